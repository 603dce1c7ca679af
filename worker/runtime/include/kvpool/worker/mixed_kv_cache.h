// kvpool/worker/mixed_kv_cache.h — a request's KV cache in OSCAR mixed precision
// (FORMAT.md §3), plugged into the reference engine through engine::KvCacheView.
//
// Storage is paged: block b holds tokens [b·P, (b+1)·P) for every layer and KV head in the
// forms of docs/BLOCK_FORMAT.md (`kvpool-block-v1`), all **rotated** (k·R_K, v·R_V):
//   - sink    blocks [0, S/P)                 BF16 form, never demoted;
//   - history full blocks between sink/recent INT2 form (history precision int2) or BF16 form
//                                             (history precision bf16: no quantization);
//   - recent  the last ⌈W/P⌉ full blocks plus the partial block, BF16 form (W..W+P−1 tokens).
// When a full block leaves the recent window it is demoted: its rotated BF16 rows are quantized
// to INT2 in place (block-granular, per layer as the engine's per-layer appends advance).
//
// Canonical numerics (shared bit for bit with the pool, docs/WORKER.md):
//   engine fp32 k, v → bf16 (round to nearest even; what a prefill client sends)
//   → k̃ = bf16(k)·R_K, ṽ = bf16(v)·R_V in fp32 (kvpool::RotateQuantizeRowsBf16, the function
//     the pool's commit path calls) → BF16 form = bf16(k̃), bf16(ṽ)
//   → INT2 form = OSCAR quantization of exactly those bf16 values (QuantizeRowsBf16, FORMAT.md §2)
// Blocks fetched from the pool (LoadBlocks) carry the same bytes, so a cache filled from the
// pool and a cache that computed the same tokens locally attend identically.
//
// Attend is the kernels library's reference mixed-precision decode attention
// (kvpool/kernels/attention.h, FORMAT.md §3) run directly over the cache's pages:
// q̃_i = q_i·R_K(⌊i/g⌋); sink, history and recent segments each give a partial (õ, lse) over
// their pages (BF16 widened, INT2 dequantized x̂ = min16 + code·scale16); the partials merge with
// the associative LSE merge (empty segments contribute nothing); out_i = õ_i·R_V(⌊i/g⌋)ᵀ.
// Pages are read in place — nothing is dequantized into a staging buffer.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto cache, MixedKvCache::Create(L, shape, rotations, options));
//   engine->Prefill(tokens, 0, *cache);             // engine::Engine from kvpool/engine/engine.h
//
// Thread-safety: one sequence, one thread (like every KvCacheView); not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/engine/kv_cache.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/rotation.h"

namespace kvpool::worker {

// Precision of history blocks (FORMAT.md §3; proto HistoryPrecision).
enum class HistoryPrecision { kInt2 = 0, kBf16 = 1 };

// "int2" / "bf16" (the spelling of block keys, docs/KEYS.md #14).
const char* HistoryPrecisionName(HistoryPrecision p);
// Parses "int2" / "bf16"; INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<HistoryPrecision> ParseHistoryPrecision(const std::string& name,
                                                       const char* field = "history_precision");

struct MixedCacheOptions {
  // P, tokens per block; power of two. Default 16 (docs/BLOCK_FORMAT.md).
  int page_size = 16;
  // S, sink tokens kept in BF16 forever; a multiple of page_size (0: no sink). Default 64.
  int sink_tokens = 64;
  // W, recent tokens kept in BF16; the window holds the last ⌈W/P⌉ full blocks plus the
  // partial block (W..W+P−1 tokens when W is a multiple of P). >= 0. Default 256.
  int recent_tokens = 256;
  // History precision; can be changed later with set_history_precision.
  HistoryPrecision history = HistoryPrecision::kInt2;
  // Clip ratios of the INT2 quantizer (FORMAT.md §2.2); 0 disables clipping.
  float clip_ratio_k = 0.96f;
  float clip_ratio_v = 0.92f;
  // Positions the cache can hold, 1..2^24 (the GGUF reader's bound on llama.context_length),
  // e.g. the model's context length; blocks are allocated as positions are written.
  int capacity = 512;
};

// Where one position's (layer's) block currently sits.
enum class Segment { kSink = 0, kHistory = 1, kRecent = 2 };

// Counters (monotonic over the cache's life).
struct MixedCacheStats {
  uint64_t demoted_chunks = 0;        // (block, layer) chunks quantized to INT2 locally
  uint64_t int2_overflow_chunks = 0;  // chunks that kept BF16 because a group exceeded fp16
  uint64_t loaded_blocks = 0;         // blocks taken from LoadBlocks
};

// One block handed to LoadBlocks: pointers to its forms' bytes (docs/BLOCK_FORMAT.md), either
// may be null but not both. Not owned; copied during the call.
struct BlockForms {
  const uint8_t* bf16 = nullptr;  // [Bf16FormBytes] rotated BF16 form, or null
  const uint8_t* int2 = nullptr;  // [Int2FormBytes] INT2 form, or null
};

class MixedKvCache : public engine::KvCacheView {
 public:
  // Creates an empty cache for `n_layers` layers of `shape` (H_q, H_kv, d). `rotations` must
  // match (num_layers == n_layers, num_kv_heads == H_kv, head_dim == d); shared, immutable.
  // Errors: INVALID_ARGUMENT naming the field (counts < 1, H_q not a multiple of H_kv, head_dim
  // not a power of two in [8, 1024], page_size not a power of two, sink_tokens not a multiple of
  // page_size or negative, recent_tokens < 0, capacity < 1, bad clip ratio, null rotations);
  // FAILED_PRECONDITION when the rotation set's geometry differs from the model's.
  static absl::StatusOr<std::unique_ptr<MixedKvCache>> Create(
      int n_layers, const engine::AttentionShape& shape,
      std::shared_ptr<const RotationSet> rotations, const MixedCacheOptions& options);

  // ---- engine::KvCacheView -------------------------------------------------------------------
  // Stores the token's K/V through the canonical pipeline (file comment) into the BF16 form of
  // block pos/P; demotes the block that leaves the recent window when this append completes a
  // block (history precision int2). pos < Length(layer) truncates the layer to pos first.
  // Errors: INVALID_ARGUMENT (bad layer / pos / span size, or a non-finite value naming the
  // element), RESOURCE_EXHAUSTED at capacity, FAILED_PRECONDITION when a truncation would put
  // back into the recent window a block that has no BF16 form (fetched INT2-only).
  absl::Status Append(int layer, int pos, absl::Span<const float> k,
                      absl::Span<const float> v) override;
  // Mixed-precision attention for the query of token `pos` over positions [0, pos] (file
  // comment). Segments are those of a sequence of pos+1 tokens; each block is read in its
  // current form (a recent-window block loaded INT2-only — LoadBlocks' planned_length — from
  // its INT2 form, as its own run of the recent segment). Errors: INVALID_ARGUMENT for a bad layer,
  // pos >= Length(layer) or bad span sizes.
  absl::Status Attend(int layer, int pos, absl::Span<const float> q,
                      absl::Span<float> out) override;
  int Length(int layer) const override;

  // ---- pool integration ----------------------------------------------------------------------
  // Appends fetched blocks (all layers) at the end of the cache, which must hold whole blocks
  // only, the same number in every layer (Length(l) == b·P for all l). blocks[i] becomes block
  // b + i. After loading, the sink blocks and the recent-window blocks must have a BF16 form,
  // and history blocks the form of the history precision (either form is accepted for history
  // in int2 mode: a BF16-only block is demoted locally, giving the bytes the pool would have
  // produced). Errors: FAILED_PRECONDITION (partial last block, layers of unequal length, a
  // required form missing — naming the block and form), INVALID_ARGUMENT (a block with no
  // form), RESOURCE_EXHAUSTED (capacity). On error the cache is unchanged.
  //
  // `planned_length` (tokens; 0 = the length after loading) is the length the caller is about
  // to extend the sequence to, e.g. a decoder that loads a prefix of its prompt's blocks and
  // computes the rest (a partial hit). A block that is history at planned_length may then come
  // INT2-only (in int2 mode) although it is still in the recent window of the loaded length: it
  // is history in the prompt's context, and the pool holds its INT2 form (FORMAT.md §3). Such a
  // block was demoted early: while it is in the window it is attended from its INT2 form (the
  // tokens appended up to planned_length attend it that way), and the demotion when it leaves
  // the window keeps that form. A block with a BF16 form is treated as without planned_length.
  // INVALID_ARGUMENT when planned_length is negative, or positive and less than the length
  // after loading or above the capacity.
  absl::Status LoadBlocks(absl::Span<const BlockForms> blocks, int planned_length = 0);

  // Switches the history precision: to int2 demotes every history chunk, to bf16 re-reads the
  // BF16 forms. FAILED_PRECONDITION (naming the block) when bf16 is requested and a history
  // block has no BF16 form. The numerics of P/D serving: a prefill node attends in BF16, then
  // the decode side attends INT2 history (docs/WORKER.md).
  absl::Status set_history_precision(HistoryPrecision p);
  HistoryPrecision history_precision() const { return options_.history; }

  // Segment of block `block` in a sequence of `length` tokens (FORMAT.md §3). Pure.
  Segment SegmentOf(int block, int length) const;
  // First block of the recent window for a sequence of `length` tokens.
  int RecentStartBlock(int length) const;

  // Bytes of a block's forms (docs/BLOCK_FORMAT.md); nullptr when the block has no such form.
  // `block` < number of started blocks. Valid until the next mutating call.
  const uint8_t* Bf16Form(int block) const;
  const uint8_t* Int2Form(int block) const;
  // True when every layer of the block has a valid chunk of that form.
  bool HasBf16Form(int block) const;
  bool HasInt2Form(int block) const;

  const BlockGeometry& geometry() const { return geometry_; }
  const MixedCacheOptions& options() const { return options_; }
  const MixedCacheStats& stats() const { return stats_; }
  const engine::AttentionShape& shape() const { return shape_; }

 private:
  struct Block {
    std::vector<uint8_t> bf16;       // [Bf16FormBytes] (allocated on first use)
    std::vector<uint8_t> int2;       // [Int2FormBytes] (allocated on first use)
    std::vector<uint8_t> has_bf16;   // [L] chunk of layer l valid
    std::vector<uint8_t> has_int2;   // [L]
    std::vector<uint8_t> int2_fail;  // [L] quantization overflowed: keep BF16
  };

  MixedKvCache(int n_layers, const engine::AttentionShape& shape,
               std::shared_ptr<const RotationSet> rotations, const MixedCacheOptions& options);
  absl::Status CheckLayer(int layer) const;
  Block& EnsureBlock(int b);
  // Quantizes block b's layer-l BF16 chunk into its INT2 form (no-op when present).
  void DemoteChunk(int b, int layer);
  // FAILED_PRECONDITION (naming block, layer and segment) when the form that block b's segment
  // reads at the layer's current length is missing.
  absl::Status CheckForms(int b, int layer) const;
  // True when (b, layer) is attended from its INT2 form at the layer's current length.
  bool UsesInt2(int b, int layer) const;

  engine::AttentionShape shape_;
  int n_layers_;
  MixedCacheOptions options_;
  BlockGeometry geometry_;
  std::shared_ptr<const RotationSet> rotations_;
  int sink_blocks_;
  int recent_blocks_;
  std::vector<int> length_;    // [L]
  std::vector<Block> blocks_;  // grown on demand, up to ceil(capacity / P)
  MixedCacheStats stats_;
  // Scratch.
  std::vector<uint16_t> row_bf16_;
  std::vector<uint8_t> codes_scratch_;
  std::vector<uint16_t> params_scratch_;
  std::vector<float> q_rot_, acc_, acc_lse_, part_, part_lse_;
};

}  // namespace kvpool::worker
