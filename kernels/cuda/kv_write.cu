// kv_write.cu — rotate / clip / INT2-quantize / pack write kernels (see kv_write.h).
//
// One kernel template KvWriteKernel<D, kRotate, kOutBf16>. A CTA of the rotating kernels owns
// one (KV head, K or V) (its Rᵀ is in shared memory); in the others (quantize-only, demotion)
// every warp alternates the K and the V tile of the same 16 tokens, since V tiles cost more
// than K tiles. Each warp is persistent and walks 16-row tiles (16 consecutive tokens) with
// its own two-stage ring in shared memory, so the next tile's 16 rows are in flight while the
// current one is processed (quantize-only and demotion: one TMA load per tile completing on the
// stage's mbarrier, the 128-byte-swizzled layout of Swz128; the rotating and BF16-output
// kernels: cp.async into the layout of Swz). Per tile:
//   1. kRotate: X̃ = X·R on tensor cores (mma.sync m16n8k16, fp16 operands, fp32 accumulators;
//      Rᵀ converted once per CTA to fp16 in shared memory with its columns permuted so that
//      the accumulators land in the register layout of step 2), rounded to bf16;
//      else X̃ = X (already rotated bf16).
//   2. Register layout: lane (g = lane/4, tig = lane%4) holds rows g and g+8 of the tile (TMA
//      layout: rows RowOf(g) and RowOf(g)+8, for conflict-free shared-memory reads) as
//      D/4 packed registers {row g, row g+8} (bf16x2, one column each); the columns are
//      tig·D/16 + q·D/4 + i (quarter q = 0..3, i < D/16), exactly the columns whose 2-bit
//      codes make up bytes tig·D/16 .. tig·D/16 + D/16 - 1 of the quarter-planar row
//      (FORMAT.md §2.6). Every per-element step below works on both rows at once.
//      Quantize-only and demotion (v8, same-row layout, kNat): each register holds two
//      adjacent columns of ONE row instead, as the 16-byte shared-memory reads deliver them
//      (no PRMT per register to pair rows g and g+8); the selection networks then sort two
//      lists per register (even / odd columns of the row) and cross the halves once, in the
//      last in-lane merge (2L PRMTs), the group min/max combine the halves with 4 PRMTs, and
//      the codes of a row's two columns land in one register (one PRMT per 4 code bytes).
//      NaN/Inf rows are found from the NaN-propagating group min/max of step 4.
//   3. Clip threshold τ (FORMAT.md §2.2, the need-th largest |x̃| with need = d − clip index):
//      the two rows' magnitudes (sign cleared) are sorted together with packed bf16x2 min/max
//      (integer u16x2 min/max give the same order): each lane sorts runs of 8 (Batcher
//      odd-even merge network; once for every need <= 16, SortRuns), keeps the top of its runs
//      (for lists shorter than 8: odd-even merge with the missing entries as -inf, pruned, see
//      TopMerge; else bitonic max-merge), then the quad merges its lists through two shuffle
//      rounds; the last round only computes position need−1 (closed form of KthOfTwo for the
//      lists' two deepest positions, else the path to it). need ≤ 6: lists of 6; need ≤ 8: top-8
//      lists; need ≤ 16: top-8 lists merged to the quad's top 16 with an exactness check
//      (every lane's 8th value ≤ the result), re-selected with top-16 lists when it fails;
//      else a 15-step bitwise search on counts. Ties are exact (a sorting network permutes the
//      multiset). In the sorting networks a comparator's min is a + b − max as two integer
//      multiply-adds (FMA pipe) instead of a second min/max on the saturated integer ALU pipe.
//   4. Per-group min/max of the clipped row (the clamped raw min/max; clipped values are never
//      formed), fp16 (scale, min) with directed rounding (FORMAT.md §2.3); the three exact
//      code thresholds per row (the smallest bf16 whose CPU code is ≥ j, in closed form with
//      fp64 directed sums) are adjusted to the clip range, so codes are packed bf16
//      comparisons of the raw values. Each (row, group) is worked out by one lane of the quad
//      (at d <= 128 two lanes per row, which split its three thresholds), not by all four.
//   5. Codes (2 compares per register: b1 = x ≥ t2, b0 = x ≥ (b1 ? t3 : t1)) are assembled
//      into the quarter-planar bytes (2 bits per quarter) by integer multiply-adds of the
//      compare masks (FMA pipe) and stored as D/16 contiguous bytes per row and lane.
//   kOutBf16 instead stores X̃ (bf16) into BF16 pages with 16-byte stores.
// Warp-specialized rotating kernels (kWs; d 128, the default when TMA maps can be encoded,
// KVPOOL_WRITE_ROT_WS=0 selects the mma.sync kernels above; session 7): a CTA per SM of 4
// consumer warpgroups and kWsProducers producer warpgroups (each serving every kWsProducers-th
// consumer warpgroup), Rᵀ of K and V (fp16) in shared memory. The
// consumer warps run the quantize-only path (TMA tile loads into their own ring, same-row
// layout, K/V alternation) on items of 64 tokens (warp w of a warpgroup takes tile w of the 4);
// between the TMA and the consumer the producer rotates the warpgroup's four tiles in place:
// ldmatrix as wgmma A fragments (bf16 -> fp16 as in step 1), wgmma m64nNk16 against Rᵀ (B from
// shared memory by descriptor, fp32 accumulators; rotate+quantize: N = 128, all columns in one
// wgmma per k step, the producer holding 128 registers through setmaxnreg (v16, session 18);
// rotate-bf16: N = kWsN = 32 columns at a time), bf16 rounding, stmatrix back into the stage,
// an mbarrier arrival per consumer warp. Same operands and accumulation as step 1, so the
// rounded rows (and the INT2 bytes) are those of the mma.sync kernels up to the tensor cores'
// accumulation order (measured by KvWrite.WarpSpecializedRotationMatchesMmaSync).
#include <cuda.h>  // CUtensorMap (the encoder comes from the runtime's driver entry point)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "device_utils.cuh"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/cuda/kv_write.h"

namespace kvpool::cuda {
namespace detail {
namespace {

// Warps per CTA: 8 for the rotating kernels at d <= 128 (they share one Rᵀ in shared memory,
// so 2 CTAs give 16 warps per SM), else 4.
template <int D, bool kRotate, bool kWs = false>
__host__ __device__ constexpr int WarpsPerCta();
constexpr int kTileRows = 16;
constexpr int kStages = 2;
// Warp-specialized rotating kernels (kWs, d 128, session 7): kWsGroups consumer warpgroups (the
// quantize-only code path on the rotated tiles) and kWsProducers producer warpgroups (wgmma) per
// CTA. The macros are measurement switches (the defaults are what was measured and kept).
#ifndef KVPOOL_WRITE_WS_GROUPS
#define KVPOOL_WRITE_WS_GROUPS 4
#endif
constexpr int kWsGroups = KVPOOL_WRITE_WS_GROUPS;
// Self-rotating consumers (KVPOOL_WRITE_WS_SELF=1): no producer warpgroup; each consumer
// warpgroup rotates its own item (the same wgmma code, kWsSelfN columns per wgmma) between its
// TMA wait and its reads, at the 128 registers 512 threads may hold. Measured on the H200
// (session 19, same call, 4 rounds, 8 KV heads, d 128): rotate+quantize 321.7 (N = 32) / 336.1
// (64) / 393.8 (128) vs 307.2 us with the producer at 1M token-heads; rotate-bf16 1.02-1.25x;
// so it is off. docs/KERNELS.md "Session 19".
#ifndef KVPOOL_WRITE_WS_SELF
#define KVPOOL_WRITE_WS_SELF 0
#endif
constexpr bool kWsSelf = KVPOOL_WRITE_WS_SELF != 0;
#ifndef KVPOOL_WRITE_WS_SELF_N
#define KVPOOL_WRITE_WS_SELF_N 64
#endif
constexpr int kWsSelfN = KVPOOL_WRITE_WS_SELF_N;
static_assert(kWsSelfN == 32 || kWsSelfN == 64 || kWsSelfN == 128, "32, 64 or 128 columns");
// Registers per producer thread (setmaxnreg; 0 = none: every warp keeps the launch's 96) of
// the rotate+quantize (KVPOOL_WRITE_WS_REGS) and the rotate-bf16 (KVPOOL_WRITE_WS_REGS_BF16)
// kernel. With 128 the producer multiplies all D columns at once (one wgmma m64n128k16 per k
// step, 64 accumulators per thread, the 8 descriptors ready before the first) and each
// consumer thread gives up 8 registers (640 threads share the SM's 64K: 512 x 88 + 128 x 128);
// without, N = kWsN columns at a time. Measured on the H200 (session 18, same call, 4 rounds,
// 8 KV heads, d 128): rotate+quantize 308.4 vs 318.2 us without (N = 32, the same one-add
// descriptors) at 1M token-heads, 87.2 vs 89.4 at 256K, 31.4 vs 33.1 at 64K (v15: 355.7 / 98.2 /
// 35.2); rotate-bf16 with 128: 307.7 vs 304.6 at 1M and 32.6 vs 29.3 at 64K (its consumers
// spill at 88 registers), so it keeps 0. docs/KERNELS.md "Session 18".
#ifndef KVPOOL_WRITE_WS_REGS
#define KVPOOL_WRITE_WS_REGS 128
#endif
#ifndef KVPOOL_WRITE_WS_REGS_BF16
#define KVPOOL_WRITE_WS_REGS_BF16 0
#endif
template <bool kOutBf16>
__host__ __device__ constexpr int WsProducerRegs() {
  return kWsSelf ? 0 : kOutBf16 ? KVPOOL_WRITE_WS_REGS_BF16 : KVPOOL_WRITE_WS_REGS;
}
static_assert(WsProducerRegs<false>() == 0 || WsProducerRegs<false>() == 128, "0 or 128");
static_assert(WsProducerRegs<true>() == 0 || WsProducerRegs<true>() == 128, "0 or 128");
// Columns per wgmma of the producer without setmaxnreg (its accumulators: kWsN / 2 per thread).
#ifndef KVPOOL_WRITE_WS_N
#define KVPOOL_WRITE_WS_N 32
#endif
constexpr int kWsN = KVPOOL_WRITE_WS_N;
template <bool kOutBf16>
__host__ __device__ constexpr int WsColumns() {
  return WsProducerRegs<kOutBf16>() >= 128 ? 128 : kWsN;
}
constexpr int kWsConsumerWarps = 4 * kWsGroups;
// Producer warpgroups; producer p serves the consumer warpgroups c with c % kWsProducers == p.
#ifndef KVPOOL_WRITE_WS_PRODUCERS
#define KVPOOL_WRITE_WS_PRODUCERS 1
#endif
constexpr int kWsProducers = kWsSelf ? 0 : KVPOOL_WRITE_WS_PRODUCERS;
// (setmaxnreg.inc waits for registers the consumers released: only the one-producer CTA of 4
// consumer warpgroups has them)
static_assert(WsProducerRegs<false>() + WsProducerRegs<true>() == 0 ||
                  (kWsProducers == 1 && kWsGroups == 4),
              "setmaxnreg needs the one-producer, four-consumer-warpgroup CTA");
// Warps per CTA of the non-rotating kernels at d <= 128 (quantize-only, demotion, BF16 output),
// which run 24 warps per SM: one CTA of 24 warps per SM (session 11, v15). Measured on the H200
// (same call, 4 rounds, d 128, 32 q / 8 KV heads): quantize-only 52.6 vs 56.8 µs with 6 CTAs of 4
// warps at 256K token-heads (the same kernel code otherwise), 173.9 vs 192.9 at 1M, 20.5 vs 21.9
// at 64K; demotion 53.0 vs 56.6 and 171.9 vs 190.8 (docs/KERNELS.md, "Session 11"). A
// compile-time switch for A/B builds (4, 8, 12 or 24 warps: 6, 3, 2 or 1 CTAs per SM).
#ifndef KVPOOL_WRITE_Q_WARPS
#define KVPOOL_WRITE_Q_WARPS 24
#endif
constexpr int kQWarps = KVPOOL_WRITE_Q_WARPS;
static_assert(24 % kQWarps == 0 && kQWarps % 4 == 0, "24 warps per SM in whole CTAs");
template <int D, bool kRotate, bool kWs>
__host__ __device__ constexpr int WarpsPerCta() {
  return kWs                   ? kWsConsumerWarps + 4 * kWsProducers
         : kRotate && D <= 128 ? 8
         : D <= 128            ? kQWarps
                               : 4;
}

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
  int32_t use_tma;  // tile loads by TMA through maps.k / maps.v (demotion: maps.k), else cp.async
  // Split of the N work items into one contiguous range per worker (warps; kWs: consumer
  // warpgroups), worked out by the launcher so that the kernel's prologue has no 64-bit
  // division (session 8): worker i takes items [B(i), B(i + 1)) with B(i) = i·split_q +
  // ⌊i·split_r / split_w⌋ = ⌊i·N / W⌋ (split_q = ⌊N / W⌋, split_r = N mod W, split_w = W <
  // 2^16, so i·split_r < 2^32). An item pair index (item / 2) splits into (quotient, remainder)
  // by split_den (kMix: see the item numbering in the kernel; kWs: the groups per head), in 32
  // bits when div32 (every pair index < 2^32).
  int64_t split_q;
  uint32_t split_r, split_w, split_den;
  int32_t div32;
  // Quantize-only / demotion with TMA: each warp waits for its first tile before it issues the
  // second one, so that the first tiles of all warps are not queued behind second tiles at the
  // start (session 8; KVPOOL_WRITE_FIRST_WAIT=0 turns it off, for A/B measurements).
  int32_t first_wait;
  // Quantize-only token writes (session 11, KVPOOL_WRITE_DYN_ITEMS; off by default, measured no
  // faster): dyn != 0 splits the items into one contiguous range per CTA (split_* over CTAs
  // instead of warps); warp w of the CTA takes items [w·dyn_static, (w+1)·dyn_static) of its
  // CTA's range, and the rest of the range (at least kWarps × the launcher's dynamic items per
  // warp) is claimed one item at a time from a shared-memory counter, so that the CTA's warps,
  // spread over the SM's four sub-partitions, finish together. Every item index is < 2^31 then
  // (the launcher checks).
  int32_t dyn;
  int32_t dyn_static;
};

// TMA descriptors of the sources, boxes of one whole tile (16 rows of one head, K or V) in the
// 128-byte swizzle (see Swz128). Token writes: the token-major K and V as 3D bf16 tensors {64
// columns, num_kv_heads·D/64 blocks of 64 columns, num_tokens rows (stride token_stride)}, box
// {64, D/64, 16}. Demotion (k only): the BF16 pool as {64 columns, the page's 128-byte lines
// (stride 128), pages (stride page_stride_bytes)}, box {64, 16·D/64, 1} (a tile's rows are
// contiguous in its page).
struct TmaMaps {
  CUtensorMap k, v;
};

// ---- packed 16-bit helpers ------------------------------------------------------------------

// NaN-propagating forms (a NaN in either half gives NaN in that half).
__device__ __forceinline__ uint32_t MaxNanBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.NaN.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t MinNanBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("min.NaN.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t MaxBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t MinBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("min.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// |a| per half (sign bits cleared; ptxas can fold it into the first comparators' operands).
__device__ __forceinline__ uint32_t AbsBf16x2(uint32_t a) {
  uint32_t d;
  asm("abs.bf16x2 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}
// 0xffff in each half where a >= b (bf16x2, ordered compare).
__device__ __forceinline__ uint32_t GeMaskBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("set.ge.u32.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// (x & c) | (y & ~c): the bits of x where c is set, of y elsewhere (one LOP3).
__device__ __forceinline__ uint32_t SelBits(uint32_t c, uint32_t x, uint32_t y) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xe4;\n" : "=r"(d) : "r"(x), "r"(y), "r"(c));
  return d;
}
__device__ __forceinline__ float Bf16LoToFloat(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Bf16HiToFloat(uint32_t w) {
  return __uint_as_float(w & 0xffff0000u);
}

// Comparators of the selection networks on packed magnitudes (sign cleared): bf16x2 min/max.
// For finite and infinite magnitudes the integer order (max/min.u16x2) is the same and was
// measured equally fast on the H200 (both run on the ALU pipe); NaN rows are detected
// separately and never quantized, so their τ does not matter.
__device__ __forceinline__ uint32_t SortMax(uint32_t a, uint32_t b) { return MaxBf16x2(a, b); }
__device__ __forceinline__ uint32_t SortMin(uint32_t a, uint32_t b) { return MinBf16x2(a, b); }

// 1 and 2^32 - 1, read at run time so that ptxas keeps the multiplies below (it cannot fold
// values in constant memory).
__constant__ uint32_t kOpaqueOnes[2] = {1u, 0xffffffffu};
// min(a, b) given mx = max(a, b) on magnitudes (sign bits clear, each half <= 0x7fff):
// a + b - mx per 16-bit half, with no carry or borrow between the halves (a + b <= 0xfffe,
// a + b >= mx). As two integer multiply-adds with run-time operands it runs on the FMA pipe
// instead of the integer ALU pipe, which the min/max comparators saturate.
__device__ __forceinline__ uint32_t SortMinFromMax(uint32_t a, uint32_t b, uint32_t mx) {
  uint32_t s, d;
  asm("mad.lo.u32 %0, %1, %2, %3;\n" : "=r"(s) : "r"(a), "r"(kOpaqueOnes[0]), "r"(b));
  asm("mad.lo.u32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(mx), "r"(kOpaqueOnes[1]), "r"(s));
  return d;
}

// Code-byte weights 4^q (b0) and 2·4^q (b1) of quarter q, and -65537 (see step 5), read at
// run time so that ptxas keeps the multiply-adds on the FMA pipe instead of turning them into
// shifts on the ALU pipe.
// [9]: 0x10001, which copies a 16-bit threshold into both halves (same-row layout).
__constant__ uint32_t kCodeWeights[10] = {1u,  2u,  4u,   8u,          16u,
                                          32u, 64u, 128u, 0xfffeffffu, 0x10001u};
// a·b + c (mod 2^32), one integer multiply-add.
__device__ __forceinline__ uint32_t MadLo(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("mad.lo.u32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// 0..15 read at run time (see MadWide's use in the cp.async addressing).
__constant__ uint32_t kSmallInts[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
// p + a·b (64-bit p, 32 x 32-bit product), one wide integer multiply-add.
__device__ __forceinline__ const uint8_t* MadWide(uint32_t a, uint32_t b, const uint8_t* p) {
  uint64_t d;
  asm("mad.wide.u32 %0, %1, %2, %3;\n"
      : "=l"(d)
      : "r"(a), "r"(b), "l"(reinterpret_cast<uint64_t>(p)));
  return reinterpret_cast<const uint8_t*>(d);
}

// ---- compile-time sorting networks (comparator lists; indices become constants) ------------

struct Net {
  int n = 0;
  unsigned char lo[256] = {};
  unsigned char hi[256] = {};
};

// Batcher's odd-even merge sort on `size` elements (19 comparators for 8, 63 for 16).
constexpr Net OddEvenSortNet(int size) {
  Net net;
  for (int p = 1; p < size; p *= 2)
    for (int k = p; k >= 1; k /= 2)
      for (int j = k % p; j + k < size; j += 2 * k)
        for (int i = 0; i < k && i + j + k < size; ++i)
          if ((i + j) / (2 * p) == (i + j + k) / (2 * p)) {
            net.lo[net.n] = static_cast<unsigned char>(i + j);
            net.hi[net.n] = static_cast<unsigned char>(i + j + k);
            ++net.n;
          }
  return net;
}

// Bitonic merge of a bitonic sequence of `size` elements into descending order.
constexpr Net BitonicMergeNet(int size) {
  Net net;
  for (int j = size / 2; j >= 1; j /= 2)
    for (int i = 0; i < size; ++i)
      if ((i & j) == 0) {
        net.lo[net.n] = static_cast<unsigned char>(i);
        net.hi[net.n] = static_cast<unsigned char>(i + j);
        ++net.n;
      }
  return net;
}

// A network pruned to its first L outputs (descending: the L largest): walking backwards, a
// comparator whose max output (position lo) and min output (hi) are both dead is dropped, one
// with a single live output keeps only that max or min; the inputs of a kept comparator are live.
struct PrunedNet {
  Net net;
  unsigned char mode[256] = {};  // bit 0: max needed, bit 1: min needed
};
constexpr PrunedNet Prune(const Net& net, int live_out) {
  PrunedNet p{net};
  bool live[64] = {};
  for (int i = 0; i < live_out; ++i) live[i] = true;
  for (int c = net.n - 1; c >= 0; --c) {
    const int lo = net.lo[c], hi = net.hi[c];
    p.mode[c] = static_cast<unsigned char>((live[lo] ? 1 : 0) | (live[hi] ? 2 : 0));
    if (p.mode[c] != 0) live[lo] = live[hi] = true;
  }
  return p;
}

// The top L (descending) of two descending lists of L, A at wires 0 .. L-1 and B at wires
// K .. K+L-1 of 2K wires (K a power of two >= L), by Batcher's odd-even merge of 2K wires
// (the last stage of OddEvenSortNet(2K)) with wires L .. K-1 and K+L .. 2K-1 fixed at -inf:
// a comparator with a -inf input is dropped (its max is the other input, renamed into place at
// compile time, its min -inf), then the network is pruned to the L outputs. Output i ends in
// wire out[i]. For L = 6 (K = 8) 22 instructions per merge instead of 24 for max(A[i],
// B[K-1-i]) + the pruned bitonic merge; for two lists of 8 to their top 12 (K = 8, L = 8, 12
// outputs) 44 instead of 52. (Checked exhaustively by the 0-1 principle on the host.)
struct MergeNet {
  int n = 0;
  unsigned char lo[256] = {};
  unsigned char hi[256] = {};
  unsigned char mode[256] = {};  // bit 0: max needed, bit 1: min needed
  unsigned char out[32] = {};
};
constexpr MergeNet OddEvenTopMerge(int k, int l, int outs) {
  MergeNet m;
  const int size = 2 * k;
  int where[64] = {};
  bool neg[64] = {};
  for (int i = 0; i < size; ++i) {
    where[i] = i;
    neg[i] = (i % k) >= l;
  }
  const int p = k;  // merge stage of the odd-even merge sort: two sorted halves of k
  for (int kk = p; kk >= 1; kk /= 2)
    for (int j = kk % p; j + kk < size; j += 2 * kk)
      for (int i = 0; i < kk && i + j + kk < size; ++i)
        if ((i + j) / (2 * p) == (i + j + kk) / (2 * p)) {
          const int a = i + j, b = i + j + kk;  // a gets the max
          if (neg[b]) continue;                 // max = a, min = -inf (already in b)
          if (neg[a]) {                         // a takes b's value, b becomes -inf
            const int t = where[a];
            where[a] = where[b];
            where[b] = t;
            neg[a] = false;
            neg[b] = true;
            continue;
          }
          m.lo[m.n] = static_cast<unsigned char>(where[a]);
          m.hi[m.n] = static_cast<unsigned char>(where[b]);
          ++m.n;
        }
  bool live[64] = {};
  for (int i = 0; i < outs; ++i) {
    m.out[i] = static_cast<unsigned char>(where[i]);
    live[where[i]] = true;
  }
  for (int c = m.n - 1; c >= 0; --c) {
    const int lo = m.lo[c], hi = m.hi[c];
    m.mode[c] = static_cast<unsigned char>((live[lo] ? 1 : 0) | (live[hi] ? 2 : 0));
    if (m.mode[c] != 0) live[lo] = live[hi] = true;
  }
  return m;
}
template <int K, int L, int kOuts>
struct TopMerge {
  static constexpr MergeNet kNet = OddEvenTopMerge(K, L, kOuts);
};
template <int K, int L>
struct Nets {
  static constexpr PrunedNet kSort = Prune(OddEvenSortNet(K), L);
  static constexpr PrunedNet kMerge = Prune(BitonicMergeNet(K), L);
};

// Quarters of the sorting-network runs whose comparators take the min from the max by two
// integer multiply-adds (FMA pipe, SortMinFromMax); the others use a second min/max (ALU
// pipe). Measured on the H200 (quantize-only, 256K token-heads, v6 with the code sums on the
// FMA pipe): 4 of 4 61.4 µs, 2 of 4 61.0 µs, 0 of 4 61.5 µs (v5, codes on the ALU pipe: 4 of
// 4 was best); session 6 (same-row layout and odd-even merges, fewer ALU instructions): 1 of 4
// 60.4 vs 2 of 4 59.5 µs, 3 of 4 58.9 / 58.3 vs 2 of 4 59.2 / 59.2, 4 of 4 61.1 / 60.8 vs 3 of 4
// 58.5 / 58.6 (same-call rounds). Session 9 (v13, same call, 3 rounds, 256K): quantize-only 3 of
// 4 57.6, 2 of 4 57.9, 4 of 4 58.9 µs; the kWs rotate+quantize kernel (its consumer warps run the
// same selection) 2 of 4 98.5, 3 of 4 100.9, 4 of 4 100.8 µs, so the kWs kernels take
// KVPOOL_WRITE_IMAD_MIN_RUNS_WS. Compile-time switches for such A/B builds.
#ifndef KVPOOL_WRITE_IMAD_MIN_RUNS
#define KVPOOL_WRITE_IMAD_MIN_RUNS 3
#endif
#ifndef KVPOOL_WRITE_IMAD_MIN_RUNS_WS
#define KVPOOL_WRITE_IMAD_MIN_RUNS_WS 2
#endif
constexpr int kImadMinRuns = KVPOOL_WRITE_IMAD_MIN_RUNS;
constexpr int kImadMinRunsWs = KVPOOL_WRITE_IMAD_MIN_RUNS_WS;
// K (need <= 6) from per-lane top-5 lists with an exactness check (see SelectTopK's kL1) instead
// of top-6 lists; a compile-time switch for A/B builds. Off: measured slower on the H200
// (session 6, 256K token-heads: quantize-only 59.4 / 59.7 vs 58.5 / 58.6 µs, rotate+quantize
// 116.2 / 116.7 vs 111.5 / 111.6), as v6's top-5 attempt was. The check is conservative: a lane
// holding 5 of the row's 6 largest has its 5th value above τ' even when τ' is exact, so by
// simulation (i.i.d. rows) it fails on 0.35 % of rows, 5.4 % of 16-row tiles, each a warp-wide
// re-selection.
#ifndef KVPOOL_WRITE_K_TOP5
#define KVPOOL_WRITE_K_TOP5 0
#endif
// The runs of 8 sorted in full once, before the branch on need, so that the K (need <= 6), need
// <= 8 and V (need <= 16) selections share that code instead of each inlining its own copy
// (session 10: ≈ 420 fewer static instructions in the d 128 quantize kernel, at the cost of
// the K runs' 2 pruned comparator halves each). Measured on the H200 (same call, 5 rounds,
// with the closed-form quad round 2): quantize-only 56.7 vs 57.0 µs at 256K token-heads and
// 192.1 vs 194.3 at 1M; 0 = one pruned copy per selection (for A/B builds).
#ifndef KVPOOL_WRITE_SHARED_RUNS
#define KVPOOL_WRITE_SHARED_RUNS 1
#endif
// Measurement switch (not a supported mode): the warp-specialized rotation with bf16 operands
// (Rᵀ rounded to bf16, the bf16 input unconverted) instead of fp16 ones, to time the fp16
// conversion of the tiles. The default (0) keeps the rotation numerics of the mma.sync kernels.
#ifndef KVPOOL_WRITE_ROT_BF16
#define KVPOOL_WRITE_ROT_BF16 0
#endif

// Applies TopMerge<K, L, kOuts> to w (A in w[0 .. L), B in w[K .. K+L)); output i is then in
// w[TopMerge<K, L, kOuts>::kNet.out[i]].
template <int K, int L, int kOuts>
__device__ __forceinline__ void RunTopMerge(uint32_t (&w)[2 * K]) {
  constexpr MergeNet net = TopMerge<K, L, kOuts>::kNet;
#pragma unroll
  for (int c = 0; c < net.n; ++c) {
    const uint32_t x = w[net.lo[c]], y = w[net.hi[c]];
    if (net.mode[c] & 1) w[net.lo[c]] = SortMax(x, y);
    if (net.mode[c] & 2) w[net.hi[c]] = SortMin(x, y);
  }
}

// Applies the descending comparator network of K elements (sort or bitonic merge), pruned to
// its L largest outputs, to a[off .. off+K); packed u16x2, so both halves (rows) are sorted
// independently. Positions >= L hold no meaningful value afterwards.
template <int K, int N, bool kMergeNet, int L = K, bool kImadMin = true>
__device__ __forceinline__ void RunNet(uint32_t (&a)[N], int off) {
  constexpr PrunedNet net = kMergeNet ? Nets<K, L>::kMerge : Nets<K, L>::kSort;
#pragma unroll
  for (int c = 0; c < net.net.n; ++c) {
    const uint32_t x = a[off + net.net.lo[c]], y = a[off + net.net.hi[c]];
    // Sorting networks (kImadMin: the runs chosen by kImadMinRuns): the min output of a full
    // comparator from its max on the FMA pipe (v5 on the H200: 1.6 % faster at 256K
    // token-heads; doing the same in the merge networks as well was 3 % slower: the FMA pipe,
    // which also runs the address IMADs, then becomes the busier one).
    if (net.mode[c] == 3 && !kMergeNet && kImadMin) {
      const uint32_t mx = SortMax(x, y);
      a[off + net.net.lo[c]] = mx;
      a[off + net.net.hi[c]] = SortMinFromMax(x, y, mx);
      continue;
    }
    if (net.mode[c] & 1) a[off + net.net.lo[c]] = SortMax(x, y);
    if (net.mode[c] & 2) a[off + net.net.hi[c]] = SortMin(x, y);
  }
}

// The top K of two descending lists A = a[ia ..], B = b[ib ..] whose first L entries are
// meaningful (entries >= L count as 0, below every magnitude: a lane contributes at most L of
// the L largest): c[i] = max(A[i], B[K-1-i]) is bitonic and holds them.
template <int K, int L, int NA, int NB>
__device__ __forceinline__ void TopKBitonic(uint32_t (&c)[K], const uint32_t (&a)[NA], int ia,
                                            const uint32_t (&b)[NB], int ib) {
#pragma unroll
  for (int i = 0; i < K; ++i) {
    if (i < K - L) {
      c[i] = a[ia + i];
    } else if (i >= L) {
      c[i] = b[ib + K - 1 - i];
    } else {
      c[i] = SortMax(a[ia + i], b[ib + K - 1 - i]);
    }
  }
}

// The same for the last run merge of the same-row layout (kNat, see KvWriteKernel step 2):
// a[ia ..] holds row gr's lists, a[ib ..] row gr+8's, each register {list of the row's even
// columns, list of its odd columns} (the halves sorted independently). The lists to merge are
// P = {gr even, gr+8 even} and Q = {gr odd, gr+8 odd}, assembled by PRMT on the way (2L PRMT),
// so the result is packed {row gr, row gr+8} like the kernel's other layout.
template <int K, int L, int NA>
__device__ __forceinline__ void TopKBitonicCross(uint32_t (&c)[K], const uint32_t (&a)[NA], int ia,
                                                 int ib) {
#pragma unroll
  for (int i = 0; i < K; ++i) {
    if (i < K - L) {
      c[i] = Prmt(a[ia + i], a[ib + i], 0x5410);
    } else if (i >= L) {
      c[i] = Prmt(a[ia + K - 1 - i], a[ib + K - 1 - i], 0x7632);
    } else {
      c[i] = SortMax(Prmt(a[ia + i], a[ib + i], 0x5410),
                     Prmt(a[ia + K - 1 - i], a[ib + K - 1 - i], 0x7632));
    }
  }
}

// Sorts each run of K registers of m (both halves independently), pruned to the L largest
// outputs; the runs r < kImad·(N/K)/4 take their comparator mins from the max on the FMA pipe.
template <int K, int L, int N, int kImad>
__device__ __forceinline__ void SortRuns(uint32_t (&m)[N]) {
  constexpr int kRuns = N / K;
#pragma unroll
  for (int r = 0; r < kRuns; ++r) {
    if (r < kImad * kRuns / 4)
      RunNet<K, N, false, L>(m, r * K);
    else
      RunNet<K, N, false, L, false>(m, r * K);
  }
}

// Quad round 2 by a closed form (session 10; KVPOOL_WRITE_KTH_FORMULA): position P (0-based,
// descending) of the union of two descending lists a, b (at least P + 1 meaningful entries each)
// is max(a[P], b[P], min(a[i-1], b[P-i]) for i = 1..P). Each min is <= the (P+1)-th largest (the
// i entries of a and P+1-i of b above it are P+1 elements >= it), and the split of the union's
// top P+1 into i from a and P+1-i from b attains it; ties are exact (multisets). P mins and a
// max over P+2 values, which ptxas fuses into 3-input VHMNMX: 8 instructions for P = 5 (K at d
// 128) and 16 for P = 10 (V), instead of the bitonic max step plus the log-depth walk to
// position P with its branches (≈ 24 and ≈ 35 in the v13 SASS). Measured on the H200 (same
// call, 5 rounds): quantize-only 57.0 vs 57.6 µs at 256K token-heads, 194.3 vs 196.4 at 1M; 0
// keeps the walk for every position (for A/B builds).
#ifndef KVPOOL_WRITE_KTH_FORMULA
#define KVPOOL_WRITE_KTH_FORMULA 1
#endif
template <int P, int NA, int NB>
__device__ __forceinline__ uint32_t KthOfTwo(const uint32_t (&a)[NA], const uint32_t (&b)[NB]) {
  static_assert(P < NA && P < NB, "position inside both lists");
  uint32_t r = SortMax(a[P], b[P]);
#pragma unroll
  for (int i = 1; i <= P; ++i) r = SortMax(r, SortMin(a[i - 1], b[P - i]));
  return r;
}

// τ (packed magnitude bits, one half per row) of the quad's two rows, from the magnitudes m
// (destroyed). need in 1..L: each lane keeps only its L largest (L <= K: a lane contributes at
// most `need` of the row's need largest), so the networks are pruned to L outputs.
// kNat: m is in the same-row layout (m[0 .. N/2) row gr, m[N/2 .. N) row gr+8, each register
// two columns of one row): the runs of each half are sorted and merged as two independent lists
// per row, and the last run merge (run 0 with run N/2K, one row each) crosses the halves.
// kL1 > L (with `exact`): the lanes keep only their L largest, quad round 1 keeps the top kL1
// of the pair's lists, and τ' (position need-1 <= kL1-1) is exact when every lane's L-th value
// ℓ is <= τ' (as in SelectTop8Merge16); *exact says whether that held on the quad's four lanes.
// kImad: the quarters of the sorting runs with the IMAD comparator min (see kImadMinRuns).
// kSorted: the runs are sorted already (SortRuns, see KVPOOL_WRITE_SHARED_RUNS).
template <int K, int L, int N, bool kNat = false, int kL1 = L, int kImad = kImadMinRuns,
          bool kSorted = false>
__device__ __forceinline__ uint32_t SelectTopK(uint32_t (&m)[N], int need, bool* exact = nullptr) {
  static_assert(N % K == 0 && (K == 8 || K == 16) && 2 * L >= K && L <= K, "runs of K");
  static_assert(kL1 >= L && kL1 <= K && (kL1 == L || L < K), "round-1 list length");
  constexpr int kRuns = N / K;
  static_assert(!kNat || kRuns >= 2, "same-row layout: at least one run per row");
  if constexpr (!kSorted) SortRuns<K, L, N, kImad>(m);
  // Tree merge of the runs into run 0: the top K of two descending lists A, B are
  // max(A[i], B[K-1-i]) (a bitonic sequence), then a bitonic merge sorts them.
  constexpr int kRunLevels = kRuns >= 8 ? 3 : kRuns >= 4 ? 2 : kRuns >= 2 ? 1 : 0;
#pragma unroll
  for (int lv = 0; lv < kRunLevels; ++lv)
#pragma unroll
    for (int r = 0; r + (1 << lv) < kRuns; r += 2 << lv) {
      const int step = 1 << lv;
      if constexpr (L < K) {  // odd-even top-L merge (see TopMerge)
        constexpr MergeNet net = TopMerge<K, L, L>::kNet;
        uint32_t w[2 * K];
#pragma unroll
        for (int i = 0; i < L; ++i) {
          if (kNat && lv == kRunLevels - 1) {  // the last merge crosses the halves (see above)
            w[i] = Prmt(m[r * K + i], m[(r + step) * K + i], 0x5410);
            w[K + i] = Prmt(m[r * K + i], m[(r + step) * K + i], 0x7632);
          } else {
            w[i] = m[r * K + i];
            w[K + i] = m[(r + step) * K + i];
          }
        }
        RunTopMerge<K, L, L>(w);
#pragma unroll
        for (int i = 0; i < L; ++i) m[r * K + i] = w[net.out[i]];
      } else {
        uint32_t c[K];
        if (kNat && lv == kRunLevels - 1)
          TopKBitonicCross<K, L>(c, m, r * K, (r + step) * K);
        else
          TopKBitonic<K, L>(c, m, r * K, m, (r + step) * K);
#pragma unroll
        for (int i = 0; i < K; ++i) m[r * K + i] = c[i];
        RunNet<K, N, true, L>(m, r * K);
      }
    }
  const uint32_t ell = m[L - 1];  // every element outside this lane's list is <= ell
  // Quad round 1: full merge with the partner lane (xor 1), the top kL1 kept.
  if constexpr (L < K) {
    constexpr MergeNet net = TopMerge<K, L, kL1>::kNet;
    uint32_t w[2 * K];
#pragma unroll
    for (int i = 0; i < L; ++i) {
      w[i] = m[i];
      w[K + i] = __shfl_xor_sync(0xffffffffu, m[i], 1);
    }
    RunTopMerge<K, L, kL1>(w);
#pragma unroll
    for (int i = 0; i < kL1; ++i) m[i] = w[net.out[i]];
  } else {
    uint32_t b[K], c[K];
#pragma unroll
    for (int i = 0; i < L; ++i) b[i] = __shfl_xor_sync(0xffffffffu, m[i], 1);
    TopKBitonic<K, L>(c, m, 0, b, 0);
#pragma unroll
    for (int i = 0; i < K; ++i) m[i] = c[i];
    RunNet<K, N, true, L>(m, 0);
  }
  // Quad round 2 (xor 2): only the element at position need-1 of the merged list.
  uint32_t b[K];
#pragma unroll
  for (int i = 0; i < kL1; ++i) b[i] = __shfl_xor_sync(0xffffffffu, m[i], 2);
  const int p = need - 1;
  uint32_t tau;
  // the two deepest positions (need = kL1, kL1 - 1: K at 0.96 of d 128 is need 6) by the closed
  // form of KthOfTwo; the rest (other clip ratios, the rare top-16 path) by the walk below
  if (KVPOOL_WRITE_KTH_FORMULA && K == 8 && p == kL1 - 1) {
    tau = KthOfTwo<kL1 - 1>(m, b);
  } else if (KVPOOL_WRITE_KTH_FORMULA && K == 8 && p == kL1 - 2) {
    tau = KthOfTwo<kL1 - 2>(m, b);
  } else {
    uint32_t c[K];
    TopKBitonic<K, kL1>(c, m, 0, b, 0);
    constexpr int kLevels = K == 8 ? 3 : 4;
#pragma unroll
    for (int lv = 0; lv < kLevels; ++lv) {
      const int j = (K / 2) >> lv;
      if (p & j) {
#pragma unroll
        for (int i = 0; i < K / 2; ++i)
          if (i < j) c[i] = SortMin(c[i], c[i + j]);
      } else {
#pragma unroll
        for (int i = 0; i < K / 2; ++i)
          if (i < j) c[i] = SortMax(c[i], c[i + j]);
      }
    }
    tau = c[0];
  }
  if constexpr (kL1 > L) {  // ℓ <= τ' in both halves on all four lanes
    uint32_t ok = GeMaskBf16x2(tau, ell);
    ok &= __shfl_xor_sync(0xffffffffu, ok, 1);
    ok &= __shfl_xor_sync(0xffffffffu, ok, 2);
    *exact = ok == 0xffffffffu;
  } else {
    (void)ell;
    if (exact != nullptr) *exact = true;
  }
  return tau;
}

// need in 9..16 from per-lane top-8 lists (the top-8 pass costs 248 comparator instructions per
// lane against 332 for top-16 lists): the quad merges the four lists into the top 16 of their
// union and reads position need-1, τ'. Elements outside a lane's list are <= its 8th value ℓ,
// so when ℓ <= τ' on every lane of the quad, no element outside the lists exceeds τ' and the
// lists hold every element >= τ' that matters: τ' is the need-th largest of the whole row (ties
// included: the count of elements >= τ' in the lists is already >= need). *exact is false when
// some lane of the quad (either row) has ℓ > τ'; then the caller selects again with top-16
// lists. On heavy-tailed random rows of d 128 this is about 0.2 % of rows.
// The quad rounds keep only the top L16 (12 or 16, >= need) of the merged lists: for need <= 12
// (V at 0.92, d 128: need 11) the round-1 merge is pruned to 12 outputs and round 2 reads 12
// of the partner's entries (24 fewer instructions per tile than with L16 = 16).
// kNat: m in the same-row layout, kSorted: the runs sorted already, as for SelectTopK.
template <int N, int L16, bool kNat = false, int kImad = kImadMinRuns, bool kSorted = false>
__device__ __forceinline__ uint32_t SelectTop8Merge16(uint32_t (&m)[N], int need, bool* exact) {
  static_assert(L16 == 12 || L16 == 16, "top 12 or 16");
  static_assert(N % 8 == 0 && (!kNat || N >= 16), "runs of 8");
  constexpr int K = 8, kRuns = N / K;
  if constexpr (!kSorted) SortRuns<K, K, N, kImad>(m);
  constexpr int kRunLevels = kRuns >= 8 ? 3 : kRuns >= 4 ? 2 : kRuns >= 2 ? 1 : 0;
#pragma unroll
  for (int lv = 0; lv < kRunLevels; ++lv)
#pragma unroll
    for (int r = 0; r + (1 << lv) < kRuns; r += 2 << lv) {
      const int step = 1 << lv;
      if (kNat && lv == kRunLevels - 1) {
        uint32_t c[K];
        TopKBitonicCross<K, K>(c, m, r * K, (r + step) * K);
#pragma unroll
        for (int i = 0; i < K; ++i) m[r * K + i] = c[i];
      } else {
#pragma unroll
        for (int i = 0; i < K; ++i)
          m[r * K + i] = SortMax(m[r * K + i], m[(r + step) * K + K - 1 - i]);
      }
      RunNet<K, N, true>(m, r * K);
    }
  const uint32_t ell = m[K - 1];
  // Quad round 1 (xor 1): the two sorted lists -> the top L16 of their union, sorted (odd-even
  // merge pruned to L16 outputs, see TopMerge).
  uint32_t c[16];
  {
    constexpr MergeNet net = TopMerge<8, 8, L16>::kNet;
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < K; ++i) {
      w[i] = m[i];
      w[K + i] = __shfl_xor_sync(0xffffffffu, m[i], 1);
    }
    RunTopMerge<8, 8, L16>(w);
#pragma unroll
    for (int i = 0; i < 16; ++i) c[i] = i < L16 ? w[net.out[i]] : 0u;
  }
  // Quad round 2 (xor 2): position need-1 of the union of the two sorted lists (entries >= L16
  // count as 0): for need = L16, L16 - 1 (V at 0.92 of d 128: need 11) by the closed form of
  // KthOfTwo, else the top 16 (bitonic) and the walk to position need-1.
  uint32_t b[16];
#pragma unroll
  for (int i = 0; i < L16; ++i) b[i] = __shfl_xor_sync(0xffffffffu, c[i], 2);
  const int p = need - 1;
  uint32_t tau;
  if (KVPOOL_WRITE_KTH_FORMULA && L16 == 12 && p == L16 - 1) {
    tau = KthOfTwo<L16 - 1>(c, b);
  } else if (KVPOOL_WRITE_KTH_FORMULA && L16 == 12 && p == L16 - 2) {
    tau = KthOfTwo<L16 - 2>(c, b);
  } else {
    TopKBitonic<16, L16>(c, c, 0, b, 0);
#pragma unroll
    for (int lv = 0; lv < 4; ++lv) {
      const int j = 8 >> lv;
      if (p & j) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (i < j) c[i] = SortMin(c[i], c[i + j]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (i < j) c[i] = SortMax(c[i], c[i + j]);
      }
    }
    tau = c[0];
  }
  // ℓ <= τ' in both halves on all four lanes (τ' is the same on the quad's lanes).
  uint32_t ok = GeMaskBf16x2(tau, ell);
  ok &= __shfl_xor_sync(0xffffffffu, ok, 1);
  ok &= __shfl_xor_sync(0xffffffffu, ok, 2);
  *exact = ok == 0xffffffffu;
  return tau;
}

// Any `need` (1..d): τ = the largest t with count(|x| >= t) >= need, built bit by bit (the
// count is non-increasing in t, and the largest such t is the need-th largest magnitude).
template <int N>
__device__ __forceinline__ uint32_t SelectBySearch(const uint32_t (&m)[N], int need) {
  uint32_t t = 0;
#pragma unroll 1
  for (int bit = 14; bit >= 0; --bit) {
    const uint32_t cand = t | (0x00010001u << bit);
    uint32_t cnt = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      // bit 15 of each half of (m | 0x8000) - cand is set iff m >= cand (no borrow across).
      const uint32_t d = (m[i] | 0x80008000u) - cand;
      cnt += (d >> 15) & 0x00010001u;
    }
    cnt += __shfl_xor_sync(0xffffffffu, cnt, 1);
    cnt += __shfl_xor_sync(0xffffffffu, cnt, 2);
    const uint32_t n = uint32_t(need);
    if ((cnt & 0xffffu) >= n) t |= (1u << bit);
    if ((cnt >> 16) >= n) t |= (0x10000u << bit);
  }
  return t;
}

// cp.async of 16 bytes to a shared-memory address (32-bit, as SmemAddr gives); `valid` false
// zero-fills the destination without reading global memory.
__device__ __forceinline__ void CpAsync16Sa(uint32_t sa, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}

// ---- mbarrier + TMA (sm_90; PTX ISA "mbarrier", "cp.async.bulk.tensor") -------------------

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized barriers visible to the async proxy (the TMA's complete-tx).
__device__ __forceinline__ void MbarInitFence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also raises the current phase's expected transaction count by `bytes`.
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the phase with parity `parity` of the barrier has completed.
__device__ __forceinline__ void MbarWaitParity(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Starts fetching a TMA descriptor (a __grid_constant__ kernel parameter) into the cache.
__device__ __forceinline__ void TmaPrefetchDescriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// One box of the 3D tensor map at coordinates (0, y, z) into shared memory at dst; its bytes
// complete on the mbarrier at bar.
__device__ __forceinline__ void TmaLoad3d(uint32_t dst, const CUtensorMap* map, int y, int z,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
      "[%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(y), "r"(z), "r"(bar)
      : "memory");
}
// One plain arrival (no transaction bytes); release semantics at CTA scope (PTX default), so
// this thread's earlier shared-memory writes, and those its __syncwarp ordered before it, are
// visible to a thread that then sees the phase complete.
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy accesses
// (wgmma operand reads of Rᵀ).
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- wgmma (sm_90a; PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate") -------

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: 8-row groups of
// 128-byte rows (1024 bytes, 1024-aligned) SBO = 1024 bytes apart; LBO unused for this layout
// (1); swizzle mode 1 = 128B in bits 62-63. A start address inside the swizzle atom (k steps of
// 32 bytes) is legal: the hardware applies the XOR to the final address bits.
// WgmmaDescLo(a) is the low word (start address >> 4 in bits 0-13, LBO in 16-29); the high word
// (SBO, swizzle) is a constant. WgmmaDescLo(a) + (o >> 4) is the low word of the descriptor of
// a + o for 16-byte multiples o (the shared-window address is < 2^18, so the 14-bit field
// neither needs a mask nor carries), so a run of descriptors costs one add each (v11 rebuilt
// each from its address: shift, or, and the constant, 6 instructions per wgmma with the moves).
__device__ __forceinline__ uint32_t WgmmaDescLo(uint32_t smem_addr) {
  return (smem_addr >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t WgmmaDescFromLo(uint32_t lo) {
  return uint64_t(lo) | (uint64_t((1024 >> 4) | (1u << 30)) << 32);
}
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaWaitAll() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Compiler-level fences: the value of r is "changed" here, so reads after and writes before
// cannot move across (used around the asynchronous wgmma on its accumulators and A registers).
__device__ __forceinline__ void RegFence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void RegFence(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// D(64 x N, f32) (+)= A(64 x 16, registers: the mma.m16n8k16 A fragment of this warp's 16 rows)
// · B(16 x N, shared memory, K-major, descriptor), fp16 or bf16 operands, N = 64 or 32.
// d[4·nt + e]: row g (e < 2) or g + 8 of the warp's 16, column 8·nt + 2·tig + e % 2.
#define KVPOOL_WGMMA_D16(o)                                                                       \
  "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
      "+f"(d[o + 6]), "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]),            \
      "+f"(d[o + 11]), "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15])
template <int N, bool kBf16>
__device__ __forceinline__ void WgmmaM64K16(float (&d)[N / 2], const uint32_t (&a)[4],
                                            uint64_t desc_b, int accumulate) {
  static_assert(N == 128 || N == 64 || N == 32, "N = 128, 64 or 32");
#define KVPOOL_WGMMA_N128(T)                                                                   \
  asm volatile(                                                                                \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                             \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T                                   \
      " "                                                                                      \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, "         \
      "%68, p, 1, 1, 0;\n}\n"                                                                  \
      : KVPOOL_WGMMA_D16(0), KVPOOL_WGMMA_D16(16), KVPOOL_WGMMA_D16(32), KVPOOL_WGMMA_D16(48)  \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
#define KVPOOL_WGMMA_N64(T)                                                                      \
  asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                               \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T                                      \
      " "                                                                                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, " \
      "%36, p, 1, 1, 0;\n}\n"                                                                    \
      : KVPOOL_WGMMA_D16(0), KVPOOL_WGMMA_D16(16)                                                \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
#define KVPOOL_WGMMA_N32(T)                                                                      \
  asm volatile(                                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                               \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T                                      \
      " "                                                                                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, " \
      "%19}, %20, p, 1, 1, 0;\n}\n"                                                              \
      : KVPOOL_WGMMA_D16(0)                                                                      \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
  if constexpr (N == 128 && kBf16) {
    KVPOOL_WGMMA_N128("bf16");
  } else if constexpr (N == 128) {
    KVPOOL_WGMMA_N128("f16");
  } else if constexpr (N == 64 && kBf16) {
    KVPOOL_WGMMA_N64("bf16");
  } else if constexpr (N == 64) {
    KVPOOL_WGMMA_N64("f16");
  } else if constexpr (kBf16) {
    KVPOOL_WGMMA_N32("bf16");
  } else {
    KVPOOL_WGMMA_N32("f16");
  }
#undef KVPOOL_WGMMA_N128
#undef KVPOOL_WGMMA_N64
#undef KVPOOL_WGMMA_N32
}
#undef KVPOOL_WGMMA_D16
// Four 8x8 b16 matrices from the mma fragment layout (lane l: row l/4, columns 2(l%4), +1 of
// each) to shared memory; lane l gives the row address of row l%8 of matrix l/8.
__device__ __forceinline__ void StMatrixX4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                           uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Ordered key of a bf16 pattern (not NaN): larger value, larger key; -0 and +0 are adjacent.
__device__ __forceinline__ int Bf16Key(uint32_t b) {
  return (b & 0x8000u) ? int(0x7fffu - (b & 0x7fffu)) : int(b + 0x8000u);
}
__device__ __forceinline__ uint32_t Bf16FromKey(int k) {
  return k >= 0x8000 ? uint32_t(k - 0x8000) : (0x8000u | uint32_t(0x7fff - k));
}

// Code threshold of level j (0, 1, 2: codes >= 1, 2, 3) as bf16 bits: the smallest bf16 x with
// round-half-up(fl(fl(x - mn) / s)) >= j + 1, the CPU rule of FORMAT.md §2.3 (quantize.cc), so
// that for every bf16 x, code(x) >= j + 1 iff x >= threshold; +inf (0x7f80) when s is 0.
// Exact, division-free and without search: with w = j + 0.5, round-half-up(t) >= j + 1 iff
// t >= w, and the correctly rounded quotient fl(a/s) >= w iff a/s >= β_w, the midpoint between w
// and the fp32 value below it (a tie rounds to w, whose significand is even): β = 0.5 - 2^-26,
// 1.5 - 2^-24, 2.5 - 2^-23. β·s (25 x 11 significant bits) is exact in fp64, so fl(a/s) >= w iff
// a >= A = fp32-round-up(β·s). Then fl(x - mn) >= A iff the exact difference x - mn reaches the
// midpoint m between A and its fp32 predecessor (at m itself iff the tie rounds to A, i.e. A's
// significand is even; m is exact in fp64), i.e. iff x >= c = mn + m (or x > c). c is bracketed
// by the fp64 sums rounded down and up; the smallest bf16 >= c is bf16↑(fp32↑(c rounded up)) (a
// bf16 value between c and its upward rounding would be that rounding itself), and when the tie
// fails and c is exactly a bf16 value, the next bf16 above it. (Earlier versions stepped fp32
// ulps from fl(mn + A); when |mn| >> |x|, e.g. the middle threshold of a symmetric group, that
// took up to 16 steps and was most of the kernel's threshold time.)
// Session 11 (KVPOOL_WRITE_MID_BITS): A and m without fp32 <-> fp64 conversions. For every fp16
// s > 0, A = fp32↑(β·s) is exactly w·s (w·s has at most 14 significant bits, so it is an fp32
// value, and β·s = w·s − ε·s with 0 < ε·s below the gap to w·s's fp32 predecessor: ε·s <
// 2^(E−24) for w = ½, < 2^(E−23)/1.5 and < 0.8·2^(E−23) for 1½ and 2½, whose products are never
// powers of two), and w·s is exact in fp64 too. The fp64 pattern of A has its 29 low significand
// bits clear, so subtracting 2^28 from it gives m = A − ½·(A − pred32(A)) in both cases (A a power
// of two or not: the borrow then moves into the exponent and gives A − 2^(E−25)), and bit 29 is
// A's fp32 significand lsb. Checked on the host for all 31,743 positive finite fp16 s and the
// three levels: m and the tie rule equal the fp32↑ / predecessor form above (0 of 95,229 differ).
#ifndef KVPOOL_WRITE_MID_BITS
#define KVPOOL_WRITE_MID_BITS 1
#endif
__device__ __forceinline__ uint32_t CodeThresholdBf16(float mn, float s, int j) {
  if (!(s > 0.f)) return 0x7f80u;
#if KVPOOL_WRITE_MID_BITS
  const double w = j == 0 ? 0.5 : (j == 1 ? 1.5 : 2.5);
  const long long a_bits = __double_as_longlong(w * double(s));  // A = w·s, exact
  const double mid = __longlong_as_double(a_bits - (1ll << 28));
  const bool tie_passes = ((a_bits >> 29) & 1) == 0;
#else
  const double beta = j == 0 ? 0.5 - 0x1p-26 : (j == 1 ? 1.5 - 0x1p-24 : 2.5 - 0x1p-23);
  const float a_hi = __double2float_ru(beta * double(s));       // A > 0, finite (s <= 65504)
  const float a_lo = __int_as_float(__float_as_int(a_hi) - 1);  // its fp32 predecessor
  const double mid = 0.5 * (double(a_hi) + double(a_lo));
  const bool tie_passes = (__float_as_int(a_hi) & 1) == 0;
#endif
  const double c_up = __dadd_ru(double(mn), mid), c_dn = __dadd_rd(double(mn), mid);
  const __nv_bfloat16 b = __float2bfloat16_ru(__double2float_ru(c_up));
  uint32_t bits = __bfloat16_as_ushort(b);
  if (!tie_passes && c_up == c_dn && double(__bfloat162float(b)) == c_up)
    bits = Bf16FromKey(Bf16Key(bits) + 1);
  return bits;
}

// Swizzled 16-byte chunk of tile row r: conflict-free both for ldmatrix (8 consecutive rows,
// one chunk) and for the quad reads of step 2 (rows 2m and 2m+1, four chunks each).
__device__ __forceinline__ int Swz(int chunk, int row) {
  return chunk ^ (((row & 1) << 2) | ((row >> 1) & 3));
}

// Stage layout of the non-rotating INT2 kernels (quantize-only, demotion; v7): the tile's rows
// back to back (linear offset L = 2D·row + byte), each 16-byte chunk moved by the 128-byte
// swizzle, L ^ (((L >> 7) & 7) << 4) (Swz128) — the layout a TMA load with
// CU_TENSOR_MAP_SWIZZLE_128B writes (stage bases 1024-byte aligned). Quantize-only and demotion
// load a tile with one TMA instruction from one lane instead of D/8 cp.async per row spread
// over the warp (≈ 75 issue and addressing instructions per tile at d 128; ncu on the H200 at
// 256K token-heads: 1,076 instead of ≈ 1,115 warp instructions per tile); with
// KVPOOL_WRITE_TMA=0 or a map the driver refuses they fall back to cp.async into the same
// layout. Lane g of the register layout reads rows RowOf(g) and
// RowOf(g) + 8 (a permutation of g, g + 8) chosen so that the quad reads of step 2 are free of
// bank conflicts under this swizzle (d 128: the two rows of a phase of 8 lanes differ in bit 1;
// d 64: the four rows of a half-warp's 8-byte reads differ in bits 1-2; d 256: 2-way conflicts
// remain, the swizzle term being the same for both rows). The rotating kernels keep the layout
// of Swz (their ldmatrix reads need it), and so does the BF16-output kernel.
template <bool kRotate, bool kOutBf16, bool kWs = false>
__host__ __device__ constexpr bool UseTmaLayout() {
  return kWs || (!kRotate && !kOutBf16);
}
template <int D>
__device__ __forceinline__ int RowOf(int g) {
  if constexpr (D == 64) return 2 * (g & 3) + (g >> 2);
  if constexpr (D == 128) return (g & 4) | ((g & 1) << 1) | ((g >> 1) & 1);
  return g;
}
// Physical byte offset of linear stage offset L in the TMA layout.
__device__ __forceinline__ int Swz128(int l) { return l ^ ((l >> 3) & 0x70); }
// Step 2's reads in the TMA layout: lane (gr, tig) reads piece (q, m4) of row gr at
// Swz128(2D·gr + byte), byte = 2·(tig·D/16 + q·D/4 + 4·m4), which splits into a lane part
// and compile-time parts as ((ReadLaneOffset ^ ReadXor) + ReadAdd) (the XOR only touches bits
// 4-6, which the lane part's 2D·gr term leaves clear; row gr + 8 is 16·D bytes further):
//  d 64:  byte = 8·tig + 32·q, line = gr % 8: chunk (tig/2 + 2q) ^ (gr % 8);
//  d 128: byte = 16·tig + 64·q, line = (2gr + q/2) % 8: chunk (tig + 4(q % 2)) ^ line;
//  d 256: byte = 32·tig + 128·q + 8·m4, line = (4gr + q) % 8: chunk (2tig + m4/2) ^ line.
template <int D>
__device__ __forceinline__ int ReadLaneOffset(int gr, int tig) {
  if constexpr (D == 64) return 128 * gr + 16 * ((tig >> 1) ^ (gr & 7)) + 8 * (tig & 1);
  if constexpr (D == 128) return 256 * gr + 16 * (tig ^ ((2 * gr) & 7));
  return 512 * gr + 16 * ((2 * tig) ^ (4 * (gr & 1)));
}
template <int D>
__host__ __device__ constexpr int ReadXor(int q, int m4) {
  return D == 64 ? 32 * q : D == 128 ? 16 * (4 * (q & 1) | (q >> 1)) : 16 * ((m4 / 2) ^ q);
}
template <int D>
__host__ __device__ constexpr int ReadAdd(int q) {
  return D == 64 ? 0 : 128 * (D == 128 ? q >> 1 : q);
}

// kWs: Rᵀ of K and of V (fp16, 2·D·D·2 bytes), the consumer warps' rings, and two mbarriers per
// consumer stage (tile loaded; tile rotated).
template <int D, bool kRotate, bool kOutBf16 = false, bool kWs = false>
constexpr int WriteSmemBytes() {
  if constexpr (kWs)
    return 2 * D * D * 2 + kWsConsumerWarps * kStages * kTileRows * 2 * D + 1024 +
           kWsConsumerWarps * kStages * 8 * 2;
  // (TMA layout: + 16 bytes after the mbarriers for the dynamic-tail counter, WriteArgs::dyn)
  return (kRotate ? D * D * 2 : 0) + WarpsPerCta<D, kRotate>() * kStages * kTileRows * 2 * D +
         (UseTmaLayout<kRotate, kOutBf16>() ? 1024 + WarpsPerCta<D, kRotate>() * kStages * 8 + 16
                                            : 0);
}

// CTAs per SM the register budget is sized for (quantize: 24 warps per SM = 80 registers, no
// spills, as 24 / kQWarps CTAs of kQWarps warps; shared memory, 8 KB of rings per warp, allows no
// 25th warp. Measured on the H200 with 4-warp CTAs: 6 CTAs 2.6 % faster than 5 at 256K
// token-heads; 4 CTAs of 7 warps (72 registers, the whole 228 KB of shared memory) 4 % slower
// than 6 x 4; session 11: one CTA of 24 warps 7 % faster than 6 x 4 (see kQWarps). Rotating:
// 2 x 8 warps, which shared memory allows anyway).
template <int D, bool kRotate, bool kWs = false>
constexpr int MinBlocks() {
  return kWs || D >= 256 ? 1 : kRotate ? 2 : 24 / kQWarps;
}

// kDemote (quantize-only kernels only): the source is BF16 pages (WriteArgs::src_pages) instead
// of token rows; a template parameter since session 9, so that the token writes carry none of
// demotion's source-page fetches and branches (and demotion none of the token path's).
// Rotates a warpgroup's 64 tile rows in place (kWs, d 128): every warp of the warpgroup calls it
// with its own 16-row tile at shared address xs (TMA layout: rows of 256 bytes, 128-byte swizzle)
// and b_lo = WgmmaDescLo of the item kind's Rᵀ (fp16, K-major, 128-byte swizzle). Each warp loads
// its rows as wgmma A fragments (ldmatrix; bf16 -> fp16, exact unless |x| > 65504: inf, and the
// row is refused downstream), the warpgroup multiplies the 64 rows by Rᵀ kN columns per wgmma
// (eight k16 steps, fp32 accumulation), and the bf16-rounded products overwrite the tile in the
// same layout (stmatrix). Warpgroup-collective (wgmma .sync.aligned): all four warps call it
// for the same item; the caller orders its later reads of the tile (__syncwarp).
template <int kN>
__device__ __forceinline__ void WsRotateTile(uint32_t xs, uint32_t b_lo, int lane) {
  constexpr int D = 128;
  const int mi = lane >> 3;                    // ldmatrix / stmatrix: matrix of this lane's
  const int lrow = (lane & 7) + 8 * (mi & 1);  // row address, and that row of the tile
  uint32_t af[8][4];
#pragma unroll
  for (int s8 = 0; s8 < 8; ++s8) {
    const uint32_t ad = xs + uint32_t(Swz128(lrow * 256 + (2 * s8 + (mi >> 1)) * 16));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(af[s8][0]), "=r"(af[s8][1]), "=r"(af[s8][2]), "=r"(af[s8][3])
                 : "r"(ad));
#if !KVPOOL_WRITE_ROT_BF16
#pragma unroll
    for (int i = 0; i < 4; ++i)
      af[s8][i] = PackHalf2(Bf16LoToFloat(af[s8][i]), Bf16HiToFloat(af[s8][i]));
#endif
  }
  // N in chunks of kN columns (kN / 2 accumulators per thread).
#pragma unroll
  for (int nc = 0; nc < D / kN; ++nc) {
    float acc[kN / 2];
#pragma unroll
    for (int r = 0; r < kN / 2; ++r) acc[r] = 0.f;
    WgmmaFence();
#pragma unroll
    for (int s8 = 0; s8 < 8; ++s8)
      WgmmaM64K16<kN, KVPOOL_WRITE_ROT_BF16 != 0>(
          acc, af[s8],
          WgmmaDescFromLo(b_lo +
                          uint32_t(((s8 >> 2) * 128 * D + nc * kN * 128 + (s8 & 3) * 32) >> 4)),
          s8 > 0);
    WgmmaCommit();
    WgmmaWaitAll();
#pragma unroll
    for (int r = 0; r < kN / 2; ++r) RegFence(acc[r]);
    if (nc == D / kN - 1) {
#pragma unroll
      for (int s8 = 0; s8 < 8; ++s8)
#pragma unroll
        for (int i = 0; i < 4; ++i) RegFence(af[s8][i]);
    }
    // stmatrix j: the n8 tiles 2j, 2j + 1 of the chunk, rows 0-7 / 8-15 each
#pragma unroll
    for (int j = 0; j < kN / 16; ++j) {
      const uint32_t ad =
          xs + uint32_t(Swz128(lrow * 256 + (nc * (kN / 8) + 2 * j + (mi >> 1)) * 16));
      StMatrixX4(
          ad, PackBf162(acc[8 * j], acc[8 * j + 1]), PackBf162(acc[8 * j + 2], acc[8 * j + 3]),
          PackBf162(acc[8 * j + 4], acc[8 * j + 5]), PackBf162(acc[8 * j + 6], acc[8 * j + 7]));
    }
  }
}

template <int D, bool kRotate, bool kOutBf16, bool kWs = false, bool kDemote = false>
__global__ void __launch_bounds__(32 * WarpsPerCta<D, kRotate, kWs>(), MinBlocks<D, kRotate, kWs>())
    KvWriteKernel(const WriteArgs a, const __grid_constant__ TmaMaps maps) {
  constexpr int kRegs = D / 4;   // packed registers per lane
  constexpr int kSpan = D / 16;  // columns per quarter per lane (= code bytes per row)
  constexpr int kNG = D > 128 ? D / 128 : 1;
  constexpr int kRowBytes = 2 * D;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kStageBytes = kTileRows * kRowBytes;
  constexpr int kWarps = WarpsPerCta<D, kRotate, kWs>();
  constexpr int kThreads = 32 * kWarps;
  static_assert(32 * kRegs * 4 == kStageBytes, "a stage holds the warp's packed registers");
  static_assert(!kWs || (D == 128 && kRotate), "the warp-specialized kernels are d 128 rotations");
  static_assert(!kDemote || (!kRotate && !kOutBf16), "demotion is a quantize-only kernel");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  constexpr bool kTmaLayout = UseTmaLayout<kRotate, kOutBf16, kWs>();
  // The rotation by mma.sync inside every warp (d 64 / 256, and the fallback at d 128); kWs
  // rotates in a producer warpgroup (wgmma) and its consumer warps run the TMA-layout path.
  constexpr bool kMma = kRotate && !kWs;
  constexpr int kRotBytes = kWs ? 2 * D * D * 2 : kMma ? D * D * 2 : 0;
  // Rings of all (consumer) warps.
  constexpr int kRingWarps = kWs ? kWsConsumerWarps : kWarps;
  // Same-row register layout (quantize-only, demotion; see step 2): each packed register holds
  // two adjacent columns of one row, x[0 .. kRegs/2) row gr and x[kRegs/2 ..) row gr+8.
  constexpr bool kNat = kTmaLayout;
  // IMAD comparator-min quarters of the selection's sorting runs (see kImadMinRuns).
  constexpr int kImad = kWs ? kImadMinRunsWs : kImadMinRuns;
  // kTmaLayout: stages 1024-byte aligned (the 128-byte swizzle repeats every 1024 bytes);
  // WriteSmemBytes reserves the slack.
  uint8_t* smem = smem_raw;
  if constexpr (kTmaLayout) smem += (1024 - (SmemAddr(smem_raw) & 1023)) & 1023;
  const int kv_cta = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  // Tile rows of this lane in the register layout: gr and gr + 8.
  const int gr = kTmaLayout ? RowOf<D>(g) : g;
  // kMma: [D][D] fp16, row n = column π(n) of R (Rᵀ, permuted), swizzled. kWs: Rᵀ of K then of
  // V, fp16, K-major in the 128-byte swizzle for wgmma (see the producer below).
  uint8_t* rt = smem;
  uint8_t* ring = smem + kRotBytes + warp * kStages * kStageBytes;
  // TMA loads: the warp's two stage mbarriers (after all rings), phase parity per stage. kWs: a
  // consumer warp's TMA completes on bar_sa (the producer waits there), and the producer's
  // rotated tile on full_sa (the consumer waits there).
  const bool tma = kTmaLayout && a.use_tma != 0;
  const uint32_t bars0 = SmemAddr(smem + kRotBytes + kRingWarps * kStages * kStageBytes);
  const uint32_t bar_sa = bars0 + warp * 8 * kStages;
  const uint32_t full_sa = bars0 + kRingWarps * 8 * kStages + warp * 8 * kStages;
  uint32_t phases = 0;
  const bool ring_warp = !kWs || warp < kWsConsumerWarps;
  if (tma && ring_warp) {
    if (lane == 0) {
      TmaPrefetchDescriptor(&maps.k);
      if (kRotate || kOutBf16 ? a.src_pages == nullptr : !kDemote) TmaPrefetchDescriptor(&maps.v);
#pragma unroll
      for (int st = 0; st < kStages; ++st) {
        MbarInit(bar_sa + 8 * st, 1);
        if constexpr (kWs) MbarInit(full_sa + 8 * st, 1);
      }
      MbarInitFence();
    }
    __syncwarp();
  }

  if constexpr (kMma) {
    const float* r = (kv_cta ? a.rot_v : a.rot_k) + blockIdx.y * a.rot_head_stride;
    for (int idx = threadIdx.x; idx < D * D; idx += kThreads) {
      const int k = idx / D, col = idx % D;  // R[k][col]
      // col = tig'·D/16 + q·D/4 + i  ->  MMA column n = 8·(q·D/32 + i/2) + 2·tig' + i%2
      const int q = col / (D / 4), rem = col % (D / 4);
      const int tg = rem / kSpan, i = rem % kSpan;
      const int n = 8 * (q * (D / 32) + i / 2) + 2 * tg + (i & 1);
      const __half v = __float2half_rn(r[idx]);
      const int c = (k >> 3) ^ (n & 7);
      *reinterpret_cast<__half*>(rt + n * 2 * D + 16 * c + 2 * (k & 7)) = v;
    }
    __syncthreads();
  }

  // (The rotating and BF16-output kernels never see src_pages; they keep the run-time test,
  // with which ptxas spilled less in them: 40 instead of 72 bytes in rotate-bf16 kWs.)
  const bool demote = kRotate || kOutBf16 ? a.src_pages != nullptr : kDemote;
  // Elements at or above τ (τ = sorted_ascending[D - need]) for K and V; 0: no clipping.
  auto need_for = [](float clip) {
    if (!(clip > 0.f)) return 0;
    return D - min(max(int(floorf(clip * D)), 0), D - 1);
  };
  const int need_k = need_for(a.clip_k), need_v = need_for(a.clip_v);
  const int P = a.page_size;
  const uint64_t int2_chunk = uint64_t(P) * (D / 2 + 8 * kNG);
  const uint64_t bf16_chunk = 4ull * P * D;
  const int ntiles = (a.num_tokens + kTileRows - 1) / kTileRows;
  // Work items of a warp. The rotating kernels keep one (head, K|V) per CTA (its Rᵀ is in
  // shared memory); the others alternate K and V tiles of the same tokens in every warp
  // (items 2i, 2i+1 = tile i's K, V): V tiles cost more than K tiles (the V clip selects the
  // 11th instead of the 6th largest), and with one kind per CTA the block scheduler filled
  // whole SMs with K CTAs that then idled while the V SMs finished.
  constexpr bool kMix = !kMma;
  const uint64_t tok_row_bytes = uint64_t(a.token_stride) * 2;

  // P is 16 or 64 (CheckShape): token -> (page, slot) by shifts.
  const int lg_p = P == 64 ? 6 : 4;
  // An item: 16 rows (tokens tile·16 ..) of head h, K (kv 0) or V (kv 1).
  struct Item {
    int h, tile, kv;
  };
  // The items of this warp: `left` of them from `cur` on, `adv` steps to the next one.
  //  * Rotating kernels: one (head, K|V) per CTA (blockIdx.y, blockIdx.z; its Rᵀ is in shared
  //    memory); the CTA's warps take tiles first, first + stride, ...
  //  * The others: the items of all heads, numbered (h·ntiles + tile)·2 + kv (K and V of the
  //    same tokens are consecutive: V tiles cost more than K tiles, and the V item reuses the
  //    K item's destination pages/slots), are split into one contiguous range per warp of
  //    ⌊N/W⌋ or ⌈N/W⌉ items. (Before: per-head strided tiles, whose counts differed by a whole
  //    K/V pair: at 256K token-heads 22 % of the warps had 12 items and the rest 10, so the SMs
  //    idled for the last two.)
  Item cur;
  // Items left (< 2^31: SetSplit). 64-bit in the rotate-bf16 kWs kernel, where ptxas spilled
  // less with it (40 instead of 48 bytes; the other kernels spill less or not at all with 32).
  std::conditional_t<kWs && kOutBf16, int64_t, int> left;
  int stride = 0;
  // kWs: items are (head, group of 4 tiles = 64 tokens, K|V), numbered (h·ngroups + grp)·2 + kv
  // over the CTA's heads (one head when the rotation is per head: grid y; else all), split into
  // one contiguous range per consumer warpgroup; warp sub of the warpgroup takes tile
  // 4·grp + sub of each item (the producer rotates the four tiles with one wgmma, M = 64).
  const int ngroups = (ntiles + 3) / 4;
  const bool per_head_rot = a.rot_head_stride != 0;
  const int ws_h0 = per_head_rot ? int(blockIdx.y) : 0;
  // First item of worker i (see WriteArgs::split_q): ⌊i·N / W⌋ without a 64-bit division.
  auto split_begin = [&](uint32_t i) -> int64_t {
    return int64_t(i) * a.split_q + int64_t((i * a.split_r) / a.split_w);
  };
  // Dynamic tail (WriteArgs::dyn; quantize-only token writes only): the CTA's counter after the
  // mbarriers holds the absolute index of the next unclaimed item of the CTA's range;
  // claim() takes one (lane 0's shared-memory atomic, broadcast to the warp). dyn_j: absolute
  // index of the current item; dyn_static_end: end of this warp's static range; dyn_end: end of
  // the CTA's range.
  constexpr bool kDyn = !kRotate && !kOutBf16 && !kWs && !kDemote;
  const bool dyn = kDyn && a.dyn != 0;
  const uint32_t dyn_sa = bars0 + kRingWarps * 8 * kStages;
  uint32_t dyn_j = 0, dyn_static_end = 0, dyn_end = 0;
  auto claim = [&]() -> uint32_t {
    uint32_t old = 0;
    if (lane == 0)
      asm volatile("atom.shared::cta.add.u32 %0, [%1], 1;\n" : "=r"(old) : "r"(dyn_sa) : "memory");
    return __shfl_sync(0xffffffffu, old, 0);
  };
  // Item pair index gt -> (gt / split_den, gt % split_den).
  auto split_pair = [&](int64_t gt, int& quo, int& rem) {
    if (a.div32) {
      const uint32_t g32 = uint32_t(gt), q32 = g32 / a.split_den;
      quo = int(q32);
      rem = int(g32 - q32 * a.split_den);
    } else {
      quo = int(gt / a.split_den);
      rem = int(gt - int64_t(quo) * a.split_den);
    }
  };
  if constexpr (kWs) {
    const int sub = warp & 3;
    const uint32_t wg = blockIdx.x * kWsGroups + (warp >> 2);
    const int64_t begin = split_begin(wg), end = split_begin(wg + 1);
    left = ring_warp ? int(end - begin) : 0;
    int hq, grp;
    split_pair(begin >> 1, hq, grp);
    cur.h = ws_h0 + hq;
    cur.tile = 4 * grp + sub;
    cur.kv = int(begin & 1);
  } else if constexpr (kMix) {
    if (dyn) {  // split_* over CTAs (see WriteArgs::dyn)
      const uint32_t cb = uint32_t(split_begin(blockIdx.x));
      const uint32_t s = uint32_t(a.dyn_static);
      dyn_end = uint32_t(split_begin(blockIdx.x + 1));
      dyn_static_end = cb + uint32_t(warp + 1) * s;
      if (threadIdx.x == 0)
        asm volatile("st.shared::cta.u32 [%0], %1;\n" ::"r"(dyn_sa), "r"(cb + uint32_t(kWarps) * s)
                     : "memory");
      __syncthreads();
      dyn_j = s > 0 ? cb + uint32_t(warp) * s : claim();
      left = dyn_j < dyn_end ? 1 : 0;
      split_pair(dyn_j >> 1, cur.h, cur.tile);
      cur.kv = int(dyn_j & 1);
    } else {
      const uint32_t w = blockIdx.x * kWarps + warp;
      const int64_t begin = split_begin(w), end = split_begin(w + 1);
      left = int(end - begin);
      split_pair(begin >> 1, cur.h, cur.tile);  // split_den = ntiles
      cur.kv = int(begin & 1);
    }
  } else {
    const int first = blockIdx.x * kWarps + warp;
    stride = gridDim.x * kWarps;
    cur.h = blockIdx.y;
    cur.tile = first;
    cur.kv = kv_cta;
    left = first < ntiles ? (ntiles - first + stride - 1) / stride : 0;
  }
  auto adv = [&](Item c) {
    if constexpr (kWs) {
      c.kv ^= 1;
      if (c.kv == 0) {
        c.tile += 4;
        if (c.tile >= 4 * ngroups) {
          c.tile &= 3;
          ++c.h;
        }
      }
    } else if constexpr (kMix) {
      c.kv ^= 1;
      if (c.kv == 0 && ++c.tile == ntiles) {
        c.tile = 0;
        ++c.h;
      }
    } else {
      c.tile += stride;
    }
    return c;
  };
  // Source page of an item's tile (demotion; every tile lies in one page since P % 16 == 0).
  auto src_page_of = [&](const Item& c, bool valid) -> int {
    return (demote && valid) ? __ldg(a.src_pages + ((c.tile * kTileRows) >> lg_p)) : 0;
  };
  // cp.async pattern of one tile: lane copies 16-byte chunk c = lane % kChunks of rows
  // r0 + kRowStep·q (q < kCopies); the shared offsets are per-lane constants (the swizzle of
  // row r0 + kRowStep·q depends on q only through compile-time terms).
  constexpr int kRowStep = 32 / kChunks;
  constexpr int kCopies = kTileRows / kRowStep;
  const int cp_r0 = lane / kChunks, cp_c = lane % kChunks;
  const uint32_t ring_sa = SmemAddr(ring);
  // Issues the loads of item c into stage `st`: tma, one TMA box completing on the stage's
  // mbarrier (nothing when !valid); else cp.async (zero-filled rows past the end; nothing but
  // the commit when !valid).
  auto issue = [&](const Item& c, bool valid, int st, int src_page) {
    if (tma) {
      // One lane posts the stage's bytes and issues the tile's one box load (rows past the end
      // are zero-filled by the TMA unit and count towards the bytes). The stage was last read and
      // written (parked values) by this warp before the __syncwarp that ended the previous
      // item, and every such access had completed (its value was used).
      if (valid && lane == 0) {
        const uint32_t bar = bar_sa + 8 * st;
        const int t0 = c.tile * kTileRows;
        if (kWs && t0 >= a.num_tokens) {
          // a tile past the end of the last group: nothing to load (the producer rotates
          // whatever the stage holds; no row of it is stored)
          MbarArrive(bar);
          return;
        }
        MbarArriveExpectTx(bar, kStageBytes);
        if (demote)
          TmaLoad3d(ring_sa + st * kStageBytes, &maps.k,
                    ((2 * c.h + c.kv) * P + (t0 & (P - 1))) * (D / 64), src_page, bar);
        else
          TmaLoad3d(ring_sa + st * kStageBytes, c.kv ? &maps.v : &maps.k, c.h * (D / 64), t0, bar);
      }
      return;
    }
    if (valid) {
      const int t0 = c.tile * kTileRows;
      const uint8_t* base;
      uint64_t row_bytes;
      if (demote) {
        base = a.src_base + uint64_t(src_page) * a.src_stride + uint64_t(c.h) * bf16_chunk +
               uint64_t(c.kv) * 2 * P * D + uint64_t(t0 & (P - 1)) * kRowBytes;
        row_bytes = kRowBytes;
      } else {
        base = reinterpret_cast<const uint8_t*>(c.kv ? a.src_v : a.src_k) +
               uint64_t(c.h) * kRowBytes + uint64_t(t0) * tok_row_bytes;
        row_bytes = tok_row_bytes;
      }
      const uint8_t* src = base + uint64_t(cp_r0) * row_bytes + 16 * cp_c;
      const uint64_t step = kRowStep * row_bytes;
      const uint32_t dst = ring_sa + st * kStageBytes + (kTmaLayout ? 0 : cp_r0 * kRowBytes);
      // Shared offset of copy q relative to dst. kTmaLayout: its linear offset is 16·lane +
      // 512·q (kRowStep rows are 512 bytes), whose 128-byte line is (lane / 8) ^ 4·(q % 2)
      // modulo 8, so Swz128 gives 512·q + (S ^ 64·(q % 2)), S = Swz128(16·lane).
      auto sm_off = [&](int q) {
        const int row = cp_r0 + kRowStep * q;
        if constexpr (kTmaLayout) return 512 * q + (Swz128(16 * lane) ^ (64 * (q & 1)));
        return q * kRowStep * kRowBytes + 16 * Swz(cp_c, row);
      };
      if (kOutBf16 && t0 + kTileRows <= a.num_tokens && step <= 0xffffffffull) {
        // BF16 output, full tile (warp-uniform): no predicates, and each row's address in one
        // 32 x 32 + 64-bit multiply-add (FMA pipe) instead of a 64-bit add on the ALU pipe
        // (measured on the H200 at 256K token-heads: rotate-bf16 6 % faster, the quantizing
        // kernels 2 % slower, their FMA pipe being busy with the code sums).
        const uint32_t step32 = uint32_t(step);
#pragma unroll
        for (int q = 0; q < kCopies; ++q) {
          CpAsync16Sa(dst + sm_off(q), q == 0 ? src : MadWide(step32, kSmallInts[q], src), true);
        }
      } else if (t0 + kTileRows <= a.num_tokens) {  // a full tile (warp-uniform): no predicates
#pragma unroll
        for (int q = 0; q < kCopies; ++q) {
          CpAsync16Sa(dst + sm_off(q), src, true);
          src += step;
        }
      } else {
        const int rows_left = a.num_tokens - t0 - cp_r0;
#pragma unroll
        for (int q = 0; q < kCopies; ++q) {
          // Rows past the end: source size 0 zero-fills and reads no global memory.
          CpAsync16Sa(dst + sm_off(q), src, kRowStep * q < rows_left);
          src += step;
        }
      }
    }
    CpAsyncCommit();
  };
  // Destination page and slot of tile rows g and g+8.
  auto dest_of = [&](const Item& c, bool valid, int(&pg)[2], int(&sl)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = c.tile * kTileRows + gr + 8 * r;
      pg[r] = 0;
      sl[r] = 0;
      if (valid && t < a.num_tokens) {
        if (demote) {
          pg[r] = __ldg(a.dst_page + (t >> lg_p));
          sl[r] = t & (P - 1);
        } else {
          pg[r] = __ldg(a.dst_page + t);
          sl[r] = __ldg(a.dst_slot + t);
        }
      }
    }
  };

  // The item after next (demotion prefetches its source page an item ahead of its issue).
  Item nxt = adv(cur);
  issue(cur, left > 0, 0, src_page_of(cur, left > 0));
  int src_pg_next = src_page_of(nxt, left > 1);
  int pg[2], sl[2];
  dest_of(cur, left > 0, pg, sl);
  // The (row, group) combination this lane owns in step 4 (see there): lane tig owns c = tig %
  // kCombos, i.e. row my_r (0: gr, 1: gr + 8) and group my_grp of it; it stores that
  // combination's params, and (my_grp == 0) the row's flag.
  constexpr int kCombos = 2 * kNG;
  const int my_c = tig % kCombos;
  const int my_r = my_c / kNG, my_grp = my_c % kNG;
  const bool owns_params = tig < kCombos;
  // INT2 destinations of tile rows g, g+8: this lane's K code bytes at rb[r] (V: + P·D/4); the
  // K params of its own combination at pp (V: + 4·kNG·P); the K flag of its own row at
  // row_flags[fl] (V: + 1). Worked out once per K/V pair.
  uint8_t* rb[2];
  uint8_t* pp;
  uint64_t fl;
  auto make_rb = [&](int hh, int tl, const int(&p)[2], const int(&s)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
      rb[r] = a.dst_base + uint64_t(p[r]) * a.dst_stride + uint64_t(hh) * int2_chunk +
              uint32_t(s[r] * (D / 4) + tig * kSpan);
    const int pm = my_r ? p[1] : p[0], sm = my_r ? s[1] : s[0];
    pp = a.dst_base + uint64_t(pm) * a.dst_stride + uint64_t(hh) * int2_chunk +
         uint32_t(2 * P * (D / 4) + sm * (4 * kNG) + 4 * my_grp);
    const int tm = tl * kTileRows + gr + 8 * my_r;
    fl = (uint64_t(uint32_t(tm)) * uint32_t(a.num_kv_heads) + uint32_t(hh)) * 2;
  };
  if constexpr (!kOutBf16) make_rb(cur.h, cur.tile, pg, sl);
  int stage = 0;
  if constexpr (!kWs) {
    // WriteArgs::first_wait: the first tile before the second is issued (waiting on the same
    // phase again at the top of the loop returns at once).
    if (tma && a.first_wait && left > 0) MbarWaitParity(bar_sa, 0u);
  }

  if constexpr (kWs) {
    // ---- Rᵀ of K and V for wgmma (after the consumers' first tile loads are in flight) ----
    // B operand K-major in the 128-byte swizzle: element R[k][n] of kind kv at
    // kv·2D² + (k / 64)·128·D + 128·n + 16·((k % 64) / 8 ^ n % 8) + 2·(k % 8) (two 64-wide k
    // blocks of D rows of 128 bytes). Each thread converts whole 16-byte chunks (8 consecutive
    // k of one column n; consecutive lanes take consecutive n: coalesced loads, conflict-free
    // stores), all loads first.
    {
      const int hr = per_head_rot ? int(blockIdx.y) : 0;
      constexpr int kChunksR = 2 * D * D / 8;
      constexpr int kIt = (kChunksR + kThreads - 1) / kThreads;
      float f[kIt][8];
#pragma unroll
      for (int it = 0; it < kIt; ++it) {
        const int idx = threadIdx.x + it * kThreads;
        const int kvr = idx / (D * D / 8), rem = idx % (D * D / 8);
        const int kc = rem / D, n = rem % D;
        const float* r =
            (kvr ? a.rot_v : a.rot_k) + int64_t(hr) * a.rot_head_stride + (8 * kc) * D + n;
#pragma unroll
        for (int j = 0; j < 8; ++j) f[it][j] = idx < kChunksR ? __ldg(r + j * D) : 0.f;
      }
#pragma unroll
      for (int it = 0; it < kIt; ++it) {
        const int idx = threadIdx.x + it * kThreads;
        if (idx >= kChunksR) continue;
        const int kvr = idx / (D * D / 8), rem = idx % (D * D / 8);
        const int kc = rem / D, n = rem % D;
        uint4 v;
#if KVPOOL_WRITE_ROT_BF16
        v.x = PackBf162(f[it][0], f[it][1]), v.y = PackBf162(f[it][2], f[it][3]);
        v.z = PackBf162(f[it][4], f[it][5]), v.w = PackBf162(f[it][6], f[it][7]);
#else
        v.x = PackHalf2(f[it][0], f[it][1]), v.y = PackHalf2(f[it][2], f[it][3]);
        v.z = PackHalf2(f[it][4], f[it][5]), v.w = PackHalf2(f[it][6], f[it][7]);
#endif
        *reinterpret_cast<uint4*>(rt + kvr * 2 * D * D + (kc >> 3) * 128 * D + 128 * n +
                                  16 * ((kc & 7) ^ (n & 7))) = v;
      }
      FenceProxyAsyncShared();  // generic stores -> wgmma (async proxy) reads
      __syncthreads();          // also: every consumer warp's mbarriers are initialized
    }
    if (!kWsSelf && warp >= kWsConsumerWarps) {
      // ---- producer warpgroup: per consumer warpgroup c and its item n in turn (the order
      // in which the consumers take them), its warp pw waits for consumer warp 4c + pw's tile
      // (TMA into that warp's stage), loads it as wgmma A fragments (bf16 -> fp16, exact unless
      // |x| > 65504: inf, and the row is refused downstream), the warpgroup multiplies the 64
      // rows by Rᵀ of the item's kind (WsColumns() columns per wgmma, eight k16 steps, fp32
      // accumulation), and the bf16-rounded products overwrite the tile in place in the same
      // layout (stmatrix), which the consumer then reads like a loaded tile.
      if constexpr (WsProducerRegs<kOutBf16>() > 0)
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WsProducerRegs<kOutBf16>()));
      const int pw = (warp - kWsConsumerWarps) & 3;
      const int pg_idx = (warp - kWsConsumerWarps) >> 2;  // this producer warpgroup
      int left_c[kWsGroups], kv0_c[kWsGroups];
      int max_left = 0;
      int64_t b_c = split_begin(blockIdx.x * kWsGroups);
#pragma unroll
      for (int c = 0; c < kWsGroups; ++c) {
        const int64_t end = split_begin(blockIdx.x * kWsGroups + c + 1);
        left_c[c] = int(end - b_c);
        kv0_c[c] = int(b_c & 1);
        max_left = max(max_left, left_c[c]);
        b_c = end;
      }
      const uint32_t rt_sa = SmemAddr(rt);
      const uint32_t ring0_sa = SmemAddr(smem + kRotBytes);
      for (int n = 0; n < max_left; ++n) {
        const int st = n & 1;
        const uint32_t par = uint32_t(n >> 1) & 1u;
#pragma unroll
        for (int c = 0; c < kWsGroups; ++c) {
          if (c % (kWsSelf ? 1 : kWsProducers) != pg_idx || n >= left_c[c])
            continue;  // warpgroup-uniform
          const int cw = 4 * c + pw;
          const uint32_t xs = ring0_sa + uint32_t((cw * kStages + st) * kStageBytes);
          MbarWaitParity(bars0 + uint32_t(cw * 8 * kStages + 8 * st), par);
          const int kvi = (kv0_c[c] + n) & 1;
          // Rᵀ of the item's kind
          WsRotateTile<WsColumns<kOutBf16>()>(xs, WgmmaDescLo(rt_sa + uint32_t(kvi * 2 * D * D)),
                                              lane);
          __syncwarp();
          if (lane == 0) MbarArrive(bars0 + uint32_t((kRingWarps + cw) * 8 * kStages + 8 * st));
        }
      }
      return;
    }
    // the consumers give up what the producer took (WsProducerRegs)
    if constexpr (WsProducerRegs<kOutBf16>() > 0)
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(
          96 -
          (WsProducerRegs<kOutBf16>() - 96) * 4 * (kWsSelf ? 1 : kWsProducers) / kWsConsumerWarps));
  }

  for (; left > 0; --left) {
    const int tile = cur.tile, kv = cur.kv, h = cur.h;
    const int need = kv ? need_v : need_k;
    // The next item: the one after cur (nxt = adv(cur) here), or (dyn, past the warp's static
    // range) one claimed from the CTA's counter.
    bool has_nxt = left > 1, seq = true;
    if (dyn) {
      uint32_t nj = dyn_j + 1;
      if (nj >= dyn_static_end) nj = claim();  // warp-uniform
      has_nxt = nj < dyn_end;
      seq = nj == dyn_j + 1;
      if (!seq) {
        split_pair(nj >> 1, nxt.h, nxt.tile);
        nxt.kv = int(nj & 1);
      }
      dyn_j = nj;
    }
    // Prefetch: the next item's rows, its destinations and the source page after it.
    issue(nxt, has_nxt, stage ^ 1, src_pg_next);
    const Item nxt2 = adv(nxt);
    src_pg_next = src_page_of(nxt2, left > 2);
    int npg[2] = {0, 0}, nsl[2] = {0, 0};
    // the next item is the V tile of the same tokens
    const bool reuse = kMix && kv == 0 && seq;
    if (reuse) {
      if constexpr (kOutBf16) npg[0] = pg[0], npg[1] = pg[1], nsl[0] = sl[0], nsl[1] = sl[1];
    } else {
      dest_of(nxt, has_nxt, npg, nsl);
    }
    if (tma) {
      MbarWaitParity((kWs && !kWsSelf ? full_sa : bar_sa) + 8 * stage, (phases >> stage) & 1u);
      phases ^= 1u << stage;
      if constexpr (kWs && kWsSelf) {
        // the warpgroup rotates its item's four tiles (each warp its own) in place
        WsRotateTile<kWsSelfN>(ring_sa + uint32_t(stage * kStageBytes),
                               WgmmaDescLo(SmemAddr(rt) + uint32_t(kv * 2 * D * D)), lane);
        __syncwarp();
      }
    } else {
      CpAsyncWait<1>();
      __syncwarp();
    }
    const uint8_t* xs = ring + stage * kStageBytes;

    // ---- step 1/2: packed registers P[q·kSpan + i] = {row g, row g+8} of column
    //      tig·kSpan + q·D/4 + i ----
    uint32_t x[kRegs];
    if constexpr (kMma) {
      float acc[D / 8][4];
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
      const int q4 = lane >> 3, r8 = lane & 7;
#pragma unroll
      for (int s = 0; s < D / 16; ++s) {
        uint32_t af[4];
        {
          const int row = r8 + 8 * (q4 & 1);
          const int c = 2 * s + (q4 >> 1);
          LdMatrixX4(af, xs + row * kRowBytes + 16 * Swz(c, row));
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)  // bf16x2 -> f16x2 (inf when out of fp16 range)
          af[i] = PackHalf2(Bf16LoToFloat(af[i]), Bf16HiToFloat(af[i]));
#pragma unroll
        for (int nt = 0; nt < D / 8; nt += 2) {
          uint32_t bf[4];
          const int n = 8 * (nt + (q4 >> 1)) + r8;
          const int c = 2 * s + (q4 & 1);
          LdMatrixX4(bf, rt + n * 2 * D + 16 * (c ^ (n & 7)));
          MmaF16(acc[nt], af[0], af[1], af[2], af[3], bf[0], bf[1]);
          MmaF16(acc[nt + 1], af[0], af[1], af[2], af[3], bf[2], bf[3]);
        }
      }
      // acc[nt][e] = row g, acc[nt][2+e] = row g+8 of MMA column 8nt+2tig+e, i.e. of the
      // permuted column with q = nt/(D/32), i = 2·(nt%(D/32)) + e. Rounded to bf16: the INT2
      // bytes are those of the rotated BF16 form (kvpool::RotateQuantizeRowsBf16 contract).
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int q = nt / (D / 32), i = 2 * (nt % (D / 32)) + e;
          x[q * kSpan + i] = PackBf162(acc[nt][e], acc[nt][2 + e]);
        }
    } else {
      const int rd_lane = kTmaLayout ? ReadLaneOffset<D>(gr, tig) : 0;
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int m4 = 0; m4 < kSpan / 4; m4 += (kSpan >= 8 ? 2 : 1)) {
          const int byte = (tig * kSpan + q * (D / 4) + 4 * m4) * 2;
          const int c = byte >> 4, off = byte & 15;
          const uint8_t* p0 = kTmaLayout ? xs + ((rd_lane ^ ReadXor<D>(q, m4)) + ReadAdd<D>(q))
                                         : xs + g * kRowBytes + 16 * Swz(c, g) + off;
          const uint8_t* p1 =
              kTmaLayout ? p0 + 8 * kRowBytes : xs + (g + 8) * kRowBytes + 16 * Swz(c, g + 8) + off;
          uint32_t w[4], u[4];
          if constexpr (kSpan >= 8) {
            const uint4 a4 = *reinterpret_cast<const uint4*>(p0);
            const uint4 b4 = *reinterpret_cast<const uint4*>(p1);
            w[0] = a4.x, w[1] = a4.y, w[2] = a4.z, w[3] = a4.w;
            u[0] = b4.x, u[1] = b4.y, u[2] = b4.z, u[3] = b4.w;
          } else {
            const uint2 a2 = *reinterpret_cast<const uint2*>(p0);
            const uint2 b2 = *reinterpret_cast<const uint2*>(p1);
            w[0] = a2.x, w[1] = a2.y, w[2] = 0, w[3] = 0;
            u[0] = b2.x, u[1] = b2.y, u[2] = 0, u[3] = 0;
          }
          const int j = q * kSpan + 4 * m4;
#pragma unroll
          for (int e = 0; e < (kSpan >= 8 ? 4 : 2); ++e) {
            if constexpr (kNat) {  // the words as loaded: no {row g, row g+8} PRMTs
              x[j / 2 + e] = w[e];
              x[kRegs / 2 + j / 2 + e] = u[e];
            } else {
              x[j + 2 * e] = Prmt(w[e], u[e], 0x5410);
              x[j + 2 * e + 1] = Prmt(w[e], u[e], 0x7632);
            }
          }
        }
    }
    __syncwarp();  // every lane has read its rows: the stage may be reused (parking, prefetch)

    if constexpr (kOutBf16 && kNat) {
      // Same-row layout (kWs): x[r·kRegs/2 + 4q .. + 3] are columns tig·kSpan + q·D/4 .. + 7 of
      // row gr + 8r, one 16-byte store each.
      static_assert(kSpan == 8, "kNat BF16 output is implemented for d 128");
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int t = tile * kTileRows + gr + 8 * r;
        if (t < a.num_tokens) {
          uint8_t* dst = a.dst_base + uint64_t(pg[r]) * a.dst_stride + uint64_t(h) * bf16_chunk +
                         uint64_t(kv) * 2 * P * D + uint64_t(sl[r]) * kRowBytes;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int j = r * (kRegs / 2) + 4 * q;
            *reinterpret_cast<uint4*>(dst + 2 * (tig * kSpan + q * (D / 4))) =
                make_uint4(x[j], x[j + 1], x[j + 2], x[j + 3]);
          }
        }
      }
    } else if constexpr (kOutBf16) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int t = tile * kTileRows + g + 8 * r;
        if (t < a.num_tokens) {
          uint8_t* dst = a.dst_base + uint64_t(pg[r]) * a.dst_stride + uint64_t(h) * bf16_chunk +
                         uint64_t(kv) * 2 * P * D + uint64_t(sl[r]) * kRowBytes;
          const uint32_t sel = r ? 0x7632u : 0x5410u;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            uint8_t* p = dst + 2 * (tig * kSpan + q * (D / 4));
            if constexpr (kSpan >= 8) {
#pragma unroll
              for (int m8 = 0; m8 < kSpan / 8; ++m8) {
                const int j = q * kSpan + 8 * m8;
                uint4 v;
                v.x = Prmt(x[j + 0], x[j + 1], sel);
                v.y = Prmt(x[j + 2], x[j + 3], sel);
                v.z = Prmt(x[j + 4], x[j + 5], sel);
                v.w = Prmt(x[j + 6], x[j + 7], sel);
                *reinterpret_cast<uint4*>(p + 16 * m8) = v;
              }
            } else {
              const int j = q * kSpan;
              uint2 v;
              v.x = Prmt(x[j + 0], x[j + 1], sel);
              v.y = Prmt(x[j + 2], x[j + 3], sel);
              *reinterpret_cast<uint2*>(p) = v;
            }
          }
        }
      }
    } else {
      // ---- step 3: τ (rows with NaN get an arbitrary τ; they are refused below) ----
      // The packed row values wait in this tile's (already consumed) stage while the sorting
      // networks run, which keeps the register count low enough for 24 warps per SM: piece c
      // (16 bytes) of lane L at byte 512·c + 16·L (no bank conflicts; one base register and
      // immediate offsets).
      uint8_t* park = ring + stage * kStageBytes + 16 * lane;
      auto park_at = [&](int c) { return park + 512 * c; };
      uint32_t tau = 0x7f807f80u;  // +inf: no clipping
      if (need > 0) {
        uint32_t m[kRegs];
#pragma unroll
        for (int j = 0; j < kRegs; ++j) m[j] = AbsBf16x2(x[j]);
#pragma unroll
        for (int c = 0; c < kRegs / 4; ++c)
          *reinterpret_cast<uint4*>(park_at(c)) =
              make_uint4(x[4 * c], x[4 * c + 1], x[4 * c + 2], x[4 * c + 3]);
        // kNat -> {row gr, row gr+8} pairs (the rare paths below only).
        auto rows_layout = [&]() {
          if constexpr (kNat) {
            uint32_t t[kRegs];
#pragma unroll
            for (int p = 0; p < kRegs / 2; ++p) {
              t[2 * p] = Prmt(m[p], m[kRegs / 2 + p], 0x5410);
              t[2 * p + 1] = Prmt(m[p], m[kRegs / 2 + p], 0x7632);
            }
#pragma unroll
            for (int p = 0; p < kRegs; ++p) m[p] = t[p];
          }
        };
        // KVPOOL_WRITE_SHARED_RUNS: the runs of 8 sorted once for all the branches below.
        constexpr bool kShared = KVPOOL_WRITE_SHARED_RUNS != 0 && !KVPOOL_WRITE_K_TOP5;
        if (kShared && need <= 16) SortRuns<8, 8, kRegs, kImad>(m);
        if (need <= 6) {
#if KVPOOL_WRITE_K_TOP5
          // per-lane top-5 lists, the quad's top 6, checked; rarely (a lane holding 6 of the
          // row's 6 largest magnitudes) again from the parked values with top-6 lists
          bool exact;
          tau = SelectTopK<8, 5, kRegs, kNat, 6, kImad>(m, need, &exact);
          if (!__all_sync(0xffffffffu, exact)) {
#pragma unroll
            for (int c = 0; c < kRegs / 4; ++c) {
              const uint4 v = *reinterpret_cast<const uint4*>(park_at(c));
              m[4 * c] = v.x & 0x7fff7fffu, m[4 * c + 1] = v.y & 0x7fff7fffu;
              m[4 * c + 2] = v.z & 0x7fff7fffu, m[4 * c + 3] = v.w & 0x7fff7fffu;
            }
            tau = SelectTopK<8, 6, kRegs, kNat, 6, kImad>(m, need);
          }
#else
          tau = SelectTopK<8, 6, kRegs, kNat, 6, kImad, kShared>(m, need);
#endif
        } else if (need <= 8) {
          tau = SelectTopK<8, 8, kRegs, kNat, 8, kImad, kShared>(m, need);
        } else if (need <= 16) {
          bool exact;
          tau = need <= 12 ? SelectTop8Merge16<kRegs, 12, kNat, kImad, kShared>(m, need, &exact)
                           : SelectTop8Merge16<kRegs, 16, kNat, kImad, kShared>(m, need, &exact);
          if (!__all_sync(0xffffffffu, exact)) {  // rare: again from the parked values
#pragma unroll
            for (int c = 0; c < kRegs / 4; ++c) {
              const uint4 v = *reinterpret_cast<const uint4*>(park_at(c));
              m[4 * c] = v.x & 0x7fff7fffu, m[4 * c + 1] = v.y & 0x7fff7fffu;
              m[4 * c + 2] = v.z & 0x7fff7fffu, m[4 * c + 3] = v.w & 0x7fff7fffu;
            }
            rows_layout();
            tau = SelectTopK<16, 16, kRegs, false, 16, kImad>(m, need);
          }
        } else {
          rows_layout();
          tau = SelectBySearch(m, need);
        }
#pragma unroll
        for (int c = 0; c < kRegs / 4; ++c) {
          const uint4 v = *reinterpret_cast<const uint4*>(park_at(c));
          x[4 * c] = v.x, x[4 * c + 1] = v.y, x[4 * c + 2] = v.z, x[4 * c + 3] = v.w;
        }
      }
      // ---- step 4: group min/max of the clipped row, (scale16, min16), code thresholds.
      // The clipped values clamp(x, -τ, τ) are never formed: their group min/max are the
      // clamped raw min/max, and the codes of the raw x against adjusted thresholds equal the
      // codes of the clipped x (see the adjustment below). The per-(row, group) work is not
      // repeated on every lane of the quad: lane tig owns combination c = tig % kCombos of
      // (row c / kNG, group c % kNG) — at d <= 128 lanes 0, 2 own row g and lanes 1, 3 row g+8
      // and split its three thresholds; at d 256 each lane owns one (row, group). ----
      uint32_t my_lo_raw = 0, my_hi_raw = 0, my_lo = 0, my_hi = 0;
#pragma unroll
      for (int grp = 0; grp < kNG; ++grp) {
        constexpr int kQPerGroup = 4 / kNG;
        uint32_t lo, hi;
        if constexpr (kNat) {
          // per row over its registers of the group, then {gr, gr+8} from the two halves
          constexpr int kP = kQPerGroup * kSpan / 2;
          uint32_t la = x[grp * kP], ha = la, lb = x[kRegs / 2 + grp * kP], hb = lb;
#pragma unroll
          for (int p = grp * kP + 1; p < (grp + 1) * kP; ++p) {
            la = MinNanBf16x2(la, x[p]);
            ha = MaxNanBf16x2(ha, x[p]);
            lb = MinNanBf16x2(lb, x[kRegs / 2 + p]);
            hb = MaxNanBf16x2(hb, x[kRegs / 2 + p]);
          }
          lo = MinNanBf16x2(Prmt(la, lb, 0x5410), Prmt(la, lb, 0x7632));
          hi = MaxNanBf16x2(Prmt(ha, hb, 0x5410), Prmt(ha, hb, 0x7632));
        } else {
          lo = x[grp * kQPerGroup * kSpan], hi = lo;
#pragma unroll
          for (int j = grp * kQPerGroup * kSpan + 1; j < (grp + 1) * kQPerGroup * kSpan; ++j) {
            lo = MinNanBf16x2(lo, x[j]);
            hi = MaxNanBf16x2(hi, x[j]);
          }
        }
        lo = MinNanBf16x2(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
        hi = MaxNanBf16x2(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
        lo = MinNanBf16x2(lo, __shfl_xor_sync(0xffffffffu, lo, 2));
        hi = MaxNanBf16x2(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
        const uint32_t lo_raw = lo, hi_raw = hi;
        if (need > 0) {  // clamp is monotone; min x <= τ and max x >= -τ (τ >= some |x|)
          lo = MaxBf16x2(lo, tau | 0x80008000u);
          hi = MinBf16x2(hi, tau);
        }
        if (kNG == 1 || grp == my_grp) {
          my_lo_raw = lo_raw, my_hi_raw = hi_raw, my_lo = lo, my_hi = hi;
        }
      }
      // This lane's (row, group): the half my_r of the packed values.
      auto half_of = [&](uint32_t w) {
        return my_r ? __uint_as_float(w & 0xffff0000u) : __uint_as_float(w << 16);
      };
      // Non-finite input (FORMAT.md §2.5): NaN propagates into both raw extremes (the clamp
      // would drop it), ±inf reaches one of them.
      bool my_bad = !(isfinite(half_of(my_lo_raw)) && isfinite(half_of(my_hi_raw)));
      // Rows past the last token are never stored; as not refused they stay out of the count
      // below (in kWs, a tile past the end holds whatever its stage held).
      const bool my_valid = tile * kTileRows + gr + 8 * my_r < a.num_tokens;
      const float l = half_of(my_lo) + 0.f;  // -0 -> +0
      const float u = half_of(my_hi) + 0.f;
      const __half mn16 = __float2half_rd(l);
      const float mn = __half2float(mn16);
      __half s16 = __ushort_as_half(0);
      if (!(u <= 65504.f) || !isfinite(mn)) my_bad = true;
      if (u != l) {
        s16 = __float2half_ru(__fdiv_rn(__fsub_rn(u, mn), 3.f));
        if (!isfinite(__half2float(s16))) my_bad = true;
      }
      const float sc = __half2float(s16);
      const uint32_t my_par =
          uint32_t(__half_as_ushort(s16)) | (uint32_t(__half_as_ushort(mn16)) << 16);
      // Row flags of the quad's two rows: lanes 0..kCombos-1 hold every combination once.
      const uint32_t ball = __ballot_sync(0xffffffffu, my_bad && my_valid);
      const uint32_t badq = ball >> (lane & ~3);
      bool bad[2];
      bad[0] = (badq & (kCombos == 2 ? 1u : 3u)) != 0;
      bad[1] = (badq & (kCombos == 2 ? 2u : 12u)) != 0;
      // Code thresholds of this lane's combination: levels {tig/2, 2} when two lanes share a
      // combination (the second lane's level 2 is a duplicate), else all three.
      constexpr int kRounds = kCombos == 2 ? 2 : 3;
      uint32_t mine[kRounds];
#pragma unroll
      for (int s = 0; s < kRounds; ++s) {
        const int j = kCombos == 2 ? (s == 0 ? (tig >> 1) : 2) : s;
        uint32_t th = my_bad ? 0x7f80u : CodeThresholdBf16(mn, sc, j);
        // Raw x instead of clamp(x, l, u) (l, u: the clipped group min/max): a threshold
        // <= l is passed by every clipped value (so -inf: by every x), one > u by none (+inf);
        // for l < th <= u, an x < l fails like l and an x > u passes like u.
        const float thf = __uint_as_float(th << 16);
        if (l >= thf) th = 0xff80u;
        if (u < thf) th = 0x7f80u;
        mine[s] = th;
      }
      // ---- step 5: codes (2 bits b1 b0 per value; quarter q in bits 2q, 2q+1 of the byte).
      // Per column i the byte of each half is Σ_q (b0 + 2·b1)·4^q, summed on the FMA pipe
      // (v6; before: 7 bitwise selects per column on the saturated ALU pipe): with the masks m
      // (0xffff per true half) as integers, S = Σ w·m mod 2^32 = 2^16·(L − H) − L for the
      // weighted sums L (low half) and H (high half) of the true bits, so S·(−65537) =
      // L + 2^16·H mod 2^32 (L, H <= 255): the low byte of each half is that half's code byte.
      uint32_t row0[kSpan / 4], row1[kSpan / 4];
      if constexpr (kNat) {
        // Same-row layout: per row r, its thresholds in both halves ({t, t}, one IMAD each), the
        // code bytes of columns 2k (low half) and 2k + 1 (high half) summed as above, and
        // 4 bytes per PRMT.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          uint32_t thr[kNG][3];
#pragma unroll
          for (int grp = 0; grp < kNG; ++grp)
#pragma unroll
            for (int j = 0; j < 3; ++j) {
              const int c = r * kNG + grp;
              const int src = kCombos == 2 ? (j == 1 ? 2 : 0) + c : c;
              const int round = kCombos == 2 ? (j == 2 ? 1 : 0) : j;
              thr[grp][j] = MadLo(__shfl_sync(0xffffffffu, mine[round], (lane & ~3) | src),
                                  kCodeWeights[9], 0u);
            }
          uint32_t accb[kSpan / 2];
#pragma unroll
          for (int k = 0; k < kSpan / 2; ++k) {
            uint32_t sum = 0;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const int grp = q / (4 / kNG);
              const uint32_t v = x[r * (kRegs / 2) + q * (kSpan / 2) + k];
              const uint32_t m2 = GeMaskBf16x2(v, thr[grp][1]);
              const uint32_t m0 = GeMaskBf16x2(v, SelBits(m2, thr[grp][2], thr[grp][0]));
              sum = MadLo(m2, kCodeWeights[2 * q + 1], sum);
              sum = MadLo(m0, kCodeWeights[2 * q], sum);
            }
            accb[k] = MadLo(sum, kCodeWeights[8], 0u);
          }
          const uint32_t keep = bad[r] ? 0u : 0xffffffffu;
#pragma unroll
          for (int w = 0; w < kSpan / 4; ++w) {
            const uint32_t word = Prmt(accb[2 * w], accb[2 * w + 1], 0x6420) & keep;
            if (r)
              row1[w] = word;
            else
              row0[w] = word;
          }
        }
      } else {
        uint32_t thr[kNG][3];  // packed {row g, row g+8} bf16 thresholds
#pragma unroll
        for (int grp = 0; grp < kNG; ++grp)
#pragma unroll
          for (int j = 0; j < 3; ++j) {
            uint32_t v[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int c = r * kNG + grp;
              const int src = kCombos == 2 ? (j == 1 ? 2 : 0) + c : c;
              const int round = kCombos == 2 ? (j == 2 ? 1 : 0) : j;
              v[r] = __shfl_sync(0xffffffffu, mine[round], (lane & ~3) | src);
            }
            thr[grp][j] = v[0] | (v[1] << 16);
          }

        uint32_t accb[kSpan];
#pragma unroll
        for (int i = 0; i < kSpan; ++i) {
          uint32_t sum = 0;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int grp = q / (4 / kNG);
            const uint32_t v = x[q * kSpan + i];
            // b1 = [x >= t2]; b0 = [x >= t3] when b1, else [x >= t1] (t1 <= t2 <= t3).
            const uint32_t m2 = GeMaskBf16x2(v, thr[grp][1]);
            const uint32_t m0 = GeMaskBf16x2(v, SelBits(m2, thr[grp][2], thr[grp][0]));
            sum = MadLo(m2, kCodeWeights[2 * q + 1], sum);
            sum = MadLo(m0, kCodeWeights[2 * q], sum);
          }
          accb[i] = MadLo(sum, kCodeWeights[8], 0u);
        }
        const uint32_t keep0 = bad[0] ? 0u : 0xffffffffu, keep1 = bad[1] ? 0u : 0xffffffffu;
#pragma unroll
        for (int w = 0; w < kSpan / 4; ++w) {
          const uint32_t t01 = Prmt(accb[4 * w], accb[4 * w + 1], 0x6240);
          const uint32_t t23 = Prmt(accb[4 * w + 2], accb[4 * w + 3], 0x6240);
          row0[w] = Prmt(t01, t23, 0x5410) & keep0;
          row1[w] = Prmt(t01, t23, 0x7632) & keep1;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int t = tile * kTileRows + gr + 8 * r;
        if (t >= a.num_tokens) continue;
        uint8_t* codes = rb[r] + (kv ? P * (D / 4) : 0);
        uint32_t rw[kSpan / 4];
#pragma unroll
        for (int w = 0; w < kSpan / 4; ++w) rw[w] = r ? row1[w] : row0[w];
        if constexpr (kSpan == 4) {
          *reinterpret_cast<uint32_t*>(codes) = rw[0];
        } else if constexpr (kSpan == 8) {
          *reinterpret_cast<uint2*>(codes) = make_uint2(rw[0], rw[1]);
        } else {
          *reinterpret_cast<uint4*>(codes) = make_uint4(rw[0], rw[1], rw[2], rw[3]);
        }
      }
      // params of this lane's combination, the flag of its row (lanes with my_grp == 0), and
      // the warp's refused rows counted with one atomic (rows: lanes tig < kCombos of each
      // quad; a row is refused when any of its groups is).
      if (owns_params && my_valid) {
        const bool my_row_bad = my_r ? bad[1] : bad[0];
        *reinterpret_cast<uint32_t*>(pp + (kv ? P * 4 * kNG : 0)) = my_row_bad ? 0u : my_par;
        if (my_grp == 0 && a.row_flags != nullptr)
          a.row_flags[fl + uint32_t(kv)] = my_row_bad ? 1 : 0;
      }
      if (ball != 0 && a.bad_rows != nullptr) {  // warp-uniform, rare
        const uint32_t rows = kNG == 1 ? ball & 0x33333333u : (ball | (ball >> 1)) & 0x55555555u;
        if (lane == 0) atomicAdd(a.bad_rows, uint32_t(__popc(rows)));
      }
    }
    __syncwarp();  // this stage (and its parked values) is refilled by the next prefetch
    if constexpr (kOutBf16) {
      pg[0] = npg[0], pg[1] = npg[1], sl[0] = nsl[0], sl[1] = nsl[1];
    } else if (!reuse) {
      make_rb(nxt.h, nxt.tile, npg, nsl);
    }
    stage ^= 1;
    cur = nxt;
    nxt = nxt2;
    if (dyn) left = has_nxt ? 2 : 1;  // (the loop's decrement follows)
  }
  CpAsyncWait<0>();
}

KernelStatus WLaunchError(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return KernelStatus::Ok();
  return KernelStatus::Error(KernelError::kLaunchFailed,
                             std::string(what) + ": " + cudaGetErrorString(e));
}

// TMA loads for quantize-only and demotion unless KVPOOL_WRITE_TMA=0 (then cp.async into the
// same layout; for A/B measurements), read once per process.
bool TmaEnabled() {
  static const bool on = [] {
    const char* e = std::getenv("KVPOOL_WRITE_TMA");
    return e == nullptr || std::string(e) != "0";
  }();
  return on;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no libcuda link), once.
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    cudaGetLastError();
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// The source maps of a quantize-only write or a demotion (see TmaMaps); host-side encoding
// only, no device work. False when the driver has no encoder or refuses a map.
bool EncodeSourceMaps(int d, const WriteArgs& a, TmaMaps* maps) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const cuuint32_t elem[3] = {1, 1, 1};
  auto one = [&](CUtensorMap* map, const void* base, const cuuint64_t(&dims)[3],
                 const cuuint64_t(&strides)[2], const cuuint32_t(&box)[3]) {
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides,
                  box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  if (a.src_pages != nullptr) {
    // Pages: ids are int32 and the launcher does not know the pool's size, so the page extent
    // is the largest id count whose byte span stays below 2^47 (the kernel only addresses the
    // caller's pages; no bounds check is needed from the TMA unit).
    const uint64_t lines = uint64_t(a.num_kv_heads) * 2 * a.page_size * d / 64;
    const uint64_t pages = std::min<uint64_t>(INT32_MAX, (1ull << 47) / a.src_stride);
    const cuuint64_t dims[3] = {64, lines, pages};
    const cuuint64_t strides[2] = {128, a.src_stride};
    const cuuint32_t box[3] = {64, cuuint32_t(kTileRows * d / 64), 1};
    return one(&maps->k, a.src_base, dims, strides, box);
  }
  const cuuint64_t dims[3] = {64, cuuint64_t(a.num_kv_heads) * (d / 64), cuuint64_t(a.num_tokens)};
  const cuuint64_t strides[2] = {128, cuuint64_t(a.token_stride) * 2};
  const cuuint32_t box[3] = {64, cuuint32_t(d / 64), kTileRows};
  return one(&maps->k, a.src_k, dims, strides, box) && one(&maps->v, a.src_v, dims, strides, box);
}

// The warp-specialized rotating kernels at d 128 unless KVPOOL_WRITE_ROT_WS=0 (then the
// mma.sync kernels; for A/B measurements and the test that compares the two), read at each
// launch.
bool WsEnabled() {
  const char* e = std::getenv("KVPOOL_WRITE_ROT_WS");
  return e == nullptr || std::string(e) != "0";
}

// WriteArgs::first_wait unless KVPOOL_WRITE_FIRST_WAIT=0 (for A/B measurements), read at each
// launch.
bool FirstWaitEnabled() {
  const char* e = std::getenv("KVPOOL_WRITE_FIRST_WAIT");
  return e == nullptr || std::string(e) != "0";
}

// Dynamic items per warp of the quantize-only token writes (WriteArgs::dyn): from
// KVPOOL_WRITE_DYN_ITEMS (read at each launch; a negative value turns the dynamic tail off,
// for A/B measurements), else KVPOOL_WRITE_DYN_DEFAULT.
// Off by default (-1): measured on the H200 (session 11, same call, 4 rounds) it gained nothing
// at 256K / 1M token-heads with 4- or 24-warp CTAs (24 warps: 52.7 / 174.2 µs with 1 dynamic
// item per warp vs 52.6 / 173.9 off) and lost at 64K (21.8 vs 20.5: most items claimed, each
// claim without the K -> V destination reuse); see docs/KERNELS.md "Session 11".
#ifndef KVPOOL_WRITE_DYN_DEFAULT
#define KVPOOL_WRITE_DYN_DEFAULT -1
#endif
int DynItemsPerWarp() {
  const char* e = std::getenv("KVPOOL_WRITE_DYN_ITEMS");
  return e == nullptr || *e == 0 ? KVPOOL_WRITE_DYN_DEFAULT : std::atoi(e);
}

// KVPOOL_WRITE_MAX_CTAS (read at each launch): caps the grid of the non-rotating kernels, so
// that tests can give each warp many items of a small write (0 or unset: no cap).
int64_t MaxCtas() {
  const char* e = std::getenv("KVPOOL_WRITE_MAX_CTAS");
  const long long v = e == nullptr ? 0 : std::atoll(e);
  return v > 0 ? int64_t(v) : int64_t(1) << 30;
}

// WriteArgs::split_*: `items` work items over `workers` (1 <= workers < 2^16) contiguous ranges,
// item pairs split by `den`. False when a worker's range would not fit the kernel's 32-bit
// item count (2^31 items per worker: far more tokens x heads than a GPU's memory holds, but
// checked rather than assumed).
bool SetSplit(int64_t items, int64_t workers, uint32_t den, WriteArgs* a) {
  if (items / workers >= int64_t(INT32_MAX)) return false;
  a->split_q = items / workers;
  a->split_r = uint32_t(items % workers);
  a->split_w = uint32_t(workers);
  a->split_den = den;
  a->div32 = (items >> 1) <= int64_t(UINT32_MAX) ? 1 : 0;
  return true;
}

// kWs launch (d 128, rotation set, TMA maps encoded): one CTA per SM (its shared memory), grid y
// = the heads when the rotation is per head (each CTA holds one head's Rᵀ), else 1; at most as
// many CTAs as give every consumer warpgroup an item.
template <bool kOutBf16>
KernelStatus LaunchWriteWs(const WriteArgs& a, const TmaMaps& maps, int sms, cudaStream_t stream) {
  constexpr int D = 128;
  constexpr int smem = WriteSmemBytes<D, true, kOutBf16, true>();
  constexpr int threads = 32 * WarpsPerCta<D, true, true>();
  auto kernel = KvWriteKernel<D, true, kOutBf16, true>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return WLaunchError("cudaFuncSetAttribute(KvWriteKernel ws)");
  const int ntiles = (a.num_tokens + kTileRows - 1) / kTileRows;
  const int64_t ngroups = (ntiles + 3) / 4;
  const bool per_head = a.rot_head_stride != 0;
  const int64_t items = 2 * ngroups * (per_head ? 1 : a.num_kv_heads);
  const int64_t slots = per_head ? std::max(1, sms / a.num_kv_heads) : sms;
  const int64_t x = std::max<int64_t>(1, std::min(slots, (items + kWsGroups - 1) / kWsGroups));
  const dim3 grid(unsigned(x), per_head ? unsigned(a.num_kv_heads) : 1u, 1);
  WriteArgs args = a;
  args.use_tma = 1;
  if (!SetSplit(items, x * kWsGroups, uint32_t(ngroups), &args))
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               "num_tokens x num_kv_heads too large for one launch");
  kernel<<<grid, threads, smem, stream>>>(args, maps);
  return WLaunchError("KvWriteKernel ws");
}

// kDemote: a demotion (a.src_pages set; quantize-only kernels).
template <int D, bool kRotate, bool kOutBf16, bool kDemote = false>
KernelStatus LaunchWrite(const WriteArgs& a, cudaStream_t stream) {
  if constexpr (kRotate && D == 128) {
    TmaMaps maps{};
    if (WsEnabled() && TmaEnabled() && EncodeSourceMaps(D, a, &maps)) {
      int dev = 0, sms = 132;
      if (cudaGetDevice(&dev) != cudaSuccess ||
          cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        sms = 132;
      cudaGetLastError();
      return LaunchWriteWs<kOutBf16>(a, maps, sms, stream);
    }
  }
  constexpr int smem = WriteSmemBytes<D, kRotate, kOutBf16>();
  constexpr int threads = 32 * WarpsPerCta<D, kRotate>();
  auto kernel = KvWriteKernel<D, kRotate, kOutBf16, false, kDemote>;
  // Resident CTAs per SM, queried once per instantiation (function attributes and the SM
  // count do not change within a process for one device; a different device gets the same
  // kernel resources).
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return WLaunchError("cudaFuncSetAttribute(KvWriteKernel)");
  static const int per_sm = [&] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess)
      n = 1;
    cudaGetLastError();
    return std::max(n, 1);
  }();
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    sms = 132;
  cudaGetLastError();
  const int ntiles = (a.num_tokens + kTileRows - 1) / kTileRows;
  dim3 grid;
  if constexpr (kRotate) {
    // One (head, K|V) per CTA: the grid's y and z.
    const int ctas_for_tiles = (ntiles + threads / 32 - 1) / (threads / 32);
    const int per_pair = std::max(1, (per_sm * sms) / (2 * a.num_kv_heads));
    grid = dim3(std::min(ctas_for_tiles, per_pair), a.num_kv_heads, 2);
  } else {
    // One wave of CTAs over all items (2 per tile and head), split evenly by warp.
    const int64_t items = 2 * int64_t(a.num_kv_heads) * ntiles;
    const int64_t ctas_for_items = (items + threads / 32 - 1) / (threads / 32);
    // at most 2^14 CTAs, so that the warp count stays below 2^16 (WriteArgs::split_w)
    grid =
        dim3(unsigned(std::min<int64_t>({ctas_for_items, int64_t(per_sm) * sms, 16383, MaxCtas()})),
             1, 1);
  }
  TmaMaps maps{};
  WriteArgs args = a;
  args.use_tma = 0;
  args.first_wait = FirstWaitEnabled() ? 1 : 0;
  if constexpr (!kRotate) {
    const int64_t items = 2 * int64_t(a.num_kv_heads) * ntiles;
    constexpr int64_t kW = threads / 32;
    const int dyn_items = !kOutBf16 && !kDemote ? DynItemsPerWarp() : -1;
    if (dyn_items >= 0 && items < int64_t(INT32_MAX)) {
      // WriteArgs::dyn: ranges per CTA, each warp's static part leaving >= kW·dyn_items of the
      // smallest CTA range to the counter
      const int64_t per_warp = items / grid.x / kW;
      args.dyn = 1;
      args.dyn_static = int32_t(std::max<int64_t>(0, per_warp - dyn_items));
      SetSplit(items, grid.x, uint32_t(ntiles), &args);  // cannot fail: items < 2^31
    } else if (!SetSplit(items, int64_t(grid.x) * kW, uint32_t(ntiles), &args)) {
      return KernelStatus::Error(KernelError::kInvalidArgument,
                                 "num_tokens x num_kv_heads too large for one launch");
    }
  }
  if constexpr (UseTmaLayout<kRotate, kOutBf16>()) {
    // A map the driver refuses leaves the cp.async loads (same bytes, slower).
    if (TmaEnabled() && EncodeSourceMaps(D, a, &maps)) args.use_tma = 1;
  }
  kernel<<<grid, threads, smem, stream>>>(args, maps);
  return WLaunchError("KvWriteKernel");
}

template <bool kRotate, bool kOutBf16>
KernelStatus DispatchWrite(int d, const WriteArgs& a, cudaStream_t stream) {
  if constexpr (!kRotate && !kOutBf16) {
    if (a.src_pages != nullptr) {
      if (d == 64) return LaunchWrite<64, false, false, true>(a, stream);
      if (d == 128) return LaunchWrite<128, false, false, true>(a, stream);
      return LaunchWrite<256, false, false, true>(a, stream);
    }
  }
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
