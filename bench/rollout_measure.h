// `flywheel bench rollout`: generation throughput of the engine on the demo-size models at
// several batch sizes, the pause an in-flight swap costs (a real delta applied to a bf16
// serving copy, the fp32 mirror patched at the written words, requests in flight), and the
// memory a worker holds against the serving weights' own size, with the mirror (bf16
// serving) and without it (f32 serving, the parameters viewing the served tensors).
// Torch-free interface.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::rollout {

struct RolloutBenchOptions {
  std::vector<int64_t> batches = {1, 8, 32};
  int64_t prompt_tokens = 32;
  int64_t new_tokens = 64;
  int swaps = 5;                   // measured swaps per model
  double changed_fraction = 0.01;  // of bf16 words per swapped version (lr ~1e-6)
  bool moe = true;
  uint64_t seed = 1;
  int threads = 0;  // torch threads; 0: one per hardware thread
};

struct RolloutThroughputRow {
  std::string model;
  int64_t batch = 0;
  int64_t tokens = 0;  // generated
  double seconds = 0;
};

struct RolloutModelRow {
  std::string model;
  // "bf16 + fp32 mirror" (the default), or "fp32, no mirror" (the engine computes from the
  // F32 serving copy itself: memory only, no swap timings).
  std::string serving = "bf16 + fp32 mirror";
  int64_t parameters = 0;
  uint64_t serving_bytes = 0;  // the serving copy (bf16, or f32)
  uint64_t mirror_bytes = 0;   // fp32 compute mirror (0 without)
  uint64_t kv_cache_bytes = 0;
  // Process RSS growth from just before the mirror is built to just after the largest batch
  // was generated: mirror, KV cache, activations and torch's own overhead.
  uint64_t rss_growth_bytes = 0;
  std::vector<double> swap_pause_ms;
  uint64_t words_patched_per_swap = 0;
};

struct RolloutBenchResult {
  std::vector<RolloutThroughputRow> throughput;
  std::vector<RolloutModelRow> models;
  int threads = 0;
};

Result<RolloutBenchResult> RunRolloutBench(const RolloutBenchOptions& options,
                                           std::ostream& progress);

}  // namespace flywheel::rollout
