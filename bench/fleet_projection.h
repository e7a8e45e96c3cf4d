// The paper-scale projection `flywheel bench fleet` prints: the seeds' case (a 1 TiB FP8
// checkpoint, 2% of words changed per step, one 10 Gbit/s WAN link per region, hosts with
// 64 cores, a relay tree with fan-out 8), stage by stage, from per-word and per-byte rates
// each measured with its role alone on an idle core (bench/fleet_rates.h). Every
// assumption is a field with its default and is printed beside the figures.
//
// The pipeline as built (docs/ARCHITECTURE.md): the publisher streams the delta
// (delta::EncodeStreamed: each chunk goes out as soon as it is encoded), every relay
// forwards a piece as soon as it has it, each connection's TLS records are sealed in order
// on one strand (one core per connection), a download runs over `streams` data
// connections (UpstreamOptions::streams, `--streams`, 4), so a relay serves its children
// from min(fan-out x streams, relay cores) cores, and a worker applies the delta once its last piece is
// in (its decode-ahead keeps at most 256 MiB of decoded chunks: a rounding error at this
// scale, not modelled). So
//
//   streamed = max(streamed stages) + the fill of every other streamed stage + RTT + apply
//
// where a streamed stage is the encode, the WAN hop, each relay level and the workers'
// receive, and its fill is the time one piece (the encode: one chunk on one thread) takes
// at that stage's pace.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/util.h"

namespace flywheel::bench {

// The rates the projection scales. Per thread / per core, each measured alone.
struct MeasuredRates {
  double encode_words_per_second = 0;  // publisher: hash + encode (EncodeStreamed), 1 thread
  double apply_words_per_second = 0;   // worker: apply + verify (ApplyInPlace), 1 thread
  double tls_send_bytes_per_second = 0;     // TLS seal + send, per CPU-second of its thread
  double tls_receive_bytes_per_second = 0;  // TLS receive + open, per CPU-second
  double relay_forward_bytes_per_second = 0;  // receive + re-send, per CPU-second
  double bits_per_changed_word = 0;           // a real encode: 8 x delta bytes / changed words
};

struct ProjectionAssumptions {
  double checkpoint_words = 1099511627776.0;  // 1 TiB of FP8 (one byte per word)
  double changed_fraction = 0.02;
  double wan_bits_per_second = 10e9;   // one link per region
  double lan_bits_per_second = 100e9;  // each host's NIC inside a region (relays, workers)
  double rtt_seconds = 0.08;           // one WAN round trip (the worker's request)
  int trainer_cores = 64;              // encode threads on the trainer host
  int worker_cores = 64;               // apply threads on a rollout host
  int relay_cores = 64;                // a relay's --egress-threads (default: its cores)
  int fan_out = 8;                     // children per relay
  int streams = 4;                     // data connections per download (--streams), a strand each
  int tree_levels = 1;                 // relay levels below the region's relay
  double piece_bytes = 1 << 20;        // the unit that moves hop to hop
  double encode_chunk_words = 4 << 20;  // EncodeOptions::chunk_bytes of 1-byte words
  double goal_seconds = 25;
};

struct ProjectionStage {
  std::string name;
  std::string basis;  // how the figure follows from the rates and assumptions
  double seconds = 0;
  double fill_seconds = 0;  // one piece (one chunk for the encode) at this stage's pace
  bool streamed = true;     // false: runs after the last piece (the apply)
};

struct Projection {
  double delta_bytes = 0;
  std::vector<ProjectionStage> stages;  // encode, WAN, each relay level, receive, apply
  double store_and_forward_seconds = 0;  // the stages one after another + RTT
  // --buffered-deltas: the encode, then the transfer cut through the relays, then apply.
  double buffered_seconds = 0;
  // The pipeline as built (the header's formula); `slowest` names its pacing stage.
  double streamed_seconds = 0;
  std::string slowest;
  // Not built: the worker applying chunks while the delta arrives (no decode-ahead budget):
  // the apply becomes one more streamed stage.
  double apply_overlapped_seconds = 0;
  // The same pipeline as built with the publisher in the workers' datacenter: every hop,
  // the publisher's included, at the LAN rate (set beside RDMA peers' figures).
  double in_region_seconds = 0;
};

Projection ProjectSeedsCase(const MeasuredRates& rates, const ProjectionAssumptions& assume);
Table ProjectionTable(const Projection& projection, const ProjectionAssumptions& assume);
std::vector<std::string> ProjectionAssumptionLines(const MeasuredRates& rates,
                                                   const ProjectionAssumptions& assume);
// The streamed pipeline's formula, as printed.
std::string StreamedFormula();

// What the goal asks of the codec with the measured hops as they are: an encode no slower
// than the slowest hop (so that it does not pace the stream) and an apply that fits in what
// is left after the slowest hop, the other stages' fill and the RTT. Unreachable when the
// hops alone take the goal.
struct GoalRates {
  bool reachable = false;
  double slowest_hop_seconds = 0;
  double encode_words_per_second = 0;  // per thread, at least
  double apply_words_per_second = 0;   // per thread, at least
};
GoalRates RatesForGoal(const Projection& projection, const ProjectionAssumptions& assume);

// This machine's fleet run predicted by the same stage model (the end-to-end check of the
// model): every role one thread (the roles' --threads default), the relays' egress on
// min(children, relay_threads) cores, all of them sharing `cores` CPUs.
struct LocalFleet {
  double words = 0;        // checkpoint words of the run (bf16)
  double delta_bytes = 0;  // the run's median delta artifact
  double wan_bytes_per_second = 0;
  double rtt_seconds = 0;
  int regions = 0;  // each with one relay
  int workers_per_region = 0;
  int cores = 0;
  int relay_threads = 1;
};

struct LocalPrediction {
  std::vector<ProjectionStage> stages;  // as Projection's, for one update of the run
  double cpu_seconds = 0;    // every role's CPU work for the update together
  double stream_seconds = 0;  // the streamed part: max(slowest stage, streamed CPU / cores)
  double apply_seconds = 0;   // the workers' applies: max(one apply, all applies / cores)
  double seconds = 0;         // stream + fills + RTT + apply
  std::string formula;
};

LocalPrediction PredictLocalFleet(const MeasuredRates& rates, const LocalFleet& fleet);

}  // namespace flywheel::bench
