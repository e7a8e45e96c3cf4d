// FP8 serving end to end in one process: a trainer with fp8_serving publishes F8_E4M3
// projection weights with power-of-two block scales (HF layout, model/fp8.h), and the
// worker's fp32 mirror holds their dequantization. Deltas between consecutive FP8 versions
// are encoded and applied as the sync worker does (delta::ApplyInPlace reporting the words it
// wrote), and after every swap the patched mirror equals a fresh dequantization bit for bit,
// steps that move a block's scale included. Answers of a worker engine serving an FP8
// version are those of a model loaded with model::LoadFp8Weights.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "delta/delta.h"
#include "model/fp8.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "rollout/mirror.h"
#include "rollout/worker_engine.h"
#include "tests/model/tiny_models.h"
#include "tests/rollout/served_engine_test_util.h"
#include "trainer/training_client.h"
#include "transport/asio.h"
#include "transport/http.h"

namespace flywheel::rollout {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using nlohmann::json;

std::unique_ptr<trainer::TrainingClient> Fp8Trainer(int64_t block, uint64_t seed = 3) {
  auto client = trainer::TrainingClient::Create(
      {.config = TinyServed(), .seed = seed, .fp8_serving = true, .fp8_block = block});
  EXPECT_TRUE(client.ok()) << client.status().ToString();
  return client.ok() ? std::move(*client) : nullptr;
}

// One cross-entropy step on a fixed little batch.
void TrainStep(trainer::TrainingClient& client, double lr, int salt) {
  std::vector<trainer::Datum> data(2);
  for (int i = 0; i < 2; ++i) {
    for (int t = 0; t < 12; ++t) {
      data[i].tokens.push_back((t * 7 + i + salt) % 60);
      data[i].target_tokens.push_back((t * 7 + i + salt + 1) % 60);
    }
  }
  ASSERT_TRUE(client.ForwardBackward(data, "cross_entropy").ok());
  ASSERT_TRUE(client.OptimStep({.lr = lr}).ok());
}

const TensorView* Find(const CheckpointView& view, const std::string& name) {
  for (const TensorView& t : view) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// Every parameter of `a` equals `b`'s bit for bit (NaN patterns included).
void ExpectSameBits(model::TransformerImpl& a, model::TransformerImpl& b) {
  auto pb = b.named_parameters();
  for (const auto& item : a.named_parameters()) {
    const torch::Tensor* other = pb.find(item.key());
    ASSERT_NE(other, nullptr) << item.key();
    const torch::Tensor& x = item.value();
    ASSERT_EQ(x.sizes(), other->sizes()) << item.key();
    EXPECT_EQ(std::memcmp(x.data_ptr<float>(), other->data_ptr<float>(), x.numel() * 4), 0)
        << item.key() << " differs from a fresh dequantization";
  }
}

// The model a worker must compute with: `version` dequantized by model::LoadFp8Weights.
std::shared_ptr<model::TransformerImpl> Dequantized(const CheckpointView& version, int64_t block) {
  auto model = std::make_shared<model::TransformerImpl>(TinyServed());
  Status s = model::LoadFp8Weights(*model, version, "fresh", block);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return model;
}

// What the sync worker does with a delta base -> target: encode (as the publisher does),
// parse, apply in place into `state` (the base) reporting the words written.
std::vector<delta::ChangedWords> ApplyDelta(OwnedCheckpoint& state, const CheckpointView& target,
                                            uint64_t base_version, uint64_t target_version) {
  auto bytes = delta::Encode(state.view(), target,
                             {.base_version = base_version, .target_version = target_version});
  EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
  if (!bytes.ok()) return {};
  auto delta = delta::DeltaView::Parse(*bytes);
  EXPECT_TRUE(delta.ok()) << delta.status().ToString();
  if (!delta.ok()) return {};
  MutableCheckpointView mutable_state = state.mutable_view();
  auto applied = delta::ApplyInPlace(mutable_state, *delta, {.report_changes = true});
  EXPECT_TRUE(applied.ok()) << applied.status().ToString();
  return applied.ok() ? applied->changes : std::vector<delta::ChangedWords>{};
}

// Multiplies one block_rows x block_cols corner of a trainer parameter so that its block's
// amax crosses a power of two: the next FP8 snapshot changes that block's scale.
void ScaleCorner(trainer::TrainingClient& client, const std::string& name, int64_t size,
                 double factor) {
  torch::NoGradGuard no_grad;
  auto params = client.model().named_parameters();
  torch::Tensor* p = params.find(name);
  ASSERT_NE(p, nullptr) << name;
  p->slice(0, 0, size).slice(1, 0, size).mul_(factor);
}

constexpr const char* kQ = "model.layers.0.self_attn.q_proj.weight";

// (a) The snapshot is HF's FP8 layout: every quantized weight F8_E4M3 with its F32
// `_scale_inv` of ceil(shape / block), everything else in the serving dtype; the same
// weights give the same bytes.
TEST(Fp8ServingTest, SnapshotsAreHfFp8LayoutAndDeterministic) {
  constexpr int64_t kBlock = 12;  // 32, 16 and 64 are not multiples: partial blocks
  auto client = Fp8Trainer(kBlock);
  ASSERT_NE(client, nullptr);
  auto v1 = client->SaveWeightsForSampler(1);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  const CheckpointView view = v1->checkpoint.view();
  const std::vector<std::string> quantized = model::Fp8WeightNames(client->model());
  ASSERT_FALSE(quantized.empty());
  auto params = client->model().named_parameters();
  for (const std::string& name : quantized) {
    const TensorView* w = Find(view, name);
    const TensorView* s = Find(view, name + model::kFp8ScaleSuffix);
    ASSERT_NE(w, nullptr) << name;
    ASSERT_NE(s, nullptr) << name;
    EXPECT_EQ(w->dtype, DType::kF8_E4M3) << name;
    EXPECT_EQ(w->shape, params.find(name)->sizes().vec()) << name;
    EXPECT_EQ(s->dtype, DType::kF32) << name;
    EXPECT_EQ(s->shape, model::Fp8ScaleShape(w->shape[0], w->shape[1], kBlock)) << name;
  }
  size_t others = 0;
  for (const TensorView& t : view) {
    if (t.dtype == DType::kF8_E4M3 || t.name.ends_with(model::kFp8ScaleSuffix)) continue;
    EXPECT_EQ(t.dtype, DType::kBF16) << t.name;
    ++others;
  }
  EXPECT_EQ(view.size(), 2 * quantized.size() + others);
  EXPECT_FALSE(AllF32(view));

  // Deterministic: a second trainer from the same seed, and a second save of the same
  // weights, give the same bytes.
  auto twin = Fp8Trainer(kBlock);
  ASSERT_NE(twin, nullptr);
  auto t1 = twin->SaveWeightsForSampler(1);
  ASSERT_TRUE(t1.ok());
  EXPECT_EQ(t1->weights_hash, v1->weights_hash);
  auto again = client->SaveWeightsForSampler(2);
  ASSERT_TRUE(again.ok());
  ASSERT_EQ(again->checkpoint.tensors.size(), v1->checkpoint.tensors.size());
  for (size_t i = 0; i < view.size(); ++i) {
    EXPECT_EQ(again->checkpoint.tensors[i].data, v1->checkpoint.tensors[i].data) << view[i].name;
  }
  EXPECT_EQ(again->weights_hash, v1->weights_hash);
}

// fp8_block below 1 is refused when the trainer is created, not at the first save.
TEST(Fp8ServingTest, BlockBelowOneIsRefused) {
  auto client = trainer::TrainingClient::Create(
      {.config = TinyServed(), .fp8_serving = true, .fp8_block = 0});
  ASSERT_FALSE(client.ok());
  EXPECT_NE(client.status().message().find("fp8_block"), std::string::npos);
}

// (b) A mirror loaded from an FP8 version is LoadFp8Weights' dequantization exactly, for
// blocks that divide the shapes, that do not, and HF's 128 (one block per matrix here).
TEST(Fp8ServingTest, MirrorOfAnFp8VersionIsItsDequantization) {
  for (const int64_t block : {8, 12, 128}) {
    SCOPED_TRACE("block " + std::to_string(block));
    auto client = Fp8Trainer(block, 5);
    ASSERT_NE(client, nullptr);
    auto v1 = client->SaveWeightsForSampler(1);
    ASSERT_TRUE(v1.ok());
    model::TransformerImpl mirror(TinyServed());
    Status loaded = LoadMirror(mirror, v1->checkpoint.view(), block);
    ASSERT_TRUE(loaded.ok()) << loaded.ToString();
    ExpectSameBits(mirror, *Dequantized(v1->checkpoint.view(), block));
    // The FP8 rounding is visible: the mirror is not the trainer's fp32 master.
    EXPECT_FALSE(torch::equal(*mirror.named_parameters().find(kQ),
                              *client->model().named_parameters().find(kQ)));
    // A block size whose scale shapes differ is refused (with 128, every matrix here is one
    // block, as it would be with any larger size).
    if (block < 32) {
      model::TransformerImpl other(TinyServed());
      EXPECT_FALSE(LoadMirror(other, v1->checkpoint.view(), block * 2).ok());
    }
  }
}

// (c) Consecutive FP8 versions as deltas: the mirror patched at the reported words (weight
// bytes re-dequantized, blocks whose scale changed re-dequantized whole) equals a fresh
// dequantization after every swap, including steps that move scales.
TEST(Fp8ServingTest, PatchedMirrorEqualsFreshDequantizationAfterEverySwap) {
  constexpr int64_t kBlock = 12;
  auto client = Fp8Trainer(kBlock);
  ASSERT_NE(client, nullptr);
  auto v1 = client->SaveWeightsForSampler(1);
  ASSERT_TRUE(v1.ok());
  OwnedCheckpoint served = v1->checkpoint;  // the worker's serving copy, patched in place
  model::TransformerImpl mirror(TinyServed());
  ASSERT_TRUE(LoadMirror(mirror, served.view(), kBlock).ok());

  const std::string q_scale = std::string(kQ) + model::kFp8ScaleSuffix;
  int scale_swaps = 0;
  for (uint64_t version = 2; version <= 6; ++version) {
    SCOPED_TRACE("version " + std::to_string(version));
    TrainStep(*client, 1e-3, static_cast<int>(version));
    // Versions 3 and 5 move a block's amax past a power of two (up, then back down).
    if (version == 3) ScaleCorner(*client, kQ, kBlock, 4.0);
    if (version == 5) ScaleCorner(*client, kQ, kBlock, 0.25);
    auto next = client->SaveWeightsForSampler(version);
    ASSERT_TRUE(next.ok());
    const std::vector<delta::ChangedWords> changes =
        ApplyDelta(served, next->checkpoint.view(), version - 1, version);
    ASSERT_FALSE(changes.empty());
    const CheckpointView view = served.view();
    bool scales_changed = false, bytes_changed = false;
    for (const delta::ChangedWords& c : changes) {
      const bool wrote = c.all || !c.positions.empty();
      if (wrote && view[c.state_index].name == q_scale) scales_changed = true;
      if (wrote && view[c.state_index].dtype == DType::kF8_E4M3) bytes_changed = true;
    }
    EXPECT_TRUE(bytes_changed);
    if (version == 3 || version == 5) EXPECT_TRUE(scales_changed);
    scale_swaps += scales_changed;
    auto patched = PatchMirror(mirror, view, changes, kBlock);
    ASSERT_TRUE(patched.ok()) << patched.status().ToString();
    EXPECT_GT(patched->words_patched, 0u);
    EXPECT_EQ(patched->tensors_ignored, 0u);  // scale tensors belong to their weights
    ExpectSameBits(mirror, *Dequantized(view, kBlock));
  }
  EXPECT_GE(scale_swaps, 2);
}

// A delta whose scale tensor no longer fits the block size is refused before any word of
// the mirror is written.
TEST(Fp8ServingTest, PatchWithMisfittingScalesLeavesTheMirrorAsItWas) {
  constexpr int64_t kBlock = 8;
  auto client = Fp8Trainer(kBlock);
  ASSERT_NE(client, nullptr);
  auto v1 = client->SaveWeightsForSampler(1);
  ASSERT_TRUE(v1.ok());
  OwnedCheckpoint served = v1->checkpoint;
  model::TransformerImpl mirror(TinyServed());
  ASSERT_TRUE(LoadMirror(mirror, served.view(), kBlock).ok());
  TrainStep(*client, 1e-3, 1);
  auto v2 = client->SaveWeightsForSampler(2);
  ASSERT_TRUE(v2.ok());
  const auto changes = ApplyDelta(served, v2->checkpoint.view(), 1, 2);
  ASSERT_FALSE(changes.empty());
  auto refused = PatchMirror(mirror, served.view(), changes, kBlock * 2);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("_scale_inv"), std::string::npos)
      << refused.status().ToString();
  ExpectSameBits(mirror, *Dequantized(v1->checkpoint.view(), kBlock));
}

// (d) A worker engine serving FP8 versions (block size from config.json's
// quantization_config) answers with the logprobs of the dequantized weights, at the first
// version and after a delta that moves a scale.
class Fp8WorkerEngineTest : public ServedEngineTest {
 protected:
  static constexpr int64_t kBlock = 8;
  const std::vector<int32_t> kPrompt = {1, 2, 3};

  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("flywheel_fp8_serving_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    json config = TinyServed().ToJson();
    config["quantization_config"] = model::Fp8QuantizationConfig(kBlock);
    std::ofstream(dir_ / "config.json") << config.dump();
    WorkerEngineOptions options;
    options.model_config = dir_.string();
    options.max_batch = 4;
    options.max_sequence = 32;
    options.tokenizer = "chars:0123456789";
    StartServing(options);
  }

  void TearDown() override {
    StopServing();
    fs::remove_all(dir_);
  }

  // A greedy completion's tokens, logprobs and versions match `reference` recomputed.
  void ExpectServedBy(model::TransformerImpl& reference, uint64_t version) {
    json request = GreedyCompletion(kPrompt);
    auto response = transport::HttpPost({"127.0.0.1", server_->port()}, "/v1/completions",
                                        request.dump(), {.timeout = std::chrono::seconds(60)});
    ASSERT_TRUE(response.ok()) << response.status().ToString();
    ASSERT_EQ(response->status, 200) << response->body;
    const json choice = json::parse(response->body)["choices"][0];
    const auto tokens = choice["token_ids"].get<std::vector<int32_t>>();
    const auto logprobs = choice["logprobs"]["token_logprobs"].get<std::vector<float>>();
    const auto versions = choice["policy_versions"].get<std::vector<uint64_t>>();
    ASSERT_EQ(tokens.size(), 6u);
    torch::NoGradGuard no_grad;
    std::vector<int64_t> sequence(kPrompt.begin(), kPrompt.end());
    sequence.insert(sequence.end(), tokens.begin(), tokens.end() - 1);
    torch::Tensor logits = reference.forward(torch::tensor(sequence).view({1, -1})).logits[0];
    torch::Tensor expected = torch::log_softmax(logits.to(torch::kDouble), -1);
    for (size_t t = 0; t < tokens.size(); ++t) {
      const int64_t row = static_cast<int64_t>(kPrompt.size() - 1 + t);
      EXPECT_NEAR(logprobs[t], expected[row][tokens[t]].item<double>(), 1e-4) << "token " << t;
      // Greedy: the served token is the reference's argmax.
      EXPECT_EQ(tokens[t], expected[row].argmax().item<int64_t>()) << "token " << t;
      EXPECT_EQ(versions[t], version) << "token " << t;
    }
  }

  fs::path dir_;
};

TEST_F(Fp8WorkerEngineTest, CompletionsOnAnFp8VersionUseTheDequantizedWeights) {
  auto client = Fp8Trainer(kBlock, 7);
  ASSERT_NE(client, nullptr);
  {
    // Sharper distributions than the 0.02 init, so that logprobs differ visibly.
    torch::NoGradGuard no_grad;
    for (auto& p : client->model().parameters()) {
      if (p.dim() == 2) p.mul_(8);
    }
  }
  auto v1 = client->SaveWeightsForSampler(1);
  ASSERT_TRUE(v1.ok());
  OwnedCheckpoint served = v1->checkpoint;
  const CheckpointView view = served.view();
  const std::vector<delta::ChangedWords> none;
  ASSERT_TRUE(engine_->OnSwap({1, &view, &none, /*full=*/true, nullptr}).ok());
  ExpectServedBy(*Dequantized(view, kBlock), 1);

  TrainStep(*client, 1e-2, 1);
  ScaleCorner(*client, kQ, kBlock, 4.0);
  auto v2 = client->SaveWeightsForSampler(2);
  ASSERT_TRUE(v2.ok());
  const auto changes = ApplyDelta(served, v2->checkpoint.view(), 1, 2);
  ASSERT_FALSE(changes.empty());
  const CheckpointView view2 = served.view();
  ASSERT_TRUE(engine_->OnSwap({2, &view2, &changes, /*full=*/false, nullptr}).ok());
  ExpectServedBy(*Dequantized(view2, kBlock), 2);
}

// Not a check: the figures for issue 18. On the pipeline's tiny preset after a short SFT
// (AdamW, lr 1e-3), RL-like steps at lr 1e-6: the share of served words each step changes
// and the delta (delta::Encode, as the publisher encodes it) as a share of the full
// checkpoint, FP8 vs BF16 serving of the same weights. Run with
// --gtest_also_run_disabled_tests --gtest_filter='*MeasureDeltas*'.
TEST(Fp8ServingTest, DISABLED_MeasureDeltasFp8VsBf16) {
  const model::ModelConfig config = model::PipelineTinyConfig(32, false);
  auto created = trainer::TrainingClient::Create(
      {.config = config, .seed = 1, .fp8_serving = true, .fp8_block = model::kFp8BlockSize});
  ASSERT_TRUE(created.ok());
  trainer::TrainingClient& client = **created;
  // Counting patterns mod 29 with a stride per sequence: learnable, not trivial.
  auto batch = [](int salt) {
    std::vector<trainer::Datum> data(8);
    for (int i = 0; i < 8; ++i) {
      const int stride = 1 + (i + salt) % 5;
      for (int t = 0; t < 32; ++t) {
        data[i].tokens.push_back(((i + salt) * 3 + t * stride) % 29 + 1);
        data[i].target_tokens.push_back(((i + salt) * 3 + (t + 1) * stride) % 29 + 1);
      }
    }
    return data;
  };
  double loss = 0;
  for (int step = 0; step < 60; ++step) {
    auto m = client.ForwardBackward(batch(step), "cross_entropy");
    ASSERT_TRUE(m.ok());
    loss = m->loss;
    ASSERT_TRUE(client.OptimStep({.lr = 1e-3}).ok());
  }
  std::printf("SFT: 60 steps at lr 1e-3, last loss %.3f\n", loss);

  struct Served {
    OwnedCheckpoint checkpoint;
    uint64_t bytes = 0;
  };
  auto snapshot = [&](bool fp8) {
    Served served;
    auto c = fp8 ? model::SnapshotWeightsFp8(client.model())
                 : model::SnapshotWeights(client.model(), DType::kBF16);
    EXPECT_TRUE(c.ok());
    served.checkpoint = std::move(*c);
    for (const OwnedTensor& t : served.checkpoint.tensors) served.bytes += t.data.size();
    return served;
  };
  Served fp8 = snapshot(true), bf16 = snapshot(false);
  // What a delta costs with nothing changed (manifest, per-tensor hashes and chunk records).
  for (const Served* served : {&fp8, &bf16}) {
    auto empty = delta::Encode(served->checkpoint.view(), served->checkpoint.view(), {});
    ASSERT_TRUE(empty.ok());
    std::printf("%s: %zu tensors, a delta with no change is %zu B\n",
                served == &fp8 ? "FP8 " : "BF16", served->checkpoint.tensors.size(), empty->size());
  }
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(client.ForwardBackward(batch(1000 + step), "cross_entropy").ok());
    ASSERT_TRUE(client.OptimStep({.lr = 1e-6}).ok());
    Served fp8_next = snapshot(true), bf16_next = snapshot(false);
    for (const bool is_fp8 : {true, false}) {
      const Served& base = is_fp8 ? fp8 : bf16;
      const Served& target = is_fp8 ? fp8_next : bf16_next;
      // Changed words: all tensors, and (FP8) the F8 weights and scale tensors apart.
      uint64_t words = 0, changed = 0, f8_words = 0, f8_changed = 0, scale_changed = 0;
      for (size_t i = 0; i < base.checkpoint.tensors.size(); ++i) {
        const OwnedTensor& a = base.checkpoint.tensors[i];
        const OwnedTensor& b = target.checkpoint.tensors[i];
        const int word = DTypeWordBytes(a.dtype);
        for (size_t w = 0; w < a.data.size() / word; ++w) {
          const bool differs = std::memcmp(&a.data[w * word], &b.data[w * word], word) != 0;
          ++words;
          changed += differs;
          if (a.dtype == DType::kF8_E4M3) {
            ++f8_words;
            f8_changed += differs;
          }
          if (a.name.ends_with(model::kFp8ScaleSuffix)) scale_changed += differs;
        }
      }
      auto encoded = delta::Encode(base.checkpoint.view(), target.checkpoint.view(), {});
      ASSERT_TRUE(encoded.ok());
      std::printf("step %d %s: checkpoint %llu B, changed words %llu / %llu (%.4f%%)", step,
                  is_fp8 ? "FP8 " : "BF16", static_cast<unsigned long long>(base.bytes),
                  static_cast<unsigned long long>(changed), static_cast<unsigned long long>(words),
                  100.0 * changed / words);
      if (is_fp8) {
        std::printf(" [F8 bytes %llu / %llu (%.4f%%), scales changed %llu]",
                    static_cast<unsigned long long>(f8_changed),
                    static_cast<unsigned long long>(f8_words), 100.0 * f8_changed / f8_words,
                    static_cast<unsigned long long>(scale_changed));
      }
      std::printf(", delta %zu B = %.3f%% of its checkpoint, %.3f%% of the BF16 checkpoint\n",
                  encoded->size(), 100.0 * encoded->size() / base.bytes,
                  100.0 * encoded->size() / bf16.bytes);
    }
    fp8 = std::move(fp8_next);
    bf16 = std::move(bf16_next);
  }
}

}  // namespace
}  // namespace flywheel::rollout
