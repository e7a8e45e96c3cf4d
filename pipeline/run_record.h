// The record of a pipeline-RL run, as the trainer writes it and the report, the CLI and the
// benchmarks read it. One definition of every column and key, so the writer (rl/) and the
// readers (pipeline/report.cc, tools/, bench/) cannot drift apart. Torch-free.
//
// <report>/metrics.csv: one header line (StepRow::CsvHeader()), then one StepRow::Csv() line
// per RL step. Columns, 1-based (gnuplot scripts address them by number, so new columns are
// only ever appended):
//   1 step, 2 version, 3 wall_s, 4 mean_reward, 5 eval_accuracy (empty: not evaluated),
//   6 k3, 7 staleness_mean, 8 staleness_max, 9 delta_density, 10 delta_bytes,
//   11 full_bytes, 12 wan_bytes, 13 sync_ms (empty: not measured yet), 14 sync_version,
//   15 samples, 16 samples_per_s, 17 dropped_stale, 18 loss, 19 grad_norm,
//   20 clip_fraction, 21 keyframe_bytes
// Numbers print with 6 significant digits.
//
// <report>/summary.json: one JSON object, RunSummary::ToJson(); every key below is written.
// The trainer's state directory also keeps StepRow::ToJson() objects (progress.json rows).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel::pipeline {

// One RL step as the trainer saw it.
struct StepRow {
  uint64_t step = 0;     // 1-based RL step
  uint64_t version = 0;  // the policy version published after this step
  double wall_s = 0;     // since the run started, resumes included
  double mean_reward = 0;
  double eval_accuracy = -1;  // -1: not evaluated at this step
  double k3 = 0;              // k3 KL estimate, sampler vs trainer
  double staleness_mean = 0;  // trainer version - sampling version, over sampled tokens
  uint64_t staleness_max = 0;
  double delta_density = 0;     // changed words / words of the published delta; 0: no delta
  uint64_t delta_bytes = 0;     // the version's delta artifact (compressed)
  uint64_t keyframe_bytes = 0;  // a keyframe written at this version too (every keyframe_every)
  uint64_t full_bytes = 0;      // serving-dtype bytes of the snapshot
  uint64_t wan_bytes = 0;       // since the previous step
  double sync_ms = -1;          // the newest version all workers serve: publish -> last swap
  uint64_t sync_version = 0;
  uint64_t samples = 0;
  double samples_per_s = 0;
  uint64_t dropped_stale = 0;  // cumulative samples
  double loss = 0;
  double grad_norm = 0;
  double clip_fraction = 0;

  bool operator==(const StepRow&) const = default;

  static const char* CsvHeader();
  std::string Csv() const;
  // Parses one Csv() line. Fails (InvalidArgument naming the column) on a wrong column
  // count or a field that is not a number.
  static Result<StepRow> FromCsv(std::string_view line);

  nlohmann::json ToJson() const;
  // A missing key keeps its default (rows saved before a column existed still load); a
  // present key of the wrong type, or a value that is not an object, is Corruption
  // naming the key.
  static Result<StepRow> FromJson(const nlohmann::json& value);
};

// The end-of-run summary.
struct RunSummary {
  std::string task;       // "<name>-<digits>"
  std::string algorithm;  // grpo, dapo, gspo, cispo
  std::string model;      // the preset or the config.json path
  int64_t parameters = 0;
  double initial_accuracy = -1;  // held-out, untrained
  double warmup_accuracy = -1;   // after SFT/DPO
  double final_accuracy = -1;
  double target_accuracy = 0;
  bool reached_target = false;
  double time_to_target_s = -1;  // -1: not reached
  double wall_seconds = 0;
  uint64_t steps = 0;
  uint64_t versions = 0;
  uint64_t samples = 0;
  int64_t max_staleness_allowed = 0;
  uint64_t max_staleness_observed = 0;
  double mean_staleness = 0;
  double mean_k3 = 0;
  double delta_bytes_mean = 0;
  uint64_t full_bytes = 0;
  uint64_t wan_bytes_total = 0;
  uint64_t workers = 0;
  uint64_t regions = 0;
  double sync_ms_mean = -1;  // -1: never measured
  uint64_t samples_dropped_stale = 0;
  uint64_t leases_expired = 0;
  uint64_t submissions_refused = 0;
  bool resumed = false;
  // Grading (issue 34); optional when read, so earlier summaries still load.
  double eval_score = -1;             // the held-out mean reward, by the run's grader
  std::string grader;                 // "builtin: exact_match", the command, or the URL
  uint64_t samples_graded = 0;
  uint64_t samples_ungraded = 0;      // timed out, crashed, bad answer: left out of the loss
  uint64_t groups_zero_variance = 0;  // dropped before the loss: all rewards equal
  uint64_t groups_too_few_graded = 0;
  uint64_t grader_restarts = 0;
  uint64_t episodes = 0;            // multi-turn episodes trained or dropped
  uint64_t episode_turns = 0;       // model turns over them
  uint64_t episode_env_tokens = 0;  // environment tokens, masked out of the loss

  bool operator==(const RunSummary&) const = default;

  // Sets the fields the rows determine: steps, samples, the staleness, k3, delta and WAN
  // aggregates, full_bytes (the last row's) and sync_ms_mean (each synced version once).
  void AddRows(const std::vector<StepRow>& rows);

  nlohmann::json ToJson() const;
  // Every key is required: a missing key or one of the wrong type is Corruption naming
  // the key (`where` prefixes the message, e.g. the file).
  static Result<RunSummary> FromJson(const nlohmann::json& value, const std::string& where);
};

// Reads <report_dir>/summary.json. NotFound when the file is missing or not JSON (the run
// did not finish), Corruption when a key is missing or mistyped.
Result<RunSummary> ReadSummary(const std::string& report_dir);

// The metrics.csv text: the header and one line per row, each ending in '\n'.
std::string MetricsCsv(const std::vector<StepRow>& rows);

}  // namespace flywheel::pipeline
