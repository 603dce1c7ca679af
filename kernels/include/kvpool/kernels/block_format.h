// kvpool/kernels/block_format.h — byte offsets of a block's forms (docs/BLOCK_FORMAT.md).
//
// Plain data, header-only, usable from host and device code (no absl, no std containers), so
// the pool, the client, the wire and the CUDA kernels compute the same offsets.
//
//   kvpool::BlockGeometry g{.num_layers = 36, .num_kv_heads = 8, .head_dim = 128,
//                           .page_size = 16};
//   uint64_t off = g.Int2ChunkOffset(layer, head) + g.Int2KParamsOffset();
//
// All sizes and offsets are in bytes and 64-bit. Thread-safe (immutable value type).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVPOOL_HD __host__ __device__
#else
#define KVPOOL_HD
#endif

namespace kvpool {

// The quantization group size along head_dim: min(head_dim, 128) (FORMAT.md §2).
inline constexpr uint32_t kMaxGroupSize = 128;

struct BlockGeometry {
  uint32_t num_layers = 0;    // L
  uint32_t num_kv_heads = 0;  // H
  uint32_t head_dim = 0;      // d, power of two >= 8
  uint32_t page_size = 16;    // P, tokens per block, power of two

  KVPOOL_HD constexpr uint32_t GroupSize() const {
    return head_dim < kMaxGroupSize ? head_dim : kMaxGroupSize;
  }
  KVPOOL_HD constexpr uint32_t GroupsPerRow() const { return head_dim / GroupSize(); }

  // ---- BF16 form: per (layer, head) K[P][d] then V[P][d], bf16 ----
  KVPOOL_HD constexpr uint64_t Bf16ChunkBytes() const {
    return 4ull * page_size * head_dim;
  }
  KVPOOL_HD constexpr uint64_t Bf16LayerBytes() const { return num_kv_heads * Bf16ChunkBytes(); }
  KVPOOL_HD constexpr uint64_t Bf16FormBytes() const { return num_layers * Bf16LayerBytes(); }
  KVPOOL_HD constexpr uint64_t Bf16ChunkOffset(uint32_t layer, uint32_t head) const {
    return (uint64_t(layer) * num_kv_heads + head) * Bf16ChunkBytes();
  }
  // Offset of the V rows inside a BF16 chunk (K rows start at 0).
  KVPOOL_HD constexpr uint64_t Bf16VOffset() const { return 2ull * page_size * head_dim; }

  // ---- INT2 form: per (layer, head) Kcodes[P][d/4], Vcodes[P][d/4], Kparams, Vparams ----
  KVPOOL_HD constexpr uint64_t CodeRowBytes() const { return head_dim / 4; }
  KVPOOL_HD constexpr uint64_t ParamRowBytes() const { return 4ull * GroupsPerRow(); }
  KVPOOL_HD constexpr uint64_t Int2ChunkBytes() const {
    return uint64_t(page_size) * (head_dim / 2 + 8ull * GroupsPerRow());
  }
  KVPOOL_HD constexpr uint64_t Int2LayerBytes() const { return num_kv_heads * Int2ChunkBytes(); }
  KVPOOL_HD constexpr uint64_t Int2FormBytes() const { return num_layers * Int2LayerBytes(); }
  KVPOOL_HD constexpr uint64_t Int2ChunkOffset(uint32_t layer, uint32_t head) const {
    return (uint64_t(layer) * num_kv_heads + head) * Int2ChunkBytes();
  }
  KVPOOL_HD constexpr uint64_t Int2KCodesOffset() const { return 0; }
  KVPOOL_HD constexpr uint64_t Int2VCodesOffset() const { return page_size * CodeRowBytes(); }
  KVPOOL_HD constexpr uint64_t Int2KParamsOffset() const {
    return 2ull * page_size * CodeRowBytes();
  }
  KVPOOL_HD constexpr uint64_t Int2VParamsOffset() const {
    return Int2KParamsOffset() + page_size * ParamRowBytes();
  }

  // True when every field is in range (power-of-two head_dim >= 8 and page_size >= 1, nonzero
  // counts). Callers that take geometry from outside validate with this and name the field.
  KVPOOL_HD constexpr bool Valid() const {
    auto pow2 = [](uint32_t x) { return x != 0 && (x & (x - 1)) == 0; };
    return num_layers > 0 && num_kv_heads > 0 && head_dim >= 8 && pow2(head_dim) &&
           pow2(page_size);
  }
};

}  // namespace kvpool
