// kvpool/worker/eval.h — the in-process evaluation harness (no pool): a float32 reference
// continuation, the mixed-precision continuation a decode worker would produce, and
// teacher-forced next-token agreement and perplexity ratio against the float32 reference.
//
// P/D numerics emulated in one process (docs/WORKER.md "Evaluation"): the prompt's first
// PoolPrefixTokens(n) tokens are computed with BF16 history (what a prefill node does; those
// are the full blocks a decode worker takes from the pool), then the cache switches to the
// evaluated history precision (int2 demotes the history blocks exactly as the pool quantizes
// them) and the rest of the prompt plus the continuation run in that mode. A pool-served
// decode therefore reproduces these runs bit for bit.
//
// Teacher forcing: the continuation positions are fed the reference's tokens c_0..c_{m−1}
// (greedy float32 tokens); at each position the mixed logits' argmax is compared with the
// reference token (= the float32 argmax at the same prefix), and the negative log-likelihood of
// the reference token is accumulated for both models:
//   agreement  = matches / m
//   ppl_ratio  = exp(mean NLL_mixed − mean NLL_fp32)       (perplexity ratio, ≥ ~1)
//
//   KVPOOL_ASSIGN_OR_RETURN(auto ref, RunReference(*engine, prompt, 48));
//   KVPOOL_ASSIGN_OR_RETURN(auto tf, TeacherForce(*engine, rot, opts, prompt, ref));
//
// Thread-safety: functions use the given Engine exclusively (one thread per Engine).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/engine/engine.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/worker/mixed_kv_cache.h"

namespace kvpool::worker {

// Tokens of a prompt of `n_prompt` tokens that a decode worker takes from the pool: the full
// blocks before the last prompt token (the last token is always computed locally, to get its
// logits): ⌊(n_prompt − 1)/P⌋·P.
int PoolPrefixTokens(int n_prompt, int page_size);

struct ReferenceRun {
  std::vector<int> tokens;  // greedy continuation (stops early at EOS/BOS)
  std::vector<double> nll;  // −log p_fp32(tokens[i]) at its position
  double seconds = 0;
};

// Float32 reference: greedy continuation of `prompt` (non-empty) for up to `max_new` tokens
// with the engine's Fp32KvCache. Errors: the engine's (INVALID_ARGUMENT for a prompt longer
// than the context, ...).
absl::StatusOr<ReferenceRun> RunReference(engine::Engine& engine, absl::Span<const int> prompt,
                                          int max_new);

// Builds a MixedKvCache for `engine`'s model and computes `prompt` the P/D way (file comment):
// [0, PoolPrefixTokens) with BF16 history, then the rest with options.history. Returns the
// cache; *last_logits (nullable) receives the last prompt token's logits.
absl::StatusOr<std::unique_ptr<MixedKvCache>> PrefillPd(
    engine::Engine& engine, std::shared_ptr<const RotationSet> rotations,
    const MixedCacheOptions& options, absl::Span<const int> prompt,
    std::vector<float>* last_logits);

// Greedy continuation with the mixed cache after PrefillPd (the single-process twin of a
// pool-served decode). Stops at EOS/BOS like the engine's Generate.
absl::StatusOr<std::vector<int>> MixedGreedy(engine::Engine& engine,
                                             std::shared_ptr<const RotationSet> rotations,
                                             const MixedCacheOptions& options,
                                             absl::Span<const int> prompt, int max_new);

struct TeacherForcedResult {
  int positions = 0;     // m, continuation tokens scored
  int matches = 0;       // argmax(mixed) == reference token
  double nll_mixed = 0;  // Σ −log p_mixed(c_i)
  double nll_ref = 0;    // Σ −log p_fp32(c_i)
  double agreement() const { return positions ? double(matches) / positions : 1.0; }
  // exp(mean NLL_mixed − mean NLL_fp32); 1 when no position.
  double ppl_ratio() const;
  void Add(const TeacherForcedResult& o);
};

// Scores logits against a reference token: adds one position to *r (argmax match, NLL of
// `token`, and `ref_nll` of the reference). Exposed for the pool-served decode.
void ScorePosition(absl::Span<const float> logits, int token, double ref_nll,
                   TeacherForcedResult* r);

// Teacher-forced comparison of the mixed cache (after PrefillPd) with the reference.
absl::StatusOr<TeacherForcedResult> TeacherForce(engine::Engine& engine,
                                                 std::shared_ptr<const RotationSet> rotations,
                                                 const MixedCacheOptions& options,
                                                 absl::Span<const int> prompt,
                                                 const ReferenceRun& reference);

// Greedy continuation from a prepared cache: `logits` are those of the token at pos − 1 (the
// last prompt token), `pos` the next position. Stops at EOS/BOS or the context end.
absl::StatusOr<std::vector<int>> GreedyFrom(engine::Engine& engine, engine::KvCacheView& cache,
                                            std::vector<float> logits, int pos, int max_new);

// Teacher forcing from a prepared cache (arguments as GreedyFrom) against `reference`.
absl::StatusOr<TeacherForcedResult> TeacherForceFrom(engine::Engine& engine,
                                                     engine::KvCacheView& cache,
                                                     std::vector<float> logits, int pos,
                                                     const ReferenceRun& reference);

// −log softmax(logits)[token], computed in fp64.
double NegLogLikelihood(absl::Span<const float> logits, int token);
// Index of the largest logit (lowest index on ties), like the engine's greedy sampler.
int Argmax(absl::Span<const float> logits);

}  // namespace kvpool::worker
