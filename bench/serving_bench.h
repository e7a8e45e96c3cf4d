// `flywheel bench serving`: what streaming buys a client of a worker's OpenAI-style routes.
//
// Serves the demo-size dense model (model::DemoDenseConfig, random weights; an HF
// tokenizer.json when given, else bytes) with rollout::CompletionService on a loopback HTTP
// server, and for `rounds` rounds sends the same chat-free completions request (a
// `prompt_tokens`-token prompt, `max_tokens` new tokens, a fixed seed, EOS ignored) twice:
// streamed (`stream: true`, read as it arrives with transport::HttpPostStream) and whole.
// Reports the medians of the time to the first streamed token, of the streamed answer's
// end, and of the whole answer (the peer: what a client without streaming waits). Checks:
// the streamed text and token ids equal the whole answer's; the first token arrives within
// a quarter of the whole answer's time; streaming costs at most 15% more in total. Sharing
// prefixes is off for this part (the whole answer would leave the streamed one its prompt).
// Then the shared-prefix section (bench/prefix_bench.h): groups and episodes; then the
// structured-output section (bench/structured_bench.h); then decode throughput against
// the GEMM floor (bench/decode_bench.h).
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "base/status.h"
#include "bench/decode_bench.h"
#include "bench/prefix_bench.h"
#include "bench/structured_bench.h"

namespace flywheel::bench {

struct ServingBenchOptions {
  int64_t prompt_tokens = 32;
  int64_t max_tokens = 64;
  int rounds = 5;
  std::string tokenizer;  // a tokenizer.json or model directory; empty: bytes
  int threads = 0;        // torch threads; 0: one per hardware thread
  bool check = true;
  PrefixBenchOptions prefixes;  // the shared-prefix section (bench/prefix_bench.h)
  StructuredBenchOptions structured;  // the structured-output section (bench/structured_bench.h)
  DecodeBenchOptions decode;          // the decode-throughput section (bench/decode_bench.h)
  std::string markdown_out;  // write the '## Serving benchmark' section here
  std::string section;       // only this part: http, prefixes, structured or decode; empty: all
};

Status RunServingBench(const ServingBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
