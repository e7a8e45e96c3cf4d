// model/memory_plan.h: the parameter counts equal the transformer's own (dense, MoE with
// dense-only layers, biases, tied embeddings, LoRA), and a small plan's terms equal a hand
// count. The plan against measured peak RSS: tests/pipeline/pipeline_fleet_test.cc.
#include "model/memory_plan.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "model/model.h"
#include "tiny_models.h"

namespace flywheel::model {
namespace {

int64_t Numel(TransformerImpl& model, bool trainable_only) {
  int64_t total = 0;
  for (const auto& p : model.parameters()) {
    if (!trainable_only || p.requires_grad()) total += p.numel();
  }
  return total;
}

TEST(MemoryPlanTest, ParameterCountsEqualTheModelsOwn) {
  std::vector<ModelConfig> configs = {testing::TinyConfig(), testing::TinyConfig({.experts = 4}),
                                      testing::TinyConfig({.experts = 4, .mlp_only_layers = {0}})};
  ModelConfig qwen2 = testing::TinyConfig();
  qwen2.model_type = "qwen2";
  qwen2.attention_bias = true;
  qwen2.qk_norm = false;
  qwen2.tie_word_embeddings = true;
  configs.push_back(qwen2);
  for (const ModelConfig& config : configs) {
    SCOPED_TRACE(config.model_type + " experts " + std::to_string(config.num_experts));
    ASSERT_TRUE(config.Validate().ok());
    TransformerImpl model(config);
    EXPECT_EQ(ParameterCount(config), Numel(model, false));
    ASSERT_TRUE(model.EnableLora({.rank = 4}).ok());
    EXPECT_EQ(LoraParameterCount(config, 4), Numel(model, true));
  }
}

TEST(MemoryPlanTest, ASmallPlanEqualsAHandCount) {
  ModelConfig c = testing::TinyConfig({.vocab = 10});
  // embeddings 10x32 twice (untied), final norm 32; per layer: q 32x32, k and v 32x16, o 32x32,
  // q/k norms 8 each, two norms 32 each, MLP 3x32x64.
  const int64_t per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 16 + 64 + 3 * 32 * 64;
  const int64_t p = 2 * 10 * 32 + 32 + 2 * per_layer;
  ASSERT_EQ(ParameterCount(c), p);
  PlanInputs in;
  in.model = c;
  in.context = 16;
  in.train_sequences = 2;
  in.workers = 3;
  in.relays = 1;
  in.worker_max_batch = 4;
  in.prefix_slots = 0;
  const MemoryPlan plan = PlanMemory(in);
  // Activations: per layer and token (12h + 2(q + 2kv) + 4i + 2 heads C) x 4, the logits
  // vocab x 4 x 3, for 2 sequences of 16 tokens.
  const uint64_t layer_token = (12 * 32 + 2 * (32 + 2 * 16) + 4 * 64 + 2 * 4 * 16) * 4;
  const uint64_t activations = 2 * 16 * (2 * layer_token + 10 * 4 * 3);
  const uint64_t trainer = 4 * p + 4 * p + 8 * p + 4 * p + 2 * (2 * p) + activations + kTrainerRuntimeBytes;
  EXPECT_EQ(plan.trainer_bytes, trainer);
  const uint64_t kv = 4 * 16 * (2 * 2 * 2 * 8) * 4;  // slots x context x (layers x 2 x kv x hd) x 4
  EXPECT_EQ(plan.worker_bytes, 2 * p + 4 * p + 2 * (2 * p) + kv + kWorkerRuntimeBytes);
  EXPECT_EQ(plan.relay_bytes, 2 * p + kRelayRuntimeBytes);
  EXPECT_EQ(plan.total_bytes, plan.trainer_bytes + 3 * plan.worker_bytes + plan.relay_bytes);
  EXPECT_NE(plan.Table().find("KV cache (4 slots x 16)"), std::string::npos) << plan.Table();
  // LoRA: gradients and moments of the adapters only, the adapters' own fp32 weights.
  in.lora_rank = 2;
  const MemoryPlan lora = PlanMemory(in);
  const uint64_t t = static_cast<uint64_t>(LoraParameterCount(c, 2));
  EXPECT_EQ(lora.trainer_bytes, 4 * (p + t) + 4 * t + 8 * t + 4 * p + 2 * (2 * p) + activations + kTrainerRuntimeBytes);
}

TEST(MemoryPlanTest, AvailableMemoryIsReadAndAPlanTooLargeDoesNotFit) {
  EXPECT_GT(AvailableMemory(), 0u);  // Linux: /proc/meminfo
  ModelConfig huge = testing::TinyConfig({.vocab = 1000});
  huge.hidden_size = 16384;
  huge.num_attention_heads = 128;
  huge.head_dim = 128;
  huge.num_key_value_heads = 8;
  huge.intermediate_size = 53248;
  huge.num_hidden_layers = 126;  // ~400B parameters
  PlanInputs in;
  in.model = huge;
  in.context = 8;
  const MemoryPlan plan = PlanMemory(in);
  EXPECT_FALSE(plan.fits());
  EXPECT_NE(plan.Table().find("does NOT fit"), std::string::npos);
}

}  // namespace
}  // namespace flywheel::model
