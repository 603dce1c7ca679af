// kvpool/transport/transport.h — the data plane: registered memory, remote keys, endpoints and
// one-sided RMA transfers (get/put), behind an interface with a UCX and a fake implementation.
//
// KV bytes move only through this interface; gRPC carries the small things it produces (a
// worker address, packed remote keys, addresses and lengths). No UCX header is included here:
// the UCX implementation lives behind `CreateUcxTransport()` (ucx_transport.h) and an
// in-process fake for tests behind `FakeFabric` (fake_transport.h).
//
// Server side (the pool):
//   KVPOOL_ASSIGN_OR_RETURN(auto t, CreateUcxTransport({.tls = "tcp"}));
//   KVPOOL_ASSIGN_OR_RETURN(auto arena, t->AllocateMemory(1 << 30));
//   // publish t->WorkerAddress(), arena->packed_rkey(), arena->address() over gRPC
//
// Client side:
//   KVPOOL_ASSIGN_OR_RETURN(EndpointId ep, t->Connect(server_worker_address));
//   KVPOOL_ASSIGN_OR_RETURN(RemoteKeyId rk, t->UnpackRemoteKey(ep, packed_rkey));
//   KVPOOL_ASSIGN_OR_RETURN(auto local, t->RegisterMemory(buf, len));
//   KVPOOL_ASSIGN_OR_RETURN(auto xfer, t->Prepare({.kind = TransferKind::kGet, .endpoint = ep,
//       .remote_key = rk, .local = local, .ops = {{0, remote_addr, len}}}));   // prepare
//   KVPOOL_RETURN_IF_ERROR(t->Post(xfer));                                      // post
//   while (xfer->state() == TransferState::kInProgress) { ... }                // check
//   KVPOOL_RETURN_IF_ERROR(xfer->Wait(absl::Now() + absl::Seconds(1)));         // or block
//
// Threading (STYLE.md rule 5): each Transport owns one UCX worker and one owner thread that
// makes every UCX call; public methods are thread-safe and hand work to that thread through a
// queue. No lock is held across a UCX call. A Transfer's state can be read from any thread.
//
// Failure model: an endpoint whose peer died is a *state* (EndpointStatus() → UNAVAILABLE),
// not a crash; transfers on it fail with UNAVAILABLE. Remote keys are unpacked per endpoint and
// die with it (Disconnect), so a key of a previous server incarnation cannot be used once the
// client reconnects.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvpool::transport {

// Opaque handle of a connection to one peer worker. Value 0 is never valid.
struct EndpointId {
  uint64_t value = 0;
  friend bool operator==(EndpointId a, EndpointId b) { return a.value == b.value; }
};

// Opaque handle of a remote key unpacked on one endpoint. Value 0 is never valid. Valid until
// its endpoint is disconnected (then operations using it return NOT_FOUND).
struct RemoteKeyId {
  uint64_t value = 0;
  friend bool operator==(RemoteKeyId a, RemoteKeyId b) { return a.value == b.value; }
};

// A range of local memory registered for RMA (ucp_mem_map). Peers address it by virtual
// address (`address()` + offset) with the key `packed_rkey()`.
//
// Ownership: returned as shared_ptr; transfers that use a region hold a reference, so the
// registration stays valid until the last transfer on it has completed. When the region was
// allocated by the transport (AllocateMemory) the memory is freed with the region; when it was
// registered (RegisterMemory) the caller keeps owning the bytes and must keep them alive as long
// as the region. Destroying a region waits (UCX: up to 1 s) until the transport no longer reads
// or writes it on a peer's behalf (over tcp UCX answers a peer's get from a queue that copies
// from the region later); memory the transport allocated is kept until the transport closes
// when that does not finish, caller-owned memory is released anyway (logged). Thread-safe
// (immutable after creation).
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  // First byte of the region (host memory).
  virtual uint8_t* data() const = 0;
  // Length in bytes.
  virtual size_t size() const = 0;
  // The region's remote key, packed: opaque bytes (tens to hundreds) that a peer passes to
  // Transport::UnpackRemoteKey to address this region. Valid for the life of the region.
  virtual const std::string& packed_rkey() const = 0;
  // data() as the integer address peers use in TransferOp::remote_addr.
  uint64_t address() const { return reinterpret_cast<uint64_t>(data()); }
};

// A peer's registered memory range mapped into this process, so that plain loads and stores
// reach it (UCX `ucp_rkey_ptr`: the shared-memory transports attach the peer's segment when its
// key is unpacked). Obtained from Transport::MapRemote. Stores are visible to the peer once
// made (cache-coherent shared memory); the peer learns that they are complete through the
// control plane, as with a flushed put.
//
// Ownership: shared_ptr. The mapping keeps the remote key (and its endpoint) alive until the
// last reference drops, even after Disconnect, so a pointer obtained from it never dangles; a
// peer that died leaves the memory mapped (writes land nowhere useful, reads see stale bytes).
// Thread-safe (immutable).
class RemoteMapping {
 public:
  virtual ~RemoteMapping() = default;
  // Local address of remote_address(); size() bytes are addressable from it.
  virtual uint8_t* data() const = 0;
  virtual size_t size() const = 0;
  virtual uint64_t remote_address() const = 0;
  // Local pointer to [remote_addr, +length), or nullptr when the range is not inside the
  // mapping.
  uint8_t* Translate(uint64_t remote_addr, uint64_t length) const {
    const uint64_t base = remote_address();
    if (remote_addr < base || length > size() || remote_addr - base > size() - length) {
      return nullptr;
    }
    return data() + (remote_addr - base);
  }
};

// Direction of a transfer, from the initiator's point of view.
enum class TransferKind {
  kGet,  // remote → local
  kPut,  // local → remote; complete once the bytes are visible at the peer (see `flush`)
};

// One contiguous copy of a transfer.
struct TransferOp {
  uint64_t local_offset = 0;  // bytes from the local region's data()
  uint64_t remote_addr = 0;   // peer virtual address (its MemoryRegion::address() + offset)
  uint64_t length = 0;        // bytes, > 0
};

// Everything a transfer needs; validated by Transport::Prepare.
struct TransferRequest {
  TransferKind kind = TransferKind::kGet;
  EndpointId endpoint;
  RemoteKeyId remote_key;  // must belong to `endpoint`
  std::shared_ptr<MemoryRegion> local;
  std::vector<TransferOp> ops;  // 1..kMaxOpsPerTransfer
  // kPut only. true: the transfer completes once its bytes are visible at the peer (a
  // ucp_ep_flush_nbx follows the puts; it also covers every earlier put on the endpoint).
  // false: it completes at local completion (the local bytes may be reused, the peer may not
  // see them yet) — for a stream of puts whose last one flushes. Default true.
  bool flush = true;
};

inline constexpr size_t kMaxOpsPerTransfer = 1 << 16;

// Merges each op with the previous one when both their local and their remote ranges are
// adjacent (local_offset and remote_addr both continue where the previous op ended), so that
// runs of blocks laid out alike on both sides move as one RMA operation. Returns the merged ops
// in order; `carrier` (optional) receives, per input op, the index of the merged op that
// carries it (per-op statuses of the merged transfer map back through it). Order is kept; ops
// are never reordered to find more merges. Pure function, thread-safe.
std::vector<TransferOp> CoalesceOps(const std::vector<TransferOp>& ops,
                                    std::vector<size_t>* carrier = nullptr);

// Life of a transfer. kInProgress is not an error: poll again or Wait().
enum class TransferState {
  kPrepared,    // validated, not posted
  kInProgress,  // posted, not all ops complete
  kDone,        // every op completed successfully
  kFailed,      // at least one op failed, or the transfer was cancelled; see status()
};

// A prepared (then posted) batch of RMA operations on one endpoint.
//
// Thread-safety: state(), status(), item_status(), Wait() and Cancel() may be called from any
// thread concurrently. The transfer completes on the transport's owner thread.
// Lifetime: owned by shared_ptr; the transport keeps its own reference while ops are in flight,
// so dropping the caller's reference early is safe (the bytes still land in the local region).
class Transfer {
 public:
  Transfer(TransferRequest request);
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  // Non-blocking check of progress (one atomic load).
  TransferState state() const { return state_.load(std::memory_order_acquire); }

  // OK when kDone; the first error when kFailed (UNAVAILABLE: endpoint failed; CANCELLED;
  // INTERNAL: another UCX error). While kPrepared or kInProgress — which are not errors —
  // returns UNKNOWN "in progress"; callers look at state() first.
  absl::Status status() const;

  // Per-op statuses, in the order of request().ops; meaningful once state() is kDone or
  // kFailed (ops not attempted because of cancellation read CANCELLED).
  std::vector<absl::Status> item_status() const;

  // Blocks until the transfer is kDone/kFailed or `deadline` passes. Returns status() when
  // finished, DEADLINE_EXCEEDED otherwise (the transfer keeps running; call again or Cancel).
  // FAILED_PRECONDITION when never posted.
  absl::Status Wait(absl::Time deadline) const;

  // Requests cancellation: ops not yet handed to UCX are skipped and the transfer ends
  // kFailed/CANCELLED once the ops already in flight complete (RMA in flight cannot be
  // recalled; the local region stays referenced until then). No effect once finished.
  void Cancel() { cancelled_.store(true, std::memory_order_release); }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  const TransferRequest& request() const { return request_; }

  // ---- for Transport implementations only ----
  // Atomically moves kPrepared → kInProgress; false when already posted.
  bool BeginPost();
  // Sets `pending` outstanding completions (ops, plus a flush for puts).
  void MarkPosted(size_t pending);
  // Records completion of op `index` (or of the flush when index == SIZE_MAX).
  void CompleteOne(size_t index, absl::Status status);

 private:
  TransferRequest request_;
  std::atomic<TransferState> state_{TransferState::kPrepared};
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  size_t pending_ = 0;                     // guarded by mu_
  absl::Status first_error_;               // guarded by mu_
  std::vector<absl::Status> item_status_;  // guarded by mu_
};

// The data-plane interface. See the file comment for threading and failure semantics.
class Transport {
 public:
  virtual ~Transport() = default;

  // Short description, e.g. "ucx(tcp)" or "fake".
  virtual std::string Name() const = 0;

  // This worker's address: opaque bytes a peer passes to Connect(). Stable for the life of the
  // transport; a new transport (e.g. after a restart) has a different address.
  virtual std::string WorkerAddress() const = 0;

  // True when the installed UCX can register and move CUDA device memory (UCX reports
  // UCS_MEMORY_TYPE_CUDA among its memory types). Debian 12's UCX 1.13 cannot.
  virtual bool SupportsCudaMemory() const = 0;

  // Registers caller-owned host memory [addr, addr+length) for RMA. The caller keeps
  // ownership of the bytes and keeps them alive while the region (and any transfer) lives.
  // Errors: INVALID_ARGUMENT (null addr or length 0, naming the field), INTERNAL (UCX).
  virtual absl::StatusOr<std::shared_ptr<MemoryRegion>> RegisterMemory(void* addr,
                                                                       size_t length) = 0;

  // Allocates `length` bytes of page-aligned, zeroed host memory (page-locked when the process
  // may lock it) and registers it. Errors: INVALID_ARGUMENT (length 0), RESOURCE_EXHAUSTED
  // (allocation failed), INTERNAL (UCX).
  virtual absl::StatusOr<std::shared_ptr<MemoryRegion>> AllocateMemory(size_t length) = 0;

  // Connects to the worker whose address is `peer_worker_address` (from its WorkerAddress(),
  // exchanged over gRPC). Errors: INVALID_ARGUMENT (empty/malformed address), UNAVAILABLE.
  virtual absl::StatusOr<EndpointId> Connect(std::string_view peer_worker_address) = 0;

  // OK while the endpoint is usable; UNAVAILABLE once its peer failed; NOT_FOUND when unknown
  // or disconnected. Endpoints over UCX 1.13's shared-memory transports (posix, sysv, cma) have
  // no peer failure detection and never turn UNAVAILABLE by themselves: the control plane
  // (gRPC) detects the dead peer and the owner disconnects.
  virtual absl::Status EndpointStatus(EndpointId endpoint) const = 0;

  // Closes the endpoint and destroys every remote key unpacked on it. In-flight transfers on it
  // complete (with an error when the peer is gone). Errors: NOT_FOUND.
  virtual absl::Status Disconnect(EndpointId endpoint) = 0;

  // Unpacks a peer's packed remote key for use on `endpoint`.
  // Errors: NOT_FOUND (endpoint), UNAVAILABLE (endpoint failed), INVALID_ARGUMENT (empty or
  // malformed key bytes).
  virtual absl::StatusOr<RemoteKeyId> UnpackRemoteKey(EndpointId endpoint,
                                                      std::string_view packed_rkey) = 0;

  // Validates a transfer without touching the network: ops non-empty, each length > 0 and
  // [local_offset, +length) inside the local region, endpoint and key known and belonging
  // together. Errors: INVALID_ARGUMENT naming the field (e.g. "ops[3].length"), NOT_FOUND
  // (endpoint or key), UNAVAILABLE (endpoint failed).
  virtual absl::StatusOr<std::shared_ptr<Transfer>> Prepare(TransferRequest request) = 0;

  // Hands a prepared transfer to the owner thread; returns at once. Completion is observed with
  // Transfer::state()/Wait(). Errors: FAILED_PRECONDITION (already posted), UNAVAILABLE
  // (endpoint failed, or the transport is shutting down).
  virtual absl::Status Post(const std::shared_ptr<Transfer>& transfer) = 0;

  // Posts a flush of `endpoint`: the returned transfer (no ops) completes once every put
  // posted on the endpoint before this call is visible at the peer (ucp_ep_flush_nbx). Use it
  // after puts posted with `flush = false`. Errors: NOT_FOUND, UNAVAILABLE (as Post).
  virtual absl::StatusOr<std::shared_ptr<Transfer>> PostFlush(EndpointId endpoint) = 0;

  // Maps the peer's range [remote_addr, +length) of the region behind `remote_key` into this
  // process when the transport can address it directly (UCX shared-memory transports: posix,
  // sysv; not tcp or RDMA). One call per range; the mapping then costs no transport call per
  // access. The range's page tables are filled before return when it is at most 4 GiB (so no
  // access faults later; 2 MiB of page tables per GiB). Errors: NOT_FOUND (endpoint or key),
  // UNAVAILABLE (endpoint failed), UNIMPLEMENTED (no direct mapping on this transport),
  // INVALID_ARGUMENT ("length" zero, or some page of the range not mapped here). UCX computes the
  // address without bounds checks; the transport refuses ranges with unmapped pages, but a range
  // running past the remote region into other mapped memory cannot be told apart: pass only ranges
  // the region's owner published (e.g. the pool's arena address and size).
  virtual absl::StatusOr<std::shared_ptr<RemoteMapping>> MapRemote(EndpointId endpoint,
                                                                   RemoteKeyId remote_key,
                                                                   uint64_t remote_addr,
                                                                   uint64_t length);

  // Stops `transfer` for good, for a caller that will not wait for it any longer (its deadline
  // passed, its caller went away): Cancel()s it and, where the transport can, makes the network
  // give back the requests already in flight so that Wait() returns soon. Cancel alone cannot
  // recall RMA in flight, so a peer that stopped answering (SIGSTOP, a hung host) would keep
  // the transfer — and the local memory UCX may still write — busy until the connection dies.
  // UCX: when the transfer is still in flight on an endpoint with peer failure detection, its
  // connection is closed with UCP_EP_CLOSE_FLAG_FORCE: every request on it (this transfer's and
  // any other transfer's on the same peer) completes with an error, the endpoint reads as
  // failed (EndpointStatus UNAVAILABLE) and the next Connect to that peer makes a new one.
  // Without failure detection (shared memory, which completes RMA locally) only Cancel().
  // Memory safety: the local region is untouched by the transport once Wait() has returned a
  // final status, as always; Abort does not shorten that. Asynchronous (returns before the
  // requests are given back); thread-safe; no effect on a finished transfer.
  virtual void Abort(const std::shared_ptr<Transfer>& transfer) {
    if (transfer != nullptr) transfer->Cancel();
  }

  // Convenience: Prepare + Post + Wait(deadline).
  absl::Status Execute(TransferRequest request, absl::Time deadline);
};

}  // namespace kvpool::transport
