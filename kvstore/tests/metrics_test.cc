// Prometheus text: format checked by promtool (Debian package `prometheus`), values checked
// against the store's counters.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "kvpool/kvstore/metrics.h"
#include "kvpool/kvstore/server.h"
#include "test_util.h"

namespace kvpool::kvstore {
namespace {

// Runs `promtool check metrics` on `text`; returns its exit status and output.
int Promtool(const std::string& text, std::string* output) {
  const std::string path = ::testing::TempDir() + "/kvpool_metrics.txt";
  std::ofstream(path) << text;
  const std::string cmd = std::string(KVPOOL_PROMTOOL) + " check metrics < " + path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    return -1;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) {
    output->append(buf, n);
  }
  return pclose(p);
}

TEST(HistogramTest, CumulativeBuckets) {
  Histogram h({1, 2, 4});
  for (double v : {0.5, 1.0, 1.5, 3.0, 10.0}) {
    h.Observe(v);
  }
  std::string out;
  h.Render("x", &out);
  EXPECT_NE(out.find("x_bucket{le=\"1\"} 2\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"2\"} 3\n"), std::string::npos);
  EXPECT_NE(out.find("x_bucket{le=\"4\"} 4\n"), std::string::npos);
  EXPECT_NE(out.find("x_bucket{le=\"+Inf\"} 5\n"), std::string::npos);
  EXPECT_NE(out.find("x_sum 16\n"), std::string::npos);
  EXPECT_NE(out.find("x_count 5\n"), std::string::npos);
}

// Newcomer report 11 F8: bounds such as 5e-5 printed with 17 significant digits
// (le="5.0000000000000002e-05"); the shortest text that reads back as the double is printed.
TEST(HistogramTest, BoundsPrintAsTheShortestRoundTripText) {
  Histogram h({5e-5, 2e-4, 0.1, 0.25, 1e3, 8388608, 0.0015});
  h.Observe(0.3);
  std::string out;
  h.Render("x", &out);
  for (const char* le : {"5e-05", "0.0002", "0.1", "0.25", "1000", "8388608", "0.0015"}) {
    EXPECT_NE(out.find(std::string("x_bucket{le=\"") + le + "\"}"), std::string::npos) << le << "\n"
                                                                                       << out;
  }
  EXPECT_EQ(out.find("00000000"), std::string::npos) << out;
  EXPECT_NE(out.find("x_sum 0.3\n"), std::string::npos) << out;
}

TEST(MetricsTest, StoreMetricsPassPromtoolAndCountActivity) {
  if (std::string(KVPOOL_PROMTOOL).empty()) {
    GTEST_SKIP() << "promtool not installed";
  }
  auto mem = *HeapPoolMemory::Create(1 << 20);
  FakeClock clock;
  auto store = *BlockStore::Create({}, mem.get(), &clock);
  ModelSpec spec = testing::TinySpec();
  auto info = store->RegisterModel(spec, {.file_bytes = testing::RotationFileFor(spec)});
  ASSERT_TRUE(info.ok());
  auto plan = store->BeginPut(info->namespace_id, testing::Tokens(1, 12), 3, {});
  ASSERT_TRUE(plan.ok());
  std::vector<BlockChecksum> sums;
  for (const auto& b : plan->blocks) {
    auto bytes = testing::BlockBytes(spec.geometry, 1, b.index);
    std::memcpy(mem->data() + b.staging_offset, bytes.data(), bytes.size());
    sums.push_back({b.index, FormChecksum(bytes.data(), bytes.size())});
  }
  ASSERT_TRUE(store->CommitPut(info->namespace_id, plan->put_id, sums).ok());
  ASSERT_TRUE(store->Lookup(info->namespace_id, {.token_ids = testing::Tokens(1, 20)}).ok());
  // One reported form that verifies (damaged in transit) and one whose stored bytes are corrupt
  // (block 2's INT2 form, dropped).
  auto lease = store->Acquire(info->namespace_id, {.token_ids = testing::Tokens(1, 12)}, 0, {});
  ASSERT_TRUE(lease.ok());
  ASSERT_EQ(lease->blocks.size(), 3u);
  std::vector<CorruptionReport> reports;
  for (const FormLocation& f : lease->blocks[1].forms) {
    if (f.form == FormKind::kBf16) reports.push_back({lease->blocks[1].key, f.form, f.generation});
  }
  for (const FormLocation& f : lease->blocks[2].forms) {
    if (f.form != FormKind::kInt2) continue;
    mem->data()[f.offset] ^= 1;
    reports.push_back({lease->blocks[2].key, f.form, f.generation});
  }
  ASSERT_TRUE(store->Release(lease->lease_id).ok());
  ASSERT_EQ(reports.size(), 2u);
  ASSERT_TRUE(store->ReportCorrupt(info->namespace_id, reports).ok());
  store->metrics().commit_latency.Observe(0.003);
  store->metrics().write_put_latency.Observe(0.02);
  store->metrics().read_leased_latency.Observe(0.01);

  const std::string text = RenderStoreMetrics(*store);
  std::string out;
  EXPECT_EQ(Promtool(text, &out), 0) << out << "\n" << text;
  EXPECT_NE(text.find("kvpool_blocks 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvpool_forms{form=\"bf16\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("kvpool_forms{form=\"int2\"} 1\n"), std::string::npos);  // one dropped
  EXPECT_NE(text.find("kvpool_checksum_failures_total{where=\"commit\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("kvpool_checksum_failures_total{where=\"fetch_stored\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("kvpool_checksum_failures_total{where=\"fetch_transit\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("kvpool_corruption_reports_refused_total 0\n"), std::string::npos);
  EXPECT_NE(text.find("kvpool_corruption_reports_dropped_total{reason=\"duplicate\"} 0\n"),
            std::string::npos);
  EXPECT_NE(text.find("kvpool_corruption_reports_dropped_total{reason=\"rate\"} 0\n"),
            std::string::npos);
  EXPECT_NE(text.find("kvpool_lookup_hit_blocks_total 6\n"), std::string::npos);  // + Acquire
  EXPECT_NE(text.find("kvpool_lookup_misses_total 1\n"), std::string::npos);
  EXPECT_NE(text.find("kvpool_commit_bytes_total 1536\n"), std::string::npos);
  EXPECT_NE(text.find("kvpool_commit_latency_seconds_count 1\n"), std::string::npos);
  // The transfers have histograms of their own (BeginPut's and Acquire's stay empty here).
  EXPECT_NE(text.find("kvpool_write_put_latency_seconds_count 1\n"), std::string::npos);
  EXPECT_NE(text.find("kvpool_read_leased_latency_seconds_count 1\n"), std::string::npos);
  EXPECT_NE(text.find("kvpool_put_latency_seconds_count 0\n"), std::string::npos);
  EXPECT_NE(text.find("kvpool_fetch_latency_seconds_count 0\n"), std::string::npos);
  EXPECT_NE(text.find("kvpool_evictions_total{reason=\"demote_bf16\"} 0\n"), std::string::npos);

  // And promtool does reject broken text (so the check above can fail).
  std::string bad_out;
  EXPECT_NE(Promtool("# TYPE x counter\nx{le=} 1\n", &bad_out), 0);
}

}  // namespace
}  // namespace kvpool::kvstore
