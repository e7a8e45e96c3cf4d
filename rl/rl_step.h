// One RL step: the groups the coordinator admitted -> datums with group advantages -> one
// forward_backward and one optim_step -> the step's numbers in a StepRow.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "pipeline/coordinator.h"
#include "pipeline/run_config.h"
#include "pipeline/run_record.h"
#include "trainer/losses.h"
#include "trainer/training_client.h"

namespace flywheel::rl {

// The loss and optimizer an algorithm trains with (config.algorithm):
//   grpo  "ppo" loss, sequence-mean of token-means;  dapo  "ppo", token mean, and groups
//   whose rewards are all equal are dropped;  gspo  "gspo";  cispo  "cispo", token mean.
// Clipping, the TIS cap, lr, weight decay and gradient clipping come from the config.
struct LossSetup {
  std::string loss_name = "ppo";
  trainer::LossConfig loss;
  trainer::AdamWParams adam;
  bool drop_all_equal = false;  // DAPO dynamic sampling
};
LossSetup MakeLossSetup(const pipeline::RunConfig& config);

struct BatchOptions {
  size_t group_size = 0;        // samples per group, as the coordinator collects them
  bool drop_all_equal = false;  // LossSetup::drop_all_equal
  bool routing_replay = false;  // MoE: train on the sampled experts (Sample::routing)
};

// The datums of one step and what the report says about the samples.
struct StepBatch {
  std::vector<trainer::Datum> datums;  // kept samples only (DAPO drops some)
  uint64_t samples = 0;                // every sample, dropped ones included
  double mean_reward = 0;              // over every sample
  // Trainer version - sampling version, over every generated token of every sample.
  double staleness_mean = 0;
  uint64_t staleness_max = 0;
};

// Turns one sample into a datum: tokens = prompt + answer shifted by one, loss weight 1
// and the sampler's logprob and version on the answer tokens only, the advantage on every
// position. REQUIRES: sample.prompt_tokens non-empty; logprobs and versions as long as
// tokens (the coordinator checks submissions for this).
trainer::Datum SampleToDatum(const pipeline::Sample& sample, double advantage, bool keep_routing);

// Group advantages over the rewards (in group order), datums of the kept samples, and the
// batch's reward and staleness numbers. A group may hold fewer than options.group_size
// samples (the coordinator leaves ungraded ones out): its advantages are over what it has.
// Fails (InvalidArgument) for a group of one sample or of more than group_size.
Result<StepBatch> MakeStepBatch(const std::vector<pipeline::Group>& groups,
                                uint64_t trainer_version, const BatchOptions& options);

// One forward_backward (setup.loss_name) and one optim_step over batch.datums, then fills
// row->loss, k3, clip_fraction and grad_norm. An empty batch (DAPO dropped every group)
// trains nothing and leaves them 0. Errors name the call that failed and the step.
Status TrainStep(trainer::TrainingClient& client, const StepBatch& batch, const LossSetup& setup,
                 pipeline::StepRow* row);

}  // namespace flywheel::rl
