// The built-in graders one by one (edge cases included), their composition with weights, the
// config (JSON and TOML-like) and its refusals, and RunAsync.
#include <gtest/gtest.h>

#include <cmath>

#include "grading/grader.h"
#include "tests/grading/grading_test_util.h"

namespace flywheel::grading {
namespace {

using nlohmann::json;
using testing::MakeSample;

std::shared_ptr<const Grader> Load(const std::string& config) {
  auto specs = ParseGraderConfig(config);
  EXPECT_TRUE(specs.ok()) << specs.status().ToString();
  if (!specs.ok()) return nullptr;
  auto grader = LoadBuiltinGraders(*specs);
  EXPECT_TRUE(grader.ok()) << grader.status().ToString();
  return grader.ok() ? *grader : nullptr;
}

Status LoadError(const std::string& config) {
  auto specs = ParseGraderConfig(config);
  if (!specs.ok()) return specs.status();
  auto grader = LoadBuiltinGraders(*specs);
  return grader.ok() ? Status::Ok() : grader.status();
}

double RewardOf(const Grader& grader, const std::string& completion, json fields) {
  Outcome outcome = grader.Grade(MakeSample("s", completion, std::move(fields)));
  EXPECT_EQ(outcome.kind, OutcomeKind::kReward) << outcome.reason;
  return outcome.reward;
}

TEST(ExactMatchTest, ComparesAfterStrippingAgainstTheAnswerField) {
  auto grader = Load(R"([{"type": "exact_match"}])");
  ASSERT_NE(grader, nullptr);
  EXPECT_EQ(RewardOf(*grader, "  42\n", {{"answer", "42"}}), 1.0);
  EXPECT_EQ(RewardOf(*grader, "42.", {{"answer", "42"}}), 0.0);
  EXPECT_EQ(RewardOf(*grader, "42", {{"answer", 42}}), 1.0);                      // a number field
  EXPECT_EQ(RewardOf(*grader, "b", {{"answer", json::array({"a", "b"})}}), 1.0);  // any of a list
  EXPECT_EQ(RewardOf(*grader, "", {{"answer", ""}}), 1.0);
}

TEST(ExactMatchTest, NamedFieldAndCaseInsensitive) {
  auto grader = Load(R"([{"type": "exact_match", "field": "label", "case_sensitive": false}])");
  ASSERT_NE(grader, nullptr);
  EXPECT_EQ(RewardOf(*grader, "Positive", {{"label", "positive"}}), 1.0);
  Outcome missing = grader->Grade(MakeSample("s", "x", {{"answer", "x"}}));
  EXPECT_EQ(missing.kind, OutcomeKind::kUngraded);
  EXPECT_NE(missing.reason.find("\"label\""), std::string::npos) << missing.reason;
}

TEST(RegexTest, CaptureGroupComparedToAField) {
  auto grader =
      Load(R"j([{"type": "regex", "pattern": "answer is (-?\\d+)", "field": "answer"}])j");
  ASSERT_NE(grader, nullptr);
  EXPECT_EQ(RewardOf(*grader, "I think the answer is 7. No, the answer is 12", {{"answer", "12"}}),
            1.0);
  EXPECT_EQ(RewardOf(*grader, "the answer is 7", {{"answer", "12"}}), 0.0);
  Outcome none = grader->Grade(MakeSample("s", "no idea", {{"answer", "12"}}));
  EXPECT_EQ(none.reward, 0.0);
  EXPECT_EQ(none.metrics.at("regex.matched"), 0.0);
}

TEST(RegexTest, FirstMatchAndPlainMatchWithoutField) {
  auto first =
      Load(R"j([{"type": "regex", "pattern": "(\\d+)", "field": "answer", "match": "first"}])j");
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(RewardOf(*first, "3 then 4", {{"answer", 3}}), 1.0);
  auto plain =
      Load(R"([{"type": "regex", "pattern": "^<think>[\\s\\S]*</think>", "ignore_case": true}])");
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(RewardOf(*plain, "<THINK>a\nb</think> 5", {}), 1.0);
  EXPECT_EQ(RewardOf(*plain, "5", {}), 0.0);
}

TEST(RegexTest, SearchesOnlyTheLastWindowOfALongCompletion) {
  auto grader =
      Load(R"j([{"type": "regex", "pattern": "X(\\d)", "field": "answer", "window": 100}])j");
  ASSERT_NE(grader, nullptr);
  const std::string filler(100000, 'a');
  EXPECT_EQ(RewardOf(*grader, "X1" + filler, {{"answer", "1"}}), 0.0);  // outside the window
  EXPECT_EQ(RewardOf(*grader, filler + "X1", {{"answer", "1"}}), 1.0);
}

TEST(NumericTest, LastNumberWithinTolerance) {
  auto grader = Load(R"([{"type": "numeric", "rel_tol": 0.01}])");
  ASSERT_NE(grader, nullptr);
  EXPECT_EQ(RewardOf(*grader, "2 + 3 = 5", {{"answer", "5"}}), 1.0);
  EXPECT_EQ(RewardOf(*grader, "5 or maybe 6", {{"answer", 5}}), 0.0);  // the last number counts
  EXPECT_EQ(RewardOf(*grader, "about 99.5", {{"answer", 100}}), 1.0);  // 0.5% off
  EXPECT_EQ(RewardOf(*grader, "about 98", {{"answer", 100}}), 0.0);    // 2% off
  EXPECT_EQ(RewardOf(*grader, "x = -1,234.5", {{"answer", "-1234.5"}}), 1.0);
  EXPECT_EQ(RewardOf(*grader, "1.5e3 meters.", {{"answer", 1500}}), 1.0);
  EXPECT_EQ(RewardOf(*grader, "so .5", {{"answer", 0.5}}), 1.0);
  EXPECT_EQ(RewardOf(*grader, "the list 1,2,3", {{"answer", 3}}), 1.0);  // not one number 1,2,3
}

TEST(NumericTest, NoNumberIsWrongAndABadFieldIsUngraded) {
  auto grader = Load(R"([{"type": "numeric", "abs_tol": 0.5}])");
  ASSERT_NE(grader, nullptr);
  Outcome none = grader->Grade(MakeSample("s", "I cannot say", {{"answer", 3}}));
  EXPECT_EQ(none.kind, OutcomeKind::kReward);
  EXPECT_EQ(none.reward, 0.0);
  EXPECT_EQ(none.metrics.at("numeric.no_number"), 1.0);
  EXPECT_EQ(RewardOf(*grader, "3.4", {{"answer", 3}}), 1.0);
  EXPECT_EQ(grader->Grade(MakeSample("s", "3", {{"answer", "three"}})).kind,
            OutcomeKind::kUngraded);
  EXPECT_EQ(grader->Grade(MakeSample("s", "3", {{"answer", json::object()}})).kind,
            OutcomeKind::kUngraded);
}

TEST(ContainsTest, LiteralOrFieldAnyOrAll) {
  auto literal = Load(R"([{"type": "contains", "value": "Paris", "case_sensitive": false}])");
  ASSERT_NE(literal, nullptr);
  EXPECT_EQ(RewardOf(*literal, "it is paris.", {}), 1.0);
  EXPECT_EQ(RewardOf(*literal, "it is Lyon.", {}), 0.0);
  auto all = Load(R"([{"type": "contains", "field": "keywords", "mode": "all"}])");
  ASSERT_NE(all, nullptr);
  EXPECT_EQ(RewardOf(*all, "red and blue", {{"keywords", json::array({"red", "blue"})}}), 1.0);
  EXPECT_EQ(RewardOf(*all, "red only", {{"keywords", json::array({"red", "blue"})}}), 0.0);
}

TEST(JsonFieldTest, WholeCompletionOrTheLastObjectInIt) {
  auto grader = Load(R"([{"type": "json_field", "path": "result.values[1]"}])");
  ASSERT_NE(grader, nullptr);
  EXPECT_EQ(RewardOf(*grader, R"({"result": {"values": [1, 2]}})", {{"answer", 2}}), 1.0);
  EXPECT_EQ(RewardOf(*grader, "Sure!\n```json\n{\"result\": {\"values\": [1, \"2\"]}}\n```",
                     {{"answer", 2}}),
            1.0);
  EXPECT_EQ(RewardOf(*grader, R"({"x": 1} then {"result": {"values": [0, 5]}})", {{"answer", 5}}),
            1.0);
  Outcome not_json = grader->Grade(MakeSample("s", "{not json", {{"answer", 2}}));
  EXPECT_EQ(not_json.reward, 0.0);
  EXPECT_EQ(not_json.metrics.at("json_field.not_json"), 1.0);
  Outcome no_path = grader->Grade(MakeSample("s", R"({"result": {}})", {{"answer", 2}}));
  EXPECT_EQ(no_path.metrics.at("json_field.missing_path"), 1.0);
}

TEST(JsonFieldTest, JsonPointerAndStructuredValues) {
  auto grader = Load(R"([{"type": "json_field", "path": "/a/b", "field": "expected"}])");
  ASSERT_NE(grader, nullptr);
  EXPECT_EQ(RewardOf(*grader, R"({"a": {"b": [1, {"c": true}]}})",
                     {{"expected", json::parse(R"([1, {"c": true}])")}}),
            1.0);
  EXPECT_EQ(RewardOf(*grader, R"({"a": {"b": " yes "}})", {{"expected", "yes"}}), 1.0);
  EXPECT_EQ(RewardOf(*grader, R"({"a": {"b": "no"}})", {{"expected", "yes"}}), 0.0);
}

TEST(JsonFieldTest, DeeplyNestedCompletionIsRefusedNotRecursedInto) {
  auto grader = Load(R"([{"type": "json_field", "path": "a"}])");
  ASSERT_NE(grader, nullptr);
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  Outcome outcome = grader->Grade(MakeSample("s", deep, {{"answer", 1}}));
  EXPECT_EQ(outcome.kind, OutcomeKind::kReward);
  EXPECT_EQ(outcome.reward, 0.0);
}

TEST(LengthPenaltyTest, TokensOrCharsOverTheBudget) {
  auto chars = Load(R"([{"type": "length_penalty", "budget": 10, "unit": "chars"}])");
  ASSERT_NE(chars, nullptr);
  EXPECT_EQ(RewardOf(*chars, "0123456789", {}), 0.0);
  EXPECT_DOUBLE_EQ(RewardOf(*chars, "012345678901234", {}), -0.5);       // 5 over, 1/10 each
  EXPECT_DOUBLE_EQ(RewardOf(*chars, std::string(1000, 'x'), {}), -1.0);  // capped
  auto tokens =
      Load(R"([{"type": "length_penalty", "budget": 2, "per_unit": 0.25, "max_penalty": 10}])");
  ASSERT_NE(tokens, nullptr);
  Sample counted = MakeSample("s", "one two three four");
  EXPECT_DOUBLE_EQ(tokens->Grade(counted).reward, -0.5);  // 4 words, 2 over
  counted.completion_tokens = 6;                          // the caller's token count wins
  Outcome outcome = tokens->Grade(counted);
  EXPECT_DOUBLE_EQ(outcome.reward, -1.0);
  EXPECT_EQ(outcome.metrics.at("length_penalty.length"), 6.0);
  EXPECT_EQ(outcome.metrics.at("length_penalty.over"), 4.0);
}

TEST(CompositionTest, WeightedSumWithNamedMetrics) {
  auto grader = Load(R"({"graders": [
      {"type": "numeric", "weight": 1.0},
      {"type": "contains", "weight": 0.5, "params": {"value": "because"}},
      {"type": "length_penalty", "name": "short", "weight": 2.0, "budget": 3, "unit": "chars"},
      {"type": "contains", "weight": 0.25, "value": "x"}]})");
  ASSERT_NE(grader, nullptr);
  Outcome outcome = grader->Grade(MakeSample("s", "because 7", {{"answer", 7}}));
  ASSERT_EQ(outcome.kind, OutcomeKind::kReward) << outcome.reason;
  // 1*1 + 0.5*1 + 2*(-min(1, 6/3)) + 0.25*0
  EXPECT_DOUBLE_EQ(outcome.reward, 1.0 + 0.5 - 2.0);
  EXPECT_EQ(outcome.metrics.at("numeric.reward"), 1.0);
  EXPECT_EQ(outcome.metrics.at("contains.reward"), 1.0);
  EXPECT_EQ(outcome.metrics.at("contains#2.reward"), 0.0);
  EXPECT_EQ(outcome.metrics.at("short.over"), 6.0);
  Outcome ungraded = grader->Grade(MakeSample("s", "because 7", {}));
  EXPECT_EQ(ungraded.kind, OutcomeKind::kUngraded);
  EXPECT_EQ(ungraded.reason.rfind("numeric: ", 0), 0u) << ungraded.reason;
}

TEST(ConfigTest, TomlLikeTables) {
  auto grader = Load(R"(
# the run's graders
[[grader]]
type = "regex"
pattern = 'answer: (\d+)'
field = "answer"
weight = 0.75

[[grader]]
type = "length_penalty"
budget = 100
unit = "chars"
)");
  ASSERT_NE(grader, nullptr);
  EXPECT_DOUBLE_EQ(grader->Grade(MakeSample("s", "answer: 4", {{"answer", 4}})).reward, 0.75);
}

TEST(ConfigTest, ErrorsAreRefusedAtLoadNamingTheEntry) {
  struct Case {
    const char* config;
    const char* message;
  };
  const Case cases[] = {
      {R"([{"type": "exact"}])", "grader 1 (exact): unknown type 'exact'"},
      {R"([{"type": "numeric"}, {"type": "regex", "pattern": "(unclosed"}])",
       "grader 2 (regex): bad regex '(unclosed'"},
      {R"([{"type": "regex"}])", "missing parameter 'pattern'"},
      {R"j([{"type": "regex", "pattern": "a(b)", "group": 2}])j",
       "group 2.0 is not a capture group"},
      {R"([{"type": "json_field"}])", "grader 1 (json_field): missing parameter 'path'"},
      {R"([{"type": "json_field", "path": "a..b"}])", "empty key"},
      {R"([{"type": "length_penalty"}])", "missing parameter 'budget'"},
      {R"([{"type": "length_penalty", "budget": 5, "unit": "words"}])", "unit must be"},
      {R"([{"type": "numeric", "feild": "answer"}])", "unknown parameter 'feild'"},
      {R"([{"type": "numeric", "field": 3}])", "parameter 'field' must be a string"},
      {R"([{"type": "contains"}])", "exactly one of 'value'"},
      {R"([{"weight": 1}])", "entry 1: no 'type'"},
      {R"([])", "no graders"},
      {R"([{"type": "numeric", "weight": "1"}])", "'weight' is not a number"},
      {"[[grader]]\ntype = numeric\n", "line 2: value is not"},
      {"[[grader]]\ntype\n", "line 2: expected [[grader]] or key = value"},
      {"{\"type\": ", "not valid JSON"},
  };
  for (const Case& c : cases) {
    Status status = LoadError(c.config);
    EXPECT_FALSE(status.ok()) << c.config;
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.config;
    EXPECT_NE(status.message().find(c.message), std::string::npos)
        << c.config << " -> " << status.message();
  }
}

TEST(RunAsyncTest, GradesOffTheCallersThreadAndCounts) {
  auto grader = Load(R"([{"type": "numeric"}])");
  ASSERT_NE(grader, nullptr);
  auto async = RunAsync(grader, "builtin: numeric", 3);
  std::vector<std::future<Outcome>> futures;
  for (int i = 0; i < 50; ++i) {
    futures.push_back(async->Submit(MakeSample(std::to_string(i), "= " + std::to_string(i),
                                               {{"answer", i % 2 == 0 ? i : -1}})));
  }
  futures.push_back(async->Submit(MakeSample("missing", "1", {})));
  for (int i = 0; i < 50; ++i) {
    Outcome outcome = testing::Await(futures[i]);
    EXPECT_EQ(outcome.reward, i % 2 == 0 ? 1.0 : 0.0) << i;
  }
  EXPECT_EQ(testing::Await(futures.back()).kind, OutcomeKind::kUngraded);
  GraderCounters counters = async->counters();
  EXPECT_EQ(counters.submitted, 51u);
  EXPECT_EQ(counters.rewarded, 50u);
  EXPECT_EQ(counters.ungraded, 1u);
  EXPECT_TRUE(async->status().ok());
}

TEST(StartGraderTest, ExactlyOneKindOfGrader) {
  GraderSettings none;
  EXPECT_NE(StartGrader(none).status().message().find("no grader"), std::string::npos);
  GraderSettings two;
  two.command = "python3 grade.py";
  two.url = "http://127.0.0.1:1/grade";
  EXPECT_NE(StartGrader(two).status().message().find("more than one grader"), std::string::npos);
  GraderSettings builtin;
  builtin.builtin = {GraderSpec{"exact_match", "", 1.0, json::object()}};
  auto grader = StartGrader(builtin);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  EXPECT_EQ((*grader)->name(), "builtin: exact_match");
  auto future = (*grader)->Submit(MakeSample("a", " yes ", {{"answer", "yes"}}));
  EXPECT_EQ(testing::Await(future).reward, 1.0);
  builtin.builtin[0].type = "exakt";
  EXPECT_NE(StartGrader(builtin).status().message().find("unknown type 'exakt'"),
            std::string::npos);
}

}  // namespace
}  // namespace flywheel::grading
