// Rotation files (see kvpool/kernels/rotation_file.h).
#include "kvpool/kernels/rotation_file.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvpool/common/atomic_file.h"
#include "kvpool/common/bounded_file.h"
#include "kvpool/common/keys.h"
#include "kvpool/common/safetensors.h"
#include "kvpool/common/status.h"

namespace kvpool {
namespace {

std::string FloatString(float f) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), f);
  return std::string(buf, r.ptr);
}

std::string TensorName(uint32_t layer, KvKind kind, const char* what) {
  return absl::StrCat("layers.", layer, ".", KvKindName(kind), ".", what);
}

absl::StatusOr<uint32_t> ParseU32(const std::map<std::string, std::string>& m,
                                  const std::string& key) {
  auto it = m.find(key);
  if (it == m.end()) {
    return absl::InvalidArgumentError(absl::StrCat("rotation file: metadata '", key, "' missing"));
  }
  uint32_t v = 0;
  const std::string& s = it->second;
  auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (r.ec == std::errc::result_out_of_range && r.ptr == s.data() + s.size()) {
    return absl::InvalidArgumentError(absl::StrCat("rotation file: metadata '", key, "' = '", s,
                                                   "' is out of range (0..4294967295)"));
  }
  if (r.ec != std::errc() || r.ptr != s.data() + s.size() || s.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation file: metadata '", key, "' = '", s, "' is not an unsigned integer"));
  }
  return v;
}

absl::StatusOr<float> ParseFloat(const std::map<std::string, std::string>& m,
                                 const std::string& key) {
  auto it = m.find(key);
  if (it == m.end()) {
    return absl::InvalidArgumentError(absl::StrCat("rotation file: metadata '", key, "' missing"));
  }
  float v = 0;
  const std::string& s = it->second;
  auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size() || s.empty() || !std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation file: metadata '", key, "' = '", s, "' is not a number"));
  }
  return v;
}

std::string Opt(const std::map<std::string, std::string>& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? "" : it->second;
}

}  // namespace

std::string Sha256Hex(const std::string& bytes) {
  const Digest d = Sha256(bytes);
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) {
    s.push_back(kHex[b >> 4]);
    s.push_back(kHex[b & 15]);
  }
  return s;
}

absl::StatusOr<std::array<uint8_t, 32>> RotationIdFromHex(const std::string& hex) {
  if (hex.size() != 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation id must be 64 hex characters, got ", hex.size()));
  }
  std::array<uint8_t, 32> out{};
  for (int i = 0; i < 32; ++i) {
    auto nib = [&](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int hi = nib(hex[2 * i]), lo = nib(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError("rotation id is not hexadecimal");
    out[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return out;
}

std::string SerializeRotations(const RotationSet& rot) {
  const RotationMetadata& m = rot.metadata();
  SafetensorsWriter w;
  w.SetMetadata("format", kRotationFileFormat);
  w.SetMetadata("format_version", absl::StrCat(m.format_version));
  w.SetMetadata("objective", m.objective);
  w.SetMetadata("composition", m.composition);
  w.SetMetadata("model_name", m.model_name);
  w.SetMetadata("head_dim", absl::StrCat(m.head_dim));
  w.SetMetadata("num_layers", absl::StrCat(m.num_layers));
  w.SetMetadata("num_kv_heads", absl::StrCat(m.num_kv_heads));
  w.SetMetadata("clip_ratio_k", FloatString(m.clip_ratio_k));
  w.SetMetadata("clip_ratio_v", FloatString(m.clip_ratio_v));
  w.SetMetadata("source_hash", m.source_hash);
  const uint64_t d = m.head_dim, hr = rot.heads_per_layer();
  for (uint32_t l = 0; l < m.num_layers; ++l) {
    for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
      std::vector<uint64_t> shape =
          rot.per_head() ? std::vector<uint64_t>{hr, d, d} : std::vector<uint64_t>{d, d};
      const float* r = rot.Matrix(kind, l, 0);
      // Shapes are consistent by construction; AddF32 cannot fail here.
      (void)w.AddF32(TensorName(l, kind, "rotation"), shape,
                     absl::Span<const float>(r, hr * d * d));
      if (rot.has_eigenvalues()) {
        std::vector<uint64_t> es =
            rot.per_head() ? std::vector<uint64_t>{hr, d} : std::vector<uint64_t>{d};
        (void)w.AddF32(TensorName(l, kind, "eigenvalues"), es,
                       absl::Span<const float>(rot.Eigenvalues(kind, l, 0), hr * d));
      }
    }
  }
  return w.Serialize();
}

absl::Status WriteRotationFile(RotationSet* rot, const std::string& path) {
  const std::string bytes = SerializeRotations(*rot);
  KVPOOL_RETURN_IF_ERROR(WriteFileAtomically(path, bytes));
  rot->set_rotation_id_hex(Sha256Hex(bytes));
  return absl::OkStatus();
}

absl::Status CheckEigenvalues(const std::string& name, const std::vector<float>& data, uint64_t d) {
  for (size_t i = 0; i < data.size(); ++i) {
    if (!std::isfinite(data[i]))
      return absl::InvalidArgumentError(
          absl::StrCat("rotation file: tensor '", name, "' element ", i, " is not finite"));
  }
  // Per head (a [d] slice): the largest eigenvalue is the target's norm.
  for (size_t h = 0; h * d < data.size(); ++h) {
    float top = 0;
    for (uint64_t j = 0; j < d; ++j) top = std::max(top, data[h * d + j]);
    const float floor = -kRotationEigenvalueTolerance * top;
    for (uint64_t j = 0; j < d; ++j) {
      const float e = data[h * d + j];
      if (e < floor) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rotation file: tensor '", name, "' element ", h * d + j, " is ", FloatString(e),
            ": eigenvalues of the PSD targets C_Q / C_S (FORMAT.md §1) are >= 0 (up to ",
            FloatString(kRotationEigenvalueTolerance), " x the largest, ", FloatString(top), ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RotationSet> ParseRotations(const std::string& bytes) {
  // A GGUF model passed where the rotations belong would otherwise read as a safetensors
  // header length of ~5e9 (the magic "GGUF" as a little-endian u64): say what it is instead.
  if (bytes.compare(0, 4, "GGUF") == 0) {
    return absl::InvalidArgumentError(
        "rotation file: this is a GGUF file (a model, for --model), not an OSCAR rotation "
        ".safetensors file (make one with 'kvpool calibrate')");
  }
  auto parsed = SafetensorsFile::Parse(bytes);
  if (!parsed.ok()) return parsed.status();
  const SafetensorsFile& f = **parsed;
  const auto& md = f.metadata();
  if (Opt(md, "format") != kRotationFileFormat) {
    return absl::InvalidArgumentError(absl::StrCat("rotation file: metadata 'format' is '",
                                                   Opt(md, "format"), "', expected '",
                                                   kRotationFileFormat, "'"));
  }
  RotationMetadata m;
  KVPOOL_ASSIGN_OR_RETURN(m.format_version, ParseU32(md, "format_version"));
  KVPOOL_ASSIGN_OR_RETURN(m.head_dim, ParseU32(md, "head_dim"));
  KVPOOL_ASSIGN_OR_RETURN(m.num_layers, ParseU32(md, "num_layers"));
  KVPOOL_ASSIGN_OR_RETURN(m.num_kv_heads, ParseU32(md, "num_kv_heads"));
  KVPOOL_ASSIGN_OR_RETURN(m.clip_ratio_k, ParseFloat(md, "clip_ratio_k"));
  KVPOOL_ASSIGN_OR_RETURN(m.clip_ratio_v, ParseFloat(md, "clip_ratio_v"));
  m.objective = Opt(md, "objective");
  m.composition = Opt(md, "composition");
  m.model_name = Opt(md, "model_name");
  m.source_hash = Opt(md, "source_hash");
  if (m.format_version != 1 && m.format_version != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("rotation file: format_version ", m.format_version, " is not 1 or 2"));
  }
  if (m.head_dim < 8 || m.head_dim > 1024 || (m.head_dim & (m.head_dim - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("rotation file: head_dim ", m.head_dim,
                                                   " is not a power of two in [8, 1024]"));
  }
  if (m.num_layers == 0 || m.num_layers > 4096 || m.num_kv_heads == 0 || m.num_kv_heads > 4096) {
    return absl::InvalidArgumentError("rotation file: num_layers / num_kv_heads out of range");
  }
  const uint64_t d = m.head_dim;
  const uint64_t hr = m.format_version == 2 ? m.num_kv_heads : 1;
  const bool has_eig = f.Find(TensorName(0, KvKind::kKey, "eigenvalues")) != nullptr;
  std::vector<float> k, v, ke, ve;
  for (uint32_t l = 0; l < m.num_layers; ++l) {
    for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
      for (const char* what : {"rotation", "eigenvalues"}) {
        const bool is_rot = what[0] == 'r';
        if (!is_rot && !has_eig) continue;
        const std::string name = TensorName(l, kind, what);
        const SafetensorsTensor* t = f.Find(name);
        if (!t)
          return absl::InvalidArgumentError(
              absl::StrCat("rotation file: tensor '", name, "' missing"));
        std::vector<uint64_t> want;
        if (hr > 1) want.push_back(hr);
        want.push_back(d);
        if (is_rot) want.push_back(d);
        if (t->dtype != SafetensorsDtype::kF32 || t->shape != want) {
          return absl::InvalidArgumentError(absl::StrCat(
              "rotation file: tensor '", name, "' is ", SafetensorsDtypeName(t->dtype), " [",
              absl::StrJoin(t->shape, ","), "], expected F32 [", absl::StrJoin(want, ","), "]"));
        }
        KVPOOL_ASSIGN_OR_RETURN(std::vector<float> data, f.ReadF32(name));
        // Rotation entries: finite here, orthogonal below; eigenvalues are those
        // of the symmetric PSD targets C_Q / C_S (FORMAT.md §1): finite, and not negative
        // beyond rounding (CheckEigenvalues).
        if (!is_rot) KVPOOL_RETURN_IF_ERROR(CheckEigenvalues(name, data, d));
        // Not finite: the tensor and the entry's index in it (newcomer 11b F6: RotationSet's own
        // check said "k rotations element 137", an index across every layer).
        for (size_t i = 0; is_rot && i < data.size(); ++i) {
          if (std::isfinite(data[i])) continue;
          const std::string head = hr > 1 ? absl::StrCat("[", i / (d * d), "]") : "";
          return absl::InvalidArgumentError(absl::StrCat("rotation file: tensor '", name,
                                                         "' element ", head, "[", i / d % d, "][",
                                                         i % d, "] is not finite"));
        }
        auto& dst = is_rot ? (kind == KvKind::kKey ? k : v) : (kind == KvKind::kKey ? ke : ve);
        dst.insert(dst.end(), data.begin(), data.end());
      }
    }
  }
  // Every tensor must be one the metadata describes: a file whose num_layers understates its
  // content (hand-edited, or truncated metadata) would otherwise load as a smaller model.
  const size_t expected = size_t(m.num_layers) * 2 * (has_eig ? 2 : 1);
  if (f.tensors().size() != expected) {
    for (const SafetensorsTensor& t : f.tensors()) {
      bool described = false;
      for (uint32_t l = 0; l < m.num_layers && !described; ++l)
        for (KvKind kind : {KvKind::kKey, KvKind::kValue})
          for (const char* what : {"rotation", "eigenvalues"})
            described = described || t.name == TensorName(l, kind, what);
      if (!described)
        return absl::InvalidArgumentError(
            absl::StrCat("rotation file: tensor '", t.name,
                         "' is not described by the metadata (num_layers ", m.num_layers, ")"));
    }
  }
  auto set = RotationSet::FromMatrices(std::move(m), std::move(k), std::move(v), std::move(ke),
                                       std::move(ve));
  if (!set.ok()) return Annotate(set.status(), "rotation file");
  // Every matrix must be orthogonal: the pool applies R and the worker Rᵀ as its inverse, so a
  // non-orthogonal matrix silently corrupts every decoded token (FORMAT.md §4).
  for (uint32_t l = 0; l < set->metadata().num_layers; ++l) {
    for (uint32_t h = 0; h < hr; ++h) {
      for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
        const double err = set->OrthogonalityError(kind, l, h);
        if (!(err <= kRotationOrthogonalityTolerance)) {
          std::string name = TensorName(l, kind, "rotation");
          if (hr > 1) absl::StrAppend(&name, "[", h, "]");
          char buf[32];
          std::snprintf(buf, sizeof(buf), "%.3e", err);
          return absl::InvalidArgumentError(absl::StrCat(
              "rotation file: tensor '", name, "' is not orthogonal: max |R Rt - I| = ", buf,
              " > tolerance ", kRotationOrthogonalityTolerance));
        }
      }
    }
  }
  set->set_rotation_id_hex(Sha256Hex(bytes));
  return set;
}

absl::StatusOr<RotationSet> ReadRotationFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open rotation file '", path, "'", RelativePathNote(path)));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  auto r = ParseRotations(ss.str());
  if (!r.ok()) return Annotate(r.status(), path);
  return r;
}

absl::Status CheckRotationsMatch(const RotationSet& rot, const ExpectedRotationModel& e) {
  const RotationMetadata& m = rot.metadata();
  std::vector<std::string> bad;
  if (!e.model_name.empty() && m.model_name != e.model_name) {
    bad.push_back(absl::StrCat("model_name '", m.model_name, "' != '", e.model_name, "'"));
  }
  if (m.head_dim != e.head_dim)
    bad.push_back(absl::StrCat("head_dim ", m.head_dim, " != ", e.head_dim));
  if (m.num_layers != e.num_layers) {
    bad.push_back(absl::StrCat("num_layers ", m.num_layers, " != ", e.num_layers));
  }
  if (m.num_kv_heads != e.num_kv_heads) {
    bad.push_back(absl::StrCat("num_kv_heads ", m.num_kv_heads, " != ", e.num_kv_heads));
  }
  if (e.clip_ratio_k && m.clip_ratio_k != *e.clip_ratio_k) {
    bad.push_back(absl::StrCat("clip_ratio_k ", FloatString(m.clip_ratio_k),
                               " != ", FloatString(*e.clip_ratio_k)));
  }
  if (e.clip_ratio_v && m.clip_ratio_v != *e.clip_ratio_v) {
    bad.push_back(absl::StrCat("clip_ratio_v ", FloatString(m.clip_ratio_v),
                               " != ", FloatString(*e.clip_ratio_v)));
  }
  if (bad.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("rotation file does not match the model: ", absl::StrJoin(bad, "; ")));
}

std::string RotationModelNameMismatch(const RotationSet& rot, const std::string& model_name) {
  const RotationMetadata& m = rot.metadata();
  if (m.model_name.empty() || m.model_name == model_name) return "";
  return absl::StrCat("the rotation file was calibrated for model '", m.model_name, "', not '",
                      model_name, "' (the model file's name): only its geometry (head_dim ",
                      m.head_dim, ", ", m.num_layers, " layers, ", m.num_kv_heads,
                      " KV heads) is checked, so a file fitted on another model of that shape "
                      "quantizes this one with rotations that are not its own (kvpool calibrate "
                      "--model on this model writes a matching one)");
}

}  // namespace kvpool
