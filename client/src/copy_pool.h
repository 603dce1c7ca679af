// client/src/copy_pool.h — a small pool of worker threads for the client's per-byte work
// (packing a put layer with its NaN/Inf scan, copying a fetched form, hashing the checksum
// chunks it packed or copied), with an ordered completion hook on the calling thread for the
// work that must stay sequential (the streamed digest of a checksum chunk that straddles two
// pieces of work).
//
//   CopyPool pool(4);  // the caller + 3 worker threads
//   pool.Run(n, [&](size_t i) { copy + hash chunk i; });   // any thread, any order
//   pool.Run(n, [&](size_t i) { pack piece i; },           // any thread, any order
//               [&](size_t i) { stream piece i; });        // the caller, i = 0, 1, ..., n-1
//
// Internal to kvpool_client. Worker threads run only the `work` callbacks: plain memory work,
// never a UCX or gRPC call (the transport's one-owner-thread rule is untouched).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace kvpool::client {

class CopyPool {
 public:
  // `threads` = participants including the caller (values < 1 are treated as 1). threads - 1
  // worker threads are started; they spin for `spin` after each job (so the next layer of a
  // put finds them awake), then sleep on a condition variable.
  explicit CopyPool(int threads, std::chrono::microseconds spin = std::chrono::microseconds(50));
  ~CopyPool();  // stops and joins the workers (no Run may be in progress)
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs work(i) for every i in [0, n), each exactly once, on the caller and the workers; and,
  // when `ordered` is given, ordered(i) on the caller in order i = 0..n-1, each after work(i)
  // has finished (its writes are visible). Returns when everything has run. While the caller
  // waits for work(i) it runs unclaimed work itself. Thread-safe: when another thread's Run
  // holds the workers (or n <= 1, or there are no workers), the caller runs everything inline
  // as work(0), ordered(0), work(1), ordered(1), ... — the same results, on one thread.
  // work and ordered must not throw.
  void Run(size_t n, absl::FunctionRef<void(size_t)> work, absl::FunctionRef<void(size_t)> ordered);
  void Run(size_t n, absl::FunctionRef<void(size_t)> work);

  // Jobs that used the workers / ran inline because the workers were busy (for tests).
  uint64_t parallel_runs() const { return parallel_runs_.load(std::memory_order_relaxed); }
  uint64_t busy_fallbacks() const { return busy_fallbacks_.load(std::memory_order_relaxed); }

 private:
  // claim_ packs (job id: 16 bits | n: 24 bits | next index: 24 bits); a worker claims index i
  // of job j with one CAS of the whole word, so it can never take an index of a job whose
  // fields it has not seen (a stale word fails the CAS).
  static constexpr int kIndexBits = 24;
  static constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
  static constexpr size_t kMaxParallel = kIndexMask;  // larger jobs run inline

  void RunImpl(size_t n, absl::FunctionRef<void(size_t)> work,
               const absl::FunctionRef<void(size_t)>* ordered);
  // Claims the next index of the job whose word is `job` (job id and n); false when none left.
  bool Claim(uint64_t job, size_t* index);
  void WorkerLoop();
  // Announces a new job (or stop) to the workers: bumps generation_, wakes sleepers.
  void Publish();

  std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // held by the Run that owns the workers
  std::atomic<uint64_t> claim_{0};
  std::atomic<uint32_t> generation_{0};  // bumped per job and at stop (Publish)
  std::mutex sleep_mu_;                  // workers sleep on wake_ after spinning
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  // The current job; written by the owning Run before claim_ is published (release), read by
  // a worker only after a successful claim (acquire), and alive until every index is done.
  const absl::FunctionRef<void(size_t)>* work_ = nullptr;
  std::unique_ptr<std::atomic<uint8_t>[]> done_;
  size_t done_capacity_ = 0;
  uint16_t job_id_ = 0;
  std::atomic<uint64_t> parallel_runs_{0};
  std::atomic<uint64_t> busy_fallbacks_{0};
};

// The default number of participants for ClientOptions::copy_threads = 0: half the hardware
// threads, at least 1 and at most 8 (1 on a 2-core machine: no worker threads).
int DefaultCopyThreads();

}  // namespace kvpool::client
