// The churn benchmark (`flywheel bench churn`): a fleet of many small workers that keep
// dying and coming back while versions are published (issue 33, part 6).
//
// One machine runs a publisher, `relays` relays and `workers` model-less workers, each a
// separate process of the flywheel binary on loopback (a worker without --model holds only
// the checkpoint's bytes). Workers are spread over the relays round robin, one region per
// relay. The benchmark generates `publishes` + 1 consecutive bf16 checkpoints of a small
// transformer (bench/checkpoint_gen.h: AdamW steps, a few percent of the words change per
// step), drops the first and waits until every worker serves it, then drops one version
// every `publish_interval_seconds` while, every `churn_period_seconds`, `churn_percent` of
// the live workers are killed and started again at once: alternately SIGKILL (no goodbye:
// the kernel closes its sockets) and SIGTERM (a clean leave, sync/worker.h Worker::Stop).
//
// What it measures and checks, every worker polled at GET /v1/status throughout:
//   * after each publish, the time from the drop's COMMIT to each worker that was serving
//     the previous version at that moment (and not killed since) serving the new one
//     (its swap_unix_us): p50 / p99 / max against `serve_deadline_seconds`;
//   * every (version, weights_hash) any worker reports was published (0 foreign hashes);
//   * each restarted worker serves the head it started under within the deadline of its
//     start;
//   * a SIGTERMed worker says "leaving" in its status, exits cleanly, and its relay no
//     longer lists it (relay GET /v1/status "nodes"): the time from the signal; the same
//     time for SIGKILLed ones beside it;
//   * the relays' CPU time (utime + stime from /proc/<pid>/stat) over the churn phase, their
//     RSS and open file descriptors with every worker up.
// Correctness failures (a foreign hash, a worker that never serves a version, a relay that
// does not forget a killed worker, a role that dies) fail the run; missed time targets are
// printed as FAIL and counted in the result without failing it.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::bench {

struct ChurnBenchOptions {
  // The flywheel executable whose roles are started; empty: this process's own binary.
  std::string flywheel_binary;
  int workers = 200;
  int relays = 4;
  int publishes = 10;  // measured publishes after the initial version
  double churn_percent = 20;  // of the live workers, per churn round; 0: no churn
  double churn_period_seconds = 10;
  double publish_interval_seconds = 5;
  // When the first churn round happens after the first measured publish (then every
  // churn_period_seconds): 1 s lands the kills inside a publish's sync window.
  double churn_offset_seconds = 1;
  uint64_t checkpoint_bytes = 15ull << 20;  // bf16 data of the generated model
  double learning_rate = 1e-6;              // AdamW step size: a few % of words change
  // The publisher's --keyframe-every: 1 keeps a keyframe at the head, so a restarted
  // worker joins with it and applies no delta; 0: the publisher's default (10).
  uint64_t keyframe_every = 1;
  uint64_t seed = 1;
  int threads = 2;  // generating and hashing the checkpoints
  double serve_deadline_seconds = 2;
  // A worker that has not served a version (or a restarted one the head) after this long
  // fails the run.
  double give_up_seconds = 60;
  int poll_threads = 8;  // concurrent status requests of the poller
  std::string work_dir;  // default: a fresh one under $TMPDIR, removed unless `keep`
  bool keep = false;
  std::string json_out;  // when set, the results as JSON
};

// The figures of one run (also written with --json).
struct ChurnBenchResult {
  uint64_t nofile_limit = 0;  // RLIMIT_NOFILE soft limit after raising it to the hard one
  // Commit -> serving, over every (publish, worker) pair measured.
  double serve_p50_seconds = 0, serve_p99_seconds = 0, serve_max_seconds = 0;
  uint64_t serve_samples = 0;
  uint64_t serve_late = 0;  // pairs over serve_deadline_seconds
  uint64_t foreign_hashes = 0;
  uint64_t restarts = 0, sigterms = 0, sigkills = 0;
  double restart_p50_seconds = 0, restart_max_seconds = 0;
  uint64_t restart_late = 0;
  // Restarts whose worker reported its whole join timeline, and the deltas each applied
  // after its keyframe on the way to the head (p50 / max).
  uint64_t joins_timed = 0;
  double join_deltas_p50 = 0, join_deltas_max = 0;
  double forget_sigterm_max_ms = 0, forget_sigkill_max_ms = 0;
  uint64_t leaving_seen = 0;  // SIGTERMed workers whose status said "leaving"
  uint64_t unclean_exits = 0;  // SIGTERMed workers that did not exit 0 / by SIGTERM
  // The relays, with every worker up at the end of the run.
  double relay_cpu_percent_max = 0;  // of one core, over the churn phase
  uint64_t relay_rss_max_bytes = 0;
  uint64_t relay_fds_max = 0;
  // The most artifact bytes a relay held (its status' cache_bytes), sampled after every
  // churn round and at the end.
  uint64_t relay_cache_bytes_max = 0;
  bool meets_targets() const { return serve_late == 0 && restart_late == 0; }
};

// Runs the benchmark, printing its tables to `out` (progress to stderr). Fails on unusable
// options, a role that fails to start or dies, or a correctness failure (see above); every
// process started is stopped on every way out.
Result<ChurnBenchResult> RunChurnBench(const ChurnBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
