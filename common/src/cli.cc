#include "kvpool/common/cli.h"

#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "kvpool/common/log.h"
#include "kvpool/common/version.h"

namespace kvpool::cli {
namespace {

// Reads a flat (or nested: "section.key") YAML map into CLI11 config items. Sequences become
// multiple inputs. Keys are flag names without the leading dashes.
class YamlConfig : public CLI::Config {
 public:
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

  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    std::vector<CLI::ConfigItem> items;
    YAML::Node root;
    try {
      root = YAML::Load(input);
    } catch (const YAML::Exception& e) {
      throw CLI::ConversionError("config file is not valid YAML: " + std::string(e.what()));
    }
    if (root.IsNull()) return items;
    if (!root.IsMap()) throw CLI::ConversionError("config file must be a YAML map of flag: value");
    Walk(root, {}, items);
    return items;
  }

 private:
  static void Walk(const YAML::Node& node, std::vector<std::string> parents,
                   std::vector<CLI::ConfigItem>& items) {
    std::set<std::string> seen;  // yaml-cpp keeps duplicate keys; the first would silently win
    for (const auto& kv : node) {
      const std::string key = kv.first.as<std::string>();
      if (!seen.insert(key).second) {
        std::string path;
        for (const auto& p : parents) path += p + ".";
        throw CLI::ConversionError("config file sets \"" + path + key + "\" more than once");
      }
      const YAML::Node& v = kv.second;
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
};

}  // namespace

const CLI::Validator& OutputFile() {
  static const CLI::Validator v(
      [](std::string& path) -> std::string {
        std::error_code ec;
        if (std::filesystem::is_directory(path, ec))
          return "'" + path + "' is a directory; name a file";
        const std::filesystem::path dir =
            std::filesystem::absolute(std::filesystem::path(path), ec).parent_path();
        if (!std::filesystem::is_directory(dir, ec)) {
          return "directory '" + dir.string() + "' of '" + path + "' does not exist";
        }
        return {};
      },
      "FILE in an existing directory");
  return v;
}

std::string VersionString() { return std::string(kVersion) + " (git " + kGitSha + ")"; }

void Setup(CLI::App& app, const std::string& program_name) {
  app.name(program_name);
  app.option_defaults()->always_capture_default();
  app.set_version_flag("--version", program_name + " " + VersionString());
  app.config_formatter(std::make_shared<YamlConfig>());
  app.set_config("--config", "", "YAML file whose keys are flag names; explicit flags win");
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

int Parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    app.exit(e);
    return kExitOk;
  } catch (const CLI::ConfigError& e) {
    // CLI11 2.1.2 words an unknown key as "INI was not able to parse KEY" (KEY is
    // "section.name" inside a subcommand section); say what it means for a YAML file.
    const std::string what = e.what();
    const std::string prefix = "INI was not able to parse ";
    if (what.rfind(prefix, 0) == 0) {
      std::cerr << app.get_name() << ": --config: unknown key \"" << what.substr(prefix.size())
                << "\" (keys are flag names without the leading dashes; a subcommand's flags go "
                   "in a section named after it)\n";
    } else {
      std::cerr << app.get_name() << ": --config: " << what << "\n";
    }
    std::cerr << "Run with --help for more information.\n";
    return kExitUsage;
  } catch (const CLI::ParseError& e) {
    std::cerr << app.get_name() << ": " << e.what() << "\n";
    std::cerr << "Run with --help for more information.\n";
    return kExitUsage;
  }
  return -1;
}

}  // namespace kvpool::cli
