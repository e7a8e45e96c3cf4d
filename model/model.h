// The decoder-only transformer shared by the trainer and the rollout engine: token
// embedding, RMSNorm, rotary position embedding, grouped-query attention (optional q/k
// norm, optional q/k/v bias), SwiGLU MLP or a Qwen3-MoE block (softmax router, top-k,
// optional renormalisation, load-balancing loss), tied or untied LM head.
//
// Parameters are registered under their Hugging Face names
// (`model.layers.3.self_attn.q_proj.weight`, `model.layers.1.mlp.experts.7.up_proj.weight`,
// `lm_head.weight`), so `named_parameters()` is the safetensors checkpoint. Compute is fp32
// (the master weights); the serving dtype only appears when weights are exported.
//
// Routing replay: Forward() may take, per MoE layer, the top-k expert indices a rollout
// worker recorded; the layer then uses exactly those experts and gathers their gate
// probabilities from this model's own router softmax, so the router still gets gradients.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "model/model_config.h"
#include "model/packed.h"

namespace flywheel::model {

// A parameter holder whose single parameter is named `weight` (LoRA A/B factors).
class WeightImpl : public torch::nn::Module {
 public:
  explicit WeightImpl(torch::Tensor value) { weight = register_parameter("weight", value); }
  torch::Tensor weight;
};

// Several LoRA adapters served on one frozen base (rollout): per adapter, per projection
// (by its HF module name) the fp32 factors; per batch row the adapter it uses. The engine
// sets `row_adapter` before each forward; rows with -1 use the base alone.
struct LoraFactors {
  torch::Tensor a;  // [rank, in]
  torch::Tensor b;  // [out, rank]
  double scale = 1;
};
struct MultiLora {
  std::vector<std::map<std::string, LoraFactors>> adapters;  // by adapter slot
  std::vector<int64_t> row_adapter;                          // one per batch row
};

// y = x W^T (+ b), plus a rank-r LoRA update scale * (x A^T) B^T once EnableLora() ran, plus
// the per-row updates of a MultiLora when one is attached.
class ProjImpl : public torch::nn::Module {
 public:
  ProjImpl(int64_t in_features, int64_t out_features, bool bias);
  torch::Tensor forward(const torch::Tensor& x);
  void AttachMultiLora(std::shared_ptr<const MultiLora> multi, std::string name) {
    multi_ = std::move(multi);
    name_ = std::move(name);
  }
  // Adds lora_A [rank, in] (uniform ±1/sqrt(in), as PEFT's kaiming init) and lora_B
  // [out, rank] = 0, so the adapted layer starts equal to the base layer.
  void EnableLora(int64_t rank, double alpha);
  bool has_lora() const { return lora_a_ != nullptr; }
  // FP8 quantization-aware training (model/fp8.h): from now on forward() computes with the
  // weight fake-quantized in block x block tiles, bit for bit the fp32 values LoadFp8Weights
  // gives a worker for SnapshotWeightsFp8's bytes, and passes the gradient of that weight
  // straight through to `weight` (d w_q / d w = identity). The bias and the LoRA adapter
  // stay fp32.
  // REQUIRES: block > 0.
  void EnableFp8FakeQuant(int64_t block);
  // The fake-quantized weight (no gradient), recomputed when `weight` changed since the last
  // call: every in-place update (optimizer step, load, copy_) moves its version counter.
  // REQUIRES: EnableFp8FakeQuant ran.
  const torch::Tensor& Fp8Weight();
  // Whether Fp8Weight() would recompute (false when fake quantization is off).
  bool fp8_weight_stale() const;
  // A copy of this projection whose weight is packed (model/packed.h) instead of an fp32
  // parameter: it has no `weight` parameter, computes with the dequantized weight, which it
  // dequantizes again in the backward pass rather than keeping it, and passes gradients only
  // to its input and its LoRA adapter (the same parameter objects as this one's).
  // Fails when the weight cannot be packed (see PackWeight) or requires a gradient.
  Result<std::shared_ptr<ProjImpl>> Packed(PackFormat format, int64_t block) const;
  // The packed weight, or null for an fp32 one.
  const PackedWeight* packed() const { return packed_.get(); }
  int64_t out_features() const;
  int64_t in_features() const;

  torch::Tensor weight;  // undefined when packed
  torch::Tensor bias;    // undefined without bias

 private:
  ProjImpl() = default;  // for Packed()
  std::shared_ptr<const PackedWeight> packed_;
  std::shared_ptr<WeightImpl> lora_a_, lora_b_;
  int64_t fp8_block_ = 0;  // 0: fake quantization off
  torch::Tensor fp8_weight_;
  int64_t fp8_version_ = -1;  // weight._version() and storage fp8_weight_ was computed from
  const void* fp8_storage_ = nullptr;
  double lora_scale_ = 0;
  std::shared_ptr<const MultiLora> multi_;
  std::string name_;
};

class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};

class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(int64_t hidden, int64_t intermediate);
  torch::Tensor forward(const torch::Tensor& x);
  // Replaces gate/up/down by their ProjImpl::Packed() copies.
  Status PackProjections(PackFormat format, int64_t block);

 private:
  std::shared_ptr<ProjImpl> gate_proj_, up_proj_, down_proj_;
};

// Keys and values of earlier tokens, for generation: per layer [slots, kv_heads,
// capacity, head_dim]. A forward over rows [first_slot, first_slot + B) writes each new
// token's key and value at its position and attends to every cached position <= its own,
// so stale entries past a row's length are never read.
struct KvCache {
  std::vector<torch::Tensor> keys, values;
  int64_t slots() const { return keys.empty() ? 0 : keys[0].size(0); }
  int64_t capacity() const { return keys.empty() ? 0 : keys[0].size(2); }
  int64_t bytes() const;
  // Copies slot `from` over slot `to` (compaction when a request leaves).
  void MoveSlot(int64_t from, int64_t to);
  // Copies positions [0, tokens) of `from`'s slot `from_slot` into this cache's slot
  // `to_slot` (a shared prefix); `from` has the same layers, heads and head size.
  void CopyPrefix(const KvCache& from, int64_t from_slot, int64_t to_slot, int64_t tokens);
};

struct CacheSpan {
  KvCache* cache = nullptr;
  int64_t first_slot = 0;
  torch::Tensor positions;  // [B, T] int64, the same the rotary embedding uses
};

// What every layer of one forward shares, computed once by TransformerImpl::Hidden: the
// attention mask ([T, T] causal, or [B, 1, T, span] over cached positions) and, with a
// cache, the rows written and the cached span attended to.
struct AttentionStep {
  torch::Tensor future;  // true where a key is hidden from a query
  const CacheSpan* cache = nullptr;
  torch::Tensor rows;  // [B, T] cache slot of every new token
  int64_t span = 0;    // cached positions [0, span) are attended to
};

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const ModelConfig& config);
  // x [B, T, D]; cos/sin [B, T, head_dim] for the tokens' positions. Causal over T; with
  // `cache`, over the cached positions instead (see KvCache), layer `layer`.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const AttentionStep& step, size_t layer = 0);

 private:
  int64_t heads_, kv_heads_, head_dim_;
  std::shared_ptr<ProjImpl> q_proj_, k_proj_, v_proj_, o_proj_;
  std::shared_ptr<RmsNormImpl> q_norm_, k_norm_;
};

struct MoeOutput {
  torch::Tensor hidden;    // [B, T, D]
  torch::Tensor indices;   // [B, T, k] int64: the experts used
  torch::Tensor aux_loss;  // scalar: E * sum_e f_e * P_e over valid tokens
};

class MoeImpl : public torch::nn::Module {
 public:
  explicit MoeImpl(const ModelConfig& config);
  // `replay` [B, T, k] int64 or undefined; `valid` [B, T] bool (tokens counted by aux loss).
  MoeOutput forward(const torch::Tensor& x, const torch::Tensor& replay,
                    const torch::Tensor& valid);
  Status PackExperts(PackFormat format, int64_t block);

 private:
  int64_t num_experts_, top_k_;
  bool norm_topk_prob_;
  std::shared_ptr<ProjImpl> gate_;
  std::vector<std::shared_ptr<MlpImpl>> experts_;
};

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const ModelConfig& config, int64_t index);
  bool is_moe() const { return moe != nullptr; }
  std::shared_ptr<AttentionImpl> self_attn;
  std::shared_ptr<MlpImpl> mlp;  // dense layers
  std::shared_ptr<MoeImpl> moe;  // MoE layers (registered as "mlp")
  std::shared_ptr<RmsNormImpl> input_layernorm, post_attention_layernorm;
};

struct ForwardResult {
  torch::Tensor logits;                // [B, T, V] fp32 (undefined from Hidden())
  torch::Tensor hidden;                // [B, T, D] final hidden states, after the last norm
  std::vector<torch::Tensor> routing;  // one [B, T, k] int64 per MoE layer, in layer order
  torch::Tensor aux_loss;              // mean over MoE layers of their aux loss; 0 if dense
};

struct LoraOptions {
  int64_t rank = 8;
  double alpha = 16;
  // Leaf names of the projections that get adapters (attention and MLP / experts).
  std::vector<std::string> targets = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                      "gate_proj", "up_proj", "down_proj"};
};

class TransformerImpl : public torch::nn::Module {
 public:
  // Random init (normal(0, 0.02) for projections and embeddings, ones for norms) from the
  // global torch seed; load real weights with LoadWeights() (model/weights.h).
  explicit TransformerImpl(ModelConfig config);

  // tokens [B, T] int64. `positions` [B, T] int64 or undefined (0..T-1). `valid` [B, T]
  // bool or undefined (all valid): padding excluded from the MoE aux loss. `replay`: empty,
  // or one [B, T, k] int64 per MoE layer (see the file comment).
  ForwardResult forward(const torch::Tensor& tokens, const torch::Tensor& positions = {},
                        const torch::Tensor& valid = {},
                        const std::vector<torch::Tensor>& replay = {});

  // Final hidden states [B, T, D] (before the LM head) and the routing, for callers that
  // compute token logprobs without materialising all logits at once.
  ForwardResult Hidden(const torch::Tensor& tokens, const torch::Tensor& positions,
                       const torch::Tensor& valid, const std::vector<torch::Tensor>& replay,
                       const CacheSpan* cache = nullptr);

  // An empty cache for `slots` sequences of up to `capacity` tokens (fp32).
  KvCache NewCache(int64_t slots, int64_t capacity) const;
  torch::Tensor LmHead(const torch::Tensor& hidden);

  // Adds adapters to every targeted projection and freezes everything else.
  Status EnableLora(const LoraOptions& options);
  // Serves several adapters at once (rollout): every projection consults `multi`.
  void AttachMultiLora(std::shared_ptr<const MultiLora> multi);
  // Module names of all projections ("model.layers.0.self_attn.q_proj") with [out, in].
  std::map<std::string, std::pair<int64_t, int64_t>> ProjectionShapes();
  bool lora_enabled() const { return lora_.has_value(); }
  // FP8 quantization-aware training: every projection whose weight Fp8WeightNames()
  // (model/fp8.h) lists, MoE experts included, computes with that weight fake-quantized in
  // block x block tiles (ProjImpl::EnableFp8FakeQuant); routers, lm_head, embeddings, norms
  // and LoRA adapters stay fp32. The fake-quantized weights are cached and recomputed at the
  // first forward after the masters change, all stale projections at once. Fails on a block
  // below 1 or when already enabled.
  Status EnableFp8Qat(int64_t block);
  int64_t fp8_qat_block() const { return fp8_qat_block_; }  // 0: off
  // Packed frozen experts (model/packed.h): every MoE expert's gate/up/down weight is stored
  // packed and dequantized one expert at a time while its matmuls run, in the forward and
  // again in the backward pass, so the fp32 weights of all experts never exist at once. The
  // packed weights leave named_parameters() (PackedWeights() lists them); full snapshots
  // (SnapshotWeights) still carry them, dequantized. Requires LoRA (the experts must be
  // frozen) and a MoE model; run before EnableFp8Qat (packed experts are not fake-quantized:
  // their packed values already are what is served). `block` 0: the format's default.
  Status PackFrozenExperts(PackFormat format, int64_t block = 0);
  PackFormat packed_experts() const { return packed_experts_; }
  // Every packed weight by its parameter name (`...experts.3.up_proj.weight`), model order.
  std::vector<std::pair<std::string, const PackedWeight*>> PackedWeights();
  const std::optional<LoraOptions>& lora() const { return lora_; }

  const ModelConfig& config() const { return config_; }

 private:
  ModelConfig config_;
  std::optional<LoraOptions> lora_;
  int64_t fp8_qat_block_ = 0;
  PackFormat packed_experts_ = PackFormat::kNone;
  // The projections EnableFp8Qat fake-quantizes.
  std::vector<std::shared_ptr<ProjImpl>> fp8_projections_;
  std::shared_ptr<torch::nn::Module> body_;  // "model"
  torch::Tensor embed_tokens_;               // model.embed_tokens.weight
  std::vector<std::shared_ptr<DecoderLayerImpl>> layers_;
  std::shared_ptr<RmsNormImpl> norm_;
  std::shared_ptr<ProjImpl> lm_head_;  // null when tied
  torch::Tensor inv_freq_;             // [head_dim / 2], not a parameter
};

// Validates `replay` against the config and the batch shape; the message names the layer.
Status ValidateReplay(const ModelConfig& config, const std::vector<torch::Tensor>& replay,
                      int64_t batch, int64_t length);

}  // namespace flywheel::model
