// kvpool-engine — runs the reference Llama engine on a GGUF model.
//
//   kvpool-engine generate --model stories260K-f32.gguf [--prompt TEXT] [--max-tokens N]
//                          [--temperature T] [--top-p P] [--seed S]
//
// Standard output carries only the generated text (streamed as it is produced, then a
// newline); logs and statistics (tokens/second) go to standard error. With no prompt generation
// starts from BOS; temperature 0 is greedy. Exit codes: 0 ok, 1 usage error (out-of-range
// numbers, a prompt that leaves no position to generate into), 2 runtime error (missing or
// corrupted model), with one line on standard error naming the problem. `--config FILE` takes YAML
// with the subcommand's flags in a section: "generate: {model: m.gguf, max-tokens: 64}" (explicit
// flags win).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>

#include "kvpool/common/cli.h"
#include "kvpool/common/log.h"
#include "kvpool/engine/engine.h"

namespace {

// Reads `v` as a double the way CLI11 reads a float flag, but without the spaces strtold skips.
bool ReadNumber(const std::string& v, double* out) {
  if (v.empty() || std::isspace(static_cast<unsigned char>(v.front())) ||
      std::isspace(static_cast<unsigned char>(v.back()))) {
    return false;
  }
  return CLI::detail::lexical_cast(v, *out);
}

int Fail(const std::string& message) {
  std::cerr << "kvpool-engine: " << message << "\n";
  return kvpool::cli::kExitRuntime;
}

}  // namespace

static int Run(int argc, char** argv) {
  CLI::App app{"kvpool-engine — the reference Llama engine (float32, CPU) on a GGUF model"};
  kvpool::cli::Setup(app, "kvpool-engine");
  app.require_subcommand(1);
  CLI::App* gen = app.add_subcommand("generate", "generate text from a prompt (or from BOS)");
  std::string model;
  std::string prompt;
  int max_tokens = 256;
  float temperature = 0.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
  // A directory, device, FIFO or file above the limit is a usage error (docs/TOOLS.md "Input
  // files"); the GGUF reader would block opening a FIFO.
  gen->add_option("--model", model, "path of the GGUF model file")
      ->required()
      ->check(kvpool::cli::InputFile(kvpool::cli::kMaxModelFileBytes));
  gen->add_option("--prompt", prompt, "text to continue; empty starts from BOS");
  // Flag values are checked at parse time: a bad value is a usage error (exit 1) naming the flag.
  gen->add_option("--max-tokens", max_tokens, "tokens to generate at most")
      ->check(kvpool::cli::Range(0, INT32_MAX))
      ->capture_default_str();
  // Both are read as double and then checked as the float they are stored in: "--top-p 1e-46"
  // is in (0, 1] but is 0 as a float, and was refused as if it were outside (newcomer 16 F12);
  // a positive temperature that is 0 as a float would sample greedily without a word.
  gen->add_option("--temperature", temperature, "sampling temperature; 0 = greedy")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            double t = 0;
            if (!ReadNumber(v, &t) || !std::isfinite(t) || t < 0) {
              return "must be a finite number >= 0, got '" + v + "'";
            }
            if (!std::isfinite(static_cast<float>(t))) {
              return "'" + v + "' is beyond the largest float (about 3.4e38)";
            }
            if (t > 0 && static_cast<float>(t) == 0.0f) {
              return "'" + v +
                     "' is positive but underflows to 0 as a float (greedy sampling): give 0 "
                     "for greedy, or at least 1e-45";
            }
            return {};
          },
          "FLOAT >= 0"))
      ->capture_default_str();
  gen->add_option("--top-p", top_p, "nucleus sampling mass in (0, 1]; 1 = off")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            double p = 0;
            if (!ReadNumber(v, &p) || !(p > 0 && p <= 1)) {
              return "must be in (0, 1], got '" + v + "'";
            }
            if (static_cast<float>(p) == 0.0f) {
              return "'" + v + "' is in (0, 1] but underflows to 0 as a float: give at least 1e-45";
            }
            return {};
          },
          "FLOAT in (0,1]"))
      ->capture_default_str();
  gen->add_option("--seed", seed, "random seed for sampling")
      ->check(kvpool::cli::Range(uint64_t{0}, UINT64_MAX))
      ->capture_default_str();
  KVPOOL_CLI_PARSE(app, argc, argv);

  kvpool::engine::GenerateOptions options;
  options.max_tokens = max_tokens;
  options.sampling = {.temperature = temperature, .top_p = top_p, .seed = seed};
  if (auto s = kvpool::engine::Sampler::Validate(options.sampling); !s.ok()) {
    return Fail(std::string(temperature < 0 || !std::isfinite(temperature) ? "--temperature: "
                                                                           : "--top-p: ") +
                std::string(s.message()));
  }

  auto engine = kvpool::engine::Engine::Create(model);
  if (!engine.ok()) return Fail("cannot load model: " + std::string(engine.status().message()));
  const auto& cfg = (*engine)->config();
  const auto& tok = (*engine)->tokenizer();
  const std::vector<int> tokens = tok.Encode(prompt, /*add_bos=*/true);
  // Generating needs one free position (docs/WORKER.md "Prompt length"; kvpool-worker applies
  // the same rule): a prompt holds at most context_length - 1 tokens, BOS included. A usage
  // error, found once the model tells the context.
  if (static_cast<int>(tokens.size()) >= cfg.context_length) {
    std::cerr << "kvpool-engine: --prompt is " << tokens.size()
              << " tokens long; a prompt may hold at most " << cfg.context_length - 1
              << " (the model's context of " << cfg.context_length
              << " less one position to generate into)\n";
    return kvpool::cli::kExitUsage;
  }
  KVPOOL_LOG_INFO(
      "model {}: {} layers, dim {}, {} heads ({} KV heads, head_dim {}), ffn {}, "
      "vocab {}, context {}",
      model, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
      cfg.vocab_size, cfg.context_length);

  // The cache holds what this run writes (the prompt and the tokens generated after it), not
  // the model's whole context: a GGUF context_length of 2^24 (the reader's bound) allocated
  // 21 GB of fp32 K/V for stories260K up front, 53 s before the first token or std::bad_alloc
  // (newcomer s8 N12). Generate stops at the context as before.
  const int64_t positions = std::min<int64_t>(
      cfg.context_length, static_cast<int64_t>(tokens.size()) + std::max(max_tokens, 1));
  auto cache = (*engine)->NewCache(static_cast<int>(positions));
  if (!cache.ok()) return Fail(std::string(cache.status().message()));

  int prev = tokens.back();
  auto result = (*engine)->Generate(tokens, options, **cache, [&](int t) {
    const std::string piece = tok.DecodeNext(prev, t);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    prev = t;
    return true;
  });
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (!result.ok()) return Fail(std::string(result.status().message()));

  const double n = static_cast<double>(result->tokens.size());
  KVPOOL_LOG_INFO("prefill: {} tokens in {:.3f} ms", result->prompt_tokens,
                  result->prefill_seconds * 1e3);
  KVPOOL_LOG_INFO("generated {} tokens in {:.3f} s: {:.1f} tok/s{}", result->tokens.size(),
                  result->decode_seconds,
                  result->decode_seconds > 0 ? n / result->decode_seconds : 0.0,
                  result->stopped_at_eos ? " (stopped at end of sequence)"
                  : result->context_full ? " (context full)"
                                         : "");
  return kvpool::cli::kExitOk;
}

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {  // e.g. std::bad_alloc; never escape main
    return Fail(std::string("unexpected error: ") + e.what());
  }
}
