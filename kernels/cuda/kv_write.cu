// kv_write.cu — rotate / clip / INT2-quantize / pack write kernels (see kv_write.h).
//
// One kernel template KvWriteKernel<D, kRotate, kOutBf16>: a CTA owns one (KV head, K or V)
// and walks 64-token chunks (grid-stride); each of its 4 warps takes 16 tokens:
//   1. the 16 bf16 rows are staged in shared memory with cp.async (16-byte pieces, swizzled);
//   2. kRotate: X̃ = X·R on tensor cores (mma.sync m16n8k16, fp16 operands, fp32
//      accumulators; R is converted once per CTA to fp16 and kept transposed in shared memory),
//      else X̃ = X exactly (bf16 -> fp32);
//   3. each row (spread over the 4 lanes of a quad, D/4 values per lane): non-finite check,
//      clip threshold τ by exact selection (repeated max extraction with tie counts), clamp,
//      per-group min/max, fp16 (scale, min) with directed rounding, codes by threshold
//      comparison, quarter-planar packing, 16-bit stores (FORMAT.md §2);
//   kOutBf16 instead stores X̃ rounded to bf16 into BF16 pages.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "device_utils.cuh"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/cuda/kv_write.h"

namespace kvpool::cuda {
namespace detail {
namespace {

constexpr int kWWarps = 4;
constexpr int kWThreads = 32 * kWWarps;
constexpr int kChunkTokens = 16 * kWWarps;

struct WriteArgs {
  int32_t num_tokens;
  int32_t num_kv_heads;
  int32_t page_size;
  // source: token-major arrays, or (demotion) BF16 pages
  const uint16_t* src_k;
  const uint16_t* src_v;
  int64_t token_stride;
  const int32_t* src_pages;  // non-null: demotion mode
  const uint8_t* src_base;
  uint64_t src_stride;
  // destination
  const int32_t* dst_page;  // per token (or per block in demotion mode)
  const int32_t* dst_slot;  // per token (null in demotion mode: slot = t % page_size)
  uint8_t* dst_base;
  uint64_t dst_stride;
  const float* rot_k;
  const float* rot_v;
  int64_t rot_head_stride;
  float clip_k, clip_v;
  uint8_t* row_flags;
  uint32_t* bad_rows;
};

template <int D>
__device__ __forceinline__ const uint8_t* SourceRow(const WriteArgs& a, int t, int h, int kv) {
  if (a.src_pages != nullptr) {
    const int blk = t / a.page_size, slot = t % a.page_size;
    const uint64_t chunk = 4ull * a.page_size * D;
    return a.src_base + uint64_t(a.src_pages[blk]) * a.src_stride + uint64_t(h) * chunk +
           uint64_t(kv) * 2 * a.page_size * D + uint64_t(slot) * 2 * D;
  }
  const uint16_t* base = kv ? a.src_v : a.src_k;
  return reinterpret_cast<const uint8_t*>(base + int64_t(t) * a.token_stride + int64_t(h) * D);
}

__device__ __forceinline__ void DestPageSlot(const WriteArgs& a, int t, int* page, int* slot) {
  if (a.dst_slot != nullptr) {
    *page = a.dst_page[t];
    *slot = a.dst_slot[t];
  } else {
    *page = a.dst_page[t / a.page_size];
    *slot = t % a.page_size;
  }
}

template <int D, bool kRotate>
constexpr int WriteSmemBytes() {
  return (kRotate ? D * D * 2 : 0) + kWWarps * 16 * 2 * D;
}

// τ per row (FORMAT.md §2.2): the `need`-th largest |x| of the row, ties counted (the value
// with count(>= τ) >= need and count(> τ) < need). Each lane keeps its kL largest magnitudes
// sorted (insertion network: 2 ops per element and slot), then the 4 lanes of the quad pop
// their heads in descending order; the need-th popped value is τ (the union of the lanes'
// top-kL lists contains the row's top-need, since kL >= need).
template <int kL, int kNt>
__device__ __forceinline__ void SelectTau(const float (&x)[kNt][4], int need, const bool (&skip)[2],
                                          float (&tau)[2]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float top[kL];
#pragma unroll
    for (int i = 0; i < kL; ++i) top[i] = -1.f;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = fabsf(x[nt][2 * r + e]);
#pragma unroll
        for (int i = 0; i < kL; ++i) {
          const float hi = fmaxf(top[i], v);
          v = fminf(top[i], v);
          top[i] = hi;
        }
      }
    int remaining = need;
    float t = INFINITY;
    bool done = skip[r];
#pragma unroll
    for (int it = 0; it < kL; ++it) {
      if (it >= need) break;
      float m = fmaxf(top[0], __shfl_xor_sync(0xffffffffu, top[0], 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const bool mine = top[0] == m;
      const unsigned bal = __ballot_sync(0xffffffffu, mine);
      const int cnt = __popc((bal >> (lane & ~3)) & 0xfu);
      if (!done) {
        if (cnt >= remaining) {
          t = m;
          done = true;
        } else {
          remaining -= cnt;
        }
      }
#pragma unroll
      for (int i = 0; i < kL - 1; ++i) top[i] = mine ? top[i + 1] : top[i];
      top[kL - 1] = mine ? -1.f : top[kL - 1];
    }
    tau[r] = t;
  }
}

template <int D, bool kRotate, bool kOutBf16>
__global__ void __launch_bounds__(kWThreads) KvWriteKernel(const WriteArgs a) {
  constexpr int kNt = D / 8;  // n-tiles of the rotated row (8 columns each)
  constexpr int kNG = D / (D < 128 ? D : 128);
  constexpr int kRowPieces = D / 8;
  extern __shared__ __align__(128) uint8_t smem[];
  const int h = blockIdx.y, kv = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  uint8_t* rt = smem;  // [D][D] fp16, Rᵀ, swizzled
  uint8_t* xs = smem + (kRotate ? D * D * 2 : 0) + warp * 16 * 2 * D;  // [16][D] bf16, swizzled

  if constexpr (kRotate) {
    const float* r = (kv ? a.rot_v : a.rot_k) + h * a.rot_head_stride;
    for (int idx = threadIdx.x; idx < D * D; idx += kWThreads) {
      const int k = idx / D, n = idx % D;  // R[k][n] -> Rᵀ[n][k]
      const __half v = __float2half_rn(r[idx]);
      const int c = (k >> 3) ^ (n & 7);
      *reinterpret_cast<__half*>(rt + n * 2 * D + 16 * c + 2 * (k & 7)) = v;
    }
    __syncthreads();
  }

  const float clip = kv ? a.clip_v : a.clip_k;
  int need = 0;  // elements at or above τ (τ = sorted_ascending[idx])
  if (clip > 0.f) {
    int idx = int(floorf(clip * D));
    idx = min(max(idx, 0), D - 1);
    need = D - idx;
  }
  const uint64_t int2_chunk = uint64_t(a.page_size) * (D / 2 + 8 * kNG);
  const uint64_t bf16_chunk = 4ull * a.page_size * D;
  const int nchunks = (a.num_tokens + kChunkTokens - 1) / kChunkTokens;

  for (int ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
    const int t0 = ch * kChunkTokens + warp * 16;
    // ---- stage 16 rows ----
    for (int p = lane; p < 16 * kRowPieces; p += 32) {
      const int row = p / kRowPieces, c = p % kRowPieces;
      const int t = t0 + row;
      const bool ok = t < a.num_tokens;
      const uint8_t* src = ok ? SourceRow<D>(a, t, h, kv) + 16 * c : nullptr;
      CpAsync16(xs + row * 2 * D + 16 * (c ^ (row & 7)),
                ok ? src : reinterpret_cast<const uint8_t*>(a.dst_base), ok);
    }
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncwarp();

    // ---- rotated values: x[nt][j], j: 0,1 row g cols 8nt+2tig+{0,1}; 2,3 row g+8 ----
    float x[kNt][4];
    if constexpr (kRotate) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) x[nt][j] = 0.f;
      const int q4 = lane >> 3, r8 = lane & 7;
#pragma unroll
      for (int s = 0; s < D / 16; ++s) {
        uint32_t af[4];
        {
          const int row = r8 + 8 * (q4 & 1);
          const int c = 2 * s + (q4 >> 1);
          LdMatrixX4(af, xs + row * 2 * D + 16 * (c ^ (row & 7)));
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // bf16x2 -> f16x2 (inf when out of fp16 range)
          const float lo = __uint_as_float(af[i] << 16), hi = __uint_as_float(af[i] & 0xffff0000u);
          af[i] = PackHalf2(lo, hi);
        }
#pragma unroll
        for (int nt = 0; nt < kNt; nt += 2) {
          uint32_t bf[4];
          const int n = 8 * (nt + (q4 >> 1)) + r8;
          const int c = 2 * s + (q4 & 1);
          LdMatrixX4(bf, rt + n * 2 * D + 16 * (c ^ (n & 7)));
          MmaF16(x[nt], af[0], af[1], af[2], af[3], bf[0], bf[1]);
          MmaF16(x[nt + 1], af[0], af[1], af[2], af[3], bf[2], bf[3]);
        }
      }
      // Round to bf16: the INT2 bytes are those of the rotated BF16 form, so demoting that
      // form later gives identical bytes (kvpool::RotateQuantizeRowsBf16 contract).
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) x[nt][j] = __bfloat162float(__float2bfloat16_rn(x[nt][j]));
    } else {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = g + 8 * r;
          const uint32_t w = *reinterpret_cast<const uint32_t*>(xs + row * 2 * D +
                                                                16 * (nt ^ (row & 7)) + 4 * tig);
          x[nt][2 * r] = __uint_as_float(w << 16);
          x[nt][2 * r + 1] = __uint_as_float(w & 0xffff0000u);
        }
    }
    __syncwarp();  // xs is rewritten next chunk

    if constexpr (kOutBf16) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int t = t0 + g + 8 * r;
        if (t < a.num_tokens) {
          int page, slot;
          DestPageSlot(a, t, &page, &slot);
          uint8_t* dst = a.dst_base + uint64_t(page) * a.dst_stride + uint64_t(h) * bf16_chunk +
                         uint64_t(kv) * 2 * a.page_size * D + uint64_t(slot) * 2 * D;
#pragma unroll
          for (int nt = 0; nt < kNt; ++nt)
            *reinterpret_cast<uint32_t*>(dst + 2 * (8 * nt + 2 * tig)) =
                PackBf162(x[nt][2 * r], x[nt][2 * r + 1]);
        }
      }
    } else {
      // ---- per row: finite check, clip, quantize ----
      bool bad[2];
      float tau[2];
      bool done[2];
      int remaining[2];
      float below[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        bool fin = true;
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt)
          fin = fin && isfinite(x[nt][2 * r]) && isfinite(x[nt][2 * r + 1]);
        int b = fin ? 0 : 1;
        b |= __shfl_xor_sync(0xffffffffu, b, 1);
        b |= __shfl_xor_sync(0xffffffffu, b, 2);
        bad[r] = b != 0;
        done[r] = bad[r] || need == 0;
        tau[r] = INFINITY;
        remaining[r] = need;
        below[r] = INFINITY;
      }
      if (need > 0 && need <= 8) {
        SelectTau<8, kNt>(x, need, bad, tau);
      } else if (need > 8 && need <= 12) {
        SelectTau<12, kNt>(x, need, bad, tau);
      } else {
        // Large `need` (small clip ratios): repeated max extraction with tie counts.
        while (__any_sync(0xffffffffu, !(done[0] && done[1]))) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float m = -1.f;
#pragma unroll
            for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float v = fabsf(x[nt][2 * r + e]);
                m = (v < below[r]) ? fmaxf(m, v) : m;
              }
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            int cnt = 0;
#pragma unroll
            for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) cnt += fabsf(x[nt][2 * r + e]) == m;
            cnt += __shfl_xor_sync(0xffffffffu, cnt, 1);
            cnt += __shfl_xor_sync(0xffffffffu, cnt, 2);
            if (!done[r]) {
              if (cnt >= remaining[r]) {
                tau[r] = m;
                done[r] = true;
              } else {
                remaining[r] -= cnt;
                below[r] = m;
              }
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int t = t0 + g + 8 * r;
        const bool live = t < a.num_tokens;
        float thr[kNG][3];
        uint32_t par[kNG];
#pragma unroll
        for (int grp = 0; grp < kNG; ++grp) {
          float lo = INFINITY, hi = -INFINITY;
#pragma unroll
          for (int nt = grp * (kNt / kNG); nt < (grp + 1) * (kNt / kNG); ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float v = fminf(fmaxf(x[nt][2 * r + e], -tau[r]), tau[r]);
              x[nt][2 * r + e] = v;
              lo = fminf(lo, v);
              hi = fmaxf(hi, v);
            }
          lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
          lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, 2));
          hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
          hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
          lo += 0.f;  // -0 -> +0, as the CPU quantizer
          const __half mn16 = __float2half_rd(lo);
          const float mnf = __half2float(mn16);
          __half s16 = __ushort_as_half(0);
          if (!(hi <= 65504.f) || !isfinite(mnf)) bad[r] = true;
          if (hi != lo) {
            s16 = __float2half_ru(__fdiv_rn(__fsub_rn(hi, mnf), 3.f));
            if (!isfinite(__half2float(s16))) bad[r] = true;
          }
          const float sf = __half2float(s16);
          // Exact code thresholds: the smallest v with fl(fl(v - mn16) / scale16) >= j - 0.5,
          // i.e. the CPU rule round-half-up((v - mn16)/scale16) (FORMAT.md §2.3) bit for bit,
          // found by stepping from mn16 + (j - 0.5)·scale16 (a few ulps away at most).
#pragma unroll
          for (int j = 0; j < 3; ++j) {
            float th = INFINITY;
            if (sf > 0.f && !bad[r]) {
              const float want = float(j) + 0.5f;
              auto pred = [&](float v) { return __fdiv_rn(__fsub_rn(v, mnf), sf) >= want; };
              th = __fmaf_rn(want, sf, mnf);
              for (int it = 0; it < 16 && pred(th); ++it) th = nextafterf(th, -INFINITY);
              for (int it = 0; it < 16 && !pred(th); ++it) th = nextafterf(th, INFINITY);
            }
            thr[grp][j] = th;
          }
          par[grp] = uint32_t(__half_as_ushort(s16)) | (uint32_t(__half_as_ushort(mn16)) << 16);
        }
        if (!live) continue;
        int page, slot;
        DestPageSlot(a, t, &page, &slot);
        uint8_t* chunk = a.dst_base + uint64_t(page) * a.dst_stride + uint64_t(h) * int2_chunk;
        uint8_t* codes = chunk + uint64_t(kv) * a.page_size * (D / 4) + uint64_t(slot) * (D / 4);
        uint8_t* params = chunk + 2ull * a.page_size * (D / 4) +
                          uint64_t(kv) * a.page_size * 4 * kNG + uint64_t(slot) * 4 * kNG;
        constexpr int kQn = D / 32;  // n-tiles per quarter
#pragma unroll
        for (int ntq = 0; ntq < kQn; ++ntq) {
          uint32_t bytes2 = 0;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            uint32_t byte = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const int nt = ntq + kQn * k;
              const int grp = (nt * 8) / (D < 128 ? D : 128);
              const float v = x[nt][2 * r + e];
              const uint32_t c = uint32_t(v >= thr[grp][0]) + uint32_t(v >= thr[grp][1]) +
                                 uint32_t(v >= thr[grp][2]);
              byte |= c << (2 * k);
            }
            bytes2 |= byte << (8 * e);
          }
          if (bad[r]) bytes2 = 0;
          *reinterpret_cast<uint16_t*>(codes + 8 * ntq + 2 * tig) = uint16_t(bytes2);
        }
        if (tig == 0) {
#pragma unroll
          for (int grp = 0; grp < kNG; ++grp)
            reinterpret_cast<uint32_t*>(params)[grp] = bad[r] ? 0u : par[grp];
          if (a.row_flags != nullptr)
            a.row_flags[(size_t(t) * a.num_kv_heads + h) * 2 + kv] = bad[r] ? 1 : 0;
          if (bad[r] && a.bad_rows != nullptr) atomicAdd(a.bad_rows, 1u);
        }
      }
    }
  }
}

KernelStatus WLaunchError(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return KernelStatus::Ok();
  return KernelStatus::Error(KernelError::kLaunchFailed,
                             std::string(what) + ": " + cudaGetErrorString(e));
}

template <int D, bool kRotate, bool kOutBf16>
KernelStatus LaunchWrite(const WriteArgs& a, cudaStream_t stream) {
  constexpr int smem = WriteSmemBytes<D, kRotate>();
  auto kernel = KvWriteKernel<D, kRotate, kOutBf16>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return WLaunchError("cudaFuncSetAttribute(KvWriteKernel)");
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    sms = 132;
  cudaGetLastError();
  const int nchunks = (a.num_tokens + kChunkTokens - 1) / kChunkTokens;
  const int per_head = std::max(1, (4 * sms) / (2 * a.num_kv_heads));
  const dim3 grid(std::min(nchunks, per_head), a.num_kv_heads, 2);
  kernel<<<grid, kWThreads, smem, stream>>>(a);
  return WLaunchError("KvWriteKernel");
}

template <bool kRotate, bool kOutBf16>
KernelStatus DispatchWrite(int d, const WriteArgs& a, cudaStream_t stream) {
  if (d == 64) return LaunchWrite<64, kRotate, kOutBf16>(a, stream);
  if (d == 128) return LaunchWrite<128, kRotate, kOutBf16>(a, stream);
  return LaunchWrite<256, kRotate, kOutBf16>(a, stream);
}

KernelStatus CheckShape(int heads, int d, int page_size) {
  if (heads < 1 || heads > 65535)
    return KernelStatus::Error(KernelError::kInvalidArgument, "num_kv_heads must be in 1..65535");
  if (d != 64 && d != 128 && d != 256)
    return KernelStatus::Error(KernelError::kUnsupported,
                               "head_dim must be 64, 128 or 256, got " + std::to_string(d));
  if (page_size != 16 && page_size != 64)
    return KernelStatus::Error(KernelError::kUnsupported,
                               "page_size must be 16 or 64, got " + std::to_string(page_size));
  return KernelStatus::Ok();
}

KernelStatus CheckPool(const void* base, uint64_t stride, uint64_t min_stride, const char* name) {
  const std::string n = name;
  if (base == nullptr)
    return KernelStatus::Error(KernelError::kInvalidArgument, n + ".base is null");
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || stride % 16 != 0)
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               n + ".base and page_stride_bytes must be 16-byte aligned");
  if (stride < min_stride)
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               n + ".page_stride_bytes is smaller than one page of all KV heads");
  return KernelStatus::Ok();
}

KernelStatus CheckClip(float c, const char* name) {
  if (!(c >= 0.f && c <= 1.f))
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               std::string(name) + " must be in [0, 1]");
  return KernelStatus::Ok();
}

KernelStatus PrepareTokenWrite(const KvWriteParams& p, bool int2, WriteArgs* a) {
  KernelStatus st = CheckShape(p.num_kv_heads, p.head_dim, p.page_size);
  if (!st.ok()) return st;
  if (p.num_tokens < 0)
    return KernelStatus::Error(KernelError::kInvalidArgument, "num_tokens must be >= 0");
  if (p.num_tokens > 0) {
    if (p.k == nullptr || p.v == nullptr)
      return KernelStatus::Error(KernelError::kInvalidArgument, "k and v must be non-null");
    if (reinterpret_cast<uintptr_t>(p.k) % 16 != 0 || reinterpret_cast<uintptr_t>(p.v) % 16 != 0)
      return KernelStatus::Error(KernelError::kInvalidArgument, "k and v must be 16-byte aligned");
    if (p.dst_page == nullptr || p.dst_slot == nullptr)
      return KernelStatus::Error(KernelError::kInvalidArgument,
                                 "dst_page and dst_slot must be non-null");
  }
  const int64_t ts = p.token_stride == 0 ? int64_t(p.num_kv_heads) * p.head_dim : p.token_stride;
  if (ts < int64_t(p.num_kv_heads) * p.head_dim || ts % 8 != 0)
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               "token_stride must be >= num_kv_heads*head_dim and a multiple of 8");
  BlockGeometry geo{1, uint32_t(p.num_kv_heads), uint32_t(p.head_dim), uint32_t(p.page_size)};
  st = CheckPool(p.dst.base, p.dst.page_stride_bytes,
                 (int2 ? geo.Int2ChunkBytes() : geo.Bf16ChunkBytes()) * p.num_kv_heads, "dst");
  if (!st.ok()) return st;
  if (int2) {
    st = CheckClip(p.clip_ratio_k, "clip_ratio_k");
    if (!st.ok()) return st;
    st = CheckClip(p.clip_ratio_v, "clip_ratio_v");
    if (!st.ok()) return st;
  }
  if ((p.rotation_k == nullptr) != (p.rotation_v == nullptr))
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               "rotation_k and rotation_v must both be set or both be null");
  *a = WriteArgs{};
  a->num_tokens = p.num_tokens;
  a->num_kv_heads = p.num_kv_heads;
  a->page_size = p.page_size;
  a->src_k = p.k;
  a->src_v = p.v;
  a->token_stride = ts;
  a->dst_page = p.dst_page;
  a->dst_slot = p.dst_slot;
  a->dst_base = static_cast<uint8_t*>(p.dst.base);
  a->dst_stride = p.dst.page_stride_bytes;
  a->rot_k = p.rotation_k;
  a->rot_v = p.rotation_v;
  a->rot_head_stride = p.rotation_per_head ? int64_t(p.head_dim) * p.head_dim : 0;
  a->clip_k = p.clip_ratio_k;
  a->clip_v = p.clip_ratio_v;
  a->row_flags = p.row_flags;
  a->bad_rows = p.bad_rows;
  return KernelStatus::Ok();
}

}  // namespace
}  // namespace detail

KernelStatus LaunchQuantizeWrite(const KvWriteParams& p, Stream stream) {
  detail::WriteArgs a;
  KernelStatus st = detail::PrepareTokenWrite(p, true, &a);
  if (!st.ok() || p.num_tokens == 0) return st;
  cudaGetLastError();
  auto s = reinterpret_cast<cudaStream_t>(stream);
  return a.rot_k != nullptr ? detail::DispatchWrite<true, false>(p.head_dim, a, s)
                            : detail::DispatchWrite<false, false>(p.head_dim, a, s);
}

KernelStatus LaunchRotateWriteBf16(const KvWriteParams& p, Stream stream) {
  detail::WriteArgs a;
  KernelStatus st = detail::PrepareTokenWrite(p, false, &a);
  if (!st.ok() || p.num_tokens == 0) return st;
  cudaGetLastError();
  auto s = reinterpret_cast<cudaStream_t>(stream);
  return a.rot_k != nullptr ? detail::DispatchWrite<true, true>(p.head_dim, a, s)
                            : detail::DispatchWrite<false, true>(p.head_dim, a, s);
}

KernelStatus LaunchDemote(const DemoteParams& p, Stream stream) {
  KernelStatus st = detail::CheckShape(p.num_kv_heads, p.head_dim, p.page_size);
  if (!st.ok()) return st;
  if (p.num_blocks < 0)
    return KernelStatus::Error(KernelError::kInvalidArgument, "num_blocks must be >= 0");
  if (int64_t(p.num_blocks) * p.page_size > INT32_MAX)
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               "num_blocks*page_size exceeds 2^31-1");
  if (p.num_blocks == 0) return KernelStatus::Ok();
  if (p.src_pages == nullptr || p.dst_pages == nullptr)
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               "src_pages and dst_pages must be non-null");
  BlockGeometry geo{1, uint32_t(p.num_kv_heads), uint32_t(p.head_dim), uint32_t(p.page_size)};
  st = detail::CheckPool(p.src.base, p.src.page_stride_bytes, geo.Bf16ChunkBytes() * p.num_kv_heads,
                         "src");
  if (!st.ok()) return st;
  st = detail::CheckPool(p.dst.base, p.dst.page_stride_bytes, geo.Int2ChunkBytes() * p.num_kv_heads,
                         "dst");
  if (!st.ok()) return st;
  st = detail::CheckClip(p.clip_ratio_k, "clip_ratio_k");
  if (!st.ok()) return st;
  st = detail::CheckClip(p.clip_ratio_v, "clip_ratio_v");
  if (!st.ok()) return st;
  detail::WriteArgs a{};
  a.num_tokens = p.num_blocks * p.page_size;
  a.num_kv_heads = p.num_kv_heads;
  a.page_size = p.page_size;
  a.src_pages = p.src_pages;
  a.src_base = static_cast<const uint8_t*>(p.src.base);
  a.src_stride = p.src.page_stride_bytes;
  a.dst_page = p.dst_pages;
  a.dst_slot = nullptr;
  a.dst_base = static_cast<uint8_t*>(p.dst.base);
  a.dst_stride = p.dst.page_stride_bytes;
  a.clip_k = p.clip_ratio_k;
  a.clip_v = p.clip_ratio_v;
  a.row_flags = p.row_flags;
  a.bad_rows = p.bad_rows;
  cudaGetLastError();
  return detail::DispatchWrite<false, false>(p.head_dim, a, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace kvpool::cuda
