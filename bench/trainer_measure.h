// `flywheel bench trainer`: what the embedded trainer costs and what its updates look like
// to the delta codec. Torch-free interface (bench/ and tools/ include it).
//
//   throughput  forward_backward tokens/s on the demo-size dense and MoE models
//               (model::DemoDenseConfig / DemoMoeConfig), the fused built-in PPO loss against
//               the same loss through forward_backward_custom (a no-grad forward for
//               logprobs, the user's loss in torch, then a forward+backward), same batch;
//               both losses are checked equal. Published anchor: fused ~2x the two-pass path.
//               Each sequence's first quarter is a prompt (weight 0), as in RL batches.
//   sparsity    from a model trained first (SFT with AdamW), RL steps at each learning rate:
//               the fraction of bf16 elements of the sampler snapshot that change per step,
//               the number the whole delta design rests on.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::trainer {

struct TrainerBenchOptions {
  int sequences = 8;          // per forward_backward call
  int sequence_length = 256;  // tokens per sequence
  int warmup = 1;             // untimed calls per path
  int repetitions = 3;        // timed calls per path (the median is reported)
  bool moe = true;            // also the MoE model
  // Sparsity: SFT steps that make the starting model "trained", then RL steps per lr.
  int pretrain_steps = 30;
  double pretrain_lr = 1e-3;
  int rl_steps = 3;
  std::vector<double> learning_rates = {1e-6, 1e-5};
  uint64_t seed = 1;
  int threads = 0;  // torch threads; 0: one per hardware thread
};

struct ThroughputRow {
  std::string model;
  int64_t parameters = 0;
  int64_t tokens = 0;          // per call
  double fused_seconds = 0;    // median per forward_backward call
  double custom_seconds = 0;   // median per forward_backward_custom call
  double forward_seconds = 0;  // median per forward (no grad) call
  double loss_difference = 0;  // |fused - custom| on the same batch and weights
};

struct SparsityRow {
  double learning_rate = 0;
  int step = 0;
  int64_t elements = 0;
  int64_t changed = 0;
};

struct TrainerBenchResult {
  std::vector<ThroughputRow> throughput;
  std::vector<SparsityRow> sparsity;
  int threads = 0;
  std::string dense_config, moe_config;  // config.json text
};

// Runs the benchmark; progress lines go to `progress`.
Result<TrainerBenchResult> RunTrainerBench(const TrainerBenchOptions& options,
                                           std::ostream& progress);

}  // namespace flywheel::trainer
