// The input rates of the fleet projection (bench/fleet_projection.h), each measured with
// its role alone: in this process, on one thread, while no fleet process runs.
//
//   codec   a generated FP8 checkpoint pair (every matrix F8_E4M3 in 128 x 128 blocks with
//           its F32 `_scale_inv`, norms BF16, as model::SnapshotWeightsFp8 lays it out; fp32
//           masters ~N(0, 0.02) taking one Adam-like step of lr x s, |s| in [0.5, 1.5), the
//           learning rate calibrated so that the requested share of FP8 words changes).
//           encode: delta::EncodeStreamed with sync::VersionLogOptions' defaults and one
//           thread, the base's tensor hashes known (as the publisher keeps them), the
//           target's hashed in the encode; apply: delta::ApplyInPlace with one thread and
//           the base's hashes known (apply + verify), checked bit for bit against the target.
//           Both per CPU-second of this process (the wall clock is printed beside them).
//           Bits per changed word: 8 x the delta's bytes / the changed words its manifest
//           counts (the library's codec at run time).
//   TLS     one TLS 1.3 stream over loopback (transport::Connection, 1 MiB frames): sender
//           and receiver each on a thread of their own; seal + send and receive + open per
//           core are the payload bytes over the CPU time of that thread (pthread CPU clock),
//           so they do not depend on how the two threads share this machine's cores. Relay
//           forward: the same stream through a forwarder (a third thread that receives each
//           frame and re-sends it on its own TLS connection): bytes over its CPU time.
//           Beside it, AES-GCM sealing 16 KiB records on one core (OpenSSL EVP, the cipher
//           the stream negotiated): the one-core ceiling of seal + send.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "bench/fleet_projection.h"
#include "checkpoint/tensor.h"

namespace flywheel::bench {

struct CodecRates {
  uint64_t words = 0;          // of the checkpoint (FP8: its bytes; BF16: bytes / 2)
  uint64_t bytes = 0;          // of the checkpoint's tensor data
  uint64_t changed_words = 0;  // the delta manifest's count
  uint64_t delta_bytes = 0;
  // Medians of the repeats: CPU seconds of the process (the rates' basis: on a busy machine
  // the wall clock counts the waits for a core too) and wall seconds.
  double encode_seconds = 0, apply_seconds = 0;
  double encode_wall_seconds = 0, apply_wall_seconds = 0;
  double encode_words_per_second() const { return words / encode_seconds; }
  double apply_words_per_second() const { return words / apply_seconds; }
  double bits_per_changed_word() const { return 8.0 * delta_bytes / changed_words; }
  double changed_fraction() const { return double(changed_words) / words; }
};

// Encodes base -> target and applies it as described above, `repeats` times each (the
// medians kept); fails when the apply does not rebuild the target bit for bit.
Result<CodecRates> MeasureCodecRates(const CheckpointView& base, const CheckpointView& target,
                                     int repeats);

// A generated FP8 pair of about `fp8_bytes` bytes in which about `changed_fraction` of the
// FP8 words change; `learning_rate` gets the calibrated step size.
struct Fp8Pair {
  OwnedCheckpoint base, target;
  double learning_rate = 0;
};
Result<Fp8Pair> GenerateFp8Pair(uint64_t fp8_bytes, double changed_fraction, uint64_t seed,
                                int threads);

struct TlsRates {
  std::string cipher;
  uint64_t bytes = 0;            // payload of each run
  double stream_bytes_per_second = 0;  // one stream, wall clock (sender and receiver threads)
  double send_per_core = 0;      // seal + send: bytes / sender thread CPU seconds
  double receive_per_core = 0;   // receive + open: bytes / receiver thread CPU seconds
  double forward_per_core = 0;   // receive + re-send: bytes / forwarder thread CPU seconds
  double forward_bytes_per_second = 0;  // the forwarded stream, wall clock
  double aes_gcm_per_core = 0;   // sealing 16 KiB records, one thread
};
Result<TlsRates> MeasureTlsRates(uint64_t bytes);

// Everything the projection needs, measured alone.
struct IsolatedRates {
  CodecRates fp8;
  double fp8_learning_rate = 0;
  TlsRates tls;
  MeasuredRates Projection() const;
  std::vector<std::string> Lines() const;  // each rate, how it was measured
};
struct IsolatedRatesOptions {
  uint64_t fp8_bytes = 256ull << 20;
  double changed_fraction = 0.02;
  uint64_t tls_bytes = 1ull << 30;
  int repeats = 3;
  uint64_t seed = 1;
  int threads = 2;  // to generate the pair (the measurements use one)
};
Result<IsolatedRates> MeasureIsolatedRates(const IsolatedRatesOptions& options);

}  // namespace flywheel::bench
