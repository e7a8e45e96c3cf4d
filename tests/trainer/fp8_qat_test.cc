// FP8 quantization-aware training (TrainerOptions::fp8_qat): the trainer's forward against
// the engine's FP8 math (a plain model loaded with LoadFp8Weights(SnapshotWeightsFp8(...))),
// straight-through gradients to the fp32 masters, LoRA on a fake-quantized base, and the
// gap QAT closes (the k3 figures are printed).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>

#include "model/fp8.h"
#include "model/weights.h"
#include "tests/model/tiny_models.h"
#include "tests/trainer/trainer_test_util.h"
#include "trainer/training_client.h"

namespace flywheel::trainer {
namespace {

void Train(TrainingClient& client, const std::vector<Datum>& data, int steps) {
  for (int i = 0; i < steps; ++i) {
    auto m = client.ForwardBackward(data, "cross_entropy");
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    auto s = client.OptimStep({.lr = 1e-2, .beta2 = 0.99});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
  }
}

// What a worker computes: a plain (no QAT) model of the same config loaded from `snapshot`,
// FP8 tensors dequantized as LoadFp8Weights does.
std::unique_ptr<TrainingClient> Served(const TrainerOptions& trainer,
                                       const OwnedCheckpoint& snapshot, int64_t block) {
  auto served = MakeClient({.config = trainer.config, .seed = 999});
  if (served == nullptr) return nullptr;
  const Status loaded = model::LoadFp8Weights(served->model(), snapshot.view(), "snapshot", block);
  EXPECT_TRUE(loaded.ok()) << loaded.ToString();
  return loaded.ok() ? std::move(served) : nullptr;
}

struct Gap {
  double k3 = 0;       // mean over tokens of exp(d) - d - 1, d = served - trainer
  double max_abs = 0;  // largest |d|
};

// The served model's logprobs against the trainer's on the same datums. With `replay` an
// MoE trainer replays the served routing, as in RL; then the two are not bit-identical even
// for equal weights, since a replayed batch routes its padding to expert 0 (more rows in
// that expert's GEMM, rounding its sums differently: ~1e-7 in a logprob). Without it the
// trainer routes itself and the test checks that it chose the served experts.
Gap Compare(TrainingClient& served, TrainingClient& trainer, std::vector<Datum> data, bool replay) {
  auto sampled = served.Forward(data);
  EXPECT_TRUE(sampled.ok());
  if (!sampled.ok()) return {1, 1};
  if (replay) {
    for (size_t i = 0; i < data.size(); ++i) data[i].routing = sampled->routing[i];
  }
  auto recomputed = trainer.Forward(data);
  EXPECT_TRUE(recomputed.ok());
  if (!recomputed.ok()) return {1, 1};
  if (!replay) {
    EXPECT_EQ(sampled->routing, recomputed->routing);
  }
  Gap gap;
  int64_t tokens = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    for (size_t t = 0; t < data[i].tokens.size(); ++t) {
      const double d = static_cast<double>(sampled->logprobs[i][t]) - recomputed->logprobs[i][t];
      gap.k3 += std::exp(d) - d - 1;
      gap.max_abs = std::max(gap.max_abs, std::fabs(d));
      ++tokens;
    }
  }
  gap.k3 /= static_cast<double>(tokens);
  return gap;
}

OwnedCheckpoint Fp8Snapshot(TrainingClient& client, int64_t block, DType other) {
  auto snapshot = model::SnapshotWeightsFp8(client.model(), {.block = block, .other_dtype = other});
  EXPECT_TRUE(snapshot.ok()) << snapshot.status().ToString();
  return snapshot.ok() ? std::move(*snapshot) : OwnedCheckpoint{};
}

std::shared_ptr<model::ProjImpl> Projection(model::TransformerImpl& model,
                                            const std::string& weight_name) {
  const std::string module = weight_name.substr(0, weight_name.size() - std::strlen(".weight"));
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (item.key() == module) return std::dynamic_pointer_cast<model::ProjImpl>(item.value());
  }
  return nullptr;
}

// Blocks 128 (one block per tiny matrix), 16 (several) and 24 (ragged edges: 32 and 64 are
// not multiples of 24).
constexpr int64_t kBlocks[] = {128, 16, 24};

TEST(Fp8QatTest, FakeQuantizedWeightsAreTheServedOnes) {
  for (bool moe : {false, true}) {
    for (int64_t block : kBlocks) {
      SCOPED_TRACE((moe ? "moe, block " : "dense, block ") + std::to_string(block));
      const TrainerOptions options{
          .config = Tiny(moe), .seed = 1, .fp8_block = block, .fp8_qat = true};
      auto trainer = MakeClient(options);
      ASSERT_NE(trainer, nullptr);
      const auto data = Sequences(3, 10, 40, 2);
      Train(*trainer, data, 3);
      auto served = Served(options, Fp8Snapshot(*trainer, block, DType::kF32), block);
      ASSERT_NE(served, nullptr);
      auto served_params = served->model().named_parameters();
      const std::vector<std::string> names = model::Fp8WeightNames(trainer->model());
      ASSERT_FALSE(names.empty());
      int experts = 0;
      for (const std::string& name : names) {
        auto proj = Projection(trainer->model(), name);
        ASSERT_NE(proj, nullptr) << name;
        EXPECT_TRUE(torch::equal(proj->Fp8Weight(), served_params[name])) << name;
        EXPECT_FALSE(torch::equal(proj->Fp8Weight(), proj->weight)) << name << " not quantized";
        if (name.find(".experts.") != std::string::npos) ++experts;
      }
      EXPECT_EQ(experts > 0, moe);
    }
  }
}

// (a) The trainer's QAT logprobs are the FP8 engine's, bit for bit, at init and after
// optimizer steps (the cached fake-quantized weights follow the masters).
TEST(Fp8QatTest, ForwardMatchesTheFp8Engine) {
  for (bool moe : {false, true}) {
    for (int64_t block : kBlocks) {
      SCOPED_TRACE((moe ? "moe, block " : "dense, block ") + std::to_string(block));
      const TrainerOptions options{
          .config = Tiny(moe), .seed = 3, .fp8_block = block, .fp8_qat = true};
      auto trainer = MakeClient(options);
      ASSERT_NE(trainer, nullptr);
      const auto data = Sequences(4, 12, 40, 4);
      for (int round = 0; round < 3; ++round) {
        SCOPED_TRACE("after " + std::to_string(round * 5) + " steps");
        auto served = Served(options, Fp8Snapshot(*trainer, block, DType::kF32), block);
        ASSERT_NE(served, nullptr);
        const Gap gap = Compare(*served, *trainer, data, /*replay=*/false);
        EXPECT_LE(gap.k3, 1e-9);
        EXPECT_EQ(gap.max_abs, 0.0) << "k3 " << gap.k3;
        Train(*trainer, data, 5);
      }
    }
  }
}

// (b) Straight-through gradients: every fake-quantized master gets a gradient, the step
// moves it, and SFT memorises as it does without QAT.
TEST(Fp8QatTest, GradientsReachTheMastersAndSftLearns) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    auto client = MakeClient({.config = Tiny(moe), .seed = 5, .fp8_block = 16, .fp8_qat = true});
    ASSERT_NE(client, nullptr);
    const auto data = Sequences(4, 12, 40, 6);
    const std::vector<std::string> names = model::Fp8WeightNames(client->model());
    auto params = client->model().named_parameters();
    std::map<std::string, torch::Tensor> before;
    for (const std::string& name : names) before[name] = params[name].detach().clone();

    auto first = client->ForwardBackward(data, "cross_entropy");
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    int with_gradient = 0;
    for (const std::string& name : names) {
      const torch::Tensor& grad = params[name].grad();
      // An expert no token was routed to has no gradient.
      if (grad.defined() && grad.abs().sum().item<double>() > 0) ++with_gradient;
    }
    if (moe) {
      EXPECT_GT(with_gradient, static_cast<int>(names.size()) / 2);
    } else {
      EXPECT_EQ(with_gradient, static_cast<int>(names.size()));
    }
    // Straight through: each master's gradient is the gradient with respect to the
    // fake-quantized weight, i.e. what a model holding the served FP8 weights gets.
    auto served = Served(client->options(), Fp8Snapshot(*client, 16, DType::kF32), 16);
    ASSERT_NE(served, nullptr);
    auto served_first = served->ForwardBackward(data, "cross_entropy");
    ASSERT_TRUE(served_first.ok());
    EXPECT_EQ(served_first->loss, first->loss);
    auto served_params = served->model().named_parameters();
    for (const std::string& name : names) {
      const torch::Tensor &mine = params[name].grad(), &theirs = served_params[name].grad();
      ASSERT_EQ(mine.defined(), theirs.defined()) << name;
      if (mine.defined()) {
        EXPECT_TRUE(torch::equal(mine, theirs)) << name;
      }
    }
    ASSERT_TRUE(client->OptimStep({.lr = 1e-2, .beta2 = 0.99}).ok());
    int moved = 0;
    for (const std::string& name : names) moved += !torch::equal(before[name], params[name]);
    EXPECT_EQ(moved, with_gradient);

    double last = 0;
    for (int step = 1; step < 60; ++step) {
      auto m = client->ForwardBackward(data, "cross_entropy");
      ASSERT_TRUE(m.ok());
      last = m->loss;
      ASSERT_TRUE(client->OptimStep({.lr = 1e-2, .beta2 = 0.99}).ok());
    }
    EXPECT_GT(first->loss, 3.0);  // ~log(40) at random init
    EXPECT_LT(last, 0.3) << "did not memorise through the fake-quantized weights";
  }
}

// LoRA + QAT: the frozen base is fake-quantized, the adapters are not; the result is what
// a worker computes with the FP8 base and the fp32 adapters.
TEST(Fp8QatTest, LoraAdaptsAFakeQuantizedBase) {
  const int64_t block = 16;
  const TrainerOptions options{.config = Tiny(false),
                               .seed = 7,
                               .lora = model::LoraOptions{.rank = 2, .alpha = 4},
                               .fp8_block = block,
                               .fp8_qat = true};
  auto trainer = MakeClient(options);
  ASSERT_NE(trainer, nullptr);
  const auto data = Sequences(3, 10, 40, 8);
  auto before = trainer->Forward(data);
  ASSERT_TRUE(before.ok());
  Train(*trainer, data, 5);
  auto after = trainer->Forward(data);
  ASSERT_TRUE(after.ok());
  EXPECT_NE(before->logprobs, after->logprobs) << "the adapters did not train";

  auto base = Fp8Snapshot(*trainer, block, DType::kF32);
  auto adapters = model::SnapshotWeights(trainer->model(), DType::kF32, /*adapters_only=*/true);
  ASSERT_TRUE(adapters.ok());
  TrainerOptions plain = options;
  plain.fp8_qat = false;
  auto served = MakeClient(plain);
  ASSERT_NE(served, nullptr);
  ASSERT_TRUE(model::LoadFp8Weights(served->model(), base.view(), "base", block).ok());
  ASSERT_TRUE(model::LoadAdapters(served->model(), adapters->view(), "adapters").ok());
  const Gap gap = Compare(*served, *trainer, data, /*replay=*/false);
  EXPECT_EQ(gap.max_abs, 0.0) << "k3 " << gap.k3;
}

TEST(Fp8QatTest, RefusesABadBlock) {
  auto client = TrainingClient::Create({.config = Tiny(false), .fp8_block = 0, .fp8_qat = true});
  ASSERT_FALSE(client.ok());
  EXPECT_NE(client.status().message().find("block"), std::string::npos)
      << client.status().ToString();
}

// (c) Without QAT the trainer's logprobs are visibly off the FP8 engine's; with QAT they
// are the same (up to the replay effect Compare describes). Prints the k3 figures (served vs
// trainer) for BF16 and FP8 serving.
TEST(Fp8QatTest, QatClosesTheGapToTheFp8Engine) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    const int64_t block = 128;
    const auto data = Sequences(4, 12, 40, 10);
    auto plain = MakeClient({.config = Tiny(moe), .seed = 9});
    auto qat = MakeClient({.config = Tiny(moe), .seed = 9, .fp8_block = block, .fp8_qat = true});
    ASSERT_TRUE(plain != nullptr && qat != nullptr);
    Train(*plain, data, 20);
    Train(*qat, data, 20);

    auto fp8_of = [&](TrainingClient& trainer, DType other) {
      return Served(trainer.options(), Fp8Snapshot(trainer, block, other), block);
    };
    auto bf16_of = [&](TrainingClient& trainer) -> std::unique_ptr<TrainingClient> {
      auto snapshot = model::SnapshotWeights(trainer.model(), DType::kBF16);
      EXPECT_TRUE(snapshot.ok());
      auto served = MakeClient({.config = trainer.options().config, .seed = 999});
      EXPECT_TRUE(model::LoadWeights(served->model(), snapshot->view(), "bf16").ok());
      return served;
    };
    const Gap fp8_plain = Compare(*fp8_of(*plain, DType::kF32), *plain, data, /*replay=*/true);
    const Gap fp8_qat = Compare(*fp8_of(*qat, DType::kF32), *qat, data, /*replay=*/true);
    const Gap fp8_bf16_plain =
        Compare(*fp8_of(*plain, DType::kBF16), *plain, data, /*replay=*/true);
    const Gap fp8_bf16_qat = Compare(*fp8_of(*qat, DType::kBF16), *qat, data, /*replay=*/true);
    const Gap bf16_plain = Compare(*bf16_of(*plain), *plain, data, /*replay=*/true);
    std::printf(
        "[%s, block %lld] k3 served vs trainer (max |d logprob|):\n"
        "  FP8 projections, rest F32,  trainer without QAT: %.3e (%.3e)\n"
        "  FP8 projections, rest F32,  trainer with QAT:    %.3e (%.3e)\n"
        "  FP8 projections, rest BF16, trainer without QAT: %.3e (%.3e)\n"
        "  FP8 projections, rest BF16, trainer with QAT:    %.3e (%.3e)\n"
        "  BF16 everything,            trainer without QAT: %.3e (%.3e)\n",
        moe ? "moe" : "dense", static_cast<long long>(block), fp8_plain.k3, fp8_plain.max_abs,
        fp8_qat.k3, fp8_qat.max_abs, fp8_bf16_plain.k3, fp8_bf16_plain.max_abs, fp8_bf16_qat.k3,
        fp8_bf16_qat.max_abs, bf16_plain.k3, bf16_plain.max_abs);
    EXPECT_GT(fp8_plain.k3, 1e-8) << "QAT would have nothing to close";
    EXPECT_LE(fp8_qat.k3, 1e-9);
    if (!moe) {
      EXPECT_EQ(fp8_qat.max_abs, 0.0);
      EXPECT_LT(fp8_bf16_qat.k3, fp8_bf16_plain.k3);
    }
    // MoE with the rest in BF16: both gaps are ~1e-7 and BF16 rounding outside the FP8
    // projections (which QAT does not model) dominates them, so their order follows the
    // CPU's GEMM rounding (seen both ways on two Xeons). The exact match above (rest in F32)
    // is what shows QAT closing the FP8 gap on MoE.
  }
}

}  // namespace
}  // namespace flywheel::trainer
