#include "bench/fleet_projection.h"

#include <algorithm>
#include <cmath>

namespace flywheel::bench {
namespace {

std::string Gb(double bytes) { return Fixed(bytes / 1e9, 1) + " GB"; }
std::string Rate(double bytes_per_second) { return Fixed(bytes_per_second / 1e9, 2) + " GB/s"; }
std::string Gbit(double bits_per_second) { return Fixed(bits_per_second / 1e9, 0) + " Gbit/s"; }

// A stage over every word of the checkpoint on `cores` threads.
ProjectionStage PerWord(const std::string& name, double words, double words_per_second, int cores,
                        double chunk_words) {
  return {name,
          Fixed(words / 1e12, 2) + " T words / (" + Fixed(words_per_second / 1e9, 2) +
              " G words/s/thread x " + std::to_string(cores) + " cores)",
          words / (words_per_second * cores), chunk_words / words_per_second};
}

std::string Streams(int streams) {
  return streams == 1 ? "one stream's" : std::to_string(streams) + " streams'";
}

// The hop from the publisher to the region's relay: the relay's download over `streams`
// TLS connections (a strand, one core, each) over the link.
ProjectionStage WanHop(const MeasuredRates& rates, double delta_bytes, double link_bits,
                       int streams, double piece_share, const std::string& name) {
  const double seconds = std::max(delta_bytes / (link_bits / 8),
                                  delta_bytes / (streams * rates.tls_send_bytes_per_second));
  return {name,
          "max(" + Gb(delta_bytes) + " / " + Gbit(link_bits) + ", / " + Streams(streams) +
              " TLS seal+send " + Rate(rates.tls_send_bytes_per_second) + " each)",
          seconds, seconds * piece_share};
}

// One relay level: it receives the delta once and sends it to each of its children. Its
// CPU per level is one forward (receive + re-send, measured as one) and fan_out - 1 more
// seal+sends, spread over min(fan_out x streams, relay cores) egress cores (each child
// downloads over `streams` connections, a strand each); no download is faster than its
// strands (D / (streams x seal+send) to a child, D / (streams x receive+open) from
// upstream); all of its children share its NIC.
ProjectionStage RelayLevel(const MeasuredRates& rates, const ProjectionAssumptions& assume,
                           double delta_bytes, double piece_share, int level) {
  const int streams = std::max(1, assume.streams);
  const int cores = std::max(1, std::min(assume.fan_out * streams, assume.relay_cores));
  const double d = delta_bytes;
  const double cpu = (d / rates.relay_forward_bytes_per_second +
                      (assume.fan_out - 1) * d / rates.tls_send_bytes_per_second) /
                     cores;
  const double strand = std::max(d / (streams * rates.tls_send_bytes_per_second),
                                 d / (streams * rates.tls_receive_bytes_per_second));
  const double nic = assume.fan_out * d / (assume.lan_bits_per_second / 8);
  const double seconds = std::max({cpu, strand, nic});
  const std::string f = std::to_string(assume.fan_out);
  return {"relay level " + std::to_string(level) + " (fan-out " + f + ")",
          "max((D / forward " + Rate(rates.relay_forward_bytes_per_second) + " + " +
              std::to_string(assume.fan_out - 1) + " x D / seal+send " +
              Rate(rates.tls_send_bytes_per_second) + ") / min(" + f + " x " +
              std::to_string(streams) + ", " + std::to_string(assume.relay_cores) +
              ") cores, D / " + std::to_string(streams) + " strands, " + f +
              " x D / NIC " + Gbit(assume.lan_bits_per_second) + ")",
          seconds, seconds * piece_share};
}

ProjectionStage WorkerReceive(const MeasuredRates& rates, const ProjectionAssumptions& assume,
                              double delta_bytes, double piece_share) {
  const int streams = std::max(1, assume.streams);
  const double seconds = std::max(delta_bytes / (streams * rates.tls_receive_bytes_per_second),
                                  delta_bytes / (assume.lan_bits_per_second / 8));
  return {"worker receive",
          "max(D / " + Streams(streams) + " TLS receive+open " +
              Rate(rates.tls_receive_bytes_per_second) + " each, D / NIC " +
              Gbit(assume.lan_bits_per_second) + ")",
          seconds, seconds * piece_share};
}

// max(streamed stages) + the other streamed stages' fill + RTT + the stages after the last
// piece; `slowest` gets the pacing stage's name.
double Streamed(const std::vector<ProjectionStage>& stages, double rtt, std::string* slowest) {
  size_t pace = stages.size();
  for (size_t i = 0; i < stages.size(); ++i) {
    if (stages[i].streamed && (pace == stages.size() || stages[i].seconds > stages[pace].seconds))
      pace = i;
  }
  double total = rtt;
  for (size_t i = 0; i < stages.size(); ++i) {
    if (!stages[i].streamed) {
      total += stages[i].seconds;
    } else {
      total += i == pace ? stages[i].seconds : stages[i].fill_seconds;
    }
  }
  if (slowest != nullptr && pace < stages.size()) *slowest = stages[pace].name;
  return total;
}

std::vector<ProjectionStage> SeedsStages(const MeasuredRates& rates,
                                         const ProjectionAssumptions& assume, double delta_bytes) {
  const double piece_share = delta_bytes > 0 ? assume.piece_bytes / delta_bytes : 0;
  std::vector<ProjectionStage> stages;
  stages.push_back(PerWord("encode (publisher)", assume.checkpoint_words,
                           rates.encode_words_per_second, assume.trainer_cores,
                           assume.encode_chunk_words));
  stages.push_back(WanHop(rates, delta_bytes, assume.wan_bits_per_second,
                          std::max(1, assume.streams), piece_share,
                          "publisher -> region's relay (WAN)"));
  for (int level = 1; level <= assume.tree_levels + 1; ++level)
    stages.push_back(RelayLevel(rates, assume, delta_bytes, piece_share, level));
  stages.push_back(WorkerReceive(rates, assume, delta_bytes, piece_share));
  ProjectionStage apply = PerWord("apply (worker, after the last piece)", assume.checkpoint_words,
                                  rates.apply_words_per_second, assume.worker_cores,
                                  assume.encode_chunk_words);
  apply.streamed = false;
  stages.push_back(apply);
  return stages;
}

}  // namespace

std::string StreamedFormula() {
  return "streamed = max(encode, WAN hop, relay levels, worker receive) + the fill of each "
         "other of them (one piece, or one encoded chunk, at its pace) + RTT + apply (after the "
         "last piece)";
}

Projection ProjectSeedsCase(const MeasuredRates& rates, const ProjectionAssumptions& assume) {
  Projection p;
  const double changed = assume.checkpoint_words * assume.changed_fraction;
  p.delta_bytes = changed * rates.bits_per_changed_word / 8;
  p.stages = SeedsStages(rates, assume, p.delta_bytes);
  double slowest_hop = 0, hop_fills = 0, slowest_hop_fill = 0;
  for (const ProjectionStage& stage : p.stages) {
    p.store_and_forward_seconds += stage.seconds;
    const bool hop = stage.streamed && &stage != &p.stages.front();
    if (hop) hop_fills += stage.fill_seconds;
    if (hop && stage.seconds > slowest_hop) {
      slowest_hop = stage.seconds;
      slowest_hop_fill = stage.fill_seconds;
    }
  }
  p.store_and_forward_seconds += assume.rtt_seconds;
  p.buffered_seconds = p.stages.front().seconds + slowest_hop + (hop_fills - slowest_hop_fill) +
                       assume.rtt_seconds + p.stages.back().seconds;
  p.streamed_seconds = Streamed(p.stages, assume.rtt_seconds, &p.slowest);
  std::vector<ProjectionStage> overlapped = p.stages;
  overlapped.back().streamed = true;
  p.apply_overlapped_seconds = Streamed(overlapped, assume.rtt_seconds, nullptr);
  ProjectionAssumptions in_region = assume;
  in_region.wan_bits_per_second = assume.lan_bits_per_second;
  in_region.rtt_seconds = 0;  // a datacenter's round trip is below the table's precision
  p.in_region_seconds =
      Streamed(SeedsStages(rates, in_region, p.delta_bytes), in_region.rtt_seconds, nullptr);
  return p;
}

GoalRates RatesForGoal(const Projection& projection, const ProjectionAssumptions& assume) {
  GoalRates goal;
  size_t slowest = 0;
  double fills = 0;
  for (size_t i = 1; i < projection.stages.size(); ++i) {
    const ProjectionStage& stage = projection.stages[i];
    if (!stage.streamed) continue;
    fills += stage.fill_seconds;
    if (slowest == 0 || stage.seconds > projection.stages[slowest].seconds) slowest = i;
  }
  if (slowest == 0) return goal;
  goal.slowest_hop_seconds = projection.stages[slowest].seconds;
  fills += projection.stages.front().fill_seconds - projection.stages[slowest].fill_seconds;
  const double left = assume.goal_seconds - goal.slowest_hop_seconds - fills - assume.rtt_seconds;
  goal.reachable = left > 0;
  goal.encode_words_per_second =
      assume.checkpoint_words / (assume.trainer_cores * goal.slowest_hop_seconds);
  if (goal.reachable)
    goal.apply_words_per_second = assume.checkpoint_words / (assume.worker_cores * left);
  return goal;
}

Table ProjectionTable(const Projection& projection, const ProjectionAssumptions& assume) {
  Table table;
  table.header = {"stage", "from", "seconds", "fill s"};
  for (const ProjectionStage& stage : projection.stages) {
    table.rows.push_back({stage.name, stage.basis, Fixed(stage.seconds, 2),
                          stage.streamed ? Fixed(stage.fill_seconds, 3) : "-"});
  }
  table.rows.push_back({"publish -> all workers, stages one after another", "sum + RTT",
                        Fixed(projection.store_and_forward_seconds, 2), ""});
  table.rows.push_back({"buffered publish (--buffered-deltas)",
                        "encode + slowest hop + other hops' fill + RTT + apply",
                        Fixed(projection.buffered_seconds, 2), ""});
  table.rows.push_back({"**streamed, as built (flywheel's default)**",
                        "max(streamed stages) + others' fill + RTT + apply; paced by " +
                            projection.slowest,
                        Fixed(projection.streamed_seconds, 2), ""});
  table.rows.push_back({"the same, apply overlapped with the arrival (not built)",
                        "apply as one more streamed stage",
                        Fixed(projection.apply_overlapped_seconds, 2), ""});
  table.rows.push_back({"in-region: as built, every hop at " + Gbit(assume.lan_bits_per_second),
                        "publisher in the workers' datacenter",
                        Fixed(projection.in_region_seconds, 2), ""});
  table.rows.push_back({"goal (streamed, as built)", "the seeds report < 60 s",
                        Fixed(assume.goal_seconds, 2) + " " +
                            PassFail(projection.streamed_seconds <= assume.goal_seconds),
                        ""});
  return table;
}

std::vector<std::string> ProjectionAssumptionLines(const MeasuredRates& rates,
                                                   const ProjectionAssumptions& assume) {
  const int workers = static_cast<int>(std::pow(assume.fan_out, assume.tree_levels + 1));
  return {
      "checkpoint: " + Fixed(assume.checkpoint_words / std::pow(2.0, 40), 2) +
          " Ti words of FP8 (1 byte each), " + Fixed(assume.changed_fraction * 100, 1) +
          "% changed per step",
      "delta: " + Fixed(rates.bits_per_changed_word, 2) +
          " bits per changed word, from a real encode (EncodeStreamed, the publisher's "
          "defaults) of a generated FP8 pair",
      "encode " + Fixed(rates.encode_words_per_second / 1e9, 3) + " and apply " +
          Fixed(rates.apply_words_per_second / 1e9, 3) +
          " G FP8 words/s per thread, each measured alone on one thread, scaled linearly to " +
          std::to_string(assume.trainer_cores) + " trainer cores and " +
          std::to_string(assume.worker_cores) +
          " cores per rollout host (memory bandwidth not modelled)",
      "TLS per core (one stream, bytes per CPU-second of the thread, measured alone): seal+send " +
          Rate(rates.tls_send_bytes_per_second) + ", receive+open " +
          Rate(rates.tls_receive_bytes_per_second) + ", relay forward (receive + re-send) " +
          Rate(rates.relay_forward_bytes_per_second),
      "WAN: one " + Gbit(assume.wan_bits_per_second) + " link per region, RTT " +
          Fixed(assume.rtt_seconds * 1000, 0) + " ms; every download over " +
          std::to_string(assume.streams) + " TLS streams (--streams), a strand each; hosts' NICs "
          "in a region " + Gbit(assume.lan_bits_per_second),
      "relays: fan-out " + std::to_string(assume.fan_out) + ", " +
          std::to_string(assume.tree_levels) + " level(s) below the region's relay (" +
          std::to_string(workers) + " workers per region), egress on min(fan-out x streams, " +
          std::to_string(assume.relay_cores) + " relay cores) cores (--egress-threads)",
      "pieces of " + Fixed(assume.piece_bytes / (1 << 20), 0) + " MiB hop to hop; encode chunks of " +
          Fixed(assume.encode_chunk_words / (1 << 20), 0) + " Mi words; " + StreamedFormula(),
  };
}

LocalPrediction PredictLocalFleet(const MeasuredRates& rates, const LocalFleet& fleet) {
  LocalPrediction p;
  const double d = fleet.delta_bytes;
  const double w = fleet.words;
  const double piece_share = d > 0 ? std::min(1.0, double(1 << 20) / d) : 0;
  const int children = fleet.workers_per_region;
  const int relay_cores = std::max(1, std::min({children, fleet.relay_threads, fleet.cores}));
  const double send = rates.tls_send_bytes_per_second, receive = rates.tls_receive_bytes_per_second,
               forward = rates.relay_forward_bytes_per_second;
  auto add = [&](const std::string& name, const std::string& basis, double seconds, bool streamed) {
    p.stages.push_back({name, basis, seconds, streamed ? seconds * piece_share : 0, streamed});
  };
  add("encode (publisher, 1 thread)", "W / encode", w / rates.encode_words_per_second, true);
  add("publisher -> relays (WAN)", "max(D / WAN rate, D / TLS seal+send)",
      std::max(d / fleet.wan_bytes_per_second, d / send), true);
  add("relay -> its workers", "max((D / forward + (children - 1) x D / seal+send) / " +
      std::to_string(relay_cores) + " cores, D / one strand)",
      std::max({(d / forward + (children - 1) * d / send) / relay_cores, d / send, d / receive}),
      true);
  add("worker receive", "D / receive+open", d / receive, true);
  add("worker apply (1 thread, after the last piece)", "W / apply", w / rates.apply_words_per_second,
      false);
  const double workers = double(fleet.regions) * children;
  const double stream_cpu = w / rates.encode_words_per_second + fleet.regions * d / send +
                            fleet.regions * (d / forward + (children - 1) * d / send) +
                            workers * d / receive;
  const double apply_cpu = workers * w / rates.apply_words_per_second;
  p.cpu_seconds = stream_cpu + apply_cpu;
  double slowest = 0, slowest_fill = 0, fills = 0;  // the pacing stage adds no fill
  for (const ProjectionStage& stage : p.stages) {
    if (!stage.streamed) continue;
    fills += stage.fill_seconds;
    if (stage.seconds > slowest) slowest = stage.seconds, slowest_fill = stage.fill_seconds;
  }
  fills -= slowest_fill;
  p.stream_seconds = std::max(slowest, stream_cpu / fleet.cores);
  p.apply_seconds = std::max(p.stages.back().seconds, apply_cpu / fleet.cores);
  p.seconds = p.stream_seconds + fills + fleet.rtt_seconds + p.apply_seconds;
  p.formula = "max(slowest streamed stage, streamed CPU of every role / " +
              std::to_string(fleet.cores) + " cores) + fills + RTT + max(one apply, " +
              Fixed(workers, 0) + " applies / " + std::to_string(fleet.cores) + " cores)";
  return p;
}

}  // namespace flywheel::bench
