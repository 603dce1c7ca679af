// kvpool/transport/ucx_transport.h — the UCX implementation of kvpool::transport::Transport.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t,
//                           CreateUcxTransport({.tls = "tcp"}));
//
// One UCP context, one worker (UCS_THREAD_MODE_SINGLE) and one owner thread per transport;
// construction order config → context → worker → endpoints, teardown in exact reverse. The
// owner thread busy-polls for `busy_poll` after the last activity, then sleeps on the worker's
// event fd (UCP_FEATURE_WAKEUP) so an idle process does not burn a core.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpool/transport/transport.h"

namespace kvpool::transport {

struct UcxOptions {
  // Value for UCX_TLS, e.g. "tcp", "posix,cma", "sm", "rc,ud". Empty: the environment's UCX_TLS
  // (or UCX's default, all transports). A transport that cannot connect to the peer makes
  // Connect or transfers fail with UNAVAILABLE.
  std::string tls;
  // How long the owner thread keeps polling after the last activity before it sleeps on the
  // worker's event fd. Longer: lower latency, more CPU. Default 200 µs.
  absl::Duration busy_poll = absl::Microseconds(200);
  // Try mlock() on memory from AllocateMemory (page-locked host memory). Failure to lock (e.g.
  // RLIMIT_MEMLOCK) is logged once and not an error. Default true.
  bool lock_memory = true;
};

// Creates a UCX transport and starts its owner thread.
// Errors: INTERNAL when UCX cannot be initialised (message carries ucs_status_string),
// INVALID_ARGUMENT when `options.tls` is rejected by UCX.
absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxOptions& options);

// The installed UCX library version ("1.13.1").
std::string UcxVersion();

// Whether two sealed worker addresses (WorkerAddress() of UCX transports) name the same UCX
// worker: byte-equal, or both unseal as addresses and carry the same 64-bit worker uuid (UCX
// 1.13 packs it after a one-byte header, ucp/wireup/address.c; ucp_worker_address_query reports
// the same value as worker_uid). Only fixed offsets are read after the envelope's length and
// checksum checks: no UCX parser runs on the bytes. False for anything that does not unseal.
// Pure function, thread-safe.
bool SameUcxWorker(std::string_view a, std::string_view b);

}  // namespace kvpool::transport
