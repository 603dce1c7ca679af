// xxh3_64 compiled for AVX2 (this file only is built with -mavx2; common/CMakeLists.txt), for
// checksum.cc's Xxh3 on x86-64 CPUs with AVX2 — the same values as every other xxh3_64 build
// (xxHash's vector paths compute one function). Only called after a runtime check of the CPU.
// Nothing else here: every inline function this file defines is built for AVX2.
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

namespace kvpool::internal {

uint64_t Xxh3Avx2(const void* data, size_t size) { return XXH3_64bits(data, size); }

}  // namespace kvpool::internal
