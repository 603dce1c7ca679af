// cuda_write_bench — H200 benchmark of the kvpool CUDA write kernels (issue 3, PERF.md rules):
// quantize-only (already-rotated bf16 rows -> INT2 pages), fused rotate+quantize, rotate-only
// BF16 write, and demotion (BF16 pages -> INT2 pages), against their memory floor (bytes the
// kernel must read + write, at the 4.6 TB/s PERF.md roofline) and against a plain
// device-to-device cudaMemcpyAsync timed in the same run (the bandwidth a copy achieves).
//
// Method: per token count, fresh random inputs (device-side fill, seed from --seed, default
// random), shuffled destination pages; every timed run is preceded (untimed) by poisoning its
// output (0xff bytes: scale16 = 0xffff and bf16 0xffff are NaN, which the kernels never write)
// and a 256 MiB memset that flushes L2; CUDA events around the launch; --warmup runs first;
// the median (and min) of --iters runs. After timing, the outputs are checked: no poisoned
// params / bf16 element may remain and no row may be flagged (exit 2 otherwise).
//
// Standard output: the table; --json FILE: every number with config, git SHA, device, clocks.
// Exit codes 0 ok, 1 usage, 2 runtime (CUDA error, unwritten output).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda_bench_util.h"
#include "kvpool/common/cli.h"
#include "kvpool/common/log.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kernels/cuda/fill.h"
#include "kvpool/kernels/cuda/kv_write.h"

namespace {

using kvpool::BlockGeometry;
namespace kc = kvpool::cuda;
using json = nlohmann::json;
using namespace kvpool::bench;  // Check, Buf, UploadVec, Timer, RandomOrthogonal

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cuda_write_bench — INT2 quantize / rotate / demote write kernels on the GPU"};
  kvpool::cli::Setup(app, "cuda_write_bench");
  std::vector<int> token_counts{8192, 32768, 131072};
  int heads = 8, head_dim = 128, page = 16, iters = 30, warmup = 5;
  float clip_k = 0.96f, clip_v = 0.92f;
  uint64_t seed = 0;
  std::string json_out;
  // Every integer flag has a kvpool::cli::Range: CLI11 alone read "0100" as octal 64 and
  // std::stoi took "+16" and " 16" (newcomer 16 F2). The later check names the supported shapes.
  app.add_option("--tokens", token_counts, "comma-separated token counts per launch")
      ->delimiter(',')
      ->check(kvpool::cli::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--kv-heads", heads, "KV heads (32 q / 8 KV: 8)")
      ->check(kvpool::cli::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--head-dim", head_dim, "head dim (64, 128, 256)")
      ->check(kvpool::cli::Range(64, 256))
      ->capture_default_str();
  app.add_option("--page-size", page, "tokens per page (16, 64)")
      ->check(kvpool::cli::Range(16, 64))
      ->capture_default_str();
  app.add_option("--iters", iters, "timed runs per kernel (median reported)")
      ->check(kvpool::cli::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--warmup", warmup, "untimed runs first")
      ->check(kvpool::cli::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--clip-k", clip_k, "K clip ratio (FORMAT.md §2.2)")
      ->check(kvpool::cli::Range(0.0f, 1.0f))
      ->capture_default_str();
  app.add_option("--clip-v", clip_v, "V clip ratio")
      ->check(kvpool::cli::Range(0.0f, 1.0f))
      ->capture_default_str();
  app.add_option("--seed", seed, "input seed (0: random)")
      ->check(kvpool::cli::Range(uint64_t{0}, UINT64_MAX))
      ->capture_default_str();
  app.add_option("--json", json_out, "write all results as JSON here");
  KVPOOL_CLI_PARSE(app, argc, argv);
  if (heads < 1 || (head_dim != 64 && head_dim != 128 && head_dim != 256) ||
      (page != 16 && page != 64) || iters < 1 || warmup < 0) {
    std::fprintf(stderr,
                 "cuda_write_bench: --kv-heads >= 1, --head-dim 64/128/256, --page-size 16/64, "
                 "--iters >= 1, --warmup >= 0\n");
    return kvpool::cli::kExitUsage;
  }
  if (iters < 20) KVPOOL_LOG_WARN("--iters {} < 20: PERF.md asks for the median of >= 20", iters);
  if (seed == 0) seed = std::random_device{}() | 1ull;

  json doc;
  try {
    const BlockGeometry geo{1, uint32_t(heads), uint32_t(head_dim), uint32_t(page)};
    doc["config"] = {{"iters", iters},
                     {"warmup", warmup},
                     {"kv_heads", heads},
                     {"head_dim", head_dim},
                     {"page_size", page},
                     {"clip_k", clip_k},
                     {"clip_v", clip_v},
                     {"seed", seed},
                     {"roofline_gbs", kRooflineGBs},
                     {"l2_flush_bytes", kL2FlushBytes}};
    DescribeDevice(&doc);
    cudaStream_t stream;
    Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    Timer timer(stream, iters, warmup);
    const int d = head_dim, ng = int(geo.GroupsPerRow());
    auto rot = UploadVec(RandomOrthogonal(d, seed ^ 0x5eedull));
    json rows = json::array();
    std::printf("%-18s %8s %9s %9s %9s %9s %9s %8s %8s\n", "kernel", "tokens", "tok-heads",
                "med_ms", "min_ms", "MB", "GB/s", "%floor", "%copy");
    for (int n : token_counts) {
      const size_t npages = size_t((n + page - 1) / page);
      const double th = double(n) * heads;
      const size_t in_bytes = size_t(n) * heads * d * 2;  // one of K or V
      Buf k(in_bytes), v(in_bytes), i2(npages * geo.Int2LayerBytes()),
          bfp(npages * geo.Bf16LayerBytes()), copy_dst(2 * in_bytes), bad(16);
      const uint64_t s = seed + uint64_t(n) * 7919;
      Check(kc::LaunchFillRandomBf16(k.as<uint16_t>(), k.n / 2, s + 1, stream), "fill");
      Check(kc::LaunchFillRandomBf16(v.as<uint16_t>(), v.n / 2, s + 2, stream), "fill");
      std::vector<int32_t> ids(npages), pg(n), sl(n);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), std::mt19937_64(s + 3));
      for (int t = 0; t < n; ++t) {
        pg[t] = ids[t / page];
        sl[t] = t % page;
      }
      auto d_pg = UploadVec(pg), d_sl = UploadVec(sl), d_ids = UploadVec(ids);
      Check(cudaMemsetAsync(bad.p, 0, bad.n, stream), "memset");

      kc::KvWriteParams wp;
      wp.num_tokens = n;
      wp.num_kv_heads = heads;
      wp.head_dim = d;
      wp.page_size = page;
      wp.k = k.as<uint16_t>();
      wp.v = v.as<uint16_t>();
      wp.dst_page = d_pg->as<int32_t>();
      wp.dst_slot = d_sl->as<int32_t>();
      wp.clip_ratio_k = clip_k;
      wp.clip_ratio_v = clip_v;
      wp.bad_rows = bad.as<uint32_t>();

      double copy_gbs = 0;
      auto emit = [&](const char* name, const Stats& st, double bytes) {
        const double floor_ms = bytes / (kRooflineGBs * 1e9) * 1e3;
        const double gbs = bytes / (st.median_ms * 1e-3) / 1e9;
        if (copy_gbs == 0) copy_gbs = gbs;  // the first row is the copy baseline
        std::printf("%-18s %8d %9.0f %9.4f %9.4f %9.1f %9.1f %7.1f%% %7.1f%%\n", name, n, th,
                    st.median_ms, st.min_ms, bytes / 1e6, gbs, 100 * floor_ms / st.median_ms,
                    100 * gbs / copy_gbs);
        std::fflush(stdout);
        rows.push_back({{"kernel", name},
                        {"tokens", n},
                        {"kv_heads", heads},
                        {"token_heads", th},
                        {"head_dim", d},
                        {"ms", st.median_ms},
                        {"min_ms", st.min_ms},
                        {"bytes", bytes},
                        {"gbs", gbs},
                        {"floor_ms", floor_ms},
                        {"pct_floor", 100 * floor_ms / st.median_ms},
                        {"pct_copy", 100 * gbs / copy_gbs}});
      };
      auto poison_i2 = [&] { Check(cudaMemsetAsync(i2.p, 0xff, i2.n, stream), "poison"); };
      auto poison_bf = [&] { Check(cudaMemsetAsync(bfp.p, 0xff, bfp.n, stream), "poison"); };
      // Every (page, head, K/V, slot) param word must have been written (scale16 != 0xffff).
      auto check_i2 = [&](const char* what) {
        Check(cudaStreamSynchronize(stream), "sync");
        std::vector<uint8_t> h(i2.n);
        Check(cudaMemcpy(h.data(), i2.p, i2.n, cudaMemcpyDeviceToHost), "download");
        uint64_t unwritten = 0;
        for (size_t p = 0; p < npages; ++p)
          for (int hd = 0; hd < heads; ++hd) {
            const uint8_t* chunk = h.data() + p * geo.Int2LayerBytes() + geo.Int2ChunkOffset(0, hd);
            for (int kvi = 0; kvi < 2; ++kvi) {
              const uint8_t* par =
                  chunk + (kvi ? geo.Int2VParamsOffset() : geo.Int2KParamsOffset());
              for (int w = 0; w < page * ng; ++w) {
                uint16_t sc;
                std::memcpy(&sc, par + 4 * w, 2);
                unwritten += sc == 0xffff;
              }
            }
          }
        uint32_t nbad = 0;
        Check(cudaMemcpy(&nbad, bad.p, 4, cudaMemcpyDeviceToHost), "download");
        if (unwritten || nbad)
          throw CudaError(std::string(what) + ": " + std::to_string(unwritten) +
                          " param words unwritten, " + std::to_string(nbad) + " rows flagged");
      };
      auto check_bf = [&](const char* what) {
        Check(cudaStreamSynchronize(stream), "sync");
        std::vector<uint16_t> h(bfp.n / 2);
        Check(cudaMemcpy(h.data(), bfp.p, bfp.n, cudaMemcpyDeviceToHost), "download");
        const auto left = std::count(h.begin(), h.end(), uint16_t(0xffff));
        if (left) throw CudaError(std::string(what) + ": " + std::to_string(left) + " unwritten");
      };
      const double q_bytes = th * (4.0 * d + d / 2 + 8.0 * ng);
      auto none = [] {};

      emit("memcpy-d2d",
           timer.Time(none,
                      [&] {
                        Check(cudaMemcpyAsync(copy_dst.p, k.p, in_bytes, cudaMemcpyDeviceToDevice,
                                              stream),
                              "copy");
                        Check(cudaMemcpyAsync(copy_dst.as<uint8_t>() + in_bytes, v.p, in_bytes,
                                              cudaMemcpyDeviceToDevice, stream),
                              "copy");
                      }),
           4.0 * in_bytes);

      wp.rotation_k = wp.rotation_v = nullptr;
      wp.dst = {i2.p, geo.Int2LayerBytes()};
      emit("quantize-only",
           timer.Time(poison_i2, [&] { Check(kc::LaunchQuantizeWrite(wp, stream), "quantize"); }),
           q_bytes);
      check_i2("quantize-only");

      wp.rotation_k = wp.rotation_v = rot->as<float>();
      emit("rotate+quantize",
           timer.Time(poison_i2, [&] { Check(kc::LaunchQuantizeWrite(wp, stream), "quantize"); }),
           q_bytes);
      check_i2("rotate+quantize");

      wp.dst = {bfp.p, geo.Bf16LayerBytes()};
      emit("rotate-bf16",
           timer.Time(poison_bf, [&] { Check(kc::LaunchRotateWriteBf16(wp, stream), "rotate"); }),
           th * 8.0 * d);
      check_bf("rotate-bf16");

      // Demotion reads the rotated BF16 pages just written.
      kc::DemoteParams dp;
      dp.num_blocks = int(npages);
      dp.num_kv_heads = heads;
      dp.head_dim = d;
      dp.page_size = page;
      dp.src_pages = d_ids->as<int32_t>();
      dp.dst_pages = d_ids->as<int32_t>();
      dp.src = {bfp.p, geo.Bf16LayerBytes()};
      dp.dst = {i2.p, geo.Int2LayerBytes()};
      dp.clip_ratio_k = clip_k;
      dp.clip_ratio_v = clip_v;
      dp.bad_rows = bad.as<uint32_t>();
      emit("demote", timer.Time(poison_i2, [&] { Check(kc::LaunchDemote(dp, stream), "demote"); }),
           double(npages) * page * heads * (4.0 * d + d / 2 + 8.0 * ng));
      check_i2("demote");
    }
    doc["results"] = rows;
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
