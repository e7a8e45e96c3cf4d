// Datasets in the formats users already have: JSONL files of OpenAI-style chat messages, read
// one line at a time (never the whole file in memory), each line checked, the bad ones
// skipped and named `file:line: what`, with counts by reason at the end. docs/DATASETS.md
// describes the formats, the errors and the split for users.
//
//   SFT  {"messages": [...], "tools": [...]?}
//   DPO  {"input": {"messages": [...], "tools": [...]?}, "preferred_output": [assistant...],
//         "non_preferred_output": [assistant...]}
//   RL   {"messages": [...], "tools": [...]?, ...}: every field but "messages" is kept, as
//        JSON and untouched, for the grader (Example::fields).
//
// A message: {"role": "system" | "developer" | "user" | "assistant" | "tool", "content": a
// string, the OpenAI list of {"type": "text", "text": ...} parts (joined into one string), or
// null (an assistant turn with tool_calls); "tool_calls": [{"id", "type": "function",
// "function": {"name", "arguments": a JSON string (or object)}}] (assistant only);
// "tool_call_id", "name" (tool messages); "weight": 0 or 1 (assistant only: 0 leaves the turn
// out of the loss); "reasoning_content" (a string, kept for templates that render it)}. Other
// keys of a message are refused (a misspelled "wieght" must not silently train).
//
// Normalised messages (Example::messages, Example::chosen/rejected) are what a chat template
// receives: content always a string, tool-call `arguments` parsed into a JSON object (as
// transformers' templates expect; Qwen's and Llama-3's render it with tojson), `weight`
// removed and reported in Example::trained instead.
//
// The held-out split is disjoint by construction: either a separate eval file (read it with
// Split::kAll; nothing checks that its lines differ from the train file's), or
// ReadOptions::eval_fraction, which puts a line on the eval side when a 64-bit FNV-1a hash of
// its canonical content (the parsed JSON printed with sorted keys, no whitespace) falls
// below eval_fraction of the hash range. The same content is always on the same side,
// wherever it sits in the file, and raising eval_fraction only moves lines from train to eval.
//
// Thread safety: a DatasetReader is used by one thread at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::data {

enum class Format { kSft, kDpo, kRl };
const char* FormatName(Format format);  // "sft", "dpo", "rl"

// Which lines a reader yields.
enum class Split {
  kAll,    // every usable line
  kTrain,  // the lines the hash puts on the train side (all of them when eval_fraction is 0)
  kEval,   // the lines the hash puts on the eval side (none when eval_fraction is 0)
};

struct ReadOptions {
  Format format = Format::kSft;
  Split split = Split::kAll;
  // In [0, 1): the share of lines, by hash of their content, on the eval side.
  double eval_fraction = 0.0;
  // A longer line is skipped ("line too long") without being held in memory whole.
  int64_t max_line_bytes = 64 << 20;
  // How many `file:line: what` messages the report keeps (the counts are always complete).
  int64_t max_kept_problems = 1000;
};

// Where an example came from.
struct SourceLine {
  std::string file;
  int64_t line = 0;           // 1-based
  uint64_t content_hash = 0;  // FNV-1a 64 of the canonical JSON (the split's hash)
  std::string Describe() const { return file + ":" + std::to_string(line); }
};

// One usable line, normalised (see the top of this file).
struct Example {
  SourceLine source;
  // SFT: the conversation. DPO: the input (prompt) messages. RL: the prompt messages.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  // Per message of `messages`: true for an assistant turn in the loss (SFT: weight absent or 1;
  // DPO and RL: always false, their prompts are not trained).
  std::vector<bool> trained;
  // The top-level (SFT, RL) or input's (DPO) "tools", or null.
  nlohmann::ordered_json tools;
  // DPO: the preferred and non-preferred assistant messages (normalised, at least one each).
  nlohmann::ordered_json chosen = nlohmann::ordered_json::array();
  nlohmann::ordered_json rejected = nlohmann::ordered_json::array();
  // RL: every top-level field but "messages", as the line had it (key order kept).
  nlohmann::ordered_json fields = nlohmann::ordered_json::object();
};

// What a reader saw. Reasons are short fixed phrases ("not JSON", "unknown role", ...;
// docs/DATASETS.md lists them).
struct DatasetReport {
  std::string file;
  int64_t lines = 0;        // lines read (blank lines included, not counted as skipped)
  int64_t blank = 0;        // empty or whitespace-only lines, ignored
  int64_t usable = 0;       // lines that parsed and passed the checks, on either split side
  int64_t train = 0;        // usable lines on the train side
  int64_t eval = 0;         // usable lines on the eval side
  int64_t skipped = 0;      // bad lines
  std::map<std::string, int64_t> skipped_by_reason;
  std::vector<std::string> problems;  // "file:line: reason: detail", the first max_kept_problems

  // "F: 120 lines, 117 usable (105 train, 12 eval), 3 skipped (not JSON: 1, unknown role: 2)".
  std::string Summary() const;
};

// Reads one JSONL dataset, line by line.
class DatasetReader {
 public:
  // Fails with kNotFound / kIOError when `path` cannot be opened, kInvalidArgument for an
  // eval_fraction outside [0, 1).
  static Result<std::unique_ptr<DatasetReader>> Open(const std::string& path,
                                                     ReadOptions options);
  ~DatasetReader();
  DatasetReader(const DatasetReader&) = delete;
  DatasetReader& operator=(const DatasetReader&) = delete;

  // The next usable example of the chosen split into `*example`: true, or false at the end
  // of the file. Bad lines are skipped and recorded in report(). At the end, a file with no
  // usable line at all fails with kInvalidArgument (naming the file and the counts), as does
  // a split side left empty (e.g. eval_fraction too small for the file); kIOError on a read
  // error. After false or an error, Next keeps returning the same.
  Result<bool> Next(Example* example);

  const DatasetReport& report() const { return report_; }

 private:
  DatasetReader(std::string path, ReadOptions options, int file);
  Status EndOfFile();
  bool ReadLine(bool* too_long, bool* error);

  std::string path_;
  ReadOptions options_;
  int file_;  // a read-only descriptor
  std::vector<char> buffer_;
  size_t begin_ = 0, end_ = 0;  // the unread part of buffer_
  std::string line_;
  DatasetReport report_;
  bool done_ = false;
  Status end_status_;
};

// Parses one line of `format` (no trailing newline) into `*example` (source.line and .file
// left to the caller). On a bad line returns kInvalidArgument whose message is
// "<reason>: <detail>" (reason as in DatasetReport). For tests and callers holding lines.
Status ParseLine(std::string_view line, Format format, Example* example);

// FNV-1a 64 of `bytes`; the split hash of a line is this over its canonical JSON.
uint64_t Fnv1a64(std::string_view bytes);

// Whether a line whose content hash is `content_hash` is on the eval side for `eval_fraction`.
bool OnEvalSide(uint64_t content_hash, double eval_fraction);

// Reads a whole file through a reader and returns its examples: for tests and small files.
Result<std::vector<Example>> ReadAll(const std::string& path, ReadOptions options,
                                     DatasetReport* report = nullptr);

}  // namespace flywheel::data
