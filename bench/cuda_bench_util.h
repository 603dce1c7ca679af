// cuda_bench_util.h — the harness the CUDA benchmarks share (bench/cuda_decode_bench.cc,
// bench/cuda_write_bench.cc): error checks, an owning device buffer, the PERF.md timing rule
// (warm-up, L2 flushed by a 256 MiB memset before every timed run, CUDA events, median and
// min) and the device description every result JSON carries.
//
// Header-only and private to bench/ (includes cuda_runtime.h and nlohmann/json). Errors are
// reported by throwing CudaError; the benchmarks catch it in main and exit 2.
// Thread-safety: none of this is meant to be shared between threads.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvpool/common/version.h"
#include "kvpool/kernels/cuda/status.h"

namespace kvpool::bench {

// PERF.md: the HBM streaming roofline of the H200 the benchmarks report against (GB/s).
constexpr double kRooflineGBs = 4600.0;
// Bytes of the memset that evicts L2 before every timed run (H200 L2 is 60 MiB).
constexpr size_t kL2FlushBytes = 256ull << 20;

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws CudaError("<what>: <reason>") unless the call succeeded.
inline void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}
inline void Check(const kvpool::cuda::KernelStatus& s, const char* what) {
  if (!s.ok()) throw CudaError(std::string(what) + ": " + s.message);
}

// Owning device allocation of `n` bytes (cudaMalloc; freed in the destructor).
struct Buf {
  void* p = nullptr;
  size_t n = 0;
  Buf() = default;
  explicit Buf(size_t bytes) : n(bytes) {
    if (bytes) Check(cudaMalloc(&p, bytes), "cudaMalloc");
  }
  ~Buf() {
    if (p) cudaFree(p);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Copies `v` to a new device buffer (at least 16 bytes, so empty vectors give a valid pointer).
template <typename T>
std::unique_ptr<Buf> UploadVec(const std::vector<T>& v) {
  auto b = std::make_unique<Buf>(std::max<size_t>(v.size() * sizeof(T), 16));
  if (!v.empty())
    Check(cudaMemcpy(b->p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return b;
}

struct Stats {
  double median_ms = 0, min_ms = 0;
};

// Times launches on `stream` by the PERF.md rule: `warmup` untimed runs, then `iters` runs
// each preceded (untimed) by prepare() and an L2-flushing memset, timed with CUDA events.
struct Timer {
  cudaStream_t stream;
  Buf flush{kL2FlushBytes};
  cudaEvent_t e0{}, e1{};
  int iters, warmup;
  Timer(cudaStream_t s, int it, int wu) : stream(s), iters(it), warmup(wu) {
    Check(cudaEventCreate(&e0), "event");
    Check(cudaEventCreate(&e1), "event");
  }
  ~Timer() {
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  Stats Time(const std::function<void()>& prepare, const std::function<void()>& run) {
    for (int i = 0; i < warmup; ++i) {
      prepare();
      run();
    }
    Check(cudaStreamSynchronize(stream), "warmup");
    std::vector<float> ms;
    for (int i = 0; i < iters; ++i) {
      prepare();
      Check(cudaMemsetAsync(flush.p, i & 0xff, flush.n, stream), "flush");
      Check(cudaEventRecord(e0, stream), "record");
      run();
      Check(cudaEventRecord(e1, stream), "record");
      Check(cudaEventSynchronize(e1), "sync");
      float t = 0;
      Check(cudaEventElapsedTime(&t, e0, e1), "elapsed");
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return {ms[ms.size() / 2], ms.front()};
  }
  // Median time in ms.
  double Median(const std::function<void()>& prepare, const std::function<void()>& run) {
    return Time(prepare, run).median_ms;
  }
};

// Random orthogonal d x d matrix (Gram-Schmidt on Gaussian columns in float64), row-major fp32.
inline std::vector<float> RandomOrthogonal(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd;
  std::vector<double> q(size_t(d) * d);
  for (auto& x : q) x = nd(rng);
  for (int c = 0; c < d; ++c) {
    for (int p = 0; p < c; ++p) {
      double dot = 0;
      for (int r = 0; r < d; ++r) dot += q[size_t(r) * d + c] * q[size_t(r) * d + p];
      for (int r = 0; r < d; ++r) q[size_t(r) * d + c] -= dot * q[size_t(r) * d + p];
    }
    double nrm = 0;
    for (int r = 0; r < d; ++r) nrm += q[size_t(r) * d + c] * q[size_t(r) * d + c];
    nrm = std::sqrt(nrm);
    for (int r = 0; r < d; ++r) q[size_t(r) * d + c] /= nrm;
  }
  return std::vector<float>(q.begin(), q.end());
}

// 0..n-1 in a seeded random order (page ids that are not adjacent in memory).
inline std::vector<int32_t> Shuffled(size_t n, uint64_t seed) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

// {"git_sha", "version", "device": {name, sms, l2_bytes, clocks, cc}} of the current device,
// merged into a result document. Throws CudaError when no device answers.
inline void DescribeDevice(nlohmann::json* doc) {
  int dev = 0;
  Check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, dev), "props");
  int clk = 0, memclk = 0;
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, dev);
  cudaDeviceGetAttribute(&memclk, cudaDevAttrMemoryClockRate, dev);
  (*doc)["git_sha"] = kvpool::kGitSha;
  (*doc)["version"] = kvpool::kVersion;
  (*doc)["device"] = {{"name", prop.name},
                      {"sms", prop.multiProcessorCount},
                      {"l2_bytes", prop.l2CacheSize},
                      {"max_sm_clock_khz", clk},
                      {"max_mem_clock_khz", memclk},
                      {"cc", std::to_string(prop.major) + "." + std::to_string(prop.minor)}};
}

// Writes `doc` (indented) to `path`; an empty path writes nothing.
inline void WriteJson(const std::string& path, const nlohmann::json& doc) {
  if (!path.empty()) std::ofstream(path) << doc.dump(2) << "\n";
}

}  // namespace kvpool::bench
