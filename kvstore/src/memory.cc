// PoolMemory, Clock and Arena (memory.h).
#include "kvpool/kvstore/memory.h"

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace kvpool::kvstore {

absl::StatusOr<std::unique_ptr<HeapPoolMemory>> HeapPoolMemory::Create(size_t size) {
  if (size == 0) {
    return absl::InvalidArgumentError("capacity: must be > 0");
  }
  // The page round-up below wrapped to a tiny buffer for sizes within 4 KiB of 2^64, and the
  // pool then started with a "capacity" of 16 EiB over it (newcomer report 13b).
  constexpr size_t kMaxSize = size_t{1} << 62;
  if (size > kMaxSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity: ", size, " bytes is more than any machine holds (at most 2^62)"));
  }
  size_t rounded = (size + 4095) & ~size_t{4095};
  void* p = std::aligned_alloc(4096, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("capacity: cannot allocate ", size, " bytes"));
  }
  std::memset(p, 0, rounded);
  return std::unique_ptr<HeapPoolMemory>(new HeapPoolMemory(static_cast<uint8_t*>(p), size));
}

HeapPoolMemory::~HeapPoolMemory() { std::free(data_); }

namespace {
class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};
}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
namespace {
// CPUID.(EAX=07H, ECX=0):ECX bit 25 = CLDEMOTE.
bool HasCldemote() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, a, b, c, d);
  return (c & (1u << 25)) != 0;
}

__attribute__((target("cldemote"))) void DemoteLines(const void* data, size_t size) {
  constexpr uintptr_t kLine = 64;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + size;
  for (uintptr_t p = reinterpret_cast<uintptr_t>(data) & ~(kLine - 1); p < end; p += kLine) {
    _cldemote(reinterpret_cast<void*>(p));
  }
}
}  // namespace

void DemoteToSharedCache(const void* data, size_t size) {
  static const bool supported = HasCldemote();
  if (supported && size > 0) DemoteLines(data, size);
}
#else
void DemoteToSharedCache(const void*, size_t) {}
#endif

Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

Arena::Arena(uint64_t capacity, uint64_t alignment) : alignment_(alignment) {
  assert(alignment != 0 && (alignment & (alignment - 1)) == 0);
  capacity_ = capacity & ~(alignment - 1);
  if (capacity_ > 0) {
    free_.emplace(0, capacity_);
  }
}

absl::StatusOr<uint64_t> Arena::Allocate(uint64_t size) {
  if (size == 0) {
    return absl::InvalidArgumentError("size: must be > 0");
  }
  const uint64_t need = RoundUp(size);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) {
      continue;
    }
    const uint64_t off = it->first;
    const uint64_t rest = it->second - need;
    free_.erase(it);
    if (rest > 0) {
      free_.emplace(off + need, rest);
    }
    used_ += need;
    return off;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("pool full: no free range of ", need, " bytes (", free_bytes(), " bytes free)"));
}

uint64_t Arena::largest_free_range() const {
  uint64_t largest = 0;
  for (const auto& [offset, size] : free_) largest = std::max(largest, size);
  return largest;
}

void Arena::Free(uint64_t offset, uint64_t size) {
  const uint64_t len = RoundUp(size);
  assert(offset + len <= capacity_);
  auto next = free_.lower_bound(offset);
  assert(next == free_.end() || next->first >= offset + len);
  uint64_t start = offset;
  uint64_t end = offset + len;
  if (next != free_.end() && next->first == end) {
    end += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    assert(prev->first + prev->second <= offset);
    if (prev->first + prev->second == start) {
      start = prev->first;
      free_.erase(prev);
    }
  }
  free_.emplace(start, end - start);
  used_ -= len;
}

}  // namespace kvpool::kvstore
