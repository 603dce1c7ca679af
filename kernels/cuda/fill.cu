// fill.cu — random fills for benchmarks/tests (see fill.h). A splitmix64 hash per element.
#include <cuda_runtime.h>

#include <string>

#include "device_utils.cuh"
#include "kvpool/kernels/cuda/fill.h"

namespace kvpool::cuda {
namespace {

__device__ __forceinline__ uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float Uniform(uint64_t h) {  // [0, 1)
  return float(h >> 40) * (1.0f / 16777216.0f);
}

__global__ void FillBf16Kernel(uint16_t* dst, uint64_t n, uint64_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float v = Uniform(Mix(seed ^ (i * 0x2545f4914f6cdd1dull))) * 4.f - 2.f;
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    dst[i] = *reinterpret_cast<const uint16_t*>(&b);
  }
}

__global__ void FillInt2Kernel(uint8_t* base, uint64_t num_pages, uint64_t stride, int heads, int d,
                               int page, uint64_t seed) {
  const int ng = d <= 128 ? 1 : d / 128;
  const uint64_t chunk = uint64_t(page) * (d / 2 + 8 * ng);
  const uint64_t code_bytes = uint64_t(page) * d / 2;  // K and V codes
  const uint64_t words_per_chunk = chunk / 4;
  const uint64_t total = num_pages * heads * words_per_chunk;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < total;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const uint64_t pg = i / (heads * words_per_chunk);
    const uint64_t rem = i % (heads * words_per_chunk);
    const uint64_t h = rem / words_per_chunk, w = rem % words_per_chunk;
    uint32_t* dst = reinterpret_cast<uint32_t*>(base + pg * stride + h * chunk) + w;
    const uint64_t r = Mix(seed ^ (i * 0x9e3779b97f4a7c15ull));
    if (w * 4 < code_bytes) {
      *dst = uint32_t(r);
    } else {
      const __half s = __float2half_rn(0.05f + 0.5f * Uniform(r));
      const __half m = __float2half_rn(-1.2f + 1.1f * Uniform(Mix(r)));
      *dst = uint32_t(__half_as_ushort(s)) | (uint32_t(__half_as_ushort(m)) << 16);
    }
  }
}

KernelStatus Err() {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return KernelStatus::Ok();
  return KernelStatus::Error(KernelError::kLaunchFailed, cudaGetErrorString(e));
}

}  // namespace

KernelStatus LaunchFillRandomBf16(uint16_t* dst, uint64_t n, uint64_t seed, Stream stream) {
  if (n == 0) return KernelStatus::Ok();
  if (dst == nullptr) return KernelStatus::Error(KernelError::kInvalidArgument, "dst is null");
  FillBf16Kernel<<<4096, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(dst, n, seed);
  return Err();
}

KernelStatus LaunchFillRandomInt2Pages(void* base, uint64_t num_pages, uint64_t stride, int heads,
                                       int d, int page, uint64_t seed, Stream stream) {
  if (num_pages == 0) return KernelStatus::Ok();
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % 4 != 0 || stride % 4 != 0)
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               "base/page_stride_bytes must be 4-byte aligned");
  if (d != 64 && d != 128 && d != 256)
    return KernelStatus::Error(KernelError::kUnsupported, "head_dim must be 64, 128 or 256");
  FillInt2Kernel<<<4096, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<uint8_t*>(base), num_pages, stride, heads, d, page, seed);
  return Err();
}

}  // namespace kvpool::cuda
