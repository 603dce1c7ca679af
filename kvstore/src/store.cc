// The block store (store.h).
#include "kvpool/kvstore/store.h"

#include <openssl/err.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvpool/common/checksum.h"
#include "kvpool/common/log.h"
#include "kvpool/common/room_shortage.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/quantize.h"
#include "kvpool/kernels/rotation_file.h"

namespace kvpool::kvstore {
namespace {

// How much of a commit's new forms is demoted to the shared cache after they are written: about
// one core's L2 (2 MiB on the benchmark host); what was written before that has left the L2
// already. DemoteToSharedCache costs ~3-7 ns per line.
constexpr uint64_t kDemoteTailBytes = uint64_t{2} << 20;

std::string IdentityKey(const ModelSpec& s) {
  std::string tp = s.tensor_parallel.has_value()
                       ? absl::StrCat(s.tensor_parallel->rank, "/", s.tensor_parallel->size)
                       : "canonical";
  return absl::StrCat(s.tenant.size(), ":", s.tenant, s.model_id.size(), ":", s.model_id,
                      s.revision.size(), ":", s.revision, tp);
}

const char* PrecisionName(HistoryPrecision p) {
  return p == HistoryPrecision::kInt2 ? "int2" : "bf16";
}

// 1..kMaxIdentityBytes printable ASCII bytes (the message never repeats the value: it may be
// megabytes of anything).
absl::Status ValidateIdentityString(const std::string& v, const char* field) {
  if (v.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": must not be empty"));
  }
  if (v.size() > kMaxIdentityBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", v.size(), " bytes, at most ",
                                                   kMaxIdentityBytes, " are accepted"));
  }
  if (const size_t i = FirstNonPrintableAscii(v); i != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": byte ", i, " is not printable ASCII (0x20..0x7e)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSpec(const ModelSpec& s) {
  const BlockGeometry& g = s.geometry;
  KVPOOL_RETURN_IF_ERROR(ValidateIdentityString(s.tenant, "identity.tenant"));
  KVPOOL_RETURN_IF_ERROR(ValidateIdentityString(s.model_id, "identity.model_id"));
  // An empty revision was accepted ("default/m@") while an empty model_id was not (newcomer
  // s7 F4): every identity string is 1..kMaxIdentityBytes printable bytes.
  KVPOOL_RETURN_IF_ERROR(ValidateIdentityString(s.revision, "identity.revision"));
  if (g.num_layers == 0 || g.num_layers > kMaxLayersOrHeads) {
    return absl::InvalidArgumentError(absl::StrCat("geometry.num_layers: must be in 1..",
                                                   kMaxLayersOrHeads, ", got ", g.num_layers));
  }
  if (g.num_kv_heads == 0 || g.num_kv_heads > kMaxLayersOrHeads) {
    return absl::InvalidArgumentError(absl::StrCat("geometry.num_kv_heads: must be in 1..",
                                                   kMaxLayersOrHeads, ", got ", g.num_kv_heads));
  }
  KVPOOL_RETURN_IF_ERROR(ValidateHeadDim(g.head_dim, "geometry.head_dim"));
  if (g.page_size == 0 || (g.page_size & (g.page_size - 1)) != 0 || g.page_size > kMaxPageSize) {
    return absl::InvalidArgumentError(absl::StrCat("page_size: must be a power of two in 1..",
                                                   kMaxPageSize, ", got ", g.page_size));
  }
  if (s.sink_tokens > kMaxRecipeTokens) {
    return absl::InvalidArgumentError(absl::StrCat("recipe.sink_tokens: ", s.sink_tokens,
                                                   " exceeds the maximum ", kMaxRecipeTokens));
  }
  if (s.recent_tokens > kMaxRecipeTokens) {
    return absl::InvalidArgumentError(absl::StrCat("recipe.recent_tokens: ", s.recent_tokens,
                                                   " exceeds the maximum ", kMaxRecipeTokens));
  }
  if (s.sink_tokens % g.page_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "recipe.sink_tokens: ", s.sink_tokens, " is not a multiple of page_size ", g.page_size));
  }
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(s.clip_ratio_k, "recipe.clip_ratio_k"));
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(s.clip_ratio_v, "recipe.clip_ratio_v"));
  if (s.block_format_version != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe.block_format_version: only 1 (kvpool-block-v1) is supported, got ",
                     s.block_format_version));
  }
  if (s.tensor_parallel.has_value() && s.tensor_parallel->size > kMaxTensorParallel) {
    return absl::InvalidArgumentError(absl::StrCat("tensor_parallel.size: must be at most ",
                                                   kMaxTensorParallel, ", got ",
                                                   s.tensor_parallel->size));
  }
  if (s.tensor_parallel.has_value() && s.tensor_parallel->rank >= s.tensor_parallel->size) {
    return absl::InvalidArgumentError("tensor_parallel.rank: must be < tensor_parallel.size");
  }
  return absl::OkStatus();
}

// Every differing field of two registrations with the same identity, "field (registered X,
// requested Y)".
std::vector<std::string> DiffSpecs(const ModelSpec& a, const Digest& rot_a, const ModelSpec& b,
                                   const Digest& rot_b) {
  std::vector<std::string> d;
  auto cmp = [&d](const char* field, auto x, auto y) {
    if (x != y) {
      d.push_back(absl::StrCat(field, " (registered ", x, ", requested ", y, ")"));
    }
  };
  cmp("geometry.num_layers", a.geometry.num_layers, b.geometry.num_layers);
  cmp("geometry.num_kv_heads", a.geometry.num_kv_heads, b.geometry.num_kv_heads);
  cmp("geometry.head_dim", a.geometry.head_dim, b.geometry.head_dim);
  cmp("page_size", a.geometry.page_size, b.geometry.page_size);
  cmp("recipe.sink_tokens", a.sink_tokens, b.sink_tokens);
  cmp("recipe.recent_tokens", a.recent_tokens, b.recent_tokens);
  cmp("recipe.clip_ratio_k", a.clip_ratio_k, b.clip_ratio_k);
  cmp("recipe.clip_ratio_v", a.clip_ratio_v, b.clip_ratio_v);
  cmp("recipe.history_precision", PrecisionName(a.history_precision),
      PrecisionName(b.history_precision));
  cmp("recipe.block_format_version", a.block_format_version, b.block_format_version);
  if (rot_a != rot_b) {
    d.push_back(
        absl::StrCat("rotation_id (registered ", ToHex(rot_a), ", requested ", ToHex(rot_b), ")"));
  }
  return d;
}

// A parse error of rotation bytes the pool read from a client-chosen path, in fixed words: the
// parsers' messages quote header lengths, metadata strings, tensor names and shapes from the file,
// which would hand its content to a client that cannot read it. The category comes from where
// the parse stopped (the safetensors layer's messages do not start with "rotation file:").
absl::Status RedactedRotationError(const absl::Status& s, const std::string& field) {
  if (absl::IsDataLoss(s)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": not a rotation file (truncated safetensors data)"));
  }
  if (absl::StartsWith(s.message(), "rotation file")) {
    return absl::InvalidArgumentError(absl::StrCat(
        field,
        ": not a valid kvpool rotation file (metadata or tensors do not describe "
        "orthogonal rotations; check it with `kvpool rotations inspect FILE` on the pool's "
        "host)"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": not a rotation file (safetensors header length or header out of range)"));
}

std::vector<FormKind> HeldForms(const bool present[kNumForms]) {
  std::vector<FormKind> out;
  for (int f = 0; f < kNumForms; ++f) {
    if (present[f]) {
      out.push_back(static_cast<FormKind>(f));
    }
  }
  return out;
}

}  // namespace

const char* FormName(FormKind f) { return f == FormKind::kBf16 ? "bf16" : "int2"; }

absl::StatusOr<std::unique_ptr<BlockStore>> BlockStore::Create(const StoreOptions& options,
                                                               PoolMemory* memory, Clock* clock,
                                                               std::shared_ptr<Metrics> metrics) {
  if (memory == nullptr || memory->size() == 0) {
    return absl::InvalidArgumentError("capacity: the pool memory is empty");
  }
  if (!(options.low_watermark > 0 && options.low_watermark <= options.high_watermark &&
        options.high_watermark <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("low_watermark/high_watermark: need 0 < low_watermark <= high_watermark "
                     "<= 1 (StoreOptions; kvpool-server's flags take [0.5, 1] and refuse the "
                     "pair before allocating), got low_watermark ",
                     options.low_watermark, " and high_watermark ", options.high_watermark));
  }
  if (options.max_registration_bytes == 0) {
    return absl::InvalidArgumentError("max-registration-bytes: must be > 0");
  }
  if (options.alignment == 0 || (options.alignment & (options.alignment - 1)) != 0) {
    return absl::InvalidArgumentError("alignment: must be a power of two");
  }
  if (options.default_lease <= absl::ZeroDuration() ||
      options.default_put_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("lease-ms/put-timeout-ms: must be > 0");
  }
  if (!(options.corruption_reports_per_second >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("corruption-report-rate: must be >= 0, got ",
                                                   options.corruption_reports_per_second));
  }
  if (options.corruption_report_burst == 0) {
    return absl::InvalidArgumentError("corruption-report-burst: must be >= 1");
  }
  if (options.corruption_report_dedupe_window < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("corruption_report_dedupe_window: must be >= 0");
  }
  if (!metrics) {
    metrics = std::make_shared<Metrics>();
  }
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<BlockEncoder> encoder,
                          CreateEncoder(options.commit_device));
  KVPOOL_LOG_INFO("commit encoder: {}", encoder->Describe());
  std::unique_ptr<BlockStore> store(
      new BlockStore(options, memory, clock ? clock : Clock::Real(), std::move(metrics)));
  store->encoder_ = std::move(encoder);
  store->encoder_->RegisterHostMemory(memory->data(), memory->size());  // staging → device DMA
  return store;
}

BlockStore::BlockStore(const StoreOptions& options, PoolMemory* memory, Clock* clock,
                       std::shared_ptr<Metrics> metrics)
    : options_(options),
      memory_(memory),
      clock_(clock),
      metrics_(std::move(metrics)),
      arena_(memory->size(), options.alignment) {}

BlockStore::~BlockStore() = default;

// ---- registration ----------------------------------------------------------------------------

absl::StatusOr<ModelInfo> BlockStore::RegisterModel(const ModelSpec& spec_in,
                                                    const RotationInput& rotation) {
  ModelSpec spec = spec_in;
  if (spec.tenant.empty()) {
    spec.tenant = "default";
  }
  KVPOOL_RETURN_IF_ERROR(ValidateSpec(spec));

  // What the rotation must fit, whether it is sent now or re-attached by rotation_id.
  const kvpool::ExpectedRotationModel expected_rotation{.head_dim = spec.geometry.head_dim,
                                                        .num_layers = spec.geometry.num_layers,
                                                        .num_kv_heads = spec.geometry.num_kv_heads,
                                                        .clip_ratio_k = spec.clip_ratio_k,
                                                        .clip_ratio_v = spec.clip_ratio_v};
  // Parse the rotation outside the lock (it can be large).
  std::shared_ptr<const kvpool::RotationSet> rot;
  Digest rot_id{};
  if (!rotation.file_bytes.empty()) {
    if (rotation.file_bytes.size() > kMaxRotationFileBytes) {
      return absl::InvalidArgumentError(absl::StrCat(rotation.field, ": ",
                                                     rotation.file_bytes.size(), " bytes, at most ",
                                                     kMaxRotationFileBytes, " are accepted"));
    }
    absl::StatusOr<kvpool::RotationSet> parsed = ParseRotations(rotation.file_bytes);
    if (!parsed.ok()) {
      // Bytes that do not parse are a malformed request field: INVALID_ARGUMENT, also where the
      // parser says DATA_LOSS for a truncated file (newcomer report s6 #9: PROTOCOL.md keeps
      // DATA_LOSS for checksum mismatches, which engines may alert on as pool corruption).
      if (rotation.redact_file_content) {
        return RedactedRotationError(parsed.status(), rotation.field);  // INVALID_ARGUMENT
      }
      absl::Status bad = parsed.status();
      if (absl::IsDataLoss(bad)) bad = absl::InvalidArgumentError(bad.message());
      return Annotate(bad, rotation.field);
    }
    absl::Status match = CheckRotationsMatch(*parsed, expected_rotation);
    if (!match.ok()) {
      if (rotation.redact_file_content) {
        match = absl::FailedPreconditionError(absl::StrCat(
            rotation.field,
            ": the rotation file does not match the model (its head_dim, num_layers, "
            "num_kv_heads or clip ratios differ; `kvpool rotations inspect FILE` on the pool's "
            "host shows them)"));
      }
      // A registration under this identity that differs too: list its differences first, so
      // the rotation check does not hide them (newcomer s7 F5; PROTOCOL.md "every differing
      // field"), then the file's own mismatch.
      std::shared_lock lock(models_mu_);
      auto existing = models_by_identity_.find(IdentityKey(spec));
      if (existing != models_by_identity_.end()) {
        const Model& m = *existing->second;
        std::vector<std::string> diff =
            DiffSpecs(m.spec, m.info.rotation_id, spec, Sha256(rotation.file_bytes));
        if (!diff.empty()) {
          return absl::FailedPreconditionError(
              absl::StrCat("model ", spec.tenant, "/", spec.model_id, "@", spec.revision,
                           " is registered with a different layout: ", absl::StrJoin(diff, "; "),
                           "; also: ", match.message()));
        }
      }
      return match;
    }
    rot = std::make_shared<const kvpool::RotationSet>(std::move(*parsed));
    rot_id = Sha256(rotation.file_bytes);
  } else if (rotation.id.has_value()) {
    rot_id = *rotation.id;
  } else {
    return absl::InvalidArgumentError(
        "rotation: one of rotation_file, rotation_path or rotation_id is required");
  }

  KeyNamespace ns;
  ns.tenant = spec.tenant;
  ns.model_id = spec.model_id;
  ns.revision = spec.revision;
  ns.num_layers = spec.geometry.num_layers;
  ns.num_kv_heads = spec.geometry.num_kv_heads;
  ns.head_dim = spec.geometry.head_dim;
  ns.rotation_id = rot_id;
  ns.page_size = spec.geometry.page_size;
  ns.sink_tokens = spec.sink_tokens;
  // + 0.0f: -0 and 0 are one recipe ("clipping disabled"), so one namespace.
  ns.clip_ratio_k = spec.clip_ratio_k + 0.0f;
  ns.clip_ratio_v = spec.clip_ratio_v + 0.0f;
  ns.history_precision = PrecisionName(spec.history_precision);
  ns.tensor_parallel = spec.tensor_parallel;
  KVPOOL_ASSIGN_OR_RETURN(Digest ns_id, NamespaceKey(ns));

  // mu_ first (lock order): freeing registrations reads the puts and the block counts.
  std::unique_lock store_lock(mu_);
  std::unique_lock lock(models_mu_);
  if (auto held = rotations_.find(rot_id); held != rotations_.end()) {
    rot = held->second;  // one parsed copy per distinct rotation, however many models use it
  }
  if (!rot) {
    auto it = rotations_.find(rot_id);
    if (it == rotations_.end()) {
      return absl::NotFoundError(
          absl::StrCat("rotation_id: ", ToHex(rot_id), " is not held by this pool; send the file"));
    }
    rot = it->second;
  }
  const std::string identity = IdentityKey(spec);
  // The other revisions of this model id holding blocks (Model::blocks is guarded by mu_, held).
  auto other_revisions = [&] {
    std::vector<OtherRevision> out;
    for (const auto& [ns, other] : models_) {
      const ModelSpec& o = other->spec;
      if (o.tenant != spec.tenant || o.model_id != spec.model_id || o.revision == spec.revision ||
          o.tensor_parallel.has_value() != spec.tensor_parallel.has_value() ||
          (o.tensor_parallel.has_value() &&
           (o.tensor_parallel->rank != spec.tensor_parallel->rank ||
            o.tensor_parallel->size != spec.tensor_parallel->size)) ||
          other->blocks == 0) {
        continue;
      }
      out.push_back({o.revision, other->info.rotation_id, other->blocks});
    }
    std::sort(out.begin(), out.end(), [](const OtherRevision& a, const OtherRevision& b) {
      return a.blocks != b.blocks ? a.blocks > b.blocks : a.revision < b.revision;
    });
    if (out.size() > kMaxOtherRevisions) out.resize(kMaxOtherRevisions);
    return out;
  };
  auto existing = models_by_identity_.find(identity);
  if (existing != models_by_identity_.end()) {
    const Model& m = *existing->second;
    std::vector<std::string> diff = DiffSpecs(m.spec, m.info.rotation_id, spec, rot_id);
    if (!diff.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("model ", spec.tenant, "/", spec.model_id, "@", spec.revision,
                       " is registered with a different layout: ", absl::StrJoin(diff, "; ")));
    }
    m.last_use.store(++use_clock_, std::memory_order_relaxed);
    ModelInfo info = m.info;
    info.created = false;
    info.other_revisions = other_revisions();
    return info;
  }
  if (rotation.file_bytes.empty()) {
    // A rotation re-attached by id was checked against the model it was sent for, not this one:
    // a model of another geometry would be encoded with matrices of the wrong shape (newcomer
    // 12 F1: head_dim 256 over an 8x8 file crashed the commit; head_dim 16, 6 layers for 5 or
    // 64 KV heads encoded blocks from memory past the matrices and served them as valid).
    if (absl::Status match = CheckRotationsMatch(*rot, expected_rotation); !match.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rotation_id: the held rotation ", ToHex(rot_id), " does not fit: ", match.message()));
    }
  }
  const uint64_t model_bytes = kRegistrationOverheadBytes + identity.size();
  const uint64_t rotation_charge =
      rotation_bytes_.count(rot_id) != 0 ? 0 : static_cast<uint64_t>(rotation.file_bytes.size());
  const std::string charged_field =
      rotation.file_bytes.empty() ? std::string("rotation_id") : rotation.field;
  if (model_bytes + rotation_charge > options_.max_registration_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        charged_field, ": registering this model needs ", model_bytes + rotation_charge,
        " bytes of registration memory, more than the whole ", options_.max_registration_bytes,
        " bytes --max-registration-bytes allows (raise it, or use a smaller rotation file)"));
  }
  if (!MakeRoomForRegistrationLocked(model_bytes + rotation_charge, rot_id)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        charged_field, ": registering this model needs ", model_bytes + rotation_charge,
        " bytes of registration memory; registrations hold ", registration_bytes_, " of the ",
        options_.max_registration_bytes,
        " bytes --max-registration-bytes allows and every other registered model holds stored "
        "blocks or an open put (a registration is freed once its model holds neither: its "
        "blocks leave by eviction or by a client's Delete call, docs/PROTOCOL.md \"Delete and "
        "Stats\"; or restart the pool with a larger --max-registration-bytes, which drops "
        "every stored block)"));
  }
  auto m = std::make_shared<Model>();
  m->spec = spec;
  m->rotation = rot;
  m->identity = identity;
  m->charged_bytes = model_bytes;
  m->last_use.store(++use_clock_, std::memory_order_relaxed);
  m->info.namespace_id = ns_id;
  m->info.rotation_id = rot_id;
  m->info.created = true;
  m->info.bf16_form_bytes = spec.geometry.Bf16FormBytes();
  m->info.int2_form_bytes = spec.geometry.Int2FormBytes();
  m->info.sink_blocks = spec.sink_tokens / spec.geometry.page_size;
  m->info.recent_blocks =
      (spec.recent_tokens + spec.geometry.page_size - 1) / spec.geometry.page_size;
  rotations_.emplace(rot_id, rot);
  rotation_bytes_.emplace(rot_id, rotation_charge);  // no-op when the rotation was held
  registration_bytes_ += model_bytes + rotation_charge;
  models_.emplace(ns_id, m);
  ModelInfo info = m->info;
  info.other_revisions = other_revisions();
  models_by_identity_.emplace(identity, std::move(m));
  KVPOOL_LOG_INFO("registered model {}/{}@{} namespace {}", spec.tenant, spec.model_id,
                  spec.revision, ToHex(ns_id));
  return info;
}

uint64_t BlockStore::NewIdLocked() {
  for (;;) {
    uint64_t id = 0;
    // OpenSSL's CSPRNG (seeded from getrandom/urandom, reseeded by OpenSSL itself).
    if (RAND_bytes(reinterpret_cast<unsigned char*>(&id), sizeof(id)) != 1) {
      KVPOOL_LOG_ERROR("no randomness for lease and put ids (RAND_bytes failed: {})",
                       ERR_error_string(ERR_get_error(), nullptr));
      std::abort();  // sequential ids would let any client release another's lease
    }
    if (id != 0 && puts_.count(id) == 0 && leases_.count(id) == 0) {
      return id;
    }
  }
}

absl::StatusOr<std::shared_ptr<const BlockStore::Model>> BlockStore::FindModelLocked(
    const Digest& namespace_id) const {
  auto it = models_.find(namespace_id);
  if (it == models_.end()) {
    return absl::NotFoundError(absl::StrCat("namespace_id: ", ToHex(namespace_id),
                                            " is not registered (register the model first)"));
  }
  it->second->last_use.store(++use_clock_, std::memory_order_relaxed);
  return it->second;
}

bool BlockStore::MakeRoomForRegistrationLocked(uint64_t need, const Digest& keep_rotation) {
  const uint64_t limit = options_.max_registration_bytes;
  if (need > limit) return false;
  if (registration_bytes_ + need <= limit) return true;
  // Candidates: no resident block, no open put (a put's commit uses the model's rotation).
  std::unordered_set<const Model*> in_puts;
  for (const auto& [id, put] : puts_) in_puts.insert(put.model);
  std::vector<std::shared_ptr<Model>> candidates;
  for (const auto& [identity, m] : models_by_identity_) {
    if (m->blocks == 0 && in_puts.count(m.get()) == 0) candidates.push_back(m);
  }
  std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
    return a->last_use.load(std::memory_order_relaxed) <
           b->last_use.load(std::memory_order_relaxed);
  });
  for (const std::shared_ptr<Model>& m : candidates) {
    if (registration_bytes_ + need <= limit) break;
    m->retired = true;
    models_.erase(m->info.namespace_id);
    models_by_identity_.erase(m->identity);
    registration_bytes_ -= m->charged_bytes;
    const Digest rot_id = m->info.rotation_id;
    const bool rotation_in_use =
        std::any_of(models_by_identity_.begin(), models_by_identity_.end(),
                    [&](const auto& e) { return e.second->info.rotation_id == rot_id; });
    if (!rotation_in_use && rot_id != keep_rotation) {
      rotations_.erase(rot_id);
      auto rb = rotation_bytes_.find(rot_id);
      if (rb != rotation_bytes_.end()) {
        registration_bytes_ -= rb->second;
        rotation_bytes_.erase(rb);
      }
    }
    metrics_->registrations_freed.fetch_add(1, std::memory_order_relaxed);
    KVPOOL_LOG_INFO(
        "registration of model {}/{}@{} freed (no blocks, least recently used) to stay under "
        "--max-registration-bytes {}",
        m->spec.tenant, m->spec.model_id, m->spec.revision, limit);
  }
  return registration_bytes_ + need <= limit;
}

BlockStore::Block* BlockStore::FindBlockLocked(const Digest& k) {
  auto& map = ShardOf(k).blocks;
  auto it = map.find(k);
  return it == map.end() ? nullptr : &it->second;
}

absl::StatusOr<std::vector<Digest>> BlockStore::ResolveKeys(const Model& m, const KeyQuery& q,
                                                            size_t max_blocks) const {
  if (q.token_ids.empty() == q.keys.empty()) {
    return absl::InvalidArgumentError("token_ids/keys: give exactly one of them");
  }
  if (!q.keys.empty()) {
    std::vector<Digest> keys = q.keys;
    if (max_blocks > 0 && keys.size() > max_blocks) {
      keys.resize(max_blocks);
    }
    return keys;
  }
  return ChainKeys(m.info.namespace_id, q.token_ids, m.spec.geometry.page_size, max_blocks);
}

// A held block answers position i of a key query only where it IS block i of the chain the
// query names: block 0 has no parent, block i > 0 is the child of the query's key i - 1. Keys
// computed from token_ids always are (a key hashes its parent's, FORMAT.md §3); keys a client
// sends may be out of order, repeated or skip a block, and would otherwise be leased and
// answered as "leading blocks 0..n-1" at the wrong positions (newcomer report 13 F2).
// INVALID_ARGUMENT naming keys[i].
absl::Status BlockStore::CheckChainPosition(absl::Span<const Digest> keys, uint32_t i,
                                            const Block& b) {
  const bool parent_ok =
      i == 0 ? !b.parent.has_value() : (b.parent.has_value() && *b.parent == keys[i - 1]);
  if (b.index == i && parent_ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "keys[", i, "]: the pool holds ", ToHex(keys[i]), " as block ", b.index, " of its chain",
      i == 0 ? "" : absl::StrCat(", not as the child of keys[", i - 1, "]"),
      " (keys must be the chain from the sequence's first block: keys[0] block 0, keys[i] the "
      "child of keys[i-1])"));
}

void BlockStore::TargetForms(const Model& m, uint32_t index, uint32_t num_blocks,
                             bool out[kNumForms]) const {
  const bool sink = index < m.info.sink_blocks;
  const bool tail = index + m.info.recent_blocks >= num_blocks;
  if (m.spec.history_precision == HistoryPrecision::kBf16 || sink) {
    out[int(FormKind::kBf16)] = true;
    out[int(FormKind::kInt2)] = false;
    return;
  }
  out[int(FormKind::kInt2)] = true;
  out[int(FormKind::kBf16)] = tail;
}

// ---- allocation and eviction --------------------------------------------------------------------

absl::StatusOr<uint64_t> BlockStore::AllocateLocked(uint64_t size) {
  for (;;) {
    absl::StatusOr<uint64_t> off = arena_.Allocate(size);
    if (off.ok() || off.status().code() != absl::StatusCode::kResourceExhausted) {
      return off;
    }
    const uint64_t need = arena_.RoundUp(size);
    const uint64_t low = static_cast<uint64_t>(options_.low_watermark * arena_.capacity());
    uint64_t target = arena_.capacity() > need ? std::min(low, arena_.capacity() - need) : 0;
    if (arena_.used_bytes() <= target) {
      // Already at the target but fragmented (or the request is huge): free one more step.
      target = arena_.used_bytes() > need ? arena_.used_bytes() - need : 0;
    }
    if (ReclaimLocked(target, "allocation") == 0) {
      return off;  // nothing more can be evicted
    }
  }
}

BlockStore::EvictionDryRun BlockStore::DryRunEvictionLocked() const {
  EvictionDryRun dry{.arena = arena_};
  auto find = [this](const Digest& k) -> const Block* {
    const auto& map = ShardOf(k).blocks;
    auto it = map.find(k);
    return it == map.end() ? nullptr : &it->second;
  };
  // Blocks above a pinned one: ReclaimLocked removes leaves only, so never these.
  std::unordered_set<const Block*> above_pinned;
  for (const Digest& k : lru_) {
    const Block* b = find(k);
    if (b == nullptr || b->pins == 0) continue;
    for (std::optional<Digest> p = b->parent; p.has_value();) {
      const Block* pb = find(*p);
      if (pb == nullptr || !above_pinned.insert(pb).second) break;
      p = pb->parent;
    }
  }
  for (const Digest& k : lru_) {
    const Block* b = find(k);
    if (b == nullptr || b->pins > 0) continue;
    const bool removable = above_pinned.count(b) == 0;
    for (int f = 0; f < kNumForms; ++f) {
      const Slot& s = b->forms[f];
      if (!s.present) continue;
      if (removable || (f == int(FormKind::kBf16) && Demotable(*b))) {
        dry.arena.Free(s.offset, s.size);
        dry.evictable += arena_.RoundUp(s.size);
      } else {
        dry.ancestors += arena_.RoundUp(s.size);
      }
    }
  }
  return dry;
}

absl::StatusOr<std::vector<uint64_t>> BlockStore::AllocateAllLocked(
    absl::Span<const uint64_t> sizes, const char* what, absl::Span<const uint64_t> then) {
  std::vector<uint64_t> offsets;
  offsets.reserve(sizes.size());
  auto free_all = [&] {
    for (size_t k = 0; k < offsets.size(); ++k) arena_.Free(offsets[k], sizes[k]);
    offsets.clear();
  };
  const std::string named = then.empty()
                                ? absl::StrCat(sizes.size(), " ", what)
                                : absl::StrCat(sizes.size(), " ", what, " and the ", then.size(),
                                               " new forms its commit allocates beside them");
  // 1. The free ranges as they are (the common case: no eviction, no dry run).
  for (uint64_t size : sizes) {
    absl::StatusOr<uint64_t> off = arena_.Allocate(size);
    if (!off.ok()) break;
    offsets.push_back(*off);
  }
  if (offsets.size() == sizes.size()) return offsets;
  free_all();
  // Leases and puts past their deadline pin nothing from here on, even before the expiry tick
  // runs (--tick-ms up to 60 s): their readers and writers are refused already (newcomer
  // report 13 F6: an expired lease kept its blocks from eviction until the tick).
  ExpireLocked(clock_->Now());
  // 2. Would they (and `then` after them) fit once eviction freed all it may? If not, evict
  // nothing.
  const EvictionDryRun dry = DryRunEvictionLocked();
  {
    std::vector<uint64_t> all(sizes.begin(), sizes.end());
    all.insert(all.end(), then.begin(), then.end());
    Arena trial = dry.arena;
    for (size_t k = 0; k < all.size(); ++k) {
      if (!trial.Allocate(all[k]).ok()) return RoomRefusalLocked(all, k, named, dry, 0);
    }
  }
  // 3. Evict as needed (watermark steps, FORMAT.md §5 order) while allocating.
  const uint64_t used_before = arena_.used_bytes();
  for (uint64_t size : sizes) {
    absl::StatusOr<uint64_t> off = AllocateLocked(size);
    if (!off.ok()) break;
    offsets.push_back(*off);
  }
  if (offsets.size() == sizes.size()) return offsets;
  // First fit placed some ranges before all eviction was done, where they block a later one.
  // Eviction is exhausted now, so the arena without our ranges is the dry run's: place them
  // again in that arena's order, which step 2 showed to fit.
  free_all();
  const uint64_t evicted = used_before - arena_.used_bytes();
  for (size_t k = 0; k < sizes.size(); ++k) {
    absl::StatusOr<uint64_t> off = arena_.Allocate(sizes[k]);
    if (!off.ok()) {
      free_all();
      return RoomRefusalLocked(sizes, k, named, DryRunEvictionLocked(), evicted);
    }
    offsets.push_back(*off);
  }
  return offsets;
}

absl::Status BlockStore::RoomRefusalLocked(absl::Span<const uint64_t> sizes, size_t placed,
                                           absl::string_view what, const EvictionDryRun& dry,
                                           uint64_t evicted) const {
  uint64_t need = 0;
  for (uint64_t size : sizes) need += arena_.RoundUp(size);
  const uint64_t used = arena_.used_bytes(), capacity = arena_.capacity();
  const uint64_t free_now = capacity - used;
  const uint64_t free_after = free_now + dry.evictable;
  // Allocated but in no block and no staging: forms other commits reserved and have not linked.
  const uint64_t accounted = staging_bytes_ + pinned_bytes_ + dry.evictable + dry.ancestors;
  const uint64_t unlinked = used > accounted ? used - accounted : 0;
  std::string text = absl::StrCat(
      "num_blocks: pool full: cannot allocate ", need, " bytes at once for ", what, " (", used,
      " of ", capacity, " bytes used: ", staging_bytes_, " bytes staging of open puts, ",
      pinned_bytes_, " bytes forms of leased or pinned blocks, ", dry.ancestors,
      " bytes forms of unpinned ancestors of pinned blocks (evicted only after them), ", unlinked,
      " bytes forms other commits have not linked yet, ", dry.evictable,
      " bytes forms eviction can free; ", free_now, " bytes free, ", free_after,
      " once those are evicted");
  if (need <= free_after && placed < sizes.size()) {
    absl::StrAppend(&text, ", but in pieces: the largest free range would be ",
                    dry.arena.largest_free_range(), " bytes, and ");
    if (placed == 0) {
      absl::StrAppend(&text, "the first (", arena_.RoundUp(sizes[0]), " bytes) finds no range");
    } else {
      absl::StrAppend(&text, "once the first ", placed, " are placed the next (",
                      arena_.RoundUp(sizes[placed]), " bytes) finds no range");
    }
  }
  if (evicted == 0) {
    absl::StrAppend(&text, "); nothing was evicted");
  } else {
    absl::StrAppend(&text, "); ", evicted, " bytes were evicted looking for room");
  }
  absl::Status refused = absl::ResourceExhaustedError(text);
  SetRoomShortage(refused, {need, free_after, staging_bytes_, pinned_bytes_});
  return refused;
}

void BlockStore::FreeSlotLocked(Block& b, FormKind f, const char* reason) {
  Slot& s = b.forms[int(f)];
  if (!s.present) {
    return;
  }
  arena_.Free(s.offset, s.size);
  form_count_[int(f)]--;
  form_bytes_[int(f)] -= s.size;
  if (b.pins > 0) pinned_bytes_ -= arena_.RoundUp(s.size);
  s = Slot{};
}

uint64_t BlockStore::HeldBytes(const Block& b) const {
  uint64_t bytes = 0;
  for (const Slot& s : b.forms) {
    if (s.present) bytes += arena_.RoundUp(s.size);
  }
  for (const Slot& s : b.dropped) bytes += arena_.RoundUp(s.size);
  return bytes;
}

void BlockStore::PinLocked(Block& b) {
  if (b.pins++ == 0) pinned_bytes_ += HeldBytes(b);
}

void BlockStore::RemoveBlockLocked(const Digest& key, const char* reason) {
  Shard& sh = ShardOf(key);
  std::unique_lock shard_lock(sh.mu);
  auto it = sh.blocks.find(key);
  if (it == sh.blocks.end()) {
    return;
  }
  Block& b = it->second;
  if (!HoldsAForm(b) && formless_blocks_ > 0) --formless_blocks_;
  for (int f = 0; f < kNumForms; ++f) {
    FreeSlotLocked(b, static_cast<FormKind>(f), reason);
  }
  for (const Slot& s : b.dropped) {  // only pinned blocks keep any
    arena_.Free(s.offset, s.size);
    if (b.pins > 0) pinned_bytes_ -= arena_.RoundUp(s.size);
  }
  if (b.parent.has_value()) {
    // The parent's children list is not read by Lookup: mu_ (held) guards it.
    if (Block* p = FindBlockLocked(*b.parent)) {
      auto& ch = p->children;
      ch.erase(std::remove(ch.begin(), ch.end(), key), ch.end());
    }
  }
  if (b.model != nullptr && b.model->blocks > 0) --b.model->blocks;
  lru_.erase(b.lru);
  sh.blocks.erase(it);
}

uint64_t BlockStore::ReclaimLocked(uint64_t target_used, const char* trigger) {
  const uint64_t before = arena_.used_bytes();
  // Phase 1: demote — BF16 forms of non-sink blocks that also hold INT2, least recently used
  // first.
  for (auto it = lru_.begin(); it != lru_.end() && arena_.used_bytes() > target_used; ++it) {
    Block& b = *FindBlockLocked(*it);
    if (b.pins > 0) {
      continue;
    }
    if (Demotable(b)) {
      std::unique_lock shard_lock(ShardOf(b.key).mu);
      FreeSlotLocked(b, FormKind::kBf16, "demote");
      metrics_->evictions_demote.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // Phase 2: whole blocks, LRU, leaf-first. Removing a leaf can make its parent a leaf, so
  // scan again while progress is made.
  bool progress = true;
  while (arena_.used_bytes() > target_used && progress) {
    progress = false;
    for (auto it = lru_.begin(); it != lru_.end() && arena_.used_bytes() > target_used;) {
      Block& b = *FindBlockLocked(*it);
      ++it;  // RemoveBlockLocked erases b's LRU entry
      if (b.pins > 0 || !b.children.empty()) {
        continue;
      }
      RemoveBlockLocked(b.key, "evict");
      metrics_->evictions_block.fetch_add(1, std::memory_order_relaxed);
      progress = true;
    }
  }
  const uint64_t freed = before - arena_.used_bytes();
  if (freed > 0) {
    KVPOOL_LOG_DEBUG("reclaimed {} bytes ({}), used {} of {}", freed, trigger, arena_.used_bytes(),
                     arena_.capacity());
  }
  return freed;
}

void BlockStore::UnpinLocked(const Digest& key) {
  Block* b = FindBlockLocked(key);
  if (b == nullptr || b->pins == 0 || --b->pins > 0) {
    return;
  }
  pinned_bytes_ -= HeldBytes(*b);
  // The last reader of forms dropped as corrupt is gone: free their bytes now.
  for (const Slot& s : b->dropped) arena_.Free(s.offset, s.size);
  b->dropped.clear();
  // A block left without forms serves nobody; as a leaf it goes (an inner one stays, so that its
  // descendants keep their place, until eviction reaches it leaf-first or a put restores it).
  if (!HoldsAForm(*b) && b->children.empty()) {
    RemoveBlockLocked(key, "corrupt");
  }
}

void BlockStore::DropCorruptFormLocked(Block& b, FormKind f) {
  Slot s = b.forms[int(f)];
  if (!s.present) return;
  {
    std::unique_lock shard_lock(ShardOf(b.key).mu);  // Lookup reads `forms` under it
    b.forms[int(f)] = Slot{};
  }
  form_count_[int(f)]--;
  form_bytes_[int(f)] -= s.size;
  if (b.pins > 0) {
    b.dropped.push_back(s);  // a reader may still be copying it
  } else {
    arena_.Free(s.offset, s.size);
  }
  if (!HoldsAForm(b)) ++formless_blocks_;
}

void BlockStore::ReleasePutLocked(Put& put, bool free_staging) {
  for (PutBlockState& b : put.blocks) {
    if (b.plan.action == PutAction::kWrite && free_staging) {
      arena_.Free(b.staging_offset, b.plan.size);
      staging_bytes_ -= arena_.RoundUp(b.plan.size);
    }
    if (b.pinned_existing) {
      UnpinLocked(b.plan.key);
    }
  }
}

void BlockStore::ExpireLocked(absl::Time now) {
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.deadline <= now) {
      for (const Digest& k : it->second.keys) {
        UnpinLocked(k);
      }
      metrics_->lease_expiries.fetch_add(1, std::memory_order_relaxed);
      it = leases_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = puts_.begin(); it != puts_.end();) {
    if (!it->second.committing && it->second.writers == 0 && it->second.deadline <= now) {
      ReleasePutLocked(it->second, true);
      metrics_->put_expiries.fetch_add(1, std::memory_order_relaxed);
      KVPOOL_LOG_INFO("put {} expired uncommitted; staging reclaimed", it->first);
      it = puts_.erase(it);
    } else {
      ++it;
    }
  }
}

void BlockStore::Tick() {
  std::unique_lock lock(mu_);
  ExpireLocked(clock_->Now());
  const uint64_t cap = arena_.capacity();
  if (arena_.used_bytes() > static_cast<uint64_t>(options_.high_watermark * cap)) {
    ReclaimLocked(static_cast<uint64_t>(options_.low_watermark * cap), "watermark");
  }
}

// ---- put ---------------------------------------------------------------------------------------

absl::StatusOr<PutPlan> BlockStore::BeginPut(const Digest& namespace_id,
                                             absl::Span<const uint32_t> tokens, uint32_t num_blocks,
                                             absl::Duration timeout) {
  std::shared_ptr<const Model> model_ref;  // keeps the model alive for this call
  {
    std::shared_lock lock(models_mu_);
    KVPOOL_ASSIGN_OR_RETURN(model_ref, FindModelLocked(namespace_id));
  }
  const Model* m = model_ref.get();
  const uint32_t P = m->spec.geometry.page_size;
  const uint64_t full = tokens.size() / P;
  if (num_blocks == 0) {
    return absl::InvalidArgumentError("num_blocks: must be >= 1");
  }
  if (num_blocks > full) {
    return absl::InvalidArgumentError(absl::StrCat("num_blocks: ", num_blocks, " exceeds the ",
                                                   full, " full blocks of token_ids (",
                                                   tokens.size(), " tokens, page_size ", P, ")"));
  }
  const uint64_t bf16_bytes = m->info.bf16_form_bytes;
  if (timeout <= absl::ZeroDuration()) {
    timeout = options_.default_put_timeout;
  }
  timeout = std::min(timeout, options_.max_put_timeout);
  KVPOOL_ASSIGN_OR_RETURN(std::vector<Digest> keys, ChainKeys(namespace_id, tokens, P, num_blocks));

  std::unique_lock lock(mu_);
  if (m->retired) {  // its registration was freed since FindModelLocked (no put may use it)
    return absl::NotFoundError(absl::StrCat("namespace_id: ", ToHex(namespace_id),
                                            " is not registered (register the model first)"));
  }
  const absl::Time now = clock_->Now();
  PruneRoomWaitersLocked(now);
  const Digest& line_key = keys.back();
  uint64_t need = 0, room = 0;
  if (absl::Status fits = CheckCommitFitsLocked(*m, keys, &need, &room); !fits.ok()) {
    NoteRoomRefusalLocked(line_key, need, fits, now);
    return fits;
  }
  // Room kept for the puts in line before this one (StoreOptions::room_waiter_life).
  if (auto [kept, ahead] = RoomKeptAheadLocked(line_key); kept > 0 && need + kept > room) {
    absl::Status refused = absl::ResourceExhaustedError(absl::StrCat(
        "num_blocks: the pool keeps ", kept, " bytes for ", ahead,
        " earlier put(s) refused for room that are asking again: this put's commit needs ", need,
        " bytes at once, and eviction can make at most ", room, " of the pool's ",
        arena_.capacity(), " bytes free (", staging_bytes_,
        " bytes are staging of other open puts, ", pinned_bytes_,
        " bytes are forms of leased or pinned blocks); ask again: a put refused for room that "
        "asks again within ",
        absl::FormatDuration(options_.room_waiter_life), " is in line too"));
    SetRoomShortage(refused,
                    {need, room - std::min(room, kept), staging_bytes_ + kept, pinned_bytes_});
    NoteRoomRefusalLocked(line_key, need, refused, now);
    return refused;
  }
  Put put;
  put.id = NewIdLocked();
  put.model = m;
  put.deadline = clock_->Now() + timeout;
  put.timeout = timeout;
  PutPlan plan;
  plan.put_id = put.id;
  plan.timeout = timeout;
  uint64_t staged = 0;
  for (uint32_t i = 0; i < num_blocks; ++i) {
    PutBlockState st;
    st.plan.index = i;
    st.plan.key = keys[i];
    if (i > 0) {
      st.parent = keys[i - 1];
    }
    bool target[kNumForms];
    TargetForms(*m, i, num_blocks, target);
    bool held[kNumForms] = {false, false};
    bool added[kNumForms] = {false, false};
    if (Block* existing = FindBlockLocked(keys[i])) {
      for (int f = 0; f < kNumForms; ++f) {
        held[f] = existing->forms[f].present;
      }
      PinLocked(*existing);
      st.pinned_existing = true;
    }
    for (int f = 0; f < kNumForms; ++f) {
      added[f] = target[f] && !held[f];
    }
    st.plan.forms_held = HeldForms(held);
    st.plan.forms_added = HeldForms(added);
    st.plan.action = PutAction::kSkip;  // kWrite once its staging is allocated below
    put.blocks.push_back(std::move(st));
  }
  // The per-put limit and the capacity bound count the blocks this put writes: blocks the pool
  // holds already (a conversation's earlier turns) need no staging (newcomer 14 F2: counting
  // the whole sequence made every prompt longer than --max-put-blocks pages unstorable).
  uint32_t writes = 0;
  for (const PutBlockState& st : put.blocks) writes += st.plan.forms_added.empty() ? 0 : 1;
  const std::string held_part = writes < num_blocks
                                    ? absl::StrCat(" (", num_blocks - writes, " of its ",
                                                   num_blocks, " blocks are held already)")
                                    : std::string();
  if (writes > options_.max_put_blocks) {
    ReleasePutLocked(put, true);  // unpins; no block is kWrite yet
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks: the put writes ", writes, " blocks", held_part,
                     ", more than the per-put limit ", options_.max_put_blocks,
                     " (kvpool-server --max-put-blocks): put a prefix with at most that many new "
                     "blocks first, then the whole sequence"));
  }
  if (uint64_t{writes} * arena_.RoundUp(bf16_bytes) > arena_.capacity()) {
    ReleasePutLocked(put, true);
    return absl::ResourceExhaustedError(
        absl::StrCat("num_blocks: staging for the ", writes, " blocks the put writes", held_part,
                     " (", uint64_t{writes} * bf16_bytes, " bytes) exceeds the pool capacity of ",
                     arena_.capacity(), " bytes"));
  }
  // The staging of every block to write at once (or none: nothing evicted for a put that then
  // fails), with the blocks the put builds on pinned.
  // The forms are only counted in the dry run: a put whose commit could not place them even
  // after eviction evicts nothing for its staging either.
  std::vector<uint64_t> staging_sizes, form_sizes;
  const uint64_t form_bytes[kNumForms] = {m->info.bf16_form_bytes, m->info.int2_form_bytes};
  for (const PutBlockState& st : put.blocks) {
    if (st.plan.forms_added.empty()) continue;
    staging_sizes.push_back(bf16_bytes);
    for (FormKind f : st.plan.forms_added) form_sizes.push_back(form_bytes[int(f)]);
  }
  absl::StatusOr<std::vector<uint64_t>> offsets =
      AllocateAllLocked(staging_sizes, "staging ranges", form_sizes);
  if (!offsets.ok()) {
    ReleasePutLocked(put, true);  // unpins; no block is kWrite yet
    NoteRoomRefusalLocked(line_key, need, offsets.status(), now);
    return offsets.status();
  }
  // Opened: out of the line.
  std::erase_if(room_waiters_, [&](const RoomWaiter& w) { return w.key == line_key; });
  size_t next = 0;
  for (PutBlockState& st : put.blocks) {
    if (!st.plan.forms_added.empty()) {
      const uint64_t off = (*offsets)[next++];
      st.plan.action = PutAction::kWrite;
      st.plan.staging_offset = off;
      st.plan.size = bf16_bytes;
      st.staging_offset = off;
      staging_bytes_ += arena_.RoundUp(bf16_bytes);
      staged += bf16_bytes;
    }
    plan.blocks.push_back(st.plan);
  }
  puts_.emplace(put.id, std::move(put));
  metrics_->put_bytes.fetch_add(staged, std::memory_order_relaxed);
  metrics_->put_size.Observe(static_cast<double>(staged));
  return plan;
}

uint64_t BlockStore::EvictableRoomLocked(uint64_t also_pinned) const {
  const uint64_t fixed = staging_bytes_ + pinned_bytes_ + also_pinned;
  const uint64_t capacity = arena_.capacity();
  return capacity > fixed ? capacity - fixed : 0;
}

void BlockStore::PruneRoomWaitersLocked(absl::Time now) {
  std::erase_if(room_waiters_,
                [&](const RoomWaiter& w) { return now - w.last > options_.room_waiter_life; });
}

void BlockStore::NoteRoomRefusalLocked(const Digest& key, uint64_t need, const absl::Status& s,
                                       absl::Time now) {
  if (options_.room_waiter_life <= absl::ZeroDuration()) return;
  // Only room that other puts or leases hold passes; a put too large for the pool waits for
  // nothing (the rule of kvpool::worker::RoomHeldByOthers).
  const std::optional<RoomShortage> r = GetRoomShortage(s);
  if (!r.has_value()) return;
  const uint64_t held = r->staging_bytes + r->pinned_bytes;
  if (held == 0 || r->need_bytes > r->room_bytes + held) return;
  auto it = std::find_if(room_waiters_.begin(), room_waiters_.end(),
                         [&](const RoomWaiter& w) { return w.key == key; });
  if (it == room_waiters_.end()) {
    room_waiters_.push_back({key, need, now, 1});
    return;
  }
  it->need = need;
  it->last = now;
  ++it->refusals;
}

std::pair<uint64_t, int> BlockStore::RoomKeptAheadLocked(const Digest& key) const {
  uint64_t kept = 0;
  int ahead = 0;
  for (const RoomWaiter& w : room_waiters_) {
    if (w.key == key) break;
    if (w.refusals < 2) continue;  // asked once: not (yet) known to ask again
    kept += w.need;
    ++ahead;
  }
  return {kept, ahead};
}

absl::Status BlockStore::CheckCommitFitsLocked(const Model& m, absl::Span<const Digest> keys,
                                               uint64_t* need_out, uint64_t* room_out) {
  const uint32_t num_blocks = static_cast<uint32_t>(keys.size());
  const uint64_t sizes[kNumForms] = {arena_.RoundUp(m.info.bf16_form_bytes),
                                     arena_.RoundUp(m.info.int2_form_bytes)};
  uint64_t staging = 0, forms = 0, newly_pinned = 0;
  uint32_t writes = 0;
  for (uint32_t i = 0; i < num_blocks; ++i) {
    bool target[kNumForms];
    TargetForms(m, i, num_blocks, target);
    const Block* existing = FindBlockLocked(keys[i]);
    bool adds = false;
    for (int f = 0; f < kNumForms; ++f) {
      if (target[f] && (existing == nullptr || !existing->forms[f].present)) {
        forms += sizes[f];
        adds = true;
      }
    }
    if (adds) {
      staging += sizes[int(FormKind::kBf16)];
      ++writes;
    }
    if (existing != nullptr && existing->pins == 0) newly_pinned += HeldBytes(*existing);
  }
  // What no eviction can free while this put commits: the other puts' staging, the blocks leased
  // or pinned (by open puts, commits, corruption checks) and those this put pins. A lower bound:
  // the ancestors of pinned blocks (never evicted before them) and fragmentation are not counted,
  // so a put refused here could never commit, while one accepted may still fail at its commit.
  const uint64_t capacity = arena_.capacity();
  const uint64_t room = EvictableRoomLocked(newly_pinned);
  if (need_out != nullptr) *need_out = staging + forms;
  if (room_out != nullptr) *room_out = room;
  if (staging + forms <= room) return absl::OkStatus();
  // A prefill node (kvpool::worker::RoomHeldByOthers) reads these numbers (the RoomShortage
  // payload, or this message's and AllocateLocked's text from a pool before v1.7) to tell
  // pressure of other puts and leases, which it waits out, from a put too large for the pool;
  // worker_e2e_pool_test checks it.
  absl::Status refused = absl::ResourceExhaustedError(absl::StrCat(
      "num_blocks: the pool cannot hold this put's commit: it needs ", staging + forms,
      " bytes at once (", staging, " bytes of staging for the ", writes, " of ", num_blocks,
      " blocks to write, plus ", forms,
      " bytes for their new forms, allocated while the staging is held), and eviction can make at "
      "most ",
      room, " of the pool's ", capacity, " bytes free (", staging_bytes_,
      " bytes are staging of other open puts, ", pinned_bytes_ + newly_pinned,
      " bytes are forms of leased or pinned blocks); release leases or put fewer blocks"));
  SetRoomShortage(refused, {staging + forms, room, staging_bytes_, pinned_bytes_ + newly_pinned});
  return refused;
}

absl::StatusOr<std::unordered_map<uint64_t, BlockStore::Put>::iterator>
BlockStore::FindOpenPutLocked(const Digest& namespace_id, uint64_t put_id) {
  auto it = puts_.find(put_id);
  if (it == puts_.end() || it->second.model->info.namespace_id != namespace_id) {
    return absl::NotFoundError(
        absl::StrCat("put_id: ", put_id,
                     " is not an open put of this namespace (never begun, expired, aborted or "
                     "committed)"));
  }
  if (it->second.committing) {
    return absl::FailedPreconditionError(
        absl::StrCat("put_id: ", put_id, " is already committing"));
  }
  // Fail closed, like a lease: a put past its deadline is expired even before the expiry tick
  // runs (newcomer report s8 N11: a commit 1 s past --put-timeout-ms was accepted when the tick
  // had not run). Reclaimed here, unless a WritePut still writes its staging (then the tick
  // reclaims it once that pull ends); NOT_FOUND like a put the tick dropped, so the client's
  // DEADLINE_EXCEEDED "not committed within the pool's put timeout" applies to both.
  const absl::Time now = clock_->Now();
  if (it->second.deadline <= now) {
    const absl::Duration timeout = it->second.timeout;
    const absl::Duration late = now - it->second.deadline;
    if (it->second.writers == 0) {
      ReleasePutLocked(it->second, true);
      metrics_->put_expiries.fetch_add(1, std::memory_order_relaxed);
      KVPOOL_LOG_INFO("put {} expired uncommitted (asked {} past its deadline); staging reclaimed",
                      put_id, absl::FormatDuration(late));
      puts_.erase(it);
    }
    return absl::NotFoundError(absl::StrCat(
        "put_id: ", put_id, " expired: not committed within the pool's put timeout of ",
        absl::ToInt64Milliseconds(timeout), " ms (its deadline passed ",
        absl::ToInt64Milliseconds(late), " ms ago); staging reclaimed, nothing of it visible"));
  }
  return it;
}

absl::Status BlockStore::AbortPut(const Digest& namespace_id, uint64_t put_id) {
  std::unique_lock lock(mu_);
  KVPOOL_ASSIGN_OR_RETURN(auto it, FindOpenPutLocked(namespace_id, put_id));
  if (it->second.writers > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("put_id: ", put_id, " is being written by the pool (WritePut)"));
  }
  ReleasePutLocked(it->second, true);
  puts_.erase(it);
  metrics_->put_aborts.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::StatusOr<CommitResult> BlockStore::CommitPut(const Digest& namespace_id, uint64_t put_id,
                                                   absl::Span<const BlockChecksum> checksums) {
  // Phase A: claim the put.
  const Model* m;
  std::vector<PutBlockState> blocks;
  {
    std::unique_lock lock(mu_);
    KVPOOL_ASSIGN_OR_RETURN(auto it, FindOpenPutLocked(namespace_id, put_id));
    if (it->second.writers > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("put_id: ", put_id, " is still being written by the pool (WritePut)"));
    }
    it->second.committing = true;
    m = it->second.model;
    blocks = it->second.blocks;
  }
  // Any failure from here on aborts the put.
  auto fail = [&](absl::Status s) -> absl::Status {
    std::unique_lock lock(mu_);
    auto it = puts_.find(put_id);
    if (it != puts_.end()) {
      ReleasePutLocked(it->second, true);
      puts_.erase(it);
    }
    metrics_->put_aborts.fetch_add(1, std::memory_order_relaxed);
    return s;
  };

  // Checksums: exactly one per WRITE block.
  std::vector<int64_t> want(blocks.size(), -1);
  for (size_t i = 0; i < checksums.size(); ++i) {
    const uint32_t idx = checksums[i].index;
    if (idx >= blocks.size() || blocks[idx].plan.action != PutAction::kWrite) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("checksums[", i, "].index: ", idx, " is not a WRITE block of this put")));
    }
    if (want[idx] >= 0) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("checksums[", i, "].index: duplicate checksum for block ", idx)));
    }
    want[idx] = static_cast<int64_t>(i);
  }
  for (const PutBlockState& b : blocks) {
    if (b.plan.action == PutAction::kWrite && want[b.plan.index] < 0) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("checksums: missing the checksum of block ", b.plan.index)));
    }
  }

  // Phase B (no lock): verify and encode into private buffers. The staging bytes belong to this
  // put (no one else writes or frees them while committing is set).
  const BlockGeometry& g = m->spec.geometry;
  const uint64_t sizes[kNumForms] = {g.Bf16FormBytes(), g.Int2FormBytes()};
  struct Encoded {
    bool wanted[kNumForms] = {false, false};
    std::vector<uint8_t> bytes[kNumForms];
    uint64_t xxh3[kNumForms] = {0, 0};
  };
  std::vector<Encoded> enc(blocks.size());
  uint64_t ingested = 0;
  uint8_t* base = memory_->data();
  // All WRITE blocks are encoded in one call (one device batch on the GPU encoder).
  std::vector<EncodeJob> jobs;
  std::vector<uint32_t> job_block;
  for (const PutBlockState& b : blocks) {
    if (b.plan.action != PutAction::kWrite) {
      continue;
    }
    const uint32_t i = b.plan.index;
    const uint8_t* staging = base + b.staging_offset;
    const uint64_t got = FormChecksum(staging, b.plan.size);
    const uint64_t expected = checksums[want[i]].xxh3;
    if (got != expected) {
      metrics_->checksum_failures.fetch_add(1, std::memory_order_relaxed);
      return fail(absl::DataLossError(absl::StrCat("block ", i, ": checksum mismatch (client sent ",
                                                   absl::Hex(expected), ", staging bytes hash to ",
                                                   absl::Hex(got), ")")));
    }
    Encoded& e = enc[i];
    for (FormKind f : b.plan.forms_added) {
      e.wanted[int(f)] = true;
    }
    const bool want_int2 = e.wanted[int(FormKind::kInt2)];
    e.bytes[int(FormKind::kBf16)].resize(sizes[0]);
    if (want_int2) {
      e.bytes[int(FormKind::kInt2)].resize(sizes[1]);
    }
    jobs.push_back(EncodeJob{.staging = staging,
                             .bf16_out = e.bytes[0].data(),
                             .int2_out = want_int2 ? e.bytes[1].data() : nullptr,
                             .bf16_wanted = e.wanted[int(FormKind::kBf16)]});
    job_block.push_back(i);
    ingested += b.plan.size;
  }
  if (absl::Status s = encoder_->EncodeBlocks(g, *m->rotation, m->spec.clip_ratio_k,
                                              m->spec.clip_ratio_v, absl::MakeSpan(jobs));
      !s.ok()) {
    return fail(s);
  }
  for (size_t k = 0; k < jobs.size(); ++k) {
    const uint32_t i = job_block[k];
    Encoded& e = enc[i];
    const EncodeResult& r = jobs[k].result;
    const absl::Status& s = jobs[k].status;
    if (!s.ok()) {
      if (s.code() == absl::StatusCode::kInvalidArgument) {
        metrics_->nonfinite_refusals.fetch_add(1, std::memory_order_relaxed);
      }
      return fail(Annotate(s, absl::StrCat("block ", i)));
    }
    const bool want_int2 = e.wanted[int(FormKind::kInt2)];
    if (want_int2 && !r.int2_ok) {
      // FORMAT.md §2.3: a group beyond fp16 is not quantized; the block keeps its BF16 form.
      e.wanted[int(FormKind::kInt2)] = false;
      e.wanted[int(FormKind::kBf16)] = true;
      e.bytes[int(FormKind::kInt2)].clear();
      metrics_->int2_overflow_blocks.fetch_add(1, std::memory_order_relaxed);
    }
    if (!e.wanted[int(FormKind::kBf16)]) {
      e.bytes[int(FormKind::kBf16)].clear();
    }
    for (int f = 0; f < kNumForms; ++f) {
      if (e.wanted[f]) {
        e.xxh3[f] = FormChecksum(e.bytes[f].data(), e.bytes[f].size());
      }
    }
  }

  // Phase C (lock): reserve slots for the new forms and pin the blocks this commit builds on.
  struct Reserved {
    Slot slot[kNumForms];
  };
  std::vector<Reserved> res(blocks.size());
  std::vector<Digest> commit_pins;
  {
    std::unique_lock lock(mu_);
    // First pin what the commit builds on and add up the new forms; refuse before evicting
    // anything when they cannot fit beside what no eviction frees (BeginPut checked this, but
    // leases or puts may have arrived since: newcomer report s8 N6, a doomed commit evicted
    // every unrelated block and then failed).
    uint64_t need = 0;
    uint32_t new_forms = 0;
    for (const PutBlockState& b : blocks) {
      const uint32_t i = b.plan.index;
      Block* existing = FindBlockLocked(b.plan.key);
      if (existing != nullptr) {
        PinLocked(*existing);
        commit_pins.push_back(b.plan.key);
      }
      for (int f = 0; f < kNumForms; ++f) {
        if (!enc[i].wanted[f]) continue;
        if (existing != nullptr && existing->forms[f].present) {
          enc[i].wanted[f] = false;  // added meanwhile by another put (same bytes)
          continue;
        }
        need += arena_.RoundUp(sizes[f]);
        ++new_forms;
      }
    }
    const uint64_t capacity = arena_.capacity();
    const uint64_t room = EvictableRoomLocked(0);
    if (need > room) {
      for (const Digest& k : commit_pins) UnpinLocked(k);
      const std::string why =
          absl::StrCat("num_blocks: the pool can no longer hold this put's commit: its ", new_forms,
                       " new forms need ", need,
                       " bytes while its staging is held, and eviction can make at "
                       "most ",
                       room, " of the pool's ", capacity, " bytes free (", staging_bytes_,
                       " bytes are staging of open puts, this one's included, ", pinned_bytes_,
                       " bytes are forms of leased or pinned blocks: leases, puts or commits taken "
                       "since BeginPut); "
                       "nothing was evicted; release leases or put fewer blocks");
      lock.unlock();
      return fail(absl::ResourceExhaustedError(why));
    }
    // Every new form at once, or none and nothing evicted (AllocateAllLocked).
    std::vector<uint64_t> form_sizes;
    for (const PutBlockState& b : blocks) {
      for (int f = 0; f < kNumForms; ++f) {
        if (enc[b.plan.index].wanted[f]) form_sizes.push_back(sizes[f]);
      }
    }
    absl::StatusOr<std::vector<uint64_t>> offsets = AllocateAllLocked(form_sizes, "new forms");
    if (!offsets.ok()) {
      for (const Digest& k : commit_pins) {
        UnpinLocked(k);
      }
      lock.unlock();
      return fail(offsets.status());
    }
    size_t next = 0;
    for (const PutBlockState& b : blocks) {
      const uint32_t i = b.plan.index;
      for (int f = 0; f < kNumForms; ++f) {
        if (!enc[i].wanted[f]) {
          continue;
        }
        res[i].slot[f] = Slot{.present = true,
                              .offset = (*offsets)[next++],
                              .size = sizes[f],
                              .generation = NextGeneration(),
                              .xxh3 = enc[i].xxh3[f]};
      }
    }
  }

  // Phase D (no lock): copy into the reserved slots; nobody can see them yet. Then the lines of
  // the last kDemoteTailBytes written, still in this core's L2, go to the shared cache: a
  // reader's first fetch (another process, usually right after the commit, often with several
  // copy threads) then reads them from there instead of snooping this one core for every line
  // (a micro-benchmark on the H200 host: 8 threads copied and hashed a just-written 1 MiB form
  // at 42 GB/s instead of 24; docs/TRANSPORT.md "Session 6").
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (int f = 0; f < kNumForms; ++f) {
      const Slot& s = res[i].slot[f];
      if (s.present) {
        std::memcpy(base + s.offset, enc[i].bytes[f].data(), s.size);
      }
    }
  }
  {
    uint64_t left = kDemoteTailBytes;
    for (size_t i = blocks.size(); i-- > 0 && left > 0;) {
      for (int f = kNumForms; f-- > 0 && left > 0;) {
        const Slot& s = res[i].slot[f];
        if (!s.present) continue;
        const uint64_t n = std::min<uint64_t>(left, s.size);
        DemoteToSharedCache(base + s.offset + s.size - n, n);
        left -= n;
      }
    }
  }

  // Phase E (lock): link every block at once, release the put. All shard locks are held so
  // a concurrent Lookup sees all of the commit or none of it.
  CommitResult result;
  result.bytes_ingested = ingested;
  {
    std::unique_lock lock(mu_);
    std::array<std::unique_lock<std::shared_mutex>, kShards> shard_locks;
    for (int s = 0; s < kShards; ++s) {
      shard_locks[s] = std::unique_lock<std::shared_mutex>(shards_[s].mu);
    }
    for (const PutBlockState& b : blocks) {
      const uint32_t i = b.plan.index;
      Block* blk = FindBlockLocked(b.plan.key);
      // An existing block whose every form was dropped as corrupt gets them back here.
      const bool was_formless = blk != nullptr && !HoldsAForm(*blk);
      bool have_new = false;
      for (int f = 0; f < kNumForms; ++f) {
        have_new |= res[i].slot[f].present;
      }
      if (blk == nullptr) {
        if (!have_new) {
          continue;  // cannot happen: absent blocks are pinned or written
        }
        Block nb;
        nb.key = b.plan.key;
        nb.parent = b.parent;
        nb.model = m;
        ++m->blocks;
        nb.index = i;
        nb.sink = i < m->info.sink_blocks;
        nb.lru = lru_.insert(lru_.end(), nb.key);
        blk = &ShardOf(nb.key).blocks.emplace(nb.key, std::move(nb)).first->second;
        if (b.parent.has_value()) {
          if (Block* p = FindBlockLocked(*b.parent)) {
            p->children.push_back(b.plan.key);
          }
        }
      } else {
        lru_.splice(lru_.end(), lru_, blk->lru);
      }
      for (int f = 0; f < kNumForms; ++f) {
        Slot& s = res[i].slot[f];
        if (!s.present) {
          continue;
        }
        if (blk->forms[f].present) {
          arena_.Free(s.offset, s.size);  // a concurrent commit linked the same form first
          continue;
        }
        blk->forms[f] = s;
        form_count_[f]++;
        form_bytes_[f] += s.size;
        if (blk->pins > 0) pinned_bytes_ += arena_.RoundUp(s.size);
      }
      if (was_formless && HoldsAForm(*blk) && formless_blocks_ > 0) --formless_blocks_;
      bool present[kNumForms];
      for (int f = 0; f < kNumForms; ++f) {
        present[f] = blk->forms[f].present;
      }
      result.blocks.push_back({.index = i, .key = b.plan.key, .forms = HeldForms(present)});
    }
    for (auto& sl : shard_locks) {
      sl.unlock();
    }
    for (const Digest& k : commit_pins) {
      UnpinLocked(k);
    }
    auto pit = puts_.find(put_id);
    if (pit != puts_.end()) {
      ReleasePutLocked(pit->second, true);
      puts_.erase(pit);
    }
  }
  metrics_->commit_bytes.fetch_add(ingested, std::memory_order_relaxed);
  metrics_->commit_size.Observe(static_cast<double>(ingested));
  return result;
}

// ---- lookup and leases -------------------------------------------------------------------------

absl::StatusOr<std::vector<BlockFormsInfo>> BlockStore::Lookup(const Digest& namespace_id,
                                                               const KeyQuery& query) const {
  std::shared_ptr<const Model> model_ref;  // keeps the model alive for this call
  {
    std::shared_lock lock(models_mu_);
    KVPOOL_ASSIGN_OR_RETURN(model_ref, FindModelLocked(namespace_id));
  }
  const Model* m = model_ref.get();
  KVPOOL_ASSIGN_OR_RETURN(std::vector<Digest> keys, ResolveKeys(*m, query, 0));
  std::vector<BlockFormsInfo> out;
  // Only shard locks, one at a time (see the lock comment in store.h).
  for (const Digest& k : keys) {
    const Shard& sh = ShardOf(k);
    std::shared_lock shard_lock(sh.mu);
    auto it = sh.blocks.find(k);
    if (it == sh.blocks.end() || it->second.model != m || !HoldsAForm(it->second)) {
      break;  // absent, or every form dropped as corrupt (ReportCorrupt)
    }
    KVPOOL_RETURN_IF_ERROR(CheckChainPosition(keys, static_cast<uint32_t>(out.size()), it->second));
    bool present[kNumForms];
    for (int f = 0; f < kNumForms; ++f) {
      present[f] = it->second.forms[f].present;
    }
    out.push_back({.key = k, .sink = it->second.sink, .forms = HeldForms(present)});
  }
  metrics_->lookup_calls.fetch_add(1, std::memory_order_relaxed);
  metrics_->lookup_hit_blocks.fetch_add(out.size(), std::memory_order_relaxed);
  // A miss is a held prefix that ends before the request's last full block; a request with no
  // full block (fewer tokens than one page) has nothing to miss.
  if (out.size() < keys.size()) {
    metrics_->lookup_miss_calls.fetch_add(1, std::memory_order_relaxed);
  }
  return out;
}

absl::StatusOr<LeaseGrant> BlockStore::Acquire(const Digest& namespace_id, const KeyQuery& query,
                                               uint32_t max_blocks, absl::Duration lease) {
  std::shared_ptr<const Model> model_ref;  // keeps the model alive for this call
  {
    std::shared_lock lock(models_mu_);
    KVPOOL_ASSIGN_OR_RETURN(model_ref, FindModelLocked(namespace_id));
  }
  const Model* m = model_ref.get();
  KVPOOL_ASSIGN_OR_RETURN(std::vector<Digest> keys, ResolveKeys(*m, query, max_blocks));
  if (lease <= absl::ZeroDuration()) {
    lease = options_.default_lease;
  }
  lease = std::min(lease, options_.max_lease);
  LeaseGrant grant;
  grant.lifetime = lease;
  uint64_t bytes = 0;
  {
    std::unique_lock lock(mu_);
    Lease l;
    for (uint32_t i = 0; i < keys.size(); ++i) {
      Block* found = FindBlockLocked(keys[i]);
      if (found == nullptr || found->model != m || !HoldsAForm(*found)) {
        break;  // absent, or every form dropped as corrupt (ReportCorrupt)
      }
      Block& b = *found;
      if (absl::Status chain = CheckChainPosition(keys, i, b); !chain.ok()) {
        for (const Digest& k : l.keys) UnpinLocked(k);  // nothing leased
        return chain;
      }
      PinLocked(b);
      lru_.splice(lru_.end(), lru_, b.lru);
      l.keys.push_back(keys[i]);
      LeasedBlock lb{.index = i, .key = keys[i], .sink = b.sink};
      for (int f = 0; f < kNumForms; ++f) {
        const Slot& s = b.forms[f];
        if (!s.present) {
          continue;
        }
        lb.forms.push_back({.form = static_cast<FormKind>(f),
                            .offset = s.offset,
                            .size = s.size,
                            .generation = s.generation,
                            .xxh3 = s.xxh3});
        bytes += s.size;
      }
      grant.blocks.push_back(std::move(lb));
    }
    if (!l.keys.empty()) {
      l.deadline = clock_->Now() + lease;
      grant.lease_id = NewIdLocked();
      leases_.emplace(grant.lease_id, std::move(l));
    }
  }
  // Blocks the recipe gives a BF16 form at this prefix's length (TargetForms: its recent
  // window, or sinks and bf16-history blocks, which always hold one) leased without it.
  const uint32_t n = static_cast<uint32_t>(grant.blocks.size());
  uint64_t int2_only = 0;
  for (uint32_t i = 0; i < n; ++i) {
    bool target[kNumForms];
    TargetForms(*m, i, n, target);
    const auto& fs = grant.blocks[i].forms;
    if (target[int(FormKind::kBf16)] &&
        std::none_of(fs.begin(), fs.end(),
                     [](const FormLocation& f) { return f.form == FormKind::kBf16; })) {
      ++int2_only;
    }
  }
  metrics_->lease_window_int2_only_blocks.fetch_add(int2_only, std::memory_order_relaxed);
  metrics_->lookup_calls.fetch_add(1, std::memory_order_relaxed);
  metrics_->lookup_hit_blocks.fetch_add(grant.blocks.size(), std::memory_order_relaxed);
  if (grant.blocks.size() < keys.size()) {  // as in Lookup: no full block, no miss
    metrics_->lookup_miss_calls.fetch_add(1, std::memory_order_relaxed);
  }
  metrics_->fetch_bytes.fetch_add(bytes, std::memory_order_relaxed);
  metrics_->fetch_size.Observe(static_cast<double>(bytes));
  return grant;
}

absl::StatusOr<absl::Duration> BlockStore::Renew(uint64_t lease_id, absl::Duration lease) {
  if (lease <= absl::ZeroDuration()) {
    lease = options_.default_lease;
  }
  lease = std::min(lease, options_.max_lease);
  std::unique_lock lock(mu_);
  const absl::Time now = clock_->Now();
  auto it = leases_.find(lease_id);
  if (it == leases_.end() || it->second.deadline <= now) {
    return absl::NotFoundError(absl::StrCat("lease_id: ", lease_id, " is unknown or expired"));
  }
  it->second.deadline = now + lease;
  return lease;
}

absl::Status BlockStore::Release(uint64_t lease_id) {
  std::unique_lock lock(mu_);
  auto it = leases_.find(lease_id);
  // A lease past its deadline is expired even if Tick has not run yet: the reader must treat
  // the bytes it read as suspect (fail closed).
  const bool expired = it != leases_.end() && it->second.deadline <= clock_->Now();
  if (it != leases_.end()) {
    for (const Digest& k : it->second.keys) {
      UnpinLocked(k);
    }
    leases_.erase(it);
    if (expired) {
      metrics_->lease_expiries.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (it == leases_.end() || expired) {
    return absl::NotFoundError(absl::StrCat("lease_id: ", lease_id,
                                            " is unknown or expired; discard bytes read under it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ItemResult>> BlockStore::Delete(const Digest& namespace_id,
                                                           absl::Span<const Digest> keys,
                                                           uint32_t* blocks_deleted) {
  std::unique_lock lock(mu_);
  std::shared_ptr<const Model> model_ref;  // keeps the model alive for this call
  {
    std::shared_lock models_lock(models_mu_);
    KVPOOL_ASSIGN_OR_RETURN(model_ref, FindModelLocked(namespace_id));
  }
  const Model* m = model_ref.get();
  std::vector<ItemResult> out;
  uint32_t deleted = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const Block* found = FindBlockLocked(keys[i]);
    if (found == nullptr || found->model != m) {
      out.push_back({absl::NotFoundError(absl::StrCat("keys[", i, "]: not held"))});
      continue;
    }
    // Collect the subtree, parents before children.
    std::vector<Digest> order = {keys[i]};
    bool pinned = false;
    for (size_t j = 0; j < order.size(); ++j) {
      const Block& b = *FindBlockLocked(order[j]);
      pinned |= b.pins > 0;
      for (const Digest& c : b.children) {
        order.push_back(c);
      }
    }
    if (pinned) {
      out.push_back({absl::FailedPreconditionError(absl::StrCat(
          "keys[", i, "]: the block or a descendant is leased or pinned by an open put"))});
      continue;
    }
    for (auto r = order.rbegin(); r != order.rend(); ++r) {
      RemoveBlockLocked(*r, "delete");
      ++deleted;
    }
    out.push_back({absl::OkStatus()});
  }
  metrics_->deletions_block.fetch_add(deleted, std::memory_order_relaxed);
  if (blocks_deleted) {
    *blocks_deleted = deleted;
  }
  return out;
}

StoreStats BlockStore::Stats() const {
  std::shared_lock lock(mu_);
  StoreStats s;
  s.capacity_bytes = arena_.capacity();
  s.used_bytes = arena_.used_bytes();
  s.staging_bytes = staging_bytes_;
  s.pinned_bytes = pinned_bytes_;
  for (const Shard& sh : shards_) {
    s.blocks += sh.blocks.size();
  }
  s.blocks -= std::min<uint64_t>(s.blocks, formless_blocks_);  // they hold nothing readable
  for (int f = 0; f < kNumForms; ++f) {
    s.forms[f] = form_count_[f];
    s.form_bytes[f] = form_bytes_[f];
  }
  s.open_puts = puts_.size();
  const absl::Time now = clock_->Now();
  for (const auto& [id, lease] : leases_) {
    if (lease.deadline > now) ++s.leases;  // one past its deadline is expired before the tick
  }
  s.commit_device = std::string(encoder_->device_name());
  {
    std::shared_lock models_lock(models_mu_);
    s.models = static_cast<uint32_t>(models_.size());
    s.registration_bytes = registration_bytes_;
  }
  return s;
}

absl::StatusOr<std::vector<StagingRange>> BlockStore::BeginPutWrite(const Digest& namespace_id,
                                                                    uint64_t put_id,
                                                                    absl::Duration* time_left) {
  std::unique_lock lock(mu_);
  KVPOOL_ASSIGN_OR_RETURN(auto it, FindOpenPutLocked(namespace_id, put_id));
  std::vector<StagingRange> out;
  for (const PutBlockState& b : it->second.blocks) {
    if (b.plan.action == PutAction::kWrite) {
      out.push_back({b.plan.index, b.staging_offset, b.plan.size});
    }
  }
  ++it->second.writers;
  if (time_left != nullptr) *time_left = it->second.deadline - clock_->Now();
  return out;
}

void BlockStore::EndPutWrite(uint64_t put_id) {
  std::unique_lock lock(mu_);
  auto it = puts_.find(put_id);
  if (it != puts_.end() && it->second.writers > 0) {
    --it->second.writers;
  }
}

absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> BlockStore::LeasedRanges(
    uint64_t lease_id, std::vector<std::pair<uint64_t, uint64_t>>* dropped) {
  std::shared_lock lock(mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end() || it->second.deadline <= clock_->Now()) {
    return absl::NotFoundError(absl::StrCat("lease_id: ", lease_id, " is unknown or expired"));
  }
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const Digest& k : it->second.keys) {
    const Shard& shard = ShardOf(k);
    std::shared_lock shard_lock(shard.mu);
    auto b = shard.blocks.find(k);
    if (b == shard.blocks.end()) {
      continue;
    }
    for (const Slot& slot : b->second.forms) {
      if (slot.present) {
        out.emplace_back(slot.offset, slot.size);
      }
    }
    if (dropped != nullptr) {
      for (const Slot& slot : b->second.dropped) dropped->emplace_back(slot.offset, slot.size);
    }
  }
  std::sort(out.begin(), out.end());
  if (dropped != nullptr) std::sort(dropped->begin(), dropped->end());
  return out;
}

// ---- corruption reports ------------------------------------------------------------------------

namespace {

// The dedupe key of a reported form: its block key, form and generation.
std::string VerifiedFormId(const Digest& key, FormKind form, uint64_t generation) {
  std::string id(reinterpret_cast<const char*>(key.data()), key.size());
  id.push_back(static_cast<char>(form));
  id.append(reinterpret_cast<const char*>(&generation), sizeof(generation));
  return id;
}

}  // namespace

bool BlockStore::TakeReportTokenLocked(const std::string& client, absl::Time now) {
  const double rate = options_.corruption_reports_per_second;
  if (rate <= 0) return true;
  const double burst = options_.corruption_report_burst;
  auto it = report_buckets_.find(client);
  if (it == report_buckets_.end()) {
    if (report_buckets_.size() >= kMaxReportClients) {
      // Drop the buckets that have refilled (their clients are quiet); else the stalest one.
      auto stalest = report_buckets_.end();
      for (auto b = report_buckets_.begin(); b != report_buckets_.end();) {
        if (b->second.tokens + rate * absl::ToDoubleSeconds(now - b->second.last) >= burst) {
          b = report_buckets_.erase(b);
          continue;
        }
        if (stalest == report_buckets_.end() || b->second.last < stalest->second.last) stalest = b;
        ++b;
      }
      if (report_buckets_.size() >= kMaxReportClients) report_buckets_.erase(stalest);
    }
    it = report_buckets_.emplace(client, ReportBucket{.tokens = burst, .last = now}).first;
  }
  ReportBucket& b = it->second;
  b.tokens = std::min(burst, b.tokens + rate * std::max(0.0, absl::ToDoubleSeconds(now - b.last)));
  b.last = now;
  if (b.tokens < 1) return false;
  b.tokens -= 1;
  return true;
}

void BlockStore::NoteVerifiedIntactLocked(const std::string& id, absl::Time now) {
  const absl::Duration window = options_.corruption_report_dedupe_window;
  if (window <= absl::ZeroDuration()) return;
  if (verified_intact_.size() >= kMaxVerifiedForms && !verified_intact_.contains(id)) {
    auto oldest = verified_intact_.end();
    for (auto v = verified_intact_.begin(); v != verified_intact_.end();) {
      if (now - v->second >= window) {
        v = verified_intact_.erase(v);
        continue;
      }
      if (oldest == verified_intact_.end() || v->second < oldest->second) oldest = v;
      ++v;
    }
    if (verified_intact_.size() >= kMaxVerifiedForms) verified_intact_.erase(oldest);
  }
  verified_intact_[id] = now;
}

absl::StatusOr<std::vector<CorruptionOutcome>> BlockStore::ReportCorrupt(
    const Digest& namespace_id, absl::Span<const CorruptionReport> reports,
    const std::string& client) {
  std::shared_ptr<const Model> model_ref;  // keeps the model alive for this call
  {
    std::shared_lock lock(models_mu_);
    KVPOOL_ASSIGN_OR_RETURN(model_ref, FindModelLocked(namespace_id));
  }
  const Model* m = model_ref.get();
  if (reports.empty()) {
    return absl::InvalidArgumentError("reports: empty (name at least one form)");
  }
  if (reports.size() > kMaxCorruptionReports) {
    return absl::InvalidArgumentError(absl::StrCat("reports: ", reports.size(),
                                                   " in one call, at most ", kMaxCorruptionReports,
                                                   " are accepted"));
  }
  std::vector<CorruptionOutcome> out(reports.size());
  // The forms to re-verify: the slot as the report found it, pinned until phase 3.
  struct Check {
    size_t report;
    Slot slot;
    bool corrupt = false;
    uint64_t hashed = 0;
  };
  std::vector<Check> checks;
  // A refused report changes nothing; its outcome still says whether the named block holds a
  // form (`b`: the block in this namespace, or null when the key names none).
  auto refuse = [&](size_t i, absl::Status s, const Block* b) {
    out[i].status = std::move(s);
    out[i].block_held = b != nullptr && HoldsAForm(*b);
    metrics_->corruption_reports_refused.fetch_add(1, std::memory_order_relaxed);
  };
  // Phase 1 (lock): every report must name a form held now, with the generation it has now.
  // Then a form verified intact within the dedupe window is answered from that verification,
  // and every other one needs a token of the client's bucket before it is hashed.
  std::vector<size_t> accepted;  // reports answered or to be hashed, for the duplicate check
  {
    std::unique_lock lock(mu_);
    const absl::Time now = clock_->Now();
    for (size_t i = 0; i < reports.size(); ++i) {
      const CorruptionReport& r = reports[i];
      const std::string what = absl::StrCat("block ", ToHex(r.key).substr(0, 12));
      Block* b = FindBlockLocked(r.key);
      if (b == nullptr || b->model != m) {
        refuse(i,
               absl::NotFoundError(
                   absl::StrCat("reports[", i, "].key: ", what, " is not held in this namespace")),
               nullptr);
        continue;
      }
      const Slot& slot = b->forms[int(r.form)];
      if (!slot.present) {
        refuse(i,
               absl::NotFoundError(absl::StrCat(
                   "reports[", i, "].form: ", what, " holds no ", FormName(r.form),
                   " form (dropped already, demoted, or never stored); nothing changed")),
               b);
        continue;
      }
      if (slot.generation != r.generation) {
        refuse(i,
               absl::FailedPreconditionError(absl::StrCat(
                   "reports[", i, "].generation: ", r.generation, " is not the generation of ",
                   what, "'s stored ", FormName(r.form),
                   " form (stored again since the reader's lease: a stale report); nothing "
                   "changed")),
               b);
        continue;
      }
      bool duplicate = false;
      for (size_t j : accepted) {
        const CorruptionReport& other = reports[j];
        if (other.key == r.key && other.form == r.form) {
          refuse(i,
                 absl::InvalidArgumentError(
                     absl::StrCat("reports[", i, "]: names the same form as reports[", j, "]")),
                 b);
          duplicate = true;
          break;
        }
      }
      if (duplicate) continue;
      accepted.push_back(i);
      const auto verified = verified_intact_.find(VerifiedFormId(r.key, r.form, r.generation));
      if (verified != verified_intact_.end() &&
          now - verified->second < options_.corruption_report_dedupe_window) {
        out[i].verdict = CorruptionVerdict::kIntact;  // status OK: verified within the window
        out[i].block_held = true;
        metrics_->corruption_reports_dropped_duplicate.fetch_add(1, std::memory_order_relaxed);
        KVPOOL_LOG_DEBUG(
            "corruption report of {} {} form generation {}: verified intact {} ago, "
            "not hashed again",
            what, FormName(r.form), r.generation, absl::FormatDuration(now - verified->second));
        continue;
      }
      if (!TakeReportTokenLocked(client, now)) {
        out[i].status = absl::ResourceExhaustedError(absl::StrCat(
            "reports[", i, "]: not re-verified: this client (", client.empty() ? "-" : client,
            ") is over its rate of ", options_.corruption_reports_per_second,
            " re-verified reports per second (burst ", options_.corruption_report_burst,
            ", kvpool-server --corruption-report-rate/--corruption-report-burst); nothing "
            "changed, report again later"));
        out[i].block_held = HoldsAForm(*b);
        metrics_->corruption_reports_dropped_rate.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      PinLocked(*b);  // neither evicted, demoted, deleted nor freed while its bytes are hashed
      checks.push_back({.report = i, .slot = slot});
    }
  }
  // Phase 2 (no lock): hash the stored bytes; the pins keep them in place.
  const uint8_t* base = memory_->data();
  for (Check& c : checks) {
    c.hashed = FormChecksum(base + c.slot.offset, c.slot.size);
    c.corrupt = c.hashed != c.slot.xxh3;
  }
  // Phase 3 (lock): drop what is corrupt, unpin.
  std::unique_lock lock(mu_);
  for (const Check& c : checks) {
    const CorruptionReport& r = reports[c.report];
    CorruptionOutcome& o = out[c.report];
    Block* b = FindBlockLocked(r.key);  // pinned in phase 1: still there
    const std::string where =
        absl::StrCat("block ", ToHex(r.key), " (model ", m->spec.model_id, ", index ", b->index,
                     ") ", FormName(r.form), " form, generation ", c.slot.generation);
    if (!c.corrupt) {
      o.verdict = CorruptionVerdict::kIntact;
      NoteVerifiedIntactLocked(VerifiedFormId(r.key, r.form, c.slot.generation), clock_->Now());
      metrics_->checksum_failures_fetch_transit.fetch_add(1, std::memory_order_relaxed);
      KVPOOL_LOG_INFO(
          "a reader reported {} corrupt (it computed {:x}); the stored bytes verify ({:x}), so the "
          "form is kept: its copy was damaged in transit or in the reader",
          where, r.observed_xxh3, c.slot.xxh3);
    } else {
      o.verdict = CorruptionVerdict::kDropped;
      const Slot& now = b->forms[int(r.form)];
      if (now.present && now.generation == c.slot.generation) {  // not dropped meanwhile
        DropCorruptFormLocked(*b, r.form);
        metrics_->checksum_failures_fetch_stored.fetch_add(1, std::memory_order_relaxed);
        KVPOOL_LOG_WARN(
            "{} is corrupt in the pool: its bytes hash to {:x}, the checksum computed at commit "
            "is {:x} (a reader reported it, computing {:x}); the form is dropped{}",
            where, c.hashed, c.slot.xxh3, r.observed_xxh3,
            HoldsAForm(*b) ? ""
                           : "; the block holds no other form, so lookups stop before it until it "
                             "is put again");
      }
    }
    o.block_held = HoldsAForm(*b);
    UnpinLocked(r.key);  // frees the dropped bytes when this was the last pin
    const Block* after = FindBlockLocked(r.key);
    o.bytes_freed =
        o.verdict == CorruptionVerdict::kDropped && (after == nullptr || after->dropped.empty());
  }
  return out;
}

}  // namespace kvpool::kvstore
