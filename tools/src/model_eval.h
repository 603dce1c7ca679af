// tools/src/model_eval.h — OSCAR calibration and evaluation on a real model through the
// reference engine (worker/engine): the library behind `kvpool calibrate` and
// `kvpool evaluate`.
//
// Text handling: the text is tokenized without BOS, cut into sequences of at most
// context_length − 1 tokens, each run from position 0 with BOS prepended; the engine's
// activation observer records post-RoPE Q/K/V of every position (FORMAT.md §1 inputs).
//
// Evaluation (per layer, and summed over layers), for a rotation set R (K and V), with every
// key and value of the text quantized to INT2 (rotate, clip, quantize, dequantize, rotate
// back — no BF16 sink/recent windows, i.e. the all-history worst case):
//   logit error  = sqrt( Σ (q_t·k_s − q_t·k̂_s)² / Σ (q_t·k_s)² ) over causal pairs s ≤ t and
//                  every query head (GQA: query head i reads KV head ⌊i/g⌋)
//   output error = sqrt( Σ ‖o_t − ô_t‖² / Σ ‖o_t‖² ), o_t = softmax(q_t Kᵀ/√d)·V (causal),
//                  ô_t the same with K̂, V̂
//
// Thread-safety: functions are reentrant (each builds its own engine).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvpool/kernels/rotation.h"

namespace kvpool::tools {

struct CalibrateOptions {
  std::string model_path;  // GGUF
  std::string text_path;   // calibration text (UTF-8)
  int64_t max_tokens = 0;  // use at most this many text tokens (0 = all)
  bool per_head = false;   // format_version 2
  float clip_ratio_k = 0.96f;
  float clip_ratio_v = 0.92f;
  // Progress callback (tokens done, tokens total); may be empty.
  std::function<void(int64_t, int64_t)> progress;
};

// Runs the model over the text, accumulates C_Q / C_S (two passes over the recorded
// activations) and fits the rotations. model_name = the GGUF file's stem; source_hash =
// SHA-256 of the text file bytes. Errors: NOT_FOUND for missing files, INVALID_ARGUMENT for an
// empty text, engine errors.
absl::StatusOr<RotationSet> CalibrateModel(const CalibrateOptions& options);

struct LayerError {
  double logit_num = 0, logit_den = 0;  // Σ squared error, Σ squared exact
  double output_num = 0, output_den = 0;
  double logit() const;  // sqrt(num/den)
  double output() const;
};

struct EvalResult {
  std::string name;                // "none", "hadamard", "oscar"
  std::vector<LayerError> layers;  // per layer
  LayerError total;                // sums over layers
};

struct EvaluateOptions {
  std::string model_path;
  std::string text_path;
  int64_t max_tokens = 0;
  float clip_ratio_k = 0.96f;
  float clip_ratio_v = 0.92f;
  // Progress callback (tokens done, tokens total), as for CalibrateOptions; may be empty.
  std::function<void(int64_t, int64_t)> progress;
};

// Evaluates each of `rotations` (name, set) on the text. FAILED_PRECONDITION when a set does
// not match the model's geometry (CheckRotationsMatch).
absl::StatusOr<std::vector<EvalResult>> EvaluateModel(
    const EvaluateOptions& options,
    const std::vector<std::pair<std::string, const RotationSet*>>& rotations);

// Model geometry for building comparison rotation sets: {head_dim, num_layers, num_kv_heads}
// and the model name (file stem).
absl::StatusOr<RotationMetadata> ModelRotationMetadata(const std::string& model_path);

}  // namespace kvpool::tools
