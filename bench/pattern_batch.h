// Training data for the torch benchmarks (trainer, fp8): sequences whose continuation is
// learnable, so SFT makes real progress and RL steps start from a trained model.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "trainer/training_client.h"

namespace flywheel::bench {

// Per sequence a repeating pattern of period 3..15 drawn from [0, vocab), with 10% of the
// tokens replaced by noise; every datum predicts its own next token (no weights set).
inline std::vector<trainer::Datum> PatternBatch(int sequences, int length, int64_t vocab,
                                                uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<trainer::Datum> out;
  for (int i = 0; i < sequences; ++i) {
    const int period = 3 + static_cast<int>(rng() % 13);
    std::vector<int32_t> pattern(period);
    for (auto& t : pattern) t = static_cast<int32_t>(rng() % vocab);
    std::vector<int32_t> seq(length + 1);
    for (int t = 0; t <= length; ++t)
      seq[t] = rng() % 10 == 0 ? static_cast<int32_t>(rng() % vocab) : pattern[t % period];
    trainer::Datum d;
    d.tokens.assign(seq.begin(), seq.end() - 1);
    d.target_tokens.assign(seq.begin() + 1, seq.end());
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace flywheel::bench
