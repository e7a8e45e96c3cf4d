// `flywheel bench join`: a worker joining at the head of a model through a relay.
//
// In one process, on loopback: a publisher (its log holds a keyframe of generated bf16
// weights and `chain` sparse deltas after it, AdamW steps), one relay, and a joining
// worker whose upstream link is shaped to `link_bytes_per_second` (transport's
// LinkShaping), so that the keyframe's transfer dominates. The relay is warmed first by an
// unshaped worker, so both measured joins fetch from its cache. Two joins are timed, from
// Worker::Start until the worker serves the head:
//   streamed  the keyframe is decoded and verified tensor by tensor while it arrives
//             (WorkerOptions::stage_keyframes, the default), then the chain is applied;
//   buffered  the keyframe is decoded once it is whole (stage_keyframes off: the behaviour
//             before streamed keyframes), the peer.
// Measured separately in the same run, on the same threads: the whole-keyframe decode and
// the chain apply (each delta applied in place). Target: streamed join <= 1.3 x (keyframe
// bytes / link rate) + chain apply. Each join is also a correctness run: the worker's
// weights hash must be the head's.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct JoinBenchOptions {
  uint64_t model_bytes = 1ull << 30;                // bf16 weights of the generated model
  double link_bytes_per_second = 125'000'000;       // 1 Gbit/s
  int chain = 2;                                    // deltas after the keyframe
  double learning_rate = 1e-6;                      // AdamW steps between versions
  int threads = 2;                                  // the worker's CPU threads (decode, apply)
  uint64_t seed = 1;
  std::string json_out;                             // also write the results here
  bool check = true;                                // fail on a missed target
};

struct JoinBenchResult {
  uint64_t model_bytes = 0;
  uint64_t keyframe_bytes = 0;
  uint64_t chain_bytes = 0;
  double link_bytes_per_second = 0;
  double transfer_seconds = 0;         // keyframe bytes / link rate
  double keyframe_decode_seconds = 0;  // the whole keyframe, decoded once it is in
  double chain_apply_seconds = 0;      // every delta of the chain, in place
  double streamed_seconds = 0;         // the join with the keyframe staged as it arrives
  double buffered_seconds = 0;         // the join with the keyframe decoded once whole
  double target_seconds() const { return 1.3 * transfer_seconds + chain_apply_seconds; }
  double ratio() const { return streamed_seconds / target_seconds(); }
  // The pre-change sequence without overlap: transfer, then decode, then the chain.
  double sequential_seconds() const {
    return transfer_seconds + keyframe_decode_seconds + chain_apply_seconds;
  }
  bool pass() const { return streamed_seconds <= target_seconds(); }
};

// Runs the benchmark, prints its table and checks to `out`.
Result<JoinBenchResult> RunJoinBench(const JoinBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
