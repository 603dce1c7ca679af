// Default float32 KV cache and the reference attention; see kvpool/engine/kv_cache.h.
#include "kvpool/engine/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvpool::engine {

void ReferenceAttention(const AttentionShape& shape, int n_positions, const float* q,
                        const float* keys, const float* values, int row_stride, float* out) {
  const int d = shape.head_dim;
  const int group = shape.n_heads / shape.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> scores(n_positions);
  for (int h = 0; h < shape.n_heads; ++h) {
    const int kvh = h / group;
    const float* qh = q + h * d;
    float max_score = -INFINITY;
    for (int t = 0; t < n_positions; ++t) {
      const float* k = keys + static_cast<size_t>(t) * row_stride + kvh * d;
      float dot = 0.0f;
      for (int i = 0; i < d; ++i) {
        dot += qh[i] * k[i];
      }
      scores[t] = dot * scale;
      max_score = std::max(max_score, scores[t]);
    }
    float sum = 0.0f;
    for (int t = 0; t < n_positions; ++t) {
      scores[t] = std::exp(scores[t] - max_score);
      sum += scores[t];
    }
    float* oh = out + h * d;
    std::fill(oh, oh + d, 0.0f);
    for (int t = 0; t < n_positions; ++t) {
      const float p = scores[t] / sum;
      const float* v = values + static_cast<size_t>(t) * row_stride + kvh * d;
      for (int i = 0; i < d; ++i) {
        oh[i] += p * v[i];
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<Fp32KvCache>> Fp32KvCache::Create(int n_layers,
                                                                 const AttentionShape& shape,
                                                                 int capacity) {
  if (n_layers < 1 || capacity < 1 || shape.n_heads < 1 || shape.n_kv_heads < 1 ||
      shape.head_dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Fp32KvCache: n_layers ", n_layers, ", capacity ", capacity, ", n_heads ", shape.n_heads,
        ", n_kv_heads ", shape.n_kv_heads, ", head_dim ", shape.head_dim, " must all be >= 1"));
  }
  if (shape.n_heads % shape.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Fp32KvCache: n_heads ", shape.n_heads,
                                                   " is not a multiple of n_kv_heads ",
                                                   shape.n_kv_heads));
  }
  const double floats = 2.0 * n_layers * capacity * shape.n_kv_heads * shape.head_dim;
  if (floats > static_cast<double>(1ull << 34)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Fp32KvCache: ", floats, " floats requested (limit 2^34)"));
  }
  return std::unique_ptr<Fp32KvCache>(new Fp32KvCache(n_layers, shape, capacity));
}

Fp32KvCache::Fp32KvCache(int n_layers, const AttentionShape& shape, int capacity)
    : shape_(shape),
      n_layers_(n_layers),
      capacity_(capacity),
      length_(n_layers, 0),
      k_(static_cast<size_t>(n_layers) * capacity * shape.kv_dim()),
      v_(k_.size()) {}

absl::Status Fp32KvCache::CheckLayer(int layer) const {
  if (layer < 0 || layer >= n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside [0, ", n_layers_, ")"));
  }
  return absl::OkStatus();
}

absl::Status Fp32KvCache::Append(int layer, int pos, absl::Span<const float> k,
                                 absl::Span<const float> v) {
  if (auto s = CheckLayer(layer); !s.ok()) {
    return s;
  }
  const size_t kv_dim = shape_.kv_dim();
  if (k.size() != kv_dim || v.size() != kv_dim) {
    return absl::InvalidArgumentError(absl::StrCat("k/v rows have ", k.size(), "/", v.size(),
                                                   " floats, expected H_kv*d = ", kv_dim));
  }
  if (pos < 0 || pos > length_[layer]) {
    return absl::InvalidArgumentError(
        absl::StrCat("pos ", pos, " for layer ", layer, " outside [0, ", length_[layer], "]"));
  }
  if (pos >= capacity_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pos ", pos, " reaches the KV cache capacity of ", capacity_, " positions"));
  }
  const size_t off = (static_cast<size_t>(layer) * capacity_ + pos) * kv_dim;
  std::memcpy(&k_[off], k.data(), kv_dim * sizeof(float));
  std::memcpy(&v_[off], v.data(), kv_dim * sizeof(float));
  length_[layer] = pos + 1;
  return absl::OkStatus();
}

absl::Status Fp32KvCache::Attend(int layer, int pos, absl::Span<const float> q,
                                 absl::Span<float> out) {
  if (auto s = CheckLayer(layer); !s.ok()) {
    return s;
  }
  const size_t q_dim = shape_.q_dim();
  if (q.size() != q_dim || out.size() != q_dim) {
    return absl::InvalidArgumentError(absl::StrCat("q/out rows have ", q.size(), "/", out.size(),
                                                   " floats, expected H_q*d = ", q_dim));
  }
  if (pos < 0 || pos >= length_[layer]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pos ", pos, " for layer ", layer, " has no stored K/V (length ", length_[layer], ")"));
  }
  const size_t off = static_cast<size_t>(layer) * capacity_ * shape_.kv_dim();
  ReferenceAttention(shape_, pos + 1, q.data(), &k_[off], &v_[off], shape_.kv_dim(), out.data());
  return absl::OkStatus();
}

int Fp32KvCache::Length(int layer) const {
  return layer < 0 || layer >= n_layers_ ? 0 : length_[layer];
}

absl::Span<const float> Fp32KvCache::Keys(int layer) const {
  if (layer < 0 || layer >= n_layers_) {
    return {};
  }
  return absl::Span<const float>(k_).subspan(
      static_cast<size_t>(layer) * capacity_ * shape_.kv_dim(),
      static_cast<size_t>(length_[layer]) * shape_.kv_dim());
}

absl::Span<const float> Fp32KvCache::Values(int layer) const {
  if (layer < 0 || layer >= n_layers_) {
    return {};
  }
  return absl::Span<const float>(v_).subspan(
      static_cast<size_t>(layer) * capacity_ * shape_.kv_dim(),
      static_cast<size_t>(length_[layer]) * shape_.kv_dim());
}

void Fp32KvCache::Clear() { std::fill(length_.begin(), length_.end(), 0); }

}  // namespace kvpool::engine
