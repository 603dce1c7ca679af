// pool_put_helper — a client that begins a put, writes some layers, prints "READY" and then
// hangs until killed. pool_integration_test uses it to kill a client mid-put.
//
//   pool_put_helper SERVER TLS SEED NUM_TOKENS LAYERS_TO_WRITE
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "pool_testing.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s SERVER TLS SEED NUM_TOKENS LAYERS_TO_WRITE\n", argv[0]);
    return 1;
  }
  kvpool::client::ClientOptions o;
  o.server = argv[1];
  o.ucx_tls = argv[2];
  const uint32_t seed = static_cast<uint32_t>(std::atoi(argv[3]));
  const uint32_t num_tokens = static_cast<uint32_t>(std::atoi(argv[4]));
  const uint32_t layers = static_cast<uint32_t>(std::atoi(argv[5]));
  auto client = kvpool::client::Client::Create(o);
  if (!client.ok()) {
    std::fprintf(stderr, "Create: %s\n", client.status().ToString().c_str());
    return 2;
  }
  auto spec = kvpool::testing::Spec("int2");
  if (auto r = (*client)->RegisterModel(spec); !r.ok()) {
    std::fprintf(stderr, "RegisterModel: %s\n", r.status().ToString().c_str());
    return 2;
  }
  auto s = kvpool::testing::MakeSequence(num_tokens, seed);
  auto put = (*client)->BeginPut(s.tokens);
  if (!put.ok()) {
    std::fprintf(stderr, "BeginPut: %s\n", put.status().ToString().c_str());
    return 2;
  }
  for (uint32_t l = 0; l < layers; ++l) {
    if (auto r = (*put)->WriteLayer(l, s.k[l], s.v[l]); !r.ok()) {
      std::fprintf(stderr, "WriteLayer: %s\n", r.ToString().c_str());
      return 2;
    }
  }
  if (auto r = (*put)->Flush(); !r.ok()) {
    std::fprintf(stderr, "Flush: %s\n", r.ToString().c_str());
    return 2;
  }
  std::printf("READY\n");
  std::fflush(stdout);
  for (;;) pause();
}
