// In-process evaluation harness (see kvpool/worker/eval.h).
#include "kvpool/worker/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"

namespace kvpool::worker {

int PoolPrefixTokens(int n_prompt, int page_size) {
  if (n_prompt <= 1 || page_size <= 0) {
    return 0;
  }
  return ((n_prompt - 1) / page_size) * page_size;
}

double NegLogLikelihood(absl::Span<const float> logits, int token) {
  double m = -INFINITY;
  for (float x : logits) {
    m = std::max(m, static_cast<double>(x));
  }
  double sum = 0;
  for (float x : logits) {
    sum += std::exp(static_cast<double>(x) - m);
  }
  return m + std::log(sum) - static_cast<double>(logits[token]);
}

int Argmax(absl::Span<const float> logits) {
  int best = 0;
  for (int i = 1; i < static_cast<int>(logits.size()); ++i) {
    if (logits[i] > logits[best]) {
      best = i;
    }
  }
  return best;
}

double TeacherForcedResult::ppl_ratio() const {
  if (positions == 0) {
    return 1.0;
  }
  return std::exp((nll_mixed - nll_ref) / positions);
}

void TeacherForcedResult::Add(const TeacherForcedResult& o) {
  positions += o.positions;
  matches += o.matches;
  nll_mixed += o.nll_mixed;
  nll_ref += o.nll_ref;
}

void ScorePosition(absl::Span<const float> logits, int token, double ref_nll,
                   TeacherForcedResult* r) {
  ++r->positions;
  if (Argmax(logits) == token) {
    ++r->matches;
  }
  r->nll_mixed += NegLogLikelihood(logits, token);
  r->nll_ref += ref_nll;
}

namespace {
bool IsStop(const engine::Engine& e, int tok) {
  return tok == e.tokenizer().eos_id() || tok == e.tokenizer().bos_id();
}
}  // namespace

absl::StatusOr<ReferenceRun> RunReference(engine::Engine& engine, absl::Span<const int> prompt,
                                          int max_new) {
  if (prompt.empty()) {
    return absl::InvalidArgumentError("prompt is empty");
  }
  if (max_new < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_new ", max_new, " < 0"));
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int ctx = engine.config().context_length;
  // Sized by the run (prompt + max_new positions at most), not the model's context: a GGUF
  // context_length of 2^24 allocated 21 GB up front (newcomer s8 N12).
  KVPOOL_ASSIGN_OR_RETURN(auto cache,
                          engine.NewCache(static_cast<int>(std::min<int64_t>(
                              ctx, static_cast<int64_t>(prompt.size()) + std::max(max_new, 1)))));
  KVPOOL_ASSIGN_OR_RETURN(absl::Span<const float> logits, engine.Prefill(prompt, 0, *cache));
  ReferenceRun run;
  int pos = static_cast<int>(prompt.size());
  for (int i = 0; i < max_new && pos < ctx; ++i) {
    const int tok = Argmax(logits);
    if (IsStop(engine, tok)) {
      break;
    }
    run.tokens.push_back(tok);
    run.nll.push_back(NegLogLikelihood(logits, tok));
    if (i + 1 == max_new || pos + 1 > ctx) {
      break;
    }
    KVPOOL_ASSIGN_OR_RETURN(logits, engine.Forward(tok, pos, *cache));
    ++pos;
  }
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

absl::StatusOr<std::unique_ptr<MixedKvCache>> PrefillPd(
    engine::Engine& engine, std::shared_ptr<const RotationSet> rotations,
    const MixedCacheOptions& options, absl::Span<const int> prompt,
    std::vector<float>* last_logits) {
  if (prompt.empty()) {
    return absl::InvalidArgumentError("prompt is empty");
  }
  const engine::ModelConfig& c = engine.config();
  MixedCacheOptions prefill_options = options;
  prefill_options.history = HistoryPrecision::kBf16;
  KVPOOL_ASSIGN_OR_RETURN(auto cache, MixedKvCache::Create(c.n_layers, c.attention(),
                                                           std::move(rotations), prefill_options));
  const int n = static_cast<int>(prompt.size());
  const int prefix = PoolPrefixTokens(n, options.page_size);
  if (prefix > 0) {
    KVPOOL_RETURN_IF_ERROR(engine.Prefill(prompt.subspan(0, prefix), 0, *cache).status());
  }
  KVPOOL_RETURN_IF_ERROR(cache->set_history_precision(options.history));
  KVPOOL_ASSIGN_OR_RETURN(absl::Span<const float> logits,
                          engine.Prefill(prompt.subspan(prefix), prefix, *cache));
  if (last_logits != nullptr) {
    last_logits->assign(logits.begin(), logits.end());
  }
  return cache;
}

absl::StatusOr<std::vector<int>> GreedyFrom(engine::Engine& engine, engine::KvCacheView& cache,
                                            std::vector<float> logits, int pos, int max_new) {
  std::vector<int> out;
  const int ctx = engine.config().context_length;
  for (int i = 0; i < max_new && pos < ctx; ++i) {
    const int tok = Argmax(logits);
    if (IsStop(engine, tok)) {
      break;
    }
    out.push_back(tok);
    if (i + 1 == max_new || pos + 1 > ctx) {
      break;
    }
    KVPOOL_ASSIGN_OR_RETURN(absl::Span<const float> l, engine.Forward(tok, pos, cache));
    logits.assign(l.begin(), l.end());
    ++pos;
  }
  return out;
}

absl::StatusOr<TeacherForcedResult> TeacherForceFrom(engine::Engine& engine,
                                                     engine::KvCacheView& cache,
                                                     std::vector<float> logits, int pos,
                                                     const ReferenceRun& reference) {
  if (reference.nll.size() != reference.tokens.size()) {
    return absl::InvalidArgumentError("reference.nll and reference.tokens differ in length");
  }
  TeacherForcedResult r;
  for (size_t i = 0; i < reference.tokens.size(); ++i) {
    ScorePosition(logits, reference.tokens[i], reference.nll[i], &r);
    if (i + 1 == reference.tokens.size()) {
      break;
    }
    KVPOOL_ASSIGN_OR_RETURN(absl::Span<const float> l,
                            engine.Forward(reference.tokens[i], pos, cache));
    logits.assign(l.begin(), l.end());
    ++pos;
  }
  return r;
}

absl::StatusOr<std::vector<int>> MixedGreedy(engine::Engine& engine,
                                             std::shared_ptr<const RotationSet> rotations,
                                             const MixedCacheOptions& options,
                                             absl::Span<const int> prompt, int max_new) {
  std::vector<float> logits;
  KVPOOL_ASSIGN_OR_RETURN(auto cache, PrefillPd(engine, rotations, options, prompt, &logits));
  return GreedyFrom(engine, *cache, std::move(logits), static_cast<int>(prompt.size()), max_new);
}

absl::StatusOr<TeacherForcedResult> TeacherForce(engine::Engine& engine,
                                                 std::shared_ptr<const RotationSet> rotations,
                                                 const MixedCacheOptions& options,
                                                 absl::Span<const int> prompt,
                                                 const ReferenceRun& reference) {
  std::vector<float> logits;
  KVPOOL_ASSIGN_OR_RETURN(auto cache, PrefillPd(engine, rotations, options, prompt, &logits));
  return TeacherForceFrom(engine, *cache, std::move(logits), static_cast<int>(prompt.size()),
                          reference);
}

}  // namespace kvpool::worker
