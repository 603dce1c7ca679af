// Greedy and temperature/top-p sampling; see kvpool/engine/sampler.h.
#include "kvpool/engine/sampler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvpool::engine {

Sampler::Sampler(const SamplingOptions& options)
    // splitmix64 of the seed, so that seed 0 does not give xorshift's all-zero state.
    : options_(options), state_(options.seed + 0x9e3779b97f4a7c15ull) {
  state_ = (state_ ^ (state_ >> 30)) * 0xbf58476d1ce4e5b9ull;
  state_ = (state_ ^ (state_ >> 27)) * 0x94d049bb133111ebull;
  state_ ^= state_ >> 31;
  if (state_ == 0) {
    state_ = 1;
  }
}

absl::Status Sampler::Validate(const SamplingOptions& o) {
  if (!(o.temperature >= 0.0f) || !std::isfinite(o.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature ", o.temperature, " must be a finite number >= 0"));
  }
  if (!(o.top_p > 0.0f && o.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p ", o.top_p, " must be in (0, 1]"));
  }
  return absl::OkStatus();
}

float Sampler::NextUniform() {
  // xorshift64* (Vigna, "An experimental exploration of Marsaglia's xorshift generators").
  state_ ^= state_ >> 12;
  state_ ^= state_ << 25;
  state_ ^= state_ >> 27;
  const uint64_t r = state_ * 0x2545f4914f6cdd1dull;
  return static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // 24 random bits
}

int Sampler::Sample(absl::Span<const float> logits) {
  const int n = static_cast<int>(logits.size());
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (logits[i] > logits[best] || std::isnan(logits[best])) {
      best = i;
    }
  }
  if (options_.temperature == 0.0f || std::isnan(logits[best])) {
    return best;
  }

  // Softmax at temperature T, relative to the max logit.
  scratch_.clear();
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    if (std::isnan(logits[i])) {
      continue;
    }
    const float p = std::exp((logits[i] - logits[best]) / options_.temperature);
    scratch_.emplace_back(p, i);
    sum += p;
  }
  float limit = sum;
  if (options_.top_p < 1.0f) {
    std::sort(scratch_.begin(), scratch_.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    float cum = 0.0f;
    size_t keep = 0;
    while (keep < scratch_.size()) {
      cum += scratch_[keep].first;
      ++keep;
      if (cum >= options_.top_p * sum) {
        break;
      }
    }
    scratch_.resize(keep);
    limit = cum;
  }
  const float r = NextUniform() * limit;
  float cum = 0.0f;
  for (const auto& [p, i] : scratch_) {
    cum += p;
    if (r < cum) {
      return i;
    }
  }
  return scratch_.back().second;  // rounding: r landed at the very end
}

}  // namespace kvpool::engine
