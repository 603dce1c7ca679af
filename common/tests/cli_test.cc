// kvpool/common/cli.h: the --config YAML convention (flat keys, subcommand sections, and the
// refusal of keys that name no flag: exit code kExitUsage with the key in the message), Range's
// messages and strict integers, the OutputFile() check and WriteOutputFile.
#include "kvpool/common/cli.h"

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <tuple>
#include <vector>

namespace kvpool::cli {
namespace {

std::string FreshDir(const std::string& name);

std::string WriteYaml(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/kvpool_cli_test_" + name + ".yaml";
  std::ofstream(path) << text;
  return path;
}

// What Parse returned and wrote.
struct ParseRun {
  int rc;
  std::string out, err;
};

// Runs Parse on `args` (program name prepended), capturing stdout and stderr.
ParseRun RunParseCapturing(CLI::App& app, std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (auto& a : args) {
    argv.push_back(a.data());
  }
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int rc = Parse(app, static_cast<int>(argv.size()), argv.data());
  std::string out = ::testing::internal::GetCapturedStdout();
  return {rc, std::move(out), ::testing::internal::GetCapturedStderr()};
}

// Runs Parse on `args` (program name prepended); returns its code and what it wrote to stderr.
std::pair<int, std::string> RunParse(CLI::App& app, std::vector<std::string> args) {
  ParseRun r = RunParseCapturing(app, std::move(args));
  return {r.rc, std::move(r.err)};
}

// A server-like app: top-level flags only.
struct FlatApp {
  CLI::App app{"test"};
  int metrics_port = 9090;
  std::string listen = "0.0.0.0:7070";
  FlatApp() {
    kvpool::cli::Setup(app, "prog");
    app.add_option("--metrics-port", metrics_port, "port");
    app.add_option("--listen", listen, "address");
  }
};

// An app with a checked integer, a bool option, a counting flag and, in a subcommand, a bool
// flag; and how Parse refuses a value that is not a boolean.
struct ValueApp {
  CLI::App app{"test"};
  int port = 1;
  bool teacher = true;
  bool per_head = false;
  int verbose = 0;
  ValueApp() {
    kvpool::cli::Setup(app, "prog");
    app.add_option("--metrics-port", port, "port")->check(Range(-1, 65535));
    app.add_option("--teacher-force", teacher, "bool option")->capture_default_str();
    app.add_flag("-v,--verbose", verbose, "counting flag");
    CLI::App* calib = app.add_subcommand("calibrate", "calibrate");
    calib->add_flag("--per-head", per_head, "bool flag");
  }
};
constexpr char kNotABoolean[] =
    "is not a boolean (want true or false; also accepted: yes/no, on/off, 1/0, enable/disable, "
    "t/f, y/n, any case)";

// An engine/tool-like app: subcommands (one nested two deep) with their own flags.
struct SubcommandApp {
  CLI::App app{"test"};
  std::string model;
  int max_tokens = 256;
  std::string rotation_file;
  CLI::App* gen = nullptr;
  CLI::App* inspect = nullptr;
  SubcommandApp() {
    kvpool::cli::Setup(app, "prog");
    app.require_subcommand(1);
    gen = app.add_subcommand("generate", "gen");
    gen->add_option("--model", model, "model");
    gen->add_option("--max-tokens", max_tokens, "tokens");
    CLI::App* rots = app.add_subcommand("rotations", "rotations");
    inspect = rots->add_subcommand("inspect", "inspect");
    inspect->add_option("--file", rotation_file, "file");
  }
};

// A subcommand's --help did not mention --log-level (newcomer s9b, left over): its footer names
// the program's flags and where they go, also two subcommands deep; the program's own --help
// lists them as before.
TEST(CliParseTest, SubcommandHelpNamesTheProgramFlags) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"generate", "--help"},
        std::vector<std::string>{"rotations", "inspect", "--help"}}) {
    SubcommandApp s;
    const auto [rc, out, err] = RunParseCapturing(s.app, args);
    EXPECT_EQ(rc, kExitOk) << err;
    EXPECT_NE(out.find("prog's own flags go before the subcommand: --log-level LEVEL"),
              std::string::npos)
        << out;
    const std::string path = args.size() == 2 ? " generate" : " rotations inspect";
    EXPECT_NE(out.find("(prog --log-level warn" + path + " ..."), std::string::npos) << out;
  }
}

// CLI11 checks required flags before unexpected arguments: "kvpool calibrate --version" (or
// --bogus) answered "--model is required" (newcomer s9b #8). The misplaced or unknown flag is
// named first, as when the required flags are given; with nothing else wrong, the missing one.
TEST(CliParseTest, AMisplacedOrUnknownFlagIsNamedBeforeAMissingRequiredOne) {
  struct RequiredApp {
    CLI::App app{"test"};
    std::string model;
    RequiredApp() {
      kvpool::cli::Setup(app, "prog");
      app.require_subcommand(1);
      app.add_subcommand("calibrate", "calibrate")->add_option("--model", model, "m")->required();
    }
  };
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"calibrate", "--version"},
       "prog: --version is a flag of prog itself, not of the subcommand 'calibrate': give it "
       "before the subcommand (prog --version calibrate ...)"},
      {{"calibrate", "--log-level"}, "prog: --log-level is a flag of prog itself"},
      {{"calibrate", "--bogus"}, "prog: The following argument was not expected: --bogus"},
      {{"calibrate", "--bogus", "x", "--other"},
       "prog: The following arguments were not expected: --bogus x --other"},
      {{"calibrate"}, "prog: --model is required"},
  };
  for (const auto& [args, want] : cases) {
    SCOPED_TRACE(args.back());
    RequiredApp a;
    auto [rc, err] = RunParse(a.app, args);
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find(want), std::string::npos) << err;
    if (args.size() > 1) {
      EXPECT_EQ(err.find("is required"), std::string::npos) << err;
    }
  }
}

// A top-level flag after the subcommand is named with where it goes (CLI11 said only "The
// following arguments were not expected: off --log-level": newcomer s9 A1).
TEST(CliParseTest, TopLevelFlagAfterTheSubcommandSaysWhereItGoes) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"generate", "--model", "m", "--log-level", "off"},
        std::vector<std::string>{"generate", "--log-level=off", "--model", "m"}}) {
    SubcommandApp s;
    auto [rc, err] = RunParse(s.app, args);
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("prog: --log-level is a flag of prog itself, not of the subcommand "
                       "'generate': give it before the subcommand (prog --log-level VALUE "
                       "generate ...)"),
              std::string::npos)
        << err;
  }
  {
    SubcommandApp s;  // two deep
    auto [rc, err] = RunParse(s.app, {"rotations", "inspect", "--file", "f", "--log-level", "off"});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("not of the subcommand 'inspect': give it before the subcommand (prog "
                       "--log-level VALUE rotations inspect ...)"),
              std::string::npos)
        << err;
  }
  {
    SubcommandApp s;  // before the subcommand it is read
    auto [rc, err] = RunParse(s.app, {"--log-level", "off", "generate", "--model", "m"});
    EXPECT_EQ(rc, -1) << err;
    EXPECT_EQ(s.model, "m");
    RunParse(s.app, {"--log-level", "info", "generate"});
  }
  {
    SubcommandApp s;  // other extras keep CLI11's message
    auto [rc, err] = RunParse(s.app, {"generate", "stray"});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("stray"), std::string::npos) << err;
    EXPECT_EQ(err.find("is a flag of"), std::string::npos) << err;
  }
}

// A missing relative directory from a config file says it was taken from the current
// directory, not the file's (newcomer s9 A12).
TEST(CliConfigTest, AMissingRelativeDirectoryNamesTheCurrentDirectory) {
  CLI::App app{"test"};
  kvpool::cli::Setup(app, "prog");
  std::string dir;
  app.add_option("--rotation-dir", dir, "dir")->check(CLI::ExistingDirectory);
  const std::string path = WriteYaml("reldir", "rotation-dir: kvpool-no-such-rots\n");
  auto [rc, err] = RunParse(app, {"--config", path});
  EXPECT_EQ(rc, kExitUsage);
  EXPECT_NE(err.find("key \"rotation-dir\": --rotation-dir: Directory does not exist: "
                     "kvpool-no-such-rots (relative to the current directory " +
                     std::filesystem::current_path().string() + ")"),
            std::string::npos)
      << err;
}

TEST(CliConfigTest, FlatKeysSetFlagsAndCommandLineWins) {
  FlatApp f;
  const std::string path = WriteYaml("flat", "metrics-port: -1\nlisten: 127.0.0.1:1234\n");
  auto [rc, err] = RunParse(f.app, {"--config", path, "--listen", "127.0.0.1:5678"});
  EXPECT_EQ(rc, -1) << err;
  EXPECT_EQ(f.metrics_port, -1);
  EXPECT_EQ(f.listen, "127.0.0.1:5678");
}

TEST(CliConfigTest, UnknownTopLevelKeyIsAUsageErrorNamingTheKey) {
  FlatApp f;
  const std::string path = WriteYaml("bogus", "listen: 127.0.0.1:1234\nbogus_key: 3\n");
  auto [rc, err] = RunParse(f.app, {"--config", path});
  EXPECT_EQ(rc, kExitUsage);
  EXPECT_NE(err.find("unknown key \"bogus_key\""), std::string::npos) << err;
}

TEST(CliConfigTest, DuplicateKeyIsAUsageErrorNamingTheKey) {
  FlatApp f;
  const std::string path = WriteYaml("dup", "listen: 127.0.0.1:1234\nlisten: 127.0.0.1:9999\n");
  auto [rc, err] = RunParse(f.app, {"--config", path});
  EXPECT_EQ(rc, kExitUsage);
  EXPECT_NE(err.find("sets \"listen\" more than once"), std::string::npos) << err;
}

// Errors about the config file's content name the file (several binaries may share a set-up).
TEST(CliConfigTest, ContentErrorsNameTheFile) {
  {
    FlatApp f;
    const std::string path = WriteYaml("named-bogus", "bogus_key: 3\n");
    auto [rc, err] = RunParse(f.app, {"--config", path});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("prog: --config '" + path + "': unknown key \"bogus_key\""),
              std::string::npos)
        << err;
  }
  {
    FlatApp f;
    const std::string path = WriteYaml("named-bad", "listen: [1, \n  bad: : yaml: [\n");
    auto [rc, err] = RunParse(f.app, {"--config", path});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("prog: --config '" + path + "' is not valid YAML: "), std::string::npos)
        << err;
  }
  {
    FlatApp f;
    const std::string path = WriteYaml("named-list", "- a\n- b\n");
    auto [rc, err] = RunParse(f.app, {"--config", path});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("prog: --config '" + path + "' must be a YAML map"), std::string::npos)
        << err;
  }
}

// Errors about a value the config file gave name the file and the key; they read as if the
// command line had given the value (newcomer s8 N9: "metrics-port: abc" in a YAML file said
// "--metrics-port: 'abc' is not an integer"). A boolean that is none lists the accepted values
// instead of CLI11's "Could not convert: --per-head = yes please", from either source.
TEST(CliConfigTest, ValueErrorsFromTheFileNameTheFileAndTheKey) {
  const std::string want_bool = kNotABoolean;
  {
    ValueApp a;
    const std::string path = WriteYaml("value-int", "metrics-port: abc\n");
    auto [rc, err] = RunParse(a.app, {"--config", path});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("prog: --config '" + path +
                       "' key \"metrics-port\": --metrics-port: 'abc' is not an integer (want "
                       "-1..65535)"),
              std::string::npos)
        << err;
  }
  {
    ValueApp a;  // the command line wins: its value is the one refused, and the file is not named
    const std::string path = WriteYaml("value-int-cl", "metrics-port: abc\n");
    auto [rc, err] = RunParse(a.app, {"--config", path, "--metrics-port=xyz"});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("prog: --metrics-port: 'xyz' is not an integer"), std::string::npos) << err;
    EXPECT_EQ(err.find("--config"), std::string::npos) << err;
  }
  {
    ValueApp a;
    const std::string path = WriteYaml("value-bool", "teacher-force: maybe\n");
    auto [rc, err] = RunParse(a.app, {"--config", path});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("prog: --config '" + path +
                       "' key \"teacher-force\": --teacher-force: "
                       "'maybe' " +
                       want_bool),
              std::string::npos)
        << err;
  }
  {
    ValueApp a;
    auto [rc, err] = RunParse(a.app, {"--teacher-force", "maybe"});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("prog: --teacher-force: 'maybe' " + want_bool), std::string::npos) << err;
    EXPECT_EQ(err.find("Could not convert"), std::string::npos) << err;
  }
  {
    ValueApp a;
    const std::string path = WriteYaml("value-flag", "calibrate:\n  per-head: yes please\n");
    auto [rc, err] = RunParse(a.app, {"--config", path, "calibrate"});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("prog: --config '" + path +
                       "' key \"calibrate.per-head\": --per-head: "
                       "'yes please' " +
                       want_bool),
              std::string::npos)
        << err;
  }
  {
    ValueApp a;  // an empty string is no boolean either (it read as true: newcomer s9b)
    const std::string path = WriteYaml("value-empty", "calibrate:\n  per-head: \"\"\n");
    auto [rc, err] = RunParse(a.app, {"--config", path, "calibrate"});
    EXPECT_EQ(rc, kExitUsage) << err;
    EXPECT_NE(err.find("key \"calibrate.per-head\" is empty (\"\"); --per-head is a flag"),
              std::string::npos)
        << err;
    EXPECT_FALSE(a.per_head);
  }
  {
    ValueApp a;  // accepted spellings still work
    const std::string path =
        WriteYaml("value-ok", "teacher-force: no\ncalibrate:\n  per-head: on\n");
    auto [rc, err] = RunParse(a.app, {"--config", path, "calibrate"});
    EXPECT_EQ(rc, -1) << err;
    EXPECT_FALSE(a.teacher);
    EXPECT_TRUE(a.per_head);
  }
}

// --version wins over a bad value in the --config file as it does over a bad command-line value
// (newcomer 16b F5: the file's error was printed, exit 2).
TEST(CliConfigTest, VersionWinsOverABadValueInTheFile) {
  const std::string path = WriteYaml("version-bad-value", "metrics-port: abc\n");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--config", path, "--version"},
        std::vector<std::string>{"--version", "--config", path},
        std::vector<std::string>{"--version", "--metrics-port", "abc"}}) {
    ValueApp a;
    const auto [rc, out, err] = RunParseCapturing(a.app, args);
    EXPECT_EQ(rc, kExitOk) << args[0] << " " << err;
    EXPECT_EQ(out, "prog " + kvpool::cli::VersionString() + "\n") << args[0];
    EXPECT_EQ(err, "") << args[0];
  }
}

// CLI11 reads booleans with to_flag_value, which takes any integer and "+"/"-": "--teacher-force
// 2" ran with it on and "-1" with it off although the refusal of "maybe" lists the accepted words
// (newcomer s8b F1). Only those words pass now, for an option of type bool and for a flag, on
// the command line and from the config file, in a subcommand too, with the same message; a
// counting flag still counts.
TEST(CliConfigTest, IntegersAndSignsAreNotBooleans) {
  const std::string want_bool = kNotABoolean;
  for (const std::string value : {"2", "-1", "10", "+", "-", "", "01", "truee"}) {
    SCOPED_TRACE(value);
    {
      ValueApp a;
      auto [rc, err] = RunParse(a.app, {"--teacher-force", value});
      EXPECT_EQ(rc, kExitUsage) << err;
      EXPECT_NE(err.find("prog: --teacher-force: '" + value + "' " + want_bool), std::string::npos)
          << err;
    }
    // "--per-head=" is the flag alone (CLI11), and "key: " in YAML has no value (another message).
    if (value.empty()) continue;
    {
      ValueApp a;
      auto [rc, err] = RunParse(a.app, {"calibrate", "--per-head=" + value});
      EXPECT_EQ(rc, kExitUsage) << err;
      EXPECT_NE(err.find("prog: --per-head: '" + value + "' " + want_bool), std::string::npos)
          << err;
    }
    // From the file: the option, and the flag in its subcommand's section.
    for (const auto& [key, yaml, flag] :
         std::vector<std::tuple<std::string, std::string, std::string>>{
             {"teacher-force", "teacher-force: \"" + value + "\"\n", "--teacher-force"},
             {"calibrate.per-head", "calibrate:\n  per-head: \"" + value + "\"\n", "--per-head"}}) {
      ValueApp a;
      const std::string path = WriteYaml("bool-int", yaml);
      auto [rc, err] = RunParse(a.app, {"--config", path, "calibrate"});
      EXPECT_EQ(rc, kExitUsage) << err;
      EXPECT_NE(err.find("prog: --config '" + path + "' key \"" + key + "\": " + flag + ": '" +
                         value + "' " + want_bool),
                std::string::npos)
          << err;
    }
  }
  // Every listed word, in any case, still reads as its value; the flag alone is true; the
  // counting flag counts and the default of an option not given stays.
  for (const auto& [word, want] : std::vector<std::pair<std::string, bool>>{{"true", true},
                                                                            {"FALSE", false},
                                                                            {"Yes", true},
                                                                            {"no", false},
                                                                            {"ON", true},
                                                                            {"off", false},
                                                                            {"1", true},
                                                                            {"0", false},
                                                                            {"enable", true},
                                                                            {"Disable", false},
                                                                            {"T", true},
                                                                            {"f", false},
                                                                            {"y", true},
                                                                            {"N", false}}) {
    SCOPED_TRACE(word);
    ValueApp a;
    auto [rc, err] = RunParse(a.app, {"--teacher-force", word, "calibrate", "--per-head=" + word});
    EXPECT_EQ(rc, -1) << err;
    EXPECT_EQ(a.teacher, want);
    EXPECT_EQ(a.per_head, want);
  }
  {
    ValueApp a;
    auto [rc, err] = RunParse(a.app, {"-vv", "--verbose", "calibrate", "--per-head"});
    EXPECT_EQ(rc, -1) << err;
    EXPECT_EQ(a.verbose, 3);
    EXPECT_TRUE(a.per_head);
    EXPECT_TRUE(a.teacher);
  }
}

// A second YAML document was silently ignored (newcomer report s6 #8): refused, naming the file.
TEST(CliConfigTest, MultiDocumentYamlIsRefusedNamingTheFile) {
  FlatApp f;
  const std::string path =
      WriteYaml("multidoc", "---\nlisten: 127.0.0.1:0\n---\nlisten: 1.2.3.4:5\n");
  auto [rc, err] = RunParse(f.app, {"--config", path});
  EXPECT_EQ(rc, kExitUsage) << err;
  EXPECT_NE(err.find("prog: --config '" + path + "' holds 2 YAML documents"), std::string::npos)
      << err;
  // One document, with or without its "---", still reads.
  FlatApp g;
  const std::string one = WriteYaml("onedoc", "---\nlisten: 127.0.0.1:1\n");
  auto [rc1, err1] = RunParse(g.app, {"--config", one});
  EXPECT_EQ(rc1, -1) << err1;
  EXPECT_EQ(g.listen, "127.0.0.1:1");
  // A trailing "---" (an empty document) is not a second document (re-tester s6).
  FlatApp h;
  const std::string trailing = WriteYaml("trailing", "listen: 127.0.0.1:2\n---\n");
  auto [rc2, err2] = RunParse(h.app, {"--config", trailing});
  EXPECT_EQ(rc2, -1) << err2;
  EXPECT_EQ(h.listen, "127.0.0.1:2");
}

// A flag given twice: CLI11 said only "--listen: At Most 1 required but received 2".
TEST(CliConfigTest, AFlagGivenTwiceSaysSo) {
  FlatApp f;
  auto [rc, err] = RunParse(f.app, {"--listen", "a:1", "--listen", "b:2"});
  EXPECT_EQ(rc, kExitUsage) << err;
  EXPECT_NE(err.find("prog: --listen is given 2 times; give it once"), std::string::npos) << err;
}

// A YAML list or an empty value for a flag that takes one value was worded about the command line
// ("--listen is given 2 times; give it once") or in CLI11's terms ("At least 1 required but
// received 0") (newcomer s7 F6): the message names the key, the file and what is wrong.
TEST(CliConfigTest, AListOrNoValueWhereOneValueIsExpectedNamesTheKeyAndTheFile) {
  struct Case {
    std::string yaml, want;
  };
  const std::vector<Case> cases = {
      {"listen: [a:1, b:2]\n",
       "key \"listen\" is a list (2 items); --listen takes one value: write \"listen: VALUE\""},
      {"listen: [a:1]\n", "key \"listen\" is a list (1 item); --listen takes one value"},
      {"metrics-port:\n",
       "key \"metrics-port\" has no value; --metrics-port takes one value: write "
       "\"metrics-port: VALUE\", or remove the key to keep the default"},
      {"listen: {a: 1}\n", "key \"listen\" is a map; --listen takes one value"},
      {"verbose:\n",
       "key \"verbose\" has no value; --verbose is a flag: write \"verbose: true\" or "
       "\"verbose: false\""},
      {"verbose: [true, false]\n", "key \"verbose\" is a list (2 items); --verbose is a flag"},
      // An empty string read as true (newcomer s9b).
      {"verbose: \"\"\n",
       "key \"verbose\" is empty (\"\"); --verbose is a flag: write \"verbose: true\" or "
       "\"verbose: false\""},
      {"verbose: ''\n", "key \"verbose\" is empty (\"\"); --verbose is a flag"},
      {"file:\n", "key \"file\" has no value; --file takes a value or a list of values"},
      {"file: []\n", "key \"file\" is an empty list; --file takes a value or a list of values"},
      {"file: [a, [b]]\n", "key \"file\": item 2 is a list; --file takes"},
      {"file: [a, ~]\n", "key \"file\": item 2 is empty; --file takes"},
  };
  for (const Case& c : cases) {
    FlatApp f;
    bool verbose = false;
    std::vector<std::string> files;
    f.app.add_flag("--verbose", verbose, "a flag");
    f.app.add_option("--file", files, "repeatable");
    const std::string path = WriteYaml("one_value", c.yaml);
    auto [rc, err] = RunParse(f.app, {"--config", path});
    EXPECT_EQ(rc, kExitUsage) << c.yaml << err;
    EXPECT_NE(err.find("prog: --config '" + path + "' " + c.want), std::string::npos)
        << c.yaml << err;
  }
  // A required option has no default to keep (newcomer 18 F6: "prompt-file: []").
  for (const Case& c : std::vector<Case>{
           {"need: []\n",
            "key \"need\" is an empty list; --need takes a value or a list of values (it is "
            "required: there is no default)"},
           {"need:\n",
            "key \"need\" has no value; --need takes a value or a list of values (it "
            "is required: there is no default)"}}) {
    FlatApp f;
    std::vector<std::string> need;
    f.app.add_option("--need", need, "required")->required();
    const std::string path = WriteYaml("required_empty", c.yaml);
    auto [rc, err] = RunParse(f.app, {"--config", path});
    EXPECT_EQ(rc, kExitUsage) << c.yaml << err;
    EXPECT_NE(err.find("prog: --config '" + path + "' " + c.want), std::string::npos)
        << c.yaml << err;
  }
  // Inside a subcommand's section the key carries the section.
  for (const Case& c : std::vector<Case>{
           {"generate: {model: [a, b]}\n",
            "key \"generate.model\" is a list (2 items); --model takes one value"},
           {"generate:\n  max-tokens:\n",
            "key \"generate.max-tokens\" has no value; --max-tokens takes one value"}}) {
    SubcommandApp s;
    const std::string path = WriteYaml("one_value_section", c.yaml);
    auto [rc, err] = RunParse(s.app, {"--config", path, "generate"});
    EXPECT_EQ(rc, kExitUsage) << c.yaml << err;
    EXPECT_NE(err.find("prog: --config '" + path + "' " + c.want), std::string::npos)
        << c.yaml << err;
  }
  // A key that is a list, and a nested list for a repeatable flag, threw yaml-cpp's exception
  // past Parse (SIGABRT).
  {
    FlatApp f;
    const std::string path = WriteYaml("list_key", "[a]: 1\n");
    auto [rc, err] = RunParse(f.app, {"--config", path});
    EXPECT_EQ(rc, kExitUsage) << err;
    EXPECT_NE(err.find("prog: --config '" + path + "' is not a map of flag names to values: "),
              std::string::npos)
        << err;
  }
  // What is allowed still reads: a list for a repeatable option, a flag's value.
  FlatApp ok;
  bool verbose = false;
  std::vector<std::string> files;
  ok.app.add_flag("--verbose", verbose, "a flag");
  ok.app.add_option("--file", files, "repeatable");
  const std::string path = WriteYaml("one_value_ok", "file: [a, b]\nverbose: true\nlisten: x:1\n");
  auto [rc, err] = RunParse(ok.app, {"--config", path});
  EXPECT_EQ(rc, -1) << err;
  EXPECT_EQ(files, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(verbose);
  EXPECT_EQ(ok.listen, "x:1");
}

// The file itself is checked before CLI11 reads it: a directory used to read as "not readable
// (missing?)", a FIFO blocked and /dev/zero was read without end.
TEST(CliConfigTest, DirectoriesDevicesFifosMissingAndHugeFilesAreRefused) {
  const std::string dir = FreshDir("config");
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  const std::string big = dir + "/big.yaml";
  std::ofstream(big).close();
  std::filesystem::resize_file(big, uint64_t{2} << 20);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dir, "--config: '" + dir + "' is a directory; name a file"},
      {dir + "/fifo", "--config: '" + dir + "/fifo' is a FIFO, not a regular file"},
      {"/dev/zero", "--config: '/dev/zero' is a character device, not a regular file"},
      {dir + "/missing.yaml", "--config: '" + dir + "/missing.yaml' does not exist"},
      {big, "--config: '" + big + "' is 2 MiB (2097152 bytes), above the limit of 1 MiB"},
  };
  for (const auto& [path, want] : cases) {
    FlatApp f;
    auto [rc, err] = RunParse(f.app, {"--config", path});
    EXPECT_EQ(rc, kExitUsage) << path;
    EXPECT_NE(err.find(want), std::string::npos) << err;
  }
}

TEST(CliConfigTest, UnderscoreSpellingOfAFlagIsRefused) {
  FlatApp f;
  const std::string path = WriteYaml("underscore", "metrics_port: -1\n");
  auto [rc, err] = RunParse(f.app, {"--config", path});
  EXPECT_EQ(rc, kExitUsage);
  EXPECT_NE(err.find("metrics_port"), std::string::npos) << err;
  EXPECT_EQ(f.metrics_port, 9090);
}

TEST(CliConfigTest, SubcommandSectionsSetTheSubcommandsFlags) {
  SubcommandApp s;
  const std::string path =
      WriteYaml("nested", "log-level: warn\ngenerate: {model: m.gguf, max-tokens: 64}\n");
  auto [rc, err] = RunParse(s.app, {"--config", path, "generate", "--max-tokens", "8"});
  EXPECT_EQ(rc, -1) << err;
  EXPECT_TRUE(s.gen->parsed());
  EXPECT_EQ(s.model, "m.gguf");
  EXPECT_EQ(s.max_tokens, 8);  // the command line wins
}

TEST(CliConfigTest, TwoLevelSubcommandSection) {
  SubcommandApp s;
  const std::string path =
      WriteYaml("nested2", "rotations:\n  inspect:\n    file: r.safetensors\n");
  auto [rc, err] = RunParse(s.app, {"--config", path, "rotations", "inspect"});
  EXPECT_EQ(rc, -1) << err;
  EXPECT_EQ(s.rotation_file, "r.safetensors");
}

TEST(CliConfigTest, UnknownKeyInsideASubcommandSectionIsRefused) {
  SubcommandApp s;
  const std::string path = WriteYaml("nested_bad", "generate: {model: m.gguf, bogus: 1}\n");
  auto [rc, err] = RunParse(s.app, {"--config", path, "generate"});
  EXPECT_EQ(rc, kExitUsage);
  EXPECT_NE(err.find("unknown key \"generate.bogus\""), std::string::npos) << err;
}

// A `config:` key names another config file, which is never read: refused naming the key (with
// its section) and the file, at the top and inside a subcommand's section (re-tester s6: inside a
// section the kvpool tool said its --config "is not read after the subcommand", about a command
// line that had none).
TEST(CliConfigTest, AConfigKeyInTheFileIsRefusedNamingTheKeyAndTheFile) {
  for (const std::string& text :
       {std::string("config: other.yaml\n"), std::string("generate: {config: other.yaml}\n"),
        std::string("rotations:\n  inspect:\n    config: other.yaml\n")}) {
    SCOPED_TRACE(text);
    SubcommandApp s;
    s.gen->add_option_function<std::string>(
        "--config", [](const std::string&) { throw CLI::ValidationError("--config", "misled"); },
        "refused after the subcommand");
    const std::string path = WriteYaml("config_key", text);
    auto [rc, err] = RunParse(s.app, {"--config", path, "generate"});
    EXPECT_EQ(rc, kExitUsage);
    const std::string key = text.rfind("generate", 0) == 0    ? "generate.config"
                            : text.rfind("rotations", 0) == 0 ? "rotations.inspect.config"
                                                              : "config";
    EXPECT_NE(err.find("prog: --config '" + path + "' sets \"" + key +
                       "\": a config file cannot name another config file"),
              std::string::npos)
        << err;
    EXPECT_EQ(err.find("misled"), std::string::npos) << err;
  }
}

TEST(CliConfigTest, UnknownSectionIsRefused) {
  SubcommandApp s;
  const std::string path = WriteYaml("section_bad", "genrate: {model: m.gguf}\n");
  auto [rc, err] = RunParse(s.app, {"--config", path, "generate"});
  EXPECT_EQ(rc, kExitUsage);
  EXPECT_NE(err.find("genrate.model"), std::string::npos) << err;
}

TEST(CliConfigTest, SubcommandFlagAtTopLevelIsRefused) {
  // "model:" belongs in the generate section; at the top it names no flag of the root.
  SubcommandApp s;
  const std::string path = WriteYaml("misplaced", "model: m.gguf\n");
  auto [rc, err] = RunParse(s.app, {"--config", path, "generate"});
  EXPECT_EQ(rc, kExitUsage);
  EXPECT_NE(err.find("unknown key \"model\""), std::string::npos) << err;
  EXPECT_EQ(s.model, "");
}

}  // namespace
}  // namespace kvpool::cli

namespace kvpool::cli {
namespace {

// kvpool::cli::Range tells a value of the wrong type apart from one out of range, from the
// command line and from --config alike.
TEST(CliRangeTest, WrongTypeAndOutOfRangeHaveTheirOwnMessages) {
  struct Case {
    std::vector<std::string> args;
    std::string want;
  };
  const std::string yaml = WriteYaml("range_type", "port: abc\n");
  const std::vector<Case> cases = {
      {{"--port", "abc"}, "--port: 'abc' is not an integer (want -1..65535)"},
      {{"--port", "1.5"}, "--port: '1.5' is not an integer (want -1..65535)"},
      {{"--port", "70000"}, "--port: 70000 is outside -1..65535"},
      {{"--ratio", "x"}, "--ratio: 'x' is not a number (want 0..1)"},
      {{"--ratio", "nan"}, "--ratio: nan is outside 0..1"},
      {{"--ratio", "1.5"}, "--ratio: 1.5 is outside 0..1"},
      {{"--config", yaml}, "--port: 'abc' is not an integer (want -1..65535)"},
  };
  for (const Case& c : cases) {
    CLI::App app{"test"};
    kvpool::cli::Setup(app, "prog");
    int port = 0;
    double ratio = 0.5;
    app.add_option("--port", port, "port")->check(Range(-1, 65535));
    app.add_option("--ratio", ratio, "ratio")->check(Range(0.0, 1.0));
    auto [rc, err] = RunParse(app, c.args);
    EXPECT_EQ(rc, kExitUsage) << c.args[1];
    EXPECT_NE(err.find(c.want), std::string::npos) << c.args[1] << ": " << err;
  }
  CLI::App app{"test"};
  kvpool::cli::Setup(app, "prog");
  int port = 0;
  app.add_option("--port", port, "port")->check(Range(-1, 65535));
  auto [rc, err] = RunParse(app, {"--port", "-1"});
  EXPECT_EQ(rc, -1) << err;
  EXPECT_EQ(port, -1);
}

}  // namespace
}  // namespace kvpool::cli

namespace kvpool::cli {
namespace {

// Range reads integers as plain decimal: CLI11's own conversion would take "-1" for an unsigned
// flag as 2^64-1, clamp a value beyond the type to its maximum, and read "010" as octal.
TEST(CliRangeTest, IntegersArePlainDecimalAndBeyondTheTypeIsOutside) {
  struct Case {
    std::string value;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"-1", "--seed: -1 is outside 0..18446744073709551615"},
      {"18446744073709551616", "--seed: 18446744073709551616 is outside 0..18446744073709551615"},
      {"99999999999999999999999", "is outside 0..18446744073709551615"},
      {"0x10", "--seed: '0x10' is not an integer"},
      {"010", "--seed: '010' is not a decimal integer (leading zero"},
      {" 4", "--seed: ' 4' is not an integer"},
      {"4 ", "--seed: '4 ' is not an integer"},
      {"+4", "--seed: '+4' is not an integer"},
      {"", "--seed: '' is not an integer"},
      {"-0", "--seed: '-0' is not a plain decimal integer (write 0; want 0..18446744073709551615)"},
  };
  for (const Case& c : cases) {
    CLI::App app{"test"};
    kvpool::cli::Setup(app, "prog");
    uint64_t seed = 7;
    app.add_option("--seed", seed, "seed")->check(Range(uint64_t{0}, UINT64_MAX));
    auto [rc, err] = RunParse(app, {"--seed", c.value});
    EXPECT_EQ(rc, kExitUsage) << "'" << c.value << "'";
    EXPECT_NE(err.find(c.want), std::string::npos) << "'" << c.value << "': " << err;
    EXPECT_EQ(seed, 7u);
  }
  for (const std::string ok : {"0", "18446744073709551615", "42"}) {
    CLI::App app{"test"};
    kvpool::cli::Setup(app, "prog");
    uint64_t seed = 7;
    app.add_option("--seed", seed, "seed")->check(Range(uint64_t{0}, UINT64_MAX));
    auto [rc, err] = RunParse(app, {"--seed", ok});
    EXPECT_EQ(rc, -1) << ok << ": " << err;
    EXPECT_EQ(std::to_string(seed), ok);
  }
  // A signed value beyond int64 is outside too (CLI11 would clamp it to INT64_MIN).
  CLI::App app{"test"};
  kvpool::cli::Setup(app, "prog");
  int64_t tokens = 0;
  app.add_option("--tokens", tokens, "tokens")->check(Range(int64_t{0}, int64_t{INT32_MAX}));
  auto [rc, err] = RunParse(app, {"--tokens", "-99999999999999999999"});
  EXPECT_EQ(rc, kExitUsage);
  EXPECT_NE(err.find("--tokens: -99999999999999999999 is outside 0..2147483647"), std::string::npos)
      << err;
  // "-0" is refused by signed options as by unsigned ones (newcomer 16b F6: accepted as 0 by a
  // signed flag, "-0 is outside 0..N" for an unsigned one).
  for (const bool ranged : {true, false}) {
    CLI::App signed_app{"test"};
    kvpool::cli::Setup(signed_app, "prog");
    int port = 5;
    CLI::Option* op = signed_app.add_option("--port", port, "port");
    if (ranged) op->check(Range(-1, 65535));
    auto [zrc, zerr] = RunParse(signed_app, {"--port", "-0"});
    EXPECT_EQ(zrc, kExitUsage) << ranged;
    EXPECT_NE(zerr.find("--port: '-0' is not a plain decimal integer (write 0"), std::string::npos)
        << ranged << ": " << zerr;
    EXPECT_EQ(port, 5);
  }
}

// Parse checks every integer option, also one without a Range, as plain decimal: CLI11 alone
// read "0100" as octal 64 and took "0x10", "+16" and " 16" (newcomer 16 F2: kvpool-worker
// --recent-tokens 0100 registered W=64), on the command line and from --config.
struct UncheckedIntegerApp {
  CLI::App app{"test"};
  int page = 16;
  uint32_t count = 3;
  int64_t big = 5;
  size_t bytes = 7;
  std::vector<int> sizes{1};
  int verbose = 0;
  UncheckedIntegerApp() {
    kvpool::cli::Setup(app, "prog");
    app.add_option("--page-size", page, "no Range");
    app.add_option("--count", count, "no Range");
    app.add_option("--big", big, "no Range");
    app.add_option("--bytes", bytes, "no Range");
    app.add_option("--sizes", sizes, "no Range")->delimiter(',');
    app.add_flag("-v,--verbose", verbose, "counting flag");
    CLI::App* sub = app.add_subcommand("gen", "subcommand");
    sub->add_option("--seed", count, "no Range");
  }
};

TEST(CliDecimalIntegerTest, EveryIntegerOptionIsPlainDecimal) {
  struct Case {
    std::vector<std::string> args;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{"--page-size", "0100"}, "--page-size: '0100' is not a decimal integer (leading zero)"},
      {{"--page-size", "016"}, "--page-size: '016' is not a decimal integer (leading zero)"},
      {{"--page-size", "0x10"}, "--page-size: '0x10' is not an integer"},
      {{"--page-size", "+16"}, "--page-size: '+16' is not an integer"},
      {{"--page-size", " 16"}, "--page-size: ' 16' is not an integer"},
      {{"--page-size", "16 "}, "--page-size: '16 ' is not an integer"},
      {{"--page-size", "1e2"}, "--page-size: '1e2' is not an integer"},
      {{"--count", "0200"}, "--count: '0200' is not a decimal integer (leading zero)"},
      {{"--count", "-1"}, "--count: -1 is negative"},
      {{"--big", "0x10"}, "--big: '0x10' is not an integer"},
      {{"--bytes", "+4"}, "--bytes: '+4' is not an integer"},
      {{"--sizes", "16,0100"}, "--sizes: '0100' is not a decimal integer (leading zero)"},
      {{"gen", "--seed", "064"}, "--seed: '064' is not a decimal integer (leading zero)"},
      {{"--config", WriteYaml("dec_plain", "page-size: 0100\n")},
       "key \"page-size\": --page-size: '0100' is not a decimal integer (leading zero)"},
      {{"--config", WriteYaml("dec_quoted", "page-size: \"0100\"\n")},
       "key \"page-size\": --page-size: '0100' is not a decimal integer (leading zero)"},
      {{"--config", WriteYaml("dec_hex", "count: 0x10\n")},
       "key \"count\": --count: '0x10' is not an integer"},
      {{"--config", WriteYaml("dec_sub", "gen:\n  seed: +16\n")},
       "--seed: '+16' is not an integer"},
  };
  for (const Case& c : cases) {
    UncheckedIntegerApp a;
    auto [rc, err] = RunParse(a.app, c.args);
    EXPECT_EQ(rc, kExitUsage) << c.args.back();
    EXPECT_NE(err.find(c.want), std::string::npos) << c.args.back() << ": " << err;
    EXPECT_EQ(a.page, 16);
    EXPECT_EQ(a.count, 3u);
  }
  {
    UncheckedIntegerApp a;
    auto [rc, err] = RunParse(a.app, {"--page-size", "-16", "--count", "0", "--big", "100",
                                      "--bytes", "0", "--sizes", "16,64", "-vvv"});
    EXPECT_EQ(rc, -1) << err;
    EXPECT_EQ(a.page, -16);
    EXPECT_EQ(a.count, 0u);
    EXPECT_EQ(a.big, 100);
    EXPECT_EQ(a.sizes, (std::vector<int>{16, 64}));
    EXPECT_EQ(a.verbose, 3);
  }
  {
    // --help still wins over the bad value; the help shows the plain type.
    UncheckedIntegerApp a;
    const auto [rc, help, err] = RunParseCapturing(a.app, {"--page-size", "0100", "--help"});
    EXPECT_EQ(rc, kExitOk) << err;
    EXPECT_NE(help.find("--page-size INT"), std::string::npos) << help;
    EXPECT_EQ(help.find("INT:"), std::string::npos) << help;
  }
  {
    // With a Range, Range's message (with the bounds) is the one given.
    CLI::App app{"test"};
    kvpool::cli::Setup(app, "prog");
    int page = 16;
    app.add_option("--page-size", page, "ranged")->check(Range(1, 1024));
    auto [rc, err] = RunParse(app, {"--page-size", "0100"});
    EXPECT_EQ(rc, kExitUsage);
    EXPECT_NE(err.find("--page-size: '0100' is not a decimal integer (leading zero; want 1..1024)"),
              std::string::npos)
        << err;
  }
}

TEST(CliRangeTest, FloatingPointValuesWithSpacesAreRefused) {
  for (const char* bad : {" 0.5", "0.5 "}) {
    CLI::App app{"test"};
    kvpool::cli::Setup(app, "prog");
    double ratio = 0;
    app.add_option("--ratio", ratio, "ratio")->check(Range(0.0, 1.0));
    auto [rc, err] = RunParse(app, {"--ratio", bad});
    EXPECT_EQ(rc, kExitUsage) << "'" << bad << "'";
    EXPECT_NE(err.find("is not a number"), std::string::npos) << err;
  }
}

// A fresh directory under the test's temporary directory.
std::string FreshDir(const std::string& name) {
  const std::string dir = (std::filesystem::path(::testing::TempDir()) / ("kvpool_cli_out_" + name))
                              .lexically_normal()
                              .string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs OutputFile() on `path`; returns its message ("" = accepted).
std::string CheckOutput(std::string path) {
  std::string p = path;
  return OutputFile()(p);
}

TEST(CliOutputFileTest, RefusesWhatIsNotARegularFileUpFront) {
  const std::string dir = FreshDir("refuse");
  EXPECT_EQ(CheckOutput(""), "empty path; name a file");
  EXPECT_EQ(CheckOutput(dir), "'" + dir + "' is a directory; name a file");
  // /dev/null is a character device: a writer would rename a regular file over it (as root) or
  // write into it.
  EXPECT_EQ(CheckOutput("/dev/null"), "'/dev/null' is a character device, not a regular file");
  std::filesystem::create_symlink("/dev/null", dir + "/null-link");
  EXPECT_EQ(CheckOutput(dir + "/null-link"),
            "'" + dir + "/null-link' links to '/dev/null', a character device, not a regular file");
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  EXPECT_EQ(CheckOutput(dir + "/fifo"), "'" + dir + "/fifo' is a FIFO, not a regular file");
  std::filesystem::create_symlink(dir, dir + "/dir-link");
  EXPECT_EQ(CheckOutput(dir + "/dir-link"),
            "'" + dir + "/dir-link' links to '" + dir + "', a directory; name a file");
  std::filesystem::create_symlink("loop-b", dir + "/loop-a");
  std::filesystem::create_symlink("loop-a", dir + "/loop-b");
  EXPECT_EQ(CheckOutput(dir + "/loop-a"),
            "'" + dir + "/loop-a': too many levels of symbolic links");
  EXPECT_EQ(CheckOutput(dir + "/no/such/r.json"),
            "directory '" + dir + "/no/such' of '" + dir + "/no/such/r.json' does not exist");
}

TEST(CliOutputFileTest, ProvesTheDirectoryTakesANewFile) {
  // /proc refuses new files for every user, root included.
  const std::string msg = CheckOutput("/proc/r.json");
  EXPECT_EQ(msg.rfind("cannot create a file in directory '/proc' of '/proc/r.json': ", 0), 0u)
      << msg;
  const std::string dir = FreshDir("probe");
  EXPECT_EQ(CheckOutput(dir + "/r.json"), "");
  EXPECT_EQ(CheckOutput("relative-name.json"), "");
  // The probe leaves nothing behind.
  EXPECT_TRUE(std::filesystem::is_empty(dir));
}

TEST(CliOutputFileTest, WritesAtomicallyThroughASymlink) {
  const std::string dir = FreshDir("write");
  std::filesystem::create_directories(dir + "/real");
  { std::ofstream(dir + "/real/target.bin") << "old"; }
  ::chmod((dir + "/real/target.bin").c_str(), 0640);
  // A relative link in another directory: the target is resolved against the link's directory.
  std::filesystem::create_symlink("real/target.bin", dir + "/link.bin");
  EXPECT_EQ(CheckOutput(dir + "/link.bin"), "");
  EXPECT_EQ(OutputTarget(dir + "/link.bin"), dir + "/real/target.bin");
  ASSERT_TRUE(WriteOutputFile(dir + "/link.bin", "new bytes").ok());
  EXPECT_TRUE(std::filesystem::is_symlink(dir + "/link.bin"));
  EXPECT_EQ(ReadAll(dir + "/real/target.bin"), "new bytes");
  EXPECT_EQ(std::filesystem::status(dir + "/real/target.bin").permissions(),
            static_cast<std::filesystem::perms>(0640));
  // No temporary file is left in either directory.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir + "/real"), {}), 1);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 2);  // real, link.bin
  // A plain new file.
  ASSERT_TRUE(WriteOutputFile(dir + "/plain.json", "{}\n").ok());
  EXPECT_EQ(ReadAll(dir + "/plain.json"), "{}\n");
  EXPECT_TRUE(
      std::filesystem::is_regular_file(std::filesystem::symlink_status(dir + "/plain.json")));
  // An unwritable directory: INTERNAL naming the file and the reason.
  const absl::Status s = WriteOutputFile("/proc/r.json", "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("'/proc/r.json'"), std::string::npos) << s;
}

// An app with two inputs (one repeatable, one with keywords) and two outputs checked by
// RefuseSameFiles, like `kvpool calibrate` / kvpool-worker.
struct SameFilesApp {
  CLI::App app{"test"};
  std::string model, out, report, rotation = "none";
  std::vector<std::string> prompts;
  SameFilesApp() {
    kvpool::cli::Setup(app, "prog");
    CLI::Option* m = app.add_option("--model", model, "input");
    CLI::Option* r = app.add_option("--rotation", rotation, "input or a keyword");
    CLI::Option* p = app.add_option("--prompt-file", prompts, "repeatable input");
    CLI::Option* o = app.add_option("--out", out, "output");
    CLI::Option* j = app.add_option("--report", report, "output");
    RefuseSameFiles(&app, {{o}, {j}}, {{m}, {r, {"none"}}, {p}});
  }
};

// `kvpool calibrate --out` equal to --model turned the model into a rotation file (newcomer s7
// F7): an output that is an input, the config file or another output is refused at parse time,
// naming both flags, whatever path reaches the same file.
TEST(CliRefuseSameFilesTest, AnOutputThatIsAnInputOrAnotherOutputIsRefusedNamingBothFlags) {
  const std::string dir = FreshDir("same");
  { std::ofstream(dir + "/m.gguf") << "model"; }
  { std::ofstream(dir + "/p1.txt") << "one"; }
  { std::ofstream(dir + "/p2.txt") << "two"; }
  std::filesystem::create_directories(dir + "/sub");
  std::filesystem::create_symlink(dir + "/m.gguf", dir + "/m-link.gguf");
  std::filesystem::create_hard_link(dir + "/p2.txt", dir + "/p2-hard.txt");
  const std::string cfg = WriteYaml("same_files", "model: " + dir + "/m.gguf\n");
  struct Case {
    std::vector<std::string> args;
    std::string want;
  };
  const std::vector<Case> refused = {
      {{"--model", dir + "/m.gguf", "--out", dir + "/m.gguf"},
       "prog: --out: '" + dir + "/m.gguf' is the same file as --model '" + dir +
           "/m.gguf'; writing it would replace that input: name another file"},
      // Another spelling of the path, a symbolic link, a hard link.
      {{"--model", dir + "/m.gguf", "--out", dir + "/sub/../m.gguf"},
       "--out: '" + dir + "/sub/../m.gguf' is the same file as --model"},
      {{"--model", dir + "/m.gguf", "--out", dir + "/m-link.gguf"},
       "--out: '" + dir + "/m-link.gguf' is the same file as --model '" + dir + "/m.gguf'"},
      {{"--model", dir + "/m-link.gguf", "--report", dir + "/m.gguf"},
       "--report: '" + dir + "/m.gguf' is the same file as --model '" + dir + "/m-link.gguf'"},
      // Every value of a repeatable input.
      {{"--prompt-file", dir + "/p1.txt", "--prompt-file", dir + "/p2.txt", "--out",
        dir + "/p2-hard.txt"},
       "--out: '" + dir + "/p2-hard.txt' is the same file as --prompt-file '" + dir + "/p2.txt'"},
      // A file given as --rotation (not a keyword).
      {{"--rotation", dir + "/p1.txt", "--report", dir + "/p1.txt"},
       "--report: '" + dir + "/p1.txt' is the same file as --rotation"},
      // Two outputs, neither written yet.
      {{"--out", dir + "/new.json", "--report", dir + "/sub/../new.json"},
       "--report: '" + dir + "/sub/../new.json' is the same file as --out '" + dir +
           "/new.json'; one would overwrite the other: name another file"},
      // The --config file, and an input the config file names.
      {{"--config", cfg, "--out", cfg},
       "--out: '" + cfg + "' is the same file as --config '" + cfg},
      {{"--config", cfg, "--report", dir + "/m-link.gguf"},
       "--report: '" + dir + "/m-link.gguf' is the same file as --model '" + dir + "/m.gguf'"},
  };
  for (const Case& c : refused) {
    SameFilesApp a;
    auto [rc, err] = RunParse(a.app, c.args);
    EXPECT_EQ(rc, kExitUsage) << c.want << "\n" << err;
    EXPECT_NE(err.find(c.want), std::string::npos) << err;
  }
  // Distinct files, a keyword input, and a missing input (left to the reader) pass.
  const std::vector<std::vector<std::string>> accepted = {
      {"--model", dir + "/m.gguf", "--out", dir + "/r.safetensors", "--report", dir + "/r.json"},
      {"--rotation", "none", "--out", dir + "/none"},
      {"--model", dir + "/missing.gguf", "--out", dir + "/other.gguf"},
  };
  for (const auto& args : accepted) {
    SameFilesApp a;
    auto [rc, err] = RunParse(a.app, args);
    EXPECT_EQ(rc, -1) << err;
  }
  EXPECT_EQ(ReadAll(dir + "/m.gguf"), "model");
}

// InputFile / ReadInputFile: what every text, prompt, model and rotation flag reads.
TEST(CliInputFileTest, RefusesDirectoriesDevicesFifosAndOversizedFiles) {
  const std::string dir = FreshDir("input");
  std::string d = dir;
  EXPECT_EQ(InputFileProblem(dir, 100), "'" + dir + "' is a directory; name a file");
  EXPECT_EQ(InputFile(100)(d), "'" + dir + "' is a directory; name a file");
  EXPECT_EQ(InputFileProblem("/dev/zero", 100),
            "'/dev/zero' is a character device, not a regular file");
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  EXPECT_EQ(InputFileProblem(dir + "/fifo", 100),
            "'" + dir + "/fifo' is a FIFO, not a regular file");
  std::filesystem::create_symlink(dir + "/fifo", dir + "/fifo-link");
  EXPECT_EQ(InputFileProblem(dir + "/fifo-link", 100),
            "'" + dir + "/fifo-link' links to '" + dir + "/fifo', a FIFO, not a regular file");
  // A sparse file: 5 GiB by its size, no blocks on disk.
  const std::string big = dir + "/big.txt";
  std::ofstream(big).close();
  std::filesystem::resize_file(big, uint64_t{5} << 30);
  EXPECT_EQ(InputFileProblem(big, kMaxTextFileBytes),
            "'" + big + "' is 5 GiB (5368709120 bytes), above the limit of 64 MiB");
  // A missing file passes the check: the reader reports it (a runtime error, exit 2).
  EXPECT_EQ(InputFileProblem(dir + "/missing.txt", 100), "");
  std::string none = "none";
  EXPECT_EQ(InputFile(100, {"none", "hadamard"})(none), "");
  EXPECT_EQ(InputFile(100)(none), "");  // missing file "none" in the cwd: the reader says so

  // The reader refuses the same files without blocking on the FIFO (O_NONBLOCK, fstat).
  auto fifo = ReadInputFile(dir + "/fifo", 100);
  ASSERT_FALSE(fifo.ok());
  EXPECT_EQ(fifo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fifo.status().message(), "'" + dir + "/fifo' is a FIFO, not a regular file");
  auto zero = ReadInputFile("/dev/zero", 100);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  auto huge = ReadInputFile(big, kMaxTextFileBytes);
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("above the limit of 64 MiB"), std::string::npos);
  auto missing = ReadInputFile(dir + "/missing.txt", 100);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("cannot open '" + dir + "/missing.txt'"),
            std::string::npos);
}

TEST(CliInputFileTest, ReadsAFileUpToTheLimit) {
  const std::string dir = FreshDir("input-read");
  const std::string path = dir + "/p.txt";
  const std::string text(100000, 'x');  // more than one 64 KiB read
  std::ofstream(path, std::ios::binary) << text;
  EXPECT_EQ(InputFileProblem(path, text.size()), "");
  auto got = ReadInputFile(path, text.size());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, text);
  EXPECT_NE(InputFileProblem(path, text.size() - 1), "");
  EXPECT_FALSE(ReadInputFile(path, text.size() - 1).ok());
}

}  // namespace
}  // namespace kvpool::cli
