// kvpool/kvstore/store.h — the pool's block store: registrations, two-phase puts, the block
// index, leases, eviction. No gRPC and no UCX here (service.cc maps the proto onto this API; the
// memory comes in as a PoolMemory), so every path is unit-testable with a FakeClock and heap
// memory.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto store, BlockStore::Create(options, memory, clock));
//   KVPOOL_ASSIGN_OR_RETURN(ModelInfo m, store->RegisterModel(spec, rotation_bytes));
//   KVPOOL_ASSIGN_OR_RETURN(PutPlan plan, store->BeginPut(m.namespace_id, tokens, n, {}));
//   ... peer writes un-rotated BF16 forms at plan.blocks[i].staging_offset ...
//   KVPOOL_ASSIGN_OR_RETURN(CommitResult c, store->CommitPut(m.namespace_id, plan.put_id, sums));
//
// Semantics (FORMAT.md §3, §5, §6; docs/PROTOCOL.md):
//  * Forms per block: sink blocks (index < S/P) hold BF16; with history precision int2 every
//    other block holds INT2, and the last ceil(W/P) full blocks of each committed sequence also
//    BF16; with history precision bf16 every block holds only BF16. Both forms are rotated.
//  * Nothing is visible half-written: a commit links all its blocks' new forms under the lock
//    in one step after every byte, checksum and generation is in place; a failing commit
//    changes nothing that was visible before.
//  * Eviction (when used bytes exceed the high watermark, or an allocation fails): BF16 forms
//    of non-sink blocks that also hold INT2 go first (demotion), LRU; then whole blocks, LRU,
//    leaf-first (never a block with a resident child); never a leased block or one pinned by an
//    open put; stops at the low watermark.
//
// Thread-safety: every method is thread-safe. Locks, in the order they may be taken:
//   1. mu_ (std::shared_mutex): puts, leases, pins, LRU, children lists, the arena, and every
//      mutation of the block index. Taken exclusively by BeginPut/CommitPut (briefly, twice:
//      to reserve and to link)/AbortPut/Acquire/Renew/Release/Delete/Tick; never held across
//      checksum, encode or memcpy of block bytes (a commit does those on memory no reader can
//      see, between its two critical sections).
//   2. models_mu_ (std::shared_mutex): registrations and rotations.
//   3. shards_[i].mu, in ascending i: the block index is split into kShards maps by key.
//      A shard's map (and the `forms` of its blocks) is mutated only with mu_ held
//      exclusively AND that shard's lock held exclusively; so code holding mu_ (any mode) may
//      read every shard, and Lookup reads a shard holding only its shared lock — Lookup never
//      takes mu_, so lookups do not wait for puts, leases or eviction bookkeeping. A commit
//      links its blocks holding all shard locks at once, so a lookup sees all or none of it.
//   Metrics counters are atomics (no lock).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvpool/common/keys.h"
#include "kvpool/kernels/block_format.h"
#include "kvpool/kvstore/encoder.h"
#include "kvpool/kvstore/memory.h"
#include "kvpool/kvstore/metrics.h"

namespace kvpool::kvstore {

enum class FormKind : uint8_t { kBf16 = 0, kInt2 = 1 };
inline constexpr int kNumForms = 2;
const char* FormName(FormKind f);  // "bf16", "int2"

enum class HistoryPrecision : uint8_t { kInt2, kBf16 };

// Bounds on what a client registers (RegisterModel refuses more with INVALID_ARGUMENT naming the
// field): identity strings (tenant, model_id, revision) are 1..kMaxIdentityBytes printable ASCII
// bytes (0x20..0x7e; tenant may be empty = "default"); recipe.sink_tokens and recent_tokens are
// at most kMaxRecipeTokens (2^24 tokens, far beyond any context length served today); geometry
// num_layers and num_kv_heads at most kMaxLayersOrHeads (the rotation file's own bound,
// kernels/rotation_file.cc); page_size a power of two at most kMaxPageSize (the worker's bound,
// worker/runtime/src/mixed_kv_cache.cc); tensor_parallel.size at most kMaxTensorParallel.
using ::kvpool::kMaxIdentityBytes;  // kvpool/common/keys.h
inline constexpr uint32_t kMaxPageSize = 1024;
inline constexpr uint32_t kMaxRecipeTokens = 1u << 24;
inline constexpr uint32_t kMaxLayersOrHeads = 4096;
inline constexpr uint32_t kMaxTensorParallel = 65536;
// Largest rotation file the pool accepts, inline (RegisterModelRequest.rotation_file, bounded by
// the gRPC message limit, server.cc) or read from rotation_path. 256 MiB: a d = 128 per-head
// (format_version 2) file of a 128-layer, 16-head model with eigenvalues is about 136 MiB.
inline constexpr uint64_t kMaxRotationFileBytes = 256ull << 20;
// Bytes charged per model registration besides its rotation and identity strings (the Model
// record, its map entries and its spec), for StoreOptions::max_registration_bytes.
inline constexpr uint64_t kRegistrationOverheadBytes = 1024;

// Everything a client registers (RegisterModelRequest without the rotation bytes).
struct ModelSpec {
  std::string tenant = "default";
  std::string model_id;
  std::string revision;
  std::optional<TensorParallelShard> tensor_parallel;
  BlockGeometry geometry;  // includes page_size
  uint32_t sink_tokens = 64;
  uint32_t recent_tokens = 256;
  float clip_ratio_k = 0.96f;
  float clip_ratio_v = 0.92f;
  HistoryPrecision history_precision = HistoryPrecision::kInt2;
  uint32_t block_format_version = 1;
};

// How the rotation arrives: the file's bytes (safetensors, kernels/rotation_file.h; parsed,
// checked against the spec and hashed by the store), or the id of a rotation the store holds.
struct RotationInput {
  std::string file_bytes;    // safetensors bytes, or empty
  std::optional<Digest> id;  // re-attach by id
  // The request field the bytes came from, named by every error about them.
  std::string field = "rotation_file";
  // The bytes were read by the pool from a path the client chose (rotation_path): errors then
  // say what is wrong in fixed words and never echo a number, name or byte read from the file
  // (a client must not learn the content of files it cannot read itself).
  bool redact_file_content = false;
};

// A registered revision of the same tenant and model id (and shard) as a registration, other
// than its own, that holds blocks: what a recalibrated rotation file or a changed recipe (a new
// revision, so a new key namespace) no longer finds.
struct OtherRevision {
  std::string revision;
  Digest rotation_id{};
  uint64_t blocks = 0;  // resident blocks
};

// Most OtherRevision entries a registration returns (those with the most blocks).
inline constexpr size_t kMaxOtherRevisions = 8;

struct ModelInfo {
  Digest namespace_id{};
  Digest rotation_id{};
  bool created = false;
  uint64_t bf16_form_bytes = 0;
  uint64_t int2_form_bytes = 0;
  uint32_t sink_blocks = 0;
  uint32_t recent_blocks = 0;
  // RegisterModel only: the other revisions of this model id that hold blocks, most blocks
  // first, at most kMaxOtherRevisions (protocol v1.7, RegisterModelResponse.other_revisions).
  std::vector<OtherRevision> other_revisions;
};

// Options; every field states its effect and default.
struct StoreOptions {
  // Staging lifetime of a put when the client passes none. Default 30 s.
  absl::Duration default_put_timeout = absl::Seconds(30);
  // Upper bound for a client-requested put timeout. Default 10 min.
  absl::Duration max_put_timeout = absl::Minutes(10);
  // Lease lifetime when the client passes none. Default 10 s.
  absl::Duration default_lease = absl::Seconds(10);
  // Upper bound for a requested lease. Default 5 min.
  absl::Duration max_lease = absl::Minutes(5);
  // Eviction starts when used bytes exceed high_watermark·capacity and stops at
  // low_watermark·capacity (a failed allocation frees further only as far as it needs).
  // Defaults 0.90 / 0.80. 0 < low <= high <= 1 (kvpool-server takes only [0.5, 1]: every pass
  // frees down to the low watermark, and below one half that drops most of the pool).
  double high_watermark = 0.90;
  double low_watermark = 0.80;
  // Largest number of blocks in one put (bounds staging per request). Default 65536.
  uint32_t max_put_blocks = 65536;
  // Allocation granularity, power of two. Default 256 bytes.
  uint64_t alignment = 256;
  // Most bytes model registrations may hold outside the pool memory (they are not counted in
  // its capacity): each distinct rotation set counts the size of its file (the parsed matrices
  // take about as much), each registration kRegistrationOverheadBytes plus its identity. A new
  // registration that would exceed it first frees registrations that hold no stored block and
  // no open put, least recently used first (their namespace then reads NOT_FOUND "is not
  // registered" until a client registers the model again); when that is not enough it is
  // refused with RESOURCE_EXHAUSTED naming the rotation field (also at once when one rotation
  // alone is larger than the limit). Default 1 GiB (four rotation files of the largest size
  // accepted, kMaxRotationFileBytes). Must be > 0.
  uint64_t max_registration_bytes = uint64_t{1} << 30;
  // Where commits rotate and quantize (encoder.h CreateEncoder): auto = the GPU when this build
  // has CUDA and a usable device, else the CPU; gpu makes Create fail (FAILED_PRECONDITION)
  // without one. Default auto.
  CommitDevice commit_device = CommitDevice::kAuto;
  // Corruption reports (ReportCorrupt), each of which costs one hash of a stored form:
  // A report of a form (block, form, generation) this pool verified intact within this window is
  // answered INTACT again without hashing it again (counted as corruption_reports_dropped
  // {reason="duplicate"}). Zero = off (every report is re-verified). Default 60 s.
  absl::Duration corruption_report_dedupe_window = absl::Seconds(60);
  // Per client (ReportCorrupt's `client`; the server passes the gRPC peer's host): the reports
  // that are re-verified pass a token bucket refilled at this many per second and holding at most
  // corruption_report_burst; a report finding it empty is refused with RESOURCE_EXHAUSTED and
  // nothing changes (corruption_reports_dropped{reason="rate"}). Zero = no limit. Default 16 per
  // second, burst 256 (one full call, kMaxCorruptionReports). rate >= 0; burst >= 1.
  double corruption_reports_per_second = 16;
  uint32_t corruption_report_burst = 256;
  // The line of puts waiting for room (BeginPut): a put refused for room that other puts'
  // staging or leased blocks hold (the RoomShortage kind a prefill node waits out) and refused
  // again within this time is in line, in the order of its first refusal, for as long as it
  // asks again within this time; a BeginPut of another sequence then opens only when the room
  // it needs leaves enough for every put in line before it (an earlier first refusal), and is
  // refused otherwise with the same kind of RESOURCE_EXHAUSTED. Without it the nodes that hold
  // the room and open their next put as they commit kept it, and a third one waiting for it
  // never saw it free (newcomer 18 F3). Zero = no line. Default 1 s (a prefill node asks again
  // every 250 ms at most while it waits for room).
  absl::Duration room_waiter_life = absl::Seconds(1);
};

enum class PutAction : uint8_t { kSkip, kWrite };

struct PutBlockPlan {
  uint32_t index = 0;
  Digest key{};
  PutAction action = PutAction::kSkip;
  uint64_t staging_offset = 0;  // into PoolMemory, for kWrite
  uint64_t size = 0;            // BF16 form bytes, for kWrite
  std::vector<FormKind> forms_held;
  std::vector<FormKind> forms_added;
};

struct PutPlan {
  uint64_t put_id = 0;  // random, nonzero, unique among open puts (NewIdLocked)
  std::vector<PutBlockPlan> blocks;
  absl::Duration timeout;
};

struct BlockChecksum {
  uint32_t index = 0;
  uint64_t xxh3 = 0;
};

struct CommittedBlock {
  uint32_t index = 0;
  Digest key{};
  std::vector<FormKind> forms;
};

struct CommitResult {
  std::vector<CommittedBlock> blocks;
  uint64_t bytes_ingested = 0;
};

struct BlockFormsInfo {
  Digest key{};
  bool sink = false;
  std::vector<FormKind> forms;
};

struct FormLocation {
  FormKind form = FormKind::kBf16;
  uint64_t offset = 0;  // into PoolMemory
  uint64_t size = 0;
  uint64_t generation = 0;
  uint64_t xxh3 = 0;
};

struct LeasedBlock {
  uint32_t index = 0;
  Digest key{};
  bool sink = false;
  std::vector<FormLocation> forms;
};

struct LeaseGrant {
  uint64_t lease_id = 0;  // 0 when nothing was held; else random (NewIdLocked), never reused live
  std::vector<LeasedBlock> blocks;
  absl::Duration lifetime;
};

struct ItemResult {
  absl::Status status;
};

// Where one WRITE block of an open put stages its bytes (for pool-initiated writes).
struct StagingRange {
  uint32_t index = 0;   // block index in the put
  uint64_t offset = 0;  // bytes from PoolMemory::data()
  uint64_t size = 0;    // the block's staging bytes (its BF16 form size)
};

struct StoreStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t staging_bytes = 0;
  uint64_t blocks = 0;
  uint64_t forms[kNumForms] = {0, 0};
  uint64_t form_bytes[kNumForms] = {0, 0};
  uint64_t open_puts = 0;
  uint64_t leases = 0;
  uint32_t models = 0;
  uint64_t registration_bytes = 0;  // charged against StoreOptions::max_registration_bytes
  uint64_t pinned_bytes = 0;        // forms of leased or pinned blocks (eviction cannot free)
  std::string commit_device;        // "cpu" or "gpu": where commits encode (BlockEncoder)
};

// A reader's report that a fetched form failed its checksum (ReportCorrupt): the block, the
// form and the generation its lease gave for the form (FormLocation::generation).
struct CorruptionReport {
  Digest key{};
  FormKind form = FormKind::kBf16;
  uint64_t generation = 0;
  uint64_t observed_xxh3 = 0;  // the checksum the reader computed (logged only)
};

// Most reports in one ReportCorrupt call (each costs the pool one hash of the stored form).
inline constexpr size_t kMaxCorruptionReports = 256;

enum class CorruptionVerdict : uint8_t {
  kDropped,  // the stored bytes fail the checksum computed at commit: the form was dropped
  kIntact,   // the stored bytes verify: the form is kept (the reader's copy was damaged in
             // transit or in the reader)
};

// What ReportCorrupt did with one report.
struct CorruptionOutcome {
  // OK: the pool re-verified the stored form (verdict says how it came out). Otherwise nothing
  // was done: NOT_FOUND naming reports[i].key (no such block in this namespace) or
  // reports[i].form (the block holds no such form), FAILED_PRECONDITION naming
  // reports[i].generation (the form was stored again since: the report is stale),
  // INVALID_ARGUMENT naming reports[i] (the same form twice in one call), RESOURCE_EXHAUSTED
  // naming reports[i] (over the client's rate of re-verified reports: report again later).
  // OK with verdict kIntact also for a repeat of a form verified intact within the dedupe
  // window (not hashed again).
  absl::Status status;
  CorruptionVerdict verdict = CorruptionVerdict::kIntact;
  // After the report (set for a refused report too, which changed nothing): the block still
  // holds a form (Lookup counts it); false for a key this namespace does not hold. False after
  // a drop when the dropped form was its last: the block stays in the index without forms (so its
  // resident descendants keep their place and a re-put of the prefix writes only this block),
  // Lookup and Acquire stop before it, and it is removed once nothing pins it and it has no
  // children.
  bool block_held = true;
  // The dropped form's bytes were freed by this call. False while a lease or an open put pins
  // the block (a reader may still be copying them): they are freed when the last pin ends.
  bool bytes_freed = false;
};

// Either token ids (keys computed by the store) or an explicit key chain.
struct KeyQuery {
  std::vector<uint32_t> token_ids;
  std::vector<Digest> keys;
};

class BlockStore {
 public:
  // `memory` and `clock` must outlive the store; `metrics` may be null (then the store keeps
  // its own). Errors: INVALID_ARGUMENT naming the option for bad watermarks/alignment.
  static absl::StatusOr<std::unique_ptr<BlockStore>> Create(const StoreOptions& options,
                                                            PoolMemory* memory, Clock* clock,
                                                            std::shared_ptr<Metrics> metrics = {});
  ~BlockStore();

  // Registers a model, or returns the existing registration when every field is equal.
  // Errors: INVALID_ARGUMENT naming the field (identity strings, geometry, page_size, recipe,
  // rotation file; bounds above); FAILED_PRECONDITION listing every differing field when (tenant,
  // model_id, revision, tensor_parallel) is already registered differently; NOT_FOUND for an
  // unknown rotation id.
  absl::StatusOr<ModelInfo> RegisterModel(const ModelSpec& spec, const RotationInput& rotation);

  // Phase 1 of a put. tokens: the sequence from token 0; num_blocks full blocks are stored
  // (1 <= num_blocks <= tokens/page_size). timeout 0 = default.
  // Errors: NOT_FOUND (namespace not registered), INVALID_ARGUMENT (num_blocks, token_ids,
  // timeout_ms), RESOURCE_EXHAUSTED (staging space even after eviction; or a commit that could
  // never fit: its staging plus the new forms it allocates while holding that staging exceed
  // what eviction can free — capacity minus other puts' staging and the forms of leased or
  // pinned blocks — the message gives each number; or, when the free bytes are in pieces, a
  // staging that would not fit with the commit's new forms even once eviction freed all it may:
  // "pool full: ...; nothing was evicted", AllocateAllLocked; or room kept for puts in line
  // before this one, StoreOptions::room_waiter_life: "the pool keeps ... for N put(s) ...",
  // whose RoomShortage counts the kept bytes as staging).
  absl::StatusOr<PutPlan> BeginPut(const Digest& namespace_id, absl::Span<const uint32_t> tokens,
                                   uint32_t num_blocks, absl::Duration timeout);

  // Phase 2: verifies one checksum per WRITE block (DATA_LOSS naming the block on mismatch),
  // refuses NaN/Inf (INVALID_ARGUMENT naming block, layer, head, K/V and token), encodes, and
  // links every block atomically. Any error aborts the put (staging freed, nothing visible).
  // Errors also: NOT_FOUND (unknown/expired put), FAILED_PRECONDITION (put of another
  // namespace, or already committing), RESOURCE_EXHAUSTED (no space for the forms: checked before
  // anything is evicted against capacity minus staging and pinned forms, naming num_blocks and the
  // numbers; then, when the free ranges do not take the forms, whether they would once eviction
  // freed all it may: if not, "pool full: ...; nothing was evicted", else it evicts until they are
  // allocated). Fail closed: a put past its deadline (BeginPut's time + its timeout) is expired
  // even before Tick runs. CommitPut, AbortPut and BeginPutWrite then answer NOT_FOUND ("expired:
  // not committed within the pool's put timeout of N ms ...") and reclaim its staging (counted in
  // put_expiries), unless a WritePut still holds a claim (then Tick reclaims it after
  // EndPutWrite). A commit that started before the deadline completes.
  absl::StatusOr<CommitResult> CommitPut(const Digest& namespace_id, uint64_t put_id,
                                         absl::Span<const BlockChecksum> checksums);

  // Drops an open put. Errors: NOT_FOUND, FAILED_PRECONDITION (committing, other namespace).
  absl::Status AbortPut(const Digest& namespace_id, uint64_t put_id);

  // Claims open put `put_id` for a write into its staging by the pool itself (WritePut): while
  // claimed, the put neither expires nor can be aborted or committed (FAILED_PRECONDITION), so
  // its staging stays allocated while a transfer writes into it. Several claims may overlap.
  // Returns the staging ranges of its WRITE blocks. Every successful call must be matched by
  // EndPutWrite. `time_left` (optional) receives the time until the put's deadline (zero or
  // negative when it has passed): the writer must give up and EndPutWrite by then, or the put
  // outlives its timeout. Errors: NOT_FOUND (unknown, expired, committed or other namespace),
  // FAILED_PRECONDITION (committing). Thread-safe.
  absl::StatusOr<std::vector<StagingRange>> BeginPutWrite(const Digest& namespace_id,
                                                          uint64_t put_id,
                                                          absl::Duration* time_left = nullptr);
  // Drops one claim of BeginPutWrite. No-op for an unknown put. Thread-safe.
  void EndPutWrite(uint64_t put_id);
  // (offset from PoolMemory::data(), size) of every form held by live lease `lease_id`, sorted
  // by offset. Leased forms are never evicted, demoted or reused while the lease lives.
  // `dropped` (optional) receives, sorted, the ranges of forms the lease was granted that were
  // dropped since as corrupt (ReportCorrupt): still allocated, but not to be served.
  // Errors: NOT_FOUND (unknown or expired lease). Thread-safe.
  absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> LeasedRanges(
      uint64_t lease_id, std::vector<std::pair<uint64_t, uint64_t>>* dropped = nullptr);

  // Leading held blocks of `query`. Side-effect free (no LRU touch). Errors: NOT_FOUND
  // (namespace), INVALID_ARGUMENT (both or neither of token_ids/keys; `keys[i]` held but not as
  // block i of the chain keys[0..i-1] names: out of order, repeated or skipping a block).
  absl::StatusOr<std::vector<BlockFormsInfo>> Lookup(const Digest& namespace_id,
                                                     const KeyQuery& query) const;

  // Leases the leading held blocks (at most max_blocks when > 0). lease 0 = default.
  // Errors: those of Lookup (then nothing is leased).
  absl::StatusOr<LeaseGrant> Acquire(const Digest& namespace_id, const KeyQuery& query,
                                     uint32_t max_blocks, absl::Duration lease);
  // Errors: NOT_FOUND when the lease is unknown or expired.
  absl::StatusOr<absl::Duration> Renew(uint64_t lease_id, absl::Duration lease);
  absl::Status Release(uint64_t lease_id);

  // A reader found that forms it fetched fail their checksums (protocol v1.5). For each report
  // the store re-hashes the stored form (outside the lock, the block pinned meanwhile) and
  // compares it with the checksum it computed at commit: corrupt → the form is dropped at once
  // (Lookup, Acquire and BeginPut no longer see it, so a re-put writes it again; its bytes are
  // freed when no lease or put pins the block; counted as checksum_failures_fetch_stored and
  // logged); intact → kept (checksum_failures_fetch_transit, logged). A report that names a
  // block of another namespace, an unknown key, a form the block does not hold or another
  // generation changes nothing (per-report status, see CorruptionOutcome;
  // corruption_reports_refused). Descendants of a block that lost its last form stay resident
  // (leaf-first: nothing is removed out of order) but are unreachable by prefix until the
  // block is stored again. Errors for the call: NOT_FOUND (namespace), INVALID_ARGUMENT
  // ("reports": empty or more than kMaxCorruptionReports). Thread-safe.
  // Repeats and floods (StoreOptions::corruption_report_*): a form verified intact within the
  // dedupe window is answered INTACT without hashing it again; a report that would be hashed
  // takes a token of `client`'s bucket (clients are told apart by this string; "" is one
  // client), and one that finds none is refused with RESOURCE_EXHAUSTED naming reports[i] and the
  // limit. Neither changes anything stored; both are counted (corruption_reports_dropped).
  absl::StatusOr<std::vector<CorruptionOutcome>> ReportCorrupt(
      const Digest& namespace_id, absl::Span<const CorruptionReport> reports,
      const std::string& client = "");

  // Deletes each key and its resident descendants. Per key: OK, NOT_FOUND (absent),
  // FAILED_PRECONDITION (it or a descendant is leased or pinned by an open put).
  absl::StatusOr<std::vector<ItemResult>> Delete(const Digest& namespace_id,
                                                 absl::Span<const Digest> keys,
                                                 uint32_t* blocks_deleted);

  // Expires leases and puts whose deadline passed, then evicts down to the low watermark when
  // above the high one. The server calls it periodically; tests call it after FakeClock moves.
  void Tick();

  StoreStats Stats() const;
  Metrics& metrics() { return *metrics_; }
  // The commit encoder (thread-safe); device_name() says where commits run.
  const BlockEncoder& encoder() const { return *encoder_; }
  PoolMemory& memory() { return *memory_; }

 private:
  struct Model {
    ModelSpec spec;
    ModelInfo info;
    std::shared_ptr<const kvpool::RotationSet> rotation;
    std::string identity;        // key in models_by_identity_
    uint64_t charged_bytes = 0;  // kRegistrationOverheadBytes + identity (not the rotation)
    // Resident blocks of this model. Guarded by mu_ (exclusive to change).
    mutable uint64_t blocks = 0;
    // Set (under mu_ and models_mu_, both exclusive) when the registration is freed; a call that
    // found the model before then must not create a put for it (BeginPut checks under mu_).
    mutable bool retired = false;
    // use_clock_ value of the latest call that named the model (LRU of registrations).
    mutable std::atomic<uint64_t> last_use{0};
  };
  struct Slot {
    bool present = false;
    uint64_t offset = 0;
    uint64_t size = 0;
    uint64_t generation = 0;
    uint64_t xxh3 = 0;
  };
  struct Block {
    Digest key{};
    std::optional<Digest> parent;
    const Model* model = nullptr;
    uint32_t index = 0;
    bool sink = false;
    Slot forms[kNumForms];
    std::vector<Digest> children;  // resident children
    uint32_t pins = 0;             // leases + open puts holding it
    std::list<Digest>::iterator lru;
    // Forms dropped as corrupt (ReportCorrupt) while the block was pinned: no longer in
    // `forms`, their bytes stay allocated until the last pin ends (UnpinLocked frees them).
    std::vector<Slot> dropped;
  };
  struct PendingForm {
    bool wanted = false;
    Slot slot;  // allocated at commit, linked last
  };
  struct PutBlockState {
    PutBlockPlan plan;
    std::optional<Digest> parent;
    bool pinned_existing = false;  // took a pin on an existing block at BeginPut
    uint64_t staging_offset = 0;
  };
  struct Put {
    uint64_t id = 0;
    const Model* model = nullptr;
    absl::Time deadline;
    absl::Duration timeout;  // the effective put timeout (deadline - BeginPut's time)
    bool committing = false;
    uint32_t writers = 0;  // BeginPutWrite claims in progress
    std::vector<PutBlockState> blocks;
  };
  struct Lease {
    absl::Time deadline;
    std::vector<Digest> keys;
  };

  BlockStore(const StoreOptions& options, PoolMemory* memory, Clock* clock,
             std::shared_ptr<Metrics> metrics);

  // Requires models_mu_ (any mode). The shared_ptr keeps the model alive for the caller even if
  // its registration is freed meanwhile (then `retired` is set).
  absl::StatusOr<std::shared_ptr<const Model>> FindModelLocked(const Digest& namespace_id) const;
  // Frees registrations (LRU, only those with no block and no open put) until `need` more bytes
  // fit under max_registration_bytes; the rotation `keep_rotation` (the one being registered)
  // stays held and charged even when no remaining model uses it. True when they fit. Requires
  // mu_ and models_mu_ exclusive.
  bool MakeRoomForRegistrationLocked(uint64_t need, const Digest& keep_rotation);
  absl::StatusOr<std::vector<Digest>> ResolveKeys(const Model& m, const KeyQuery& q,
                                                  size_t max_blocks) const;
  // OK when held block `b` is block i of the chain `keys` names (store.cc says why), else
  // INVALID_ARGUMENT naming keys[i]. Reads only `b`: callable under a shard lock or mu_.
  static absl::Status CheckChainPosition(absl::Span<const Digest> keys, uint32_t i, const Block& b);
  // Forms a block at `index` of a sequence of `num_blocks` gets from a put.
  void TargetForms(const Model& m, uint32_t index, uint32_t num_blocks, bool out[kNumForms]) const;
  // Allocates `size` bytes, evicting (ReclaimLocked) until it fits or nothing more can be
  // evicted; then the arena's RESOURCE_EXHAUSTED. Only AllocateAllLocked calls it, after its dry
  // run. Requires mu_ exclusive.
  absl::StatusOr<uint64_t> AllocateLocked(uint64_t size);
  // What eviction could make free now, found without evicting: a copy of the arena with every
  // form freed that ReclaimLocked may free (BF16 forms of unpinned non-sink blocks that also hold
  // INT2; every form of unpinned blocks with no pinned descendant, FORMAT.md §5), the bytes so
  // freed, and the bytes of the unpinned blocks it cannot free (ancestors of pinned blocks).
  struct EvictionDryRun {
    Arena arena;
    uint64_t evictable = 0;
    uint64_t ancestors = 0;
  };
  // O(blocks + free ranges), like one ReclaimLocked pass. Requires mu_.
  EvictionDryRun DryRunEvictionLocked() const;
  // One arena range for each of `sizes` (bytes, each > 0), all of them or none; offsets in the
  // order of `sizes`. Without eviction when the free ranges serve them all; else it evicts only
  // when a dry run (DryRunEvictionLocked) shows they all fit once eviction freed what it may, so
  // a request that cannot succeed evicts nothing (newcomer report 11b F1: a commit whose forms
  // found no range in a fragmented pool evicted every stored block, then failed, and the
  // prefill node's re-put repeated it). `then`: sizes that must fit after these in the dry run
  // but are not allocated (BeginPut: the new forms its commit allocates while the staging is
  // held, so a put that could not commit evicts nothing for its staging either). `what` names
  // the ranges in the refusal ("new forms", "staging ranges"). Errors: RESOURCE_EXHAUSTED
  // "num_blocks: pool full: ..." naming what holds the pool (RoomRefusalLocked), with a
  // RoomShortage payload. Requires mu_ exclusive.
  absl::StatusOr<std::vector<uint64_t>> AllocateAllLocked(absl::Span<const uint64_t> sizes,
                                                          const char* what,
                                                          absl::Span<const uint64_t> then = {});
  // The refusal of AllocateAllLocked: `sizes` (named by `what`, e.g. "3 new forms") cannot all
  // be placed; the first `placed` of them fit (in the dry run's arena) and the next did not;
  // `evicted` bytes were evicted meanwhile. The caller's own ranges must be freed before (they
  // are not counted). Requires mu_.
  absl::Status RoomRefusalLocked(absl::Span<const uint64_t> sizes, size_t placed,
                                 absl::string_view what, const EvictionDryRun& dry,
                                 uint64_t evicted) const;
  // Frees down to `target_used` bytes. Returns bytes freed. Requires mu_ exclusive.
  uint64_t ReclaimLocked(uint64_t target_used, const char* trigger);
  // Requires mu_ exclusive and the block's shard lock exclusive.
  void FreeSlotLocked(Block& b, FormKind f, const char* reason);
  // Requires mu_ exclusive; takes the block's shard lock.
  void RemoveBlockLocked(const Digest& key, const char* reason);
  void ReleasePutLocked(Put& put, bool free_staging);
  // The open put `put_id` of `namespace_id` that is not committing. Caller holds mu_
  // exclusively. Errors: NOT_FOUND (unknown, expired, aborted, committed or another
  // namespace's put), FAILED_PRECONDITION (already committing), both naming put_id. A put past
  // its deadline is NOT_FOUND and, with no WritePut claim, reclaimed here (fail closed).
  absl::StatusOr<std::unordered_map<uint64_t, Put>::iterator> FindOpenPutLocked(
      const Digest& namespace_id, uint64_t put_id);
  // Drops one pin; at the last one frees the block's dropped forms, and removes the block when
  // it holds no form and has no resident child. Requires mu_ exclusive (no shard lock held).
  void UnpinLocked(const Digest& key);
  // Drops form `f` of `b` found corrupt: out of `forms` at once, its bytes freed now or (when
  // pinned) at the last unpin. Requires mu_ exclusive; takes the block's shard lock.
  void DropCorruptFormLocked(Block& b, FormKind f);
  static bool HoldsAForm(const Block& b) { return b.forms[0].present || b.forms[1].present; }
  // Whether eviction's first phase may drop b's BF16 form ("demote before evict", FORMAT.md §5):
  // a non-sink block holding both forms (pins are the caller's check).
  static bool Demotable(const Block& b) {
    return !b.sink && b.forms[int(FormKind::kBf16)].present &&
           b.forms[int(FormKind::kInt2)].present;
  }
  void ExpireLocked(absl::Time now);
  // Bytes of `b`'s present and dropped forms (arena-rounded).
  uint64_t HeldBytes(const Block& b) const;
  // Takes one pin on `b` (the first adds its bytes to pinned_bytes_). Requires mu_ exclusive.
  void PinLocked(Block& b);
  // The most bytes eviction can make free now: capacity minus the staging of open puts, the
  // forms of pinned blocks and `also_pinned` more (what a caller is about to pin); 0 when those
  // exceed it. A bound, not a promise (ancestors of pinned blocks, fragmentation). Requires mu_.
  uint64_t EvictableRoomLocked(uint64_t also_pinned) const;
  // RESOURCE_EXHAUSTED (naming what is short, with the numbers) when a put of the blocks `keys`
  // could never commit: its staging plus the new forms its commit allocates while that staging
  // is held exceed what eviction can free (capacity minus other puts' staging and the forms of
  // pinned blocks, counting those the put itself pins). Requires mu_ exclusive.
  // `need` and `room` (when not null) get the bytes the commit needs at once and what eviction
  // can free, whatever the outcome.
  absl::Status CheckCommitFitsLocked(const Model& m, absl::Span<const Digest> keys,
                                     uint64_t* need = nullptr, uint64_t* room = nullptr);
  uint64_t NextGeneration() { return ++generation_; }

  // The line of puts waiting for room (StoreOptions::room_waiter_life), in the order of their
  // first refusal; a put is named by the key of its last block (the chain names the namespace
  // and every token). Guarded by mu_.
  struct RoomWaiter {
    Digest key{};
    uint64_t need = 0;  // bytes its commit needs at once, at its last refusal
    absl::Time last;    // its last refusal
    int refusals = 0;   // in line from the second
  };
  std::vector<RoomWaiter> room_waiters_;
  // Drops the waiters not refused within room_waiter_life before `now`. Requires mu_ exclusive.
  void PruneRoomWaitersLocked(absl::Time now);
  // A refusal `s` of the put named `key` (needing `need` bytes) at `now`: recorded when it is
  // for room held by other puts or leases (its RoomShortage). Requires mu_ exclusive.
  void NoteRoomRefusalLocked(const Digest& key, uint64_t need, const absl::Status& s,
                             absl::Time now);
  // Bytes and count of the puts in line before `key` (all in line when `key` is not). Requires mu_.
  std::pair<uint64_t, int> RoomKeptAheadLocked(const Digest& key) const;

  const StoreOptions options_;
  PoolMemory* const memory_;
  Clock* const clock_;
  std::shared_ptr<Metrics> metrics_;
  std::unique_ptr<BlockEncoder> encoder_;  // set by Create; thread-safe

  mutable std::shared_mutex mu_;
  Arena arena_;  // guarded by mu_
  mutable std::shared_mutex models_mu_;
  std::map<std::string, std::shared_ptr<Model>> models_by_identity_;  // guarded by models_mu_
  std::unordered_map<Digest, std::shared_ptr<const Model>, DigestHash>
      models_;  // guarded by models_mu_
  std::unordered_map<Digest, std::shared_ptr<const kvpool::RotationSet>, DigestHash>
      rotations_;                                                    // guarded by models_mu_
  std::unordered_map<Digest, uint64_t, DigestHash> rotation_bytes_;  // guarded by models_mu_
  uint64_t registration_bytes_ = 0;                                  // guarded by models_mu_
  mutable std::atomic<uint64_t> use_clock_{0};
  static constexpr int kShards = 16;
  struct Shard {
    mutable std::shared_mutex mu;
    std::unordered_map<Digest, Block, DigestHash> blocks;  // see the lock comment at the top
  };
  // Byte 8 of the key picks the shard (DigestHash uses bytes 0..7 for the bucket).
  Shard& ShardOf(const Digest& k) { return shards_[k[8] % kShards]; }
  const Shard& ShardOf(const Digest& k) const { return shards_[k[8] % kShards]; }
  // The block with key `k`, or null. Requires mu_ (any mode).
  Block* FindBlockLocked(const Digest& k);
  std::array<Shard, kShards> shards_;
  std::list<Digest> lru_;                       // front = least recently used; guarded by mu_
  std::unordered_map<uint64_t, Put> puts_;      // guarded by mu_
  std::unordered_map<uint64_t, Lease> leases_;  // guarded by mu_
  uint64_t staging_bytes_ = 0;                  // guarded by mu_
  // Arena bytes of the forms (present and dropped) of blocks with pins > 0: eviction cannot
  // free them. Kept by PinLocked, UnpinLocked, FreeSlotLocked, RemoveBlockLocked and the
  // commit's linking; guarded by mu_.
  uint64_t pinned_bytes_ = 0;
  uint64_t form_count_[kNumForms] = {0, 0};  // guarded by mu_
  uint64_t form_bytes_[kNumForms] = {0, 0};  // guarded by mu_
  uint64_t formless_blocks_ = 0;  // indexed blocks whose every form was dropped; guarded by mu_
  // A fresh put or lease id: 64 random bits from OpenSSL's CSPRNG, nonzero and not in use by an
  // open put or a live lease, so that no client can guess another's id (Release, Renew,
  // AbortPut and CommitPut take nothing else). Requires mu_ exclusive.
  uint64_t NewIdLocked();
  uint64_t generation_ = 0;  // guarded by mu_
  // ReportCorrupt's memory (guarded by mu_): when each (key, form, generation) was last verified
  // intact (at most kMaxVerifiedForms entries, expired ones swept, else the oldest dropped), and
  // each client's token bucket (at most kMaxReportClients; full buckets are dropped first).
  static constexpr size_t kMaxVerifiedForms = 65536;
  static constexpr size_t kMaxReportClients = 4096;
  std::unordered_map<std::string, absl::Time> verified_intact_;
  struct ReportBucket {
    double tokens = 0;
    absl::Time last;
  };
  std::unordered_map<std::string, ReportBucket> report_buckets_;
  // Takes one token of `client`'s bucket at `now`; false when it is empty. Requires mu_.
  bool TakeReportTokenLocked(const std::string& client, absl::Time now);
  // Remembers that `key`'s form `f` at `generation` verified intact at `now`. Requires mu_.
  void NoteVerifiedIntactLocked(const std::string& id, absl::Time now);
};

}  // namespace kvpool::kvstore
