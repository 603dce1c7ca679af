// Unit tests of kvpool/worker/pool_node.h that need no pool (worker_pool_test).
#include "kvpool/worker/pool_node.h"

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "kvpool/common/room_shortage.h"

namespace kvpool::worker {
namespace {

absl::Status WithShortage(std::string message, RoomShortage r) {
  absl::Status s = absl::ResourceExhaustedError(std::move(message));
  SetRoomShortage(s, r);
  return s;
}

// Protocol v1.7: the pool's numbers come as a payload (the v1.7 trailer, kvpool/common/
// room_shortage.h), so the prefill node's room wait no longer depends on the message's words
// (newcomer s10b: it parsed numbers out of the RESOURCE_EXHAUSTED text).
TEST(RoomHeldByOthersTest, TakesThePoolsNumbersFromThePayload) {
  // Need 7424, room 5632, 4608 pinned by leases: fits once they go.
  EXPECT_TRUE(RoomHeldByOthers(WithShortage("any words", {7424, 5632, 0, 4608})));
  EXPECT_TRUE(RoomHeldByOthers(WithShortage("", {600, 100, 500, 0})));
  // Nothing held by others: a put too large for the pool, not pressure that passes.
  EXPECT_FALSE(RoomHeldByOthers(WithShortage("any words", {7424, 5632, 0, 0})));
  // Too large even once the others are gone.
  EXPECT_FALSE(RoomHeldByOthers(WithShortage("any words", {20000, 5632, 1000, 4608})));
  // The payload wins over numbers in the message.
  EXPECT_FALSE(RoomHeldByOthers(WithShortage(
      "num_blocks: pool full: cannot allocate 512 bytes (5376 of 10240 bytes used: 512 bytes "
      "staging of open puts, 4864 bytes forms of leased or pinned blocks, 0 bytes other forms "
      "eviction cannot free now (ancestors of pinned blocks); 4864 bytes free but fragmented)",
      {20000, 0, 0, 0})));
  // Another code never is.
  absl::Status other = absl::UnavailableError("x");
  SetRoomShortage(other, {1, 1, 1, 1});
  EXPECT_FALSE(RoomHeldByOthers(other));
}

// A pool before v1.7 sends the numbers in its message only: still read from there.
TEST(RoomHeldByOthersTest, ReadsTheMessageOfAPoolBeforeV17) {
  EXPECT_TRUE(RoomHeldByOthers(absl::ResourceExhaustedError(
      "num_blocks: pool full: cannot allocate 512 bytes (5376 of 10240 bytes used: 512 bytes "
      "staging of open puts, 4864 bytes forms of leased or pinned blocks, 0 bytes other forms "
      "eviction cannot free now (ancestors of pinned blocks); 4864 bytes free but fragmented)")));
  EXPECT_TRUE(RoomHeldByOthers(absl::ResourceExhaustedError(
      "num_blocks: the pool cannot hold this put's commit: it needs 7424 bytes at once (4096 "
      "bytes of staging for the 8 of 8 blocks to write, plus 3328 bytes for their new forms, "
      "allocated while the staging is held), and eviction can make at most 5632 of the pool's "
      "10240 bytes free (0 bytes are staging of other open puts, 4608 bytes are forms of leased "
      "or pinned blocks); release leases or put fewer blocks")));
  EXPECT_FALSE(RoomHeldByOthers(absl::ResourceExhaustedError("no numbers here")));
}

}  // namespace
}  // namespace kvpool::worker
