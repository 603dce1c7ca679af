// The reference Llama forward pass; see kvpool/engine/engine.h for the math and the contract.
#include "kvpool/engine/engine.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvpool/common/gguf.h"
#include "kvpool/common/status.h"

namespace kvpool::engine {
namespace {

// y[rows] = W[rows][cols] · x[cols].
void MatVec(const std::vector<float>& w, const float* x, int rows, int cols, float* y) {
  for (int r = 0; r < rows; ++r) {
    const float* row = w.data() + static_cast<size_t>(r) * cols;
    float acc = 0.0f;
    for (int c = 0; c < cols; ++c) {
      acc += row[c] * x[c];
    }
    y[r] = acc;
  }
}

// out = x / sqrt(mean(x²) + eps) ⊙ weight.
// False when the sum of squares is not finite (x holds values beyond ~1.8e19): the output is
// then 0 or NaN, not a normalized x, and the caller refuses it (CheckNorm).
bool RmsNorm(const float* x, const std::vector<float>& weight, int n, float eps, float* out) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) {
    ss += x[i] * x[i];
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) {
    out[i] = x[i] * inv * weight[i];
  }
  return std::isfinite(ss);
}

// Rotates adjacent pairs (2i, 2i+1), i < rope_dim/2, of each head of `v` by pos·inv_freq[i].
void Rope(float* v, int n_heads, int head_dim, int pos, const std::vector<float>& inv_freq) {
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = std::cos(angle), s = std::sin(angle);
    for (int h = 0; h < n_heads; ++h) {
      float* p = v + h * head_dim + 2 * i;
      const float a = p[0], b = p[1];
      p[0] = a * c - b * s;
      p[1] = a * s + b * c;
    }
  }
}

absl::StatusOr<int> GetDim(const GgufFile& f, std::string_view key, int fallback, bool required) {
  if (f.FindValue(key) == nullptr) {
    if (required) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata key '", std::string(key), "' is missing"));
    }
    return fallback;
  }
  auto v = f.GetUint(key);
  if (!v.ok()) {
    return absl::InvalidArgumentError(v.status().message());
  }
  if (*v < 1 || *v > (1u << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata key '", std::string(key), "' is ", *v, " (expected 1..2^24)"));
  }
  return static_cast<int>(*v);
}

// Reads tensor `name` as float32 after checking its GGUF dims equal `dims`.
absl::StatusOr<std::vector<float>> Weight(const GgufFile& f, const std::string& name,
                                          const std::vector<uint64_t>& dims) {
  const GgufTensor* t = f.FindTensor(name);
  if (t == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' is missing"));
  }
  if (t->dims != dims) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has dims [",
                                                   absl::StrJoin(t->dims, ","), "], expected [",
                                                   absl::StrJoin(dims, ","), "]"));
  }
  KVPOOL_ASSIGN_OR_RETURN(std::vector<float> w, f.ReadFloat32(name));
  // A NaN/Inf weight poisons every logit; sampling then "succeeds" with garbage or an instant
  // end of sequence. Refuse it at load, naming the tensor and the first bad element.
  for (size_t i = 0; i < w.size(); ++i) {
    if (!std::isfinite(w[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", name, "' element ", i, " is ",
          std::isnan(w[i]) ? "nan" : (w[i] > 0 ? "+inf" : "-inf"), " (weights must be finite)"));
    }
  }
  return w;
}

// The per-layer tensors Engine::Load reads, "blk.<l>." + each.
constexpr std::array<std::string_view, 9> kLayerTensors = {
    "attn_norm.weight", "attn_q.weight",   "attn_k.weight", "attn_v.weight",  "attn_output.weight",
    "ffn_norm.weight",  "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"};

// INVALID_ARGUMENT for the first tensor of `f` that Engine::Load does not read, with how many
// such tensors the file holds: a tensor is expected when it is token_embd.weight,
// output_norm.weight, output.weight or blk.<l>.<one of kLayerTensors> with l < n_layers. A layer
// beyond llama.block_count (newcomer report 11 F1: block_count 4 over 5 layers' tensors ran 4
// layers, exit 0) or a tensor of a feature this engine does not implement (e.g. rope_freqs) would
// otherwise be ignored and the model run as something it is not. Runs after every expected
// tensor was found, so a missing one is reported first (Weight: "tensor '...' is missing").
absl::Status CheckNoUnexpectedTensors(const GgufFile& f, int n_layers) {
  const GgufTensor* first = nullptr;
  std::string why;
  int count = 0;
  for (const GgufTensor& t : f.tensors()) {
    std::string_view name = t.name;
    if (name == "token_embd.weight" || name == "output_norm.weight" || name == "output.weight") {
      continue;
    }
    std::string reason;
    if (name.starts_with("blk.")) {
      name.remove_prefix(4);
      const size_t dot = name.find('.');
      uint32_t layer = 0;
      const std::string_view digits =
          dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
      // Canonical decimal only ("blk.04." is not layer 4).
      const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), layer);
      const bool numbered = !digits.empty() && ec == std::errc() &&
                            end == digits.data() + digits.size() &&
                            (digits.size() == 1 || digits[0] != '0');
      const std::string_view rest =
          dot == std::string_view::npos ? std::string_view() : name.substr(dot + 1);
      const bool known =
          std::find(kLayerTensors.begin(), kLayerTensors.end(), rest) != kLayerTensors.end();
      if (numbered && known && layer < static_cast<uint32_t>(n_layers)) {
        continue;
      }
      if (numbered && layer >= static_cast<uint32_t>(n_layers)) {
        reason = absl::StrCat("belongs to layer ", layer,
                              ", beyond the layers the metadata describes (llama.block_count ",
                              n_layers, ": layers 0..", n_layers - 1, ")");
      } else {
        reason = "is not a tensor of a llama layer this engine reads";
      }
    } else {
      reason = "is not a tensor of the llama model this engine reads";
    }
    if (first == nullptr) {
      first = &t;
      why = std::move(reason);
    }
    ++count;
  }
  if (first == nullptr) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor '", first->name, "' ", why, "; the file holds ", count,
      " tensor(s) the metadata does not describe (a model file whose metadata and tensors "
      "disagree is refused rather than run as a different model)"));
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

// ---- QkvRecorder ----------------------------------------------------------------------------

QkvRecorder::QkvRecorder(std::vector<int> layers) : layers_(std::move(layers)) {}

void QkvRecorder::OnAttentionInputs(int layer, int pos, absl::Span<const float> q,
                                    absl::Span<const float> k, absl::Span<const float> v) {
  if (layer < 0) {
    return;
  }
  if (!layers_.empty() && std::find(layers_.begin(), layers_.end(), layer) == layers_.end()) {
    return;
  }
  if (static_cast<size_t>(layer) >= rows_.size()) {
    rows_.resize(layer + 1);
  }
  Rows& r = rows_[layer];
  r.positions.push_back(pos);
  r.q.insert(r.q.end(), q.begin(), q.end());
  r.k.insert(r.k.end(), k.begin(), k.end());
  r.v.insert(r.v.end(), v.begin(), v.end());
}

const QkvRecorder::Rows& QkvRecorder::rows(int layer) const {
  if (layer < 0 || static_cast<size_t>(layer) >= rows_.size()) {
    return empty_;
  }
  return rows_[layer];
}

// ---- loading --------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const std::string& path) {
  auto engine = std::unique_ptr<Engine>(new Engine());
  if (auto s = engine->Load(path); !s.ok()) {
    // GgufFile errors already start with the path.
    if (absl::StartsWith(s.message(), path)) {
      return s;
    }
    return Annotate(s, path);
  }
  return engine;
}

absl::Status Engine::Load(const std::string& path) {
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  const GgufFile& f = *file;

  auto arch = f.GetString("general.architecture");
  if (!arch.ok()) {
    return absl::InvalidArgumentError(arch.status().message());
  }
  if (*arch != "llama") {
    return absl::FailedPreconditionError(absl::StrCat("metadata key 'general.architecture' is '",
                                                      *arch, "'; only 'llama' is supported"));
  }
  ModelConfig& c = config_;
  KVPOOL_ASSIGN_OR_RETURN(c.n_layers, GetDim(f, "llama.block_count", 0, true));
  KVPOOL_ASSIGN_OR_RETURN(c.dim, GetDim(f, "llama.embedding_length", 0, true));
  KVPOOL_ASSIGN_OR_RETURN(c.n_heads, GetDim(f, "llama.attention.head_count", 0, true));
  KVPOOL_ASSIGN_OR_RETURN(c.n_kv_heads,
                          GetDim(f, "llama.attention.head_count_kv", c.n_heads, false));
  KVPOOL_ASSIGN_OR_RETURN(c.ffn_dim, GetDim(f, "llama.feed_forward_length", 0, true));
  KVPOOL_ASSIGN_OR_RETURN(c.context_length, GetDim(f, "llama.context_length", 0, true));
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama.embedding_length ", c.dim, " / llama.attention.head_count ", c.n_heads,
                     " / llama.attention.head_count_kv ", c.n_kv_heads,
                     ": embedding must split into heads and heads into KV groups"));
  }
  c.head_dim = c.dim / c.n_heads;
  KVPOOL_ASSIGN_OR_RETURN(c.rope_dim, GetDim(f, "llama.rope.dimension_count", c.head_dim, false));
  if (c.rope_dim % 2 != 0 || c.rope_dim > c.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("llama.rope.dimension_count ", c.rope_dim,
                                                   " must be even and <= head_dim ", c.head_dim));
  }
  for (auto [key, out] : {std::pair<const char*, float*>{"llama.rope.freq_base", &c.rope_base},
                          {"llama.attention.layer_norm_rms_epsilon", &c.rms_eps}}) {
    if (f.FindValue(key) == nullptr) {
      continue;
    }
    auto v = f.GetFloat(key);
    if (!v.ok()) {
      return absl::InvalidArgumentError(v.status().message());
    }
    if (!(*v > 0.0) || !std::isfinite(*v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata key '", key, "' is ", *v, " (must be > 0)"));
    }
    *out = static_cast<float>(*v);
  }

  KVPOOL_ASSIGN_OR_RETURN(tokenizer_, Tokenizer::FromGguf(f));
  c.vocab_size = tokenizer_->vocab_size();

  const auto d = static_cast<uint64_t>(c.dim);
  const auto kv = static_cast<uint64_t>(c.n_kv_heads) * c.head_dim;
  const auto ff = static_cast<uint64_t>(c.ffn_dim);
  const auto vocab = static_cast<uint64_t>(c.vocab_size);
  KVPOOL_ASSIGN_OR_RETURN(token_embd_, Weight(f, "token_embd.weight", {d, vocab}));
  layers_.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    Layer& L = layers_[l];
    KVPOOL_ASSIGN_OR_RETURN(L.attn_norm, Weight(f, p + "attn_norm.weight", {d}));
    KVPOOL_ASSIGN_OR_RETURN(L.wq, Weight(f, p + "attn_q.weight", {d, d}));
    KVPOOL_ASSIGN_OR_RETURN(L.wk, Weight(f, p + "attn_k.weight", {d, kv}));
    KVPOOL_ASSIGN_OR_RETURN(L.wv, Weight(f, p + "attn_v.weight", {d, kv}));
    KVPOOL_ASSIGN_OR_RETURN(L.wo, Weight(f, p + "attn_output.weight", {d, d}));
    KVPOOL_ASSIGN_OR_RETURN(L.ffn_norm, Weight(f, p + "ffn_norm.weight", {d}));
    KVPOOL_ASSIGN_OR_RETURN(L.w_gate, Weight(f, p + "ffn_gate.weight", {d, ff}));
    KVPOOL_ASSIGN_OR_RETURN(L.w_up, Weight(f, p + "ffn_up.weight", {d, ff}));
    KVPOOL_ASSIGN_OR_RETURN(L.w_down, Weight(f, p + "ffn_down.weight", {ff, d}));
  }
  KVPOOL_ASSIGN_OR_RETURN(output_norm_, Weight(f, "output_norm.weight", {d}));
  c.tied_output = f.FindTensor("output.weight") == nullptr;
  if (!c.tied_output) {
    KVPOOL_ASSIGN_OR_RETURN(output_, Weight(f, "output.weight", {d, vocab}));
  }
  KVPOOL_RETURN_IF_ERROR(CheckNoUnexpectedTensors(f, c.n_layers));

  rope_inv_freq_.resize(c.rope_dim / 2);
  for (int i = 0; i < c.rope_dim / 2; ++i) {
    rope_inv_freq_[i] = static_cast<float>(
        std::pow(static_cast<double>(c.rope_base), -2.0 * i / static_cast<double>(c.rope_dim)));
  }
  x_.resize(c.dim);
  h_.resize(c.dim);
  q_.resize(c.dim);
  att_.resize(c.dim);
  k_.resize(kv);
  v_.resize(kv);
  gate_.resize(c.ffn_dim);
  up_.resize(c.ffn_dim);
  logits_.resize(c.vocab_size);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Fp32KvCache>> Engine::NewCache(int capacity) const {
  return Fp32KvCache::Create(config_.n_layers, config_.attention(),
                             capacity > 0 ? capacity : config_.context_length);
}

// ---- forward --------------------------------------------------------------------------------

namespace {
// "layer L pos P", or "pos P" after the last layer (layer < 0): where an error arose.
std::string Where(int layer, int pos) {
  return layer < 0 ? absl::StrCat("pos ", pos) : absl::StrCat("layer ", layer, " pos ", pos);
}
// INVALID_ARGUMENT naming where (Where(layer, pos)), `what` and the first element of `x` that is
// NaN or Inf. The location is formatted only on that path: this runs per layer and token.
absl::Status CheckFinite(const std::vector<float>& x, int layer, int pos, const char* what) {
  for (size_t j = 0; j < x.size(); ++j) {
    if (!std::isfinite(x[j])) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(layer, pos), ": element ", j, " of ", what, " is ",
                       std::isnan(x[j]) ? "NaN" : "infinite",
                       " (the model's activations overflow: NaN/Inf are refused, FORMAT.md §2.5)"));
    }
  }
  return absl::OkStatus();
}
// INVALID_ARGUMENT: the RMS norm before `block` got a residual stream whose squares overflow.
absl::Status NormOverflow(int layer, int pos, const char* block) {
  return absl::InvalidArgumentError(absl::StrCat(
      Where(layer, pos), ": the residual stream entering the ", block,
      " RMS norm is too large (its sum of squares overflows fp32: the model's activations "
      "overflow; NaN/Inf are refused, FORMAT.md §2.5)"));
}
}  // namespace

absl::StatusOr<absl::Span<const float>> Engine::Forward(int token, int pos, KvCacheView& cache) {
  const ModelConfig& c = config_;
  if (token < 0 || token >= c.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("token ", token, " outside the vocabulary [0, ", c.vocab_size, ")"));
  }
  if (pos < 0 || pos >= c.context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("pos ", pos, " outside the context [0, ", c.context_length, ")"));
  }
  const int kv_dim = c.n_kv_heads * c.head_dim;
  std::copy_n(token_embd_.begin() + static_cast<size_t>(token) * c.dim, c.dim, x_.begin());

  for (int l = 0; l < c.n_layers; ++l) {
    const Layer& L = layers_[l];
    // Attention block.
    if (!RmsNorm(x_.data(), L.attn_norm, c.dim, c.rms_eps, h_.data())) {
      return NormOverflow(l, pos, "attention");
    }
    MatVec(L.wq, h_.data(), c.dim, c.dim, q_.data());
    MatVec(L.wk, h_.data(), kv_dim, c.dim, k_.data());
    MatVec(L.wv, h_.data(), kv_dim, c.dim, v_.data());
    Rope(q_.data(), c.n_heads, c.head_dim, pos, rope_inv_freq_);
    Rope(k_.data(), c.n_kv_heads, c.head_dim, pos, rope_inv_freq_);
    KVPOOL_RETURN_IF_ERROR(CheckFinite(q_, l, pos, "q"));
    KVPOOL_RETURN_IF_ERROR(CheckFinite(k_, l, pos, "k"));
    KVPOOL_RETURN_IF_ERROR(CheckFinite(v_, l, pos, "v"));
    if (observer_ != nullptr) {
      observer_->OnAttentionInputs(l, pos, q_, k_, v_);
    }
    if (auto s = cache.Append(l, pos, k_, v_); !s.ok()) {
      return Annotate(s, absl::StrCat("KV cache append (layer ", l, ")"));
    }
    if (auto s = cache.Attend(l, pos, q_, absl::MakeSpan(att_)); !s.ok()) {
      return Annotate(s, absl::StrCat("KV cache attend (layer ", l, ")"));
    }
    MatVec(L.wo, att_.data(), c.dim, c.dim, h_.data());
    for (int i = 0; i < c.dim; ++i) {
      x_[i] += h_[i];
    }
    KVPOOL_RETURN_IF_ERROR(
        CheckFinite(x_, l, pos, "the residual stream after the attention block"));

    // SwiGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer").
    if (!RmsNorm(x_.data(), L.ffn_norm, c.dim, c.rms_eps, h_.data())) {
      return NormOverflow(l, pos, "feed-forward");
    }
    MatVec(L.w_gate, h_.data(), c.ffn_dim, c.dim, gate_.data());
    MatVec(L.w_up, h_.data(), c.ffn_dim, c.dim, up_.data());
    for (int i = 0; i < c.ffn_dim; ++i) {
      const float g = gate_[i];
      gate_[i] = g / (1.0f + std::exp(-g)) * up_[i];  // SiLU(g) · up
    }
    MatVec(L.w_down, gate_.data(), c.dim, c.ffn_dim, h_.data());
    for (int i = 0; i < c.dim; ++i) {
      x_[i] += h_[i];
    }
    KVPOOL_RETURN_IF_ERROR(
        CheckFinite(x_, l, pos, "the residual stream after the feed-forward block"));
  }

  if (!RmsNorm(x_.data(), output_norm_, c.dim, c.rms_eps, h_.data())) {
    return NormOverflow(-1, pos, "output");
  }
  MatVec(c.tied_output ? token_embd_ : output_, h_.data(), c.vocab_size, c.dim, logits_.data());
  KVPOOL_RETURN_IF_ERROR(CheckFinite(logits_, -1, pos, "the logits"));
  // Logits that are all equal rank no token above another: a degenerate model (zeroed weights,
  // norms or output), whose greedy continuation is token 0 forever and whose comparisons agree
  // trivially (newcomer s10b F4: all-zero weights gave `<unk>` tokens, exit 0 and agreement 1.0).
  if (c.vocab_size > 1 &&
      std::all_of(logits_.begin() + 1, logits_.end(), [&](float v) { return v == logits_[0]; })) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(-1, pos), ": every one of the ", c.vocab_size, " logits is ", logits_[0],
        " (the model is degenerate, e.g. zeroed weights, norms or output tensor: no token ranks "
        "above another, so a continuation or comparison would mean nothing)"));
  }
  return absl::Span<const float>(logits_);
}

absl::StatusOr<absl::Span<const float>> Engine::Prefill(absl::Span<const int> tokens, int start_pos,
                                                        KvCacheView& cache) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError("prefill: no tokens");
  }
  if (start_pos < 0 || static_cast<int64_t>(start_pos) + static_cast<int64_t>(tokens.size()) >
                           config_.context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill of ", tokens.size(), " tokens at position ", start_pos,
                     " does not fit the context of ", config_.context_length, " positions"));
  }
  absl::Span<const float> logits;
  for (size_t i = 0; i < tokens.size(); ++i) {
    KVPOOL_ASSIGN_OR_RETURN(logits, Forward(tokens[i], start_pos + static_cast<int>(i), cache));
  }
  return logits;
}

absl::StatusOr<GenerateResult> Engine::Generate(absl::Span<const int> prompt,
                                                const GenerateOptions& options, KvCacheView& cache,
                                                const std::function<bool(int)>& on_token) {
  if (prompt.empty()) {
    return absl::InvalidArgumentError("prompt is empty (start with BOS)");
  }
  if (static_cast<int64_t>(prompt.size()) > config_.context_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt has ", prompt.size(), " tokens; the context holds ", config_.context_length));
  }
  if (options.max_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens ", options.max_tokens, " must be >= 0"));
  }
  KVPOOL_RETURN_IF_ERROR(Sampler::Validate(options.sampling));
  Sampler sampler(options.sampling);
  GenerateResult result;
  result.prompt_tokens = static_cast<int>(prompt.size());

  auto t0 = std::chrono::steady_clock::now();
  KVPOOL_ASSIGN_OR_RETURN(absl::Span<const float> logits, Prefill(prompt, 0, cache));
  auto t1 = std::chrono::steady_clock::now();
  result.prefill_seconds = Seconds(t0, t1);

  int pos = static_cast<int>(prompt.size());
  while (static_cast<int>(result.tokens.size()) < options.max_tokens) {
    const int next = sampler.Sample(logits);
    if (options.stop_at_eos && (next == tokenizer_->eos_id() || next == tokenizer_->bos_id())) {
      result.stopped_at_eos = true;
      break;
    }
    result.tokens.push_back(next);
    if (on_token && !on_token(next)) {
      break;
    }
    if (static_cast<int>(result.tokens.size()) == options.max_tokens) {
      break;
    }
    if (pos >= config_.context_length) {
      result.context_full = true;
      break;
    }
    KVPOOL_ASSIGN_OR_RETURN(logits, Forward(next, pos, cache));
    ++pos;
  }
  result.decode_seconds = Seconds(t1, std::chrono::steady_clock::now());
  return result;
}

}  // namespace kvpool::engine
