// kvpool/common/atomic_file.h: the one atomic writer (temporary file + rename, through symbolic
// links) and its users SafetensorsWriter::WriteFile and cli::WriteOutputFile.
#include "kvpool/common/atomic_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvpool/common/cli.h"
#include "kvpool/common/safetensors.h"

namespace kvpool {
namespace {

namespace fs = std::filesystem;

std::string FreshDir(const std::string& name) {
  const std::string dir =
      (fs::path(::testing::TempDir()) / ("kvpool_atomic_" + name)).lexically_normal().string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Names in `dir`, sorted.
std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(AtomicFileTest, CreatesAndReplacesKeepingTheModeAndLeavingNoTemporaryFile) {
  const std::string dir = FreshDir("plain");
  const std::string path = dir + "/out.bin";
  ASSERT_TRUE(WriteFileAtomically(path, std::string("a\0b", 3)).ok());
  EXPECT_EQ(ReadAll(path), std::string("a\0b", 3));
  ASSERT_EQ(::chmod(path.c_str(), 0604), 0);
  ASSERT_TRUE(WriteFileAtomically(path, "second").ok());
  EXPECT_EQ(ReadAll(path), "second");
  EXPECT_EQ(fs::status(path).permissions(), static_cast<fs::perms>(0604));
  // Empty content is a valid file too.
  ASSERT_TRUE(WriteFileAtomically(path, "").ok());
  EXPECT_EQ(fs::file_size(path), 0u);
  EXPECT_EQ(Names(dir), std::vector<std::string>{"out.bin"});
}

TEST(AtomicFileTest, WritesThroughAChainOfRelativeLinksAndKeepsTheLinks) {
  const std::string dir = FreshDir("links");
  fs::create_directories(dir + "/a/b");
  { std::ofstream(dir + "/a/b/real.bin") << "old"; }
  fs::create_symlink("b/real.bin", dir + "/a/hop");  // relative to a/
  fs::create_symlink("a/hop", dir + "/link");        // relative to dir
  EXPECT_EQ(AtomicWriteTarget(dir + "/link"), dir + "/a/b/real.bin");
  EXPECT_EQ(AtomicWriteTarget(dir + "/a/b/real.bin"), dir + "/a/b/real.bin");
  ASSERT_TRUE(WriteFileAtomically(dir + "/link", "new").ok());
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir + "/link")));
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir + "/a/hop")));
  EXPECT_EQ(ReadAll(dir + "/a/b/real.bin"), "new");
  EXPECT_EQ(Names(dir + "/a/b"), std::vector<std::string>{"real.bin"});
  // A dangling link: the file it names is created.
  fs::create_symlink("a/b/made.bin", dir + "/dangling");
  ASSERT_TRUE(WriteFileAtomically(dir + "/dangling", "made").ok());
  EXPECT_EQ(ReadAll(dir + "/a/b/made.bin"), "made");
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir + "/dangling")));
}

TEST(AtomicFileTest, StopsAfterFortyLinks) {
  const std::string dir = FreshDir("loop");
  // l0 -> l1 -> ... -> l40 -> file: 41 links.
  { std::ofstream(dir + "/file") << "x"; }
  for (int i = 0; i <= 40; ++i) {
    const std::string next = i == 40 ? "file" : "l" + std::to_string(i + 1);
    fs::create_symlink(next, dir + "/l" + std::to_string(i));
  }
  bool too_many = false;
  EXPECT_EQ(AtomicWriteTarget(dir + "/l1", &too_many), dir + "/file");  // 40 links
  EXPECT_FALSE(too_many);
  AtomicWriteTarget(dir + "/l0", &too_many);  // 41 links
  EXPECT_TRUE(too_many);
  // A cycle ends too.
  fs::create_symlink("cyc_b", dir + "/cyc_a");
  fs::create_symlink("cyc_a", dir + "/cyc_b");
  AtomicWriteTarget(dir + "/cyc_a", &too_many);
  EXPECT_TRUE(too_many);
}

TEST(AtomicFileTest, ErrorsNameTheFileAndTheLinkAndLeaveNothingBehind) {
  const std::string dir = FreshDir("errors");
  absl::Status s = WriteFileAtomically(dir + "/missing-dir/out.bin", "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("'" + dir + "/missing-dir/out.bin'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("No such file or directory"), std::string::npos) << s;
  // Through a link: both names.
  fs::create_symlink("nowhere/out.bin", dir + "/link");
  s = WriteFileAtomically(dir + "/link", "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("'" + dir + "/nowhere/out.bin' (the target of '" + dir + "/link')"),
            std::string::npos)
      << s;
  // A directory cannot be replaced by a file: the rename fails and the temporary file goes.
  fs::create_directories(dir + "/adir");
  s = WriteFileAtomically(dir + "/adir", "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("cannot replace '" + dir + "/adir'"), std::string::npos) << s;
  EXPECT_EQ(Names(dir), (std::vector<std::string>{"adir", "link"}));
  // A file system that takes no new file.
  s = WriteFileAtomically("/proc/kvpool-atomic-test", "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("'/proc/kvpool-atomic-test'"), std::string::npos) << s;
}

// The two writers that had their own temporary-file code now share this one.
TEST(AtomicFileTest, SafetensorsAndCliWritersGoThroughIt) {
  const std::string dir = FreshDir("users");
  fs::create_directories(dir + "/real");
  { std::ofstream(dir + "/real/r.safetensors") << "old"; }
  fs::create_symlink("real/r.safetensors", dir + "/r.safetensors");
  SafetensorsWriter w;
  w.SetMetadata("format", "test");
  const std::vector<float> x = {1.0f, 2.0f};
  ASSERT_TRUE(w.AddF32("x", {2}, x).ok());
  ASSERT_TRUE(w.WriteFile(dir + "/r.safetensors").ok());
  // The link stays a link (the old writer renamed a file over it) and its target has the bytes.
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir + "/r.safetensors")));
  EXPECT_EQ(ReadAll(dir + "/real/r.safetensors"), w.Serialize());
  EXPECT_EQ(Names(dir), (std::vector<std::string>{"r.safetensors", "real"}));
  EXPECT_EQ(Names(dir + "/real"), std::vector<std::string>{"r.safetensors"});
  const absl::Status s = w.WriteFile(dir + "/none/r.safetensors");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find(dir + "/none/r.safetensors"), std::string::npos) << s;

  ASSERT_TRUE(cli::WriteOutputFile(dir + "/r.safetensors", "cli").ok());
  EXPECT_EQ(ReadAll(dir + "/real/r.safetensors"), "cli");
  EXPECT_EQ(cli::OutputTarget(dir + "/r.safetensors"), dir + "/real/r.safetensors");
}

}  // namespace
}  // namespace kvpool
