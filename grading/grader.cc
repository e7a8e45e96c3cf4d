// Outcomes, the config parser, and RunAsync (a synchronous grader on a thread pool).
#include "grading/grader.h"

#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "base/json.h"
#include "grading/internal.h"

namespace flywheel::grading {

using nlohmann::json;

const char* OutcomeKindName(OutcomeKind kind) {
  switch (kind) {
    case OutcomeKind::kReward:
      return "reward";
    case OutcomeKind::kContinue:
      return "continue";
    case OutcomeKind::kUngraded:
      return "ungraded";
    case OutcomeKind::kFailed:
      return "failed";
  }
  return "unknown";
}

Outcome Outcome::Reward(double reward, std::map<std::string, double> metrics) {
  Outcome outcome;
  outcome.kind = OutcomeKind::kReward;
  outcome.reward = reward;
  outcome.metrics = std::move(metrics);
  return outcome;
}

Outcome Outcome::Ungraded(std::string reason) {
  Outcome outcome;
  outcome.kind = OutcomeKind::kUngraded;
  outcome.reason = std::move(reason);
  return outcome;
}

std::future<Outcome> AsyncGrader::Submit(Sample sample) {
  auto promise = std::make_shared<std::promise<Outcome>>();
  std::future<Outcome> future = promise->get_future();
  Submit(std::move(sample), [promise](Outcome outcome) { promise->set_value(std::move(outcome)); });
  return future;
}

void CountOutcome(GraderCounters& counters, const Outcome& outcome) {
  switch (outcome.kind) {
    case OutcomeKind::kReward:
      ++counters.rewarded;
      break;
    case OutcomeKind::kContinue:
      ++counters.continued;
      break;
    case OutcomeKind::kUngraded:
      ++counters.ungraded;
      break;
    case OutcomeKind::kFailed:
      ++counters.failed;
      break;
  }
}

// ---- the config ----

Result<std::vector<GraderSpec>> GraderSpecsFromJson(const json& config) {
  const json* list = &config;
  if (config.is_object() && config.contains("graders")) list = &config["graders"];
  if (list->is_object()) {
    return GraderSpecsFromJson(json::array({*list}));
  }
  if (!list->is_array()) return Status::InvalidArgument("grader config: not a list of graders");
  std::vector<GraderSpec> specs;
  for (size_t i = 0; i < list->size(); ++i) {
    const json& entry = (*list)[i];
    const std::string where = "grader config entry " + std::to_string(i + 1);
    if (!entry.is_object()) return Status::InvalidArgument(where + ": not an object");
    GraderSpec spec;
    for (const auto& [key, value] : entry.items()) {
      if (key == "type" || key == "name") {
        if (!value.is_string())
          return Status::InvalidArgument(where + ": '" + key + "' is not a string");
        (key == "type" ? spec.type : spec.name) = value.get<std::string>();
      } else if (key == "weight") {
        if (!value.is_number())
          return Status::InvalidArgument(where + ": 'weight' is not a number");
        spec.weight = value.get<double>();
      } else if (key == "params") {
        if (!value.is_object())
          return Status::InvalidArgument(where + ": 'params' is not an object");
        for (const auto& [param, param_value] : value.items()) {
          if (spec.params.contains(param))
            return Status::InvalidArgument(where + ": parameter '" + param + "' given twice");
          spec.params[param] = param_value;
        }
      } else {
        if (spec.params.contains(key))
          return Status::InvalidArgument(where + ": parameter '" + key + "' given twice");
        spec.params[key] = value;
      }
    }
    if (spec.type.empty()) return Status::InvalidArgument(where + ": no 'type'");
    specs.push_back(std::move(spec));
  }
  return specs;
}

namespace {

std::string_view Trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front())))
    text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())))
    text.remove_suffix(1);
  return text;
}

// A TOML-like value: JSON, or a 'literal string'.
Result<json> TomlValue(std::string_view text, const std::string& where) {
  if (text.size() >= 2 && text.front() == '\'' && text.back() == '\'') {
    return json(std::string(text.substr(1, text.size() - 2)));
  }
  auto value = ParseJson(text, where);
  if (!value.ok())
    return Status::InvalidArgument(where + ": value is not a string, number, boolean or array");
  return value;
}

// `[[grader]]` tables of `key = value` lines; lines before the first header form one table.
Result<json> TomlLikeToJson(std::string_view text) {
  json tables = json::array();
  size_t line_number = 0;
  while (!text.empty()) {
    const size_t newline = text.find('\n');
    std::string_view line = Trim(text.substr(0, newline));
    text = newline == std::string_view::npos ? std::string_view() : text.substr(newline + 1);
    ++line_number;
    const std::string where = "grader config line " + std::to_string(line_number);
    if (line.empty() || line.front() == '#') continue;
    if (line == "[[grader]]" || line == "[[graders]]") {
      tables.push_back(json::object());
      continue;
    }
    const size_t equals = line.find('=');
    if (equals == std::string_view::npos || line.front() == '[') {
      return Status::InvalidArgument(where + ": expected [[grader]] or key = value, got '" +
                                     std::string(line) + "'");
    }
    const std::string key(Trim(line.substr(0, equals)));
    if (key.empty()) return Status::InvalidArgument(where + ": empty key");
    FW_ASSIGN_OR_RETURN(json value, TomlValue(Trim(line.substr(equals + 1)), where));
    if (tables.empty()) tables.push_back(json::object());
    if (tables.back().contains(key))
      return Status::InvalidArgument(where + ": '" + key + "' given twice");
    tables.back()[key] = std::move(value);
  }
  if (tables.empty()) return Status::InvalidArgument("grader config: empty");
  return tables;
}

}  // namespace

Result<std::vector<GraderSpec>> ParseGraderConfig(std::string_view text) {
  const std::string_view trimmed = Trim(text);
  const bool looks_toml = trimmed.rfind("[[", 0) == 0 ||
                          (!trimmed.empty() && trimmed.front() != '[' && trimmed.front() != '{');
  if (!looks_toml) {
    FW_ASSIGN_OR_RETURN(json config, ParseJson(trimmed, "grader config"));
    return GraderSpecsFromJson(config);
  }
  FW_ASSIGN_OR_RETURN(json config, TomlLikeToJson(text));
  return GraderSpecsFromJson(config);
}

// ---- RunAsync ----

namespace {

class PooledGrader final : public AsyncGrader {
 public:
  PooledGrader(std::shared_ptr<const Grader> grader, std::string name, size_t threads)
      : grader_(std::move(grader)), name_(std::move(name)) {
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
  }
  ~PooledGrader() override {
    std::deque<std::pair<Sample, OutcomeCallback>> left;
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      left.swap(queue_);
    }
    wake_.notify_all();
    for (std::thread& thread : threads_) thread.join();
    for (auto& [sample, done] : left) done(Outcome::Ungraded("grader stopped"));
  }

  using AsyncGrader::Submit;
  void Submit(Sample sample, OutcomeCallback done) override {
    {
      std::lock_guard lock(mu_);
      ++counters_.submitted;
      queue_.emplace_back(std::move(sample), std::move(done));
    }
    wake_.notify_one();
  }
  Status status() const override { return Status::Ok(); }
  GraderCounters counters() const override {
    std::lock_guard lock(mu_);
    return counters_;
  }
  std::string name() const override { return name_; }

 private:
  void Work() {
    std::unique_lock lock(mu_);
    while (true) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      auto [sample, done] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      Outcome outcome = grader_->Grade(sample);
      lock.lock();
      CountOutcome(counters_, outcome);
      lock.unlock();
      done(std::move(outcome));
      lock.lock();
    }
  }

  const std::shared_ptr<const Grader> grader_;
  const std::string name_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::pair<Sample, OutcomeCallback>> queue_;  // GUARDED_BY(mu_)
  GraderCounters counters_;                               // GUARDED_BY(mu_)
  bool stopping_ = false;                                 // GUARDED_BY(mu_)
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<AsyncGrader> RunAsync(std::shared_ptr<const Grader> grader, std::string name,
                                      size_t threads) {
  return std::make_unique<PooledGrader>(std::move(grader), std::move(name),
                                        std::max<size_t>(threads, 1));
}

Result<std::unique_ptr<AsyncGrader>> StartGrader(const GraderSettings& settings) {
  const int given = !settings.command.empty() + !settings.url.empty() + !settings.builtin.empty();
  if (given != 1) {
    return Status::InvalidArgument(std::string(given == 0 ? "no grader" : "more than one grader") +
                                   ": give one of --grader, --grader-url and built-in graders");
  }
  if (!settings.command.empty()) return StartProcessGrader(settings.command, settings.options);
  if (!settings.url.empty()) return StartHttpGrader(settings.url, settings.options);
  FW_ASSIGN_OR_RETURN(std::shared_ptr<const Grader> grader, LoadBuiltinGraders(settings.builtin));
  std::string name = "builtin:";
  for (const GraderSpec& spec : settings.builtin) name += " " + spec.type;
  return RunAsync(std::move(grader), std::move(name), settings.builtin_threads);
}

}  // namespace flywheel::grading
