// RAII wrappers of UCX handles (see ucx_handles.h).
#include "ucx_handles.h"

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <ucs/debug/log_def.h>

#include "absl/strings/str_cat.h"
#include "kvpool/common/log.h"

namespace kvpool::transport::internal {

absl::Status FromUcs(ucs_status_t status, const char* what) {
  if (status == UCS_OK) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_SOME_CONNECTS_FAILED:
    case UCS_ERR_ALREADY_EXISTS:
      return absl::UnavailableError(msg);
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return absl::InvalidArgumentError(msg);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// ---- UCX's own log ----
namespace {
// Set on the owner thread around the ep_create attempt with UCP_ERR_HANDLING_MODE_PEER that is
// expected to fail on shared-memory transports (UcxEndpoint::Create).
thread_local bool t_probing_peer_mode = false;

// UCX's default log handler prints to stdout unless UCX_LOG_FILE names another stream, and libucs
// reads UCX_LOG_FILE in its load-time constructor (ucs_global_opts_init), so a setenv() from
// here would come too late. Instead this handler (pushed once per process) writes UCX's messages
// to stderr, keeping stdout for the binaries' results. A UCX_LOG_FILE set by the user wins: the
// handler then passes every message on to UCX's default handler unchanged. Messages raised while
// probing for peer failure detection are expected and logged at debug level only.
// Thread-safety: UCX may call it from any thread; it touches no shared state.
ucs_log_func_rc_t UcxLogHandler(const char* file, unsigned line, const char* /*function*/,
                                ucs_log_level_t level,
                                const ucs_log_component_config_t* /*comp_conf*/,
                                const char* message, va_list ap) {
  static const bool user_log_file = std::getenv("UCX_LOG_FILE") != nullptr;
  if (!t_probing_peer_mode && user_log_file) return UCS_LOG_FUNC_RC_CONTINUE;
  char text[1024];
  va_list copy;
  va_copy(copy, ap);
  std::vsnprintf(text, sizeof(text), message, copy);
  va_end(copy);
  if (t_probing_peer_mode) {
    KVPOOL_LOG_DEBUG("transport: UCX (expected while probing peer error handling): {}", text);
    return UCS_LOG_FUNC_RC_STOP;
  }
  const char* base = std::strrchr(file, '/');
  std::fprintf(stderr, "UCX %s %s:%u %s\n",
               level < UCS_LOG_LEVEL_LAST ? ucs_log_level_names[level] : "?",
               base != nullptr ? base + 1 : file, line, text);
  return UCS_LOG_FUNC_RC_STOP;
}
}  // namespace

// ---- UcxConfig ----
absl::StatusOr<std::unique_ptr<UcxConfig>> UcxConfig::Create(const std::string& tls) {
  static std::once_flag log_handler_once;
  std::call_once(log_handler_once, [] { ucs_log_push_handler(&UcxLogHandler); });
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return FromUcs(st, "ucp_config_read");
  auto out = std::unique_ptr<UcxConfig>(new UcxConfig(config));
  // RMA of every size goes zero-copy (cma's process_vm_readv/writev over shared memory) instead
  // of being emulated with active messages below UCX's auto threshold. Over posix/sysv those
  // messages are written into the *target's* shared receive FIFO, and a process killed halfway
  // through writing an element leaves that FIFO blocked for every later sender: a client
  // SIGKILLed mid-put wedged the pool's data plane for all new clients (docs/TRANSPORT.md).
  // UCX_ZCOPY_THRESH in the environment still wins.
  if (std::getenv("UCX_ZCOPY_THRESH") == nullptr) {
    st = ucp_config_modify(config, "ZCOPY_THRESH", "0");
    if (st != UCS_OK) {
      KVPOOL_LOG_WARN("transport: cannot set ZCOPY_THRESH=0: {}", ucs_status_string(st));
    }
  }
  if (!tls.empty()) {
    st = ucp_config_modify(config, "TLS", tls.c_str());
    if (st != UCS_OK) {
      return absl::InvalidArgumentError(
          absl::StrCat("tls: UCX rejected \"", tls, "\": ", ucs_status_string(st)));
    }
  }
  return out;
}

UcxConfig::~UcxConfig() { ucp_config_release(config_); }

// ---- UcxContext ----
absl::StatusOr<std::unique_ptr<UcxContext>> UcxContext::Create(const UcxConfig& config) {
  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  ucp_context_h context = nullptr;
  ucs_status_t st = ucp_init(&params, config.get(), &context);
  if (st != UCS_OK) return FromUcs(st, "ucp_init");
  return std::unique_ptr<UcxContext>(new UcxContext(context));
}

UcxContext::~UcxContext() { ucp_cleanup(context_); }

bool UcxContext::SupportsCuda() const {
  ucp_context_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &attr) != UCS_OK) return false;
  return (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

// ---- UcxWorker ----
absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const UcxContext& context) {
  ucp_worker_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  ucs_status_t st = ucp_worker_create(context.get(), &params, &worker);
  if (st != UCS_OK) return FromUcs(st, "ucp_worker_create");
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(worker, &addr, &addr_len);
  if (st != UCS_OK) {
    ucp_worker_destroy(worker);
    return FromUcs(st, "ucp_worker_get_address");
  }
  std::string address(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(worker, addr);
  int fd = -1;
  st = ucp_worker_get_efd(worker, &fd);
  if (st != UCS_OK) {
    ucp_worker_destroy(worker);
    return FromUcs(st, "ucp_worker_get_efd");
  }
  return std::unique_ptr<UcxWorker>(new UcxWorker(worker, std::move(address), fd));
}

UcxWorker::~UcxWorker() { ucp_worker_destroy(worker_); }

// ---- UcxEndpoint ----
namespace {
void EndpointErrorCallback(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* health = static_cast<EndpointHealth*>(arg);
  health->ucs_status.store(static_cast<int>(status), std::memory_order_relaxed);
  health->failed.store(true, std::memory_order_release);
  KVPOOL_LOG_DEBUG("transport: endpoint failed: {}", ucs_status_string(status));
}
}  // namespace

absl::StatusOr<std::unique_ptr<UcxEndpoint>> UcxEndpoint::Create(const UcxWorker& worker,
                                                                 std::string_view peer_address,
                                                                 EndpointHealth* health,
                                                                 bool* peer_mode_supported) {
  ucp_ep_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  params.err_mode = *peer_mode_supported ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  health->failure_detection = *peer_mode_supported;
  params.err_handler.cb = &EndpointErrorCallback;
  params.err_handler.arg = health;
  ucp_ep_h ep = nullptr;
  t_probing_peer_mode = *peer_mode_supported;
  ucs_status_t st = ucp_ep_create(worker.get(), &params, &ep);
  t_probing_peer_mode = false;
  if (st == UCS_ERR_UNREACHABLE && *peer_mode_supported) {
    // UCX 1.13's shared-memory transports (posix, sysv, cma) have no peer failure handler, so
    // with UCP_ERR_HANDLING_MODE_PEER no lane qualifies. Connect without failure detection;
    // the control plane (gRPC) then detects a dead peer and the owner disconnects.
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    st = ucp_ep_create(worker.get(), &params, &ep);
    if (st == UCS_OK) {
      health->failure_detection = false;
      *peer_mode_supported = false;  // remembered: later connects skip the failing attempt
    }
  }
  if (st != UCS_OK) {
    absl::Status s = FromUcs(st, "ucp_ep_create");
    if (absl::IsInternal(s)) s = absl::UnavailableError(s.message());
    return s;
  }
  return std::unique_ptr<UcxEndpoint>(new UcxEndpoint(worker.get(), ep, health));
}

UcxEndpoint::~UcxEndpoint() { Close(health_->failed.load(std::memory_order_acquire)); }

void UcxEndpoint::Close(bool force) {
  if (ep_ == nullptr) return;
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  if (force) {
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep_, &param);
  ep_ = nullptr;
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (ucp_request_check_status(req) == UCS_INPROGRESS &&
         std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(worker_);
  }
  if (ucp_request_check_status(req) == UCS_INPROGRESS) {
    KVPOOL_LOG_WARN("transport: endpoint close did not finish within 1 s; abandoning it");
  }
  ucp_request_free(req);
}

// ---- UcxMemHandle ----
absl::StatusOr<std::unique_ptr<UcxMemHandle>> UcxMemHandle::Create(const UcxContext& context,
                                                                   void* addr, size_t length) {
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = addr;
  params.length = length;
  return Map(context, params);
}

absl::StatusOr<std::unique_ptr<UcxMemHandle>> UcxMemHandle::Allocate(const UcxContext& context,
                                                                     size_t length) {
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.length = length;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  return Map(context, params);
}

absl::StatusOr<std::unique_ptr<UcxMemHandle>> UcxMemHandle::Map(
    const UcxContext& context, const ucp_mem_map_params_t& params) {
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context.get(), &params, &memh);
  if (st != UCS_OK) return FromUcs(st, "ucp_mem_map");
  ucp_mem_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  st = ucp_mem_query(memh, &attr);
  if (st != UCS_OK) {
    ucp_mem_unmap(context.get(), memh);
    return FromUcs(st, "ucp_mem_query");
  }
  void* rkey_buf = nullptr;
  size_t rkey_len = 0;
  st = ucp_rkey_pack(context.get(), memh, &rkey_buf, &rkey_len);
  if (st != UCS_OK) {
    ucp_mem_unmap(context.get(), memh);
    return FromUcs(st, "ucp_rkey_pack");
  }
  std::string packed(static_cast<const char*>(rkey_buf), rkey_len);
  ucp_rkey_buffer_release(rkey_buf);
  return std::unique_ptr<UcxMemHandle>(
      new UcxMemHandle(context.get(), memh, std::move(packed), attr.address, attr.length,
                       (params.field_mask & UCP_MEM_MAP_PARAM_FIELD_FLAGS) != 0 &&
                           (params.flags & UCP_MEM_MAP_ALLOCATE) != 0));
}

UcxMemHandle::~UcxMemHandle() { ucp_mem_unmap(context_, memh_); }

// ---- UcxRkey ----
absl::StatusOr<std::unique_ptr<UcxRkey>> UcxRkey::Create(const UcxEndpoint& ep,
                                                         std::string_view packed) {
  ucp_rkey_h rkey = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(ep.get(), packed.data(), &rkey);
  if (st != UCS_OK) {
    absl::Status s = FromUcs(st, "ucp_ep_rkey_unpack");
    return absl::InvalidArgumentError(absl::StrCat("packed_rkey: ", s.message()));
  }
  return std::unique_ptr<UcxRkey>(new UcxRkey(rkey));
}

UcxRkey::~UcxRkey() { ucp_rkey_destroy(rkey_); }

}  // namespace kvpool::transport::internal
