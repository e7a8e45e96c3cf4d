#include "grading/environment.h"

#include <algorithm>

#include "grading/zero_variance.h"

namespace flywheel::grading {

const char* StepKindName(StepKind kind) {
  switch (kind) {
    case StepKind::kContinue:
      return "continue";
    case StepKind::kFinished:
      return "finished";
    case StepKind::kGaveUp:
      return "gave_up";
    case StepKind::kUngraded:
      return "ungraded";
    case StepKind::kFailed:
      return "failed";
    case StepKind::kUnknown:
      return "unknown";
  }
  return "unknown";
}

Status EpisodeTracker::Begin(const std::string& id, nlohmann::json messages) {
  if (!messages.is_array())
    return Status::InvalidArgument("episode '" + id + "': messages is not an array");
  std::lock_guard lock(mu_);
  if (episodes_.count(id)) return Status::InvalidArgument("episode '" + id + "' is already active");
  episodes_.emplace(id, Episode{std::move(messages)});
  ++counters_.started;
  return Status::Ok();
}

Result<nlohmann::json> EpisodeTracker::Conversation(const std::string& id) const {
  std::lock_guard lock(mu_);
  auto found = episodes_.find(id);
  if (found == episodes_.end()) return Status::NotFound("no active episode '" + id + "'");
  return found->second.messages;
}

Result<Sample> EpisodeTracker::Turn(const std::string& id, nlohmann::json assistant_message,
                                    std::string completion, nlohmann::json fields) {
  std::lock_guard lock(mu_);
  auto found = episodes_.find(id);
  if (found == episodes_.end()) {
    ++counters_.unknown_ids;
    return Status::NotFound("no active episode '" + id + "'");
  }
  Episode& episode = found->second;
  if (episode.awaiting) {
    return Status::InvalidArgument("episode '" + id +
                                   "' already has a turn waiting for its outcome");
  }
  Sample sample;
  sample.id = id;
  sample.messages = episode.messages;
  sample.completion = std::move(completion);
  sample.fields = std::move(fields);
  episode.messages.push_back(std::move(assistant_message));
  ++episode.turns;
  ++counters_.model_turns;
  episode.awaiting = true;
  return sample;
}

EpisodeStep EpisodeTracker::OnOutcome(const std::string& id, Outcome outcome) {
  EpisodeStep step;
  std::lock_guard lock(mu_);
  auto found = episodes_.find(id);
  if (found == episodes_.end() || !found->second.awaiting) {
    ++counters_.unknown_ids;
    step.kind = StepKind::kUnknown;
    step.reason = found == episodes_.end()
                      ? "no active episode '" + id + "'"
                      : "episode '" + id + "' has no turn waiting for an outcome";
    step.outcome = std::move(outcome);
    return step;
  }
  Episode& episode = found->second;
  episode.awaiting = false;
  step.turns = episode.turns;
  switch (outcome.kind) {
    case OutcomeKind::kReward:
      step.kind = StepKind::kFinished;
      ++counters_.finished;
      break;
    case OutcomeKind::kContinue:
      if (episode.turns >= max_turns_) {
        step.kind = StepKind::kGaveUp;
        step.reason = "max_turns (" + std::to_string(max_turns_) + ") reached without a reward";
        ++counters_.gave_up_max_turns;
        break;
      }
      step.kind = StepKind::kContinue;
      for (const nlohmann::json& message : outcome.messages) episode.messages.push_back(message);
      counters_.environment_messages += outcome.messages.size();
      step.messages = episode.messages;
      break;
    case OutcomeKind::kUngraded:
      step.kind = StepKind::kUngraded;
      step.reason = outcome.reason;
      ++counters_.ungraded;
      break;
    case OutcomeKind::kFailed:
      step.kind = StepKind::kFailed;
      step.reason = outcome.reason;
      ++counters_.failed;
      break;
  }
  step.outcome = std::move(outcome);
  if (step.kind != StepKind::kContinue) episodes_.erase(found);
  return step;
}

bool EpisodeTracker::Abandon(const std::string& id) {
  std::lock_guard lock(mu_);
  return episodes_.erase(id) > 0;
}

size_t EpisodeTracker::active() const {
  std::lock_guard lock(mu_);
  return episodes_.size();
}

EpisodeCounters EpisodeTracker::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

GroupVerdict ZeroVarianceFilter::Decide(std::span<const std::optional<double>> rewards) {
  GroupVerdict verdict;
  double low = 0;
  double high = 0;
  for (const std::optional<double>& reward : rewards) {
    if (!reward) {
      ++verdict.ungraded;
      continue;
    }
    low = verdict.graded == 0 ? *reward : std::min(low, *reward);
    high = verdict.graded == 0 ? *reward : std::max(high, *reward);
    ++verdict.graded;
  }
  std::lock_guard lock(mu_);
  ++counters_.groups;
  counters_.ungraded_samples += verdict.ungraded;
  if (verdict.graded < 2) {
    verdict.reason = "fewer than 2 graded samples";
    ++counters_.dropped_too_few_graded;
  } else if (enabled_ && high - low <= tolerance_) {
    verdict.reason = "zero variance";
    ++counters_.dropped_zero_variance;
  } else {
    verdict.keep = true;
    ++counters_.kept;
  }
  return verdict;
}

ZeroVarianceCounters ZeroVarianceFilter::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

}  // namespace flywheel::grading
