// client_test — the client against an in-process pool (kvstore's PoolServer) over UCX (tcp and
// posix,cma): byte-exact put → fetch against the CPU encoder, page tables, validation errors,
// deadlines, cancellation, leases, corruption detection (DATA_LOSS) and a pool restart.
#include "kvpool/client/client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "kvpool/common/checksum.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/kernels/rotation_file.h"
#include "kvpool/kvstore/encoder.h"
#include "kvpool/kvstore/server.h"
#include "pool_testing.h"

namespace kvpool::client {
namespace {

using ::testing::HasSubstr;

using testing::ExpectedForms;
using testing::Geometry;
using testing::kDim;
using testing::kHeads;
using testing::kLayers;
using testing::kPage;
using testing::MakeSequence;
using testing::Sequence;
using testing::Spec;

// Loopback only: UCX's tcp transport otherwise also opens lanes over eth0. A value from the
// environment wins.
class LoopbackEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { setenv("UCX_NET_DEVICES", "lo", /*overwrite=*/0); }
};
const auto* const kLoopback = ::testing::AddGlobalTestEnvironment(new LoopbackEnvironment);

// Options of an in-process pool of one test: a free loopback port, no metrics port, 16 MiB.
kvstore::PoolServerOptions LoopbackPoolOptions() {
  kvstore::PoolServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_port = -1;
  o.capacity_bytes = 16 << 20;
  return o;
}

// An in-process pool without a UCX data plane (kvpool-server --data-plane none): it accepts a
// registration, which the client then refuses (FAILED_PRECONDITION, RefusedByClient).
absl::StatusOr<std::unique_ptr<kvstore::PoolServer>> StartDataPlaneNonePool() {
  kvstore::PoolServerOptions o = LoopbackPoolOptions();
  o.data_plane = "none";
  return kvstore::PoolServer::Create(o);
}

class ClientTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { StartServer(0); }

  void StartServer(int port, uint64_t max_registration_bytes = uint64_t{1} << 30) {
    kvstore::PoolServerOptions o;
    o.store.max_registration_bytes = max_registration_bytes;
    o.listen = absl::StrCat("127.0.0.1:", port);
    o.metrics_port = -1;
    o.capacity_bytes = 16 << 20;
    o.ucx_tls = Tls();
    o.transfer_initiator = Initiator();
    o.tick_interval = absl::Milliseconds(20);
    auto s = kvstore::PoolServer::Create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    port_ = server_->grpc_port();
  }

  // `report_corrupt_forms` false: fetches that fail a checksum do not report it to the pool
  // (tests that corrupt pool memory and restore it).
  std::unique_ptr<Client> NewClient(bool check_finite = true, bool report_corrupt_forms = true) {
    absl::Status error;
    // MODE "threads": 4 copy threads and no size floor, so every put layer and every fetch
    // of these small sequences is spread over the client's CopyPool (chunk pipeline for few
    // blocks, one task per block for many).
    const bool threads = Threads();
    auto c =
        testing::NewClient(absl::StrCat("127.0.0.1:", port_), Tls(), check_finite, &error,
                           /*map_shared_memory=*/Mode() != "rma",
                           /*copy_threads=*/threads ? 4 : 1,
                           /*parallel_min_bytes=*/threads ? 0 : 64 << 10, report_corrupt_forms);
    EXPECT_NE(c, nullptr) << error;
    return c;
  }

  // Page pools for `blocks` blocks of each form; pages in reverse order, so page ids differ
  // from block indices.
  using Pools = testing::FetchPools;
  std::unique_ptr<Pools> MakePools(Client& c, uint32_t blocks) {
    auto p = Pools::Create(c, blocks, /*reverse_pages=*/true);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }

  // Parameter "TLS" or "TLS/MODE": the UCX transports, and who initiates RMA transfers (MODE
  // "pool" or "client" = the server's transfer_initiator; default auto = pool over tcp, client
  // over shared memory). MODE "rma": the client initiates but does not map the pool's memory
  // (ClientOptions::map_shared_memory = false), so shared memory also runs RMA transfers.
  std::string Tls() const { return GetParam().substr(0, GetParam().find('/')); }
  std::string Mode() const {
    std::string p = GetParam();
    if (Threads()) p.resize(p.size() - std::string_view("/threads").size());
    const size_t slash = p.find('/');
    return slash == std::string::npos ? "" : p.substr(slash + 1);
  }
  bool Threads() const { return absl::EndsWith(GetParam(), "/threads"); }
  std::string Initiator() const {
    if (Mode().empty()) return "auto";
    return Mode() == "rma" ? "client" : Mode();
  }

  // Leases and fetches the `blocks` full blocks of `s` (history precision bf16: every block
  // BF16) into pages 0..blocks-1, compares each page with the encoder's BF16 form and releases
  // the lease. Returns the
  // fetch for further checks (nullopt after a failed assertion).
  std::optional<FetchResult> FetchAndCompareBf16(Client& c, const Sequence& s,
                                                 const ModelSpec& spec, uint32_t blocks) {
    auto lease = c.Acquire(s.tokens);
    EXPECT_TRUE(lease.ok()) << lease.status();
    if (!lease.ok() || lease->blocks.size() != blocks) {
      ADD_FAILURE() << "leased " << (lease.ok() ? lease->blocks.size() : 0) << " blocks";
      return std::nullopt;
    }
    // Pages in block order (the other tests reverse them): blocks adjacent in the pool then
    // move as one RMA op (transport::CoalesceOps) on the RMA paths.
    auto made = Pools::Create(c, blocks, /*reverse_pages=*/false);
    EXPECT_TRUE(made.ok()) << made.status();
    if (!made.ok()) return std::nullopt;
    auto pools = *std::move(made);
    auto f = c.Fetch(*lease, pools->plan);
    EXPECT_TRUE(f.ok()) << f.status();
    if (!f.ok() || f->num_blocks != blocks) {
      ADD_FAILURE() << "fetched " << (f.ok() ? f->num_blocks : 0) << " blocks";
      return std::nullopt;
    }
    const BlockGeometry g = testing::Geometry();
    for (uint32_t b = 0; b < blocks; ++b) {
      std::vector<uint8_t> bf16, int2;
      EXPECT_TRUE(ExpectedForms(s, b, spec, &bf16, &int2)) << b;
      EXPECT_EQ(0, std::memcmp(pools->bf16_mem.data() + f->pages[b] * g.Bf16FormBytes(),
                               bf16.data(), bf16.size()))
          << "block " << b;
    }
    EXPECT_TRUE(c.Release(*lease).ok());
    return *std::move(f);
  }

  // Leases and fetches the `blocks` full blocks of `s` (any history precision) and compares
  // each fetched form, INT2 or BF16, with the encoder's; releases the lease.
  void FetchAndCompareForms(Client& c, const Sequence& s, const ModelSpec& spec, uint32_t blocks) {
    auto lease = c.Acquire(s.tokens);
    ASSERT_TRUE(lease.ok()) << lease.status();
    ASSERT_EQ(lease->blocks.size(), blocks);
    auto pools = MakePools(c, blocks);
    ASSERT_NE(pools, nullptr);
    auto f = c.Fetch(*lease, pools->plan);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_EQ(f->num_blocks, blocks);
    const BlockGeometry g = testing::Geometry();
    for (uint32_t b = 0; b < blocks; ++b) {
      std::vector<uint8_t> bf16, int2;
      ASSERT_TRUE(ExpectedForms(s, b, spec, &bf16, &int2)) << b;
      if (f->forms[b] == Form::kInt2) {
        EXPECT_EQ(0, std::memcmp(pools->int2_mem.data() + f->pages[b] * g.Int2FormBytes(),
                                 int2.data(), int2.size()))
            << "block " << b;
      } else {
        EXPECT_EQ(0, std::memcmp(pools->bf16_mem.data() + f->pages[b] * g.Bf16FormBytes(),
                                 bf16.data(), bf16.size()))
            << "block " << b;
      }
    }
    EXPECT_TRUE(c.Release(*lease).ok());
  }

  // Is the packed slice of `layer` of every block of `s` somewhere in the pool's memory?
  bool LayerInPool(const Sequence& s, uint32_t layer) {
    const BlockGeometry g = testing::Geometry();
    kvstore::PoolMemory& mem = server_->store().memory();
    std::vector<uint8_t> slice(g.Bf16LayerBytes());
    for (uint32_t b = 0; b < s.tokens.size() / kPage; ++b) {
      PackLayerSlice(g, b, s.k[layer].data(), s.v[layer].data(), slice.data());
      if (memmem(mem.data(), mem.size(), slice.data(), slice.size()) == nullptr) return false;
    }
    return true;
  }
  // LayerInPool, waited for (bounded by 20 s: a bound, not a speed check).
  bool LayerArrives(const Sequence& s, uint32_t layer) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (!LayerInPool(s, layer) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    return LayerInPool(s, layer);
  }
  // Ends a 3-block bf16 put whose layers were all written: `commit` false aborts it and checks
  // that nothing is visible and its staging and open put are gone; true commits it and checks
  // the stored bytes against the encoder.
  void AbortOrCommitThreeBlocks(Client& c, PutSession& put, const Sequence& s,
                                const ModelSpec& spec, bool commit) {
    if (!commit) {
      ASSERT_TRUE(put.Abort().ok());
      auto look = c.Lookup(s.tokens);
      ASSERT_TRUE(look.ok()) << look.status();
      EXPECT_EQ(look->num_blocks, 0u);
      auto st = c.Stats();
      ASSERT_TRUE(st.ok()) << st.status();
      EXPECT_EQ(st->staging_bytes, 0u);
      EXPECT_EQ(st->open_puts, 0u);
      return;
    }
    auto r = put.Commit();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->blocks_written, 3u);
    EXPECT_TRUE(FetchAndCompareBf16(c, s, spec, 3).has_value());
  }

  std::unique_ptr<kvstore::PoolServer> server_;
  int port_ = 0;
};

TEST_P(ClientTest, PutThenFetchIsByteExactAgainstTheCpuEncoderInt2) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ModelSpec spec = Spec("int2");
  auto info = c->RegisterModel(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->sink_blocks, 1u);
  EXPECT_EQ(info->recent_blocks, 2u);

  Sequence s = MakeSequence(8 * kPage + 5, 1);  // 8 full blocks + a partial tail
  auto put = c->Put(s.tokens, s.ks(), s.vs());
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->num_blocks, 8u);
  EXPECT_EQ(put->blocks_written, 8u);

  auto look = c->Lookup(s.tokens);
  ASSERT_TRUE(look.ok()) << look.status();
  ASSERT_EQ(look->num_blocks, 8u);
  auto keys = c->Keys(s.tokens);
  ASSERT_TRUE(keys.ok());
  for (uint32_t b = 0; b < 8; ++b) {
    EXPECT_EQ(look->blocks[b].key, (*keys)[b]) << b;
    EXPECT_EQ(look->blocks[b].sink, b == 0) << b;
    EXPECT_TRUE(look->blocks[b].has_int2 || b == 0) << b;
  }

  auto lease = c->Acquire(s.tokens);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->blocks.size(), 8u);
  auto pools = MakePools(*c, 8);
  auto f = c->Fetch(*lease, pools->plan);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->num_blocks, 8u);
  BlockGeometry g{kLayers, kHeads, kDim, kPage};
  // Segments: block 0 sink (BF16), 1..5 history (INT2), 6..7 recent (BF16).
  EXPECT_EQ(f->tables.sink.indices.size(), 1u);
  EXPECT_EQ(f->tables.history.indices.size(), 5u);
  EXPECT_EQ(f->tables.recent.indices.size(), 2u);
  EXPECT_EQ(f->tables.sink.indptr, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(f->tables.history.indptr, (std::vector<int32_t>{0, 5}));
  EXPECT_EQ(f->tables.recent.last_page_len, (std::vector<int32_t>{int32_t(kPage)}));
  for (uint32_t b = 0; b < 8; ++b) {
    std::vector<uint8_t> bf16, int2;
    ASSERT_TRUE(ExpectedForms(s, b, spec, &bf16, &int2));
    const bool is_int2 = b >= 1 && b <= 5;
    EXPECT_EQ(f->forms[b], is_int2 ? Form::kInt2 : Form::kBf16) << b;
    const int32_t page = f->pages[b];
    if (is_int2) {
      EXPECT_EQ(0, std::memcmp(pools->int2_mem.data() + page * g.Int2FormBytes(), int2.data(),
                               int2.size()))
          << "block " << b;
    } else {
      EXPECT_EQ(0, std::memcmp(pools->bf16_mem.data() + page * g.Bf16FormBytes(), bf16.data(),
                               bf16.size()))
          << "block " << b;
    }
  }
  EXPECT_TRUE(c->Release(*lease).ok());
  EXPECT_EQ(c->Release(*lease).code(), absl::StatusCode::kNotFound);
}

TEST_P(ClientTest, Bf16HistoryStoresTheRotatedInputExactly) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ModelSpec spec = Spec("bf16");
  ASSERT_TRUE(c->RegisterModel(spec).ok());
  Sequence s = MakeSequence(5 * kPage, 2);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto f = FetchAndCompareBf16(*c, s, spec, 5);
  ASSERT_TRUE(f.has_value());
  EXPECT_TRUE(f->tables.history.indices.empty());
  EXPECT_EQ(f->tables.recent.indices.size(), 4u);
}

// Layer-wise streaming: each layer reaches the pool's staging while the caller has not yet
// written the next one and without any Flush (in every mode: direct stores, client RMA puts,
// pool pulls through asynchronous WritePut calls); abort and commit keep their meaning
// afterwards.
TEST_P(ClientTest, EachLayerReachesStagingBeforeTheNextIsWritten) {
  const ModelSpec spec = Spec("bf16");
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  auto info = c->RegisterModel(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  // Only a client that initiates over shared memory may map the pool (the direct path; it
  // also needs the pool's memory to be a UCX shared segment, which a full /dev/shm prevents).
  if (Tls() != "posix,cma" || !Mode().empty()) {
    EXPECT_FALSE(info->mapped_pool_memory);
  }
  RecordProperty("mapped_pool_memory", info->mapped_pool_memory ? "yes" : "no");
  for (bool commit : {false, true}) {
    SCOPED_TRACE(commit ? "commit" : "abort");
    Sequence s = MakeSequence(3 * kPage, commit ? 21 : 22);
    auto put = c->BeginPut(s.tokens);
    ASSERT_TRUE(put.ok()) << put.status();
    for (uint32_t l = 0; l < kLayers; ++l) {
      ASSERT_TRUE((*put)->WriteLayer(l, s.k[l], s.v[l]).ok());
      EXPECT_TRUE(LayerArrives(s, l)) << "layer " << l << " never reached staging";
      if (l + 1 < kLayers) {
        EXPECT_FALSE(LayerInPool(s, l + 1)) << "layer " << l + 1;
      }
    }
    AbortOrCommitThreeBlocks(*c, **put, s, spec, commit);
  }
}

// WriteLayerAsync: the same stored bytes as the encoder gives, for few blocks (one task per
// 16 KiB checksum piece) and many (one task per block and layer; 12 >= 2 x 4 threads), with
// every layer asynchronous and mixed with WriteLayer; after Flush the caller may overwrite
// k/v (the put no longer reads them) and the commit still stores the original bytes (its
// checksums were computed from them).
TEST_P(ClientTest, AsyncLayersAreByteExactAgainstTheCpuEncoder) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  const ModelSpec spec = Spec("int2");
  ASSERT_TRUE(c->RegisterModel(spec).ok());
  const BlockGeometry g = Geometry();
  uint32_t seed = 100;
  for (uint32_t blocks : {3u, 12u}) {
    for (const char* mode : {"async", "async,sync", "sync,async"}) {
      SCOPED_TRACE(absl::StrCat(blocks, " blocks, layers ", mode));
      const Sequence s = MakeSequence(blocks * kPage, ++seed);
      Sequence scratch = s;  // what the put reads; overwritten after Flush
      auto put = c->BeginPut(s.tokens);
      ASSERT_TRUE(put.ok()) << put.status();
      for (uint32_t l = 0; l < kLayers; ++l) {
        const bool async = std::string_view(mode) == "async" ||
                           (l == 0) == (std::string_view(mode) == "async,sync");
        absl::Status w = async ? (*put)->WriteLayerAsync(l, scratch.k[l], scratch.v[l])
                               : (*put)->WriteLayer(l, scratch.k[l], scratch.v[l]);
        ASSERT_TRUE(w.ok()) << w;
      }
      ASSERT_TRUE((*put)->Flush().ok());
      for (auto& layer : scratch.k) std::fill(layer.begin(), layer.end(), uint16_t{0x7FC0});
      for (auto& layer : scratch.v) std::fill(layer.begin(), layer.end(), uint16_t{0x3F80});
      auto r = (*put)->Commit();
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->blocks_written, blocks);
      EXPECT_EQ(r->bytes_written, uint64_t{blocks} * g.Bf16FormBytes());

      ASSERT_NO_FATAL_FAILURE(FetchAndCompareForms(*c, s, spec, blocks));
    }
  }
}

// Asynchronous layers reach the pool's staging without a Flush: in direct mode the copy threads
// store them straight into the mapped staging; over RMA and pool pulls the next WriteLayerAsync
// sends every earlier layer that is packed by then (it waits for none: here the caller
// "computes" 100 ms between layers, far longer than packing 3 small blocks takes, so layer l-1
// is there after layer l was queued), and Flush sends and waits for the rest. Abort and Commit
// keep their meaning.
TEST_P(ClientTest, AsyncLayersReachStagingAndFlushJoinsThem) {
  const ModelSpec spec = Spec("bf16");
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  auto info = c->RegisterModel(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  const bool direct = info->mapped_pool_memory;
  for (bool commit : {false, true}) {
    SCOPED_TRACE(commit ? "commit" : "abort");
    Sequence s = MakeSequence(3 * kPage, commit ? 23 : 24);
    auto put = c->BeginPut(s.tokens);
    ASSERT_TRUE(put.ok()) << put.status();
    for (uint32_t l = 0; l < kLayers; ++l) {
      if (l > 0 && !direct) absl::SleepFor(absl::Milliseconds(100));  // computing layer l
      ASSERT_TRUE((*put)->WriteLayerAsync(l, s.k[l], s.v[l]).ok());
      if (direct) {
        EXPECT_TRUE(LayerArrives(s, l)) << "layer " << l << " never reached staging";
      } else if (l > 0) {
        EXPECT_TRUE(LayerArrives(s, l - 1)) << "layer " << l - 1 << " not sent by the next layer";
      }
    }
    ASSERT_TRUE((*put)->Flush().ok());
    for (uint32_t l = 0; l < kLayers; ++l) EXPECT_TRUE(LayerInPool(s, l)) << "after Flush, " << l;
    AbortOrCommitThreeBlocks(*c, **put, s, spec, commit);
  }
}

// A non-finite value in an asynchronous layer: found while the copy threads pack it (or the
// calling thread, below the floor), never returned by any WriteLayerAsync (its own layer's or an
// earlier one's: which call could see it would depend on timing, and waiting for the previous
// layer to know cost the 256 KiB async put 9.66 -> 5.65 GB/s on the H200 host), reported by
// Flush (every time) and Commit (which aborts) as WriteLayer reports it — INVALID_ARGUMENT
// naming the lowest bad layer and its first bad token — on every path; the put is poisoned:
// nothing becomes visible, its staging is reclaimed, over RMA / pool pulls the bad layer never
// reaches the pool, and a clean put of the same tokens then stores exactly the encoder's bytes.
// Few and many blocks (both task shapes), with and without Flush.
TEST_P(ClientTest, AsyncNonFiniteValuesPoisonThePutNamingLayerAndToken) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  const ModelSpec spec = Spec("int2");
  auto info = c->RegisterModel(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  const BlockGeometry g = Geometry();
  kvstore::PoolMemory& mem = server_->store().memory();
  const size_t row = size_t(kHeads) * kDim;
  uint32_t seed = 300;
  // Which layers hold a bad value: layer 1 only (the last one), layer 0 only, both.
  const std::vector<std::vector<uint32_t>> bad_sets = {{1}, {0}, {0, 1}};
  for (uint32_t blocks : {2u, 12u}) {
    for (const auto& bad : bad_sets) {
      for (bool flush : {true, false}) {
        SCOPED_TRACE(absl::StrCat(blocks, " blocks, bad layer(s) ", absl::StrJoin(bad, ","),
                                  flush ? ", Flush" : ", no Flush"));
        const Sequence clean = MakeSequence(blocks * kPage, ++seed);
        Sequence s = clean;
        const uint32_t token = blocks * kPage - 3;  // in the last block
        for (uint32_t l : bad) {
          if (l == 1) s.v[1][token * row + 5] = 0xFFC1;        // NaN at layer 1
          if (l == 0) s.k[0][(kPage + 2) * row + 1] = 0x7F80;  // +Inf at layer 0, token 18
        }
        const uint32_t bad_layer = bad[0];
        const std::string want = bad_layer == 0
                                     ? "k: NaN or Inf at layer 0, token 18"
                                     : absl::StrCat("v: NaN or Inf at layer 1, token ", token);
        auto put = c->BeginPut(s.tokens);
        ASSERT_TRUE(put.ok()) << put.status();
        for (uint32_t l = 0; l < kLayers; ++l) {
          const absl::Status w = (*put)->WriteLayerAsync(l, s.k[l], s.v[l]);
          EXPECT_TRUE(w.ok()) << "layer " << l << ": " << w;
        }
        absl::Status flushed;
        if (flush) {
          flushed = (*put)->Flush();
          EXPECT_EQ(flushed.code(), absl::StatusCode::kInvalidArgument) << flushed;
          EXPECT_THAT(flushed.message(), HasSubstr(want));
          EXPECT_EQ((*put)->Flush(), flushed);  // every later Flush: the same status
        }
        if (!info->mapped_pool_memory) {
          // Never RMA-put or pulled: the bad layer's packed bytes are nowhere in the pool.
          std::vector<uint8_t> slice(g.Bf16LayerBytes());
          PackLayerSlice(g, bad_layer == 0 ? 1 : blocks - 1, s.k[bad_layer].data(),
                         s.v[bad_layer].data(), slice.data());
          EXPECT_EQ(memmem(mem.data(), mem.size(), slice.data(), slice.size()), nullptr);
        }
        // Commit aborts with the same status.
        const absl::Status committed = (*put)->Commit().status();
        EXPECT_EQ(committed.code(), absl::StatusCode::kInvalidArgument) << committed;
        EXPECT_THAT(committed.message(), HasSubstr(want));
        if (flush) {
          EXPECT_EQ(committed, flushed);
        }
        auto look = c->Lookup(s.tokens);
        ASSERT_TRUE(look.ok()) << look.status();
        EXPECT_EQ(look->num_blocks, 0u);
        auto st = c->Stats();
        ASSERT_TRUE(st.ok()) << st.status();
        EXPECT_EQ(st->open_puts, 0u);
        EXPECT_EQ(st->staging_bytes, 0u);
        // The same tokens with clean values: stored, byte-exact.
        auto again = c->BeginPut(clean.tokens);
        ASSERT_TRUE(again.ok()) << again.status();
        for (uint32_t l = 0; l < kLayers; ++l) {
          ASSERT_TRUE((*again)->WriteLayerAsync(l, clean.k[l], clean.v[l]).ok());
        }
        auto r = (*again)->Commit();
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->blocks_written, blocks);
        ASSERT_NO_FATAL_FAILURE(FetchAndCompareForms(*c, clean, spec, blocks));
      }
    }
  }
  // Client::Put packs its layers asynchronously: Commit's status.
  Sequence bad = MakeSequence(3 * kPage, 399);
  bad.k[1][20 * row + 3] = 0x7FC0;
  auto r = c->Put(bad.tokens, bad.ks(), bad.vs());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("k: NaN or Inf at layer 1, token 20"));
  auto st = c->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->open_puts, 0u);
}

// WriteLayerAsync refuses what WriteLayer refuses, at once: layers out of order or twice, short
// k/v, a layer beyond the model, a finished session.
TEST_P(ClientTest, AsyncLayersOutOfOrderOrAfterTheEndAreRefused) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->RegisterModel(Spec("int2")).ok());
  Sequence s = MakeSequence(3 * kPage, 41);
  auto put = c->BeginPut(s.tokens);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ((*put)->WriteLayerAsync(1, s.k[1], s.v[1]).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT((*put)->WriteLayerAsync(0, absl::MakeSpan(s.k[0]).subspan(0, 10), s.v[0]).message(),
              HasSubstr("k:"));
  EXPECT_THAT((*put)->WriteLayerAsync(0, s.k[0], absl::MakeSpan(s.v[0]).subspan(0, 10)).message(),
              HasSubstr("v:"));
  EXPECT_EQ((*put)->WriteLayerAsync(7, s.k[0], s.v[0]).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*put)->WriteLayerAsync(0, s.k[0], s.v[0]).ok());
  const absl::Status twice = (*put)->WriteLayerAsync(0, s.k[0], s.v[0]);
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition) << twice;
  EXPECT_THAT(twice.message(), HasSubstr("expected layer 1, got 0"));
  // Commit with a layer missing joins the queued one, aborts and stores nothing.
  EXPECT_EQ((*put)->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*put)->WriteLayerAsync(1, s.k[1], s.v[1]).code(),
            absl::StatusCode::kFailedPrecondition);
  auto look = c->Lookup(s.tokens);
  ASSERT_TRUE(look.ok());
  EXPECT_EQ(look->num_blocks, 0u);
}

// A model of kFiveLayers layers (the shared test geometry has two), for the tests that need
// layers after a bad one, and K/V for it: [layer][tokens * heads * dim].
constexpr uint32_t kFiveLayers = 5;
ModelSpec FiveLayerSpec() {
  ModelSpec s = Spec("int2", "-five-layers");
  s.num_layers = kFiveLayers;
  RotationMetadata meta;
  meta.model_name = s.model_id;
  meta.head_dim = kDim;
  meta.num_layers = kFiveLayers;
  meta.num_kv_heads = kHeads;
  meta.clip_ratio_k = s.clip_ratio_k;
  meta.clip_ratio_v = s.clip_ratio_v;
  auto rot = RotationSet::Hadamard(meta);
  s.rotation_file = rot.ok() ? SerializeRotations(*rot) : std::string();
  return s;
}
std::vector<std::vector<uint16_t>> FiveLayerKv(uint32_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<std::vector<uint16_t>> kv(2 * kFiveLayers,
                                        std::vector<uint16_t>(size_t(tokens) * kHeads * kDim));
  for (auto& layer : kv) {
    for (uint16_t& x : layer) x = testing::ToBf16(n(rng));
  }
  return kv;  // k of layer l at [2l], v at [2l + 1]
}

// Newcomer report s7 F1: which call reported an asynchronous layer's NaN/Inf, and what Commit
// returned, depended on the path and on timing (over tcp: layers 2 and 3 INVALID_ARGUMENT, layer
// 4 FAILED_PRECONDITION "expected layer 3", Commit FAILED_PRECONDITION "only 3 of 5 layers"; over
// posix,cma every call OK; a 512-token put's call reported its own layer). Session 8's contract,
// the same on every path and task shape (calling thread, few and many blocks) with no wait for
// an earlier layer: no WriteLayerAsync returns a NaN/Inf status (its own layer's or an earlier
// one's); a WriteLayer returns INVALID_ARGUMENT exactly when its own layer holds one (naming that
// layer and its first bad token), whatever earlier layers held; Flush and Commit (which aborts)
// return INVALID_ARGUMENT naming the lowest bad layer and its first bad token, however many
// layers the caller wrote after it. Then nothing is visible, the staging is reclaimed, and a
// clean put of the same tokens is stored.
TEST_P(ClientTest, ANonFiniteValueIsReportedByFlushAndCommitOnEveryPath) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  const ModelSpec spec = FiveLayerSpec();
  ASSERT_FALSE(spec.rotation_file.empty());
  auto info = c->RegisterModel(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  const size_t row = size_t(kHeads) * kDim;
  uint32_t seed = 700;
  // `bad`: the layers holding a NaN/Inf; `how`: one letter per layer, a = WriteLayerAsync,
  // s = WriteLayer; `stop`: the caller stops writing after the first error a write call
  // returns (only a WriteLayer of a bad layer returns one); `flush`: Flush before Commit.
  struct Case {
    std::vector<uint32_t> bad;
    const char* how;
    bool stop, flush;
  };
  const Case cases[] = {
      {{1}, "aaaaa", false, true},    {{3, 1}, "aaaaa", false, true}, {{4}, "aaaaa", false, true},
      {{1}, "aaaaa", false, false},   {{0}, "aaaaa", false, true},    {{1}, "sssss", false, true},
      {{1}, "sssss", true, false},    {{1}, "aasaa", false, false},   {{2}, "saaas", false, true},
      {{1, 3}, "aaasa", false, true}, {{1, 3}, "asasa", true, true},
  };
  for (uint32_t blocks : {2u, 12u}) {
    for (const Case& cs : cases) {
      SCOPED_TRACE(absl::StrCat(blocks, " blocks, layers ", cs.how, ", bad layer(s) ",
                                absl::StrJoin(cs.bad, ","), cs.stop ? ", stop at the error" : "",
                                cs.flush ? ", Flush" : ""));
      const uint32_t tokens = blocks * kPage;
      const auto clean = FiveLayerKv(tokens, ++seed);
      auto kv = clean;
      const uint32_t first_bad = *std::min_element(cs.bad.begin(), cs.bad.end());
      // What a status about layer l's bad value says: k for even layers (Inf), v for odd (NaN);
      // the lowest bad layer's first bad token is in the last block, the others' is token 5.
      auto message = [&](uint32_t l) {
        return absl::StrCat(l % 2 ? "v" : "k", ": NaN or Inf at layer ", l, ", token ",
                            l == first_bad ? tokens - 3 : 5);
      };
      for (uint32_t l : cs.bad) {
        const uint32_t token = l == first_bad ? tokens - 3 : 5;
        kv[2 * l + (l % 2)][size_t(token) * row + 7] = l % 2 ? 0xFFC1 : 0x7F80;
      }
      std::vector<uint32_t> ids(tokens);
      for (uint32_t i = 0; i < tokens; ++i) ids[i] = 7000 * seed + i;
      auto put = c->BeginPut(ids);
      ASSERT_TRUE(put.ok()) << put.status();
      for (uint32_t l = 0; l < kFiveLayers; ++l) {
        const bool async = cs.how[l] == 'a';
        const absl::Status w = async ? (*put)->WriteLayerAsync(l, kv[2 * l], kv[2 * l + 1])
                                     : (*put)->WriteLayer(l, kv[2 * l], kv[2 * l + 1]);
        const bool own_bad = std::find(cs.bad.begin(), cs.bad.end(), l) != cs.bad.end();
        if (!async && own_bad) {
          EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << "layer " << l << ": " << w;
          EXPECT_THAT(w.message(), HasSubstr(message(l))) << "layer " << l;
          if (cs.stop) break;
        } else {
          EXPECT_TRUE(w.ok()) << "layer " << l << ": " << w;
        }
      }
      const std::string want = message(first_bad);
      absl::Status flushed;
      if (cs.flush) {
        flushed = (*put)->Flush();
        EXPECT_EQ(flushed.code(), absl::StatusCode::kInvalidArgument) << flushed;
        EXPECT_THAT(flushed.message(), HasSubstr(want));
      }
      const absl::Status committed = (*put)->Commit().status();
      EXPECT_EQ(committed.code(), absl::StatusCode::kInvalidArgument) << committed;
      EXPECT_THAT(committed.message(), HasSubstr(want));
      if (cs.flush) {
        EXPECT_EQ(committed, flushed);
      }
      // Finished: later calls say so (the put was aborted and stored nothing).
      EXPECT_EQ((*put)->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
      auto look = c->Lookup(ids);
      ASSERT_TRUE(look.ok()) << look.status();
      EXPECT_EQ(look->num_blocks, 0u);
      auto st = c->Stats();
      ASSERT_TRUE(st.ok()) << st.status();
      EXPECT_EQ(st->open_puts, 0u);
      EXPECT_EQ(st->staging_bytes, 0u);
      // The same tokens with clean values: stored (Client::Put: asynchronous layers).
      std::vector<absl::Span<const uint16_t>> ks, vs;
      for (uint32_t l = 0; l < kFiveLayers; ++l) {
        ks.push_back(clean[2 * l]);
        vs.push_back(clean[2 * l + 1]);
      }
      auto good = c->Put(ids, ks, vs);
      ASSERT_TRUE(good.ok()) << good.status();
      EXPECT_EQ(good->blocks_written, blocks);
      look = c->Lookup(ids);
      ASSERT_TRUE(look.ok()) << look.status();
      EXPECT_EQ(look->num_blocks, blocks);
      auto keys = c->Keys(ids);
      ASSERT_TRUE(keys.ok()) << keys.status();
      ASSERT_TRUE(c->Delete(*keys).ok());  // room for the next case
    }
  }
}

// Newcomer report s7 F3: history blocks whose INT2 encoding overflows (values beyond fp16's
// range, here V = 70000) are kept by the pool in BF16 only, and a history block is fetched as
// INT2 (the decode kernel's history segment), so Fetch stops before the first of them with
// NOT_FOUND in its block_status, which now says why and what to do (recompute from the tokens);
// Lookup shows it (has_int2 false). Also with accept_int2_window.
TEST_P(ClientTest, AHistoryBlockHeldInBf16OnlyEndsTheFetchSayingWhy) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->RegisterModel(Spec("int2")).ok());
  Sequence s = MakeSequence(6 * kPage, 71);  // sink 0, history 1..3, window 4..5
  std::mt19937 rng(72);
  std::normal_distribution<float> n(0.f, 70000.f);
  for (uint16_t& x : s.v[0]) x = testing::ToBf16(n(rng));
  auto put = c->Put(s.tokens, s.ks(), s.vs());
  ASSERT_TRUE(put.ok()) << put.status();
  auto look = c->Lookup(s.tokens);
  ASSERT_TRUE(look.ok()) << look.status();
  ASSERT_EQ(look->num_blocks, 6u);
  EXPECT_TRUE(look->blocks[1].has_bf16);
  EXPECT_FALSE(look->blocks[1].has_int2);
  auto pools = MakePools(*c, 6);
  ASSERT_NE(pools, nullptr);
  for (bool accept_int2_window : {false, true}) {
    SCOPED_TRACE(accept_int2_window ? "accept_int2_window" : "default plan");
    auto lease = c->Acquire(s.tokens);
    ASSERT_TRUE(lease.ok()) << lease.status();
    FetchPlan plan = pools->plan;
    plan.accept_int2_window = accept_int2_window;
    auto f = c->Fetch(*lease, plan);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->num_blocks, 1u);  // the sink block
    ASSERT_EQ(f->block_status.size(), 2u);
    const absl::Status& st = f->block_status[1];
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
    EXPECT_THAT(st.message(), HasSubstr("block 1: no INT2 form leased"));
    EXPECT_THAT(st.message(), HasSubstr("history block in BF16 only"));
    EXPECT_THAT(st.message(), HasSubstr("recompute"));
    EXPECT_TRUE(c->Release(*lease).ok());
  }
}

// Newcomer report 10 F5: a decoder that takes a prefix of a longer prompt's blocks (a prompt
// sharing all but its last block with a stored one) gives the blocks it wants as
// sequence_blocks: the window is that sequence's, so the fetched blocks before it come as INT2
// history. Here 8 blocks are stored (sink 0, history 1..5, window 6..7) and 7 fetched: without
// sequence_blocks the window of the 7 (5..6) needs BF16 of block 5, held INT2-only, and the
// fetch stops before it (5 blocks); with sequence_blocks 8 all 7 come (5 as INT2).
TEST_P(ClientTest, SequenceBlocksPlaceTheWindowOfAPrefixFetch) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  const ModelSpec spec = Spec("int2");
  ASSERT_TRUE(c->RegisterModel(spec).ok());
  Sequence s = MakeSequence(8 * kPage, 91);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto pools = MakePools(*c, 8);
  ASSERT_NE(pools, nullptr);
  auto lease = c->Acquire(s.tokens, 7);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->blocks.size(), 7u);
  ASSERT_FALSE(lease->blocks[5].bf16.has_value());
  FetchPlan plan = pools->plan;
  auto f = c->Fetch(*lease, plan);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->num_blocks, 5u);  // stopped before the window of the 7 blocks
  plan.sequence_blocks = 6;
  auto bad = c->Fetch(*lease, plan);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("plan.sequence_blocks"));
  plan.sequence_blocks = 8;
  f = c->Fetch(*lease, plan);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->num_blocks, 7u);
  EXPECT_EQ(f->tables.sink.indices.size(), 1u);
  EXPECT_EQ(f->tables.history.indices.size(), 5u);
  EXPECT_EQ(f->tables.recent.indices.size(), 1u);
  const BlockGeometry g{kLayers, kHeads, kDim, kPage};
  for (uint32_t b = 0; b < 7; ++b) {
    std::vector<uint8_t> bf16, int2;
    ASSERT_TRUE(ExpectedForms(s, b, spec, &bf16, &int2));
    const bool is_int2 = b >= 1 && b <= 5;
    EXPECT_EQ(f->forms[b], is_int2 ? Form::kInt2 : Form::kBf16) << b;
    const std::vector<uint8_t>& want = is_int2 ? int2 : bf16;
    const uint8_t* got = is_int2 ? pools->int2_mem.data() + f->pages[b] * g.Int2FormBytes()
                                 : pools->bf16_mem.data() + f->pages[b] * g.Bf16FormBytes();
    EXPECT_EQ(0, std::memcmp(got, want.data(), want.size())) << "block " << b;
  }
  EXPECT_TRUE(c->Release(*lease).ok());
}

// Newcomer report s8 N10: Lookup/Acquire with 0 tokens answered the wire-level
// "INVALID_ARGUMENT: token_ids/keys: give exactly one of them" (the C++ calls have no keys
// argument). No tokens hold no full block: the same answer as 5 tokens, 0 blocks / no lease.
// Newcomer report 9 A11: 5 tokens were sent to the pool (and counted there as a miss) although
// client.h says fewer tokens than one block are answered without a call: none reaches the pool.
TEST_P(ClientTest, LookupAndAcquireOfFewerTokensThanOneBlockFindNothing) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->RegisterModel(Spec("int2")).ok());
  Sequence s = MakeSequence(2 * kPage, 81);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  const kvstore::Metrics& m = server_->store().metrics();
  const uint64_t calls_before = m.lookup_calls.load();
  const std::vector<uint32_t> none;
  const std::vector<uint32_t> five(s.tokens.begin(), s.tokens.begin() + 5);
  for (const std::vector<uint32_t>* t : {&none, &five}) {
    SCOPED_TRACE(absl::StrCat(t->size(), " tokens"));
    auto look = c->Lookup(*t);
    ASSERT_TRUE(look.ok()) << look.status();
    EXPECT_EQ(look->num_blocks, 0u);
    EXPECT_TRUE(look->blocks.empty());
    auto lease = c->Acquire(*t);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->id, 0u);
    EXPECT_TRUE(lease->blocks.empty());
  }
  EXPECT_EQ(c->Stats()->leases, 0u);
  EXPECT_EQ(m.lookup_calls.load(), calls_before) << "a request without a full block was sent";
  EXPECT_EQ(m.lookup_miss_calls.load(), 0u);
  const std::vector<uint32_t> page_less_one(s.tokens.begin(), s.tokens.begin() + kPage - 1);
  EXPECT_EQ(c->Lookup(page_less_one)->num_blocks, 0u);
  EXPECT_EQ(m.lookup_calls.load(), calls_before);
  auto full = c->Lookup(s.tokens);  // the stored blocks are found as before
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->num_blocks, 2u);
  EXPECT_EQ(m.lookup_calls.load(), calls_before + 1);
}

// Newcomer report s7 F13: a k span that is not a whole number of tokens, and a v span of
// another length than k, were accepted (the extra elements ignored). Both WriteLayer and
// WriteLayerAsync refuse them naming the span and the sizes; a refused call writes nothing and
// does not count its layer, so the right call follows and the put commits the right bytes.
// Longer spans of whole tokens, k and v alike, are accepted (extra tokens ignored, client.h).
TEST_P(ClientTest, LayersOfPartialTokensOrUnequalKAndVAreRefusedNamingTheSizes) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  const ModelSpec spec = Spec("bf16");
  ASSERT_TRUE(c->RegisterModel(spec).ok());
  const size_t row = size_t(kHeads) * kDim;
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "WriteLayerAsync" : "WriteLayer");
    const Sequence s = MakeSequence(3 * kPage, async ? 61 : 62);
    auto put = c->BeginPut(s.tokens);
    ASSERT_TRUE(put.ok()) << put.status();
    auto write = [&](uint32_t l, const std::vector<uint16_t>& k, const std::vector<uint16_t>& v) {
      return async ? (*put)->WriteLayerAsync(l, k, v) : (*put)->WriteLayer(l, k, v);
    };
    const size_t n = s.k[0].size();
    std::vector<uint16_t> k_plus_one = s.k[0], v_plus_five = s.v[0], k_plus_3_tokens = s.k[0];
    k_plus_one.push_back(0);
    v_plus_five.resize(n + 5);
    k_plus_3_tokens.resize(n + 3 * row);
    absl::Status w = write(0, k_plus_one, s.v[0]);
    EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
    EXPECT_THAT(w.message(), HasSubstr(absl::StrCat("k: ", n + 1,
                                                    " elements is not a whole number "
                                                    "of tokens")));
    EXPECT_THAT(w.message(), HasSubstr(absl::StrCat(row)));
    w = write(0, s.k[0], v_plus_five);
    EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
    EXPECT_THAT(w.message(), HasSubstr(absl::StrCat("v: ", n + 5, " elements, k has ", n)));
    w = write(0, k_plus_3_tokens, s.v[0]);
    EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
    EXPECT_THAT(w.message(), HasSubstr(absl::StrCat("v: ", n, " elements, k has ", n + 3 * row)));
    // Not counted: layer 0 is still the one expected; whole extra tokens in both are ignored.
    std::vector<uint16_t> v_plus_3_tokens = s.v[0];
    v_plus_3_tokens.resize(n + 3 * row);
    ASSERT_TRUE(write(0, k_plus_3_tokens, v_plus_3_tokens).ok());
    w = write(1, s.k[1], v_plus_five);  // v_plus_five is layer 0's: refused before it is read
    EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
    ASSERT_TRUE(write(1, s.k[1], s.v[1]).ok());
    auto r = (*put)->Commit();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->blocks_written, 3u);
    EXPECT_TRUE(FetchAndCompareBf16(*c, s, spec, 3).has_value());
  }
}

// Newcomer report s7 F12: destroying the Client before a session it created (outside the
// contract) crashed (SIGSEGV in UCX) when the session was destroyed. Now the Client's
// destructor aborts its open sessions (joining their layers in flight) and leaves them inert:
// their later calls return FAILED_PRECONDITION naming the destroyed Client, Abort is a no-op,
// the destructor touches nothing. The put leaves nothing in the pool (no open put, no staging,
// nothing visible). Also for a session already committed and one with no layer written.
TEST_P(ClientTest, DestroyingTheClientBeforeItsSessionsAbortsThemAndLeavesThemInert) {
  const ModelSpec spec = Spec("bf16");
  auto observer = NewClient();
  ASSERT_NE(observer, nullptr);
  ASSERT_TRUE(observer->RegisterModel(spec).ok());
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->RegisterModel(spec).ok());
  const Sequence s = MakeSequence(64 * kPage, 801), empty = MakeSequence(2 * kPage, 802),
                 done = MakeSequence(2 * kPage, 803);
  auto in_flight = c->BeginPut(s.tokens);
  ASSERT_TRUE(in_flight.ok()) << in_flight.status();
  for (uint32_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE((*in_flight)->WriteLayerAsync(l, s.k[l], s.v[l]).ok());
  }
  auto untouched = c->BeginPut(empty.tokens);
  ASSERT_TRUE(untouched.ok()) << untouched.status();
  auto committed = c->BeginPut(done.tokens);
  ASSERT_TRUE(committed.ok()) << committed.status();
  for (uint32_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE((*committed)->WriteLayer(l, done.k[l], done.v[l]).ok());
  }
  ASSERT_TRUE((*committed)->Commit().ok());
  c.reset();
  for (auto* put : {&*in_flight, &*untouched}) {
    const absl::Status w = (*put)->WriteLayerAsync(0, s.k[0], s.v[0]);
    EXPECT_EQ(w.code(), absl::StatusCode::kFailedPrecondition) << w;
    EXPECT_THAT(w.message(), HasSubstr("Client that created this session was destroyed"));
    EXPECT_EQ((*put)->WriteLayer(0, s.k[0], s.v[0]).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*put)->Flush().code(), absl::StatusCode::kFailedPrecondition);
    const absl::Status r = (*put)->Commit().status();
    EXPECT_EQ(r.code(), absl::StatusCode::kFailedPrecondition) << r;
    EXPECT_THAT(r.message(), HasSubstr("destroyed"));
    EXPECT_TRUE((*put)->Abort().ok());
  }
  EXPECT_EQ((*committed)->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  in_flight->reset();
  untouched->reset();
  committed->reset();
  auto st = observer->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->open_puts, 0u);
  EXPECT_EQ(st->staging_bytes, 0u);
  auto look = observer->Lookup(s.tokens);
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->num_blocks, 0u);
  look = observer->Lookup(done.tokens);
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->num_blocks, 2u);  // committed before the Client went
}

// Abort, destroying the session, or destroying the session and then the client right after
// queuing asynchronous layers (64 blocks: still being packed by the copy threads): nothing
// becomes visible, the staging is reclaimed, and once the call returns nothing of this put
// writes the pool's memory any more (a snapshot of it stays equal); the same put then works.
TEST_P(ClientTest, AbortOrDestroyWithAsyncLayersInFlightLeavesNothing) {
  const ModelSpec spec = Spec("bf16");
  auto observer = NewClient();
  ASSERT_NE(observer, nullptr);
  ASSERT_TRUE(observer->RegisterModel(spec).ok());
  kvstore::PoolMemory& mem = server_->store().memory();
  uint32_t seed = 500;
  for (const char* how : {"abort", "destroy session", "destroy session and client"}) {
    SCOPED_TRACE(how);
    auto c = NewClient();
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(c->RegisterModel(spec).ok());
    auto s = std::make_unique<Sequence>(MakeSequence(64 * kPage, ++seed));
    auto put = c->BeginPut(s->tokens);
    ASSERT_TRUE(put.ok()) << put.status();
    for (uint32_t l = 0; l < kLayers; ++l) {
      ASSERT_TRUE((*put)->WriteLayerAsync(l, s->k[l], s->v[l]).ok());
    }
    if (std::string_view(how) == "abort") {
      EXPECT_TRUE((*put)->Abort().ok());
    } else {
      put->reset();
      if (std::string_view(how) != "destroy session") c.reset();
    }
    const Sequence kept = *s;
    s.reset();  // the caller frees k/v: nothing of the put reads them any more
    const std::vector<uint8_t> snapshot(mem.data(), mem.data() + mem.size());
    absl::SleepFor(absl::Milliseconds(20));
    EXPECT_EQ(0, std::memcmp(snapshot.data(), mem.data(), mem.size()))
        << "the pool's memory changed after the put was dropped";
    auto st = observer->Stats();
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->open_puts, 0u);
    EXPECT_EQ(st->staging_bytes, 0u);
    auto look = observer->Lookup(kept.tokens);
    ASSERT_TRUE(look.ok());
    EXPECT_EQ(look->num_blocks, 0u);
    if (c == nullptr) c = NewClient();
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(c->RegisterModel(spec).ok());
    auto again = c->Put(kept.tokens, kept.ks(), kept.vs());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->blocks_written, 64u);
    EXPECT_TRUE(FetchAndCompareBf16(*c, kept, spec, 64).has_value());
  }
}

// The client's vectorized NaN/Inf scan: a bad value at each of 9 consecutive positions (every
// lane of a vector word and across a word boundary), both signs, NaN payloads and Inf are
// refused naming the token; the extreme finite values pass.
TEST_P(ClientTest, NonFiniteValuesAreFoundAtEveryPosition) {
  if (GetParam() != "posix,cma" && GetParam() != "posix,cma/threads") {
    GTEST_SKIP() << "client-side check; one transport (serial and threaded) suffices";
  }
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  Sequence s = MakeSequence(2 * kPage, 31);
  for (uint16_t& x : s.k[0]) x = 0x7F7F;  // largest finite
  for (uint16_t& x : s.v[0]) x = 0xFF7F;  // most negative finite
  for (size_t i = 0; i < 16; ++i)
    s.k[1][i] = std::array<uint16_t, 4>{0x0080, 0x8000, 0x0001, 0xFF7F}[i % 4];
  const size_t row = size_t(kHeads) * kDim;
  for (uint16_t bad_value :
       {uint16_t{0x7F80}, uint16_t{0xFF80}, uint16_t{0x7FC1}, uint16_t{0xFFFF}}) {
    for (size_t pos = 0; pos < 9; ++pos) {
      SCOPED_TRACE(absl::StrCat("value ", bad_value, " at element ", 5 * row + pos));
      auto put = c->BeginPut(s.tokens);
      ASSERT_TRUE(put.ok()) << put.status();
      ASSERT_TRUE((*put)->WriteLayer(0, s.k[0], s.v[0]).ok());
      Sequence b = s;
      (pos % 2 == 0 ? b.k : b.v)[1][5 * row + pos] = bad_value;
      absl::Status w = (*put)->WriteLayer(1, b.k[1], b.v[1]);
      EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
      EXPECT_THAT(w.message(), HasSubstr("token 5"));
      EXPECT_TRUE((*put)->Abort().ok());
    }
  }
  // A refused layer poisons the put (the scan rides on the pack, so some checksums already took
  // the layer): Commit fails with the same status, aborts, and nothing becomes visible.
  {
    auto put = c->BeginPut(s.tokens);
    ASSERT_TRUE(put.ok()) << put.status();
    ASSERT_TRUE((*put)->WriteLayer(0, s.k[0], s.v[0]).ok());
    Sequence b = s;
    b.v[1][7 * row + 3] = 0x7FC0;  // NaN at token 7
    absl::Status w = (*put)->WriteLayer(1, b.k[1], b.v[1]);
    EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
    EXPECT_THAT(w.message(), HasSubstr("v: NaN or Inf at layer 1, token 7"));
    auto committed = (*put)->Commit();
    // The client's own status, without asking the pool (which would refuse the NaN too, in its
    // own words).
    EXPECT_EQ(committed.status(), w);
    auto look = c->Lookup(s.tokens);
    ASSERT_TRUE(look.ok()) << look.status();
    EXPECT_EQ(look->num_blocks, 0u);
  }
  // The extreme finite values pass the client's scan (the pool would refuse them at commit:
  // their rotation overflows).
  auto good = c->BeginPut(s.tokens);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE((*good)->WriteLayer(0, s.k[0], s.v[0]).ok());
  EXPECT_TRUE((*good)->WriteLayer(1, s.k[1], s.v[1]).ok());
  EXPECT_TRUE((*good)->Abort().ok());
}

TEST_P(ClientTest, BadPutsAreRefusedAndStoreNothing) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  Sequence s = MakeSequence(3 * kPage, 3);
  // Too few tokens.
  EXPECT_THAT(c->BeginPut(absl::MakeSpan(s.tokens).subspan(0, kPage - 1)).status().message(),
              HasSubstr("tokens"));
  // Layers out of order, short buffers.
  auto put = c->BeginPut(s.tokens);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ((*put)->WriteLayer(1, s.k[1], s.v[1]).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT((*put)->WriteLayer(0, absl::MakeSpan(s.k[0]).subspan(0, 10), s.v[0]).message(),
              HasSubstr("k:"));
  EXPECT_THAT((*put)->WriteLayer(0, s.k[0], absl::MakeSpan(s.v[0]).subspan(0, 10)).message(),
              HasSubstr("v:"));
  EXPECT_EQ((*put)->WriteLayer(7, s.k[0], s.v[0]).code(), absl::StatusCode::kInvalidArgument);
  // Commit with layers missing aborts, and says why and what to do (it said only "0 of 2
  // layers written; aborted").
  const absl::Status early = (*put)->Commit().status();
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.message(), HasSubstr("Commit with only 0 of 2 layers written")) << early;
  EXPECT_THAT(early.message(), HasSubstr("must be written with WriteLayer")) << early;
  EXPECT_THAT(early.message(), HasSubstr("begin the put again")) << early;
  auto look = c->Lookup(s.tokens);
  ASSERT_TRUE(look.ok());
  EXPECT_EQ(look->num_blocks, 0u);

  // NaN caught by the client...
  Sequence bad = s;
  bad.k[1][kHeads * kDim * 20 + 3] = 0x7FC0;  // NaN at layer 1, token 20
  auto r = c->Put(bad.tokens, bad.ks(), bad.vs());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("token 20"));
  // ...and by the pool when the client does not check.
  auto unchecked = NewClient(/*check_finite=*/false);
  {
    auto reg = unchecked->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  bad.v[0][kHeads * kDim * 40] = 0x7F80;  // +Inf at layer 0, token 40
  r = unchecked->Put(bad.tokens, bad.ks(), bad.vs());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  look = c->Lookup(s.tokens);
  ASSERT_TRUE(look.ok());
  EXPECT_EQ(look->num_blocks, 0u);
  auto stats_after = c->Lookup(bad.tokens);
  ASSERT_TRUE(stats_after.ok());
  EXPECT_EQ(stats_after->num_blocks, 0u);

  // A good put still works afterwards, and a duplicate put writes nothing.
  auto ok = c->Put(s.tokens, s.ks(), s.vs());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->blocks_written, 3u);
  auto dup = c->Put(s.tokens, s.ks(), s.vs());
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_EQ(dup->blocks_written, 0u);
}

TEST_P(ClientTest, MismatchedRegistrationListsFields) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ModelSpec spec = Spec("int2");
  ASSERT_TRUE(c->RegisterModel(spec).ok());
  ModelSpec other = spec;
  other.sink_tokens = 32;
  other.page_size = 32;
  auto r = c->RegisterModel(other);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  ModelSpec bad = spec;
  bad.history_precision = "int3";
  EXPECT_THAT(c->RegisterModel(bad).status().message(), HasSubstr("history_precision"));
}

TEST_P(ClientTest, DeadlinesAndCancellation) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  Sequence s = MakeSequence(2 * kPage, 4);
  CallOptions past{absl::Now() - absl::Seconds(1), nullptr};
  const absl::Status late = c->Lookup(s.tokens, past).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded);
  // It said only "Deadline Exceeded": now which call, the deadline and what sets it.
  EXPECT_THAT(late.message(), HasSubstr("Lookup: no answer from the pool")) << late;
  EXPECT_THAT(late.message(), HasSubstr("ClientOptions::default_timeout")) << late;
  EXPECT_THAT(late.message(), HasSubstr("--call-timeout-ms")) << late;
  CallOptions short_deadline{absl::Now() + absl::Milliseconds(1), nullptr};
  absl::Status quick = c->Stats(short_deadline).status();
  if (!quick.ok()) {  // a fast pool may answer within 1 ms
    EXPECT_EQ(quick.code(), absl::StatusCode::kDeadlineExceeded) << quick;
    EXPECT_THAT(quick.message(), HasSubstr("Stats: no answer from the pool")) << quick;
  }
  auto token = std::make_shared<CancelToken>();
  token->Cancel();
  CallOptions cancelled{absl::InfiniteFuture(), token};
  const absl::Status stopped = c->Lookup(s.tokens, cancelled).status();
  EXPECT_EQ(stopped.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(stopped.message(), HasSubstr("Lookup: cancelled by this client")) << stopped;
  EXPECT_EQ(c->Put(s.tokens, s.ks(), s.vs(), cancelled).status().code(),
            absl::StatusCode::kCancelled);
  auto look = c->Lookup(s.tokens);
  ASSERT_TRUE(look.ok());
  EXPECT_EQ(look->num_blocks, 0u);
}

// A put session is bounded by the pool's put timeout, not by BeginPut's deadline: each call
// of the session gets default_timeout from its own start, so a prefill that pauses longer than
// default_timeout between layers still commits (newcomer report s5 #3). A put not committed
// within the pool's put timeout (ClientOptions::put_timeout) fails with DEADLINE_EXCEEDED
// naming it.
TEST_P(ClientTest, PutSessionOutlivesTheDefaultTimeoutButNotThePutTimeout) {
  auto make = [&](absl::Duration put_timeout) -> std::unique_ptr<Client> {
    ClientOptions o;
    o.server = absl::StrCat("127.0.0.1:", port_);
    o.ucx_tls = Tls();
    o.map_shared_memory = Mode() != "rma";
    o.copy_threads = Threads() ? 4 : 1;
    o.default_timeout = absl::Seconds(1);
    o.put_timeout = put_timeout;
    auto c = Client::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  };
  // Registration connects UCX: give it more than 1 s on a loaded host.
  auto roomy = [] { return CallOptions{absl::Now() + absl::Seconds(20), nullptr}; };
  auto c = make(absl::ZeroDuration());
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->RegisterModel(Spec("int2"), roomy()).ok());
  Sequence s = MakeSequence(2 * kPage, 21);
  auto put = c->BeginPut(s.tokens);  // default_timeout: BeginPut's deadline, 1 s
  ASSERT_TRUE(put.ok()) << put.status();
  // The pool's default put timeout (30 s), not default_timeout, bounds the session.
  EXPECT_GT((*put)->expires(), absl::Now() + absl::Seconds(10));
  for (uint32_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE((*put)->WriteLayer(l, s.k[l], s.v[l]).ok()) << l;
    // Longer than default_timeout after BeginPut, before the later pulls and the commit.
    if (l == 0) absl::SleepFor(absl::Milliseconds(1300));
  }
  auto r = (*put)->Commit();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_blocks, 2u);
  auto look = c->Lookup(s.tokens, roomy());
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->num_blocks, 2u);

  // Roomy enough that the writes below finish inside it on a loaded CI host.
  auto short_lived = make(absl::Seconds(2));
  ASSERT_NE(short_lived, nullptr);
  ASSERT_TRUE(short_lived->RegisterModel(Spec("int2"), roomy()).ok());
  Sequence s2 = MakeSequence(2 * kPage, 22);
  auto put2 = short_lived->BeginPut(s2.tokens);
  ASSERT_TRUE(put2.ok()) << put2.status();
  EXPECT_LT((*put2)->expires(), absl::Now() + absl::Seconds(3));
  for (uint32_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE((*put2)->WriteLayer(l, s2.k[l], s2.v[l]).ok()) << l;
  }
  ASSERT_TRUE((*put2)->Flush().ok());
  absl::SleepFor(absl::Milliseconds(2600));  // the pool drops the put (ticks every 20 ms)
  auto r2 = (*put2)->Commit();
  EXPECT_EQ(r2.status().code(), absl::StatusCode::kDeadlineExceeded) << r2.status();
  EXPECT_THAT(r2.status().message(), HasSubstr("put timeout"));
  // Marked, so that a caller holding the K/V can put them again (kvpool-worker's prefill does).
  EXPECT_TRUE(kvpool::client::PutExpired(r2.status())) << r2.status();
  EXPECT_FALSE(kvpool::client::PutExpired(absl::DeadlineExceededError("put timeout")));
  auto look2 = short_lived->Lookup(s2.tokens, roomy());
  ASSERT_TRUE(look2.ok()) << look2.status();
  EXPECT_EQ(look2->num_blocks, 0u);
}

// The pool frees a registration without blocks or puts when a new one needs the room
// (--max-registration-bytes): the client says so (UNAVAILABLE) and registers again on its next
// call, as after a pool restart, instead of failing every later call with NOT_FOUND.
TEST_P(ClientTest, AFreedRegistrationIsRegisteredAgain) {
  const ModelSpec spec = Spec("int2");
  server_->Shutdown(absl::ZeroDuration());
  server_.reset();
  // Room for one registration: the next one frees the other (neither holds blocks).
  StartServer(0, spec.rotation_file.size() + kvstore::kRegistrationOverheadBytes + 256);
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(spec);
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  auto other = NewClient();
  ASSERT_NE(other, nullptr);
  {
    auto reg = other->RegisterModel(Spec("int2", "-other"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  Sequence s = MakeSequence(2 * kPage, 31);
  auto freed = c->Lookup(s.tokens);
  EXPECT_EQ(freed.status().code(), absl::StatusCode::kUnavailable) << freed.status();
  EXPECT_THAT(freed.status().message(), HasSubstr("registration"));
  // The next call registers the model again (freeing the other one, which holds nothing).
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto look = c->Lookup(s.tokens);
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->num_blocks, 2u);
}

TEST_P(ClientTest, LeaseExpiryFailsClosedAndFetchPlanIsValidated) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  Sequence s = MakeSequence(4 * kPage, 5);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto pools = MakePools(*c, 4);

  auto lease = c->Acquire(s.tokens);
  ASSERT_TRUE(lease.ok());
  FetchPlan few = pools->plan;
  few.int2_pages.resize(0);
  EXPECT_THAT(c->Fetch(*lease, few).status().message(), HasSubstr("int2_pages"));
  FetchPlan nopool = pools->plan;
  nopool.bf16_pool = nullptr;
  EXPECT_THAT(c->Fetch(*lease, nopool).status().message(), HasSubstr("bf16_pool"));
  PagePool small = pools->bf16;
  small.page_stride = 8;
  FetchPlan stride = pools->plan;
  stride.bf16_pool = &small;
  EXPECT_THAT(c->Fetch(*lease, stride).status().message(), HasSubstr("page_stride"));
  FetchPlan outside = pools->plan;
  outside.bf16_pages = {100, 101, 102, 103};
  EXPECT_EQ(c->Fetch(*lease, outside).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(c->Release(*lease).ok());

  auto short_lease = c->Acquire(s.tokens, 0, /*lease_ms=*/50);
  ASSERT_TRUE(short_lease.ok());
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(c->Fetch(*short_lease, pools->plan).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->Release(*short_lease).code(), absl::StatusCode::kNotFound);
}

// A page given to two blocks is refused before a byte moves, on every path (newcomer report s6
// #2: direct mode returned OK with four blocks "verified" in one page, tcp reported DATA_LOSS),
// within each list and across the pools when they share memory.
TEST_P(ClientTest, FetchRefusesAPageGivenToTwoBlocks) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  // Six blocks: sink block 0 and window blocks 4, 5 in BF16, blocks 1-3 in INT2.
  Sequence s = MakeSequence(6 * kPage, 41);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto pools = MakePools(*c, 6);
  ASSERT_NE(pools, nullptr);
  auto lease = c->Acquire(s.tokens);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->blocks.size(), 6u);
  auto untouched = [&] {
    for (uint8_t b : pools->bf16_mem) {
      if (b != 0xCD) return false;
    }
    for (uint8_t b : pools->int2_mem) {
      if (b != 0xCD) return false;
    }
    return true;
  };

  FetchPlan bf16_dup = pools->plan;
  bf16_dup.bf16_pages = {2, 1, 2};  // blocks 0, 4, 5
  auto f = c->Fetch(*lease, bf16_dup);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_THAT(f.status().message(),
              HasSubstr("plan.bf16_pages: page 2 is given to blocks 0 and 5"));
  EXPECT_TRUE(untouched());

  FetchPlan int2_dup = pools->plan;
  int2_dup.int2_pages = {0, 0, 0};  // blocks 1, 2, 3
  f = c->Fetch(*lease, int2_dup);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_THAT(f.status().message(),
              HasSubstr("plan.int2_pages: page 0 is given to blocks 1 and 2"));
  EXPECT_TRUE(untouched());

  // Both pools in one region, page stride of a BF16 form: BF16 page 2 (block 5) is INT2 page 2
  // (block 3); INT2 pages 3-5 lie beside the BF16 pages and are accepted.
  const BlockGeometry g = Geometry();
  std::vector<uint8_t> shared_mem(6 * g.Bf16FormBytes(), 0xCD);
  auto region = c->RegisterBuffer(shared_mem.data(), shared_mem.size());
  ASSERT_TRUE(region.ok()) << region.status();
  PagePool bf16_shared{*region, g.Bf16FormBytes()};
  PagePool int2_shared{*region, g.Bf16FormBytes()};
  FetchPlan shared;
  shared.bf16_pool = &bf16_shared;
  shared.int2_pool = &int2_shared;
  shared.bf16_pages = {0, 1, 2};
  shared.int2_pages = {4, 3, 2};
  f = c->Fetch(*lease, shared);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_THAT(f.status().message(),
              HasSubstr("plan.bf16_pages: page 2 of block 5 overlaps plan.int2_pages page 2 of "
                        "block 3"));
  for (uint8_t b : shared_mem) ASSERT_EQ(b, 0xCD);
  // An INT2 page straddling two BF16 pages (INT2 stride: its page 3 lies inside BF16 page 1).
  PagePool int2_tight{*region, g.Int2FormBytes()};
  FetchPlan straddle = shared;
  straddle.int2_pool = &int2_tight;
  straddle.bf16_pages = {0, 1, 5};
  straddle.int2_pages = {
      static_cast<int32_t>(3 * g.Bf16FormBytes() / g.Int2FormBytes()),
      static_cast<int32_t>(4 * g.Bf16FormBytes() / g.Int2FormBytes()),
      static_cast<int32_t>((g.Bf16FormBytes() + g.Int2FormBytes() - 1) / g.Int2FormBytes())};
  ASSERT_LT(uint64_t(straddle.int2_pages[2]) * g.Int2FormBytes(), 2 * g.Bf16FormBytes());
  f = c->Fetch(*lease, straddle);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_THAT(f.status().message(),
              HasSubstr("plan.bf16_pages: page 1 of block 4 overlaps plan.int2_pages page"));
  for (uint8_t b : shared_mem) ASSERT_EQ(b, 0xCD);

  shared.int2_pages = {3, 4, 5};
  shared.bf16_pages = {0, 1, 2};
  f = c->Fetch(*lease, shared);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->num_blocks, 6u);
  for (const absl::Status& b : f->block_status) EXPECT_TRUE(b.ok()) << b;
  EXPECT_TRUE(c->Release(*lease).ok());
}

// Fetch fails closed before reading anything for a lease this client released or never got,
// and for a lease of a pool it lost (newcomer report s5 #5: in direct mode such fetches
// returned OK, with another sequence's bytes once the slots were reused, even unverified).
TEST_P(ClientTest, FetchRefusesReleasedForgedAndDeadPoolLeases) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  Sequence a = MakeSequence(4 * kPage, 31);
  ASSERT_TRUE(c->Put(a.tokens, a.ks(), a.vs()).ok());
  auto pools = MakePools(*c, 4);
  FetchPlan unverified = pools->plan;
  unverified.verify_checksums = false;

  auto lease = c->Acquire(a.tokens);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->blocks.size(), 4u);
  auto first = c->Fetch(*lease, unverified);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->num_blocks, 4u);

  // Forged: another id (and a far expiry) on the same blocks.
  Lease forged = *lease;
  forged.id = lease->id + 12345;
  forged.expires = absl::InfiniteFuture();
  auto f = c->Fetch(forged, unverified);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound) << f.status();
  EXPECT_THAT(f.status().message(), HasSubstr("lease_id"));

  // Released, then its blocks deleted and their slots reused by another sequence.
  ASSERT_TRUE(c->Release(*lease).ok());
  f = c->Fetch(*lease, unverified);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound) << f.status();
  EXPECT_THAT(f.status().message(), HasSubstr("lease_id"));
  auto keys = c->Keys(a.tokens);
  ASSERT_TRUE(keys.ok());
  auto deleted = c->Delete(*keys);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  Sequence b = MakeSequence(4 * kPage, 32);
  ASSERT_TRUE(c->Put(b.tokens, b.ks(), b.vs()).ok());
  f = c->Fetch(*lease, unverified);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound) << f.status();

  // The pool dies: once a call has seen it gone, a lease of its epoch is refused with
  // UNAVAILABLE (a dead pool's mapped memory would still read), before and after a new pool
  // starts on the same port.
  auto live = c->Acquire(b.tokens);
  ASSERT_TRUE(live.ok()) << live.status();
  const int port = port_;
  server_->Shutdown(absl::ZeroDuration());
  server_.reset();
  EXPECT_EQ(c->Lookup(b.tokens).status().code(), absl::StatusCode::kUnavailable);
  f = c->Fetch(*live, unverified);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kUnavailable) << f.status();
  StartServer(port);
  absl::StatusOr<FetchResult> after = absl::UnavailableError("not tried");
  for (int i = 0; i < 5; ++i) {
    after = c->Fetch(*live, unverified);
    EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_THAT(after.status().message(), HasSubstr("epoch"));
}

// A pool that died after the Acquire (or BeginPut) is not read (or written) as if alive, also
// when no call has failed since (newcomer report s6 #3: in direct mode a fetch from a pool
// killed 4.5 s earlier returned OK, and a put kept writing layers into its mapped staging).
TEST_P(ClientTest, APoolThatDiedSinceTheLeaseOrBeginPutIsNotReadOrWritten) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  const bool direct = c->model()->mapped_pool_memory;
  Sequence a = MakeSequence(4 * kPage, 61);
  ASSERT_TRUE(c->Put(a.tokens, a.ks(), a.vs()).ok());
  auto pools = MakePools(*c, 4);
  ASSERT_NE(pools, nullptr);
  auto lease = c->Acquire(a.tokens);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->blocks.size(), 4u);
  std::unique_ptr<PutSession> put, put_async;
  if (direct) {  // the other paths call the pool (or its UCX worker) for every layer
    for (auto* p : {&put, &put_async}) {
      Sequence b = MakeSequence(4 * kPage, p == &put ? 62 : 63);
      auto begun = c->BeginPut(b.tokens);
      ASSERT_TRUE(begun.ok()) << begun.status();
      *p = *std::move(begun);
      ASSERT_TRUE((*p)->WriteLayer(0, b.ks()[0], b.vs()[0]).ok());
    }
  }
  server_->Shutdown(absl::ZeroDuration());
  server_.reset();
  // gRPC notices the closed connection on its own threads; give it a moment (no call of this
  // client runs meanwhile, so nothing has marked the connection failed).
  absl::SleepFor(absl::Seconds(1));
  auto f = c->Fetch(*lease, pools->plan);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kUnavailable) << f.status();
  for (uint8_t byte : pools->bf16_mem) ASSERT_EQ(byte, 0xCD) << "a page was written";
  for (uint8_t byte : pools->int2_mem) ASSERT_EQ(byte, 0xCD) << "a page was written";
  if (put != nullptr) {
    Sequence b = MakeSequence(4 * kPage, 62);
    absl::Status w = put->WriteLayer(1, b.ks()[1], b.vs()[1]);
    EXPECT_EQ(w.code(), absl::StatusCode::kUnavailable) << w;
    // The put has failed: Commit returns the same status (and aborts).
    EXPECT_EQ(put->Commit().status(), w);
    // The asynchronous layer makes the same check before it is queued.
    w = put_async->WriteLayerAsync(1, b.ks()[1], b.vs()[1]);
    EXPECT_EQ(w.code(), absl::StatusCode::kUnavailable) << w;
    (void)put_async->Abort();
  }
}

// BeginPut and Acquire have their latency histograms to themselves; the transfers a pool runs
// (WritePut per pull call, ReadLeased per fetch) have their own (newcomer report s6 #6: over tcp
// kvpool_put_latency_seconds counted 1 BeginPut + 5 WritePuts per put).
TEST_P(ClientTest, TransfersHaveLatencyHistogramsOfTheirOwn) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  auto reg = c->RegisterModel(Spec("int2"));
  ASSERT_TRUE(reg.ok()) << reg.status();
  const bool pool_transfers = reg->pool_initiates_transfers;
  Sequence s = MakeSequence(4 * kPage, 71);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto pools = MakePools(*c, 4);
  ASSERT_NE(pools, nullptr);
  auto lease = c->Acquire(s.tokens);
  ASSERT_TRUE(lease.ok()) << lease.status();
  auto f = c->Fetch(*lease, pools->plan);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(c->Release(*lease).ok());
  const kvstore::Metrics& m = server_->store().metrics();
  EXPECT_EQ(m.put_latency.count(), 1u);
  EXPECT_EQ(m.fetch_latency.count(), 1u);
  // One WritePut call per layer that the calls of the put sent (Client::Put's WriteLayerAsync
  // sends the earlier layers packed by then; Commit the rest): 1..kLayers calls.
  if (pool_transfers) {
    EXPECT_GE(m.write_put_latency.count(), 1u);
    EXPECT_LE(m.write_put_latency.count(), uint64_t{kLayers});
  } else {
    EXPECT_EQ(m.write_put_latency.count(), 0u);
  }
  EXPECT_EQ(m.read_leased_latency.count(), pool_transfers ? 1u : 0u);
}

TEST_P(ClientTest, CorruptedStoredBytesAreDataLoss) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  Sequence s = MakeSequence(4 * kPage, 6);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto lease = c->Acquire(s.tokens);
  ASSERT_TRUE(lease.ok());
  // Block 1 is the only history block (sink 1, window 2): it is fetched as INT2.
  ASSERT_TRUE(lease->blocks[1].int2.has_value());
  // The pool lives in this process: flip one stored byte of block 1's INT2 form.
  auto* stored = reinterpret_cast<uint8_t*>(lease->blocks[1].int2->remote_addr);
  stored[17] ^= 0x40;
  auto pools = MakePools(*c, 4);
  // Without the checksum (verify_checksums = false) the corrupted bytes are delivered as they
  // are: the option trades corruption detection for speed.
  FetchPlan unverified = pools->plan;
  unverified.verify_checksums = false;
  auto g = c->Fetch(*lease, unverified);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->num_blocks, 4u);
  EXPECT_EQ(pools->int2_mem[g->pages[1] * Geometry().Int2FormBytes() + 17], stored[17]);
  // Verified: DATA_LOSS for that block (and the form is reported to the pool, next test).
  auto f = c->Fetch(*lease, pools->plan);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->num_blocks, 1u);  // only the verified leading blocks count
  EXPECT_EQ(f->block_status[1].code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f->block_status[1].message(), HasSubstr("xxh3"));
  EXPECT_TRUE(f->block_status[0].ok());
  EXPECT_TRUE(f->block_status[2].ok());
  EXPECT_EQ(f->tables.history.indices.size(), 0u);  // tables stop before the bad block
  EXPECT_EQ(f->tables.sink.indices.size(), 1u);
  EXPECT_TRUE(c->Release(*lease).ok());
}

// Waits up to 10 s for `done` (a pool-side effect of the client's background report).
bool Eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 1000; ++i) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return done();
}

// A stored form corrupted in the pool: the fetch that finds it returns DATA_LOSS for the block
// and reports it; the pool re-verifies, drops it and stops serving it (the next Lookup and
// Acquire end before the block; when the pool pushes the forms, the lease that still names it
// gets DATA_LOSS from the pool without a byte moving), and the next put of the sequence writes
// that one block again and restores it byte for byte. Before ReportCorrupt the pool went on
// leasing the same bytes to every reader.
TEST_P(ClientTest, ACorruptFormFoundAtFetchIsReportedAndNoLongerServed) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ModelSpec spec = Spec("int2");
  ASSERT_TRUE(c->RegisterModel(spec).ok());
  Sequence s = MakeSequence(4 * kPage, 16);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto lease = c->Acquire(s.tokens);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->blocks.size(), 4u);
  ASSERT_TRUE(lease->blocks[1].int2.has_value());  // the one history block: INT2 only
  ASSERT_FALSE(lease->blocks[1].bf16.has_value());
  auto* stored = reinterpret_cast<uint8_t*>(lease->blocks[1].int2->remote_addr);
  stored[100] ^= 0x04;  // the pool lives in this process
  auto pools = MakePools(*c, 4);
  auto f = c->Fetch(*lease, pools->plan);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->num_blocks, 1u);
  EXPECT_EQ(f->block_status[1].code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(f->block_status[1].message(), HasSubstr("reported to the pool"));
  const kvstore::Metrics& m = server_->store().metrics();
  ASSERT_TRUE(Eventually([&] { return m.checksum_failures_fetch_stored.load() == 1; }))
      << "the pool never dropped the reported form";
  EXPECT_EQ(m.checksum_failures_fetch_transit.load(), 0u);
  EXPECT_EQ(m.checksum_failures.load(), 0u);

  // No longer served: the held prefix ends before block 1.
  auto look = c->Lookup(s.tokens);
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->num_blocks, 1u);
  auto short_lease = c->Acquire(s.tokens);
  ASSERT_TRUE(short_lease.ok()) << short_lease.status();
  EXPECT_EQ(short_lease->blocks.size(), 1u);
  ASSERT_TRUE(c->Release(*short_lease).ok());
  // The old lease still names the form: it is DATA_LOSS again (when the pool pushes, from the
  // pool itself, which refuses to send it).
  auto again = c->Fetch(*lease, pools->plan);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->num_blocks, 1u);
  EXPECT_EQ(again->block_status[1].code(), absl::StatusCode::kDataLoss);
  if (c->model()->pool_initiates_transfers) {
    EXPECT_THAT(again->block_status[1].message(), HasSubstr("the pool found this form corrupt"));
  }
  ASSERT_TRUE(c->Release(*lease).ok());

  // A re-put writes block 1 only and restores it.
  auto put = c->Put(s.tokens, s.ks(), s.vs());
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->blocks_written, 1u);
  auto restored = c->Acquire(s.tokens);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_EQ(restored->blocks.size(), 4u);
  ASSERT_TRUE(restored->blocks[1].int2.has_value());
  EXPECT_NE(restored->blocks[1].int2->generation, lease->blocks[1].int2->generation);
  auto ok = c->Fetch(*restored, pools->plan);
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_EQ(ok->num_blocks, 4u);
  std::vector<uint8_t> bf16, int2;
  ASSERT_TRUE(ExpectedForms(s, 1, spec, &bf16, &int2));
  EXPECT_EQ(0, std::memcmp(pools->int2_mem.data() + ok->pages[1] * Geometry().Int2FormBytes(),
                           int2.data(), int2.size()));
  EXPECT_TRUE(c->Release(*restored).ok());
}

// Client::ReportCorrupt for callers that verify themselves: a form whose stored bytes verify is
// kept (the damage was the caller's), a stale generation or a form the block does not hold
// changes nothing, and each refusal names the field.
TEST_P(ClientTest, ReportCorruptKeepsAnIntactFormAndRefusesStaleReports) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->RegisterModel(Spec("int2")).ok());
  Sequence s = MakeSequence(4 * kPage, 17);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto lease = c->Acquire(s.tokens);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_EQ(lease->blocks.size(), 4u);
  const LeasedBlock& b2 = lease->blocks[2];
  ASSERT_TRUE(b2.bf16.has_value());
  auto r = c->ReportCorrupt(
      {{.key = b2.key, .form = Form::kBf16, .generation = b2.bf16->generation},
       {.key = b2.key, .form = Form::kInt2, .generation = 0},
       {.key = lease->blocks[1].key, .form = Form::kBf16, .generation = b2.bf16->generation}});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_TRUE((*r)[0].status.ok()) << (*r)[0].status;
  EXPECT_EQ((*r)[0].verdict, CorruptionVerdict::kIntact);
  EXPECT_TRUE((*r)[0].block_held);
  EXPECT_EQ((*r)[1].status.code(), absl::StatusCode::kFailedPrecondition) << (*r)[1].status;
  EXPECT_THAT((*r)[1].status.message(), HasSubstr("reports[1].generation"));
  EXPECT_EQ((*r)[2].status.code(), absl::StatusCode::kNotFound) << (*r)[2].status;
  EXPECT_THAT((*r)[2].status.message(), HasSubstr("reports[2].form"));
  // The refused reports changed nothing and say so over the wire: blocks 1 and 2 hold forms.
  EXPECT_TRUE((*r)[1].block_held);
  EXPECT_TRUE((*r)[2].block_held);
  EXPECT_EQ(c->ReportCorrupt({}).status().code(), absl::StatusCode::kInvalidArgument);
  const kvstore::Metrics& m = server_->store().metrics();
  EXPECT_EQ(m.checksum_failures_fetch_transit.load(), 1u);
  EXPECT_EQ(m.checksum_failures_fetch_stored.load(), 0u);
  EXPECT_EQ(m.corruption_reports_refused.load(), 2u);
  // Nothing was dropped: every block and form is served.
  auto pools = MakePools(*c, 4);
  auto f = c->Fetch(*lease, pools->plan);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->num_blocks, 4u);
  auto look = c->Lookup(s.tokens);
  ASSERT_TRUE(look.ok());
  ASSERT_EQ(look->num_blocks, 4u);
  EXPECT_TRUE(look->blocks[2].has_bf16 && look->blocks[2].has_int2);
  EXPECT_TRUE(c->Release(*lease).ok());
}

// Forms of several 16 KiB checksum chunks (docs/BLOCK_FORMAT.md "Checksums"), with layer slices
// that straddle chunks (L=3, H=3, d=64: 12 KiB layers, 36 KiB BF16 forms = 16 + 16 + 4 KiB) and
// that are whole chunks (L=2, H=4, d=128: 32 KiB layers, 64 KiB forms). The pool's commit check
// passing is the client's chunked put checksum agreeing with the pool's, on every path (the
// "/threads" variants pack and hash chunks on the copy threads); a byte flipped in any chunk of
// a stored form, the short last one included, makes the verified fetch DATA_LOSS, and the
// restored form verifies and is delivered byte for byte.
TEST_P(ClientTest, MultiChunkFormsVerifyAndACorruptedByteInAnyChunkIsDataLoss) {
  struct Shape {
    uint32_t layers, heads, dim;
  };
  for (const Shape shape : {Shape{3, 3, 64}, Shape{2, 4, 128}}) {
    SCOPED_TRACE(absl::StrCat("L=", shape.layers, " H=", shape.heads, " d=", shape.dim));
    // The bytes flipped below are flipped back: a report would make the pool drop the form.
    auto c = NewClient(/*check_finite=*/true, /*report_corrupt_forms=*/false);
    ASSERT_NE(c, nullptr);
    ModelSpec spec = Spec("int2", absl::StrCat("-chunks-", shape.layers, shape.heads, shape.dim));
    spec.num_layers = shape.layers;
    spec.num_kv_heads = shape.heads;
    spec.head_dim = shape.dim;
    RotationMetadata meta;
    meta.model_name = spec.model_id;
    meta.head_dim = shape.dim;
    meta.num_layers = shape.layers;
    meta.num_kv_heads = shape.heads;
    meta.clip_ratio_k = spec.clip_ratio_k;
    meta.clip_ratio_v = spec.clip_ratio_v;
    auto rot = RotationSet::Hadamard(meta);
    ASSERT_TRUE(rot.ok()) << rot.status();
    spec.rotation_file = SerializeRotations(*rot);
    ASSERT_TRUE(c->RegisterModel(spec).ok());
    const BlockGeometry g{shape.layers, shape.heads, shape.dim, kPage};
    const uint32_t blocks = 4;  // sink, history (INT2), recent x 2 (BF16)
    std::mt19937 rng(shape.layers * 100 + shape.heads);
    std::normal_distribution<float> normal(0.f, 1.f);
    const size_t per_layer = size_t(blocks) * kPage * shape.heads * shape.dim;
    std::vector<std::vector<uint16_t>> k(shape.layers, std::vector<uint16_t>(per_layer));
    std::vector<std::vector<uint16_t>> v = k;
    for (uint32_t l = 0; l < shape.layers; ++l) {
      for (size_t i = 0; i < per_layer; ++i) {
        k[l][i] = testing::ToBf16(normal(rng));
        v[l][i] = testing::ToBf16(normal(rng));
      }
    }
    std::vector<uint32_t> tokens(blocks * kPage);
    for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = 7000 + shape.dim + i;
    std::vector<absl::Span<const uint16_t>> ks(k.begin(), k.end()), vs(v.begin(), v.end());
    auto put = c->Put(tokens, ks, vs);
    ASSERT_TRUE(put.ok()) << put.status();  // the pool's check of the chunked put checksum
    auto lease = c->Acquire(tokens);
    ASSERT_TRUE(lease.ok()) << lease.status();
    ASSERT_EQ(lease->blocks.size(), blocks);
    ASSERT_TRUE(lease->blocks[0].bf16.has_value());
    ASSERT_EQ(lease->blocks[0].bf16->size, g.Bf16FormBytes());
    ASSERT_GT(ChecksumChunks(g.Bf16FormBytes()), 1u);

    std::vector<uint8_t> bf16_mem(blocks * g.Bf16FormBytes()), int2_mem(blocks * g.Int2FormBytes());
    auto rb = c->RegisterBuffer(bf16_mem.data(), bf16_mem.size());
    auto ri = c->RegisterBuffer(int2_mem.data(), int2_mem.size());
    ASSERT_TRUE(rb.ok() && ri.ok());
    PagePool bf16_pool{*rb, g.Bf16FormBytes()}, int2_pool{*ri, g.Int2FormBytes()};
    FetchPlan plan;
    plan.bf16_pool = &bf16_pool;
    plan.int2_pool = &int2_pool;
    for (int32_t i = 0; i < int32_t(blocks); ++i) {
      plan.bf16_pages.push_back(int32_t(blocks) - 1 - i);
      plan.int2_pages.push_back(int32_t(blocks) - 1 - i);
    }
    auto ok = c->Fetch(*lease, plan);
    ASSERT_TRUE(ok.ok()) << ok.status();
    ASSERT_EQ(ok->num_blocks, blocks);
    // The pool lives in this process: its stored bytes are addressable here.
    const auto* stored0 = reinterpret_cast<uint8_t*>(lease->blocks[0].bf16->remote_addr);
    EXPECT_EQ(
        std::memcmp(bf16_mem.data() + ok->pages[0] * g.Bf16FormBytes(), stored0, g.Bf16FormBytes()),
        0);
    auto* stored = const_cast<uint8_t*>(stored0);
    const uint64_t size = g.Bf16FormBytes();
    for (uint64_t at :
         {uint64_t{0}, uint64_t{16383}, uint64_t{16384}, uint64_t{20000}, size - 4096, size - 1}) {
      stored[at] ^= 0x08;
      auto f = c->Fetch(*lease, plan);
      stored[at] ^= 0x08;
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_EQ(f->block_status[0].code(), absl::StatusCode::kDataLoss) << "byte " << at;
      EXPECT_EQ(f->num_blocks, 0u) << "byte " << at;
      for (uint32_t b = 1; b < blocks; ++b) EXPECT_TRUE(f->block_status[b].ok()) << b;
    }
    auto again = c->Fetch(*lease, plan);
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_EQ(again->num_blocks, blocks);
    EXPECT_EQ(std::memcmp(bf16_mem.data() + again->pages[0] * g.Bf16FormBytes(), stored0, size), 0);
    EXPECT_TRUE(c->Release(*lease).ok());
  }
}

TEST_P(ClientTest, PoolRestartGivesUnavailableThenWorksAgain) {
  auto c = NewClient();
  ASSERT_NE(c, nullptr);
  {
    auto reg = c->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  Sequence s = MakeSequence(4 * kPage, 7);
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto lease = c->Acquire(s.tokens);
  ASSERT_TRUE(lease.ok());
  const uint64_t old_epoch = lease->pool_epoch;
  // A client that only looks up (a decode worker before its first lease) has no puts or leases
  // for a restarted pool to forget, and is not told of them (newcomer 18 F7).
  auto looker = NewClient();
  ASSERT_NE(looker, nullptr);
  ASSERT_TRUE(looker->RegisterModel(Spec("int2")).ok());
  ASSERT_TRUE(looker->Lookup(s.tokens).ok());

  const int port = port_;
  server_->Shutdown(absl::ZeroDuration());
  server_.reset();
  auto down = c->Lookup(s.tokens);
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable) << down.status();
  // gRPC's own words ("Broken pipe", "failed to connect ...") now come with what happened and
  // what the client does next.
  EXPECT_THAT(down.status().message(), HasSubstr("Lookup: lost the connection to the pool"))
      << down.status();
  EXPECT_THAT(down.status().message(), HasSubstr("reconnects")) << down.status();
  // What it holds now: the lease (the put is committed, so no longer open).
  EXPECT_THAT(down.status().message(), HasSubstr("forgotten this client's 1 lease(s)"))
      << down.status();
  EXPECT_THAT(down.status().message(), Not(HasSubstr("put(s)"))) << down.status();
  auto looker_down = looker->Lookup(s.tokens);
  EXPECT_EQ(looker_down.status().code(), absl::StatusCode::kUnavailable) << looker_down.status();
  EXPECT_THAT(looker_down.status().message(), HasSubstr("reconnects")) << looker_down.status();
  EXPECT_THAT(looker_down.status().message(), Not(HasSubstr("put"))) << looker_down.status();
  EXPECT_THAT(looker_down.status().message(), Not(HasSubstr("lease"))) << looker_down.status();
  StartServer(port);

  // The first call after the restart may still report UNAVAILABLE (it discovers the restart);
  // within a few calls the client has reconnected and re-registered.
  absl::StatusOr<LookupResult> look = absl::UnavailableError("not tried");
  for (int i = 0; i < 50 && !look.ok(); ++i) {
    look = c->Lookup(s.tokens);
    if (!look.ok()) {
      EXPECT_EQ(look.status().code(), absl::StatusCode::kUnavailable) << look.status();
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->num_blocks, 0u);  // the new pool is empty
  auto info = c->model();
  ASSERT_TRUE(info.ok());
  EXPECT_NE(info->pool_epoch, old_epoch);
  // The old lease is never used against the new process.
  auto pools = MakePools(*c, 4);
  EXPECT_EQ(c->Fetch(*lease, pools->plan).status().code(), absl::StatusCode::kUnavailable);
  // Put and fetch work again.
  ASSERT_TRUE(c->Put(s.tokens, s.ks(), s.vs()).ok());
  auto lease2 = c->Acquire(s.tokens);
  ASSERT_TRUE(lease2.ok());
  auto f = c->Fetch(*lease2, pools->plan);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->num_blocks, 4u);
  EXPECT_TRUE(c->Release(*lease2).ok());
}

INSTANTIATE_TEST_SUITE_P(Ucx, ClientTest,
                         ::testing::Values("tcp", "posix,cma", "tcp/client", "posix,cma/pool",
                                           "posix,cma/rma", "posix,cma/threads", "tcp/threads",
                                           "posix,cma/rma/threads"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), ',', '_');
                           std::replace(n.begin(), n.end(), '/', '_');
                           return n;
                         });

// A TCP proxy on 127.0.0.1 that forwards each connection to `upstream_port` only after `delay`:
// to the client, a pool whose connection handshake (the pool's HTTP/2 SETTINGS) takes `delay`,
// as on a loaded host or over a slow link. Serves connections one after another.
class DelayProxy {
 public:
  DelayProxy(int upstream_port, absl::Duration delay) : upstream_(upstream_port), delay_(delay) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(listen_fd_, 8) != 0 ||
        getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      return;
    }
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~DelayProxy() {
    stop_ = true;
    shutdown(listen_fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    close(listen_fd_);
  }
  int port() const { return port_; }

 private:
  void Serve() {
    while (!stop_) {
      const int in = accept(listen_fd_, nullptr, nullptr);
      if (in < 0) return;
      absl::SleepFor(delay_);
      const int out = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(upstream_);
      if (connect(out, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) Pump(in, out);
      close(out);
      close(in);
    }
  }
  // Copies bytes both ways until either side closes or the proxy stops.
  void Pump(int a, int b) {
    char buf[16384];
    while (!stop_) {
      pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
      if (poll(fds, 2, 20) < 0) return;
      for (int i = 0; i < 2; ++i) {
        if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
        if (n <= 0) return;
        if (write(fds[1 - i].fd, buf, static_cast<size_t>(n)) != n) return;
      }
    }
  }

  int upstream_;
  absl::Duration delay_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A pool whose connection handshake takes 300 ms (a loaded host: the full make test saw a fresh
// client's RegisterModel fail UNAVAILABLE after 333 ms, "tcp handshaker shutdown") answers the
// client's first call. The client's channel used to set GRPC_ARG_MIN_RECONNECT_BACKOFF_MS to
// 100 ms, which gRPC also takes as the minimum connect timeout: every connection attempt that
// took longer than ~100 ms was abandoned and the call failed UNAVAILABLE without the pool ever
// seeing it. The pool here has no data plane, so its answer is the client's refusal
// (FAILED_PRECONDITION): any code but UNAVAILABLE/DEADLINE_EXCEEDED shows the pool answered.
TEST(ClientConnect, APoolWhoseHandshakeTakes300MsAnswersTheFirstCall) {
  auto server = StartDataPlaneNonePool();
  ASSERT_TRUE(server.ok()) << server.status();
  DelayProxy proxy((*server)->grpc_port(), absl::Milliseconds(300));
  ASSERT_NE(proxy.port(), 0);
  auto c = testing::NewClient(absl::StrCat("127.0.0.1:", proxy.port()), "tcp");
  ASSERT_NE(c, nullptr);
  auto r = c->RegisterModel(Spec("int2"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(RefusedByClient(r.status())) << r.status();
}

// Who refused, and why (newcomer report s5 #10): a pool without a UCX data plane accepts the
// registration and the client refuses it (RefusedByClient, the message says so); a pool's own
// refusal carries no such mark; a client whose UCX transports the pool's worker cannot reach
// gets a hint naming --ucx-tls.
TEST(ClientRefusal, DataPlaneNonePoolIsRefusedByTheClientAndSaysSo) {
  auto server = StartDataPlaneNonePool();
  ASSERT_TRUE(server.ok()) << server.status();
  auto c = testing::NewClient(absl::StrCat("127.0.0.1:", (*server)->grpc_port()), "tcp");
  ASSERT_NE(c, nullptr);
  auto r = c->RegisterModel(Spec("int2"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(RefusedByClient(r.status())) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("this client refuses the pool"));
  EXPECT_THAT(r.status().message(), HasSubstr("--data-plane none"));

  // A refusal by the pool (a differing registration of the same model) is not the client's.
  kvstore::PoolServerOptions u = LoopbackPoolOptions();
  u.data_plane = "ucx";
  u.ucx_tls = "tcp";
  auto pool = kvstore::PoolServer::Create(u);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto c2 = testing::NewClient(absl::StrCat("127.0.0.1:", (*pool)->grpc_port()), "tcp");
  ASSERT_NE(c2, nullptr);
  {
    auto reg = c2->RegisterModel(Spec("int2"));
    ASSERT_TRUE(reg.ok()) << reg.status();
  }
  ModelSpec other = Spec("int2");
  other.sink_tokens += kPage;
  auto conflict = c2->RegisterModel(other);
  EXPECT_EQ(conflict.status().code(), absl::StatusCode::kFailedPrecondition) << conflict.status();
  EXPECT_FALSE(RefusedByClient(conflict.status())) << conflict.status();
}

TEST(ClientRefusal, NoSharedUcxTransportNamesUcxTls) {
  // The pool's worker is reachable over shared memory only; this client speaks tcp only.
  kvstore::PoolServerOptions o = LoopbackPoolOptions();
  o.ucx_tls = "posix,cma";
  o.transfer_initiator = "client";
  auto server = kvstore::PoolServer::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto c = testing::NewClient(absl::StrCat("127.0.0.1:", (*server)->grpc_port()), "tcp");
  ASSERT_NE(c, nullptr);
  auto r = c->RegisterModel(Spec("int2"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("share no UCX transport"));
  EXPECT_THAT(r.status().message(), HasSubstr("--ucx-tls"));
}

// Cancel ran the actions it took outside its lock and Remove did not wait for them: a call
// cancelled by another thread returned and freed its gRPC context while that thread's TryCancel
// was still inside it ("Mutex unlocked when destroyed", SIGABRT: kvpool-worker stopped during a
// registration, session 10). Remove now returns only once a running action has.
TEST(CancelToken, RemoveWaitsForAnActionThatCancelIsRunning) {
  auto token = std::make_shared<CancelToken>();
  std::atomic<bool> started{false}, finished{false};
  const uint64_t id = token->Add([&] {
    started = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    finished = true;
  });
  ASSERT_NE(id, 0u);
  std::thread canceller([&] { token->Cancel(); });
  while (!started) std::this_thread::yield();
  token->Remove(id);
  EXPECT_TRUE(finished) << "Remove returned while its action was still running";
  canceller.join();
  // An action that removes an id on the cancelling thread does not wait for itself.
  auto self = std::make_shared<CancelToken>();
  uint64_t other = self->Add([] {});
  self->Add([&] { self->Remove(other); });
  self->Cancel();
  EXPECT_TRUE(self->cancelled());
}

TEST(PageTables, MergeConcatenatesRequests) {
  PageTables a, b;
  a.sink = {{0, 1}, {7}, {16}};
  a.history = {{0, 2}, {3, 4}, {16}};
  a.recent = {{0, 1}, {9}, {5}};
  b.sink = {{0, 0}, {}, {16}};
  b.history = {{0, 1}, {8}, {16}};
  b.recent = {{0, 2}, {1, 2}, {16}};
  const PageTables* both[] = {&a, &b};
  PageTables m = MergePageTables(both);
  EXPECT_EQ(m.sink.indptr, (std::vector<int32_t>{0, 1, 1}));
  EXPECT_EQ(m.sink.indices, (std::vector<int32_t>{7}));
  EXPECT_EQ(m.history.indptr, (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(m.history.indices, (std::vector<int32_t>{3, 4, 8}));
  EXPECT_EQ(m.recent.indices, (std::vector<int32_t>{9, 1, 2}));
  EXPECT_EQ(m.recent.last_page_len, (std::vector<int32_t>{5, 16}));
}

TEST(PackLayerSlice, MatchesBlockFormatOffsets) {
  BlockGeometry g{2, 2, 8, 4};
  const uint32_t T = 8;  // two blocks
  std::vector<uint16_t> k(T * 2 * 8), v(T * 2 * 8);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<uint16_t>(i);
    v[i] = static_cast<uint16_t>(10000 + i);
  }
  std::vector<uint8_t> out(g.Bf16LayerBytes());
  PackLayerSlice(g, /*block=*/1, k.data(), v.data(), out.data());
  for (uint32_t h = 0; h < 2; ++h) {
    for (uint32_t t = 0; t < 4; ++t) {
      for (uint32_t j = 0; j < 8; ++j) {
        uint16_t kk, vv;
        std::memcpy(&kk, out.data() + g.Bf16ChunkOffset(0, h) + (t * 8 + j) * 2, 2);
        std::memcpy(&vv, out.data() + g.Bf16ChunkOffset(0, h) + g.Bf16VOffset() + (t * 8 + j) * 2,
                    2);
        const size_t src = ((4 + t) * 2 + h) * 8 + j;
        ASSERT_EQ(kk, k[src]);
        ASSERT_EQ(vv, v[src]);
      }
    }
  }
}

}  // namespace
}  // namespace kvpool::client
