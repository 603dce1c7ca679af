// kvpool-worker — the prefill node, the decode worker and the in-process evaluation of the
// OSCAR mixed-precision KV path on the reference engine (docs/WORKER.md).
//
//   kvpool-worker --role prefill --pool 127.0.0.1:7070 --model m.gguf --rotations r.safetensors
//       --prompt-file a.txt --prompt-file b.txt
//   kvpool-worker --role decode  --pool 127.0.0.1:7070 --model m.gguf --rotations r.safetensors
//       --prompt-file a.txt --max-new-tokens 48 --report decode.json
//   kvpool-worker --role eval --model m.gguf --rotations r.safetensors --prompt-file a.txt
//       --report eval.json        # no pool: fp32 vs bf16/int2 x windows
//
// Standard output: the continuations (decode, eval) as text; logs go to standard error.
// Exit codes: 0 ok, 1 usage, 2 runtime error, 128 + signal when SIGTERM (143), SIGINT (130) or
// a closed standard output (SIGPIPE, 141)
// stopped the run (its report and metrics written: docs/WORKER.md "Stopping a worker").

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvpool/common/cli.h"
#include "kvpool/common/keys.h"
#include "kvpool/common/log.h"
#include "kvpool/common/process.h"
#include "kvpool/common/status_text.h"
#include "kvpool/engine/engine.h"
#include "kvpool/kernels/rotation_file.h"
#include "kvpool/worker/eval.h"
#include "kvpool/worker/mixed_kv_cache.h"
#include "kvpool/worker/pool_node.h"

namespace kw = kvpool::worker;
using nlohmann::json;

namespace {

// A registration that failed because no pool answered (UNAVAILABLE, except a client that shares no
// UCX transport with the pool; DEADLINE_EXCEEDED), not because the pool or this client refused.
bool PoolNotAnswering(const absl::Status& s) {
  return (absl::IsUnavailable(s) && !kvpool::client::NoSharedUcxTransport(s)) ||
         absl::IsDeadlineExceeded(s);
}

// A decode worker's fallback_reason when its registration failed with `s` (docs/WORKER.md).
std::string NoPoolReason(const absl::Status& s, bool stopped) {
  // Each failure is named for what happened (newcomer 20 F2: a missing shared UCX transport and
  // a call timeout both read "pool unreachable"). The client, not the pool, refuses a pool it
  // cannot use (e.g. one started with --data-plane none): say who refused.
  const char* what = stopped && absl::IsCancelled(s) ? "stopped during the registration: "
                     : kvpool::client::NoSharedUcxTransport(s)
                         ? "this worker's data plane cannot reach the pool's: "
                     : absl::IsDeadlineExceeded(s)
                         ? "no answer from the pool within --call-timeout-ms at start-up: "
                     : absl::IsUnavailable(s) || absl::IsCancelled(s)
                         ? "pool unreachable at start-up: "
                     : kvpool::client::RefusedByClient(s)
                         ? "this worker refused the pool (the pool accepted the registration): "
                         : "pool refused the registration: ";
  return absl::StrCat(what, kvpool::StatusText(s));
}

struct Prompt {
  std::string path;  // the --prompt-file it came from
  std::string name;
  std::string text;
  std::vector<int> tokens;
};

std::string BaseName(const std::string& path) {
  std::string b = path.substr(path.find_last_of('/') + 1);
  const size_t dot = b.rfind('.');
  return dot == std::string::npos ? b : b.substr(0, dot);
}

// Agreement and perplexity ratio are undefined over no position (e.g. --max-new-tokens 0, or
// a reference that stopped at once): null, not the neutral 1.0 a reader would take for a match.
json TfJson(const kw::TeacherForcedResult& r) {
  const bool any = r.positions > 0;
  return json{{"positions", r.positions},
              {"matches", r.matches},
              {"agreement", any ? json(r.agreement()) : json(nullptr)},
              {"ppl_ratio", any ? json(r.ppl_ratio()) : json(nullptr)}};
}

// "0.906" or "n/a" (no position) for the text summary.
std::string Fixed(const kw::TeacherForcedResult& r, double v, int digits) {
  if (r.positions == 0) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::string Text(const kvpool::engine::Engine& e, const std::vector<int>& tokens) {
  return e.tokenizer().Decode(tokens);
}

// A fatal error ends the run: printed to stderr whatever --log-level says (off included), as
// kvpool and kvpool-engine do.
int Fail(const absl::Status& s, const std::string& what) {
  std::fprintf(stderr, "kvpool-worker: %s: %s\n", what.c_str(), kvpool::StatusText(s).c_str());
  return kvpool::cli::kExitRuntime;
}

// A usage error found after parsing (needs the model or a file's content): exit 1, printed
// whatever --log-level says.
int Usage(const std::string& message) {
  std::fprintf(stderr, "kvpool-worker: %s\n", message.c_str());
  return kvpool::cli::kExitUsage;
}

// SIGTERM/SIGINT: the handler records the signal; each role stops taking new prompts, aborts
// its open puts, writes the report and metrics of what completed and exits 128 + the signal
// (docs/WORKER.md "Stopping a worker"). The handler also wakes the stop watcher (a byte on
// g_stop_pipe), which cancels the pool calls still unanswered kStopGrace later (a registration
// or BeginPut waiting for a pool that does not answer held the stop for the whole call timeout:
// newcomer s9b #3, #4). A second signal ends the process at once, without the report: the
// watcher first sends AbortPut for the puts still open, waiting at most kAtOnceAbortWait for the
// pool's answers (they stayed open until the pool's put timeout: newcomer s9b #9), then the
// signal's default action ends the process; a third signal ends it even while that runs.
volatile std::sig_atomic_t g_stop_signal = 0;  // the first signal
volatile std::sig_atomic_t g_last_signal = 0;
volatile std::sig_atomic_t g_signals = 0;  // how many arrived
int g_stop_pipe[2] = {-1, -1};

// Calls a healthy pool answers within milliseconds (a commit that is under way when the signal
// comes) are left this long to finish before they are cancelled: a CommitPut cancelled in
// flight may still commit, so the worker could not tell whether the prompt was stored.
constexpr std::chrono::milliseconds kStopGrace{250};
// How long the second signal's AbortPuts may take before the process ends.
constexpr absl::Duration kAtOnceAbortWait = absl::Milliseconds(300);

// The client whose open puts the second signal aborts (null: none); g_at_once_mu is held while
// they are aborted and while the client is set or cleared, so it is never used once destroyed.
std::mutex g_at_once_mu;
kvpool::client::Client* g_at_once_client = nullptr;

// What the run has done so far, for the second signal's line (every role says what it
// stopped: newcomer s10b F5, a decode worker printed nothing). Set by the main thread as prompts
// complete; read by the stop watcher.
std::atomic<const char*> g_role{""};
std::atomic<size_t> g_prompts_done{0};
std::atomic<size_t> g_prompts_total{0};
// Decode: whether the request under way holds a lease (NodeOptions::lease_held), for the second
// signal's line (newcomer 11b F4: it said a lease expires while none was held).
std::atomic<bool> g_lease_held{false};

extern "C" void OnHangupSignal(int) {
  const int saved_errno = errno;
  static constexpr char kLine[] =
      "kvpool-worker: SIGHUP ignored; SIGTERM or SIGINT stops the run\n";
  (void)!::write(STDERR_FILENO, kLine, sizeof(kLine) - 1);  // async-signal-safe
  errno = saved_errno;
}

extern "C" void OnStopSignal(int sig) {
  const int saved_errno = errno;
  const int n = g_signals + 1;
  g_signals = n;  // both signals are blocked while the handler runs (sa_mask)
  if (n == 1) g_stop_signal = sig;
  g_last_signal = sig;
  if (n >= 3 || (n >= 2 && g_stop_pipe[1] < 0)) {
    ::signal(sig, SIG_DFL);  // async-signal-safe, as raise
    ::raise(sig);
  }
  const char b = 1;
  if (g_stop_pipe[1] >= 0) (void)!::write(g_stop_pipe[1], &b, 1);  // async-signal-safe
  errno = saved_errno;
}

// The second signal: abort the open puts (bounded), then end the process by the signal.
[[noreturn]] void ExitAtOnce() {
  const int sig = g_last_signal;
  {
    std::lock_guard<std::mutex> lock(g_at_once_mu);
    const std::string role = g_role.load();
    const size_t done = g_prompts_done.load(), total = g_prompts_total.load();
    std::string what;
    if (role == "prefill") {
      what = absl::StrCat("prefill: ", done, " of ", total, " prompt(s) stored");
      if (g_at_once_client != nullptr) {
        const kvpool::client::Client::OpenPutAborts a =
            g_at_once_client->AbortOpenPutsNow(kAtOnceAbortWait);
        absl::StrAppend(&what, "; ", a.aborted, " of ", a.open, " open put(s) aborted");
        if (a.aborted < a.open) {
          absl::StrAppend(&what, " (the pool did not answer the others within ",
                          absl::ToInt64Milliseconds(kAtOnceAbortWait),
                          " ms: it frees their staging at its put timeout)");
        }
      }
    } else if (role == "decode") {
      what = absl::StrCat("decode: ", done, " of ", total,
                          " request(s) served; the one under way is dropped",
                          g_lease_held.load() ? " (the lease it holds expires at its lease time)"
                                              : " (it holds no lease)");
    } else if (role == "eval") {
      what = absl::StrCat("eval: ", done, " of ", total,
                          " prompt(s) run; the one under way is dropped");
    } else {
      what = "before any prompt ran";
    }
    std::fprintf(stderr, "kvpool-worker: second %s: exiting at once, without the report (%s)\n",
                 sig == SIGINT ? "SIGINT" : "SIGTERM", what.c_str());
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
  std::_Exit(128 + sig);  // not reached: the default action of SIGTERM/SIGINT ends the process
}

const char* SignalName(int sig);

// The first signal's line, at once (newcomer 11b F3: nothing was printed until the stop ended,
// which invited the second, report-losing signal): what the stop waits for, and what a second
// signal costs. Printed whatever --log-level says.
void FirstSignalLine() {
  const int sig = g_stop_signal;
  const std::string role = g_role.load();
  const char* waits =
      role == "prefill"
          ? "no new prompt starts; the prompt being computed finishes, the open puts are aborted"
      : role == "decode" ? "no new request starts; the one under way finishes"
      : role == "eval"   ? "no new prompt starts; the one under way finishes"
                         : "the start-up is stopped";
  std::fprintf(stderr,
               "kvpool-worker: %s: stopping: %s, then the report and metrics are written (a "
               "second SIGTERM or SIGINT exits at once, without them)\n",
               SignalName(sig), waits);
}

// Installs the handlers and starts the stop watcher; returns the token it cancels kStopGrace
// after the first signal (at once after a second), passed to the pool calls that may wait for
// an unresponsive pool.
std::shared_ptr<kvpool::client::CancelToken> InstallStopHandlers() {
  auto token = std::make_shared<kvpool::client::CancelToken>();
  if (::pipe2(g_stop_pipe, O_CLOEXEC) == 0) {
    ::fcntl(g_stop_pipe[1], F_SETFL, O_NONBLOCK);  // the handler never blocks
    std::thread([token] {
      auto next_signal = [](int timeout_ms) {  // true: a byte arrived within timeout_ms
        pollfd p{g_stop_pipe[0], POLLIN, 0};
        int r;
        while ((r = ::poll(&p, 1, timeout_ms)) < 0 && errno == EINTR) {
        }
        char b;
        return r > 0 && ::read(g_stop_pipe[0], &b, 1) == 1;
      };
      while (!next_signal(-1)) {
      }
      FirstSignalLine();
      const bool second = next_signal(static_cast<int>(kStopGrace.count()));
      token->Cancel();
      if (!second) {
        while (!next_signal(-1)) {
        }
      }
      ExitAtOnce();
    }).detach();
  }
  // SIGHUP is logged and ignored, as by kvpool-server: UCX's default UCX_DEBUG_SIGNO=HUP
  // otherwise turned a hangup (a closed terminal) into UCX debug logging for the rest of the
  // run, whatever --log-level said (newcomer 14 F3).
  struct sigaction hup {};
  hup.sa_handler = OnHangupSignal;
  sigemptyset(&hup.sa_mask);
  hup.sa_flags = SA_RESTART;
  sigaction(SIGHUP, &hup, nullptr);
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGTERM);
  sigaddset(&sa.sa_mask, SIGINT);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);  // a closed stdout: FlushStdout
  return token;
}

// Makes `client` the one the second signal aborts the open puts of, until destroyed.
class AtOnceClient {
 public:
  explicit AtOnceClient(kvpool::client::Client* client) {
    std::lock_guard<std::mutex> lock(g_at_once_mu);
    g_at_once_client = client;
  }
  ~AtOnceClient() {
    std::lock_guard<std::mutex> lock(g_at_once_mu);
    g_at_once_client = nullptr;
  }
  AtOnceClient(const AtOnceClient&) = delete;
  AtOnceClient& operator=(const AtOnceClient&) = delete;
};

// The stop signal received so far; 0 when none.
int StopSignal() { return g_stop_signal; }

const char* SignalName(int sig) {
  return sig == SIGINT ? "SIGINT" : sig == SIGPIPE ? "SIGPIPE" : "SIGTERM";
}

// Flushes standard output (each answer as it completes). A reader that went away (a pipe into
// `head -1`) stops the run like SIGTERM, as if by SIGPIPE (128 + 13 = 141), with the report and
// metrics of what completed: SIGPIPE is ignored, so the write fails with EPIPE instead of
// killing the worker silently with neither (newcomer s10 F2).
void FlushStdout() {
  if ((std::fflush(stdout) != 0 || std::ferror(stdout)) && g_stop_signal == 0) {
    g_stop_signal = SIGPIPE;
  }
}

// Marks the report of a run that a stop signal ended (nothing when `sig` is 0).
void NoteInterrupted(nlohmann::json& out, int sig) {
  out["interrupted"] = sig != 0;
  if (sig != 0) out["interrupt_signal"] = SignalName(sig);
}

// The end of a run a stop signal ended: one line whatever --log-level says, exit 128 + signal.
// The report and metrics are written by then. The process ends here, without tearing down the
// client: with a pool that stopped answering (SIGSTOP), UCX 1.13 asserted in ucp_worker_destroy
// on a wireup reply still pending toward that pool (SIGABRT, exit 134 instead of 143: newcomer
// s10 F1); the OS closes the connections.
[[noreturn]] void Interrupted(int sig, const std::string& what) {
  std::fprintf(stderr, "kvpool-worker: stopped by %s%s: %s\n", SignalName(sig),
               sig == SIGPIPE ? " (standard output was closed)" : "", what.c_str());
  std::fflush(nullptr);
  std::_Exit(128 + sig);
}

// One counter of --metrics-file.
struct Counter {
  const char* name;
  const char* help;
  uint64_t value;
};

// Prometheus text exposition of `counters`: HELP, TYPE and value of each (promtool check metrics
// wants the HELP line; newcomer s7 F9 found three counters without one).
std::string PrometheusCounters(const std::vector<Counter>& counters) {
  std::ostringstream m;
  for (const Counter& c : counters) {
    m << "# HELP " << c.name << " " << c.help << "\n"
      << "# TYPE " << c.name << " counter\n"
      << c.name << " " << c.value << "\n";
  }
  return m.str();
}

// Writes the report (none when `path` is empty), atomically and through a symbolic link
// (kvpool::cli::WriteOutputFile).
absl::Status WriteJson(const std::string& path, const json& j) {
  if (path.empty()) {
    return absl::OkStatus();
  }
  return kvpool::cli::WriteOutputFile(path, j.dump(2) + "\n");
}

// Writes the --metrics-file `metrics_text` (when `metrics_file` is not empty) and the --report
// `out` (when `report` is not empty), each atomically; the second is written whatever became of
// the first (newcomer report 11 F5: a --metrics-file on a full disk skipped --report, whose disk
// had room, without a word). Each failure is printed (Fail's line, naming the flag and the
// error); when one output failed and the other was written, a line says which one was. Returns
// 0, or kExitRuntime when either failed.
int WriteOutputs(const std::string& metrics_file, const std::string& metrics_text,
                 const std::string& report, const json& out) {
  std::vector<std::string> written, failed;
  if (!metrics_file.empty()) {
    if (auto s = kvpool::cli::WriteOutputFile(metrics_file, metrics_text); !s.ok()) {
      Fail(s, "--metrics-file");
      failed.push_back("--metrics-file");
    } else {
      written.push_back(absl::StrCat("--metrics-file '", metrics_file, "'"));
    }
  }
  if (!report.empty()) {
    if (auto s = WriteJson(report, out); !s.ok()) {
      Fail(s, "--report");
      failed.push_back("--report");
    } else {
      written.push_back(absl::StrCat("--report '", report, "'"));
    }
  }
  if (failed.empty()) return kvpool::cli::kExitOk;
  if (!written.empty()) {
    std::fprintf(stderr, "kvpool-worker: %s written; exit %d because %s failed\n",
                 absl::StrJoin(written, " and ").c_str(), kvpool::cli::kExitRuntime,
                 absl::StrJoin(failed, " and ").c_str());
  }
  return kvpool::cli::kExitRuntime;
}

// A non-negative decimal integer as the integer flags take one (kvpool::cli::Range): digits
// only, no sign, space, hex or leading zero ("+256" and "0256" passed SimpleAtoi: newcomer s9b
// #7), and within int.
bool ParseDecimal(absl::string_view v, int* out) {
  if (v.empty() || v.find_first_not_of("0123456789") != absl::string_view::npos ||
      (v.size() > 1 && v[0] == '0')) {
    return false;
  }
  return absl::SimpleAtoi(v, out);
}

// The --fault hooks that signal the pool's process (--fault-pool-pid).
bool NeedsPoolPid(kw::Fault f) {
  return f == kw::Fault::kKillPoolMidFetch || f == kw::Fault::kStopPoolAfterRegister ||
         f == kw::Fault::kKillPoolAfterFirstCommit;
}

// 0 when `pid` is the process of the pool `client` reaches (StatsResponse.pool_pid, protocol
// v1.6); else prints why and returns kExitUsage: the pool does not answer Stats, is older than
// v1.6 (reports no pid), or reports another pid. The pids compare only on the pool's host, in
// one pid namespace, as the hooks signal a local process anyway.
int CheckFaultPoolPid(kvpool::client::Client& client, const std::string& pool,
                      const std::string& fault, int pid,
                      const std::shared_ptr<kvpool::client::CancelToken>& cancel) {
  absl::StatusOr<kvpool::client::PoolStats> st = client.Stats({.cancel = cancel});
  std::string why;
  if (!st.ok()) {
    why = absl::StrCat("cannot check that it is the pool at ", pool,
                       " (Stats: ", kvpool::StatusText(st.status()), ")");
  } else if (st->pool_pid == 0) {
    why = absl::StrCat("cannot check that it is the pool at ", pool,
                       ": that pool reports no pid (a kvpool-server from before protocol v1.6)");
  } else if (static_cast<int64_t>(st->pool_pid) != pid) {
    why = absl::StrCat("is not the pool at ", pool, " (that pool's pid is ", st->pool_pid, ")");
  } else {
    return 0;
  }
  std::fprintf(stderr,
               "kvpool-worker: --fault-pool-pid: %d %s: %s signals only the pool under test "
               "(--pool)\n",
               pid, why.c_str(), fault.c_str());
  return kvpool::cli::kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvpool-worker — prefill node, decode worker and in-process evaluation"};
  kvpool::cli::Setup(app, "kvpool-worker");
  std::string role, pool = "127.0.0.1:7070", model, rotations_path, ucx_tls = "tcp";
  std::string model_id, revision = "auto", history = "int2", report, fault = "none";
  std::string windows = "64:256,16:16";
  std::vector<std::string> prompt_files;
  int max_new = 48, page_size = 16, sink = 64, recent = 256, fault_pool_pid = 0;
  int put_timeout_ms = 0, call_timeout_ms = 10000;
  bool teacher_force = true;
  app.add_option("--role", role, "prefill | decode | eval")
      ->required()
      ->check(CLI::IsMember({"prefill", "decode", "eval"}));
  app.add_option("--pool", pool, "gRPC address of the pool (HOST:PORT)")
      ->capture_default_str()
      ->check(kvpool::cli::HostPortAddress(1));
  // Input files: a directory, a device, a FIFO or a file above the size limit is a usage error
  // naming the flag (kvpool::cli::InputFile; docs/TOOLS.md "Input files").
  CLI::Option* model_opt = app.add_option("--model", model, "GGUF model file")
                               ->required()
                               ->check(kvpool::cli::InputFile(kvpool::cli::kMaxModelFileBytes));
  CLI::Option* rotations_opt =
      app.add_option("--rotations", rotations_path, "OSCAR rotation file (safetensors)")
          ->required()
          ->check(kvpool::cli::InputFile(kvpool::cli::kMaxRotationFileBytes));
  CLI::Option* prompts_opt =
      app.add_option("--prompt-file", prompt_files, "a prompt text file (repeatable)")
          ->required()
          ->check(kvpool::cli::InputFile(kvpool::cli::kMaxTextFileBytes));
  app.add_option("--max-new-tokens", max_new, "tokens to generate per prompt")
      ->capture_default_str()
      ->check(kvpool::cli::Range(0, 4096));
  // Ranges (newcomer 16 F2: without one CLI11 read "--recent-tokens 0100" as octal 64 and took
  // "0x10" and "+16"): the bounds the cache checks later (a page size up to 1024 tokens, S and W
  // up to 2^24, the longest context the GGUF reader takes); the cache then names what else is
  // wrong (a page size that is not a power of two, S not a multiple of it, S or W beyond the
  // model's context).
  app.add_option(
         "--page-size", page_size,
         "tokens per block (a power of two; prefill and decode: at most the model's context)")
      ->capture_default_str()
      ->check(kvpool::cli::Range(1, 1024));
  app.add_option("--sink-tokens", sink, "prefill/decode: S, sink tokens kept in BF16")
      ->capture_default_str()
      ->check(kvpool::cli::Range(0, 1 << 24));
  app.add_option("--recent-tokens", recent, "prefill/decode: W, recent tokens kept in BF16")
      ->capture_default_str()
      ->check(kvpool::cli::Range(0, 1 << 24));
  app.add_option("--history-precision", history, "int2 | bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"int2", "bf16"}));
  // The default was "stories260K" whatever --model loaded (newcomer report s6 #10); the file's
  // stem is what `kvpool calibrate` records as the rotation file's model_name.
  app.add_option("--model-id", model_id,
                 "model id registered with the pool (default: the --model file's name without "
                 "its extension, e.g. stories260K-f32); not empty")
      // An explicit "" (command line or --config) fell back to the default silently (newcomer
      // s8 N3); it is refused like --revision "".
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            return v.empty() ? "must not be empty (omit --model-id for the --model file's name)"
                             : std::string();
          },
          "TEXT"));
  app.add_option("--revision", revision,
                 "registered revision; 'auto' = model hash + recipe (P, S, W, precision, clip "
                 "ratios) + rotation id. An explicit revision asserts the weights: the pool "
                 "does not compare them, so every worker using it must load the same model file")
      ->capture_default_str();
  app.add_option("--ucx-tls", ucx_tls, "UCX transports of the data plane")->capture_default_str();
  app.add_option("--put-timeout-ms", put_timeout_ms,
                 "prefill: how long a put may stay open between BeginPut and Commit before the "
                 "pool drops it; 0 = the pool's --put-timeout-ms; the pool caps it at the larger "
                 "of 10 min and its own --put-timeout-ms (a warning says so)")
      ->capture_default_str()
      ->check(kvpool::cli::Range(0, 3600000));
  app.add_option("--call-timeout-ms", call_timeout_ms,
                 "timeout of each pool call (registration, lookup, lease, fetch, "
                 "each call of a put), counted from that call's start; prefill: also how long "
                 "the prompts wait, per outage, for a pool found unreachable to come back (a put "
                 "open when it went away is then put again), and how long a prompt waits for room "
                 "that other puts' staging or leases hold in the pool (once per shortage: after "
                 "a prompt waited this long in vain, the later ones fail at once until a commit "
                 "succeeds)")
      ->capture_default_str()
      ->check(kvpool::cli::Range(1, 3600000));
  CLI::Option* report_opt = app.add_option("--report", report, "write a JSON report to this file")
                                ->check(kvpool::cli::OutputFile());
  std::string metrics_file;
  CLI::Option* metrics_opt =
      app.add_option("--metrics-file", metrics_file,
                     "decode/prefill: write counters in Prometheus text format to this file")
          ->check(kvpool::cli::OutputFile());
  app.add_option("--eval-windows", windows,
                 "eval: the S:W pairs compared, comma-separated (instead of --sink-tokens "
                 "and --recent-tokens)")
      ->capture_default_str();
  app.add_option("--teacher-force", teacher_force,
                 "decode: also compute the fp32 reference and teacher-forced agreement")
      ->default_str(teacher_force ? "true" : "false");  // as WORKER.md writes it, not "1"
  // Checked by the flag (newcomer s14 #2), so a --config file's bad value is named with the file
  // and its key, and --help lists the choices (kw::ParseFault's names).
  app.add_option("--fault", fault, "test hook (none = no fault)")
      ->check(CLI::IsMember({"none", "prefill-exit-mid-push", "kill-pool-mid-fetch",
                             "stop-pool-after-register", "kill-pool-after-first-commit",
                             "commit-answer-lost"}))
      ->capture_default_str();
  app.add_option("--fault-pool-pid", fault_pool_pid,
                 "pid of the pool for kill-pool-mid-fetch, stop-pool-after-register and "
                 "kill-pool-after-first-commit (must be the pid the pool at --pool reports: "
                 "a kvpool-server on this host)")
      ->check(kvpool::cli::Range(0, INT32_MAX));
  // An output that is one of the inputs (or the other output) would replace it (newcomer s7 F7).
  kvpool::cli::RefuseSameFiles(&app, {{report_opt}, {metrics_opt}},
                               {{model_opt}, {rotations_opt}, {prompts_opt}});
  KVPOOL_CLI_PARSE(app, argc, argv);
  const std::shared_ptr<kvpool::client::CancelToken> stop_token = InstallStopHandlers();
  const bool model_id_default = model_id.empty();
  if (model_id_default) model_id = std::filesystem::path(model).stem().string();
  const bool pool_role = role != "eval";
  // The pool takes 1-256 printable ASCII bytes for each identity field (docs/PROTOCOL.md
  // "Registration"); check before any work, naming where a default came from (a --model file
  // named "my model ü.gguf" failed at the registration, exit 2, or made decode fall back
  // silently: newcomer s10 F5).
  for (const auto& [flag, value, derived] :
       {std::tuple<const char*, const std::string&, bool>{"--model-id", model_id, model_id_default},
        {"--revision", revision, false}}) {
    if (!pool_role || value == "auto") continue;
    std::string bad;
    if (value.size() > kvpool::kMaxIdentityBytes) {
      bad = absl::StrCat("is ", value.size(), " bytes long (at most ", kvpool::kMaxIdentityBytes,
                         ")");
    } else if (const size_t i = kvpool::FirstNonPrintableAscii(value); i != std::string::npos) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02x", static_cast<unsigned char>(value[i]));
      bad = absl::StrCat("has byte ", i, " (", hex, "), which is not printable ASCII (0x20..0x7e)");
    }
    if (!bad.empty()) {
      return Usage(absl::StrCat(flag, ": '", value, "' ",
                                derived ? "(the default: the --model file's name without "
                                          "its extension) "
                                        : "",
                                bad, "; the pool takes 1-256 printable ASCII bytes",
                                derived ? ": give --model-id" : ""));
    }
  }

  auto fault_or = kw::ParseFault(fault);
  if (!fault_or.ok()) {
    std::fprintf(stderr, "kvpool-worker: --fault: %s\n",
                 std::string(fault_or.status().message()).c_str());
    return kvpool::cli::kExitUsage;
  }
  // eval ignores --fault and --fault-pool-pid (named in a warning below), so it checks neither.
  if (pool_role && NeedsPoolPid(*fault_or) && fault_pool_pid <= 0) {
    std::fprintf(stderr,
                 "kvpool-worker: --fault-pool-pid: %s needs the pool's pid (a positive integer)\n",
                 fault.c_str());
    return kvpool::cli::kExitUsage;
  }
  // The hooks SIGKILL/SIGSTOP that pid: only a kvpool-server's (a typo SIGKILLed an unrelated
  // `sleep`: newcomer s9 A8).
  // A cheap first check here, before any work; the pool confirms its pid once it is reached
  // (CheckFaultPoolPid).
  if (pool_role && NeedsPoolPid(*fault_or) &&
      !kvpool::ProcessRuns(fault_pool_pid, "kvpool-server")) {
    const std::optional<std::string> comm = kvpool::ProcessComm(fault_pool_pid);
    const std::string is = comm.has_value()
                               ? absl::StrCat("is '", *comm, "' (/proc/", fault_pool_pid, "/comm)")
                               : std::string("is no process of this host");
    std::fprintf(stderr,
                 "kvpool-worker: --fault-pool-pid: %d %s, not kvpool-server: %s signals only a "
                 "kvpool-server\n",
                 fault_pool_pid, is.c_str(), fault.c_str());
    return kvpool::cli::kExitUsage;
  }
  // Each role is checked on the flags it uses only: eval compares --eval-windows and ignores
  // --sink-tokens/--recent-tokens (their defaults refused --page-size 256: newcomer s9 A10);
  // prefill and decode ignore --eval-windows. A flag given explicitly (command line or
  // --config) to a role that ignores it is named in a warning (--metrics-file was ignored by
  // eval without one: newcomer s9b #5).
  const bool eval = role == "eval";
  struct RoleFlag {
    const char* flag;
    std::vector<std::string> roles;  // the roles that use it
    const char* why;                 // null: "it is for --role R"
  };
  const std::vector<RoleFlag> role_flags = {
      {"--sink-tokens", {"prefill", "decode"}, "eval compares the S:W pairs of --eval-windows"},
      {"--recent-tokens", {"prefill", "decode"}, "eval compares the S:W pairs of --eval-windows"},
      {"--eval-windows", {"eval"}, "--eval-windows is for --role eval"},
      {"--history-precision", {"prefill", "decode"}, "eval compares bf16 and int2 history"},
      {"--max-new-tokens", {"decode", "eval"}, "a prefill node generates no token"},
      {"--teacher-force", {"decode"}, nullptr},
      {"--pool", {"prefill", "decode"}, nullptr},
      {"--model-id", {"prefill", "decode"}, nullptr},
      {"--revision", {"prefill", "decode"}, nullptr},
      {"--ucx-tls", {"prefill", "decode"}, nullptr},
      {"--call-timeout-ms", {"prefill", "decode"}, nullptr},
      {"--put-timeout-ms", {"prefill"}, nullptr},
      {"--metrics-file", {"prefill", "decode"}, nullptr},
      {"--fault", {"prefill", "decode"}, nullptr},
      {"--fault-pool-pid", {"prefill", "decode"}, nullptr},
  };
  for (const RoleFlag& f : role_flags) {
    if (app.get_option(f.flag)->count() == 0 ||
        std::find(f.roles.begin(), f.roles.end(), role) != f.roles.end()) {
      continue;
    }
    KVPOOL_LOG_WARN("{} is ignored by --role {} ({})", f.flag, role,
                    f.why != nullptr
                        ? std::string(f.why)
                        : absl::StrCat("it is for --role ", absl::StrJoin(f.roles, " and ")));
  }
  std::vector<std::pair<int, int>> wins;  // --eval-windows, checked before any work
  const std::vector<std::string> window_list =
      eval ? absl::StrSplit(windows, ',') : std::vector<std::string>{};
  for (absl::string_view w : window_list) {
    std::vector<std::string> sw = absl::StrSplit(w, ':');
    int s = 0, r = 0;
    if (sw.size() != 2 || !ParseDecimal(sw[0], &s) || !ParseDecimal(sw[1], &r)) {
      std::fprintf(stderr,
                   "kvpool-worker: --eval-windows: '%s' is not S:W (two non-negative decimal "
                   "integers: digits only, no sign, no leading zero)\n",
                   std::string(w).c_str());
      return kvpool::cli::kExitUsage;
    }
    // Each pair is one entry of the report ("int2_S64_W256"): a repeat wrote the key twice into
    // one JSON object (newcomer s7 F8).
    if (std::find(wins.begin(), wins.end(), std::pair<int, int>(s, r)) != wins.end()) {
      std::fprintf(stderr,
                   "kvpool-worker: --eval-windows: %d:%d is given twice ('%s'); give each S:W "
                   "pair once\n",
                   s, r, windows.c_str());
      return kvpool::cli::kExitUsage;
    }
    wins.emplace_back(s, r);
  }
  if (revision.empty()) {
    std::fprintf(stderr, "kvpool-worker: --revision: must not be empty (use 'auto')\n");
    return kvpool::cli::kExitUsage;
  }
  auto t_start = std::chrono::steady_clock::now();
  auto engine_or = kvpool::engine::Engine::Create(model);
  if (!engine_or.ok()) {
    return Fail(engine_or.status(), "--model");
  }
  auto& engine = **engine_or;
  const auto& cfg = engine.config();
  // Generation stops when the context is full; say so, as kvpool-engine does (newcomer report 13
  // F8: a 510-token prompt with --max-new-tokens 100 gave 2 tokens and no word about it).
  auto context_full = [&](size_t prompt, size_t generated) {
    return generated < static_cast<size_t>(std::max(max_new, 0)) &&
           prompt + generated >= static_cast<size_t>(cfg.context_length);
  };
  auto warn_if_context_full = [&](const std::string& name, size_t prompt, size_t generated) {
    if (!context_full(prompt, generated)) return;
    KVPOOL_LOG_WARN(
        "{}: generated {} of --max-new-tokens {}: the context is full ({} prompt tokens, the "
        "model's context is {} tokens)",
        name, generated, max_new, prompt, cfg.context_length);
  };
  auto rot_bytes = kvpool::cli::ReadInputFile(rotations_path, kvpool::cli::kMaxRotationFileBytes);
  if (!rot_bytes.ok()) {
    return Fail(rot_bytes.status(), "--rotations");
  }
  auto rot_or = kvpool::ParseRotations(*rot_bytes);
  if (!rot_or.ok()) {
    return Fail(rot_or.status(), "--rotations '" + rotations_path + "'");
  }
  kvpool::ExpectedRotationModel expected;
  expected.head_dim = static_cast<uint32_t>(cfg.head_dim);
  expected.num_layers = static_cast<uint32_t>(cfg.n_layers);
  expected.num_kv_heads = static_cast<uint32_t>(cfg.n_kv_heads);
  if (auto s = kvpool::CheckRotationsMatch(*rot_or, expected); !s.ok()) {
    return Fail(s, "--rotations '" + rotations_path + "'");
  }
  if (const std::string note =
          kvpool::RotationModelNameMismatch(*rot_or, std::filesystem::path(model).stem().string());
      !note.empty()) {
    KVPOOL_LOG_WARN("--rotations '{}': {}", rotations_path, note);
  }
  auto rotations = std::make_shared<const kvpool::RotationSet>(std::move(rot_or).value());

  // Checked before the recipe (newcomer 18 F5: --page-size 1024 with the default sink was told
  // "--sink-tokens: sink_tokens 64 must be a non-negative multiple of page_size 1024").
  // S and W beyond the context would never apply (the cache holds context_length tokens); a
  // block longer than the context is never full, so nothing would reach the pool (newcomer 17
  // F6: --page-size 1024 on a 512-token model ran with "0/0 blocks from the pool" everywhere).
  for (const auto& [flag, value] : {std::pair<const char*, int>{"--sink-tokens", sink},
                                    {"--recent-tokens", recent},
                                    {"--page-size", page_size}}) {
    if (!eval && value > cfg.context_length) {
      std::fprintf(stderr, "kvpool-worker: %s: %d exceeds the model's context of %d tokens\n", flag,
                   value, cfg.context_length);
      return kvpool::cli::kExitUsage;
    }
  }
  kw::MixedCacheOptions copts;
  copts.page_size = page_size;
  // eval sets S and W per --eval-windows pair (checked below); 0:0 checks the rest of the recipe.
  copts.sink_tokens = eval ? 0 : sink;
  copts.recent_tokens = eval ? 0 : recent;
  copts.history = kw::ParseHistoryPrecision(history).value();
  copts.clip_ratio_k = rotations->metadata().clip_ratio_k;
  copts.clip_ratio_v = rotations->metadata().clip_ratio_v;
  copts.capacity = cfg.context_length;
  // Validate the recipe once (same checks the cache applies).
  if (auto c = kw::MixedKvCache::Create(cfg.n_layers, cfg.attention(), rotations, copts); !c.ok()) {
    const std::string msg(c.status().message());
    // The cache names its field (page_size, sink_tokens, ...): name the flag that sets it.
    std::string flag = "recipe";
    for (const auto& [field, name] :
         {std::pair<const char*, const char*>{"page_size", "--page-size"},
          {"sink_tokens", "--sink-tokens"},
          {"recent_tokens", "--recent-tokens"},
          {"capacity", "--model (context length)"},
          {"clip_ratio", "--rotations (clip ratios)"}}) {
      if (absl::StartsWith(msg, field)) {
        flag = name;
        break;
      }
    }
    std::fprintf(stderr, "kvpool-worker: %s: %s\n", flag.c_str(), msg.c_str());
    return kvpool::cli::kExitUsage;
  }

  if (role == "eval") {
    for (auto [s, w] : wins) {
      kw::MixedCacheOptions o = copts;
      o.sink_tokens = s;
      o.recent_tokens = w;
      absl::Status bad;
      if (s > cfg.context_length || w > cfg.context_length) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("exceeds the model's context of ", cfg.context_length, " tokens"));
      } else if (auto c = kw::MixedKvCache::Create(cfg.n_layers, cfg.attention(), rotations, o);
                 !c.ok()) {
        bad = c.status();
      }
      if (!bad.ok()) {
        std::fprintf(stderr, "kvpool-worker: --eval-windows: %d:%d: %s\n", s, w,
                     std::string(bad.message()).c_str());
        return kvpool::cli::kExitUsage;
      }
    }
  }

  std::vector<Prompt> prompts;
  for (const auto& f : prompt_files) {
    auto text = kvpool::cli::ReadInputFile(f, kvpool::cli::kMaxTextFileBytes);
    if (!text.ok()) {
      return Fail(text.status(), "--prompt-file");
    }
    // Each token covers at most max_piece_bytes of the text (Tokenizer::max_piece_bytes), so
    // BOS + ceil(bytes / L) tokens is a sound lower bound: a file it puts at the context or
    // beyond is refused before tokenizing it (a 30 MB prompt took 28 s and 1.2 GB to be
    // refused: newcomer s9 A3).
    const size_t piece_bytes = engine.tokenizer().max_piece_bytes();
    const size_t min_tokens = 1 + (text->size() + piece_bytes - 1) / piece_bytes;
    if (min_tokens >= static_cast<size_t>(cfg.context_length)) {
      return Usage(absl::StrCat(
          "--prompt-file: '", f, "' is ", text->size(), " bytes, so at least ", min_tokens,
          " tokens long (BOS included; a token of this model's tokenizer holds at most ",
          piece_bytes, " bytes); a prompt may hold at most ", cfg.context_length - 1,
          " (the model's context of ", cfg.context_length, " less one position to generate into)"));
    }
    Prompt p{f, BaseName(f), *text, engine.tokenizer().Encode(*text, true)};
    if (p.tokens.size() <= 1) {  // BOS only
      return Usage(absl::StrCat("--prompt-file: '", f, "' has no tokens (the file is empty)"));
    }
    // Generating needs one free position (docs/WORKER.md "Prompt length"; kvpool-engine applies
    // the same rule): a prompt holds at most context_length - 1 tokens, BOS included.
    if (static_cast<int>(p.tokens.size()) >= cfg.context_length) {
      return Usage(absl::StrCat("--prompt-file: '", f, "' is ", p.tokens.size(),
                                " tokens long; a prompt may hold at most ", cfg.context_length - 1,
                                " (the model's context of ", cfg.context_length,
                                " less one position to generate into)"));
    }
    prompts.push_back(std::move(p));
  }

  // The weights' SHA-256, for the auto revision and every report (eval's too, so that an eval
  // report can be matched with the decode reports it is compared with: newcomer s10 #13). The
  // pool compares layout, recipe and rotation of a registration, not weights (the proto has no
  // field for them).
  auto model_bytes = kvpool::cli::ReadInputFile(model, kvpool::cli::kMaxModelFileBytes);
  if (!model_bytes.ok()) {
    return Fail(model_bytes.status(), "model");
  }
  const std::string model_sha256 = kvpool::Sha256Hex(*model_bytes);
  model_bytes->clear();
  model_bytes->shrink_to_fit();
  json out;
  out["role"] = role;
  out["model"] = model_id;
  out["model_sha256"] = model_sha256;
  // The rotation id (SHA-256 of the rotation file, kvpool/kernels/rotation_file.h).
  out["rotation_id"] = rotations->rotation_id_hex();
  out["page_size"] = page_size;

  // ---- eval: no pool ------------------------------------------------------------------------
  g_prompts_total = prompts.size();
  g_role = role == "eval" ? "eval" : role == "prefill" ? "prefill" : "decode";
  if (role == "eval") {
    std::map<std::string, kw::TeacherForcedResult> overall;
    double ref_s = 0, mixed_s = 0;
    size_t done = 0;
    out["prompts"] = json::array();
    for (auto& p : prompts) {
      if (StopSignal() != 0) break;
      auto ref = kw::RunReference(engine, p.tokens, max_new);
      if (!ref.ok()) {
        return Fail(ref.status(), "reference");
      }
      ref_s += ref->seconds;
      warn_if_context_full(p.name, p.tokens.size(), ref->tokens.size());
      json pj{{"name", p.name},
              {"path", p.path},
              {"prompt_tokens", p.tokens.size()},
              {"reference", {{"tokens", ref->tokens}, {"text", Text(engine, ref->tokens)}}}};
      std::printf("== %s (%zu prompt tokens)\nfp32 reference: %s\n", p.name.c_str(),
                  p.tokens.size(), Text(engine, ref->tokens).c_str());
      for (auto hp : {kw::HistoryPrecision::kBf16, kw::HistoryPrecision::kInt2}) {
        for (auto [s, w] : wins) {
          kw::MixedCacheOptions o = copts;
          o.history = hp;
          o.sink_tokens = s;
          o.recent_tokens = w;
          const std::string key = absl::StrCat(kw::HistoryPrecisionName(hp), "_S", s, "_W", w);
          auto t0 = std::chrono::steady_clock::now();
          auto tf = kw::TeacherForce(engine, rotations, o, p.tokens, *ref);
          if (!tf.ok()) {
            return Fail(tf.status(), "teacher forcing");
          }
          auto greedy = kw::MixedGreedy(engine, rotations, o, p.tokens, max_new);
          if (!greedy.ok()) {
            return Fail(greedy.status(), "greedy");
          }
          mixed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          overall[key].Add(*tf);
          json cj = TfJson(*tf);
          cj["greedy_tokens"] = *greedy;
          cj["greedy_text"] = Text(engine, *greedy);
          pj["configs"][key] = cj;
          std::printf("%-16s agreement %s  ppl ratio %s  greedy: %s\n", key.c_str(),
                      Fixed(*tf, tf->agreement(), 3).c_str(),
                      Fixed(*tf, tf->ppl_ratio(), 4).c_str(), Text(engine, *greedy).c_str());
        }
      }
      out["prompts"].push_back(pj);
      g_prompts_done = ++done;
      FlushStdout();  // each prompt's lines as it completes, also into a file or pipe
    }
    const int stop_signal = StopSignal();
    for (auto& [k, r] : overall) out["overall"][k] = TfJson(r);
    out["prompts_not_run"] = prompts.size() - done;
    NoteInterrupted(out, stop_signal);
    out["seconds"] = {{"reference", ref_s}, {"mixed", mixed_s}};
    std::printf("== overall (teacher-forced over the fp32 reference continuations)\n");
    for (auto& [k, r] : overall) {
      std::printf("%-16s agreement %s (%d/%d)  ppl ratio %s\n", k.c_str(),
                  Fixed(r, r.agreement(), 3).c_str(), r.matches, r.positions,
                  Fixed(r, r.ppl_ratio(), 4).c_str());
    }
    if (auto s = WriteJson(report, out); !s.ok()) {
      return Fail(s, "--report");
    }
    if (stop_signal != 0) {
      Interrupted(stop_signal,
                  absl::StrCat("eval: ", done, " of ", prompts.size(), " prompt(s) run"));
    }
    return kvpool::cli::kExitOk;
  }

  // ---- pool roles ---------------------------------------------------------------------------
  if (revision != "auto") {
    KVPOOL_LOG_WARN(
        "--revision {} is explicit: the pool does not compare weights, so every worker that "
        "registers {}@{} must load the same model file (this one: sha256 {}); --revision auto "
        "derives the revision from the weights",
        revision, model_id, revision, model_sha256.substr(0, 16));
  } else {
    const std::string hex = model_sha256.substr(0, 16);
    // Everything that changes the stored bytes: recipe, clip ratios and the rotation id
    // (SHA-256 of the rotation file, kvpool/kernels/rotation_file.h), so a re-calibration
    // registers a new revision instead of conflicting with the old one.
    revision = absl::StrCat(hex, "-p", page_size, "-s", sink, "-w", recent, "-", history, "-k",
                            copts.clip_ratio_k, "-v", copts.clip_ratio_v, "-r",
                            rotations->rotation_id_hex().substr(0, 16));
  }
  kw::NodeOptions nopts{.cache = copts,
                        .fault_pool_pid = fault_pool_pid,
                        .fault = *fault_or,
                        .reconnect_wait = std::chrono::milliseconds(call_timeout_ms),
                        .hung_pool_retry = std::chrono::milliseconds(3 * int64_t{call_timeout_ms}),
                        .cancel = stop_token,
                        .put_timeout = std::chrono::milliseconds(put_timeout_ms),
                        .lease_held = &g_lease_held};
  kvpool::client::ClientOptions clo;
  clo.server = pool;
  clo.ucx_tls = ucx_tls;
  clo.default_timeout = absl::Milliseconds(call_timeout_ms);
  clo.put_timeout = absl::Milliseconds(put_timeout_ms);
  std::unique_ptr<kvpool::client::Client> client;
  std::optional<AtOnceClient> at_once;  // after `client`: cleared before it is destroyed
  absl::Status client_error;            // the pool's own status, code kept (docs/WORKER.md)
  // A decode worker whose pool did not answer at start-up asks again before later requests
  // (newcomer 19 F3: it never did, while its message said the client tries again): the client
  // and the spec it registers are kept here until a registration succeeds or is refused.
  std::unique_ptr<kvpool::client::Client> retry_client;
  std::optional<kvpool::client::ModelSpec> retry_spec;
  // What a successful registration logs and reports (the pool's other revisions of this model).
  const auto OnRegistered = [&](const kvpool::client::ModelInfo& registered) {
    KVPOOL_LOG_INFO("registered {} rev {} with the pool at {} (epoch {})", model_id, revision, pool,
                    registered.pool_epoch);
    // Blocks of this model id under another revision are not found under this one: a
    // recalibrated rotation file (or a changed recipe) makes a new revision and every lookup
    // then misses, silently (newcomer s10b: 0 hits after a recalibration, no warning).
    const std::string own_rotation = rotations->rotation_id_hex();
    out["pool_other_revisions"] = json::array();
    for (const kvpool::client::OtherRevision& o : registered.other_revisions) {
      const std::string other_rotation = kvpool::ToHex(o.rotation_id);
      const bool same_rotation = other_rotation == own_rotation;
      out["pool_other_revisions"].push_back(
          {{"revision", o.revision}, {"rotation_id", other_rotation}, {"blocks", o.blocks}});
      KVPOOL_LOG_WARN(
          "the pool holds {} block(s) of model {} under revision {} (rotation {}), not under "
          "this worker's revision {} (rotation {}): {}; {}",
          o.blocks, model_id, o.revision, other_rotation.substr(0, 16), revision,
          own_rotation.substr(0, 16),
          same_rotation ? "the same rotation file, another recipe, weights or --revision"
                        : "another rotation file (recalibrated?): --rotations with the old file "
                          "(and its recipe) would find them",
          // A prefill node makes no lookups (newcomer 11b F5): what the other revision means
          // for it is a second copy.
          role == "prefill"
              ? "this node stores its prompts under its own revision, a second copy that "
                "decode workers of the other revision do not find; both copies take pool "
                "capacity"
              : "lookups of this run do not find them");
    }
  };
  if (auto c = kvpool::client::Client::Create(clo); !c.ok()) {
    // Create makes no RPC: its failure is this worker's own configuration (the UCX transport
    // list, the address), not the pool, so both roles stop instead of falling back.
    return Fail(c.status(),
                absl::StrCat("local data plane (--ucx-tls '", ucx_tls, "', --pool ", pool, ")"));
  } else {
    client = std::move(c).value();
    // The pool fault hooks SIGKILL/SIGSTOP --fault-pool-pid: only the pool at --pool (a pid of
    // another kvpool-server passed the process-name check above and killed that pool, while the
    // run under test "succeeded": newcomer s9b #2). The pool reports its pid in Stats (v1.6).
    if (NeedsPoolPid(*fault_or)) {
      if (int rc = CheckFaultPoolPid(*client, pool, fault, fault_pool_pid, stop_token); rc != 0) {
        return rc;
      }
    }
    // No deadline of its own: the client's default_timeout (--call-timeout-ms) bounds it, as
    // its DEADLINE_EXCEEDED message says (a fixed 5 s ignored the flag: newcomer s9 A7).
    // A stop cancels it (stop_token): a pool that accepts the connection and never answers held
    // a stopped worker until the deadline, and a prefill then exited 2 with no report (newcomer
    // s9b #3).
    const auto spec = kw::MakeModelSpec(cfg, copts, model_id, revision, *rot_bytes);
    auto info = client->RegisterModel(spec, {.cancel = stop_token});
    // A prefill node started before its pool (pods started together) waits for it as for an
    // outage mid-run: it asks again every 250 ms for up to --call-timeout-ms (it failed at once,
    // while a pool gone mid-run was waited for: newcomer 19 F3). A decode worker serves its
    // prompts locally instead (docs/WORKER.md).
    if (role == "prefill" && absl::IsUnavailable(info.status()) &&
        !kvpool::client::NoSharedUcxTransport(info.status()) && StopSignal() == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto until = t0 + std::chrono::milliseconds(call_timeout_ms);
      KVPOOL_LOG_WARN(
          "prefill: the pool at {} does not answer yet ({}); waiting up to {} ms for it "
          "(--call-timeout-ms)",
          pool, kvpool::StatusText(info.status()), call_timeout_ms);
      while (absl::IsUnavailable(info.status()) && StopSignal() == 0 &&
             std::chrono::steady_clock::now() < until) {
        const auto wake =
            std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(250));
        while (StopSignal() == 0 && std::chrono::steady_clock::now() < wake) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        if (StopSignal() != 0) break;
        info = client->RegisterModel(spec, {.cancel = stop_token});
      }
      if (info.ok()) {
        KVPOOL_LOG_INFO(
            "prefill: the pool at {} answered after {:.2f} s", pool,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    if (!info.ok()) {
      client_error = info.status();
      if (role == "decode" && PoolNotAnswering(info.status()) && StopSignal() == 0) {
        retry_client = std::move(client);
        retry_spec = spec;
      }
      client.reset();
    } else {
      OnRegistered(*info);
      if (role == "prefill") at_once.emplace(client.get());  // its puts, on a second signal
      if (*fault_or == kw::Fault::kStopPoolAfterRegister) {
        KVPOOL_LOG_WARN("fault stop-pool-after-register: stopping pool pid {}", fault_pool_pid);
        // A pool thread already running may still answer the next call: wait (up to 2 s)
        // until every thread of the pool shows as stopped.
        if (!kvpool::StopProcessAndWait(fault_pool_pid, std::chrono::seconds(2))) {
          KVPOOL_LOG_WARN("fault stop-pool-after-register: pool pid {} not stopped after 2 s",
                          fault_pool_pid);
        }
      }
    }
  }
  out["revision"] = revision;
  out["history_precision"] = history;
  out["sink_tokens"] = sink;
  out["recent_tokens"] = recent;
  const uint64_t bf16_per_token = 4ull * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim;
  out["bf16_bytes_per_token"] = bf16_per_token;

  if (role == "prefill") {
    // A failed registration ends the run with exit 2, after the report and metrics say so:
    // every prompt that had blocks to push is failed with the registration's status (exit 2
    // with no --report left a caller nothing to read: newcomer 18 F2).
    const bool registration_failed = client == nullptr && StopSignal() == 0;
    if (registration_failed) out["registration_error"] = kvpool::StatusText(client_error);
    // Stopped before or during the registration: no prompt runs (RunAll's stop hook answers true
    // at once, so the node never uses the missing client), and the report lists them all.
    if (client == nullptr && !registration_failed) {
      KVPOOL_LOG_WARN("prefill: stopped during the registration with the pool at {} ({})", pool,
                      kvpool::StatusText(client_error));
    }
    kw::PrefillNode node(&engine, client.get(), rotations, nopts);
    uint64_t bytes = 0, tokens = 0;
    double compute = 0, push = 0;
    // A prompt with no full block before its last token (n <= P) has nothing to push: the
    // decode worker takes PoolPrefixTokens(n) = 0 tokens of it from the pool and computes it
    // locally. It is skipped with a warning, the others still run.
    std::vector<std::vector<int>> all_tokens;
    std::vector<size_t> run_index;  // prompts[] index of all_tokens[i]
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (kw::PoolPrefixTokens(static_cast<int>(prompts[i].tokens.size()), page_size) < page_size) {
        continue;
      }
      all_tokens.push_back(prompts[i].tokens);
      run_index.push_back(i);
    }
    int failed = 0, skipped = 0, reput = 0, not_stored = 0;
    std::string first_failure;
    out["prompts"] = json::array();
    // Each prompt is logged and recorded as its outcome is known (the log had every line only
    // at the end of the run: newcomer s9 A4), skipped prompts in their place.
    size_t recorded = 0;  // prompts[0, recorded) are in out["prompts"]
    auto record_skipped_up_to = [&](size_t end) {
      for (; recorded < end; ++recorded) {
        const Prompt& p = prompts[recorded];
        const std::string why =
            absl::StrCat(p.tokens.size(), " tokens hold no full block of ", page_size,
                         " before the last token (the decoder computes it): nothing to push");
        KVPOOL_LOG_WARN("prefill --prompt-file {}: skipped, {}", p.path, why);
        out["prompts"].push_back({{"name", p.name},
                                  {"path", p.path},
                                  {"prompt_tokens", p.tokens.size()},
                                  {"skipped", true},
                                  {"skip_reason", why}});
        ++skipped;
      }
    };
    // A stored prompt's part of the run's totals.
    auto add_to_overall = [&](const kw::PrefillReport& r) {
      bytes += r.bytes_written;
      tokens += uint64_t(r.blocks) * page_size;
      compute += r.compute_seconds;
      push += r.push_seconds;
    };
    // The report entry of a prompt not stored: its name, path and length, plus `why` (an
    // "error", or "interrupted" with its "interrupt_reason").
    auto not_stored_entry = [](const Prompt& p, const json& why) {
      json e{{"name", p.name}, {"path", p.path}, {"prompt_tokens", p.tokens.size()}};
      e.update(why);
      return e;
    };
    auto on_done = [&](size_t k, const absl::StatusOr<kw::PrefillReport>& outcome) {
      record_skipped_up_to(run_index[k]);
      const Prompt& p = prompts[recorded++];
      if (!outcome.ok() && absl::IsCancelled(outcome.status()) && StopSignal() != 0) {
        const std::string why = std::string(outcome.status().message());
        // An aborted put is named; prompts never started are counted in the last line only.
        if (!kw::PromptNotRun(outcome.status())) {
          KVPOOL_LOG_WARN("prefill --prompt-file {}: {}", p.path, why);
        }
        out["prompts"].push_back(
            not_stored_entry(p, {{"interrupted", true}, {"interrupt_reason", why}}));
        ++not_stored;
        return;
      }
      if (!outcome.ok()) {
        const std::string why = kvpool::StatusText(outcome.status());
        KVPOOL_LOG_ERROR("prefill --prompt-file {}: {}", p.path, why);
        out["prompts"].push_back(not_stored_entry(p, {{"error", why}}));
        if (failed++ == 0) first_failure = why;
        return;
      }
      const kw::PrefillReport* r = &*outcome;
      // A commit whose answer was lost but whose blocks the pool holds: what this node wrote
      // is unknown, not 0 (newcomer 19 F6).
      const std::string written =
          r->commit_unanswered.empty()
              ? absl::StrCat(r->blocks_written, " written, ", r->bytes_written, " bytes")
              : std::string("written unknown: the commit was not answered");
      KVPOOL_LOG_INFO("prefill {}: {} tokens, {} blocks ({}), {:.3f}s compute, {:.3f}s push",
                      p.name, r->prompt_tokens, r->blocks, written, r->compute_seconds,
                      r->push_seconds);
      out["prompts"].push_back({{"name", p.name},
                                {"path", p.path},
                                {"prompt_tokens", r->prompt_tokens},
                                {"blocks", r->blocks},
                                {"blocks_written", r->blocks_written},
                                {"bytes_written", r->bytes_written},
                                {"compute_seconds", r->compute_seconds},
                                {"push_seconds", r->push_seconds},
                                {"reput", r->reput},
                                {"recomputed_after_restart", false}});
      if (!r->commit_unanswered.empty()) {  // stored: found by a Lookup (newcomer 17 F1)
        out["prompts"].back()["commit_unanswered"] = r->commit_unanswered;
      }
      reput += r->reput ? 1 : 0;
      ++g_prompts_done;  // stored
      add_to_overall(*r);
    };
    // A prompt committed to a pool that restarted later was computed and put again: its entry
    // is replaced (newcomer 14 F1).
    // One that was not put again is no longer stored (stopped first: interrupted; else failed),
    // and one the pool could not confirm at the end is marked so (newcomer 16 F1).
    int unconfirmed = 0;
    auto on_redone = [&](size_t k, const absl::StatusOr<kw::PrefillReport>& outcome) {
      const Prompt& p = prompts[run_index[k]];
      json& e = out["prompts"][run_index[k]];
      if (outcome.ok() && !outcome->pool_unconfirmed.empty()) {
        KVPOOL_LOG_WARN("prefill --prompt-file {}: {}", p.path, outcome->pool_unconfirmed);
        e["unconfirmed"] = true;
        e["unconfirmed_reason"] = outcome->pool_unconfirmed;
        ++unconfirmed;
        return;
      }
      tokens -= e.value("blocks", uint64_t{0}) * page_size;  // no longer in the pool
      const bool lost = !outcome.ok() && kw::PromptLostWithPool(outcome.status());
      if (lost && absl::IsCancelled(outcome.status())) {
        const std::string why = std::string(outcome.status().message());
        KVPOOL_LOG_WARN("prefill --prompt-file {}: {}", p.path, why);
        e = not_stored_entry(p, {{"interrupted", true}, {"interrupt_reason", why}});
        ++not_stored;
        --g_prompts_done;
        return;
      }
      if (!outcome.ok()) {
        const std::string why =
            lost ? kvpool::StatusText(outcome.status())
                 : absl::StrCat(kvpool::StatusText(outcome.status()),
                                " (putting it again: its first commit went to a pool that "
                                "restarted)");
        KVPOOL_LOG_ERROR("prefill --prompt-file {}: {}", p.path, why);
        e = not_stored_entry(p, {{"error", why}});
        if (failed++ == 0) first_failure = why;
        --g_prompts_done;
        return;
      }
      const kw::PrefillReport* r = &*outcome;
      KVPOOL_LOG_INFO(
          "prefill {}: put again after the pool restarted: {} blocks ({} written, {} bytes), "
          "{:.3f}s compute, {:.3f}s push",
          p.name, r->blocks, r->blocks_written, r->bytes_written, r->compute_seconds,
          r->push_seconds);
      e["blocks"] = r->blocks;
      e["blocks_written"] = r->blocks_written;
      e["bytes_written"] = e.value("bytes_written", uint64_t{0}) + r->bytes_written;
      e["compute_seconds"] = e.value("compute_seconds", 0.0) + r->compute_seconds;
      e["push_seconds"] = e.value("push_seconds", 0.0) + r->push_seconds;
      e["recomputed_after_restart"] = true;
      add_to_overall(*r);
    };
    if (registration_failed) {
      const absl::Status why(client_error.code(),
                             absl::StrCat("not put: the registration with the pool at ", pool,
                                          " failed: ", client_error.message()));
      for (size_t k = 0; k < all_tokens.size(); ++k) on_done(k, why);
    } else {
      // prompt i+1 computes while i is in flight; one outcome per prompt.
      node.RunAll(
          all_tokens,
          {.on_done = on_done, .stop = [] { return StopSignal() != 0; }, .on_redone = on_redone});
    }
    record_skipped_up_to(prompts.size());
    // Prompts, not recompute passes: a prompt put again twice (the pool restarted again during
    // the recompute) counts once, and one whose recompute failed is counted as failed only
    // (newcomer 14b F1: 65 "recomputed" of 60 prompts).
    int recomputed = 0;
    for (const json& e : out["prompts"]) recomputed += e.value("recomputed_after_restart", false);
    const int stop_signal = StopSignal();
    out["overall"] = {{"bytes_written", bytes},
                      {"tokens_stored", tokens},
                      {"bytes_written_per_token", tokens ? double(bytes) / tokens : 0.0},
                      {"compute_seconds", compute},
                      {"push_seconds", push},
                      {"skipped_prompts", skipped},
                      {"failed_prompts", failed},
                      {"interrupted_prompts", not_stored},
                      {"reput_prompts", reput},
                      {"recomputed_prompts", recomputed},
                      {"unconfirmed_prompts", unconfirmed},
                      {"pool_reconnects", node.pool_reconnects()},
                      {"room_waits", node.room_waits()}};
    NoteInterrupted(out, stop_signal);
    out["seconds"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::string metrics_text;  // --metrics-file
    if (!metrics_file.empty()) {
      metrics_text = PrometheusCounters({
          {"kvpool_worker_prefill_prompts_total", "Prompts given to this prefill node.",
           prompts.size()},
          {"kvpool_worker_prefill_failed_prompts_total",
           "Prompts whose put failed (aborted; nothing of them stored).", uint64_t(failed)},
          {"kvpool_worker_prefill_skipped_prompts_total",
           "Prompts with no full block before their last token (nothing to push).",
           uint64_t(skipped)},
          {"kvpool_worker_prefill_interrupted_prompts_total",
           "Prompts not stored because the worker was stopped by SIGTERM or SIGINT (not run, "
           "or their open put aborted).",
           uint64_t(not_stored)},
          {"kvpool_worker_pushed_bytes_total",
           "Staging bytes written to the pool by committed puts.", bytes},
          {"kvpool_worker_pool_reconnects_total",
           "Times the pool answered again after it was found unreachable.",
           uint64_t(node.pool_reconnects())},
          {"kvpool_worker_prefill_reput_prompts_total",
           "Prompts whose put failed (the pool went away or closed the connection, or the put "
           "expired) and was put again from the recorded K/V.",
           uint64_t(reput)},
          {"kvpool_worker_prefill_recomputed_prompts_total",
           "Prompts committed to a pool that restarted later in the run, computed and put "
           "again.",
           uint64_t(recomputed)},
          {"kvpool_worker_prefill_unconfirmed_prompts_total",
           "Prompts committed to a pool that did not answer at the end of the run (stored only "
           "if it is still up).",
           uint64_t(unconfirmed)},
      });
    }
    if (int rc = WriteOutputs(metrics_file, metrics_text, report, out); rc != 0) return rc;
    if (registration_failed) return Fail(client_error, absl::StrCat("pool ", pool));
    if (stop_signal != 0) {
      // Every prompt in exactly one count (newcomer 11b F2: the failed ones were in none).
      std::string what =
          absl::StrCat("prefill: ", prompts.size() - skipped - failed - not_stored, " of ",
                       prompts.size(), " prompt(s) stored, ", not_stored, " stopped");
      if (failed > 0) absl::StrAppend(&what, ", ", failed, " failed");
      if (skipped > 0) absl::StrAppend(&what, ", ", skipped, " skipped");
      if (unconfirmed > 0) {
        absl::StrAppend(&what, " (", unconfirmed,
                        " of the stored unconfirmed: the pool did not answer at the end)");
      }
      Interrupted(stop_signal, what);
    }
    if (unconfirmed > 0) {
      std::fprintf(stderr,
                   "kvpool-worker: prefill: %d prompt(s) committed to a pool that did not answer "
                   "at the end of the run: stored only if that pool is still up (report: "
                   "\"unconfirmed\")\n",
                   unconfirmed);
    }
    if (failed > 0) {
      // The run's outcome: printed whatever --log-level says, with the first failure.
      std::fprintf(stderr, "kvpool-worker: prefill: %d of %zu prompt(s) failed (first: %s)\n",
                   failed, prompts.size(), first_failure.c_str());
      return kvpool::cli::kExitRuntime;
    }
    return kvpool::cli::kExitOk;
  }

  // decode
  // The wait before the next try: a second after a refused connection (UNAVAILABLE fails at
  // once), 3 x --call-timeout-ms after a registration that timed out (each try of a hung pool
  // costs a whole --call-timeout-ms, as a Lookup's does mid-run: hung_pool_retry).
  const auto RetryWait = [&](const absl::Status& s) {
    return absl::IsDeadlineExceeded(s) ? std::chrono::milliseconds(3 * int64_t{call_timeout_ms})
                                       : std::chrono::milliseconds(1000);
  };
  std::chrono::milliseconds retry_wait = RetryWait(client_error);
  if (client == nullptr) {
    // Only an unreachable pool is "unreachable"; a refused registration (e.g. a recipe that
    // conflicts with the pool's, FAILED_PRECONDITION) is reported with the pool's own status.
    nopts.no_pool_reason = NoPoolReason(client_error, StopSignal() != 0);
    // Logged once here; each request's report carries it as fallback_reason.
    KVPOOL_LOG_WARN("pool at {} not usable ({}); {}", pool, nopts.no_pool_reason,
                    retry_client != nullptr
                        ? absl::StrCat("each request computes its prefix locally until the "
                                       "pool answers (the worker registers again before a "
                                       "later request, ",
                                       retry_wait.count(), " ms after this try)")
                        : "every request computes its prefix locally");
  }
  std::optional<kw::DecodeNode> node;
  node.emplace(&engine, client.get(), rotations, nopts);
  auto last_try = std::chrono::steady_clock::now();
  // A pool that did not answer at start-up is asked again before a request, after retry_wait:
  // a worker started before its pool serves from it once it is up (newcomer 19 F3). A refusal
  // ends the retries (its reason becomes the requests' fallback_reason).
  const auto TryRegisterAgain = [&] {
    if (retry_client == nullptr || std::chrono::steady_clock::now() - last_try < retry_wait) {
      return;
    }
    auto again = retry_client->RegisterModel(*retry_spec, {.cancel = stop_token});
    last_try = std::chrono::steady_clock::now();
    if (again.ok()) {
      client = std::move(retry_client);
      OnRegistered(*again);
      KVPOOL_LOG_INFO(
          "decode: the pool at {} answered after {:.2f} s; the next requests look it up ({} "
          "computed their prefix locally before)",
          pool, std::chrono::duration<double>(last_try - t_start).count(), g_prompts_done.load());
      nopts.no_pool_reason.clear();
      node.emplace(&engine, client.get(), rotations, nopts);
    } else if (!PoolNotAnswering(again.status()) || StopSignal() != 0) {
      retry_client.reset();
      if (StopSignal() != 0) return;
      nopts.no_pool_reason = NoPoolReason(again.status(), false);
      KVPOOL_LOG_WARN("pool at {} not usable ({}); every later request computes its prefix locally",
                      pool, nopts.no_pool_reason);
      node.emplace(&engine, client.get(), rotations, nopts);
    } else {
      retry_wait = RetryWait(again.status());
      KVPOOL_LOG_DEBUG("decode: the pool at {} still does not answer ({}); asking again in {} ms",
                       pool, kvpool::StatusText(again.status()), retry_wait.count());
    }
  };
  kw::TeacherForcedResult tf_all;
  uint64_t moved = 0, discarded = 0, bf16_equiv = 0, stored = 0, loaded_tokens = 0, hit_tokens = 0;
  int hits = 0, wanted = 0, fallbacks = 0;
  double fetch = 0, compute = 0;
  size_t served = 0;
  out["prompts"] = json::array();
  for (auto& p : prompts) {
    if (StopSignal() != 0) break;  // the request under way finishes; no new one starts
    std::unique_ptr<kw::ReferenceRun> ref;
    if (teacher_force) {
      auto r = kw::RunReference(engine, p.tokens, max_new);
      if (!r.ok()) {
        return Fail(r.status(), "reference");
      }
      ref = std::make_unique<kw::ReferenceRun>(std::move(r).value());
    }
    TryRegisterAgain();
    auto r = node->Run(p.tokens, max_new, ref.get());
    if (!r.ok()) {
      return Fail(r.status(), absl::StrCat("decode ", p.name));
    }
    warn_if_context_full(p.name, p.tokens.size(), r->tokens.size());
    json pj{{"name", p.name},
            {"path", p.path},
            {"prompt_tokens", r->prompt_tokens},
            {"tokens", r->tokens},
            {"text", Text(engine, r->tokens)},
            {"context_full", context_full(p.tokens.size(), r->tokens.size())},
            {"wanted_blocks", r->wanted_blocks},
            {"lookup_blocks", r->lookup_blocks},
            {"hit_blocks", r->hit_blocks},
            {"missed_blocks", r->wanted_blocks - r->hit_blocks},
            {"loaded_blocks", r->loaded_blocks},
            {"gap_blocks", r->gap_blocks},
            {"bf16_blocks_fetched", r->bf16_blocks_fetched},
            {"int2_blocks_fetched", r->int2_blocks_fetched},
            {"recomputed_tokens", r->recomputed_tokens},
            {"bytes_moved", r->bytes_moved},
            {"bytes_discarded", r->bytes_discarded},
            {"bf16_bytes_equivalent", r->bf16_bytes_equivalent},
            {"bytes_stored", r->bytes_stored},
            {"fallback", r->fallback},
            {"fallback_reason", r->fallback_reason},
            {"fetch_seconds", r->fetch_seconds},
            {"compute_seconds", r->compute_seconds}};
    if (ref) {
      pj["reference"] = {{"tokens", ref->tokens}, {"text", Text(engine, ref->tokens)}};
      pj["teacher_forced"] = TfJson(r->teacher_forced);
      tf_all.Add(r->teacher_forced);
    }
    std::printf("== %s (%d prompt tokens; %d/%d blocks from the pool%s)\n%s\n", p.name.c_str(),
                r->prompt_tokens, r->loaded_blocks, r->wanted_blocks,
                r->fallback ? ", FALLBACK: computed locally" : "", Text(engine, r->tokens).c_str());
    // Each answer as it completes, also into a file or pipe (block-buffered stdout lost every
    // answer of a SIGTERMed run: newcomer s9 A4).
    FlushStdout();
    g_prompts_done = ++served;
    out["prompts"].push_back(pj);
    moved += r->bytes_moved;
    discarded += r->bytes_discarded;
    bf16_equiv += r->bf16_bytes_equivalent;
    stored += r->bytes_stored;
    loaded_tokens += uint64_t(r->loaded_blocks) * page_size;
    hit_tokens += uint64_t(r->hit_blocks) * page_size;
    hits += r->hit_blocks;
    wanted += r->wanted_blocks;
    fallbacks += r->fallback ? 1 : 0;
    fetch += r->fetch_seconds;
    compute += r->compute_seconds;
  }
  // hit_blocks counts what the pool held (Acquire); loaded_blocks what was fetched, verified and
  // attended over — lower after a failed fetch or when a recent window lacks its BF16 form.
  out["overall"] = {{"hit_blocks", hits},
                    {"missed_blocks", wanted - hits},
                    {"loaded_blocks", loaded_tokens / page_size},
                    {"fallbacks", fallbacks},
                    {"bytes_moved", moved},
                    {"bytes_discarded", discarded},
                    {"bytes_moved_per_token", loaded_tokens ? double(moved) / loaded_tokens : 0.0},
                    {"bytes_stored_per_token", hit_tokens ? double(stored) / hit_tokens : 0.0},
                    {"bf16_bytes_per_token", bf16_per_token},
                    {"moved_vs_bf16", bf16_equiv ? double(moved) / bf16_equiv : 0.0},
                    {"fetch_seconds", fetch},
                    {"compute_seconds", compute}};
  if (teacher_force) out["overall"]["teacher_forced"] = TfJson(tf_all);
  out["prompts_not_run"] = prompts.size() - served;
  const int stop_signal = StopSignal();
  NoteInterrupted(out, stop_signal);
  out["seconds"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::string metrics_text;  // --metrics-file
  if (!metrics_file.empty()) {
    metrics_text = PrometheusCounters({
        {"kvpool_worker_requests_total", "Requests served by this decode worker.", served},
        {"kvpool_worker_requests_not_run_total",
         "Requests not started because the worker was stopped by SIGTERM or SIGINT.",
         prompts.size() - served},
        {"kvpool_worker_pool_fallbacks_total",
         "Requests whose prefix was computed locally because the pool path failed.",
         uint64_t(fallbacks)},
        {"kvpool_worker_blocks_hit_total", "Blocks of the wanted prefixes the pool held (leased).",
         uint64_t(hits)},
        {"kvpool_worker_blocks_missed_total",
         "Blocks of the wanted prefixes the pool did not hold, or that no answer came for "
         "(pool unreachable).",
         uint64_t(wanted - hits)},
        {"kvpool_worker_fetched_bytes_total",
         "Bytes fetched from the pool over the data plane (loaded or, after a failed fetch, "
         "discarded).",
         moved + discarded},
    });
  }
  if (int rc = WriteOutputs(metrics_file, metrics_text, report, out); rc != 0) return rc;
  if (stop_signal != 0) {
    Interrupted(stop_signal,
                absl::StrCat("decode: ", served, " of ", prompts.size(), " request(s) served"));
  }
  return kvpool::cli::kExitOk;
}
