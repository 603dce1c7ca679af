// Internal: one small RAII type per UCX handle (STYLE.md: NIXL/UCX examples). Every method is
// called on the transport's owner thread only. Types that UCX callbacks point into are neither
// copyable nor movable.
//
// Construction order: UcxConfig → UcxContext → UcxWorker → UcxEndpoint / UcxMemHandle →
// UcxRkey; an owner declares them in that order so destruction runs in exact reverse.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ucp/api/ucp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvpool::transport::internal {

// Maps a UCX status to a canonical absl status (peer/connection errors → UNAVAILABLE,
// UCS_ERR_CANCELED → CANCELLED, invalid params → INVALID_ARGUMENT, others INTERNAL).
absl::Status FromUcs(ucs_status_t status, const char* what);

// ucp_config_t (read from the environment, then modified).
class UcxConfig {
 public:
  static absl::StatusOr<std::unique_ptr<UcxConfig>> Create(const std::string& tls);
  ~UcxConfig();
  UcxConfig(const UcxConfig&) = delete;
  UcxConfig& operator=(const UcxConfig&) = delete;
  ucp_config_t* get() const { return config_; }

 private:
  explicit UcxConfig(ucp_config_t* c) : config_(c) {}
  ucp_config_t* config_;
};

// ucp_context_h with RMA + WAKEUP features.
class UcxContext {
 public:
  static absl::StatusOr<std::unique_ptr<UcxContext>> Create(const UcxConfig& config);
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  ucp_context_h get() const { return context_; }
  bool SupportsCuda() const;

 private:
  explicit UcxContext(ucp_context_h c) : context_(c) {}
  ucp_context_h context_;
};

// ucp_worker_h (single-threaded) plus its packed address and event fd.
class UcxWorker {
 public:
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(const UcxContext& context);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;
  ucp_worker_h get() const { return worker_; }
  const std::string& address() const { return address_; }
  int event_fd() const { return event_fd_; }

 private:
  UcxWorker(ucp_worker_h w, std::string address, int fd)
      : worker_(w), address_(std::move(address)), event_fd_(fd) {}
  ucp_worker_h worker_;
  std::string address_;
  int event_fd_;
};

// Endpoint error state written by the UCX error callback (owner thread) and read by any
// thread. Pointed into by UCX: never moved.
struct EndpointHealth {
  std::atomic<bool> failed{false};
  std::atomic<int> ucs_status{0};
  // False when UCX offered no lane with peer failure handling (shared memory in UCX 1.13): the
  // endpoint then never reports failure by itself.
  bool failure_detection = true;
};

// ucp_ep_h connected by worker address, with peer error handling.
class UcxEndpoint {
 public:
  // `health` must outlive the endpoint (the error callback writes into it).
  // `peer_mode_supported` (in/out): try UCP_ERR_HANDLING_MODE_PEER when true; set to false when
  // no lane supports it (then the endpoint is created without failure detection).
  static absl::StatusOr<std::unique_ptr<UcxEndpoint>> Create(const UcxWorker& worker,
                                                             std::string_view peer_address,
                                                             EndpointHealth* health,
                                                             bool* peer_mode_supported);
  // Closes (forcefully when failed) unless Close already did, progressing the worker for at
  // most ~1 s.
  ~UcxEndpoint();
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;
  // nullptr once closed.
  ucp_ep_h get() const { return ep_; }
  // Closes now (UCP_EP_CLOSE_FLAG_FORCE when `force`), progressing the worker for at most ~1 s:
  // with force, UCX completes every request still on the endpoint with an error (their
  // callbacks run during this call's progress). Idempotent. Owner thread only.
  void Close(bool force);

 private:
  UcxEndpoint(ucp_worker_h w, ucp_ep_h ep, EndpointHealth* h) : worker_(w), ep_(ep), health_(h) {}
  ucp_worker_h worker_;
  ucp_ep_h ep_;
  EndpointHealth* health_;
};

// ucp_mem_h for [addr, addr+length), plus its packed rkey bytes.
class UcxMemHandle {
 public:
  static absl::StatusOr<std::unique_ptr<UcxMemHandle>> Create(const UcxContext& context, void* addr,
                                                              size_t length);
  // Lets UCX allocate and map `length` bytes (UCP_MEM_MAP_ALLOCATE, methods by UCX_ALLOC_PRIO:
  // a shared-memory segment of the posix/sysv md when one is enabled, else mmap). Peers on the
  // same host then reach the memory with true one-sided RMA (the segment is attached and
  // copied with loads/stores); registered private memory is only reachable through RMA
  // emulated with active messages that the owner's worker must answer. The memory is freed
  // with the handle. address()/length() say where it is.
  static absl::StatusOr<std::unique_ptr<UcxMemHandle>> Allocate(const UcxContext& context,
                                                                size_t length);
  void* address() const { return address_; }
  size_t length() const { return length_; }
  // True when UCX allocated the memory (Allocate): it is freed with the handle.
  bool allocated() const { return allocated_; }
  ~UcxMemHandle();
  UcxMemHandle(const UcxMemHandle&) = delete;
  UcxMemHandle& operator=(const UcxMemHandle&) = delete;
  ucp_mem_h get() const { return memh_; }
  const std::string& packed_rkey() const { return packed_rkey_; }

 private:
  UcxMemHandle(ucp_context_h c, ucp_mem_h m, std::string rkey, void* address, size_t length,
               bool allocated)
      : context_(c),
        memh_(m),
        packed_rkey_(std::move(rkey)),
        address_(address),
        length_(length),
        allocated_(allocated) {}
  static absl::StatusOr<std::unique_ptr<UcxMemHandle>> Map(const UcxContext& context,
                                                           const ucp_mem_map_params_t& params);
  ucp_context_h context_;
  ucp_mem_h memh_;
  std::string packed_rkey_;
  void* address_;
  size_t length_;
  bool allocated_;
};

// ucp_rkey_h unpacked on one endpoint.
class UcxRkey {
 public:
  static absl::StatusOr<std::unique_ptr<UcxRkey>> Create(const UcxEndpoint& ep,
                                                         std::string_view packed);
  ~UcxRkey();
  UcxRkey(const UcxRkey&) = delete;
  UcxRkey& operator=(const UcxRkey&) = delete;
  ucp_rkey_h get() const { return rkey_; }

 private:
  explicit UcxRkey(ucp_rkey_h r) : rkey_(r) {}
  ucp_rkey_h rkey_;
};

}  // namespace kvpool::transport::internal
