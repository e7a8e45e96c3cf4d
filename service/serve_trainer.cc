#include "service/serve_trainer.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "base/env.h"
#include "model/fp8.h"
#include "model/packed.h"
#include "model/model_config.h"
#include "pipeline/dashboard.h"
#include "pipeline/task.h"
#include "push/push_api.h"
#include "rl/trainer_process.h"
#include "service/training_service.h"
#include "sync/publisher.h"
#include "transport/tls.h"

namespace flywheel::service {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

Status WriteText(const std::string& path, const std::string& text) {
  return WriteFileAtomically(path, std::as_bytes(std::span(text)));
}

bool HasSafetensors(const fs::path& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".safetensors") return true;
  }
  return false;
}

// The model and what workers load with it: its config.json and a tokenizer.
Status ChooseModel(const ServeTrainerOptions& o, trainer::TrainerOptions& t,
                   std::string& model_config_path, std::string& tokenizer) {
  std::error_code ec;
  tokenizer = "auto";
  if (!o.model.empty()) {
    const fs::path given = o.model;
    const bool is_dir = fs::is_directory(given, ec);
    const fs::path config_path = is_dir ? given / "config.json" : given;
    FW_ASSIGN_OR_RETURN(t.config, model::ModelConfig::Load(config_path.string()));
    model_config_path = fs::absolute(config_path).string();
    // An FP8 model directory's own block size, which its workers will read from there too.
    if (t.fp8_serving) {
      FW_ASSIGN_OR_RETURN(t.fp8_block, model::Fp8BlockFromConfig(model_config_path));
    }
    if (!o.weights.empty()) {
      t.init_weights = o.weights;
    } else if (is_dir && !o.random_init && HasSafetensors(given)) {
      t.init_weights = given.string();
    }
    if (is_dir) tokenizer = fs::absolute(given).string();
  } else {
    const std::string preset = o.preset.empty() ? "tiny" : o.preset;
    if (preset != "tiny" && preset != "tiny-moe")
      return Status::InvalidArgument("--preset must be tiny or tiny-moe, got " + preset);
    // The demo's model for the demo's task: its characters plus BOS and EOS.
    FW_ASSIGN_OR_RETURN(auto task, pipeline::Task::Create({}));
    const std::string alphabet = task->alphabet();
    const int64_t vocab = o.vocab > 0 ? o.vocab : static_cast<int64_t>(alphabet.size()) + 2;
    t.config = model::PipelineTinyConfig(vocab, preset == "tiny-moe");
    FW_RETURN_IF_ERROR(t.config.Validate());
    model_config_path = fs::absolute(fs::path(o.state_dir) / "config.json").string();
    json config = t.config.ToJson();
    // Workers read the FP8 block size from here (rollout/worker_engine.h).
    if (t.fp8_serving) config["quantization_config"] = model::Fp8QuantizationConfig(t.fp8_block);
    FW_RETURN_IF_ERROR(WriteText(model_config_path, config.dump(2) + "\n"));
    tokenizer = vocab >= static_cast<int64_t>(alphabet.size()) + 2 ? "chars:" + alphabet : "byte";
    if (!o.weights.empty()) t.init_weights = o.weights;
  }
  return Status::Ok();
}

Result<TrainingServiceOptions> ServiceOptions(const ServeTrainerOptions& o,
                                              std::string& model_config_path,
                                              std::string& tokenizer) {
  if (o.state_dir.empty()) return Status::InvalidArgument("serve-trainer needs --state DIR");
  if (!o.model.empty() && !o.preset.empty())
    return Status::InvalidArgument("give --model or --preset, not both");
  TrainingServiceOptions options;
  options.state_dir = o.state_dir;
  options.session_idle_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(o.session_idle_timeout_s * 1000));
  options.seq_wait = std::chrono::milliseconds(static_cast<int64_t>(o.seq_wait_s * 1000));
  options.max_batch_tokens = o.max_batch_tokens;
  if (o.max_sessions_per_token < 1 || o.max_sessions_per_token > INT32_MAX)
    return Status::InvalidArgument("--max-sessions-per-token must be >= 1, got " +
                                   std::to_string(o.max_sessions_per_token));
  if (o.max_sessions < 1 || o.max_sessions > INT32_MAX)
    return Status::InvalidArgument("--max-sessions must be >= 1, got " + std::to_string(o.max_sessions));
  options.max_sessions_per_identity = static_cast<int>(o.max_sessions_per_token);
  options.max_sessions = static_cast<int>(o.max_sessions);
  if (o.max_body_mb < 1) return Status::InvalidArgument("--max-body-mb must be >= 1");
  options.max_body_bytes = static_cast<uint64_t>(o.max_body_mb) << 20;
  trainer::TrainerOptions& t = options.trainer;
  t.seed = o.seed;
  t.threads = o.threads;
  if (o.serving_dtype == "bf16") {
    t.serving_dtype = DType::kBF16;
  } else if (o.serving_dtype == "f16") {
    t.serving_dtype = DType::kF16;
  } else if (o.serving_dtype == "f32") {
    t.serving_dtype = DType::kF32;
  } else if (o.serving_dtype == "fp8") {
    // Projection weights F8_E4M3 in 128 x 128 blocks (HF layout), everything else BF16.
    t.serving_dtype = DType::kBF16;
    t.fp8_serving = true;
  } else {
    return Status::InvalidArgument("--serving-dtype must be bf16, f16, f32 or fp8, got " +
                                   o.serving_dtype);
  }
  std::error_code ec;
  fs::create_directories(o.state_dir, ec);
  if (ec) return Status::IOError("cannot create " + o.state_dir + ": " + ec.message());
  FW_RETURN_IF_ERROR(ChooseModel(o, t, model_config_path, tokenizer));
  if (o.lora_rank > 0 && t.fp8_serving) {
    // LoRA publishes adapters-only snapshots over a base that stays as it was loaded.
    return Status::InvalidArgument("--serving-dtype fp8 is for full fine-tuning, not LoRA");
  }
  if (o.lora_rank > 0) {
    model::LoraOptions lora;
    lora.rank = o.lora_rank;
    lora.alpha = o.lora_alpha > 0 ? o.lora_alpha : 2.0 * static_cast<double>(o.lora_rank);
    if (!o.lora_targets.empty()) lora.targets = o.lora_targets;
    t.lora = lora;
  } else if (o.lora_rank < 0) {
    return Status::InvalidArgument("--lora-rank must be >= 0");
  }
  Result<model::PackFormat> pack = model::ParsePackFormat(o.pack_experts);
  if (!pack.ok()) return pack.status().WithContext("--pack-experts");
  t.pack_frozen_experts = *pack;
  if (t.pack_frozen_experts != model::PackFormat::kNone && o.lora_rank == 0)
    return Status::InvalidArgument("--pack-experts needs --lora-rank (only frozen experts pack)");
  FW_RETURN_IF_ERROR(options.Validate());
  return options;
}

Result<sync::PublisherOptions> PublisherOptionsFor(const ServeTrainerOptions& o) {
  sync::PublisherOptions publisher_options;
  publisher_options.common.region = "home";
  publisher_options.common.node_id = "trainer";
  FW_ASSIGN_OR_RETURN(publisher_options.common.http, transport::ParseEndpoint(o.publisher_http));
  publisher_options.common.token = o.token;
  publisher_options.common.scoped_tokens = o.scoped_tokens;
  publisher_options.common.tls = o.tls;
  publisher_options.common.wan_rate = o.wan_rate_mbit * 1e6 / 8;
  publisher_options.common.wan_latency_ms = o.wan_latency_ms;
  publisher_options.signing_key = o.signing_key;
  FW_ASSIGN_OR_RETURN(publisher_options.listen, transport::ParseEndpoint(o.listen));
  publisher_options.log.dir = (fs::path(o.state_dir) / "versions").string();
  if (o.keyframe_every < 1) return Status::InvalidArgument("--keyframe-every must be >= 1");
  publisher_options.log.keyframe_every = static_cast<uint64_t>(o.keyframe_every);
  publisher_options.log.retain = 2 * static_cast<uint64_t>(o.keyframe_every);
  // The ledger, readiness and wait routes; push routes answer 403 (no push token).
  sync::EnablePushApi(publisher_options, sync::PushOptions{});
  return publisher_options;
}

// The training API's server: the fleet token, the train token (train + read) and TLS; every
// token with the train scope tagged (`identities`), so that sessions know their owners.
Result<transport::HttpServerOptions> HttpOptionsFor(const ServeTrainerOptions& o) {
  transport::HttpServerOptions http_options;
  http_options.token = o.token;
  http_options.scoped_tokens = o.scoped_tokens;
  if (!o.train_token.empty()) {
    http_options.scoped_tokens.push_back(
        {o.train_token, transport::kScopeTrain | transport::kScopeRead});
  }
  if (!http_options.token.empty() || !http_options.scoped_tokens.empty()) {
    // The dashboard's own read-only token (rl/trainer_process.h), kept across restarts.
    FW_ASSIGN_OR_RETURN(const std::string dashboard, pipeline::DashboardToken(rl::DashboardTokenPath(o.state_dir)));
    http_options.scoped_tokens.push_back({dashboard, transport::kScopeRead});
  }
  if (o.tls.enabled()) {
    FW_ASSIGN_OR_RETURN(http_options.tls, transport::MakeServerTlsContext(o.tls));
  }
  return http_options;
}

}  // namespace

Status RunServeTrainer(const ServeTrainerOptions& o) {
  std::string model_config_path, tokenizer;
  FW_ASSIGN_OR_RETURN(TrainingServiceOptions options, ServiceOptions(o, model_config_path, tokenizer));
  FW_ASSIGN_OR_RETURN(sync::PublisherOptions publisher_options, PublisherOptionsFor(o));
  transport::asio::io_context io{1};
  auto work = transport::asio::make_work_guard(io);
  FW_ASSIGN_OR_RETURN(std::unique_ptr<sync::Publisher> publisher,
                      sync::Publisher::Start(io.get_executor(), publisher_options));
  std::thread io_thread([&] { io.run(); });
  struct StopIo {
    transport::asio::io_context& io;
    decltype(work)& guard;
    std::thread& thread;
    ~StopIo() {
      guard.reset();
      io.stop();
      if (thread.joinable()) thread.join();
    }
  } stop_io{io, work, io_thread};

  auto service_or = TrainingService::Create(options, publisher.get());
  if (!service_or.ok()) {
    publisher->Stop();
    return service_or.status();
  }
  std::unique_ptr<TrainingService> service = std::move(*service_or);

  FW_ASSIGN_OR_RETURN(transport::HttpServerOptions http_options, HttpOptionsFor(o));
  FW_ASSIGN_OR_RETURN(transport::Endpoint http_endpoint, transport::ParseEndpoint(o.http));
  std::promise<Result<std::unique_ptr<transport::HttpServer>>> started;
  transport::asio::post(io, [&] {
    auto server = transport::HttpServer::Start(io.get_executor(), http_endpoint, http_options);
    if (server.ok()) service->Register(**server);
    started.set_value(std::move(server));
  });
  auto server_or = started.get_future().get();
  if (!server_or.ok()) {
    service.reset();
    publisher->Stop();
    return server_or.status();
  }
  std::unique_ptr<transport::HttpServer> http = std::move(*server_or);
  const std::string scheme = o.tls.enabled() ? "https://" : "http://";
  const std::string host = http_endpoint.host == "0.0.0.0" ? "127.0.0.1" : http_endpoint.host;
  const json ready = {{"http", host + ":" + std::to_string(http->port())},
                      {"url", scheme + host + ":" + std::to_string(http->port())},
                      {"listen", "127.0.0.1:" + std::to_string(publisher->port())},
                      {"publisher_http", "127.0.0.1:" + std::to_string(publisher->http_port())},
                      {"model_config", model_config_path},
                      {"tokenizer", tokenizer},
                      {"mode", service->lora() ? "lora" : "full"},
                      {"dashboard", pipeline::DashboardUrl(host + ":" + std::to_string(http->port()), "", o.tls.enabled())},
                      {"version", service->version()}};
  spdlog::info("serve-trainer: training API on {}{}:{}, publisher on port {} ({} mode, version {})",
               scheme, host, http->port(), publisher->port(), service->lora() ? "LoRA" : "full",
               service->version());
  Status status = Status::Ok();
  if (!o.ready_file.empty()) status = WriteText(o.ready_file, ready.dump() + "\n");
  if (status.ok()) {
    rl::InstallStopSignals();
    while (!rl::StopRequested()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    spdlog::info("serve-trainer: stopping");
  }
  std::promise<void> stopped;
  transport::asio::post(io, [&] {
    http->Stop();
    stopped.set_value();
  });
  stopped.get_future().wait_for(std::chrono::seconds(5));
  service.reset();  // waits for the call that runs; the rest are answered 503
  publisher->Stop();
  work.reset();
  io.stop();
  if (io_thread.joinable()) io_thread.join();  // `http` goes after its executor stopped
  return status;
}

}  // namespace flywheel::service
