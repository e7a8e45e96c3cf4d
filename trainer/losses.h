// The built-in RL and supervised losses, fused into the trainer's single forward pass,
// plus the group-advantage helpers of GRPO / Dr. GRPO / DAPO.
//
// Per token (r = exp(logp - logp_sampler), A = advantage, w = the datum's weights, sg =
// stop-gradient); the formulas are ../shared/REFERENCES.md's:
//   cross_entropy        l = -logp                        (w = SFT weights)
//   importance_sampling  l = -r A
//   ppo                  l = -min(r A, clip(r, 1-clip_low, 1+clip_high) A); with
//                        dual_clip c > 1, tokens with A < 0 are capped at -c A
//   cispo                l = -sg(clip(r, cispo_low, cispo_high)) A logp
//   dro                  l = -(logp A - beta/2 (logp - logp_sampler)^2)
//   gspo                 log s = mean_t(logp - logp_sampler) per sequence;
//                        s_t = exp(sg(log s) + logp - sg(logp)); PPO clip on s_t
//   dpo                  per pair (datum 2i chosen, 2i+1 rejected), Z = sum_t w logp:
//                        l = -log sigmoid(beta ((Z_c - Zref_c) - (Z_r - Zref_r)))
// then optionally  l *= min(exp(sg(logp) - logp_sampler), tis_cap)   (truncated IS)
//             and  l += kl_coef * k(logp, logp_ref)  with k1 = -d, k2 = d^2/2,
//                  k3 = exp(d) - d - 1, d = logp_ref - logp.
// Aggregation over the batch (padding and w = 0 tokens never count):
//   token-mean                sum(w l) / sum(w)
//   seq-mean-token-mean       mean over sequences of sum_t(w l) / sum_t(w)
//   seq-mean-token-sum-norm   mean over sequences of sum_t(w l) / L   (L = norm_length,
//                             or the batch's padded length when 0: Dr. GRPO)
// DPO is per pair and ignores the aggregation mode.
//
// Everything here is dtype-generic (the reference tests run it in double precision).
#pragma once

#include <torch/torch.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel::trainer {

enum class LossName { kCrossEntropy, kImportanceSampling, kPpo, kCispo, kDro, kGspo, kDpo };
enum class Aggregation { kTokenMean, kSeqMeanTokenMean, kSeqMeanTokenSumNorm };
enum class KlEstimator { kK1, kK2, kK3 };

Result<LossName> ParseLossName(std::string_view name);  // "ppo", "cross_entropy", ...
const char* LossNameString(LossName name);
Result<Aggregation> ParseAggregation(std::string_view name);  // "token-mean", ...
const char* AggregationString(Aggregation aggregation);
Result<KlEstimator> ParseKlEstimator(std::string_view name);  // "k1", "k2", "k3"

struct LossConfig {
  Aggregation aggregation = Aggregation::kTokenMean;
  double norm_length = 0;  // seq-mean-token-sum-norm divisor; 0: the padded length
  double clip_low = 0.2;   // ppo, gspo: ratio clipped to [1 - clip_low, 1 + clip_high]
  double clip_high = 0.2;  //   (DAPO clip-higher: 0.2 / 0.28)
  double dual_clip = 0;    // ppo: 0 off, else c > 1
  double cispo_low = 0;    // cispo: IS weight clipped to [cispo_low, cispo_high]
  double cispo_high = 5;
  double dro_beta = 0.1;
  double dpo_beta = 0.1;
  double kl_coef = 0;  // > 0 needs the datums' ref_logprobs
  KlEstimator kl_estimator = KlEstimator::kK3;
  double tis_cap = 0;  // truncated importance sampling cap; 0 off

  Status Validate() const;  // names the bad field and value
};

// One padded batch, every tensor [B, T] of the same floating dtype.
struct LossBatch {
  torch::Tensor logprobs;           // the policy's, with grad
  torch::Tensor sampling_logprobs;  // undefined for cross_entropy / dpo
  torch::Tensor advantages;         // undefined for cross_entropy / dpo
  torch::Tensor weights;            // loss mask / SFT weights, 0 at padding
  torch::Tensor ref_logprobs;       // needed by dpo and by kl_coef > 0
};

struct LossResult {
  torch::Tensor loss;        // scalar, aggregated
  double clip_fraction = 0;  // share of loss tokens (gspo: sequences) whose ratio was clipped
  double kl_sampler_k3 = 0;  // mean k3(logp_sampler vs logp) over loss tokens
  double kl_reference = 0;   // mean of the chosen KL estimator, when kl_coef > 0
  double tis_truncated = 0;  // share of loss tokens whose TIS weight hit the cap
};

Result<LossResult> ComputeLoss(LossName name, const LossConfig& config, const LossBatch& batch);

// Which LossBatch fields `name` (with `config`) needs; used to check datums up front.
bool NeedsSamplingLogprobs(LossName name, const LossConfig& config);
bool NeedsAdvantages(LossName name);
bool NeedsRefLogprobs(LossName name, const LossConfig& config);

// GRPO family: rewards in consecutive groups of `group_size` samples of one prompt.
struct GroupAdvantageOptions {
  bool normalize_std = true;    // GRPO; false: Dr. GRPO (mean-centred only)
  double eps = 1e-6;            // added to the std
  bool drop_all_equal = false;  // DAPO dynamic sampling: groups with equal rewards carry no signal
};
struct GroupAdvantages {
  std::vector<double> advantages;  // one per sample (0 for dropped ones)
  std::vector<bool> keep;          // false for samples of dropped groups
  size_t dropped_groups = 0;
};
// A_i = (R_i - mean_group) / (std_group + eps), std unbiased (n - 1), as torch.std.
Result<GroupAdvantages> ComputeGroupAdvantages(const std::vector<double>& rewards,
                                               size_t group_size,
                                               const GroupAdvantageOptions& options);

}  // namespace flywheel::trainer
