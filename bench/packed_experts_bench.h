// `flywheel bench packed-experts`: LoRA training of a MoE model with its frozen experts
// packed (model/packed.h: fp8 with 128x128 block scales, int8 per-row, int4 per group of 32)
// against the same training with the experts unpacked, in one run:
//
//   memory     bytes the frozen expert weights take, against bf16 (target <= 0.3x) and
//              against the fp32 flywheel holds them in unpacked
//   step time  forward_backward + optim_step, packed vs unpacked, interleaved, median of
//              the per-round ratios (target <= 1.2x)
//
// Checks its own results: each packed model's first loss and adapter gradients equal those
// of an unpacked model holding the dequantized experts (1e-6), and the packed bytes are
// what the format defines.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct PackedExpertsBenchOptions {
  // The model: a Qwen3-MoE of this size (every layer MoE).
  int64_t hidden = 512;
  int64_t layers = 2;
  int64_t experts = 16;
  int64_t top_k = 2;
  int64_t expert_intermediate = 768;
  int64_t lora_rank = 8;
  // The batch: sequences x tokens per step.
  int64_t sequences = 8;
  int64_t tokens = 128;
  int rounds = 9;   // timed rounds (each runs every format once, interleaved)
  int threads = 0;  // compute threads (0: one per hardware thread)
  bool check = true;  // fail on a missed target
  std::string markdown_out;  // write the '## Packed experts benchmark' section here
};

Status RunPackedExpertsBench(const PackedExpertsBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
