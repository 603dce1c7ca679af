// Internal entry points of the quantizer's two implementations (not installed).
#pragma once

#include <cstdint>

#include "kvpool/kernels/quantize.h"

namespace kvpool::internal {

// Threshold selection helper shared by both paths: the k-th largest of a[0..d) (k >= 1),
// a holds magnitudes (non-negative, finite). May reorder `a`.
float KthLargest(float* a, uint32_t d, uint32_t k);

RowQuantStatus QuantizeRowScalar(const float* x, uint32_t d, float ratio, uint8_t* codes,
                                 uint16_t* params);
void DequantizeRowScalar(const uint8_t* codes, const uint16_t* params, uint32_t d, float* out);
void RotateRowsScalar(const float* x, uint64_t n, uint32_t d, const float* rotation, float* out);

// Defined in quantize_avx2.cc (compiled for AVX2/FMA/F16C through a target pragma); call
// only when CpuHasAvx2().
// The clip threshold through the AVX2 selection (same value as ClipThreshold's scalar path;
// NaN when x holds NaN/Inf).
float ClipThresholdAvx2(const float* x, uint32_t d, float ratio);
RowQuantStatus QuantizeRowAvx2(const float* x, uint32_t d, float ratio, uint8_t* codes,
                               uint16_t* params);
// The same for n consecutive rows of bf16 bit patterns (widened exactly; statistics on
// 16-bit lanes; rows interleaved in batches of kBf16Batch): x [n][d], codes [n][d/4], params
// [n][2·d/G], status [n] out (one per row, as QuantizeRowAvx2 returns).
inline constexpr uint32_t kBf16Batch = 4;
void QuantizeRowsBf16Avx2(const uint16_t* x, uint32_t n, uint32_t d, float ratio, uint8_t* codes,
                          uint16_t* params, RowQuantStatus* status);

// ---- rotation (x·R, the operation order of RotateRowsScalar) ----
// The AVX2 kernel reads R either row-major (RotateRowsDirectAvx2: no preparation; R streams
// from L2 for every block of 6 rows) or packed once per call into column panels
// (RotateRowsPackedAvx2: each panel is read from L2 once per tile of rows and reused from L1).
// Packing (64 KiB at d = 128) costs about as much as rotating 6-8 rows and the packed kernel
// is ~10% faster under load (measured on the 2-core dev machine), so callers pack only for
// n >= kRotatePackMinRows.
inline constexpr uint64_t kRotatePackMinRows = 64;
// Columns per panel: 16 (two ymm vectors), 8 for d = 8.
inline constexpr uint32_t RotationPanelWidth(uint32_t d) { return d >= 16 ? 16 : 8; }
// Rows of x per call of RotateRowsPackedAvx2: a 12 KiB tile of fp32 rows (24 at d = 128, 3 at
// d = kMaxHeadDim), small enough for L1 beside one 8 KiB panel.
inline constexpr uint64_t kRotationTileFloats = 3072;
inline constexpr uint64_t RotationTileRows(uint32_t d) { return kRotationTileFloats / d; }
// packed [d·d]: panel p (columns p·W .. p·W+W−1, W = RotationPanelWidth(d)) at p·W·d, holding
// R[i][p·W + c] at i·W + c. 32-byte alignment recommended (loads are unaligned-safe).
void PackRotationAvx2(const float* rotation, uint32_t d, float* packed);
// out[r][j] = Σ_i x[r][i]·R[i][j] for n rows, with R packed (above) or row-major (Direct). The
// result goes to out (fp32, [n][d]) when out_bf16 is null, else rounded to bf16 (nearest
// even, Fp32ToBf16) into out_bf16 [n][d] and out is unused. Bit-identical to RotateRowsScalar.
void RotateRowsPackedAvx2(const float* x, uint64_t n, uint32_t d, const float* packed, float* out,
                          uint16_t* out_bf16);
void RotateRowsDirectAvx2(const float* x, uint64_t n, uint32_t d, const float* rotation, float* out,
                          uint16_t* out_bf16);
// One column slab of the same: columns j0 .. j0 + RotationPanelWidth(d) − 1 of n rows, with
// R's slab at r, row stride r_stride (the packed panel: packed + j0·d, stride W; or the
// row-major R: rotation + j0, stride d). out / out_bf16 as above (full rows [n][d]).
void RotateSlabAvx2(const float* x, uint64_t n, uint32_t d, const float* r, uint64_t r_stride,
                    uint32_t j0, float* out, uint16_t* out_bf16);
void DequantizeRowsAvx2(const uint8_t* codes, const uint16_t* params, uint64_t n, uint32_t d,
                        float* out);
void Bf16ToFp32RowsAvx2(const uint16_t* x, uint64_t count, float* out);
void Fp32ToBf16RowsAvx2(const float* x, uint64_t count, uint16_t* out);

}  // namespace kvpool::internal
