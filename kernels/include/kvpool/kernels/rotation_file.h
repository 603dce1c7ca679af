// kvpool/kernels/rotation_file.h — rotation files (safetensors, FORMAT.md §4).
//
// Tensors (all F32, little-endian):
//   layers.{i}.k.rotation     [d, d] (format_version 1) or [H_kv, d, d] (format_version 2)
//   layers.{i}.v.rotation     same
//   layers.{i}.k.eigenvalues  [d] or [H_kv, d]   (optional: present for all or for none)
//   layers.{i}.v.eigenvalues  same
// `__metadata__` (all strings): format = "kvpool-rotations", format_version ("1" | "2"),
// objective, composition, model_name, head_dim, num_layers, num_kv_heads, clip_ratio_k,
// clip_ratio_v (shortest round-trip decimal of the fp32 value), source_hash.
//
// The rotation id — part of every block key (docs/KEYS.md) — is the SHA-256 of the file bytes.
// Serialization is deterministic (same RotationSet -> same bytes -> same id).
//
//   KVPOOL_ASSIGN_OR_RETURN(RotationSet rot, ReadRotationFile(path));
//   KVPOOL_RETURN_IF_ERROR(CheckRotationsMatch(rot, {.model_name = "m", .head_dim = 128,
//                                                    .num_layers = 36, .num_kv_heads = 8}));
//   Digest id = rot.rotation_id();   // via RotationIdFromHex
//
// Thread-safety: free functions, reentrant.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/kernels/rotation.h"

namespace kvpool {

inline constexpr char kRotationFileFormat[] = "kvpool-rotations";

// The file bytes of `rot`. Sets nothing; see WriteRotationFile for the id.
std::string SerializeRotations(const RotationSet& rot);

// Writes the file atomically, through a symbolic link (kvpool::WriteFileAtomically,
// kvpool/common/atomic_file.h), and records its id in `*rot` (rotation_id_hex); `*rot` is
// unchanged on failure. INTERNAL on I/O errors, naming the path.
absl::Status WriteRotationFile(RotationSet* rot, const std::string& path);

// Largest accepted max |R Rᵀ − I| (fp64 arithmetic over the stored fp32 matrix). A float32-saved
// orthogonal matrix measures ≈ 1e-7 (FORMAT.md §4); 1e-4 leaves room for d = 1024 rounding while
// refusing any matrix that is not a rotation.
inline constexpr double kRotationOrthogonalityTolerance = 1e-4;

// Most negative accepted eigenvalue, as a fraction of the largest of its [d] slice. The targets
// C_Q / C_S are positive semi-definite (FORMAT.md §1), so a negative eigenvalue is rounding only:
// an fp32 symmetric eigensolver errs by about d · 2^-24 · λ_max (≤ 1e-4 · λ_max for d ≤ 1024).
inline constexpr float kRotationEigenvalueTolerance = 1e-4f;

// INVALID_ARGUMENT unless every element of the eigenvalue tensor `name` (`data`, [H, d] or [d]
// flattened) is finite and ≥ −kRotationEigenvalueTolerance × the largest of its [d] slice;
// the message names the tensor, the element and its value (newcomer report 11 F4: −5 was
// accepted).
absl::Status CheckEigenvalues(const std::string& name, const std::vector<float>& data, uint64_t d);

// Parses and validates file bytes: safetensors validity (common/safetensors.h: no byte outside
// the tensors), metadata fields present and well-formed, every expected tensor present with the
// exact dtype/shape, finite values, eigenvalues not negative (CheckEigenvalues), every rotation
// matrix orthogonal within kRotationOrthogonalityTolerance. Shared by the pool (RegisterModel),
// kvpool-worker and the kvpool CLI (rotations inspect, evaluate, quantize).
// INVALID_ARGUMENT naming the field/tensor (and the measured orthogonality error, e.g.
// "tensor 'layers.0.k.rotation' is not orthogonal: max |R Rt - I| = 4.880e+01 > tolerance
// 0.0001"); DATA_LOSS for truncated files.
// The returned set carries rotation_id_hex = SHA-256(bytes).
absl::StatusOr<RotationSet> ParseRotations(const std::string& bytes);
// Reads `path` and parses it. NOT_FOUND "cannot open rotation file 'P'" when it cannot be opened,
// plus RelativePathNote(P) (" (relative to the current directory DIR)") for a relative path.
absl::StatusOr<RotationSet> ReadRotationFile(const std::string& path);

// Lower-case hex SHA-256 of `bytes`.
std::string Sha256Hex(const std::string& bytes);
// 32 raw bytes from a 64-character hex id; INVALID_ARGUMENT otherwise.
absl::StatusOr<std::array<uint8_t, 32>> RotationIdFromHex(const std::string& hex);

// What the registered model expects of a rotation file.
struct ExpectedRotationModel {
  std::string model_name;  // empty: not checked
  uint32_t head_dim = 0;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  std::optional<float> clip_ratio_k;  // checked when set
  std::optional<float> clip_ratio_v;
};

// OK when every field matches; otherwise FAILED_PRECONDITION listing every mismatching field
// ("rotation file does not match the model: head_dim 64 != 128; num_layers 4 != 36").
absl::Status CheckRotationsMatch(const RotationSet& rot, const ExpectedRotationModel& expected);

// The rotation file's model_name is advisory: a name identifies no weights, an operator may
// rename a model file, and the pool registers a model under an id of its own choosing
// (--model-id), so a differing name is warned about, never refused (the geometry and the clip
// ratios are what CheckRotationsMatch refuses). Returns "" when `rot`'s model_name equals
// `model_name` (for a loaded GGUF: its file name without the extension, what `kvpool calibrate`
// records) or the file records none; otherwise one line for a warning naming both, e.g.
// "the rotation file was calibrated for model 'a', not 'b' (the model file's name): only its
// geometry (head_dim 8, 5 layers, 4 KV heads) is checked; ..." (newcomer
// report 11 F2: a file calibrated for another model of the same geometry was used silently).
std::string RotationModelNameMismatch(const RotationSet& rot, const std::string& model_name);

}  // namespace kvpool
