// `flywheel bench parity`: runs rollout::RunParityBench (bench/parity_measure.h), prints
// the table and checks k3 <= 1e-6 on the served weights (dense; MoE with routing replay).
#pragma once

#include <ostream>
#include <string>

#include "base/status.h"
#include "bench/parity_measure.h"

namespace flywheel::bench {

struct ParityReportOptions {
  rollout::ParityBenchOptions bench;
  std::string markdown_out;
};

Status RunParityReport(const ParityReportOptions& options, std::ostream& out);

}  // namespace flywheel::bench
