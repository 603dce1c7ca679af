// CopyPool (copy_pool.h): worker threads for the client's per-byte work.
#include "copy_pool.h"

#include "stage_stamps.h"

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvpool::client {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Waiting for another thread of a job: pause a little, then yield the core (on an oversubscribed
// host the thread waited for may be queued behind this one; pure spinning made a 2-thread
// pipeline variant put 1 MiB at 0.4 GB/s on the 2-core VM).
class Backoff {
 public:
  void Pause() {
    if (++spins_ < 64) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }

 private:
  int spins_ = 0;
};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int DefaultCopyThreads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp<unsigned>(hw / 2, 1, 8));
}

CopyPool::CopyPool(int threads, std::chrono::microseconds spin)
    : spin_(spin), slots_(std::make_unique<Slot[]>(kSlots)) {
  const int participants = std::max(threads, 1);
  for (int i = 1; i < participants; ++i) {
    workers_.emplace_back([this, i, participants] { WorkerLoop(i, participants); });
  }
}

CopyPool::~CopyPool() {
  stop_.store(true, std::memory_order_release);
  Publish();
  for (auto& t : workers_) t.join();
}

bool CopyPool::TryRunSlot(uint64_t run, size_t s) {
  Slot& slot = slots_[s];
  uint64_t c = slot.claimed.load(std::memory_order_relaxed);
  if (c >= run || !slot.claimed.compare_exchange_strong(c, run, std::memory_order_acq_rel,
                                                        std::memory_order_relaxed)) {
    return false;
  }
  // Claimed in run `run`, which is therefore the current one (copy_pool.h): work_, n_ and
  // group_ are its, published before job_ (release) and seen through the caller's acquire of
  // job_.
  const size_t end = std::min(n_, (s + 1) * group_);
  KVPOOL_STAMP(kSlotBegin, uint32_t(s));
  for (size_t i = s * group_; i < end; ++i) (*work_)(i);
  KVPOOL_STAMP(kSlotEnd, uint32_t(s));
  slot.done.store(run, std::memory_order_release);
  return true;
}

void CopyPool::HoldAwake(std::chrono::microseconds cap) {
  if (workers_.empty() || cap.count() <= 0) return;
  const int64_t until = NowNs() + std::chrono::nanoseconds(cap).count();
  {
    // The cap of the holds standing now (a released hold's cap no longer counts).
    std::lock_guard<std::mutex> lock(hold_mu_);
    const int64_t cur = hold_until_ns_.load(std::memory_order_relaxed);
    hold_until_ns_.store(holds_.load(std::memory_order_relaxed) == 0 ? until : std::max(cur, until),
                         std::memory_order_relaxed);
    holds_.fetch_add(1);
  }
  if (sleepers_.load() > 0) Publish();
}

void CopyPool::ReleaseAwake() {
  if (workers_.empty()) return;
  // The usual spin after a job, counted from the end of the hold.
  const int64_t until = NowNs() + std::chrono::nanoseconds(spin_).count();
  int64_t cur = awake_until_ns_.load(std::memory_order_relaxed);
  while (cur < until &&
         !awake_until_ns_.compare_exchange_weak(cur, until, std::memory_order_relaxed)) {
  }
  std::lock_guard<std::mutex> lock(hold_mu_);
  if (holds_.fetch_sub(1) == 1) hold_until_ns_.store(0, std::memory_order_relaxed);
}

bool CopyPool::TryRunStreamTask(Stream& s) {
  size_t c = s.claimed_.load(std::memory_order_relaxed);
  for (;;) {
    // claimed_ <= published_ always (a task is claimed only below a published count seen), and
    // the acquire makes the owner's writes before that Submit visible to RunTask(c).
    if (c >= s.published_.load(std::memory_order_acquire)) return false;
    if (s.claimed_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                         std::memory_order_relaxed)) {
      break;
    }
  }
  KVPOOL_STAMP(kTaskBegin, uint32_t(c));
  s.RunTask(c);
  KVPOOL_STAMP(kTaskEnd, uint32_t(c));
  s.done_.fetch_add(1, std::memory_order_release);
  return true;
}

void CopyPool::RunStreamSlot(int k) {
  StreamSlot& slot = stream_slots_[k];
  if (slot.stream.load(std::memory_order_relaxed) == nullptr) return;
  // users is raised before the stream pointer is read and Drain clears the pointer before it
  // reads users (all seq_cst): either Drain sees this worker and waits for it, or this worker
  // reads null.
  slot.users.fetch_add(1);
  if (Stream* s = slot.stream.load(); s != nullptr) {
    uint64_t ran = 0;
    while (TryRunStreamTask(*s)) ++ran;
    if (ran != 0) stream_tasks_on_workers_.fetch_add(ran, std::memory_order_relaxed);
  }
  slot.users.fetch_sub(1);
}

void CopyPool::Submit(Stream& s, size_t n) {
  if (n <= s.published_.load(std::memory_order_relaxed)) return;
  if (s.slot_ < 0 && !workers_.empty()) {
    for (int k = 0; k < kStreamSlots; ++k) {
      Stream* expected = nullptr;
      if (stream_slots_[k].stream.compare_exchange_strong(expected, &s)) {
        s.slot_ = k;
        break;
      }
    }
  }
  s.published_.store(n, std::memory_order_release);
  if (s.slot_ >= 0) {
    Publish();
    return;
  }
  // No worker runs this stream (no workers, or every slot taken): run it here.
  while (TryRunStreamTask(s)) {
  }
}

void CopyPool::Drain(Stream& s) {
  const size_t n = s.published_.load(std::memory_order_relaxed);
  Backoff b;
  // The acquire load that sees n pairs with the release increments of every task (a chain of
  // RMWs): their writes are visible here.
  while (s.done_.load(std::memory_order_acquire) < n) {
    if (!TryRunStreamTask(s)) b.Pause();
  }
  if (s.slot_ >= 0) {
    StreamSlot& slot = stream_slots_[s.slot_];
    slot.stream.store(nullptr);
    while (slot.users.load() != 0) CpuRelax();
    s.slot_ = -1;
  }
}

void CopyPool::Publish() {
  generation_.fetch_add(1);
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lock(sleep_mu_);
    wake_.notify_all();
  }
}

void CopyPool::WorkerLoop(int id, int participants) {
  // generation_ is 0 when the pool is constructed: a worker that starts late still sees every
  // job published (or the stop) since then.
  uint32_t seen = 0;
  uint64_t scanned_run = 0;  // the last Run whose slots this worker has tried every one of
  for (;;) {
    // Wait for a new job: spin a little (the next layer of a put usually comes within
    // microseconds) or as long as a HoldAwake asks, then sleep.
    const int64_t spin_end = NowNs() + std::chrono::nanoseconds(spin_).count();
    // Whether this worker may sleep now: its own spin is over, ReleaseAwake's spin too, and
    // no HoldAwake stands (or the holds' cap has passed).
    auto may_sleep = [&] {
      const int64_t now = NowNs();
      return now >= spin_end && now >= awake_until_ns_.load(std::memory_order_relaxed) &&
             (holds_.load(std::memory_order_relaxed) <= 0 ||
              now >= hold_until_ns_.load(std::memory_order_relaxed));
    };
    uint32_t g = generation_.load(std::memory_order_acquire);
    for (int k = 0; g == seen; ++k) {
      if ((k & 63) == 63 && may_sleep()) {
        // Sleep. sleepers_ is raised before generation_ is re-read and Publish bumps
        // generation_ before reading sleepers_ (both seq_cst), so either this thread sees the
        // new job or Publish sees a sleeper and notifies under sleep_mu_.
        std::unique_lock<std::mutex> lock(sleep_mu_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
      } else {
        CpuRelax();
      }
      g = generation_.load(std::memory_order_acquire);
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    const uint64_t job = job_.load(std::memory_order_acquire);
    const uint64_t run = job >> kSlotBits;
    if (run != scanned_run) {
      // A Run's slots once (a later generation bump may be a stream's or a wake-up: this run's
      // slots that were claimed stay claimed).
      const size_t num_slots = job & ((uint64_t{1} << kSlotBits) - 1);
      // Own slots first, then whatever is left.
      for (size_t s = id; s < num_slots; s += size_t(participants)) TryRunSlot(run, s);
      for (size_t s = 0; s < num_slots; ++s) TryRunSlot(run, s);
      scanned_run = run;
    }
    for (int k = 0; k < kStreamSlots; ++k) RunStreamSlot(k);
  }
}

void CopyPool::Run(size_t n, absl::FunctionRef<void(size_t)> work,
                   absl::FunctionRef<void(size_t)> ordered) {
  RunImpl(n, work, &ordered);
}

void CopyPool::Run(size_t n, absl::FunctionRef<void(size_t)> work) { RunImpl(n, work, nullptr); }

void CopyPool::RunImpl(size_t n, absl::FunctionRef<void(size_t)> work,
                       const absl::FunctionRef<void(size_t)>* ordered) {
  std::unique_lock<std::mutex> lock(run_mu_, std::defer_lock);
  const bool parallel = n > 1 && !workers_.empty();
  if (parallel && !lock.try_lock()) busy_fallbacks_.fetch_add(1, std::memory_order_relaxed);
  if (!lock.owns_lock()) {
    for (size_t i = 0; i < n; ++i) {
      work(i);
      if (ordered != nullptr) (*ordered)(i);
    }
    return;
  }
  parallel_runs_.fetch_add(1, std::memory_order_relaxed);
  KVPOOL_STAMP_SCOPE(kRunEnter, kRunDone, uint32_t(n));
  // No worker runs anything of the previous job any more (every slot of it was done before its
  // Run returned), so these may change.
  group_ = (n + kSlots - 1) / kSlots;
  const size_t num_slots = (n + group_ - 1) / group_;
  n_ = n;
  work_ = &work;
  const uint64_t run = ++run_;
  job_.store(run << kSlotBits | num_slots, std::memory_order_release);
  Publish();
  KVPOOL_STAMP(kRunPublished, uint32_t(num_slots));
  const size_t participants = workers_.size() + 1;
  size_t own = 0;            // the caller's next own slot: 0, P, 2P, ...
  size_t steal = num_slots;  // slots >= steal were tried (claimed slots stay claimed)
  for (size_t s = 0; s < num_slots; ++s) {
    Backoff b;
    while (slots_[s].done.load(std::memory_order_acquire) != run) {
      // Slot s itself when nobody took it yet, else one of the caller's own, else any other
      // (from the last: the workers scan upwards), else wait.
      if (TryRunSlot(run, s)) break;
      bool ran = false;
      for (; own < num_slots && !ran; own += participants) ran = TryRunSlot(run, own);
      while (!ran && steal > s + 1) ran = TryRunSlot(run, --steal);
      if (!ran) b.Pause();
    }
    if (ordered != nullptr) {
      const size_t end = std::min(n, (s + 1) * group_);
      for (size_t i = s * group_; i < end; ++i) (*ordered)(i);
    }
  }
  // Every slot is done: no worker runs anything of this job, so work_ may dangle now.
  work_ = nullptr;
}

}  // namespace kvpool::client
