// `flywheel bench parity`: does the trainer train what the engine sampled? The engine
// samples from the served bf16 weights; the trainer recomputes the same sequences' logprobs
// with its own forward (a) on those very weights, without and with routing replay, and
// (b) on its fp32 master weights (the policy mismatch truncated importance sampling
// corrects). Reported as mean k3 KL and max |delta logprob| over generated tokens.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::rollout {

struct ParityBenchOptions {
  int64_t requests = 16;
  int64_t prompt_tokens = 16;
  int64_t new_tokens = 64;
  int sft_steps = 10;  // sharpen the random demo models first (AdamW lr 1e-3)
  bool moe = true;
  uint64_t seed = 1;
  int threads = 0;
};

struct ParityRow {
  std::string model;
  std::string comparison;  // "served weights", "served weights + routing replay", "fp32 masters"
  int64_t tokens = 0;
  double mean_k3 = 0;
  double max_abs_diff = 0;
  double routing_agreement = -1;  // MoE: share of (token, layer) top-k sets equal; -1 n/a
};

Result<std::vector<ParityRow>> RunParityBench(const ParityBenchOptions& options,
                                              std::ostream& progress);

}  // namespace flywheel::rollout
