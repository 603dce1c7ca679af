// Per-thread stage stamps (stage_stamps.h). Built into the library always (a few hundred
// bytes); only a build with KVPOOL_STAGE_STAMPS defined calls Record.
#include "stage_stamps.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include <sched.h>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace kvpool::client::stamps {
namespace {

uint64_t Tsc() {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

struct Entry {
  uint64_t tsc;
  uint32_t arg;
  uint16_t event;
};

constexpr size_t kPerThread = size_t{4} << 20;

struct Buffer {
  int thread = 0;
  size_t used = 0;
  uint64_t dropped = 0;
  std::unique_ptr<Entry[]> entries = std::make_unique<Entry[]>(kPerThread);
};

// Every thread's buffer, kept until exit (threads may end before the dump).
class Registry {
 public:
  Registry()
      : start_tsc_(Tsc()), start_ns_(std::chrono::steady_clock::now().time_since_epoch().count()) {}
  ~Registry() { Dump(); }
  Buffer* Add() {
    std::lock_guard<std::mutex> lock(mu_);
    buffers_.push_back(std::make_unique<Buffer>());
    buffers_.back()->thread = static_cast<int>(buffers_.size() - 1);
    return buffers_.back().get();
  }

 private:
  void Dump() {
    const char* path = std::getenv("KVPOOL_STAGE_STAMPS_OUT");
    if (path == nullptr || *path == '\0') return;
    const uint64_t end_tsc = Tsc();
    const int64_t end_ns = std::chrono::steady_clock::now().time_since_epoch().count();
    const double per_us =
        end_ns > start_ns_ ? double(end_tsc - start_tsc_) / (double(end_ns - start_ns_) / 1e3) : 0;
    std::FILE* f = std::fopen(path, "w");
    if (f == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t dropped = 0;
    for (const auto& b : buffers_) dropped += b->dropped;
    std::fprintf(f, "tsc_per_us %.6f dropped %llu\n", per_us,
                 static_cast<unsigned long long>(dropped));
    for (const auto& b : buffers_) {
      for (size_t i = 0; i < b->used; ++i) {
        const Entry& e = b->entries[i];
        std::fprintf(f, "%d %llu %u %u\n", b->thread, static_cast<unsigned long long>(e.tsc),
                     unsigned(e.event), e.arg);
      }
    }
    std::fclose(f);
  }

  std::mutex mu_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  const uint64_t start_tsc_;
  const int64_t start_ns_;
};

Registry& TheRegistry() {
  static Registry r;
  return r;
}

}  // namespace

void Record(Event event, uint32_t arg) {
  thread_local Buffer* buf = TheRegistry().Add();
  if (buf->used == kPerThread) {
    ++buf->dropped;
    return;
  }
  buf->entries[buf->used++] = {Tsc(), arg, event};
}

uint32_t Cpu() {
  const int c = sched_getcpu();
  return c < 0 ? 0xFFFFFFFFu : static_cast<uint32_t>(c);
}

}  // namespace kvpool::client::stamps
