// kvpool/kernels/attention.h — reference (CPU, fp32-accumulate) decode attention over a
// mixed-precision sequence (FORMAT.md §3): BF16 sink, INT2 history, BF16 recent. The CUDA
// decode kernels are checked against this code.
//
// One decode step of one layer for one request:
//   q̃_i  = q_i · R_K(h)                 query head i, KV head h = ⌊i / g⌋, g = H_q / H_kv
//   s_t  = softmax_scale · (q̃_i · k̃_t)  k̃_t: stored (rotated) key — bf16 widened, or INT2
//                                        dequantized x̂ = mn16 + code·scale16
//   per segment: m = max s_t, l = Σ exp(s_t − m), o = Σ exp(s_t − m) ṽ_t / l, lse = m + ln l
//   (empty segment: o = 0, lse = −inf)
//   merge (associative): m = max(lse_a, lse_b); if m = −inf the result is (0, −inf);
//   else w_x = exp(lse_x − m), o = (w_a o_a + w_b o_b)/(w_a + w_b), lse = m + ln(w_a + w_b)
//   output = o · R_V(h)ᵀ (back to the model's space).
// Everything is fp32 (products and sums accumulate in fp32, in token order); exp/log are
// std::exp/std::log of fp32. Natural-log LSE over *scaled* logits.
//
//   SegmentView sink{SegmentForm::kBf16, sink_pages, P}, hist{SegmentForm::kInt2, h_pages, P},
//               recent{SegmentForm::kBf16, r_pages, last_len};
//   DecodeAttentionParams p{.geometry = g, .layer = l, .num_q_heads = 32,
//                           .softmax_scale = 1 / sqrtf(128)};
//   KVPOOL_RETURN_IF_ERROR(ReferenceDecodeAttention(p, rot, q, sink, hist, recent, out, lse));
//
// Thread-safety: reentrant. Pages are read-only and borrowed for the call.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/rotation.h"

namespace kvpool {

enum class SegmentForm { kBf16, kInt2 };

// One segment of a request's sequence: its pages in token order. Each page pointer is the
// start of a whole block's form (g.Bf16FormBytes() or g.Int2FormBytes() bytes, layout of
// docs/BLOCK_FORMAT.md); the reference reads layer `layer` of each. All pages are full except
// the last, which holds last_page_len tokens (1..P). No pages = empty segment.
struct SegmentView {
  SegmentForm form = SegmentForm::kBf16;
  std::vector<const uint8_t*> pages;
  uint32_t last_page_len = 0;
  uint64_t NumTokens(uint32_t page_size) const {
    return pages.empty() ? 0 : (pages.size() - 1) * uint64_t{page_size} + last_page_len;
  }
};

struct DecodeAttentionParams {
  BlockGeometry geometry;
  uint32_t layer = 0;
  uint32_t num_q_heads = 0;  // H_q, a multiple of geometry.num_kv_heads
  float softmax_scale = 0;   // usually 1/sqrt(head_dim)
};

// Attention of rotated queries over one segment. q_rot: [H_q][d] (already q·R_K of each
// head's KV head). out: [H_q][d] normalized output in the *rotated* V space; lse: [H_q].
// INVALID_ARGUMENT for bad parameters or last_page_len out of 1..P (naming the field).
absl::Status AttendSegment(const DecodeAttentionParams& p, const SegmentView& seg,
                           const float* q_rot, float* out, float* lse);

// Merges state b into a (in place): a ← merge(a, b) per head, rule above. Never produces NaN
// from two empty states.
void MergeAttentionStates(uint32_t num_heads, uint32_t head_dim, float* out_a, float* lse_a,
                          const float* out_b, const float* lse_b);

// The full reference: rotates q (un-rotated, [H_q][d]) by R_K, attends sink, history and recent
// separately, merges, rotates the output back by R_Vᵀ. out [H_q][d] (model space), lse [H_q].
// FAILED_PRECONDITION when `rot` does not match the geometry.
absl::Status ReferenceDecodeAttention(const DecodeAttentionParams& p, const RotationSet& rot,
                                      const float* q, const SegmentView& sink,
                                      const SegmentView& history, const SegmentView& recent,
                                      float* out, float* lse);

}  // namespace kvpool
