// Tests of the fp32 <-> bf16 / fp16 conversions (kvpool/kernels/numeric.h).
#include "kvpool/kernels/numeric.h"

#include <cmath>
#include <cstdint>
#include <random>

#include <gtest/gtest.h>

#include "kvpool/kernels/quantize.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvpool {
namespace {

// Exact fp16 value of each of the 65536 patterns, computed independently from the definition.
double Fp16Value(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}

TEST(NumericTest, Fp16ToFp32AllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Fp16ToFp32(static_cast<uint16_t>(h));
    const int e = (h >> 10) & 31;
    if (e == 31) {
      if (h & 1023) {
        EXPECT_TRUE(std::isnan(f)) << h;
      } else {
        EXPECT_TRUE(std::isinf(f)) << h;
        EXPECT_EQ(std::signbit(f), (h >> 15) != 0);
      }
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), Fp16Value(static_cast<uint16_t>(h))) << h;
    ASSERT_EQ(std::signbit(f), (h >> 15) != 0) << h;
  }
}

TEST(NumericTest, Fp16RoundTripAllFinitePatternsAllModes) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if (((h >> 10) & 31) == 31) continue;
    const float f = Fp16ToFp32(static_cast<uint16_t>(h));
    for (RoundMode m : {RoundMode::kNearestEven, RoundMode::kDown, RoundMode::kUp}) {
      ASSERT_EQ(Fp32ToFp16(f, m), h) << h;
    }
  }
}

// Directed rounding checked against the definition: for every sampled fp32 x the result r is
// the fp16 neighbour on the required side, with no fp16 value strictly between x and r.
TEST(NumericTest, DirectedRoundingBracketsEveryValue) {
  // All fp32 patterns with a stride that visits every exponent and many mantissas, plus all
  // values near fp16 grid points.
  uint64_t checked = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
    const float x = BitsToFloat(static_cast<uint32_t>(u));
    if (!std::isfinite(x)) continue;
    const uint16_t dn = Fp32ToFp16(x, RoundMode::kDown);
    const uint16_t up = Fp32ToFp16(x, RoundMode::kUp);
    const uint16_t ne = Fp32ToFp16(x, RoundMode::kNearestEven);
    const double xd = x;
    const double vd = Fp16IsNonFinite(dn) ? -INFINITY : Fp16Value(dn);
    const double vu = Fp16IsNonFinite(up) ? INFINITY : Fp16Value(up);
    ASSERT_LE(vd, xd) << u;
    ASSERT_GE(vu, xd) << u;
    if (vd == xd) {
      ASSERT_EQ(vu, xd) << u;
    } else if (std::isfinite(vd) && std::isfinite(vu)) {
      // adjacent: their patterns differ by one step (same sign side) or straddle zero
      const double gap = vu - vd;
      const double ulp =
          std::max(std::ldexp(1.0, -24),
                   std::ldexp(1.0, std::ilogb(std::max(std::fabs(vd), std::fabs(vu))) - 10));
      ASSERT_LE(gap, ulp * 1.0000001) << u;
    }
    // nearest: one of the two, the closer one (ties to even mantissa)
    if (!Fp16IsNonFinite(ne)) {
      const double vn = Fp16Value(ne);
      ASSERT_TRUE(vn == vd || vn == vu || (vn == 0 && (vd == 0 || vu == 0))) << u;
      if (std::isfinite(vd) && std::isfinite(vu)) {
        ASSERT_LE(std::fabs(vn - xd), std::min(xd - vd, vu - xd)) << u;
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 1000000u);
}

TEST(NumericTest, Fp16OverflowAndSpecials) {
  EXPECT_EQ(Fp32ToFp16(65504.0f, RoundMode::kUp), 0x7bff);
  EXPECT_EQ(Fp32ToFp16(65505.0f, RoundMode::kUp), 0x7c00);
  EXPECT_EQ(Fp32ToFp16(65505.0f, RoundMode::kDown), 0x7bff);
  EXPECT_EQ(Fp32ToFp16(-65505.0f, RoundMode::kDown), 0xfc00);
  EXPECT_EQ(Fp32ToFp16(-65505.0f, RoundMode::kUp), 0xfbff);
  EXPECT_EQ(Fp32ToFp16(65519.0f, RoundMode::kNearestEven), 0x7bff);
  EXPECT_EQ(Fp32ToFp16(65520.0f, RoundMode::kNearestEven), 0x7c00);
  EXPECT_EQ(Fp32ToFp16(1e-9f, RoundMode::kUp), 0x0001);
  EXPECT_EQ(Fp32ToFp16(1e-9f, RoundMode::kDown), 0x0000);
  EXPECT_EQ(Fp32ToFp16(-1e-9f, RoundMode::kDown), 0x8001);
  EXPECT_EQ(Fp32ToFp16(-0.0f, RoundMode::kDown), 0x8000);
  EXPECT_EQ(Fp32ToFp16(4.0f / 3.0f, RoundMode::kUp), 0x3d56);  // FORMAT.md §2.4
  EXPECT_EQ(Fp32ToFp16(INFINITY, RoundMode::kDown), 0x7c00);
  EXPECT_TRUE(Fp16IsNonFinite(Fp32ToFp16(NAN, RoundMode::kNearestEven)));
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) uint16_t F16c(float f, int mode) {
  __m128i r;
  switch (mode) {
    case 0:
      r = _mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      break;
    case 1:
      r = _mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      break;
    default:
      r = _mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
      break;
  }
  return static_cast<uint16_t>(_mm_extract_epi16(r, 0));
}

// The AVX2 quantizer converts with F16C; it must agree with the software conversion for every
// finite fp32 (all 2^32 patterns, split into strides so it stays fast) in all three modes.
TEST(NumericTest, SoftwareMatchesF16cNearExhaustive) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "no F16C on this CPU";
  const RoundMode modes[3] = {RoundMode::kNearestEven, RoundMode::kDown, RoundMode::kUp};
  // Patterns with |x| in [2^-26, 2^17) (where fp16 rounding happens) with stride 61 — every
  // exponent of both signs, ~6M values — and every other pattern with stride 65537.
  uint64_t n = 0;
  auto check = [&](uint32_t u) {
    const float f = BitsToFloat(u);
    if (std::isnan(f)) return true;
    for (int m = 0; m < 3; ++m) {
      if (Fp32ToFp16(f, modes[m]) != F16c(f, m)) {
        ADD_FAILURE() << "mismatch at 0x" << std::hex << u << " mode " << m;
        return false;
      }
    }
    ++n;
    return true;
  };
  for (uint32_t sign = 0; sign < 2; ++sign) {
    const uint64_t lo = (uint64_t{sign} << 31) | (uint64_t{127 - 26} << 23);
    const uint64_t hi = (uint64_t{sign} << 31) | (uint64_t{127 + 17} << 23);
    for (uint64_t u = lo; u < hi; u += 61) ASSERT_TRUE(check(static_cast<uint32_t>(u)));
  }
  for (uint64_t u = 0; u < (1ull << 32); u += 65537) ASSERT_TRUE(check(static_cast<uint32_t>(u)));
  EXPECT_GT(n, 5000000u);
}
#endif

TEST(NumericTest, Bf16RoundNearestEvenAllPatternsSampled) {
  for (uint64_t u = 0; u < (1ull << 32); u += 257) {
    const float f = BitsToFloat(static_cast<uint32_t>(u));
    const uint16_t b = Fp32ToBf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(Bf16ToFp32(b)));
      continue;
    }
    const double back = Bf16ToFp32(b);
    // candidates: truncation and truncation + 1 ulp (2^128 stands in for the value past the
    // largest bf16, which rounds to inf)
    const uint32_t tr = static_cast<uint32_t>(u) & 0xffff0000u;
    const double lo = BitsToFloat(tr);
    double hi = BitsToFloat(tr + 0x10000u);
    if (std::isinf(hi)) hi = std::copysign(std::ldexp(1.0, 128), hi);
    const double x = f;
    const double dlo = std::fabs(x - lo), dhi = std::fabs(hi - x);
    const uint16_t lo_bits = static_cast<uint16_t>(tr >> 16);
    const bool pick_lo = dlo < dhi || (dlo == dhi && (lo_bits & 1) == 0);
    ASSERT_EQ(b, pick_lo ? lo_bits : static_cast<uint16_t>(lo_bits + 1)) << std::hex << u;
    (void)back;
  }
}

}  // namespace
}  // namespace kvpool
