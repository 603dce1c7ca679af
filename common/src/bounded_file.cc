// The bounded regular-file reader (see bounded_file.h).
#include "kvpool/common/bounded_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

namespace kvpool {

const char* FileTypeWords(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "a special file";
}

std::string HumanByteCount(uint64_t n) {
  static const char* const kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double v = static_cast<double>(n);
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[48];
  if (u == 0 || v == static_cast<double>(static_cast<uint64_t>(v))) {
    std::snprintf(buf, sizeof(buf), "%.0f %s", v, kUnits[u]);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[u]);
  }
  return buf;
}

std::string RelativePathNote(const std::string& path) {
  if (path.empty() || path.front() == '/') return {};
  std::error_code ec;
  const std::filesystem::path cwd = std::filesystem::current_path(ec);
  if (ec) return {};
  return " (relative to the current directory " + cwd.string() + ")";
}

absl::StatusOr<std::string> ReadBoundedRegularFile(const std::string& path, uint64_t max_bytes,
                                                   FileReadInfo* info, bool exact_size) {
  FileReadInfo local;
  FileReadInfo& out = info != nullptr ? *info : local;
  out = FileReadInfo{};
  const std::string quoted = "'" + path + "'";
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) {
    out.stage = FileReadInfo::Stage::kOpen;
    out.error = errno;
    return absl::NotFoundError("cannot open " + quoted + ": " + std::strerror(out.error) +
                               RelativePathNote(path));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    out.stage = FileReadInfo::Stage::kStat;
    out.error = errno;
    return absl::InternalError("cannot stat " + quoted + ": " + std::strerror(out.error));
  }
  out.type = FileTypeWords(st.st_mode);
  out.size = static_cast<uint64_t>(st.st_size);
  if (!S_ISREG(st.st_mode)) {
    out.stage = FileReadInfo::Stage::kNotRegular;
    return absl::InvalidArgumentError(quoted + " is " + out.type + ", not a regular file");
  }
  if (out.size > max_bytes) {
    out.stage = FileReadInfo::Stage::kTooLarge;
    return absl::InvalidArgumentError(quoted + " is " + HumanByteCount(out.size) + " (" +
                                      std::to_string(out.size) + " bytes), above the limit of " +
                                      HumanByteCount(max_bytes));
  }
  // Read to the end, not st_size bytes: the file may change while being read. The bytes fstat
  // promised go straight into the result (no second copy of a 256 MiB rotation file); more is
  // appended from a small buffer, up to the limit.
  std::string bytes(static_cast<size_t>(out.size), '\0');
  size_t got = 0;
  std::vector<char> extra;
  while (!exact_size || got < bytes.size()) {
    const bool in_place = got < bytes.size();
    if (!in_place && extra.empty()) extra.resize(size_t{1} << 16);
    char* dst = in_place ? bytes.data() + got : extra.data();
    const size_t room = in_place ? bytes.size() - got : extra.size();
    const ssize_t n = ::read(fd, dst, room);
    if (n < 0) {
      if (errno == EINTR) continue;
      out.stage = FileReadInfo::Stage::kRead;
      out.error = errno;
      return absl::InternalError("cannot read " + quoted + ": " + std::strerror(out.error));
    }
    if (n == 0) break;
    if (got + static_cast<uint64_t>(n) > max_bytes) {
      out.stage = FileReadInfo::Stage::kGrew;
      return absl::InvalidArgumentError(quoted + " grew above the limit of " +
                                        HumanByteCount(max_bytes) + " while being read");
    }
    if (!in_place) bytes.append(extra.data(), static_cast<size_t>(n));
    got += static_cast<size_t>(n);
  }
  if (exact_size && got != bytes.size()) {
    out.stage = FileReadInfo::Stage::kShrank;
    return absl::InvalidArgumentError(quoted + " changed size while being read");
  }
  bytes.resize(got);  // shorter when the file shrank meanwhile
  return bytes;
}

}  // namespace kvpool
