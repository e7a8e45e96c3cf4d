// `flywheel bench signing`: what signed versions (sync/signing.h) cost per version.
//
// Generates two consecutive bf16 serving checkpoints of an RL-like AdamW run
// (bench/checkpoint_gen.h, default 1 GiB at lr 1e-6), encodes the delta between them and
// the keyframe of the second, cuts both into 1 MiB pieces as the publisher does, and times,
// on one thread:
//   - the Ed25519 signature of a manifest, and its verification against the catalog entry
//     (the per-version cost the issue bounds at 5 ms: it signs the manifest, not the bytes);
//   - SignArtifact and CheckArtifactBytes of the delta and of the keyframe: the manifest
//     plus the SHA-256 of the artifact's bytes (what the publisher and each worker add to
//     a version's path);
//   - the delta encode, for scale.
// The peer is `openssl speed -evp sha256` (one core, 16 KiB blocks): the crypto floor for
// the SHA-256 pass. Checks: signing and verifying a manifest <= 5 ms each; the SHA-256
// pass >= 0.8 x openssl's rate; every signature verifies and a flipped byte is refused.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "base/status.h"

namespace flywheel::bench {

struct SigningBenchOptions {
  uint64_t checkpoint_bytes = 1ull << 30;
  double learning_rate = 1e-6;
  int rounds = 200;      // manifest sign/verify repetitions (the median is reported)
  int threads = 2;       // checkpoint generation and delta encode
  bool check = true;
  std::string markdown_out;  // write the '## Signing benchmark' section here
};

Status RunSigningBench(const SigningBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
