// kvpool/kernels/quantize.h — OSCAR INT2 quantization of rotated rows on the CPU.
//
// Implements FORMAT.md §2 exactly (the CUDA kernels are checked against this code):
//   1. rotate   x̃ = x·R                          (RotateRows; fp32, see its comment for order)
//   2. clip     τ = sort(|x̃|)[clamp(⌊ratio·d⌋, 0, d−1)], x̃ ← clamp(x̃, −τ, τ)   (§2.2)
//   3. per group of G = min(d, 128) elements: mn = min, mx = max (after clipping);
//      mn16 = fp16↓(mn); scale16 = fp16↑((mx − mn16) / 3)   with (mx − mn16) and /3 in fp32;
//      t = (x̃ − mn16) / scale16 in fp32; code = ⌊t⌋ + (t − ⌊t⌋ ≥ 0.5)  (round half up, the
//      fraction is exact in fp32), clamped to [0, 3]; code = 0 for all elements when
//      scale16 = 0.                                                       (§2.3)
//      Degenerate groups (§2.5): when mx == mn (all-equal, including all-zero) scale16 = 0 and
//      every code is 0, so the group dequantizes to fp16↓(value) (exactly the value when it is
//      representable; exactly 0 for all-zero).
//      fp16 overflow (§2.3): when mx > 65504, or mn16 or scale16 is not finite, the row is
//      not quantized (RowQuantStatus::kFp16Overflow, its outputs are zeroed); the caller keeps
//      the BF16 form.
//      NaN/Inf in the input: RowQuantStatus::kNonFinite; nothing is stored for the row.
//   4. pack     quarter-planar (§2.6): byte b of a row holds codes b, b+d/4, b+d/2, b+3d/4 in
//               bits 0–1, 2–3, 4–5, 6–7.
//   5. dequant  x̂_j = mn16 + code_j·scale16 in fp32 (code·scale16 is exact in fp32, so fused
//               and unfused multiply-add give the same value).
//
// Params layout: per row NG = d / G pairs, each {uint16 scale16, uint16 mn16} (4 bytes,
// little-endian, scale first) — docs/BLOCK_FORMAT.md.
//
// Two implementations: portable scalar code (the reference: sorted selection of τ, a division
// per element) and an AVX2/FMA/F16C path, chosen at run time (KernelIsa::kAuto) and
// bit-identical to the scalar path for every input (tested on random, tie-heavy, adversarial
// and level-boundary inputs). The AVX2 quantizer finds the same τ from per-lane top lists
// (with an exactness check and an exact fallback) and the same codes by comparisons that are
// proven equivalent to the division (kernels/src/quantize_avx2.cc); bf16 rows are processed
// natively on 16-bit lanes, a few rows at a time.
//
//   uint8_t codes[32]; uint16_t params[2];
//   RowQuantStatus s = QuantizeRow(x, 128, kDefaultClipRatioK, codes, params);
//
// Thread-safety: all functions are reentrant (no shared state; scratch lives on the stack).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace kvpool {

// Default clip ratios (FORMAT.md §2.2). 0 disables clipping.
inline constexpr float kDefaultClipRatioK = 0.96f;
inline constexpr float kDefaultClipRatioV = 0.92f;

// Largest head_dim the CPU kernels accept (they keep a row of scratch on the stack).
inline constexpr uint32_t kMaxHeadDim = 1024;

// Instruction set for the CPU kernels.
enum class KernelIsa {
  kAuto,    // AVX2 when the CPU has AVX2+FMA+F16C, else scalar
  kScalar,  // portable C++
  kAvx2,    // AVX2+FMA+F16C; callers must check CpuHasAvx2() (kAuto does)
};

// True when this CPU supports the AVX2 path (AVX2, FMA and F16C).
bool CpuHasAvx2();

// kAuto -> the best available; kAvx2 on a CPU without it -> kScalar. Never returns kAuto.
KernelIsa ResolveIsa(KernelIsa isa);

// Human-readable name ("scalar", "avx2").
const char* IsaName(KernelIsa isa);

// INVALID_ARGUMENT (naming `field`) unless head_dim is a power of two in [8, kMaxHeadDim].
absl::Status ValidateHeadDim(uint32_t head_dim, const char* field = "head_dim");

// INVALID_ARGUMENT (naming `field`) unless ratio == 0 or 0 < ratio <= 1 (finite).
absl::Status ValidateClipRatio(float ratio, const char* field = "clip_ratio");

// Index of the clip threshold in the ascending sorted magnitudes: clamp(⌊ratio·d⌋, 0, d−1)
// computed in fp64 from the fp32 ratio (FORMAT.md §2.2). Only meaningful for ratio > 0.
uint32_t ClipIndex(float ratio, uint32_t d);

// The clip threshold τ of one row (FORMAT.md §2.2): the ClipIndex-th smallest |x_j|;
// +inf when ratio == 0 (clipping disabled). x: [d] finite fp32 (with NaN/Inf the AVX2 path
// returns NaN). kScalar (the default, the reference) selects with a sorted top-k insertion /
// nth_element; kAvx2/kAuto use the quantizer's vectorized selection (per-lane top lists with an
// exactness check), the same value for every input. Pure.
float ClipThreshold(const float* x, uint32_t d, float ratio, KernelIsa isa = KernelIsa::kScalar);

// Result of quantizing one row.
enum class RowQuantStatus : uint8_t {
  kOk = 0,
  kNonFinite = 1,     // NaN or ±inf in the input; outputs zeroed; never store the row
  kFp16Overflow = 2,  // a group exceeds the fp16 range; outputs zeroed; keep BF16 form
};

// Quantizes one rotated row (steps 2–4 above).
//   x:      [d] fp32, rotated
//   d:      head_dim (power of two, 8..kMaxHeadDim; unchecked here — validate once per call
//           site with ValidateHeadDim)
//   ratio:  clip ratio (0 disables; validate with ValidateClipRatio)
//   codes:  [d/4] bytes out, quarter-planar packed
//   params: [2·d/G] uint16 out: {scale16, mn16} per group
RowQuantStatus QuantizeRow(const float* x, uint32_t d, float ratio, uint8_t* codes,
                           uint16_t* params, KernelIsa isa = KernelIsa::kAuto);

// Summary of a multi-row quantization.
struct QuantizeRowsResult {
  uint64_t overflow_rows = 0;    // rows with RowQuantStatus::kFp16Overflow
  uint64_t overflow_groups = 0;  // groups whose values exceed fp16 (counted in those rows)
  int64_t first_overflow_row = -1;
};

// Quantizes n rows of fp32 (x: [n][d]) into codes [n][d/4] and params [n][2·d/G].
// Errors: INVALID_ARGUMENT for a bad head_dim or ratio, or for a NaN/Inf input naming the row
// and element ("row 3 element 17 is nan"); on error the outputs are unspecified.
// Overflow rows are zeroed and counted in *result (nullable), not an error.
absl::Status QuantizeRows(const float* x, uint64_t n, uint32_t d, float ratio, uint8_t* codes,
                          uint16_t* params, QuantizeRowsResult* result,
                          KernelIsa isa = KernelIsa::kAuto);

// Same, for bf16 rows (x: [n][d] bf16 bit patterns) — the demotion path of a decode worker
// (its recent-window blocks are already rotated BF16). Each row is widened to fp32 exactly.
absl::Status QuantizeRowsBf16(const uint16_t* x, uint64_t n, uint32_t d, float ratio,
                              uint8_t* codes, uint16_t* params, QuantizeRowsResult* result,
                              KernelIsa isa = KernelIsa::kAuto);

// Dequantizes one packed row: out[j] = mn16 + code_j·scale16 (fp32, multiply then add; the
// product is exact, so this equals the fused form). codes [d/4], params [2·d/G], out [d];
// d a power of two 8..kMaxHeadDim (unchecked). The AVX2 path (kAuto on an AVX2 CPU) is
// bit-identical to the scalar one.
void DequantizeRow(const uint8_t* codes, const uint16_t* params, uint32_t d, float* out,
                   KernelIsa isa = KernelIsa::kAuto);

// Dequantizes n rows: codes [n][d/4], params [n][2·d/G], out [n][d] (same rule as above).
void DequantizeRows(const uint8_t* codes, const uint16_t* params, uint64_t n, uint32_t d,
                    float* out, KernelIsa isa = KernelIsa::kAuto);

// Quarter-planar packing of d codes (each 0..3) into d/4 bytes, and its inverse.
void PackCodes(const uint8_t* codes, uint32_t d, uint8_t* packed);
void UnpackCodes(const uint8_t* packed, uint32_t d, uint8_t* codes);

// Rotates n rows: out[r][j] = Σ_i x[r][i]·R[i][j] (rows times R on the right, FORMAT.md §1),
// computed in fp32 as acc_j ← fma(x_i, R_ij, acc_j) for i = 0..d−1 in order starting from
// acc_j = 0 — the scalar and AVX2 paths are bit-identical. R: [d][d] row-major fp32.
// x and out must not overlap. d: power of two 8..kMaxHeadDim (unchecked).
void RotateRows(const float* x, uint64_t n, uint32_t d, const float* rotation, float* out,
                KernelIsa isa = KernelIsa::kAuto);

// Same with bf16 input rows (widened exactly to fp32 first).
void RotateRowsBf16(const uint16_t* x, uint64_t n, uint32_t d, const float* rotation, float* out,
                    KernelIsa isa = KernelIsa::kAuto);

// Multiplies rows by Rᵀ (the inverse rotation of an orthogonal R): out[r][i] = Σ_j
// x[r][j]·R[i][j], fp32 with fma in order j = 0..d−1. Scalar only (reference paths).
void RotateRowsTransposed(const float* x, uint64_t n, uint32_t d, const float* rotation,
                          float* out);

// Fused rotate + bf16 rounding + clip + quantize of n un-rotated bf16 rows (the pool's commit
// path, and benchmark (a) of bench/). rotated_bf16 [n][d] (nullable) receives bf16(x·R);
// the INT2 output quantizes exactly those bf16 values (so a worker demoting the rotated BF16
// form later produces identical bytes). Errors and result as QuantizeRows.
absl::Status RotateQuantizeRowsBf16(const uint16_t* x, uint64_t n, uint32_t d,
                                    const float* rotation, float ratio, uint16_t* rotated_bf16,
                                    uint8_t* codes, uint16_t* params, QuantizeRowsResult* result,
                                    KernelIsa isa = KernelIsa::kAuto);

}  // namespace kvpool
