// The paper-scale projection of `flywheel bench fleet` (bench/fleet_projection.h): its
// stages follow from the rates and assumptions by the stated arithmetic, a wrong rate
// changes the result, and this machine's run is predicted by the same model.
#include "bench/fleet_projection.h"

#include <gtest/gtest.h>

namespace flywheel::bench {
namespace {

MeasuredRates Rates() {
  MeasuredRates rates;
  rates.encode_words_per_second = 0.5e9;  // per thread
  rates.apply_words_per_second = 1e9;
  rates.tls_send_bytes_per_second = 2e9;  // per core
  rates.tls_receive_bytes_per_second = 4e9;
  rates.relay_forward_bytes_per_second = 1e9;
  rates.bits_per_changed_word = 8;  // one byte per changed word
  return rates;
}

ProjectionAssumptions Small() {
  ProjectionAssumptions assume;
  assume.checkpoint_words = 64e9;
  assume.changed_fraction = 0.25;     // 16e9 changed words: a 16 GB delta
  assume.wan_bits_per_second = 80e9;  // 10 GB/s
  assume.lan_bits_per_second = 800e9;  // 100 GB/s
  assume.rtt_seconds = 0.1;
  assume.trainer_cores = 64;
  assume.worker_cores = 32;
  assume.relay_cores = 2;
  assume.fan_out = 4;
  assume.streams = 1;  // one data connection per download (StreamsSpreadTheStrands: 4)
  assume.tree_levels = 1;
  assume.piece_bytes = 16e6;        // 1/1000 of the delta
  assume.encode_chunk_words = 1e6;  // 2 ms at 0.5 G words/s
  return assume;
}

TEST(FleetProjectionTest, StagesFollowFromRatesAndAssumptions) {
  const ProjectionAssumptions assume = Small();
  const Projection p = ProjectSeedsCase(Rates(), assume);
  EXPECT_DOUBLE_EQ(p.delta_bytes, 16e9);
  ASSERT_EQ(p.stages.size(), 6u);  // encode, WAN, 2 relay levels, receive, apply
  EXPECT_DOUBLE_EQ(p.stages[0].seconds, 64e9 / (0.5e9 * 64));  // 2 s
  EXPECT_DOUBLE_EQ(p.stages[0].fill_seconds, 1e6 / 0.5e9);
  // One TLS stream per link: 8 s at 2 GB/s, not the link's 1.6 s.
  EXPECT_DOUBLE_EQ(p.stages[1].seconds, 16e9 / 2e9);
  // Relay: max((16 GB / 1 GB/s forward + 3 x 16 GB / 2 GB/s) / min(4, 2) cores, one
  // strand's 8 s, 4 x 16 GB / NIC 0.64 s).
  EXPECT_DOUBLE_EQ(p.stages[2].seconds, 20.0);
  EXPECT_DOUBLE_EQ(p.stages[3].seconds, 20.0);
  EXPECT_DOUBLE_EQ(p.stages[4].seconds, 16e9 / 4e9);  // receive+open 4 GB/s
  EXPECT_DOUBLE_EQ(p.stages[5].seconds, 64e9 / (1e9 * 32));  // 2 s, after the last piece
  EXPECT_FALSE(p.stages[5].streamed);
  EXPECT_NEAR(p.store_and_forward_seconds, 2 + 8 + 20 + 20 + 4 + 2 + 0.1, 1e-9);
  // Buffered: encode, the slowest hop, the other hops' fill, RTT, apply.
  EXPECT_NEAR(p.buffered_seconds, 2 + 20 + (0.008 + 0.020 + 0.004) + 0.1 + 2, 1e-9);
  // Streamed: the slowest stage, each other streamed stage's fill, RTT, then the apply.
  EXPECT_NEAR(p.streamed_seconds, 20 + (0.002 + 0.008 + 0.020 + 0.004) + 0.1 + 2, 1e-9);
  EXPECT_EQ(p.slowest, p.stages[2].name);
  EXPECT_NEAR(p.apply_overlapped_seconds, 20 + (0.002 + 0.008 + 0.020 + 0.004 + 0.001) + 0.1, 1e-9);
  // In one datacenter: the same stages (the one TLS stream still paces the first hop), no RTT.
  EXPECT_NEAR(p.in_region_seconds, 20 + 0.034 + 2, 1e-9);
  const Table table = ProjectionTable(p, assume);
  EXPECT_EQ(table.rows.size(), p.stages.size() + 6);
}

TEST(FleetProjectionTest, StreamsSpreadTheStrands) {
  ProjectionAssumptions assume = Small();
  assume.streams = 4;
  assume.relay_cores = 64;
  const Projection p = ProjectSeedsCase(Rates(), assume);
  // WAN: max(16 GB / 10 GB/s, 16 GB / (4 x 2 GB/s)) = 2 s, not one stream's 8 s.
  EXPECT_DOUBLE_EQ(p.stages[1].seconds, 2.0);
  // Relay: (16 / 1 + 3 x 16 / 2) / min(4 x 4, 64) cores = 2.5 s; strands 16 / 8 = 2 s.
  EXPECT_DOUBLE_EQ(p.stages[2].seconds, 2.5);
  // Receive: 16 GB / (4 x 4 GB/s) = 1 s.
  EXPECT_DOUBLE_EQ(p.stages[4].seconds, 1.0);
  // Two relay cores: min(16, 2) = 2 cores, as with one stream.
  assume.relay_cores = 2;
  EXPECT_DOUBLE_EQ(ProjectSeedsCase(Rates(), assume).stages[2].seconds, 20.0);
}

TEST(FleetProjectionTest, APlantedWrongRateChangesTheResult) {
  const ProjectionAssumptions assume = Small();
  const double right = ProjectSeedsCase(Rates(), assume).streamed_seconds;
  MeasuredRates slow_forward = Rates();
  slow_forward.relay_forward_bytes_per_second = 0.5e9;  // (32 + 24) / 2 = 28 s per level
  const Projection slow = ProjectSeedsCase(slow_forward, assume);
  EXPECT_NEAR(slow.streamed_seconds, 28 + (0.002 + 0.008 + 0.028 + 0.004) + 0.1 + 2, 1e-9);
  EXPECT_GT(slow.streamed_seconds, right + 7.9);
  // More relay cores: the egress spreads over min(fan-out, cores); forward no longer paces.
  MeasuredRates fast_forward = Rates();
  fast_forward.relay_forward_bytes_per_second = 8e9;
  ProjectionAssumptions cores = assume;
  cores.relay_cores = 64;  // min(4, 64) = 4 cores: (2 + 24) / 4 = 6.5 s, under a strand's 8 s
  EXPECT_DOUBLE_EQ(ProjectSeedsCase(fast_forward, cores).stages[2].seconds, 8.0);
  EXPECT_DOUBLE_EQ(ProjectSeedsCase(fast_forward, assume).stages[2].seconds, 13.0);
  // A denser code: more delta bytes on every hop.
  MeasuredRates dense = Rates();
  dense.bits_per_changed_word = 4;
  EXPECT_DOUBLE_EQ(ProjectSeedsCase(dense, assume).delta_bytes, 8e9);
  EXPECT_LT(ProjectSeedsCase(dense, assume).streamed_seconds, right);
  // A slow apply on the workers adds to the streamed time one for one.
  MeasuredRates slow_apply = Rates();
  slow_apply.apply_words_per_second = 0.5e9;
  EXPECT_NEAR(ProjectSeedsCase(slow_apply, assume).streamed_seconds, right + 2, 1e-9);
}

TEST(FleetProjectionTest, WhatTheGoalAsksOfTheCodec) {
  ProjectionAssumptions assume = Small();
  assume.goal_seconds = 25;
  const GoalRates goal = RatesForGoal(ProjectSeedsCase(Rates(), assume), assume);
  ASSERT_TRUE(goal.reachable);
  EXPECT_DOUBLE_EQ(goal.slowest_hop_seconds, 20.0);  // the relay levels
  EXPECT_DOUBLE_EQ(goal.encode_words_per_second, 64e9 / (64 * 20.0));
  // 25 s - 20 s - the other stages' fill (0.002 + 0.008 + 0.020 + 0.004) - 0.1 s RTT.
  EXPECT_NEAR(goal.apply_words_per_second, 64e9 / (32 * (25 - 20 - 0.034 - 0.1)), 1e3);
  MeasuredRates met = Rates();
  met.apply_words_per_second = goal.apply_words_per_second;
  EXPECT_NEAR(ProjectSeedsCase(met, assume).streamed_seconds, 25.0, 1e-9);
  assume.goal_seconds = 20;  // the relay levels alone take it
  EXPECT_FALSE(RatesForGoal(ProjectSeedsCase(Rates(), assume), assume).reachable);
}

TEST(FleetProjectionTest, TheSeedsCaseDefaults) {
  const ProjectionAssumptions assume;
  EXPECT_DOUBLE_EQ(assume.checkpoint_words, 1099511627776.0);  // 1 TiB of FP8
  EXPECT_DOUBLE_EQ(assume.changed_fraction, 0.02);
  EXPECT_DOUBLE_EQ(assume.wan_bits_per_second, 10e9);
  EXPECT_DOUBLE_EQ(assume.lan_bits_per_second, 100e9);
  EXPECT_EQ(assume.trainer_cores, 64);
  EXPECT_EQ(assume.worker_cores, 64);
  EXPECT_EQ(assume.fan_out, 8);
  EXPECT_EQ(assume.streams, 4);  // UpstreamOptions::streams, `--streams`
  MeasuredRates rates = Rates();
  rates.tls_send_bytes_per_second = 4e9;  // faster than the 1.25 GB/s link
  const Projection p = ProjectSeedsCase(rates, assume);
  // 2% of 2^40 words at one byte each: about 22 GB of delta, 17.6 s on 10 Gbit/s.
  EXPECT_NEAR(p.delta_bytes, 21.99e9, 0.01e9);
  EXPECT_NEAR(p.stages[1].seconds, 17.59, 0.01);
  EXPECT_EQ(ProjectionAssumptionLines(rates, assume).size(), 7u);
}

TEST(FleetProjectionTest, PredictsThisMachinesRunFromTheSameStages) {
  LocalFleet fleet;
  fleet.words = 1e9;
  fleet.delta_bytes = 1e7;
  fleet.wan_bytes_per_second = 1.25e8;
  fleet.rtt_seconds = 0.08;
  fleet.regions = 2;
  fleet.workers_per_region = 4;
  fleet.cores = 2;
  fleet.relay_threads = 2;
  const LocalPrediction p = PredictLocalFleet(Rates(), fleet);
  ASSERT_EQ(p.stages.size(), 5u);
  EXPECT_DOUBLE_EQ(p.stages[0].seconds, 2.0);   // 1e9 words at 0.5e9 on one thread
  EXPECT_DOUBLE_EQ(p.stages[1].seconds, 0.08);  // 10 MB at 125 MB/s
  EXPECT_DOUBLE_EQ(p.stages[2].seconds, (0.01 + 3 * 0.005) / 2);
  EXPECT_DOUBLE_EQ(p.stages[4].seconds, 1.0);
  // Streamed CPU: 2 + 2 x 0.005 + 2 x 0.025 + 8 x 0.0025 = 2.08 s (1.04 s on 2 cores, under
  // the 2 s encode); the 8 applies: 8 s of CPU on 2 cores.
  EXPECT_NEAR(p.cpu_seconds, 2.08 + 8, 1e-9);
  EXPECT_DOUBLE_EQ(p.stream_seconds, 2.0);
  EXPECT_DOUBLE_EQ(p.apply_seconds, 4.0);
  const double share = double(1 << 20) / 1e7;
  EXPECT_NEAR(p.seconds, 2 + (0.08 + 0.0125 + 0.0025) * share + 0.08 + 4, 1e-9);
  fleet.cores = 16;  // the contention gone: one apply after the stream
  EXPECT_NEAR(PredictLocalFleet(Rates(), fleet).apply_seconds, 1.0, 1e-9);
}

}  // namespace
}  // namespace flywheel::bench
