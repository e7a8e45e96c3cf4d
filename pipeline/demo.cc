#include "pipeline/demo.h"

#include <atomic>
#include <chrono>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <iomanip>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "base/env.h"
#include "ops/process.h"
#include "pipeline/launcher.h"
#include "pipeline/task.h"

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::atomic<bool> g_interrupted{false};
extern "C" void OnInterrupt(int) { g_interrupted = true; }

// Ctrl-C (or SIGTERM) ends the run early but cleanly: the trainer is told to stop, saves its
// state and writes its report, then the rest of the fleet is stopped. Restores the default
// handlers when it goes.
struct InterruptScope {
  InterruptScope() {
    g_interrupted = false;
    std::signal(SIGINT, OnInterrupt);
    std::signal(SIGTERM, OnInterrupt);
  }
  ~InterruptScope() {
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
  }
};

// Waits for the trainer to exit; an interrupt is passed on to it once.
Status SuperviseTrainer(Fleet& fleet, const RunConfig& config, bool echo, std::ostream& out) {
  const auto limit = std::chrono::milliseconds(static_cast<int64_t>(config.run.time_limit_s * 1000) + 180000);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  bool told = false;
  for (;;) {
    Status finished = fleet.WaitTrainer(std::chrono::milliseconds(500), echo ? &out : nullptr);
    if (finished.ok() || !fleet.Running("trainer")) return finished;
    if (g_interrupted && !told) {
      out << "interrupted: stopping the trainer (it saves its state and writes its report)" << std::endl;
      (void)fleet.Kill("trainer", SIGTERM);
      told = true;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Status::Unavailable("the trainer did not finish within " +
                                 std::to_string(limit.count() / 1000) + " s");
    }
  }
}

void SayFleet(const FleetOptions& options, std::ostream& out) {
  const RunConfig& c = options.config;
  out << "starting the fleet in " << options.run_dir << ": trainer + publisher, "
      << c.fleet.regions.size() << " regions x (relay + " << c.fleet.workers_per_region
      << " workers); WAN " << c.fleet.wan_rate_mbit << " Mbit/s, " << c.fleet.wan_latency_ms
      << " ms one way; max_staleness " << c.pipeline.max_staleness
      << (c.pipeline.max_staleness == 0 ? " (synchronous)" : "") << std::endl;
}

}  // namespace

RunConfig DemoConfig() {
  RunConfig config;
  config.sft.steps = 30;
  config.sft.batch_size = 32;
  config.sft.lr = 1e-3;
  return config;
}

std::string DefaultRunDir(const std::string& what) {
  const std::time_t now = static_cast<std::time_t>(UnixMicrosNow() / 1000000);
  std::tm local{};
  localtime_r(&now, &local);
  std::ostringstream name;
  name << "flywheel-runs/" << what << "-" << std::put_time(&local, "%Y%m%d-%H%M%S");
  return name.str();
}

Status WriteSftDataset(const RunConfig& config, const std::string& path, size_t count) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<Task> task, Task::Create(config.task));
  std::mt19937_64 rng(static_cast<uint64_t>(config.run.seed) + 99);
  std::string text;
  for (size_t i = 0; i < count; ++i) {
    const Problem problem = task->Sample(rng, /*held_out=*/false);
    const json line = {{"messages",
                        {{{"role", "user"}, {"content", problem.prompt}},
                         {{"role", "assistant"}, {"content", problem.answer}, {"weight", 1}}}}};
    text += line.dump() + "\n";
  }
  return WriteFileAtomically(path, std::as_bytes(std::span(text.data(), text.size())));
}

Status RunFleetToEnd(const FleetRunOptions& run, std::ostream& out) {
  std::error_code ec;
  fs::create_directories(run.run_dir, ec);
  if (ec) return Status::IOError("cannot create " + run.run_dir + ": " + ec.message());
  if (!run.resume && fs::exists(fs::path(run.run_dir) / "state")) {
    return Status::InvalidArgument(run.run_dir + " already holds a run (state/); choose another "
                                   "--run-dir, or --resume it");
  }
  FleetOptions options;
  options.config = run.config;
  if (options.config.sft.steps > 0 && options.config.sft.dataset.empty()) {
    options.config.sft.dataset = fs::absolute(fs::path(run.run_dir) / "sft.jsonl").string();
    FW_RETURN_IF_ERROR(WriteSftDataset(options.config, options.config.sft.dataset, 4000));
  }
  options.program = run.program;
  options.trainer_cpus = run.trainer_cpus;
  options.rollout_cpus = run.rollout_cpus;
  options.run_dir = fs::absolute(run.run_dir).string();
  options.report_dir = run.report_dir.empty() ? "" : fs::absolute(run.report_dir).string();
  SayFleet(options, out);
  FW_ASSIGN_OR_RETURN(std::unique_ptr<Fleet> fleet, Fleet::Start(options));
  out << "dashboard: " << fleet->dashboard_url() << std::endl;
  Status finished;
  {
    InterruptScope interrupts;
    finished = SuperviseTrainer(*fleet, options.config, run.echo, out);
  }
  for (const std::string& line : fleet->Stop()) {
    if (run.warn) {
      run.warn(line);
    } else {
      out << line << std::endl;
    }
  }
  if (!finished.ok()) return finished.WithContext("logs in " + fleet->log_dir());
  return Status::Ok();
}

Result<std::string> ResumableRunConfig(const std::string& run_dir) {
  if (!fs::exists(fs::path(run_dir) / "state" / "progress.json")) {
    return Status::NotFound(run_dir + " holds no run to resume (no state/progress.json)");
  }
  return (fs::path(run_dir) / "run.toml").string();
}

Status PrepareDemoFiles(const DemoOptions& options, const std::string& run_dir, RunConfig& config,
                        std::ostream& out) {
  const fs::path root = fs::absolute(run_dir);
  if (fs::exists(root / "state")) {
    return Status::InvalidArgument(run_dir + " already holds a run (state/); choose another --run-dir, or --resume it");
  }
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return Status::IOError("cannot create " + root.string() + ": " + ec.message());
  if (config.model.dir.empty() && config.model.config.empty()) {
    config.model.dir = (root / "model").string();
    std::vector<std::string> args = {"model", "make-tiny", "--out", config.model.dir, "--seed",
                                     std::to_string(config.run.seed)};
    if (config.model.preset == "tiny-moe") args.push_back("--moe");
    FW_ASSIGN_OR_RETURN(ops::Completion made, ops::RunToCompletion(options.program, args));
    if (made.exit_code != 0) {
      std::string why = made.err;
      while (!why.empty() && why.back() == '\n') why.pop_back();
      return Status::Internal("`flywheel model make-tiny --out " + config.model.dir + "` failed: " + why);
    }
  }
  TaskFilesOptions files;
  files.task = config.task;
  files.seed = static_cast<uint64_t>(config.run.seed);
  files.count = 20000;
  files.eval_count = static_cast<size_t>(config.run.eval_prompts);
  if (config.task.dataset.empty()) {
    files.out = config.task.dataset = (root / "train.jsonl").string();
    files.eval_out = config.task.eval_dataset = (root / "eval.jsonl").string();
  }
  if (config.sft.steps > 0 && config.sft.dataset.empty()) {
    files.sft_out = config.sft.dataset = (root / "sft.jsonl").string();
  }
  if (!files.out.empty() || !files.sft_out.empty()) FW_RETURN_IF_ERROR(MakeTaskFiles(files).status());
  out << "demo files: model " << config.model.dir << ", dataset " << config.task.dataset
      << (config.task.eval_dataset.empty() ? "" : ", held out " + config.task.eval_dataset)
      << (config.sft.dataset.empty() ? "" : ", SFT " + config.sft.dataset) << std::endl;
  return Status::Ok();
}

Status RunDemo(const DemoOptions& options, std::ostream& out) {
  FleetRunOptions run;
  run.run_dir = options.run_dir.empty() ? DefaultRunDir("demo") : options.run_dir;
  RunConfig config = options.config;
  if (options.files && !options.resume) FW_RETURN_IF_ERROR(PrepareDemoFiles(options, run.run_dir, config, out));
  run.config = config;
  run.program = options.program;
  run.report_dir = options.report_dir;
  run.echo = true;
  run.resume = options.resume;
  run.warn = options.warn;
  out << "flywheel demo: asynchronous pipeline RL on ";
  const std::string grader = !config.grading.command.empty() ? "grader: " + config.grading.command
                             : !config.grading.url.empty()   ? "grader: " + config.grading.url
                             : !config.graders.empty()       ? std::to_string(config.graders.size()) + " built-in grader(s)"
                                                             : "exact match against \"answer\"";
  if (config.task.dataset.empty()) {
    out << config.task.name << " (" << config.task.digits << " digits, " << grader << ")";
  } else {
    out << config.task.dataset << " (" << grader << ")";
  }
  out << ", model " << (config.model.dir.empty() ? config.model.preset : config.model.dir) << ", "
      << config.algorithm.name << "\n";
  FW_RETURN_IF_ERROR(RunFleetToEnd(run, out));
  const std::string report =
      options.report_dir.empty() ? (fs::path(run.run_dir) / "report").string() : options.report_dir;
  return WriteReport(report, out);
}

}  // namespace flywheel::pipeline
