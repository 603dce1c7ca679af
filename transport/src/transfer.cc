// Transfer bookkeeping shared by every Transport implementation.
#include <sched.h>

#include <limits>
#include <utility>

#include "kvpool/transport/transport.h"

#include "absl/strings/str_cat.h"

namespace kvpool::transport {

Transfer::Transfer(TransferRequest request)
    : request_(std::move(request)),
      item_status_(request_.ops.size(), absl::CancelledError("not attempted")) {}

absl::Status Transfer::status() const {
  switch (state()) {
    case TransferState::kDone:
      return absl::OkStatus();
    case TransferState::kFailed: {
      std::lock_guard<std::mutex> lock(mu_);
      return first_error_;
    }
    default:
      return absl::UnknownError("in progress");
  }
}

std::vector<absl::Status> Transfer::item_status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return item_status_;
}

absl::Status Transfer::Wait(absl::Time deadline) const {
  if (state() == TransferState::kPrepared) {
    return absl::FailedPreconditionError("transfer was not posted");
  }
  auto finished = [this] {
    TransferState s = state_.load(std::memory_order_acquire);
    return s == TransferState::kDone || s == TransferState::kFailed;
  };
  // Most transfers finish within microseconds: poll (yielding the core, which the owner thread
  // completing them may need) before sleeping on the condition variable, whose wake-up costs
  // more than a short transfer.
  for (int spin = 0; spin < 64 && !finished(); ++spin) sched_yield();
  std::unique_lock<std::mutex> lock(mu_);
  while (!finished()) {
    if (deadline == absl::InfiniteFuture()) {
      cv_.wait(lock);
    } else {
      absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError("transfer still in progress at its deadline");
      }
      cv_.wait_for(lock, absl::ToChronoNanoseconds(left));
    }
  }
  if (state_.load(std::memory_order_acquire) == TransferState::kDone) return absl::OkStatus();
  return first_error_;
}

bool Transfer::BeginPost() {
  TransferState expected = TransferState::kPrepared;
  return state_.compare_exchange_strong(expected, TransferState::kInProgress,
                                        std::memory_order_acq_rel);
}

void Transfer::MarkPosted(size_t pending) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_ = pending;
  if (pending == 0) {
    // Nothing was handed to the network (every op skipped): finish now.
    if (first_error_.ok()) first_error_ = absl::CancelledError("transfer cancelled");
    state_.store(TransferState::kFailed, std::memory_order_release);
    cv_.notify_all();
  }
}

void Transfer::CompleteOne(size_t index, absl::Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (index != std::numeric_limits<size_t>::max() && index < item_status_.size()) {
    item_status_[index] = status;
  } else if (!status.ok()) {
    // A failed flush fails every op that had reported local completion.
    for (auto& s : item_status_) {
      if (s.ok()) s = status;
    }
  }
  if (!status.ok() && first_error_.ok()) first_error_ = std::move(status);
  if (pending_ > 0) --pending_;
  if (pending_ == 0) {
    if (first_error_.ok() && cancelled()) {
      for (const auto& s : item_status_) {
        if (!s.ok()) {
          first_error_ = absl::CancelledError("transfer cancelled");
          break;
        }
      }
    }
    state_.store(first_error_.ok() ? TransferState::kDone : TransferState::kFailed,
                 std::memory_order_release);
    cv_.notify_all();
  }
}

std::vector<TransferOp> CoalesceOps(const std::vector<TransferOp>& ops,
                                    std::vector<size_t>* carrier) {
  std::vector<TransferOp> out;
  if (carrier != nullptr) carrier->clear();
  for (const TransferOp& op : ops) {
    if (!out.empty()) {
      TransferOp& last = out.back();
      if (last.local_offset + last.length == op.local_offset &&
          last.remote_addr + last.length == op.remote_addr) {
        last.length += op.length;
        if (carrier != nullptr) carrier->push_back(out.size() - 1);
        continue;
      }
    }
    out.push_back(op);
    if (carrier != nullptr) carrier->push_back(out.size() - 1);
  }
  return out;
}

absl::StatusOr<std::shared_ptr<RemoteMapping>> Transport::MapRemote(EndpointId, RemoteKeyId,
                                                                    uint64_t, uint64_t) {
  return absl::UnimplementedError(absl::StrCat(Name(), ": peers' memory cannot be mapped"));
}

absl::Status Transport::Execute(TransferRequest request, absl::Time deadline) {
  auto prepared = Prepare(std::move(request));
  if (!prepared.ok()) return prepared.status();
  std::shared_ptr<Transfer> transfer = *std::move(prepared);
  absl::Status posted = Post(transfer);
  if (!posted.ok()) return posted;
  absl::Status waited = transfer->Wait(deadline);
  if (absl::IsDeadlineExceeded(waited)) transfer->Cancel();
  return waited;
}

}  // namespace kvpool::transport
