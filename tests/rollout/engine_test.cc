// The rollout engine on tiny models: the KV cache against full recomputation, seeded
// sampling, continuous batching, logprob parity with the trainer, routing that round-trips
// into the trainer's replay, versions per token, request validation, top logprobs, token
// events for streaming, and cancellation.
#include "rollout/engine.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <set>

#include "tests/model/tiny_models.h"
#include "trainer/training_client.h"
#include "model/weights.h"

namespace flywheel::rollout {
namespace {

namespace fs = std::filesystem;

model::ModelConfig Tiny(bool moe) {
  return testing::TinyConfig({.vocab = 50, .experts = moe ? 6 : 0});
}

std::shared_ptr<model::TransformerImpl> MakeModel(bool moe, uint64_t seed) {
  torch::manual_seed(seed);
  auto m = std::make_shared<model::TransformerImpl>(Tiny(moe));
  // Sharper distributions than the 0.02 init, so greedy and sampled paths differ visibly.
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) {
    if (p.dim() == 2) p.mul_(8);
  }
  return m;
}

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<model::TransformerImpl> m,
                                   int64_t max_batch = 8) {
  auto engine = Engine::Create(std::move(m), {.max_batch = max_batch, .max_sequence = 64}, 1);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(*engine) : nullptr;
}

GenerationRequest Request(std::vector<int32_t> prompt, int64_t max_tokens, double temperature = 0,
                          std::optional<uint64_t> seed = std::nullopt) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.params.max_tokens = max_tokens;
  r.params.temperature = temperature;
  r.params.seed = seed;
  return r;
}

// Greedy decoding by re-running the whole sequence every step (no cache).
std::pair<std::vector<int32_t>, std::vector<float>> GreedyWithoutCache(
    model::TransformerImpl& m, std::vector<int32_t> sequence, int steps) {
  torch::NoGradGuard no_grad;
  std::vector<int32_t> out;
  std::vector<float> logprobs;
  for (int i = 0; i < steps; ++i) {
    torch::Tensor tokens =
        torch::tensor(std::vector<int64_t>(sequence.begin(), sequence.end())).view({1, -1});
    torch::Tensor logits = m.forward(tokens).logits[0][-1];
    torch::Tensor lp = torch::log_softmax(logits.to(torch::kDouble), -1);
    const int32_t token = static_cast<int32_t>(logits.argmax().item<int64_t>());
    out.push_back(token);
    logprobs.push_back(static_cast<float>(lp[token].item<double>()));
    sequence.push_back(token);
  }
  return {out, logprobs};
}

TEST(EngineTest, GreedyWithCacheEqualsRecomputation) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    auto m = MakeModel(moe, 1);
    auto engine = MakeEngine(m);
    const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3}, {7}, {4, 9, 9, 4, 30, 2, 11}};
    std::vector<GenerationRequest> requests;
    for (const auto& p : prompts) requests.push_back(Request(p, 12));
    auto results = engine->Generate(requests);
    ASSERT_TRUE(results.ok()) << results.status().ToString();
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto [tokens, logprobs] = GreedyWithoutCache(*m, prompts[i], 12);
      EXPECT_EQ((*results)[i].tokens, tokens) << "prompt " << i;
      ASSERT_EQ((*results)[i].logprobs.size(), logprobs.size());
      for (size_t t = 0; t < logprobs.size(); ++t)
        EXPECT_NEAR((*results)[i].logprobs[t], logprobs[t], 2e-5);
      EXPECT_EQ((*results)[i].finish_reason, "length");
    }
  }
}

TEST(EngineTest, SeededSamplingIsReproducibleWhateverTheBatch) {
  auto m = MakeModel(false, 2);
  auto alone = MakeEngine(m);
  auto a = alone->Generate({Request({5, 6, 7}, 20, 1.0, 42)});
  ASSERT_TRUE(a.ok());
  auto crowd = MakeEngine(m);
  auto b = crowd->Generate(
      {Request({1}, 5, 1.0, 1), Request({5, 6, 7}, 20, 1.0, 42), Request({2, 2}, 30, 0.7, 3)});
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*a)[0].tokens, (*b)[1].tokens);
  for (size_t t = 0; t < (*a)[0].logprobs.size(); ++t)
    EXPECT_NEAR((*a)[0].logprobs[t], (*b)[1].logprobs[t], 2e-5);
  auto other_seed = crowd->Generate({Request({5, 6, 7}, 20, 1.0, 43)});
  ASSERT_TRUE(other_seed.ok());
  EXPECT_NE((*other_seed)[0].tokens, (*a)[0].tokens);
  // Greedy and sampled differ at temperature 1 on this model.
  auto greedy = crowd->Generate({Request({5, 6, 7}, 20, 0)});
  ASSERT_TRUE(greedy.ok());
  EXPECT_NE((*greedy)[0].tokens, (*a)[0].tokens);
}

TEST(EngineTest, TopKAndTopPOnlyEverPickAllowedTokens) {
  auto m = MakeModel(false, 3);
  auto engine = MakeEngine(m);
  GenerationRequest top1 = Request({3, 4}, 10, 1.5, 9);
  top1.params.top_k = 1;
  GenerationRequest nucleus = Request({3, 4}, 10, 1.5, 9);
  nucleus.params.top_p = 1e-9;  // only the most likely token survives
  auto results = engine->Generate({top1, nucleus, Request({3, 4}, 10, 0)});
  ASSERT_TRUE(results.ok());
  EXPECT_EQ((*results)[0].tokens, (*results)[2].tokens);
  EXPECT_EQ((*results)[1].tokens, (*results)[2].tokens);
}

TEST(EngineTest, ContinuousBatchingMatchesRunningAlone) {
  auto m = MakeModel(true, 4);
  auto engine = MakeEngine(m, /*max_batch=*/2);
  // Three requests through two slots, one joining mid-flight, one stopping early.
  ASSERT_TRUE(engine->Submit(Request({1, 2, 3}, 10)).ok());
  ASSERT_TRUE(engine->Submit(Request({8, 8}, 3)).ok());
  std::map<uint64_t, GenerationResult> done;
  for (int i = 0; i < 2; ++i) {
    for (auto& r : engine->Step()) done.emplace(r.id, std::move(r));
  }
  ASSERT_TRUE(engine->Submit(Request({20, 21, 22, 23}, 7)).ok());
  EXPECT_EQ(engine->waiting() + engine->active(), 3 - done.size());
  while (done.size() < 3) {
    for (auto& r : engine->Step()) done.emplace(r.id, std::move(r));
  }
  auto solo = MakeEngine(m);
  const std::vector<std::pair<std::vector<int32_t>, int>> runs = {
      {{1, 2, 3}, 10}, {{8, 8}, 3}, {{20, 21, 22, 23}, 7}};
  uint64_t id = 1;
  for (const auto& [prompt, n] : runs) {
    auto alone = solo->Generate({Request(prompt, n)});
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(done.at(id).tokens, (*alone)[0].tokens) << "request " << id;
    ++id;
  }
}

TEST(EngineTest, StopTokensEndGeneration) {
  auto m = MakeModel(false, 5);
  auto engine = MakeEngine(m);
  auto free_run = engine->Generate({Request({2, 3}, 10)});
  ASSERT_TRUE(free_run.ok());
  GenerationRequest stopping = Request({2, 3}, 10);
  stopping.params.stop_tokens = {(*free_run)[0].tokens[2]};
  auto stopped = engine->Generate({stopping});
  ASSERT_TRUE(stopped.ok());
  // It stops at the first occurrence of the stop token, which it emits.
  const auto& full = (*free_run)[0].tokens;
  const size_t first = std::find(full.begin(), full.end(), full[2]) - full.begin();
  EXPECT_EQ((*stopped)[0].tokens, std::vector<int32_t>(full.begin(), full.begin() + first + 1));
  EXPECT_EQ((*stopped)[0].finish_reason, "stop");
}

// Parity: the trainer's forward on the very weights the engine served gives the same
// logprobs for the sampled sequences (temperature 1).
// The trainer's view of a generated sequence: prompt + generated, each position predicting
// the next (no routing).
trainer::Datum AsDatum(const GenerationResult& r) {
  trainer::Datum d;
  d.tokens = r.prompt;
  d.tokens.insert(d.tokens.end(), r.tokens.begin(), r.tokens.end() - 1);
  d.target_tokens.assign(r.prompt.begin() + 1, r.prompt.end());
  d.target_tokens.insert(d.target_tokens.end(), r.tokens.begin(), r.tokens.end());
  return d;
}

// `count` sampled requests (temperature 1, seeds 0..count-1) that return their routing.
std::vector<GenerationRequest> RoutedRequests(uint64_t count) {
  std::vector<GenerationRequest> requests;
  for (uint64_t s = 0; s < count; ++s) {
    GenerationRequest r = Request({static_cast<int32_t>(s + 1), 7, 9}, 16, 1.0, s);
    r.params.return_routing = true;
    requests.push_back(r);
  }
  return requests;
}

TEST(EngineTest, LogprobsMatchTheTrainerAndRoutingReplays) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    auto m = MakeModel(moe, 6);
    const fs::path dir =
        fs::temp_directory_path() / ("flywheel_engine_test_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    const std::string weights = (dir / "model.safetensors").string();
    ASSERT_TRUE(model::SaveModel(*m, weights, DType::kF32).ok());
    auto trainer = trainer::TrainingClient::Create({.config = Tiny(moe), .init_weights = weights});
    ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();

    auto engine = MakeEngine(m);
    auto results = engine->Generate(RoutedRequests(4));
    ASSERT_TRUE(results.ok());
    std::vector<trainer::Datum> datums;
    for (const auto& r : *results) {
      trainer::Datum d = AsDatum(r);
      if (moe) {
        EXPECT_EQ(r.routing.size(), d.tokens.size() * Tiny(true).NumMoeLayers() * 2);
        d.routing.assign(r.routing.begin(), r.routing.end());
      } else {
        EXPECT_TRUE(r.routing.empty());
      }
      datums.push_back(std::move(d));
    }
    auto recomputed = (*trainer)->Forward(datums);
    ASSERT_TRUE(recomputed.ok()) << recomputed.status().ToString();
    double k3 = 0, max_diff = 0, count = 0;
    for (size_t i = 0; i < datums.size(); ++i) {
      const auto& sampled = (*results)[i];
      const size_t offset = sampled.prompt.size() - 1;  // generated tokens' positions
      for (size_t t = 0; t < sampled.tokens.size(); ++t) {
        const double train = recomputed->logprobs[i][offset + t], sample = sampled.logprobs[t];
        const double delta = sample - train;  // k3 of sampler vs trainer
        k3 += std::exp(delta) - delta - 1;
        max_diff = std::max(max_diff, std::abs(delta));
        count += 1;
      }
      if (moe) {
        // The routing the engine used is the routing the trainer picks on its own.
        std::vector<int32_t> engine_routing(sampled.routing.begin(), sampled.routing.end());
        EXPECT_EQ(recomputed->routing[i], engine_routing);
      }
    }
    EXPECT_LT(k3 / count, 1e-6);
    EXPECT_LT(max_diff, 1e-4);
    fs::remove_all(dir);
  }
}

// The trainer's router has moved since the engine sampled (a later version): without
// replay it picks other experts for some tokens, so its logprobs drift from the sampler's;
// replaying the sampled routing uses the engine's experts and brings the logprobs back.
TEST(EngineTest, RoutingReplayChangesTheTrainersMoeResults) {
  auto sampler = MakeModel(/*moe=*/true, 6);
  auto engine = MakeEngine(sampler);
  auto results = engine->Generate(RoutedRequests(6));
  ASSERT_TRUE(results.ok());

  // The trainer: the same weights but every router perturbed.
  const fs::path dir =
      fs::temp_directory_path() / ("flywheel_replay_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string weights = (dir / "model.safetensors").string();
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(11);
    auto moved = MakeModel(true, 6);
    int routers = 0;
    for (auto& p : moved->named_parameters()) {
      if (p.key().find("mlp.gate.weight") != std::string::npos) {
        p.value().add_(torch::randn_like(p.value()) * 0.5);
        ++routers;
      }
    }
    ASSERT_GT(routers, 0);
    ASSERT_TRUE(model::SaveModel(*moved, weights, DType::kF32).ok());
  }
  auto trainer = trainer::TrainingClient::Create({.config = Tiny(true), .init_weights = weights});
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();

  std::vector<trainer::Datum> plain, replayed;
  for (const auto& r : *results) {
    trainer::Datum d = AsDatum(r);
    plain.push_back(d);
    d.routing.assign(r.routing.begin(), r.routing.end());
    replayed.push_back(std::move(d));
  }
  auto own = (*trainer)->Forward(plain);
  auto replay = (*trainer)->Forward(replayed);
  ASSERT_TRUE(own.ok() && replay.ok());
  double k3_own = 0, k3_replay = 0, count = 0;
  size_t rerouted = 0;
  for (size_t i = 0; i < results->size(); ++i) {
    const auto& sampled = (*results)[i];
    const std::vector<int32_t> engine_routing(sampled.routing.begin(), sampled.routing.end());
    EXPECT_EQ(replay->routing[i], engine_routing);  // replay used exactly the sampled experts
    for (size_t j = 0; j < engine_routing.size(); ++j) rerouted += own->routing[i][j] != engine_routing[j];
    const size_t offset = sampled.prompt.size() - 1;
    for (size_t t = 0; t < sampled.tokens.size(); ++t) {
      const double d_own = sampled.logprobs[t] - own->logprobs[i][offset + t];
      const double d_replay = sampled.logprobs[t] - replay->logprobs[i][offset + t];
      k3_own += std::exp(d_own) - d_own - 1;
      k3_replay += std::exp(d_replay) - d_replay - 1;
      count += 1;
    }
  }
  EXPECT_GT(rerouted, 0u) << "the perturbed routers chose the same experts everywhere";
  EXPECT_NE(own->logprobs, replay->logprobs);
  EXPECT_LT(k3_replay / count, k3_own / count) << "replay " << k3_replay / count << " vs own "
                                                << k3_own / count;
  fs::remove_all(dir);
}

TEST(EngineTest, VersionsAreTaggedPerTokenAcrossASwap) {
  auto m = MakeModel(false, 7);
  auto engine = MakeEngine(m);
  ASSERT_TRUE(engine->Submit(Request({1, 2}, 6)).ok());
  std::vector<GenerationResult> done;
  for (int i = 0; i < 2; ++i) {
    for (auto& r : engine->Step()) done.push_back(std::move(r));
  }
  ASSERT_TRUE(engine->SetVersion(2).ok());
  while (done.empty()) {
    for (auto& r : engine->Step()) done.push_back(std::move(r));
  }
  // Prefill + first decode sampled 2 tokens at version 1; the rest at version 2.
  EXPECT_EQ(done[0].versions, (std::vector<uint64_t>{1, 1, 1, 2, 2, 2}));
  EXPECT_FALSE(engine->SetVersion(1).ok());
}

TEST(EngineTest, InvalidRequestsAreClearErrors) {
  auto m = MakeModel(false, 8);
  auto engine = MakeEngine(m);
  auto expect = [&](GenerationRequest r, const std::string& needle) {
    auto id = engine->Submit(std::move(r));
    ASSERT_FALSE(id.ok());
    EXPECT_NE(id.status().message().find(needle), std::string::npos) << id.status().message();
  };
  expect(Request({}, 4), "prompt is empty");
  expect(Request({1, 50}, 4), "outside the vocabulary [0, 50)");
  expect(Request(std::vector<int32_t>(60, 1), 10), "exceeds the engine's max_sequence 64");
  expect(Request({1}, 0), "max_tokens");
  expect(Request({1}, 4, -1), "temperature");
  GenerationRequest bad_p = Request({1}, 4, 1);
  bad_p.params.top_p = 0;
  expect(bad_p, "top_p");
  GenerationRequest bad_stop = Request({1}, 4);
  bad_stop.params.stop_tokens = {99};
  expect(bad_stop, "stop token 99");
  // The engine keeps serving.
  auto ok = engine->Generate({Request({1}, 3)});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)[0].tokens.size(), 3u);
  EXPECT_FALSE(Engine::Create(m, {.max_batch = 0}, 1).ok());
  EXPECT_FALSE(Engine::Create(m, {.max_sequence = 1000}, 1).ok());
}

// Multi-LoRA: requests on two adapters and the base, interleaved in one batch, each get
// exactly the logprobs of their own adapter (checked with the trainer's LoRA model holding
// the same, served, factors).
TEST(EngineTest, MultiLoraRequestsDoNotLeakIntoEachOther) {
  const fs::path dir =
      fs::temp_directory_path() / ("flywheel_lora_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto base = MakeModel(false, 11);
  const std::string base_file = (dir / "base.safetensors").string();
  ASSERT_TRUE(model::SaveModel(*base, base_file, DType::kF32).ok());

  // Two adapters trained on different data from the same base.
  std::vector<std::unique_ptr<trainer::TrainingClient>> trainers;
  std::vector<trainer::SamplerSnapshot> snapshots;
  for (int a = 0; a < 2; ++a) {
    auto client =
        trainer::TrainingClient::Create({.config = Tiny(false),
                                         .init_weights = base_file,
                                         .seed = 20u + a,
                                         .lora = model::LoraOptions{.rank = 4, .alpha = 8}});
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    std::vector<trainer::Datum> data(2);
    for (int i = 0; i < 2; ++i) {
      for (int t = 0; t < 10; ++t) {
        data[i].tokens.push_back((t * (3 + a) + i) % 50);
        data[i].target_tokens.push_back((t * (3 + a) + i + 1 + a) % 50);
      }
    }
    for (int step = 0; step < 3; ++step) {
      ASSERT_TRUE((*client)->ForwardBackward(data, "cross_entropy").ok());
      ASSERT_TRUE((*client)->OptimStep({.lr = 5e-2}).ok());
    }
    auto snapshot = (*client)->SaveWeightsForSampler(1);
    ASSERT_TRUE(snapshot.ok());
    // The trainer's model now holds the served (bf16) factors: the reference for parity.
    ASSERT_TRUE(
        model::LoadAdapters((*client)->model(), snapshot->checkpoint.view(), "served").ok());
    snapshots.push_back(std::move(*snapshot));
    trainers.push_back(std::move(*client));
  }
  auto base_trainer =
      trainer::TrainingClient::Create({.config = Tiny(false), .init_weights = base_file});
  ASSERT_TRUE(base_trainer.ok());

  auto engine = MakeEngine(base);
  ASSERT_TRUE(engine->LoadAdapter("a", snapshots[0].checkpoint.view()).ok());
  ASSERT_TRUE(engine->LoadAdapter("b", snapshots[1].checkpoint.view()).ok());
  EXPECT_EQ(engine->adapters(), (std::vector<std::string>{"a", "b"}));
  const std::vector<std::string> which = {"a", "", "b", "a", "b", "", "b", "a"};
  std::vector<GenerationRequest> requests;
  for (size_t i = 0; i < which.size(); ++i) {
    GenerationRequest r = Request({static_cast<int32_t>(i + 1), 4, 4}, 10, 1.0, i);
    r.adapter = which[i];
    requests.push_back(r);
  }
  auto results = engine->Generate(requests);
  ASSERT_TRUE(results.ok()) << results.status().ToString();
  bool adapters_differ = false;
  for (size_t i = 0; i < which.size(); ++i) {
    const auto& r = (*results)[i];
    trainer::Datum d;
    d.tokens = r.prompt;
    d.tokens.insert(d.tokens.end(), r.tokens.begin(), r.tokens.end() - 1);
    d.target_tokens.assign(r.prompt.begin() + 1, r.prompt.end());
    d.target_tokens.insert(d.target_tokens.end(), r.tokens.begin(), r.tokens.end());
    trainer::TrainingClient& reference =
        which[i].empty() ? **base_trainer : *trainers[which[i] == "a" ? 0 : 1];
    auto recomputed = reference.Forward({d});
    ASSERT_TRUE(recomputed.ok());
    auto base_lp = (*base_trainer)->Forward({d});
    ASSERT_TRUE(base_lp.ok());
    for (size_t t = 0; t < r.tokens.size(); ++t) {
      const size_t position = r.prompt.size() - 1 + t;
      EXPECT_NEAR(r.logprobs[t], recomputed->logprobs[0][position], 1e-4)
          << "request " << i << " token " << t;
      if (!which[i].empty())
        adapters_differ |= std::abs(r.logprobs[t] - base_lp->logprobs[0][position]) > 1e-2;
    }
  }
  EXPECT_TRUE(adapters_differ)
      << "the adapters did not change the model: the test cannot see leakage";

  // Errors: an unknown adapter is a clear 4xx-style error; unloading one in use is refused.
  GenerationRequest unknown = Request({1}, 3);
  unknown.adapter = "c";
  auto refused = engine->Submit(unknown);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("unknown adapter 'c'"), std::string::npos);
  GenerationRequest busy = Request({1}, 30);
  busy.adapter = "a";
  ASSERT_TRUE(engine->Submit(busy).ok());
  EXPECT_NE(engine->UnloadAdapter("a").message().find("in use"), std::string::npos);
  while (engine->active() + engine->waiting() > 0) engine->Step();
  EXPECT_TRUE(engine->UnloadAdapter("a").ok());
  EXPECT_EQ(engine->adapters(), (std::vector<std::string>{"b"}));
  // An adapter config with a non-numeric rank is refused, not a crash.
  OwnedCheckpoint typo = snapshots[1].checkpoint;
  const std::string bad_config = R"({"r": "four", "lora_alpha": 8})";
  typo.tensors.back().data.assign(
      reinterpret_cast<const std::byte*>(bad_config.data()),
      reinterpret_cast<const std::byte*>(bad_config.data()) + bad_config.size());
  typo.tensors.back().shape = {static_cast<int64_t>(bad_config.size())};
  auto typo_status = engine->LoadAdapter("t", typo.view());
  EXPECT_NE(typo_status.message().find("must be numbers"), std::string::npos)
      << typo_status.message();
  // A snapshot that is not an adapter is refused.
  auto full = model::SnapshotWeights(*base, DType::kBF16);
  ASSERT_TRUE(full.ok());
  EXPECT_FALSE(engine->LoadAdapter("x", full->view()).ok());
  fs::remove_all(dir);
}

// log softmax(logits / temperature) (untempered at 0) of the token after prompt +
// generated[0, t), recomputed without a cache: the distribution token t was sampled from.
torch::Tensor RecomputedLogprobs(model::TransformerImpl& m, const GenerationResult& r, size_t t,
                                 double temperature) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> sequence(r.prompt.begin(), r.prompt.end());
  sequence.insert(sequence.end(), r.tokens.begin(), r.tokens.begin() + t);
  torch::Tensor logits = m.forward(torch::tensor(sequence).view({1, -1})).logits[0][-1];
  return torch::log_softmax(logits.to(torch::kDouble) / (temperature > 0 ? temperature : 1.0), -1);
}

// Every list has min(k, vocab) entries, most likely first and equal logprobs by lower id, and
// the sampled token's entry (when listed) is its sampling logprob exactly.
void ExpectWellFormedTopLogprobs(const GenerationResult& r, size_t k) {
  ASSERT_EQ(r.top_logprobs.size(), r.tokens.size());
  for (size_t t = 0; t < r.tokens.size(); ++t) {
    const auto& top = r.top_logprobs[t];
    ASSERT_EQ(top.size(), k) << "token " << t;
    std::set<int32_t> distinct;
    for (size_t i = 0; i < top.size(); ++i) {
      distinct.insert(top[i].token);
      if (i > 0) {
        EXPECT_TRUE(top[i - 1].logprob > top[i].logprob ||
                    (top[i - 1].logprob == top[i].logprob && top[i - 1].token < top[i].token))
            << "token " << t << " entry " << i;
      }
      if (top[i].token == r.tokens[t]) {
        EXPECT_EQ(top[i].logprob, r.logprobs[t]) << "token " << t;
      }
    }
    EXPECT_EQ(distinct.size(), k);
  }
}

TEST(EngineTest, TopLogprobsAreTheHeadOfTheSamplingDistribution) {
  auto m = MakeModel(false, 12);
  auto engine = MakeEngine(m);
  GenerationRequest sampled = Request({3, 1, 4}, 12, 0.8, 5);
  sampled.params.top_logprobs = 5;
  sampled.params.top_k = 3;  // truncation does not change what is reported
  GenerationRequest greedy = Request({3, 1, 4}, 12, 0);
  greedy.params.top_logprobs = 3;
  GenerationRequest widest = Request({9, 2}, 6, 1.0, 6);
  widest.params.top_logprobs = kMaxTopLogprobs;
  GenerationRequest plain = sampled;  // k = 0, in the same batch
  plain.params.top_logprobs = 0;
  auto results = engine->Generate({sampled, greedy, widest, plain});
  ASSERT_TRUE(results.ok()) << results.status().ToString();
  const std::vector<std::pair<size_t, double>> asked = {{5, 0.8}, {3, 0}, {20, 1.0}};
  size_t listed = 0;
  for (size_t i = 0; i < asked.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    const auto& r = (*results)[i];
    const auto [k, temperature] = asked[i];
    ExpectWellFormedTopLogprobs(r, k);
    for (size_t t = 0; t < r.tokens.size(); ++t) {
      const torch::Tensor lp = RecomputedLogprobs(*m, r, t, temperature);
      const torch::Tensor head = std::get<0>(lp.sort(/*dim=*/-1, /*descending=*/true));
      for (size_t e = 0; e < k; ++e) {
        const TokenLogprob& entry = r.top_logprobs[t][e];
        EXPECT_NEAR(entry.logprob, lp[entry.token].item<double>(), 2e-5) << "token " << t;
        EXPECT_NEAR(entry.logprob, head[e].item<double>(), 2e-5) << "token " << t;
        listed += entry.token == r.tokens[t];
      }
    }
  }
  EXPECT_GT(listed, 0u) << "no sampled token was listed: the equality check never ran";
  // Greedy: the chosen token heads the list.
  const auto& g = (*results)[1];
  for (size_t t = 0; t < g.tokens.size(); ++t) {
    EXPECT_EQ(g.top_logprobs[t][0].token, g.tokens[t]);
    EXPECT_EQ(g.top_logprobs[t][0].logprob, g.logprobs[t]);
  }
  // Asking changes nothing else: the same seed gives the same tokens and logprobs.
  EXPECT_TRUE((*results)[3].top_logprobs.empty());
  EXPECT_EQ((*results)[0].tokens, (*results)[3].tokens);
  // The two sit in different rows of one batched forward: some CPUs' GEMM kernels round a
  // row differently by its place in the batch (seen: 1e-5 on a Xeon without AVX-512).
  ASSERT_EQ((*results)[0].logprobs.size(), (*results)[3].logprobs.size());
  for (size_t t = 0; t < (*results)[0].logprobs.size(); ++t)
    EXPECT_NEAR((*results)[0].logprobs[t], (*results)[3].logprobs[t], 2e-5) << "token " << t;
}

// A model whose logits are all equal: every token ties, so the lists are the lowest ids.
TEST(EngineTest, TopLogprobsBreakTiesByLowerTokenId) {
  auto m = MakeModel(false, 13);
  {
    torch::NoGradGuard no_grad;
    bool zeroed = false;
    for (auto& p : m->named_parameters()) {
      if (p.key() == "lm_head.weight") {
        p.value().zero_();
        zeroed = true;
      }
    }
    ASSERT_TRUE(zeroed);
  }
  auto engine = MakeEngine(m);
  GenerationRequest few = Request({1, 2}, 4, 1.0, 7);
  few.params.top_logprobs = 4;
  GenerationRequest greedy = Request({5}, 3, 0);
  greedy.params.top_logprobs = kMaxTopLogprobs;
  auto results = engine->Generate({few, greedy});
  ASSERT_TRUE(results.ok()) << results.status().ToString();
  const float uniform = static_cast<float>(-std::log(50.0));
  for (size_t i = 0; i < results->size(); ++i) {
    const auto& r = (*results)[i];
    const size_t k = i == 0 ? 4 : kMaxTopLogprobs;
    ExpectWellFormedTopLogprobs(r, k);
    for (size_t t = 0; t < r.tokens.size(); ++t) {
      EXPECT_FLOAT_EQ(r.logprobs[t], uniform);
      for (size_t e = 0; e < k; ++e) {
        EXPECT_EQ(r.top_logprobs[t][e].token, static_cast<int32_t>(e));
        EXPECT_FLOAT_EQ(r.top_logprobs[t][e].logprob, uniform);
      }
    }
  }
  EXPECT_EQ((*results)[1].tokens, (std::vector<int32_t>{0, 0, 0}));  // greedy: the lowest id
}

TEST(EngineTest, TopLogprobsOutsideTheRangeAreRefused) {
  auto m = MakeModel(false, 14);
  auto engine = MakeEngine(m);
  for (int64_t k : {int64_t{-1}, kMaxTopLogprobs + 1}) {
    GenerationRequest r = Request({1}, 2);
    r.params.top_logprobs = k;
    const Status status = engine->Validate(r);
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find("top_logprobs must be in [0, 20], got " + std::to_string(k)),
              std::string::npos)
        << status.message();
    EXPECT_FALSE(engine->Submit(r).ok());
  }
  GenerationRequest none = Request({1}, 2);
  auto result = engine->Generate({none});
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE((*result)[0].top_logprobs.empty());
}

// Requests for the event tests: seeded, some with top logprobs, one done at its prefill.
std::vector<GenerationRequest> StreamedRequests() {
  std::vector<GenerationRequest> requests = {
      Request({1, 2, 3}, 9, 1.0, 21), Request({4}, /*max_tokens=*/1, 1.0, 22),
      Request({5, 6}, 5, 0.7, 23), Request({7, 7, 7}, 7, 0, std::nullopt)};
  requests[0].params.top_logprobs = 3;
  requests[1].params.top_logprobs = 2;
  return requests;
}

TEST(EngineTest, StepEventsConcatenateToTheResults) {
  auto m = MakeModel(true, 15);
  auto engine = MakeEngine(m, /*max_batch=*/2);  // admissions spread over several steps
  for (auto& r : StreamedRequests()) ASSERT_TRUE(engine->Submit(std::move(r)).ok());
  std::map<uint64_t, GenerationResult> done;
  std::map<uint64_t, std::vector<TokenEvent>> events;
  for (int step = 0; done.size() < 4; ++step) {
    ASSERT_LT(step, 100);
    if (step == 3) {
      ASSERT_TRUE(engine->SetVersion(2).ok());
    }
    std::vector<TokenEvent> emitted = {TokenEvent{.id = 999}};  // Step appends
    std::vector<GenerationResult> finished = engine->Step(&emitted);
    ASSERT_FALSE(emitted.empty());
    EXPECT_EQ(emitted[0].id, 999u);
    emitted.erase(emitted.begin());
    for (size_t i = 1; i < emitted.size(); ++i) EXPECT_LE(emitted[i - 1].id, emitted[i].id);
    std::set<uint64_t> finished_events;
    for (auto& e : emitted) {
      if (e.finished) finished_events.insert(e.id);
      events[e.id].push_back(std::move(e));
    }
    std::set<uint64_t> finished_ids;
    for (auto& r : finished) finished_ids.insert(r.id);
    EXPECT_EQ(finished_events, finished_ids) << "step " << step;  // last token with the result
    for (auto& r : finished) done.emplace(r.id, std::move(r));
  }
  bool swapped = false;
  for (const auto& [id, r] : done) {
    SCOPED_TRACE("request " + std::to_string(id));
    const auto& mine = events[id];
    ASSERT_EQ(mine.size(), r.tokens.size());
    for (size_t t = 0; t < mine.size(); ++t) {
      EXPECT_EQ(mine[t].token, r.tokens[t]);
      EXPECT_EQ(mine[t].logprob, r.logprobs[t]);
      EXPECT_EQ(mine[t].version, r.versions[t]);
      swapped |= mine[t].version == 2;
      if (r.top_logprobs.empty()) {
        EXPECT_TRUE(mine[t].top.empty());
      } else {
        ASSERT_EQ(mine[t].top.size(), r.top_logprobs[t].size());
        for (size_t e = 0; e < mine[t].top.size(); ++e) {
          EXPECT_EQ(mine[t].top[e].token, r.top_logprobs[t][e].token);
          EXPECT_EQ(mine[t].top[e].logprob, r.top_logprobs[t][e].logprob);
        }
      }
      EXPECT_EQ(mine[t].finished, t + 1 == mine.size());
    }
  }
  EXPECT_TRUE(swapped);
  EXPECT_EQ(done.at(2).tokens.size(), 1u);

  // Without events: the same tokens and logprobs.
  auto quiet = MakeEngine(m, /*max_batch=*/2);
  auto results = quiet->Generate(StreamedRequests());
  ASSERT_TRUE(results.ok());
  for (uint64_t id = 1; id <= 4; ++id) {
    EXPECT_EQ((*results)[id - 1].tokens, done.at(id).tokens) << "request " << id;
    EXPECT_EQ((*results)[id - 1].logprobs, done.at(id).logprobs) << "request " << id;
  }
}

TEST(EngineTest, CancelFreesTheSlotForTheNextStep) {
  auto m = MakeModel(false, 16);
  const GenerationRequest cancelled = Request({1, 2, 3}, 12, 1.0, 31);
  const std::vector<GenerationRequest> kept = {
      Request({4, 5}, 10, 1.0, 32), Request({6}, 8, 1.0, 33), Request({8, 9, 10}, 6, 0.9, 34)};
  auto engine = MakeEngine(m, /*max_batch=*/2);
  auto a = engine->Submit(cancelled);  // slot 0, so cancelling it moves slot 1 into place
  auto b = engine->Submit(kept[0]);
  auto c = engine->Submit(kept[1]);
  auto never_started = engine->Submit(cancelled);
  auto d = engine->Submit(kept[2]);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && never_started.ok() && d.ok());
  std::map<uint64_t, GenerationResult> done;
  std::vector<TokenEvent> events;
  for (auto& r : engine->Step(&events)) done.emplace(r.id, std::move(r));
  ASSERT_EQ(engine->active(), 2u);  // every slot is full; three wait
  ASSERT_EQ(engine->waiting(), 3u);
  EXPECT_TRUE(engine->Cancel(*a));
  EXPECT_TRUE(engine->Cancel(*never_started));
  EXPECT_FALSE(engine->Cancel(*a));  // already cancelled
  EXPECT_FALSE(engine->Cancel(12345));
  EXPECT_EQ(engine->active(), 1u);
  EXPECT_EQ(engine->waiting(), 2u);
  const size_t events_before = events.size();
  for (auto& r : engine->Step(&events)) done.emplace(r.id, std::move(r));
  EXPECT_EQ(engine->active(), 2u) << "the freed slot was not used by the next step";
  EXPECT_EQ(engine->waiting(), 1u);
  for (int step = 0; engine->active() + engine->waiting() > 0; ++step) {
    ASSERT_LT(step, 100);
    for (auto& r : engine->Step(&events)) done.emplace(r.id, std::move(r));
  }
  EXPECT_EQ(done.size(), 3u);
  EXPECT_FALSE(done.count(*a));
  EXPECT_FALSE(done.count(*never_started));
  for (size_t i = events_before; i < events.size(); ++i) {
    EXPECT_NE(events[i].id, *a);
    EXPECT_NE(events[i].id, *never_started);
  }
  EXPECT_FALSE(engine->Cancel(*b));  // finished: its result was returned

  // The others sampled what they sample in a run that never had the cancelled request.
  auto without = MakeEngine(m, /*max_batch=*/2);
  auto results = without->Generate(kept);
  ASSERT_TRUE(results.ok());
  const std::vector<uint64_t> ids = {*b, *c, *d};
  for (size_t i = 0; i < kept.size(); ++i) {
    const auto& r = done.at(ids[i]);
    EXPECT_EQ(r.tokens, (*results)[i].tokens) << "request " << ids[i];
    ASSERT_EQ(r.logprobs.size(), (*results)[i].logprobs.size());
    for (size_t t = 0; t < r.logprobs.size(); ++t)
      EXPECT_NEAR(r.logprobs[t], (*results)[i].logprobs[t], 2e-5);
  }
}

}  // namespace
}  // namespace flywheel::rollout
