// The embedded trainer's client API, modelled on the training APIs RL teams know
// (Tinker, Fireworks' training SDK): forward / forward_backward / forward_backward_custom /
// optim_step / save_weights_for_sampler / save_state / load_state.
//
// A Datum is one sequence: position i of `tokens` predicts `target_tokens[i]`. Batches are
// right-padded to the longest datum; padding never counts.
//
// Gradient accumulation: every ForwardBackward* call adds (its aggregated loss x its
// normaliser n) to the gradients, where n is the call's number of sequences or its sum of
// loss weights (Normalization); OptimStep divides by the sum of n since the last step. So
// k calls of B sequences step exactly like one call of k*B sequences when the aggregation
// matches the mode (token-mean with kTokens, seq-mean-* with kSequences).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/env.h"
#include "base/status.h"
#include "checkpoint/hash.h"
#include "checkpoint/tensor.h"
#include "trainer/data_parallel.h"
#include "trainer/losses.h"
#include "model/model.h"
#include "sync/version_log.h"

namespace flywheel::trainer {

struct Datum {
  std::vector<int32_t> tokens;            // model input, length T >= 1
  std::vector<int32_t> target_tokens;     // length T
  std::vector<float> weights;             // length T; empty = all 1 (loss mask / SFT weights)
  std::vector<float> logprobs;            // sampling logprobs, length T (RL losses, TIS)
  std::vector<float> advantages;          // length T (RL losses)
  std::vector<float> ref_logprobs;        // length T (dpo, kl_coef > 0)
  std::vector<uint64_t> policy_versions;  // optional, length T: the version that sampled each token
  // Optional routing replay: T x num_moe_layers x top_k expert indices, token-major.
  std::vector<int32_t> routing;
};

enum class Normalization { kTokens, kSequences };

struct AdamWParams {
  double lr = 1e-5;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double grad_clip = 1.0;  // max global L2 norm; 0 off
  Status Validate() const;
};

struct Metrics {
  double loss = 0;           // the call's aggregated loss (ForwardBackward*)
  double kl_sampler_k3 = 0;  // sampling vs recomputed logprobs, mean k3 over loss tokens
  double clip_fraction = 0;
  double kl_reference = 0;
  double tis_truncated = 0;
  double aux_loss = 0;      // MoE load balancing (mean over layers), before its coefficient
  double grad_norm = 0;     // OptimStep: global norm before clipping
  double tokens_per_s = 0;  // loss tokens (OptimStep: since the last step) per wall second
  int64_t sequences = 0;
  int64_t tokens = 0;  // loss tokens (weight > 0)
  uint64_t step = 0;   // optimizer steps taken (after this call)
};

struct ForwardOutput {
  std::vector<std::vector<float>> logprobs;  // per datum, length T
  // Per datum, T x num_moe_layers x top_k, token-major (empty for dense models).
  std::vector<std::vector<int32_t>> routing;
};

// One pass over the snapshot's bytes hashes it (tensor_hashes, combined into weights_hash);
// the publisher is handed those hashes and does not hash again, and the changed-word counts
// are the delta encoder's own (no separate comparison with the previous snapshot).
struct SamplerSnapshot {
  uint64_t version = 0;
  std::string weights_hash;  // hex, as `flywheel checkpoint hash` prints it
  uint64_t bytes = 0;        // serving-dtype bytes of the snapshot
  bool adapters_only = false;
  OwnedCheckpoint checkpoint;          // what was hashed and published
  std::vector<Hash128> tensor_hashes;  // TensorHash of each, aligned with checkpoint.tensors
  // With a publisher: the sizes of what it wrote for this version (0 when not written).
  uint64_t published_delta_bytes = 0;
  uint64_t published_keyframe_bytes = 0;
  // With a publisher that wrote a delta: words (serving dtype) that differ from the
  // previous published version, and all words, as the encoder counted them; both 0
  // otherwise (no publisher, first version, layout change, keyframe-only log).
  uint64_t changed_words = 0;
  uint64_t total_words = 0;
  // Tensors the publisher hashed itself (sync::AppendResult::tensors_hashed): 0, since it
  // is handed tensor_hashes; a test checks that the bytes are hashed once.
  uint64_t publisher_hashed_tensors = 0;
};

struct TrainerOptions {
  model::ModelConfig config;
  std::string init_weights;                // optional safetensors file or sharded dir to start from
  uint64_t seed = 0;                       // random init (when no init_weights) and LoRA A factors
  std::optional<model::LoraOptions> lora;  // set: LoRA mode (base frozen)
  DType serving_dtype = DType::kBF16;
  Normalization normalization = Normalization::kTokens;
  // FP8 serving (model/fp8.h): SaveWeightsForSampler writes the projection weights as F8_E4M3
  // with power-of-two fp8_block x fp8_block scales (HF layout), everything else in
  // serving_dtype. Adapters-only snapshots (LoRA) are unaffected.
  bool fp8_serving = false;
  int64_t fp8_block = 128;
  // FP8 quantization-aware training: the forward pass computes with the projection weights
  // fake-quantized exactly as the FP8 snapshot stores them (straight-through gradients to the
  // fp32 masters). The other tensors stay fp32: the trainer's logprobs equal an FP8 worker's
  // when the snapshot keeps them F32 (serving_dtype F32), and are as close as BF16 serving is
  // when it rounds them to BF16 (the default).
  bool fp8_qat = false;
  // Packed frozen experts (LoRA on a MoE model; model/packed.h): the experts' frozen weights
  // are held as fp8 (block scales), int8 (per-row scales) or int4 (per-group scales) and
  // dequantized one expert at a time in the forward and backward passes. The trainer and
  // the served base then both use the dequantized values. pack_block 0: the format's default.
  model::PackFormat pack_frozen_experts = model::PackFormat::kNone;
  int64_t pack_block = 0;
  int threads = 0;  // compute threads (see ConfigureCpuThreads); 0: one per hardware thread
  // Set: join a c10d/Gloo group (trainer/data_parallel.h). Rank 0's initial weights are
  // broadcast; every rank must call optim_step together; only rank 0 should publish.
  std::optional<DataParallelOptions> data_parallel;
  // Saved states are written and read through this Env (null: Env::Default()).
  Env* env = nullptr;
};

// Where SaveWeightsForSampler hands a snapshot to be published as `version`, with what is
// known of it (its tensor hashes and checkpoint hash: not hashed again). The trainer knows
// no publisher: whoever runs it wires one in (the RL run and the training service attach
// their in-process sync::Publisher, whose Publish has this shape).
using SnapshotPublisher = std::function<Result<sync::AppendResult>(
    uint64_t version, const CheckpointView& weights, const sync::AppendOptions& known)>;

// A CPU trainer has two thread pools: torch's OpenMP intra-op pool (element-wise ops,
// softmax, reductions) and the pthread pool of OpenBLAS, the BLAS Debian's libtorch runs
// its matmuls in. Each defaults to one thread per core, and each spins for a while after
// its work before sleeping, so on a small machine the two take each other's cores: a
// 2-thread OpenMP region or GEMM then waits for a thread that is spinning in the other
// pool. On 2 busy cores that made a forward_backward take 5-17x its CPU time instead of ~3x
// and swing the fused/custom ratio between 0.4x and 2.5x (issue 20). So one pool
// gets the cores: OpenBLAS (the matmuls are most of the work) gets `threads` (0: one per
// hardware thread) and torch's own ops run on the calling thread. Without OpenBLAS (looked
// up at run time; libblas.so.3 may be another BLAS), torch gets `threads` as before.
// Process-wide; TrainingClient::Create calls it with TrainerOptions::threads. When
// OMP_NUM_THREADS or OPENBLAS_NUM_THREADS is set, the pools are left as the environment
// made them.
struct CpuThreads {
  int torch = 0;  // torch intra-op threads
  int blas = 0;   // OpenBLAS threads; 0: the BLAS is not OpenBLAS
};
CpuThreads ConfigureCpuThreads(int threads);
CpuThreads CurrentCpuThreads();

// What one training run owns of a TrainingClient: the trainable tensors' values (LoRA: the
// adapters; otherwise every weight), their AdamW moments and pending gradients, the step and
// the gradient accumulation since it. The training service keeps one per session and swaps
// them in and out of one client, so several runs share one frozen base (multi-LoRA).
struct TrainableState {
  // Aligned with the client's trainable parameters; undefined moments or gradients are zeros.
  std::vector<torch::Tensor> values, exp_avg, exp_avg_sq, grads;
  uint64_t step = 0;
  uint64_t last_version = 0;
  double pending_norm = 0;
  int64_t pending_tokens = 0;
  bool have_pending = false;
  std::chrono::steady_clock::time_point pending_since{};
};

// The user loss of ForwardBackwardCustom: given the datums and their current logprobs
// (one 1-D fp32 tensor of length T per datum, requiring grad), return a scalar loss.
using CustomLossFn = std::function<Result<torch::Tensor>(const std::vector<Datum>&,
                                                         const std::vector<torch::Tensor>&)>;

class TrainingClient {
 public:
  static Result<std::unique_ptr<TrainingClient>> Create(TrainerOptions options);
  ~TrainingClient();

  // Logprobs of the targets (and the routing used), no gradients.
  Result<ForwardOutput> Forward(const std::vector<Datum>& datums);
  // One forward and one backward with the loss fused in; gradients accumulate.
  Result<Metrics> ForwardBackward(const std::vector<Datum>& datums, std::string_view loss_name,
                                  const LossConfig& config = {});
  // The general path: a no-grad forward for logprobs, `fn` computes the loss and
  // d loss / d logprob, then a forward+backward of sum(logprob * that gradient).
  Result<Metrics> ForwardBackwardCustom(const std::vector<Datum>& datums, const CustomLossFn& fn);
  // ForwardBackwardCustom's second pass for a loss computed elsewhere (the training
  // service's Python clients): `grads[i][t]` is d loss / d logprob of datum i's token t, taken
  // at the logprobs Forward() returned (pass the routing it returned in the datums, so an
  // MoE model routes as it did); `loss_value` is reported as the metrics' loss. Backpropagates
  // sum(logprob * grads) through one forward with a graph: the loss's gradient.
  Result<Metrics> ForwardBackwardFromGrads(const std::vector<Datum>& datums,
                                           const std::vector<std::vector<float>>& grads,
                                           double loss_value);
  // AdamW on the accumulated gradients (divided by the accumulated normaliser), with
  // global-norm clipping; clears the gradients. Data parallel: gradients, normalisers and
  // token counts are summed over the ranks first (a rank may contribute nothing).
  Result<Metrics> OptimStep(const AdamWParams& params);
  // Drops the gradients accumulated since the last step without stepping: weights,
  // optimizer moments and the step count stay as they were (a skipped batch; benchmarks
  // that repeat the same call).
  void DiscardGradients();

  // Casts the weights (LoRA: only the adapters) to the serving dtype, hashes them and, when
  // a publisher is attached, publishes them as `version` (must exceed the last one).
  Result<SamplerSnapshot> SaveWeightsForSampler(uint64_t version);
  void AttachPublisher(SnapshotPublisher publish) { publish_ = std::move(publish); }
  // Any object with sync::Publisher's Publish(version, weights, known): the caller, which
  // includes the publisher, is where the two are wired together.
  template <typename Publisher>
  void AttachPublisher(Publisher* publisher) {
    AttachPublisher([publisher](uint64_t version, const CheckpointView& weights,
                                const sync::AppendOptions& known) {
      return publisher->Publish(version, weights, known);
    });
  }

  // Weights (fp32), optimizer moments, step and pending accumulation, so a run resumes
  // bit-exactly. `dir` is replaced atomically and durably, through TrainerOptions::env:
  // the new state is written beside it (<dir>.tmp.<pid>, every file synced), the old one
  // renamed to <dir>.old, the new one renamed to `dir`, the directory synced; OK means the
  // new state survives a power cut. A crash part-way leaves `dir` whole (old or new) or, if
  // it struck between the two renames, no `dir` and a whole <dir>.old, which LoadState then
  // reads. trainer.json records the checkpoint hash of each tensor file; LoadState refuses
  // (Corruption) a file that does not match it, so a damaged save is never loaded.
  // With include_frozen false only the trained parameters are written and read (LoRA: the
  // adapters; the frozen base is left as it is): a state of one LoRA session on a shared base.
  Status SaveState(const std::string& dir, bool include_frozen = true);
  Status LoadState(const std::string& dir, bool include_frozen = true);

  // Copies of the trainable state, and back (REQUIRES: a state exported by this client, or
  // one shaped like it). Import replaces values, moments, gradients, step and accumulation.
  TrainableState ExportTrainable() const;
  Status ImportTrainable(const TrainableState& state);
  // Number of parameters (elements): all (packed frozen experts included), and those trained.
  int64_t parameter_count() const;
  int64_t trainable_count() const;

  model::TransformerImpl& model() { return *model_; }
  const TrainerOptions& options() const { return options_; }
  uint64_t step() const { return step_; }
  int64_t pending_tokens() const { return pending_tokens_; }  // loss tokens since the last step
  uint64_t last_sampler_version() const { return last_version_; }

 private:
  struct Batch;
  explicit TrainingClient(TrainerOptions options);
  Result<Batch> MakeBatch(const std::vector<Datum>& datums, bool need_sampling,
                          bool need_advantages, bool need_ref) const;
  // Checks datum `index` and copies it into its row of `batch` (routing into `replay`).
  static Status FillBatchRow(const Datum& datum, size_t index, const model::ModelConfig& config,
                             Batch& batch, torch::Tensor& replay);
  // Data parallel: sums gradients, normalisers and token counts over the ranks.
  Status ReduceAcrossRanks();
  // SaveState's files (weights, optimizer, trainer.json) in the new directory `dir`.
  Status WriteStateFiles(const std::string& dir, bool include_frozen) const;
  Env* env() const { return options_.env != nullptr ? options_.env : Env::Default(); }
  // Token logprobs [B, T] of the batch's targets, and the MoE outputs. With `positions`
  // ([B, T] bool), the LM head runs only there (the vocabulary projection is the largest
  // matmul of a small model); elsewhere the result holds `filler` (or 0), without gradient.
  struct LogprobResult;
  LogprobResult Logprobs(const Batch& batch, const torch::Tensor& positions = {},
                         const torch::Tensor& filler = {});
  // Backpropagates (loss [+ MoE aux loss x its coefficient]) x the batch's normaliser and
  // accumulates the normaliser and token counts (see the file comment).
  void Backward(const Batch& batch, const torch::Tensor& loss, const torch::Tensor& aux_loss,
                Metrics& metrics);
  // The second pass of the custom paths: `upstream` [B, T] is d loss / d logprob.
  Metrics BackwardUpstream(const Batch& batch, const torch::Tensor& upstream, double loss_value);

  TrainerOptions options_;
  std::shared_ptr<model::TransformerImpl> model_;
  std::vector<std::pair<std::string, torch::Tensor>> trainable_;  // name-sorted
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_;
  uint64_t step_ = 0;
  double pending_norm_ = 0;  // sum of normalisers since the last step
  int64_t pending_tokens_ = 0;
  std::chrono::steady_clock::time_point pending_since_{};
  bool have_pending_ = false;
  uint64_t last_version_ = 0;
  SnapshotPublisher publish_;
  std::unique_ptr<DataParallel> data_parallel_;
};

}  // namespace flywheel::trainer
