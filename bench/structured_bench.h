// The structured-output section of `flywheel bench serving`: JSON-schema answers from the
// rollout engine (SamplingParams::guide, tokenizer/token_guide.h) on the demo-size dense
// model (random weights, so the grammar alone makes the answers valid), engine to engine.
//
// The vocabulary is synthetic but shaped like a BPE one: the 256 bytes, common words with
// and without a leading space, JSON keys and punctuation runs, and printable-ASCII pairs
// (many tokens cross a grammar boundary, e.g. `":` or `",`), filling the model's 8,192 ids.
//
// Validity: `requests` sampled answers (temperature 1, `concurrent` at a time) to a bounded
// schema (nested object, enum, integer, number array, string pattern and lengths); each must
// end on the stop token, parse, and validate (tokenizer/json_schema.h's checker, which does
// not use the regex). Overhead: the decode step of `concurrent` running guided requests
// (masks cached, as in steady serving) against the same number of unguided ones, medians
// over interleaved rounds; the cold first batch (every mask computed on the way) is
// reported beside it. Checks: every answer valid; with check_timing, overhead <= 15%.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct StructuredBenchOptions {
  int64_t requests = 200;
  int64_t concurrent = 32;
  int rounds = 3;
  bool check_timing = true;
};

// The report's Markdown. Mismatch when an answer is invalid, or (check_timing) the
// overhead target is missed; `targets_met` says whether it was met.
Result<std::string> RunStructuredBench(const StructuredBenchOptions& options, bool& targets_met);

}  // namespace flywheel::bench
