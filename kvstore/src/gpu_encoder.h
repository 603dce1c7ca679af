// kvstore/src/gpu_encoder.h — the pool's GPU commit encoder (built only with CUDA; selected
// through CreateEncoder in kvpool/kvstore/encoder.h, which is the only public entry point).
//
// Per EncodeBlocks call (one put), in batches of up to options.batch_bytes of staging bytes:
//   1. copy each block's staging bytes to the device (one copy per block),
//   2. gpu_relayout.cu: block layout → token-major rows + per-block NaN/Inf flag,
//   3. one kvpool::cuda::LaunchRotateWriteBf16 per layer (all blocks' tokens at once) writing
//      bf16(x·R) straight into BF16 forms (fp16 copy of R on tensor cores, fp32 accumulation),
//   4. one kvpool::cuda::LaunchDemote over all (block, layer) pages quantizing exactly those
//      stored bf16 rows into INT2 forms, with per-row refusal flags,
//   5. copy the forms back into each job's buffers (not a BF16 form the job does not want,
//      EncodeJob::bf16_wanted), synchronize the stream once.
// A block with a NaN/Inf, or with any row the demotion refused (fp16 overflow of a group, or a
// GPU rotation that overflowed fp16 because an input exceeded ±65504), is re-encoded on the CPU
// with EncodeBlock, so refusals, error messages and int2_ok are the CPU path's.
// Geometries the kernels do not implement (head_dim other than 64/128/256, page_size other than
// 16/64) and blocks larger than a batch go to the CPU encoder.
//
// Staging copies are direct DMA when the pool's memory was registered (RegisterHostMemory,
// called by BlockStore::Create), else they go through the driver's pageable-memory path.
// Resources: one CUDA stream and every device buffer are created in Create and reused (the
// launchers never allocate); rotations are uploaded once per distinct rotation (a small cache,
// keyed by the rotation id, or by a content hash when it has none).
// Thread-safety: EncodeBlocks may be called concurrently; calls are serialized on the device by
// a mutex (one stream). A CUDA error marks the encoder failed: that call and all later ones run
// on the CPU encoder and device_name() says "cpu".
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kvpool/kvstore/encoder.h"

namespace kvpool::kvstore {

struct GpuEncoderOptions {
  int device = 0;                      // CUDA device ordinal
  uint64_t batch_bytes = 64ull << 20;  // staging bytes per device batch (>= one block)
  size_t max_cached_rotations = 4;     // distinct rotations kept on the device
};

// Errors: FAILED_PRECONDITION naming why the GPU cannot be used (no device, compute capability
// not 9.0, device memory, a failed self-test encode); INVALID_ARGUMENT for batch_bytes < 1 MiB.
absl::StatusOr<std::unique_ptr<BlockEncoder>> CreateGpuEncoder(const GpuEncoderOptions& options);

}  // namespace kvpool::kvstore
