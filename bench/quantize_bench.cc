// CPU throughput of the OSCAR quantizer, per core (single thread), in GB/s of BF16 input:
//   (a) rotate (dense 128×128, fp32 FMA) + bf16 round + clip + INT2 quantize
//       (RotateQuantizeRowsBf16, the pool's commit path) — also as a fraction of this core's
//       measured FMA peak (the rotation costs 64 FMA per input byte, PERF.md);
//   (b) clip + INT2 quantize of already-rotated BF16 rows (QuantizeRowsBf16, the demotion path),
//       with the K ratio 0.96 (the target), the V ratio 0.92 and without clipping;
//   (c) dequantization of INT2 rows to fp32 (DequantizeRows);
// each on the AVX2 path and the scalar path (the baseline ratio), plus the FMA peak itself.
// Prints Google Benchmark's table, then a summary, and writes a JSON results file
// (--json-out, default quantize_cpu.json in the current directory) with config, git SHA and
// host; committed results under bench/results/ are written only when named explicitly.
//
// The headline of (a) — its fraction of the FMA ceiling — comes from an interleaved run after
// the table: --pairs alternating windows of --window-ms thread CPU time, one running the FMA
// kernel, the next (a) on the 576 cache-resident rows, so the kernel and the ceiling are measured
// over the same stretch of time on this shared 2-core machine (the table's benchmarks run one
// after the other, seconds apart). Headline = the median (a) window; ceiling = the best FMA
// measurement of the whole run (every table repetition and every window) / 64 FMA per byte.
// The spread (min, p10, p25, p75, p90, max) of both is printed and stored.
//
//   build/bin/quantize_bench [--benchmark_min_time=0.5] [--pairs 41] [--window-ms 25]
//                            [--json-out FILE]
#include <immintrin.h>
#include <unistd.h>

#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "kvpool/common/cli.h"
#include "kvpool/common/version.h"
#include "kvpool/kernels/calibration.h"
#include "kvpool/kernels/numeric.h"
#include "kvpool/kernels/quantize.h"

namespace {

using kvpool::KernelIsa;

constexpr uint32_t kD = 128;
constexpr uint64_t kRows = 8192;  // 2 MiB of BF16 input per iteration

struct Inputs {
  std::vector<uint16_t> x;        // un-rotated bf16 [rows][d]
  std::vector<uint16_t> rotated;  // rotated bf16
  std::vector<float> r;           // dense rotation
  std::vector<uint8_t> codes;
  std::vector<uint16_t> params, rot_out;
};

// Thread CPU time in seconds (for the per-call minimum: the least-disturbed call on a shared
// machine).
double ThreadCpu() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

Inputs& In() {
  static Inputs in = [] {
    Inputs s;
    std::mt19937 rng(1);
    std::normal_distribution<float> n01;
    s.x.resize(kRows * kD);
    for (size_t i = 0; i < s.x.size(); ++i)
      s.x[i] = kvpool::Fp32ToBf16(n01(rng) * (i % kD == 7 ? 20.0f : 1.0f));
    // A dense fitted rotation (random SPD target).
    std::vector<double> c(kD * kD, 0.0), a(kD * kD);
    for (auto& v : a) v = n01(rng);
    for (uint32_t i = 0; i < kD; ++i)
      for (uint32_t j = 0; j < kD; ++j)
        for (uint32_t k = 0; k < kD; ++k) c[i * kD + j] += a[i * kD + k] * a[j * kD + k];
    s.r = kvpool::FitRotation(c, kD)->rotation;
    std::vector<float> rot(kRows * kD);
    kvpool::RotateRowsBf16(s.x.data(), kRows, kD, s.r.data(), rot.data());
    s.rotated.resize(rot.size());
    for (size_t i = 0; i < rot.size(); ++i) s.rotated[i] = kvpool::Fp32ToBf16(rot[i]);
    s.codes.resize(kRows * kD / 4);
    s.params.resize(kRows * 2);
    s.rot_out.resize(kRows * kD);
    return s;
  }();
  return in;
}

void BM_RotateQuantize(benchmark::State& st) {
  const KernelIsa isa = st.range(0) ? KernelIsa::kAvx2 : KernelIsa::kScalar;
  if (isa == KernelIsa::kAvx2 && !kvpool::CpuHasAvx2()) {
    st.SkipWithError("no AVX2");
    return;
  }
  Inputs& in = In();
  const uint64_t rows = static_cast<uint64_t>(st.range(1));
  double best = 1e30;
  for (auto _ : st) {
    const double t0 = ThreadCpu();
    auto s =
        kvpool::RotateQuantizeRowsBf16(in.x.data(), rows, kD, in.r.data(), 0.96f, in.rot_out.data(),
                                       in.codes.data(), in.params.data(), nullptr, isa);
    best = std::min(best, ThreadCpu() - t0);
    if (!s.ok()) st.SkipWithError("quantize failed");
    benchmark::DoNotOptimize(in.codes.data());
  }
  st.counters["best_call_GB/s"] = static_cast<double>(rows) * kD * 2 / best / 1e9;
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * rows * kD * 2));
  st.counters["GFMA/s"] =
      benchmark::Counter(static_cast<double>(rows) * kD * kD * st.iterations(),
                         benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}
// rows: 576 (144 KiB of BF16 input, cache-resident) and 8192 (2 MiB, beyond L2).
BENCHMARK(BM_RotateQuantize)
    ->Repetitions(5)
    ->Args({1, 576})
    ->Args({1, 8192})
    ->Args({0, 576})
    ->ArgNames({"avx2", "rows"})
    ->Unit(benchmark::kMillisecond);

void BM_ClipQuantize(benchmark::State& st) {
  const KernelIsa isa = st.range(0) ? KernelIsa::kAvx2 : KernelIsa::kScalar;
  const uint64_t rows = static_cast<uint64_t>(st.range(1));
  const float ratio = static_cast<float>(st.range(2)) / 100.0f;  // clip ratio in percent
  if (isa == KernelIsa::kAvx2 && !kvpool::CpuHasAvx2()) {
    st.SkipWithError("no AVX2");
    return;
  }
  Inputs& in = In();
  double best = 1e30;
  for (auto _ : st) {
    const double t0 = ThreadCpu();
    auto s = kvpool::QuantizeRowsBf16(in.rotated.data(), rows, kD, ratio, in.codes.data(),
                                      in.params.data(), nullptr, isa);
    best = std::min(best, ThreadCpu() - t0);
    if (!s.ok()) st.SkipWithError("quantize failed");
    benchmark::DoNotOptimize(in.codes.data());
  }
  st.counters["best_call_GB/s"] = static_cast<double>(rows) * kD * 2 / best / 1e9;
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * rows * kD * 2));
}
// clip: 96 = K (0.96), 92 = V (0.92), 0 = no clipping (the cost of the threshold selection).
BENCHMARK(BM_ClipQuantize)
    ->Repetitions(5)
    ->Args({1, 576, 96})
    ->Args({1, 8192, 96})
    ->Args({1, 576, 92})
    ->Args({1, 576, 0})
    ->Args({0, 576, 96})
    ->ArgNames({"avx2", "rows", "clip"})
    ->Unit(benchmark::kMillisecond);

// Dequantization of INT2 rows (codes + fp16 params -> fp32), in GB/s of the BF16 data it
// replaces (rows·d·2 bytes), so it compares with (b).
void BM_Dequantize(benchmark::State& st) {
  const KernelIsa isa = st.range(0) ? KernelIsa::kAvx2 : KernelIsa::kScalar;
  const uint64_t rows = static_cast<uint64_t>(st.range(1));
  if (isa == KernelIsa::kAvx2 && !kvpool::CpuHasAvx2()) {
    st.SkipWithError("no AVX2");
    return;
  }
  Inputs& in = In();
  if (!kvpool::QuantizeRowsBf16(in.rotated.data(), rows, kD, 0.96f, in.codes.data(),
                                in.params.data(), nullptr)
           .ok()) {
    st.SkipWithError("quantize failed");
    return;
  }
  std::vector<float> out(rows * kD);
  double best = 1e30;
  for (auto _ : st) {
    const double t0 = ThreadCpu();
    kvpool::DequantizeRows(in.codes.data(), in.params.data(), rows, kD, out.data(), isa);
    best = std::min(best, ThreadCpu() - t0);
    benchmark::DoNotOptimize(out.data());
  }
  st.counters["best_call_GB/s"] = static_cast<double>(rows) * kD * 2 / best / 1e9;
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * rows * kD * 2));
}
BENCHMARK(BM_Dequantize)
    ->Repetitions(5)
    ->Args({1, 576})
    ->Args({0, 576})
    ->ArgNames({"avx2", "rows"})
    ->Unit(benchmark::kMillisecond);

// This core's FMA peak: 10 independent 8-lane FMA chains in named registers (enough to cover
// 2 FMA units x 4-5 cycles latency), no memory traffic.
__attribute__((target("avx2,fma"), noinline)) float FmaKernel(int64_t iters) {
  __m256 a0 = _mm256_set1_ps(1), a1 = _mm256_set1_ps(2), a2 = _mm256_set1_ps(3);
  __m256 a3 = _mm256_set1_ps(4), a4 = _mm256_set1_ps(5), a5 = _mm256_set1_ps(6);
  __m256 a6 = _mm256_set1_ps(7), a7 = _mm256_set1_ps(8), a8 = _mm256_set1_ps(9);
  __m256 a9 = _mm256_set1_ps(10);
  const __m256 m = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int64_t n = 0; n < iters; ++n) {
    a0 = _mm256_fmadd_ps(a0, m, b);
    a1 = _mm256_fmadd_ps(a1, m, b);
    a2 = _mm256_fmadd_ps(a2, m, b);
    a3 = _mm256_fmadd_ps(a3, m, b);
    a4 = _mm256_fmadd_ps(a4, m, b);
    a5 = _mm256_fmadd_ps(a5, m, b);
    a6 = _mm256_fmadd_ps(a6, m, b);
    a7 = _mm256_fmadd_ps(a7, m, b);
    a8 = _mm256_fmadd_ps(a8, m, b);
    a9 = _mm256_fmadd_ps(a9, m, b);
  }
  const __m256 s =
      _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                    _mm256_add_ps(_mm256_add_ps(a4, a5),
                                  _mm256_add_ps(_mm256_add_ps(a6, a7), _mm256_add_ps(a8, a9))));
  return _mm256_cvtss_f32(s);
}

void BM_FmaPeak(benchmark::State& st) {
  if (!kvpool::CpuHasAvx2()) {
    st.SkipWithError("no AVX2");
    return;
  }
  constexpr int64_t kIters = 1 << 22;
  for (auto _ : st) {
    int64_t iters = kIters;
    benchmark::DoNotOptimize(iters);  // keep the (pure) call inside the timed loop
    benchmark::DoNotOptimize(FmaKernel(iters));
  }
  st.counters["GFMA/s"] = benchmark::Counter(
      80.0 * kIters * st.iterations(), benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_FmaPeak)->Repetitions(5)->Unit(benchmark::kMillisecond);

// Sorted-sample quantile (nearest rank).
double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

nlohmann::json Spread(const std::vector<double>& v) {
  return {{"min", Quantile(v, 0.0)},  {"p10", Quantile(v, 0.1)},
          {"p25", Quantile(v, 0.25)}, {"median", Quantile(v, 0.5)},
          {"p75", Quantile(v, 0.75)}, {"p90", Quantile(v, 0.9)},
          {"max", Quantile(v, 1.0)},  {"n", v.size()}};
}

// The interleaved measurement of (a) against the FMA peak (see the file comment): per pair one
// window of FmaKernel calls (GFMA/s) and one of RotateQuantizeRowsBf16 calls on `rows` rows
// (GB/s of BF16 input), each window at least window_s of thread CPU time.
struct Interleaved {
  std::vector<double> fma_gfma_s, a_gb_s;
};
Interleaved RunInterleaved(int pairs, double window_s, uint64_t rows) {
  Inputs& in = In();
  constexpr int64_t kFmaIters = 1 << 18;  // ~0.5 ms per call
  auto fma_window = [&] {
    const double t0 = ThreadCpu();
    int64_t calls = 0;
    double dt = 0;
    do {
      int64_t iters = kFmaIters;
      benchmark::DoNotOptimize(iters);
      benchmark::DoNotOptimize(FmaKernel(iters));
      ++calls;
      dt = ThreadCpu() - t0;
    } while (dt < window_s);
    return 80.0 * static_cast<double>(kFmaIters * calls) / dt / 1e9;
  };
  auto a_window = [&] {
    const double t0 = ThreadCpu();
    int64_t calls = 0;
    double dt = 0;
    do {
      auto s = kvpool::RotateQuantizeRowsBf16(in.x.data(), rows, kD, in.r.data(), 0.96f,
                                              in.rot_out.data(), in.codes.data(), in.params.data(),
                                              nullptr, KernelIsa::kAvx2);
      if (!s.ok()) return 0.0;
      benchmark::DoNotOptimize(in.codes.data());
      ++calls;
      dt = ThreadCpu() - t0;
    } while (dt < window_s);
    return static_cast<double>(rows * kD * 2 * static_cast<uint64_t>(calls)) / dt / 1e9;
  };
  Interleaved r;
  a_window();  // warm-up (caches, packed buffers, page faults)
  for (int p = 0; p < pairs; ++p) {
    r.fma_gfma_s.push_back(fma_window());
    r.a_gb_s.push_back(a_window());
  }
  return r;
}

// Collects every run while still printing the usual console table: per benchmark the median
// repetition (the headline: typical speed on this shared machine) and the best one (least
// disturbed by other processes), plus every repetition's rate.
class Collector : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate) continue;
      const double rate =
          r.counters.count("bytes_per_second")
              ? static_cast<double>(r.counters.at("bytes_per_second").value)
              : (r.counters.count("GFMA/s") ? static_cast<double>(r.counters.at("GFMA/s").value)
                                            : 0.0);
      nlohmann::json j;
      j["rate"] = rate;
      j["name"] = r.benchmark_name();
      j["real_time_ms"] = r.GetAdjustedRealTime();
      j["cpu_time_ms"] = r.GetAdjustedCPUTime();
      j["iterations"] = r.iterations;
      for (const auto& [k, c] : r.counters) j[k] = static_cast<double>(c.value);
      j["repetition"] = r.repetition_index;
      reps[r.benchmark_name()].push_back(j);
    }
    ConsoleReporter::ReportRuns(runs);
  }
  // The repetition with the median (which = 0.5) or best (which = 1.0) rate.
  const nlohmann::json* Pick(const std::string& name, double which) const {
    auto it = reps.find(name);
    if (it == reps.end() || it->second.empty()) return nullptr;
    std::vector<const nlohmann::json*> v;
    for (const auto& j : it->second) v.push_back(&j);
    std::sort(v.begin(), v.end(), [](const nlohmann::json* a, const nlohmann::json* b) {
      return (*a)["rate"].get<double>() < (*b)["rate"].get<double>();
    });
    return v[static_cast<size_t>(which * static_cast<double>(v.size() - 1) + 0.5)];
  }
  std::map<std::string, std::vector<nlohmann::json>> reps;
};

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  // --help prints this program's flags (benchmark::Initialize would print only Google
  // Benchmark's --benchmark_* flags and exit).
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    help = help || std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h";
  }
  if (!help) benchmark::Initialize(&argc, argv);  // consumes --benchmark_* flags
  CLI::App app{
      "quantize_bench — CPU OSCAR quantizer throughput per core (also accepts Google "
      "Benchmark's --benchmark_* flags, e.g. --benchmark_filter, --benchmark_min_time)"};
  kvpool::cli::Setup(app, "quantize_bench");
  // Default in the current directory: an absolute default into the source tree overwrote the
  // committed bench/results/quantize_cpu.json on every run.
  std::string json_out = "quantize_cpu.json";
  app.add_option("--json-out", json_out, "results file")
      ->check(kvpool::cli::OutputFile())
      ->capture_default_str();
  int pairs = 41;
  app.add_option("--pairs", pairs, "interleaved FMA / (a) window pairs (0: skip)")
      ->capture_default_str()
      ->check(kvpool::cli::Range(0, 100000));
  double window_ms = 25.0;
  app.add_option("--window-ms", window_ms, "thread CPU time per interleaved window, ms")
      ->capture_default_str()
      ->check(kvpool::cli::Range(1.0, 10000.0));
  KVPOOL_CLI_PARSE(app, argc, argv);

  Collector rep;
  // A filter that matches nothing used to write a summary of zeros that read as measurements
  // and exit 0 (newcomer report 13).
  if (benchmark::RunSpecifiedBenchmarks(&rep) == 0) {
    std::fprintf(stderr, "quantize_bench: --benchmark_filter matches no benchmark\n");
    return kvpool::cli::kExitUsage;
  }
  // --benchmark_list_tests lists and runs nothing: no summary of zeros, no results file
  // (newcomer report 13b).
  if (rep.reps.empty()) return 0;
  const bool avx2 = kvpool::CpuHasAvx2();
  const Interleaved il =
      avx2 && pairs > 0 ? RunInterleaved(pairs, window_ms / 1e3, 576) : Interleaved{};

  // value of `key` in the median (which = 0.5) or best (1.0) repetition of benchmark `name`
  auto get = [&](const std::string& name, const std::string& key, double which = 0.5) -> double {
    const nlohmann::json* j = rep.Pick(name + "/repeats:5", which);
    if (j == nullptr || !j->contains(key)) return 0.0;
    return (*j)[key].get<double>();
  };
  const std::string a576 = "BM_RotateQuantize/avx2:1/rows:576";
  const std::string b576 = "BM_ClipQuantize/avx2:1/rows:576/clip:96";
  const double peak = get("BM_FmaPeak", "GFMA/s", 1.0) / 1e9;  // the peak: best repetition
  const double a_gbs = get(a576, "bytes_per_second") / 1e9;
  const double a_fma = get(a576, "GFMA/s") / 1e9;
  const double a_big = get("BM_RotateQuantize/avx2:1/rows:8192", "bytes_per_second") / 1e9;
  const double a_scalar = get("BM_RotateQuantize/avx2:0/rows:576", "bytes_per_second") / 1e9;
  const double b_gbs = get(b576, "bytes_per_second") / 1e9;
  const double b_big = get("BM_ClipQuantize/avx2:1/rows:8192/clip:96", "bytes_per_second") / 1e9;
  const double b_v = get("BM_ClipQuantize/avx2:1/rows:576/clip:92", "bytes_per_second") / 1e9;
  const double b_noclip = get("BM_ClipQuantize/avx2:1/rows:576/clip:0", "bytes_per_second") / 1e9;
  const double b_scalar = get("BM_ClipQuantize/avx2:0/rows:576/clip:96", "bytes_per_second") / 1e9;
  const double dq = get("BM_Dequantize/avx2:1/rows:576", "bytes_per_second") / 1e9;
  const double dq_scalar = get("BM_Dequantize/avx2:0/rows:576", "bytes_per_second") / 1e9;
  const double a_best = get(a576, "bytes_per_second", 1.0) / 1e9;
  const double b_best = get(b576, "bytes_per_second", 1.0) / 1e9;
  const double a_best_call = get(a576, "best_call_GB/s", 1.0);
  const double b_best_call = get(b576, "best_call_GB/s", 1.0);
  // The ceiling: the best FMA measurement of the run (table repetitions and interleaved
  // windows alike) at 64 FMA per byte of BF16 input.
  const double fma_best_window = Quantile(il.fma_gfma_s, 1.0);
  const double peak_all = std::max(peak, fma_best_window);
  const double ceiling = peak_all / 64.0;  // GB/s of BF16 input at 64 FMA per byte
  auto pct = [&](double v) { return ceiling > 0 ? 100.0 * v / ceiling : 0.0; };
  const double a_il = Quantile(il.a_gb_s, 0.5);  // the headline
  std::vector<double> paired;                    // per pair: (a) / (that pair's FMA window / 64)
  for (size_t i = 0; i < il.a_gb_s.size(); ++i) {
    paired.push_back(il.fma_gfma_s[i] > 0 ? il.a_gb_s[i] / (il.fma_gfma_s[i] / 64.0) : 0.0);
  }
  std::printf(
      "\nsummary (one core, d=128, BF16 input; thread CPU time; table figures are the median of "
      "5 repetitions unless noted):\n");
  std::printf(
      "  FMA peak: best of the run            %8.2f GFMA/s -> rotate ceiling %.3f GB/s (table best "
      "repetition %.2f, best of %zu interleaved windows %.2f; window median %.2f, p10 %.2f)\n",
      peak_all, ceiling, peak, il.fma_gfma_s.size(), fma_best_window, Quantile(il.fma_gfma_s, 0.5),
      Quantile(il.fma_gfma_s, 0.1));
  std::printf(
      "  (a) HEADLINE, interleaved: median of %zu windows of %.0f ms  %.3f GB/s = %.1f%% of the "
      "FMA ceiling; spread p10 %.1f%%, p25 %.1f%%, p75 %.1f%%, p90 %.1f%% (min %.1f%%, max "
      "%.1f%%); paired with each window's own FMA rate: median %.1f%%\n",
      il.a_gb_s.size(), window_ms, a_il, pct(a_il), pct(Quantile(il.a_gb_s, 0.1)),
      pct(Quantile(il.a_gb_s, 0.25)), pct(Quantile(il.a_gb_s, 0.75)), pct(Quantile(il.a_gb_s, 0.9)),
      pct(Quantile(il.a_gb_s, 0.0)), pct(Quantile(il.a_gb_s, 1.0)), 100.0 * Quantile(paired, 0.5));
  std::printf(
      "  (a) rotate+clip+quantize, avx2 table %8.3f GB/s = %.1f%% of the FMA ceiling "
      "(%.2f GFMA/s); scalar %.4f GB/s (avx2/scalar %.1fx)\n",
      a_gbs, pct(a_gbs), a_fma, a_scalar, a_scalar > 0 ? a_gbs / a_scalar : 0.0);
  std::printf(
      "  (b) clip+quantize (rotated), avx2    %8.3f GB/s (target >= 2) K clip 0.96; V clip 0.92 "
      "%.3f; no clip %.3f; scalar %.3f GB/s (avx2/scalar %.1fx)\n",
      b_gbs, b_v, b_noclip, b_scalar, b_scalar > 0 ? b_gbs / b_scalar : 0.0);
  std::printf(
      "  dequantize, avx2                     %8.3f GB/s; scalar %.3f (avx2/scalar %.1fx)\n", dq,
      dq_scalar, dq_scalar > 0 ? dq / dq_scalar : 0.0);
  std::printf("  2 MiB inputs (beyond L2): (a) %.3f GB/s, (b) %.3f GB/s\n", a_big, b_big);
  std::printf(
      "  best repetition: (a) %.3f GB/s = %.1f%%, (b) %.3f GB/s; fastest single call: (a) %.3f "
      "GB/s = %.1f%%, (b) %.3f GB/s\n",
      a_best, pct(a_best), b_best, a_best_call, pct(a_best_call), b_best_call);

  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  nlohmann::json j;
  j["benchmark"] = "quantize_bench";
  j["git_sha"] = kvpool::kGitSha;
  j["version"] = kvpool::kVersion;
  j["host"] = host;
  j["cpu"] = CpuModel();
  j["threads"] = 1;
  j["config"] = {{"head_dim", kD},
                 {"rows", "576 (cache-resident) and 8192"},
                 {"clip_ratio", 0.96},
                 {"rotation", "dense fitted 128x128"}};
  j["fma_peak_gfma_s"] = peak_all;
  j["fma_peak_table_best_repetition_gfma_s"] = peak;
  j["a_gfma_s"] = a_fma;
  j["timing"] =
      "CPU time of the benchmark thread. Headline: a_interleaved (median of the (a) windows "
      "alternating with FMA windows) over rotate_ceiling_gb_s = fma_peak_gfma_s / 64, "
      "fma_peak_gfma_s being the best FMA measurement of the run (table repetitions and "
      "windows). Table figures (*_gb_s): medians of 5 repetitions of ~0.5 s, *_best_* the "
      "fastest repetition / single call";
  j["rotate_ceiling_gb_s"] = ceiling;
  j["a_interleaved"] = {{"pairs", il.a_gb_s.size()},
                        {"window_ms", window_ms},
                        {"rows", 576},
                        {"a_gb_s", Spread(il.a_gb_s)},
                        {"fma_gfma_s", Spread(il.fma_gfma_s)},
                        {"a_fraction_paired_with_window_fma", Spread(paired)},
                        {"a_windows_gb_s", il.a_gb_s},
                        {"fma_windows_gfma_s", il.fma_gfma_s}};
  j["a_fraction_of_fma_ceiling"] = ceiling > 0 ? a_il / ceiling : 0.0;  // the headline
  j["a_table_fraction_of_fma_ceiling"] = ceiling > 0 ? a_gbs / ceiling : 0.0;
  j["a_rotate_clip_quantize_gb_s"] = a_gbs;
  j["a_scalar_gb_s"] = a_scalar;
  j["b_clip_quantize_gb_s"] = b_gbs;
  j["b_clip_v_0_92_gb_s"] = b_v;
  j["b_no_clip_gb_s"] = b_noclip;
  j["dequantize_gb_s"] = dq;
  j["dequantize_scalar_gb_s"] = dq_scalar;
  j["a_best_repetition_gb_s"] = a_best;
  j["b_best_repetition_gb_s"] = b_best;
  j["b_scalar_gb_s"] = b_scalar;
  j["a_2mib_gb_s"] = a_big;
  j["a_best_call_gb_s"] = a_best_call;
  j["b_best_call_gb_s"] = b_best_call;
  j["b_2mib_gb_s"] = b_big;
  nlohmann::json runs = nlohmann::json::object();
  for (const auto& [k, v] : rep.reps) runs[k] = v;
  j["runs"] = runs;
  // Atomic, and through a symbolic link (kvpool/common/cli.h).
  if (auto s = kvpool::cli::WriteOutputFile(json_out, j.dump(2) + "\n"); !s.ok()) {
    std::fprintf(stderr, "quantize_bench: --json-out: %s\n", std::string(s.message()).c_str());
    return kvpool::cli::kExitRuntime;
  }
  std::printf("wrote %s\n", json_out.c_str());
  return kvpool::cli::kExitOk;
}
