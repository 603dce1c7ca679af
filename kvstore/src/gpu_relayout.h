// kvstore/src/gpu_relayout.h — the GPU encoder's one own kernel (gpu_relayout.cu): staging blocks
// in the BF16 form layout (docs/BLOCK_FORMAT.md) → token-major rows the kernels' write launchers
// read (kvpool/kernels/cuda/kv_write.h), plus a per-block NaN/Inf flag and the index arrays.
// Plain C++ (no CUDA headers); built only with CUDA (KVPOOL_HAVE_CUDA).
#pragma once

#include <cstdint>

#include "kvpool/kernels/block_format.h"

struct CUstream_st;

namespace kvpool::kvstore::gpu {

// Device pointers, not owned. Shapes for n = num_blocks, geometry g (L, H, d, P):
//   in:       [n][L][H][2][P][d] bf16 — n whole BF16 forms back to back (staging bytes).
//   out:      [L][2][n·P][H][d] bf16 — element (l, kv, b·P + t, h, j) = in (b, l, h, kv, t, j),
//             i.e. for layer l the K rows start at out + (2l)·n·P·H·d and the V rows at
//             out + (2l + 1)·n·P·H·d with token stride H·d (KvWriteParams' layout).
//   nonfinite:[n] u8, set to 1 for each block holding a NaN or ±Inf (never cleared here: the
//             caller zeroes it first).
//   page, slot: [n·P] int32: page[T] = T / P, slot[T] = T % P.
//   ids:      [n·L] int32: ids[i] = i.
// Requirements: d a multiple of 8, 16-byte aligned pointers. Enqueues on `stream`; never
// allocates or synchronizes. Returns the CUDA runtime's launch error code (0 = success).
// Reentrant.
int LaunchStagingToTokenMajor(const uint16_t* in, uint16_t* out, uint32_t num_blocks,
                              const BlockGeometry& g, uint8_t* nonfinite, int32_t* page,
                              int32_t* slot, int32_t* ids, CUstream_st* stream);

// The CUDA runtime's name of an error code returned above ("cudaErrorInvalidValue").
const char* CudaErrorName(int code);

}  // namespace kvpool::kvstore::gpu
