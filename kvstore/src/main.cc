// kvpool-server — the KV-cache pool. Flags: `kvpool-server --help`; docs/OPERATIONS.md.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvpool/common/cli.h"
#include "kvpool/common/log.h"
#include "kvpool/kvstore/server.h"
#include "memory_limit.h"

namespace {

// What ParseBytes found.
enum class ByteParse { kOk, kBad, kTooLarge };

// "1073741824", "512MiB", "1GiB", "64KiB", "2TiB" (binary units) or "1GB" (decimal) → bytes;
// kTooLarge for digits (and a unit) beyond 2^64 - 1 bytes ("99999999999TiB" was "cannot parse":
// newcomer 16 F9).
ByteParse ParseBytes(const std::string& s, uint64_t* out) {
  if (s.empty() || s.find_first_not_of("0123456789") == 0) {
    return ByteParse::kBad;  // SimpleAtoi takes " 4", "+4": digits first, as the integer flags want
  }
  if (s.find_first_of(" \t\n\v\f\r") != std::string::npos) {
    return ByteParse::kBad;  // and trims trailing spaces: "4 MiB"
  }
  struct Unit {
    const char* suffix;
    uint64_t mul;
  };
  static const Unit kUnits[] = {
      {"TiB", 1ull << 40}, {"GiB", 1ull << 30},      {"MiB", 1ull << 20},
      {"KiB", 1ull << 10}, {"TB", 1000000000000ull}, {"GB", 1000000000ull},
      {"MB", 1000000ull},  {"KB", 1000ull},          {"B", 1}};
  std::string digits = s;
  uint64_t mul = 1;
  for (const Unit& u : kUnits) {
    const std::string suf = u.suffix;
    if (s.size() > suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0) {
      digits = s.substr(0, s.size() - suf.size());
      mul = u.mul;
      break;
    }
  }
  if (digits.find_first_not_of("0123456789") != std::string::npos) return ByteParse::kBad;
  uint64_t n = 0;
  if (!absl::SimpleAtoi(digits, &n)) return ByteParse::kTooLarge;  // all digits: it overflowed
  if (n > UINT64_MAX / mul) return ByteParse::kTooLarge;
  *out = n * mul;
  return ByteParse::kOk;
}

// Smallest watermark. Eviction, whether the high watermark or a failed allocation triggered it,
// frees down to --low-watermark (a failed allocation further only when its request needs more),
// so a low watermark of 0.01 threw away 99 % of a pool at every pass: every block of a small pool
// (re-tester s6; newcomer report s6 #7 had already refused 0 and 1e-300). Below one half a pass
// would drop most of what the pool holds, and nothing needs it: an allocation that needs more
// than the low watermark leaves gets it anyway. The high watermark is at least the low one.
constexpr double kMinWatermark = 0.5;

// CLI11 check for a watermark: a fraction in [0.5, 1]. cli::Range is inclusive at both ends, so
// it showed 0..1 in --help while the store then refused 0 ("need 0 < low-watermark"). `low`:
// the check of --low-watermark, else --high-watermark; a value below one half is refused with
// that flag's reason. NaN is not a number here: it used to get --low-watermark's reason from
// either flag (newcomer 8b F2).
CLI::Validator WatermarkFraction(bool low) {
  return CLI::Validator(
      [low](std::string& v) -> std::string {
        double x = 0;
        if (v.empty() || std::isspace(static_cast<unsigned char>(v.front())) ||
            std::isspace(static_cast<unsigned char>(v.back())) ||
            !CLI::detail::lexical_cast(v, x) || std::isnan(x)) {
          return "'" + v + "' is not a number (want a fraction in [0.5, 1])";
        }
        if (x > 1.0) return v + " is outside [0.5, 1] (a fraction of --capacity)";
        if (!(x >= kMinWatermark)) {
          return v + (low ? " is outside [0.5, 1] (eviction frees down to --low-watermark of "
                            "--capacity each time it runs: below one half a pass would drop "
                            "most of what the pool holds)"
                          : " is outside [0.5, 1] (eviction starts above --high-watermark of "
                            "--capacity and frees down to --low-watermark, which is at most "
                            "--high-watermark and at least one half)");
        }
        return {};
      },
      "in [0.5, 1]");
}

// What --capacity may be at most: the memory this process may use (physical memory, or its
// cgroup's limit: a container's limits.memory) less kProcessReserve for the process itself
// (gRPC, UCX, the binary: ~32 MiB resident with a tiny pool). The pool's memory is allocated and
// pinned up front: more can only end in swapping or the OOM killer, which in a container kills
// it before it logs a line (newcomer report 13 F1).
constexpr uint64_t kProcessReserve = 64ull << 20;
const kvpool::kvstore::MemoryLimit& UsableMemory() {
  static const kvpool::kvstore::MemoryLimit limit =
      kvpool::kvstore::ProcessMemoryLimit(static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                                          static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
  return limit;
}
// What the pool's memory may take: UsableMemory() less kProcessReserve (0 when the limit is at
// most the reserve; computed without a sum, which wrapped near 2^64: newcomer report 13b);
// nullopt when no limit is known.
std::optional<uint64_t> PoolRoom() {
  const kvpool::kvstore::MemoryLimit& limit = UsableMemory();
  if (limit.bytes == 0) return std::nullopt;
  return limit.bytes > kProcessReserve ? limit.bytes - kProcessReserve : 0;
}

// CLI11 checks for --capacity and --max-registration-bytes: a positive byte count ParseBytes
// reads, and for --capacity 1 MiB .. UsableMemory() - kProcessReserve (less cannot hold a block
// of any real model). At parse time, so a value from a --config file is named with the file and
// its key (cli::Parse; newcomer s8 N9).
CLI::Validator ByteCount(const char* examples, bool capacity_bounds) {
  return CLI::Validator(
      [examples, capacity_bounds](std::string& v) -> std::string {
        uint64_t bytes = 0;
        const ByteParse parsed = ParseBytes(v, &bytes);
        const kvpool::kvstore::MemoryLimit& limit = UsableMemory();
        if (parsed == ByteParse::kTooLarge) {
          // The largest value it may take: what the checks below allow, else 2^64 - 1 bytes.
          if (const std::optional<uint64_t> room = PoolRoom(); capacity_bounds && room) {
            return absl::StrCat(v, " is too large: at most ", *room, " bytes (the memory this ",
                                "process may use, ", limit.bytes, " bytes (", limit.source,
                                "), less 64 MiB for the process itself)");
          }
          if (!capacity_bounds && limit.bytes > 0) {
            return absl::StrCat(v, " is too large: at most ", limit.bytes,
                                " bytes (the memory this process may use: ", limit.source, ")");
          }
          return absl::StrCat(v, " is too large: at most ", UINT64_MAX, " bytes");
        }
        if (parsed == ByteParse::kBad || bytes == 0) {
          return absl::StrCat(
              "cannot parse \"", v,
              "\" as a positive byte count (bytes, or digits and a unit: ", examples, ")");
        }
        if (!capacity_bounds) {
          // --max-registration-bytes: a bound above the memory the process may use bounds
          // nothing (newcomer report 13).
          if (limit.bytes > 0 && bytes > limit.bytes) {
            return absl::StrCat(v, " (", bytes,
                                " bytes) is more than this process may use: ", limit.bytes,
                                " bytes (", limit.source, ")");
          }
          return {};
        }
        constexpr uint64_t kMinCapacity = 1ull << 20;
        if (bytes < kMinCapacity) {
          return absl::StrCat(v, " (", bytes, " bytes) is below 1 MiB");
        }
        if (const std::optional<uint64_t> room = PoolRoom(); room && bytes > *room) {
          return absl::StrCat(v, " (", bytes,
                              " bytes) is more than this process may use: ", limit.bytes,
                              " bytes (", limit.source, ") less 64 MiB for the ",
                              "process itself; the pool allocates and pins all of it at start");
        }
        return {};
      },
      "BYTES");
}

// CLI11 check for --rotation-dir: empty (the documented "no rotation file for a client", also
// `rotation-dir: ""` in a --config file) or an existing directory. CLI::ExistingDirectory alone
// refused the empty value as "Directory does not exist: " (newcomer s8 N2).
CLI::Validator ExistingDirectoryOrEmpty() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        if (v.empty()) return {};
        return CLI::ExistingDirectory(v);
      },
      "DIR (or empty)");
}

// The termination signals main waits for (sigwait): SIGTERM, SIGINT, SIGHUP.
sigset_t TerminationSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  return signals;
}

// Blocks them from the executable's .preinit_array: after the dynamic loader has mapped and
// relocated the libraries (~4 ms) but before any library's static initializers run (gRPC,
// protobuf, absl, UCX: ~20-30 ms on a loaded 2-core machine), so a SIGTERM that arrives during
// those waits for main instead of killing the process. Only sigemptyset/sigaddset/sigprocmask
// (async-signal-safe system call wrappers) run here; the process has one thread.
void BlockTerminationSignalsEarly(int, char**, char**) {
  const sigset_t signals = TerminationSignals();
  sigprocmask(SIG_BLOCK, &signals, nullptr);
}
__attribute__((section(".preinit_array"),
               used)) void (*kBlockSignalsEarly)(int, char**,
                                                 char**) = &BlockTerminationSignalsEarly;

}  // namespace

int main(int argc, char** argv) {
  // The termination signals (and SIGHUP) are blocked before flag parsing and the slow start-up
  // (UCX, pool memory, gRPC): a SIGTERM that arrives while the pool starts then waits in the
  // pending set and drains the pool as soon as it is up (exit 0, docs/OPERATIONS.md) instead of
  // killing the process with the default action (exit 143). Threads inherit the mask; main
  // waits for the signals below. SIGHUP is logged and ignored whatever the parent's disposition
  // was: there is no configuration reload, and a lost terminal must not drop the pool's contents.
  sigset_t signals = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // again: a no-op after the preinit block
  signal(SIGHUP, SIG_DFL);  // an inherited SIG_IGN would discard it before sigwait sees it

  CLI::App app{
      "kvpool-server — the disaggregated KV-cache pool (gRPC control plane, UCX data "
      "plane, OSCAR mixed-precision block store)"};
  kvpool::cli::Setup(app, "kvpool-server");
  kvpool::kvstore::PoolServerOptions o;
  std::string capacity = "1GiB";
  int64_t put_timeout_ms = 30000, lease_ms = 10000, max_lease_ms = 300000;
  int64_t tick_ms = 100, drain_ms = 10000, readiness_delay_ms = 0;
  app.add_option("--listen", o.listen,
                 "gRPC address HOST:PORT (port 0 = any free port); /metrics listens on the same "
                 "host. 0.0.0.0 and [::] both mean every interface, IPv4 and IPv6 (gRPC cannot "
                 "listen on 0.0.0.0 alone): give one interface's IPv4 address to listen on IPv4 "
                 "only, or one IPv6 address (e.g. [::1]) for IPv6 only")
      ->check(kvpool::cli::HostPortAddress(0));
  app.add_option("--metrics-port", o.metrics_port,
                 "HTTP port of /metrics (Prometheus text); 0 = any free port, -1 = off")
      ->check(kvpool::cli::Range(-1, 65535));
  app.add_option("--capacity", capacity,
                 "Pool memory for blocks and staging: bytes or with a unit (KiB, MiB, GiB, TiB, "
                 "KB, MB, GB, TB), 1 MiB .. the memory this process may use (physical memory or "
                 "its cgroup's limit) less 64 MiB; allocated and pinned at start")
      // An example that is accepted: 1000000 was, but is below 1 MiB (newcomer 16 F9).
      ->check(ByteCount("64GiB, 512MiB, 1073741824", /*capacity_bounds=*/true));
  std::string max_registration = "1GiB";
  app.add_option("--max-registration-bytes", max_registration,
                 "Most memory model registrations (parsed rotation files) may hold outside "
                 "--capacity; past it, registrations without stored blocks or open puts are "
                 "freed least recently used first, else RegisterModel is refused "
                 "(RESOURCE_EXHAUSTED). Same units as --capacity")
      ->capture_default_str()
      ->check(ByteCount("1GiB, 512MiB", /*capacity_bounds=*/false));
  // Checked by the flag (newcomer s14 #2): the server's own check ("cannot start: ... expected
  // \"ucx\" or \"none\"") ran after parsing, so a --config file's bad value was not named
  // with the file and its key, and --help did not list the choices.
  app.add_option("--data-plane", o.data_plane,
                 "ucx (pinned host memory registered with UCX) or none (heap; control plane only)")
      ->check(CLI::IsMember({"ucx", "none"}))
      ->capture_default_str();
  app.add_option("--ucx-tls", o.ucx_tls,
                 "UCX_TLS for the data plane, e.g. tcp or posix,cma "
                 "(empty = UCX default)");
  app.add_option("--transfer-initiator", o.transfer_initiator,
                 "Who starts RMA transfers: pool (clients call WritePut/ReadLeased; a client "
                 "killed mid-transfer cannot abort the pool over tcp), client (clients put/get "
                 "the pool's memory themselves), or auto (pool when --ucx-tls may let UCX use tcp: "
                 "empty, all, an item naming tcp, or a ^ list keeping it; else client)")
      ->check(CLI::IsMember({"auto", "pool", "client"}))
      ->capture_default_str();
  app.add_option("--high-watermark", o.store.high_watermark,
                 "Eviction starts above this fraction of capacity (>= --low-watermark)")
      ->check(WatermarkFraction(/*low=*/false));
  app.add_option("--low-watermark", o.store.low_watermark,
                 "Eviction (at the high watermark or when an allocation fails) frees down to "
                 "this fraction of capacity (<= --high-watermark; a failed allocation further "
                 "only as far as its request needs)")
      ->check(WatermarkFraction(/*low=*/true));
  app.add_option("--put-timeout-ms", put_timeout_ms,
                 "Default lifetime of an uncommitted put before its staging is reclaimed")
      ->check(kvpool::cli::Range(int64_t{1}, int64_t{3600000}));
  app.add_option("--lease-ms", lease_ms, "Default lease lifetime")
      ->check(kvpool::cli::Range(int64_t{1}, int64_t{3600000}));
  app.add_option("--max-lease-ms", max_lease_ms, "Longest lease a client may request")
      ->check(kvpool::cli::Range(int64_t{1}, int64_t{86400000}));
  app.add_option("--max-put-blocks", o.store.max_put_blocks,
                 "Most blocks one put writes (blocks the pool holds already do not count)")
      ->check(kvpool::cli::Range(uint32_t{1}, uint32_t{1} << 24));
  app.add_option("--tick-ms", tick_ms, "Period of expiry and watermark eviction")
      ->check(kvpool::cli::Range(int64_t{1}, int64_t{60000}));
  app.add_option("--drain-ms", drain_ms,
                 "On SIGTERM: how long in-flight calls may take before they are cancelled")
      ->check(kvpool::cli::Range(int64_t{0}, int64_t{600000}));
  app.add_option("--readiness-delay-ms", readiness_delay_ms,
                 "On SIGTERM: time between readiness off and refusing new calls (lets load "
                 "balancers stop routing)")
      ->check(kvpool::cli::Range(int64_t{0}, int64_t{600000}));
  app.add_option("--rotation-dir", o.rotation_dir,
                 "Directory whose files RegisterModel's rotation_path may name (relative paths "
                 "are taken from it; symbolic links must stay inside it). Empty = the pool reads "
                 "no rotation file for a client: rotation_path is refused and clients send the "
                 "file's bytes (rotation_file)")
      ->check(ExistingDirectoryOrEmpty());
  app.add_option("--corruption-report-rate", o.store.corruption_reports_per_second,
                 "ReportCorrupt: re-verified reports per second each client host may send "
                 "(token bucket; more are refused with RESOURCE_EXHAUSTED and counted in "
                 "kvpool_corruption_reports_dropped_total{reason=\"rate\"}); 0 = no limit; "
                 "fractions allowed")
      ->capture_default_str()
      // The project's range check (kvpool/common/cli.h), as for every other number: CLI11's
      // printed "[0 - 1e+09]" and "Value -1 not in range 0.000000 to 1000000000.000000".
      ->check(kvpool::cli::Range(0.0, 1e9));
  app.add_option("--corruption-report-burst", o.store.corruption_report_burst,
                 "ReportCorrupt: most re-verified reports a client host may send at once (the "
                 "bucket's size; default one full call)")
      ->capture_default_str()
      ->check(kvpool::cli::Range(uint32_t{1}, uint32_t{1} << 20));
  std::string commit_device = "auto";
  app.add_option("--commit-device", commit_device,
                 "Where commits rotate and quantize: auto (the GPU when this build has CUDA and "
                 "a compute-capability-9.0 device is present, else the CPU), cpu, or gpu (start-up "
                 "fails without a usable GPU); /metrics kvpool_commit_device says which is used")
      ->check(CLI::IsMember({"auto", "cpu", "gpu"}));
  // The watermarks' order is a usage error found with the flags (newcomer s8 N1): the store's
  // own check ran only after the pool memory was allocated and zeroed (1.2-2.8 s for the default
  // 1 GiB) and said "0 < low-watermark" while the flags take [0.5, 1]. Each flag's range is
  // checked by its validator; this checks the pair, whichever of command line, --config file or
  // default gave each value.
  app.callback([&o] {
    if (o.store.low_watermark > o.store.high_watermark) {
      throw CLI::ValidationError(
          "--low-watermark",
          absl::StrCat(o.store.low_watermark, " is above --high-watermark ", o.store.high_watermark,
                       ": eviction starts above the high watermark and frees down to the low "
                       "one, so the low one must not exceed it (each in [0.5, 1]; lower "
                       "--low-watermark or raise --high-watermark)"));
    }
  });
  KVPOOL_CLI_PARSE(app, argc, argv);
  o.store.commit_device = *kvpool::kvstore::ParseCommitDevice(commit_device);

  // Checked by ByteCount at parse time.
  ParseBytes(capacity, &o.capacity_bytes);
  ParseBytes(max_registration, &o.store.max_registration_bytes);
  // Each bound holds alone; together they may not (newcomer report 13b): registrations are
  // allocated as models register, so this is a warning, not a refusal.
  if (const std::optional<uint64_t> room = PoolRoom();
      room && o.capacity_bytes < *room &&
      o.store.max_registration_bytes > *room - o.capacity_bytes) {
    const kvpool::kvstore::MemoryLimit& limit = UsableMemory();
    std::fprintf(stderr,
                 "kvpool-server: warning: --capacity %s and --max-registration-bytes %s together "
                 "exceed what this process may use (%llu bytes, %s, less 64 MiB): registrations "
                 "past %llu bytes would run into that limit\n",
                 capacity.c_str(), max_registration.c_str(),
                 static_cast<unsigned long long>(limit.bytes), limit.source.c_str(),
                 static_cast<unsigned long long>(*room - o.capacity_bytes));
  }
  // Allowed, but warned before the allocation that may be the process's last act: other
  // processes hold memory now (the check above is against the limit, not what is free).
  // Available now: MemAvailable, or less where the limiting cgroup's other processes already use
  // part of its limit (newcomer report 13b: a 1 GiB pool in a 1.5 GiB cgroup holding 900 MiB
  // started unwarned and the kernel killed the other process).
  {
    uint64_t avail = kvpool::kvstore::MemAvailableBytes();
    std::string where = "MemAvailable in /proc/meminfo";
    if (const kvpool::kvstore::MemoryLimit& limit = UsableMemory();
        limit.used > 0 && limit.used < limit.bytes &&
        (avail == 0 || limit.bytes - limit.used < avail)) {
      avail = limit.bytes - limit.used;
      where = absl::StrCat(limit.source, " less the ", limit.used, " bytes its cgroup uses now");
    }
    if (avail > 0 && o.capacity_bytes > avail) {
      std::fprintf(stderr,
                   "kvpool-server: warning: --capacity %s (%llu bytes) is more than the memory "
                   "available now (%llu bytes: %s); the pool allocates and pins all of it at "
                   "start: expect swapping or the OOM killer\n",
                   capacity.c_str(), static_cast<unsigned long long>(o.capacity_bytes),
                   static_cast<unsigned long long>(avail), where.c_str());
    }
  }
  // A default lease longer than the longest one a client may request contradicts itself; the
  // pool used to raise the maximum silently.
  // Values from the --config file are named with it, as single-value errors are (newcomer 17
  // F5: these two cross-flag errors did not say the values came from the file).
  auto sources = [&](std::initializer_list<const char*> flags) {
    std::string out;
    for (const char* f : flags) {
      const std::string from = kvpool::cli::ConfigSourceOf(app, f, argc, argv);
      if (!from.empty()) absl::StrAppend(&out, out.empty() ? " (" : "; ", f, " from ", from);
    }
    return out.empty() ? out : out + ")";
  };
  if (lease_ms > max_lease_ms) {
    std::fprintf(stderr,
                 "kvpool-server: --lease-ms %lld is longer than --max-lease-ms %lld%s: the default "
                 "lease must not exceed the maximum (raise --max-lease-ms or lower --lease-ms)\n"
                 "Run with --help for more information.\n",
                 static_cast<long long>(lease_ms), static_cast<long long>(max_lease_ms),
                 sources({"--lease-ms", "--max-lease-ms"}).c_str());
    return kvpool::cli::kExitUsage;
  }
  o.store.default_put_timeout = absl::Milliseconds(put_timeout_ms);
  o.store.max_put_timeout = std::max(absl::Minutes(10), o.store.default_put_timeout);
  o.store.default_lease = absl::Milliseconds(lease_ms);
  o.store.max_lease = absl::Milliseconds(max_lease_ms);
  o.tick_interval = absl::Milliseconds(tick_ms);

  auto server = kvpool::kvstore::PoolServer::Create(o);
  if (!server.ok()) {
    // Straight to stderr, whatever --log-level says: a pool that exits 2 must say why.
    std::fprintf(stderr, "kvpool-server: cannot start: %s%s\n", server.status().ToString().c_str(),
                 absl::StrContains(server.status().message(), "metrics-port")
                     ? sources({"--listen", "--metrics-port"}).c_str()
                     : "");
    return server.status().code() == absl::StatusCode::kInvalidArgument ? kvpool::cli::kExitUsage
                                                                        : kvpool::cli::kExitRuntime;
  }
  // One line on stdout with the bound ports, for scripts and tests that pass port 0.
  std::printf("grpc_port=%d metrics_port=%d\n", (*server)->grpc_port(), (*server)->metrics_port());
  std::fflush(stdout);

  int sig = 0;
  while (sigwait(&signals, &sig) == 0 && sig == SIGHUP) {
    KVPOOL_LOG_WARN("SIGHUP ignored: no configuration reload; SIGTERM or SIGINT drains and exits");
  }
  KVPOOL_LOG_INFO(
      "signal {}: draining: readiness off; new calls are still served for --readiness-delay-ms "
      "{} ms{}, then in-flight calls get --drain-ms {} ms",
      sig, readiness_delay_ms,
      readiness_delay_ms > 0 ? " (a second SIGTERM or SIGINT ends that delay)" : "", drain_ms);
  (*server)->MarkNotReady();
  // The readiness delay waits for the signals too: a second SIGTERM/SIGINT ends it (an
  // operator's second Ctrl-C during a delay of up to 10 minutes was silently ignored: newcomer
  // report 11 F9); SIGHUP stays ignored.
  const absl::Time ready_end = absl::Now() + absl::Milliseconds(readiness_delay_ms);
  for (absl::Duration left = ready_end - absl::Now(); left > absl::ZeroDuration();
       left = ready_end - absl::Now()) {
    const timespec ts = absl::ToTimespec(left);
    const int s = sigtimedwait(&signals, nullptr, &ts);
    if (s == SIGHUP) {
      KVPOOL_LOG_WARN("SIGHUP ignored while draining");
    } else if (s > 0) {
      KVPOOL_LOG_WARN(
          "signal {} again: the rest of --readiness-delay-ms ({} ms) skipped; new calls "
          "are refused now",
          s, absl::ToInt64Milliseconds(ready_end - absl::Now()));
      break;
    } else if (errno != EINTR) {
      break;  // EAGAIN: the delay is over
    }
  }
  // During the drain (at most --drain-ms) further signals are logged, saying what they do.
  std::atomic<bool> drained{false};
  std::thread watcher([&] {
    while (!drained.load()) {
      const timespec tick = absl::ToTimespec(absl::Milliseconds(100));
      const int s = sigtimedwait(&signals, nullptr, &tick);
      if (s == SIGHUP) {
        KVPOOL_LOG_WARN("SIGHUP ignored while draining");
      } else if (s > 0) {
        KVPOOL_LOG_WARN(
            "signal {} during the drain: nothing more to skip; in-flight calls get at "
            "most --drain-ms {} ms in all, then the pool exits (SIGKILL stops it at "
            "once)",
            s, drain_ms);
      }
    }
  });
  (*server)->Shutdown(absl::Milliseconds(drain_ms));
  drained.store(true);
  watcher.join();
  return kvpool::cli::kExitOk;
}
