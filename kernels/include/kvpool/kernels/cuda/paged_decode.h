// kvpool/kernels/cuda/paged_decode.h — mixed-precision paged decode attention (CUDA, sm_90a).
//
// One query token per request attends over its sequence, stored as three segments of pages
// (FORMAT.md §3, docs/BLOCK_FORMAT.md "Page tables"): sink (BF16 form), history (INT2 form),
// recent (BF16 form). Every segment has a CSR page table; any segment may be empty. The KV in
// the pages is stored rotated (k·R_K, v·R_V, FORMAT.md §1); the launcher rotates q by R_K once
// per step and rotates the output back by R_Vᵀ, so `out` is the attention output in the
// model's own (un-rotated) basis:
//
//   out[b, i, :] = softmax_t(sm_scale · q[b,i]·k_t) · v_t   over the union of the segments,
//
// with k_t, v_t the dequantized (INT2: min16 + code·scale16, FORMAT.md §2.3) or BF16 rows
// rotated back. Query head i uses KV head ⌊i / group⌋, group = num_q_heads / num_kv_heads.
//
// The BF16 baseline is the same call with every page in a BF16 segment (history empty).
//
//   kvpool::cuda::PagedDecodeParams p;  ... fill shapes, pointers, page tables ...
//   size_t ws = 0;
//   KVPOOL_CHECK(kvpool::cuda::PagedDecodeWorkspaceBytes(p, &ws).ok());
//   p.workspace = my_ws; p.workspace_bytes = ws;          // caller-owned device memory
//   kvpool::cuda::KernelStatus st = kvpool::cuda::LaunchPagedDecode(p, stream);
//
// Algorithm (docs/KERNELS.md): split-K over pages (flash-decoding); each warp streams its pages
// through a shared-memory ring (TMA bulk copies for INT2 pages, cp.async for BF16 pages),
// computes q·k and p·v on tensor cores with tokens on the M side of q·kᵀ — INT2: integer MMA
// of the masked u8 codes with a 16-bit integer q̃ split into int8 halves for q·k, the masked
// codes used as fp16 subnormals for p·v; the per-token affine form of FORMAT.md §2.8, so no
// per-element scale multiply — keeps an online softmax, and writes a (partial output,
// log-sum-exp) pair; a merge kernel combines the partials of all splits and segments (empty
// ones contribute nothing) and applies R_Vᵀ. The kernels are chained with programmatic
// dependent launch (KVPOOL_DECODE_PDL=0 in the environment launches them plainly).
//
// Supported: head_dim 64/128/256; page_size 16 or 64; group 1..16 (padded at run time);
// batch 1..65535. Everything else is refused with kUnsupported.
//
// Thread-safety: launchers are reentrant; concurrent launches need distinct workspaces.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvpool/kernels/cuda/status.h"

namespace kvpool::cuda {

// A page pool of one form for ONE layer: page p of head h starts at
//   base + p·page_stride_bytes + h·chunk_bytes
// where chunk_bytes is BlockGeometry::Bf16ChunkBytes() or Int2ChunkBytes() (docs/BLOCK_FORMAT.md).
// For a whole-block slab pass base already offset by layer·layer_stride and page_stride = the
// block's form size. base must be 16-byte aligned and page_stride_bytes a multiple of 16.
struct PagePool {
  const void* base = nullptr;      // device memory, not owned
  uint64_t page_stride_bytes = 0;  // bytes between consecutive page ids (64-bit: > 2^31 ok)
};

// CSR page table of one segment (FlashInfer style). Device pointers, not owned.
// All three null (or max_pages == 0) means the segment is empty for every request.
struct SegmentTable {
  const int32_t* indptr = nullptr;         // [batch + 1], indptr[0] = 0, non-decreasing
  const int32_t* indices = nullptr;        // [indptr[batch]] page ids, in token order
  const int32_t* last_page_len = nullptr;  // [batch] valid tokens in the last page, 1..page_size
  // Host-side upper bound of indptr[b+1] - indptr[b] over the batch; sizes the split grid.
  // A request with more pages than this gets NaN output (never a silent truncation).
  int32_t max_pages = 0;
};

struct PagedDecodeParams {
  // ---- shapes ----
  int32_t batch = 0;         // requests, 1..65535
  int32_t num_q_heads = 0;   // H_q
  int32_t num_kv_heads = 0;  // H_kv; H_q % H_kv == 0 and H_q / H_kv in 1..16
  int32_t head_dim = 0;      // 64, 128 or 256
  int32_t page_size = 16;    // 16 or 64 (tokens per page)
  float sm_scale = 0.f;      // logit scale, usually 1/sqrt(head_dim); must be finite and > 0

  // ---- inputs (device) ----
  const uint16_t* q = nullptr;  // bf16 [batch][H_q][head_dim], un-rotated (model basis)
  // Rotations, fp32 row-major [d][d] (x̃ = x·R), or [H_kv][d][d] when rotation_per_head.
  // nullptr = identity (q and the stored KV are in the same basis). rotation_v: 8-byte aligned.
  // At head_dim 128 the output rotation runs on tensor cores with R_V and the merged output
  // rounded to tf32 (2^-11 relative, below the bf16 output's 2^-9); q·R_K is fp32.
  const float* rotation_k = nullptr;
  const float* rotation_v = nullptr;
  bool rotation_per_head = false;

  PagePool bf16_pool;    // pages of the BF16 form (sink and recent segments)
  PagePool int2_pool;    // pages of the INT2 form (history segment)
  SegmentTable sink;     // BF16
  SegmentTable history;  // INT2
  SegmentTable recent;   // BF16

  // ---- outputs (device) ----
  uint16_t* out = nullptr;  // bf16 [batch][H_q][head_dim]
  float* lse = nullptr;     // optional fp32 [batch][H_q]: natural-log log-sum-exp of the
                            // scaled logits (-inf when every segment is empty)

  // ---- scratch ----
  void* workspace = nullptr;  // device, 256-byte aligned, >= PagedDecodeWorkspaceBytes()
  size_t workspace_bytes = 0;
  // Number of CTAs the split planner aims for (0 = 4 per multiprocessor of the current device).
  int32_t target_ctas = 0;
};

// Workspace bytes LaunchPagedDecode needs for `params` on the current device (depends on
// shapes, the max_pages hints and the device's multiprocessor count; not on pointers; the A/B
// switches KVPOOL_DECODE_SPLIT_FIXED, _HIST_SPLITS, _RECENT_SPLITS and _FOLD_SINK change it too,
// and are read once per process, so the size stays valid for every launch of that process).
// Errors: kInvalidArgument / kUnsupported as LaunchPagedDecode.
KernelStatus PagedDecodeWorkspaceBytes(const PagedDecodeParams& params, size_t* bytes);

// Enqueues the decode on `stream` (up to 4 kernel launches: q rotation, BF16 segments, INT2
// history, merge). Never allocates or synchronizes.
// Errors: kInvalidArgument (field named), kUnsupported (shape), kWorkspaceTooSmall,
// kLaunchFailed. Device-side contract violations (page ids out of the pool, a request with more
// pages than max_pages) are the caller's; the latter yields NaN output for that request.
KernelStatus LaunchPagedDecode(const PagedDecodeParams& params, Stream stream);

}  // namespace kvpool::cuda
