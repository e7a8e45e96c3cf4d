// The rollout worker's side of the pipeline-RL loop (pipeline/coordinator.h has the
// protocol): a thread that claims prompts from the trainer, samples a group per prompt with
// the worker's engine (whatever version it serves; a swap mid-group tags the tokens it
// affects) and submits the group with its tokens, sampling logprobs, per-token versions and
// MoE routing. The reward it sends (exact match against the claim's answer) is a hint only:
// the trainer grades every completion itself with the run's grader (pipeline/coordinator.h).
//
// The trainer may be away (restarting): the actor retries every half second and goes on
// when it answers. A restarted worker comes back with a new incarnation, so the trainer
// hands its old claims to others.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "base/status.h"
#include "transport/endpoint.h"
#include "transport/http.h"
#include "pipeline/rollout_protocol.h"

namespace flywheel::tokenizer {
class Tokenizer;
class ChatTemplate;
}  // namespace flywheel::tokenizer
namespace flywheel::model {
using tokenizer::Tokenizer;
}  // namespace flywheel::model

namespace flywheel::rollout {

class CompletionService;

struct ActorOptions {
  transport::Endpoint trainer;  // the trainer's HTTP endpoint
  std::string token;            // bearer token for it
  // A TLS trainer (https): the client context that verifies it (and presents this worker's
  // certificate for mutual authentication); null: plain HTTP.
  std::shared_ptr<transport::asio::ssl::context> tls;
  std::string worker_id;
  int64_t max_groups = 8;  // groups claimed at once
};

struct ActorStats {
  std::atomic<uint64_t> groups_submitted{0};
  std::atomic<uint64_t> groups_refused{0};
  std::atomic<uint64_t> samples{0};
  std::atomic<uint64_t> trainer_unreachable{0};
};

class Actor {
 public:
  // `service` returns the worker's completion service, or null before it serves a version.
  Actor(ActorOptions options, std::function<std::shared_ptr<CompletionService>()> service,
        std::shared_ptr<const model::Tokenizer> tokenizer);
  ~Actor();  // stops the thread

  const ActorStats& stats() const { return stats_; }

 private:
  void Run();
  // One claim and its groups: how long to wait before the next claim, or Unavailable when
  // the trainer cannot be reached or answers what the protocol does not allow (the actor
  // then retries every half second). A generation that fails is not an error of the
  // round: its claims lapse and go to other workers.
  Result<std::chrono::milliseconds> Round(CompletionService& service);
  Result<pipeline::ClaimAnswer> PostClaim(CompletionService& service);
  // Samples group_size completions per claimed prompt (all in one Generate call), or an
  // empty vector when generation failed.
  std::vector<pipeline::SubmitRequest> Sample(CompletionService& service,
                                               const pipeline::ClaimAnswer& claim);
  // Multi-turn (claim.max_turns > 1): every sample is an episode; after each turn the
  // trainer's POST /v1/rollout/turn says reward, ungraded, or the environment's messages,
  // which the chat template renders onto the sequence (masked out of the loss).
  std::vector<pipeline::SubmitRequest> SampleEpisodes(CompletionService& service,
                                                       const pipeline::ClaimAnswer& claim);
  // SampleEpisodes' parts: one episode per sample of each claimed group (and its
  // submission); one turn of every live episode sampled, as the turn requests to post (one
  // per submission); a turn posted and its outcomes applied; an episode continued with the
  // environment's messages.
  struct Episode;
  std::vector<Episode> BeginEpisodes(const pipeline::ClaimAnswer& claim,
                                     std::vector<pipeline::SubmitRequest>& submissions);
  Result<std::vector<pipeline::TurnRequest>> SampleTurn(CompletionService& service, const pipeline::ClaimAnswer& claim,
                                                        size_t submissions, std::vector<Episode>& episodes);
  void PostTurn(const pipeline::TurnRequest& turn, size_t submission, const pipeline::ClaimAnswer& claim,
                std::vector<Episode>& episodes);
  void ContinueEpisode(Episode& episode, const pipeline::TurnOutcome& outcome, const pipeline::ClaimAnswer& claim,
                       uint64_t claim_id);
  // The text the environment's messages add after `so_far` (the sequence as text so far):
  // the conversation re-rendered by the chat template with a generation prompt, past
  // `so_far`; without a template, the messages' contents. NotFound when the template does
  // not render the conversation so far as a prefix (the episode then ends).
  Result<std::string> Continuation(const nlohmann::json& conversation, const nlohmann::json& added,
                                   const std::string& so_far) const;
  Status PostSubmit(const pipeline::SubmitRequest& submission);
  transport::HttpGetOptions HttpOptions() const;

  ActorOptions options_;
  std::function<std::shared_ptr<CompletionService>()> service_;
  std::shared_ptr<const model::Tokenizer> tokenizer_;
  std::shared_ptr<const tokenizer::ChatTemplate> chat_;  // the tokenizer's, if it has one
  std::string bos_text_, eos_text_;
  std::string incarnation_;
  ActorStats stats_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace flywheel::rollout
