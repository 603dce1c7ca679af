// kvpool/kvstore/server.h — the pool process: block store + gRPC service (kvpool.v1.KvPool,
// grpc.health.v1.Health, reflection) + Prometheus /metrics over HTTP + the UCX data plane.
// No gRPC, UCX or HTTP header is included here.
//
//   PoolServerOptions o; o.listen = "127.0.0.1:0"; o.capacity_bytes = 64 << 20;
//   KVPOOL_ASSIGN_OR_RETURN(auto server, PoolServer::Create(o));   // listening, ready
//   ... server->grpc_port() ...
//   server->Shutdown(absl::Seconds(10));   // readiness off, drain in-flight calls, stop
//
// Health: service "" and "kvpool.v1.KvPool" report SERVING while ready and NOT_SERVING once
// draining (readiness); service "liveness" reports SERVING until the process stops.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpool/kvstore/store.h"

namespace kvpool::transport {
class Transport;
}  // namespace kvpool::transport

namespace kvpool::kvstore {

struct PoolServerOptions {
  // gRPC address "HOST:PORT"; port 0 picks a free port (see grpc_port()). /metrics listens on
  // the same host. The wildcards 0.0.0.0, [::] and [::ffff:0.0.0.0] all mean every interface of
  // both families ([::] dual-stack; 0.0.0.0 only on a host without IPv6), because gRPC listens
  // that way on any of them; a specific address listens on that address only. Default
  // 0.0.0.0:7070.
  std::string listen = "0.0.0.0:7070";
  // HTTP port for /metrics; 0 picks a free port; -1 disables; other values outside 1..65535
  // make Create fail with INVALID_ARGUMENT. Default 9090.
  int metrics_port = 9090;
  // Bytes of pool memory (blocks and staging). Default 1 GiB.
  uint64_t capacity_bytes = 1ull << 30;
  // Data plane: "ucx" (pinned host memory registered with UCX; peers use RMA) or "none" (heap
  // memory; only for tests of the control plane). Default "ucx" when the transport library is
  // built, else "none".
  std::string data_plane = "ucx";
  // UCX_TLS for the data plane ("" = UCX's default). Default "".
  std::string ucx_tls;
  // Who initiates RMA transfers: "client" (clients put into staging and get leased forms
  // themselves), "pool" (clients call WritePut/ReadLeased and the pool gets/puts; a client dying
  // mid-transfer then fails only the pool's own request), or "auto": "pool" when `ucx_tls` may
  // let UCX use tcp (UcxTlsMayUseTcp) — UCX 1.13 emulates RMA over tcp with messages the target
  // answers, and a target answering a dead client aborts (docs/TRANSPORT.md) — else "client".
  // "client" with such a list starts, with a warning. Default "auto".
  std::string transfer_initiator = "auto";
  // Tests: builds the data plane instead of CreateUcxTransport (e.g. a FakeFabric transport).
  // Ignored unless data_plane is "ucx". Default: none.
  std::function<absl::StatusOr<std::unique_ptr<transport::Transport>>()> transport_factory;
  // The directory RegisterModelRequest.rotation_path may name a file in (a relative path is
  // taken from it; symbolic links are resolved and must stay inside it). "" = rotation_path is
  // refused with FAILED_PRECONDITION and clients send the bytes (rotation_file) or a
  // rotation_id. Create fails with INVALID_ARGUMENT when it is set but not a directory.
  // Default "".
  std::string rotation_dir;
  // Period of lease/put expiry and watermark eviction. Default 100 ms.
  absl::Duration tick_interval = absl::Milliseconds(100);
  StoreOptions store;
};

// Whether a UCX_TLS value may let UCX pick tcp: "" (UCX's default: every transport), a list with
// "all" or an item naming tcp ("tcp", "tcp_sockcm"), or an exclusion list ("^…") that does not
// exclude tcp. Items are compared as UCX compares them: exactly (case-sensitive, untrimmed), so
// "^TCP" excludes nothing and "posix, tcp" names no tcp. Pure; thread-safe.
bool UcxTlsMayUseTcp(std::string_view ucx_tls);

class PoolServer {
 public:
  // Builds the store and the data plane, starts gRPC, the metrics endpoint and the tick thread.
  // Errors: INVALID_ARGUMENT (options, naming the flag), UNAVAILABLE (cannot bind a port),
  // RESOURCE_EXHAUSTED (capacity cannot be allocated), INTERNAL (UCX).
  static absl::StatusOr<std::unique_ptr<PoolServer>> Create(const PoolServerOptions& options);
  ~PoolServer();  // Shutdown(0) if still running

  int grpc_port() const;
  int metrics_port() const;  // -1 when disabled
  // The data plane's sealed UCX worker address ("" with --data-plane none). Handed to clients
  // in RegisterModelResponse only when they initiate transfers; for operators and tests.
  const std::string& ucx_worker_address() const;
  BlockStore& store();
  // Readiness off (health NOT_SERVING) while still serving calls; Shutdown follows.
  void MarkNotReady();
  // Readiness off; in-flight calls get until `grace` to finish, then are cancelled; stops
  // every thread. Idempotent; thread-safe.
  void Shutdown(absl::Duration grace);
  // Blocks until Shutdown has completed.
  void Wait();

  struct Impl;

 private:
  explicit PoolServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The Prometheus text of a store (its metrics plus gauges from Stats()).
std::string RenderStoreMetrics(BlockStore& store);

}  // namespace kvpool::kvstore
