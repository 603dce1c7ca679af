// kvpool/common/bounded_file.h — one bounded reader of whole regular files, shared by every
// place that reads a file named by a user or a client (CLI input flags through
// kvpool::cli::ReadInputFile, the pool's RegisterModel rotation_path, the kvpool tool's --text),
// and the size limits of those files.
//
// The reader refuses what is not a regular file (directories, devices such as /dev/zero, FIFOs,
// sockets) and files above a limit before it reads a byte, and never blocks on a FIFO swapped in
// after an earlier path check. Callers word their own messages (a pool must not echo a client's
// path in the same words as a CLI), from the FileReadInfo the reader fills in.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace kvpool {

// Size limits of the input files read whole (docs/TOOLS.md "Input files"): text (prompts,
// calibration and evaluation text), rotation files (also the pool's limit, docs/OPERATIONS.md
// "Trust model"), GGUF models (the reference engine holds them in memory), and --config YAML.
inline constexpr uint64_t kMaxTextFileBytes = uint64_t{64} << 20;       // 64 MiB
inline constexpr uint64_t kMaxRotationFileBytes = uint64_t{256} << 20;  // 256 MiB
inline constexpr uint64_t kMaxModelFileBytes = uint64_t{64} << 30;      // 64 GiB
inline constexpr uint64_t kMaxConfigFileBytes = uint64_t{1} << 20;      // 1 MiB

// Words for a file type from a stat() st_mode: "a directory", "a character device", "a block
// device", "a FIFO", "a socket", "a symbolic link", "a regular file", else "a special file".
// Thread-safe.
const char* FileTypeWords(mode_t mode);

// Where a read by ReadBoundedRegularFile stopped, and what it saw.
struct FileReadInfo {
  enum class Stage {
    kOk,          // read whole
    kOpen,        // open() failed: `error`
    kStat,        // fstat() of the opened file failed: `error`
    kNotRegular,  // not a regular file: `type` says what it is
    kTooLarge,    // `size` (fstat) is above the limit
    kGrew,        // it grew above the limit while being read
    kShrank,      // exact_size: fewer than `size` bytes could be read
    kRead,        // read() failed: `error`
  };
  Stage stage = Stage::kOk;
  int error = 0;          // errno for kOpen, kStat and kRead
  const char* type = "";  // FileTypeWords of the opened file (from kStat on)
  uint64_t size = 0;      // st_size of the opened file (from kStat on)
};

// Reads the whole regular file at `path`, at most `max_bytes` bytes. Opens with O_NONBLOCK and
// O_NOCTTY (a FIFO or a terminal does not block) and checks the opened file with fstat: a file
// that is not regular, or larger than `max_bytes`, is refused before any byte is read. Reads to
// the end (the file may change while being read; growth beyond `max_bytes` is refused); the
// bytes fstat reported go straight into the result. With `exact_size` it reads only fstat's
// size instead: a file whose size reads as 0 (those under /proc) yields no byte without a read,
// and one that shrank meanwhile fails (kShrank). `info` (optional) receives where it stopped;
// `info->size` is fstat's size.
// Errors (messages name the path in single quotes; callers that must not echo it use `info`):
//   NOT_FOUND "cannot open 'P': <errno text>" (+ RelativePathNote(P)); INTERNAL "cannot stat 'P':
//   ..." or "cannot read 'P': ..."; INVALID_ARGUMENT "'P' is a FIFO, not a regular file",
//   "'P' is 70.0 GiB (N bytes), above the limit of 64 GiB", "'P' grew above the limit of 64 MiB
//   while being read", "'P' changed size while being read". Thread-safe.
absl::StatusOr<std::string> ReadBoundedRegularFile(const std::string& path, uint64_t max_bytes,
                                                   FileReadInfo* info = nullptr,
                                                   bool exact_size = false);

// For a message about a file that cannot be opened: " (relative to the current directory
// DIR)" when `path` is relative, "" when it is absolute. A relative path — on the command line
// or in a --config file — is taken from the current directory, not from the config file's
// (docs/TOOLS.md "Input files"); the note says which directory that was. Reads the current
// directory (std::filesystem::current_path); "" when it cannot. Thread-safe.
std::string RelativePathNote(const std::string& path);

// "70.0 GiB", "64 MiB", "512 bytes": a byte count for messages. Thread-safe.
std::string HumanByteCount(uint64_t bytes);

}  // namespace kvpool
