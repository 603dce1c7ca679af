// gpu_relayout.cu — staging blocks → token-major rows, NaN/Inf flags, index arrays
// (gpu_relayout.h). Memory-bound copy: each thread moves 16-byte pieces (8 bf16 values).
#include <cuda_runtime.h>

#include <algorithm>

#include "gpu_relayout.h"

namespace kvpool::kvstore::gpu {
namespace {

__device__ __forceinline__ bool HasNonFiniteBf16(uint32_t w) {
  // Two bf16 values; exponent bits all ones means NaN or ±Inf.
  return (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
}

__global__ void StagingToTokenMajorKernel(const uint4* __restrict__ in, uint4* __restrict__ out,
                                          uint32_t n, uint32_t L, uint32_t H, uint32_t P,
                                          uint32_t d8, uint8_t* __restrict__ nonfinite) {
  const uint64_t total = uint64_t(n) * L * H * 2 * P * d8;
  const uint64_t rows_per_kv = uint64_t(n) * P;  // tokens of one layer
  for (uint64_t c = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; c < total;
       c += uint64_t(gridDim.x) * blockDim.x) {
    uint64_t r = c;
    const uint32_t j8 = uint32_t(r % d8);
    r /= d8;
    const uint32_t t = uint32_t(r % P);
    r /= P;
    const uint32_t kv = uint32_t(r % 2);
    r /= 2;
    const uint32_t h = uint32_t(r % H);
    r /= H;
    const uint32_t l = uint32_t(r % L);
    const uint32_t b = uint32_t(r / L);
    const uint4 v = in[c];
    if (HasNonFiniteBf16(v.x) || HasNonFiniteBf16(v.y) || HasNonFiniteBf16(v.z) ||
        HasNonFiniteBf16(v.w)) {
      nonfinite[b] = 1;
    }
    const uint64_t token = uint64_t(b) * P + t;
    const uint64_t o = ((uint64_t(2 * l + kv) * rows_per_kv + token) * H + h) * d8 + j8;
    out[o] = v;
  }
}

__global__ void IndexKernel(uint32_t tokens, uint32_t P, uint32_t nids, int32_t* page,
                            int32_t* slot, int32_t* ids) {
  const uint32_t m = tokens > nids ? tokens : nids;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < m; i += gridDim.x * blockDim.x) {
    if (i < tokens) {
      page[i] = int32_t(i / P);
      slot[i] = int32_t(i % P);
    }
    if (i < nids) {
      ids[i] = int32_t(i);
    }
  }
}

}  // namespace

int LaunchStagingToTokenMajor(const uint16_t* in, uint16_t* out, uint32_t num_blocks,
                              const BlockGeometry& g, uint8_t* nonfinite, int32_t* page,
                              int32_t* slot, int32_t* ids, CUstream_st* stream) {
  if (num_blocks == 0) {
    return 0;
  }
  const uint64_t total =
      uint64_t(num_blocks) * g.num_layers * g.num_kv_heads * 2 * g.page_size * (g.head_dim / 8);
  constexpr int kThreads = 256;
  const uint64_t want = (total + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(std::min<uint64_t>(want, 132 * 16));
  StagingToTokenMajorKernel<<<grid, kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(in), reinterpret_cast<uint4*>(out), num_blocks, g.num_layers,
      g.num_kv_heads, g.page_size, g.head_dim / 8, nonfinite);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return int(e);
  }
  const uint32_t tokens = num_blocks * g.page_size;
  const uint32_t nids = num_blocks * g.num_layers;
  const uint32_t m = std::max(tokens, nids);
  IndexKernel<<<std::min<uint32_t>((m + kThreads - 1) / kThreads, 1024), kThreads, 0, stream>>>(
      tokens, g.page_size, nids, page, slot, ids);
  return int(cudaGetLastError());
}

const char* CudaErrorName(int code) { return cudaGetErrorName(cudaError_t(code)); }

}  // namespace kvpool::kvstore::gpu
