// kvpool/kvstore/encoder.h — the commit-time transformation of one block: un-rotated BF16
// staging bytes → rotated BF16 form and OSCAR INT2 form (docs/BLOCK_FORMAT.md, FORMAT.md §2).
//
//   KVPOOL_ASSIGN_OR_RETURN(kvpool::RotationSet rot, kvpool::ParseRotations(file_bytes));
//   EncodeResult r;
//   KVPOOL_RETURN_IF_ERROR(EncodeBlock(geom, rot, 0.96f, 0.92f, staging, bf16, int2, &r));
//
// The numerics are the kernels library's CPU encoder (RotateQuantizeRowsBf16); this file is the
// pool's single call site for it, so a GPU path can replace it in one place.
// Thread-safety: all functions are reentrant.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/rotation.h"

namespace kvpool::kvstore {

struct EncodeResult {
  bool int2_ok = false;        // false when some group exceeded fp16 (FORMAT.md §2.3)
  uint64_t overflow_rows = 0;  // rows whose INT2 encoding overflowed fp16
};

// Scans a BF16 form (staging bytes, docs/BLOCK_FORMAT.md layout) for NaN/Inf.
// Errors: INVALID_ARGUMENT naming layer, head, K or V, token and element of the first
// non-finite value ("layer 2 head 1 V token 5 element 3 is nan").
absl::Status CheckFinite(const BlockGeometry& g, const uint8_t* bf16_form);

// Encodes one block.
//   staging:  [Bf16FormBytes] un-rotated bf16 K/V as the engine computed them (read only).
//   bf16_out: [Bf16FormBytes] receives bf16(x·R) in the BF16 form layout. Required.
//   int2_out: [Int2FormBytes] receives the INT2 form of exactly those rotated bf16 values, or
//             null to skip it. Contents are unspecified when result->int2_ok is false.
//   clip_k/v: clip ratios (FORMAT.md §2.2).
// Errors: INVALID_ARGUMENT for non-finite input (as CheckFinite) or a geometry the kernels do not
// support (naming the field). Outputs may be partially written on error.
absl::Status EncodeBlock(const BlockGeometry& g, const RotationSet& rotation, float clip_k,
                         float clip_v, const uint8_t* staging, uint8_t* bf16_out, uint8_t* int2_out,
                         EncodeResult* result);

}  // namespace kvpool::kvstore
