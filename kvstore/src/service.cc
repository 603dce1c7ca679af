// kvpool.v1.KvPool over BlockStore: proto ↔ store structs, status mapping, latency metrics.
#include "service.h"

#include <grpcpp/grpcpp.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvpool/common/bounded_file.h"
#include "kvpool/common/checksum.h"
#include "kvpool/common/log.h"
#include "kvpool/common/room_shortage.h"
#include "kvpool/common/status.h"
#include "kvpool/v1/pool.grpc.pb.h"
#include "kvpool/v1/pool.pb.h"
#include "rotation_source.h"
#if defined(KVPOOL_HAVE_TRANSPORT)
#include "kvpool/transport/transport.h"
#include "kvpool/transport/ucx_transport.h"
#endif

namespace kvpool::kvstore {
namespace {

namespace pb = ::kvpool::v1;

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) {
    return grpc::Status::OK;
  }
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

pb::Form ToProto(FormKind f) { return f == FormKind::kBf16 ? pb::FORM_BF16 : pb::FORM_INT2; }

absl::StatusOr<Digest> ParseNamespace(const std::string& bytes) {
  return DigestFromBytes(bytes, "namespace_id");
}

absl::StatusOr<KeyQuery> ParseQuery(const google::protobuf::RepeatedField<uint32_t>& tokens,
                                    const google::protobuf::RepeatedPtrField<std::string>& keys) {
  KeyQuery q;
  q.token_ids.assign(tokens.begin(), tokens.end());
  q.keys.reserve(keys.size());
  for (int i = 0; i < keys.size(); ++i) {
    auto d = DigestFromBytes(keys[i], absl::StrCat("keys[", i, "]"));
    if (!d.ok()) {
      return d.status();
    }
    q.keys.push_back(*d);
  }
  if (q.token_ids.empty() == q.keys.empty()) {
    return absl::InvalidArgumentError("token_ids/keys: give exactly one of them");
  }
  return q;
}

// The bytes of the rotation file at `path` (RegisterModelRequest.rotation_path), read by the pool
// for a client with the shared bounded reader (kvpool::ReadBoundedRegularFile, exact size). Only a
// regular file of 1..kMaxRotationFileBytes bytes is read (a device such as /dev/zero, a FIFO, a
// directory or /proc/self/mem is refused before any byte is read; the open does not block on a
// FIFO), into one buffer of the size fstat reported (no growth, no second copy). Errors:
// INVALID_ARGUMENT naming rotation_path and the path; the message carries the errno text, the
// file type or the size, never a byte of the file.
absl::StatusOr<std::string> ReadRotationPath(const std::string& path) {
  const std::string where = absl::StrCat("rotation_path ", QuotedPath(path));
  if (path.empty()) return absl::InvalidArgumentError("rotation_path: empty");
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(where, " contains a NUL byte"));
  }
  FileReadInfo info;
  auto bytes = ReadBoundedRegularFile(path, kMaxRotationFileBytes, &info, /*exact_size=*/true);
  using Stage = FileReadInfo::Stage;
  switch (info.stage) {
    case Stage::kOk:
      break;
    case Stage::kOpen:
      return absl::InvalidArgumentError(
          absl::StrCat(where, " cannot be opened (", std::strerror(info.error), ")"));
    case Stage::kStat:
      return absl::InvalidArgumentError(
          absl::StrCat(where, " cannot be examined (", std::strerror(info.error), ")"));
    case Stage::kNotRegular:
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is ", info.type, "; a rotation file must be a regular file"));
    case Stage::kTooLarge:
      return absl::InvalidArgumentError(absl::StrCat(where, " has ", info.size, " bytes; at most ",
                                                     kMaxRotationFileBytes, " are accepted"));
    case Stage::kGrew:
    case Stage::kShrank:
      return absl::InvalidArgumentError(absl::StrCat(where, " changed size while being read"));
    case Stage::kRead:
      return absl::InvalidArgumentError(
          absl::StrCat(where, " cannot be read (", std::strerror(info.error), ")"));
  }
  if (!bytes.ok()) return absl::InvalidArgumentError(absl::StrCat(where, " cannot be read"));
  if (bytes->empty()) return absl::InvalidArgumentError(absl::StrCat(where, " is empty"));
  return bytes;
}

#if defined(KVPOOL_HAVE_TRANSPORT)
using transport::EndpointId;
using transport::RemoteKeyId;

// Endpoints to clients and the remote keys unpacked on them, for pool-initiated transfers
// (WritePut, ReadLeased). One endpoint per client worker address, reused across calls; a failed
// one (its client died) is replaced on the next use. Bounded: at most kMaxPeers peers (the
// least recently used is dropped) and kMaxKeys keys per peer (then the peer is replaced by a
// fresh endpoint without keys). A Peer is disconnected — its keys destroyed — only when the last
// call using it has finished (shared_ptr), never under a transfer in flight. Thread-safe.
class PeerLinks {
 public:
  struct Peer {
    transport::Transport* transport = nullptr;
    EndpointId endpoint;
    std::map<std::string, RemoteKeyId> keys;  // guarded by PeerLinks::mu_
    uint64_t last_use = 0;                    // guarded by PeerLinks::mu_
    ~Peer() { (void)transport->Disconnect(endpoint); }
  };
  struct Link {
    std::shared_ptr<Peer> peer;  // keeps endpoint and key alive while held
    RemoteKeyId key;
  };

  explicit PeerLinks(transport::Transport* t) : transport_(t) {}

  // The endpoint to `address` (sealed worker address) and `rkey` (sealed packed key) unpacked
  // on it. Errors: INVALID_ARGUMENT naming `address_field` / `rkey_field` for malformed blobs,
  // UNAVAILABLE when the client cannot be reached.
  absl::StatusOr<Link> Get(const std::string& address, const std::string& rkey,
                           const char* address_field, const char* rkey_field) {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Peer>& slot = peers_[address];
    if (slot != nullptr &&
        (!transport_->EndpointStatus(slot->endpoint).ok() || slot->keys.size() >= kMaxKeys)) {
      slot.reset();  // failed, or too many keys: a fresh endpoint
    }
    if (slot == nullptr) {
      auto ep = transport_->Connect(address);
      if (!ep.ok()) {
        peers_.erase(address);
        return Annotated(ep.status(), address_field);
      }
      slot = std::make_shared<Peer>();
      slot->transport = transport_;
      slot->endpoint = *ep;
    }
    std::shared_ptr<Peer> peer = slot;
    peer->last_use = ++clock_;
    auto k = peer->keys.find(rkey);
    if (k == peer->keys.end()) {
      auto key = transport_->UnpackRemoteKey(peer->endpoint, rkey);
      if (!key.ok()) return Annotated(key.status(), rkey_field);
      k = peer->keys.emplace(rkey, *key).first;
    }
    Link link{peer, k->second};
    if (peers_.size() > kMaxPeers) {
      auto lru = std::min_element(peers_.begin(), peers_.end(), [](const auto& a, const auto& b) {
        return a.second->last_use < b.second->last_use;
      });
      peers_.erase(lru);
    }
    return link;
  }

 private:
  static constexpr size_t kMaxPeers = 1024;
  static constexpr size_t kMaxKeys = 64;

  static absl::Status Annotated(const absl::Status& s, const char* field) {
    return absl::Status(s.code(), absl::StrCat(field, ": ", s.message()));
  }

  transport::Transport* const transport_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Peer>> peers_;  // guarded by mu_
  uint64_t clock_ = 0;                                  // guarded by mu_
};
#endif  // KVPOOL_HAVE_TRANSPORT

// Wall-clock deadline of a call: the client's, capped at 60 s.
absl::Time CallDeadline(const grpc::ServerContext* ctx) {
  const absl::Time cap = absl::Now() + absl::Seconds(60);
  if (ctx == nullptr) return cap;
  const absl::Time d = absl::FromChrono(ctx->deadline());
  return std::min(d, cap);
}

class KvPoolService final : public pb::KvPool::Service {
 public:
  explicit KvPoolService(const ServiceContext& ctx)
      : ctx_(ctx),
        store_(*ctx.store)
#if defined(KVPOOL_HAVE_TRANSPORT)
        ,
        peers_(ctx.transport)
#endif
  {
  }

  grpc::Status RegisterModel(grpc::ServerContext*, const pb::RegisterModelRequest* req,
                             pb::RegisterModelResponse* resp) override {
    return Finish(RegisterImpl(*req, resp));
  }

  grpc::Status BeginPut(grpc::ServerContext* context, const pb::BeginPutRequest* req,
                        pb::BeginPutResponse* resp) override {
    return Timed(store_.metrics().put_latency, [&] {
      absl::Status s = BeginPutImpl(*req, resp, context);
      // A refusal for room: its numbers as a trailer too (protocol v1.7, RoomShortage).
      if (std::optional<RoomShortage> r = GetRoomShortage(s); r.has_value() && context) {
        pb::RoomShortage m;
        m.set_need_bytes(r->need_bytes);
        m.set_room_bytes(r->room_bytes);
        m.set_staging_bytes(r->staging_bytes);
        m.set_pinned_bytes(r->pinned_bytes);
        context->AddTrailingMetadata(kRoomShortageTrailer, m.SerializeAsString());
      }
      return s;
    });
  }

  grpc::Status CommitPut(grpc::ServerContext*, const pb::CommitPutRequest* req,
                         pb::CommitPutResponse* resp) override {
    return Timed(store_.metrics().commit_latency, [&] { return CommitImpl(*req, resp); });
  }

  grpc::Status AbortPut(grpc::ServerContext*, const pb::AbortPutRequest* req,
                        pb::AbortPutResponse*) override {
    auto ns = ParseNamespace(req->namespace_id());
    if (!ns.ok()) {
      return Finish(ns.status());
    }
    if (req->put_tag().empty()) {
      absl::Status s = store_.AbortPut(*ns, req->put_id());
      if (s.ok()) ForgetPutTag(req->put_id());
      return Finish(s);
    }
    if (req->put_id() != 0) {
      return Finish(absl::InvalidArgumentError(
          "put_tag: give put_id or put_tag, not both (put_tag names a put whose id the caller "
          "never learnt)"));
    }
    if (absl::Status t = CheckPutTag(req->put_tag()); !t.ok()) return Finish(t);
    return Finish(AbortTagged(*ns, TagKey(req->namespace_id(), req->put_tag())));
  }

  grpc::Status WritePut(grpc::ServerContext* context, const pb::WritePutRequest* req,
                        pb::WritePutResponse* resp) override {
    return Timed(store_.metrics().write_put_latency,
                 [&] { return WritePutImpl(*req, resp, CallDeadline(context), context); });
  }

  grpc::Status ReadLeased(grpc::ServerContext* context, const pb::ReadLeasedRequest* req,
                          pb::ReadLeasedResponse* resp) override {
    return Timed(store_.metrics().read_leased_latency,
                 [&] { return ReadLeasedImpl(*req, resp, CallDeadline(context), context); });
  }

  grpc::Status Lookup(grpc::ServerContext*, const pb::LookupRequest* req,
                      pb::LookupResponse* resp) override {
    return Timed(store_.metrics().lookup_latency, [&] { return LookupImpl(*req, resp); });
  }

  grpc::Status Acquire(grpc::ServerContext*, const pb::AcquireRequest* req,
                       pb::AcquireResponse* resp) override {
    return Timed(store_.metrics().fetch_latency, [&] { return AcquireImpl(*req, resp); });
  }

  grpc::Status Renew(grpc::ServerContext*, const pb::RenewRequest* req,
                     pb::RenewResponse* resp) override {
    auto d = store_.Renew(req->lease_id(), absl::Milliseconds(req->lease_ms()));
    if (!d.ok()) {
      return Finish(d.status());
    }
    resp->set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(*d)));
    return grpc::Status::OK;
  }

  grpc::Status Release(grpc::ServerContext*, const pb::ReleaseRequest* req,
                       pb::ReleaseResponse*) override {
    return Finish(store_.Release(req->lease_id()));
  }

  grpc::Status Delete(grpc::ServerContext*, const pb::DeleteRequest* req,
                      pb::DeleteResponse* resp) override {
    auto ns = ParseNamespace(req->namespace_id());
    if (!ns.ok()) {
      return Finish(ns.status());
    }
    std::vector<Digest> keys;
    for (int i = 0; i < req->keys_size(); ++i) {
      auto d = DigestFromBytes(req->keys(i), absl::StrCat("keys[", i, "]"));
      if (!d.ok()) {
        return Finish(d.status());
      }
      keys.push_back(*d);
    }
    uint32_t deleted = 0;
    auto r = store_.Delete(*ns, keys, &deleted);
    if (!r.ok()) {
      return Finish(r.status());
    }
    for (const ItemResult& item : *r) {
      pb::ItemStatus* st = resp->add_results();
      st->set_code(static_cast<int32_t>(item.status.code()));
      st->set_message(std::string(item.status.message()));
    }
    resp->set_blocks_deleted(deleted);
    return grpc::Status::OK;
  }

  grpc::Status ReportCorrupt(grpc::ServerContext* ctx, const pb::ReportCorruptRequest* req,
                             pb::ReportCorruptResponse* resp) override {
    return Finish(ReportCorruptImpl(*req, ReportClientIdentity(ctx->peer()), resp));
  }

  grpc::Status Stats(grpc::ServerContext*, const pb::StatsRequest*,
                     pb::StatsResponse* resp) override {
    const StoreStats s = store_.Stats();
    const Metrics& m = store_.metrics();
    resp->set_capacity_bytes(s.capacity_bytes);
    resp->set_used_bytes(s.used_bytes);
    resp->set_staging_bytes(s.staging_bytes);
    resp->set_blocks(s.blocks);
    resp->set_bf16_forms(s.forms[int(FormKind::kBf16)]);
    resp->set_int2_forms(s.forms[int(FormKind::kInt2)]);
    resp->set_bf16_bytes(s.form_bytes[int(FormKind::kBf16)]);
    resp->set_int2_bytes(s.form_bytes[int(FormKind::kInt2)]);
    resp->set_open_puts(s.open_puts);
    resp->set_leases(s.leases);
    resp->set_models(s.models);
    resp->set_lookup_hits(m.lookup_hit_blocks.load());
    resp->set_lookup_misses(m.lookup_miss_calls.load());
    resp->set_evicted_blocks(m.evictions_block.load());
    resp->set_demoted_forms(m.evictions_demote.load());
    resp->set_pool_epoch(ctx_.pool_epoch);
    resp->set_pool_pid(static_cast<uint32_t>(::getpid()));
    return grpc::Status::OK;
  }

 private:
  // Runs `impl`, records its wall time in the `latency` histogram and maps its status.
  template <typename Histogram, typename Impl>
  grpc::Status Timed(Histogram& latency, Impl&& impl) {
    const absl::Time start = absl::Now();
    absl::Status s = impl();
    latency.Observe(absl::ToDoubleSeconds(absl::Now() - start));
    return Finish(s);
  }

  grpc::Status Finish(const absl::Status& s) {
    if (!s.ok()) {
      store_.metrics().grpc_errors.fetch_add(1, std::memory_order_relaxed);
      KVPOOL_LOG_DEBUG("rpc failed: {}", s.ToString());
    }
    return ToGrpc(s);
  }

  absl::Status RegisterImpl(const pb::RegisterModelRequest& req, pb::RegisterModelResponse* resp) {
    ModelSpec spec;
    spec.tenant = req.identity().tenant();
    spec.model_id = req.identity().model_id();
    spec.revision = req.identity().revision();
    if (req.has_tensor_parallel()) {
      spec.tensor_parallel =
          TensorParallelShard{req.tensor_parallel().rank(), req.tensor_parallel().size()};
    }
    if (req.checksum_scheme() != kChecksumScheme) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checksum_scheme: this pool uses ", kChecksumScheme,
          " (chunked form checksums, protocol v1.3, docs/BLOCK_FORMAT.md \"Checksums\"); the "
          "client sent ",
          req.checksum_scheme(),
          req.checksum_scheme() == 0
              ? " (unset: a client from before v1.4; those before v1.3 hash whole forms)"
              : "",
          ": deploy clients and pool of the same version"));
    }
    if (req.geometry().dtype() != pb::KV_DTYPE_BF16) {
      return absl::InvalidArgumentError("geometry.dtype: only KV_DTYPE_BF16 is supported");
    }
    spec.geometry.num_layers = req.geometry().num_layers();
    spec.geometry.num_kv_heads = req.geometry().num_kv_heads();
    spec.geometry.head_dim = req.geometry().head_dim();
    spec.geometry.page_size = req.page_size();
    spec.sink_tokens = req.recipe().sink_tokens();
    spec.recent_tokens = req.recipe().recent_tokens();
    spec.clip_ratio_k = req.recipe().clip_ratio_k();
    spec.clip_ratio_v = req.recipe().clip_ratio_v();
    switch (req.recipe().history_precision()) {
      case pb::HISTORY_PRECISION_INT2:
        spec.history_precision = HistoryPrecision::kInt2;
        break;
      case pb::HISTORY_PRECISION_BF16:
        spec.history_precision = HistoryPrecision::kBf16;
        break;
      default:
        return absl::InvalidArgumentError(
            "recipe.history_precision: must be HISTORY_PRECISION_INT2 or HISTORY_PRECISION_BF16");
    }
    spec.block_format_version = req.recipe().block_format_version();
    RotationInput rot;
    switch (req.rotation_case()) {
      case pb::RegisterModelRequest::kRotationFile:
        if (req.rotation_file().empty()) {
          return absl::InvalidArgumentError("rotation_file: empty");
        }
        rot.file_bytes = req.rotation_file();
        break;
      case pb::RegisterModelRequest::kRotationPath: {
        KVPOOL_ASSIGN_OR_RETURN(const std::string readable,
                                ResolveRotationPath(ctx_.rotation_dir, req.rotation_path()));
        KVPOOL_ASSIGN_OR_RETURN(rot.file_bytes, ReadRotationPath(readable));
        rot.field = absl::StrCat("rotation_path ", QuotedPath(req.rotation_path()));
        rot.redact_file_content = true;
        break;
      }
      case pb::RegisterModelRequest::kRotationId: {
        auto id = DigestFromBytes(req.rotation_id(), "rotation_id");
        if (!id.ok()) {
          return id.status();
        }
        rot.id = *id;
        break;
      }
      default:
        break;  // the store names the missing field
    }
    auto info = store_.RegisterModel(spec, rot);
    if (!info.ok()) {
      return info.status();
    }
    resp->set_namespace_id(DigestBytes(info->namespace_id));
    resp->set_rotation_id(DigestBytes(info->rotation_id));
    resp->set_created(info->created);
    // When the pool initiates transfers, clients never connect to its worker nor address its
    // memory (client/ uses neither on that path): its worker address and keys stay private
    // (docs/OPERATIONS.md "Trust model").
    if (!ctx_.pool_initiates_transfers) {
      resp->set_ucx_worker_address(ctx_.ucx_worker_address);
    }
    resp->set_pool_initiates_transfers(ctx_.pool_initiates_transfers);
    if (!ctx_.pool_initiates_transfers && !store_.memory().packed_rkey().empty()) {
      resp->set_arena_rkey(store_.memory().packed_rkey());
      resp->set_arena_address(store_.memory().remote_address());
      resp->set_arena_bytes(store_.memory().size());
    }
    resp->set_pool_epoch(ctx_.pool_epoch);
    resp->set_bf16_form_bytes(info->bf16_form_bytes);
    resp->set_int2_form_bytes(info->int2_form_bytes);
    resp->set_sink_blocks(info->sink_blocks);
    resp->set_recent_blocks(info->recent_blocks);
    resp->set_checksum_scheme(kChecksumScheme);
    for (const OtherRevision& o : info->other_revisions) {
      pb::OtherRevision* r = resp->add_other_revisions();
      r->set_revision(o.revision);
      r->set_rotation_id(DigestBytes(o.rotation_id));
      r->set_blocks(o.blocks);
    }
    return absl::OkStatus();
  }

  // Whether the caller of `context` has given up on the call (cancelled it, or its deadline has
  // passed): an answer would reach no one.
  static bool CallerGone(grpc::ServerContext* context) {
    return context != nullptr &&
           (context->IsCancelled() || absl::Now() >= absl::FromChrono(context->deadline()));
  }

  absl::Status BeginPutImpl(const pb::BeginPutRequest& req, pb::BeginPutResponse* resp,
                            grpc::ServerContext* context) {
    // A BeginPut handled after its caller gave up (a pool resumed from SIGSTOP reads the calls
    // queued meanwhile) opened a put that no one knows the id of, holding its staging until
    // the put timeout (newcomer s10b F2: a stopped worker's pool went from 2 to 4 open puts
    // once resumed). Such a call opens nothing, and a put opened while its caller gave up is
    // aborted at once. Best effort: the pool sees a cancel only once it has read it (a resumed
    // pool reads the call and the client's cancel together, and the handler may run first), and
    // it counts a deadline from when it read the call; a put it opens then, or whose caller
    // gives up after the answer left, waits for its put timeout. Measured: a BeginPut given up
    // on at a SIGSTOPped pool opened no put in 7 of 10 runs once the pool resumed (before: 0 of
    // 2). The rest is closed by put tags (v1.8, below): the client aborts a BeginPut it gave up
    // on by the tag it sent (newcomer 17 F3).
    if (CallerGone(context)) {
      return absl::DeadlineExceededError(
          "BeginPut: the caller had given up on the call (cancelled, or past its deadline) when "
          "the pool handled it; no put was opened");
    }
    auto ns = ParseNamespace(req.namespace_id());
    if (!ns.ok()) {
      return ns.status();
    }
    // Protocol v1.8: a tagged put can be aborted by its tag (AbortPutRequest.put_tag) by a
    // caller that gave up on this call, which closes what the checks above cannot see.
    std::string tag_key;
    if (!req.put_tag().empty()) {
      KVPOOL_RETURN_IF_ERROR(CheckPutTag(req.put_tag()));
      tag_key = TagKey(req.namespace_id(), req.put_tag());
      KVPOOL_RETURN_IF_ERROR(ClaimTag(tag_key));
    }
    auto plan =
        store_.BeginPut(*ns, absl::MakeConstSpan(req.token_ids().data(), req.token_ids().size()),
                        req.num_blocks(), absl::Milliseconds(req.timeout_ms()));
    if (!plan.ok()) {
      if (!tag_key.empty()) ReleaseTag(tag_key);
      return plan.status();
    }
    if (!tag_key.empty() && !BindTag(tag_key, plan->put_id, plan->timeout)) {
      (void)store_.AbortPut(*ns, plan->put_id);
      return absl::AbortedError(
          "BeginPut: an AbortPut named this put's put_tag while the pool opened it; it was "
          "aborted");
    }
    if (CallerGone(context)) {
      (void)store_.AbortPut(*ns, plan->put_id);
      if (!tag_key.empty()) ReleaseTag(tag_key);
      return absl::DeadlineExceededError(
          "BeginPut: the caller gave up on the call (cancelled, or past its deadline) while the "
          "pool opened the put; it was aborted");
    }
    const uint64_t base = store_.memory().remote_address();
    const std::string& rkey = store_.memory().packed_rkey();
    resp->set_put_id(plan->put_id);
    resp->set_timeout_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(plan->timeout)));
    resp->set_pool_epoch(ctx_.pool_epoch);
    for (const PutBlockPlan& b : plan->blocks) {
      pb::PutBlock* pbk = resp->add_blocks();
      pbk->set_index(b.index);
      pbk->set_key(DigestBytes(b.key));
      pbk->set_action(b.action == PutAction::kWrite ? pb::PUT_BLOCK_ACTION_WRITE
                                                    : pb::PUT_BLOCK_ACTION_SKIP);
      if (b.action == PutAction::kWrite) {
        // Pool-initiated: the client names blocks by index in WritePut and never addresses the
        // staging itself, so neither its address nor the arena's key is handed out.
        if (!ctx_.pool_initiates_transfers) {
          pbk->set_staging_addr(base + b.staging_offset);
          pbk->set_rkey(rkey);
        }
        pbk->set_size(b.size);
      }
      for (FormKind f : b.forms_held) {
        pbk->add_forms_held(ToProto(f));
      }
      for (FormKind f : b.forms_added) {
        pbk->add_forms_added(ToProto(f));
      }
    }
    return absl::OkStatus();
  }

  absl::Status CommitImpl(const pb::CommitPutRequest& req, pb::CommitPutResponse* resp) {
    auto ns = ParseNamespace(req.namespace_id());
    if (!ns.ok()) {
      return ns.status();
    }
    std::vector<BlockChecksum> sums;
    sums.reserve(req.checksums_size());
    for (const auto& c : req.checksums()) {
      sums.push_back({c.index(), c.xxh3()});
    }
    auto r = store_.CommitPut(*ns, req.put_id(), sums);
    if (!r.ok()) {
      return r.status();
    }
    ForgetPutTag(req.put_id());
    for (const CommittedBlock& b : r->blocks) {
      pb::CommittedBlock* cb = resp->add_blocks();
      cb->set_index(b.index);
      cb->set_key(DigestBytes(b.key));
      for (FormKind f : b.forms) {
        cb->add_forms(ToProto(f));
      }
    }
    resp->set_bytes_ingested(r->bytes_ingested);
    return absl::OkStatus();
  }

  absl::Status LookupImpl(const pb::LookupRequest& req, pb::LookupResponse* resp) {
    auto ns = ParseNamespace(req.namespace_id());
    if (!ns.ok()) {
      return ns.status();
    }
    auto q = ParseQuery(req.token_ids(), req.keys());
    if (!q.ok()) {
      return q.status();
    }
    auto r = store_.Lookup(*ns, *q);
    if (!r.ok()) {
      return r.status();
    }
    resp->set_num_blocks(static_cast<uint32_t>(r->size()));
    for (const BlockFormsInfo& b : *r) {
      pb::BlockForms* bf = resp->add_blocks();
      bf->set_key(DigestBytes(b.key));
      bf->set_sink(b.sink);
      for (FormKind f : b.forms) {
        bf->add_forms(ToProto(f));
      }
    }
    return absl::OkStatus();
  }

  absl::Status AcquireImpl(const pb::AcquireRequest& req, pb::AcquireResponse* resp) {
    auto ns = ParseNamespace(req.namespace_id());
    if (!ns.ok()) {
      return ns.status();
    }
    auto q = ParseQuery(req.token_ids(), req.keys());
    if (!q.ok()) {
      return q.status();
    }
    auto g = store_.Acquire(*ns, *q, req.max_blocks(), absl::Milliseconds(req.lease_ms()));
    if (!g.ok()) {
      return g.status();
    }
    const uint64_t base = store_.memory().remote_address();
    const std::string& rkey = store_.memory().packed_rkey();
    resp->set_lease_id(g->lease_id);
    resp->set_num_blocks(static_cast<uint32_t>(g->blocks.size()));
    resp->set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(g->lifetime)));
    resp->set_pool_epoch(ctx_.pool_epoch);
    for (const LeasedBlock& b : g->blocks) {
      pb::LeasedBlock* lb = resp->add_blocks();
      lb->set_index(b.index);
      lb->set_key(DigestBytes(b.key));
      lb->set_sink(b.sink);
      for (const FormLocation& f : b.forms) {
        pb::FormLocation* fl = lb->add_forms();
        fl->set_form(ToProto(f.form));
        // remote_addr names the form in ReadLeased, so it is sent in both modes; the arena's key
        // only to clients that address the pool's memory themselves.
        fl->set_remote_addr(base + f.offset);
        if (!ctx_.pool_initiates_transfers) fl->set_rkey(rkey);
        fl->set_size(f.size);
        fl->set_generation(f.generation);
        fl->set_xxh3(f.xxh3);
      }
    }
    return absl::OkStatus();
  }

  absl::Status ReportCorruptImpl(const pb::ReportCorruptRequest& req, const std::string& client,
                                 pb::ReportCorruptResponse* resp) {
    KVPOOL_ASSIGN_OR_RETURN(Digest ns, ParseNamespace(req.namespace_id()));
    if (req.reports_size() > static_cast<int>(kMaxCorruptionReports)) {
      return absl::InvalidArgumentError(absl::StrCat("reports: ", req.reports_size(),
                                                     " in one call, at most ",
                                                     kMaxCorruptionReports, " are accepted"));
    }
    // A malformed report refuses the whole call (as a malformed key does in Delete): nothing is
    // re-verified or dropped.
    std::vector<CorruptionReport> reports;
    for (int i = 0; i < req.reports_size(); ++i) {
      const pb::CorruptFormReport& r = req.reports(i);
      KVPOOL_ASSIGN_OR_RETURN(Digest key,
                              DigestFromBytes(r.key(), absl::StrCat("reports[", i, "].key")));
      if (r.form() != pb::FORM_BF16 && r.form() != pb::FORM_INT2) {
        return absl::InvalidArgumentError(
            absl::StrCat("reports[", i, "].form: must be FORM_BF16 or FORM_INT2, got ", r.form()));
      }
      reports.push_back({.key = key,
                         .form = r.form() == pb::FORM_BF16 ? FormKind::kBf16 : FormKind::kInt2,
                         .generation = r.generation(),
                         .observed_xxh3 = r.observed_xxh3()});
    }
    KVPOOL_ASSIGN_OR_RETURN(std::vector<CorruptionOutcome> outcomes,
                            store_.ReportCorrupt(ns, reports, client));
    for (const CorruptionOutcome& o : outcomes) {
      pb::CorruptFormResult* out = resp->add_results();
      out->mutable_status()->set_code(static_cast<int32_t>(o.status.code()));
      out->mutable_status()->set_message(std::string(o.status.message()));
      out->set_block_held(o.block_held);  // for a refused report too: it changed nothing
      if (!o.status.ok()) continue;
      out->set_verdict(o.verdict == CorruptionVerdict::kDropped ? pb::CORRUPTION_VERDICT_DROPPED
                                                                : pb::CORRUPTION_VERDICT_INTACT);
      out->set_bytes_freed(o.bytes_freed);
    }
    return absl::OkStatus();
  }

  absl::Status NotInitiating(const char* rpc) const {
    return absl::FailedPreconditionError(
        absl::StrCat(rpc,
                     ": this pool does not initiate transfers (RegisterModelResponse."
                     "pool_initiates_transfers is false); address its memory directly"));
  }

  // Refuses a client worker address that is the pool's own: the pool would connect to itself
  // and its own worker would serve the "client's" side of the RMA against the pool's memory
  // (UCX's software RMA over tcp/shm checks no key), writing or reading any address in this
  // process. Caught: the address byte for byte, and any address whose UCX payload carries the
  // pool worker's 64-bit uuid (a re-packed or re-sealed copy). Not caught: an address crafted
  // with another uuid that reaches the same worker (docs/OPERATIONS.md "Trust model").
  // INVALID_ARGUMENT naming client_worker_address.
  absl::Status CheckClientWorker(const std::string& address) const {
    if (address.empty()) {
      return absl::InvalidArgumentError(
          "client_worker_address: empty (the client's own UCX worker address is required)");
    }
#if defined(KVPOOL_HAVE_TRANSPORT)
    const bool own = !ctx_.ucx_worker_address.empty() &&
                     transport::SameUcxWorker(address, ctx_.ucx_worker_address);
#else
    const bool own = !ctx_.ucx_worker_address.empty() && address == ctx_.ucx_worker_address;
#endif
    if (own) {
      return absl::InvalidArgumentError(
          "client_worker_address: is this pool's own UCX worker; send the client's worker "
          "address");
    }
    return absl::OkStatus();
  }

#if defined(KVPOOL_HAVE_TRANSPORT)
  // Waits for `t` until it finishes, `deadline` passes (DEADLINE_EXCEEDED) or the call is
  // cancelled (CANCELLED: the client went away, or the server's drain deadline passed at
  // shutdown; checked every 100 ms). Then aborts it — UCX force-closes the connection of a
  // transfer still in flight, which completes its requests — and waits until the transport
  // has let go of it, however long that takes: the caller releases the memory the transfer
  // writes (a put's staging) only after this returns, so nothing is freed while UCX may still
  // write. A peer that stopped answering (SIGSTOP) used to keep the transfer, the put's staging
  // and, at shutdown, the whole drain waiting for minutes, and then crash ucp_worker_destroy.
  // `what` names the transfer and `bound` what set its deadline, for the messages: a client
  // saw only "transfer still in progress at its deadline".
  // `cause`: why a transfer that ran out of time did so, when the caller knows better than
  // "the client stopped answering" (empty: that default).
  absl::Status WaitTransfer(const std::shared_ptr<transport::Transfer>& t, absl::Time deadline,
                            grpc::ServerContext* call, const char* what, const char* bound,
                            const std::string& cause = {}) {
    absl::Status s;
    while (true) {
      s = t->Wait(std::min(deadline, absl::Now() + absl::Milliseconds(100)));
      if (!absl::IsDeadlineExceeded(s)) return s;
      if (absl::Now() >= deadline) {
        s = absl::DeadlineExceededError(absl::StrCat(
            what, " did not finish by ", bound,
            ", so the pool aborted it (its UCX connection to client_worker_address is closed): ",
            cause.empty() ? "the client process stopped answering UCX (stopped, hung or "
                            "overloaded) or its network is down"
                          : cause));
        break;
      }
      if (call != nullptr && call->IsCancelled()) {
        s = absl::CancelledError(absl::StrCat(
            what,
            " was aborted because its call was cancelled (the client went away, or the pool is "
            "shutting down and its drain time, --drain-ms, ran out)"));
        break;
      }
    }
    ctx_.transport->Abort(t);
    for (int waited_s = 10;; waited_s += 10) {
      if (!absl::IsDeadlineExceeded(t->Wait(absl::Now() + absl::Seconds(10)))) return s;
      KVPOOL_LOG_WARN(
          "a pool-initiated transfer is still in flight {} s after it was aborted; its memory "
          "stays claimed until it finishes",
          waited_s);
    }
  }
#endif

  absl::Status WritePutImpl(const pb::WritePutRequest& req, pb::WritePutResponse* resp,
                            absl::Time deadline, grpc::ServerContext* call) {
#if defined(KVPOOL_HAVE_TRANSPORT)
    if (!ctx_.pool_initiates_transfers || ctx_.transport == nullptr || ctx_.arena == nullptr) {
      return NotInitiating("WritePut");
    }
    KVPOOL_ASSIGN_OR_RETURN(Digest ns, ParseNamespace(req.namespace_id()));
    if (req.sources().empty()) return absl::InvalidArgumentError("sources: empty");
    // The pull is bounded by the put's own deadline too: a put whose pulls cannot finish (the
    // client hangs) is aborted and reclaimed at its timeout, not pinned by this claim.
    absl::Duration put_left;
    KVPOOL_ASSIGN_OR_RETURN(std::vector<StagingRange> ranges,
                            store_.BeginPutWrite(ns, req.put_id(), &put_left));
    // A put timeout shorter than the pull itself (newcomer 13b F8: kvpool-worker
    // --put-timeout-ms 1 read as a client that stopped answering UCX) is named as such.
    std::string cause;
    if (absl::Now() + put_left < deadline) {
      deadline = absl::Now() + put_left;
      cause = absl::StrCat("the put's timeout ran out first (", absl::ToInt64Milliseconds(put_left),
                           " ms of it were left when this pull began): the put's timeout is "
                           "shorter than writing and committing the put takes (ask for a longer "
                           "one), or the client stopped answering UCX within it");
    }
    struct Claim {
      BlockStore& store;
      uint64_t put_id;
      ~Claim() { store.EndPutWrite(put_id); }
    } claim{store_, req.put_id()};
    std::map<uint32_t, const StagingRange*> by_index;
    for (const StagingRange& r : ranges) by_index[r.index] = &r;
    std::vector<transport::TransferOp> ops;
    uint64_t total = 0;
    for (int i = 0; i < req.sources_size(); ++i) {
      const pb::PutSource& src = req.sources(i);
      auto it = by_index.find(src.index());
      if (it == by_index.end()) {
        return absl::InvalidArgumentError(absl::StrCat("sources[", i, "].index: ", src.index(),
                                                       " is not a WRITE block of this put"));
      }
      if (src.length() == 0) {
        return absl::InvalidArgumentError(absl::StrCat("sources[", i, "].length: zero"));
      }
      if (src.offset() > it->second->size || src.length() > it->second->size - src.offset()) {
        return absl::InvalidArgumentError(
            absl::StrCat("sources[", i, "].length: [", src.offset(), ", +", src.length(),
                         ") exceeds the block's staging size ", it->second->size));
      }
      ops.push_back({it->second->offset + src.offset(), src.source_addr(), src.length()});
      total += src.length();
    }
    KVPOOL_RETURN_IF_ERROR(CheckClientWorker(req.client_worker_address()));
    KVPOOL_ASSIGN_OR_RETURN(PeerLinks::Link link,
                            peers_.Get(req.client_worker_address(), req.source_rkey(),
                                       "client_worker_address", "source_rkey"));
    // Whole blocks adjacent in staging and in the client's buffer move as one get.
    KVPOOL_ASSIGN_OR_RETURN(
        auto t, ctx_.transport->Prepare({transport::TransferKind::kGet, link.peer->endpoint,
                                         link.key, ctx_.arena, transport::CoalesceOps(ops)}));
    KVPOOL_RETURN_IF_ERROR(ctx_.transport->Post(t));
    KVPOOL_RETURN_IF_ERROR(WaitTransfer(
        t, deadline, call, "WritePut: the pool's pull of this put from the client's memory",
        "the earlier of the call's deadline and the put's timeout (BeginPutRequest.timeout_ms, "
        "else kvpool-server --put-timeout-ms; the put is then dropped: begin it again)",
        cause));
    resp->set_bytes_written(total);
    return absl::OkStatus();
#else
    (void)req;
    (void)resp;
    (void)deadline;
    (void)call;
    return NotInitiating("WritePut");
#endif
  }

  absl::Status ReadLeasedImpl(const pb::ReadLeasedRequest& req, pb::ReadLeasedResponse* resp,
                              absl::Time deadline, grpc::ServerContext* call) {
#if defined(KVPOOL_HAVE_TRANSPORT)
    if (!ctx_.pool_initiates_transfers || ctx_.transport == nullptr || ctx_.arena == nullptr) {
      return NotInitiating("ReadLeased");
    }
    if (req.reads().empty()) return absl::InvalidArgumentError("reads: empty");
    KVPOOL_RETURN_IF_ERROR(CheckClientWorker(req.client_worker_address()));
    std::vector<std::pair<uint64_t, uint64_t>> dropped;  // found corrupt since the Acquire
    KVPOOL_ASSIGN_OR_RETURN(auto leased, store_.LeasedRanges(req.lease_id(), &dropped));
    const uint64_t base = store_.memory().remote_address();
    std::vector<absl::Status> results(req.reads_size());
    // One transfer per destination key (normally one or two: the caller's page pools).
    struct Group {
      std::vector<transport::TransferOp> ops;
      std::vector<int> reads;
      std::vector<size_t> carrier;  // per op: the merged op that moves it (CoalesceOps)
    };
    std::map<std::string, Group> groups;
    for (int i = 0; i < req.reads_size(); ++i) {
      const pb::LeasedRead& r = req.reads(i);
      const uint64_t off = r.remote_addr() - base;
      const bool held =
          r.remote_addr() >= base &&
          std::binary_search(leased.begin(), leased.end(), std::make_pair(off, r.size()));
      if (!held) {
        const bool was_dropped =
            r.remote_addr() >= base &&
            std::binary_search(dropped.begin(), dropped.end(), std::make_pair(off, r.size()));
        results[i] =
            was_dropped
                ? absl::DataLossError(absl::StrCat(
                      "reads[", i,
                      "]: the pool found this form corrupt (a reader reported it and the stored "
                      "bytes failed their checksum) and dropped it; re-acquire, and put the "
                      "block again"))
                : absl::NotFoundError(
                      absl::StrCat("reads[", i, "]: not a form held by lease ", req.lease_id()));
        continue;
      }
      Group& g = groups[r.dest_rkey()];
      g.ops.push_back({off, r.dest_addr(), r.size()});
      g.reads.push_back(i);
    }
    std::vector<std::pair<std::shared_ptr<transport::Transfer>, const Group*>> posted;
    std::vector<PeerLinks::Link> links;  // endpoints and keys stay alive until the waits below
    for (auto& [rkey, g] : groups) {
      auto fail = [&](const absl::Status& s) {
        for (int i : g.reads) results[i] = s;
      };
      auto link =
          peers_.Get(req.client_worker_address(), rkey, "client_worker_address", "reads.dest_rkey");
      if (!link.ok()) {
        if (absl::IsInvalidArgument(link.status())) return link.status();
        fail(link.status());
        continue;
      }
      // Forms adjacent in the arena going to adjacent destinations move as one put.
      auto t =
          ctx_.transport->Prepare({transport::TransferKind::kPut, link->peer->endpoint, link->key,
                                   ctx_.arena, transport::CoalesceOps(g.ops, &g.carrier),
                                   /*flush=*/true});
      if (!t.ok()) {
        fail(t.status());
        continue;
      }
      if (absl::Status s = ctx_.transport->Post(*t); !s.ok()) {
        fail(s);
        continue;
      }
      links.push_back(*std::move(link));
      posted.emplace_back(*t, &g);
    }
    for (auto& [t, g] : posted) {
      absl::Status s =
          WaitTransfer(t, deadline, call,
                       "ReadLeased: the pool's write of leased forms into the client's memory",
                       "the call's deadline");
      std::vector<absl::Status> items = t->item_status();
      for (size_t k = 0; k < g->reads.size(); ++k) {
        const int i = g->reads[k];
        const size_t op = g->carrier[k];
        results[i] = !s.ok() ? s : (op < items.size() ? items[op] : absl::OkStatus());
      }
    }
    // A lease that ended while the bytes moved may have had its slots reused: fail closed.
    if (!store_.LeasedRanges(req.lease_id()).ok()) {
      for (auto& r : results) {
        if (r.ok()) {
          r = absl::FailedPreconditionError("lease: expired during the read; discard the bytes");
        }
      }
    }
    uint64_t moved = 0;
    for (int i = 0; i < req.reads_size(); ++i) {
      const absl::Status& r = results[i];
      if (r.ok()) moved += req.reads(i).size();
      pb::ItemStatus* st = resp->add_results();
      st->set_code(static_cast<int32_t>(r.code()));
      st->set_message(std::string(r.message()));
    }
    store_.metrics().read_leased_bytes.fetch_add(moved, std::memory_order_relaxed);
    return absl::OkStatus();
#else
    (void)req;
    (void)resp;
    (void)deadline;
    (void)call;
    return NotInitiating("ReadLeased");
#endif
  }

  // ---- put tags (protocol v1.8, BeginPutRequest.put_tag / AbortPutRequest.put_tag) ----
  // A tag's state: claimed by a BeginPut that is opening its put (put_id 0), bound to the open
  // put, or aborted (an AbortPut named it: a BeginPut with it is refused). Entries expire (a
  // bound one at its put's deadline, when the store has committed or reclaimed the put; an
  // aborted one after ctx_.tag_tombstone_life) and are swept when the table has doubled.
  struct TagState {
    uint64_t put_id = 0;
    bool aborted = false;
    absl::Time expires;
  };
  static constexpr size_t kMaxPutTagBytes = 64;

  static absl::Status CheckPutTag(const std::string& tag) {
    if (tag.size() > kMaxPutTagBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("put_tag: ", tag.size(), " bytes, at most ", kMaxPutTagBytes));
    }
    return absl::OkStatus();
  }
  static std::string TagKey(const std::string& namespace_id, const std::string& tag) {
    return absl::StrCat(namespace_id, tag);  // the namespace digest is always 32 bytes
  }
  void SweepTagsLocked(absl::Time now) {
    if (tags_.size() < tags_sweep_at_) return;
    for (auto it = tags_.begin(); it != tags_.end();) {
      if (it->second.expires > now) {
        ++it;
        continue;
      }
      if (it->second.put_id != 0) tag_of_put_.erase(it->second.put_id);
      it = tags_.erase(it);
    }
    tags_sweep_at_ = std::max<size_t>(1024, 2 * tags_.size());
  }
  // BeginPut: takes the tag for the put about to be opened.
  absl::Status ClaimTag(const std::string& key) {
    const absl::Time now = absl::Now();
    std::lock_guard<std::mutex> lock(tags_mu_);
    SweepTagsLocked(now);
    auto [it, fresh] = tags_.try_emplace(key);
    if (!fresh && it->second.expires > now) {
      if (it->second.aborted) {
        return absl::AbortedError(
            "BeginPut: an AbortPut named this put_tag before the pool handled the call; no put "
            "was opened");
      }
      return absl::InvalidArgumentError(absl::StrCat("put_tag: already names ",
                                                     it->second.put_id != 0
                                                         ? absl::StrCat("put ", it->second.put_id)
                                                         : std::string("a put being opened"),
                                                     " of this namespace (a tag names one put)"));
    }
    it->second = TagState{0, false, now + ctx_.tag_tombstone_life};
    return absl::OkStatus();
  }
  // BeginPut: the put is open; false when an AbortPut named the tag meanwhile.
  bool BindTag(const std::string& key, uint64_t put_id, absl::Duration timeout) {
    std::lock_guard<std::mutex> lock(tags_mu_);
    auto it = tags_.find(key);
    if (it == tags_.end() || it->second.aborted) return false;
    it->second.put_id = put_id;
    it->second.expires = absl::Now() + timeout + absl::Seconds(1);
    tag_of_put_[put_id] = key;
    return true;
  }
  // A put committed or aborted by its id: its tag is dropped at once (else it waits for the
  // sweep after its put deadline), so the table holds about the open puts.
  void ForgetPutTag(uint64_t put_id) {
    std::lock_guard<std::mutex> lock(tags_mu_);
    auto p = tag_of_put_.find(put_id);
    if (p == tag_of_put_.end()) return;
    auto it = tags_.find(p->second);
    if (it != tags_.end() && !it->second.aborted && it->second.put_id == put_id) tags_.erase(it);
    tag_of_put_.erase(p);
  }
  // BeginPut: no put was opened (or it was aborted); the tag is free unless aborted.
  void ReleaseTag(const std::string& key) {
    std::lock_guard<std::mutex> lock(tags_mu_);
    auto it = tags_.find(key);
    if (it == tags_.end() || it->second.aborted) return;
    if (it->second.put_id != 0) tag_of_put_.erase(it->second.put_id);
    tags_.erase(it);
  }
  // AbortPut by tag: aborts the bound put, or marks the tag so that its BeginPut opens nothing.
  absl::Status AbortTagged(const Digest& ns, const std::string& key) {
    uint64_t put_id = 0;
    {
      const absl::Time now = absl::Now();
      std::lock_guard<std::mutex> lock(tags_mu_);
      SweepTagsLocked(now);
      TagState& t = tags_[key];
      if (t.expires > now && !t.aborted) put_id = t.put_id;
      if (t.put_id != 0) tag_of_put_.erase(t.put_id);
      t = TagState{0, true, now + ctx_.tag_tombstone_life};
    }
    if (put_id == 0) return absl::OkStatus();  // not opened yet: its BeginPut will be refused
    return store_.AbortPut(ns, put_id);
  }

  ServiceContext ctx_;
  BlockStore& store_;
#if defined(KVPOOL_HAVE_TRANSPORT)
  PeerLinks peers_;
#endif
  std::mutex tags_mu_;
  std::unordered_map<std::string, TagState> tags_;        // TagKey -> state
  std::unordered_map<uint64_t, std::string> tag_of_put_;  // bound put_id -> its TagKey
  size_t tags_sweep_at_ = 1024;
};

}  // namespace

std::string ReportClientIdentity(const std::string& peer) {
  for (absl::string_view scheme : {"ipv4:", "ipv6:"}) {
    if (!absl::StartsWith(peer, scheme)) continue;
    const absl::string_view address = absl::string_view(peer).substr(scheme.size());
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos || colon == 0) return peer;
    return std::string(address.substr(0, colon));
  }
  return peer;
}

std::unique_ptr<grpc::Service> MakeKvPoolService(const ServiceContext& ctx) {
  return std::make_unique<KvPoolService>(ctx);
}

}  // namespace kvpool::kvstore
