// `flywheel bench rollout`: runs rollout::RunRolloutBench (bench/rollout_measure.h), prints
// its tables with ratios and checks, and optionally writes a "## Rollout benchmark" section.
#pragma once

#include <ostream>
#include <string>

#include "base/status.h"
#include "bench/rollout_measure.h"

namespace flywheel::bench {

struct RolloutReportOptions {
  rollout::RolloutBenchOptions bench;
  std::string markdown_out;
};

Status RunRolloutReport(const RolloutReportOptions& options, std::ostream& out);

}  // namespace flywheel::bench
