// The demo's tasks as files (pipeline/task.h): MakeTaskFiles writes RL / held-out / SFT
// JSONL that parse back, with disjoint splits and the counts asked for; Task::FromFiles reads
// RL JSONL back as a task, skipping bad lines by file:line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "pipeline/task.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class TaskFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("flywheel-task-files-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  std::vector<json> Lines(const std::string& name) {
    std::ifstream in(dir_ / name);
    std::vector<json> lines;
    for (std::string text; std::getline(in, text);) lines.push_back(json::parse(text));
    return lines;
  }
  std::string Path(const std::string& name) { return (dir_ / name).string(); }
  void Write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
  static PromptRenderer LastContent() {
    return [](const nlohmann::ordered_json& messages) -> Result<std::string> {
      return messages.back()["content"].get<std::string>();
    };
  }
  fs::path dir_;
};

TEST_F(TaskFilesTest, MakeWritesParsableDisjointSplitsWithTheCounts) {
  for (const char* name : {"sort", "reverse", "add"}) {
    SCOPED_TRACE(name);
    TaskFilesOptions options;
    options.task = {name, 4};
    options.count = 300;
    options.eval_count = 40;
    options.seed = 7;
    options.out = Path("train.jsonl");
    options.eval_out = Path("eval.jsonl");
    options.sft_out = Path("sft.jsonl");
    Result<TaskFilesWritten> written = MakeTaskFiles(options);
    ASSERT_TRUE(written.ok()) << written.status().ToString();
    EXPECT_EQ(written->train, 300u);
    EXPECT_EQ(written->eval, 40u);
    EXPECT_EQ(written->sft, 300u);
    auto task = Task::Create(options.task);
    ASSERT_TRUE(task.ok());
    std::set<std::string> train_prompts, eval_prompts;
    for (const json& line : Lines("train.jsonl")) {
      ASSERT_EQ(line["messages"].size(), 1u);
      EXPECT_EQ(line["messages"][0]["role"], "user");
      const std::string prompt = line["messages"][0]["content"];
      EXPECT_FALSE(Task::IsHeldOut(prompt)) << prompt;
      train_prompts.insert(prompt);
    }
    for (const json& line : Lines("eval.jsonl")) {
      const std::string prompt = line["messages"][0]["content"];
      EXPECT_TRUE(Task::IsHeldOut(prompt)) << prompt;
      EXPECT_TRUE(eval_prompts.insert(prompt).second) << "held-out prompts are distinct: " << prompt;
      EXPECT_EQ(train_prompts.count(prompt), 0u) << prompt;
    }
    EXPECT_EQ(Lines("train.jsonl").size(), 300u);
    EXPECT_EQ(eval_prompts.size(), 40u);
    const std::vector<json> sft = Lines("sft.jsonl");
    ASSERT_EQ(sft.size(), 300u);
    for (const json& line : sft) {
      ASSERT_EQ(line["messages"].size(), 2u);
      EXPECT_EQ(line["messages"][1]["role"], "assistant");
      EXPECT_EQ(eval_prompts.count(line["messages"][0]["content"]), 0u);
    }
  }
}

TEST_F(TaskFilesTest, AnswersAreTheTasksAnswers) {
  TaskFilesOptions options;
  options.task = {"add", 3};
  options.count = 50;
  options.out = Path("add.jsonl");
  ASSERT_TRUE(MakeTaskFiles(options).ok());
  for (const json& line : Lines("add.jsonl")) {
    const std::string prompt = line["messages"][0]["content"];
    const size_t plus = prompt.find('+');
    ASSERT_NE(plus, std::string::npos);
    const int a = std::stoi(prompt.substr(0, plus)), b = std::stoi(prompt.substr(plus + 1));
    EXPECT_EQ(line["answer"], std::to_string(a + b)) << prompt;
  }
}

TEST_F(TaskFilesTest, MakeRefusesBadOptionsAndWritesNothing) {
  TaskFilesOptions options;
  options.task = {"sort", 0};
  options.out = Path("bad.jsonl");
  EXPECT_FALSE(MakeTaskFiles(options).ok());
  options.task = {"shuffle", 4};
  Result<TaskFilesWritten> unknown = MakeTaskFiles(options);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("shuffle"), std::string::npos);
  options.task = {"sort", 4};
  options.out.clear();
  EXPECT_FALSE(MakeTaskFiles(options).ok());
  EXPECT_FALSE(fs::exists(dir_ / "bad.jsonl"));
}

TEST_F(TaskFilesTest, FromFilesReadsWhatMakeWrote) {
  TaskFilesOptions options;
  options.task = {"reverse", 5};
  options.count = 200;
  options.eval_count = 30;
  options.out = Path("train.jsonl");
  options.eval_out = Path("eval.jsonl");
  ASSERT_TRUE(MakeTaskFiles(options).ok());
  TaskFileCounts counts;
  auto task = Task::FromFiles(options.out, options.eval_out, LastContent(), nullptr, &counts);
  ASSERT_TRUE(task.ok()) << task.status().ToString();
  EXPECT_EQ(counts.train_lines, 200u);
  EXPECT_EQ(counts.eval_lines, 30u);
  EXPECT_EQ(counts.skipped, 0u);
  EXPECT_EQ((*task)->max_prompt_chars(), 6);
  EXPECT_EQ((*task)->max_answer_chars(), 5);
  const std::vector<Problem> held_out = (*task)->HeldOut(1000, 0);
  ASSERT_EQ(held_out.size(), 30u);
  std::set<std::string> eval_prompts;
  for (const Problem& p : held_out) {
    eval_prompts.insert(p.prompt);
    EXPECT_EQ(p.answer, std::string(p.prompt.rbegin() + 1, p.prompt.rend()));
  }
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200; ++i) {
    const Problem p = (*task)->Sample(rng, false);
    EXPECT_EQ(eval_prompts.count(p.prompt), 0u);
    EXPECT_EQ(p.answer, std::string(p.prompt.rbegin() + 1, p.prompt.rend()));
  }
}

TEST_F(TaskFilesTest, BadLinesAreSkippedByFileAndLineAndAnEmptyFileStops) {
  Write("mixed.jsonl",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"12>\"}], \"answer\": \"12\"}\n"
        "not json\n"
        "{\"answer\": \"1\"}\n"
        "{\"messages\": [{\"role\": \"robot\", \"content\": \"1>\"}], \"answer\": \"1\"}\n"
        "{\"messages\": [{\"role\": \"user\", \"content\": \"1>\"}], \"answer\": [1]}\n"
        "{\"messages\": [{\"role\": \"user\", \"content\": \"7>\"}], \"tests\": [\"t\"]}\n"
        "\n"
        "{\"messages\": [{\"role\": \"user\", \"content\": \"21>\"}], \"answer\": \"12\", \"tests\": [1]}\n");
  Write("eval.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"31>\"}], \"answer\": \"13\"}\n");
  std::vector<std::string> warnings;
  TaskFileCounts counts;
  auto task = Task::FromFiles(Path("mixed.jsonl"), Path("eval.jsonl"), LastContent(),
                              [&](const std::string& line) { warnings.push_back(line); }, &counts);
  ASSERT_TRUE(task.ok()) << task.status().ToString();
  EXPECT_EQ(counts.train_lines, 3u);
  EXPECT_EQ(counts.skipped, 4u);
  ASSERT_EQ(warnings.size(), 4u);
  EXPECT_NE(warnings[0].find("mixed.jsonl:2: skipped: not JSON"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[1].find("mixed.jsonl:3: skipped: needs a non-empty \"messages\""), std::string::npos);
  EXPECT_NE(warnings[2].find("mixed.jsonl:4: skipped: unknown role \"robot\""), std::string::npos);
  // Every field but "messages" reaches the grader untouched; "answer" is optional.
  std::mt19937_64 rng(3);
  bool saw_tests = false, saw_no_answer = false;
  for (int i = 0; i < 200; ++i) {
    const Problem p = (*task)->Sample(rng, false);
    ASSERT_TRUE(p.messages.is_array());
    if (p.prompt == "21>") {
      saw_tests = true;
      EXPECT_EQ(p.fields, nlohmann::json::parse(R"({"answer": "12", "tests": [1]})"));
    }
    if (p.prompt == "7>") {
      saw_no_answer = true;
      EXPECT_EQ(p.answer, "");
      EXPECT_EQ(p.fields, nlohmann::json::parse(R"({"tests": ["t"]})"));
    }
  }
  EXPECT_TRUE(saw_tests && saw_no_answer);
  EXPECT_NE(warnings[3].find("mixed.jsonl:5: skipped: \"answer\" must be a string or a number"), std::string::npos);

  // A renderer that refuses a line skips it too.
  warnings.clear();
  auto refusing = [](const nlohmann::ordered_json& messages) -> Result<std::string> {
    const std::string content = messages.back()["content"];
    if (content == "21>") return Status::InvalidArgument("cannot render");
    return content;
  };
  ASSERT_TRUE(Task::FromFiles(Path("mixed.jsonl"), Path("eval.jsonl"), refusing,
                              [&](const std::string& line) { warnings.push_back(line); }).ok());
  EXPECT_EQ(warnings.size(), 5u);
  EXPECT_NE(warnings.back().find("mixed.jsonl:8: skipped: the chat template cannot render it"),
            std::string::npos) << warnings.back();

  Write("useless.jsonl", "nope\n{}\n");
  auto none = Task::FromFiles(Path("useless.jsonl"), Path("eval.jsonl"), LastContent(), nullptr);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("useless.jsonl has no usable training line"), std::string::npos)
      << none.status().ToString();
  auto missing = Task::FromFiles(Path("absent.jsonl"), "", LastContent(), nullptr);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("absent.jsonl"), std::string::npos);
}

TEST_F(TaskFilesTest, LinesAreReadBackWhenDrawnNotHeldInMemory) {
  // The task keeps byte offsets only: a line rewritten in place (same length) is drawn as
  // it reads now.
  Write("stream.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"12>\"}], \"answer\": \"12\"}\n");
  Write("stream_eval.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"31>\"}], \"answer\": \"13\"}\n");
  auto task = Task::FromFiles(Path("stream.jsonl"), Path("stream_eval.jsonl"), LastContent(), nullptr);
  ASSERT_TRUE(task.ok()) << task.status().ToString();
  std::mt19937_64 rng(1);
  EXPECT_EQ((*task)->Sample(rng, false).prompt, "12>");
  Write("stream.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"21>\"}], \"answer\": \"12\"}\n");
  EXPECT_EQ((*task)->Sample(rng, false).prompt, "21>");
  EXPECT_EQ((*task)->HeldOut(5, 0).size(), 1u);
  EXPECT_EQ((*task)->HeldOut(5, 0)[0].answer, "13");
}

TEST_F(TaskFilesTest, WithoutAnEvalFileEveryEighthPromptIsHeldOut) {
  TaskFilesOptions options;
  options.task = {"sort", 6};
  options.count = 400;
  options.out = Path("train.jsonl");
  ASSERT_TRUE(MakeTaskFiles(options).ok());
  // The generated training part holds no held-out prompt: add some by hand.
  auto task = Task::Create(options.task);
  std::mt19937_64 rng(5);
  std::string extra;
  for (int i = 0; i < 10; ++i) extra += RlLine((*task)->Sample(rng, true)) + "\n";
  std::ofstream(dir_ / "train.jsonl", std::ios::app) << extra;
  TaskFileCounts counts;
  auto read = Task::FromFiles(options.out, "", LastContent(), nullptr, &counts);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(counts.train_lines, 400u);
  EXPECT_EQ(counts.eval_lines, 10u);
  for (const Problem& p : (*read)->HeldOut(100, 0)) EXPECT_TRUE(Task::IsHeldOut(p.prompt));

  // eval_fraction: another share of the prompts, by the same hash, disjoint by construction.
  TaskFileCounts half;
  auto halves = Task::FromFiles(options.out, "", LastContent(), nullptr, &half, 0.5);
  ASSERT_TRUE(halves.ok()) << halves.status().ToString();
  EXPECT_EQ(half.train_lines + half.eval_lines, 410u);
  EXPECT_GT(half.eval_lines, 150u);
  EXPECT_LT(half.eval_lines, 260u);
  for (const Problem& p : (*halves)->HeldOut(1000, 0)) EXPECT_TRUE(Task::IsHeldOut(p.prompt, 0.5));
  std::mt19937_64 draw(2);
  for (int i = 0; i < 200; ++i) EXPECT_FALSE(Task::IsHeldOut((*halves)->Sample(draw, false).prompt, 0.5));
  EXPECT_FALSE(Task::FromFiles(options.out, "", LastContent(), nullptr, nullptr, 1.0).ok());
}

}  // namespace
}  // namespace flywheel::pipeline
