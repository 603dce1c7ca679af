// The shared bounded reader of regular files (kvpool/common/bounded_file.h).
#include "kvpool/common/bounded_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace kvpool {
namespace {

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// A relative path that cannot be opened names the directory it was taken from (a --config
// file's directory is not: newcomer s9 A12); an absolute one needs no note.
TEST(BoundedFileTest, AMissingRelativePathNamesTheCurrentDirectory) {
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof(cwd)), nullptr);
  const std::string note = std::string(" (relative to the current directory ") + cwd + ")";
  EXPECT_EQ(RelativePathNote("no/such/file.txt"), note);
  EXPECT_EQ(RelativePathNote("../x"), note);
  EXPECT_EQ(RelativePathNote("/abs/x"), "");
  EXPECT_EQ(RelativePathNote(""), "");
  auto rel = ReadBoundedRegularFile("kvpool-no-such-dir/f.txt", 100);
  ASSERT_FALSE(rel.ok());
  EXPECT_EQ(rel.status().message(),
            "cannot open 'kvpool-no-such-dir/f.txt': No such file or directory" + note);
  auto abs = ReadBoundedRegularFile("/kvpool-no-such-dir/f.txt", 100);
  ASSERT_FALSE(abs.ok());
  EXPECT_EQ(abs.status().message(),
            "cannot open '/kvpool-no-such-dir/f.txt': No such file or directory");
}

TEST(BoundedFileTest, ReadsRegularFilesWholeUpToTheLimit) {
  const std::string path = WriteFile("kvpool_bounded_ok.bin", std::string("ab\0cd", 5));
  FileReadInfo info;
  auto bytes = ReadBoundedRegularFile(path, 5, &info);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, std::string("ab\0cd", 5));
  EXPECT_EQ(info.stage, FileReadInfo::Stage::kOk);
  EXPECT_EQ(info.size, 5u);
  auto exact = ReadBoundedRegularFile(path, 5, &info, /*exact_size=*/true);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_EQ(*exact, *bytes);

  auto big = ReadBoundedRegularFile(path, 4, &info);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(info.stage, FileReadInfo::Stage::kTooLarge);
  EXPECT_EQ(info.size, 5u);
  EXPECT_NE(big.status().message().find("above the limit of 4 bytes"), std::string::npos)
      << big.status();
  std::remove(path.c_str());
}

TEST(BoundedFileTest, RefusesWhatIsNotARegularFileBeforeReading) {
  FileReadInfo info;
  auto dev = ReadBoundedRegularFile("/dev/zero", 1 << 20, &info);
  EXPECT_EQ(dev.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(info.stage, FileReadInfo::Stage::kNotRegular);
  EXPECT_STREQ(info.type, "a character device");
  auto dir = ReadBoundedRegularFile(::testing::TempDir(), 1 << 20, &info);
  EXPECT_EQ(info.stage, FileReadInfo::Stage::kNotRegular);
  EXPECT_NE(dir.status().message().find("is a directory, not a regular file"), std::string::npos)
      << dir.status();
  // A FIFO nobody writes to: refused at once (the open does not block).
  const std::string fifo = ::testing::TempDir() + "/kvpool_bounded_fifo";
  std::remove(fifo.c_str());
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  auto f = ReadBoundedRegularFile(fifo, 1 << 20, &info);
  EXPECT_EQ(info.stage, FileReadInfo::Stage::kNotRegular);
  EXPECT_STREQ(info.type, "a FIFO");
  std::remove(fifo.c_str());
  auto missing = ReadBoundedRegularFile("/nonexistent/kvpool", 1, &info);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(info.stage, FileReadInfo::Stage::kOpen);
}

// exact_size reads only what fstat promised: a file whose size reads as 0 (/proc) yields nothing.
TEST(BoundedFileTest, ExactSizeReadsNothingFromFilesWhoseSizeReadsAsZero) {
  FileReadInfo info;
  auto proc = ReadBoundedRegularFile("/proc/self/status", 1 << 20, &info, /*exact_size=*/true);
  ASSERT_TRUE(proc.ok()) << proc.status();
  EXPECT_TRUE(proc->empty());
  EXPECT_EQ(info.size, 0u);
  auto whole = ReadBoundedRegularFile("/proc/self/status", 1 << 20, &info);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_NE(whole->find("Name:"), std::string::npos);
  auto over = ReadBoundedRegularFile("/proc/self/status", 8, &info);
  EXPECT_EQ(info.stage, FileReadInfo::Stage::kGrew);
  EXPECT_NE(over.status().message().find("grew above the limit of 8 bytes"), std::string::npos)
      << over.status();
}

TEST(BoundedFileTest, FileTypeWordsAndByteCounts) {
  EXPECT_STREQ(FileTypeWords(S_IFREG), "a regular file");
  EXPECT_STREQ(FileTypeWords(S_IFDIR), "a directory");
  EXPECT_STREQ(FileTypeWords(S_IFBLK), "a block device");
  EXPECT_STREQ(FileTypeWords(S_IFSOCK), "a socket");
  EXPECT_EQ(HumanByteCount(512), "512 bytes");
  EXPECT_EQ(HumanByteCount(uint64_t{64} << 20), "64 MiB");
  EXPECT_EQ(HumanByteCount((uint64_t{70} << 30) + (uint64_t{1} << 29)), "70.5 GiB");
}

}  // namespace
}  // namespace kvpool
