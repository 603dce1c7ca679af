// Internal: validation shared by the Transport implementations (Prepare's checks).
#pragma once

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvpool/transport/transport.h"

namespace kvpool::transport::internal {

// Checks the parts of a request that need no transport state: local region, op count, and
// each op's length and local bounds. Errors: INVALID_ARGUMENT naming the field.
inline absl::Status ValidateRequestShape(const TransferRequest& r) {
  if (r.local == nullptr) return absl::InvalidArgumentError("local: region is null");
  if (r.ops.empty()) return absl::InvalidArgumentError("ops: empty");
  if (r.ops.size() > kMaxOpsPerTransfer) {
    return absl::InvalidArgumentError(
        absl::StrCat("ops: ", r.ops.size(), " ops exceed the limit ", kMaxOpsPerTransfer));
  }
  const uint64_t size = r.local->size();
  for (size_t i = 0; i < r.ops.size(); ++i) {
    const TransferOp& op = r.ops[i];
    if (op.length == 0) {
      return absl::InvalidArgumentError(absl::StrCat("ops[", i, "].length: zero"));
    }
    if (op.local_offset > size || op.length > size - op.local_offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("ops[", i, "].local_offset: [", op.local_offset, ", +", op.length,
                       ") is outside the local region of ", size, " bytes"));
    }
    if (op.remote_addr == 0) {
      return absl::InvalidArgumentError(absl::StrCat("ops[", i, "].remote_addr: zero"));
    }
    if (op.remote_addr + op.length < op.remote_addr) {
      return absl::InvalidArgumentError(absl::StrCat("ops[", i, "].remote_addr: wraps"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool::transport::internal
