// Internal: the kvpool.v1.KvPool gRPC service over a BlockStore. Only service.cc includes the
// generated headers; this header forward-declares grpc::Service.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"

#include "kvpool/kvstore/store.h"

namespace grpc {
class Service;
}
namespace kvpool::transport {
class Transport;
class MemoryRegion;
}  // namespace kvpool::transport

namespace kvpool::kvstore {

struct ServiceContext {
  BlockStore* store = nullptr;  // not owned; outlives the service
  // The data plane's sealed worker address ("" without one). Sent in RegisterModelResponse only
  // when clients initiate transfers; WritePut/ReadLeased refuse it as a client's address.
  std::string ucx_worker_address;
  uint64_t pool_epoch = 0;  // random per process start
  // The pool's data plane for pool-initiated transfers (WritePut, ReadLeased): not owned,
  // outlives the service; null without a data plane. `arena` is the registered region behind
  // the store's PoolMemory (same data()).
  transport::Transport* transport = nullptr;
  std::shared_ptr<transport::MemoryRegion> arena;
  // Tell clients to use WritePut/ReadLeased instead of addressing the pool's memory.
  bool pool_initiates_transfers = false;
  // The only directory RegisterModelRequest.rotation_path may name a file in (realpath, from
  // CanonicalRotationDir in rotation_source.h); "" = the pool reads no rotation file for a
  // client (ResolveRotationPath refuses rotation_path).
  std::string rotation_dir;
  // How long an AbortPut by put_tag that came before its BeginPut keeps refusing it (protocol
  // v1.8): the store's longest put timeout (StoreOptions::max_put_timeout).
  absl::Duration tag_tombstone_life = absl::Minutes(10);
};

std::unique_ptr<grpc::Service> MakeKvPoolService(const ServiceContext& ctx);

// The client identity ReportCorrupt's rate limit is kept by, from a gRPC peer string
// (grpc::ServerContext::peer()): its host without the port — "ipv4:10.0.0.5:41234" →
// "10.0.0.5", "ipv6:[::1]:41234" → "[::1]" — so a client cannot get a fresh budget by
// reconnecting (every client of one host shares it); any other form ("unix:/path", "") as given.
std::string ReportClientIdentity(const std::string& peer);

}  // namespace kvpool::kvstore
