// kvpool/kernels/rotation.h — a model's set of OSCAR rotations (one per layer, or one per
// (layer, KV head)) for keys and values, plus the Hadamard / bit-reversal building blocks.
//
// Vectors are rows and rotations multiply on the right: k̃ = k·R_K, ṽ = v·R_V (FORMAT.md §1).
// Matrices are row-major fp32 [d][d] (element (i, j) at i·d + j).
//
//   KVPOOL_ASSIGN_OR_RETURN(RotationSet rot, RotationSet::Hadamard(meta));
//   const float* rk = rot.Matrix(KvKind::kKey, layer, head);   // d·d floats
//
// Thread-safety: a RotationSet is an immutable value after construction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvpool {

enum class KvKind { kKey = 0, kValue = 1 };

// "k" / "v" as used in tensor names.
const char* KvKindName(KvKind kind);

// Metadata of a rotation set; the fields of the rotation file's `__metadata__` (FORMAT.md §4).
struct RotationMetadata {
  uint32_t format_version = 1;           // 1: one R per layer; 2: one R per (layer, KV head)
  std::string objective = "oscar";       // "oscar" | "hadamard" | "identity" | imported name
  std::string composition = "U*H*P_br";  // how R was built (FORMAT.md §1)
  std::string model_name;                // e.g. "stories260K"
  uint32_t head_dim = 0;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  float clip_ratio_k = 0.96f;  // FORMAT.md §2.2
  float clip_ratio_v = 0.92f;
  std::string source_hash;  // provenance (e.g. SHA-256 of the calibration text / .pt file)
};

// Owning set of rotations and (optionally) their eigenvalues.
class RotationSet {
 public:
  // Builds from matrices: `k`, `v` hold [L][Hr][d][d] floats, Hr = 1 (format_version 1) or
  // num_kv_heads (format_version 2); eigenvalues (may be empty) [L][Hr][d]. INVALID_ARGUMENT
  // (naming the field) for a bad head_dim / count / version or wrong vector sizes, or
  // non-finite entries.
  static absl::StatusOr<RotationSet> FromMatrices(RotationMetadata meta, std::vector<float> k,
                                                  std::vector<float> v,
                                                  std::vector<float> k_eigenvalues = {},
                                                  std::vector<float> v_eigenvalues = {});
  // R = I for every layer (format_version 1, objective "identity").
  static absl::StatusOr<RotationSet> Identity(RotationMetadata meta);
  // R = H, the normalized Sylvester Hadamard, for every layer ("hadamard", composition "H").
  static absl::StatusOr<RotationSet> Hadamard(RotationMetadata meta);

  const RotationMetadata& metadata() const { return meta_; }
  uint32_t head_dim() const { return meta_.head_dim; }
  uint32_t num_layers() const { return meta_.num_layers; }
  uint32_t num_kv_heads() const { return meta_.num_kv_heads; }
  bool per_head() const { return meta_.format_version == 2; }
  // Matrices per layer: 1 or num_kv_heads.
  uint32_t heads_per_layer() const { return per_head() ? meta_.num_kv_heads : 1; }

  // The d×d matrix for (layer, KV head); with one rotation per layer `head` is ignored.
  // Preconditions (unchecked): layer < num_layers, head < num_kv_heads.
  const float* Matrix(KvKind kind, uint32_t layer, uint32_t head) const;
  // Eigenvalues (ascending, d floats) of that matrix's target; nullptr when absent.
  const float* Eigenvalues(KvKind kind, uint32_t layer, uint32_t head) const;
  bool has_eigenvalues() const { return !k_eig_.empty(); }

  // Whole arrays ([L][Hr][d][d] and [L][Hr][d]).
  const std::vector<float>& matrices(KvKind kind) const { return kind == KvKind::kKey ? k_ : v_; }
  const std::vector<float>& eigenvalues(KvKind kind) const {
    return kind == KvKind::kKey ? k_eig_ : v_eig_;
  }

  // max |R·Rᵀ − I| (fp64) of one matrix, and the maximum over the whole set.
  double OrthogonalityError(KvKind kind, uint32_t layer, uint32_t head) const;
  double MaxOrthogonalityError() const;

  // SHA-256 (lower-case hex) of the rotation file this set was read from or serialized to;
  // empty until then. Set by the rotation-file functions.
  const std::string& rotation_id_hex() const { return rotation_id_hex_; }
  void set_rotation_id_hex(std::string id) { rotation_id_hex_ = std::move(id); }

 private:
  RotationMetadata meta_;
  std::vector<float> k_, v_, k_eig_, v_eig_;
  std::string rotation_id_hex_;
};

// The normalized d×d Sylvester Hadamard: H[i][j] = (−1)^popcount(i & j) / √d (FORMAT.md §1),
// row-major fp64. d must be a power of two (unchecked).
std::vector<double> HadamardMatrix(uint32_t d);

// i with its log2(d) low bits reversed.
uint32_t BitReverse(uint32_t i, uint32_t d);

// The eigenvalue-sorted bit-reversal permutation of FORMAT.md §1: s = indices of λ sorted
// descending (ties by ascending index); perm[br(i)] = s[i]. P_br = I[:, perm] (column j of
// M·P_br is column perm[j] of M).
std::vector<uint32_t> BitReversalPermutation(const std::vector<double>& eigenvalues);

}  // namespace kvpool
