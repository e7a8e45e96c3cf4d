// Every built-in loss against a direct formula written out token by token in double
// precision: values, and gradients with respect to the policy logprobs by central
// differences of that formula (stop-gradient parts held at the evaluation point).
#include "trainer/losses.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <random>

namespace flywheel::trainer {
namespace {

constexpr int64_t kB = 4, kT = 5;

struct Inputs {
  std::vector<double> lp, sampling, adv, w, ref;  // kB * kT, row-major
};

Inputs MakeInputs(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0, 1);
  Inputs in;
  for (int64_t b = 0; b < kB; ++b) {
    const int64_t length = kT - b % 3;  // ragged: padding at the end of some rows
    const double seq_adv = normal(rng);
    for (int64_t t = 0; t < kT; ++t) {
      const double lp = -std::abs(normal(rng)) - 0.05;
      in.lp.push_back(lp);
      in.sampling.push_back(lp + 0.35 * normal(rng));
      in.adv.push_back(seq_adv + 0.1 * normal(rng));
      in.ref.push_back(lp + 0.2 * normal(rng));
      double w = t < length ? (t == 1 && b == 2 ? 0.0 : 1.0) : 0.0;
      in.w.push_back(w);
    }
  }
  return in;
}

// The direct formula. `lp` is varied; `lp0` is where stop-gradients are evaluated.
double Direct(LossName name, const LossConfig& c, const Inputs& in, const std::vector<double>& lp,
              const std::vector<double>& lp0) {
  auto at = [](int64_t b, int64_t t) { return b * kT + t; };
  if (name == LossName::kDpo) {
    double total = 0;
    for (int64_t pair = 0; pair < kB / 2; ++pair) {
      double margin[2];
      for (int side = 0; side < 2; ++side) {
        const int64_t b = 2 * pair + side;
        double policy = 0, reference = 0;
        for (int64_t t = 0; t < kT; ++t) {
          policy += in.w[at(b, t)] * lp[at(b, t)];
          reference += in.w[at(b, t)] * in.ref[at(b, t)];
        }
        margin[side] = policy - reference;
      }
      const double z = c.dpo_beta * (margin[0] - margin[1]);
      total += -std::log(1.0 / (1.0 + std::exp(-z)));
    }
    return total / (kB / 2);
  }
  std::vector<double> l(kB * kT, 0.0);
  for (int64_t b = 0; b < kB; ++b) {
    // GSPO's sequence log ratio, over tokens with weight > 0; its stop-gradient at lp0.
    double seq_sum = 0, seq_count = 0;
    for (int64_t t = 0; t < kT; ++t) {
      if (in.w[at(b, t)] > 0) {
        seq_sum += lp0[at(b, t)] - in.sampling[at(b, t)];
        seq_count += 1;
      }
    }
    const double log_s = seq_count > 0 ? seq_sum / seq_count : 0;
    for (int64_t t = 0; t < kT; ++t) {
      const int64_t i = at(b, t);
      const double A = in.adv[i];
      const double r = std::exp(lp[i] - in.sampling[i]);
      double v = 0;
      switch (name) {
        case LossName::kCrossEntropy:
          v = -lp[i];
          break;
        case LossName::kImportanceSampling:
          v = -r * A;
          break;
        case LossName::kPpo: {
          const double clipped = std::clamp(r, 1 - c.clip_low, 1 + c.clip_high);
          v = -std::min(r * A, clipped * A);
          if (c.dual_clip > 0 && A < 0) v = std::min(v, -c.dual_clip * A);
          break;
        }
        case LossName::kCispo: {
          const double r0 = std::exp(lp0[i] - in.sampling[i]);
          v = -std::clamp(r0, c.cispo_low, c.cispo_high) * A * lp[i];
          break;
        }
        case LossName::kDro: {
          const double d = lp[i] - in.sampling[i];
          v = -(lp[i] * A - 0.5 * c.dro_beta * d * d);
          break;
        }
        case LossName::kGspo: {
          const double s = std::exp(log_s + lp[i] - lp0[i]);
          const double clipped = std::clamp(s, 1 - c.clip_low, 1 + c.clip_high);
          v = -std::min(s * A, clipped * A);
          break;
        }
        case LossName::kDpo:
          break;
      }
      if (c.tis_cap > 0) v *= std::min(std::exp(lp0[i] - in.sampling[i]), c.tis_cap);
      if (c.kl_coef > 0) {
        const double d = in.ref[i] - lp[i];
        double k = 0;
        switch (c.kl_estimator) {
          case KlEstimator::kK1:
            k = -d;
            break;
          case KlEstimator::kK2:
            k = 0.5 * d * d;
            break;
          case KlEstimator::kK3:
            k = std::exp(d) - d - 1;
            break;
        }
        v += c.kl_coef * k;
      }
      l[i] = v;
    }
  }
  switch (c.aggregation) {
    case Aggregation::kTokenMean: {
      double num = 0, den = 0;
      for (int64_t i = 0; i < kB * kT; ++i) {
        num += in.w[i] * l[i];
        den += in.w[i];
      }
      return num / den;
    }
    case Aggregation::kSeqMeanTokenMean: {
      double total = 0;
      int seqs = 0;
      for (int64_t b = 0; b < kB; ++b) {
        double num = 0, den = 0;
        for (int64_t t = 0; t < kT; ++t) {
          num += in.w[at(b, t)] * l[at(b, t)];
          den += in.w[at(b, t)];
        }
        if (den > 0) {
          total += num / den;
          ++seqs;
        }
      }
      return total / seqs;
    }
    case Aggregation::kSeqMeanTokenSumNorm: {
      const double length = c.norm_length > 0 ? c.norm_length : kT;
      double total = 0;
      for (int64_t b = 0; b < kB; ++b) {
        for (int64_t t = 0; t < kT; ++t) total += in.w[at(b, t)] * l[at(b, t)];
      }
      return total / kB / length;
    }
  }
  return 0;
}

torch::Tensor ToTensor(const std::vector<double>& v) {
  return torch::tensor(v, torch::kDouble).view({kB, kT});
}

void CheckAgainstFormula(LossName name, const LossConfig& config, uint32_t seed = 7) {
  SCOPED_TRACE(std::string(LossNameString(name)) + " / " + AggregationString(config.aggregation));
  const Inputs in = MakeInputs(seed);
  torch::Tensor lp = ToTensor(in.lp).set_requires_grad(true);
  LossBatch batch{lp, ToTensor(in.sampling), ToTensor(in.adv), ToTensor(in.w), ToTensor(in.ref)};
  auto result = ComputeLoss(name, config, batch);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  result->loss.backward();
  const double expected = Direct(name, config, in, in.lp, in.lp);
  EXPECT_NEAR(result->loss.item<double>(), expected, 1e-10 * std::max(1.0, std::abs(expected)));
  EXPECT_GT(std::abs(expected), 1e-6) << "degenerate inputs: the loss is zero";

  auto grad = lp.grad().view({-1});
  double grad_scale = 0;
  const double h = 1e-6;
  for (int64_t i = 0; i < kB * kT; ++i) {
    std::vector<double> up = in.lp, down = in.lp;
    up[i] += h;
    down[i] -= h;
    const double numeric =
        (Direct(name, config, in, up, in.lp) - Direct(name, config, in, down, in.lp)) / (2 * h);
    EXPECT_NEAR(grad[i].item<double>(), numeric, 1e-6) << "token " << i;
    grad_scale = std::max(grad_scale, std::abs(numeric));
    if (in.w[i] == 0) {
      EXPECT_EQ(grad[i].item<double>(), 0.0) << "masked token " << i << " got a gradient";
    }
  }
  EXPECT_GT(grad_scale, 1e-4) << "degenerate inputs: no gradient";
}

const Aggregation kAggregations[] = {Aggregation::kTokenMean, Aggregation::kSeqMeanTokenMean,
                                     Aggregation::kSeqMeanTokenSumNorm};

TEST(LossFormulaTest, CrossEntropy) {
  for (Aggregation a : kAggregations)
    CheckAgainstFormula(LossName::kCrossEntropy, {.aggregation = a});
}

TEST(LossFormulaTest, ImportanceSampling) {
  for (Aggregation a : kAggregations)
    CheckAgainstFormula(LossName::kImportanceSampling, {.aggregation = a});
}

TEST(LossFormulaTest, PpoAsymmetricClip) {
  for (Aggregation a : kAggregations) {
    CheckAgainstFormula(LossName::kPpo, {.aggregation = a, .clip_low = 0.2, .clip_high = 0.28});
  }
}

TEST(LossFormulaTest, PpoDualClip) {
  LossConfig config{.clip_low = 0.1, .clip_high = 0.1, .dual_clip = 1.05};
  CheckAgainstFormula(LossName::kPpo, config);
  CheckAgainstFormula(LossName::kPpo, config, 11);
}

TEST(LossFormulaTest, Cispo) {
  for (Aggregation a : kAggregations) {
    CheckAgainstFormula(LossName::kCispo, {.aggregation = a, .cispo_low = 0.8, .cispo_high = 1.2});
  }
}

TEST(LossFormulaTest, Dro) {
  for (Aggregation a : kAggregations)
    CheckAgainstFormula(LossName::kDro, {.aggregation = a, .dro_beta = 0.5});
}

TEST(LossFormulaTest, Gspo) {
  for (Aggregation a : kAggregations) {
    CheckAgainstFormula(LossName::kGspo, {.aggregation = a, .clip_low = 0.05, .clip_high = 0.08});
  }
}

TEST(LossFormulaTest, Dpo) {
  CheckAgainstFormula(LossName::kDpo, {.dpo_beta = 0.3});
}

TEST(LossFormulaTest, KlEstimators) {
  for (KlEstimator k : {KlEstimator::kK1, KlEstimator::kK2, KlEstimator::kK3}) {
    CheckAgainstFormula(LossName::kPpo, {.kl_coef = 0.05, .kl_estimator = k});
  }
}

TEST(LossFormulaTest, TruncatedImportanceSampling) {
  CheckAgainstFormula(LossName::kImportanceSampling, {.tis_cap = 1.1});
  CheckAgainstFormula(LossName::kPpo,
                      {.aggregation = Aggregation::kSeqMeanTokenMean, .tis_cap = 1.5});
}

TEST(LossFormulaTest, SumNormWithFixedLength) {
  CheckAgainstFormula(LossName::kDro,
                      {.aggregation = Aggregation::kSeqMeanTokenSumNorm, .norm_length = 16});
}

TEST(LossMetricsTest, ClipFractionAndK3) {
  const Inputs in = MakeInputs(3);
  torch::Tensor lp = ToTensor(in.lp);
  LossBatch batch{lp, ToTensor(in.sampling), ToTensor(in.adv), ToTensor(in.w), {}};
  auto result = ComputeLoss(LossName::kPpo, {.clip_low = 0.2, .clip_high = 0.2}, batch);
  ASSERT_TRUE(result.ok());
  double clipped = 0, k3 = 0, count = 0;
  for (size_t i = 0; i < in.lp.size(); ++i) {
    if (in.w[i] <= 0) continue;
    const double r = std::exp(in.lp[i] - in.sampling[i]);
    clipped += (r < 0.8 || r > 1.2) ? 1 : 0;
    const double d = in.sampling[i] - in.lp[i];
    k3 += std::exp(d) - d - 1;
    count += 1;
  }
  EXPECT_NEAR(result->clip_fraction, clipped / count, 1e-12);
  EXPECT_NEAR(result->kl_sampler_k3, k3 / count, 1e-12);
  EXPECT_GT(result->clip_fraction, 0);
}

TEST(LossErrorsTest, UnknownNamesAndBadConfig) {
  auto unknown = ParseLossName("grpo2");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("unknown loss 'grpo2'"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("cispo"), std::string::npos);
  EXPECT_FALSE(ParseAggregation("token-sum").ok());
  EXPECT_FALSE(ParseKlEstimator("k4").ok());
  EXPECT_NE(LossConfig{.clip_low = 1.5}.Validate().message().find("clip_low"), std::string::npos);
  EXPECT_NE(LossConfig{.dual_clip = 0.5}.Validate().message().find("dual_clip"), std::string::npos);
  EXPECT_NE(LossConfig{.dpo_beta = 0}.Validate().message().find("dpo_beta"), std::string::npos);
}

TEST(LossErrorsTest, MissingOrMisshapenInputs) {
  torch::Tensor lp = torch::zeros({2, 3}, torch::kDouble);
  torch::Tensor w = torch::ones({2, 3}, torch::kDouble);
  auto missing = ComputeLoss(LossName::kPpo, {}, {lp, {}, {}, w, {}});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("sampling logprobs"), std::string::npos);
  auto shape = ComputeLoss(
      LossName::kImportanceSampling, {},
      {lp, torch::zeros({2, 4}, torch::kDouble), torch::zeros({2, 3}, torch::kDouble), w, {}});
  ASSERT_FALSE(shape.ok());
  EXPECT_NE(shape.status().message().find("shape"), std::string::npos);
  auto odd = ComputeLoss(LossName::kDpo, {},
                         {torch::zeros({3, 3}, torch::kDouble),
                          {},
                          {},
                          torch::ones({3, 3}, torch::kDouble),
                          torch::zeros({3, 3}, torch::kDouble)});
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("pairs"), std::string::npos);
  auto no_ref = ComputeLoss(LossName::kCrossEntropy, {.kl_coef = 0.1}, {lp, {}, {}, w, {}});
  ASSERT_FALSE(no_ref.ok());
  EXPECT_NE(no_ref.status().message().find("reference logprobs"), std::string::npos);
}

TEST(GroupAdvantageTest, GrpoDrGrpoAndDapo) {
  const std::vector<double> rewards = {1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 2, 0, 1, 1};
  auto grpo = ComputeGroupAdvantages(rewards, 4, {});
  ASSERT_TRUE(grpo.ok());
  // Group 1: mean 0.5, unbiased std sqrt(1/3).
  const double std1 = std::sqrt(1.0 / 3.0);
  EXPECT_NEAR(grpo->advantages[0], 0.5 / (std1 + 1e-6), 1e-12);
  EXPECT_NEAR(grpo->advantages[1], -0.5 / (std1 + 1e-6), 1e-12);
  EXPECT_EQ(grpo->advantages[4], 0.0);  // all-equal group: zero, kept
  EXPECT_TRUE(grpo->keep[4]);
  auto dr = ComputeGroupAdvantages(rewards, 4, {.normalize_std = false});
  ASSERT_TRUE(dr.ok());
  EXPECT_NEAR(dr->advantages[8], 1.0, 1e-12);  // 2 - mean 1
  auto dapo = ComputeGroupAdvantages(rewards, 4, {.drop_all_equal = true});
  ASSERT_TRUE(dapo.ok());
  EXPECT_EQ(dapo->dropped_groups, 1u);
  EXPECT_FALSE(dapo->keep[5]);
  EXPECT_TRUE(dapo->keep[9]);
  EXPECT_FALSE(ComputeGroupAdvantages(rewards, 5, {}).ok());
  EXPECT_FALSE(ComputeGroupAdvantages({1, 2}, 1, {}).ok());
  EXPECT_FALSE(ComputeGroupAdvantages({1, NAN}, 2, {}).ok());
}

}  // namespace
}  // namespace flywheel::trainer
