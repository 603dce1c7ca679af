// kvpool/kernels/cuda/kv_write.h — CUDA write kernels into paged KV blocks (sm_90a).
//
// Three launchers, all writing the byte layout of docs/BLOCK_FORMAT.md:
//  * LaunchQuantizeWrite — fused rotate (tensor cores, fp16 copy of R in shared memory, fp32
//    accumulation) + per-row clip + asymmetric INT2 quantize + quarter-planar pack
//    (FORMAT.md §2) of a batch of tokens straight into INT2 pages.
//  * LaunchRotateWriteBf16 — rotate-only write of a batch of tokens into BF16 pages.
//  * LaunchDemote — quantize already-rotated BF16 pages (a full recent block leaving the
//    window) into INT2 pages (FORMAT.md §3 "demotion"). No rotation: bf16 -> fp32 is exact, so
//    its codes equal the CPU quantizer's on the same rows except at exact ties.
//
// Quantization rule (FORMAT.md §2.2-2.3): τ = (|x̃| sorted ascending)[clamp(⌊ratio·d⌋,0,d-1)]
// (ratio 0 disables), x̃ clamped to ±τ; per group of min(d,128): mn16 = fp16 round-down(min),
// scale16 = fp16 round-up((max - mn16)/3) (computed in fp32), code = round-half-up((x̃ -
// mn16)/scale16) clamped to 0..3 (0 when scale16 = 0), evaluated as comparisons of the bf16
// values against exact per-row thresholds (the smallest bf16 whose code under that rule is
// >= j, j = 1..3, derived without division; see kv_write.cu), so the bytes equal the CPU
// quantizer's (kvpool::QuantizeRow) on the same rotated bf16 rows, ties included.
// A row (token, head, K or V) whose input or rotated values are not finite, or whose (scale,
// min) do not fit fp16, is not quantized: its codes and params are written as zeros (it
// dequantizes to 0), row_flags[(token·H + head)·2 + (0 for K, 1 for V)] is set to 1 and *bad_rows
// is incremented. The caller then keeps the block's BF16 form (FORMAT.md §2.3). row_flags
// entries are always written (0 = quantized, 1 = refused), so they need no clearing.
//
// Shapes: head_dim 64/128/256, page_size 16 or 64, any num_tokens >= 0 (0 launches nothing).
// Launchers never allocate or synchronize; thread-safety: reentrant. LaunchQuantizeWrite without
// rotation and LaunchDemote encode TMA descriptors of their sources on the host per call
// (cuTensorMapEncodeTiled through the runtime's driver entry point; no device work); when the
// driver refuses one they load with cp.async instead (same bytes). KVPOOL_WRITE_TMA=0 in the
// environment forces cp.async (A/B measurements). The rotating launchers at head_dim 128 use
// the same TMA loads in warp-specialized kernels (the rotation by wgmma in producer warpgroups);
// without a map, or with KVPOOL_WRITE_ROT_WS=0 (read at each launch), they run the mma.sync
// kernels of the other head dims, which round to the same bf16 values (measured bit-identical,
// docs/KERNELS.md "Session 7 (v11: warp-specialized d 128 rotation)"). Measurement and test
// switches of the non-rotating kernels, read at each launch (same bytes): KVPOOL_WRITE_MAX_CTAS=N
// caps their grid at N CTAs (more items per warp); KVPOOL_WRITE_DYN_ITEMS=K >= 0 lets each CTA's
// warps of LaunchQuantizeWrite without rotation claim the last items of the CTA's range from a
// shared-memory counter (off by default: measured no faster, docs/KERNELS.md "Session 11").
#pragma once

#include <cstdint>

#include "kvpool/kernels/cuda/paged_decode.h"
#include "kvpool/kernels/cuda/status.h"

namespace kvpool::cuda {

// Destination (or source) pages of one form for ONE layer (see PagePool in paged_decode.h).
struct MutablePagePool {
  void* base = nullptr;            // 16-byte aligned device memory
  uint64_t page_stride_bytes = 0;  // multiple of 16
};

struct KvWriteParams {
  int32_t num_tokens = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;    // 64, 128, 256
  int32_t page_size = 16;  // 16 or 64

  // Un-rotated input rows, bf16: element (t, h, j) at k[t·token_stride + h·head_dim + j].
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  int64_t token_stride = 0;  // elements between tokens; 0 = num_kv_heads·head_dim

  // fp32 [d][d] row-major (x̃ = x·R) or [H_kv][d][d] when rotation_per_head; nullptr = identity.
  const float* rotation_k = nullptr;
  const float* rotation_v = nullptr;
  bool rotation_per_head = false;

  // Token t goes to slot dst_slot[t] of page dst_page[t] (device arrays [num_tokens]).
  const int32_t* dst_page = nullptr;
  const int32_t* dst_slot = nullptr;
  MutablePagePool dst;  // INT2 pool for LaunchQuantizeWrite, BF16 pool for LaunchRotateWriteBf16

  float clip_ratio_k = 0.96f;  // FORMAT.md §2.2; 0 disables
  float clip_ratio_v = 0.92f;
  uint8_t* row_flags = nullptr;  // optional [num_tokens][H_kv][2] (K, V); quantize only
  uint32_t* bad_rows = nullptr;  // optional device counter, incremented per refused row
};

// Rotates (when rotation_k/v are set; else the rows are taken as already rotated), rounds to
// bf16, clips, quantizes and packs every (token, head) K and V row into slot dst_slot[t] of
// INT2 page dst_page[t] of `dst` (codes and (scale16, min16) params, docs/BLOCK_FORMAT.md). The
// caller guarantees page ids and slots are in range and that no two tokens share a slot.
// Errors: kInvalidArgument (null/misaligned pointer, bad stride, clip ratio outside [0, 1],
// only one rotation set), kUnsupported (head_dim, page_size), kLaunchFailed.
KernelStatus LaunchQuantizeWrite(const KvWriteParams& params, Stream stream);

// Rotate-only write: bf16(x·R) (fp16 copy of R on tensor cores, fp32 accumulation; identity when
// no rotation is set) into the K/V rows of BF16 pages of `dst`. Same contract and errors as
// LaunchQuantizeWrite; clip ratios, row_flags and bad_rows are ignored.
KernelStatus LaunchRotateWriteBf16(const KvWriteParams& params, Stream stream);

struct DemoteParams {
  int32_t num_blocks = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 16;
  const int32_t* src_pages = nullptr;  // [num_blocks] full BF16 pages (rotated rows)
  const int32_t* dst_pages = nullptr;  // [num_blocks] INT2 pages to fill
  PagePool src;                        // BF16 pool (read-only)
  MutablePagePool dst;                 // INT2 pool
  float clip_ratio_k = 0.96f;
  float clip_ratio_v = 0.92f;
  uint8_t* row_flags = nullptr;  // optional [num_blocks·page_size][H_kv][2] (K, V)
  uint32_t* bad_rows = nullptr;  // optional device counter
};

// Quantizes the page_size tokens of each BF16 page src_pages[i] (already rotated) into INT2 page
// dst_pages[i] — the same bytes LaunchQuantizeWrite produces for those rows. Source and
// destination pools must not overlap. Errors as LaunchQuantizeWrite.
KernelStatus LaunchDemote(const DemoteParams& params, Stream stream);

}  // namespace kvpool::cuda
