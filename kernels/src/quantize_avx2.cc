// AVX2/FMA/F16C implementation of the quantizer and rotation (see kvpool/kernels/quantize.h).
// Results are bit-identical to the scalar path in quantize.cc (tested): the rotation and the
// fp16 parameters perform exactly the same fp32 operations in the same order; the clip
// threshold is the same order statistic found by another selection, and the codes come from
// comparisons proven equivalent to the scalar division (see "Codes without a division"). The code
// is compiled for AVX2 through a target pragma and only called after CpuHasAvx2() returned true.
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

// ---- Clip threshold: per-lane top lists ---------------------------------------------------
//
// Magnitudes are handled as their int32 bit patterns: for non-negative floats (and NaN/inf,
// whose patterns are larger than every finite one) the integer order is the float order.
// During the single pass over the row every lane keeps its M largest magnitudes, sorted
// (t[0] >= t[1] >= ... >= t[M-1]), by a branch-free compare-exchange chain. S = the top
// m = M-1 of every lane (8·m elements of the row, as a multiset). T0 = k-th largest of S is a
// lower bound of τ (S is part of the row). When no lane's M-th largest exceeds T0, every row
// element > T0 lies in S, so #(row > T0) = #(S > T0) < k and τ = T0 exactly — ties included.
// Otherwise (a lane holds more than m of the top k; rare for the chosen m) the exact selection
// KthLargestAvx2 runs on the stored magnitudes.

// k-th largest of the 8·m values of t[0..m) (k <= 8·m; lanes may hold the -1 "empty" marker,
// which is below every magnitude), as bits. τ = max{c in S : #(S >= c) >= k}; the count uses
// #(S < c) = 8m − #(S >= c), one compare per pair.
template <int m>
inline int32_t KthOfLaneTops(const __m256i* t, uint32_t k) {
  alignas(32) int32_t s[8 * m];
#pragma GCC unroll 4
  for (int i = 0; i < m; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(s + 8 * i), t[i]);
  const __m256i lim = _mm256_set1_epi32(static_cast<int>(8 * m - k + 1));
  __m256i best = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int i = 0; i < m; ++i) {
    const __m256i c = t[i];
    __m256i lt0 = _mm256_setzero_si256(), lt1 = _mm256_setzero_si256();
#pragma GCC unroll 32
    for (int j = 0; j < 8 * m; j += 2) {
      lt0 = _mm256_sub_epi32(lt0, _mm256_cmpgt_epi32(c, _mm256_set1_epi32(s[j])));
      lt1 = _mm256_sub_epi32(lt1, _mm256_cmpgt_epi32(c, _mm256_set1_epi32(s[j + 1])));
    }
    // #(S < c) <= 8m − k  <=>  #(S >= c) >= k
    const __m256i sel = _mm256_cmpgt_epi32(lim, _mm256_add_epi32(lt0, lt1));
    best = _mm256_max_epi32(best, _mm256_and_si256(sel, c));  // -1 markers AND -> -1 or 0
  }
  __m128i v = _mm_max_epi32(_mm256_castsi256_si128(best), _mm256_extracti128_si256(best, 1));
  v = _mm_max_epi32(v, _mm_shuffle_epi32(v, 0x4e));
  v = _mm_max_epi32(v, _mm_shuffle_epi32(v, 0xb1));
  return _mm_cvtsi128_si32(v);
}

// ---- Codes without a division per element ---------------------------------------------------
//
// The scalar path computes, per clipped value v, u = fl(v − mn16), t = fl(u / s) (s =
// scale16 > 0), code = clamp(⌊t⌋ + (t − ⌊t⌋ >= 0.5), 0, 3). As t − ⌊t⌋ is exact,
// code >= k <=> t >= c_k = k − 1/2 (k = 1, 2, 3). Claim: fl(u/s) >= c_k <=> u >= P_k = c_k·s,
// where P_k is computed exactly in fp32 (c_k has 3 significant bits, s is an fp16 value with
// 11; 2^-25 <= P_k <= 2.5·65504). (<=) u/s >= c_k and c_k is a float. (=>) if u < P_k then
// u <= pred(P_k) <= P_k(1 − 2^-24), so u/s <= c_k(1 − 2^-24), which is below the midpoint
// between c_k and its predecessor (c_k − 2^-26, 1.5 − 2^-24, 2.5 − 2^-23) and rounds below
// c_k. Hence code = Σ_k [u >= P_k] exactly.
// Clipping folds in: v ↦ fl(v − mn16) is monotone, so fl(clamp(x, −τ, τ) − mn16) =
// clamp(fl(x − mn16), lo, hi) with lo = fl(−τ − mn16), hi = fl(τ − mn16), and
// [clamp(u, lo, hi) >= P] = (hi >= P) and (u >= P or lo >= P): P becomes +inf (never) or −inf
// (always) accordingly. ±0 give the same code (P > 0), and u stays finite for finite x.

// {mn16, P'_1, P'_2, P'_3} of one group (see above).
inline void GroupThresholds(float mn16f, float sc, float tau, float* th) {
  const float lo = -tau - mn16f, hi = tau - mn16f;
  th[0] = mn16f;
  for (int k = 0; k < 3; ++k) {
    const float p = (static_cast<float>(k) + 0.5f) * sc;
    th[1 + k] = hi < p ? INFINITY : (lo >= p ? -INFINITY : p);
  }
}

// Single-pass statistics: each group's raw min/max and the per-lane top-M magnitudes
// (t[0] = lane maximum, also the NaN/Inf detector).
template <int M>
inline void RowStats(const float* x, uint32_t d, uint32_t G, float* raw_mn, float* raw_mx,
                     __m256i* t) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) t[i] = _mm256_set1_epi32(-1);
  for (uint32_t g = 0; g < d / G; ++g) {
    __m256 vmn = _mm256_set1_ps(INFINITY), vmx = _mm256_set1_ps(-INFINITY);
    for (uint32_t j = g * G; j < (g + 1) * G; j += 8) {
      const __m256 xv = _mm256_loadu_ps(x + j);
      __m256i a = _mm256_and_si256(_mm256_castps_si256(xv), abs_mask);
      vmn = _mm256_min_ps(vmn, xv);
      vmx = _mm256_max_ps(vmx, xv);
#pragma GCC unroll 8
      for (int i = 0; i + 1 < M; ++i) {
        const __m256i hi = _mm256_max_epi32(t[i], a);
        a = _mm256_min_epi32(t[i], a);
        t[i] = hi;
      }
      t[M - 1] = _mm256_max_epi32(t[M - 1], a);
    }
    raw_mn[g] = HMin(vmn);
    raw_mx[g] = HMax(vmx);
  }
}

inline bool AnyNonFinite(__m256i lane_max) {
  return _mm256_movemask_ps(
             _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane_max, _mm256_set1_epi32(0x7f7fffff)))) != 0;
}

// Exact clip threshold from the stored magnitudes (fallback and large k).
float ExactTau(const float* x, uint32_t d, uint32_t k) {
  alignas(32) float mag[kMaxHeadDim];
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (uint32_t j = 0; j < d; j += 8) {
    _mm256_store_ps(mag + j, _mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask));
  }
  return k <= 32 ? KthLargestAvx2(mag, d, k) : KthLargest(mag, d, k);
}

// Statistics + τ for k = number of kept-at-τ-or-above elements (0: no clipping). Returns false
// on NaN/Inf.
template <int M>
bool StatsAndTau(const float* x, uint32_t d, uint32_t G, uint32_t k, float* raw_mn, float* raw_mx,
                 float* tau) {
  __m256i t[M];
  RowStats<M>(x, d, G, raw_mn, raw_mx, t);
  if (AnyNonFinite(t[0])) return false;
  if (k == 0) {
    *tau = INFINITY;
    return true;
  }
  if constexpr (M >= 2) {
    const int32_t t0 = KthOfLaneTops<M - 1>(t, k);
    const __m256i over = _mm256_cmpgt_epi32(t[M - 1], _mm256_set1_epi32(t0));
    if (_mm256_movemask_ps(_mm256_castsi256_ps(over)) == 0) {
      *tau = BitsToFloat(static_cast<uint32_t>(t0));
      return true;
    }
  }
  *tau = ExactTau(x, d, k);
  return true;
}

// Lane lists deep enough that a lane rarely holds more than M−1 of the top k (measured on
// Gaussian rows at d = 128: k = 6 falls back for 2% of rows with M = 4, 21% with M = 3; k = 11:
// 3% with M = 5); the selection costs 16·(M−1)² integer ops.
bool StatsAndTauDispatch(const float* x, uint32_t d, uint32_t G, uint32_t k, float* raw_mn,
                         float* raw_mx, float* tau) {
  if (k == 0 || k > 32) return StatsAndTau<1>(x, d, G, k, raw_mn, raw_mx, tau);
  if (k <= 8) return StatsAndTau<4>(x, d, G, k, raw_mn, raw_mx, tau);
  return StatsAndTau<5>(x, d, G, k, raw_mn, raw_mx, tau);
}

}  // namespace

float ClipThresholdAvx2(const float* x, uint32_t d, float ratio) {
  if (!(ratio > 0.0f)) return INFINITY;
  const uint32_t k = d - ClipIndex(ratio, d);
  if (d < 32) {
    float mag[32];
    for (uint32_t j = 0; j < d; ++j) mag[j] = BitsToFloat(FloatBits(x[j]) & 0x7fffffffu);
    return KthLargest(mag, d, k);
  }
  alignas(32) float raw_mn[kMaxHeadDim / 8], raw_mx[kMaxHeadDim / 8];
  float tau = INFINITY;
  const uint32_t G = d < 128 ? d : 128;
  if (!StatsAndTauDispatch(x, d, G, k, raw_mn, raw_mx, &tau)) return NAN;
  return tau;
}

namespace {

// Row sources for the encoder: 8 consecutive elements as fp32.
struct F32Row {
  const float* x;
  __m256 Load8(uint32_t j) const { return _mm256_loadu_ps(x + j); }
};
struct Bf16Row {
  const uint16_t* x;
  __m256 Load8(uint32_t j) const {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

// Steps 3–4 of FORMAT.md §2 once τ and each group's raw min/max are known.
template <class Row>
RowQuantStatus EncodeRow(const Row& row, uint32_t d, float tau, const float* raw_mn,
                         const float* raw_mx, uint8_t* codes, uint16_t* params) {
  const uint32_t G = d < 128 ? d : 128;
  const uint32_t ng = d / G;
  // Per group: clipped range (clamping is monotonic, so min(clamp(x)) == clamp(min(x))
  // exactly), fp16 parameters as the scalar path, then the code thresholds.
  alignas(32) float th[4 * (kMaxHeadDim / 8)];
  uint16_t out_params[2 * (kMaxHeadDim / 8)];
  for (uint32_t g = 0; g < ng; ++g) {
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
    if (scale16 == 0) {
      th[4 * g] = mn16f;
      th[4 * g + 1] = th[4 * g + 2] = th[4 * g + 3] = INFINITY;  // every code 0
    } else {
      GroupThresholds(mn16f, FromFp16(scale16), tau, th + 4 * g);
    }
  }
  // Codes and quarter-planar packing, 8 output bytes per step: byte b holds the codes of
  // elements b, b+q, b+2q, b+3q in bits 0-1, 2-3, 4-5, 6-7. code = Σ_k [fl(x − mn16) >= P'_k];
  // the compare masks are -1, so acc −= (mask sum) << 2p adds code·4^p.
  const uint32_t q = d / 4;
  const uint32_t gshift = static_cast<uint32_t>(__builtin_ctz(G));
  const __m256i gather =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (uint32_t b = 0; b < q; b += 8) {
    __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (uint32_t p = 0; p < 4; ++p) {
      const uint32_t j = b + p * q;
      const float* tg = th + 4 * (j >> gshift);
      const __m256 u = _mm256_sub_ps(row.Load8(j), _mm256_set1_ps(tg[0]));
      const __m256i m1 = _mm256_castps_si256(_mm256_cmp_ps(u, _mm256_set1_ps(tg[1]), _CMP_GE_OQ));
      const __m256i m2 = _mm256_castps_si256(_mm256_cmp_ps(u, _mm256_set1_ps(tg[2]), _CMP_GE_OQ));
      const __m256i m3 = _mm256_castps_si256(_mm256_cmp_ps(u, _mm256_set1_ps(tg[3]), _CMP_GE_OQ));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(m1, m2), m3);  // −code
      acc = _mm256_sub_epi32(acc, _mm256_slli_epi32(s, static_cast<int>(2 * p)));
    }
    const __m256i v = _mm256_shuffle_epi8(acc, gather);
    const uint32_t lo = static_cast<uint32_t>(_mm256_extract_epi32(v, 0));
    const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(v, 4));
    std::memcpy(codes + b, &lo, 4);
    std::memcpy(codes + b + 4, &hi, 4);
  }
  std::memcpy(params, out_params, 4 * ng);
  return RowQuantStatus::kOk;
}

// ---- bf16 rows: statistics on 16-bit lanes ---------------------------------------------------
//
// A bf16 magnitude (bits & 0x7fff) orders like a non-negative int16 (NaN/inf above every finite
// one); a signed bf16 maps to an order-preserving int16 key by key = b ^ ((b >> 15) & 0x7fff)
// (an involution; −0 sorts just below +0, which the + 0.0f of the encoder makes irrelevant).
// The same per-lane top lists as the fp32 path, 16 lanes per vector, so one pass costs half.

inline int16_t KeyMin(__m256i v) {  // signed min of 16 int16
  __m128i m = _mm_min_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_minpos_epu16(_mm_xor_si128(m, _mm_set1_epi16(static_cast<int16_t>(0x8000))));
  return static_cast<int16_t>(_mm_extract_epi16(m, 0) ^ 0x8000);
}
inline int16_t KeyMax(__m256i v) {  // signed max of 16 int16 (0x7fff − v reverses the order)
  __m128i m = _mm_max_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_minpos_epu16(_mm_xor_si128(m, _mm_set1_epi16(0x7fff)));
  return static_cast<int16_t>(_mm_extract_epi16(m, 0) ^ 0x7fff);
}
inline float KeyToFloat(int16_t key) {
  const uint32_t b = static_cast<uint16_t>(key ^ ((key >> 15) & 0x7fff));
  return BitsToFloat(b << 16);
}

// One group of kG (>= 16, or 0: G at run time) bf16 elements x[0..G): key min/max into raw_mn /
// raw_mx, magnitudes into the lane lists t[0..M).
template <int M, uint32_t kG>
inline void GroupStatsBf16(const uint16_t* x, uint32_t G, float* raw_mn, float* raw_mx,
                           __m256i* t) {
  const __m256i abs_mask = _mm256_set1_epi16(0x7fff);
  const uint32_t n = kG != 0 ? kG : G;
  __m256i kmn = _mm256_set1_epi16(0x7fff), kmx = _mm256_set1_epi16(-32768);
#pragma GCC unroll 8
  for (uint32_t j = 0; j < n; j += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j));
    __m256i a = _mm256_and_si256(v, abs_mask);
    const __m256i key = _mm256_xor_si256(v, _mm256_and_si256(_mm256_srai_epi16(v, 15), abs_mask));
    kmn = _mm256_min_epi16(kmn, key);
    kmx = _mm256_max_epi16(kmx, key);
#pragma GCC unroll 8
    for (int i = 0; i + 1 < M; ++i) {
      const __m256i hi = _mm256_max_epi16(t[i], a);
      a = _mm256_min_epi16(t[i], a);
      t[i] = hi;
    }
    t[M - 1] = _mm256_max_epi16(t[M - 1], a);
  }
  *raw_mn = KeyToFloat(KeyMin(kmn));
  *raw_mx = KeyToFloat(KeyMax(kmx));
}

template <int M>
inline void RowStatsBf16(const uint16_t* x, uint32_t d, uint32_t G, float* raw_mn, float* raw_mx,
                         __m256i* t) {
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) t[i] = _mm256_set1_epi16(-1);
  if (G == 128) {  // d >= 128: groups of a compile-time size (fully unrolled)
    for (uint32_t g = 0; g < d / 128; ++g) {
      GroupStatsBf16<M, 128>(x + 128 * g, 128, raw_mn + g, raw_mx + g, t);
    }
  } else {  // d < 128: one group of G = d elements
    GroupStatsBf16<M, 0>(x, G, raw_mn, raw_mx, t);
  }
}

// k-th largest of the 16·m int16 values of S = t[0..m) (k <= number of non-marker values;
// each lane sorted descending, t[0] >= t[1] >= ..., -1 markers below every magnitude), as in
// KthOfLaneTops but by extraction in descending order: the maximum c of the lane heads t[0]
// is the largest value not yet extracted; the n lanes whose head equals c hold n copies of it
// (further copies below a head come out in the next steps with the same value). With `cum`
// values extracted before, c is the k-th largest as soon as cum + n >= k; otherwise those heads
// are popped (each such lane's list moves up one level, a -1 marker enters at the bottom). Each
// step extracts at least one value, so at most k steps run (k when all of the top k are
// distinct, the usual case); ~14 vector ops per step instead of the 16·m² compare-count.
template <int m>
inline int16_t KthOfLaneTops16(const __m256i* t_in, uint32_t k) {
  __m256i t[m];
#pragma GCC unroll 4
  for (int i = 0; i < m; ++i) t[i] = t_in[i];
  const __m128i rev = _mm_set1_epi16(0x7fff);  // v ^ 0x7fff reverses the signed int16 order
  const uint32_t k2 = 2 * k;                   // counts are in bytes (two per 16-bit lane)
  uint32_t cum2 = 0;
  for (;;) {
    const __m128i h =
        _mm_max_epi16(_mm256_castsi256_si128(t[0]), _mm256_extracti128_si256(t[0], 1));
    const __m128i mx = _mm_xor_si128(_mm_minpos_epu16(_mm_xor_si128(h, rev)), rev);  // lane 0
    const __m256i c = _mm256_broadcastw_epi16(mx);
    const __m256i eq = _mm256_cmpeq_epi16(t[0], c);
    cum2 +=
        static_cast<uint32_t>(__builtin_popcount(static_cast<unsigned>(_mm256_movemask_epi8(eq))));
    if (cum2 >= k2) return static_cast<int16_t>(_mm_cvtsi128_si32(mx));
#pragma GCC unroll 4
    for (int i = 0; i + 1 < m; ++i) t[i] = _mm256_blendv_epi8(t[i], t[i + 1], eq);
    t[m - 1] = _mm256_or_si256(t[m - 1], eq);
  }
}

// KthOfLaneTops16 for kBf16Batch rows at once (lists[r][0..m) of row r; k-th largest into
// out[r]), as exactly k steps without a data-dependent branch: a step after the one that
// reached k changes no result, and k steps always reach k (each extracts at least one value).
// The rows' step chains are independent, so their latencies overlap and no loop exit is
// mispredicted when ties change the number of steps a row needs.
template <int m, int M>
inline void KthOfLaneTops16Batch(const __m256i (*lists)[M], uint32_t k, int16_t* out) {
  constexpr int B = static_cast<int>(kBf16Batch);
  __m256i t[B][m];
#pragma GCC unroll 4
  for (int r = 0; r < B; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < m; ++i) t[r][i] = lists[r][i];
  const __m128i rev = _mm_set1_epi16(0x7fff);
  const uint32_t k2 = 2 * k;
  uint32_t cum2[B] = {};
  int32_t res[B] = {};
  for (uint32_t step = 0; step < k; ++step) {
#pragma GCC unroll 4
    for (int r = 0; r < B; ++r) {
      const __m128i h =
          _mm_max_epi16(_mm256_castsi256_si128(t[r][0]), _mm256_extracti128_si256(t[r][0], 1));
      const __m128i mx = _mm_xor_si128(_mm_minpos_epu16(_mm_xor_si128(h, rev)), rev);
      const __m256i eq = _mm256_cmpeq_epi16(t[r][0], _mm256_broadcastw_epi16(mx));
      const uint32_t before = cum2[r];
      cum2[r] = before + static_cast<uint32_t>(
                             __builtin_popcount(static_cast<unsigned>(_mm256_movemask_epi8(eq))));
      res[r] = before < k2 ? _mm_cvtsi128_si32(mx) : res[r];
#pragma GCC unroll 4
      for (int i = 0; i + 1 < m; ++i) t[r][i] = _mm256_blendv_epi8(t[r][i], t[r][i + 1], eq);
      t[r][m - 1] = _mm256_or_si256(t[r][m - 1], eq);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < B; ++r) out[r] = static_cast<int16_t>(res[r]);
}

// ---- bf16 rows: codes by 16-bit key compares --------------------------------------------------
//
// For a bf16 row, code >= k  <=>  clamp(x) >= V_k with V_k the smallest bf16 value whose
// fl(V_k − mn16) >= P_k (monotone, see "Codes without a division"), and x >= V <=> key(x) >=
// key(V) on the order-preserving int16 keys (±0 never straddle V: fl(−0 − m) = fl(+0 − m)
// in value, so the smallest such bf16 in key order is never +0). V_k is found as the bf16
// ceiling of fl(mn16 + P_k) and accepted only after checking the definition on it and on its
// bf16 predecessor; when the check fails (the boundary's fp32 rounding grid is coarser than
// bf16 there, e.g. a threshold at ~0 in a group with a large |mn16|) the row takes the fp32
// compare path instead. Clipping folds in as before: never when τ < V_k, always when −τ >= V_k.

// key(V_k) − 1 for k = 1..3 into tm1 (code_k = [key(x) > tm1_k]); false when a candidate
// fails its check. The candidate is exact: fl(v − mn16) >= P  <=>  v − mn16 >= B (reals), B the
// midpoint between P and its float predecessor, inclusive when P's significand is even (ties
// to even); B and mn16 + B are exact in fp64 (25 + 11 significant bits) but for absurd
// exponent gaps, which the check catches. V_k = the bf16 ceiling of the smallest float at or
// above (inclusive) / above mn16 + B.
inline bool Bf16KeyThresholds(float mn16f, float sc, float tau, int32_t* tm1) {
  const __m128 m = _mm_set1_ps(mn16f);
  const __m128 p = _mm_mul_ps(_mm_setr_ps(0.5f, 1.5f, 2.5f, 2.5f), _mm_set1_ps(sc));  // exact
  const __m128i pbits = _mm_castps_si128(p);                                          // P > 0
  const __m128 pprev = _mm_castsi128_ps(_mm_sub_epi32(pbits, _mm_set1_epi32(1)));
  const __m256d bnd =
      _mm256_mul_pd(_mm256_add_pd(_mm256_cvtps_pd(p), _mm256_cvtps_pd(pprev)), _mm256_set1_pd(0.5));
  const __m256d y = _mm256_add_pd(bnd, _mm256_set1_pd(static_cast<double>(mn16f)));
  const __m128 f = _mm256_cvtpd_ps(y);  // nearest
  const __m256d fd = _mm256_cvtps_pd(f);
  // need the next float up: inclusive (P even) when f < y, exclusive when f <= y
  const __m256i lt = _mm256_castpd_si256(_mm256_cmp_pd(fd, y, _CMP_LT_OQ));
  const __m256i le = _mm256_castpd_si256(_mm256_cmp_pd(fd, y, _CMP_LE_OQ));
  const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  const __m128i lt32 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(lt, pick));
  const __m128i le32 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(le, pick));
  const __m128i odd = _mm_slli_epi32(pbits, 31);  // sign bit set when P's significand is odd
  const __m128i up = _mm_blendv_epi8(lt32, le32, odd);
  const __m128i fb = _mm_castps_si128(f);
  const __m128i step = _mm_or_si128(_mm_srai_epi32(fb, 31), _mm_set1_epi32(1));  // ±1
  const __m128i zero =
      _mm_cmpeq_epi32(_mm_and_si128(fb, _mm_set1_epi32(0x7fffffff)), _mm_setzero_si128());
  const __m128i next = _mm_blendv_epi8(_mm_add_epi32(fb, step), _mm_set1_epi32(1), zero);
  const __m128i c = _mm_blendv_epi8(fb, next, up);
  // bf16 ceiling (toward +inf): positives round the magnitude up, negatives truncate it
  const __m128i neg = _mm_srai_epi32(c, 31);
  const __m128i cb = _mm_and_si128(_mm_add_epi32(c, _mm_andnot_si128(neg, _mm_set1_epi32(0xffff))),
                                   _mm_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  // int16 keys (kept in 32-bit lanes): b ^ (b < 0 ? 0x7fff : 0), sign-extended
  const __m128i b16 = _mm_srai_epi32(cb, 16);  // the bf16 pattern, sign-extended
  const __m128i key =
      _mm_xor_si128(b16, _mm_and_si128(_mm_srai_epi32(b16, 31), _mm_set1_epi32(0x7fff)));
  const __m128i kp = _mm_sub_epi32(key, _mm_set1_epi32(1));  // predecessor's key
  const __m128i bp = _mm_slli_epi32(
      _mm_xor_si128(kp, _mm_and_si128(_mm_srai_epi32(kp, 31), _mm_set1_epi32(0x7fff))), 16);
  // the definition, checked on V_k and its predecessor
  const __m128 vc = _mm_castsi128_ps(cb), vp = _mm_castsi128_ps(bp);
  const int ok_c = _mm_movemask_ps(_mm_cmp_ps(_mm_sub_ps(vc, m), p, _CMP_GE_OQ));
  const int ok_p = _mm_movemask_ps(_mm_cmp_ps(_mm_sub_ps(vp, m), p, _CMP_GE_OQ));
  if ((ok_c & 7) != 7 || (ok_p & 7) != 0) return false;
  const __m128 vt = _mm_set1_ps(tau);
  const __m128i never = _mm_castps_si128(_mm_cmp_ps(vt, vc, _CMP_LT_OQ));
  const __m128i always =
      _mm_castps_si128(_mm_cmp_ps(_mm_sub_ps(_mm_setzero_ps(), vt), vc, _CMP_GE_OQ));
  __m128i t = _mm_blendv_epi8(kp, _mm_set1_epi32(-32768), always);
  t = _mm_blendv_epi8(t, _mm_set1_epi32(32767), never);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(tm1), t);
  return true;
}

// Codes of a bf16 row from its per-group key thresholds tv[3·g + k] (d >= 64) and the
// quarter-planar packing, 16 output bytes per step. kOneGroup: d <= 128 (thresholds stay in
// registers).
template <bool kOneGroup>
inline void KeyCodes(const uint16_t* x, uint32_t d, const __m256i* tv, uint8_t* codes) {
  const uint32_t q = d / 4;
  const uint32_t gshift = d < 128 ? static_cast<uint32_t>(__builtin_ctz(d)) : 7;
  const __m256i abs_mask = _mm256_set1_epi16(0x7fff);
  const __m256i t0 = tv[0], t1 = tv[1], t2 = tv[2];
  for (uint32_t b = 0; b < q; b += 16) {
    __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (uint32_t p = 0; p < 4; ++p) {
      const uint32_t j = b + p * q;
      const __m256i* t = kOneGroup ? nullptr : tv + 3 * (j >> gshift);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j));
      const __m256i key = _mm256_xor_si256(v, _mm256_and_si256(_mm256_srai_epi16(v, 15), abs_mask));
      const __m256i s =
          _mm256_add_epi16(_mm256_add_epi16(_mm256_cmpgt_epi16(key, kOneGroup ? t0 : t[0]),
                                            _mm256_cmpgt_epi16(key, kOneGroup ? t1 : t[1])),
                           _mm256_cmpgt_epi16(key, kOneGroup ? t2 : t[2]));  // −code
      acc = _mm256_sub_epi16(acc, _mm256_slli_epi16(s, static_cast<int>(2 * p)));
    }
    // 16 code bytes (one per 16-bit lane) -> bytes b..b+15
    const __m256i packed = _mm256_packus_epi16(acc, acc);  // lane0: 0..7 x2, lane1: 8..15 x2
    const uint64_t lo = static_cast<uint64_t>(_mm256_extract_epi64(packed, 0));
    const uint64_t hi = static_cast<uint64_t>(_mm256_extract_epi64(packed, 2));
    std::memcpy(codes + b, &lo, 8);
    std::memcpy(codes + b + 8, &hi, 8);
  }
}

// One group's fp16 parameters into p[0] (scale16), p[1] (mn16) and its key thresholds
// key(V_k) − 1 into tm1[0..2] (32767: code never reached).
enum class GroupParams { kOk, kFp16Overflow, kFp32Path /* key thresholds unusable */ };
inline GroupParams GroupParamsBf16(float raw_mn, float raw_mx, float tau, uint16_t* p,
                                   int32_t* tm1) {
  const float mn = ClampScalar(raw_mn, tau) + 0.0f;
  const float mx = ClampScalar(raw_mx, tau) + 0.0f;
  const uint16_t mn16 = ToFp16Down(mn);
  if (mx > kFp16Max || Fp16IsNonFinite(mn16)) return GroupParams::kFp16Overflow;
  const float mn16f = FromFp16(mn16);
  uint16_t scale16 = 0;
  if (mx != mn) {
    const float s = (mx - mn16f) / 3.0f;
    scale16 = ToFp16Up(s);
    if (Fp16IsNonFinite(scale16)) return GroupParams::kFp16Overflow;
  }
  p[0] = scale16;  // overwritten by Fail or the fp32 fallback if needed
  p[1] = mn16;
  tm1[0] = tm1[1] = tm1[2] = 32767;  // scale16 = 0: every code 0
  if (scale16 != 0 && !Bf16KeyThresholds(mn16f, FromFp16(scale16), tau, tm1)) {
    return GroupParams::kFp32Path;
  }
  return GroupParams::kOk;
}

// EncodeRowBf16 for d > 128 (several groups; thresholds in memory).
__attribute__((noinline)) RowQuantStatus EncodeRowBf16Groups(const uint16_t* x, uint32_t d,
                                                             float tau, const float* raw_mn,
                                                             const float* raw_mx, uint8_t* codes,
                                                             uint16_t* params) {
  const uint32_t ng = d / 128;
  __m256i tv[3 * (kMaxHeadDim / 128)];
  for (uint32_t g = 0; g < ng; ++g) {
    alignas(16) int32_t tm1[4];
    const GroupParams st = GroupParamsBf16(raw_mn[g], raw_mx[g], tau, params + 2 * g, tm1);
    if (st == GroupParams::kFp16Overflow) {
      return Fail(RowQuantStatus::kFp16Overflow, d, codes, params);
    }
    if (st == GroupParams::kFp32Path) {
      return EncodeRow(Bf16Row{x}, d, tau, raw_mn, raw_mx, codes, params);
    }
    for (int k = 0; k < 3; ++k) tv[3 * g + k] = _mm256_set1_epi16(static_cast<int16_t>(tm1[k]));
  }
  KeyCodes<false>(x, d, tv, codes);
  return RowQuantStatus::kOk;
}

// EncodeRow for bf16 rows with d >= 64: key compares on 16 elements per vector. One group
// (d <= 128) keeps its thresholds in registers.
inline RowQuantStatus EncodeRowBf16(const uint16_t* x, uint32_t d, float tau, const float* raw_mn,
                                    const float* raw_mx, uint8_t* codes, uint16_t* params) {
  if (d > 128) return EncodeRowBf16Groups(x, d, tau, raw_mn, raw_mx, codes, params);
  alignas(16) int32_t tm1[4];
  const GroupParams st = GroupParamsBf16(raw_mn[0], raw_mx[0], tau, params, tm1);
  if (st == GroupParams::kFp16Overflow)
    return Fail(RowQuantStatus::kFp16Overflow, d, codes, params);
  if (st == GroupParams::kFp32Path) {
    return EncodeRow(Bf16Row{x}, d, tau, raw_mn, raw_mx, codes, params);
  }
  const __m256i tv[3] = {_mm256_set1_epi16(static_cast<int16_t>(tm1[0])),
                         _mm256_set1_epi16(static_cast<int16_t>(tm1[1])),
                         _mm256_set1_epi16(static_cast<int16_t>(tm1[2]))};
  KeyCodes<true>(x, d, tv, codes);
  return RowQuantStatus::kOk;
}

template <int M>
bool StatsAndTauBf16(const uint16_t* x, uint32_t d, uint32_t G, uint32_t k, float* raw_mn,
                     float* raw_mx, float* tau) {
  __m256i t[M];
  RowStatsBf16<M>(x, d, G, raw_mn, raw_mx, t);
  if (_mm256_movemask_epi8(_mm256_cmpgt_epi16(t[0], _mm256_set1_epi16(0x7f7f))) != 0) {
    return false;  // NaN or ±inf
  }
  if (k == 0) {
    *tau = INFINITY;
    return true;
  }
  if constexpr (M >= 2) {
    const int16_t t0 = KthOfLaneTops16<M - 1>(t, k);
    if (_mm256_movemask_epi8(_mm256_cmpgt_epi16(t[M - 1], _mm256_set1_epi16(t0))) == 0) {
      *tau = BitsToFloat(static_cast<uint32_t>(static_cast<uint16_t>(t0)) << 16);
      return true;
    }
    // a lane holds more than M−1 of the top k: retry once with deeper lists (a second pass
    // costs less than the exact selection), then the exact selection
    if constexpr (M == 3) return StatsAndTauBf16<4>(x, d, G, k, raw_mn, raw_mx, tau);
  }
  alignas(32) float wide[kMaxHeadDim];
  Bf16ToFp32RowsAvx2(x, d, wide);
  *tau = ExactTau(wide, d, k);
  return true;
}

}  // namespace

RowQuantStatus QuantizeRowAvx2(const float* x, uint32_t d, float ratio, uint8_t* codes,
                               uint16_t* params) {
  if (d < 32) return QuantizeRowScalar(x, d, ratio, codes, params);
  const uint32_t G = d < 128 ? d : 128;
  // k = number of elements at or above τ: the (d − ClipIndex)-th largest magnitude (§2.2).
  const uint32_t k = ratio > 0.0f ? d - ClipIndex(ratio, d) : 0;
  alignas(32) float raw_mn[kMaxHeadDim / 8], raw_mx[kMaxHeadDim / 8];
  float tau = INFINITY;
  if (!StatsAndTauDispatch(x, d, G, k, raw_mn, raw_mx, &tau)) {
    return Fail(RowQuantStatus::kNonFinite, d, codes, params);
  }
  return EncodeRow(F32Row{x}, d, tau, raw_mn, raw_mx, codes, params);
}

namespace {

// Up to kBf16Batch rows: statistics of every row, then the rows' k-th values selected together
// (KthOfLaneTops16Batch: interleaved, branch-free), then the encodings, so the out-of-order core
// overlaps the rows' latency chains (selection -> fp16 parameters -> thresholds). Selecting row
// by row left the core waiting on one row's extraction chain: d = 128, V clip 1.4 -> 2.0 GB/s.
template <int M>
void BatchBf16(const uint16_t* x, uint32_t n, uint32_t d, uint32_t k, uint8_t* codes,
               uint16_t* params, RowQuantStatus* status) {
  const uint32_t G = d < 128 ? d : 128;
  const uint32_t ng = d / G;
  alignas(32) float mn[kBf16Batch][kMaxHeadDim / 8], mx[kBf16Batch][kMaxHeadDim / 8];
  float tau[kBf16Batch];
  bool finite[kBf16Batch];
  __m256i t[kBf16Batch][M];
  for (uint32_t i = 0; i < n; ++i) {
    RowStatsBf16<M>(x + i * d, d, G, mn[i], mx[i], t[i]);
    // t[0] holds each lane's largest magnitude: NaN or ±inf iff above the largest finite bf16
    finite[i] = _mm256_movemask_epi8(_mm256_cmpgt_epi16(t[i][0], _mm256_set1_epi16(0x7f7f))) == 0;
    tau[i] = INFINITY;
  }
  if constexpr (M >= 2) {                        // 1 <= k <= 32
    for (uint32_t i = n; i < kBf16Batch; ++i) {  // a short batch: copies of row 0 (ignored)
#pragma GCC unroll 8
      for (int l = 0; l < M; ++l) t[i][l] = t[0][l];
    }
    int16_t t0[kBf16Batch];
    KthOfLaneTops16Batch<M - 1, M>(t, k, t0);
    for (uint32_t i = 0; i < n; ++i) {
      if (!finite[i]) continue;
      // τ = T0 unless a lane holds more than M−1 of the top k (see "per-lane top lists")
      if (_mm256_movemask_epi8(_mm256_cmpgt_epi16(t[i][M - 1], _mm256_set1_epi16(t0[i]))) == 0) {
        tau[i] = BitsToFloat(static_cast<uint32_t>(static_cast<uint16_t>(t0[i])) << 16);
      } else if constexpr (M == 3) {  // deeper lists first, then the exact selection
        StatsAndTauBf16<4>(x + i * d, d, G, k, mn[i], mx[i], &tau[i]);
      } else {
        alignas(32) float wide[kMaxHeadDim];
        Bf16ToFp32RowsAvx2(x + i * d, d, wide);
        tau[i] = ExactTau(wide, d, k);
      }
    }
  } else if (k != 0) {  // k > 32: the exact selection
    for (uint32_t i = 0; i < n; ++i) {
      if (!finite[i]) continue;
      alignas(32) float wide[kMaxHeadDim];
      Bf16ToFp32RowsAvx2(x + i * d, d, wide);
      tau[i] = ExactTau(wide, d, k);
    }
  }
  for (uint32_t i = 0; i < n; ++i) {
    uint8_t* c = codes + i * (d / 4);
    uint16_t* p = params + i * 2 * ng;
    if (!finite[i]) {
      status[i] = Fail(RowQuantStatus::kNonFinite, d, c, p);
    } else if (d >= 64) {
      status[i] = EncodeRowBf16(x + i * d, d, tau[i], mn[i], mx[i], c, p);
    } else {
      status[i] = EncodeRow(Bf16Row{x + i * d}, d, tau[i], mn[i], mx[i], c, p);
    }
  }
}

}  // namespace

void QuantizeRowsBf16Avx2(const uint16_t* x, uint32_t n, uint32_t d, float ratio, uint8_t* codes,
                          uint16_t* params, RowQuantStatus* status) {
  const uint32_t ng = d / (d < 128 ? d : 128);
  if (d < 32) {
    for (uint32_t i = 0; i < n; ++i) {
      float wide[32];
      for (uint32_t j = 0; j < d; ++j) wide[j] = Bf16ToFp32(x[i * d + j]);
      status[i] = QuantizeRowScalar(wide, d, ratio, codes + i * (d / 4), params + i * 2 * ng);
    }
    return;
  }
  const uint32_t k = ratio > 0.0f ? d - ClipIndex(ratio, d) : 0;
  // 16 lanes: k = 6 (K at d = 128) falls back for ~5% of Gaussian rows with M = 3, k = 11 (V)
  // for ~3% with M = 4 (simulated); larger k use the exact selection directly.
  for (uint32_t r = 0; r < n; r += kBf16Batch) {
    const uint32_t nb = n - r < kBf16Batch ? n - r : kBf16Batch;
    const uint16_t* xr = x + static_cast<uint64_t>(r) * d;
    uint8_t* c = codes + static_cast<uint64_t>(r) * (d / 4);
    uint16_t* p = params + static_cast<uint64_t>(r) * 2 * ng;
    if (k == 0 || k > 32) {
      BatchBf16<1>(xr, nb, d, k, c, p, status + r);
    } else if (k <= 8) {
      BatchBf16<3>(xr, nb, d, k, c, p, status + r);
    } else {
      BatchBf16<4>(xr, nb, d, k, c, p, status + r);
    }
  }
}

namespace {

// 8 fp32 lanes -> 8 bf16 patterns, round to nearest even, NaN quieted (Fp32ToBf16 of
// numeric.h lane by lane).
inline __m128i Bf16Of(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256i r =
      _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), is_nan);
  const __m256i s = _mm256_srli_epi32(r, 16);  // 8 × u32 < 65536
  return _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// The rotation micro-kernel: NR rows × NC vectors of 8 output columns, all NR·NC accumulators
// in ymm registers (6 × 2 = 12 of the 16, plus 2 for R and 1 for the broadcast x). Column
// vector c of R's row i is read at r + i·r_stride + 8·c: r_stride = d for the row-major R
// (r = R + j0) and the panel width for a packed panel (see PackRotationAvx2). Each accumulator
// follows acc ← fma(x_i, R_ij, acc) for i = 0..d−1 from acc = 0, exactly the scalar path's
// operations in its order (the blocking over rows and columns never reorders one element's
// sum over i). Output: fp32 to out (row stride d) or, with kBf16, bf16(acc) rounded to nearest
// even to out16 (row stride d) — the fused rounding of RotateQuantizeRowsBf16.
template <int NR, int NC, bool kBf16>
inline void RotTile(const float* x, uint32_t d, const float* r, uint64_t r_stride, float* out,
                    uint16_t* out16) {
  __m256 acc[NR][NC];
#pragma GCC unroll 16
  for (int k = 0; k < NR; ++k)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[k][c] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (uint32_t i = 0; i < d; ++i) {
    __m256 rv[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) rv[c] = _mm256_loadu_ps(r + i * r_stride + 8 * c);
#pragma GCC unroll 16
    for (int k = 0; k < NR; ++k) {
      const __m256 xb = _mm256_broadcast_ss(x + static_cast<uint64_t>(k) * d + i);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[k][c] = _mm256_fmadd_ps(xb, rv[c], acc[k][c]);
    }
  }
#pragma GCC unroll 16
  for (int k = 0; k < NR; ++k) {
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      if constexpr (kBf16) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out16 + static_cast<uint64_t>(k) * d + 8 * c),
                         Bf16Of(acc[k][c]));
      } else {
        _mm256_storeu_ps(out + static_cast<uint64_t>(k) * d + 8 * c, acc[k][c]);
      }
    }
  }
}

// All n rows of x against one column slab (NC·8 columns starting at column j0 of the output)
// whose R columns are at r with stride r_stride: blocks of 6 rows, then 4, 2, 1.
template <int NC, bool kBf16>
inline void RotSlab(const float* x, uint64_t n, uint32_t d, const float* r, uint64_t r_stride,
                    float* out, uint16_t* out16, uint32_t j0) {
  uint64_t k = 0;
  auto at = [&](uint64_t row) { return row * d + j0; };
  for (; k + 6 <= n; k += 6) {
    RotTile<6, NC, kBf16>(x + k * d, d, r, r_stride, out + (out ? at(k) : 0),
                          out16 + (out16 ? at(k) : 0));
  }
  if (k + 4 <= n) {
    RotTile<4, NC, kBf16>(x + k * d, d, r, r_stride, out + (out ? at(k) : 0),
                          out16 + (out16 ? at(k) : 0));
    k += 4;
  }
  if (k + 2 <= n) {
    RotTile<2, NC, kBf16>(x + k * d, d, r, r_stride, out + (out ? at(k) : 0),
                          out16 + (out16 ? at(k) : 0));
    k += 2;
  }
  if (k < n) {
    RotTile<1, NC, kBf16>(x + k * d, d, r, r_stride, out + (out ? at(k) : 0),
                          out16 + (out16 ? at(k) : 0));
  }
}

// Row-major R: per block of rows, every column slab (the block's x rows stay in L1; R streams
// from L2 once per block). For few rows, where packing would not pay.
template <bool kBf16>
void RotDirect(const float* x, uint64_t n, uint32_t d, const float* rot, float* out,
               uint16_t* out16) {
  constexpr uint64_t kRowBlock = 6;
  for (uint64_t r0 = 0; r0 < n; r0 += kRowBlock) {
    const uint64_t nr = n - r0 < kRowBlock ? n - r0 : kRowBlock;
    const float* xr = x + r0 * d;
    float* o = out ? out + r0 * d : nullptr;
    uint16_t* o16 = out16 ? out16 + r0 * d : nullptr;
    if (d % 16 == 0) {
      for (uint32_t j0 = 0; j0 < d; j0 += 16) RotSlab<2, kBf16>(xr, nr, d, rot + j0, d, o, o16, j0);
    } else {
      RotSlab<1, kBf16>(xr, nr, d, rot, d, o, o16, 0);  // d = 8
    }
  }
}

// Packed R: panel by panel over all n rows (the caller keeps n·d·4 bytes of x within L1, about
// 24 rows at d = 128), so each 8 KiB panel (d = 128) is read from L2 once per call and then
// reused from L1 by every row block, with unit-stride loads.
template <bool kBf16>
void RotPacked(const float* x, uint64_t n, uint32_t d, const float* packed, float* out,
               uint16_t* out16) {
  const uint32_t w = RotationPanelWidth(d);
  for (uint32_t j0 = 0; j0 < d; j0 += w) {
    const float* panel = packed + static_cast<uint64_t>(j0) * d;
    if (w == 16) {
      RotSlab<2, kBf16>(x, n, d, panel, 16, out, out16, j0);
    } else {
      RotSlab<1, kBf16>(x, n, d, panel, 8, out, out16, j0);
    }
  }
}

}  // namespace

void PackRotationAvx2(const float* rotation, uint32_t d, float* packed) {
  const uint32_t w = RotationPanelWidth(d);
  for (uint32_t j0 = 0; j0 < d; j0 += w) {
    float* panel = packed + static_cast<uint64_t>(j0) * d;
    for (uint32_t i = 0; i < d; ++i) {
      for (uint32_t c = 0; c < w; c += 8) {
        _mm256_storeu_ps(panel + static_cast<uint64_t>(i) * w + c,
                         _mm256_loadu_ps(rotation + static_cast<uint64_t>(i) * d + j0 + c));
      }
    }
  }
}

void RotateRowsPackedAvx2(const float* x, uint64_t n, uint32_t d, const float* packed, float* out,
                          uint16_t* out_bf16) {
  if (out_bf16 != nullptr) {
    RotPacked<true>(x, n, d, packed, nullptr, out_bf16);
  } else {
    RotPacked<false>(x, n, d, packed, out, nullptr);
  }
}

void RotateSlabAvx2(const float* x, uint64_t n, uint32_t d, const float* r, uint64_t r_stride,
                    uint32_t j0, float* out, uint16_t* out_bf16) {
  if (RotationPanelWidth(d) == 16) {
    if (out_bf16 != nullptr) {
      RotSlab<2, true>(x, n, d, r, r_stride, nullptr, out_bf16, j0);
    } else {
      RotSlab<2, false>(x, n, d, r, r_stride, out, nullptr, j0);
    }
  } else if (out_bf16 != nullptr) {
    RotSlab<1, true>(x, n, d, r, r_stride, nullptr, out_bf16, j0);
  } else {
    RotSlab<1, false>(x, n, d, r, r_stride, out, nullptr, j0);
  }
}

void RotateRowsDirectAvx2(const float* x, uint64_t n, uint32_t d, const float* rotation, float* out,
                          uint16_t* out_bf16) {
  if (out_bf16 != nullptr) {
    RotDirect<true>(x, n, d, rotation, nullptr, out_bf16);
  } else {
    RotDirect<false>(x, n, d, rotation, out, nullptr);
  }
}

void DequantizeRowsAvx2(const uint8_t* codes, const uint16_t* params, uint64_t n, uint32_t d,
                        float* out) {
  if (d < 32) {
    for (uint64_t r = 0; r < n; ++r) {
      DequantizeRowScalar(codes + r * (d / 4), params + r * 2, d, out + r * d);
    }
    return;
  }
  const uint32_t G = d < 128 ? d : 128;
  const uint32_t ng = d / G;
  const uint32_t q = d / 4;
  const uint32_t gshift = static_cast<uint32_t>(__builtin_ctz(G));
  const __m256i three = _mm256_set1_epi32(3);
  for (uint64_t r = 0; r < n; ++r) {
    const uint8_t* c = codes + r * q;
    const uint16_t* pr = params + r * 2 * ng;
    float* o = out + r * d;
    // out = mn16 + code·scale16: the scalar path's fp32 multiply then add (code·scale16 is
    // exact, so the sum is the one rounding of both paths).
    for (uint32_t b = 0; b < q; b += 8) {
      uint64_t raw;
      std::memcpy(&raw, c + b, 8);
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(raw)));
#pragma GCC unroll 4
      for (uint32_t p = 0; p < 4; ++p) {
        const uint32_t j = b + p * q;
        const uint32_t g = j >> gshift;
        const __m256 scale = _mm256_set1_ps(FromFp16(pr[2 * g]));
        const __m256 mn = _mm256_set1_ps(FromFp16(pr[2 * g + 1]));
        const __m256i code =
            _mm256_and_si256(_mm256_srli_epi32(bytes, static_cast<int>(2 * p)), three);
        const __m256 v = _mm256_add_ps(mn, _mm256_mul_ps(_mm256_cvtepi32_ps(code), scale));
        _mm256_storeu_ps(o + j, v);
      }
    }
  }
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
  for (; i + 8 <= count; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), Bf16Of(_mm256_loadu_ps(x + i)));
  }
  for (; i < count; ++i) out[i] = Fp32ToBf16(x[i]);
}

}  // namespace kvpool::internal

#pragma GCC pop_options

#else  // not x86-64: the AVX2 entry points are never called (CpuHasAvx2() is false)

namespace kvpool::internal {
float ClipThresholdAvx2(const float* x, uint32_t d, float ratio) {
  return ClipThreshold(x, d, ratio, KernelIsa::kScalar);
}
RowQuantStatus QuantizeRowAvx2(const float* x, uint32_t d, float ratio, uint8_t* codes,
                               uint16_t* params) {
  return QuantizeRowScalar(x, d, ratio, codes, params);
}
void QuantizeRowsBf16Avx2(const uint16_t* x, uint32_t n, uint32_t d, float ratio, uint8_t* codes,
                          uint16_t* params, RowQuantStatus* status) {
  const uint32_t ng = d / (d < 128 ? d : 128);
  for (uint32_t i = 0; i < n; ++i) {
    float wide[kMaxHeadDim];
    for (uint32_t j = 0; j < d; ++j) wide[j] = Bf16ToFp32(x[i * d + j]);
    status[i] = QuantizeRowScalar(wide, d, ratio, codes + i * (d / 4), params + i * 2 * ng);
  }
}
void PackRotationAvx2(const float* rotation, uint32_t d, float* packed) {
  const uint32_t w = RotationPanelWidth(d);
  for (uint32_t j0 = 0; j0 < d; j0 += w)
    for (uint32_t i = 0; i < d; ++i)
      for (uint32_t c = 0; c < w; ++c) packed[j0 * d + i * w + c] = rotation[i * d + j0 + c];
}
void RotateRowsPackedAvx2(const float* x, uint64_t n, uint32_t d, const float* packed, float* out,
                          uint16_t* out_bf16) {
  const uint32_t w = RotationPanelWidth(d);
  for (uint64_t r = 0; r < n; ++r) {
    for (uint32_t j = 0; j < d; ++j) {
      const float* col = packed + static_cast<uint64_t>(j / w) * w * d + j % w;
      float acc = 0.0f;
      for (uint32_t i = 0; i < d; ++i) acc = std::fma(x[r * d + i], col[i * w], acc);
      if (out_bf16 != nullptr) {
        out_bf16[r * d + j] = Fp32ToBf16(acc);
      } else {
        out[r * d + j] = acc;
      }
    }
  }
}
void RotateSlabAvx2(const float* x, uint64_t n, uint32_t d, const float* r, uint64_t r_stride,
                    uint32_t j0, float* out, uint16_t* out_bf16) {
  const uint32_t w = RotationPanelWidth(d);
  for (uint64_t k = 0; k < n; ++k) {
    for (uint32_t c = 0; c < w; ++c) {
      float acc = 0.0f;
      for (uint32_t i = 0; i < d; ++i) acc = std::fma(x[k * d + i], r[i * r_stride + c], acc);
      if (out_bf16 != nullptr) {
        out_bf16[k * d + j0 + c] = Fp32ToBf16(acc);
      } else {
        out[k * d + j0 + c] = acc;
      }
    }
  }
}
void RotateRowsDirectAvx2(const float* x, uint64_t n, uint32_t d, const float* rotation, float* out,
                          uint16_t* out_bf16) {
  if (out_bf16 == nullptr) {
    RotateRowsScalar(x, n, d, rotation, out);
    return;
  }
  float row[kMaxHeadDim];
  for (uint64_t r = 0; r < n; ++r) {
    RotateRowsScalar(x + r * d, 1, d, rotation, row);
    for (uint32_t j = 0; j < d; ++j) out_bf16[r * d + j] = Fp32ToBf16(row[j]);
  }
}
void DequantizeRowsAvx2(const uint8_t* codes, const uint16_t* params, uint64_t n, uint32_t d,
                        float* out) {
  const uint32_t ng = d / (d < 128 ? d : 128);
  for (uint64_t r = 0; r < n; ++r) {
    DequantizeRowScalar(codes + r * (d / 4), params + r * 2 * ng, d, out + r * d);
  }
}
void Bf16ToFp32RowsAvx2(const uint16_t* x, uint64_t count, float* out) {
  for (uint64_t i = 0; i < count; ++i) out[i] = Bf16ToFp32(x[i]);
}
void Fp32ToBf16RowsAvx2(const float* x, uint64_t count, uint16_t* out) {
  for (uint64_t i = 0; i < count; ++i) out[i] = Fp32ToBf16(x[i]);
}
}  // namespace kvpool::internal

#endif
