// `flywheel worker --model` end to end, as real processes on loopback: a publisher takes
// checkpoint drops of a tiny model, the worker's rollout engine serves POST /v1/completions
// from the served weights (503 before the first version), and a new version reaches the
// engine in flight: later answers carry it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "model/model.h"
#include "model/weights.h"
#include "ops/process.h"
#include "tests/model/tiny_models.h"
#include "tests/sync/promtool.h"
#include "transport/http.h"

namespace flywheel::rollout {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace std::chrono_literals;

// Polls `predicate` for up to `limit` (ops::WaitUntil); the error names `what`.
::testing::AssertionResult WaitFor(const std::function<bool()>& predicate, const std::string& what,
                                   std::chrono::milliseconds limit = 30s) {
  const Status waited = ops::WaitUntil(predicate, limit, what, 20ms);
  if (waited.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << waited.ToString();
}

transport::Endpoint Parse(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  return {host_port.substr(0, colon),
          static_cast<uint16_t>(std::stoi(host_port.substr(colon + 1)))};
}

void Drop(const fs::path& watch, uint64_t version, model::TransformerImpl& m, DType dtype) {
  const fs::path dir = watch / std::to_string(version);
  fs::create_directories(dir);
  ASSERT_TRUE(model::SaveModel(m, (dir / "model.safetensors").string(), dtype).ok());
  std::ofstream(dir / "COMMIT").close();
}

// bf16 serving computes from a patched fp32 mirror; f32 serving computes from the served
// weights themselves (no mirror), which deltas patch in place.
class WorkerProcessTest : public ::testing::TestWithParam<DType> {};

TEST_P(WorkerProcessTest, CompletionsFollowTheServedVersion) {
  const DType dtype = GetParam();
  const fs::path dir = fs::temp_directory_path() /
                       ("flywheel_worker_engine_" + std::string(DTypeName(dtype)) + "_" +
                        std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "watch");
  const model::ModelConfig config = testing::TinyConfig({.vocab = 260});
  { std::ofstream(dir / "config.json") << config.ToJson().dump(); }
  // Logs in `dir`; the group stops both processes however the test ends.
  ops::ProcessGroup processes(dir.string());
  Result<size_t> publisher = processes.Start(
      "publisher", FLYWHEEL_BIN,
      {"publish", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state-dir",
       (dir / "state").string(), "--watch", (dir / "watch").string(), "--ready-file",
       (dir / "publisher.ready").string()});
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  Result<json> publisher_ready = ops::AwaitReadyFile(
      processes, (dir / "publisher.ready").string(), "publisher", 30s, *publisher);
  ASSERT_TRUE(publisher_ready.ok()) << publisher_ready.status().ToString();
  const std::string upstream = (*publisher_ready)["listen"];
  Result<size_t> worker = processes.Start(
      "worker", FLYWHEEL_BIN,
      {"worker", "--region", "home", "--upstream", upstream, "--http", "127.0.0.1:0", "--model",
       (dir / "config.json").string(), "--max-sequence", "64", "--ready-file",
       (dir / "worker.ready").string()});
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  Result<json> worker_ready =
      ops::AwaitReadyFile(processes, (dir / "worker.ready").string(), "worker", 30s, *worker);
  ASSERT_TRUE(worker_ready.ok()) << worker_ready.status().ToString();
  const transport::Endpoint http = Parse((*worker_ready)["http"]);
  const std::string request =
      R"({"prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": true})";

  auto early = transport::HttpPost(http, "/v1/completions", request);
  ASSERT_TRUE(early.ok()) << early.status().ToString();
  EXPECT_EQ(early->status, 503) << early->body;

  torch::manual_seed(1);
  model::TransformerImpl m(config);
  Drop(dir / "watch", 1, m, dtype);
  json answer;
  ASSERT_TRUE(WaitFor([&] {
    auto r = transport::HttpPost(http, "/v1/completions", request);
    if (!r.ok() || r->status != 200) return false;
    answer = json::parse(r->body, nullptr, false);
    return true;
  }, "the worker to serve version 1"));
  EXPECT_EQ(answer["choices"][0]["policy_versions"], json::array({1, 1, 1, 1}));
  EXPECT_EQ(answer["choices"][0]["token_ids"].size(), 4u);
  const json v1_logprobs = answer["choices"][0]["logprobs"]["token_logprobs"];

  {
    torch::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.add_(0.01);
  }
  Drop(dir / "watch", 2, m, dtype);
  ASSERT_TRUE(WaitFor([&] {
    auto r = transport::HttpPost(http, "/v1/completions", request);
    if (!r.ok() || r->status != 200) return false;
    answer = json::parse(r->body, nullptr, false);
    return answer["choices"][0]["policy_versions"][0] == 2;
  }, "version 2 to reach the engine"));
  // The engine computes from the new weights (with fp32 serving: the in-place patched
  // served tensors themselves).
  EXPECT_NE(answer["choices"][0]["logprobs"]["token_logprobs"], v1_logprobs);
  auto status = transport::HttpGet(http, "/v1/status");
  ASSERT_TRUE(status.ok());
  json s = json::parse(status->body, nullptr, false);
  EXPECT_EQ(s["version"], 2);
  EXPECT_GE(s["last_swap_pause_ms"].get<double>(), 0.0);
  // A bad request is a 400 and the worker keeps serving.
  auto bad = transport::HttpPost(http, "/v1/completions", R"({"prompt": "hi", "top_p": 2})");
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(bad->status, 400);
  auto again = transport::HttpPost(http, "/v1/completions", request);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->status, 200);
  // A group of 4 samples prefills its prompt once: the engine's prefix counters in
  // /v1/status and /metrics.
  const uint64_t hits_before = s["prefix_cache_hits_total"].get<uint64_t>();
  auto group = transport::HttpPost(
      http, "/v1/completions",
      R"({"prompt": "a longer prompt for the group", "max_tokens": 4, "n": 4, "seed": 7})");
  ASSERT_TRUE(group.ok());
  EXPECT_EQ(group->status, 200) << group->body;
  status = transport::HttpGet(http, "/v1/status");
  ASSERT_TRUE(status.ok());
  s = json::parse(status->body, nullptr, false);
  EXPECT_GE(s["prefix_cache_hits_total"].get<uint64_t>(), hits_before + 3) << s.dump();
  EXPECT_GT(s["prefill_tokens_total"].get<uint64_t>(), 0u);
  EXPECT_GT(s["kv_cache_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(s["prefix_cache_slots"], 8);  // --max-batch 32 / 4
  auto metrics = transport::HttpGet(http, "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_NE(metrics->body.find("flywheel_prefix_cache_hits_total{"), std::string::npos);
  EXPECT_NE(metrics->body.find("flywheel_engine_running_requests{"), std::string::npos);
  // Latency histograms: every answered request had a first token, the group's 4 samples
  // 3 more tokens each.
  EXPECT_GE(s["time_to_first_token"]["histogram"]["count"].get<uint64_t>(), 4u) << s.dump();
  EXPECT_GE(s["inter_token_latency"]["histogram"]["count"].get<uint64_t>(), 12u) << s.dump();
  EXPECT_GE(s["e2e_request_latency"]["histogram"]["count"].get<uint64_t>(), 4u);
  EXPECT_GE(s["request_queue_time"]["histogram"]["count"].get<uint64_t>(), 4u);
  EXPECT_NE(metrics->body.find("# TYPE flywheel_time_to_first_token_seconds histogram"), std::string::npos);
  EXPECT_NE(metrics->body.find("flywheel_inter_token_latency_seconds_bucket{"), std::string::npos);
  if (std::optional<std::string> complaints = flywheel::testing::PromtoolComplaints(metrics->body)) {
    EXPECT_EQ(*complaints, "") << metrics->body;
  }
  (void)processes.StopAll();  // before their directory goes
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(ServingDtypes, WorkerProcessTest, ::testing::Values(DType::kBF16, DType::kF32),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace flywheel::rollout
