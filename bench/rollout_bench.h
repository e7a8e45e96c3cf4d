// `flywheel bench rollout`: runs rollout::RunRolloutBench (rollout/rollout_bench.h), prints
// its tables with ratios and checks, and optionally writes a "## Rollout benchmark" section.
#pragma once

#include <ostream>
#include <string>

#include "base/status.h"
#include "rollout/rollout_bench.h"

namespace flywheel::bench {

struct RolloutReportOptions {
  rollout::RolloutBenchOptions bench;
  std::string markdown_out;
};

Status RunRolloutReport(const RolloutReportOptions& options, std::ostream& out);

}  // namespace flywheel::bench
