// What a trainer run records: its progress in the state directory (so a restarted trainer
// resumes), one line per step on stdout, and at the end <report>/metrics.csv and
// <report>/summary.json (pipeline/run_record.h defines both).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "pipeline/coordinator.h"
#include "pipeline/run_config.h"
#include "pipeline/run_record.h"

namespace flywheel::rl {

// <state>/progress.json: {"version", "wall_s", "initial_accuracy", "warmup_accuracy",
// "last_accuracy", "time_to_target_s", "rows": [StepRow::ToJson(), ...]}, replaced
// atomically after every state_every steps together with the trainer's state.
struct RunProgress {
  uint64_t version = 0;  // the newest published version
  double wall_s = 0;     // wall time of the run before this process
  double initial_accuracy = -1;
  double warmup_accuracy = -1;
  double last_accuracy = -1;
  double time_to_target_s = -1;
  std::vector<pipeline::StepRow> rows;
};

// The progress saved at `path`; nullopt when there is none (a fresh run). Corruption
// naming the file when it is unreadable or a row is malformed.
Result<std::optional<RunProgress>> LoadProgress(const std::string& path);
Status SaveProgress(const std::string& path, const RunProgress& progress);

// The per-step line on stdout: step, version, wall time, reward, accuracy (the last
// measured one, marked "~" when not measured at this step), k3, staleness against the
// bound, delta density and bytes, WAN bytes and sync latency.
std::string StepLine(const pipeline::StepRow& row, int64_t max_staleness, double last_accuracy);

// The summary of a finished run: identity from the config, aggregates from the rows
// (RunSummary::AddRows), the coordinator's drop counters.
struct SummaryInputs {
  const pipeline::RunConfig* config = nullptr;
  int64_t parameters = 0;
  const RunProgress* progress = nullptr;
  bool reached_target = false;
  double wall_seconds = 0;
  pipeline::CoordinatorStats stats;
  bool resumed = false;
};
pipeline::RunSummary MakeRunSummary(const SummaryInputs& inputs);

// Writes <report_dir>/metrics.csv and <report_dir>/summary.json (atomically, each).
Status WriteRunReport(const std::string& report_dir, const std::vector<pipeline::StepRow>& rows,
                      const pipeline::RunSummary& summary);

}  // namespace flywheel::rl
