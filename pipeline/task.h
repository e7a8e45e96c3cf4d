// The demo's verifiable tasks: problems a program can generate and check exactly, so the
// reward needs no model (exact match of the completion against the answer).
//
//   sort     "3142>" -> "1234"        the digits sorted ascending
//   reverse  "3142>" -> "2413"        the digits reversed
//   add      "47+85=" -> "132"        the sum of two numbers of up to `digits` digits
//
// Every prompt ends in its separator (">" or "="); the completion is the answer followed by
// the tokenizer's end-of-sequence token. The problem space is split once, by a hash of the
// prompt, into a training part and a held-out part (about 1 in 8 prompts): evaluation only
// ever sees prompts that training never samples. Torch-free: the trainer, the rollout
// workers and the tools share it.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel::pipeline {

struct Problem {
  std::string prompt;
  std::string answer;
};

struct TaskConfig {
  std::string name = "sort";  // sort, reverse, add
  int digits = 6;             // sort / reverse: string length; add: digits per operand
};

class Task {
 public:
  static Result<std::unique_ptr<Task>> Create(const TaskConfig& config);
  virtual ~Task() = default;

  const TaskConfig& config() const { return config_; }
  // The characters prompts and answers use (the CharTokenizer's alphabet).
  std::string alphabet() const { return "0123456789+=>"; }
  // The longest answer in characters (generation stops one token later, at EOS).
  virtual int max_answer_chars() const = 0;
  // The longest prompt in characters, separator included.
  virtual int max_prompt_chars() const = 0;

  // A random problem from the training part, or from the held-out part.
  Problem Sample(std::mt19937_64& rng, bool held_out) const;
  // 1 for an exact match of `completion` (the decoded answer, EOS removed), else 0.
  static double Reward(std::string_view completion, std::string_view answer) {
    return completion == answer ? 1.0 : 0.0;
  }
  // `count` distinct held-out problems drawn with `seed` (fewer when the part is smaller).
  std::vector<Problem> HeldOut(size_t count, uint64_t seed) const;
  static bool IsHeldOut(std::string_view prompt);

 protected:
  explicit Task(TaskConfig config) : config_(std::move(config)) {}
  virtual Problem Random(std::mt19937_64& rng) const = 0;
  TaskConfig config_;
};

}  // namespace flywheel::pipeline
