// rotation_source.h: RegisterModelRequest.rotation_path is confined to the pool's --rotation-dir
// (relative names taken from it, no '..', symbolic links resolved and kept inside, nothing
// looked up outside it), and refused outright without one.
#include "rotation_source.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "kvpool/kvstore/server.h"

namespace kvpool::kvstore {
namespace {

namespace fs = std::filesystem;

class RotationSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ =
        fs::weakly_canonical(fs::path(::testing::TempDir()) / "kvpool_rotation_source").string();
    fs::remove_all(root_);
    fs::create_directories(root_ + "/rot/sub");
    fs::create_directories(root_ + "/outside");
    std::ofstream(root_ + "/rot/r.safetensors") << "r";
    std::ofstream(root_ + "/rot/sub/s.safetensors") << "s";
    std::ofstream(root_ + "/outside/secret") << "x";
    auto dir = CanonicalRotationDir(root_ + "/rot");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
  }
  void TearDown() override { fs::remove_all(root_); }

  // The refusal of `path`: its code and message.
  absl::Status Refusal(const std::string& path) {
    auto r = ResolveRotationPath(dir_, path);
    EXPECT_FALSE(r.ok()) << path << " resolved to " << *r;
    return r.ok() ? absl::OkStatus() : r.status();
  }

  std::string root_;
  std::string dir_;
};

TEST_F(RotationSourceTest, WithoutADirectoryEveryPathIsRefusedSayingWhatToDoInstead) {
  for (const std::string& path : {root_ + "/rot/r.safetensors", std::string("r.safetensors")}) {
    auto r = ResolveRotationPath("", path);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    const std::string msg(r.status().message());
    EXPECT_EQ(msg.rfind("rotation_path: ", 0), 0u) << msg;
    EXPECT_NE(msg.find("rotation_file"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--rotation-dir"), std::string::npos) << msg;
  }
}

TEST_F(RotationSourceTest, RelativeAndAbsoluteNamesInsideResolve) {
  auto rel = ResolveRotationPath(dir_, "r.safetensors");
  ASSERT_TRUE(rel.ok()) << rel.status();
  EXPECT_EQ(*rel, root_ + "/rot/r.safetensors");
  auto sub = ResolveRotationPath(dir_, "./sub//s.safetensors");
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ(*sub, root_ + "/rot/sub/s.safetensors");
  auto abs = ResolveRotationPath(dir_, root_ + "/rot/sub/s.safetensors");
  ASSERT_TRUE(abs.ok()) << abs.status();
  EXPECT_EQ(*abs, root_ + "/rot/sub/s.safetensors");
  // A link inside that stays inside resolves to its target.
  fs::create_symlink("sub/s.safetensors", root_ + "/rot/alias");
  auto alias = ResolveRotationPath(dir_, "alias");
  ASSERT_TRUE(alias.ok()) << alias.status();
  EXPECT_EQ(*alias, root_ + "/rot/sub/s.safetensors");
}

TEST_F(RotationSourceTest, DotDotIsRefusedWhereverItStands) {
  for (const std::string& path :
       {std::string("../outside/secret"), std::string("sub/../../outside/secret"),
        std::string("sub/../r.safetensors"), root_ + "/rot/../outside/secret", std::string("..")}) {
    const absl::Status s = Refusal(path);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_NE(s.message().find("contains '..'"), std::string::npos) << s;
    EXPECT_NE(s.message().find("rotation_path"), std::string::npos) << s;
  }
}

TEST_F(RotationSourceTest, AbsolutePathsOutsideAreRefusedAlikeWhetherTheyExistOrNot) {
  const absl::Status exists = Refusal(root_ + "/outside/secret");
  const absl::Status missing = Refusal(root_ + "/outside/no-such-file");
  for (const absl::Status& s : {exists, missing}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("is not under the pool's --rotation-dir"), std::string::npos) << s;
  }
  // Only the quoted path differs: nothing about the file itself comes back.
  EXPECT_EQ(std::string(exists.message()).substr(exists.message().find("' is not")),
            std::string(missing.message()).substr(missing.message().find("' is not")));
  // A sibling whose name starts with the directory's name is not inside it.
  fs::create_directories(root_ + "/rotten");
  std::ofstream(root_ + "/rotten/f") << "f";
  EXPECT_NE(Refusal(root_ + "/rotten/f").message().find("is not under"), std::string::npos);
  // Neither is the directory itself.
  EXPECT_NE(Refusal(dir_).message().find("is not under"), std::string::npos);
  EXPECT_NE(Refusal(".").message().find("is not under"), std::string::npos);
  EXPECT_NE(Refusal("/etc/passwd").message().find("is not under"), std::string::npos);
}

TEST_F(RotationSourceTest, LinksLeadingOutAndMissingFilesAreRefused) {
  fs::create_symlink(root_ + "/outside/secret", root_ + "/rot/escape");
  fs::create_symlink("../outside", root_ + "/rot/outdir");
  for (const std::string& path : {std::string("escape"), std::string("outdir/secret")}) {
    const absl::Status s = Refusal(path);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("leads out of the pool's --rotation-dir"), std::string::npos) << s;
  }
  const absl::Status missing = Refusal("no-such.safetensors");
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("rotation_path 'no-such.safetensors' cannot be opened"),
            std::string::npos)
      << missing;
  // Malformed input.
  EXPECT_EQ(Refusal("").message(), "rotation_path: empty");
  EXPECT_NE(Refusal(std::string("r\0x", 3)).message().find("NUL"), std::string::npos);
  // Messages quote the client's words, never the directory.
  EXPECT_EQ(missing.message().find(dir_), std::string::npos) << missing;
}

TEST_F(RotationSourceTest, TheRootDirectoryAdmitsEveryFile) {
  auto zero = ResolveRotationPath("/", "/dev/zero");
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_EQ(*zero, "/dev/zero");  // what the file is, is for the reader to check
  auto rel = ResolveRotationPath("/", "dev/null");
  ASSERT_TRUE(rel.ok()) << rel.status();
  EXPECT_EQ(*rel, "/dev/null");
  EXPECT_EQ(Refusal("/").code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RotationSourceTest, TheDirectoryIsCanonicalAndMustBeADirectory) {
  auto empty = CanonicalRotationDir("");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, "");
  fs::create_symlink(root_ + "/rot", root_ + "/link-to-rot");
  auto linked = CanonicalRotationDir(root_ + "/link-to-rot/");
  ASSERT_TRUE(linked.ok()) << linked.status();
  EXPECT_EQ(*linked, root_ + "/rot");
  auto missing = CanonicalRotationDir(root_ + "/no-such-dir");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("rotation-dir '" + root_ + "/no-such-dir'"),
            std::string::npos)
      << missing.status();
  auto file = CanonicalRotationDir(root_ + "/rot/r.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_NE(file.status().message().find("is not a directory"), std::string::npos) << file.status();
  // PoolServer::Create checks it before anything starts.
  PoolServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_port = -1;
  o.capacity_bytes = 1 << 20;
  o.data_plane = "none";
  o.rotation_dir = root_ + "/rot/r.safetensors";
  auto server = PoolServer::Create(o);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("rotation-dir"), std::string::npos) << server.status();
}

}  // namespace
}  // namespace kvpool::kvstore
