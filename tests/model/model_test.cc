// The shared transformer: config parsing and its errors, HF-named safetensors round trips,
// causality, MoE routing replay, LoRA starting equal to the base model.
#include "model/model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "checkpoint/safetensors.h"
#include "tests/model/tiny_models.h"
#include "model/weights.h"

namespace flywheel::model {
namespace {

namespace fs = std::filesystem;

ModelConfig TinyDense() {
  return testing::TinyConfig();
}

ModelConfig TinyMoe() {
  return testing::TinyConfig({.experts = 6, .moe_intermediate = 24, .mlp_only_layers = {0}});
}

fs::path TempDir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() /
                 ("flywheel_model_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

torch::Tensor Tokens(int64_t batch, int64_t length, int64_t vocab, int seed) {
  torch::manual_seed(seed);
  return torch::randint(vocab, {batch, length}, torch::kLong);
}

TEST(ModelConfigTest, ParsesHfQwen3MoeConfig) {
  const std::string text = R"({
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": false,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": true, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "torch_dtype": "bfloat16"})";
  auto c = ModelConfig::FromJsonText(text, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->NumMoeLayers(), 48);
  EXPECT_EQ(c->rope_theta, 1e6);
  auto round = ModelConfig::FromJson(c->ToJson());
  ASSERT_TRUE(round.ok());
  EXPECT_EQ(round->ToJson(), c->ToJson());
}

TEST(ModelConfigTest, LlamaDefaultsKvHeadsAndHeadDim) {
  auto c = ModelConfig::FromJsonText(
      R"({"model_type":"llama","vocab_size":100,"hidden_size":64,"num_hidden_layers":1,
          "num_attention_heads":8,"intermediate_size":128})",
      "llama");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_FALSE(c->qk_norm);
}

TEST(ModelConfigTest, BadValuesNameTheField) {
  auto expect_error = [](const std::string& text, const std::string& needle) {
    auto c = ModelConfig::FromJsonText(text, "cfg");
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status().message();
  };
  const std::string base =
      R"("vocab_size":100,"hidden_size":64,"num_hidden_layers":1,"intermediate_size":128)";
  expect_error("{" + base + R"(,"num_attention_heads":6,"num_key_value_heads":4})",
               "num_key_value_heads");
  expect_error(
      R"({"vocab_size":-3,"hidden_size":64,"num_hidden_layers":1,"num_attention_heads":8,"intermediate_size":8})",
      "vocab_size");
  expect_error("{" + base + R"(,"num_attention_heads":"8"})",
               "num_attention_heads has the wrong type");
  expect_error(
      "{" + base +
          R"(,"num_attention_heads":8,"num_experts":4,"num_experts_per_tok":5,"moe_intermediate_size":8})",
      "num_experts_per_tok");
  expect_error("{" + base + R"(,"num_attention_heads":8,"rope_theta":0})", "rope_theta");
  expect_error(
      "{" + base +
          R"(,"num_attention_heads":8,"rope_scaling":{"rope_type":"llama3","factor":8.0}})",
      "rope_scaling");
  expect_error("{" + base + R"(,"num_attention_heads":8,"use_sliding_window":true})",
               "use_sliding_window");
  expect_error("{" + base + R"(,"num_attention_heads":8,"hidden_act":"gelu"})",
               "hidden_act 'gelu'");
  expect_error("[1,2]", "not a JSON object");
  expect_error("{nope", "not valid JSON");
}

TEST(ModelTest, HfNamesAndSafetensorsRoundTrip) {
  torch::manual_seed(1);
  TransformerImpl model(TinyMoe());
  std::set<std::string> names;
  for (const auto& p : model.named_parameters()) names.insert(p.key());
  for (const char* expected :
       {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight", "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.5.up_proj.weight"}) {
    EXPECT_TRUE(names.count(expected)) << expected;
  }
  const fs::path dir = TempDir("roundtrip");
  const std::string path = (dir / "model.safetensors").string();
  ASSERT_TRUE(SaveModel(model, path, DType::kF32).ok());
  auto file = Checkpoint::Open(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->tensors().size(), names.size());

  torch::manual_seed(2);
  TransformerImpl other(TinyMoe());
  ASSERT_TRUE(LoadWeights(other, file->tensors(), path).ok());
  auto mine = model.named_parameters(), theirs = other.named_parameters();
  for (const auto& p : mine) EXPECT_TRUE(torch::equal(p.value(), theirs[p.key()])) << p.key();
  torch::Tensor tokens = Tokens(2, 7, 48, 3);
  EXPECT_TRUE(torch::equal(model.forward(tokens).logits, other.forward(tokens).logits));

  // BF16: what loads is the round-to-nearest-even cast of the fp32 weights.
  const std::string bf16 = (dir / "bf16.safetensors").string();
  ASSERT_TRUE(SaveModel(model, bf16, DType::kBF16).ok());
  auto bf16_file = Checkpoint::Open(bf16);
  ASSERT_TRUE(bf16_file.ok());
  ASSERT_TRUE(LoadWeights(other, bf16_file->tensors(), bf16).ok());
  for (const auto& p : mine) {
    EXPECT_TRUE(torch::equal(p.value().to(torch::kBFloat16).to(torch::kFloat), theirs[p.key()]))
        << p.key();
  }
  fs::remove_all(dir);
}

TEST(ModelTest, LoadErrorsNameTheTensor) {
  torch::manual_seed(1);
  TransformerImpl model(TinyDense());
  auto snapshot = SnapshotWeights(model, DType::kF32);
  ASSERT_TRUE(snapshot.ok());
  {
    OwnedCheckpoint missing = *snapshot;
    missing.tensors.erase(missing.tensors.begin() + 3);
    const std::string dropped = snapshot->tensors[3].name;
    Status s = LoadWeights(model, missing.view(), "ckpt");
    EXPECT_EQ(s.code(), StatusCode::kNotFound);
    EXPECT_NE(s.message().find("missing tensor " + dropped), std::string::npos) << s.message();
  }
  {
    OwnedCheckpoint reshaped = *snapshot;
    reshaped.tensors[0].shape = {reshaped.tensors[0].shape[1], reshaped.tensors[0].shape[0]};
    Status s = LoadWeights(model, reshaped.view(), "ckpt");
    EXPECT_EQ(s.code(), StatusCode::kMismatch);
    EXPECT_NE(s.message().find(reshaped.tensors[0].name), std::string::npos);
  }
  {
    OwnedCheckpoint extra = *snapshot;
    extra.tensors.push_back(extra.tensors[0]);
    extra.tensors.back().name = "model.layers.9.mlp.up_proj.weight";
    Status s = LoadWeights(model, extra.view(), "ckpt");
    EXPECT_NE(s.message().find("model.layers.9.mlp.up_proj.weight is not a parameter"),
              std::string::npos);
  }
  {
    OwnedCheckpoint ints = *snapshot;
    ints.tensors[0].dtype = DType::kI32;
    Status s = LoadWeights(model, ints.view(), "ckpt");
    EXPECT_NE(s.message().find("must be F32, BF16 or F16"), std::string::npos);
  }
}

TEST(ModelTest, TiedEmbeddingsShareTheMatrix) {
  ModelConfig c = TinyDense();
  c.tie_word_embeddings = true;
  torch::manual_seed(4);
  TransformerImpl model(c);
  for (const auto& p : model.named_parameters()) EXPECT_NE(p.key(), "lm_head.weight");
  torch::Tensor tokens = Tokens(1, 5, 48, 5);
  auto out = model.forward(tokens);
  torch::Tensor embed = model.named_parameters()["model.embed_tokens.weight"];
  EXPECT_TRUE(torch::allclose(out.logits, torch::matmul(out.hidden, embed.t()), 1e-5, 1e-6));
}

TEST(ModelTest, CausalAndGroupedQueryAttention) {
  torch::manual_seed(5);
  TransformerImpl model(TinyDense());
  torch::Tensor tokens = Tokens(2, 9, 48, 6);
  torch::Tensor changed = tokens.clone();
  changed.index_put_({torch::indexing::Slice(), 6}, (tokens.select(1, 6) + 1) % 48);
  auto a = model.forward(tokens).logits, b = model.forward(changed).logits;
  using torch::indexing::Slice;
  EXPECT_TRUE(torch::equal(a.index({Slice(), Slice(0, 6)}), b.index({Slice(), Slice(0, 6)})));
  EXPECT_FALSE(torch::allclose(a.index({Slice(), 6}), b.index({Slice(), 6})));
  // Padding: a shorter sequence gives the same logits as its prefix inside a longer batch.
  auto alone = model.forward(tokens.index({Slice(0, 1), Slice(0, 4)})).logits;
  EXPECT_TRUE(torch::allclose(alone, a.index({Slice(0, 1), Slice(0, 4)}), 1e-5, 1e-6));
}

TEST(MoeTest, RoutingReplayReproducesTheForwardAndTrainsTheRouter) {
  torch::manual_seed(7);
  TransformerImpl model(TinyMoe());
  torch::Tensor tokens = Tokens(3, 8, 48, 8);
  ForwardResult free_run = model.forward(tokens);
  ASSERT_EQ(free_run.routing.size(), 1u);
  EXPECT_EQ(free_run.routing[0].sizes(), (std::vector<int64_t>{3, 8, 2}));
  ASSERT_TRUE(ValidateReplay(model.config(), free_run.routing, 3, 8).ok());

  ForwardResult replayed = model.forward(tokens, {}, {}, free_run.routing);
  EXPECT_TRUE(torch::equal(replayed.logits, free_run.logits));
  EXPECT_TRUE(torch::equal(replayed.routing[0], free_run.routing[0]));

  // Other experts give other outputs: the replay is really used.
  torch::Tensor shifted = (free_run.routing[0] + 1) % 6;
  ForwardResult other = model.forward(tokens, {}, {}, {shifted});
  EXPECT_FALSE(torch::allclose(other.logits, free_run.logits));

  // The router gets gradients under replay (gate probabilities come from its logits).
  model.zero_grad();
  ForwardResult with_grad = model.forward(tokens, {}, {}, free_run.routing);
  (with_grad.logits.pow(2).mean() + with_grad.aux_loss).backward();
  torch::Tensor router_grad = model.named_parameters()["model.layers.1.mlp.gate.weight"].grad();
  ASSERT_TRUE(router_grad.defined());
  EXPECT_GT(router_grad.abs().sum().item<double>(), 0);
  EXPECT_GT(with_grad.aux_loss.item<double>(), 0);
}

TEST(MoeTest, ReplayValidation) {
  ModelConfig c = TinyMoe();
  auto idx = torch::zeros({2, 4, 2}, torch::kLong);
  EXPECT_TRUE(ValidateReplay(c, {idx}, 2, 4).ok());
  EXPECT_NE(ValidateReplay(c, {idx, idx}, 2, 4).message().find("1 MoE layers"), std::string::npos);
  EXPECT_NE(
      ValidateReplay(c, {torch::zeros({2, 4, 3}, torch::kLong)}, 2, 4).message().find("shape"),
      std::string::npos);
  EXPECT_NE(
      ValidateReplay(c, {torch::full({2, 4, 2}, 6, torch::kLong)}, 2, 4).message().find("outside"),
      std::string::npos);
}

TEST(LoraTest, ZeroBEqualsTheBaseModelAndOnlyAdaptersTrain) {
  torch::manual_seed(9);
  TransformerImpl model(TinyMoe());
  torch::Tensor tokens = Tokens(2, 6, 48, 10);
  torch::Tensor base = model.forward(tokens).logits;
  ASSERT_TRUE(model.EnableLora({.rank = 4, .alpha = 8}).ok());
  EXPECT_TRUE(torch::equal(model.forward(tokens).logits, base));

  size_t adapters = 0;
  for (const auto& p : model.named_parameters()) {
    const bool adapter = p.key().find(".lora_") != std::string::npos;
    adapters += adapter;
    EXPECT_EQ(p.value().requires_grad(), adapter) << p.key();
  }
  // 2 layers x 4 attention projections + layer 0's dense MLP (3) + 6 experts x 3, A and B each.
  EXPECT_EQ(adapters, 2u * (2 * 4 + 3 + 6 * 3));
  auto snapshot = SnapshotWeights(model, DType::kBF16, /*adapters_only=*/true);
  ASSERT_TRUE(snapshot.ok());
  ASSERT_EQ(snapshot->tensors.size(), adapters + 1);
  const OwnedTensor& config = snapshot->tensors.back();
  EXPECT_EQ(config.name, kAdapterConfigTensor);
  auto parsed = nlohmann::json::parse(
      std::string(reinterpret_cast<const char*>(config.data.data()), config.data.size()));
  EXPECT_EQ(parsed["r"], 4);
  EXPECT_EQ(parsed["lora_alpha"], 8.0);
  EXPECT_EQ(parsed["base_model_config"]["num_experts"], 6);
  // The adapters load back into a model with the same LoRA settings.
  torch::manual_seed(10);
  auto other = std::make_shared<TransformerImpl>(TinyMoe());
  ASSERT_TRUE(other->EnableLora({.rank = 4, .alpha = 8}).ok());
  ASSERT_TRUE(LoadAdapters(*other, snapshot->view(), "adapters").ok());
  EXPECT_EQ(
      snapshot->tensors[0].name.rfind("base_model.model.model.layers.0.self_attn.q_proj.lora_", 0),
      0u)
      << snapshot->tensors[0].name;
  EXPECT_FALSE(model.EnableLora({}).ok());
  EXPECT_FALSE(TransformerImpl(TinyDense()).EnableLora({.targets = {"nothing"}}).ok());
}

}  // namespace
}  // namespace flywheel::model
