// The typed role statuses: each renders the /v1/status keys the fleet view, the tests and
// dashboards read, with their JSON types, and /metrics turns the numbers into samples.
#include "sync/role_status.h"
#include "tests/sync/promtool.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "ops/histogram.h"
#include "ops/metrics.h"

namespace flywheel::sync {
namespace {

using nlohmann::json;

std::set<std::string> Keys(const json& document) {
  std::set<std::string> keys;
  for (const auto& [key, value] : document.items()) keys.insert(key);
  return keys;
}

const std::set<std::string> kCommon = {
    "role",     "region",    "node_id",      "version",       "weights_hash", "head_version",
    "staleness", "max_staleness", "upstream", "bytes_in",     "bytes_out",    "wan_bytes_in",
    "wan_bytes_out", "links", "last_swap_ms", "swap_unix_us", "peak_rss_bytes"};

std::set<std::string> With(std::set<std::string> own) {
  own.insert(kCommon.begin(), kCommon.end());
  return own;
}

RoleStatus Common(const std::string& role) {
  return {.role = role,
          .region = "eu \"west\"",
          .node_id = "n1",
          .version = 7,
          .weights_hash = "abc",
          .head_version = 9,
          .staleness = 2,
          .max_staleness = 3,
          .upstream = "127.0.0.1:1",
          .traffic = {.bytes_in = 10, .bytes_out = 20, .wan_bytes_in = 5, .wan_bytes_out = 6}};
}

TEST(RoleStatusTest, PublisherDocumentHasItsKeys) {
  PublisherStatus s{.common = Common("publisher")};
  s.nodes.push_back({.node_id = "w", .region = "eu", .role = "worker", .version = 6, .detailed = true,
                     .staleness = 3, .upstream = "r", .via = "relay-eu"});
  s.rejected_drops = {{4, "not above v5"}};
  const json doc = ToJson(s);
  EXPECT_EQ(Keys(doc), With({"last_version", "nodes", "artifacts_retained", "log_bytes", "join_bytes",
                             "last_publish_ms", "last_first_piece_ms", "last_encode_done_unix_us", "streaming_version", "streaming_pieces", "last_artifact_bytes", "published_total",
                             "drops_rejected", "rejected_drops", "pieces_served",
                             "signing_key_id", "run_id", "last_sign_ms", "last_error"}));
  EXPECT_EQ(doc["drops_rejected"], 1);
  EXPECT_EQ(doc["rejected_drops"][0]["reason"], "not above v5");
  EXPECT_EQ(Keys(doc["nodes"][0]),
            (std::set<std::string>{"node_id", "region", "role", "version", "staleness", "upstream", "via"}));
  EXPECT_EQ(doc["nodes"][0]["via"], "relay-eu");
}

TEST(RoleStatusTest, RelayDocumentHasItsKeys) {
  RelayStatus s{.common = Common("relay"), .connected = true};
  s.artifacts.push_back({"delta 6->7", 4, 2});
  s.nodes.push_back({.node_id = "w", .region = "eu", .role = "worker", .version = 6});
  s.fetch.pieces_verified = 3;
  const json doc = ToJson(s);
  EXPECT_EQ(Keys(doc), With({"connected", "cache_bytes", "artifacts", "nodes", "piece_requests",
                             "pieces_verified", "pieces_rejected", "piece_bytes", "pieces_served",
                             "fetch_failures", "trusted_keys", "signature_failures_total",
                             "replays_refused_total", "last_signature_error", "run_id"}));
  EXPECT_TRUE(doc["connected"].is_boolean());
  EXPECT_EQ(doc["artifacts"][0]["cached_pieces"], 2);
  // A relay knows its region's nodes, not where they are behind.
  EXPECT_EQ(Keys(doc["nodes"][0]), (std::set<std::string>{"node_id", "region", "role", "version"}));
}

TEST(RoleStatusTest, WorkerDocumentHasItsKeysAndTypes) {
  WorkerStatus s{.common = Common("worker"), .stale = false, .connected = true};
  s.common.last_swap_ms = 1.5;
  s.common.swap_unix_us = 1700000000000000;
  s.swaps_refused = 1;
  s.last_error = "engine refused v8";
  const json doc = ToJson(s);
  EXPECT_EQ(Keys(doc), With({"state", "leaving", "stale", "connected", "last_apply_ms", "last_apply_chunks_early", "last_early_decode_unix_us", "arriving_chunks_decoded",
                             "last_swap_pause_ms",
                             "swaps_total", "exports_total", "piece_requests", "pieces_verified",
                             "pieces_rejected", "piece_bytes", "artifacts_rejected", "swaps_refused",
                             "older_heads_ignored", "export_failures_total", "last_error",
                             "trusted_keys", "signature_failures_total", "replays_refused_total",
                             "last_signature_error", "run_id"}));
  EXPECT_TRUE(doc["version"].is_number_unsigned());
  EXPECT_TRUE(doc["stale"].is_boolean());
  EXPECT_DOUBLE_EQ(doc["last_swap_ms"].get<double>(), 1.5);
  EXPECT_EQ(doc["swap_unix_us"].get<uint64_t>(), 1700000000000000u);
  EXPECT_GT(doc["peak_rss_bytes"].get<uint64_t>(), 1u << 20);  // this process's, by getrusage
  EXPECT_EQ(doc["last_error"], "engine refused v8");
  EXPECT_EQ(doc["state"], "serving");  // "joining" before a version, "leaving" after Stop()
  EXPECT_EQ(doc["leaving"], false);
}

TEST(RoleStatusTest, MetricsAreTheDocumentsNumbersWithEscapedLabels) {
  WorkerStatus s{.common = Common("worker"), .connected = true};
  s.swaps_total = 4;
  s.common.last_swap_ms = 1500;
  const std::string text = ops::MetricsText(ToJson(s));
  const std::string labels = "{role=\"worker\",region=\"eu \\\"west\\\"\",node=\"n1\"}";
  // Counters end in _total, units are base-unit suffixes, and every metric has help.
  EXPECT_NE(text.find("# TYPE flywheel_received_bytes_total counter\nflywheel_received_bytes_total" +
                      labels + " 10\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE flywheel_swaps_total counter\nflywheel_swaps_total" + labels + " 4\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE flywheel_version gauge\nflywheel_version" + labels + " 7\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("flywheel_last_swap_seconds" + labels + " 1.5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# HELP flywheel_pieces_rejected_total "), std::string::npos) << text;
  EXPECT_NE(text.find("flywheel_connected" + labels + " 1\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("_ms{"), std::string::npos) << text;
  // Strings and structured values are /v1/status only.
  EXPECT_EQ(text.find("flywheel_weights_hash"), std::string::npos);
  EXPECT_EQ(text.find("flywheel_links"), std::string::npos);
  EXPECT_EQ(text.find("flywheel_last_error"), std::string::npos);
}

TEST(RoleStatusTest, EveryRolesMetricsPassPromtool) {
  PublisherStatus publisher{.common = Common("publisher")};
  RelayStatus relay{.common = Common("relay")};
  WorkerStatus worker{.common = Common("worker")};
  worker.export_failures = 1;
  worker.signatures.signature_failures = 2;
  for (const nlohmann::json& document : {ToJson(publisher), ToJson(relay), ToJson(worker)}) {
    const std::string text = ops::MetricsText(document);
    std::optional<std::string> complaints = flywheel::testing::PromtoolComplaints(text);
    if (!complaints) GTEST_SKIP() << "promtool is not installed (apt install prometheus)";
    EXPECT_EQ(*complaints, "") << document["role"] << ":\n" << text;
  }
}

// A worker serving a rollout engine adds latency histograms (ops::Histogram): Prometheus
// histograms with cumulative buckets, +Inf = _count, that promtool accepts.
TEST(RoleStatusTest, LatencyHistogramsBecomePrometheusHistograms) {
  WorkerStatus worker{.common = Common("worker")};
  nlohmann::json document = ToJson(worker);
  ops::Histogram first_token({0.01, 0.1, 1});
  for (double s : {0.005, 0.05, 0.05, 0.5, 3.0}) first_token.Observe(s);
  document["time_to_first_token"] = first_token.ToJson();
  document["some_new_latency"] = ops::Histogram().ToJson();
  const std::string text = ops::MetricsText(document);
  const std::string labels = R"(role="worker",region="eu \"west\"",node="n1")";
  EXPECT_NE(text.find("# TYPE flywheel_time_to_first_token_seconds histogram\n"), std::string::npos) << text;
  EXPECT_NE(text.find("flywheel_time_to_first_token_seconds_bucket{" + labels + ",le=\"0.01\"} 1\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("flywheel_time_to_first_token_seconds_bucket{" + labels + ",le=\"0.10000000000000001\"} 3\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("flywheel_time_to_first_token_seconds_bucket{" + labels + ",le=\"1\"} 4\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("flywheel_time_to_first_token_seconds_bucket{" + labels + ",le=\"+Inf\"} 5\n"),
            std::string::npos) << text;
  EXPECT_NE(text.find("flywheel_time_to_first_token_seconds_count{" + labels + "} 5\n"), std::string::npos);
  EXPECT_NE(text.find("flywheel_time_to_first_token_seconds_sum{" + labels + "} 3.605"), std::string::npos);
  EXPECT_NE(text.find("flywheel_some_new_latency_count{" + labels + "} 0\n"), std::string::npos);
  std::optional<std::string> complaints = flywheel::testing::PromtoolComplaints(text);
  if (!complaints) GTEST_SKIP() << "promtool is not installed (apt install prometheus)";
  EXPECT_EQ(*complaints, "") << text;
}

}  // namespace
}  // namespace flywheel::sync
