// The training client end to end on tiny models: SFT memorisation, accumulation, the
// custom-loss path against the fused one, bit-exact resume, sampler snapshots (in-process
// publishing included), LoRA mode, and the errors users hit first.
#include "trainer/training_client.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "checkpoint/hash.h"
#include "checkpoint/safetensors.h"
#include "sync/publisher.h"
#include "tests/model/tiny_models.h"
#include "tests/trainer/trainer_test_util.h"
#include "model/weights.h"
#include "transport/asio.h"

namespace flywheel::trainer {
namespace {

namespace fs = std::filesystem;
namespace asio = boost::asio;

// RL fields: sampling logprobs near the model's, advantages per sequence.
void AddRlFields(std::vector<Datum>& datums, TrainingClient& client, uint32_t seed) {
  auto forward = client.Forward(datums);
  ASSERT_TRUE(forward.ok());
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0, 0.1f);
  for (size_t i = 0; i < datums.size(); ++i) {
    Datum& d = datums[i];
    d.logprobs = forward->logprobs[i];
    for (float& lp : d.logprobs) lp += noise(rng);
    d.advantages.assign(d.tokens.size(), i % 2 ? 1.0f : -0.5f);
  }
}

double MaxDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  return m;
}

fs::path TempDir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() /
                 ("flywheel_trainer_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(TrainingClientTest, SftMemorisesAFewSequences) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    auto client = MakeClient({.config = Tiny(moe), .seed = 1});
    ASSERT_NE(client, nullptr);
    const auto data = Sequences(4, 12, 40, 2);
    double first = 0, last = 0;
    for (int step = 0; step < 120; ++step) {
      auto m = client->ForwardBackward(data, "cross_entropy");
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      if (step == 0) first = m->loss;
      last = m->loss;
      auto s = client->OptimStep({.lr = 1e-2, .beta2 = 0.99});
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      EXPECT_EQ(s->step, static_cast<uint64_t>(step + 1));
    }
    EXPECT_GT(first, 3.0);  // ~log(40) at random init
    EXPECT_LT(last, 0.05) << "did not memorise";
  }
}

TEST(TrainingClientTest, ForwardMatchesTheTrainingPassAndReportsRouting) {
  auto client = MakeClient({.config = Tiny(true), .seed = 3});
  auto data = Sequences(3, 6, 40, 4);
  auto forward = client->Forward(data);
  ASSERT_TRUE(forward.ok());
  ASSERT_EQ(forward->logprobs.size(), 3u);
  EXPECT_EQ(forward->logprobs[1].size(), data[1].tokens.size());
  // Routing: T x 2 MoE layers x top-2 per datum; replaying it gives the same logprobs.
  EXPECT_EQ(forward->routing[0].size(), data[0].tokens.size() * 2 * 2);
  for (size_t i = 0; i < data.size(); ++i) data[i].routing = forward->routing[i];
  auto replayed = client->Forward(data);
  ASSERT_TRUE(replayed.ok());
  EXPECT_EQ(replayed->logprobs, forward->logprobs);
  for (const auto& lps : forward->logprobs) {
    for (float lp : lps) EXPECT_LT(lp, 0.0f);
  }
}

TEST(TrainingClientTest, AccumulationEqualsOneBigBatch) {
  for (Normalization norm : {Normalization::kTokens, Normalization::kSequences}) {
    const LossConfig config{.aggregation = norm == Normalization::kTokens
                                               ? Aggregation::kTokenMean
                                               : Aggregation::kSeqMeanTokenMean};
    auto one = MakeClient({.config = Tiny(), .seed = 5, .normalization = norm});
    auto two = MakeClient({.config = Tiny(), .seed = 5, .normalization = norm});
    auto data = Sequences(6, 9, 40, 6);
    AddRlFields(data, *one, 7);
    ASSERT_TRUE(one->ForwardBackward(data, "ppo", config).ok());
    const std::vector<Datum> first(data.begin(), data.begin() + 2),
        second(data.begin() + 2, data.end());
    ASSERT_TRUE(two->ForwardBackward(first, "ppo", config).ok());
    ASSERT_TRUE(two->ForwardBackward(second, "ppo", config).ok());
    auto a = one->OptimStep({.lr = 1e-3});
    auto b = two->OptimStep({.lr = 1e-3});
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_NEAR(a->grad_norm, b->grad_norm, 1e-5 * a->grad_norm);
    EXPECT_GT(a->grad_norm, 0);
    // Adam normalises the gradient away, so the norm above is the sharp check; parameters
    // agree to 1% of one step (near-zero gradient entries amplify float rounding).
    EXPECT_LT(MaxDiff(Params(*one), Params(*two)), 1e-5);
  }
}

TEST(TrainingClientTest, CustomLossMatchesTheFusedLoss) {
  auto fused = MakeClient({.config = Tiny(true), .seed = 8});
  auto custom = MakeClient({.config = Tiny(true), .seed = 8});
  auto data = Sequences(4, 8, 40, 9);
  AddRlFields(data, *fused, 10);
  auto m1 = fused->ForwardBackward(data, "importance_sampling");
  ASSERT_TRUE(m1.ok());
  // The same loss written by a user: token-mean of -exp(lp - sampling) * A.
  CustomLossFn fn = [](const std::vector<Datum>& datums,
                       const std::vector<torch::Tensor>& logprobs) -> Result<torch::Tensor> {
    torch::Tensor total = torch::zeros({});
    double tokens = 0;
    for (size_t i = 0; i < datums.size(); ++i) {
      torch::Tensor sampling = torch::tensor(datums[i].logprobs);
      torch::Tensor adv = torch::tensor(datums[i].advantages);
      total = total - ((logprobs[i] - sampling).exp() * adv).sum();
      tokens += datums[i].tokens.size();
    }
    return total / tokens;
  };
  auto m2 = custom->ForwardBackwardCustom(data, fn);
  ASSERT_TRUE(m2.ok()) << m2.status().ToString();
  EXPECT_NEAR(m1->loss, m2->loss, 1e-6);
  auto s1 = fused->OptimStep({.lr = 1e-3});
  auto s2 = custom->OptimStep({.lr = 1e-3});
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_NEAR(s1->grad_norm, s2->grad_norm, 1e-4 * s1->grad_norm);
  EXPECT_LT(MaxDiff(Params(*fused), Params(*custom)), 1e-6);

  CustomLossFn constant = [](const std::vector<Datum>&,
                             const std::vector<torch::Tensor>&) -> Result<torch::Tensor> {
    return torch::ones({});
  };
  EXPECT_FALSE(custom->ForwardBackwardCustom(data, constant).ok());
}

TEST(TrainingClientTest, SaveAndLoadStateResumesBitExactly) {
  const fs::path dir = TempDir("state");
  auto data = Sequences(4, 10, 40, 11);
  auto a = MakeClient({.config = Tiny(true), .seed = 12});
  AddRlFields(data, *a, 13);
  auto train = [&](TrainingClient& client, int steps) {
    for (int i = 0; i < steps; ++i) {
      ASSERT_TRUE(client.ForwardBackward(data, "ppo", {.clip_high = 0.28}).ok());
      ASSERT_TRUE(client.OptimStep({.lr = 3e-3, .weight_decay = 0.01}).ok());
    }
  };
  train(*a, 2);
  ASSERT_TRUE(a->SaveWeightsForSampler(2).ok());
  ASSERT_TRUE(a->SaveState((dir / "ckpt").string()).ok());
  ASSERT_TRUE(a->SaveState((dir / "ckpt").string()).ok());  // replacing a state works too
  train(*a, 3);

  auto b =
      MakeClient({.config = Tiny(true), .seed = 99});  // different init: all comes from the state
  ASSERT_TRUE(b->LoadState((dir / "ckpt").string()).ok());
  EXPECT_EQ(b->step(), 2u);
  EXPECT_EQ(b->last_sampler_version(), 2u);
  train(*b, 3);
  EXPECT_TRUE(AllEqual(Params(*a), Params(*b)));
  EXPECT_EQ(a->step(), b->step());

  // Refusals: pending gradients, another config, a missing directory; b is left unchanged.
  ASSERT_TRUE(b->ForwardBackward(data, "ppo").ok());
  EXPECT_NE(b->SaveState((dir / "x").string()).message().find("pending"), std::string::npos);
  auto other = MakeClient({.config = Tiny(false), .seed = 1});
  EXPECT_EQ(other->LoadState((dir / "ckpt").string()).code(), StatusCode::kMismatch);
  EXPECT_EQ(other->LoadState((dir / "absent").string()).code(), StatusCode::kNotFound);
  // A state whose trainer.json has a field of the wrong type is corrupt, not a crash.
  fs::copy(dir / "ckpt", dir / "typo", fs::copy_options::recursive);
  std::ofstream(dir / "typo" / "trainer.json") << R"({"format": "one", "step": 2})";
  EXPECT_EQ(b->LoadState((dir / "typo").string()).code(), StatusCode::kCorruption);
  std::ofstream(dir / "typo" / "trainer.json") << R"({"format": 1, "step": "two"})";
  EXPECT_NE(b->LoadState((dir / "typo").string()).code(), StatusCode::kOk);
  fs::remove_all(dir);
}

TEST(TrainingClientTest, SamplerSnapshotHashesWhatItPublishes) {
  const fs::path dir = TempDir("publish");
  asio::io_context io;
  sync::PublisherOptions options;
  options.listen = {"127.0.0.1", 0};
  options.common.http = {"127.0.0.1", 0};
  options.log.dir = (dir / "state").string();
  auto publisher = sync::Publisher::Start(io.get_executor(), options);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  auto guard = asio::make_work_guard(io);
  std::thread thread([&] { io.run(); });

  auto client = MakeClient({.config = Tiny(), .seed = 14});
  client->AttachPublisher(publisher->get());
  auto v1 = client->SaveWeightsForSampler(1);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_EQ((*publisher)->version(), 1u);
  EXPECT_EQ(v1->bytes, v1->checkpoint.view().size() > 0 ? v1->bytes : 0u);
  auto hash = CheckpointHash(v1->checkpoint.view());
  ASSERT_TRUE(hash.ok());
  EXPECT_EQ(v1->weights_hash, hash->ToHex());
  for (const TensorView& t : v1->checkpoint.view()) EXPECT_EQ(t.dtype, DType::kBF16) << t.name;

  auto data = Sequences(2, 6, 40, 15);
  ASSERT_TRUE(client->ForwardBackward(data, "cross_entropy").ok());
  ASSERT_TRUE(client->OptimStep({.lr = 1e-3}).ok());
  auto v2 = client->SaveWeightsForSampler(2);
  ASSERT_TRUE(v2.ok());
  EXPECT_NE(v2->weights_hash, v1->weights_hash);
  EXPECT_EQ((*publisher)->version(), 2u);
  auto replay = client->SaveWeightsForSampler(2);
  ASSERT_FALSE(replay.ok());
  EXPECT_NE(replay.status().message().find("does not move forward"), std::string::npos);

  (*publisher)->Stop();
  guard.reset();
  io.stop();
  thread.join();
  fs::remove_all(dir);
}

TEST(TrainingClientTest, LoraModeTrainsAndShipsOnlyAdapters) {
  auto client =
      MakeClient({.config = Tiny(), .seed = 16, .lora = model::LoraOptions{.rank = 2, .alpha = 4}});
  ASSERT_NE(client, nullptr);
  auto full = MakeClient({.config = Tiny(), .seed = 16});
  std::vector<torch::Tensor> base_before;
  for (const auto& p : client->model().named_parameters()) {
    if (p.key().find(".lora_") == std::string::npos)
      base_before.push_back(p.value().detach().clone());
  }
  const auto data = Sequences(3, 8, 40, 17);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(client->ForwardBackward(data, "cross_entropy").ok());
    ASSERT_TRUE(client->OptimStep({.lr = 1e-2}).ok());
  }
  std::vector<torch::Tensor> base_after;
  for (const auto& p : client->model().named_parameters()) {
    if (p.key().find(".lora_") == std::string::npos)
      base_after.push_back(p.value().detach().clone());
  }
  EXPECT_TRUE(AllEqual(base_before, base_after)) << "LoRA mode changed a base weight";
  auto adapters = client->SaveWeightsForSampler(1);
  auto dense = full->SaveWeightsForSampler(1);
  ASSERT_TRUE(adapters.ok() && dense.ok());
  EXPECT_TRUE(adapters->adapters_only);
  EXPECT_LT(adapters->bytes * 5, dense->bytes) << adapters->bytes << " vs " << dense->bytes;
  // The adapters moved off B = 0: the adapted model differs from the base.
  auto lp_lora = client->Forward(data), lp_base = full->Forward(data);
  ASSERT_TRUE(lp_lora.ok() && lp_base.ok());
  EXPECT_NE(lp_lora->logprobs, lp_base->logprobs);
}

TEST(TrainingClientTest, ClearErrors) {
  auto client = MakeClient({.config = Tiny(), .seed = 18});
  auto data = Sequences(2, 5, 40, 19);
  auto expect = [](const Status& s, const std::string& needle) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  expect(client->ForwardBackward(data, "grpo++").status(), "unknown loss 'grpo++'");
  expect(client->ForwardBackward(data, "ppo").status(),
         "datum 0: logprobs has 0 entries, tokens has 5");
  auto bad = data;
  bad[1].target_tokens.pop_back();
  expect(client->ForwardBackward(bad, "cross_entropy").status(),
         "datum 1: target_tokens has 3 entries, tokens has 4");
  bad = data;
  bad[0].weights = {1, 1};
  expect(client->ForwardBackward(bad, "cross_entropy").status(), "datum 0: weights has 2 entries");
  bad = data;
  bad[0].tokens[2] = 40;
  expect(client->Forward(bad).status(), "outside the vocabulary [0, 40)");
  bad = data;
  bad[0].routing = {0, 1};
  expect(client->Forward(bad).status(), "the model is dense");
  expect(client->ForwardBackward({}, "cross_entropy").status(), "no datums");
  expect(client->ForwardBackward(data, "cross_entropy", {.clip_low = -1}).status(), "clip_low");
  expect(client->OptimStep({}).status(), "no gradients accumulated");
  ASSERT_TRUE(client->ForwardBackward(data, "cross_entropy").ok());
  expect(client->OptimStep({.lr = -1}).status(), "lr must be");
  expect(client->ForwardBackward(data, "dpo").status(), "ref_logprobs has 0 entries");
  model::ModelConfig wrong = Tiny();
  wrong.num_key_value_heads = 3;
  auto created = TrainingClient::Create({.config = wrong});
  expect(created.status(), "num_key_value_heads");
  auto moe = MakeClient({.config = Tiny(true), .seed = 1});
  bad = data;
  bad[0].routing.assign(bad[0].tokens.size() * 2 * 2, 7);
  bad[1].routing.assign(bad[1].tokens.size() * 2 * 2, 0);
  expect(moe->Forward(bad).status(), "names expert 7");
}

}  // namespace
}  // namespace flywheel::trainer
