// OSCAR calibration / evaluation on a real model (see model_eval.h).
#include "model_eval.h"

#include <cmath>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "kvpool/common/bounded_file.h"
#include "kvpool/common/status.h"
#include "kvpool/engine/engine.h"
#include "kvpool/kernels/calibration.h"
#include "kvpool/kernels/quantize.h"
#include "kvpool/kernels/rotation_file.h"

namespace kvpool::tools {
namespace {

// The --text file, through the shared bounded reader: the flag's parse-time check looked at the
// path only, so a FIFO or device swapped in afterwards, or a file grown past the limit, is
// refused here instead of blocking or being read without end.
absl::StatusOr<std::string> ReadText(const std::string& path) {
  auto text = ReadBoundedRegularFile(path, kMaxTextFileBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(), absl::StrCat("text file: ", text.status().message()));
  }
  return text;
}

struct Recorded {
  engine::ModelConfig config;
  std::unique_ptr<engine::QkvRecorder> rec;
  int64_t tokens = 0;
};

absl::StatusOr<Recorded> RunText(const std::string& model_path, const std::string& text_path,
                                 int64_t max_tokens,
                                 const std::function<void(int64_t, int64_t)>& progress) {
  KVPOOL_ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(model_path));
  KVPOOL_ASSIGN_OR_RETURN(std::string text, ReadText(text_path));
  std::vector<int> toks = eng->tokenizer().Encode(text, /*add_bos=*/false);
  if (max_tokens > 0 && static_cast<int64_t>(toks.size()) > max_tokens) toks.resize(max_tokens);
  if (toks.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("text file '", text_path, "' has no tokens"));
  }
  Recorded r;
  r.config = eng->config();
  r.rec = std::make_unique<engine::QkvRecorder>();
  eng->set_observer(r.rec.get());
  const int64_t per_seq = r.config.context_length - 1;
  const int64_t total = static_cast<int64_t>(toks.size());
  for (int64_t start = 0; start < total; start += per_seq) {
    const int64_t n = std::min(per_seq, total - start);
    std::vector<int> seq;
    seq.push_back(eng->tokenizer().bos_id());
    seq.insert(seq.end(), toks.begin() + start, toks.begin() + start + n);
    // Sized by the sequence, not the model's context (a GGUF context_length of 2^24 allocated
    // 21 GB; newcomer s8 N12).
    KVPOOL_ASSIGN_OR_RETURN(auto cache, eng->NewCache(static_cast<int>(seq.size())));
    auto logits = eng->Prefill(seq, 0, *cache);
    if (!logits.ok()) return logits.status();
    r.tokens += static_cast<int64_t>(seq.size());
    if (progress) progress(start + n, total);
  }
  eng->set_observer(nullptr);
  return r;
}

std::string Stem(const std::string& path) { return std::filesystem::path(path).stem().string(); }

// Quantizes rows [n][d] with rotation r (rotate, clip, INT2, dequantize, rotate back).
absl::Status RoundTrip(const float* x, uint64_t n, uint32_t d, const float* r, float clip,
                       float* out) {
  std::vector<float> rot(n * d), deq(n * d);
  RotateRows(x, n, d, r, rot.data());
  const uint32_t ng = d / std::min<uint32_t>(d, 128);
  std::vector<uint8_t> codes(n * d / 4);
  std::vector<uint16_t> params(n * 2 * ng);
  QuantizeRowsResult res;
  KVPOOL_RETURN_IF_ERROR(QuantizeRows(rot.data(), n, d, clip, codes.data(), params.data(), &res));
  if (res.overflow_rows) {
    return absl::FailedPreconditionError(
        absl::StrCat(res.overflow_rows, " rows exceed the fp16 range; INT2 cannot hold them"));
  }
  for (uint64_t t = 0; t < n; ++t) {
    DequantizeRow(&codes[t * d / 4], &params[t * 2 * ng], d, &deq[t * d]);
  }
  RotateRowsTransposed(deq.data(), n, d, r, out);
  return absl::OkStatus();
}

}  // namespace

double LayerError::logit() const { return logit_den > 0 ? std::sqrt(logit_num / logit_den) : 0; }
double LayerError::output() const {
  return output_den > 0 ? std::sqrt(output_num / output_den) : 0;
}

absl::StatusOr<RotationMetadata> ModelRotationMetadata(const std::string& model_path) {
  KVPOOL_ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(model_path));
  RotationMetadata m;
  m.model_name = Stem(model_path);
  m.head_dim = static_cast<uint32_t>(eng->config().head_dim);
  m.num_layers = static_cast<uint32_t>(eng->config().n_layers);
  m.num_kv_heads = static_cast<uint32_t>(eng->config().n_kv_heads);
  return m;
}

absl::StatusOr<RotationSet> CalibrateModel(const CalibrateOptions& o) {
  KVPOOL_ASSIGN_OR_RETURN(Recorded r, RunText(o.model_path, o.text_path, o.max_tokens, o.progress));
  const auto& c = r.config;
  KVPOOL_ASSIGN_OR_RETURN(
      auto acc, CalibrationAccumulator::Create(c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim));
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& rows = r.rec->rows(l);
    KVPOOL_RETURN_IF_ERROR(acc->AddQueries(l, rows.q.data(), rows.positions.size()));
  }
  KVPOOL_RETURN_IF_ERROR(acc->FreezeKeyTargets());
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& rows = r.rec->rows(l);
    KVPOOL_RETURN_IF_ERROR(
        acc->AddKeysValues(l, rows.k.data(), rows.v.data(), rows.positions.size()));
  }
  KVPOOL_ASSIGN_OR_RETURN(std::string text, ReadText(o.text_path));
  FitOptions fo;
  fo.per_head = o.per_head;
  fo.model_name = Stem(o.model_path);
  fo.clip_ratio_k = o.clip_ratio_k;
  fo.clip_ratio_v = o.clip_ratio_v;
  fo.source_hash = absl::StrCat("sha256:", Sha256Hex(text), " tokens:", r.tokens);
  return FitOscarRotations(*acc, fo);
}

absl::StatusOr<std::vector<EvalResult>> EvaluateModel(
    const EvaluateOptions& o, const std::vector<std::pair<std::string, const RotationSet*>>& rots) {
  KVPOOL_ASSIGN_OR_RETURN(Recorded r, RunText(o.model_path, o.text_path, o.max_tokens, o.progress));
  const auto& c = r.config;
  const uint32_t d = c.head_dim, hq = c.n_heads, hkv = c.n_kv_heads, g = hq / hkv;
  ExpectedRotationModel expect{
      .head_dim = d, .num_layers = static_cast<uint32_t>(c.n_layers), .num_kv_heads = hkv};
  std::vector<EvalResult> results;
  for (const auto& [name, set] : rots) {
    KVPOOL_RETURN_IF_ERROR(Annotate(CheckRotationsMatch(*set, expect), name));
    EvalResult res;
    res.name = name;
    res.layers.resize(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
      const auto& rows = r.rec->rows(l);
      const uint64_t n = rows.positions.size();
      // Per KV head: gather, quantize round trip.
      std::vector<float> kh(n * hkv * d), vh(n * hkv * d);
      for (uint32_t h = 0; h < hkv; ++h) {
        std::vector<float> kx(n * d), vx(n * d), kq(n * d), vq(n * d);
        for (uint64_t t = 0; t < n; ++t) {
          std::copy_n(&rows.k[(t * hkv + h) * d], d, &kx[t * d]);
          std::copy_n(&rows.v[(t * hkv + h) * d], d, &vx[t * d]);
        }
        KVPOOL_RETURN_IF_ERROR(
            RoundTrip(kx.data(), n, d, set->Matrix(KvKind::kKey, l, h), o.clip_ratio_k, kq.data()));
        KVPOOL_RETURN_IF_ERROR(RoundTrip(vx.data(), n, d, set->Matrix(KvKind::kValue, l, h),
                                         o.clip_ratio_v, vq.data()));
        for (uint64_t t = 0; t < n; ++t) {
          std::copy_n(&kq[t * d], d, &kh[(t * hkv + h) * d]);
          std::copy_n(&vq[t * d], d, &vh[(t * hkv + h) * d]);
        }
      }
      LayerError& e = res.layers[l];
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      std::vector<double> s(n), sh(n);
      uint64_t seq_start = 0;
      for (uint64_t t = 0; t < n; ++t) {
        if (rows.positions[t] == 0) seq_start = t;
        for (uint32_t i = 0; i < hq; ++i) {
          const uint32_t h = i / g;
          const float* q = &rows.q[(t * hq + i) * d];
          double m = -INFINITY, mh = -INFINITY;
          for (uint64_t u = seq_start; u <= t; ++u) {
            double a = 0, b = 0;
            for (uint32_t j = 0; j < d; ++j) {
              a += double(q[j]) * rows.k[(u * hkv + h) * d + j];
              b += double(q[j]) * kh[(u * hkv + h) * d + j];
            }
            e.logit_num += (a - b) * (a - b);
            e.logit_den += a * a;
            s[u] = a * scale;
            sh[u] = b * scale;
            m = std::max(m, s[u]);
            mh = std::max(mh, sh[u]);
          }
          double z = 0, zh = 0;
          std::vector<double> out(d, 0.0), outh(d, 0.0);
          for (uint64_t u = seq_start; u <= t; ++u) {
            const double w = std::exp(s[u] - m), wh = std::exp(sh[u] - mh);
            z += w;
            zh += wh;
            for (uint32_t j = 0; j < d; ++j) {
              out[j] += w * rows.v[(u * hkv + h) * d + j];
              outh[j] += wh * vh[(u * hkv + h) * d + j];
            }
          }
          for (uint32_t j = 0; j < d; ++j) {
            const double a = out[j] / z, b = outh[j] / zh;
            e.output_num += (a - b) * (a - b);
            e.output_den += a * a;
          }
        }
      }
      res.total.logit_num += e.logit_num;
      res.total.logit_den += e.logit_den;
      res.total.output_num += e.output_num;
      res.total.output_den += e.output_den;
    }
    results.push_back(std::move(res));
  }
  return results;
}

}  // namespace kvpool::tools
