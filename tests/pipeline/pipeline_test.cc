// The pipeline loop's torch-free parts: run configuration, tasks, the sample coordinator.
#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "grading/protocol.h"
#include "pipeline/coordinator.h"
#include "pipeline/run_config.h"
#include "pipeline/task.h"

namespace flywheel::pipeline {
namespace {

using nlohmann::json;

// The coordinator as the trainer's HTTP routes drive it: JSON bodies in and out.
json ClaimJson(Coordinator& c, const json& request) {
  Result<std::string> answer = c.HandleClaim(request.dump());
  EXPECT_TRUE(answer.ok()) << answer.status().ToString();
  return answer.ok() ? json::parse(*answer) : json();
}
json SubmitJson(Coordinator& c, const json& request) {
  return json::parse(c.HandleSubmit(request.dump()));
}

TEST(RunConfigTest, DefaultsRoundTripThroughToml) {
  RunConfig config;
  config.algorithm.lr = 1.5e-5;
  config.fleet.regions = {"a", "b", "c"};
  config.model.routing_replay = false;
  auto parsed = RunConfig::FromToml(config.ToToml(), "round-trip");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->ToToml(), config.ToToml());
  EXPECT_EQ(parsed->fleet.regions, config.fleet.regions);
  EXPECT_DOUBLE_EQ(parsed->algorithm.lr, 1.5e-5);
  EXPECT_FALSE(parsed->model.routing_replay);
}

TEST(RunConfigTest, EmptyFileIsAllDefaults) {
  auto parsed = RunConfig::FromToml("", "empty");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->ToToml(), RunConfig().ToToml());
}

TEST(RunConfigTest, ErrorsNameTheKey) {
  auto unknown = RunConfig::FromToml("[algorithm]\nlearning_rate = 1e-4\n", "run.toml");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("unknown key algorithm.learning_rate"), std::string::npos)
      << unknown.status().message();
  auto section = RunConfig::FromToml("[optimizer]\nlr = 1\n", "run.toml");
  ASSERT_FALSE(section.ok());
  EXPECT_NE(section.status().message().find("unknown section [optimizer]"), std::string::npos);
  auto type = RunConfig::FromToml("[algorithm]\ngroup_size = \"eight\"\n", "run.toml");
  ASSERT_FALSE(type.ok());
  EXPECT_NE(type.status().message().find("algorithm.group_size must be an integer"), std::string::npos);
  auto range = RunConfig::FromToml("[algorithm]\ngroup_size = 1\n", "run.toml");
  ASSERT_FALSE(range.ok());
  EXPECT_NE(range.status().message().find("algorithm.group_size = 1"), std::string::npos);
  auto syntax = RunConfig::FromToml("[algorithm\n", "run.toml");
  ASSERT_FALSE(syntax.ok());
  EXPECT_NE(syntax.status().message().find("run.toml:1"), std::string::npos) << syntax.status().message();
  auto algorithm = RunConfig::FromToml("[algorithm]\nname = \"reinforce\"\n", "run.toml");
  ASSERT_FALSE(algorithm.ok());
  EXPECT_NE(algorithm.status().message().find("algorithm.name"), std::string::npos);
  auto regions = RunConfig::FromToml("[fleet]\nregions = [\"us\", \"us\"]\n", "run.toml");
  EXPECT_FALSE(regions.ok());
}

TEST(RunConfigTest, GradersAndGradingKeysRoundTrip) {
  const std::string text =
      "[algorithm]\nmax_tokens = 12\nzero_variance_filter = false\n"
      "[grading]\ntimeout_s = 5\nmax_failures = 3\n"
      "[[grader]]\ntype = \"numeric\"\nweight = 0.75\nrel_tol = 0.01\n"
      "[[grader]]\ntype = \"regex\"\nname = \"tagged\"\nweight = 0.25\npattern = \"<a>\\\\d+</a>\"\n";
  auto parsed = RunConfig::FromToml(text, "run.toml");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->algorithm.max_tokens, 12);
  EXPECT_FALSE(parsed->algorithm.zero_variance_filter);
  EXPECT_EQ(parsed->grading.max_failures, 3);
  ASSERT_EQ(parsed->graders.size(), 2u);
  EXPECT_EQ(parsed->graders[0].type, "numeric");
  EXPECT_DOUBLE_EQ(parsed->graders[0].weight, 0.75);
  EXPECT_EQ(parsed->graders[0].params, json({{"rel_tol", 0.01}}));
  EXPECT_EQ(parsed->graders[1].name, "tagged");
  EXPECT_EQ(parsed->graders[1].params["pattern"], "<a>\\d+</a>");
  auto again = RunConfig::FromToml(parsed->ToToml(), "again");
  ASSERT_TRUE(again.ok()) << again.status().ToString() << "\n" << parsed->ToToml();
  EXPECT_EQ(again->ToToml(), parsed->ToToml());
  EXPECT_EQ(again->graders[1].params, parsed->graders[1].params);

  // Bad graders are refused at load, naming the entry; an external grader excludes them.
  auto unknown = RunConfig::FromToml("[[grader]]\ntype = \"telepathy\"\n", "run.toml");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("telepathy"), std::string::npos) << unknown.status().message();
  auto both = RunConfig::FromToml("[grading]\ncommand = \"python3 g.py\"\n[[grader]]\ntype = \"exact_match\"\n",
                                  "run.toml");
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("exclusive"), std::string::npos) << both.status().message();
  auto table = RunConfig::FromToml("[grader]\ntype = \"exact_match\"\n", "run.toml");
  ASSERT_FALSE(table.ok());
  EXPECT_NE(table.status().message().find("[[grader]]"), std::string::npos) << table.status().message();
  EXPECT_FALSE(RunConfig::FromToml("[grading]\ntimeout_s = 0\n", "run.toml").ok());
  auto kl = RunConfig::FromToml("[algorithm]\nkl_coef = -1\n", "run.toml");
  ASSERT_FALSE(kl.ok());
  EXPECT_NE(kl.status().message().find("algorithm.kl_coef"), std::string::npos);
}

TEST(RunConfigTest, Fp8ServingKeys) {
  auto fp8 = RunConfig::FromToml("[model]\nserving = \"fp8\"\nfp8_qat = true\n", "run.toml");
  ASSERT_TRUE(fp8.ok()) << fp8.status().ToString();
  EXPECT_EQ(fp8->model.serving, "fp8");
  EXPECT_TRUE(fp8->model.fp8_qat);
  EXPECT_EQ(RunConfig::FromToml(fp8->ToToml(), "again")->ToToml(), fp8->ToToml());
  auto unknown = RunConfig::FromToml("[model]\nserving = \"int4\"\n", "run.toml");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("model.serving"), std::string::npos);
  auto qat = RunConfig::FromToml("[model]\nfp8_qat = true\n", "run.toml");
  ASSERT_FALSE(qat.ok());
  EXPECT_NE(qat.status().message().find("model.fp8_qat"), std::string::npos)
      << qat.status().message();
}

TEST(RunConfigTest, DapoDefaultsToClipHigher) {
  auto dapo = RunConfig::FromToml("[algorithm]\nname = \"dapo\"\n", "run.toml");
  ASSERT_TRUE(dapo.ok());
  EXPECT_DOUBLE_EQ(dapo->algorithm.clip_high, 0.28);
  auto explicit_clip = RunConfig::FromToml("[algorithm]\nname = \"dapo\"\nclip_high = 0.3\n", "r");
  ASSERT_TRUE(explicit_clip.ok());
  EXPECT_DOUBLE_EQ(explicit_clip->algorithm.clip_high, 0.3);
}

TEST(RunConfigTest, SetOverridesOneKey) {
  RunConfig config;
  ASSERT_TRUE(config.Set("algorithm.lr=2e-4").ok());
  EXPECT_DOUBLE_EQ(config.algorithm.lr, 2e-4);
  ASSERT_TRUE(config.Set("task.name=reverse").ok());  // bare words are strings
  EXPECT_EQ(config.task.name, "reverse");
  ASSERT_TRUE(config.Set("fleet.regions=[\"x\"]").ok());
  EXPECT_EQ(config.fleet.regions, std::vector<std::string>{"x"});
  const RunConfig before = config;
  EXPECT_FALSE(config.Set("algorithm.group_size=0").ok());
  EXPECT_FALSE(config.Set("nodot=1").ok());
  EXPECT_FALSE(config.Set("algorithm.nope=1").ok());
  EXPECT_EQ(config.ToToml(), before.ToToml());  // a refused --set changes nothing
}

TEST(TaskTest, AnswersAreRightAndHeldOutIsDisjoint) {
  for (const char* name : {"sort", "reverse", "add"}) {
    auto task = Task::Create({name, 3});
    ASSERT_TRUE(task.ok()) << name;
    std::mt19937_64 rng(7);
    for (int i = 0; i < 200; ++i) {
      const Problem p = (*task)->Sample(rng, false);
      EXPECT_FALSE(Task::IsHeldOut(p.prompt));
      EXPECT_LE(static_cast<int>(p.answer.size()), (*task)->max_answer_chars());
      EXPECT_LE(static_cast<int>(p.prompt.size()), (*task)->max_prompt_chars());
      const std::string digits = p.prompt.substr(0, p.prompt.size() - 1);
      if (std::string(name) == "sort") {
        std::string sorted = digits;
        std::sort(sorted.begin(), sorted.end());
        EXPECT_EQ(p.answer, sorted);
      } else if (std::string(name) == "reverse") {
        EXPECT_EQ(p.answer, std::string(digits.rbegin(), digits.rend()));
      } else {
        const size_t plus = digits.find('+');
        EXPECT_EQ(std::stoi(p.answer), std::stoi(digits.substr(0, plus)) + std::stoi(digits.substr(plus + 1)));
      }
    }
    const auto held_out = (*task)->HeldOut(50, 1);
    EXPECT_EQ(held_out.size(), 50u);
    std::set<std::string> prompts;
    for (const auto& p : held_out) {
      EXPECT_TRUE(Task::IsHeldOut(p.prompt));
      prompts.insert(p.prompt);
    }
    EXPECT_EQ(prompts.size(), 50u);  // distinct
  }
  EXPECT_FALSE(Task::Create({"sort", 0}).ok());
  EXPECT_FALSE(Task::Create({"multiply", 3}).ok());
  EXPECT_EQ(Task::Reward("123", "123"), 1.0);
  EXPECT_EQ(Task::Reward("1234", "123"), 0.0);
}

// A coordinator over the sort task with small groups.
class CoordinatorTest : public ::testing::Test {
 protected:
  CoordinatorTest() : task_(std::move(Task::Create({"sort", 3}).value())) {}

  std::unique_ptr<Coordinator> Make(int64_t k, int64_t groups_per_step = 2,
                                    std::chrono::milliseconds lease = std::chrono::seconds(20)) {
    CoordinatorOptions options;
    options.group_size = 2;
    options.groups_per_step = groups_per_step;
    options.max_staleness = k;
    options.lease = lease;
    options.vocab_size = 15;
    options.env = &clock_;
    auto c = std::make_unique<Coordinator>(*task_, options);
    c->SetVersion(1);
    return c;
  }

  static json Claim(Coordinator& c, const std::string& worker, uint64_t version, int64_t max,
                    const std::string& incarnation = "a") {
    return ClaimJson(c, {{"worker", worker}, {"incarnation", incarnation}, {"version", version},
                    {"max_groups", max}, {"serving_since_unix_us", 1000}});
  }
  // A one-group claim from a worker that began serving `version` at `since` (unix us).
  static json ClaimServing(Coordinator& c, const std::string& worker, uint64_t version, int64_t since) {
    return ClaimJson(c, {{"worker", worker}, {"incarnation", "a"}, {"version", version},
                         {"max_groups", 1}, {"serving_since_unix_us", since}});
  }
  static json Sample(uint64_t version, double reward = 1) {
    return {{"prompt_tokens", {13, 1, 2, 3, 12}}, {"tokens", {1, 2, 3, 14}},
            {"logprobs", {-0.1, -0.2, -0.3, -0.4}}, {"versions", {version, version, version, version}},
            {"reward", reward}};
  }
  static json Submit(Coordinator& c, const std::string& worker, uint64_t claim, uint64_t version,
                     const std::string& incarnation = "a") {
    return SubmitJson(c, {{"worker", worker}, {"incarnation", incarnation}, {"claim", claim},
                     {"samples", {Sample(version), Sample(version, 0)}}});
  }
  // The coordinators' clock stands still, so a deadline of now means: what is queued,
  // without waiting.
  Coordinator::Clock::time_point Now() { return clock_.SteadyNow(); }

  ManualClock clock_;  // leases lapse when the test advances it, not by sleeping
  std::unique_ptr<Task> task_;
};

TEST_F(CoordinatorTest, ClaimSubmitTake) {
  auto c = Make(/*k=*/1);
  json claim = Claim(*c, "w1", 1, 2);
  ASSERT_EQ(claim["status"], "ok") << claim.dump();
  ASSERT_EQ(claim["groups"].size(), 2u);
  EXPECT_EQ(claim["group_size"], 2);
  for (const json& g : claim["groups"]) {
    EXPECT_FALSE(Task::IsHeldOut(g["prompt"].get<std::string>()));
    EXPECT_TRUE(Submit(*c, "w1", g["claim"], 1)["accepted"].get<bool>());
  }
  const auto batch = c->TakeBatch(Now());
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_EQ(batch[0].samples.size(), 2u);
  EXPECT_EQ(batch[0].worker, "w1");
  EXPECT_EQ(c->stats().groups_trained, 2u);
  EXPECT_EQ(c->stats().groups_by_worker.at("w1"), 2u);
}

TEST_F(CoordinatorTest, SynchronousModeWaitsForTheNextVersion) {
  auto c = Make(/*k=*/0);
  json first = Claim(*c, "w1", 1, 8);
  ASSERT_EQ(first["groups"].size(), 2u);  // exactly one batch
  EXPECT_EQ(Claim(*c, "w2", 1, 8)["status"], "wait");
  for (const json& g : first["groups"]) Submit(*c, "w1", g["claim"], 1);
  ASSERT_EQ(c->TakeBatch(Now()).size(), 2u);
  // Training: version 1 samples would be stale for the batch at version 2.
  EXPECT_EQ(Claim(*c, "w1", 1, 8)["status"], "wait");
  c->SetVersion(2);
  EXPECT_EQ(Claim(*c, "w1", 1, 8)["status"], "wait");  // the worker has not swapped yet
  EXPECT_EQ(Claim(*c, "w1", 2, 8)["groups"].size(), 2u);
}

TEST_F(CoordinatorTest, PacingKeepsStalenessBounded) {
  auto c = Make(/*k=*/2);
  // At version 1 three batches may be out: they train at versions 1, 2 and 3.
  EXPECT_EQ(Claim(*c, "w1", 1, 100)["groups"].size(), 6u);
  EXPECT_EQ(Claim(*c, "w2", 1, 100)["status"], "wait");
  // A worker two versions behind gets nothing.
  c->SetVersion(3);
  EXPECT_EQ(Claim(*c, "w3", 1, 100)["status"], "wait");
  // A worker claiming ahead of the trainer (after a trainer restart) waits too.
  EXPECT_EQ(Claim(*c, "w3", 9, 100)["status"], "wait");
}

TEST_F(CoordinatorTest, StaleGroupsAreDroppedAndTheirPromptsRequeued) {
  auto c = Make(/*k=*/1, /*groups_per_step=*/1);
  json claim = Claim(*c, "w1", 1, 1);
  const std::string prompt = claim["groups"][0]["prompt"];
  c->SetVersion(3);  // the trainer moved on meanwhile (other workers)
  ASSERT_TRUE(Submit(*c, "w1", claim["groups"][0]["claim"], 1)["accepted"].get<bool>());
  EXPECT_TRUE(c->TakeBatch(Now()).empty());
  EXPECT_EQ(c->stats().samples_dropped_stale, 2u);
  EXPECT_EQ(c->stats().groups_dropped_stale, 1u);
  // The prompt comes back first.
  json again = Claim(*c, "w1", 3, 1);
  EXPECT_EQ(again["groups"][0]["prompt"], prompt);
}

TEST_F(CoordinatorTest, LapsedLeaseRequeuesAndRefusesTheLateSubmission) {
  auto c = Make(/*k=*/1, 1, std::chrono::milliseconds(50));
  json claim = Claim(*c, "w1", 1, 1);
  const uint64_t id = claim["groups"][0]["claim"];
  const std::string prompt = claim["groups"][0]["prompt"];
  clock_.Advance(std::chrono::milliseconds(80));
  json other = Claim(*c, "w2", 1, 1);  // expires w1's lease, hands its prompt out again
  EXPECT_EQ(other["groups"][0]["prompt"], prompt);
  EXPECT_EQ(c->stats().leases_expired, 1u);
  json late = Submit(*c, "w1", id, 1);
  EXPECT_FALSE(late["accepted"].get<bool>());
  EXPECT_NE(late["reason"].get<std::string>().find("not out"), std::string::npos);
  // Submitting twice counts once.
  const uint64_t id2 = other["groups"][0]["claim"];
  EXPECT_TRUE(Submit(*c, "w2", id2, 1)["accepted"].get<bool>());
  EXPECT_FALSE(Submit(*c, "w2", id2, 1)["accepted"].get<bool>());
  EXPECT_EQ(c->stats().groups_accepted, 1u);
  EXPECT_EQ(c->stats().submissions_refused, 2u);
}

TEST_F(CoordinatorTest, RestartedWorkerReleasesItsClaims) {
  auto c = Make(/*k=*/1, 2);
  json claim = Claim(*c, "w1", 1, 2, "first");
  ASSERT_EQ(claim["groups"].size(), 2u);
  json after = Claim(*c, "w1", 1, 4, "second");  // same worker, new incarnation
  EXPECT_EQ(c->stats().leases_expired, 2u);
  ASSERT_EQ(after["groups"].size(), 4u);
  EXPECT_EQ(after["groups"][0]["prompt"], claim["groups"][0]["prompt"]);
  // The old incarnation's submission is refused.
  EXPECT_FALSE(Submit(*c, "w1", claim["groups"][0]["claim"], 1, "first")["accepted"].get<bool>());
}

TEST_F(CoordinatorTest, MalformedSubmissionsAreRefusedAndThePromptReturns) {
  auto c = Make(/*k=*/1, 1);
  json claim = Claim(*c, "w1", 1, 1);
  const uint64_t id = claim["groups"][0]["claim"];
  json bad_token = {{"worker", "w1"}, {"incarnation", "a"}, {"claim", id},
                    {"samples", {Sample(1), Sample(1)}}};
  bad_token["samples"][1]["tokens"] = {1, 99, 3, 14};  // outside the vocabulary
  json answer = SubmitJson(*c, bad_token);
  EXPECT_FALSE(answer["accepted"].get<bool>());
  EXPECT_NE(answer["reason"].get<std::string>().find("outside the vocabulary"), std::string::npos);
  EXPECT_EQ(Claim(*c, "w1", 1, 1)["groups"][0]["prompt"], claim["groups"][0]["prompt"]);
  for (json broken : {json{{"claim", "x"}}, json::array(), json{{"worker", "w1"}, {"claim", 1}}}) {
    EXPECT_FALSE(SubmitJson(*c, broken)["accepted"].get<bool>()) << broken.dump();
  }
  // A claim that does not parse is an error (HTTP 400 in the one error shape), no answer.
  for (json broken : {json::array(), json{{"worker", ""}, {"version", 1}}}) {
    Result<std::string> answer = c->HandleClaim(broken.dump());
    ASSERT_FALSE(answer.ok()) << broken.dump();
    EXPECT_EQ(answer.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(answer.status().message().find("bad claim request"), std::string::npos)
        << answer.status().message();
  }
}

TEST_F(CoordinatorTest, OverlongSamplesAndBadRoutingAreRefused) {
  auto c = Make(/*k=*/1, 1);
  const auto submit = [&](const std::function<void(json&)>& spoil) {
    json claim = Claim(*c, "w1", 1, 1);
    json request = {{"worker", "w1"}, {"incarnation", "a"}, {"claim", claim["groups"][0]["claim"]},
                    {"samples", {Sample(1), Sample(1)}}};
    spoil(request["samples"][0]);
    return SubmitJson(*c, request);
  };
  json longer = submit([](json& s) {  // more generated tokens than max_tokens (8)
    s["tokens"] = json::array();
    s["logprobs"] = json::array();
    s["versions"] = json::array();
    for (int i = 0; i < 9; ++i) {
      s["tokens"].push_back(1);
      s["logprobs"].push_back(-0.5);
      s["versions"].push_back(1);
    }
  });
  EXPECT_FALSE(longer["accepted"].get<bool>());
  EXPECT_NE(longer["reason"].get<std::string>().find("longer than the claim allows"), std::string::npos);
  json routed = submit([](json& s) {  // routing for a dense model
    s["routing"] = json::array();
    for (int i = 0; i < 8; ++i) s["routing"].push_back(0);
    s["routing_shape"] = {8, 1, 1};
  });
  EXPECT_FALSE(routed["accepted"].get<bool>());
  EXPECT_NE(routed["reason"].get<std::string>().find("routing"), std::string::npos);
  EXPECT_EQ(c->stats().groups_accepted, 0u);
}

TEST_F(CoordinatorTest, SyncLatencyFromTheWorkersClaims) {
  auto c = Make(/*k=*/1);
  auto claim = [&](const std::string& w, uint64_t v, int64_t since) { return ClaimServing(*c, w, v, since); };
  claim("w1", 1, 1'000);
  claim("w2", 1, 1'000);
  c->NotePublished(2, 10'000);
  EXPECT_TRUE(c->TakeSynced().empty());
  claim("w1", 2, 30'000);
  EXPECT_TRUE(c->TakeSynced().empty());  // w2 still serves 1
  claim("w2", 2, 50'000);
  auto synced = c->TakeSynced();
  ASSERT_EQ(synced.size(), 1u);
  EXPECT_EQ(synced[0].version, 2u);
  EXPECT_DOUBLE_EQ(synced[0].ms, 40.0);  // the last worker's swap, 40 ms after publishing
  EXPECT_EQ(synced[0].workers, 2u);
  EXPECT_TRUE(c->TakeSynced().empty());  // reported once
}

TEST_F(CoordinatorTest, LeaseHoldsUntilTheClockPassesIt) {
  auto c = Make(/*k=*/1, 1, std::chrono::milliseconds(50));
  json claim = Claim(*c, "w1", 1, 1);
  const std::string prompt = claim["groups"][0]["prompt"];
  clock_.Advance(std::chrono::milliseconds(49));
  json other = Claim(*c, "w2", 1, 1);
  EXPECT_NE(other["groups"][0]["prompt"], prompt);
  EXPECT_EQ(c->stats().leases_expired, 0u);
  clock_.Advance(std::chrono::milliseconds(1));  // exactly at the lease's end it lapses
  EXPECT_EQ(Claim(*c, "w3", 1, 1)["groups"][0]["prompt"], prompt);
  EXPECT_EQ(c->stats().leases_expired, 1u);
}

TEST_F(CoordinatorTest, TakeBatchWaitsUntilTheDrivenDeadline) {
  auto c = Make(/*k=*/1);
  std::atomic<bool> returned{false};
  std::thread trainer([&] {
    EXPECT_TRUE(c->TakeBatch(Now() + std::chrono::seconds(30)).empty());
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(returned);  // 30 s of the coordinator's clock do not pass by themselves
  clock_.Advance(std::chrono::seconds(30));
  trainer.join();
  EXPECT_TRUE(returned);
}

TEST_F(CoordinatorTest, SyncLatencyCountsOnlyWorkersThatClaimedInTheLastFiveSeconds) {
  auto c = Make(/*k=*/1);
  auto claim = [&](const std::string& w, uint64_t v, int64_t since) { return ClaimServing(*c, w, v, since); };
  claim("w1", 1, 1'000);
  claim("w2", 1, 1'000);
  c->NotePublished(2, 10'000);
  claim("w1", 2, 30'000);
  EXPECT_TRUE(c->TakeSynced().empty());  // w2 still serves 1 and is live
  clock_.Advance(std::chrono::seconds(6));
  claim("w1", 2, 30'000);  // w2 has been silent for 6 s: no longer live
  auto synced = c->TakeSynced();
  ASSERT_EQ(synced.size(), 1u);
  EXPECT_EQ(synced[0].workers, 1u);
  EXPECT_DOUBLE_EQ(synced[0].ms, 20.0);
}

}  // namespace
}  // namespace flywheel::pipeline

namespace flywheel::pipeline {
namespace {

// A grader that answers what the test says, when the test says: each request waits in
// `pending` until Answer() or Fail().
class ScriptedGrader final : public grading::AsyncGrader {
 public:
  void Submit(grading::Sample sample, grading::OutcomeCallback done) override {
    std::lock_guard lock(mu_);
    samples_.push_back(sample);
    pending_.push_back(std::move(done));
  }
  // Completes the oldest request with `outcome`, on another thread (as a grader does).
  void Answer(grading::Outcome outcome) {
    grading::OutcomeCallback done;
    {
      std::lock_guard lock(mu_);
      ASSERT_FALSE(pending_.empty());
      done = std::move(pending_.front());
      pending_.pop_front();
    }
    std::thread([done = std::move(done), outcome = std::move(outcome)]() mutable { done(std::move(outcome)); })
        .join();
  }
  Status status() const override { return Status::Ok(); }
  grading::GraderCounters counters() const override { return {}; }
  std::string name() const override { return "scripted"; }
  std::vector<grading::Sample> samples() {
    std::lock_guard lock(mu_);
    return samples_;
  }

 private:
  std::mutex mu_;
  std::vector<grading::Sample> samples_;
  std::deque<grading::OutcomeCallback> pending_;
};

class CoordinatorGradingTest : public ::testing::Test {
 protected:
  CoordinatorGradingTest() : task_(std::move(Task::Create({"sort", 3}).value())) {}

  std::unique_ptr<Coordinator> Make(bool zero_variance = true) {
    CoordinatorOptions options;
    options.group_size = 3;
    options.groups_per_step = 1;
    options.max_staleness = 1;
    options.vocab_size = 15;
    options.env = &clock_;
    options.grader = &grader_;
    options.zero_variance_filter = zero_variance;
    // The sort task's CharTokenizer ids: '0'..'9' are 0..9, EOS is 14.
    options.decode = [](const std::vector<int32_t>& tokens) -> Result<std::string> {
      std::string text;
      for (int32_t id : tokens) {
        if (id == 14) break;
        if (id > 9) return Status::InvalidArgument("not a digit");
        text.push_back(static_cast<char>('0' + id));
      }
      return text;
    };
    auto c = std::make_unique<Coordinator>(*task_, options);
    c->SetVersion(1);
    return c;
  }
  // Claims one group and submits three samples whose tokens are `answers` (digit strings).
  static void ClaimAndSubmit(Coordinator& c, const std::vector<std::vector<int32_t>>& answers) {
    json claim = ClaimJson(c, {{"worker", "w"}, {"incarnation", "a"}, {"version", 1}, {"max_groups", 1},
                               {"serving_since_unix_us", 1000}});
    ASSERT_EQ(claim["status"], "ok") << claim.dump();
    json samples = json::array();
    for (const auto& tokens : answers) {
      std::vector<float> logprobs(tokens.size(), -0.5f);
      std::vector<uint64_t> versions(tokens.size(), 1);
      // The worker's own reward is ignored when the run has a grader.
      samples.push_back({{"prompt_tokens", {13, 1, 2, 3, 12}}, {"tokens", tokens},
                         {"logprobs", logprobs}, {"versions", versions}, {"reward", 7.0}});
    }
    json answer = SubmitJson(c, {{"worker", "w"}, {"incarnation", "a"},
                                 {"claim", claim["groups"][0]["claim"]}, {"samples", samples}});
    ASSERT_TRUE(answer["accepted"].get<bool>()) << answer.dump();
  }
  Coordinator::Clock::time_point Now() { return clock_.SteadyNow(); }

  ManualClock clock_;
  ScriptedGrader grader_;
  std::unique_ptr<Task> task_;
};

TEST_F(CoordinatorGradingTest, GroupsWaitForTheGraderAndUngradedSamplesAreLeftOut) {
  auto c = Make();
  ClaimAndSubmit(*c, {{1, 2, 14}, {2, 1, 14}, {1, 14}});
  // The grader saw each completion decoded, with the problem as messages and fields.
  const std::vector<grading::Sample> seen = grader_.samples();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].completion, "12");
  EXPECT_EQ(seen[1].completion, "21");
  EXPECT_EQ(seen[0].completion_tokens, 3);
  ASSERT_TRUE(seen[0].messages.is_array());
  EXPECT_EQ(seen[0].messages[0]["role"], "user");
  EXPECT_TRUE(seen[0].fields.contains("answer"));
  EXPECT_NE(seen[0].id, seen[1].id);
  // Nothing to train on until every sample has its outcome.
  EXPECT_TRUE(c->TakeBatch(Now()).empty());
  EXPECT_EQ(c->stats().groups_grading, 1u);
  grader_.Answer(grading::Outcome::Reward(1.0));
  grader_.Answer(grading::Outcome::Ungraded("timed out"));
  EXPECT_TRUE(c->TakeBatch(Now()).empty());
  grader_.Answer(grading::Outcome::Reward(0.25));
  const auto batch = c->TakeBatch(Now());
  ASSERT_EQ(batch.size(), 1u);
  ASSERT_EQ(batch[0].samples.size(), 2u);  // the ungraded one is left out
  EXPECT_EQ(batch[0].samples[0].reward, 1.0);
  EXPECT_EQ(batch[0].samples[1].reward, 0.25);
  EXPECT_EQ(batch[0].samples[1].tokens, (std::vector<int32_t>{1, 14}));
  const CoordinatorStats stats = c->stats();
  EXPECT_EQ(stats.samples_graded, 2u);
  EXPECT_EQ(stats.samples_ungraded, 1u);
  EXPECT_EQ(stats.groups_grading, 0u);
  EXPECT_TRUE(c->failure().ok());
}

TEST_F(CoordinatorGradingTest, ZeroVarianceGroupsAreDroppedAndCounted) {
  auto c = Make(/*zero_variance=*/true);
  ClaimAndSubmit(*c, {{1, 14}, {2, 14}, {3, 14}});
  for (int i = 0; i < 3; ++i) grader_.Answer(grading::Outcome::Reward(0.0));
  EXPECT_TRUE(c->TakeBatch(Now()).empty());
  EXPECT_EQ(c->stats().groups_zero_variance, 1u);
  // A group with one graded sample carries no advantage either.
  ClaimAndSubmit(*c, {{1, 14}, {2, 14}, {3, 14}});
  grader_.Answer(grading::Outcome::Reward(1.0));
  grader_.Answer(grading::Outcome::Ungraded("not JSON"));
  grader_.Answer(grading::Outcome::Ungraded("not JSON"));
  EXPECT_TRUE(c->TakeBatch(Now()).empty());
  EXPECT_EQ(c->stats().groups_too_few_graded, 1u);

  // With the filter off, an all-equal group is trained on (its advantages are zero).
  auto kept = Make(/*zero_variance=*/false);
  ClaimAndSubmit(*kept, {{1, 14}, {2, 14}, {3, 14}});
  for (int i = 0; i < 3; ++i) grader_.Answer(grading::Outcome::Reward(0.0));
  EXPECT_EQ(kept->TakeBatch(Now()).size(), 1u);
}

TEST_F(CoordinatorGradingTest, ACompletionThatDoesNotDecodeIsUngradedWithoutTheGrader) {
  auto c = Make();
  ClaimAndSubmit(*c, {{1, 14}, {12, 14}, {3, 14}});  // 12 ('>') is not a digit to the decoder
  EXPECT_EQ(grader_.samples().size(), 2u);
  grader_.Answer(grading::Outcome::Reward(1.0));
  grader_.Answer(grading::Outcome::Reward(0.0));
  const auto batch = c->TakeBatch(Now());
  ASSERT_EQ(batch.size(), 1u);
  EXPECT_EQ(batch[0].samples.size(), 2u);
  EXPECT_EQ(c->stats().samples_ungraded, 1u);
}

TEST_F(CoordinatorGradingTest, AFailedGraderStopsTakeBatchWithItsMessage) {
  auto c = Make();
  ClaimAndSubmit(*c, {{1, 14}, {2, 14}, {3, 14}});
  grading::Outcome failed;
  failed.kind = grading::OutcomeKind::kFailed;
  failed.reason = "grader 'python3 grade.py' failed: 21 ungraded in a row; stderr: Traceback";
  grader_.Answer(failed);
  // Returns at once (no deadline wait), with the grader's message in failure().
  EXPECT_TRUE(c->TakeBatch(Now() + std::chrono::hours(1)).empty());
  ASSERT_FALSE(c->failure().ok());
  EXPECT_NE(c->failure().message().find("Traceback"), std::string::npos);
  grader_.Answer(grading::Outcome::Reward(1.0));
  grader_.Answer(grading::Outcome::Reward(0.0));
}

// Multi-turn: the worker posts each turn; the environment (the grader) answers messages to
// continue with, then a reward; the submission carries every turn with its mask.
class CoordinatorEpisodeTest : public CoordinatorGradingTest {
 protected:
  // Token ids decode to digits; 14 ends the text (or `decode`).
  std::unique_ptr<Coordinator> MakeEpisodes(int64_t max_turns,
                                            std::function<Result<std::string>(const std::vector<int32_t>&)> decode = {}) {
    CoordinatorOptions options;
    options.group_size = 2;
    options.groups_per_step = 1;
    options.max_staleness = 1;
    options.vocab_size = 15;
    options.max_tokens = 4;
    options.env = &clock_;
    options.grader = &grader_;
    options.zero_variance_filter = true;
    options.max_turns = max_turns;
    options.max_episode_tokens = 32;
    options.decode = [](const std::vector<int32_t>& tokens) -> Result<std::string> {
      std::string text;
      for (int32_t id : tokens) {
        if (id == 14) break;
        text.push_back(static_cast<char>('0' + id));
      }
      return text;
    };
    if (decode) options.decode = std::move(decode);
    auto c = std::make_unique<Coordinator>(*task_, options);
    c->SetVersion(1);
    return c;
  }
  // Posts a turn on another thread (HandleTurn waits for the grader) and answers it.
  json Turn(Coordinator& c, uint64_t claim, const json& samples, const std::vector<grading::Outcome>& outcomes) {
    const json request = {{"worker", "w"}, {"incarnation", "a"}, {"claim", claim}, {"samples", samples}};
    Result<std::string> answer = Status::Internal("not run");
    std::thread turn([&] { answer = c.HandleTurn(request.dump()); });
    for (const grading::Outcome& outcome : outcomes) {
      while (grader_.samples().size() <= answered_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ++answered_;
      grader_.Answer(outcome);
    }
    turn.join();
    EXPECT_TRUE(answer.ok()) << answer.status().ToString();
    return answer.ok() ? json::parse(*answer) : json();
  }
  size_t answered_ = 0;
};

TEST_F(CoordinatorEpisodeTest, EpisodesContinueWithTheEnvironmentsMessagesAndEndInItsReward) {
  auto c = MakeEpisodes(/*max_turns=*/3);
  json claim = ClaimJson(*c, {{"worker", "w"}, {"incarnation", "a"}, {"version", 1}, {"max_groups", 1},
                              {"serving_since_unix_us", 1000}});
  ASSERT_EQ(claim["status"], "ok") << claim.dump();
  EXPECT_EQ(claim["max_turns"], 3);
  ASSERT_TRUE(claim["groups"][0]["messages"].is_array());
  const uint64_t id = claim["groups"][0]["claim"];
  grading::Outcome tool;
  tool.kind = grading::OutcomeKind::kContinue;
  tool.messages = json::parse(R"([{"role": "tool", "content": "7"}])");
  // Turn 1: both episodes call the "tool".
  json first = Turn(*c, id, {{{"index", 0}, {"tokens", {1, 14}}}, {{"index", 1}, {"tokens", {2, 14}}}}, {tool, tool});
  ASSERT_EQ(first["samples"].size(), 2u) << first.dump();
  EXPECT_EQ(first["samples"][0]["kind"], "continue");
  EXPECT_EQ(first["samples"][0]["messages"][0]["content"], "7");
  // The environment saw the conversation so far and this turn's completion.
  EXPECT_EQ(grader_.samples()[0].completion, "1");
  // Turn 2: one is right, the other wrong.
  json second = Turn(*c, id, {{{"index", 0}, {"tokens", {7, 14}}}, {{"index", 1}, {"tokens", {3, 14}}}},
                     {grading::Outcome::Reward(1.0), grading::Outcome::Reward(0.0)});
  EXPECT_EQ(second["samples"][1]["kind"], "reward");
  const json conversation = grader_.samples()[2].messages;
  ASSERT_EQ(conversation.size(), 3u) << conversation.dump();  // user, assistant "1", tool "7"
  EXPECT_EQ(conversation[1]["content"], "1");
  EXPECT_EQ(conversation[2]["role"], "tool");
  // A finished episode takes no more turns.
  EXPECT_FALSE(c->HandleTurn(json({{"worker", "w"}, {"incarnation", "a"}, {"claim", id},
                                   {"samples", {{{"index", 0}, {"tokens", {1}}}}}}).dump()).ok());

  // The submission: model tokens (mask 1) and the environment's (mask 0) of both turns.
  json samples = json::array();
  for (int i = 0; i < 2; ++i) {
    samples.push_back({{"prompt_tokens", {13, 1, 2, 3, 12}}, {"tokens", {1, 14, 7, 7, 14}},
                       {"logprobs", {-0.1, -0.1, 0, -0.2, -0.2}}, {"versions", {1, 1, 1, 1, 1}},
                       {"mask", {1, 1, 0, 1, 1}}, {"reward", 0}});
  }
  json answer = SubmitJson(*c, {{"worker", "w"}, {"incarnation", "a"}, {"claim", id}, {"samples", samples}});
  ASSERT_TRUE(answer["accepted"].get<bool>()) << answer.dump();
  const auto batch = c->TakeBatch(Now());
  ASSERT_EQ(batch.size(), 1u);
  EXPECT_EQ(batch[0].samples[0].reward, 1.0);
  EXPECT_EQ(batch[0].samples[1].reward, 0.0);
  EXPECT_EQ(batch[0].samples[0].mask, (std::vector<uint8_t>{1, 1, 0, 1, 1}));
  const CoordinatorStats stats = c->stats();
  EXPECT_EQ(stats.episodes, 2u);
  EXPECT_EQ(stats.episode_turns, 4u);
  EXPECT_EQ(stats.episode_env_tokens, 2u);
  EXPECT_EQ(stats.episode_model_tokens, 8u);
}

// The environment gets each model turn as an OpenAI assistant message with its tool calls
// parsed (as the serving layer parses them), this turn's and every earlier one's.
TEST_F(CoordinatorEpisodeTest, TheEnvironmentSeesToolCallsParsed) {
  auto c = MakeEpisodes(/*max_turns=*/3, [](const std::vector<int32_t>& tokens) -> Result<std::string> {
    if (tokens.front() == 5)
      return std::string("Let me compute.\n<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"x\": 7, \"a\": [1]}}\n</tool_call>");
    return std::string("1");
  });
  json claim = ClaimJson(*c, {{"worker", "w"}, {"incarnation", "a"}, {"version", 1}, {"max_groups", 1},
                              {"serving_since_unix_us", 1000}});
  const uint64_t id = claim["groups"][0]["claim"];
  grading::Outcome tool;
  tool.kind = grading::OutcomeKind::kContinue;
  tool.messages = json::parse(R"([{"role": "tool", "tool_call_id": "x", "content": "7"}])");
  Turn(*c, id, {{{"index", 0}, {"tokens", {5, 14}}}, {{"index", 1}, {"tokens", {1, 14}}}}, {tool, tool});
  const json called = grader_.samples()[0].message;
  EXPECT_EQ(called["role"], "assistant");
  EXPECT_EQ(called["content"], "Let me compute.");
  ASSERT_EQ(called["tool_calls"].size(), 1u) << called.dump();
  EXPECT_EQ(called["tool_calls"][0]["type"], "function");
  EXPECT_EQ(called["tool_calls"][0]["function"]["name"], "calc");
  EXPECT_EQ(json::parse(called["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json::parse(R"({"x": 7, "a": [1]})"));
  EXPECT_EQ(called["tool_calls"][0]["id"].get<std::string>().rfind("call_", 0), 0u);
  // On the wire to an external environment, beside the completion text.
  EXPECT_EQ(grading::protocol::RequestJson(grader_.samples()[0])["message"], called);
  EXPECT_EQ(grader_.samples()[0].completion.find("<tool_call>"), 16u);  // the text as written
  // A turn without calls is plain content.
  EXPECT_EQ(grader_.samples()[1].message, json({{"role", "assistant"}, {"content", "1"}}));
  // The next turn's conversation carries the parsed call.
  Turn(*c, id, {{{"index", 0}, {"tokens", {1, 14}}}, {{"index", 1}, {"tokens", {1, 14}}}},
       {grading::Outcome::Reward(1.0), grading::Outcome::Reward(0.0)});
  const json conversation = grader_.samples()[2].messages;
  ASSERT_EQ(conversation.size(), 3u) << conversation.dump();
  EXPECT_EQ(conversation[1], called);
  EXPECT_EQ(conversation[2]["role"], "tool");
}

TEST_F(CoordinatorEpisodeTest, AnEpisodeStillGoingAfterMaxTurnsIsUngradedAndMasksAreChecked) {
  auto c = MakeEpisodes(/*max_turns=*/1 + 1);
  json claim = ClaimJson(*c, {{"worker", "w"}, {"incarnation", "a"}, {"version", 1}, {"max_groups", 1},
                              {"serving_since_unix_us", 1000}});
  const uint64_t id = claim["groups"][0]["claim"];
  grading::Outcome more;
  more.kind = grading::OutcomeKind::kContinue;
  more.messages = json::parse(R"([{"role": "user", "content": "again"}])");
  Turn(*c, id, {{{"index", 0}, {"tokens", {1, 14}}}, {{"index", 1}, {"tokens", {1, 14}}}}, {more, more});
  json last = Turn(*c, id, {{{"index", 0}, {"tokens", {1, 14}}}, {{"index", 1}, {"tokens", {1, 14}}}},
                   {more, grading::Outcome::Reward(1.0)});
  EXPECT_EQ(last["samples"][0]["kind"], "ungraded");
  EXPECT_NE(last["samples"][0]["reason"].get<std::string>().find("max_turns"), std::string::npos);
  EXPECT_EQ(c->stats().episodes_max_turns, 1u);
  // A multi-turn sample without a mask is refused (and its prompt requeued).
  json samples = json::array();
  for (int i = 0; i < 2; ++i) {
    samples.push_back({{"prompt_tokens", {13, 1}}, {"tokens", {1, 14}}, {"logprobs", {-0.1, -0.1}},
                       {"versions", {1, 1}}, {"reward", 0}});
  }
  json refused = SubmitJson(*c, {{"worker", "w"}, {"incarnation", "a"}, {"claim", id}, {"samples", samples}});
  EXPECT_FALSE(refused["accepted"].get<bool>());
  EXPECT_NE(refused["reason"].get<std::string>().find("mask"), std::string::npos) << refused.dump();
  // A turn for a claim that is not out is refused.
  EXPECT_FALSE(c->HandleTurn(json({{"worker", "w"}, {"incarnation", "a"}, {"claim", id},
                                   {"samples", {{{"index", 0}, {"tokens", {1}}}}}}).dump()).ok());
}

TEST_F(CoordinatorEpisodeTest, OneTurnOfAClaimAtATime) {
  auto c = MakeEpisodes(/*max_turns=*/3);
  json claim = ClaimJson(*c, {{"worker", "w"}, {"incarnation", "a"}, {"version", 1}, {"max_groups", 1},
                              {"serving_since_unix_us", 1000}});
  EXPECT_EQ(claim["max_episode_tokens"], 32);
  const uint64_t id = claim["groups"][0]["claim"];
  const std::string turn =
      json({{"worker", "w"}, {"incarnation", "a"}, {"claim", id}, {"samples", {{{"index", 0}, {"tokens", {1, 14}}}}}})
          .dump();
  Result<std::string> first = Status::Internal("not run");
  std::thread waiting([&] { first = c->HandleTurn(turn); });
  while (grader_.samples().empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // A turn at the environment keeps the claim alive past its lease.
  clock_.Advance(std::chrono::seconds(120));
  ClaimJson(*c, {{"worker", "w2"}, {"incarnation", "b"}, {"version", 1}, {"max_groups", 1},
                 {"serving_since_unix_us", 1000}});  // a claim expires lapsed leases
  EXPECT_EQ(c->stats().leases_expired, 0u);
  // A second turn of the same claim while the first is at the environment is refused.
  Result<std::string> second = c->HandleTurn(turn);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("already"), std::string::npos) << second.status().ToString();
  grader_.Answer(grading::Outcome::Reward(1.0));
  waiting.join();
  EXPECT_TRUE(first.ok()) << first.status().ToString();
  // Empty turns and a sample twice in one turn are refused.
  const auto turn_of = [&](const json& samples) {
    return c->HandleTurn(json({{"worker", "w"}, {"incarnation", "a"}, {"claim", id}, {"samples", samples}}).dump());
  };
  EXPECT_FALSE(turn_of(json::array()).ok());
  Result<std::string> twice = turn_of({{{"index", 1}, {"tokens", {1}}}, {{"index", 1}, {"tokens", {2}}}});
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("twice"), std::string::npos) << twice.status().ToString();
}

TEST(RolloutProtocolTurnTest, TurnMessagesRoundTripAndBadOnesAreNamed) {
  TurnRequest request{"w", "a", 7, {{0, {1, 2}}, {3, {4}}}};
  auto parsed = ParseTurnRequest(ToJson(request));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->samples[1].index, 3);
  EXPECT_EQ(parsed->samples[1].tokens, std::vector<int32_t>{4});
  TurnAnswer answer;
  answer.samples.push_back({0, "reward", 0.5, nullptr, ""});
  answer.samples.push_back({1, "continue", 0, json::parse(R"([{"role": "tool", "content": "x"}])"), ""});
  answer.samples.push_back({2, "ungraded", 0, nullptr, "timed out"});
  auto back = ParseTurnAnswer(ToJson(answer));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->samples[0].reward, 0.5);
  EXPECT_EQ(back->samples[1].messages[0]["content"], "x");
  EXPECT_EQ(back->samples[2].reason, "timed out");
  auto bad = ParseTurnAnswer(R"({"samples": [{"index": 0, "kind": "maybe"}]})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("unknown kind"), std::string::npos);
  auto mask = ParseSubmitRequest(R"({"worker": "w", "claim": 1, "samples": [{"prompt_tokens": [1], "tokens": [2],
      "logprobs": [0], "versions": [1], "reward": 0, "mask": [2]}]})");
  ASSERT_FALSE(mask.ok());
  EXPECT_NE(mask.status().message().find("mask"), std::string::npos);
}

TEST(GradingSampleTest, AGeneratedProblemBecomesAUserTurnAndItsAnswer) {
  Problem problem{"312>", "123", {}, {}};
  const grading::Sample sample = GradingSample(problem, "7/1", "123", 4);
  EXPECT_EQ(sample.messages, json::parse(R"([{"role": "user", "content": "312>"}])"));
  EXPECT_EQ(sample.fields, json::parse(R"({"answer": "123"})"));
  problem.messages = json::parse(R"([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])");
  problem.fields = json::parse(R"({"tests": [1, 2]})");
  const grading::Sample from_file = GradingSample(problem, "7/2", "x");
  EXPECT_EQ(from_file.messages, problem.messages);
  EXPECT_EQ(from_file.fields, problem.fields);
  EXPECT_EQ(from_file.completion_tokens, -1);
}

}  // namespace
}  // namespace flywheel::pipeline
