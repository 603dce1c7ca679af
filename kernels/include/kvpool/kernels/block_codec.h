// kvpool/kernels/block_codec.h — encode/decode whole blocks in the docs/BLOCK_FORMAT.md layout.
//
// What the pool calls at commit (staging BF16 form, un-rotated → rotated BF16 form + INT2 form),
// what a decode worker calls to demote a rotated BF16 block to INT2, and the dequantizer used by
// references and tools. All offsets come from kvpool::BlockGeometry (block_format.h).
//
// Numerics (FORMAT.md §1–2): every row of K (V) of layer l, KV head h is rotated in fp32 by
// R_K (R_V) of (l, h) — RotateRows' operation order — rounded to bf16 (round-nearest-even)
// for the rotated BF16 form, and those *bf16* values are clipped and quantized (QuantizeRow),
// so pool commit and worker demotion produce identical INT2 bytes for the same block.
//
//   BlockEncodeReport rep;
//   KVPOOL_ASSIGN_OR_RETURN(rep, EncodeBlockBf16(g, rotations, staging, rotated, int2));
//   if (!rep.int2_valid) { /* fp16 overflow: keep only the BF16 form, count the event */ }
//
// Buffers are caller-owned byte spans of exactly the form sizes (Bf16FormBytes /
// Int2FormBytes); no alignment is required (values are copied with memcpy). Thread-safety:
// reentrant; distinct blocks may be encoded concurrently.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/quantize.h"
#include "kvpool/kernels/rotation.h"

namespace kvpool {

struct BlockEncodeOptions {
  float clip_ratio_k = kDefaultClipRatioK;  // FORMAT.md §2.2; 0 disables
  float clip_ratio_v = kDefaultClipRatioV;
  KernelIsa isa = KernelIsa::kAuto;
};

struct BlockEncodeReport {
  // fp16-overflow events (FORMAT.md §2.3): such rows are zeroed in the INT2 form and the block
  // must keep (serve) its BF16 form; int2_valid is false when any occurred.
  uint64_t overflow_groups = 0;
  uint64_t overflow_rows = 0;
  bool int2_valid = true;
  // Location of the first overflow (-1 when none).
  int32_t first_overflow_layer = -1;
  int32_t first_overflow_head = -1;
  int32_t first_overflow_token = -1;
  KvKind first_overflow_kind = KvKind::kKey;
};

// FAILED_PRECONDITION unless `rot` has the geometry's head_dim, num_layers and num_kv_heads;
// INVALID_ARGUMENT for an invalid geometry (naming the field).
absl::Status CheckGeometryMatchesRotations(const BlockGeometry& g, const RotationSet& rot);

// Pool commit. staging: un-rotated BF16 form (g.Bf16FormBytes()). rotated_bf16: output BF16
// form (same size) or empty to skip; int2: output INT2 form (g.Int2FormBytes()) or empty to
// skip. Errors: INVALID_ARGUMENT for wrong buffer sizes (naming the buffer) or NaN/Inf input
// ("layer 2 head 1 token 5 K element 7 is nan"); FAILED_PRECONDITION for a rotation set of a
// different geometry. On error the outputs are unspecified.
absl::StatusOr<BlockEncodeReport> EncodeBlockBf16(const BlockGeometry& g, const RotationSet& rot,
                                                  absl::Span<const uint8_t> staging,
                                                  absl::Span<uint8_t> rotated_bf16,
                                                  absl::Span<uint8_t> int2,
                                                  const BlockEncodeOptions& options = {});

// Same from fp32 input laid out like the BF16 form ([L][H][K|V][P][d] floats,
// g.Bf16FormBytes()/2 floats). The rows are rotated in fp32 without a bf16 round trip first.
absl::StatusOr<BlockEncodeReport> EncodeBlockF32(const BlockGeometry& g, const RotationSet& rot,
                                                 absl::Span<const float> unrotated,
                                                 absl::Span<uint8_t> rotated_bf16,
                                                 absl::Span<uint8_t> int2,
                                                 const BlockEncodeOptions& options = {});

// Demotion: quantizes an already-rotated BF16 form into an INT2 form (sizes as above).
absl::StatusOr<BlockEncodeReport> QuantizeRotatedBlock(const BlockGeometry& g,
                                                       absl::Span<const uint8_t> rotated_bf16,
                                                       absl::Span<uint8_t> int2,
                                                       const BlockEncodeOptions& options = {});

// Dequantizes K or V of (layer, head) of an INT2 form into out [P][d] fp32 (rotated space:
// x̂ = mn16 + code·scale16). INVALID_ARGUMENT for a wrong size or out-of-range layer/head.
absl::Status DequantizeInt2Chunk(const BlockGeometry& g, absl::Span<const uint8_t> int2_form,
                                 uint32_t layer, uint32_t head, KvKind kind, absl::Span<float> out);

// Widens K or V of (layer, head) of a BF16 form into out [P][d] fp32 (exact).
absl::Status ReadBf16Chunk(const BlockGeometry& g, absl::Span<const uint8_t> bf16_form,
                           uint32_t layer, uint32_t head, KvKind kind, absl::Span<float> out);

}  // namespace kvpool
