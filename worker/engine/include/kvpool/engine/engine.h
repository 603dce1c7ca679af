// kvpool/engine/engine.h — the reference Llama engine: float32 on the CPU, small and readable.
//
// Loads a Llama-architecture GGUF model (F32/F16/BF16 weights, widened to float32) and its
// tokenizer, and runs the forward pass one token at a time:
//   x = embed[token]
//   per layer l:  h = RMSNorm(x)·attn_norm;  q = Wq·h, k = Wk·h, v = Wv·h
//                 RoPE on q and k: per head, adjacent pairs (2i, 2i+1) rotated by the angle
//                   pos · base^(−2i/rope_dim) (Su et al. 2021, "RoFormer"; the "Meta AI original
//                   pth" layout, see /work/shared/data/stories260K/README.md)
//                 observer->OnAttentionInputs(l, pos, q, k, v)        (optional)
//                 cache.Append(l, pos, k, v); cache.Attend(l, pos, q, a)   (kv_cache.h)
//                 x += Wo·a
//                 h = RMSNorm(x)·ffn_norm;  x += Wdown·(SiLU(Wgate·h) ⊙ (Wup·h))   (SwiGLU)
//   logits = Wout·(RMSNorm(x)·output_norm)       (Wout = token embedding when tied)
// RMSNorm(x) = x / sqrt(mean(x²) + eps) (Zhang & Sennrich 2019). Every matrix W is stored as
// GGUF dims [in, out] = `out` rows of `in` floats, y = W·x.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto engine, Engine::Create(path));
//   KVPOOL_ASSIGN_OR_RETURN(auto cache, engine->NewCache());
//   std::vector<int> prompt = engine->tokenizer().Encode("Once upon a time", true);
//   KVPOOL_ASSIGN_OR_RETURN(auto result, engine->Generate(prompt, {.max_tokens = 64}, *cache));
//   std::string text = engine->tokenizer().Decode(result.tokens);
//
// Thread-safety: an Engine holds scratch buffers; Forward/Prefill/Generate must not run
// concurrently on one Engine (create one per thread; the weights are ~1 MB for stories260K).
// Const accessors are thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/engine/kv_cache.h"
#include "kvpool/engine/sampler.h"
#include "kvpool/engine/tokenizer.h"

namespace kvpool::engine {

// Model geometry, from the GGUF metadata (`llama.*` keys).
struct ModelConfig {
  int n_layers = 0;        // llama.block_count
  int dim = 0;             // llama.embedding_length
  int n_heads = 0;         // llama.attention.head_count (H_q)
  int n_kv_heads = 0;      // llama.attention.head_count_kv (H_kv; defaults to H_q)
  int head_dim = 0;        // dim / n_heads
  int ffn_dim = 0;         // llama.feed_forward_length
  int vocab_size = 0;      // rows of token_embd.weight (== tokenizer vocabulary)
  int context_length = 0;  // llama.context_length (maximum positions)
  int rope_dim = 0;        // llama.rope.dimension_count (defaults to head_dim; even, <= head_dim)
  float rope_base = 10000.0f;  // llama.rope.freq_base
  float rms_eps = 1e-5f;       // llama.attention.layer_norm_rms_epsilon
  bool tied_output = false;    // true when output.weight is absent (uses token_embd.weight)

  AttentionShape attention() const { return {n_heads, n_kv_heads, head_dim}; }
};

// Receives the post-RoPE attention inputs of every (layer, position) the engine computes,
// before they go to the KV cache (for calibration dumps; FORMAT.md §1). q: [H_q*d],
// k, v: [H_kv*d]; the spans are valid only during the call. Called on the thread running
// Forward; must not call back into the engine.
class ActivationObserver {
 public:
  virtual ~ActivationObserver() = default;
  virtual void OnAttentionInputs(int layer, int pos, absl::Span<const float> q,
                                 absl::Span<const float> k, absl::Span<const float> v) = 0;
};

// An observer that records the rows of chosen layers in memory.
class QkvRecorder : public ActivationObserver {
 public:
  struct Rows {
    std::vector<int> positions;  // one entry per recorded token
    std::vector<float> q;        // positions.size() rows of H_q*d
    std::vector<float> k, v;     // positions.size() rows of H_kv*d
  };
  // Records layers listed in `layers` (all layers when empty).
  explicit QkvRecorder(std::vector<int> layers = {});
  void OnAttentionInputs(int layer, int pos, absl::Span<const float> q, absl::Span<const float> k,
                         absl::Span<const float> v) override;
  // Rows recorded for `layer` (empty when none).
  const Rows& rows(int layer) const;

 private:
  std::vector<int> layers_;
  std::vector<Rows> rows_;  // indexed by layer, grown on demand
  Rows empty_;
};

struct GenerateOptions {
  int max_tokens = 256;      // tokens to generate at most (>= 0)
  SamplingOptions sampling;  // temperature 0 = greedy
  bool stop_at_eos = true;   // stop (without emitting it) at EOS or BOS, like llama2.c
};

struct GenerateResult {
  std::vector<int> tokens;  // generated tokens (prompt excluded)
  int prompt_tokens = 0;
  bool stopped_at_eos = false;  // an EOS/BOS ended generation
  bool context_full = false;    // generation stopped at context_length
  double prefill_seconds = 0;   // wall time of the prompt's forward passes
  double decode_seconds = 0;    // wall time of the generated tokens' forward passes + sampling
};

class Engine {
 public:
  // Loads the GGUF model at `path`: architecture "llama", geometry (ModelConfig), tokenizer,
  // and every weight with its expected dims. Errors: whatever GgufFile::Open reports (NOT_FOUND,
  // INVALID_ARGUMENT, DATA_LOSS), INVALID_ARGUMENT naming the missing/ill-shaped tensor or
  // metadata key, FAILED_PRECONDITION for another architecture. A tensor the metadata does not
  // describe — blk.N.* with N >= llama.block_count, or a name this engine does not read — is
  // INVALID_ARGUMENT naming the first such tensor, why (the key and its value for a layer
  // beyond block_count) and how many the file holds; a missing one is reported first (newcomer
  // report 11 F1: block_count 4 over 5 layers' tensors ran 4 layers with exit 0).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const std::string& path);

  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }

  // A float32 KV cache sized for this model and `capacity` positions (default: the context),
  // allocated up front (kv_cache.h). Callers size it by what they write (prompt + tokens to
  // generate): a context_length near the reader's 2^24 bound is tens of GB for any model.
  absl::StatusOr<std::unique_ptr<Fp32KvCache>> NewCache(int capacity = 0) const;

  // Observer for post-RoPE Q/K/V (not owned; nullptr disables). Must outlive its use.
  void set_observer(ActivationObserver* observer) { observer_ = observer; }

  // Runs one token at position `pos` through the model, appending its K/V to `cache` (which
  // must hold positions [0, pos) of this sequence for every layer). Returns the logits
  // [vocab_size], valid until the next call on this engine. Errors: INVALID_ARGUMENT for a
  // token outside the vocabulary or pos outside [0, context_length), and for a model whose
  // activations are not finite (NaN/Inf, e.g. weights that overflow fp32: FORMAT.md §2.5
  // refuses them at ingest), naming what: a layer's post-RoPE q, k or v ("layer 1 pos 0:
  // element 6 of k is not finite ..."), checked before the observer and the cache see them, or
  // the logits; whatever the cache returns (annotated with the layer). Newcomer report 10 F7:
  // `kvpool-engine generate` printed blank tokens with exit 0 for such a model. INVALID_ARGUMENT
  // too for logits that are all equal ("pos 0: every one of the 512 logits is 0 (the model is
  // degenerate ..."): a model with zeroed weights (newcomer s10b F4: `<unk>` tokens, exit 0,
  // agreement 1.0).
  absl::StatusOr<absl::Span<const float>> Forward(int token, int pos, KvCacheView& cache);

  // Forward over tokens at positions start_pos, start_pos+1, ...; returns the logits of the
  // last token. Errors as Forward, plus INVALID_ARGUMENT for empty `tokens` or
  // start_pos + tokens.size() > context_length (the message names both numbers).
  absl::StatusOr<absl::Span<const float>> Prefill(absl::Span<const int> tokens, int start_pos,
                                                  KvCacheView& cache);

  // Prefills `prompt` (non-empty, usually starting with BOS) from position 0 of an empty
  // `cache`, then samples up to max_tokens tokens, stopping early at EOS/BOS (when
  // stop_at_eos) or when the context is full. `on_token` (optional) sees each generated token
  // as it is produced and may return false to stop. Errors: INVALID_ARGUMENT for an empty
  // prompt, a prompt longer than the context ("prompt has N tokens; the context holds M"), bad
  // sampling options or max_tokens < 0; errors of Forward.
  absl::StatusOr<GenerateResult> Generate(absl::Span<const int> prompt,
                                          const GenerateOptions& options, KvCacheView& cache,
                                          const std::function<bool(int)>& on_token = {});

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down;
  };
  Engine() = default;
  absl::Status Load(const std::string& path);

  ModelConfig config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<float> token_embd_;  // [vocab][dim]
  std::vector<Layer> layers_;
  std::vector<float> output_norm_;
  std::vector<float> output_;         // [vocab][dim]; empty when tied
  std::vector<float> rope_inv_freq_;  // [rope_dim/2]: base^(-2i/rope_dim)
  ActivationObserver* observer_ = nullptr;

  // Scratch (one token).
  std::vector<float> x_, h_, q_, k_, v_, att_, gate_, up_, logits_;
};

}  // namespace kvpool::engine
