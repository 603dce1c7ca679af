// kvpool/common/status.h — status helpers on top of absl::Status / absl::StatusOr.
//
// Debian's Abseil (20220623) has no status macros, so kvpool defines its own:
//
//   absl::StatusOr<Header> ReadHeader(File& f) {
//     KVPOOL_RETURN_IF_ERROR(f.Seek(0));
//     KVPOOL_ASSIGN_OR_RETURN(auto bytes, f.Read(8));
//     ...
//   }
//
// Canonical codes have fixed meanings across the project (STYLE.md rule 2):
//   NOT_FOUND absent key, RESOURCE_EXHAUSTED pool full, UNAVAILABLE peer down (retryable),
//   DEADLINE_EXCEEDED, FAILED_PRECONDITION incompatible layout, DATA_LOSS checksum mismatch,
//   INVALID_ARGUMENT malformed input (the message names the field).
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define KVPOOL_STATUS_CONCAT_INNER_(a, b) a##b
#define KVPOOL_STATUS_CONCAT_(a, b) KVPOOL_STATUS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define KVPOOL_RETURN_IF_ERROR(expr)                         \
  do {                                                       \
    ::absl::Status kvpool_status_ = (expr);                  \
    if (!kvpool_status_.ok()) return kvpool_status_;         \
  } while (0)

// `lhs` = value of the StatusOr `rexpr`, or returns its status from the enclosing function.
#define KVPOOL_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVPOOL_ASSIGN_OR_RETURN_IMPL_(KVPOOL_STATUS_CONCAT_(kvpool_statusor_, __LINE__), lhs, rexpr)

#define KVPOOL_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()

namespace kvpool {

// Prefixes the message of a non-OK status with `context` ("context: message"), keeping the code.
inline absl::Status Annotate(const absl::Status& s, std::string_view context) {
  if (s.ok()) return s;
  // Debian's Abseil has its own string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0), so a
  // std::string_view must be converted before it meets absl::StrCat.
  return absl::Status(s.code(), absl::StrCat(absl::string_view(context.data(), context.size()),
                                             ": ", s.message()));
}

}  // namespace kvpool
