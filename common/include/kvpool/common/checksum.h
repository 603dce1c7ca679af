// kvpool/common/checksum.h — xxh3_64 checksums of block forms (docs/BLOCK_FORMAT.md
// "Checksums"): xxh3_64 with seed 0 over a form's bytes. The pool verifies staging checksums at
// commit and hands stored forms' checksums to readers; readers verify after each transfer.
//
//   uint64_t c = kvpool::Xxh3(bytes.data(), bytes.size());
//
// Thread-safe. libxxhash (Debian) is included only by the .cc; on x86-64 it is called through its
// runtime CPU dispatch (AVX2/AVX-512), which gives the same values as the baseline build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

namespace kvpool {

// xxh3_64(data[0..size), seed 0). `data` may be null only when size == 0.
uint64_t Xxh3(const void* data, size_t size);

inline uint64_t Xxh3(std::string_view bytes) { return Xxh3(bytes.data(), bytes.size()); }

// Streaming form: feeding the bytes in pieces gives the same value as one Xxh3() call over
// their concatenation. Not thread-safe (one owner).
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;

  void Update(const void* data, size_t size);
  uint64_t Digest() const;  // of everything fed so far; the stream stays usable

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kvpool
