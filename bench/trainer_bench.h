// `flywheel bench trainer`: runs trainer::RunTrainerBench (bench/trainer_measure.h), prints
// its tables with ratios, checks them, and optionally writes a "## Trainer benchmark"
// section into a Markdown file.
#pragma once

#include <ostream>
#include <string>

#include "base/status.h"
#include "bench/trainer_measure.h"

namespace flywheel::bench {

struct TrainerReportOptions {
  trainer::TrainerBenchOptions bench;
  std::string markdown_out;  // when set, the section is written there
};

// Fails when the run fails or a correctness check fails (fused and custom losses differ);
// a missed performance target is reported as FAIL in the table, not as an error.
Status RunTrainerReport(const TrainerReportOptions& options, std::ostream& out);

}  // namespace flywheel::bench
