// rotation_path confinement (see rotation_source.h).
#include "rotation_source.h"

#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kvpool/common/log.h"

namespace kvpool::kvstore {
namespace {

namespace fs = std::filesystem;

// realpath(3) of `path`, or errno.
absl::StatusOr<std::string> RealPath(const std::string& path, int* err) {
  std::unique_ptr<char, decltype(&std::free)> real(::realpath(path.c_str(), nullptr), &std::free);
  if (real == nullptr) {
    *err = errno;
    return absl::NotFoundError("realpath");
  }
  return std::string(real.get());
}

// True when `p` (lexically normal, absolute) is `dir` itself or lies below it.
bool Within(const std::string& p, const std::string& dir) {
  if (dir == "/") return !p.empty() && p.front() == '/';
  return p == dir ||
         (p.size() > dir.size() && p.compare(0, dir.size(), dir) == 0 && p[dir.size()] == '/');
}

}  // namespace

absl::StatusOr<std::string> ResolveRotationPath(const std::string& rotation_dir,
                                                const std::string& path) {
  if (rotation_dir.empty()) {
    return absl::FailedPreconditionError(
        "rotation_path: this pool reads no rotation file from its own disk (it was started "
        "without --rotation-dir); send the file's bytes in rotation_file, or start the pool with "
        "--rotation-dir DIR and name a file under DIR");
  }
  const std::string where = absl::StrCat("rotation_path ", QuotedPath(path));
  if (path.empty()) return absl::InvalidArgumentError("rotation_path: empty");
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(where, " contains a NUL byte"));
  }
  const fs::path given(path);
  for (const fs::path& part : given) {
    if (part == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " contains '..'; name a file under the pool's --rotation-dir without it"));
    }
  }
  const fs::path dir(rotation_dir);
  const fs::path joined = (given.is_absolute() ? given : dir / given).lexically_normal();
  const std::string candidate = joined.string();
  if (!Within(candidate, rotation_dir) || candidate == rotation_dir ||
      candidate == rotation_dir + "/") {
    return absl::InvalidArgumentError(absl::StrCat(
        where,
        " is not under the pool's --rotation-dir; name a file there (a relative path is taken "
        "from that directory)"));
  }
  int err = 0;
  auto real = RealPath(candidate, &err);
  if (!real.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " cannot be opened (", std::strerror(err), ")"));
  }
  if (!Within(*real, rotation_dir) || *real == rotation_dir) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     " leads out of the pool's --rotation-dir through a symbolic link; name a file "
                     "inside it"));
  }
  return *std::move(real);
}

std::string QuotedPath(const std::string& path) {
  constexpr size_t kMax = 200;
  std::string out = "'";
  for (size_t i = 0; i < path.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(path[i]);
    out.push_back(c >= 0x20 && c <= 0x7e ? static_cast<char>(c) : '?');
  }
  if (path.size() > kMax) out += "...";
  out += "'";
  return out;
}

absl::StatusOr<std::string> CanonicalRotationDir(const std::string& dir) {
  if (dir.empty()) return std::string();
  const std::string where = absl::StrCat("rotation-dir ", QuotedPath(dir));
  if (dir.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(where, " contains a NUL byte"));
  }
  int err = 0;
  auto real = RealPath(dir, &err);
  if (!real.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " cannot be resolved (", std::strerror(err), ")"));
  }
  struct stat st {};
  if (::stat(real->c_str(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " cannot be examined (", std::strerror(errno), ")"));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(where, " is not a directory"));
  }
  if (*real == "/") {
    KVPOOL_LOG_WARN(
        "--rotation-dir is '/': any client may make the pool read any file it can read (a "
        "non-rotation file is refused, but its existence shows); name a directory that holds "
        "only rotation files (docs/OPERATIONS.md \"Trust model\")");
  }
  return real;
}

}  // namespace kvpool::kvstore
