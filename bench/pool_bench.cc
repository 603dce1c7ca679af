// pool_bench — data-plane and control-plane numbers of a running kvpool-server, through the
// C++ client (the path engines use). Per transfer size S = 16 KiB … 4 MiB (one block of S bytes
// per put and per fetch), each iteration puts a new sequence, leases it and fetches it:
//   * put data phase: first WriteLayer → Flush returned (the bytes are in the pool's staging;
//     packing, hashing and the transfers; no control RPC except, when the pool initiates
//     transfers, the WritePut calls that make it pull). Comparable to ucx_perftest, which
//     times only transfers. With --async-put (default) every iteration also puts a second
//     sequence with WriteLayerAsync (the layers packed by the copy threads in the background,
//     joined by Flush): "put async", first WriteLayerAsync → Flush returned; the two puts of an
//     iteration alternate in order.
//   * put end to end: BeginPut → Flush (adds the BeginPut RPC), and + CommitPut (the whole
//     two-phase put, including the pool's commit of one block).
//   * fetch data phase: Fetch() of the leased block, verified (form checksum: chunked xxh3,
//     docs/BLOCK_FORMAT.md "Checksums") — the first read of the block after its commit; then
//     the same block again verified ("warm") and unverified (FetchPlan::verify_checksums =
//     false), in alternating order across iterations.
//   * fetch end to end: Acquire + the first Fetch + Release.
//   * raw get: the same bytes with one bare RMA get through the transport (when the client may
//     initiate transfers): the data plane without the client; into the fetch page, or into a
//     buffer of its own (--raw-get-into own).
//   * in flight (--inflight-clients D, default 0 = none; after every size's one-at-a-time
//     part, or alone with --only-inflight, as bench/pool_bench.py runs it): D clients in this
//     process, one thread each (--inflight-copy-threads 1), put and then fetch fresh sequences
//     of every size at the same time, D operations in flight as ucx_perftest's ucp_put_bw keeps
//     many: aggregate GB/s of the put data phases (WriteLayer → Flush) and of the first
//     fetches, each operation's p50/p99, and the process CPU per MiB moved. An additional
//     measurement: the columns above stay one operation at a time;
//   * commit: CommitPut of many INT2 blocks (rotate + quantize on the pool), reported apart;
//   * lookup: p50/p99 of Lookup with N concurrent clients (all set up and warmed before timing;
//     the wall time and the rate count the timed lookups only).
// Block sizes are set by the model geometry (d = 128, P = 16: 8 KiB per layer·head), with
// history precision bf16 so a block has exactly one S-byte form. Prints a table on stdout and
// writes JSON (--json). bench/pool_bench.py runs it next to ucx_perftest on the same transport.
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <latch>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvpool/client/client.h"
#include "kvpool/common/checksum.h"
#include "kvpool/common/cli.h"
#include "kvpool/common/log.h"
#include "kvpool/common/status_text.h"
#include "kvpool/common/version.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/kernels/rotation_file.h"

namespace {

using kvpool::client::Client;
using kvpool::client::ClientOptions;
using kvpool::client::ModelSpec;

struct Stats {
  double p50_us = 0, p99_us = 0, mean_us = 0;
};

Stats Summarize(std::vector<double> us) {
  Stats s;
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  auto pct = [&](double p) {
    size_t i = static_cast<size_t>(p * (us.size() - 1) + 0.5);
    return us[std::min(i, us.size() - 1)];
  };
  s.p50_us = pct(0.50);
  s.p99_us = pct(0.99);
  double sum = 0;
  for (double x : us) sum += x;
  s.mean_us = sum / us.size();
  return s;
}

std::string RotationFile(const std::string& model, uint32_t L, uint32_t H, uint32_t d) {
  kvpool::RotationMetadata meta;
  meta.model_name = model;
  meta.head_dim = d;
  meta.num_layers = L;
  meta.num_kv_heads = H;
  auto rot = kvpool::RotationSet::Hadamard(meta);
  if (!rot.ok()) {
    KVPOOL_LOG_ERROR("rotation: {}", kvpool::StatusText(rot.status()));
    std::exit(kvpool::cli::kExitRuntime);
  }
  return kvpool::SerializeRotations(*rot);
}

ModelSpec Spec(const std::string& id, uint32_t L, uint32_t H, const std::string& precision,
               uint32_t sink, uint32_t recent) {
  ModelSpec s;
  s.model_id = id;
  s.revision = "bench";
  s.num_layers = L;
  s.num_kv_heads = H;
  s.head_dim = 128;
  s.page_size = 16;
  s.sink_tokens = sink;
  s.recent_tokens = recent;
  s.history_precision = precision;
  s.rotation_file = RotationFile(id, L, H, 128);
  return s;
}

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// The measuring client's copy-thread settings (defaults: the client's own).
struct CopySettings {
  int copy_threads = 0;
  uint64_t put_min_kib = ClientOptions{}.parallel_put_min_bytes >> 10;
  uint64_t async_put_min_kib = ClientOptions{}.parallel_async_put_min_bytes >> 10;
  uint64_t fetch_min_kib = ClientOptions{}.parallel_fetch_min_bytes >> 10;
  uint64_t fetch_awake_min_kib = ClientOptions{}.parallel_fetch_awake_min_bytes >> 10;
  int64_t prewake_us = absl::ToInt64Microseconds(ClientOptions{}.copy_threads_prewake);
};

std::unique_ptr<Client> NewClient(const std::string& server, const std::string& tls,
                                  bool map_shared_memory = true, const CopySettings& cs = {}) {
  ClientOptions o;
  o.copy_threads = cs.copy_threads;
  o.parallel_put_min_bytes = cs.put_min_kib << 10;
  o.parallel_async_put_min_bytes = cs.async_put_min_kib << 10;
  o.parallel_fetch_min_bytes = cs.fetch_min_kib << 10;
  o.parallel_fetch_awake_min_bytes = cs.fetch_awake_min_kib << 10;
  o.copy_threads_prewake = absl::Microseconds(cs.prewake_us);
  o.server = server;
  o.ucx_tls = tls;
  o.map_shared_memory = map_shared_memory;
  o.default_timeout = absl::Seconds(60);
  auto c = Client::Create(o);
  if (!c.ok()) {
    KVPOOL_LOG_ERROR("client: {}", kvpool::StatusText(c.status()));
    std::exit(kvpool::cli::kExitRuntime);
  }
  return *std::move(c);
}

// Minor page faults taken by the calling thread so far (getrusage RUSAGE_THREAD).
long ThreadMinorFaults() {
  rusage ru{};
  getrusage(RUSAGE_THREAD, &ru);
  return ru.ru_minflt;
}

// CPU time (user + system) of this whole process so far, in microseconds: the calling thread,
// the client's copy threads (spinning or working) and gRPC's threads.
double ProcessCpuUs() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 + ru.ru_utime.tv_usec +
         ru.ru_stime.tv_usec;
}

// A barrier whose waiters spin (then yield), so that the threads of an in-flight window start
// within a microsecond or so of each other instead of a futex wake-up apart. Reusable.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void Wait() {
    const uint32_t gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int k = 0; gen_.load(std::memory_order_acquire) == gen; ++k) {
      if (k >= 4096) std::this_thread::yield();
    }
  }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<uint32_t> gen_{0};
};

// The pool's address (--server), for BenchFail's message.
std::string g_pool_address;

// Statuses print as kvpool::StatusText (code and message, no payload: a room refusal's binary
// one printed as escaped bytes with ToString(); newcomer report 13 F7), after what failed in
// words: "E info.status(): UNAVAILABLE: ..." named a source expression (newcomer 16 F10). A
// pool that cannot be reached is said so, with its address.
[[noreturn]] void BenchFail(const std::string& what, const absl::Status& s) {
  if (s.code() == absl::StatusCode::kUnavailable) {
    KVPOOL_LOG_ERROR("cannot reach the pool at {} ({}): {}", g_pool_address, what,
                     kvpool::StatusText(s));
  } else {
    KVPOOL_LOG_ERROR("{} failed: {}", what, kvpool::StatusText(s));
  }
  std::exit(kvpool::cli::kExitRuntime);
}
#define BENCH_CHECK(what, expr)          \
  do {                                   \
    absl::Status s_ = (expr);            \
    if (!s_.ok()) BenchFail((what), s_); \
  } while (0)

// The in-flight section's result for one size.
struct Inflight {
  int clients = 0, copy_threads = 0, per_window = 0, rounds = 0;
  double put_gbps = 0, fetch_gbps = 0;  // window bytes / window time, over all windows
  double put_cpu_us_per_mib = 0, fetch_cpu_us_per_mib = 0;  // process CPU in the windows
  Stats put_op, fetch_op;  // each put's data phase / each first fetch
};

// D = clients.size() threads, thread i driving clients[i] (model `spec` registered on it): per
// round, every thread begins `per_window` puts of fresh sequences (BeginPut, untimed), all
// threads start together (SpinBarrier), each writes its puts' layers with WriteLayer and
// Flushes them one after the other (the put data window: D puts in flight at any time, fresh
// sequences; each thread reuses its own source values, as the one-at-a-time puts do), then all
// commit (untimed), acquire (untimed), start together again and fetch each block once,
// verified, into a page of their own (the fetch window), then release. A window's time runs from
// the first thread's start to the last thread's end; bandwidth = bytes of all windows / their time.
// CPU = the process's (all threads: callers, copy workers, gRPC) over the windows, per MiB moved.
Inflight RunInflight(const std::vector<std::unique_ptr<Client>>& clients, const ModelSpec& spec,
                     uint32_t L, uint32_t H, uint64_t bytes, int per_window, int rounds,
                     int copy_threads, std::mt19937& seed_rng) {
  const int D = static_cast<int>(clients.size());
  Inflight r;
  r.clients = D;
  r.copy_threads = copy_threads;
  r.per_window = per_window;
  r.rounds = rounds;
  // A failure names the section, the client and what the section needs of the pool (newcomer
  // 11b F7: "E put.status(): RESOURCE_EXHAUSTED: ..." said neither which section nor how much).
  const uint64_t staging_bytes = uint64_t(D) * uint64_t(per_window) * bytes;
  auto check = [&](const absl::Status& s, int client, const char* what) {
    if (s.ok()) return;
    KVPOOL_LOG_ERROR(
        "in-flight section, {} KiB blocks, client {} of {}: {}: {}{}", bytes >> 10, client + 1, D,
        what, kvpool::StatusText(s),
        absl::IsResourceExhausted(s)
            ? absl::StrCat(" (this section holds ", D, " client(s) x ", per_window, " put(s) x ",
                           bytes >> 10, " KiB = ", staging_bytes,
                           " bytes of open puts at once, then as many bytes of committed forms: "
                           "give the pool more --capacity, or lower --inflight-clients or "
                           "--inflight-window-kib)")
            : std::string());
    // The other clients' threads are still running (in a call, or spinning at the barrier):
    // leave without static destructors. std::exit ran UCX's and gRPC's under them: a fresh-clone
    // CI run on a loaded machine died there (double free, SIGABRT) instead of exiting 2.
    kvpool::Logger().flush();
    std::fflush(nullptr);
    std::_Exit(kvpool::cli::kExitRuntime);
  };
  SpinBarrier barrier(D);
  using Clock = std::chrono::steady_clock;
  // Per thread: its start and end of each window, and its operations' latencies.
  std::vector<Clock::time_point> t_begin(D), t_end(D);
  std::vector<std::vector<double>> put_lat(D), fetch_lat(D);
  double put_window_us = 0, fetch_window_us = 0, put_cpu_us = 0, fetch_cpu_us = 0;
  std::vector<uint32_t> seeds(D);
  for (auto& x : seeds) x = seed_rng();
  std::vector<std::thread> threads;
  for (int i = 0; i < D; ++i) {
    threads.emplace_back([&, i] {
      Client& cl = *clients[i];
      check(cl.RegisterModel(spec).status(), i, "RegisterModel");
      std::mt19937 rng(seeds[i]);
      const size_t elems = size_t(16) * H * 128;
      std::vector<std::vector<uint16_t>> kv(2 * L, std::vector<uint16_t>(elems));
      for (auto& layer : kv) {
        for (auto& x : layer) x = Bf16(float(int(rng() % 2001) - 1000) / 500.f);
      }
      std::vector<uint8_t> pages(bytes * per_window);
      auto region = cl.RegisterBuffer(pages.data(), pages.size());
      check(region.status(), i, "RegisterBuffer");
      kvpool::client::PagePool pool{*region, bytes};
      for (int round = 0; round <= rounds; ++round) {
        const bool timed = round > 0;
        std::vector<std::vector<uint32_t>> tokens(per_window, std::vector<uint32_t>(16));
        std::vector<std::unique_ptr<kvpool::client::PutSession>> puts;
        for (auto& tk : tokens) {
          for (auto& t : tk) t = rng();
          auto put = cl.BeginPut(tk);
          check(put.status(), i, "BeginPut");
          puts.push_back(*std::move(put));
        }
        // Put window.
        barrier.Wait();
        double cpu0 = i == 0 ? ProcessCpuUs() : 0;
        t_begin[i] = Clock::now();
        for (auto& put : puts) {
          const auto s0 = Clock::now();
          for (uint32_t l = 0; l < L; ++l)
            check(put->WriteLayer(l, kv[2 * l], kv[2 * l + 1]), i, "WriteLayer");
          check(put->Flush(), i, "Flush");
          if (timed) {
            put_lat[i].push_back(
                std::chrono::duration<double, std::micro>(Clock::now() - s0).count());
          }
        }
        t_end[i] = Clock::now();
        barrier.Wait();
        if (i == 0 && timed) {
          put_cpu_us += ProcessCpuUs() - cpu0;
          put_window_us += std::chrono::duration<double, std::micro>(
                               *std::max_element(t_end.begin(), t_end.end()) -
                               *std::min_element(t_begin.begin(), t_begin.end()))
                               .count();
        }
        barrier.Wait();  // thread 0 has read every thread's times
        for (auto& put : puts) {
          auto committed = put->Commit();
          check(committed.status(), i, "Commit");
          if (committed->blocks_written != 1) {
            KVPOOL_LOG_ERROR("in-flight put wrote {} blocks", committed->blocks_written);
            std::exit(kvpool::cli::kExitRuntime);
          }
        }
        std::vector<kvpool::client::Lease> leases;
        for (auto& tk : tokens) {
          auto lease = cl.Acquire(tk);
          check(lease.status(), i, "Acquire");
          leases.push_back(*std::move(lease));
        }
        // Fetch window: every block once, the first read after its commit, verified.
        barrier.Wait();
        cpu0 = i == 0 ? ProcessCpuUs() : 0;
        t_begin[i] = Clock::now();
        for (int k = 0; k < per_window; ++k) {
          kvpool::client::FetchPlan plan;
          plan.bf16_pool = &pool;
          plan.bf16_pages = {k};
          const auto s0 = Clock::now();
          auto f = cl.Fetch(leases[k], plan);
          const auto s1 = Clock::now();
          check(f.status(), i, "Fetch");
          if (f->num_blocks != 1) {
            KVPOOL_LOG_ERROR("in-flight fetch returned {} blocks", f->num_blocks);
            std::exit(kvpool::cli::kExitRuntime);
          }
          if (timed)
            fetch_lat[i].push_back(std::chrono::duration<double, std::micro>(s1 - s0).count());
        }
        t_end[i] = Clock::now();
        barrier.Wait();
        if (i == 0 && timed) {
          fetch_cpu_us += ProcessCpuUs() - cpu0;
          fetch_window_us += std::chrono::duration<double, std::micro>(
                                 *std::max_element(t_end.begin(), t_end.end()) -
                                 *std::min_element(t_begin.begin(), t_begin.end()))
                                 .count();
        }
        barrier.Wait();
        for (auto& lease : leases) check(cl.Release(lease), i, "Release");
      }
    });
  }
  for (auto& t : threads) t.join();
  const double moved = double(bytes) * D * per_window * rounds;  // per kind
  r.put_gbps = moved / (put_window_us * 1e3);
  r.fetch_gbps = moved / (fetch_window_us * 1e3);
  r.put_cpu_us_per_mib = put_cpu_us / (moved / double(1 << 20));
  r.fetch_cpu_us_per_mib = fetch_cpu_us / (moved / double(1 << 20));
  std::vector<double> all_put, all_fetch;
  for (int i = 0; i < D; ++i) {
    all_put.insert(all_put.end(), put_lat[i].begin(), put_lat[i].end());
    all_fetch.insert(all_fetch.end(), fetch_lat[i].begin(), fetch_lat[i].end());
  }
  r.put_op = Summarize(all_put);
  r.fetch_op = Summarize(all_fetch);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pool_bench — put/fetch/commit/lookup numbers of a running kvpool-server"};
  kvpool::cli::Setup(app, "pool_bench");
  std::string server = "127.0.0.1:7070";
  std::string tls = "tcp";
  std::vector<uint64_t> sizes_kib = {16, 64, 256, 1024, 4096};
  int iters = 50, warmup = 5, lookup_clients = 16, lookup_iters = 200, lookup_warmup = 10,
      commit_blocks = 64, commit_iters = 5;
  std::string json_path;
  bool map_shared_memory = true;
  bool async_put = true;
  std::string raw_get_into = "page";
  CopySettings cs;
  app.add_option("--async-put", async_put,
                 "Also put a second sequence per iteration with PutSession::WriteLayerAsync "
                 "(layers packed in the background, joined by Flush) and report it as 'put "
                 "async'; false: only WriteLayer puts")
      ->capture_default_str();
  app.add_option("--copy-threads", cs.copy_threads,
                 "ClientOptions::copy_threads of the measuring client (0 = the client's default: "
                 "half the hardware threads, 1..8)")
      ->check(kvpool::cli::Range(0, 64))
      ->capture_default_str();
  // A ClientOptions size threshold in KiB, 0 .. 2^30. kvpool::cli::Range everywhere: CLI::Range
  // said "Value 0,1 not in range -1 to 4095" for a value that is not an integer at all
  // (newcomer 16 F10).
  auto kib_option = [&app](const char* name, uint64_t& kib, const char* help) {
    app.add_option(name, kib, help)
        ->check(kvpool::cli::Range(uint64_t{0}, uint64_t{1} << 30))
        ->capture_default_str();
  };
  kib_option("--parallel-put-min-kib", cs.put_min_kib,
             "ClientOptions::parallel_put_min_bytes in KiB (smaller WriteLayer layers stay on "
             "the calling thread)");
  kib_option("--parallel-async-put-min-kib", cs.async_put_min_kib,
             "ClientOptions::parallel_async_put_min_bytes in KiB (WriteLayerAsync puts of "
             "fewer written bytes pack on the calling thread)");
  kib_option("--parallel-fetch-min-kib", cs.fetch_min_kib,
             "ClientOptions::parallel_fetch_min_bytes in KiB (smaller fetches stay on the "
             "calling thread unless the copy threads are awake)");
  kib_option("--parallel-fetch-awake-min-kib", cs.fetch_awake_min_kib,
             "ClientOptions::parallel_fetch_awake_min_bytes in KiB (fetches of at least this "
             "are spread when no copy thread is asleep)");
  app.add_option("--copy-threads-prewake-us", cs.prewake_us,
                 "ClientOptions::copy_threads_prewake in microseconds of the measuring client: "
                 "BeginPut/Acquire hold the copy threads awake through the RPC (at most this "
                 "long) when the put layers / fetch that follow will be spread; 0 = off")
      ->check(kvpool::cli::Range(int64_t{0}, int64_t{10'000'000}))
      ->capture_default_str();
  int pin_caller_cpu = -1;
  app.add_option("--pin-caller-cpu", pin_caller_cpu,
                 "An experiment: pin the measuring thread (only it: after its client and copy "
                 "threads exist; undone after the one-at-a-time transfers) to this CPU, so that "
                 "it cannot migrate to another core while it waits in an RPC; -1 = not pinned")
      ->check(kvpool::cli::Range(-1, 4095))
      ->capture_default_str();
  int inflight_clients = 0, inflight_copy_threads = 1, inflight_rounds = 10;
  bool only_inflight = false;
  uint64_t inflight_window_kib = 1024;
  app.add_option("--inflight-clients", inflight_clients,
                 "In-flight section (an additional measurement, after every size's "
                 "one-at-a-time transfers, which it leaves as they were): D clients, one thread "
                 "each, each with its own puts and fetches of fresh sequences, all D started "
                 "together; 0 = none (bench/pool_bench.py runs it with --only-inflight in "
                 "processes of their own)")
      ->check(kvpool::cli::Range(0, 256))
      ->capture_default_str();
  app.add_option("--only-inflight", only_inflight,
                 "Run only the in-flight section (needs --inflight-clients > 0): no "
                 "one-at-a-time transfers, commit or lookup; each size's JSON entry holds its "
                 "bytes and the in-flight fields")
      ->capture_default_str();
  app.add_option("--inflight-copy-threads", inflight_copy_threads,
                 "ClientOptions::copy_threads of each in-flight client (1 = no worker threads: "
                 "each put and fetch on its own calling thread)")
      ->check(kvpool::cli::Range(1, 64))
      ->capture_default_str();
  app.add_option("--inflight-rounds", inflight_rounds,
                 "Timed windows per size of the in-flight section (one more untimed first)")
      ->check(kvpool::cli::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--inflight-window-kib", inflight_window_kib,
                 "Bytes each in-flight client puts (then fetches) back to back in one window, "
                 "in KiB: max(1, this / size) blocks of one put each, at most 8")
      ->check(kvpool::cli::Range(uint64_t{1}, uint64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--raw-get-into", raw_get_into,
                 "Where the raw get lands: 'page' = the fetch page itself (so the next "
                 "iteration's first fetch writes lines the transport's owner thread wrote last, "
                 "on another core); 'own' = a registered buffer of its own, so the fetch pages are "
                 "written only by fetches (session 9 measured no difference: docs/TRANSPORT.md)")
      ->check(CLI::IsMember({"own", "page"}))
      ->capture_default_str();
  app.add_option("--server", server, "gRPC address of the pool")->capture_default_str();
  app.add_option("--map-shared-memory", map_shared_memory,
                 "Let the client map the pool's memory when the transport can (direct mode); "
                 "false: RMA transfers")
      ->capture_default_str();
  app.add_option("--ucx-tls", tls, "UCX_TLS of the client (match the server's)")
      ->capture_default_str();
  app.add_option("--sizes-kib", sizes_kib, "Transfer sizes in KiB (powers of two, >= 16)")
      ->delimiter(',')
      ->check(kvpool::cli::Range(uint64_t{0}, uint64_t{1} << 30))  // powers of two: below
      ->capture_default_str();
  // Ranges: a negative count reached std::vector's constructor (std::length_error, abort) and
  // zero timed iterations leave nothing to take percentiles of.
  auto count_option = [&app](const char* name, int& count, int min, int max, const char* help) {
    app.add_option(name, count, help)->check(kvpool::cli::Range(min, max))->capture_default_str();
  };
  count_option("--iters", iters, 1, 1000000, "Timed puts/fetches per size");
  count_option("--warmup", warmup, 0, 1000000, "Untimed iterations per size");
  count_option("--lookup-clients", lookup_clients, 1, 1024,
               "Concurrent clients for the lookup test");
  count_option("--lookup-iters", lookup_iters, 1, 10000000, "Lookups per client");
  count_option("--lookup-warmup", lookup_warmup, 0, 1000000,
               "Untimed lookups per client before the timed ones (all clients set up first)");
  count_option("--commit-blocks", commit_blocks, 1, 65536, "INT2 blocks per commit");
  count_option("--commit-iters", commit_iters, 1, 1000000, "Timed commits");
  // Checked while parsing (kvpool::cli::OutputFile), so a bad path costs no run: it used to be
  // found only when the results were written, after the whole benchmark (exit 2).
  app.add_option("--json", json_path, "Write results as JSON to this file")
      ->check(kvpool::cli::OutputFile());
  KVPOOL_CLI_PARSE(app, argc, argv);
  g_pool_address = server;
  if (only_inflight && inflight_clients == 0) {
    // The usage form of the flags' own checks (newcomer 11b F7: it was an E log line).
    std::fprintf(stderr,
                 "pool_bench: --only-inflight: needs --inflight-clients > 0 (the in-flight "
                 "section is all it runs)\nRun with --help for more information.\n");
    return kvpool::cli::kExitUsage;
  }
  if (pin_caller_cpu >= 0) {
    // Checked before anything runs, in the usage form: pthread_setaffinity_np's EINVAL, found
    // after the client was set up, said nothing of why (newcomer 13b F9).
    cpu_set_t allowed_set;
    CPU_ZERO(&allowed_set);
    pthread_getaffinity_np(pthread_self(), sizeof(allowed_set), &allowed_set);
    if (!CPU_ISSET(pin_caller_cpu, &allowed_set)) {
      std::string allowed;
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &allowed_set)) {
          allowed += (allowed.empty() ? "" : ",") + std::to_string(c);
        }
      }
      std::fprintf(stderr,
                   "pool_bench: --pin-caller-cpu: CPU %d is not one this process may run on "
                   "(its CPUs: %s)\nRun with --help for more information.\n",
                   pin_caller_cpu, allowed.c_str());
      return kvpool::cli::kExitUsage;
    }
  }

  nlohmann::json out;
  out["bench"] = "pool_bench";
  out["version"] = kvpool::kVersion;
  out["git_sha"] = kvpool::kGitSha;
  out["server"] = server;
  out["ucx_tls"] = tls;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  out["host"] = host;
  out["hardware_threads"] = std::thread::hardware_concurrency();
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) == 3) out["load_average_1m_at_start"] = load[0];

  // A fresh seed per run: sequences from an earlier run against the same pool would already
  // be stored, and their puts would write nothing.
  std::mt19937 rng(std::random_device{}());
  auto client = NewClient(server, tls, map_shared_memory, cs);
  // What the in-flight section needs of each size (it runs after all of them).
  struct SizeRun {
    ModelSpec spec;
    uint32_t L, H;
    uint64_t kib;
  };
  std::vector<SizeRun> size_runs;
  cpu_set_t unpinned;
  CPU_ZERO(&unpinned);
  if (pin_caller_cpu >= 0) {
    pthread_getaffinity_np(pthread_self(), sizeof(unpinned), &unpinned);
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(pin_caller_cpu, &one);
    if (const int err = pthread_setaffinity_np(pthread_self(), sizeof(one), &one); err != 0) {
      KVPOOL_LOG_ERROR("--pin-caller-cpu: cannot pin to CPU {}: {}", pin_caller_cpu,
                       std::strerror(err));
      return kvpool::cli::kExitUsage;
    }
  }
  out["pin_caller_cpu"] = pin_caller_cpu;
  out["inflight_clients"] = inflight_clients;
  out["inflight_copy_threads"] = inflight_copy_threads;
  out["only_inflight"] = only_inflight;
  out["map_shared_memory"] = map_shared_memory;
  out["async_put"] = async_put;
  out["raw_get_into"] = raw_get_into;
  out["copy_threads"] = cs.copy_threads;  // 0: the client's default
  out["parallel_put_min_kib"] = cs.put_min_kib;
  out["parallel_async_put_min_kib"] = cs.async_put_min_kib;
  out["parallel_fetch_min_kib"] = cs.fetch_min_kib;
  out["parallel_fetch_awake_min_kib"] = cs.fetch_awake_min_kib;
  out["copy_threads_prewake_us"] = cs.prewake_us;
  // What "verified" means in this build: the form checksum of docs/BLOCK_FORMAT.md "Checksums"
  // (protocol v1.3: xxh3_64 per 16 KiB chunk, combined), hashed by the thread that copies each
  // chunk. Results from before it (one xxh3 stream per form) have no such field.
  out["checksum"] = absl::StrCat("chunked xxh3_64, ", kvpool::kChecksumChunkBytes, "-byte chunks");

  // Every size is checked before anything is printed (newcomer report 13 F7: the header came
  // first, then the refusal).
  for (uint64_t kib : sizes_kib) {
    const uint64_t bytes = kib << 10;
    if (bytes < (16u << 10) || (bytes & (bytes - 1)) != 0) {
      // The usage form, as the flags' own checks (newcomer report 13b: an E log line).
      std::fprintf(stderr,
                   "pool_bench: --sizes-kib: %llu is not a power of two >= 16\n"
                   "Run with --help for more information.\n",
                   static_cast<unsigned long long>(kib));
      return kvpool::cli::kExitUsage;
    }
  }
  // Printed before the first row, so never with --only-inflight (its columns are the
  // one-at-a-time transfers it skips; newcomer 11b F7) nor before a failure that ends the run
  // with no row (newcomer report 13b: a pool that cannot be reached).
  bool header_printed = false;
  auto print_header = [&] {
    if (header_printed) return;
    header_printed = true;
    std::printf(
        "%-9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s %6s %6s %8s  (GB/s; mean over "
        "iterations; p50 in us; faults: minor page faults per put / first fetch; cpu: process CPU "
        "ms per iteration)\n",
        "size", "put data", "put async", "put e2e", "put+cmt", "fetch", "warm", "no-xxh3",
        "fetch e2e", "raw get", "p50 put", "p50 async", "pf put", "pf get", "cpu ms");
  };
  for (uint64_t kib : sizes_kib) {
    const uint64_t bytes = kib << 10;
    // bytes = L * H * 8 KiB; keep L <= 8.
    const uint32_t units = static_cast<uint32_t>(bytes / (8 << 10));
    const uint32_t L = std::min<uint32_t>(8, units);
    const uint32_t H = units / L;
    ModelSpec spec = Spec(absl::StrCat("bench-", kib, "k"), L, H, "bf16", 16, 16);
    if (only_inflight) {
      size_runs.push_back({spec, L, H, kib});
      out["transfers"].push_back({{"bytes", bytes}, {"layers", L}, {"kv_heads", H}});
      continue;
    }
    auto info = client->RegisterModel(spec);
    BENCH_CHECK(absl::StrCat("registering model ", spec.model_id), info.status());
    const size_t elems = size_t(16) * H * 128;
    std::vector<std::vector<uint16_t>> kv(2 * L, std::vector<uint16_t>(elems));
    for (auto& layer : kv) {
      for (auto& x : layer) x = Bf16(float(int(rng() % 2001) - 1000) / 500.f);
    }
    // Page pool for one block.
    std::vector<uint8_t> page(bytes);
    auto region = client->RegisterBuffer(page.data(), page.size());
    BENCH_CHECK("registering the fetch page", region.status());
    kvpool::client::PagePool pool{*region, bytes};
    // The raw get's destination (--raw-get-into).
    std::vector<uint8_t> raw_page(raw_get_into == "own" ? bytes : 0);
    std::shared_ptr<kvpool::transport::MemoryRegion> raw_region = *region;
    if (raw_get_into == "own") {
      auto r = client->RegisterBuffer(raw_page.data(), raw_page.size());
      BENCH_CHECK("registering the raw-get buffer", r.status());
      raw_region = *r;
    }

    std::vector<double> put_us, put_e2e_us, put_commit_us, put_async_us, put_async_e2e_us, fetch_us,
        fetch_warm_us, fetch_nv_us, fetch_e2e_us, raw_us;
    bool direct = false;
    long put_faults = 0, fetch_faults = 0;  // minor page faults of this thread, timed phases
    double cpu_us = 0;                      // process CPU time of the timed iterations
    for (int it = 0; it < warmup + iters; ++it) {
      const double cpu0 = ProcessCpuUs();
      // One put of a fresh sequence (`async`: WriteLayerAsync); returns its tokens.
      auto put_one = [&](bool async) {
        std::vector<uint32_t> tokens(16);
        for (auto& t : tokens) t = rng();
        const absl::Time b0 = absl::Now();
        auto put = client->BeginPut(tokens);
        BENCH_CHECK("BeginPut", put.status());
        const long pf0 = ThreadMinorFaults();
        const absl::Time t0 = absl::Now();
        for (uint32_t l = 0; l < L; ++l) {
          BENCH_CHECK("WriteLayer", async ? (*put)->WriteLayerAsync(l, kv[2 * l], kv[2 * l + 1])
                                          : (*put)->WriteLayer(l, kv[2 * l], kv[2 * l + 1]));
        }
        BENCH_CHECK("Flush of the put", (*put)->Flush());
        const absl::Time t1 = absl::Now();
        const long pf1 = ThreadMinorFaults();
        auto committed = (*put)->Commit();
        const absl::Time t1c = absl::Now();
        BENCH_CHECK("Commit of the put", committed.status());
        if (committed->blocks_written != 1) {
          KVPOOL_LOG_ERROR("put wrote {} blocks (the sequence was already stored?)",
                           committed->blocks_written);
          std::exit(kvpool::cli::kExitRuntime);
        }
        if (it >= warmup) {
          if (async) {
            put_async_us.push_back(absl::ToDoubleMicroseconds(t1 - t0));
            put_async_e2e_us.push_back(absl::ToDoubleMicroseconds(t1 - b0));
          } else {
            put_us.push_back(absl::ToDoubleMicroseconds(t1 - t0));
            put_e2e_us.push_back(absl::ToDoubleMicroseconds(t1 - b0));
            put_commit_us.push_back(absl::ToDoubleMicroseconds(t1c - b0));
            put_faults += pf1 - pf0;
          }
        }
        return tokens;
      };
      // Both kinds alternate in order; the block fetched below is the one committed last.
      std::vector<uint32_t> tokens;
      if (!async_put) {
        tokens = put_one(false);
      } else if (it % 2 == 0) {
        put_one(false);
        tokens = put_one(true);
      } else {
        put_one(true);
        tokens = put_one(false);
      }
      kvpool::client::FetchPlan plan;
      plan.bf16_pool = &pool;
      plan.bf16_pages = {0};
      const absl::Time a0 = absl::Now();
      auto lease = client->Acquire(tokens);
      BENCH_CHECK("Acquire (lease)", lease.status());
      const long pf2 = ThreadMinorFaults();
      const absl::Time t2 = absl::Now();
      auto f = client->Fetch(*lease, plan);
      const absl::Time t3 = absl::Now();
      const long pf3 = ThreadMinorFaults();
      BENCH_CHECK("Fetch", f.status());
      if (f->num_blocks != 1) {
        KVPOOL_LOG_ERROR("fetch returned {} blocks", f->num_blocks);
        return kvpool::cli::kExitRuntime;
      }
      // The same block again, verified and unverified (FetchPlan::verify_checksums = false), in
      // alternating order so that neither always reads after the other.
      kvpool::client::FetchPlan unverified = plan;
      unverified.verify_checksums = false;
      double warm_us = 0, nv_us = 0;
      for (int pass = 0; pass < 2; ++pass) {
        const bool verified = (pass == 0) == (it % 2 == 0);
        const absl::Time s0 = absl::Now();
        BENCH_CHECK("Fetch", client->Fetch(*lease, verified ? plan : unverified).status());
        (verified ? warm_us : nv_us) = absl::ToDoubleMicroseconds(absl::Now() - s0);
      }
      // The same bytes with a bare RMA get through the transport (no verification): the
      // wrapper's own cost next to the client's. Only when the client may address the pool's
      // memory (not when the pool initiates transfers, e.g. over tcp).
      absl::Time t4 = absl::Now(), t5 = t4;
      if (!info->pool_initiates_transfers) {
        const auto& loc = *lease->blocks[0].bf16;
        auto target = client->DataPlaneTarget(lease->pool_epoch, loc.rkey);
        BENCH_CHECK("the data-plane target of the lease", target.status());
        t4 = absl::Now();
        BENCH_CHECK("the raw get",
                    client->transport().Execute({kvpool::transport::TransferKind::kGet,
                                                 target->first,
                                                 target->second,
                                                 raw_region,
                                                 {{0, loc.remote_addr, loc.size}}},
                                                absl::Now() + absl::Seconds(30)));
        t5 = absl::Now();
      }
      const absl::Time r0 = absl::Now();
      BENCH_CHECK("Release of the lease", client->Release(*lease));
      const absl::Duration release = absl::Now() - r0;
      if (it >= warmup) {
        fetch_us.push_back(absl::ToDoubleMicroseconds(t3 - t2));
        fetch_e2e_us.push_back(absl::ToDoubleMicroseconds((t3 - a0) + release));
        fetch_warm_us.push_back(warm_us);
        fetch_nv_us.push_back(nv_us);
        if (t5 > t4) raw_us.push_back(absl::ToDoubleMicroseconds(t5 - t4));
        fetch_faults += pf3 - pf2;
        cpu_us += ProcessCpuUs() - cpu0;
      }
    }
    {
      auto m = client->model();
      BENCH_CHECK("the client's model", m.status());
      direct = m->mapped_pool_memory;
    }
    const Stats pa = Summarize(put_async_us), pae = Summarize(put_async_e2e_us);
    const Stats ps = Summarize(put_us), pe = Summarize(put_e2e_us), pc = Summarize(put_commit_us),
                fs = Summarize(fetch_us), fw = Summarize(fetch_warm_us),
                nvs = Summarize(fetch_nv_us), fe = Summarize(fetch_e2e_us), rs = Summarize(raw_us);
    auto gbps = [&](const Stats& st) { return st.mean_us > 0 ? bytes / (st.mean_us * 1e3) : 0.0; };
    // No raw get when the pool initiates transfers (docs/TRANSPORT.md): "n/a", not a measured 0.
    char raw_cell[32] = "n/a";
    if (!raw_us.empty()) std::snprintf(raw_cell, sizeof(raw_cell), "%.3f", gbps(rs));
    print_header();
    std::printf(
        "%-9s %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9s %9.1f %9.1f %6.1f %6.1f %8.3f\n",
        absl::StrCat(kib, " KiB").c_str(), gbps(ps), gbps(pa), gbps(pe), gbps(pc), gbps(fs),
        gbps(fw), gbps(nvs), gbps(fe), raw_cell, ps.p50_us, pa.p50_us, double(put_faults) / iters,
        double(fetch_faults) / iters, cpu_us / iters / 1e3);
    auto add = [&](nlohmann::json& j, const std::string& name, const Stats& st) {
      j[name + "_gbps"] = gbps(st);
      j[name + "_p50_us"] = st.p50_us;
      j[name + "_p99_us"] = st.p99_us;
      j[name + "_gbps_at_p50"] = st.p50_us > 0 ? bytes / (st.p50_us * 1e3) : 0.0;
    };
    nlohmann::json j = {{"bytes", bytes},
                        {"layers", L},
                        {"kv_heads", H},
                        {"iters", iters},
                        {"pool_initiated", info->pool_initiates_transfers},
                        {"direct_mapped", direct},
                        {"data_path", direct                           ? "direct"
                                      : info->pool_initiates_transfers ? "pool-initiated"
                                                                       : "client-rma"}};
    // Transport transfers per put and per fetch of this one block, by construction of the
    // client's paths (docs/TRANSPORT.md): direct stores/copies use none; client RMA puts one
    // per layer and gets one per fetch. Pool-initiated: WritePut calls vary (1..L per put).
    if (!info->pool_initiates_transfers) {
      j["transfers_per_put"] = direct ? 0 : int(L);
      j["transfers_per_fetch"] = direct ? 0 : 1;
    }
    j["put_minor_faults_per_iter"] = double(put_faults) / iters;
    // Process CPU time per iteration (all puts, fetches, lease RPCs of it; copy threads spinning
    // or working included): what copy_threads_prewake costs shows here.
    j["cpu_us_per_iter"] = cpu_us / iters;
    j["fetch_minor_faults_per_iter"] = double(fetch_faults) / iters;
    add(j, "put", ps);         // data phase
    add(j, "put_e2e", pe);     // BeginPut → Flush
    add(j, "put_commit", pc);  // BeginPut → CommitPut returned
    if (!put_async_us.empty()) {
      add(j, "put_async", pa);       // WriteLayerAsync puts: first layer → Flush returned
      add(j, "put_async_e2e", pae);  // BeginPut → Flush
    }
    add(j, "fetch", fs);       // first Fetch after the commit, verified
    add(j, "fetch_warm", fw);  // the same block again, verified
    add(j, "fetch_unverified", nvs);
    add(j, "fetch_e2e", fe);  // Acquire + Fetch + Release
    if (!raw_us.empty()) add(j, "raw_get", rs);
    size_runs.push_back({spec, L, H, kib});
    out["transfers"].push_back(j);
  }

  if (pin_caller_cpu >= 0) pthread_setaffinity_np(pthread_self(), sizeof(unpinned), &unpinned);

  // ---- in flight: D clients at once (after every one-at-a-time size, so that neither their
  // clients nor their load are in the process while those are measured) ----
  if (inflight_clients > 0) {
    std::vector<std::unique_ptr<Client>> inflight;
    CopySettings ics;
    ics.copy_threads = inflight_copy_threads;
    for (int i = 0; i < inflight_clients; ++i) {
      inflight.push_back(NewClient(server, tls, map_shared_memory, ics));
    }
    for (size_t k = 0; k < size_runs.size(); ++k) {
      const SizeRun& sr = size_runs[k];
      const uint64_t bytes = sr.kib << 10;
      const int per_window =
          static_cast<int>(std::clamp<uint64_t>(inflight_window_kib / sr.kib, 1, 8));
      const Inflight fl = RunInflight(inflight, sr.spec, sr.L, sr.H, bytes, per_window,
                                      inflight_rounds, inflight_copy_threads, rng);
      std::printf(
          "%-9s in flight: %d clients x %d thread(s), %d back-to-back per client per window: put "
          "%.3f GB/s (each put p50 %.1f / p99 %.1f us; %.0f us CPU per MiB), fetch %.3f GB/s "
          "(p50 %.1f / p99 %.1f us; %.0f us CPU per MiB)\n",
          absl::StrCat(sr.kib, " KiB").c_str(), fl.clients, fl.copy_threads, fl.per_window,
          fl.put_gbps, fl.put_op.p50_us, fl.put_op.p99_us, fl.put_cpu_us_per_mib, fl.fetch_gbps,
          fl.fetch_op.p50_us, fl.fetch_op.p99_us, fl.fetch_cpu_us_per_mib);
      nlohmann::json& j = out["transfers"][k];
      j["inflight_clients"] = fl.clients;
      j["inflight_copy_threads"] = fl.copy_threads;
      j["inflight_threads"] = fl.clients * fl.copy_threads;
      j["inflight_per_window"] = fl.per_window;
      j["inflight_rounds"] = fl.rounds;
      j["put_inflight_gbps"] = fl.put_gbps;
      j["put_inflight_p50_us"] = fl.put_op.p50_us;
      j["put_inflight_p99_us"] = fl.put_op.p99_us;
      j["put_inflight_cpu_us_per_mib"] = fl.put_cpu_us_per_mib;
      j["fetch_inflight_gbps"] = fl.fetch_gbps;
      j["fetch_inflight_p50_us"] = fl.fetch_op.p50_us;
      j["fetch_inflight_p99_us"] = fl.fetch_op.p99_us;
      j["fetch_inflight_cpu_us_per_mib"] = fl.fetch_cpu_us_per_mib;
    }
  }

  // ---- commit (rotate + quantize to INT2 on the pool) ----
  if (!only_inflight) {
    const uint32_t L = 4, H = 8;
    ModelSpec spec = Spec("bench-commit", L, H, "int2", 0, 0);
    BENCH_CHECK("registering model bench-commit", client->RegisterModel(spec).status());
    const size_t elems = size_t(commit_blocks) * 16 * H * 128;
    std::vector<std::vector<uint16_t>> kv(2 * L, std::vector<uint16_t>(elems));
    std::normal_distribution<float> n(0.f, 1.f);
    for (auto& layer : kv) {
      for (auto& x : layer) x = Bf16(n(rng));
    }
    std::vector<double> commit_us;
    const uint64_t bytes = uint64_t(commit_blocks) * L * H * 8192;
    for (int it = 0; it < 1 + commit_iters; ++it) {
      std::vector<uint32_t> tokens(size_t(commit_blocks) * 16);
      for (auto& t : tokens) t = rng();
      auto put = client->BeginPut(tokens);
      BENCH_CHECK("BeginPut (commit test)", put.status());
      for (uint32_t l = 0; l < L; ++l)
        BENCH_CHECK("WriteLayer (commit test)", (*put)->WriteLayer(l, kv[2 * l], kv[2 * l + 1]));
      BENCH_CHECK("Flush (commit test)", (*put)->Flush());
      absl::Time t0 = absl::Now();
      BENCH_CHECK("Commit (commit test)", (*put)->Commit().status());
      if (it > 0) commit_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
    }
    Stats cs = Summarize(commit_us);
    const double gbs = bytes / (cs.mean_us * 1e3);
    std::printf(
        "\ncommit (rotate+quantize, %d blocks of %llu KiB BF16): %.3f GB/s of BF16 input, "
        "p50 %.1f ms\n",
        commit_blocks, static_cast<unsigned long long>(L * H * 8), gbs, cs.p50_us / 1e3);
    out["commit"] = {{"blocks", commit_blocks},
                     {"bf16_bytes", bytes},
                     {"gbps", gbs},
                     {"p50_ms", cs.p50_us / 1e3},
                     {"p99_ms", cs.p99_us / 1e3}};
  }

  // ---- lookup p99 with concurrent clients ----
  if (!only_inflight) {
    ModelSpec spec = Spec("bench-lookup", 2, 2, "int2", 16, 32);
    BENCH_CHECK("registering model bench-lookup", client->RegisterModel(spec).status());
    const uint32_t blocks = 64;
    std::vector<uint32_t> tokens(blocks * 16);
    for (auto& t : tokens) t = rng();
    std::vector<std::vector<uint16_t>> kv(4, std::vector<uint16_t>(tokens.size() * 2 * 128));
    for (auto& layer : kv) {
      for (auto& x : layer) x = Bf16(float(int(rng() % 200) - 100) / 50.f);
    }
    std::vector<absl::Span<const uint16_t>> ks = {kv[0], kv[2]}, vs = {kv[1], kv[3]};
    BENCH_CHECK("Put (lookup test)", client->Put(tokens, ks, vs).status());
    // Every client is created and registered (its UCX worker, copy threads, channel, and over a
    // shared-memory transport the pool's memory mapped and its page tables filled) before any
    // lookup is timed, and each first makes `lookup_warmup` untimed lookups (its channel's
    // first call); all are destroyed only after the last timed lookup. Before session 10 each
    // client started timing as soon as it had registered, so the first clients' lookups ran
    // while the others were still setting up (16 × an madvise(MADV_POPULATE_WRITE) of the
    // pool's mapping, thread creation) and, at the end, while finished clients unmapped it:
    // p99 measured that, not lookups.
    std::vector<std::vector<double>> lat(lookup_clients);
    std::atomic<int> failures{0};
    // Blocking latches, not sleep-polling flags: a main thread waking every 200 us took 7 % of
    // the bench process's CPU time during the timed lookups (perf, 1 client).
    std::latch ready(lookup_clients), done(lookup_clients), go(1), leave(1);
    std::vector<std::thread> threads;
    const absl::Time setup_start = absl::Now();
    for (int c = 0; c < lookup_clients; ++c) {
      threads.emplace_back([&, c] {
        auto cl = NewClient(server, tls);
        bool ok = cl->RegisterModel(spec).ok();
        if (!ok) ++failures;
        for (int i = 0; ok && i < lookup_warmup; ++i) {
          auto r = cl->Lookup(tokens);
          if (!r.ok() || r->num_blocks != blocks) ++failures;
        }
        ready.count_down();
        go.wait();
        for (int i = 0; ok && i < lookup_iters; ++i) {
          absl::Time t0 = absl::Now();
          auto r = cl->Lookup(tokens);
          lat[c].push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
          if (!r.ok() || r->num_blocks != blocks) ++failures;
        }
        done.count_down();
        leave.wait();
      });
    }
    ready.wait();
    const double setup_s = absl::ToDoubleSeconds(absl::Now() - setup_start);
    const absl::Time start = absl::Now();
    go.count_down();
    done.wait();
    const double wall_s = absl::ToDoubleSeconds(absl::Now() - start);
    leave.count_down();
    for (auto& t : threads) t.join();
    std::vector<double> all;
    for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
    Stats ls = Summarize(all);
    std::printf(
        "lookup (%u blocks, %d clients): p50 %.1f us, p99 %.1f us, %.0f lookups/s, %d "
        "failures (set-up of the clients %.0f ms, untimed)\n",
        blocks, lookup_clients, ls.p50_us, ls.p99_us, all.size() / wall_s, failures.load(),
        setup_s * 1e3);
    out["lookup"] = {{"clients", lookup_clients},   {"blocks", blocks},
                     {"p50_us", ls.p50_us},         {"p99_us", ls.p99_us},
                     {"rate", all.size() / wall_s}, {"failures", failures.load()},
                     {"warmup", lookup_warmup},     {"setup_ms", setup_s * 1e3}};
    if (failures.load() != 0) return kvpool::cli::kExitRuntime;
  }

  if (!json_path.empty()) {
    // Atomic, and through a symbolic link (kvpool/common/cli.h).
    if (auto s = kvpool::cli::WriteOutputFile(json_path, out.dump(2) + "\n"); !s.ok()) {
      KVPOOL_LOG_ERROR("--json: {}", std::string(s.message()));
      return kvpool::cli::kExitRuntime;
    }
  }
  return kvpool::cli::kExitOk;
}
