// cuda_test_util.h — helpers for the GPU tests of kvpool_cuda_kernels: device buffers, random
// data, a float64 reference for paged decode attention over dequantized pages.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#define KVPOOL_CUDA_OK(expr)                                               \
  do {                                                                     \
    cudaError_t e_ = (expr);                                               \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

namespace kvpool::cuda::testing {

// Owning device allocation (cudaMalloc / cudaFree).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { Reset(bytes); }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void Reset(size_t bytes) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = bytes;
    if (bytes > 0 && cudaMalloc(&ptr_, bytes) != cudaSuccess) ptr_ = nullptr;
  }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }
  bool ok() const { return ptr_ != nullptr || bytes_ == 0; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <typename T>
void Upload(DeviceBuffer& buf, const std::vector<T>& v) {
  buf.Reset(v.size() * sizeof(T));
  if (!v.empty()) cudaMemcpy(buf.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
}
template <typename T>
std::vector<T> Download(const void* dev, size_t n) {
  std::vector<T> v(n);
  if (n > 0) cudaMemcpy(v.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

bool HaveGpu();

uint16_t ToBf16(double x);
double FromBf16(uint16_t b);
uint16_t ToFp16Nearest(double x);
double FromFp16(uint16_t h);

// Random orthogonal d×d matrix (Gram–Schmidt on Gaussian columns), row-major, float64.
std::vector<double> RandomOrthogonal(int d, std::mt19937_64& rng);
std::vector<float> ToFloat(const std::vector<double>& v);

// One decode problem: pages, page tables and the float64 reference.
struct DecodeCase {
  int batch = 1, hq = 4, hkv = 1, d = 128, page = 16;
  std::vector<int> sink_len, hist_len, recent_len;  // tokens per request (hist multiple of page)
  bool rotate = true;
  bool per_head_rotation = false;
  uint64_t seed = 1;
  int64_t page_id_offset = 0;  // added to every page id (tests 64-bit byte offsets)
  // NaN injection: q of (nan_q_request, nan_q_head) and one valid sink K element of request
  // nan_k_request (-1 = none). Affected outputs must be NaN, all others unaffected.
  int nan_q_request = -1, nan_q_head = -1, nan_k_request = -1;
  // Standard deviation of the random q elements (1 = N(0, 1)). Large values sharpen the softmax
  // until one token holds most of the mass (peaked attention).
  double q_scale = 1.0;
};

struct DecodeResult {
  double rel_l2 = 0;             // ‖out − ref‖ / ‖ref‖ over all outputs
  double max_lse_err = 0;        // max |lse − ref| over heads with a finite reference
  int64_t unwritten = 0;         // outputs still holding the poison pattern
  int64_t lse_inf_mismatch = 0;  // heads where exactly one of (gpu, ref) lse is -inf
  int64_t nan_expected = 0;      // outputs that must be NaN (NaN inputs)
  int64_t nan_missing = 0;       // ... of which were not NaN
  int64_t nan_leaked = 0;        // NaN outputs where the inputs were finite
  std::string error;             // launcher error, if any
};

// Builds the case on the GPU, runs LaunchPagedDecode, and compares with the float64 reference.
DecodeResult RunDecodeCase(const DecodeCase& c);

}  // namespace kvpool::cuda::testing
