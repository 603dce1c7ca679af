// The --config YAML convention of kvpool/common/cli.h: flat keys, subcommand sections, and the
// refusal of keys that name no flag (exit code kExitUsage with the key in the message).
#include "kvpool/common/cli.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

namespace kvpool::cli {
namespace {

std::string WriteYaml(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/kvpool_cli_test_" + name + ".yaml";
  std::ofstream(path) << text;
  return path;
}

// Runs Parse on `args` (program name prepended); returns its code and what it wrote to stderr.
std::pair<int, std::string> RunParse(CLI::App& app, std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (auto& a : args) {
    argv.push_back(a.data());
  }
  ::testing::internal::CaptureStderr();
  const int rc = Parse(app, static_cast<int>(argv.size()), argv.data());
  return {rc, ::testing::internal::GetCapturedStderr()};
}

// A server-like app: top-level flags only.
struct FlatApp {
  CLI::App app{"test"};
  int metrics_port = 9090;
  std::string listen = "0.0.0.0:7070";
  FlatApp() {
    Setup(app, "prog");
    app.add_option("--metrics-port", metrics_port, "port");
    app.add_option("--listen", listen, "address");
  }
};

// An engine/tool-like app: subcommands (one nested two deep) with their own flags.
struct SubcommandApp {
  CLI::App app{"test"};
  std::string model;
  int max_tokens = 256;
  std::string rotation_file;
  CLI::App* gen = nullptr;
  CLI::App* inspect = nullptr;
  SubcommandApp() {
    Setup(app, "prog");
    app.require_subcommand(1);
    gen = app.add_subcommand("generate", "gen");
    gen->add_option("--model", model, "model");
    gen->add_option("--max-tokens", max_tokens, "tokens");
    CLI::App* rots = app.add_subcommand("rotations", "rotations");
    inspect = rots->add_subcommand("inspect", "inspect");
    inspect->add_option("--file", rotation_file, "file");
  }
};

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
