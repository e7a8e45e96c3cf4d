#include "model/model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <set>

#include "model/fp8.h"

namespace flywheel::model {

namespace {

constexpr double kInitStd = 0.02;  // HF initializer_range

torch::Tensor RotateHalf(const torch::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return torch::cat({-halves[1], halves[0]}, -1);
}

// dequant(quant(w)) with model/fp8.h's own QuantizeBlockwise and DequantizeBlockwise: the
// values LoadFp8Weights writes into a worker's fp32 weight for SnapshotWeightsFp8's bytes.
torch::Tensor Fp8FakeQuantize(const torch::Tensor& w, int64_t block) {
  torch::NoGradGuard no_grad;
  const torch::Tensor master = w.detach().to(torch::kCPU, torch::kFloat).contiguous();
  const int64_t rows = master.size(0), cols = master.size(1);
  const Fp8Block q = QuantizeBlockwise(master.data_ptr<float>(), rows, cols, block);
  torch::Tensor out = torch::empty({rows, cols}, torch::kFloat);
  DequantizeBlockwise(q.data.data(), q.scale_inv.data(), rows, cols, block, out.data_ptr<float>());
  return out.to(w.options().requires_grad(false));
}

// Forward: the fake-quantized weight as it is; backward: the master's gradient is the
// fake-quantized weight's (the straight-through estimator). Returning `quantized` itself,
// with no arithmetic on it (master + (quantized - master).detach() could flip the sign of a
// zero), makes the forward bit-exact by construction.
struct StraightThrough : torch::autograd::Function<StraightThrough> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& /*master*/,
                               const torch::Tensor& quantized) {
    return quantized;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

// y = x W^T for a packed W: the forward dequantizes W, the backward dequantizes it again for
// dx = dy W, so no fp32 W outlives its matmul. W gets no gradient (it is frozen). The graph
// holds the packed tensors themselves (reference-counted), so a backward run after the model
// is gone still finds them.
struct PackedLinear : torch::autograd::Function<PackedLinear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const PackedWeight* packed) {
    ctx->saved_data["data"] = packed->data;
    ctx->saved_data["scales"] = packed->scales;
    ctx->saved_data["shape"] = std::vector<int64_t>{static_cast<int64_t>(packed->format),
                                                    packed->rows, packed->cols, packed->block};
    return torch::linear(x, packed->Dequantize());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    PackedWeight packed;
    packed.format = static_cast<PackFormat>(shape[0]);
    packed.rows = shape[1];
    packed.cols = shape[2];
    packed.block = shape[3];
    packed.data = ctx->saved_data["data"].toTensor();
    packed.scales = ctx->saved_data["scales"].toTensor();
    return {torch::matmul(grads[0], packed.Dequantize()), torch::Tensor()};
  }
};

}  // namespace

ProjImpl::ProjImpl(int64_t in_features, int64_t out_features, bool bias) {
  weight = register_parameter("weight", torch::randn({out_features, in_features}) * kInitStd);
  if (bias) this->bias = register_parameter("bias", torch::zeros({out_features}));
}

torch::Tensor ProjImpl::forward(const torch::Tensor& x) {
  torch::Tensor y;
  if (packed_) {
    y = x.requires_grad() && torch::GradMode::is_enabled()
            ? PackedLinear::apply(x, packed_.get())
            : torch::linear(x, packed_->Dequantize());
    if (bias.defined()) y = y + bias;
  } else {
    torch::Tensor w = weight;
    if (fp8_block_ > 0) {
      const torch::Tensor& quantized = Fp8Weight();
      w = weight.requires_grad() && torch::GradMode::is_enabled()
              ? StraightThrough::apply(weight, quantized)
              : quantized;
    }
    y = torch::linear(x, w, bias);
  }
  if (lora_a_)
    y = y + torch::linear(torch::linear(x, lora_a_->weight), lora_b_->weight) * lora_scale_;
  if (multi_ && !multi_->row_adapter.empty() && x.dim() >= 2 &&
      static_cast<int64_t>(multi_->row_adapter.size()) == x.size(0)) {
    // Group the rows by adapter; each group adds its own low-rank update.
    std::map<int64_t, std::vector<int64_t>> groups;
    for (size_t row = 0; row < multi_->row_adapter.size(); ++row) {
      if (multi_->row_adapter[row] >= 0)
        groups[multi_->row_adapter[row]].push_back(static_cast<int64_t>(row));
    }
    for (const auto& [slot, rows] : groups) {
      const auto& factors = multi_->adapters[slot];
      auto it = factors.find(name_);
      if (it == factors.end()) continue;
      torch::Tensor index = torch::tensor(rows, torch::kLong);
      torch::Tensor update =
          torch::linear(torch::linear(x.index_select(0, index), it->second.a), it->second.b) *
          it->second.scale;
      y = y.index_add(0, index, update);
    }
  }
  return y;
}

void ProjImpl::EnableLora(int64_t rank, double alpha) {
  const int64_t in = in_features(), out = out_features();
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  lora_a_ = register_module(
      "lora_A", std::make_shared<WeightImpl>(torch::empty({rank, in}).uniform_(-bound, bound)));
  lora_b_ = register_module("lora_B", std::make_shared<WeightImpl>(torch::zeros({out, rank})));
  lora_scale_ = alpha / static_cast<double>(rank);
}

void ProjImpl::EnableFp8FakeQuant(int64_t block) {
  assert(block > 0);
  fp8_block_ = block;
  fp8_weight_ = torch::Tensor();
  fp8_version_ = -1;
  fp8_storage_ = nullptr;
}

bool ProjImpl::fp8_weight_stale() const {
  return fp8_block_ > 0 && (!fp8_weight_.defined() || weight._version() != fp8_version_ ||
                            weight.storage().data() != fp8_storage_);
}

const torch::Tensor& ProjImpl::Fp8Weight() {
  assert(fp8_block_ > 0);
  if (fp8_weight_stale()) {
    fp8_weight_ = Fp8FakeQuantize(weight, fp8_block_);
    fp8_version_ = weight._version();
    fp8_storage_ = weight.storage().data();
  }
  return fp8_weight_;
}

int64_t ProjImpl::out_features() const {
  return packed_ ? packed_->rows : weight.size(0);
}

int64_t ProjImpl::in_features() const {
  return packed_ ? packed_->cols : weight.size(1);
}

Result<std::shared_ptr<ProjImpl>> ProjImpl::Packed(PackFormat format, int64_t block) const {
  if (packed_) return Status::InvalidArgument("the projection is already packed");
  if (weight.requires_grad())
    return Status::InvalidArgument("only a frozen weight can be packed (it requires a gradient)");
  FW_ASSIGN_OR_RETURN(PackedWeight packed, PackWeight(weight, format, block));
  std::shared_ptr<ProjImpl> out(new ProjImpl());
  out->packed_ = std::make_shared<const PackedWeight>(std::move(packed));
  if (bias.defined()) out->bias = out->register_parameter("bias", bias, bias.requires_grad());
  if (lora_a_) {
    out->lora_a_ = out->register_module("lora_A", lora_a_);
    out->lora_b_ = out->register_module("lora_B", lora_b_);
    out->lora_scale_ = lora_scale_;
  }
  out->multi_ = multi_;
  out->name_ = name_;
  return out;
}

RmsNormImpl::RmsNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RmsNormImpl::forward(const torch::Tensor& x) {
  torch::Tensor variance = x.pow(2).mean(-1, /*keepdim=*/true);
  return x * torch::rsqrt(variance + eps_) * weight;
}

MlpImpl::MlpImpl(int64_t hidden, int64_t intermediate) {
  gate_proj_ =
      register_module("gate_proj", std::make_shared<ProjImpl>(hidden, intermediate, false));
  up_proj_ = register_module("up_proj", std::make_shared<ProjImpl>(hidden, intermediate, false));
  down_proj_ =
      register_module("down_proj", std::make_shared<ProjImpl>(intermediate, hidden, false));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return down_proj_->forward(torch::silu(gate_proj_->forward(x)) * up_proj_->forward(x));
}

AttentionImpl::AttentionImpl(const ModelConfig& c)
    : heads_(c.num_attention_heads), kv_heads_(c.num_key_value_heads), head_dim_(c.head_dim) {
  const int64_t d = c.hidden_size;
  q_proj_ = register_module("q_proj",
                            std::make_shared<ProjImpl>(d, heads_ * head_dim_, c.attention_bias));
  k_proj_ = register_module("k_proj",
                            std::make_shared<ProjImpl>(d, kv_heads_ * head_dim_, c.attention_bias));
  v_proj_ = register_module("v_proj",
                            std::make_shared<ProjImpl>(d, kv_heads_ * head_dim_, c.attention_bias));
  o_proj_ = register_module("o_proj", std::make_shared<ProjImpl>(heads_ * head_dim_, d, false));
  if (c.qk_norm) {
    q_norm_ = register_module("q_norm", std::make_shared<RmsNormImpl>(head_dim_, c.rms_norm_eps));
    k_norm_ = register_module("k_norm", std::make_shared<RmsNormImpl>(head_dim_, c.rms_norm_eps));
  }
}

int64_t KvCache::bytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    total +=
        keys[i].numel() * keys[i].element_size() + values[i].numel() * values[i].element_size();
  }
  return total;
}

void KvCache::MoveSlot(int64_t from, int64_t to) {
  if (from == to) return;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i][to].copy_(keys[i][from]);
    values[i][to].copy_(values[i][from]);
  }
}

void KvCache::CopyPrefix(const KvCache& from, int64_t from_slot, int64_t to_slot,
                         int64_t tokens) {
  if (tokens <= 0 || (&from == this && from_slot == to_slot)) return;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i][to_slot].narrow(1, 0, tokens).copy_(from.keys[i][from_slot].narrow(1, 0, tokens));
    values[i][to_slot].narrow(1, 0, tokens).copy_(from.values[i][from_slot].narrow(1, 0, tokens));
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const AttentionStep& step,
                                     size_t layer) {
  const int64_t batch = x.size(0), length = x.size(1);
  torch::Tensor q = q_proj_->forward(x).view({batch, length, heads_, head_dim_});
  torch::Tensor k = k_proj_->forward(x).view({batch, length, kv_heads_, head_dim_});
  torch::Tensor v = v_proj_->forward(x).view({batch, length, kv_heads_, head_dim_});
  if (q_norm_) {
    q = q_norm_->forward(q);
    k = k_norm_->forward(k);
  }
  q = q.transpose(1, 2);  // [B, H, T, hd]
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  const torch::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // [B, 1, T, hd]
  q = q * c + RotateHalf(q) * s;
  k = k * c + RotateHalf(k) * s;
  if (step.cache) {
    using torch::indexing::Slice;
    const CacheSpan& cache = *step.cache;
    torch::Tensor& keys = cache.cache->keys[layer];
    torch::Tensor& values = cache.cache->values[layer];
    {
      torch::NoGradGuard no_grad;
      keys.index_put_({step.rows, Slice(), cache.positions}, k.permute({0, 2, 1, 3}));
      values.index_put_({step.rows, Slice(), cache.positions}, v.permute({0, 2, 1, 3}));
    }
    k = keys.narrow(0, cache.first_slot, batch).narrow(2, 0, step.span);
    v = values.narrow(0, cache.first_slot, batch).narrow(2, 0, step.span);
  }
  // Grouped-query attention without copying K and V for every query head: the `group`
  // query heads that share a KV head (heads kv * group .. kv * group + group - 1, HF's
  // repeat_kv order) are one [group * T, hd] matrix against it. A decode step over a long
  // cache reads K and V once instead of writing `group` copies of them first.
  const int64_t group = heads_ / kv_heads_, span = k.size(2);
  torch::Tensor grouped_q = q.reshape({batch, kv_heads_, group * length, head_dim_});
  torch::Tensor scores = torch::matmul(grouped_q, k.transpose(-2, -1))
                             .view({batch, heads_, length, span}) /
                         std::sqrt(static_cast<double>(head_dim_));
  scores = scores.masked_fill(step.future, -std::numeric_limits<float>::infinity());
  torch::Tensor probs =
      torch::softmax(scores, -1).view({batch, kv_heads_, group * length, span});
  torch::Tensor out = torch::matmul(probs, v).view({batch, heads_, length, head_dim_});
  return o_proj_->forward(out.transpose(1, 2).reshape({batch, length, heads_ * head_dim_}));
}

Status MlpImpl::PackProjections(PackFormat format, int64_t block) {
  // All three first, so that a failure leaves this MLP as it was.
  FW_ASSIGN_OR_RETURN(std::shared_ptr<ProjImpl> gate, gate_proj_->Packed(format, block));
  FW_ASSIGN_OR_RETURN(std::shared_ptr<ProjImpl> up, up_proj_->Packed(format, block));
  FW_ASSIGN_OR_RETURN(std::shared_ptr<ProjImpl> down, down_proj_->Packed(format, block));
  gate_proj_ = replace_module("gate_proj", std::move(gate));
  up_proj_ = replace_module("up_proj", std::move(up));
  down_proj_ = replace_module("down_proj", std::move(down));
  return Status::Ok();
}

MoeImpl::MoeImpl(const ModelConfig& c)
    : num_experts_(c.num_experts),
      top_k_(c.num_experts_per_tok),
      norm_topk_prob_(c.norm_topk_prob) {
  gate_ = register_module("gate", std::make_shared<ProjImpl>(c.hidden_size, num_experts_, false));
  auto list = register_module("experts", std::make_shared<torch::nn::Module>());
  for (int64_t e = 0; e < num_experts_; ++e) {
    experts_.push_back(list->register_module(
        std::to_string(e), std::make_shared<MlpImpl>(c.hidden_size, c.moe_intermediate_size)));
  }
}

MoeOutput MoeImpl::forward(const torch::Tensor& x, const torch::Tensor& replay,
                           const torch::Tensor& valid) {
  const int64_t batch = x.size(0), length = x.size(1), d = x.size(2);
  torch::Tensor flat = x.reshape({batch * length, d});
  torch::Tensor probs = torch::softmax(gate_->forward(flat), -1);  // [N, E]
  torch::Tensor weights, indices;
  if (replay.defined()) {
    indices = replay.reshape({batch * length, top_k_}).to(torch::kLong);
    weights = probs.gather(1, indices);
  } else {
    std::tie(weights, indices) = probs.topk(top_k_, -1);
  }
  if (norm_topk_prob_) weights = weights / weights.sum(-1, /*keepdim=*/true);

  torch::Tensor out = torch::zeros_like(flat);
  for (int64_t e = 0; e < num_experts_; ++e) {
    torch::Tensor hit = indices.eq(e);                       // [N, k]
    torch::Tensor rows = hit.any(-1).nonzero().squeeze(-1);  // tokens routed to e
    if (rows.numel() == 0) continue;
    torch::Tensor gate = (weights * hit).sum(-1).index_select(0, rows).unsqueeze(-1);
    torch::Tensor y = experts_[e]->forward(flat.index_select(0, rows)) * gate;
    out = out.index_add(0, rows, y);
  }

  // Load balancing (Switch / HF load_balancing_loss_func) over valid tokens:
  // E * sum_{k,e} f_{k,e} * P_e, f = share of tokens whose k-th choice is e.
  torch::Tensor mask = valid.defined() ? valid.reshape({batch * length}).to(torch::kFloat)
                                       : torch::ones({batch * length});
  const torch::Tensor count = mask.sum().clamp_min(1.0);
  torch::Tensor one_hot = torch::one_hot(indices, num_experts_).to(torch::kFloat);     // [N, k, E]
  torch::Tensor tokens_per_expert = (one_hot * mask.view({-1, 1, 1})).sum(0) / count;  // [k, E]
  torch::Tensor prob_per_expert = (probs * mask.view({-1, 1})).sum(0) / count;         // [E]
  torch::Tensor aux =
      (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * static_cast<double>(num_experts_);
  return {out.view({batch, length, d}), indices.view({batch, length, top_k_}), aux};
}

Status MoeImpl::PackExperts(PackFormat format, int64_t block) {
  for (size_t e = 0; e < experts_.size(); ++e) {
    FW_RETURN_IF_ERROR(experts_[e]->PackProjections(format, block).WithContext(
        "packing expert " + std::to_string(e)));
  }
  return Status::Ok();
}

DecoderLayerImpl::DecoderLayerImpl(const ModelConfig& c, int64_t index) {
  self_attn = register_module("self_attn", std::make_shared<AttentionImpl>(c));
  if (c.IsMoeLayer(index)) {
    moe = register_module("mlp", std::make_shared<MoeImpl>(c));
  } else {
    mlp = register_module("mlp", std::make_shared<MlpImpl>(c.hidden_size, c.intermediate_size));
  }
  input_layernorm = register_module("input_layernorm",
                                    std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm = register_module(
      "post_attention_layernorm", std::make_shared<RmsNormImpl>(c.hidden_size, c.rms_norm_eps));
}

TransformerImpl::TransformerImpl(ModelConfig config) : config_(std::move(config)) {
  body_ = register_module("model", std::make_shared<torch::nn::Module>());
  embed_tokens_ =
      body_
          ->register_module("embed_tokens",
                            std::make_shared<WeightImpl>(
                                torch::randn({config_.vocab_size, config_.hidden_size}) * kInitStd))
          ->weight;
  auto list = body_->register_module("layers", std::make_shared<torch::nn::Module>());
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    layers_.push_back(
        list->register_module(std::to_string(i), std::make_shared<DecoderLayerImpl>(config_, i)));
  }
  norm_ = body_->register_module(
      "norm", std::make_shared<RmsNormImpl>(config_.hidden_size, config_.rms_norm_eps));
  if (!config_.tie_word_embeddings) {
    lm_head_ = register_module(
        "lm_head", std::make_shared<ProjImpl>(config_.hidden_size, config_.vocab_size, false));
  }
  inv_freq_ =
      1.0 / torch::pow(config_.rope_theta, torch::arange(0, config_.head_dim, 2, torch::kDouble) /
                                               static_cast<double>(config_.head_dim));
  inv_freq_ = inv_freq_.to(torch::kFloat);
}

KvCache TransformerImpl::NewCache(int64_t slots, int64_t capacity) const {
  KvCache cache;
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    cache.keys.push_back(
        torch::zeros({slots, config_.num_key_value_heads, capacity, config_.head_dim}));
    cache.values.push_back(
        torch::zeros({slots, config_.num_key_value_heads, capacity, config_.head_dim}));
  }
  return cache;
}

ForwardResult TransformerImpl::Hidden(const torch::Tensor& tokens,
                                      const torch::Tensor& positions_in, const torch::Tensor& valid,
                                      const std::vector<torch::Tensor>& replay,
                                      const CacheSpan* cache) {
  const int64_t batch = tokens.size(0), length = tokens.size(1);
  if (!fp8_projections_.empty()) {
    // Fake-quantize every projection whose master changed (after an optimizer step or a
    // load: all of them) at once rather than one by one inside the layers.
    std::vector<ProjImpl*> stale;
    for (const auto& proj : fp8_projections_) {
      if (proj->fp8_weight_stale()) stale.push_back(proj.get());
    }
    at::parallel_for(0, static_cast<int64_t>(stale.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) stale[i]->Fp8Weight();
    });
  }
  torch::Tensor positions =
      positions_in.defined()
          ? positions_in
          : torch::arange(length, torch::kLong).unsqueeze(0).expand({batch, length});
  torch::Tensor freqs = positions.to(torch::kFloat).unsqueeze(-1) * inv_freq_;  // [B, T, hd/2]
  torch::Tensor angles = torch::cat({freqs, freqs}, -1);
  torch::Tensor cos = angles.cos(), sin = angles.sin();

  AttentionStep step;
  if (cache) {
    step.cache = cache;
    step.rows = (torch::arange(batch, torch::kLong) + cache->first_slot)
                    .unsqueeze(1)
                    .expand({batch, length});
    step.span = cache->positions.max().item<int64_t>() + 1;
    // Key j is visible to a query at position p when j <= p.
    step.future = torch::arange(step.span, torch::kLong).view({1, 1, 1, step.span}) >
                  cache->positions.view({batch, 1, length, 1});
  } else {
    step.future = torch::ones({length, length}, torch::kBool).triu(1);
  }

  torch::Tensor h = torch::embedding(embed_tokens_, tokens);
  ForwardResult result;
  std::vector<torch::Tensor> aux;
  size_t moe_index = 0;
  for (size_t index = 0; index < layers_.size(); ++index) {
    auto& layer = layers_[index];
    h = h + layer->self_attn->forward(layer->input_layernorm->forward(h), cos, sin, step, index);
    torch::Tensor normed = layer->post_attention_layernorm->forward(h);
    if (layer->is_moe()) {
      torch::Tensor layer_replay = moe_index < replay.size() ? replay[moe_index] : torch::Tensor();
      MoeOutput moe = layer->moe->forward(normed, layer_replay, valid);
      h = h + moe.hidden;
      result.routing.push_back(moe.indices);
      aux.push_back(moe.aux_loss);
      ++moe_index;
    } else {
      h = h + layer->mlp->forward(normed);
    }
  }
  result.hidden = norm_->forward(h);
  result.aux_loss = aux.empty() ? torch::zeros({}) : torch::stack(aux).mean();
  return result;
}

torch::Tensor TransformerImpl::LmHead(const torch::Tensor& hidden) {
  return lm_head_ ? lm_head_->forward(hidden) : torch::linear(hidden, embed_tokens_);
}

ForwardResult TransformerImpl::forward(const torch::Tensor& tokens, const torch::Tensor& positions,
                                       const torch::Tensor& valid,
                                       const std::vector<torch::Tensor>& replay) {
  ForwardResult result = Hidden(tokens, positions, valid, replay);
  result.logits = LmHead(result.hidden);
  return result;
}

Status TransformerImpl::EnableLora(const LoraOptions& options) {
  if (lora_) return Status::InvalidArgument("LoRA is already enabled on this model");
  if (options.rank <= 0) {
    return Status::InvalidArgument("LoRA rank must be > 0, got " + std::to_string(options.rank));
  }
  if (!(options.alpha > 0)) return Status::InvalidArgument("LoRA alpha must be > 0");
  for (auto& p : parameters()) p.set_requires_grad(false);
  int adapted = 0;
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    auto proj = std::dynamic_pointer_cast<ProjImpl>(item.value());
    if (!proj) continue;
    const std::string& name = item.key();
    const std::string leaf = name.substr(name.rfind('.') + 1);
    if (std::find(options.targets.begin(), options.targets.end(), leaf) == options.targets.end())
      continue;
    proj->EnableLora(options.rank, options.alpha);
    ++adapted;
  }
  if (adapted == 0) {
    return Status::InvalidArgument("LoRA targets match no projection of this model");
  }
  lora_ = options;
  return Status::Ok();
}

Status TransformerImpl::EnableFp8Qat(int64_t block) {
  if (block < 1) {
    return Status::InvalidArgument("FP8 QAT block size must be at least 1, got " +
                                   std::to_string(block));
  }
  if (fp8_qat_block_ > 0) return Status::InvalidArgument("FP8 QAT is already enabled");
  const std::vector<std::string> names = Fp8WeightNames(*this);
  const std::set<std::string> quantized(names.begin(), names.end());
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    auto proj = std::dynamic_pointer_cast<ProjImpl>(item.value());
    if (!proj || proj->packed() || !quantized.count(item.key() + ".weight")) continue;
    proj->EnableFp8FakeQuant(block);
    fp8_projections_.push_back(std::move(proj));
  }
  fp8_qat_block_ = block;
  return Status::Ok();
}

Status TransformerImpl::PackFrozenExperts(PackFormat format, int64_t block) {
  if (format == PackFormat::kNone) return Status::Ok();
  if (packed_experts_ != PackFormat::kNone)
    return Status::InvalidArgument("the experts are already packed");
  if (config_.NumMoeLayers() == 0)
    return Status::InvalidArgument("packed frozen experts need a MoE model; this one is dense");
  if (!lora_) {
    return Status::InvalidArgument(
        "packed frozen experts need LoRA (only frozen experts can be packed)");
  }
  if (fp8_qat_block_ > 0)
    return Status::InvalidArgument("pack the experts before enabling FP8 QAT");
  if (block < 0) return Status::InvalidArgument("the packing block must be >= 0");
  // Checked up front, so that packing cannot fail halfway (PackWeight refuses these).
  for (const auto& item : named_parameters()) {
    if (item.key().find(".mlp.experts.") == std::string::npos ||
        item.key().find(".lora_") != std::string::npos)
      continue;
    if (item.value().requires_grad())
      return Status::InvalidArgument("cannot pack " + item.key() + ": it is trainable");
    if (!torch::isfinite(item.value()).all().item<bool>())
      return Status::InvalidArgument("cannot pack " + item.key() + ": it holds NaN or inf");
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!layers_[i]->is_moe()) continue;
    FW_RETURN_IF_ERROR(
        layers_[i]->moe->PackExperts(format, block).WithContext("layer " + std::to_string(i)));
  }
  packed_experts_ = format;
  return Status::Ok();
}

std::vector<std::pair<std::string, const PackedWeight*>> TransformerImpl::PackedWeights() {
  std::vector<std::pair<std::string, const PackedWeight*>> out;
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    auto proj = std::dynamic_pointer_cast<ProjImpl>(item.value());
    if (proj && proj->packed()) out.emplace_back(item.key() + ".weight", proj->packed());
  }
  return out;
}

void TransformerImpl::AttachMultiLora(std::shared_ptr<const MultiLora> multi) {
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    if (auto proj = std::dynamic_pointer_cast<ProjImpl>(item.value()))
      proj->AttachMultiLora(multi, item.key());
  }
}

std::map<std::string, std::pair<int64_t, int64_t>> TransformerImpl::ProjectionShapes() {
  std::map<std::string, std::pair<int64_t, int64_t>> out;
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    if (auto proj = std::dynamic_pointer_cast<ProjImpl>(item.value())) {
      out[item.key()] = {proj->out_features(), proj->in_features()};
    }
  }
  return out;
}

Status ValidateReplay(const ModelConfig& config, const std::vector<torch::Tensor>& replay,
                      int64_t batch, int64_t length) {
  if (replay.empty()) return Status::Ok();
  const int64_t layers = config.NumMoeLayers();
  if (static_cast<int64_t>(replay.size()) != layers) {
    return Status::InvalidArgument("routing replay has " + std::to_string(replay.size()) +
                                   " layers, the model has " + std::to_string(layers) +
                                   " MoE layers");
  }
  for (size_t i = 0; i < replay.size(); ++i) {
    const torch::Tensor& r = replay[i];
    if (r.dim() != 3 || r.size(0) != batch || r.size(1) != length ||
        r.size(2) != config.num_experts_per_tok) {
      return Status::InvalidArgument("routing replay for MoE layer " + std::to_string(i) +
                                     " has shape " + c10::str(r.sizes()) + ", expected [" +
                                     std::to_string(batch) + ", " + std::to_string(length) + ", " +
                                     std::to_string(config.num_experts_per_tok) + "]");
    }
    if (r.numel() > 0 &&
        (r.min().item<int64_t>() < 0 || r.max().item<int64_t>() >= config.num_experts)) {
      return Status::InvalidArgument("routing replay for MoE layer " + std::to_string(i) +
                                     " names an expert outside [0, " +
                                     std::to_string(config.num_experts) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace flywheel::model
