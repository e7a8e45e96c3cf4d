// The built-in graders and their configuration (grading/grader.h, docs/GRADERS.md).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <regex>
#include <set>
#include <variant>
#include <vector>

#include "base/json.h"
#include "grading/grader.h"

namespace flywheel::grading {
namespace {

using nlohmann::json;

std::string Strip(std::string_view text) {
  size_t begin = 0;
  size_t end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  return std::string(text.substr(begin, end - begin));
}

std::string Lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

// A field's value as text: strings as they are, numbers and booleans as JSON writes them.
std::optional<std::string> ScalarText(const json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_number() || value.is_boolean()) return value.dump();
  return std::nullopt;
}

// The acceptable texts of a field: a scalar, or an array of scalars (any of them counts).
// nullopt when the sample has no such field or it holds something else.
std::optional<std::vector<std::string>> FieldTexts(const Sample& sample, const std::string& field) {
  if (!sample.fields.is_object()) return std::nullopt;
  auto found = sample.fields.find(field);
  if (found == sample.fields.end()) return std::nullopt;
  std::vector<std::string> texts;
  if (found->is_array()) {
    for (const json& element : *found) {
      auto text = ScalarText(element);
      if (!text) return std::nullopt;
      texts.push_back(*text);
    }
    if (texts.empty()) return std::nullopt;
    return texts;
  }
  auto text = ScalarText(*found);
  if (!text) return std::nullopt;
  texts.push_back(*text);
  return texts;
}

Outcome MissingField(const std::string& field) {
  return Outcome::Ungraded("fields has no usable \"" + field + "\" (a string, number or list)");
}

// Reads the parameters of one spec, each at most once; Finish() refuses the unread ones.
class Params {
 public:
  Params(const json& params, std::string where) : params_(params), where_(std::move(where)) {}

  Result<std::string> String(const std::string& key, std::optional<std::string> fallback) {
    const json* value = Take(key);
    if (value == nullptr) return Missing(key, fallback);
    if (!value->is_string()) return Wrong(key, "a string");
    return value->get<std::string>();
  }
  Result<double> Number(const std::string& key, std::optional<double> fallback) {
    const json* value = Take(key);
    if (value == nullptr) return Missing(key, fallback);
    if (!value->is_number() || !std::isfinite(value->get<double>())) {
      return Wrong(key, "a finite number");
    }
    return value->get<double>();
  }
  Result<bool> Bool(const std::string& key, bool fallback) {
    const json* value = Take(key);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) return Wrong(key, "true or false");
    return value->get<bool>();
  }
  bool Has(const std::string& key) const { return params_.contains(key); }
  Status Finish() const {
    for (const auto& [key, value] : params_.items()) {
      if (!read_.count(key))
        return Status::InvalidArgument(where_ + ": unknown parameter '" + key + "'");
    }
    return Status::Ok();
  }
  Status Error(const std::string& message) const {
    return Status::InvalidArgument(where_ + ": " + message);
  }

 private:
  const json* Take(const std::string& key) {
    read_.insert(key);
    auto found = params_.find(key);
    return found == params_.end() ? nullptr : &*found;
  }
  template <typename T>
  Result<T> Missing(const std::string& key, const std::optional<T>& fallback) const {
    if (fallback) return *fallback;
    return Status::InvalidArgument(where_ + ": missing parameter '" + key + "'");
  }
  Status Wrong(const std::string& key, const char* expected) const {
    return Status::InvalidArgument(where_ + ": parameter '" + key + "' must be " + expected);
  }

  const json& params_;
  std::string where_;
  std::set<std::string> read_;
};

// ---- exact_match ----
class ExactMatch final : public Grader {
 public:
  static Result<std::unique_ptr<Grader>> Make(Params& params) {
    auto grader = std::make_unique<ExactMatch>();
    FW_ASSIGN_OR_RETURN(grader->field_, params.String("field", "answer"));
    FW_ASSIGN_OR_RETURN(grader->strip_, params.Bool("strip", true));
    FW_ASSIGN_OR_RETURN(grader->case_sensitive_, params.Bool("case_sensitive", true));
    return std::unique_ptr<Grader>(std::move(grader));
  }
  Outcome Grade(const Sample& sample) const override {
    auto expected = FieldTexts(sample, field_);
    if (!expected) return MissingField(field_);
    const std::string answer = Normal(sample.completion);
    for (const std::string& text : *expected) {
      if (Normal(text) == answer) return Outcome::Reward(1.0);
    }
    return Outcome::Reward(0.0);
  }

 private:
  std::string Normal(std::string_view text) const {
    std::string normal = strip_ ? Strip(text) : std::string(text);
    return case_sensitive_ ? normal : Lower(std::move(normal));
  }
  std::string field_;
  bool strip_ = true;
  bool case_sensitive_ = true;
};

// ---- regex ----
// std::regex matches recursively, a stack frame per character or so: the pattern is
// searched in the completion's last `window` characters only.
class Regex final : public Grader {
 public:
  static Result<std::unique_ptr<Grader>> Make(Params& params) {
    auto grader = std::make_unique<Regex>();
    FW_ASSIGN_OR_RETURN(std::string pattern, params.String("pattern", std::nullopt));
    FW_ASSIGN_OR_RETURN(bool ignore_case, params.Bool("ignore_case", false));
    try {
      auto flags =
          std::regex::ECMAScript | (ignore_case ? std::regex::icase : std::regex::ECMAScript);
      grader->regex_ = std::regex(pattern, flags);
    } catch (const std::regex_error& error) {
      return params.Error("bad regex '" + pattern + "': " + error.what());
    }
    const double groups = static_cast<double>(grader->regex_.mark_count());
    FW_ASSIGN_OR_RETURN(double group, params.Number("group", groups >= 1 ? 1.0 : 0.0));
    if (group < 0 || group > groups || group != std::floor(group)) {
      return params.Error("group " + json(group).dump() + " is not a capture group of '" + pattern +
                          "' (it has " + std::to_string(grader->regex_.mark_count()) + ")");
    }
    grader->group_ = static_cast<size_t>(group);
    if (params.Has("field")) {
      FW_ASSIGN_OR_RETURN(grader->field_, params.String("field", std::nullopt));
    }
    FW_ASSIGN_OR_RETURN(std::string match, params.String("match", "last"));
    if (match != "last" && match != "first")
      return params.Error("match must be \"first\" or \"last\"");
    grader->last_ = match == "last";
    FW_ASSIGN_OR_RETURN(double window, params.Number("window", 4096));
    if (window < 1 || window > 65536) return params.Error("window must be in 1..65536");
    grader->window_ = static_cast<size_t>(window);
    return std::unique_ptr<Grader>(std::move(grader));
  }
  Outcome Grade(const Sample& sample) const override {
    std::optional<std::vector<std::string>> expected;
    if (!field_.empty() && !(expected = FieldTexts(sample, field_))) return MissingField(field_);
    const std::string& text = sample.completion;
    const size_t start = text.size() > window_ ? text.size() - window_ : 0;
    std::optional<std::string> captured;
    for (auto it = std::sregex_iterator(text.begin() + start, text.end(), regex_);
         it != std::sregex_iterator(); ++it) {
      captured = (*it)[group_].str();
      if (!last_) break;
    }
    if (!captured) return Outcome::Reward(0.0, {{"matched", 0.0}});
    if (!expected) return Outcome::Reward(1.0, {{"matched", 1.0}});
    for (const std::string& want : *expected) {
      if (Strip(want) == Strip(*captured)) return Outcome::Reward(1.0, {{"matched", 1.0}});
    }
    return Outcome::Reward(0.0, {{"matched", 1.0}});
  }

 private:
  std::regex regex_;
  size_t group_ = 0;
  std::string field_;
  bool last_ = true;
  size_t window_ = 4096;
};

// The span [begin, end) of the number starting at `at` (a digit, or '.' before one): digits
// with optional thousands commas, a fraction and an exponent; a '-' just before counts.
std::pair<size_t, size_t> NumberAt(std::string_view text, size_t at) {
  auto digit = [&](size_t i) {
    return i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]));
  };
  size_t begin = at > 0 && text[at - 1] == '-' ? at - 1 : at;
  size_t end = at;
  while (digit(end)) ++end;
  while (end > at && end < text.size() && text[end] == ',' && digit(end + 1) && digit(end + 2) &&
         digit(end + 3) && !digit(end + 4)) {
    end += 4;
  }
  if (end < text.size() && text[end] == '.' && digit(end + 1)) {
    ++end;
    while (digit(end)) ++end;
  }
  if (end < text.size() && (text[end] == 'e' || text[end] == 'E')) {
    size_t exponent = end + 1;
    if (exponent < text.size() && (text[exponent] == '+' || text[exponent] == '-')) ++exponent;
    if (digit(exponent)) {
      end = exponent;
      while (digit(end)) ++end;
    }
  }
  return {begin, end};
}

std::optional<double> ToNumber(std::string_view span) {
  std::string cleaned;
  for (char c : span) {
    if (c != ',') cleaned.push_back(c);
  }
  if (cleaned.empty()) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(cleaned.c_str(), &end);
  if (end != cleaned.c_str() + cleaned.size() || !std::isfinite(value)) return std::nullopt;
  return value;
}

// The last number written in `text` ("x = -1,234.5e2." -> -123450); nullopt when none.
std::optional<double> LastNumber(std::string_view text) {
  std::optional<double> last;
  size_t i = 0;
  while (i < text.size()) {
    const bool starts = std::isdigit(static_cast<unsigned char>(text[i])) ||
                        (text[i] == '.' && i + 1 < text.size() &&
                         std::isdigit(static_cast<unsigned char>(text[i + 1])));
    if (!starts) {
      ++i;
      continue;
    }
    auto [begin, end] = NumberAt(text, i);
    if (auto value = ToNumber(text.substr(begin, end - begin))) last = value;
    i = end;
  }
  return last;
}

// ---- numeric ----
class Numeric final : public Grader {
 public:
  static Result<std::unique_ptr<Grader>> Make(Params& params) {
    auto grader = std::make_unique<Numeric>();
    FW_ASSIGN_OR_RETURN(grader->field_, params.String("field", "answer"));
    FW_ASSIGN_OR_RETURN(grader->rel_tol_, params.Number("rel_tol", 1e-6));
    FW_ASSIGN_OR_RETURN(grader->abs_tol_, params.Number("abs_tol", 1e-9));
    if (grader->rel_tol_ < 0 || grader->abs_tol_ < 0)
      return params.Error("tolerances must be >= 0");
    return std::unique_ptr<Grader>(std::move(grader));
  }
  Outcome Grade(const Sample& sample) const override {
    auto expected_texts = FieldTexts(sample, field_);
    if (!expected_texts) return MissingField(field_);
    std::vector<double> expected;
    for (const std::string& text : *expected_texts) {
      auto value = ToNumber(Strip(text));
      if (!value) return Outcome::Ungraded("fields \"" + field_ + "\" is not a number: " + text);
      expected.push_back(*value);
    }
    auto answer = LastNumber(sample.completion);
    if (!answer) return Outcome::Reward(0.0, {{"no_number", 1.0}});
    for (double want : expected) {
      const double error = std::fabs(*answer - want);
      if (error <= abs_tol_ || error <= rel_tol_ * std::fabs(want)) {
        return Outcome::Reward(1.0, {{"no_number", 0.0}});
      }
    }
    return Outcome::Reward(0.0, {{"no_number", 0.0}});
  }

 private:
  std::string field_;
  double rel_tol_ = 1e-6;
  double abs_tol_ = 1e-9;
};

// ---- contains ----
class Contains final : public Grader {
 public:
  static Result<std::unique_ptr<Grader>> Make(Params& params) {
    auto grader = std::make_unique<Contains>();
    if (params.Has("value") == params.Has("field")) {
      return params.Error("give exactly one of 'value' (a literal) and 'field'");
    }
    if (params.Has("value")) {
      FW_ASSIGN_OR_RETURN(grader->value_, params.String("value", std::nullopt));
    } else {
      FW_ASSIGN_OR_RETURN(grader->field_, params.String("field", std::nullopt));
    }
    FW_ASSIGN_OR_RETURN(grader->case_sensitive_, params.Bool("case_sensitive", true));
    FW_ASSIGN_OR_RETURN(std::string mode, params.String("mode", "any"));
    if (mode != "any" && mode != "all") return params.Error("mode must be \"any\" or \"all\"");
    grader->all_ = mode == "all";
    return std::unique_ptr<Grader>(std::move(grader));
  }
  Outcome Grade(const Sample& sample) const override {
    std::vector<std::string> needles{value_};
    if (!field_.empty()) {
      auto texts = FieldTexts(sample, field_);
      if (!texts) return MissingField(field_);
      needles = std::move(*texts);
    }
    const std::string haystack = case_sensitive_ ? sample.completion : Lower(sample.completion);
    size_t found = 0;
    for (const std::string& needle : needles) {
      found += haystack.find(case_sensitive_ ? needle : Lower(needle)) != std::string::npos;
    }
    const bool pass = all_ ? found == needles.size() : found > 0;
    return Outcome::Reward(pass ? 1.0 : 0.0);
  }

 private:
  std::string value_;
  std::string field_;
  bool case_sensitive_ = true;
  bool all_ = false;
};

// A path into a JSON value: "a.b[0].c" or a JSON pointer "/a/b/0/c".
struct JsonPath {
  std::string text;
  std::vector<std::variant<std::string, size_t>> steps;

  static Result<JsonPath> Parse(const std::string& text);
  const json* Find(const json& root) const;
};

Result<JsonPath> JsonPath::Parse(const std::string& text) {
  JsonPath path{text, {}};
  if (text.empty()) return Status::InvalidArgument("path is empty");
  if (text.front() == '/') {
    try {
      (void)json::json_pointer(text);
    } catch (const json::exception& error) {
      return Status::InvalidArgument("path '" + text + "' is not a JSON pointer: " + error.what());
    }
    return path;  // nlohmann resolves a pointer (steps stay empty)
  }
  size_t at = 0;
  while (at < text.size()) {
    if (text[at] == '[') {
      const size_t close = text.find(']', at);
      const std::string index =
          close == std::string::npos ? "" : text.substr(at + 1, close - at - 1);
      if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) {
        return Status::InvalidArgument("path '" + text + "': bad index at character " +
                                       std::to_string(at));
      }
      path.steps.emplace_back(static_cast<size_t>(std::stoull(index)));
      at = close + 1;
      if (at < text.size() && text[at] == '.') ++at;
      continue;
    }
    const size_t end = text.find_first_of(".[", at);
    const std::string key =
        text.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (key.empty())
      return Status::InvalidArgument("path '" + text + "': empty key at character " +
                                     std::to_string(at));
    path.steps.emplace_back(key);
    at = end == std::string::npos ? text.size() : end + (text[end] == '.' ? 1 : 0);
  }
  return path;
}

const json* JsonPath::Find(const json& root) const {
  if (!text.empty() && text.front() == '/') {
    const json::json_pointer pointer(text);
    return root.contains(pointer) ? &root.at(pointer) : nullptr;
  }
  const json* at = &root;
  for (const auto& step : steps) {
    if (const auto* key = std::get_if<std::string>(&step)) {
      if (!at->is_object() || !at->contains(*key)) return nullptr;
      at = &(*at)[*key];
    } else {
      const size_t index = std::get<size_t>(step);
      if (!at->is_array() || index >= at->size()) return nullptr;
      at = &(*at)[index];
    }
  }
  return at;
}

// The completion as JSON, or the last JSON object in it (a fenced block, a trailing
// object after prose); nullopt when none parses. Tries at most 32 '{' from the right.
std::optional<json> CompletionJson(std::string_view completion) {
  const std::string whole = Strip(completion);
  auto parsed = ParseJson(whole, "completion");
  if (parsed.ok()) return std::move(parsed).value();
  const size_t last_close = whole.rfind('}');
  if (last_close == std::string::npos) return std::nullopt;
  size_t open = last_close;
  for (int tries = 0; tries < 32; ++tries) {
    open = whole.rfind('{', open == 0 ? std::string::npos : open - 1);
    if (open == std::string::npos || open > last_close) return std::nullopt;
    auto candidate =
        ParseJson(std::string_view(whole).substr(open, last_close - open + 1), "completion");
    if (candidate.ok()) return std::move(candidate).value();
    if (open == 0) return std::nullopt;
  }
  return std::nullopt;
}

// ---- json_field ----
class JsonField final : public Grader {
 public:
  static Result<std::unique_ptr<Grader>> Make(Params& params) {
    auto grader = std::make_unique<JsonField>();
    FW_ASSIGN_OR_RETURN(std::string path, params.String("path", std::nullopt));
    auto parsed = JsonPath::Parse(path);
    if (!parsed.ok()) return params.Error(parsed.status().message());
    grader->path_ = std::move(parsed).value();
    FW_ASSIGN_OR_RETURN(grader->field_, params.String("field", "answer"));
    FW_ASSIGN_OR_RETURN(grader->tolerance_, params.Number("abs_tol", 1e-9));
    return std::unique_ptr<Grader>(std::move(grader));
  }
  Outcome Grade(const Sample& sample) const override {
    if (!sample.fields.is_object() || !sample.fields.contains(field_)) return MissingField(field_);
    const json& expected = sample.fields[field_];
    auto document = CompletionJson(sample.completion);
    if (!document) return Outcome::Reward(0.0, {{"not_json", 1.0}, {"missing_path", 0.0}});
    const json* value = path_.Find(*document);
    if (value == nullptr) return Outcome::Reward(0.0, {{"not_json", 0.0}, {"missing_path", 1.0}});
    return Outcome::Reward(Equal(*value, expected) ? 1.0 : 0.0,
                           {{"not_json", 0.0}, {"missing_path", 0.0}});
  }

 private:
  // Numbers within the tolerance (a number written as a string counts), strings after
  // stripping, anything else by JSON equality.
  bool Equal(const json& value, const json& expected) const {
    auto number = [](const json& v) -> std::optional<double> {
      if (v.is_number()) return v.get<double>();
      if (v.is_string()) return ToNumber(Strip(v.get<std::string>()));
      return std::nullopt;
    };
    if (value.is_number() || expected.is_number()) {
      auto a = number(value);
      auto b = number(expected);
      return a && b && std::fabs(*a - *b) <= tolerance_;
    }
    if (value.is_string() && expected.is_string()) {
      return Strip(value.get<std::string>()) == Strip(expected.get<std::string>());
    }
    return value == expected;
  }
  JsonPath path_;
  std::string field_;
  double tolerance_ = 1e-9;
};

// ---- length_penalty ----
class LengthPenalty final : public Grader {
 public:
  static Result<std::unique_ptr<Grader>> Make(Params& params) {
    auto grader = std::make_unique<LengthPenalty>();
    FW_ASSIGN_OR_RETURN(grader->budget_, params.Number("budget", std::nullopt));
    if (grader->budget_ < 0) return params.Error("budget must be >= 0");
    FW_ASSIGN_OR_RETURN(std::string unit, params.String("unit", "tokens"));
    if (unit != "tokens" && unit != "chars")
      return params.Error("unit must be \"tokens\" or \"chars\"");
    grader->chars_ = unit == "chars";
    FW_ASSIGN_OR_RETURN(grader->per_unit_,
                        params.Number("per_unit", 1.0 / std::max(grader->budget_, 1.0)));
    FW_ASSIGN_OR_RETURN(grader->max_penalty_, params.Number("max_penalty", 1.0));
    if (grader->per_unit_ < 0 || grader->max_penalty_ < 0)
      return params.Error("per_unit and max_penalty must be >= 0");
    return std::unique_ptr<Grader>(std::move(grader));
  }
  Outcome Grade(const Sample& sample) const override {
    const double length = static_cast<double>(chars_ ? sample.completion.size() : Tokens(sample));
    const double over = std::max(0.0, length - budget_);
    const double penalty = std::min(max_penalty_, over * per_unit_);
    return Outcome::Reward(-penalty, {{"length", length}, {"over", over}});
  }

 private:
  static size_t Tokens(const Sample& sample) {
    if (sample.completion_tokens >= 0) return static_cast<size_t>(sample.completion_tokens);
    size_t words = 0;
    bool in_word = false;
    for (char c : sample.completion) {
      const bool space = std::isspace(static_cast<unsigned char>(c));
      words += !space && !in_word;
      in_word = !space;
    }
    return words;
  }
  double budget_ = 0;
  bool chars_ = false;
  double per_unit_ = 1;
  double max_penalty_ = 1;
};

using Factory = Result<std::unique_ptr<Grader>> (*)(Params&);

const std::map<std::string, Factory>& Factories() {
  static const std::map<std::string, Factory> factories = {
      {"exact_match", &ExactMatch::Make}, {"regex", &Regex::Make},
      {"numeric", &Numeric::Make},        {"contains", &Contains::Make},
      {"json_field", &JsonField::Make},   {"length_penalty", &LengthPenalty::Make},
  };
  return factories;
}

// The weighted sum of named parts.
class Composite final : public Grader {
 public:
  struct Part {
    std::string name;
    double weight;
    std::unique_ptr<Grader> grader;
  };
  explicit Composite(std::vector<Part> parts) : parts_(std::move(parts)) {}

  Outcome Grade(const Sample& sample) const override {
    double reward = 0;
    std::map<std::string, double> metrics;
    for (const Part& part : parts_) {
      Outcome outcome = part.grader->Grade(sample);
      if (outcome.kind != OutcomeKind::kReward) {
        outcome.reason = part.name + ": " + outcome.reason;
        return outcome;
      }
      reward += part.weight * outcome.reward;
      metrics[part.name + ".reward"] = outcome.reward;
      for (const auto& [metric, value] : outcome.metrics) metrics[part.name + "." + metric] = value;
    }
    return Outcome::Reward(reward, std::move(metrics));
  }

 private:
  std::vector<Part> parts_;
};

}  // namespace

Result<std::shared_ptr<const Grader>> LoadBuiltinGraders(const std::vector<GraderSpec>& specs) {
  if (specs.empty()) return Status::InvalidArgument("grader config: no graders");
  std::vector<Composite::Part> parts;
  std::map<std::string, int> seen;
  for (size_t i = 0; i < specs.size(); ++i) {
    const GraderSpec& spec = specs[i];
    const std::string where = "grader " + std::to_string(i + 1) + " (" + spec.type + ")";
    auto factory = Factories().find(spec.type);
    if (factory == Factories().end()) {
      return Status::InvalidArgument(
          where + ": unknown type '" + spec.type +
          "' (exact_match, regex, numeric, contains, json_field, length_penalty)");
    }
    if (!std::isfinite(spec.weight))
      return Status::InvalidArgument(where + ": weight is not finite");
    if (!spec.params.is_object())
      return Status::InvalidArgument(where + ": params is not an object");
    Params params(spec.params, where);
    FW_ASSIGN_OR_RETURN(std::unique_ptr<Grader> grader, factory->second(params));
    FW_RETURN_IF_ERROR(params.Finish());
    std::string name = spec.name.empty() ? spec.type : spec.name;
    if (++seen[name] > 1) name += "#" + std::to_string(seen[name]);
    parts.push_back({std::move(name), spec.weight, std::move(grader)});
  }
  return std::shared_ptr<const Grader>(std::make_shared<Composite>(std::move(parts)));
}

}  // namespace flywheel::grading
