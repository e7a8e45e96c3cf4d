#include "grading/protocol.h"

#include <cmath>

#include "base/json.h"

namespace flywheel::grading::protocol {
namespace {

using nlohmann::json;

std::string IdText(const json& id) {
  if (id.is_string()) return id.get<std::string>();
  if (id.is_number_integer() || id.is_number_unsigned()) return id.dump();
  return "";
}

// The "id" of a line that is not JSON: the first `"id": "<text>"` or `"id": <digits>`.
std::string RecoverId(std::string_view line) {
  const size_t key = line.find("\"id\"");
  if (key == std::string_view::npos) return "";
  size_t at = line.find_first_not_of(" \t", key + 4);
  if (at == std::string_view::npos || line[at] != ':') return "";
  at = line.find_first_not_of(" \t", at + 1);
  if (at == std::string_view::npos) return "";
  if (line[at] == '"') {
    const size_t end = line.find('"', at + 1);
    if (end == std::string_view::npos) return "";
    std::string id(line.substr(at + 1, end - at - 1));
    return id.find('\\') == std::string::npos ? id : "";  // escapes: not recoverable
  }
  size_t end = at;
  while (end < line.size() && std::isdigit(static_cast<unsigned char>(line[end]))) ++end;
  return std::string(line.substr(at, end - at));
}

Outcome RewardOutcome(const json& answer) {
  const json& reward = answer["reward"];
  if (!reward.is_number()) {
    return Outcome::Ungraded("bad answer: \"reward\" is " + std::string(reward.type_name()) +
                             ", not a number");
  }
  const double value = reward.get<double>();
  if (!std::isfinite(value)) return Outcome::Ungraded("bad answer: \"reward\" is not finite");
  std::map<std::string, double> metrics;
  auto found = answer.find("metrics");
  if (found != answer.end() && found->is_object()) {
    for (const auto& [name, metric] : found->items()) {
      if (metric.is_number() && std::isfinite(metric.get<double>())) {
        metrics[name] = metric.get<double>();
      }
    }
  }
  return Outcome::Reward(value, std::move(metrics));
}

Outcome ContinueOutcome(const json& answer) {
  const json& messages = answer["messages"];
  if (!messages.is_array() || messages.empty()) {
    return Outcome::Ungraded("bad answer: \"messages\" is not a non-empty array");
  }
  for (const json& message : messages) {
    if (!message.is_object() || !message.contains("role") || !message["role"].is_string()) {
      return Outcome::Ungraded("bad answer: a message without a string \"role\"");
    }
  }
  Outcome outcome;
  outcome.kind = OutcomeKind::kContinue;
  outcome.messages = messages;
  return outcome;
}

}  // namespace

json RequestJson(const Sample& sample) {
  json request{{"id", sample.id},
               {"messages", sample.messages},
               {"completion", sample.completion},
               {"fields", sample.fields}};
  if (!sample.message.is_null()) request["message"] = sample.message;
  return request;
}

std::string RequestText(const Sample& sample) {
  return RequestJson(sample).dump(-1, ' ', false, json::error_handler_t::replace);
}

Answer AnswerFromJson(const json& answer) {
  Answer parsed;
  if (!answer.is_object()) {
    parsed.outcome = Outcome::Ungraded("bad answer: not a JSON object");
    return parsed;
  }
  auto id = answer.find("id");
  if (id != answer.end()) parsed.id = IdText(*id);
  if (answer.contains("reward")) {
    parsed.outcome = RewardOutcome(answer);
  } else if (answer.contains("messages")) {
    parsed.outcome = ContinueOutcome(answer);
  } else {
    parsed.outcome = Outcome::Ungraded("bad answer: neither \"reward\" nor \"messages\"");
  }
  return parsed;
}

Answer ParseAnswer(std::string_view line) {
  auto parsed = ParseJson(line, "answer", JsonLimits{.max_depth = 64, .max_bytes = 64u << 20});
  if (!parsed.ok()) {
    Answer answer;
    answer.id = RecoverId(line);
    answer.outcome = Outcome::Ungraded("bad answer: not JSON: " + std::string(line.substr(0, 120)));
    return answer;
  }
  return AnswerFromJson(*parsed);
}

}  // namespace flywheel::grading::protocol
