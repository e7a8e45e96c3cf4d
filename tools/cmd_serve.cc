// `flywheel serve-trainer` (the training service, service/serve_trainer.h) and `flywheel service`
// (serve-trainer plus a relay and rollout workers on this machine, one command, for the
// Python SDK's examples and for trying the API).
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/env.h"
#include "ops/process.h"
#include "pipeline/dashboard.h"
#include "pipeline/shapes.h"
#include "service/serve_trainer.h"  // declarations only: flywheel hands serve-trainer over
#include "tools/commands.h"

namespace flywheel::tools {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct ServeArgs {
  service::ServeTrainerOptions o;
  TokenFlags tokens;  // --token-file, --scoped-token-file
  std::string train_token_file;
  // service
  std::string run_dir;
  std::vector<std::string> regions = {"local"};
  int64_t workers = 2;
  int64_t max_batch = 64;
  int64_t max_sequence = 0;  // 0: the smaller of 1024 and the model's max_position_embeddings
  double ready_timeout_s = 120;
  std::string shape, shapes_dir;       // --shape NAME (pipeline/shapes.h), --shapes-dir DIR
  std::vector<std::string> user_flags;  // the shape-owned flags given on the command line
  int64_t shape_context = 0;            // the shape's max context (0: none)
};

// --shape for `flywheel service`: the shape's trainer threads, serving dtype, workers'
// batch and longest sequence (its max context, at most the model's), and LoRA rank (a LoRA shape: --lora-rank
// within its range, default its smallest; a full shape: none). A flag the shape owns given
// too is refused by name.
Status ApplyServiceShape(ServeArgs& a) {
  FW_ASSIGN_OR_RETURN(pipeline::Shape shape, pipeline::FindShape(a.shape, a.shapes_dir));
  auto given = [&](const std::string& flag) {
    return std::find(a.user_flags.begin(), a.user_flags.end(), flag) != a.user_flags.end();
  };
  if (shape.data_parallel_ranks != 1) {
    return Status::InvalidArgument("shape '" + shape.name + "' has " + std::to_string(shape.data_parallel_ranks) +
                                   " data-parallel trainer ranks; serve-trainer runs one");
  }
  const std::vector<std::pair<std::string, std::string>> owned = {
      {"--threads", std::to_string(shape.trainer_threads)}, {"--serving-dtype", shape.serving},
      {"--max-batch", std::to_string(shape.worker_max_batch)}, {"--max-sequence", std::to_string(shape.max_context)}};
  for (const auto& [flag, value] : owned) {
    if (given(flag)) {
      return Status::InvalidArgument(flag + " is set by shape '" + shape.name + "' (" + value +
                                     "): drop it, or choose another shape (`flywheel shapes`)");
    }
  }
  if (shape.mode == "full" && given("--lora-rank")) {
    return Status::InvalidArgument("shape '" + shape.name + "' trains full weights: drop --lora-rank");
  }
  if (shape.mode == "lora") {
    if (!given("--lora-rank")) a.o.lora_rank = shape.lora_rank_min;
    if (a.o.lora_rank < shape.lora_rank_min || a.o.lora_rank > shape.lora_rank_max) {
      return Status::InvalidArgument("--lora-rank " + std::to_string(a.o.lora_rank) + " is outside shape '" +
                                     shape.name + "''s range " + std::to_string(shape.lora_rank_min) + ".." +
                                     std::to_string(shape.lora_rank_max));
    }
  }
  a.o.threads = shape.trainer_threads;
  a.o.serving_dtype = shape.serving;
  a.max_batch = shape.worker_max_batch;
  a.shape_context = shape.max_context;  // the workers' longest sequence, within the model's limit
  return Status::Ok();
}

Status RunServeTrainer(ServeArgs args) {
  FW_ASSIGN_OR_RETURN(args.o.token, ResolveToken(args.tokens, TokenFallback::kNone));
  if (!args.train_token_file.empty()) {
    FW_ASSIGN_OR_RETURN(args.o.train_token, ReadTokenFile(args.train_token_file, "--train-token-file"));
  }
  FW_ASSIGN_OR_RETURN(args.o.scoped_tokens, ReadScopedTokens(args.tokens.scoped));
#ifdef FLYWHEEL_WITH_TORCH
  return service::RunServeTrainer(args.o);
#else
  return TorchOnly("serve-trainer");
#endif
}

std::atomic<bool> g_service_stop{false};
extern "C" void OnServiceSignal(int) { g_service_stop = true; }

Status WritePrivateFile(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return Status::IOError("cannot create " + path + ": " + std::strerror(errno));
  const bool ok = ::fchmod(fd, 0600) == 0 &&
                  ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!ok) return Status::IOError("cannot write " + path);
  return Status::Ok();
}

// serve-trainer's flags as `service` passes them on.
std::vector<std::string> ServeTrainerArgs(const ServeArgs& a) {
  const service::ServeTrainerOptions& o = a.o;
  std::vector<std::string> out;
  auto add = [&](const std::string& flag, const std::string& value) {
    if (!value.empty()) out.insert(out.end(), {flag, value});
  };
  add("--model", o.model);
  add("--preset", o.preset);
  if (o.vocab > 0) add("--vocab", std::to_string(o.vocab));
  add("--weights", o.weights);
  if (o.random_init) out.push_back("--random-init");
  if (o.lora_rank > 0) add("--lora-rank", std::to_string(o.lora_rank));
  if (o.lora_alpha > 0) add("--lora-alpha", std::to_string(o.lora_alpha));
  for (const std::string& t : o.lora_targets) add("--lora-target", t);
  add("--seed", std::to_string(o.seed));
  if (o.threads > 0) add("--threads", std::to_string(o.threads));
  add("--serving-dtype", o.serving_dtype);
  add("--pack-experts", o.pack_experts);
  add("--session-idle-timeout", std::to_string(o.session_idle_timeout_s));
  add("--seq-wait", std::to_string(o.seq_wait_s));
  add("--max-batch-tokens", std::to_string(o.max_batch_tokens));
  add("--max-body-mb", std::to_string(o.max_body_mb));
  add("--keyframe-every", std::to_string(o.keyframe_every));
  add("--max-sessions-per-token", std::to_string(o.max_sessions_per_token));
  add("--max-sessions", std::to_string(o.max_sessions));
  return out;
}

// A relay per region (upstream: the publisher) and its workers (upstreams: the relay, then
// the publisher); returns the workers' URLs once every one serves.
Result<json> StartRegions(const ServeArgs& args, ops::ProcessGroup& processes,
                          const fs::path& run, const std::string& program,
                          const std::string& token_file, const json& trainer_ready, json& relays,
                          std::chrono::milliseconds timeout) {
  std::error_code ec;
  const std::string publisher = trainer_ready.value("listen", "");
  json workers = json::array();
  int64_t max_sequence = args.max_sequence;
  if (max_sequence <= 0) {
    // The smaller of ours (the shape's max context, else 1024) and the model's limit.
    auto text = ops::ReadWholeFile(trainer_ready.value("model_config", ""));
    json config = text.ok() ? json::parse(*text, nullptr, false) : json();
    const int64_t model_limit = config.is_object() ? config.value("max_position_embeddings", int64_t{1024}) : 1024;
    max_sequence = std::min<int64_t>(args.shape_context > 0 ? args.shape_context : 1024, model_limit);
  }
  struct Pending {
    std::string name, ready;
  };
  std::vector<Pending> pending;
  for (const std::string& region : args.regions) {
    auto port = ops::FreePort();
    if (!port.ok()) return port.status();
    const std::string relay_listen = "127.0.0.1:" + std::to_string(*port);
    const std::string relay = "relay-" + region;
    const std::string relay_ready = (run / (relay + ".ready")).string();
    fs::remove(relay_ready, ec);
    auto started = processes.Start(
        relay, program,
        {"relay", "--region", region, "--node-id", relay, "--listen", relay_listen, "--http",
         "127.0.0.1:0", "--upstream", publisher, "--token-file", token_file, "--ready-file",
         relay_ready});
    if (!started.ok()) return started.status();
    pending.push_back({relay, relay_ready});
    relays.push_back(relay_listen);
    for (int64_t i = 1; i <= args.workers; ++i) {
      const std::string worker = "worker-" + region + "-" + std::to_string(i);
      const std::string ready = (run / (worker + ".ready")).string();
      fs::remove(ready, ec);
      auto w = processes.Start(
          worker, program,
          {"worker", "--region", region, "--node-id", worker, "--upstream", relay_listen,
           "--upstream", publisher, "--http", "127.0.0.1:0", "--token-file", token_file,
           "--ready-file", ready, "--model", trainer_ready.value("model_config", ""),
           "--tokenizer", trainer_ready.value("tokenizer", "auto"), "--max-batch",
           std::to_string(args.max_batch), "--max-sequence", std::to_string(max_sequence)});
      if (!w.ok()) return w.status();
      pending.push_back({worker, ready});
    }
  }
  for (const Pending& p : pending) {
    auto ready = ops::AwaitReadyFile(processes, p.ready, p.name, timeout);
    if (!ready.ok()) return ready.status();
    if (p.name.rfind("worker-", 0) == 0) workers.push_back("http://" + ready->value("http", ""));
  }
  return workers;
}

// Prints the dashboard's URL with its read-only token (serve-trainer made it in its state
// directory); returns service.json's "dashboard" (the URL without the token) and
// "dashboard_token_file".
Result<json> AnnounceDashboard(const fs::path& run, const std::string& trainer_http, bool tls) {
  const std::string token_file = (run / "state" / "dashboard.token").string();
  FW_ASSIGN_OR_RETURN(const std::string token, pipeline::DashboardToken(token_file));
  std::cout << "service: dashboard: " << pipeline::DashboardUrl(trainer_http, token, tls) << std::endl;
  return json{{"dashboard", pipeline::DashboardUrl(trainer_http, "", tls)}, {"dashboard_token_file", token_file}};
}

Status RunService(ServeArgs args) {
  if (args.run_dir.empty()) return Status::InvalidArgument("service needs --run-dir DIR");
  if (!args.shape.empty()) FW_RETURN_IF_ERROR(ApplyServiceShape(args));
  if (args.workers < 1) return Status::InvalidArgument("--workers must be >= 1");
  if (args.regions.empty()) return Status::InvalidArgument("--region: at least one");
  const fs::path run = fs::absolute(args.run_dir);
  const fs::path logs = run / "logs";
  std::error_code ec;
  fs::create_directories(logs, ec);
  if (ec) return Status::IOError("cannot create " + logs.string() + ": " + ec.message());
  fs::remove(run / "service.json", ec);
  // One token for the fleet and the training API (a local, single-user setup).
  std::string token_file = args.tokens.token_file;
  if (token_file.empty()) {
    token_file = (run / "token").string();
    if (!fs::exists(token_file)) {
      std::random_device device;
      std::ostringstream token;
      token << std::hex << device() << device() << device() << device();
      FW_RETURN_IF_ERROR(WritePrivateFile(token_file, token.str() + "\n"));
    }
  }
  const std::string program = SelfProgram();
  ops::ProcessGroup processes(logs.string());
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(args.ready_timeout_s * 1000));
  std::signal(SIGINT, OnServiceSignal);
  std::signal(SIGTERM, OnServiceSignal);
  auto fail = [&](const Status& status) {
    processes.StopAll();
    return status;
  };

  std::vector<std::string> trainer_args = {
      "serve-trainer", "--state", (run / "state").string(), "--http", "127.0.0.1:0",
      "--listen", "127.0.0.1:0", "--token-file", token_file, "--train-token-file", token_file,
      "--ready-file", (run / "trainer.ready").string()};
  for (const std::string& a : ServeTrainerArgs(args)) trainer_args.push_back(a);
  fs::remove(run / "trainer.ready", ec);
  std::cout << "service: starting serve-trainer (logs in " << logs.string() << ")" << std::endl;
  auto trainer_index = processes.Start("trainer", program, trainer_args);
  if (!trainer_index.ok()) return fail(trainer_index.status());
  auto trainer_ready = ops::AwaitReadyFile(processes, (run / "trainer.ready").string(),
                                                "serve-trainer", timeout);
  if (!trainer_ready.ok()) return fail(trainer_ready.status());
  const std::string publisher = trainer_ready->value("listen", "");
  json relays = json::array();
  auto workers = StartRegions(args, processes, run, program, token_file, *trainer_ready, relays, timeout);
  if (!workers.ok()) return fail(workers.status());
  auto dashboard = AnnounceDashboard(run, trainer_ready->value("http", ""), args.o.tls.enabled());
  if (!dashboard.ok()) return fail(dashboard.status());
  json service = {{"trainer", "http://" + trainer_ready->value("http", "")},
                        {"workers", *workers},
                        {"token_file", token_file},
                        {"publisher", publisher},
                        {"relays", relays},
                        {"mode", trainer_ready->value("mode", "full")},
                        {"logs", logs.string()},
                        {"pid", ::getpid()}};
  service.update(*dashboard);
  const std::string text = service.dump(2) + "\n";
  Status written = WriteFileAtomically((run / "service.json").string(), std::as_bytes(std::span(text)));
  if (!written.ok()) return fail(written);
  std::cout << "service: ready: training API " << service["trainer"].get<std::string>() << ", "
            << workers->size() << " workers; endpoints in " << (run / "service.json").string()
            << "\nservice: Ctrl-C stops every process" << std::endl;
  Status status = Status::Ok();
  while (!g_service_stop.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    Status running = processes.CheckAllRunning();
    if (!running.ok()) {
      status = Status(running.code(), "service: a process ended: " + running.message());
      break;
    }
  }
  std::cout << "service: stopping" << std::endl;
  fs::remove(run / "service.json", ec);
  for (const std::string& line : processes.StopAll()) std::cerr << "service: " << line << "\n";
  return status;
}

void AddServeTrainerFlags(CLI::App* app, ServeArgs& a) {
  service::ServeTrainerOptions& o = a.o;
  app->add_option("--model", o.model,
                  "HF model: a directory with config.json (and *.safetensors weights,\n"
                  "loaded unless --random-init), or a config.json")
      ->type_name("DIR|FILE");
  app->add_option("--preset", o.preset,
                  "Without --model: the demo's model, tiny or tiny-moe (default tiny), sized\n"
                  "for the demo task's characters unless --vocab")
      ->type_name("NAME");
  app->add_option("--vocab", o.vocab, "--preset's vocabulary size")->type_name("N");
  app->add_option("--weights", o.weights, "Initial weights (safetensors file or directory)")
      ->type_name("PATH");
  app->add_flag("--random-init", o.random_init, "Ignore the model directory's weights");
  app->add_option("--lora-rank", o.lora_rank,
                  "LoRA mode: sessions share the frozen base, each training its own adapter\n"
                  "of this rank (served to workers under the session's name). 0: full\n"
                  "fine-tuning, one session at a time")
      ->type_name("R");
  app->add_option("--lora-alpha", o.lora_alpha, "LoRA alpha (default 2 x rank)")->type_name("A");
  app->add_option("--lora-target", o.lora_targets,
                  "A projection that gets adapters (q_proj, ..., down_proj); repeatable;\n"
                  "default: all")
      ->type_name("NAME");
  app->add_option("--seed", o.seed, "Random initialisation (weights without a file, LoRA A)")
      ->capture_default_str();
  app->add_option("--threads", o.threads, "Compute threads (default: every core)")->type_name("N");
  app->add_option("--serving-dtype", o.serving_dtype,
                  "What workers serve: bf16, f16, f32 or fp8 (projection weights F8_E4M3\n"
                  "with 128x128 block scales, HF's FP8 layout; the rest bf16; full\n"
                  "fine-tuning only)")
      ->capture_default_str();
  app->add_option("--pack-experts", o.pack_experts,
                  "LoRA on a MoE model: hold the frozen experts packed, dequantized one\n"
                  "expert at a time: fp8 (128x128 block scales, 0.5x bf16), int8 (per-row,\n"
                  "0.5x) or int4 (per 32 inputs, 0.27x; lossy: workers serve the same\n"
                  "dequantized base the trainer uses, in bf16 or f32); none keeps fp32")
      ->capture_default_str();
  app->add_option("--session-idle-timeout", o.session_idle_timeout_s,
                  "Seconds without a call after which a session expires (its saved states stay)")
      ->capture_default_str();
  app->add_option("--seq-wait", o.seq_wait_s,
                  "Seconds a call waits for an earlier seq of its session before failing 408")
      ->capture_default_str();
  app->add_option("--max-batch-tokens", o.max_batch_tokens, "Tokens in one call's batch, at most")
      ->capture_default_str();
  app->add_option("--max-body-mb", o.max_body_mb, "Request bodies, at most (MiB)")
      ->capture_default_str();
  app->add_option("--keyframe-every", o.keyframe_every, "A full keyframe every N versions")
      ->capture_default_str();
  app->add_option("--max-sessions-per-token", o.max_sessions_per_token,
                  "Open sessions one token may hold (each session is its opener's alone)")
      ->capture_default_str();
  app->add_option("--max-sessions", o.max_sessions, "Open sessions of every token together")
      ->capture_default_str();
}

}  // namespace

void AddServiceShapeFlags(CLI::App* service, ServeArgs& args) {
  service->add_option("--shape", args.shape,
                      "A training shape (`flywheel shapes`): it sets --threads, --serving-dtype,\n"
                      "--max-batch, --max-sequence (its max context) and the LoRA rank range;\n"
                      "giving one of those too is refused")
      ->type_name("NAME");
  service->add_option("--shapes-dir", args.shapes_dir, "Your own shapes (*.toml)")
      ->check(CLI::ExistingDirectory)
      ->type_name("DIR");
}

// Which of the flags a shape owns the command line gave (ApplyServiceShape refuses them).
void NoteShapeOwnedFlags(const CLI::App& service, ServeArgs& args) {
  for (const char* flag : {"--threads", "--serving-dtype", "--max-batch", "--max-sequence", "--lora-rank"}) {
    if (service.get_option(flag)->count() > 0) args.user_flags.push_back(flag);
  }
}

void AddServeCommands(CLI::App& app, Action& action) {
  auto args = std::make_shared<ServeArgs>();

  CLI::App* serve = app.add_subcommand(
      "serve-trainer",
      "The training service: the trainer behind an HTTP API (docs/TRAINING_API.md) that a\n"
      "Python RL loop drives (python/: flywheel.TrainingClient): forward, forward_backward\n"
      "with the built-in losses or a loss written in Python, optim_step, save_state, and\n"
      "save_weights_for_sampler, which publishes a version on --listen for relays and\n"
      "workers. Sessions: one full fine-tuning session, or with --lora-rank many sessions\n"
      "sharing the base, each adapter served by name. Restarted on the same --state, it\n"
      "restores every session from its latest save_state. Stops on SIGINT/SIGTERM.");
  serve->add_option("--state", args->o.state_dir, "State directory (versions/, sessions/)")
      ->type_name("DIR")
      ->required();
  AddServeTrainerFlags(serve, *args);
  serve->add_option("--http", args->o.http, "The training API, /v1/status and /metrics")
      ->type_name("HOST:PORT")
      ->capture_default_str();
  serve->add_option("--listen", args->o.listen, "The publisher's port for relays and workers")
      ->type_name("HOST:PORT")
      ->capture_default_str();
  serve->add_option("--publisher-http", args->o.publisher_http, "The publisher's status endpoint")
      ->type_name("HOST:PORT")
      ->capture_default_str();
  AddTokenFileFlag(serve, args->tokens, "The fleet's token (relays and workers subscribing)");
  serve->add_option("--train-token-file", args->train_token_file,
                    "The training API's token (scopes train and read). Without any token the\n"
                    "API is open: bind it to loopback")
      ->type_name("F");
  AddScopedTokenFlag(
      serve, args->tokens,
      "A further token with its own scopes, SCOPES:FILE (train, read, ...); repeatable");
  AddTlsFlags(serve, args->o.tls, "TLS certificate chain (PEM): TLS 1.3 on every port",
              "Clients must present a certificate from this CA");
  serve->add_option("--signing-key", args->o.signing_key, "Sign every published version (Ed25519)")
      ->type_name("F");
  serve->add_option("--ready-file", args->o.ready_file, "Write the bound endpoints here (JSON)")
      ->type_name("F");
  serve->footer(
      "\nExamples:\n"
      "  flywheel serve-trainer --state /tmp/st --http 127.0.0.1:8100\n"
      "  flywheel serve-trainer --state st --model Qwen3-0.6B/ --lora-rank 16 --train-token-file t\n"
      "See also `flywheel service`, which starts it with a relay and workers.");
  MarkTorchOnly(serve);
  serve->callback([args, &action] { action = [args] { return RunServeTrainer(*args); }; });

  CLI::App* service = app.add_subcommand(
      "service",
      "serve-trainer plus a relay and rollout workers on this machine, in one command: what\n"
      "the Python SDK's examples run against (examples/rl_sort.py). Writes the endpoints to\n"
      "<run-dir>/service.json ({trainer, workers, token_file}) once every process serves, and\n"
      "runs until Ctrl-C (or until one of them ends), then stops them all.");
  service->add_option("--run-dir", args->run_dir, "Where state, logs, token and service.json go")
      ->type_name("DIR")
      ->required();
  AddServeTrainerFlags(service, *args);
  service->add_option("--workers", args->workers, "Rollout workers per region")->capture_default_str();
  service->add_option("--region", args->regions, "A region (one relay each); repeatable")
      ->capture_default_str();
  service->add_option("--max-batch", args->max_batch, "Each worker's engine batch")->capture_default_str();
  service->add_option("--max-sequence", args->max_sequence,
                      "Each worker's longest sequence (default: the smaller of 1024 and the\n"
                      "model's max_position_embeddings)")
      ->type_name("N");
  AddTokenFileFlag(service, args->tokens,
                   "The token for everything (default: a new one in <run-dir>/token)");
  service->add_option("--ready-timeout", args->ready_timeout_s, "Seconds for each process to start")
      ->capture_default_str();
  service->footer(
      "\nExamples:\n"
      "  flywheel service --run-dir /tmp/svc\n"
      "  flywheel service --run-dir /tmp/svc --lora-rank 8 --workers 1\n"
      "  python3 examples/rl_sort.py --service /tmp/svc");
  AddServiceShapeFlags(service, *args);
  service->callback([args, service, &action] {
    NoteShapeOwnedFlags(*service, *args);
    action = [args] { return RunService(*args); };
  });
}

}  // namespace flywheel::tools
