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
//   struct Layers : CopyPool::Stream { void RunTask(size_t i) override { pack piece i; } };
//   Layers s;  // background work (an asynchronous put): tasks run while the owner goes on
//   pool.Submit(s, n1); ... pool.Submit(s, n2);  // publish tasks [0, n1), then [n1, n2)
//   pool.Drain(s);                               // the owner joins: every task has run
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

  // Holds the workers awake (spinning) from now until the matching ReleaseAwake, at most `cap`
  // from now, and wakes the sleeping ones: for a caller about to block in an RPC that is
  // usually followed at once by parallel work (BeginPut before an asynchronous put's layers,
  // Acquire before a fetch), so that the workers' wake-up overlaps the RPC and costs their cores
  // only for as long as the RPC takes (session 6's fixed window spent them for the whole window
  // whatever the RPC took): a sleeping worker needs tens of microseconds to run again, and the
  // first Run after a pause would otherwise do most of its work on the calling thread (and pay
  // for waking them: on the H200 host a Run of 8 empty tasks took 8 us with sleeping workers
  // against 2.5 with spinning ones). Holds from several threads nest (the workers stay up while any
  // is held). Thread-safe; nothing when there are no workers or cap <= 0.
  void HoldAwake(std::chrono::microseconds cap);
  // Ends one HoldAwake (every HoldAwake needs exactly one, on any thread); the workers then
  // spin for their usual `spin` (the work the RPC announced normally comes within it), then
  // sleep unless another hold stands.
  void ReleaseAwake();
  // True when no worker is asleep (each is running a task or spinning), so a Run now starts
  // on every thread at once instead of paying for their wake-up. A hint: a worker may fall
  // asleep right after. For the fetch floor that applies only with awake workers.
  bool awake() const { return !workers_.empty() && sleepers_.load(std::memory_order_relaxed) == 0; }

  // ---- background streams ----
  // A Stream is a list of tasks 0, 1, 2, ... that grows while it is used (Submit) and that the
  // workers run in the background, claiming them in index order, while the stream's owner
  // thread does other things; the owner joins them with Drain. The owner subclasses it and
  // implements RunTask(i): called once for every published index, on a worker or on the owner
  // (inside Submit or Drain), concurrently for different indices; whatever the owner wrote
  // before the Submit that published i is visible to RunTask(i), and whatever RunTask(i) wrote
  // is visible to the owner once Drain returns. One owner thread at a time per stream. At most
  // kStreamSlots streams are run by the workers at once; a Submit that finds them all taken (or a
  // pool without workers) runs the tasks it publishes on the owner before it returns (the same
  // results).
  class Stream {
   public:
    Stream() = default;
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    // A stream must be drained (or never have been submitted) when it is destroyed.
    virtual ~Stream() = default;
    size_t published() const { return published_.load(std::memory_order_relaxed); }

   protected:
    virtual void RunTask(size_t i) = 0;

   private:
    friend class CopyPool;
    alignas(64) std::atomic<size_t> claimed_{0};  // tasks claimed (<= published_)
    alignas(64) std::atomic<size_t> done_{0};     // tasks finished
    std::atomic<size_t> published_{0};            // written by the owner only
    int slot_ = -1;                               // the stream slot it holds (owner only)
  };
  static constexpr int kStreamSlots = 4;
  // Publishes the tasks [s.published(), n) of `s` (n >= s.published()) and wakes the workers.
  // Attaches the stream to a free slot on its first Submit (or a later one, when the slots were
  // taken before). Owner only.
  void Submit(Stream& s, size_t n);
  // Runs the unclaimed tasks of `s` on the owner, waits until every published task is done,
  // and detaches the stream (no worker touches it after this returns). Owner only. The stream
  // can be submitted to again afterwards.
  void Drain(Stream& s);

  // Jobs that used the workers / ran inline because the workers were busy (for tests).
  uint64_t parallel_runs() const { return parallel_runs_.load(std::memory_order_relaxed); }
  uint64_t busy_fallbacks() const { return busy_fallbacks_.load(std::memory_order_relaxed); }
  // Workers asleep on the condition variable right now (for tests).
  int sleeping_workers() const { return sleepers_.load(); }
  // Stream tasks run by worker threads (not by the owner) since the pool started (for tests).
  uint64_t stream_tasks_on_workers() const {
    return stream_tasks_on_workers_.load(std::memory_order_relaxed);
  }

 private:
  // A job's n indices are cut into num_slots <= kSlots slots of `group` consecutive indices
  // (the last may be shorter). Participant p (the caller is 0, worker w is w) first takes the
  // slots p, p + P, p + 2P, ... (P = threads()), each on its own cache line, so in the common
  // case no two threads touch the same line while claiming; then it takes any slot still
  // unclaimed (a worker that is late or asleep never holds the job up). A slot is claimed by a
  // CAS of its `claimed` field from a run number below the job's to the job's run number.
  // Before the first version claimed every index with one CAS of a shared word: with 8 threads
  // on the H200 host a Run of 8 empty tasks took 2.8 us and of 32 tasks 7.1 us (that line
  // bounced between all of them); docs/TRANSPORT.md "Session 6".
  //
  // Why a worker with a stale job word cannot run a slot of the next job: it only claims slots
  // below the num_slots of its word, and only from claimed < its run r. A slot of run r that
  // is still below r was not claimed in run r, so run r has not finished (Run returns only
  // after every slot of it was claimed and done) and no later run has started: the claim is a
  // claim in run r, whose work_/n_/group_ are still published.
  static constexpr size_t kSlots = 256;
  static constexpr int kSlotBits = 16;  // job_ = run << kSlotBits | num_slots
  struct alignas(64) Slot {
    std::atomic<uint64_t> claimed{0};  // the last run that claimed it
    std::atomic<uint64_t> done{0};     // the last run in which its work finished
  };

  void RunImpl(size_t n, absl::FunctionRef<void(size_t)> work,
               const absl::FunctionRef<void(size_t)>* ordered);
  // Claims slot `s` for run `run` and runs its indices; false when it was claimed already.
  bool TryRunSlot(uint64_t run, size_t s);
  void WorkerLoop(int id, int participants);
  // Claims and runs one published, unclaimed task of `s`; false when there is none.
  static bool TryRunStreamTask(Stream& s);
  // A worker's turn at stream slot k: runs the tasks of the stream attached there, if any.
  void RunStreamSlot(int k);
  // Announces a new job (or stop) to the workers: bumps generation_, wakes sleepers.
  void Publish();

  std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;                    // held by the Run that owns the workers
  std::unique_ptr<Slot[]> slots_;        // kSlots, for the lifetime of the pool
  std::atomic<uint64_t> job_{0};         // the current (or last) job: run << kSlotBits | num_slots
  std::atomic<uint32_t> generation_{0};  // bumped per job and at stop (Publish)
  std::mutex sleep_mu_;                  // workers sleep on wake_ after spinning
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  // Workers do not sleep before this steady_clock time (nanoseconds since its epoch):
  // ReleaseAwake's spin after a hold.
  std::atomic<int64_t> awake_until_ns_{0};
  // HoldAwake: holds standing now, and the time the longest of them is capped at (changed
  // under hold_mu_; the workers only read them).
  std::mutex hold_mu_;
  std::atomic<int> holds_{0};
  std::atomic<int64_t> hold_until_ns_{0};
  // Streams the workers run (Submit attaches, Drain detaches). `users` counts the workers
  // inside RunStreamSlot(k), so that Drain can wait until none still looks at the stream.
  struct alignas(64) StreamSlot {
    std::atomic<Stream*> stream{nullptr};
    std::atomic<int> users{0};
  };
  StreamSlot stream_slots_[kStreamSlots];
  std::atomic<uint64_t> stream_tasks_on_workers_{0};
  // The current job; written by the owning Run before job_ is published (release), read by a
  // worker only after it claimed a slot of that run, and unchanged until every slot is done.
  const absl::FunctionRef<void(size_t)>* work_ = nullptr;
  size_t n_ = 0;      // indices of the current job
  size_t group_ = 1;  // indices per slot
  uint64_t run_ = 0;  // run number of the current (or last) parallel Run, from 1
  std::atomic<uint64_t> parallel_runs_{0};
  std::atomic<uint64_t> busy_fallbacks_{0};
};

// The default number of participants for ClientOptions::copy_threads = 0: half the hardware
// threads, at least 1 and at most 8 (1 on a 2-core machine: no worker threads).
int DefaultCopyThreads();

}  // namespace kvpool::client
