// `flywheel train`: the trainer process of a pipeline-RL run (torch-free interface).
//
// It holds the policy (TrainingClient), publishes every new version in process
// (sync::Publisher: the version log, deltas, WAN shaping towards the regions' relays), and
// serves the sample coordinator (pipeline/coordinator.h) on its HTTP endpoint:
//   POST /v1/rollout/claim, POST /v1/rollout/submit   the rollout workers' actors
//   GET /v1/status                                    progress (step, version, accuracy)
//
// The run: optional SFT warm-up (JSONL chat examples) and DPO (preference pairs), then
// version 1 is published and the RL loop runs: take a batch of groups admitted under the
// staleness bound, group advantages (GRPO / DAPO / GSPO / CISPO), one forward_backward with
// truncated importance sampling against the sampler's logprobs (MoE: routing replay of the
// sampled experts), optim_step, save state, publish the next version. Held-out accuracy
// (greedy, exact match, on the served bf16 weights) every eval_every steps; the run ends at
// max_steps, at time_limit_s, or when the accuracy reaches target_accuracy.
//
// One line per step on stdout; <report>/metrics.csv (a row per step) and
// <report>/summary.json at the end. The state directory holds the trainer's state after
// every state_every steps and the publisher's version log: started again on it, the run
// resumes from the last saved step and version.
#pragma once

#include <string>
#include <vector>

#include "base/status.h"
#include "pipeline/run_config.h"
#include "transport/http.h"
#include "transport/tls.h"

namespace flywheel::rl {

struct TrainRunOptions {
  pipeline::RunConfig config;
  std::string state_dir;   // required
  std::string report_dir;  // required
  std::string listen = "127.0.0.1:0";  // the publisher's data port
  std::string http = "127.0.0.1:0";    // coordinator + status
  std::string publisher_http = "127.0.0.1:0";
  std::string ready_file;  // {"listen","http","publisher_http","model_config"} once serving
  std::string token;
  // Further HTTP tokens with their own scopes, on the coordinator and the publisher's HTTP
  // port (transport/http.h: a dashboard's read-only token, ...).
  std::vector<transport::ScopedToken> scoped_tokens;
  // TLS 1.3 on every port of the trainer (the coordinator, the publisher's data and HTTP
  // ports); with a CA, clients must present a certificate it signed.
  transport::TlsOptions tls;
  std::string signing_key;  // the publisher's --signing-key (sync/signing.h)
  bool quiet = false;  // no per-step lines
  // The run's fleet ([fleet]: relays and workers) runs on this machine too (flywheel demo):
  // the memory plan counts it.
  bool local_fleet = false;
};

// Runs until the run ends (or SIGINT/SIGTERM: the state is saved, the run can resume).
Status RunTrainer(const TrainRunOptions& options);

// The model of a run config (preset or config.json) for a tokenizer of `vocab` ids; torch-free.
Result<std::string> ModelConfigJson(const pipeline::RunConfig& config, int64_t vocab);

}  // namespace flywheel::rl
