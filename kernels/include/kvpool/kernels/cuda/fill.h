// kvpool/kernels/cuda/fill.h — device-side random fills for benchmarks and tests of the CUDA
// kernels (large page pools are filled on the GPU, not uploaded). Deterministic in `seed`.
// Plain C++ header; launchers enqueue on `stream`, never allocate or synchronize.
#pragma once

#include <cstdint>

#include "kvpool/kernels/cuda/status.h"

namespace kvpool::cuda {

// n bf16 values, uniform in [-2, 2), at dst (2-byte aligned).
KernelStatus LaunchFillRandomBf16(uint16_t* dst, uint64_t n, uint64_t seed, Stream stream);

// num_pages INT2 pages of page_stride_bytes each (docs/BLOCK_FORMAT.md, one layer): random
// codes; (scale16, min16) pairs with scale in [0.05, 0.55) and min in [-1.2, -0.1).
KernelStatus LaunchFillRandomInt2Pages(void* base, uint64_t num_pages, uint64_t page_stride_bytes,
                                       int num_kv_heads, int head_dim, int page_size, uint64_t seed,
                                       Stream stream);

}  // namespace kvpool::cuda
