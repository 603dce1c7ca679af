// kvpool — command-line tools for OSCAR rotations and INT2 quantization.
//
//   kvpool quantize --in X.npy [--rotation none|hadamard|FILE --layer L --kind k|v] [--clip R]
//                   [--dequant-out Y.npy] [--packed-out P.bin]
//   kvpool rotations inspect FILE
//   kvpool calibrate --model GGUF --text FILE [--tokens N] --out rot.safetensors [--per-head]
//   kvpool evaluate  --model GGUF --rotations FILE --text FILE [--tokens N]
//
// Results go to standard output, logs to standard error. Exit codes: 0 ok, 1 usage, 2 runtime.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvpool/common/cli.h"
#include "kvpool/common/log.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/quantize.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/kernels/rotation_file.h"
#include "model_eval.h"
#include "npy.h"

namespace kvpool::tools {
namespace {

int Fail(const absl::Status& s) {
  std::cerr << "kvpool: " << s << "\n";
  return cli::kExitRuntime;
}

// CLI11 check for a clip ratio: 0 (disabled) or in (0, 1] (FORMAT.md §2.2); refuses nan,
// negatives and values above 1 at parse time (exit 1 naming the flag).
const CLI::Validator kClipRatio(
    [](std::string& v) -> std::string {
      double d = 0;
      if (!CLI::detail::lexical_cast(v, d) || !(d >= 0.0 && d <= 1.0)) {
        return "must be 0 (disabled) or in (0, 1], got '" + v + "'";
      }
      // The file records a float32: a positive ratio that rounds to 0 there (1e-50) would
      // silently disable clipping (newcomer report 13b).
      if (d > 0.0 && static_cast<float>(d) == 0.0f) {
        return "'" + v +
               "' is positive but rounds to 0 in the file's float32 (clipping disabled); " +
               "give 0 to disable clipping, or a ratio of at least 1e-38";
      }
      // "-0" is 0: recorded as -0 it gave another rotation id, revision and namespace for the
      // same "clipping disabled" (newcomer report 13 F9).
      if (d == 0.0) v = "0";
      return {};
    },
    "RATIO in [0,1]");

// Largest .npy `kvpool quantize --in` reads (docs/TOOLS.md "Input files").
constexpr uint64_t kMaxNpyFileBytes = uint64_t{16} << 30;

// CLI11 check for an index: a non-negative integer (CLI::NonNegativeNumber's message printed a
// range up to 1.797e308), in plain decimal as kvpool::cli::Range reads it: lexical_cast read
// "010" as octal 8 and took "0x10" and "+1" (newcomer 16 F2).
const CLI::Validator kIndex(
    [](std::string& v) -> std::string {
      if (kvpool::cli::SpellingOf(v) != kvpool::cli::DecimalSpelling::kPlain) {
        return "must be an index >= 0 in plain decimal (no leading zero, sign, hex or spaces), "
               "got '" +
               v + "'";
      }
      std::string copy = v;
      if (!kvpool::cli::Range(int64_t{0}, int64_t{INT32_MAX})(copy).empty()) {
        // A value beyond the largest index is not "< 0" (newcomer 16b: --head 99999999999 was
        // told it "must be an index >= 0").
        return v[0] == '-' ? "must be an index >= 0, got '" + v + "'"
                           : "must be an index in 0..2147483647, got '" + v + "'";
      }
      return {};
    },
    "INDEX >= 0");

// Fewest text tokens `calibrate --tokens` accepts, and below how many it warns: a rotation is
// the eigenbasis of a head_dim x head_dim covariance, which fewer tokens than head_dim leave
// rank-deficient (the eigenvectors of its zero eigenvalues are arbitrary). 16 is a fixed floor
// (the flag is checked before the model, hence head_dim, is known; head_dim is 8 for stories260K
// and 64..256 for real models), not head_dim itself: the messages say so (newcomer report 11
// F10: '--tokens 15' was refused "because fewer tokens than head_dim", head_dim being 8).
constexpr int64_t kMinCalibrationTokens = 16;
constexpr int64_t kFewCalibrationTokens = 256;
// Largest --tokens: a bound on a count, not a budget (0 already means "all the text").
constexpr int64_t kMaxTextTokens = INT32_MAX;

// "nan", "+inf" or "-inf" for a non-finite value.
const char* NonFiniteKind(float v) { return std::isnan(v) ? "nan" : (v > 0 ? "+inf" : "-inf"); }

struct QuantizeArgs {
  std::string in, rotation = "none", kind = "k", dequant_out, packed_out;
  int layer = 0;
  int head = -1;
  float clip = -1;
};

int RunQuantize(const QuantizeArgs& a) {
  auto x = ReadNpyF32(a.in);
  if (!x.ok()) return Fail(x.status());
  if (x->shape.size() != 2 && x->shape.size() != 3) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--in must be float32 [tokens, d] or [tokens, heads, d], got ",
                     x->shape.size(), " dimensions")));
  }
  const uint32_t d = static_cast<uint32_t>(x->shape.back());
  if (auto s = ValidateHeadDim(d, "last dimension of --in (head_dim)"); !s.ok()) return Fail(s);
  const uint64_t tokens = x->shape[0];
  const uint32_t heads = x->shape.size() == 3 ? static_cast<uint32_t>(x->shape[1]) : 1;
  // An array without rows printed errors of 0 and 6 bits per element over nothing (newcomer s8
  // N7).
  if (tokens == 0 || heads == 0) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--in '", a.in, "' has 0 ", tokens == 0 ? "tokens" : "heads", " (shape [",
                     absl::StrJoin(x->shape, ", "), "]): nothing to quantize")));
  }
  // Name the first non-finite input element by its index in --in (the rotation would smear it
  // over the whole row and lose its position and sign).
  for (uint64_t i = 0; i < x->data.size(); ++i) {
    if (std::isfinite(x->data[i])) continue;
    const uint64_t t = i / (uint64_t{heads} * d), h = (i / d) % heads, j = i % d;
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--in element [", t, heads > 1 ? absl::StrCat(",", h) : "", ",", j, "] is ",
                     NonFiniteKind(x->data[i]), " (NaN/Inf are refused, FORMAT.md §2.5)")));
  }
  if (a.kind != "k" && a.kind != "v") {
    return Fail(absl::InvalidArgumentError("--kind must be k or v, got '" + a.kind + "'"));
  }
  const KvKind kind = a.kind == "k" ? KvKind::kKey : KvKind::kValue;
  RotationMetadata meta{.head_dim = d, .num_layers = 1, .num_kv_heads = heads};
  absl::StatusOr<RotationSet> rot;
  uint32_t layer = 0;
  if ((a.rotation == "none" || a.rotation == "hadamard") && a.layer != 0) {
    std::cerr << "kvpool: --layer " << a.layer << " needs a rotation file (--rotation "
              << a.rotation << " has a single layer 0)\n";
    return cli::kExitUsage;
  }
  if ((a.rotation == "none" || a.rotation == "hadamard") && a.head >= 0) {
    std::cerr << "kvpool: --head " << a.head << " needs a per-head rotation file (--rotation "
              << a.rotation << " is one matrix for every head)\n";
    return cli::kExitUsage;
  }
  if (a.rotation == "none") {
    rot = RotationSet::Identity(meta);
  } else if (a.rotation == "hadamard") {
    rot = RotationSet::Hadamard(meta);
  } else {
    rot = ReadRotationFile(a.rotation);
    if (rot.ok()) {
      if (rot->head_dim() != d) {
        return Fail(absl::FailedPreconditionError(
            absl::StrCat("rotation file head_dim ", rot->head_dim(), " != input head_dim ", d)));
      }
      if (a.layer < 0 || static_cast<uint32_t>(a.layer) >= rot->num_layers()) {
        return Fail(absl::InvalidArgumentError(absl::StrCat(
            "--layer ", a.layer, " out of range (file has ", rot->num_layers(), " layers)")));
      }
      if (rot->per_head() && heads != 1 && heads != rot->num_kv_heads()) {
        return Fail(absl::FailedPreconditionError(absl::StrCat(
            "input has ", heads, " heads, the per-head rotation file ", rot->num_kv_heads())));
      }
      if (a.head >= 0 && !rot->per_head()) {
        return Fail(absl::InvalidArgumentError(
            absl::StrCat("--head ", a.head, " needs a per-head rotation file; '", a.rotation,
                         "' has one rotation per layer")));
      }
      if (a.head >= 0 && static_cast<uint32_t>(a.head) >= rot->num_kv_heads()) {
        return Fail(absl::InvalidArgumentError(absl::StrCat(
            "--head ", a.head, " out of range (file has ", rot->num_kv_heads(), " KV heads)")));
      }
      layer = static_cast<uint32_t>(a.layer);
    }
  }
  if (!rot.ok()) return Fail(rot.status());
  float clip = a.clip;
  if (clip < 0) {
    clip = kind == KvKind::kKey ? rot->metadata().clip_ratio_k : rot->metadata().clip_ratio_v;
  }
  if (auto s = ValidateClipRatio(clip, "--clip"); !s.ok()) return Fail(s);

  const uint32_t ng = d / std::min<uint32_t>(d, 128);
  std::vector<float> deq(x->data.size());
  std::vector<uint8_t> codes(tokens * heads * d / 4);
  std::vector<uint16_t> params(tokens * heads * 2 * ng);
  std::vector<float> rows(tokens * d), rotated(tokens * d), back(tokens * d), hat(tokens * d);
  double err2 = 0, ref2 = 0, max_abs = 0;
  uint64_t overflow = 0;
  for (uint32_t h = 0; h < heads; ++h) {
    const uint32_t rh = a.head >= 0 ? static_cast<uint32_t>(a.head) : (heads == 1 ? 0 : h);
    if (rot->per_head() && rh >= rot->num_kv_heads()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("--head ", rh, " out of range")));
    }
    const float* r = rot->Matrix(kind, layer, rh);
    for (uint64_t t = 0; t < tokens; ++t)
      std::copy_n(&x->data[(t * heads + h) * d], d, &rows[t * d]);
    RotateRows(rows.data(), tokens, d, r, rotated.data());
    std::vector<uint8_t> c(tokens * d / 4);
    std::vector<uint16_t> p(tokens * 2 * ng);
    QuantizeRowsResult res;
    absl::Status s = QuantizeRows(rotated.data(), tokens, d, clip, c.data(), p.data(), &res);
    if (!s.ok()) return Fail(Annotate(s, absl::StrCat("head ", h)));
    overflow += res.overflow_rows;
    for (uint64_t t = 0; t < tokens; ++t) {
      DequantizeRow(&c[t * d / 4], &p[t * 2 * ng], d, &hat[t * d]);
      std::copy_n(&c[t * d / 4], d / 4, &codes[(t * heads + h) * d / 4]);
      std::copy_n(&p[t * 2 * ng], 2 * ng, &params[(t * heads + h) * 2 * ng]);
    }
    RotateRowsTransposed(hat.data(), tokens, d, r, back.data());
    for (uint64_t t = 0; t < tokens; ++t) {
      for (uint32_t j = 0; j < d; ++j) {
        const double e = double(back[t * d + j]) - rows[t * d + j];
        err2 += e * e;
        ref2 += double(rows[t * d + j]) * rows[t * d + j];
        max_abs = std::max(max_abs, std::fabs(e));
        deq[(t * heads + h) * d + j] = back[t * d + j];
      }
    }
  }
  const double bits = (d / 4 * 8.0 + 32.0 * ng) / d;
  std::printf("input            %s [%llu x %u x %u]\n", a.in.c_str(),
              static_cast<unsigned long long>(tokens), heads, d);
  std::printf("rotation         %s (%s, layer %u, kind %s), clip %g, isa %s\n", a.rotation.c_str(),
              rot->metadata().objective.c_str(), layer, a.kind.c_str(), clip,
              IsaName(ResolveIsa(KernelIsa::kAuto)));
  std::printf("relative L2 err  %.6f\n", ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0);
  std::printf("max abs err      %.6g\n", max_abs);
  std::printf("bits/element     %.4f (codes 2 + fp16 scale/min %.4f)\n", bits, bits - 2.0);
  std::printf("fp16 overflow    %llu rows (stored as zero; such blocks keep BF16)\n",
              static_cast<unsigned long long>(overflow));
  // Outputs replace their file atomically and write through a symbolic link (cli.h).
  if (!a.dequant_out.empty()) {
    auto bytes = SerializeNpyF32(x->shape, deq);
    if (!bytes.ok()) return Fail(bytes.status());
    if (auto s = cli::WriteOutputFile(a.dequant_out, *bytes); !s.ok()) return Fail(s);
  }
  if (!a.packed_out.empty()) {
    std::string bytes(reinterpret_cast<const char*>(codes.data()), codes.size());
    bytes.append(reinterpret_cast<const char*>(params.data()), params.size() * 2);
    if (auto s = cli::WriteOutputFile(a.packed_out, bytes); !s.ok()) return Fail(s);
  }
  return cli::kExitOk;
}

int RunInspect(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is a directory, not a rotation .safetensors file")));
  }
  auto rot = ReadRotationFile(path);
  if (!rot.ok()) return Fail(rot.status());
  const RotationMetadata& m = rot->metadata();
  std::printf("file             %s\n", path.c_str());
  std::printf("rotation id      %s\n", rot->rotation_id_hex().c_str());
  std::printf("format_version   %u (%s)\n", m.format_version,
              m.format_version == 2 ? "one rotation per (layer, KV head)" : "one per layer");
  std::printf("objective        %s\n", m.objective.c_str());
  std::printf("composition      %s\n", m.composition.c_str());
  std::printf("model_name       %s\n", m.model_name.c_str());
  std::printf("geometry         head_dim %u, num_layers %u, num_kv_heads %u\n", m.head_dim,
              m.num_layers, m.num_kv_heads);
  std::printf("clip ratios      k %g, v %g\n", m.clip_ratio_k, m.clip_ratio_v);
  std::printf("source_hash      %s\n", m.source_hash.c_str());
  std::printf("tensors          layers.{i}.{k,v}.rotation %s%s\n",
              rot->per_head()
                  ? absl::StrCat("[", m.num_kv_heads, ",", m.head_dim, ",", m.head_dim, "]").c_str()
                  : absl::StrCat("[", m.head_dim, ",", m.head_dim, "]").c_str(),
              rot->has_eigenvalues() ? " + eigenvalues" : "");
  std::printf("%-6s %-5s %-4s %14s %14s %14s\n", "layer", "head", "kind", "orth_err", "eig_min",
              "eig_max");
  for (uint32_t l = 0; l < m.num_layers; ++l) {
    for (uint32_t h = 0; h < rot->heads_per_layer(); ++h) {
      for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
        const float* e = rot->Eigenvalues(kind, l, h);
        std::printf("%-6u %-5s %-4s %14.3e", l, rot->per_head() ? std::to_string(h).c_str() : "-",
                    KvKindName(kind), rot->OrthogonalityError(kind, l, h));
        if (e) {
          std::printf(" %14.6g %14.6g\n", e[0], e[m.head_dim - 1]);
        } else {
          std::printf(" %14s %14s\n", "-", "-");
        }
      }
    }
  }
  std::printf("max orth_err     %.3e\n", rot->MaxOrthogonalityError());
  return cli::kExitOk;
}

// The --tokens bounds of calibrate and evaluate, applied to the text tokens a run used (the
// text's, capped by --tokens): fewer than kMinCalibrationTokens refuses (exit 2, `what` says
// what is not done), fewer than kFewCalibrationTokens warns. Returns the exit code, or -1 to go
// on. Newcomer report s6 #4: a 3-token text under the default --tokens 0 wrote a rotation with
// no word; s8 N7: evaluate printed per-layer errors over a 2-token text.
int CheckTokensUsed(const char* subcommand, const std::string& text_path, int64_t max_tokens,
                    int64_t used, const char* why_min, const char* what) {
  const std::string source =
      absl::StrCat("--text '", text_path, "'",
                   max_tokens > 0 ? absl::StrCat(" (--tokens ", max_tokens, ")") : "");
  if (used < kMinCalibrationTokens) {
    std::cerr << "kvpool: " << source << " gives " << used << " tokens, fewer than "
              << kMinCalibrationTokens << ": " << why_min << "; " << what << "\n";
    return cli::kExitRuntime;
  }
  if (used < kFewCalibrationTokens) {
    KVPOOL_LOG_WARN("{}: {} gives {} tokens, which is few; {} (use {} or more)", subcommand, source,
                    used,
                    std::string(subcommand) == "calibrate"
                        ? "rotations fitted on fewer tokens than a few times head_dim are noisy"
                        : "errors measured on so few tokens are noisy",
                    kFewCalibrationTokens);
  }
  return -1;
}

int RunCalibrate(const CalibrateOptions& o, const std::string& out) {
  CalibrateOptions opt = o;
  int64_t used = 0;  // text tokens the fit saw: the text's, capped by --tokens
  opt.progress = [&used](int64_t done, int64_t total) {
    used = total;
    KVPOOL_LOG_INFO("calibrate: {}/{} text tokens through the model", done, total);
  };
  auto rot = CalibrateModel(opt);
  if (!rot.ok()) return Fail(rot.status());
  if (int rc = CheckTokensUsed("calibrate", o.text_path, o.max_tokens, used,
                               "too few to fit a rotation on (16 is calibrate's fixed floor)",
                               "nothing written");
      rc >= 0) {
    return rc;
  }
  // Atomic, and through a symbolic link (cli.h); the id is the SHA-256 of the file's bytes, as
  // WriteRotationFile records it.
  const std::string bytes = SerializeRotations(*rot);
  if (auto s = cli::WriteOutputFile(out, bytes); !s.ok()) return Fail(s);
  rot->set_rotation_id_hex(Sha256Hex(bytes));
  std::printf("wrote %s: %u layers, %s, max orth_err %.3e, rotation id %s\n", out.c_str(),
              rot->num_layers(), rot->per_head() ? "per head (v2)" : "per layer (v1)",
              rot->MaxOrthogonalityError(), rot->rotation_id_hex().c_str());
  return cli::kExitOk;
}

int RunEvaluate(const EvaluateOptions& o, const std::string& rotations_path) {
  auto oscar = ReadRotationFile(rotations_path);
  if (!oscar.ok()) return Fail(oscar.status());
  auto meta = ModelRotationMetadata(o.model_path);
  if (!meta.ok()) return Fail(meta.status());
  // Only the geometry is refused (EvaluateModel); a name that differs is warned about.
  if (const std::string note = RotationModelNameMismatch(*oscar, meta->model_name); !note.empty()) {
    KVPOOL_LOG_WARN("evaluate: --rotations '{}': {}", rotations_path, note);
  }
  auto none = RotationSet::Identity(*meta);
  auto had = RotationSet::Hadamard(*meta);
  if (!none.ok()) return Fail(none.status());
  if (!had.ok()) return Fail(had.status());
  EvaluateOptions eo = o;
  eo.clip_ratio_k = oscar->metadata().clip_ratio_k;
  eo.clip_ratio_v = oscar->metadata().clip_ratio_v;
  int64_t used = 0;  // text tokens evaluated: the text's, capped by --tokens
  eo.progress = [&used](int64_t, int64_t total) { used = total; };
  auto res = EvaluateModel(eo, {{"none", &*none}, {"hadamard", &*had}, {"oscar", &*oscar}});
  if (!res.ok()) return Fail(res.status());
  // calibrate's bounds (TOOLS.md): errors over a handful of rows compare the rotations on next
  // to nothing.
  if (int rc = CheckTokensUsed("evaluate", o.text_path, o.max_tokens, used,
                               "errors over so few tokens say nothing about a rotation",
                               "nothing printed");
      rc >= 0) {
    return rc;
  }
  std::printf("model %s, text %s, all K/V INT2 (clip k %g, v %g); relative errors\n",
              o.model_path.c_str(), o.text_path.c_str(), eo.clip_ratio_k, eo.clip_ratio_v);
  std::printf("%-6s", "layer");
  for (const auto& r : *res)
    std::printf(" %12s %12s", (r.name + ":logit").c_str(), (r.name + ":out").c_str());
  std::printf("\n");
  const size_t layers = res->front().layers.size();
  for (size_t l = 0; l <= layers; ++l) {
    std::printf("%-6s", l < layers ? std::to_string(l).c_str() : "all");
    for (const auto& r : *res) {
      const LayerError& e = l < layers ? r.layers[l] : r.total;
      std::printf(" %12.4f %12.4f", e.logit(), e.output());
    }
    std::printf("\n");
  }
  return cli::kExitOk;
}

}  // namespace
}  // namespace kvpool::tools

int main(int argc, char** argv) {
  using namespace kvpool::tools;
  CLI::App app{"kvpool — OSCAR rotation and INT2 quantization tools"};
  kvpool::cli::Setup(app, "kvpool");
  app.require_subcommand(1);

  QuantizeArgs q;
  auto* quant = app.add_subcommand("quantize",
                                   "quantize a float32 .npy array to OSCAR INT2 and "
                                   "print error statistics");
  CLI::Option* quant_in =
      quant->add_option("--in", q.in, "float32 [tokens, d] or [tokens, heads, d] .npy")
          ->required()
          ->check(kvpool::cli::InputFile(kMaxNpyFileBytes));
  CLI::Option* quant_rot =
      quant
          ->add_option("--rotation", q.rotation,
                       "none | hadamard | a rotation .safetensors file (a file named none or "
                       "hadamard: give its path, ./hadamard)")
          ->capture_default_str()
          ->check(kvpool::cli::InputFile(kvpool::cli::kMaxRotationFileBytes, {"none", "hadamard"}));
  quant->add_option("--layer", q.layer, "layer of the rotation file (needs a rotation file)")
      ->check(kIndex)
      ->capture_default_str();
  // The defaults of --head and --clip are "unset" (-1 inside, outside the checked ranges), so
  // --help shows what they mean instead of the sentinel.
  quant
      ->add_option("--head", q.head,
                   "KV head of a per-head rotation file (default: the input's own head index, "
                   "head 0 for a [tokens, d] input)")
      ->check(kIndex)
      ->default_str("input head");
  quant->add_option("--kind", q.kind, "k | v (rotation and default clip ratio)")
      ->check(CLI::IsMember({"k", "v"}))
      ->capture_default_str();
  quant
      ->add_option("--clip", q.clip,
                   "clip ratio (0 disables; default: the rotation file's ratio for --kind, or "
                   "0.96 for k / 0.92 for v with --rotation none|hadamard)")
      ->transform(kClipRatio)
      ->default_str("file's ratio");
  CLI::Option* dequant_out = quant
                                 ->add_option("--dequant-out", q.dequant_out,
                                              "write the dequantized array (.npy, input space)")
                                 ->check(kvpool::cli::OutputFile());
  CLI::Option* packed_out =
      quant
          ->add_option(
              "--packed-out", q.packed_out,
              "write codes [tokens][heads][d/4] then fp16 {scale,min} [tokens][heads][d/G]")
          ->check(kvpool::cli::OutputFile());

  std::string inspect_path;
  auto* rots = app.add_subcommand("rotations", "rotation file tools");
  rots->require_subcommand(1);
  auto* inspect = rots->add_subcommand("inspect", "print metadata, shapes, orthogonality error");
  inspect->add_option("file", inspect_path, "rotation .safetensors file")
      ->required()
      ->check(kvpool::cli::InputFile(kvpool::cli::kMaxRotationFileBytes));

  CalibrateOptions c;
  std::string out;
  int64_t ctokens = 0;
  auto* calib = app.add_subcommand("calibrate", "fit OSCAR rotations on a model and a text");
  CLI::Option* calib_model = calib->add_option("--model", c.model_path, "GGUF model")
                                 ->required()
                                 ->check(kvpool::cli::InputFile(kvpool::cli::kMaxModelFileBytes));
  CLI::Option* calib_text = calib->add_option("--text", c.text_path, "calibration text file")
                                ->required()
                                ->check(kvpool::cli::InputFile(kvpool::cli::kMaxTextFileBytes));
  calib
      ->add_option(
          "--tokens", ctokens,
          absl::StrCat("use at most N text tokens (0 = all; at least ", kMinCalibrationTokens,
                       ", a warning below ", kFewCalibrationTokens, ")"))
      ->check(kvpool::cli::Range(int64_t{0}, kMaxTextTokens))
      ->capture_default_str();
  CLI::Option* calib_out = calib->add_option("--out", out, "output rotation .safetensors")
                               ->required()
                               ->check(kvpool::cli::OutputFile());
  calib->add_flag("--per-head", c.per_head, "one rotation per (layer, KV head) (format_version 2)");
  calib->add_option("--clip-k", c.clip_ratio_k, "K clip ratio recorded in the file")
      ->transform(kClipRatio)
      ->capture_default_str();
  calib->add_option("--clip-v", c.clip_ratio_v, "V clip ratio recorded in the file")
      ->transform(kClipRatio)
      ->capture_default_str();

  // An output that is one of the inputs (or the other output) would replace it (newcomer s7 F7).
  kvpool::cli::RefuseSameFiles(quant, {{dequant_out}, {packed_out}},
                               {{quant_in}, {quant_rot, {"none", "hadamard"}}});
  kvpool::cli::RefuseSameFiles(calib, {{calib_out}}, {{calib_model}, {calib_text}});

  EvaluateOptions e;
  std::string eval_rot;
  int64_t etokens = 0;
  auto* eval = app.add_subcommand(
      "evaluate", "logit and attention-output error of none / hadamard / OSCAR on a model");
  eval->add_option("--model", e.model_path, "GGUF model")
      ->required()
      ->check(kvpool::cli::InputFile(kvpool::cli::kMaxModelFileBytes));
  eval->add_option("--rotations", eval_rot, "OSCAR rotation file")
      ->required()
      ->check(kvpool::cli::InputFile(kvpool::cli::kMaxRotationFileBytes));
  eval->add_option("--text", e.text_path,
                   "evaluation text (use a different one than "
                   "calibration)")
      ->required()
      ->check(kvpool::cli::InputFile(kvpool::cli::kMaxTextFileBytes));
  eval->add_option(
          "--tokens", etokens,
          absl::StrCat("use at most N text tokens (0 = all; at least ", kMinCalibrationTokens,
                       ", a warning below ", kFewCalibrationTokens, ", as for calibrate)"))
      ->check(kvpool::cli::Range(int64_t{0}, kMaxTextTokens))
      ->capture_default_str();

  // `kvpool SUBCOMMAND --config FILE` reached the root's --config only after the subcommand's
  // required flags were checked, so the file was never read, not even checked for existence
  // (newcomer report s6 #5). Every subcommand takes --config only to refuse it, naming the file
  // and where it goes.
  for (CLI::App* sub : {quant, rots, inspect, calib, eval}) {
    sub->add_option_function<std::string>(
           "--config",
           [sub](const std::string& path) {
             throw CLI::ValidationError(
                 "--config", "'" + path + "' is not read after the subcommand '" + sub->get_name() +
                                 "': give it first (kvpool --config FILE SUBCOMMAND ...), with "
                                 "the subcommand's flags in a section named after it");
           },
           "not read here: give --config FILE before the subcommand")
        ->trigger_on_parse();
  }
  KVPOOL_CLI_PARSE(app, argc, argv);
  if (*quant) return RunQuantize(q);
  if (*inspect) return RunInspect(inspect_path);
  if (*calib) {
    if (ctokens < 0 || (ctokens > 0 && ctokens < kMinCalibrationTokens)) {
      std::cerr << "kvpool: --tokens must be 0 (all) or >= " << kMinCalibrationTokens << ", got "
                << ctokens << ": " << kMinCalibrationTokens
                << " is calibrate's fixed floor (a head_dim x head_dim target needs many more "
                   "tokens than head_dim; below "
                << kFewCalibrationTokens << " it warns)\n";
      return kvpool::cli::kExitUsage;
    }
    c.max_tokens = ctokens;
    return RunCalibrate(c, out);
  }
  if (*eval) {
    if (etokens > 0 && etokens < kMinCalibrationTokens) {
      std::cerr << "kvpool: --tokens must be 0 (all) or >= " << kMinCalibrationTokens << ", got "
                << etokens << ": errors over so few tokens say nothing about a rotation\n";
      return kvpool::cli::kExitUsage;
    }
    e.max_tokens = etokens;
    return RunEvaluate(e, eval_rot);
  }
  return kvpool::cli::kExitUsage;
}
