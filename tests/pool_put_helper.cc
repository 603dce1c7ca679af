// pool_put_helper — a client process that pool_integration_test SIGKILLs.
//
//   pool_put_helper SERVER TLS SEED NUM_TOKENS LAYERS_TO_WRITE [MODE]
//
// MODE "hang" (default): begins a put of MakeSequence(NUM_TOKENS, SEED), writes LAYERS_TO_WRITE
// layers, flushes, prints "READY" and hangs until killed (a client killed between layers).
// MODE "storm-put": puts MakeSequence(NUM_TOKENS, 7) with token 1 = SEED again and again, token
// 0 = the iteration (so every put writes every block), committing each; prints "READY" once the
// first layer of the first put is written, so a kill lands while layer transfers, flushes or
// commits are in flight. Every put carries the same K/V, so every committed block of every
// iteration holds the same bytes. LAYERS_TO_WRITE is ignored.
// MODE "storm-fetch": puts and leases (2 s) that sequence once, prints "READY" after the first
// fetch and fetches it in a loop (a kill lands while transfers into this process are in flight).
// Exit: 1 usage, 2 a call failed; the storms and "hang" otherwise run until killed.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "pool_testing.h"

namespace {

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  return 2;
}

void Ready() {
  std::printf("READY\n");
  std::fflush(stdout);
}

// Runs a storm mode until killed (or until a call fails: 2).
int Storm(kvpool::client::Client& c, const std::string& mode, kvpool::testing::Sequence& s) {
  const uint32_t blocks = static_cast<uint32_t>(s.tokens.size()) / kvpool::testing::kPage;
  if (mode == "storm-put") {
    for (uint32_t iter = 0;; ++iter) {
      s.tokens[0] = iter;
      auto put = c.BeginPut(s.tokens);
      if (!put.ok()) return Fail("BeginPut", put.status());
      for (uint32_t l = 0; l < kvpool::testing::kLayers; ++l) {
        if (auto r = (*put)->WriteLayer(l, s.k[l], s.v[l]); !r.ok()) return Fail("WriteLayer", r);
        if (iter == 0 && l == 0) Ready();
      }
      if (auto r = (*put)->Commit(); !r.ok()) return Fail("Commit", r.status());
    }
  }
  if (auto r = c.Put(s.tokens, s.ks(), s.vs()); !r.ok()) return Fail("Put", r.status());
  auto lease = c.Acquire(s.tokens, 0, /*lease_ms=*/2000);
  if (!lease.ok()) return Fail("Acquire", lease.status());
  auto pools = kvpool::testing::FetchPools::Create(c, blocks);
  if (!pools.ok()) return Fail("FetchPools", pools.status());
  for (uint32_t iter = 0;; ++iter) {
    if (iter == 1) Ready();
    auto f = c.Fetch(*lease, (*pools)->plan);
    if (!f.ok()) return Fail("Fetch", f.status());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    std::fprintf(stderr, "usage: %s SERVER TLS SEED NUM_TOKENS LAYERS_TO_WRITE [MODE]\n",
                 argv[0]);
    return 1;
  }
  kvpool::client::ClientOptions o;
  o.server = argv[1];
  o.ucx_tls = argv[2];
  o.default_timeout = absl::Seconds(20);
  const uint32_t seed = static_cast<uint32_t>(std::atoi(argv[3]));
  const uint32_t num_tokens = static_cast<uint32_t>(std::atoi(argv[4]));
  const uint32_t layers = static_cast<uint32_t>(std::atoi(argv[5]));
  const std::string mode = argc == 7 ? argv[6] : "hang";
  if (mode != "hang" && mode != "storm-put" && mode != "storm-fetch") {
    std::fprintf(stderr, "MODE: \"%s\" is not hang, storm-put or storm-fetch\n", mode.c_str());
    return 1;
  }
  if (num_tokens < 2 * kvpool::testing::kPage) {
    std::fprintf(stderr, "NUM_TOKENS: %u is less than two blocks\n", num_tokens);
    return 1;
  }
  auto client = kvpool::client::Client::Create(o);
  if (!client.ok()) return Fail("Create", client.status());
  auto spec = kvpool::testing::Spec("int2");
  if (auto r = (*client)->RegisterModel(spec); !r.ok()) return Fail("RegisterModel", r.status());
  if (mode != "hang") {
    // Same K/V in every storm (seed 7); token 1 = SEED keeps the runs' keys apart.
    auto s = kvpool::testing::MakeSequence(num_tokens, 7);
    s.tokens[1] = seed;
    return Storm(**client, mode, s);
  }
  auto s = kvpool::testing::MakeSequence(num_tokens, seed);
  auto put = (*client)->BeginPut(s.tokens);
  if (!put.ok()) return Fail("BeginPut", put.status());
  for (uint32_t l = 0; l < layers; ++l) {
    if (auto r = (*put)->WriteLayer(l, s.k[l], s.v[l]); !r.ok()) return Fail("WriteLayer", r);
  }
  if (auto r = (*put)->Flush(); !r.ok()) return Fail("Flush", r);
  Ready();
  for (;;) pause();
}
