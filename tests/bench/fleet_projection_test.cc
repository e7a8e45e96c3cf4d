// The paper-scale projection of `flywheel bench fleet` (bench/fleet_projection.h): its
// stages follow from the rates and assumptions by the stated arithmetic.
#include "bench/fleet_projection.h"

#include <gtest/gtest.h>

namespace flywheel::bench {
namespace {

MeasuredRates Rates() {
  MeasuredRates rates;
  rates.encode_words_per_second = 0.5e9;  // per thread
  rates.apply_words_per_second = 1e9;
  rates.tls_bytes_per_second = 2e9;
  rates.bits_per_changed_word = 8;  // one byte per changed word
  return rates;
}

TEST(FleetProjectionTest, StagesFollowFromRatesAndAssumptions) {
  ProjectionAssumptions assume;
  assume.checkpoint_words = 64e9;
  assume.changed_fraction = 0.25;  // 16e9 changed words: a 16 GB delta
  assume.wan_bits_per_second = 80e9;  // 10 GB/s
  assume.rtt_seconds = 0.1;
  assume.trainer_cores = 64;
  assume.worker_cores = 32;
  assume.fan_out = 4;
  assume.tree_levels = 1;
  assume.relay_cores = 2;
  assume.piece_bytes = 16e6;  // 1/1000 of the delta
  const Projection p = ProjectSeedsCase(Rates(), assume);
  EXPECT_DOUBLE_EQ(p.delta_bytes, 16e9);
  ASSERT_EQ(p.stages.size(), 5u);  // encode, WAN, 2 relay levels, apply
  EXPECT_DOUBLE_EQ(p.stages[0].seconds, 64e9 / (0.5e9 * 64));  // 2 s
  EXPECT_DOUBLE_EQ(p.stages[1].seconds, 16e9 / 10e9);          // 1.6 s
  EXPECT_DOUBLE_EQ(p.stages[2].seconds, 4 * 16e9 / (2e9 * 2));  // 16 s
  EXPECT_DOUBLE_EQ(p.stages[3].seconds, 16.0);
  EXPECT_DOUBLE_EQ(p.stages[4].seconds, 64e9 / (1e9 * 32));  // 2 s
  EXPECT_NEAR(p.store_and_forward_seconds, 2 + 1.6 + 16 + 16 + 2 + 0.1, 1e-9);
  // Today: encode, then the slowest hop paces the transfer, then apply.
  EXPECT_NEAR(p.cut_through_seconds, 2 + 16 + 2 + 0.1, 1e-9);
  // Streamed: the slowest stage (16 s), the RTT, and a thousandth of each faster stage.
  EXPECT_NEAR(p.streamed_seconds, 16 + 0.1 + (2 + 1.6 + 2) / 1000, 1e-9);
  const Table table = ProjectionTable(p, assume);
  EXPECT_EQ(table.rows.size(), p.stages.size() + 5);
  // With a core per child (4 per relay), each relay level takes 8 s: the slowest stage.
  EXPECT_NEAR(p.streamed_core_per_child_seconds, 8 + 0.1 + (2 + 1.6 + 2) / 1000, 1e-9);
}

TEST(FleetProjectionTest, TheSeedsCaseDefaults) {
  const ProjectionAssumptions assume;
  EXPECT_DOUBLE_EQ(assume.checkpoint_words, 1099511627776.0);  // 1 TiB of FP8
  EXPECT_DOUBLE_EQ(assume.changed_fraction, 0.02);
  EXPECT_DOUBLE_EQ(assume.wan_bits_per_second, 10e9);
  EXPECT_EQ(assume.trainer_cores, 64);
  EXPECT_EQ(assume.fan_out, 8);
  const Projection p = ProjectSeedsCase(Rates(), assume);
  // 2% of 2^40 words at one byte each: about 22 GB of delta, 17.6 s on 10 Gbit/s.
  EXPECT_NEAR(p.delta_bytes, 21.99e9, 0.01e9);
  EXPECT_NEAR(p.stages[1].seconds, 17.59, 0.01);
  EXPECT_EQ(ProjectionAssumptionLines(Rates(), assume).size(), 5u);
}

}  // namespace
}  // namespace flywheel::bench
