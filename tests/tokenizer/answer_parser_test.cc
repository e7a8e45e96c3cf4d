// The answer splitter (tokenizer/answer_parser.h): reasoning, content and tool calls from
// whole texts, and the same parts whatever pieces the text arrives in (streaming).
#include "tokenizer/answer_parser.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace flywheel::tokenizer {
namespace {

AnswerParts Whole(ReasoningParser r, bool tools, const std::string& text) {
  return AnswerSplitter(r, tools).Feed(text, true);
}

// Feeds `text` in random pieces (sometimes empty, sometimes one byte), concatenating.
AnswerParts Pieces(ReasoningParser r, bool tools, const std::string& text, std::mt19937& rng) {
  AnswerSplitter splitter(r, tools);
  AnswerParts all;
  size_t at = 0;
  while (at < text.size()) {
    const size_t n = std::min(text.size() - at, static_cast<size_t>(rng() % 7));
    AnswerParts p = splitter.Feed(std::string_view(text).substr(at, n), false);
    all.reasoning += p.reasoning;
    all.content += p.content;
    for (auto& c : p.calls) all.calls.push_back(c);
    at += n;
  }
  AnswerParts p = splitter.Feed("", true);
  all.reasoning += p.reasoning;
  all.content += p.content;
  for (auto& c : p.calls) all.calls.push_back(c);
  return all;
}

TEST(AnswerSplitterTest, ReasoningAndContent) {
  AnswerParts q = Whole(ReasoningParser::kQwen3, false, "\n<think>\nadd 2 and 2\n</think>\n\nIt is 4.");
  EXPECT_EQ(q.reasoning, "\nadd 2 and 2\n");
  EXPECT_EQ(q.content, "It is 4.");
  // Qwen3: no opening tag, no reasoning.
  q = Whole(ReasoningParser::kQwen3, false, "It is 4. </think> indeed");
  EXPECT_EQ(q.reasoning, "");
  EXPECT_EQ(q.content, "It is 4. </think> indeed");
  // DeepSeek-R1: the template opened it.
  q = Whole(ReasoningParser::kDeepSeekR1, false, "let me see</think>4");
  EXPECT_EQ(q.reasoning, "let me see");
  EXPECT_EQ(q.content, "4");
  q = Whole(ReasoningParser::kDeepSeekR1, false, "<think>never closed");
  EXPECT_EQ(q.reasoning, "never closed");
  EXPECT_EQ(q.content, "");
  q = Whole(ReasoningParser::kNone, false, "<think>x</think>y");
  EXPECT_EQ(q.content, "<think>x</think>y");
}

TEST(AnswerSplitterTest, ToolCalls) {
  AnswerParts p = Whole(ReasoningParser::kNone, true,
                        "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                        "{\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\"}</tool_call>");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, R"({"city":"Oslo"})");
  EXPECT_EQ(p.calls[1].name, "now");
  EXPECT_EQ(p.calls[1].arguments, "{}");
  EXPECT_EQ(p.content, "Let me look.");
  // Arguments keep the model's key order; brackets nested without end are not a call.
  p = Whole(ReasoningParser::kNone, true,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"z\": 1, \"a\": 2}}</tool_call>");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].arguments, R"({"z":1,"a":2})");
  const std::string deep = "<tool_call>{\"name\": \"f\", \"arguments\": " + std::string(100000, '[') + "</tool_call>";
  p = Whole(ReasoningParser::kNone, true, deep);
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, deep);
  // A block that does not parse, and one never closed, stay in the content as written.
  p = Whole(ReasoningParser::kNone, true, "a <tool_call>{oops}</tool_call> b <tool_call>{\"name\"");
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, "a <tool_call>{oops}</tool_call> b <tool_call>{\"name\"");
  p = Whole(ReasoningParser::kNone, true, "ends with <tool_call>");
  EXPECT_EQ(p.content, "ends with <tool_call>");
  // Reasoning first, then a call.
  p = Whole(ReasoningParser::kQwen3, true,
            "<think>need the tool</think>\n\n<tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>");
  EXPECT_EQ(p.reasoning, "need the tool");
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].arguments, "{}");
}

TEST(AnswerSplitterTest, AnyPiecesGiveTheWholeTextsParts) {
  const std::vector<std::string> texts = {
      "\n<think>\nadd 2 and 2\n</think>\n\nIt is 4.",
      "It is 4. </think> indeed <tool_call",
      "let me see</think>4  ",
      "<thin",
      "  <think",
      "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n  and more\n",
      "a <tool_call>{oops}</tool_call> b <tool_call>{\"name\"",
      "x<tool_call>{\"name\": \"f\"}</tool_call>   <tool_call>{\"name\": \"g\"}</tool_call>  y <tool_ca",
      "<think>need the tool</think>\n\n<tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>",
      "<tool_call>", "   ", "",
  };
  std::mt19937 rng(5);
  for (ReasoningParser r : {ReasoningParser::kNone, ReasoningParser::kQwen3, ReasoningParser::kDeepSeekR1}) {
    for (bool tools : {false, true}) {
      for (const std::string& text : texts) {
        const AnswerParts whole = Whole(r, tools, text);
        // Nothing is lost: without tools, reasoning + content is the text less the tags
        // and the whitespace the rules drop.
        for (int round = 0; round < 20; ++round) {
          const AnswerParts pieces = Pieces(r, tools, text, rng);
          SCOPED_TRACE(text);
          ASSERT_EQ(pieces.reasoning, whole.reasoning);
          ASSERT_EQ(pieces.content, whole.content);
          ASSERT_EQ(pieces.calls.size(), whole.calls.size());
          for (size_t i = 0; i < whole.calls.size(); ++i) {
            EXPECT_EQ(pieces.calls[i].name, whole.calls[i].name);
            EXPECT_EQ(pieces.calls[i].arguments, whole.calls[i].arguments);
          }
        }
      }
    }
  }
  // Without a parser the text is the content, byte for byte.
  EXPECT_EQ(Whole(ReasoningParser::kNone, false, texts[5]).content, texts[5]);
}

TEST(AnswerSplitterTest, ParserNames) {
  EXPECT_EQ(*ParseReasoningParser("qwen3"), ReasoningParser::kQwen3);
  EXPECT_EQ(*ParseReasoningParser("deepseek_r1"), ReasoningParser::kDeepSeekR1);
  EXPECT_EQ(*ParseReasoningParser(""), ReasoningParser::kNone);
  auto bad = ParseReasoningParser("granite");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("qwen3"), std::string::npos);
}

}  // namespace
}  // namespace flywheel::tokenizer
