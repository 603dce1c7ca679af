// kvpool/engine/sampler.h — picks the next token from logits: greedy or temperature + top-p.
//
//   Sampler s({.temperature = 0.8f, .top_p = 0.9f, .seed = 42});
//   int next = s.Sample(logits);
//
// temperature 0 → greedy (argmax, lowest id on ties; the RNG is not used). Otherwise
// p = softmax(logits / temperature); with top_p < 1 only the smallest set of most probable
// tokens whose probabilities sum to >= top_p is kept (nucleus sampling, Holtzman et al. 2019,
// "The Curious Case of Neural Text Degeneration"), renormalized, and one is drawn with a
// seeded xorshift64* generator, so a given seed gives the same tokens on every platform.
// Thread-safety: a Sampler holds RNG state; use one per sequence/thread.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace kvpool::engine {

struct SamplingOptions {
  float temperature = 0.0f;  // 0 = greedy; must be >= 0 and finite
  float top_p = 1.0f;        // in (0, 1]; 1 = sample from the full distribution
  uint64_t seed = 0;         // RNG seed (any value)
};

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options);

  // INVALID_ARGUMENT naming "temperature" or "top_p" when out of range.
  static absl::Status Validate(const SamplingOptions& options);

  // Index of the chosen token in `logits` (non-empty; NaN logits are never chosen unless all
  // are NaN, then 0). Options are assumed validated.
  int Sample(absl::Span<const float> logits);

 private:
  float NextUniform();  // in [0, 1)

  SamplingOptions options_;
  uint64_t state_;
  std::vector<std::pair<float, int>> scratch_;
};

}  // namespace kvpool::engine
