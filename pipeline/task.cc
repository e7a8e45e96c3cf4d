#include "pipeline/task.h"

#include <algorithm>
#include <set>

namespace flywheel::pipeline {
namespace {

std::string RandomDigits(std::mt19937_64& rng, int count) {
  std::uniform_int_distribution<int> digit(0, 9);
  std::string text;
  for (int i = 0; i < count; ++i) text.push_back(static_cast<char>('0' + digit(rng)));
  return text;
}

// A task whose prompt is a random digit string and '>', its answer the same number of
// characters, computed from the digits.
class DigitStringTask : public Task {
 public:
  using Task::Task;
  int max_answer_chars() const override { return config_.digits; }
  int max_prompt_chars() const override { return config_.digits + 1; }
  Problem Random(std::mt19937_64& rng) const override {
    std::string digits = RandomDigits(rng, config_.digits);
    std::string answer = Answer(digits);
    return {digits + ">", std::move(answer)};
  }

 protected:
  virtual std::string Answer(const std::string& digits) const = 0;
};

class SortTask final : public DigitStringTask {
 public:
  using DigitStringTask::DigitStringTask;

 protected:
  std::string Answer(const std::string& digits) const override {
    std::string sorted = digits;
    std::sort(sorted.begin(), sorted.end());
    return sorted;
  }
};

class ReverseTask final : public DigitStringTask {
 public:
  using DigitStringTask::DigitStringTask;

 protected:
  std::string Answer(const std::string& digits) const override {
    return std::string(digits.rbegin(), digits.rend());
  }
};

class AddTask final : public Task {
 public:
  using Task::Task;
  int max_answer_chars() const override { return config_.digits + 1; }
  int max_prompt_chars() const override { return 2 * config_.digits + 2; }
  Problem Random(std::mt19937_64& rng) const override {
    uint64_t limit = 1;
    for (int i = 0; i < config_.digits; ++i) limit *= 10;
    std::uniform_int_distribution<uint64_t> operand(0, limit - 1);
    const uint64_t a = operand(rng), b = operand(rng);
    return {std::to_string(a) + "+" + std::to_string(b) + "=", std::to_string(a + b)};
  }
};

}  // namespace

Result<std::unique_ptr<Task>> Task::Create(const TaskConfig& config) {
  const int max_digits = config.name == "add" ? 9 : 16;
  if (config.digits < 1 || config.digits > max_digits) {
    return Status::InvalidArgument("task.digits = " + std::to_string(config.digits) +
                                   " is out of range for task '" + config.name + "' (1.." +
                                   std::to_string(max_digits) + ")");
  }
  if (config.name == "sort") return std::unique_ptr<Task>(new SortTask(config));
  if (config.name == "reverse") return std::unique_ptr<Task>(new ReverseTask(config));
  if (config.name == "add") return std::unique_ptr<Task>(new AddTask(config));
  return Status::InvalidArgument("unknown task.name '" + config.name + "' (sort, reverse, add)");
}

bool Task::IsHeldOut(std::string_view prompt) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (char c : prompt) hash = (hash ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return (hash >> 32) % 8 == 0;
}

Problem Task::Sample(std::mt19937_64& rng, bool held_out) const {
  for (;;) {
    Problem problem = Random(rng);
    if (IsHeldOut(problem.prompt) == held_out) return problem;
  }
}

std::vector<Problem> Task::HeldOut(size_t count, uint64_t seed) const {
  std::mt19937_64 rng(seed);
  std::set<std::string> seen;
  std::vector<Problem> problems;
  // Small problem spaces run out of distinct held-out prompts: stop after many repeats.
  for (size_t attempts = 0; problems.size() < count && attempts < count * 50; ++attempts) {
    Problem problem = Sample(rng, /*held_out=*/true);
    if (seen.insert(problem.prompt).second) problems.push_back(std::move(problem));
  }
  return problems;
}

}  // namespace flywheel::pipeline
