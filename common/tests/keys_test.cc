// Golden vectors for docs/KEYS.md. The same values are computed independently with Python's
// hashlib in python/tests/test_keys.py; both must agree.
#include "kvpool/common/keys.h"

#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace kvpool {
namespace {

Digest TestRotationId() { return Sha256("kvpool-test-rotation"); }

KeyNamespace StoriesNamespace() {
  KeyNamespace ns;
  ns.model_id = "stories260K";
  ns.revision = "r1";
  ns.num_layers = 5;
  ns.num_kv_heads = 4;
  ns.head_dim = 8;
  ns.rotation_id = TestRotationId();
  return ns;
}

KeyNamespace TpNamespace() {
  KeyNamespace ns;
  ns.tenant = "acme";
  ns.model_id = "m";
  ns.revision = "";
  ns.num_layers = 2;
  ns.num_kv_heads = 1;
  ns.head_dim = 128;
  ns.rotation_id = TestRotationId();
  ns.page_size = 4;
  ns.sink_tokens = 0;
  ns.clip_ratio_k = 0.0f;
  ns.clip_ratio_v = 0.5f;
  ns.history_precision = "bf16";
  ns.tensor_parallel = TensorParallelShard{.rank = 1, .size = 2};
  return ns;
}

TEST(KeysTest, Sha256KnownAnswer) {
  // FIPS 180-2 example "abc".
  EXPECT_EQ(ToHex(Sha256("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(ToHex(TestRotationId()),
            "c1f9b8dae38143e7088e2e498feaaac14353cec61265fca29f2c0efef3792efa");
}

TEST(KeysTest, NamespaceEncodingLayout) {
  std::string enc = EncodeNamespace(StoriesNamespace());
  ASSERT_EQ(enc.size(), 172u);
  // Field 1: u32 length 4, then u32 version 1.
  EXPECT_EQ(enc.substr(0, 8), std::string("\x04\0\0\0\x01\0\0\0", 8));
  // Field 2: length 15, "kvpool-block-v1".
  EXPECT_EQ(enc.substr(8, 4 + 15), std::string("\x0f\0\0\0kvpool-block-v1", 19));
  // Last field: "canonical".
  EXPECT_EQ(enc.substr(enc.size() - 13), std::string("\x09\0\0\0canonical", 13));
  EXPECT_EQ(EncodeNamespace(TpNamespace()).size(), 156u);
}

TEST(KeysTest, GoldenStories) {
  auto root = NamespaceKey(StoriesNamespace());
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ(ToHex(*root), "b9dbaefc23947ab039efe1b4c8c74fe50d6adbf74ade1b3f401c00e9a2476677");
  std::vector<uint32_t> tokens(40);
  std::iota(tokens.begin(), tokens.end(), 0u);
  auto keys = ChainKeys(*root, tokens, 16);
  ASSERT_TRUE(keys.ok()) << keys.status();
  ASSERT_EQ(keys->size(), 2u);  // 40 tokens = 2 full blocks + a partial one (no key)
  EXPECT_EQ(ToHex((*keys)[0]), "6a4c9c628b1cd244561f62a3b5d8f0a3b3c90ff4bf603094e9fdb5103b37e9ed");
  EXPECT_EQ(ToHex((*keys)[1]), "bac191c4a348aa5e9f8a03e7cc0fd55bcd3d531414513040b306374d68bfe4cb");
}

TEST(KeysTest, GoldenTensorParallelBf16) {
  auto root = NamespaceKey(TpNamespace());
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ(ToHex(*root), "44fb11cbca654646639f4ad8f1fc0108f42dd81f0ee5efaa7e89cba61fb7a983");
  std::vector<uint32_t> tokens = {1, 2, 3, 4, 4294967295u, 0, 7, 65536};
  auto keys = ChainKeys(*root, tokens, 4);
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->size(), 2u);
  EXPECT_EQ(ToHex((*keys)[0]), "af1c94cc823beb91007d2bfcca65d3b96596bca2ba8fb17abb2eb69e19936cea");
  EXPECT_EQ(ToHex((*keys)[1]), "48bf2ba1fe985fc1e6169e566e23a3541b4397b27464939c50c3b6aa88e725b0");
}

TEST(KeysTest, ChainIsPrefixStableAndMaxBlocks) {
  auto root = NamespaceKey(StoriesNamespace());
  ASSERT_TRUE(root.ok());
  std::vector<uint32_t> tokens(64);
  std::iota(tokens.begin(), tokens.end(), 100u);
  auto all = ChainKeys(*root, tokens, 16);
  auto two = ChainKeys(*root, tokens, 16, 2);
  ASSERT_TRUE(all.ok() && two.ok());
  ASSERT_EQ(all->size(), 4u);
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*all)[1], (*two)[1]);
  EXPECT_EQ((*all)[2], NextBlockKey((*all)[1], absl::MakeConstSpan(tokens).subspan(32, 16)));
}

// NextBlockKey feeds the body to SHA-256 in pieces of 64 ids: for page sizes below, at and
// above a piece (and not a multiple of it) the key is SHA-256 of the whole concatenation
// key(i-1) || u32 count || ids (docs/KEYS.md), hashed here in one piece.
TEST(KeysTest, BlockKeyIsTheHashOfTheWholeBodyAtEveryPageSize) {
  const Digest prev = *NamespaceKey(StoriesNamespace());
  for (uint32_t page : {1u, 16u, 63u, 64u, 65u, 128u, 200u}) {
    std::vector<uint32_t> tokens(page);
    std::iota(tokens.begin(), tokens.end(), 0xfffffff0u);  // ids above 2^31 wrap through 0
    std::string body(reinterpret_cast<const char*>(prev.data()), prev.size());
    auto append = [&body](uint32_t v) {
      for (int i = 0; i < 4; ++i) body.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    };
    append(page);
    for (uint32_t t : tokens) append(t);
    EXPECT_EQ(NextBlockKey(prev, tokens), Sha256(body)) << "page " << page;
  }
}

// Each thread hashes with a context of its own: keys computed by eight threads at once equal the
// keys of one thread.
TEST(KeysTest, ThreadsComputeTheSameKeys) {
  const Digest root = *NamespaceKey(StoriesNamespace());
  std::vector<uint32_t> tokens(64 * 16);
  std::iota(tokens.begin(), tokens.end(), 7u);
  const std::vector<BlockKey> want = *ChainKeys(root, tokens, 16);
  std::vector<std::vector<BlockKey>> got(8);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) got[t] = *ChainKeys(root, tokens, 16);
    });
  }
  for (auto& th : threads) th.join();
  for (size_t t = 0; t < got.size(); ++t) EXPECT_EQ(got[t], want) << "thread " << t;
}

TEST(KeysTest, EveryNamespaceFieldChangesTheKey) {
  const Digest base = *NamespaceKey(StoriesNamespace());
  std::vector<void (*)(KeyNamespace&)> edits = {
      [](KeyNamespace& n) { n.tenant = "other"; },
      [](KeyNamespace& n) { n.model_id = "x"; },
      [](KeyNamespace& n) { n.revision = "r2"; },
      [](KeyNamespace& n) { n.num_layers = 6; },
      [](KeyNamespace& n) { n.num_kv_heads = 2; },
      [](KeyNamespace& n) { n.head_dim = 16; },
      [](KeyNamespace& n) { n.rotation_id[0] ^= 1; },
      [](KeyNamespace& n) { n.page_size = 32; },
      [](KeyNamespace& n) { n.sink_tokens = 0; },
      [](KeyNamespace& n) { n.clip_ratio_k = 0.95f; },
      [](KeyNamespace& n) { n.clip_ratio_v = 0.0f; },
      [](KeyNamespace& n) { n.history_precision = "bf16"; },
      [](KeyNamespace& n) {
        n.tensor_parallel = TensorParallelShard{0, 1};
      },
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    KeyNamespace ns = StoriesNamespace();
    edits[i](ns);
    auto k = NamespaceKey(ns);
    ASSERT_TRUE(k.ok()) << i;
    EXPECT_NE(*k, base) << "edit " << i;
  }
}

TEST(KeysTest, InvalidNamespaceNamesTheField) {
  KeyNamespace ns = StoriesNamespace();
  ns.page_size = 12;
  auto k = NamespaceKey(ns);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(k.status().message().find("page_size"), std::string_view::npos);
  ns = StoriesNamespace();
  ns.history_precision = "int4";
  EXPECT_NE(NamespaceKey(ns).status().message().find("history_precision"), std::string_view::npos);
  ns = StoriesNamespace();
  ns.model_id = "";
  EXPECT_NE(NamespaceKey(ns).status().message().find("model_id"), std::string_view::npos);
  ns = StoriesNamespace();
  ns.tensor_parallel = TensorParallelShard{2, 2};
  EXPECT_NE(NamespaceKey(ns).status().message().find("tensor_parallel"), std::string_view::npos);
  EXPECT_EQ(ChainKeys(Digest{}, {}, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KeysTest, HexAndBytesRoundTrip) {
  Digest d = TestRotationId();
  auto back = DigestFromHex(ToHex(d));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, d);
  auto upper = DigestFromHex("C1F9B8DAE38143E7088E2E498FEAAAC14353CEC61265FCA29F2C0EFEF3792EFA");
  ASSERT_TRUE(upper.ok());
  EXPECT_EQ(*upper, d);
  EXPECT_EQ(DigestFromHex("abc", "rotation_id").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NE(
      DigestFromHex(std::string(64, 'g'), "rotation_id").status().message().find("rotation_id"),
      std::string_view::npos);
  auto fb = DigestFromBytes(DigestBytes(d));
  ASSERT_TRUE(fb.ok());
  EXPECT_EQ(*fb, d);
  EXPECT_EQ(DigestFromBytes("short").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
