// The pipeline benchmark (`flywheel bench pipeline`): the same pipeline-RL run on a local
// fleet (pipeline/demo.h), asynchronous (max_staleness k) and synchronous (0: generate,
// then train), each until the accuracy target or the time limit; then both again with the
// trainer and the rollout side pinned to disjoint CPUs (the trainer on the first, relays
// and workers on the others: what separate GPUs give a real fleet, where the trainer and
// the samplers do not take turns on the same cores). It compares RL samples per second and
// the time to the target for all four runs, and checks its own runs: each must take a step
// and stay inside its staleness bound.
#pragma once

#include <functional>
#include <ostream>
#include <string>

#include "base/status.h"
#include "pipeline/run_config.h"

namespace flywheel::bench {

struct PipelineBenchOptions {
  pipeline::RunConfig config;  // max_staleness 0 is taken as 2 for the async run
  std::string program;         // the flywheel binary the fleets run
  std::string run_dir;         // empty: pipeline::DefaultRunDir("bench-pipeline")
  std::string markdown;        // set: write the table as its "## Pipeline benchmark" section
  bool quiet = false;          // no per-step lines
  bool pinned = true;          // also run both modes with pinned roles (needs >= 2 CPUs)
  // Lines about fleet processes that did not stop cleanly; empty: written to `out`.
  std::function<void(const std::string&)> warn;
};

// Prints what runs, both runs' trainer lines (unless quiet), the table and the ratios to
// `out`. Fails when a run fails, or (Internal) when a run took no step or exceeded its
// staleness bound.
Status RunPipelineBench(const PipelineBenchOptions& options, std::ostream& out);

}  // namespace flywheel::bench
