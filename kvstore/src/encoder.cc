// Commit-time block encoding (encoder.h).
#include "kvpool/kvstore/encoder.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvpool/common/log.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/quantize.h"
#include "kvpool/kernels/rotation_file.h"

#if defined(KVPOOL_HAVE_GPU_ENCODER)
#include "gpu_encoder.h"
#endif

namespace kvpool::kvstore {

absl::Status CheckFinite(const BlockGeometry& g, const uint8_t* bf16_form) {
  const uint64_t row_elems = g.head_dim;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
      const uint8_t* chunk = bf16_form + g.Bf16ChunkOffset(l, h);
      for (int kv = 0; kv < 2; ++kv) {
        const uint8_t* base = chunk + (kv ? g.Bf16VOffset() : 0);
        for (uint32_t t = 0; t < g.page_size; ++t) {
          for (uint64_t j = 0; j < row_elems; ++j) {
            uint16_t x;
            std::memcpy(&x, base + (t * row_elems + j) * 2, 2);
            if ((x & 0x7f80u) == 0x7f80u) {
              const bool nan = (x & 0x007fu) != 0;
              return absl::InvalidArgumentError(absl::StrCat(
                  "layer ", l, " head ", h, " ", kv ? "V" : "K", " token ", t, " element ", j,
                  " is ", nan ? "nan" : ((x & 0x8000u) ? "-inf" : "inf")));
            }
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

// INTERNAL unless `rotation`'s matrices have g's shape (ValidateBatch, EncodeBlock).
absl::Status RotationFits(const BlockGeometry& g, const RotationSet& rotation) {
  absl::Status s = CheckRotationsMatch(
      rotation,
      {.head_dim = g.head_dim, .num_layers = g.num_layers, .num_kv_heads = g.num_kv_heads});
  if (s.ok()) return s;
  // Registration refuses such a pair (newcomer 12 F1): reaching here is a bug, not bad input.
  return absl::InternalError(
      absl::StrCat("the model's rotation does not fit its geometry: ", s.message()));
}

absl::Status EncodeBlock(const BlockGeometry& g, const RotationSet& rotation, float clip_k,
                         float clip_v, const uint8_t* staging, uint8_t* bf16_out, uint8_t* int2_out,
                         EncodeResult* result) {
  KVPOOL_RETURN_IF_ERROR(ValidateHeadDim(g.head_dim, "geometry.head_dim"));
  KVPOOL_RETURN_IF_ERROR(RotationFits(g, rotation));
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(clip_k, "recipe.clip_ratio_k"));
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(clip_v, "recipe.clip_ratio_v"));
  KVPOOL_RETURN_IF_ERROR(CheckFinite(g, staging));
  const uint32_t P = g.page_size;
  const uint32_t d = g.head_dim;
  // Scratch for the INT2 outputs when the caller does not want them (the fused kernel always
  // produces codes; the rotated bf16 values are what we keep).
  std::vector<uint8_t> codes_scratch;
  std::vector<uint16_t> params_scratch;
  if (int2_out == nullptr) {
    codes_scratch.resize(size_t{P} * d / 4);
    params_scratch.resize(size_t{P} * 2 * g.GroupsPerRow());
  }
  QuantizeRowsResult total;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
      const uint64_t in_chunk = g.Bf16ChunkOffset(l, h);
      const uint64_t q_chunk = g.Int2ChunkOffset(l, h);
      for (int kv = 0; kv < 2; ++kv) {
        const uint64_t rows_off = in_chunk + (kv ? g.Bf16VOffset() : 0);
        const auto* x = reinterpret_cast<const uint16_t*>(staging + rows_off);
        auto* rotated = reinterpret_cast<uint16_t*>(bf16_out + rows_off);
        uint8_t* codes = codes_scratch.data();
        uint16_t* params = params_scratch.data();
        if (int2_out != nullptr) {
          codes = int2_out + q_chunk + (kv ? g.Int2VCodesOffset() : g.Int2KCodesOffset());
          params = reinterpret_cast<uint16_t*>(
              int2_out + q_chunk + (kv ? g.Int2VParamsOffset() : g.Int2KParamsOffset()));
        }
        QuantizeRowsResult r;
        absl::Status s = RotateQuantizeRowsBf16(
            x, P, d, rotation.Matrix(kv ? KvKind::kValue : KvKind::kKey, l, h),
            kv ? clip_v : clip_k, rotated, codes, params, &r);
        if (!s.ok()) {
          return Annotate(s, absl::StrCat("layer ", l, " head ", h, kv ? " V" : " K"));
        }
        total.overflow_rows += r.overflow_rows;
      }
    }
  }
  result->overflow_rows = total.overflow_rows;
  result->int2_ok = int2_out != nullptr && total.overflow_rows == 0;
  return absl::OkStatus();
}

const char* CommitDeviceName(CommitDevice d) {
  switch (d) {
    case CommitDevice::kAuto:
      return "auto";
    case CommitDevice::kCpu:
      return "cpu";
    case CommitDevice::kGpu:
      return "gpu";
  }
  return "?";
}

absl::StatusOr<CommitDevice> ParseCommitDevice(std::string_view text, const char* field) {
  for (CommitDevice d : {CommitDevice::kAuto, CommitDevice::kCpu, CommitDevice::kGpu}) {
    if (text == CommitDeviceName(d)) {
      return d;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", std::string(text), "\" is not one of auto, cpu, gpu"));
}

namespace {

class CpuEncoder final : public BlockEncoder {
 public:
  absl::Status EncodeBlocks(const BlockGeometry& g, const RotationSet& rotation, float clip_k,
                            float clip_v, absl::Span<EncodeJob> jobs) override {
    KVPOOL_RETURN_IF_ERROR(ValidateBatch(g, rotation, clip_k, clip_v, jobs));
    for (EncodeJob& j : jobs) {
      j.result = EncodeResult{};
      j.status =
          EncodeBlock(g, rotation, clip_k, clip_v, j.staging, j.bf16_out, j.int2_out, &j.result);
    }
    return absl::OkStatus();
  }
  std::string_view device_name() const override { return "cpu"; }
  std::string Describe() const override { return "cpu: kernels library (RotateQuantizeRowsBf16)"; }
};

}  // namespace

absl::Status ValidateBatch(const BlockGeometry& g, const RotationSet& rotation, float clip_k,
                           float clip_v, absl::Span<const EncodeJob> jobs) {
  if (!g.Valid()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry: num_layers ", g.num_layers, ", num_kv_heads ", g.num_kv_heads, ", head_dim ",
        g.head_dim, ", page_size ", g.page_size, " is not a valid block geometry"));
  }
  KVPOOL_RETURN_IF_ERROR(ValidateHeadDim(g.head_dim, "geometry.head_dim"));
  KVPOOL_RETURN_IF_ERROR(RotationFits(g, rotation));
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(clip_k, "recipe.clip_ratio_k"));
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(clip_v, "recipe.clip_ratio_v"));
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (jobs[i].staging == nullptr || jobs[i].bf16_out == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "jobs[", i, "].", jobs[i].staging == nullptr ? "staging" : "bf16_out", " is null"));
    }
  }
  return absl::OkStatus();
}

std::unique_ptr<BlockEncoder> NewCpuEncoder() { return std::make_unique<CpuEncoder>(); }

absl::StatusOr<std::unique_ptr<BlockEncoder>> CreateEncoder(CommitDevice device) {
  if (device == CommitDevice::kCpu) {
    return NewCpuEncoder();
  }
#if defined(KVPOOL_HAVE_GPU_ENCODER)
  absl::StatusOr<std::unique_ptr<BlockEncoder>> gpu = CreateGpuEncoder(GpuEncoderOptions{});
#else
  absl::StatusOr<std::unique_ptr<BlockEncoder>> gpu = absl::FailedPreconditionError(
      "this build has no CUDA support (built without nvcc; KVPOOL_HAVE_CUDA off)");
#endif
  if (gpu.ok() || device == CommitDevice::kGpu) {
    if (!gpu.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("commit-device gpu: ", gpu.status().message()));
    }
    return gpu;
  }
  KVPOOL_LOG_INFO("commit device auto: using the CPU ({})", std::string(gpu.status().message()));
  return NewCpuEncoder();
}

}  // namespace kvpool::kvstore
