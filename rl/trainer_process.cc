#include "rl/trainer_process.h"

#include <chrono>
#include <csignal>
#include <sys/resource.h>
#include <unistd.h>
#include <iostream>
#include <filesystem>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include <spdlog/spdlog.h>

#include "delta/delta_file.h"
#include "model/fp8.h"
#include "model/weights.h"
#include "tokenizer/chat_template.h"
#include "ops/metrics.h"
#include "pipeline/dashboard.h"
#include "pipeline/shapes.h"
#include "push/push_api.h"
#include "transport/api.h"
#include "transport/connection.h"
#include "transport/http.h"

namespace flywheel::rl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::atomic<bool> g_stop{false};
extern "C" void OnStopSignal(int) { g_stop = true; }

Status WriteText(const std::string& path, const std::string& text) {
  return delta::WriteFileAtomically(path, std::as_bytes(std::span(text)));
}

Status CheckOptions(const TrainRunOptions& options) {
  const pipeline::RunConfig& config = options.config;
  FW_RETURN_IF_ERROR(config.Validate());
  if (config.sft.steps > 0 && config.sft.dataset.empty()) {
    return Status::InvalidArgument("sft.steps = " + std::to_string(config.sft.steps) +
                                   " needs sft.dataset (a JSONL file of chat examples)");
  }
  if (config.dpo.steps > 0 && config.dpo.dataset.empty()) {
    return Status::InvalidArgument("dpo.steps = " + std::to_string(config.dpo.steps) +
                                   " needs dpo.dataset (a JSONL file of preference pairs)");
  }
  if (options.state_dir.empty() || options.report_dir.empty()) {
    return Status::InvalidArgument("the trainer needs a state directory and a report directory");
  }
  return Status::Ok();
}

Result<sync::PublisherOptions> MakePublisherOptions(const TrainRunOptions& options) {
  const pipeline::RunConfig& config = options.config;
  sync::PublisherOptions publisher;
  publisher.common.region = "home";
  publisher.common.node_id = "trainer";
  FW_ASSIGN_OR_RETURN(publisher.common.http, transport::ParseEndpoint(options.publisher_http));
  publisher.common.token = options.token;
  publisher.common.scoped_tokens = options.scoped_tokens;
  publisher.common.tls = options.tls;
  publisher.signing_key = options.signing_key;
  publisher.common.wan_rate = config.fleet.wan_rate_mbit * 1e6 / 8;
  publisher.common.wan_latency_ms = config.fleet.wan_latency_ms;
  FW_ASSIGN_OR_RETURN(publisher.listen, transport::ParseEndpoint(options.listen));
  publisher.log.dir = (fs::path(options.state_dir) / "versions").string();
  publisher.log.keyframe_every = static_cast<uint64_t>(config.fleet.keyframe_every);
  publisher.log.retain = 2 * static_cast<uint64_t>(config.fleet.keyframe_every);
  publisher.max_staleness = static_cast<uint64_t>(config.pipeline.max_staleness);
  // The ledger, readiness and wait routes; push routes answer 403 (no push token).
  sync::EnablePushApi(publisher, sync::PushOptions{});
  return publisher;
}

pipeline::CoordinatorOptions MakeCoordinatorOptions(const pipeline::RunConfig& config,
                                                    const RunSetup& setup, uint64_t rows_done) {
  pipeline::CoordinatorOptions c;
  c.group_size = config.algorithm.group_size;
  c.groups_per_step = config.algorithm.groups_per_step;
  c.max_staleness = config.pipeline.max_staleness;
  c.lease = std::chrono::milliseconds(static_cast<int64_t>(config.pipeline.lease_s * 1000));
  c.temperature = config.algorithm.temperature;
  c.max_tokens = setup.max_tokens;
  c.vocab_size = setup.tokenizer->vocab_size();
  c.max_prompt_tokens = setup.max_prompt_tokens;  // BOS + prompt
  c.moe_layers = setup.model_config.NumMoeLayers();
  c.top_k = setup.model_config.num_experts_per_tok;
  c.num_experts = setup.model_config.num_experts;
  c.seed = static_cast<uint64_t>(config.run.seed) * 7919 + rows_done;
  c.zero_variance_filter = config.algorithm.zero_variance_filter;
  c.max_turns = config.grading.max_turns;
  c.max_episode_tokens = config.grading.max_episode_tokens;
  std::shared_ptr<const model::Tokenizer> tokenizer = setup.tokenizer;
  c.decode = [tokenizer](const std::vector<int32_t>& tokens) -> Result<std::string> {
    std::vector<int32_t> ids = tokens;
    if (!ids.empty() && ids.back() == tokenizer->eos()) ids.pop_back();
    return tokenizer->Decode(ids);
  };
  return c;
}

// A rendered JSON answer, or the error in the one shape (transport/api.h).
transport::HttpResponse JsonAnswer(Result<std::string> answer) {
  if (!answer.ok()) return transport::ErrorResponse(answer.status());
  return transport::HttpResponse{200, "application/json", std::move(answer).value()};
}

}  // namespace

grading::GraderSettings MakeGraderSettings(const pipeline::RunConfig& config) {
  grading::GraderSettings settings;
  settings.command = config.grading.command;
  settings.url = config.grading.url;
  settings.builtin = config.graders;
  if (settings.command.empty() && settings.url.empty() && settings.builtin.empty()) {
    settings.builtin.push_back({.type = "exact_match", .name = "", .weight = 1.0,
                                .params = nlohmann::json{{"field", "answer"}}});
  }
  settings.options.timeout = std::chrono::milliseconds(static_cast<int64_t>(config.grading.timeout_s * 1000));
  settings.options.max_grader_failures = static_cast<int>(config.grading.max_failures);
  settings.options.max_in_flight = static_cast<size_t>(config.grading.max_in_flight);
  return settings;
}

Result<model::ModelConfig> MakeModelConfig(const pipeline::RunConfig& config, int64_t vocab) {
  if (!config.model.config.empty()) {
    FW_ASSIGN_OR_RETURN(model::ModelConfig loaded, model::ModelConfig::Load(config.model.config));
    if (loaded.vocab_size < vocab) {
      return Status::InvalidArgument("model.config " + config.model.config + " has vocab_size " +
                                     std::to_string(loaded.vocab_size) + ", the task needs " +
                                     std::to_string(vocab));
    }
    return loaded;
  }
  model::ModelConfig c = model::PipelineTinyConfig(vocab, config.model.preset == "tiny-moe");
  FW_RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<ModelDir> LoadModelDir(const std::string& dir) {
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return Status::InvalidArgument("model.dir " + dir + " is not a directory");
  const auto need = [&](const char* file, const std::string& what) -> Status {
    if (fs::exists(root / file, ec)) return Status::Ok();
    return Status::InvalidArgument((root / file).string() + " is missing (" + what + ")");
  };
  FW_RETURN_IF_ERROR(need("config.json", "the model's HF config"));
  ModelDir loaded;
  const bool sharded = fs::exists(root / "model.safetensors.index.json", ec);
  if (!sharded) FW_RETURN_IF_ERROR(need("model.safetensors", "the weights, or model.safetensors.index.json with shards"));
  loaded.weights = (root / (sharded ? "model.safetensors.index.json" : "model.safetensors")).string();
  FW_RETURN_IF_ERROR(need("tokenizer.json", "the HF tokenizer the workers serve"));
  Result<model::ModelConfig> config = model::ModelConfig::Load((root / "config.json").string());
  if (!config.ok()) return Status::InvalidArgument(config.status().message());
  loaded.config = std::move(*config);
  Result<std::unique_ptr<tokenizer::HfTokenizer>> hf = tokenizer::HfTokenizer::Load(dir);
  if (!hf.ok()) return Status::InvalidArgument((root / "tokenizer.json").string() + ": " + hf.status().message());
  if ((*hf)->vocab_size() > loaded.config.vocab_size) {
    return Status::InvalidArgument((root / "config.json").string() + ": vocab_size " +
                                   std::to_string(loaded.config.vocab_size) + " is smaller than " +
                                   (root / "tokenizer.json").string() + "'s " +
                                   std::to_string((*hf)->vocab_size()) + " tokens");
  }
  if ((*hf)->bos() < 0 || (*hf)->eos() < 0) {
    return Status::InvalidArgument((root / "tokenizer_config.json").string() +
                                   ": needs bos_token and eos_token (the workers prepend BOS, stop at EOS)");
  }
  loaded.tokenizer = std::move(*hf);
  return loaded;
}

namespace {

// The prompt text of a dataset line: the model's chat template with add_generation_prompt,
// or, without a template, the last message's content.
Result<pipeline::PromptRenderer> MakeRenderer(const RunSetup& setup, const std::string& dir) {
  const auto* hf = dynamic_cast<const tokenizer::HfTokenizer*>(setup.tokenizer.get());
  if (hf == nullptr || hf->chat_template().empty()) {
    return pipeline::PromptRenderer([](const nlohmann::ordered_json& messages) -> Result<std::string> {
      const nlohmann::ordered_json& content = messages.back().value("content", nlohmann::ordered_json());
      if (!content.is_string()) return Status::InvalidArgument("the last message has no string content");
      return content.get<std::string>();
    });
  }
  Result<tokenizer::ChatTemplate> parsed = tokenizer::ChatTemplate::Parse(hf->chat_template());
  if (!parsed.ok()) {
    return Status::InvalidArgument((fs::path(dir) / "tokenizer_config.json").string() +
                                   ": chat template: " + parsed.status().message());
  }
  auto chat = std::make_shared<tokenizer::ChatTemplate>(std::move(*parsed));
  const std::string bos = hf->bos_token(), eos = hf->eos_token();
  return pipeline::PromptRenderer([chat, bos, eos](const nlohmann::ordered_json& messages) {
    nlohmann::ordered_json context = {{"messages", messages}, {"add_generation_prompt", true},
                                      {"bos_token", bos}, {"eos_token", eos}};
    return chat->Render(context);
  });
}

// The tokenizer and the model: the task alphabet's and the preset's, or model.dir's.
Status SetUpModel(const pipeline::RunConfig& config, const std::string& alphabet, RunSetup& setup) {
  if (!config.model.dir.empty()) {
    FW_ASSIGN_OR_RETURN(ModelDir dir, LoadModelDir(config.model.dir));
    setup.model_config = std::move(dir.config);
    setup.init_weights = dir.weights;
    setup.tokenizer = std::move(dir.tokenizer);
    setup.worker_tokenizer = fs::absolute(config.model.dir).string();
    return Status::Ok();
  }
  FW_ASSIGN_OR_RETURN(std::unique_ptr<model::CharTokenizer> chars, model::CharTokenizer::Create(alphabet));
  setup.tokenizer = std::move(chars);
  setup.worker_tokenizer = "chars:" + alphabet;
  FW_ASSIGN_OR_RETURN(setup.model_config, MakeModelConfig(config, setup.tokenizer->vocab_size()));
  return Status::Ok();
}

Status SetUpTask(const pipeline::RunConfig& config, RunSetup& setup) {
  if (config.task.dataset.empty()) return Status::Ok();
  FW_ASSIGN_OR_RETURN(pipeline::PromptRenderer render, MakeRenderer(setup, config.model.dir));
  pipeline::TaskFileCounts counts;
  FW_ASSIGN_OR_RETURN(setup.task, pipeline::Task::FromFiles(
                                      config.task.dataset, config.task.eval_dataset, render,
                                      [](const std::string& line) { spdlog::warn("{}", line); }, &counts,
                                      config.task.eval_fraction));
  if (counts.skipped > 0) {
    spdlog::warn("task.dataset: {} lines skipped ({} training, {} held-out lines used)", counts.skipped,
                 counts.train_lines, counts.eval_lines);
  }
  return Status::Ok();
}

}  // namespace

Result<RunSetup> PrepareRun(const TrainRunOptions& options) {
  FW_RETURN_IF_ERROR(CheckOptions(options));
  std::error_code ec;
  fs::create_directories(options.state_dir, ec);
  fs::create_directories(options.report_dir, ec);
  if (ec) return Status::IOError("cannot create " + options.state_dir + " or " + options.report_dir);
  RunSetup setup;
  FW_ASSIGN_OR_RETURN(setup.task, pipeline::Task::Create(options.config.task));
  FW_RETURN_IF_ERROR(SetUpModel(options.config, setup.task->alphabet(), setup));
  FW_RETURN_IF_ERROR(SetUpTask(options.config, setup));
  setup.model_config_path = (fs::path(options.state_dir) / "config.json").string();
  nlohmann::json config_json = setup.model_config.ToJson();
  // FP8 serving: workers read the block size from here (rollout/worker_engine.h).
  if (options.config.model.serving == "fp8")
    config_json["quantization_config"] = model::Fp8QuantizationConfig(model::kFp8BlockSize);
  FW_RETURN_IF_ERROR(WriteText(setup.model_config_path, config_json.dump(2)));
  const pipeline::RunConfig& config = options.config;
  if (config.algorithm.max_tokens > 0) {
    setup.max_tokens = config.algorithm.max_tokens;
  } else if (setup.task->max_answer_chars() > 0) {
    setup.max_tokens = setup.task->max_answer_chars() + 1;
  } else {
    return Status::InvalidArgument("task.dataset " + config.task.dataset +
                                   " has no \"answer\" to size completions by: set algorithm.max_tokens");
  }
  setup.max_prompt_tokens = 1 + setup.task->max_prompt_chars();
  setup.max_turns = config.grading.max_turns;
  setup.max_episode_tokens = config.grading.max_episode_tokens;
  if (setup.max_turns > 1 && setup.max_tokens >= setup.max_episode_tokens) {
    return Status::InvalidArgument("grading.max_episode_tokens = " + std::to_string(setup.max_episode_tokens) +
                                   " leaves no room for an episode of turns of up to " +
                                   std::to_string(setup.max_tokens) + " tokens (algorithm.max_tokens)");
  }
  return setup;
}

Status WriteTinyModelDir(const pipeline::RunConfig& config, const std::string& dir) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<pipeline::Task> task, pipeline::Task::Create(config.task));
  const std::string alphabet = task->alphabet();
  pipeline::RunConfig preset = config;
  preset.model.dir.clear();
  FW_ASSIGN_OR_RETURN(model::ModelConfig model_config,
                      MakeModelConfig(preset, static_cast<int64_t>(alphabet.size()) + 2));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IOError("cannot create " + dir + ": " + ec.message());
  // Exactly the trainer's own initialisation for run.seed (trainer/training_client.cc).
  torch::manual_seed(static_cast<uint64_t>(config.run.seed));
  auto model = std::make_shared<model::TransformerImpl>(model_config);
  const fs::path root(dir);
  FW_RETURN_IF_ERROR(model::SaveModel(*model, (root / "model.safetensors").string(), DType::kF32));
  FW_RETURN_IF_ERROR(WriteText((root / "config.json").string(), model_config.ToJson().dump(2) + "\n"));
  FW_RETURN_IF_ERROR(WriteText((root / "tokenizer.json").string(), pipeline::TinyTokenizerJson(alphabet)));
  return WriteText((root / "tokenizer_config.json").string(), pipeline::TinyTokenizerConfigJson());
}

struct TrainerServices::Impl {
  transport::asio::io_context io{1};
  transport::asio::executor_work_guard<transport::asio::io_context::executor_type> work =
      transport::asio::make_work_guard(io);
  std::unique_ptr<sync::Publisher> publisher;
  std::unique_ptr<pipeline::Coordinator> coordinator;
  // After the coordinator: destroyed first, its last callbacks still reach the coordinator.
  std::unique_ptr<grading::AsyncGrader> grader;
  std::unique_ptr<transport::HttpServer> http;
  // Parses rollout submissions (up to 64 MiB of JSON each) off the I/O thread, which also
  // runs the publisher and answers heartbeats; two at a time, the rest wait their turn.
  transport::asio::thread_pool parse_pool{2};
  // Multi-turn: POST /v1/rollout/turn waits for the environment (up to its timeout) here.
  transport::asio::thread_pool turn_pool{4};
  std::thread thread;
  std::mutex status_mutex;
  TrainerStatus status;  // GUARDED_BY(status_mutex); its coordinator part is filled when read
  std::shared_ptr<pipeline::DashboardFeed> dashboard;
  std::string dashboard_url;  // without its token

  void AddRoutes();
  json StatusJson();
  ~Impl();
};

void TrainerServices::Impl::AddRoutes() {
  pipeline::Coordinator* coordinator_ptr = coordinator.get();
  http->RoutePost(
      "/v1/rollout/claim",
      [coordinator_ptr](std::string, std::string body) -> transport::awaitable<transport::HttpResponse> {
        co_return JsonAnswer(coordinator_ptr->HandleClaim(body));
      },
      1 << 20, transport::kScopeSubmit);
  transport::asio::thread_pool* pool = &parse_pool;
  http->RoutePost(
      "/v1/rollout/submit",
      [coordinator_ptr, pool](std::string, std::string body) -> transport::awaitable<transport::HttpResponse> {
        auto parse = [coordinator_ptr, body = std::move(body)] { return coordinator_ptr->HandleSubmit(body); };
        // Named first: GCC 12 mishandles temporaries inside a co_await full-expression.
        transport::awaitable<std::optional<std::string>> call = transport::RunOn(*pool, std::move(parse));
        std::optional<std::string> answer = co_await std::move(call);
        if (!answer) co_return transport::ErrorResponse(Status::Unavailable("the trainer is stopping"));
        co_return transport::HttpResponse{200, "application/json", std::move(*answer)};
      },
      64 << 20, transport::kScopeSubmit);
  http->RoutePost(
      "/v1/rollout/turn",
      [coordinator_ptr, pool = &turn_pool](std::string, std::string body) -> transport::awaitable<transport::HttpResponse> {
        // Waits for the environment: off the I/O thread, on a pool of its own, so that slow
        // turns never hold up submissions.
        auto turn = [coordinator_ptr, body = std::move(body)] { return coordinator_ptr->HandleTurn(body); };
        // Named first: GCC 12 mishandles temporaries inside a co_await full-expression.
        transport::awaitable<std::optional<Result<std::string>>> call = transport::RunOn(*pool, std::move(turn));
        std::optional<Result<std::string>> answer = co_await std::move(call);
        if (!answer) co_return transport::ErrorResponse(Status::Unavailable("the trainer is stopping"));
        co_return JsonAnswer(std::move(*answer));
      },
      16 << 20, transport::kScopeSubmit);
  transport::AddStatusRoutes(*http, [this] { return StatusJson(); }, ops::MetricsText);
  // The dashboard's live part runs on the I/O thread, the publisher's own.
  dashboard->SetLive([this] {
    return json{{"status", StatusJson()}, {"publisher", sync::ToJson(publisher->CurrentStatus())}};
  });
  pipeline::AddDashboardRoutes(*http, dashboard);
}

json TrainerServices::Impl::StatusJson() {
  TrainerStatus answer;
  {
    std::lock_guard lock(status_mutex);
    answer = status;
  }
  // The coordinator's counters live (the rest is as of the last step).
  answer.coordinator = coordinator->stats();
  answer.queued_groups = coordinator->queued();
  return ToJson(answer);
}

json ToJson(const TrainerStatus& s) {
  json out = {{"role", "trainer"}, {"phase", s.phase}, {"step", s.step}, {"version", s.version}};
  if (s.stepped) {
    out["accuracy"] = s.accuracy;
    out["mean_reward"] = s.mean_reward;
    out["resumed"] = s.resumed;
  }
  const pipeline::CoordinatorStats& c = s.coordinator;
  out["claims"] = c.claims;
  out["groups_accepted"] = c.groups_accepted;
  out["groups_trained"] = c.groups_trained;
  out["samples_dropped_stale"] = c.samples_dropped_stale;
  out["leases_expired"] = c.leases_expired;
  out["submissions_refused"] = c.submissions_refused;
  out["groups_by_worker"] = c.groups_by_worker;
  out["leases_by_worker"] = c.leases_by_worker;
  out["last_error_by_worker"] = c.last_error_by_worker;
  out["queued_groups"] = s.queued_groups;
  out["samples_graded"] = c.samples_graded;
  out["samples_ungraded"] = c.samples_ungraded;
  out["groups_zero_variance"] = c.groups_zero_variance;
  out["groups_too_few_graded"] = c.groups_too_few_graded;
  out["groups_grading"] = c.groups_grading;
  out["episodes"] = c.episodes;
  out["episode_turns"] = c.episode_turns;
  out["episode_env_tokens"] = c.episode_env_tokens;
  out["episode_model_tokens"] = c.episode_model_tokens;
  out["episodes_max_turns"] = c.episodes_max_turns;
  return out;
}

TrainerServices::Impl::~Impl() {
  if (http) {
    std::promise<void> stopped;
    transport::asio::post(io, [&] {
      http->Stop();
      stopped.set_value();
    });
    // Before the thread runs (a failed Start) nothing answers: do not wait for long.
    stopped.get_future().wait_for(std::chrono::seconds(thread.joinable() ? 5 : 0));
  }
  if (publisher) publisher->Stop();
  work.reset();
  io.stop();
  if (thread.joinable()) thread.join();
  parse_pool.join();  // a parse still running refers to the coordinator
  turn_pool.join();   // so does a turn (the grader, alive until after this, answers it)
}

TrainerServices::TrainerServices(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TrainerServices::~TrainerServices() = default;

Result<std::unique_ptr<TrainerServices>> TrainerServices::Start(const TrainRunOptions& options,
                                                                const RunSetup& setup,
                                                                uint64_t rows_done) {
  auto impl = std::make_unique<Impl>();
  FW_ASSIGN_OR_RETURN(sync::PublisherOptions publisher_options, MakePublisherOptions(options));
  FW_ASSIGN_OR_RETURN(impl->publisher, sync::Publisher::Start(impl->io.get_executor(), publisher_options));
  Result<std::unique_ptr<grading::AsyncGrader>> grader = grading::StartGrader(MakeGraderSettings(options.config));
  if (!grader.ok()) return grader.status().WithContext("starting the grader");
  impl->grader = std::move(*grader);
  pipeline::CoordinatorOptions coordinator_options = MakeCoordinatorOptions(options.config, setup, rows_done);
  coordinator_options.grader = impl->grader.get();
  impl->coordinator = std::make_unique<pipeline::Coordinator>(*setup.task, std::move(coordinator_options));
  transport::HttpServerOptions http_options;
  http_options.token = options.token;
  http_options.scoped_tokens = options.scoped_tokens;
  std::string dashboard_token;
  if (!options.token.empty() || !options.scoped_tokens.empty()) {
    // A read-only token of the dashboard's own, kept across restarts: the URL printed at
    // start never carries the fleet's token.
    FW_ASSIGN_OR_RETURN(dashboard_token, pipeline::DashboardToken(DashboardTokenPath(options.state_dir)));
    http_options.scoped_tokens.push_back({dashboard_token, transport::kScopeRead});
  }
  impl->dashboard = std::make_shared<pipeline::DashboardFeed>(DashboardRun(options.config));
  if (options.tls.enabled()) {
    // Rollout samples (training data) and bearer tokens cross regions: TLS like every
    // other port, mutual when a CA is given.
    FW_ASSIGN_OR_RETURN(http_options.tls, transport::MakeServerTlsContext(options.tls));
  }
  FW_ASSIGN_OR_RETURN(transport::Endpoint http_endpoint, transport::ParseEndpoint(options.http));
  FW_ASSIGN_OR_RETURN(impl->http,
                      transport::HttpServer::Start(impl->io.get_executor(), http_endpoint, http_options));
  impl->AddRoutes();
  impl->dashboard_url = pipeline::DashboardUrl("127.0.0.1:" + std::to_string(impl->http->port()), "",
                                               options.tls.enabled());
  if (!options.quiet && (options.ready_file.empty() || ::isatty(STDOUT_FILENO) != 0)) {
    // The token only on a terminal: a log file keeps the URL, and says where the token is.
    // (Under `flywheel demo`, which passes --ready-file, the demo prints the URL.)
    std::cout << "dashboard: "
              << (dashboard_token.empty() || ::isatty(STDOUT_FILENO) == 0
                      ? impl->dashboard_url + (dashboard_token.empty() ? "" : " (its token: " + DashboardTokenPath(options.state_dir) + ")")
                      : pipeline::DashboardUrl("127.0.0.1:" + std::to_string(impl->http->port()), dashboard_token, options.tls.enabled()))
              << std::endl;
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<TrainerServices>(new TrainerServices(std::move(impl)));
}

sync::Publisher& TrainerServices::publisher() { return *impl_->publisher; }
uint16_t TrainerServices::http_port() const { return impl_->http->port(); }
pipeline::Coordinator& TrainerServices::coordinator() { return *impl_->coordinator; }
grading::AsyncGrader& TrainerServices::grader() { return *impl_->grader; }

sync::PublisherStatus TrainerServices::PublisherStatusNow() {
  std::promise<sync::PublisherStatus> answer;
  transport::asio::post(impl_->io, [&] { answer.set_value(impl_->publisher->CurrentStatus()); });
  return answer.get_future().get();
}

Status TrainerServices::WriteReadyFile(const std::string& path, const RunSetup& setup) const {
  const json ready = {{"listen", "127.0.0.1:" + std::to_string(impl_->publisher->port())},
                      {"http", "127.0.0.1:" + std::to_string(impl_->http->port())},
                      {"publisher_http", "127.0.0.1:" + std::to_string(impl_->publisher->http_port())},
                      {"model_config", setup.model_config_path},
                      {"dashboard", impl_->dashboard_url},
                      {"tokenizer", setup.worker_tokenizer},
                      // BOS + the longest prompt + a completion, and one spare position.
                      {"max_sequence", setup.max_prompt_tokens + 1 +
                                           (setup.max_turns > 1 ? setup.max_episode_tokens : setup.max_tokens)}};
  return WriteText(path, ready.dump());
}

void TrainerServices::SetPhase(const std::string& phase) {
  std::lock_guard lock(impl_->status_mutex);
  impl_->status.phase = phase;
}

void TrainerServices::NoteStep(const pipeline::StepRow& row, uint64_t version, double accuracy,
                               bool resumed) {
  std::lock_guard lock(impl_->status_mutex);
  TrainerStatus& s = impl_->status;
  s.step = row.step;
  s.version = version;
  s.stepped = true;
  s.accuracy = accuracy;
  s.mean_reward = row.mean_reward;
  s.resumed = resumed;
  const pipeline::CoordinatorStats stats = impl_->coordinator->stats();
  impl_->dashboard->AddStep(row, json{{"samples_ungraded", stats.samples_ungraded},
                                      {"groups_zero_variance", stats.groups_zero_variance}});
}

model::MemoryPlan PlanRunMemory(const TrainRunOptions& options, const RunSetup& setup) {
  const pipeline::RunConfig& config = options.config;
  model::PlanInputs in;
  in.model = setup.model_config;
  in.context = setup.max_prompt_tokens + 1 + (setup.max_turns > 1 ? setup.max_episode_tokens : setup.max_tokens);
  in.train_sequences = std::max<int64_t>(config.algorithm.group_size * config.algorithm.groups_per_step,
                                         config.sft.steps > 0 ? config.sft.batch_size : 0);
  in.reference = config.algorithm.kl_coef > 0;
  in.serving_bytes_per_weight = config.model.serving == "fp8" ? 1.0 : 2.0;
  in.worker_max_batch = config.fleet.worker_max_batch;
  if (options.local_fleet) {
    in.relays = static_cast<int64_t>(config.fleet.regions.size());
    in.workers = in.relays * config.fleet.workers_per_region;
  } else {
    in.workers = 0;
  }
  return model::PlanMemory(in);
}

Status CheckRunMemory(const TrainRunOptions& options, const RunSetup& setup) {
  const pipeline::RunConfig& config = options.config;
  const int64_t context = setup.max_prompt_tokens + 1 + (setup.max_turns > 1 ? setup.max_episode_tokens : setup.max_tokens);
  FW_RETURN_IF_ERROR(pipeline::CheckShapeLimits(
      config, context, model::KvCacheBytes(setup.model_config, config.fleet.worker_max_batch, -1, context)));
  if (!config.run.check_memory) return Status::Ok();
  const model::MemoryPlan plan = PlanRunMemory(options, setup);
  if (plan.fits()) return Status::Ok();
  return Status::ResourceExhausted(
      "this run does not fit in this machine's memory, so it was not started (run.check_memory = "
      "false starts it anyway):\n" + plan.Table());
}

Status WriteMemoryRecord(const TrainRunOptions& options, const RunSetup& setup) {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  const json record = {{"plan", json::parse(PlanRunMemory(options, setup).Json())},
                       {"trainer_peak_rss_bytes", static_cast<uint64_t>(usage.ru_maxrss) * 1024}};
  return WriteText((fs::path(options.report_dir) / "memory.json").string(), record.dump(2) + "\n");
}

pipeline::DashboardFeed& TrainerServices::dashboard() { return *impl_->dashboard; }

std::string DashboardTokenPath(const std::string& state_dir) {
  return (fs::path(state_dir) / "dashboard.token").string();
}

json DashboardRun(const pipeline::RunConfig& config) {
  const std::string task = config.task.dataset.empty()
                               ? config.task.name + "-" + std::to_string(config.task.digits)
                               : fs::path(config.task.dataset).filename().string();
  const std::string model = !config.model.dir.empty()      ? fs::path(config.model.dir).filename().string()
                            : !config.model.config.empty() ? config.model.config
                                                           : config.model.preset;
  return json{{"title", task + " · " + model + " · " + config.algorithm.name},
              {"source", "live"},
              {"group_size", config.algorithm.group_size},
              {"max_staleness", config.pipeline.max_staleness}};
}

void InstallStopSignals() {
  std::signal(SIGINT, OnStopSignal);
  std::signal(SIGTERM, OnStopSignal);
}
bool StopRequested() { return g_stop.load(); }
const std::atomic<bool>& StopFlag() { return g_stop; }

}  // namespace flywheel::rl
