// ParseHostPort: accepted forms and the refusals both binaries rely on.
#include "kvpool/common/host_port.h"

#include <gtest/gtest.h>

#include <string>

namespace kvpool {
namespace {

TEST(ParseHostPort, AcceptsNamesIpv4AndBracketedIpv6) {
  auto a = ParseHostPort("--pool", "pool.svc:7070", 1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "pool.svc");
  EXPECT_EQ(a->port, 7070);
  auto b = ParseHostPort("--pool", "127.0.0.1:65535", 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->host, "127.0.0.1");
  EXPECT_EQ(b->port, 65535);
  auto c = ParseHostPort("listen", "[::1]:0", 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->host, "::1");
  EXPECT_EQ(c->port, 0);
}

TEST(ParseHostPort, RefusesMalformedAddressesNamingTheField) {
  for (const char* bad : {"127.0.0.1", ":7070", "127.0.0.1:", "127.0.0.1:x7", "127.0.0.1:7x",
                          "127.0.0.1:-5", "127.0.0.1:65536", "127.0.0.1:999999", "127.0.0.1:0",
                          "::1:7070", "[::1:7070", "::1]:7070", "[]:7070", "127.0.0.1: 70"}) {
    auto r = ParseHostPort("--pool", bad, 1);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    const std::string msg(r.status().message());
    EXPECT_EQ(msg.rfind("--pool: '", 0), 0u) << msg;
    EXPECT_NE(msg.find(bad), std::string::npos) << msg;
  }
}

TEST(ParseHostPort, PortZeroOnlyWhenAllowed) {
  EXPECT_TRUE(ParseHostPort("listen", "0.0.0.0:0", 0).ok());
  auto r = ParseHostPort("--pool", "0.0.0.0:0", 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("1..65535"), std::string::npos) << r.status();
}

TEST(ParseHostPort, UnbracketedIpv6SaysHowToWriteIt) {
  auto r = ParseHostPort("listen", "::1:0", 0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("[::1]:0"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace kvpool
