// kvpool/worker/pool_node.h — the prefill and decode roles of kvpool-worker on top of the pool
// client (kvpool/client/client.h) and the mixed-precision cache (mixed_kv_cache.h).
//
// Prefill (PrefillNode::Run): opens a two-phase put for the full blocks before the prompt's last
// token (PoolPrefixTokens: the blocks a decoder of the same recipe takes, so the BF16 tail the
// pool keeps is that decoder's recent window, also when n is a multiple of P), computes the
// prompt with BF16 attention (MixedKvCache, history bf16, the registered S/W), records the
// un-rotated bf16 K/V (StagingRecorder), writes them layer by layer (PutSession::WriteLayer;
// each layer's transfer proceeds while the next is packed) and commits. Nothing is visible
// before the commit; a prefill killed mid-push leaves nothing behind. A pool found unreachable
// (UNAVAILABLE) fails no prompt that it comes back for: each later prompt's BeginPut waits for
// the pool to come back (re-registering the model), up to NodeOptions::reconnect_wait per outage,
// and a put open when it went away is put again from the recorded K/V (PrefillNode::RunAll).
//
// Decode (DecodeNode::Run): leases the longest held prefix (at most the full blocks before the
// last prompt token), keeps the longest part of it whose sink and recent window — the window of
// those wanted blocks, so a held block before it is history even if it is among the last held
// ones — have BF16 forms and history the registered precision's, fetches them in those forms
// into registered page pools, loads them into a MixedKvCache (LoadBlocks with the wanted
// blocks' length as planned length), releases the lease, recomputes the
// missing tokens and generates greedily. When that part ends at window blocks the pool holds
// INT2-only (a strict prefix of a stored sequence, whose window was history there), the window
// blocks held in BF16 after them are fetched too: the gap is recomputed and they are loaded
// after it (DecodeReport::gap_blocks). When the pool is unreachable or a fetch fails or is
// incomplete, it computes the prefix itself exactly as a single process would (eval.h
// PrefillPd), so the answer is the same; the report and the log say so. After a pool call that
// timed out (DEADLINE_EXCEEDED), the node stops asking the pool for its remaining requests
// (they fall back at once; logged once; fallback_reason starts with kPoolSkipped); after an
// UNAVAILABLE it asks again with the next request (the client reconnects).
//
// Thread-safety: one node per thread (the Engine is single-threaded).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/client/client.h"
#include "kvpool/engine/engine.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/worker/eval.h"
#include "kvpool/worker/mixed_kv_cache.h"
#include "kvpool/worker/staging_recorder.h"

namespace kvpool::worker {

// Prefix of DecodeReport::fallback_reason for a request that did not ask the pool because an
// earlier request of the same DecodeNode found it not answering (DEADLINE_EXCEEDED); the
// earlier failure follows, e.g. "pool skipped after an earlier failure in this
// run: lookup: DEADLINE_EXCEEDED: ...".
extern const char kPoolSkipped[];

// Test hooks (flag --fault of kvpool-worker).
enum class Fault {
  kNone,
  kPrefillExitMidPush,  // prefill: SIGKILL itself after half of the layers were sent
  kKillPoolMidFetch,    // decode: fetch the sink blocks, SIGKILL the pool (pid), fetch the rest
  // decode: SIGSTOP the pool (pid) once the model is registered, so every later call times out
  // (a hung pool; kvpool-worker sends it, the test resumes the pool with SIGCONT).
  kStopPoolAfterRegister,
  // prefill: SIGKILL the pool (pid) right after the first prompt committed (the next prompt's put
  // is open), and wait until it is dead; the test restarts the pool.
  kKillPoolAfterFirstCommit,
  // prefill: the answer to the first CommitPut is taken as lost (DEADLINE_EXCEEDED, as when a
  // slow pool answers after the call timeout) although the pool committed the put; the node
  // must find the prompt stored by a Lookup (newcomer 17 F1). No pool pid needed.
  kCommitAnswerLost,
};
absl::StatusOr<Fault> ParseFault(const std::string& name);

struct NodeOptions {
  MixedCacheOptions cache;  // page size, S, W, history precision, clip ratios, capacity
  int fault_pool_pid = 0;   // for kKillPoolMidFetch, kStopPoolAfterRegister and
                            // kKillPoolAfterFirstCommit
  Fault fault = Fault::kNone;
  // Prefill: how long the node waits, per outage, for a pool that answers UNAVAILABLE (refused,
  // restarted, reconnecting) to come back before a prompt's BeginPut fails (kvpool-worker sets
  // --call-timeout-ms). Counted from the outage's first UNAVAILABLE, across prompts; once it has
  // passed, each later prompt tries once (so a pool that stays down costs one wait per run, and
  // one restarted later still gets the later prompts). Zero: no wait, every prompt tries once.
  std::chrono::milliseconds reconnect_wait{0};
  // Decode: how long after a pool call timed out (DEADLINE_EXCEEDED: a hung pool) the node asks
  // the pool again; until then every request falls back at once. A pool that stays hung costs
  // one deadline per interval; one that recovers is used again (newcomer report 13: one 2 s stall
  // disabled the pool for the rest of a 60-prompt run). kvpool-worker sets 3 x --call-timeout-ms.
  // Zero: never again in this run.
  std::chrono::milliseconds hung_pool_retry{0};
  // Why a DecodeNode built with a null client has no pool (reported as fallback_reason), e.g.
  // "pool unreachable at start-up: UNAVAILABLE: …" or "pool refused the registration:
  // FAILED_PRECONDITION: …". Empty: "pool unreachable at start-up". The node does not log it
  // per request (debug level only): the caller logs it once.
  std::string no_pool_reason;
  // Prefill: cancelled when the node is to stop (kvpool-worker cancels it shortly after
  // SIGTERM/SIGINT: docs/WORKER.md "Stopping a worker"). Passed to every BeginPut, so it cancels
  // a BeginPut and every later call of its session except the AbortPut (a WritePut pull, the
  // CommitPut: Commit then returns CANCELLED at once); the wait for an unreachable pool ends at
  // it too. Null: nothing is cancelled. Decode does not use it.
  std::shared_ptr<client::CancelToken> cancel;
  // Prefill: the put timeout asked of the pool (kvpool-worker --put-timeout-ms; 0 = the pool's
  // default). The pool caps it; the node warns once when the first put gets less.
  std::chrono::milliseconds put_timeout{0};
  // Decode: when set, true while the request under way holds a lease (from its Acquire to its
  // Release, or until it leaves the lease to expire), false otherwise; read by another thread
  // (kvpool-worker's second-signal line says whether a lease is left to expire). Not owned; must
  // outlive the node. Null: not reported.
  std::atomic<bool>* lease_held = nullptr;
};

// Whether `status`, an outcome of PrefillNode::RunAll, is that of a prompt the node did not
// start because RunAllHooks::stop answered true first (CANCELLED "not run ...", marked with a
// status payload; a prompt stopped later, e.g. with its put open, is CANCELLED without it).
bool PromptNotRun(const absl::Status& status);

// Whether `status`, an outcome of PrefillNode::RunAll given through RunAllHooks::on_redone, is
// that of a prompt committed to a pool that restarted later and not put again (CANCELLED when
// the run was stopping, else UNAVAILABLE; the message names both epochs).
bool PromptLostWithPool(const absl::Status& status);

// The ModelSpec a worker registers: geometry from the engine, recipe from `cache`,
// rotation file bytes, identity (model_id, revision).
client::ModelSpec MakeModelSpec(const engine::ModelConfig& config, const MixedCacheOptions& cache,
                                const std::string& model_id, const std::string& revision,
                                std::string rotation_file_bytes);

struct PrefillReport {
  int prompt_tokens = 0;
  uint32_t blocks = 0;          // full blocks of the put
  uint32_t blocks_written = 0;  // blocks sent (the rest already existed in the pool)
  uint64_t bytes_written = 0;   // staging bytes sent
  double compute_seconds = 0;
  double push_seconds = 0;  // from the first layer write to the commit's return (when
                            // pipelined, this overlaps the next prompt's computation)
  // The put was open on a pool that went away (UNAVAILABLE: killed, restarted) and was put
  // again from the recorded K/V, without computing the prompt again.
  bool reput = false;
  // The epoch of the pool the commit reached (ModelInfo::pool_epoch after it).
  uint64_t pool_epoch = 0;
  // The prompt had been committed to a pool that restarted later in the run (its blocks went
  // with it); it was computed and put again at the end of RunAll (RunAllHooks::on_redone).
  bool recomputed_after_restart = false;
  // Non-empty: why the pool's holding this prompt could not be confirmed at the end of RunAll
  // (the pool did not answer then; the message says so and names the epoch it was committed
  // to). Set only by RunAll, given through RunAllHooks::on_redone.
  std::string pool_unconfirmed;
  // Non-empty: the CommitPut's answer did not come (this status text: DEADLINE_EXCEEDED, the
  // call timeout), and a Lookup right after found every block of the put in the pool, so the
  // prompt is stored (blocks_written and bytes_written are then 0: unknown). A slow pool may have
  // committed it, or another node stored the same blocks (newcomer 17 F1: such prompts were
  // reported failed and served).
  std::string commit_unanswered;
};

class PrefillNode {
 public:
  // `engine`, `client` not owned (must outlive the node); `client` already registered.
  PrefillNode(engine::Engine* engine, client::Client* client,
              std::shared_ptr<const RotationSet> rotations, NodeOptions options);
  // Errors: the engine's, the client's (UNAVAILABLE, RESOURCE_EXHAUSTED, ...); INVALID_ARGUMENT
  // for a prompt with no full block before its last token (n <= P). An UNAVAILABLE BeginPut is
  // retried while NodeOptions::reconnect_wait allows (see there); the prompt is computed only once
  // its put is open. A put that fails UNAVAILABLE after that (in WriteLayer or Commit: the pool
  // went away with it) is opened again, with the same wait, and its recorded layers written again,
  // once; the prompt is not computed again.
  absl::StatusOr<PrefillReport> Run(absl::Span<const int> prompt);

  // Serves several prompts pipelined: while the layers of prompt i are in flight to the pool,
  // prompt i+1 is computed; prompt i commits after that (each put stays two-phase: nothing of
  // it is visible before its own commit). One outcome per prompt, in order: its report, or its
  // error as Run's (a failed prompt's put is aborted; the other prompts still run and commit).
  // When the pool goes away mid-run, a prompt whose put was open (a restarted pool has forgotten
  // it) is put again from its recorded K/V once the pool answers (PrefillReport::reput; at most
  // once per prompt), and each later prompt waits for it as Run does, so a pool restarted within
  // reconnect_wait receives all of them.
  //
  // `hooks` (both optional): on_done(i, outcome) is called as soon as prompt i's outcome is
  // known, in prompt order, on the calling thread (a prompt commits while the next one is
  // computed, so prompt i is reported once prompt i+1 is written, the last one at the end).
  // stop() is asked before each prompt is computed and after it is written; once it answers
  // true no further prompt is computed, the puts still open (the prompt just written and the
  // one in flight) are aborted (PutSession::Abort: the pool frees their staging at once) and
  // their outcome is CANCELLED "stopped before its commit ..." (saying whether the pool took
  // the AbortPut; one that does not answer keeps the staging until its put timeout), and every
  // prompt not started is CANCELLED "not run ..." (PromptNotRun). No put is opened once stop()
  // answered true (BeginPut answers CANCELLED without asking the pool). A prompt whose BeginPut
  // or CommitPut NodeOptions::cancel cancelled (or that the stop kept from opening its put) is
  // CANCELLED "stopped before its put was open ..." or "stopped during its commit ..." (the
  // latter says that the pool may have committed it); one stopped between a failed commit (pool
  // lost, or refused for room) and its put open again, "stopped while putting it again ...".
  // A commit refused for room is put again from the recorded K/V (Commit); the next prompt's
  // put, aborted to make that room, is then put again too. A BeginPut refused for room held by
  // others (RoomHeldByOthers) or by the pool's per-put limit (OverPerPutLimit) while this node's
  // own put is in flight commits that put first and asks once more (the put in flight may hold
  // the room, or the prefix whose blocks then count as held).
  // stop() must be cheap and callable from this thread (e.g. reading a flag a signal handler
  // sets).
  //
  // A pool that restarted after some prompts committed has lost them (a restarted pool starts
  // empty). Once every prompt has its outcome, each prompt committed to an earlier epoch than
  // the pool's latest (ModelInfo::pool_epoch) is computed and put again, as Run does (at most
  // two such passes, for a pool restarted again meanwhile), logged, with
  // PrefillReport::recomputed_after_restart set; on_redone(i, outcome) gives its new outcome
  // (on_done had given the first). The pool's epoch is asked of the pool itself (Stats, bounded
  // by 1 s once stop() answered true), so a restart after the run's last call is seen too. A
  // prompt still committed to an earlier epoch after that (the run stopped before the passes,
  // or the pool restarted during both) gets a PromptLostWithPool outcome through on_redone;
  // when the pool does not answer, every committed prompt gets PrefillReport::pool_unconfirmed
  // through on_redone (newcomer 16 F1).
  struct RunAllHooks {
    std::function<void(size_t, const absl::StatusOr<PrefillReport>&)> on_done;
    std::function<bool()> stop;
    std::function<void(size_t, const absl::StatusOr<PrefillReport>&)> on_redone;
  };
  std::vector<absl::StatusOr<PrefillReport>> RunAll(absl::Span<const std::vector<int>> prompts,
                                                    const RunAllHooks& hooks = {});

  // Outages after which a BeginPut reached the pool again (the client re-registered the model).
  int pool_reconnects() const { return pool_reconnects_; }
  // Prompts whose BeginPut waited for room held by other puts or leases (RoomHeldByOthers), or
  // whose commit was refused for room and put again (Commit).
  int room_waits() const { return room_waits_; }

 private:
  // A put whose layers are written (transfers possibly still in flight), not yet committed.
  // It keeps the prompt's recorded K/V until the commit, so a put lost with the pool can be
  // written again.
  struct Pending {
    std::unique_ptr<client::PutSession> put;
    PrefillReport report;
    std::chrono::steady_clock::time_point writes_started;
    std::vector<uint32_t> tokens;
    std::unique_ptr<MixedKvCache> cache;        // the BF16 attention the prompt was computed with
    std::unique_ptr<StagingRecorder> recorder;  // the un-rotated bf16 K/V (over `cache`)
  };
  // `wait_for_room`: see BeginPut.
  absl::StatusOr<Pending> ComputeAndWrite(absl::Span<const int> prompt, bool wait_for_room);
  // Writes every layer of pending.recorder into pending.put (in order).
  absl::Status WriteLayers(Pending& pending);
  // Commits; a Commit that fails UNAVAILABLE puts the recorded K/V again once (BeginPut with the
  // outage wait, WriteLayers, Commit). A Commit refused RESOURCE_EXHAUSTED (no room for the new
  // forms now) puts them again, the BeginPut waiting for room (RoomHeldByOthers), until one
  // commits or reconnect_wait from the first refusal has passed (50 ms backoff doubling to
  // 250 ms between refused commits; not at all while room_wait_spent_); `other_open`, this node's
  // other put still open (or null), is aborted at the first such refusal, as it may hold the room,
  // and left with a null `put`: the caller puts it again (Reopen). A stop (NodeOptions::cancel)
  // during such a re-put returns CANCELLED "stopped while putting it again ..." (StopStageNamed).
  absl::StatusOr<PrefillReport> Commit(Pending pending, Pending* other_open = nullptr);
  // Opens pending.put again (BeginPut with `wait_for_room` and `room_since`) and writes its
  // recorded layers; UNAVAILABLE and CANCELLED of the writes are left to the Commit.
  absl::Status Reopen(Pending& pending, bool wait_for_room,
                      std::optional<std::chrono::steady_clock::time_point> room_since);
  // client_->BeginPut, retried on UNAVAILABLE within the outage's reconnect_wait (50 ms backoff
  // doubling to 1 s); the last status when the wait is over. With `wait_for_room`, a
  // RESOURCE_EXHAUSTED that other open puts' staging or leased blocks cause (RoomHeldByOthers)
  // is retried (the backoff doubling to 250 ms only, so that the pool keeps the put's place in
  // its line of puts waiting for room, kvstore StoreOptions::room_waiter_life) for up to
  // reconnect_wait from this prompt's first refusal
  // (`room_since` when given: a refusal at an earlier commit of the same prompt), or not at all
  // once an earlier prompt's room wait ran out with no commit since (room_wait_spent_). CANCELLED,
  // without asking the pool, once the node is stopping (Stopping()).
  absl::StatusOr<std::unique_ptr<client::PutSession>> BeginPut(
      const std::vector<uint32_t>& tokens, bool wait_for_room = false,
      std::optional<std::chrono::steady_clock::time_point> room_since = std::nullopt);
  // NodeOptions::cancel was cancelled, or RunAll's stop hook answers true.
  bool Stopping() const {
    return (options_.cancel != nullptr && options_.cancel->cancelled()) || (stop_ && stop_());
  }
  // Sleeps in 20 ms slices until `wake` or until the node is stopping (a stop ends a backoff
  // within 20 ms); returns Stopping().
  bool SleepUnlessStopping(std::chrono::steady_clock::time_point wake) const;
  // Whether the pool holds every block of `pending`'s put (Lookup, asked again every 100 ms for
  // up to 1 s): after a CommitPut whose answer did not come. False on any error.
  bool HeldByPool(const Pending& pending);
  // An UNAVAILABLE BeginPut `s` starts an outage when none is open (logged once).
  void NoteOutage(const absl::Status& s);

  engine::Engine* engine_;
  client::Client* client_;
  std::shared_ptr<const RotationSet> rotations_;
  NodeOptions options_;
  bool fault_fired_ = false;
  std::function<bool()> stop_;        // RunAllHooks::stop while RunAll runs
  bool put_timeout_checked_ = false;  // the first put's granted timeout was compared
  // When the current outage began (the first UNAVAILABLE BeginPut since one last reached the
  // pool); unset while the pool answers.
  std::optional<std::chrono::steady_clock::time_point> outage_start_;
  uint64_t outage_epoch_ = 0;  // the pool's epoch when the outage began (restart or hang?)
  int pool_reconnects_ = 0;
  int room_waits_ = 0;
  // Set when a prompt waited the whole reconnect_wait for room (its BeginPut's or its commit's
  // re-put wait) without getting it: a shortage that does not pass. Until a commit succeeds
  // again, a later prompt refused for room does not wait: it fails at once with the refusal,
  // its message saying why (RoomWaitSpent), so such a shortage costs the run one reconnect_wait,
  // not one per prompt (newcomer 11b F8). Each prompt still tries once.
  bool room_wait_spent_ = false;
  // The refusal `s` of a prompt not waited for (room_wait_spent_): same code and payloads.
  absl::Status RoomWaitSpent(const absl::Status& s) const;
  // `s` (a put that expired in the pool, client::PutExpired) for a prompt whose second put,
  // from the recorded K/V, expired too after `reput_seconds`: the message adds which timeout
  // was too short for it (this node's --put-timeout-ms, or the pool's when that is 0) and by
  // how much; the payloads are kept.
  absl::Status ExpiredAgain(const absl::Status& s, double reput_seconds) const;
  // Whether pending's put (the put again) is past its granted timeout (PutSession::expires()):
  // what failed it then is its expiry, whatever status the write or commit returned.
  static bool ReputTimedOut(const Pending& pending);
  // Marks the shortage as one that does not pass (logged once per episode).
  void NoteRoomWaitSpent();
};

// True when `s` is the pool's BeginPut refusal for room (RESOURCE_EXHAUSTED "num_blocks: the pool
// cannot hold this put's commit: it needs N bytes at once ... eviction can make at most R of the
// pool's C bytes free (S bytes are staging of other open puts, L bytes are forms of leased or
// pinned blocks)", or the allocation's "num_blocks: pool full: cannot allocate N bytes (... S
// bytes staging of open puts, L bytes forms of leased or pinned blocks ...)") and the put would
// fit once that staging and those leases are gone (N <= R + S + L, S + L > 0): pressure of other
// puts and readers, which passes, rather than a put too large for the pool. The numbers come
// from the status's RoomShortage payload (kvpool/common/room_shortage.h, protocol v1.7), or
// from the message text of a pool before v1.7. Pure.
bool RoomHeldByOthers(const absl::Status& s);

// Whether `s` is a BeginPut refused by the pool's per-put limit (INVALID_ARGUMENT "num_blocks:
// the put writes N blocks …, more than the per-put limit M (kvpool-server --max-put-blocks)").
// Pure.
bool OverPerPutLimit(const absl::Status& s);

struct DecodeReport {
  std::vector<int> tokens;  // greedy continuation
  int prompt_tokens = 0;
  int wanted_blocks = 0;   // full blocks before the last prompt token
  int lookup_blocks = -1;  // leading blocks Lookup reported (-1: not run or failed)
  int hit_blocks = 0;      // blocks the pool held (leased)
  int loaded_blocks = 0;   // blocks fetched and loaded
  // Blocks recomputed between loaded ones: the first blocks of the window that the pool holds
  // INT2-only (a strict prefix of a stored sequence), before the BF16 window blocks it holds.
  int gap_blocks = 0;
  int recomputed_tokens = 0;  // prompt tokens computed locally
  uint64_t bytes_moved = 0;   // fetched bytes (data plane) of the blocks loaded
  // Bytes fetched over the data plane but not loaded: a fetch that failed part-way or was
  // incomplete (the request fell back), or fetched again (newcomer s10 F7: they were counted
  // nowhere, so a fallback after 4 fetched blocks reported 0 bytes).
  uint64_t bytes_discarded = 0;
  uint64_t bf16_bytes_equivalent = 0;  // bytes the loaded blocks take in BF16
  uint64_t bytes_stored = 0;           // bytes of every form the pool holds for the leased blocks
  uint64_t bf16_blocks_fetched = 0, int2_blocks_fetched = 0;
  bool fallback = false;  // computed the prefix locally because the pool path failed
  std::string fallback_reason;
  double fetch_seconds = 0;
  double compute_seconds = 0;  // recompute + generation
  bool has_teacher_forced = false;
  TeacherForcedResult teacher_forced;  // vs the reference, when one was given
};

class DecodeNode {
 public:
  // `client` may be null (pool unreachable at start-up: every request falls back).
  DecodeNode(engine::Engine* engine, client::Client* client,
             std::shared_ptr<const RotationSet> rotations, NodeOptions options);
  // Serves `prompt`: max_new greedy tokens. With `reference` non-null also teacher-forces a
  // second cache loaded from the same fetched pages. Errors: only the engine's (pool failures
  // fall back and are reported in the DecodeReport).
  absl::StatusOr<DecodeReport> Run(absl::Span<const int> prompt, int max_new,
                                   const ReferenceRun* reference);

 private:
  engine::Engine* engine_;
  client::Client* client_;
  std::shared_ptr<const RotationSet> rotations_;
  NodeOptions options_;
  bool fault_fired_ = false;
  // Set by the first pool call (Lookup, Acquire, Fetch, Release) that failed with
  // DEADLINE_EXCEEDED (not UNAVAILABLE: docs/WORKER.md), to that call's failure text: later
  // requests do not ask the pool (a hung pool would cost each of them the full deadline) and report
  // kPoolSkipped + this text as their fallback_reason. Cleared NodeOptions::hung_pool_retry after
  // pool_down_at_.
  std::string pool_down_;
  std::chrono::steady_clock::time_point pool_down_at_;
};

}  // namespace kvpool::worker
