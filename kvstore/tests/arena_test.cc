#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

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

// A put's staging is freed after its commit allocated the forms, so the next put of the same
// size gets the same range back (first fit by address): the staging a streaming prefill writes
// stays the recently used one (docs/TRANSPORT.md "Session 6").
TEST(ArenaTest, FreedStagingGoesToTheNextAllocationOfItsSize) {
  Arena a(uint64_t{64} << 20, 256);
  const uint64_t staging_size = uint64_t{1} << 20;
  uint64_t first_staging = 0;
  for (int put = 0; put < 5; ++put) {
    auto staging = a.Allocate(staging_size);
    ASSERT_TRUE(staging.ok());
    if (put == 0) {
      first_staging = *staging;
    } else {
      EXPECT_EQ(*staging, first_staging) << "put " << put;
    }
    auto form = a.Allocate(staging_size);  // the commit's form, while the staging is held
    ASSERT_TRUE(form.ok());
    EXPECT_NE(*form, *staging);
    a.Free(*staging, staging_size);
  }
  EXPECT_EQ(a.used_bytes(), 5 * staging_size);  // the five forms
}

// DemoteToSharedCache is a cache hint: every byte of the buffer is the same afterwards, for
// unaligned ranges, ranges shorter than a line and empty ones.
TEST(DemoteToSharedCacheTest, ChangesNoByte) {
  std::vector<uint8_t> buf(3 * 4096 + 77);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131 + 7);
  const std::vector<uint8_t> want = buf;
  DemoteToSharedCache(buf.data(), buf.size());
  DemoteToSharedCache(buf.data() + 13, 1000);
  DemoteToSharedCache(buf.data() + 63, 2);
  DemoteToSharedCache(buf.data() + 5, 0);
  DemoteToSharedCache(nullptr, 0);
  EXPECT_EQ(buf, want);
}

TEST(HeapPoolMemoryTest, CreateAndRejectZero) {
  auto m = HeapPoolMemory::Create(10000);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)->size(), 10000u);
  EXPECT_EQ((*m)->remote_address(), reinterpret_cast<uint64_t>((*m)->data()));
  EXPECT_EQ((*m)->data()[9999], 0);
  EXPECT_EQ(HeapPoolMemory::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
  // Sizes whose page round-up wrapped to a tiny buffer (newcomer report 13b).
  for (size_t huge : {~size_t{0}, ~size_t{0} - 4095, (size_t{1} << 62) + 1}) {
    EXPECT_EQ(HeapPoolMemory::Create(huge).status().code(), absl::StatusCode::kInvalidArgument)
        << huge;
  }
}

}  // namespace
}  // namespace kvpool::kvstore
