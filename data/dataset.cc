// JSONL datasets: the line reader, the per-format checks and normalisation, the split hash.
#include "data/dataset.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include "base/json.h"

namespace flywheel::data {

using nlohmann::ordered_json;

namespace {

constexpr const char* kRoles[] = {"system", "developer", "user", "assistant", "tool"};
constexpr const char* kMessageKeys[] = {"role",         "content", "tool_calls",       "tool_call_id",
                                        "name",         "weight",  "reasoning_content"};

Status Bad(const std::string& reason, const std::string& detail) {
  return Status::InvalidArgument(reason + ": " + detail);
}

template <size_t N>
bool OneOf(const std::string& value, const char* const (&list)[N]) {
  for (const char* item : list)
    if (value == item) return true;
  return false;
}

// "content": a string, a list of text parts (joined), or null / absent (as "").
Result<std::string> ContentText(const ordered_json& message, const std::string& where) {
  auto it = message.find("content");
  if (it == message.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array()) return Bad("bad content", where + " content is neither a string nor a list of parts");
  std::string text;
  for (const ordered_json& part : *it) {
    auto type = part.is_object() ? part.find("type") : part.end();
    if (!part.is_object() || type == part.end() || *type != "text" || !part.contains("text") ||
        !part["text"].is_string())
      return Bad("bad content", where + " content part is not {\"type\": \"text\", \"text\": ...}");
    text += part["text"].get<std::string>();
  }
  return text;
}

// One OpenAI tool call, normalised: {"id"?, "type": "function", "function": {name, arguments}}
// with arguments parsed from their JSON string.
Result<ordered_json> NormalizeToolCall(const ordered_json& call, const std::string& where) {
  if (!call.is_object()) return Bad("bad tool_calls", where + " is not an object");
  if (call.contains("type") && call["type"] != "function")
    return Bad("bad tool_calls", where + " type is not \"function\"");
  auto function = call.find("function");
  if (function == call.end() || !function->is_object())
    return Bad("bad tool_calls", where + " has no \"function\" object");
  auto name = function->find("name");
  if (name == function->end() || !name->is_string() || name->get<std::string>().empty())
    return Bad("bad tool_calls", where + ".function has no name");
  ordered_json arguments = ordered_json::object();
  if (auto a = function->find("arguments"); a != function->end()) {
    if (a->is_string()) {
      Result<ordered_json> parsed = ParseJson<ordered_json>(a->get<std::string>(), "arguments");
      if (!parsed.ok()) return Bad("bad tool_calls", where + ".function.arguments is not JSON");
      arguments = std::move(parsed).value();
    } else if (a->is_object()) {
      arguments = *a;
    } else {
      return Bad("bad tool_calls", where + ".function.arguments is neither a JSON string nor an object");
    }
  }
  ordered_json out = ordered_json::object();
  if (auto id = call.find("id"); id != call.end()) {
    if (!id->is_string()) return Bad("bad tool_calls", where + ".id is not a string");
    out["id"] = *id;
  }
  out["type"] = "function";
  out["function"] = {{"name", *name}, {"arguments", std::move(arguments)}};
  return out;
}

// "weight": absent (1), or the number 0 or 1, on an assistant message only.
Result<bool> Weight(const ordered_json& message, const std::string& role, const std::string& where) {
  auto it = message.find("weight");
  if (it == message.end()) return true;
  if (role != "assistant") return Bad("bad weight", where + " has a weight but is not an assistant turn");
  if (!it->is_number() || (it->get<double>() != 0.0 && it->get<double>() != 1.0))
    return Bad("bad weight", where + " weight is " + it->dump() + ", not 0 or 1");
  return it->get<double>() == 1.0;
}

struct Normalized {
  ordered_json message;
  bool weighted = true;  // weight absent or 1
};

Status CheckKeys(const ordered_json& message, const std::string& role, const std::string& where) {
  for (const auto& [key, value] : message.items()) {
    if (!OneOf(key, kMessageKeys)) return Bad("unknown message key", where + " has a key \"" + key + "\"");
    bool string_key = key == "tool_call_id" || key == "name" || key == "reasoning_content";
    if (string_key && !value.is_string() && !value.is_null())
      return Bad("bad message", where + " " + key + " is not a string");
  }
  if (message.contains("tool_calls") && role != "assistant")
    return Bad("bad tool_calls", where + " has tool_calls but is a " + role + " message");
  return Status::Ok();
}

// One message checked and normalised (see dataset.h). `where`: "messages[3]".
Result<Normalized> NormalizeMessage(const ordered_json& message, const std::string& where) {
  if (!message.is_object()) return Bad("bad message", where + " is not an object");
  auto role_it = message.find("role");
  if (role_it == message.end() || !role_it->is_string())
    return Bad("unknown role", where + " has no role");
  const std::string role = role_it->get<std::string>();
  if (!OneOf(role, kRoles)) return Bad("unknown role", where + " role \"" + role + "\"");
  FW_RETURN_IF_ERROR(CheckKeys(message, role, where));
  Normalized out;
  FW_ASSIGN_OR_RETURN(out.weighted, Weight(message, role, where));
  FW_ASSIGN_OR_RETURN(std::string content, ContentText(message, where));
  out.message = {{"role", role}, {"content", content}};
  bool has_calls = false;
  if (auto calls = message.find("tool_calls"); calls != message.end() && !calls->is_null()) {
    if (!calls->is_array()) return Bad("bad tool_calls", where + " tool_calls is not a list");
    ordered_json normalized = ordered_json::array();
    for (size_t i = 0; i < calls->size(); ++i) {
      FW_ASSIGN_OR_RETURN(ordered_json call,
                          NormalizeToolCall((*calls)[i], where + ".tool_calls[" + std::to_string(i) + "]"));
      normalized.push_back(std::move(call));
    }
    has_calls = !normalized.empty();
    if (has_calls) out.message["tool_calls"] = std::move(normalized);
  }
  for (const char* key : {"tool_call_id", "name", "reasoning_content"})
    if (auto it = message.find(key); it != message.end() && it->is_string()) out.message[key] = *it;
  bool blank = content.find_first_not_of(" \t\r\n") == std::string::npos;
  bool has_reasoning = out.message.contains("reasoning_content");
  if (role == "assistant" && out.weighted && blank && !has_calls && !has_reasoning)
    return Bad("empty assistant turn", where + " has no content and no tool_calls");
  return out;
}

Status ParseTools(const ordered_json& holder, const std::string& where, ordered_json* tools) {
  auto it = holder.find("tools");
  if (it == holder.end() || it->is_null()) return Status::Ok();
  if (!it->is_array()) return Bad("bad tools", where + "tools is not a list");
  for (const ordered_json& tool : *it)
    if (!tool.is_object()) return Bad("bad tools", where + "tools holds a non-object");
  *tools = *it;
  return Status::Ok();
}

// The "messages" list of `holder` into example->messages / trained. `train_assistant`: SFT
// (assistant turns are in the loss unless weight 0).
Status ParseMessages(const ordered_json& holder, const std::string& where, bool train_assistant,
                     Example* example) {
  auto it = holder.find("messages");
  if (it == holder.end()) return Bad("no messages", where + "has no \"messages\"");
  if (!it->is_array() || it->empty()) return Bad("no messages", where + "messages is not a non-empty list");
  for (size_t i = 0; i < it->size(); ++i) {
    const std::string name = where + "messages[" + std::to_string(i) + "]";
    Result<Normalized> message = NormalizeMessage((*it)[i], name);
    // Untrained prompt turns may be empty (a history turn the loss never sees).
    if (!message.ok() && !train_assistant &&
        message.status().message().rfind("empty assistant turn", 0) == 0) {
      Normalized kept;
      kept.message = {{"role", "assistant"}, {"content", ""}};
      message = std::move(kept);
    }
    if (!message.ok()) return message.status();
    bool trained = train_assistant && message->weighted && message->message["role"] == "assistant";
    example->messages.push_back(std::move(message->message));
    example->trained.push_back(trained);
  }
  return ParseTools(holder, where, &example->tools);
}

// A DPO side: a non-empty list of assistant messages, no weights.
Result<ordered_json> ParseCompletion(const ordered_json& line, const std::string& key) {
  const std::string reason = "bad " + key;
  auto it = line.find(key);
  if (it == line.end() || !it->is_array() || it->empty())
    return Bad(reason, key + " is not a non-empty list of assistant messages");
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < it->size(); ++i) {
    const std::string where = key + "[" + std::to_string(i) + "]";
    const ordered_json& message = (*it)[i];
    if (message.is_object() && message.contains("weight"))
      return Bad("bad weight", where + " has a weight (a DPO completion is trained whole)");
    if (message.is_object() && message.value("role", "") != "assistant")
      return Bad(reason, where + " is not an assistant message");
    FW_ASSIGN_OR_RETURN(Normalized normalized, NormalizeMessage(message, where));
    out.push_back(std::move(normalized.message));
  }
  return out;
}

Status ParseSft(const ordered_json& line, Example* example) {
  FW_RETURN_IF_ERROR(ParseMessages(line, "", true, example));
  for (bool trained : example->trained)
    if (trained) return Status::Ok();
  return Bad("no trained assistant turn", "no assistant message with weight 1");
}

Status ParseDpo(const ordered_json& line, Example* example) {
  auto input = line.find("input");
  if (input == line.end() || !input->is_object()) return Bad("no input", "no \"input\" object");
  FW_RETURN_IF_ERROR(ParseMessages(*input, "input.", false, example));
  FW_ASSIGN_OR_RETURN(example->chosen, ParseCompletion(line, "preferred_output"));
  FW_ASSIGN_OR_RETURN(example->rejected, ParseCompletion(line, "non_preferred_output"));
  return Status::Ok();
}

Status ParseRl(const ordered_json& line, Example* example) {
  FW_RETURN_IF_ERROR(ParseMessages(line, "", false, example));
  if (example->messages.back()["role"] == "assistant")
    return Bad("prompt ends with an assistant turn", "the last message is the assistant's");
  for (const auto& [key, value] : line.items())
    if (key != "messages") example->fields[key] = value;
  return Status::Ok();
}

std::string ReasonOf(const Status& status) {
  const std::string& message = status.message();
  size_t colon = message.find(": ");
  return colon == std::string::npos ? message : message.substr(0, colon);
}

}  // namespace

const char* FormatName(Format format) {
  switch (format) {
    case Format::kSft: return "sft";
    case Format::kDpo: return "dpo";
    case Format::kRl: return "rl";
  }
  return "?";
}

uint64_t Fnv1a64(std::string_view bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

bool OnEvalSide(uint64_t content_hash, double eval_fraction) {
  // The top 53 bits as a fraction in [0, 1).
  double position = static_cast<double>(content_hash >> 11) * 0x1.0p-53;
  return position < eval_fraction;
}

Status ParseLine(std::string_view line, Format format, Example* example) {
  Result<ordered_json> parsed = ParseJson<ordered_json>(line, "line");
  if (!parsed.ok()) return Bad("not JSON", parsed.status().message());
  if (!parsed->is_object()) return Bad("not an object", "the line is JSON but not an object");
  // The canonical content: keys sorted (nlohmann::json), no whitespace.
  Result<nlohmann::json> canonical = ParseJson<nlohmann::json>(line, "line");
  if (!canonical.ok()) return Bad("not JSON", canonical.status().message());
  example->source.content_hash = Fnv1a64(canonical->dump());
  switch (format) {
    case Format::kSft: return ParseSft(*parsed, example);
    case Format::kDpo: return ParseDpo(*parsed, example);
    case Format::kRl: return ParseRl(*parsed, example);
  }
  return Status::Internal("unknown dataset format");
}

std::string DatasetReport::Summary() const {
  std::string out = file + ": " + std::to_string(lines) + " lines, " + std::to_string(usable) +
                    " usable (" + std::to_string(train) + " train, " + std::to_string(eval) +
                    " eval), " + std::to_string(skipped) + " skipped";
  if (!skipped_by_reason.empty()) {
    out += " (";
    bool first = true;
    for (const auto& [reason, count] : skipped_by_reason) {
      out += (first ? "" : ", ") + reason + ": " + std::to_string(count);
      first = false;
    }
    out += ")";
  }
  return out;
}

Result<std::unique_ptr<DatasetReader>> DatasetReader::Open(const std::string& path,
                                                           ReadOptions options) {
  if (!(options.eval_fraction >= 0.0 && options.eval_fraction < 1.0))
    return Status::InvalidArgument("eval_fraction " + std::to_string(options.eval_fraction) +
                                   " is outside [0, 1)");
  int file = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file < 0) {
    int error = errno;
    std::string message = path + ": " + std::strerror(error);
    return error == ENOENT ? Status::NotFound(message) : Status::IOError(message);
  }
  return std::unique_ptr<DatasetReader>(new DatasetReader(path, options, file));
}

DatasetReader::DatasetReader(std::string path, ReadOptions options, int file)
    : path_(std::move(path)), options_(options), file_(file), buffer_(1 << 16) {
  report_.file = path_;
}

DatasetReader::~DatasetReader() {
  if (file_ >= 0) ::close(file_);
}

Status DatasetReader::EndOfFile() {
  if (report_.usable == 0)
    return Status::InvalidArgument(report_.Summary() + ": no usable line" +
                                   (report_.problems.empty() ? "" : "; first: " + report_.problems[0]));
  bool empty_side = (options_.split == Split::kTrain && report_.train == 0) ||
                    (options_.split == Split::kEval && report_.eval == 0);
  if (empty_side)
    return Status::InvalidArgument(report_.Summary() + ": eval_fraction " +
                                   std::to_string(options_.eval_fraction) + " leaves the " +
                                   (options_.split == Split::kTrain ? "train" : "eval") +
                                   " side empty");
  return Status::Ok();
}

// One line (without its '\n') into line_, through a 64 KiB buffer; a line past
// max_line_bytes is consumed but not kept (*too_long). False at the end of the file with
// nothing read, or on a read error (*error).
bool DatasetReader::ReadLine(bool* too_long, bool* error) {
  line_.clear();
  *too_long = false;
  bool any = false;
  while (true) {
    if (begin_ == end_) {
      begin_ = end_ = 0;
      // read(2), not stdio: it returns what a pipe holds now, so a line is yielded as soon
      // as it is complete.
      ssize_t n = ::read(file_, buffer_.data(), buffer_.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        *error = n < 0;
        return any && !*error;
      }
      end_ = static_cast<size_t>(n);
    }
    any = true;
    const char* start = buffer_.data() + begin_;
    const void* newline = std::memchr(start, '\n', end_ - begin_);
    size_t n = newline ? static_cast<const char*>(newline) - start : end_ - begin_;
    begin_ += newline ? n + 1 : n;
    if (!*too_long && static_cast<int64_t>(line_.size() + n) > options_.max_line_bytes) {
      *too_long = true;
      line_.clear();
      line_.shrink_to_fit();
    }
    if (!*too_long) line_.append(start, n);
    if (newline) return true;
  }
}

Result<bool> DatasetReader::Next(Example* example) {
  while (!done_) {
    bool too_long = false, error = false;
    if (!ReadLine(&too_long, &error)) {
      done_ = true;
      end_status_ = error ? Status::IOError(path_ + ": read failed at line " +
                                            std::to_string(report_.lines + 1))
                          : EndOfFile();
      break;
    }
    ++report_.lines;
    if (!line_.empty() && line_.back() == '\r') line_.pop_back();
    if (!too_long && line_.find_first_not_of(" \t") == std::string::npos) {
      ++report_.blank;
      continue;
    }
    *example = Example();
    Status status = too_long ? Bad("line too long", "over " + std::to_string(options_.max_line_bytes) + " bytes")
                             : ParseLine(line_, options_.format, example);
    if (!status.ok()) {
      ++report_.skipped;
      ++report_.skipped_by_reason[ReasonOf(status)];
      if (static_cast<int64_t>(report_.problems.size()) < options_.max_kept_problems)
        report_.problems.push_back(path_ + ":" + std::to_string(report_.lines) + ": " + status.message());
      continue;
    }
    example->source.file = path_;
    example->source.line = report_.lines;
    ++report_.usable;
    bool eval = OnEvalSide(example->source.content_hash, options_.eval_fraction);
    ++(eval ? report_.eval : report_.train);
    if (options_.split == Split::kAll || (options_.split == Split::kEval) == eval) return true;
  }
  if (!end_status_.ok()) return end_status_;
  return false;
}

Result<std::vector<Example>> ReadAll(const std::string& path, ReadOptions options,
                                     DatasetReport* report) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<DatasetReader> reader, DatasetReader::Open(path, options));
  std::vector<Example> examples;
  Example example;
  while (true) {
    Result<bool> more = reader->Next(&example);
    if (report != nullptr) *report = reader->report();
    if (!more.ok()) return more.status();
    if (!*more) break;
    examples.push_back(std::move(example));
  }
  return examples;
}

}  // namespace flywheel::data
