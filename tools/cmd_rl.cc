// `flywheel train`, `flywheel demo`, `flywheel bench pipeline`: flags -> options -> one
// library call each (rl::RunTrainer, pipeline::RunDemo, bench::RunPipelineBench).
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/pipeline_bench.h"
#include "model/memory_plan.h"
#include "pipeline/dashboard.h"
#include "pipeline/demo.h"
#include "pipeline/run_config.h"
#include "pipeline/shapes.h"
#include "rl/rl_loop.h"  // declarations only: flywheel hands `train` over (commands.h)
#include "tools/commands.h"

namespace flywheel::tools {
namespace {

namespace fs = std::filesystem;

struct RlArgs {
  std::string config;
  std::vector<std::string> sets;
  bool moe = false;
  bool sync = false;
  // Issue 34's files: model.dir, task.dataset, task.eval_dataset, sft.dataset.
  std::string model_dir, dataset, eval_dataset, sft_dataset, dpo_dataset;
  // Grading: grading.command, grading.url, or [[grader]] tables from a file.
  std::string grader, grader_url, graders;
  bool files = true;  // demo: write the model directory and the JSONL files first
  std::string run_dir;
  std::string report;
  std::string markdown;
  // train
  std::string state, listen = "127.0.0.1:0", http = "127.0.0.1:0", publisher_http = "127.0.0.1:0";
  TokenFlags tokens;
  transport::TlsOptions tls;
  std::string ready_file, signing_key;
  bool quiet = false;
  bool local_fleet = false;
  std::string shape;       // --shape NAME (pipeline/shapes.h)
  std::string shapes_dir;  // --shapes-dir DIR
  bool resume = false;
  bool no_pinned = false;
};

// --shape: the keys the user set (--config's, --set's) may not include one the shape owns.
Status ApplyShapeArgs(const RlArgs& args, pipeline::RunConfig& config) {
  FW_ASSIGN_OR_RETURN(pipeline::Shape shape, pipeline::FindShape(args.shape, args.shapes_dir));
  std::vector<std::string> user_keys;
  if (!args.config.empty()) {
    FW_ASSIGN_OR_RETURN(user_keys, pipeline::RunTomlKeys(args.config));
  }
  for (const std::string& set : args.sets) user_keys.push_back(set.substr(0, set.find('=')));
  return pipeline::ApplyShape(shape, user_keys, "demo/train", config);
}

Result<pipeline::RunConfig> LoadConfig(const RlArgs& args, pipeline::RunConfig config) {
  if (!args.config.empty()) {
    FW_ASSIGN_OR_RETURN(config, pipeline::RunConfig::Load(args.config));
  }
  if (args.moe) config.model.preset = "tiny-moe";
  if (args.sync) config.pipeline.max_staleness = 0;
  if (!args.model_dir.empty()) config.model.dir = fs::absolute(args.model_dir).string();
  if (!args.dataset.empty()) config.task.dataset = fs::absolute(args.dataset).string();
  if (!args.eval_dataset.empty()) config.task.eval_dataset = fs::absolute(args.eval_dataset).string();
  if (!args.sft_dataset.empty()) config.sft.dataset = fs::absolute(args.sft_dataset).string();
  if (!args.dpo_dataset.empty()) config.dpo.dataset = fs::absolute(args.dpo_dataset).string();
  if (!args.grader.empty()) config.grading.command = args.grader;
  if (!args.grader_url.empty()) config.grading.url = args.grader_url;
  if (!args.graders.empty()) {
    std::ifstream in(args.graders);
    std::ostringstream text;
    text << in.rdbuf();
    Result<std::vector<grading::GraderSpec>> specs = grading::ParseGraderConfig(text.str());
    if (!in || !specs.ok()) {
      return Status::InvalidArgument("--graders " + args.graders + ": " +
                                     (specs.ok() ? std::string("cannot be read") : specs.status().message()));
    }
    config.graders = std::move(*specs);
  }
  if (!args.grader.empty() || !args.grader_url.empty()) config.graders.clear();
  for (const std::string& set : args.sets) FW_RETURN_IF_ERROR(config.Set(set));
  FW_RETURN_IF_ERROR(config.Validate());
  if (!args.shape.empty()) FW_RETURN_IF_ERROR(ApplyShapeArgs(args, config));
  return config;
}

void WarnLine(const std::string& line) { spdlog::warn("{}", line); }

Status RunDemo(const RlArgs& args) {
  pipeline::DemoOptions options;
  if (args.resume) {
    // The interrupted run's own configuration (the trainer resumes from its state); --set
    // may change it, e.g. run.time_limit_s (which counts the time already spent).
    if (args.run_dir.empty()) return Status::InvalidArgument("--resume needs the run's --run-dir");
    if (!args.shape.empty()) {
      return Status::InvalidArgument("--resume runs with the run's own run.toml, its shape included: drop --shape");
    }
    RlArgs from_saved = args;
    FW_ASSIGN_OR_RETURN(from_saved.config, pipeline::ResumableRunConfig(args.run_dir));
    FW_ASSIGN_OR_RETURN(options.config, LoadConfig(from_saved, pipeline::DemoConfig()));
  } else {
    FW_ASSIGN_OR_RETURN(options.config, LoadConfig(args, pipeline::DemoConfig()));
  }
  options.program = SelfProgram();
  options.run_dir = args.run_dir;
  options.report_dir = args.report;
  options.resume = args.resume;
  options.files = args.files;
  options.warn = WarnLine;
  return pipeline::RunDemo(options, std::cout);
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
  FW_ASSIGN_OR_RETURN(options.token, ResolveToken(args.tokens, TokenFallback::kEnvironment));
  FW_ASSIGN_OR_RETURN(options.scoped_tokens, ReadScopedTokens(args.tokens.scoped));
  options.tls = args.tls;
  options.signing_key = args.signing_key;
  options.quiet = args.quiet;
  options.local_fleet = args.local_fleet;
#ifdef FLYWHEEL_WITH_TORCH
  return rl::RunTrainer(options);
#else
  return TorchOnly("train");
#endif
}

Status RunPipelineBench(const RlArgs& args) {
  bench::PipelineBenchOptions options;
  FW_ASSIGN_OR_RETURN(options.config, LoadConfig(args, pipeline::DemoConfig()));
  options.program = SelfProgram();
  options.run_dir = args.run_dir;
  options.markdown = args.markdown;
  options.quiet = args.quiet;
  options.pinned = !args.no_pinned;
  options.warn = WarnLine;
#ifdef FLYWHEEL_WITH_TORCH
  return bench::RunPipelineBench(options, std::cout);
#else
  return TorchOnly("bench pipeline");
#endif
}

void AddConfigOptions(CLI::App* app, RlArgs& args) {
  app->add_option("--config", args.config, "Run configuration (TOML; every key has a default)")
      ->check(CLI::ExistingFile)
      ->option_text("FILE");
  app->add_option("--set", args.sets, "Override one key, e.g. --set algorithm.lr=1e-4; repeatable")
      ->type_name("SECTION.KEY=VALUE");
  app->add_flag("--moe", args.moe, "The MoE variant (model.preset = tiny-moe, routing replay)");
  app->add_flag("--sync", args.sync, "Synchronous RL (pipeline.max_staleness = 0)");
  app->add_option("--model", args.model_dir,
                  "An HF model directory (model.dir): config.json, safetensors (sharded or not),\n"
                  "tokenizer.json, tokenizer_config.json; the trainer starts from its weights and\n"
                  "the workers serve its tokenizer")
      ->check(CLI::ExistingDirectory)
      ->type_name("DIR");
  app->add_option("--dataset", args.dataset,
                  "RL JSONL (task.dataset): {\"messages\": [...], ...} a line; prompts rendered by\n"
                  "the model's chat template, every other field handed to the grader")
      ->check(CLI::ExistingFile)
      ->type_name("F");
  app->add_option("--eval-dataset", args.eval_dataset,
                  "Held-out RL JSONL (task.eval_dataset; default: task.eval_fraction, 0.125, of --dataset by a prompt hash)")
      ->check(CLI::ExistingFile)
      ->type_name("F");
  app->add_option("--sft-dataset", args.sft_dataset, "SFT JSONL for the warm-up (sft.dataset)")
      ->check(CLI::ExistingFile)
      ->type_name("F");
  app->add_option("--dpo-dataset", args.dpo_dataset,
                  "DPO JSONL, OpenAI preference format, for the warm-up (dpo.dataset; with\n"
                  "--set dpo.steps=N)")
      ->check(CLI::ExistingFile)
      ->type_name("F");
  auto* command = app->add_option("--grader", args.grader,
                  "An external grader (grading.command): a long-lived process reading one JSON\n"
                  "request a line on stdin, answering {\"id\", \"reward\"} lines (docs/GRADERS.md)")
      ->type_name("CMD");
  auto* url = app->add_option("--grader-url", args.grader_url,
                  "The same protocol over HTTP POST (grading.url)")
      ->type_name("URL");
  app->add_option("--graders", args.graders,
                  "Built-in graders ([[grader]] tables, TOML or JSON), summed by weight; default:\n"
                  "exact_match against \"answer\"")
      ->check(CLI::ExistingFile)
      ->type_name("F")
      ->excludes(command)
      ->excludes(url);
  command->excludes(url);
  app->add_option("--shape", args.shape,
                  "A training shape (`flywheel shapes`): it sets the trainer's threads, the workers'\n"
                  "batch and serving dtype and the run's limits; a --set or --config of a key it\n"
                  "owns is refused")
      ->type_name("NAME");
  app->add_option("--shapes-dir", args.shapes_dir, "Your own shapes (*.toml), beside the shipped ones")
      ->check(CLI::ExistingDirectory)
      ->type_name("DIR");
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
  demo->add_flag("--files,!--no-files", args->files,
                 "Issue 34's path (the default): write the tiny model as an HF directory\n"
                 "(<run-dir>/model) and the task as JSONL files (train.jsonl, eval.jsonl,\n"
                 "sft.jsonl), unless --model, --dataset, --sft-dataset name them, and train from\n"
                 "those; --no-files: the preset model and the generated task in the trainer");
  demo->add_flag("--resume", args->resume,
                 "Continue an interrupted run in --run-dir with its run.toml and state")
      ->needs("--run-dir")
      ->excludes("--config");
  demo->footer(
      "\nExamples:\n"
      "  flywheel demo\n"
      "  flywheel demo --moe\n"
      "  flywheel demo --no-files     # the preset model and the task generated in the trainer\n"
      "  flywheel demo --model DIR --dataset train.jsonl --eval-dataset eval.jsonl\n"
      "  flywheel demo --resume --run-dir flywheel-runs/demo-20261123-120000\n"
      "  flywheel demo --set task.name=reverse --set algorithm.name=dapo --report /tmp/report\n"
      "  flywheel demo --set model.serving=fp8 --set model.fp8_qat=true   # FP8 workers, QAT");
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
  AddTokenFlags(train, args->tokens, "Bearer token for peers and HTTP clients");
  AddScopedTokenFlag(train, args->tokens,
                     "A further HTTP token with its own scopes, SCOPES:FILE (read, submit, ...;\n"
                     "see `flywheel publish --help`); repeatable");
  AddTlsFlags(train, args->tls,
              "TLS certificate chain (PEM): TLS 1.3 on the coordinator and the publisher",
              "CA that clients (workers claiming and submitting, relays) must present a\n"
              "certificate from (mutual authentication)");
  train->add_option("--signing-key", args->signing_key,
                    "Sign every published version (Ed25519, from `flywheel keys generate`)")
      ->type_name("F");
  train->add_option("--ready-file", args->ready_file, "Write the bound endpoints here (JSON)")
      ->type_name("F");
  train->add_flag("--quiet", args->quiet, "No per-step lines");
  train->add_flag("--local-fleet", args->local_fleet,
                  "The config's relays and workers run here too (flywheel demo): the memory plan counts them");
  MarkTorchOnly(train);
  train->callback([args, &action] { action = [args] { return RunTrain(*args); }; });
}

// `flywheel report serve DIR`: the dashboard of a finished run until SIGINT or SIGTERM.
static Status ServeReport(const std::string& dir, const std::string& listen) {
  // Blocked before the server's thread starts, so that it inherits the mask and this
  // thread's sigwait takes them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  FW_ASSIGN_OR_RETURN(std::unique_ptr<pipeline::ReportServer> server, pipeline::ReportServer::Start(dir, listen));
  std::cout << "the dashboard of " << dir << " (" << server->feed().steps() << " steps): " << server->url()
            << "\n(Ctrl-C stops it)" << std::endl;
  int signal = 0;
  sigwait(&signals, &signal);
  return Status::Ok();
}

void AddReportCommand(CLI::App& app, Action& action) {
  CLI::App* report = app.add_subcommand("report", "A run's report directory");
  report->require_subcommand(1);
  auto dir = std::make_shared<std::string>();
  auto listen = std::make_shared<std::string>("127.0.0.1:0");
  CLI::App* serve = report->add_subcommand(
      "serve",
      "Serve a finished (or interrupted) run's dashboard from its report directory: the\n"
      "curves of metrics.csv, summary.json and the latest rollouts (rollouts.jsonl), the\n"
      "same page `flywheel demo` and `flywheel train` serve live. Prints a URL that carries\n"
      "a read-only token made for this server; runs until Ctrl-C.");
  serve->add_option("dir", *dir, "The report directory (<run-dir>/report)")
      ->required()
      ->check(CLI::ExistingDirectory)
      ->type_name("DIR");
  serve->add_option("--listen", *listen, "Where to serve (port 0: a free one)")
      ->type_name("HOST:PORT")
      ->capture_default_str();
  serve->callback([dir, listen, &action] { action = [dir, listen] { return ServeReport(*dir, *listen); }; });
}

struct PlanArgs {
  std::string model;
  int64_t context = 0;
  int64_t lora_rank = 0;
  int64_t workers = 1;
  int64_t relays = 0;
  int64_t batch = 64;
  int64_t worker_batch = 32;
  std::string serving = "bf16";
  bool kl = false;
  bool json = false;
  std::string shape, shapes_dir;
};

// --shape: the shape's context, LoRA rank (its largest), workers' batch and serving dtype.
Status ApplyPlanShape(PlanArgs& args) {
  FW_ASSIGN_OR_RETURN(pipeline::Shape shape, pipeline::FindShape(args.shape, args.shapes_dir));
  args.context = shape.max_context;
  args.lora_rank = shape.mode == "lora" ? shape.lora_rank_max : 0;
  args.worker_batch = shape.worker_max_batch;
  args.serving = shape.serving;
  return Status::Ok();
}

Status RunPlan(PlanArgs args) {
#ifdef FLYWHEEL_WITH_TORCH
  if (!args.shape.empty()) FW_RETURN_IF_ERROR(ApplyPlanShape(args));
  const fs::path path = fs::is_directory(args.model) ? fs::path(args.model) / "config.json" : fs::path(args.model);
  if (!fs::exists(path)) {
    return Status::NotFound(args.model + " has no config.json (the plan is made from the model's config)");
  }
  FW_ASSIGN_OR_RETURN(model::ModelConfig config, model::ModelConfig::Load(path.string()));
  model::PlanInputs in;
  in.model = config;
  in.context = args.context > 0 ? args.context : std::min<int64_t>(4096, config.max_position_embeddings);
  in.lora_rank = args.lora_rank;
  in.train_sequences = args.batch;
  in.workers = args.workers;
  in.relays = args.relays;
  in.worker_max_batch = args.worker_batch;
  in.serving_bytes_per_weight = args.serving == "fp8" ? 1.0 : 2.0;
  in.reference = args.kl;
  const model::MemoryPlan plan = model::PlanMemory(in);
  if (args.json) {
    std::cout << plan.Json() << std::endl;
    return Status::Ok();
  }
  std::cout << "memory plan for " << path.string() << " (" << model::ParameterCount(config) << " parameters"
            << (args.lora_rank > 0 ? ", LoRA rank " + std::to_string(args.lora_rank) : ", full fine-tuning")
            << ", context " << in.context << ")\n"
            << plan.Table();
  return Status::Ok();
#else
  return TorchOnly("plan");
#endif
}

void AddPlanCommand(CLI::App& app, Action& action) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* plan = app.add_subcommand(
      "plan",
      "Before anything starts: the memory a run holds, by process and term (the trainer's\n"
      "weights, gradients, optimizer states and activations at the context; each worker's\n"
      "serving copy, fp32 mirror and KV cache; the relays' cached versions), against this\n"
      "machine's available memory. `flywheel train` and `flywheel demo` check the same plan\n"
      "at start and refuse a run that does not fit (run.check_memory).");
  plan->add_option("--model", args->model, "An HF model directory (its config.json) or a config.json")
      ->required()
      ->type_name("DIR|FILE");
  plan->add_option("--context", args->context, "Tokens per sequence (default: min(4096, max_position_embeddings))")
      ->type_name("N");
  plan->add_option("--lora-rank", args->lora_rank, "LoRA adapters of this rank (0: full fine-tuning)")
      ->capture_default_str();
  plan->add_option("--workers", args->workers, "Rollout workers on this machine")->capture_default_str();
  plan->add_option("--relays", args->relays, "Relays on this machine")->capture_default_str();
  plan->add_option("--batch", args->batch, "Sequences in one training step")->capture_default_str();
  plan->add_option("--worker-batch", args->worker_batch, "Sequences each worker decodes together")
      ->capture_default_str();
  plan->add_option("--serving", args->serving, "The workers' weights: bf16 or fp8")
      ->check(CLI::IsMember({"bf16", "fp8"}))
      ->capture_default_str();
  plan->add_flag("--kl", args->kl, "A KL reference copy in the trainer (algorithm.kl_coef > 0)");
  plan->add_flag("--json", args->json, "The plan as JSON");
  auto* shape = plan->add_option("--shape", args->shape, "A training shape's context, LoRA rank, worker batch and dtype")
      ->type_name("NAME");
  plan->add_option("--shapes-dir", args->shapes_dir, "Your own shapes (*.toml)")
      ->check(CLI::ExistingDirectory)
      ->type_name("DIR");
  shape->excludes(plan->get_option("--context"))->excludes(plan->get_option("--lora-rank"))
      ->excludes(plan->get_option("--worker-batch"))->excludes(plan->get_option("--serving"));
  MarkTorchOnly(plan);
  plan->callback([args, &action] { action = [args] { return RunPlan(*args); }; });
}

Status ListShapes(const std::string& dir) {
  FW_ASSIGN_OR_RETURN(std::vector<pipeline::Shape> shapes, pipeline::LoadShapes(dir));
  for (const pipeline::Shape& s : shapes) {
    std::cout << s.name << "  (" << s.source << ")\n  " << s.description << "\n  max context " << s.max_context
              << ", " << (s.mode == "lora" ? "LoRA rank " + std::to_string(s.lora_rank_min) + ".." +
                                                 std::to_string(s.lora_rank_max)
                                           : std::string("full fine-tuning"))
              << ", data-parallel ranks " << s.data_parallel_ranks << ", KV cache "
              << (s.kv_cache_mib > 0 ? std::to_string(s.kv_cache_mib) + " MiB a worker" : std::string("unbounded"))
              << "\n  sets:";
    for (const auto& [key, value] : s.Owned()) std::cout << " " << key << "=" << value;
    std::cout << "\n";
  }
  return Status::Ok();
}

void AddShapesCommand(CLI::App& app, Action& action) {
  auto dir = std::make_shared<std::string>();
  CLI::App* shapes = app.add_subcommand(
      "shapes",
      "The training shapes `flywheel demo --shape` and `flywheel train --shape` take: named\n"
      "profiles (shapes/*.toml, built in; yours in --shapes-dir) that fix the maximum context,\n"
      "full or LoRA training, the trainer's threads and ranks, the workers' batch, KV-cache\n"
      "budget and serving dtype. Lists each with the run.toml keys it owns.");
  shapes->add_option("--shapes-dir", *dir, "Your own shapes (*.toml)")
      ->check(CLI::ExistingDirectory)
      ->type_name("DIR");
  shapes->callback([dir, &action] { action = [dir] { return ListShapes(*dir); }; });
}

void AddPipelineBenchCommand(CLI::App& bench_app, Action& action) {
  auto args = std::make_shared<RlArgs>();
  CLI::App* pipeline = bench_app.add_subcommand(
      "pipeline",
      "Asynchronous against synchronous pipeline RL on the same task and budget.\n"
      "Runs the demo's fleet with max_staleness k, then 0, then both again with the trainer\n"
      "and the rollout side pinned to disjoint CPUs (as on separate GPUs), and reports RL\n"
      "samples/s and the time to the accuracy target of all four runs side by side.");
  AddConfigOptions(pipeline, *args);
  pipeline->add_option("--run-dir", args->run_dir, "Where the two runs live")->type_name("DIR");
  pipeline->add_option("--markdown", args->markdown,
                       "Write the table as the '## Pipeline benchmark' section of this file")
      ->type_name("PATH");
  pipeline->add_flag("--quiet", args->quiet, "No per-step lines");
  pipeline->add_flag("--no-pinned", args->no_pinned, "Skip the runs with pinned roles");
  MarkTorchOnly(pipeline);
  pipeline->callback([args, &action] { action = [args] { return RunPipelineBench(*args); }; });
}

}  // namespace flywheel::tools
