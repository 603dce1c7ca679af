// The UCX implementation of Transport (see ucx_transport.h and transport.h).
//
// Structure: UcxCore owns the UCX handles (config → context → worker, declared in that order so
// they are destroyed in reverse) and the owner thread. Every UCX call runs on the owner thread:
// public methods enqueue closures (and wait for them when they need a result). MemoryRegions
// hold a reference to the core so that a region outliving the Transport façade is still
// deregistered before the context is destroyed.
#include "kvpool/transport/ucx_transport.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include <ucp/api/ucp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "envelope.h"
#include "kvpool/common/log.h"
#include "kvpool/common/status.h"
#include "ucx_handles.h"
#include "validate.h"

namespace kvpool::transport {
namespace {

using internal::EndpointHealth;
using internal::FromUcs;
using internal::UcxConfig;
using internal::UcxContext;
using internal::UcxEndpoint;
using internal::UcxMemHandle;
using internal::UcxRkey;
using internal::UcxWorker;

class UcxCore;

// How long releasing a region waits for the worker to finish what it does for peers (UcxCore::
// ReleaseMemory) before keeping the memory until the transport closes instead.
constexpr absl::Duration kReleaseQuiesce = absl::Seconds(1);

// Completion context of one posted UCX request; lives in its InFlight record.
struct OpContext {
  UcxCore* core;
  Transfer* transfer;
  size_t index;  // op index, or SIZE_MAX for the flush of a put
};

// A posted transfer: keeps the Transfer (and through it the local region) alive while UCX may
// still write into it. Never moved once requests point into `contexts`.
struct InFlight {
  std::shared_ptr<Transfer> transfer;
  std::vector<OpContext> contexts;
  size_t outstanding = 0;
};

// One UCX endpoint and the health record its error callback writes into. Shared by every
// EndpointId connected to the same peer address: UCX 1.13 asserts when one worker opens two
// TCP endpoints to the same peer worker, so a worker keeps one UCX endpoint per peer.
// Declaration order = destruction in reverse: the endpoint closes before its health goes.
struct Connection {
  std::shared_ptr<EndpointHealth> health;
  std::unique_ptr<UcxEndpoint> endpoint;
};

// Owner-thread-only state of one EndpointId: remote keys are destroyed before the connection
// reference is dropped (reverse declaration order).
struct EndpointEntry {
  std::shared_ptr<Connection> connection;
  // shared: a RemoteMapping keeps its key (and connection) alive past Disconnect.
  std::map<uint64_t, std::shared_ptr<UcxRkey>> rkeys;
};

// A region's memory whose release waits for the worker's destruction: its registration, and
// the bytes when the transport mapped them itself (munmap'ed after the registration goes).
struct DeferredMemory {
  std::unique_ptr<UcxMemHandle> memh;
  uint8_t* owned_data = nullptr;
  size_t owned_size = 0;
  DeferredMemory(std::unique_ptr<UcxMemHandle> m, uint8_t* data, size_t size)
      : memh(std::move(m)), owned_data(data), owned_size(size) {}
  DeferredMemory(DeferredMemory&& o) noexcept
      : memh(std::move(o.memh)),
        owned_data(std::exchange(o.owned_data, nullptr)),
        owned_size(o.owned_size) {}
  DeferredMemory(const DeferredMemory&) = delete;
  DeferredMemory& operator=(const DeferredMemory&) = delete;
  DeferredMemory& operator=(DeferredMemory&&) = delete;
  ~DeferredMemory() {
    memh.reset();
    if (owned_data != nullptr) munmap(owned_data, owned_size);
  }
};

class UcxCore : public std::enable_shared_from_this<UcxCore> {
 public:
  static absl::StatusOr<std::shared_ptr<UcxCore>> Create(const UcxOptions& options) {
    auto core = std::shared_ptr<UcxCore>(new UcxCore(options));
    KVPOOL_ASSIGN_OR_RETURN(core->config_, UcxConfig::Create(options.tls));
    KVPOOL_ASSIGN_OR_RETURN(core->context_, UcxContext::Create(*core->config_));
    KVPOOL_ASSIGN_OR_RETURN(core->worker_, UcxWorker::Create(*core->context_));
    core->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (core->wake_fd_ < 0) return absl::InternalError("eventfd failed");
    core->sealed_address_ = internal::Seal('A', core->worker_->address());
    core->cuda_ = core->context_->SupportsCuda();
    core->owner_ = std::thread([c = core.get()] { c->Loop(); });
    core->owner_id_ = core->owner_.get_id();
    return core;
  }

  ~UcxCore() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    Wake();
    if (owner_.joinable()) owner_.join();
    if (wake_fd_ >= 0) close(wake_fd_);
    // worker_, deferred_ (memory kept past a release, ReleaseMemory), context_, config_ are
    // destroyed after this body, in reverse declaration order.
  }

  const std::string& sealed_address() const { return sealed_address_; }
  bool cuda() const { return cuda_; }
  const UcxOptions& options() const { return options_; }

  // Runs `fn` on the owner thread (inline when already there) and returns its result.
  template <typename T>
  T RunSync(std::function<T()> fn) {
    if (std::this_thread::get_id() == owner_id_) return fn();
    auto task = std::make_shared<std::packaged_task<T()>>(std::move(fn));
    std::future<T> result = task->get_future();
    Enqueue([task] { (*task)(); });
    return result.get();
  }

  void Enqueue(std::function<void()> fn) {
    {
      absl::MutexLock lock(&mu_);
      queue_.push_back(std::move(fn));
    }
    // The eventfd write (a syscall) is needed only when the owner thread sleeps or is about to;
    // while it polls it finds the queue itself. Pairs with the store in Loop(): either the
    // owner sees this closure when it re-checks the queue after announcing its sleep, or this
    // load sees the announcement (both sequentially consistent).
    if (may_sleep_.load(std::memory_order_seq_cst)) Wake();
  }

  // ---- called on the owner thread ----
  absl::StatusOr<std::unique_ptr<UcxMemHandle>> MapMemory(void* addr, size_t len) {
    return UcxMemHandle::Create(*context_, addr, len);
  }
  absl::StatusOr<std::unique_ptr<UcxMemHandle>> AllocateMemory(size_t len) {
    return UcxMemHandle::Allocate(*context_, len);
  }

  // Releases a region's memory (its registration, and `owned_data` when the transport mapped
  // the bytes itself) once this worker no longer reads or writes them on a peer's behalf.
  //
  // Why: over transports without hardware RMA (UCX 1.13 tcp) a peer's get of this region is
  // answered by this worker in software: each request it has received queues a reply on the
  // peer's connection that copies from the region when the socket takes it. A client whose put
  // the pool gave up on (the client was stopped past the put timeout, then resumed) received the
  // pool's requests after the pool had stopped reading; its replies sat in the queue, the
  // client freed the put's buffer, and the next dispatch of the queue copied from unmapped memory
  // (SIGSEGV in uct_tcp_ep_am_bcopy). So first everything already received is handled (progress
  // until idle), then a worker flush waits until every queued reply is sent or dropped with its
  // failed connection. If that does not finish within `kReleaseQuiesce` (a peer that stopped
  // reading), the memory is kept until the worker is destroyed (which drops the queues) rather
  // than freed under them; memory the caller owns (RegisterMemory) cannot be kept, so that case
  // is logged. Owner thread only.
  void ReleaseMemory(std::unique_ptr<UcxMemHandle> memh, uint8_t* owned_data, size_t owned_size) {
    if (!Quiesce(absl::Now() + kReleaseQuiesce)) {
      if (owned_data != nullptr || memh->allocated()) {
        KVPOOL_LOG_WARN(
            "transport: a released region may still be read for a peer (replies queued on a "
            "connection that does not drain); its {} bytes are kept until the transport closes",
            memh->length());
        deferred_.emplace_back(std::move(memh), owned_data, owned_size);
        return;
      }
      KVPOOL_LOG_WARN(
          "transport: a caller-owned region is released while replies to a peer may still read "
          "it (a connection that does not drain)");
    }
    DeferredMemory now(std::move(memh), owned_data, owned_size);
  }

  // Handles what the worker has received, then flushes every connection of the worker (its own
  // and those peers opened to it) until `deadline`. True when the flush finished (sent, or failed
  // with its connection); false at the deadline. Owner thread only.
  bool Quiesce(absl::Time deadline) {
    ucp_worker_h w = worker_->get();
    while (ucp_worker_progress(w) != 0 && absl::Now() < deadline) {
    }
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    ucs_status_ptr_t r = ucp_worker_flush_nbx(w, &param);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) return true;
    while (ucp_request_check_status(r) == UCS_INPROGRESS && absl::Now() < deadline) {
      ucp_worker_progress(w);
    }
    const bool done = ucp_request_check_status(r) != UCS_INPROGRESS;
    if (!done) ucp_request_cancel(w, r);
    ucp_request_free(r);
    return done;
  }

  absl::StatusOr<EndpointId> Connect(std::string payload) {
    if (shutting_down_) return absl::UnavailableError("transport is shutting down");
    std::shared_ptr<Connection> conn;
    auto found = connections_.find(payload);
    if (found != connections_.end()) conn = found->second.lock();
    if (conn == nullptr || conn->health->failed.load()) {
      conn = std::make_shared<Connection>();
      conn->health = std::make_shared<EndpointHealth>();
      KVPOOL_ASSIGN_OR_RETURN(
          conn->endpoint,
          UcxEndpoint::Create(*worker_, payload, conn->health.get(), &peer_mode_supported_));
      connections_[payload] = conn;
    }
    const uint64_t id = next_id_++;
    {
      absl::MutexLock lock(&mu_);
      health_[id] = conn->health;
    }
    endpoints_.emplace(id, EndpointEntry{std::move(conn), {}});
    return EndpointId{id};
  }

  absl::Status Disconnect(EndpointId id) {
    auto it = endpoints_.find(id.value);
    if (it == endpoints_.end()) return absl::NotFoundError("endpoint: unknown or disconnected");
    {
      absl::MutexLock lock(&mu_);
      health_.erase(id.value);
      for (const auto& [rk, unused] : it->second.rkeys) rkey_endpoint_.erase(rk);
    }
    endpoints_.erase(it);  // rkeys, then the connection (closed when this was its last user)
    for (auto c = connections_.begin(); c != connections_.end();) {
      c = c->second.expired() ? connections_.erase(c) : std::next(c);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<RemoteKeyId> Unpack(EndpointId id, std::string payload) {
    auto it = endpoints_.find(id.value);
    if (it == endpoints_.end()) return absl::NotFoundError("endpoint: unknown or disconnected");
    if (it->second.connection->health->failed.load()) {
      return absl::UnavailableError("endpoint: peer failed");
    }
    KVPOOL_ASSIGN_OR_RETURN(auto rkey, UcxRkey::Create(*it->second.connection->endpoint, payload));
    const uint64_t rid = next_id_++;
    it->second.rkeys.emplace(rid, std::move(rkey));
    absl::MutexLock lock(&mu_);
    rkey_endpoint_[rid] = id.value;
    return RemoteKeyId{rid};
  }

  // Thread-safe reads of endpoint state.
  absl::Status EndpointStatus(EndpointId id) const {
    absl::MutexLock lock(&mu_);
    auto it = health_.find(id.value);
    if (it == health_.end()) return absl::NotFoundError("endpoint: unknown or disconnected");
    if (it->second->failed.load(std::memory_order_acquire)) {
      return absl::UnavailableError(absl::StrCat(
          "endpoint: peer failed (",
          ucs_status_string(static_cast<ucs_status_t>(it->second->ucs_status.load())), ")"));
    }
    return absl::OkStatus();
  }

  absl::Status CheckKey(EndpointId ep, RemoteKeyId rk) const {
    absl::MutexLock lock(&mu_);
    auto it = rkey_endpoint_.find(rk.value);
    if (it == rkey_endpoint_.end()) return absl::NotFoundError("remote_key: unknown or released");
    if (it->second != ep.value) {
      return absl::InvalidArgumentError("remote_key: belongs to another endpoint");
    }
    return absl::OkStatus();
  }

  // Transport::Abort on the owner thread: when `t` is still in flight on a connection with peer
  // failure detection, marks the connection failed (UCS_ERR_CANCELED) and force-closes it, so
  // UCX completes its requests (and every other request on that connection) with errors.
  void AbortOnOwner(Transfer* t) {
    if (inflight_.find(t) == inflight_.end()) return;  // finished or never reached UCX
    auto ep_it = endpoints_.find(t->request().endpoint.value);
    if (ep_it == endpoints_.end()) return;
    Connection& conn = *ep_it->second.connection;
    if (!conn.health->failure_detection || conn.endpoint == nullptr) return;
    conn.health->ucs_status.store(static_cast<int>(UCS_ERR_CANCELED), std::memory_order_relaxed);
    conn.health->failed.store(true, std::memory_order_release);
    KVPOOL_LOG_INFO("transport: aborting a transfer in flight; force-closing its connection");
    conn.endpoint->Close(/*force=*/true);
  }

  void PostOnOwner(std::shared_ptr<Transfer> transfer, ucp_mem_h local_memh);
  void FlushOnOwner(std::shared_ptr<Transfer> transfer);

  // ucp_rkey_ptr of both ends of [addr, +length): the local address of `addr` when the whole
  // range is mapped linearly; `*keep` receives what must stay alive while it is used (the key
  // and its connection).
  absl::StatusOr<uint8_t*> MapRemote(EndpointId id, RemoteKeyId rk, uint64_t addr, uint64_t length,
                                     std::shared_ptr<void>* keep) {
    auto it = endpoints_.find(id.value);
    if (it == endpoints_.end()) return absl::NotFoundError("endpoint: unknown or disconnected");
    if (it->second.connection->health->failed.load()) {
      return absl::UnavailableError("endpoint: peer failed");
    }
    auto k = it->second.rkeys.find(rk.value);
    if (k == it->second.rkeys.end()) return absl::NotFoundError("remote_key: unknown or released");
    void* first = nullptr;
    void* last = nullptr;
    ucs_status_t st = ucp_rkey_ptr(k->second->get(), addr, &first);
    if (st == UCS_ERR_UNREACHABLE) {
      return absl::UnimplementedError("remote_key: not mappable over this transport");
    }
    if (st != UCS_OK || ucp_rkey_ptr(k->second->get(), addr + length - 1, &last) != UCS_OK ||
        static_cast<uint8_t*>(last) - static_cast<uint8_t*>(first) !=
            static_cast<ptrdiff_t>(length - 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "length: [", addr, ", +", length, ") is not one mapped range of the remote region (",
          ucs_status_string(st), ")"));
    }
    // UCX computes the pointer without bounds checks: make sure every page of the range is
    // mapped here (mincore fails with ENOMEM otherwise), so a range the remote region does not
    // cover is refused instead of faulting later.
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t lo = reinterpret_cast<uintptr_t>(first) & ~(page - 1);
    const uintptr_t hi = reinterpret_cast<uintptr_t>(last) + 1;
    unsigned char resident[4096];
    for (uintptr_t at = lo; at < hi; at += sizeof(resident) * page) {
      const uintptr_t n = std::min<uintptr_t>(hi - at, sizeof(resident) * page);
      if (mincore(reinterpret_cast<void*>(at), n, resident) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("length: [", addr, ", +", length, ") is not mapped in this process (",
                         std::strerror(errno), "): outside the remote region?"));
      }
    }
    // Members are destroyed in reverse order: the key before its connection.
    struct Hold {
      std::shared_ptr<Connection> connection;
      std::shared_ptr<UcxRkey> rkey;
    };
    auto hold = std::make_shared<Hold>(Hold{it->second.connection, k->second});
    *keep = std::move(hold);
    return static_cast<uint8_t*>(first);
  }

  bool OnOwnerThread() const { return std::this_thread::get_id() == owner_id_; }

  // Posts ucp_ep_flush_nbx on `ep` as the flush completion (index SIZE_MAX) of
  // record->transfer, its context kept in `record`. True: a request is pending (OpCallback
  // completes it). False: the flush finished at once with `*done` (OK or the error).
  bool PostEndpointFlush(ucp_ep_h ep, InFlight& record, absl::Status* done) {
    record.contexts.push_back(
        OpContext{this, record.transfer.get(), std::numeric_limits<size_t>::max()});
    ucp_request_param_t param = CallbackParam(&record.contexts.back());
    ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &param);
    if (r == nullptr) {
      *done = absl::OkStatus();
      return false;
    }
    if (UCS_PTR_IS_ERR(r)) {
      *done = FromUcs(UCS_PTR_STATUS(r), "ucp_ep_flush_nbx");
      return false;
    }
    return true;
  }

  static ucp_request_param_t CallbackParam(OpContext* ctx) {
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxCore::OpCallback;
    param.user_data = ctx;
    return param;
  }

 private:
  explicit UcxCore(const UcxOptions& options) : options_(options) {}

  static void OpCallback(void* request, ucs_status_t status, void* user_data) {
    auto* ctx = static_cast<OpContext*>(user_data);
    ucp_request_free(request);
    ctx->core->FinishOp(ctx, status);
  }

  void FinishOp(OpContext* ctx, ucs_status_t status) {
    Transfer* t = ctx->transfer;
    absl::Status s = FromUcs(
        status, ctx->index == std::numeric_limits<size_t>::max() ? "ucp_ep_flush_nbx" : "rma op");
    auto it = inflight_.find(t);
    if (!s.ok() && it != inflight_.end()) {
      // A failed peer turns every error into UNAVAILABLE (retryable), whatever UCX says.
      absl::MutexLock lock(&mu_);
      auto h = health_.find(t->request().endpoint.value);
      if (h == health_.end() || h->second->failed.load()) {
        s = absl::UnavailableError(absl::StrCat("endpoint failed: ", s.message()));
      }
    }
    t->CompleteOne(ctx->index, s);
    if (it != inflight_.end() && --it->second->outstanding == 0) {
      // Not destroyed here: this runs inside ucp_worker_progress, and dropping the record may
      // drop the last reference to the transfer's region, whose release progresses the worker
      // (ReleaseMemory), which UCX forbids from a callback (ucp_worker.c "inprogress++ == 0").
      finished_.push_back(std::move(it->second));
      inflight_.erase(it);
    }
  }

 public:
  // Drops the records of transfers that finished inside ucp_worker_progress (FinishOp), now
  // that no progress call is on the stack. A release may progress the worker and finish more;
  // they are dropped too. Owner thread only, never from a UCX callback.
  void ReleaseFinished() {
    while (!finished_.empty()) {
      std::vector<std::unique_ptr<InFlight>> batch;
      batch.swap(finished_);
      batch.clear();
    }
  }

 private:
  void Wake() {
    uint64_t one = 1;
    ssize_t n = write(wake_fd_, &one, sizeof(one));
    (void)n;
  }

  void Loop();
  void RunQueued();

 public:
  // Owner thread: refuses new work, lets in-flight transfers finish (bounded), closes every
  // endpoint (remote keys first). Idempotent.
  void Shutdown();

 private:
  UcxOptions options_;
  // ---- UCX handles, in construction order (destroyed in reverse) ----
  std::unique_ptr<UcxConfig> config_;
  std::unique_ptr<UcxContext> context_;
  // Memory of regions released while the worker was not quiescent (ReleaseMemory): freed after
  // the worker is destroyed (declared between context_ and worker_ for that), before the context.
  std::vector<DeferredMemory> deferred_;
  std::unique_ptr<UcxWorker> worker_;
  // ---- owner-thread-only state (destroyed by Shutdown on the owner thread) ----
  std::map<std::string, std::weak_ptr<Connection>> connections_;  // peer address → connection
  std::map<uint64_t, EndpointEntry> endpoints_;
  std::map<Transfer*, std::unique_ptr<InFlight>> inflight_;
  std::vector<std::unique_ptr<InFlight>> finished_;  // see FinishOp / ReleaseFinished
  uint64_t next_id_ = 1;
  bool shutting_down_ = false;
  bool peer_mode_supported_ = true;  // see UcxEndpoint::Create
  // ---- shared state ----
  mutable absl::Mutex mu_;  // guards queue_, stop_, health_, rkey_endpoint_; never held in UCX
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint64_t, std::shared_ptr<EndpointHealth>> health_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> rkey_endpoint_ ABSL_GUARDED_BY(mu_);  // rkey id → endpoint id
  std::string sealed_address_;
  bool cuda_ = false;
  int wake_fd_ = -1;
  // True while the owner thread is about to sleep or sleeps in poll(): Enqueue must wake it.
  std::atomic<bool> may_sleep_{false};
  std::thread::id owner_id_;
  std::thread owner_;
};

void UcxCore::PostOnOwner(std::shared_ptr<Transfer> transfer, ucp_mem_h local_memh) {
  const TransferRequest& req = transfer->request();
  auto fail_all = [&](absl::Status s) {
    transfer->MarkPosted(1);
    transfer->CompleteOne(std::numeric_limits<size_t>::max(), s);
  };
  auto ep_it = endpoints_.find(req.endpoint.value);
  if (shutting_down_) return fail_all(absl::UnavailableError("transport is shutting down"));
  if (ep_it == endpoints_.end()) return fail_all(absl::NotFoundError("endpoint: disconnected"));
  if (ep_it->second.connection->health->failed.load()) {
    return fail_all(absl::UnavailableError("endpoint: peer failed"));
  }
  auto rk_it = ep_it->second.rkeys.find(req.remote_key.value);
  if (rk_it == ep_it->second.rkeys.end()) {
    return fail_all(absl::NotFoundError("remote_key: released"));
  }
  ucp_ep_h ep = ep_it->second.connection->endpoint->get();
  ucp_rkey_h rkey = rk_it->second->get();

  auto record = std::make_unique<InFlight>();
  record->transfer = transfer;
  record->contexts.reserve(req.ops.size() + 1);
  const bool is_put = req.kind == TransferKind::kPut;
  const bool flush = is_put && req.flush;
  uint8_t* base = req.local->data();

  // Post every op (ops skipped by cancellation stay CANCELLED). Immediate completions and
  // immediate errors are recorded after MarkPosted, below.
  std::vector<std::pair<size_t, absl::Status>> immediate;
  size_t posted_requests = 0;
  for (size_t i = 0; i < req.ops.size(); ++i) {
    if (transfer->cancelled()) break;
    const TransferOp& op = req.ops[i];
    record->contexts.push_back(OpContext{this, transfer.get(), i});
    ucp_request_param_t param = CallbackParam(&record->contexts.back());
    if (local_memh != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = local_memh;
    }
    ucs_status_ptr_t r =
        is_put ? ucp_put_nbx(ep, base + op.local_offset, op.length, op.remote_addr, rkey, &param)
               : ucp_get_nbx(ep, base + op.local_offset, op.length, op.remote_addr, rkey, &param);
    if (r == nullptr) {
      immediate.emplace_back(i, absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(r)) {
      immediate.emplace_back(i, FromUcs(UCS_PTR_STATUS(r), is_put ? "ucp_put_nbx" : "ucp_get_nbx"));
    } else {
      ++posted_requests;
    }
  }
  const size_t attempted = record->contexts.size();
  bool flush_pending = false;
  absl::Status flush_status;
  if (flush && attempted > 0) {
    // Puts are complete only when remotely visible: flush the endpoint after them.
    flush_pending = PostEndpointFlush(ep, *record, &flush_status);
    if (flush_pending) ++posted_requests;
  }
  const size_t total = attempted + ((flush && attempted > 0) ? 1 : 0);
  transfer->MarkPosted(total);
  if (posted_requests > 0) {
    record->outstanding = posted_requests;
    inflight_.emplace(transfer.get(), std::move(record));
  }
  for (auto& [i, s] : immediate) transfer->CompleteOne(i, std::move(s));
  if (flush && attempted > 0 && !flush_pending) {
    transfer->CompleteOne(std::numeric_limits<size_t>::max(), flush_status);
  }
}

void UcxCore::FlushOnOwner(std::shared_ptr<Transfer> transfer) {
  auto fail = [&](absl::Status s) {
    transfer->MarkPosted(1);
    transfer->CompleteOne(std::numeric_limits<size_t>::max(), s);
  };
  if (shutting_down_) return fail(absl::UnavailableError("transport is shutting down"));
  auto ep_it = endpoints_.find(transfer->request().endpoint.value);
  if (ep_it == endpoints_.end()) return fail(absl::NotFoundError("endpoint: disconnected"));
  if (ep_it->second.connection->health->failed.load()) {
    return fail(absl::UnavailableError("endpoint: peer failed"));
  }
  auto record = std::make_unique<InFlight>();
  record->transfer = transfer;
  transfer->MarkPosted(1);
  absl::Status done;
  if (PostEndpointFlush(ep_it->second.connection->endpoint->get(), *record, &done)) {
    record->outstanding = 1;
    inflight_.emplace(transfer.get(), std::move(record));
  } else {
    transfer->CompleteOne(std::numeric_limits<size_t>::max(), std::move(done));
  }
}

void UcxCore::RunQueued() {
  std::deque<std::function<void()>> batch;
  {
    absl::MutexLock lock(&mu_);
    batch.swap(queue_);
  }
  for (auto& fn : batch) fn();
}

void UcxCore::Shutdown() {
  if (shutting_down_) return;
  shutting_down_ = true;
  RunQueued();
  // Let in-flight transfers finish (bounded), then close every endpoint; ops still in flight
  // complete with errors while the endpoints close.
  auto deadline = absl::Now() + absl::Seconds(2);
  while (!inflight_.empty() && absl::Now() < deadline) ucp_worker_progress(worker_->get());
  {
    absl::MutexLock lock(&mu_);
    health_.clear();
    rkey_endpoint_.clear();
  }
  for (auto& [id, entry] : endpoints_) entry.connection->health->failed.store(true);
  endpoints_.clear();
  connections_.clear();
  deadline = absl::Now() + absl::Seconds(2);
  while (!inflight_.empty() && absl::Now() < deadline) ucp_worker_progress(worker_->get());
  for (auto& [t, record] : inflight_) {
    KVPOOL_LOG_WARN("transport: abandoning a transfer still in flight at shutdown");
    t->CompleteOne(std::numeric_limits<size_t>::max(),
                   absl::UnavailableError("transport shut down"));
  }
  inflight_.clear();
  ReleaseFinished();
  RunQueued();
  ReleaseFinished();
}

void UcxCore::Loop() {
  ucp_worker_h w = worker_->get();
  absl::Time last_activity = absl::Now();
  while (true) {
    bool stop = false;
    bool have_work = false;
    {
      absl::MutexLock lock(&mu_);
      stop = stop_;
      have_work = !queue_.empty();
    }
    if (stop) break;
    if (have_work) RunQueued();
    unsigned progressed = 0;
    while (ucp_worker_progress(w) != 0) ++progressed;
    ReleaseFinished();
    if (have_work || progressed > 0) {
      last_activity = absl::Now();
      continue;
    }
    if (!inflight_.empty() || absl::Now() - last_activity < options_.busy_poll) {
      // Keep polling, but let other runnable threads (the caller waiting for this transfer,
      // the peer's threads on a shared host) have the core: on an oversubscribed machine a
      // tight spin delays exactly the work it waits for.
      sched_yield();
      continue;
    }
    may_sleep_.store(true, std::memory_order_seq_cst);
    {
      absl::MutexLock lock(&mu_);
      have_work = !queue_.empty() || stop_;
    }
    if (have_work) {
      may_sleep_.store(false, std::memory_order_seq_cst);
      continue;
    }
    ucs_status_t st = ucp_worker_arm(w);
    if (st == UCS_ERR_BUSY) {
      may_sleep_.store(false, std::memory_order_seq_cst);
      continue;
    }
    pollfd fds[2] = {{worker_->event_fd(), POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    poll(fds, 2, 100);
    may_sleep_.store(false, std::memory_order_seq_cst);
    if (fds[1].revents & POLLIN) {
      uint64_t v;
      ssize_t n = read(wake_fd_, &v, sizeof(v));
      (void)n;
    }
    last_activity = absl::Now();
  }
  Shutdown();
}

// ---- MemoryRegion ----
class UcxRegion final : public MemoryRegion {
 public:
  UcxRegion(std::shared_ptr<UcxCore> core, uint8_t* data, size_t size, bool owned,
            std::unique_ptr<UcxMemHandle> memh)
      : core_(std::move(core)),
        data_(data),
        size_(size),
        owned_(owned),
        memh_(std::move(memh)),
        sealed_rkey_(internal::Seal('R', memh_->packed_rkey())) {}

  ~UcxRegion() override {
    // Deregister and free on the owner thread once the worker no longer serves peers from the
    // memory (UcxCore::ReleaseMemory); memory UCX allocated goes with the handle, memory we
    // mapped (owned_) is munmap'ed after it.
    auto memh = std::make_shared<std::unique_ptr<UcxMemHandle>>(std::move(memh_));
    uint8_t* owned = owned_ ? data_ : nullptr;
    core_->RunSync<int>([c = core_.get(), memh, owned, size = size_] {
      c->ReleaseMemory(std::move(*memh), owned, size);
      return 0;
    });
  }

  uint8_t* data() const override { return data_; }
  size_t size() const override { return size_; }
  const std::string& packed_rkey() const override { return sealed_rkey_; }
  ucp_mem_h memh() const { return memh_->get(); }

 private:
  std::shared_ptr<UcxCore> core_;
  uint8_t* data_;
  size_t size_;
  bool owned_;
  std::unique_ptr<UcxMemHandle> memh_;
  std::string sealed_rkey_;
};

// ---- RemoteMapping ----
class UcxMapping final : public RemoteMapping {
 public:
  UcxMapping(std::shared_ptr<UcxCore> core, std::shared_ptr<void> keep, uint8_t* data, size_t size,
             uint64_t remote_address)
      : core_(std::move(core)),
        keep_(std::move(keep)),
        data_(data),
        size_(size),
        remote_address_(remote_address) {}
  ~UcxMapping() override {
    // The key (and maybe the endpoint) it kept alive are UCX handles: release them on the owner
    // thread.
    core_->RunSync<int>([keep = std::move(keep_)]() mutable {
      keep.reset();
      return 0;
    });
  }
  uint8_t* data() const override { return data_; }
  size_t size() const override { return size_; }
  uint64_t remote_address() const override { return remote_address_; }

 private:
  std::shared_ptr<UcxCore> core_;
  std::shared_ptr<void> keep_;
  uint8_t* data_;
  size_t size_;
  uint64_t remote_address_;
};

// ---- the Transport façade ----
class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(std::shared_ptr<UcxCore> core) : core_(std::move(core)) {}
  ~UcxTransport() override {
    // Close endpoints now; the core (and its thread) lives on while regions reference it.
    core_->RunSync<int>([c = core_.get()] {
      c->Shutdown();
      return 0;
    });
  }

  std::string Name() const override {
    return absl::StrCat("ucx(", core_->options().tls.empty() ? "default" : core_->options().tls,
                        ")");
  }
  std::string WorkerAddress() const override { return core_->sealed_address(); }
  bool SupportsCudaMemory() const override { return core_->cuda(); }

  absl::StatusOr<std::shared_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length) override {
    if (addr == nullptr) return absl::InvalidArgumentError("addr: null");
    if (length == 0) return absl::InvalidArgumentError("length: zero");
    return Map(static_cast<uint8_t*>(addr), length, /*owned=*/false);
  }

  absl::StatusOr<std::shared_ptr<MemoryRegion>> AllocateMemory(size_t length) override {
    if (length == 0) return absl::InvalidArgumentError("length: zero");
    if (!FitsInSharedMemory(length)) return AllocatePrivate(length);
    // UCX allocates (a shared-memory segment when posix/sysv is enabled), so that peers on this
    // host reach it with one-sided RMA instead of RMA emulated through this worker (see
    // UcxMemHandle::Allocate).
    auto memh = core_->RunSync<absl::StatusOr<std::unique_ptr<UcxMemHandle>>>(
        [c = core_.get(), length] { return c->AllocateMemory(length); });
    if (!memh.ok()) return AllocatePrivate(length);
    auto* data = static_cast<uint8_t*>((*memh)->address());
    std::memset(data, 0, length);  // zeroed whatever method UCX used (heap is not)
    LockOnce(data, length);
    return std::shared_ptr<MemoryRegion>(
        std::make_shared<UcxRegion>(core_, data, length, /*owned=*/false, *std::move(memh)));
  }

  absl::StatusOr<EndpointId> Connect(std::string_view peer_worker_address) override {
    KVPOOL_ASSIGN_OR_RETURN(std::string_view payload,
                            internal::Unseal('A', peer_worker_address, "peer_worker_address"));
    std::string copy(payload);  // aligned copy for UCX
    return core_->RunSync<absl::StatusOr<EndpointId>>(
        [c = core_.get(), copy = std::move(copy)] { return c->Connect(copy); });
  }

  absl::Status EndpointStatus(EndpointId endpoint) const override {
    return core_->EndpointStatus(endpoint);
  }

  absl::Status Disconnect(EndpointId endpoint) override {
    return core_->RunSync<absl::Status>(
        [c = core_.get(), endpoint] { return c->Disconnect(endpoint); });
  }

  absl::StatusOr<RemoteKeyId> UnpackRemoteKey(EndpointId endpoint,
                                              std::string_view packed_rkey) override {
    KVPOOL_ASSIGN_OR_RETURN(std::string_view payload,
                            internal::Unseal('R', packed_rkey, "packed_rkey"));
    std::string copy(payload);
    return core_->RunSync<absl::StatusOr<RemoteKeyId>>(
        [c = core_.get(), endpoint, copy = std::move(copy)] { return c->Unpack(endpoint, copy); });
  }

  absl::StatusOr<std::shared_ptr<Transfer>> Prepare(TransferRequest request) override {
    KVPOOL_RETURN_IF_ERROR(internal::ValidateRequestShape(request));
    if (dynamic_cast<UcxRegion*>(request.local.get()) == nullptr) {
      return absl::InvalidArgumentError("local: region was not registered by a UCX transport");
    }
    KVPOOL_RETURN_IF_ERROR(core_->EndpointStatus(request.endpoint));
    KVPOOL_RETURN_IF_ERROR(core_->CheckKey(request.endpoint, request.remote_key));
    return std::make_shared<Transfer>(std::move(request));
  }

  absl::StatusOr<std::shared_ptr<RemoteMapping>> MapRemote(EndpointId endpoint,
                                                           RemoteKeyId remote_key,
                                                           uint64_t remote_addr,
                                                           uint64_t length) override {
    if (length == 0) return absl::InvalidArgumentError("length: zero");
    if (remote_addr + length < remote_addr) {
      return absl::InvalidArgumentError("length: range wraps around the address space");
    }
    std::shared_ptr<void> keep;
    KVPOOL_ASSIGN_OR_RETURN(
        uint8_t * data, core_->RunSync<absl::StatusOr<uint8_t*>>(
                            [c = core_.get(), endpoint, remote_key, remote_addr, length, &keep] {
                              return c->MapRemote(endpoint, remote_key, remote_addr, length, &keep);
                            }));
    auto mapping = std::make_shared<UcxMapping>(core_, std::move(keep), data, length, remote_addr);
    // Fill the page tables now (here, not on the owner thread): else the first store or load
    // of each 4 KiB page through the mapping takes a fault (measured: a put's first write of a
    // 256 KiB block ran at ~1.6 GB/s and a first fetch at ~4 GB/s, against 13+ GB/s once
    // faulted in). MADV_POPULATE_WRITE (Linux 5.14) does it in one call; else touch each page.
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t lo = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
    const uintptr_t hi = reinterpret_cast<uintptr_t>(data) + length;
    // Bounded: page tables cost 2 MiB per GiB and the call takes time; a larger range faults
    // its pages in on first use instead.
    constexpr uintptr_t kPopulateLimit = uintptr_t{4} << 30;
    if (hi - lo > kPopulateLimit) return std::shared_ptr<RemoteMapping>(std::move(mapping));
    if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE) != 0) {
      for (uintptr_t at = lo; at < hi; at += page) {
        auto* p = reinterpret_cast<std::atomic<uint8_t>*>(at);
        p->fetch_add(0, std::memory_order_relaxed);  // a write fault; the byte is unchanged
      }
    }
    return std::shared_ptr<RemoteMapping>(std::move(mapping));
  }

  absl::StatusOr<std::shared_ptr<Transfer>> PostFlush(EndpointId endpoint) override {
    KVPOOL_RETURN_IF_ERROR(core_->EndpointStatus(endpoint));
    TransferRequest req;
    req.kind = TransferKind::kPut;
    req.endpoint = endpoint;
    auto transfer = std::make_shared<Transfer>(std::move(req));
    transfer->BeginPost();
    if (core_->OnOwnerThread()) {
      core_->FlushOnOwner(transfer);
    } else {
      core_->Enqueue([c = core_.get(), transfer] { c->FlushOnOwner(transfer); });
    }
    return transfer;
  }

  void Abort(const std::shared_ptr<Transfer>& transfer) override {
    if (transfer == nullptr) return;
    transfer->Cancel();
    core_->Enqueue([c = core_.get(), transfer] { c->AbortOnOwner(transfer.get()); });
  }

  absl::Status Post(const std::shared_ptr<Transfer>& transfer) override {
    if (transfer == nullptr) return absl::InvalidArgumentError("transfer: null");
    KVPOOL_RETURN_IF_ERROR(core_->EndpointStatus(transfer->request().endpoint));
    if (!transfer->BeginPost()) return absl::FailedPreconditionError("transfer: already posted");
    auto* region = static_cast<UcxRegion*>(transfer->request().local.get());
    ucp_mem_h memh = region->memh();
    if (core_->OnOwnerThread()) {
      core_->PostOnOwner(transfer, memh);
    } else {
      core_->Enqueue([c = core_.get(), transfer, memh] { c->PostOnOwner(transfer, memh); });
    }
    return absl::OkStatus();
  }

 private:
  // A UCX allocation may be a tmpfs segment under /dev/shm (RAM; a process that dies by a
  // signal can leave it behind). Use it only while it takes at most a quarter of the free space
  // there, so a large capacity never fills /dev/shm (writing past its end is SIGBUS).
  static bool FitsInSharedMemory(size_t length) {
    struct statvfs fs;
    if (statvfs("/dev/shm", &fs) != 0) return false;
    const unsigned __int128 free_bytes = (unsigned __int128)fs.f_bavail * fs.f_frsize;
    return (unsigned __int128)length * 4 <= free_bytes;
  }

  void LockOnce(uint8_t* data, size_t length) {
    if (core_->options().lock_memory && mlock(data, length) != 0) {
      // errno now, before call_once (which may overwrite it: newcomer 12 F3 saw ENOTTY's text).
      const int err = errno;
      static std::once_flag once;
      std::call_once(once, [err, length] {
        KVPOOL_LOG_WARN(
            "transport: mlock of {} bytes failed ({}); memory is registered but not locked "
            "(the limit is RLIMIT_MEMLOCK, `ulimit -l`, unless the process has CAP_IPC_LOCK)",
            length, std::strerror(err));
      });
    }
  }

  // Private anonymous memory registered with UCX (reached by same-host peers only through RMA
  // emulated by this worker over posix; fine for tcp and RDMA).
  absl::StatusOr<std::shared_ptr<MemoryRegion>> AllocatePrivate(size_t length) {
    void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("length: cannot allocate ", length, " bytes: ", std::strerror(errno)));
    }
    LockOnce(static_cast<uint8_t*>(p), length);
    auto region = Map(static_cast<uint8_t*>(p), length, /*owned=*/true);
    if (!region.ok()) munmap(p, length);
    return region;
  }

  absl::StatusOr<std::shared_ptr<MemoryRegion>> Map(uint8_t* data, size_t length, bool owned) {
    auto memh = core_->RunSync<absl::StatusOr<std::unique_ptr<UcxMemHandle>>>(
        [c = core_.get(), data, length] { return c->MapMemory(data, length); });
    if (!memh.ok()) return memh.status();
    return std::shared_ptr<MemoryRegion>(
        std::make_shared<UcxRegion>(core_, data, length, owned, *std::move(memh)));
  }

  std::shared_ptr<UcxCore> core_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxOptions& options) {
  KVPOOL_ASSIGN_OR_RETURN(auto core, UcxCore::Create(options));
  return std::unique_ptr<Transport>(new UcxTransport(std::move(core)));
}

bool SameUcxWorker(std::string_view a, std::string_view b) {
  if (a == b) return true;
  auto uuid = [](std::string_view sealed) -> std::optional<uint64_t> {
    absl::StatusOr<std::string_view> payload = internal::Unseal('A', sealed, "address");
    if (!payload.ok() || payload->size() < 1 + sizeof(uint64_t)) return std::nullopt;
    uint64_t v = 0;
    std::memcpy(&v, payload->data() + 1, sizeof(v));
    return v;
  };
  const std::optional<uint64_t> ua = uuid(a), ub = uuid(b);
  return ua.has_value() && ub.has_value() && *ua == *ub;
}

std::string UcxVersion() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return absl::StrCat(major, ".", minor, ".", release);
}

}  // namespace kvpool::transport
