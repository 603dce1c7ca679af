// CopyPool (copy_pool.h): worker threads for the client's per-byte work.
#include "copy_pool.h"

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

}  // namespace

int DefaultCopyThreads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp<unsigned>(hw / 2, 1, 8));
}

CopyPool::CopyPool(int threads, std::chrono::microseconds spin) : spin_(spin) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

CopyPool::~CopyPool() {
  stop_.store(true, std::memory_order_release);
  Publish();
  for (auto& t : workers_) t.join();
}

bool CopyPool::Claim(uint64_t job, size_t* index) {
  uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    if ((c & ~kIndexMask) != job) return false;  // another job (or none)
    const uint64_t i = c & kIndexMask;
    const uint64_t n = (c >> kIndexBits) & kIndexMask;
    if (i >= n) return false;
    if (claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                     std::memory_order_acquire)) {
      *index = static_cast<size_t>(i);
      return true;
    }
  }
}

void CopyPool::Publish() {
  generation_.fetch_add(1);
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lock(sleep_mu_);
    wake_.notify_all();
  }
}

void CopyPool::WorkerLoop() {
  // generation_ is 0 when the pool is constructed: a worker that starts late still sees every
  // job published (or the stop) since then.
  uint32_t seen = 0;
  for (;;) {
    // Wait for a new job: spin a little (the next layer of a put usually comes within
    // microseconds), then sleep.
    const auto until = std::chrono::steady_clock::now() + spin_;
    uint32_t g = generation_.load(std::memory_order_acquire);
    for (int k = 0; g == seen; ++k) {
      if ((k & 63) == 63 && std::chrono::steady_clock::now() >= until) {
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
    const uint64_t c = claim_.load(std::memory_order_acquire);
    const uint64_t job = c & ~kIndexMask;
    size_t i;
    while (Claim(job, &i)) {
      // The claim keeps the job alive: its Run waits for done_[i].
      (*work_)(i);
      done_[i].store(1, std::memory_order_release);
    }
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
  const bool parallel = n > 1 && n <= kMaxParallel && !workers_.empty();
  if (parallel && !lock.try_lock()) busy_fallbacks_.fetch_add(1, std::memory_order_relaxed);
  if (!lock.owns_lock()) {
    for (size_t i = 0; i < n; ++i) {
      work(i);
      if (ordered != nullptr) (*ordered)(i);
    }
    return;
  }
  parallel_runs_.fetch_add(1, std::memory_order_relaxed);
  if (done_capacity_ < n) {
    // No worker can be touching done_: every index of the previous job was done before its
    // Run returned, and a worker touches done_ only for an index it claimed.
    done_capacity_ = std::max<size_t>(n, 64);
    done_ = std::make_unique<std::atomic<uint8_t>[]>(done_capacity_);
  }
  for (size_t i = 0; i < n; ++i) done_[i].store(0, std::memory_order_relaxed);
  work_ = &work;
  job_id_ = static_cast<uint16_t>(job_id_ + 1);
  const uint64_t job = (uint64_t{job_id_} << (2 * kIndexBits)) | (uint64_t{n} << kIndexBits);
  claim_.store(job, std::memory_order_release);  // publishes work_ and done_
  Publish();
  for (size_t h = 0; h < n; ++h) {
    Backoff b;
    while (done_[h].load(std::memory_order_acquire) == 0) {
      size_t i;
      if (Claim(job, &i)) {
        work(i);
        done_[i].store(1, std::memory_order_release);
      } else {
        b.Pause();
      }
    }
    if (ordered != nullptr) (*ordered)(h);
  }
  // Every index is done: no worker holds a claim on this job, so work_ may dangle now.
  work_ = nullptr;
}

}  // namespace kvpool::client
