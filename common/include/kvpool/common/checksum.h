// kvpool/common/checksum.h — checksums of block forms (docs/BLOCK_FORMAT.md "Checksums").
//
// A form's checksum is a *chunked* xxh3: the form's bytes are cut into chunks of
// kChecksumChunkBytes (16 KiB; the last chunk may be shorter), each chunk is hashed with
// xxh3_64 (seed 0), and the form checksum is xxh3_64 (seed 0) over the chunk digests written as
// consecutive little-endian u64. Chunks hash independently, so the client's copy threads hash
// the chunks they pack or copy while the bytes are in their own cache; the pool verifies the
// staging checksum at commit and hands stored forms' checksums to readers.
//
//   uint64_t c = kvpool::FormChecksum(bytes.data(), bytes.size());
//
//   kvpool::FormChecksumBuilder b(form_size);  // the same value, bytes fed in pieces
//   b.Add(offset, piece, piece_size);  ...  uint64_t c = b.Finish();
//
// Xxh3 / Xxh3Stream are plain xxh3_64 (seed 0), used for chunk digests and for things that are
// not block forms. Thread-safe except where noted. libxxhash (Debian) is included only by the
// .cc; on x86-64 it is called through its runtime CPU dispatch (AVX2/AVX-512), which gives the
// same values as the baseline build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

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
  void Reset();             // back to the empty stream

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Chunk size of a form checksum (docs/BLOCK_FORMAT.md "Checksums"): 16 KiB. Part of the
// format: the client, the pool and every reader must use the same value.
inline constexpr size_t kChecksumChunkBytes = size_t{16} << 10;

// The checksum scheme client and pool announce to each other at registration
// (RegisterModelRequest/Response.checksum_scheme, docs/PROTOCOL.md v1.4): 2 = FormChecksum
// (chunked, since protocol v1.3). 0 = a peer from before the field, which hashed whole forms.
inline constexpr uint32_t kChecksumScheme = 2;

// Number of chunks of a form of `size` bytes: ceil(size / kChecksumChunkBytes) (0 for 0).
inline uint64_t ChecksumChunks(uint64_t size) {
  return (size + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
}

// xxh3_64(seed 0) over digests[0..n) written as n little-endian u64 (8·n bytes). `digests` may
// be null only when n == 0.
uint64_t CombineChunkDigests(const uint64_t* digests, size_t n);

// The checksum of a form of `size` bytes at `data` (null only when size == 0): chunk digests
// xxh3_64(data[c·16 KiB, min((c+1)·16 KiB, size))) for c = 0..ChecksumChunks(size)-1, combined
// with CombineChunkDigests. One thread; see FormChecksumBuilder for pieces and threads.
uint64_t FormChecksum(const void* data, size_t size);

// Builds FormChecksum of a form of `form_size` bytes from pieces [offset, offset + size) added
// in any order, which together must cover every byte exactly once (Finish does not check).
// Threads: a piece that covers whole chunks only (offset a multiple of kChecksumChunkBytes,
// ending on a chunk boundary or at form_size) touches only those chunks' digests, so such
// pieces may be added from several threads at once when they cover different chunks. A piece
// that covers part of a chunk goes through the builder's one streaming state: the partial
// pieces of a chunk must be added in order of offset, by one thread at a time, and all of them
// before the partial pieces of another incompletely covered chunk. Finish after every Add has
// returned (and happened-before the call). Pieces beyond form_size are a programming error
// (abort).
class FormChecksumBuilder {
 public:
  explicit FormChecksumBuilder(uint64_t form_size);
  ~FormChecksumBuilder();
  FormChecksumBuilder(const FormChecksumBuilder&) = delete;
  FormChecksumBuilder& operator=(const FormChecksumBuilder&) = delete;

  void Add(uint64_t offset, const void* data, size_t size);
  // Sets chunk `chunk`'s digest computed elsewhere (xxh3_64 of the whole chunk's bytes).
  void SetChunkDigest(uint64_t chunk, uint64_t digest);
  uint64_t Finish() const;
  uint64_t form_size() const { return form_size_; }

 private:
  uint64_t form_size_;
  std::vector<uint64_t> digests_;
  std::unique_ptr<Xxh3Stream> partial_;  // the chunk being fed in pieces
  uint64_t partial_chunk_ = 0;
  uint64_t partial_fed_ = 0;  // bytes of partial_chunk_ fed so far
};

}  // namespace kvpool
