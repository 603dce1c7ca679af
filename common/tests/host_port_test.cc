// ParseHostPort: accepted forms and the refusals both binaries rely on; FormatHostPort.
#include "kvpool/common/host_port.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"

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

// The start-up line of kvpool-server printed "grpc :::47120" for --listen [::]:47120, which
// --listen refuses (newcomer s9b #6): FormatHostPort brackets an IPv6 host, and what it writes
// parses back to the same host and port.
TEST(FormatHostPort, BracketsIpv6HostsAndParsesBack) {
  EXPECT_EQ(FormatHostPort("::", 47120), "[::]:47120");
  EXPECT_EQ(FormatHostPort("::1", 0), "[::1]:0");
  EXPECT_EQ(FormatHostPort("127.0.0.1", 7070), "127.0.0.1:7070");
  EXPECT_EQ(FormatHostPort("pool.svc", 1), "pool.svc:1");
  for (const char* host : {"::", "::1", "fe80::1", "0.0.0.0", "localhost"}) {
    auto back = ParseHostPort("--listen", FormatHostPort(host, 7070), 0);
    ASSERT_TRUE(back.ok()) << host << ": " << back.status();
    EXPECT_EQ(back->host, host);
    EXPECT_EQ(back->port, 7070);
  }
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

// "127.0.0.1:0:0" was told to write "[127.0.0.1:0]:0", which is no address either (newcomer s7
// F13): brackets are suggested only for a host that is an IPv6 address.
TEST(ParseHostPort, ExtraColonsInANonIpv6HostAskForOneColon) {
  for (const char* bad : {"127.0.0.1:0:0", "pool.svc:70:70", "a:b:7070"}) {
    auto r = ParseHostPort("--listen", bad, 0);
    ASSERT_FALSE(r.ok()) << bad;
    const std::string msg(r.status().message());
    EXPECT_EQ(msg.find("write ["), std::string::npos) << msg;
    EXPECT_NE(msg.find(absl::StrCat("--listen: '", bad,
                                    "' has more than one ':' outside brackets; want HOST:PORT "
                                    "with one ':' (an IPv6 address in brackets: [::1]:7070)")),
              std::string::npos)
        << msg;
  }
  // An IPv6 literal still gets its bracketed spelling, also a longer one.
  auto r = ParseHostPort("--pool", "fe80::1:2:7070", 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("write [fe80::1:2]:7070"), std::string::npos) << r.status();
}

// "[::1]" was told its brackets were unbalanced or empty (newcomer s8 N5): it lacks the port,
// like "127.0.0.1". Both the worker's --pool and the server's --listen use this parser.
TEST(ParseHostPort, BracketedIpv6WithoutAPortSaysThePortIsMissing) {
  for (const char* bad : {"[::1]", "[fe80::1]"}) {
    auto r = ParseHostPort("--pool", bad, 1);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(),
              absl::StrCat("--pool: '", bad, "' has no port (want ", bad, ":PORT)"));
  }
  auto v4 = ParseHostPort("--pool", "127.0.0.1", 1);
  ASSERT_FALSE(v4.ok());
  EXPECT_EQ(v4.status().message(), "--pool: '127.0.0.1' has no port (want HOST:PORT)");
  // Still brackets: an unclosed one, a ']' before the end that is not followed by ':'.
  for (const char* bad : {"[::1", "[::1]x", "[]"}) {
    auto r = ParseHostPort("--pool", bad, 1);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(std::string(r.status().message()).find("' has no port (want " + std::string(bad)),
              std::string::npos)
        << r.status();
  }
}

}  // namespace
}  // namespace kvpool
