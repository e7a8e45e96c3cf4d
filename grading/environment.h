// Multi-turn environments (docs/GRADERS.md "Environments"): an external grader may answer a
// completion with {"id", "messages": [...]} (tool results, a user turn) instead of a reward;
// the caller appends them, samples the model again and sends the new completion under the
// same id, until a reward comes or max_turns is reached. EpisodeTracker keeps each
// episode's conversation and turn count and says what to do with each outcome.
//
//   tracker.Begin(id, prompt_messages);
//   loop: completion = model(tracker.Conversation(id));
//         sample = tracker.Turn(id, assistant_message, completion_text, fields);
//         step = tracker.OnOutcome(id, grader.Submit(sample).get());
//         kContinue: loop; otherwise the episode has ended (step.kind says how).
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>

#include "base/status.h"
#include "grading/grader.h"

namespace flywheel::grading {

enum class StepKind {
  kContinue,  // append step.messages (done already in the tracker) and sample again
  kFinished,  // a reward: the episode ended graded
  kGaveUp,    // the environment still wanted more after max_turns model turns: ended ungraded
  kUngraded,  // the grader gave no usable answer: ended ungraded
  kFailed,    // the grader failed for good: ended
  kUnknown,   // no active episode has this id: the outcome was dropped (counted)
};

const char* StepKindName(StepKind kind);

struct EpisodeStep {
  StepKind kind = StepKind::kUnknown;
  Outcome outcome;          // the grader's outcome as it came
  int turns = 0;            // model turns so far in this episode
  std::string reason;       // kGaveUp, kUngraded, kFailed, kUnknown: why
  nlohmann::json messages;  // kContinue: the whole conversation, to sample from
};

struct EpisodeCounters {
  uint64_t started = 0;
  uint64_t finished = 0;  // ended with a reward
  uint64_t gave_up_max_turns = 0;
  uint64_t ungraded = 0;
  uint64_t failed = 0;
  uint64_t unknown_ids = 0;           // outcomes or turns for no active episode: dropped
  uint64_t model_turns = 0;           // over all episodes
  uint64_t environment_messages = 0;  // messages the environment appended
};

class EpisodeTracker {
 public:
  // REQUIRES: max_turns >= 1 (a model turn is one completion).
  explicit EpisodeTracker(int max_turns) : max_turns_(max_turns < 1 ? 1 : max_turns) {}

  int max_turns() const { return max_turns_; }

  // Starts episode `id` from the prompt conversation. InvalidArgument when `id` is already
  // active or `messages` is not an array.
  Status Begin(const std::string& id, nlohmann::json messages);

  // The conversation of an active episode; NotFound otherwise.
  Result<nlohmann::json> Conversation(const std::string& id) const;

  // Records the model's turn: `assistant_message` ({"role": "assistant", "content", maybe
  // "tool_calls"}) is appended, and the Sample to grade is returned (messages: the
  // conversation before this turn; completion: `completion`). NotFound (counted in
  // unknown_ids) for no active episode; InvalidArgument when the episode already has a turn
  // waiting for its outcome.
  Result<Sample> Turn(const std::string& id, nlohmann::json assistant_message,
                      std::string completion, nlohmann::json fields);

  // What the grader said about the episode's last turn; ends the episode unless kContinue.
  EpisodeStep OnOutcome(const std::string& id, Outcome outcome);

  // Ends an episode without an outcome (the caller gives up on it); false when unknown.
  bool Abandon(const std::string& id);

  size_t active() const;
  EpisodeCounters counters() const;

 private:
  struct Episode {
    nlohmann::json messages;
    int turns = 0;
    bool awaiting = false;  // a turn was sent; its outcome has not come
  };

  const int max_turns_;
  mutable std::mutex mu_;
  std::map<std::string, Episode> episodes_;  // GUARDED_BY(mu_)
  EpisodeCounters counters_;                 // GUARDED_BY(mu_)
};

}  // namespace flywheel::grading
