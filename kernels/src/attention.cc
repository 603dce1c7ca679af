// Reference decode attention (see kvpool/kernels/attention.h).
#include "kvpool/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/block_codec.h"
#include "kvpool/kernels/quantize.h"

namespace kvpool {
namespace {

absl::Status CheckParams(const DecodeAttentionParams& p) {
  const BlockGeometry& g = p.geometry;
  KVPOOL_RETURN_IF_ERROR(ValidateHeadDim(g.head_dim, "geometry.head_dim"));
  if (!g.Valid()) return absl::InvalidArgumentError("geometry is not valid (counts, page_size)");
  if (p.layer >= g.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", p.layer, " out of range (num_layers ", g.num_layers, ")"));
  }
  if (p.num_q_heads == 0 || p.num_q_heads % g.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_q_heads ", p.num_q_heads,
                                                   " is not a positive multiple of num_kv_heads ",
                                                   g.num_kv_heads));
  }
  if (!(p.softmax_scale > 0) || !std::isfinite(p.softmax_scale)) {
    return absl::InvalidArgumentError("softmax_scale must be positive and finite");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AttendSegment(const DecodeAttentionParams& p, const SegmentView& seg,
                           const float* q_rot, float* out, float* lse) {
  KVPOOL_RETURN_IF_ERROR(CheckParams(p));
  const BlockGeometry& g = p.geometry;
  const uint32_t P = g.page_size, d = g.head_dim, hq = p.num_q_heads;
  const uint32_t group = hq / g.num_kv_heads;
  std::fill(out, out + uint64_t{hq} * d, 0.0f);
  std::fill(lse, lse + hq, -INFINITY);
  if (seg.pages.empty()) return absl::OkStatus();
  if (seg.last_page_len < 1 || seg.last_page_len > P) {
    return absl::InvalidArgumentError(
        absl::StrCat("last_page_len ", seg.last_page_len, " must be in 1..", P));
  }
  for (size_t i = 0; i < seg.pages.size(); ++i) {
    if (seg.pages[i] == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("pages[", i, "] is null"));
  }
  const uint64_t n = seg.NumTokens(P);
  const uint64_t form_bytes =
      seg.form == SegmentForm::kBf16 ? g.Bf16FormBytes() : g.Int2FormBytes();
  std::vector<float> k(n * d), v(n * d), chunk(uint64_t{P} * d);
  std::vector<float> s(n);
  for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
    // Gather this KV head's keys and values (fp32, rotated space).
    for (size_t pg = 0; pg < seg.pages.size(); ++pg) {
      const uint32_t valid = pg + 1 == seg.pages.size() ? seg.last_page_len : P;
      absl::Span<const uint8_t> form(seg.pages[pg], form_bytes);
      for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
        if (seg.form == SegmentForm::kBf16) {
          KVPOOL_RETURN_IF_ERROR(ReadBf16Chunk(g, form, p.layer, h, kind, absl::MakeSpan(chunk)));
        } else {
          KVPOOL_RETURN_IF_ERROR(
              DequantizeInt2Chunk(g, form, p.layer, h, kind, absl::MakeSpan(chunk)));
        }
        float* dst = (kind == KvKind::kKey ? k : v).data() + pg * uint64_t{P} * d;
        std::memcpy(dst, chunk.data(), uint64_t{valid} * d * sizeof(float));
      }
    }
    for (uint32_t qi = h * group; qi < (h + 1) * group; ++qi) {
      const float* q = q_rot + uint64_t{qi} * d;
      float m = -INFINITY;
      for (uint64_t t = 0; t < n; ++t) {
        float dot = 0.0f;
        for (uint32_t j = 0; j < d; ++j) dot += q[j] * k[t * d + j];
        s[t] = p.softmax_scale * dot;
        m = std::max(m, s[t]);
      }
      float l = 0.0f;
      float* o = out + uint64_t{qi} * d;
      for (uint64_t t = 0; t < n; ++t) {
        const float w = std::exp(s[t] - m);
        l += w;
        for (uint32_t j = 0; j < d; ++j) o[j] += w * v[t * d + j];
      }
      for (uint32_t j = 0; j < d; ++j) o[j] /= l;
      lse[qi] = m + std::log(l);
    }
  }
  return absl::OkStatus();
}

void MergeAttentionStates(uint32_t num_heads, uint32_t head_dim, float* out_a, float* lse_a,
                          const float* out_b, const float* lse_b) {
  for (uint32_t i = 0; i < num_heads; ++i) {
    const float m = std::max(lse_a[i], lse_b[i]);
    float* oa = out_a + uint64_t{i} * head_dim;
    const float* ob = out_b + uint64_t{i} * head_dim;
    if (m == -INFINITY) {  // both empty: stay empty (no (−inf) − (−inf))
      std::fill(oa, oa + head_dim, 0.0f);
      lse_a[i] = -INFINITY;
      continue;
    }
    const float wa = std::exp(lse_a[i] - m), wb = std::exp(lse_b[i] - m);
    const float sum = wa + wb;
    for (uint32_t j = 0; j < head_dim; ++j) oa[j] = (wa * oa[j] + wb * ob[j]) / sum;
    lse_a[i] = m + std::log(sum);
  }
}

absl::Status ReferenceDecodeAttention(const DecodeAttentionParams& p, const RotationSet& rot,
                                      const float* q, const SegmentView& sink,
                                      const SegmentView& history, const SegmentView& recent,
                                      float* out, float* lse) {
  KVPOOL_RETURN_IF_ERROR(CheckParams(p));
  KVPOOL_RETURN_IF_ERROR(CheckGeometryMatchesRotations(p.geometry, rot));
  const uint32_t d = p.geometry.head_dim, hq = p.num_q_heads;
  const uint32_t group = hq / p.geometry.num_kv_heads;
  std::vector<float> q_rot(uint64_t{hq} * d);
  for (uint32_t i = 0; i < hq; ++i) {
    RotateRows(q + uint64_t{i} * d, 1, d, rot.Matrix(KvKind::kKey, p.layer, i / group),
               q_rot.data() + uint64_t{i} * d, KernelIsa::kScalar);
  }
  std::vector<float> acc(uint64_t{hq} * d), acc_lse(hq), part(acc.size()), part_lse(hq);
  KVPOOL_RETURN_IF_ERROR(AttendSegment(p, sink, q_rot.data(), acc.data(), acc_lse.data()));
  for (const SegmentView* seg : {&history, &recent}) {
    KVPOOL_RETURN_IF_ERROR(AttendSegment(p, *seg, q_rot.data(), part.data(), part_lse.data()));
    MergeAttentionStates(hq, d, acc.data(), acc_lse.data(), part.data(), part_lse.data());
  }
  for (uint32_t i = 0; i < hq; ++i) {
    RotateRowsTransposed(acc.data() + uint64_t{i} * d, 1, d,
                         rot.Matrix(KvKind::kValue, p.layer, i / group), out + uint64_t{i} * d);
    lse[i] = acc_lse[i];
  }
  return absl::OkStatus();
}

}  // namespace kvpool
