// AVX2/FMA/F16C implementation of the quantizer and rotation (see kvpool/kernels/quantize.h).
// Every function here performs exactly the same fp32 operations, in the same order, as the
// scalar path in quantize.cc, so results are bit-identical (tested). The code is compiled for
// AVX2 through a target pragma and only called after CpuHasAvx2() returned true.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvpool/kernels/numeric.h"
#include "quantize_internal.h"

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace kvpool::internal {
namespace {

inline float HMin(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_min_ps(lo, hi);
  lo = _mm_min_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_min_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
inline float HMax(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_max_ps(lo, hi);
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// std::min(std::max(v, -tau), tau) spelled out (no std templates instantiated in this AVX2
// translation unit).
inline float ClampScalar(float v, float tau) {
  const float lo = v < -tau ? -tau : v;
  return tau < lo ? tau : lo;
}

inline uint16_t ToFp16Down(float f) {
  return static_cast<uint16_t>(
      _mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), 0));
}
inline uint16_t ToFp16Up(float f) {
  return static_cast<uint16_t>(
      _mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC), 0));
}
inline float FromFp16(uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }

// Left-packing table: for each 8-bit mask, the lane indices of its set bits, in order.
struct PackTable {
  alignas(32) int32_t idx[256][8];
  constexpr PackTable() : idx() {
    for (int m = 0; m < 256; ++m) {
      int n = 0;
      for (int b = 0; b < 8; ++b)
        if (m & (1 << b)) idx[m][n++] = b;
      for (; n < 8; ++n) idx[m][n] = 0;
    }
  }
};
constexpr PackTable kPack;

// k-th largest of a[0..n) (1 <= k <= n), a padded with -1 up to a multiple of 8. Branch-free
// rank selection: lane value c is the answer when #(a > c) < k <= #(a >= c).
inline float RankSelect(const float* a, uint32_t n, uint32_t k) {
  const uint32_t padded = (n + 7) & ~7u;
  const __m256i vk = _mm256_set1_epi32(static_cast<int>(k));
  __m256 best = _mm256_set1_ps(-1.0f);
  for (uint32_t i = 0; i < padded; i += 8) {
    const __m256 c = _mm256_load_ps(a + i);
    __m256i gt = _mm256_setzero_si256(), ge = _mm256_setzero_si256();
    for (uint32_t j = 0; j < n; ++j) {
      const __m256 v = _mm256_broadcast_ss(a + j);
      gt = _mm256_sub_epi32(gt, _mm256_castps_si256(_mm256_cmp_ps(v, c, _CMP_GT_OQ)));
      ge = _mm256_sub_epi32(ge, _mm256_castps_si256(_mm256_cmp_ps(v, c, _CMP_GE_OQ)));
    }
    // gt < k  and  ge >= k  (i.e. !(k > ge))
    const __m256i sel = _mm256_andnot_si256(_mm256_cmpgt_epi32(vk, ge), _mm256_cmpgt_epi32(vk, gt));
    best = _mm256_max_ps(best, _mm256_and_ps(_mm256_castsi256_ps(sel), c));
  }
  return HMax(best);  // selected lanes all hold the answer; others contribute +0 or -1
}

// k-th largest magnitude (k <= 32, d a multiple of 8). Lower bound first: split the d/8 chunks
// into m = ceil(k/8) interleaved sets and take lane-wise maxima — 8·m distinct elements — whose
// k-th largest T0 cannot exceed the true k-th largest τ. Only elements >= T0 can be among the k
// largest; they are left-packed (branch-free) and rank-selected. Same order statistic as
// KthLargest.
float KthLargestAvx2(const float* mag, uint32_t d, uint32_t k) {
  const uint32_t m = (k + 7) / 8;
  const uint32_t chunks = d / 8;
  if (chunks < m) return KthLargest(const_cast<float*>(mag), d, k);  // tiny rows
  alignas(32) float lanes[32];
  for (uint32_t s = 0; s < m; ++s) {
    __m256 mx = _mm256_load_ps(mag + 8 * s);
    for (uint32_t c = s + m; c < chunks; c += m)
      mx = _mm256_max_ps(mx, _mm256_load_ps(mag + 8 * c));
    _mm256_store_ps(lanes + 8 * s, mx);
  }
  const float t0 = RankSelect(lanes, 8 * m, k);
  alignas(32) float cand[kMaxHeadDim + 8];
  uint32_t nc = 0;
  const __m256 vt0 = _mm256_set1_ps(t0);
  for (uint32_t j = 0; j < d; j += 8) {
    const __m256 v = _mm256_load_ps(mag + j);
    const int msk = _mm256_movemask_ps(_mm256_cmp_ps(v, vt0, _CMP_GE_OQ));
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPack.idx[msk]));
    _mm256_storeu_ps(cand + nc, _mm256_permutevar8x32_ps(v, perm));
    nc += static_cast<uint32_t>(__builtin_popcount(static_cast<unsigned>(msk)));
  }
  _mm256_storeu_ps(cand + nc, _mm256_set1_ps(-1.0f));  // padding
  return RankSelect(cand, nc, k);
}

RowQuantStatus Fail(RowQuantStatus s, uint32_t d, uint8_t* codes, uint16_t* params) {
  const uint32_t ng = d / (d < 128 ? d : 128);
  std::memset(codes, 0, d / 4);
  std::memset(params, 0, 4 * ng);
  return s;
}

}  // namespace

RowQuantStatus QuantizeRowAvx2(const float* x, uint32_t d, float ratio, uint8_t* codes,
                               uint16_t* params) {
  if (d < 32) return QuantizeRowScalar(x, d, ratio, codes, params);
  const uint32_t G = d < 128 ? d : 128;
  const uint32_t ng = d / G;
  alignas(32) float mag[kMaxHeadDim];
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(INFINITY);
  __m256 bad = _mm256_setzero_ps();
  // One pass: magnitudes, the NaN/Inf check, and each group's raw min/max. Clamping is
  // monotonic, so min(clamp(x)) == clamp(min(x)) exactly (no NaN here): the clipped group
  // range is derived from the raw one once τ is known — the same values the scalar path gets.
  alignas(32) float raw_mn[kMaxHeadDim / 8], raw_mx[kMaxHeadDim / 8];
  for (uint32_t g = 0; g < ng; ++g) {
    __m256 vmn = _mm256_set1_ps(INFINITY), vmx = _mm256_set1_ps(-INFINITY);
    for (uint32_t j = g * G; j < (g + 1) * G; j += 8) {
      const __m256 xv = _mm256_loadu_ps(x + j);
      const __m256 a = _mm256_and_ps(xv, abs_mask);
      // !(a < inf) is true for inf and NaN
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
      _mm256_store_ps(mag + j, a);
      vmn = _mm256_min_ps(vmn, xv);
      vmx = _mm256_max_ps(vmx, xv);
    }
    raw_mn[g] = HMin(vmn);
    raw_mx[g] = HMax(vmx);
  }
  if (_mm256_movemask_ps(bad)) return Fail(RowQuantStatus::kNonFinite, d, codes, params);

  float tau = INFINITY;
  if (ratio > 0.0f) {
    const uint32_t k = d - ClipIndex(ratio, d);
    tau = k <= 32 ? KthLargestAvx2(mag, d, k) : KthLargest(mag, d, k);
  }
  const __m256 vt = _mm256_set1_ps(tau), vnt = _mm256_set1_ps(-tau);
  alignas(32) int32_t code[kMaxHeadDim];
  uint16_t out_params[2 * (kMaxHeadDim / 8)];
  for (uint32_t g = 0; g < ng; ++g) {
    const float* v = x + g * G;
    const float mn = ClampScalar(raw_mn[g], tau) + 0.0f;
    const float mx = ClampScalar(raw_mx[g], tau) + 0.0f;
    const uint16_t mn16 = ToFp16Down(mn);
    if (mx > kFp16Max || Fp16IsNonFinite(mn16)) {
      return Fail(RowQuantStatus::kFp16Overflow, d, codes, params);
    }
    const float mn16f = FromFp16(mn16);
    uint16_t scale16 = 0;
    if (mx != mn) {
      const float s = (mx - mn16f) / 3.0f;
      scale16 = ToFp16Up(s);
      if (Fp16IsNonFinite(scale16)) return Fail(RowQuantStatus::kFp16Overflow, d, codes, params);
    }
    out_params[2 * g] = scale16;
    out_params[2 * g + 1] = mn16;
    int32_t* c = code + g * G;
    if (scale16 == 0) {
      for (uint32_t j = 0; j < G; j += 8) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(c + j), _mm256_setzero_si256());
      }
      continue;
    }
    const __m256 vmn16 = _mm256_set1_ps(mn16f), vsc = _mm256_set1_ps(FromFp16(scale16));
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256 zero = _mm256_setzero_ps(), three = _mm256_set1_ps(3.0f);
    for (uint32_t j = 0; j < G; j += 8) {
      const __m256 xc = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(v + j), vnt), vt);
      const __m256 t = _mm256_div_ps(_mm256_sub_ps(xc, vmn16), vsc);
      const __m256 fl = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      const __m256 up = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(t, fl), half, _CMP_GE_OQ), one);
      __m256 q = _mm256_add_ps(fl, up);
      q = _mm256_min_ps(_mm256_max_ps(q, zero), three);
      _mm256_store_si256(reinterpret_cast<__m256i*>(c + j), _mm256_cvttps_epi32(q));
    }
  }
  // Quarter-planar packing, 8 output bytes per step.
  const uint32_t q = d / 4;
  const __m256i gather =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (uint32_t b = 0; b < q; b += 8) {
    const __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(code + b));
    const __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(code + b + q));
    const __m256i c2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(code + b + 2 * q));
    const __m256i c3 = _mm256_load_si256(reinterpret_cast<const __m256i*>(code + b + 3 * q));
    __m256i v =
        _mm256_or_si256(_mm256_or_si256(c0, _mm256_slli_epi32(c1, 2)),
                        _mm256_or_si256(_mm256_slli_epi32(c2, 4), _mm256_slli_epi32(c3, 6)));
    v = _mm256_shuffle_epi8(v, gather);
    const uint32_t lo = static_cast<uint32_t>(_mm256_extract_epi32(v, 0));
    const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(v, 4));
    std::memcpy(codes + b, &lo, 4);
    std::memcpy(codes + b + 4, &hi, 4);
  }
  std::memcpy(params, out_params, 4 * ng);
  return RowQuantStatus::kOk;
}

namespace {

// Register-blocked x·R: NR rows × NC vectors of 8 columns per tile. Each accumulator follows
// acc ← fma(x_i, R_ij, acc) for i = 0..d−1 from acc = 0, as the scalar path.
template <int NR, int NC>
inline void RotTile(const float* x, uint32_t d, const float* rot, float* out, uint32_t j0) {
  __m256 acc[NR][NC];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (uint32_t i = 0; i < d; ++i) {
    __m256 rv[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      rv[c] = _mm256_loadu_ps(rot + static_cast<uint64_t>(i) * d + j0 + 8 * c);
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + static_cast<uint64_t>(r) * d + i);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(xb, rv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_ps(out + static_cast<uint64_t>(r) * d + j0 + 8 * c, acc[r][c]);
}

template <int NR>
inline void RotRows(const float* x, uint32_t d, const float* rot, float* out) {
  if (d % 16 == 0) {
    for (uint32_t j0 = 0; j0 < d; j0 += 16) RotTile<NR, 2>(x, d, rot, out, j0);
  } else {
    for (uint32_t j0 = 0; j0 < d; j0 += 8) RotTile<NR, 1>(x, d, rot, out, j0);
  }
}

}  // namespace

void RotateRowsAvx2(const float* x, uint64_t n, uint32_t d, const float* rotation, float* out) {
  uint64_t r = 0;
  for (; r + 6 <= n; r += 6) RotRows<6>(x + r * d, d, rotation, out + r * d);
  for (; r + 2 <= n; r += 2) RotRows<2>(x + r * d, d, rotation, out + r * d);
  for (; r < n; ++r) RotRows<1>(x + r * d, d, rotation, out + r * d);
}

void Bf16ToFp32RowsAvx2(const uint16_t* x, uint64_t count, float* out) {
  uint64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(w));
  }
  for (; i < count; ++i) out[i] = Bf16ToFp32(x[i]);
}

void Fp32ToBf16RowsAvx2(const float* x, uint64_t count, uint16_t* out) {
  uint64_t i = 0;
  const __m256i exp_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i qnan = _mm256_set1_epi32(0x00400000);
  for (; i + 8 <= count; i += 8) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, exp_mask), inf);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(bias, lsb));
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, qnan), is_nan);
    __m256i s = _mm256_srli_epi32(r, 16);
    // pack 8 × u32 (< 65536) to 8 × u16
    const __m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_packus_epi32(lo, hi));
  }
  for (; i < count; ++i) out[i] = Fp32ToBf16(x[i]);
}

}  // namespace kvpool::internal

#pragma GCC pop_options

#else  // not x86-64: the AVX2 entry points are never called (CpuHasAvx2() is false)

namespace kvpool::internal {
RowQuantStatus QuantizeRowAvx2(const float* x, uint32_t d, float ratio, uint8_t* codes,
                               uint16_t* params) {
  return QuantizeRowScalar(x, d, ratio, codes, params);
}
void RotateRowsAvx2(const float* x, uint64_t n, uint32_t d, const float* r, float* out) {
  RotateRowsScalar(x, n, d, r, out);
}
void Bf16ToFp32RowsAvx2(const uint16_t* x, uint64_t count, float* out) {
  for (uint64_t i = 0; i < count; ++i) out[i] = Bf16ToFp32(x[i]);
}
void Fp32ToBf16RowsAvx2(const float* x, uint64_t count, uint16_t* out) {
  for (uint64_t i = 0; i < count; ++i) out[i] = Fp32ToBf16(x[i]);
}
}  // namespace kvpool::internal

#endif
