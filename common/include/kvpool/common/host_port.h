// kvpool/common/host_port.h — one parser for the HOST:PORT addresses binaries take on the
// command line (kvpool-server --listen, kvpool-worker --pool), so both refuse the same malformed
// addresses with the same words.
//
//   absl::StatusOr<kvpool::HostPort> hp = kvpool::ParseHostPort("--pool", "10.0.0.5:7070", 1);
//
// Thread-safe (pure function).
#pragma once

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace kvpool {

struct HostPort {
  std::string host;  // without IPv6 brackets: "::1" for "[::1]:7070"
  int port = 0;      // min_port..65535
};

// Parses `address` as HOST:PORT, where HOST is a name, an IPv4 address or a bracketed IPv6
// address ("[::1]:7070") and PORT a decimal integer in min_port..65535 (min_port 0 lets a server
// ask for any free port; clients pass 1). Does not resolve the name.
// Errors: INVALID_ARGUMENT whose message starts with `field` ("--pool: ...") and quotes the
// address — no port ("'[::1]' has no port (want [::1]:PORT)" for a bracketed host), empty
// host, a port that is not a decimal integer in range, an IPv6 address without brackets
// ("::1:7070": the message says "write [::1]:7070"), another host with a ':' ("127.0.0.1:0:0":
// "want HOST:PORT with one ':'"), unbalanced brackets.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view field, absl::string_view address,
                                       int min_port);

// HOST:PORT as ParseHostPort reads it back: a host holding a ':' (an IPv6 address, as
// HostPort::host keeps it) in brackets ("[::1]:7070"), any other host as it is.
std::string FormatHostPort(absl::string_view host, int port);

}  // namespace kvpool
