// The pool process (server.h): store + gRPC (service, health, reflection) + /metrics + ticks.
#include "kvpool/kvstore/server.h"

#include <arpa/inet.h>
#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/codegen/service_type.h>
#include <grpcpp/support/server_interceptor.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kvpool/common/host_port.h"
#include "kvpool/common/log.h"
#include "kvpool/common/status.h"
#include "rotation_source.h"
#include "service.h"

#if defined(KVPOOL_HAVE_TRANSPORT)
#include "kvpool/transport/transport.h"
#include "kvpool/transport/ucx_transport.h"
#endif

namespace kvpool::kvstore {
namespace {

constexpr char kServiceName[] = "kvpool.v1.KvPool";
constexpr char kLivenessName[] = "liveness";

#if defined(KVPOOL_HAVE_TRANSPORT)
// Pool memory backed by a UCX-registered region (pinned when the process may lock memory).
class RegionPoolMemory final : public PoolMemory {
 public:
  explicit RegionPoolMemory(std::shared_ptr<transport::MemoryRegion> r) : region_(std::move(r)) {}
  uint8_t* data() const override { return region_->data(); }
  size_t size() const override { return region_->size(); }
  uint64_t remote_address() const override { return region_->address(); }
  const std::string& packed_rkey() const override { return region_->packed_rkey(); }

 private:
  std::shared_ptr<transport::MemoryRegion> region_;
};
#endif

// The /metrics HTTP server: worker threads (each serves one connection at a time) and the
// seconds a read, a write or an idle keep-alive connection may take.
constexpr size_t kMetricsHttpThreads = 32;
constexpr time_t kMetricsHttpTimeoutSec = 2;

// Why binding TCP `host`:`port` fails, found by trying it (gRPC's and cpp-httplib's bind errors
// do not reach the caller): ", <strerror>" such as ", Address already in use", ", host does not
// resolve (<gai_strerror>)", or "" when the probe binds (the failure was elsewhere).
std::string BindFailureReason(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
      rc != 0 || res == nullptr) {
    return absl::StrCat(", host does not resolve (", rc != 0 ? gai_strerror(rc) : "no address",
                        ")");
  }
  std::string reason;
  int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  if (fd >= 0) {
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (bind(fd, res->ai_addr, res->ai_addrlen) != 0) {
      reason = absl::StrCat(", ", std::strerror(errno));
    }
    close(fd);
  }
  freeaddrinfo(res);
  return reason;
}

// True for the "any address" hosts 0.0.0.0, :: and ::ffff:0.0.0.0. gRPC's POSIX TCP server
// treats each of them as one family-agnostic wildcard: it listens on [::] with IPV6_V6ONLY off
// (IPv4 and IPv6 on one socket) and only falls back to 0.0.0.0 when the host has no IPv6
// (grpc/grpc src/core/lib/iomgr/tcp_server_posix.cc, add_wildcard_addrs_to_server).
bool IsWildcardHost(const std::string& host) {
  in_addr a4{};
  if (inet_pton(AF_INET, host.c_str(), &a4) == 1) return a4.s_addr == htonl(INADDR_ANY);
  in6_addr a6{};
  if (inet_pton(AF_INET6, host.c_str(), &a6) != 1) return false;
  if (IN6_IS_ADDR_UNSPECIFIED(&a6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr32[3] == 0;
}

// Whether this host can open an IPv6 socket (false where IPv6 is disabled or not built in).
bool HostHasIpv6() {
  const int fd = socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

}  // namespace

std::string RenderStoreMetrics(BlockStore& store) {
  const StoreStats s = store.Stats();
  std::vector<GaugeSample> g = {
      {"kvpool_capacity_bytes", "Pool memory in bytes.", "", double(s.capacity_bytes)},
      {"kvpool_used_bytes", "Bytes allocated (forms and staging).", "", double(s.used_bytes)},
      {"kvpool_staging_bytes", "Bytes reserved by open puts.", "", double(s.staging_bytes)},
      {"kvpool_blocks", "Resident blocks.", "", double(s.blocks)},
      {"kvpool_forms", "Stored forms by kind.", "form=\"bf16\"", double(s.forms[0])},
      {"kvpool_forms", "", "form=\"int2\"", double(s.forms[1])},
      {"kvpool_form_bytes", "Bytes of stored forms by kind.", "form=\"bf16\"",
       double(s.form_bytes[0])},
      {"kvpool_form_bytes", "", "form=\"int2\"", double(s.form_bytes[1])},
      {"kvpool_open_puts", "Puts begun and not yet committed, aborted or expired.", "",
       double(s.open_puts)},
      {"kvpool_leases", "Active leases.", "", double(s.leases)},
      {"kvpool_models", "Registered models.", "", double(s.models)},
      {"kvpool_registration_bytes",
       "Bytes held by model registrations (rotations), bounded by --max-registration-bytes.", "",
       double(s.registration_bytes)},
      {"kvpool_commit_device", "Where commits rotate and quantize (1 = in use).", "device=\"cpu\"",
       s.commit_device == "cpu" ? 1.0 : 0.0},
      {"kvpool_commit_device", "", "device=\"gpu\"", s.commit_device == "gpu" ? 1.0 : 0.0},
  };
  return RenderPrometheus(store.metrics(), g);
}

// Calls the gRPC server is running (every service: the pool's, health, reflection), counted by
// a server interceptor that lives as long as its call, so that a drain can end once they are
// done. Thread-safe.
class InFlightCalls {
 public:
  void Begin() {
    std::lock_guard l(mu_);
    ++count_;
  }
  void End() {
    std::lock_guard l(mu_);
    if (--count_ == 0) cv_.notify_all();
  }
  // Blocks until no call runs or `deadline` passes; true when none runs.
  bool WaitIdle(absl::Time deadline) {
    std::unique_lock l(mu_);
    return cv_.wait_until(l, absl::ToChronoTime(deadline), [this] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t count_ = 0;  // guarded by mu_
};

class CountingInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit CountingInterceptor(InFlightCalls* calls) : calls_(calls) { calls_->Begin(); }
  ~CountingInterceptor() override { calls_->End(); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  InFlightCalls* calls_;
};

class CountingInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CountingInterceptorFactory(InFlightCalls* calls) : calls_(calls) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo*) override {
    return new CountingInterceptor(calls_);
  }

 private:
  InFlightCalls* calls_;
};

struct PoolServer::Impl {
  PoolServerOptions options;
#if defined(KVPOOL_HAVE_TRANSPORT)
  std::unique_ptr<transport::Transport> transport;  // destroyed after the store (declared first)
#endif
  std::unique_ptr<PoolMemory> memory;
  std::unique_ptr<BlockStore> store;
  std::unique_ptr<grpc::Service> service;
  InFlightCalls in_flight;  // outlives grpc_server (declared first), whose calls count into it
  std::unique_ptr<grpc::Server> grpc_server;
  int grpc_port = 0;
  httplib::Server http;
  int http_port = -1;
  std::string worker_address;  // sealed UCX worker address, "" without a data plane
  std::thread http_thread;
  std::thread tick_thread;

  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;  // guarded by mu
  bool stopped = false;   // guarded by mu

  void TickLoop() {
    std::unique_lock l(mu);
    while (!stopping) {
      cv.wait_for(l, absl::ToChronoMilliseconds(options.tick_interval));
      if (stopping) {
        break;
      }
      l.unlock();
      store->Tick();
      l.lock();
    }
  }
};

PoolServer::PoolServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PoolServer::~PoolServer() { Shutdown(absl::ZeroDuration()); }

int PoolServer::grpc_port() const { return impl_->grpc_port; }
int PoolServer::metrics_port() const { return impl_->http_port; }
const std::string& PoolServer::ucx_worker_address() const { return impl_->worker_address; }
BlockStore& PoolServer::store() { return *impl_->store; }

bool UcxTlsMayUseTcp(std::string_view ucx_tls_std) {
  absl::string_view ucx_tls(ucx_tls_std.data(), ucx_tls_std.size());
  if (ucx_tls.empty()) return true;
  const bool exclude = absl::ConsumePrefix(&ucx_tls, "^");
  bool names_tcp = false;
  // Items as UCX reads them: exact, case-sensitive, untrimmed (newcomer report 13b: "^TCP" and
  // "^ tcp" exclude nothing in UCX, which warns "transport 'TCP' is not available", so tcp
  // stayed usable while this said it was excluded).
  for (absl::string_view item : absl::StrSplit(ucx_tls, ',')) {
    if (item == "all") return !exclude;  // everything, or nothing
    if (absl::StartsWith(item, "tcp")) names_tcp = true;
  }
  return exclude ? !names_tcp : names_tcp;
}

absl::StatusOr<std::unique_ptr<PoolServer>> PoolServer::Create(const PoolServerOptions& o) {
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  if (o.capacity_bytes == 0) {
    return absl::InvalidArgumentError("capacity: must be > 0");
  }
  KVPOOL_ASSIGN_OR_RETURN(const HostPort listen, ParseHostPort("listen", o.listen, 0));
  if (o.metrics_port < -1 || o.metrics_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics-port: expected -1 (off), 0 (any free port) or 1..65535, got ", o.metrics_port));
  }

  // A configuration conflict, not a busy port: INVALID_ARGUMENT (kvpool-server exits 1).
  if (o.metrics_port > 0 && o.metrics_port == listen.port) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics-port: ", o.metrics_port, " is the gRPC port of --listen ", o.listen,
                     " (give them different ports; -1 turns metrics off)"));
  }

  KVPOOL_ASSIGN_OR_RETURN(const std::string rotation_dir, CanonicalRotationDir(o.rotation_dir));

  // Data plane memory.
  std::string worker_address;
  if (o.transfer_initiator != "auto" && o.transfer_initiator != "pool" &&
      o.transfer_initiator != "client") {
    return absl::InvalidArgumentError(absl::StrCat(
        "transfer-initiator: expected auto, pool or client, got \"", o.transfer_initiator, "\""));
  }
  bool pool_initiates = o.transfer_initiator == "pool";
  if (o.transfer_initiator == "auto") {
    pool_initiates = UcxTlsMayUseTcp(o.ucx_tls);
  }
#if defined(KVPOOL_HAVE_TRANSPORT)
  std::shared_ptr<transport::MemoryRegion> arena;
#else
  (void)pool_initiates;
#endif
  if (o.data_plane == "ucx") {
#if defined(KVPOOL_HAVE_TRANSPORT)
    if (o.transport_factory) {
      KVPOOL_ASSIGN_OR_RETURN(impl->transport, o.transport_factory());
    } else {
      auto t = transport::CreateUcxTransport({.tls = o.ucx_tls});
      if (!t.ok()) {
        // UCX rejects an unknown transport only when it finds no device for it (ucp_init: No
        // such device), so name the flag: the code stays the transport's (runtime) one.
        return absl::Status(
            t.status().code(),
            absl::StrCat(o.ucx_tls.empty() ? std::string("--ucx-tls (UCX default)")
                                           : absl::StrCat("--ucx-tls '", o.ucx_tls, "'"),
                         ": ", t.status().message()));
      }
      impl->transport = *std::move(t);
    }
    KVPOOL_ASSIGN_OR_RETURN(arena, impl->transport->AllocateMemory(o.capacity_bytes));
    impl->memory = std::make_unique<RegionPoolMemory>(arena);
    worker_address = impl->transport->WorkerAddress();
#else
    return absl::InvalidArgumentError(
        "data-plane: this build has no transport library; use --data-plane=none");
#endif
  } else if (o.data_plane == "none") {
    KVPOOL_ASSIGN_OR_RETURN(impl->memory, HeapPoolMemory::Create(o.capacity_bytes));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("data-plane: expected \"ucx\" or \"none\", got \"", o.data_plane, "\""));
  }
  KVPOOL_ASSIGN_OR_RETURN(impl->store,
                          BlockStore::Create(o.store, impl->memory.get(), Clock::Real()));

  ServiceContext ctx;
  ctx.store = impl->store.get();
  ctx.ucx_worker_address = worker_address;
  ctx.rotation_dir = rotation_dir;
  ctx.tag_tombstone_life = o.store.max_put_timeout;
  impl->worker_address = worker_address;
#if defined(KVPOOL_HAVE_TRANSPORT)
  ctx.transport = impl->transport.get();
  ctx.arena = arena;
  ctx.pool_initiates_transfers = pool_initiates && impl->transport != nullptr;
#endif
  ctx.pool_epoch = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  if (ctx.pool_epoch == 0) {
    ctx.pool_epoch = 1;
  }
  impl->service = MakeKvPoolService(ctx);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default, which lets a second pool bind the same port and steal
  // half of the connections; a busy port must be a start-up error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(o.listen, grpc::InsecureServerCredentials(), &impl->grpc_port);
  builder.RegisterService(impl->service.get());
  builder.SetMaxReceiveMessageSize(256 << 20);  // rotation files of large models
  {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> counting;
    counting.push_back(std::make_unique<CountingInterceptorFactory>(&impl->in_flight));
    builder.experimental().SetInterceptorCreators(std::move(counting));
  }
  impl->grpc_server = builder.BuildAndStart();
  if (!impl->grpc_server || impl->grpc_port == 0) {
    std::string reason = BindFailureReason(listen.host, listen.port);
    if (reason.empty()) reason = ", reason unknown (a probe bind of the port succeeded)";
    return absl::UnavailableError(absl::StrCat("listen: cannot bind ", o.listen, reason));
  }
  auto* health = impl->grpc_server->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(kServiceName, true);
  health->SetServingStatus(kLivenessName, true);

  if (o.metrics_port >= 0) {
    Impl* raw = impl.get();
    raw->http.Get("/metrics", [raw](const httplib::Request&, httplib::Response& res) {
      res.set_content(RenderStoreMetrics(*raw->store), "text/plain; version=0.0.4");
    });
    // /metrics follows gRPC's rule for the listen host (IsWildcardHost): a wildcard host means
    // every interface of both families, [::] dual-stack, or 0.0.0.0 on a host without IPv6, so
    // that one firewall rule (or one specific --listen address) covers both ports.
    const bool wildcard = IsWildcardHost(listen.host);
    const std::string mhost = wildcard                     ? (HostHasIpv6() ? "::" : "0.0.0.0")
                              : listen.host == "localhost" ? "127.0.0.1"
                                                           : listen.host;
    // cpp-httplib's default socket options set SO_REUSEPORT, which lets a second pool bind the
    // same metrics port and split the scrapes between two processes; SO_REUSEADDR alone lets a
    // restarted pool rebind while old connections sit in TIME_WAIT, and nothing more.
    // cpp-httplib serves each connection on one thread of a fixed pool (8 by default) and
    // waits up to 5 s for every read, so 8 connections sending an unfinished request starved
    // every scrape for seconds. More workers and shorter read/keep-alive timeouts raise the bar;
    // a client trickling bytes still holds a worker, so /metrics is for a scraper on a trusted
    // network (docs/OPERATIONS.md).
    raw->http.new_task_queue = [] { return new httplib::ThreadPool(kMetricsHttpThreads); };
    raw->http.set_read_timeout(kMetricsHttpTimeoutSec, 0);
    raw->http.set_write_timeout(kMetricsHttpTimeoutSec, 0);
    raw->http.set_keep_alive_timeout(kMetricsHttpTimeoutSec);
    raw->http.set_socket_options([wildcard](int sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
      if (wildcard) {
        // Dual-stack whatever net.ipv6.bindv6only says, as gRPC does (a no-op on AF_INET).
        int no = 0;
        setsockopt(sock, IPPROTO_IPV6, IPV6_V6ONLY, &no, sizeof(no));
      }
    });
    if (o.metrics_port == 0) {
      raw->http_port = raw->http.bind_to_any_port(mhost);
    } else {
      raw->http_port = raw->http.bind_to_port(mhost, o.metrics_port) ? o.metrics_port : -1;
    }
    if (raw->http_port <= 0) {
      // Probe before the gRPC server lets its port go: the metrics port may be the gRPC one.
      std::string reason = BindFailureReason(mhost, o.metrics_port);
      if (reason.empty()) reason = ", reason unknown (a probe bind of the port succeeded)";
      raw->grpc_server->Shutdown();
      return absl::UnavailableError(absl::StrCat("metrics-port: cannot bind ",
                                                 FormatHostPort(mhost, o.metrics_port), reason));
    }
    raw->http_thread = std::thread([raw] { raw->http.listen_after_bind(); });
  }
  Impl* raw = impl.get();
  raw->tick_thread = std::thread([raw] { raw->TickLoop(); });
  if (o.data_plane == "ucx" && !ctx.pool_initiates_transfers && UcxTlsMayUseTcp(o.ucx_tls)) {
    KVPOOL_LOG_WARN(
        "--transfer-initiator client with --ucx-tls '{}', which lets UCX use tcp: a client killed "
        "in the middle of an RMA transfer over tcp can abort this pool and lose every stored "
        "block (UCX 1.13 emulates RMA over tcp with messages the pool answers; docs/TRANSPORT.md). "
        "Use --transfer-initiator pool (or auto), or a --ucx-tls without tcp",
        o.ucx_tls);
  }
  KVPOOL_LOG_INFO(
      "kvpool-server ready: grpc {}{} metrics {} capacity {} bytes data-plane {} transfers "
      "initiated by the {} rotation_path {}",
      // An IPv6 host in brackets, as --listen takes it ("grpc :::47120" could not be pasted
      // back: newcomer s9b #6).
      FormatHostPort(listen.host, raw->grpc_port),
      IsWildcardHost(listen.host) ? " (every interface, IPv4 and IPv6)" : "", raw->http_port,
      o.capacity_bytes, o.data_plane, ctx.pool_initiates_transfers ? "pool" : "client",
      rotation_dir.empty() ? std::string("refused (no --rotation-dir)")
                           : absl::StrCat("under ", rotation_dir));
  return std::unique_ptr<PoolServer>(new PoolServer(std::move(impl)));
}

void PoolServer::MarkNotReady() {
  auto* health = impl_->grpc_server->GetHealthCheckService();
  health->SetServingStatus(kServiceName, false);
  health->SetServingStatus("", false);
}

void PoolServer::Shutdown(absl::Duration grace) {
  {
    std::lock_guard l(impl_->mu);
    if (impl_->stopping) {
      return;
    }
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  auto* health = impl_->grpc_server->GetHealthCheckService();
  health->SetServingStatus(kServiceName, false);
  health->SetServingStatus("", false);
  // Finish in-flight calls (new ones are refused), cancel what is left at the deadline. gRPC's
  // Shutdown(deadline) also waits for every client connection to close after its GOAWAY, so a
  // client that keeps an idle connection open (stopped, hung, or one that simply does not close
  // it) held every drain to the full `grace` with nothing running. So Shutdown runs on its own
  // thread while this one waits for the calls alone; once none runs, the remaining connections
  // are cut (grpc_server_cancel_all_calls: no call is left to cancel), which lets Shutdown
  // return. Repeated until it returns, since Shutdown's own start on its thread is not observable
  // (a cut before it started would let a connection in afterwards).
  const absl::Time deadline = absl::Now() + grace;
  std::atomic<bool> shut{false};
  std::thread stopper([this, deadline, &shut] {
    impl_->grpc_server->Shutdown(absl::ToChronoTime(deadline));
    shut.store(true);
  });
  while (!shut.load() && impl_->in_flight.WaitIdle(deadline)) {
    grpc_server_cancel_all_calls(impl_->grpc_server->c_server());
    absl::SleepFor(absl::Milliseconds(20));
  }
  stopper.join();
  impl_->grpc_server->Wait();
  if (impl_->http_thread.joinable()) {
    impl_->http.stop();
    impl_->http_thread.join();
  }
  if (impl_->tick_thread.joinable()) {
    impl_->tick_thread.join();
  }
  {
    std::lock_guard l(impl_->mu);
    impl_->stopped = true;
  }
  impl_->cv.notify_all();
  KVPOOL_LOG_INFO("kvpool-server stopped");
}

void PoolServer::Wait() {
  std::unique_lock l(impl_->mu);
  impl_->cv.wait(l, [this] { return impl_->stopped; });
}

}  // namespace kvpool::kvstore
