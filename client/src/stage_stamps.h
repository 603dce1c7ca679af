// client/src/stage_stamps.h — per-thread time stamps of the client's data-path stages, for
// finding where a put's or a fetch's microseconds go (docs/TRANSPORT.md "Session 11").
// Compiled in only with -DKVPOOL_STAGE_STAMPS=ON (CMake); otherwise KVPOOL_STAMP is nothing.
//
//   KVPOOL_STAMP(kvpool::client::stamps::kFetchEnter, 0);
//
// Each thread appends (rdtsc, event, arg) to a buffer of its own (no sharing, no lock after
// the thread's first stamp). At process exit, when the environment names a file in
// KVPOOL_STAGE_STAMPS_OUT, every thread's stamps are written there as text: a header line
// "tsc_per_us X" (rdtsc calibrated against steady_clock over the process's life), then one
// line "thread tsc event arg" per stamp. bench/stage_stamps_summary.py reads it. A stamp
// costs ~10-20 ns (rdtsc and a store); buffers hold 4 M stamps per thread, later ones are
// dropped (counted in the header's "dropped N").
#pragma once

#include <cstdint>

namespace kvpool::client::stamps {

enum Event : uint16_t {
  // Client::Acquire (calling thread); since session 13 kAcquireEnter's and kAcquireRpcDone's
  // arg is the CPU (Cpu()) at that point (the same for BeginPut's).
  kAcquireEnter = 1,
  kAcquireRpcDone = 2,
  kAcquireExit = 3,
  // Client::Fetch (calling thread), in order.
  kFetchEnter = 10,
  kFetchLeaseChecked = 11,  // lease registry and connection snapshot
  kFetchItems = 12,         // segments and items
  kFetchOverlapChecked = 13,
  kFetchAliveChecked = 14,  // Translate and the first ConfirmPoolAlive
  kFetchCopyDone = 15,      // CopyForms returned
  kFetchExit = 16,          // checks after the copy and the page tables
  // CopyPool::Run (calling thread): entered, job published, every slot done.
  kRunEnter = 20,
  kRunPublished = 21,
  kRunDone = 22,
  // A Run slot (any thread), arg = slot.
  kSlotBegin = 23,
  kSlotEnd = 24,
  // 25, 26: a copy thread's prefetch hint (session 11's patch,
  // bench/results/s11_pool11_prefetch_hint.patch).
  kHintBegin = 25,
  kHintEnd = 26,
  // A stream task (any thread), arg = task.
  kTaskBegin = 27,
  kTaskEnd = 28,
  // Client::BeginPut (calling thread).
  kBeginPutEnter = 30,
  kBeginPutRpcDone = 31,
  kBeginPutExit = 32,
  // PutSession::WriteLayerAsync / WriteLayer, arg = layer.
  kWriteAsyncEnter = 40,
  kWriteAsyncExit = 41,
  kWriteEnter = 42,
  kWriteExit = 43,
  // PutSession::Flush.
  kFlushEnter = 44,
  kFlushJoined = 45,  // the asynchronous layers are drained
  kFlushExit = 46,
  // Inside WriteLayerAsync (session 13), arg = layer: the checks and the first call's task
  // layout done; the layer's tasks published.
  kWriteAsyncReady = 47,
  kWriteAsyncSubmitted = 48,
};

void Record(Event event, uint32_t arg);

// The CPU the calling thread runs on now (sched_getcpu; for the Acquire and BeginPut stamps,
// whose args say whether the caller came back from the RPC on another core: session 13).
uint32_t Cpu();

// Stamps `enter` now and `exit` when the scope ends (every return path).
class Scope {
 public:
  Scope(Event enter, Event exit, uint32_t arg) : exit_(exit), arg_(arg) { Record(enter, arg); }
  ~Scope() { Record(exit_, arg_); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Event exit_;
  uint32_t arg_;
};

}  // namespace kvpool::client::stamps

#if defined(KVPOOL_STAGE_STAMPS)
#define KVPOOL_STAMP(event, arg) \
  ::kvpool::client::stamps::Record(::kvpool::client::stamps::event, (arg))
#define KVPOOL_STAMP_SCOPE(enter, exit, arg)                                           \
  ::kvpool::client::stamps::Scope kvpool_stamp_scope_(::kvpool::client::stamps::enter, \
                                                      ::kvpool::client::stamps::exit, (arg))
#else
#define KVPOOL_STAMP(event, arg) ((void)0)
#define KVPOOL_STAMP_SCOPE(enter, exit, arg) ((void)0)
#endif
