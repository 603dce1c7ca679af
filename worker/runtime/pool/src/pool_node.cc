// Prefill and decode roles over the pool (see kvpool/worker/pool_node.h).
#include "kvpool/worker/pool_node.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvpool/common/log.h"
#include "kvpool/common/process.h"
#include "kvpool/common/room_shortage.h"
#include "kvpool/common/status.h"
#include "kvpool/common/status_text.h"
#include "kvpool/worker/staging_recorder.h"

namespace kvpool::worker {

namespace {

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<uint32_t> ToU32(absl::Span<const int> tokens) {
  return std::vector<uint32_t>(tokens.begin(), tokens.end());
}

// Token-major bf16 rows of `layer` ([blocks·P][H][d]) from the recorder's staging blocks.
void LayerRows(const StagingRecorder& rec, uint32_t layer, uint32_t blocks,
               std::vector<uint16_t>* k, std::vector<uint16_t>* v) {
  const BlockGeometry& g = rec.geometry();
  const uint32_t P = g.page_size, d = g.head_dim, H = g.num_kv_heads;
  k->assign(size_t{blocks} * P * H * d, 0);
  v->assign(k->size(), 0);
  for (uint32_t b = 0; b < blocks; ++b) {
    const uint8_t* staging = rec.Staging(static_cast<int>(b));
    for (uint32_t h = 0; h < H; ++h) {
      const auto* kr = reinterpret_cast<const uint16_t*>(staging + g.Bf16ChunkOffset(layer, h));
      const auto* vr = reinterpret_cast<const uint16_t*>(staging + g.Bf16ChunkOffset(layer, h) +
                                                         g.Bf16VOffset());
      for (uint32_t t = 0; t < P; ++t) {
        const size_t dst = (size_t{b} * P + t) * H * d + size_t{h} * d;
        std::copy_n(kr + size_t{t} * d, d, k->data() + dst);
        std::copy_n(vr + size_t{t} * d, d, v->data() + dst);
      }
    }
  }
}

}  // namespace

const char kPoolSkipped[] = "pool skipped after an earlier failure in this run: ";

namespace {
// The number after the first `label` in `text` (digits only); nullopt when absent.
std::optional<uint64_t> NumberAfter(absl::string_view text, absl::string_view label) {
  const size_t at = text.find(label);
  if (at == absl::string_view::npos) return std::nullopt;
  absl::string_view rest = text.substr(at + label.size());
  size_t n = 0;
  while (n < rest.size() && rest[n] >= '0' && rest[n] <= '9') ++n;
  uint64_t v = 0;
  if (n == 0 || !absl::SimpleAtoi(rest.substr(0, n), &v)) return std::nullopt;
  return v;
}
// The number just before `label` in `text` ("573440 bytes are staging"); nullopt when absent.
std::optional<uint64_t> NumberBefore(absl::string_view text, absl::string_view label) {
  const size_t at = text.find(label);
  if (at == absl::string_view::npos) return std::nullopt;
  size_t b = at;
  while (b > 0 && text[b - 1] >= '0' && text[b - 1] <= '9') --b;
  uint64_t v = 0;
  if (b == at || !absl::SimpleAtoi(text.substr(b, at - b), &v)) return std::nullopt;
  return v;
}

// Longest backoff between the tries of a put waiting for room (an outage's is 1 s): below the
// pool's default StoreOptions::room_waiter_life, so that the put keeps its place in line.
constexpr std::chrono::milliseconds kRoomBackoffCap{250};
}  // namespace

bool OverPerPutLimit(const absl::Status& s) {
  return absl::IsInvalidArgument(s) &&
         absl::StrContains(s.message(), "more than the per-put limit");
}

bool RoomHeldByOthers(const absl::Status& s) {
  if (!absl::IsResourceExhausted(s)) return false;
  // The pool's numbers (protocol v1.7: kvpool/common/room_shortage.h); a pool before v1.7 sends
  // them in its message only, read below.
  if (std::optional<RoomShortage> r = GetRoomShortage(s); r.has_value()) {
    const uint64_t held = r->staging_bytes + r->pinned_bytes;
    return held > 0 && r->need_bytes <= r->room_bytes + held;
  }
  const absl::string_view m = s.message();
  // BeginPut's check that the commit can fit (kvstore CheckCommitFitsLocked).
  std::optional<uint64_t> need = NumberAfter(m, "this put's commit: it needs ");
  std::optional<uint64_t> room = NumberAfter(m, "eviction can make at most ");
  std::optional<uint64_t> staging = NumberBefore(m, " bytes are staging of other open puts");
  std::optional<uint64_t> pinned = NumberBefore(m, " bytes are forms of leased or pinned blocks");
  if (!need.has_value()) {
    // The staging allocation itself (kvstore AllocateLocked): room = the free bytes.
    need = NumberAfter(m, "pool full: cannot allocate ");
    room = NumberBefore(m, " bytes free");
    staging = NumberBefore(m, " bytes staging of open puts");
    pinned = NumberBefore(m, " bytes forms of leased or pinned blocks");
  }
  if (!need || !room || !staging || !pinned) return false;
  const uint64_t held = *staging + *pinned;
  return held > 0 && *need <= *room + held;
}

namespace {
// The payload that marks a prompt RunAll did not start (PromptNotRun).
constexpr char kNotRunPayload[] = "type.kvpool/worker-prompt-not-run";
// The payload of a CANCELLED outcome whose message already names the stage the stop found the
// prompt in (RunAll does not add "stopped during its commit" to it).
constexpr char kStageNamedPayload[] = "type.kvpool/worker-stop-stage-named";
// The payload of an outcome RunAll gave a prompt it had committed to a pool that restarted
// later and that it did not put again (PromptLostWithPool).
constexpr char kLostPayload[] = "type.kvpool/worker-prompt-lost-with-pool";
// How often a question the pool did not answer is asked again: RunAll's epoch check at the end
// of a run (UNAVAILABLE) and HeldByPool after an unanswered commit.
constexpr absl::Duration kAskAgainInterval = absl::Milliseconds(100);

// `s` with `suffix` appended to its message, its code and payloads kept (the payloads mark
// outcomes RunAll and the worker tell apart: PromptLostWithPool, PutExpired, ...).
absl::Status WithSuffix(const absl::Status& s, std::string_view suffix) {
  absl::Status out(s.code(),
                   absl::StrCat(s.message(), absl::string_view(suffix.data(), suffix.size())));
  s.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

// A Reopen that failed: a stop (CANCELLED) found the prompt between a failed commit and its
// put open again, not during a commit (newcomer s10b F3: a prompt waiting for a killed pool to
// come back was logged "stopped during its commit").
// CANCELLED "stopped while putting it again (the worker was asked to stop WHEN): nothing of it
// stored" + `rest`, marked as naming its stage (kStageNamedPayload).
absl::Status StopStageNamed(absl::string_view when, absl::string_view rest) {
  absl::Status out = absl::CancelledError(
      absl::StrCat("stopped while putting it again (the worker was asked to stop ", when,
                   "): nothing of it stored", rest));
  out.SetPayload(kStageNamedPayload, absl::Cord("1"));
  return out;
}

absl::Status ReopenStopped(const absl::Status& s) {
  if (!absl::IsCancelled(s)) return s;
  return StopStageNamed("before its put was open again", absl::StrCat(": ", StatusText(s)));
}
}  // namespace

bool PromptNotRun(const absl::Status& status) {
  return absl::IsCancelled(status) && status.GetPayload(kNotRunPayload).has_value();
}

bool PromptLostWithPool(const absl::Status& status) {
  return status.GetPayload(kLostPayload).has_value();
}

absl::StatusOr<Fault> ParseFault(const std::string& name) {
  if (name.empty() || name == "none") {
    return Fault::kNone;
  }
  if (name == "prefill-exit-mid-push") {
    return Fault::kPrefillExitMidPush;
  }
  if (name == "kill-pool-mid-fetch") {
    return Fault::kKillPoolMidFetch;
  }
  if (name == "stop-pool-after-register") {
    return Fault::kStopPoolAfterRegister;
  }
  if (name == "kill-pool-after-first-commit") {
    return Fault::kKillPoolAfterFirstCommit;
  }
  if (name == "commit-answer-lost") {
    return Fault::kCommitAnswerLost;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("fault '", name,
                   "' must be none, prefill-exit-mid-push, kill-pool-mid-fetch, "
                   "stop-pool-after-register, kill-pool-after-first-commit or "
                   "commit-answer-lost"));
}

client::ModelSpec MakeModelSpec(const engine::ModelConfig& config, const MixedCacheOptions& cache,
                                const std::string& model_id, const std::string& revision,
                                std::string rotation_file_bytes) {
  client::ModelSpec spec;
  spec.model_id = model_id;
  spec.revision = revision;
  spec.num_layers = static_cast<uint32_t>(config.n_layers);
  spec.num_kv_heads = static_cast<uint32_t>(config.n_kv_heads);
  spec.head_dim = static_cast<uint32_t>(config.head_dim);
  spec.page_size = static_cast<uint32_t>(cache.page_size);
  spec.sink_tokens = static_cast<uint32_t>(cache.sink_tokens);
  spec.recent_tokens = static_cast<uint32_t>(cache.recent_tokens);
  spec.clip_ratio_k = cache.clip_ratio_k;
  spec.clip_ratio_v = cache.clip_ratio_v;
  spec.history_precision = HistoryPrecisionName(cache.history);
  spec.rotation_file = std::move(rotation_file_bytes);
  return spec;
}

// ---- prefill ---------------------------------------------------------------------------------

PrefillNode::PrefillNode(engine::Engine* engine, client::Client* client,
                         std::shared_ptr<const RotationSet> rotations, NodeOptions options)
    : engine_(engine), client_(client), rotations_(std::move(rotations)), options_(options) {}

absl::StatusOr<PrefillNode::Pending> PrefillNode::ComputeAndWrite(absl::Span<const int> prompt,
                                                                  bool wait_for_room) {
  const engine::ModelConfig& c = engine_->config();
  const int P = options_.cache.page_size;
  // The put holds the blocks a decode worker of the same recipe takes: the full blocks before
  // the last prompt token (PoolPrefixTokens; the decoder computes that token itself). The pool
  // keeps BF16 for a put's last ⌈W/P⌉ blocks, so putting every full block of a prompt of n ≡ 0
  // (mod P) tokens would place that window one block past the decoder's, leaving its first
  // window block INT2-only and the decode a partial hit (newcomer report s8 N8).
  const int prefix = PoolPrefixTokens(static_cast<int>(prompt.size()), P);
  if (prefix < P) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt: ", prompt.size(), " tokens hold no full block before the last token (", P, ")"));
  }
  Pending pending;
  PrefillReport& rep = pending.report;
  rep.prompt_tokens = static_cast<int>(prompt.size());
  pending.tokens = ToU32(prompt.first(static_cast<size_t>(prefix)));
  // Open the put first: staging space is reserved while the prompt is computed.
  KVPOOL_ASSIGN_OR_RETURN(pending.put, BeginPut(pending.tokens, wait_for_room));
  rep.blocks = pending.put->num_blocks();

  // A prefill node attends in BF16 (history precision bf16, the registered S/W).
  MixedCacheOptions o = options_.cache;
  o.history = HistoryPrecision::kBf16;
  KVPOOL_ASSIGN_OR_RETURN(pending.cache,
                          MixedKvCache::Create(c.n_layers, c.attention(), rotations_, o));
  pending.recorder =
      std::make_unique<StagingRecorder>(pending.cache.get(), pending.cache->geometry());
  auto t0 = std::chrono::steady_clock::now();
  KVPOOL_RETURN_IF_ERROR(engine_->Prefill(prompt, 0, *pending.recorder).status());
  rep.compute_seconds = Since(t0);

  pending.writes_started = std::chrono::steady_clock::now();
  // UNAVAILABLE: the put is lost with the pool, or expired (client::PutExpired: this node was
  // paused past the pool's put timeout); Commit fails and puts it again. CANCELLED
  // (NodeOptions::cancel: the node is stopping): RunAll aborts the open put.
  // A write the pool did not answer within the call timeout (client::NoAnswer: a pool stopped
  // for a moment) fails the put too; Commit puts it again.
  if (absl::Status s = WriteLayers(pending); !s.ok() && !absl::IsUnavailable(s) &&
                                             !absl::IsCancelled(s) && !client::PutExpired(s) &&
                                             !client::NoAnswer(s)) {
    return s;
  }
  return pending;
}

absl::Status PrefillNode::WriteLayers(Pending& pending) {
  const int layers = engine_->config().n_layers;
  // Layer by layer: each WriteLayer copies the layer and returns while its transfer proceeds.
  std::vector<uint16_t> k, v;
  for (int l = 0; l < layers; ++l) {
    LayerRows(*pending.recorder, static_cast<uint32_t>(l), pending.report.blocks, &k, &v);
    KVPOOL_RETURN_IF_ERROR(pending.put->WriteLayer(static_cast<uint32_t>(l), k, v));
    if (options_.fault == Fault::kPrefillExitMidPush && l == layers / 2) {
      (void)pending.put->Flush();
      KVPOOL_LOG_WARN("fault prefill-exit-mid-push: killing this prefill node after layer {}", l);
      ::kill(::getpid(), SIGKILL);
    }
  }
  return absl::OkStatus();
}

absl::Status PrefillNode::Reopen(Pending& pending, bool wait_for_room,
                                 std::optional<std::chrono::steady_clock::time_point> room_since) {
  pending.put.reset();
  absl::StatusOr<std::unique_ptr<client::PutSession>> put =
      BeginPut(pending.tokens, wait_for_room, room_since);
  if (!put.ok()) {
    return put.status();
  }
  pending.put = std::move(put).value();
  if (pending.put->num_blocks() != pending.report.blocks) {
    return absl::InternalError(absl::StrCat("prefill: the put again has ",
                                            pending.put->num_blocks(), " blocks, the first one ",
                                            pending.report.blocks));
  }
  // UNAVAILABLE and CANCELLED surface at the Commit, as after ComputeAndWrite.
  if (absl::Status s = WriteLayers(pending);
      !s.ok() && !absl::IsUnavailable(s) && !absl::IsCancelled(s)) {
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<PrefillReport> PrefillNode::Commit(Pending pending, Pending* other_open) {
  absl::StatusOr<client::PutResult> r = pending.put->Commit();
  if (options_.fault == Fault::kCommitAnswerLost && !fault_fired_ && r.ok()) {
    fault_fired_ = true;
    KVPOOL_LOG_WARN("fault commit-answer-lost: taking the answer of a committed put as lost");
    r = absl::DeadlineExceededError(
        "CommitPut: fault commit-answer-lost: the answer was dropped after the pool committed "
        "the put; a pool that was only slow may still have committed it (a Lookup tells)");
  }
  // No shared UCX transport (--ucx-tls): a configuration mismatch, not a pool that went away;
  // putting again fails the same way (it was logged as a lost put: newcomer s10 F8).
  // Puts the recorded K/V again after `what` happened to the put (once per prompt: the report's
  // reput flag); `r` becomes the new put's Commit result.
  std::optional<std::chrono::steady_clock::time_point> reput_start;
  absl::Status first_failure;  // what the first put ended with, when it was put again
  auto put_again = [&](const std::string& what) -> absl::Status {
    KVPOOL_LOG_WARN("prefill: the put of a {}-token prompt {} ({}); putting its recorded K/V again",
                    pending.report.prompt_tokens, what, StatusText(r.status()));
    first_failure = r.status();
    pending.report.reput = true;
    reput_start = std::chrono::steady_clock::now();
    if (absl::Status s = Reopen(pending, /*wait_for_room=*/false, std::nullopt); !s.ok()) {
      return ReputTimedOut(pending) ? ExpiredAgain(s, Since(*reput_start)) : s;
    }
    r = pending.put->Commit();
    return absl::OkStatus();
  };
  if (absl::IsUnavailable(r.status()) && !client::NoSharedUcxTransport(r.status())) {
    // The pool went away while the put was open (killed, restarted: a restarted pool has
    // forgotten it; the failed Commit aborted what was left), or it closed this client's
    // endpoint, which ends every transfer on it (the pool does so when it aborts another put's
    // pull at its deadline: newcomer 17 F2, the log said "lost with the pool" of a pool that never
    // went away). The recorded K/V are still here: put them again, once, through the same outage
    // wait as a new prompt's BeginPut. Nothing of the lost put is visible (two-phase), and blocks
    // a lost answer did commit are found present.
    if (absl::Status s = put_again("failed: the pool went away or closed the connection");
        !s.ok()) {
      return ReopenStopped(s);
    }
  }
  // The pool dropped the put at its put timeout: this node was paused or slow past
  // --put-timeout-ms between BeginPut and Commit (a stop signal, a swapping or overloaded host).
  // The recorded K/V are still here: put them again, once, as after a lost pool (newcomer
  // report 13 F10: the prompt was lost). A second expiry fails the prompt.
  if (client::PutExpired(r.status()) && !pending.report.reput && !Stopping()) {
    // Which timeout it outran, in this node's words: the pool's message names the pool's flag
    // and the client API even when the timeout is this node's --put-timeout-ms (newcomer 19 F4).
    const int64_t asked = options_.put_timeout.count();
    const std::string what = absl::StrCat(
        "expired in the pool after ",
        asked > 0
            ? absl::StrCat("the ", asked, " ms this node asks for (kvpool-worker --put-timeout-ms)")
            : std::string("the pool's put timeout (kvpool-server --put-timeout-ms; "
                          "kvpool-worker --put-timeout-ms asks for another)"),
        ", which counts from its BeginPut, before the prompt is computed, to its commit, after the "
        "next prompt is computed");
    if (absl::Status s = put_again(what); !s.ok()) return ReopenStopped(s);
  }
  // A call of the put the pool did not answer within the call timeout (client::NoAnswer): a pool
  // stopped or swamped for a moment. A WritePut's put is then gone (the pool aborts a pull cut
  // off by its deadline) and a CommitPut's may or may not have committed: unless the pool holds
  // every block (HeldByPool), the recorded K/V are put again, once, as after a lost pool
  // (newcomer 19 F1: a pool stopped for 3 s with --call-timeout-ms 2000 cost the prompt whose
  // commit met the stop and also the next one, whose WritePut, sent during the stop, timed out
  // a second after the pool answered again).
  if (client::NoAnswer(r.status()) && !pending.report.reput && !Stopping() &&
      !HeldByPool(pending)) {
    if (absl::Status s = put_again("got no answer from the pool within --call-timeout-ms");
        !s.ok()) {
      return ReopenStopped(s);
    }
  }
  // A commit refused for room (RESOURCE_EXHAUSTED "can no longer hold this put's commit", or the
  // allocation of a new form): leases, commits or other nodes' puts taken since the BeginPut
  // hold the room the new forms need (BeginPut's check cannot see what arrives later). The
  // failed Commit aborted the put; the recorded K/V are put again, the BeginPut waiting for
  // room as a new prompt's does (RoomHeldByOthers; a put that can no longer fit fails there at
  // once), up to reconnect_wait from this first refusal (newcomer s10b F1: 2 of 15 prompts of
  // three nodes sharing a 1 MiB pool failed here although docs/WORKER.md said all are stored).
  // This node's other open put (`other_open`, the next prompt, written and not committed) may
  // be what holds the room: it is aborted first and put again by the caller (Reopen).
  std::optional<std::chrono::steady_clock::time_point> room_since;
  auto backoff = std::chrono::milliseconds(50);
  if (absl::IsResourceExhausted(r.status()) && room_wait_spent_ && !Stopping()) {
    return RoomWaitSpent(r.status());  // an earlier prompt's room wait ran out: not waited for
  }
  while (absl::IsResourceExhausted(r.status()) && options_.reconnect_wait.count() > 0 &&
         !Stopping()) {
    const auto now = std::chrono::steady_clock::now();
    if (!room_since.has_value()) {
      room_since = now;
      ++room_waits_;
      KVPOOL_LOG_WARN(
          "prefill: the pool refused the commit of a {}-token prompt for room ({}); putting its "
          "recorded K/V again, waiting up to {} ms for other puts or leases to free room "
          "(--call-timeout-ms)",
          pending.report.prompt_tokens, StatusText(r.status()), options_.reconnect_wait.count());
      if (other_open != nullptr && other_open->put != nullptr) {
        if (absl::Status a = other_open->put->Abort(); !a.ok()) {
          KVPOOL_LOG_WARN("prefill: abort of the next prompt's put to make room: {}",
                          StatusText(a));
        }
        other_open->put.reset();  // the caller puts it again (Reopen)
      }
    } else if (now >= *room_since + options_.reconnect_wait) {
      NoteRoomWaitSpent();
      break;  // the wait is spent: the last refusal is the prompt's outcome
    } else {
      // Accepted by BeginPut but refused again at the commit: back off before the next try.
      if (SleepUnlessStopping(std::min(now + backoff, *room_since + options_.reconnect_wait))) {
        break;
      }
      backoff = std::min(backoff * 2, kRoomBackoffCap);
    }
    if (absl::Status s = Reopen(pending, /*wait_for_room=*/true, room_since); !s.ok()) {
      return ReopenStopped(s);
    }
    r = pending.put->Commit();
  }
  // A stop (the loop ends at once when it begins) found the prompt between a commit refused
  // for room and its put again: it is stopped, not failed; the refusal was not final (newcomer
  // 11b F2: logged "E ... RESOURCE_EXHAUSTED" and counted as failed 2.7 s into a 20 s wait).
  if (absl::IsResourceExhausted(r.status()) && options_.reconnect_wait.count() > 0 && Stopping()) {
    return StopStageNamed("while it waited for room after the pool refused its commit",
                          absl::StrCat(" (last refusal: ", StatusText(r.status()), ")"));
  }
  if (r.ok()) room_wait_spent_ = false;  // room came: a later shortage is waited for again
  if (r.ok() && room_since.has_value()) {
    KVPOOL_LOG_INFO(
        "prefill: the put of a {}-token prompt committed after {:.2f} s of waiting "
        "for room",
        pending.report.prompt_tokens, Since(*room_since));
  }
  // The put again expired too: at its Commit (PutExpired), or while it was written (the pool's
  // pull of a put whose timeout ran out fails, and so does its connection: newcomer 18 F4, the
  // prompt's error then lacked why).
  if (reput_start.has_value() && !r.ok() &&
      (client::PutExpired(r.status()) || ReputTimedOut(pending))) {
    return ExpiredAgain(r.status(), Since(*reput_start));
  }
  // The CommitPut's answer did not come within the call timeout: a pool that was only slow (or
  // stopped for a moment) may have committed the put, and a Lookup tells (newcomer 17 F1: 10
  // prompts reported failed, 3 of them committed and served). Every block of the put held: the
  // prompt is stored, whoever wrote the blocks.
  std::string unanswered;
  if (absl::IsDeadlineExceeded(r.status()) && !client::PutExpired(r.status()) && !Stopping() &&
      HeldByPool(pending)) {
    unanswered = StatusText(r.status());
    KVPOOL_LOG_WARN(
        "prefill: the commit of a {}-token prompt was not answered ({}), and the pool holds all "
        "{} of its blocks: stored",
        pending.report.prompt_tokens, unanswered, pending.report.blocks);
  }
  // The put again failed too: say both (17 F2).
  if (!r.ok() && unanswered.empty() && reput_start.has_value()) {
    return WithSuffix(r.status(), absl::StrCat(" (the put of this prompt again, after ",
                                               StatusText(first_failure), ")"));
  }
  if (unanswered.empty()) KVPOOL_RETURN_IF_ERROR(r.status());
  PrefillReport rep = pending.report;
  rep.push_seconds = Since(pending.writes_started);
  rep.blocks_written = r.ok() ? r->blocks_written : 0;
  rep.bytes_written = r.ok() ? r->bytes_written : 0;
  rep.commit_unanswered = unanswered;
  if (absl::StatusOr<client::ModelInfo> info = client_->model(); info.ok()) {
    rep.pool_epoch = info->pool_epoch;
  }
  return rep;
}

bool PrefillNode::HeldByPool(const Pending& pending) {
  // Up to 1 s (the commit may still be running in a slow pool), whatever --call-timeout-ms is:
  // the question is only asked after a commit whose answer did not come.
  const absl::Time until = absl::Now() + absl::Seconds(1);
  for (;;) {
    client::CallOptions call;
    call.deadline = until;
    absl::StatusOr<client::LookupResult> lk = client_->Lookup(pending.tokens, call);
    if (lk.ok() && pending.report.blocks > 0 && lk->num_blocks >= pending.report.blocks) {
      return true;
    }
    if (absl::Now() + kAskAgainInterval >= until || Stopping()) return false;
    absl::SleepFor(kAskAgainInterval);
  }
}

bool PrefillNode::SleepUnlessStopping(std::chrono::steady_clock::time_point wake) const {
  while (!Stopping() && std::chrono::steady_clock::now() < wake) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return Stopping();
}

void PrefillNode::NoteRoomWaitSpent() {
  if (room_wait_spent_) return;
  room_wait_spent_ = true;
  KVPOOL_LOG_WARN(
      "prefill: no room came within the whole {} ms of waiting (--call-timeout-ms); the later "
      "prompts refused for room fail at once, each trying once, until a commit succeeds again",
      options_.reconnect_wait.count());
}

absl::Status PrefillNode::RoomWaitSpent(const absl::Status& s) const {
  return WithSuffix(s, absl::StrCat(" (not waited for: an earlier prompt waited the whole ",
                                    options_.reconnect_wait.count(),
                                    " ms of --call-timeout-ms for room in vain, and no commit has "
                                    "succeeded since)"));
}

bool PrefillNode::ReputTimedOut(const Pending& pending) {
  return pending.put != nullptr && absl::Now() >= pending.put->expires();
}

absl::Status PrefillNode::ExpiredAgain(const absl::Status& s, double reput_seconds) const {
  // The pool's message names the pool's flag and ClientOptions; what a node's operator sets is
  // this node's --put-timeout-ms, or the pool's when it is 0 (newcomer 13b F8: with
  // --put-timeout-ms 1 every prompt failed and nothing said which flag was too short).
  const int64_t asked = options_.put_timeout.count();
  return WithSuffix(
      s, absl::StrCat(" (it expired again when put a second time from the recorded K/V: ",
                      "that put was not committed ", static_cast<int64_t>(reput_seconds * 1000.0),
                      " ms after its BeginPut, longer than the put timeout ",
                      asked > 0 ? absl::StrCat("of ", asked,
                                               " ms that kvpool-worker --put-timeout-ms asks "
                                               "for; raise it, or give 0 for the pool's own")
                                : "of the pool (kvpool-server --put-timeout-ms; or ask for more "
                                  "with kvpool-worker --put-timeout-ms)",
                      ")"));
}

void PrefillNode::NoteOutage(const absl::Status& s) {
  if (outage_start_.has_value()) return;
  outage_start_ = std::chrono::steady_clock::now();
  absl::StatusOr<client::ModelInfo> info = client_->model();
  outage_epoch_ = info.ok() ? info->pool_epoch : 0;
  KVPOOL_LOG_WARN(
      "prefill: the pool is unreachable ({}); the later prompts wait up to {} ms from now for "
      "it to come back (--call-timeout-ms), then each tries once",
      StatusText(s), options_.reconnect_wait.count());
}

absl::StatusOr<std::unique_ptr<client::PutSession>> PrefillNode::BeginPut(
    const std::vector<uint32_t>& tokens, bool wait_for_room,
    std::optional<std::chrono::steady_clock::time_point> room_since) {
  const client::CallOptions call{.cancel = options_.cancel};
  if (Stopping()) {
    // A stop has begun: no new put opens (a BeginPut sent now would open one the stop never
    // aborts when its answer arrives late; newcomer s10b F2).
    return absl::CancelledError("BeginPut: not sent, the worker is stopping");
  }
  absl::StatusOr<std::unique_ptr<client::PutSession>> put = client_->BeginPut(tokens, call);
  auto backoff = std::chrono::milliseconds(50);
  // The room wait of this prompt: from its first refusal (here, or at an earlier commit).
  std::optional<std::chrono::steady_clock::time_point> room_wait_start = room_since;
  bool waited_for_room = false;
  for (;;) {
    const bool outage =
        absl::IsUnavailable(put.status()) && !client::NoSharedUcxTransport(put.status());
    const bool room = wait_for_room && RoomHeldByOthers(put.status());
    if (!outage && !room) {
      break;
    }
    std::chrono::steady_clock::time_point end;
    if (outage) {
      NoteOutage(put.status());
      end = *outage_start_ + options_.reconnect_wait;
    } else {
      // Other nodes' open puts (their staging) or leased blocks hold the room: transient (newcomer
      // report 10 F3: a node that lost that race failed all 20 prompts in 22 ms) — unless an
      // earlier prompt waited the whole reconnect_wait for it in vain (room_wait_spent_).
      if (room_wait_spent_) return RoomWaitSpent(put.status());
      waited_for_room = true;
      if (!room_wait_start.has_value()) {
        room_wait_start = std::chrono::steady_clock::now();
        ++room_waits_;
        KVPOOL_LOG_WARN(
            "prefill: the pool has no room for this put now ({}); waiting up to {} ms for other "
            "puts or leases to free it (--call-timeout-ms)",
            StatusText(put.status()), options_.reconnect_wait.count());
      }
      end = *room_wait_start + options_.reconnect_wait;
    }
    if (std::chrono::steady_clock::now() >= end) {
      if (!outage) NoteRoomWaitSpent();
      return put;  // the wait of this outage is spent: one attempt per prompt from now on
    }
    // The backoff, in slices, so that a stop (NodeOptions::cancel) ends the wait within 20 ms.
    if (SleepUnlessStopping(std::min(std::chrono::steady_clock::now() + backoff, end))) {
      return absl::CancelledError(
          absl::StrCat("BeginPut: cancelled while waiting for ",
                       outage ? "the unreachable pool to come back" : "room in the pool",
                       " (last: ", StatusText(put.status()), ")"));
    }
    // A put waiting for room asks again at least every 250 ms: the pool keeps its place in the
    // line of puts waiting for room only while it asks again within 1 s (kvstore
    // StoreOptions::room_waiter_life).
    backoff = std::min(backoff * 2, outage ? std::chrono::milliseconds(1000) : kRoomBackoffCap);
    put = client_->BeginPut(tokens, call);  // the client re-registers the model first (stale)
  }
  if (put.ok() && waited_for_room) {
    KVPOOL_LOG_INFO("prefill: room for the put after {:.2f} s", Since(*room_wait_start));
  }
  if (put.ok() && !put_timeout_checked_) {
    put_timeout_checked_ = true;
    // The pool caps the asked timeout at the larger of 10 min and its own --put-timeout-ms and
    // grants it silently (newcomer s10 F3): say so once. expires() is BeginPut's start plus
    // the granted timeout, so 1 s of slack covers the call's own time.
    const int64_t granted = absl::ToInt64Milliseconds((*put)->expires() - absl::Now());
    if (options_.put_timeout.count() > 0 && granted + 1000 < options_.put_timeout.count()) {
      KVPOOL_LOG_WARN(
          "prefill: the pool grants each put about {} s, not the {} ms of --put-timeout-ms (a "
          "pool caps a put's timeout at the larger of 10 min and its own --put-timeout-ms)",
          (granted + 500) / 1000, options_.put_timeout.count());
    }
  }
  if (put.ok() && outage_start_.has_value()) {
    ++pool_reconnects_;
    absl::StatusOr<client::ModelInfo> info = client_->model();
    const bool restarted = !info.ok() || info->pool_epoch != outage_epoch_;
    KVPOOL_LOG_INFO("prefill: the pool answers again after {:.2f} s ({})", Since(*outage_start_),
                    restarted ? "a restarted pool: model registered again"
                              : "the same pool, which had stopped answering");
    outage_start_.reset();
  }
  return put;
}

namespace {

// The kill-pool-after-first-commit fault: SIGKILL the pool and wait (up to 5 s) until it is gone
// or a zombie, so the next call cannot reach it.
void KillPoolAndWait(int pid) {
  KVPOOL_LOG_WARN("fault kill-pool-after-first-commit: killing pool pid {}", pid);
  if (!KillProcessAndWait(pid, std::chrono::seconds(5))) {
    KVPOOL_LOG_WARN("fault kill-pool-after-first-commit: pool pid {} still runs after 5 s", pid);
  }
}

}  // namespace

absl::StatusOr<PrefillReport> PrefillNode::Run(absl::Span<const int> prompt) {
  KVPOOL_ASSIGN_OR_RETURN(Pending pending, ComputeAndWrite(prompt, /*wait_for_room=*/true));
  return Commit(std::move(pending));
}

std::vector<absl::StatusOr<PrefillReport>> PrefillNode::RunAll(
    absl::Span<const std::vector<int>> prompts, const RunAllHooks& hooks) {
  std::vector<absl::StatusOr<PrefillReport>> out(prompts.size(),
                                                 absl::InternalError("prompt not run"));
  size_t reported = 0;  // out[0, reported) went to hooks.on_done
  auto report_up_to = [&](size_t end) {
    for (; reported < end; ++reported) {
      if (hooks.on_done) hooks.on_done(reported, out[reported]);
    }
  };
  auto stop = [&] { return hooks.stop && hooks.stop(); };
  // BeginPut refuses once the run is stopping (no put opens after the stop began), also inside
  // a Commit's re-put; cleared when RunAll returns.
  stop_ = hooks.stop;
  struct ClearStop {
    std::function<bool()>* f;
    ~ClearStop() { *f = nullptr; }
  } clear_stop{&stop_};
  // An open put of a stopped run: aborted now, so the pool frees its staging at once instead
  // of at its put timeout.
  // The outcome says whether the pool took the AbortPut: a pool that does not answer (stopped,
  // killed) keeps the put's staging until its put timeout (newcomer s9b #1: "aborted" was said
  // whatever Abort returned).
  auto abort = [&](Pending& p, size_t index) {
    const absl::Status st = p.put->Abort();
    if (!st.ok()) {
      KVPOOL_LOG_WARN("prefill: abort of prompt {}'s put after the stop: {}", index,
                      StatusText(st));
    }
    out[index] = absl::CancelledError(
        st.ok() ? std::string("stopped before its commit (the worker was asked to stop): its put "
                              "was aborted, nothing of it stored")
                : absl::StrCat("stopped before its commit (the worker was asked to stop): nothing "
                               "of it stored, but its AbortPut did not reach the pool (",
                               StatusText(st), "): the pool frees its staging at its put timeout"));
  };
  std::optional<Pending> in_flight;  // destroying an uncommitted session aborts it
  size_t in_flight_index = 0;
  // `next`: the put begun after the one in flight, if any (see the fault below).
  auto commit = [&](absl::StatusOr<Pending>* next) {
    Pending* other = next != nullptr && next->ok() ? &**next : nullptr;
    out[in_flight_index] = Commit(std::move(*in_flight), other);
    in_flight.reset();
    if (other != nullptr && other->put == nullptr) {
      // Commit aborted the next prompt's put to make room for this one: put it again.
      if (absl::Status s = Reopen(*other, /*wait_for_room=*/true, std::nullopt); !s.ok()) {
        *next = ReopenStopped(s);
      }
    }
    // Cancelled by NodeOptions::cancel: the stop came while the CommitPut was unanswered; the
    // client's message says whether the pool may have committed it.
    if (absl::IsCancelled(out[in_flight_index].status()) && stop() &&
        !out[in_flight_index].status().GetPayload(kStageNamedPayload).has_value()) {
      out[in_flight_index] = absl::CancelledError(
          absl::StrCat("stopped during its commit (the worker was asked to stop): ",
                       StatusText(out[in_flight_index].status())));
    }
    if (out[in_flight_index].ok() && options_.fault == Fault::kKillPoolAfterFirstCommit &&
        !fault_fired_ && options_.fault_pool_pid > 0) {
      fault_fired_ = true;
      // The next put's bytes are pulled first, so the pool dies between transfers: over tcp the
      // pool pulls them with software-emulated UCX gets that this process answers, and Debian's
      // UCX 1.13 aborts the process (ucs_fatal "unexpected error: Endpoint timeout" in
      // ucp_get_req_handler) when the pool dies while a reply is being sent — a transport
      // limitation (docs/TRANSPORT.md "UCX 1.13 facts found while building it"), not what this
      // fault tests (a pool lost between a commit and the next put's commit).
      if (next != nullptr && next->ok() && (*next)->put != nullptr) (void)(*next)->put->Flush();
      KillPoolAndWait(options_.fault_pool_pid);
    }
  };
  size_t i = 0;
  bool stopped = false;
  for (; i < prompts.size(); ++i) {
    if (stop()) {
      stopped = true;
      break;
    }
    // With a put of this node's own in flight, a refusal for room is not waited for: that put
    // may be what holds it, and it commits only after this prompt is computed. It is committed
    // first, then this prompt asks again, waiting for room other nodes hold (newcomer report 10
    // F3).
    // Likewise a refusal by the pool's per-put limit: the put in flight may hold this prompt's
    // prefix, whose blocks count as held only once it commits (newcomer 16 F4: a prefix listed
    // first, as the refusal advises, did not help within one run).
    absl::StatusOr<Pending> next = ComputeAndWrite(prompts[i], !in_flight.has_value());
    if (!next.ok() && in_flight.has_value() &&
        (RoomHeldByOthers(next.status()) || OverPerPutLimit(next.status())) && !stop()) {
      commit(nullptr);
      report_up_to(in_flight_index + 1);
      next = ComputeAndWrite(prompts[i], /*wait_for_room=*/true);
    }
    if (stop()) {
      stopped = true;
      if (next.ok()) {
        abort(*next, i);
      } else if (absl::IsCancelled(next.status())) {
        // Its BeginPut was cancelled (NodeOptions::cancel): no put was open, nothing computed.
        out[i] = absl::CancelledError(
            absl::StrCat("stopped before its put was open (the worker was asked to stop): ",
                         StatusText(next.status())));
      } else {
        out[i] = next.status();
      }
      ++i;  // prompt i has its outcome
      break;
    }
    if (in_flight.has_value()) {
      commit(&next);
      report_up_to(in_flight_index + 1);
    }
    if (!next.ok()) {
      out[i] = next.status();
      report_up_to(i + 1);
      continue;
    }
    in_flight.emplace(std::move(next).value());
    in_flight_index = i;
  }
  if (in_flight.has_value()) {
    if (stopped) {
      abort(*in_flight, in_flight_index);
      in_flight.reset();
    } else {
      commit(nullptr);
    }
  }
  for (size_t k = i; k < prompts.size(); ++k) {
    absl::Status not_run = absl::CancelledError("not run (the worker was asked to stop)");
    not_run.SetPayload(kNotRunPayload, absl::Cord("not run"));
    out[k] = not_run;
  }
  report_up_to(prompts.size());
  // The pool's epoch as this run ends: asked of the pool (Stats), so that a restart after the
  // run's last call is seen too; 0 (no epoch is 0) with `unanswered` set when the pool does not
  // answer.
  // While stopping the call is bounded by 1 s (fail-fast: a pool that is gone refuses at once).
  // UNAVAILABLE is asked again every 100 ms for up to 1 s (stopping) or 5 s: a pool that has just
  // restarted is refused for a moment while the channel's reconnect backoff runs (newcomer 16b
  // F3: Stats refused ~95 ms after the new pool said it was ready, and every prompt was reported
  // unconfirmed).
  absl::Status unanswered;
  auto epoch_now = [&]() -> uint64_t {
    const bool stopping = stopped || stop();
    const absl::Time until = absl::Now() + (stopping ? absl::Seconds(1) : absl::Seconds(5));
    for (;;) {
      client::CallOptions call;
      if (stopping) call.deadline = until;
      absl::StatusOr<client::PoolStats> st = client_->Stats(call);
      if (st.ok()) {
        unanswered = absl::OkStatus();
        return st->pool_epoch;
      }
      unanswered = st.status();
      if (!absl::IsUnavailable(st.status()) || absl::Now() + kAskAgainInterval >= until) {
        return 0;
      }
      absl::SleepFor(kAskAgainInterval);
    }
  };
  auto committed = [&](size_t k) { return out[k].ok() && out[k]->pool_epoch != 0; };
  auto any_committed = [&] {
    for (size_t k = 0; k < prompts.size(); ++k) {
      if (committed(k)) return true;
    }
    return false;
  };
  // Prompts committed to a pool that restarted since are gone with it (newcomer 14 F1: the
  // report said every prompt was stored, and the 8 committed before a restart were not there).
  uint64_t epoch = any_committed() ? epoch_now() : 0;
  for (int pass = 0; pass < 2 && epoch != 0 && !stopped && !stop(); ++pass) {
    bool any = false;
    for (size_t k = 0; k < prompts.size() && !stop(); ++k) {
      if (!committed(k) || out[k]->pool_epoch == epoch) continue;
      any = true;
      KVPOOL_LOG_WARN(
          "prefill: prompt {} of the run was committed to the pool before it restarted (epoch "
          "{}, now {}): its blocks went with that pool; computing it and putting it again",
          k, out[k]->pool_epoch, epoch);
      absl::StatusOr<PrefillReport> r = Run(prompts[k]);
      if (r.ok()) r->recomputed_after_restart = true;
      out[k] = std::move(r);
      if (hooks.on_redone) hooks.on_redone(k, out[k]);
    }
    if (!any) break;
    epoch = epoch_now();
  }
  // What the passes left (the run stopped first, or the pool restarted again after the second
  // pass) is not in the pool, and its outcome says so; when the pool does not answer at the
  // end, nothing committed can be confirmed (newcomer 16 F1: a stop during the recompute
  // reported 30 lost prompts as stored, three restarts 20, a pool gone for good 21).
  const bool stopping = stopped || stop();
  // With no answer, the latest epoch this client registered with still tells a prompt committed
  // to an earlier one as lost (newcomer 16b F2: a pool restarted, then gone for good, left the
  // first pool's prompts "unconfirmed" beside the second's).
  uint64_t known = 0;
  if (epoch == 0 && client_ != nullptr && any_committed()) {  // no client: registration stopped
    if (absl::StatusOr<client::ModelInfo> info = client_->model(); info.ok()) {
      known = info->pool_epoch;
    }
  }
  for (size_t k = 0; k < prompts.size(); ++k) {
    if (!committed(k)) continue;
    if (epoch == 0 && (known == 0 || out[k]->pool_epoch == known)) {
      out[k]->pool_unconfirmed =
          absl::StrCat("the pool did not answer at the end of the run (", StatusText(unanswered),
                       "): the prompt is stored only if the pool it was committed to (epoch ",
                       out[k]->pool_epoch, ") is still up");
      if (hooks.on_redone) hooks.on_redone(k, out[k]);
      continue;
    }
    const uint64_t now = epoch != 0 ? epoch : known;
    if (out[k]->pool_epoch == now) continue;
    const std::string what =
        absl::StrCat("committed to the pool before it restarted (epoch ", out[k]->pool_epoch,
                     ", now ", now, "): its blocks went with that pool, and ");
    absl::Status lost = stopping
                            ? absl::CancelledError(absl::StrCat(
                                  what, "the run stopped before putting it again: not in the pool"))
                            : absl::UnavailableError(absl::StrCat(
                                  what,
                                  epoch != 0 ? "the pool restarted again after the run's two "
                                               "passes of putting such prompts again"
                                             : "the restarted pool did not answer at the end of "
                                               "the run",
                                  ": not in the pool"));
    lost.SetPayload(kLostPayload, absl::Cord("1"));
    out[k] = lost;
    if (hooks.on_redone) hooks.on_redone(k, out[k]);
  }
  return out;
}

// ---- decode ----------------------------------------------------------------------------------

DecodeNode::DecodeNode(engine::Engine* engine, client::Client* client,
                       std::shared_ptr<const RotationSet> rotations, NodeOptions options)
    : engine_(engine), client_(client), rotations_(std::move(rotations)), options_(options) {}

absl::StatusOr<DecodeReport> DecodeNode::Run(absl::Span<const int> prompt, int max_new,
                                             const ReferenceRun* reference) {
  const engine::ModelConfig& c = engine_->config();
  const MixedCacheOptions& o = options_.cache;
  const int P = o.page_size;
  const int n = static_cast<int>(prompt.size());
  if (n == 0) {
    return absl::InvalidArgumentError("prompt is empty");
  }
  DecodeReport rep;
  rep.prompt_tokens = n;
  rep.wanted_blocks = PoolPrefixTokens(n, P) / P;
  const BlockGeometry g{static_cast<uint32_t>(c.n_layers), static_cast<uint32_t>(c.n_kv_heads),
                        static_cast<uint32_t>(c.head_dim), static_cast<uint32_t>(P)};
  const bool int2 = o.history == HistoryPrecision::kInt2;
  const int sink_blocks = o.sink_tokens / P;
  const int recent_blocks = (o.recent_tokens + P - 1) / P;

  // Pages the fetch fills (host memory registered with the data plane).
  std::vector<uint8_t> bf16_pages, int2_pages, tail_pages;
  std::vector<BlockForms> forms;
  // Window blocks held in BF16 after an INT2-only gap (a strict prefix of a stored sequence):
  // blocks [gap_end, gap_end + tail_forms.size()), loaded after the gap is recomputed.
  std::vector<BlockForms> tail_forms;
  int gap_end = 0;
  std::string failure;
  // A call that timed out marks the pool as hung: the rest of this node's requests fall back at
  // once instead of each waiting for the deadline. UNAVAILABLE does not: it comes back at once
  // (refused connection, broken pipe after a restart), and the client reconnects on the next call,
  // so a pool restarted mid-run is used again.
  // After NodeOptions::hung_pool_retry the pool is asked again (a stall ends; a restarted pool
  // answers UNAVAILABLE at once and reconnects).
  auto note_down = [&](const absl::Status& st, const std::string& what) {
    if (pool_down_.empty() && absl::IsDeadlineExceeded(st)) {
      pool_down_ = what;
      pool_down_at_ = std::chrono::steady_clock::now();
      const int64_t retry = options_.hung_pool_retry.count();
      KVPOOL_LOG_WARN(
          "decode: the pool did not answer within the deadline ({}); the remaining requests of "
          "this run compute their prefix locally without asking it{}",
          what, retry > 0 ? absl::StrCat(" for ", retry, " ms") : std::string());
    }
  };
  if (!pool_down_.empty() && options_.hung_pool_retry.count() > 0 &&
      std::chrono::steady_clock::now() - pool_down_at_ >= options_.hung_pool_retry) {
    KVPOOL_LOG_WARN("decode: asking the pool again, {} ms after it did not answer ({})",
                    options_.hung_pool_retry.count(), pool_down_);
    pool_down_.clear();
  }
  auto t0 = std::chrono::steady_clock::now();
  if (client_ == nullptr) {
    failure =
        options_.no_pool_reason.empty() ? "pool unreachable at start-up" : options_.no_pool_reason;
  } else if (!pool_down_.empty() && rep.wanted_blocks > 0) {
    failure = absl::StrCat(kPoolSkipped, pool_down_);
  } else if (rep.wanted_blocks > 0) {
    // The tokens of the wanted blocks only: the pool counts a call whose held prefix ends
    // before the request's last full block as a miss (kvpool_lookup_misses_total), so the whole
    // prompt of n = 0 (mod P) tokens made every full hit a miss (newcomer report 10 F4).
    const std::vector<uint32_t> tokens =
        ToU32(prompt.first(static_cast<size_t>(rep.wanted_blocks) * P));
    // Side-effect-free probe first (what a scheduler asks), then the lease.
    // A failed probe or lease that is the pool's doing (UNAVAILABLE, DEADLINE_EXCEEDED, ...)
    // is a fallback with its reason, not a miss; only NOT_FOUND means "nothing stored".
    absl::StatusOr<client::LookupResult> lk = client_->Lookup(tokens);
    if (lk.ok()) {
      rep.lookup_blocks = static_cast<int>(lk->num_blocks);
    } else if (!absl::IsNotFound(lk.status())) {
      failure = absl::StrCat("lookup: ", StatusText(lk.status()));
      note_down(lk.status(), failure);
    }
    absl::StatusOr<client::Lease> lease =
        failure.empty() ? client_->Acquire(tokens, static_cast<uint32_t>(rep.wanted_blocks))
                        : absl::StatusOr<client::Lease>(lk.status());
    if (!failure.empty()) {
      // Reported below with the lookup's status; no lease was taken.
    } else if (absl::IsNotFound(lease.status())) {
      KVPOOL_LOG_DEBUG("acquire: nothing stored ({})", StatusText(lease.status()));
    } else if (!lease.ok()) {
      failure = absl::StrCat("acquire: ", StatusText(lease.status()));
      note_down(lease.status(), failure);
    } else {
      // Cleared at the end of this branch: the lease is released then (or left to expire).
      struct LeaseHeld {
        std::atomic<bool>* flag;
        explicit LeaseHeld(std::atomic<bool>* f) : flag(f) {
          if (flag != nullptr) flag->store(true);
        }
        ~LeaseHeld() {
          if (flag != nullptr) flag->store(false);
        }
        LeaseHeld(const LeaseHeld&) = delete;
        LeaseHeld& operator=(const LeaseHeld&) = delete;
      } lease_held(lease->id != 0 ? options_.lease_held : nullptr);
      const auto& lb = lease->blocks;
      rep.hit_blocks = static_cast<int>(lb.size());
      for (const auto& b : lb) {
        rep.bytes_stored += (b.bf16 ? b.bf16->size : 0) + (b.int2 ? b.int2->size : 0);
      }
      // Longest usable prefix: sink and recent-window blocks need a BF16 form, history blocks
      // the precision's form (FORMAT.md §3), where the window is that of the wanted blocks, not
      // of the held ones: a held block before this prompt's own window is history in its
      // context, whatever it was in the put that stored it (for a prompt sharing all but its
      // last block with a stored one, the shared blocks before the window are INT2-only in the
      // pool; newcomer report 10 F5: the window of the held blocks asked BF16 of them and only
      // the 4 sink blocks were used, 419 of 483 tokens recomputed). The first block without its
      // form ends the prefix; the rest is recomputed, except BF16 window blocks after a gap of
      // INT2-only ones (below).
      const int hist_end = std::max(sink_blocks, rep.wanted_blocks - recent_blocks);
      int use = 0;
      for (; use < static_cast<int>(lb.size()); ++use) {
        const bool hist = use >= sink_blocks && use < hist_end;
        if (!((hist && int2) ? lb[use].int2.has_value() : lb[use].bf16.has_value())) {
          break;
        }
      }
      if (use > 0) {
        bf16_pages.assign(size_t(use) * g.Bf16FormBytes(), 0);
        int2_pages.assign(size_t(use) * g.Int2FormBytes(), 0);
        auto bf16_region = client_->RegisterBuffer(bf16_pages.data(), bf16_pages.size());
        auto int2_region = client_->RegisterBuffer(int2_pages.data(), int2_pages.size());
        if (!bf16_region.ok() || !int2_region.ok()) {
          failure = absl::StrCat(
              "register buffers: ",
              StatusText(bf16_region.ok() ? int2_region.status() : bf16_region.status()));
        } else {
          client::PagePool bf16_pool{*bf16_region, g.Bf16FormBytes()};
          client::PagePool int2_pool{*int2_region, g.Int2FormBytes()};
          client::FetchPlan plan;
          plan.bf16_pool = &bf16_pool;
          plan.int2_pool = &int2_pool;
          for (int i = 0; i < use; ++i) {
            plan.bf16_pages.push_back(i);
            plan.int2_pages.push_back(i);
          }
          plan.max_blocks = static_cast<uint32_t>(use);
          // The window is the wanted blocks' (as above), so the fetch reads the blocks before it
          // as INT2 history.
          plan.sequence_blocks = static_cast<uint32_t>(rep.wanted_blocks);
          client::CallOptions call;  // the client's default timeout (--call-timeout-ms)
          if (options_.fault == Fault::kKillPoolMidFetch && !fault_fired_) {
            fault_fired_ = true;
            client::FetchPlan first = plan;
            first.max_blocks = static_cast<uint32_t>(std::max(1, std::min(sink_blocks, use)));
            uint64_t part_moved = 0;
            first.moved_bytes = &part_moved;
            auto part = client_->Fetch(*lease, first, call);
            rep.bytes_discarded += part_moved;  // fetched again below
            KVPOOL_LOG_WARN("fault kill-pool-mid-fetch: fetched {} block(s), killing pool pid {}",
                            part.ok() ? part->num_blocks : 0, options_.fault_pool_pid);
            if (options_.fault_pool_pid > 0) {
              ::kill(options_.fault_pool_pid, SIGKILL);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
          }
          // Bytes a failed fetch moved (its lease expired after the copy, ...) were discarded.
          uint64_t moved = 0;
          plan.moved_bytes = &moved;
          absl::StatusOr<client::FetchResult> fr = client_->Fetch(*lease, plan, call);
          if (!fr.ok()) {
            rep.bytes_discarded += moved;
            failure = absl::StrCat("fetch: ", StatusText(fr.status()));
            note_down(fr.status(), failure);
          } else if (static_cast<int>(fr->num_blocks) != use) {
            rep.bytes_discarded += fr->bytes;
            failure = absl::StrCat("fetch: ", fr->num_blocks, " of ", use, " blocks verified");
            for (const auto& s : fr->block_status) {
              if (!s.ok()) {
                absl::StrAppend(&failure, " (", StatusText(s), ")");
                break;
              }
            }
          } else {
            rep.bytes_moved = fr->bytes;
            for (int i = 0; i < use; ++i) {
              BlockForms f;
              if (fr->forms[i] == client::Form::kBf16) {
                f.bf16 = bf16_pages.data() + size_t(fr->pages[i]) * g.Bf16FormBytes();
                ++rep.bf16_blocks_fetched;
              } else {
                f.int2 = int2_pages.data() + size_t(fr->pages[i]) * g.Int2FormBytes();
                ++rep.int2_blocks_fetched;
              }
              forms.push_back(f);
            }
          }
        }
      }
      // A strict prefix of a stored sequence: the stored put kept BF16 for its own last window
      // only, so the first blocks of this prompt's window, history there, are INT2-only and end
      // the prefix above; the window blocks after them are held in BF16 (newcomer s10b: 11 of
      // 27 blocks loaded, blocks 13..26 held in BF16 and recomputed). Those are fetched too and
      // loaded once the gap is recomputed (prepare below). The fetch reads a lease from its
      // first block, so it gets a copy of the lease holding just those blocks, none a sink:
      // all of them in its window, hence read in BF16 (the pool checks each read against the
      // lease's forms, by address).
      const int held = std::min(static_cast<int>(lb.size()), rep.wanted_blocks);
      if (failure.empty() && int2 && !forms.empty() && use >= hist_end && use < held) {
        int g0 = use;
        while (g0 < held && !lb[g0].bf16.has_value()) ++g0;
        int t = g0;
        while (t < held && lb[t].bf16.has_value()) ++t;
        if (g0 > use && t > g0) {
          const int count = t - g0;
          tail_pages.assign(size_t(count) * g.Bf16FormBytes(), 0);
          auto region = client_->RegisterBuffer(tail_pages.data(), tail_pages.size());
          absl::StatusOr<client::FetchResult> tr =
              region.ok() ? absl::StatusOr<client::FetchResult>(absl::UnknownError("not fetched"))
                          : absl::StatusOr<client::FetchResult>(region.status());
          client::PagePool tail_pool;
          uint64_t tail_moved = 0;  // bytes the tail fetch moved, also when it failed
          if (region.ok()) {
            tail_pool = client::PagePool{*region, g.Bf16FormBytes()};
            client::Lease tail_lease = *lease;
            tail_lease.blocks.assign(lb.begin() + g0, lb.begin() + t);
            for (client::LeasedBlock& b : tail_lease.blocks) b.sink = false;
            client::FetchPlan plan;
            plan.bf16_pool = &tail_pool;
            for (int i = 0; i < count; ++i) plan.bf16_pages.push_back(i);
            plan.moved_bytes = &tail_moved;
            tr = client_->Fetch(tail_lease, plan, client::CallOptions{});
          }
          if (tr.ok() && static_cast<int>(tr->num_blocks) == count) {
            rep.bytes_moved += tr->bytes;
            rep.bf16_blocks_fetched += count;
            gap_end = g0;
            for (int i = 0; i < count; ++i) {
              BlockForms f;
              f.bf16 = tail_pages.data() + size_t(tr->pages[i]) * g.Bf16FormBytes();
              tail_forms.push_back(f);
            }
          } else {
            // The prefix stands; the window is recomputed as without the tail.
            rep.bytes_discarded += tail_moved;
            KVPOOL_LOG_WARN(
                "decode: the {} BF16 window block(s) after the gap were not fetched "
                "({}); computing them locally",
                count,
                tr.ok() ? absl::StrCat(tr->num_blocks, " of ", count, " verified")
                        : StatusText(tr.status()));
            note_down(tr.status(), absl::StrCat("fetch: ", StatusText(tr.status())));
          }
        }
      }
      if (lease->id != 0 && !pool_down_.empty()) {
        // The pool just timed out: a Release would wait another deadline; the lease expires.
        KVPOOL_LOG_DEBUG("lease {} left to expire: the pool is not answering", lease->id);
      } else if (lease->id != 0) {
        if (absl::Status s = client_->Release(*lease); !s.ok()) {
          if (absl::IsNotFound(s) && absl::Now() >= lease->expires) {
            // Expected once the lease ran out (the fetch's own line says so): not a second
            // warning per prompt (newcomer 20 F4).
            KVPOOL_LOG_DEBUG("release of lease {}: it had expired ({})", lease->id, StatusText(s));
          } else {
            KVPOOL_LOG_WARN("release of lease {} failed: {}", lease->id, StatusText(s));
          }
          note_down(s, absl::StrCat("release: ", StatusText(s)));
          if (failure.empty() && absl::IsNotFound(s)) {
            failure = "lease expired before release (fetched bytes discarded)";
          }
        }
      }
    }
  }
  if (!failure.empty()) {
    forms.clear();
  }
  if (forms.empty()) tail_forms.clear();
  rep.fetch_seconds = Since(t0);

  // Prepares a cache: the fetched blocks + the rest of the prompt computed locally, or (on any
  // pool failure) the whole prompt computed as a single process would.
  auto prepare = [&](std::vector<float>* logits) -> absl::StatusOr<std::unique_ptr<MixedKvCache>> {
    if (!forms.empty()) {
      KVPOOL_ASSIGN_OR_RETURN(auto cache,
                              MixedKvCache::Create(c.n_layers, c.attention(), rotations_, o));
      // Blocks before the wanted prefix's window came as history (INT2) although some may lie
      // in the window of the loaded length (a partial hit): history of the planned length.
      absl::Status s = cache->LoadBlocks(forms, rep.wanted_blocks * P);
      int start = static_cast<int>(forms.size()) * P;
      if (s.ok() && !tail_forms.empty()) {
        // The gap (window blocks the pool holds INT2-only) is computed, then the BF16 window
        // blocks after it are appended: the cache holds whole blocks at both points.
        const int gap_stop = gap_end * P;
        KVPOOL_RETURN_IF_ERROR(
            engine_->Prefill(prompt.subspan(start, gap_stop - start), start, *cache).status());
        s = cache->LoadBlocks(tail_forms, rep.wanted_blocks * P);
        start = (gap_end + static_cast<int>(tail_forms.size())) * P;
      }
      if (s.ok()) {
        KVPOOL_ASSIGN_OR_RETURN(absl::Span<const float> l,
                                engine_->Prefill(prompt.subspan(start), start, *cache));
        logits->assign(l.begin(), l.end());
        return cache;
      }
      failure = absl::StrCat("load blocks: ", StatusText(s));
      forms.clear();
      tail_forms.clear();
    }
    return PrefillPd(*engine_, rotations_, o, prompt, logits);
  };

  t0 = std::chrono::steady_clock::now();
  std::vector<float> logits;
  KVPOOL_ASSIGN_OR_RETURN(auto cache, prepare(&logits));
  if (!failure.empty()) {
    rep.fallback = true;
    rep.fallback_reason = failure;
    rep.loaded_blocks = 0;
    rep.bytes_discarded += rep.bytes_moved;  // fetched, then not used (e.g. lease expired)
    rep.bytes_moved = 0;
    rep.bf16_blocks_fetched = rep.int2_blocks_fetched = 0;
    if (client_ == nullptr || absl::StartsWith(failure, kPoolSkipped)) {
      // No pool since start-up, or it stopped answering earlier in the run: why was logged
      // once (above, or by the caller; docs/WORKER.md); every request would repeat it.
      KVPOOL_LOG_DEBUG("decode: {}; computed the {}-token prefix locally", failure, n);
    } else {
      KVPOOL_LOG_WARN("decode: pool path failed ({}); computed the {}-token prefix locally",
                      failure, n);
    }
  } else {
    rep.loaded_blocks = static_cast<int>(forms.size() + tail_forms.size());
    rep.gap_blocks = tail_forms.empty() ? 0 : gap_end - static_cast<int>(forms.size());
  }
  rep.recomputed_tokens = n - rep.loaded_blocks * P;
  rep.bf16_bytes_equivalent = uint64_t(rep.loaded_blocks) * g.Bf16FormBytes();
  KVPOOL_ASSIGN_OR_RETURN(rep.tokens, GreedyFrom(*engine_, *cache, logits, n, max_new));
  if (reference != nullptr) {
    std::vector<float> logits2;
    KVPOOL_ASSIGN_OR_RETURN(auto cache2, prepare(&logits2));
    KVPOOL_ASSIGN_OR_RETURN(rep.teacher_forced,
                            TeacherForceFrom(*engine_, *cache2, std::move(logits2), n, *reference));
    rep.has_teacher_forced = true;
  }
  rep.compute_seconds = Since(t0);
  return rep;
}

}  // namespace kvpool::worker
