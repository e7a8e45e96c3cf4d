// `flywheel bench trainer`: what the embedded trainer costs and what its updates look like
// to the delta codec. Torch-free interface (bench/ and tools/ include it).
//
//   throughput  forward_backward tokens/s on the demo-size dense and MoE models
//               (model::DemoDenseConfig / DemoMoeConfig), the fused built-in PPO loss against
//               the same loss through forward_backward_custom (a no-grad forward for
//               logprobs, the user's loss in torch, then a forward+backward), same batch;
//               both losses are checked equal. Published anchor: fused ~2x the two-pass path.
//               Each sequence's first quarter is a prompt (weight 0), as in RL batches.
//               Fused and custom calls are interleaved (the order alternates per pair) on
//               one client; gradients are discarded after every call, so every repetition
//               does the same work on the same weights and optimizer state.
//   sparsity    from a model trained first (SFT with AdamW), RL steps at each learning rate:
//               the fraction of bf16 elements of the sampler snapshot that change per step,
//               the number the whole delta design rests on.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"
#include "bench/stats.h"
#include "model/model_config.h"

namespace flywheel::trainer {

struct TrainerBenchOptions {
  int sequences = 8;          // per forward_backward call
  int sequence_length = 256;  // tokens per sequence
  int warmup = 1;             // warm-up pairs (timed and reported, not in the statistics)
  int repetitions = 5;        // timed (fused, custom) pairs (the median is reported)
  bool moe = true;            // also the MoE model
  // Sparsity: SFT steps that make the starting model "trained", then RL steps per lr.
  int pretrain_steps = 30;
  double pretrain_lr = 1e-3;
  int rl_steps = 3;
  std::vector<double> learning_rates = {1e-6, 1e-5};
  uint64_t seed = 1;
  int threads = 0;  // TrainerOptions::threads (trainer/training_client.h ConfigureCpuThreads)
};

// Seconds of the timed repetitions of one kind of call (bench/stats.h).
using bench::Spread;
using bench::Summarize;

// Fused vs custom forward_backward on one client, one batch (RL-shaped: the first quarter
// of each sequence a prompt with weight 0, PPO clip 0.2/0.28, token-mean), measured in one
// process. Shared by `flywheel bench trainer` and the ratio guard in the test suite, so
// both time the same user loss the same way.
struct FusedVsCustomOptions {
  int sequences = 8;
  int sequence_length = 256;
  int warmup = 1;       // pairs before the timed ones
  int repetitions = 5;  // timed pairs
  uint64_t seed = 1;
  bool forward = true;  // also time a no-grad forward per pair
  int threads = 0;      // TrainerOptions::threads of the client
};

struct FusedVsCustomTiming {
  int64_t parameters = 0;
  int64_t tokens = 0;  // per call
  // Seconds per call, in pair order. Pair i runs fused first when i is even, custom first
  // when odd, so a drift in machine speed falls on both paths alike.
  std::vector<double> warmup_fused, warmup_custom;
  std::vector<double> fused, custom, forward;
  // CPU seconds of the whole process (all threads) per timed call: what the call cost the
  // machine, nearly independent of how many other processes share the cores.
  std::vector<double> fused_cpu, custom_cpu;
  double loss_difference = 0;  // max |fused - custom| over all calls (same batch and weights)

  // Median over the timed pairs of custom_i / fused_i: a noisy pair moves it by one rank.
  double MedianPairRatio() const;
  double MedianPairCpuRatio() const;  // the same for the CPU seconds
};

// REQUIRES: options.sequences >= 1, sequence_length >= 2, repetitions >= 1, warmup >= 0.
// One line per pair goes to `progress` when it is not null.
Result<FusedVsCustomTiming> MeasureFusedVsCustom(const model::ModelConfig& config,
                                                 const FusedVsCustomOptions& options,
                                                 const std::string& name, std::ostream* progress);

struct ThroughputRow {
  std::string model;
  int64_t parameters = 0;
  int64_t tokens = 0;  // per call
  Spread fused;        // seconds per forward_backward call
  Spread custom;       // seconds per forward_backward_custom call
  Spread forward;      // seconds per forward (no grad) call
  double pair_ratio = 0;  // median over pairs of custom / fused
  std::vector<double> warmup_fused, warmup_custom;
  double loss_difference = 0;  // max |fused - custom| on the same batch and weights
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
  int threads = 0;       // torch intra-op threads
  int blas_threads = 0;  // OpenBLAS threads (0: not OpenBLAS, or unknown)
  std::string dense_config, moe_config;  // config.json text
};

// Runs the benchmark; progress lines go to `progress`.
Result<TrainerBenchResult> RunTrainerBench(const TrainerBenchOptions& options,
                                           std::ostream& progress);

}  // namespace flywheel::trainer
