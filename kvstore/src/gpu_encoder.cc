// The pool's GPU commit encoder (gpu_encoder.h).
#include "gpu_encoder.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <list>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu_relayout.h"
#include "kvpool/common/checksum.h"
#include "kvpool/common/log.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/cuda/kv_write.h"

namespace kvpool::kvstore {
namespace {

absl::Status CudaError(cudaError_t e, const std::string& what) {
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

#define KVPOOL_CUDA_TRY(expr, what)       \
  do {                                    \
    const cudaError_t kvpool_e_ = (expr); \
    if (kvpool_e_ != cudaSuccess) {       \
      return CudaError(kvpool_e_, what);  \
    }                                     \
  } while (0)

absl::Status KernelError(const cuda::KernelStatus& st, const std::string& what) {
  return absl::InternalError(
      absl::StrCat(what, ": ", cuda::KernelErrorName(st.code), ": ", st.message));
}

// Device buffers of one encoder; sizes derived from batch_bytes B for the worst supported
// geometry (head_dim >= 64, page_size >= 16).
struct DeviceBuffers {
  uint8_t* in = nullptr;         // B: staging blocks
  uint16_t* tok = nullptr;       // B: token-major rows
  uint8_t* bf16 = nullptr;       // B: BF16 forms
  uint8_t* int2 = nullptr;       // B / 4: INT2 forms (ratio <= 0.16 at head_dim >= 64)
  uint8_t* flags = nullptr;      // B / 128: one byte per row (2·d bytes of staging)
  int32_t* page = nullptr;       // B / 256 tokens (4·d·L·H bytes per token per layer >= 256)
  int32_t* slot = nullptr;       // same
  int32_t* ids = nullptr;        // B / 4096 (block, layer) pairs (>= 4·P·d·H = 4096 bytes each)
  uint8_t* nonfinite = nullptr;  // B / 4096 blocks
};

class GpuEncoder final : public BlockEncoder {
 public:
  GpuEncoder(const GpuEncoderOptions& o, std::string device_desc)
      : options_(o), device_desc_(std::move(device_desc)), cpu_(NewCpuEncoder()) {}

  ~GpuEncoder() override {
    cudaSetDevice(options_.device);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
    }
    for (void* p :
         {static_cast<void*>(buf_.in), static_cast<void*>(buf_.tok), static_cast<void*>(buf_.bf16),
          static_cast<void*>(buf_.int2), static_cast<void*>(buf_.flags),
          static_cast<void*>(buf_.page), static_cast<void*>(buf_.slot),
          static_cast<void*>(buf_.ids), static_cast<void*>(buf_.nonfinite)}) {
      if (p != nullptr) {
        cudaFree(p);
      }
    }
    for (CachedRotation& r : rotations_) {
      cudaFree(r.dev);
    }
    if (stream_ != nullptr) {
      cudaStreamDestroy(stream_);
    }
    if (registered_ != nullptr) {
      cudaHostUnregister(registered_);
    }
  }

  absl::Status Init() {
    KVPOOL_CUDA_TRY(cudaSetDevice(options_.device), "cudaSetDevice");
    KVPOOL_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    const uint64_t B = options_.batch_bytes;
    auto alloc = [&](auto** p, uint64_t bytes) -> absl::Status {
      void* raw = nullptr;
      const cudaError_t e = cudaMalloc(&raw, std::max<uint64_t>(bytes, 256));
      if (e != cudaSuccess) {
        return CudaError(e, absl::StrCat("cudaMalloc(", bytes, " bytes)"));
      }
      *p = static_cast<std::remove_reference_t<decltype(*p)>>(raw);
      return absl::OkStatus();
    };
    KVPOOL_RETURN_IF_ERROR(alloc(&buf_.in, B));
    KVPOOL_RETURN_IF_ERROR(alloc(&buf_.tok, B));
    KVPOOL_RETURN_IF_ERROR(alloc(&buf_.bf16, B));
    KVPOOL_RETURN_IF_ERROR(alloc(&buf_.int2, B / 4));
    KVPOOL_RETURN_IF_ERROR(alloc(&buf_.flags, B / 128));
    KVPOOL_RETURN_IF_ERROR(alloc(&buf_.page, 4 * (B / 256)));
    KVPOOL_RETURN_IF_ERROR(alloc(&buf_.slot, 4 * (B / 256)));
    KVPOOL_RETURN_IF_ERROR(alloc(&buf_.ids, 4 * (B / 4096)));
    KVPOOL_RETURN_IF_ERROR(alloc(&buf_.nonfinite, B / 4096));
    return absl::OkStatus();
  }

  absl::Status EncodeBlocks(const BlockGeometry& g, const RotationSet& rotation, float clip_k,
                            float clip_v, absl::Span<EncodeJob> jobs) override {
    KVPOOL_RETURN_IF_ERROR(ValidateBatch(g, rotation, clip_k, clip_v, jobs));
    if (jobs.empty()) {
      return absl::OkStatus();
    }
    if (failed_.load(std::memory_order_relaxed) || !Supported(g, rotation)) {
      return cpu_->EncodeBlocks(g, rotation, clip_k, clip_v, jobs);
    }
    absl::Status st;
    {
      std::lock_guard<std::mutex> lock(mu_);
      st = EncodeOnDevice(g, rotation, clip_k, clip_v, jobs);
    }
    if (!st.ok()) {
      if (!failed_.exchange(true)) {
        KVPOOL_LOG_ERROR("GPU commit encoder failed, commits continue on the CPU: {}",
                         std::string(st.message()));
      }
      return cpu_->EncodeBlocks(g, rotation, clip_k, clip_v, jobs);
    }
    return absl::OkStatus();
  }

  std::string_view device_name() const override {
    return failed_.load(std::memory_order_relaxed) ? "cpu" : "gpu";
  }

  void RegisterHostMemory(void* base, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (registered_ != nullptr || base == nullptr || bytes == 0) {
      return;
    }
    cudaSetDevice(options_.device);
    const cudaError_t e = cudaHostRegister(base, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky; clear it
      KVPOOL_LOG_WARN(
          "GPU encoder: cannot page-lock {} bytes of pool memory for the device ({}); "
          "staging copies go through the driver's bounce buffer",
          bytes, cudaGetErrorString(e));
      return;
    }
    registered_ = base;
  }

  std::string Describe() const override {
    if (failed_.load(std::memory_order_relaxed)) {
      return absl::StrCat("cpu (the GPU encoder on ", device_desc_, " failed)");
    }
    return absl::StrCat("gpu: ", device_desc_, ", batch ", options_.batch_bytes >> 20, " MiB");
  }

 private:
  struct CachedRotation {
    std::string key;
    float* dev = nullptr;  // [2][L][Hr][d][d]: K matrices then V matrices
    uint64_t floats_per_kind = 0;
  };

  bool Supported(const BlockGeometry& g, const RotationSet& r) const {
    const bool d_ok = g.head_dim == 64 || g.head_dim == 128 || g.head_dim == 256;
    const bool p_ok = g.page_size == 16 || g.page_size == 64;
    const bool rot_ok = r.head_dim() == g.head_dim && r.num_layers() >= g.num_layers &&
                        (!r.per_head() || r.num_kv_heads() == g.num_kv_heads);
    return d_ok && p_ok && rot_ok && g.Bf16FormBytes() <= options_.batch_bytes;
  }

  // The device copy of `r`, uploading it on first use. Requires mu_.
  absl::StatusOr<const CachedRotation*> DeviceRotation(const RotationSet& r) {
    std::string key = r.rotation_id_hex();
    const std::vector<float>& k = r.matrices(KvKind::kKey);
    const std::vector<float>& v = r.matrices(KvKind::kValue);
    if (key.empty()) {
      key = absl::StrFormat("xxh3:%016x:%016x", Xxh3(k.data(), k.size() * sizeof(float)),
                            Xxh3(v.data(), v.size() * sizeof(float)));
    }
    for (auto it = rotations_.begin(); it != rotations_.end(); ++it) {
      if (it->key == key) {
        rotations_.splice(rotations_.begin(), rotations_, it);
        return &rotations_.front();
      }
    }
    while (rotations_.size() >= options_.max_cached_rotations && !rotations_.empty()) {
      KVPOOL_CUDA_TRY(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      cudaFree(rotations_.back().dev);
      rotations_.pop_back();
    }
    CachedRotation c;
    c.key = key;
    c.floats_per_kind = k.size();
    KVPOOL_CUDA_TRY(cudaMalloc(&c.dev, 2 * k.size() * sizeof(float)), "cudaMalloc(rotation)");
    rotations_.push_front(c);
    KVPOOL_CUDA_TRY(cudaMemcpy(c.dev, k.data(), k.size() * sizeof(float), cudaMemcpyHostToDevice),
                    "cudaMemcpy(rotation K)");
    KVPOOL_CUDA_TRY(
        cudaMemcpy(c.dev + k.size(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice),
        "cudaMemcpy(rotation V)");
    return &rotations_.front();
  }

  // Requires mu_. A non-OK status is a device failure (the caller re-encodes on the CPU).
  absl::Status EncodeOnDevice(const BlockGeometry& g, const RotationSet& rotation, float clip_k,
                              float clip_v, absl::Span<EncodeJob> jobs) {
    KVPOOL_CUDA_TRY(cudaSetDevice(options_.device), "cudaSetDevice");
    KVPOOL_ASSIGN_OR_RETURN(const CachedRotation* rot, DeviceRotation(rotation));
    const uint64_t F = g.Bf16FormBytes();
    const uint64_t Q = g.Int2FormBytes();
    const uint32_t L = g.num_layers, H = g.num_kv_heads, d = g.head_dim, P = g.page_size;
    const uint64_t rows_per_block = uint64_t(L) * H * 2 * P;
    const uint64_t per_matrix = uint64_t(d) * d;
    const uint64_t mats_per_layer = rotation.heads_per_layer();
    const size_t max_blocks = size_t(options_.batch_bytes / F);
    for (size_t start = 0; start < jobs.size(); start += max_blocks) {
      const uint32_t n = uint32_t(std::min(max_blocks, jobs.size() - start));
      for (uint32_t i = 0; i < n; ++i) {
        KVPOOL_CUDA_TRY(cudaMemcpyAsync(buf_.in + i * F, jobs[start + i].staging, F,
                                        cudaMemcpyHostToDevice, stream_),
                        "cudaMemcpyAsync(staging)");
      }
      KVPOOL_CUDA_TRY(cudaMemsetAsync(buf_.nonfinite, 0, n, stream_), "cudaMemsetAsync");
      const int e =
          gpu::LaunchStagingToTokenMajor(reinterpret_cast<const uint16_t*>(buf_.in), buf_.tok, n, g,
                                         buf_.nonfinite, buf_.page, buf_.slot, buf_.ids, stream_);
      if (e != 0) {
        return CudaError(cudaError_t(e), "relayout kernel");
      }
      const uint64_t layer_elems = uint64_t(n) * P * H * d;  // one of K or V of one layer
      for (uint32_t l = 0; l < L; ++l) {
        cuda::KvWriteParams p;
        p.num_tokens = int32_t(n * P);
        p.num_kv_heads = int32_t(H);
        p.head_dim = int32_t(d);
        p.page_size = int32_t(P);
        p.k = buf_.tok + (2 * l) * layer_elems;
        p.v = buf_.tok + (2 * l + 1) * layer_elems;
        p.token_stride = 0;
        p.rotation_k = rot->dev + l * mats_per_layer * per_matrix;
        p.rotation_v = rot->dev + rot->floats_per_kind + l * mats_per_layer * per_matrix;
        p.rotation_per_head = rotation.per_head();
        p.dst_page = buf_.page;
        p.dst_slot = buf_.slot;
        p.dst = {buf_.bf16 + l * g.Bf16LayerBytes(), F};
        const cuda::KernelStatus ks = cuda::LaunchRotateWriteBf16(p, stream_);
        if (!ks.ok()) {
          return KernelError(ks, absl::StrCat("LaunchRotateWriteBf16 layer ", l));
        }
      }
      cuda::DemoteParams dp;
      dp.num_blocks = int32_t(n * L);  // page (b, l) = b·L + l with stride = one layer
      dp.num_kv_heads = int32_t(H);
      dp.head_dim = int32_t(d);
      dp.page_size = int32_t(P);
      dp.src_pages = buf_.ids;
      dp.dst_pages = buf_.ids;
      dp.src = {buf_.bf16, g.Bf16LayerBytes()};
      dp.dst = {buf_.int2, g.Int2LayerBytes()};
      dp.clip_ratio_k = clip_k;
      dp.clip_ratio_v = clip_v;
      dp.row_flags = buf_.flags;  // [(b·L + l)·P + t][H][2] = block b's rows are contiguous
      const cuda::KernelStatus ks = cuda::LaunchDemote(dp, stream_);
      if (!ks.ok()) {
        return KernelError(ks, "LaunchDemote");
      }
      host_flags_.resize(n * rows_per_block);
      host_nonfinite_.resize(n);
      KVPOOL_CUDA_TRY(cudaMemcpyAsync(host_flags_.data(), buf_.flags, host_flags_.size(),
                                      cudaMemcpyDeviceToHost, stream_),
                      "cudaMemcpyAsync(flags)");
      KVPOOL_CUDA_TRY(cudaMemcpyAsync(host_nonfinite_.data(), buf_.nonfinite, n,
                                      cudaMemcpyDeviceToHost, stream_),
                      "cudaMemcpyAsync(nonfinite)");
      for (uint32_t i = 0; i < n; ++i) {
        EncodeJob& j = jobs[start + i];
        // A BF16 form kept only as the fallback of a refused INT2 form is not copied back: a
        // refused block is re-encoded on the CPU below.
        if (j.bf16_wanted || j.int2_out == nullptr) {
          KVPOOL_CUDA_TRY(
              cudaMemcpyAsync(j.bf16_out, buf_.bf16 + i * F, F, cudaMemcpyDeviceToHost, stream_),
              "cudaMemcpyAsync(bf16 form)");
        }
        if (j.int2_out != nullptr) {
          KVPOOL_CUDA_TRY(
              cudaMemcpyAsync(j.int2_out, buf_.int2 + i * Q, Q, cudaMemcpyDeviceToHost, stream_),
              "cudaMemcpyAsync(int2 form)");
        }
      }
      KVPOOL_CUDA_TRY(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      for (uint32_t i = 0; i < n; ++i) {
        EncodeJob& j = jobs[start + i];
        const uint8_t* f = host_flags_.data() + i * rows_per_block;
        const bool refused_row = std::any_of(f, f + rows_per_block, [](uint8_t x) { return x; });
        if (host_nonfinite_[i] != 0 || refused_row) {
          // The CPU path decides: its NaN/Inf error, its overflow rows, its rotation.
          j.result = EncodeResult{};
          j.status = EncodeBlock(g, rotation, clip_k, clip_v, j.staging, j.bf16_out, j.int2_out,
                                 &j.result);
          continue;
        }
        j.status = absl::OkStatus();
        j.result = EncodeResult{.int2_ok = j.int2_out != nullptr, .overflow_rows = 0};
      }
    }
    return absl::OkStatus();
  }

  const GpuEncoderOptions options_;
  const std::string device_desc_;
  const std::unique_ptr<BlockEncoder> cpu_;
  std::atomic<bool> failed_{false};

  std::mutex mu_;  // serializes device work; guards everything below
  cudaStream_t stream_ = nullptr;
  DeviceBuffers buf_;
  std::list<CachedRotation> rotations_;  // most recently used first
  void* registered_ = nullptr;           // RegisterHostMemory's base, or null
  std::vector<uint8_t> host_flags_;
  std::vector<uint8_t> host_nonfinite_;
};

// Encodes one small block (identity rotation, integer values: exact on both paths) on the GPU
// and the CPU and compares the bytes: catches a device the kernels cannot run on.
absl::Status SelfTest(BlockEncoder& gpu) {
  const BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .page_size = 16};
  RotationMetadata meta{.model_name = "gpu-encoder-self-test",
                        .head_dim = g.head_dim,
                        .num_layers = g.num_layers,
                        .num_kv_heads = g.num_kv_heads};
  KVPOOL_ASSIGN_OR_RETURN(RotationSet rot, RotationSet::Identity(meta));
  std::vector<uint8_t> in(g.Bf16FormBytes());
  for (size_t i = 0; i < in.size() / 2; ++i) {
    const float x = float(int((i * 37) % 41) - 20);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    const uint16_t b = uint16_t(bits >> 16);
    std::memcpy(in.data() + 2 * i, &b, 2);
  }
  std::vector<uint8_t> bf_gpu(g.Bf16FormBytes()), i2_gpu(g.Int2FormBytes());
  std::vector<uint8_t> bf_cpu(g.Bf16FormBytes()), i2_cpu(g.Int2FormBytes());
  EncodeJob job{.staging = in.data(), .bf16_out = bf_gpu.data(), .int2_out = i2_gpu.data()};
  KVPOOL_RETURN_IF_ERROR(gpu.EncodeBlocks(g, rot, 0.96f, 0.92f, absl::MakeSpan(&job, 1)));
  if (gpu.device_name() != "gpu") {
    return absl::InternalError("the self-test encode failed on the device");
  }
  KVPOOL_RETURN_IF_ERROR(job.status);
  EncodeResult r;
  KVPOOL_RETURN_IF_ERROR(
      EncodeBlock(g, rot, 0.96f, 0.92f, in.data(), bf_cpu.data(), i2_cpu.data(), &r));
  if (bf_gpu != bf_cpu || i2_gpu != i2_cpu || job.result.int2_ok != r.int2_ok) {
    return absl::InternalError("the self-test encode differs from the CPU encoder");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<BlockEncoder>> CreateGpuEncoder(const GpuEncoderOptions& options) {
  if (options.batch_bytes < (1ull << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_bytes: ", options.batch_bytes, " is below 1 MiB"));
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device", e != cudaSuccess ? absl::StrCat(" (", cudaGetErrorString(e), ")") : ""));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("device: ", options.device, " is not one of the ", count, " CUDA devices"));
  }
  cudaDeviceProp prop{};
  if (cudaError_t pe = cudaGetDeviceProperties(&prop, options.device); pe != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cudaGetDeviceProperties: ", cudaGetErrorString(pe)));
  }
  if (prop.major != 9 || prop.minor != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("device ", options.device, " (", prop.name, ") has compute capability ",
                     prop.major, ".", prop.minor, "; the kernels are built for 9.0 (sm_90a)"));
  }
  auto enc = std::make_unique<GpuEncoder>(
      options, absl::StrCat(prop.name, " (device ", options.device, ", cc ", prop.major, ".",
                            prop.minor, ")"));
  if (absl::Status s = enc->Init(); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("GPU encoder setup: ", s.message()));
  }
  if (absl::Status s = SelfTest(*enc); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("GPU encoder self-test: ", s.message()));
  }
  return std::unique_ptr<BlockEncoder>(std::move(enc));
}

}  // namespace kvpool::kvstore
