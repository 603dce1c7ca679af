// RotationSet and the Hadamard / bit-reversal helpers (see kvpool/kernels/rotation.h).
#include "kvpool/kernels/rotation.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kvpool/kernels/quantize.h"

namespace kvpool {

const char* KvKindName(KvKind kind) { return kind == KvKind::kKey ? "k" : "v"; }

absl::StatusOr<RotationSet> RotationSet::FromMatrices(RotationMetadata meta, std::vector<float> k,
                                                      std::vector<float> v,
                                                      std::vector<float> k_eigenvalues,
                                                      std::vector<float> v_eigenvalues) {
  if (auto s = ValidateHeadDim(meta.head_dim); !s.ok()) return s;
  if (meta.num_layers == 0) return absl::InvalidArgumentError("num_layers must be > 0");
  if (meta.num_kv_heads == 0) return absl::InvalidArgumentError("num_kv_heads must be > 0");
  if (meta.format_version != 1 && meta.format_version != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("format_version must be 1 or 2, got ", meta.format_version));
  }
  if (auto s = ValidateClipRatio(meta.clip_ratio_k, "clip_ratio_k"); !s.ok()) return s;
  if (auto s = ValidateClipRatio(meta.clip_ratio_v, "clip_ratio_v"); !s.ok()) return s;
  const uint64_t hr = meta.format_version == 2 ? meta.num_kv_heads : 1;
  const uint64_t d = meta.head_dim;
  const uint64_t want = meta.num_layers * hr * d * d;
  for (auto [name, vec] : {std::pair<const char*, const std::vector<float>*>{"k rotations", &k},
                           {"v rotations", &v}}) {
    if (vec->size() != want) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " hold ", vec->size(), " floats, expected ", want));
    }
    for (size_t i = 0; i < vec->size(); ++i) {
      if (!std::isfinite((*vec)[i])) {
        return absl::InvalidArgumentError(absl::StrCat(name, " element ", i, " is not finite"));
      }
    }
  }
  const uint64_t want_eig = meta.num_layers * hr * d;
  if (k_eigenvalues.size() != v_eigenvalues.size() ||
      (!k_eigenvalues.empty() && k_eigenvalues.size() != want_eig)) {
    return absl::InvalidArgumentError(absl::StrCat("eigenvalues hold ", k_eigenvalues.size(), "/",
                                                   v_eigenvalues.size(), " floats, expected ",
                                                   want_eig, " each (or none)"));
  }
  RotationSet r;
  r.meta_ = std::move(meta);
  r.k_ = std::move(k);
  r.v_ = std::move(v);
  r.k_eig_ = std::move(k_eigenvalues);
  r.v_eig_ = std::move(v_eigenvalues);
  return r;
}

absl::StatusOr<RotationSet> RotationSet::Identity(RotationMetadata meta) {
  if (auto s = ValidateHeadDim(meta.head_dim); !s.ok()) return s;
  meta.format_version = 1;
  meta.objective = "identity";
  meta.composition = "I";
  const uint32_t d = meta.head_dim;
  std::vector<float> m(static_cast<size_t>(meta.num_layers) * d * d, 0.0f);
  for (uint32_t l = 0; l < meta.num_layers; ++l)
    for (uint32_t i = 0; i < d; ++i) m[(static_cast<size_t>(l) * d + i) * d + i] = 1.0f;
  return FromMatrices(std::move(meta), m, m);
}

absl::StatusOr<RotationSet> RotationSet::Hadamard(RotationMetadata meta) {
  if (auto s = ValidateHeadDim(meta.head_dim); !s.ok()) return s;
  meta.format_version = 1;
  meta.objective = "hadamard";
  meta.composition = "H";
  const uint32_t d = meta.head_dim;
  const std::vector<double> h = HadamardMatrix(d);
  std::vector<float> m;
  m.reserve(static_cast<size_t>(meta.num_layers) * d * d);
  for (uint32_t l = 0; l < meta.num_layers; ++l)
    for (double x : h) m.push_back(static_cast<float>(x));
  return FromMatrices(std::move(meta), m, m);
}

const float* RotationSet::Matrix(KvKind kind, uint32_t layer, uint32_t head) const {
  const uint64_t d = meta_.head_dim;
  const uint64_t idx = static_cast<uint64_t>(layer) * heads_per_layer() + (per_head() ? head : 0);
  return (kind == KvKind::kKey ? k_ : v_).data() + idx * d * d;
}

const float* RotationSet::Eigenvalues(KvKind kind, uint32_t layer, uint32_t head) const {
  const auto& e = kind == KvKind::kKey ? k_eig_ : v_eig_;
  if (e.empty()) return nullptr;
  const uint64_t idx = static_cast<uint64_t>(layer) * heads_per_layer() + (per_head() ? head : 0);
  return e.data() + idx * meta_.head_dim;
}

double RotationSet::OrthogonalityError(KvKind kind, uint32_t layer, uint32_t head) const {
  const uint32_t d = meta_.head_dim;
  const float* r = Matrix(kind, layer, head);
  double worst = 0;
  for (uint32_t i = 0; i < d; ++i) {
    for (uint32_t j = 0; j < d; ++j) {
      double s = 0;
      for (uint32_t k = 0; k < d; ++k) s += static_cast<double>(r[i * d + k]) * r[j * d + k];
      worst = std::max(worst, std::fabs(s - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

double RotationSet::MaxOrthogonalityError() const {
  double worst = 0;
  for (uint32_t l = 0; l < meta_.num_layers; ++l)
    for (uint32_t h = 0; h < heads_per_layer(); ++h)
      for (KvKind kind : {KvKind::kKey, KvKind::kValue})
        worst = std::max(worst, OrthogonalityError(kind, l, h));
  return worst;
}

std::vector<double> HadamardMatrix(uint32_t d) {
  std::vector<double> h(static_cast<size_t>(d) * d);
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j) h[i * d + j] = (__builtin_popcount(i & j) & 1) ? -s : s;
  return h;
}

uint32_t BitReverse(uint32_t i, uint32_t d) {
  uint32_t bits = 0;
  while ((1u << bits) < d) ++bits;
  uint32_t r = 0;
  for (uint32_t b = 0; b < bits; ++b)
    if (i & (1u << b)) r |= 1u << (bits - 1 - b);
  return r;
}

std::vector<uint32_t> BitReversalPermutation(const std::vector<double>& eigenvalues) {
  const uint32_t d = static_cast<uint32_t>(eigenvalues.size());
  std::vector<uint32_t> s(d);
  std::iota(s.begin(), s.end(), 0u);
  std::stable_sort(s.begin(), s.end(),
                   [&](uint32_t a, uint32_t b) { return eigenvalues[a] > eigenvalues[b]; });
  std::vector<uint32_t> perm(d);
  for (uint32_t i = 0; i < d; ++i) perm[BitReverse(i, d)] = s[i];
  return perm;
}

}  // namespace kvpool
