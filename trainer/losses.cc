#include "trainer/losses.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numeric>

namespace flywheel::trainer {

namespace {

struct NamedLoss {
  LossName name;
  const char* text;
};
constexpr NamedLoss kLosses[] = {
    {LossName::kCrossEntropy, "cross_entropy"},
    {LossName::kImportanceSampling, "importance_sampling"},
    {LossName::kPpo, "ppo"},
    {LossName::kCispo, "cispo"},
    {LossName::kDro, "dro"},
    {LossName::kGspo, "gspo"},
    {LossName::kDpo, "dpo"},
};

double MaskedMean(const torch::Tensor& values, const torch::Tensor& mask) {
  const double count = mask.sum().item<double>();
  return count > 0 ? (values * mask).sum().item<double>() / count : 0.0;
}

// Sum over tokens of each sequence: [B, T] -> [B].
torch::Tensor RowSum(const torch::Tensor& x) {
  return x.sum(1);
}

torch::Tensor Aggregate(const torch::Tensor& per_token, const torch::Tensor& weights,
                        const LossConfig& config) {
  switch (config.aggregation) {
    case Aggregation::kTokenMean:
      return (per_token * weights).sum() / weights.sum().clamp_min(1e-12);
    case Aggregation::kSeqMeanTokenMean: {
      torch::Tensor seq_weight = RowSum(weights);
      torch::Tensor has_tokens = seq_weight.gt(0);
      torch::Tensor seq_loss = RowSum(per_token * weights) / seq_weight.clamp_min(1e-12);
      return (seq_loss * has_tokens).sum() / has_tokens.sum().clamp_min(1);
    }
    case Aggregation::kSeqMeanTokenSumNorm: {
      const double length =
          config.norm_length > 0 ? config.norm_length : static_cast<double>(per_token.size(1));
      return RowSum(per_token * weights).mean() / length;
    }
  }
  return {};
}

}  // namespace

Result<LossName> ParseLossName(std::string_view name) {
  for (const auto& l : kLosses) {
    if (name == l.text) return l.name;
  }
  std::string known;
  for (const auto& l : kLosses) known += std::string(known.empty() ? "" : ", ") + l.text;
  return Status::InvalidArgument("unknown loss '" + std::string(name) + "' (known: " + known + ")");
}

const char* LossNameString(LossName name) {
  for (const auto& l : kLosses) {
    if (l.name == name) return l.text;
  }
  return "?";
}

Result<Aggregation> ParseAggregation(std::string_view name) {
  if (name == "token-mean") return Aggregation::kTokenMean;
  if (name == "seq-mean-token-mean") return Aggregation::kSeqMeanTokenMean;
  if (name == "seq-mean-token-sum-norm") return Aggregation::kSeqMeanTokenSumNorm;
  return Status::InvalidArgument(
      "unknown aggregation '" + std::string(name) +
      "' (known: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm)");
}

const char* AggregationString(Aggregation aggregation) {
  switch (aggregation) {
    case Aggregation::kTokenMean:
      return "token-mean";
    case Aggregation::kSeqMeanTokenMean:
      return "seq-mean-token-mean";
    case Aggregation::kSeqMeanTokenSumNorm:
      return "seq-mean-token-sum-norm";
  }
  return "?";
}

Result<KlEstimator> ParseKlEstimator(std::string_view name) {
  if (name == "k1") return KlEstimator::kK1;
  if (name == "k2") return KlEstimator::kK2;
  if (name == "k3") return KlEstimator::kK3;
  return Status::InvalidArgument("unknown KL estimator '" + std::string(name) +
                                 "' (known: k1, k2, k3)");
}

Status LossConfig::Validate() const {
  auto bad = [](const std::string& what, double v) {
    return Status::InvalidArgument("loss config: " + what + ", got " + std::to_string(v));
  };
  if (!(clip_low >= 0 && clip_low < 1)) return bad("clip_low must be in [0, 1)", clip_low);
  if (!(clip_high >= 0)) return bad("clip_high must be >= 0", clip_high);
  if (!(dual_clip == 0 || dual_clip > 1)) return bad("dual_clip must be 0 (off) or > 1", dual_clip);
  if (!(cispo_low >= 0 && cispo_high > cispo_low))
    return bad("cispo needs 0 <= cispo_low < cispo_high", cispo_high);
  if (!(dro_beta >= 0)) return bad("dro_beta must be >= 0", dro_beta);
  if (!(dpo_beta > 0)) return bad("dpo_beta must be > 0", dpo_beta);
  if (!(kl_coef >= 0)) return bad("kl_coef must be >= 0", kl_coef);
  if (!(tis_cap >= 0)) return bad("tis_cap must be >= 0 (0 = off)", tis_cap);
  if (!(norm_length >= 0)) return bad("norm_length must be >= 0", norm_length);
  return Status::Ok();
}

bool NeedsSamplingLogprobs(LossName name, const LossConfig& config) {
  return (name != LossName::kCrossEntropy && name != LossName::kDpo) || config.tis_cap > 0;
}
bool NeedsAdvantages(LossName name) {
  return name != LossName::kCrossEntropy && name != LossName::kDpo;
}
bool NeedsRefLogprobs(LossName name, const LossConfig& config) {
  return name == LossName::kDpo || config.kl_coef > 0;
}

namespace {

// Every tensor `name` (with `config`) needs is there, in the shape of the logprobs.
Status CheckBatch(LossName name, const LossConfig& config, const LossBatch& batch) {
  const torch::Tensor& lp = batch.logprobs;
  auto require = [&](const torch::Tensor& t, const char* what) -> Status {
    if (!t.defined()) {
      return Status::InvalidArgument(std::string("loss ") + LossNameString(name) + " needs " +
                                     what);
    }
    if (t.sizes() != lp.sizes()) {
      return Status::InvalidArgument(std::string("loss ") + LossNameString(name) + ": " + what +
                                     " has shape " + c10::str(t.sizes()) + ", logprobs " +
                                     c10::str(lp.sizes()));
    }
    return Status::Ok();
  };
  FW_RETURN_IF_ERROR(require(batch.weights, "weights"));
  if (NeedsSamplingLogprobs(name, config))
    FW_RETURN_IF_ERROR(require(batch.sampling_logprobs, "sampling logprobs"));
  if (NeedsAdvantages(name)) FW_RETURN_IF_ERROR(require(batch.advantages, "advantages"));
  if (NeedsRefLogprobs(name, config))
    FW_RETURN_IF_ERROR(require(batch.ref_logprobs, "reference logprobs"));
  return Status::Ok();
}

Result<torch::Tensor> DpoLoss(const LossConfig& config, const LossBatch& batch) {
  const torch::Tensor& lp = batch.logprobs;
  const torch::Tensor& w = batch.weights;
  if (lp.size(0) % 2 != 0) {
    return Status::InvalidArgument("loss dpo needs datums in (chosen, rejected) pairs; got " +
                                   std::to_string(lp.size(0)) + " datums");
  }
  torch::Tensor policy = RowSum(lp * w), reference = RowSum(batch.ref_logprobs * w);
  torch::Tensor margin = (policy - reference).view({-1, 2});
  torch::Tensor logits = (margin.select(1, 0) - margin.select(1, 1)) * config.dpo_beta;
  return -torch::log_sigmoid(logits).mean();
}

// What the per-token policy losses read.
struct PolicyTerms {
  const LossConfig& config;
  const torch::Tensor& lp;    // [B, T] logprobs under the current policy
  const torch::Tensor& adv;   // advantages (undefined for cross entropy)
  const torch::Tensor& mask;  // loss tokens (weight > 0)
  torch::Tensor log_ratio;    // lp - sampling logprobs, when given
  torch::Tensor ratio;        // exp(log_ratio)
};

// Share of loss tokens whose ratio `r` lies outside [lo, hi].
double ClippedShare(const PolicyTerms& in, const torch::Tensor& r, double lo, double hi) {
  torch::NoGradGuard no_grad;
  return MaskedMean((r.lt(lo) | r.gt(hi)).to(in.lp.scalar_type()), in.mask);
}

torch::Tensor CrossEntropyTokens(const PolicyTerms& in, LossResult*) {
  return -in.lp;
}

torch::Tensor ImportanceSamplingTokens(const PolicyTerms& in, LossResult*) {
  return -in.ratio * in.adv;
}

torch::Tensor PpoTokens(const PolicyTerms& in, LossResult* result) {
  const double lo = 1 - in.config.clip_low, hi = 1 + in.config.clip_high;
  torch::Tensor unclipped = -in.ratio * in.adv;
  torch::Tensor clipped = -in.ratio.clamp(lo, hi) * in.adv;
  torch::Tensor per_token = torch::max(unclipped, clipped);
  if (in.config.dual_clip > 0) {
    torch::Tensor capped = torch::min(per_token, -in.adv * in.config.dual_clip);
    per_token = torch::where(in.adv.lt(0), capped, per_token);
  }
  result->clip_fraction = ClippedShare(in, in.ratio, lo, hi);
  return per_token;
}

torch::Tensor CispoTokens(const PolicyTerms& in, LossResult* result) {
  const LossConfig& config = in.config;
  torch::Tensor weight = in.ratio.detach().clamp(config.cispo_low, config.cispo_high);
  result->clip_fraction = ClippedShare(in, in.ratio, config.cispo_low, config.cispo_high);
  return -weight * in.adv * in.lp;
}

torch::Tensor DroTokens(const PolicyTerms& in, LossResult*) {
  return -(in.lp * in.adv - 0.5 * in.config.dro_beta * in.log_ratio.pow(2));
}

// The ratio is the sequence's (the mean log ratio of its loss tokens), clipped per sequence.
torch::Tensor GspoTokens(const PolicyTerms& in, LossResult* result) {
  const torch::Tensor& lp = in.lp;
  const double lo = 1 - in.config.clip_low, hi = 1 + in.config.clip_high;
  torch::Tensor seq_log_ratio = RowSum(in.log_ratio * in.mask) / RowSum(in.mask).clamp_min(1);
  torch::Tensor token_log_ratio = seq_log_ratio.detach().unsqueeze(1) + lp - lp.detach();
  torch::Tensor s = token_log_ratio.exp();
  torch::Tensor per_token = torch::max(-s * in.adv, -s.clamp(lo, hi) * in.adv);
  {
    torch::NoGradGuard no_grad;
    torch::Tensor seq_ratio = seq_log_ratio.exp();
    torch::Tensor has_tokens = RowSum(in.mask).gt(0).to(lp.scalar_type());
    torch::Tensor out = (seq_ratio.lt(lo) | seq_ratio.gt(hi)).to(lp.scalar_type());
    const double seqs = has_tokens.sum().item<double>();
    result->clip_fraction = seqs > 0 ? (out * has_tokens).sum().item<double>() / seqs : 0.0;
  }
  return per_token;
}

// The per-token loss of each policy loss (all but DPO, a loss over sequence pairs).
using PerTokenLoss = torch::Tensor (*)(const PolicyTerms&, LossResult*);
struct PolicyLoss {
  LossName name;
  PerTokenLoss per_token;
};
constexpr PolicyLoss kPolicyLosses[] = {
    {LossName::kCrossEntropy, CrossEntropyTokens},
    {LossName::kImportanceSampling, ImportanceSamplingTokens},
    {LossName::kPpo, PpoTokens},
    {LossName::kCispo, CispoTokens},
    {LossName::kDro, DroTokens},
    {LossName::kGspo, GspoTokens},
};

// Truncated importance sampling: weights the per-token loss by min(ratio, tis_cap).
torch::Tensor ApplyTis(const torch::Tensor& per_token, const LossConfig& config,
                       const LossBatch& batch, const torch::Tensor& mask, LossResult* result) {
  const torch::Tensor& lp = batch.logprobs;
  torch::Tensor tis = (lp.detach() - batch.sampling_logprobs).exp();
  {
    torch::NoGradGuard no_grad;
    result->tis_truncated = MaskedMean(tis.gt(config.tis_cap).to(lp.scalar_type()), mask);
  }
  return per_token * tis.clamp_max(config.tis_cap);
}

// The per-token KL to the reference policy by the configured estimator.
torch::Tensor ReferenceKl(const LossConfig& config, const LossBatch& batch,
                          const torch::Tensor& mask, LossResult* result) {
  torch::Tensor d = batch.ref_logprobs - batch.logprobs;
  torch::Tensor kl;
  switch (config.kl_estimator) {
    case KlEstimator::kK1:
      kl = -d;
      break;
    case KlEstimator::kK2:
      kl = 0.5 * d.pow(2);
      break;
    case KlEstimator::kK3:
      kl = d.exp() - d - 1;
      break;
  }
  result->kl_reference = MaskedMean(kl.detach(), mask);
  return kl;
}

}  // namespace

Result<LossResult> ComputeLoss(LossName name, const LossConfig& config, const LossBatch& batch) {
  FW_RETURN_IF_ERROR(config.Validate());
  FW_RETURN_IF_ERROR(CheckBatch(name, config, batch));
  const torch::Tensor& lp = batch.logprobs;
  LossResult result;
  const torch::Tensor mask = batch.weights.gt(0).to(lp.scalar_type());
  if (batch.sampling_logprobs.defined()) {
    torch::NoGradGuard no_grad;
    const torch::Tensor delta = batch.sampling_logprobs - lp.detach();
    result.kl_sampler_k3 = MaskedMean(delta.exp() - delta - 1, mask);
  }
  if (name == LossName::kDpo) {
    FW_ASSIGN_OR_RETURN(result.loss, DpoLoss(config, batch));
    return result;
  }
  const PolicyLoss* loss = std::find_if(std::begin(kPolicyLosses), std::end(kPolicyLosses),
                                        [name](const PolicyLoss& l) { return l.name == name; });
  if (loss == std::end(kPolicyLosses)) {
    return Status::InvalidArgument(std::string("loss ") + LossNameString(name) + " is not known");
  }
  PolicyTerms terms{config, lp, batch.advantages, mask, {}, {}};
  if (batch.sampling_logprobs.defined()) {
    terms.log_ratio = lp - batch.sampling_logprobs;
    terms.ratio = terms.log_ratio.exp();
  }
  torch::Tensor per_token = loss->per_token(terms, &result);
  if (config.tis_cap > 0) per_token = ApplyTis(per_token, config, batch, mask, &result);
  if (config.kl_coef > 0) {
    per_token = per_token + config.kl_coef * ReferenceKl(config, batch, mask, &result);
  }
  result.loss = Aggregate(per_token, batch.weights, config);
  return result;
}

Result<GroupAdvantages> ComputeGroupAdvantages(const std::vector<double>& rewards,
                                               size_t group_size,
                                               const GroupAdvantageOptions& options) {
  if (group_size == 0) return Status::InvalidArgument("group advantages: group_size must be > 0");
  if (rewards.size() % group_size != 0) {
    return Status::InvalidArgument("group advantages: " + std::to_string(rewards.size()) +
                                   " rewards do not split into groups of " +
                                   std::to_string(group_size));
  }
  if (options.normalize_std && group_size < 2) {
    return Status::InvalidArgument(
        "group advantages: std normalisation needs groups of at least 2");
  }
  GroupAdvantages out;
  out.advantages.assign(rewards.size(), 0.0);
  out.keep.assign(rewards.size(), true);
  for (size_t start = 0; start < rewards.size(); start += group_size) {
    const double* r = rewards.data() + start;
    for (size_t i = 0; i < group_size; ++i) {
      if (!std::isfinite(r[i])) {
        return Status::InvalidArgument("group advantages: reward " + std::to_string(start + i) +
                                       " is not finite");
      }
    }
    const double mean = std::accumulate(r, r + group_size, 0.0) / static_cast<double>(group_size);
    bool all_equal = true;
    double squares = 0;
    for (size_t i = 0; i < group_size; ++i) {
      all_equal &= r[i] == r[0];
      squares += (r[i] - mean) * (r[i] - mean);
    }
    if (all_equal && options.drop_all_equal) {
      for (size_t i = 0; i < group_size; ++i) out.keep[start + i] = false;
      ++out.dropped_groups;
      continue;
    }
    const double std =
        group_size > 1 ? std::sqrt(squares / static_cast<double>(group_size - 1)) : 0.0;
    for (size_t i = 0; i < group_size; ++i) {
      const double centred = r[i] - mean;
      out.advantages[start + i] = options.normalize_std ? centred / (std + options.eps) : centred;
    }
  }
  return out;
}

}  // namespace flywheel::trainer
