// Atomic file replacement (see kvpool/common/atomic_file.h).
#include "kvpool/common/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace kvpool {

std::string AtomicWriteTarget(const std::string& path, bool* too_many_links) {
  namespace fs = std::filesystem;
  fs::path p = path;
  for (int hops = 0; hops <= kMaxFollowedLinks; ++hops) {
    std::error_code ec;
    const fs::file_status st = fs::symlink_status(p, ec);
    if (ec || !fs::is_symlink(st)) break;
    const fs::path next = fs::read_symlink(p, ec);
    if (ec) break;
    p = next.is_absolute() ? next : p.parent_path() / next;
    if (hops == kMaxFollowedLinks) {
      if (too_many_links != nullptr) *too_many_links = true;
      return p.string();
    }
  }
  if (too_many_links != nullptr) *too_many_links = false;
  return p.string();
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  const std::string target = AtomicWriteTarget(path);
  const std::string named =
      target == path ? "'" + path + "'" : "'" + target + "' (the target of '" + path + "')";
  // O_EXCL under a name of this process (pid, counter): the kernel applies the umask to 0666,
  // as for any new file.
  static std::atomic<unsigned> counter{0};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 100; ++attempt) {
    tmp = target + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    const int err = errno;
    return absl::InternalError("cannot create a temporary file beside " + named + ": " +
                               std::strerror(err));
  }
  auto fail = [&](const char* what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return absl::InternalError(std::string("cannot ") + what + " " + named + ": " +
                               std::strerror(err));
  };
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail("write");
    }
    done += static_cast<size_t>(n);
  }
  // A replaced file keeps its mode.
  struct stat old {};
  if (::stat(target.c_str(), &old) == 0 && ::fchmod(fd, old.st_mode & 07777) != 0) {
    return fail("set the mode of");
  }
  if (::fsync(fd) != 0) return fail("flush");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::InternalError("cannot write " + named + ": " + std::strerror(err));
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::InternalError("cannot replace " + named + ": " + std::strerror(err));
  }
  return absl::OkStatus();
}

}  // namespace kvpool
