// The pipeline-RL fleet's failure behaviour, end to end: the trainer, relays and workers run
// as processes of build/bin/flywheel on loopback (pipeline::Fleet), and the tests kill and
// restart them mid-run. Every wait is bounded; the fleet is stopped when a test ends.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "pipeline/launcher.h"
#include "pipeline/shapes.h"
#include "tests/sync/promtool.h"
#include "sync/signing.h"
#include "transport/certs.h"
#include "transport/http.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kGroupsPerStep = 2;

RunConfig SmallRun() {
  RunConfig config;
  config.task = {"sort", 3};
  config.run.max_steps = 100000;  // the tests end the run
  config.run.time_limit_s = 600;
  config.run.target_accuracy = 0;
  config.run.eval_every = 1000;
  config.run.eval_prompts = 16;
  config.algorithm.group_size = 4;
  config.algorithm.groups_per_step = kGroupsPerStep;
  // An untrained policy scores 0 on almost every sample: the zero-variance filter would
  // drop nearly every group, and these tests are about the fleet, not the filter.
  config.algorithm.zero_variance_filter = false;
  config.pipeline.max_staleness = 2;
  config.pipeline.lease_s = 5;
  config.fleet.regions = {"us", "eu"};
  config.fleet.workers_per_region = 1;
  config.fleet.wan_rate_mbit = 50;
  config.fleet.wan_latency_ms = 5;
  config.fleet.worker_max_batch = 8;
  return config;
}

class PipelineFleetTest : public ::testing::Test {
 protected:
  // A derived fixture's chance to change the fleet before it starts.
  virtual void Adjust(FleetOptions& /*options*/) {}

  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("flywheel-pipeline-" + std::string(info->name()) + "-" +
                                        std::to_string(::getpid()));
    fs::remove_all(dir_);
    FleetOptions options;
    options.config = SmallRun();
    options.program = FLYWHEEL_BIN;
    options.run_dir = dir_.string();
    Adjust(options);
    if (HasFatalFailure()) return;
    auto fleet = Fleet::Start(options);
    ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
    fleet_ = std::move(*fleet);
  }
  void TearDown() override {
    if (fleet_) {
      for (const std::string& line : fleet_->Stop()) ADD_FAILURE() << line;
    }
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // The trainer's status; an empty object while it does not answer.
  json Trainer() {
    auto status = fleet_->TrainerStatus();
    return status.ok() ? *status : json::object();
  }
  uint64_t Step() { return Trainer().value("step", uint64_t{0}); }
  uint64_t WorkerVersion(const std::string& name) {
    auto status = fleet_->WorkerStatus(name);
    return status.ok() ? status->value("version", uint64_t{0}) : 0;
  }
  // Claims `worker` holds now.
  uint64_t LeasesOf(const std::string& worker) {
    const json status = Trainer();
    if (!status.contains("leases_by_worker") || !status["leases_by_worker"].is_object()) return 0;
    return status["leases_by_worker"].value(worker, uint64_t{0});
  }
  uint64_t GroupsOf(const std::string& worker) {
    const json status = Trainer();
    if (!status.contains("groups_by_worker") || !status["groups_by_worker"].is_object()) return 0;
    return status["groups_by_worker"].value(worker, uint64_t{0});
  }
  // ops::WaitUntil at the pace of the trainer's status (each poll is an HTTP GET).
  static bool WaitFor(const std::function<bool()>& predicate, std::chrono::seconds limit) {
    return ops::WaitUntil(predicate, limit, "a fleet condition", std::chrono::milliseconds(100)).ok();
  }
  std::string Logs() { return " (logs in " + fleet_->log_dir() + ")"; }

  fs::path dir_;
  std::unique_ptr<Fleet> fleet_;
};

TEST_F(PipelineFleetTest, KilledWorkerRejoinsAndContributesAgain) {
  // Kill it while it holds claims (it almost always does: it claims again right after
  // submitting).
  ASSERT_TRUE(WaitFor([&] { return Step() >= 5; }, std::chrono::seconds(90))) << Logs();
  ASSERT_TRUE(WaitFor([&] { return LeasesOf("worker-us-1") > 0; }, std::chrono::seconds(30)));
  ASSERT_TRUE(fleet_->Kill("worker-us-1", SIGKILL).ok());
  EXPECT_FALSE(fleet_->Running("worker-us-1"));
  // Dead, its claims are frozen: these are the prompts it had in flight.
  const uint64_t in_flight = LeasesOf("worker-us-1");
  const uint64_t expired_at_kill = Trainer().value("leases_expired", uint64_t{0});
  // The run goes on with the other worker.
  const uint64_t step_at_kill = Step();
  ASSERT_TRUE(WaitFor([&] { return Step() >= step_at_kill + 8; }, std::chrono::seconds(90)))
      << "the run stalled without worker-us-1" << Logs();
  // Restarted, it catches up (weights) and contributes groups again.
  const uint64_t before = GroupsOf("worker-us-1");
  Status restarted = fleet_->Restart("worker-us-1");
  ASSERT_TRUE(restarted.ok()) << restarted.ToString();
  ASSERT_TRUE(WaitFor([&] { return GroupsOf("worker-us-1") > before; }, std::chrono::seconds(90)))
      << "the restarted worker contributed nothing" << Logs();
  // Not lost: the claims it held went back to the pool (its new incarnation released them,
  // or their leases lapsed), to be handed out again.
  EXPECT_GE(Trainer().value("leases_expired", uint64_t{0}), expired_at_kill + in_flight)
      << "in flight at the kill: " << in_flight;
  const uint64_t trainer_version = Trainer().value("version", uint64_t{0});
  ASSERT_TRUE(WaitFor([&] { return WorkerVersion("worker-us-1") + 2 >= trainer_version; },
                      std::chrono::seconds(60)));
  // Nothing counted twice: every trained group belongs to exactly one step's batch (the
  // counters are live, the step as of the last one finished: a batch may be in training).
  const json status = Trainer();
  const uint64_t trained = status.value("groups_trained", uint64_t{0});
  const uint64_t steps = status.value("step", uint64_t{0});
  EXPECT_TRUE(trained == steps * kGroupsPerStep || trained == (steps + 1) * kGroupsPerStep)
      << status.dump();
  EXPECT_EQ(status.value("samples_dropped_stale", uint64_t{1}), 0u) << status.dump();
}

TEST_F(PipelineFleetTest, KilledRelaysWorkersGoUpstream) {
  ASSERT_TRUE(WaitFor([&] { return Step() >= 3; }, std::chrono::seconds(90))) << Logs();
  ASSERT_TRUE(fleet_->Kill("relay-us", SIGKILL).ok());
  const uint64_t version = Trainer().value("version", uint64_t{0});
  // worker-us-1 keeps following new versions through the publisher itself.
  ASSERT_TRUE(WaitFor([&] { return WorkerVersion("worker-us-1") >= version + 5; },
                      std::chrono::seconds(90)))
      << "worker-us-1 stopped following versions after its relay died" << Logs();
  const uint64_t groups = GroupsOf("worker-us-1");
  ASSERT_TRUE(WaitFor([&] { return GroupsOf("worker-us-1") > groups; }, std::chrono::seconds(60)));
}

TEST_F(PipelineFleetTest, KilledTrainerResumesFromItsStateAndTheFleetFollows) {
  ASSERT_TRUE(WaitFor([&] { return Step() >= 6; }, std::chrono::seconds(90))) << Logs();
  const json before = Trainer();
  const uint64_t step_before = before.value("step", uint64_t{0});
  const uint64_t version_before = before.value("version", uint64_t{0});
  ASSERT_TRUE(fleet_->Kill("trainer", SIGKILL).ok());
  Status restarted = fleet_->Restart("trainer");
  ASSERT_TRUE(restarted.ok()) << restarted.ToString();
  // It resumed (from the state saved after its last step or the one before) and goes on.
  ASSERT_TRUE(WaitFor([&] { return Trainer().value("step", uint64_t{0}) >= step_before + 3; },
                      std::chrono::seconds(120)))
      << "the restarted trainer did not train on" << Logs();
  const json after = Trainer();
  EXPECT_TRUE(after.value("resumed", false)) << after.dump();
  EXPECT_GT(after.value("version", uint64_t{0}), version_before);
  // The workers follow the restarted trainer's versions.
  const uint64_t version = after.value("version", uint64_t{0});
  for (const std::string worker : {"worker-us-1", "worker-eu-1"}) {
    ASSERT_TRUE(WaitFor([&] { return WorkerVersion(worker) >= version; }, std::chrono::seconds(60)))
        << worker << " did not follow the restarted trainer" << Logs();
  }
  // The per-step record continues where the state left it (no step missing).
  std::ifstream progress_file(fs::path(fleet_->state_dir()) / "progress.json");
  const json progress = json::parse(progress_file, nullptr, false);
  ASSERT_TRUE(progress.is_object());
  const json& rows = progress["rows"];
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(rows[i]["step"], i + 1);
}

// Every algorithm of the run config trains in the real loop, after an SFT and a DPO warm-up
// from JSONL files (chat format; preference pairs).
// TLS on every link, the trainer's coordinator included, and signed versions: rollout samples (training data)
// and bearer tokens never cross a network in clear text, and the trainer only talks to
// clients whose certificate its CA signed.
class PipelineTlsFleetTest : public PipelineFleetTest {
 protected:
  void Adjust(FleetOptions& options) override {
    const std::string certs = (dir_ / "certs").string();
    const Status written = transport::WriteTestCertificates(certs);
    ASSERT_TRUE(written.ok()) << written.ToString();
    options.tls = {certs + "/server.crt", certs + "/server.key", certs + "/ca.crt"};
    certs_ = certs;
    // And signed versions: the whole trusted loop.
    Result<sync::KeyFiles> keys = sync::GenerateSigningKeys((dir_ / "keys").string());
    ASSERT_TRUE(keys.ok()) << keys.status().ToString();
    options.signing_keys_dir = (dir_ / "keys").string();
  }
  std::string certs_;
};

TEST_F(PipelineTlsFleetTest, WorkersClaimAndSubmitOverMutualTlsAndOthersAreRefused) {
  // The workers' actors claim and submit over mTLS: the run trains.
  ASSERT_TRUE(WaitFor([&] { return Step() >= 2; }, std::chrono::seconds(120))) << Logs();
  EXPECT_GT(GroupsOf("worker-us-1") + GroupsOf("worker-eu-1"), 0u);
  // Every worker serves versions the trainer signed, and refused none.
  for (const char* name : {"worker-us-1", "worker-eu-1"}) {
    Result<json> worker = fleet_->WorkerStatus(name);
    ASSERT_TRUE(worker.ok()) << worker.status().ToString();
    EXPECT_EQ(worker->value("trusted_keys", uint64_t{0}), 1u) << worker->dump();
    EXPECT_EQ(worker->value("signature_failures_total", uint64_t{1}), 0u) << worker->dump();
    EXPECT_EQ(worker->value("run_id", std::string()).size(), 16u) << worker->dump();
  }
  Result<transport::Endpoint> trainer = transport::ParseEndpoint(fleet_->trainer_http());
  ASSERT_TRUE(trainer.ok());
  const std::string claim = R"({"worker":"intruder","incarnation":"1","version":0,"max_groups":1})";
  auto post = [&](std::shared_ptr<transport::asio::ssl::context> tls, const std::string& token) {
    transport::HttpGetOptions options;
    options.tls = std::move(tls);
    options.token = token;
    options.timeout = std::chrono::milliseconds(3000);
    return transport::HttpPost(*trainer, "/v1/rollout/claim", claim, options);
  };
  std::string token;
  {
    std::ifstream in(dir_ / "token");
    std::getline(in, token);
  }
  // Plain HTTP: no answer (the port speaks TLS only).
  Result<transport::HttpResponse> plain = post(nullptr, token);
  EXPECT_FALSE(plain.ok() && plain->status == 200);
  // TLS without a client certificate: the handshake is refused.
  Result<std::shared_ptr<transport::asio::ssl::context>> anonymous =
      transport::MakeClientTlsContext({"", "", certs_ + "/ca.crt"});
  ASSERT_TRUE(anonymous.ok());
  Result<transport::HttpResponse> refused = post(*anonymous, token);
  EXPECT_FALSE(refused.ok()) << "HTTP " << refused->status;
  // A certificate from another CA: refused as well.
  Result<std::shared_ptr<transport::asio::ssl::context>> rogue =
      transport::MakeClientTlsContext({certs_ + "/rogue.crt", certs_ + "/rogue.key", certs_ + "/ca.crt"});
  ASSERT_TRUE(rogue.ok());
  EXPECT_FALSE(post(*rogue, token).ok());
  // The right certificate without the token: 401.
  Result<std::shared_ptr<transport::asio::ssl::context>> client =
      transport::MakeClientTlsContext({certs_ + "/client.crt", certs_ + "/client.key", certs_ + "/ca.crt"});
  ASSERT_TRUE(client.ok());
  Result<transport::HttpResponse> no_token = post(*client, "");
  ASSERT_TRUE(no_token.ok()) << no_token.status().ToString();
  EXPECT_EQ(no_token->status, 401);
  // And both: the coordinator answers.
  Result<transport::HttpResponse> admitted = post(*client, token);
  ASSERT_TRUE(admitted.ok()) << admitted.status().ToString();
  EXPECT_EQ(admitted->status, 200) << admitted->body;
  // The trainer's metrics, over the same mutual TLS, pass promtool; a refused submission is
  // one of its series.
  transport::HttpGetOptions get;
  get.tls = *client;
  get.token = token;
  Result<transport::HttpResponse> metrics = transport::HttpGet(*trainer, "/metrics", get);
  ASSERT_TRUE(metrics.ok()) << metrics.status().ToString();
  ASSERT_EQ(metrics->status, 200);
  EXPECT_NE(metrics->body.find("flywheel_submissions_refused_total{role=\"trainer\""), std::string::npos)
      << metrics->body;
  std::optional<std::string> complaints = flywheel::testing::PromtoolComplaints(metrics->body);
  if (!complaints) GTEST_SKIP() << "promtool is not installed (apt install prometheus)";
  EXPECT_EQ(*complaints, "") << metrics->body;
}

TEST(PipelineAlgorithmsTest, EveryAlgorithmTrainsAfterSftAndDpoWarmUp) {
  const fs::path dir = fs::temp_directory_path() /
                       ("flywheel-pipeline-algorithms-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream sft(dir / "sft.jsonl");
    sft << R"({"messages": [{"role": "user", "content": "321>"}, {"role": "assistant", "content": "123", "weight": 1}]})" "\n"
        << R"({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "907>"}, {"role": "assistant", "content": "079"}]})" "\n";
    std::ofstream dpo(dir / "dpo.jsonl");
    dpo << R"({"prompt": "321>", "chosen": "123", "rejected": "321"})" "\n"
        << R"({"prompt": "554>", "chosen": "455", "rejected": "545"})" "\n";
  }
  for (const char* algorithm : {"dapo", "gspo", "cispo"}) {
    SCOPED_TRACE(algorithm);
    RunConfig config = SmallRun();
    config.algorithm.name = algorithm;
    config.sft = {(dir / "sft.jsonl").string(), 3, 4, 1e-3};
    config.dpo = {(dir / "dpo.jsonl").string(), 3, 2, 1e-4, 0.1};
    config.run.max_steps = 3;
    config.fleet.regions = {"us"};
    FleetOptions options;
    options.config = config;
    options.program = FLYWHEEL_BIN;
    options.run_dir = (dir / algorithm).string();
    auto fleet = Fleet::Start(options);
    ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
    Status finished = (*fleet)->WaitTrainer(std::chrono::seconds(120), nullptr);
    ASSERT_TRUE(finished.ok()) << finished.ToString();
    std::ifstream in(fs::path((*fleet)->report_dir()) / "summary.json");
    const json summary = json::parse(in, nullptr, false);
    ASSERT_TRUE(summary.is_object());
    EXPECT_EQ(summary["algorithm"], algorithm);
    EXPECT_EQ(summary["steps"], 3);
    EXPECT_EQ(summary["versions"], 4);  // version 1 after the warm-up, one per step
    for (const std::string& line : (*fleet)->Stop()) ADD_FAILURE() << line;
    std::ifstream log(fs::path((*fleet)->log_dir()) / "trainer.out");
    const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("sft     3/3"), std::string::npos) << text;
    EXPECT_NE(text.find("dpo     3/3"), std::string::npos) << text;
  }
  if (!::testing::Test::HasFailure()) fs::remove_all(dir);
}

// The memory plan (model/memory_plan.h, checked by the trainer at start): a run that cannot
// fit is refused before anything else starts, with the plan in the message.
TEST(MemoryPlanFleetTest, ARunThatCannotFitIsRefusedBeforeAnythingElseStarts) {
  const fs::path dir = fs::temp_directory_path() / ("flywheel-plan-refused-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    // ~400B parameters: no machine this runs on holds 6 TiB of trainer state.
    std::ofstream(dir / "config.json")
        << R"({"model_type": "qwen3", "vocab_size": 15, "hidden_size": 16384, "intermediate_size": 53248,
               "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
               "head_dim": 128, "max_position_embeddings": 4096, "qk_norm": true})";
  }
  RunConfig config = SmallRun();
  config.model.config = (dir / "config.json").string();
  FleetOptions options;
  options.config = config;
  options.program = FLYWHEEL_BIN;
  options.run_dir = (dir / "run").string();
  const auto started = std::chrono::steady_clock::now();
  auto fleet = Fleet::Start(options);
  ASSERT_FALSE(fleet.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(60));
  EXPECT_NE(fleet.status().message().find("does NOT fit"), std::string::npos) << fleet.status().ToString();
  std::ifstream err(dir / "run" / "logs" / "trainer.err");
  const std::string text((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("this run does not fit in this machine's memory"), std::string::npos) << text;
  EXPECT_NE(text.find("weights (fp32 masters)"), std::string::npos) << text;
  EXPECT_NE(text.find("worker (each of 2)"), std::string::npos) << text;  // --local-fleet: the fleet counted
  EXPECT_FALSE(fs::exists(dir / "run" / "trainer.ready"));
  EXPECT_FALSE(fs::exists(dir / "run" / "worker-us-1.ready"));  // nothing else started
  if (!::testing::Test::HasFailure()) fs::remove_all(dir);
}

// A training shape's limits (pipeline/shapes.h), checked by the trainer at start: a run whose
// sequences are longer than the shape's max_context is refused, naming the shape.
TEST(MemoryPlanFleetTest, AShapesContextLimitRefusesALongerRun) {
  const fs::path dir = fs::temp_directory_path() / ("flywheel-shape-limit-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  RunConfig config = SmallRun();
  Result<Shape> shape = FindShape("demo-cpu", "");
  ASSERT_TRUE(shape.ok()) << shape.status().ToString();
  ASSERT_TRUE(ApplyShape(*shape, {"algorithm.max_tokens"}, "demo", config).ok());
  config.algorithm.max_tokens = 100;  // 100 answer tokens: longer than the shape's 64
  FleetOptions options;
  options.config = config;
  options.program = FLYWHEEL_BIN;
  options.run_dir = (dir / "run").string();
  auto fleet = Fleet::Start(options);
  ASSERT_FALSE(fleet.ok());
  EXPECT_NE(fleet.status().message().find("shape 'demo-cpu' allows 64"), std::string::npos)
      << fleet.status().ToString();
  EXPECT_FALSE(fs::exists(dir / "run" / "trainer.ready"));
  if (!::testing::Test::HasFailure()) fs::remove_all(dir);
}

// The plan against the processes' measured peak RSS on the demo's model: the trainer's
// (report/memory.json, getrusage at the end) and a worker's (/v1/status peak_rss_bytes),
// within 15%. On this model the runtime term (libtorch, OpenBLAS) dominates; the 100M
// parameter figures are in docs/BENCHMARKS.md (`flywheel plan`, section Memory plan).
TEST(MemoryPlanFleetTest, ThePlanAgreesWithPeakRssOnTheDemoModel) {
  const fs::path dir = fs::temp_directory_path() / ("flywheel-plan-rss-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  RunConfig config = SmallRun();
  config.run.max_steps = 4;
  config.fleet.regions = {"us"};
  FleetOptions options;
  options.config = config;
  options.program = FLYWHEEL_BIN;
  options.run_dir = (dir / "run").string();
  auto fleet = Fleet::Start(options);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  Status finished = (*fleet)->WaitTrainer(std::chrono::seconds(180), nullptr);
  ASSERT_TRUE(finished.ok()) << finished.ToString();
  Result<json> worker = (*fleet)->WorkerStatus("worker-us-1");
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  std::ifstream in(fs::path((*fleet)->report_dir()) / "memory.json");
  const json record = json::parse(in, nullptr, false);
  ASSERT_TRUE(record.is_object());
  auto within = [](double plan, double measured, const char* what) {
    EXPECT_GT(measured, 0) << what;
    EXPECT_LE(std::abs(plan - measured), 0.15 * measured)
        << what << ": plan " << plan / (1 << 20) << " MiB, measured " << measured / (1 << 20) << " MiB";
  };
  within(record["plan"]["trainer_bytes"].get<double>(), record["trainer_peak_rss_bytes"].get<double>(), "trainer");
  within(record["plan"]["worker_bytes"].get<double>(), (*worker)["peak_rss_bytes"].get<double>(), "worker");
  EXPECT_EQ(record["plan"]["workers"], 1);
  for (const std::string& line : (*fleet)->Stop()) ADD_FAILURE() << line;
  if (!::testing::Test::HasFailure()) fs::remove_all(dir);
}

}  // namespace
}  // namespace flywheel::pipeline
