// ProcessMemoryLimit / MemAvailableBytes over fake /proc and cgroup trees
// (kvstore/src/memory_limit.h).
#include "memory_limit.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace kvpool::kvstore {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kGiB = 1ull << 30;

class MemoryLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) /
            ("kvpool_memory_limit_" +
             std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  // Writes `text` to root_/rel, creating its folders.
  std::string Write(const std::string& rel, const std::string& text) {
    const fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }
  std::string Cg() const { return (root_ / "cg").string(); }
  fs::path root_;
};

TEST_F(MemoryLimitTest, CgroupV2TakesTheLowestLimitOfItselfAndItsParents) {
  const std::string self = Write("proc_cgroup", "0::/kubepods/pod1/ctr\n");
  Write("cg/kubepods/pod1/ctr/memory.max", "max\n");
  Write("cg/kubepods/pod1/memory.max", std::to_string(10 * kGiB) + "\n");
  Write("cg/kubepods/memory.max", std::to_string(12 * kGiB) + "\n");
  Write("cg/kubepods/pod1/memory.current", std::to_string(3 * kGiB) + "\n");
  MemoryLimit l = ProcessMemoryLimit(64 * kGiB, self, Cg());
  EXPECT_EQ(l.bytes, 10 * kGiB);
  EXPECT_EQ(l.source, "cgroup limit " + Cg() + "/kubepods/pod1/memory.max");
  EXPECT_EQ(l.used, 3 * kGiB);  // the limiting cgroup's usage, beside its limit
  // Physical memory below every limit wins.
  l = ProcessMemoryLimit(8 * kGiB, self, Cg());
  EXPECT_EQ(l.bytes, 8 * kGiB);
  EXPECT_EQ(l.source, "physical memory");
}

TEST_F(MemoryLimitTest, ContainerWithoutCgroupNamespaceFindsItsLimitAtTheRoot) {
  // /proc/self/cgroup names the host's path; the container's own cgroup is mounted at the root.
  const std::string self = Write("proc_cgroup", "0::/system.slice/docker-abc.scope\n");
  Write("cg/memory.max", std::to_string(2 * kGiB) + "\n");
  EXPECT_EQ(ProcessMemoryLimit(64 * kGiB, self, Cg()).bytes, 2 * kGiB);
}

TEST_F(MemoryLimitTest, CgroupV1ReadsTheMemoryControllersLimitAndIgnoresUnlimited) {
  const std::string self = Write("proc_cgroup",
                                 "5:cpu,cpuacct:/user/x\n"
                                 "4:memory:/user/x/job\n"
                                 "1:name=systemd:/user/x\n");
  Write("cg/memory/user/x/job/memory.limit_in_bytes", "9223372036854771712\n");
  Write("cg/memory/user/x/memory.limit_in_bytes", std::to_string(3 * kGiB) + "\n");
  Write("cg/memory/memory.limit_in_bytes", "9223372036854771712\n");
  // A cpu controller's file of the same name must not count.
  Write("cg/user/x/memory.limit_in_bytes", std::to_string(1 * kGiB) + "\n");
  Write("cg/memory/user/x/memory.usage_in_bytes", "1048576\n");
  MemoryLimit l = ProcessMemoryLimit(64 * kGiB, self, Cg());
  EXPECT_EQ(l.bytes, 3 * kGiB);
  EXPECT_EQ(l.source, "cgroup limit " + Cg() + "/memory/user/x/memory.limit_in_bytes");
  EXPECT_EQ(l.used, 1048576u);
}

TEST_F(MemoryLimitTest, NoCgroupFileOrUnreadableValuesMeanPhysicalMemory) {
  EXPECT_EQ(ProcessMemoryLimit(16 * kGiB, (root_ / "absent").string(), Cg()).bytes, 16 * kGiB);
  const std::string self = Write("proc_cgroup", "0::/a\ngarbage line\n3:memory\n");
  Write("cg/a/memory.max", "not a number\n");
  Write("cg/memory.max", "0\n");
  MemoryLimit l = ProcessMemoryLimit(16 * kGiB, self, Cg());
  EXPECT_EQ(l.bytes, 16 * kGiB);
  EXPECT_EQ(l.source, "physical memory");
  EXPECT_EQ(l.used, 0u);
  // Physical memory unknown (0): a limit still counts.
  Write("cg/a/memory.max", "4096\n");
  EXPECT_EQ(ProcessMemoryLimit(0, self, Cg()).bytes, 4096u);
}

TEST_F(MemoryLimitTest, MemAvailableIsReadInBytes) {
  EXPECT_EQ(MemAvailableBytes(Write("meminfo",
                                    "MemTotal:       24576000 kB\n"
                                    "MemFree:         1000000 kB\n"
                                    "MemAvailable:   20000000 kB\n")),
            20000000ull << 10);
  EXPECT_EQ(MemAvailableBytes(Write("meminfo2", "MemTotal: 1 kB\n")), 0u);
  EXPECT_EQ(MemAvailableBytes((root_ / "absent").string()), 0u);
  // The real file of this machine has it (Linux >= 3.14).
  EXPECT_GT(MemAvailableBytes(), 0u);
}

}  // namespace
}  // namespace kvpool::kvstore
