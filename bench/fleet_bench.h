// The fleet benchmark: cross-region weight sync on a real local fleet.
//
// It starts the flywheel roles as separate processes on loopback (the flywheel binary
// itself: `flywheel publish`, `relay`, `worker`), drops a sequence of generated
// checkpoints into the publisher's watch directory, and measures for each update how long
// it takes until every worker serves the new version with the expected weights hash, and
// how many bytes crossed the WAN. Three strategies run side by side on the same
// checkpoints:
//
//   full-direct  every worker fetches the full checkpoint from the publisher (the peer:
//                what one does without flywheel's relays and deltas);
//   full-relay   full checkpoints, fetched once per region by a relay that serves the
//                region's workers;
//   delta-relay  keyframes every K versions and sparse deltas between them, through the
//                relays (flywheel's default).
//   delta-relay-signed  the same with signed versions (publisher --signing-key, relays and
//                workers --trust-key); not run by default. With delta-relay it is checked
//                to be within 2 % of delta-relay's median sync time.
//
// Before each strategy and each update the benchmark calls sync(), so that no strategy
// or update is measured while an earlier one's writes are written back (without it the
// strategy that ran second was 13-25 % slower, whichever it was).
//
// The WAN is emulated by the publisher (`--wan-rate`, `--wan-latency-ms`): every link to
// a node in another region shares that region's token bucket and has the one-way latency
// each way. Relays and workers run unshaped (LAN). Every update is also a correctness run:
// a worker that serves the new version with another weights hash fails the benchmark.
//
// The run ends with the loopback stream comparison: iperf3 (one TCP stream) against one
// flywheel connection stream, plain and TLS, as a ratio.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::bench {

// Names accepted in FleetBenchOptions::strategies, in their canonical order.
inline constexpr const char* kFullDirect = "full-direct";
inline constexpr const char* kFullRelay = "full-relay";
inline constexpr const char* kDeltaRelay = "delta-relay";
// delta-relay with signed versions: the publisher signs (--signing-key), relays and workers
// verify (--trust-key); compared with delta-relay when both run.
inline constexpr const char* kDeltaRelaySigned = "delta-relay-signed";
// delta-relay with the publisher serving a delta only once it is wholly encoded
// (--buffered-deltas, format-1 containers): the peer of the streamed publish.
inline constexpr const char* kDeltaRelayBuffered = "delta-relay-buffered";

struct FleetBenchOptions {
  // The flywheel executable whose roles are started; empty: this process's own binary.
  std::string flywheel_binary;
  // Emulated WAN between the publisher's region ("home") and every other region.
  uint64_t wan_bytes_per_second = 125'000'000;  // 1 Gbit/s
  int wan_latency_ms = 40;                      // one way; RTT is twice this
  // bf16 parameters of the generated checkpoint (2 bytes each).
  uint64_t parameters = 500'000'000;
  // Measured updates after the initial version (which is synced but not measured).
  int updates = 3;
  int regions = 2;
  int workers_per_region = 4;
  // Run in this order; each of kFullDirect, kFullRelay, kDeltaRelay, kDeltaRelaySigned,
  // kDeltaRelayBuffered at most once.
  std::vector<std::string> strategies = {kFullDirect, kFullRelay, kDeltaRelay};
  // Size of the simulated optimiser step; sets the fraction of bf16 words that change.
  double learning_rate = 1e-6;
  // delta-relay's keyframe period, passed to the publisher; 0: the publisher's default.
  int keyframe_every = 0;
  uint64_t seed = 1;
  // Threads used to generate and hash the checkpoints.
  int threads = 2;
  // Pin the publisher to CPU 0 and every relay and worker to the other CPUs, as a
  // trainer host and the fleet are separate hardware (needs 2 CPUs or more; ignored
  // otherwise). Off: every role shares every CPU.
  bool pin = false;
  // Scratch directory for drops, state and logs (default: a fresh one under $TMPDIR).
  // A directory created by the run is removed at the end unless `keep` is set; logs of
  // the roles are in <work_dir>/logs/.
  std::string work_dir;
  bool keep = false;
  // Give up on an update when the workers have not all caught up after this long;
  // 0: derived from the bytes full-direct must move over the WAN.
  double update_timeout_seconds = 0;
  // Duration of the iperf3 run; 0 skips the loopback stream comparison.
  int stream_seconds = 3;
  // When set, a "## Fleet benchmark" section is written into this Markdown file
  // (replacing an existing one, else appended).
  std::string markdown_out;
  // When set, the raw results as JSON.
  std::string json_out;
  // The projection's input rates, each measured alone after the fleet has stopped
  // (bench/fleet_rates.h): the generated FP8 pair's size and the TLS streams' payload, MiB.
  uint64_t rates_fp8_mb = 256;
  uint64_t rates_tls_mb = 1024;
  // Only measure those rates and print the projection: no fleet, no loopback stream.
  bool projection_only = false;
};

// Runs the benchmark and prints its tables to `out`; progress goes to stderr. Fails when
// the options are unusable, the machine lacks the memory for the fleet (checked up front,
// naming the size needed), a role fails to start or exits early (naming it and the tail
// of its log), an update times out, or a worker serves wrong weights. Missed performance
// targets are printed as FAIL but do not fail the run. Every started process is stopped
// (and reaped) on every way out.
Status RunFleetBench(const FleetBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
