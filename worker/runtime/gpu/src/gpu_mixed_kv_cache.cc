// GpuMixedKvCache: see kvpool/worker/gpu_mixed_kv_cache.h.
#include "kvpool/worker/gpu_mixed_kv_cache.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/cuda/kv_write.h"
#include "kvpool/kernels/cuda/paged_decode.h"
#include "kvpool/kernels/numeric.h"

namespace kvpool::worker {
namespace {

absl::Status CudaError(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) {
    return absl::OkStatus();
  }
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
  }
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status KernelError(const cuda::KernelStatus& s, const std::string& what) {
  if (s.ok()) {
    return absl::OkStatus();
  }
  return absl::InternalError(
      absl::StrCat(what, ": ", cuda::KernelErrorName(s.code), ": ", s.message));
}

}  // namespace

GpuMixedKvCache::GpuMixedKvCache(int n_layers, const engine::AttentionShape& shape,
                                 std::shared_ptr<const RotationSet> rotations,
                                 const MixedCacheOptions& options)
    : shape_(shape),
      n_layers_(n_layers),
      options_(options),
      rotations_(std::move(rotations)),
      length_(static_cast<size_t>(n_layers), 0) {
  geometry_.num_layers = static_cast<uint32_t>(n_layers);
  geometry_.num_kv_heads = static_cast<uint32_t>(shape.n_kv_heads);
  geometry_.head_dim = static_cast<uint32_t>(shape.head_dim);
  geometry_.page_size = static_cast<uint32_t>(options.page_size);
  sink_blocks_ = options.sink_tokens / options.page_size;
  recent_blocks_ = (options.recent_tokens + options.page_size - 1) / options.page_size;
  max_blocks_ = (options.capacity + options.page_size - 1) / options.page_size;
}

absl::StatusOr<std::unique_ptr<GpuMixedKvCache>> GpuMixedKvCache::Create(
    int n_layers, const engine::AttentionShape& shape, std::shared_ptr<const RotationSet> rotations,
    const MixedCacheOptions& options) {
  if (n_layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("n_layers is ", n_layers, "; must be >= 1"));
  }
  if (shape.n_heads < 1 || shape.n_kv_heads < 1 || shape.n_heads % shape.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("shape.n_heads ", shape.n_heads,
                                                   " must be a positive multiple of n_kv_heads ",
                                                   shape.n_kv_heads));
  }
  if (shape.head_dim != 64 && shape.head_dim != 128 && shape.head_dim != 256) {
    return absl::FailedPreconditionError(absl::StrCat("shape.head_dim is ", shape.head_dim,
                                                      "; the CUDA kernels implement 64, 128, 256"));
  }
  if (shape.n_heads / shape.n_kv_heads > 16) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shape: GQA group ", shape.n_heads / shape.n_kv_heads, " exceeds the kernels' 16"));
  }
  if (options.page_size != 16 && options.page_size != 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.page_size is ", options.page_size, "; the kernels take 16 or 64"));
  }
  if (options.sink_tokens < 0 || options.sink_tokens % options.page_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("options.sink_tokens ", options.sink_tokens,
                                                   " must be a non-negative multiple of ",
                                                   options.page_size));
  }
  if (options.recent_tokens < 0) {
    return absl::InvalidArgumentError("options.recent_tokens must be >= 0");
  }
  if (options.capacity < 1 || options.capacity > (1 << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.capacity is ", options.capacity, "; must be in [1, 2^24]"));
  }
  for (float r : {options.clip_ratio_k, options.clip_ratio_v}) {
    if (!(r >= 0.0f && r <= 1.0f)) {
      return absl::InvalidArgumentError("options.clip_ratio_k/v must be in [0, 1]");
    }
  }
  if (rotations == nullptr) {
    return absl::InvalidArgumentError("rotations is null");
  }
  if (rotations->num_layers() != static_cast<uint32_t>(n_layers) ||
      rotations->num_kv_heads() != static_cast<uint32_t>(shape.n_kv_heads) ||
      rotations->head_dim() != static_cast<uint32_t>(shape.head_dim)) {
    return absl::FailedPreconditionError(
        absl::StrCat("rotations are for ", rotations->num_layers(), " layers, ",
                     rotations->num_kv_heads(), " KV heads, head_dim ", rotations->head_dim(),
                     "; the model has ", n_layers, ", ", shape.n_kv_heads, ", ", shape.head_dim));
  }
  std::unique_ptr<GpuMixedKvCache> cache(
      new GpuMixedKvCache(n_layers, shape, std::move(rotations), options));
  KVPOOL_RETURN_IF_ERROR(cache->Init());
  return cache;
}

absl::Status GpuMixedKvCache::Alloc(void** p, size_t bytes, const char* what) {
  KVPOOL_RETURN_IF_ERROR(CudaError(cudaMalloc(p, bytes), absl::StrCat("cudaMalloc ", what)));
  allocations_.push_back(*p);
  return absl::OkStatus();
}

absl::Status GpuMixedKvCache::Init() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return absl::UnavailableError("no usable CUDA device");
  }
  cudaStream_t s = nullptr;
  KVPOOL_RETURN_IF_ERROR(
      CudaError(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"));
  stream_ = s;
  const size_t bf16_layer = geometry_.Bf16LayerBytes();
  const size_t int2_layer = geometry_.Int2LayerBytes();
  for (int l = 0; l < n_layers_; ++l) {
    void* p = nullptr;
    KVPOOL_RETURN_IF_ERROR(Alloc(&p, bf16_layer * max_blocks_, "bf16 pool"));
    bf16_pool_.push_back(static_cast<uint8_t*>(p));
    KVPOOL_RETURN_IF_ERROR(Alloc(&p, int2_layer * max_blocks_, "int2 pool"));
    int2_pool_.push_back(static_cast<uint8_t*>(p));
  }
  const auto& mk = rotations_->matrices(KvKind::kKey);
  const auto& mv = rotations_->matrices(KvKind::kValue);
  void* p = nullptr;
  KVPOOL_RETURN_IF_ERROR(Alloc(&p, mk.size() * sizeof(float), "rotation_k"));
  rot_k_ = static_cast<float*>(p);
  KVPOOL_RETURN_IF_ERROR(Alloc(&p, mv.size() * sizeof(float), "rotation_v"));
  rot_v_ = static_cast<float*>(p);
  KVPOOL_RETURN_IF_ERROR(CudaError(
      cudaMemcpy(rot_k_, mk.data(), mk.size() * sizeof(float), cudaMemcpyHostToDevice), "R_K"));
  KVPOOL_RETURN_IF_ERROR(CudaError(
      cudaMemcpy(rot_v_, mv.data(), mv.size() * sizeof(float), cudaMemcpyHostToDevice), "R_V"));
  const size_t kv_dim = shape_.kv_dim();
  const size_t q_dim = shape_.q_dim();
  KVPOOL_RETURN_IF_ERROR(Alloc(&p, 2 * kv_dim * 2, "kv staging"));
  kv_dev_ = static_cast<uint16_t*>(p);
  KVPOOL_RETURN_IF_ERROR(Alloc(&p, q_dim * 2, "q"));
  q_dev_ = static_cast<uint16_t*>(p);
  KVPOOL_RETURN_IF_ERROR(Alloc(&p, q_dim * 2, "out"));
  out_dev_ = static_cast<uint16_t*>(p);
  // Layout: [0,4) write/demote indices; then 3 segments × (indptr[2], last[1], pad, pages).
  table_ints_ = 4 + 3 * (4 + static_cast<size_t>(max_blocks_));
  KVPOOL_RETURN_IF_ERROR(Alloc(&p, table_ints_ * sizeof(int32_t), "page tables"));
  table_dev_ = static_cast<int32_t*>(p);
  KVPOOL_RETURN_IF_ERROR(Alloc(&p, sizeof(uint32_t), "bad_rows"));
  bad_rows_dev_ = static_cast<uint32_t*>(p);
  KVPOOL_RETURN_IF_ERROR(CudaError(cudaMemset(bad_rows_dev_, 0, sizeof(uint32_t)), "memset"));
  KVPOOL_RETURN_IF_ERROR(
      CudaError(cudaMallocHost(reinterpret_cast<void**>(&kv_host_), 2 * kv_dim * 2), "pinned"));
  KVPOOL_RETURN_IF_ERROR(
      CudaError(cudaMallocHost(reinterpret_cast<void**>(&q_host_), q_dim * 2), "pinned"));
  KVPOOL_RETURN_IF_ERROR(
      CudaError(cudaMallocHost(reinterpret_cast<void**>(&out_host_), q_dim * 2), "pinned"));
  KVPOOL_RETURN_IF_ERROR(CudaError(
      cudaMallocHost(reinterpret_cast<void**>(&table_host_), table_ints_ * sizeof(int32_t)),
      "pinned"));
  return absl::OkStatus();
}

GpuMixedKvCache::~GpuMixedKvCache() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  }
  for (void* p : allocations_) {
    cudaFree(p);
  }
  for (void* p : {static_cast<void*>(kv_host_), static_cast<void*>(q_host_),
                  static_cast<void*>(out_host_), static_cast<void*>(table_host_)}) {
    if (p != nullptr) {
      cudaFreeHost(p);
    }
  }
  if (stream_ != nullptr) {
    cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  }
}

int GpuMixedKvCache::RecentStartBlock(int length) const {
  const int full = length / options_.page_size;
  return std::min(full, std::max(sink_blocks_, full - recent_blocks_));
}

int GpuMixedKvCache::Length(int layer) const {
  return layer >= 0 && layer < n_layers_ ? length_[layer] : 0;
}

absl::Status GpuMixedKvCache::CheckLayer(int layer) const {
  if (layer < 0 || layer >= n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside [0, ", n_layers_, ")"));
  }
  return absl::OkStatus();
}

absl::Status GpuMixedKvCache::Append(int layer, int pos, absl::Span<const float> k,
                                     absl::Span<const float> v) {
  KVPOOL_RETURN_IF_ERROR(CheckLayer(layer));
  if (pos < 0 || pos > length_[layer]) {
    return absl::InvalidArgumentError(
        absl::StrCat("pos ", pos, " outside [0, ", length_[layer], "] for layer ", layer));
  }
  if (pos >= options_.capacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pos ", pos, " reaches the cache capacity ", options_.capacity));
  }
  const int kv_dim = shape_.kv_dim();
  if (k.size() != static_cast<size_t>(kv_dim) || v.size() != static_cast<size_t>(kv_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("k/v have ", k.size(), "/", v.size(), " floats; expected H_kv*d = ", kv_dim));
  }
  for (int j = 0; j < kv_dim; ++j) {
    if (!std::isfinite(k[j]) || !std::isfinite(v[j])) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " pos ", pos, " element ", j,
                                                     " of ", std::isfinite(k[j]) ? "v" : "k",
                                                     " is not finite"));
    }
  }
  auto stream = static_cast<cudaStream_t>(stream_);
  // The pinned staging of the previous call may still be in flight.
  KVPOOL_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
  const int P = options_.page_size;
  // Truncation (pos < Length) needs no page work: every block keeps its BF16 page, and a block
  // rewritten from here on is demoted again when it leaves the window.
  length_[layer] = pos;
  for (int j = 0; j < kv_dim; ++j) {
    kv_host_[j] = Fp32ToBf16(k[j]);  // what a client sends
    kv_host_[kv_dim + j] = Fp32ToBf16(v[j]);
  }
  table_host_[0] = pos / P;
  table_host_[1] = pos % P;
  const bool completes = (pos + 1) % P == 0;
  const int leaving = RecentStartBlock(pos + 1) - 1;
  const bool demote = completes && options_.history == HistoryPrecision::kInt2 &&
                      leaving >= sink_blocks_ && leaving >= 0;
  table_host_[2] = leaving;
  table_host_[3] = leaving;
  KVPOOL_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(kv_dev_, kv_host_, 2 * kv_dim * 2, cudaMemcpyHostToDevice, stream),
                "H2D kv"));
  KVPOOL_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(table_dev_, table_host_, 4 * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
      "H2D indices"));
  const uint64_t d2 = static_cast<uint64_t>(shape_.head_dim) * shape_.head_dim;
  const uint64_t rot_layer = d2 * rotations_->heads_per_layer() * layer;

  cuda::KvWriteParams w;
  w.num_tokens = 1;
  w.num_kv_heads = shape_.n_kv_heads;
  w.head_dim = shape_.head_dim;
  w.page_size = P;
  w.k = kv_dev_;
  w.v = kv_dev_ + kv_dim;
  w.rotation_k = rot_k_ + rot_layer;
  w.rotation_v = rot_v_ + rot_layer;
  w.rotation_per_head = rotations_->per_head();
  w.dst_page = table_dev_;
  w.dst_slot = table_dev_ + 1;
  w.dst = {bf16_pool_[layer], geometry_.Bf16LayerBytes()};
  w.clip_ratio_k = options_.clip_ratio_k;
  w.clip_ratio_v = options_.clip_ratio_v;
  KVPOOL_RETURN_IF_ERROR(KernelError(cuda::LaunchRotateWriteBf16(w, stream),
                                     absl::StrCat("LaunchRotateWriteBf16 layer ", layer)));
  if (demote) {
    cuda::DemoteParams dp;
    dp.num_blocks = 1;
    dp.num_kv_heads = shape_.n_kv_heads;
    dp.head_dim = shape_.head_dim;
    dp.page_size = P;
    dp.src_pages = table_dev_ + 2;
    dp.dst_pages = table_dev_ + 3;
    dp.src = {bf16_pool_[layer], geometry_.Bf16LayerBytes()};
    dp.dst = {int2_pool_[layer], geometry_.Int2LayerBytes()};
    dp.clip_ratio_k = options_.clip_ratio_k;
    dp.clip_ratio_v = options_.clip_ratio_v;
    dp.bad_rows = bad_rows_dev_;
    KVPOOL_RETURN_IF_ERROR(
        KernelError(cuda::LaunchDemote(dp, stream), absl::StrCat("LaunchDemote layer ", layer)));
    ++stats_.demoted_chunks;
  }
  length_[layer] = pos + 1;
  return absl::OkStatus();
}

absl::Status GpuMixedKvCache::Attend(int layer, int pos, absl::Span<const float> q,
                                     absl::Span<float> out) {
  KVPOOL_RETURN_IF_ERROR(CheckLayer(layer));
  if (pos < 0 || pos >= length_[layer]) {
    return absl::InvalidArgumentError(
        absl::StrCat("pos ", pos, " outside [0, ", length_[layer], ") for layer ", layer));
  }
  const int q_dim = shape_.q_dim();
  if (q.size() != static_cast<size_t>(q_dim) || out.size() != static_cast<size_t>(q_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("q/out have ", q.size(), "/", out.size(),
                                                   " floats; expected H_q*d = ", q_dim));
  }
  auto stream = static_cast<cudaStream_t>(stream_);
  KVPOOL_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
  const int P = options_.page_size;
  const int n = pos + 1;
  const int sink_end = std::min(sink_blocks_, n / P);
  const int recent_start = RecentStartBlock(n);
  const int last_block = (n - 1) / P;
  const bool int2_history = options_.history == HistoryPrecision::kInt2;

  // Segment s at table offset 4 + s·(4 + max_blocks): indptr[2], last_page_len[1], pad, pages.
  const size_t seg_ints = 4 + static_cast<size_t>(max_blocks_);
  cuda::SegmentTable tables[3];
  // History in bf16 precision reads BF16 pages: it joins the recent segment (same pool, token
  // order preserved), so the kernel's INT2 history segment stays empty.
  const int begins[3] = {0, sink_end, int2_history ? recent_start : sink_end};
  const int ends[3] = {sink_end, int2_history ? recent_start : sink_end, last_block + 1};
  for (int s = 0; s < 3; ++s) {
    int32_t* t = table_host_ + 4 + s * seg_ints;
    const int count = ends[s] - begins[s];
    t[0] = 0;
    t[1] = count;
    t[2] = s == 2 ? n - last_block * P : P;
    t[3] = 0;
    for (int i = 0; i < count; ++i) {
      t[4 + i] = begins[s] + i;
    }
    if (count > 0) {
      const int32_t* dt = table_dev_ + 4 + s * seg_ints;
      tables[s] = cuda::SegmentTable{dt, dt + 4, dt + 2, count};
    }
  }
  for (int j = 0; j < q_dim; ++j) {
    q_host_[j] = Fp32ToBf16(q[j]);
  }
  KVPOOL_RETURN_IF_ERROR(
      CudaError(cudaMemcpyAsync(table_dev_ + 4, table_host_ + 4, 3 * seg_ints * sizeof(int32_t),
                                cudaMemcpyHostToDevice, stream),
                "H2D page tables"));
  KVPOOL_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(q_dev_, q_host_, q_dim * 2, cudaMemcpyHostToDevice, stream), "H2D q"));

  const uint64_t d2 = static_cast<uint64_t>(shape_.head_dim) * shape_.head_dim;
  const uint64_t rot_layer = d2 * rotations_->heads_per_layer() * layer;
  cuda::PagedDecodeParams p;
  p.batch = 1;
  p.num_q_heads = shape_.n_heads;
  p.num_kv_heads = shape_.n_kv_heads;
  p.head_dim = shape_.head_dim;
  p.page_size = P;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim));
  p.q = q_dev_;
  p.rotation_k = rot_k_ + rot_layer;
  p.rotation_v = rot_v_ + rot_layer;
  p.rotation_per_head = rotations_->per_head();
  p.bf16_pool = {bf16_pool_[layer], geometry_.Bf16LayerBytes()};
  p.int2_pool = {int2_pool_[layer], geometry_.Int2LayerBytes()};
  p.sink = tables[0];
  p.history = tables[1];
  p.recent = tables[2];
  p.out = out_dev_;
  size_t ws = 0;
  KVPOOL_RETURN_IF_ERROR(KernelError(cuda::PagedDecodeWorkspaceBytes(p, &ws), "workspace size"));
  if (ws > workspace_bytes_) {
    if (workspace_ != nullptr) {
      cudaFree(workspace_);
      allocations_.erase(std::find(allocations_.begin(), allocations_.end(), workspace_));
      workspace_ = nullptr;
      workspace_bytes_ = 0;
    }
    KVPOOL_RETURN_IF_ERROR(Alloc(&workspace_, ws, "workspace"));
    workspace_bytes_ = ws;
  }
  p.workspace = workspace_;
  p.workspace_bytes = workspace_bytes_;
  KVPOOL_RETURN_IF_ERROR(KernelError(cuda::LaunchPagedDecode(p, stream),
                                     absl::StrCat("LaunchPagedDecode layer ", layer)));
  ++stats_.decode_launches;
  uint32_t bad_rows = 0;
  KVPOOL_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(out_host_, out_dev_, q_dim * 2, cudaMemcpyDeviceToHost, stream), "D2H out"));
  KVPOOL_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(&bad_rows, bad_rows_dev_, sizeof(uint32_t), cudaMemcpyDeviceToHost, stream),
      "D2H bad_rows"));
  KVPOOL_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
  if (bad_rows != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(bad_rows,
                     " demoted rows could not be quantized (non-finite or fp16 "
                     "overflow; layer ",
                     layer, "): keeping such blocks in BF16 is not implemented on the GPU path"));
  }
  for (int j = 0; j < q_dim; ++j) {
    out[j] = Bf16ToFp32(out_host_[j]);
  }
  return absl::OkStatus();
}

}  // namespace kvpool::worker
