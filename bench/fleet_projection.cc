#include "bench/fleet_projection.h"

#include <algorithm>
#include <cmath>

namespace flywheel::bench {
namespace {

std::string Gb(double bytes) { return Fixed(bytes / 1e9, 1) + " GB"; }
std::string Rate(double bytes_per_second) { return Fixed(bytes_per_second / 1e9, 2) + " GB/s"; }

}  // namespace

Projection ProjectSeedsCase(const MeasuredRates& rates, const ProjectionAssumptions& assume) {
  Projection p;
  const double changed = assume.checkpoint_words * assume.changed_fraction;
  p.delta_bytes = changed * rates.bits_per_changed_word / 8;
  // A stage that goes over every word of the checkpoint on `cores` threads.
  auto per_word = [&](const std::string& name, double words_per_second, int cores) {
    return ProjectionStage{name,
                           Fixed(assume.checkpoint_words / 1e12, 2) + " T words at " +
                               Fixed(words_per_second / 1e9, 2) + " G words/s/thread x " +
                               std::to_string(cores) + " cores",
                           assume.checkpoint_words / (words_per_second * cores)};
  };
  p.stages.push_back(
      per_word("encode (publisher)", rates.encode_words_per_second, assume.trainer_cores));
  const double wan_rate = assume.wan_bits_per_second / 8;
  p.stages.push_back({"WAN to the region's relay",
                      Gb(p.delta_bytes) + " at " + Fixed(assume.wan_bits_per_second / 1e9, 0) +
                          " Gbit/s",
                      p.delta_bytes / wan_rate});
  const double egress = rates.tls_bytes_per_second * assume.relay_cores;
  for (int level = 1; level <= assume.tree_levels + 1; ++level) {
    p.stages.push_back({"relay level " + std::to_string(level) + " fan-out",
                        std::to_string(assume.fan_out) + " x " + Gb(p.delta_bytes) +
                            " over TLS at " + Rate(rates.tls_bytes_per_second) + " x " +
                            std::to_string(assume.relay_cores) + " core(s)",
                        assume.fan_out * p.delta_bytes / egress});
  }
  p.stages.push_back(per_word("apply (worker)", rates.apply_words_per_second, assume.worker_cores));
  double slowest = 0;
  for (const ProjectionStage& stage : p.stages) {
    p.store_and_forward_seconds += stage.seconds;
    slowest = std::max(slowest, stage.seconds);
  }
  p.store_and_forward_seconds += assume.rtt_seconds;
  double slowest_hop = 0;  // the stages between the encode (first) and the apply (last)
  for (size_t i = 1; i + 1 < p.stages.size(); ++i) slowest_hop = std::max(slowest_hop, p.stages[i].seconds);
  p.cut_through_seconds =
      p.stages.front().seconds + slowest_hop + p.stages.back().seconds + assume.rtt_seconds;
  // Streamed, every hop forwards a piece as soon as it has it: the slowest stage sets the
  // pace, and each other stage adds the time it takes for one piece.
  const double piece_share = p.delta_bytes > 0 ? assume.piece_bytes / p.delta_bytes : 0;
  p.streamed_seconds = slowest + assume.rtt_seconds;
  for (const ProjectionStage& stage : p.stages) {
    if (stage.seconds < slowest) p.streamed_seconds += stage.seconds * piece_share;
  }
  p.streamed_core_per_child_seconds = p.streamed_seconds;
  if (assume.relay_cores < assume.fan_out) {
    ProjectionAssumptions parallel = assume;
    parallel.relay_cores = assume.fan_out;
    p.streamed_core_per_child_seconds = ProjectSeedsCase(rates, parallel).streamed_seconds;
  }
  return p;
}

Table ProjectionTable(const Projection& projection, const ProjectionAssumptions& assume) {
  Table table;
  table.header = {"stage", "from", "seconds"};
  for (const ProjectionStage& stage : projection.stages) {
    table.rows.push_back({stage.name, stage.basis, Fixed(stage.seconds, 2)});
  }
  table.rows.push_back({"publish -> all workers, stages one after another", "sum + RTT",
                        Fixed(projection.store_and_forward_seconds, 2)});
  table.rows.push_back({"publish -> all workers, buffered publish (--buffered-deltas): encode, then transfer cut through the relays, then apply",
                        "encode + slowest hop + apply + RTT",
                        Fixed(projection.cut_through_seconds, 2)});
  table.rows.push_back({"publish -> all workers, streamed through every hop (flywheel's default)",
                        "slowest stage + RTT + a piece per other hop",
                        Fixed(projection.streamed_seconds, 2)});
  table.rows.push_back({"the same, relays serving each child from its own core (not built)",
                        "today a relay serves its children from one thread",
                        Fixed(projection.streamed_core_per_child_seconds, 2)});
  table.rows.push_back({"goal", "the seeds report < 60 s", Fixed(assume.goal_seconds, 2)});
  return table;
}

std::vector<std::string> ProjectionAssumptionLines(const MeasuredRates& rates,
                                                   const ProjectionAssumptions& assume) {
  return {
      "checkpoint: " + Fixed(assume.checkpoint_words / std::pow(2.0, 40), 2) +
          " Ti words of FP8 (1 byte each), " + Fixed(assume.changed_fraction * 100, 1) +
          "% changed per step",
      "delta: " + Fixed(rates.bits_per_changed_word, 2) +
          " bits per changed word, as this run's bf16 deltas measured",
      "encode and apply cost per word as this run measured on bf16 (one thread per role), "
      "scaled to " + std::to_string(assume.trainer_cores) + " trainer cores and " +
          std::to_string(assume.worker_cores) + " cores per rollout host; every role of this "
          "run shares this machine's cores, so a crowded run (many workers) projects "
          "pessimistically",
      "WAN: one " + Fixed(assume.wan_bits_per_second / 1e9, 0) +
          " Gbit/s link per region, RTT " + Fixed(assume.rtt_seconds * 1000, 0) + " ms",
      "relays: fan-out " + std::to_string(assume.fan_out) + ", " +
          std::to_string(assume.tree_levels) + " levels below the region's relay (" +
          std::to_string(static_cast<int>(std::pow(assume.fan_out, assume.tree_levels + 1))) +
          " workers per region), each relay serving its children from " +
          std::to_string(assume.relay_cores) + " core(s) at this run's one-stream TLS rate; "
          "NICs inside a region are assumed faster than that",
  };
}

}  // namespace flywheel::bench
