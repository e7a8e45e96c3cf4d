#include "model/model_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace flywheel::model {

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end())
    return false;
  return decoder_sparse_step > 0 && (layer + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::NumMoeLayers() const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i) n += IsMoeLayer(i) ? 1 : 0;
  return n;
}

Status ModelConfig::Validate() const {
  auto positive = [](const char* name, int64_t v) -> Status {
    if (v > 0) return Status::Ok();
    return Status::InvalidArgument(std::string("model config: ") + name + " must be > 0, got " +
                                   std::to_string(v));
  };
  FW_RETURN_IF_ERROR(positive("vocab_size", vocab_size));
  FW_RETURN_IF_ERROR(positive("hidden_size", hidden_size));
  FW_RETURN_IF_ERROR(positive("num_hidden_layers", num_hidden_layers));
  FW_RETURN_IF_ERROR(positive("num_attention_heads", num_attention_heads));
  FW_RETURN_IF_ERROR(positive("num_key_value_heads", num_key_value_heads));
  FW_RETURN_IF_ERROR(positive("head_dim", head_dim));
  if (num_attention_heads % num_key_value_heads != 0) {
    return Status::InvalidArgument(
        "model config: num_attention_heads (" + std::to_string(num_attention_heads) +
        ") is not a multiple of num_key_value_heads (" + std::to_string(num_key_value_heads) + ")");
  }
  if (head_dim % 2 != 0) {
    return Status::InvalidArgument(
        "model config: head_dim must be even for rotary embeddings, got " +
        std::to_string(head_dim));
  }
  if (!(rope_theta > 0)) {
    return Status::InvalidArgument("model config: rope_theta must be > 0, got " +
                                   std::to_string(rope_theta));
  }
  if (!(rms_norm_eps > 0)) {
    return Status::InvalidArgument("model config: rms_norm_eps must be > 0, got " +
                                   std::to_string(rms_norm_eps));
  }
  bool any_dense = false;
  for (int64_t i = 0; i < num_hidden_layers; ++i) any_dense |= !IsMoeLayer(i);
  if (any_dense) FW_RETURN_IF_ERROR(positive("intermediate_size", intermediate_size));
  if (num_experts < 0) {
    return Status::InvalidArgument("model config: num_experts must be >= 0, got " +
                                   std::to_string(num_experts));
  }
  if (num_experts > 0) {
    FW_RETURN_IF_ERROR(positive("num_experts_per_tok", num_experts_per_tok));
    FW_RETURN_IF_ERROR(positive("moe_intermediate_size", moe_intermediate_size));
    FW_RETURN_IF_ERROR(positive("decoder_sparse_step", decoder_sparse_step));
    if (num_experts_per_tok > num_experts) {
      return Status::InvalidArgument("model config: num_experts_per_tok (" +
                                     std::to_string(num_experts_per_tok) +
                                     ") exceeds num_experts (" + std::to_string(num_experts) + ")");
    }
    if (router_aux_loss_coef < 0) {
      return Status::InvalidArgument("model config: router_aux_loss_coef must be >= 0");
    }
  }
  return Status::Ok();
}

namespace {

// Reads `key` into `out` when present; a value of the wrong JSON type is an error naming it.
template <typename T>
Status Read(const nlohmann::json& json, const char* key, T& out) {
  auto it = json.find(key);
  if (it == json.end() || it->is_null()) return Status::Ok();
  bool type_ok = true;
  if constexpr (std::is_same_v<T, bool>) {
    type_ok = it->is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    type_ok = it->is_number_integer();
  } else if constexpr (std::is_floating_point_v<T>) {
    type_ok = it->is_number();
  } else if constexpr (std::is_same_v<T, std::string>) {
    type_ok = it->is_string();
  } else {
    type_ok = it->is_array() && std::all_of(it->begin(), it->end(),
                                            [](const auto& v) { return v.is_number_integer(); });
  }
  if (!type_ok) {
    return Status::InvalidArgument(std::string("model config: ") + key + " has the wrong type (" +
                                   it->dump() + ")");
  }
  out = it->get<T>();
  return Status::Ok();
}

}  // namespace

Result<ModelConfig> ModelConfig::FromJson(const nlohmann::json& json) {
  if (!json.is_object()) return Status::InvalidArgument("model config: not a JSON object");
  ModelConfig c;
  FW_RETURN_IF_ERROR(Read(json, "model_type", c.model_type));
  FW_RETURN_IF_ERROR(Read(json, "vocab_size", c.vocab_size));
  FW_RETURN_IF_ERROR(Read(json, "hidden_size", c.hidden_size));
  FW_RETURN_IF_ERROR(Read(json, "num_hidden_layers", c.num_hidden_layers));
  FW_RETURN_IF_ERROR(Read(json, "num_attention_heads", c.num_attention_heads));
  c.num_key_value_heads = c.num_attention_heads;
  FW_RETURN_IF_ERROR(Read(json, "num_key_value_heads", c.num_key_value_heads));
  if (c.num_attention_heads > 0) c.head_dim = c.hidden_size / c.num_attention_heads;
  FW_RETURN_IF_ERROR(Read(json, "head_dim", c.head_dim));
  FW_RETURN_IF_ERROR(Read(json, "intermediate_size", c.intermediate_size));
  FW_RETURN_IF_ERROR(Read(json, "rope_theta", c.rope_theta));
  FW_RETURN_IF_ERROR(Read(json, "rms_norm_eps", c.rms_norm_eps));
  FW_RETURN_IF_ERROR(Read(json, "max_position_embeddings", c.max_position_embeddings));
  FW_RETURN_IF_ERROR(Read(json, "tie_word_embeddings", c.tie_word_embeddings));
  FW_RETURN_IF_ERROR(Read(json, "attention_bias", c.attention_bias));
  c.qk_norm = c.model_type.rfind("qwen3", 0) == 0;
  FW_RETURN_IF_ERROR(Read(json, "qk_norm", c.qk_norm));
  FW_RETURN_IF_ERROR(Read(json, "num_experts", c.num_experts));
  FW_RETURN_IF_ERROR(Read(json, "num_experts_per_tok", c.num_experts_per_tok));
  FW_RETURN_IF_ERROR(Read(json, "moe_intermediate_size", c.moe_intermediate_size));
  FW_RETURN_IF_ERROR(Read(json, "norm_topk_prob", c.norm_topk_prob));
  FW_RETURN_IF_ERROR(Read(json, "router_aux_loss_coef", c.router_aux_loss_coef));
  FW_RETURN_IF_ERROR(Read(json, "decoder_sparse_step", c.decoder_sparse_step));
  FW_RETURN_IF_ERROR(Read(json, "mlp_only_layers", c.mlp_only_layers));
  // Features this transformer does not implement must not be silently ignored: a model that
  // needs them would load and compute something else.
  auto it = json.find("rope_scaling");
  if (it != json.end() && !it->is_null()) {
    return Status::InvalidArgument("model config: rope_scaling (" + it->dump() + ") is not supported");
  }
  for (const char* key : {"use_sliding_window", "use_qk_norm_in_gate"}) {
    auto flag = json.find(key);
    if (flag != json.end() && flag->is_boolean() && flag->get<bool>()) {
      return Status::InvalidArgument(std::string("model config: ") + key + " = true is not supported");
    }
  }
  auto act = json.find("hidden_act");
  if (act != json.end() && act->is_string() && *act != "silu") {
    return Status::InvalidArgument("model config: hidden_act '" + act->get<std::string>() +
                                   "' is not supported (only silu / SwiGLU)");
  }
  FW_RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<ModelConfig> ModelConfig::FromJsonText(const std::string& text, const std::string& source) {
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return Status::InvalidArgument(source + ": not valid JSON");
  auto config = FromJson(json);
  if (!config.ok()) return Status::InvalidArgument(source + ": " + config.status().message());
  return config;
}

Result<ModelConfig> ModelConfig::Load(const std::string& path) {
  std::filesystem::path file = path;
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) file /= "config.json";
  std::ifstream in(file);
  if (!in) return Status::NotFound("cannot open model config " + file.string());
  std::stringstream text;
  text << in.rdbuf();
  return FromJsonText(text.str(), file.string());
}

nlohmann::json ModelConfig::ToJson() const {
  nlohmann::json j = {
      {"model_type", model_type},
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"intermediate_size", intermediate_size},
      {"rope_theta", rope_theta},
      {"rms_norm_eps", rms_norm_eps},
      {"max_position_embeddings", max_position_embeddings},
      {"tie_word_embeddings", tie_word_embeddings},
      {"attention_bias", attention_bias},
      {"qk_norm", qk_norm},
  };
  if (num_experts > 0) {
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
  }
  return j;
}

ModelConfig DemoDenseConfig() {
  ModelConfig c;
  c.model_type = "qwen3";
  c.vocab_size = 8192;
  c.hidden_size = 512;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.intermediate_size = 1408;
  c.rope_theta = 1e6;
  c.qk_norm = true;
  c.max_position_embeddings = 4096;
  return c;
}

ModelConfig DemoMoeConfig() {
  ModelConfig c = DemoDenseConfig();
  c.model_type = "qwen3_moe";
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 704;
  return c;
}

ModelConfig PipelineTinyConfig(int64_t vocab, bool moe) {
  ModelConfig c;
  c.model_type = "qwen3";
  c.vocab_size = vocab;
  c.hidden_size = 128;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.intermediate_size = 384;
  c.qk_norm = true;
  c.max_position_embeddings = 64;
  if (moe) {
    c.model_type = "qwen3_moe";
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 192;
    c.mlp_only_layers = {0};
  }
  return c;
}

}  // namespace flywheel::model
