// kvpool/client/client.h — the C++ client of the kvpool pool: registration, two-phase puts
// streamed per layer, lookups, leases, and fetches straight into caller-registered buffers.
//
// Control calls go over gRPC (kvpool.v1.KvPool); KV bytes move over the data plane
// (kvpool/transport, UCX RMA): puts write un-rotated BF16 block forms into the pool's staging
// memory, fetches read stored forms into the caller's page pools and verify their checksums.
//
//   ClientOptions o; o.server = "127.0.0.1:7070"; o.ucx_tls = "tcp";
//   KVPOOL_ASSIGN_OR_RETURN(auto client, Client::Create(o));
//   KVPOOL_ASSIGN_OR_RETURN(ModelInfo info, client->RegisterModel(spec));
//   // prefill: put a sequence layer by layer
//   KVPOOL_ASSIGN_OR_RETURN(auto put, client->BeginPut(tokens));
//   for (uint32_t l = 0; l < L; ++l) KVPOOL_RETURN_IF_ERROR(put->WriteLayer(l, k[l], v[l]));
//   KVPOOL_ASSIGN_OR_RETURN(PutResult r, put->Commit());
//   // or, keeping k[l]/v[l] alive until Flush/Commit (an engine's save_kv_layer / wait_for_save):
//   for (uint32_t l = 0; l < L; ++l) KVPOOL_RETURN_IF_ERROR(put->WriteLayerAsync(l, k[l], v[l]));
//   KVPOOL_RETURN_IF_ERROR(put->Flush());
//   // decode: lease the longest prefix and fetch it into page pools
//   KVPOOL_ASSIGN_OR_RETURN(Lease lease, client->Acquire(tokens));
//   KVPOOL_ASSIGN_OR_RETURN(FetchResult f, client->Fetch(lease, plan));
//   KVPOOL_RETURN_IF_ERROR(client->Release(lease));
//
// Statuses (canonical, STYLE.md): NOT_FOUND absent key/put/lease; RESOURCE_EXHAUSTED pool
// full; UNAVAILABLE server down or restarted (retry: the client reconnects and re-registers on
// the next call), or not answering after an earlier call timed out (the call was not sent:
// ClientOptions::hung_pool_probe_timeout); DEADLINE_EXCEEDED; CANCELLED (CallOptions::cancel);
// FAILED_PRECONDITION incompatible registration; DATA_LOSS checksum mismatch (a fetched form that
// fails it is also reported to the pool, which drops it when its stored bytes are corrupt:
// Client::Fetch); INVALID_ARGUMENT names the field.
//
// Threading: a Client is thread-safe; calls from many threads proceed in parallel (no lock is
// held across a gRPC or UCX call). A PutSession belongs to one thread at a time. The client
// starts ClientOptions::copy_threads - 1 worker threads that only copy, scan and hash memory for
// large puts and fetches; they never call UCX or gRPC (the transport keeps its one owner thread
// per UCX worker).
//
// Server restarts: every remote address and key is tied to the pool's epoch (its incarnation
// id). After a restart the client drops its UCX endpoint (and with it every unpacked remote
// key), reconnects and re-registers; leases and puts of the old epoch fail with UNAVAILABLE and
// are never used against the new process: once the client has registered with the restarted
// pool, a PutSession begun before sends nothing more (no layer, pull, flush, CommitPut or
// AbortPut), and its WriteLayer, Flush and Commit say "put N: not sent: it was begun with the
// pool at ADDR before that pool restarted (epoch A; ... epoch B ...)".
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvpool/common/keys.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/transport/transport.h"

namespace kvpool::client {

// Cancels the calls it is attached to (gRPC calls in flight and transfers not yet complete).
// Thread-safe; one token may be shared by many calls. Once cancelled it stays cancelled.
class CancelToken {
 public:
  void Cancel();
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // ---- used by the client ----
  // Registers a cancel action; runs it at once when already cancelled. Returns an id for
  // Remove.
  uint64_t Add(std::function<void()> on_cancel);
  // Unregisters action `id`. When Cancel is running the actions on another thread, waits until
  // they have returned, so that no action touches what the caller frees after Remove (a
  // cancelled call's gRPC context: its TryCancel ran on after the call had returned and the
  // context was gone, found by kvpool-worker's stop during a registration, session 10).
  void Remove(uint64_t id);

 private:
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::condition_variable done_;  // notified when Cancel has run every action
  bool running_ = false;          // Cancel is running the actions (guarded by mu_)
  std::thread::id runner_;        // the thread that runs them (guarded by mu_)
  uint64_t next_ = 1;
  std::vector<std::pair<uint64_t, std::function<void()>>> actions_;
};

// Per-call options. A call that does not finish by `deadline` returns DEADLINE_EXCEEDED.
struct CallOptions {
  // Absolute deadline; InfiniteFuture() means "the client's default timeout from now".
  absl::Time deadline = absl::InfiniteFuture();
  std::shared_ptr<CancelToken> cancel;  // optional
};

// How the client reaches the pool.
struct ClientOptions {
  std::string server = "127.0.0.1:7070";  // gRPC "HOST:PORT" of the pool
  // UCX_TLS for this client's data plane ("" = environment/UCX default). Must share a
  // transport with the pool's (e.g. both "tcp", or both "posix,cma" on one host).
  std::string ucx_tls;
  // Timeout of calls whose CallOptions have no deadline. Default 10 s. In a put session it is
  // the timeout of each call of the session on its own (PutSession::SetCallTimeout), not of
  // the session: see PutSession.
  absl::Duration default_timeout = absl::Seconds(10);
  // Staging lifetime each put asks for (BeginPutRequest.timeout_ms): the pool aborts a put not
  // committed within it after BeginPut and reclaims its staging. Zero = the pool's default
  // (kvpool-server --put-timeout-ms, 30 s unless set); the pool caps it at the larger of
  // 10 min and its default. The effective value is PutSession::expires(). Default zero.
  absl::Duration put_timeout = absl::ZeroDuration();
  // Refuse K/V holding NaN or ±Inf before committing or RMA-putting them (INVALID_ARGUMENT
  // naming the layer and token; the scan rides on the pack, so the refused put is poisoned:
  // Commit fails with the same status). The pool refuses them too; checking here saves the
  // transfer and the commit. Default true.
  bool check_finite = true;
  // When the pool lets clients initiate transfers and the data plane can map the pool's memory
  // into this process (UCX shared memory, Transport::MapRemote), puts pack straight into the
  // pool's staging and fetches copy straight from leased forms, with no RMA transfer and no
  // hand-off to the transport's owner thread (docs/TRANSPORT.md "Direct mode"). false: always
  // RMA transfers. Default true.
  bool map_shared_memory = true;
  // Threads that share the per-byte work of large puts and fetches (packing a layer with its
  // NaN/Inf scan, copying fetched forms out of mapped pool memory, hashing independent blocks),
  // counting the calling thread: copy_threads - 1 worker threads are started with the client.
  // They only copy, scan and hash memory, never call UCX or gRPC. A form's checksum is made of
  // per-16 KiB-chunk digests (docs/BLOCK_FORMAT.md "Checksums"), so for a put or fetch of few
  // blocks every thread hashes the chunks it packs or copies, while they are in its cache.
  // 0 = half of std::thread::hardware_concurrency(), clamped to 1..8 (8 on the 16-core H200
  // host, where 8 threads put 4 MiB blocks at 21.9 GB/s against 14.5 with 4 — docs/TRANSPORT.md
  // session 5; 1 on a 2-core machine: everything on the calling thread). At most 64. The
  // workers spin 50 µs after each job, then sleep.
  int copy_threads = 0;
  // Put layers (bytes packed by one WriteLayer) smaller than this stay on the calling thread.
  // Default 64 KiB: on the H200 host's 16 idle cores, 32 KiB layers (256 KiB blocks) put at
  // 7.0 GB/s on one thread and 5.0 spread; 128 KiB layers 8.0 spread against 7.3
  // (docs/TRANSPORT.md "pool4").
  uint64_t parallel_put_min_bytes = 64 << 10;
  // Fetches (bytes of one Fetch) smaller than this stay on the calling thread. Default
  // 512 KiB: a verified 256 KiB fetch spread over the copy threads was not reliably faster
  // (H200 host, docs/TRANSPORT.md session 5: first fetch 6.9 against 5.1 GB/s with 4 threads
  // in one call, 4.0 against 4.3 with 8 in another; the unverified one 19 against 28); from
  // 1 MiB on, spreading wins (1 MiB warm verified 28.0 against 10.8 GB/s).
  uint64_t parallel_fetch_min_bytes = 512 << 10;
  // Fetches of at least this many bytes (and below parallel_fetch_min_bytes) are spread over
  // the copy threads when none of them is asleep (held awake through the Acquire by
  // copy_threads_prewake, or spinning after their last job), so the spread pays no wake-up.
  // Default 256 KiB: on the H200 host (posix,cma, 8 copy threads held through the Acquire) a
  // verified 256 KiB first fetch ran at 8.8 GB/s spread against 4.4 on the calling thread, the
  // warm one 17.2 against 9.2 (docs/TRANSPORT.md "Session 7", call s7a).
  uint64_t parallel_fetch_awake_min_bytes = 256 << 10;
  // Asynchronous puts (PutSession::WriteLayerAsync) whose blocks to write hold fewer bytes than
  // this are packed on the calling thread before WriteLayerAsync returns, as WriteLayer does.
  // Default 128 KiB: on the H200 host spreading gained nothing below it (16 KiB puts 1.6 GB/s
  // spread against 2.0 inline, 64 KiB 3.1 either way) and from 256 KiB on it doubles the put
  // (docs/TRANSPORT.md "Session 7"; 64-256 KiB not measured).
  uint64_t parallel_async_put_min_bytes = 128 << 10;
  // Holds the copy threads awake (spinning, not asleep) through a BeginPut whose layers, or an
  // Acquire whose fetch, will be spread over them (the floors above): from the start of the RPC
  // until it returns, then their usual 50 µs spin, so that they are running when that work
  // comes instead of being woken for it (a sleeping worker needs tens of microseconds, and on
  // the H200 host the first fetch after an Acquire and the first layer after a BeginPut ran
  // mostly on the calling thread: docs/TRANSPORT.md "Session 6"). This is the cap of one hold
  // (at most 10 s is used), for an RPC that takes longer; the cost is the copy threads' cores
  // for as long as the RPC takes: about (copy_threads - 1) x the RPC's duration of process CPU
  // per held call (on the H200 host, whose BeginPut/Acquire take ~0.3-0.4 ms, a benchmark
  // iteration of two puts and one fetch of 256 KiB cost 10.6 ms of CPU held against 2.1 not
  // held). Zero or negative = off. On by default: there it doubled the 256 KiB async put
  // (9.8 against 5.0 GB/s) and first fetch (8.8 against 4.2), and the 1 MiB ones 16.6 / 16.1
  // against 11.4 / 10.3 (docs/TRANSPORT.md "Session 7", call s7a). Default 2 ms. A 10 ms cap
  // (session 8, f3d3c2d) was reverted: in call s8b its gain (256 KiB first fetch 5.86 against
  // 4.28 GB/s, where an Acquire after a commit outlived the 2 ms hold) was within that call's
  // spread between two runs of the same build (first fetch 3.81 against 4.45, put 3.45 against
  // 4.61), it cost 31.3 against 21.3 ms of process CPU per iteration, and it spins
  // copy_threads - 1 cores through every slow RPC on an engine's node (docs/TRANSPORT.md
  // "Session 8"). An engine that is short of CPU rather than latency turns it off.
  absl::Duration copy_threads_prewake = absl::Milliseconds(2);
  // Report fetched forms that fail their checksum to the pool (Client::Fetch, in the background;
  // protocol v1.5), which drops them when its stored bytes are corrupt. false: Fetch only
  // returns DATA_LOSS and the pool keeps serving the form (for a pool from before v1.5, which
  // answers UNIMPLEMENTED, logged at each report; or tests that corrupt and restore pool memory
  // themselves). Default true.
  bool report_corrupt_forms = true;
  // Fail-fast against a pool that stopped answering (hung: SIGSTOPped, wedged; it still accepts
  // connections, so nothing fails at once). After a call to the pool gets no answer within its
  // deadline (gRPC's DEADLINE_EXCEEDED, not one the pool sent; only a deadline at least this
  // long counts), each later call first sends the standard gRPC health check
  // (grpc.health.v1.Health/Check) with this deadline (a call whose own deadline ends first
  // returns DEADLINE_EXCEEDED "not sent" when it passes, and proves nothing about the pool).
  // Any answer clears that state and the call is sent; no answer makes the call
  // return UNAVAILABLE ("<method>: not sent: the pool at HOST:PORT did not answer a health check
  // within N ms after an earlier <method> got no answer within its deadline (M ms) …") without
  // sending it, and the calls of the next hung_pool_probe_timeout after such a check return
  // the same at once (one check at a time; a call arriving during a check waits for it). So a
  // hung pool costs one call timeout, then at most this per call, instead of a full call
  // timeout per call; once it answers a check, calls go through again. A pool whose health
  // service answers while its KvPool calls hang still costs each call its timeout. Zero or
  // negative = off (every call waits for its own deadline). Default 1 s. Calls sent in the
  // background (WritePut pulls, the AbortPut after a failed Commit, corruption reports) are not
  // held back, but their unanswered deadlines count.
  absl::Duration hung_pool_probe_timeout = absl::Seconds(1);
  // Creates the data plane. Default (null): transport::CreateUcxTransport({.tls = ucx_tls}).
  // Tests pass a FakeFabric transport.
  std::function<absl::StatusOr<std::unique_ptr<transport::Transport>>()> transport_factory;
};

// What RegisterModel needs: docs/KEYS.md namespace fields plus the recipe and rotation file.
struct ModelSpec {
  std::string tenant = "default";
  std::string model_id;
  std::string revision;
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t page_size = 16;
  uint32_t sink_tokens = 64;     // S, multiple of page_size
  uint32_t recent_tokens = 256;  // W
  float clip_ratio_k = 0.96f;
  float clip_ratio_v = 0.92f;
  std::string history_precision = "int2";  // "int2" or "bf16"
  std::optional<TensorParallelShard> tensor_parallel;
  // Exactly one of: the rotation file's bytes (safetensors), or the path of a file under the
  // pool's --rotation-dir (relative to it or absolute; a pool started without one refuses it
  // with FAILED_PRECONDITION, docs/OPERATIONS.md).
  std::string rotation_file;
  std::string rotation_path;
};

// The registration as the pool confirmed it.
// Another revision of a registered model id that holds blocks in the pool
// (RegisterModelResponse.other_revisions, protocol v1.7).
struct OtherRevision {
  std::string revision;
  Digest rotation_id{};  // SHA-256 of that revision's rotation file
  uint64_t blocks = 0;   // blocks resident under it when the registration ran
};

struct ModelInfo {
  Digest namespace_id{};  // key(-1); block keys chain from it
  Digest rotation_id{};
  // The pool's other revisions of this tenant and model id (same shard) holding blocks, most
  // blocks first, at most 8, as of the (latest) registration: blocks stored under them are not
  // found under this revision (e.g. after a recalibrated rotation file). Empty from a pool
  // before v1.7.
  std::vector<OtherRevision> other_revisions;
  bool created = false;
  uint64_t pool_epoch = 0;
  uint64_t bf16_form_bytes = 0;
  uint64_t int2_form_bytes = 0;
  uint32_t sink_blocks = 0;
  uint32_t recent_blocks = 0;
  BlockGeometry geometry;
  // true: the pool initiates every RMA transfer (it pulls puts with WritePut and pushes fetches
  // with ReadLeased; chosen by the pool, e.g. over UCX tcp) and the client never addresses the
  // pool's memory itself, so DataPlaneTarget is refused. docs/TRANSPORT.md.
  bool pool_initiates_transfers = false;
  // true: this client mapped the pool's memory (ClientOptions::map_shared_memory over a
  // shared-memory transport) and puts/fetches copy directly, without RMA transfers.
  bool mapped_pool_memory = false;
};

enum class Form { kBf16, kInt2 };

// ---- put ----

struct PutResult {
  uint32_t num_blocks = 0;      // full blocks of the put
  uint32_t blocks_written = 0;  // blocks whose bytes were sent (the rest already existed)
  uint64_t bytes_written = 0;   // staging bytes sent over the data plane
};

// One open two-phase put. Write every layer once, in order 0..L-1 (the checksum of each block
// form is streamed layer by layer), then Commit. Destroying an
// uncommitted session aborts it (best effort). Not thread-safe; movable only via unique_ptr.
//
// Errors and layer counting. A WriteLayer(Async) refused for its own arguments or order
// (INVALID_ARGUMENT "layer"/"k"/"v", FAILED_PRECONDITION out of order or finished) writes
// nothing and does not count its layer: the caller may call again with the right arguments.
// Every other error fails the put for good. A data-plane or pool error, CANCELLED or a pool
// found dead is sticky: the call that finds it and every later WriteLayer(Async), Flush and
// Commit of the session return the same status, Commit after aborting the put. A NaN/Inf
// (ClientOptions::check_finite) poisons the put instead, with a status that never depends on
// timing or on the data path: WriteLayerAsync never returns it (its own layer's or an earlier
// one's); WriteLayer returns INVALID_ARGUMENT exactly when its own layer holds one, naming that
// layer and its first bad token, whatever the earlier layers held (so a later clean WriteLayer
// returns OK); Flush (every time) and Commit (which aborts) return INVALID_ARGUMENT naming the
// lowest bad layer written and its first bad token — ahead of any other error of the put,
// since whether one also happened can depend on timing (nothing is sent after a bad layer is
// found). A call that returns an error, or writes a layer of a poisoned put, still counts its
// layer (nothing more is written), so a caller that goes on writing layers 0..L-1 after an
// error, or one that stops at the first error, gets that error from Commit, never a
// FAILED_PRECONDITION about missing layers. Commit returns FAILED_PRECONDITION "only N of L
// layers written" only for a put without such an error.
//
// A session must not outlive the Client that created it. Destroying the Client first fails
// clearly instead of crashing: the Client's destructor aborts each of its sessions still open
// (joining its layers in flight, the abort bounded as Abort's) and detaches it; its later
// WriteLayer(Async), Flush and Commit return FAILED_PRECONDITION naming the destroyed Client,
// Abort returns OK (nothing is left to abort) and its destructor does nothing. Destroying the
// Client while another thread is inside a call of one of its sessions is undefined.
//
// Deadlines. BeginPut's CallOptions::deadline bounds the BeginPut call only. Every later call
// of the session gets its own deadline, from its own start: the call timeout
// (ClientOptions::default_timeout unless SetCallTimeout changed it) bounds each WritePut call
// the pool pulls a layer with (from the WriteLayer that starts it), each wait for this
// client's RMA transfers in WriteLayer/Flush/Commit, the CommitPut call and the AbortPut call.
// The session as a whole is bounded by the pool's put timeout (ClientOptions::put_timeout or
// the pool's --put-timeout-ms; expires()), which the pool enforces: a prefill may take
// minutes between BeginPut and Commit. A put the pool dropped for its timeout fails its next
// call with DEADLINE_EXCEEDED naming the put timeout. BeginPut's CallOptions::cancel cancels
// every call of the session. Client::Put with an explicit CallOptions::deadline bounds the
// whole put by it.
class PutSession {
 public:
  virtual ~PutSession() = default;
  // The timeout of each later call of this session (see the class comment); > 0.
  virtual void SetCallTimeout(absl::Duration timeout) = 0;
  // When the pool drops the put if it is not committed: the local estimate BeginPut's start +
  // the effective put timeout the pool returned (BeginPutResponse.timeout_ms).
  virtual absl::Time expires() const = 0;
  // Sends layer `layer` of the sequence: `k` and `v` are [num_tokens][num_kv_heads][head_dim]
  // bf16 (uint16 bit patterns), un-rotated (post-RoPE, as the engine has them), both of the same
  // length, a whole number of tokens, with num_tokens >= num_blocks * page_size (extra tokens
  // are ignored). The bytes are copied before return; the transfer proceeds in the background,
  // so layer l travels while the caller computes layer l+1. How it travels: in direct mode (the
  // pool's memory is mapped, ClientOptions::map_shared_memory) the layer is packed straight into
  // the pool's staging before return; with client-initiated RMA it is packed into a registered
  // buffer and put (one transfer per layer); when the pool initiates transfers
  // (ModelInfo::pool_initiates_transfers) it is packed into a registered buffer and a WritePut
  // call (gRPC callback API, no thread of ours) lets the pool pull it (one call per layer, calls
  // overlapping; Flush/Commit wait for them). Large layers are packed by the client's copy
  // threads too (ClientOptions::copy_threads). Errors (the class comment says which count
  // the layer and which fail the put): INVALID_ARGUMENT "layer" (>= num_layers), "k" (fewer
  // elements than num_blocks * page_size tokens, or not a whole number of tokens of
  // num_kv_heads * head_dim elements) or "v" (not as long as k), each naming the sizes;
  // INVALID_ARGUMENT for a non-finite value in this layer, naming the layer and its first bad
  // token (the put is poisoned: Flush and Commit return the lowest bad layer's; a NaN/Inf in an
  // earlier layer, asynchronous or not, is not this call's status: the class comment);
  // FAILED_PRECONDITION (layer out of order, session finished, Client destroyed);
  // CANCELLED; UNAVAILABLE (data plane; in direct mode also a pool found dead before the layer
  // is written: the mapped staging is written with no call to the pool, so the client first
  // checks that its gRPC connection is up, else asks Stats — as Fetch does; a pool that dies
  // later is seen by Flush/Commit; any mode: a put begun before the pool restarted, once the
  // client has registered with the restarted pool, "not sent: it was begun ... before that pool
  // restarted"); the put's earlier error.
  virtual absl::Status WriteLayer(uint32_t layer, absl::Span<const uint16_t> k,
                                  absl::Span<const uint16_t> v) = 0;
  // Sends layer `layer` like WriteLayer (same arguments, same bytes, same checksums, same
  // refusals), but returns once the layer is queued: it is packed, scanned for NaN/Inf and
  // hashed by the client's copy threads in the background, with no wait per layer, while the
  // caller computes the next layer. This is vLLM's save_kv_layer … wait_for_save contract.
  //
  // Ownership: the memory of `k` and `v` must stay valid and unchanged from this call until the
  // next Flush, Commit or Abort of this session returns (whatever its status), or until the
  // session is destroyed; the client reads it until then and never writes it. Flush joins every
  // layer written so far (that is the put's wait_for_save); Commit and Abort join too, and the
  // destructor joins before it returns, so nothing of this session runs after it.
  //
  // Errors: those of WriteLayer's checks (INVALID_ARGUMENT "layer"/"k"/"v", FAILED_PRECONDITION
  // out of order, finished or Client destroyed, CANCELLED, UNAVAILABLE in direct mode when the
  // pool is found dead before the layer is queued), and the put's earlier error.
  //
  // A non-finite value (ClientOptions::check_finite) gives the same result on every path (direct,
  // client-initiated RMA, pool-initiated; packed by the copy threads or on the calling thread)
  // and with any timing: no WriteLayerAsync reports a NaN/Inf, its own layer's or an earlier
  // one's; Flush and Commit (which aborts the put: nothing becomes visible) return
  // INVALID_ARGUMENT naming the lowest bad layer and its first bad token. The put is poisoned: a
  // layer holding one is never RMA-put or pulled, and the layers queued after it is found are
  // counted but not packed. No call waits for an earlier layer to learn this (session 8: such a
  // wait, so that the next call could report it, cost the 256 KiB async put 9.66 -> 5.65 GB/s
  // on the H200 host: docs/TRANSPORT.md "Session 8"), so any number of layers are packed in the
  // background at once (they need no memory beyond the caller's k/v and the put's staging or
  // registered buffer). A data-plane error (RMA, pool pulls) is returned by the call that finds
  // it and then, sticky, by every later one.
  //
  // How it travels: direct mode — the copy threads pack straight into the mapped staging;
  // client-initiated RMA and pool-initiated mode — they pack into a registered buffer of the
  // whole put, and each WriteLayerAsync sends (RMA put, or one WritePut call for the pool to pull)
  // the earlier layers, in order, that are packed by then, without waiting for any; Flush and
  // Commit send the rest. An engine computes between two layers, so layer l-1 is normally
  // packed and sent by the call for layer l.
  // Puts whose written blocks hold fewer than ClientOptions::parallel_async_put_min_bytes, and
  // clients with one copy thread, pack on the calling thread before return (as WriteLayer, but
  // leaving this layer's own NaN/Inf to Flush and Commit, as above).
  // Mixing WriteLayer and WriteLayerAsync in one put is allowed (WriteLayer joins the
  // asynchronous layers before it, but returns only its own layer's NaN/Inf: the class comment).
  // One copy-pool stream per put; with more than four asynchronous puts in flight at once in one
  // client, the extra ones pack on their calling threads.
  virtual absl::Status WriteLayerAsync(uint32_t layer, absl::Span<const uint16_t> k,
                                       absl::Span<const uint16_t> v) = 0;
  // Waits until every layer written so far is visible in the pool's staging memory (the
  // data-plane half of a put; an engine's wait_for_save), joining asynchronous layers first;
  // afterwards the caller may reuse their k/v. Errors: INVALID_ARGUMENT naming the lowest layer
  // written that holds a non-finite value and its first bad token (from any layer, asynchronous
  // or not; returned by every Flush of a poisoned put, ahead of other errors: the class
  // comment), UNAVAILABLE, DEADLINE_EXCEEDED, FAILED_PRECONDITION (Client destroyed), and the
  // put's sticky error.
  virtual absl::Status Flush() = 0;
  // Waits for every layer's transfer, sends checksums, commits. On failure the put is aborted
  // (Abort: at most 2 s more), except when CommitPut got no answer within the call timeout:
  // then Commit returns DEADLINE_EXCEEDED at that timeout and the AbortPut is sent without
  // waiting for it (a pool that does not answer the commit would hold the caller another 2 s
  // for the abort; one that was only slow may still have committed the put). The same when the
  // CommitPut is cancelled (BeginPut's CallOptions::cancel, during the call or before it): Commit
  // returns CANCELLED at once, saying whether the CommitPut was sent (then the pool may have
  // committed the put before the cancel), and the AbortPut goes out without waiting.
  // Errors: the put's error when it has one (the class comment: INVALID_ARGUMENT naming the
  // lowest layer holding a NaN/Inf and its first bad token, the same status as Flush, however
  // many layers were written; else the sticky error), else FAILED_PRECONDITION (a layer missing, or
  // the Client destroyed), DATA_LOSS, UNAVAILABLE, DEADLINE_EXCEEDED, plus the pool's refusals
  // (e.g. INVALID_ARGUMENT for NaN/Inf found at commit; RESOURCE_EXHAUSTED when the pool has no
  // room for the new forms: the commit needs them and the put's staging at once, see
  // Client::BeginPut).
  virtual absl::StatusOr<PutResult> Commit() = 0;
  // Drops the put; nothing becomes visible. Idempotent (OK once committed, aborted or detached
  // from a destroyed Client). Asynchronous layers not yet packed are skipped; the call waits for
  // those being packed (no copy thread touches k/v or the staging after it returns).
  // Bounded by the smaller of the call timeout and 2 s, also against a pool that stopped
  // answering: pool-initiated puts give their WritePut calls in flight half of that and then
  // cancel them (the pool drops a cancelled pull within ~100 ms), and the AbortPut gets the rest
  // (asked again while the pool still holds a pull of the put); the registered buffer such a
  // cancelled pull reads is never reused while the pool may still read it (kept until the put's
  // timeout plus 10 s). With client-initiated RMA the put's transfers in flight are waited for
  // first and then the endpoint is flushed (remote completion of every put of the session),
  // together up to 5 s (RMA in flight cannot be recalled, and the pool must not reuse staging
  // it may still write; a flush unfinished by then force-closes the connection, up to 1 s
  // more), and the AbortPut then gets at least half the bound. Errors:
  // DEADLINE_EXCEEDED when the AbortPut got no answer in time (the message says so; the pool
  // reclaims the put's staging at its put timeout, expires()), UNAVAILABLE.
  virtual absl::Status Abort() = 0;
  // Full blocks this put covers and how many need writing (the rest already exist).
  virtual uint32_t num_blocks() const = 0;
  virtual uint32_t blocks_to_write() const = 0;
};

// ---- lookup and leases ----

struct BlockInfo {
  BlockKey key{};
  bool sink = false;
  bool has_bf16 = false;
  bool has_int2 = false;
};

struct LookupResult {
  uint32_t num_blocks = 0;        // leading blocks held
  std::vector<BlockInfo> blocks;  // one per held block
};

struct FormLocation {
  uint64_t remote_addr = 0;
  std::string rkey;  // packed remote key
  uint64_t size = 0;
  uint64_t generation = 0;
  uint64_t xxh3 = 0;
};

struct LeasedBlock {
  uint32_t index = 0;
  BlockKey key{};
  bool sink = false;
  std::optional<FormLocation> bf16;
  std::optional<FormLocation> int2;
};

struct Lease {
  uint64_t id = 0;  // 0 when nothing was held (no lease taken)
  uint64_t pool_epoch = 0;
  absl::Time expires;  // local estimate (call start + lease_ms)
  std::vector<LeasedBlock> blocks;
};

// ---- fetch ----

// A caller-registered buffer of pages of one form (RegisterBuffer). Page p occupies
// [p * page_stride, p * page_stride + form_bytes) of the region.
struct PagePool {
  std::shared_ptr<transport::MemoryRegion> region;
  uint64_t page_stride = 0;  // bytes >= the form's bytes
};

// Where to put a lease's blocks.
struct FetchPlan {
  PagePool* bf16_pool = nullptr;  // required when any block is fetched in BF16
  PagePool* int2_pool = nullptr;  // required when any block is fetched in INT2
  // Page ids to fill, consumed in block order from each list (must be long enough). No page
  // may be given to two blocks, nor, when both pools share memory, overlap the other pool's
  // (INVALID_ARGUMENT naming the list, the page and both blocks; nothing is copied).
  std::vector<int32_t> bf16_pages;
  std::vector<int32_t> int2_pages;
  uint32_t max_blocks = 0;  // 0 = every leased block
  // When some block of the recent window (the last recent_blocks leased blocks) has no BF16
  // form: true → fetch the whole window as INT2 (history); false → stop before the window
  // (num_blocks < leased, the caller recomputes the window). Default false (FORMAT.md §3).
  // History blocks are always fetched as INT2 (the decode kernel's history segment reads INT2;
  // history precision int2). A history block the pool keeps in BF16 only — one whose INT2
  // encoding overflowed, values beyond fp16's range (FORMAT.md §2.3; Lookup shows it as
  // has_int2 false) — therefore ends the fetch there, whatever this flag: NOT_FOUND in its
  // block_status (the message says why), num_blocks the blocks before it. The decoder
  // recomputes from that block on from the tokens, as for a miss; putting the sequence again
  // does not help (the pool keeps such a block BF16-only).
  bool accept_int2_window = false;
  // Full blocks of the sequence the fetched blocks begin (0 = the blocks fetched), so that the
  // recent window is that sequence's last recent_blocks blocks: a decoder that takes a prefix of
  // a longer prompt's blocks from the pool (a partial hit, e.g. a prompt sharing all but its
  // last block with a stored one) passes the blocks it wants, and the fetched blocks before
  // that window come as INT2 history although they are among the last recent_blocks fetched —
  // they are history in the prompt's own context (FORMAT.md §3), and the pool holds their INT2
  // form. Only the fetched blocks inside the window are read in BF16 (accept_int2_window
  // applies to those). Less than the blocks fetched (the lease's, at most max_blocks) is
  // INVALID_ARGUMENT naming plan.sequence_blocks. Ignored with history precision bf16.
  uint32_t sequence_blocks = 0;
  // Compare the form checksum (docs/BLOCK_FORMAT.md "Checksums") of every fetched form with
  // the lease's (DATA_LOSS per block on mismatch).
  // The lease alone already fails closed against slot reuse (a leased slot is never reused and
  // a lease that expired before the fetch ended fails it); the checksum adds detection of
  // corrupted bytes. The client hashes with libxxhash's AVX2/AVX-512 dispatch and, when the
  // pool's memory is mapped (direct mode), each 16 KiB chunk on the thread that copied it,
  // while it is still in that thread's cache.
  // false skips it (e.g. a caller that verifies later on the GPU). Default true.
  bool verify_checksums = true;
  // When set (not owned), receives the bytes this call moved into the page pools — the
  // FetchResult::bytes of a fetch that returns OK — also when the fetch then fails after moving
  // them: the lease expired or was released during the fetch (FAILED_PRECONDITION), or the pool
  // was found dead after a direct copy (UNAVAILABLE). The caller discards those pages; this
  // lets it count what crossed the data plane (newcomer report 11 F11: a decode worker reported
  // 0 bytes discarded for a fetch whose lease expired after its 593920 bytes were copied). 0
  // when nothing moved (refused before any byte moved, a transfer that failed or timed out).
  uint64_t* moved_bytes = nullptr;
};

// CSR page table of one segment for one request (docs/BLOCK_FORMAT.md "Page tables").
struct SegmentTable {
  std::vector<int32_t> indptr{0};      // [batch + 1]
  std::vector<int32_t> indices;        // [nnz] page ids in token order
  std::vector<int32_t> last_page_len;  // [batch]
};

struct PageTables {
  SegmentTable sink;     // BF16 pages
  SegmentTable history;  // INT2 pages
  SegmentTable recent;   // BF16 pages
};

struct FetchResult {
  uint32_t num_blocks = 0;                 // leading blocks fetched and verified
  std::vector<absl::Status> block_status;  // one per block considered, in order
  std::vector<Form> forms;                 // form fetched per block (num_blocks entries)
  std::vector<int32_t> pages;              // page id per block (num_blocks entries)
  PageTables tables;                       // batch of one
  uint64_t bytes = 0;                      // bytes moved
};

// ---- corruption reports ----

// A fetched form that failed its checksum, for Client::ReportCorrupt: the block's key, the form
// and the generation its lease gave for that form (FormLocation::generation).
struct CorruptForm {
  BlockKey key{};
  Form form = Form::kBf16;
  uint64_t generation = 0;
  uint64_t observed_xxh3 = 0;  // the form checksum the caller computed (the pool only logs it)
};

enum class CorruptionVerdict {
  kDropped,  // the pool's stored bytes were corrupt: it dropped the form (re-put the block)
  kIntact,   // the stored bytes verify: the pool kept the form; the caller's copy was damaged in
             // transit or in this process (fetch again)
};

// The pool's answer to one CorruptForm.
struct CorruptionOutcome {
  // OK: the pool re-verified its stored form (verdict). Otherwise it did nothing: NOT_FOUND
  // naming reports[i].key (no such block in this model's namespace) or reports[i].form (the
  // block does not hold that form: dropped already, demoted), FAILED_PRECONDITION naming
  // reports[i].generation (the form was stored again since: a stale report), INVALID_ARGUMENT
  // naming reports[i] (the same form twice), RESOURCE_EXHAUSTED naming reports[i] (this client
  // host is over the pool's rate of re-verified reports, kvpool-server
  // --corruption-report-rate: report again later). A form the pool verified intact within the
  // last 60 s is answered kIntact again without being re-hashed.
  absl::Status status;
  CorruptionVerdict verdict = CorruptionVerdict::kIntact;
  // Whether the block still holds a form, for every status (false: the key is not held, or the
  // dropped form was its last; lookups stop before it until it is put again). `verdict` is
  // meaningful only when `status` is OK.
  bool block_held = true;
};

// The payload (absl::Status::GetPayload) a status carries when this client, not the pool,
// refused what the pool offered: FAILED_PRECONDITION from RegisterModel when the pool has no
// UCX data plane (kvpool-server --data-plane none) or its form sizes differ from this client's.
inline constexpr char kRefusedByClientPayload[] = "type.kvpool/refused-by-client";
// Whether `status` is such a refusal by the client (the pool accepted the call).
bool RefusedByClient(const absl::Status& status);

// The payload an UNAVAILABLE status carries when UCX found that this client's and the pool's
// workers share no transport (ucp_ep_create "Destination is unreachable", on either side: the
// message says to check --ucx-tls / UCX_TLS). A configuration mismatch, not an outage: calling
// again does not help.
inline constexpr char kNoSharedUcxTransportPayload[] = "type.kvpool/no-shared-ucx-transport";
bool NoSharedUcxTransport(const absl::Status& status);

// The payload of the DEADLINE_EXCEEDED a PutSession call returns once the pool dropped the put
// for its put timeout ("not committed within the pool's put timeout"): nothing of the put is
// visible; the same K/V can be put again with a new BeginPut.
inline constexpr char kPutExpiredPayload[] = "type.kvpool/put-expired";
bool PutExpired(const absl::Status& status);

// The payload of the DEADLINE_EXCEEDED a call returns when its deadline passed with no answer
// from the pool at all ("<Method>: no answer from the pool at HOST:PORT within the call's
// deadline"): a pool stopped for a moment, swamped or gone; it may still handle the call (a
// CommitPut may still commit), unlike a DEADLINE_EXCEEDED the pool answered with.
inline constexpr char kNoAnswerPayload[] = "type.kvpool/no-answer";
bool NoAnswer(const absl::Status& status);

// Concatenates the page tables of several requests into one batch (request order).
PageTables MergePageTables(absl::Span<const PageTables* const> per_request);

// The pool's counters (StatsResponse of the proto), for tests and dashboards.
struct PoolStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;     // committed forms + staging
  uint64_t staging_bytes = 0;  // reserved by open puts
  uint64_t blocks = 0;
  uint64_t open_puts = 0;
  uint64_t leases = 0;
  uint64_t evicted_blocks = 0;
  uint64_t demoted_forms = 0;
  uint64_t pool_epoch = 0;
  // The pool's process id in its own pid namespace (protocol v1.6; 0 from an older pool). For
  // test harnesses on the pool's host (kvpool-worker --fault-pool-pid).
  uint32_t pool_pid = 0;
};

class Client {
 public:
  // Creates the data plane, the gRPC channel (no RPC yet) and the copy threads. Errors:
  // INVALID_ARGUMENT ("server", "copy_threads"), INTERNAL (UCX).
  static absl::StatusOr<std::unique_ptr<Client>> Create(const ClientOptions& options);
  // Destroy the Client after every PutSession it created; one still alive is aborted and
  // detached (logged; PutSession's class comment).
  virtual ~Client() = default;

  // Registers (or re-attaches to) the model; the client remembers it and re-registers after a
  // pool restart, or after the pool freed the registration (--max-registration-bytes: that call
  // fails with UNAVAILABLE, the next one registers again). Connects the data plane to the pool's
  // worker. Errors: FAILED_PRECONDITION (differing registration; the message lists the fields; or,
  // marked RefusedByClient, a pool this client cannot use: no UCX data plane), INVALID_ARGUMENT
  // (spec fields), UNAVAILABLE (pool unreachable; when the UCX workers share no transport — this
  // call or a later put/fetch the pool serves by connecting back — the message says to check
  // --ucx-tls / UCX_TLS on both).
  virtual absl::StatusOr<ModelInfo> RegisterModel(const ModelSpec& spec,
                                                  const CallOptions& call = {}) = 0;
  // The current registration (after RegisterModel). FAILED_PRECONDITION before.
  virtual absl::StatusOr<ModelInfo> model() const = 0;

  // Block keys of the full blocks of `tokens` (docs/KEYS.md), from the registered namespace.
  virtual absl::StatusOr<std::vector<BlockKey>> Keys(absl::Span<const uint32_t> tokens) const = 0;

  // Starts a put of the full blocks of `tokens` (the partial tail is not stored).
  // `call.deadline` bounds this call only; the session's later calls each get the call
  // timeout, and the session lives until the pool's put timeout (PutSession).
  // Room: the pool reserves staging for the blocks to write (one BF16 form each) here, but the
  // new forms only at Commit, while that staging is still held: a commit needs room for both at
  // once (up to a BF16 plus an INT2 form per block on top of its staging; eviction frees only
  // blocks no lease, open put or commit holds). The pool refuses here a put that cannot commit
  // with what it holds now (RESOURCE_EXHAUSTED naming num_blocks, with the numbers); the check is
  // a lower bound, so Commit can still fail RESOURCE_EXHAUSTED when leases or puts arrive
  // meanwhile (docs/CLIENT.md "Room for a commit").
  // Errors: INVALID_ARGUMENT ("tokens": fewer than page_size), RESOURCE_EXHAUSTED (no room for
  // the staging, or for the commit), UNAVAILABLE, DEADLINE_EXCEEDED / CANCELLED (the call given
  // up on: the pool may still open the put, so the client aborts it by the put tag it sent, in
  // the background; protocol v1.8, docs/PROTOCOL.md).
  virtual absl::StatusOr<std::unique_ptr<PutSession>> BeginPut(absl::Span<const uint32_t> tokens,
                                                               const CallOptions& call = {}) = 0;

  // Convenience: BeginPut + WriteLayerAsync for every layer (k[l], v[l]) + Commit (k and v are
  // the caller's for the whole call, so every layer is packed in the background and joined once,
  // at Commit). An explicit `call.deadline` bounds the whole put; without one each call gets
  // default_timeout. A non-finite value fails it with WriteLayer's INVALID_ARGUMENT.
  virtual absl::StatusOr<PutResult> Put(absl::Span<const uint32_t> tokens,
                                        absl::Span<const absl::Span<const uint16_t>> k,
                                        absl::Span<const absl::Span<const uint16_t>> v,
                                        const CallOptions& call = {}) = 0;

  // Longest held prefix of `tokens` and its forms. Side-effect free. Fewer tokens than one
  // block (0 included) hold no full block: 0 blocks, answered without a call to the pool (after
  // the registration check), so it reaches none of the pool's lookup counters. Errors:
  // FAILED_PRECONDITION (no model registered), UNAVAILABLE, DEADLINE_EXCEEDED.
  virtual absl::StatusOr<LookupResult> Lookup(absl::Span<const uint32_t> tokens,
                                              const CallOptions& call = {}) = 0;

  // Leases the longest held prefix (at most max_blocks when > 0) for `lease_ms` (0 = the
  // pool's default). A lease with id 0 means nothing is held — also the answer for fewer
  // tokens than one block (0 included, answered without a call to the pool).
  virtual absl::StatusOr<Lease> Acquire(absl::Span<const uint32_t> tokens, uint32_t max_blocks = 0,
                                        uint32_t lease_ms = 0, const CallOptions& call = {}) = 0;
  virtual absl::Status Renew(Lease& lease, uint32_t lease_ms = 0, const CallOptions& call = {}) = 0;
  // NOT_FOUND: the lease had expired (bytes read under it must be discarded). Whatever the
  // outcome, Fetch refuses the lease from the call's start on.
  virtual absl::Status Release(const Lease& lease, const CallOptions& call = {}) = 0;

  // Registers caller memory as a fetch destination (pinned host memory for UCX).
  virtual absl::StatusOr<std::shared_ptr<transport::MemoryRegion>> RegisterBuffer(
      void* addr, size_t length) = 0;

  // Reads the leased blocks into the plan's page pools (UCX RMA get), verifies each block's
  // checksum (DATA_LOSS in its block_status) and builds the page tables. num_blocks counts the
  // leading blocks that all verified; a block whose lease lacks the form its segment is read in
  // (a history block held in BF16 only: FetchPlan::accept_int2_window) ends it there with
  // NOT_FOUND in its block_status. Errors for the whole call: INVALID_ARGUMENT (plan:
  // missing pool, too few pages, page_stride too small or region too small, a page given to
  // two blocks or overlapping the other pool's, naming the field; checked before any byte
  // moves), NOT_FOUND naming lease_id (a lease this client released, or did not acquire:
  // only this client's live leases are read, whatever the Lease's fields say), UNAVAILABLE
  // (lease from another pool epoch, or the connection failed since the lease was taken and the
  // pool cannot be reached to confirm its epoch; or data plane down). Liveness: when the client
  // reads the pool's memory itself (mapped, or client-initiated RMA) nothing on that path tells
  // it the pool died (no UCX peer failure detection over shared memory), so it first confirms
  // the pool is alive — the gRPC connection is up (a client thread keeps the channel polled, so
  // a closed socket is seen within milliseconds), else a Stats call at the lease's epoch — and
  // in direct mode again after the copy; a pool found dead is UNAVAILABLE (after the copy: the
  // pages this call wrote must be discarded). A pool that dies after the last check (or within
  // those milliseconds before it) goes unnoticed by this call: its bytes are then still the leased
  // forms (verified against the lease's checksums unless verify_checksums is false), and the
  // Release that follows fails (UNAVAILABLE); a caller that must know the pool outlived the fetch
  // discards the bytes on a non-OK Release. FAILED_PRECONDITION (lease expired locally, before or
  // during the fetch, or released by another thread during it), DEADLINE_EXCEEDED, CANCELLED.
  // Corruption: the forms of a fetch that returns OK and whose checksum failed (DATA_LOSS in
  // block_status) are reported to the pool (ReportCorrupt below, one call for the fetch, at
  // most kMaxCorruptionReports forms; unless ClientOptions::report_corrupt_forms is false) in
  // the background: Fetch does not wait for it, the report
  // has a 2 s deadline, at most 4 are in flight per client (more are dropped, logged), and its
  // outcome is only logged. The pool re-verifies each stored form and drops the corrupt ones, so
  // the next Acquire no longer leases them (the Lookup stops before such a block until it is put
  // again); a form that verifies at the pool stays. When the pool pushes the forms
  // (pool_initiates_transfers), a form it has dropped since the Acquire comes back DATA_LOSS
  // without moving ("the pool found this form corrupt").
  virtual absl::StatusOr<FetchResult> Fetch(const Lease& lease, const FetchPlan& plan,
                                            const CallOptions& call = {}) = 0;

  // Most forms one ReportCorrupt call (and one Fetch's background report) names.
  static constexpr size_t kMaxCorruptionReports = 256;
  // Tells the pool that `forms` of this model failed their checksum here, for callers that
  // verify fetched bytes themselves (FetchPlan::verify_checksums = false, e.g. on the GPU);
  // Fetch reports its own failures. The pool re-hashes each stored form and drops it when it is
  // corrupt (CorruptionVerdict::kDropped: put the block again), else keeps it (kIntact). One
  // outcome per form, in order (see CorruptionOutcome); a report cannot drop a form whose
  // stored bytes verify, whatever it names. Errors for the call: INVALID_ARGUMENT ("forms":
  // empty or more than kMaxCorruptionReports), FAILED_PRECONDITION (RegisterModel first),
  // UNAVAILABLE (pool unreachable or restarted: the forms named are gone anyway),
  // DEADLINE_EXCEEDED, CANCELLED. Thread-safe.
  virtual absl::StatusOr<std::vector<CorruptionOutcome>> ReportCorrupt(
      absl::Span<const CorruptForm> forms, const CallOptions& call = {}) = 0;

  // Deletes blocks; one status per key.
  virtual absl::StatusOr<std::vector<absl::Status>> Delete(absl::Span<const BlockKey> keys,
                                                           const CallOptions& call = {}) = 0;

  // The pool's counters. Needs no registration.
  virtual absl::StatusOr<PoolStats> Stats(const CallOptions& call = {}) = 0;

  // For a process about to exit at once (kvpool-worker's second SIGTERM): sends AbortPut for
  // every put of this client still open (a PutSession begun and not yet destroyed; one already
  // committed or aborted answers NOT_FOUND), one after the other, until every one is answered
  // or `wait` has passed, so that the pool frees their staging now instead of at its put
  // timeout. A put the pool is still pulling a layer of (FAILED_PRECONDITION) is asked again
  // every 20 ms within `wait`. The sessions are not touched (their later calls behave as
  // without this call; one may then find its put gone). Thread-safe: callable while other
  // threads are inside calls of those sessions. Also asks again for puts whose session is gone
  // but whose AbortPut went out in the background unanswered (a commit cancelled or timed out,
  // PutSession::Commit). Returns how many puts the pool may still hold — `open`: begun with the
  // pool's current incarnation (a restarted pool never knew the others) and not answered
  // NOT_FOUND (committed, aborted or expired already) — and how many of them the pool aborted
  // now; those not aborted (no answer within `wait`, e.g. a stopped pool) keep their staging
  // until the pool's put timeout.
  struct OpenPutAborts {
    int open = 0;
    int aborted = 0;
  };
  virtual OpenPutAborts AbortOpenPutsNow(absl::Duration wait) = 0;

  // The endpoint and unpacked remote key for a leased form, for callers that drive the data
  // plane themselves (transport().Prepare/Post). Valid until the pool's epoch changes.
  // Errors: UNAVAILABLE (epoch changed or data plane down), INVALID_ARGUMENT (rkey bytes),
  // FAILED_PRECONDITION when the pool initiates transfers (ModelInfo::pool_initiates_transfers).
  virtual absl::StatusOr<std::pair<transport::EndpointId, transport::RemoteKeyId>> DataPlaneTarget(
      uint64_t pool_epoch, const std::string& packed_rkey) = 0;

  // The data plane (for callers that manage their own buffers).
  virtual transport::Transport& transport() = 0;
};

// Packs one layer of an engine's K/V ([tokens][H][d] bf16) into the BF16 block-form slice of
// block `block` (docs/BLOCK_FORMAT.md: per head K[P][d] then V[P][d]); `out` must hold
// H * 4 * P * d bytes. Exposed for tests and benchmarks.
void PackLayerSlice(const BlockGeometry& g, uint32_t block, const uint16_t* k, const uint16_t* v,
                    uint8_t* out);

}  // namespace kvpool::client
