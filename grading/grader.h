// Graders: what turns a sampled completion into a reward. Two kinds behind one asynchronous
// interface (AsyncGrader):
//
//   * built in (LoadBuiltinGraders): exact_match, regex, numeric, contains, json_field,
//     length_penalty, composed as a weighted sum from a config (JSON, or TOML-like
//     `[[grader]]` key/values); a config error is refused at load, naming the entry;
//   * external: a long-lived process (StartProcessGrader, `--grader "python3 grade.py"`) or
//     an HTTP endpoint (StartHttpGrader, `--grader-url URL`) speaking the line protocol of
//     docs/GRADERS.md: one request {"id", "messages", "completion", "fields"} per line, one
//     answer {"id", "reward"[, "metrics"]} (or, from an environment, {"id", "messages"})
//     per line, in any order.
//
// Failure model (docs/GRADERS.md "Failures"): an answer that is missing (timed out), not JSON
// or not a finite number makes that sample kUngraded (counted in GraderCounters, excluded
// from the loss by the caller); a crashed process is restarted and the requests it held are
// re-sent once (a request held through a second crash is kUngraded); more than
// max_grader_failures ungraded samples in a row make the grader failed: status() is then an
// error naming the command (or URL) and its last stderr lines, and every outstanding and
// later request completes as kFailed with that message.
//
// Thread safety: every AsyncGrader method may be called from any thread. Callbacks run on a
// grader's own thread, never on the caller's inside Submit(); they must not block (set a
// promise, push to a queue) and may call Submit() again.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel::grading {

// One sample to grade: a dataset line's prompt conversation, the model's completion, and
// every other field of the line, untouched ({"answer": "42", "tests": [...]}).
struct Sample {
  // Unique among the requests in flight at one grader: an environment keeps an episode's
  // state under it across turns, so a group of completions of one prompt needs one id each
  // ("prompt17/3").
  std::string id;
  nlohmann::json messages = nlohmann::json::array();  // [{"role", "content", ...}, ...]
  std::string completion;
  // The completion as an OpenAI assistant message, tool calls parsed (tokenizer/
  // answer_parser.h), when the caller parsed it (episodes in a run); null otherwise.
  nlohmann::json message;
  nlohmann::json fields = nlohmann::json::object();
  // The completion's length in tokens when the caller knows it; -1: unknown
  // (length_penalty with unit "tokens" then counts whitespace-separated words).
  int64_t completion_tokens = -1;
};

enum class OutcomeKind {
  kReward,    // graded: reward (and metrics)
  kContinue,  // an environment's next turn: append `messages` and sample again
  kUngraded,  // no usable answer (reason says why); excluded from the loss
  kFailed,    // the grader has failed for good (reason: status().message())
};

const char* OutcomeKindName(OutcomeKind kind);

struct Outcome {
  OutcomeKind kind = OutcomeKind::kUngraded;
  double reward = 0;                      // kReward: finite
  std::map<std::string, double> metrics;  // kReward: named, finite values
  nlohmann::json messages;                // kContinue: an array of messages to append
  std::string reason;                     // kUngraded, kFailed

  static Outcome Reward(double reward, std::map<std::string, double> metrics = {});
  static Outcome Ungraded(std::string reason);
};

// A synchronous grader: the built-in ones. Grade() is const and thread-safe.
class Grader {
 public:
  virtual ~Grader() = default;
  // kReward, or kUngraded when the sample lacks what the grader needs (a missing field).
  virtual Outcome Grade(const Sample& sample) const = 0;
};

// What a grader has done since it started; every counter only grows.
struct GraderCounters {
  uint64_t submitted = 0;
  uint64_t rewarded = 0;
  uint64_t continued = 0;            // kContinue answers
  uint64_t ungraded = 0;             // all kUngraded outcomes, the lines below included
  uint64_t ungraded_timeout = 0;     // no answer within the per-call timeout
  uint64_t ungraded_bad_answer = 0;  // not JSON, reward not a finite number, neither field
  uint64_t ungraded_crash = 0;       // held through a second crash, or HTTP call failed
  uint64_t ungraded_no_answer = 0;   // an HTTP batch answer that lacked the id
  uint64_t failed = 0;               // kFailed outcomes
  uint64_t unknown_ids = 0;          // answers for no request in flight: dropped
  uint64_t garbage_lines = 0;        // stdout lines that name no request (debug prints)
  uint64_t restarts = 0;             // process restarts after a crash or a silent hang
  uint64_t resent = 0;               // requests re-sent after a restart
};

using OutcomeCallback = std::function<void(Outcome)>;

class AsyncGrader {
 public:
  // Stops the grader: outstanding requests complete as kUngraded ("grader stopped"); an
  // external process is stopped (stdin closed, then SIGTERM, then SIGKILL) and reaped.
  virtual ~AsyncGrader() = default;

  // Queues `sample`; `done` runs exactly once with its outcome. Never blocks on the grader:
  // at most max_in_flight requests are at the grader at once, the rest wait here.
  virtual void Submit(Sample sample, OutcomeCallback done) = 0;
  // Submit() with a future.
  std::future<Outcome> Submit(Sample sample);

  // OK while the grader works; once failed, the error (command or URL, last stderr lines).
  virtual Status status() const = 0;
  virtual GraderCounters counters() const = 0;
  // The command, URL or "builtin: exact_match+numeric": for messages.
  virtual std::string name() const = 0;
};

struct ExternalGraderOptions {
  // Per request, from the moment it is written to the grader (or POSTed).
  std::chrono::milliseconds timeout{30000};
  // Requests at the grader at once (process: lines written and not answered; HTTP: the
  // concurrent POSTs are max_in_flight / max_batch, at least 1).
  size_t max_in_flight = 64;
  // HTTP only: samples per POST; above 1 a POST carries a JSON array when several wait.
  size_t max_batch = 1;
  // Ungraded samples in a row (a crash counts one) beyond which the grader fails.
  int max_grader_failures = 20;
  // Stderr lines kept for messages.
  size_t stderr_lines = 20;
  // How long a stopping process may take to exit after its stdin closed, then after
  // SIGTERM, before it is killed.
  std::chrono::milliseconds stop_grace{2000};
};

// Starts `command` (split into words like a shell splits quotes and backslashes; no
// expansions, pipes or redirections; the first word looked up in PATH) as a long-lived
// grader: stdin/stdout carry the protocol, stderr is kept (last lines). Errors:
// InvalidArgument for an empty or badly quoted command or bad options; NotFound/IOError
// "grader command '<command>' does not start: ..." when it cannot be executed.
Result<std::unique_ptr<AsyncGrader>> StartProcessGrader(const std::string& command,
                                                        const ExternalGraderOptions& options = {});

// A grader at http://HOST:PORT/PATH: each POST carries one request object (or, with
// max_batch > 1, a JSON array of them) and is answered with one answer object or an array
// of answers, in any order. InvalidArgument for a URL that is not http://HOST:PORT[/PATH]
// (https is not supported). Nothing is contacted before the first Submit().
Result<std::unique_ptr<AsyncGrader>> StartHttpGrader(const std::string& url,
                                                     const ExternalGraderOptions& options = {});

// Runs a synchronous grader on `threads` threads of its own behind the AsyncGrader
// interface. REQUIRES: grader != nullptr, threads >= 1.
std::unique_ptr<AsyncGrader> RunAsync(std::shared_ptr<const Grader> grader, std::string name,
                                      size_t threads = 2);

// ---- Built-in graders (docs/GRADERS.md "Built-in graders") ----

// One configured grader of a composition.
struct GraderSpec {
  std::string type;  // exact_match, regex, numeric, contains, json_field, length_penalty
  std::string name;  // metric prefix; defaults to type (a repeated type gets "#2", ...)
  double weight = 1.0;
  nlohmann::json params = nlohmann::json::object();
};

// The specs from a config: a JSON array of {type, weight, params} (params may also be given
// flat, beside type and weight), a JSON object {"graders": [...]}, or TOML-like text:
//
//   [[grader]]
//   type = "numeric"
//   field = "answer"
//   rel_tol = 1e-6
//
// (values are JSON scalars or arrays). InvalidArgument naming the line or entry otherwise.
Result<std::vector<GraderSpec>> ParseGraderConfig(std::string_view text);
Result<std::vector<GraderSpec>> GraderSpecsFromJson(const nlohmann::json& config);

// The weighted sum of the specs' graders: reward = sum(weight * reward); metrics
// "<name>.reward" and "<name>.<metric>" for each, and "reward". Ungraded when any part is.
// InvalidArgument at load for an unknown type, a bad regex, a missing or mistyped parameter,
// an unknown parameter, or no graders, naming the entry ("grader 2 (regex): ...").
Result<std::shared_ptr<const Grader>> LoadBuiltinGraders(const std::vector<GraderSpec>& specs);

// ---- One grader from the run's settings ----

// Exactly one of `command` (--grader), `url` (--grader-url) and `builtin` (the run's
// [[grader]] tables) is set.
struct GraderSettings {
  std::string command;
  std::string url;
  std::vector<GraderSpec> builtin;
  ExternalGraderOptions options;  // command and url
  size_t builtin_threads = 2;     // builtin
};

// Starts the grader the settings name. InvalidArgument when none or more than one is set
// ("give one of --grader, --grader-url and built-in graders"), or as the starter refuses.
Result<std::unique_ptr<AsyncGrader>> StartGrader(const GraderSettings& settings);

}  // namespace flywheel::grading
