// The in-flight swap end to end in one process: the trainer publishes through a real
// publisher, a real sync worker receives the delta over loopback, and its on_swap hook
// patches the engine's fp32 mirror between two decode steps. The request in flight keeps
// going, its tokens carry the version that sampled them, and the mirror equals the new
// bf16 weights bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "rollout/engine.h"
#include "rollout/mirror.h"
#include "sync/publisher.h"
#include "sync/worker.h"
#include "tests/model/tiny_models.h"
#include "trainer/training_client.h"
#include "model/weights.h"
#include "transport/asio.h"

namespace flywheel::rollout {
namespace {

namespace fs = std::filesystem;
namespace asio = boost::asio;
using namespace std::chrono_literals;

model::ModelConfig Tiny() {
  return testing::TinyConfig({.vocab = 60});
}

template <typename Predicate>
bool WaitFor(Predicate predicate, std::chrono::milliseconds limit = 20s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return predicate();
}

TEST(SwapTest, DeltaPatchesTheMirrorBetweenDecodeStepsOfALiveRequest) {
  const fs::path dir =
      fs::temp_directory_path() / ("flywheel_swap_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  asio::io_context io(1);
  auto guard = asio::make_work_guard(io);
  std::thread io_thread([&] { io.run(); });

  sync::PublisherOptions publisher_options;
  publisher_options.listen = {"127.0.0.1", 0};
  publisher_options.common.http = {"127.0.0.1", 0};
  publisher_options.log.dir = (dir / "state").string();
  auto publisher = sync::Publisher::Start(io.get_executor(), publisher_options);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();

  auto trainer = trainer::TrainingClient::Create({.config = Tiny(), .seed = 3});
  ASSERT_TRUE(trainer.ok());
  (*trainer)->AttachPublisher(publisher->get());
  ASSERT_TRUE((*trainer)->SaveWeightsForSampler(1).ok());

  // The engine's model; loaded from the worker's first version, patched on every swap.
  auto model = std::make_shared<model::TransformerImpl>(Tiny());
  std::unique_ptr<Engine> engine;
  std::atomic<int> patched_swaps{0};
  std::atomic<uint64_t> words_patched{0};
  sync::WorkerOptions worker_options;
  worker_options.common.region = "home";
  worker_options.common.http = {"127.0.0.1", 0};
  worker_options.upstreams = {{"127.0.0.1", (*publisher)->port()}};
  worker_options.on_swap = [&](const sync::SwapEvent& event) {
    if (!engine) return;  // the first version is loaded wholesale below
    Status s = engine->Swap(event.version, [&]() -> Status {
      if (event.full) return LoadMirror(*model, *event.weights);
      auto stats = PatchMirror(*model, *event.weights, *event.changes);
      if (!stats.ok()) return stats.status();
      words_patched += stats->words_patched;
      return Status::Ok();
    });
    EXPECT_TRUE(s.ok()) << s.ToString();
    ++patched_swaps;
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
  auto expected = std::make_shared<model::TransformerImpl>(Tiny());
  ASSERT_TRUE(model::LoadWeights(*expected, v2->checkpoint.view(), "v2").ok());
  auto want = expected->named_parameters();
  for (const auto& p : model->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key();
  // A fresh request now samples at version 2.
  auto after = engine->Generate({request});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ((*after)[0].versions.front(), 2u);

  (*worker)->Stop();
  (*publisher)->Stop();
  std::this_thread::sleep_for(100ms);
  guard.reset();
  io.stop();
  io_thread.join();
  worker->reset();
  publisher->reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace flywheel::rollout
