// Block-form checksums (docs/BLOCK_FORMAT.md "Checksums").
#include "kvpool/common/checksum.h"

#include <xxhash.h>
#if defined(__x86_64__)
#define XXH_DISPATCH_DISABLE_REPLACE  // call the *_dispatch entry points by name
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace kvpool {

#if defined(__x86_64__)
namespace internal {
uint64_t Xxh3Avx2(const void* data, size_t size);  // checksum_avx2.cc
}  // namespace internal

namespace {
bool HaveAvx2() {
  static const bool have = [] {
    __builtin_cpu_init();  // may run before libgcc's own initialisation (a static constructor)
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return have;
}
}  // namespace
#endif

// On x86-64: the AVX2 build of xxh3 (checksum_avx2.cc) when the CPU has AVX2, else libxxhash's
// runtime dispatch; the same values either way. Debian builds the plain entry points for
// baseline x86-64 (SSE2), which ran at 2.3-4 GB/s against 6-28 GB/s dispatched on 256 KiB-4 MiB
// forms — slower than the copy a reader verifies and the staging bytes the pool checks at
// commit. The dispatch takes AVX-512 where the CPU has it; the AVX2 build is used instead since
// session 10: the client's copy threads hash a few 16 KiB chunks per put or fetch, short bursts
// in which the AVX-512 path ran slower on the H200 host (Intel Xeon): with the AVX2 build in
// client and pool, the geometric mean of bytes / p50 of the 256 KiB and 1 MiB asynchronous put
// and first fetch was 1.12x and 1.16x that of the same build hashing through the dispatch, in
// the two rounds of one call (docs/TRANSPORT.md "Session 10", which also says what is not known
// about 4 MiB). Xxh3Stream keeps the dispatch.
uint64_t Xxh3(const void* data, size_t size) {
#if defined(__x86_64__)
  if (HaveAvx2()) return internal::Xxh3Avx2(data, size);
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

void Xxh3Stream::Reset() {
  if (XXH3_64bits_reset(state_->s) != XXH_OK) std::abort();
}

uint64_t CombineChunkDigests(const uint64_t* digests, size_t n) {
  // Little-endian u64s, written byte by byte (the same bytes on any host), hashed in batches of
  // 64 digests through a stream when there are more (the same value as one call).
  constexpr size_t kBatch = 64;
  unsigned char buf[kBatch * 8];
  auto fill = [&](size_t from, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      const uint64_t d = digests[from + i];
      for (int b = 0; b < 8; ++b) buf[i * 8 + b] = static_cast<unsigned char>(d >> (8 * b));
    }
  };
  if (n <= kBatch) {
    fill(0, n);
    return Xxh3(buf, n * 8);
  }
  Xxh3Stream s;
  for (size_t from = 0; from < n; from += kBatch) {
    const size_t count = std::min(kBatch, n - from);
    fill(from, count);
    s.Update(buf, count * 8);
  }
  return s.Digest();
}

uint64_t FormChecksum(const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  const uint64_t n = ChecksumChunks(size);
  constexpr size_t kLocal = 256;  // forms up to 4 MiB need no allocation
  uint64_t local[kLocal] = {};
  std::vector<uint64_t> heap;
  uint64_t* digests = local;
  if (n > kLocal) {
    heap.resize(n);
    digests = heap.data();
  }
  for (uint64_t c = 0; c < n; ++c) {
    const size_t off = c * kChecksumChunkBytes;
    digests[c] = Xxh3(p + off, std::min(kChecksumChunkBytes, size - off));
  }
  return CombineChunkDigests(digests, n);
}

FormChecksumBuilder::FormChecksumBuilder(uint64_t form_size)
    : form_size_(form_size), digests_(ChecksumChunks(form_size), 0) {}

FormChecksumBuilder::~FormChecksumBuilder() = default;

void FormChecksumBuilder::Add(uint64_t offset, const void* data, size_t size) {
  if (offset > form_size_ || size > form_size_ - offset) {
    std::fprintf(stderr, "FormChecksumBuilder::Add: [%llu, +%zu) beyond the form's %llu bytes\n",
                 static_cast<unsigned long long>(offset), size,
                 static_cast<unsigned long long>(form_size_));
    std::abort();
  }
  const auto* p = static_cast<const unsigned char*>(data);
  const uint64_t end = offset + size;
  while (offset < end) {
    const uint64_t chunk = offset / kChecksumChunkBytes;
    const uint64_t chunk_start = chunk * kChecksumChunkBytes;
    const uint64_t chunk_end = std::min<uint64_t>(chunk_start + kChecksumChunkBytes, form_size_);
    const uint64_t piece_end = std::min(end, chunk_end);
    const size_t n = static_cast<size_t>(piece_end - offset);
    if (offset == chunk_start && piece_end == chunk_end) {
      digests_[chunk] = Xxh3(p, n);  // the whole chunk in one piece
    } else {
      if (partial_ == nullptr) partial_ = std::make_unique<Xxh3Stream>();
      if (partial_fed_ == 0) {
        partial_chunk_ = chunk;
        partial_->Reset();
      }
      if (partial_chunk_ != chunk || chunk_start + partial_fed_ != offset) {
        std::fprintf(stderr,
                     "FormChecksumBuilder::Add: piece at %llu out of order (chunk %llu has %llu "
                     "bytes fed)\n",
                     static_cast<unsigned long long>(offset),
                     static_cast<unsigned long long>(partial_chunk_),
                     static_cast<unsigned long long>(partial_fed_));
        std::abort();
      }
      partial_->Update(p, n);
      partial_fed_ += n;
      if (chunk_start + partial_fed_ == chunk_end) {
        digests_[chunk] = partial_->Digest();
        partial_fed_ = 0;
      }
    }
    p += n;
    offset = piece_end;
  }
}

void FormChecksumBuilder::SetChunkDigest(uint64_t chunk, uint64_t digest) {
  if (chunk >= digests_.size()) {
    std::fprintf(stderr, "FormChecksumBuilder::SetChunkDigest: chunk %llu of %zu\n",
                 static_cast<unsigned long long>(chunk), digests_.size());
    std::abort();
  }
  digests_[chunk] = digest;
}

uint64_t FormChecksumBuilder::Finish() const {
  return CombineChunkDigests(digests_.data(), digests_.size());
}

}  // namespace kvpool
