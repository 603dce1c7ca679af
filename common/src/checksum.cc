// xxh3_64 checksums (docs/BLOCK_FORMAT.md "Checksums").
#include "kvpool/common/checksum.h"

#include <xxhash.h>

#include <cstdlib>

namespace kvpool {

uint64_t Xxh3(const void* data, size_t size) { return XXH3_64bits(data, size); }

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
    XXH3_64bits_update(state_->s, data, size);
  }
}

uint64_t Xxh3Stream::Digest() const { return XXH3_64bits_digest(state_->s); }

}  // namespace kvpool
