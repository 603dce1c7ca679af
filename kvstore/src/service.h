// Internal: the kvpool.v1.KvPool gRPC service over a BlockStore. Only service.cc includes the
// generated headers; this header forward-declares grpc::Service.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kvpool/kvstore/store.h"

namespace grpc {
class Service;
}

namespace kvpool::kvstore {

struct ServiceContext {
  BlockStore* store = nullptr;     // not owned; outlives the service
  std::string ucx_worker_address;  // the data plane's worker address ("" without one)
  std::string ucx_listen_address;  // "" (sockaddr listener not used)
  uint64_t pool_epoch = 0;         // random per process start
};

std::unique_ptr<grpc::Service> MakeKvPoolService(const ServiceContext& ctx);

}  // namespace kvpool::kvstore
