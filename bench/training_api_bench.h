// `flywheel bench training-api`: what the training service's network API costs against the
// in-process training client, on the demo's model and batch (the tiny preset, 8 groups x 8
// samples of the sort task's length), on a loopback HTTP server in this process:
//
//   overhead   forward_backward (ppo + TIS) over the API vs the same call in process,
//              interleaved pairs, median of the per-pair ratios (target <= 1.10)
//   custom     forward + forward_backward_custom (the loss computed by the client, here an
//              importance-sampling loss in C++ standing in for Python) vs built-in
//              forward_backward of the same loss, both over the API
//   lora       two LoRA sessions trained at once (two client threads) vs one after the other:
//              tokens per second of each, and the adapters must come out identical
//
// Checks its own results: the API's losses equal the in-process ones, the custom loss equals
// the built-in one (1e-6), and both LoRA schedules give the same adapters.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct TrainingApiBenchOptions {
  int rounds = 10;        // timed pairs
  int lora_steps = 4;     // steps per LoRA session
  int threads = 0;        // compute threads (0: one per hardware thread)
  bool check = true;      // fail on a missed overhead target
  std::string markdown_out;  // write the '## Training API benchmark' section here
};

Status RunTrainingApiBench(const TrainingApiBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
