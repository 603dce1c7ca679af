// GPU tests of LaunchPagedDecode against a float64 reference over the dequantized pages
// (cuda_test_util.cc). Tolerances from issue 3: relative L2 < 1e-2 on outputs, |ΔLSE| < 1e-3.
// Label gpu; skipped when no device is present.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "kvpool/kernels/cuda/paged_decode.h"

namespace kvpool::cuda::testing {
namespace {

constexpr double kRelL2 = 1e-2;
constexpr double kLse = 1e-3;

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device"

void Expect(const DecodeCase& c, const std::string& what) {
  const DecodeResult r = RunDecodeCase(c);
  ASSERT_TRUE(r.error.empty()) << what << ": " << r.error;
  EXPECT_EQ(r.unwritten, 0) << what;
  EXPECT_EQ(r.lse_inf_mismatch, 0) << what;
  EXPECT_LT(r.rel_l2, kRelL2) << what;
  EXPECT_LT(r.max_lse_err, kLse) << what;
  std::printf("[case] %-48s rel_l2 %.2e  max|dLSE| %.2e\n", what.c_str(), r.rel_l2, r.max_lse_err);
}

DecodeCase Mixed(int batch, int hq, int hkv, int d, int page, int hist_tokens, uint64_t seed) {
  DecodeCase c;
  c.batch = batch;
  c.hq = hq;
  c.hkv = hkv;
  c.d = d;
  c.page = page;
  c.seed = seed;
  for (int b = 0; b < batch; ++b) {
    c.sink_len.push_back(64);
    c.hist_len.push_back(((hist_tokens + 37 * b) / page) * page);
    c.recent_len.push_back(256 + (5 * b + 3) % page);
  }
  return c;
}

TEST(PagedDecode, EveryGqaGroupD128) {
  SKIP_WITHOUT_GPU();
  for (int group = 1; group <= 16; ++group) {
    Expect(Mixed(2, 2 * group, 2, 128, 16, 700, 100 + group),
           "d128 p16 group " + std::to_string(group));
  }
}

TEST(PagedDecode, HeadDims64And256) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 256}) {
    for (int group : {1, 3, 4, 8, 12, 16}) {
      Expect(Mixed(2, 2 * group, 2, d, 16, 500, 200 + group + d),
             "d" + std::to_string(d) + " group " + std::to_string(group));
    }
  }
}

TEST(PagedDecode, PageSize64) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    for (int group : {1, 4, 7}) {
      Expect(Mixed(3, 4 * group, 4, d, 64, 1000, 300 + group + d),
             "p64 d" + std::to_string(d) + " group " + std::to_string(group));
    }
  }
}

TEST(PagedDecode, OddAndShortLengths) {
  SKIP_WITHOUT_GPU();
  // Total lengths 54 and 97 (all BF16: shorter than sink + window), L < 64, L = 320 ± 1.
  for (int total : {1, 15, 54, 63, 97, 319, 320, 321}) {
    DecodeCase c;
    c.hq = 8;
    c.hkv = 2;
    c.seed = 400 + total;
    c.sink_len = {std::min(total, 64)};
    c.hist_len = {0};
    c.recent_len = {std::max(0, total - 64)};
    Expect(c, "bf16 only, L=" + std::to_string(total));
  }
  // Mixed with partial last pages in every segment (the kernels accept them anywhere).
  DecodeCase c;
  c.batch = 3;
  c.hq = 12;
  c.hkv = 4;
  c.seed = 450;
  c.sink_len = {54, 64, 33};
  c.hist_len = {97, 16, 321};
  c.recent_len = {1, 257, 270};
  Expect(c, "partial last pages in every segment");
}

TEST(PagedDecode, EachSegmentEmptyInTurn) {
  SKIP_WITHOUT_GPU();
  for (int empty = 0; empty < 3; ++empty) {
    DecodeCase c = Mixed(3, 8, 2, 128, 16, 640, 500 + empty);
    std::vector<int>* lens[3] = {&c.sink_len, &c.hist_len, &c.recent_len};
    for (int& v : *lens[empty]) v = 0;
    Expect(c, "segment " + std::to_string(empty) + " empty");
  }
  // One request with nothing at all, next to normal ones: output 0, lse -inf.
  DecodeCase c = Mixed(3, 8, 2, 128, 16, 640, 510);
  c.sink_len[1] = c.hist_len[1] = c.recent_len[1] = 0;
  Expect(c, "one request fully empty");
  // Only history (INT2 alone).
  DecodeCase h = Mixed(2, 8, 2, 128, 16, 2048, 520);
  h.sink_len = {0, 0};
  h.recent_len = {0, 0};
  Expect(h, "history only");
}

TEST(PagedDecode, LongContextManySplitsAndBatch) {
  SKIP_WITHOUT_GPU();
  Expect(Mixed(1, 32, 8, 128, 16, 16384, 600), "B1 16K 32q/8kv");
  Expect(Mixed(9, 32, 8, 128, 16, 3000, 601), "B9 varied lengths 32q/8kv");
  Expect(Mixed(64, 8, 2, 64, 16, 300, 602), "B64 short");
}

// Peaked attention: q scaled so the logits spread over several nats and one token (or a few)
// holds most of the softmax mass; with history alone the dominant token is an INT2 one. The
// LSE is then the top logit itself, so |ΔLSE| measures one logit's error instead of an average.
TEST(PagedDecode, PeakedAttention) {
  SKIP_WITHOUT_GPU();
  for (double qs : {6.0, 12.0}) {
    DecodeCase h = Mixed(2, 32, 8, 128, 16, 4096, 900 + int(qs));
    h.q_scale = qs;
    h.sink_len = {0, 0};
    h.recent_len = {0, 0};
    Expect(h, "peaked history only, q x" + std::to_string(int(qs)));
    DecodeCase m = Mixed(2, 32, 8, 128, 16, 4096, 950 + int(qs));
    m.q_scale = qs;
    Expect(m, "peaked mixed, q x" + std::to_string(int(qs)));
  }
}

TEST(PagedDecode, RotationVariants) {
  SKIP_WITHOUT_GPU();
  DecodeCase c = Mixed(2, 8, 2, 128, 16, 640, 700);
  c.rotate = false;
  Expect(c, "no rotation");
  c.rotate = true;
  c.per_head_rotation = true;
  c.seed = 701;
  Expect(c, "per-head rotation");
}

TEST(PagedDecode, PageByteOffsetsBeyond2GiB) {
  SKIP_WITHOUT_GPU();
  DecodeCase c = Mixed(1, 4, 1, 128, 16, 640, 800);
  // INT2 layer bytes per page at hkv=1: 1152; BF16: 8192. 2^31 / 1152 ≈ 1.86M pages.
  c.page_id_offset = 2000000;
  Expect(c, "page ids with byte offsets > 2^31");
}

// NaN in q of one head, and NaN in one valid K element of another request: exactly the
// affected outputs (that head; every head of that request) are NaN, with NaN LSE, and nothing
// else changes (no NaN spreads to neighbours; the rest stays within tolerance).
TEST(PagedDecode, NanInputsGiveDefinedResults) {
  SKIP_WITHOUT_GPU();
  DecodeCase c = Mixed(3, 8, 2, 128, 16, 640, 900);
  c.nan_q_request = 0;
  c.nan_q_head = 5;
  c.nan_k_request = 2;
  const DecodeResult r = RunDecodeCase(c);
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.nan_expected, (128 + 8 * 128));
  EXPECT_EQ(r.nan_missing, 0);
  EXPECT_EQ(r.nan_leaked, 0);
  EXPECT_EQ(r.unwritten, 0);
  EXPECT_LT(r.rel_l2, kRelL2);
  EXPECT_LT(r.max_lse_err, kLse);
  std::printf("[case] NaN inputs: %lld NaN outputs as expected, rel_l2 of the rest %.2e\n",
              (long long)r.nan_expected, r.rel_l2);
}

TEST(PagedDecode, RefusesUnsupportedShapes) {
  PagedDecodeParams p;
  p.batch = 1;
  p.num_q_heads = 17;
  p.num_kv_heads = 1;
  p.head_dim = 128;
  p.sm_scale = 0.1f;
  size_t ws = 0;
  KernelStatus st = PagedDecodeWorkspaceBytes(p, &ws);
  EXPECT_EQ(st.code, KernelError::kUnsupported);
  EXPECT_NE(st.message.find("group"), std::string::npos) << st.message;
  p.num_q_heads = 4;
  p.head_dim = 96;
  st = PagedDecodeWorkspaceBytes(p, &ws);
  EXPECT_EQ(st.code, KernelError::kUnsupported);
  EXPECT_NE(st.message.find("head_dim"), std::string::npos) << st.message;
  p.head_dim = 128;
  p.page_size = 32;
  st = PagedDecodeWorkspaceBytes(p, &ws);
  EXPECT_EQ(st.code, KernelError::kUnsupported);
  EXPECT_NE(st.message.find("page_size"), std::string::npos) << st.message;
  p.page_size = 16;
  st = PagedDecodeWorkspaceBytes(p, &ws);
  EXPECT_EQ(st.code, KernelError::kInvalidArgument);  // q is null
  EXPECT_NE(st.message.find("q"), std::string::npos) << st.message;
  p.q = reinterpret_cast<const uint16_t*>(16);
  p.out = reinterpret_cast<uint16_t*>(16);
  p.history.max_pages = 4;  // history used but its table is missing
  st = PagedDecodeWorkspaceBytes(p, &ws);
  EXPECT_EQ(st.code, KernelError::kInvalidArgument);
  EXPECT_NE(st.message.find("history.indptr"), std::string::npos) << st.message;
  p.history.max_pages = 0;
  st = PagedDecodeWorkspaceBytes(p, &ws);
  ASSERT_TRUE(st.ok()) << st.message;
  p.workspace = nullptr;
  st = LaunchPagedDecode(p, nullptr);
  EXPECT_EQ(st.code, KernelError::kInvalidArgument);
  EXPECT_NE(st.message.find("workspace"), std::string::npos) << st.message;
}

}  // namespace
}  // namespace kvpool::cuda::testing
