// Tests of the decode worker's mixed-precision cache (worker/runtime, FORMAT.md §3).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/engine/engine.h"
#include "kvpool/kernels/attention.h"
#include "kvpool/kernels/numeric.h"
#include "kvpool/kernels/quantize.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/worker/eval.h"
#include "kvpool/worker/mixed_kv_cache.h"
#include "kvpool/worker/staging_recorder.h"

namespace kvpool::worker {
namespace {

using engine::AttentionShape;

constexpr AttentionShape kShape{.n_heads = 8, .n_kv_heads = 4, .head_dim = 8};
constexpr int kLayers = 2;

std::shared_ptr<const RotationSet> MakeRotations(int layers, int kv_heads, int d, bool random,
                                                 uint32_t seed = 1) {
  RotationMetadata meta;
  meta.model_name = "test";
  meta.head_dim = d;
  meta.num_layers = layers;
  meta.num_kv_heads = kv_heads;
  if (!random) return std::make_shared<RotationSet>(RotationSet::Hadamard(meta).value());
  // Random orthogonal matrices from Gram-Schmidt on Gaussian rows (fp64, stored fp32).
  std::mt19937 rng(seed);
  std::normal_distribution<double> g;
  auto make = [&] {
    std::vector<double> m(size_t(d) * d);
    for (auto& x : m) x = g(rng);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < i; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += m[i * d + c] * m[j * d + c];
        for (int c = 0; c < d; ++c) m[i * d + c] -= dot * m[j * d + c];
      }
      double n = 0;
      for (int c = 0; c < d; ++c) n += m[i * d + c] * m[i * d + c];
      for (int c = 0; c < d; ++c) m[i * d + c] /= std::sqrt(n);
    }
    return std::vector<float>(m.begin(), m.end());
  };
  std::vector<float> k, v;
  for (int l = 0; l < layers; ++l) {
    auto a = make();
    auto b = make();
    k.insert(k.end(), a.begin(), a.end());
    v.insert(v.end(), b.begin(), b.end());
  }
  return std::make_shared<RotationSet>(RotationSet::FromMatrices(meta, k, v).value());
}

MixedCacheOptions Opts(HistoryPrecision h, int sink, int recent, int capacity = 256) {
  MixedCacheOptions o;
  o.history = h;
  o.sink_tokens = sink;
  o.recent_tokens = recent;
  o.capacity = capacity;
  return o;
}

std::vector<float> RandomRows(int n, int width, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(size_t(n) * width);
  for (auto& e : x) e = g(rng);
  return x;
}

// Appends n random tokens to every layer of `cache` (and of `other` if non-null).
void Fill(engine::KvCacheView& cache, int n, uint32_t seed, int start = 0) {
  const int kv = kShape.kv_dim();
  auto k = RandomRows(n, kv * kLayers, seed);
  auto v = RandomRows(n, kv * kLayers, seed + 1000);
  for (int p = 0; p < n; ++p) {
    for (int l = 0; l < kLayers; ++l) {
      const size_t off = (size_t(p) * kLayers + l) * kv;
      ASSERT_TRUE(cache
                      .Append(l, start + p, absl::MakeConstSpan(&k[off], kv),
                              absl::MakeConstSpan(&v[off], kv))
                      .ok());
    }
  }
}

// ---- validation --------------------------------------------------------------------------------

TEST(MixedKvCacheTest, CreateRejectsBadOptionsNamingTheField) {
  auto rot = MakeRotations(kLayers, 4, 8, false);
  auto expect_invalid = [&](MixedCacheOptions o, const char* field) {
    auto c = MixedKvCache::Create(kLayers, kShape, rot, o);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status();
  };
  MixedCacheOptions o = Opts(HistoryPrecision::kInt2, 64, 256);
  o.page_size = 12;
  expect_invalid(o, "page_size");
  o = Opts(HistoryPrecision::kInt2, 40, 256);
  expect_invalid(o, "sink_tokens");
  o = Opts(HistoryPrecision::kInt2, 64, -1);
  expect_invalid(o, "recent_tokens");
  o = Opts(HistoryPrecision::kInt2, 64, 256, 0);
  expect_invalid(o, "capacity");
  o = Opts(HistoryPrecision::kInt2, 64, 256);
  o.clip_ratio_k = 1.5f;
  expect_invalid(o, "clip_ratio_k");
  auto bad = MixedKvCache::Create(kLayers, {8, 3, 8}, rot, Opts(HistoryPrecision::kInt2, 0, 0));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  auto null_rot =
      MixedKvCache::Create(kLayers, kShape, nullptr, Opts(HistoryPrecision::kInt2, 0, 0));
  EXPECT_EQ(null_rot.status().code(), absl::StatusCode::kInvalidArgument);
  auto mismatch = MixedKvCache::Create(3, kShape, rot, Opts(HistoryPrecision::kInt2, 0, 0));
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(MixedKvCacheTest, AppendAndAttendRejectBadInput) {
  auto cache = MixedKvCache::Create(kLayers, kShape, MakeRotations(kLayers, 4, 8, false),
                                    Opts(HistoryPrecision::kInt2, 16, 16, 20))
                   .value();
  std::vector<float> row(kShape.kv_dim(), 0.5f), q(kShape.q_dim(), 0.1f), out(kShape.q_dim());
  EXPECT_EQ(cache->Append(2, 0, row, row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Append(0, 1, row, row).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> short_row(3);
  EXPECT_EQ(cache->Append(0, 0, short_row, row).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> nan_row = row;
  nan_row[5] = NAN;
  auto s = cache->Append(0, 0, row, nan_row);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("element 5"), std::string::npos) << s;
  EXPECT_EQ(cache->Attend(0, 0, q, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);  // nothing stored yet
  for (int p = 0; p < 20; ++p) ASSERT_TRUE(cache->Append(0, p, row, row).ok());
  EXPECT_EQ(cache->Append(0, 20, row, row).code(), absl::StatusCode::kResourceExhausted);
  std::vector<float> short_q(5);
  EXPECT_EQ(cache->Attend(0, 3, short_q, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cache->Attend(0, 19, q, absl::MakeSpan(out)).ok());
}

// ---- segments and demotion ---------------------------------------------------------------------

TEST(MixedKvCacheTest, SegmentsFollowFormat3) {
  auto cache = MixedKvCache::Create(kLayers, kShape, MakeRotations(kLayers, 4, 8, false),
                                    Opts(HistoryPrecision::kInt2, 64, 256, 512))
                   .value();
  // 400 tokens = 25 full blocks: sink 0..3, recent 9..24, history 4..8.
  EXPECT_EQ(cache->RecentStartBlock(400), 9);
  EXPECT_EQ(cache->SegmentOf(3, 400), Segment::kSink);
  EXPECT_EQ(cache->SegmentOf(4, 400), Segment::kHistory);
  EXPECT_EQ(cache->SegmentOf(8, 400), Segment::kHistory);
  EXPECT_EQ(cache->SegmentOf(9, 400), Segment::kRecent);
  // 415 tokens: the partial block 25 joins the window, which holds 256 + 15 tokens.
  EXPECT_EQ(cache->RecentStartBlock(415), 9);
  EXPECT_EQ(415 - cache->RecentStartBlock(415) * 16, 271);
  // Shorter than S + W: everything BF16 (no history).
  for (int b = 0; b < 20; ++b) EXPECT_NE(cache->SegmentOf(b, 320), Segment::kHistory) << b;
  // Within the sink: the partial block is recent.
  EXPECT_EQ(cache->SegmentOf(1, 40), Segment::kSink);
  EXPECT_EQ(cache->SegmentOf(2, 40), Segment::kRecent);
}

// Demotion produces exactly the INT2 bytes the pool's encoder produces from the same
// un-rotated BF16 input (RotateQuantizeRowsBf16 on staging rows), and the BF16 form equals the
// pool's rotated BF16 form.
TEST(MixedKvCacheTest, DemotionMatchesPoolEncodingBitForBit) {
  auto rot = MakeRotations(kLayers, 4, 8, true);
  auto cache =
      MixedKvCache::Create(kLayers, kShape, rot, Opts(HistoryPrecision::kInt2, 16, 16)).value();
  StagingRecorder rec(cache.get(), cache->geometry());
  int completed = 0;
  rec.set_on_layer_complete([&](int, int) { ++completed; });
  Fill(rec, 80, 7);  // 5 blocks: sink 0, history 1..3, recent 4
  EXPECT_EQ(completed, 5 * kLayers);
  EXPECT_EQ(rec.FullBlocks(), 5);
  const BlockGeometry& g = cache->geometry();
  EXPECT_EQ(cache->stats().demoted_chunks, 3u * kLayers);
  EXPECT_FALSE(cache->HasInt2Form(0));
  EXPECT_FALSE(cache->HasInt2Form(4));
  for (int b = 0; b < 5; ++b) {
    // The pool's commit: rotate + bf16 + quantize from the staging bytes.
    std::vector<uint8_t> bf16(g.Bf16FormBytes()), int2(g.Int2FormBytes());
    const uint8_t* staging = rec.Staging(b);
    ASSERT_NE(staging, nullptr);
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
        for (int kv = 0; kv < 2; ++kv) {
          const uint64_t off = g.Bf16ChunkOffset(l, h) + (kv ? g.Bf16VOffset() : 0);
          const uint64_t q = g.Int2ChunkOffset(l, h);
          ASSERT_TRUE(
              RotateQuantizeRowsBf16(
                  reinterpret_cast<const uint16_t*>(staging + off), g.page_size, g.head_dim,
                  rot->Matrix(kv ? KvKind::kValue : KvKind::kKey, l, h),
                  kv ? kDefaultClipRatioV : kDefaultClipRatioK,
                  reinterpret_cast<uint16_t*>(bf16.data() + off),
                  int2.data() + q + (kv ? g.Int2VCodesOffset() : g.Int2KCodesOffset()),
                  reinterpret_cast<uint16_t*>(int2.data() + q +
                                              (kv ? g.Int2VParamsOffset() : g.Int2KParamsOffset())),
                  nullptr)
                  .ok());
        }
      }
    }
    ASSERT_TRUE(cache->HasBf16Form(b));
    EXPECT_EQ(std::memcmp(cache->Bf16Form(b), bf16.data(), bf16.size()), 0) << "block " << b;
    if (b >= 1 && b <= 3) {
      ASSERT_TRUE(cache->HasInt2Form(b)) << b;
      EXPECT_EQ(std::memcmp(cache->Int2Form(b), int2.data(), int2.size()), 0) << "block " << b;
    }
  }
}

// With BF16 history and a rotation, attention equals float32 attention up to bf16 rounding of
// K/V (the rotation is orthogonal, so it cancels); with INT2 history the error grows but stays
// bounded.
TEST(MixedKvCacheTest, AttentionMatchesFloat32UpToPrecision) {
  auto rot = MakeRotations(kLayers, 4, 8, true, 5);
  auto fp32 = engine::Fp32KvCache::Create(kLayers, kShape, 256).value();
  auto bf16 =
      MixedKvCache::Create(kLayers, kShape, rot, Opts(HistoryPrecision::kBf16, 16, 16)).value();
  auto int2 =
      MixedKvCache::Create(kLayers, kShape, rot, Opts(HistoryPrecision::kInt2, 16, 16)).value();
  const int n = 100;
  Fill(*fp32, n, 11);
  Fill(*bf16, n, 11);
  Fill(*int2, n, 11);
  auto q = RandomRows(1, kShape.q_dim(), 99);
  std::vector<float> o_ref(kShape.q_dim()), o_bf16(kShape.q_dim()), o_int2(kShape.q_dim());
  double err_bf16 = 0, err_int2 = 0, norm = 0;
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(fp32->Attend(l, n - 1, q, absl::MakeSpan(o_ref)).ok());
    ASSERT_TRUE(bf16->Attend(l, n - 1, q, absl::MakeSpan(o_bf16)).ok());
    ASSERT_TRUE(int2->Attend(l, n - 1, q, absl::MakeSpan(o_int2)).ok());
    for (int i = 0; i < kShape.q_dim(); ++i) {
      err_bf16 = std::max(err_bf16, double(std::fabs(o_bf16[i] - o_ref[i])));
      err_int2 = std::max(err_int2, double(std::fabs(o_int2[i] - o_ref[i])));
      norm = std::max(norm, double(std::fabs(o_ref[i])));
    }
  }
  EXPECT_LT(err_bf16, 2e-2 * norm + 1e-3);  // bf16 has 8 mantissa bits
  EXPECT_GT(err_int2, err_bf16);            // INT2 is really in use
  EXPECT_LT(err_int2, 0.6 * norm + 0.1);    // and still an approximation of attention
}

// A cache filled from fetched blocks (the pool's forms) attends bit-identically to a cache that
// computed the same tokens, in both history precisions, and keeps doing so while decoding.
TEST(MixedKvCacheTest, LoadedBlocksAttendLikeLocallyComputedOnes) {
  for (HistoryPrecision hp : {HistoryPrecision::kInt2, HistoryPrecision::kBf16}) {
    auto rot = MakeRotations(kLayers, 4, 8, true, 3);
    const MixedCacheOptions o = Opts(hp, 16, 32);
    auto local = MixedKvCache::Create(kLayers, kShape, rot, o).value();
    Fill(*local, 96, 21);  // 6 blocks: sink 0, history 1..3, recent 4..5
    // What the decode worker fetches: sink + recent in BF16, history in the precision's form.
    std::vector<BlockForms> forms;
    for (int b = 0; b < 6; ++b) {
      const bool history = local->SegmentOf(b, 96) == Segment::kHistory;
      BlockForms f;
      if (!history || hp == HistoryPrecision::kBf16) f.bf16 = local->Bf16Form(b);
      if (history && hp == HistoryPrecision::kInt2) f.int2 = local->Int2Form(b);
      forms.push_back(f);
    }
    auto loaded = MixedKvCache::Create(kLayers, kShape, rot, o).value();
    ASSERT_TRUE(loaded->LoadBlocks(forms).ok());
    EXPECT_EQ(loaded->Length(0), 96);
    EXPECT_EQ(loaded->stats().loaded_blocks, 6u);
    // Continue both with the same 40 tokens (one more demotion happens on the way).
    Fill(*local, 40, 77, 96);
    Fill(*loaded, 40, 77, 96);
    auto q = RandomRows(1, kShape.q_dim(), 5);
    std::vector<float> a(kShape.q_dim()), b(kShape.q_dim());
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(local->Attend(l, 135, q, absl::MakeSpan(a)).ok());
      ASSERT_TRUE(loaded->Attend(l, 135, q, absl::MakeSpan(b)).ok());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << HistoryPrecisionName(hp) << " layer " << l;
    }
    if (hp == HistoryPrecision::kInt2) {
      ASSERT_TRUE(loaded->HasInt2Form(4));  // demoted after loading
      EXPECT_EQ(
          std::memcmp(loaded->Int2Form(4), local->Int2Form(4), local->geometry().Int2FormBytes()),
          0);
    }
  }
}

// Newcomer report 10 F5: a decoder whose prompt shares all but its last block with a stored
// one loads the shared blocks and recomputes the last. Those blocks were stored for the other
// prompt's window positions, so the ones before this prompt's own window exist in INT2 only,
// though they are still in the window of the loaded length: LoadBlocks takes them as history
// of the planned length (before, it refused them and the decoder fell back to the sink). Once
// the sequence reaches that length, it attends bit-identically to a cache that computed it all.
TEST(MixedKvCacheTest, APrefixLoadedForAPlannedLengthTakesItsHistoryInt2Only) {
  auto rot = MakeRotations(kLayers, 4, 8, true, 31);
  const MixedCacheOptions o = Opts(HistoryPrecision::kInt2, 16, 32);  // sink 1 block, window 2
  auto local = MixedKvCache::Create(kLayers, kShape, rot, o).value();
  Fill(*local, 112, 21);
  Fill(*local, 16, 77, 112);  // 8 blocks: sink 0, history 1..5, recent 6..7
  ASSERT_TRUE(local->HasInt2Form(5));
  // The planned sequence is those 8 blocks; blocks 0..6 come from the pool, 7 is recomputed.
  // At 7 blocks (112 tokens) block 5 is in the window, but it is history at 128 tokens.
  std::vector<BlockForms> forms;
  for (int b = 0; b < 7; ++b) {
    const bool history = local->SegmentOf(b, 128) == Segment::kHistory;
    forms.push_back(history ? BlockForms{nullptr, local->Int2Form(b)}
                            : BlockForms{local->Bf16Form(b), nullptr});
  }
  ASSERT_EQ(forms[5].bf16, nullptr);
  auto loaded = MixedKvCache::Create(kLayers, kShape, rot, o).value();
  absl::Status s = loaded->LoadBlocks(forms);  // no planned length: block 5 is "recent"
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("block 5 is in the recent window"), std::string::npos) << s;
  EXPECT_EQ(loaded->LoadBlocks(forms, 111).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(loaded->LoadBlocks(forms, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(loaded->Length(0), 0);  // unchanged
  s = loaded->LoadBlocks(forms, 128);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(loaded->Length(0), 112);
  EXPECT_EQ(loaded->SegmentOf(5, 112), Segment::kRecent);
  EXPECT_FALSE(loaded->HasBf16Form(5));
  // BF16 history precision cannot read it, in the window or not.
  EXPECT_EQ(loaded->set_history_precision(HistoryPrecision::kBf16).code(),
            absl::StatusCode::kFailedPrecondition);
  auto q = RandomRows(1, kShape.q_dim(), 5);
  std::vector<float> a(kShape.q_dim()), b(kShape.q_dim());
  // While block 5 is in the window it is attended from its INT2 form.
  ASSERT_TRUE(loaded->Attend(0, 111, q, absl::MakeSpan(b)).ok());
  for (float x : b) ASSERT_TRUE(std::isfinite(x));
  // Recompute block 7 (the same K/V), then both decode the same 20 tokens.
  Fill(*loaded, 16, 77, 112);
  EXPECT_EQ(std::memcmp(loaded->Int2Form(5), local->Int2Form(5), local->geometry().Int2FormBytes()),
            0);
  Fill(*local, 20, 78, 128);
  Fill(*loaded, 20, 78, 128);
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(local->Attend(l, 147, q, absl::MakeSpan(a)).ok());
    ASSERT_TRUE(loaded->Attend(l, 147, q, absl::MakeSpan(b)).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "layer " << l;
  }
}

TEST(MixedKvCacheTest, LoadBlocksRefusesMissingFormsAndPartialCaches) {
  auto rot = MakeRotations(kLayers, 4, 8, false);
  const MixedCacheOptions o = Opts(HistoryPrecision::kInt2, 16, 16);
  auto local = MixedKvCache::Create(kLayers, kShape, rot, o).value();
  Fill(*local, 64, 4);
  auto target = MixedKvCache::Create(kLayers, kShape, rot, o).value();
  // Block 3 is the recent window: INT2-only is refused.
  std::vector<BlockForms> forms = {{local->Bf16Form(0), nullptr},
                                   {nullptr, local->Int2Form(1)},
                                   {nullptr, local->Int2Form(2)},
                                   {nullptr, local->Int2Form(2)}};
  auto s = target->LoadBlocks(forms);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("block 3"), std::string::npos) << s;
  EXPECT_EQ(target->Length(0), 0);  // unchanged
  forms[3] = {};
  EXPECT_EQ(target->LoadBlocks(forms).code(), absl::StatusCode::kInvalidArgument);
  // Sink without BF16.
  forms = {{nullptr, local->Int2Form(1)}};
  EXPECT_EQ(target->LoadBlocks(forms).code(), absl::StatusCode::kFailedPrecondition);
  // A cache that ends in a partial block.
  Fill(*target, 5, 1);
  forms = {{local->Bf16Form(0), nullptr}};
  EXPECT_EQ(target->LoadBlocks(forms).code(), absl::StatusCode::kFailedPrecondition);
  // BF16 history precision needs BF16 for history too.
  auto bf =
      MixedKvCache::Create(kLayers, kShape, rot, Opts(HistoryPrecision::kBf16, 16, 16)).value();
  forms = {
      {local->Bf16Form(0), nullptr}, {nullptr, local->Int2Form(1)}, {local->Bf16Form(2), nullptr}};
  EXPECT_EQ(bf->LoadBlocks(forms).code(), absl::StatusCode::kFailedPrecondition);
}

// Switching BF16 → INT2 after a prefix equals running INT2 from the start when the prefix
// is all BF16 anyway, and gives the same forms as local demotion otherwise.
TEST(MixedKvCacheTest, HistoryPrecisionSwitchDemotesAndRestores) {
  auto rot = MakeRotations(kLayers, 4, 8, true, 8);
  auto c =
      MixedKvCache::Create(kLayers, kShape, rot, Opts(HistoryPrecision::kBf16, 16, 16)).value();
  Fill(*c, 80, 2);
  EXPECT_FALSE(c->HasInt2Form(2));
  auto q = RandomRows(1, kShape.q_dim(), 3);
  std::vector<float> before(kShape.q_dim()), after(kShape.q_dim()), back(kShape.q_dim());
  ASSERT_TRUE(c->Attend(1, 79, q, absl::MakeSpan(before)).ok());
  ASSERT_TRUE(c->set_history_precision(HistoryPrecision::kInt2).ok());
  EXPECT_TRUE(c->HasInt2Form(1) && c->HasInt2Form(2) && c->HasInt2Form(3));
  ASSERT_TRUE(c->Attend(1, 79, q, absl::MakeSpan(after)).ok());
  EXPECT_NE(std::memcmp(before.data(), after.data(), before.size() * 4), 0);
  ASSERT_TRUE(c->set_history_precision(HistoryPrecision::kBf16).ok());
  ASSERT_TRUE(c->Attend(1, 79, q, absl::MakeSpan(back)).ok());
  EXPECT_EQ(std::memcmp(before.data(), back.data(), before.size() * 4), 0);
}

TEST(MixedKvCacheTest, TruncationRewritesTheTail) {
  auto rot = MakeRotations(kLayers, 4, 8, true, 9);
  const MixedCacheOptions o = Opts(HistoryPrecision::kInt2, 16, 16);
  auto a = MixedKvCache::Create(kLayers, kShape, rot, o).value();
  auto b = MixedKvCache::Create(kLayers, kShape, rot, o).value();
  Fill(*a, 70, 31);
  Fill(*a, 30, 32, 40);  // overwrite from 40: truncates first
  Fill(*b, 40, 31);
  Fill(*b, 30, 32, 40);
  EXPECT_EQ(a->Length(0), 70);
  auto q = RandomRows(1, kShape.q_dim(), 4);
  std::vector<float> x(kShape.q_dim()), y(kShape.q_dim());
  ASSERT_TRUE(a->Attend(0, 69, q, absl::MakeSpan(x)).ok());
  ASSERT_TRUE(b->Attend(0, 69, q, absl::MakeSpan(y)).ok());
  EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0);
  // A fetched INT2-only block cannot come back into the window.
  auto c = MixedKvCache::Create(kLayers, kShape, rot, o).value();
  std::vector<BlockForms> forms = {
      {a->Bf16Form(0), nullptr}, {nullptr, a->Int2Form(1)}, {a->Bf16Form(2), nullptr}};
  ASSERT_TRUE(c->LoadBlocks(forms).ok());
  std::vector<float> row(kShape.kv_dim(), 0.25f);
  EXPECT_EQ(c->Append(0, 20, row, row).code(), absl::StatusCode::kFailedPrecondition);
}

// Attend is the kernels' reference decode attention over the cache's own pages.
TEST(MixedKvCacheTest, AttendEqualsReferenceDecodeAttentionOverThePages) {
  auto rot = MakeRotations(kLayers, 4, 8, true, 12);
  auto c =
      MixedKvCache::Create(kLayers, kShape, rot, Opts(HistoryPrecision::kInt2, 16, 32)).value();
  const int n = 101;  // sink 0, history 1..3, recent 4..5 + partial 6 (5 tokens)
  Fill(*c, n, 40);
  SegmentView sink{SegmentForm::kBf16, {c->Bf16Form(0)}, 16};
  SegmentView hist{SegmentForm::kInt2, {c->Int2Form(1), c->Int2Form(2), c->Int2Form(3)}, 16};
  SegmentView recent{SegmentForm::kBf16, {c->Bf16Form(4), c->Bf16Form(5), c->Bf16Form(6)}, 5};
  auto q = RandomRows(1, kShape.q_dim(), 41);
  std::vector<float> a(kShape.q_dim()), b(kShape.q_dim()), lse(kShape.n_heads);
  for (int l = 0; l < kLayers; ++l) {
    DecodeAttentionParams p{.geometry = c->geometry(),
                            .layer = static_cast<uint32_t>(l),
                            .num_q_heads = 8,
                            .softmax_scale = 1.0f / std::sqrt(8.0f)};
    ASSERT_TRUE(
        ReferenceDecodeAttention(p, *rot, q.data(), sink, hist, recent, b.data(), lse.data()).ok());
    ASSERT_TRUE(c->Attend(l, n - 1, q, absl::MakeSpan(a)).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << "layer " << l;
  }
}

// The staging bytes are bf16(k), bf16(v) un-rotated, in the BF16 form layout, and every
// (block, layer) completion is reported once, in order.
TEST(StagingRecorderTest, RecordsUnrotatedBf16InBlockLayout) {
  auto c = MixedKvCache::Create(kLayers, kShape, MakeRotations(kLayers, 4, 8, true),
                                Opts(HistoryPrecision::kBf16, 16, 16))
               .value();
  StagingRecorder rec(c.get(), c->geometry());
  std::vector<std::pair<int, int>> done;
  rec.set_on_layer_complete([&](int b, int l) { done.emplace_back(b, l); });
  const int kv = kShape.kv_dim();
  auto k = RandomRows(40 * kLayers, kv, 61);
  auto v = RandomRows(40 * kLayers, kv, 62);
  for (int p = 0; p < 40; ++p) {
    for (int l = 0; l < kLayers; ++l) {
      const size_t off = (size_t(p) * kLayers + l) * kv;
      ASSERT_TRUE(
          rec.Append(l, p, absl::MakeConstSpan(&k[off], kv), absl::MakeConstSpan(&v[off], kv))
              .ok());
    }
  }
  EXPECT_EQ(rec.FullBlocks(), 2);
  EXPECT_EQ(rec.Length(1), 40);
  ASSERT_EQ(done.size(), 4u);
  EXPECT_EQ(done[0], std::make_pair(0, 0));
  EXPECT_EQ(done[3], std::make_pair(1, 1));
  const BlockGeometry& g = c->geometry();
  // Token 21 (block 1, row 5), layer 1, head 2, element 3.
  const size_t off = (size_t(21) * kLayers + 1) * kv + 2 * 8 + 3;
  const uint8_t* blk = rec.Staging(1);
  uint16_t kb, vb;
  std::memcpy(&kb, blk + g.Bf16ChunkOffset(1, 2) + (5 * 8 + 3) * 2, 2);
  std::memcpy(&vb, blk + g.Bf16ChunkOffset(1, 2) + g.Bf16VOffset() + (5 * 8 + 3) * 2, 2);
  EXPECT_EQ(kb, Fp32ToBf16(k[off]));
  EXPECT_EQ(vb, Fp32ToBf16(v[off]));
  EXPECT_EQ(rec.Staging(3), nullptr);
  std::vector<float> row(kv);
  EXPECT_EQ(rec.Append(kLayers, 40, row, row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rec.Append(0, 40, absl::MakeConstSpan(row).subspan(1), row).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HistoryPrecisionTest, ParsesTheKeySpellings) {
  EXPECT_EQ(ParseHistoryPrecision("int2").value(), HistoryPrecision::kInt2);
  EXPECT_EQ(ParseHistoryPrecision("bf16").value(), HistoryPrecision::kBf16);
  auto bad = ParseHistoryPrecision("int4", "recipe.history");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("recipe.history"), std::string::npos);
  EXPECT_STREQ(HistoryPrecisionName(HistoryPrecision::kBf16), "bf16");
}

// ---- the real model ----------------------------------------------------------------------------

class RealModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = engine::Engine::Create(KVPOOL_MODEL_PATH);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(e).value();
    const auto& c = engine_->config();
    rot_ = MakeRotations(c.n_layers, c.n_kv_heads, c.head_dim, false);
  }
  std::unique_ptr<engine::Engine> engine_;
  std::shared_ptr<const RotationSet> rot_;
};

TEST_F(RealModelTest, Bf16HistoryFollowsTheFloat32ReferenceAndInt2StaysClose) {
  std::vector<int> prompt = engine_->tokenizer().Encode(
      "Once upon a time, there was a little dog named Max. Max liked to run in the park with "
      "his red ball. One day, the ball rolled into the pond.",
      true);
  auto ref = RunReference(*engine_, prompt, 40);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_GE(ref->tokens.size(), 20u);
  MixedCacheOptions o = Opts(HistoryPrecision::kBf16, 16, 16, 512);
  auto bf = TeacherForce(*engine_, rot_, o, prompt, *ref);
  ASSERT_TRUE(bf.ok()) << bf.status();
  EXPECT_EQ(bf->positions, static_cast<int>(ref->tokens.size()));
  EXPECT_GE(bf->agreement(), 0.9);
  EXPECT_LT(bf->ppl_ratio(), 1.1);
  o.history = HistoryPrecision::kInt2;
  auto i2 = TeacherForce(*engine_, rot_, o, prompt, *ref);
  ASSERT_TRUE(i2.ok()) << i2.status();
  // S16/W16 on a ~40-token prompt puts most of the context in INT2 at head_dim 8 (4 levels per
  // 8-element group with a Hadamard rotation): a sanity bound far above chance (1/512); the
  // measured numbers are in docs/WORKER.md.
  EXPECT_GE(i2->agreement(), 0.3);
  EXPECT_LT(i2->ppl_ratio(), 8.0);
  std::printf("teacher-forced S16/W16: bf16 agreement %.3f ppl ratio %.4f; int2 %.3f %.4f\n",
              bf->agreement(), bf->ppl_ratio(), i2->agreement(), i2->ppl_ratio());
  // The greedy twin of teacher forcing starts with the same first token when they agree.
  auto greedy = MixedGreedy(*engine_, rot_, o, prompt, 8);
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  EXPECT_FALSE(greedy->empty());
}

TEST(EvalTest, PoolPrefixAndScoring) {
  EXPECT_EQ(PoolPrefixTokens(1, 16), 0);
  EXPECT_EQ(PoolPrefixTokens(16, 16), 0);
  EXPECT_EQ(PoolPrefixTokens(17, 16), 16);
  EXPECT_EQ(PoolPrefixTokens(480, 16), 464);
  std::vector<float> logits = {0.0f, 2.0f, 1.0f};
  TeacherForcedResult r;
  ScorePosition(logits, 1, 0.5, &r);
  ScorePosition(logits, 2, 0.5, &r);
  EXPECT_EQ(r.positions, 2);
  EXPECT_EQ(r.matches, 1);
  const double lse = std::log(1 + std::exp(2.0) + std::exp(1.0));
  EXPECT_NEAR(r.nll_mixed, (lse - 2) + (lse - 1), 1e-9);
  EXPECT_NEAR(r.ppl_ratio(), std::exp((r.nll_mixed - 1.0) / 2), 1e-12);
  EXPECT_EQ(Argmax(std::vector<float>{1, 3, 3}), 1);
}

}  // namespace
}  // namespace kvpool::worker
