// The model configuration: the fields of a Hugging Face `config.json` for the
// Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder families that flywheel's transformer needs.
// Torch-free, so tools and the sync side can read it too.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::model {

struct ModelConfig {
  std::string model_type = "qwen3";  // informational: llama, qwen2, qwen3, qwen3_moe
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // 0 in JSON (absent): = num_attention_heads
  int64_t head_dim = 0;             // 0 (absent): hidden_size / num_attention_heads
  int64_t intermediate_size = 0;    // dense MLP width
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 4096;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections carry a bias (Qwen2)
  bool qk_norm = false;         // RMSNorm on q and k per head (Qwen3; implied by qwen3*)

  // Mixture of experts (Qwen3-MoE). num_experts == 0: every layer is dense.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;  // top-k
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  double router_aux_loss_coef = 0.001;
  int64_t decoder_sparse_step = 1;       // layer i is MoE when (i + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and i is not listed here

  bool IsMoeLayer(int64_t layer) const;
  int64_t NumMoeLayers() const;
  int64_t kv_heads() const { return num_key_value_heads; }

  // Every field that must be positive is, heads divide evenly, top-k <= experts, ...;
  // the message names the field and its value.
  Status Validate() const;

  // Parses config.json contents (unknown keys are ignored, as HF does); validates.
  static Result<ModelConfig> FromJson(const nlohmann::json& json);
  static Result<ModelConfig> FromJsonText(const std::string& text, const std::string& source);
  // `path`: a config.json file, or a directory holding one.
  static Result<ModelConfig> Load(const std::string& path);
  nlohmann::json ToJson() const;
};

// The demo-size models (about 20M parameters; a CPU trains them at a few hundred tokens/s):
// Qwen3-style dense (4 layers, hidden 512, GQA 8/4, SwiGLU 1408, vocab 8192) and the same
// with MoE layers (8 experts, top-2, width 704).
ModelConfig DemoDenseConfig();
ModelConfig DemoMoeConfig();

// The pipeline demo's tiny presets (a few hundred thousand parameters: trained and sampled
// in milliseconds per step on a CPU, yet enough to learn the demo tasks): Qwen3-style, 3
// layers, hidden 128, GQA 4/2, SwiGLU 384; with `moe`, layers 1-2 have 4 experts, top-2,
// width 192. `vocab` comes from the task's tokenizer.
ModelConfig PipelineTinyConfig(int64_t vocab, bool moe);

}  // namespace flywheel::model
