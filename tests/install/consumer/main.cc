// The installed client from outside the tree: block keys (the docs/KEYS.md golden vector of
// common/tests/keys_test.cc GoldenStories), ClientOptions, and a call to a pool that is not
// there, which must come back UNAVAILABLE. Prints "kvpool consumer: ok" and exits 0, or says
// what differed and exits 1.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "kvpool/client/client.h"
#include "kvpool/common/keys.h"

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "kvpool consumer: %s\n", what.c_str());
  return 1;
}

// A loopback port nobody listens on: bound to port 0, read back, closed.
int ClosedPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

}  // namespace

int main() {
  kvpool::KeyNamespace ns;
  ns.model_id = "stories260K";
  ns.revision = "r1";
  ns.num_layers = 5;
  ns.num_kv_heads = 4;
  ns.head_dim = 8;
  ns.rotation_id = kvpool::Sha256("kvpool-test-rotation");
  auto root = kvpool::NamespaceKey(ns);
  if (!root.ok()) return Fail("NamespaceKey: " + root.status().ToString());
  std::vector<uint32_t> tokens(40);
  std::iota(tokens.begin(), tokens.end(), 0u);
  auto keys = kvpool::ChainKeys(*root, tokens, 16);
  if (!keys.ok() || keys->size() != 2) return Fail("ChainKeys: want 2 keys");
  const std::string want = "6a4c9c628b1cd244561f62a3b5d8f0a3b3c90ff4bf603094e9fdb5103b37e9ed";
  if (kvpool::ToHex((*keys)[0]) != want) {
    return Fail("key(0) = " + kvpool::ToHex((*keys)[0]) + ", want " + want);
  }

  const int port = ClosedPort();
  if (port <= 0) return Fail("no free loopback port");
  kvpool::client::ClientOptions o;
  o.server = "127.0.0.1:" + std::to_string(port);
  o.ucx_tls = "tcp";
  o.default_timeout = absl::Seconds(10);
  auto client = kvpool::client::Client::Create(o);
  if (!client.ok()) return Fail("Client::Create: " + client.status().ToString());
  auto stats = (*client)->Stats();
  if (stats.ok() || stats.status().code() != absl::StatusCode::kUnavailable) {
    return Fail("Stats against closed port " + std::to_string(port) + ": want UNAVAILABLE, got " +
                stats.status().ToString());
  }
  std::printf("kvpool consumer: ok (key(0) %s, Stats: %s)\n", want.substr(0, 16).c_str(),
              stats.status().ToString().c_str());
  return 0;
}
