#include "rl/rl_step.h"

#include <algorithm>

namespace flywheel::rl {

LossSetup MakeLossSetup(const pipeline::RunConfig& config) {
  LossSetup setup;
  const std::string& algorithm = config.algorithm.name;
  setup.drop_all_equal = algorithm == "dapo";
  setup.loss.aggregation = trainer::Aggregation::kSeqMeanTokenMean;
  if (algorithm == "dapo") setup.loss.aggregation = trainer::Aggregation::kTokenMean;
  if (algorithm == "gspo") setup.loss_name = "gspo";
  if (algorithm == "cispo") {
    setup.loss_name = "cispo";
    setup.loss.aggregation = trainer::Aggregation::kTokenMean;
  }
  setup.loss.clip_low = config.algorithm.clip_low;
  setup.loss.clip_high = config.algorithm.clip_high;
  setup.loss.tis_cap = config.algorithm.tis_cap;
  setup.loss.kl_coef = config.algorithm.kl_coef;
  setup.adam.lr = config.algorithm.lr;
  setup.adam.weight_decay = config.algorithm.weight_decay;
  setup.adam.grad_clip = config.algorithm.grad_clip;
  return setup;
}

trainer::Datum SampleToDatum(const pipeline::Sample& sample, double advantage, bool keep_routing) {
  std::vector<int32_t> full = sample.prompt_tokens;
  full.insert(full.end(), sample.tokens.begin(), sample.tokens.end());
  const size_t length = full.size() - 1;
  // Position p predicts full[p + 1]: the first answer token is predicted at the prompt's last.
  const size_t first = sample.prompt_tokens.size() - 1;
  trainer::Datum d;
  d.tokens.assign(full.begin(), full.end() - 1);
  d.target_tokens.assign(full.begin() + 1, full.end());
  d.weights.assign(length, 0.0f);
  d.logprobs.assign(length, 0.0f);
  d.advantages.assign(length, static_cast<float>(advantage));
  d.policy_versions.assign(length, sample.versions.empty() ? 0 : sample.versions.front());
  for (size_t j = 0; j < sample.tokens.size(); ++j) {
    // An environment's tokens (multi-turn, mask 0) are context, not the model's to learn.
    d.weights[first + j] = sample.mask.empty() || sample.mask[j] ? 1.0f : 0.0f;
    d.logprobs[first + j] = sample.logprobs[j];
    d.policy_versions[first + j] = sample.versions[j];
  }
  if (keep_routing && !sample.routing.empty()) d.routing = sample.routing;
  return d;
}

Result<StepBatch> MakeStepBatch(const std::vector<pipeline::Group>& groups,
                                uint64_t trainer_version, const BatchOptions& options) {
  // Per group: a group may hold fewer than group_size samples (its ungraded ones left out
  // by the coordinator), so each is normalised over the samples it has.
  std::vector<double> rewards;
  trainer::GroupAdvantages advantages;
  trainer::GroupAdvantageOptions advantage_options;
  advantage_options.drop_all_equal = options.drop_all_equal;
  for (const auto& g : groups) {
    std::vector<double> group_rewards;
    for (const auto& s : g.samples) group_rewards.push_back(s.reward);
    if (group_rewards.empty()) continue;
    if (options.group_size > 0 && group_rewards.size() > options.group_size) {
      return Status::InvalidArgument("a group of " + std::to_string(group_rewards.size()) +
                                     " samples, more than group_size = " + std::to_string(options.group_size));
    }
    rewards.insert(rewards.end(), group_rewards.begin(), group_rewards.end());
    FW_ASSIGN_OR_RETURN(trainer::GroupAdvantages part,
                        trainer::ComputeGroupAdvantages(group_rewards, group_rewards.size(), advantage_options));
    advantages.advantages.insert(advantages.advantages.end(), part.advantages.begin(), part.advantages.end());
    advantages.keep.insert(advantages.keep.end(), part.keep.begin(), part.keep.end());
    advantages.dropped_groups += part.dropped_groups;
  }
  StepBatch batch;
  double staleness_sum = 0;
  uint64_t staleness_tokens = 0;
  size_t index = 0;
  for (const auto& g : groups) {
    for (const auto& s : g.samples) {
      const size_t i = index++;
      for (uint64_t v : s.versions) {
        const uint64_t lag = trainer_version > v ? trainer_version - v : 0;
        staleness_sum += static_cast<double>(lag);
        batch.staleness_max = std::max(batch.staleness_max, lag);
        ++staleness_tokens;
      }
      if (!advantages.keep[i]) continue;
      batch.datums.push_back(SampleToDatum(s, advantages.advantages[i], options.routing_replay));
    }
  }
  batch.samples = rewards.size();
  double reward_sum = 0;
  for (double r : rewards) reward_sum += r;
  batch.mean_reward = rewards.empty() ? 0 : reward_sum / static_cast<double>(rewards.size());
  batch.staleness_mean = staleness_tokens ? staleness_sum / static_cast<double>(staleness_tokens) : 0;
  return batch;
}

Status TrainStep(trainer::TrainingClient& client, const StepBatch& batch, const LossSetup& setup,
                 pipeline::StepRow* row) {
  if (batch.datums.empty()) return Status::Ok();
  Result<trainer::Metrics> fb = client.ForwardBackward(batch.datums, setup.loss_name, setup.loss);
  if (!fb.ok()) return fb.status().WithContext("forward_backward at step " + std::to_string(row->step));
  row->loss = fb->loss;
  row->k3 = fb->kl_sampler_k3;
  row->clip_fraction = fb->clip_fraction;
  Result<trainer::Metrics> step = client.OptimStep(setup.adam);
  if (!step.ok()) return step.status().WithContext("optim_step");
  row->grad_norm = step->grad_norm;
  return Status::Ok();
}

}  // namespace flywheel::rl
