// The codec benchmark: flywheel's delta codec against what users would pick instead,
// on realistic consecutive checkpoints that it generates itself (fp32 masters
// ~N(0, 0.02) in transformer-like shapes, AdamW steps with random gradients, cast to bf16
// after each step). Peers run in the same process run: `zstd -3` of the target,
// `zstd --patch-from`, `xdelta3`; plus the entropy floor and the full-checkpoint size.
// Every row is also a correctness run: each flywheel delta is applied and compared bit
// for bit with the target; a mismatch fails the run.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::bench {

struct CodecBenchOptions {
  // Approximate size of one bf16 checkpoint.
  uint64_t checkpoint_bytes = 128ull << 20;
  // One table row group per learning rate (density follows from it).
  std::vector<double> learning_rates = {1e-6, 1e-5};
  // AdamW steps taken (from a warm start) before the measured pair (step k-1 -> step k).
  int adam_steps = 3;
  // Thread counts whose encode/apply throughput is measured (1 and 2 by default).
  std::vector<int> threads = {1, 2};
  // Timed repetitions per measurement (the best is reported).
  int repetitions = 3;
  // Scratch directory for the peer tools' files (default: a fresh one under $TMPDIR).
  std::string work_dir;
  bool run_peers = true;
  uint64_t seed = 1;
  // When set, the table is also written there as Markdown (e.g. docs/BENCHMARKS.md).
  std::string markdown_out;
  // When set, the raw results as JSON.
  std::string json_out;
};

// Runs the benchmark and prints the table to `out` (progress goes to stderr).
// Returns a non-OK status if any self-check fails (round trip, peer round trip).
Status RunCodecBench(const CodecBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
