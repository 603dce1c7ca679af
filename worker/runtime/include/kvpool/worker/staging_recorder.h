// kvpool/worker/staging_recorder.h — a KvCacheView decorator that keeps the un-rotated BF16
// K/V of every token in the staging layout a prefill node writes into the pool
// (docs/BLOCK_FORMAT.md BF16 form: per layer, per KV head, K[P][d] then V[P][d]).
//
// The engine computes fp32 K/V; a prefill client sends them rounded to bf16 (round to nearest
// even) and un-rotated — the pool rotates at commit. The recorder forwards every call to the
// wrapped view (which does the attention) and reports each completed (block, layer) chunk, so
// a prefill node can stream layer by layer while it computes.
//
//   StagingRecorder rec(inner.get(), geometry);
//   rec.set_on_layer_complete([&](int block, int layer) { push.WriteLayer(block, layer, ...); });
//   engine->Prefill(tokens, 0, rec);
//   const uint8_t* staging = rec.Staging(block);   // Bf16FormBytes bytes
//
// Thread-safety: like every KvCacheView, one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvpool/engine/kv_cache.h"
#include "kvpool/kernels/block_format.h"

namespace kvpool::worker {

class StagingRecorder : public engine::KvCacheView {
 public:
  // `inner` (not owned, must outlive this) does storage and attention; `geometry` gives L, H,
  // d and P (must describe the same model as the engine; Append checks the row size).
  StagingRecorder(engine::KvCacheView* inner, const BlockGeometry& geometry);

  // Records bf16(k), bf16(v) of (layer, pos) into block pos/P, then forwards to the inner
  // view. When pos completes a block for `layer`, calls on_layer_complete(pos/P, layer) after
  // the inner append succeeded. Errors: INVALID_ARGUMENT for a bad layer or span size;
  // whatever the inner view returns.
  absl::Status Append(int layer, int pos, absl::Span<const float> k,
                      absl::Span<const float> v) override;
  absl::Status Attend(int layer, int pos, absl::Span<const float> q,
                      absl::Span<float> out) override {
    return inner_->Attend(layer, pos, q, out);
  }
  int Length(int layer) const override { return inner_->Length(layer); }

  void set_on_layer_complete(std::function<void(int block, int layer)> fn) {
    on_layer_complete_ = std::move(fn);
  }

  // Staging bytes of block `block` (Bf16FormBytes), nullptr when the block was never started.
  // Rows of positions not yet appended are zero. Valid until the next Append.
  const uint8_t* Staging(int block) const;
  // Blocks complete in every layer.
  int FullBlocks() const;
  const BlockGeometry& geometry() const { return geometry_; }

 private:
  engine::KvCacheView* inner_;
  BlockGeometry geometry_;
  std::vector<std::vector<uint8_t>> blocks_;
  std::function<void(int, int)> on_layer_complete_;
};

}  // namespace kvpool::worker
