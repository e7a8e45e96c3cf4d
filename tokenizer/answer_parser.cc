#include "tokenizer/answer_parser.h"

#include <nlohmann/json.hpp>

#include "base/json.h"

namespace flywheel::tokenizer {

namespace {

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>", kCallClose = "</tool_call>";

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

// The length of the longest suffix of `text` that is a proper prefix of `tag`.
size_t PartialTag(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

// The call in a block's text, or false when it is not one. The project's bounded parser
// (a model can write brackets nested without end), keys kept in the model's order.
bool ParseCall(std::string_view block, ParsedToolCall& call) {
  using Json = nlohmann::ordered_json;
  Result<Json> result = ParseJson<Json>(block, "a tool call");
  if (!result.ok()) return false;
  const Json& parsed = *result;
  if (!parsed.is_object() || !parsed.contains("name") || !parsed["name"].is_string()) return false;
  call.name = parsed["name"].get<std::string>();
  const Json args = parsed.value("arguments", Json::object());
  call.arguments = args.is_string() ? args.get<std::string>() : args.dump();
  return true;
}

}  // namespace

Result<ReasoningParser> ParseReasoningParser(std::string_view name) {
  if (name.empty() || name == "none") return ReasoningParser::kNone;
  if (name == "qwen3") return ReasoningParser::kQwen3;
  if (name == "deepseek_r1" || name == "deepseek-r1") return ReasoningParser::kDeepSeekR1;
  return Status::InvalidArgument("unknown reasoning parser '" + std::string(name) +
                                 "' (choices: none, qwen3, deepseek_r1)");
}

AnswerSplitter::AnswerSplitter(ReasoningParser reasoning, bool tools)
    : reasoning_(reasoning),
      tools_(tools),
      state_(reasoning == ReasoningParser::kNone ? State::kContent : State::kStart) {}

AnswerParts AnswerSplitter::Feed(std::string_view more, bool end) {
  pending_.append(more);
  AnswerParts out;
  while (!pending_.empty() && Advance(out, end)) {
  }
  if (end && state_ == State::kToolCall) {  // a block never closed: written as it was
    out.content += held_space_ + std::string(kCallOpen) + pending_;
    held_space_.clear();
    pending_.clear();
  }
  return out;
}

bool AnswerSplitter::Advance(AnswerParts& out, bool end) {
  switch (state_) {
    case State::kStart: {
      size_t at = 0;
      if (reasoning_ == ReasoningParser::kQwen3) {
        while (at < pending_.size() && IsSpace(pending_[at])) ++at;
      }
      const std::string_view rest = std::string_view(pending_).substr(at);
      if (rest.size() < kThinkOpen.size() && kThinkOpen.substr(0, rest.size()) == rest && !end) {
        return false;  // could still open the thinking
      }
      if (rest.substr(0, kThinkOpen.size()) == kThinkOpen) {
        pending_.erase(0, at + kThinkOpen.size());
        state_ = State::kReasoning;
      } else {
        state_ = reasoning_ == ReasoningParser::kDeepSeekR1 ? State::kReasoning : State::kContent;
      }
      return true;
    }
    case State::kReasoning: {
      const size_t close = pending_.find(kThinkClose);
      if (close != std::string::npos) {
        out.reasoning += pending_.substr(0, close);
        pending_.erase(0, close + kThinkClose.size());
        state_ = State::kContent;
        drop_whitespace_ = true;
        return true;
      }
      const size_t keep = end ? 0 : PartialTag(pending_, kThinkClose);
      out.reasoning += pending_.substr(0, pending_.size() - keep);
      pending_.erase(0, pending_.size() - keep);
      return false;
    }
    case State::kContent:
      return AdvanceContent(out, end);
    case State::kToolCall:
      return AdvanceToolCall(out, end);
  }
  return false;
}

bool AnswerSplitter::AdvanceContent(AnswerParts& out, bool end) {
  if (drop_whitespace_) {
    size_t at = 0;
    while (at < pending_.size() && IsSpace(pending_[at])) ++at;
    pending_.erase(0, at);
    if (pending_.empty()) return false;
    drop_whitespace_ = false;
  }
  if (!tools_) {
    out.content += pending_;
    pending_.clear();
    return false;
  }
  const size_t open = pending_.find(kCallOpen);
  size_t decided = open != std::string::npos ? open
                   : end                     ? pending_.size()
                                             : pending_.size() - PartialTag(pending_, kCallOpen);
  // Whitespace before a block that may open is held: it goes if the block is a call.
  size_t text_end = decided;
  if (open != std::string::npos || !end) {
    while (text_end > 0 && IsSpace(pending_[text_end - 1])) --text_end;
  }
  out.content += pending_.substr(0, text_end);
  if (open == std::string::npos) {
    pending_.erase(0, text_end);
    return false;
  }
  held_space_ = pending_.substr(text_end, open - text_end);
  pending_.erase(0, open + kCallOpen.size());
  state_ = State::kToolCall;
  return true;
}

bool AnswerSplitter::AdvanceToolCall(AnswerParts& out, bool end) {
  const size_t close = pending_.find(kCallClose);
  if (close == std::string::npos) {
    if (!end) return false;
    // Never closed: the block as it was written.
    out.content += held_space_ + std::string(kCallOpen) + pending_;
    held_space_.clear();
    pending_.clear();
    state_ = State::kContent;
    return false;
  }
  ParsedToolCall call;
  if (ParseCall(std::string_view(pending_).substr(0, close), call)) {
    out.calls.push_back(std::move(call));
    drop_whitespace_ = true;
  } else {
    out.content += held_space_ + std::string(kCallOpen) + pending_.substr(0, close + kCallClose.size());
  }
  held_space_.clear();
  pending_.erase(0, close + kCallClose.size());
  state_ = State::kContent;
  return true;
}

nlohmann::json AssistantMessage(std::string_view text, const std::string& id_prefix) {
  const AnswerParts parts = AnswerSplitter(ReasoningParser::kNone, /*tools=*/true).Feed(text, true);
  if (parts.calls.empty()) return {{"role", "assistant"}, {"content", std::string(text)}};
  nlohmann::json calls = nlohmann::json::array();
  for (size_t i = 0; i < parts.calls.size(); ++i) {
    calls.push_back({{"id", id_prefix + "_" + std::to_string(i)},
                     {"type", "function"},
                     {"function", {{"name", parts.calls[i].name}, {"arguments", parts.calls[i].arguments}}}});
  }
  return {{"role", "assistant"},
          {"content", parts.content.empty() ? nlohmann::json(nullptr) : nlohmann::json(parts.content)},
          {"tool_calls", std::move(calls)}};
}

}  // namespace flywheel::tokenizer
