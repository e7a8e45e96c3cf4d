// The decode-throughput section of `flywheel bench serving`: tokens per second of
// `concurrent` sequences decoding together in the rollout engine, against this CPU's matmul
// floor measured in the same run (OpenBLAS through torch::mm: a large square GEMM, and the
// decode step's own shapes), times the FLOPs a token costs (2 per matmul weight, the LM
// head included, plus attention over the context).
//
// The model is the 167M-parameter bench model (Qwen3 architecture, random weights: hidden
// 1024, 12 layers, 16 heads / 8 KV heads, MLP 1728, vocabulary 32,000, untied), or the
// demo-size dense model in the short form. Check (with check_timing): the fraction of the
// square-GEMM floor >= 0.5.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct DecodeBenchOptions {
  int64_t concurrent = 32;
  int64_t prompt_tokens = 64;
  int64_t steps = 24;        // decode steps timed (after the admission step)
  bool small_model = false;  // the demo-size model instead of the 167M one
  bool check_timing = true;
};

Result<std::string> RunDecodeBench(const DecodeBenchOptions& options, bool& targets_met);

}  // namespace flywheel::bench
