// kvpool/kvstore/memory.h — the pool's memory and time, behind small interfaces so the store
// logic is testable without UCX or real clocks.
//
//   auto mem = kvpool::kvstore::HeapPoolMemory::Create(64 << 20);   // tests
//   kvpool::kvstore::Arena arena(mem->size(), /*alignment=*/256);
//   absl::StatusOr<uint64_t> off = arena.Allocate(4096);            // offset into mem
//
// PoolMemory: one big buffer the pool serves from. The server backs it with pinned host memory
// registered with UCX (transport::MemoryRegion); tests use plain heap memory. Clock: the time
// source for lease and put expiry (FakeClock in tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvpool::kvstore {

// One contiguous buffer that peers address by `remote_address() + offset` with `packed_rkey()`.
// Thread-safety: immutable after creation; the bytes are synchronized by the store's protocol
// (a slot is written only while no reader can see it).
class PoolMemory {
 public:
  virtual ~PoolMemory() = default;
  virtual uint8_t* data() const = 0;
  virtual size_t size() const = 0;
  // The address peers use for byte 0 (for UCX: the virtual address of data()).
  virtual uint64_t remote_address() const = 0;
  // The packed UCX remote key of the buffer ("" for heap memory).
  virtual const std::string& packed_rkey() const = 0;
};

// Zeroed, 4096-byte aligned heap memory (not registered anywhere; for tests and for servers
// run without a data plane). remote_address() is the pointer value; packed_rkey() is empty.
class HeapPoolMemory final : public PoolMemory {
 public:
  // Errors: INVALID_ARGUMENT "capacity" when size is 0; RESOURCE_EXHAUSTED when allocation fails.
  static absl::StatusOr<std::unique_ptr<HeapPoolMemory>> Create(size_t size);
  ~HeapPoolMemory() override;
  uint8_t* data() const override { return data_; }
  size_t size() const override { return size_; }
  uint64_t remote_address() const override { return reinterpret_cast<uint64_t>(data_); }
  const std::string& packed_rkey() const override { return rkey_; }

 private:
  HeapPoolMemory(uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t* data_;
  size_t size_;
  std::string rkey_;
};

// Hints that the cache lines of [data, data + size) leave this core's private caches for the
// shared last-level cache (x86 CLDEMOTE, when the CPU reports it; otherwise, and on other
// architectures, nothing). Changes no byte; thread-safe. The pool calls it on the forms a commit
// just wrote, which another process reads next (a reader's first fetch then finds them in the
// shared cache instead of snooping this core's L2 for every line). Costs ~3-7 ns per 64-byte
// line on the benchmark host (docs/TRANSPORT.md "Session 6").
void DemoteToSharedCache(const void* data, size_t size);

// Time source. Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // The process-wide real clock (never null, never destroyed).
  static Clock* Real();
};

// A clock that moves only when told. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'000'000)) : now_(start) {}
  absl::Time Now() const override {
    std::lock_guard<std::mutex> l(mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    std::lock_guard<std::mutex> l(mu_);
    now_ += d;
  }

 private:
  mutable std::mutex mu_;
  absl::Time now_;
};

// First-fit allocator of byte ranges [0, capacity) with coalescing of freed neighbours.
// Sizes are rounded up to `alignment` (a power of two); offsets are multiples of it.
// O(log n) free, O(n) worst-case allocate over the free list. Not thread-safe: the store calls
// it under its own lock.
class Arena {
 public:
  Arena(uint64_t capacity, uint64_t alignment);

  // Offset of a free range of at least `size` bytes. RESOURCE_EXHAUSTED when no free range is
  // large enough (fragmentation counts: `free_bytes()` may exceed size). INVALID_ARGUMENT for 0.
  absl::StatusOr<uint64_t> Allocate(uint64_t size);
  // Returns a range obtained from Allocate (same size). Double frees / unknown ranges are a
  // programming error and abort in debug builds; they are ignored in release builds.
  void Free(uint64_t offset, uint64_t size);

  uint64_t capacity() const { return capacity_; }
  uint64_t used_bytes() const { return used_; }
  uint64_t free_bytes() const { return capacity_ - used_; }
  uint64_t RoundUp(uint64_t size) const { return (size + alignment_ - 1) & ~(alignment_ - 1); }
  size_t free_ranges() const { return free_.size(); }
  // Bytes of the largest free range (0 when full): the largest size Allocate can serve now.
  // O(free ranges).
  uint64_t largest_free_range() const;

 private:
  uint64_t capacity_;
  uint64_t alignment_;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset → size, non-adjacent ranges
};

}  // namespace kvpool::kvstore
