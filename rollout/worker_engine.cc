#include "rollout/worker_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>

#include "base/env.h"
#include "checkpoint/safetensors.h"
#include "rollout/actor.h"
#include "rollout/engine.h"
#include "rollout/mirror.h"
#include "rollout/openai_api.h"
#include "model/fp8.h"
#include "model/tokenizer.h"
#include "model/weights.h"
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
  ReasoningParser reasoning_parser = ReasoningParser::kNone;
  bool aliased = false;  // fp32 serving: the parameters are views of the worker's weights
  // FP8 versions' weight_block_size (config.json's quantization_config; HF's 128 if absent).
  int64_t fp8_block = model::kFp8BlockSize;
  std::atomic<const sync::Worker*> worker{nullptr};
  // Adapters loaded from the served versions' kServedAdapterPrefix groups (guarded by
  // `mutex`, like everything a swap touches). The --adapter ones are never among them, so a
  // swap never unloads those.
  std::set<std::string> served_adapters;
  // Served adapters a version dropped while a request still used them: a later swap tries
  // to unload them again.
  std::set<std::string> retiring_adapters;

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
  FW_ASSIGN_OR_RETURN(impl->fp8_block, model::Fp8BlockFromConfig(options.model_config));
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
  FW_ASSIGN_OR_RETURN(impl->reasoning_parser, ParseReasoningParser(options.reasoning_parser));
  const EngineOptions engine_options{options.max_batch, options.max_sequence,
                                    options.share_prefixes, options.prefix_slots,
                                    options.prefill_chunk};
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

// A served version's tensor "flywheel.adapters/<adapter>/<tensor>" split in two (`tensor`
// empty when no '/' follows the adapter's name); nullopt for a base tensor.
struct ServedAdapterTensor {
  std::string_view adapter;
  std::string_view tensor;
};
std::optional<ServedAdapterTensor> SplitServedAdapterTensor(std::string_view name) {
  const std::string_view prefix = model::kServedAdapterPrefix;
  if (!name.starts_with(prefix)) return std::nullopt;
  const std::string_view rest = name.substr(prefix.size());
  const size_t slash = rest.find('/');
  if (slash == std::string_view::npos) return ServedAdapterTensor{rest, {}};
  return ServedAdapterTensor{rest.substr(0, slash), rest.substr(slash + 1)};
}

// The training service's session names: [A-Za-z0-9._-]{1,64}.
bool ValidAdapterName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (const char c : name) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// `weights` without the served adapters' tensors: what the model's parameters load from
// (LoadMirror and AliasWeights take a version's base tensors only). Views of the same bytes.
CheckpointView BaseWeights(const CheckpointView& weights) {
  CheckpointView base;
  base.reserve(weights.size());
  for (const TensorView& t : weights) {
    if (!SplitServedAdapterTensor(t.name)) base.push_back(t);
  }
  return base;
}

// After the engine took `event`'s version: (re)loads the adapters the version serves, all
// of them when `all` (the first version, a keyframe in a new layout), else only those whose
// tensors `event.changes` lists, and unloads those a version dropped. A group that does not
// load is logged and leaves the adapter's previous copy served; nothing here refuses the
// version.
void ServeAdapters(WorkerEngine::Impl& s, const sync::SwapEvent& event, bool all);

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
      return event.full ? AliasWeights(*s.model, BaseWeights(*event.weights)) : Status::Ok();
    }
    if (event.full) {
      const CheckpointView previous =
          event.previous ? BaseWeights(*event.previous) : CheckpointView();
      return LoadMirrorOrRestore(*s.model, BaseWeights(*event.weights),
                                 event.previous ? &previous : nullptr, s.fp8_block);
    }
    // PatchMirror skips tensors that are not parameters (the served adapters).
    return PatchMirror(*s.model, *event.weights, *event.changes, s.fp8_block).status();
  });
  if (!swapped.ok()) {
    spdlog::error("rollout engine: version {} refused, still serving version {}: {}",
                  event.version, s.engine->version(), swapped.message());
    return swapped;
  }
  spdlog::info("rollout engine: version {} in {:.2f} ms", event.version,
               s.engine->last_swap_pause_ms());
  // Between steps, after the base: the engine's lock is not reentrant, so the adapters
  // cannot be loaded inside Swap's patch.
  ServeAdapters(s, event, event.full);
  return Status::Ok();
}

namespace {

Status StartEngine(WorkerEngine::Impl& s, const sync::SwapEvent& event) {
  // The served adapters' tensors (their U8 configs included) are not the base's: F32 base
  // weights are served without a mirror whatever rides beside them.
  const CheckpointView base = BaseWeights(*event.weights);
  const bool aliased = AllF32(base);
  FW_RETURN_IF_ERROR(aliased ? AliasWeights(*s.model, base)
                              : LoadMirror(*s.model, base, s.fp8_block));
  FW_ASSIGN_OR_RETURN(
      auto engine,
      Engine::Create(s.model,
                     {s.options.max_batch, s.options.max_sequence, s.options.share_prefixes,
                      s.options.prefix_slots, s.options.prefill_chunk},
                     event.version));
  s.aliased = aliased;
  s.engine = std::shared_ptr<Engine>(std::move(engine));
  for (const auto& [name, path] : s.options.adapters) {
    auto file = Checkpoint::Open(path);
    Status added = file.ok() ? s.engine->LoadAdapter(name, file->tensors()) : file.status();
    if (!added.ok()) spdlog::error("rollout engine: adapter {}: {}", name, added.message());
  }
  ServeAdapters(s, event, /*all=*/true);
  ServingOptions serving;
  serving.chat_template = s.chat_template;
  serving.chat_template_error = s.chat_template_error;
  serving.bos_token = s.bos_token;
  serving.eos_token = s.eos_token;
  serving.max_model_len = s.max_model_len;
  serving.reasoning_parser = s.reasoning_parser;  // the smaller of it and max_sequence counts
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

void ServeAdapters(WorkerEngine::Impl& s, const sync::SwapEvent& event, bool all) {
  const CheckpointView& weights = *event.weights;
  // The adapters whose tensors this swap wrote (a base-only delta: none, and no more work).
  std::set<std::string, std::less<>> changed;
  if (!all) {
    for (const delta::ChangedWords& c : *event.changes) {
      if (c.state_index >= weights.size() || (!c.all && c.positions.empty())) continue;
      if (auto served = SplitServedAdapterTensor(weights[c.state_index].name)) {
        changed.emplace(served->adapter);
      }
    }
  }
  // Each group to load, its tensors under their adapters-only snapshot names. With `all`,
  // also every adapter the version serves.
  std::map<std::string, CheckpointView, std::less<>> groups;
  if (all || !changed.empty()) {
    for (const TensorView& t : weights) {
      auto served = SplitServedAdapterTensor(t.name);
      if (!served || (!all && !changed.contains(served->adapter))) continue;
      // A tensor right under the prefix keeps its whole name, which LoadAdapter refuses.
      groups[std::string(served->adapter)].push_back(
          {served->tensor.empty() ? t.name : std::string(served->tensor), t.dtype, t.shape,
           t.data});
    }
  }
  for (const auto& [name, group] : groups) {
    if (!ValidAdapterName(name)) {
      spdlog::error(
          "rollout engine: version {}: served adapter name '{}' ignored (want "
          "[A-Za-z0-9._-], 1 to 64 characters)",
          event.version, name);
      continue;
    }
    const bool from_file = std::any_of(s.options.adapters.begin(), s.options.adapters.end(),
                                       [&](const auto& adapter) { return adapter.first == name; });
    if (from_file) {
      spdlog::error(
          "rollout engine: version {}: served adapter {} ignored: --adapter {} names "
          "the one served under that name",
          event.version, name, name);
      continue;
    }
    s.retiring_adapters.erase(name);
    Status loaded = s.engine->LoadAdapter(name, group);
    if (!loaded.ok()) {
      spdlog::error("rollout engine: version {}: served adapter {} not loaded ({}): {}",
                    event.version, name,
                    s.served_adapters.contains(name) ? "still serving its previous copy"
                                                     : "not served",
                    loaded.message());
      continue;
    }
    s.served_adapters.insert(name);
  }
  // Only a new layout (`all`) can drop an adapter; one still in use is retried at every swap.
  if (all) {
    for (const std::string& name : s.served_adapters) {
      if (!groups.contains(name)) s.retiring_adapters.insert(name);
    }
  }
  for (auto it = s.retiring_adapters.begin(); it != s.retiring_adapters.end();) {
    Status unloaded = s.engine->UnloadAdapter(*it);
    if (!unloaded.ok() && unloaded.code() != StatusCode::kNotFound) {
      spdlog::warn("rollout engine: adapter {} is not in version {} but stays loaded until a "
                   "later swap: {}",
                   *it, event.version, unloaded.message());
      ++it;
      continue;
    }
    spdlog::info("rollout engine: adapter {} unloaded (not in version {})", *it, event.version);
    s.served_adapters.erase(*it);
    it = s.retiring_adapters.erase(it);
  }
}

}  // namespace

void WorkerEngine::Attach(const sync::Worker* worker) { impl_->worker.store(worker); }

void WorkerEngine::Register(transport::HttpServer& server) {
  Impl* impl = impl_.get();
  CompletionService::RegisterRoutes(server, [impl] { return impl->Service(); });
}

void WorkerEngine::AddStatus(nlohmann::json& status) const {
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard lock(impl_->mutex);
    engine = impl_->engine;
  }
  if (!engine) return;
  const PrefixStats prefixes = engine->prefix_stats();
  status["engine_running"] = engine->running();
  status["engine_waiting"] = engine->queued();
  status["kv_cache_bytes"] = engine->cache_bytes();
  status["prefix_cache_hits_total"] = prefixes.hits;
  status["prefix_tokens_reused_total"] = prefixes.tokens_reused;
  status["prefill_tokens_total"] = prefixes.tokens_prefilled;
  status["prefix_cache_entries"] = prefixes.entries;
  status["prefix_cache_slots"] = prefixes.slots;
  status["kv_cache_usage"] =
      static_cast<double>(engine->running()) / static_cast<double>(engine->max_batch());
  const LatencyHistograms& latencies = engine->latencies();
  status["request_queue_time"] = latencies.queue.ToJson();
  status["time_to_first_token"] = latencies.first_token.ToJson();
  status["inter_token_latency"] = latencies.inter_token.ToJson();
  status["e2e_request_latency"] = latencies.end_to_end.ToJson();
}

}  // namespace flywheel::rollout
