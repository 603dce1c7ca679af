// kvpool/common/status_text.h — one-line text of an absl::Status for logs and reports
// (kvpool-worker, pool_bench): the code once, then the message (errors relayed from gRPC or from a
// wrapped status often repeat the code name in the message: "UNAVAILABLE: UNAVAILABLE: ...",
// "CANCELLED: CANCELLED").
#pragma once

#include <string>

#include "absl/status/status.h"

namespace kvpool {

// "CODE: message" with any leading repetitions of "CODE: " (or a message equal to the code
// name) removed from the message; "CODE" alone when nothing else remains; "OK" for OkStatus.
// Payloads are not printed.
// Pure function; thread-safe. No errors.
std::string StatusText(const absl::Status& status);

}  // namespace kvpool
