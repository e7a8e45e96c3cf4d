// Workers leaving and coming back: the status a leaving worker reports, and `flywheel bench
// churn` end to end at a small scale (40 worker processes, 3 publishes, a fifth of them
// killed and restarted every 3 s, alternately SIGKILL and SIGTERM). The bench checks its
// own results (bench/churn_bench.h): it fails on an unpublished hash, a worker that never
// serves a version, a role that dies, a relay that still lists a killed worker after 5 s,
// or a SIGTERMed worker that does not exit cleanly. Here the figures a clean leave promises
// are asserted on top; the 2 s serving target after a publish is the full benchmark's (a
// loaded CI machine runs this beside other tests), so only a loose bound is asserted there.
// A restarted worker serves the head within 2 s (p50; the max loosely): the publisher keeps
// a keyframe at the head (the bench's default --keyframe-every 1), so a join applies at
// most one delta after its keyframe (the head's keyframe may still be encoding), and the
// relays release older keyframes once a newer one is cached.
#include <gtest/gtest.h>

#include <sstream>

#include "bench/churn_bench.h"
#include "sync/role_status.h"

namespace flywheel {
namespace {

TEST(WorkerStatusState, JoiningServingLeaving) {
  sync::WorkerStatus status;
  EXPECT_EQ(sync::ToJson(status)["state"], "joining");
  EXPECT_EQ(sync::ToJson(status)["leaving"], false);
  status.common.version = 3;
  EXPECT_EQ(sync::ToJson(status)["state"], "serving");
  status.leaving = true;
  EXPECT_EQ(sync::ToJson(status)["state"], "leaving");
  EXPECT_EQ(sync::ToJson(status)["leaving"], true);
}

TEST(ChurnBench, FortyWorkersThreePublishesWithChurn) {
  bench::ChurnBenchOptions options;
  options.flywheel_binary = FLYWHEEL_BIN;
  options.workers = 40;
  options.relays = 4;
  options.publishes = 3;
  options.churn_percent = 20;
  options.publish_interval_seconds = 3;
  options.churn_period_seconds = 3;
  options.churn_offset_seconds = 1;
  options.checkpoint_bytes = 4ull << 20;
  options.give_up_seconds = 30;
  std::ostringstream out;
  Result<bench::ChurnBenchResult> result = bench::RunChurnBench(options, out);
  ASSERT_TRUE(result.ok()) << result.status().ToString() << "\n" << out.str();
  std::cout << out.str();
  EXPECT_EQ(result->foreign_hashes, 0u);
  EXPECT_GE(result->serve_samples, 3u * 30u);  // most of the 40 workers, each publish
  EXPECT_LT(result->serve_max_seconds, 10.0);
  // Churn ran: rounds after the first and second publishes, 8 workers each, half SIGTERM.
  EXPECT_GE(result->sigterms, 8u);
  EXPECT_GE(result->sigkills, 8u);
  EXPECT_EQ(result->restarts, result->sigterms + result->sigkills);
  // A clean leave: it said so, exited cleanly, and its relay forgot it at once.
  EXPECT_EQ(result->leaving_seen, result->sigterms);
  EXPECT_EQ(result->unclean_exits, 0u);
  EXPECT_LT(result->forget_sigterm_max_ms, 1000.0);
  EXPECT_GT(result->relay_fds_max, 10u);  // each relay holds its workers' connections
  // Restart -> head: within the target at p50, and the joins took the head's keyframe.
  EXPECT_LE(result->restart_p50_seconds, options.serve_deadline_seconds);
  EXPECT_LT(result->restart_max_seconds, 10.0);
  EXPECT_GE(result->joins_timed, result->restarts / 2);
  EXPECT_LE(result->join_deltas_p50, 1.0);
  // A relay holds one keyframe (about 0.7x the bf16 bytes) and the deltas, not one keyframe
  // per restart round (3 publishes here, each a keyframe: that would be over 2x). While a
  // new keyframe arrives it holds two: the older is released only once the newer is whole
  // (sync/relay.cc, ReleaseOlderKeyframes), and the newer counts whole from its first piece.
  // The maximum is sampled, so a loaded machine's slower fetch shows that window: 1.48x was
  // measured in a CI run (1.3x was the bound before, which only a quick fetch met).
  EXPECT_GT(result->relay_cache_bytes_max, 0u);
  EXPECT_LT(result->relay_cache_bytes_max, options.checkpoint_bytes * 16 / 10);
}

}  // namespace
}  // namespace flywheel
