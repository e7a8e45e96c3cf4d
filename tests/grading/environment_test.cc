// Multi-turn environments: a calculator environment (a python3 script) that wants a tool
// call before the answer, driven by fake "models" through EpisodeTracker; unknown ids;
// max_turns; and zero-variance filtering.
#include "grading/environment.h"

#include <gtest/gtest.h>

#include <optional>

#include "grading/grader.h"
#include "grading/zero_variance.h"
#include "tests/grading/grading_test_util.h"

namespace flywheel::grading {
namespace {

using nlohmann::json;
using testing::Await;

// A calculator environment: a <tool_call>{"name": "calc", "arguments": {"expr": ...}}</tool_call>
// is answered with the tool's result; "ANSWER: n" is graded (1 when right and the tool was
// used); anything else gets a user turn asking for the tool. "GHOST" in a completion also
// makes it answer for an id nobody asked about.
constexpr char kCalculator[] = R"py(
import re
for line in sys.stdin:
    request = json.loads(line)
    rid, text = request["id"], request["completion"]
    if "GHOST" in text:
        print(json.dumps({"id": "ghost-episode", "reward": 1}), flush=True)
    call = re.search(r"<tool_call>(.*?)</tool_call>", text, re.S)
    if call:
        arguments = json.loads(call.group(1))["arguments"]
        expr = arguments["expr"]
        result = str(eval(expr)) if re.fullmatch(r"[0-9+*/() -]+", expr) else "error: bad expression"
        print(json.dumps({"id": rid, "messages": [{"role": "tool", "name": "calc", "content": result}]}), flush=True)
        continue
    answer = re.search(r"ANSWER:\s*(-?\d+)", text)
    if answer:
        used_tool = any(m.get("role") == "tool" for m in request["messages"])
        correct = int(answer.group(1)) == int(request["fields"]["answer"])
        print(json.dumps({"id": rid, "reward": 1.0 if used_tool and correct else 0.0,
                          "metrics": {"used_tool": float(used_tool), "correct": float(correct)}}), flush=True)
        continue
    print(json.dumps({"id": rid, "messages": [{"role": "user", "content": "Use the calc tool, then write ANSWER: <n>."}]}), flush=True)
)py";

enum class Policy { kGood, kImpatient, kRambling, kLooping };

// The fake model: what it writes given the conversation so far.
std::pair<json, std::string> FakeModel(Policy policy, const json& conversation) {
  const std::string prompt = conversation[0]["content"];
  const std::string expr =
      prompt.substr(prompt.find("Compute ") + 8, prompt.find('.') - prompt.find("Compute ") - 8);
  const json& last = conversation.back();
  std::string text;
  json tool_calls;
  if (policy == Policy::kImpatient) {
    text = "ANSWER: 0";
  } else if (policy == Policy::kRambling && conversation.size() == 1) {
    text = "Hmm, let me think about it. GHOST";
  } else if (last["role"] == "tool" && policy != Policy::kLooping) {
    text = "ANSWER: " + last["content"].get<std::string>();
  } else {
    const json arguments = {{"expr", expr}};
    text = "<tool_call>" + json{{"name", "calc"}, {"arguments", arguments}}.dump() + "</tool_call>";
    tool_calls = json::array({{{"type", "function"},
                               {"function", {{"name", "calc"}, {"arguments", arguments.dump()}}}}});
  }
  json message = {{"role", "assistant"}, {"content", tool_calls.is_null() ? text : ""}};
  if (!tool_calls.is_null()) message["tool_calls"] = tool_calls;
  return {message, text};
}

TEST(EnvironmentTest, CalculatorEpisodesRunSeveralTurnsToAReward) {
  testing::TempDir dir;
  ExternalGraderOptions options;
  options.timeout = std::chrono::milliseconds(5000);
  options.stop_grace = std::chrono::milliseconds(500);
  auto grader = StartProcessGrader(testing::WriteGrader(dir, "calc.py", kCalculator), options);
  ASSERT_TRUE(grader.ok()) << grader.status().ToString();
  EpisodeTracker tracker(/*max_turns=*/3);
  const std::map<std::string, Policy> policies = {{"good", Policy::kGood},
                                                  {"impatient", Policy::kImpatient},
                                                  {"rambling", Policy::kRambling},
                                                  {"looping", Policy::kLooping}};
  for (const auto& [id, policy] : policies) {
    ASSERT_TRUE(
        tracker
            .Begin(id, json::array({{{"role", "user"}, {"content", "Compute 17*23. Use calc."}}}))
            .ok());
  }
  std::map<std::string, EpisodeStep> ended;
  for (int round = 0; round < 5 && tracker.active() > 0; ++round) {
    std::map<std::string, std::future<Outcome>> futures;  // every active episode's turn at once
    for (const auto& [id, policy] : policies) {
      if (ended.count(id)) continue;
      auto conversation = tracker.Conversation(id);
      ASSERT_TRUE(conversation.ok());
      auto [message, text] = FakeModel(policy, *conversation);
      auto sample = tracker.Turn(id, message, text, {{"answer", 391}});
      ASSERT_TRUE(sample.ok()) << sample.status().ToString();
      futures.emplace(id, (*grader)->Submit(std::move(sample).value()));
    }
    for (auto& [id, future] : futures) {
      EpisodeStep step = tracker.OnOutcome(id, Await(future));
      if (step.kind != StepKind::kContinue) ended[id] = step;
    }
  }
  ASSERT_EQ(ended.size(), 4u);
  EXPECT_EQ(ended["good"].kind, StepKind::kFinished);
  EXPECT_EQ(ended["good"].outcome.reward, 1.0);
  EXPECT_EQ(ended["good"].turns, 2);
  EXPECT_EQ(ended["good"].outcome.metrics.at("used_tool"), 1.0);
  EXPECT_EQ(ended["rambling"].kind, StepKind::kFinished);
  EXPECT_EQ(ended["rambling"].outcome.reward, 1.0);
  EXPECT_EQ(ended["rambling"].turns, 3);
  EXPECT_EQ(ended["impatient"].kind, StepKind::kFinished);
  EXPECT_EQ(ended["impatient"].outcome.reward, 0.0);  // answered without the tool, wrongly
  EXPECT_EQ(ended["impatient"].turns, 1);
  EXPECT_EQ(ended["looping"].kind, StepKind::kGaveUp);
  EXPECT_EQ(ended["looping"].turns, 3);
  EXPECT_NE(ended["looping"].reason.find("max_turns (3)"), std::string::npos);
  EpisodeCounters counters = tracker.counters();
  EXPECT_EQ(counters.started, 4u);
  EXPECT_EQ(counters.finished, 3u);
  EXPECT_EQ(counters.gave_up_max_turns, 1u);
  EXPECT_EQ(counters.model_turns, 9u);
  EXPECT_EQ(counters.environment_messages, 5u);      // good 1, rambling 2, looping 2
  EXPECT_EQ((*grader)->counters().unknown_ids, 1u);  // the ghost answer, dropped
  EXPECT_EQ((*grader)->counters().continued,
            5u + 1u);  // looping's last continue is refused by max_turns
  grader->reset();
  EXPECT_TRUE(testing::AllEnded(dir));
}

TEST(EnvironmentTest, TheConversationGrowsByTheModelAndTheEnvironmentTurns) {
  EpisodeTracker tracker(4);
  ASSERT_TRUE(tracker.Begin("e", json::array({{{"role", "user"}, {"content", "hi"}}})).ok());
  auto sample =
      tracker.Turn("e", {{"role", "assistant"}, {"content", "call"}}, "call", json::object());
  ASSERT_TRUE(sample.ok());
  EXPECT_EQ(sample->messages.size(), 1u);  // the conversation before this turn
  EXPECT_EQ(sample->completion, "call");
  Outcome tool;
  tool.kind = OutcomeKind::kContinue;
  tool.messages = json::array({{{"role", "tool"}, {"content", "4"}}});
  EpisodeStep step = tracker.OnOutcome("e", tool);
  ASSERT_EQ(step.kind, StepKind::kContinue);
  ASSERT_EQ(step.messages.size(), 3u);
  EXPECT_EQ(step.messages[1]["role"], "assistant");
  EXPECT_EQ(step.messages[2]["role"], "tool");
  EXPECT_EQ(tracker.Conversation("e")->size(), 3u);
}

TEST(EnvironmentTest, UnknownIdsAndMisuseAreRefusedAndCounted) {
  EpisodeTracker tracker(2);
  EXPECT_EQ(tracker.OnOutcome("nobody", Outcome::Reward(1)).kind, StepKind::kUnknown);
  EXPECT_EQ(tracker.Turn("nobody", json::object(), "", json::object()).status().code(),
            StatusCode::kNotFound);
  ASSERT_TRUE(tracker.Begin("a", json::array()).ok());
  EXPECT_FALSE(tracker.Begin("a", json::array()).ok());   // already active
  EXPECT_FALSE(tracker.Begin("b", json::object()).ok());  // not an array
  EXPECT_EQ(tracker.OnOutcome("a", Outcome::Reward(1)).kind,
            StepKind::kUnknown);  // no turn waiting
  ASSERT_TRUE(tracker.Turn("a", json::object(), "", json::object()).ok());
  EXPECT_FALSE(tracker.Turn("a", json::object(), "", json::object()).ok());  // one turn at a time
  EpisodeStep ungraded = tracker.OnOutcome("a", Outcome::Ungraded("no answer within 5 ms"));
  EXPECT_EQ(ungraded.kind, StepKind::kUngraded);
  EXPECT_EQ(ungraded.reason, "no answer within 5 ms");
  EXPECT_EQ(tracker.active(), 0u);
  EXPECT_EQ(tracker.counters().unknown_ids, 3u);
  EXPECT_EQ(tracker.counters().ungraded, 1u);
  ASSERT_TRUE(tracker.Begin("c", json::array()).ok());
  EXPECT_TRUE(tracker.Abandon("c"));
  EXPECT_FALSE(tracker.Abandon("c"));
}

TEST(ZeroVarianceTest, EqualRewardsAreDroppedAndUngradedLeftOut) {
  ZeroVarianceFilter filter;
  using R = std::vector<std::optional<double>>;
  const R all_equal = {1.0, 1.0, 1.0, 1.0};
  const R mixed = {1.0, 0.0, std::nullopt, 1.0};
  const R equal_but_ungraded = {0.0, std::nullopt, 0.0, std::nullopt};  // ungraded ignored
  const R one_graded = {0.5, std::nullopt, std::nullopt};
  const R none_graded = {std::nullopt, std::nullopt};
  GroupVerdict verdict = filter.Decide(all_equal);
  EXPECT_FALSE(verdict.keep);
  EXPECT_EQ(verdict.reason, "zero variance");
  verdict = filter.Decide(mixed);
  EXPECT_TRUE(verdict.keep);
  EXPECT_EQ(verdict.graded, 3u);
  EXPECT_EQ(verdict.ungraded, 1u);
  EXPECT_FALSE(filter.Decide(equal_but_ungraded).keep);
  EXPECT_EQ(filter.Decide(one_graded).reason, "fewer than 2 graded samples");
  EXPECT_FALSE(filter.Decide(none_graded).keep);
  ZeroVarianceCounters counters = filter.counters();
  EXPECT_EQ(counters.groups, 5u);
  EXPECT_EQ(counters.kept, 1u);
  EXPECT_EQ(counters.dropped_zero_variance, 2u);
  EXPECT_EQ(counters.dropped_too_few_graded, 2u);
  EXPECT_EQ(counters.ungraded_samples, 7u);
}

TEST(ZeroVarianceTest, ToleranceAndDisabled) {
  ZeroVarianceFilter tolerant(true, 1e-3);
  const std::vector<std::optional<double>> close = {0.5, 0.5005};
  EXPECT_FALSE(tolerant.Decide(close).keep);
  ZeroVarianceFilter off(false);
  const std::vector<std::optional<double>> equal = {1.0, 1.0};
  EXPECT_TRUE(off.Decide(equal).keep);
}

}  // namespace
}  // namespace flywheel::grading
