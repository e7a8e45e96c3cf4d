// The in-flight swap end to end in one process: the trainer publishes through a real
// publisher, a real sync worker receives the delta over loopback, and its on_swap hook
// patches the engine's fp32 mirror between two decode steps. The request in flight keeps
// going, its tokens carry the version that sampled them, and the mirror equals the new
// bf16 weights bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "rollout/engine.h"
#include "rollout/mirror.h"
#include "rollout/worker_engine.h"
#include "sync/publisher.h"
#include "sync/worker.h"
#include "tests/model/tiny_models.h"
#include "tests/rollout/served_engine_test_util.h"
#include "trainer/training_client.h"
#include "model/weights.h"
#include "transport/asio.h"
#include "transport/http.h"

namespace flywheel::rollout {
namespace {

namespace fs = std::filesystem;
namespace asio = boost::asio;
using namespace std::chrono_literals;

template <typename Predicate>
bool WaitFor(Predicate predicate, std::chrono::milliseconds limit = 20s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return predicate();
}

// Stops the worker and the publisher, gives their sessions a moment to close, then stops
// the io thread they ran on.
void StopAll(sync::Worker& worker, sync::Publisher& publisher,
             asio::executor_work_guard<asio::io_context::executor_type>& guard,
             asio::io_context& io, std::thread& io_thread) {
  worker.Stop();
  publisher.Stop();
  std::this_thread::sleep_for(100ms);
  guard.reset();
  io.stop();
  io_thread.join();
}

// A publisher on loopback ports with its version log under `dir`/state.
sync::PublisherOptions LoopbackPublisher(const fs::path& dir) {
  sync::PublisherOptions options;
  options.listen = {"127.0.0.1", 0};
  options.common.http = {"127.0.0.1", 0};
  options.log.dir = (dir / "state").string();
  return options;
}

TEST(SwapTest, DeltaPatchesTheMirrorBetweenDecodeStepsOfALiveRequest) {
  const fs::path dir =
      fs::temp_directory_path() / ("flywheel_swap_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  asio::io_context io(1);
  auto guard = asio::make_work_guard(io);
  std::thread io_thread([&] { io.run(); });

  sync::PublisherOptions publisher_options = LoopbackPublisher(dir);
  auto publisher = sync::Publisher::Start(io.get_executor(), publisher_options);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();

  auto trainer = trainer::TrainingClient::Create({.config = TinyServed(), .seed = 3});
  ASSERT_TRUE(trainer.ok());
  (*trainer)->AttachPublisher(publisher->get());
  ASSERT_TRUE((*trainer)->SaveWeightsForSampler(1).ok());

  // The engine's model; loaded from the worker's first version, patched on every swap.
  auto model = std::make_shared<model::TransformerImpl>(TinyServed());
  std::unique_ptr<Engine> engine;
  std::atomic<int> patched_swaps{0};
  std::atomic<uint64_t> words_patched{0};
  sync::WorkerOptions worker_options;
  worker_options.common.region = "home";
  worker_options.common.http = {"127.0.0.1", 0};
  worker_options.upstreams = {{"127.0.0.1", (*publisher)->port()}};
  worker_options.on_swap = [&](const sync::SwapEvent& event) -> Status {
    if (!engine) return Status::Ok();  // the first version is loaded wholesale below
    Status s = engine->Swap(event.version, [&]() -> Status {
      if (event.full) return LoadMirror(*model, *event.weights);
      auto stats = PatchMirror(*model, *event.weights, *event.changes);
      if (!stats.ok()) return stats.status();
      words_patched += stats->words_patched;
      return Status::Ok();
    });
    EXPECT_TRUE(s.ok()) << s.ToString();
    ++patched_swaps;
    return s;
  };
  auto worker = sync::Worker::Start(io.get_executor(), worker_options);
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return (*worker)->version() == 1; }));
  Status loaded = Status::Ok();
  (*worker)->WithWeights(
      [&](uint64_t, const CheckpointView& weights) { loaded = LoadMirror(*model, weights); });
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  auto created = Engine::Create(model, {.max_batch = 4, .max_sequence = 96}, 1);
  ASSERT_TRUE(created.ok());
  engine = std::move(*created);

  GenerationRequest request;
  request.prompt = {1, 2, 3};
  request.params.max_tokens = 40;
  request.params.temperature = 1.0;
  request.params.seed = 5;
  ASSERT_TRUE(engine->Submit(request).ok());
  std::vector<GenerationResult> done;
  for (int i = 0; i < 5; ++i) {
    for (auto& r : engine->Step()) done.push_back(std::move(r));
  }
  ASSERT_TRUE(done.empty());

  // A training step and version 2, published while the request is mid-flight.
  std::vector<trainer::Datum> data(2);
  for (int i = 0; i < 2; ++i) {
    for (int t = 0; t < 12; ++t) {
      data[i].tokens.push_back((t * 7 + i) % 60);
      data[i].target_tokens.push_back((t * 7 + i + 1) % 60);
    }
  }
  ASSERT_TRUE((*trainer)->ForwardBackward(data, "cross_entropy").ok());
  ASSERT_TRUE((*trainer)->OptimStep({.lr = 1e-3}).ok());
  auto v2 = (*trainer)->SaveWeightsForSampler(2);
  ASSERT_TRUE(v2.ok());
  // Keep decoding (slowly) while the delta travels: the swap lands between two steps.
  for (int steps = 0; patched_swaps.load() == 0 && steps < 20; ++steps) {
    for (auto& r : engine->Step()) done.push_back(std::move(r));
    std::this_thread::sleep_for(25ms);
  }
  ASSERT_EQ(patched_swaps.load(), 1) << "version 2 did not arrive within 20 decode steps";
  ASSERT_TRUE(done.empty());
  while (done.empty()) {
    for (auto& r : engine->Step()) done.push_back(std::move(r));
  }
  EXPECT_EQ(engine->version(), 2u);
  EXPECT_GT(words_patched.load(), 0u);
  EXPECT_GE(engine->last_swap_pause_ms(), 0.0);

  // Versions per token: a run of 1s, then 2s; the request went on across the swap.
  const auto& versions = done[0].versions;
  ASSERT_EQ(versions.size(), 40u);
  EXPECT_EQ(versions.front(), 1u);
  EXPECT_EQ(versions.back(), 2u);
  EXPECT_TRUE(std::is_sorted(versions.begin(), versions.end()));
  // The mirror is exactly the served bf16 weights of version 2.
  auto expected = std::make_shared<model::TransformerImpl>(TinyServed());
  ASSERT_TRUE(model::LoadWeights(*expected, v2->checkpoint.view(), "v2").ok());
  auto want = expected->named_parameters();
  for (const auto& p : model->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key();
  // A fresh request now samples at version 2.
  auto after = engine->Generate({request});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ((*after)[0].versions.front(), 2u);

  StopAll(**worker, **publisher, guard, io, io_thread);
  worker->reset();
  publisher->reset();
  fs::remove_all(dir);
}

// One step of the tiny model, so the next version differs.
void TrainOneStep(trainer::TrainingClient& trainer, int salt) {
  std::vector<trainer::Datum> data(2);
  for (int i = 0; i < 2; ++i) {
    for (int t = 0; t < 12; ++t) {
      data[i].tokens.push_back((t * 7 + i + salt) % 60);
      data[i].target_tokens.push_back((t * 7 + i + salt + 1) % 60);
    }
  }
  ASSERT_TRUE(trainer.ForwardBackward(data, "cross_entropy").ok());
  ASSERT_TRUE(trainer.OptimStep({.lr = 1e-3}).ok());
}

// The worker's weights as bytes, to compare a refused swap's aftermath bit for bit.
std::string WeightBytes(const sync::Worker& worker) {
  std::string bytes;
  worker.WithWeights([&](uint64_t, const CheckpointView& weights) {
    for (const TensorView& t : weights)
      bytes.append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  });
  return bytes;
}

// A swap the engine refuses (a failure injected through WorkerEngineOptions::before_swap)
// leaves the worker serving and advertising the old version: its weights are restored bit
// for bit, /v1/status keeps the old version and hash and counts the refusal, completions
// are still sampled at the old version, and the next version is taken normally.
TEST(SwapTest, RefusedSwapKeepsServingAndAdvertisingTheOldVersion) {
  const fs::path dir =
      fs::temp_directory_path() / ("flywheel_refused_swap_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream config(dir / "config.json");
    config << TinyServed().ToJson().dump();
  }
  asio::io_context io(1);
  auto guard = asio::make_work_guard(io);
  std::thread io_thread([&] { io.run(); });

  sync::PublisherOptions publisher_options = LoopbackPublisher(dir);
  // Keyframes at versions 1, 3, 5...: the refused delta to version 2 is undone, and since
  // the delta 2 -> 3 needs version 2, version 3 arrives as a keyframe applied in place over
  // version 1 (the same engine-acceptance path).
  publisher_options.log.keyframe_every = 2;
  auto publisher = sync::Publisher::Start(io.get_executor(), publisher_options);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  auto trainer = trainer::TrainingClient::Create({.config = TinyServed(), .seed = 3});
  ASSERT_TRUE(trainer.ok());
  (*trainer)->AttachPublisher(publisher->get());
  auto v1 = (*trainer)->SaveWeightsForSampler(1);
  ASSERT_TRUE(v1.ok());

  std::atomic<uint64_t> refuse_version{2};
  rollout::WorkerEngineOptions engine_options;
  engine_options.model_config = (dir / "config.json").string();
  engine_options.max_batch = 2;
  engine_options.max_sequence = 64;
  engine_options.tokenizer = "chars:0123456789";  // the tiny model has 60 ids
  engine_options.before_swap = [&](uint64_t version) {
    return version == refuse_version.load() ? Status::Internal("injected swap failure")
                                            : Status::Ok();
  };
  auto engine = WorkerEngine::Create(engine_options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  WorkerEngine* raw = engine->get();
  sync::WorkerOptions worker_options;
  worker_options.common.region = "home";
  worker_options.common.http = {"127.0.0.1", 0};
  worker_options.upstreams = {{"127.0.0.1", (*publisher)->port()}};
  worker_options.on_swap = [raw](const sync::SwapEvent& event) { return raw->OnSwap(event); };
  worker_options.configure_http = [raw](transport::HttpServer& server) { raw->Register(server); };
  auto worker = sync::Worker::Start(io.get_executor(), worker_options);
  ASSERT_TRUE(worker.ok()) << worker.status().ToString();
  raw->Attach(worker->get());
  ASSERT_TRUE(WaitFor([&] { return (*worker)->version() == 1; }));
  const std::string v1_bytes = WeightBytes(**worker);
  const transport::Endpoint http{"127.0.0.1", (*worker)->http_port()};
  auto status = [&] {
    auto response = transport::HttpGet(http, "/v1/status");
    EXPECT_TRUE(response.ok());
    return nlohmann::json::parse(response.ok() ? response->body : "{}");
  };
  auto completion_version = [&] {
    auto response = transport::HttpPost(
        http, "/v1/completions",
        R"({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "logprobs": 1})");
    EXPECT_TRUE(response.ok() && response->status == 200) << (response.ok() ? response->body : "");
    auto body = nlohmann::json::parse(response.ok() ? response->body : "{}", nullptr, false);
    return body.is_object() ? body["choices"].dump() : std::string();  // ids, versions, logprobs
  };
  const std::string v1_answer = completion_version();

  // Version 2: the engine refuses it.
  TrainOneStep(**trainer, 0);
  auto v2 = (*trainer)->SaveWeightsForSampler(2);
  ASSERT_TRUE(v2.ok());
  ASSERT_TRUE(WaitFor([&] { return status().value("swaps_refused", 0) >= 1; }))
      << status().dump(2);
  nlohmann::json after = status();
  EXPECT_EQ(after["version"], 1) << after.dump(2);
  EXPECT_EQ(after["weights_hash"], v1->weights_hash);
  EXPECT_EQ(after["swaps_refused"], 1);
  EXPECT_EQ(after["artifacts_rejected"], 1);
  EXPECT_EQ((*worker)->version(), 1u);
  EXPECT_EQ((*worker)->weights_hash().ToHex(), v1->weights_hash);
  EXPECT_TRUE(WeightBytes(**worker) == v1_bytes) << "the refused delta was not undone";
  // Completions are still sampled from version 1's weights (same greedy answer, version 1).
  EXPECT_EQ(completion_version(), v1_answer);

  // Version 3 is taken normally (the refusal is not sticky).
  TrainOneStep(**trainer, 3);
  auto v3 = (*trainer)->SaveWeightsForSampler(3);
  ASSERT_TRUE(v3.ok());
  ASSERT_TRUE(WaitFor([&] { return (*worker)->version() == 3; })) << status().dump(2);
  EXPECT_EQ(status()["weights_hash"], v3->weights_hash);
  EXPECT_NE(completion_version(), v1_answer);

  StopAll(**worker, **publisher, guard, io, io_thread);
  engine->reset();
  worker->reset();
  publisher->reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace flywheel::rollout
