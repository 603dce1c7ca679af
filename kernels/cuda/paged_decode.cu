// paged_decode.cu — mixed-precision paged decode attention (see paged_decode.h, docs/KERNELS.md).
//
// Four kernels per call, chained with programmatic dependent launch (PDL):
//   1. QRotateKernel  q̃ = q·R_K · sm_scale·log2(e), fp32, into the workspace.
//   2. Bf16DecodeKernel<D, NT>  sink + recent segments (BF16 pages): one CTA = (split of one
//      segment, KV head [, head chunk], request), 4 warps, cp.async rings, bf16 mma.sync; a
//      one-split sink is folded into the first recent split (v8, FoldSink).
//   3. Int2DecodeKernel<D, KT, N>  history segment (INT2 pages; N resident CTAs per SM: 5 at
//      d <= 128 with one n-tile, or 4 in the v31 wide form MakePlan picks for large grids at d
//      128): TMA bulk copies into per-warp mbarrier rings, q·k on integer tensor cores (u8 codes ×
//      s8 hi/lo halves of a 16-bit q̃), p·v on fp16 tensor cores with the masked codes read as fp16
//      subnormals, the per-token (scale, min) applied as s = scale·(q̃·c) + min·Σq̃ and P' = p·scale
//      plus a per-head Σ p·min term (FORMAT.md §2.8). The head_dim permutation implied by the
//      packed byte order is absorbed into the q̃ fragments (any permutation of the reduction index
//      leaves a dot product unchanged) and into the output index map. The splits of a row (request,
//      KV head) interleave by ring stage; when the grid is one wave, the last quarter of each row's
//      stages is claimed at run time from a per-row counter in the workspace (zeroed by
//      QRotateKernel) and the grid is ordered split-major (v18, MakePlan).
//   Each decode CTA writes one partial (output normalized by its own sum, log2-sum-exp) per
//   (request, q head, split).
//   4. MergeKernel  LSE-merges the partials of every split and segment (empty ones carry
//      lse = -inf and contribute nothing) and applies R_Vᵀ.
// Kernel 3 is launched before kernel 2 (v6 default; KVPOOL_DECODE_ORDER=bf16 restores the v4
// order, docs/KERNELS.md v5/v6 notes): the decode kernel launched second reads q̃ without waiting
// and waits for the first one at its end.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "device_utils.cuh"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/cuda/paged_decode.h"

namespace kvpool::cuda {
namespace detail {
namespace {

constexpr int kWarps = 4;
// Claim counters of the INT2 kernel sit 128 bytes apart, so the rows' atomics spread over L2
// slices (in one 128-byte line they serialized: +35 % launch time at B = 8 × 128K, s6 notes).
constexpr int kClaimStride = 32;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct SegArgs {
  const int32_t* indptr;
  const int32_t* indices;
  const int32_t* last_len;
  const uint8_t* base;
  uint64_t page_stride;
  int32_t num_splits;
  int32_t pages_per_split;
  int32_t split_offset;  // index of this segment's first split among the request's partials
};

struct AttnArgs {
  int32_t num_q_heads;
  int32_t group;
  int32_t head_chunks;
  int32_t page_size;
  int32_t s_total;
  const float* q_rot;  // [B][Hq][D]
  float* part_o;       // [B][Hq][S][D]
  float* part_lse;     // [B][Hq][S], log2 units
  SegArgs seg0;
  SegArgs seg1;  // BF16 kernel only: the recent segment (seg0 = sink)
  // Wait for the previous kernel (QRotateKernel) before reading q̃. False when the kernel runs
  // behind the other decode kernel, whose CTAs only let it start once q̃ was complete; it then
  // waits for that kernel at its very end instead, so the merge kernel's wait covers both.
  int32_t pdl_wait_first;
  // BF16 kernel only: the sink (seg0, one split) is folded into the first split of the recent
  // segment (seg1): grid.x = seg1's splits, and CTA 0 streams the sink's units before its recent
  // units into the same softmax state and partial (v8; no sink CTAs, one partial fewer per row).
  int32_t fold_sink;
  // INT2 kernel only (v18): one claim counter per history row (request, KV head, head chunk),
  // kClaimStride ints apart, zeroed by QRotateKernel; dyn_claims = percent of a row's stages
  // assigned statically before the rest is claimed (0: every stage static). split_major:
  // grid (KV heads × chunks, batch, splits) instead of (splits, KV heads × chunks, batch), so the
  // first wave holds the first splits of every row.
  int* row_claims;
  int32_t dyn_claims;
  int32_t split_major;
  // INT2 kernel only (v19, "two items"): when > 0 the grid is 1-D, items_rows × splits CTAs,
  // and CTA c runs two (row, split) items one after the other: first (c / S, c % S) of rows
  // [0, items_rows) with static stages (row-major), then an item of rows [items_rows,
  // 2·items_rows) with dyn_claims, handed out in the order the CTAs finish their first (v20; v19:
  // (items_rows + c % items_rows, c / items_rows)), so a two-wave grid runs as one resident wave
  // whose second items balance a row's splits like v18's one-wave grids. 0: one item per CTA.
  int32_t items_rows;
  // With items_rows > 0: the ticket counter of the second items (zeroed by QRotateKernel, v20).
  int* item_counter;
  // BF16 kernel only (v28): lane l of a warp loads the page id of the warp's step w + l once per
  // 32-step window (the first one right after the index and q̃ loads, before the q̃ packing) and
  // each unit's copy takes its id by a shuffle; 0: every copy loads its page id first (v7-v24).
  int32_t pid_window;
  // INT2 kernel only (v30): ring stages of the first item issued before the wait for q̃ (2: both,
  // v9-v29; 1: stage 1 right after the wait, so that half as many copies queue in front of the
  // rotation's R_K and q loads while q̃ is on the critical path; launcher rule, Int2PreStages).
  int32_t pre_stages;
};

__device__ __forceinline__ void ImmaU8S8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "KVPOOL_WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra KVPOOL_WAIT_%=;\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}
// Bulk global -> shared copy of `bytes` (multiple of 16, both addresses 16-byte aligned),
// completing on `bar` (TMA, no tensor map), issued once by one elected lane of a converged warp
// (v27; every lane passes the same operands): with warp-uniform operands the compiler emits a
// single UBLKCP, where a per-thread cp.async.bulk costs a loop over the issuing lanes (ELECT,
// three R2UR, two PLOP3, UBLKCP and a branch per lane).
__device__ __forceinline__ void BulkCopyElect(void* dst, const void* src, uint32_t bytes,
                                              uint64_t* bar) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "elect.sync _|p, 0xffffffff;\n"
      "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      "}\n" ::"r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}

// Global load of a read-only int, issued where it is written (asm volatile: the compiler keeps it
// in program order with the other asm statements and does not sink it into the branch that
// uses it); 0 when !pred (p is not read). v28, Bf16DecodeKernel's prologue.
__device__ __forceinline__ int LdgEarly(const int32_t* p, bool pred) {
  int v;
  asm volatile(
      "{\n"
      ".reg .pred q;\n"
      "setp.ne.b32 q, %2, 0;\n"
      "mov.b32 %0, 0;\n"
      "@q ld.global.nc.b32 %0, [%1];\n"
      "}\n"
      : "=r"(v)
      : "l"(p), "r"(int(pred)));
  return v;
}

// Programmatic dependent launch (PDL, sm_90): let the next kernel of the stream be scheduled,
// and wait for the previous one (a no-op when the kernel was launched without the attribute).
__device__ __forceinline__ void PdlLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void PdlWait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
// The CTA of the highest linear index in the grid.
__device__ __forceinline__ bool IsLastCta() {
  return blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1;
}

// Timeline instrumentation (only in builds compiled with -DKVPOOL_DECODE_TIMELINE, for the
// device profile; the shipped kernels contain none of it): thread 0 of every CTA stamps
// %globaltimer at entry (field 0), after its PDL wait (1) and at its end (2), plus its SM id (3),
// into g_tl[kernel][cta][kTlFields] (kernel 0 QRotate, 1 INT2, 2 BF16, 3 merge); field 4 is one
// more stamp (INT2: the end of the first item; merge: before the R_V product) and field 5 a value
// (INT2: the second item's row). The last launch's stamps are written out by
// KvpoolDecodeTimelineDump (host side, below).
#ifdef KVPOOL_DECODE_TIMELINE
constexpr int kTlMaxCtas = 16384;
constexpr int kTlFields = 6;
__device__ unsigned long long* g_tl = nullptr;
__device__ __forceinline__ void TlValue(int kernel, int field, unsigned long long v) {
  if (threadIdx.x != 0 || g_tl == nullptr) return;
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta < unsigned(kTlMaxCtas)) g_tl[(size_t(kernel) * kTlMaxCtas + cta) * kTlFields + field] = v;
}
__device__ __forceinline__ void TlMark(int kernel, int field) {
  if (threadIdx.x != 0 || g_tl == nullptr) return;
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta >= unsigned(kTlMaxCtas)) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  unsigned long long* r = g_tl + (size_t(kernel) * kTlMaxCtas + cta) * kTlFields;
  r[field] = t;
  if (field == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    r[3] = sm;
  }
}
#define KVPOOL_TL(kernel, field) TlMark(kernel, field)
#define KVPOOL_TL_VALUE(kernel, field, v) TlValue(kernel, field, v)
#else
#define KVPOOL_TL(kernel, field) ((void)0)
#define KVPOOL_TL_VALUE(kernel, field, v) ((void)0)
#endif

// ---------------------------------------------------------------------------------------------
// BF16 kernel (sink and recent segments; also the BF16 baseline). One CTA = (split of the sink or
// recent segment, KV head, head chunk, request), 4 warps (with fold_sink, the first recent split
// streams the sink's pages before its own and there are no sink CTAs); each warp streams 16-token
// units of its pages through a private cp.async ring (swizzled rows, ldmatrix), computes
// S = K·q̃ᵀ (tokens = M, heads = N, head_dim = K) and Oᵀ += Vᵀ·P (head_dim = M, heads = N,
// tokens = K) with mma.sync m16n8k16, and keeps an online softmax; the warps' states are combined
// in shared memory into one partial per (request, q head, split).
template <int D>
struct Bf16Cfg {
  static constexpr int kTile = 64 * D;  // 16 tokens, K + V bf16
  // Ring stages per warp. d 128: 2 (64 KB per CTA, 3 CTAs/SM) so that a sink/recent CTA fits
  // beside 4 INT2 CTAs (4 × 39 KB + 66 KB ≤ 228 KB) and runs during the INT2 grid on SMs that
  // hold fewer than 5 of its CTAs instead of after it (v7; 3 stages = 96 KB did not fit).
  static constexpr int kStages = (D == 64) ? 3 : 2;
  __host__ __device__ static constexpr uint64_t ChunkBytes(int page_size) {
    return 4ull * page_size * D;
  }
};

template <int D, int NT>
constexpr int Bf16SmemBytes() {
  using C = Bf16Cfg<D>;
  constexpr int ring = kWarps * C::kStages * C::kTile;
  constexpr int combine = kWarps * 8 * NT * (D + 2) * 4;
  return ring > combine ? ring : combine;
}

// d 128 / one n-tile: at most 128 registers, so a sink/recent CTA fits beside 4 INT2 CTAs
// (4 × 128 × 96 + 128 × 128 ≤ 65536 registers; the v8 sink fold took it from 127 to 131).
template <int D, int NT>
__global__ void __launch_bounds__(kThreads, (D == 128 && NT == 1) ? 4 : 1)
    Bf16DecodeKernel(const AttnArgs a) {
  using C = Bf16Cfg<D>;
  constexpr int kN = 8 * NT;
  constexpr int kSteps = D / 16;  // k-steps of q·kᵀ, and m-tiles of Vᵀ·P
  constexpr int kMt = D / 16;
  constexpr int kSub = 1;  // 16-token units per warp step
  extern __shared__ __align__(128) uint8_t smem[];
  KVPOOL_TL(2, 0);

  // Warp index through a shuffle from lane 0, so the compiler treats it as warp-uniform.
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;

  int sx = blockIdx.x;
  const bool second = a.fold_sink || sx >= a.seg0.num_splits;  // recent (seg1) after sink (seg0)
  if (second && !a.fold_sink) sx -= a.seg0.num_splits;
  const SegArgs seg = second ? a.seg1 : a.seg0;
  const int b = blockIdx.z;
  const int kvh = blockIdx.y / a.head_chunks;
  const int chunk = blockIdx.y % a.head_chunks;
  const int h_first = kvh * a.group + chunk * kN;  // first q head of this CTA
  const int nh = min(kN, a.group - chunk * kN);    // real heads (rest is padding)
  const int page_size = a.page_size;
  const int tpp_log2 = page_size == 64 ? 2 : 0;  // 16-token units per page: 1 or 4

  // Prologue order (v28): every index load of the CTA is issued first, back to back (LdgEarly:
  // the compiler neither sinks a load into the branch that uses it nor holds it behind the loads
  // before it), then the q̃ loads, then the index arithmetic, the page-id window and the q̃
  // packing, so the first copy waits for three latencies (indices with q̃, page ids, data). v24
  // chained recent indptr -> last_page_len -> sink indptr -> sink last_page_len -> q̃ -> page id
  // -> data, seven (SASS of Bf16DecodeKernel<128, 1>). A used segment has all `batch`
  // last-page lengths (Validate), so they are loaded whether or not the request's segment is
  // empty.
  const bool has_seg = seg.indptr != nullptr;
  const bool fold = a.fold_sink && sx == 0 && a.seg0.indptr != nullptr;
  const int r_beg = LdgEarly(has_seg ? seg.indptr + b : nullptr, has_seg);
  const int r_end = LdgEarly(has_seg ? seg.indptr + b + 1 : nullptr, has_seg);
  const int r_ll = LdgEarly(has_seg ? seg.last_len + b : nullptr, has_seg);
  const int s_beg = LdgEarly(fold ? a.seg0.indptr + b : nullptr, fold);
  const int s_end = LdgEarly(fold ? a.seg0.indptr + b + 1 : nullptr, fold);
  const int s_ll = LdgEarly(fold ? a.seg0.last_len + b : nullptr, fold);

  if (a.pdl_wait_first) PdlWait();  // q̃ of QRotateKernel
  PdlLaunchDependents();
  KVPOOL_TL(2, 1);
  // ---- q̃ loads (packed into the MMA fragments below, once the indices are in) ----
  float qraw[kSteps][NT][2][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int hl = 8 * nt + g;
    const float* qh = a.q_rot + (size_t(b) * a.num_q_heads + h_first + hl) * D;
    const bool real = hl < nh;
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          qraw[s][nt][half][e] = real ? qh[16 * s + 8 * half + 2 * tig + e] : 0.f;
  }

  int pbeg = 0, npg = 0, last_len = 0;
  if (has_seg) {
    pbeg = r_beg;
    npg = r_end - r_beg;
    if (npg > 0) last_len = min(max(r_ll, 0), page_size);
  }
  const int p0 = sx * seg.pages_per_split;
  const int p1 = min(npg, p0 + seg.pages_per_split);
  bool overflow = (sx == seg.num_splits - 1) && npg > p1;
  // Folded sink (fold_sink, CTA 0 only): the sink's s_pages pages come first, then this split's
  // recent pages; lp = u >> tpp_log2 is a unit's page among them (the sink and recent segments
  // share the BF16 pool, so one base and page stride serve both). lp_s / lp_r: the local index
  // of the sink's / the request's last recent page (partial pages), -1 / out of range if absent.
  int s_pages = 0, lp_s = -1, s_last = 0;
  const int32_t* s_ids = nullptr;
  if (fold) {
    const int s_npg = max(s_end - s_beg, 0);
    if (s_npg > 0) s_last = min(max(s_ll, 0), page_size);
    s_pages = min(s_npg, a.seg0.pages_per_split);
    overflow |= s_npg > s_pages;
    lp_s = s_npg - 1;
    s_ids = a.seg0.indices + s_beg;
  }
  const int n0 = s_pages << tpp_log2;
  const int lp_r = s_pages + npg - 1 - p0;
  const int nunits = n0 + (max(0, p1 - p0) << tpp_log2);
  const int first_unit = kSub * warp;
  const int my_steps =
      nunits > first_unit ? (nunits - first_unit + kSub * kWarps - 1) / (kSub * kWarps) : 0;
  const uint64_t chunk_bytes = C::ChunkBytes(page_size);
  // Recent page of local page index lp >= s_pages: page_ids[lp].
  const int32_t* page_ids = seg.indices + pbeg + p0 - s_pages;
  const uint8_t* head_base = seg.base + uint64_t(kvh) * chunk_bytes;
  // Page-id window (pid_window, v28): lane l holds the page id of this warp's step w0 + l, loaded
  // before the q̃ packing; each copy takes its id by a shuffle (v24: every copy loaded its page
  // id first, the first one a full latency after the q̃ loads).
  static_assert(kSub == 1, "the page-id window holds one unit per step");
  auto load_pids = [&](int w0) -> int32_t {
    const int t = w0 + lane;
    const int u = first_unit + t * kWarps;
    return (t < my_steps && u < nunits) ? (u < n0 ? s_ids : page_ids)[u >> tpp_log2] : 0;
  };
  int32_t pid_win = a.pid_window ? load_pids(0) : 0;

  // ---- q fragments (B operand of S = K·q̃ᵀ) ----
  uint32_t qb[kSteps][NT][2];
  // q̃ = hi + lo, both bf16 (two MMAs), so q̃ keeps ~16 significant bits.
  uint32_t qlo[kSteps][NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float* v = qraw[s][nt][half];
        qb[s][nt][half] = PackBf162(v[0], v[1]);
        const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&qb[s][nt][half]);
        qlo[s][nt][half] = PackBf162(v[0] - __low2float(hi), v[1] - __high2float(hi));
      }

  // ---- per-warp cp.async ring; a stage holds kSub 16-token units ----
  uint8_t* ring = smem + warp * C::kStages * C::kTile * kSub;
  auto unit_valid = [&](int u) -> int {  // valid tokens of split-local unit u
    if (u >= nunits) return 0;
    const int lp = u >> tpp_log2;
    const int sub = u & ((1 << tpp_log2) - 1);
    const int n = lp == lp_s ? s_last - 16 * sub : (lp == lp_r ? last_len - 16 * sub : 16);
    return min(max(n, 0), 16);
  };
  auto issue = [&](int t) {
    if (t < my_steps) {
      uint8_t* stage = ring + (t % C::kStages) * C::kTile * kSub;
      // Steps are issued in order, so a new window starts exactly at t % 32 == 0.
      if (a.pid_window && t > 0 && (t & 31) == 0) pid_win = load_pids(t);
      const int32_t pid_shfl = __shfl_sync(0xffffffffu, pid_win, t & 31);
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const int u = first_unit + t * kSub * kWarps + j;
        if (u < nunits) {
          const int sub = u & ((1 << tpp_log2) - 1);
          const int32_t pid = a.pid_window ? pid_shfl : (u < n0 ? s_ids : page_ids)[u >> tpp_log2];
          const uint8_t* src = head_base + uint64_t(pid) * seg.page_stride;
          uint8_t* dst = stage + j * C::kTile;
          const int valid = unit_valid(u);
          constexpr int kRowPieces = D / 8;  // 16-byte pieces per bf16 row
          const uint64_t v_part = 2ull * page_size * D;
          const uint8_t* ks = src + uint64_t(sub) * 16 * 2 * D;
#pragma unroll 4
          for (int p = lane; p < 32 * kRowPieces; p += 32) {
            const int kv = p / (16 * kRowPieces);
            const int rp = p % (16 * kRowPieces);
            const int row = rp / kRowPieces, c = rp % kRowPieces;
            uint8_t* d = dst + kv * 32 * D + row * 2 * D + 16 * (c ^ (row & 7));
            CpAsync16(d, ks + kv * v_part + row * 2 * D + 16 * c, row < valid);
          }
        }
      }
    }
    CpAsyncCommit();
  };

  float acc[kMt][NT][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.f;
  float m_run[NT][2], l_run[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      m_run[nt][e] = -INFINITY;
      l_run[nt][e] = 0.f;
    }

#pragma unroll
  for (int t = 0; t < C::kStages - 1; ++t) issue(t);

  for (int t = 0; t < my_steps; ++t) {
    issue(t + C::kStages - 1);
    CpAsyncWait<C::kStages - 1>();
    __syncwarp();
    const uint8_t* stage = ring + (t % C::kStages) * C::kTile * kSub;
    bool vrow[kSub][2];
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int valid = unit_valid(first_unit + t * kSub * kWarps + j);
      vrow[j][0] = g < valid;
      vrow[j][1] = g + 8 < valid;
    }

    // ---- S = K·q̃ᵀ for each unit ----
    float logit[kSub][NT][4];
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const uint8_t* st = stage + j * C::kTile;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) logit[j][nt][i] = 0.f;
      const int q4 = lane >> 3, r8 = lane & 7;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int row = r8 + 8 * (q4 & 1);
        const int c = 2 * s + (q4 >> 1);
        uint32_t af[4];
        LdMatrixX4(af, st + row * 2 * D + 16 * (c ^ (row & 7)));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          MmaBf16(logit[j][nt], af[0], af[1], af[2], af[3], qb[s][nt][0], qb[s][nt][1]);
          MmaBf16(logit[j][nt], af[0], af[1], af[2], af[3], qlo[s][nt][0], qlo[s][nt][1]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (!vrow[j][i >> 1]) logit[j][nt][i] = -INFINITY;
    }

    // ---- online softmax over the kSub·16 tokens of this step ----
    float p[kSub][NT][4];
    float alpha[NT][2];
    bool grew = false;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float tmax = -INFINITY;
#pragma unroll
        for (int j = 0; j < kSub; ++j)
          tmax = fmaxf(tmax, fmaxf(logit[j][nt][e], logit[j][nt][2 + e]));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 4));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 8));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 16));
        const float m_new = fmaxf(m_run[nt][e], tmax);
        grew |= m_new > m_run[nt][e];
        const float m_safe = (m_new == -INFINITY) ? 0.f : m_new;
        alpha[nt][e] = exp2f(m_run[nt][e] - m_safe);
        m_run[nt][e] = m_new;
        float lsum = 0.f;
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          p[j][nt][e] = exp2f(logit[j][nt][e] - m_safe);
          p[j][nt][2 + e] = exp2f(logit[j][nt][2 + e] - m_safe);
          lsum += p[j][nt][e] + p[j][nt][2 + e];
        }
        l_run[nt][e] = l_run[nt][e] * alpha[nt][e] + lsum;
      }
    if (__any_sync(0xffffffffu, grew)) {  // rescale only when some running max moved
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][nt][i] *= alpha[nt][i & 1];
    }

    // ---- Oᵀ += Vᵀ·P ----
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const uint8_t* st = stage + j * C::kTile;
      uint32_t pb[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        pb[nt][0] = MovMatrixTrans(PackBf162(p[j][nt][0], p[j][nt][1]));
        pb[nt][1] = MovMatrixTrans(PackBf162(p[j][nt][2], p[j][nt][3]));
      }
      const uint8_t* vt = st + 32 * D;
      const int q4 = lane >> 3, r8 = lane & 7;
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        const int row = r8 + 8 * (q4 >> 1);
        const int c = 2 * mt + (q4 & 1);
        uint32_t af[4];
        LdMatrixX4Trans(af, vt + row * 2 * D + 16 * (c ^ (row & 7)));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          MmaBf16(acc[mt][nt], af[0], af[1], af[2], af[3], pb[nt][0], pb[nt][1]);
      }
    }
    __syncwarp();
  }
  CpAsyncWait<0>();

  // ---- reduce per-lane partial sums over the 8 lane groups ----
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1)
        l_run[nt][e] += __shfl_xor_sync(0xffffffffu, l_run[nt][e], o);
    }

  // ---- combine the warps in shared memory ----
  __syncthreads();                             // every warp is done with its ring
  float* cm = reinterpret_cast<float*>(smem);  // [kWarps][kN]
  float* cl = cm + kWarps * kN;                // [kWarps][kN]
  float* co = cl + kWarps * kN;                // [kWarps][kN][D]
  if (g == 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        cm[warp * kN + 8 * nt + 2 * tig + e] = m_run[nt][e];
        cl[warp * kN + 8 * nt + 2 * tig + e] = l_run[nt][e];
      }
  }
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i >> 1, e = i & 1;
        co[(warp * kN + 8 * nt + 2 * tig + e) * D + 16 * mt + 8 * r + g] = acc[mt][nt][i];
      }
  __syncthreads();
  const int split = seg.split_offset + sx;
  for (int idx = threadIdx.x; idx < nh * D; idx += kThreads) {
    const int h = idx / D, dim = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, cm[w * kN + h]);
    const float ms = (mx == -INFINITY) ? 0.f : mx;
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(cm[w * kN + h] - ms);
      l += cl[w * kN + h] * f;
      o += co[(w * kN + h) * D + dim] * f;
    }
    const size_t row = (size_t(b) * a.num_q_heads + h_first + h) * a.s_total + split;
    // NaN inputs (q, or a K/V/param value of a valid token) make l NaN: keep it NaN (a defined,
    // visible result for exactly the affected heads) rather than letting "l > 0" turn it into 0.
    const bool nan = isnan(l);
    a.part_o[row * D + dim] = nan ? NAN : (l > 0.f ? o / l : 0.f);
    if (dim == 0) a.part_lse[row] = (overflow || nan) ? NAN : (l > 0.f ? ms + log2f(l) : -INFINITY);
  }
  // Behind the INT2 kernel: the merge kernel waits for this grid only, make its completion imply
  // the INT2 grid's. One CTA waiting is enough (the grid completes when its last CTA exits); the
  // others exit and free their slot for the CTAs still queued (v20: with every CTA waiting, the
  // BF16 CTAs that ran beside the INT2 grid held their slot until it ended, so at B = 32 × 32K
  // 245 of 256 started only in the INT2 grid's tail).
  KVPOOL_TL(2, 2);
  if (!a.pdl_wait_first && IsLastCta()) PdlWait();
}

// ---------------------------------------------------------------------------------------------
// INT2 history kernel (v6). One CTA = (split of the history segment, KV head, head chunk,
// request), 4 warps, each warp streaming 32-token steps (two 16-token units) of its pages.
//
// * Loads: TMA bulk copies (cp.async.bulk) of whole units into a private 2-stage ring per warp,
//   completed through mbarriers; a stage holds two steps (4 units), so the wait, the expect_tx and
//   the page-id bookkeeping are paid once per 64 tokens. A stage's page ids are loaded one stage
//   ahead, one per lane (lanes 0-3); since v27 each copy is issued by one elected lane with the
//   page id shuffled in, so its operands are warp-uniform (one UBLKCP, no per-lane loop).
// * S = K·q̃ᵀ on integer tensor cores (mma m16n8k32, u8 codes × s8 q, s32 accumulators): the
//   32-bit word at code byte 4w holds channels 4w..4w+3 of all four quarters, so
//   (word >> 2k) & 0x03030303 are four u8 codes of quarter k (2 ops per 4 codes, no bias,
//   exact). q̃ is quantized per head to 16 bits, v = rint(q̃·S) = 256·hi + lo (hi, lo int8), and
//   hi / lo sit in adjacent N columns (2h, 2h+1), so a thread's two accumulator columns are the
//   two halves of ONE head: the dot product is 256·acc_hi + acc_lo, exact in int32, and every
//   lane's softmax work is on a real head (4 heads per n-tile). Per token the logit is
//   scale16·(Σ c·v)/S + min16·(Σ v)/S (FORMAT.md §2.8): the same quantized q̃ in both terms, so
//   it is the exact dot product of the dequantized key with q̃ rounded to 2^-15 of its largest
//   element (finer than fp16).
// * Oᵀ += Vᵀ·P' on fp16 tensor cores (m16n8k16): a masked code is used directly as an fp16
//   SUBNORMAL, (x & (0x00030003 << 2k)) = code·4^k·2^-24 exactly, one LOP3 per two codes, no
//   bias to remove (the 0x6400 + HSUB2 form cost two ops; folding the bias out after the MMA
//   failed the tolerances, KERNELS.md). 2^24·4^-k is applied once to the accumulator.
//   P' = p·scale16 (fp16), Σ p·min16 per head (FORMAT.md §2.8): at one n-tile (v27) from one more
//   m16n8k16 per unit with an all-ones A and p·min16 in the (otherwise padding) odd N columns of
//   P', at two n-tiles in fp32 FFMAs. Heads sit on the even (head h) and odd (head 4 + h) N
//   columns, matching the S layout after movmatrix.trans.
// * Online softmax in log2 units; logits are formed relative to the running max (the FFMA chain
//   starts from -max), which is re-reduced across lanes only when some logit of the step exceeds
//   it (one warp vote per step otherwise). Invalid rows (past the last page's length, or units
//   not loaded) are masked in a branch taken only by the steps that hold them.
template <int D>
struct I2Cfg {
  static constexpr int kNG = (D == 256) ? 2 : 1;      // INT2 groups per row
  static constexpr int kCR = D / 4;                   // code bytes per token row
  static constexpr int kTile = 32 * kCR + 128 * kNG;  // one 16-token unit: K, V, params
  static constexpr int kSub = 2;            // units per warp step (the online-softmax granularity)
  static constexpr int kStepsPerStage = 2;  // warp steps per ring stage (one wait, one TMA issue)
  static constexpr int kStageUnits = kSub * kStepsPerStage;
  static constexpr int kStages = 2;     // ring stages per warp
  static constexpr int kTW = D / 64;    // K words per row per lane (1, 2, 4)
  static constexpr int kMma = 2 * kTW;  // k32 MMAs per unit per n-tile
  static constexpr int kVB = D / 32;    // V bytes per row per lane group
  static constexpr int kMt = D / 16;    // m-tiles of Oᵀ
};

template <int D, int KT>
constexpr int Int2SmemBytes() {
  using C = I2Cfg<D>;
  constexpr int ring = kWarps * C::kStages * C::kStageUnits * C::kTile;
  // Combine buffers: per (warp, head slot) max, sum, weight and the D outputs.
  constexpr int combine = kWarps * 8 * (D + 3) * 4;
  return ring > combine ? ring : combine;
}

// MMA m of a unit uses the code words (w0, w1) of quarters (k0, k1) (K-index halves 0-15 and
// 16-31 of the k32 step; any pairing works as long as q̃'s fragments follow it).
template <int D>
struct I2Chunk {
  static constexpr __host__ __device__ int W0(int m) {
    return I2Cfg<D>::kTW == 1 ? 0 : 2 * (m % (I2Cfg<D>::kTW / 2));
  }
  static constexpr __host__ __device__ int W1(int m) { return I2Cfg<D>::kTW == 1 ? 0 : W0(m) + 1; }
  static constexpr __host__ __device__ int K0(int m) {
    return I2Cfg<D>::kTW == 1 ? 2 * m : m / (I2Cfg<D>::kTW / 2);
  }
  static constexpr __host__ __device__ int K1(int m) {
    return I2Cfg<D>::kTW == 1 ? 2 * m + 1 : K0(m);
  }
  static constexpr __host__ __device__ int Grp(int m) { return I2Cfg<D>::kNG == 2 ? K0(m) / 2 : 0; }
  // Channel of byte b of word w, quarter k, for lane-in-group tig.
  static constexpr __host__ __device__ int Channel(int tig, int w, int k, int b) {
    return tig * (D / 16) + 4 * w + b + (D / 4) * k;
  }
};

// Resident CTAs per SM the INT2 kernel is compiled for (its register cap: 65,536 / (128 · N)).
// The wide form (N = 4, d 128, one n-tile, v31) is a second instantiation chosen by the launcher.
template <int D, int KT>
constexpr int Int2DefaultCtas() {
  return D <= 128 ? (KT == 1 ? 5 : 4) : 2;
}

template <int D, int KT, int kCtas = Int2DefaultCtas<D, KT>()>
__global__ void __launch_bounds__(kThreads, kCtas) Int2DecodeKernel(const AttnArgs a) {
  using C = I2Cfg<D>;
  using CH = I2Chunk<D>;
  constexpr int kNG = C::kNG;
  constexpr int kSub = C::kSub;
  constexpr int kStages = C::kStages;
  constexpr int kStepsPerStage = C::kStepsPerStage;
  constexpr int kStageUnits = C::kStageUnits;
  constexpr int kMma = C::kMma;
  constexpr int kMt = C::kMt;
  constexpr int kTW = C::kTW;
  constexpr int kHeads = 4 * KT;  // q heads per CTA
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[kWarps][kStages];
  // Quantized q̃ per head as its int8 halves, v = 256·hi + lo: [head][0: hi, 1: lo][channel].
  __shared__ __align__(4) int8_t q_b[kHeads][2][D];
  __shared__ float q_inv_s[kHeads];
  __shared__ float q_sum[kHeads][kNG];  // Σ v over the group, times 1/S
  KVPOOL_TL(1, 0);

  // The warp index through a shuffle from lane 0: the compiler then treats it (and the split
  // bounds derived from it) as warp-uniform.
  const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x >> 5), 0), lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  // Token order inside a 16-token unit. Lane group g holds the logits of tokens krow and
  // krow + 8, krow = σ(g) = [0, 4, 1, 5, 2, 6, 3, 7][g], so that after movmatrix.trans the P'
  // fragment of lane (g, tig) covers tokens tig and tig + 4 (+ 8): the V code rows a lane reads
  // are then 4·32 bytes apart across tig, which keeps the V loads free of bank conflicts
  // (tokens 2tig, 2tig + 1 would put lanes tig and tig + 2 on the same bank).
  const int krow = (g >> 1) + 4 * (g & 1);
  const SegArgs& seg = a.seg0;
  const int num_splits = max(seg.num_splits, 1);
  const int rows_per_req = (a.num_q_heads / a.group) * a.head_chunks;
  uint8_t* ring = smem + warp * kStages * kStageUnits * C::kTile;
  uint64_t* bar = bars[warp];
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) MbarInit(&bar[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncwarp();
  // Phase parity of the two ring slots carried across items: slot s waits for parity
  // ((ts / kStages) ^ (par_bits >> s)) & 1.
  uint32_t par_bits = 0;
  // Claims and two items are compiled for one n-tile only (v20): at KT = 2 they lost (64 q / 8 KV,
  // s7), and without their code that instantiation keeps v17's register allocation.
  constexpr bool kDyn = KT == 1;
  const int n_items = (kDyn && a.items_rows > 0) ? 2 : 1;
  __shared__ int next_item[2];  // the second item's row and split (v20), see below
#pragma unroll 1
  for (int item = 0; item < n_items; ++item) {
    int sx, yy, b;  // split, KV head × head chunk, request of this item
    if (kDyn && a.items_rows > 0) {
      // The first item is (c / S, c % S) of rows [0, R2); the second comes in the order the CTAs
      // finish their first (v20; ticket and mapping below, before this loop's last barrier).
      const int c = blockIdx.x;
      const int row = item == 0 ? c / num_splits : next_item[0];
      sx = item == 0 ? c % num_splits : next_item[1];
      b = row / rows_per_req;
      yy = row % rows_per_req;
    } else {
      sx = a.split_major ? blockIdx.z : blockIdx.x;
      yy = a.split_major ? blockIdx.x : blockIdx.y;
      b = a.split_major ? blockIdx.y : blockIdx.z;
    }
    const int kvh = yy / a.head_chunks;
    const int chunk = yy % a.head_chunks;
    const int h_first = kvh * a.group + chunk * kHeads;
    const int nh = min(kHeads, a.group - chunk * kHeads);
    const int page_size = a.page_size;
    const int tpp_log2 = page_size == 64 ? 2 : 0;

    int pbeg = 0, npg = 0, last_len = 0;
    if (seg.indptr != nullptr) {
      pbeg = seg.indptr[b];
      npg = seg.indptr[b + 1] - pbeg;
      if (npg > 0) last_len = min(max(seg.last_len[b], 0), page_size);
    }
    // v18: a ring stage holds kStageUnits consecutive units of the row (request, KV head, head
    // chunk); stage t < t_fix of warp w in split sx is the fixed ((t·S + sx)·kWarps + w)-th stage
    // of the row (the splits interleave at stage granularity), and with dyn_claims every later
    // stage is claimed from the row's counter (atomicAdd of lane 0, issued one stage before the
    // stage is prepared and two before its copies), so the splits of a row end within about one
    // stage of each other however unevenly the SMs serve their CTAs. (One launch's timeline at B =
    // 8 × 128K, v16: equal static splits ended between 101 and 162 µs, the CTAs an SM received last
    // taking 32 % longer than its first; with the split-major grid a row's splits sit at every such
    // rank.) Claims start only after the wait for QRotateKernel, which zeroes the counters; the
    // first kStages stages are always fixed and issued before that wait.
    const int npg_eff = min(npg, num_splits * seg.pages_per_split);  // max_pages bound
    const bool overflow = (sx == num_splits - 1) && npg > npg_eff;
    const int row_units = npg_eff << tpp_log2;
    const int row_tokens =
        npg_eff < npg ? npg_eff * page_size : (npg > 0 ? (npg - 1) * page_size + last_len : 0);
    // Stages t < t_fix of every warp are fixed (dyn_claims % of the row), later ones claimed.
    const int t_fix =
        (kDyn && a.dyn_claims && !(a.items_rows > 0 && item == 0))
            ? max(kStages, (a.dyn_claims * row_units) / (100 * num_splits * kWarps * kStageUnits))
            : 1 << 30;
    const int claim_base = t_fix * num_splits * kWarps * kStageUnits;  // units of fixed stages
    auto fixed_base = [&](int t) { return ((t * num_splits + sx) * kWarps + warp) * kStageUnits; };
    int* claims = a.row_claims + kClaimStride * (size_t(b) * rows_per_req + yy);
    const uint64_t chunk_bytes = uint64_t(page_size) * (D / 2 + 8 * kNG);
    // Page ids and the head's base as single 64-bit values (the empty asms keep the compiler from
    // re-deriving them per use: a sign-extended pbeg added to every page-id address, two 64-bit
    // additions per copy address).
    uint64_t pid_addr = reinterpret_cast<uint64_t>(seg.indices + pbeg);
    asm("" : "+l"(pid_addr));
    const int32_t* page_ids = reinterpret_cast<const int32_t*>(pid_addr);
    uint64_t head_addr = reinterpret_cast<uint64_t>(seg.base) + uint64_t(kvh) * chunk_bytes;
    asm("" : "+l"(head_addr));
    const uint8_t* head_base = reinterpret_cast<const uint8_t*>(head_addr);

    // Page id of unit base + (lane % kStageUnits) (base < row_units; a unit past the row's end
    // reads unit base's page id, see issue): one load per lane, from kStageUnits addresses.
    auto load_pid = [&](int base) -> int {
      const uint32_t u = uint32_t(base) + uint32_t(lane & (kStageUnits - 1));
      const uint32_t uc = u < uint32_t(row_units) ? u : uint32_t(base);
      return base < row_units ? __ldg(page_ids + (uc >> tpp_log2)) : 0;
    };
    // TMA copies of ring stage t = units base .. base + kStageUnits - 1 (base < row_units). v27:
    // copy j takes lane j's page id through a shuffle, so its operands are warp-uniform, and one
    // elected lane issues it (BulkCopyElect; v26 had lane j issue it, which the compiler wraps in
    // a loop over the issuing lanes, ~8 instructions per copy plus per-lane address arithmetic).
    // Every stage copies kStageUnits units: a unit past the row's end copies unit base again (an
    // in-bounds page; its rows are masked like any row past the end), so the expect_tx count is
    // a constant and the copies need no branch. No proxy fence before the copies: the
    // generic-proxy reads of this stage completed (their values were consumed) before the
    // __syncwarp that ended its previous use, as in a TMA pipeline's consumer release. expect_tx
    // comes first in program order (same warp).
    auto issue = [&](int t, int base, int pid) {
      const int s = t % kStages;
      if (lane == 0) MbarExpectTx(&bar[s], uint32_t(kStageUnits * C::kTile));
      const uint64_t stride = seg.page_stride;
      uint8_t* const dst = ring + s * kStageUnits * C::kTile;
      if (page_size == 16) {
#pragma unroll
        for (int j = 0; j < kStageUnits; ++j) {
          const uint32_t pj = uint32_t(__shfl_sync(0xffffffffu, pid, j));
          BulkCopyElect(dst + j * C::kTile, head_base + uint64_t(pj) * stride, C::kTile, &bar[s]);
        }
      } else {
        const uint64_t code_part = uint64_t(page_size) * C::kCR;
#pragma unroll
        for (int j = 0; j < kStageUnits; ++j) {
          const uint32_t pj = uint32_t(__shfl_sync(0xffffffffu, pid, j));
          const uint8_t* src = head_base + uint64_t(pj) * stride;
          uint8_t* d = dst + j * C::kTile;
          const int sub = (base + j < row_units ? base + j : base) & 3;
          BulkCopyElect(d, src + sub * 16 * C::kCR, 16 * C::kCR, &bar[s]);
          BulkCopyElect(d + 16 * C::kCR, src + code_part + sub * 16 * C::kCR, 16 * C::kCR, &bar[s]);
          BulkCopyElect(d + 32 * C::kCR, src + 2 * code_part + sub * 64 * kNG, 64 * kNG, &bar[s]);
          BulkCopyElect(d + 32 * C::kCR + 64 * kNG,
                        src + 2 * code_part + uint64_t(page_size) * 4 * kNG + sub * 64 * kNG,
                        64 * kNG, &bar[s]);
        }
      }
    };
    // The fixed stages fill the whole ring before the wait for q̃ (v9: the copies read page ids
    // only, never q̃), so a CTA resident while QRotateKernel runs has kStages stages in flight.
    static_assert(kStages == 2, "the stage bookkeeping below holds two ring slots");
    int sb0 = fixed_base(0), sb1 = fixed_base(1);  // unit base of the stage in ring slot 0 / 1
    // v30: with pre_stages == 1 the first item's stage 1 waits for q̃ as well (see AttnArgs).
    const bool late1 = a.pre_stages == 1 && item == 0;
    const int pid0 = load_pid(sb0), pid1 = load_pid(sb1);
    if (sb0 < row_units) issue(0, sb0, pid0);
    if (!late1 && sb1 < row_units) issue(1, sb1, pid1);

    // ---- q̃ (written by QRotateKernel) → 16-bit integers per head, in shared memory ----
    if (a.pdl_wait_first) PdlWait();
    if (late1 && sb1 < row_units) issue(1, sb1, pid1);
    PdlLaunchDependents();
    KVPOOL_TL(1, 1);
    // Claims of stages 2 and 3 (the counters are zero now: QRotateKernel completed). Lane 0 holds
    // the pending result; it is read one stage later, so the atomic's latency is hidden.
    int claim2 = 0, claim = 0;
    if (lane == 0 && sb1 < row_units) {
      if (2 >= t_fix) claim2 = atomicAdd(claims, kStageUnits);
      if (3 >= t_fix) claim = atomicAdd(claims, kStageUnits);
    }
    for (int h = warp; h < kHeads; h += kWarps) {
      const bool real = h < nh;
      const float* qh = a.q_rot + (size_t(b) * a.num_q_heads + h_first + h) * D;
      float v[D / 32];
      float amax = 0.f;
      bool bad = false;
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        v[i] = real ? qh[lane + 32 * i] : 0.f;
        bad |= !isfinite(v[i]);
        amax = fmaxf(amax, fabsf(v[i]));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        bad |= __shfl_xor_sync(0xffffffffu, int(bad), o) != 0;
      }
      // |v| <= 32512 = 127·256: hi = (v - lo) / 256 stays within int8 for lo in [-128, 127].
      const float s = (amax > 0.f && !bad) ? 32512.f / amax : 0.f;
      const float inv_s = bad ? NAN : (amax > 0.f ? amax / 32512.f : 0.f);
      int sum[kNG];
#pragma unroll
      for (int grp = 0; grp < kNG; ++grp) sum[grp] = 0;
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        const int iv = bad ? 0 : __float2int_rn(v[i] * s);
        const int lo = ((iv + 128) & 0xff) - 128;
        q_b[h][0][lane + 32 * i] = int8_t((iv - lo) >> 8);
        q_b[h][1][lane + 32 * i] = int8_t(lo);
        sum[(kNG == 2) ? (i / 4) : 0] += iv;
      }
#pragma unroll
      for (int grp = 0; grp < kNG; ++grp) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum[grp] += __shfl_xor_sync(0xffffffffu, sum[grp], o);
        if (lane == 0) q_sum[h][grp] = float(sum[grp]) * inv_s;
      }
      if (lane == 0) q_inv_s[h] = inv_s;
    }
    __syncthreads();
    // B fragments: column n = g is head 4kt + g/2, part g&1 (0: hi byte, 1: lo byte).
    uint32_t qb[kMma][KT][2];
    float inv_s[KT], sqs[KT][kNG];
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const int hb = 4 * kt + (g >> 1);
      const bool hi_part = (g & 1) == 0;
#pragma unroll
      for (int m = 0; m < kMma; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int w = half ? CH::W1(m) : CH::W0(m);
          const int k = half ? CH::K1(m) : CH::K0(m);
          // Channels bb = 0..3 of (tig, w, k) are consecutive: one 32-bit load of four bytes
          // (v6 built each byte from an int16 load and five ALU ops, ~230 instructions per warp).
          qb[m][kt][half] = *reinterpret_cast<const uint32_t*>(
              &q_b[hb][hi_part ? 0 : 1][CH::Channel(tig, w, k, 0)]);
        }
      }
      inv_s[kt] = q_inv_s[4 * kt + tig] * (1.f / 64.f);  // the codes enter the MMA as code·64
#pragma unroll
      for (int grp = 0; grp < kNG; ++grp) sqs[kt][grp] = q_sum[4 * kt + tig][grp];
    }

    float acc[kMt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
    // m_run: running max (log2 units). Logits are formed relative to mref = m_run (0 while m_run is
    // -inf), i.e. the FFMA chain that builds a logit starts from -mref, so p = 2^logit needs no
    // subtraction; a logit exceeds the running max iff it exceeds gth = m_run - mref (0 or -inf).
    // v29: m_run is not kept (it is always mref + gth = gth - nref) and mref is held negated,
    // nref = -mref, the FFMA chain's start. The register this frees is what lets the two lane
    // offsets below stay in registers at 95 (without it: 96 and a 16-byte spill).
    float nref[KT], gth[KT], l_run[KT], mn_run[KT][kNG];
    // v27, one n-tile: Σ p·min16 per head comes from the tensor cores. With a single n-tile the odd
    // N columns of P' were zero padding; they now carry p·min16 of the even column's head (one
    // HMUL2 of {p, p} by the (scale16, min16) word makes both), and one more m16n8k16 per unit
    // with an all-ones A sums them over the unit's 16 tokens: accm[grp][1] of lane (g, tig) is
    // Σ p·min16 of head tig, the same in every lane group (no reduction across groups). This
    // replaces a half→float conversion and an FFMA per (token row, lane), 8 instructions per unit,
    // with one HMMA; p·min16 is rounded to fp16 as P' = p·scale16 always was. The V MMAs' odd
    // output columns then hold unused sums (Σ code·p·min16, finite).
    constexpr bool kMinMma = KT == 1;
    float accm[kNG][4];
#pragma unroll
    for (int grp = 0; grp < kNG; ++grp)
#pragma unroll
      for (int i = 0; i < 4; ++i) accm[grp][i] = 0.f;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      nref[kt] = 0.f;
      gth[kt] = -INFINITY;
      l_run[kt] = 0.f;
#pragma unroll
      for (int grp = 0; grp < kNG; ++grp) mn_run[kt][grp] = 0.f;
    }

    // Stage 2: its base (claimed above, or fixed) and page ids; every later stage is prepared in
    // the loop one stage before its copies are issued.
    auto next_base = [&](int t, int c) {
      return t >= t_fix ? claim_base + __shfl_sync(0xffffffffu, c, 0) : fixed_base(t);
    };
    int nb = sb1 < row_units ? next_base(2, claim2) : row_units;
    int npid = load_pid(nb);

    // One ring stage (two warp steps) per iteration, while the stage's base is inside the row
    // (bases grow with the stage index, so the first one past the end ends the loop with no copy in
    // flight). (v11 ran the stages without masked steps through a second, branch-free copy of this
    // body: 96 registers instead of 90 and no faster (s5/s6 A/B in KERNELS.md), so v12 dropped it.)
    // Per-lane shared-memory offsets of a unit's K rows, K/V params and V rows inside a unit. v29:
    // the empty asm keeps koff and voff in registers through the loop (without it the compiler
    // re-derived them from %tid every stage, ~11 instructions); poff is left to the compiler
    // (holding it too needs a 96th register and spills).
    uint32_t koff = krow * C::kCR + tig * (D / 16), poff = krow * kNG * 4,
             voff = tig * C::kCR + g * C::kVB;
    asm("" : "+r"(koff), "+r"(voff));
    int ts = 0;
    for (;; ++ts) {
      const int s = ts % kStages;
      const int sbase = s ? sb1 : sb0;
      if (sbase >= row_units) break;  // warp-uniform
      MbarWait(&bar[s], (uint32_t(ts / kStages) ^ (par_bits >> s)) & 1u);
      const bool stage_partial = (sbase + kStageUnits) * 16 > row_tokens;  // warp-uniform
#pragma unroll
      for (int h = 0; h < kStepsPerStage; ++h) {
        // A step past the row's end (a stage that holds fewer than kStageUnits units) is run with
        // every row masked rather than skipped, so the two steps of a stage form one basic block
        // the compiler can interleave.
        const uint8_t* stage = ring + (s * kStageUnits + h * kSub) * C::kTile;
        const int u0 = sbase + h * kSub;  // row-global unit of the step
        // One test per stage (v27; v26 tested each step): a stage with rows past the segment's end,
        // or units not loaded, runs both steps through the masking branches.
        const bool partial = stage_partial;

        float logit[kSub][KT][2];    // relative to mref
        uint32_t vpw[kSub][2][kNG];  // V params {scale16, min16} of rows krow, krow + 8
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          const uint8_t* st = stage + j * C::kTile;
          const uint32_t* kpar = reinterpret_cast<const uint32_t*>(st + 32 * C::kCR + poff);
          const uint32_t* vpar = kpar + 16 * kNG;
          float ks[2][kNG], km[2][kNG];
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int grp = 0; grp < kNG; ++grp) {
              const uint32_t kp = kpar[8 * r * kNG + grp];
              vpw[j][r][grp] = vpar[8 * r * kNG + grp];
              const __half2 kh = *reinterpret_cast<const __half2*>(&kp);
              ks[r][grp] = __low2float(kh);
              km[r][grp] = __high2float(kh);
            }
          // K words of rows g and g+8 for this lane.
          uint32_t kw[2][kTW];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const uint8_t* rowp = st + koff + 8 * r * C::kCR;
            if constexpr (kTW == 1) {
              kw[r][0] = *reinterpret_cast<const uint32_t*>(rowp);
            } else if constexpr (kTW == 2) {
              const uint2 x = *reinterpret_cast<const uint2*>(rowp);
              kw[r][0] = x.x;
              kw[r][1] = x.y;
            } else {
              const uint4 x = *reinterpret_cast<const uint4*>(rowp);
              kw[r][0] = x.x;
              kw[r][1] = x.y;
              kw[r][2] = x.z;
              kw[r][3] = x.w;
            }
          }
          int sacc[kNG][KT][4];
#pragma unroll
          for (int grp = 0; grp < kNG; ++grp)
#pragma unroll
            for (int kt = 0; kt < KT; ++kt)
#pragma unroll
              for (int i = 0; i < 4; ++i) sacc[grp][kt][i] = 0;
#pragma unroll
          for (int m = 0; m < kMma; ++m) {
            const int w0 = CH::W0(m), w1 = CH::W1(m), k0 = CH::K0(m), k1 = CH::K1(m);
            // code·64 of quarter k: a left shift (IMAD.SHL, FMA pipe) and one LOP3 (ALU pipe, the
            // busier one: ncu showed it at 65 % with right shifts).
            const uint32_t a0 = (kw[0][w0] << (6 - 2 * k0)) & 0xc0c0c0c0u;
            const uint32_t a1 = (kw[1][w0] << (6 - 2 * k0)) & 0xc0c0c0c0u;
            const uint32_t a2 = (kw[0][w1] << (6 - 2 * k1)) & 0xc0c0c0c0u;
            const uint32_t a3 = (kw[1][w1] << (6 - 2 * k1)) & 0xc0c0c0c0u;
#pragma unroll
            for (int kt = 0; kt < KT; ++kt)
              ImmaU8S8(sacc[CH::Grp(m)][kt], a0, a1, a2, a3, qb[m][kt][0], qb[m][kt][1]);
          }
#pragma unroll
          for (int kt = 0; kt < KT; ++kt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float x = nref[kt];
#pragma unroll
              for (int grp = 0; grp < kNG; ++grp) {
                const int dot = sacc[grp][kt][2 * r] * 256 + sacc[grp][kt][2 * r + 1];
                x = fmaf(ks[r][grp] * inv_s[kt], float(dot), fmaf(km[r][grp], sqs[kt][grp], x));
              }
              logit[j][kt][r] = x;
            }
          if (partial) {  // warp-uniform: rows past the segment's end, or of units not loaded
            const int n = min(max(row_tokens - 16 * (u0 + j), 0), 16);
#pragma unroll
            for (int r = 0; r < 2; ++r)
              if (krow + 8 * r >= n) {  // unused slots may hold anything (NaN included)
#pragma unroll
                for (int kt = 0; kt < KT; ++kt) logit[j][kt][r] = -INFINITY;
#pragma unroll
                for (int grp = 0; grp < kNG; ++grp) vpw[j][r][grp] = 0u;
              }
          }
        }

        // ---- online softmax (log2 units) ----
        bool grow = false;
        float lmax[KT];
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          // No -inf start (v29, one FMNMX per step fewer): fmaxf returns the non-NaN operand, so
          // only a lane whose four logits are all NaN differs (NaN instead of -inf), and both
          // fail the test below and lose to any other operand of the reduction in the rescale.
          lmax[kt] = fmaxf(logit[0][kt][0], logit[0][kt][1]);
#pragma unroll
          for (int j = 1; j < kSub; ++j)
            lmax[kt] = fmaxf(lmax[kt], fmaxf(logit[j][kt][0], logit[j][kt][1]));
          grow |= lmax[kt] > gth[kt];
        }
        if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
            float x = lmax[kt];
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
            const float m_old = gth[kt] - nref[kt];  // m_run
            const float m_new = fmaxf(m_old, x - nref[kt]);
            const float alpha = (m_new == -INFINITY) ? 1.f : Ex2(m_old - m_new);
            const float ref = (m_new == -INFINITY) ? 0.f : m_new;
#pragma unroll
            for (int j = 0; j < kSub; ++j)
#pragma unroll
              for (int r = 0; r < 2; ++r) logit[j][kt][r] -= nref[kt] + ref;
            nref[kt] = -ref;
            gth[kt] = m_new - ref;
            l_run[kt] *= alpha;
#pragma unroll
            for (int grp = 0; grp < kNG; ++grp) {
              if constexpr (kMinMma)
                accm[grp][1] *= alpha;  // the only column read (0, 2, 3 are never used)
              else
                mn_run[kt][grp] *= alpha;
            }
#pragma unroll
            for (int mt = 0; mt < kMt; ++mt) {
              acc[mt][kt] *= alpha;
              acc[mt][2 + kt] *= alpha;
            }
          }
        }
        uint32_t pb[kSub][kNG][2];
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          float p[KT][2];
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              p[kt][r] = Ex2(logit[j][kt][r]);
              l_run[kt] += p[kt][r];
              if constexpr (!kMinMma) {
#pragma unroll
                for (int grp = 0; grp < kNG; ++grp)
                  mn_run[kt][grp] = fmaf(
                      p[kt][r], __high2float(*reinterpret_cast<const __half2*>(&vpw[j][r][grp])),
                      mn_run[kt][grp]);
              }
            }
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // {p(head tig), p(head 4 + tig)} of token g + 8r, times its scale16; with kMinMma
            // {p·scale16, p·min16} of head tig.
            const uint32_t pk = PackHalf2(p[0][r], KT == 2   ? p[KT - 1][r]
                                                   : kMinMma ? p[0][r]
                                                             : 0.f);
#pragma unroll
            for (int grp = 0; grp < kNG; ++grp) {
              const __half2 vp = *reinterpret_cast<const __half2*>(&vpw[j][r][grp]);
              __half2 h =
                  __hmul2(*reinterpret_cast<const __half2*>(&pk), kMinMma ? vp : __low2half2(vp));
              pb[j][grp][r] = MovMatrixTrans(*reinterpret_cast<const uint32_t*>(&h));
            }
          }
        }

        // ---- Oᵀ += Vᵀ·P' ----
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          const uint8_t* vc = stage + j * C::kTile + 16 * C::kCR;
          constexpr int kVB = C::kVB;
          constexpr int kVW = (kVB + 3) / 4;
          uint32_t vw[4][kVW];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint8_t* rp = vc + voff + (4 * (q & 1) + 8 * (q >> 1)) * C::kCR;
            if constexpr (kVB == 2) {
              vw[q][0] = *reinterpret_cast<const uint16_t*>(rp);
            } else if constexpr (kVB == 4) {
              vw[q][0] = *reinterpret_cast<const uint32_t*>(rp);
            } else {
              const uint2 x = *reinterpret_cast<const uint2*>(rp);
              vw[q][0] = x.x;
              vw[q][1] = x.y;
            }
          }
#pragma unroll
          for (int i = 0; i < kVB; ++i) {
            const int wi = i >> 2, bs = i & 3;
            // bytes bs of tokens (2tig, 2tig+1) and (2tig+8, 2tig+9) in the low byte of each lane
            const uint32_t sel = bs | ((4 + bs) << 8);
            const uint32_t x0 = Prmt(vw[0][wi], vw[1][wi], sel);
            const uint32_t x1 = Prmt(vw[2][wi], vw[3][wi], sel);
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
              const int k0 = 2 * kk;  // quarters k0 (row g) and k0 + 1 (row g + 8)
              const int mt = 2 * i + kk;
              const uint32_t m0 = 0x00030003u << (2 * k0), m1 = 0x00030003u << (2 * k0 + 2);
              const int grp = (kNG == 2) ? kk : 0;
              MmaF16(acc[mt], x0 & m0, x0 & m1, x1 & m0, x1 & m1, pb[j][grp][0], pb[j][grp][1]);
            }
          }
          if constexpr (kMinMma) {
            constexpr uint32_t kOnes = 0x3c003c00u;  // fp16 {1, 1}
#pragma unroll
            for (int grp = 0; grp < kNG; ++grp)
              MmaF16(accm[grp], kOnes, kOnes, kOnes, kOnes, pb[j][grp][0], pb[j][grp][1]);
          }
        }
      }  // step h of stage ts
      __syncwarp();
      // Refill the slot just consumed with stage ts + 2 (prepared one stage ago), then prepare
      // stage ts + 3 from the claim issued one stage ago and claim stage ts + 4.
      if (s)
        sb1 = nb;
      else
        sb0 = nb;
      if (nb < row_units) {
        issue(ts + kStages, nb, npid);
        nb = next_base(ts + kStages + 1, claim);
        npid = load_pid(nb);
        if (ts + kStages + 2 >= t_fix && lane == 0) claim = atomicAdd(claims, kStageUnits);
      }
    }

    // The ticket of this CTA's next item (its latency hides behind the epilogue below).
    int ticket = 0;
    if (item + 1 < n_items && threadIdx.x == 0) ticket = atomicAdd(a.item_counter, 1);
    if (item + 1 < n_items) KVPOOL_TL(1, 4);
    // Stages 0, 2, … used slot 0 and 1, 3, … slot 1: their phases carry into the next item.
    par_bits ^= (uint32_t((ts + 1) / 2) & 1u) | ((uint32_t(ts / 2) & 1u) << 1);

    // ---- reduce per-lane sums over the 8 lane groups ----
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        l_run[kt] += __shfl_xor_sync(0xffffffffu, l_run[kt], o);
        if constexpr (!kMinMma) {
#pragma unroll
          for (int grp = 0; grp < kNG; ++grp)
            mn_run[kt][grp] += __shfl_xor_sync(0xffffffffu, mn_run[kt][grp], o);
        }
      }

    // ---- combine the warps in shared memory ----
    constexpr int kN = 8;  // head slots per warp in the combine buffers
    __syncthreads();       // every warp is done with its ring (all issued copies were consumed)
    float* cm = reinterpret_cast<float*>(smem);
    float* cl = cm + kWarps * kN;
    float* co = cl + kWarps * kN;
    if (g == 0) {
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
        cm[warp * kN + 4 * kt + tig] = gth[kt] - nref[kt];  // m_run
        cl[warp * kN + 4 * kt + tig] = l_run[kt];
      }
    }
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kt = i & 1, r = i >> 1;
        if (kt < KT) {
          const int idx = 2 * mt + r;
          const int k = idx & 3;
          const int dim = g * (D / 32) + (idx >> 2) + (D / 4) * k;
          const int grp = (kNG == 2) ? (dim >= 128) : 0;
          // 2^24 undoes the subnormal code encoding, 4^-k the quarter's bit position.
          const float mn = kMinMma ? accm[grp][1] : mn_run[kt][grp];
          const float o = acc[mt][i] * (16777216.f / float(1 << (2 * k))) + mn;
          co[(warp * kN + 4 * kt + tig) * D + dim] = o;
        }
      }
    __syncthreads();
    const int split = seg.split_offset + sx;
    // Per (warp, head) weight 2^(m_w - m) / l, computed once per head (v11; v10 recomputed the
    // four exp2f, the sum l and a division for every output element). A NaN l (a NaN input of a
    // valid token, or in q̃) makes every weight of the head NaN, so its outputs stay NaN; l = 0
    // (no valid token) makes them 0.
    float* cw = co + kWarps * kN * D;  // [kWarps][kN], inside the ring (larger than the combine)
    if (threadIdx.x < nh) {
      const int h = threadIdx.x;
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, cm[w * kN + h]);
      const float ms = (mx == -INFINITY) ? 0.f : mx;
      float f[kWarps], l = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        f[w] = exp2f(cm[w * kN + h] - ms);
        l += cl[w * kN + h] * f[w];
      }
      const bool nan = isnan(l);
      const float inv_l = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) cw[w * kN + h] = nan ? NAN : f[w] * inv_l;
      const size_t row = (size_t(b) * a.num_q_heads + h_first + h) * a.s_total + split;
      a.part_lse[row] = (overflow || nan) ? NAN : (l > 0.f ? ms + log2f(l) : -INFINITY);
    }
    __syncthreads();
#pragma unroll 1
    for (int idx = threadIdx.x; idx < nh * D; idx += kThreads) {
      const int h = idx / D, dim = idx % D;
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) o = fmaf(co[(w * kN + h) * D + dim], cw[w * kN + h], o);
      const size_t row = (size_t(b) * a.num_q_heads + h_first + h) * a.s_total + split;
      a.part_o[row * D + dim] = o;
    }
    if (item + 1 < n_items) {
      if (threadIdx.x == 0) {
        // Ticket g = q·R2 + p is split q of row R2 + p, p reversed for odd q: each row's splits go
        // to CTAs from every fifth of the finishing order, early and late ones paired. (v19 gave
        // CTA c the fixed second item (R2 + c % R2, c / R2); the rows' ends then followed the mean
        // first-item end of their CTAs: correlation 0.81, rows ending 145-170 µs at B = 32 × 32K.)
        const int r2 = a.items_rows, q = ticket / r2, pp = ticket % r2;
        next_item[0] = r2 + ((q & 1) ? r2 - 1 - pp : pp);
        next_item[1] = q;
        KVPOOL_TL_VALUE(1, 5, next_item[0]);
      }
      // The next item's copies overwrite the combine buffers (generic-proxy accesses) in the ring.
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
    }
  }  // item
  KVPOOL_TL(1, 2);
  // The merge kernel waits for this grid only: make its completion imply the BF16 grid's (behind
  // the BF16 kernel; otherwise the predecessor is QRotateKernel, already waited for). One CTA
  // waiting is enough, as in the BF16 kernel.
  if (IsLastCta()) PdlWait();
}

// q̃[b, i, :] = q[b, i, :]·R_K(kvh) · scale; grid (H_kv, B), 256 threads. Thread t owns column
// j = t % D and the slice of the reduction index i ≡ t / D (mod 256 / D); heads go four at a time
// (a float4 of q per i), so a group of 4 costs 4 FMAs per loaded R element, and the partial sums
// of the slices meet in shared memory. (v3 gave each CTA D threads and computed 16 heads for any
// group: 16.6 µs at B = 32, 8 KV heads, d 128, latency-bound on 8 warps per SM.)
constexpr int kRotThreads = 256;
template <int D>
__global__ void __launch_bounds__(kRotThreads)
    QRotateKernel(const uint16_t* __restrict__ q, const float* __restrict__ rk,
                  int64_t r_head_stride, int num_q_heads, int group, float scale,
                  float* __restrict__ q_rot, int* __restrict__ row_claims, int claims_per_cta) {
  constexpr int kParts = kRotThreads / D;    // slices of the reduction index (1, 2 or 4)
  __shared__ __align__(16) float qs[D][16];  // [i][head]
  __shared__ float red[kParts][4][D];
  PdlLaunchDependents();
  KVPOOL_TL(0, 0);
  const int kvh = blockIdx.x, b = blockIdx.y;
  // The INT2 kernel's claim counters of this (request, KV head), one per head chunk: this kernel
  // runs after the previous launch completed and before any INT2 CTA claims (they claim after
  // their wait for this grid), so a poisoned workspace is fine.
  if (int(threadIdx.x) < claims_per_cta)
    row_claims[kClaimStride * ((size_t(b) * gridDim.x + kvh) * claims_per_cta + threadIdx.x)] = 0;
  // ... and the second items' ticket counter behind them (AttnArgs::item_counter).
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    row_claims[kClaimStride * (size_t(gridDim.y) * gridDim.x * claims_per_cta)] = 0;
  const int j = threadIdx.x % D, part = threadIdx.x / D;
  const size_t row0 = size_t(b) * num_q_heads + size_t(kvh) * group;
  const float* r = rk == nullptr ? nullptr : rk + kvh * r_head_stride;
  // R elements (i = part + kParts·c, j) of this thread, loaded kChunk at a time into registers,
  // all of a chunk before any is used; the first chunk is issued before q is staged, so the R
  // and q loads overlap (v6 let the compiler interleave loads and FMAs: ~5 R loads in flight,
  // a dozen dependent trips to L2/DRAM per CTA, 9.5 µs under ncu at B = 32).
  constexpr int kPer = D / kParts;
  constexpr int kChunk = kPer < 64 ? kPer : 64;
  float rr[kChunk];
  auto load_chunk = [&](int c0) {
#pragma unroll
    for (int c = 0; c < kChunk; ++c) rr[c] = __ldg(r + size_t(part + kParts * (c0 + c)) * D + j);
  };
  if (r != nullptr) load_chunk(0);
  for (int idx = threadIdx.x; idx < 16 * D; idx += kRotThreads) {
    const int h = idx / D, i = idx % D;
    qs[i][h] = h < group ? Bf16BitsToFloat(q[(row0 + h) * D + i]) : 0.f;
  }
  __syncthreads();
  for (int h0 = 0; h0 < group; h0 += 4) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (r == nullptr) {
      if (part == 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = qs[j][h0 + e];
      }
    } else {
#pragma unroll 1
      for (int c0 = 0; c0 < kPer; c0 += kChunk) {
        if (kPer > kChunk && (h0 > 0 || c0 > 0)) load_chunk(c0);
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
          const float4 qv = *reinterpret_cast<const float4*>(&qs[part + kParts * (c0 + c)][h0]);
          acc[0] = fmaf(qv.x, rr[c], acc[0]);
          acc[1] = fmaf(qv.y, rr[c], acc[1]);
          acc[2] = fmaf(qv.z, rr[c], acc[2]);
          acc[3] = fmaf(qv.w, rr[c], acc[3]);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) red[part][e][j] = acc[e];
    __syncthreads();
    if (part == 0) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = 0.f;
#pragma unroll
        for (int pp = 0; pp < kParts; ++pp) x += red[pp][e][j];
        if (h0 + e < group) q_rot[(row0 + h0 + e) * D + j] = x * scale;
      }
    }
    __syncthreads();
  }
  KVPOOL_TL(0, 2);
}

// out[b, i, :] = (LSE-merge over splits of part_o)·R_Vᵀ; grid (H_kv, B), 256 threads:
// warp w merges heads w, w+8 (lanes over splits for the LSE, over head_dim for the output),
// then the warps apply R_Vᵀ row by row (below).
// kFew: the launcher's s_total <= 32 (see the merge loop). Both forms capped at 128 registers,
// as v12's merge (uncapped in one kernel, the two forms took 170 and it was slower at
// B = 32 × 32K, s6).
constexpr int kMergeThreads = 256;
template <int D, bool kFew>
__global__ void __launch_bounds__(kMergeThreads, 2)
    MergeKernel(const float* __restrict__ part_o, const float* __restrict__ part_lse, int s_total,
                const float* __restrict__ rv, int64_t r_head_stride, int num_q_heads, int group,
                uint16_t* __restrict__ out, float* __restrict__ lse_out) {
  // Merged outputs, [head][i]; rows padded by 8 floats so the tensor-core path's float2 B loads
  // (lanes (g, t) at row g, column 8k + 2t) hit 32 distinct banks per half warp.
  constexpr int kOsStride = D + 8;
  __shared__ __align__(16) float os[16][kOsStride];
  KVPOOL_TL(3, 0);
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // out[h][j] = Σ_i os[h][i]·R_V[j][i] (below): warp w takes rows j ≡ w (mod 8), lanes read a row
  // coalesced. A batch of rows (≤ 64 floats per lane) is loaded before any is used (a first
  // version that loaded row by row spent ~25 µs on latency at B = 32 × 8 KV heads), and the first
  // batch before the PDL wait: R_V does not depend on the decode kernels, so its DRAM trip
  // overlaps their tail instead of following it.
  constexpr int kRows = D / (kMergeThreads / 32);              // rows per warp
  constexpr int kBatch = kRows < 2048 / D ? kRows : 2048 / D;  // ≤ 64 floats of R per lane
  const float* r = rv == nullptr ? nullptr : rv + kvh * r_head_stride;
  // d 128 (v21): outᵀ = R_V·osᵀ on tensor cores (mma m16n8k8 tf32, fp32 accumulation): warp w
  // owns output rows j in [16w, 16w + 16) and holds their A fragments (R_V rounded to tf32, 2^-11
  // relative, 4x below the bf16 output's rounding) in ra, loaded before the PDL wait like rr.
  // The reduction index is permuted (fragment column t / t + 4 of k-step k = i 8k + 2t / 8k + 2t +
  // 1) so that a lane's A and B elements are float2 pairs. The FMA + halving-exchange path (v17)
  // took ~2.1 µs after the LSE phase at B = 32 × 32K (s7 timeline); it stays for d 64 / 256.
  constexpr bool kTc = D == 128;
  constexpr int kRa = kTc ? D / 8 : 1;  // k-steps
  const int g = lane >> 2, t = lane & 3;
  uint32_t ra[kRa][4];
  float rr[kTc ? 1 : kBatch][kTc ? 1 : D / 32];
  auto load_batch = [&](int rb) {
    if constexpr (kTc) {
#pragma unroll
      for (int kk = 0; kk < kRa; ++kk) {
        const float2 x =
            __ldg(reinterpret_cast<const float2*>(r + size_t(16 * warp + g) * D + 8 * kk + 2 * t));
        const float2 y = __ldg(
            reinterpret_cast<const float2*>(r + size_t(16 * warp + g + 8) * D + 8 * kk + 2 * t));
        ra[kk][0] = ToTf32(x.x);
        ra[kk][1] = ToTf32(y.x);
        ra[kk][2] = ToTf32(x.y);
        ra[kk][3] = ToTf32(y.y);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kBatch; ++k)
#pragma unroll
        for (int i = 0; i < D / 32; ++i)
          rr[k][i] = __ldg(r + size_t(warp + 8 * (rb + k)) * D + lane + 32 * i);
    }
  };
  if (r != nullptr) load_batch(0);
  for (int idx = threadIdx.x; idx < 16 * kOsStride; idx += kMergeThreads)
    os[idx / kOsStride][idx % kOsStride] = 0.f;
  __syncthreads();
  PdlWait();  // partials of the decode kernels
  KVPOOL_TL(3, 1);
  const size_t row0 = size_t(b) * num_q_heads + size_t(kvh) * group;
  // kFew (at most 32 partials per row; B = 32 × 32K: 6, B = 8 × 128K: 11): a warp loads its
  // first kSc partial outputs together with the LSEs (v12 loaded them after the LSE max, a second
  // dependent L2 trip on the launch's critical path), and lane s holds the weight 2^(lse_s − max)
  // of split s and broadcasts it by a shuffle. Otherwise (B = 1: up to 65 partials) the v12 loop
  // that loads LSE and outputs split by split (the one-trip form measured +1.5 µs at B = 1 × 32K;
  // both forms in one kernel took 170 registers, see the KERNELS.md notes, s6).
  constexpr int kSc = 1024 / D;  // splits per register batch of partial outputs (8 at d 128)
  for (int h = warp; h < group; h += kMergeThreads / 32) {
    const size_t row = row0 + h;
    const float* ls = part_lse + row * s_total;
    const float* po = part_o + row * s_total * D + lane;
    float pv[kSc][D / 32];
    auto load_po = [&](int s0) {
#pragma unroll
      for (int c = 0; c < kSc; ++c)
#pragma unroll
        for (int i = 0; i < D / 32; ++i)
          pv[c][i] = s0 + c < s_total ? po[size_t(s0 + c) * D + 32 * i] : 0.f;
    };
    if constexpr (kFew) load_po(0);
    const float ls_lane = lane < s_total ? ls[lane] : -INFINITY;
    float mx = ls_lane;
    int nan = isnan(ls_lane);
    for (int s = lane + 32; s < s_total; s += 32) {
      const float v = ls[s];
      nan |= isnan(v);
      mx = fmaxf(mx, v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    float l = 0.f;
    float o[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) o[i] = 0.f;
    if (kFew && mx != -INFINITY) {
      const float f_lane = lane < s_total ? exp2f(ls_lane - mx) : 0.f;
      l = f_lane;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
#pragma unroll 1
      for (int s0 = 0; s0 < s_total; s0 += kSc) {
        if (s0 > 0) load_po(s0);
#pragma unroll
        for (int c = 0; c < kSc; ++c) {
          const float fs = __shfl_sync(0xffffffffu, f_lane, (s0 + c) & 31);
          const float f = s0 + c < s_total ? fs : 0.f;  // warp-uniform test
#pragma unroll
          for (int i = 0; i < D / 32; ++i) o[i] = fmaf(f, pv[c][i], o[i]);
        }
      }
    } else if (!kFew && mx != -INFINITY) {
      for (int s = lane; s < s_total; s += 32) l += exp2f(ls[s] - mx);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
#pragma unroll 4
      for (int s = 0; s < s_total; ++s) {
        const float f = exp2f(ls[s] - mx);
#pragma unroll
        for (int i = 0; i < D / 32; ++i) o[i] = fmaf(f, po[size_t(s) * D + 32 * i], o[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < D / 32; ++i) os[h][lane + 32 * i] = nan ? NAN : (l > 0.f ? o[i] / l : 0.f);
    if (lane == 0 && lse_out != nullptr)
      lse_out[row] = nan ? NAN : (l > 0.f ? (mx + log2f(l)) * kLn2 : -INFINITY);
  }
  __syncthreads();
  if (r == nullptr) {
    for (int idx = threadIdx.x; idx < group * D; idx += kMergeThreads) {
      const int h = idx / D, jj = idx % D;
      const __nv_bfloat16 v = __float2bfloat16_rn(os[h][jj]);
      out[(row0 + h) * D + jj] = *reinterpret_cast<const uint16_t*>(&v);
    }
    return;
  }
  KVPOOL_TL(3, 4);
  if constexpr (kTc) {
    for (int nt = 0; nt * 8 < group; ++nt) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < kRa; ++kk) {
        const float2 bv = *reinterpret_cast<const float2*>(&os[8 * nt + g][8 * kk + 2 * t]);
        MmaTf32(c, ra[kk][0], ra[kk][1], ra[kk][2], ra[kk][3], ToTf32(bv.x), ToTf32(bv.y));
      }
      // c[e]: output row j = 16w + g (+8 for e >= 2), head 8nt + 2t + (e & 1).
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = 8 * nt + 2 * t + (e & 1);
        if (h < group) {
          const __nv_bfloat16 bv = __float2bfloat16_rn(c[e]);
          out[(row0 + h) * D + 16 * warp + g + 8 * (e >> 1)] =
              *reinterpret_cast<const uint16_t*>(&bv);
        }
      }
    }
    KVPOOL_TL(3, 2);
    return;
  }
  // Rows are taken in pairs: a lane's 8 products (2 rows × 4 heads) are reduced over the warp by
  // halving exchanges (offset 16: 8 → 4 values per lane, 8: 4 → 2, 4: 2 → 1, then a butterfly
  // over offsets 2 and 1), 9 shuffles per pair where a butterfly per (row, head) took 40 (v17;
  // the merge's shuffles were ~2.6 µs of SM time per launch at B = 32, 8 KV heads). Lane l ends
  // with value 4·bit4(l) + 2·bit3(l) + bit2(l), i.e. row k + bit4, head h0 + 2·bit3 + bit2.
  static_assert(kBatch % 2 == 0, "rows are reduced in pairs");
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
#pragma unroll 1
  for (int rb = 0; rb < kRows; rb += kBatch) {
    if (rb > 0) load_batch(rb);
    for (int h0 = 0; h0 < group; h0 += 4) {
#pragma unroll
      for (int k = 0; k < kBatch; k += 2) {
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          v[e] = 0.f;
#pragma unroll
          for (int i = 0; i < D / 32; ++i)
            v[e] = fmaf(os[h0 + (e & 3)][lane + 32 * i], rr[k + (e >> 2)][i], v[e]);
        }
        float v4[4], v2[2];
#pragma unroll
        for (int q = 0; q < 4; ++q)
          v4[q] = (b4 ? v[4 + q] : v[q]) + __shfl_xor_sync(0xffffffffu, b4 ? v[q] : v[4 + q], 16);
#pragma unroll
        for (int q = 0; q < 2; ++q)
          v2[q] =
              (b3 ? v4[2 + q] : v4[q]) + __shfl_xor_sync(0xffffffffu, b3 ? v4[q] : v4[2 + q], 8);
        float x = (b2 ? v2[1] : v2[0]) + __shfl_xor_sync(0xffffffffu, b2 ? v2[0] : v2[1], 4);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        const int h = h0 + 2 * b3 + b2;
        if ((lane & 3) == 0 && h < group) {
          const int j = warp + 8 * (rb + k + b4);
          const __nv_bfloat16 bv = __float2bfloat16_rn(x);
          out[(row0 + h) * D + j] = *reinterpret_cast<const uint16_t*>(&bv);
        }
      }
    }
  }
  KVPOOL_TL(3, 2);
}

// ---------------------------------------------------------------------------------------------
// Host side: validation, split planning, dispatch.

struct SegPlan {
  int32_t splits = 0;
  int32_t pps = 1;  // pages per split
};

struct Plan {
  int nt = 1;           // BF16 kernel: 8-head n-tiles
  int head_chunks = 1;  // BF16 kernel: CTAs per KV head
  int kt = 1;           // INT2 kernel: 4-head n-tiles (1 or 2)
  int i2_chunks = 1;    // INT2 kernel: CTAs per KV head
  SegPlan sink, history, recent;
  bool fold_sink = false;    // sink CTA folded into the first recent split (FoldSink)
  int dyn_pct = 0;           // INT2: percent of a row's stages fixed before claiming (0: none)
  bool split_major = false;  // INT2: grid (rows, batch, splits)
  int items_rows = 0;        // INT2: > 0 = two (row, split) items per CTA (AttnArgs::items_rows)
  bool wide = false;         // INT2: the 4-CTA form Int2DecodeKernel<128, 1, 4> (v31)
  int sink_parts = 0;        // partials of the sink: 0 when folded
  int s_total = 0;
  size_t off_q = 0, off_o = 0, off_lse = 0, off_claims = 0, total = 0;
};

size_t AlignUp(size_t x) { return (x + 255) & ~size_t(255); }

bool SegmentUsed(const SegmentTable& t) { return t.max_pages > 0; }

KernelStatus Validate(const PagedDecodeParams& p) {
  using E = KernelError;
  auto bad = [](std::string m) { return KernelStatus::Error(E::kInvalidArgument, std::move(m)); };
  if (p.batch < 1 || p.batch > 65535)
    return bad("batch must be in 1..65535, got " + std::to_string(p.batch));
  if (p.num_kv_heads < 1) return bad("num_kv_heads must be >= 1");
  if (p.num_q_heads < 1 || p.num_q_heads % p.num_kv_heads != 0)
    return bad("num_q_heads must be a positive multiple of num_kv_heads");
  const int group = p.num_q_heads / p.num_kv_heads;
  if (group > 16)
    return KernelStatus::Error(
        E::kUnsupported,
        "GQA group (num_q_heads/num_kv_heads) must be 1..16, got " + std::to_string(group));
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return KernelStatus::Error(
        E::kUnsupported, "head_dim must be 64, 128 or 256, got " + std::to_string(p.head_dim));
  if (p.page_size != 16 && p.page_size != 64)
    return KernelStatus::Error(E::kUnsupported,
                               "page_size must be 16 or 64, got " + std::to_string(p.page_size));
  if (!(p.sm_scale > 0.f) || !std::isfinite(p.sm_scale))
    return bad("sm_scale must be finite and > 0");
  if (p.q == nullptr) return bad("q is null");
  // The merge reads R_V rows as float2 pairs (tensor-core path, v21).
  if (reinterpret_cast<uintptr_t>(p.rotation_v) % 8 != 0)
    return bad("rotation_v must be 8-byte aligned");
  if (p.out == nullptr) return bad("out is null");
  BlockGeometry geo{1, uint32_t(p.num_kv_heads), uint32_t(p.head_dim), uint32_t(p.page_size)};
  struct Item {
    const char* name;
    const SegmentTable* t;
    const PagePool* pool;
    uint64_t chunk;
  } items[3] = {{"sink", &p.sink, &p.bf16_pool, geo.Bf16ChunkBytes()},
                {"history", &p.history, &p.int2_pool, geo.Int2ChunkBytes()},
                {"recent", &p.recent, &p.bf16_pool, geo.Bf16ChunkBytes()}};
  for (const Item& it : items) {
    const std::string n = it.name;
    if (it.t->max_pages < 0) return bad(n + ".max_pages must be >= 0");
    if (!SegmentUsed(*it.t)) continue;
    if (it.t->indptr == nullptr) return bad(n + ".indptr is null");
    if (it.t->indices == nullptr) return bad(n + ".indices is null");
    if (it.t->last_page_len == nullptr) return bad(n + ".last_page_len is null");
    const std::string pn = (it.pool == &p.int2_pool) ? "int2_pool" : "bf16_pool";
    if (it.pool->base == nullptr) return bad(pn + ".base is null");
    if (reinterpret_cast<uintptr_t>(it.pool->base) % 16 != 0)
      return bad(pn + ".base must be 16-byte aligned");
    if (it.pool->page_stride_bytes % 16 != 0)
      return bad(pn + ".page_stride_bytes must be a multiple of 16");
    if (it.pool->page_stride_bytes < it.chunk * uint64_t(p.num_kv_heads))
      return bad(pn + ".page_stride_bytes is smaller than one page of all KV heads (" +
                 std::to_string(it.chunk * p.num_kv_heads) + " bytes)");
  }
  return KernelStatus::Ok();
}

// An A/B switch that is on unless the environment sets `name` to "0".
bool EnvOnUnlessZero(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr || std::string(e) != "0";
}

// Whether launches use programmatic dependent launch (PDL): on unless the environment sets
// KVPOOL_DECODE_PDL=0 (kept for A/B measurements). Read once per process.
bool UsePdl() {
  static const bool on = EnvOnUnlessZero("KVPOOL_DECODE_PDL");
  return on;
}

// Launch order of the two decode kernels: the INT2 history kernel first (v6 default: it starts
// while q̃ is being rotated, and the BF16 CTAs fill its last wave), or BF16 sink + recent first
// (the v4/v5 default) with KVPOOL_DECODE_ORDER=bf16. Read once per process.
bool Int2First() {
  static const bool on = [] {
    const char* e = std::getenv("KVPOOL_DECODE_ORDER");
    return e == nullptr || std::string(e) != "bf16";
  }();
  return on;
}

// Fixed cost of one split (one CTA) in 16-token units of streaming work, for the split planner:
// the prologue (q̃ quantization, fragments), the first load's latency, the epilogue (warp
// combine, partial store) and the merge's share; ~2 CTA steps (16 units) by the v6a profile.
// KVPOOL_DECODE_SPLIT_FIXED overrides it (A/B); a negative value selects the v5 rule
// (cost factor 1 + 0.002·s). Read once per process.
double SplitFixedUnits() {
  static const double v = [] {
    const char* e = std::getenv("KVPOOL_DECODE_SPLIT_FIXED");
    return e == nullptr ? 16.0 : std::atof(e);
  }();
  return v;
}

// KVPOOL_DECODE_DYN=P (0..100) forces the INT2 kernel's claimed stages on with P % of each row
// fixed (0: all fixed); unset (-1): the launcher's rule (MakePlan). A/B switch; no effect on
// groups of more than 4 heads per KV head (two n-tiles: no claims compiled). Read once.
int DynClaimsOverride() {
  static const int v = [] {
    const char* e = std::getenv("KVPOOL_DECODE_DYN");
    return e == nullptr ? -1 : std::min(std::max(std::atoi(e), 0), 100);
  }();
  return v;
}

// KVPOOL_DECODE_SPLIT_MAJOR=0/1 forces the INT2 grid's order; unset (-1): the launcher's rule.
int SplitMajorOverride() {
  static const int v = [] {
    const char* e = std::getenv("KVPOOL_DECODE_SPLIT_MAJOR");
    return e == nullptr ? -1 : (std::string(e) == "1" ? 1 : 0);
  }();
  return v;
}

// KVPOOL_DECODE_ITEMS=0/1 forces the INT2 kernel's two-items-per-CTA form off / on (on: for any
// even row count, one n-tile); unset (-1): the launcher's rule (MakePlan). A/B and test switch.
// Read once.
int ItemsOverride() {
  static const int v = [] {
    const char* e = std::getenv("KVPOOL_DECODE_ITEMS");
    return e == nullptr ? -1 : (std::string(e) == "1" ? 1 : 0);
  }();
  return v;
}

// KVPOOL_DECODE_INT2_WIDE=0/1 forces the INT2 kernel's 4-CTA form (v31) off / on (on: wherever
// head_dim is 128 and one n-tile holds the group); unset (-1): the launcher's rule (MakePlan).
// A/B and test switch. Read once.
int Int2WideOverride() {
  static const int v = [] {
    const char* e = std::getenv("KVPOOL_DECODE_INT2_WIDE");
    return e == nullptr ? -1 : (std::string(e) == "1" ? 1 : 0);
  }();
  return v;
}

// Multiprocessors of the current device, queried once per process (132 on the H200).
int NumSms() {
  static const int n = [] {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      sms = 132;
    }
    return sms;
  }();
  return n;
}

// QRotateKernel with the maximum shared-memory carveout when its grid (batch × KV heads CTAs)
// exceeds the SM count (v17 default), like the decode kernels: an SM that runs rotation CTAs then
// keeps the configuration INT2 CTAs need and takes one beside them while q is rotated (one
// launch's timeline at B = 32 × 32K: no INT2 CTA started before the rotation grid had drained,
// 4.1 µs). Smaller grids leave SMs free for the INT2 CTAs anyway (B = 8 × 128K: the first INT2
// CTA started 0.06 µs after the rotation), and B = 1 measured ~1 µs slower with the carveout.
// v24 (s9): also when the INT2 grid is one wave with claimed stages and the rotation grid holds
// more than 3/4 of the SM count (B = 16 × 128K at 8 KV heads: 128 rotation CTAs). Under the
// driver's carveout the rotation CTAs kept their SMs free of INT2 CTAs until they exited, so
// 620 of 640 INT2 CTAs started after the rotation in an order that changes from launch to
// launch, and a row's speed followed the arrival ranks of its CTAs on their SMs (rows ended
// 247-309 µs, rank sums of a row's 5 CTAs 1-17, correlation with the row's end 0.88; with the
// maximum carveout 264-294 µs, 5-13; s9 timelines): 0.3027 vs 0.3135 ms in one call, 0.3094 vs
// 0.3183 in another (B = 14 × 128K, 112 rotation CTAs: level). At
// B = 8 × 128K (64 rotation CTAs, 340 INT2 CTAs dispatched in index order before the rotation
// ends) the maximum was slower, 0.1696 vs 0.1642 ms (the rotation ended at 6.1 instead of
// 3.1 µs, p50), so the rule needs a rotation grid that covers most SMs.
// KVPOOL_DECODE_QROT_CARVEOUT=0 leaves the driver's choice, =1 keeps the v17 rule (grid > SMs),
// =2 asks for the maximum for every grid (A/B switches). Read once per process.
int QRotCarveoutMode() {
  static const int v = [] {
    const char* e = std::getenv("KVPOOL_DECODE_QROT_CARVEOUT");
    return e == nullptr ? -1 : std::min(std::max(std::atoi(e), 0), 2);
  }();
  return v;
}

// History splits forced by KVPOOL_DECODE_HIST_SPLITS (> 0; A/B measurements of the split planner
// only, never needed for correctness: any split count is valid). Read once per process.
int HistSplitsOverride() {
  static const int v = [] {
    const char* e = std::getenv("KVPOOL_DECODE_HIST_SPLITS");
    return e == nullptr ? 0 : std::atoi(e);
  }();
  return v;
}

// Recent-window splits forced by KVPOOL_DECODE_RECENT_SPLITS (> 0; A/B of the BF16 kernel's CTA
// length only, any split count is valid). Read once per process.
int RecentSplitsOverride() {
  static const int v = [] {
    const char* e = std::getenv("KVPOOL_DECODE_RECENT_SPLITS");
    return e == nullptr ? 0 : std::atoi(e);
  }();
  return v;
}

// Whether a one-split sink is folded into the first split of the recent segment (v8 default:
// the first recent CTA of each request and KV head streams the sink's pages before its own,
// instead of a separate sink CTA whose warps hold one 16-token unit each: -5.5 % at
// B = 32 × 32K, where the BF16 CTAs outnumber the slots left beside the INT2 grid; +1 µs at
// B = 1 × 32K, where that CTA becomes the longest of a latency-bound launch; docs/KERNELS.md v8).
// KVPOOL_DECODE_FOLD_SINK=0 keeps separate sink CTAs (A/B). Read once per process.
bool FoldSink() {
  static const bool on = EnvOnUnlessZero("KVPOOL_DECODE_FOLD_SINK");
  return on;
}

// Whether the BF16 kernel loads its page ids in 32-step windows ahead of the copies (v28,
// AttnArgs::pid_window; default on): KVPOOL_DECODE_BF16_PID=0 restores the per-copy load (A/B).
// Read once per process.
bool Bf16PidWindow() {
  static const bool on = EnvOnUnlessZero("KVPOOL_DECODE_BF16_PID");
  return on;
}

// v30 (s14): ring stages the INT2 kernel's first item issues before its wait for q̃
// (AttnArgs::pre_stages). Rule: 1 where the rotation grid holds at most 1/16 of the SMs (8 CTAs
// on the H200: B = 1 at 8 KV heads), i.e. where the launch is a latency chain whose start is q̃:
// its R_K and q loads then queue behind half as many INT2 copies (s14: B = 1 × 32K −1.2 to −1.8 %,
// B = 1 × 128K −1.8 to −2.0 %, every round below main's); 2 elsewhere (B = 8: +0.0 to +0.9 % with
// 1, within the rounds' spread but never a win; B = 32 × 32K +0.1 to +0.2 %).
// KVPOOL_DECODE_INT2_PRE=1/2 forces it (A/B). Read once.
int Int2PreStages(int64_t rot_ctas) {
  static const int env = [] {
    const char* e = std::getenv("KVPOOL_DECODE_INT2_PRE");
    return e == nullptr ? 0 : (std::string(e) == "1" ? 1 : 2);
  }();
  if (env != 0) return env;
  return 16 * rot_ctas <= NumSms() ? 1 : 2;
}

// Launches `kernel` on `stream`, with the PDL attribute when `pdl` (the kernel may then start
// before its predecessor in the stream finished; it synchronizes with griddepcontrol.wait).
template <typename Kernel, typename... Args>
cudaError_t Launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                   Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = (pdl && UsePdl()) ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

template <typename Kernel>
int ResidentCtas(Kernel kernel, int smem) {
  int n = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem) != cudaSuccess) {
    cudaGetLastError();
    n = 1;
  }
  return std::max(n, 1);
}

// Resident CTAs of a decode kernel on the current device: occupancy × multiprocessors, computed
// once per process (host calls only, no device sync). int2: `tiles` = KT (4-head n-tiles);
// bf16: `tiles` = NT (8-head n-tiles). wide: the INT2 kernel's 4-CTA form (d 128, KT 1 only).
int DecodeSlots(bool int2, int d, int tiles, bool wide = false) {
  static std::atomic<int> cache[3][3][2] = {};
  const int di = d == 64 ? 0 : (d == 128 ? 1 : 2);
  std::atomic<int>& c = cache[int2 ? (wide ? 2 : 1) : 0][di][tiles - 1];
  int v = c.load(std::memory_order_relaxed);
  if (v > 0) return v;
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    cudaGetLastError();
    sms = 132;
  }
  int per_sm = 1;
  if (int2 && wide) {
    per_sm = ResidentCtas(Int2DecodeKernel<128, 1, 4>, Int2SmemBytes<128, 1>());
  } else if (int2) {
    per_sm = d == 64 ? (tiles == 2 ? ResidentCtas(Int2DecodeKernel<64, 2>, Int2SmemBytes<64, 2>())
                                   : ResidentCtas(Int2DecodeKernel<64, 1>, Int2SmemBytes<64, 1>()))
             : d == 128
                 ? (tiles == 2 ? ResidentCtas(Int2DecodeKernel<128, 2>, Int2SmemBytes<128, 2>())
                               : ResidentCtas(Int2DecodeKernel<128, 1>, Int2SmemBytes<128, 1>()))
                 : (tiles == 2 ? ResidentCtas(Int2DecodeKernel<256, 2>, Int2SmemBytes<256, 2>())
                               : ResidentCtas(Int2DecodeKernel<256, 1>, Int2SmemBytes<256, 1>()));
  } else {
    per_sm = d == 64 ? (tiles == 2 ? ResidentCtas(Bf16DecodeKernel<64, 2>, Bf16SmemBytes<64, 2>())
                                   : ResidentCtas(Bf16DecodeKernel<64, 1>, Bf16SmemBytes<64, 1>()))
             : d == 128
                 ? (tiles == 2 ? ResidentCtas(Bf16DecodeKernel<128, 2>, Bf16SmemBytes<128, 2>())
                               : ResidentCtas(Bf16DecodeKernel<128, 1>, Bf16SmemBytes<128, 1>()))
                 : ResidentCtas(Bf16DecodeKernel<256, 1>, Bf16SmemBytes<256, 1>());
  }
  v = per_sm * sms;
  c.store(v, std::memory_order_relaxed);
  return v;
}

// Splits of one segment. With base = batch·KV heads·head chunks CTAs per split and `slots`
// resident CTAs, the decode takes ⌈base·s / slots⌉ waves, each CTA streaming U/s units (U = the
// longest request's 16-token units) plus a fixed cost F (SplitFixedUnits), so s minimizes
// ⌈base·s / slots⌉ · (U/s + F), with at least `min_pps` pages per split. (A plain "one wave"
// rule, s = ⌊slots / base⌋, left 22 % of the slots idle at B = 32, 8 KV heads on the H200; the v5
// rule, F = 0.002·U, chose 18 splits = 7 waves of short CTAs at B = 32 × 32K, where the CTAs'
// fixed work was ~12 % of the INT2 kernel's instructions.)
SegPlan PlanSegment(const SegmentTable& t, int page_size, int64_t base_ctas, int64_t slots) {
  SegPlan sp;
  if (!SegmentUsed(t)) return sp;
  const int min_pps = page_size == 16 ? 16 : 4;  // >= 2 steps per warp
  const int64_t max_splits =
      std::min<int64_t>(64, std::max<int64_t>(1, (t.max_pages + min_pps - 1) / min_pps));
  const double units = double(t.max_pages) * (page_size / 16);
  const double fixed = SplitFixedUnits() >= 0 ? SplitFixedUnits() : -1.0;
  double best_cost = 1e30;
  int64_t best = 1;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const double waves = double((base_ctas * s + slots - 1) / slots);
    const double cost = fixed >= 0 ? waves * (units / double(s) + fixed)
                                   : waves / double(s) * (1.0 + 0.002 * double(s));
    if (cost < best_cost) {
      best_cost = cost;
      best = s;
    }
  }
  sp.pps = int32_t((t.max_pages + best - 1) / best);
  sp.splits = int32_t((t.max_pages + sp.pps - 1) / sp.pps);
  return sp;
}

// The history segment's splits and INT2 work distribution for `slots` resident INT2 CTAs (sets
// plan->history, dyn_pct, split_major, items_rows; plan->kt must be set). Returns the waves of
// CTAs the plan takes (⌈CTAs / slots⌉, 0 without history splits; the v31 rule reads it).
int64_t PlanHistory(const PagedDecodeParams& p, int64_t base_i2, int64_t slots_i2, Plan* plan) {
  plan->history = PlanSegment(p.history, p.page_size, base_i2, slots_i2);
  if (HistSplitsOverride() > 0 && plan->history.splits > 0) {  // A/B of the split planner only
    const int64_t want = std::min<int64_t>(HistSplitsOverride(), p.history.max_pages);
    plan->history.pps = int32_t((p.history.max_pages + want - 1) / want);
    plan->history.splits =
        int32_t((p.history.max_pages + plan->history.pps - 1) / plan->history.pps);
  }
  plan->dyn_pct = 0;
  plan->split_major = false;
  plan->items_rows = 0;
  int64_t waves = 0;
  // INT2 work distribution (v18, v20). When the INT2 grid is one wave (every CTA resident at
  // once), a CTA holds one n-tile and a warp has >= 32 stages, the last quarter of each row is
  // claimed at run time and the grid is ordered split-major, so the splits of a row sit at
  // different arrival ranks of their SMs and share the row's end (B = 8 × 128K: 0.1664-0.1670 ms vs
  // 0.1710-0.1713 static, same call). Grids of several waves keep static stages in row-major order
  // (B = 32 × 32K, 2 waves: claimed stages were 1.2-2.5 % slower, the split-major order lets a
  // row's late splits start a wave later); B = 1 has 2 stages per warp, where claims only add the
  // atomic's latency.
  if (plan->history.splits > 0) {
    const int64_t ctas = base_i2 * plan->history.splits;
    const int64_t units = int64_t(p.history.max_pages) * (p.page_size / 16);
    const int64_t stages_per_warp = units / (int64_t(plan->history.splits) * kWarps * 4);
    // v20 (s7, same call): claims only with one n-tile and >= 32 stages per warp. B = 8 × 32K
    // (12.7 stages) ran 0.0648 ms with claims vs 0.0622 static; 64 q / 8 KV (KT = 2) 0.0765 vs
    // 0.0705 at B = 8 and 0.2143 vs 0.2088 at B = 32 (63 stages); B = 8 × 128K (51 stages)
    // 0.1676-0.1681 vs 0.1736-0.1743.
    const bool claim = plan->kt == 1 && ctas <= slots_i2 && stages_per_warp >= 32;
    waves = (ctas + slots_i2 - 1) / slots_i2;
    plan->dyn_pct = DynClaimsOverride() >= 0 ? DynClaimsOverride() : (claim ? 75 : 0);
    plan->split_major = SplitMajorOverride() >= 0 ? SplitMajorOverride() == 1 : claim;
    // v19: a grid of two waves or less whose rows are even in number runs as one resident wave of
    // CTAs that take two (row, split) items each, static first, then claimed and split-major (the
    // one-wave balance of v18 for the second half of the rows). B = 32 × 32K: 1280 CTAs on 660
    // slots become 640 CTAs of two items.
    const int64_t rows = base_i2;
    bool items = ctas > slots_i2 && rows % 2 == 0 && ctas / 2 <= slots_i2 && stages_per_warp >= 8;
    if (ItemsOverride() >= 0) items = ItemsOverride() == 1 && rows % 2 == 0;
    if (plan->kt != 1) {  // the KT = 2 instantiation has neither (Int2DecodeKernel, kDyn)
      items = false;
      plan->dyn_pct = 0;
    }
    if (items) {
      plan->items_rows = int(rows / 2);
      plan->dyn_pct = DynClaimsOverride() >= 0 ? DynClaimsOverride() : 50;
      plan->split_major = false;
    }
  }
  return waves;
}

KernelStatus MakePlan(const PagedDecodeParams& p, Plan* plan) {
  KernelStatus st = Validate(p);
  if (!st.ok()) return st;
  const int group = p.num_q_heads / p.num_kv_heads;
  plan->nt = (group > 8 && p.head_dim <= 128) ? 2 : 1;
  plan->head_chunks = (group + 8 * plan->nt - 1) / (8 * plan->nt);
  plan->kt = group <= 4 ? 1 : 2;
  plan->i2_chunks = (group + 4 * plan->kt - 1) / (4 * plan->kt);
  int64_t slots_i2, slots_bf;
  if (p.target_ctas > 0) {
    slots_i2 = slots_bf = p.target_ctas;
  } else {
    slots_i2 = DecodeSlots(true, p.head_dim, plan->kt);
    slots_bf = DecodeSlots(false, p.head_dim, plan->nt);
  }
  const int64_t base = int64_t(p.batch) * p.num_kv_heads * plan->head_chunks;
  const int64_t base_i2 = int64_t(p.batch) * p.num_kv_heads * plan->i2_chunks;
  // Sink and recent share one launch: plan them as one segment's worth of slots.
  plan->sink = PlanSegment(p.sink, p.page_size, base, slots_bf);
  plan->recent = PlanSegment(p.recent, p.page_size, base, slots_bf);
  if (RecentSplitsOverride() > 0 && plan->recent.splits > 0) {  // A/B only
    const int64_t want = std::min<int64_t>(RecentSplitsOverride(), p.recent.max_pages);
    plan->recent.pps = int32_t((p.recent.max_pages + want - 1) / want);
    plan->recent.splits = int32_t((p.recent.max_pages + plan->recent.pps - 1) / plan->recent.pps);
  }
  // v31: the 4-CTA form of the INT2 kernel (d 128, one n-tile, page 16) where the 5-CTA plan
  // takes 2 to 5 waves, with the history re-planned for its 528 slots (s17 call 1, alternating
  // rounds, ratio to v30: B = 32 × 32K 0.9887 (2 waves → one wave of 2 splits with claims),
  // B = 32 × 4K 0.955 (2 waves), B = 128 × 4K 0.963 (5 waves → two-item CTAs); it lost at 11
  // waves (B = 128 × 32K 1.007), in one-wave plans (B = 16 × 128K 1.007, B = 8 × 32K 1.014,
  // B = 1 × 32K 1.064; B = 8 × 128K 0.998, B = 1 × 128K 0.933 won) and at page 64 (1.060).
  // KVPOOL_DECODE_INT2_WIDE=0/1 forces it off / on (on: wherever d 128 and KT 1).
  const int64_t waves = PlanHistory(p, base_i2, slots_i2, plan);
  const bool wide_ok = p.head_dim == 128 && plan->kt == 1 && plan->history.splits > 0;
  const bool wide =
      wide_ok && (Int2WideOverride() >= 0 ? Int2WideOverride() == 1
                                          : p.page_size == 16 && waves >= 2 && waves <= 5);
  if (wide) {
    plan->wide = true;
    PlanHistory(p, base_i2, p.target_ctas > 0 ? p.target_ctas : DecodeSlots(true, 128, 1, true),
                plan);
  }
  plan->fold_sink = FoldSink() && plan->sink.splits == 1 && plan->recent.splits >= 1;
  plan->sink_parts = plan->fold_sink ? 0 : plan->sink.splits;
  plan->s_total = plan->sink_parts + plan->history.splits + plan->recent.splits;
  const size_t rows = size_t(p.batch) * p.num_q_heads;
  plan->off_q = 0;
  plan->off_o = AlignUp(rows * p.head_dim * sizeof(float));
  plan->off_lse = plan->off_o + AlignUp(rows * plan->s_total * p.head_dim * sizeof(float));
  plan->off_claims = plan->off_lse + AlignUp(rows * plan->s_total * sizeof(float));
  // One claim counter per history row, then the second items' ticket counter.
  plan->total =
      plan->off_claims + AlignUp((size_t(p.batch) * p.num_kv_heads * plan->i2_chunks + 1) *
                                 kClaimStride * sizeof(int32_t));
  return KernelStatus::Ok();
}

KernelStatus LaunchError(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return KernelStatus::Ok();
  return KernelStatus::Error(KernelError::kLaunchFailed,
                             std::string(what) + ": " + cudaGetErrorString(e));
}

template <int D, int NT>
KernelStatus LaunchBf16Kernel(const AttnArgs& args, dim3 grid, cudaStream_t stream, bool pdl) {
  constexpr int smem = Bf16SmemBytes<D, NT>();
  auto kernel = Bf16DecodeKernel<D, NT>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) != cudaSuccess)
    return LaunchError("cudaFuncSetAttribute(Bf16DecodeKernel)");
  if (Launch(kernel, grid, dim3(kThreads), smem, stream, pdl, args) != cudaSuccess)
    return LaunchError("Bf16DecodeKernel");
  return LaunchError("Bf16DecodeKernel");
}
template <int D, int KT, int kCtas = Int2DefaultCtas<D, KT>()>
KernelStatus LaunchInt2Kernel(const AttnArgs& args, dim3 grid, cudaStream_t stream) {
  constexpr int smem = Int2SmemBytes<D, KT>();
  auto kernel = Int2DecodeKernel<D, KT, kCtas>;
  // Full shared-memory carveout for both decode kernels, so that the SM configuration an INT2
  // grid leaves behind has room for BF16 CTAs beside it (the driver may otherwise pick a smaller
  // carveout that just fits 5 INT2 CTAs).
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) != cudaSuccess)
    return LaunchError("cudaFuncSetAttribute(Int2DecodeKernel)");
  if (Launch(kernel, grid, dim3(kThreads), smem, stream, true, args) != cudaSuccess)
    return LaunchError("Int2DecodeKernel");
  return LaunchError("Int2DecodeKernel");
}

KernelStatus DispatchBf16(int d, int nt, const AttnArgs& args, dim3 grid, cudaStream_t stream,
                          bool pdl) {
  if (d == 64)
    return nt == 2 ? LaunchBf16Kernel<64, 2>(args, grid, stream, pdl)
                   : LaunchBf16Kernel<64, 1>(args, grid, stream, pdl);
  if (d == 128)
    return nt == 2 ? LaunchBf16Kernel<128, 2>(args, grid, stream, pdl)
                   : LaunchBf16Kernel<128, 1>(args, grid, stream, pdl);
  return LaunchBf16Kernel<256, 1>(args, grid, stream, pdl);
}
KernelStatus DispatchInt2(int d, int kt, bool wide, const AttnArgs& args, dim3 grid,
                          cudaStream_t stream) {
  if (wide) return LaunchInt2Kernel<128, 1, 4>(args, grid, stream);  // MakePlan: d 128, KT 1
  if (d == 64)
    return kt == 2 ? LaunchInt2Kernel<64, 2>(args, grid, stream)
                   : LaunchInt2Kernel<64, 1>(args, grid, stream);
  if (d == 128)
    return kt == 2 ? LaunchInt2Kernel<128, 2>(args, grid, stream)
                   : LaunchInt2Kernel<128, 1>(args, grid, stream);
  return kt == 2 ? LaunchInt2Kernel<256, 2>(args, grid, stream)
                 : LaunchInt2Kernel<256, 1>(args, grid, stream);
}

SegArgs MakeSeg(const SegmentTable& t, const PagePool& pool, const SegPlan& sp, int offset) {
  SegArgs s{};
  if (sp.splits > 0) {
    s.indptr = t.indptr;
    s.indices = t.indices;
    s.last_len = t.last_page_len;
    s.base = static_cast<const uint8_t*>(pool.base);
    s.page_stride = pool.page_stride_bytes;
  }
  s.num_splits = sp.splits;
  s.pages_per_split = sp.pps;
  s.split_offset = offset;
  return s;
}

}  // namespace
}  // namespace detail

const char* KernelErrorName(KernelError code) {
  switch (code) {
    case KernelError::kOk:
      return "ok";
    case KernelError::kInvalidArgument:
      return "invalid_argument";
    case KernelError::kUnsupported:
      return "unsupported";
    case KernelError::kWorkspaceTooSmall:
      return "workspace_too_small";
    case KernelError::kLaunchFailed:
      return "launch_failed";
  }
  return "unknown";
}

KernelStatus PagedDecodeWorkspaceBytes(const PagedDecodeParams& params, size_t* bytes) {
  if (bytes == nullptr)
    return KernelStatus::Error(KernelError::kInvalidArgument, "bytes (output pointer) is null");
  detail::Plan plan;
  KernelStatus st = detail::MakePlan(params, &plan);
  if (!st.ok()) return st;
  *bytes = plan.total;
  return KernelStatus::Ok();
}

KernelStatus LaunchPagedDecode(const PagedDecodeParams& p, Stream stream_handle) {
  using namespace detail;
  Plan plan;
  KernelStatus st = MakePlan(p, &plan);
  if (!st.ok()) return st;
#ifdef KVPOOL_DECODE_TIMELINE
  {  // instrumented builds only: a zeroed stamp buffer for this launch (synchronizes: not for
     // timing)
    static unsigned long long* buf = nullptr;
    const size_t n =
        size_t(4) * detail::kTlMaxCtas * detail::kTlFields * sizeof(unsigned long long);
    if (buf == nullptr) {
      if (cudaMalloc(&buf, n) != cudaSuccess ||
          cudaMemcpyToSymbol(detail::g_tl, &buf, sizeof(buf)) != cudaSuccess)
        return KernelStatus::Error(KernelError::kLaunchFailed, "timeline buffer");
    }
    cudaMemsetAsync(buf, 0, n, reinterpret_cast<cudaStream_t>(stream_handle));
  }
#endif
  if (p.workspace == nullptr || reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0)
    return KernelStatus::Error(KernelError::kInvalidArgument,
                               "workspace must be non-null and 256-byte aligned");
  if (p.workspace_bytes < plan.total)
    return KernelStatus::Error(KernelError::kWorkspaceTooSmall,
                               "workspace_bytes " + std::to_string(p.workspace_bytes) + " < " +
                                   std::to_string(plan.total) + " needed");
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  cudaGetLastError();  // clear stale errors so they are not blamed on these launches
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  float* q_rot = reinterpret_cast<float*>(ws + plan.off_q);
  float* part_o = reinterpret_cast<float*>(ws + plan.off_o);
  float* part_lse = reinterpret_cast<float*>(ws + plan.off_lse);
  int* row_claims = reinterpret_cast<int*>(ws + plan.off_claims);
  const int d = p.head_dim;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t rstride = p.rotation_per_head ? int64_t(d) * d : 0;
  const dim3 hb(p.num_kv_heads, p.batch);
  const float qscale = p.sm_scale * kLog2e;
  {
    // The rotation grid gets the maximum shared-memory carveout when it holds more CTAs than
    // there are SMs, or more than 3/4 of them while the INT2 grid is one wave that claims stages
    // (QRotCarveoutMode); the attribute is host-side state, set only when it changes.
    static std::atomic<int> state[3] = {};  // 0 unset, 1 maximum, 2 driver default
    const int64_t rot_ctas = int64_t(p.num_kv_heads) * p.batch;
    const bool big = rot_ctas > NumSms();
    const bool wide_claims =
        plan.dyn_pct > 0 && plan.items_rows == 0 && 4 * rot_ctas > 3 * NumSms();
    const int mode = QRotCarveoutMode();
    const bool max_co = mode == 2 || (mode == 1 && big) || (mode < 0 && (big || wide_claims));
    const int want = max_co ? 1 : 2;
    std::atomic<int>& cur = state[d == 64 ? 0 : (d == 128 ? 1 : 2)];
    if (cur.load(std::memory_order_relaxed) != want) {
      const int v = want == 1 ? int(cudaSharedmemCarveoutMaxShared) : -1;  // -1: no preference
      const cudaFuncAttribute at = cudaFuncAttributePreferredSharedMemoryCarveout;
      const cudaError_t e = d == 64    ? cudaFuncSetAttribute(QRotateKernel<64>, at, v)
                            : d == 128 ? cudaFuncSetAttribute(QRotateKernel<128>, at, v)
                                       : cudaFuncSetAttribute(QRotateKernel<256>, at, v);
      if (e != cudaSuccess) return LaunchError("cudaFuncSetAttribute(QRotateKernel)");
      cur.store(want, std::memory_order_relaxed);
    }
  }
  if (d == 64)
    QRotateKernel<64><<<hb, kRotThreads, 0, stream>>>(p.q, p.rotation_k, rstride, p.num_q_heads,
                                                      group, qscale, q_rot, row_claims,
                                                      plan.i2_chunks);
  else if (d == 128)
    QRotateKernel<128><<<hb, kRotThreads, 0, stream>>>(p.q, p.rotation_k, rstride, p.num_q_heads,
                                                       group, qscale, q_rot, row_claims,
                                                       plan.i2_chunks);
  else
    QRotateKernel<256><<<hb, kRotThreads, 0, stream>>>(p.q, p.rotation_k, rstride, p.num_q_heads,
                                                       group, qscale, q_rot, row_claims,
                                                       plan.i2_chunks);
  st = LaunchError("QRotateKernel");
  if (!st.ok()) return st;

  // Order (v6 default): the INT2 history kernel right after QRotateKernel (it issues its first
  // copies, then waits for q̃), the BF16 sink + recent kernel behind it (filling the INT2 grid's
  // last wave), then the merge (docs/KERNELS.md). KVPOOL_DECODE_ORDER=bf16 swaps the two decode
  // kernels back (the v4 order).
  AttnArgs args{};
  args.num_q_heads = p.num_q_heads;
  args.group = group;
  args.page_size = p.page_size;
  args.s_total = plan.s_total;
  args.q_rot = q_rot;
  args.part_o = part_o;
  args.part_lse = part_lse;
  const bool has_bf16 = plan.sink.splits + plan.recent.splits > 0;
  const bool has_int2 = plan.history.splits > 0;
  const bool int2_first = has_bf16 && has_int2 && Int2First();
  auto launch_bf16 = [&]() {
    AttnArgs ab = args;
    ab.head_chunks = plan.head_chunks;
    ab.pdl_wait_first = !int2_first;
    ab.fold_sink = plan.fold_sink;
    ab.pid_window = Bf16PidWindow();
    ab.seg0 = MakeSeg(p.sink, p.bf16_pool, plan.sink, 0);
    ab.seg1 = MakeSeg(p.recent, p.bf16_pool, plan.recent, plan.sink_parts + plan.history.splits);
    return DispatchBf16(
        d, plan.nt, ab,
        dim3(plan.sink_parts + plan.recent.splits, p.num_kv_heads * plan.head_chunks, p.batch),
        stream, true);
  };
  auto launch_int2 = [&]() {
    AttnArgs ai = args;
    ai.head_chunks = plan.i2_chunks;
    ai.pdl_wait_first = int2_first || !has_bf16;
    ai.seg0 = MakeSeg(p.history, p.int2_pool, plan.history, plan.sink_parts);
    ai.seg1 = SegArgs{};
    ai.row_claims = row_claims;
    ai.dyn_claims = plan.dyn_pct;
    ai.split_major = plan.split_major;
    ai.items_rows = plan.items_rows;
    ai.pre_stages = Int2PreStages(int64_t(p.num_kv_heads) * p.batch);
    const int rows_per_req = p.num_kv_heads * plan.i2_chunks;
    ai.item_counter = row_claims + kClaimStride * (size_t(p.batch) * rows_per_req);
    const dim3 grid = plan.items_rows > 0
                          ? dim3(unsigned(plan.items_rows) * unsigned(plan.history.splits))
                      : ai.split_major ? dim3(rows_per_req, p.batch, plan.history.splits)
                                       : dim3(plan.history.splits, rows_per_req, p.batch);
    return DispatchInt2(d, plan.kt, plan.wide, ai, grid, stream);
  };
  if (int2_first) {
    st = launch_int2();
    if (!st.ok()) return st;
    st = launch_bf16();
    if (!st.ok()) return st;
  } else {
    if (has_bf16) {
      st = launch_bf16();
      if (!st.ok()) return st;
    }
    if (has_int2) {
      st = launch_int2();
      if (!st.ok()) return st;
    }
  }
  // Rows of at most 32 partials take the one-L2-trip merge (its own instantiation, so each form
  // keeps its own register allocation).
  const bool few = plan.s_total <= 32;
  auto merge = [&](auto kernel) {
    return Launch(kernel, hb, dim3(kMergeThreads), 0, stream, true, (const float*)part_o,
                  (const float*)part_lse, plan.s_total, p.rotation_v, rstride, p.num_q_heads, group,
                  p.out, p.lse);
  };
  cudaError_t e;
  if (d == 64)
    e = few ? merge(MergeKernel<64, true>) : merge(MergeKernel<64, false>);
  else if (d == 128)
    e = few ? merge(MergeKernel<128, true>) : merge(MergeKernel<128, false>);
  else
    e = few ? merge(MergeKernel<256, true>) : merge(MergeKernel<256, false>);
  if (e != cudaSuccess) return LaunchError("MergeKernel");
  return LaunchError("MergeKernel");
}

}  // namespace kvpool::cuda

#ifdef KVPOOL_DECODE_TIMELINE
// Appends the stamps of the last launch to the file named by $KVPOOL_DECODE_TIMELINE (one line
// per CTA: kernel, cta, sm, entry, after-wait, end, field 4 in ns from the first QRotate entry
// (-1 = not stamped), field 5 as stored), under a "# tag" line. Synchronizes the device.
// Instrumented builds only.
extern "C" void KvpoolDecodeTimelineDump(const char* tag) {
  using namespace kvpool::cuda::detail;
  const char* path = std::getenv("KVPOOL_DECODE_TIMELINE");
  if (path == nullptr) return;
  unsigned long long* dev = nullptr;
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(&dev, g_tl, sizeof(dev)) != cudaSuccess || dev == nullptr)
    return;
  std::vector<unsigned long long> h(size_t(4) * kTlMaxCtas * kTlFields);
  if (cudaMemcpy(h.data(), dev, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost) != cudaSuccess)
    return;
  unsigned long long t_min = ~0ull;
  for (size_t i = 0; i < h.size(); i += kTlFields)
    if (h[i] != 0) t_min = std::min(t_min, h[i]);
  FILE* f = std::fopen(path, "a");
  if (f == nullptr) return;
  std::fprintf(f, "# %s\n", tag);
  for (int k = 0; k < 4; ++k)
    for (int c = 0; c < kTlMaxCtas; ++c) {
      const unsigned long long* r = &h[(size_t(k) * kTlMaxCtas + c) * kTlFields];
      if (r[0] == 0) continue;
      auto rel = [&](unsigned long long t) { return t == 0 ? -1.0 : double(t - t_min); };
      std::fprintf(f, "%d %d %llu %.0f %.0f %.0f %.0f %llu\n", k, c, r[3], rel(r[0]), rel(r[1]),
                   rel(r[2]), rel(r[4]), r[5]);
    }
  std::fclose(f);
}
#endif
