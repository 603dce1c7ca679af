// Whole-block encode/decode (see kvpool/kernels/block_codec.h).
#include "kvpool/kernels/block_codec.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/numeric.h"

namespace kvpool {
namespace {

absl::Status CheckSize(const char* what, uint64_t got, uint64_t want) {
  if (got != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is ", got, " bytes, the block geometry needs ", want));
  }
  return absl::OkStatus();
}

absl::Status ValidateGeometry(const BlockGeometry& g) {
  if (auto s = ValidateHeadDim(g.head_dim, "geometry.head_dim"); !s.ok()) return s;
  if (g.num_layers == 0) return absl::InvalidArgumentError("geometry.num_layers must be > 0");
  if (g.num_kv_heads == 0) return absl::InvalidArgumentError("geometry.num_kv_heads must be > 0");
  if (g.page_size == 0 || (g.page_size & (g.page_size - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.page_size must be a power of two, got ", g.page_size));
  }
  return absl::OkStatus();
}

absl::Status NonFinite(uint32_t l, uint32_t h, uint32_t t, KvKind kind, uint32_t j, float v) {
  return absl::InvalidArgumentError(absl::StrCat(
      "layer ", l, " head ", h, " token ", t, " ", kind == KvKind::kKey ? "K" : "V", " element ", j,
      " is ", std::isnan(v) ? "nan" : "inf", " (NaN/Inf are refused, FORMAT.md §2.5)"));
}

void Note(BlockEncodeReport* rep, const QuantizeRowsResult& r, uint32_t l, uint32_t h,
          KvKind kind) {
  if (r.overflow_rows == 0) return;
  rep->int2_valid = false;
  rep->overflow_rows += r.overflow_rows;
  rep->overflow_groups += r.overflow_groups;
  if (rep->first_overflow_layer < 0) {
    rep->first_overflow_layer = static_cast<int32_t>(l);
    rep->first_overflow_head = static_cast<int32_t>(h);
    rep->first_overflow_token = static_cast<int32_t>(r.first_overflow_row);
    rep->first_overflow_kind = kind;
  }
}

// Writes P quantized rows (codes, params) into their parts of an INT2 chunk.
void StorePart(const BlockGeometry& g, const uint8_t* codes, const uint16_t* params, uint8_t* chunk,
               KvKind kind) {
  const uint64_t P = g.page_size;
  std::memcpy(chunk + (kind == KvKind::kKey ? g.Int2KCodesOffset() : g.Int2VCodesOffset()), codes,
              P * g.CodeRowBytes());
  std::memcpy(chunk + (kind == KvKind::kKey ? g.Int2KParamsOffset() : g.Int2VParamsOffset()),
              params, P * g.ParamRowBytes());
}

uint64_t RowsOffset(const BlockGeometry& g, uint32_t l, uint32_t h, KvKind kind) {
  return g.Bf16ChunkOffset(l, h) + (kind == KvKind::kKey ? 0 : g.Bf16VOffset());
}

// The shared encoder: `load` fills P un-rotated fp32 rows of (l, h, kind) — or, for
// pre_rotated, P rotated bf16 rows.
template <typename LoadF32>
absl::StatusOr<BlockEncodeReport> Encode(const BlockGeometry& g, const RotationSet* rot,
                                         LoadF32 load, absl::Span<uint8_t> rotated_bf16,
                                         absl::Span<uint8_t> int2, const BlockEncodeOptions& opt) {
  const uint32_t P = g.page_size, d = g.head_dim;
  const KernelIsa isa = ResolveIsa(opt.isa);
  std::vector<float> in(static_cast<size_t>(P) * d), rotated(in.size());
  std::vector<uint16_t> rb(in.size());
  std::vector<uint8_t> codes(static_cast<size_t>(P) * g.CodeRowBytes());
  std::vector<uint16_t> params(static_cast<size_t>(P) * g.ParamRowBytes() / 2);
  BlockEncodeReport rep;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
      for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
        load(l, h, kind, in.data());
        for (uint32_t t = 0; t < P; ++t)
          for (uint32_t j = 0; j < d; ++j)
            if (!std::isfinite(in[t * d + j])) return NonFinite(l, h, t, kind, j, in[t * d + j]);
        if (rot) {
          RotateRows(in.data(), P, d, rot->Matrix(kind, l, h), rotated.data(), isa);
          for (size_t i = 0; i < rb.size(); ++i) rb[i] = Fp32ToBf16(rotated[i]);
          if (!rotated_bf16.empty()) {
            std::memcpy(rotated_bf16.data() + RowsOffset(g, l, h, kind), rb.data(), rb.size() * 2);
          }
        } else {
          for (size_t i = 0; i < rb.size(); ++i) rb[i] = Fp32ToBf16(in[i]);  // exact (bf16 in)
        }
        if (int2.empty()) continue;
        QuantizeRowsResult r;
        const float ratio = kind == KvKind::kKey ? opt.clip_ratio_k : opt.clip_ratio_v;
        absl::Status s =
            QuantizeRowsBf16(rb.data(), P, d, ratio, codes.data(), params.data(), &r, isa);
        if (!s.ok()) {
          return absl::Status(s.code(), absl::StrCat("layer ", l, " head ", h, " ",
                                                     kind == KvKind::kKey ? "K" : "V",
                                                     " after rotation: ", s.message()));
        }
        Note(&rep, r, l, h, kind);
        StorePart(g, codes.data(), params.data(), int2.data() + g.Int2ChunkOffset(l, h), kind);
      }
    }
  }
  return rep;
}

absl::Status CheckCommon(const BlockGeometry& g, const BlockEncodeOptions& opt,
                         absl::Span<uint8_t> rotated_bf16, absl::Span<uint8_t> int2) {
  KVPOOL_RETURN_IF_ERROR(ValidateGeometry(g));
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(opt.clip_ratio_k, "clip_ratio_k"));
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(opt.clip_ratio_v, "clip_ratio_v"));
  if (!rotated_bf16.empty()) {
    KVPOOL_RETURN_IF_ERROR(CheckSize("rotated_bf16", rotated_bf16.size(), g.Bf16FormBytes()));
  }
  if (!int2.empty()) KVPOOL_RETURN_IF_ERROR(CheckSize("int2", int2.size(), g.Int2FormBytes()));
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckGeometryMatchesRotations(const BlockGeometry& g, const RotationSet& rot) {
  KVPOOL_RETURN_IF_ERROR(ValidateGeometry(g));
  std::string bad;
  if (rot.head_dim() != g.head_dim) {
    absl::StrAppend(&bad, " head_dim ", rot.head_dim(), " != ", g.head_dim, ";");
  }
  if (rot.num_layers() != g.num_layers) {
    absl::StrAppend(&bad, " num_layers ", rot.num_layers(), " != ", g.num_layers, ";");
  }
  if (rot.num_kv_heads() != g.num_kv_heads) {
    absl::StrAppend(&bad, " num_kv_heads ", rot.num_kv_heads(), " != ", g.num_kv_heads, ";");
  }
  if (!bad.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rotations do not match the block geometry (rotations vs block):", bad));
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockEncodeReport> EncodeBlockBf16(const BlockGeometry& g, const RotationSet& rot,
                                                  absl::Span<const uint8_t> staging,
                                                  absl::Span<uint8_t> rotated_bf16,
                                                  absl::Span<uint8_t> int2,
                                                  const BlockEncodeOptions& options) {
  KVPOOL_RETURN_IF_ERROR(CheckCommon(g, options, rotated_bf16, int2));
  KVPOOL_RETURN_IF_ERROR(CheckSize("staging", staging.size(), g.Bf16FormBytes()));
  KVPOOL_RETURN_IF_ERROR(CheckGeometryMatchesRotations(g, rot));
  const uint64_t n = uint64_t{g.page_size} * g.head_dim;
  auto load = [&](uint32_t l, uint32_t h, KvKind kind, float* out) {
    const uint8_t* src = staging.data() + RowsOffset(g, l, h, kind);
    for (uint64_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, src + 2 * i, 2);
      out[i] = Bf16ToFp32(b);
    }
  };
  return Encode(g, &rot, load, rotated_bf16, int2, options);
}

absl::StatusOr<BlockEncodeReport> EncodeBlockF32(const BlockGeometry& g, const RotationSet& rot,
                                                 absl::Span<const float> unrotated,
                                                 absl::Span<uint8_t> rotated_bf16,
                                                 absl::Span<uint8_t> int2,
                                                 const BlockEncodeOptions& options) {
  KVPOOL_RETURN_IF_ERROR(CheckCommon(g, options, rotated_bf16, int2));
  KVPOOL_RETURN_IF_ERROR(
      CheckSize("unrotated (bytes)", unrotated.size() * sizeof(float), 2 * g.Bf16FormBytes()));
  KVPOOL_RETURN_IF_ERROR(CheckGeometryMatchesRotations(g, rot));
  const uint64_t n = uint64_t{g.page_size} * g.head_dim;
  auto load = [&](uint32_t l, uint32_t h, KvKind kind, float* out) {
    std::memcpy(out, unrotated.data() + RowsOffset(g, l, h, kind) / 2, n * sizeof(float));
  };
  return Encode(g, &rot, load, rotated_bf16, int2, options);
}

absl::StatusOr<BlockEncodeReport> QuantizeRotatedBlock(const BlockGeometry& g,
                                                       absl::Span<const uint8_t> rotated_bf16,
                                                       absl::Span<uint8_t> int2,
                                                       const BlockEncodeOptions& options) {
  KVPOOL_RETURN_IF_ERROR(CheckCommon(g, options, {}, int2));
  KVPOOL_RETURN_IF_ERROR(CheckSize("rotated_bf16", rotated_bf16.size(), g.Bf16FormBytes()));
  KVPOOL_RETURN_IF_ERROR(CheckSize("int2", int2.size(), g.Int2FormBytes()));
  const uint64_t n = uint64_t{g.page_size} * g.head_dim;
  auto load = [&](uint32_t l, uint32_t h, KvKind kind, float* out) {
    const uint8_t* src = rotated_bf16.data() + RowsOffset(g, l, h, kind);
    for (uint64_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, src + 2 * i, 2);
      out[i] = Bf16ToFp32(b);
    }
  };
  return Encode(g, nullptr, load, {}, int2, options);
}

absl::Status DequantizeInt2Chunk(const BlockGeometry& g, absl::Span<const uint8_t> int2_form,
                                 uint32_t layer, uint32_t head, KvKind kind,
                                 absl::Span<float> out) {
  KVPOOL_RETURN_IF_ERROR(ValidateGeometry(g));
  KVPOOL_RETURN_IF_ERROR(CheckSize("int2_form", int2_form.size(), g.Int2FormBytes()));
  if (layer >= g.num_layers || head >= g.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " / head ", head,
                                                   " out of range (", g.num_layers, " layers, ",
                                                   g.num_kv_heads, " heads)"));
  }
  const uint32_t P = g.page_size, d = g.head_dim;
  if (out.size() != uint64_t{P} * d) {
    return absl::InvalidArgumentError(
        absl::StrCat("out holds ", out.size(), " floats, expected page_size*head_dim = ", P * d));
  }
  const uint8_t* chunk = int2_form.data() + g.Int2ChunkOffset(layer, head);
  const uint8_t* codes =
      chunk + (kind == KvKind::kKey ? g.Int2KCodesOffset() : g.Int2VCodesOffset());
  const uint8_t* params =
      chunk + (kind == KvKind::kKey ? g.Int2KParamsOffset() : g.Int2VParamsOffset());
  std::vector<uint16_t> p(g.ParamRowBytes() / 2);
  for (uint32_t t = 0; t < P; ++t) {
    std::memcpy(p.data(), params + t * g.ParamRowBytes(), g.ParamRowBytes());
    DequantizeRow(codes + t * g.CodeRowBytes(), p.data(), d, out.data() + uint64_t{t} * d);
  }
  return absl::OkStatus();
}

absl::Status ReadBf16Chunk(const BlockGeometry& g, absl::Span<const uint8_t> bf16_form,
                           uint32_t layer, uint32_t head, KvKind kind, absl::Span<float> out) {
  KVPOOL_RETURN_IF_ERROR(ValidateGeometry(g));
  KVPOOL_RETURN_IF_ERROR(CheckSize("bf16_form", bf16_form.size(), g.Bf16FormBytes()));
  if (layer >= g.num_layers || head >= g.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " / head ", head,
                                                   " out of range (", g.num_layers, " layers, ",
                                                   g.num_kv_heads, " heads)"));
  }
  const uint64_t n = uint64_t{g.page_size} * g.head_dim;
  if (out.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("out holds ", out.size(), " floats, expected page_size*head_dim = ", n));
  }
  const uint8_t* src = bf16_form.data() + RowsOffset(g, layer, head, kind);
  for (uint64_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, src + 2 * i, 2);
    out[i] = Bf16ToFp32(b);
  }
  return absl::OkStatus();
}

}  // namespace kvpool
