// rl/: the units of the trainer process that run without a fleet: submitted groups ->
// datums and advantages, the loss each algorithm trains with, the warm-up datasets and
// their errors, the run's progress and report, and publishing through the in-process
// publisher (one hash pass; the delta density is the encoder's changed-word count).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <filesystem>
#include <fstream>
#include <optional>

#include "rl/evaluator.h"
#include "rl/publish.h"
#include "rollout/engine.h"
#include "tests/model/tiny_models.h"
#include "rl/rl_step.h"
#include "rl/run_report.h"
#include "rl/trainer_process.h"
#include "rl/warmup.h"
#include "pipeline/task.h"
#include "tokenizer/hf_tokenizer.h"
#include "transport/api.h"
#include "transport/http.h"
#include "pipeline/rollout_protocol.h"
#include "ops/metrics.h"
#include "tests/delta/test_checkpoints.h"
#include "tests/sync/promtool.h"

namespace flywheel::rl {
namespace {

namespace fs = std::filesystem;
using testing::DirectlyChangedWords;
using pipeline::Group;
using pipeline::Sample;
using pipeline::StepRow;

fs::path TempDir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("rl_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

Sample MakeSample(std::vector<int32_t> prompt, std::vector<int32_t> tokens, double reward,
                  std::vector<uint64_t> versions) {
  Sample s;
  s.prompt_tokens = std::move(prompt);
  s.tokens = std::move(tokens);
  for (size_t i = 0; i < s.tokens.size(); ++i) s.logprobs.push_back(-0.5f * static_cast<float>(i + 1));
  s.versions = std::move(versions);
  s.reward = reward;
  return s;
}

TEST(RlStepTest, SampleToDatumWeighsOnlyTheAnswer) {
  const Sample s = MakeSample({1, 5, 6}, {7, 8, 2}, 1.0, {3, 3, 4});
  const trainer::Datum d = SampleToDatum(s, 0.75, /*keep_routing=*/false);
  EXPECT_EQ(d.tokens, (std::vector<int32_t>{1, 5, 6, 7, 8}));
  EXPECT_EQ(d.target_tokens, (std::vector<int32_t>{5, 6, 7, 8, 2}));
  EXPECT_EQ(d.weights, (std::vector<float>{0, 0, 1, 1, 1}));
  EXPECT_EQ(d.logprobs, (std::vector<float>{0, 0, -0.5f, -1.0f, -1.5f}));
  EXPECT_EQ(d.policy_versions, (std::vector<uint64_t>{3, 3, 3, 3, 4}));
  EXPECT_EQ(d.advantages, std::vector<float>(5, 0.75f));
  EXPECT_TRUE(d.routing.empty());
}

TEST(RlStepTest, AnEnvironmentsTokensAreContextNotLoss) {
  // A two-turn episode: model "7" EOS, the tool's "5", model "8" EOS.
  Sample s = MakeSample({1, 5}, {7, 2, 5, 8, 2}, 1.0, {3, 3, 3, 4, 4});
  s.mask = {1, 1, 0, 1, 1};
  s.logprobs = {-0.5f, -0.1f, 0.0f, -0.7f, -0.2f};
  const trainer::Datum d = SampleToDatum(s, 0.5, false);
  EXPECT_EQ(d.target_tokens, (std::vector<int32_t>{5, 7, 2, 5, 8, 2}));
  EXPECT_EQ(d.weights, (std::vector<float>{0, 1, 1, 0, 1, 1}));
  EXPECT_EQ(d.logprobs, (std::vector<float>{0, -0.5f, -0.1f, 0, -0.7f, -0.2f}));
  EXPECT_EQ(d.policy_versions, (std::vector<uint64_t>{3, 3, 3, 3, 4, 4}));
}

TEST(RlStepTest, SampleToDatumKeepsRoutingOnlyWhenAsked) {
  Sample s = MakeSample({1, 5}, {7}, 1.0, {1});
  s.routing = {0, 1, 1, 0};
  EXPECT_EQ(SampleToDatum(s, 1, true).routing, s.routing);
  EXPECT_TRUE(SampleToDatum(s, 1, false).routing.empty());
}

std::vector<Group> TwoGroups() {
  Group a, b;
  a.samples = {MakeSample({1, 5}, {7, 2}, 1.0, {4, 4}), MakeSample({1, 5}, {8, 2}, 0.0, {4, 5})};
  b.samples = {MakeSample({1, 6}, {7, 2}, 1.0, {3, 3}), MakeSample({1, 6}, {7, 2}, 1.0, {3, 3})};
  return {a, b};
}

TEST(RlStepTest, GroupsBecomeDatumsWithGroupAdvantages) {
  BatchOptions options;
  options.group_size = 2;
  auto batch = MakeStepBatch(TwoGroups(), /*trainer_version=*/5, options);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  EXPECT_EQ(batch->samples, 4u);
  EXPECT_DOUBLE_EQ(batch->mean_reward, 0.75);
  // Lags over the 8 generated tokens: 1,1,1,0 and 2,2,2,2.
  EXPECT_DOUBLE_EQ(batch->staleness_mean, 11.0 / 8);
  EXPECT_EQ(batch->staleness_max, 2u);
  ASSERT_EQ(batch->datums.size(), 4u);
  // GRPO: (R - mean) / (std + eps) within the group; an all-equal group gets 0.
  EXPECT_GT(batch->datums[0].advantages[0], 0.7f);
  EXPECT_LT(batch->datums[1].advantages[0], -0.7f);
  EXPECT_FLOAT_EQ(batch->datums[0].advantages[0], -batch->datums[1].advantages[0]);
  EXPECT_EQ(batch->datums[2].advantages[0], 0.0f);
  EXPECT_EQ(batch->datums[3].advantages[0], 0.0f);
}

TEST(RlStepTest, DapoDropsGroupsWithEqualRewardsButCountsTheirSamples) {
  BatchOptions options;
  options.group_size = 2;
  options.drop_all_equal = true;
  auto batch = MakeStepBatch(TwoGroups(), 5, options);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  EXPECT_EQ(batch->datums.size(), 2u);  // the second group carried no signal
  EXPECT_EQ(batch->samples, 4u);
  EXPECT_DOUBLE_EQ(batch->mean_reward, 0.75);
}

TEST(RlStepTest, AGroupShortOfItsUngradedSamplesIsNormalisedOverWhatItHas) {
  BatchOptions options;
  options.group_size = 3;  // each group lost one ungraded sample
  auto batch = MakeStepBatch(TwoGroups(), 5, options);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  ASSERT_EQ(batch->datums.size(), 4u);
  EXPECT_FLOAT_EQ(batch->datums[0].advantages[0], -batch->datums[1].advantages[0]);
  EXPECT_GT(batch->datums[0].advantages[0], 0.7f);
  // One sample has no advantage to speak of; more than group_size is not a group.
  std::vector<Group> lone = TwoGroups();
  lone[0].samples.pop_back();
  EXPECT_FALSE(MakeStepBatch(lone, 5, options).ok());
  options.group_size = 1;
  EXPECT_FALSE(MakeStepBatch(TwoGroups(), 5, options).ok());
}

TEST(RlStepTest, EachAlgorithmHasItsLoss) {
  pipeline::RunConfig config;
  config.algorithm.name = "grpo";
  EXPECT_EQ(MakeLossSetup(config).loss_name, "ppo");
  EXPECT_EQ(MakeLossSetup(config).loss.aggregation, trainer::Aggregation::kSeqMeanTokenMean);
  EXPECT_FALSE(MakeLossSetup(config).drop_all_equal);
  config.algorithm.name = "dapo";
  EXPECT_EQ(MakeLossSetup(config).loss_name, "ppo");
  EXPECT_EQ(MakeLossSetup(config).loss.aggregation, trainer::Aggregation::kTokenMean);
  EXPECT_TRUE(MakeLossSetup(config).drop_all_equal);
  config.algorithm.name = "gspo";
  EXPECT_EQ(MakeLossSetup(config).loss_name, "gspo");
  config.algorithm.name = "cispo";
  EXPECT_EQ(MakeLossSetup(config).loss_name, "cispo");
  EXPECT_EQ(MakeLossSetup(config).loss.aggregation, trainer::Aggregation::kTokenMean);
  config.algorithm.lr = 3e-4;
  EXPECT_DOUBLE_EQ(MakeLossSetup(config).adam.lr, 3e-4);
  EXPECT_EQ(MakeLossSetup(config).loss.kl_coef, 0.0);
  config.algorithm.kl_coef = 0.05;
  EXPECT_DOUBLE_EQ(MakeLossSetup(config).loss.kl_coef, 0.05);
}

// ---- warm-up datasets -----------------------------------------------------------------------

class WarmupDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir("warmup");
    auto tokenizer = model::CharTokenizer::Create("0123456789 ");
    ASSERT_TRUE(tokenizer.ok());
    tokenizer_ = std::move(*tokenizer);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    const fs::path path = dir_ / name;
    std::ofstream(path) << text;
    return path.string();
  }
  std::string ErrorOfSft(const std::string& text) {
    auto loaded = LoadSftDataset(Write("sft.jsonl", text), *tokenizer_);
    return loaded.ok() ? "" : loaded.status().message();
  }
  std::string ErrorOfDpo(const std::string& text) {
    auto loaded = LoadDpoDataset(Write("dpo.jsonl", text), *tokenizer_);
    return loaded.ok() ? "" : loaded.status().message();
  }
  fs::path dir_;
  std::unique_ptr<model::CharTokenizer> tokenizer_;
};

TEST_F(WarmupDatasetTest, SftExampleWeighsTheAssistantTurn) {
  const std::string path = Write(
      "sft.jsonl",
      R"({"messages": [{"role": "user", "content": "21"}, {"role": "assistant", "content": "12"}]})"
      "\n\n");
  auto loaded = LoadSftDataset(path, *tokenizer_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), 1u);
  const trainer::Datum& d = (*loaded)[0];
  // BOS 2 1 1 2 EOS: predicting "1" "2" EOS of the answer weighs 1, the prompt 0.
  EXPECT_EQ(d.tokens.size(), 5u);
  EXPECT_EQ(d.weights, (std::vector<float>{0, 0, 1, 1, 1}));
  EXPECT_EQ(d.target_tokens.back(), tokenizer_->eos());
}

TEST_F(WarmupDatasetTest, SftErrorsNameTheLine) {
  const std::string good = R"({"messages": [{"role": "assistant", "content": "1"}]})";
  EXPECT_NE(ErrorOfSft(good + "\n" + "[1, 2]\n").find("sft.jsonl:2: not a JSON object"), std::string::npos)
      << ErrorOfSft(good + "\n[1, 2]\n");
  EXPECT_NE(ErrorOfSft(good + "\n\n" + R"({"messages": []})").find(":3: needs a non-empty \"messages\""),
            std::string::npos);
  EXPECT_NE(ErrorOfSft(R"({"messages": [{"role": "robot", "content": "1"}]})").find(":1: unknown role 'robot'"),
            std::string::npos);
  EXPECT_NE(ErrorOfSft(R"({"messages": [{"role": "assistant", "content": "1", "weight": -1}]})")
                .find(":1: weight must be a number >= 0"),
            std::string::npos);
  EXPECT_NE(ErrorOfSft(R"({"messages": [{"role": "user", "content": "1"}]})").find(":1: no token carries weight"),
            std::string::npos);
  EXPECT_NE(ErrorOfSft(R"({"messages": [{"role": "assistant", "content": "x"}]})").find("sft.jsonl:1: "),
            std::string::npos);  // a character the task's tokenizer does not know
  EXPECT_NE(ErrorOfSft("\n  \n").find("has no examples"), std::string::npos);
  auto missing = LoadSftDataset((dir_ / "missing.jsonl").string(), *tokenizer_);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
}

TEST_F(WarmupDatasetTest, DpoPairIsChosenThenRejected) {
  const std::string path =
      Write("dpo.jsonl", R"({"prompt": "21", "chosen": "12", "rejected": "21 "})" "\n");
  auto loaded = LoadDpoDataset(path, *tokenizer_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), 2u);
  EXPECT_EQ((*loaded)[0].weights, (std::vector<float>{0, 0, 1, 1, 1}));     // "12" + EOS
  EXPECT_EQ((*loaded)[1].weights, (std::vector<float>{0, 0, 1, 1, 1, 1}));  // "21 " + EOS
}

TEST_F(WarmupDatasetTest, DpoErrorsNameTheLine) {
  const std::string good = R"({"prompt": "1", "chosen": "1", "rejected": "2"})";
  EXPECT_NE(ErrorOfDpo(good + "\n" + R"({"prompt": "1", "chosen": "1"})")
                .find("dpo.dataset " + (dir_ / "dpo.jsonl").string() +
                      ":2: needs string \"prompt\", \"chosen\" and \"rejected\""),
            std::string::npos);
  EXPECT_NE(ErrorOfDpo("oops\n").find("dpo.jsonl:1: not a JSON object"), std::string::npos);
}

// Through a model directory's chat template (model.dir): the demo's tiny tokenizer, whose
// template renders a user turn as its content and an assistant turn as content + </s> in a
// {% generation %} block; no BOS (prepended).
class TemplatedWarmupTest : public WarmupDatasetTest {
 protected:
  void SetUp() override {
    WarmupDatasetTest::SetUp();
    const std::string alphabet = "0123456789+=>";
    Write("tokenizer.json", pipeline::TinyTokenizerJson(alphabet));
    Write("tokenizer_config.json", pipeline::TinyTokenizerConfigJson());
    auto hf = tokenizer::HfTokenizer::Load(dir_.string());
    ASSERT_TRUE(hf.ok()) << hf.status().ToString();
    hf_ = std::move(*hf);
  }
  std::vector<std::string> warnings_;
  std::function<void(const std::string&)> Warn() {
    return [this](const std::string& line) { warnings_.push_back(line); };
  }
  std::unique_ptr<tokenizer::HfTokenizer> hf_;
};

TEST_F(TemplatedWarmupTest, SftMasksExactlyTheAssistantTokensAndHonoursWeight) {
  const std::string path = Write(
      "sft.jsonl",
      R"({"messages": [{"role": "user", "content": "21>"}, {"role": "assistant", "content": "12"}]})" "\n"
      R"({"messages": [{"role": "user", "content": "3>"}, {"role": "assistant", "content": "3", "weight": 0}, {"role": "user", "content": "4>"}, {"role": "assistant", "content": "4"}]})" "\n"
      "not json\n"
      R"({"messages": [{"role": "user", "content": "9999999>"}, {"role": "assistant", "content": "9999999"}]})" "\n");
  auto loaded = LoadSftDataset(path, *hf_, /*max_tokens=*/12, Warn());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), 2u);
  // <s> 2 1 > 1 2 </s>: predicting "1" "2" "</s>" weighs 1; the prompt and BOS 0.
  const trainer::Datum& first = (*loaded)[0];
  EXPECT_EQ(first.tokens, (std::vector<int32_t>{13, 2, 1, 12, 1, 2}));
  EXPECT_EQ(first.target_tokens, (std::vector<int32_t>{2, 1, 12, 1, 2, 14}));
  EXPECT_EQ(first.weights, (std::vector<float>{0, 0, 0, 1, 1, 1}));
  // The weight-0 turn is in the sequence but not in the loss: only "4</s>" is.
  const trainer::Datum& second = (*loaded)[1];
  EXPECT_EQ(second.target_tokens, (std::vector<int32_t>{3, 12, 3, 14, 4, 12, 4, 14}));
  EXPECT_EQ(second.weights, (std::vector<float>{0, 0, 0, 0, 0, 0, 1, 1}));
  // The bad line is skipped by file:line, the overlong example dropped and counted, not cut.
  std::string all;
  for (const std::string& line : warnings_) all += line + "\n";
  EXPECT_NE(all.find("sft.jsonl:3"), std::string::npos) << all;
  EXPECT_NE(all.find("sft.jsonl:4: dropped"), std::string::npos) << all;
  EXPECT_NE(all.find("past max_tokens: 1"), std::string::npos) << all;

  // Nothing usable stops the run, naming the file.
  auto none = LoadSftDataset(Write("none.jsonl", "nope\n"), *hf_, 12, Warn());
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("none.jsonl"), std::string::npos) << none.status().ToString();
}

TEST_F(TemplatedWarmupTest, DpoInTheOpenAiPreferenceFormat) {
  const std::string line =
      R"({"input": {"messages": [{"role": "user", "content": "21>"}]}, "preferred_output": [{"role": "assistant", "content": "12"}], "non_preferred_output": [{"role": "assistant", "content": "21"}]})";
  const std::string path = Write("dpo.jsonl", line + "\n");
  auto loaded = LoadDpoDataset(path, *hf_, 0, Warn());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), 2u);
  EXPECT_EQ((*loaded)[0].target_tokens, (std::vector<int32_t>{2, 1, 12, 1, 2, 14}));
  EXPECT_EQ((*loaded)[0].weights, (std::vector<float>{0, 0, 0, 1, 1, 1}));
  EXPECT_EQ((*loaded)[1].target_tokens, (std::vector<int32_t>{2, 1, 12, 2, 1, 14}));
  EXPECT_EQ((*loaded)[1].weights, (std::vector<float>{0, 0, 0, 1, 1, 1}));
  // The same file without a template (the character tokenizer): the plain rendering.
  auto chars = model::CharTokenizer::Create("0123456789+=>");
  ASSERT_TRUE(chars.ok());
  auto plain = LoadDpoDataset(path, **chars);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ((*plain)[0].target_tokens, (*loaded)[0].target_tokens);
  EXPECT_EQ((*plain)[0].weights, (*loaded)[0].weights);
}

// ---- progress and report --------------------------------------------------------------------

StepRow Row(uint64_t step) {
  StepRow row;
  row.step = step;
  row.version = step + 1;
  row.samples = 8;
  row.k3 = 0.5;
  row.staleness_max = step;
  row.delta_bytes = 100 * step;
  row.full_bytes = 4096;
  row.sync_ms = step == 2 ? 12.5 : -1;
  row.sync_version = 2;
  return row;
}

TEST(RunReportTest, ProgressRoundTrip) {
  const fs::path dir = TempDir("progress");
  RunProgress progress;
  progress.version = 3;
  progress.wall_s = 42.5;
  progress.initial_accuracy = 0.0;
  progress.warmup_accuracy = 0.25;
  progress.last_accuracy = 0.5;
  progress.rows = {Row(1), Row(2)};
  const std::string path = (dir / "progress.json").string();
  ASSERT_TRUE(SaveProgress(path, progress).ok());
  auto loaded = LoadProgress(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->version, 3u);
  EXPECT_EQ((*loaded)->wall_s, 42.5);
  EXPECT_EQ((*loaded)->warmup_accuracy, 0.25);
  EXPECT_EQ((*loaded)->time_to_target_s, -1);
  EXPECT_EQ((*loaded)->rows, progress.rows);

  auto none = LoadProgress((dir / "absent.json").string());
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  std::ofstream(path) << R"({"version": 3, "rows": [{"step": "one"}]})";
  auto bad = LoadProgress(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'step'"), std::string::npos) << bad.status().ToString();
  fs::remove_all(dir);
}

TEST(RunReportTest, SummaryAndFiles) {
  const fs::path dir = TempDir("report");
  pipeline::RunConfig config;
  RunProgress progress;
  progress.version = 3;
  progress.last_accuracy = 0.75;
  progress.rows = {Row(1), Row(2)};
  SummaryInputs inputs;
  inputs.config = &config;
  inputs.parameters = 1234;
  inputs.progress = &progress;
  inputs.wall_seconds = 9;
  inputs.stats.samples_dropped_stale = 5;
  inputs.stats.samples_graded = 40;
  inputs.stats.samples_ungraded = 2;
  inputs.stats.groups_zero_variance = 3;
  pipeline::RunSummary summary = MakeRunSummary(inputs);
  EXPECT_EQ(summary.samples_graded, 40u);
  EXPECT_EQ(summary.samples_ungraded, 2u);
  EXPECT_EQ(summary.groups_zero_variance, 3u);
  summary.eval_score = 0.75;
  summary.grader = "builtin: exact_match";
  EXPECT_EQ(summary.task, config.task.name + "-" + std::to_string(config.task.digits));
  EXPECT_EQ(summary.steps, 2u);
  EXPECT_EQ(summary.versions, 3u);
  EXPECT_EQ(summary.samples, 16u);
  EXPECT_EQ(summary.final_accuracy, 0.75);
  EXPECT_EQ(summary.max_staleness_observed, 2u);
  EXPECT_DOUBLE_EQ(summary.delta_bytes_mean, 150);
  EXPECT_DOUBLE_EQ(summary.sync_ms_mean, 12.5);
  EXPECT_EQ(summary.samples_dropped_stale, 5u);
  EXPECT_EQ(summary.workers,
            config.fleet.regions.size() * static_cast<uint64_t>(config.fleet.workers_per_region));

  ASSERT_TRUE(WriteRunReport(dir.string(), progress.rows, summary).ok());
  auto read = pipeline::ReadSummary(dir.string());
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, summary);
  std::ifstream csv(dir / "metrics.csv");
  std::string header, line;
  std::getline(csv, header);
  EXPECT_EQ(header, StepRow::CsvHeader());
  std::getline(csv, line);
  auto row = StepRow::FromCsv(line);
  ASSERT_TRUE(row.ok()) << row.status().ToString();
  EXPECT_EQ(*row, Row(1));
  fs::remove_all(dir);
}

// The evaluator reuses its engine across evaluations: the new weights must reach it as a
// swap, or its shared prefixes would serve the last evaluation's keys and values. Policy B's
// own greedy answers are the expected ones, so B scores 1 whether or not A was evaluated
// first on the same evaluator.
TEST(EvaluatorTest, EachEvaluationComputesWithTheWeightsItIsGiven) {
  const model::ModelConfig config = testing::TinyConfig({.vocab = 260});
  auto policy = [&](uint64_t seed) {
    torch::manual_seed(seed);
    auto m = std::make_shared<model::TransformerImpl>(config);
    torch::NoGradGuard no_grad;
    for (auto& p : m->parameters()) p.mul_(8).copy_(p.to(torch::kBFloat16).to(torch::kFloat32));
    return m;
  };
  auto a = policy(1), b = policy(2);
  auto tokenizer = std::make_shared<model::ByteTokenizer>();
  std::vector<pipeline::Problem> problems;
  std::vector<rollout::GenerationRequest> requests;
  for (int i = 0; i < 8; ++i) {
    const std::string prompt = "common prefix " + std::to_string(i * 37) + ">";
    problems.push_back({prompt, "", nullptr, nullptr});
    std::vector<int32_t> ids = {tokenizer->bos()};
    for (unsigned char ch : prompt) ids.push_back(ch);
    rollout::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = 6;
    params.stop_tokens = {tokenizer->eos()};
    requests.push_back({ids, params, ""});
  }
  auto engine = rollout::Engine::Create(b, {8, 64}, 1);
  ASSERT_TRUE(engine.ok());
  auto answers = (*engine)->Generate(requests);
  ASSERT_TRUE(answers.ok());
  for (size_t i = 0; i < problems.size(); ++i) {
    std::vector<int32_t> ids = (*answers)[i].tokens;
    if (!ids.empty() && ids.back() == tokenizer->eos()) ids.pop_back();
    auto text = tokenizer->Decode(ids);
    ASSERT_TRUE(text.ok());
    problems[i].answer = *text;
  }
  Evaluator fresh(config, problems, tokenizer, 6);
  auto alone = fresh.Accuracy(*b);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  EXPECT_EQ(*alone, 1.0);
  Evaluator reused(config, problems, tokenizer, 6);
  auto first = reused.Accuracy(*a);
  ASSERT_TRUE(first.ok());
  EXPECT_LT(*first, 1.0);  // A answers otherwise
  auto second = reused.Accuracy(*b);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, 1.0);
}

TEST(RunReportTest, StepLineShowsMeasuredAndCarriedAccuracy) {
  StepRow row = Row(2);
  row.delta_density = 0.0125;
  const std::string carried = StepLine(row, 2, 0.5);
  EXPECT_EQ(carried.rfind("step    2  v3", 0), 0u) << carried;
  EXPECT_NE(carried.find("acc ~0.500"), std::string::npos) << carried;
  EXPECT_NE(carried.find("stale 0.00/2 (k=2)"), std::string::npos) << carried;
  EXPECT_NE(carried.find("delta 1.25% 200 B"), std::string::npos) << carried;
  EXPECT_NE(carried.find(" ms (v2)"), std::string::npos) << carried;
  row.eval_accuracy = 0.5;
  EXPECT_NE(StepLine(row, 2, 0.5).find("acc  0.500"), std::string::npos);
}

// ---- publishing ------------------------------------------------------------------------------

TEST(PublishTest, VersionToPublishOnResume) {
  EXPECT_EQ(VersionToPublishOnResume(0, 4), 4u);     // the publisher lost its log
  EXPECT_EQ(VersionToPublishOnResume(6, 4), 7u);     // published past the saved state
  EXPECT_EQ(VersionToPublishOnResume(4, 4), std::nullopt);
  EXPECT_EQ(DeltaDensity(0, 0), 0.0);
  EXPECT_EQ(DeltaDensity(1, 4), 0.25);
}

// The trainer process's services on a fresh run directory, started as the trainer starts them.
struct StartedServices {
  fs::path dir;
  std::optional<RunSetup> setup;
  std::unique_ptr<TrainerServices> services;
};

void StartServices(const std::string& name, StartedServices* out) {
  out->dir = TempDir(name);
  TrainRunOptions options;
  options.state_dir = (out->dir / "state").string();
  options.report_dir = (out->dir / "report").string();
  auto setup = PrepareRun(options);
  ASSERT_TRUE(setup.ok()) << setup.status().ToString();
  out->setup = std::move(*setup);
  auto services = TrainerServices::Start(options, *out->setup, 0);
  ASSERT_TRUE(services.ok()) << services.status().ToString();
  out->services = std::move(*services);
}

// The trainer's side of the snapshot path end to end, in process: the services the trainer
// process starts, a tiny policy, two published versions with an optimizer step between.
TEST(PublishTest, SnapshotIsHashedOnceAndTheEncoderCountsTheChange) {
  StartedServices started;
  ASSERT_NO_FATAL_FAILURE(StartServices("publish", &started));
  const fs::path& dir = started.dir;
  RunSetup* setup = &*started.setup;
  TrainerServices* services = started.services.get();
  trainer::TrainerOptions trainer_options;
  trainer_options.config = setup->model_config;
  trainer_options.seed = 3;
  auto client = trainer::TrainingClient::Create(trainer_options);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  (*client)->AttachPublisher(&services->publisher());

  auto v1 = (*client)->SaveWeightsForSampler(1);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_EQ(v1->publisher_hashed_tensors, 0u);  // it took the trainer's hashes
  EXPECT_EQ(v1->changed_words, 0u);             // a keyframe: nothing to compare with
  EXPECT_EQ(v1->tensor_hashes.size(), v1->checkpoint.tensors.size());

  trainer::Datum datum;
  datum.tokens = {1, 2, 3, 4};
  datum.target_tokens = {2, 3, 4, 5};
  ASSERT_TRUE((*client)->ForwardBackward({datum}, "cross_entropy").ok());
  trainer::AdamWParams adam;
  adam.lr = 1e-3;
  ASSERT_TRUE((*client)->OptimStep(adam).ok());
  auto v2 = (*client)->SaveWeightsForSampler(2);
  ASSERT_TRUE(v2.ok()) << v2.status().ToString();
  EXPECT_EQ(v2->publisher_hashed_tensors, 0u);
  const uint64_t direct = DirectlyChangedWords(v1->checkpoint, v2->checkpoint);
  EXPECT_GT(direct, 0u);
  EXPECT_EQ(v2->changed_words, direct);
  EXPECT_EQ(v2->total_words, v2->bytes / 2);  // bf16
  EXPECT_EQ(services->publisher().version(), 2u);

  // PublishVersion: the same numbers, and the coordinator follows the version.
  ASSERT_TRUE((*client)->ForwardBackward({datum}, "cross_entropy").ok());
  ASSERT_TRUE((*client)->OptimStep(adam).ok());
  auto v3 = PublishVersion(**client, services->coordinator(), 3);
  ASSERT_TRUE(v3.ok()) << v3.status().ToString();
  EXPECT_EQ(v3->version, 3u);
  EXPECT_GT(v3->delta_density, 0.0);
  EXPECT_LT(v3->delta_density, 1.0);
  EXPECT_GT(v3->delta_bytes, 0u);
  EXPECT_EQ(v3->full_bytes, v2->bytes);
  started.services.reset();
  fs::remove_all(dir);
}

// A 64 MiB submission is parsed off the trainer's I/O thread, which also runs the publisher:
// while one is parsed, GET /v1/status (as every heartbeat) keeps answering at once. Before,
// the parse ran on that thread and every other request waited for it.
TEST(TrainerServicesTest, ALargeSubmissionDoesNotStallTheIoThread) {
  StartedServices started;
  ASSERT_NO_FATAL_FAILURE(StartServices("submit", &started));
  const fs::path& dir = started.dir;
  TrainerServices* services = started.services.get();
  const transport::Endpoint endpoint{"127.0.0.1", services->http_port()};

  std::string body = R"({"worker": "w", "claim": 1, "version": 0, "samples": [)";
  const std::string sample = "[1.5,2.5,3.5,4.5,5.5,6.5,7.5,8.5,9.5,10.5,11.5,12.5],";
  while (body.size() + sample.size() + 2 < (63u << 20)) body += sample;
  body += "[1]]}";
  const auto parse_start = std::chrono::steady_clock::now();
  EXPECT_FALSE(pipeline::ParseSubmitRequest(body).ok());  // parsed whole, then refused
  const double parse_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - parse_start).count();

  std::atomic<bool> done{false};
  std::thread submitter([&] {
    auto answer = transport::HttpPost(endpoint, "/v1/rollout/submit", body,
                                      {.timeout = std::chrono::seconds(60)});
    EXPECT_TRUE(answer.ok()) << answer.status().ToString();
    if (answer.ok()) {
      EXPECT_NE(answer->body.find("\"accepted\":false"), std::string::npos) << answer->body.substr(0, 200);
    }
    done = true;
  });
  double worst_ms = 0;
  int polls = 0;
  while (!done) {
    const auto start = std::chrono::steady_clock::now();
    auto status = transport::HttpGet(endpoint, "/v1/status");
    ASSERT_TRUE(status.ok()) << status.status().ToString();
    worst_ms = std::max(worst_ms, std::chrono::duration<double, std::milli>(
                                      std::chrono::steady_clock::now() - start).count());
    ++polls;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  submitter.join();
  std::printf("63 MiB submission: parse %.0f ms; slowest of %d GET /v1/status meanwhile: %.1f ms\n",
              parse_ms, polls, worst_ms);
  EXPECT_LT(worst_ms, std::max(100.0, parse_ms / 3));

  // Bodies nested 100,000 deep on both of the coordinator's routes: refused by name, and the
  // trainer keeps serving.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  for (const char* path : {"/v1/rollout/claim", "/v1/rollout/submit"}) {
    auto answer = transport::HttpPost(endpoint, path, R"({"worker": "w", "version": )" + deep + "}");
    ASSERT_TRUE(answer.ok()) << path << ": " << answer.status().ToString();
    EXPECT_NE(answer->body.find("nested deeper than 64 levels"), std::string::npos)
        << path << ": " << answer->body.substr(0, 300);
    if (std::string_view(path) == "/v1/rollout/claim") {
      // A claim that does not parse is an error in flywheel's one shape (transport/api.h).
      EXPECT_EQ(answer->status, 400);
      const std::optional<transport::ApiError> error =
          transport::ParseErrorBody(answer->status, answer->body);
      ASSERT_TRUE(error.has_value()) << answer->body.substr(0, 300);
      EXPECT_EQ(error->code, "bad_request");
    }
  }
  auto after = transport::HttpGet(endpoint, "/v1/status");
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(after->status, 200);
  started.services.reset();
  fs::remove_all(dir);
}

TEST(TrainerStatusTest, ReportsProgressAfterTheFirstStepAndTheCoordinatorsCounters) {
  TrainerStatus status;
  nlohmann::json before = ToJson(status);
  EXPECT_EQ(before["role"], "trainer");
  EXPECT_EQ(before["phase"], "starting");
  EXPECT_FALSE(before.contains("accuracy"));
  EXPECT_FALSE(before.contains("resumed"));
  status.phase = "rl";
  status.step = 3;
  status.version = 4;
  status.stepped = true;
  status.accuracy = 0.5;
  status.resumed = true;
  status.coordinator.claims = 12;
  status.coordinator.groups_by_worker["w1"] = 2;
  status.queued_groups = 1;
  nlohmann::json after = ToJson(status);
  EXPECT_EQ(after["step"], 3u);
  EXPECT_EQ(after["version"], 4u);
  EXPECT_EQ(after["accuracy"], 0.5);
  EXPECT_EQ(after["resumed"], true);
  EXPECT_EQ(after["claims"], 12u);
  EXPECT_EQ(after["groups_by_worker"]["w1"], 2u);
  EXPECT_EQ(after["queued_groups"], 1u);
  // GET /metrics renders the same document by the Prometheus conventions.
  const std::string metrics = ops::MetricsText(after);
  EXPECT_NE(metrics.find("flywheel_claims_total{role=\"trainer\""), std::string::npos) << metrics;
  std::optional<std::string> complaints = flywheel::testing::PromtoolComplaints(metrics);
  if (!complaints) GTEST_SKIP() << "promtool is not installed (apt install prometheus)";
  EXPECT_EQ(*complaints, "") << metrics;
}

}  // namespace
}  // namespace flywheel::rl
