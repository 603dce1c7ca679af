// Tests for the reference Llama engine on the real stories260K model: greedy generation from BOS
// reproduces the model's known story, tokenizer round trips, the KV-cache interface and the
// activation observer, sampling, and error paths.
#include "kvpool/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kvpool/common/gguf.h"

namespace kvpool::engine {
namespace {

constexpr char kModel[] = KVPOOL_MODEL_PATH;

// Greedy decoding from BOS, first 40 generated tokens, decoded. Observed from this engine on
// 2026-11-29 and checked against the known behaviour in the model's README ("Once upon a time,
// there was a little girl named Lily. She loved to play outside in the park. ..."): coherent
// English; token 40 is the first piece of "red".
constexpr char kGreedy40[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, r";

Engine& SharedEngine() {
  static Engine* engine = [] {
    auto e = Engine::Create(kModel);
    if (!e.ok()) {
      ADD_FAILURE() << e.status();
      return static_cast<Engine*>(nullptr);
    }
    return e->release();
  }();
  if (engine == nullptr) std::abort();
  return *engine;
}

std::vector<int> Greedy(Engine& engine, std::vector<int> prompt, int n, KvCacheView& cache) {
  GenerateOptions opt;
  opt.max_tokens = n;
  auto r = engine.Generate(prompt, opt, cache);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->tokens : std::vector<int>{};
}

TEST(EngineTest, LoadsGeometry) {
  const ModelConfig& c = SharedEngine().config();
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.ffn_dim, 172);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.context_length, 512);
  EXPECT_EQ(c.rope_dim, 8);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_FALSE(c.tied_output);
  EXPECT_EQ(SharedEngine().tokenizer().bos_id(), 1);
  EXPECT_EQ(SharedEngine().tokenizer().eos_id(), 2);
}

TEST(EngineTest, GreedyFromBosReproducesKnownStory) {
  Engine& e = SharedEngine();
  auto cache = e.NewCache();
  ASSERT_TRUE(cache.ok());
  const std::vector<int> tokens = Greedy(e, {e.tokenizer().bos_id()}, 120, **cache);
  ASSERT_EQ(tokens.size(), 120u);
  const std::vector<int> first40(tokens.begin(), tokens.begin() + 40);
  EXPECT_EQ(e.tokenizer().Decode(first40), kGreedy40);
  // The whole 120-token text continues the same story.
  const std::string text = e.tokenizer().Decode(tokens);
  EXPECT_EQ(text.rfind(kGreedy40, 0), 0u) << text;
  EXPECT_NE(text.find("saw a big, red ball"), std::string::npos) << text;
  // Streaming decode (token by token, as the CLI prints) gives the same text.
  std::string streamed;
  int prev = e.tokenizer().bos_id();
  for (int t : tokens) {
    streamed += e.tokenizer().DecodeNext(prev, t);
    prev = t;
  }
  EXPECT_EQ(streamed, text);
}

TEST(EngineTest, GreedyIsDeterministicAndPromptContinues) {
  Engine& e = SharedEngine();
  auto c1 = e.NewCache();
  auto c2 = e.NewCache();
  ASSERT_TRUE(c1.ok() && c2.ok());
  const std::vector<int> a = Greedy(e, {1}, 40, **c1);
  // Prompting with BOS + the first 10 generated tokens continues with tokens 10.. of the run.
  std::vector<int> prompt = {1};
  prompt.insert(prompt.end(), a.begin(), a.begin() + 10);
  const std::vector<int> b = Greedy(e, prompt, 30, **c2);
  EXPECT_EQ(b, std::vector<int>(a.begin() + 10, a.end()));
}

// ---- tokenizer ------------------------------------------------------------------------------

TEST(TokenizerTest, RoundTripsTexts) {
  const Tokenizer& tok = SharedEngine().tokenizer();
  const std::vector<std::string> texts = {
      "Once upon a time, there was a little girl named Lily.",
      "Hello world",
      " leading space and trailing space ",
      "two  spaces\nnewline\ttab",
      "Unicode: héllo wörld ☃ 日本",
      "Tom said, \"I'm happy!\" (really) 123-456?",
      "x",
  };
  for (const std::string& t : texts) {
    const std::vector<int> ids = tok.Encode(t, /*add_bos=*/true);
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids[0], tok.bos_id());
    EXPECT_EQ(tok.Decode(ids), t) << t;
    EXPECT_EQ(tok.Decode(tok.Encode(t, /*add_bos=*/false)), t) << t;
  }
  EXPECT_TRUE(tok.Encode("", false).empty());
  EXPECT_EQ(tok.Encode("", true), std::vector<int>{tok.bos_id()});
}

TEST(TokenizerTest, MergesWordsAndFallsBackToBytes) {
  const Tokenizer& tok = SharedEngine().tokenizer();
  // Common words merge into whole pieces with the dummy-prefix "▁".
  const std::vector<int> ids = tok.Encode("Once upon a time", false);
  std::vector<std::string> pieces;
  for (int id : ids) pieces.emplace_back(tok.piece(id));
  EXPECT_LT(ids.size(), 10u);
  ASSERT_FALSE(pieces.empty());
  EXPECT_EQ(pieces[0].rfind("\xe2\x96\x81", 0), 0u) << pieces[0];  // starts with "▁"
  // A snowman is not in the 512-piece vocabulary: three byte tokens E2 98 83.
  const std::vector<int> snow = tok.Encode("\xe2\x98\x83", false);
  std::vector<std::string> sp;
  for (int id : snow) sp.emplace_back(tok.piece(id));
  ASSERT_GE(sp.size(), 3u);
  EXPECT_EQ(std::vector<std::string>(sp.end() - 3, sp.end()),
            (std::vector<std::string>{"<0xE2>", "<0x98>", "<0x83>"}));
  EXPECT_EQ(tok.type(snow.back()), Tokenizer::TokenType::kByte);
  // Invalid UTF-8 survives a round trip byte for byte.
  const std::string bad = "a\xff\xc3(b\xe2\x82";
  EXPECT_EQ(tok.Decode(tok.Encode(bad, true)), bad);
  // Control tokens decode to nothing; out-of-range ids too.
  EXPECT_EQ(tok.Decode({1, 2, -5, 100000}), "");
}

// The byte-size bound kvpool-worker refuses a too-long prompt file with (newcomer s9 A3): every
// encodable piece fits in max_piece_bytes, and no text has fewer tokens than
// ceil(bytes / max_piece_bytes), the longest piece repeated included.
TEST(TokenizerTest, MaxPieceBytesBoundsTheTokenCount) {
  const Tokenizer& tok = SharedEngine().tokenizer();
  const size_t l = tok.max_piece_bytes();
  ASSERT_GE(l, 2u);  // stories260K merges words: some piece is longer than one byte
  std::string longest;
  for (int id = 0; id < tok.vocab_size(); ++id) {
    const auto t = tok.type(id);
    if (t == Tokenizer::TokenType::kNormal || t == Tokenizer::TokenType::kUserDefined) {
      EXPECT_LE(tok.piece(id).size(), l) << id;
      if (tok.piece(id).size() > longest.size()) longest = std::string(tok.piece(id));
    }
  }
  EXPECT_EQ(longest.size(), l);
  // The longest piece's text ("▁" read as a space) repeated: the densest text there is.
  std::string dense;
  for (size_t i = 0; i < longest.size();) {
    if (longest.compare(i, 3, "\xe2\x96\x81") == 0) {
      dense += ' ';
      i += 3;
    } else {
      dense += longest[i++];
    }
  }
  std::string rep;
  for (int k = 0; k < 50; ++k) rep += dense;
  for (const std::string& t :
       {rep, std::string("Once upon a time, there was a little girl named Lily."),
        std::string(1000, ' '), std::string("\xe2\x98\x83 \xff\xfe"), std::string("x")}) {
    const size_t n = tok.Encode(t, /*add_bos=*/false).size();
    EXPECT_GE(n, (t.size() + l - 1) / l) << t.size() << " bytes, " << n << " tokens";
  }
}

TEST(TokenizerTest, MergeOrderFollowsScores) {
  // Pieces: a, b, c, "ab" (score 1), "bc" (score 2). "abc" must merge b+c first (higher score).
  auto tok =
      Tokenizer::Create({"<unk>", "<s>", "</s>", "\xe2\x96\x81", "a", "b", "c", "ab", "bc"},
                        {0, 0, 0, -1, -1, -1, -1, 1, 2}, {2, 3, 3, 1, 1, 1, 1, 1, 1}, 1, 2, 0);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("abc", false), (std::vector<int>{3, 4, 8}));
  EXPECT_EQ((*tok)->Encode("abab", false), (std::vector<int>{3, 7, 7}));
  // Length mismatches and bad ids are refused, naming the key.
  auto bad = Tokenizer::Create({"a", "b"}, {0}, {}, 1, 1, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tokenizer.ggml.scores"), std::string::npos);
  auto bad_id = Tokenizer::Create({"a", "b"}, {}, {}, 7, 1, 0);
  ASSERT_FALSE(bad_id.ok());
  EXPECT_NE(bad_id.status().message().find("bos_token_id"), std::string::npos);
}

// ---- KV interface and observer --------------------------------------------------------------

// A view that forwards to an Fp32KvCache and records the calls; optionally scales V on the way
// in to prove attention really reads through the view.
class RecordingView : public KvCacheView {
 public:
  RecordingView(Fp32KvCache& inner, float v_scale) : inner_(inner), v_scale_(v_scale) {}
  absl::Status Append(int layer, int pos, absl::Span<const float> k,
                      absl::Span<const float> v) override {
    ++appends;
    last_append_pos = pos;
    std::vector<float> vs(v.begin(), v.end());
    for (float& x : vs) x *= v_scale_;
    return inner_.Append(layer, pos, k, vs);
  }
  absl::Status Attend(int layer, int pos, absl::Span<const float> q,
                      absl::Span<float> out) override {
    ++attends;
    return inner_.Attend(layer, pos, q, out);
  }
  int Length(int layer) const override { return inner_.Length(layer); }
  int appends = 0, attends = 0, last_append_pos = -1;

 private:
  Fp32KvCache& inner_;
  float v_scale_;
};

TEST(EngineKvTest, AttentionGoesThroughTheView) {
  Engine& e = SharedEngine();
  auto direct = e.NewCache();
  auto inner = e.NewCache();
  auto inner2 = e.NewCache();
  ASSERT_TRUE(direct.ok() && inner.ok() && inner2.ok());
  RecordingView view(**inner, 1.0f);
  const std::vector<int> prompt = e.tokenizer().Encode("The cat sat on the mat", true);
  auto a = e.Prefill(prompt, 0, **direct);
  ASSERT_TRUE(a.ok());
  const std::vector<float> logits_direct(a->begin(), a->end());
  auto b = e.Prefill(prompt, 0, view);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(std::vector<float>(b->begin(), b->end()), logits_direct);
  const int n = static_cast<int>(prompt.size());
  EXPECT_EQ(view.appends, n * e.config().n_layers);
  EXPECT_EQ(view.attends, n * e.config().n_layers);
  EXPECT_EQ(view.last_append_pos, n - 1);
  EXPECT_EQ((*inner)->Length(0), n);

  RecordingView scaled(**inner2, 0.5f);
  auto c = e.Prefill(prompt, 0, scaled);
  ASSERT_TRUE(c.ok());
  double diff = 0;
  for (size_t i = 0; i < logits_direct.size(); ++i) diff += std::fabs((*c)[i] - logits_direct[i]);
  EXPECT_GT(diff, 1.0) << "scaling V inside the view must change the logits";
}

TEST(EngineKvTest, ObserverSeesPostRopeRowsThatTheCacheStores) {
  Engine& e = SharedEngine();
  auto cache = e.NewCache();
  ASSERT_TRUE(cache.ok());
  QkvRecorder rec({2});
  e.set_observer(&rec);
  const std::vector<int> prompt = e.tokenizer().Encode("Lily saw a big dog", true);
  auto r = e.Prefill(prompt, 0, **cache);
  e.set_observer(nullptr);
  ASSERT_TRUE(r.ok());
  const int n = static_cast<int>(prompt.size());
  const auto& rows = rec.rows(2);
  ASSERT_EQ(rows.positions.size(), static_cast<size_t>(n));
  EXPECT_EQ(rows.positions.front(), 0);
  EXPECT_EQ(rows.positions.back(), n - 1);
  EXPECT_EQ(rows.q.size(), static_cast<size_t>(n * 64));
  EXPECT_TRUE(rec.rows(1).positions.empty());  // layer not chosen
  const auto keys = (*cache)->Keys(2);
  const auto values = (*cache)->Values(2);
  EXPECT_EQ(std::vector<float>(keys.begin(), keys.end()), rows.k);
  EXPECT_EQ(std::vector<float>(values.begin(), values.end()), rows.v);
}

TEST(EngineKvTest, RopeRotatesAdjacentPairs) {
  // Layer 0's attention input depends only on the token, so one token at positions 1 and 5
  // yields q/k rows that differ exactly by rotating each adjacent pair (2i, 2i+1) of each head
  // by the angle (5 - 1)·10000^(-2i/8) (NeoX-style half rotation would fail this).
  Engine& e = SharedEngine();
  auto cache = e.NewCache();
  ASSERT_TRUE(cache.ok());
  QkvRecorder rec({0});
  e.set_observer(&rec);
  auto r = e.Prefill(std::vector<int>{1, 300, 301, 302, 303, 300}, 0, **cache);
  e.set_observer(nullptr);
  ASSERT_TRUE(r.ok());
  const auto& rows = rec.rows(0);
  ASSERT_EQ(rows.positions.size(), 6u);
  auto check = [](const std::vector<float>& all, int heads, const char* what) {
    const int d = 8, w = heads * d;
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < d / 2; ++i) {
        const float angle = 4.0f * std::pow(10000.0f, -2.0f * i / d);
        const float a = all[1 * w + h * d + 2 * i], b = all[1 * w + h * d + 2 * i + 1];
        const float ra = a * std::cos(angle) - b * std::sin(angle);
        const float rb = a * std::sin(angle) + b * std::cos(angle);
        EXPECT_NEAR(all[5 * w + h * d + 2 * i], ra, 1e-4f)
            << what << " head " << h << " pair " << i;
        EXPECT_NEAR(all[5 * w + h * d + 2 * i + 1], rb, 1e-4f)
            << what << " head " << h << " pair " << i;
      }
    }
  };
  check(rows.q, 8, "q");
  check(rows.k, 4, "k");
  // V is not rotated: identical at both positions.
  EXPECT_EQ(std::vector<float>(rows.v.begin() + 32, rows.v.begin() + 64),
            std::vector<float>(rows.v.begin() + 160, rows.v.begin() + 192));
}

TEST(EngineKvTest, ReferenceAttentionHandExample) {
  // 2 query heads sharing 1 KV head (GQA), d = 2. Scores: q·k/√2 = 0 and ln 3 → p = 1/4, 3/4.
  const AttentionShape shape{2, 1, 2};
  const float s = std::sqrt(2.0f) * std::log(3.0f);
  const float q[4] = {1, 0, 1, 0};
  const float keys[4] = {0, 0, s, 0};
  const float values[4] = {4, 0, 0, 8};
  float out[4];
  ReferenceAttention(shape, 2, q, keys, values, 2, out);
  for (int h = 0; h < 2; ++h) {
    EXPECT_NEAR(out[2 * h], 1.0f, 1e-5);
    EXPECT_NEAR(out[2 * h + 1], 6.0f, 1e-5);
  }
  // Only position 0 (causal prefix of length 1).
  ReferenceAttention(shape, 1, q, keys, values, 2, out);
  EXPECT_NEAR(out[0], 4.0f, 1e-6);
  EXPECT_NEAR(out[1], 0.0f, 1e-6);
}

TEST(EngineKvTest, Fp32CacheRefusesBadUse) {
  auto cache = Fp32KvCache::Create(2, {2, 1, 2}, 3);
  ASSERT_TRUE(cache.ok());
  Fp32KvCache& c = **cache;
  const std::vector<float> kv = {1, 2};
  std::vector<float> q = {1, 0, 0, 1}, out(4);
  EXPECT_EQ(c.Append(0, 1, kv, kv).code(), absl::StatusCode::kInvalidArgument);  // gap
  EXPECT_EQ(c.Append(2, 0, kv, kv).code(), absl::StatusCode::kInvalidArgument);  // layer
  EXPECT_EQ(c.Append(0, 0, std::vector<float>{1}, kv).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Attend(0, 0, q, absl::MakeSpan(out)).code(), absl::StatusCode::kInvalidArgument);
  for (int p = 0; p < 3; ++p) ASSERT_TRUE(c.Append(0, p, kv, kv).ok());
  EXPECT_EQ(c.Append(0, 3, kv, kv).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(c.Attend(0, 2, q, absl::MakeSpan(out)).ok());
  // Rewriting position 1 drops position 2.
  ASSERT_TRUE(c.Append(0, 1, kv, kv).ok());
  EXPECT_EQ(c.Length(0), 2);
  EXPECT_EQ(c.Attend(0, 2, q, absl::MakeSpan(out)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Fp32KvCache::Create(1, {3, 2, 4}, 8).status().code(),
            absl::StatusCode::kInvalidArgument);  // 3 heads over 2 KV heads
}

// ---- sampling -------------------------------------------------------------------------------

TEST(EngineSamplingTest, SeededSamplingIsReproducible) {
  Engine& e = SharedEngine();
  auto run = [&](float temperature, float top_p, uint64_t seed) {
    auto cache = e.NewCache();
    EXPECT_TRUE(cache.ok());
    GenerateOptions opt;
    opt.max_tokens = 60;
    opt.stop_at_eos = false;
    opt.sampling = {.temperature = temperature, .top_p = top_p, .seed = seed};
    auto r = e.Generate({1}, opt, **cache);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->tokens : std::vector<int>{};
  };
  const auto a = run(1.0f, 0.9f, 7);
  EXPECT_EQ(a.size(), 60u);
  EXPECT_EQ(run(1.0f, 0.9f, 7), a);
  EXPECT_NE(run(1.0f, 0.9f, 8), a);
  EXPECT_NE(run(1.0f, 1.0f, 7), run(0.0f, 1.0f, 0));
  // A tiny nucleus keeps only the most probable token: the greedy sequence.
  EXPECT_EQ(run(1.0f, 1e-6f, 3), run(0.0f, 1.0f, 0));
}

TEST(EngineSamplingTest, SamplerDistribution) {
  // logits ln(1), ln(3): at temperature 1 token 1 has probability 3/4.
  Sampler s({.temperature = 1.0f, .top_p = 1.0f, .seed = 99});
  const std::vector<float> logits = {0.0f, std::log(3.0f)};
  int ones = 0;
  for (int i = 0; i < 20000; ++i) ones += s.Sample(logits);
  EXPECT_NEAR(ones / 20000.0, 0.75, 0.02);
  Sampler greedy({});
  EXPECT_EQ(greedy.Sample(std::vector<float>{0.5f, 2.0f, 2.0f, -1.0f}), 1);  // lowest id on ties
  EXPECT_FALSE(Sampler::Validate({.temperature = -1.0f}).ok());
  EXPECT_FALSE(Sampler::Validate({.temperature = NAN}).ok());
  EXPECT_FALSE(Sampler::Validate({.top_p = 0.0f}).ok());
  EXPECT_FALSE(Sampler::Validate({.top_p = 1.5f}).ok());
}

// ---- errors ---------------------------------------------------------------------------------

TEST(EngineErrorTest, BadInputsAreRefused) {
  Engine& e = SharedEngine();
  auto cache = e.NewCache();
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(e.Forward(512, 0, **cache).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.Forward(-1, 0, **cache).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.Forward(1, 512, **cache).status().code(), absl::StatusCode::kInvalidArgument);
  // Skipping positions is refused by the cache, annotated with the layer.
  auto gap = e.Forward(1, 5, **cache);
  ASSERT_FALSE(gap.ok());
  EXPECT_NE(gap.status().message().find("layer 0"), std::string::npos) << gap.status();

  std::vector<int> long_prompt(513, 100);
  long_prompt[0] = 1;
  auto r = e.Generate(long_prompt, {}, **cache);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("prompt has 513 tokens"), std::string::npos);
  EXPECT_EQ(e.Generate({}, {}, **cache).status().code(), absl::StatusCode::kInvalidArgument);
  GenerateOptions bad;
  bad.sampling.top_p = 2.0f;
  EXPECT_EQ(e.Generate({1}, bad, **cache).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(EngineErrorTest, MissingAndCorruptedModels) {
  auto missing = Engine::Create("/nonexistent/m.gguf");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);

  std::ifstream in(kModel, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  ASSERT_GT(bytes.size(), 20000u);
  const std::string path = ::testing::TempDir() + "/engine_test_corrupt.gguf";
  auto write = [&](const std::string& b) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  write(bytes.substr(0, 20000));
  auto truncated = Engine::Create(path);
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(truncated.status().message().find(path), std::string::npos) << truncated.status();

  // A valid GGUF whose architecture is not llama.
  std::string arch = bytes;
  const size_t p = arch.find("llama");
  ASSERT_NE(p, std::string::npos);
  arch.replace(p, 5, "gpt2x");
  write(arch);
  auto wrong = Engine::Create(path);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  EXPECT_NE(wrong.status().message().find("general.architecture"), std::string::npos);
  std::remove(path.c_str());
}

TEST(EngineErrorTest, NonFiniteWeightsAreRefusedAtLoad) {
  std::ifstream in(kModel, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  auto gguf = GgufFile::Parse(bytes);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  const GgufTensor* t = (*gguf)->FindTensor("blk.1.attn_q.weight");
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(t->dtype, GgufDType::kF32);
  const std::string path = ::testing::TempDir() + "/engine_test_nan.gguf";
  for (float bad : {std::nanf(""), -INFINITY}) {
    std::string b = bytes;
    const uint64_t at = (*gguf)->data_offset() + t->offset + 7 * sizeof(float);
    std::memcpy(&b[at], &bad, sizeof(float));
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(b.data(), static_cast<std::streamsize>(b.size()));
    }
    auto e = Engine::Create(path);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
    const std::string want = std::string("tensor 'blk.1.attn_q.weight' element 7 is ") +
                             (std::isnan(bad) ? "nan" : "-inf");
    EXPECT_NE(e.status().message().find(want), std::string::npos) << e.status();
  }
  std::remove(path.c_str());
}

// Newcomer report 11 F1: a copy of stories260K whose llama.block_count says 4 while it holds
// the tensors of 5 layers loaded and ran 4 layers (exit 0, other text). The loader refuses every
// tensor it does not read, naming the first and the metadata key; block_count 6 (a layer
// missing) is refused naming the missing tensor. A tensor of another name (output.weight
// renamed, so the output would silently become tied) is refused the same way.
TEST(EngineErrorTest, TensorsTheMetadataDoesNotDescribeAreRefused) {
  std::ifstream in(kModel, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  auto gguf = GgufFile::Parse(bytes);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  ASSERT_EQ(*(*gguf)->GetUint("llama.block_count"), 5u);
  // The key string, then its value type (u32) and the u32 value.
  const std::string key = "llama.block_count";
  const size_t k = bytes.find(key);
  ASSERT_NE(k, std::string::npos);
  const size_t at = k + key.size() + 4;
  uint32_t type = 0, value = 0;
  std::memcpy(&type, &bytes[k + key.size()], 4);
  std::memcpy(&value, &bytes[at], 4);
  ASSERT_EQ(type, 4u);  // GGUF uint32
  ASSERT_EQ(value, 5u);
  const std::string path = ::testing::TempDir() + "/engine_test_layers.gguf";
  auto load = [&](const std::string& b) {
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(b.data(), static_cast<std::streamsize>(b.size()));
    }
    return Engine::Create(path);
  };
  auto with_layers = [&](uint32_t n) {
    std::string b = bytes;
    std::memcpy(&b[at], &n, 4);
    return b;
  };
  {
    auto e = load(with_layers(4));
    ASSERT_FALSE(e.ok()) << "a 5-layer file loaded as 4 layers";
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
    EXPECT_NE(e.status().message().find("tensor 'blk.4.attn_q.weight' belongs to layer 4"),
              std::string::npos)
        << e.status();
    EXPECT_NE(e.status().message().find("llama.block_count 4"), std::string::npos) << e.status();
    EXPECT_NE(e.status().message().find("holds 9 tensor(s)"), std::string::npos) << e.status();
    EXPECT_NE(e.status().message().find(path), std::string::npos) << e.status();
  }
  {
    auto e = load(with_layers(6));
    ASSERT_FALSE(e.ok());
    EXPECT_NE(e.status().message().find("tensor 'blk.5.attn_norm.weight' is missing"),
              std::string::npos)
        << e.status();
  }
  {
    // Same length, so every offset stays valid.
    std::string b = bytes;
    // The tensor info's name, not the tail of blk.N.attn_output.weight.
    size_t o = b.find("output.weight");
    while (o != std::string::npos && b[o - 1] == '_') o = b.find("output.weight", o + 1);
    ASSERT_NE(o, std::string::npos);
    b.replace(o, 13, "outpux.weight");
    auto e = load(b);
    ASSERT_FALSE(e.ok()) << "an unknown tensor was ignored";
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
    EXPECT_NE(e.status().message().find("tensor 'outpux.weight' is not a tensor of the llama"),
              std::string::npos)
        << e.status();
  }
  {
    // The untouched file loads (the check cannot fire on the real model).
    auto e = load(bytes);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ((*e)->config().n_layers, 5);
  }
  std::remove(path.c_str());
}

// Newcomer report 10 F7: finite weights whose activations overflow (every 7th element of
// blk.1.attn_k.weight times 3e38: k becomes NaN/Inf; blk.2.attn_v.weight times 1e37: k and v
// stay finite but the residual stream's squares overflow, the RMS norm gives zeros and the
// logits a constant) made kvpool-engine generate print <unk> or blank tokens with exit 0. The
// forward pass now refuses them, naming the layer and what overflowed.
TEST(EngineErrorTest, ActivationsThatOverflowAreRefusedNamingTheLayer) {
  std::ifstream in(kModel, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  auto gguf = GgufFile::Parse(bytes);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  const std::string path = ::testing::TempDir() + "/engine_test_overflow.gguf";
  struct Case {
    const char* tensor;
    float scale;
    const char* want;
  };
  for (const Case& cs : {Case{"blk.1.attn_k.weight", 3e38f, "layer 1 pos 0: element "},
                         Case{"blk.2.attn_v.weight", 1e37f, "RMS norm is too large"}}) {
    SCOPED_TRACE(cs.tensor);
    const GgufTensor* t = (*gguf)->FindTensor(cs.tensor);
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->dtype, GgufDType::kF32);
    std::string b = bytes;
    const uint64_t base = (*gguf)->data_offset() + t->offset;
    for (uint64_t i = 0; i < t->num_elements; i += 7) {
      float w;
      std::memcpy(&w, &b[base + i * sizeof(float)], sizeof(float));
      w *= cs.scale;
      if (!std::isfinite(w)) w = std::copysign(3.4e38f, w);  // finite weights only
      std::memcpy(&b[base + i * sizeof(float)], &w, sizeof(float));
    }
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(b.data(), static_cast<std::streamsize>(b.size()));
    }
    auto e = Engine::Create(path);
    ASSERT_TRUE(e.ok()) << e.status();  // finite weights load
    auto cache = (*e)->NewCache(64);
    ASSERT_TRUE(cache.ok()) << cache.status();
    auto r = (*e)->Generate({1}, {.max_tokens = 4}, **cache);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(cs.want), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("overflow"), std::string::npos) << r.status();
  }
  std::remove(path.c_str());
}

// Newcomer s10b F4: a model whose weights are all zero gives logits that are all equal (0):
// greedy decoding emitted token 0 (<unk>) forever with exit 0, and eval/decode reported
// agreement 1.0 (both runs emit the same token 0). The forward pass refuses such logits.
TEST(EngineErrorTest, LogitsThatAreAllEqualAreRefusedAsADegenerateModel) {
  std::ifstream in(kModel, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  auto gguf = GgufFile::Parse(bytes);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  std::string b = bytes;
  for (const char* name : {"token_embd.weight", "output.weight", "output_norm.weight"}) {
    const GgufTensor* t = (*gguf)->FindTensor(name);
    if (t == nullptr) continue;  // tied output
    ASSERT_EQ(t->dtype, GgufDType::kF32) << name;
    const uint64_t base = (*gguf)->data_offset() + t->offset;
    std::fill_n(b.begin() + static_cast<std::ptrdiff_t>(base), t->num_elements * sizeof(float),
                '\0');
  }
  const std::string path = ::testing::TempDir() + "/engine_test_zero.gguf";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(b.data(), static_cast<std::streamsize>(b.size()));
  }
  auto e = Engine::Create(path);
  ASSERT_TRUE(e.ok()) << e.status();  // finite weights load
  auto cache = (*e)->NewCache(64);
  ASSERT_TRUE(cache.ok()) << cache.status();
  auto r = (*e)->Generate({1, 2, 3}, {.max_tokens = 4}, **cache);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("pos 0: every one of the 512 logits is 0"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("degenerate"), std::string::npos) << r.status();

  // The real model's logits are not refused (the check cannot fire on a working model).
  auto real = Engine::Create(kModel);
  ASSERT_TRUE(real.ok()) << real.status();
  auto real_cache = (*real)->NewCache(64);
  ASSERT_TRUE(real_cache.ok());
  EXPECT_TRUE((*real)->Generate({1, 2, 3}, {.max_tokens = 4}, **real_cache).ok());
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvpool::engine
