// OSCAR calibration statistics and rotation fitting (see kvpool/kernels/calibration.h).
#include "kvpool/kernels/calibration.h"

#include <algorithm>
#include <cmath>

#include <Eigen/Dense>

#include "absl/strings/str_cat.h"
#include "kvpool/kernels/quantize.h"

namespace kvpool {
namespace {

absl::Status CheckFinite(const float* x, uint64_t n, uint32_t heads, uint32_t d, uint32_t layer,
                         const char* what) {
  for (uint64_t i = 0; i < n * heads * d; ++i) {
    if (!std::isfinite(x[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " of layer ", layer, " token ", i / (uint64_t{heads} * d), " head ",
                       (i / d) % heads, " element ", i % d, " is not finite"));
    }
  }
  return absl::OkStatus();
}

// acc += w · x xᵀ (upper triangle only; mirrored when read).
inline void AddOuter(double* acc, const float* x, uint32_t d, double w) {
  double xd[kMaxHeadDim];
  for (uint32_t i = 0; i < d; ++i) xd[i] = x[i];
  for (uint32_t i = 0; i < d; ++i) {
    const double a = w * xd[i];
    double* row = acc + static_cast<size_t>(i) * d;
    for (uint32_t j = i; j < d; ++j) row[j] += a * xd[j];
  }
}

// Full symmetric matrix from the upper triangle.
std::vector<double> Mirror(const double* upper, uint32_t d, double scale) {
  std::vector<double> m(static_cast<size_t>(d) * d);
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = i; j < d; ++j) m[i * d + j] = m[j * d + i] = upper[i * d + j] * scale;
  return m;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CalibrationAccumulator>> CalibrationAccumulator::Create(
    uint32_t num_layers, uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim) {
  if (num_layers == 0) return absl::InvalidArgumentError("num_layers must be > 0");
  if (num_kv_heads == 0) return absl::InvalidArgumentError("num_kv_heads must be > 0");
  if (num_q_heads == 0 || num_q_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_q_heads (", num_q_heads,
                                                   ") must be a positive multiple of "
                                                   "num_kv_heads (",
                                                   num_kv_heads, ")"));
  }
  if (auto s = ValidateHeadDim(head_dim); !s.ok()) return s;
  auto a = std::unique_ptr<CalibrationAccumulator>(new CalibrationAccumulator());
  a->num_layers_ = num_layers;
  a->num_q_heads_ = num_q_heads;
  a->num_kv_heads_ = num_kv_heads;
  a->head_dim_ = head_dim;
  const size_t mats = static_cast<size_t>(num_layers) * num_kv_heads * head_dim * head_dim;
  a->sum_qq_.assign(mats, 0.0);
  a->sum_wvv_.assign(mats, 0.0);
  a->sum_w_.assign(static_cast<size_t>(num_layers) * num_kv_heads, 0.0);
  a->q_tokens_.assign(num_layers, 0);
  a->kv_tokens_.assign(num_layers, 0);
  return a;
}

std::unique_ptr<CalibrationAccumulator> CalibrationAccumulator::Clone() const {
  return std::unique_ptr<CalibrationAccumulator>(new CalibrationAccumulator(*this));
}

absl::Status CalibrationAccumulator::AddQueries(uint32_t layer, const float* q, uint64_t n) {
  if (frozen_) {
    return absl::FailedPreconditionError("AddQueries after FreezeKeyTargets (phase 1 is over)");
  }
  if (layer >= num_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range (num_layers ", num_layers_, ")"));
  }
  if (auto s = CheckFinite(q, n, num_q_heads_, head_dim_, layer, "query"); !s.ok()) return s;
  const uint32_t g = num_q_heads_ / num_kv_heads_;
  const uint32_t d = head_dim_;
  for (uint64_t t = 0; t < n; ++t) {
    for (uint32_t i = 0; i < num_q_heads_; ++i) {
      AddOuter(sum_qq_.data() + MatIndex(layer, i / g), q + (t * num_q_heads_ + i) * d, d, 1.0);
    }
  }
  q_tokens_[layer] += n;
  return absl::OkStatus();
}

absl::Status CalibrationAccumulator::FreezeKeyTargets() {
  if (frozen_) return absl::OkStatus();
  for (uint32_t l = 0; l < num_layers_; ++l) {
    if (q_tokens_[l] == 0) {
      return absl::FailedPreconditionError(absl::StrCat("layer ", l, " has seen no query"));
    }
  }
  cq_.resize(sum_qq_.size());
  for (uint32_t l = 0; l < num_layers_; ++l) {
    for (uint32_t h = 0; h < num_kv_heads_; ++h) {
      auto m = KeyTarget(l, h);
      std::copy(m.begin(), m.end(), cq_.begin() + MatIndex(l, h));
    }
  }
  frozen_ = true;
  return absl::OkStatus();
}

absl::Status CalibrationAccumulator::AddKeysValues(uint32_t layer, const float* k, const float* v,
                                                   uint64_t n) {
  if (!frozen_) {
    return absl::FailedPreconditionError(
        "AddKeysValues needs the key targets: call FreezeKeyTargets after phase 1");
  }
  if (layer >= num_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range (num_layers ", num_layers_, ")"));
  }
  if (auto s = CheckFinite(k, n, num_kv_heads_, head_dim_, layer, "key"); !s.ok()) return s;
  if (auto s = CheckFinite(v, n, num_kv_heads_, head_dim_, layer, "value"); !s.ok()) return s;
  const uint32_t d = head_dim_;
  for (uint64_t t = 0; t < n; ++t) {
    for (uint32_t h = 0; h < num_kv_heads_; ++h) {
      const float* kt = k + (t * num_kv_heads_ + h) * d;
      const double* c = cq_.data() + MatIndex(layer, h);
      double w = 0;
      for (uint32_t i = 0; i < d; ++i) {
        double row = 0;
        for (uint32_t j = 0; j < d; ++j) row += c[i * d + j] * kt[j];
        w += kt[i] * row;
      }
      if (w < 0) w = 0;  // C_Q is PSD; guard rounding
      AddOuter(sum_wvv_.data() + MatIndex(layer, h), v + (t * num_kv_heads_ + h) * d, d, w);
      sum_w_[static_cast<size_t>(layer) * num_kv_heads_ + h] += w;
    }
  }
  kv_tokens_[layer] += n;
  return absl::OkStatus();
}

absl::Status CalibrationAccumulator::Merge(const CalibrationAccumulator& o) {
  if (o.num_layers_ != num_layers_ || o.num_q_heads_ != num_q_heads_ ||
      o.num_kv_heads_ != num_kv_heads_ || o.head_dim_ != head_dim_) {
    return absl::FailedPreconditionError("Merge: accumulators have different shapes");
  }
  if (o.frozen_ != frozen_) {
    return absl::FailedPreconditionError("Merge: accumulators are in different phases");
  }
  if (frozen_) {
    if (o.sum_qq_ != sum_qq_ || o.q_tokens_ != q_tokens_) {
      return absl::FailedPreconditionError(
          "Merge: phase-2 accumulators must share the same frozen key statistics");
    }
    for (size_t i = 0; i < sum_wvv_.size(); ++i) sum_wvv_[i] += o.sum_wvv_[i];
    for (size_t i = 0; i < sum_w_.size(); ++i) sum_w_[i] += o.sum_w_[i];
    for (uint32_t l = 0; l < num_layers_; ++l) kv_tokens_[l] += o.kv_tokens_[l];
    return absl::OkStatus();
  }
  for (size_t i = 0; i < sum_qq_.size(); ++i) sum_qq_[i] += o.sum_qq_[i];
  for (uint32_t l = 0; l < num_layers_; ++l) q_tokens_[l] += o.q_tokens_[l];
  return absl::OkStatus();
}

std::vector<double> CalibrationAccumulator::KeyTarget(uint32_t layer, uint32_t head) const {
  const uint32_t g = num_q_heads_ / num_kv_heads_;
  const double n = static_cast<double>(q_tokens_[layer]) * g;
  return Mirror(sum_qq_.data() + MatIndex(layer, head), head_dim_, n > 0 ? 1.0 / n : 0.0);
}

std::vector<double> CalibrationAccumulator::ValueTarget(uint32_t layer, uint32_t head) const {
  const double w = std::max(sum_w_[static_cast<size_t>(layer) * num_kv_heads_ + head], 1e-12);
  return Mirror(sum_wvv_.data() + MatIndex(layer, head), head_dim_, 1.0 / w);
}

namespace {
std::vector<double> MeanSym(const CalibrationAccumulator& a, uint32_t layer, bool key) {
  const uint32_t d = a.head_dim();
  std::vector<double> m(static_cast<size_t>(d) * d, 0.0);
  for (uint32_t h = 0; h < a.num_kv_heads(); ++h) {
    auto t = key ? a.KeyTarget(layer, h) : a.ValueTarget(layer, h);
    for (size_t i = 0; i < m.size(); ++i) m[i] += t[i] / a.num_kv_heads();
  }
  std::vector<double> s(m.size());
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j) s[i * d + j] = 0.5 * (m[i * d + j] + m[j * d + i]);
  return s;
}
}  // namespace

std::vector<double> CalibrationAccumulator::LayerKeyTarget(uint32_t layer) const {
  return MeanSym(*this, layer, true);
}
std::vector<double> CalibrationAccumulator::LayerValueTarget(uint32_t layer) const {
  return MeanSym(*this, layer, false);
}

absl::StatusOr<FittedRotation> FitRotation(const std::vector<double>& target, uint32_t d) {
  if (auto s = ValidateHeadDim(d); !s.ok()) return s;
  if (target.size() != static_cast<size_t>(d) * d) {
    return absl::InvalidArgumentError(
        absl::StrCat("target has ", target.size(), " entries, expected d*d = ", d * d));
  }
  Eigen::MatrixXd c(d, d);
  for (uint32_t i = 0; i < d; ++i) {
    for (uint32_t j = 0; j < d; ++j) {
      const double v = 0.5 * (target[i * d + j] + target[j * d + i]);
      if (!std::isfinite(v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("target element (", i, ", ", j, ") is not finite"));
      }
      c(i, j) = v;
    }
  }
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(c);
  if (solver.info() != Eigen::Success) {
    return absl::InternalError("symmetric eigen-decomposition did not converge");
  }
  Eigen::MatrixXd u = solver.eigenvectors();  // columns, eigenvalues ascending
  const Eigen::VectorXd lambda = solver.eigenvalues();
  // Sign rule: largest-magnitude component positive (first index on ties).
  for (uint32_t col = 0; col < d; ++col) {
    uint32_t best = 0;
    for (uint32_t i = 1; i < d; ++i)
      if (std::fabs(u(i, col)) > std::fabs(u(best, col))) best = i;
    if (u(best, col) < 0) u.col(col) *= -1.0;
  }
  const std::vector<double> hv = HadamardMatrix(d);
  Eigen::MatrixXd h(d, d);
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j) h(i, j) = hv[i * d + j];
  std::vector<double> ev(d);
  for (uint32_t i = 0; i < d; ++i) ev[i] = lambda(i);
  const std::vector<uint32_t> perm = BitReversalPermutation(ev);
  const Eigen::MatrixXd uh = u * h;
  FittedRotation out;
  out.rotation.resize(static_cast<size_t>(d) * d);
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j)
      out.rotation[i * d + j] = static_cast<float>(uh(i, perm[j]));  // (U·H·P_br)[i][j]
  out.eigenvalues.resize(d);
  for (uint32_t i = 0; i < d; ++i) out.eigenvalues[i] = static_cast<float>(lambda(i));
  double worst = 0;
  for (uint32_t i = 0; i < d; ++i) {
    for (uint32_t j = 0; j < d; ++j) {
      double s = 0;
      for (uint32_t k = 0; k < d; ++k)
        s += static_cast<double>(out.rotation[i * d + k]) * out.rotation[j * d + k];
      worst = std::max(worst, std::fabs(s - (i == j ? 1.0 : 0.0)));
    }
  }
  out.orthogonality_error = worst;
  return out;
}

absl::StatusOr<RotationSet> FitOscarRotations(const CalibrationAccumulator& acc,
                                              const FitOptions& options) {
  if (!acc.frozen()) {
    return absl::FailedPreconditionError("FitOscarRotations: key targets are not frozen");
  }
  for (uint32_t l = 0; l < acc.num_layers(); ++l) {
    if (acc.value_tokens(l) == 0) {
      return absl::FailedPreconditionError(absl::StrCat("layer ", l, " has no key/value tokens"));
    }
  }
  const uint32_t d = acc.head_dim();
  const uint32_t hr = options.per_head ? acc.num_kv_heads() : 1;
  std::vector<float> k, v, ke, ve;
  for (uint32_t l = 0; l < acc.num_layers(); ++l) {
    for (uint32_t h = 0; h < hr; ++h) {
      for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
        std::vector<double> target;
        if (options.per_head) {
          target = kind == KvKind::kKey ? acc.KeyTarget(l, h) : acc.ValueTarget(l, h);
        } else {
          target = kind == KvKind::kKey ? acc.LayerKeyTarget(l) : acc.LayerValueTarget(l);
        }
        auto fit = FitRotation(target, d);
        if (!fit.ok()) {
          return absl::Status(fit.status().code(),
                              absl::StrCat("layer ", l, " head ", h, " ", KvKindName(kind), ": ",
                                           fit.status().message()));
        }
        auto& m = kind == KvKind::kKey ? k : v;
        auto& e = kind == KvKind::kKey ? ke : ve;
        m.insert(m.end(), fit->rotation.begin(), fit->rotation.end());
        e.insert(e.end(), fit->eigenvalues.begin(), fit->eigenvalues.end());
      }
    }
  }
  RotationMetadata meta;
  meta.format_version = options.per_head ? 2 : 1;
  meta.objective = "oscar";
  meta.composition = "U*H*P_br";
  meta.model_name = options.model_name;
  meta.head_dim = d;
  meta.num_layers = acc.num_layers();
  meta.num_kv_heads = acc.num_kv_heads();
  meta.clip_ratio_k = options.clip_ratio_k;
  meta.clip_ratio_v = options.clip_ratio_v;
  meta.source_hash = options.source_hash;
  return RotationSet::FromMatrices(std::move(meta), std::move(k), std::move(v), std::move(ke),
                                   std::move(ve));
}

}  // namespace kvpool
