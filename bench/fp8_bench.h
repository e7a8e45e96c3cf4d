// `flywheel bench fp8`: what FP8 serving (model/fp8.h, TrainerOptions::fp8_serving) does to
// the deltas workers fetch and to the sampler-trainer gap, measured in one run on one dense
// model (hidden 1024 by default, so the fixed per-tensor bytes of a delta do not dominate):
//
//   deltas   after a short SFT (AdamW, lr 1e-3), RL steps (PPO) at lr 1e-6. After every step
//            the same fp32 masters are served twice: as the FP8 snapshot the trainer publishes
//            (SaveWeightsForSampler with fp8_serving: F8_E4M3 projections with F32 block
//            scales, the rest BF16) and as a BF16 snapshot. Per step: the share of served
//            words that changed, and the delta encoded exactly as the publisher encodes it
//            (delta::EncodeStreamed with sync::VersionLogOptions' defaults) as a share of the
//            full FP8 and of the full BF16 checkpoint. Goal: <= 1.5% of the FP8 checkpoint
//            (the seeds' figure: 1.98%, Fireworks, a 1 TiB FP8 model). Peers in the same run:
//            `zstd -19` and `zstd -3` of the XOR of the two FP8 checkpoints' bytes, and the
//            full checkpoint. The delta of a checkpoint with itself gives the fixed bytes
//            (manifest, per-tensor hashes, chunk records), reported apart.
//   codec    bits per changed F8_E4M3 byte: the stored payload of the delta's F8 chunks
//            against the entropy floor computed as `flywheel bench codec` does for bf16,
//            here for 1-byte words: n·H2(p) bits for the positions (n F8 bytes, p the
//            changed share) + the empirical entropy of the byte differences
//            (target - base) mod 256, the value transform the codec codes (zigzagged, rANS;
//            delta/entropy.h). Target <= 1.05x the floor.
//   k3       sampler vs trainer: mean over sampled tokens of exp(r) - 1 - r,
//            r = logp_trainer - logp_sampler, after the SFT and the RL steps. The sampler is
//            what a worker serves: a model loaded from the published snapshot
//            (model::LoadFp8Weights for FP8, model::LoadWeights for BF16); tokens are sampled
//            from it at every position of held-out sequences (teacher-forced contexts). Rows:
//            FP8 without QAT, FP8 with QAT (fp8_qat, started from the same SFT state and
//            given the same RL steps), BF16. Target: with QAT <= 2x the BF16 figure.
//
// Checks its own results: every delta (FP8 and BF16) applies (delta::ApplyInPlace) to the
// exact next checkpoint, the XOR peers decode back, the FP8 snapshot is deterministic; a
// failure is an error. The targets are reported as PASS/FAIL in the tables.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct Fp8BenchOptions {
  // The model: DemoDenseConfig's shape with these sizes (heads of 64 dims, half as many KV
  // heads, MLP width 11/4 of hidden rounded up to 64).
  int64_t hidden = 1024;  // a multiple of 64, >= 128
  int64_t layers = 4;
  int64_t vocab = 1024;
  int sft_steps = 30;  // AdamW, lr 1e-3
  int rl_steps = 3;    // PPO steps at rl_lr, each one measured
  double rl_lr = 1e-6;
  int sequences = 8;         // per batch
  int sequence_length = 64;  // tokens per sequence
  int64_t block = 128;       // TrainerOptions::fp8_block
  bool run_peers = true;     // zstd of the XOR of consecutive FP8 checkpoints
  uint64_t seed = 1;
  int threads = 0;           // trainer compute threads (0: one per hardware thread)
  std::string markdown_out;  // write the '## FP8 benchmark' section here

  // A quick run (tests): hidden 256, 2 layers, 8 SFT steps, 2 RL steps.
  static Fp8BenchOptions Small();
};

// Fails on bad options, a failed run or a failed correctness check; a missed target is
// reported as FAIL in the tables, not as an error.
Status RunFp8Bench(const Fp8BenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
