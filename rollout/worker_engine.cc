#include "rollout/worker_engine.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <filesystem>
#include <mutex>

#include "base/env.h"
#include "delta/safetensors.h"
#include "rollout/actor.h"
#include "rollout/engine.h"
#include "rollout/mirror.h"
#include "rollout/serving.h"
#include "model/tokenizer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/hf_tokenizer.h"

namespace flywheel::rollout {

struct WorkerEngine::Impl {
  WorkerEngineOptions options;
  model::ModelConfig config;
  std::shared_ptr<const model::Tokenizer> tokenizer;
  // An HF tokenizer's chat template and tokens (empty for byte and char tokenizers).
  std::shared_ptr<const tokenizer::ChatTemplate> chat_template;
  std::string chat_template_error;
  std::string bos_token, eos_token;
  int64_t max_model_len = 0;
  std::shared_ptr<model::TransformerImpl> model;
  std::mutex mutex;  // guards engine / service creation
  std::shared_ptr<Engine> engine;
  std::shared_ptr<CompletionService> service;
  bool aliased = false;  // fp32 serving: the parameters are views of the worker's weights
  std::atomic<const sync::Worker*> worker{nullptr};

  std::shared_ptr<CompletionService> Service() {
    std::lock_guard lock(mutex);
    return service;
  }
  std::unique_ptr<Actor> actor;  // last: stops before the service goes
};

WorkerEngine::WorkerEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
WorkerEngine::~WorkerEngine() = default;

Result<std::unique_ptr<WorkerEngine>> WorkerEngine::Create(const WorkerEngineOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  FW_ASSIGN_OR_RETURN(impl->config, model::ModelConfig::Load(options.model_config));
  // The tokenizer: an HF tokenizer.json beside config.json unless told otherwise.
  namespace fs = std::filesystem;
  std::string hf_path;
  if (options.tokenizer == "auto") {
    fs::path dir = options.model_config;
    if (!fs::is_directory(dir)) dir = dir.parent_path();
    if (Env::Default()->FileExists((dir / "tokenizer.json").string())) hf_path = dir.string();
  } else if (options.tokenizer != "byte" && options.tokenizer.rfind("chars:", 0) != 0) {
    hf_path = options.tokenizer;
  }
  if (!hf_path.empty()) {
    FW_ASSIGN_OR_RETURN(std::unique_ptr<tokenizer::HfTokenizer> hf, tokenizer::HfTokenizer::Load(hf_path));
    spdlog::info("tokenizer: {} ({})", hf_path, hf->Describe());
    if (!hf->chat_template().empty()) {
      auto parsed = tokenizer::ChatTemplate::Parse(hf->chat_template());
      if (!parsed.ok()) {
        // Completions still work; chat answers 400 naming why.
        spdlog::warn("chat template of {} not supported, /v1/chat/completions is off: {}", hf_path,
                     parsed.status().message());
        impl->chat_template_error = parsed.status().message();
      } else {
        impl->chat_template = std::make_shared<tokenizer::ChatTemplate>(std::move(*parsed));
      }
    }
    impl->bos_token = hf->bos_token();
    impl->eos_token = hf->eos_token();
    impl->max_model_len = hf->model_max_length();
    impl->tokenizer = std::move(hf);
  } else if (options.tokenizer == "byte" || options.tokenizer == "auto") {
    impl->tokenizer = std::make_shared<model::ByteTokenizer>();
  } else {
    FW_ASSIGN_OR_RETURN(auto chars, model::CharTokenizer::Create(options.tokenizer.substr(6)));
    impl->tokenizer = std::move(chars);
  }
  if (impl->tokenizer->vocab_size() > impl->config.vocab_size) {
    return Status::InvalidArgument(
        "the tokenizer has " + std::to_string(impl->tokenizer->vocab_size()) +
        " ids, more than the model's vocab_size " + std::to_string(impl->config.vocab_size));
  }
  EngineOptions engine_options{options.max_batch, options.max_sequence};
  FW_RETURN_IF_ERROR(engine_options.Validate(impl->config));
  for (const auto& [name, path] : options.adapters) {
    if (name.empty() || path.empty()) return Status::InvalidArgument("--adapter wants NAME=PATH");
  }
  impl->model = std::make_shared<model::TransformerImpl>(impl->config);
  if (!options.trainer.empty()) {
    ActorOptions actor;
    FW_ASSIGN_OR_RETURN(actor.trainer, transport::ParseEndpoint(options.trainer));
    actor.token = options.trainer_token;
    if (options.trainer_tls.enabled()) {
      FW_ASSIGN_OR_RETURN(actor.tls, transport::MakeClientTlsContext(options.trainer_tls));
    }
    actor.worker_id = options.worker_id;
    actor.max_groups = options.actor_groups;
    if (actor.worker_id.empty()) return Status::InvalidArgument("the actor needs a worker id");
    Impl* raw = impl.get();
    impl->actor = std::make_unique<Actor>(actor, [raw] { return raw->Service(); }, impl->tokenizer);
  }
  return std::unique_ptr<WorkerEngine>(new WorkerEngine(std::move(impl)));
}

namespace {

// The first served version: the engine is built on it.
Status StartEngine(WorkerEngine::Impl& s, const sync::SwapEvent& event);

}  // namespace

Status WorkerEngine::OnSwap(const sync::SwapEvent& event) {
  Impl& s = *impl_;
  std::lock_guard lock(s.mutex);
  if (!s.engine) {
    Status started = StartEngine(s, event);
    if (!started.ok()) {
      spdlog::error("rollout engine: version {} refused: {}", event.version, started.message());
    }
    return started;
  }
  if (s.options.before_swap) FW_RETURN_IF_ERROR(s.options.before_swap(event.version));
  // Every patch below validates all it will write before writing, so a refused version
  // leaves the engine computing from the version before.
  Status swapped = s.engine->Swap(event.version, [&]() -> Status {
    if (s.aliased) {
      // Deltas were applied in place into the tensors the model views; a keyframe decoded
      // into new buffers is viewed afresh.
      return event.full ? AliasWeights(*s.model, *event.weights) : Status::Ok();
    }
    if (event.full) return LoadMirrorOrRestore(*s.model, *event.weights, event.previous);
    return PatchMirror(*s.model, *event.weights, *event.changes).status();
  });
  if (!swapped.ok()) {
    spdlog::error("rollout engine: version {} refused, still serving version {}: {}",
                  event.version, s.engine->version(), swapped.message());
    return swapped;
  }
  spdlog::info("rollout engine: version {} in {:.2f} ms", event.version,
               s.engine->last_swap_pause_ms());
  return Status::Ok();
}

namespace {

Status StartEngine(WorkerEngine::Impl& s, const sync::SwapEvent& event) {
  const bool aliased = AllF32(*event.weights);
  FW_RETURN_IF_ERROR(aliased ? AliasWeights(*s.model, *event.weights)
                             : LoadMirror(*s.model, *event.weights));
  FW_ASSIGN_OR_RETURN(
      auto engine,
      Engine::Create(s.model, {s.options.max_batch, s.options.max_sequence}, event.version));
  s.aliased = aliased;
  s.engine = std::shared_ptr<Engine>(std::move(engine));
  for (const auto& [name, path] : s.options.adapters) {
    auto file = Checkpoint::Open(path);
    Status added = file.ok() ? s.engine->LoadAdapter(name, file->tensors()) : file.status();
    if (!added.ok()) spdlog::error("rollout engine: adapter {}: {}", name, added.message());
  }
  ServingOptions serving;
  serving.chat_template = s.chat_template;
  serving.chat_template_error = s.chat_template_error;
  serving.bos_token = s.bos_token;
  serving.eos_token = s.eos_token;
  serving.max_model_len = s.max_model_len;  // the smaller of it and max_sequence counts
  if (!s.options.model_name.empty()) serving.model_name = s.options.model_name;
  if (s.aliased) {
    WorkerEngine::Impl* impl = &s;
    serving.step_guard = [impl](const std::function<void()>& step) {
      const sync::Worker* worker = impl->worker.load();
      if (worker == nullptr) return step();
      worker->WithWeights([&](uint64_t, const CheckpointView&) { step(); });
    };
  }
  s.service = std::make_shared<CompletionService>(s.engine, s.tokenizer, serving);
  spdlog::info("rollout engine: serving version {}", event.version);
  return Status::Ok();
}

}  // namespace

void WorkerEngine::Attach(const sync::Worker* worker) { impl_->worker.store(worker); }

void WorkerEngine::Register(transport::HttpServer& server) {
  Impl* impl = impl_.get();
  CompletionService::RegisterRoutes(server, [impl] { return impl->Service(); });
}

}  // namespace flywheel::rollout
