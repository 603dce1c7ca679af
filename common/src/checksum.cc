// xxh3_64 checksums (docs/BLOCK_FORMAT.md "Checksums").
#include "kvpool/common/checksum.h"

#include <xxhash.h>
#if defined(__x86_64__)
#define XXH_DISPATCH_DISABLE_REPLACE  // call the *_dispatch entry points by name
#include <xxh_x86dispatch.h>
#endif

#include <cstdlib>

namespace kvpool {

// On x86-64 through libxxhash's runtime dispatch (AVX-512 / AVX2 when the CPU has them; same
// values as the plain entry points): Debian builds those for baseline x86-64 (SSE2), which ran
// at 2.3-4 GB/s against 6-28 GB/s dispatched on 256 KiB-4 MiB forms — slower than the copy a
// reader verifies and the staging bytes the pool checks at commit.
uint64_t Xxh3(const void* data, size_t size) {
#if defined(__x86_64__)
  return XXH3_64bits_dispatch(data, size);
#else
  return XXH3_64bits(data, size);
#endif
}

struct Xxh3Stream::State {
  XXH3_state_t* s = nullptr;
};

Xxh3Stream::Xxh3Stream() : state_(std::make_unique<State>()) {
  state_->s = XXH3_createState();
  if (state_->s == nullptr || XXH3_64bits_reset(state_->s) != XXH_OK) {
    std::abort();
  }
}

Xxh3Stream::~Xxh3Stream() { XXH3_freeState(state_->s); }

void Xxh3Stream::Update(const void* data, size_t size) {
  if (size > 0) {
#if defined(__x86_64__)
    XXH3_64bits_update_dispatch(state_->s, data, size);
#else
    XXH3_64bits_update(state_->s, data, size);
#endif
  }
}

uint64_t Xxh3Stream::Digest() const { return XXH3_64bits_digest(state_->s); }

}  // namespace kvpool
