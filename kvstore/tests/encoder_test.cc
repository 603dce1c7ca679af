#include "kvpool/kvstore/encoder.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kvpool/kernels/numeric.h"
#include "kvpool/kernels/quantize.h"
#include "test_util.h"

namespace kvpool::kvstore {
namespace {

using testing::BlockBytes;

TEST(EncoderTest, IdentityRotationKeepsBf16AndMatchesQuantizer) {
  BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .page_size = 4};
  RotationMetadata meta{.model_name = "t", .head_dim = 8, .num_layers = 2, .num_kv_heads = 2};
  auto rot = RotationSet::Identity(meta);
  ASSERT_TRUE(rot.ok());
  std::vector<uint8_t> in = BlockBytes(g, 1, 2);
  std::vector<uint8_t> bf16(g.Bf16FormBytes()), int2(g.Int2FormBytes());
  EncodeResult r;
  ASSERT_TRUE(EncodeBlock(g, *rot, 0.96f, 0.92f, in.data(), bf16.data(), int2.data(), &r).ok());
  EXPECT_TRUE(r.int2_ok);
  EXPECT_EQ(bf16, in);  // x·I rounded to bf16 is x
  // The V codes of (layer 1, head 1) equal the quantizer's output on the same rows.
  const uint64_t rows = g.Bf16ChunkOffset(1, 1) + g.Bf16VOffset();
  std::vector<uint8_t> codes(4 * 2);
  std::vector<uint16_t> params(4 * 2);
  ASSERT_TRUE(QuantizeRowsBf16(reinterpret_cast<const uint16_t*>(in.data() + rows), 4, 8, 0.92f,
                               codes.data(), params.data(), nullptr)
                  .ok());
  const uint64_t q = g.Int2ChunkOffset(1, 1);
  EXPECT_EQ(0, std::memcmp(int2.data() + q + g.Int2VCodesOffset(), codes.data(), codes.size()));
  EXPECT_EQ(0, std::memcmp(int2.data() + q + g.Int2VParamsOffset(), params.data(), 16));
}

TEST(EncoderTest, HadamardRotationIsOrthogonal) {
  BlockGeometry g{.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .page_size = 4};
  RotationMetadata meta{.model_name = "t", .head_dim = 8, .num_layers = 1, .num_kv_heads = 1};
  auto rot = RotationSet::Hadamard(meta);
  ASSERT_TRUE(rot.ok());
  std::vector<uint8_t> in = BlockBytes(g, 3, 0);
  std::vector<uint8_t> bf16(g.Bf16FormBytes());
  EncodeResult r;
  ASSERT_TRUE(EncodeBlock(g, *rot, 0, 0, in.data(), bf16.data(), nullptr, &r).ok());
  EXPECT_FALSE(r.int2_ok);  // not requested
  EXPECT_NE(bf16, in);
  // Norms of each row are preserved (orthogonal R) up to bf16 rounding.
  for (int row = 0; row < 8; ++row) {
    double n_in = 0, n_out = 0;
    for (int j = 0; j < 8; ++j) {
      uint16_t a, b;
      std::memcpy(&a, in.data() + (row * 8 + j) * 2, 2);
      std::memcpy(&b, bf16.data() + (row * 8 + j) * 2, 2);
      n_in += Bf16ToFp32(a) * Bf16ToFp32(a);
      n_out += Bf16ToFp32(b) * Bf16ToFp32(b);
    }
    EXPECT_NEAR(n_in, n_out, 0.02 * n_in + 1e-6) << "row " << row;
  }
}

TEST(EncoderTest, NonFiniteNamesLayerHeadKvTokenElement) {
  BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .page_size = 4};
  std::vector<uint8_t> in = BlockBytes(g, 0, 0);
  const uint64_t at = g.Bf16ChunkOffset(1, 0) + g.Bf16VOffset() + (2 * 8 + 5) * 2;
  const uint16_t nan = 0x7fc0;
  std::memcpy(in.data() + at, &nan, 2);
  absl::Status s = CheckFinite(g, in.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "layer 1 head 0 V token 2 element 5 is nan");
  const uint16_t ninf = 0xff80;
  std::memcpy(in.data() + at, &ninf, 2);
  EXPECT_EQ(CheckFinite(g, in.data()).message(), "layer 1 head 0 V token 2 element 5 is -inf");
}

TEST(EncoderTest, ParseCommitDevice) {
  for (CommitDevice d : {CommitDevice::kAuto, CommitDevice::kCpu, CommitDevice::kGpu}) {
    absl::StatusOr<CommitDevice> p = ParseCommitDevice(CommitDeviceName(d));
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(*p, d);
  }
  absl::StatusOr<CommitDevice> bad = ParseCommitDevice("cuda");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "commit-device: \"cuda\" is not one of auto, cpu, gpu");
}

TEST(EncoderTest, CreateEncoderPicksTheDevice) {
  absl::StatusOr<std::unique_ptr<BlockEncoder>> cpu = CreateEncoder(CommitDevice::kCpu);
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->device_name(), "cpu");
  absl::StatusOr<std::unique_ptr<BlockEncoder>> gpu = CreateEncoder(CommitDevice::kGpu);
  absl::StatusOr<std::unique_ptr<BlockEncoder>> automatic = CreateEncoder(CommitDevice::kAuto);
  ASSERT_TRUE(automatic.ok());
#if !defined(KVPOOL_HAVE_GPU_ENCODER)
  // CI: built without CUDA. gpu is refused naming the reason; auto falls back to the CPU.
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpu.status().message(),
            "commit-device gpu: this build has no CUDA support (built without nvcc; "
            "KVPOOL_HAVE_CUDA off)");
  EXPECT_EQ((*automatic)->device_name(), "cpu");
#else
  // A CUDA build: gpu works exactly when a usable device is present, and auto follows it.
  if (gpu.ok()) {
    EXPECT_EQ((*gpu)->device_name(), "gpu");
    EXPECT_EQ((*automatic)->device_name(), "gpu");
  } else {
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*automatic)->device_name(), "cpu");
  }
#endif
}

TEST(EncoderTest, CpuBatchMatchesPerBlockAndIsolatesBadBlocks) {
  BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .page_size = 4};
  RotationMetadata meta{.model_name = "t", .head_dim = 8, .num_layers = 2, .num_kv_heads = 2};
  auto rot = RotationSet::Hadamard(meta);
  ASSERT_TRUE(rot.ok());
  std::vector<std::vector<uint8_t>> in;
  for (int i = 0; i < 3; ++i) {
    in.push_back(BlockBytes(g, i, 1));
  }
  const uint16_t nan = 0x7fc0;
  std::memcpy(in[1].data() + g.Bf16ChunkOffset(0, 1) + 6, &nan, 2);
  std::vector<std::vector<uint8_t>> bf16(3, std::vector<uint8_t>(g.Bf16FormBytes()));
  std::vector<std::vector<uint8_t>> int2(3, std::vector<uint8_t>(g.Int2FormBytes()));
  std::vector<EncodeJob> jobs(3);
  for (int i = 0; i < 3; ++i) {
    jobs[i].staging = in[i].data();
    jobs[i].bf16_out = bf16[i].data();
    jobs[i].int2_out = i == 2 ? nullptr : int2[i].data();
  }
  auto enc = NewCpuEncoder();
  ASSERT_TRUE(enc->EncodeBlocks(g, *rot, 0.96f, 0.92f, absl::MakeSpan(jobs)).ok());
  EXPECT_EQ(jobs[1].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(jobs[1].status.message(), "layer 0 head 1 K token 0 element 3 is nan");
  for (int i : {0, 2}) {
    ASSERT_TRUE(jobs[i].status.ok()) << jobs[i].status;
    std::vector<uint8_t> b(g.Bf16FormBytes()), q(g.Int2FormBytes());
    EncodeResult r;
    ASSERT_TRUE(
        EncodeBlock(g, *rot, 0.96f, 0.92f, in[i].data(), b.data(), i == 2 ? nullptr : q.data(), &r)
            .ok());
    EXPECT_EQ(b, bf16[i]);
    EXPECT_EQ(jobs[i].result.int2_ok, r.int2_ok);
    EXPECT_EQ(jobs[i].result.int2_ok, i == 0);
    if (i == 0) {
      EXPECT_EQ(q, int2[i]);
    }
  }
}

TEST(EncoderTest, BatchRefusesMalformedCalls) {
  BlockGeometry g{.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .page_size = 4};
  RotationMetadata meta{.model_name = "t", .head_dim = 8, .num_layers = 1, .num_kv_heads = 1};
  auto rot = RotationSet::Identity(meta);
  ASSERT_TRUE(rot.ok());
  std::vector<uint8_t> in = BlockBytes(g, 0, 0), out(g.Bf16FormBytes());
  std::vector<EncodeJob> jobs(2);
  jobs[0].staging = in.data();
  jobs[0].bf16_out = out.data();
  jobs[1].bf16_out = out.data();
  auto enc = NewCpuEncoder();
  absl::Status s = enc->EncodeBlocks(g, *rot, 0.96f, 0.92f, absl::MakeSpan(jobs));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "jobs[1].staging is null");
  jobs[1].staging = in.data();
  s = enc->EncodeBlocks(g, *rot, 1.5f, 0.92f, absl::MakeSpan(jobs));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("recipe.clip_ratio_k"), std::string::npos) << s.message();
  BlockGeometry odd = g;
  odd.head_dim = 12;
  s = enc->EncodeBlocks(odd, *rot, 0.96f, 0.92f, absl::MakeSpan(jobs));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("geometry"), std::string::npos) << s.message();
  EXPECT_TRUE(enc->EncodeBlocks(g, *rot, 0.96f, 0.92f, {}).ok());
  // A rotation of another shape never reaches the rotation (newcomer 12 F1: a 256-wide row over
  // 8x8 matrices read past them): INTERNAL from the batch and from EncodeBlock, outputs untouched.
  BlockGeometry wider = g, deeper = g, more_heads = g;
  wider.head_dim = 16;
  deeper.num_layers = 2;
  more_heads.num_kv_heads = 2;
  for (const BlockGeometry& other : {wider, deeper, more_heads}) {
    std::vector<uint8_t> big = BlockBytes(other, 0, 0), big_out(other.Bf16FormBytes(), 0xAB);
    std::vector<EncodeJob> one(1);
    one[0].staging = big.data();
    one[0].bf16_out = big_out.data();
    s = enc->EncodeBlocks(other, *rot, 0.96f, 0.92f, absl::MakeSpan(one));
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_NE(s.message().find("does not fit"), std::string::npos) << s.message();
    EncodeResult r;
    s = EncodeBlock(other, *rot, 0.96f, 0.92f, big.data(), big_out.data(), nullptr, &r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_EQ(big_out, std::vector<uint8_t>(other.Bf16FormBytes(), 0xAB));
  }
}

}  // namespace
}  // namespace kvpool::kvstore
