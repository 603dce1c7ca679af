// kvpool/kernels/cuda/status.h — the result type of every CUDA kernel launcher.
//
// Launchers never throw, never allocate device memory and never synchronize. They validate
// their arguments on the host first (a refused call launches nothing) and then enqueue work
// on the caller's stream. A launch error reported by the CUDA runtime is returned as
// kLaunchFailed; errors raised later by the device (e.g. an illegal address) surface at the
// caller's next synchronization, as with any CUDA work.
//
//   kvpool::cuda::KernelStatus st = kvpool::cuda::LaunchPagedDecode(params, stream);
//   if (!st.ok()) return absl::InvalidArgumentError(st.message);
//
// Plain C++ (no CUDA headers): included by host code that is compiled without nvcc.
#pragma once

#include <string>
#include <utility>

// The CUDA runtime's stream handle (cudaStream_t is `CUstream_st*`); declared here so that this
// header needs no CUDA include. nullptr is the legacy default stream.
struct CUstream_st;

namespace kvpool::cuda {

using Stream = CUstream_st*;

enum class KernelError : int {
  kOk = 0,
  kInvalidArgument = 1,  // a malformed argument (null pointer, misaligned, out of range)
  kUnsupported = 2,      // a well-formed shape this build does not implement
  kWorkspaceTooSmall = 3,
  kLaunchFailed = 4,  // the CUDA runtime refused the launch (message has its error string)
};

// Error code + human-readable message that names the offending field. Value type.
struct KernelStatus {
  KernelError code = KernelError::kOk;
  std::string message;

  bool ok() const { return code == KernelError::kOk; }
  static KernelStatus Ok() { return {}; }
  static KernelStatus Error(KernelError c, std::string m) { return {c, std::move(m)}; }
};

// "ok", "invalid_argument", "unsupported", "workspace_too_small", "launch_failed".
const char* KernelErrorName(KernelError code);

}  // namespace kvpool::cuda
