// kvpool/kvstore/metrics.h — the pool's counters and histograms, rendered as Prometheus text
// exposition format 0.0.4 (checked by `promtool check metrics` in kvstore_test).
//
//   metrics.commit_latency.Observe(absl::ToDoubleSeconds(elapsed));
//   metrics.evictions_demote.fetch_add(1);
//   std::string text = RenderPrometheus(metrics, {{"kvpool_used_bytes", "...", used}});
//
// Thread-safety: every member is atomic; Observe/Render may run concurrently (a render sees
// each counter at some recent value, not a global snapshot).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace kvpool::kvstore {

// Cumulative histogram with fixed upper bounds (Prometheus semantics: bucket i counts
// observations <= bounds[i]; +Inf is implicit).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);
  // Renders `name_bucket{le=..}`, `name_sum`, `name_count` lines (no HELP/TYPE).
  void Render(const std::string& name, std::string* out) const;
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

  // Exponential bounds start, start·factor, … (n values).
  static std::vector<double> Exponential(double start, double factor, int n);

 private:
  std::vector<double> bounds_;
  std::vector<std::atomic<uint64_t>> buckets_;  // non-cumulative per bucket, plus +Inf
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0.0};
};

struct Metrics {
  Metrics();
  // Counters (monotonic).
  std::atomic<uint64_t> lookup_hit_blocks{0};  // blocks found by Lookup/Acquire
  std::atomic<uint64_t> lookup_miss_calls{0};  // Lookup/Acquire calls that ended short
  std::atomic<uint64_t> lookup_calls{0};
  std::atomic<uint64_t> evictions_demote{0};  // BF16 forms dropped from INT2-holding blocks
  std::atomic<uint64_t> evictions_block{0};   // whole blocks evicted (LRU, leaf-first)
  std::atomic<uint64_t> deletions_block{0};   // blocks removed by Delete
  std::atomic<uint64_t> lease_expiries{0};
  std::atomic<uint64_t> put_expiries{0};
  std::atomic<uint64_t> registrations_freed{0};  // by --max-registration-bytes (LRU)
  std::atomic<uint64_t> put_aborts{0};
  // Checksum failures by where they were found (kvpool_checksum_failures_total{where=...}):
  // staging refused at commit ("commit"); a form a reader reported (ReportCorrupt) whose stored
  // bytes the pool found corrupt and dropped ("fetch_stored"); a reported form whose stored
  // bytes verified, so the reader's copy was damaged in transit or in the reader
  // ("fetch_transit").
  std::atomic<uint64_t> checksum_failures{0};  // commit
  std::atomic<uint64_t> checksum_failures_fetch_stored{0};
  std::atomic<uint64_t> checksum_failures_fetch_transit{0};
  // ReportCorrupt reports that changed nothing: unknown key, other namespace, a form not held,
  // another generation, a duplicate.
  std::atomic<uint64_t> corruption_reports_refused{0};
  // ReportCorrupt reports not re-verified (kvpool_corruption_reports_dropped_total{reason=...}):
  // "duplicate" — the form, with that generation, was verified intact within the dedupe window
  // (answered INTACT without hashing); "rate" — over the client's rate (RESOURCE_EXHAUSTED).
  std::atomic<uint64_t> corruption_reports_dropped_duplicate{0};
  std::atomic<uint64_t> corruption_reports_dropped_rate{0};
  std::atomic<uint64_t> nonfinite_refusals{0};
  std::atomic<uint64_t> int2_overflow_blocks{0};  // kept BF16 because a group exceeded fp16
  std::atomic<uint64_t> put_bytes{0};             // staging bytes reserved by BeginPut
  std::atomic<uint64_t> commit_bytes{0};          // staging bytes ingested by successful commits
  std::atomic<uint64_t> fetch_bytes{0};           // form bytes leased (every form, read or not)
  std::atomic<uint64_t> read_leased_bytes{0};     // form bytes ReadLeased pushed (reads OK)
  // Blocks of a lease's recent window (its last recent_blocks non-sink blocks) leased without a
  // BF16 form (demoted, or interior blocks of a longer sequence): readers that need BF16 there
  // recompute them although they count as hits.
  std::atomic<uint64_t> lease_window_int2_only_blocks{0};
  std::atomic<uint64_t> grpc_errors{0};
  // Latency (seconds) and size (bytes) histograms.
  Histogram put_latency;  // BeginPut
  Histogram commit_latency;
  Histogram fetch_latency;  // Acquire
  Histogram lookup_latency;
  // The data transfers the pool runs when it initiates them (tcp): WritePut (pulling a put's
  // layer from the client) and ReadLeased (pushing leased forms to it). Kept apart from the
  // control calls above, which they would swamp (newcomer report s6 #6).
  Histogram write_put_latency;
  Histogram read_leased_latency;
  Histogram put_size;
  Histogram commit_size;
  Histogram fetch_size;
};

// A gauge value computed at render time.
struct GaugeSample {
  std::string name;  // metric name, e.g. "kvpool_blocks"
  std::string help;
  std::string labels;  // "" or `form="bf16"` (without braces)
  double value = 0;
};

// Full exposition text: every counter and histogram of `m` plus `gauges` (samples with the same
// name must be adjacent; HELP/TYPE is written once per name).
std::string RenderPrometheus(const Metrics& m, const std::vector<GaugeSample>& gauges);

}  // namespace kvpool::kvstore
