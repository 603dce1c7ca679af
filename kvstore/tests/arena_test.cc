#include <gtest/gtest.h>

#include "kvpool/kvstore/memory.h"

namespace kvpool::kvstore {
namespace {

TEST(ArenaTest, AllocatesAlignedAndCoalesces) {
  Arena a(4096, 256);
  auto x = a.Allocate(100);
  auto y = a.Allocate(300);
  auto z = a.Allocate(256);
  ASSERT_TRUE(x.ok() && y.ok() && z.ok());
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 256u);
  EXPECT_EQ(*z, 768u);
  EXPECT_EQ(a.used_bytes(), 1024u);
  a.Free(*y, 300);
  EXPECT_EQ(a.used_bytes(), 512u);
  a.Free(*x, 100);  // merges with y's range
  EXPECT_EQ(a.free_ranges(), 2u);
  a.Free(*z, 256);  // merges everything
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.used_bytes(), 0u);
  auto big = a.Allocate(4096);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(*big, 0u);
}

TEST(ArenaTest, ExhaustionAndFragmentation) {
  Arena a(1024, 256);
  std::vector<uint64_t> offs;
  for (int i = 0; i < 4; ++i) {
    offs.push_back(*a.Allocate(256));
  }
  EXPECT_EQ(a.Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
  a.Free(offs[0], 256);
  a.Free(offs[2], 256);
  EXPECT_EQ(a.free_bytes(), 512u);
  // 512 bytes free but not contiguous.
  EXPECT_EQ(a.Allocate(512).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(a.Allocate(256).ok());
  EXPECT_EQ(a.Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HeapPoolMemoryTest, CreateAndRejectZero) {
  auto m = HeapPoolMemory::Create(10000);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)->size(), 10000u);
  EXPECT_EQ((*m)->remote_address(), reinterpret_cast<uint64_t>((*m)->data()));
  EXPECT_EQ((*m)->data()[9999], 0);
  EXPECT_EQ(HeapPoolMemory::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::kvstore
