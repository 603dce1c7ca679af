#include "kvpool/common/cli.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "kvpool/common/atomic_file.h"
#include "kvpool/common/bounded_file.h"
#include "kvpool/common/host_port.h"
#include "kvpool/common/log.h"
#include "kvpool/common/version.h"

namespace kvpool::cli {
namespace {

// Reads a flat (or nested: "section.key") YAML map into CLI11 config items. Sequences become
// multiple inputs. Keys are flag names without the leading dashes.
class YamlConfig : public CLI::Config {
 public:
  // `root`: the app whose options the keys name (not owned; outlives the formatter, which it
  // owns). Used to word a list or a missing value for a flag that takes one value.
  explicit YamlConfig(const CLI::App* root) : root_(root) {}

  std::string to_config(const CLI::App* app, bool default_also, bool, std::string) const override {
    YAML::Emitter out;
    out << YAML::BeginMap;
    for (const CLI::Option* opt : app->get_options()) {
      if (opt->get_lnames().empty() || !opt->get_configurable()) continue;
      const std::string& name = opt->get_lnames().front();
      std::string value = opt->results().empty() ? (default_also ? opt->get_default_str() : "")
                                                 : opt->results().front();
      if (value.empty()) continue;
      out << YAML::Key << name << YAML::Value << value;
    }
    out << YAML::EndMap;
    return out.c_str();
  }

  // A key of the file that set an option's value, for naming the file in errors about that
  // value (Parse): "calibrate.per-head" and the option it names.
  struct Origin {
    std::string key;
    const CLI::Option* option = nullptr;
  };
  // The keys of the last file read (from_config) that name an option and carry a value.
  const std::vector<Origin>& origins() const { return origins_; }

  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    origins_.clear();
    std::vector<CLI::ConfigItem> items;
    YAML::Node root;
    try {
      // yaml-cpp's Load reads the first document only: a second one ("---") was silently
      // ignored (newcomer report s6 #8).
      // Empty documents (a leading or trailing "---") hold nothing and are skipped.
      std::vector<YAML::Node> documents = YAML::LoadAll(input);
      documents.erase(std::remove_if(documents.begin(), documents.end(),
                                     [](const YAML::Node& d) { return d.IsNull(); }),
                      documents.end());
      if (documents.size() > 1) {
        throw CLI::ConversionError("config file holds " + std::to_string(documents.size()) +
                                   " YAML documents (separated by ---); give one map");
      }
      if (!documents.empty()) root = documents.front();
    } catch (const YAML::Exception& e) {
      throw CLI::ConversionError("config file is not valid YAML: " + std::string(e.what()));
    }
    if (root.IsNull()) return items;
    if (!root.IsMap()) throw CLI::ConversionError("config file must be a YAML map of flag: value");
    try {
      Walk(root, {}, items);
    } catch (const YAML::Exception& e) {  // e.g. a key that is a list or a map
      throw CLI::ConversionError("config file is not a map of flag names to values: " +
                                 std::string(e.what()));
    }
    return items;
  }

 private:
  // The option `parents`.`name` of root_ stands for, as CLI11 looks it up ("--name", "-n",
  // then a positional "name"); null when there is none (CLI11 then refuses the key as unknown).
  const CLI::Option* FindOption(const std::vector<std::string>& parents,
                                const std::string& name) const {
    const CLI::App* app = root_;
    for (const auto& p : parents) {
      if (app == nullptr) return nullptr;
      try {
        app = app->get_subcommand(p);
      } catch (const CLI::OptionNotFound&) {
        return nullptr;
      }
    }
    if (app == nullptr) return nullptr;
    const CLI::Option* op = app->get_option_no_throw("--" + name);
    if (op == nullptr && name.size() == 1) op = app->get_option_no_throw("-" + name);
    if (op == nullptr) op = app->get_option_no_throw(name);
    return op;
  }

  // Whether `parents`.`name` is a subcommand of root_ (a section, not an option's value).
  bool HasSubcommand(std::vector<std::string> parents, const std::string& name) const {
    parents.push_back(name);
    const CLI::App* app = root_;
    for (const auto& p : parents) {
      try {
        app = app->get_subcommand(p);
      } catch (const CLI::OptionNotFound&) {
        return false;
      }
      if (app == nullptr) return false;
    }
    return true;
  }

  // Refuses what CLI11 would word about the command line or in its own terms (newcomer s7 F6:
  // "capacity: [1, 2]" read as "--capacity is given 2 times", "capacity:" as "At least 1
  // required but received 0"): a key with no value, a list for an option that takes one value,
  // a list item that is not a value, a map for an option. The message names the key (with its
  // section) and the flag; Parse puts the file's name in front.
  void CheckValue(const YAML::Node& v, const std::string& key, const CLI::Option* op) const {
    const std::string flag = op->get_name();
    const bool is_flag = op->get_expected_min() == 0 && op->get_type_size_max() <= 1 &&
                         op->get_items_expected_max() <= 1;
    const bool one_value = op->get_items_expected_max() <= 1;
    const std::string want =
        is_flag     ? flag + " is a flag: write \"" + key + ": true\" or \"" + key + ": false\""
        : one_value ? flag + " takes one value: write \"" + key + ": VALUE\""
                    : flag + " takes a value or a list of values";
    // A required option has no default to fall back to (newcomer 18 F6: "prompt-file: []" was
    // told to remove the key, which then gave "--prompt-file is required").
    const std::string or_remove = op->get_required()
                                      ? std::string(" (it is required: there is no default)")
                                      : std::string(", or remove the key to keep the default");
    if (v.IsNull()) {
      throw CLI::ConversionError("config file key \"" + key + "\" has no value; " + want +
                                 or_remove);
    }
    if (v.IsMap()) {
      throw CLI::ConversionError("config file key \"" + key + "\" is a map; " + want);
    }
    // An empty string for a flag: CLI11 reads a flag without a value as true, so "per-head: \"\""
    // turned it on (newcomer s9b).
    if (is_flag && v.IsScalar() && v.Scalar().empty()) {
      throw CLI::ConversionError("config file key \"" + key + "\" is empty (\"\"); " + want);
    }
    if (v.IsSequence()) {
      if (one_value) {
        throw CLI::ConversionError("config file key \"" + key + "\" is a list (" +
                                   std::to_string(v.size()) + (v.size() == 1 ? " item" : " items") +
                                   "); " + want);
      }
      if (v.size() == 0) {
        throw CLI::ConversionError("config file key \"" + key + "\" is an empty list; " + want +
                                   or_remove);
      }
      size_t i = 0;
      for (const auto& e : v) {
        ++i;
        if (!e.IsScalar()) {
          throw CLI::ConversionError("config file key \"" + key + "\": item " + std::to_string(i) +
                                     " is " +
                                     (e.IsMap()        ? "a map"
                                      : e.IsSequence() ? "a list"
                                                       : "empty") +
                                     "; " + want);
        }
      }
    }
  }

  void Walk(const YAML::Node& node, std::vector<std::string> parents,
            std::vector<CLI::ConfigItem>& items) const {
    std::set<std::string> seen;  // yaml-cpp keeps duplicate keys; the first would silently win
    for (const auto& kv : node) {
      const std::string key = kv.first.as<std::string>();
      if (!seen.insert(key).second) {
        std::string path;
        for (const auto& p : parents) path += p + ".";
        throw CLI::ConversionError("config file sets \"" + path + key + "\" more than once");
      }
      // A config file naming another one: --config is read from the command line only. Inside a
      // subcommand's section the key reached the subcommand's own --config, whose message (the
      // kvpool tool's "is not read after the subcommand") is about the command line and misled
      // (re-tester s6); at the top CLI11 said "This option is not allowed in a configuration file".
      if (key == "config") {
        std::string path;
        for (const auto& p : parents) path += p + ".";
        throw CLI::ConversionError("config file sets \"" + path + key +
                                   "\": a config file cannot name another config file; give "
                                   "--config FILE once, on the command line, before any "
                                   "subcommand");
      }
      const YAML::Node& v = kv.second;
      if (const CLI::Option* op = FindOption(parents, key);
          op != nullptr && !(v.IsMap() && HasSubcommand(parents, key))) {
        std::string path;
        for (const auto& p : parents) path += p + ".";
        CheckValue(v, path + key, op);
        origins_.push_back({path + key, op});
      }
      if (v.IsMap()) {
        auto p = parents;
        p.push_back(key);
        Walk(v, p, items);
        continue;
      }
      CLI::ConfigItem item;
      item.parents = parents;
      item.name = key;
      if (v.IsSequence()) {
        for (const auto& e : v) item.inputs.push_back(e.as<std::string>());
      } else if (!v.IsNull()) {
        item.inputs.push_back(v.as<std::string>());
      }
      items.push_back(std::move(item));
    }
  }

  const CLI::App* root_;
  mutable std::vector<Origin> origins_;  // written by from_config (const in CLI::Config)
};

}  // namespace

namespace {

namespace fs = std::filesystem;

// Words for the type of the file `path` names (following links), e.g. "a FIFO".
const char* FileKind(const std::string& path) {
  struct stat sb {};
  if (::stat(path.c_str(), &sb) != 0) return "a special file";
  return FileTypeWords(sb.st_mode);
}

// The directory `target` lives in ("." for a bare name).
fs::path DirectoryOf(const fs::path& target) {
  const fs::path dir = target.parent_path();
  return dir.empty() ? fs::path(".") : dir;
}

}  // namespace

std::string OutputTarget(const std::string& path) { return AtomicWriteTarget(path); }

const CLI::Validator& OutputFile() {
  static const CLI::Validator v(
      [](std::string& path) -> std::string {
        if (path.empty()) return "empty path; name a file";
        bool too_many_links = false;
        const fs::path target = AtomicWriteTarget(path, &too_many_links);
        if (too_many_links) {
          return "'" + path + "': too many levels of symbolic links";
        }
        const bool linked = target != fs::path(path);
        const std::string named =
            linked ? "'" + path + "' links to '" + target.string() + "', " : "'" + path + "' is ";
        std::error_code ec;
        const fs::file_status st = fs::status(target, ec);
        if (fs::is_directory(st)) return named + "a directory; name a file";
        if (fs::exists(st) && !fs::is_regular_file(st)) {
          return named + FileKind(path) + ", not a regular file";
        }
        const fs::path dir = fs::absolute(DirectoryOf(target), ec).lexically_normal();
        std::string d = dir.string();
        if (d.size() > 1 && d.back() == '/') d.pop_back();
        if (!fs::is_directory(dir, ec)) {
          return "directory '" + d + "' of '" + path + "' does not exist";
        }
        // Prove the directory takes a new file (the writers create a temporary file there and
        // rename it): a read-only mount, missing permission or a pseudo file system like /proc.
        std::string probe = (dir / ".kvpool-probe-XXXXXX").string();
        const int fd = ::mkstemp(probe.data());
        if (fd < 0) {
          const int err = errno;
          return "cannot create a file in directory '" + d + "' of '" + path +
                 "': " + std::strerror(err);
        }
        ::close(fd);
        ::unlink(probe.c_str());
        return {};
      },
      "FILE in a writable directory");
  return v;
}

namespace {

std::string TooLarge(const std::string& path, uint64_t size, uint64_t max_bytes) {
  return "'" + path + "' is " + HumanByteCount(size) + " (" + std::to_string(size) +
         " bytes), above the limit of " + HumanByteCount(max_bytes);
}

}  // namespace

std::string InputFileProblem(const std::string& path, uint64_t max_bytes) {
  if (path.empty()) return "empty path; name a file";
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return {};  // the reader says "cannot open" (exit 2)
  std::string named = "'" + path + "' is ";
  if (fs::is_symlink(fs::symlink_status(path, ec))) {
    const fs::path target = fs::canonical(path, ec);
    if (!ec) named = "'" + path + "' links to '" + target.string() + "', ";
  }
  if (fs::is_directory(st)) return named + "a directory; name a file";
  if (!fs::is_regular_file(st)) return named + FileKind(path) + ", not a regular file";
  const uintmax_t size = fs::file_size(path, ec);
  if (!ec && size > max_bytes) return TooLarge(path, size, max_bytes);
  return {};
}

CLI::Validator InputFile(uint64_t max_bytes, std::vector<std::string> keywords) {
  return CLI::Validator(
      [max_bytes, keywords](std::string& path) -> std::string {
        for (const auto& k : keywords) {
          if (path == k) return {};
        }
        return InputFileProblem(path, max_bytes);
      },
      "FILE (at most " + HumanByteCount(max_bytes) + ")");
}

absl::StatusOr<std::string> ReadInputFile(const std::string& path, uint64_t max_bytes) {
  FileReadInfo info;
  auto bytes = ReadBoundedRegularFile(path, max_bytes, &info);
  if (!bytes.ok() && info.stage == FileReadInfo::Stage::kNotRegular) {
    // The flag check's words, which also say where a symbolic link led.
    std::string problem = InputFileProblem(path, max_bytes);
    if (!problem.empty()) return absl::InvalidArgumentError(problem);
  }
  return bytes;
}

absl::Status WriteOutputFile(const std::string& path, std::string_view bytes) {
  return WriteFileAtomically(path, bytes);
}

namespace {

// What a path names, for RefuseSameFiles: the device and inode of the file it reaches (through
// symbolic links) when that exists, else the absolute path with links resolved as far as the
// file system has them (an output not written yet).
struct FileIdentity {
  bool exists = false;
  dev_t dev = 0;
  ino_t ino = 0;
  std::string path;
  bool operator==(const FileIdentity& o) const {
    return exists == o.exists && (exists ? dev == o.dev && ino == o.ino : path == o.path);
  }
};

FileIdentity IdentityOf(const std::string& path) {
  FileIdentity id;
  const std::string target = AtomicWriteTarget(path);  // what a write replaces; stat follows too
  struct stat sb {};
  if (::stat(target.c_str(), &sb) == 0) {
    id.exists = true;
    id.dev = sb.st_dev;
    id.ino = sb.st_ino;
    return id;
  }
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(target, ec), ec);
  id.path = (ec ? fs::absolute(target, ec) : p).lexically_normal().string();
  return id;
}

}  // namespace

void RefuseSameFiles(CLI::App* app, std::vector<FileFlag> outputs, std::vector<FileFlag> inputs) {
  const CLI::App* root = app;
  while (root->get_parent() != nullptr) root = root->get_parent();
  if (const CLI::Option* config = root->get_config_ptr(); config != nullptr) {
    inputs.push_back({config});
  }
  app->final_callback([outputs = std::move(outputs), inputs = std::move(inputs)] {
    struct Named {
      std::string flag, path;
      FileIdentity id;
    };
    auto given = [](const std::vector<FileFlag>& flags, bool must_exist) {
      std::vector<Named> out;
      for (const FileFlag& f : flags) {
        if (f.option == nullptr) continue;
        for (const std::string& v : f.option->results()) {
          if (v.empty() || std::find(f.keywords.begin(), f.keywords.end(), v) != f.keywords.end()) {
            continue;
          }
          Named n{f.option->get_name(), v, IdentityOf(v)};
          if (must_exist && !n.id.exists) continue;  // the reader says "cannot open"
          out.push_back(std::move(n));
        }
      }
      return out;
    };
    const std::vector<Named> outs = given(outputs, false);
    const std::vector<Named> ins = given(inputs, true);
    for (size_t i = 0; i < outs.size(); ++i) {
      for (const Named& in : ins) {
        if (outs[i].id == in.id) {
          throw CLI::ValidationError(
              outs[i].flag, "'" + outs[i].path + "' is the same file as " + in.flag + " '" +
                                in.path +
                                "'; writing it would replace that input: name another "
                                "file");
        }
      }
      for (size_t j = 0; j < i; ++j) {
        if (outs[i].id == outs[j].id) {
          throw CLI::ValidationError(outs[i].flag, "'" + outs[i].path + "' is the same file as " +
                                                       outs[j].flag + " '" + outs[j].path +
                                                       "'; one would overwrite the other: name "
                                                       "another file");
        }
      }
    }
  });
}

CLI::Validator HostPortAddress(int min_port) {
  return CLI::Validator(
      [min_port](std::string& v) -> std::string {
        constexpr absl::string_view kField = "address";
        auto hp = ParseHostPort(kField, v, min_port);
        if (hp.ok()) return {};
        const absl::string_view msg = hp.status().message();
        return std::string(msg.substr(std::min(msg.size(), kField.size() + 2)));  // "address: "
      },
      "HOST:PORT");
}

std::string VersionString() { return std::string(kVersion) + " (git " + kGitSha + ")"; }

void Setup(CLI::App& app, const std::string& program_name) {
  app.name(program_name);
  app.option_defaults()->always_capture_default();
  app.set_version_flag("--version", program_name + " " + VersionString());
  app.config_formatter(std::make_shared<YamlConfig>(&app));
  // The file is checked before CLI11 reads it: CLI11 alone would block on a FIFO, read /dev/zero
  // forever and call a directory "not readable (missing?)".
  app.set_config("--config", "", "YAML file whose keys are flag names; explicit flags win")
      ->check(CLI::Validator(
          [](std::string& path) -> std::string {
            std::error_code ec;
            if (!path.empty() && !fs::exists(fs::status(path, ec))) {
              return "'" + path + "' does not exist";
            }
            if (std::string problem = InputFileProblem(path, kMaxConfigFileBytes);
                !problem.empty()) {
              return problem;
            }
            if (::access(path.c_str(), R_OK) != 0) {
              const int err = errno;
              return "cannot read '" + path + "': " + std::strerror(err);
            }
            return {};
          },
          "YAML FILE (at most " + HumanByteCount(kMaxConfigFileBytes) + ")"));
  // A misspelt key ("metrics_port", "lease-msec") must not be dropped silently: refuse keys that
  // match no flag, also inside subcommand sections (the check runs for the whole tree at the
  // root; subcommands added later are looked up by name).
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.add_option_function<std::string>(
         "--log-level",
         [](const std::string& lvl) {
           if (!SetLogLevel(lvl)) throw CLI::ValidationError("--log-level", "unknown level " + lvl);
         },
         "trace|debug|info|warn|error|off")
      ->default_str("info");
}

namespace {

// "--config 'FILE'" for messages about the config file's content, or "--config" when none was
// given (cannot happen for such messages, kept as a fallback).
std::string ConfigNamed(const CLI::App& app) {
  const CLI::Option* c = app.get_config_ptr();
  if (c == nullptr || c->results().empty()) return "--config";
  return "--config '" + c->results().back() + "'";
}

// CLI11's and YamlConfig's "config file ..." errors, with the file named as given on the
// command line; any other text unchanged.
std::string WithConfigNamed(const CLI::App& app, std::string what) {
  constexpr std::string_view kPrefix = "config file ";
  if (what.rfind(kPrefix, 0) == 0) what = ConfigNamed(app) + " " + what.substr(kPrefix.size());
  return what;
}

// The refusal of a value that is not a boolean word (BooleanWords), for the command line and the
// --config file alike.
std::string NotABoolean(const std::string& value) {
  return "'" + value +
         "' is not a boolean (want true or false; also accepted: yes/no, on/off, 1/0, "
         "enable/disable, t/f, y/n, any case)";
}

// CLI11 reads a boolean with to_flag_value, which also takes any integer (2 is true, -1 false)
// and '+'/'-' (newcomer s8b F1: "--teacher-force 2" ran with it on): the check admits only the
// words NotABoolean lists. No description, so --help and the type name stay "BOOLEAN".
constexpr const char kBooleanWordsName[] = "kvpool-boolean-words";
CLI::Validator BooleanWords() {
  CLI::Validator v(
      [](std::string& value) -> std::string {
        std::string lower = value;
        std::transform(lower.begin(), lower.end(), lower.begin(),
                       [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
        for (const char* word : {"true", "false", "yes", "no", "on", "off", "1", "0", "enable",
                                 "disable", "t", "f", "y", "n"}) {
          if (lower == word) return {};
        }
        return NotABoolean(value);
      },
      "");
  v.name(kBooleanWordsName);
  return v;
}

// Whether `op` holds a boolean: an option of type bool ("BOOLEAN"), or a flag (no value) that is
// not --help, --help-all, --version or a counting flag (add_flag of an integer or a vector, which
// CLI11 gives MultiOptionPolicy::TakeAll). A flag's results are the words CLI11 makes of "--x",
// "--x=V" or a config value.
bool IsBoolean(const CLI::App& app, const CLI::Option& op) {
  if (&op == app.get_help_ptr() || &op == app.get_help_all_ptr() || &op == app.get_version_ptr() ||
      &op == app.get_config_ptr()) {
    return false;
  }
  if (op.get_type_name().rfind("BOOLEAN", 0) == 0) return true;
  return op.get_expected_min() == 0 && op.get_expected_max() == 0 &&
         op.get_multi_option_policy() != CLI::MultiOptionPolicy::TakeAll;
}

// Adds BooleanWords to every boolean option of `app` and its subcommands (once).
void CheckBooleanWords(CLI::App& app) {
  for (CLI::Option* op : app.get_options([](const CLI::Option*) { return true; })) {
    if (!IsBoolean(app, *op)) continue;
    try {
      (void)op->get_validator(kBooleanWordsName);
    } catch (const CLI::OptionNotFound&) {
      op->check(BooleanWords());
    }
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    CheckBooleanWords(*sub);
  }
}

// The name of DecimalInteger's validator (so Parse adds it once).
constexpr const char kDecimalIntegerName[] = "kvpool-decimal-integer";
}  // namespace

DecimalSpelling SpellingOf(std::string_view v) {
  const std::string_view digits = v.substr(!v.empty() && v[0] == '-' ? 1 : 0);
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos) {
    return DecimalSpelling::kNotDigits;
  }
  if (digits.size() > 1 && digits[0] == '0') return DecimalSpelling::kLeadingZero;
  return digits == "0" && v[0] == '-' ? DecimalSpelling::kNegativeZero : DecimalSpelling::kPlain;
}

namespace {
// CLI11 reads an integer option with its own conversion, which takes "0100" as octal 64, "0x10" as
// 16, "+16" and " 16", and wraps "-1" into an unsigned type (newcomer 16 F2: --recent-tokens 0100
// registered W=64): the check admits only plain decimal, as Range does. Range, where an option
// has it, runs first and names the bounds; this check only catches an option without one. No
// description, so --help and the type name stay "INT"/"UINT".
CLI::Validator DecimalInteger(bool is_unsigned) {
  CLI::Validator v(
      [is_unsigned](std::string& value) -> std::string {
        const DecimalSpelling spelling = SpellingOf(value);
        if (spelling == DecimalSpelling::kNotDigits) {
          return "'" + value + "' is not an integer (want plain decimal digits)";
        }
        if (spelling == DecimalSpelling::kLeadingZero) {
          return "'" + value + "' is not a decimal integer (leading zero)";
        }
        if (spelling == DecimalSpelling::kNegativeZero) {
          return "'" + value + "' is not a plain decimal integer (write 0)";
        }
        if (is_unsigned && value[0] == '-') {
          return value + " is negative (want an integer >= 0)";
        }
        return {};
      },
      "");
  v.name(kDecimalIntegerName);
  return v;
}

// The integer type of `op` ("INT" or "UINT", the type name CLI11 gives every integral type),
// "" for any other option and for flags (a counting flag takes no value).
std::string IntegerType(const CLI::Option& op) {
  if (op.get_expected_min() == 0) return {};
  std::string type = op.get_type_name();
  type = type.substr(0, type.find(':'));
  return type == "INT" || type == "UINT" ? type : std::string();
}

// Adds DecimalInteger to every integer option of `app` and its subcommands (once).
void CheckDecimalIntegers(CLI::App& app) {
  for (CLI::Option* op : app.get_options([](const CLI::Option*) { return true; })) {
    const std::string type = IntegerType(*op);
    if (type.empty()) continue;
    try {
      (void)op->get_validator(kDecimalIntegerName);
    } catch (const CLI::OptionNotFound&) {
      op->check(DecimalInteger(type == "UINT"));
    }
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    CheckDecimalIntegers(*sub);
  }
}

// Whether argv names `op` ("--name", "--name=V", "-n", "-nV"): CLI11 reads a config file's value
// only for an option the command line left empty, so an error about the value of an option the
// command line does not name is about the file's value.
bool NamedOnCommandLine(const CLI::Option& op, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--") break;
    for (const std::string& l : op.get_lnames()) {
      const std::string flag = "--" + l;
      if (a == flag || (a.size() > flag.size() && a.substr(0, flag.size() + 1) == flag + "=")) {
        return true;
      }
    }
    if (a.size() >= 2 && a[0] == '-' && a[1] != '-') {
      for (const std::string& sn : op.get_snames()) {
        if (a.substr(1, sn.size()) == sn) return true;
      }
    }
  }
  return false;
}

// An option named `name` ("--per-head") in `app` or its subcommands, preferring one that holds a
// value (the subcommand that ran); null when none.
const CLI::Option* FindByName(const CLI::App& app, const std::string& name) {
  const CLI::Option* found = nullptr;
  for (const CLI::Option* op : app.get_options()) {
    if (op->get_name() == name) {
      if (!op->results().empty()) return op;
      found = op;
    }
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    if (const CLI::Option* op = FindByName(*sub, name); op != nullptr) {
      if (!op->results().empty()) return op;
      if (found == nullptr) found = op;
    }
  }
  return found;
}

// Rewords an error about one option's value (CLI11's ValidationError "--x: why" or
// ConversionError "Could not convert: --x = v"; newcomer s8 N9): a boolean that is none lists
// what is accepted instead of "Could not convert", and a value that came from the --config file
// names the file and the key ("--config 'k.yaml' key \"calibrate.per-head\": --per-head: ...").
// Returns "" for any other message.
std::string OptionValueError(const CLI::App& app, const std::string& what, int argc, char** argv) {
  std::string name, why;
  const std::string conv = "Could not convert: ";
  if (what.rfind(conv, 0) == 0) {
    const std::string::size_type eq = what.find(" = ", conv.size());
    if (eq == std::string::npos) return {};
    name = what.substr(conv.size(), eq - conv.size());
    const std::string value = what.substr(eq + 3);
    const CLI::Option* op = FindByName(app, name);
    if (op == nullptr) return {};
    if (op->get_expected_min() == 0 || op->get_type_name() == "BOOLEAN") {
      why = NotABoolean(value);
    } else {
      why = "'" + value + "' cannot be read as " + op->get_type_name();
    }
  } else if (what.rfind("--", 0) == 0) {
    const std::string::size_type colon = what.find(": ");
    if (colon == std::string::npos) return {};
    name = what.substr(0, colon);
    why = what.substr(colon + 2);
  } else {
    return {};
  }
  // CLI11's ExistingDirectory/ExistingFile ("Directory does not exist: rots"): say which
  // directory a relative path was taken from (a config file's directory is not: newcomer s9 A12).
  if (const CLI::Option* op = FindByName(app, name);
      op != nullptr && !op->results().empty() &&
      why.find("does not exist: " + op->results().back()) != std::string::npos) {
    why += RelativePathNote(op->results().back());
  }
  if (const std::string from = ConfigSourceOf(app, name, argc, argv); !from.empty()) {
    return from + ": " + name + ": " + why;
  }
  return name + ": " + why;
}

// For an ExtrasError: a flag of `app` itself given after its subcommand ("prog generate ...
// --log-level off"), which CLI11 reports as "The following arguments were not expected: off
// --log-level" (value first). Names the flag and where it goes; "" when no such flag is found.
std::string MisplacedTopLevelFlag(const CLI::App& app, int argc, char** argv) {
  const std::vector<CLI::App*> subs = app.get_subcommands();
  if (subs.empty()) return {};
  std::vector<const CLI::App*> chain{subs.front()};  // the parsed subcommands, outermost first
  while (!chain.back()->get_subcommands().empty()) {
    chain.push_back(chain.back()->get_subcommands().front());
  }
  int at = 1;
  while (at < argc && chain.front()->get_name() != argv[at]) ++at;
  for (int i = at + 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string flag = arg.substr(0, arg.find('='));
    if (flag.rfind("--", 0) != 0 || flag.size() <= 2) continue;
    const CLI::Option* top = app.get_option_no_throw(flag);
    if (top == nullptr) continue;
    bool in_sub = false;
    for (const CLI::App* sub : chain) in_sub = in_sub || sub->get_option_no_throw(flag) != nullptr;
    if (in_sub) continue;
    std::string path;
    for (const CLI::App* sub : chain) path += " " + sub->get_name();
    return flag + " is a flag of " + app.get_name() + " itself, not of the subcommand '" +
           chain.back()->get_name() + "': give it before the subcommand (" + app.get_name() + " " +
           flag + (top->get_expected_min() > 0 ? " VALUE" : "") + path + " ...)";
  }
  return {};
}

}  // namespace

namespace {

// A subcommand's --help listed only its own flags, not --log-level, --config and --version, which
// go before it (newcomer s9b, left over): each subcommand without a footer of its own gets one
// naming them and where they go.
void NameProgramFlagsInSubcommandHelp(const CLI::App& root, CLI::App& app,
                                      const std::string& path) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    const std::string sub_path = path + " " + sub->get_name();
    if (sub->get_footer().empty()) {
      sub->footer("\n" + root.get_name() +
                  "'s own flags go before the subcommand: --log-level LEVEL "
                  "(trace|debug|info|warn|error|off; default info), --config FILE, --version (" +
                  root.get_name() + " --log-level warn" + sub_path + " ...; " + root.get_name() +
                  " --help lists them)");
    }
    NameProgramFlagsInSubcommandHelp(root, *sub, sub_path);
  }
}

}  // namespace

namespace {
// A refused command line: "PROG: WHAT" and the --help hint on standard error; kExitUsage.
int RefuseUsage(const CLI::App& app, const std::string& what) {
  std::cerr << app.get_name() << ": " << what << "\n";
  std::cerr << "Run with --help for more information.\n";
  return kExitUsage;
}

// Whether --help (or --help-all) of `app` or of a subcommand it parsed was given: 1 for --help,
// 2 for --help-all, 0 for neither. Read after a refused parse: CLI11 reads the whole command line
// (counting each flag) before it reads the --config file and converts and checks the values.
int HelpGiven(const CLI::App& app) {
  if (app.get_help_all_ptr() != nullptr && app.get_help_all_ptr()->count() > 0) return 2;
  int given = app.get_help_ptr() != nullptr && app.get_help_ptr()->count() > 0 ? 1 : 0;
  for (const CLI::App* sub : app.get_subcommands()) given = std::max(given, HelpGiven(*sub));
  return given;
}

// The message and exit code of a refused parse; called inside a catch block (rethrows the
// exception being handled).
int RefuseParseError(CLI::App& app, int argc, char** argv) {
  try {
    throw;
  } catch (const CLI::ConfigError& e) {
    // CLI11 2.1.2 words an unknown key as "INI was not able to parse KEY" (KEY is
    // "section.name" inside a subcommand section); say what it means for a YAML file.
    const std::string what = e.what();
    const std::string prefix = "INI was not able to parse ";
    if (what.rfind(prefix, 0) == 0) {
      return RefuseUsage(app, ConfigNamed(app) + ": unknown key \"" + what.substr(prefix.size()) +
                                  "\" (keys are flag names without the leading dashes; a "
                                  "subcommand's flags go in a section named after it)");
    }
    return RefuseUsage(app, ConfigNamed(app) + ": " + what);
  } catch (const CLI::ArgumentMismatch& e) {
    // CLI11 words a repeated single-value flag as "--x: At Most 1 required but received 2".
    std::string what = e.what();
    const std::string::size_type at = what.find(": At Most 1 required but received ");
    if (at != std::string::npos) {
      what = what.substr(0, at) + " is given " +
             what.substr(at + std::string(": At Most 1 required but received ").size()) +
             " times; give it once";
    }
    return RefuseUsage(app, what);
  } catch (const CLI::ConversionError& e) {
    std::string what = OptionValueError(app, e.what(), argc, argv);
    if (what.empty()) what = WithConfigNamed(app, e.what());
    return RefuseUsage(app, what);
  } catch (const CLI::ValidationError& e) {
    std::string what = OptionValueError(app, e.what(), argc, argv);
    if (what.empty()) what = e.what();
    return RefuseUsage(app, what);
  } catch (const CLI::RequiredError& e) {
    // CLI11 checks the required flags before the arguments it did not expect, so "kvpool
    // calibrate --version" (or --bogus) answered "--model is required" (newcomer s9b #8): a
    // misplaced top-level flag or an unknown argument is the first thing to fix, as it is
    // when the required flags are given.
    std::string what = MisplacedTopLevelFlag(app, argc, argv);
    if (what.empty()) {
      const std::vector<std::string> extra = app.remaining(/*recurse=*/true);
      if (!extra.empty()) {
        what = extra.size() > 1 ? "The following arguments were not expected:"
                                : "The following argument was not expected:";
        for (const std::string& a : extra) what += " " + a;  // in command-line order
      }
    }
    if (what.empty()) what = WithConfigNamed(app, e.what());
    return RefuseUsage(app, what);
  } catch (const CLI::ExtrasError& e) {
    std::string what = MisplacedTopLevelFlag(app, argc, argv);
    if (what.empty()) what = WithConfigNamed(app, e.what());
    return RefuseUsage(app, what);
  } catch (const CLI::ParseError& e) {
    // YamlConfig's own errors ("config file is not valid YAML: ...") name the file here.
    const std::string what = WithConfigNamed(app, e.what());
    return RefuseUsage(app, what);
  }
}

}  // namespace

std::string ConfigSourceOf(const CLI::App& app, const std::string& flag, int argc, char** argv) {
  const auto* config = dynamic_cast<const YamlConfig*>(app.get_config_formatter().get());
  if (config == nullptr) return {};
  for (const auto& origin : config->origins()) {
    if (origin.option->get_name() != flag || origin.option->results().empty()) continue;
    if (NamedOnCommandLine(*origin.option, argc, argv)) return {};
    return ConfigNamed(app) + " key \"" + origin.key + "\"";
  }
  return {};
}

int Parse(CLI::App& app, int argc, char** argv) {
  CheckBooleanWords(app);
  CheckDecimalIntegers(app);
  NameProgramFlagsInSubcommandHelp(app, app, "");
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    app.exit(e);
    return kExitOk;
  } catch (const CLI::ParseError&) {
    // CLI11 converts and checks values before it looks at --help, so "--help --capacity 1" (or
    // "--metrics-port abc --help", or a bad value in the --config file) answered with the other
    // flag's error (newcomer s14 #1). The help asked for wins: the subcommand's when it was given
    // to one (CLI::App::help shows the parsed subcommand's). --version wins too: its callback runs
    // before the command line's values are checked, but not before the --config file's
    // (newcomer 16b F5: "--config bad.yaml --version" answered with the file's error).
    if (const CLI::Option* version = app.get_version_ptr();
        version != nullptr && version->count() > 0) {
      try {
        app.get_version_ptr()->run_callback();  // throws CLI::CallForVersion with the text
      } catch (const CLI::Success& e) {
        app.exit(e);
        return kExitOk;
      }
    }
    if (const int help = HelpGiven(app); help > 0) {
      if (help == 2) {
        app.exit(CLI::CallForAllHelp());
      } else {
        app.exit(CLI::CallForHelp());
      }
      return kExitOk;
    }
    return RefuseParseError(app, argc, argv);
  }
  return -1;
}

}  // namespace kvpool::cli
