// GPU path of the decode worker vs its CPU path (issue 5): a synthetic Llama model of
// production attention shape (32 q heads, 8 KV heads, head_dim 128, 2 layers, FFN 256, vocab
// 512; random weights from a fixed seed, written as a GGUF v3 file by this test) runs ~600
// prompt tokens + 32 greedy decode steps with OSCAR S64/W256 pages (P 16), so history blocks
// are demoted to INT2 as the window moves.
//
// 1. Lock-step: one engine run drives a tee view that appends every token to the CPU
//    MixedKvCache (int2), the GpuMixedKvCache (int2) and a CPU MixedKvCache with BF16 history,
//    attends with all three, and feeds the CPU int2 output back to the engine. Per (layer, pos)
//    we get rel L2(GPU, CPU) over identical inputs, and rel L2(CPU int2, CPU bf16) — the INT2
//    quantization error the GPU difference is measured against.
// 2. Free-running: the engine runs once with the GPU cache alone; its greedy tokens and logits
//    are compared with the lock-step run's (which is exactly the CPU-path run).
//
// Tolerances (why): the GPU writes rotate with an fp16 copy of R on tensor cores (~3e-4 relative
// per rotated value), so a rotated value's bf16 rounding differs now and then; q and the
// attention output are rounded to bf16 on the GPU (2^-9 relative each; the kernel alone measured
// ~1.7e-3 rel L2 against float64, docs/KERNELS.md). Steps that read BF16 pages only: rel L2 per
// step <= 3e-2, mean <= 1e-2. Once history is INT2, a bf16 ulp in a rotated value can move a clip
// threshold, a group's (min, scale) or a code (0.017 % of codes, docs/KERNELS.md), and one code
// moves a dequantized element by a whole quantization step: those differences are of the INT2
// error's own kind, so they are bounded against it: mean rel L2(GPU, CPU) <= 0.1 × mean rel
// L2(CPU int2, CPU bf16 history) over those steps, and <= 0.3 on any single step. (The first
// device run, 2026-11-29, showed the per-step 2e-2 first tried here is too tight for INT2 steps:
// mean 1.35e-2, max 0.15 on layer 0, against an INT2 error of mean 0.38.) Logits: rel L2 <= 5e-2
// per step while the token prefixes agree (the attention difference enters a residual stream it
// is only part of); a differing greedy token must be explained by the logit noise: the CPU top-2
// margin at that step <= 6 · rel L2 · RMS(logits).
//
// Label `gpu`: skipped (GTEST_SKIP) where no CUDA device is present; run on the GPU machine by
// worker/runtime/gpu/device_run.sh. KVPOOL_GPU_TEST_PROMPT (tokens, default 600) shortens it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "kvpool/common/status.h"
#include "kvpool/engine/engine.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/worker/gpu_mixed_kv_cache.h"
#include "kvpool/worker/mixed_kv_cache.h"

namespace kvpool::worker {
namespace {

constexpr int kLayers = 2;
constexpr int kHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kDim = kHeads * kHeadDim;
constexpr int kFfn = 256;
constexpr int kVocab = 512;
constexpr int kContext = 1024;
constexpr int kDecodeSteps = 32;

// ---- a minimal GGUF v3 writer (GGUF spec: header, KV pairs, tensor infos, aligned data) ----
class GgufWriter {
 public:
  void KvU32(const std::string& key, uint32_t v) {
    Key(key, 4);
    Put(meta_, v);
    ++n_kv_;
  }
  void KvF32(const std::string& key, float v) {
    Key(key, 6);
    Put(meta_, v);
    ++n_kv_;
  }
  void KvStr(const std::string& key, const std::string& v) {
    Key(key, 8);
    Str(meta_, v);
    ++n_kv_;
  }
  void KvStrArray(const std::string& key, const std::vector<std::string>& v) {
    Key(key, 9);
    Put<uint32_t>(meta_, 8);
    Put<uint64_t>(meta_, v.size());
    for (const auto& s : v) Str(meta_, s);
    ++n_kv_;
  }
  // F32 tensor with GGUF dims (ne0 fastest).
  void Tensor(const std::string& name, std::vector<uint64_t> dims, const std::vector<float>& data) {
    Str(info_, name);
    Put<uint32_t>(info_, static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) Put<uint64_t>(info_, d);
    Put<uint32_t>(info_, 0);  // GGML_TYPE_F32
    data_.resize((data_.size() + 31) / 32 * 32);
    Put<uint64_t>(info_, data_.size());
    const char* p = reinterpret_cast<const char*>(data.data());
    data_.append(p, data.size() * sizeof(float));
    ++n_tensors_;
  }
  bool Write(const std::string& path) const {
    std::string s = "GGUF";
    Put<uint32_t>(s, 3);
    Put<uint64_t>(s, n_tensors_);
    Put<uint64_t>(s, n_kv_);
    s += meta_;
    s += info_;
    s.resize((s.size() + 31) / 32 * 32);
    std::ofstream f(path, std::ios::binary);
    f.write(s.data(), static_cast<std::streamsize>(s.size()));
    f.write(data_.data(), static_cast<std::streamsize>(data_.size()));
    return static_cast<bool>(f);
  }

 private:
  template <typename T>
  static void Put(std::string& s, T v) {
    s.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  static void Str(std::string& s, const std::string& v) {
    Put<uint64_t>(s, v.size());
    s += v;
  }
  void Key(const std::string& key, uint32_t type) {
    Str(meta_, key);
    Put(meta_, type);
  }
  std::string meta_, info_, data_;
  uint64_t n_kv_ = 0, n_tensors_ = 0;
};

std::vector<float> Randn(std::mt19937_64& rng, size_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Writes the synthetic model; weights N(0, σ²) with σ chosen so that RMSNorm'd activations give
// O(1) per-element q, k (attention logits of std ≈ gain² ≈ 2: neither flat nor one-hot).
bool WriteSyntheticModel(const std::string& path) {
  std::mt19937_64 rng(20261129);
  GgufWriter w;
  w.KvStr("general.architecture", "llama");
  w.KvStr("general.name", "kvpool-synthetic-d128");
  w.KvU32("llama.block_count", kLayers);
  w.KvU32("llama.embedding_length", kDim);
  w.KvU32("llama.attention.head_count", kHeads);
  w.KvU32("llama.attention.head_count_kv", kKvHeads);
  w.KvU32("llama.feed_forward_length", kFfn);
  w.KvU32("llama.context_length", kContext);
  w.KvF32("llama.rope.freq_base", 10000.0f);
  w.KvF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.KvStr("tokenizer.ggml.model", "llama");
  std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
  for (int i = 3; i < kVocab; ++i) pieces.push_back("tok" + std::to_string(i));
  w.KvStrArray("tokenizer.ggml.tokens", pieces);
  const float s_in = 1.0f / std::sqrt(static_cast<float>(kDim));
  const float gain = 1.4f;
  const uint64_t d = kDim, kv = kKvHeads * kHeadDim, ff = kFfn;
  w.Tensor("token_embd.weight", {d, kVocab}, Randn(rng, d * kVocab, 1.0f));
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    w.Tensor(p + "attn_norm.weight", {d}, std::vector<float>(d, 1.0f));
    w.Tensor(p + "attn_q.weight", {d, d}, Randn(rng, d * d, gain * s_in));
    w.Tensor(p + "attn_k.weight", {d, kv}, Randn(rng, d * kv, gain * s_in));
    w.Tensor(p + "attn_v.weight", {d, kv}, Randn(rng, d * kv, s_in));
    w.Tensor(p + "attn_output.weight", {d, d}, Randn(rng, d * d, s_in));
    w.Tensor(p + "ffn_norm.weight", {d}, std::vector<float>(d, 1.0f));
    w.Tensor(p + "ffn_gate.weight", {d, ff}, Randn(rng, d * ff, s_in));
    w.Tensor(p + "ffn_up.weight", {d, ff}, Randn(rng, d * ff, s_in));
    w.Tensor(p + "ffn_down.weight", {ff, d}, Randn(rng, ff * d, 1.0f / std::sqrt(float(kFfn))));
  }
  w.Tensor("output_norm.weight", {d}, std::vector<float>(d, 1.0f));
  // Untied output head: logits of std ≈ 3 (a tied one would give std ≈ √d and collapse greedy
  // decoding onto the input token).
  w.Tensor("output.weight", {d, kVocab}, Randn(rng, d * kVocab, 3.0f * s_in));
  return w.Write(path);
}

double RelL2(absl::Span<const float> a, absl::Span<const float> ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

int Argmax(absl::Span<const float> x) {
  return static_cast<int>(std::max_element(x.begin(), x.end()) - x.begin());
}

// Drives three caches in lock step; the engine sees the CPU int2 cache's output.
class TeeView : public engine::KvCacheView {
 public:
  TeeView(MixedKvCache* cpu, GpuMixedKvCache* gpu, MixedKvCache* cpu_bf16)
      : cpu_(cpu), gpu_(gpu), bf16_(cpu_bf16), gpu_rel_(kLayers), quant_rel_(kLayers) {}
  absl::Status Append(int layer, int pos, absl::Span<const float> k,
                      absl::Span<const float> v) override {
    KVPOOL_RETURN_IF_ERROR(cpu_->Append(layer, pos, k, v));
    KVPOOL_RETURN_IF_ERROR(gpu_->Append(layer, pos, k, v));
    return bf16_->Append(layer, pos, k, v);
  }
  absl::Status Attend(int layer, int pos, absl::Span<const float> q,
                      absl::Span<float> out) override {
    KVPOOL_RETURN_IF_ERROR(cpu_->Attend(layer, pos, q, out));
    tmp_.resize(out.size());
    KVPOOL_RETURN_IF_ERROR(gpu_->Attend(layer, pos, q, absl::MakeSpan(tmp_)));
    gpu_rel_[layer].push_back(RelL2(tmp_, out));
    KVPOOL_RETURN_IF_ERROR(bf16_->Attend(layer, pos, q, absl::MakeSpan(tmp_)));
    quant_rel_[layer].push_back(RelL2(out, tmp_));
    return absl::OkStatus();
  }
  int Length(int layer) const override { return cpu_->Length(layer); }

  MixedKvCache* cpu_;
  GpuMixedKvCache* gpu_;
  MixedKvCache* bf16_;
  std::vector<std::vector<double>> gpu_rel_, quant_rel_;  // [layer][pos]
  std::vector<float> tmp_;
};

struct Run {
  std::vector<int> tokens;                 // greedy tokens
  std::vector<std::vector<float>> logits;  // logits that chose each token (prompt's last first)
};

absl::StatusOr<Run> Greedy(engine::Engine& e, const std::vector<int>& prompt,
                           engine::KvCacheView& cache) {
  Run r;
  KVPOOL_ASSIGN_OR_RETURN(absl::Span<const float> logits, e.Prefill(prompt, 0, cache));
  for (int step = 0; step < kDecodeSteps; ++step) {
    r.logits.emplace_back(logits.begin(), logits.end());
    r.tokens.push_back(Argmax(logits));
    if (step + 1 == kDecodeSteps) break;
    KVPOOL_ASSIGN_OR_RETURN(
        logits, e.Forward(r.tokens.back(), static_cast<int>(prompt.size()) + step, cache));
  }
  return r;
}

double Mean(const std::vector<double>& v, size_t from, size_t to) {
  double s = 0;
  for (size_t i = from; i < to; ++i) s += v[i];
  return to > from ? s / double(to - from) : 0.0;
}
double Max(const std::vector<double>& v, size_t from, size_t to) {
  double m = 0;
  for (size_t i = from; i < to; ++i) m = std::max(m, v[i]);
  return m;
}

TEST(GpuMixedKvCache, SyntheticD128ModelMatchesCpuPath) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device";
  }
  int prompt_len = 600;
  if (const char* env = std::getenv("KVPOOL_GPU_TEST_PROMPT")) prompt_len = std::atoi(env);
  ASSERT_GT(prompt_len, 0);
  ASSERT_LE(prompt_len + kDecodeSteps, kContext);

  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvpool_synth_d128_" + std::to_string(::getpid()) + ".gguf"))
                               .string();
  ASSERT_TRUE(WriteSyntheticModel(path)) << path;
  auto engine_or = engine::Engine::Create(path);
  std::filesystem::remove(path);
  ASSERT_TRUE(engine_or.ok()) << engine_or.status();
  engine::Engine& engine = **engine_or;
  ASSERT_EQ(engine.config().head_dim, kHeadDim);
  const engine::AttentionShape shape = engine.config().attention();

  RotationMetadata meta;
  meta.format_version = 1;
  meta.objective = "hadamard";
  meta.model_name = "kvpool-synthetic-d128";
  meta.head_dim = kHeadDim;
  meta.num_layers = kLayers;
  meta.num_kv_heads = kKvHeads;
  auto rot_or = RotationSet::Hadamard(meta);
  ASSERT_TRUE(rot_or.ok()) << rot_or.status();
  auto rotations = std::make_shared<const RotationSet>(std::move(*rot_or));

  MixedCacheOptions opt;  // S64 / W256 / P16 / int2, clip 0.96 / 0.92
  opt.capacity = kContext;
  std::mt19937_64 rng(7);
  std::vector<int> prompt = {1};
  std::uniform_int_distribution<int> tok(3, kVocab - 1);
  while (static_cast<int>(prompt.size()) < prompt_len) prompt.push_back(tok(rng));

  // ---- 1. lock-step ----
  auto cpu = MixedKvCache::Create(kLayers, shape, rotations, opt);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto gpu = GpuMixedKvCache::Create(kLayers, shape, rotations, opt);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  MixedCacheOptions opt_bf16 = opt;
  opt_bf16.history = HistoryPrecision::kBf16;
  auto bf16 = MixedKvCache::Create(kLayers, shape, rotations, opt_bf16);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  TeeView tee(cpu->get(), gpu->get(), bf16->get());
  auto cpu_run = Greedy(engine, prompt, tee);
  ASSERT_TRUE(cpu_run.ok()) << cpu_run.status();
  EXPECT_EQ((*cpu)->stats().demoted_chunks, (*gpu)->stats().demoted_chunks);
  EXPECT_GT((*gpu)->stats().demoted_chunks, 0u);

  const size_t n_pos = tee.gpu_rel_[0].size();
  ASSERT_EQ(n_pos, static_cast<size_t>(prompt_len + kDecodeSteps - 1));
  // First position whose attention reads INT2 history: at n = pos + 1 = S + W + P tokens the
  // window (⌈W/P⌉ full blocks + the partial one) has moved one block past the sink.
  const size_t first_int2 =
      static_cast<size_t>(opt.sink_tokens + opt.recent_tokens + opt.page_size - 1);
  std::printf(
      "synthetic llama d128: %d layers, %d q / %d kv heads, prompt %d + %d greedy steps, "
      "S%d W%d P%d int2, Hadamard rotations; demoted chunks cpu %llu gpu %llu\n",
      kLayers, kHeads, kKvHeads, prompt_len, kDecodeSteps, opt.sink_tokens, opt.recent_tokens,
      opt.page_size, static_cast<unsigned long long>((*cpu)->stats().demoted_chunks),
      static_cast<unsigned long long>((*gpu)->stats().demoted_chunks));
  // Print everything first, then assert.
  for (int l = 0; l < kLayers; ++l) {
    const auto& g = tee.gpu_rel_[l];
    const auto& q = tee.quant_rel_[l];
    const size_t dec = std::min(static_cast<size_t>(prompt_len) - 1, n_pos);  // decode steps
    std::printf(
        "layer %d attention rel L2 GPU vs CPU: bf16-only steps [0,%zu) mean %.3e max %.3e | "
        "int2-history steps [%zu,%zu) mean %.3e max %.3e | decode steps mean %.3e max %.3e\n",
        l, first_int2, Mean(g, 0, first_int2), Max(g, 0, first_int2), first_int2, n_pos,
        Mean(g, first_int2, n_pos), Max(g, first_int2, n_pos), Mean(g, dec, n_pos),
        Max(g, dec, n_pos));
    std::printf(
        "layer %d INT2 quantization error (CPU int2 vs CPU bf16 history), int2-history "
        "steps: mean %.3e max %.3e\n",
        l, Mean(q, first_int2, n_pos), Max(q, first_int2, n_pos));
  }
  for (int l = 0; l < kLayers; ++l) {
    const auto& g = tee.gpu_rel_[l];
    const auto& q = tee.quant_rel_[l];
    for (size_t p = 0; p < first_int2; ++p) {
      EXPECT_LE(g[p], 3e-2) << "layer " << l << " pos " << p << " (BF16 pages only)";
    }
    EXPECT_LE(Mean(g, 0, first_int2), 1e-2) << "layer " << l;
    for (size_t p = first_int2; p < n_pos; ++p) {
      EXPECT_LE(g[p], 0.3) << "layer " << l << " pos " << p << " (INT2 history)";
    }
    EXPECT_LE(Mean(g, first_int2, n_pos), 0.1 * Mean(q, first_int2, n_pos)) << "layer " << l;
  }
  std::printf("per-step rel L2 (layer 0, layer 1) at decode steps:");
  for (size_t p = static_cast<size_t>(prompt_len) - 1; p < n_pos; p += 4) {
    std::printf(" [%zu] %.2e/%.2e", p, tee.gpu_rel_[0][p], tee.gpu_rel_[1][p]);
  }
  std::printf("\n");

  // ---- 2. free-running GPU path ----
  auto gpu2 = GpuMixedKvCache::Create(kLayers, shape, rotations, opt);
  ASSERT_TRUE(gpu2.ok()) << gpu2.status();
  auto gpu_run = Greedy(engine, prompt, **gpu2);
  ASSERT_TRUE(gpu_run.ok()) << gpu_run.status();
  int agree = 0;
  int first_diff = -1;
  double max_logit_rel = 0;
  for (int s = 0; s < kDecodeSteps; ++s) {
    const auto& a = cpu_run->logits[s];
    const auto& b = gpu_run->logits[s];
    const double rel = RelL2(b, a);
    if (first_diff < 0) {
      max_logit_rel = std::max(max_logit_rel, rel);
      EXPECT_LE(rel, 5e-2) << "step " << s;
    }
    if (cpu_run->tokens[s] == gpu_run->tokens[s]) {
      ++agree;
    } else if (first_diff < 0) {
      first_diff = s;
      std::vector<float> sorted(a);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      double rms = 0;
      for (float x : a) rms += double(x) * x;
      rms = std::sqrt(rms / double(a.size()));
      const double margin = sorted[0] - sorted[1];
      std::printf("first differing token at step %d: CPU top-2 margin %.4f (logit RMS %.3f)\n", s,
                  margin, rms);
      // A flip needs margin <= 2·max|Δlogit|; with Δ of rel L2 r, max|Δ| over 512 logits is
      // ~3·r·RMS for noise-like differences. Allow 6·r·RMS; a gross error exceeds it.
      EXPECT_LE(margin, 6.0 * rel * rms)
          << "tokens diverged at step " << s << " by more than the logit noise explains";
    }
  }
  std::printf(
      "greedy tokens: %d of %d agree (first difference at step %d); max logits rel L2 "
      "before it %.3e\n",
      agree, kDecodeSteps, first_diff, max_logit_rel);
  std::printf("tokens cpu:");
  for (int t : cpu_run->tokens) std::printf(" %d", t);
  std::printf("\ntokens gpu:");
  for (int t : gpu_run->tokens) std::printf(" %d", t);
  std::printf("\n");
}

}  // namespace
}  // namespace kvpool::worker
