// Tests of whole-block encode/decode on the docs/BLOCK_FORMAT.md layout and of the reference
// mixed-precision decode attention.
#include "kvpool/kernels/block_codec.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kvpool/kernels/attention.h"
#include "kvpool/kernels/calibration.h"
#include "kvpool/kernels/numeric.h"

namespace kvpool {
namespace {

// Random per-head OSCAR-like rotations (fitted to random SPD targets).
RotationSet RandomRotations(std::mt19937& rng, const BlockGeometry& g, bool per_head) {
  RotationMetadata m;
  m.format_version = per_head ? 2 : 1;
  m.head_dim = g.head_dim;
  m.num_layers = g.num_layers;
  m.num_kv_heads = g.num_kv_heads;
  const uint32_t d = g.head_dim, hr = per_head ? g.num_kv_heads : 1;
  std::vector<float> k, v;
  std::normal_distribution<double> n01;
  for (uint32_t i = 0; i < 2 * g.num_layers * hr; ++i) {
    std::vector<double> a(d * d), c(d * d, 0.0);
    for (auto& x : a) x = n01(rng);
    for (uint32_t r = 0; r < d; ++r)
      for (uint32_t s = 0; s < d; ++s)
        for (uint32_t t = 0; t < d; ++t) c[r * d + s] += a[r * d + t] * a[s * d + t];
    auto fit = FitRotation(c, d);
    EXPECT_TRUE(fit.ok());
    auto& dst = i % 2 ? v : k;
    dst.insert(dst.end(), fit->rotation.begin(), fit->rotation.end());
  }
  return *RotationSet::FromMatrices(m, k, v);
}

std::vector<uint8_t> RandomStaging(std::mt19937& rng, const BlockGeometry& g, float outlier) {
  std::vector<uint8_t> s(g.Bf16FormBytes());
  std::normal_distribution<float> n01;
  for (size_t i = 0; i < s.size(); i += 2) {
    const uint64_t j = (i / 2) % g.head_dim;
    const uint16_t b = Fp32ToBf16(n01(rng) * (j == 5 ? outlier : 1.0f));
    std::memcpy(&s[i], &b, 2);
  }
  return s;
}

TEST(BlockCodecTest, EncodeMatchesRowFunctionsAndDemotion) {
  std::mt19937 rng(1);
  for (uint32_t d : {64u, 256u}) {
    BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = d, .page_size = 16};
    for (bool per_head : {false, true}) {
      RotationSet rot = RandomRotations(rng, g, per_head);
      auto staging = RandomStaging(rng, g, 8.0f);
      std::vector<uint8_t> rbf(g.Bf16FormBytes()), int2(g.Int2FormBytes());
      auto rep = EncodeBlockBf16(g, rot, staging, absl::MakeSpan(rbf), absl::MakeSpan(int2));
      ASSERT_TRUE(rep.ok()) << rep.status();
      EXPECT_TRUE(rep->int2_valid);
      const uint32_t P = g.page_size;
      for (uint32_t l = 0; l < 2; ++l) {
        for (uint32_t h = 0; h < 2; ++h) {
          for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
            const uint64_t off =
                g.Bf16ChunkOffset(l, h) + (kind == KvKind::kKey ? 0 : g.Bf16VOffset());
            std::vector<uint16_t> in(P * d), got(P * d);
            std::memcpy(in.data(), &staging[off], P * d * 2);
            std::memcpy(got.data(), &rbf[off], P * d * 2);
            std::vector<float> rot_rows(P * d);
            RotateRowsBf16(in.data(), P, d, rot.Matrix(kind, l, h), rot_rows.data(),
                           KernelIsa::kScalar);
            std::vector<uint16_t> expect(P * d);
            for (size_t i = 0; i < expect.size(); ++i) expect[i] = Fp32ToBf16(rot_rows[i]);
            ASSERT_EQ(got, expect);
            std::vector<uint8_t> codes(P * d / 4);
            std::vector<uint16_t> params(P * 2 * g.GroupsPerRow());
            const float ratio = kind == KvKind::kKey ? 0.96f : 0.92f;
            ASSERT_TRUE(QuantizeRowsBf16(expect.data(), P, d, ratio, codes.data(), params.data(),
                                         nullptr, KernelIsa::kScalar)
                            .ok());
            const uint8_t* chunk = &int2[g.Int2ChunkOffset(l, h)];
            const uint64_t co = kind == KvKind::kKey ? g.Int2KCodesOffset() : g.Int2VCodesOffset();
            const uint64_t po =
                kind == KvKind::kKey ? g.Int2KParamsOffset() : g.Int2VParamsOffset();
            ASSERT_EQ(0, std::memcmp(chunk + co, codes.data(), codes.size()));
            ASSERT_EQ(0, std::memcmp(chunk + po, params.data(), params.size() * 2));
          }
        }
      }
      // Demotion of the rotated BF16 form gives the same INT2 bytes.
      std::vector<uint8_t> int2b(g.Int2FormBytes());
      ASSERT_TRUE(QuantizeRotatedBlock(g, rbf, absl::MakeSpan(int2b)).ok());
      EXPECT_EQ(int2, int2b);
      // Scalar and AVX2 produce the same forms.
      std::vector<uint8_t> rbf2(rbf.size()), int2c(int2.size());
      BlockEncodeOptions o;
      o.isa = KernelIsa::kScalar;
      ASSERT_TRUE(
          EncodeBlockBf16(g, rot, staging, absl::MakeSpan(rbf2), absl::MakeSpan(int2c), o).ok());
      EXPECT_EQ(rbf, rbf2);
      EXPECT_EQ(int2, int2c);
      // fp32 input equal to the bf16 values gives identical forms.
      std::vector<float> f32(g.Bf16FormBytes() / 2);
      for (size_t i = 0; i < f32.size(); ++i) {
        uint16_t b;
        std::memcpy(&b, &staging[2 * i], 2);
        f32[i] = Bf16ToFp32(b);
      }
      std::vector<uint8_t> rbf3(rbf.size()), int2d(int2.size());
      ASSERT_TRUE(EncodeBlockF32(g, rot, f32, absl::MakeSpan(rbf3), absl::MakeSpan(int2d)).ok());
      EXPECT_EQ(rbf, rbf3);
      EXPECT_EQ(int2, int2d);
    }
  }
}

TEST(BlockCodecTest, DequantizedChunkWithinHalfScale) {
  std::mt19937 rng(2);
  BlockGeometry g{.num_layers = 1, .num_kv_heads = 1, .head_dim = 128, .page_size = 16};
  RotationMetadata m{.head_dim = 128, .num_layers = 1, .num_kv_heads = 1};
  auto rot = RotationSet::Hadamard(m);
  ASSERT_TRUE(rot.ok());
  auto staging = RandomStaging(rng, g, 1.0f);
  std::vector<uint8_t> rbf(g.Bf16FormBytes()), int2(g.Int2FormBytes());
  BlockEncodeOptions o;
  o.clip_ratio_k = o.clip_ratio_v = 0.0f;
  ASSERT_TRUE(EncodeBlockBf16(g, *rot, staging, absl::MakeSpan(rbf), absl::MakeSpan(int2), o).ok());
  for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
    std::vector<float> deq(16 * 128), ref(16 * 128);
    ASSERT_TRUE(DequantizeInt2Chunk(g, int2, 0, 0, kind, absl::MakeSpan(deq)).ok());
    ASSERT_TRUE(ReadBf16Chunk(g, rbf, 0, 0, kind, absl::MakeSpan(ref)).ok());
    const uint8_t* params =
        &int2[kind == KvKind::kKey ? g.Int2KParamsOffset() : g.Int2VParamsOffset()];
    for (uint32_t t = 0; t < 16; ++t) {
      uint16_t scale;
      std::memcpy(&scale, params + 4 * t, 2);
      for (uint32_t j = 0; j < 128; ++j) {
        ASSERT_LE(std::fabs(deq[t * 128 + j] - ref[t * 128 + j]),
                  Fp16ToFp32(scale) / 2 * (1 + 1e-6f));
      }
    }
  }
}

TEST(BlockCodecTest, ErrorsNameTheProblem) {
  std::mt19937 rng(3);
  BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .page_size = 16};
  RotationSet rot = RandomRotations(rng, g, false);
  auto staging = RandomStaging(rng, g, 1.0f);
  std::vector<uint8_t> rbf(g.Bf16FormBytes()), int2(g.Int2FormBytes());
  // NaN at layer 1, head 0, V, token 3, element 5
  const uint64_t off = g.Bf16ChunkOffset(1, 0) + g.Bf16VOffset() + (3 * 64 + 5) * 2;
  const uint16_t nan = 0x7fc0;
  auto bad = staging;
  std::memcpy(&bad[off], &nan, 2);
  auto r = EncodeBlockBf16(g, rot, bad, absl::MakeSpan(rbf), absl::MakeSpan(int2));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("layer 1 head 0 token 3 V element 5 is nan"),
            std::string::npos)
      << r.status();
  // wrong sizes
  r = EncodeBlockBf16(g, rot, absl::MakeSpan(staging).subspan(2), absl::MakeSpan(rbf),
                      absl::MakeSpan(int2));
  EXPECT_NE(r.status().message().find("staging"), std::string::npos);
  std::vector<uint8_t> small(10);
  r = EncodeBlockBf16(g, rot, staging, absl::MakeSpan(rbf), absl::MakeSpan(small));
  EXPECT_NE(r.status().message().find("int2"), std::string::npos);
  // geometry mismatch
  BlockGeometry g2 = g;
  g2.num_kv_heads = 4;
  std::vector<uint8_t> st2(g2.Bf16FormBytes());
  r = EncodeBlockBf16(g2, rot, st2, {}, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("num_kv_heads 2 != 4"), std::string::npos) << r.status();
  BlockGeometry g3 = g;
  g3.head_dim = 48;
  EXPECT_EQ(EncodeBlockBf16(g3, rot, staging, {}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BlockCodecTest, Fp16OverflowKeepsBf16Form) {
  BlockGeometry g{.num_layers = 1, .num_kv_heads = 2, .head_dim = 64, .page_size = 16};
  RotationMetadata m{.head_dim = 64, .num_layers = 1, .num_kv_heads = 2};
  auto rot = RotationSet::Identity(m);
  std::vector<uint8_t> staging(g.Bf16FormBytes(), 0);
  const uint16_t big = Fp32ToBf16(1e6f);
  const uint64_t off = g.Bf16ChunkOffset(0, 1) + (7 * 64 + 2) * 2;  // head 1, K, token 7
  std::memcpy(&staging[off], &big, 2);
  std::vector<uint8_t> rbf(g.Bf16FormBytes()), int2(g.Int2FormBytes());
  BlockEncodeOptions o;
  o.clip_ratio_k = 0;
  auto r = EncodeBlockBf16(g, *rot, staging, absl::MakeSpan(rbf), absl::MakeSpan(int2), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->int2_valid);
  EXPECT_EQ(r->overflow_rows, 1u);
  EXPECT_EQ(r->first_overflow_layer, 0);
  EXPECT_EQ(r->first_overflow_head, 1);
  EXPECT_EQ(r->first_overflow_token, 7);
  EXPECT_EQ(r->first_overflow_kind, KvKind::kKey);
  EXPECT_EQ(rbf, staging);  // identity rotation: BF16 form holds the values
}

// ---- reference attention ----

struct Seq {
  std::vector<std::vector<uint8_t>> bf16, int2;  // per block
};

Seq MakeBlocks(std::mt19937& rng, const BlockGeometry& g, const RotationSet& rot, int n) {
  Seq s;
  for (int b = 0; b < n; ++b) {
    auto staging = RandomStaging(rng, g, 4.0f);
    s.bf16.emplace_back(g.Bf16FormBytes());
    s.int2.emplace_back(g.Int2FormBytes());
    EXPECT_TRUE(EncodeBlockBf16(g, rot, staging, absl::MakeSpan(s.bf16.back()),
                                absl::MakeSpan(s.int2.back()))
                    .ok());
  }
  return s;
}

// Plain fp64 attention over the dequantized union (rotated space), output rotated back.
void Fp64Attention(const DecodeAttentionParams& p, const RotationSet& rot, const float* q,
                   const std::vector<std::pair<SegmentView, int>>& segs, std::vector<double>* out,
                   std::vector<double>* lse) {
  const BlockGeometry& g = p.geometry;
  const uint32_t d = g.head_dim, P = g.page_size, hq = p.num_q_heads;
  const uint32_t group = hq / g.num_kv_heads;
  out->assign(hq * d, 0.0);
  lse->assign(hq, -INFINITY);
  for (uint32_t i = 0; i < hq; ++i) {
    const uint32_t h = i / group;
    const float* rk = rot.Matrix(KvKind::kKey, p.layer, h);
    const float* rv = rot.Matrix(KvKind::kValue, p.layer, h);
    std::vector<double> qr(d, 0.0);
    for (uint32_t j = 0; j < d; ++j)
      for (uint32_t t = 0; t < d; ++t) qr[j] += double(q[i * d + t]) * rk[t * d + j];
    std::vector<double> logits;
    std::vector<std::vector<float>> vals;
    for (const auto& [seg, unused] : segs) {
      for (size_t pg = 0; pg < seg.pages.size(); ++pg) {
        const uint32_t valid = pg + 1 == seg.pages.size() ? seg.last_page_len : P;
        std::vector<float> kc(P * d), vc(P * d);
        const uint64_t fb = seg.form == SegmentForm::kBf16 ? g.Bf16FormBytes() : g.Int2FormBytes();
        absl::Span<const uint8_t> form(seg.pages[pg], fb);
        if (seg.form == SegmentForm::kBf16) {
          EXPECT_TRUE(ReadBf16Chunk(g, form, p.layer, h, KvKind::kKey, absl::MakeSpan(kc)).ok());
          EXPECT_TRUE(ReadBf16Chunk(g, form, p.layer, h, KvKind::kValue, absl::MakeSpan(vc)).ok());
        } else {
          EXPECT_TRUE(
              DequantizeInt2Chunk(g, form, p.layer, h, KvKind::kKey, absl::MakeSpan(kc)).ok());
          EXPECT_TRUE(
              DequantizeInt2Chunk(g, form, p.layer, h, KvKind::kValue, absl::MakeSpan(vc)).ok());
        }
        for (uint32_t t = 0; t < valid; ++t) {
          double dot = 0;
          for (uint32_t j = 0; j < d; ++j) dot += qr[j] * kc[t * d + j];
          logits.push_back(p.softmax_scale * dot);
          vals.emplace_back(vc.begin() + t * d, vc.begin() + (t + 1) * d);
        }
      }
    }
    if (logits.empty()) continue;
    double m = -INFINITY;
    for (double x : logits) m = std::max(m, x);
    double l = 0;
    std::vector<double> o(d, 0.0);
    for (size_t t = 0; t < logits.size(); ++t) {
      const double w = std::exp(logits[t] - m);
      l += w;
      for (uint32_t j = 0; j < d; ++j) o[j] += w * vals[t][j];
    }
    for (uint32_t r = 0; r < d; ++r) {
      double acc = 0;
      for (uint32_t j = 0; j < d; ++j) acc += o[j] / l * rv[r * d + j];
      (*out)[i * d + r] = acc;
    }
    (*lse)[i] = m + std::log(l);
  }
}

TEST(AttentionTest, MixedSequenceMatchesFp64OverUnion) {
  std::mt19937 rng(4);
  for (uint32_t hq : {2u, 8u}) {
    BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .page_size = 16};
    RotationSet rot = RandomRotations(rng, g, hq == 8);
    Seq blocks = MakeBlocks(rng, g, rot, 6);
    SegmentView sink{SegmentForm::kBf16, {blocks.bf16[0].data()}, 16};
    SegmentView hist{SegmentForm::kInt2,
                     {blocks.int2[1].data(), blocks.int2[2].data(), blocks.int2[3].data()},
                     16};
    SegmentView recent{SegmentForm::kBf16, {blocks.bf16[4].data(), blocks.bf16[5].data()}, 5};
    std::vector<float> q(hq * 64);
    std::normal_distribution<float> n01;
    for (auto& x : q) x = n01(rng);
    DecodeAttentionParams p{
        .geometry = g, .layer = 1, .num_q_heads = hq, .softmax_scale = 1.0f / 8.0f};
    std::vector<float> out(hq * 64), lse(hq);
    ASSERT_TRUE(
        ReferenceDecodeAttention(p, rot, q.data(), sink, hist, recent, out.data(), lse.data())
            .ok());
    std::vector<double> ro, rl;
    Fp64Attention(p, rot, q.data(), {{sink, 0}, {hist, 0}, {recent, 0}}, &ro, &rl);
    for (uint32_t i = 0; i < hq; ++i) {
      EXPECT_NEAR(lse[i], rl[i], 1e-5 * (1 + std::fabs(rl[i])));
      for (uint32_t j = 0; j < 64; ++j) EXPECT_NEAR(out[i * 64 + j], ro[i * 64 + j], 2e-5);
    }
    // the INT2 history matters: attending the BF16 forms instead changes the output
    SegmentView hist_bf16{SegmentForm::kBf16,
                          {blocks.bf16[1].data(), blocks.bf16[2].data(), blocks.bf16[3].data()},
                          16};
    std::vector<float> out2(hq * 64), lse2(hq);
    ASSERT_TRUE(ReferenceDecodeAttention(p, rot, q.data(), sink, hist_bf16, recent, out2.data(),
                                         lse2.data())
                    .ok());
    double diff = 0;
    for (size_t i = 0; i < out.size(); ++i)
      diff = std::max(diff, double(std::fabs(out[i] - out2[i])));
    EXPECT_GT(diff, 1e-4);
  }
}

TEST(AttentionTest, EmptySegmentsAndMerge) {
  std::mt19937 rng(5);
  BlockGeometry g{.num_layers = 1, .num_kv_heads = 1, .head_dim = 32, .page_size = 8};
  RotationSet rot = RandomRotations(rng, g, false);
  Seq blocks = MakeBlocks(rng, g, rot, 2);
  std::vector<float> q(4 * 32, 0.3f);
  DecodeAttentionParams p{.geometry = g, .layer = 0, .num_q_heads = 4, .softmax_scale = 0.2f};
  SegmentView empty_bf16{SegmentForm::kBf16, {}, 0}, empty_int2{SegmentForm::kInt2, {}, 0};
  SegmentView recent{SegmentForm::kBf16, {blocks.bf16[0].data(), blocks.bf16[1].data()}, 3};
  std::vector<float> out(4 * 32), lse(4);
  ASSERT_TRUE(ReferenceDecodeAttention(p, rot, q.data(), empty_bf16, empty_int2, recent, out.data(),
                                       lse.data())
                  .ok());
  std::vector<double> ro, rl;
  Fp64Attention(p, rot, q.data(), {{recent, 0}}, &ro, &rl);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ro[i], 2e-5);
  // everything empty: zeros and -inf, no NaN
  ASSERT_TRUE(ReferenceDecodeAttention(p, rot, q.data(), empty_bf16, empty_int2, empty_bf16,
                                       out.data(), lse.data())
                  .ok());
  for (float x : out) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -INFINITY);
  // merge associativity on random states
  std::vector<float> oa(2 * 4), la = {0.5f, -INFINITY}, ob(8), lb = {1.5f, -INFINITY}, oc(8),
                                lc = {-1.0f, 2.0f};
  for (auto* v : {&oa, &ob, &oc})
    for (auto& x : *v) x = std::normal_distribution<float>()(rng);
  auto a1 = oa, l1 = la, b1 = ob, lb1 = lb;
  MergeAttentionStates(2, 4, a1.data(), l1.data(), ob.data(), lb.data());
  MergeAttentionStates(2, 4, a1.data(), l1.data(), oc.data(), lc.data());
  MergeAttentionStates(2, 4, b1.data(), lb1.data(), oc.data(), lc.data());
  auto a2 = oa, l2 = la;
  MergeAttentionStates(2, 4, a2.data(), l2.data(), b1.data(), lb1.data());
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(a1[i], a2[i], 1e-6);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(l1[i], l2[i], 1e-6);
  // head 1: a and b empty, c not -> c exactly
  for (int j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(a1[4 + j], oc[4 + j]);
  // bad last_page_len
  SegmentView bad{SegmentForm::kBf16, {blocks.bf16[0].data()}, 0};
  EXPECT_EQ(AttendSegment(p, bad, q.data(), out.data(), lse.data()).code(),
            absl::StatusCode::kInvalidArgument);
  p.num_q_heads = 3;
  p.geometry.num_kv_heads = 2;
  EXPECT_EQ(AttendSegment(p, recent, q.data(), out.data(), lse.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
