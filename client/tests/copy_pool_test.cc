// copy_pool_test — the client's CopyPool (client/src/copy_pool.h): every index runs exactly
// once, the ordered hook runs on the caller in index order after its work, concurrent callers
// each get complete results (one of them inline when the workers are taken), workers really
// share a job, and the one-thread pool interleaves work and hook on the caller; background
// streams (Submit / Drain) run every task once, on the workers while the owner goes on,
// several at once and inline when every slot is taken; HoldAwake keeps the workers up until
// ReleaseAwake (bounded by its cap).
#include "copy_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace kvpool::client {
namespace {

TEST(CopyPool, EveryIndexOnceAndOrderedHookInOrderAfterItsWork) {
  CopyPool pool(4);
  ASSERT_EQ(pool.threads(), 4);
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{7}, size_t{64}, size_t{1000}}) {
    for (int rep = 0; rep < 50; ++rep) {
      std::vector<std::atomic<int>> runs(n);
      std::vector<uint64_t> value(n, 0);
      std::vector<size_t> order;
      const std::thread::id caller = std::this_thread::get_id();
      bool hook_off_caller = false, hook_saw_stale = false;
      pool.Run(
          n,
          [&](size_t i) {
            runs[i].fetch_add(1);
            value[i] = i * 2654435761u + 1;  // written by whichever thread ran it
          },
          [&](size_t i) {
            hook_off_caller |= std::this_thread::get_id() != caller;
            hook_saw_stale |= value[i] != i * 2654435761u + 1;
            order.push_back(i);
          });
      ASSERT_FALSE(hook_off_caller) << "n " << n;
      ASSERT_FALSE(hook_saw_stale) << "n " << n;
      ASSERT_EQ(order.size(), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(runs[i].load(), 1) << "n " << n << " index " << i;
        ASSERT_EQ(order[i], i);
      }
    }
  }
}

TEST(CopyPool, WorkersShareAJob) {
  CopyPool pool(3);
  std::mutex mu;
  std::set<std::thread::id> ids;
  // 64 tasks of 2 ms each: the workers wake long before the caller could run them all.
  pool.Run(64, [&](size_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_GT(ids.size(), 1u);
  EXPECT_EQ(pool.parallel_runs(), 1u);
}

TEST(CopyPool, ConcurrentCallersAllComplete) {
  CopyPool pool(4);
  constexpr int kCallers = 6, kJobs = 200;
  std::atomic<int> bad{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int j = 0; j < kJobs; ++j) {
        const size_t n = 1 + (c * 31 + j * 7) % 97;
        std::vector<std::atomic<int>> runs(n);
        size_t next = 0;
        pool.Run(
            n, [&](size_t i) { runs[i].fetch_add(1); },
            [&](size_t i) {
              if (i != next++ || runs[i].load() != 1) ++bad;
            });
        if (next != n) ++bad;
        for (auto& r : runs) bad += r.load() != 1;
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(bad.load(), 0);
  // Every job ran, on the workers or inline (n = 1 runs inline without counting).
  EXPECT_LE(pool.parallel_runs() + pool.busy_fallbacks(), uint64_t{kCallers} * kJobs);
  EXPECT_GT(pool.parallel_runs(), 0u);
}

// A stream whose task i records which thread ran it and sleeps `sleep` (so that workers get a
// share while the owner is elsewhere).
class RecordingStream : public CopyPool::Stream {
 public:
  explicit RecordingStream(size_t capacity, std::chrono::microseconds sleep = {})
      : runs_(capacity), values_(capacity, 0), sleep_(sleep) {}
  std::vector<std::atomic<int>> runs_;
  std::vector<uint64_t> values_;
  std::mutex mu_;
  std::set<std::thread::id> threads_;

 private:
  void RunTask(size_t i) override {
    if (sleep_.count() > 0) std::this_thread::sleep_for(sleep_);
    runs_[i].fetch_add(1);
    values_[i] = i * 0x9E3779B97F4A7C15ull + 7;  // plain write: visible after Drain
    std::lock_guard<std::mutex> lock(mu_);
    threads_.insert(std::this_thread::get_id());
  }
  std::chrono::microseconds sleep_;
};

TEST(CopyPool, StreamRunsEveryTaskOnceAndDrainSeesTheirWrites) {
  CopyPool pool(4);
  for (int rep = 0; rep < 200; ++rep) {
    RecordingStream s(64);
    size_t n = 0;
    for (size_t step : {size_t{1}, size_t{7}, size_t{0}, size_t{20}, size_t{36}}) {
      n += step;
      pool.Submit(s, n);
      ASSERT_EQ(s.published(), n);
    }
    pool.Drain(s);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(s.runs_[i].load(), 1) << "rep " << rep << " task " << i;
      ASSERT_EQ(s.values_[i], i * 0x9E3779B97F4A7C15ull + 7) << "rep " << rep << " task " << i;
    }
  }
}

TEST(CopyPool, StreamTasksRunOnTheWorkersWhileTheOwnerGoesOn) {
  CopyPool pool(3);
  RecordingStream s(32, std::chrono::milliseconds(1));
  const auto t0 = std::chrono::steady_clock::now();
  pool.Submit(s, 32);  // 32 ms of tasks
  const auto submitted = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(submitted, std::chrono::milliseconds(16)) << "Submit ran the tasks itself";
  // The owner does something else; the workers run tasks meanwhile.
  for (int i = 0; i < 10000 && pool.stream_tasks_on_workers() < 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_GE(pool.stream_tasks_on_workers(), 4u);
  pool.Drain(s);
  for (auto& r : s.runs_) EXPECT_EQ(r.load(), 1);
  EXPECT_GT(s.threads_.size(), 1u);
}

// More streams than slots: the extra ones run inline in Submit; all complete, with a sync Run
// on another thread at the same time.
TEST(CopyPool, MoreStreamsThanSlotsAndConcurrentRunsAllComplete) {
  CopyPool pool(4);
  constexpr int kOwners = CopyPool::kStreamSlots + 2;
  std::atomic<int> bad{0};
  std::vector<std::thread> owners;
  for (int o = 0; o < kOwners; ++o) {
    owners.emplace_back([&, o] {
      for (int rep = 0; rep < 100; ++rep) {
        RecordingStream s(40);
        for (size_t n = 5; n <= 40; n += 5) pool.Submit(s, n);
        pool.Drain(s);
        for (auto& r : s.runs_) bad += r.load() != 1;
        (void)o;
      }
    });
  }
  std::thread runner([&] {
    for (int j = 0; j < 300; ++j) {
      std::vector<std::atomic<int>> runs(33);
      pool.Run(runs.size(), [&](size_t i) { runs[i].fetch_add(1); });
      for (auto& r : runs) bad += r.load() != 1;
    }
  });
  for (auto& t : owners) t.join();
  runner.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(CopyPool, AStreamWithoutWorkersRunsInSubmit) {
  CopyPool pool(1);
  RecordingStream s(10);
  pool.Submit(s, 10);
  for (auto& r : s.runs_) EXPECT_EQ(r.load(), 1);  // before any Drain
  pool.Drain(s);
  EXPECT_EQ(pool.stream_tasks_on_workers(), 0u);
}

// HoldAwake wakes the workers and keeps them up until ReleaseAwake (then they sleep after
// their spin); a hold that is never released ends at its cap.
TEST(CopyPool, HoldAwakeKeepsTheWorkersUpUntilReleasedOrItsCap) {
  CopyPool pool(3, std::chrono::microseconds(50));
  auto wait_for = [&](int sleeping) {
    for (int i = 0; i < 10000 && pool.sleeping_workers() != sleeping; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return pool.sleeping_workers();
  };
  ASSERT_EQ(wait_for(2), 2);
  EXPECT_FALSE(pool.awake());
  pool.HoldAwake(std::chrono::seconds(60));
  ASSERT_EQ(wait_for(0), 0);
  EXPECT_TRUE(pool.awake());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // 2000 x their spin
  EXPECT_EQ(pool.sleeping_workers(), 0);
  pool.HoldAwake(std::chrono::seconds(60));  // a second, nested hold
  pool.ReleaseAwake();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(pool.sleeping_workers(), 0) << "one hold still stands";
  pool.ReleaseAwake();
  EXPECT_EQ(wait_for(2), 2) << "released: asleep after their spin";
  // Capped: 1 s, never released within the test's wait. (30 ms was too short to see the workers
  // up on a loaded 2-core machine: the fresh-clone check of session 17 saw none awake in 10 s.)
  pool.HoldAwake(std::chrono::seconds(1));
  ASSERT_EQ(wait_for(0), 0);
  EXPECT_EQ(wait_for(2), 2) << "the cap ends the hold";
  pool.ReleaseAwake();
}

TEST(CopyPool, OneThreadInterleavesWorkAndHookOnTheCaller) {
  CopyPool pool(1);
  ASSERT_EQ(pool.threads(), 1);
  std::vector<int> trace;
  pool.Run(
      3, [&](size_t i) { trace.push_back(static_cast<int>(i)); },
      [&](size_t i) { trace.push_back(100 + static_cast<int>(i)); });
  EXPECT_EQ(trace, (std::vector<int>{0, 100, 1, 101, 2, 102}));
  EXPECT_EQ(pool.parallel_runs(), 0u);
}

// Half the hardware threads since session 5 (the test still said a quarter, which only held
// on hosts with fewer than 4 hardware threads, where neither branch checked anything).
TEST(CopyPool, DefaultThreadsIsHalfTheHardwareThreadsWithinOneToEight) {
  const int d = DefaultCopyThreads();
  EXPECT_GE(d, 1);
  EXPECT_LE(d, 8);
  const unsigned hw = std::thread::hardware_concurrency();
  EXPECT_EQ(d, static_cast<int>(std::clamp<unsigned>(hw / 2, 1, 8)));
}

}  // namespace
}  // namespace kvpool::client
