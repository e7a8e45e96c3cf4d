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
//
// The same tasks as files (issue 34): MakeTaskFiles writes the training part as an RL JSONL
// (`{"messages": [{"role": "user", "content": prompt}], "answer": "..."}`), the held-out
// part as another, and optionally SFT examples (`{"messages": [user, assistant]}`);
// Task::FromFiles reads such files back as a task whose prompts are the lines' messages
// rendered by the model's chat template and whose answers are their "answer" fields. The
// files are read once to check every line, then kept as byte offsets of the usable lines
// (8 bytes a line): a prompt is read back and rendered when it is drawn.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel::pipeline {

struct Problem {
  std::string prompt;
  std::string answer;  // a dataset line's "answer" (a number as its JSON text); "" if none
  // A dataset line's "messages" and every other field of it, untouched, for the grader;
  // null for the generated tasks (GradingSample makes them from prompt and answer).
  nlohmann::json messages;
  nlohmann::json fields;
};

struct TaskConfig {
  std::string name = "sort";  // sort, reverse, add
  int digits = 6;             // sort / reverse: string length; add: digits per operand
  // Set: the task is read from this RL JSONL instead (Task::FromFiles), held out from
  // eval_dataset (empty: eval_fraction of the dataset's prompts, by IsHeldOut's hash).
  std::string dataset;
  std::string eval_dataset;
  double eval_fraction = 0.125;
};

// Renders a dataset line's "messages" as the prompt text a worker tokenizes (the chat
// template with add_generation_prompt); an error names why the line cannot be rendered.
using PromptRenderer = std::function<Result<std::string>(const nlohmann::ordered_json& messages)>;

// What Task::FromFiles read: usable lines, and the skipped ones (each warned as file:line).
struct TaskFileCounts {
  size_t train_lines = 0, eval_lines = 0, skipped = 0;
};

class Task {
 public:
  static Result<std::unique_ptr<Task>> Create(const TaskConfig& config);
  // A task from RL JSONL files: `train` (sampled) and `eval` (held out; empty: every 8th
  // line of `train`, by the prompt hash of IsHeldOut, is held out instead). A line needs a
  // non-empty "messages" array of known roles; its "answer" is optional (a string, or a
  // number taken as its JSON text); other lines are skipped, each named
  // file:line in `warn`, and counted. InvalidArgument when a file has no usable line, or
  // cannot be read (naming it).
  static Result<std::unique_ptr<Task>> FromFiles(const std::string& train, const std::string& eval,
                                                 const PromptRenderer& render,
                                                 const std::function<void(const std::string&)>& warn,
                                                 TaskFileCounts* counts = nullptr,
                                                 double eval_fraction = 0.125);
  virtual ~Task() = default;

  const TaskConfig& config() const { return config_; }
  // The characters prompts and answers use (the CharTokenizer's alphabet).
  std::string alphabet() const { return "0123456789+=>"; }
  // The longest answer in characters (generation stops one token later, at EOS).
  virtual int max_answer_chars() const = 0;
  // The longest prompt in characters, separator included.
  virtual int max_prompt_chars() const = 0;

  // A random problem from the training part, or from the held-out part.
  virtual Problem Sample(std::mt19937_64& rng, bool held_out) const;
  // 1 for an exact match of `completion` (the decoded answer, EOS removed), else 0.
  static double Reward(std::string_view completion, std::string_view answer) {
    return completion == answer ? 1.0 : 0.0;
  }
  // `count` distinct held-out problems drawn with `seed` (fewer when the part is smaller).
  virtual std::vector<Problem> HeldOut(size_t count, uint64_t seed) const;
  static bool IsHeldOut(std::string_view prompt);
  // Held out at `fraction` (in (0, 1)) of prompts by the same hash; 0.125 is exactly
  // IsHeldOut(prompt), the generated tasks' split.
  static bool IsHeldOut(std::string_view prompt, double fraction);

 protected:
  explicit Task(TaskConfig config) : config_(std::move(config)) {}
  virtual Problem Random(std::mt19937_64& rng) const = 0;
  TaskConfig config_;
};

// `flywheel dataset make`: the task's problems as files, written atomically (base/env.h).
struct TaskFilesOptions {
  TaskConfig task;
  size_t count = 4000;       // training lines (problems drawn from the training part)
  size_t eval_count = 256;   // distinct held-out problems (fewer when the part is smaller)
  uint64_t seed = 1;
  std::string out;           // the RL JSONL of the training part (required)
  std::string eval_out;      // the held-out RL JSONL (empty: not written)
  std::string sft_out;       // SFT JSONL of `count` training problems (empty: not written)
};
struct TaskFilesWritten {
  size_t train = 0, eval = 0, sft = 0;
};
Result<TaskFilesWritten> MakeTaskFiles(const TaskFilesOptions& options);

// One RL line (no trailing newline) and one SFT line for a problem.
std::string RlLine(const Problem& problem);
std::string SftLine(const Problem& problem);

// The demo's tiny vocabulary as HF tokenizer files: tokenizer.json (BPE over single
// characters, no merges, a Fuse decoder; the alphabet's characters are ids 0.., then <s>
// and </s>: exactly the CharTokenizer's ids) and tokenizer_config.json (bos/eos and a
// chat template that
// renders user turns as their content and assistant turns as content + </s>, inside
// {% generation %}; no BOS: the workers prepend it).
std::string TinyTokenizerJson(const std::string& alphabet);
std::string TinyTokenizerConfigJson();

}  // namespace flywheel::pipeline
