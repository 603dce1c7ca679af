// BlockStore: registration, two-phase puts, forms per block, leases, expiry, eviction, delete,
// failure paths. Heap memory and a FakeClock; the "client" writes staging bytes directly.
#include "kvpool/kvstore/store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "kvpool/common/checksum.h"
#include "kvpool/common/room_shortage.h"
#include "test_util.h"

namespace kvpool::kvstore {
namespace {

using testing::BlockBytes;
using ::testing::HasSubstr;
using testing::RotationFileFor;
using testing::TinySpec;
using testing::Tokens;

constexpr FormKind kB = FormKind::kBf16;
constexpr FormKind kI = FormKind::kInt2;

class StoreTest : public ::testing::Test {
 protected:
  void Init(uint64_t capacity, HistoryPrecision p = HistoryPrecision::kInt2,
            StoreOptions opts = {}) {
    mem_ = *HeapPoolMemory::Create(capacity);
    store_ = *BlockStore::Create(opts, mem_.get(), &clock_);
    spec_ = TinySpec(p);
    auto info = store_->RegisterModel(spec_, {.file_bytes = RotationFileFor(spec_)});
    ASSERT_TRUE(info.ok()) << info.status();
    info_ = *info;
    ns_ = info_.namespace_id;
  }
  void SetUp() override { Init(1 << 20); }

  // Writes the staging bytes of every WRITE block and returns their checksums.
  std::vector<BlockChecksum> Write(const PutPlan& plan, uint32_t seq) {
    std::vector<BlockChecksum> sums;
    for (const PutBlockPlan& b : plan.blocks) {
      if (b.action != PutAction::kWrite) {
        continue;
      }
      std::vector<uint8_t> bytes = BlockBytes(spec_.geometry, seq, b.index);
      EXPECT_EQ(bytes.size(), b.size);
      std::memcpy(mem_->data() + b.staging_offset, bytes.data(), bytes.size());
      sums.push_back({b.index, FormChecksum(bytes.data(), bytes.size())});
    }
    return sums;
  }

  absl::StatusOr<CommitResult> Put(uint32_t seq, uint32_t blocks, uint32_t shared = 0) {
    auto plan = store_->BeginPut(ns_, Tokens(seq, blocks * 4, shared), blocks, {});
    if (!plan.ok()) {
      return plan.status();
    }
    return store_->CommitPut(ns_, plan->put_id, Write(*plan, seq));
  }

  std::vector<std::vector<FormKind>> Forms(uint32_t seq, uint32_t blocks, uint32_t shared = 0) {
    auto r = store_->Lookup(ns_, {.token_ids = Tokens(seq, blocks * 4, shared)});
    EXPECT_TRUE(r.ok()) << r.status();
    std::vector<std::vector<FormKind>> out;
    for (const auto& b : *r) {
      out.push_back(b.forms);
    }
    return out;
  }

  FakeClock clock_;
  std::unique_ptr<HeapPoolMemory> mem_;
  std::unique_ptr<BlockStore> store_;
  ModelSpec spec_;
  ModelInfo info_;
  Digest ns_{};
};

// A request of fewer tokens than one block (page_size 4 here) has no full block, so it cannot
// miss: it is a Lookup/Acquire call with 0 blocks, not a miss (kvpool_lookup_misses_total is
// "calls whose held prefix ended before the request's end"). It used to count as one.
TEST_F(StoreTest, RequestWithNoFullBlockCountsAsACallNotAMiss) {
  ASSERT_TRUE(Put(1, 2).ok());
  const Metrics& m = store_->metrics();
  auto short_lookup = store_->Lookup(ns_, {.token_ids = Tokens(1, 3)});
  ASSERT_TRUE(short_lookup.ok()) << short_lookup.status();
  EXPECT_TRUE(short_lookup->empty());
  auto short_acquire = store_->Acquire(ns_, {.token_ids = Tokens(1, 3)}, 0, absl::Seconds(1));
  ASSERT_TRUE(short_acquire.ok()) << short_acquire.status();
  EXPECT_EQ(short_acquire->lease_id, 0u);
  EXPECT_EQ(m.lookup_calls.load(), 2u);
  EXPECT_EQ(m.lookup_miss_calls.load(), 0u);
  // The held 8 tokens plus a partial tail: a full hit, no miss; one more full block: a miss.
  EXPECT_EQ(store_->Lookup(ns_, {.token_ids = Tokens(1, 10)})->size(), 2u);
  EXPECT_EQ(m.lookup_miss_calls.load(), 0u);
  EXPECT_EQ(store_->Lookup(ns_, {.token_ids = Tokens(1, 12)})->size(), 2u);
  EXPECT_EQ(m.lookup_miss_calls.load(), 1u);
  EXPECT_EQ(m.lookup_calls.load(), 4u);
}

TEST_F(StoreTest, RegistrationIsIdempotentAndMismatchListsEveryField) {
  EXPECT_EQ(info_.bf16_form_bytes, 512u);
  EXPECT_EQ(info_.int2_form_bytes, 192u);
  EXPECT_EQ(info_.sink_blocks, 1u);
  EXPECT_EQ(info_.recent_blocks, 2u);
  EXPECT_TRUE(info_.created);
  auto again = store_->RegisterModel(spec_, {.file_bytes = RotationFileFor(spec_)});
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->namespace_id, ns_);
  // Re-attach by rotation id.
  auto by_id = store_->RegisterModel(spec_, {.id = info_.rotation_id});
  ASSERT_TRUE(by_id.ok()) << by_id.status();
  EXPECT_EQ(by_id->namespace_id, ns_);

  ModelSpec other = spec_;
  other.sink_tokens = 8;
  other.recent_tokens = 16;
  other.clip_ratio_k = 0.5f;
  auto bad = store_->RegisterModel(other, {.id = info_.rotation_id});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  for (const char* f : {"recipe.sink_tokens", "recipe.recent_tokens", "recipe.clip_ratio_k"}) {
    EXPECT_NE(bad.status().message().find(f), std::string_view::npos) << bad.status();
  }
  EXPECT_EQ(bad.status().message().find("recipe.clip_ratio_v"), std::string_view::npos);

  // Same model, another revision: a separate namespace.
  ModelSpec rev = spec_;
  rev.revision = "r2";
  auto r2 = store_->RegisterModel(rev, {.id = info_.rotation_id});
  ASSERT_TRUE(r2.ok());
  EXPECT_NE(r2->namespace_id, ns_);
}

// A rotation re-attached by rotation_id must fit the new registration like a file sent with it
// (newcomer 12 F1): another revision with another head_dim, layer count, KV head count or clip
// ratio was accepted, and its commits rotated rows with matrices of the wrong shape (a crash at
// head_dim 256 over the 8x8 file; elsewhere blocks encoded from memory past the matrices, served
// as valid). Each is refused FAILED_PRECONDITION naming rotation_id and the field; nothing stored
// before is touched and the matching registration still re-attaches.
TEST_F(StoreTest, ARotationReattachedByIdMustFitTheModel) {
  ASSERT_TRUE(Put(1, 3).ok());
  const auto before = Forms(1, 3);
  struct Case {
    const char* field;
    void (*change)(ModelSpec&);
  };
  const Case cases[] = {
      {"head_dim", [](ModelSpec& s) { s.geometry.head_dim *= 2; }},
      {"num_layers", [](ModelSpec& s) { s.geometry.num_layers += 1; }},
      {"num_kv_heads", [](ModelSpec& s) { s.geometry.num_kv_heads *= 2; }},
      {"clip_ratio_k", [](ModelSpec& s) { s.clip_ratio_k = 0.5f; }},
      {"clip_ratio_v", [](ModelSpec& s) { s.clip_ratio_v = 0.5f; }},
  };
  for (const Case& c : cases) {
    ModelSpec other = spec_;
    other.revision = std::string("bad-") + c.field;
    c.change(other);
    auto r = store_->RegisterModel(other, {.id = info_.rotation_id});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << c.field << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("rotation_id")) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.field)) << r.status();
  }
  EXPECT_EQ(Forms(1, 3), before);
  ModelSpec fits = spec_;
  fits.revision = "r2";
  auto ok = store_->RegisterModel(fits, {.id = info_.rotation_id});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(ok->created);
}

// A recalibrated rotation file registers a new revision (kvpool-worker --revision auto), whose
// lookups miss everything stored under the old one, silently (newcomer s10b). The registration
// names the other revisions of the model id that hold blocks, with their rotation ids.
TEST_F(StoreTest, RegistrationNamesTheOtherRevisionsOfTheModelIdThatHoldBlocks) {
  ModelSpec rev = spec_;
  rev.revision = "r2";
  auto empty = store_->RegisterModel(rev, {.id = info_.rotation_id});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->other_revisions.empty());  // the first revision holds no block yet
  ASSERT_TRUE(Put(1, 3).ok());
  auto again = store_->RegisterModel(rev, {.id = info_.rotation_id});
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->other_revisions.size(), 1u);
  EXPECT_EQ(again->other_revisions[0].revision, spec_.revision);
  EXPECT_EQ(again->other_revisions[0].rotation_id, info_.rotation_id);
  EXPECT_EQ(again->other_revisions[0].blocks, 3u);
  // Its own revision is not listed, nor another model id's.
  auto own = store_->RegisterModel(spec_, {.id = info_.rotation_id});
  ASSERT_TRUE(own.ok());
  EXPECT_TRUE(own->other_revisions.empty());
  ModelSpec other_id = spec_;
  other_id.model_id = "another-model";
  auto other = store_->RegisterModel(other_id, {.id = info_.rotation_id});
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(other->other_revisions.empty());
}

// A conflicting registration whose rotation file also disagrees with its clip ratio was refused
// with the rotation file's mismatch only, hiding the page_size / sink / recent differences
// (newcomer s7 F5; PROTOCOL.md: "listing every differing field"): one FAILED_PRECONDITION lists
// them all, and the rotation file's own mismatch.
TEST_F(StoreTest, AConflictThatAlsoFailsTheRotationCheckListsEveryDifferingField) {
  ModelSpec other = spec_;  // P 4, S 4, W 8, clip 0.96 / 0.92 registered
  other.geometry.page_size = 8;
  other.sink_tokens = 8;
  other.recent_tokens = 16;
  other.clip_ratio_k = 0.5f;
  const std::string file = RotationFileFor(spec_);  // says clip_ratio_k 0.96
  for (bool redact : {false, true}) {
    auto bad = store_->RegisterModel(
        other, {.file_bytes = file, .field = "rotation_path 'r'", .redact_file_content = redact});
    ASSERT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();
    const std::string msg(bad.status().message());
    for (const char* f :
         {"model default/tiny@r1 is registered with a different layout: ",
          "page_size (registered 4, requested 8)", "recipe.sink_tokens (registered 4, requested 8)",
          "recipe.recent_tokens (registered 8, requested 16)",
          "recipe.clip_ratio_k (registered 0.96, requested 0.5)"}) {
      EXPECT_NE(msg.find(f), std::string::npos) << f << "\n" << msg;
    }
    EXPECT_EQ(msg.find("clip_ratio_v"), std::string::npos) << msg;
    if (redact) {  // the file's numbers stay on the pool's host
      EXPECT_NE(msg.find("the rotation file does not match the model"), std::string::npos) << msg;
      EXPECT_EQ(msg.find("0.96 != 0.5"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("rotation file does not match the model: clip_ratio_k 0.96 != 0.5"),
                std::string::npos)
          << msg;
    }
  }
  // Without a registration under that identity, the rotation check alone speaks, as before.
  other.revision = "fresh";
  auto alone = store_->RegisterModel(other, {.file_bytes = file});
  ASSERT_EQ(alone.status().code(), absl::StatusCode::kFailedPrecondition) << alone.status();
  EXPECT_EQ(alone.status().message(),
            "rotation file does not match the model: clip_ratio_k 0.96 != 0.5");
  EXPECT_EQ(store_->Stats().models, 1u);
}

// An empty revision was accepted ("registered model default/m@"), an empty model_id refused
// (newcomer s7 F4; OPERATIONS.md: identity strings are 1-256 printable ASCII bytes): every
// identity string is checked the same way, naming its field. An empty tenant means "default".
TEST_F(StoreTest, EveryIdentityStringMustBeOneTo256PrintableBytes) {
  for (const char* field : {"identity.model_id", "identity.revision"}) {
    for (const std::string& v : {std::string(), std::string(257, 'x'), std::string("a\tb")}) {
      ModelSpec s = spec_;
      (std::string(field) == "identity.model_id" ? s.model_id : s.revision) = v;
      auto r = store_->RegisterModel(s, {.id = info_.rotation_id});
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field << " " << v.size();
      EXPECT_EQ(r.status().message().rfind(absl::StrCat(field, ": "), 0), 0u) << r.status();
    }
  }
  ModelSpec s = spec_;
  s.tenant = std::string(257, 't');
  auto r = store_->RegisterModel(s, {.id = info_.rotation_id});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(r.status().message().rfind("identity.tenant: ", 0), 0u) << r.status();
  s.tenant = "";  // "default"
  auto same = store_->RegisterModel(s, {.id = info_.rotation_id});
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->namespace_id, ns_);
  EXPECT_EQ(store_->Stats().models, 1u);
}

TEST_F(StoreTest, RegistrationErrorsNameTheField) {
  ModelSpec s = spec_;
  s.revision = "x";
  s.geometry.head_dim = 12;
  auto r = store_->RegisterModel(s, {.id = info_.rotation_id});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("geometry.head_dim"), std::string_view::npos);
  s = spec_;
  s.revision = "x";
  s.sink_tokens = 6;
  EXPECT_NE(store_->RegisterModel(s, {.id = info_.rotation_id})
                .status()
                .message()
                .find("recipe.sink_tokens"),
            std::string_view::npos);
  s = spec_;
  s.revision = "x";
  EXPECT_EQ(store_->RegisterModel(s, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->RegisterModel(s, {.id = Sha256("nope")}).status().code(),
            absl::StatusCode::kNotFound);
  // A rotation file for another geometry.
  ModelSpec wrong = spec_;
  wrong.geometry.num_layers = 3;
  auto rf = store_->RegisterModel(s, {.file_bytes = RotationFileFor(wrong)});
  EXPECT_EQ(rf.status().code(), absl::StatusCode::kFailedPrecondition) << rf.status();
  EXPECT_NE(rf.status().message().find("num_layers"), std::string_view::npos);
  EXPECT_EQ(store_->RegisterModel(s, {.file_bytes = "garbage!garbage!"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A truncated rotation file is a malformed field too, not DATA_LOSS (kept for checksum
  // mismatches; newcomer report s6 #9), and the message still says what is wrong.
  const std::string whole = RotationFileFor(spec_);
  for (size_t cut : {size_t{4}, size_t{20}, whole.size() - 100}) {
    auto truncated = store_->RegisterModel(s, {.file_bytes = whole.substr(0, cut)});
    EXPECT_EQ(truncated.status().code(), absl::StatusCode::kInvalidArgument)
        << cut << ": " << truncated.status();
    EXPECT_NE(truncated.status().message().find("rotation_file"), std::string_view::npos)
        << truncated.status();
  }
}

// Newcomer report s5 #4: registrations (parsed rotation files) lived outside --capacity and were
// never freed, so repeated re-calibration grew the pool's memory without bound. Now they are
// charged against max_registration_bytes; registrations without blocks or open puts are freed
// least recently used first, and when none is free the new one is RESOURCE_EXHAUSTED.
TEST_F(StoreTest, RegistrationsAreBoundedAndFreedLeastRecentlyUsed) {
  auto spec_n = [&](int i) {
    ModelSpec s = spec_;
    s.model_id = absl::StrCat("m", i);  // a distinct rotation file per model (its metadata)
    return s;
  };
  auto register_n = [&](int i) {
    return store_->RegisterModel(spec_n(i), {.file_bytes = RotationFileFor(spec_n(i))});
  };
  const uint64_t file = RotationFileFor(spec_n(0)).size();
  StoreOptions o;
  o.max_registration_bytes = 3 * (file + kRegistrationOverheadBytes + 64);  // three models
  Init(1 << 20, HistoryPrecision::kInt2, o);
  ASSERT_TRUE(Put(1, 4).ok());  // the fixture's model holds blocks: it is never freed
  const uint64_t one_model = store_->Stats().registration_bytes;
  EXPECT_GE(one_model, file + kRegistrationOverheadBytes);

  std::vector<ModelInfo> infos;
  for (int i = 0; i < 20; ++i) {  // 20 re-calibrations, none with blocks
    auto r = register_n(i);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    infos.push_back(*r);
    const StoreStats st = store_->Stats();
    EXPECT_LE(st.registration_bytes, o.max_registration_bytes) << i;
    EXPECT_LE(st.models, 3u) << i;
  }
  EXPECT_EQ(store_->metrics().registrations_freed.load(), 18u);
  // A rotation file larger than the whole limit is refused as such, freeing nothing.
  ModelSpec huge = spec_n(100);
  // Grown by padding its JSON header with spaces, so that it stays a valid file (bytes after
  // the last tensor are refused by the reader since newcomer report 11 F3).
  std::string huge_file = RotationFileFor(huge);
  {
    uint64_t n = 0;
    std::memcpy(&n, huge_file.data(), 8);
    std::string header = huge_file.substr(8, n);
    const std::string data = huge_file.substr(8 + n);
    header.resize(o.max_registration_bytes + 1 - 8 - data.size(), ' ');
    n = header.size();
    huge_file.assign(8, '\0');
    std::memcpy(huge_file.data(), &n, 8);
    huge_file += header + data;
  }
  ASSERT_EQ(huge_file.size(), o.max_registration_bytes + 1);
  auto too_big = store_->RegisterModel(huge, {.file_bytes = huge_file});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("more than the whole"), std::string::npos)
      << too_big.status();
  EXPECT_EQ(store_->metrics().registrations_freed.load(), 18u);
  EXPECT_EQ(store_->Stats().models, 3u);
  // The model with blocks stayed; a freed one reads as not registered; the newest are there.
  EXPECT_EQ(Forms(1, 4).size(), 4u);
  EXPECT_EQ(store_->BeginPut(infos[0].namespace_id, Tokens(2, 4), 1, {}).status().code(),
            absl::StatusCode::kNotFound);
  auto open_put = store_->BeginPut(infos[19].namespace_id, Tokens(2, 4), 1, {});
  ASSERT_TRUE(open_put.ok()) << open_put.status();  // an open put keeps m19 registered

  // m20 frees m18 (no blocks, no put) and then gets blocks of its own.
  auto m20 = register_n(20);
  ASSERT_TRUE(m20.ok()) << m20.status();
  EXPECT_EQ(store_->BeginPut(infos[18].namespace_id, Tokens(2, 4), 1, {}).status().code(),
            absl::StatusCode::kNotFound);
  auto plan = store_->BeginPut(m20->namespace_id, Tokens(3, 8), 2, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(store_->CommitPut(m20->namespace_id, plan->put_id, Write(*plan, 3)).ok());

  // Nothing can be freed now (blocks, an open put, blocks): refused, naming the field.
  const StoreStats before = store_->Stats();
  auto refused = register_n(21);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("rotation_file"), std::string::npos);
  EXPECT_NE(refused.status().message().find("--max-registration-bytes"), std::string::npos);
  // The remedies named exist (newcomer report 11 F6: "delete blocks" named no tool).
  EXPECT_NE(refused.status().message().find("by a client's Delete call"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("restart the pool with a larger"), std::string::npos)
      << refused.status();
  EXPECT_EQ(store_->Stats().models, before.models);
  EXPECT_EQ(store_->Stats().registration_bytes, before.registration_bytes);
  // Re-registering a held model needs no room; the same rotation under a new revision is charged
  // only its registration, not the rotation again (one parsed copy).
  EXPECT_TRUE(store_->RegisterModel(spec_n(20), {.file_bytes = RotationFileFor(spec_n(20))}).ok());
  // Once m19's put ends, m19 can be freed for m21.
  ASSERT_TRUE(store_->AbortPut(infos[19].namespace_id, open_put->put_id).ok());
  auto m21 = register_n(21);
  ASSERT_TRUE(m21.ok()) << m21.status();
  // The same rotation under another revision: m21's registration (no blocks) is freed to make
  // room, the rotation both share stays held and is charged once.
  ModelSpec again = spec_n(21);
  again.revision = "r2";
  const uint64_t bytes_before = store_->Stats().registration_bytes;
  auto shared = store_->RegisterModel(again, {.file_bytes = RotationFileFor(again)});
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->rotation_id, m21->rotation_id);
  EXPECT_EQ(store_->Stats().registration_bytes, bytes_before);  // same identity length
  EXPECT_EQ(store_->BeginPut(m21->namespace_id, Tokens(2, 4), 1, {}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_->BeginPut(shared->namespace_id, Tokens(4, 4), 1, {}).ok());
  // A rotation larger than the whole limit is refused at once.
  StoreOptions tiny = o;
  tiny.max_registration_bytes = file / 2;
  auto small_store = BlockStore::Create(tiny, mem_.get(), &clock_);
  ASSERT_TRUE(small_store.ok());
  EXPECT_EQ(
      (*small_store)->RegisterModel(spec_, {.file_bytes = RotationFileFor(spec_)}).status().code(),
      absl::StatusCode::kResourceExhausted);
}

TEST_F(StoreTest, FormsPerBlockFollowTheRecipe) {
  // 6 blocks: 0 is sink (BF16), 1..3 history (INT2), 4..5 recent tail (INT2 + BF16).
  auto c = Put(1, 6);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->bytes_ingested, 6u * 512);
  auto f = Forms(1, 6);
  ASSERT_EQ(f.size(), 6u);
  EXPECT_EQ(f[0], (std::vector<FormKind>{kB}));
  for (int i = 1; i <= 3; ++i) {
    EXPECT_EQ(f[i], (std::vector<FormKind>{kI})) << i;
  }
  for (int i = 4; i <= 5; ++i) {
    EXPECT_EQ(f[i], (std::vector<FormKind>{kB, kI})) << i;
  }
  auto lk = store_->Lookup(ns_, {.token_ids = Tokens(1, 24)});
  EXPECT_TRUE((*lk)[0].sink);
  EXPECT_FALSE((*lk)[1].sink);
  // Keys are the docs/KEYS.md chain from the namespace.
  auto keys = ChainKeys(ns_, Tokens(1, 24), 4);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ((*lk)[i].key, (*keys)[i]);
  }
  // A longer query stops at the held prefix; a key query gives the same answer.
  EXPECT_EQ(Forms(1, 9).size(), 6u);
  auto by_keys = store_->Lookup(ns_, {.keys = *keys});
  EXPECT_EQ(by_keys->size(), 6u);
  StoreStats s = store_->Stats();
  EXPECT_EQ(s.blocks, 6u);
  EXPECT_EQ(s.forms[int(kB)], 3u);
  EXPECT_EQ(s.forms[int(kI)], 5u);
  EXPECT_EQ(s.staging_bytes, 0u);
  EXPECT_EQ(s.open_puts, 0u);
}

// Newcomer report 13 F2: keys a client sends were answered wherever they were held, so
// [key 4, key 5] was leased as "blocks 0 and 1" (and [key 0, key 5, key 5] as 0..2, [key 0,
// key 2] skipping block 1): a client whose keys are off attends over other positions' KV. A key
// must be asked for at its own position of its chain; anything else is INVALID_ARGUMENT naming
// the key, with nothing leased.
TEST_F(StoreTest, KeysMustBeTheChainFromTheFirstBlock) {
  ASSERT_TRUE(Put(1, 6).ok());
  ASSERT_TRUE(Put(2, 3).ok());
  auto k = *ChainKeys(ns_, Tokens(1, 24), 4);
  auto other = *ChainKeys(ns_, Tokens(2, 12), 4);
  struct Case {
    std::vector<Digest> keys;
    const char* field;
  };
  const std::vector<Case> bad = {
      {{k[4], k[5]}, "keys[0]"},        // starts mid-chain
      {{k[0], k[5], k[5]}, "keys[1]"},  // skips blocks 1..4
      {{k[0], k[2]}, "keys[1]"},        // skips block 1
      {{k[0], k[1], k[1]}, "keys[2]"},  // repeated
      {{k[1], k[0]}, "keys[0]"},        // out of order
      {{k[0], other[1]}, "keys[1]"},    // block 1 of another sequence
  };
  for (const Case& c : bad) {
    auto lk = store_->Lookup(ns_, {.keys = c.keys});
    ASSERT_EQ(lk.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(lk.status().message()), ::testing::StartsWith(c.field)) << lk.status();
    auto lease = store_->Acquire(ns_, {.keys = c.keys}, 0, {});
    ASSERT_EQ(lease.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(lease.status().message()), ::testing::StartsWith(c.field))
        << lease.status();
  }
  EXPECT_EQ(store_->Stats().leases, 0u);
  // Nothing was left pinned: Delete (refused for leased blocks) removes the whole sequence.
  // The chain itself, and any prefix of it, still answers; an unknown key ends the prefix.
  auto whole = store_->Acquire(ns_, {.keys = k}, 0, {});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->blocks.size(), 6u);
  ASSERT_TRUE(store_->Release(whole->lease_id).ok());
  auto three = store_->Lookup(ns_, {.keys = {k[0], k[1], k[2]}});
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(three->size(), 3u);
  auto unknown_tail = *ChainKeys(ns_, Tokens(1, 32), 4);  // blocks 6, 7 never put
  auto eight = store_->Lookup(ns_, {.keys = unknown_tail});
  ASSERT_TRUE(eight.ok()) << eight.status();
  EXPECT_EQ(eight->size(), 6u);
  uint32_t deleted = 0;
  auto items = store_->Delete(ns_, {k[0]}, &deleted);
  ASSERT_TRUE(items.ok()) << items.status();
  EXPECT_TRUE((*items)[0].status.ok()) << (*items)[0].status;
  EXPECT_EQ(deleted, 6u);
}

TEST_F(StoreTest, Bf16PrecisionKeepsOnlyBf16) {
  Init(1 << 20, HistoryPrecision::kBf16);
  ASSERT_TRUE(Put(1, 5).ok());
  for (const auto& f : Forms(1, 5)) {
    EXPECT_EQ(f, (std::vector<FormKind>{kB}));
  }
}

TEST_F(StoreTest, StoredBytesAreTheEncodedFormsWithChecksums) {
  ASSERT_TRUE(Put(2, 6).ok());
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(2, 24)}, 0, {});
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->blocks.size(), 6u);
  auto rot = ParseRotations(RotationFileFor(spec_));
  ASSERT_TRUE(rot.ok());
  std::set<uint64_t> generations;
  for (const LeasedBlock& b : lease->blocks) {
    std::vector<uint8_t> in = BlockBytes(spec_.geometry, 2, b.index);
    std::vector<uint8_t> bf16(512), int2(192);
    EncodeResult r;
    ASSERT_TRUE(EncodeBlock(spec_.geometry, *rot, spec_.clip_ratio_k, spec_.clip_ratio_v, in.data(),
                            bf16.data(), int2.data(), &r)
                    .ok());
    for (const FormLocation& f : b.forms) {
      const uint8_t* stored = mem_->data() + f.offset;
      const std::vector<uint8_t>& want = f.form == kB ? bf16 : int2;
      ASSERT_EQ(f.size, want.size());
      EXPECT_EQ(0, std::memcmp(stored, want.data(), want.size())) << "block " << b.index;
      EXPECT_EQ(f.xxh3, FormChecksum(stored, f.size));
      EXPECT_TRUE(generations.insert(f.generation).second);
    }
  }
  EXPECT_TRUE(store_->Release(lease->lease_id).ok());
}

TEST_F(StoreTest, NothingVisibleBeforeCommitAndAbortReclaims) {
  auto plan = store_->BeginPut(ns_, Tokens(3, 16), 4, {});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(store_->Stats().staging_bytes, 4u * 512);
  Write(*plan, 3);
  EXPECT_TRUE(Forms(3, 4).empty());
  EXPECT_TRUE(store_->AbortPut(ns_, plan->put_id).ok());
  EXPECT_TRUE(Forms(3, 4).empty());
  EXPECT_EQ(store_->Stats().used_bytes, 0u);
  EXPECT_EQ(store_->CommitPut(ns_, plan->put_id, {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->AbortPut(ns_, plan->put_id).code(), absl::StatusCode::kNotFound);
}

TEST_F(StoreTest, ChecksumMismatchIsDataLossAndChangesNothing) {
  ASSERT_TRUE(Put(4, 2).ok());
  const uint64_t used = store_->Stats().used_bytes;
  auto plan = store_->BeginPut(ns_, Tokens(4, 20), 5, {});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->blocks[0].action, PutAction::kSkip);
  auto sums = Write(*plan, 4);
  sums.back().xxh3 ^= 1;
  auto c = store_->CommitPut(ns_, plan->put_id, sums);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(c.status().message().find("block 4"), std::string_view::npos) << c.status();
  EXPECT_EQ(store_->metrics().checksum_failures.load(), 1u);
  EXPECT_EQ(Forms(4, 5).size(), 2u);  // only the earlier commit
  EXPECT_EQ(store_->Stats().used_bytes, used);
  EXPECT_EQ(store_->Stats().open_puts, 0u);
}

// The form checksum is chunked (docs/BLOCK_FORMAT.md "Checksums": 16 KiB chunks): a byte
// flipped in any chunk of a multi-chunk staging form, including the short last chunk, is caught
// at commit, and nothing already stored changes.
TEST_F(StoreTest, CorruptedByteInAnyChunkIsDataLossAtCommit) {
  // L=3, H=3, d=64, P=16: BF16 form 36864 bytes = chunks of 16384, 16384 and 4096; a layer
  // slice is 12 KiB, so chunks straddle layers.
  ModelSpec big = TinySpec();
  big.model_id = "chunky";
  big.geometry = BlockGeometry{.num_layers = 3, .num_kv_heads = 3, .head_dim = 64, .page_size = 16};
  big.sink_tokens = 16;
  big.recent_tokens = 16;
  auto info = store_->RegisterModel(big, {.file_bytes = RotationFileFor(big)});
  ASSERT_TRUE(info.ok()) << info.status();
  const Digest ns = info->namespace_id;
  const BlockGeometry& g = big.geometry;
  ASSERT_EQ(g.Bf16FormBytes(), 36864u);
  ASSERT_EQ(ChecksumChunks(g.Bf16FormBytes()), 3u);
  auto put = [&](uint32_t seq, int64_t flip_at) -> absl::StatusOr<CommitResult> {
    auto plan = store_->BeginPut(ns, Tokens(seq, 3 * 16), 3, {});
    if (!plan.ok()) return plan.status();
    std::vector<BlockChecksum> sums;
    for (const PutBlockPlan& b : plan->blocks) {
      std::vector<uint8_t> bytes = BlockBytes(g, seq, b.index);
      std::memcpy(mem_->data() + b.staging_offset, bytes.data(), bytes.size());
      sums.push_back({b.index, FormChecksum(bytes.data(), bytes.size())});
      if (b.index == 1 && flip_at >= 0) mem_->data()[b.staging_offset + flip_at] ^= 0x10;
    }
    return store_->CommitPut(ns, plan->put_id, sums);
  };
  ASSERT_TRUE(put(1, -1).ok());
  const uint64_t used = store_->Stats().used_bytes;
  auto stored_ok = [&] {
    auto lease = store_->Acquire(ns, {.token_ids = Tokens(1, 3 * 16)}, 0, {});
    if (!lease.ok() || lease->blocks.size() != 3) return false;
    bool ok = true;
    for (const LeasedBlock& b : lease->blocks) {
      for (const FormLocation& f : b.forms) {
        ok &= FormChecksum(mem_->data() + f.offset, f.size) == f.xxh3;
      }
    }
    return store_->Release(lease->lease_id).ok() && ok;
  };
  ASSERT_TRUE(stored_ok());
  uint64_t failures = store_->metrics().checksum_failures.load();
  uint32_t seq = 2;
  for (int64_t at : {0, 9000, 16383, 16384, 30000, 32768, 36863}) {
    auto c = put(seq++, at);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << "byte " << at;
    EXPECT_NE(c.status().message().find("block 1"), std::string_view::npos) << c.status();
    EXPECT_EQ(store_->metrics().checksum_failures.load(), ++failures);
    EXPECT_EQ(store_->Stats().used_bytes, used) << "byte " << at;
    EXPECT_EQ(store_->Stats().open_puts, 0u);
    EXPECT_TRUE(stored_ok()) << "byte " << at;
  }
  EXPECT_TRUE(put(seq, -1).ok());  // the same put with intact bytes commits
}

TEST_F(StoreTest, NonFiniteIsRefusedNamingBlockLayerHeadToken) {
  ASSERT_TRUE(Put(5, 3).ok());
  auto before = store_->Acquire(ns_, {.token_ids = Tokens(5, 12)}, 0, {});
  ASSERT_TRUE(before.ok());
  ASSERT_TRUE(store_->Release(before->lease_id).ok());
  auto plan = store_->BeginPut(ns_, Tokens(5, 24), 6, {});
  ASSERT_TRUE(plan.ok());
  std::vector<BlockChecksum> sums;
  for (const PutBlockPlan& b : plan->blocks) {
    if (b.action != PutAction::kWrite) {
      continue;
    }
    std::vector<uint8_t> bytes = BlockBytes(spec_.geometry, 5, b.index);
    if (b.index == 4) {
      const uint64_t at = spec_.geometry.Bf16ChunkOffset(1, 1) + (3 * 8 + 6) * 2;
      const uint16_t inf = 0x7f80;
      std::memcpy(bytes.data() + at, &inf, 2);
    }
    std::memcpy(mem_->data() + b.staging_offset, bytes.data(), bytes.size());
    sums.push_back({b.index, FormChecksum(bytes.data(), bytes.size())});
  }
  auto c = store_->CommitPut(ns_, plan->put_id, sums);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), "block 4: layer 1 head 1 K token 3 element 6 is inf");
  // Nothing of the failed put is visible and the committed blocks are intact: their forms,
  // locations and checksums did not change (the tail BF16 forms of blocks 1, 2 were not
  // demoted or touched).
  EXPECT_EQ(Forms(5, 6).size(), 3u);
  auto after = store_->Acquire(ns_, {.token_ids = Tokens(5, 12)}, 0, {});
  ASSERT_EQ(after->blocks.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(after->blocks[i].forms.size(), before->blocks[i].forms.size());
    for (size_t f = 0; f < after->blocks[i].forms.size(); ++f) {
      const FormLocation& a = after->blocks[i].forms[f];
      const FormLocation& b = before->blocks[i].forms[f];
      EXPECT_EQ(a.offset, b.offset);
      EXPECT_EQ(a.generation, b.generation);
      EXPECT_EQ(a.xxh3, b.xxh3);
      EXPECT_EQ(FormChecksum(mem_->data() + a.offset, a.size), a.xxh3);
    }
  }
  EXPECT_EQ(store_->metrics().nonfinite_refusals.load(), 1u);
}

TEST_F(StoreTest, RepeatedPutIsIdempotentAndAddsMissingForms) {
  ASSERT_TRUE(Put(6, 6).ok());
  // The 3-block prefix of the same sequence: its blocks 1 and 2 are now a tail and need BF16.
  auto plan = store_->BeginPut(ns_, Tokens(6, 12), 3, {});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->blocks[0].action, PutAction::kSkip);
  EXPECT_EQ(plan->blocks[1].action, PutAction::kWrite);
  EXPECT_EQ(plan->blocks[1].forms_held, (std::vector<FormKind>{kI}));
  EXPECT_EQ(plan->blocks[1].forms_added, (std::vector<FormKind>{kB}));
  ASSERT_TRUE(store_->CommitPut(ns_, plan->put_id, Write(*plan, 6)).ok());
  auto f = Forms(6, 6);
  EXPECT_EQ(f[1], (std::vector<FormKind>{kB, kI}));
  EXPECT_EQ(f[2], (std::vector<FormKind>{kB, kI}));
  EXPECT_EQ(f[3], (std::vector<FormKind>{kI}));
  // The same put again: everything skipped, nothing staged.
  auto again = store_->BeginPut(ns_, Tokens(6, 24), 6, {});
  ASSERT_TRUE(again.ok());
  for (const auto& b : again->blocks) {
    EXPECT_EQ(b.action, PutAction::kSkip);
  }
  EXPECT_EQ(store_->Stats().staging_bytes, 0u);
  auto c = store_->CommitPut(ns_, again->put_id, {});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->blocks.size(), 6u);
  EXPECT_EQ(store_->Stats().blocks, 6u);
}

TEST_F(StoreTest, ConcurrentPutsOfTheSameBlocksLinkOnce) {
  auto p1 = store_->BeginPut(ns_, Tokens(7, 16), 4, {});
  auto p2 = store_->BeginPut(ns_, Tokens(7, 16), 4, {});
  ASSERT_TRUE(p1.ok() && p2.ok());
  EXPECT_EQ(p2->blocks[3].action, PutAction::kWrite);  // not committed yet: both write
  auto s1 = Write(*p1, 7);
  auto s2 = Write(*p2, 7);
  ASSERT_TRUE(store_->CommitPut(ns_, p1->put_id, s1).ok());
  const uint64_t used = store_->Stats().used_bytes;
  ASSERT_TRUE(store_->CommitPut(ns_, p2->put_id, s2).ok());
  EXPECT_EQ(store_->Stats().blocks, 4u);
  EXPECT_EQ(store_->Stats().used_bytes, used - 4 * 512);  // p2's staging freed, nothing added
}

TEST_F(StoreTest, BadPutArgumentsNameTheField) {
  EXPECT_EQ(store_->BeginPut(Sha256("x"), Tokens(1, 8), 2, {}).status().code(),
            absl::StatusCode::kNotFound);
  auto zero = store_->BeginPut(ns_, Tokens(1, 8), 0, {});
  EXPECT_NE(zero.status().message().find("num_blocks"), std::string_view::npos);
  auto over = store_->BeginPut(ns_, Tokens(1, 7), 2, {});
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(over.status().message().find("num_blocks"), std::string_view::npos);
  // Oversize: staging larger than the whole pool.
  auto huge = store_->BeginPut(ns_, Tokens(1, 4 * 4096), 4096, {});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  // Checksums: missing, unknown index, duplicate.
  auto plan = store_->BeginPut(ns_, Tokens(1, 8), 2, {});
  ASSERT_TRUE(plan.ok());
  auto sums = Write(*plan, 1);
  auto missing = store_->CommitPut(ns_, plan->put_id, {sums[0]});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("checksums"), std::string_view::npos);
  plan = store_->BeginPut(ns_, Tokens(1, 8), 2, {});
  sums = Write(*plan, 1);
  sums.push_back({7, 0});
  EXPECT_NE(
      store_->CommitPut(ns_, plan->put_id, sums).status().message().find("checksums[2].index"),
      std::string_view::npos);
  plan = store_->BeginPut(ns_, Tokens(1, 8), 2, {});
  // Commit under another namespace: NOT_FOUND, and the put stays open.
  EXPECT_EQ(store_->CommitPut(Sha256("x"), plan->put_id, {}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Stats().open_puts, 1u);
  EXPECT_EQ(store_->Lookup(ns_, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, UncommittedPutExpiresAndIsReclaimed) {
  auto plan = store_->BeginPut(ns_, Tokens(8, 16), 4, absl::Seconds(5));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->timeout, absl::Seconds(5));
  auto sums = Write(*plan, 8);
  clock_.Advance(absl::Seconds(4));
  store_->Tick();
  EXPECT_EQ(store_->Stats().open_puts, 1u);
  clock_.Advance(absl::Seconds(2));
  store_->Tick();
  EXPECT_EQ(store_->Stats().open_puts, 0u);
  EXPECT_EQ(store_->Stats().used_bytes, 0u);
  EXPECT_EQ(store_->metrics().put_expiries.load(), 1u);
  EXPECT_EQ(store_->CommitPut(ns_, plan->put_id, sums).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(Forms(8, 4).empty());
}

// Newcomer report s8 N11: the put timeout was enforced only by Tick, so a commit 1 s past
// --put-timeout-ms (tick 60 s) committed. Fail closed like a lease: past its deadline a put is
// expired at its next call, before any Tick — NOT_FOUND naming the put timeout (the client turns
// it into DEADLINE_EXCEEDED "not committed within the pool's put timeout"), staging reclaimed,
// nothing visible, counted once in put_expiries.
TEST_F(StoreTest, APutPastItsDeadlineFailsClosedBeforeTheTick) {
  // In time (4 s of 5): commits.
  auto ok_plan = store_->BeginPut(ns_, Tokens(7, 16), 4, absl::Seconds(5));
  ASSERT_TRUE(ok_plan.ok());
  auto ok_sums = Write(*ok_plan, 7);
  clock_.Advance(absl::Seconds(4));
  ASSERT_TRUE(store_->CommitPut(ns_, ok_plan->put_id, ok_sums).ok());
  const uint64_t used = store_->Stats().used_bytes;

  // CommitPut 1 s past the deadline, no Tick in between.
  auto plan = store_->BeginPut(ns_, Tokens(8, 16), 4, absl::Seconds(5));
  ASSERT_TRUE(plan.ok());
  auto sums = Write(*plan, 8);
  EXPECT_GT(store_->Stats().staging_bytes, 0u);
  clock_.Advance(absl::Seconds(6));
  auto late = store_->CommitPut(ns_, plan->put_id, sums);
  ASSERT_EQ(late.status().code(), absl::StatusCode::kNotFound) << late.status();
  EXPECT_THAT(late.status().message(),
              HasSubstr("expired: not committed within the pool's put timeout of 5000 ms (its "
                        "deadline passed 1000 ms ago); staging reclaimed"));
  StoreStats st = store_->Stats();
  EXPECT_EQ(st.open_puts, 0u);
  EXPECT_EQ(st.staging_bytes, 0u);
  EXPECT_EQ(st.used_bytes, used);
  EXPECT_TRUE(Forms(8, 4).empty());
  EXPECT_EQ(store_->metrics().put_expiries.load(), 1u);
  store_->Tick();  // nothing left for it: counted once
  EXPECT_EQ(store_->metrics().put_expiries.load(), 1u);
  EXPECT_EQ(store_->CommitPut(ns_, plan->put_id, sums).status().code(),
            absl::StatusCode::kNotFound);

  // A WritePut (BeginPutWrite) and an AbortPut past the deadline: the same.
  auto w = store_->BeginPut(ns_, Tokens(9, 16), 4, absl::Seconds(1));
  auto a = store_->BeginPut(ns_, Tokens(10, 16), 4, absl::Seconds(1));
  ASSERT_TRUE(w.ok() && a.ok());
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(store_->BeginPutWrite(ns_, w->put_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(store_->AbortPut(ns_, a->put_id).message(),
              HasSubstr("not committed within the pool's put timeout of 1000 ms"));
  EXPECT_EQ(store_->Stats().open_puts, 0u);
  EXPECT_EQ(store_->Stats().staging_bytes, 0u);
  EXPECT_EQ(store_->metrics().put_expiries.load(), 3u);
  EXPECT_EQ(store_->metrics().put_aborts.load(), 0u);

  // A pull still writing the staging when the deadline passes: the commit is refused, the
  // staging stays until the pull ends, then Tick reclaims it.
  auto p = store_->BeginPut(ns_, Tokens(11, 16), 4, absl::Seconds(1));
  ASSERT_TRUE(p.ok());
  auto psums = Write(*p, 11);
  ASSERT_TRUE(store_->BeginPutWrite(ns_, p->put_id).ok());
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(store_->CommitPut(ns_, p->put_id, psums).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Stats().open_puts, 1u);
  store_->EndPutWrite(p->put_id);
  store_->Tick();
  EXPECT_EQ(store_->Stats().open_puts, 0u);
  EXPECT_EQ(store_->Stats().staging_bytes, 0u);
  EXPECT_EQ(store_->metrics().put_expiries.load(), 4u);
  EXPECT_TRUE(Forms(11, 4).empty());
  EXPECT_EQ(Forms(7, 4).size(), 4u);  // the put committed in time is intact
}

TEST_F(StoreTest, LeasesRenewReleaseAndExpire) {
  ASSERT_TRUE(Put(9, 3).ok());
  auto l = store_->Acquire(ns_, {.token_ids = Tokens(9, 16)}, 0, absl::Seconds(2));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->blocks.size(), 3u);
  EXPECT_NE(l->lease_id, 0u);
  EXPECT_EQ(store_->Stats().leases, 1u);
  clock_.Advance(absl::Seconds(1));
  auto renewed = store_->Renew(l->lease_id, absl::Seconds(2));
  ASSERT_TRUE(renewed.ok());
  clock_.Advance(absl::Seconds(1.5));
  store_->Tick();
  EXPECT_EQ(store_->Stats().leases, 1u);  // renewed: still alive
  clock_.Advance(absl::Seconds(1));
  store_->Tick();
  EXPECT_EQ(store_->Stats().leases, 0u);
  EXPECT_EQ(store_->metrics().lease_expiries.load(), 1u);
  EXPECT_EQ(store_->Release(l->lease_id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Renew(l->lease_id, {}).status().code(), absl::StatusCode::kNotFound);
  // Past its deadline but before a Tick: Release still reports the expiry (fail closed).
  auto l2 = store_->Acquire(ns_, {.token_ids = Tokens(9, 12)}, 2, absl::Seconds(1));
  ASSERT_EQ(l2->blocks.size(), 2u);
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(store_->Release(l2->lease_id).code(), absl::StatusCode::kNotFound);
  // Nothing held: no lease.
  auto none = store_->Acquire(ns_, {.token_ids = Tokens(99, 8)}, 0, {});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->lease_id, 0u);
  EXPECT_TRUE(none->blocks.empty());
}

// 10240 bytes of pool: 20 BF16 forms (512 bytes) or 40 INT2 forms (192 bytes, allocated as
// 256). A 4-block sequence stores B, I, B+I, B+I = 2304 bytes; staging is 512 per block.
// --max-put-blocks bounds the blocks one put writes, not the sequence's length: blocks the pool
// holds already need no staging (newcomer 14 F2: an 8-block prompt whose first 4 blocks were
// held was refused with a limit of 4, so no prompt longer than 4 pages could ever be stored).
TEST_F(StoreTest, PerPutLimitCountsTheBlocksThePutWrites) {
  StoreOptions o;
  o.max_put_blocks = 4;
  Init(1 << 20, HistoryPrecision::kInt2, o);
  ASSERT_TRUE(Put(1, 4).ok());
  auto grown = Put(1, 8);  // 4 held + 4 new
  ASSERT_TRUE(grown.ok()) << grown.status();
  EXPECT_EQ(grown->bytes_ingested, 4u * info_.bf16_form_bytes);
  auto over = store_->BeginPut(ns_, Tokens(1, 13 * 4), 13, {});  // 8 held + 5 new
  ASSERT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument) << over.status();
  EXPECT_THAT(std::string(over.status().message()),
              ::testing::HasSubstr("the put writes 5 blocks (8 of its 13 blocks are held "
                                   "already), more than the per-put limit 4"));
  auto fresh = store_->BeginPut(ns_, Tokens(2, 5 * 4), 5, {});
  ASSERT_EQ(fresh.status().code(), absl::StatusCode::kInvalidArgument) << fresh.status();
  EXPECT_THAT(std::string(fresh.status().message()),
              ::testing::HasSubstr("the put writes 5 blocks, more than the per-put limit 4"));
  // The refusals opened nothing and left nothing pinned: the held blocks can still be deleted.
  EXPECT_EQ(store_->Stats().open_puts, 0u);
  auto keys = *ChainKeys(ns_, Tokens(1, 8 * 4), 4);
  uint32_t deleted = 0;
  auto items = store_->Delete(ns_, {keys[0]}, &deleted);  // the block and its descendants
  ASSERT_TRUE(items.ok()) << items.status();
  EXPECT_TRUE((*items)[0].status.ok()) << (*items)[0].status;
  EXPECT_EQ(deleted, 8u);
}

class EvictionTest : public StoreTest {
 protected:
  void SetUp() override { InitWatermarks(0.6, 0.4); }
  void InitWatermarks(double high, double low) {
    StoreOptions o;
    o.high_watermark = high;
    o.low_watermark = low;
    Init(20 * 512, HistoryPrecision::kInt2, o);
  }
};

TEST_F(EvictionTest, DemotesBf16BeforeEvictingBlocks) {
  // Sequence A: 4 blocks → forms: B, I, B+I, B+I  = 3·512 + 3·256 = 2304 bytes.
  ASSERT_TRUE(Put(1, 4).ok());
  ASSERT_TRUE(Put(2, 4).ok());
  ASSERT_TRUE(Put(3, 4).ok());  // 6912 of 10240 bytes: above the 60% high watermark
  const uint64_t used = store_->Stats().used_bytes;
  EXPECT_EQ(used, 3u * 2304);
  EXPECT_EQ(store_->metrics().evictions_demote.load(), 0u);
  store_->Tick();  // reclaims to <= 40% = 4096 bytes
  StoreStats s = store_->Stats();
  EXPECT_LE(s.used_bytes, 4096u);
  EXPECT_EQ(s.blocks, 12u);  // demotion alone was enough: no block lost
  EXPECT_GE(store_->metrics().evictions_demote.load(), 4u);
  EXPECT_EQ(store_->metrics().evictions_block.load(), 0u);
  // Sinks keep BF16; demoted blocks keep INT2.
  uint64_t window_int2_only = 0;  // blocks 2 and 3 are each sequence's recent window (W = 8)
  for (uint32_t seq = 1; seq <= 3; ++seq) {
    auto f = Forms(seq, 4);
    ASSERT_EQ(f.size(), 4u);
    EXPECT_EQ(f[0], (std::vector<FormKind>{kB}));
    for (int i = 1; i < 4; ++i) {
      EXPECT_NE(std::find(f[i].begin(), f[i].end(), kI), f[i].end());
      if (i >= 2 && std::find(f[i].begin(), f[i].end(), kB) == f[i].end()) ++window_int2_only;
    }
  }
  // The hits a BF16-window reader cannot use as stored show in
  // kvpool_lease_window_int2_only_blocks_total (newcomer report 13): leases count them.
  EXPECT_GT(window_int2_only, 0u);
  EXPECT_EQ(store_->metrics().lease_window_int2_only_blocks.load(), 0u);
  for (uint32_t seq = 1; seq <= 3; ++seq) {
    auto l = store_->Acquire(ns_, {.token_ids = Tokens(seq, 16)}, 0, {});
    ASSERT_TRUE(l.ok()) << l.status();
    ASSERT_TRUE(store_->Release(l->lease_id).ok());
  }
  EXPECT_EQ(store_->metrics().lease_window_int2_only_blocks.load(), window_int2_only);
}

TEST_F(EvictionTest, EvictsWholeBlocksLeafFirstAndNeverLeased) {
  ASSERT_TRUE(Put(1, 4).ok());
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, absl::Minutes(1));
  ASSERT_EQ(lease->blocks.size(), 4u);
  // Sequences sharing a 2-block prefix (8 tokens) with each other.
  ASSERT_TRUE(Put(2, 4, 8).ok());
  ASSERT_TRUE(Put(3, 4, 8).ok());
  // Puts keep coming; allocations evict as needed.
  for (uint32_t seq = 4; seq < 12; ++seq) {
    auto c = Put(seq, 3);
    ASSERT_TRUE(c.ok()) << seq << ": " << c.status();
  }
  // The leased sequence is intact with every form.
  auto f = Forms(1, 4);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[2], (std::vector<FormKind>{kB, kI}));
  EXPECT_GT(store_->metrics().evictions_block.load(), 0u);
  // Leaf-first: every resident block's parent is resident, so every held block is part of the
  // held prefix of its sequence (no holes). Only these 11 sequences were put, so the union of
  // their held prefixes must be every block in the index. (A key query can no longer observe a
  // hole directly: a key must be asked for at its own position of its chain.)
  std::set<Digest> in_prefixes;
  for (uint32_t seq = 1; seq < 12; ++seq) {
    const uint32_t n = seq <= 3 ? 4 : 3;
    auto keys = ChainKeys(ns_, Tokens(seq, n * 4, seq == 2 || seq == 3 ? 8 : 0), 4);
    auto prefix = store_->Lookup(ns_, {.keys = *keys});
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    for (const BlockFormsInfo& b : *prefix) in_prefixes.insert(b.key);
  }
  EXPECT_EQ(store_->Stats().blocks, in_prefixes.size()) << "a resident block outside every prefix";
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
}

// Newcomer report 13 F6: a lease past its deadline kept its blocks from eviction (and counted in
// Stats().leases) until the expiry tick ran, up to --tick-ms (60 s) later. It pins nothing now.
TEST_F(EvictionTest, ALeasePastItsDeadlinePinsNothingBeforeTheTick) {
  ASSERT_TRUE(Put(1, 4).ok());
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, absl::Seconds(1));
  ASSERT_EQ(lease->blocks.size(), 4u);
  EXPECT_EQ(store_->Stats().leases, 1u);
  clock_.Advance(absl::Seconds(2));  // no Tick
  EXPECT_EQ(store_->Stats().leases, 0u);
  // Sequence 1 is the least recently used: the puts below evict it first.
  for (uint32_t seq = 2; seq < 8; ++seq) {
    auto c = Put(seq, 3);
    ASSERT_TRUE(c.ok()) << seq << ": " << c.status();
  }
  EXPECT_LT(Forms(1, 4).size(), 4u) << "the expired lease still pinned sequence 1";
  EXPECT_EQ(store_->metrics().lease_expiries.load(), 1u);
  EXPECT_EQ(store_->Release(lease->lease_id).code(), absl::StatusCode::kNotFound);
}

TEST_F(EvictionTest, PoolFullOfLeasedBlocksRefusesPuts) {
  InitWatermarks(0.9, 0.8);
  for (uint32_t seq = 1; seq <= 3; ++seq) {
    ASSERT_TRUE(Put(seq, 4).ok());
  }
  std::vector<uint64_t> leases;
  for (uint32_t seq = 1; seq <= 3; ++seq) {
    auto l = store_->Acquire(ns_, {.token_ids = Tokens(seq, 16)}, 0, absl::Minutes(1));
    ASSERT_TRUE(l.ok());
    ASSERT_EQ(l->blocks.size(), 4u);
    leases.push_back(l->lease_id);
  }
  const uint64_t used = store_->Stats().used_bytes;
  EXPECT_EQ(used, 3u * 2304);
  auto p = store_->BeginPut(ns_, Tokens(50, 32), 8, {});  // 4096 bytes of staging, 3328 free
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->Stats().used_bytes, used);  // nothing leaked, nothing evicted
  EXPECT_EQ(store_->Stats().blocks, 12u);
  EXPECT_EQ(store_->metrics().evictions_demote.load(), 0u);
  for (uint64_t id : leases) {
    ASSERT_TRUE(store_->Release(id).ok());
  }
  auto c = Put(50, 8);  // now eviction can make room
  EXPECT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Forms(50, 8).size(), 8u);
}

// Newcomer 18 F3: three prefill nodes sharing a pool with room for one put at a time; two of
// them held the room in turn (each opens its next put as it commits the last) and the third,
// asking again every second, never found it free and failed its prompts. A put refused for room
// that other puts or leases hold, and refused again within StoreOptions::room_waiter_life, is
// in line: the room it needs is kept for it, in the order of the first refusals, until it opens
// or stops asking.
TEST_F(EvictionTest, PutsWaitingForRoomAreServedInTheOrderTheyFirstAsked) {
  // 10240 bytes; an 8-block put needs 4096 bytes of staging + 3328 of new forms = 7424 at once.
  auto a = store_->BeginPut(ns_, Tokens(1, 32), 8, {});
  ASSERT_TRUE(a.ok()) << a.status();
  // B: 10240 - 4096 of A's staging = 6144 < 7424. Refused, and again 100 ms later: in line.
  for (int i = 0; i < 2; ++i) {
    auto b = store_->BeginPut(ns_, Tokens(2, 32), 8, {});
    ASSERT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
    EXPECT_THAT(b.status().message(), HasSubstr("the pool cannot hold this put's commit"));
    clock_.Advance(absl::Milliseconds(100));
  }
  ASSERT_TRUE(store_->CommitPut(ns_, a->put_id, Write(*a, 1)).ok());
  // The room is free now, but kept for B: C (another sequence, never refused) is refused with
  // numbers under which a prefill node waits (RoomHeldByOthers: the kept bytes count as staging).
  auto c = store_->BeginPut(ns_, Tokens(3, 32), 8, {});
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(c.status().message(),
              HasSubstr("num_blocks: the pool keeps 7424 bytes for 1 earlier put(s) refused for "
                        "room that are asking again: this put's commit needs 7424 bytes at once, "
                        "and eviction can make at most 10240 of the pool's 10240 bytes free"));
  std::optional<RoomShortage> r = GetRoomShortage(c.status());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->need_bytes, 7424u);
  EXPECT_EQ(r->room_bytes, 10240u - 7424u);
  EXPECT_EQ(r->staging_bytes, 7424u);
  EXPECT_EQ(r->pinned_bytes, 0u);
  EXPECT_EQ(store_->Stats().open_puts, 0u);  // C opened nothing
  // B asks again and opens (it leaves the line); C, refused again under B's staging, is in line.
  auto b = store_->BeginPut(ns_, Tokens(2, 32), 8, {});
  ASSERT_TRUE(b.ok()) << b.status();
  c = store_->BeginPut(ns_, Tokens(3, 32), 8, {});
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr("the pool cannot hold this put's commit"));
  ASSERT_TRUE(store_->AbortPut(ns_, b->put_id).ok());
  // D (new) finds the room kept for C; once C has not asked for longer than the waiter life
  // (1 s by default), it is out of the line and D opens.
  auto d = store_->BeginPut(ns_, Tokens(4, 32), 8, {});
  ASSERT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted) << d.status();
  EXPECT_THAT(d.status().message(), HasSubstr("the pool keeps 7424 bytes for 1 earlier put(s)"));
  clock_.Advance(absl::Milliseconds(1100));
  d = store_->BeginPut(ns_, Tokens(4, 32), 8, {});
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(store_->CommitPut(ns_, d->put_id, Write(*d, 4)).ok());
  EXPECT_EQ(Forms(4, 8).size(), 8u);  // (its commit evicted A's blocks: both do not fit)
  EXPECT_EQ(store_->Stats().open_puts, 0u);
  EXPECT_EQ(store_->Stats().staging_bytes, 0u);
}

// What keeps no room: a put refused only once (not known to ask again), a put too large for
// the pool (it waits for nothing), and any put when StoreOptions::room_waiter_life is 0.
TEST_F(EvictionTest, APutRefusedOnceOrTooLargeOrWithNoLineKeepsNoRoom) {
  for (const bool line : {true, false}) {
    SCOPED_TRACE(line ? "line on, B refused once" : "room_waiter_life 0, B refused twice");
    StoreOptions o;
    o.high_watermark = 0.6;
    o.low_watermark = 0.4;
    if (!line) o.room_waiter_life = absl::ZeroDuration();
    Init(20 * 512, HistoryPrecision::kInt2, o);
    auto a = store_->BeginPut(ns_, Tokens(1, 32), 8, {});
    ASSERT_TRUE(a.ok()) << a.status();
    for (int i = 0; i < (line ? 1 : 2); ++i) {
      auto b = store_->BeginPut(ns_, Tokens(2, 32), 8, {});
      ASSERT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
    }
    // Too large even for the empty pool (40 blocks: 20480 bytes of staging alone), twice.
    for (int i = 0; i < 2; ++i) {
      auto big = store_->BeginPut(ns_, Tokens(9, 160), 40, {});
      ASSERT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
    }
    ASSERT_TRUE(store_->CommitPut(ns_, a->put_id, Write(*a, 1)).ok());
    auto c = store_->BeginPut(ns_, Tokens(3, 32), 8, {});
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(store_->AbortPut(ns_, c->put_id).ok());
  }
}

// Newcomer report s7 F11: a put whose staging fit passed BeginPut, moved every layer and only
// then failed RESOURCE_EXHAUSTED at its commit, which allocates the new forms while the staging
// is still held. BeginPut now refuses a put that could never commit — staging plus new forms
// beyond what eviction can free (capacity minus the other puts' staging and the forms of leased
// blocks) — naming the numbers; nothing stored is touched. A put that just fits is accepted and
// commits (evicting the unleased sequence), so the check does not refuse what could commit.
TEST_F(EvictionTest, BeginPutRefusesACommitThatCouldNeverFit) {
  InitWatermarks(0.9, 0.8);     // 10240 bytes; BF16 form 512, INT2 192 (256 allocated)
  ASSERT_TRUE(Put(1, 4).ok());  // B, I, B+I, B+I: 2304 bytes each
  ASSERT_TRUE(Put(2, 4).ok());
  auto l1 = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, absl::Minutes(1));
  auto l2 = store_->Acquire(ns_, {.token_ids = Tokens(2, 16)}, 0, absl::Minutes(1));
  ASSERT_TRUE(l1.ok() && l2.ok());
  const StoreStats before = store_->Stats();
  EXPECT_EQ(before.pinned_bytes, 2u * 2304);
  // 8 blocks: staging 8 x 512 = 4096, new forms 512 + 5 x 256 + 2 x 768 = 3328; 7424 at once,
  // and 10240 - 4608 leased = 5632 can be freed. Its staging alone (4096) would have fitted.
  auto p = store_->BeginPut(ns_, Tokens(50, 32), 8, {});
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(p.status().message(),
              HasSubstr("num_blocks: the pool cannot hold this put's commit"));
  EXPECT_THAT(p.status().message(), HasSubstr("needs 7424 bytes at once (4096 bytes of staging"));
  EXPECT_THAT(p.status().message(), HasSubstr("the 8 of 8 blocks to write, plus 3328 bytes"));
  EXPECT_THAT(p.status().message(), HasSubstr("at most 5632 of the pool's 10240 bytes free"));
  EXPECT_THAT(p.status().message(),
              HasSubstr("0 bytes are staging of other open puts, 4608 bytes"));
  // The same numbers as a payload (kvpool/common/room_shortage.h), for clients that must not
  // parse the message.
  std::optional<RoomShortage> r = GetRoomShortage(p.status());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->need_bytes, 7424u);
  EXPECT_EQ(r->room_bytes, 5632u);
  EXPECT_EQ(r->staging_bytes, 0u);
  EXPECT_EQ(r->pinned_bytes, 4608u);
  const StoreStats after = store_->Stats();
  EXPECT_EQ(after.used_bytes, before.used_bytes);  // nothing allocated, leaked or evicted
  EXPECT_EQ(after.staging_bytes, 0u);
  EXPECT_EQ(after.open_puts, 0u);
  EXPECT_EQ(after.blocks, 8u);
  EXPECT_EQ(after.pinned_bytes, before.pinned_bytes);
  EXPECT_EQ(store_->metrics().evictions_demote.load() + store_->metrics().evictions_block.load(),
            0u);
  EXPECT_EQ(Forms(1, 4).size(), 4u);
  EXPECT_EQ(Forms(2, 4).size(), 4u);
  // One lease fewer: 2304 + 7424 = 9728 <= 10240. Accepted, and the commit evicts sequence 2.
  ASSERT_TRUE(store_->Release(l2->lease_id).ok());
  EXPECT_EQ(store_->Stats().pinned_bytes, 2304u);
  auto c = Put(50, 8);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Forms(50, 8).size(), 8u);
  EXPECT_EQ(Forms(1, 4).size(), 4u);  // the leased sequence is intact
  EXPECT_GT(store_->metrics().evictions_demote.load() + store_->metrics().evictions_block.load(),
            0u);
  ASSERT_TRUE(store_->Release(l1->lease_id).ok());
  EXPECT_EQ(store_->Stats().pinned_bytes, 0u);
}

// Newcomer report s8 N6, the exact case: nothing leased, unrelated blocks stored, a put whose
// staging fits the pool (here 12 x 512 = 6144 of 10240 bytes) but whose staging plus new forms
// (512 + 9 x 256 + 2 x 768 = 4352) cannot fit even in an empty pool. Refused at BeginPut since
// 9b07483, before anything is evicted (it used to pass, then its commit evicted every stored
// block and failed with "the rest is leased, pinned by open puts or fragmented").
TEST_F(EvictionTest, APutThatCanNeverFitEvictsNothingAndIsRefusedAtBeginPut) {
  InitWatermarks(0.9, 0.8);
  ASSERT_TRUE(Put(1, 4).ok());
  ASSERT_TRUE(Put(2, 4).ok());
  const StoreStats before = store_->Stats();
  auto p = store_->BeginPut(ns_, Tokens(50, 48), 12, {});
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(p.status().message(), HasSubstr("needs 10496 bytes at once (6144 bytes of staging"));
  EXPECT_THAT(p.status().message(), HasSubstr("0 bytes are forms of leased or pinned blocks"));
  EXPECT_EQ(store_->Stats().used_bytes, before.used_bytes);
  EXPECT_EQ(store_->metrics().evictions_demote.load() + store_->metrics().evictions_block.load(),
            0u);
  EXPECT_EQ(Forms(1, 4).size(), 4u);
  EXPECT_EQ(Forms(2, 4).size(), 4u);
}

// Newcomer report s8 N6, what is left after 9b07483: a put accepted at BeginPut whose commit no
// longer fits because leases arrived meanwhile. The commit used to evict the unrelated unleased
// blocks first and then fail anyway; it now adds up its new forms first and fails before
// evicting anything, with the actual numbers (no claim about leases or pins that is not so).
TEST_F(EvictionTest, ACommitThatNoLongerFitsFailsBeforeEvictingAnything) {
  InitWatermarks(0.9, 0.8);     // 10240 bytes; BF16 form 512, INT2 192 (256 allocated)
  ASSERT_TRUE(Put(1, 4).ok());  // 2304 bytes each
  ASSERT_TRUE(Put(2, 4).ok());
  ASSERT_TRUE(Put(3, 2).ok());  // B, B+I: 1280 bytes, never leased
  // 8 blocks: staging 4096 + new forms 3328 = 7424 <= 10240 with nothing leased: accepted.
  auto plan = store_->BeginPut(ns_, Tokens(50, 32), 8, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto sums = Write(*plan, 50);
  auto l1 = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, absl::Minutes(1));
  auto l2 = store_->Acquire(ns_, {.token_ids = Tokens(2, 16)}, 0, absl::Minutes(1));
  ASSERT_TRUE(l1.ok() && l2.ok());
  const uint64_t used = store_->Stats().used_bytes;  // 4608 + 1280 + 4096 staging
  EXPECT_EQ(used, 9984u);
  // Now 10240 - 4096 staging - 4608 leased = 1536 can be freed, the forms need 3328.
  auto c = store_->CommitPut(ns_, plan->put_id, sums);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(c.status().message(),
              HasSubstr("num_blocks: the pool can no longer hold this put's commit: its 10 new "
                        "forms need 3328 bytes while its staging is held, and eviction can make "
                        "at most 1536 of the pool's 10240 bytes free (4096 bytes are staging of "
                        "open puts, this one's included, 4608 bytes are forms of leased or "
                        "pinned blocks"))
      << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr("nothing was evicted")) << c.status();
  EXPECT_EQ(store_->metrics().evictions_demote.load() + store_->metrics().evictions_block.load(),
            0u);
  const StoreStats after = store_->Stats();
  EXPECT_EQ(after.used_bytes, used - 4096);  // only the put's staging went
  EXPECT_EQ(after.staging_bytes, 0u);
  EXPECT_EQ(after.open_puts, 0u);
  EXPECT_EQ(after.pinned_bytes, 4608u);
  EXPECT_EQ(Forms(3, 2).size(), 2u);  // the unrelated unleased sequence is intact
  EXPECT_TRUE(Forms(50, 8).empty());
  ASSERT_TRUE(store_->Release(l1->lease_id).ok());
  ASSERT_TRUE(store_->Release(l2->lease_id).ok());
  EXPECT_EQ(store_->Stats().pinned_bytes, 0u);
}

// The allocation's own refusal (AllocateLocked, "num_blocks: pool full: ..."; the field prefix
// was missing until session 10), which the room checks of
// BeginPut and CommitPut cannot see coming: they add up bytes, and these free bytes are in
// pieces (untested until session 9). A model with no sink or recent blocks stores one INT2 form
// (192 bytes, 256 allocated) per block. 38 one-block puts leave their forms at 256-byte units
// 2..39 (each put's 512 bytes of staging at units 0-1, freed by its commit); an open put then
// holds units 0-1, every other sequence is deleted and the other 19 are leased. A one-block put
// needs 512 + 256 bytes, and 10240 - 512 staging - 19 x 256 leased = 4864 pass the room check,
// but every free range is 256 bytes: its staging cannot be allocated and nothing can be evicted.
// RESOURCE_EXHAUSTED with every part named; nothing stored, leased or open is touched. The same
// at CommitPut: with the open put aborted, a one-block put of the first model (its block is a
// sink: one 512-byte BF16 form) gets units 0-1 for its staging, and its commit finds no 512
// bytes in one piece for the form. Both puts go in once the leases are gone.
TEST_F(EvictionTest, AFragmentedPoolRefusesAPutNamingWhatHoldsIt) {
  InitWatermarks(0.9, 0.8);  // 10240 bytes
  const Digest sink_ns = ns_;
  spec_.model_id = "tiny-int2-only";
  spec_.sink_tokens = 0;
  spec_.recent_tokens = 0;
  auto info = store_->RegisterModel(spec_, {.file_bytes = RotationFileFor(spec_)});
  ASSERT_TRUE(info.ok()) << info.status();
  ns_ = info->namespace_id;
  for (uint32_t seq = 1; seq <= 38; ++seq) {
    ASSERT_TRUE(Put(seq, 1).ok()) << seq;
  }
  ASSERT_EQ(store_->Stats().used_bytes, 38u * 256);
  auto open = store_->BeginPut(ns_, Tokens(100, 4), 1, {});  // staging at units 0-1
  ASSERT_TRUE(open.ok()) << open.status();
  std::vector<Digest> even;
  for (uint32_t seq = 2; seq <= 38; seq += 2)
    even.push_back((*ChainKeys(ns_, Tokens(seq, 4), 4))[0]);
  uint32_t deleted = 0;
  ASSERT_TRUE(store_->Delete(ns_, even, &deleted).ok());
  ASSERT_EQ(deleted, 19u);
  std::vector<uint64_t> leases;
  for (uint32_t seq = 1; seq <= 37; seq += 2) {
    auto l = store_->Acquire(ns_, {.token_ids = Tokens(seq, 4)}, 0, absl::Minutes(1));
    ASSERT_TRUE(l.ok() && l->blocks.size() == 1u) << seq;
    leases.push_back(l->lease_id);
  }
  const StoreStats before = store_->Stats();
  EXPECT_EQ(before.used_bytes, 512u + 19 * 256);
  EXPECT_EQ(before.pinned_bytes, 19u * 256);

  auto p = store_->BeginPut(ns_, Tokens(101, 4), 1, {});
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_EQ(std::string(p.status().message()),
            "num_blocks: pool full: cannot allocate 768 bytes at once for 1 staging ranges and "
            "the 1 new forms its commit allocates beside them (5376 of 10240 bytes used: 512 bytes "
            "staging of open puts, 4864 bytes forms of leased or "
            "pinned blocks, 0 bytes forms of unpinned ancestors of pinned blocks (evicted only "
            "after them), 0 bytes forms other commits have not linked yet, 0 bytes forms "
            "eviction can free; 4864 bytes free, 4864 once those are evicted, but in pieces: the "
            "largest free range would be 256 bytes, and the first (512 bytes) finds no range); "
            "nothing was evicted");
  std::optional<RoomShortage> r = GetRoomShortage(p.status());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->need_bytes, 768u);
  EXPECT_EQ(r->room_bytes, 4864u);
  EXPECT_EQ(r->staging_bytes, 512u);
  EXPECT_EQ(r->pinned_bytes, 4864u);
  const StoreStats after = store_->Stats();
  EXPECT_EQ(after.used_bytes, before.used_bytes);  // nothing allocated, leaked or evicted
  EXPECT_EQ(after.staging_bytes, 512u);
  EXPECT_EQ(after.open_puts, 1u);
  EXPECT_EQ(after.blocks, 19u);
  EXPECT_EQ(store_->metrics().evictions_demote.load() + store_->metrics().evictions_block.load(),
            0u);
  for (uint32_t seq = 1; seq <= 37; seq += 2) EXPECT_EQ(Forms(seq, 1).size(), 1u) << seq;

  ASSERT_TRUE(store_->AbortPut(ns_, open->put_id).ok());
  auto sink = store_->BeginPut(sink_ns, Tokens(102, 4), 1, {});
  ASSERT_TRUE(sink.ok()) << sink.status();
  auto committed = store_->CommitPut(sink_ns, sink->put_id, Write(*sink, 102));
  ASSERT_EQ(committed.status().code(), absl::StatusCode::kResourceExhausted) << committed.status();
  // The same numbers, for the commit's new form.
  EXPECT_EQ(std::string(committed.status().message()),
            absl::StrReplaceAll(p.status().message(),
                                {{"768 bytes at once for 1 staging ranges and the 1 new forms its "
                                  "commit allocates beside them",
                                  "512 bytes at once for 1 new forms"}}));
  const StoreStats failed = store_->Stats();
  EXPECT_EQ(failed.used_bytes, 19u * 256);  // only the put's staging went
  EXPECT_EQ(failed.staging_bytes, 0u);
  EXPECT_EQ(failed.open_puts, 0u);
  EXPECT_EQ(failed.blocks, 19u);
  EXPECT_EQ(store_->metrics().evictions_demote.load() + store_->metrics().evictions_block.load(),
            0u);
  for (uint32_t seq = 1; seq <= 37; seq += 2) EXPECT_EQ(Forms(seq, 1).size(), 1u) << seq;

  for (uint64_t id : leases) ASSERT_TRUE(store_->Release(id).ok());
  auto c = Put(101, 1);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Forms(101, 1).size(), 1u);
  ns_ = sink_ns;
  c = Put(102, 1);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(Forms(102, 1), (std::vector<std::vector<FormKind>>{{kB}}));
}

// Newcomer report 11b F1: a commit that passes the room check (its new forms need less than
// capacity minus staging and pinned forms) but whose forms find no range even once eviction
// freed all it may, because the free bytes lie between other puts' staging. It used to evict
// every stored block and then fail, and its refusal counted its own forms allocated before the
// last one failed as "other forms eviction cannot free now (ancestors of pinned blocks)" next to
// 0 pinned bytes. Layout in 256-byte units (10240 bytes = 40): 12 groups [open put's staging,
// staging, a stored one-block INT2 form] fill units 0-35; a 2-block put of a model with no sink
// block and one recent block takes units 36-39 for its staging and needs, at commit, block 0's
// INT2 (1 unit), block 1's BF16 (2 units) and INT2 (1 unit): 4 units of the 12 that staging
// leaves, but eviction can only make 1-unit holes. Now: refused before anything is evicted,
// every part named truly; the 12 stored blocks stay. Once one open put is aborted (units 0-1),
// the same put commits, evicting what it needs.
TEST_F(EvictionTest, ACommitThatCannotBePlacedEvictsNothingAndNamesItsParts) {
  InitWatermarks(0.9, 0.8);
  spec_.model_id = "tiny-int2-only";
  spec_.sink_tokens = 0;
  spec_.recent_tokens = 0;
  auto filler = store_->RegisterModel(spec_, {.file_bytes = RotationFileFor(spec_)});
  ASSERT_TRUE(filler.ok()) << filler.status();
  spec_.model_id = "tiny-recent";
  spec_.recent_tokens = 4;
  auto recent = store_->RegisterModel(spec_, {.file_bytes = RotationFileFor(spec_)});
  ASSERT_TRUE(recent.ok()) << recent.status();
  ns_ = filler->namespace_id;
  // Sequence s's form at unit s + 1 (each put's staging at units 0-1, freed by its commit).
  for (uint32_t seq = 1; seq <= 38; ++seq) ASSERT_TRUE(Put(seq, 1).ok()) << seq;
  ASSERT_EQ(store_->Stats().used_bytes, 38u * 256);
  std::vector<Digest> gone;
  std::vector<uint32_t> kept;
  for (uint32_t seq = 1; seq <= 38; ++seq) {
    if (seq % 3 == 1 && seq <= 34) {
      kept.push_back(seq);  // units 2, 5, ..., 35
    } else {
      gone.push_back((*ChainKeys(ns_, Tokens(seq, 4), 4))[0]);
    }
  }
  uint32_t deleted = 0;
  ASSERT_TRUE(store_->Delete(ns_, gone, &deleted).ok());
  ASSERT_EQ(kept.size(), 12u);
  std::vector<uint64_t> open;
  for (uint32_t k = 0; k < 12; ++k) {  // staging at units 0-1, 3-4, ..., 33-34
    auto o = store_->BeginPut(ns_, Tokens(200 + k, 4), 1, {});
    ASSERT_TRUE(o.ok()) << o.status();
    ASSERT_EQ(o->blocks[0].staging_offset, (k == 0 ? 0u : 3u * k) * 256) << k;
    open.push_back(o->put_id);
  }
  ns_ = recent->namespace_id;
  auto plan = store_->BeginPut(ns_, Tokens(300, 8), 2, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->blocks[0].staging_offset, 36u * 256);
  ASSERT_EQ(plan->blocks[1].staging_offset, 38u * 256);
  const StoreStats before = store_->Stats();
  ASSERT_EQ(before.used_bytes, 10240u);
  ASSERT_EQ(before.staging_bytes, 28u * 256);
  ASSERT_EQ(before.pinned_bytes, 0u);
  ASSERT_EQ(before.blocks, 12u);

  auto committed = store_->CommitPut(ns_, plan->put_id, Write(*plan, 300));
  ASSERT_EQ(committed.status().code(), absl::StatusCode::kResourceExhausted) << committed.status();
  EXPECT_EQ(std::string(committed.status().message()),
            "num_blocks: pool full: cannot allocate 1024 bytes at once for 3 new forms (10240 of "
            "10240 bytes used: 7168 bytes staging of open puts, 0 bytes forms of leased or pinned "
            "blocks, 0 bytes forms of unpinned ancestors of pinned blocks (evicted only after "
            "them), 0 bytes forms other commits have not linked yet, 3072 bytes forms eviction "
            "can free; 0 bytes free, 3072 once those are evicted, but in pieces: the largest free "
            "range would be 256 bytes, and once the first 1 are placed the next (512 bytes) finds "
            "no range); nothing was evicted");
  std::optional<RoomShortage> r = GetRoomShortage(committed.status());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->need_bytes, 1024u);
  EXPECT_EQ(r->room_bytes, 3072u);
  EXPECT_EQ(r->staging_bytes, 28u * 256);
  EXPECT_EQ(r->pinned_bytes, 0u);
  const StoreStats after = store_->Stats();
  EXPECT_EQ(after.used_bytes, 10240u - 4 * 256);  // only the failed put's staging went
  EXPECT_EQ(after.staging_bytes, 24u * 256);
  EXPECT_EQ(after.open_puts, 12u);
  EXPECT_EQ(after.blocks, 12u);
  EXPECT_EQ(store_->metrics().evictions_demote.load() + store_->metrics().evictions_block.load(),
            0u);
  ns_ = filler->namespace_id;
  for (uint32_t seq : kept) EXPECT_EQ(Forms(seq, 1).size(), 1u) << seq;

  // Units 0-1 free: evicting the form at unit 2 makes a 3-unit range, so the commit can succeed
  // and does, evicting (watermark steps) and keeping its room.
  ASSERT_TRUE(store_->AbortPut(ns_, open[0]).ok());
  ns_ = recent->namespace_id;
  auto again = store_->BeginPut(ns_, Tokens(300, 8), 2, {});
  ASSERT_TRUE(again.ok()) << again.status();
  auto ok = store_->CommitPut(ns_, again->put_id, Write(*again, 300));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(Forms(300, 2), (std::vector<std::vector<FormKind>>{{kI}, {kB, kI}}));
  EXPECT_GT(store_->metrics().evictions_block.load(), 0u);
  for (uint64_t id : open) {
    if (id != open[0]) {
      ASSERT_TRUE(store_->AbortPut(filler->namespace_id, id).ok());
    }
  }
}

// The same at BeginPut: a put whose staging fits only after eviction but whose commit could
// then not place its new form evicts nothing and is refused there. 13 groups [staging, staging,
// stored INT2 form] at units 0-38 and one more stored form at unit 39: a one-block put of the
// first model (a sink block: staging 512 bytes, one 512-byte BF16 form) finds its staging at
// units 38-39 once those two forms are evicted, but no second 2-unit range for its form.
TEST_F(EvictionTest, APutWhoseCommitCouldNotBePlacedEvictsNothingForItsStaging) {
  InitWatermarks(0.9, 0.8);
  const Digest tiny_ns = ns_;
  spec_.model_id = "tiny-int2-only";
  spec_.sink_tokens = 0;
  spec_.recent_tokens = 0;
  auto filler = store_->RegisterModel(spec_, {.file_bytes = RotationFileFor(spec_)});
  ASSERT_TRUE(filler.ok()) << filler.status();
  ns_ = filler->namespace_id;
  for (uint32_t seq = 1; seq <= 38; ++seq) ASSERT_TRUE(Put(seq, 1).ok()) << seq;
  std::vector<Digest> gone;
  std::vector<uint32_t> kept;
  for (uint32_t seq = 1; seq <= 38; ++seq) {
    if (seq % 3 == 1 || seq == 38) {
      kept.push_back(seq);  // units 2, 5, ..., 38 and 39
    } else {
      gone.push_back((*ChainKeys(ns_, Tokens(seq, 4), 4))[0]);
    }
  }
  uint32_t deleted = 0;
  ASSERT_TRUE(store_->Delete(ns_, gone, &deleted).ok());
  ASSERT_EQ(kept.size(), 14u);
  std::vector<uint64_t> open;
  for (uint32_t k = 0; k < 13; ++k) {  // staging at units 0-1, 3-4, ..., 36-37
    auto o = store_->BeginPut(ns_, Tokens(200 + k, 4), 1, {});
    ASSERT_TRUE(o.ok()) << o.status();
    ASSERT_EQ(o->blocks[0].staging_offset, 3u * k * 256) << k;
    open.push_back(o->put_id);
  }
  ASSERT_EQ(store_->Stats().used_bytes, 10240u);

  auto p = store_->BeginPut(tiny_ns, Tokens(400, 4), 1, {});
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_EQ(std::string(p.status().message()),
            "num_blocks: pool full: cannot allocate 1024 bytes at once for 1 staging ranges and "
            "the 1 new forms its commit allocates beside them (10240 of 10240 bytes used: 6656 "
            "bytes staging of open puts, 0 bytes forms of leased or pinned blocks, 0 bytes forms "
            "of unpinned ancestors of pinned blocks (evicted only after them), 0 bytes forms other "
            "commits have not linked yet, 3584 bytes forms eviction can free; 0 bytes free, 3584 "
            "once those are evicted, but in pieces: the largest free range would be 512 bytes, "
            "and once the first 1 are placed the next (512 bytes) finds no range); nothing was "
            "evicted");
  const StoreStats after = store_->Stats();
  EXPECT_EQ(after.used_bytes, 10240u);
  EXPECT_EQ(after.open_puts, 13u);
  EXPECT_EQ(after.blocks, 14u);
  EXPECT_EQ(store_->metrics().evictions_demote.load() + store_->metrics().evictions_block.load(),
            0u);
  for (uint32_t seq : kept) EXPECT_EQ(Forms(seq, 1).size(), 1u) << seq;
  for (uint64_t id : open) ASSERT_TRUE(store_->AbortPut(ns_, id).ok());
}

TEST_F(StoreTest, DeleteRemovesDescendantsAndRespectsLeases) {
  ASSERT_TRUE(Put(1, 4).ok());
  ASSERT_TRUE(Put(2, 4, 8).ok());  // shares blocks 0, 1 with sequence... only with itself
  ASSERT_TRUE(Put(3, 4, 8).ok());  // sequences 2 and 3 share blocks 0, 1
  EXPECT_EQ(store_->Stats().blocks, 4u + 6u);
  auto keys2 = ChainKeys(ns_, Tokens(2, 16, 8), 4);
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(3, 16, 8)}, 0, {});
  uint32_t deleted = 0;
  auto r = store_->Delete(ns_, {(*keys2)[1]}, &deleted);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(deleted, 0u);
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
  r = store_->Delete(ns_, {(*keys2)[1], Sha256("absent")}, &deleted);
  EXPECT_TRUE((*r)[0].status.ok());
  EXPECT_EQ((*r)[1].status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(deleted, 5u);  // block 1 and the blocks 2, 3 of both sequences
  EXPECT_EQ(Forms(2, 4, 8).size(), 1u);
  EXPECT_EQ(Forms(3, 4, 8).size(), 1u);
  EXPECT_EQ(Forms(1, 4).size(), 4u);
}

// ---- corruption reports (ReportCorrupt, protocol v1.5) ----

// The form `f` of leased block `b`.
const FormLocation* LeasedForm(const LeasedBlock& b, FormKind f) {
  for (const FormLocation& l : b.forms) {
    if (l.form == f) return &l;
  }
  return nullptr;
}

// A reader found a stored form corrupt and said so: the pool re-verifies it, drops it at once
// (lookups and new leases stop before the block, whose only form it was), keeps its bytes while
// the reporter's lease may still read them, frees them at the release, keeps the descendants,
// and a re-put writes only that block and restores it byte for byte.
TEST_F(StoreTest, ACorruptStoredFormReportedByAReaderIsDroppedAndARePutRestoresIt) {
  ASSERT_TRUE(Put(1, 4).ok());  // forms B, I, B+I, B+I
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, absl::Minutes(1));
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->blocks.size(), 4u);
  const FormLocation* int2 = LeasedForm(lease->blocks[1], kI);
  ASSERT_NE(int2, nullptr);
  ASSERT_EQ(lease->blocks[1].forms.size(), 1u);  // a history block: INT2 only
  const std::vector<uint8_t> good(mem_->data() + int2->offset,
                                  mem_->data() + int2->offset + int2->size);
  mem_->data()[int2->offset + 5] ^= 0x10;  // the stored form goes bad
  const uint64_t used = store_->Stats().used_bytes;

  auto r = store_->ReportCorrupt(
      ns_, {{.key = lease->blocks[1].key, .form = kI, .generation = int2->generation}});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 1u);
  EXPECT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  EXPECT_EQ((*r)[0].verdict, CorruptionVerdict::kDropped);
  EXPECT_FALSE((*r)[0].block_held);
  EXPECT_FALSE((*r)[0].bytes_freed);  // the lease may still be reading them
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_stored.load(), 1u);
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_transit.load(), 0u);
  EXPECT_EQ(store_->metrics().checksum_failures.load(), 0u);  // commit failures are apart

  // No longer served: lookups and leases stop before block 1; the descendants stay resident.
  EXPECT_EQ(Forms(1, 4).size(), 1u);
  auto again = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, {});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->blocks.size(), 1u);
  ASSERT_TRUE(store_->Release(again->lease_id).ok());
  EXPECT_EQ(store_->Stats().blocks, 3u);  // block 1 holds nothing readable
  EXPECT_EQ(store_->Stats().forms[int(kI)], 2u);
  // The reporter's lease names the dropped form apart from the ones it may still read.
  std::vector<std::pair<uint64_t, uint64_t>> dropped;
  auto ranges = store_->LeasedRanges(lease->lease_id, &dropped);
  ASSERT_TRUE(ranges.ok());
  EXPECT_EQ(ranges->size(), 5u);  // B, B+I, B+I
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0], std::make_pair(int2->offset, int2->size));
  EXPECT_EQ(store_->Stats().used_bytes, used);    // not freed under the lease
  EXPECT_EQ(store_->Stats().pinned_bytes, used);  // the dropped form stays pinned with it
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
  EXPECT_EQ(store_->Stats().used_bytes, used - 256);  // 192 bytes, allocated as 256
  EXPECT_EQ(store_->Stats().pinned_bytes, 0u);

  // A re-put of the sequence writes block 1 only and restores it.
  auto plan = store_->BeginPut(ns_, Tokens(1, 16), 4, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const PutBlockPlan& b : plan->blocks) {
    EXPECT_EQ(b.action, b.index == 1 ? PutAction::kWrite : PutAction::kSkip) << b.index;
  }
  EXPECT_EQ(plan->blocks[1].forms_added, (std::vector<FormKind>{kI}));
  ASSERT_TRUE(store_->CommitPut(ns_, plan->put_id, Write(*plan, 1)).ok());
  auto restored = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, {});
  ASSERT_TRUE(restored.ok());
  ASSERT_EQ(restored->blocks.size(), 4u);
  const FormLocation* fresh = LeasedForm(restored->blocks[1], kI);
  ASSERT_NE(fresh, nullptr);
  EXPECT_NE(fresh->generation, int2->generation);
  EXPECT_EQ(fresh->xxh3, int2->xxh3);
  EXPECT_EQ(0, std::memcmp(mem_->data() + fresh->offset, good.data(), good.size()));
  EXPECT_EQ(store_->Stats().blocks, 4u);
  EXPECT_EQ(store_->Stats().used_bytes, used);
  EXPECT_EQ(store_->Stats().pinned_bytes, used);
  ASSERT_TRUE(store_->Release(restored->lease_id).ok());
  EXPECT_EQ(store_->Stats().pinned_bytes, 0u);
}

// A report whose stored form verifies keeps it (the damage was in transit or in the reader).
TEST_F(StoreTest, AReportedFormThatVerifiesIsKept) {
  ASSERT_TRUE(Put(1, 4).ok());
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, {});
  ASSERT_TRUE(lease.ok());
  const FormLocation* bf16 = LeasedForm(lease->blocks[2], kB);
  ASSERT_NE(bf16, nullptr);
  const uint64_t used = store_->Stats().used_bytes;
  auto r = store_->ReportCorrupt(ns_, {{.key = lease->blocks[2].key,
                                        .form = kB,
                                        .generation = bf16->generation,
                                        .observed_xxh3 = bf16->xxh3 ^ 1}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  EXPECT_EQ((*r)[0].verdict, CorruptionVerdict::kIntact);
  EXPECT_TRUE((*r)[0].block_held);
  EXPECT_FALSE((*r)[0].bytes_freed);
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_transit.load(), 1u);
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_stored.load(), 0u);
  auto f = Forms(1, 4);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[2], (std::vector<FormKind>{kB, kI}));
  EXPECT_EQ(store_->Stats().used_bytes, used);
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
  EXPECT_EQ(store_->Stats().used_bytes, used);
}

// Forged or stale reports (another generation, an unknown key, another namespace's block, a form
// the block does not hold, a duplicate) never drop a form, not even a corrupt one: each is
// refused naming the field, and the call's own errors name theirs.
TEST_F(StoreTest, ForgedOrStaleReportsDropNothingAndNameTheField) {
  ASSERT_TRUE(Put(1, 4).ok());
  ModelSpec other = spec_;
  other.revision = "r2";
  auto info2 = store_->RegisterModel(other, {.id = info_.rotation_id});
  ASSERT_TRUE(info2.ok());
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, {});
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->blocks.size(), 4u);
  const LeasedBlock& b1 = lease->blocks[1];
  const LeasedBlock& b2 = lease->blocks[2];
  const FormLocation* i1 = LeasedForm(b1, kI);
  const FormLocation* b2bf16 = LeasedForm(b2, kB);
  ASSERT_NE(i1, nullptr);
  ASSERT_NE(b2bf16, nullptr);
  mem_->data()[i1->offset] ^= 1;  // really corrupt: still the wrong reports must not drop it
  const std::vector<CorruptionReport> reports = {
      {.key = b1.key, .form = kI, .generation = i1->generation + 1},  // stale
      {.key = Sha256("not a block"), .form = kB, .generation = 1},    // unknown
      {.key = b1.key, .form = kB, .generation = i1->generation},      // not held
      {.key = b2.key, .form = kB, .generation = b2bf16->generation},  // intact: kept
      {.key = b2.key, .form = kB, .generation = b2bf16->generation},  // duplicate
  };
  auto r = store_->ReportCorrupt(ns_, reports);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), reports.size());
  EXPECT_EQ((*r)[0].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE((*r)[0].status.message().find("reports[0].generation"), std::string_view::npos)
      << (*r)[0].status;
  EXPECT_EQ((*r)[1].status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE((*r)[1].status.message().find("reports[1].key"), std::string_view::npos)
      << (*r)[1].status;
  EXPECT_EQ((*r)[2].status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE((*r)[2].status.message().find("reports[2].form"), std::string_view::npos)
      << (*r)[2].status;
  EXPECT_TRUE((*r)[3].status.ok()) << (*r)[3].status;
  EXPECT_EQ((*r)[3].verdict, CorruptionVerdict::kIntact);
  EXPECT_EQ((*r)[4].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE((*r)[4].status.message().find("reports[4]"), std::string_view::npos) << (*r)[4].status;
  // A refused report still says whether the block holds a form (newcomer s8 N13): b1 and b2 do,
  // the unknown key names none.
  EXPECT_TRUE((*r)[0].block_held);
  EXPECT_FALSE((*r)[1].block_held);
  EXPECT_TRUE((*r)[2].block_held);
  EXPECT_TRUE((*r)[3].block_held);
  EXPECT_TRUE((*r)[4].block_held);
  // Another namespace cannot name this one's blocks (its own key of the same tokens is another).
  auto foreign = store_->ReportCorrupt(info2->namespace_id,
                                       {{.key = b1.key, .form = kI, .generation = i1->generation}});
  ASSERT_TRUE(foreign.ok()) << foreign.status();
  EXPECT_EQ((*foreign)[0].status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE((*foreign)[0].status.message().find("reports[0].key"), std::string_view::npos);
  EXPECT_EQ(store_->metrics().corruption_reports_refused.load(), 5u);
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_stored.load(), 0u);
  // Errors of the call: no report, too many, a namespace not registered.
  auto none = store_->ReportCorrupt(ns_, {});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("reports"), std::string_view::npos);
  std::vector<CorruptionReport> many(kMaxCorruptionReports + 1, reports[3]);
  auto too_many = store_->ReportCorrupt(ns_, many);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("reports: 257"), std::string_view::npos)
      << too_many.status();
  auto unregistered = store_->ReportCorrupt(Sha256("no model"), {reports[3]});
  EXPECT_EQ(unregistered.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unregistered.status().message().find("namespace_id"), std::string_view::npos);
  // Everything is still held, every form.
  auto f = Forms(1, 4);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[1], (std::vector<FormKind>{kI}));
  EXPECT_EQ(f[2], (std::vector<FormKind>{kB, kI}));
  EXPECT_EQ(store_->Stats().blocks, 4u);
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
}

// An unleased leaf: a dropped form's bytes are freed at once; when its last form goes the block
// goes too (nothing pins it and no block descends from it), and its parent stays held.
TEST_F(StoreTest, AnUnpinnedLeafLosesItsCorruptFormsAtOnce) {
  ASSERT_TRUE(Put(1, 4).ok());
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, {});
  ASSERT_TRUE(lease.ok());
  const LeasedBlock b3 = lease->blocks[3];
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
  const FormLocation* bf16 = LeasedForm(b3, kB);
  const FormLocation* int2 = LeasedForm(b3, kI);
  ASSERT_NE(bf16, nullptr);
  ASSERT_NE(int2, nullptr);
  const uint64_t used = store_->Stats().used_bytes;
  mem_->data()[bf16->offset + bf16->size - 1] ^= 0x80;
  auto r =
      store_->ReportCorrupt(ns_, {{.key = b3.key, .form = kB, .generation = bf16->generation}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].verdict, CorruptionVerdict::kDropped);
  EXPECT_TRUE((*r)[0].block_held);  // its INT2 form remains
  EXPECT_TRUE((*r)[0].bytes_freed);
  EXPECT_EQ(store_->Stats().used_bytes, used - 512);
  auto f = Forms(1, 4);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[3], (std::vector<FormKind>{kI}));

  mem_->data()[int2->offset + 7] ^= 0x01;
  r = store_->ReportCorrupt(ns_, {{.key = b3.key, .form = kI, .generation = int2->generation}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)[0].verdict, CorruptionVerdict::kDropped);
  EXPECT_FALSE((*r)[0].block_held);
  EXPECT_TRUE((*r)[0].bytes_freed);
  EXPECT_EQ(store_->Stats().used_bytes, used - 512 - 256);
  EXPECT_EQ(store_->Stats().blocks, 3u);
  EXPECT_EQ(Forms(1, 4).size(), 3u);
  // The block is gone from the index: a second report of it names the key.
  r = store_->ReportCorrupt(ns_, {{.key = b3.key, .form = kI, .generation = int2->generation}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0].status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_stored.load(), 2u);
  // The put that follows writes it again (as the recent tail: both forms).
  auto c = Put(1, 4);
  ASSERT_TRUE(c.ok()) << c.status();
  f = Forms(1, 4);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[3], (std::vector<FormKind>{kB, kI}));
  EXPECT_EQ(store_->Stats().used_bytes, used);
}

// A client that repeats a report (a bug, or on purpose) made the pool hash the same stored form
// every time. A form verified intact within corruption_report_dedupe_window (60 s) is answered
// INTACT from that verification; the bytes are not hashed again (here: damaged after the first
// verification, still INTACT within the window), and after the window a report hashes again and
// finds the damage. Counted in corruption_reports_dropped_duplicate; nothing else changes.
TEST_F(StoreTest, ARepeatedReportOfAFormVerifiedIntactIsNotHashedAgainWithinTheWindow) {
  ASSERT_TRUE(Put(1, 4).ok());
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, absl::Minutes(5));
  ASSERT_TRUE(lease.ok());
  const FormLocation* int2 = LeasedForm(lease->blocks[1], kI);
  ASSERT_NE(int2, nullptr);
  const CorruptionReport report{
      .key = lease->blocks[1].key, .form = kI, .generation = int2->generation};
  auto first = store_->ReportCorrupt(ns_, {report}, "10.0.0.1");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE((*first)[0].status.ok()) << (*first)[0].status;
  EXPECT_EQ((*first)[0].verdict, CorruptionVerdict::kIntact);
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_transit.load(), 1u);

  mem_->data()[int2->offset + 3] ^= 0x01;  // damaged after the verification
  for (int i = 0; i < 5; ++i) {
    clock_.Advance(absl::Seconds(10));  // 10..50 s after it: inside the window
    auto again = store_->ReportCorrupt(ns_, {report}, i % 2 ? "10.0.0.1" : "10.0.0.2");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE((*again)[0].status.ok()) << (*again)[0].status;
    EXPECT_EQ((*again)[0].verdict, CorruptionVerdict::kIntact);
    EXPECT_TRUE((*again)[0].block_held);
  }
  EXPECT_EQ(store_->metrics().corruption_reports_dropped_duplicate.load(), 5u);
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_transit.load(), 1u);  // not hashed again
  EXPECT_EQ(store_->metrics().corruption_reports_refused.load(), 0u);
  EXPECT_EQ(Forms(1, 4).size(), 4u);

  clock_.Advance(absl::Seconds(11));  // 61 s after the verification
  auto late = store_->ReportCorrupt(ns_, {report}, "10.0.0.1");
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ((*late)[0].verdict, CorruptionVerdict::kDropped);  // hashed: the damage is found
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_stored.load(), 1u);
  EXPECT_EQ(store_->metrics().corruption_reports_dropped_duplicate.load(), 5u);
  // The dropped form is gone: a further repeat names the form, as before.
  auto gone = store_->ReportCorrupt(ns_, {report}, "10.0.0.1");
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ((*gone)[0].status.code(), absl::StatusCode::kNotFound) << (*gone)[0].status;
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
}

// A client flooding reports made the pool hash one stored form per report without bound. Each
// client (the server passes the gRPC peer's host) has a token bucket: here 2 re-verified reports
// per second, at most 3 at once; a report beyond it is refused RESOURCE_EXHAUSTED naming
// reports[i] and the limit, changes nothing and is counted (corruption_reports_dropped_rate).
// Another client has its own bucket; the bucket refills with time. Reports refused for their
// content (unknown key) take no token. Dedupe is off here, so repeats also need tokens.
TEST_F(StoreTest, ReportsBeyondAClientsRateAreRefusedAndCounted) {
  StoreOptions o;
  o.corruption_reports_per_second = 2;
  o.corruption_report_burst = 3;
  o.corruption_report_dedupe_window = absl::ZeroDuration();
  Init(1 << 20, HistoryPrecision::kInt2, o);
  ASSERT_TRUE(Put(1, 4).ok());  // forms B, I, B+I, B+I
  auto lease = store_->Acquire(ns_, {.token_ids = Tokens(1, 16)}, 0, absl::Minutes(5));
  ASSERT_TRUE(lease.ok());
  std::vector<CorruptionReport> all;
  for (const LeasedBlock& b : lease->blocks) {
    for (const FormLocation& f : b.forms) {
      all.push_back({.key = b.key, .form = f.form, .generation = f.generation});
    }
  }
  ASSERT_EQ(all.size(), 6u);
  const uint64_t used = store_->Stats().used_bytes;
  // An unknown key first: refused for its content, no token taken.
  std::vector<CorruptionReport> five = {
      {.key = Digest{}, .form = kI, .generation = 1}, all[0], all[1], all[2], all[3], all[4]};
  auto a = store_->ReportCorrupt(ns_, five, "10.0.0.1");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)[0].status.code(), absl::StatusCode::kNotFound);
  for (int i = 1; i <= 3; ++i) {
    EXPECT_TRUE((*a)[i].status.ok()) << i << ": " << (*a)[i].status;
    EXPECT_EQ((*a)[i].verdict, CorruptionVerdict::kIntact);
  }
  EXPECT_FALSE((*a)[0].block_held);
  for (int i = 4; i <= 5; ++i) {
    EXPECT_EQ((*a)[i].status.code(), absl::StatusCode::kResourceExhausted) << (*a)[i].status;
    EXPECT_TRUE((*a)[i].block_held) << i;
    EXPECT_THAT((*a)[i].status.message(), HasSubstr(absl::StrCat("reports[", i, "]")));
    EXPECT_THAT((*a)[i].status.message(),
                HasSubstr("this client (10.0.0.1) is over its rate of 2 re-verified reports per "
                          "second (burst 3"));
  }
  EXPECT_EQ(store_->metrics().corruption_reports_dropped_rate.load(), 2u);
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_transit.load(), 3u);  // 3 hashed
  // Another client is not held back by the first one's reports.
  auto b = store_->ReportCorrupt(ns_, {all[5]}, "10.0.0.2");
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE((*b)[0].status.ok()) << (*b)[0].status;
  // Half a second refills one token for the first client: one of two passes.
  clock_.Advance(absl::Milliseconds(500));
  auto c = store_->ReportCorrupt(ns_, {all[4], all[5]}, "10.0.0.1");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE((*c)[0].status.ok()) << (*c)[0].status;
  EXPECT_EQ((*c)[1].status.code(), absl::StatusCode::kResourceExhausted) << (*c)[1].status;
  EXPECT_EQ(store_->metrics().corruption_reports_dropped_rate.load(), 3u);
  // After a long pause the bucket holds its burst again, not more.
  clock_.Advance(absl::Minutes(1));
  auto d = store_->ReportCorrupt(ns_, {all[0], all[1], all[2], all[3]}, "10.0.0.1");
  ASSERT_TRUE(d.ok());
  for (int i = 0; i < 3; ++i) EXPECT_TRUE((*d)[i].status.ok()) << (*d)[i].status;
  EXPECT_EQ((*d)[3].status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->metrics().corruption_reports_dropped_rate.load(), 4u);
  // Nothing stored changed.
  EXPECT_EQ(store_->Stats().used_bytes, used);
  EXPECT_EQ(Forms(1, 4).size(), 4u);
  EXPECT_EQ(store_->metrics().checksum_failures_fetch_stored.load(), 0u);
  ASSERT_TRUE(store_->Release(lease->lease_id).ok());
}

TEST(StoreOptionsTest, CorruptionReportLimitsAreChecked) {
  auto mem = *HeapPoolMemory::Create(1 << 20);
  FakeClock clock;
  StoreOptions o;
  o.corruption_report_burst = 0;
  auto s = BlockStore::Create(o, mem.get(), &clock);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("corruption-report-burst"));
  o = {};
  o.corruption_reports_per_second = -1;
  s = BlockStore::Create(o, mem.get(), &clock);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("corruption-report-rate"));
}

TEST_F(StoreTest, ConcurrentClientsKeepTheStoreConsistent) {
  Init(4 << 20);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int iter = 0; iter < 20; ++iter) {
        const uint32_t seq = (t * 7 + iter) % 10;  // overlapping sequences across threads
        auto plan = store_->BeginPut(ns_, Tokens(seq, 24), 6, {});
        if (!plan.ok()) {
          failures++;
          continue;
        }
        std::vector<BlockChecksum> sums;
        for (const PutBlockPlan& b : plan->blocks) {
          if (b.action != PutAction::kWrite) {
            continue;
          }
          auto bytes = BlockBytes(spec_.geometry, seq, b.index);
          std::memcpy(mem_->data() + b.staging_offset, bytes.data(), bytes.size());
          sums.push_back({b.index, FormChecksum(bytes.data(), bytes.size())});
        }
        if (!store_->CommitPut(ns_, plan->put_id, sums).ok()) {
          failures++;
        }
        auto l = store_->Acquire(ns_, {.token_ids = Tokens(seq, 24)}, 0, {});
        if (!l.ok() || l->blocks.size() != 6) {
          failures++;
          continue;
        }
        for (const auto& b : l->blocks) {
          for (const auto& f : b.forms) {
            if (FormChecksum(mem_->data() + f.offset, f.size) != f.xxh3) {
              failures++;
            }
          }
        }
        if (!store_->Release(l->lease_id).ok()) {
          failures++;
        }
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
  EXPECT_EQ(failures.load(), 0);
  StoreStats s = store_->Stats();
  EXPECT_EQ(s.blocks, 60u);
  EXPECT_EQ(s.leases, 0u);
  EXPECT_EQ(s.open_puts, 0u);
  EXPECT_EQ(s.staging_bytes, 0u);
  EXPECT_EQ(s.pinned_bytes, 0u);  // every pin (puts, commits, leases) was given back
  EXPECT_EQ(s.used_bytes, 10u * (512 + 3 * 256 + 2 * (512 + 256)));
}

}  // namespace
}  // namespace kvpool::kvstore
