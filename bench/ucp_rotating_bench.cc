// ucp_rotating_bench — a second UCX baseline for pool_bench: one RMA put or get of S bytes at a
// time between two processes over the same UCX transport, each operation on a buffer pair that
// no earlier operation touched for a whole ring (--ring-mib per side, larger than the host's
// last-level cache), so source and destination come from memory, not from a cache.
//
// Why (docs/TRANSPORT.md "Session 9"): ucx_perftest (UCX 1.13) reuses one buffer per side for
// every iteration, so at 256 KiB over posix,cma it measures one core's memcpy between two
// buffers held in its own L2 (~8 us on the H200 host). kvpool's first fetch reads a form the
// pool has just written, into pages other cores wrote last. This binary keeps everything else of
// ucx_perftest's measurement (ucp_put_nbx / ucp_get_nbx of one contiguous buffer, UCX's default
// protocol thresholds, buffers allocated by ucp_mem_map(ALLOCATE) as ucx_perftest's are, so
// posix maps them), but with one operation in flight (like kvpool's client: a put is posted and
// flushed, a get waited for) and a fresh buffer pair per operation. With --ring-mib 0 both sides
// reuse one buffer, which reproduces ucx_perftest's setting (the "same" rows: a check of this
// binary against ucx_perftest in the same run).
//
// The process forks: the child is the target (allocates its ring, sends its worker address and
// packed key over a socketpair, then progresses its worker until told to stop: tcp needs the
// target to progress; shared memory does not). The parent initiates. Page tables of both rings
// (and of the mapped remote ring, when the transport maps it) are filled before timing, so no
// operation takes page faults (kvpool's client populates its mapping of the pool the same way).
//
// Prints one line per (size, ring, test) and writes JSON (--json): bandwidth = bytes / mean
// latency, p50/p99 of the per-operation latency (steady_clock around post + completion).
// Exit codes: 0 ok, 1 usage, 2 runtime error (a UCX call failed; the message names it).
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <ucp/api/ucp.h>
#include <nlohmann/json.hpp>

#include "kvpool/common/cli.h"
#include "kvpool/common/version.h"

namespace {

[[noreturn]] void Die(const char* what, ucs_status_t st) {
  std::fprintf(stderr, "ucp_rotating_bench: %s: %s\n", what, ucs_status_string(st));
  std::exit(kvpool::cli::kExitRuntime);
}

[[noreturn]] void DieErrno(const char* what) {
  std::fprintf(stderr, "ucp_rotating_bench: %s: %s\n", what, std::strerror(errno));
  std::exit(kvpool::cli::kExitRuntime);
}

void Check(ucs_status_t st, const char* what) {
  if (st != UCS_OK) Die(what, st);
}

// A context and one worker with RMA, UCX_TLS = `tls` (other settings: UCX's defaults and the
// environment, as for ucx_perftest).
struct Ucp {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;

  explicit Ucp(const std::string& tls) {
    ucp_config_t* config = nullptr;
    Check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
    if (!tls.empty()) Check(ucp_config_modify(config, "TLS", tls.c_str()), "UCX_TLS");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA;
    Check(ucp_init(&params, config, &context), "ucp_init");
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    Check(ucp_worker_create(context, &wp, &worker), "ucp_worker_create");
  }
  ~Ucp() {
    ucp_worker_destroy(worker);
    ucp_cleanup(context);
  }
};

// `bytes` allocated and registered by UCX (UCP_MEM_MAP_ALLOCATE: a posix/sysv segment when a
// shared-memory transport is enabled, as for ucx_perftest's buffers), every page written once.
struct Ring {
  ucp_context_h context;
  ucp_mem_h memh = nullptr;
  uint8_t* data = nullptr;
  size_t bytes = 0;

  Ring(ucp_context_h c, size_t n, uint8_t fill) : context(c), bytes(n) {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.length = n;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    Check(ucp_mem_map(context, &mp, &memh), "ucp_mem_map(ALLOCATE)");
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    Check(ucp_mem_query(memh, &attr), "ucp_mem_query");
    data = static_cast<uint8_t*>(attr.address);
    // Distinct bytes per page, never zero (zero pages could be shared or skipped).
    for (size_t at = 0; at < n; at += 4096) {
      std::memset(data + at, fill ^ static_cast<uint8_t>(at >> 12), std::min<size_t>(4096, n - at));
    }
  }
  ~Ring() { ucp_mem_unmap(context, memh); }
};

void SendAll(int fd, const void* p, size_t n) {
  const auto* c = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t w = write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) DieErrno("socketpair write");
    c += w;
    n -= size_t(w);
  }
}

void RecvAll(int fd, void* p, size_t n) {
  auto* c = static_cast<uint8_t*>(p);
  while (n > 0) {
    ssize_t r = read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) DieErrno("socketpair read");
    c += r;
    n -= size_t(r);
  }
}

void SendBlob(int fd, const void* p, uint64_t n) {
  SendAll(fd, &n, sizeof(n));
  SendAll(fd, p, n);
}

std::vector<uint8_t> RecvBlob(int fd) {
  uint64_t n = 0;
  RecvAll(fd, &n, sizeof(n));
  std::vector<uint8_t> v(n);
  RecvAll(fd, v.data(), n);
  return v;
}

// Waits for a non-blocking request (nullptr: done at once), progressing the worker.
void Wait(ucp_worker_h w, ucs_status_ptr_t req, const char* what) {
  if (req == nullptr) return;
  if (UCS_PTR_IS_ERR(req)) Die(what, UCS_PTR_STATUS(req));
  ucs_status_t st;
  do {
    ucp_worker_progress(w);
    st = ucp_request_check_status(req);
  } while (st == UCS_INPROGRESS);
  ucp_request_free(req);
  Check(st, what);
}

// The target: allocates its ring, publishes it, progresses until the initiator closes `fd`.
int Target(int fd, const std::string& tls, size_t ring_bytes) {
  Ucp u(tls);
  Ring ring(u.context, ring_bytes, 0x5a);
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  Check(ucp_worker_get_address(u.worker, &addr, &addr_len), "ucp_worker_get_address");
  void* rkey = nullptr;
  size_t rkey_len = 0;
  Check(ucp_rkey_pack(u.context, ring.memh, &rkey, &rkey_len), "ucp_rkey_pack");
  SendBlob(fd, addr, addr_len);
  SendBlob(fd, rkey, rkey_len);
  const uint64_t base = reinterpret_cast<uintptr_t>(ring.data);
  SendAll(fd, &base, sizeof(base));
  ucp_rkey_buffer_release(rkey);
  ucp_worker_release_address(u.worker, addr);
  // Progress (tcp needs the target's worker to serve gets and puts) until the initiator is done.
  pollfd p{fd, POLLIN, 0};
  for (uint64_t k = 0;; ++k) {
    ucp_worker_progress(u.worker);
    if ((k & 1023) == 0 && poll(&p, 1, 0) > 0) break;
  }
  return 0;
}

struct Stats {
  double mean_us = 0, p50_us = 0, p99_us = 0;
};

Stats Summarize(std::vector<double> us) {
  Stats s;
  std::sort(us.begin(), us.end());
  auto pct = [&](double p) {
    return us[std::min(us.size() - 1, size_t(p * (us.size() - 1) + 0.5))];
  };
  double sum = 0;
  for (double x : us) sum += x;
  s.mean_us = sum / us.size();
  s.p50_us = pct(0.5);
  s.p99_us = pct(0.99);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "ucp_rotating_bench — UCX put/get of one buffer at a time over buffers not in any cache "
      "(a baseline for pool_bench next to ucx_perftest)"};
  kvpool::cli::Setup(app, "ucp_rotating_bench");
  std::string tls = "posix,cma";
  std::vector<uint64_t> sizes_kib = {256, 1024, 4096};
  int iters = 200, warmup = 10;
  uint64_t ring_mib = 1024;
  bool same = true;
  std::string json_path;
  app.add_option("--ucx-tls", tls, "UCX_TLS of both processes")->capture_default_str();
  app.add_option("--sizes-kib", sizes_kib, "Message sizes in KiB")
      ->delimiter(',')
      ->check(kvpool::cli::Range(uint64_t{1}, uint64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--iters", iters, "Timed operations per size and test")
      ->check(kvpool::cli::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed operations before them")
      ->check(kvpool::cli::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--ring-mib", ring_mib,
                 "Bytes of buffers per side, in MiB: each operation uses the next buffer of "
                 "the ring (choose it well above the last-level cache); 0 = one buffer reused, "
                 "as ucx_perftest does")
      ->check(kvpool::cli::Range(uint64_t{0}, uint64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--same", same,
                 "Also measure with one buffer reused per side (the 'same' rows, ucx_perftest's "
                 "setting) in the same run")
      ->capture_default_str();
  app.add_option("--json", json_path, "Write results as JSON to this file")
      ->check(kvpool::cli::OutputFile());
  KVPOOL_CLI_PARSE(app, argc, argv);

  const uint64_t max_size = *std::max_element(sizes_kib.begin(), sizes_kib.end()) << 10;
  const size_t ring_bytes = std::max<uint64_t>(ring_mib << 20, max_size);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) DieErrno("socketpair");
  const pid_t child = fork();
  if (child < 0) DieErrno("fork");
  if (child == 0) {
    close(sv[0]);
    std::_Exit(Target(sv[1], tls, ring_bytes));
  }
  close(sv[1]);

  nlohmann::json out;
  out["bench"] = "ucp_rotating_bench";
  out["version"] = kvpool::kVersion;
  out["git_sha"] = kvpool::kGitSha;
  out["ucx_tls"] = tls;
  out["ring_bytes_per_side"] = ring_bytes;
  out["iters"] = iters;
  out["warmup"] = warmup;
  out["in_flight"] = 1;
  {
    Ucp u(tls);
    Ring local(u.context, ring_bytes, 0xa5);
    const std::vector<uint8_t> addr = RecvBlob(sv[0]);
    const std::vector<uint8_t> packed = RecvBlob(sv[0]);
    uint64_t remote_base = 0;
    RecvAll(sv[0], &remote_base, sizeof(remote_base));
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(addr.data());
    ucp_ep_h ep = nullptr;
    Check(ucp_ep_create(u.worker, &ep_params, &ep), "ucp_ep_create");
    ucp_rkey_h rkey = nullptr;
    Check(ucp_ep_rkey_unpack(ep, packed.data(), &rkey), "ucp_ep_rkey_unpack");
    // When the transport maps the target's ring here (posix), fill this process's page tables
    // for it now, as kvpool's client does for its mapping of the pool.
    void* mapped = nullptr;
    out["remote_mapped"] = ucp_rkey_ptr(rkey, remote_base, &mapped) == UCS_OK;
    if (mapped != nullptr) {
      const uintptr_t lo = reinterpret_cast<uintptr_t>(mapped) & ~uintptr_t{4095};
      const uintptr_t hi = reinterpret_cast<uintptr_t>(mapped) + ring_bytes;
      if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE) != 0) {
        for (uintptr_t at = lo; at < hi; at += 4096) {
          (void)*reinterpret_cast<volatile uint8_t*>(at);
        }
      }
    }
    uint64_t op_index = 0;  // over every rotating operation of the run: no buffer is met twice
                            // within a ring
    std::printf(
        "%-8s %-6s %-4s %10s %9s %9s  (GB/s = bytes / mean latency; one operation in "
        "flight)\n",
        "size", "ring", "test", "GB/s", "p50 us", "p99 us");
    for (uint64_t kib : sizes_kib) {
      const uint64_t size = kib << 10;
      const uint64_t nbuf = ring_bytes / size;
      for (int rotate = 1; rotate >= (same ? 0 : 1); --rotate) {
        for (const char* test : {"put", "get"}) {
          const bool put = test[0] == 'p';
          std::vector<double> us;
          for (int it = 0; it < warmup + iters; ++it) {
            const uint64_t b = rotate ? (op_index++ % nbuf) : 0;
            void* lbuf = local.data + b * size;
            const uint64_t raddr = remote_base + b * size;
            ucp_request_param_t rp{};
            const auto t0 = std::chrono::steady_clock::now();
            if (put) {
              Wait(u.worker, ucp_put_nbx(ep, lbuf, size, raddr, rkey, &rp), "ucp_put_nbx");
              Wait(u.worker, ucp_ep_flush_nbx(ep, &rp), "ucp_ep_flush_nbx");
            } else {
              Wait(u.worker, ucp_get_nbx(ep, lbuf, size, raddr, rkey, &rp), "ucp_get_nbx");
            }
            const auto t1 = std::chrono::steady_clock::now();
            if (it >= warmup)
              us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          }
          const Stats s = Summarize(us);
          const double gbps = size / (s.mean_us * 1e3);
          std::printf("%-8s %-6s %-4s %10.3f %9.1f %9.1f\n", (std::to_string(kib) + "KiB").c_str(),
                      rotate ? "fresh" : "same", test, gbps, s.p50_us, s.p99_us);
          out["results"].push_back({{"bytes", size},
                                    {"ring", rotate ? "fresh" : "same"},
                                    {"test", test},
                                    {"buffers", rotate ? nbuf : 1},
                                    {"gbps", gbps},
                                    {"mean_us", s.mean_us},
                                    {"p50_us", s.p50_us},
                                    {"p99_us", s.p99_us}});
        }
      }
    }
    // The bytes really move: a page of a known pattern is put to the target and got back
    // into another (zeroed) page; a mismatch is a runtime error.
    {
      uint8_t* src = local.data;
      uint8_t* dst = local.data + 4096;
      for (int i = 0; i < 4096; ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
      std::memset(dst, 0, 4096);
      ucp_request_param_t rp{};
      Wait(u.worker, ucp_put_nbx(ep, src, 4096, remote_base, rkey, &rp), "check put");
      Wait(u.worker, ucp_ep_flush_nbx(ep, &rp), "check flush");
      Wait(u.worker, ucp_get_nbx(ep, dst, 4096, remote_base, rkey, &rp), "check get");
      if (std::memcmp(src, dst, 4096) != 0) {
        std::fprintf(stderr, "ucp_rotating_bench: a page put and got back differs\n");
        return kvpool::cli::kExitRuntime;
      }
      out["data_check"] = "a 4 KiB page put and got back byte-exact";
    }
    ucp_rkey_destroy(rkey);
    ucp_request_param_t cp{};
    cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t close_req = ucp_ep_close_nbx(ep, &cp);
    if (close_req != nullptr && !UCS_PTR_IS_ERR(close_req)) {
      while (ucp_request_check_status(close_req) == UCS_INPROGRESS) ucp_worker_progress(u.worker);
      ucp_request_free(close_req);
    }
  }
  close(sv[0]);  // the target stops progressing and exits
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << out.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "ucp_rotating_bench: --json: cannot write %s\n", json_path.c_str());
      return kvpool::cli::kExitRuntime;
    }
  }
  return kvpool::cli::kExitOk;
}
