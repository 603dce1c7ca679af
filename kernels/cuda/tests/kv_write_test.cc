// GPU tests of the write kernels (LaunchQuantizeWrite, LaunchRotateWriteBf16, LaunchDemote)
// against the shared CPU quantizer (kvpool/kernels/quantize.h), plus one end-to-end check at
// production shape: write, demote as decode proceeds, attend, compare step by step with the
// CPU path. Label gpu; skipped when no device is present.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/cuda/kv_write.h"
#include "kvpool/kernels/cuda/paged_decode.h"
#include "kvpool/kernels/numeric.h"
#include "kvpool/kernels/quantize.h"

namespace kvpool::cuda::testing {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device"

struct WriteSetup {
  int n = 0, h = 0, d = 0, page = 16;
  int64_t page_offset = 0;
  std::vector<uint16_t> k, v;  // [n][h][d] bf16
  std::vector<int32_t> dst_page, dst_slot;
  int num_pages = 0;
};

WriteSetup MakeSetup(int n, int h, int d, int page, uint64_t seed, int64_t page_offset = 0) {
  WriteSetup s;
  s.n = n;
  s.h = h;
  s.d = d;
  s.page = page;
  s.page_offset = page_offset;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  s.k.resize(size_t(n) * h * d);
  s.v.resize(s.k.size());
  for (size_t i = 0; i < s.k.size(); ++i) {
    // heavy-ish tails so that clipping matters
    const double sk = ud(rng) < 0.02 ? 8.0 : 1.0, sv = ud(rng) < 0.02 ? 6.0 : 1.0;
    s.k[i] = ToBf16(nd(rng) * sk + 0.3);
    s.v[i] = ToBf16(nd(rng) * sv);
  }
  s.num_pages = (n + page - 1) / page;
  std::vector<int32_t> perm(s.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int t = 0; t < n; ++t) {
    s.dst_page.push_back(int32_t(perm[t / page] + page_offset));
    s.dst_slot.push_back(t % page);
  }
  return s;
}

// CPU expectation for one row (rotated values as fp32).
void CpuQuantRow(const std::vector<float>& x, float ratio, std::vector<uint8_t>* codes,
                 std::vector<uint16_t>* params, RowQuantStatus* st) {
  const int d = int(x.size());
  codes->assign(d / 4, 0);
  params->assign(2 * (d / std::min(d, 128)), 0);
  *st = QuantizeRow(x.data(), uint32_t(d), ratio, codes->data(), params->data());
}

struct Int2Row {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> params;
};

Int2Row ReadInt2Row(const std::vector<uint8_t>& pool, const BlockGeometry& geo, int64_t page,
                    int slot, int head, int kv) {
  const uint64_t base = uint64_t(page) * geo.Int2LayerBytes() + geo.Int2ChunkOffset(0, head);
  const int d = int(geo.head_dim), ng = int(geo.GroupsPerRow()), P = int(geo.page_size);
  Int2Row r;
  const uint8_t* c = pool.data() + base + (kv ? geo.Int2VCodesOffset() : 0) + slot * d / 4;
  r.codes.assign(c, c + d / 4);
  const uint16_t* p = reinterpret_cast<const uint16_t*>(
      pool.data() + base + (kv ? geo.Int2VParamsOffset() : geo.Int2KParamsOffset()) +
      slot * 4 * ng);
  r.params.assign(p, p + 2 * ng);
  (void)P;
  return r;
}

TEST(KvWrite, QuantizeOnlyMatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    for (int page : {16, 64}) {
      const int n = 1000 + d / 64;  // odd counts: partial chunks and pages
      WriteSetup s = MakeSetup(n, 3, d, page, 10 + d + page);
      const BlockGeometry geo{1, uint32_t(s.h), uint32_t(d), uint32_t(page)};
      DeviceBuffer dk, dv, dp, ds, flags(size_t(n) * s.h * 2), bad(4);
      Upload(dk, s.k);
      Upload(dv, s.v);
      Upload(dp, s.dst_page);
      Upload(ds, s.dst_slot);
      DeviceBuffer pool(size_t(s.num_pages) * geo.Int2LayerBytes());
      cudaMemset(pool.get(), 0xa5, pool.bytes());  // poison
      cudaMemset(flags.get(), 0x77, flags.bytes());
      cudaMemset(bad.get(), 0, 4);
      KvWriteParams p;
      p.num_tokens = n;
      p.num_kv_heads = s.h;
      p.head_dim = d;
      p.page_size = page;
      p.k = dk.as<uint16_t>();
      p.v = dv.as<uint16_t>();
      p.dst_page = dp.as<int32_t>();
      p.dst_slot = ds.as<int32_t>();
      p.dst = {pool.get(), geo.Int2LayerBytes()};
      p.row_flags = flags.as<uint8_t>();
      p.bad_rows = bad.as<uint32_t>();
      KernelStatus st = LaunchQuantizeWrite(p, nullptr);
      ASSERT_TRUE(st.ok()) << st.message;
      KVPOOL_CUDA_OK(cudaDeviceSynchronize());
      auto host = Download<uint8_t>(pool.get(), pool.bytes());
      auto fl = Download<uint8_t>(flags.get(), flags.bytes());
      int64_t mismatched_rows = 0, rows = 0;
      for (int t = 0; t < n; ++t) {
        for (int h = 0; h < s.h; ++h) {
          for (int kv = 0; kv < 2; ++kv) {
            const uint16_t* src = (kv ? s.v.data() : s.k.data()) + (size_t(t) * s.h + h) * d;
            std::vector<float> x(d);
            for (int j = 0; j < d; ++j) x[j] = Bf16ToFp32(src[j]);
            std::vector<uint8_t> codes;
            std::vector<uint16_t> params;
            RowQuantStatus rs;
            CpuQuantRow(x, kv ? 0.92f : 0.96f, &codes, &params, &rs);
            const Int2Row g = ReadInt2Row(host, geo, s.dst_page[t], s.dst_slot[t], h, kv);
            ++rows;
            if (g.codes != codes || g.params != params) ++mismatched_rows;
            EXPECT_EQ(fl[(size_t(t) * s.h + h) * 2 + kv], rs == RowQuantStatus::kOk ? 0 : 1);
          }
        }
      }
      std::printf("[quantize-only] d=%d page=%d rows=%lld mismatched=%lld\n", d, page,
                  (long long)rows, (long long)mismatched_rows);
      EXPECT_EQ(mismatched_rows, 0) << "d=" << d << " page=" << page;
      EXPECT_EQ(Download<uint32_t>(bad.get(), 1)[0], 0u);
    }
  }
}

// Every clip-threshold path of the kernel (no clipping; the top-8 sorting path; top-8 lists
// merged to 16 with its exactness check and the top-16 re-selection when the check fails; the
// bitwise count search for larger `need`) on rows full of exact ties (few distinct values, many
// equal magnitudes of both signs), rows whose largest values sit in one lane's columns, all-equal
// rows, all-zero rows and symmetric rows with values next to a tiny negative code threshold:
// bit-identical to the CPU quantizer, since the selection is exact on the multiset and the code
// thresholds are exact.
TEST(KvWrite, QuantizeOnlyClipRatiosAndTiesMatchCpu) {
  SKIP_WITHOUT_GPU();
  // (clip_k, clip_v): need = d - clamp(floor(ratio*d), 0, d-1) covers 0, 1, <= 8, <= 16, > 16.
  const std::pair<float, float> ratios[] = {
      {0.f, 1.f}, {0.97f, 0.875f}, {0.5f, 0.9f}, {0.25f, 0.999f}};
  for (int d : {64, 128, 256}) {
    for (const auto& [rk, rv] : ratios) {
      const int n = 203, H = 2, page = 16;
      WriteSetup s = MakeSetup(n, H, d, page, 3000 + d + int(rk * 100) + int(rv * 1000));
      std::mt19937_64 rng(4000 + d);
      std::uniform_int_distribution<int> pick(-3, 3), kind(0, 9);
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < H; ++h)
          for (int kv = 0; kv < 2; ++kv) {
            uint16_t* row = (kv ? s.v.data() : s.k.data()) + (size_t(t) * H + h) * d;
            const int k = kind(rng);
            if (k < 5) {  // ties: 7 distinct values, scaled
              const double sc = k == 0 ? 1e-3 : (k == 1 ? 37.0 : 1.0);
              for (int j = 0; j < d; ++j) row[j] = ToBf16(pick(rng) * sc);
            } else if (k == 5) {  // all equal
              for (int j = 0; j < d; ++j) row[j] = ToBf16(-1.5);
            } else if (k == 6) {  // all zero (some -0)
              for (int j = 0; j < d; ++j) row[j] = (j % 3) ? 0x0000 : 0x8000;
            } else if (k == 7) {
              // The largest magnitudes all in the columns of one lane of the kernel's quad
              // (tig·d/16 + q·d/4 + i, i < d/16): its per-lane top-8 list cannot hold the
              // top 9..16, so the kernel's fast selection must detect that and select again.
              const int lane = t % 4;
              for (int j = 0; j < d; ++j) {
                const bool mine = (j % (d / 4)) / (d / 16) == lane;
                row[j] = ToBf16(mine ? (j % 2 ? -1.0 : 1.0) * (10.0 + 0.25 * (j % 19))
                                     : 0.5 * pick(rng));
              }
            } else if (k == 8) {
              // A symmetric group (many ±1.5, so lo = -1.5, hi = 1.5 and scale 1 for need up to
              // d/3) whose middle code threshold is the tiny negative -2^-24: the values
              // -2^-24, -2^-25 and -2^-30 get code 2 on the CPU (an earlier GPU threshold
              // search returned -0 there and coded them 1).
              static constexpr uint16_t kTiny[] = {0xb380, 0xb300, 0xb080, 0x8000, 0x0000, 0x3380};
              for (int j = 0; j < d; ++j)
                row[j] = j % 3 == 0 ? ToBf16(j % 2 ? -1.5 : 1.5) : kTiny[(j / 3) % 6];
            }  // else: the random row of MakeSetup
          }
      const BlockGeometry geo{1, uint32_t(H), uint32_t(d), uint32_t(page)};
      DeviceBuffer dk, dv, dp, ds, flags(size_t(n) * H * 2), bad(4);
      Upload(dk, s.k);
      Upload(dv, s.v);
      Upload(dp, s.dst_page);
      Upload(ds, s.dst_slot);
      DeviceBuffer pool(size_t(s.num_pages) * geo.Int2LayerBytes());
      cudaMemset(pool.get(), 0xa5, pool.bytes());
      cudaMemset(flags.get(), 0x77, flags.bytes());
      cudaMemset(bad.get(), 0, 4);
      KvWriteParams p;
      p.num_tokens = n;
      p.num_kv_heads = H;
      p.head_dim = d;
      p.page_size = page;
      p.k = dk.as<uint16_t>();
      p.v = dv.as<uint16_t>();
      p.dst_page = dp.as<int32_t>();
      p.dst_slot = ds.as<int32_t>();
      p.dst = {pool.get(), geo.Int2LayerBytes()};
      p.clip_ratio_k = rk;
      p.clip_ratio_v = rv;
      p.row_flags = flags.as<uint8_t>();
      p.bad_rows = bad.as<uint32_t>();
      KernelStatus st = LaunchQuantizeWrite(p, nullptr);
      ASSERT_TRUE(st.ok()) << st.message;
      KVPOOL_CUDA_OK(cudaDeviceSynchronize());
      auto host = Download<uint8_t>(pool.get(), pool.bytes());
      auto fl = Download<uint8_t>(flags.get(), flags.bytes());
      int64_t mismatched = 0;
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < H; ++h)
          for (int kv = 0; kv < 2; ++kv) {
            const uint16_t* src = (kv ? s.v.data() : s.k.data()) + (size_t(t) * H + h) * d;
            std::vector<float> x(d);
            for (int j = 0; j < d; ++j) x[j] = Bf16ToFp32(src[j]);
            std::vector<uint8_t> codes;
            std::vector<uint16_t> params;
            RowQuantStatus rs;
            CpuQuantRow(x, kv ? rv : rk, &codes, &params, &rs);
            const Int2Row g = ReadInt2Row(host, geo, s.dst_page[t], s.dst_slot[t], h, kv);
            if (g.codes != codes || g.params != params) ++mismatched;
            EXPECT_EQ(fl[(size_t(t) * H + h) * 2 + kv], rs == RowQuantStatus::kOk ? 0 : 1);
          }
      std::printf("[quantize-ratios] d=%d clip_k=%.3f clip_v=%.3f mismatched rows=%lld/%d\n", d, rk,
                  rv, (long long)mismatched, n * H * 2);
      EXPECT_EQ(mismatched, 0) << "d=" << d << " clip_k=" << rk << " clip_v=" << rv;
      EXPECT_EQ(Download<uint32_t>(bad.get(), 1)[0], 0u);
    }
  }
}

TEST(KvWrite, NonFiniteAndOverflowRowsAreRefusedAndZeroed) {
  SKIP_WITHOUT_GPU();
  const int n = 64, d = 128;
  WriteSetup s = MakeSetup(n, 2, d, 16, 77);
  // token 3 head 0 K: NaN; token 10 head 1 V: +inf; token 20 head 0 K: fp16 overflow (1e6)
  s.k[(size_t(3) * 2 + 0) * d + 5] = 0x7fc0;
  s.v[(size_t(10) * 2 + 1) * d + 100] = 0x7f80;
  for (int j = 0; j < d; ++j) s.k[(size_t(20) * 2 + 0) * d + j] = ToBf16(1e6 * (j % 2 ? 1 : -1));
  const BlockGeometry geo{1, 2, uint32_t(d), 16};
  DeviceBuffer dk, dv, dp, ds, flags(size_t(n) * 2 * 2), bad(4);
  Upload(dk, s.k);
  Upload(dv, s.v);
  Upload(dp, s.dst_page);
  Upload(ds, s.dst_slot);
  DeviceBuffer pool(size_t(s.num_pages) * geo.Int2LayerBytes());
  cudaMemset(pool.get(), 0xa5, pool.bytes());
  cudaMemset(bad.get(), 0, 4);
  KvWriteParams p;
  p.num_tokens = n;
  p.num_kv_heads = 2;
  p.head_dim = d;
  p.k = dk.as<uint16_t>();
  p.v = dv.as<uint16_t>();
  p.dst_page = dp.as<int32_t>();
  p.dst_slot = ds.as<int32_t>();
  p.dst = {pool.get(), geo.Int2LayerBytes()};
  p.row_flags = flags.as<uint8_t>();
  p.bad_rows = bad.as<uint32_t>();
  ASSERT_TRUE(LaunchQuantizeWrite(p, nullptr).ok());
  KVPOOL_CUDA_OK(cudaDeviceSynchronize());
  auto host = Download<uint8_t>(pool.get(), pool.bytes());
  auto fl = Download<uint8_t>(flags.get(), flags.bytes());
  EXPECT_EQ(Download<uint32_t>(bad.get(), 1)[0], 3u);
  struct Bad {
    int t, h, kv;
  } bads[] = {{3, 0, 0}, {10, 1, 1}, {20, 0, 0}};
  for (const Bad& b : bads) {
    EXPECT_EQ(fl[(size_t(b.t) * 2 + b.h) * 2 + b.kv], 1);
    const Int2Row g = ReadInt2Row(host, geo, s.dst_page[b.t], s.dst_slot[b.t], b.h, b.kv);
    for (uint8_t c : g.codes) EXPECT_EQ(c, 0);
    for (uint16_t q : g.params) EXPECT_EQ(q, 0);
  }
  // Neighbours (same page, same token other head / other kind) are intact and match the CPU.
  for (int t : {2, 3, 4, 10, 20}) {
    for (int h = 0; h < 2; ++h) {
      for (int kv = 0; kv < 2; ++kv) {
        bool is_bad = false;
        for (const Bad& b : bads) is_bad |= (b.t == t && b.h == h && b.kv == kv);
        if (is_bad) continue;
        const uint16_t* src = (kv ? s.v.data() : s.k.data()) + (size_t(t) * 2 + h) * d;
        std::vector<float> x(d);
        for (int j = 0; j < d; ++j) x[j] = Bf16ToFp32(src[j]);
        std::vector<uint8_t> codes;
        std::vector<uint16_t> params;
        RowQuantStatus rs;
        CpuQuantRow(x, kv ? 0.92f : 0.96f, &codes, &params, &rs);
        const Int2Row g = ReadInt2Row(host, geo, s.dst_page[t], s.dst_slot[t], h, kv);
        EXPECT_EQ(g.codes, codes) << "t=" << t << " h=" << h << " kv=" << kv;
        EXPECT_EQ(g.params, params) << "t=" << t << " h=" << h << " kv=" << kv;
        EXPECT_EQ(fl[(size_t(t) * 2 + h) * 2 + kv], 0);
      }
    }
  }
}

// Rotation accuracy (fp16 copy of R on tensor cores, fp32 accumulation, bf16 output) against
// float64, and the fused rotate+quantize path: its bytes must equal the CPU quantizer applied
// to the GPU's own rotated BF16 rows, and stay close to the all-CPU path (fp32 rotation).
TEST(KvWrite, RotateWriteAndFusedQuantize) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    const int n = 777, H = 2, page = 16;
    WriteSetup s = MakeSetup(n, H, d, page, 900 + d, /*page_offset=*/d == 128 ? 1100000 : 0);
    std::mt19937_64 rng(901 + d);
    const std::vector<double> rk64 = RandomOrthogonal(d, rng), rv64 = RandomOrthogonal(d, rng);
    const std::vector<float> rk = ToFloat(rk64), rv = ToFloat(rv64);
    const BlockGeometry geo{1, uint32_t(H), uint32_t(d), uint32_t(page)};
    const uint64_t npool = uint64_t(s.num_pages + s.page_offset);
    DeviceBuffer dk, dv, dp, ds, drk, drv;
    Upload(dk, s.k);
    Upload(dv, s.v);
    Upload(dp, s.dst_page);
    Upload(ds, s.dst_slot);
    Upload(drk, rk);
    Upload(drv, rv);
    DeviceBuffer bfpool(npool * geo.Bf16LayerBytes()), i2pool(npool * geo.Int2LayerBytes());
    ASSERT_TRUE(bfpool.ok() && i2pool.ok());
    KvWriteParams p;
    p.num_tokens = n;
    p.num_kv_heads = H;
    p.head_dim = d;
    p.page_size = page;
    p.k = dk.as<uint16_t>();
    p.v = dv.as<uint16_t>();
    p.rotation_k = drk.as<float>();
    p.rotation_v = drv.as<float>();
    p.dst_page = dp.as<int32_t>();
    p.dst_slot = ds.as<int32_t>();
    p.dst = {bfpool.get(), geo.Bf16LayerBytes()};
    ASSERT_TRUE(LaunchRotateWriteBf16(p, nullptr).ok());
    p.dst = {i2pool.get(), geo.Int2LayerBytes()};
    ASSERT_TRUE(LaunchQuantizeWrite(p, nullptr).ok());
    KVPOOL_CUDA_OK(cudaDeviceSynchronize());
    // Only the used pages (offset region) are downloaded.
    const uint64_t off = uint64_t(s.page_offset);
    std::vector<uint8_t> bf_host(npool * geo.Bf16LayerBytes()),
        i2_host(npool * geo.Int2LayerBytes());
    cudaMemcpy(bf_host.data() + off * geo.Bf16LayerBytes(),
               bfpool.as<uint8_t>() + off * geo.Bf16LayerBytes(),
               s.num_pages * geo.Bf16LayerBytes(), cudaMemcpyDeviceToHost);
    cudaMemcpy(i2_host.data() + off * geo.Int2LayerBytes(),
               i2pool.as<uint8_t>() + off * geo.Int2LayerBytes(),
               s.num_pages * geo.Int2LayerBytes(), cudaMemcpyDeviceToHost);
    double num = 0, den = 0;
    int64_t fused_mismatch = 0, rows = 0, cpu_code_diff = 0, codes_total = 0;
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < H; ++h) {
        for (int kv = 0; kv < 2; ++kv) {
          const uint16_t* src = (kv ? s.v.data() : s.k.data()) + (size_t(t) * H + h) * d;
          const std::vector<double>& r64 = kv ? rv64 : rk64;
          const std::vector<float>& r32 = kv ? rv : rk;
          const uint16_t* g = reinterpret_cast<const uint16_t*>(
              bf_host.data() + uint64_t(s.dst_page[t]) * geo.Bf16LayerBytes() +
              geo.Bf16ChunkOffset(0, h) + (kv ? geo.Bf16VOffset() : 0) +
              uint64_t(s.dst_slot[t]) * 2 * d);
          std::vector<float> gpu_rot(d);
          for (int j = 0; j < d; ++j) {
            double ref = 0;
            for (int i = 0; i < d; ++i) ref += Bf16ToFp32(src[i]) * double(r32[size_t(i) * d + j]);
            gpu_rot[j] = Bf16ToFp32(g[j]);
            num += (gpu_rot[j] - ref) * (gpu_rot[j] - ref);
            den += ref * ref;
          }
          (void)r64;
          const float ratio = kv ? 0.92f : 0.96f;
          std::vector<uint8_t> codes;
          std::vector<uint16_t> params;
          RowQuantStatus rs;
          CpuQuantRow(gpu_rot, ratio, &codes, &params, &rs);
          const Int2Row q = ReadInt2Row(i2_host, geo, s.dst_page[t], s.dst_slot[t], h, kv);
          ++rows;
          if (q.codes != codes || q.params != params) ++fused_mismatch;
          // all-CPU path: fp32 rotation, bf16 rounding, quantize
          std::vector<uint8_t> cc(d / 4);
          std::vector<uint16_t> cp(params.size());
          QuantizeRowsResult qr;
          ASSERT_TRUE(RotateQuantizeRowsBf16(src, 1, uint32_t(d), r32.data(), ratio, nullptr,
                                             cc.data(), cp.data(), &qr)
                          .ok());
          std::vector<uint8_t> a(d), b(d);
          UnpackCodes(cc.data(), uint32_t(d), a.data());
          UnpackCodes(q.codes.data(), uint32_t(d), b.data());
          for (int j = 0; j < d; ++j) cpu_code_diff += a[j] != b[j];
          codes_total += d;
        }
      }
    }
    const double rel = std::sqrt(num / den);
    std::printf(
        "[rotate] d=%d rel_l2(gpu bf16(x·R) vs fp64) = %.3e; fused-vs-quantize(gpu rows) "
        "mismatched rows %lld/%lld; codes differing from all-CPU path %.4f%%\n",
        d, rel, (long long)fused_mismatch, (long long)rows,
        100.0 * double(cpu_code_diff) / double(codes_total));
    EXPECT_LT(rel, 3e-3) << "d=" << d;
    EXPECT_EQ(fused_mismatch, 0) << "d=" << d;
    EXPECT_LT(double(cpu_code_diff) / double(codes_total), 0.02) << "d=" << d;
  }
}

// d 128 rotates in the warp-specialized kernels (wgmma in a producer warpgroup); with
// KVPOOL_WRITE_ROT_WS=0 (read at each launch) in the mma.sync kernels. Both paths, shared and
// per-head rotations, 3 heads (items cross heads) and 1000 tokens (the last 64-token group has
// a partial tile and one past the end): the rotated BF16 rows of the two paths are compared
// value by value (the count printed; same fp16 operands and fp32 accumulation, so at most one
// bf16 step apart), the warp-specialized fused kernel's bytes must equal the CPU quantizer on
// the warp-specialized kernel's own rotated rows, and every BF16 value must have been written.
TEST(KvWrite, WarpSpecializedRotationMatchesMmaSync) {
  SKIP_WITHOUT_GPU();
  const int n = 1000, H = 3, d = 128, page = 16;
  const BlockGeometry geo{1, uint32_t(H), uint32_t(d), uint32_t(page)};
  for (bool per_head : {false, true}) {
    WriteSetup s = MakeSetup(n, H, d, page, 4242 + per_head);
    std::mt19937_64 rng(4343 + per_head);
    std::vector<float> rk, rv;
    for (int h = 0; h < (per_head ? H : 1); ++h) {
      const std::vector<float> a = ToFloat(RandomOrthogonal(d, rng));
      const std::vector<float> b = ToFloat(RandomOrthogonal(d, rng));
      rk.insert(rk.end(), a.begin(), a.end());
      rv.insert(rv.end(), b.begin(), b.end());
    }
    DeviceBuffer dk, dv, dp, ds, drk, drv;
    Upload(dk, s.k);
    Upload(dv, s.v);
    Upload(dp, s.dst_page);
    Upload(ds, s.dst_slot);
    Upload(drk, rk);
    Upload(drv, rv);
    const uint64_t bf_bytes = uint64_t(s.num_pages) * geo.Bf16LayerBytes();
    const uint64_t i2_bytes = uint64_t(s.num_pages) * geo.Int2LayerBytes();
    DeviceBuffer bf_ws(bf_bytes), bf_mma(bf_bytes), i2_ws(i2_bytes);
    ASSERT_TRUE(bf_ws.ok() && bf_mma.ok() && i2_ws.ok());
    KvWriteParams p;
    p.num_tokens = n;
    p.num_kv_heads = H;
    p.head_dim = d;
    p.page_size = page;
    p.k = dk.as<uint16_t>();
    p.v = dv.as<uint16_t>();
    p.rotation_k = drk.as<float>();
    p.rotation_v = drv.as<float>();
    p.rotation_per_head = per_head;
    p.dst_page = dp.as<int32_t>();
    p.dst_slot = ds.as<int32_t>();
    KVPOOL_CUDA_OK(cudaMemset(bf_ws.get(), 0xff, bf_bytes));
    KVPOOL_CUDA_OK(cudaMemset(bf_mma.get(), 0xff, bf_bytes));
    KVPOOL_CUDA_OK(cudaMemset(i2_ws.get(), 0xff, i2_bytes));
    p.dst = {bf_ws.get(), geo.Bf16LayerBytes()};
    ASSERT_TRUE(LaunchRotateWriteBf16(p, nullptr).ok());
    p.dst = {i2_ws.get(), geo.Int2LayerBytes()};
    ASSERT_TRUE(LaunchQuantizeWrite(p, nullptr).ok());
    KVPOOL_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(setenv("KVPOOL_WRITE_ROT_WS", "0", 1), 0);
    p.dst = {bf_mma.get(), geo.Bf16LayerBytes()};
    const KernelStatus st = LaunchRotateWriteBf16(p, nullptr);
    unsetenv("KVPOOL_WRITE_ROT_WS");
    ASSERT_TRUE(st.ok());
    KVPOOL_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> ws = Download<uint8_t>(bf_ws.get(), bf_bytes);
    const std::vector<uint8_t> mma = Download<uint8_t>(bf_mma.get(), bf_bytes);
    const std::vector<uint8_t> i2 = Download<uint8_t>(i2_ws.get(), i2_bytes);
    int64_t differ = 0, beyond_one_step = 0, unwritten = 0, fused_mismatch = 0, rows = 0;
    double num = 0, den = 0;
    for (int t = 0; t < n; ++t) {
      for (int h = 0; h < H; ++h) {
        for (int kv = 0; kv < 2; ++kv) {
          const uint64_t off = uint64_t(s.dst_page[t]) * geo.Bf16LayerBytes() +
                               geo.Bf16ChunkOffset(0, h) + (kv ? geo.Bf16VOffset() : 0) +
                               uint64_t(s.dst_slot[t]) * 2 * d;
          const uint16_t* a = reinterpret_cast<const uint16_t*>(ws.data() + off);
          const uint16_t* b = reinterpret_cast<const uint16_t*>(mma.data() + off);
          const uint16_t* src = (kv ? s.v.data() : s.k.data()) + (size_t(t) * H + h) * d;
          const float* r = (kv ? rv.data() : rk.data()) + (per_head ? size_t(h) * d * d : 0);
          std::vector<float> rot(d);
          for (int j = 0; j < d; ++j) {
            unwritten += a[j] == 0xffff || b[j] == 0xffff;
            if (a[j] != b[j]) {
              ++differ;
              const int step = std::abs(int(a[j] & 0x7fff) - int(b[j] & 0x7fff));
              if ((a[j] ^ b[j]) & 0x8000 ? (a[j] & 0x7fff) + (b[j] & 0x7fff) > 1 : step > 1)
                ++beyond_one_step;
            }
            double ref = 0;
            for (int i = 0; i < d; ++i) ref += double(Bf16ToFp32(src[i])) * r[size_t(i) * d + j];
            rot[j] = Bf16ToFp32(a[j]);
            num += (rot[j] - ref) * (rot[j] - ref);
            den += ref * ref;
          }
          std::vector<uint8_t> codes;
          std::vector<uint16_t> params;
          RowQuantStatus rs;
          CpuQuantRow(rot, kv ? 0.92f : 0.96f, &codes, &params, &rs);
          const Int2Row q = ReadInt2Row(i2, geo, s.dst_page[t], s.dst_slot[t], h, kv);
          ++rows;
          if (q.codes != codes || q.params != params) ++fused_mismatch;
        }
      }
    }
    const double rel = std::sqrt(num / den);
    std::printf(
        "[rotate-ws] per_head=%d rel_l2(ws bf16(x·R) vs fp64) = %.3e; ws vs mma.sync: %lld of "
        "%lld bf16 values differ (%lld by more than one bf16 step); fused-ws vs "
        "quantize(ws rows) mismatched rows %lld/%lld\n",
        int(per_head), rel, (long long)differ, (long long)(int64_t(n) * H * 2 * d),
        (long long)beyond_one_step, (long long)fused_mismatch, (long long)rows);
    EXPECT_EQ(unwritten, 0) << "per_head=" << per_head;
    EXPECT_LT(rel, 3e-3) << "per_head=" << per_head;
    EXPECT_EQ(beyond_one_step, 0) << "per_head=" << per_head;
    EXPECT_EQ(fused_mismatch, 0) << "per_head=" << per_head;
  }
}

TEST(KvWrite, DemoteMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (int page : {16, 64}) {
    const int H = 4, d = 128, nblocks = 9;
    const BlockGeometry geo{1, uint32_t(H), uint32_t(d), uint32_t(page)};
    std::mt19937_64 rng(1234 + page);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::vector<uint8_t> bf(size_t(nblocks + 3) * geo.Bf16LayerBytes());
    uint16_t* e = reinterpret_cast<uint16_t*>(bf.data());
    for (size_t i = 0; i < bf.size() / 2; ++i) e[i] = ToBf16(nd(rng));
    std::vector<int32_t> src(nblocks), dst(nblocks);
    for (int i = 0; i < nblocks; ++i) {
      src[i] = (i * 5) % (nblocks + 3);
      dst[i] = nblocks - 1 - i;
    }
    DeviceBuffer dbf, dsrc, ddst, di2(size_t(nblocks) * geo.Int2LayerBytes());
    Upload(dbf, bf);
    Upload(dsrc, src);
    Upload(ddst, dst);
    cudaMemset(di2.get(), 0x5a, di2.bytes());
    DemoteParams p;
    p.num_blocks = nblocks;
    p.num_kv_heads = H;
    p.head_dim = d;
    p.page_size = page;
    p.src_pages = dsrc.as<int32_t>();
    p.dst_pages = ddst.as<int32_t>();
    p.src = {dbf.get(), geo.Bf16LayerBytes()};
    p.dst = {di2.get(), geo.Int2LayerBytes()};
    KernelStatus st = LaunchDemote(p, nullptr);
    ASSERT_TRUE(st.ok()) << st.message;
    KVPOOL_CUDA_OK(cudaDeviceSynchronize());
    auto host = Download<uint8_t>(di2.get(), di2.bytes());
    int64_t mism = 0;
    for (int b = 0; b < nblocks; ++b)
      for (int slot = 0; slot < page; ++slot)
        for (int h = 0; h < H; ++h)
          for (int kv = 0; kv < 2; ++kv) {
            const uint16_t* row = reinterpret_cast<const uint16_t*>(
                bf.data() + uint64_t(src[b]) * geo.Bf16LayerBytes() + geo.Bf16ChunkOffset(0, h) +
                (kv ? geo.Bf16VOffset() : 0) + slot * 2 * d);
            std::vector<uint8_t> codes(d / 4);
            std::vector<uint16_t> params(2);
            QuantizeRowsResult r;
            ASSERT_TRUE(
                QuantizeRowsBf16(row, 1, d, kv ? 0.92f : 0.96f, codes.data(), params.data(), &r)
                    .ok());
            const Int2Row g = ReadInt2Row(host, geo, dst[b], slot, h, kv);
            mism += (g.codes != codes || g.params != params);
          }
    EXPECT_EQ(mism, 0) << "page=" << page;
  }
}

TEST(KvWrite, RefusesBadArguments) {
  KvWriteParams p;
  p.num_tokens = 4;
  p.num_kv_heads = 1;
  p.head_dim = 96;
  EXPECT_EQ(LaunchQuantizeWrite(p, nullptr).code, KernelError::kUnsupported);
  p.head_dim = 128;
  KernelStatus st = LaunchQuantizeWrite(p, nullptr);
  EXPECT_EQ(st.code, KernelError::kInvalidArgument);
  EXPECT_NE(st.message.find("k and v"), std::string::npos) << st.message;
  DemoteParams d;
  d.num_blocks = 1;
  d.num_kv_heads = 1;
  d.head_dim = 128;
  d.page_size = 16;
  st = LaunchDemote(d, nullptr);
  EXPECT_EQ(st.code, KernelError::kInvalidArgument);
  EXPECT_NE(st.message.find("src_pages"), std::string::npos) << st.message;
}

// ---- end to end at production shape --------------------------------------------------------
// 32 q / 8 KV heads, d 128, page 16, 32783 prompt tokens: sink (64) and recent window written by
// LaunchRotateWriteBf16, history by LaunchQuantizeWrite; 20 decode steps each append one token
// (rotate-write), demote the block leaving the window (LaunchDemote) and attend
// (LaunchPagedDecode). The CPU path mirrors every step with the shared CPU quantizer (fp32
// rotation, RotateQuantizeRowsBf16 / QuantizeRowsBf16) and a float64 attention.
TEST(EndToEnd, ProductionShapeWriteDemoteDecode) {
  SKIP_WITHOUT_GPU();
  const int H = 8, HQ = 32, d = 128, P = 16, L0 = 32768 + 15, steps = 20, W = 256, S = 64;
  const int T = L0 + steps;
  const BlockGeometry geo{1, uint32_t(H), uint32_t(d), uint32_t(P)};
  std::mt19937_64 rng(4242);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<uint16_t> k(size_t(T) * H * d), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = ToBf16(nd(rng) + 0.2);
    v[i] = ToBf16(nd(rng));
  }
  const std::vector<float> rk = ToFloat(RandomOrthogonal(d, rng)),
                           rv = ToFloat(RandomOrthogonal(d, rng));
  // CPU mirror of the rotated cache in fp32 (dequantized where the block is INT2).
  std::vector<float> kr(k.size()), vr(v.size());
  std::vector<uint16_t> kr16(k.size()), vr16(v.size());
  {
    std::vector<float> tmp(size_t(T) * H * d);
    RotateRowsBf16(k.data(), uint64_t(T) * H, d, rk.data(), tmp.data());
    for (size_t i = 0; i < tmp.size(); ++i) kr16[i] = Fp32ToBf16(tmp[i]);
    RotateRowsBf16(v.data(), uint64_t(T) * H, d, rv.data(), tmp.data());
    for (size_t i = 0; i < tmp.size(); ++i) vr16[i] = Fp32ToBf16(tmp[i]);
    for (size_t i = 0; i < tmp.size(); ++i) {
      kr[i] = Bf16ToFp32(kr16[i]);
      vr[i] = Bf16ToFp32(vr16[i]);
    }
  }
  auto cpu_quantize_block = [&](int blk) {
    for (int t = blk * P; t < (blk + 1) * P; ++t)
      for (int h = 0; h < H; ++h)
        for (int kv = 0; kv < 2; ++kv) {
          const size_t o = (size_t(t) * H + h) * d;
          std::vector<uint8_t> codes(d / 4);
          std::vector<uint16_t> params(2);
          QuantizeRowsResult r;
          ASSERT_TRUE(QuantizeRowsBf16((kv ? vr16 : kr16).data() + o, 1, d, kv ? 0.92f : 0.96f,
                                       codes.data(), params.data(), &r)
                          .ok());
          DequantizeRow(codes.data(), params.data(), d, (kv ? vr : kr).data() + o);
        }
  };

  // Block bookkeeping: sink blocks 0..3 in BF16 pages 0..3; recent blocks in BF16 pages
  // 4..; history blocks in INT2 page id == block id.
  const int nblocks_max = (T + P - 1) / P;
  std::vector<int32_t> hist_blocks, recent_blocks;
  std::vector<int32_t> bf_page_of(nblocks_max, -1);
  int next_bf = 0;
  for (int b = 0; b < S / P; ++b) bf_page_of[b] = next_bf++;
  const int first_recent = (L0 - (W + P - 1)) / P;  // window holds W + P - 1 tokens
  for (int b = S / P; b < first_recent; ++b) hist_blocks.push_back(b);
  for (int b = first_recent; b * P < L0; ++b) {
    recent_blocks.push_back(b);
    bf_page_of[b] = next_bf++;
  }
  std::vector<int32_t> free_bf;  // recycled BF16 pages
  for (int b : hist_blocks) cpu_quantize_block(b);

  DeviceBuffer dk, dv, drk, drv;
  Upload(dk, k);
  Upload(dv, v);
  Upload(drk, rk);
  Upload(drv, rv);
  DeviceBuffer bfpool(size_t(64) * geo.Bf16LayerBytes()),
      i2pool(size_t(nblocks_max) * geo.Int2LayerBytes());
  // Initial writes: token lists per destination kind.
  std::vector<int32_t> bf_tok_page, bf_tok_slot, bf_toks, i2_tok_page, i2_tok_slot, i2_toks;
  for (int t = 0; t < L0; ++t) {
    const int b = t / P;
    if (bf_page_of[b] >= 0) {
      bf_toks.push_back(t);
    } else {
      i2_toks.push_back(t);
    }
  }
  auto write_tokens = [&](const std::vector<int32_t>& toks, bool int2) {
    // contiguous runs only: the tokens of each call are consecutive here
    std::vector<int32_t> pg, sl;
    for (int t : toks) {
      pg.push_back(int2 ? t / P : bf_page_of[t / P]);
      sl.push_back(t % P);
    }
    DeviceBuffer dpg, dsl;
    Upload(dpg, pg);
    Upload(dsl, sl);
    // toks may not be contiguous (sink, then recent): write run by run
    size_t i = 0;
    while (i < toks.size()) {
      size_t j = i + 1;
      while (j < toks.size() && toks[j] == toks[j - 1] + 1) ++j;
      KvWriteParams p;
      p.num_tokens = int(j - i);
      p.num_kv_heads = H;
      p.head_dim = d;
      p.page_size = P;
      p.k = dk.as<uint16_t>() + size_t(toks[i]) * H * d;
      p.v = dv.as<uint16_t>() + size_t(toks[i]) * H * d;
      p.rotation_k = drk.as<float>();
      p.rotation_v = drv.as<float>();
      p.dst_page = dpg.as<int32_t>() + i;
      p.dst_slot = dsl.as<int32_t>() + i;
      if (int2) {
        p.dst = {i2pool.get(), geo.Int2LayerBytes()};
        KernelStatus st = LaunchQuantizeWrite(p, nullptr);
        ASSERT_TRUE(st.ok()) << st.message;
      } else {
        p.dst = {bfpool.get(), geo.Bf16LayerBytes()};
        KernelStatus st = LaunchRotateWriteBf16(p, nullptr);
        ASSERT_TRUE(st.ok()) << st.message;
      }
      i = j;
    }
    KVPOOL_CUDA_OK(cudaDeviceSynchronize());
  };
  write_tokens(bf_toks, false);
  write_tokens(i2_toks, true);

  double worst_rel = 0, worst_lse = 0, worst_same = 0, worst_same_lse = 0;
  int demotions = 0;
  std::vector<float> kg(k.size()), vg(v.size());  // mirror of the GPU-written cache
  std::vector<int> demoted_now;
  for (int step = 0; step < steps; ++step) {
    const int t = L0 + step;
    const int blk = t / P;
    if (bf_page_of[blk] < 0) {
      recent_blocks.push_back(blk);
      int pg;
      if (!free_bf.empty()) {
        pg = free_bf.back();
        free_bf.pop_back();
      } else {
        pg = next_bf++;
      }
      bf_page_of[blk] = pg;
    }
    write_tokens({t}, false);
    const int len = t + 1;
    // Demote when the window holds W + P tokens of full blocks + nothing partial.
    if (len % P == 0 && int(recent_blocks.size()) * P >= W + P) {
      const int old = recent_blocks.front();
      recent_blocks.erase(recent_blocks.begin());
      std::vector<int32_t> src{bf_page_of[old]}, dst{old};
      DeviceBuffer ds, dd;
      Upload(ds, src);
      Upload(dd, dst);
      DemoteParams dp;
      dp.num_blocks = 1;
      dp.num_kv_heads = H;
      dp.head_dim = d;
      dp.page_size = P;
      dp.src_pages = ds.as<int32_t>();
      dp.dst_pages = dd.as<int32_t>();
      dp.src = {bfpool.get(), geo.Bf16LayerBytes()};
      dp.dst = {i2pool.get(), geo.Int2LayerBytes()};
      ASSERT_TRUE(LaunchDemote(dp, nullptr).ok());
      KVPOOL_CUDA_OK(cudaDeviceSynchronize());
      free_bf.push_back(bf_page_of[old]);
      bf_page_of[old] = -1;
      hist_blocks.push_back(old);
      cpu_quantize_block(old);
      demoted_now.push_back(old);
      ++demotions;
    }
    // ---- decode ----
    std::vector<int32_t> sink_idx, hist_idx = hist_blocks, rec_idx;
    for (int b = 0; b < S / P; ++b) sink_idx.push_back(bf_page_of[b]);
    for (int b : recent_blocks) rec_idx.push_back(bf_page_of[b]);
    const int rec_last = len - recent_blocks.back() * P;
    std::vector<int32_t> ip_s{0, int32_t(sink_idx.size())}, ip_h{0, int32_t(hist_idx.size())},
        ip_r{0, int32_t(rec_idx.size())}, l_s{P}, l_h{P}, l_r{rec_last};
    DeviceBuffer a1, a2, a3, b1, b2, b3, c1, c2, c3;
    Upload(a1, ip_s);
    Upload(a2, sink_idx);
    Upload(a3, l_s);
    Upload(b1, ip_h);
    Upload(b2, hist_idx);
    Upload(b3, l_h);
    Upload(c1, ip_r);
    Upload(c2, rec_idx);
    Upload(c3, l_r);
    std::vector<uint16_t> q(size_t(HQ) * d);
    for (auto& x : q) x = ToBf16(nd(rng));
    DeviceBuffer dq, dout(size_t(HQ) * d * 2), dlse(HQ * 4);
    Upload(dq, q);
    cudaMemset(dout.get(), 0xff, dout.bytes());
    PagedDecodeParams p;
    p.batch = 1;
    p.num_q_heads = HQ;
    p.num_kv_heads = H;
    p.head_dim = d;
    p.page_size = P;
    p.sm_scale = float(1.0 / std::sqrt(double(d)));
    p.q = dq.as<uint16_t>();
    p.rotation_k = drk.as<float>();
    p.rotation_v = drv.as<float>();
    p.bf16_pool = {bfpool.get(), geo.Bf16LayerBytes()};
    p.int2_pool = {i2pool.get(), geo.Int2LayerBytes()};
    p.sink = {a1.as<int32_t>(), a2.as<int32_t>(), a3.as<int32_t>(), int32_t(sink_idx.size())};
    p.history = {b1.as<int32_t>(), b2.as<int32_t>(), b3.as<int32_t>(), int32_t(hist_idx.size())};
    p.recent = {c1.as<int32_t>(), c2.as<int32_t>(), c3.as<int32_t>(), int32_t(rec_idx.size())};
    p.out = dout.as<uint16_t>();
    p.lse = dlse.as<float>();
    size_t ws = 0;
    ASSERT_TRUE(PagedDecodeWorkspaceBytes(p, &ws).ok());
    DeviceBuffer dws(ws);
    p.workspace = dws.get();
    p.workspace_bytes = ws;
    KernelStatus st = LaunchPagedDecode(p, nullptr);
    ASSERT_TRUE(st.ok()) << st.message;
    KVPOOL_CUDA_OK(cudaDeviceSynchronize());
    auto out = Download<uint16_t>(dout.get(), size_t(HQ) * d);
    auto lse = Download<float>(dlse.get(), HQ);
    // Mirror of the GPU-written cache (what the kernel must attend over): refresh the new token
    // and any block whose form changed since the last step.
    auto refresh_gpu_block = [&](int blk2) {
      const bool bf = bf_page_of[blk2] >= 0;
      std::vector<uint8_t> page(bf ? geo.Bf16LayerBytes() : geo.Int2LayerBytes());
      const uint8_t* src =
          bf ? bfpool.as<uint8_t>() + uint64_t(bf_page_of[blk2]) * geo.Bf16LayerBytes()
             : i2pool.as<uint8_t>() + uint64_t(blk2) * geo.Int2LayerBytes();
      cudaMemcpy(page.data(), src, page.size(), cudaMemcpyDeviceToHost);
      for (int slot = 0; slot < P && blk2 * P + slot < len; ++slot)
        for (int h = 0; h < H; ++h)
          for (int kv = 0; kv < 2; ++kv) {
            float* dst = (kv ? vg : kg).data() + (size_t(blk2 * P + slot) * H + h) * d;
            if (bf) {
              const uint16_t* row =
                  reinterpret_cast<const uint16_t*>(page.data() + geo.Bf16ChunkOffset(0, h) +
                                                    (kv ? geo.Bf16VOffset() : 0) + slot * 2 * d);
              for (int j = 0; j < d; ++j) dst[j] = Bf16ToFp32(row[j]);
            } else {
              const Int2Row r = ReadInt2Row(page, geo, 0, slot, h, kv);
              DequantizeRow(r.codes.data(), r.params.data(), d, dst);
            }
          }
    };
    if (step == 0) {
      for (int b2 = 0; b2 * P < len; ++b2) refresh_gpu_block(b2);
    } else {
      refresh_gpu_block(blk);
      for (int b2 : demoted_now) refresh_gpu_block(b2);
    }
    demoted_now.clear();
    // float64 attention over a mirror (tokens 0..len-1), output rotated back by R_V^T.
    auto attend = [&](const std::vector<float>& kk, const std::vector<float>& vv,
                      std::vector<double>* o_out, std::vector<double>* lse_out) {
      o_out->assign(size_t(HQ) * d, 0.0);
      lse_out->assign(HQ, 0.0);
      for (int i = 0; i < HQ; ++i) {
        const int h = i / (HQ / H);
        std::vector<double> qr(d, 0.0);
        for (int a = 0; a < d; ++a) {
          const double qa = Bf16ToFp32(q[size_t(i) * d + a]);
          for (int j = 0; j < d; ++j) qr[j] += qa * rk[size_t(a) * d + j];
        }
        std::vector<double> logit(len);
        double m = -INFINITY;
        for (int tt = 0; tt < len; ++tt) {
          const float* kr_row = kk.data() + (size_t(tt) * H + h) * d;
          double dot = 0;
          for (int j = 0; j < d; ++j) dot += qr[j] * kr_row[j];
          logit[tt] = dot * p.sm_scale;
          m = std::max(m, logit[tt]);
        }
        std::vector<double> o(d, 0.0);
        double l = 0;
        for (int tt = 0; tt < len; ++tt) {
          const double w = std::exp(logit[tt] - m);
          l += w;
          const float* vr_row = vv.data() + (size_t(tt) * H + h) * d;
          for (int j = 0; j < d; ++j) o[j] += w * vr_row[j];
        }
        for (int j = 0; j < d; ++j) {
          double ref = 0;
          for (int a = 0; a < d; ++a) ref += o[a] / l * rv[size_t(j) * d + a];
          (*o_out)[size_t(i) * d + j] = ref;
        }
        (*lse_out)[i] = m + std::log(l);
      }
    };
    auto compare = [&](const std::vector<double>& ref_o, const std::vector<double>& ref_lse,
                       double* rel, double* dl) {
      double num = 0, den = 0;
      *dl = 0;
      for (size_t i = 0; i < ref_o.size(); ++i) {
        const double g = Bf16ToFp32(out[i]);
        num += (g - ref_o[i]) * (g - ref_o[i]);
        den += ref_o[i] * ref_o[i];
      }
      for (int i = 0; i < HQ; ++i) *dl = std::max(*dl, std::fabs(double(lse[i]) - ref_lse[i]));
      *rel = std::sqrt(num / den);
    };
    std::vector<double> ro, rl;
    double rel_same = 0, dl_same = 0, rel_cpu = 0, dl_cpu = 0;
    attend(kg, vg, &ro, &rl);
    compare(ro, rl, &rel_same, &dl_same);
    attend(kr, vr, &ro, &rl);
    compare(ro, rl, &rel_cpu, &dl_cpu);
    worst_same = std::max(worst_same, rel_same);
    worst_same_lse = std::max(worst_same_lse, dl_same);
    worst_rel = std::max(worst_rel, rel_cpu);
    worst_lse = std::max(worst_lse, dl_cpu);
    // (1) the kernel against float64 on the same dequantized KV (issue 3's tolerance);
    EXPECT_LT(rel_same, 1e-2) << "step " << step;
    EXPECT_LT(dl_same, 1e-3) << "step " << step;
    // (2) the GPU write path against the CPU write path (fp16 R on tensor cores vs fp32 R).
    //     With this random data the softmax is nearly flat over 32K tokens, so the output is
    //     a mean of ~32K vectors (|o| ≈ |v|/180) and per-row differences of the two caches
    //     (bf16 ulps of the rotated rows moving τ, min, scale) are not averaged away in
    //     relative terms; the bound is looser and the measured value is printed.
    EXPECT_LT(rel_cpu, 5e-2) << "step " << step;
    EXPECT_LT(dl_cpu, 1e-3) << "step " << step;
  }
  std::printf(
      "[e2e] 32q/8kv d128 L0=%d steps=%d demotions=%d | kernel vs float64 on the GPU cache: "
      "worst rel_l2 %.3e |dLSE| %.3e | GPU path vs CPU path: worst rel_l2 %.3e |dLSE| %.3e\n",
      L0, steps, demotions, worst_same, worst_same_lse, worst_rel, worst_lse);
  EXPECT_GE(demotions, 1);
}

}  // namespace
}  // namespace kvpool::cuda::testing
