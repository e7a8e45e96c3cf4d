// The paper-scale projection `flywheel bench fleet` prints: the seeds' case (a 1 TiB FP8
// checkpoint, 2% of words changed per step, one 10 Gbit/s WAN link per region, trainer
// hosts with 64 cores, a relay tree with fan-out 8), stage by stage, from the per-word and
// per-byte rates the same run measured. Every assumption is a field with its default and
// is printed beside the figures.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/util.h"

namespace flywheel::bench {

// What the run measured (one thread per role, as the fleet bench starts them).
struct MeasuredRates {
  double encode_words_per_second = 0;  // publisher: validate + hash + encode + write, 1 thread
  double apply_words_per_second = 0;   // worker: apply + verify + swap, 1 thread
  double tls_bytes_per_second = 0;     // one TLS 1.3 stream, one core per side
  double bits_per_changed_word = 0;    // the run's deltas: 8 x bytes / changed words
};

struct ProjectionAssumptions {
  double checkpoint_words = 1099511627776.0;  // 1 TiB of FP8 (one byte per word)
  double changed_fraction = 0.02;
  double wan_bits_per_second = 10e9;          // one link per region
  double rtt_seconds = 0.08;                  // the run's emulated WAN round trip
  int trainer_cores = 64;                     // encode threads on the trainer host
  int worker_cores = 64;                      // apply threads on a rollout host
  int fan_out = 8;                            // children per relay
  int tree_levels = 1;                        // relay levels below the region's relay
  int relay_cores = 1;                        // threads a relay serves its children from
  double piece_bytes = 1 << 20;               // the unit that moves hop to hop
  double goal_seconds = 25;
};

struct ProjectionStage {
  std::string name;
  std::string basis;   // how the figure follows from the rates and assumptions
  double seconds = 0;
};

struct Projection {
  double delta_bytes = 0;
  std::vector<ProjectionStage> stages;  // encode, WAN, each relay level, apply
  double store_and_forward_seconds = 0;  // the stages one after another
  // Today's pipeline: the encode, then the transfer cut through every relay (each relay
  // forwards a piece once it has it: the slowest hop sets the pace), then the apply.
  double cut_through_seconds = 0;
  double streamed_seconds = 0;           // the slowest stage + RTT + one piece per hop
  // The same, were every relay to serve each child from a core of its own (today a relay
  // serves all its children from one thread, so its egress is one core's TLS rate).
  double streamed_core_per_child_seconds = 0;
};

Projection ProjectSeedsCase(const MeasuredRates& rates, const ProjectionAssumptions& assume);
Table ProjectionTable(const Projection& projection, const ProjectionAssumptions& assume);
std::vector<std::string> ProjectionAssumptionLines(const MeasuredRates& rates,
                                                   const ProjectionAssumptions& assume);

}  // namespace flywheel::bench
