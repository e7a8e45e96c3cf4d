// HF model directories end to end (issue 34 parts 1 and 6), through the flywheel binary:
// `flywheel model make-tiny` writes a directory whose tokenizer and chat template load; a
// fleet trains from it and from `flywheel dataset make` files; broken directories stop the
// trainer with one line naming the file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "ops/process.h"
#include "pipeline/launcher.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/hf_tokenizer.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

ops::Completion RunFlywheel(const std::vector<std::string>& args) {
  ops::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  Result<ops::Completion> done = ops::RunToCompletion(FLYWHEEL_BIN, args, options);
  EXPECT_TRUE(done.ok()) << done.status().ToString();
  return done.ok() ? *done : ops::Completion{};
}

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

class ModelDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("flywheel-model-dir-" + std::string(info->name()) + "-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  // `flywheel model make-tiny --out <dir_>/<name>`.
  fs::path MakeTiny(const std::string& name) {
    const fs::path out = dir_ / name;
    const ops::Completion made = RunFlywheel({"model", "make-tiny", "--out", out.string(), "--seed", "3"});
    EXPECT_EQ(made.exit_code, 0) << made.err;
    return out;
  }
  fs::path dir_;
};

TEST_F(ModelDirTest, MakeTinyWritesADirectoryWhoseTokenizerAndTemplateLoad) {
  const fs::path model = MakeTiny("model");
  for (const char* file : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_TRUE(fs::exists(model / file)) << file;
  }
  const json config = json::parse(ReadText(model / "config.json"));
  EXPECT_EQ(config["vocab_size"], 15);
  Result<Checkpoint> weights = Checkpoint::Open((model / "model.safetensors").string());
  ASSERT_TRUE(weights.ok()) << weights.status().ToString();
  EXPECT_GT(weights->tensors().size(), 4u);

  auto tokenizer = tokenizer::HfTokenizer::Load(model.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  EXPECT_EQ((*tokenizer)->vocab_size(), 15);
  EXPECT_EQ((*tokenizer)->bos(), 13);
  EXPECT_EQ((*tokenizer)->eos(), 14);
  // The CharTokenizer's ids: the alphabet "0123456789+=>" in order.
  auto ids = (*tokenizer)->Encode("3142>12+9=");
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  EXPECT_EQ(*ids, (std::vector<int32_t>{3, 1, 4, 2, 12, 1, 2, 10, 9, 11}));
  auto text = (*tokenizer)->Decode(std::vector<int32_t>{1, 2, 3, 4, 14});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "1234");

  auto chat = tokenizer::ChatTemplate::Parse((*tokenizer)->chat_template());
  ASSERT_TRUE(chat.ok()) << chat.status().ToString();
  nlohmann::ordered_json prompt = {
      {"messages", {{{"role", "user"}, {"content", "3142>"}}}}, {"add_generation_prompt", true},
      {"bos_token", "<s>"}, {"eos_token", "</s>"}};
  auto rendered = chat->Render(prompt);
  ASSERT_TRUE(rendered.ok()) << rendered.status().ToString();
  EXPECT_EQ(*rendered, "3142>");
  prompt["messages"].push_back({{"role", "assistant"}, {"content", "1234"}});
  rendered = chat->Render(prompt);
  ASSERT_TRUE(rendered.ok());
  EXPECT_EQ(*rendered, "3142>1234</s>");
  auto encoded = (*tokenizer)->Encode(*rendered);
  ASSERT_TRUE(encoded.ok());
  EXPECT_EQ(encoded->back(), 14);
}

TEST_F(ModelDirTest, AFleetTrainsFromTheDirectoryAndTheDatasetFiles) {
  const fs::path model = MakeTiny("model");
  const ops::Completion made =
      RunFlywheel({"dataset", "make", "sort", "--digits", "3", "--count", "200", "--eval-count", "16", "--out",
           (dir_ / "train.jsonl").string(), "--eval-out", (dir_ / "eval.jsonl").string(), "--sft",
           (dir_ / "sft.jsonl").string()});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  EXPECT_NE(made.out.find("wrote 200 training lines"), std::string::npos) << made.out;
  RunConfig config;
  config.model.dir = model.string();
  config.task = {"sort", 3, (dir_ / "train.jsonl").string(), (dir_ / "eval.jsonl").string()};
  config.sft = {(dir_ / "sft.jsonl").string(), 2, 4, 1e-3};
  config.run.max_steps = 2;
  config.run.target_accuracy = 0;
  config.run.eval_prompts = 16;
  config.algorithm.group_size = 4;
  config.algorithm.groups_per_step = 2;
  config.fleet.regions = {"us"};
  config.fleet.workers_per_region = 1;
  config.fleet.worker_max_batch = 8;
  FleetOptions options;
  options.config = config;
  options.program = FLYWHEEL_BIN;
  options.run_dir = (dir_ / "run").string();
  auto fleet = Fleet::Start(options);
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  Status finished = (*fleet)->WaitTrainer(std::chrono::seconds(180), nullptr);
  ASSERT_TRUE(finished.ok()) << finished.ToString();
  for (const std::string& line : (*fleet)->Stop()) ADD_FAILURE() << line;
  const json summary = json::parse(ReadText(fs::path((*fleet)->report_dir()) / "summary.json"), nullptr, false);
  ASSERT_TRUE(summary.is_object());
  EXPECT_EQ(summary["steps"], 2);
  // The workers were told to serve the directory's tokenizer.
  const json ready = json::parse(ReadText(dir_ / "run" / "trainer.ready"));
  EXPECT_EQ(ready["tokenizer"], fs::absolute(model).string());
  const std::string toml = ReadText(dir_ / "run" / "run.toml");
  EXPECT_NE(toml.find("dir = '" + model.string() + "'"), std::string::npos) << toml;
  EXPECT_NE(toml.find("eval_dataset = "), std::string::npos) << toml;
}

// `flywheel train --model DIR` on a broken directory: exit 1, one line naming the file.
TEST_F(ModelDirTest, BrokenDirectoriesStopTheTrainerWithOneLineNamingTheFile) {
  const fs::path good = MakeTiny("good");
  struct Case {
    std::string name;
    std::function<void(const fs::path&)> damage;
    std::string expected;  // in the message
  };
  const std::vector<Case> cases = {
      {"no-config", [](const fs::path& d) { fs::remove(d / "config.json"); }, "config.json is missing"},
      {"no-weights", [](const fs::path& d) { fs::remove(d / "model.safetensors"); },
       "model.safetensors is missing"},
      {"no-tokenizer", [](const fs::path& d) { fs::remove(d / "tokenizer.json"); },
       "tokenizer.json is missing"},
      {"small-vocab",
       [](const fs::path& d) {
         json config = json::parse(ReadText(d / "config.json"));
         config["vocab_size"] = 10;
         std::ofstream(d / "config.json") << config.dump();
       },
       "config.json: vocab_size 10 is smaller than"},
      {"other-shape",
       [](const fs::path& d) {
         json config = json::parse(ReadText(d / "config.json"));
         config["intermediate_size"] = config["intermediate_size"].get<int>() * 2;
         std::ofstream(d / "config.json") << config.dump();
       },
       "model.safetensors"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path broken = dir_ / c.name;
    fs::copy(good, broken, fs::copy_options::recursive);
    c.damage(broken);
    const ops::Completion run = RunFlywheel({"train", "--state", (dir_ / ("state-" + c.name)).string(),
                                     "--model", broken.string(), "--quiet"});
    EXPECT_EQ(run.exit_code, 1) << run.err;
    EXPECT_NE(run.err.find(c.expected), std::string::npos) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  }
}

TEST_F(ModelDirTest, DatasetMakeNamesBadFlags) {
  ops::Completion bad = RunFlywheel({"dataset", "make", "sort", "--out", (dir_ / "x.jsonl").string(), "--count", "0"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--count"), std::string::npos) << bad.err;
  bad = RunFlywheel({"dataset", "make", "sort", "--out", (dir_ / "x.jsonl").string(), "--digits", "40"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("digits"), std::string::npos) << bad.err;
  bad = RunFlywheel({"dataset", "make", "sort", "--count", "3"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--out"), std::string::npos) << bad.err;
  bad = RunFlywheel({"dataset", "make", "sort", "--out", (dir_ / "x.jsonl").string(), "--shuffle"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--shuffle"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(dir_ / "x.jsonl"));
  const ops::Completion help = RunFlywheel({"dataset", "make", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("held-out"), std::string::npos) << help.out;
}

}  // namespace
}  // namespace flywheel::pipeline
