// GPU commit encoder vs the CPU encoder (kvpool/kvstore/encoder.h) on random blocks: the INT2
// form is the CPU quantizer's output on exactly the GPU's stored rotated bf16 values, the rotated
// bf16 values are within the stated tolerance of the CPU's fp32 rotation (and the measured
// difference is printed), NaN/Inf blocks and fp16-overflow rows give the CPU path's statuses and
// bytes; commit throughput GPU vs CPU on the same blocks is printed (not asserted).
// Label gpu; skipped when this process finds no usable CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "kvpool/kernels/numeric.h"
#include "kvpool/kernels/quantize.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/kvstore/encoder.h"
#include "kvpool/kvstore/store.h"

namespace kvpool::kvstore {
namespace {

std::unique_ptr<BlockEncoder> GpuOrSkip(std::string* why) {
  absl::StatusOr<std::unique_ptr<BlockEncoder>> e = CreateEncoder(CommitDevice::kGpu);
  if (!e.ok()) {
    *why = std::string(e.status().message());
    return nullptr;
  }
  return std::move(*e);
}

#define GPU_ENCODER_OR_SKIP(var)                             \
  std::string why_##var;                                     \
  std::unique_ptr<BlockEncoder> var = GpuOrSkip(&why_##var); \
  if (var == nullptr) GTEST_SKIP() << why_##var

// Random orthogonal d×d (Gram-Schmidt of a Gaussian matrix, fp64), row-major fp32.
std::vector<float> RandomOrthogonal(uint32_t d, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> m(size_t(d) * d);
  for (double& x : m) x = nd(rng);
  for (uint32_t i = 0; i < d; ++i) {
    double* r = &m[size_t(i) * d];
    for (int pass = 0; pass < 2; ++pass) {
      for (uint32_t k = 0; k < i; ++k) {
        const double* q = &m[size_t(k) * d];
        double dot = 0;
        for (uint32_t j = 0; j < d; ++j) dot += r[j] * q[j];
        for (uint32_t j = 0; j < d; ++j) r[j] -= dot * q[j];
      }
    }
    double n = 0;
    for (uint32_t j = 0; j < d; ++j) n += r[j] * r[j];
    n = std::sqrt(n);
    for (uint32_t j = 0; j < d; ++j) r[j] /= n;
  }
  return std::vector<float>(m.begin(), m.end());
}

RotationSet RandomRotation(const BlockGeometry& g, bool per_head, uint64_t seed) {
  std::mt19937_64 rng(seed);
  RotationMetadata meta;
  meta.format_version = per_head ? 2 : 1;
  meta.model_name = "gpu-encoder-test";
  meta.head_dim = g.head_dim;
  meta.num_layers = g.num_layers;
  meta.num_kv_heads = g.num_kv_heads;
  const uint32_t hr = per_head ? g.num_kv_heads : 1;
  std::vector<float> k, v;
  for (uint32_t i = 0; i < g.num_layers * hr; ++i) {
    std::vector<float> a = RandomOrthogonal(g.head_dim, rng);
    std::vector<float> b = RandomOrthogonal(g.head_dim, rng);
    k.insert(k.end(), a.begin(), a.end());
    v.insert(v.end(), b.begin(), b.end());
  }
  absl::StatusOr<RotationSet> r = RotationSet::FromMatrices(meta, std::move(k), std::move(v));
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// KV-like values: N(0,1) with a few outlier channels (x20) and some quiet rows (x0.01).
std::vector<uint8_t> RandomBlock(const BlockGeometry& g, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<uint8_t> out(g.Bf16FormBytes());
  const uint64_t rows = out.size() / 2 / g.head_dim;
  for (uint64_t r = 0; r < rows; ++r) {
    const double row_scale = (r % 13 == 5) ? 0.01 : 1.0;
    for (uint32_t j = 0; j < g.head_dim; ++j) {
      const double ch = (j % 17 == 3) ? 20.0 : 1.0;
      const uint16_t b = Fp32ToBf16(float(nd(rng) * ch * row_scale));
      std::memcpy(out.data() + (r * g.head_dim + j) * 2, &b, 2);
    }
  }
  return out;
}

struct Buffers {
  std::vector<uint8_t> bf16, int2;
};

std::vector<EncodeJob> MakeJobs(const BlockGeometry& g, const std::vector<std::vector<uint8_t>>& in,
                                std::vector<Buffers>& out, bool (*want_int2)(size_t)) {
  out.assign(in.size(), Buffers{});
  std::vector<EncodeJob> jobs(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    out[i].bf16.assign(g.Bf16FormBytes(), 0xee);
    jobs[i].staging = in[i].data();
    jobs[i].bf16_out = out[i].bf16.data();
    if (want_int2(i)) {
      out[i].int2.assign(g.Int2FormBytes(), 0xee);
      jobs[i].int2_out = out[i].int2.data();
    }
  }
  return jobs;
}

bool AllInt2(size_t) { return true; }
bool MostInt2(size_t i) { return i % 4 != 0; }  // every 4th block BF16 only (sink-like)

// Quantizes the stored bf16 rows of `bf16` with the CPU quantizer and compares with `int2`.
// Returns the number of (layer, head, K/V) chunks that differ.
int CountInt2Mismatches(const BlockGeometry& g, const uint8_t* bf16, const uint8_t* int2,
                        float clip_k, float clip_v) {
  const uint32_t P = g.page_size, d = g.head_dim;
  std::vector<uint8_t> codes(size_t(P) * d / 4);
  std::vector<uint16_t> params(size_t(P) * 2 * g.GroupsPerRow());
  int bad = 0;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
      for (int kv = 0; kv < 2; ++kv) {
        const auto* rows = reinterpret_cast<const uint16_t*>(bf16 + g.Bf16ChunkOffset(l, h) +
                                                             (kv ? g.Bf16VOffset() : 0));
        EXPECT_TRUE(
            QuantizeRowsBf16(rows, P, d, kv ? clip_v : clip_k, codes.data(), params.data(), nullptr)
                .ok());
        const uint8_t* q = int2 + g.Int2ChunkOffset(l, h);
        const uint8_t* gc = q + (kv ? g.Int2VCodesOffset() : g.Int2KCodesOffset());
        const uint8_t* gp = q + (kv ? g.Int2VParamsOffset() : g.Int2KParamsOffset());
        if (std::memcmp(gc, codes.data(), codes.size()) != 0 ||
            std::memcmp(gp, params.data(), params.size() * 2) != 0) {
          ++bad;
        }
      }
    }
  }
  return bad;
}

struct RotationDiff {
  double max_abs = 0;      // max |gpu - cpu|
  double max_rel = 0;      // max |gpu - cpu| / ||x_row||_2
  uint64_t differing = 0;  // bf16 values that differ
  uint64_t total = 0;
  uint64_t beyond_tolerance = 0;
};

// Tolerance of one rotated value (docs/OPERATIONS.md "Commit device"): the fp16 copy of R is
// within 2^-11 relative of R (|Σ x_i δR_ij| <= 2^-11·||x||), each path rounds to bf16 once
// (<= 2^-9·|x̃_j| <= 2^-9·||x|| each); 2^-7·||x|| bounds the sum with margin.
void AccumulateDiff(const BlockGeometry& g, const uint8_t* staging, const uint8_t* gpu,
                    const uint8_t* cpu, RotationDiff* diff) {
  const uint32_t d = g.head_dim;
  const uint64_t rows = g.Bf16FormBytes() / 2 / d;
  for (uint64_t r = 0; r < rows; ++r) {
    double norm = 0;
    for (uint32_t j = 0; j < d; ++j) {
      uint16_t x;
      std::memcpy(&x, staging + (r * d + j) * 2, 2);
      norm += double(Bf16ToFp32(x)) * Bf16ToFp32(x);
    }
    norm = std::sqrt(norm);
    for (uint32_t j = 0; j < d; ++j) {
      uint16_t a, b;
      std::memcpy(&a, gpu + (r * d + j) * 2, 2);
      std::memcpy(&b, cpu + (r * d + j) * 2, 2);
      ++diff->total;
      if (a == b) continue;
      ++diff->differing;
      const double delta = std::fabs(double(Bf16ToFp32(a)) - Bf16ToFp32(b));
      diff->max_abs = std::max(diff->max_abs, delta);
      if (norm > 0) diff->max_rel = std::max(diff->max_rel, delta / norm);
      if (!(delta <= std::ldexp(norm, -7))) ++diff->beyond_tolerance;
    }
  }
}

struct Case {
  BlockGeometry g;
  bool per_head;
  float clip_k, clip_v;
};

TEST(GpuEncoder, MatchesCpuOnRandomBlocks) {
  GPU_ENCODER_OR_SKIP(gpu);
  std::printf("encoder: %s\n", gpu->Describe().c_str());
  auto cpu = NewCpuEncoder();
  const Case cases[] = {
      {{.num_layers = 3, .num_kv_heads = 2, .head_dim = 128, .page_size = 16}, false, 0.96f, 0.92f},
      {{.num_layers = 2, .num_kv_heads = 4, .head_dim = 64, .page_size = 64}, true, 0.96f, 0.92f},
      {{.num_layers = 2, .num_kv_heads = 2, .head_dim = 256, .page_size = 16}, false, 0.9f, 0.0f},
  };
  RotationDiff all;
  for (const Case& c : cases) {
    const BlockGeometry& g = c.g;
    SCOPED_TRACE(::testing::Message()
                 << "d=" << g.head_dim << " P=" << g.page_size << " per_head=" << c.per_head);
    RotationSet rot = RandomRotation(g, c.per_head, 7 + g.head_dim);
    std::vector<std::vector<uint8_t>> in;
    for (int i = 0; i < 11; ++i) in.push_back(RandomBlock(g, 1000 * g.head_dim + i));
    std::vector<Buffers> go, co;
    std::vector<EncodeJob> gj = MakeJobs(g, in, go, MostInt2);
    std::vector<EncodeJob> cj = MakeJobs(g, in, co, MostInt2);
    ASSERT_TRUE(gpu->EncodeBlocks(g, rot, c.clip_k, c.clip_v, absl::MakeSpan(gj)).ok());
    ASSERT_TRUE(cpu->EncodeBlocks(g, rot, c.clip_k, c.clip_v, absl::MakeSpan(cj)).ok());
    EXPECT_EQ(gpu->device_name(), "gpu");
    RotationDiff diff;
    for (size_t i = 0; i < in.size(); ++i) {
      ASSERT_TRUE(gj[i].status.ok()) << "block " << i << ": " << gj[i].status;
      ASSERT_TRUE(cj[i].status.ok()) << "block " << i << ": " << cj[i].status;
      EXPECT_EQ(gj[i].result.int2_ok, cj[i].result.int2_ok) << "block " << i;
      EXPECT_EQ(gj[i].result.int2_ok, MostInt2(i)) << "block " << i;
      EXPECT_EQ(gj[i].result.overflow_rows, 0u);
      AccumulateDiff(g, in[i].data(), go[i].bf16.data(), co[i].bf16.data(), &diff);
      if (gj[i].int2_out != nullptr) {
        EXPECT_EQ(CountInt2Mismatches(g, go[i].bf16.data(), go[i].int2.data(), c.clip_k, c.clip_v),
                  0)
            << "block " << i << ": the GPU INT2 form is not the quantization of its bf16 form";
      }
    }
    std::printf(
        "rotation d=%u P=%u per_head=%d: %llu of %llu bf16 values differ from the CPU (%.4f%%), "
        "max |delta| %.3g, max |delta|/||x|| %.3g (tolerance 2^-7 = %.3g)\n",
        g.head_dim, g.page_size, int(c.per_head), (unsigned long long)diff.differing,
        (unsigned long long)diff.total, 100.0 * double(diff.differing) / double(diff.total),
        diff.max_abs, diff.max_rel, std::ldexp(1.0, -7));
    EXPECT_EQ(diff.beyond_tolerance, 0u);
    all.max_abs = std::max(all.max_abs, diff.max_abs);
    all.max_rel = std::max(all.max_rel, diff.max_rel);
  }
}

TEST(GpuEncoder, NonFiniteBlocksRefusedAsOnCpu) {
  GPU_ENCODER_OR_SKIP(gpu);
  auto cpu = NewCpuEncoder();
  const BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = 128, .page_size = 16};
  RotationSet rot = RandomRotation(g, false, 99);
  std::vector<std::vector<uint8_t>> in;
  for (int i = 0; i < 6; ++i) in.push_back(RandomBlock(g, 500 + i));
  const uint16_t nan = 0x7fc0, ninf = 0xff80;
  std::memcpy(in[1].data() + g.Bf16ChunkOffset(1, 0) + g.Bf16VOffset() + (3 * 128 + 17) * 2, &nan,
              2);
  std::memcpy(in[4].data() + g.Bf16ChunkOffset(0, 1) + (15 * 128 + 127) * 2, &ninf, 2);
  std::vector<Buffers> go, co;
  std::vector<EncodeJob> gj = MakeJobs(g, in, go, AllInt2);
  std::vector<EncodeJob> cj = MakeJobs(g, in, co, AllInt2);
  ASSERT_TRUE(gpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(gj)).ok());
  ASSERT_TRUE(cpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(cj)).ok());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(gj[i].status, cj[i].status) << "block " << i;
    if (gj[i].status.ok()) {
      EXPECT_EQ(CountInt2Mismatches(g, go[i].bf16.data(), go[i].int2.data(), 0.96f, 0.92f), 0);
    }
  }
  EXPECT_EQ(gj[1].status.message(), "layer 1 head 0 V token 3 element 17 is nan");
  EXPECT_EQ(gj[4].status.message(), "layer 0 head 1 K token 15 element 127 is -inf");
  EXPECT_EQ(gj[1].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(gj[0].status.ok());
  EXPECT_EQ(gpu->device_name(), "gpu");
}

TEST(GpuEncoder, Fp16OverflowRowsAsOnCpu) {
  GPU_ENCODER_OR_SKIP(gpu);
  auto cpu = NewCpuEncoder();
  const BlockGeometry g{.num_layers = 1, .num_kv_heads = 2, .head_dim = 128, .page_size = 16};
  RotationMetadata meta;
  meta.model_name = "t";
  meta.head_dim = 128;
  meta.num_layers = 1;
  meta.num_kv_heads = 2;
  absl::StatusOr<RotationSet> rot = RotationSet::Hadamard(meta);
  ASSERT_TRUE(rot.ok());
  std::vector<std::vector<uint8_t>> in;
  for (int i = 0; i < 4; ++i) in.push_back(RandomBlock(g, 800 + i));
  // Block 1, K row 2 of head 0: x = c·H_5 rotates to c·e_5, a single spike of 5e5 (finite on
  // both paths; |x_j| = c/√128 ≈ 44194 fits fp16) whose group scale 5e5/3 exceeds fp16: an
  // overflow row (int2_ok false), clipping disabled so the spike stays.
  std::vector<double> hm = HadamardMatrix(128);
  for (uint32_t j = 0; j < 128; ++j) {
    const uint16_t b = Fp32ToBf16(float(5e5 * hm[5 * 128 + j]));
    std::memcpy(in[1].data() + g.Bf16ChunkOffset(0, 0) + (2 * 128 + j) * 2, &b, 2);
  }
  // Block 2, V row 7 of head 1: one input of 1e5 (beyond fp16: the GPU's fp16 operand is inf)
  // while the CPU's fp32 rotation is finite and quantizes fine.
  const uint16_t big = Fp32ToBf16(1e5f);
  std::memcpy(in[2].data() + g.Bf16ChunkOffset(0, 1) + g.Bf16VOffset() + (7 * 128 + 9) * 2, &big,
              2);
  std::vector<Buffers> go, co;
  std::vector<EncodeJob> gj = MakeJobs(g, in, go, AllInt2);
  std::vector<EncodeJob> cj = MakeJobs(g, in, co, AllInt2);
  ASSERT_TRUE(gpu->EncodeBlocks(g, *rot, 0.0f, 0.0f, absl::MakeSpan(gj)).ok());
  ASSERT_TRUE(cpu->EncodeBlocks(g, *rot, 0.0f, 0.0f, absl::MakeSpan(cj)).ok());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_TRUE(gj[i].status.ok()) << gj[i].status;
    EXPECT_EQ(gj[i].result.int2_ok, cj[i].result.int2_ok) << "block " << i;
    EXPECT_EQ(gj[i].result.overflow_rows, cj[i].result.overflow_rows) << "block " << i;
  }
  EXPECT_FALSE(gj[1].result.int2_ok);
  EXPECT_EQ(gj[1].result.overflow_rows, 1u);
  EXPECT_TRUE(gj[2].result.int2_ok);
  // Blocks 1 and 2 were re-encoded on the CPU: their bytes are the CPU's.
  EXPECT_EQ(go[1].bf16, co[1].bf16);
  EXPECT_EQ(go[2].bf16, co[2].bf16);
  EXPECT_EQ(go[2].int2, co[2].int2);
  uint16_t spike;
  std::memcpy(&spike, go[1].bf16.data() + (2 * 128 + 5) * 2, 2);
  EXPECT_NEAR(Bf16ToFp32(spike), 5e5, 5e5 * 0.01);
  EXPECT_EQ(gpu->device_name(), "gpu");
}

// The store's commit path on the GPU: one CommitPut of several blocks, forms as planned, the
// INT2 forms are the quantization of the stored BF16 forms, Stats names the device.
TEST(GpuEncoder, StoreCommitsOnTheGpu) {
  GPU_ENCODER_OR_SKIP(probe);
  probe.reset();
  auto mem = HeapPoolMemory::Create(64 << 20);
  ASSERT_TRUE(mem.ok());
  FakeClock clock;
  StoreOptions opts;
  opts.commit_device = CommitDevice::kGpu;
  auto store = BlockStore::Create(opts, mem->get(), &clock);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->Stats().commit_device, "gpu");
  ModelSpec spec = testing::TinySpec();
  spec.geometry =
      BlockGeometry{.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .page_size = 16};
  spec.sink_tokens = 16;
  spec.recent_tokens = 32;
  auto info = (*store)->RegisterModel(spec, {.file_bytes = testing::RotationFileFor(spec)});
  ASSERT_TRUE(info.ok()) << info.status();
  const uint32_t nblocks = 6;
  const std::vector<uint32_t> tokens = testing::Tokens(1, nblocks * 16);
  auto plan = (*store)->BeginPut(info->namespace_id, tokens, nblocks, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<BlockChecksum> sums;
  for (const PutBlockPlan& b : plan->blocks) {
    ASSERT_EQ(b.action, PutAction::kWrite);
    std::vector<uint8_t> bytes = RandomBlock(spec.geometry, 60 + b.index);
    std::memcpy((*mem)->data() + b.staging_offset, bytes.data(), bytes.size());
    sums.push_back({b.index, FormChecksum(bytes.data(), bytes.size())});
  }
  auto commit = (*store)->CommitPut(info->namespace_id, plan->put_id, sums);
  ASSERT_TRUE(commit.ok()) << commit.status();
  auto lease = (*store)->Acquire(info->namespace_id, {.token_ids = tokens}, 0, {});
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->blocks.size(), nblocks);
  int both = 0;
  for (const LeasedBlock& b : lease->blocks) {
    const uint8_t* bf16 = nullptr;
    const uint8_t* int2 = nullptr;
    for (const FormLocation& f : b.forms) {
      (f.form == FormKind::kBf16 ? bf16 : int2) = (*mem)->data() + f.offset;
      EXPECT_EQ(FormChecksum((*mem)->data() + f.offset, f.size), f.xxh3);
    }
    EXPECT_EQ(bf16 != nullptr, b.index == 0 || b.index >= nblocks - 2) << "block " << b.index;
    EXPECT_EQ(int2 != nullptr, b.index > 0) << "block " << b.index;
    if (bf16 != nullptr && int2 != nullptr) {
      ++both;
      EXPECT_EQ(
          CountInt2Mismatches(spec.geometry, bf16, int2, spec.clip_ratio_k, spec.clip_ratio_v), 0);
    }
  }
  EXPECT_EQ(both, 2);
}

// Concurrent commits share one encoder (mutex-serialized device work) and more distinct
// rotations than the encoder caches (uploads and evictions): every thread's bytes equal a
// single-threaded encode of the same blocks.
TEST(GpuEncoder, ConcurrentCallsAndRotationCacheGiveSameBytes) {
  GPU_ENCODER_OR_SKIP(gpu);
  const BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = 128, .page_size = 16};
  constexpr int kThreads = 6;  // > the 4 cached rotations
  std::vector<RotationSet> rots;
  std::vector<std::vector<std::vector<uint8_t>>> in(kThreads);
  std::vector<std::vector<Buffers>> ref(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    rots.push_back(RandomRotation(g, t % 2 == 1, 300 + t));
    for (int i = 0; i < 5; ++i) in[t].push_back(RandomBlock(g, 9000 + 10 * t + i));
    std::vector<EncodeJob> jobs = MakeJobs(g, in[t], ref[t], MostInt2);
    ASSERT_TRUE(gpu->EncodeBlocks(g, rots[t], 0.96f, 0.92f, absl::MakeSpan(jobs)).ok());
  }
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 4; ++rep) {
        std::vector<Buffers> out;
        std::vector<EncodeJob> jobs = MakeJobs(g, in[t], out, MostInt2);
        if (!gpu->EncodeBlocks(g, rots[t], 0.96f, 0.92f, absl::MakeSpan(jobs)).ok()) {
          ++mismatches[t];
          continue;
        }
        for (size_t i = 0; i < jobs.size(); ++i) {
          if (!jobs[i].status.ok() || out[i].bf16 != ref[t][i].bf16 ||
              out[i].int2 != ref[t][i].int2) {
            ++mismatches[t];
          }
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
  EXPECT_EQ(gpu->device_name(), "gpu");
}

// A job that keeps BF16 only as the INT2 fallback (bf16_wanted false) gets the same INT2 bytes
// and result; a refused block still gets its CPU-encoded BF16 form.
TEST(GpuEncoder, HistoryBlocksSkipTheBf16CopyButKeepTheFallback) {
  GPU_ENCODER_OR_SKIP(gpu);
  const BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = 128, .page_size = 16};
  RotationSet rot = RandomRotation(g, false, 77);
  std::vector<std::vector<uint8_t>> in;
  for (int i = 0; i < 5; ++i) in.push_back(RandomBlock(g, 7000 + i));
  const uint16_t big = Fp32ToBf16(1e5f);  // block 3: beyond fp16, re-encoded on the CPU
  std::memcpy(in[3].data() + g.Bf16ChunkOffset(1, 1) + 64, &big, 2);
  std::vector<Buffers> a, b, c;
  std::vector<EncodeJob> ja = MakeJobs(g, in, a, AllInt2);
  std::vector<EncodeJob> jb = MakeJobs(g, in, b, AllInt2);
  std::vector<EncodeJob> jc = MakeJobs(g, in, c, AllInt2);
  for (EncodeJob& j : jb) j.bf16_wanted = false;
  ASSERT_TRUE(gpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(ja)).ok());
  ASSERT_TRUE(gpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(jb)).ok());
  ASSERT_TRUE(NewCpuEncoder()->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(jc)).ok());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_TRUE(jb[i].status.ok()) << jb[i].status;
    EXPECT_EQ(jb[i].result.int2_ok, ja[i].result.int2_ok) << "block " << i;
    EXPECT_EQ(b[i].int2, a[i].int2) << "block " << i;
  }
  EXPECT_EQ(b[3].bf16, c[3].bf16);  // re-encoded on the CPU: its BF16 form is there
  EXPECT_EQ(b[3].int2, c[3].int2);
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Commit throughput (staging bytes per second) of both encoders on the same blocks; printed.
TEST(GpuEncoder, CommitThroughput) {
  GPU_ENCODER_OR_SKIP(gpu);
  auto cpu = NewCpuEncoder();
  const BlockGeometry g{.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .page_size = 16};
  RotationSet rot = RandomRotation(g, false, 3);
  std::vector<std::vector<uint8_t>> in;
  const int n = 32;  // 32 blocks of 2 MiB = 64 MiB of staging (one put of 512 tokens)
  for (int i = 0; i < n; ++i) in.push_back(RandomBlock(g, 4000 + i));
  std::vector<Buffers> go, co;
  std::vector<EncodeJob> gj = MakeJobs(g, in, go, AllInt2);
  std::vector<EncodeJob> cj = MakeJobs(g, in, co, AllInt2);
  const double bytes = double(n) * g.Bf16FormBytes();
  ASSERT_TRUE(gpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(gj)).ok());  // warm-up
  const int iters = 10;
  auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < iters; ++it) {
    ASSERT_TRUE(gpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(gj)).ok());
  }
  const double gpu_s = Seconds(t0, std::chrono::steady_clock::now()) / iters;
  t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(cpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(cj)).ok());
  const double cpu_s = Seconds(t0, std::chrono::steady_clock::now());
  // Smaller puts (per-put overhead): 4 blocks = 8 MiB, 1 block = 2 MiB.
  for (int small : {4, 1}) {
    auto span = absl::MakeSpan(gj.data(), small);
    t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it) {
      ASSERT_TRUE(gpu->EncodeBlocks(g, rot, 0.96f, 0.92f, span).ok());
    }
    const double s_small = Seconds(t0, std::chrono::steady_clock::now()) / iters;
    std::printf("gpu commit of %d block(s) (%.0f MiB): %.3f GB/s (%.2f ms)\n", small,
                small * double(g.Bf16FormBytes()) / (1 << 20),
                small * double(g.Bf16FormBytes()) / s_small / 1e9, s_small * 1e3);
  }
  // A put of history blocks (INT2 kept, BF16 only as fallback): no BF16 copy back.
  for (EncodeJob& j : gj) j.bf16_wanted = false;
  t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < iters; ++it) {
    ASSERT_TRUE(gpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(gj)).ok());
  }
  const double hist_s = Seconds(t0, std::chrono::steady_clock::now()) / iters;
  std::printf("gpu commit of %d history blocks (INT2 only back): %.3f GB/s (%.1f ms)\n", n,
              bytes / hist_s / 1e9, hist_s * 1e3);
  // Staging in page-locked pool memory (RegisterHostMemory, as BlockStore::Create does).
  const uint64_t F = g.Bf16FormBytes();
  std::vector<uint8_t> slab(n * F);
  std::vector<EncodeJob> sj = gj;
  for (int i = 0; i < n; ++i) {
    std::memcpy(slab.data() + i * F, in[i].data(), F);
    sj[i].staging = slab.data() + i * F;
  }
  gpu->RegisterHostMemory(slab.data(), slab.size());
  for (bool bf16 : {true, false}) {
    for (EncodeJob& j : sj) j.bf16_wanted = bf16;
    t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it) {
      ASSERT_TRUE(gpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(sj)).ok());
    }
    const double reg_s = Seconds(t0, std::chrono::steady_clock::now()) / iters;
    std::printf("gpu commit of %d blocks, staging page-locked, %s: %.3f GB/s (%.1f ms)\n", n,
                bf16 ? "both forms back" : "history (INT2 only back)", bytes / reg_s / 1e9,
                reg_s * 1e3);
  }
  for (EncodeJob& j : gj) j.bf16_wanted = true;
  ASSERT_TRUE(gpu->EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(gj)).ok());
  RotationDiff diff;
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(gj[i].status.ok());
    AccumulateDiff(g, in[i].data(), go[i].bf16.data(), co[i].bf16.data(), &diff);
  }
  EXPECT_EQ(diff.beyond_tolerance, 0u);
  EXPECT_EQ(CountInt2Mismatches(g, go[0].bf16.data(), go[0].int2.data(), 0.96f, 0.92f), 0);
  std::printf(
      "commit throughput (L=32 H=8 d=128 P=16, %d blocks, %.0f MiB staging, both forms): "
      "cpu %.3f GB/s (%.1f ms, 1 thread), gpu %.3f GB/s (%.1f ms incl. host<->device copies), "
      "gpu/cpu %.1fx\n",
      n, bytes / (1 << 20), bytes / cpu_s / 1e9, cpu_s * 1e3, bytes / gpu_s / 1e9, gpu_s * 1e3,
      cpu_s / gpu_s);
  std::printf(
      "rotation vs cpu at this shape: %.4f%% of bf16 values differ, max |delta| %.3g, "
      "max |delta|/||x|| %.3g\n",
      100.0 * double(diff.differing) / double(diff.total), diff.max_abs, diff.max_rel);
  gpu.reset();  // unregisters `slab` while it is alive
}

}  // namespace
}  // namespace kvpool::kvstore
