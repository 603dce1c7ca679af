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

#include <cctype>
#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/common/bounded_file.h"

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
// "generate.bogus"). The --config file itself must exist and pass InputFile's checks with
// kMaxConfigFileBytes (a directory, FIFO or device is a usage error naming it, before CLI11 reads
// it); Parse names the file in errors about its content ("--config 'c.yaml': unknown key ...",
// "--config 'c.yaml' is not valid YAML: ..."), also a key with no value ("capacity:"), a list
// for a flag that takes one value ("capacity: [1, 2]"), a map for a flag, or a list item that is
// not a value ("--config 'c.yaml' key \"capacity\" is a list (2 items); --capacity takes one
// value: write \"capacity: VALUE\""). An error about a value the file gave (a check or a
// conversion that refused it) names the file and the key too: "--config 'c.yaml' key
// \"metrics-port\": --metrics-port: 'abc' is not an integer (want -1..65535)"; a boolean that
// is none, from the file or the command line, lists the accepted values ("--per-head: 'yes
// please' is not a boolean (want true or false; also accepted: yes/no, ...)"); only those words
// are booleans (Parse checks every bool option and flag of the app and its subcommands): CLI11
// alone also reads any integer ("2" true, "-1" false) and "+"/"-".
// Not thread-safe (touches `app` only).
void Setup(CLI::App& app, const std::string& program_name);

// CLI11 check for an output file written after a long run, so the run does not fail at its
// end (docs/TOOLS.md "Output files"). Refuses, before any work:
//   - an empty path: "empty path; name a file";
//   - a directory: "'P' is a directory; name a file";
//   - an existing file that is not a regular file, or a symbolic link whose final target is not
//     one (a device node, a FIFO, a socket): "'P' is a character device, not a regular file"
//     ("'P' links to 'T', a character device, ..."); the writers would replace or block on it;
//   - a link chain longer than 40 links: "'P': too many levels of symbolic links";
//   - a missing directory: "directory 'D' of 'P' does not exist" (D absolute; for a link, the
//     directory of its target);
//   - a directory this process cannot create a file in, found by creating and removing a
//     temporary file there (mkstemp): "cannot create a file in directory 'D' of 'P': <errno
//     text>".
// CLI11 prefixes "--flag: ". A symbolic link to a regular file (or to a missing file in an
// existing directory) is accepted: WriteOutputFile writes through it.
// Usage: app.add_option("--report", path, "...")->check(kvpool::cli::OutputFile());
const CLI::Validator& OutputFile();

// A file flag for RefuseSameFiles: its option and the values that name no file (e.g. {"none",
// "hadamard"} for `kvpool quantize --rotation`).
struct FileFlag {
  const CLI::Option* option = nullptr;
  std::vector<std::string> keywords = {};
};

// Refuses, once `app` (the root or a subcommand) is parsed and before the program runs, an
// output path that names the same file as one of `inputs`, as the --config file or as another
// output — also through another spelling of the path, a symbolic link or a hard link (the same
// device and inode; for outputs that do not exist yet, the same path once links are resolved) —
// so a run cannot replace what it reads (newcomer s7 F7: `kvpool calibrate --out` equal to
// `--model` turned the model into a rotation file). Parse then exits kExitUsage naming both
// flags: "--out: 'm2.gguf' is the same file as --model 'm.gguf'; writing it would replace that
// input: name another file". Only values given (command line or --config) are compared, every
// value of a repeatable flag. Sets `app`'s final callback (CLI::App::final_callback); not
// thread-safe (touches `app` only). Usage, after adding the options:
//   kvpool::cli::RefuseSameFiles(calib, {{out_opt}}, {{model_opt}, {text_opt}});
void RefuseSameFiles(CLI::App* app, std::vector<FileFlag> outputs, std::vector<FileFlag> inputs);

// Size limits of the input files the binaries read whole (docs/TOOLS.md "Input files"), defined
// with the shared reader in kvpool/common/bounded_file.h: text 64 MiB, rotation files 256 MiB,
// GGUF models 64 GiB, --config YAML 1 MiB.
using ::kvpool::kMaxConfigFileBytes;
using ::kvpool::kMaxModelFileBytes;
using ::kvpool::kMaxRotationFileBytes;
using ::kvpool::kMaxTextFileBytes;

// What is wrong with `path` as an input file of at most `max_bytes` bytes, "" when nothing is.
// Looks at the path only (stat, following symbolic links; opens nothing, so a FIFO cannot block):
//   - a directory: "'P' is a directory; name a file";
//   - not a regular file (device such as /dev/zero, FIFO, socket): "'P' is a FIFO, not a regular
//     file" ("'P' links to 'T', a FIFO, ..." through a link);
//   - larger than max_bytes: "'P' is 70.0 GiB, above the limit of 64 GiB".
// A missing or unreadable path passes: the reader then fails with its own "cannot open" error
// (a runtime error, exit 2). Thread-safe.
std::string InputFileProblem(const std::string& path, uint64_t max_bytes);

// CLI11 check running InputFileProblem at parse time, so a bad input file is a usage error
// (exit 1) naming the flag: CLI11 prefixes "--flag: ". `keywords` are values that name no file
// and pass unchecked (e.g. {"none", "hadamard"} for `kvpool quantize --rotation`).
// Usage: app.add_option("--prompt-file", f)->check(InputFile(kMaxTextFileBytes)).
CLI::Validator InputFile(uint64_t max_bytes, std::vector<std::string> keywords = {});

// Reads the whole input file at `path` (at most `max_bytes` bytes) with the shared bounded reader
// (kvpool::ReadBoundedRegularFile). Opens with O_NONBLOCK, so a FIFO swapped in after the flag
// check does not block, and checks the opened file (fstat) again:
// NOT_FOUND "cannot open 'P': <errno text>"; INVALID_ARGUMENT for a file that is not regular or
// is (or grew) larger than max_bytes, in InputFileProblem's words; INTERNAL on a read error.
// Thread-safe.
absl::StatusOr<std::string> ReadInputFile(const std::string& path, uint64_t max_bytes);

// The file a write to `path` replaces (kvpool::AtomicWriteTarget, kvpool/common/atomic_file.h):
// `path` itself, or, when `path` is a symbolic link (possibly a chain), the file the last link
// names. Reads the file system; thread-safe.
std::string OutputTarget(const std::string& path);

// Writes `bytes` to OutputTarget(path) atomically (temporary file beside the target, fsync,
// rename; a symbolic link stays a link whose target has the new bytes): the one atomic writer,
// kvpool::WriteFileAtomically (kvpool/common/atomic_file.h), under the name the binaries use.
// Errors: INTERNAL naming the file and the errno text. Thread-safe.
absl::Status WriteOutputFile(const std::string& path, std::string_view bytes);

// CLI11 check that a value is a T in [min, max]. Unlike CLI::Range, whose message for a value
// of the wrong type ("abc", "1.5" for an integer) claims it is out of range, the message says
// which: "'abc' is not an integer (want -1..65535)", "70000 is outside -1..65535".
// Integers are plain decimal: an optional '-' and digits, no spaces, '+', hex or leading zero
// (CLI11 itself would read "010" as octal 8, "0x10" as 16, wrap "-1" into an unsigned type and
// clamp "18446744073709551616" to the type's maximum); a value beyond the type is "outside"
// too. Floating-point values may not carry spaces either; NaN is refused ("nan is outside").
// Usage: app.add_option("--metrics-port", port)->check(Range(-1, 65535)).
// How an integer value is spelled: plain decimal (an optional '-' and digits, no leading zero),
// something other than digits (empty, spaces, '+', hex, a list), digits with a leading zero, or
// "-0" (refused for signed and unsigned options alike: newcomer 16b F6 found it accepted by the
// one and called "outside 0..N" by the other). The one rule behind Range and the check Parse
// adds to every integer option. Pure.
enum class DecimalSpelling { kPlain, kNotDigits, kLeadingZero, kNegativeZero };
DecimalSpelling SpellingOf(std::string_view v);

template <typename T>
CLI::Validator Range(T min, T max) {
  static_assert(std::is_arithmetic_v<T>);
  const std::string want = CLI::detail::to_string(min) + ".." + CLI::detail::to_string(max);
  return CLI::Validator(
      [min, max, want](std::string& v) -> std::string {
        const std::string not_a = "'" + v + "' is not " +
                                  (std::is_integral_v<T> ? "an integer" : "a number") + " (want " +
                                  want + ")";
        const std::string outside = v + " is outside " + want;
        T x{};
        if constexpr (std::is_integral_v<T>) {
          const DecimalSpelling spelling = SpellingOf(v);
          if (spelling == DecimalSpelling::kNotDigits) return not_a;
          if (spelling == DecimalSpelling::kLeadingZero) {
            return "'" + v + "' is not a decimal integer (leading zero; want " + want + ")";
          }
          if (spelling == DecimalSpelling::kNegativeZero) {
            return "'" + v + "' is not a plain decimal integer (write 0; want " + want + ")";
          }
          if (!v.empty() && v[0] == '-' && std::is_unsigned_v<T>) return outside;
          const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
          if (ec == std::errc::result_out_of_range) return outside;
          if (ec != std::errc() || end != v.data() + v.size()) return not_a;
        } else {
          if (v.empty() || std::isspace(static_cast<unsigned char>(v.front())) ||
              std::isspace(static_cast<unsigned char>(v.back())) ||
              !CLI::detail::lexical_cast(v, x)) {
            return not_a;
          }
        }
        if (!(x >= min && x <= max)) {
          return outside;
        }
        return {};
      },
      "in " + want);
}

// CLI11 check that a value is HOST:PORT as kvpool::ParseHostPort (kvpool/common/host_port.h)
// reads it, port in min_port..65535; the message is ParseHostPort's without its field, which
// CLI11 puts in front: "--pool: '[::1]' has no port (want [::1]:PORT)". At parse time, so a
// value from a --config file is named with the file and its key.
// Usage: app.add_option("--pool", pool)->check(HostPortAddress(1)).
CLI::Validator HostPortAddress(int min_port);

// Parses; on --help/--version prints and returns kExitOk, on a usage error prints a one-line
// message and returns kExitUsage; returns -1 when the program should continue. --help (-h,
// --help-all) on the command line (not as another flag's value) wins over a usage error of
// another flag or of the --config file, as --version does (its callback runs before the other
// flags' checks): it prints the help of the subcommand it was given to ("kvpool quantize --clip 5
// --help"). First adds the boolean-words check (Setup) to every option of type bool and every
// flag of `app` and its subcommands, except --help, --help-all, --version and counting flags (an
// integer or vector add_flag, MultiOptionPolicy::TakeAll). Also adds, to every integer option
// (CLI11 type INT or UINT, any integral type) of `app` and its subcommands, a check that the
// value is plain decimal as Range reads it: without it CLI11 reads "0100" as octal 64, takes
// "0x10", "+16" and " 16", and wraps "-1" into an unsigned type ("--x: '0100' is not a decimal
// integer (leading zero)"). Give every integer option a Range all the same: only Range knows the
// bounds and names them in its message (it runs first).
int Parse(CLI::App& app, int argc, char** argv);

// For an error about a flag's value found after Parse (a check across flags): where the value came
// from when the --config file set it and the command line did not, as "--config 'FILE' key
// \"lease-ms\"", else "" (the command line, or the default). `flag`: its long name with the dashes
// ("--lease-ms"). After Parse with the same argc/argv. Not thread-safe (reads the app's state).
std::string ConfigSourceOf(const CLI::App& app, const std::string& flag, int argc, char** argv);

}  // namespace kvpool::cli

#define KVPOOL_CLI_PARSE(app, argc, argv)                             \
  do {                                                                \
    int kvpool_cli_rc_ = ::kvpool::cli::Parse((app), (argc), (argv)); \
    if (kvpool_cli_rc_ >= 0) return kvpool_cli_rc_;                   \
  } while (0)
