// cuda_decode_bench — H200 benchmarks of the kvpool CUDA kernels (issue 3, PERF.md rules).
//
//  * decode: INT2 mixed-precision paged decode (64 sink + 256 recent BF16 tokens, the rest
//    INT2) and our BF16 paged decode (every token BF16, same launcher) over the PERF.md grid;
//    time (CUDA events, warm-up, median of --iters, L2 flushed by a 256 MiB memset before every
//    timed run, outputs poisoned before every run and checked after), bytes the kernel must
//    read, GB/s, % of the 4.6 TB/s roofline, and speed-ups over our BF16 kernel and over
//    PyTorch SDPA measured by bench/cuda_sdpa_baseline.py in the same device run (--sdpa-json).
//    Batch 1 is also timed as a replayed CUDA graph.
//  The write kernels have their own benchmark, bench/cuda_write_bench.cc.
//
// Standard output: the human table; --json FILE: every number with config, git SHA, device,
// clocks. Exit codes 0 ok, 1 usage, 2 runtime (CUDA error, wrong output).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda_bench_util.h"
#include "kvpool/common/cli.h"
#include "kvpool/common/log.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/cuda/fill.h"
#include "kvpool/kernels/cuda/paged_decode.h"

// Defined only by instrumented builds of paged_decode.cu (KVPOOL_DECODE_TIMELINE): writes the
// per-CTA timestamps of the last launch to $KVPOOL_DECODE_TIMELINE.
extern "C" __attribute__((weak)) void KvpoolDecodeTimelineDump(const char* tag);

namespace {

using kvpool::BlockGeometry;
namespace kc = kvpool::cuda;
using json = nlohmann::json;
using namespace kvpool::bench;  // Check, Buf, UploadVec, Timer, Shuffled

struct Shape {
  int batch, ctx, hq, hkv, d, page;
};

// Segment layout of one request of `ctx` tokens (FORMAT.md §3, S = 64, W = 256).
struct Layout {
  int sink = 0, hist = 0, recent = 0;  // tokens
};
Layout MakeLayout(int ctx, int page) {
  Layout l;
  l.sink = std::min(ctx, 64);
  const int rest = ctx - l.sink;
  if (rest <= 256) {
    l.recent = rest;
    return l;
  }
  l.hist = ((rest - 256) / page) * page;
  l.recent = rest - l.hist;
  return l;
}

struct Table {
  std::vector<int32_t> indptr{0}, indices, last;
  int32_t max_pages = 0;
  std::unique_ptr<Buf> d_indptr, d_indices, d_last;
  void Add(int tokens, int page, std::vector<int32_t>& pool_ids, size_t& next) {
    const int np = (tokens + page - 1) / page;
    for (int i = 0; i < np; ++i) indices.push_back(pool_ids[next++]);
    indptr.push_back(indptr.back() + np);
    last.push_back(np ? tokens - (np - 1) * page : 0);
    max_pages = std::max(max_pages, np);
  }
  kc::SegmentTable Upload() {
    d_indptr = UploadVec(indptr);
    d_indices = UploadVec(indices);
    d_last = UploadVec(last);
    kc::SegmentTable t;
    t.indptr = d_indptr->as<int32_t>();
    t.indices = d_indices->as<int32_t>();
    t.last_page_len = d_last->as<int32_t>();
    t.max_pages = max_pages;
    return t;
  }
};

struct DecodeRun {
  double ms = 0, graph_ms = -1;
  double bytes = 0;
  int64_t bad_outputs = 0;
};

// Builds the pools for `s` (mixed INT2 when int2 = true, else every token BF16), runs the
// decode, returns timing.
DecodeRun RunDecode(const Shape& s, bool int2, Timer& timer, bool graph, uint64_t seed,
                    bool contiguous) {
  const BlockGeometry geo{1, uint32_t(s.hkv), uint32_t(s.d), uint32_t(s.page)};
  const Layout lay = int2 ? MakeLayout(s.ctx, s.page) : Layout{s.ctx, 0, 0};
  auto pages = [&](int tok) { return size_t((tok + s.page - 1) / s.page); };
  const size_t bf_pages = size_t(s.batch) * (pages(lay.sink) + pages(lay.recent));
  const size_t i2_pages = size_t(s.batch) * pages(lay.hist);
  Buf bf(std::max<size_t>(bf_pages, 1) * geo.Bf16LayerBytes());
  Buf i2(std::max<size_t>(i2_pages, 1) * geo.Int2LayerBytes());
  cudaStream_t st = timer.stream;
  Check(kc::LaunchFillRandomBf16(bf.as<uint16_t>(), bf.n / 2, seed, st), "fill bf16");
  if (i2_pages)
    Check(kc::LaunchFillRandomInt2Pages(i2.p, i2_pages, geo.Int2LayerBytes(), s.hkv, s.d, s.page,
                                        seed + 1, st),
          "fill int2");
  std::vector<int32_t> bf_ids = Shuffled(bf_pages, seed + 2), i2_ids = Shuffled(i2_pages, seed + 3);
  if (contiguous) {  // pages of a request adjacent in the pool (upper bound of page locality)
    std::iota(bf_ids.begin(), bf_ids.end(), 0);
    std::iota(i2_ids.begin(), i2_ids.end(), 0);
  }
  size_t nb = 0, ni = 0;
  Table sink, hist, rec;
  for (int b = 0; b < s.batch; ++b) {
    sink.Add(lay.sink, s.page, bf_ids, nb);
    hist.Add(lay.hist, s.page, i2_ids, ni);
    rec.Add(lay.recent, s.page, bf_ids, nb);
  }
  Buf q(size_t(s.batch) * s.hq * s.d * 2), out(size_t(s.batch) * s.hq * s.d * 2),
      lse(size_t(s.batch) * s.hq * 4);
  Check(kc::LaunchFillRandomBf16(q.as<uint16_t>(), q.n / 2, seed + 4, st), "fill q");
  // A real random orthogonal rotation (Gram-Schmidt), as in production.
  std::mt19937_64 rng(seed + 5);
  std::normal_distribution<double> nd;
  std::vector<float> rot(size_t(s.d) * s.d);
  {
    std::vector<double> m(size_t(s.d) * s.d);
    for (auto& x : m) x = nd(rng);
    for (int c = 0; c < s.d; ++c) {  // Gram-Schmidt on rows
      double* r = &m[size_t(c) * s.d];
      for (int p = 0; p < c; ++p) {
        const double* pr = &m[size_t(p) * s.d];
        double dot = 0;
        for (int i = 0; i < s.d; ++i) dot += pr[i] * r[i];
        for (int i = 0; i < s.d; ++i) r[i] -= dot * pr[i];
      }
      double n2 = 0;
      for (int i = 0; i < s.d; ++i) n2 += r[i] * r[i];
      for (int i = 0; i < s.d; ++i) r[i] /= std::sqrt(n2);
    }
    for (size_t i = 0; i < m.size(); ++i) rot[i] = float(m[i]);
  }
  auto d_rot = UploadVec(rot);
  kc::PagedDecodeParams p;
  p.batch = s.batch;
  p.num_q_heads = s.hq;
  p.num_kv_heads = s.hkv;
  p.head_dim = s.d;
  p.page_size = s.page;
  p.sm_scale = float(1.0 / std::sqrt(double(s.d)));
  p.q = q.as<uint16_t>();
  p.rotation_k = d_rot->as<float>();
  p.rotation_v = d_rot->as<float>();
  p.bf16_pool = {bf.p, geo.Bf16LayerBytes()};
  p.int2_pool = {i2.p, geo.Int2LayerBytes()};
  p.sink = sink.Upload();
  p.history = hist.Upload();
  p.recent = rec.Upload();
  p.out = out.as<uint16_t>();
  p.lse = lse.as<float>();
  size_t ws = 0;
  Check(kc::PagedDecodeWorkspaceBytes(p, &ws), "workspace size");
  Buf wsb(std::max<size_t>(ws, 256));
  p.workspace = wsb.p;
  p.workspace_bytes = wsb.n;
  Check(cudaStreamSynchronize(st), "setup");

  DecodeRun r;
  r.bytes = double(s.batch) * s.hkv *
            (double(lay.sink + lay.recent) * 4.0 * s.d +
             double(lay.hist) * (s.d / 2 + 8 * geo.GroupsPerRow()));
  auto poison = [&] { Check(cudaMemsetAsync(out.p, 0xff, out.n, st), "poison"); };
  auto launch = [&] { Check(kc::LaunchPagedDecode(p, st), "LaunchPagedDecode"); };
  r.ms = timer.Median(poison, launch);
  // Builds of the launcher instrumented with per-CTA timestamps (-DKVPOOL_DECODE_TIMELINE)
  // define this hook; it writes the last timed launch's stamps (docs/KERNELS.md, device profile).
  if (KvpoolDecodeTimelineDump != nullptr) {
    const std::string tag = std::string(int2 ? "int2" : "bf16") + " B=" + std::to_string(s.batch) +
                            " ctx=" + std::to_string(s.ctx) + " " + std::to_string(s.hq) + "/" +
                            std::to_string(s.hkv) + " page=" + std::to_string(s.page) +
                            " ms=" + std::to_string(r.ms);
    KvpoolDecodeTimelineDump(tag.c_str());
  }
  std::vector<uint16_t> host(out.n / 2);
  Check(cudaMemcpy(host.data(), out.p, out.n, cudaMemcpyDeviceToHost), "download");
  for (uint16_t v : host) r.bad_outputs += ((v & 0x7f80) == 0x7f80);  // poison / NaN / inf
  if (graph) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    Check(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
    launch();
    Check(cudaStreamEndCapture(st, &g), "end capture");
    Check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
    r.graph_ms = timer.Median(poison, [&] { Check(cudaGraphLaunch(ge, st), "graph launch"); });
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
  }
  return r;
}

std::vector<std::string> Split(const std::string& s, char c) {
  std::vector<std::string> out;
  size_t b = 0;
  while (true) {
    const size_t e = s.find(c, b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cuda_decode_bench — INT2 mixed vs BF16 paged decode on the GPU"};
  kvpool::cli::Setup(app, "cuda_decode_bench");
  std::vector<int> batches{1, 8, 32, 128};
  std::vector<int> contexts{1024, 4096, 32768, 100000, 131072};
  std::vector<std::string> gqa{"32:8", "64:8", "32:4"};
  std::vector<int> page_sizes{16, 64};
  int head_dim = 128, iters = 30, warmup = 5;
  double max_gb = 110.0;
  std::string json_out, sdpa_json;
  bool contiguous = false, skip_bf16 = false;
  // Every integer flag has a kvpool::cli::Range: CLI11 alone read "0100" as octal 64 (newcomer
  // 16 F2); the kernels refuse a shape they do not support when the point runs.
  app.add_option("--batches", batches, "batch sizes")
      ->delimiter(',')
      ->check(kvpool::cli::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--contexts", contexts, "context lengths (tokens)")
      ->delimiter(',')
      ->check(kvpool::cli::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--gqa", gqa, "q_heads:kv_heads pairs")->delimiter(',')->capture_default_str();
  app.add_option("--page-sizes", page_sizes, "page sizes")
      ->delimiter(',')
      ->check(kvpool::cli::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--head-dim", head_dim, "head_dim")
      ->check(kvpool::cli::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--iters", iters, "timed runs per point (median)")
      ->check(kvpool::cli::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--warmup", warmup, "untimed runs first")
      ->check(kvpool::cli::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--max-gb", max_gb, "skip shapes whose BF16 pool exceeds this (GB)")
      ->check(kvpool::cli::Range(0.0, 1e6))
      ->capture_default_str();
  app.add_option("--json", json_out, "write all results as JSON here");
  app.add_option("--sdpa-json", sdpa_json,
                 "PyTorch SDPA results of the same run (cuda_sdpa_baseline.py)");
  app.add_flag("--contiguous-pages", contiguous,
               "allocate each request's pages adjacently (default: shuffled page ids)");
  app.add_flag("--skip-bf16", skip_bf16,
               "time only the INT2 mixed launch (A/B runs of several builds); x_bf16 is then -1");
  KVPOOL_CLI_PARSE(app, argc, argv);
  if (iters < 20) KVPOOL_LOG_WARN("--iters {} < 20: PERF.md asks for the median of >= 20", iters);

  json doc;
  try {
    doc["config"] = {{"iters", iters},
                     {"warmup", warmup},
                     {"head_dim", head_dim},
                     {"roofline_gbs", kRooflineGBs},
                     {"l2_flush_bytes", kL2FlushBytes}};
    DescribeDevice(&doc);
    std::map<std::tuple<int, int, int, int, int>, double> sdpa;
    if (!sdpa_json.empty()) {
      std::ifstream f(sdpa_json);
      if (f) {
        json sj = json::parse(f, nullptr, false);
        if (!sj.is_discarded() && sj.contains("results")) {
          for (auto& r : sj["results"])
            if (r.contains("ms") && !r["ms"].is_null())
              sdpa[{r["batch"].get<int>(), r["context"].get<int>(), r["hq"].get<int>(),
                    r["hkv"].get<int>(), r["d"].get<int>()}] = r["ms"].get<double>();
          doc["sdpa_source"] = sj.value("torch", "");
        }
      } else {
        KVPOOL_LOG_WARN("cannot read {}", sdpa_json);
      }
    }
    cudaStream_t stream;
    Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    Timer timer(stream, iters, warmup);

    {
      std::printf("%-6s %4s %7s %6s %3s %9s %9s %7s %8s %8s %8s %9s\n", "kernel", "B", "ctx",
                  "heads", "P", "ms", "GB/s", "%roof", "x_bf16", "x_sdpa", "sdpa_ms", "graph_ms");
      json rows = json::array();
      uint64_t seed = 1;
      for (const std::string& gs : gqa) {
        const auto parts = Split(gs, ':');
        const int hq = std::stoi(parts.at(0)), hkv = std::stoi(parts.at(1));
        for (int page : page_sizes)
          for (int B : batches)
            for (int ctx : contexts) {
              const Shape s{B, ctx, hq, hkv, head_dim, page};
              const double bf16_gb =
                  double(B) * hkv * ((ctx + page - 1) / page) * page * 4.0 * head_dim / 1e9;
              json row = {{"batch", B}, {"context", ctx}, {"hq", hq},
                          {"hkv", hkv}, {"d", head_dim},  {"page", page}};
              if (bf16_gb > max_gb) {
                row["skipped"] = "bf16 pool " + std::to_string(bf16_gb) + " GB > --max-gb";
                rows.push_back(row);
                std::printf("skip B=%d ctx=%d %d/%d P=%d: BF16 pool %.1f GB\n", B, ctx, hq, hkv,
                            page, bf16_gb);
                continue;
              }
              const bool graph = B == 1;
              const DecodeRun mixed = RunDecode(s, true, timer, graph, seed++, contiguous);
              DecodeRun bf16;
              if (!skip_bf16) bf16 = RunDecode(s, false, timer, graph, seed++, contiguous);
              seed += skip_bf16 ? 1 : 0;  // the same data seeds with and without --skip-bf16
              if (mixed.bad_outputs || bf16.bad_outputs)
                throw CudaError("decode left " +
                                std::to_string(mixed.bad_outputs + bf16.bad_outputs) +
                                " unwritten or non-finite outputs");
              const auto it = sdpa.find({B, ctx, hq, hkv, head_dim});
              const double sd = it == sdpa.end() ? -1 : it->second;
              auto emit = [&](const char* name, const DecodeRun& r) {
                const double gbs = r.bytes / (r.ms * 1e-3) / 1e9;
                std::printf(
                    "%-6s %4d %7d %3d/%-2d %3d %9.4f %9.1f %6.1f%% %8.2f %8.2f %8.4f %9.4f\n", name,
                    B, ctx, hq, hkv, page, r.ms, gbs, 100 * gbs / kRooflineGBs,
                    skip_bf16 ? -1.0 : bf16.ms / r.ms, sd > 0 ? sd / r.ms : -1.0, sd, r.graph_ms);
                return json{{"ms", r.ms},
                            {"bytes", r.bytes},
                            {"gbs", gbs},
                            {"pct_roofline", 100 * gbs / kRooflineGBs},
                            {"graph_ms", r.graph_ms},
                            {"speedup_vs_bf16", skip_bf16 ? -1.0 : bf16.ms / r.ms},
                            {"speedup_vs_sdpa", sd > 0 ? sd / r.ms : -1.0}};
              };
              row["int2_mixed"] = emit("int2", mixed);
              if (!skip_bf16) row["bf16"] = emit("bf16", bf16);
              row["sdpa_ms"] = sd;
              rows.push_back(row);
              std::fflush(stdout);
            }
      }
      doc["decode"] = rows;
    }

    Check(cudaStreamDestroy(stream), "stream");
  } catch (const std::exception& e) {
    KVPOOL_LOG_ERROR("{}", e.what());
    doc["error"] = e.what();
    WriteJson(json_out, doc);
    return kvpool::cli::kExitRuntime;
  }
  WriteJson(json_out, doc);
  return kvpool::cli::kExitOk;
}
