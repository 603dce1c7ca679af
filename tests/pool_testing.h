// tests/pool_testing.h — helpers shared by the client and cross-component tests
// (client/tests/client_test.cc, tests/pool_integration_test.cc, tests/pool_put_helper.cc): a
// kvpool-server child process on a loopback port (only where KVPOOL_SERVER_BIN is defined),
// model specs with a Hadamard rotation file, random K/V sequences, the pool's CPU encoder as the
// oracle for stored bytes, registered page pools for fetches, a client factory and the
// fork/exec of child processes with their stdout on a pipe (servers and put helpers).
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvpool/client/client.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/kernels/rotation_file.h"
#include "kvpool/kvstore/encoder.h"

namespace kvpool::testing {

// A child process whose standard output is a pipe to this one.
struct Child {
  pid_t pid = -1;
  int out = -1;  // read end of the child's stdout; -1 when the spawn failed
};

// fork + execv(args[0], args): the child's stdout goes to Child::out, its stderr stays ours,
// and it keeps none of this process's other descriptors (UCX, gRPC sockets) past exec. On
// failure returns pid -1 (nothing to reap); an exec failure shows as exit status 127.
inline Child SpawnWithStdoutPipe(std::vector<std::string> args) {
  Child c;
  int out[2];
  if (pipe(out) != 0) return c;
  c.pid = fork();
  if (c.pid < 0) {
    close(out[0]);
    close(out[1]);
    return c;
  }
  if (c.pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    close_range(3, ~0u, 0);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(out[1]);
  c.out = out[0];
  return c;
}

#ifdef KVPOOL_SERVER_BIN
// A kvpool-server child process. Start() launches it on 127.0.0.1 (port 0 = any free port, read
// back from its "grpc_port=N" line) and returns once that line appeared (the server prints it
// when ready). Destruction kills it.
class ServerProcess {
 public:
  ServerProcess(std::string tls, std::vector<std::string> extra_flags)
      : tls_(std::move(tls)), extra_(std::move(extra_flags)) {}
  ~ServerProcess() { Kill(); }

  // Returns false (and sets error()) when the server did not become ready within 20 s.
  bool Start(int port = 0) {
    std::vector<std::string> args = {KVPOOL_SERVER_BIN,
                                     "--listen",
                                     absl::StrCat("127.0.0.1:", port),
                                     "--metrics-port",
                                     "-1",
                                     "--ucx-tls",
                                     tls_,
                                     "--tick-ms",
                                     "20",
                                     "--drain-ms",
                                     "0"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    // Reproductions: KVPOOL_ITEST_SERVER_FLAGS adds flags to every server, e.g.
    // "--transfer-initiator client" to run the kill tests against client-initiated tcp.
    if (const char* more = std::getenv("KVPOOL_ITEST_SERVER_FLAGS"); more != nullptr) {
      for (absl::string_view f : absl::StrSplit(more, ' ', absl::SkipEmpty())) {
        args.emplace_back(f);
      }
    }
    Child child = SpawnWithStdoutPipe(std::move(args));
    if (child.pid < 0) return Fail("pipe or fork failed");
    pid_ = child.pid;
    fd_ = child.out;
    // Read the ports line, bounded by poll().
    std::string line;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      pollfd pfd{fd_, POLLIN, 0};
      if (poll(&pfd, 1, 100) <= 0) continue;
      char c;
      if (read(fd_, &c, 1) != 1) break;
      if (c == '\n') break;
      line.push_back(c);
    }
    int p = 0, m = 0;
    if (std::sscanf(line.c_str(), "grpc_port=%d metrics_port=%d", &p, &m) < 1 || p <= 0) {
      Kill();
      return Fail(absl::StrCat("server did not report its port (got \"", line, "\")"));
    }
    port_ = p;
    return true;
  }

  // SIGKILL (no drain) and reap. Idempotent.
  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      int st;
      waitpid(pid_, &st, 0);
      pid_ = -1;
    }
    if (fd_ >= 0) {
      close(fd_);
      fd_ = -1;
    }
  }

  // True while the child runs (not exited or killed by a signal); reaps it when it has died.
  bool Alive() {
    if (pid_ <= 0) return false;
    int st;
    if (waitpid(pid_, &st, WNOHANG) == 0) return true;
    pid_ = -1;
    return false;
  }

  int port() const { return port_; }
  pid_t pid() const { return pid_; }  // -1 once killed or reaped
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  const std::string& error() const { return error_; }

 private:
  bool Fail(std::string e) {
    error_ = std::move(e);
    return false;
  }
  std::string tls_;
  std::vector<std::string> extra_;
  pid_t pid_ = -1;
  int fd_ = -1;
  int port_ = 0;
  std::string error_;
};
#endif  // KVPOOL_SERVER_BIN

inline constexpr uint32_t kLayers = 2, kHeads = 2, kDim = 64, kPage = 16;

inline BlockGeometry Geometry() { return BlockGeometry{kLayers, kHeads, kDim, kPage}; }

inline std::string HadamardRotationFile(const std::string& model_id, float ck, float cv) {
  RotationMetadata meta;
  meta.model_name = model_id;
  meta.head_dim = kDim;
  meta.num_layers = kLayers;
  meta.num_kv_heads = kHeads;
  meta.clip_ratio_k = ck;
  meta.clip_ratio_v = cv;
  auto rot = RotationSet::Hadamard(meta);
  return rot.ok() ? SerializeRotations(*rot) : std::string();
}

// sink 1 block, window 2 blocks.
inline client::ModelSpec Spec(const std::string& precision, const std::string& suffix = "") {
  client::ModelSpec s;
  s.model_id = "itest-" + precision + suffix;
  s.revision = "r1";
  s.num_layers = kLayers;
  s.num_kv_heads = kHeads;
  s.head_dim = kDim;
  s.page_size = kPage;
  s.sink_tokens = 16;
  s.recent_tokens = 32;
  s.history_precision = precision;
  s.rotation_file = HadamardRotationFile(s.model_id, s.clip_ratio_k, s.clip_ratio_v);
  return s;
}

inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

struct Sequence {
  std::vector<uint32_t> tokens;
  std::vector<std::vector<uint16_t>> k, v;  // [layer][tokens * heads * dim]
  std::vector<absl::Span<const uint16_t>> ks() const { return {k.begin(), k.end()}; }
  std::vector<absl::Span<const uint16_t>> vs() const { return {v.begin(), v.end()}; }
};

// K/V values depend only on (token position, token id prefix seed) so sequences sharing a
// token prefix share K/V for it (as a real model would).
inline Sequence MakeSequence(uint32_t num_tokens, uint32_t seed,
                             const std::vector<uint32_t>& prefix = {},
                             const Sequence* prefix_kv = nullptr) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  Sequence s;
  s.tokens = prefix;
  while (s.tokens.size() < num_tokens) s.tokens.push_back(rng() % 32000);
  const size_t row = size_t(kHeads) * kDim;
  for (uint32_t l = 0; l < kLayers; ++l) {
    s.k.emplace_back(num_tokens * row);
    s.v.emplace_back(num_tokens * row);
    for (size_t i = 0; i < num_tokens * row; ++i) {
      if (prefix_kv != nullptr && i < prefix.size() * row) {
        s.k[l][i] = prefix_kv->k[l][i];
        s.v[l][i] = prefix_kv->v[l][i];
      } else {
        s.k[l][i] = ToBf16(n(rng) * 2.f);
        s.v[l][i] = ToBf16(n(rng));
      }
    }
  }
  return s;
}

// The pool's CPU encoder applied to block b's staging bytes: the expected stored forms.
inline bool ExpectedForms(const Sequence& s, uint32_t b, const client::ModelSpec& spec,
                          std::vector<uint8_t>* bf16, std::vector<uint8_t>* int2) {
  BlockGeometry g = Geometry();
  auto rot = ParseRotations(spec.rotation_file);
  if (!rot.ok()) return false;
  std::vector<uint8_t> staging(g.Bf16FormBytes());
  for (uint32_t l = 0; l < kLayers; ++l) {
    client::PackLayerSlice(g, b, s.k[l].data(), s.v[l].data(),
                           staging.data() + l * g.Bf16LayerBytes());
  }
  bf16->assign(g.Bf16FormBytes(), 0);
  int2->assign(g.Int2FormBytes(), 0);
  kvstore::EncodeResult r;
  return kvstore::EncodeBlock(g, *rot, spec.clip_ratio_k, spec.clip_ratio_v, staging.data(),
                              bf16->data(), int2->data(), &r)
             .ok() &&
         r.int2_ok;
}

// Caller-registered page pools for `blocks` blocks of each form, and a fetch plan that puts
// block i (of either form) on page i. Movable only as a whole (the plan points into it).
// With `reverse_pages`, block i goes to page blocks-1-i instead (page ids differ from block
// indices).
struct FetchPools {
  std::vector<uint8_t> bf16_mem, int2_mem;
  client::PagePool bf16, int2;
  client::FetchPlan plan;

  static absl::StatusOr<std::unique_ptr<FetchPools>> Create(client::Client& c, uint32_t blocks,
                                                            bool reverse_pages = false) {
    auto p = std::make_unique<FetchPools>();
    BlockGeometry g = Geometry();
    p->bf16_mem.assign(blocks * g.Bf16FormBytes(), 0xCD);
    p->int2_mem.assign(blocks * g.Int2FormBytes(), 0xCD);
    auto rb = c.RegisterBuffer(p->bf16_mem.data(), p->bf16_mem.size());
    if (!rb.ok()) return rb.status();
    auto ri = c.RegisterBuffer(p->int2_mem.data(), p->int2_mem.size());
    if (!ri.ok()) return ri.status();
    p->bf16 = {*rb, g.Bf16FormBytes()};
    p->int2 = {*ri, g.Int2FormBytes()};
    p->plan.bf16_pool = &p->bf16;
    p->plan.int2_pool = &p->int2;
    for (uint32_t i = 0; i < blocks; ++i) {
      const auto page = static_cast<int32_t>(reverse_pages ? blocks - 1 - i : i);
      p->plan.bf16_pages.push_back(page);
      p->plan.int2_pages.push_back(page);
    }
    return p;
  }
};

// A client of the pool at `server` ("host:port") over UCX `tls`, 20 s default deadline; null
// (with the status in *error when given) when it cannot be created.
inline std::unique_ptr<client::Client> NewClient(
    const std::string& server, const std::string& tls, bool check_finite = true,
    absl::Status* error = nullptr, bool map_shared_memory = true, int copy_threads = 0,
    uint64_t parallel_min_bytes = 64 << 10, bool report_corrupt_forms = true) {
  client::ClientOptions o;
  o.report_corrupt_forms = report_corrupt_forms;
  o.copy_threads = copy_threads;
  // With copy threads, BeginPut and Acquire also hold them awake through the RPC
  // (ClientOptions::copy_threads_prewake), so that path runs in every test with threads.
  if (copy_threads > 1) o.copy_threads_prewake = absl::Milliseconds(1);
  // The same floor for put layers, asynchronous puts and fetches (tests pass 0 to spread
  // everything: every WriteLayerAsync, and Client::Put, then runs on the copy threads).
  o.parallel_put_min_bytes = parallel_min_bytes;
  o.parallel_async_put_min_bytes = parallel_min_bytes;
  o.parallel_fetch_min_bytes = parallel_min_bytes;
  o.parallel_fetch_awake_min_bytes = parallel_min_bytes;
  o.server = server;
  o.ucx_tls = tls;
  o.default_timeout = absl::Seconds(20);
  o.check_finite = check_finite;
  o.map_shared_memory = map_shared_memory;
  auto c = client::Client::Create(o);
  if (!c.ok()) {
    if (error != nullptr) *error = c.status();
    return nullptr;
  }
  return *std::move(c);
}

}  // namespace kvpool::testing
