#include "pipeline/coordinator.h"

#include <algorithm>
#include <cmath>
#include <future>
#include <limits>
#include <utility>

#include "tokenizer/answer_parser.h"

namespace flywheel::pipeline {
namespace {

using pipeline::ClaimAnswer;
using pipeline::ClaimRequest;
using pipeline::SubmitAnswer;
using pipeline::SubmitRequest;

}  // namespace

uint64_t Group::oldest_version() const {
  uint64_t oldest = std::numeric_limits<uint64_t>::max();
  for (const Sample& sample : samples) {
    for (uint64_t version : sample.versions) oldest = std::min(oldest, version);
  }
  return oldest == std::numeric_limits<uint64_t>::max() ? 0 : oldest;
}

grading::Sample GradingSample(const Problem& problem, std::string id, std::string completion,
                              int64_t completion_tokens) {
  grading::Sample sample;
  sample.id = std::move(id);
  sample.messages = problem.messages.is_array()
                        ? problem.messages
                        : nlohmann::json::array({{{"role", "user"}, {"content", problem.prompt}}});
  sample.fields = problem.fields.is_object() ? problem.fields
                                             : nlohmann::json{{"answer", problem.answer}};
  sample.completion = std::move(completion);
  sample.completion_tokens = completion_tokens;
  return sample;
}

Coordinator::Coordinator(const Task& task, CoordinatorOptions options)
    : task_(task), options_(std::move(options)), rng_(options_.seed),
      zero_variance_(options_.zero_variance_filter) {
  std::random_device device;
  epoch_ = (static_cast<uint64_t>(device()) << 32) ^ device();
  epoch_ &= 0xffffffffull;  // claim ids stay below 2^53 (exact in any JSON reader)
}

Problem Coordinator::NextProblem() {
  if (!requeued_.empty()) {
    Problem problem = std::move(requeued_.front());
    requeued_.pop_front();
    return problem;
  }
  return task_.Sample(rng_, /*held_out=*/false);
}

void Coordinator::ExpireLeases(Clock::time_point now) {
  for (auto it = leases_.begin(); it != leases_.end();) {
    // A claim whose turn is at the environment is alive; its lease runs again from the turn's end.
    if (it->second.expires <= now && !it->second.turn_in_flight) {
      requeued_.push_back(std::move(it->second.problem));
      ++stats_.leases_expired;
      it = leases_.erase(it);
    } else {
      ++it;
    }
  }
}

Result<ClaimAnswer> Coordinator::Claim(const ClaimRequest& request) {
  const std::string& worker = request.worker;
  const std::string& incarnation = request.incarnation;
  const uint64_t version = request.version;
  const int64_t serving_since = request.serving_since_unix_us;
  if (worker.empty() || request.max_groups < 1) {
    return Status::InvalidArgument("bad claim request: worker must be named and max_groups >= 1");
  }
  std::lock_guard lock(mutex_);
  if (finished_) return ClaimAnswer::Done();
  const Clock::time_point now = options_.env->SteadyNow();
  // A worker back with a new incarnation restarted: what it held goes back to the pool.
  auto [known, inserted] = incarnations_.try_emplace(worker, incarnation);
  if (!inserted && known->second != incarnation) {
    for (auto it = leases_.begin(); it != leases_.end();) {
      if (it->second.worker == worker) {
        requeued_.push_back(std::move(it->second.problem));
        ++stats_.leases_expired;
        it = leases_.erase(it);
      } else {
        ++it;
      }
    }
    known->second = incarnation;
  }
  ExpireLeases(now);
  if (version > 0 && serving_since > 0) {
    auto [view, fresh] = workers_.try_emplace(worker);
    if (fresh) view->second.first_version = version;
    view->second.last_claim = now;
    for (const auto& [published, at] : published_) {
      if (published > version) break;
      if (published > view->second.first_version) view->second.served_since.try_emplace(published, serving_since);
    }
  }
  if (version == 0) return ClaimAnswer::Wait(100, "the worker serves no version yet");
  const int64_t k = options_.max_staleness;
  const uint64_t next = version_ + (in_training_ ? 1 : 0);  // the version the next batch trains at
  if (version > next) {
    // A worker ahead of the trainer (the trainer restarted from an older state): its samples
    // would carry versions the trainer never had.
    return ClaimAnswer::Wait(200, "worker version " + std::to_string(version) + " is ahead of trainer version " +
                         std::to_string(next));
  }
  const int64_t lag = static_cast<int64_t>(next - version);
  const int64_t outstanding = static_cast<int64_t>(queue_.size() + leases_.size() + grading_.size());
  const int64_t allowed = (k - lag + 1) * options_.groups_per_step - outstanding;
  if (allowed <= 0) {
    ++stats_.waits;
    return ClaimAnswer::Wait(lag > k ? 50 : 20,
                lag > k ? "worker version " + std::to_string(version) + " is more than " +
                              std::to_string(k) + " behind trainer version " + std::to_string(next)
                        : "enough groups are out for the staleness bound");
  }
  const int64_t count = std::min(allowed, request.max_groups);
  ClaimAnswer answer = ClaimAnswer::Ok();
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t id = (epoch_ << 20) + next_claim_++;
    Problem problem = NextProblem();
    ClaimedGroup claimed{id, problem.prompt, problem.answer, nullptr};
    if (options_.max_turns > 1) claimed.messages = GradingSample(problem, "", "").messages;
    answer.groups.push_back(std::move(claimed));
    leases_[id] = Lease{std::move(problem), worker, incarnation, now + options_.lease, {}, false};
    ++stats_.claims;
  }
  answer.trainer_version = next;
  answer.group_size = options_.group_size;
  answer.temperature = options_.temperature;
  answer.max_tokens = options_.max_tokens;
  answer.max_turns = options_.max_turns;
  answer.max_episode_tokens = options_.max_episode_tokens;
  return answer;
}

// What the protocol's parser cannot know: whether the samples fit this claim and model.
Status Coordinator::ValidateGroup(const std::vector<Sample>& samples) const {
  if (static_cast<int64_t>(samples.size()) != options_.group_size) {
    return Status::InvalidArgument("samples must be an array of group_size = " +
                                   std::to_string(options_.group_size) + " samples");
  }
  for (size_t i = 0; i < samples.size(); ++i) {
    const Sample& sample = samples[i];
    const std::string where = "sample " + std::to_string(i) + ": ";
    if (sample.prompt_tokens.empty() || sample.tokens.empty() ||
        sample.logprobs.size() != sample.tokens.size() ||
        sample.versions.size() != sample.tokens.size()) {
      return Status::InvalidArgument(where + "empty prompt or tokens, or logprobs/versions of "
                                             "another length than tokens");
    }
    const bool episodes = options_.max_turns > 1;
    if (episodes != !sample.mask.empty() || (episodes && sample.mask.size() != sample.tokens.size())) {
      return Status::InvalidArgument(where + (episodes ? "a multi-turn sample needs a mask as long as its tokens"
                                                       : "a mask is for multi-turn samples only"));
    }
    const int64_t limit = episodes ? options_.max_episode_tokens : options_.max_tokens;
    if (static_cast<int64_t>(sample.tokens.size()) > limit ||
        (options_.max_prompt_tokens > 0 &&
         static_cast<int64_t>(sample.prompt_tokens.size()) > options_.max_prompt_tokens)) {
      return Status::InvalidArgument(where + "longer than the claim allows (" +
                                     std::to_string(sample.prompt_tokens.size()) + " prompt + " +
                                     std::to_string(sample.tokens.size()) + " generated tokens; at most " +
                                     std::to_string(limit) + " generated)");
    }
    for (const auto* ids : {&sample.prompt_tokens, &sample.tokens}) {
      for (int32_t id : *ids) {
        if (id < 0 || id >= options_.vocab_size) {
          return Status::InvalidArgument(where + "token id " + std::to_string(id) +
                                         " outside the vocabulary");
        }
      }
    }
    for (float logprob : sample.logprobs) {
      if (!std::isfinite(logprob) || logprob > 1e-3f) {
        return Status::InvalidArgument(where + "logprob " + std::to_string(logprob) +
                                       " is not a finite log probability");
      }
    }
    if (!std::isfinite(sample.reward)) return Status::InvalidArgument(where + "reward is not finite");
    if (!sample.routing.empty()) {
      const int64_t rows = static_cast<int64_t>(sample.prompt_tokens.size() + sample.tokens.size()) - 1;
      const auto& shape = sample.routing_shape;
      if (shape.size() != 3 || shape[0] != rows || shape[1] != options_.moe_layers || shape[2] != options_.top_k ||
          options_.moe_layers == 0 ||
          shape[0] * shape[1] * shape[2] != static_cast<int64_t>(sample.routing.size())) {
        return Status::InvalidArgument(where + "routing of " + std::to_string(sample.routing.size()) +
                                       " ids does not match routing_shape, the sequence and the "
                                       "model's MoE layers x top_k");
      }
      for (int32_t expert : sample.routing) {
        if (expert < 0 || expert >= options_.num_experts) {
          return Status::InvalidArgument(where + "routing names expert " + std::to_string(expert) +
                                         " of " + std::to_string(options_.num_experts));
        }
      }
    }
  }
  return Status::Ok();
}

SubmitAnswer Coordinator::RefuseAndRequeue(const SubmitRequest& request,
                                           const std::string& reason) {
  ++stats_.submissions_refused;
  if (stats_.last_error_by_worker.size() < 1024 || stats_.last_error_by_worker.count(request.worker) > 0) {
    stats_.last_error_by_worker[request.worker] = reason.substr(0, 200);
  }
  auto lease = leases_.find(request.claim);
  if (lease == leases_.end()) {
    return SubmitAnswer::Refused("claim " + std::to_string(request.claim) +
                                 " is not out (its lease lapsed, it was submitted already, or "
                                 "the trainer restarted); its prompt was handed out again");
  }
  if (lease->second.worker != request.worker || lease->second.incarnation != request.incarnation) {
    return SubmitAnswer::Refused("claim " + std::to_string(request.claim) +
                                 " belongs to another worker");
  }
  // A malformed group returns its prompt to the pool; the claim is closed.
  requeued_.push_back(std::move(lease->second.problem));
  leases_.erase(lease);
  changed_.notify_all();
  return SubmitAnswer::Refused("claim " + std::to_string(request.claim) + ": " + reason);
}

SubmitAnswer Coordinator::Submit(SubmitRequest request) {
  Status valid = ValidateGroup(request.samples);
  std::unique_lock lock(mutex_);
  auto lease = leases_.find(request.claim);
  if (lease == leases_.end() || lease->second.worker != request.worker ||
      lease->second.incarnation != request.incarnation || !valid.ok()) {
    return RefuseAndRequeue(request, valid.message());
  }
  for (const Sample& sample : request.samples) {
    for (uint64_t version : sample.versions) {
      if (version > version_ + 1) {
        return RefuseAndRequeue(request, "token version " + std::to_string(version) +
                                             " is newer than the trainer's " +
                                             std::to_string(version_));
      }
    }
  }
  Group group;
  group.claim = request.claim;
  group.problem = std::move(lease->second.problem);
  group.worker = request.worker;
  group.samples = std::move(request.samples);
  std::vector<Episode> episodes = std::move(lease->second.episodes);
  leases_.erase(lease);
  ++stats_.groups_accepted;
  ++stats_.groups_by_worker[request.worker];
  if (options_.max_turns > 1) {
    // The rewards are the environment's, kept at each episode's last turn.
    std::vector<std::optional<double>> rewards(group.samples.size());
    for (size_t i = 0; i < group.samples.size(); ++i) {
      Sample& sample = group.samples[i];
      if (i < episodes.size() && episodes[i].done) {
        rewards[i] = episodes[i].reward;
        stats_.episode_turns += static_cast<uint64_t>(episodes[i].turns);
      }
      if (rewards[i]) {
        sample.reward = *rewards[i];
        ++stats_.samples_graded;
      } else {
        ++stats_.samples_ungraded;
      }
      ++stats_.episodes;
      for (uint8_t m : sample.mask) ++(m ? stats_.episode_model_tokens : stats_.episode_env_tokens);
    }
    Admit(std::move(group), rewards);
    return SubmitAnswer::Accepted();
  }
  if (options_.grader != nullptr) {
    const uint64_t claim = group.claim;
    Grading& grading = grading_[claim];
    grading.rewards.assign(group.samples.size(), std::nullopt);
    grading.pending = group.samples.size();
    grading.group = std::move(group);
    ++stats_.groups_grading;
    lock.unlock();
    Grade(claim);
    return SubmitAnswer::Accepted();
  }
  if (options_.zero_variance_filter) {
    std::vector<std::optional<double>> rewards;
    for (const Sample& sample : group.samples) rewards.push_back(sample.reward);
    Admit(std::move(group), rewards);
    return SubmitAnswer::Accepted();
  }
  queue_.push_back(std::move(group));
  changed_.notify_all();
  return SubmitAnswer::Accepted();
}

void Coordinator::Grade(uint64_t claim) {
  std::vector<grading::Sample> samples;
  std::vector<std::vector<int32_t>> tokens;
  {
    std::lock_guard lock(mutex_);
    auto it = grading_.find(claim);
    if (it == grading_.end()) return;
    const Group& group = it->second.group;
    for (size_t i = 0; i < group.samples.size(); ++i) {
      samples.push_back(GradingSample(group.problem, std::to_string(claim) + "/" + std::to_string(i), "",
                                      static_cast<int64_t>(group.samples[i].tokens.size())));
      tokens.push_back(group.samples[i].tokens);
    }
  }
  // Decoded outside the lock; the grader's callbacks may run before this returns.
  for (size_t i = 0; i < samples.size(); ++i) {
    Result<std::string> text = options_.decode ? options_.decode(tokens[i])
                                               : Result<std::string>(Status::Internal("no decoder"));
    if (!text.ok()) {
      Graded(claim, i, grading::Outcome::Ungraded("the completion does not decode: " + text.status().message()));
      continue;
    }
    samples[i].completion = std::move(*text);
    options_.grader->Submit(std::move(samples[i]),
                            [this, claim, i](grading::Outcome outcome) { Graded(claim, i, std::move(outcome)); });
  }
}

void Coordinator::Graded(uint64_t claim, size_t index, grading::Outcome outcome) {
  std::lock_guard lock(mutex_);
  auto it = grading_.find(claim);
  if (it == grading_.end() || index >= it->second.rewards.size()) return;
  Grading& grading = it->second;
  switch (outcome.kind) {
    case grading::OutcomeKind::kReward:
      grading.rewards[index] = outcome.reward;
      grading.group.samples[index].reward = outcome.reward;
      ++stats_.samples_graded;
      break;
    case grading::OutcomeKind::kFailed:
      if (failure_.ok()) failure_ = Status::Unavailable(outcome.reason);
      ++stats_.samples_ungraded;
      break;
    default:  // kUngraded; kContinue (an environment's next turn) has no episode here
      ++stats_.samples_ungraded;
      break;
  }
  if (--grading.pending > 0) return;
  Group group = std::move(grading.group);
  std::vector<std::optional<double>> rewards = std::move(grading.rewards);
  grading_.erase(it);
  --stats_.groups_grading;
  Admit(std::move(group), rewards);
}

void Coordinator::Admit(Group group, const std::vector<std::optional<double>>& rewards) {
  const grading::GroupVerdict verdict = zero_variance_.Decide(rewards);
  if (!verdict.keep) {
    ++(verdict.graded < 2 ? stats_.groups_too_few_graded : stats_.groups_zero_variance);
    changed_.notify_all();
    return;
  }
  std::vector<Sample> kept;
  for (size_t i = 0; i < group.samples.size(); ++i) {
    if (rewards[i]) kept.push_back(std::move(group.samples[i]));
  }
  group.samples = std::move(kept);
  queue_.push_back(std::move(group));
  changed_.notify_all();
}

Status Coordinator::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

Result<std::vector<grading::Sample>> Coordinator::BeginTurn(const TurnRequest& request) {
  std::lock_guard lock(mutex_);
  const std::string claim = "claim " + std::to_string(request.claim);
  auto lease = leases_.find(request.claim);
  if (lease == leases_.end() || lease->second.worker != request.worker ||
      lease->second.incarnation != request.incarnation) {
    return Status::InvalidArgument(claim + " is not out to this worker");
  }
  Lease& held = lease->second;
  if (held.turn_in_flight) return Status::InvalidArgument(claim + " has a turn at the environment already");
  if (request.samples.empty() || request.samples.size() > static_cast<size_t>(options_.group_size)) {
    return Status::InvalidArgument("turn of " + claim + ": 1.." + std::to_string(options_.group_size) +
                                   " samples, one per live episode");
  }
  if (held.episodes.empty()) {
    const nlohmann::json prompt = GradingSample(held.problem, "", "").messages;
    held.episodes.assign(static_cast<size_t>(options_.group_size), Episode{prompt, 0, false, std::nullopt});
  }
  std::vector<bool> seen(held.episodes.size(), false);
  std::vector<grading::Sample> samples;
  for (const TurnRequest::Item& item : request.samples) {
    const std::string sample = "turn of " + claim + ": sample " + std::to_string(item.index);
    if (item.index < 0 || item.index >= static_cast<int64_t>(held.episodes.size()) || held.episodes[item.index].done)
      return Status::InvalidArgument(sample + " is out of range or its episode is over");
    if (seen[item.index]) return Status::InvalidArgument(sample + " twice");
    seen[item.index] = true;
    if (static_cast<int64_t>(item.tokens.size()) > options_.max_tokens)
      return Status::InvalidArgument(sample + " has more than max_tokens tokens");
    for (int32_t id : item.tokens) {
      if (id < 0 || id >= options_.vocab_size) return Status::InvalidArgument(sample + ": token id outside the vocabulary");
    }
    samples.push_back(GradingSample(held.problem, std::to_string(request.claim) + "/" + std::to_string(item.index), "",
                                    static_cast<int64_t>(item.tokens.size())));
    samples.back().messages = held.episodes[item.index].conversation;
  }
  held.turn_in_flight = true;
  held.expires = options_.env->SteadyNow() + options_.lease;
  return samples;
}

std::vector<Coordinator::TurnResult> Coordinator::AskEnvironment(const TurnRequest& request,
                                                                 std::vector<grading::Sample> samples) {
  std::vector<std::future<grading::Outcome>> futures;
  std::vector<TurnResult> results(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    Result<std::string> text = options_.decode ? options_.decode(request.samples[i].tokens)
                                               : Result<std::string>(Status::Internal("no decoder"));
    if (text.ok()) {
      results[i].text = *text;
      // Tool calls parsed as the serving layer parses them; ids unique in the episode.
      results[i].message = tokenizer::AssistantMessage(
          *text, "call_" + samples[i].id + "_" + std::to_string(samples[i].messages.size()));
      samples[i].message = results[i].message;
      samples[i].completion = std::move(*text);
      futures.push_back(options_.grader->Submit(std::move(samples[i])));
    } else {
      std::promise<grading::Outcome> undecodable;
      undecodable.set_value(grading::Outcome::Ungraded("the completion does not decode: " + text.status().message()));
      futures.push_back(undecodable.get_future());
    }
  }
  // Each bounded by the grader's per-call timeout.
  for (size_t i = 0; i < futures.size(); ++i) results[i].outcome = futures[i].get();
  return results;
}

Result<std::string> Coordinator::FinishTurn(const TurnRequest& request, std::vector<TurnResult> results) {
  std::lock_guard lock(mutex_);
  auto lease = leases_.find(request.claim);
  if (lease == leases_.end()) {
    return Status::InvalidArgument("claim " + std::to_string(request.claim) + " lapsed while its turn was graded");
  }
  TurnAnswer answer;
  for (size_t i = 0; i < results.size(); ++i) {
    Episode& episode = lease->second.episodes[request.samples[i].index];
    grading::Outcome& outcome = results[i].outcome;
    ++episode.turns;
    episode.conversation.push_back(results[i].message.is_null()
                                       ? nlohmann::json{{"role", "assistant"}, {"content", results[i].text}}
                                       : results[i].message);
    TurnOutcome out;
    out.index = request.samples[i].index;
    if (outcome.kind == grading::OutcomeKind::kContinue && episode.turns >= options_.max_turns) {
      ++stats_.episodes_max_turns;
      outcome = grading::Outcome::Ungraded("the episode is still going after max_turns = " +
                                           std::to_string(options_.max_turns));
    }
    if (outcome.kind == grading::OutcomeKind::kReward) {
      episode.done = true;
      episode.reward = outcome.reward;
      out.kind = "reward";
      out.reward = outcome.reward;
    } else if (outcome.kind == grading::OutcomeKind::kContinue) {
      for (const nlohmann::json& message : outcome.messages) episode.conversation.push_back(message);
      out.kind = "continue";
      out.messages = outcome.messages;
    } else {  // ungraded, or the grader failed for good
      if (outcome.kind == grading::OutcomeKind::kFailed && failure_.ok()) failure_ = Status::Unavailable(outcome.reason);
      episode.done = true;
      out.kind = "ungraded";
      out.reason = outcome.reason;
    }
    answer.samples.push_back(std::move(out));
  }
  if (!failure_.ok()) changed_.notify_all();
  return ToJson(answer);
}

Result<std::string> Coordinator::HandleTurn(std::string_view body) {
  if (options_.max_turns <= 1 || options_.grader == nullptr) {
    return Status::InvalidArgument("this run has no multi-turn environment (grading.max_turns = 1)");
  }
  Result<TurnRequest> request = ParseTurnRequest(body);
  if (!request.ok()) return Status::InvalidArgument("bad " + request.status().message());
  FW_ASSIGN_OR_RETURN(std::vector<grading::Sample> samples, BeginTurn(*request));
  // Whatever happens below, the claim takes turns again afterwards, its lease renewed.
  struct TurnDone {
    Coordinator* self;
    uint64_t claim;
    ~TurnDone() {
      std::lock_guard lock(self->mutex_);
      auto lease = self->leases_.find(claim);
      if (lease == self->leases_.end()) return;
      lease->second.turn_in_flight = false;
      lease->second.expires = self->options_.env->SteadyNow() + self->options_.lease;
    }
  } turn_done{this, request->claim};
  // Decoded and graded outside the lock.
  std::vector<TurnResult> results = AskEnvironment(*request, std::move(samples));
  return FinishTurn(*request, std::move(results));
}

Result<std::string> Coordinator::HandleClaim(std::string_view body) {
  Result<ClaimRequest> request = pipeline::ParseClaimRequest(body);
  if (!request.ok()) return Status::InvalidArgument("bad " + request.status().message());
  FW_ASSIGN_OR_RETURN(ClaimAnswer answer, Claim(*request));
  return ToJson(answer);
}

std::string Coordinator::HandleSubmit(std::string_view body) {
  Result<SubmitRequest> request = pipeline::ParseSubmitRequest(body);
  if (request.ok()) return ToJson(Submit(std::move(*request)));
  Result<SubmitRequest> header = pipeline::ParseSubmitHeader(body);
  std::lock_guard lock(mutex_);
  if (!header.ok()) {
    ++stats_.submissions_refused;
    return ToJson(SubmitAnswer::Refused("bad " + request.status().message()));
  }
  return ToJson(RefuseAndRequeue(*header, request.status().message()));
}

void Coordinator::SetVersion(uint64_t version) {
  std::lock_guard lock(mutex_);
  version_ = version;
  in_training_ = false;
  changed_.notify_all();
}

std::vector<Group> Coordinator::TakeBatch(Clock::time_point deadline, bool partial) {
  std::unique_lock lock(mutex_);
  const size_t want = static_cast<size_t>(options_.groups_per_step);
  for (;;) {
    // Admission: a group too stale for the current version is dropped, its prompt requeued.
    for (auto it = queue_.begin(); it != queue_.end();) {
      const uint64_t oldest = it->oldest_version();
      if (version_ > oldest && version_ - oldest > static_cast<uint64_t>(options_.max_staleness)) {
        stats_.samples_dropped_stale += it->samples.size();
        ++stats_.groups_dropped_stale;
        requeued_.push_back(std::move(it->problem));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    if (!failure_.ok()) return {};
    const Clock::time_point now = options_.env->SteadyNow();
    const bool timed_out = now >= deadline;
    if (queue_.size() >= want || finished_ || (timed_out && partial && !queue_.empty())) break;
    if (timed_out) return {};
    ExpireLeases(now);
    // Wakes at least every 100 ms (of the env's clock) to expire leases meanwhile.
    options_.env->WaitUntil(changed_, lock, std::min(deadline, now + std::chrono::milliseconds(100)));
  }
  std::vector<Group> batch;
  while (!queue_.empty() && batch.size() < want) {
    batch.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  stats_.groups_trained += batch.size();
  if (!batch.empty()) in_training_ = true;
  return batch;
}

void Coordinator::Finish() {
  std::lock_guard lock(mutex_);
  finished_ = true;
  changed_.notify_all();
}

void Coordinator::NotePublished(uint64_t version, int64_t unix_us) {
  std::lock_guard lock(mutex_);
  published_[version] = unix_us;
}

std::vector<Coordinator::Synced> Coordinator::TakeSynced() {
  std::lock_guard lock(mutex_);
  const Clock::time_point now = options_.env->SteadyNow();
  std::vector<Synced> out;
  for (auto it = published_.begin(); it != published_.end();) {
    const auto [version, at] = *it;
    int64_t last = at;
    size_t live = 0;
    bool complete = true;
    for (auto& [name, view] : workers_) {
      if (now - view.last_claim > std::chrono::seconds(5)) continue;
      ++live;
      if (version <= view.first_version) continue;
      auto served = view.served_since.find(version);
      if (served == view.served_since.end()) {
        complete = false;
        break;
      }
      last = std::max(last, served->second);
    }
    if (!complete || live == 0) break;
    out.push_back({version, (last - at) / 1000.0, live});
    for (auto& [name, view] : workers_) view.served_since.erase(version);
    it = published_.erase(it);
  }
  return out;
}

CoordinatorStats Coordinator::stats() const {
  std::lock_guard lock(mutex_);
  CoordinatorStats stats = stats_;
  for (const auto& [claim, lease] : leases_) ++stats.leases_by_worker[lease.worker];
  return stats;
}

size_t Coordinator::queued() const {
  std::lock_guard lock(mutex_);
  return queue_.size();
}

}  // namespace flywheel::pipeline
