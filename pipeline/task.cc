#include "pipeline/task.h"

#include <algorithm>
#include <fstream>
#include <mutex>
#include <set>
#include <span>

#include "base/env.h"

namespace flywheel::pipeline {
namespace {

Problem MakeProblem(std::string prompt, std::string answer) {
  Problem problem;
  problem.prompt = std::move(prompt);
  problem.answer = std::move(answer);
  return problem;
}

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
    return MakeProblem(digits + ">", std::move(answer));
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
    return MakeProblem(std::to_string(a) + "+" + std::to_string(b) + "=", std::to_string(a + b));
  }
};

using nlohmann::json;
using Line = nlohmann::ordered_json;

// Why an RL line is unusable ("" when it is usable).
std::string LineProblem(const Line& line) {
  if (!line.is_object()) return "not a JSON object";
  const auto messages = line.find("messages");
  if (messages == line.end() || !messages->is_array() || messages->empty())
    return "needs a non-empty \"messages\" array";
  for (const Line& m : *messages) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      return "a message without a string \"role\"";
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      return "unknown role \"" + role + "\"";
  }
  const auto answer = line.find("answer");
  if (answer != line.end() && !answer->is_string() && !answer->is_number())
    return "\"answer\" must be a string or a number";
  return "";
}

// One line of an RL file as a problem, or why it is unusable.
Result<Problem> ParseProblem(const std::string& text, const PromptRenderer& render) {
  Line line = Line::parse(text, nullptr, /*allow_exceptions=*/false);
  const std::string why = line.is_discarded() ? "not JSON" : LineProblem(line);
  if (!why.empty()) return Status::InvalidArgument(why);
  Result<std::string> prompt = render(line["messages"]);
  if (!prompt.ok()) return Status::InvalidArgument("the chat template cannot render it: " + prompt.status().message());
  Problem problem;
  problem.prompt = std::move(*prompt);
  // The grader sees the line as it was (plain json: the grading library's type).
  problem.messages = json::parse(line["messages"].dump());
  problem.fields = json::object();
  for (const auto& [key, value] : line.items()) {
    if (key != "messages") problem.fields[key] = json::parse(value.dump());
  }
  if (const auto answer = line.find("answer"); answer != line.end())
    problem.answer = answer->is_string() ? answer->get<std::string>() : answer->dump();
  return problem;
}

// The usable lines of one RL file, by byte offset: the file is read once at load (to check
// and measure every line) and then line by line as prompts are drawn, never held whole.
struct LineIndex {
  std::string path;
  std::vector<uint64_t> offsets;
};

// A task read from RL JSONL files; prompts are drawn uniformly from the line index and read
// back (and rendered) when drawn.
class FileTask final : public Task {
 public:
  FileTask(LineIndex train, LineIndex eval, PromptRenderer render, int max_prompt, int max_answer)
      : Task(TaskConfig{"files", 0, {}, {}, 0.125}),
        train_(std::move(train)),
        eval_(std::move(eval)),
        render_(std::move(render)),
        max_prompt_(max_prompt),
        max_answer_(max_answer) {}
  int max_answer_chars() const override { return max_answer_; }
  int max_prompt_chars() const override { return max_prompt_; }
  Problem Sample(std::mt19937_64& rng, bool held_out) const override {
    const LineIndex& part = held_out ? eval_ : train_;
    const size_t first = rng() % part.offsets.size();
    // A line that no longer reads back (the file changed under the run) is passed over.
    for (size_t i = 0; i < part.offsets.size(); ++i) {
      Result<Problem> problem = Read(part, (first + i) % part.offsets.size());
      if (problem.ok()) return std::move(*problem);
    }
    Problem none;
    none.prompt = "";
    return none;
  }
  std::vector<Problem> HeldOut(size_t count, uint64_t) const override {
    std::vector<Problem> problems;
    for (size_t i = 0; i < eval_.offsets.size() && problems.size() < count; ++i) {
      Result<Problem> problem = Read(eval_, i);
      if (problem.ok()) problems.push_back(std::move(*problem));
    }
    return problems;
  }

 protected:
  Problem Random(std::mt19937_64& rng) const override { return Sample(rng, false); }

 private:
  Result<Problem> Read(const LineIndex& part, size_t index) const {
    std::lock_guard lock(mu_);
    std::ifstream& in = &part == &train_ ? train_in_ : eval_in_;
    if (!in.is_open()) in.open(part.path, std::ios::binary);
    in.clear();
    in.seekg(static_cast<std::streamoff>(part.offsets[index]));
    std::string text;
    if (!std::getline(in, text)) return Status::IOError("cannot read " + part.path + " again");
    return ParseProblem(text, render_);
  }

  LineIndex train_, eval_;
  PromptRenderer render_;
  int max_prompt_ = 0, max_answer_ = 0;
  mutable std::mutex mu_;
  mutable std::ifstream train_in_, eval_in_;  // GUARDED_BY(mu_)
};

struct IndexedLines {
  LineIndex train, eval;
  int max_prompt = 0, max_answer = 0;
  size_t skipped = 0;
};

// Indexes the usable lines of `path` into `train` (or, with `split`, those whose prompt
// IsHeldOut into `eval`); bad lines are warned (file:line) and counted.
Status IndexProblems(const std::string& path, const PromptRenderer& render,
                     const std::function<void(const std::string&)>& warn, bool split, double fraction,
                     LineIndex& train, LineIndex& eval, IndexedLines& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::InvalidArgument("cannot read dataset " + path);
  train.path = eval.path = path;
  std::string text;
  uint64_t offset = 0;
  for (size_t number = 1; std::getline(in, text); ++number) {
    const uint64_t at = offset;
    offset += text.size() + 1;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    Result<Problem> problem = ParseProblem(text, render);
    if (!problem.ok()) {
      ++out.skipped;
      if (warn) warn(path + ":" + std::to_string(number) + ": skipped: " + problem.status().message());
      continue;
    }
    out.max_prompt = std::max<int>(out.max_prompt, static_cast<int>(problem->prompt.size()));
    out.max_answer = std::max<int>(out.max_answer, static_cast<int>(problem->answer.size()));
    (split && Task::IsHeldOut(problem->prompt, fraction) ? eval : train).offsets.push_back(at);
  }
  if (in.bad()) return Status::IOError("cannot read dataset " + path);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Task>> Task::FromFiles(const std::string& train, const std::string& eval,
                                              const PromptRenderer& render,
                                              const std::function<void(const std::string&)>& warn,
                                              TaskFileCounts* counts, double eval_fraction) {
  if (!(eval_fraction > 0 && eval_fraction < 1)) {
    return Status::InvalidArgument("task.eval_fraction must be in (0, 1)");
  }
  IndexedLines lines;
  LineIndex unused;
  FW_RETURN_IF_ERROR(IndexProblems(train, render, warn, /*split=*/eval.empty(), eval_fraction, lines.train,
                                   lines.eval, lines));
  if (!eval.empty()) FW_RETURN_IF_ERROR(IndexProblems(eval, render, warn, false, eval_fraction, lines.eval, unused, lines));
  if (lines.train.offsets.empty()) return Status::InvalidArgument("dataset " + train + " has no usable training line");
  if (lines.eval.offsets.empty()) {
    return Status::InvalidArgument("no usable held-out line (" + (eval.empty() ? train : eval) + ")");
  }
  if (counts) *counts = {lines.train.offsets.size(), lines.eval.offsets.size(), lines.skipped};
  return std::unique_ptr<Task>(new FileTask(std::move(lines.train), std::move(lines.eval), render,
                                            lines.max_prompt, lines.max_answer));
}

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

bool Task::IsHeldOut(std::string_view prompt, double fraction) {
  if (fraction == 0.125) return IsHeldOut(prompt);
  uint64_t hash = 1469598103934665603ull;  // FNV-1a, as IsHeldOut
  for (char c : prompt) hash = (hash ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return static_cast<double>((hash >> 32) % 1000000) < fraction * 1e6;
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

std::string RlLine(const Problem& problem) {
  const json line = {{"messages", {{{"role", "user"}, {"content", problem.prompt}}}},
                     {"answer", problem.answer}};
  return line.dump();
}

std::string SftLine(const Problem& problem) {
  const json line = {{"messages",
                      {{{"role", "user"}, {"content", problem.prompt}},
                       {{"role", "assistant"}, {"content", problem.answer}, {"weight", 1}}}}};
  return line.dump();
}

namespace {
Status WriteLines(const std::string& path, const std::string& text) {
  return WriteFileAtomically(path, std::as_bytes(std::span(text.data(), text.size())));
}
}  // namespace

Result<TaskFilesWritten> MakeTaskFiles(const TaskFilesOptions& options) {
  if (options.out.empty() && options.sft_out.empty()) return Status::InvalidArgument("no output file named (--out)");
  if (options.count < 1) return Status::InvalidArgument("--count must be at least 1");
  FW_ASSIGN_OR_RETURN(std::unique_ptr<Task> task, Task::Create(options.task));
  TaskFilesWritten written;
  std::mt19937_64 rng(options.seed);
  std::string train, sft;
  for (size_t i = 0; i < options.count && !options.out.empty(); ++i) {
    const Problem problem = task->Sample(rng, /*held_out=*/false);
    train += RlLine(problem) + "\n";
    ++written.train;
  }
  if (!options.sft_out.empty()) {
    std::mt19937_64 sft_rng(options.seed + 99);  // the demo's WriteSftDataset draws the same
    for (size_t i = 0; i < options.count; ++i) {
      sft += SftLine(task->Sample(sft_rng, /*held_out=*/false)) + "\n";
      ++written.sft;
    }
  }
  std::string eval;
  if (!options.eval_out.empty()) {
    for (const Problem& problem : task->HeldOut(options.eval_count, options.seed + 4241)) {
      eval += RlLine(problem) + "\n";
      ++written.eval;
    }
  }
  if (!options.out.empty()) FW_RETURN_IF_ERROR(WriteLines(options.out, train));
  if (!options.eval_out.empty()) FW_RETURN_IF_ERROR(WriteLines(options.eval_out, eval));
  if (!options.sft_out.empty()) FW_RETURN_IF_ERROR(WriteLines(options.sft_out, sft));
  return written;
}

std::string TinyTokenizerJson(const std::string& alphabet) {
  json vocab = json::object();
  for (size_t i = 0; i < alphabet.size(); ++i) vocab[std::string(1, alphabet[i])] = i;
  const size_t bos = alphabet.size(), eos = alphabet.size() + 1;
  vocab["<s>"] = bos;
  vocab["</s>"] = eos;
  const auto added = [](size_t id, const char* content) {
    return json{{"id", id},         {"content", content}, {"single_word", false},
                {"lstrip", false},  {"rstrip", false},    {"normalized", false},
                {"special", true}};
  };
  const json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {added(bos, "<s>"), added(eos, "</s>")}},
      {"normalizer", nullptr},
      {"pre_tokenizer", nullptr},
      {"post_processor", nullptr},
      {"decoder", {{"type", "Fuse"}}},  // joins the pieces (no decoder would join with spaces)
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
        {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", json::array()}}}};
  return tokenizer.dump(2) + "\n";
}

std::string TinyTokenizerConfigJson() {
  const std::string chat_template =
      "{%- for message in messages -%}"
      "{%- if message['role'] == 'assistant' -%}"
      "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
      "{%- else -%}{{ message['content'] }}{%- endif -%}"
      "{%- endfor -%}";
  const json config = {{"bos_token", "<s>"},
                       {"eos_token", "</s>"},
                       {"model_max_length", 64},
                       {"tokenizer_class", "PreTrainedTokenizerFast"},
                       {"chat_template", chat_template}};
  return config.dump(2) + "\n";
}

}  // namespace flywheel::pipeline
