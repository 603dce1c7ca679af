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
void RotateRowsAvx2(const float* x, uint64_t n, uint32_t d, const float* rotation, float* out);
void DequantizeRowsAvx2(const uint8_t* codes, const uint16_t* params, uint64_t n, uint32_t d,
                        float* out);
void Bf16ToFp32RowsAvx2(const uint16_t* x, uint64_t count, float* out);
void Fp32ToBf16RowsAvx2(const float* x, uint64_t count, uint16_t* out);

}  // namespace kvpool::internal
