// Internal: where RegisterModelRequest.rotation_path may point. The pool reads a rotation file
// from its own disk for a client only under the directory its operator named with
// `kvpool-server --rotation-dir DIR` (docs/OPERATIONS.md "Trust model"); without one it reads
// none. No gRPC header here.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace kvpool::kvstore {

// The path the pool may read for `path` (rotation_path exactly as the client sent it), given
// `rotation_dir` (PoolServerOptions::rotation_dir as PoolServer::Create resolved it: an absolute
// path without symbolic links, or "" when the pool reads no rotation files).
//
// Rules, checked in this order:
//   - `rotation_dir` empty: FAILED_PRECONDITION naming rotation_path and saying to send the
//     bytes (rotation_file) or to start the pool with --rotation-dir;
//   - `path` empty, holding a NUL byte, or with a ".." component: INVALID_ARGUMENT;
//   - a relative `path` is taken from `rotation_dir`; an absolute one must lie under it by its
//     words alone (no file-system access yet, so a client learns nothing about files elsewhere):
//     INVALID_ARGUMENT "not under the pool's --rotation-dir" otherwise;
//   - realpath(3) of it (every symbolic link resolved) fails: INVALID_ARGUMENT "cannot be
//     opened (<errno text>)";
//   - the resolved path lies outside `rotation_dir` (a link inside leads out): INVALID_ARGUMENT.
// Returns the resolved path (absolute, no links, strictly under `rotation_dir`); what the file
// is (regular, size) is for the reader to check. Messages quote `path` (at most 200 bytes,
// unprintable bytes as '?') and never the directory. A link swapped in after this check is
// followed by the reader: DIR must be writable only by the pool's operator.
// Thread-safe (reads the file system only).
absl::StatusOr<std::string> ResolveRotationPath(const std::string& rotation_dir,
                                                const std::string& path);

// `dir` as PoolServer::Create keeps it (ServiceContext::rotation_dir): "" stays "", anything
// else becomes its realpath(3), which must be a directory. Errors: INVALID_ARGUMENT naming
// --rotation-dir and the reason. Thread-safe.
absl::StatusOr<std::string> CanonicalRotationDir(const std::string& dir);

// `path` as a client sent it, for messages: at most 200 bytes, bytes outside printable ASCII as
// '?', in single quotes. Thread-safe.
std::string QuotedPath(const std::string& path);

}  // namespace kvpool::kvstore
