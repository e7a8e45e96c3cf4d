// The shared-prefix half of `flywheel bench serving`: what the rollout engine's shared
// prefixes (rollout/engine.h, EngineOptions::share_prefixes) save on RL's two shapes of
// work, on the demo-size dense model (random weights), engine to engine (no HTTP).
//
// Group: n seeded samples of one `group_prompt_tokens`-token prompt, `group_max_tokens`
// each, timed against one sample of the same length (medians over rounds, a fresh random
// prompt each round, so nothing is cached from an earlier round). The peer is the same
// group with sharing off: every sample prefills the prompt, as the engine did before.
// Checks: the shared group's tokens and logprobs equal the unshared group's bit for bit;
// the group within 1.6x one sample.
//
// Episode: `turns` turns, each adding `turn_tokens` tokens to the history (the model's
// answer of group_max_tokens tokens, then a tool's reply making up the rest). Counts the
// prompt tokens prefilled against the history's length summed over turns (what a fresh
// prefill of every turn computes), and checks that exactly the new tokens were prefilled:
// each turn's tool reply and the previous answer's last token (sampled, never fed).
//
// Chunked prefill: `running` requests decode; a `long_prompt_tokens`-token prompt arrives.
// Reports the running requests' step time while it is prefilled in chunks of
// `prefill_chunk` tokens (the worst step and the median) against their undisturbed step,
// and against the one step that prefills it whole (prefill_chunk 0, the engine before);
// also the long prompt's time to its first token both ways. Checks: the long prompt's
// answer (greedy) is the same both ways; the worst step within 1.5x the undisturbed one.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct PrefixBenchOptions {
  int64_t group_prompt_tokens = 1024;
  int64_t group_n = 8;
  int64_t group_max_tokens = 32;
  int64_t turns = 6;
  int64_t turn_tokens = 200;
  int rounds = 3;
  int64_t running = 16;
  int64_t long_prompt_tokens = 4000;
  int64_t prefill_chunk = 16;
  // false: the timing target is reported, not enforced (short CTest forms); the exactness
  // checks always are.
  bool check_timing = true;
};

// The report's Markdown (tables and checks). Mismatch when an exactness check fails, or a
// timing target is missed with check_timing; `targets_met` says whether the timing target
// was met.
Result<std::string> RunPrefixBench(const PrefixBenchOptions& options, bool& targets_met);

}  // namespace flywheel::bench
