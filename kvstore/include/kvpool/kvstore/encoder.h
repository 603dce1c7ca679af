// kvpool/kvstore/encoder.h — the commit-time transformation of blocks: un-rotated BF16
// staging bytes → rotated BF16 form and OSCAR INT2 form (docs/BLOCK_FORMAT.md, FORMAT.md §2).
//
//   KVPOOL_ASSIGN_OR_RETURN(kvpool::RotationSet rot, kvpool::ParseRotations(file_bytes));
//   EncodeResult r;
//   KVPOOL_RETURN_IF_ERROR(EncodeBlock(geom, rot, 0.96f, 0.92f, staging, bf16, int2, &r));
//
// or, for all blocks of a put at once, on the pool's GPU when it has one:
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<BlockEncoder> enc, CreateEncoder(CommitDevice::kAuto));
//   std::vector<EncodeJob> jobs = ...;   // one per block: staging, bf16_out, int2_out
//   KVPOOL_RETURN_IF_ERROR(enc->EncodeBlocks(geom, rot, 0.96f, 0.92f, absl::MakeSpan(jobs)));
//   ... jobs[i].status, jobs[i].result ...
//
// The CPU numerics are the kernels library's encoder (RotateQuantizeRowsBf16). The GPU encoder
// (built only with CUDA, kvstore/src/gpu_encoder.h) uses the kernels' rotate-only BF16 write
// (fp16 copy of R on tensor cores, fp32 accumulation) and then the demotion kernel on the
// stored rotated bf16 rows, so on both paths the INT2 form is the quantization of exactly the
// stored rotated BF16 values. The GPU's rotated bf16 values may differ from the CPU's fp32
// rotation in the last bit (docs/OPERATIONS.md "Commit device" states the measured difference);
// NaN/Inf refusal and fp16-overflow rows behave as on the CPU (blocks with such rows are
// re-encoded on the CPU).
// Thread-safety: the free functions are reentrant; BlockEncoder implementations are
// thread-safe (see each).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/rotation.h"

namespace kvpool::kvstore {

struct EncodeResult {
  bool int2_ok = false;        // false when some group exceeded fp16 (FORMAT.md §2.3)
  uint64_t overflow_rows = 0;  // rows whose INT2 encoding overflowed fp16
};

// Scans a BF16 form (staging bytes, docs/BLOCK_FORMAT.md layout) for NaN/Inf.
// Errors: INVALID_ARGUMENT naming layer, head, K or V, token and element of the first
// non-finite value ("layer 2 head 1 V token 5 element 3 is nan").
absl::Status CheckFinite(const BlockGeometry& g, const uint8_t* bf16_form);

// Encodes one block on the CPU.
//   staging:  [Bf16FormBytes] un-rotated bf16 K/V as the engine computed them (read only).
//   bf16_out: [Bf16FormBytes] receives bf16(x·R) in the BF16 form layout. Required.
//   int2_out: [Int2FormBytes] receives the INT2 form of exactly those rotated bf16 values, or
//             null to skip it. Contents are unspecified when result->int2_ok is false.
//   clip_k/v: clip ratios (FORMAT.md §2.2).
// Errors: INVALID_ARGUMENT for non-finite input (as CheckFinite) or a geometry the kernels do not
// support (naming the field). Outputs may be partially written on error.
absl::Status EncodeBlock(const BlockGeometry& g, const RotationSet& rotation, float clip_k,
                         float clip_v, const uint8_t* staging, uint8_t* bf16_out, uint8_t* int2_out,
                         EncodeResult* result);

// One block of a batch. Buffers are the caller's (host memory, not owned), sized as for
// EncodeBlock; `status` and `result` are outputs.
struct EncodeJob {
  const uint8_t* staging = nullptr;  // [Bf16FormBytes]
  uint8_t* bf16_out = nullptr;       // [Bf16FormBytes], required
  uint8_t* int2_out = nullptr;       // [Int2FormBytes] or null (BF16 form only)
  // false: the caller keeps the BF16 form only as the fallback of a refused INT2 form (a
  // history block, FORMAT.md §2.3), so when result.int2_ok is true an encoder may leave bf16_out
  // unwritten (the GPU encoder then skips copying it back). Ignored when int2_out is null.
  bool bf16_wanted = true;
  absl::Status status;  // OK, or EncodeBlock's error for this block
  EncodeResult result;  // valid when status is OK
};

// Where commits rotate and quantize: kAuto = the GPU when this build has CUDA and a usable
// device (compute capability 9.0) is present, else the CPU.
enum class CommitDevice : uint8_t { kAuto, kCpu, kGpu };

// "auto", "cpu", "gpu".
const char* CommitDeviceName(CommitDevice d);
// Parses "auto" / "cpu" / "gpu". Errors: INVALID_ARGUMENT naming `field`.
absl::StatusOr<CommitDevice> ParseCommitDevice(std::string_view text,
                                               const char* field = "commit-device");

// Encodes a batch of blocks that share geometry, rotation and clip ratios (one put).
class BlockEncoder {
 public:
  virtual ~BlockEncoder() = default;

  // Encodes every job; each job gets its own status (a NaN in one block does not stop the
  // others). Outputs of a job whose status is not OK are unspecified.
  // Errors (whole call; no job's outputs are then meaningful): INVALID_ARGUMENT naming the field
  // for a bad geometry (geometry.head_dim, ...), clip ratio (recipe.clip_ratio_k/v) or a null
  // staging/bf16_out pointer (jobs[i].staging); a device failure is not an error (the GPU
  // encoder re-encodes on the CPU and stops using the device).
  virtual absl::Status EncodeBlocks(const BlockGeometry& g, const RotationSet& rotation,
                                    float clip_k, float clip_v, absl::Span<EncodeJob> jobs) = 0;

  // "cpu" or "gpu": where the next call will run (a GPU encoder whose device failed says "cpu").
  virtual std::string_view device_name() const = 0;
  // One line for logs: the device and why ("gpu: NVIDIA H200 (cc 9.0), batch 64 MiB").
  virtual std::string Describe() const = 0;

  // Hint: [base, base + bytes) is the host memory staging pointers point into (the pool's
  // memory). The GPU encoder page-locks it for the device once (cudaHostRegister), so staging is
  // copied by DMA instead of through the driver's bounce buffer; a failure is logged and ignored
  // (copies stay correct, only slower). The CPU encoder ignores it. Call at most once, before
  // any EncodeBlocks; the memory must outlive the encoder (it is unregistered on destruction).
  virtual void RegisterHostMemory(void* base, size_t bytes) {}
};

// The call-level checks every BlockEncoder::EncodeBlocks makes first (the errors listed there),
// and INTERNAL when `rotation`'s head_dim, num_layers or num_kv_heads differ from `g` (the
// registration refuses such a pair; this keeps a bug there from reading past the matrices).
absl::Status ValidateBatch(const BlockGeometry& g, const RotationSet& rotation, float clip_k,
                           float clip_v, absl::Span<const EncodeJob> jobs);

// The CPU encoder (EncodeBlock per job, in order). Thread-safe, stateless.
std::unique_ptr<BlockEncoder> NewCpuEncoder();

// The encoder for `device`: kCpu → CPU; kGpu → the GPU encoder, or FAILED_PRECONDITION saying
// why not ("this build has no CUDA support", "no CUDA device", "device 0 has compute capability
// 8.0; the kernels need 9.0"); kAuto → the GPU encoder when kGpu would succeed, else the CPU
// encoder (the reason is logged at info level).
absl::StatusOr<std::unique_ptr<BlockEncoder>> CreateEncoder(CommitDevice device);

}  // namespace kvpool::kvstore
