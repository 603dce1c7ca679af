// Tests of the OSCAR INT2 quantizer (kvpool/kernels/quantize.h) against FORMAT.md §2.
#include "kvpool/kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kvpool/kernels/numeric.h"

namespace kvpool {
namespace {

// The reference implementation's exact-arithmetic quantizer (fp64, unrounded mn and scale,
// round half up), FORMAT.md §2.3 before our fp16 decision. Returns codes.
std::vector<uint8_t> ExactReferenceCodes(const std::vector<float>& x) {
  double mn = x[0], mx = x[0];
  for (float v : x) {
    mn = std::min<double>(mn, v);
    mx = std::max<double>(mx, v);
  }
  const double scale = std::max(mx - mn, 1e-8) / 3.0;
  std::vector<uint8_t> c;
  for (float v : x) {
    double q = std::floor((v - mn) / scale + 0.5);
    c.push_back(static_cast<uint8_t>(std::clamp(q, 0.0, 3.0)));
  }
  return c;
}

std::vector<KernelIsa> Isas() {
  std::vector<KernelIsa> v = {KernelIsa::kScalar};
  if (CpuHasAvx2()) v.push_back(KernelIsa::kAvx2);
  return v;
}

TEST(QuantizeTest, WorkedExampleFormat24) {
  const std::vector<float> x = {-1, 0, 0.5, 2, -0.5, 1, 1.5, -2};
  for (KernelIsa isa : Isas()) {
    uint8_t packed[2];
    uint16_t params[2];
    ASSERT_EQ(QuantizeRow(x.data(), 8, 0.0f, packed, params, isa), RowQuantStatus::kOk);
    EXPECT_EQ(packed[0], 0xD9) << IsaName(isa);
    EXPECT_EQ(packed[1], 0x2D) << IsaName(isa);
    EXPECT_EQ(params[0], 0x3D56);  // scale16 = fp16↑(4/3) = 1.333984375
    EXPECT_EQ(params[1], 0xC000);  // mn16 = −2
    uint8_t codes[8];
    UnpackCodes(packed, 8, codes);
    const std::vector<uint8_t> expect = {1, 1, 2, 3, 1, 2, 3, 0};
    EXPECT_EQ(std::vector<uint8_t>(codes, codes + 8), expect);
    float deq[8];
    DequantizeRow(packed, params, 8, deq);
    for (int j = 0; j < 8; ++j) EXPECT_EQ(deq[j], -2.0f + expect[j] * 1.333984375f);
  }
  // The exact-arithmetic reference puts x = 0 on the tie 1.5 -> 2: bytes [0xD9, 0x2E].
  std::vector<uint8_t> ref = ExactReferenceCodes(x);
  EXPECT_EQ(ref, (std::vector<uint8_t>{1, 2, 2, 3, 1, 2, 3, 0}));
  uint8_t ref_packed[2];
  PackCodes(ref.data(), 8, ref_packed);
  EXPECT_EQ(ref_packed[0], 0xD9);
  EXPECT_EQ(ref_packed[1], 0x2E);
}

TEST(QuantizeTest, PackUnpackRoundTripAndBitOrder) {
  std::mt19937 rng(1);
  for (uint32_t d : {8u, 16u, 64u, 128u, 256u}) {
    std::vector<uint8_t> c(d), back(d), packed(d / 4);
    for (auto& v : c) v = rng() & 3;
    PackCodes(c.data(), d, packed.data());
    for (uint32_t b = 0; b < d / 4; ++b) {
      for (uint32_t k = 0; k < 4; ++k) {
        ASSERT_EQ((packed[b] >> (2 * k)) & 3, c[b + k * d / 4]);
      }
    }
    UnpackCodes(packed.data(), d, back.data());
    EXPECT_EQ(c, back);
  }
}

TEST(QuantizeTest, ClipIndexAndThreshold) {
  EXPECT_EQ(ClipIndex(0.96f, 128), 122u);
  EXPECT_EQ(ClipIndex(0.92f, 128), 117u);
  EXPECT_EQ(ClipIndex(1.0f, 128), 127u);
  std::vector<float> x(128);
  for (int j = 0; j < 128; ++j) x[j] = (j % 2 ? -1.0f : 1.0f) * static_cast<float>(j + 1);
  std::shuffle(x.begin(), x.end(), std::mt19937(3));
  EXPECT_EQ(ClipThreshold(x.data(), 128, 0.96f), 123.0f);  // K: 5 largest (124..128) clipped
  EXPECT_EQ(ClipThreshold(x.data(), 128, 0.92f), 118.0f);  // V: 10 largest clipped
  EXPECT_TRUE(std::isinf(ClipThreshold(x.data(), 128, 0.0f)));
  // Count clipped elements through the quantizer's dequantized output: with clipping, the
  // largest reconstructed magnitude cannot exceed τ + scale/2.
  for (KernelIsa isa : Isas()) {
    uint8_t codes[32];
    uint16_t params[2];
    ASSERT_EQ(QuantizeRow(x.data(), 128, 0.96f, codes, params, isa), RowQuantStatus::kOk);
    float deq[128];
    DequantizeRow(codes, params, 128, deq);
    const float scale = Fp16ToFp32(params[0]);
    for (float v : deq) EXPECT_LE(std::fabs(v), 123.0f + scale / 2 + 1e-3f);
  }
}

// Random rows of many shapes and distributions.
std::vector<float> RandomRow(std::mt19937& rng, uint32_t d, int kind) {
  std::vector<float> x(d);
  std::normal_distribution<float> n01(0, 1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (uint32_t j = 0; j < d; ++j) {
    switch (kind % 7) {
      case 0:
        x[j] = n01(rng);
        break;
      case 1:  // heavy tail / outliers
        x[j] = n01(rng) * (rng() % 16 == 0 ? 40.0f : 1.0f);
        break;
      case 2:  // tiny magnitudes (fp16 subnormal range)
        x[j] = n01(rng) * 1e-6f;
        break;
      case 3:  // many duplicates / ties
        x[j] = static_cast<float>(static_cast<int>(rng() % 5) - 2) * 0.25f;
        break;
      case 4:  // large but within fp16
        x[j] = u(rng) * 20000.0f;
        break;
      case 5:  // positive offset
        x[j] = 3.0f + u(rng);
        break;
      default:  // with zeros and signed zeros
        x[j] = rng() % 3 == 0 ? (rng() % 2 ? -0.0f : 0.0f) : n01(rng);
        break;
    }
  }
  return x;
}

TEST(QuantizeTest, Avx2BitIdenticalToScalarManyShapes) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "CPU without AVX2/FMA/F16C: only the scalar path exists";
  std::mt19937 rng(42);
  uint64_t rows = 0;
  for (uint32_t d : {8u, 16u, 32u, 64u, 128u, 256u, 512u, 1024u}) {
    const uint32_t ng = d / std::min(d, 128u);
    for (float ratio : {0.0f, 0.96f, 0.92f, 0.5f, 1.0f, 0.05f, 0.999f}) {
      for (int kind = 0; kind < 7; ++kind) {
        for (int rep = 0; rep < 20; ++rep) {
          auto x = RandomRow(rng, d, kind);
          std::vector<uint8_t> c1(d / 4), c2(d / 4);
          std::vector<uint16_t> p1(2 * ng), p2(2 * ng);
          auto s1 = QuantizeRow(x.data(), d, ratio, c1.data(), p1.data(), KernelIsa::kScalar);
          auto s2 = QuantizeRow(x.data(), d, ratio, c2.data(), p2.data(), KernelIsa::kAvx2);
          ASSERT_EQ(s1, s2) << d << " " << ratio << " " << kind;
          ASSERT_EQ(c1, c2) << d << " " << ratio << " " << kind;
          ASSERT_EQ(p1, p2) << d << " " << ratio << " " << kind;
          ++rows;
        }
      }
    }
  }
  EXPECT_EQ(rows, 8u * 7 * 7 * 20);
}

// Rows for the selection test: many ties, bf16-rounded values, and adversarial layouts where
// one 8-element lane (j % 8 == lane) holds all the large magnitudes (the AVX2 selection's
// exactness check then fails and its exact fallback runs).
std::vector<float> SelectionRow(std::mt19937& rng, uint32_t d, int kind) {
  std::vector<float> x(d);
  std::normal_distribution<float> n01(0, 1);
  const uint32_t lane = rng() % 8;
  for (uint32_t j = 0; j < d; ++j) {
    switch (kind % 8) {
      case 0:  // few distinct magnitudes: heavy ties everywhere, also at τ
        x[j] = static_cast<float>(static_cast<int>(rng() % 7) - 3) * 0.5f;
        break;
      case 1:  // bf16-rounded Gaussian (ties among the largest magnitudes)
        x[j] = Bf16ToFp32(Fp32ToBf16(n01(rng)));
        break;
      case 2:  // all large magnitudes in one lane
        x[j] = j % 8 == lane ? 100.0f + static_cast<float>(rng() % 50) : n01(rng);
        break;
      case 3:  // one lane, all tied at the top
        x[j] = j % 8 == lane ? (rng() % 2 ? -7.0f : 7.0f) : 0.25f * n01(rng);
        break;
      case 4:  // equal magnitudes, random signs, some signed zeros
        x[j] = rng() % 5 == 0 ? (rng() % 2 ? -0.0f : 0.0f) : (rng() % 2 ? -2.0f : 2.0f);
        break;
      case 5:  // two lanes share the outliers, integer-valued (ties)
        x[j] = (j % 8 == lane || j % 8 == (lane + 3) % 8) ? static_cast<float>(rng() % 4 + 10)
                                                          : static_cast<float>(rng() % 3);
        break;
      case 6:  // subnormal and tiny magnitudes
        x[j] = BitsToFloat(static_cast<uint32_t>(rng() % 64) | (rng() % 2 ? 0x80000000u : 0u));
        break;
      default:
        x[j] = n01(rng) * (rng() % 16 == 0 ? 30.0f : 1.0f);
        break;
    }
  }
  return x;
}

TEST(QuantizeTest, ClipSelectionMatchesFullSortWithTies) {
  std::mt19937 rng(2024);
  std::uniform_real_distribution<float> any_ratio(0.0f, 1.0f);
  uint64_t rows = 0, fallback_layouts = 0;
  for (uint32_t d : {8u, 16u, 32u, 64u, 128u, 256u, 512u, 1024u}) {
    for (int kind = 0; kind < 8; ++kind) {
      for (int rep = 0; rep < 40; ++rep) {
        const auto x = SelectionRow(rng, d, kind);
        std::vector<float> mag(d);
        for (uint32_t j = 0; j < d; ++j) mag[j] = std::fabs(x[j]);
        std::sort(mag.begin(), mag.end());  // the definition: sorted ascending, index
        for (float ratio :
             {1.0f, 0.999f, 0.96f, 0.92f, 0.75f, 0.5f, 0.05f, 1e-6f, any_ratio(rng)}) {
          const float expect = mag[ClipIndex(ratio, d)];
          for (KernelIsa isa : Isas()) {
            const float got = ClipThreshold(x.data(), d, ratio, isa);
            ASSERT_EQ(FloatBits(got), FloatBits(expect))
                << IsaName(isa) << " d=" << d << " kind=" << kind << " ratio=" << ratio;
          }
          ++rows;
          if (kind == 2 || kind == 3 || kind == 5) ++fallback_layouts;
        }
        for (KernelIsa isa : Isas()) {
          EXPECT_TRUE(std::isinf(ClipThreshold(x.data(), d, 0.0f, isa)));
        }
      }
    }
  }
  EXPECT_EQ(rows, 8u * 8 * 40 * 9);
  EXPECT_EQ(fallback_layouts, 8u * 3 * 40 * 9);
}

// Elements placed exactly on, and a few ulps around, the code boundaries mn16 + (k − ½)·scale16
// (in u = x − mn16 as well as in x), over many magnitudes, including groups whose |mn16| is
// far larger than their range (where fl(x − mn16) is coarse): the AVX2 compare-based codes
// must equal the scalar division-based ones.
TEST(QuantizeTest, Avx2CodesAtLevelBoundariesEqualScalar) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "CPU without AVX2/FMA/F16C: only the scalar path exists";
  std::mt19937 rng(77);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  uint64_t rows = 0;
  for (uint32_t d : {32u, 64u, 128u, 256u}) {
    const uint32_t G = std::min(d, 128u);
    const uint32_t ng = d / G;
    for (int rep = 0; rep < 1500; ++rep) {
      const double scale = std::ldexp(1.0, static_cast<int>(rng() % 36) - 24);  // 2^-24 .. 2^11
      const double lo = (u01(rng) - 0.5) * 2.0 * std::min(60000.0, scale * (1 << (rng() % 20)));
      const double hi = lo + scale * (0.001 + 4.0 * u01(rng));
      const float mn = static_cast<float>(lo), mx = static_cast<float>(hi);
      if (!(mx > mn) || std::fabs(mx) > 60000.0f) continue;
      // The fp16 parameters exactly as FORMAT.md §2.3 (no clipping).
      const float mn16 = Fp16ToFp32(Fp32ToFp16(mn, RoundMode::kDown));
      const float sc = Fp16ToFp32(Fp32ToFp16((mx - mn16) / 3.0f, RoundMode::kUp));
      std::vector<float> cand;
      for (int k = 0; k < 3; ++k) {
        const float p = (k + 0.5f) * sc;
        float v = mn16 + p;  // x on the boundary
        float w = p;         // u on the boundary: x with fl(x − mn16) near p
        for (int i = 0; i < 3; ++i) {
          v = std::nextafter(v, -INFINITY);
          w = std::nextafter(w, -INFINITY);
        }
        for (int i = 0; i < 7; ++i) {
          cand.push_back(v);
          cand.push_back(w + mn16);
          cand.push_back(std::nextafter(w + mn16, INFINITY));
          cand.push_back(std::nextafter(w + mn16, -INFINITY));
          v = std::nextafter(v, INFINITY);
          w = std::nextafter(w, INFINITY);
        }
      }
      std::vector<float> x(d);
      for (uint32_t g = 0; g < ng; ++g) {
        x[g * G] = mn;
        x[g * G + 1] = mx;
        for (uint32_t j = 2; j < G; ++j) {
          const float c = cand[rng() % cand.size()];
          x[g * G + j] = (c >= mn && c <= mx) ? c : mn;
        }
        std::shuffle(x.begin() + g * G, x.begin() + (g + 1) * G, rng);
      }
      for (float ratio : {0.0f, 0.96f, 0.92f}) {
        std::vector<uint8_t> c1(d / 4), c2(d / 4);
        std::vector<uint16_t> p1(2 * ng), p2(2 * ng);
        const auto s1 = QuantizeRow(x.data(), d, ratio, c1.data(), p1.data(), KernelIsa::kScalar);
        const auto s2 = QuantizeRow(x.data(), d, ratio, c2.data(), p2.data(), KernelIsa::kAvx2);
        ASSERT_EQ(s1, s2);
        ASSERT_EQ(c1, c2) << "d=" << d << " mn=" << mn << " mx=" << mx << " ratio=" << ratio;
        ASSERT_EQ(p1, p2) << "d=" << d << " mn=" << mn << " mx=" << mx << " ratio=" << ratio;
        if (ratio == 0.0f && s1 == RowQuantStatus::kOk) {
          ASSERT_EQ(p1[0], Fp32ToFp16(sc, RoundMode::kNearestEven)) << "test's fp16 rule drifted";
          ++rows;
        }
      }
    }
  }
  EXPECT_GT(rows, 4000u);
}

// The bf16-native AVX2 path (16-bit-lane statistics) against the scalar path on bf16 rows of
// every shape and ratio, including tie-heavy and adversarial layouts, overflow and NaN/Inf.
TEST(QuantizeTest, Bf16RowsAvx2BitIdenticalToScalar) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "CPU without AVX2/FMA/F16C: only the scalar path exists";
  std::mt19937 rng(4242);
  uint64_t rows = 0;
  for (uint32_t d : {8u, 16u, 32u, 64u, 128u, 256u, 512u, 1024u}) {
    const uint32_t ng = d / std::min(d, 128u);
    for (float ratio : {0.0f, 0.96f, 0.92f, 0.5f, 1.0f, 0.05f, 0.999f}) {
      for (int kind = 0; kind < 15; ++kind) {
        const uint64_t n = 5;
        std::vector<uint16_t> x(n * d);
        for (uint64_t r = 0; r < n; ++r) {
          const auto row = kind < 7 ? RandomRow(rng, d, kind) : SelectionRow(rng, d, kind - 7);
          for (uint32_t j = 0; j < d; ++j) x[r * d + j] = Fp32ToBf16(row[j]);
        }
        if (kind == 4) x[2 * d + 3] = Fp32ToBf16(70000.0f);  // fp16 overflow unless clipped
        std::vector<uint8_t> c1(n * d / 4), c2(n * d / 4);
        std::vector<uint16_t> p1(n * 2 * ng), p2(n * 2 * ng);
        QuantizeRowsResult r1, r2;
        ASSERT_TRUE(
            QuantizeRowsBf16(x.data(), n, d, ratio, c1.data(), p1.data(), &r1, KernelIsa::kScalar)
                .ok());
        ASSERT_TRUE(
            QuantizeRowsBf16(x.data(), n, d, ratio, c2.data(), p2.data(), &r2, KernelIsa::kAvx2)
                .ok());
        ASSERT_EQ(c1, c2) << d << " " << ratio << " " << kind;
        ASSERT_EQ(p1, p2) << d << " " << ratio << " " << kind;
        ASSERT_EQ(r1.overflow_rows, r2.overflow_rows);
        ASSERT_EQ(r1.overflow_groups, r2.overflow_groups);
        ++rows;
      }
      // NaN / ±inf: the same refusal and message from both paths
      for (uint16_t bad : {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}}) {
        std::vector<uint16_t> x(2 * d, Fp32ToBf16(0.5f));
        x[d + d / 2] = bad;
        std::vector<uint8_t> c(2 * d / 4);
        std::vector<uint16_t> p(2 * 2 * ng);
        const absl::Status s1 = QuantizeRowsBf16(x.data(), 2, d, ratio, c.data(), p.data(), nullptr,
                                                 KernelIsa::kScalar);
        const absl::Status s2 =
            QuantizeRowsBf16(x.data(), 2, d, ratio, c.data(), p.data(), nullptr, KernelIsa::kAvx2);
        ASSERT_EQ(s1.code(), absl::StatusCode::kInvalidArgument);
        ASSERT_EQ(s1, s2);
      }
    }
  }
  EXPECT_EQ(rows, 8u * 7 * 15);
}

// Every clip count k = d − ClipIndex(ratio, d) from 1 to 40 on bf16 rows, in calls of 7 rows
// (a full batch of 4, then a short one of 3) that mix the AVX2 selection's outcomes within a
// batch: Gaussian rows (lane lists exact), rows whose largest magnitudes all sit in one 16-lane
// (the lists overflow: deeper lists, then the exact selection), rows with a few tied outliers in
// one lane, tie-heavy rows and rows with outliers; k > 32 takes the exact selection directly.
TEST(QuantizeTest, Bf16BatchSelectionEveryClipCount) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "CPU without AVX2/FMA/F16C: only the scalar path exists";
  std::mt19937 rng(777);
  std::normal_distribution<float> n01(0, 1);
  uint64_t rows = 0;
  for (uint32_t d : {32u, 64u, 128u, 256u, 1024u}) {
    const uint32_t ng = d / std::min(d, 128u);
    for (uint32_t k = 1; k <= std::min(d, 40u); ++k) {
      const float ratio = (static_cast<float>(d - k) + 0.5f) / static_cast<float>(d);
      ASSERT_EQ(d - ClipIndex(ratio, d), k) << d << " " << k;
      const uint64_t n = 7;
      std::vector<uint16_t> x(n * d);
      for (uint64_t r = 0; r < n; ++r) {
        const uint32_t lane = rng() % 16;
        for (uint32_t j = 0; j < d; ++j) {
          float v = n01(rng);
          switch (r) {
            case 1:  // one lane holds all the largest magnitudes (distinct)
              if (j % 16 == lane) v = (rng() % 2 ? -1.0f : 1.0f) * (100.0f + static_cast<float>(j));
              break;
            case 3:  // four tied outliers in one lane
              if (j % 16 == lane && j < 64) v = rng() % 2 ? -50.0f : 50.0f;
              break;
            case 4:  // few distinct magnitudes
              v = static_cast<float>(static_cast<int>(rng() % 5) - 2) * 0.5f;
              break;
            case 5:  // sparse outliers
              v *= rng() % 16 == 0 ? 30.0f : 1.0f;
              break;
            default:
              break;
          }
          x[r * d + j] = Fp32ToBf16(v);
        }
      }
      std::vector<uint8_t> c1(n * d / 4), c2(n * d / 4);
      std::vector<uint16_t> p1(n * 2 * ng), p2(n * 2 * ng);
      ASSERT_TRUE(
          QuantizeRowsBf16(x.data(), n, d, ratio, c1.data(), p1.data(), nullptr, KernelIsa::kScalar)
              .ok());
      ASSERT_TRUE(
          QuantizeRowsBf16(x.data(), n, d, ratio, c2.data(), p2.data(), nullptr, KernelIsa::kAvx2)
              .ok());
      ASSERT_EQ(c1, c2) << "d=" << d << " k=" << k;
      ASSERT_EQ(p1, p2) << "d=" << d << " k=" << k;
      rows += n;
    }
  }
  EXPECT_EQ(rows, 7u * (32 + 4 * 40));
}

// bf16 rows whose values sit on and around the code boundaries in x (bf16 neighbours of
// mn16 + (k − ½)·scale16), including symmetric groups whose middle boundary is ~0 (where the
// boundary's fp32 rounding grid is coarser than bf16), tiny values at ±2^-23·|mn16| and
// signed zeros, with and without clipping: the AVX2 key-compare codes must equal the scalar
// division-based ones.
TEST(QuantizeTest, Bf16CodesAtLevelBoundariesEqualScalar) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "CPU without AVX2/FMA/F16C: only the scalar path exists";
  std::mt19937 rng(99);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  auto bf16_step = [](float v, int steps) {  // move by bf16 steps in value order
    uint16_t b = Fp32ToBf16(v);
    for (int i = 0; i < std::abs(steps); ++i) {
      const float f = Bf16ToFp32(b);
      const bool up = steps > 0;
      if (f == 0.0f) {
        b = up ? 0x0001 : 0x8001;
      } else if ((f > 0) == up) {
        ++b;
      } else {
        --b;
      }
    }
    return Bf16ToFp32(b);
  };
  uint64_t rows = 0;
  for (uint32_t d : {64u, 128u, 256u}) {
    const uint32_t G = std::min(d, 128u);
    const uint32_t ng = d / G;
    for (int rep = 0; rep < 600; ++rep) {
      const double scale = std::ldexp(1.0, static_cast<int>(rng() % 30) - 20);
      // every third group symmetric with mx = 3·2^e: mn16 = −mx exactly, scale16 = 2^(e+1),
      // so the middle boundary in u is exactly −mn16 and its x boundary is an exact tie at
      // −2^(e−22) (rounding of fl(x − mn16) to even decides)
      float mx = rep % 3 == 0
                     ? std::ldexp(3.0f, static_cast<int>(rng() % 24) - 16)
                     : Bf16ToFp32(Fp32ToBf16(static_cast<float>(scale * (0.5 + 8 * u01(rng)))));
      float mn =
          rep % 3 == 0
              ? -mx  // symmetric: middle boundary near 0
              : Bf16ToFp32(Fp32ToBf16(static_cast<float>(mx - scale * (0.01 + 8 * u01(rng)))));
      if (!(mx > mn)) continue;
      const float mn16 = Fp16ToFp32(Fp32ToFp16(mn, RoundMode::kDown));
      const float sc = Fp16ToFp32(Fp32ToFp16((mx - mn16) / 3.0f, RoundMode::kUp));
      std::vector<float> cand = {0.0f, -0.0f};
      for (int k = 0; k < 3; ++k) {
        const float b = mn16 + (k + 0.5f) * sc;
        for (int st = -3; st <= 3; ++st) cand.push_back(bf16_step(b, st));
      }
      for (int k = 0; k < 3; ++k) {
        for (int e : {16, 22, 23, 24, 25}) {  // half-ulps of the u boundary, both signs
          const float t = std::ldexp((k + 0.5f) * sc, -e);
          for (int st = -1; st <= 1; ++st) {
            cand.push_back(bf16_step(t, st));
            cand.push_back(bf16_step(-t, st));
          }
        }
      }
      std::vector<uint16_t> x(d);
      for (uint32_t g = 0; g < ng; ++g) {
        x[g * G] = Fp32ToBf16(mn);
        x[g * G + 1] = Fp32ToBf16(mx);
        for (uint32_t j = 2; j < G; ++j) {
          const float c = cand[rng() % cand.size()];
          x[g * G + j] = Fp32ToBf16((c >= mn && c <= mx) ? c : mn);
        }
        std::shuffle(x.begin() + g * G, x.begin() + (g + 1) * G, rng);
      }
      for (float ratio : {0.0f, 0.96f, 0.92f, 0.5f}) {
        std::vector<uint8_t> c1(d / 4), c2(d / 4);
        std::vector<uint16_t> p1(2 * ng), p2(2 * ng);
        ASSERT_TRUE(QuantizeRowsBf16(x.data(), 1, d, ratio, c1.data(), p1.data(), nullptr,
                                     KernelIsa::kScalar)
                        .ok());
        ASSERT_TRUE(
            QuantizeRowsBf16(x.data(), 1, d, ratio, c2.data(), p2.data(), nullptr, KernelIsa::kAvx2)
                .ok());
        ASSERT_EQ(c1, c2) << "d=" << d << " mn=" << mn << " mx=" << mx << " ratio=" << ratio;
        ASSERT_EQ(p1, p2) << "d=" << d << " mn=" << mn << " mx=" << mx << " ratio=" << ratio;
        ++rows;
      }
    }
  }
  EXPECT_GT(rows, 5000u);
}

TEST(QuantizeTest, DequantAvx2BitIdenticalToScalar) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "CPU without AVX2/FMA/F16C: only the scalar path exists";
  std::mt19937 rng(31);
  for (uint32_t d : {8u, 16u, 32u, 64u, 128u, 256u, 512u, 1024u}) {
    const uint32_t ng = d / std::min(d, 128u);
    for (uint64_t n : {1ull, 3ull, 17ull}) {
      std::vector<uint8_t> codes(n * d / 4);
      std::vector<uint16_t> params(n * 2 * ng);
      for (auto& c : codes) c = static_cast<uint8_t>(rng());
      for (auto& p : params) {
        // any finite fp16 (normal, subnormal, ±0, either sign; also the largest ones)
        do {
          p = static_cast<uint16_t>(rng());
        } while (Fp16IsNonFinite(p));
      }
      std::vector<float> a(n * d), b(n * d), one(d);
      DequantizeRows(codes.data(), params.data(), n, d, a.data(), KernelIsa::kScalar);
      DequantizeRows(codes.data(), params.data(), n, d, b.data(), KernelIsa::kAvx2);
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(FloatBits(a[i]), FloatBits(b[i])) << "d=" << d << " i=" << i;
      }
      // the single-row entry point and the definition out = mn16 + code·scale16
      const uint64_t r = n - 1;
      DequantizeRow(codes.data() + r * d / 4, params.data() + r * 2 * ng, d, one.data());
      std::vector<uint8_t> unpacked(d);
      UnpackCodes(codes.data() + r * d / 4, d, unpacked.data());
      for (uint32_t j = 0; j < d; ++j) {
        const uint32_t g = j / std::min(d, 128u);
        const float scale = Fp16ToFp32(params[r * 2 * ng + 2 * g]);
        const float mn = Fp16ToFp32(params[r * 2 * ng + 2 * g + 1]);
        const float expect = mn + static_cast<float>(unpacked[j]) * scale;
        ASSERT_EQ(FloatBits(one[j]), FloatBits(expect)) << "d=" << d << " j=" << j;
        ASSERT_EQ(FloatBits(one[j]), FloatBits(a[r * d + j]));
      }
    }
  }
}

TEST(QuantizeTest, DequantErrorWithinHalfScaleOnNonClippedElements) {
  std::mt19937 rng(7);
  for (KernelIsa isa : Isas()) {
    for (uint32_t d : {8u, 64u, 128u, 256u}) {
      const uint32_t G = std::min(d, 128u);
      for (float ratio : {0.0f, 0.96f, 0.92f}) {
        for (int kind = 0; kind < 7; ++kind) {
          for (int rep = 0; rep < 30; ++rep) {
            auto x = RandomRow(rng, d, kind);
            std::vector<uint8_t> c(d / 4);
            std::vector<uint16_t> p(2 * d / G);
            ASSERT_EQ(QuantizeRow(x.data(), d, ratio, c.data(), p.data(), isa),
                      RowQuantStatus::kOk);
            std::vector<float> deq(d);
            DequantizeRow(c.data(), p.data(), d, deq.data());
            const float tau = ClipThreshold(x.data(), d, ratio);
            for (uint32_t j = 0; j < d; ++j) {
              if (std::fabs(x[j]) > tau) continue;  // clipped element
              const uint32_t g = j / G;
              const float scale = Fp16ToFp32(p[2 * g]);
              const float mn = Fp16ToFp32(p[2 * g + 1]);
              if (scale == 0.0f) {
                // degenerate group: dequantizes to fp16↓(value)
                ASSERT_EQ(deq[j], mn);
                continue;
              }
              // scale16/2, plus the fp32 rounding of the quotient (a few ulps of the level)
              const double slack =
                  4.0 * std::ldexp(1.0, std::ilogb(std::fabs(mn) + 3.0 * scale) - 23);
              ASSERT_LE(std::fabs(static_cast<double>(deq[j]) - x[j]), scale / 2.0 + slack)
                  << "d=" << d << " j=" << j << " kind=" << kind;
            }
          }
        }
      }
    }
  }
}

TEST(QuantizeTest, DegenerateRows) {
  for (KernelIsa isa : Isas()) {
    for (uint32_t d : {8u, 128u, 256u}) {
      const uint32_t ng = d / std::min(d, 128u);
      std::vector<uint8_t> c(d / 4, 0xff);
      std::vector<uint16_t> p(2 * ng, 0xffff);
      std::vector<float> deq(d);
      // all-zero -> exactly zero, zero params
      std::vector<float> zero(d, 0.0f);
      ASSERT_EQ(QuantizeRow(zero.data(), d, 0.96f, c.data(), p.data(), isa), RowQuantStatus::kOk);
      DequantizeRow(c.data(), p.data(), d, deq.data());
      for (float v : deq) ASSERT_EQ(v, 0.0f);
      for (uint16_t v : p) ASSERT_EQ(v, 0);
      // all-equal representable -> exact
      std::vector<float> eq(d, 1.5f);
      ASSERT_EQ(QuantizeRow(eq.data(), d, 0.96f, c.data(), p.data(), isa), RowQuantStatus::kOk);
      DequantizeRow(c.data(), p.data(), d, deq.data());
      for (float v : deq) ASSERT_EQ(v, 1.5f);
      // all-equal not representable -> fp16 rounded down
      std::vector<float> tenth(d, 0.1f);
      ASSERT_EQ(QuantizeRow(tenth.data(), d, 0.0f, c.data(), p.data(), isa), RowQuantStatus::kOk);
      DequantizeRow(c.data(), p.data(), d, deq.data());
      const float down = Fp16ToFp32(Fp32ToFp16(0.1f, RoundMode::kDown));
      EXPECT_LT(down, 0.1f);
      for (float v : deq) ASSERT_EQ(v, down);
    }
  }
}

TEST(QuantizeTest, NonFiniteRefusedAndNamed) {
  for (KernelIsa isa : Isas()) {
    std::vector<float> x(128, 1.0f);
    uint8_t c[64];
    uint16_t p[4];
    x[17] = NAN;
    EXPECT_EQ(QuantizeRow(x.data(), 128, 0.96f, c, p, isa), RowQuantStatus::kNonFinite);
    x[17] = -INFINITY;
    EXPECT_EQ(QuantizeRow(x.data(), 128, 0.96f, c, p, isa), RowQuantStatus::kNonFinite);
    std::vector<float> rows(4 * 128, 0.5f);
    rows[3 * 128 + 17] = NAN;
    std::vector<uint8_t> codes(4 * 32);
    std::vector<uint16_t> params(4 * 2);
    absl::Status s =
        QuantizeRows(rows.data(), 4, 128, 0.96f, codes.data(), params.data(), nullptr, isa);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("row 3 element 17 is nan"), std::string::npos) << s;
  }
}

TEST(QuantizeTest, Fp16OverflowIsCountedNotStored) {
  for (KernelIsa isa : Isas()) {
    std::vector<float> rows(3 * 128, 0.5f);
    for (int j = 0; j < 128; ++j) rows[128 + j] = j * 1000.0f;  // row 1 reaches 127000 > 65504
    rows[2 * 128 + 5] = -70000.0f;                              // row 2: min below -65504
    std::vector<uint8_t> codes(3 * 32, 0xaa);
    std::vector<uint16_t> params(3 * 2, 0xaaaa);
    QuantizeRowsResult r;
    // ratio 0: no clipping, so the outliers survive
    ASSERT_TRUE(QuantizeRows(rows.data(), 3, 128, 0.0f, codes.data(), params.data(), &r, isa).ok());
    EXPECT_EQ(r.overflow_rows, 2u);
    EXPECT_EQ(r.overflow_groups, 2u);
    EXPECT_EQ(r.first_overflow_row, 1);
    for (int j = 32; j < 96; ++j) EXPECT_EQ(codes[j], 0);
    for (int j = 2; j < 6; ++j) EXPECT_EQ(params[j], 0);
    // with K clipping the 5 largest of row 2 (only one outlier) the row fits again
    ASSERT_TRUE(
        QuantizeRows(rows.data(), 3, 128, 0.96f, codes.data(), params.data(), &r, isa).ok());
    EXPECT_EQ(r.overflow_rows, 1u);
  }
}

TEST(QuantizeTest, BadArgumentsNamed) {
  std::vector<float> x(16, 0.0f);
  uint8_t c[8];
  uint16_t p[2];
  absl::Status s = QuantizeRows(x.data(), 1, 12, 0.96f, c, p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("head_dim"), std::string::npos);
  s = QuantizeRows(x.data(), 1, 16, 1.5f, c, p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("clip_ratio"), std::string::npos);
  s = QuantizeRows(x.data(), 1, 16, NAN, c, p, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateHeadDim(4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateHeadDim(2048).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateHeadDim(128).ok());
}

std::vector<float> RandomOrthogonalish(std::mt19937& rng, uint32_t d) {
  std::vector<float> r(d * d);
  std::normal_distribution<float> n01(0, 1.0f / std::sqrt(static_cast<float>(d)));
  for (auto& v : r) v = n01(rng);
  return r;
}

TEST(QuantizeTest, RotationAvx2BitIdenticalAndAccurate) {
  std::mt19937 rng(5);
  for (uint32_t d : {8u, 16u, 64u, 128u, 256u}) {
    for (uint64_t n : {1ull, 2ull, 5ull, 6ull, 13ull, 16ull}) {
      auto R = RandomOrthogonalish(rng, d);
      std::vector<float> x(n * d);
      std::normal_distribution<float> n01(0, 1);
      for (auto& v : x) v = n01(rng);
      std::vector<float> a(n * d), b(n * d);
      RotateRows(x.data(), n, d, R.data(), a.data(), KernelIsa::kScalar);
      if (CpuHasAvx2()) {
        RotateRows(x.data(), n, d, R.data(), b.data(), KernelIsa::kAvx2);
        ASSERT_EQ(a, b) << d << " " << n;
      }
      for (uint64_t r = 0; r < n; ++r) {
        for (uint32_t j = 0; j < d; ++j) {
          double ref = 0, mag = 0;
          for (uint32_t i = 0; i < d; ++i) {
            ref += static_cast<double>(x[r * d + i]) * R[i * d + j];
            mag += std::fabs(static_cast<double>(x[r * d + i]) * R[i * d + j]);
          }
          ASSERT_NEAR(a[r * d + j], ref, 1e-6 * mag + 1e-30);
        }
      }
    }
  }
}

TEST(QuantizeTest, FusedRotateQuantizeMatchesSteps) {
  std::mt19937 rng(9);
  const uint32_t d = 128;
  const uint64_t n = 37;
  auto R = RandomOrthogonalish(rng, d);
  std::vector<uint16_t> x(n * d);
  std::normal_distribution<float> n01(0, 2);
  for (auto& v : x) v = Fp32ToBf16(n01(rng));
  for (KernelIsa isa : Isas()) {
    std::vector<uint16_t> rot_bf16(n * d);
    std::vector<uint8_t> codes(n * d / 4), codes2(n * d / 4);
    std::vector<uint16_t> params(n * 2), params2(n * 2);
    ASSERT_TRUE(RotateQuantizeRowsBf16(x.data(), n, d, R.data(), 0.96f, rot_bf16.data(),
                                       codes.data(), params.data(), nullptr, isa)
                    .ok());
    std::vector<float> rot(n * d);
    RotateRowsBf16(x.data(), n, d, R.data(), rot.data(), KernelIsa::kScalar);
    std::vector<uint16_t> expect_bf16(n * d);
    for (size_t i = 0; i < rot.size(); ++i) expect_bf16[i] = Fp32ToBf16(rot[i]);
    ASSERT_EQ(rot_bf16, expect_bf16);
    ASSERT_TRUE(QuantizeRowsBf16(expect_bf16.data(), n, d, 0.96f, codes2.data(), params2.data(),
                                 nullptr, KernelIsa::kScalar)
                    .ok());
    EXPECT_EQ(codes, codes2);
    EXPECT_EQ(params, params2);
  }
}

}  // namespace
}  // namespace kvpool
