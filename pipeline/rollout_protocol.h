// The rollout protocol between the trainer's sample coordinator (pipeline/coordinator.h) and
// the rollout workers' actors (rollout/actor.h): typed messages, one JSON rendering and one
// parser each, shared by both sides so that neither builds or reads the JSON by hand.
//
//   POST /v1/rollout/claim   ClaimRequest  -> ClaimAnswer
//   POST /v1/rollout/submit  SubmitRequest -> SubmitAnswer
//
// On the wire (JSON, unchanged from the hand-built version):
//   ClaimRequest  {"worker", "incarnation", "version", "serving_since_unix_us", "max_groups"}
//   ClaimAnswer   {"status": "ok", "trainer_version", "groups": [{"claim", "prompt",
//                 "answer"}], "group_size", "temperature", "max_tokens"}
//                 | {"status": "wait", "retry_ms", "reason"} | {"status": "done"}
//   SubmitRequest {"worker", "incarnation", "claim", "samples": [{"prompt_tokens",
//                 "tokens", "logprobs", "versions", "reward", "routing"?,
//                 "routing_shape"?: [rows, layers, top_k]}]}
//   SubmitAnswer  {"accepted": true} | {"accepted": false, "reason"}
//
// Multi-turn environments (grading.max_turns > 1): a claim's groups also carry "messages"
// (the prompt conversation) and the answer "max_turns"; after each turn the worker sends
//   POST /v1/rollout/turn   TurnRequest {"worker", "incarnation", "claim", "samples":
//                           [{"index", "tokens"}]}  (this turn's tokens of each live episode)
//                           -> TurnAnswer {"samples": [{"index", "kind": "reward"|"continue"|
//                           "ungraded", "reward"?, "messages"?, "reason"?}]}
// and continues the episodes answered "continue" with the messages appended; its
// submission's samples then carry "mask" (per token: 1 sampled by the model, 0 written by
// the environment), and their rewards are the environment's, kept by the trainer.
//
// A claim request that does not parse is no ClaimAnswer: the trainer answers it as every
// flywheel API answers an error, HTTP 400 {"error": {"code": "bad_request", "message"}}
// (transport/api.h). A refused submission is an answer (accepted false, with the reason).
//
// The parsers check structure and types (a field missing, of the wrong type, a negative
// version, a token id that is not an int32) and name what was wrong; whether a submission
// fits the claim and the model (group size, vocabulary, lengths, routing shape) is the
// coordinator's to check. Claim ids stay below 2^53 so that any JSON reader keeps them exact.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel::pipeline {

struct ClaimRequest {
  std::string worker;       // required, non-empty
  std::string incarnation;  // changes when the worker restarts
  uint64_t version = 0;     // the policy version the worker serves (0: none yet)
  int64_t serving_since_unix_us = 0;  // when it began serving it (wall clock); 0: unknown
  int64_t max_groups = 1;             // >= 1
};

struct ClaimedGroup {
  uint64_t claim = 0;
  std::string prompt;
  std::string answer;
  nlohmann::json messages;  // multi-turn: the prompt conversation (an array); else null
};

struct ClaimAnswer {
  enum class Kind { kOk, kWait, kDone };
  Kind kind = Kind::kOk;
  // kOk
  uint64_t trainer_version = 0;
  std::vector<ClaimedGroup> groups;
  int64_t group_size = 1;
  double temperature = 1.0;
  int64_t max_tokens = 16;  // per turn
  int64_t max_turns = 1;    // > 1: episodes with an environment (above)
  int64_t max_episode_tokens = 0;  // multi-turn: model + environment tokens of an episode
  // kWait
  int64_t retry_ms = 50;
  // kWait
  std::string reason;

  static ClaimAnswer Ok() { return Of(Kind::kOk); }
  static ClaimAnswer Wait(int64_t retry_ms, std::string reason) {
    ClaimAnswer a = Of(Kind::kWait);
    a.retry_ms = retry_ms;
    a.reason = std::move(reason);
    return a;
  }
  static ClaimAnswer Done() { return Of(Kind::kDone); }

 private:
  static ClaimAnswer Of(Kind kind) {
    ClaimAnswer a;
    a.kind = kind;
    return a;
  }
};

// One scored completion of a claimed prompt.
struct RolloutSample {
  std::vector<int32_t> prompt_tokens;
  std::vector<int32_t> tokens;     // generated
  std::vector<float> logprobs;     // per generated token, as sampled
  std::vector<uint64_t> versions;  // per generated token: the policy version that sampled it
  std::vector<int32_t> routing;    // rows x layers x top_k, token-major (MoE), else empty
  std::vector<int64_t> routing_shape;  // {rows, layers, top_k} when routing is set
  double reward = 0;
  // Multi-turn: per token, 1 when the model sampled it, 0 when the environment wrote it
  // (its logprob 0, its version the one before); empty: every token is the model's.
  std::vector<uint8_t> mask;
};

// One turn of a claim's live episodes.
struct TurnRequest {
  std::string worker;
  std::string incarnation;
  uint64_t claim = 0;
  struct Item {
    int64_t index = 0;            // the sample of the group
    std::vector<int32_t> tokens;  // this turn's generated tokens
  };
  std::vector<Item> samples;
};

struct TurnOutcome {
  int64_t index = 0;
  std::string kind;         // "reward", "continue", "ungraded"
  double reward = 0;        // reward
  nlohmann::json messages;  // continue: the messages to append
  std::string reason;       // ungraded
};

struct TurnAnswer {
  std::vector<TurnOutcome> samples;
};

struct SubmitRequest {
  std::string worker;
  std::string incarnation;
  uint64_t claim = 0;
  std::vector<RolloutSample> samples;
};

struct SubmitAnswer {
  bool accepted = false;
  std::string reason;  // when refused

  static SubmitAnswer Accepted() { return {true, ""}; }
  static SubmitAnswer Refused(std::string reason) { return {false, std::move(reason)}; }
};

std::string ToJson(const ClaimRequest& request);
std::string ToJson(const ClaimAnswer& answer);
std::string ToJson(const SubmitRequest& request);
std::string ToJson(const SubmitAnswer& answer);
std::string ToJson(const TurnRequest& request);
std::string ToJson(const TurnAnswer& answer);

// Each fails with InvalidArgument naming the field that is missing or wrong.
Result<ClaimRequest> ParseClaimRequest(std::string_view body);
Result<ClaimAnswer> ParseClaimAnswer(std::string_view body);
Result<SubmitRequest> ParseSubmitRequest(std::string_view body);
Result<SubmitAnswer> ParseSubmitAnswer(std::string_view body);
Result<TurnRequest> ParseTurnRequest(std::string_view body);
Result<TurnAnswer> ParseTurnAnswer(std::string_view body);

// Only the submission's worker, incarnation and claim (samples left empty): what a receiver
// needs to close the claim of a submission whose samples do not parse.
Result<SubmitRequest> ParseSubmitHeader(std::string_view body);

}  // namespace flywheel::pipeline
