// kvpool/common/atomic_file.h — replacing a file atomically (temporary file + rename), writing
// through symbolic links. The one implementation behind every file kvpool writes: the binaries'
// output files (kvpool::cli::WriteOutputFile), safetensors files (SafetensorsWriter::WriteFile)
// and rotation files (WriteRotationFile).
//
//   KVPOOL_RETURN_IF_ERROR(kvpool::WriteFileAtomically("out/report.json", json));
//
// No third-party header; safe to include anywhere.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace kvpool {

// Largest number of symbolic links AtomicWriteTarget follows (the kernel's ELOOP limit).
inline constexpr int kMaxFollowedLinks = 40;

// The file a write to `path` replaces: `path` itself, or, when `path` is a symbolic link
// (possibly a chain), the file the last link names (a relative target is resolved against its
// link's directory; a dangling link names the missing file it points to). Follows at most
// kMaxFollowedLinks links; when the chain is longer it stops there and sets `*too_many_links`
// (when given) to true, else false. Reads the file system (lstat, readlink); never fails;
// thread-safe.
std::string AtomicWriteTarget(const std::string& path, bool* too_many_links = nullptr);

// Writes `bytes` to AtomicWriteTarget(path) atomically: into a new temporary file in the
// target's directory ("TARGET.tmp-PID-N", O_EXCL, mode 0666 minus the umask), given the mode of
// the file it replaces, flushed to disk (fsync), then renamed over the target, so a reader sees
// the old or the new content, never a part, and a symbolic link `path` stays a link whose
// target has the new bytes. Errors: INTERNAL naming the file ("'T'", or "'T' (the target of
// 'P')" for a link) and the errno text; the temporary file is removed. Thread-safe (two writers
// of one path: the last rename wins).
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

}  // namespace kvpool
