// Tiny Qwen3-style models for the trainer and rollout tests: 2 layers, hidden 32, GQA 4/2,
// head_dim 8, q/k norm; MoE when `experts` > 0.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model_config.h"

namespace flywheel::testing {

struct TinyOptions {
  int64_t vocab = 48;
  int64_t experts = 0;  // 0: dense
  int64_t moe_intermediate = 16;
  std::vector<int64_t> mlp_only_layers = {};
};

inline model::ModelConfig TinyConfig(const TinyOptions& o = {}) {
  model::ModelConfig c;
  c.model_type = o.experts > 0 ? "qwen3_moe" : "qwen3";
  c.vocab_size = o.vocab;
  c.hidden_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.intermediate_size = 64;
  c.qk_norm = true;
  c.max_position_embeddings = 128;
  if (o.experts > 0) {
    c.num_experts = o.experts;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = o.moe_intermediate;
    c.mlp_only_layers = o.mlp_only_layers;
  }
  return c;
}

}  // namespace flywheel::testing
