// Packed frozen experts (model/packed.h, TrainerOptions::pack_frozen_experts): the formats
// against references written here from their definitions, LoRA training with packed experts
// against the same training on an unpacked model whose experts hold the dequantized values
// (loss and adapter gradients to 1e-6), re-dequantization in the backward pass, snapshots
// that still carry the experts, memory, and the errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <set>

#include "model/fp8.h"
#include "model/packed.h"
#include "model/weights.h"
#include "tests/model/tiny_models.h"
#include "trainer/training_client.h"

namespace flywheel::trainer {
namespace {

using model::PackFormat;

// The reference integer quantizer: the smallest power-of-two scale 2^e with
// amax / 2^e <= limit, q = round-half-even(w / 2^e).
std::vector<float> ReferenceInt(const std::vector<float>& group, int limit) {
  float amax = 0;
  for (float w : group) amax = std::max(amax, std::fabs(w));
  int e = 0;
  if (amax > 0) {
    e = -130;
    while (std::ldexp(static_cast<double>(amax), -e) > limit) ++e;
  }
  std::vector<float> out;
  for (float w : group) {
    const double q = std::nearbyint(std::ldexp(static_cast<double>(w), -e));
    out.push_back(static_cast<float>(std::ldexp(q, e)));
  }
  return out;
}

torch::Tensor RandomWeight(int64_t rows, int64_t cols, uint32_t seed) {
  torch::manual_seed(seed);
  torch::Tensor w = torch::randn({rows, cols}) * 0.05;
  // Rows and groups of very different magnitudes, exact zeros, a zero row.
  w.index_put_({0}, w[0] * 1000);
  w.index_put_({1}, 0);
  w.index_put_({2, 5}, 0);
  w.index_put_({3}, w[3] * 1e-6);
  return w;
}

TEST(PackedWeightTest, IntFormatsMatchTheirDefinition) {
  const int64_t rows = 7, cols = 71;  // odd, and the last group is partial (7 of 32, 1 of 5)
  const torch::Tensor w = RandomWeight(rows, cols, 1);
  // int4 with the default group (32) and with an odd one (a group's halves are uneven).
  for (auto [format, limit, group, block] :
       {std::tuple{PackFormat::kInt8, 127, cols, int64_t{0}},
        std::tuple{PackFormat::kInt4, 7, int64_t{32}, int64_t{0}},
        std::tuple{PackFormat::kInt4, 7, int64_t{5}, int64_t{5}}}) {
    auto packed = model::PackWeight(w, format, block);
    ASSERT_TRUE(packed.ok()) << packed.status().ToString();
    const torch::Tensor got = packed->Dequantize();
    ASSERT_EQ(got.sizes(), w.sizes());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t begin = 0; begin < cols; begin += group) {
        const int64_t end = std::min(cols, begin + group);
        std::vector<float> values;
        for (int64_t c = begin; c < end; ++c) values.push_back(w[r][c].item<float>());
        const std::vector<float> want = ReferenceInt(values, limit);
        for (int64_t c = begin; c < end; ++c) {
          ASSERT_EQ(got[r][c].item<float>(), want[c - begin])
              << model::PackFormatName(format) << " at [" << r << ", " << c << "]";
        }
      }
    }
    // Power-of-two scales: the dequantized values are exact in bf16.
    EXPECT_TRUE(torch::equal(got.to(torch::kBFloat16).to(torch::kFloat), got));
  }
}

TEST(PackedWeightTest, Fp8IsTheServedBlockQuantization) {
  const int64_t rows = 40, cols = 24, block = 16;
  const torch::Tensor w = RandomWeight(rows, cols, 2);
  auto packed = model::PackWeight(w, PackFormat::kFp8, block);
  ASSERT_TRUE(packed.ok());
  const model::Fp8Block q = model::QuantizeBlockwise(w.data_ptr<float>(), rows, cols, block);
  std::vector<float> want(rows * cols);
  model::DequantizeBlockwise(q.data.data(), q.scale_inv.data(), rows, cols, block, want.data());
  const torch::Tensor got = packed->Dequantize();
  EXPECT_TRUE(torch::equal(got, torch::from_blob(want.data(), {rows, cols}, torch::kFloat)));
  EXPECT_EQ(packed->bytes(), rows * cols + 3 * 2 * 4);  // codes + [3, 2] fp32 scales
}

TEST(PackedWeightTest, BytesPerFormat) {
  const torch::Tensor w = torch::randn({256, 512});
  const int64_t bf16 = w.numel() * 2;
  auto fp8 = model::PackWeight(w, PackFormat::kFp8);
  auto int8 = model::PackWeight(w, PackFormat::kInt8);
  auto int4 = model::PackWeight(w, PackFormat::kInt4);
  ASSERT_TRUE(fp8.ok() && int8.ok() && int4.ok());
  EXPECT_EQ(fp8->bytes(), w.numel() + 2 * 4 * 4);
  EXPECT_EQ(int8->bytes(), w.numel() + 256);
  EXPECT_EQ(int4->bytes(), w.numel() / 2 + 256 * 16);
  EXPECT_LE(static_cast<double>(int4->bytes()) / bf16, 0.3);
}

TEST(PackedWeightTest, RefusesBadInput) {
  EXPECT_FALSE(model::PackWeight(torch::randn({4}), PackFormat::kInt8).ok());
  EXPECT_FALSE(model::PackWeight(torch::randn({4, 4}), PackFormat::kNone).ok());
  torch::Tensor nan = torch::randn({4, 4});
  nan[1][2] = std::nanf("");
  auto status = model::PackWeight(nan, PackFormat::kInt4).status();
  EXPECT_NE(status.message().find("NaN"), std::string::npos) << status.ToString();
  auto parsed = model::ParsePackFormat("nf4");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("nf4"), std::string::npos);
  EXPECT_EQ(*model::ParsePackFormat("int4"), PackFormat::kInt4);
}

model::ModelConfig TinyMoe() {
  return testing::TinyConfig({.vocab = 40, .experts = 4, .moe_intermediate = 24});
}

TrainerOptions LoraOptions(PackFormat format) {
  return {.config = TinyMoe(),
          .seed = 3,
          .lora = model::LoraOptions{.rank = 4, .alpha = 8},
          .pack_frozen_experts = format,
          .pack_block = format == PackFormat::kFp8 ? 16 : 0};
}

std::vector<Datum> Sequences(int count, int length, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Datum> out;
  for (int i = 0; i < count; ++i) {
    Datum d;
    for (int t = 0; t < length - i % 3; ++t) {
      d.tokens.push_back(static_cast<int32_t>(rng() % 40));
      d.target_tokens.push_back(static_cast<int32_t>(rng() % 40));
    }
    out.push_back(std::move(d));
  }
  return out;
}

std::map<std::string, torch::Tensor> AdapterGrads(TrainingClient& client) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : client.model().named_parameters()) {
    if (item.value().requires_grad()) out[item.key()] = item.value().grad().clone();
  }
  return out;
}

// The unpacked twin: same seed (same adapters), experts overwritten with the packed model's
// dequantized values.
std::unique_ptr<TrainingClient> UnpackedTwin(TrainingClient& packed, PackFormat format) {
  TrainerOptions options = LoraOptions(format);
  options.pack_frozen_experts = PackFormat::kNone;
  auto twin = TrainingClient::Create(options);
  EXPECT_TRUE(twin.ok());
  auto params = (*twin)->model().named_parameters();
  torch::NoGradGuard no_grad;
  for (const auto& [name, weight] : packed.model().PackedWeights())
    params[name].copy_(weight->Dequantize());
  return std::move(*twin);
}

TEST(PackedExpertsTest, LoraTrainingEqualsUnpackedDequantized) {
  for (PackFormat format : {PackFormat::kFp8, PackFormat::kInt8, PackFormat::kInt4}) {
    SCOPED_TRACE(model::PackFormatName(format));
    auto packed = TrainingClient::Create(LoraOptions(format));
    ASSERT_TRUE(packed.ok()) << packed.status().ToString();
    auto twin = UnpackedTwin(**packed, format);
    const auto data = Sequences(4, 12, 5);
    for (int step = 0; step < 3; ++step) {
      auto a = (*packed)->ForwardBackward(data, "cross_entropy");
      auto b = twin->ForwardBackward(data, "cross_entropy");
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_NEAR(a->loss, b->loss, 1e-6) << "step " << step;
      const auto ga = AdapterGrads(**packed), gb = AdapterGrads(*twin);
      ASSERT_EQ(ga.size(), gb.size());
      bool expert_adapter = false;
      for (const auto& [name, grad] : ga) {
        ASSERT_TRUE(gb.count(name)) << name;
        EXPECT_LE((grad - gb.at(name)).abs().max().item<double>(), 1e-6) << name;
        expert_adapter |= name.find(".experts.") != std::string::npos &&
                          grad.abs().max().item<double>() > 0;
      }
      EXPECT_TRUE(expert_adapter) << "no gradient reached an expert's adapter";
      ASSERT_TRUE((*packed)->OptimStep({.lr = 1e-2}).ok());
      ASSERT_TRUE(twin->OptimStep({.lr = 1e-2}).ok());
    }
  }
}

TEST(PackedExpertsTest, BackwardDequantizesAgainInsteadOfKeepingWeights) {
  auto client = TrainingClient::Create(LoraOptions(PackFormat::kInt4));
  ASSERT_TRUE(client.ok());
  const auto data = Sequences(2, 8, 9);
  const int64_t before = model::PackedDequantizeCount();
  auto forward = (*client)->Forward(data);  // no gradient: one dequantization per use
  ASSERT_TRUE(forward.ok());
  const int64_t forward_only = model::PackedDequantizeCount() - before;
  EXPECT_GT(forward_only, 0);
  const int64_t start = model::PackedDequantizeCount();
  ASSERT_TRUE((*client)->ForwardBackward(data, "cross_entropy").ok());
  // The same experts run; each is dequantized in the forward and again in the backward.
  EXPECT_EQ(model::PackedDequantizeCount() - start, 2 * forward_only);
}

// The graph keeps what its backward needs: the packed codes outlive the model, and the
// adapters' gradients equal those of a twin that is still alive.
TEST(PackedExpertsTest, BackwardAfterTheModelIsGone) {
  const torch::Tensor tokens = torch::randint(0, 40, {2, 6}, torch::kLong);
  auto build = [] {
    torch::manual_seed(21);
    auto model = std::make_shared<model::TransformerImpl>(TinyMoe());
    EXPECT_TRUE(model->EnableLora({.rank = 2}).ok());
    EXPECT_TRUE(model->PackFrozenExperts(PackFormat::kInt4).ok());
    return model;
  };
  auto expert_adapters = [](model::TransformerImpl& m) {
    std::vector<torch::Tensor> out;
    for (const auto& item : m.named_parameters())
      if (item.key().find(".experts.") != std::string::npos &&
          item.key().find("lora_B") != std::string::npos)
        out.push_back(item.value());
    return out;
  };
  std::vector<torch::Tensor> orphaned;
  torch::Tensor loss;
  {
    auto model = build();
    orphaned = expert_adapters(*model);
    loss = model->forward(tokens).logits.logsumexp(-1).sum();
  }
  loss.backward();  // the model and its ProjImpls are gone
  auto twin = build();
  twin->forward(tokens).logits.logsumexp(-1).sum().backward();
  const std::vector<torch::Tensor> alive = expert_adapters(*twin);
  ASSERT_EQ(orphaned.size(), alive.size());
  double total = 0;
  for (size_t i = 0; i < alive.size(); ++i) {
    ASSERT_TRUE(orphaned[i].grad().defined() == alive[i].grad().defined()) << i;
    if (!alive[i].grad().defined()) continue;
    EXPECT_TRUE(torch::equal(orphaned[i].grad(), alive[i].grad())) << i;
    total += alive[i].grad().abs().sum().item<double>();
  }
  EXPECT_GT(total, 0);
}

TEST(PackedExpertsTest, SavedStatesRecordThePacking) {
  const std::string dir = ::testing::TempDir() + "/packed_state";
  auto int4 = TrainingClient::Create(LoraOptions(PackFormat::kInt4));
  ASSERT_TRUE(int4.ok());
  ASSERT_TRUE((*int4)->SaveState(dir, /*include_frozen=*/false).ok());
  auto again = TrainingClient::Create(LoraOptions(PackFormat::kInt4));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)->LoadState(dir, false).ok());
  auto fp8 = TrainingClient::Create(LoraOptions(PackFormat::kFp8));
  ASSERT_TRUE(fp8.ok());
  Status other = (*fp8)->LoadState(dir, false);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.message().find("packed experts"), std::string::npos) << other.ToString();
  auto unpacked = TrainingClient::Create(LoraOptions(PackFormat::kNone));
  ASSERT_TRUE(unpacked.ok());
  EXPECT_FALSE((*unpacked)->LoadState(dir, false).ok());
}

TEST(PackedExpertsTest, ExpertsLeaveTheParametersButNotTheSnapshots) {
  auto packed = TrainingClient::Create(LoraOptions(PackFormat::kFp8));
  ASSERT_TRUE(packed.ok());
  model::TransformerImpl& m = (*packed)->model();
  EXPECT_EQ(m.packed_experts(), PackFormat::kFp8);
  // 2 layers x 4 experts x gate/up/down.
  EXPECT_EQ(m.PackedWeights().size(), 24u);
  for (const auto& item : m.named_parameters()) {
    const bool expert_base = item.key().find(".experts.") != std::string::npos &&
                             item.key().find(".lora_") == std::string::npos;
    EXPECT_FALSE(expert_base) << item.key() << " is still a parameter";
  }
  auto twin = UnpackedTwin(**packed, PackFormat::kFp8);
  auto a = model::SnapshotWeights(m, DType::kBF16, false);
  auto b = model::SnapshotWeights(twin->model(), DType::kBF16, false);
  ASSERT_TRUE(a.ok() && b.ok());
  std::map<std::string, std::vector<std::byte>> want;
  for (const auto& t : b->tensors) want[t.name] = t.data;
  ASSERT_EQ(a->tensors.size(), want.size());
  for (const auto& t : a->tensors) {
    ASSERT_TRUE(want.count(t.name)) << t.name;
    EXPECT_EQ(t.data, want[t.name]) << t.name;
  }
}

// Every expert weight is held in exactly the bytes its format defines (BytesPerFormat checks
// the ratio to bf16 on a realistic shape; these tiny ones are dominated by their scales).
TEST(PackedExpertsTest, ExpertsHoldTheirFormatsBytes) {
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  for (PackFormat format : {PackFormat::kFp8, PackFormat::kInt8, PackFormat::kInt4}) {
    TrainerOptions options = LoraOptions(format);
    options.pack_block = 0;  // the defaults: fp8 128, int4 32
    auto client = TrainingClient::Create(options);
    ASSERT_TRUE(client.ok());
    int64_t packed = 0, want = 0;
    for (const auto& [name, w] : (*client)->model().PackedWeights()) {
      packed += w->bytes();
      const int64_t r = w->rows, c = w->cols;
      want += format == PackFormat::kFp8    ? r * c + 4 * ceil_div(r, 128) * ceil_div(c, 128)
              : format == PackFormat::kInt8 ? r * c + r
                                            : r * ceil_div(c, 32) * 16 + r * ceil_div(c, 32);
    }
    EXPECT_EQ(packed, want) << model::PackFormatName(format);
  }
}

TEST(PackedExpertsTest, RefusesWhatCannotBePacked) {
  TrainerOptions no_lora = LoraOptions(PackFormat::kInt8);
  no_lora.lora.reset();
  auto a = TrainingClient::Create(no_lora);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("LoRA"), std::string::npos) << a.status().ToString();

  TrainerOptions dense = LoraOptions(PackFormat::kInt8);
  dense.config = testing::TinyConfig({.vocab = 40});
  auto b = TrainingClient::Create(dense);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("MoE"), std::string::npos) << b.status().ToString();

  TrainerOptions fp8 = LoraOptions(PackFormat::kInt8);
  fp8.fp8_serving = true;
  EXPECT_FALSE(TrainingClient::Create(fp8).ok());
  TrainerOptions f16 = LoraOptions(PackFormat::kInt8);
  f16.serving_dtype = DType::kF16;
  auto c = TrainingClient::Create(f16);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("F16"), std::string::npos) << c.status().ToString();

  // A non-finite expert weight is named, and the model is left unpacked.
  auto model = std::make_shared<model::TransformerImpl>(TinyMoe());
  ASSERT_TRUE(model->EnableLora({.rank = 2}).ok());
  {
    torch::NoGradGuard no_grad;
    model->named_parameters()["model.layers.1.mlp.experts.2.down_proj.weight"][0][0] = INFINITY;
  }
  Status status = model->PackFrozenExperts(PackFormat::kFp8);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("model.layers.1.mlp.experts.2.down_proj.weight"),
            std::string::npos)
      << status.ToString();
  EXPECT_TRUE(model->PackedWeights().empty());
  EXPECT_EQ(model->packed_experts(), PackFormat::kNone);
}

}  // namespace
}  // namespace flywheel::trainer

namespace flywheel::trainer {
namespace {

// Not a check: nanoseconds per dequantized weight for each format (an expert's 768 x 512),
// against a plain copy of the fp32 weight. Run with --gtest_also_run_disabled_tests
// --gtest_filter='*DequantizeSpeed*'.
TEST(PackedWeightTest, DISABLED_DequantizeSpeed) {
  const torch::Tensor w = torch::randn({768, 512}) * 0.02;
  const int reps = 200;
  auto time = [&](const std::function<void()>& fn) {
    fn();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() * 1e9 /
           (reps * static_cast<double>(w.numel()));
  };
  std::printf("copy of the fp32 weight: %.3f ns/weight\n", time([&] { (void)w.clone(); }));
  for (PackFormat format : {PackFormat::kFp8, PackFormat::kInt8, PackFormat::kInt4}) {
    auto packed = model::PackWeight(w, format);
    ASSERT_TRUE(packed.ok());
    std::printf("%s: %.3f ns/weight\n", model::PackFormatName(format),
                time([&] { (void)packed->Dequantize(); }));
  }
}

}  // namespace
}  // namespace flywheel::trainer
