// kvpool/kernels/calibration.h — OSCAR calibration statistics and rotation fitting
// (FORMAT.md §1).
//
// Targets, all float64 and uncentered, from post-RoPE Q [n, H_q, d], K and V [n, H_kv, d]:
//   key target   C_Q,h = Σ q qᵀ / (n·g) over the g = H_q/H_kv query heads of KV head h
//                (query head i belongs to KV head ⌊i/g⌋)
//   value target C_S,h = Σ_t w_t v_t v_tᵀ / max(Σ_t w_t, 1e-12), w_t = k_t · C_Q,h · k_tᵀ
//   per layer:   C = mean over h of the per-head targets, symmetrized (C + Cᵀ)/2
// The value weighting needs the final C_Q, so calibration has two phases over the same data:
//   phase 1: AddQueries(...) for every chunk; then FreezeKeyTargets();
//   phase 2: AddKeysValues(...) for every chunk (weights use the frozen C_Q,h).
// Accumulators are sums, so Merge() of two accumulators equals one accumulator fed both
// inputs (split calibration over processes: merge phase-1 states, copy the merged state to
// every process, run phase 2, merge again).
//
// Fitting: eigen-decomposition in float64 (Eigen's SelfAdjointEigenSolver), each eigenvector
// signed so its largest-magnitude component is positive (first such index on ties), then
// R = U·H·P_br (HadamardMatrix, BitReversalPermutation of rotation.h), stored as fp32.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto acc, CalibrationAccumulator::Create(L, Hq, Hkv, d));
//   for (chunk) KVPOOL_RETURN_IF_ERROR(acc->AddQueries(layer, q, n));
//   KVPOOL_RETURN_IF_ERROR(acc->FreezeKeyTargets());
//   for (chunk) KVPOOL_RETURN_IF_ERROR(acc->AddKeysValues(layer, k, v, n));
//   KVPOOL_ASSIGN_OR_RETURN(RotationSet rot, FitOscarRotations(*acc, options));
//
// Thread-safety: an accumulator is not thread-safe (one writer); const methods are.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/kernels/rotation.h"

namespace kvpool {

class CalibrationAccumulator {
 public:
  // INVALID_ARGUMENT (naming the field) unless counts > 0, num_q_heads a multiple of
  // num_kv_heads, head_dim a power of two in [8, kMaxHeadDim].
  static absl::StatusOr<std::unique_ptr<CalibrationAccumulator>> Create(uint32_t num_layers,
                                                                        uint32_t num_q_heads,
                                                                        uint32_t num_kv_heads,
                                                                        uint32_t head_dim);
  std::unique_ptr<CalibrationAccumulator> Clone() const;

  // Phase 1. q: [n][H_q][d] fp32 post-RoPE queries of `layer` (n tokens).
  // INVALID_ARGUMENT for a bad layer or non-finite value (naming token/head/element);
  // FAILED_PRECONDITION after FreezeKeyTargets().
  absl::Status AddQueries(uint32_t layer, const float* q, uint64_t n);
  // Ends phase 1. FAILED_PRECONDITION if some layer has seen no query.
  absl::Status FreezeKeyTargets();
  bool frozen() const { return frozen_; }
  // Phase 2. k, v: [n][H_kv][d] fp32. FAILED_PRECONDITION before FreezeKeyTargets().
  absl::Status AddKeysValues(uint32_t layer, const float* k, const float* v, uint64_t n);

  // Adds `other`'s sums. FAILED_PRECONDITION for different shapes, or if the two are in
  // different phases, or (both frozen) their key statistics differ.
  absl::Status Merge(const CalibrationAccumulator& other);

  uint32_t num_layers() const { return num_layers_; }
  uint32_t num_q_heads() const { return num_q_heads_; }
  uint32_t num_kv_heads() const { return num_kv_heads_; }
  uint32_t head_dim() const { return head_dim_; }
  uint64_t query_tokens(uint32_t layer) const { return q_tokens_[layer]; }
  uint64_t value_tokens(uint32_t layer) const { return kv_tokens_[layer]; }

  // Targets as row-major d×d fp64 (not symmetrized). Zero matrices when no data.
  std::vector<double> KeyTarget(uint32_t layer, uint32_t head) const;    // C_Q,h
  std::vector<double> ValueTarget(uint32_t layer, uint32_t head) const;  // C_S,h
  // Layer targets: mean over heads, symmetrized.
  std::vector<double> LayerKeyTarget(uint32_t layer) const;
  std::vector<double> LayerValueTarget(uint32_t layer) const;

 private:
  CalibrationAccumulator() = default;
  size_t MatIndex(uint32_t layer, uint32_t head) const {
    return (static_cast<size_t>(layer) * num_kv_heads_ + head) * head_dim_ * head_dim_;
  }
  uint32_t num_layers_ = 0, num_q_heads_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  bool frozen_ = false;
  std::vector<double> sum_qq_;   // [L][Hkv][d][d]  Σ q qᵀ over the group's query rows
  std::vector<double> sum_wvv_;  // [L][Hkv][d][d] Σ w v vᵀ
  std::vector<double> sum_w_;    // [L][Hkv]
  std::vector<double> cq_;       // frozen C_Q,h  [L][Hkv][d][d]
  std::vector<uint64_t> q_tokens_, kv_tokens_;  // [L]
};

// One fitted rotation.
struct FittedRotation {
  std::vector<float> rotation;     // [d][d] fp32, R = U·H·P_br
  std::vector<float> eigenvalues;  // [d] ascending
  double orthogonality_error = 0;  // max |R Rᵀ − I| of the fp32 matrix (fp64 arithmetic)
};

// Fits R from a symmetric target (row-major d×d fp64; symmetrized again here).
// INVALID_ARGUMENT for a bad d or non-finite target.
absl::StatusOr<FittedRotation> FitRotation(const std::vector<double>& target, uint32_t d);

struct FitOptions {
  bool per_head = false;  // format_version 2: one R per (layer, KV head), per-head targets
  std::string model_name;
  float clip_ratio_k = 0.96f;
  float clip_ratio_v = 0.92f;
  std::string source_hash;  // provenance recorded in the metadata
};

// Fits every layer's (or head's) K and V rotation from a frozen accumulator with phase-2
// data. FAILED_PRECONDITION when not frozen or a layer has no key/value tokens.
absl::StatusOr<RotationSet> FitOscarRotations(const CalibrationAccumulator& acc,
                                              const FitOptions& options);

}  // namespace kvpool
