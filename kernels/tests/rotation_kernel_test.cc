// The AVX2 rotation kernels (register-blocked 6-row × 16-column tiles over a row-major R for few
// rows, over R packed into column panels from internal::kRotatePackMinRows rows on, with the
// bf16 rounding fused into the tile's stores, and the quantizer software-pipelined between the
// column slabs of RotateQuantizeRowsBf16) against the scalar reference path, bit for bit, over
// head dims 8..1024, row counts on both sides of the packing threshold and of every row block
// (6, 4, 2, 1) and tile size, unaligned row pointers, and rows that overflow fp16 or are
// non-finite.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kvpool/kernels/numeric.h"
#include "kvpool/kernels/quantize.h"

namespace kvpool {
namespace {

std::vector<float> RandomMatrix(std::mt19937& rng, uint32_t d) {
  std::vector<float> r(size_t{d} * d);
  std::normal_distribution<float> n01(0, 1.0f / std::sqrt(static_cast<float>(d)));
  for (auto& v : r) v = n01(rng);
  return r;
}

// Bitwise equality of float vectors (−0 vs +0 and NaN payloads count).
::testing::AssertionResult SameBits(const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t ua, ub;
    std::memcpy(&ua, a + i, 4);
    std::memcpy(&ub, b + i, 4);
    if (ua != ub) {
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " (0x" << std::hex
                                           << ua << ") vs " << b[i] << " (0x" << ub << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

const uint64_t kRowCounts[] = {1, 2, 3, 5, 6, 7, 11, 23, 24, 25, 47, 63, 64, 65, 71, 97, 150};

TEST(RotationKernelTest, RotateRowsAvx2MatchesScalarOverShapes) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "no AVX2 on this CPU: only the scalar path exists";
  std::mt19937 rng(17);
  for (uint32_t d : {8u, 16u, 32u, 64u, 128u, 256u, 512u, 1024u}) {
    const auto R = RandomMatrix(rng, d);
    for (uint64_t n : kRowCounts) {
      if (d >= 512 && n != 1 && n != 7 && n != 65) continue;  // keep the scalar reference quick
      // one extra leading element: rows start 4 bytes past the allocation (unaligned)
      std::vector<float> x(n * d + 1), a(n * d + 1), b(n * d + 1, -7.0f);
      std::normal_distribution<float> n01(0, 1);
      for (auto& v : x) v = n01(rng);
      RotateRows(x.data() + 1, n, d, R.data(), a.data() + 1, KernelIsa::kScalar);
      RotateRows(x.data() + 1, n, d, R.data(), b.data() + 1, KernelIsa::kAvx2);
      ASSERT_TRUE(SameBits(a.data() + 1, b.data() + 1, n * d)) << "d=" << d << " n=" << n;
      ASSERT_EQ(b[0], -7.0f) << "wrote before the output, d=" << d << " n=" << n;
    }
  }
}

// The scalar reference really is Σ_i x_i·R_ij in the stated fma order (so the AVX2 equality
// above is against the documented operation order, not only another implementation).
TEST(RotationKernelTest, ScalarPathIsTheDocumentedFmaOrder) {
  std::mt19937 rng(3);
  const uint32_t d = 64;
  const uint64_t n = 9;
  const auto R = RandomMatrix(rng, d);
  std::vector<float> x(n * d), out(n * d);
  std::normal_distribution<float> n01(0, 1);
  for (auto& v : x) v = n01(rng);
  RotateRows(x.data(), n, d, R.data(), out.data(), KernelIsa::kScalar);
  for (uint64_t r = 0; r < n; ++r) {
    for (uint32_t j = 0; j < d; ++j) {
      float acc = 0.0f;
      for (uint32_t i = 0; i < d; ++i) acc = std::fma(x[r * d + i], R[i * d + j], acc);
      ASSERT_TRUE(SameBits(&acc, &out[r * d + j], 1)) << r << " " << j;
    }
  }
}

struct FusedOut {
  std::vector<uint16_t> rotated;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> params;
  QuantizeRowsResult result;
  absl::Status status;
};

FusedOut RunFused(const std::vector<uint16_t>& x, uint64_t n, uint32_t d,
                  const std::vector<float>& R, float ratio, bool keep_rotated, KernelIsa isa) {
  const uint32_t ng = d / std::min<uint32_t>(d, 128);
  FusedOut o;
  o.rotated.assign(n * d + 1, 0xABCD);
  o.codes.assign(n * d / 4, 0xEE);
  o.params.assign(n * 2 * ng, 0xEEEE);
  o.status = RotateQuantizeRowsBf16(x.data() + 1, n, d, R.data(), ratio,
                                    keep_rotated ? o.rotated.data() + 1 : nullptr, o.codes.data(),
                                    o.params.data(), &o.result, isa);
  return o;
}

TEST(RotationKernelTest, FusedRotateQuantizeAvx2MatchesScalarOverShapes) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "no AVX2 on this CPU: only the scalar path exists";
  std::mt19937 rng(29);
  int overflow_cases = 0;
  for (uint32_t d : {8u, 16u, 32u, 64u, 128u, 256u, 512u, 1024u}) {
    const auto R = RandomMatrix(rng, d);
    for (uint64_t n : kRowCounts) {
      if (d >= 512 && n != 1 && n != 7 && n != 65) continue;  // keep the scalar reference quick
      std::vector<uint16_t> x(n * d + 1);
      std::normal_distribution<float> n01(0, 2);
      for (auto& v : x) v = Fp32ToBf16(n01(rng));
      // a row whose rotation overflows fp16 (kept as BF16, counted) in the middle of the call
      if (n >= 3) {
        for (uint32_t j = 0; j < d; ++j) x[1 + (n / 2) * d + j] = Fp32ToBf16(3.0e5f);
      }
      // the bf16 form must be bf16(x·R) of the scalar fp32 rotation
      std::vector<float> wide(n * d), rot(n * d);
      for (size_t i = 0; i < n * d; ++i) wide[i] = Bf16ToFp32(x[1 + i]);
      RotateRows(wide.data(), n, d, R.data(), rot.data(), KernelIsa::kScalar);
      // K clip with the rotated form kept, V clip without it, no clipping
      const std::pair<float, bool> cases[] = {{0.96f, true}, {0.92f, false}, {0.0f, true}};
      for (const auto& [ratio, keep] : cases) {
        const FusedOut s = RunFused(x, n, d, R, ratio, keep, KernelIsa::kScalar);
        const FusedOut v = RunFused(x, n, d, R, ratio, keep, KernelIsa::kAvx2);
        const std::string where = "d=" + std::to_string(d) + " n=" + std::to_string(n) +
                                  " ratio=" + std::to_string(ratio) +
                                  " keep=" + std::to_string(keep);
        ASSERT_TRUE(s.status.ok()) << s.status << " " << where;
        ASSERT_TRUE(v.status.ok()) << v.status << " " << where;
        ASSERT_EQ(s.rotated, v.rotated) << where;
        ASSERT_EQ(s.codes, v.codes) << where;
        ASSERT_EQ(s.params, v.params) << where;
        ASSERT_EQ(s.result.overflow_rows, v.result.overflow_rows) << where;
        ASSERT_EQ(s.result.overflow_groups, v.result.overflow_groups) << where;
        ASSERT_EQ(s.result.first_overflow_row, v.result.first_overflow_row) << where;
        if (n >= 3) {
          // the 3e5 row overflows fp16 whatever the rotation (|x·R| ~ 3e5·‖R‖ spread)
          EXPECT_GE(v.result.overflow_rows, 1u) << where;
          overflow_cases += v.result.overflow_rows > 0;
        }
        if (keep) {
          ASSERT_EQ(v.rotated[0], 0xABCD) << "wrote before rotated_bf16, " << where;
          for (size_t i = 0; i < n * d; ++i) {
            ASSERT_EQ(v.rotated[1 + i], Fp32ToBf16(rot[i])) << where << " element " << i;
          }
        }
      }
    }
  }
  EXPECT_GT(overflow_cases, 0);
}

// A NaN input row, and a finite row whose rotation overflows fp32, after the first tiles (the
// AVX2 path reports a tile's rows only after rotating the next one): same error from both paths.
TEST(RotationKernelTest, FusedErrorsMatchScalarInLaterTiles) {
  if (!CpuHasAvx2()) GTEST_SKIP() << "no AVX2 on this CPU: only the scalar path exists";
  std::mt19937 rng(41);
  for (uint32_t d : {64u, 128u, 256u}) {
    const auto R = RandomMatrix(rng, d);
    for (uint64_t n : {40ull, 100ull}) {
      for (int kind = 0; kind < 2; ++kind) {
        std::vector<uint16_t> x(n * d + 1);
        std::normal_distribution<float> n01(0, 1);
        for (auto& v : x) v = Fp32ToBf16(n01(rng));
        const uint64_t bad = n - 3;
        if (kind == 0) {
          x[1 + bad * d + 5] = 0x7fc0;  // NaN
        } else {
          for (uint32_t j = 0; j < d; ++j) x[1 + bad * d + j] = Fp32ToBf16(3.0e38f);
        }
        const FusedOut s = RunFused(x, n, d, R, 0.96f, true, KernelIsa::kScalar);
        const FusedOut v = RunFused(x, n, d, R, 0.96f, true, KernelIsa::kAvx2);
        ASSERT_FALSE(s.status.ok()) << d << " " << n << " " << kind;
        EXPECT_EQ(s.status, v.status) << d << " " << n << " " << kind;
        EXPECT_NE(std::string(v.status.message()).find("row " + std::to_string(bad)),
                  std::string::npos)
            << v.status;
      }
    }
  }
}

}  // namespace
}  // namespace kvpool
