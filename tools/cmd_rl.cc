// `flywheel train`, `flywheel demo`, `flywheel bench pipeline`: the pipeline-RL loop.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench/util.h"
#include "pipeline/launcher.h"
#include "pipeline/run_config.h"
#include "pipeline/task.h"
#include "tools/commands.h"
#include "rl/rl_loop.h"

namespace flywheel::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct RlArgs {
  std::string config;
  std::vector<std::string> sets;
  bool moe = false;
  bool sync = false;
  std::string run_dir;
  std::string report;
  std::string markdown;
  // train
  std::string state, listen = "127.0.0.1:0", http = "127.0.0.1:0", publisher_http = "127.0.0.1:0";
  std::string token, token_file, ready_file;
  bool quiet = false;
  bool resume = false;
};

// The demo's defaults on top of RunConfig's: sorting 6 digits with the tiny model, a short
// SFT warm-up on generated examples, then async GRPO on 2 regions x 2 workers.
pipeline::RunConfig DemoConfig() {
  pipeline::RunConfig config;
  config.sft.steps = 30;
  config.sft.batch_size = 32;
  config.sft.lr = 1e-3;
  return config;
}

Result<pipeline::RunConfig> LoadConfig(const RlArgs& args, pipeline::RunConfig config) {
  if (!args.config.empty()) {
    FW_ASSIGN_OR_RETURN(config, pipeline::RunConfig::Load(args.config));
  }
  if (args.moe) config.model.preset = "tiny-moe";
  if (args.sync) config.pipeline.max_staleness = 0;
  for (const std::string& set : args.sets) FW_RETURN_IF_ERROR(config.Set(set));
  FW_RETURN_IF_ERROR(config.Validate());
  return config;
}

// Writes `count` SFT examples of the task's training part in the OpenAI chat format.
Status WriteSftDataset(const pipeline::RunConfig& config, const std::string& path, size_t count) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<pipeline::Task> task, pipeline::Task::Create(config.task));
  std::mt19937_64 rng(static_cast<uint64_t>(config.run.seed) + 99);
  std::ofstream out(path, std::ios::trunc);
  for (size_t i = 0; i < count; ++i) {
    const pipeline::Problem problem = task->Sample(rng, /*held_out=*/false);
    const json line = {{"messages",
                        {{{"role", "user"}, {"content", problem.prompt}},
                         {{"role", "assistant"}, {"content", problem.answer}, {"weight", 1}}}}};
    out << line.dump() << "\n";
  }
  if (!out) return Status::IOError("cannot write " + path);
  return Status::Ok();
}

std::string DefaultRunDir(const std::string& what) {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  std::ostringstream name;
  name << "flywheel-runs/" << what << "-" << std::put_time(&local, "%Y%m%d-%H%M%S");
  return name.str();
}

std::atomic<bool> g_interrupted{false};
extern "C" void OnInterrupt(int) { g_interrupted = true; }

std::string SelfPath() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "flywheel" : self.string();
}

// Runs one fleet to the end of its run; the trainer's lines go to `out` when `echo`.
Status RunFleet(const pipeline::RunConfig& config, const std::string& run_dir,
                const std::string& report_dir, bool echo, std::ostream& out, bool resume = false) {
  pipeline::RunConfig effective = config;
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) return Status::IOError("cannot create " + run_dir + ": " + ec.message());
  if (!resume && fs::exists(fs::path(run_dir) / "state")) {
    return Status::InvalidArgument(run_dir + " already holds a run (state/); choose another "
                                   "--run-dir, or --resume it");
  }
  if (effective.sft.steps > 0 && effective.sft.dataset.empty()) {
    effective.sft.dataset = fs::absolute(fs::path(run_dir) / "sft.jsonl").string();
    FW_RETURN_IF_ERROR(WriteSftDataset(effective, effective.sft.dataset, 4000));
  }
  pipeline::FleetOptions options;
  options.config = effective;
  options.program = SelfPath();
  options.run_dir = fs::absolute(run_dir).string();
  options.report_dir = report_dir.empty() ? "" : fs::absolute(report_dir).string();
  out << "starting the fleet in " << options.run_dir << ": trainer + publisher, "
      << effective.fleet.regions.size() << " regions x (relay + " << effective.fleet.workers_per_region
      << " workers); WAN " << effective.fleet.wan_rate_mbit << " Mbit/s, "
      << effective.fleet.wan_latency_ms << " ms one way; max_staleness "
      << effective.pipeline.max_staleness << (effective.pipeline.max_staleness == 0 ? " (synchronous)" : "")
      << std::endl;
  FW_ASSIGN_OR_RETURN(std::unique_ptr<pipeline::Fleet> fleet, pipeline::Fleet::Start(options));
  // Ctrl-C (or SIGTERM) ends the run early but cleanly: the trainer is told to stop, saves
  // its state and writes its report, then the rest of the fleet is stopped.
  g_interrupted = false;
  std::signal(SIGINT, OnInterrupt);
  std::signal(SIGTERM, OnInterrupt);
  const auto limit = std::chrono::milliseconds(static_cast<int64_t>(effective.run.time_limit_s * 1000) + 180000);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  Status finished = Status::Ok();
  bool told = false;
  for (;;) {
    finished = fleet->WaitTrainer(std::chrono::milliseconds(500), echo ? &out : nullptr);
    if (finished.ok() || !fleet->Running("trainer")) break;
    if (g_interrupted && !told) {
      out << "interrupted: stopping the trainer (it saves its state and writes its report)" << std::endl;
      (void)fleet->Kill("trainer", SIGTERM);
      told = true;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      finished = Status::Unavailable("the trainer did not finish within " +
                                     std::to_string(limit.count() / 1000) + " s");
      break;
    }
  }
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  for (const std::string& line : fleet->Stop()) spdlog::warn("{}", line);
  if (!finished.ok()) return finished.WithContext("logs in " + fleet->log_dir());
  return Status::Ok();
}

Status RunDemo(const RlArgs& args) {
  pipeline::RunConfig config;
  if (args.resume) {
    // The interrupted run's own configuration (the trainer resumes from its state); --set
    // may change it, e.g. run.time_limit_s (which counts the time already spent).
    if (args.run_dir.empty()) return Status::InvalidArgument("--resume needs the run's --run-dir");
    const std::string saved = (fs::path(args.run_dir) / "run.toml").string();
    if (!fs::exists(fs::path(args.run_dir) / "state" / "progress.json")) {
      return Status::NotFound(args.run_dir + " holds no run to resume (no state/progress.json)");
    }
    RlArgs from_saved = args;
    from_saved.config = saved;
    FW_ASSIGN_OR_RETURN(config, LoadConfig(from_saved, DemoConfig()));
  } else {
    FW_ASSIGN_OR_RETURN(config, LoadConfig(args, DemoConfig()));
  }
  const std::string run_dir = args.run_dir.empty() ? DefaultRunDir("demo") : args.run_dir;
  std::cout << "flywheel demo: asynchronous pipeline RL on " << config.task.name << " ("
            << config.task.digits << " digits, exact-match reward), model " << config.model.preset
            << ", " << config.algorithm.name << "\n";
  FW_RETURN_IF_ERROR(RunFleet(config, run_dir, args.report, /*echo=*/true, std::cout, args.resume));
  const std::string report = args.report.empty() ? (fs::path(run_dir) / "report").string() : args.report;
  return pipeline::WriteReport(report, std::cout);
}

Status RunTrain(const RlArgs& args) {
  if (spdlog::get_level() == spdlog::level::off) spdlog::set_level(spdlog::level::warn);
  FW_ASSIGN_OR_RETURN(pipeline::RunConfig config, LoadConfig(args, pipeline::RunConfig()));
  rl::TrainRunOptions options;
  options.config = config;
  options.state_dir = args.state;
  options.report_dir = args.report.empty() ? (fs::path(args.state) / "report").string() : args.report;
  options.listen = args.listen;
  options.http = args.http;
  options.publisher_http = args.publisher_http;
  options.ready_file = args.ready_file;
  options.token = args.token;
  if (!args.token_file.empty()) {
    std::ifstream in(args.token_file);
    if (!in) return Status::NotFound("cannot read --token-file " + args.token_file);
    std::getline(in, options.token);
  }
  options.quiet = args.quiet;
  return rl::RunTrainer(options);
}

Result<json> ReadSummary(const std::string& report_dir) {
  std::ifstream in(fs::path(report_dir) / "summary.json");
  json summary = json::parse(in, nullptr, false);
  if (!summary.is_object()) return Status::NotFound("no summary.json in " + report_dir);
  return summary;
}

Status RunPipelineBench(const RlArgs& args) {
  FW_ASSIGN_OR_RETURN(pipeline::RunConfig config, LoadConfig(args, DemoConfig()));
  if (config.pipeline.max_staleness == 0) config.pipeline.max_staleness = 2;
  const std::string run_dir = args.run_dir.empty() ? DefaultRunDir("bench-pipeline") : args.run_dir;
  std::cout << "flywheel bench pipeline: the same run asynchronous (max_staleness "
            << config.pipeline.max_staleness << ") and synchronous (generate, then train), "
            << "each until accuracy " << config.run.target_accuracy << " or "
            << config.run.time_limit_s << " s\n";
  struct Mode {
    std::string name;
    int64_t staleness;
    json summary;
  };
  std::vector<Mode> modes = {{"async", config.pipeline.max_staleness, {}}, {"sync", 0, {}}};
  for (Mode& mode : modes) {
    pipeline::RunConfig run = config;
    run.pipeline.max_staleness = mode.staleness;
    const std::string dir = (fs::path(run_dir) / mode.name).string();
    std::cout << "\n== " << mode.name << " ==\n";
    FW_RETURN_IF_ERROR(RunFleet(run, dir, "", /*echo=*/!args.quiet, std::cout));
    FW_ASSIGN_OR_RETURN(mode.summary, ReadSummary((fs::path(dir) / "report").string()));
  }
  // RL samples per second over the RL phase, and time to the accuracy target.
  bench::Table table;
  const std::string title = "Async vs sync pipeline RL (" + config.task.name + "-" +
                            std::to_string(config.task.digits) + ", " + config.model.preset + ", " +
                            std::to_string(config.fleet.regions.size() * config.fleet.workers_per_region) +
                            " workers, one machine)";
  std::vector<std::string> notes;
  table.header = {"mode", "max_staleness", "RL samples/s", "steps", "time to target (s)",
                  "final accuracy", "max staleness seen", "dropped stale", "mean k3"};
  double rate[2] = {0, 0}, to_target[2] = {-1, -1};
  for (size_t i = 0; i < modes.size(); ++i) {
    const json& s = modes[i].summary;
    const double rl_seconds = s.value("wall_seconds", 0.0);
    rate[i] = rl_seconds > 0 ? s.value("samples", 0.0) / rl_seconds : 0;
    to_target[i] = s.value("time_to_target_s", -1.0);
    std::ostringstream k3;
    k3 << std::scientific << std::setprecision(2) << s.value("mean_k3", 0.0);
    table.rows.push_back({modes[i].name, std::to_string(modes[i].staleness), bench::Fixed(rate[i], 1),
                          std::to_string(s.value("steps", 0)),
                          to_target[i] >= 0 ? bench::Fixed(to_target[i], 1) : "not reached",
                          bench::Fixed(s.value("final_accuracy", 0.0), 3),
                          std::to_string(s.value("max_staleness_observed", 0)),
                          std::to_string(s.value("samples_dropped_stale", 0)), k3.str()});
  }
  notes.push_back("async / sync samples/s: " + bench::Fixed(rate[1] > 0 ? rate[0] / rate[1] : 0, 2) + "x");
  if (to_target[0] > 0 && to_target[1] > 0) {
    notes.push_back("sync / async time to target: " + bench::Fixed(to_target[1] / to_target[0], 2) + "x");
  }
  notes.push_back("samples/s counts RL samples trained over the whole wall time (warm-up included)");
  std::cout << "\n" << title << "\n" << bench::RenderText(table);
  std::string notes_text;
  for (const std::string& note : notes) notes_text += "- " + note + "\n";
  std::cout << notes_text;
  if (!args.markdown.empty()) {
    const std::string section = "## Pipeline benchmark\n\n" + title + ", `flywheel bench pipeline`.\n\n" +
                                bench::RenderMarkdown(table) + "\n" + notes_text;
    FW_RETURN_IF_ERROR(bench::WriteMarkdownSection(args.markdown, "## Pipeline benchmark", section));
  }
  // Self-check: both runs trained and stayed inside their staleness bounds.
  for (const Mode& mode : modes) {
    if (mode.summary.value("max_staleness_observed", int64_t{0}) > mode.staleness) {
      return Status::Internal(mode.name + " run exceeded its staleness bound");
    }
    if (mode.summary.value("steps", 0) == 0) return Status::Internal(mode.name + " run took no step");
  }
  return Status::Ok();
}

void AddConfigOptions(CLI::App* app, RlArgs& args) {
  app->add_option("--config", args.config, "Run configuration (TOML; every key has a default)")
      ->check(CLI::ExistingFile)
      ->option_text("FILE");
  app->add_option("--set", args.sets, "Override one key, e.g. --set algorithm.lr=1e-4; repeatable")
      ->type_name("SECTION.KEY=VALUE");
  app->add_flag("--moe", args.moe, "The MoE variant (model.preset = tiny-moe, routing replay)");
  app->add_flag("--sync", args.sync, "Synchronous RL (pipeline.max_staleness = 0)");
}

}  // namespace

void AddRlCommands(CLI::App& app, Action& action) {
  auto args = std::make_shared<RlArgs>();

  CLI::App* demo = app.add_subcommand(
      "demo",
      "The main job: an asynchronous pipeline-RL run that visibly learns.\n"
      "Starts the trainer (with its publisher), a relay per region and the rollout workers\n"
      "as separate processes on loopback, with shaped WAN links between the regions. The\n"
      "workers sample groups of answers to generated problems (default: sort 6 digits),\n"
      "score them by exact match and stream them to the trainer; every step publishes a new\n"
      "policy version as a delta that the relays fan out and the workers swap in flight.\n"
      "Accuracy is measured on a held-out split of the problems. The run stops at\n"
      "run.target_accuracy (0.8) or run.time_limit_s (600). One line per step; at the end a\n"
      "summary and a report directory (metrics.csv, summary.json, PNG plots, run.toml).");
  AddConfigOptions(demo, *args);
  demo->add_option("--run-dir", args->run_dir,
                   "Where the run lives (default: flywheel-runs/demo-<time>)")
      ->type_name("DIR");
  demo->add_option("--report", args->report, "Report directory (default: <run-dir>/report)")
      ->type_name("DIR");
  demo->add_flag("--resume", args->resume,
                 "Continue an interrupted run in --run-dir with its run.toml and state")
      ->needs("--run-dir")
      ->excludes("--config");
  demo->footer(
      "\nExamples:\n"
      "  flywheel demo\n"
      "  flywheel demo --moe\n"
      "  flywheel demo --resume --run-dir flywheel-runs/demo-20261123-120000\n"
      "  flywheel demo --set task.name=reverse --set algorithm.name=dapo --report /tmp/report");
  demo->callback([args, &action] { action = [args] { return RunDemo(*args); }; });

  CLI::App* train = app.add_subcommand(
      "train",
      "The trainer process of a pipeline-RL run (started by `flywheel demo`).\n"
      "Trains the policy, publishes each version (deltas, keyframes) on --listen, and serves\n"
      "the rollout workers' prompts and samples on --http (POST /v1/rollout/claim, /submit;\n"
      "GET /v1/status). Started again on the same --state it resumes where it stopped.");
  AddConfigOptions(train, *args);
  train->add_option("--state", args->state, "State directory (trainer state, version log)")
      ->type_name("DIR")
      ->required();
  train->add_option("--report", args->report, "Report directory (default: <state>/report)")
      ->type_name("DIR");
  train->add_option("--listen", args->listen, "The publisher's port for relays and workers")
      ->type_name("HOST:PORT")
      ->capture_default_str();
  train->add_option("--http", args->http, "The rollout coordinator and status")
      ->type_name("HOST:PORT")
      ->capture_default_str();
  train->add_option("--publisher-http", args->publisher_http, "The publisher's status endpoint")
      ->type_name("HOST:PORT")
      ->capture_default_str();
  train->add_option("--token", args->token, "Bearer token for peers and HTTP clients")->type_name("T");
  train->add_option("--token-file", args->token_file, "Read the token from this file")
      ->type_name("F")
      ->excludes("--token");
  train->add_option("--ready-file", args->ready_file, "Write the bound endpoints here (JSON)")
      ->type_name("F");
  train->add_flag("--quiet", args->quiet, "No per-step lines");
  train->callback([args, &action] { action = [args] { return RunTrain(*args); }; });
}

void AddPipelineBenchCommand(CLI::App& bench_app, Action& action) {
  auto args = std::make_shared<RlArgs>();
  CLI::App* pipeline = bench_app.add_subcommand(
      "pipeline",
      "Asynchronous against synchronous pipeline RL on the same task and budget.\n"
      "Runs the demo's fleet twice (max_staleness k, then 0) and reports RL samples/s and\n"
      "the time to the accuracy target of each, side by side.");
  AddConfigOptions(pipeline, *args);
  pipeline->add_option("--run-dir", args->run_dir, "Where the two runs live")->type_name("DIR");
  pipeline->add_option("--markdown", args->markdown,
                       "Write the table as the '## Pipeline benchmark' section of this file")
      ->type_name("PATH");
  pipeline->add_flag("--quiet", args->quiet, "No per-step lines");
  pipeline->callback([args, &action] { action = [args] { return RunPipelineBench(*args); }; });
}

}  // namespace flywheel::tools
