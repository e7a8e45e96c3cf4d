// Splits a chat answer's text, as it is generated, into reasoning, content and tool calls,
// so that streamed and whole answers carry the same parts (rollout/openai_api.h).
//
// Reasoning (ServingOptions::reasoning_parser, `flywheel worker --reasoning-parser`):
//   kQwen3       an answer that opens with "<think>" (after whitespace) reasons until
//                "</think>" (to its end if never closed); any other answer is content.
//   kDeepSeekR1  the chat template opened the thinking: the answer reasons from its start
//                (an opening "<think>" is dropped) until "</think>", or to its end.
//   Whitespace right after "</think>" is dropped.
// Tool calls (a request with tools): `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
//   blocks (the Hermes / Qwen form). A block whose JSON is an object with a string "name"
//   becomes a call; the whitespace just before and just after it is dropped. A block that
//   does not parse, or is never closed, stays in the content as it was written.
//
// Feed() may be given the text in any pieces: the concatenated outputs are the same as for
// the whole text at once (text that could still turn out to start a tag is held back until
// it cannot, or until the end). A call's arguments come whole, in the feed that closes it.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace flywheel::tokenizer {

enum class ReasoningParser { kNone, kQwen3, kDeepSeekR1 };

// "" or "none", "qwen3", "deepseek_r1" (also "deepseek-r1"); the error names the choices.
Result<ReasoningParser> ParseReasoningParser(std::string_view name);

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // JSON text (an arguments object is serialized)
};

struct AnswerParts {
  std::string reasoning, content;
  std::vector<ParsedToolCall> calls;
};

class AnswerSplitter {
 public:
  AnswerSplitter(ReasoningParser reasoning, bool tools);
  // `more` is the text appended to the answer; `end`: the answer is complete. Returns the
  // parts that became final.
  AnswerParts Feed(std::string_view more, bool end);
  // Whether this splitter does anything (else Feed returns the text as content).
  bool active() const { return reasoning_ != ReasoningParser::kNone || tools_; }

 private:
  enum class State { kStart, kReasoning, kContent, kToolCall };
  // One decision on pending_; false when it must wait for more text.
  bool Advance(AnswerParts& out, bool end);
  bool AdvanceContent(AnswerParts& out, bool end);
  bool AdvanceToolCall(AnswerParts& out, bool end);

  ReasoningParser reasoning_;
  bool tools_;
  State state_;
  std::string pending_;       // text not yet decided
  bool drop_whitespace_ = false;  // leading whitespace of the content is dropped
  std::string held_space_;    // whitespace just before an open tool-call block
};

// `text` as an OpenAI chat assistant message: `<tool_call>` blocks that parse become
// `tool_calls` (type "function", ids `id_prefix` + "_" + index, arguments as JSON text), the
// rest `content` (null when there are calls and no other text). What environments and
// graders are given for a model's turn (pipeline/coordinator.h).
nlohmann::json AssistantMessage(std::string_view text, const std::string& id_prefix);

}  // namespace flywheel::tokenizer
