// The training service's LoRA sessions as a worker serves them: a version carries, beside the
// base, each session's adapters-only snapshot under model::kServedAdapterPrefix + "<name>/",
// and WorkerEngine::OnSwap serves every such group as adapter <name>. SwapEvents are built
// here by hand, as sync/worker.cc hands them over: the served tensors patched in place with
// the words written (a delta), or a new layout (`full`, a keyframe). Answers come over HTTP
// and are checked against a model holding the base plus that adapter's served factors.
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "checkpoint/safetensors.h"
#include "model/weights.h"
#include "rollout/worker_engine.h"
#include "tests/model/tiny_models.h"
#include "tests/rollout/served_engine_test_util.h"
#include "transport/asio.h"
#include "transport/http.h"

namespace flywheel::rollout {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using nlohmann::json;

const std::vector<int32_t> kPrompt = {1, 2, 3};

// One session's adapter: its adapters-only snapshot and a model holding the served base plus
// exactly the served (rounded) factors, the reference for the worker's logprobs.
struct Adapter {
  OwnedCheckpoint snapshot;
  std::shared_ptr<model::TransformerImpl> reference;
};

// A completion's first choice.
struct Answer {
  int status = 0;
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<uint64_t> versions;
  json body;
};

// log p(token t | prompt + tokens[0, t)) under `model`, recomputed without a cache.
std::vector<float> ReferenceLogprobs(model::TransformerImpl& model,
                                     const std::vector<int32_t>& tokens) {
  if (tokens.empty()) return {};
  torch::NoGradGuard no_grad;
  std::vector<int64_t> sequence(kPrompt.begin(), kPrompt.end());
  sequence.insert(sequence.end(), tokens.begin(), tokens.end() - 1);
  torch::Tensor logits = model.forward(torch::tensor(sequence).view({1, -1})).logits[0];
  torch::Tensor logprobs = torch::log_softmax(logits.to(torch::kDouble), -1);
  std::vector<float> out;
  for (size_t t = 0; t < tokens.size(); ++t) {
    out.push_back(static_cast<float>(logprobs[kPrompt.size() - 1 + t][tokens[t]].item<double>()));
  }
  return out;
}

// A version's tensors: the base's, then each adapter's under kServedAdapterPrefix + name + "/".
OwnedCheckpoint Version(
    const OwnedCheckpoint& base,
    const std::vector<std::pair<std::string, const OwnedCheckpoint*>>& adapters) {
  OwnedCheckpoint version = base;
  for (const auto& [name, snapshot] : adapters) {
    for (OwnedTensor t : snapshot->tensors) {
      t.name = model::kServedAdapterPrefix + name + "/" + t.name;
      version.tensors.push_back(std::move(t));
    }
  }
  return version;
}

// Writes `source`'s tensors over those named `prefix` + their name in `version`, in place, as
// a delta apply does; returns what the sync worker would report as written.
std::vector<delta::ChangedWords> PatchInPlace(OwnedCheckpoint& version, const std::string& prefix,
                                              const OwnedCheckpoint& source) {
  std::vector<delta::ChangedWords> changes;
  for (const OwnedTensor& s : source.tensors) {
    auto it = std::find_if(version.tensors.begin(), version.tensors.end(),
                           [&](const OwnedTensor& t) { return t.name == prefix + s.name; });
    EXPECT_TRUE(it != version.tensors.end() && it->data.size() == s.data.size()) << s.name;
    if (it == version.tensors.end() || it->data.size() != s.data.size() || it->data == s.data) {
      continue;
    }
    std::copy(s.data.begin(), s.data.end(), it->data.begin());
    const auto index = static_cast<size_t>(it - version.tensors.begin());
    changes.push_back({.state_index = index,
                       .word_begin = 0,
                       .word_count = it->data.size() / DTypeWordBytes(it->dtype),
                       .all = true});
  }
  return changes;
}

const std::vector<delta::ChangedWords> kNoChanges;

sync::SwapEvent Keyframe(uint64_t version, const CheckpointView& weights,
                         const CheckpointView* previous) {
  return {version, &weights, &kNoChanges, /*full=*/true, previous};
}

sync::SwapEvent Delta(uint64_t version, const CheckpointView& weights,
                      const std::vector<delta::ChangedWords>& changes) {
  return {version, &weights, &changes, /*full=*/false, nullptr};
}

class ServedAdaptersTest : public ServedEngineTest {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("flywheel_served_adapters_" + std::to_string(::getpid()) +
                                        "_" + std::to_string(++tests_started_));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "config.json") << TinyServed().ToJson().dump();
    // Before any thread logs: the errors the engine logs are part of what is checked.
    log_sink_ = std::make_shared<spdlog::sinks::ostream_sink_mt>(log_);
    spdlog::default_logger()->sinks().push_back(log_sink_);
  }

  void TearDown() override {
    StopServing();
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), log_sink_), sinks.end());
    fs::remove_all(dir_);
  }

  // The base every version serves, in `dtype` (the mirror's path for BF16, serving without
  // a mirror for F32), and a model holding exactly those values.
  void MakeBase(DType dtype) {
    dtype_ = dtype;
    torch::manual_seed(11);
    model::TransformerImpl model(TinyServed());
    {
      // Sharper distributions than the 0.02 init, so that logprobs differ visibly.
      torch::NoGradGuard no_grad;
      for (auto& p : model.parameters()) {
        if (p.dim() == 2) p.mul_(8);
      }
    }
    auto base = model::SnapshotWeights(model, dtype);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    base_ = std::move(*base);
    base_reference_ = std::make_shared<model::TransformerImpl>(TinyServed());
    ASSERT_TRUE(model::LoadWeights(*base_reference_, base_.view(), "base").ok());
  }

  // An adapter with random factors drawn from `seed` (PEFT's zero lora_B would not change
  // the model), rank 4.
  Adapter MakeAdapter(uint64_t seed) {
    Adapter adapter;
    adapter.reference = std::make_shared<model::TransformerImpl>(TinyServed());
    EXPECT_TRUE(model::LoadWeights(*adapter.reference, base_.view(), "base").ok());
    EXPECT_TRUE(adapter.reference->EnableLora({.rank = 4, .alpha = 8}).ok());
    torch::manual_seed(seed);
    {
      torch::NoGradGuard no_grad;
      for (auto& item : adapter.reference->named_parameters()) {
        if (item.key().find(".lora_") != std::string::npos) item.value().normal_(0, 0.3);
      }
    }
    auto snapshot = model::SnapshotWeights(*adapter.reference, dtype_, /*adapters_only=*/true);
    EXPECT_TRUE(snapshot.ok()) << snapshot.status().ToString();
    if (!snapshot.ok()) return adapter;
    adapter.snapshot = std::move(*snapshot);
    // The reference holds the served, rounded factors.
    EXPECT_TRUE(model::LoadAdapters(*adapter.reference, adapter.snapshot.view(), "served").ok());
    return adapter;
  }

  void StartEngine(std::vector<std::pair<std::string, std::string>> file_adapters = {}) {
    WorkerEngineOptions options;
    options.model_config = (dir_ / "config.json").string();
    options.max_batch = 4;
    options.max_sequence = 32;
    options.tokenizer = "chars:0123456789";  // the tiny model has 60 ids
    options.model_name = "tiny";
    options.adapters = std::move(file_adapters);
    StartServing(options);
  }

  // A greedy completion of kPrompt; `field` is "model" or "adapter".
  Answer Complete(const std::string& name, const std::string& field = "model") {
    json request = GreedyCompletion(kPrompt);
    if (!name.empty()) request[field] = name;
    auto response = transport::HttpPost({"127.0.0.1", server_->port()}, "/v1/completions",
                                        request.dump(), {.timeout = std::chrono::seconds(60)});
    Answer answer;
    EXPECT_TRUE(response.ok()) << response.status().ToString();
    if (!response.ok()) return answer;
    answer.status = response->status;
    answer.body = json::parse(response->body, nullptr, false);
    if (answer.status != 200) return answer;
    const json& choice = answer.body["choices"][0];
    answer.tokens = choice["token_ids"].get<std::vector<int32_t>>();
    answer.logprobs = choice["logprobs"]["token_logprobs"].get<std::vector<float>>();
    answer.versions = choice["policy_versions"].get<std::vector<uint64_t>>();
    return answer;
  }

  // Answers for `name` are `reference`'s logprobs, sampled at `version`.
  void ExpectServedBy(const std::string& name, model::TransformerImpl& reference,
                      uint64_t version) {
    SCOPED_TRACE("served as '" + name + "'");
    Answer answer = Complete(name);
    ASSERT_EQ(answer.status, 200) << answer.body.dump();
    ASSERT_EQ(answer.tokens.size(), 6u);
    const std::vector<float> expected = ReferenceLogprobs(reference, answer.tokens);
    for (size_t t = 0; t < expected.size(); ++t) {
      EXPECT_NEAR(answer.logprobs[t], expected[t], 1e-4) << "token " << t;
      EXPECT_EQ(answer.versions[t], version) << "token " << t;
    }
  }

  // The ids /v1/models lists, after checking every entry but the base names it as parent.
  std::vector<std::string> Models() {
    auto response = transport::HttpGet({"127.0.0.1", server_->port()}, "/v1/models");
    EXPECT_TRUE(response.ok() && response->status == 200);
    if (!response.ok()) return {};
    const json models = json::parse(response->body);
    std::vector<std::string> ids;
    for (const json& entry : models["data"]) {
      const std::string id = entry["id"];
      EXPECT_EQ(entry["parent"], id == "tiny" ? json(nullptr) : json("tiny")) << id;
      ids.push_back(id);
    }
    return ids;
  }

  // Everything logged since the test began.
  std::string Logged() {
    log_sink_->flush();
    return log_.str();
  }

  static inline int tests_started_ = 0;
  fs::path dir_;
  DType dtype_ = DType::kBF16;
  OwnedCheckpoint base_;
  std::shared_ptr<model::TransformerImpl> base_reference_;
  std::ostringstream log_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> log_sink_;
};

// (1) The first version's adapters are all served, by `model` name, each with its own
// logprobs (not the base's), and /v1/models lists them under the base. For BF16 (the mirror)
// and F32 (served without a mirror: the adapters' U8 configs do not count as base tensors).
class ServedAdaptersDTypeTest : public ServedAdaptersTest,
                                public ::testing::WithParamInterface<DType> {};

TEST_P(ServedAdaptersDTypeTest, FirstVersionServesEveryAdapterItCarries) {
  MakeBase(GetParam());
  Adapter a = MakeAdapter(21), b = MakeAdapter(22);
  StartEngine();
  OwnedCheckpoint v1 = Version(base_, {{"a", &a.snapshot}, {"b", &b.snapshot}});
  const CheckpointView view = v1.view();
  ASSERT_TRUE(engine_->OnSwap(Keyframe(1, view, nullptr)).ok()) << Logged();

  EXPECT_EQ(Models(), (std::vector<std::string>{"tiny", "a", "b"}));
  ExpectServedBy("", *base_reference_, 1);
  ExpectServedBy("a", *a.reference, 1);
  ExpectServedBy("b", *b.reference, 1);
  // The adapter changes the model: otherwise the checks above could not tell it apart.
  const Answer on_a = Complete("a");
  ASSERT_EQ(on_a.status, 200);
  const std::vector<float> base_logprobs = ReferenceLogprobs(*base_reference_, on_a.tokens);
  float largest = 0;
  for (size_t t = 0; t < base_logprobs.size(); ++t) {
    largest = std::max(largest, std::abs(on_a.logprobs[t] - base_logprobs[t]));
  }
  EXPECT_GT(largest, 1e-2);
}

INSTANTIATE_TEST_SUITE_P(ServingDtypes, ServedAdaptersDTypeTest,
                         ::testing::Values(DType::kBF16, DType::kF32),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

// (2) A delta that writes only "a"'s tensors reloads "a" alone. "b"'s served bytes are
// scribbled over without being reported as written: a reload of "b" would show in its answers.
TEST_F(ServedAdaptersTest, ADeltaReloadsOnlyTheAdaptersItWrote) {
  MakeBase(DType::kBF16);
  Adapter a = MakeAdapter(21), b = MakeAdapter(22), a2 = MakeAdapter(23), other = MakeAdapter(24);
  StartEngine();
  OwnedCheckpoint served = Version(base_, {{"a", &a.snapshot}, {"b", &b.snapshot}});
  const CheckpointView view = served.view();  // the bytes are patched in place below
  ASSERT_TRUE(engine_->OnSwap(Keyframe(1, view, nullptr)).ok()) << Logged();
  const Answer b_before = Complete("b");
  ASSERT_EQ(b_before.status, 200);

  const std::string prefix = model::kServedAdapterPrefix;
  const auto changes = PatchInPlace(served, prefix + "a/", a2.snapshot);
  ASSERT_FALSE(changes.empty());
  EXPECT_TRUE(PatchInPlace(served, prefix + "b/", other.snapshot).size() > 0);  // not reported
  ASSERT_TRUE(engine_->OnSwap(Delta(2, view, changes)).ok()) << Logged();

  ExpectServedBy("a", *a2.reference, 2);
  const Answer b_after = Complete("b");
  EXPECT_EQ(b_after.tokens, b_before.tokens);
  EXPECT_EQ(b_after.logprobs, b_before.logprobs);
  EXPECT_EQ(b_after.versions, std::vector<uint64_t>(6, 2));
  ExpectServedBy("", *base_reference_, 2);

  // A base-only delta (nothing written here) reloads no adapter either.
  ASSERT_TRUE(engine_->OnSwap(Delta(3, view, kNoChanges)).ok()) << Logged();
  EXPECT_EQ(Complete("b").logprobs, b_before.logprobs);
  ExpectServedBy("a", *a2.reference, 3);
}

// (3) A keyframe without "b" unloads it: gone from /v1/models, and asking for it is a 404.
// An adapter loaded from a file (--adapter) is not the versions' to unload.
TEST_F(ServedAdaptersTest, AnAdapterMissingFromANewVersionIsUnloaded) {
  MakeBase(DType::kBF16);
  Adapter a = MakeAdapter(21), b = MakeAdapter(22), f = MakeAdapter(25);
  const std::string file = (dir_ / "f.safetensors").string();
  ASSERT_TRUE(WriteSafetensors(file, f.snapshot.view(), {}).ok());
  StartEngine({{"f", file}});
  OwnedCheckpoint v1 = Version(base_, {{"a", &a.snapshot}, {"b", &b.snapshot}});
  const CheckpointView view1 = v1.view();
  ASSERT_TRUE(engine_->OnSwap(Keyframe(1, view1, nullptr)).ok()) << Logged();
  EXPECT_EQ(Models(), (std::vector<std::string>{"tiny", "a", "b", "f"}));

  OwnedCheckpoint v2 = Version(base_, {{"a", &a.snapshot}});
  const CheckpointView view2 = v2.view();
  ASSERT_TRUE(engine_->OnSwap(Keyframe(2, view2, &view1)).ok()) << Logged();
  EXPECT_EQ(Models(), (std::vector<std::string>{"tiny", "a", "f"}));
  EXPECT_EQ(Complete("b", "adapter").status, 404);
  ExpectServedBy("a", *a.reference, 2);
  ExpectServedBy("f", *f.reference, 2);

  // A later version may bring it back.
  OwnedCheckpoint v3 = Version(base_, {{"a", &a.snapshot}, {"b", &b.snapshot}});
  const CheckpointView view3 = v3.view();
  ASSERT_TRUE(engine_->OnSwap(Keyframe(3, view3, &view2)).ok()) << Logged();
  ExpectServedBy("b", *b.reference, 3);
}

// (4) Groups that do not load never refuse the version: a delta that breaks "a"'s config
// leaves "a"'s previous copy served; a keyframe with a group lacking its config, a bad name
// and a tensor right under the prefix serves the rest. Each is logged with spdlog::error.
TEST_F(ServedAdaptersTest, AMalformedAdapterIsLoggedAndTheVersionStillTaken) {
  MakeBase(DType::kBF16);
  Adapter a = MakeAdapter(21), b = MakeAdapter(22);
  StartEngine();
  OwnedCheckpoint served = Version(base_, {{"a", &a.snapshot}, {"b", &b.snapshot}});
  const CheckpointView view = served.view();
  ASSERT_TRUE(engine_->OnSwap(Keyframe(1, view, nullptr)).ok()) << Logged();

  OwnedCheckpoint broken = a.snapshot;
  for (OwnedTensor& t : broken.tensors) {
    if (t.name == model::kAdapterConfigTensor)
      std::fill(t.data.begin(), t.data.end(), std::byte{'x'});
  }
  const auto changes =
      PatchInPlace(served, std::string(model::kServedAdapterPrefix) + "a/", broken);
  ASSERT_EQ(changes.size(), 1u);
  ASSERT_TRUE(engine_->OnSwap(Delta(2, view, changes)).ok()) << Logged();
  EXPECT_NE(Logged().find("served adapter a not loaded (still serving its previous copy)"),
            std::string::npos)
      << Logged();
  ExpectServedBy("a", *a.reference, 2);
  ExpectServedBy("b", *b.reference, 2);

  OwnedCheckpoint no_config = b.snapshot;
  std::erase_if(no_config.tensors,
                [](const OwnedTensor& t) { return t.name == model::kAdapterConfigTensor; });
  OwnedCheckpoint v3 = Version(base_, {{"a", &a.snapshot},
                                       {"b", &b.snapshot},
                                       {"c", &no_config},
                                       {"bad name", &b.snapshot},
                                       {std::string(65, 'x'), &b.snapshot}});
  OwnedTensor stray = a.snapshot.tensors.back();  // the config, right under the prefix
  stray.name = std::string(model::kServedAdapterPrefix) + "stray";
  v3.tensors.push_back(stray);
  const CheckpointView view3 = v3.view();
  ASSERT_TRUE(engine_->OnSwap(Keyframe(3, view3, &view)).ok()) << Logged();
  const std::string logged = Logged();
  EXPECT_NE(logged.find("served adapter c not loaded (not served)"), std::string::npos) << logged;
  EXPECT_NE(logged.find("lacks its config tensor"), std::string::npos) << logged;
  EXPECT_NE(logged.find("served adapter name 'bad name' ignored"), std::string::npos) << logged;
  EXPECT_NE(logged.find("served adapter name '" + std::string(65, 'x') + "' ignored"),
            std::string::npos)
      << logged;
  EXPECT_NE(logged.find("served adapter stray not loaded"), std::string::npos) << logged;
  EXPECT_EQ(Models(), (std::vector<std::string>{"tiny", "a", "b"}));
  ExpectServedBy("a", *a.reference, 3);
  ExpectServedBy("b", *b.reference, 3);
  ExpectServedBy("", *base_reference_, 3);
}

}  // namespace
}  // namespace flywheel::rollout
