// kvpool/common/cli.h — the one flag convention shared by every kvpool binary.
//
// Hyphenated long flags, `--help` with defaults, `--version`, and `--config FILE` (YAML whose
// keys are the flag names without dashes; flags given on the command line win). Exit codes:
// 0 success, 1 usage error, 2 runtime error.
//
//   int main(int argc, char** argv) {
//     CLI::App app{"kvpool-server — the KV-cache pool"};
//     kvpool::cli::Setup(app, "kvpool-server");
//     std::string listen = "127.0.0.1:7070";
//     app.add_option("--listen", listen, "gRPC address")->capture_default_str();
//     KVPOOL_CLI_PARSE(app, argc, argv);   // returns 0/1 from main on --help/--version/errors
//     ...
//   }
//
// CLI11 is a header-only Debian package; this header is included only by binaries' main files.
#pragma once

#include <string>
#include <type_traits>

#include <CLI/CLI.hpp>

namespace kvpool::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitUsage = 1;
inline constexpr int kExitRuntime = 2;

// The project version string ("0.1.0 (git abcdef0)").
std::string VersionString();

// Adds --version, --config FILE (YAML) and --log-level to `app`, and shows defaults in --help.
// The YAML is a map of flag names (without dashes) to values; a subcommand's flags go in a
// nested map named after the subcommand ("generate: {model: m.gguf}"). A key that names no flag
// or subcommand is a usage error (Parse returns kExitUsage naming the key, e.g. "bogus_key" or
// "generate.bogus"). Not thread-safe (touches `app` only).
void Setup(CLI::App& app, const std::string& program_name);

// CLI11 check for an output file written after a long run, so the run does not fail at its
// end: the path must not be a directory and its directory must exist. Messages (after CLI11's
// "--flag: "): "'P' is a directory; name a file", "directory 'D' of 'P' does not exist" (D
// absolute). Usage: app.add_option("--report", path, "...")->check(kvpool::cli::OutputFile());
const CLI::Validator& OutputFile();

// CLI11 check that a value is a T in [min, max]. Unlike CLI::Range, whose message for a value
// of the wrong type ("abc", "1.5" for an integer) claims it is out of range, the message says
// which: "'abc' is not an integer (want -1..65535)", "70000 is outside -1..65535"; NaN is refused
// for floating-point T. Usage: app.add_option("--metrics-port", port)->check(Range(-1, 65535)).
template <typename T>
CLI::Validator Range(T min, T max) {
  static_assert(std::is_arithmetic_v<T>);
  const std::string want = CLI::detail::to_string(min) + ".." + CLI::detail::to_string(max);
  return CLI::Validator(
      [min, max, want](std::string& v) -> std::string {
        T x{};
        if (!CLI::detail::lexical_cast(v, x)) {
          return "'" + v + "' is not " + (std::is_integral_v<T> ? "an integer" : "a number") +
                 " (want " + want + ")";
        }
        if (!(x >= min && x <= max)) {
          return v + " is outside " + want;
        }
        return {};
      },
      "in " + want);
}

// Parses; on --help/--version prints and returns kExitOk, on a usage error prints a one-line
// message and returns kExitUsage; returns -1 when the program should continue.
int Parse(CLI::App& app, int argc, char** argv);

}  // namespace kvpool::cli

#define KVPOOL_CLI_PARSE(app, argc, argv)                             \
  do {                                                                \
    int kvpool_cli_rc_ = ::kvpool::cli::Parse((app), (argc), (argv)); \
    if (kvpool_cli_rc_ >= 0) return kvpool_cli_rc_;                   \
  } while (0)
