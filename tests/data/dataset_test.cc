// DatasetReader: the three formats, every bad-input case with its `file:line` message and
// count, the split (disjoint, stable under reordering and reformatting, monotone in
// eval_fraction), and streaming (a FIFO fed one line at a time; a 40 MB file read with
// bounded memory).
#include "data/dataset.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace flywheel::data {
namespace {

using nlohmann::ordered_json;

class DatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/data_test_XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }

  std::string Write(const std::string& name, const std::vector<std::string>& lines,
                    bool final_newline = true) {
    std::string path = dir_ + "/" + name;
    std::ofstream out(path, std::ios::binary);
    for (size_t i = 0; i < lines.size(); ++i)
      out << lines[i] << (i + 1 < lines.size() || final_newline ? "\n" : "");
    return path;
  }

  std::string dir_;
};

const std::string kGood =
    R"({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})";

// `text` with its newlines removed: a JSON object written over several source lines.
std::string OneLine(std::string text) {
  text.erase(std::remove(text.begin(), text.end(), '\n'), text.end());
  return text;
}

// The problem messages of `report` that start with `file:line: `.
std::vector<std::string> ProblemsAt(const DatasetReport& report, const std::string& path, int line) {
  std::vector<std::string> out;
  std::string prefix = path + ":" + std::to_string(line) + ": ";
  for (const std::string& p : report.problems)
    if (p.rfind(prefix, 0) == 0) out.push_back(p.substr(prefix.size()));
  return out;
}

TEST_F(DatasetTest, SftNormalisesContentToolCallsAndWeights) {
  std::string path = Write("sft.jsonl", {OneLine(R"({"messages": [
      {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
      {"role": "assistant", "content": "Sunny.", "weight": 0},
      {"role": "user", "content": "thanks"},
      {"role": "assistant", "content": "You're welcome.", "weight": 1}],
     "tools": [{"type": "function", "function": {"name": "get_weather"}}]})")});
  DatasetReport report;
  auto examples = ReadAll(path, {.format = Format::kSft}, &report);
  ASSERT_TRUE(examples.ok()) << examples.status().ToString();
  ASSERT_EQ(examples->size(), 1u);
  const Example& e = (*examples)[0];
  EXPECT_EQ(e.messages[0]["content"], "Be brief.");
  EXPECT_EQ(e.messages[2]["content"], "");
  EXPECT_EQ(e.messages[2]["tool_calls"][0]["function"]["arguments"], ordered_json({{"city", "Paris"}}));
  EXPECT_EQ(e.messages[3]["tool_call_id"], "c1");
  EXPECT_FALSE(e.messages[4].contains("weight"));
  EXPECT_EQ(e.trained, (std::vector<bool>{false, false, true, false, false, false, true}));
  EXPECT_EQ(e.tools.size(), 1u);
  EXPECT_EQ(e.source.line, 1);
  EXPECT_EQ(report.usable, 1);
}

TEST_F(DatasetTest, EveryBadLineIsNamedAndCounted) {
  const std::vector<std::string> lines = {
      kGood,                                                                         // 1
      "{not json",                                                                   // 2
      R"({"prompt": "x"})",                                                          // 3
      R"({"messages": [{"role": "wizard", "content": "x"}]})",                       // 4
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]})",  // 5
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 2}]})",  // 6
      R"({"messages": [{"role": "user", "content": "x", "weight": 1}, {"role": "assistant", "content": "y"}]})",  // 7
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]})",  // 8
      "",                                                                            // 9 (blank)
      "[1, 2]",                                                                      // 10
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": 0}]})",  // 11
      R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "y"}]})",  // 12
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "wieght": 0}]})",  // 13
      R"({"messages": [], "tools": []})",                                            // 14
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": {"a": 1}})",  // 15
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "weight": "1"}]})",  // 16
      R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "assistant", "content": "y"}]})",  // 17
      kGood,                                                                         // 18
  };
  std::string path = Write("bad.jsonl", lines);
  DatasetReport report;
  auto examples = ReadAll(path, {.format = Format::kSft}, &report);
  ASSERT_TRUE(examples.ok()) << examples.status().ToString();
  EXPECT_EQ(examples->size(), 2u);
  EXPECT_EQ((*examples)[1].source.line, 18);
  EXPECT_EQ(report.lines, 18);
  EXPECT_EQ(report.blank, 1);
  EXPECT_EQ(report.usable, 2);
  EXPECT_EQ(report.skipped, 15);
  const std::vector<std::pair<int, std::string>> expected = {
      {2, "not JSON: "},
      {3, "no messages: has no \"messages\""},
      {4, "unknown role: messages[0] role \"wizard\""},
      {5, "empty assistant turn: messages[1] has no content and no tool_calls"},
      {6, "bad weight: messages[1] weight is 2, not 0 or 1"},
      {7, "bad weight: messages[0] has a weight but is not an assistant turn"},
      {8, "bad tool_calls: messages[1].tool_calls[0].function.arguments is not JSON"},
      {10, "not an object: "},
      {11, "no trained assistant turn: "},
      {12, "bad content: messages[0] content part is not"},
      {13, "unknown message key: messages[1] has a key \"wieght\""},
      {14, "no messages: messages is not a non-empty list"},
      {15, "bad tools: tools is not a list"},
      {16, "bad weight: messages[1] weight is \"1\", not 0 or 1"},
      {17, "bad tool_calls: messages[0] has tool_calls but is a user message"},
  };
  for (const auto& [line, message] : expected) {
    auto at = ProblemsAt(report, path, line);
    ASSERT_EQ(at.size(), 1u) << "line " << line;
    EXPECT_EQ(at[0].rfind(message, 0), 0u) << "line " << line << ": " << at[0];
  }
  EXPECT_EQ(report.skipped_by_reason.at("bad weight"), 3);
  EXPECT_EQ(report.skipped_by_reason.at("no messages"), 2);
  EXPECT_EQ(report.skipped_by_reason.at("not JSON"), 1);
  std::string summary = report.Summary();
  EXPECT_NE(summary.find("18 lines, 2 usable"), std::string::npos) << summary;
  EXPECT_NE(summary.find("15 skipped (bad content: 1, bad tool_calls: 2, bad tools: 1, bad weight: 3"),
            std::string::npos) << summary;
}

TEST_F(DatasetTest, NoUsableLineIsAnError) {
  std::string path = Write("none.jsonl", {"{not json", R"({"messages": []})", ""});
  auto examples = ReadAll(path, {.format = Format::kSft});
  ASSERT_FALSE(examples.ok());
  EXPECT_EQ(examples.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(examples.status().message().find(path + ": 3 lines, 0 usable"), std::string::npos)
      << examples.status().message();
  EXPECT_NE(examples.status().message().find("no usable line; first: " + path + ":1: not JSON"),
            std::string::npos) << examples.status().message();
  std::string empty = Write("empty.jsonl", {});
  EXPECT_FALSE(ReadAll(empty, {.format = Format::kSft}).ok());
}

TEST_F(DatasetTest, MissingFileAndBadFractionRefused) {
  auto missing = DatasetReader::Open(dir_ + "/nope.jsonl", {});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope.jsonl"), std::string::npos);
  std::string path = Write("ok.jsonl", {kGood});
  EXPECT_FALSE(DatasetReader::Open(path, {.eval_fraction = 1.0}).ok());
  EXPECT_FALSE(DatasetReader::Open(path, {.eval_fraction = -0.1}).ok());
}

TEST_F(DatasetTest, CrlfNoFinalNewlineAndLongLines) {
  std::string long_line = R"({"messages": [{"role": "user", "content": ")" + std::string(5000, 'x') +
                          R"("}, {"role": "assistant", "content": "y"}]})";
  std::string path = Write("crlf.jsonl", {kGood + "\r", long_line, kGood}, /*final_newline=*/false);
  DatasetReport report;
  auto examples = ReadAll(path, {.format = Format::kSft, .max_line_bytes = 1000}, &report);
  ASSERT_TRUE(examples.ok()) << examples.status().ToString();
  EXPECT_EQ(examples->size(), 2u);
  EXPECT_EQ(report.lines, 3);
  auto at = ProblemsAt(report, path, 2);
  ASSERT_EQ(at.size(), 1u);
  EXPECT_EQ(at[0], "line too long: over 1000 bytes");
  auto full = ReadAll(path, {.format = Format::kSft});
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->size(), 3u);
}

TEST_F(DatasetTest, DpoLines) {
  std::string good = R"({"input": {"messages": [{"role": "user", "content": "Hi"}], "tools": []},)"
                     R"( "preferred_output": [{"role": "assistant", "content": "Hello!"}],)"
                     R"( "non_preferred_output": [{"role": "assistant", "content": "Go away."}]})";
  std::string path = Write("dpo.jsonl", {
      good,
      R"({"preferred_output": [], "non_preferred_output": []})",
      R"({"input": {"messages": [{"role": "user", "content": "Hi"}]}, "preferred_output": [{"role": "user", "content": "x"}], "non_preferred_output": [{"role": "assistant", "content": "y"}]})",
      R"({"input": {"messages": [{"role": "user", "content": "Hi"}]}, "preferred_output": [{"role": "assistant", "content": "x"}], "non_preferred_output": []})",
      R"({"input": {"messages": [{"role": "user", "content": "Hi"}]}, "preferred_output": [{"role": "assistant", "content": "x"}], "non_preferred_output": [{"role": "assistant", "content": ""}]})",
      R"({"input": {"messages": [{"role": "user", "content": "Hi"}]}, "preferred_output": [{"role": "assistant", "content": "x", "weight": 0}], "non_preferred_output": [{"role": "assistant", "content": "y"}]})",
  });
  DatasetReport report;
  auto examples = ReadAll(path, {.format = Format::kDpo}, &report);
  ASSERT_TRUE(examples.ok()) << examples.status().ToString();
  ASSERT_EQ(examples->size(), 1u);
  const Example& e = (*examples)[0];
  EXPECT_EQ(e.messages.size(), 1u);
  EXPECT_EQ(e.trained, std::vector<bool>{false});
  EXPECT_EQ(e.chosen[0]["content"], "Hello!");
  EXPECT_EQ(e.rejected[0]["content"], "Go away.");
  EXPECT_TRUE(e.tools.is_array());
  EXPECT_EQ(ProblemsAt(report, path, 2).at(0), "no input: no \"input\" object");
  EXPECT_EQ(ProblemsAt(report, path, 3).at(0), "bad preferred_output: preferred_output[0] is not an assistant message");
  EXPECT_EQ(ProblemsAt(report, path, 4).at(0).rfind("bad non_preferred_output: ", 0), 0u);
  EXPECT_EQ(ProblemsAt(report, path, 5).at(0),
            "empty assistant turn: non_preferred_output[0] has no content and no tool_calls");
  EXPECT_EQ(ProblemsAt(report, path, 6).at(0).rfind("bad weight: ", 0), 0u);
}

TEST_F(DatasetTest, RlKeepsEveryOtherFieldUntouched) {
  std::string path = Write("rl.jsonl", {
      R"({"id": 7, "messages": [{"role": "user", "content": "2+3?"}], "answer": "5", "tests": [{"in": [1, 2.50], "out": null}], "meta": {"z": 1, "a": 2}})",
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "answer": "1"})",
      R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]})",
  });
  DatasetReport report;
  auto examples = ReadAll(path, {.format = Format::kRl}, &report);
  ASSERT_TRUE(examples.ok()) << examples.status().ToString();
  ASSERT_EQ(examples->size(), 2u);
  const Example& e = (*examples)[0];
  EXPECT_EQ(e.fields.dump(), R"({"id":7,"answer":"5","tests":[{"in":[1,2.5],"out":null}],"meta":{"z":1,"a":2}})");
  EXPECT_EQ(e.trained, std::vector<bool>{false});
  EXPECT_EQ(ProblemsAt(report, path, 2).at(0),
            "prompt ends with an assistant turn: the last message is the assistant's");
  // An empty assistant turn in a prompt's history is not trained, so it is kept.
  EXPECT_EQ((*examples)[1].messages.size(), 3u);
}

// Lines with distinct content, numbered.
std::vector<std::string> NumberedLines(int n) {
  std::vector<std::string> lines;
  for (int i = 0; i < n; ++i)
    lines.push_back(R"({"messages": [{"role": "user", "content": "q)" + std::to_string(i) +
                    R"("}, {"role": "assistant", "content": "a"}]})");
  return lines;
}

std::set<std::string> Contents(const std::vector<Example>& examples) {
  std::set<std::string> out;
  for (const Example& e : examples) out.insert(e.messages[0]["content"].get<std::string>());
  return out;
}

TEST_F(DatasetTest, SplitIsDisjointCompleteAndStable) {
  std::vector<std::string> lines = NumberedLines(2000);
  std::string path = Write("split.jsonl", lines);
  auto side = [&](const std::string& p, Split split, double fraction) {
    auto examples = ReadAll(p, {.format = Format::kSft, .split = split, .eval_fraction = fraction});
    EXPECT_TRUE(examples.ok()) << examples.status().ToString();
    return examples.ok() ? Contents(*examples) : std::set<std::string>();
  };
  std::set<std::string> train = side(path, Split::kTrain, 0.2), eval = side(path, Split::kEval, 0.2);
  EXPECT_GT(eval.size(), 330u);
  EXPECT_LT(eval.size(), 470u);
  EXPECT_EQ(train.size() + eval.size(), 2000u);
  for (const std::string& c : eval) EXPECT_EQ(train.count(c), 0u) << c;
  // Reordered, and each line reformatted (whitespace, key order): the same sides.
  std::mt19937 rng(7);
  std::shuffle(lines.begin(), lines.end(), rng);
  for (std::string& line : lines) {
    ordered_json j = ordered_json::parse(line);
    ordered_json flipped = ordered_json::object();
    flipped["messages"] = ordered_json::array();
    for (const auto& m : j["messages"]) flipped["messages"].push_back({{"content", m["content"]}, {"role", m["role"]}});
    line = flipped.dump(1);
    line.erase(std::remove(line.begin(), line.end(), '\n'), line.end());
  }
  std::string shuffled = Write("shuffled.jsonl", lines);
  EXPECT_EQ(side(shuffled, Split::kEval, 0.2), eval);
  EXPECT_EQ(side(shuffled, Split::kTrain, 0.2), train);
  // Monotone: a larger fraction only moves lines to the eval side.
  std::set<std::string> small = side(path, Split::kEval, 0.05);
  EXPECT_LT(small.size(), eval.size());
  for (const std::string& c : small) EXPECT_EQ(eval.count(c), 1u) << c;
  // Zero: everything trains, and an eval split of nothing is an error.
  EXPECT_EQ(side(path, Split::kTrain, 0.0).size(), 2000u);
  auto none = ReadAll(path, {.format = Format::kSft, .split = Split::kEval, .eval_fraction = 0.0});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("leaves the eval side empty"), std::string::npos);
}

// A FIFO fed one line at a time: the reader yields each example before the next line exists,
// so it cannot be reading the file whole.
TEST_F(DatasetTest, ReadsAFifoLineByLine) {
  std::string path = dir_ + "/fifo";
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0);
  std::mutex mu;
  std::condition_variable cv;
  int consumed = 0;
  bool waited_in_vain = false;
  std::thread writer([&] {
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 5; ++i) {
      out << NumberedLines(5)[i] << "\n" << std::flush;
      std::unique_lock<std::mutex> lock(mu);
      // The reader must take line i before line i + 1 is written.
      if (!cv.wait_for(lock, std::chrono::seconds(3), [&] { return consumed > i; }))
        waited_in_vain = true;
    }
  });
  auto reader = DatasetReader::Open(path, {.format = Format::kSft});
  ASSERT_TRUE(reader.ok());
  Example example;
  for (int i = 0; i < 5; ++i) {
    auto more = (*reader)->Next(&example);
    ASSERT_TRUE(more.ok() && *more);
    EXPECT_EQ(example.messages[0]["content"], "q" + std::to_string(i));
    std::lock_guard<std::mutex> lock(mu);
    consumed = i + 1;
    cv.notify_all();
  }
  writer.join();
  EXPECT_FALSE(waited_in_vain) << "the reader waited for more than one line";
  auto end = (*reader)->Next(&example);
  ASSERT_TRUE(end.ok());
  EXPECT_FALSE(*end);
}

int64_t RssKiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  return -1;
}

TEST_F(DatasetTest, LargeFileStreamsInBoundedMemory) {
  std::string path = dir_ + "/large.jsonl";
  {
    std::ofstream out(path, std::ios::binary);
    std::string filler(2000, 'w');
    for (int i = 0; i < 20000; ++i)
      out << R"({"messages": [{"role": "user", "content": ")" << i << filler
          << R"("}, {"role": "assistant", "content": "ok"}], "n": )" << i << "}\n";
  }
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  ASSERT_GT(st.st_size, 40'000'000);
  int64_t before = RssKiB();
  auto reader = DatasetReader::Open(path, {.format = Format::kSft});
  ASSERT_TRUE(reader.ok());
  Example example;
  int64_t count = 0, peak = before;
  while (true) {
    auto more = (*reader)->Next(&example);
    ASSERT_TRUE(more.ok()) << more.status().ToString();
    if (!*more) break;
    if (++count % 1000 == 0) peak = std::max(peak, RssKiB());
  }
  EXPECT_EQ(count, 20000);
  // The file is 40 MB; the reader holds one line (2 KB) and a 64 KiB buffer.
  EXPECT_LT(peak - before, 8 * 1024) << "RSS grew by " << (peak - before) << " KiB";
}

}  // namespace
}  // namespace flywheel::data
