// The external graders' wire format (docs/GRADERS.md "The protocol"), shared by the process
// and HTTP graders. Private to grading/.
//
//   request:  {"id": str, "messages": [...], "completion": str, "fields": {...}}
//   answer:   {"id": str, "reward": finite number[, "metrics": {name: number}]}
//         or  {"id": str, "messages": [{"role", "content", ...}, ...]}   (an environment)
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "grading/grader.h"

namespace flywheel::grading::protocol {

// The request object; invalid UTF-8 in the completion is replaced (U+FFFD), never thrown on.
nlohmann::json RequestJson(const Sample& sample);
// RequestJson() dumped compactly, without the newline.
std::string RequestText(const Sample& sample);

// One parsed answer.
struct Answer {
  std::string id;   // empty: none could be found (a line that names no request)
  Outcome outcome;  // kReward, kContinue, or kUngraded (a bad answer: reason says why)
};

// Parses one answer line. A line that is not JSON is a bad answer for the id that can still
// be read from it ({"id": "7", "reward": NaN} is Python's json.dumps of a NaN), else one
// with an empty id. A number id is taken as its decimal text.
Answer ParseAnswer(std::string_view line);
// The same for a parsed value (an element of an HTTP batch answer).
Answer AnswerFromJson(const nlohmann::json& answer);

}  // namespace flywheel::grading::protocol
