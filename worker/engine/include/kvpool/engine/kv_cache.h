// kvpool/engine/kv_cache.h — how the reference engine's attention reads and writes K/V.
//
// The engine never touches K/V storage directly: per layer and position it hands the
// post-RoPE key/value rows of the new token to KvCacheView::Append, then asks
// KvCacheView::Attend for the attention output of the query over positions [0, pos]. The
// default Fp32KvCache keeps everything in float32; later work plugs in views whose history
// comes from the pool in mixed precision (INT2 + BF16 pages) without touching the engine.
//
// Shapes (row vectors, FORMAT.md notation): H_q query heads, H_kv KV heads, d = head_dim,
// g = H_q / H_kv; query head i uses KV head ⌊i/g⌋ (grouped-query attention). A row of K or V
// for one token is [H_kv * d] floats, head-major (head h at [h*d, (h+1)*d)); a query or
// attention output row is [H_q * d] floats.
//
//   auto cache = Fp32KvCache::Create(/*n_layers=*/5, {8, 4, 8}, /*capacity=*/512).value();
//   cache->Append(layer, pos, k, v);        // k, v: [H_kv*d]
//   cache->Attend(layer, pos, q, out);      // q, out: [H_q*d]
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvpool::engine {

// Attention geometry of one layer.
struct AttentionShape {
  int n_heads = 0;     // H_q
  int n_kv_heads = 0;  // H_kv; divides n_heads
  int head_dim = 0;    // d
  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
};

// Per-sequence K/V storage plus the attention that reads it. Implementations decide the
// storage precision; the engine only sees float32 rows.
// Thread-safety: one sequence is driven by one thread; implementations need not be
// thread-safe.
class KvCacheView {
 public:
  virtual ~KvCacheView() = default;

  // Stores the post-RoPE key and value rows of the token at `pos` for `layer`. k, v:
  // [H_kv * d] floats (copied). Positions of a layer are written in order: `pos` must be in
  // [0, Length(layer)]; writing pos < Length(layer) overwrites that position and drops every
  // later one (rollback / re-prefill). Errors: INVALID_ARGUMENT for a bad layer, pos, or span
  // size; RESOURCE_EXHAUSTED when pos reaches the view's capacity.
  virtual absl::Status Append(int layer, int pos, absl::Span<const float> k,
                              absl::Span<const float> v) = 0;

  // Attention output for the query row of the token at `pos`:
  //   out_i = Σ_{t=0..pos} softmax_t(q_i · k_{t,⌊i/g⌋} / √d) · v_{t,⌊i/g⌋}   for each head i
  // (scaled dot-product attention, causal: only positions [0, pos]). q, out: [H_q * d] floats.
  // Requires pos < Length(layer). Errors: INVALID_ARGUMENT for a bad layer, pos or span size.
  virtual absl::Status Attend(int layer, int pos, absl::Span<const float> q,
                              absl::Span<float> out) = 0;

  // Number of positions stored for `layer` (0 for an invalid layer).
  virtual int Length(int layer) const = 0;
};

// Reference attention over float32 rows, used by Fp32KvCache and usable by other views after
// they have materialized rows in float32. keys/values: n_positions rows of `row_stride` floats,
// the KV head h of row t at [t*row_stride + h*d, ... + d). q, out: [H_q * d]. Formula as in
// KvCacheView::Attend; softmax with max subtraction, accumulation in float32.
// Preconditions (not checked): n_positions >= 1, spans sized as described.
void ReferenceAttention(const AttentionShape& shape, int n_positions, const float* q,
                        const float* keys, const float* values, int row_stride, float* out);

// The default view: float32 K/V for `n_layers` layers and up to `capacity` positions,
// allocated up front (2 * n_layers * capacity * H_kv * d floats).
class Fp32KvCache : public KvCacheView {
 public:
  // Errors: INVALID_ARGUMENT when a count is < 1, n_heads is not a multiple of n_kv_heads, or
  // the allocation would exceed 2^34 floats.
  static absl::StatusOr<std::unique_ptr<Fp32KvCache>> Create(int n_layers,
                                                             const AttentionShape& shape,
                                                             int capacity);

  absl::Status Append(int layer, int pos, absl::Span<const float> k,
                      absl::Span<const float> v) override;
  absl::Status Attend(int layer, int pos, absl::Span<const float> q,
                      absl::Span<float> out) override;
  int Length(int layer) const override;

  // Stored rows of `layer`: Length(layer) rows of H_kv * d floats. Valid until the next Append.
  absl::Span<const float> Keys(int layer) const;
  absl::Span<const float> Values(int layer) const;

  // Forgets every position of every layer (keeps the allocation).
  void Clear();

  int capacity() const { return capacity_; }
  const AttentionShape& shape() const { return shape_; }

 private:
  Fp32KvCache(int n_layers, const AttentionShape& shape, int capacity);
  absl::Status CheckLayer(int layer) const;

  AttentionShape shape_;
  int n_layers_;
  int capacity_;
  std::vector<int> length_;   // [n_layers]
  std::vector<float> k_, v_;  // [n_layers][capacity][kv_dim]
};

}  // namespace kvpool::engine
