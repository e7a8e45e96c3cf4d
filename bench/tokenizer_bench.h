// `flywheel bench tokenizer`: encode throughput of an HF tokenizer.json (tokenizer/
// hf_tokenizer.h) on one thread, against the reference implementation in the same run.
//
// The text is mixed-language and generated deterministically (`megabytes` of it): prose in
// English, German, French, Spanish, Russian, Greek, Chinese, Japanese, Korean, Arabic and
// Hindi, source code with tabs and runs of spaces, numbers, emoji, chat markup, with random
// identifiers and numbers spliced in so that the word cache does not see only repeats.
// flywheel encodes it (best of `rounds`, after a warm-up); the peer is
// @huggingface/tokenizers (the JS port of HF tokenizers) under node, run on the same text,
// whose ids must be equal to ours. Checks: >= `min_mb_per_s` MB/s and, when the reference
// ran, every id equal. Without node or the npm package (offline), the peer row says why.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct TokenizerBenchOptions {
  std::string tokenizer;  // a tokenizer.json or a model directory (required)
  double megabytes = 4;
  int rounds = 3;
  double min_mb_per_s = 20;
  // A folder whose node_modules has @huggingface/tokenizers; empty: installed from the npm
  // registry into ~/.cache/flywheel/npm-tokenizers when needed.
  std::string reference_dir;
  bool reference = true;  // run the peer
  bool check = true;
  std::string markdown_out;  // write the '## Tokenizer benchmark' section here
};

// The generated text (deterministic for a size).
std::string MixedLanguageText(size_t bytes);

Status RunTokenizerBench(const TokenizerBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
