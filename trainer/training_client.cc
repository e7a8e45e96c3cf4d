#include "trainer/training_client.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <thread>

#include "checkpoint/hash.h"
#include "checkpoint/safetensors.h"
#include "model/fp8.h"
#include "model/weights.h"

namespace flywheel::trainer {

namespace fs = std::filesystem;

struct TrainingClient::Batch {
  torch::Tensor tokens, targets;            // [B, T] int64 (targets 0 at padding)
  torch::Tensor valid;                      // [B, T] bool
  torch::Tensor weights;                    // [B, T] fp32, 0 at padding
  torch::Tensor sampling, advantages, ref;  // [B, T] fp32 or undefined
  std::vector<torch::Tensor> replay;        // per MoE layer [B, T, k], or empty
  std::vector<int64_t> lengths;
  int64_t loss_tokens = 0;
  double weight_sum = 0;
};

struct TrainingClient::LogprobResult {
  torch::Tensor logprobs;  // [B, T]
  std::vector<torch::Tensor> routing;
  torch::Tensor aux_loss;
};

namespace {

constexpr int kStateFormat = 1;

std::string DatumField(size_t index, const char* field) {
  return "datum " + std::to_string(index) + ": " + field;
}

// Copies a per-token float array into row `row` of `out`, checking length and finiteness.
Status FillRow(const std::vector<float>& values, size_t index, const char* field, int64_t length,
               torch::Tensor& out, int64_t row) {
  if (static_cast<int64_t>(values.size()) != length) {
    return Status::InvalidArgument(DatumField(index, field) + " has " +
                                   std::to_string(values.size()) + " entries, tokens has " +
                                   std::to_string(length));
  }
  auto acc = out.accessor<float, 2>();
  for (int64_t t = 0; t < length; ++t) {
    if (!std::isfinite(values[t])) {
      return Status::InvalidArgument(DatumField(index, field) + " entry " + std::to_string(t) +
                                     " is not finite");
    }
    acc[row][t] = values[t];
  }
  return Status::Ok();
}

// Looked up at run time: the OpenBLAS symbols are not part of the BLAS interface libtorch
// links against (libblas.so.3 may be another implementation).
using SetThreadsFn = void (*)(int);
using GetThreadsFn = int (*)();

}  // namespace

CpuThreads CurrentCpuThreads() {
  auto get = reinterpret_cast<GetThreadsFn>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return {.torch = torch::get_num_threads(), .blas = get != nullptr ? get() : 0};
}

CpuThreads ConfigureCpuThreads(int threads) {
  // An explicit choice in the environment (what both libraries read at load) wins.
  if (std::getenv("OMP_NUM_THREADS") != nullptr || std::getenv("OPENBLAS_NUM_THREADS") != nullptr)
    return CurrentCpuThreads();
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto set = reinterpret_cast<SetThreadsFn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set != nullptr) {
    set(threads);
    torch::set_num_threads(1);
  } else {
    torch::set_num_threads(threads);
  }
  return CurrentCpuThreads();
}

Status AdamWParams::Validate() const {
  auto bad = [](const std::string& what, double v) {
    return Status::InvalidArgument("optim_step: " + what + ", got " + std::to_string(v));
  };
  if (!(lr >= 0 && std::isfinite(lr))) return bad("lr must be finite and >= 0", lr);
  if (!(beta1 >= 0 && beta1 < 1)) return bad("beta1 must be in [0, 1)", beta1);
  if (!(beta2 >= 0 && beta2 < 1)) return bad("beta2 must be in [0, 1)", beta2);
  if (!(eps > 0)) return bad("eps must be > 0", eps);
  if (!(weight_decay >= 0)) return bad("weight_decay must be >= 0", weight_decay);
  if (!(grad_clip >= 0)) return bad("grad_clip must be >= 0 (0 = off)", grad_clip);
  return Status::Ok();
}

TrainingClient::TrainingClient(TrainerOptions options) : options_(std::move(options)) {}
TrainingClient::~TrainingClient() = default;

namespace {

// {"format", "block"} of the packed frozen experts, or null: recorded in saved states.
nlohmann::json PackedExpertsJson(const TrainerOptions& options) {
  const model::PackFormat format = options.pack_frozen_experts;
  if (format == model::PackFormat::kNone) return nullptr;
  const int64_t block = format == model::PackFormat::kInt8 ? 0
                        : options.pack_block > 0           ? options.pack_block
                                                           : model::DefaultPackBlock(format);
  return {{"format", model::PackFormatName(format)}, {"block", block}};
}

}  // namespace

Result<std::unique_ptr<TrainingClient>> TrainingClient::Create(TrainerOptions options) {
  FW_RETURN_IF_ERROR(options.config.Validate());
  if (options.serving_dtype != DType::kBF16 && options.serving_dtype != DType::kF16 &&
      options.serving_dtype != DType::kF32) {
    return Status::InvalidArgument(std::string("serving dtype must be BF16, F16 or F32, got ") +
                                   DTypeName(options.serving_dtype));
  }
  if (options.fp8_serving && options.fp8_block < 1) {
    return Status::InvalidArgument("fp8_block must be >= 1, got " +
                                   std::to_string(options.fp8_block));
  }
  if (options.pack_frozen_experts != model::PackFormat::kNone) {
    // Packed values are exact in BF16 and F32 (power-of-two scales), not always in F16; and an
    // FP8 snapshot would quantize the packed base again.
    if (options.fp8_serving)
      return Status::InvalidArgument("packed frozen experts cannot be served as FP8 snapshots");
    if (options.serving_dtype == DType::kF16) {
      return Status::InvalidArgument(
          "packed frozen experts need serving dtype BF16 or F32 (F16 cannot hold every packed "
          "value exactly)");
    }
  }
  if (options.threads < 0) return Status::InvalidArgument("threads must be >= 0");
  ConfigureCpuThreads(options.threads);
  std::unique_ptr<TrainingClient> client(new TrainingClient(std::move(options)));
  torch::manual_seed(client->options_.seed);
  client->model_ = std::make_shared<model::TransformerImpl>(client->options_.config);
  if (!client->options_.init_weights.empty()) {
    FW_ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::Open(client->options_.init_weights));
    FW_RETURN_IF_ERROR(
        model::LoadWeights(*client->model_, checkpoint.tensors(), client->options_.init_weights));
  }
  if (client->options_.lora) {
    torch::manual_seed(client->options_.seed + 1);
    FW_RETURN_IF_ERROR(client->model_->EnableLora(*client->options_.lora));
  }
  for (auto& item : client->model_->named_parameters()) {
    if (item.value().requires_grad()) client->trainable_.emplace_back(item.key(), item.value());
  }
  std::sort(client->trainable_.begin(), client->trainable_.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [name, p] : client->trainable_) {
    client->exp_avg_.push_back(torch::zeros_like(p));
    client->exp_avg_sq_.push_back(torch::zeros_like(p));
  }
  if (client->options_.data_parallel) {
    FW_ASSIGN_OR_RETURN(client->data_parallel_,
                        DataParallel::Join(*client->options_.data_parallel));
    std::vector<torch::Tensor> params;
    for (auto& item : client->model_->named_parameters()) params.push_back(item.value());
    FW_RETURN_IF_ERROR(client->data_parallel_->Broadcast(params));
  }
  // After the broadcast, so that every rank packs rank 0's experts.
  if (client->options_.pack_frozen_experts != model::PackFormat::kNone) {
    FW_RETURN_IF_ERROR(client->model_->PackFrozenExperts(client->options_.pack_frozen_experts,
                                                         client->options_.pack_block));
  }
  if (client->options_.fp8_qat)
    FW_RETURN_IF_ERROR(client->model_->EnableFp8Qat(client->options_.fp8_block));
  return client;
}

namespace {

// Copies datum `index`'s routing (T x MoE layers x top-k, token-major) into `replay`
// [layers, B, T, k] at row `row`, checking its size and every expert id.
Status FillRouting(const Datum& d, size_t index, const model::ModelConfig& config,
                   torch::Tensor& replay, int64_t row) {
  const int64_t length = d.tokens.size();
  const int64_t moe_layers = config.NumMoeLayers(), top_k = config.num_experts_per_tok;
  if (static_cast<int64_t>(d.routing.size()) != length * moe_layers * top_k) {
    return Status::InvalidArgument(
        DatumField(index, "routing") + " has " + std::to_string(d.routing.size()) +
        " entries, expected tokens x MoE layers x top-k = " +
        std::to_string(length * moe_layers * top_k) +
        (d.routing.empty() ? " (every datum of a batch or none carries routing)" : ""));
  }
  auto r = replay.accessor<int64_t, 4>();
  for (int64_t t = 0; t < length; ++t) {
    for (int64_t l = 0; l < moe_layers; ++l) {
      for (int64_t k = 0; k < top_k; ++k) {
        const int32_t e = d.routing[(t * moe_layers + l) * top_k + k];
        if (e < 0 || e >= config.num_experts) {
          return Status::InvalidArgument(DatumField(index, "routing") + " names expert " +
                                         std::to_string(e) + " at position " +
                                         std::to_string(t) + ", the model has " +
                                         std::to_string(config.num_experts));
        }
        r[l][row][t][k] = e;
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status TrainingClient::FillBatchRow(const Datum& d, size_t i, const model::ModelConfig& config,
                                    Batch& batch, torch::Tensor& replay) {
  const int64_t length = d.tokens.size(), row = static_cast<int64_t>(i);
  batch.lengths.push_back(length);
  if (static_cast<int64_t>(d.target_tokens.size()) != length) {
    return Status::InvalidArgument(DatumField(i, "target_tokens") + " has " +
                                   std::to_string(d.target_tokens.size()) +
                                   " entries, tokens has " + std::to_string(length));
  }
  auto tokens = batch.tokens.accessor<int64_t, 2>();
  auto targets = batch.targets.accessor<int64_t, 2>();
  auto valid = batch.valid.accessor<bool, 2>();
  for (int64_t t = 0; t < length; ++t) {
    for (int32_t id : {d.tokens[t], d.target_tokens[t]}) {
      if (id < 0 || id >= config.vocab_size) {
        return Status::InvalidArgument(DatumField(i, "token id ") + std::to_string(id) +
                                       " at position " + std::to_string(t) +
                                       " is outside the vocabulary [0, " +
                                       std::to_string(config.vocab_size) + ")");
      }
    }
    tokens[row][t] = d.tokens[t];
    targets[row][t] = d.target_tokens[t];
    valid[row][t] = true;
  }
  if (d.weights.empty()) {
    batch.weights[row].narrow(0, 0, length).fill_(1.0f);
  } else {
    FW_RETURN_IF_ERROR(FillRow(d.weights, i, "weights", length, batch.weights, row));
    if (std::any_of(d.weights.begin(), d.weights.end(), [](float w) { return w < 0; })) {
      return Status::InvalidArgument(DatumField(i, "weights") + " has a negative entry");
    }
  }
  if (batch.sampling.defined())
    FW_RETURN_IF_ERROR(FillRow(d.logprobs, i, "logprobs", length, batch.sampling, row));
  if (batch.advantages.defined())
    FW_RETURN_IF_ERROR(FillRow(d.advantages, i, "advantages", length, batch.advantages, row));
  if (batch.ref.defined())
    FW_RETURN_IF_ERROR(FillRow(d.ref_logprobs, i, "ref_logprobs", length, batch.ref, row));
  if (!d.policy_versions.empty() && static_cast<int64_t>(d.policy_versions.size()) != length) {
    return Status::InvalidArgument(DatumField(i, "policy_versions") + " has " +
                                   std::to_string(d.policy_versions.size()) +
                                   " entries, tokens has " + std::to_string(length));
  }
  if (replay.defined()) FW_RETURN_IF_ERROR(FillRouting(d, i, config, replay, row));
  return Status::Ok();
}

Result<TrainingClient::Batch> TrainingClient::MakeBatch(const std::vector<Datum>& datums,
                                                        bool need_sampling, bool need_advantages,
                                                        bool need_ref) const {
  const model::ModelConfig& config = options_.config;
  if (datums.empty()) return Status::InvalidArgument("no datums");
  int64_t max_length = 0;
  for (size_t i = 0; i < datums.size(); ++i) {
    if (datums[i].tokens.empty())
      return Status::InvalidArgument(DatumField(i, "tokens") + " is empty");
    max_length = std::max<int64_t>(max_length, datums[i].tokens.size());
  }
  if (max_length > config.max_position_embeddings) {
    return Status::InvalidArgument("a datum has " + std::to_string(max_length) +
                                   " tokens, more than max_position_embeddings (" +
                                   std::to_string(config.max_position_embeddings) + ")");
  }
  const bool any_routing =
      std::any_of(datums.begin(), datums.end(), [](const Datum& d) { return !d.routing.empty(); });
  const int64_t moe_layers = config.NumMoeLayers(), top_k = config.num_experts_per_tok;
  if (any_routing && moe_layers == 0)
    return Status::InvalidArgument("datums carry routing but the model is dense");

  const int64_t b = static_cast<int64_t>(datums.size()), t_max = max_length;
  Batch batch;
  batch.tokens = torch::zeros({b, t_max}, torch::kLong);
  batch.targets = torch::zeros({b, t_max}, torch::kLong);
  batch.valid = torch::zeros({b, t_max}, torch::kBool);
  batch.weights = torch::zeros({b, t_max});
  if (need_sampling) batch.sampling = torch::zeros({b, t_max});
  if (need_advantages) batch.advantages = torch::zeros({b, t_max});
  if (need_ref) batch.ref = torch::zeros({b, t_max});
  torch::Tensor replay =
      any_routing ? torch::zeros({moe_layers, b, t_max, top_k}, torch::kLong) : torch::Tensor();
  for (size_t i = 0; i < datums.size(); ++i) {
    FW_RETURN_IF_ERROR(FillBatchRow(datums[i], i, config, batch, replay));
  }
  if (any_routing) {
    for (int64_t l = 0; l < moe_layers; ++l) batch.replay.push_back(replay[l]);
  }
  batch.loss_tokens = batch.weights.gt(0).sum().item<int64_t>();
  batch.weight_sum = batch.weights.sum().item<double>();
  return batch;
}

TrainingClient::LogprobResult TrainingClient::Logprobs(const Batch& batch,
                                                       const torch::Tensor& positions,
                                                       const torch::Tensor& filler) {
  model::ForwardResult out = model_->Hidden(batch.tokens, {}, batch.valid, batch.replay);
  if (!positions.defined()) {
    torch::Tensor logits = model_->LmHead(out.hidden);  // [B, T, V]
    torch::Tensor picked = logits.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1);
    return {picked - logits.logsumexp(-1), std::move(out.routing), out.aux_loss};
  }
  torch::Tensor hidden = out.hidden.index({positions});  // [N, D]
  torch::Tensor logits = model_->LmHead(hidden);         // [N, V]
  torch::Tensor targets = batch.targets.index({positions});
  torch::Tensor selected =
      logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1);
  torch::Tensor base =
      filler.defined() ? filler.detach().clone() : torch::zeros_like(batch.weights);
  return {base.masked_scatter(positions, selected), std::move(out.routing), out.aux_loss};
}

void TrainingClient::Backward(const Batch& batch, const torch::Tensor& loss,
                              const torch::Tensor& aux_loss, Metrics& metrics) {
  torch::Tensor total = loss;
  if (options_.config.num_experts > 0 && options_.config.router_aux_loss_coef > 0) {
    total = total + aux_loss * options_.config.router_aux_loss_coef;
  }
  const double norm = options_.normalization == Normalization::kTokens
                          ? batch.weight_sum
                          : static_cast<double>(batch.lengths.size());
  (total * norm).backward();
  if (!have_pending_) {
    pending_since_ = std::chrono::steady_clock::now();
    have_pending_ = true;
  }
  pending_norm_ += norm;
  pending_tokens_ += batch.loss_tokens;
  metrics.sequences = static_cast<int64_t>(batch.lengths.size());
  metrics.tokens = batch.loss_tokens;
  metrics.step = step_;
}

Result<ForwardOutput> TrainingClient::Forward(const std::vector<Datum>& datums) {
  FW_ASSIGN_OR_RETURN(Batch batch, MakeBatch(datums, false, false, false));
  torch::NoGradGuard no_grad;
  LogprobResult lp = Logprobs(batch);
  ForwardOutput out;
  const int64_t layers = static_cast<int64_t>(lp.routing.size());
  for (size_t i = 0; i < datums.size(); ++i) {
    const int64_t length = batch.lengths[i];
    torch::Tensor row = lp.logprobs[i].narrow(0, 0, length).contiguous();
    out.logprobs.emplace_back(row.data_ptr<float>(), row.data_ptr<float>() + length);
    std::vector<int32_t> routing;
    if (layers > 0) {
      // [L, T, k] -> [T, L, k], token-major.
      std::vector<torch::Tensor> per_layer;
      for (const auto& r : lp.routing) per_layer.push_back(r[i].narrow(0, 0, length));
      torch::Tensor packed = torch::stack(per_layer, 1).to(torch::kInt).contiguous();
      routing.assign(packed.data_ptr<int32_t>(), packed.data_ptr<int32_t>() + packed.numel());
    }
    out.routing.push_back(std::move(routing));
  }
  return out;
}

Result<Metrics> TrainingClient::ForwardBackward(const std::vector<Datum>& datums,
                                                std::string_view loss_name,
                                                const LossConfig& config) {
  FW_ASSIGN_OR_RETURN(LossName name, ParseLossName(loss_name));
  FW_RETURN_IF_ERROR(config.Validate());
  FW_ASSIGN_OR_RETURN(Batch batch,
                      MakeBatch(datums, NeedsSamplingLogprobs(name, config), NeedsAdvantages(name),
                                NeedsRefLogprobs(name, config)));
  if (name == LossName::kDpo && datums.size() % 2 != 0) {
    return Status::InvalidArgument("loss dpo needs datums in (chosen, rejected) pairs; got " +
                                   std::to_string(datums.size()));
  }
  // Tokens without loss weight (prompts, padding) need no logits; their logprob is the
  // sampling one (ratio 1), so no formula meets an extreme value it then multiplies by 0.
  LogprobResult lp = Logprobs(batch, batch.weights.gt(0), batch.sampling);
  LossBatch loss_batch{lp.logprobs, batch.sampling, batch.advantages, batch.weights, batch.ref};
  FW_ASSIGN_OR_RETURN(LossResult loss, ComputeLoss(name, config, loss_batch));
  Metrics metrics;
  Backward(batch, loss.loss, lp.aux_loss, metrics);
  metrics.loss = loss.loss.item<double>();
  metrics.kl_sampler_k3 = loss.kl_sampler_k3;
  metrics.clip_fraction = loss.clip_fraction;
  metrics.kl_reference = loss.kl_reference;
  metrics.tis_truncated = loss.tis_truncated;
  metrics.aux_loss = lp.aux_loss.item<double>();
  return metrics;
}

Result<Metrics> TrainingClient::ForwardBackwardCustom(const std::vector<Datum>& datums,
                                                      const CustomLossFn& fn) {
  if (!fn) return Status::InvalidArgument("forward_backward_custom: no loss function");
  FW_ASSIGN_OR_RETURN(Batch batch, MakeBatch(datums, false, false, false));
  // Pass 1: logprobs without a graph; MoE routing is pinned for pass 2.
  std::vector<torch::Tensor> leaves;
  {
    torch::NoGradGuard no_grad;
    LogprobResult first = Logprobs(batch);
    if (batch.replay.empty()) batch.replay = first.routing;
    for (size_t i = 0; i < datums.size(); ++i) {
      leaves.push_back(
          first.logprobs[i].narrow(0, 0, batch.lengths[i]).clone().set_requires_grad(true));
    }
  }
  FW_ASSIGN_OR_RETURN(torch::Tensor loss, fn(datums, leaves));
  if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
    return Status::InvalidArgument(
        "forward_backward_custom: the loss function must return a scalar that "
        "depends on the logprobs it was given");
  }
  if (!std::isfinite(loss.item<double>()))
    return Status::InvalidArgument("forward_backward_custom: the loss is not finite");
  std::vector<torch::Tensor> grads =
      torch::autograd::grad({loss.reshape({})}, leaves, {}, false, false, true);
  torch::Tensor upstream = torch::zeros_like(batch.weights);
  for (size_t i = 0; i < datums.size(); ++i) {
    if (grads[i].defined())
      upstream[i].narrow(0, 0, batch.lengths[i]).copy_(grads[i].to(torch::kFloat));
  }
  return BackwardUpstream(batch, upstream, loss.item<double>());
}

Metrics TrainingClient::BackwardUpstream(const Batch& batch, const torch::Tensor& upstream,
                                         double loss_value) {
  // Pass 2: the same forward with a graph; sum(logprob * dL/dlogprob) has the loss's gradient.
  LogprobResult second = Logprobs(batch, upstream.ne(0));
  Metrics metrics;
  Backward(batch, (second.logprobs * upstream).sum(), second.aux_loss, metrics);
  metrics.loss = loss_value;
  metrics.aux_loss = second.aux_loss.item<double>();
  return metrics;
}

Result<Metrics> TrainingClient::ForwardBackwardFromGrads(
    const std::vector<Datum>& datums, const std::vector<std::vector<float>>& grads,
    double loss_value) {
  if (grads.size() != datums.size()) {
    return Status::InvalidArgument("forward_backward_custom: " + std::to_string(grads.size()) +
                                   " gradient rows for " + std::to_string(datums.size()) +
                                   " datums");
  }
  if (!std::isfinite(loss_value))
    return Status::InvalidArgument("forward_backward_custom: the loss value is not finite");
  FW_ASSIGN_OR_RETURN(Batch batch, MakeBatch(datums, false, false, false));
  torch::Tensor upstream = torch::zeros_like(batch.weights);
  for (size_t i = 0; i < datums.size(); ++i) {
    if (static_cast<int64_t>(grads[i].size()) != batch.lengths[i]) {
      return Status::InvalidArgument("forward_backward_custom: datum " + std::to_string(i) +
                                     " has " + std::to_string(batch.lengths[i]) + " tokens but " +
                                     std::to_string(grads[i].size()) + " gradients");
    }
    for (size_t t = 0; t < grads[i].size(); ++t) {
      if (!std::isfinite(grads[i][t])) {
        return Status::InvalidArgument("forward_backward_custom: gradient " + std::to_string(t) +
                                       " of datum " + std::to_string(i) + " is not finite");
      }
    }
    upstream[i]
        .narrow(0, 0, batch.lengths[i])
        .copy_(torch::from_blob(const_cast<float*>(grads[i].data()), {batch.lengths[i]},
                                torch::kFloat));
  }
  return BackwardUpstream(batch, upstream, loss_value);
}

TrainableState TrainingClient::ExportTrainable() const {
  TrainableState state;
  for (size_t i = 0; i < trainable_.size(); ++i) {
    const torch::Tensor& p = trainable_[i].second;
    state.values.push_back(p.detach().clone());
    state.exp_avg.push_back(exp_avg_[i].clone());
    state.exp_avg_sq.push_back(exp_avg_sq_[i].clone());
    state.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }
  state.step = step_;
  state.last_version = last_version_;
  state.pending_norm = pending_norm_;
  state.pending_tokens = pending_tokens_;
  state.have_pending = have_pending_;
  state.pending_since = pending_since_;
  return state;
}

Status TrainingClient::ImportTrainable(const TrainableState& state) {
  const size_t n = trainable_.size();
  if (state.values.size() != n || state.exp_avg.size() != n || state.exp_avg_sq.size() != n ||
      state.grads.size() != n) {
    return Status::Mismatch("import_trainable: the state has " +
                            std::to_string(state.values.size()) + " tensors, the client trains " +
                            std::to_string(n));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!state.values[i].sizes().equals(trainable_[i].second.sizes())) {
      return Status::Mismatch("import_trainable: " + trainable_[i].first + " has another shape");
    }
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < n; ++i) {
    torch::Tensor& p = trainable_[i].second;
    p.copy_(state.values[i]);
    // Undefined moments are zeros (a fresh state need not hold two copies of them).
    state.exp_avg[i].defined() ? exp_avg_[i].copy_(state.exp_avg[i]) : exp_avg_[i].zero_();
    state.exp_avg_sq[i].defined() ? exp_avg_sq_[i].copy_(state.exp_avg_sq[i]) : exp_avg_sq_[i].zero_();
    p.mutable_grad() = state.grads[i].defined() ? state.grads[i].clone() : torch::Tensor();
  }
  step_ = state.step;
  last_version_ = state.last_version;
  pending_norm_ = state.pending_norm;
  pending_tokens_ = state.pending_tokens;
  have_pending_ = state.have_pending;
  pending_since_ = state.pending_since;
  return Status::Ok();
}

int64_t TrainingClient::parameter_count() const {
  int64_t n = 0;
  for (const auto& item : model_->named_parameters()) n += item.value().numel();
  for (const auto& [name, packed] : model_->PackedWeights()) n += packed->rows * packed->cols;
  return n;
}

int64_t TrainingClient::trainable_count() const {
  int64_t n = 0;
  for (const auto& [name, p] : trainable_) n += p.numel();
  return n;
}

Status TrainingClient::ReduceAcrossRanks() {
  // One reduction: every gradient (zeros where this rank has none), a has-gradient flag
  // per parameter, and the normaliser and token count.
  std::vector<torch::Tensor> buffers;
  torch::Tensor flags = torch::zeros({static_cast<int64_t>(trainable_.size())}, torch::kDouble);
  for (size_t i = 0; i < trainable_.size(); ++i) {
    torch::Tensor& p = trainable_[i].second;
    if (p.grad().defined()) {
      flags[i] = 1.0;
    } else {
      p.mutable_grad() = torch::zeros_like(p);
    }
    buffers.push_back(p.mutable_grad());
  }
  torch::Tensor counters =
      torch::tensor({pending_norm_, static_cast<double>(pending_tokens_)}, torch::kDouble);
  buffers.push_back(flags);
  buffers.push_back(counters);
  FW_RETURN_IF_ERROR(data_parallel_->AllReduceSum(buffers));
  for (size_t i = 0; i < trainable_.size(); ++i) {
    if (flags[i].item<double>() == 0) trainable_[i].second.mutable_grad() = torch::Tensor();
  }
  pending_norm_ = counters[0].item<double>();
  pending_tokens_ = static_cast<int64_t>(counters[1].item<double>());
  if (!have_pending_) {
    pending_since_ = std::chrono::steady_clock::now();
    have_pending_ = pending_norm_ > 0;
  }
  return Status::Ok();
}

Result<Metrics> TrainingClient::OptimStep(const AdamWParams& params) {
  FW_RETURN_IF_ERROR(params.Validate());
  torch::NoGradGuard no_grad;
  if (data_parallel_) FW_RETURN_IF_ERROR(ReduceAcrossRanks());
  if (!have_pending_ || pending_norm_ <= 0) {
    return Status::InvalidArgument(
        "optim_step: no gradients accumulated since the last step "
        "(call forward_backward first, with at least one loss token)");
  }
  std::vector<torch::Tensor> grads;
  double squares = 0;
  for (auto& [name, p] : trainable_) {
    // In place: a divided copy would hold every gradient twice during the step.
    torch::Tensor g = p.grad().defined() ? p.mutable_grad().div_(pending_norm_) : torch::Tensor();
    if (g.defined()) squares += g.to(torch::kDouble).pow(2).sum().item<double>();
    grads.push_back(g);
  }
  Metrics metrics;
  metrics.grad_norm = std::sqrt(squares);
  if (!std::isfinite(metrics.grad_norm)) {
    for (auto& [name, p] : trainable_) p.mutable_grad() = torch::Tensor();
    have_pending_ = false;
    pending_norm_ = 0;
    pending_tokens_ = 0;
    return Status::InvalidArgument(
        "optim_step: the gradient is not finite; step skipped and gradients cleared");
  }
  const double clip = params.grad_clip > 0 && metrics.grad_norm > params.grad_clip
                          ? params.grad_clip / (metrics.grad_norm + 1e-6)
                          : 1.0;
  ++step_;
  const double bias1 = 1 - std::pow(params.beta1, static_cast<double>(step_));
  const double bias2 = 1 - std::pow(params.beta2, static_cast<double>(step_));
  for (size_t i = 0; i < trainable_.size(); ++i) {
    if (!grads[i].defined())
      continue;  // as torch.optim: a parameter without a gradient is left alone
    torch::Tensor& p = trainable_[i].second;
    torch::Tensor g = clip != 1.0 ? grads[i] * clip : grads[i];
    p.mul_(1 - params.lr * params.weight_decay);
    exp_avg_[i].mul_(params.beta1).add_(g, 1 - params.beta1);
    exp_avg_sq_[i].mul_(params.beta2).addcmul_(g, g, 1 - params.beta2);
    torch::Tensor denom = (exp_avg_sq_[i].sqrt() / std::sqrt(bias2)).add_(params.eps);
    p.addcdiv_(exp_avg_[i], denom, -params.lr / bias1);
    p.mutable_grad() = torch::Tensor();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - pending_since_).count();
  metrics.tokens = pending_tokens_;
  metrics.tokens_per_s = seconds > 0 ? static_cast<double>(pending_tokens_) / seconds : 0;
  metrics.step = step_;
  have_pending_ = false;
  pending_norm_ = 0;
  pending_tokens_ = 0;
  return metrics;
}

void TrainingClient::DiscardGradients() {
  for (auto& [name, p] : trainable_) p.mutable_grad() = torch::Tensor();
  have_pending_ = false;
  pending_norm_ = 0;
  pending_tokens_ = 0;
}

Result<SamplerSnapshot> TrainingClient::SaveWeightsForSampler(uint64_t version) {
  if (version <= last_version_) {
    return Status::InvalidArgument("save_weights_for_sampler: version " + std::to_string(version) +
                                   " does not move forward (last was " +
                                   std::to_string(last_version_) + ")");
  }
  SamplerSnapshot snapshot;
  snapshot.version = version;
  snapshot.adapters_only = model_->lora_enabled();
  if (options_.fp8_serving && !snapshot.adapters_only) {
    // Deterministic: quantization is a pure function of the weights (model/fp8.h).
    FW_ASSIGN_OR_RETURN(snapshot.checkpoint,
                        model::SnapshotWeightsFp8(*model_, {.block = options_.fp8_block,
                                                            .other_dtype = options_.serving_dtype}));
  } else {
    FW_ASSIGN_OR_RETURN(snapshot.checkpoint, model::SnapshotWeights(*model_, options_.serving_dtype,
                                                                    snapshot.adapters_only));
  }
  const CheckpointView view = snapshot.checkpoint.view();
  // The only pass over the bytes on this side: the publisher reuses these hashes.
  snapshot.tensor_hashes.reserve(view.size());
  for (const TensorView& t : view) {
    snapshot.bytes += t.data.size();
    snapshot.tensor_hashes.push_back(TensorHash(t));
  }
  FW_ASSIGN_OR_RETURN(Hash128 hash, CheckpointHashFromTensorHashes(view, snapshot.tensor_hashes));
  snapshot.weights_hash = hash.ToHex();
  if (publish_) {
    sync::AppendOptions known;
    known.tensor_hashes = snapshot.tensor_hashes;
    known.checkpoint_hash = hash;
    FW_ASSIGN_OR_RETURN(sync::AppendResult published, publish_(version, view, known));
    for (const sync::ArtifactInfo& info : published.artifacts) {
      (info.kind == sync::ArtifactKind::kDelta ? snapshot.published_delta_bytes
                                               : snapshot.published_keyframe_bytes) += info.size_bytes;
    }
    snapshot.changed_words = published.changed_words;
    snapshot.total_words = published.total_words;
    snapshot.publisher_hashed_tensors = published.tensors_hashed;
  }
  last_version_ = version;
  return snapshot;
}

namespace {

constexpr const char* kStateMeta = "trainer.json";
constexpr const char* kStateFiles[] = {"weights.safetensors", "optimizer.safetensors"};

// `dir` made absolute, without a trailing '/': the name <dir>.tmp.<pid> and <dir>.old hang on.
std::string StatePath(const std::string& dir) {
  std::string path = fs::absolute(dir).lexically_normal().string();
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

// Writes `tensors` as a safetensors file through `env`, atomically and synced, and returns
// their checkpoint hash (recorded in trainer.json; LoadState checks the file against it).
Result<Hash128> WriteStateTensors(Env* env, const std::string& path, const CheckpointView& tensors) {
  std::vector<Hash128> hashes;
  for (const TensorView& t : tensors) hashes.push_back(TensorHash(t));
  FW_ASSIGN_OR_RETURN(Hash128 hash, CheckpointHashFromTensorHashes(tensors, hashes));
  FW_ASSIGN_OR_RETURN(std::vector<std::byte> header, SafetensorsHeader(tensors, {}));
  FW_ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(path, env));
  FW_RETURN_IF_ERROR(file.Append(header));
  for (const TensorView& t : tensors) FW_RETURN_IF_ERROR(file.Append(t.data));
  FW_RETURN_IF_ERROR(file.Commit());
  return hash;
}

// Swaps the complete state in `temp` in for `target`: the old one is renamed aside and the
// new one into place, the directory synced after each rename (so a crash between them
// leaves <target>.old whole, which LoadState reads), then the old one is removed.
Status SwapInState(Env* env, const std::string& temp, const std::string& target) {
  const std::string old = target + ".old";
  const std::string parent = DirName(target);
  if (env->FileExists(target)) {
    FW_RETURN_IF_ERROR(env->RemoveAll(old));  // a leftover: `target` is the state now
    FW_RETURN_IF_ERROR(env->RenameFile(target, old));
    FW_RETURN_IF_ERROR(env->SyncDir(parent));
  }
  if (Status renamed = env->RenameFile(temp, target); !renamed.ok()) {
    if (env->FileExists(old)) (void)env->RenameFile(old, target);
    return renamed;
  }
  FW_RETURN_IF_ERROR(env->SyncDir(parent));
  // Not synced: an old state that comes back after a crash is removed by the next save.
  (void)env->RemoveAll(old);
  return Status::Ok();
}

// Checks trainer.json against this trainer's settings; reads the step, the last sampler
// version and the recorded file hashes (absent in states saved before they were recorded).
Status CheckStateMeta(const TrainerOptions& options, const nlohmann::json& state,
                      const std::string& dir, const std::string& meta_path, uint64_t* step,
                      uint64_t* version, std::map<std::string, std::string>* file_hashes) {
  // Every field is read up front; a field of the wrong type is a corrupt state, not a throw.
  try {
    if (state.value("format", 0) != kStateFormat) {
      return Status::InvalidArgument("load_state: " + meta_path + " has an unknown format");
    }
    if (state.value("config", nlohmann::json()) != options.config.ToJson()) {
      return Status::Mismatch("load_state: " + dir + " was saved from a different model config");
    }
    const bool saved_lora = state.contains("lora") && !state["lora"].is_null();
    if (saved_lora != options.lora.has_value() ||
        (saved_lora &&
         (state["lora"].value("rank", 0) != options.lora->rank ||
          state["lora"].value("alpha", 0.0) != options.lora->alpha ||
          state["lora"].value("targets", std::vector<std::string>{}) != options.lora->targets))) {
      return Status::Mismatch("load_state: " + dir + " was saved with different LoRA settings");
    }
    // The adapters were trained against the base as packed; another packing is another base.
    if (state.value("packed_experts", nlohmann::json(nullptr)) != PackedExpertsJson(options)) {
      return Status::Mismatch("load_state: " + dir + " was saved with packed experts " +
                              state.value("packed_experts", nlohmann::json(nullptr)).dump() +
                              ", this trainer has " + PackedExpertsJson(options).dump());
    }
    *step = state.value("step", uint64_t{0});
    *version = state.value("last_sampler_version", uint64_t{0});
    *file_hashes = state.value("files", std::map<std::string, std::string>{});
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption("load_state: " + meta_path + ": " + e.what());
  }
  return Status::Ok();
}

// Opens one tensor file of a state and checks it against the hash trainer.json recorded.
Result<SafetensorsFile> OpenStateTensors(const std::string& root, const std::string& name,
                                         const std::map<std::string, std::string>& hashes) {
  const std::string path = root + "/" + name;
  FW_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
  auto recorded = hashes.find(name);
  if (recorded == hashes.end()) return file;
  std::vector<Hash128> tensor_hashes;
  for (const TensorView& t : file.tensors()) tensor_hashes.push_back(TensorHash(t));
  FW_ASSIGN_OR_RETURN(Hash128 hash, CheckpointHashFromTensorHashes(file.tensors(), tensor_hashes));
  if (hash.ToHex() != recorded->second) {
    return Status::Corruption("load_state: " + path + " has hash " + hash.ToHex() + ", " +
                              kStateMeta + " records " + recorded->second +
                              ": the file is damaged or from another save; not loaded");
  }
  return file;
}

}  // namespace

namespace {

// The bytes of a CPU fp32 tensor as a view, without a copy (the state is written from the
// tensors themselves: a copy would hold weights and moments twice while the state is saved,
// 12 bytes a parameter). A tensor of another dtype or layout is copied into `spill`.
Result<TensorView> StateView(const std::string& name, const torch::Tensor& tensor, std::vector<OwnedTensor>& spill) {
  if (tensor.device().is_cpu() && tensor.scalar_type() == torch::kFloat32 && tensor.is_contiguous()) {
    const auto* bytes = static_cast<const std::byte*>(tensor.data_ptr());
    return TensorView{name, DType::kF32, tensor.sizes().vec(),
                      std::span<const std::byte>(bytes, static_cast<size_t>(tensor.numel()) * 4)};
  }
  FW_ASSIGN_OR_RETURN(OwnedTensor copy, model::FromTorch(name, tensor, DType::kF32));
  spill.push_back(std::move(copy));
  const OwnedTensor& kept = spill.back();
  return TensorView{kept.name, kept.dtype, kept.shape, std::span<const std::byte>(kept.data.data(), kept.data.size())};
}

}  // namespace

Status TrainingClient::WriteStateFiles(const std::string& dir, bool include_frozen) const {
  std::vector<OwnedTensor> spill;
  spill.reserve(2 * (model_->parameters().size() + trainable_.size()));  // views into it stay valid
  CheckpointView weights, moments;
  for (auto& item : model_->named_parameters()) {
    if (!include_frozen && !item.value().requires_grad()) continue;
    FW_ASSIGN_OR_RETURN(TensorView t, StateView(item.key(), item.value().detach(), spill));
    weights.push_back(std::move(t));
  }
  for (size_t i = 0; i < trainable_.size(); ++i) {
    FW_ASSIGN_OR_RETURN(TensorView m, StateView("exp_avg." + trainable_[i].first, exp_avg_[i], spill));
    FW_ASSIGN_OR_RETURN(TensorView v, StateView("exp_avg_sq." + trainable_[i].first, exp_avg_sq_[i], spill));
    moments.push_back(std::move(m));
    moments.push_back(std::move(v));
  }
  FW_ASSIGN_OR_RETURN(Hash128 weights_hash, WriteStateTensors(env(), dir + "/" + kStateFiles[0], weights));
  FW_ASSIGN_OR_RETURN(Hash128 moments_hash, WriteStateTensors(env(), dir + "/" + kStateFiles[1], moments));
  nlohmann::json state = {
      {"format", kStateFormat},
      {"step", step_},
      {"last_sampler_version", last_version_},
      {"config", options_.config.ToJson()},
      {"lora", options_.lora ? nlohmann::json{{"rank", options_.lora->rank},
                                              {"alpha", options_.lora->alpha},
                                              {"targets", options_.lora->targets}}
                             : nlohmann::json(nullptr)},
      {"packed_experts", PackedExpertsJson(options_)},
      {"files", {{kStateFiles[0], weights_hash.ToHex()}, {kStateFiles[1], moments_hash.ToHex()}}},
  };
  const std::string text = state.dump(2) + "\n";
  return WriteFileAtomically(dir + "/" + kStateMeta,
                             std::as_bytes(std::span(text.data(), text.size())), env());
}

Status TrainingClient::SaveState(const std::string& dir, bool include_frozen) {
  if (have_pending_) {
    return Status::InvalidArgument(
        "save_state: gradients are pending (forward_backward without optim_step); "
        "step first so nothing is lost");
  }
  Env* const env = this->env();
  const std::string target = StatePath(dir);
  const std::string temp = target + ".tmp." + std::to_string(::getpid());
  FW_RETURN_IF_ERROR(env->RemoveAll(temp).WithContext("save_state"));
  FW_RETURN_IF_ERROR(env->CreateDirs(temp).WithContext("save_state"));
  // Swap in: the old state stays whole until the new one is complete.
  Status saved = WriteStateFiles(temp, include_frozen);
  if (saved.ok()) saved = SwapInState(env, temp, target);
  if (!saved.ok()) {
    (void)env->RemoveAll(temp);  // a failed save leaves no half-written directory behind
    return saved.WithContext("save_state " + target);
  }
  return Status::Ok();
}

Status TrainingClient::LoadState(const std::string& dir, bool include_frozen) {
  Env* const env = this->env();
  std::string root = StatePath(dir);
  // A save that crashed between its two renames left the previous state as <dir>.old.
  if (!env->FileExists(root) && env->FileExists(root + ".old/" + kStateMeta)) root += ".old";
  const std::string meta_path = root + "/" + kStateMeta;
  if (!env->FileExists(meta_path))
    return Status::NotFound("load_state: " + (fs::path(dir) / kStateMeta).string() + " does not exist");
  Result<std::vector<std::byte>> text = env->ReadFile(meta_path);
  if (!text.ok()) return text.status().WithContext("load_state");
  nlohmann::json state = nlohmann::json::parse(reinterpret_cast<const char*>(text->data()),
                                               reinterpret_cast<const char*>(text->data()) + text->size(),
                                               nullptr, false);
  if (state.is_discarded() || !state.is_object())
    return Status::Corruption("load_state: " + meta_path + " is not JSON");
  uint64_t saved_step = 0, saved_version = 0;
  std::map<std::string, std::string> file_hashes;
  FW_RETURN_IF_ERROR(CheckStateMeta(options_, state, dir, meta_path, &saved_step, &saved_version,
                                    &file_hashes));
  FW_ASSIGN_OR_RETURN(SafetensorsFile weights, OpenStateTensors(root, kStateFiles[0], file_hashes));
  FW_ASSIGN_OR_RETURN(SafetensorsFile moments, OpenStateTensors(root, kStateFiles[1], file_hashes));
  std::map<std::string, const TensorView*> by_name;
  for (const TensorView& t : weights.tensors()) by_name[t.name] = &t;
  for (const TensorView& t : moments.tensors()) by_name[t.name] = &t;
  // Check everything before touching the model, so a bad state leaves it unchanged.
  auto find = [&](const std::string& name, const torch::Tensor& like) -> Result<torch::Tensor> {
    auto it = by_name.find(name);
    if (it == by_name.end())
      return Status::NotFound("load_state: " + dir + " lacks tensor " + name);
    if (it->second->dtype != DType::kF32 || it->second->shape != like.sizes().vec()) {
      return Status::Mismatch("load_state: tensor " + name + " in " + dir +
                              " has the wrong dtype or shape");
    }
    return model::ToTorch(*it->second);
  };
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  for (auto& item : model_->named_parameters()) {
    if (!include_frozen && !item.value().requires_grad()) continue;
    FW_ASSIGN_OR_RETURN(torch::Tensor value, find(item.key(), item.value()));
    copies.emplace_back(item.value(), value);
  }
  for (size_t i = 0; i < trainable_.size(); ++i) {
    FW_ASSIGN_OR_RETURN(torch::Tensor m, find("exp_avg." + trainable_[i].first, exp_avg_[i]));
    FW_ASSIGN_OR_RETURN(torch::Tensor v, find("exp_avg_sq." + trainable_[i].first, exp_avg_sq_[i]));
    copies.emplace_back(exp_avg_[i], m);
    copies.emplace_back(exp_avg_sq_[i], v);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dst, src] : copies) dst.copy_(src);
  for (auto& [name, p] : trainable_) p.mutable_grad() = torch::Tensor();
  step_ = saved_step;
  last_version_ = saved_version;
  have_pending_ = false;
  pending_norm_ = 0;
  pending_tokens_ = 0;
  return Status::Ok();
}

}  // namespace flywheel::trainer
