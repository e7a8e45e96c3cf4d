// `flywheel demo` and the fleet runs the pipeline benchmark makes: a whole pipeline-RL fleet
// (pipeline/launcher.h) started, supervised to the end of its run and stopped. Torch-free:
// the trainer and workers are other processes of the flywheel binary.
#pragma once

#include <functional>
#include <ostream>
#include <string>

#include "base/status.h"
#include "pipeline/run_config.h"

namespace flywheel::pipeline {

// The demo's defaults on top of RunConfig's: sorting 6 digits with the tiny model, a short
// SFT warm-up on generated examples, then async GRPO on 2 regions x 2 workers.
RunConfig DemoConfig();

// "flywheel-runs/<what>-<local time YYYYmmdd-HHMMSS>".
std::string DefaultRunDir(const std::string& what);

// Writes `count` SFT examples of the task's training split in the OpenAI chat format
// (rl/warmup.h reads them), seeded by run.seed. IOError when `path` cannot be written.
Status WriteSftDataset(const RunConfig& config, const std::string& path, size_t count);

struct FleetRunOptions {
  RunConfig config;
  std::string program;     // the flywheel binary the fleet's processes run
  std::string run_dir;     // created if missing
  std::string report_dir;  // empty: <run_dir>/report
  bool echo = true;        // copy the trainer's lines to `out`
  bool resume = false;     // false: refuse a run_dir that already holds a run (state/)
  // Lines about processes that did not stop cleanly; empty: written to `out`.
  std::function<void(const std::string&)> warn;
  // Non-empty: pin the trainer and the rollout side to these CPUs (FleetOptions).
  std::vector<int> trainer_cpus, rollout_cpus;
};

// Runs one fleet until its trainer exits: with SFT steps and no dataset, a generated one
// (4000 examples, <run_dir>/sft.jsonl) first. SIGINT/SIGTERM while it runs tell the trainer
// to stop (it saves its state and writes its report); the fleet is stopped at the end.
// Fails when run_dir holds a run and resume is off (InvalidArgument), the fleet does not
// start, the trainer fails, or it runs past run.time_limit_s + 180 s (Unavailable); the
// error names the log directory.
Status RunFleetToEnd(const FleetRunOptions& options, std::ostream& out);

// The run.toml of the run in `run_dir` to resume it with; NotFound when run_dir holds no
// resumable run (no state/progress.json).
Result<std::string> ResumableRunConfig(const std::string& run_dir);

struct DemoOptions {
  RunConfig config;
  // The demo as files (issue 34): its tiny model written as an HF directory
  // (<run_dir>/model, by `program model make-tiny`) unless model.dir is set, its task as RL
  // JSONL files (<run_dir>/train.jsonl, eval.jsonl) unless task.dataset is set, and its SFT
  // warm-up as <run_dir>/sft.jsonl unless sft.dataset is set; the trainer then starts from
  // the directory and reads prompts and answers from the files.
  bool files = false;
  std::string program;
  std::string run_dir;  // empty: DefaultRunDir("demo")
  std::string report_dir;  // empty: <run_dir>/report
  bool resume = false;
  std::function<void(const std::string&)> warn;
};

// With options.files: writes what is missing of the model directory and the JSONL files
// into `run_dir` and points `config` at them. Errors name the file or the command.
Status PrepareDemoFiles(const DemoOptions& options, const std::string& run_dir, RunConfig& config,
                        std::ostream& out);

// `flywheel demo`: a line saying what runs, the fleet to the end, then the report
// (WriteReport: plots and the summary table) on `out`.
Status RunDemo(const DemoOptions& options, std::ostream& out);

}  // namespace flywheel::pipeline
