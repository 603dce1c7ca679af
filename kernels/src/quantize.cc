// Scalar OSCAR quantizer and the run-time dispatch (see kvpool/kernels/quantize.h).
#include "kvpool/kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/numeric.h"
#include "quantize_internal.h"

namespace kvpool {

bool CpuHasAvx2() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

KernelIsa ResolveIsa(KernelIsa isa) {
  if (isa == KernelIsa::kScalar) return KernelIsa::kScalar;
  return CpuHasAvx2() ? KernelIsa::kAvx2 : KernelIsa::kScalar;
}

const char* IsaName(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAuto:
      return "auto";
    case KernelIsa::kScalar:
      return "scalar";
    case KernelIsa::kAvx2:
      return "avx2";
  }
  return "unknown";
}

absl::Status ValidateHeadDim(uint32_t head_dim, const char* field) {
  if (head_dim < 8 || head_dim > kMaxHeadDim || (head_dim & (head_dim - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be a power of two in [8, ", kMaxHeadDim, "], got ", head_dim));
  }
  return absl::OkStatus();
}

absl::Status ValidateClipRatio(float ratio, const char* field) {
  if (!(ratio >= 0.0f && ratio <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be 0 (disabled) or in (0, 1], got ", ratio));
  }
  return absl::OkStatus();
}

uint32_t ClipIndex(float ratio, uint32_t d) {
  double v = std::floor(static_cast<double>(ratio) * static_cast<double>(d));
  if (v < 0) v = 0;
  if (v > d - 1) v = d - 1;
  return static_cast<uint32_t>(v);
}

float ClipThreshold(const float* x, uint32_t d, float ratio, KernelIsa isa) {
  if (!(ratio > 0.0f)) return INFINITY;
  if (ResolveIsa(isa) == KernelIsa::kAvx2) return internal::ClipThresholdAvx2(x, d, ratio);
  std::vector<float> mag(d);
  for (uint32_t j = 0; j < d; ++j) mag[j] = std::fabs(x[j]);
  return internal::KthLargest(mag.data(), d, d - ClipIndex(ratio, d));
}

namespace internal {

float KthLargest(float* a, uint32_t d, uint32_t k) {
  if (k <= 32) {
    // Sorted (descending) top-k insertion; the k-th largest is a value of the multiset, so
    // every selection algorithm returns the same number.
    float top[33];
    uint32_t c = 0;
    for (uint32_t j = 0; j < d; ++j) {
      const float v = a[j];
      if (c == k && !(v > top[k - 1])) continue;
      uint32_t pos = c < k ? c : k - 1;
      while (pos > 0 && top[pos - 1] < v) {
        top[pos] = top[pos - 1];
        --pos;
      }
      top[pos] = v;
      if (c < k) ++c;
    }
    return top[k - 1];
  }
  std::nth_element(a, a + (d - k), a + d);
  return a[d - k];
}

namespace {

inline float Fp16Bits(uint16_t h) { return Fp16ToFp32(h); }

}  // namespace

RowQuantStatus QuantizeRowScalar(const float* x, uint32_t d, float ratio, uint8_t* codes,
                                 uint16_t* params) {
  const uint32_t G = std::min<uint32_t>(d, 128);
  const uint32_t ng = d / G;
  float mag[kMaxHeadDim];
  for (uint32_t j = 0; j < d; ++j) {
    if (!std::isfinite(x[j])) {
      std::fill(codes, codes + d / 4, 0);
      std::fill(params, params + 2 * ng, 0);
      return RowQuantStatus::kNonFinite;
    }
    mag[j] = std::fabs(x[j]);
  }
  float tau = INFINITY;
  if (ratio > 0.0f) tau = KthLargest(mag, d, d - ClipIndex(ratio, d));
  float xc[kMaxHeadDim];
  for (uint32_t j = 0; j < d; ++j) xc[j] = std::min(std::max(x[j], -tau), tau);

  uint8_t code[kMaxHeadDim];
  for (uint32_t g = 0; g < ng; ++g) {
    const float* v = xc + g * G;
    float mn = v[0], mx = v[0];
    for (uint32_t j = 1; j < G; ++j) {
      mn = std::min(mn, v[j]);
      mx = std::max(mx, v[j]);
    }
    mn += 0.0f;  // -0 -> +0 (both paths store the same mn16 bits)
    mx += 0.0f;
    const uint16_t mn16 = Fp32ToFp16(mn, RoundMode::kDown);
    uint16_t scale16 = 0;
    if (mx > kFp16Max || Fp16IsNonFinite(mn16)) {
      std::fill(codes, codes + d / 4, 0);
      std::fill(params, params + 2 * ng, 0);
      return RowQuantStatus::kFp16Overflow;
    }
    const float mn16f = Fp16Bits(mn16);
    if (mx != mn) {
      const float s = (mx - mn16f) / 3.0f;
      scale16 = Fp32ToFp16(s, RoundMode::kUp);
      if (Fp16IsNonFinite(scale16)) {
        std::fill(codes, codes + d / 4, 0);
        std::fill(params, params + 2 * ng, 0);
        return RowQuantStatus::kFp16Overflow;
      }
    }
    params[2 * g] = scale16;
    params[2 * g + 1] = mn16;
    uint8_t* c = code + g * G;
    if (scale16 == 0) {
      std::fill(c, c + G, 0);
      continue;
    }
    const float sc = Fp16Bits(scale16);
    for (uint32_t j = 0; j < G; ++j) {
      const float t = (v[j] - mn16f) / sc;
      const float fl = std::floor(t);
      float q = fl + ((t - fl) >= 0.5f ? 1.0f : 0.0f);
      q = std::min(std::max(q, 0.0f), 3.0f);
      c[j] = static_cast<uint8_t>(q);
    }
  }
  PackCodes(code, d, codes);
  return RowQuantStatus::kOk;
}

void RotateRowsScalar(const float* x, uint64_t n, uint32_t d, const float* rotation, float* out) {
  for (uint64_t r = 0; r < n; ++r) {
    const float* xr = x + r * d;
    float* o = out + r * d;
    std::fill(o, o + d, 0.0f);
    for (uint32_t i = 0; i < d; ++i) {
      const float xi = xr[i];
      const float* row = rotation + static_cast<uint64_t>(i) * d;
      for (uint32_t j = 0; j < d; ++j) o[j] = std::fma(xi, row[j], o[j]);
    }
  }
}

}  // namespace internal

RowQuantStatus QuantizeRow(const float* x, uint32_t d, float ratio, uint8_t* codes,
                           uint16_t* params, KernelIsa isa) {
  if (ResolveIsa(isa) == KernelIsa::kAvx2) {
    return internal::QuantizeRowAvx2(x, d, ratio, codes, params);
  }
  return internal::QuantizeRowScalar(x, d, ratio, codes, params);
}

namespace {

absl::Status NonFiniteError(const float* row, uint64_t r, uint32_t d) {
  for (uint32_t j = 0; j < d; ++j) {
    if (!std::isfinite(row[j])) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", r, " element ", j, " is ",
                       std::isnan(row[j]) ? "nan" : (row[j] > 0 ? "+inf" : "-inf"),
                       " (NaN/Inf are refused, FORMAT.md §2.5)"));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("row ", r, " is not finite"));
}

uint32_t CountOverflowGroups(const float* row, uint32_t d) {
  // Overflow is decided per row on the clipped values; count the groups whose raw values
  // reach beyond fp16 as the event count (at least one per overflowing row).
  const uint32_t G = std::min<uint32_t>(d, 128);
  uint32_t n = 0;
  for (uint32_t g = 0; g < d / G; ++g) {
    for (uint32_t j = 0; j < G; ++j) {
      if (std::fabs(row[g * G + j]) > kFp16Max) {
        ++n;
        break;
      }
    }
  }
  return n == 0 ? 1 : n;
}

// Counts an fp16-overflow row (FORMAT.md §2.3: the block keeps its BF16 form) in `result`.
void RecordOverflow(const float* row, uint32_t d, uint64_t r, QuantizeRowsResult& result) {
  ++result.overflow_rows;
  result.overflow_groups += CountOverflowGroups(row, d);
  if (result.first_overflow_row < 0) result.first_overflow_row = static_cast<int64_t>(r);
}

}  // namespace

absl::Status QuantizeRows(const float* x, uint64_t n, uint32_t d, float ratio, uint8_t* codes,
                          uint16_t* params, QuantizeRowsResult* result, KernelIsa isa) {
  if (auto s = ValidateHeadDim(d); !s.ok()) return s;
  if (auto s = ValidateClipRatio(ratio); !s.ok()) return s;
  const KernelIsa use = ResolveIsa(isa);
  const uint32_t ng = d / std::min<uint32_t>(d, 128);
  QuantizeRowsResult local;
  for (uint64_t r = 0; r < n; ++r) {
    const float* row = x + r * d;
    RowQuantStatus s = QuantizeRow(row, d, ratio, codes + r * (d / 4), params + r * 2 * ng, use);
    if (s == RowQuantStatus::kNonFinite) return NonFiniteError(row, r, d);
    if (s == RowQuantStatus::kFp16Overflow) RecordOverflow(row, d, r, local);
  }
  if (result) *result = local;
  return absl::OkStatus();
}

namespace {

void WidenBf16(const uint16_t* x, uint64_t count, float* out, KernelIsa use) {
  if (use == KernelIsa::kAvx2) {
    internal::Bf16ToFp32RowsAvx2(x, count, out);
    return;
  }
  for (uint64_t i = 0; i < count; ++i) out[i] = Bf16ToFp32(x[i]);
}

}  // namespace

absl::Status QuantizeRowsBf16(const uint16_t* x, uint64_t n, uint32_t d, float ratio,
                              uint8_t* codes, uint16_t* params, QuantizeRowsResult* result,
                              KernelIsa isa) {
  if (auto s = ValidateHeadDim(d); !s.ok()) return s;
  if (auto s = ValidateClipRatio(ratio); !s.ok()) return s;
  const KernelIsa use = ResolveIsa(isa);
  const uint32_t ng = d / std::min<uint32_t>(d, 128);
  QuantizeRowsResult local;
  float row[kMaxHeadDim];
  if (use == KernelIsa::kAvx2) {
    // bf16-native statistics, a few rows at a time (no widened copy unless a row needs an
    // error report)
    constexpr uint64_t kBlock = 64;
    RowQuantStatus st[kBlock];
    for (uint64_t r0 = 0; r0 < n; r0 += kBlock) {
      const uint64_t nb = std::min(kBlock, n - r0);
      internal::QuantizeRowsBf16Avx2(x + r0 * d, static_cast<uint32_t>(nb), d, ratio,
                                     codes + r0 * (d / 4), params + r0 * 2 * ng, st);
      for (uint64_t i = 0; i < nb; ++i) {
        if (st[i] == RowQuantStatus::kOk) continue;
        const uint64_t r = r0 + i;
        WidenBf16(x + r * d, d, row, use);
        if (st[i] == RowQuantStatus::kNonFinite) return NonFiniteError(row, r, d);
        RecordOverflow(row, d, r, local);
      }
    }
    if (result) *result = local;
    return absl::OkStatus();
  }
  for (uint64_t r = 0; r < n; ++r) {
    WidenBf16(x + r * d, d, row, use);
    const RowQuantStatus s =
        QuantizeRow(row, d, ratio, codes + r * (d / 4), params + r * 2 * ng, use);
    if (s == RowQuantStatus::kNonFinite) return NonFiniteError(row, r, d);
    if (s == RowQuantStatus::kFp16Overflow) RecordOverflow(row, d, r, local);
  }
  if (result) *result = local;
  return absl::OkStatus();
}

void internal::DequantizeRowScalar(const uint8_t* codes, const uint16_t* params, uint32_t d,
                                   float* out) {
  const uint32_t G = std::min<uint32_t>(d, 128);
  const uint32_t q = d / 4;
  for (uint32_t j = 0; j < d; ++j) {
    const uint32_t quarter = j / q;
    const uint32_t c = (codes[j % q] >> (2 * quarter)) & 3u;
    const uint32_t g = j / G;
    const float scale = Fp16ToFp32(params[2 * g]);
    const float mn = Fp16ToFp32(params[2 * g + 1]);
    out[j] = mn + static_cast<float>(c) * scale;
  }
}

void DequantizeRow(const uint8_t* codes, const uint16_t* params, uint32_t d, float* out,
                   KernelIsa isa) {
  DequantizeRows(codes, params, 1, d, out, isa);
}

void DequantizeRows(const uint8_t* codes, const uint16_t* params, uint64_t n, uint32_t d,
                    float* out, KernelIsa isa) {
  if (ResolveIsa(isa) == KernelIsa::kAvx2) {
    internal::DequantizeRowsAvx2(codes, params, n, d, out);
    return;
  }
  const uint32_t ng = d / std::min<uint32_t>(d, 128);
  for (uint64_t r = 0; r < n; ++r) {
    internal::DequantizeRowScalar(codes + r * (d / 4), params + r * 2 * ng, d, out + r * d);
  }
}

void PackCodes(const uint8_t* codes, uint32_t d, uint8_t* packed) {
  const uint32_t q = d / 4;
  for (uint32_t b = 0; b < q; ++b) {
    packed[b] =
        static_cast<uint8_t>((codes[b] & 3u) | ((codes[b + q] & 3u) << 2) |
                             ((codes[b + 2 * q] & 3u) << 4) | ((codes[b + 3 * q] & 3u) << 6));
  }
}

void UnpackCodes(const uint8_t* packed, uint32_t d, uint8_t* codes) {
  const uint32_t q = d / 4;
  for (uint32_t b = 0; b < q; ++b) {
    for (uint32_t k = 0; k < 4; ++k) codes[b + k * q] = (packed[b] >> (2 * k)) & 3u;
  }
}

namespace {

// A rotation packed for the AVX2 kernel (internal::PackRotationAvx2), 64-byte aligned; empty
// (data() null) when the call has too few rows to amortize the packing or no AVX2.
class PackedRotation {
 public:
  PackedRotation(const float* rotation, uint64_t n, uint32_t d, KernelIsa use) {
    if (use != KernelIsa::kAvx2 || n < internal::kRotatePackMinRows) return;
    buf_.reset(new float[static_cast<size_t>(d) * d + 16]);  // uninitialized: fully packed
    const auto addr = reinterpret_cast<uintptr_t>(buf_.get());
    data_ = reinterpret_cast<float*>((addr + 63) & ~uintptr_t{63});
    internal::PackRotationAvx2(rotation, d, data_);
  }
  const float* data() const { return data_; }

 private:
  std::unique_ptr<float[]> buf_;
  float* data_ = nullptr;
};

// AVX2 rotation of nr rows (one tile when packed): fp32 to out, or bf16 to out_bf16.
void RotateTileAvx2(const float* x, uint64_t nr, uint32_t d, const float* rotation,
                    const PackedRotation& packed, float* out, uint16_t* out_bf16) {
  if (packed.data() != nullptr) {
    internal::RotateRowsPackedAvx2(x, nr, d, packed.data(), out, out_bf16);
  } else {
    internal::RotateRowsDirectAvx2(x, nr, d, rotation, out, out_bf16);
  }
}

}  // namespace

void RotateRows(const float* x, uint64_t n, uint32_t d, const float* rotation, float* out,
                KernelIsa isa) {
  if (ResolveIsa(isa) != KernelIsa::kAvx2) {
    internal::RotateRowsScalar(x, n, d, rotation, out);
    return;
  }
  const PackedRotation packed(rotation, n, d, KernelIsa::kAvx2);
  const uint64_t tile = packed.data() ? internal::RotationTileRows(d) : n;
  for (uint64_t r0 = 0; r0 < n; r0 += tile) {
    RotateTileAvx2(x + r0 * d, std::min(tile, n - r0), d, rotation, packed, out + r0 * d, nullptr);
  }
}

void RotateRowsBf16(const uint16_t* x, uint64_t n, uint32_t d, const float* rotation, float* out,
                    KernelIsa isa) {
  const KernelIsa use = ResolveIsa(isa);
  std::vector<float> wide(static_cast<size_t>(n) * d);
  WidenBf16(x, n * d, wide.data(), use);
  RotateRows(wide.data(), n, d, rotation, out, use);
}

void RotateRowsTransposed(const float* x, uint64_t n, uint32_t d, const float* rotation,
                          float* out) {
  for (uint64_t r = 0; r < n; ++r) {
    const float* xr = x + r * d;
    for (uint32_t i = 0; i < d; ++i) {
      const float* row = rotation + static_cast<uint64_t>(i) * d;
      float acc = 0.0f;
      for (uint32_t j = 0; j < d; ++j) acc = std::fma(xr[j], row[j], acc);
      out[r * d + i] = acc;
    }
  }
}

namespace {

// The outcome of one row of RotateQuantizeRowsBf16: an error for a NaN/Inf row (naming the
// input element when the input itself is bad, else the rotated row), or the overflow count.
// rotated: the row's fp32 values as quantized (bf16-rounded).
absl::Status RotatedRowStatus(RowQuantStatus s, const uint16_t* x, const float* rotated, uint64_t r,
                              uint32_t d, QuantizeRowsResult& local) {
  if (s == RowQuantStatus::kNonFinite) {
    std::vector<float> in(d);
    for (uint32_t j = 0; j < d; ++j) in[j] = Bf16ToFp32(x[r * d + j]);
    for (uint32_t j = 0; j < d; ++j) {
      if (!std::isfinite(in[j])) return NonFiniteError(in.data(), r, d);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "row ", r, " is finite but its rotation overflows to inf/nan (input too large)"));
  }
  if (s == RowQuantStatus::kFp16Overflow) RecordOverflow(rotated, d, r, local);
  return absl::OkStatus();
}

// The AVX2 path of RotateQuantizeRowsBf16, software-pipelined over tiles of
// RotationTileRows(d) rows (24 at d = 128): tile t is widened and rotated one column slab at a
// time (the kernel rounds to bf16 in registers and stores only the bf16 rows), and between its
// slabs the already-rotated tile t − 1 is clipped and quantized in batches of kBf16Batch rows.
// The rotation keeps the two FMA ports busy while the quantizer's work is mostly integer,
// shuffle and scalar; interleaving them at this grain lets the out-of-order core overlap the
// two (sequential tiles measured ~0.3 of the rotation time for the quantizer alone). Each
// row's numbers are those of the scalar path; only the order of the work changes.
absl::Status RotateQuantizeRowsBf16Avx2(const uint16_t* x, uint64_t n, uint32_t d,
                                        const float* rotation, float ratio, uint16_t* rotated_bf16,
                                        uint8_t* codes, uint16_t* params,
                                        QuantizeRowsResult* result) {
  constexpr uint64_t kTileFloats = internal::kRotationTileFloats;
  static_assert(kTileFloats >= kMaxHeadDim);
  const uint32_t ng = d / std::min<uint32_t>(d, 128);
  const uint64_t tile = internal::RotationTileRows(d);
  const uint32_t w = internal::RotationPanelWidth(d);
  const PackedRotation packed(rotation, n, d, KernelIsa::kAvx2);
  float wide[kTileFloats];
  float row[kMaxHeadDim];
  uint16_t rb[2][kTileFloats];            // bf16 tiles when rotated_bf16 is null
  RowQuantStatus st[2][kTileFloats / 8];  // tile <= kTileFloats / d rows, d >= 8
  struct Pending {                        // a rotated tile waiting for its quantization
    uint64_t r0 = 0, nr = 0;
    const uint16_t* bf16 = nullptr;
    RowQuantStatus* st = nullptr;
    uint64_t Batches() const { return (nr + internal::kBf16Batch - 1) / internal::kBf16Batch; }
  } prev;
  auto quantize_batch = [&](const Pending& t, uint64_t b) {
    const uint64_t k0 = b * internal::kBf16Batch;
    const uint64_t nb = std::min<uint64_t>(internal::kBf16Batch, t.nr - k0);
    const uint64_t r = t.r0 + k0;
    internal::QuantizeRowsBf16Avx2(t.bf16 + k0 * d, static_cast<uint32_t>(nb), d, ratio,
                                   codes + r * (d / 4), params + r * 2 * ng, t.st + k0);
  };
  QuantizeRowsResult local;
  auto finish = [&](const Pending& t) -> absl::Status {
    for (uint64_t k = 0; k < t.nr; ++k) {
      if (t.st[k] == RowQuantStatus::kOk) continue;
      internal::Bf16ToFp32RowsAvx2(t.bf16 + k * d, d, row);
      KVPOOL_RETURN_IF_ERROR(RotatedRowStatus(t.st[k], x, row, t.r0 + k, d, local));
    }
    return absl::OkStatus();
  };
  int buf = 0;
  for (uint64_t r0 = 0; r0 < n; r0 += tile, buf ^= 1) {
    const uint64_t nr = std::min(tile, n - r0);
    internal::Bf16ToFp32RowsAvx2(x + r0 * d, nr * d, wide);
    uint16_t* dst = rotated_bf16 ? rotated_bf16 + r0 * d : rb[buf];
    const uint64_t slabs = d / w, batches = prev.Batches();
    uint64_t b = 0;
    for (uint64_t p = 0; p < slabs; ++p) {
      const uint32_t j0 = static_cast<uint32_t>(p * w);
      if (packed.data() != nullptr) {
        internal::RotateSlabAvx2(wide, nr, d, packed.data() + uint64_t{j0} * d, w, j0, nullptr,
                                 dst);
      } else {
        internal::RotateSlabAvx2(wide, nr, d, rotation + j0, d, j0, nullptr, dst);
      }
      for (; b < batches && b * slabs < (p + 1) * batches; ++b) quantize_batch(prev, b);
    }
    KVPOOL_RETURN_IF_ERROR(finish(prev));
    prev = Pending{r0, nr, dst, st[buf]};
  }
  for (uint64_t b = 0; b < prev.Batches(); ++b) quantize_batch(prev, b);
  KVPOOL_RETURN_IF_ERROR(finish(prev));
  if (result) *result = local;
  return absl::OkStatus();
}

}  // namespace

absl::Status RotateQuantizeRowsBf16(const uint16_t* x, uint64_t n, uint32_t d,
                                    const float* rotation, float ratio, uint16_t* rotated_bf16,
                                    uint8_t* codes, uint16_t* params, QuantizeRowsResult* result,
                                    KernelIsa isa) {
  if (auto s = ValidateHeadDim(d); !s.ok()) return s;
  if (auto s = ValidateClipRatio(ratio); !s.ok()) return s;
  if (ResolveIsa(isa) == KernelIsa::kAvx2) {
    return RotateQuantizeRowsBf16Avx2(x, n, d, rotation, ratio, rotated_bf16, codes, params,
                                      result);
  }
  // Scalar reference: tiles of rows widened, rotated in fp32, rounded to bf16, and those bf16
  // values clipped and quantized row by row.
  const uint32_t ng = d / std::min<uint32_t>(d, 128);
  constexpr uint64_t kTileFloats = internal::kRotationTileFloats;
  const uint64_t tile = internal::RotationTileRows(d);
  std::vector<float> wide(kTileFloats), rot(kTileFloats);
  std::vector<uint16_t> rb(kTileFloats);
  QuantizeRowsResult local;
  for (uint64_t r0 = 0; r0 < n; r0 += tile) {
    const uint64_t nr = std::min(tile, n - r0);
    WidenBf16(x + r0 * d, nr * d, wide.data(), KernelIsa::kScalar);
    internal::RotateRowsScalar(wide.data(), nr, d, rotation, rot.data());
    uint16_t* dst = rotated_bf16 ? rotated_bf16 + r0 * d : rb.data();
    for (uint64_t i = 0; i < nr * d; ++i) {
      dst[i] = Fp32ToBf16(rot[i]);
      rot[i] = Bf16ToFp32(dst[i]);
    }
    for (uint64_t k = 0; k < nr; ++k) {
      const uint64_t r = r0 + k;
      float* row = rot.data() + k * d;
      const RowQuantStatus s =
          internal::QuantizeRowScalar(row, d, ratio, codes + r * (d / 4), params + r * 2 * ng);
      KVPOOL_RETURN_IF_ERROR(RotatedRowStatus(s, x, row, r, d, local));
    }
  }
  if (result) *result = local;
  return absl::OkStatus();
}

}  // namespace kvpool
