// kvpool/worker/gpu_mixed_kv_cache.h — a request's KV cache in OSCAR mixed precision whose pages
// live in GPU memory, attended by the CUDA kernels (kvpool_cuda_kernels, sm_90a); the GPU twin of
// MixedKvCache (kvpool/worker/mixed_kv_cache.h) behind the same engine::KvCacheView.
//
// Layout: for every layer one BF16 page pool and one INT2 page pool in device memory, page id =
// block index b (tokens [b·P, (b+1)·P)), a page holding the layer's H_kv chunks in the forms of
// docs/BLOCK_FORMAT.md (PagePool in kvpool/kernels/cuda/paged_decode.h, page stride =
// BlockGeometry::Bf16LayerBytes() / Int2LayerBytes()). Segments follow FORMAT.md §3 exactly as
// MixedKvCache computes them (same SegmentOf / RecentStartBlock rules):
//   sink    blocks [0, min(S/P, n/P))            BF16 pages
//   history full blocks up to RecentStartBlock(n) INT2 pages (history precision int2)
//   recent  the rest, last page partial           BF16 pages
// Append converts the engine's fp32 k, v to bf16 (round to nearest even, what a prefill client
// sends) and writes them with LaunchRotateWriteBf16 (rotation on tensor cores with an fp16 copy
// of R, fp32 accumulation, bf16 output; docs/KERNELS.md). When an append completes a block, the
// block leaving the recent window is demoted with LaunchDemote into its INT2 page (the BF16 page
// is kept, so truncation never loses a form). Attend converts q to bf16, builds the three CSR
// page tables on the host, runs LaunchPagedDecode (q rotated by R_K, output rotated back by
// R_Vᵀ inside the kernel path) and returns the bf16 output widened to fp32.
//
// Numerics versus MixedKvCache (fp32 R, fp32 q and output): the GPU rotation's fp16 R moves a
// rotated value by ~3e-4 relative, which flips its bf16 rounding now and then and with it an
// INT2 code (0.017 % of codes, docs/KERNELS.md); q and the output are rounded to bf16
// (rel 2^-9 each). Expect attention outputs to agree to ~1e-2 relative, not bit for bit.
//
// Not supported (returned as errors, never silently wrong): an INT2 row whose (scale, min) do not
// fit fp16 (the CPU cache keeps such a block in BF16; here Attend returns FAILED_PRECONDITION
// naming the layer), LoadBlocks from the pool, batching several sequences.
//
// Synchronization: Append enqueues its copy, write and demotion on the cache's stream without
// waiting for them (it first waits for the previous call's work, whose pinned host staging it
// reuses); Attend synchronizes the stream once to return the output. The kernels themselves
// never synchronize.
// Thread-safety: one sequence, one thread (like every KvCacheView); not thread-safe.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto cache, GpuMixedKvCache::Create(L, shape, rotations, options));
//   engine->Prefill(tokens, 0, *cache);
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/engine/kv_cache.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/worker/mixed_kv_cache.h"

namespace kvpool::worker {

// Counters (monotonic over the cache's life).
struct GpuCacheStats {
  uint64_t demoted_chunks = 0;   // (block, layer) chunks demoted to INT2 by LaunchDemote
  uint64_t decode_launches = 0;  // LaunchPagedDecode calls
};

class GpuMixedKvCache : public engine::KvCacheView {
 public:
  // Creates an empty cache on the current CUDA device for `n_layers` layers of `shape`, with
  // the options of MixedCacheOptions (page_size 16 or 64; head_dim 64, 128 or 256 — what the
  // kernels implement). `rotations` must match the model (num_layers, num_kv_heads, head_dim);
  // its matrices are copied to the device. Allocates 2·n_layers pools of ⌈capacity/P⌉ pages
  // plus small buffers up front. Errors: INVALID_ARGUMENT naming the field (counts, shapes,
  // options, null rotations); FAILED_PRECONDITION for a rotation set of another geometry or a
  // shape the kernels do not support; RESOURCE_EXHAUSTED when device memory runs out;
  // UNAVAILABLE when no CUDA device is usable.
  static absl::StatusOr<std::unique_ptr<GpuMixedKvCache>> Create(
      int n_layers, const engine::AttentionShape& shape,
      std::shared_ptr<const RotationSet> rotations, const MixedCacheOptions& options);
  ~GpuMixedKvCache() override;
  GpuMixedKvCache(const GpuMixedKvCache&) = delete;
  GpuMixedKvCache& operator=(const GpuMixedKvCache&) = delete;

  // engine::KvCacheView. k, v: [H_kv·d] fp32; q, out: [H_q·d] fp32. Errors as MixedKvCache
  // (INVALID_ARGUMENT for bad layer / pos / sizes or non-finite input naming the element,
  // RESOURCE_EXHAUSTED at capacity); INTERNAL when a kernel launch or CUDA call fails (message
  // names it); FAILED_PRECONDITION from Attend when a demoted row overflowed fp16 (see above).
  absl::Status Append(int layer, int pos, absl::Span<const float> k,
                      absl::Span<const float> v) override;
  absl::Status Attend(int layer, int pos, absl::Span<const float> q,
                      absl::Span<float> out) override;
  int Length(int layer) const override;

  // Segment rules (FORMAT.md §3), identical to MixedKvCache's.
  int RecentStartBlock(int length) const;

  const GpuCacheStats& stats() const { return stats_; }
  const BlockGeometry& geometry() const { return geometry_; }

 private:
  GpuMixedKvCache(int n_layers, const engine::AttentionShape& shape,
                  std::shared_ptr<const RotationSet> rotations, const MixedCacheOptions& options);
  absl::Status Init();
  absl::Status CheckLayer(int layer) const;
  // Device allocation helper; records the pointer for the destructor.
  absl::Status Alloc(void** p, size_t bytes, const char* what);

  engine::AttentionShape shape_;
  int n_layers_;
  MixedCacheOptions options_;
  BlockGeometry geometry_;
  std::shared_ptr<const RotationSet> rotations_;
  int sink_blocks_ = 0;
  int recent_blocks_ = 0;
  int max_blocks_ = 0;
  std::vector<int> length_;  // [L]
  GpuCacheStats stats_;

  void* stream_ = nullptr;  // cudaStream_t
  std::vector<void*> allocations_;
  std::vector<uint8_t*> bf16_pool_, int2_pool_;  // [L] device
  float* rot_k_ = nullptr;                       // device, all layers (RotationSet layout)
  float* rot_v_ = nullptr;
  uint16_t* kv_dev_ = nullptr;    // [2][kv_dim] bf16 staging (k then v)
  uint16_t* q_dev_ = nullptr;     // [q_dim]
  uint16_t* out_dev_ = nullptr;   // [q_dim]
  int32_t* table_dev_ = nullptr;  // page tables + write/demote indices
  uint32_t* bad_rows_dev_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  // Pinned host staging.
  uint16_t* kv_host_ = nullptr;
  uint16_t* q_host_ = nullptr;
  uint16_t* out_host_ = nullptr;
  int32_t* table_host_ = nullptr;
  size_t table_ints_ = 0;
};

}  // namespace kvpool::worker
