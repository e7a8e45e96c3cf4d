#include "rollout/serving.h"

#include <chrono>
#include <nlohmann/json.hpp>

#include "transport/connection.h"

namespace flywheel::rollout {

namespace {

using nlohmann::json;

}  // namespace

transport::HttpResponse JsonError(int status, const std::string& message) {
  json body = {{"error",
                {{"message", message},
                 {"type", status == 404 ? "not_found_error" : "invalid_request_error"}}}};
  return {status, "application/json", body.dump(-1, ' ', false, json::error_handler_t::replace)};
}

namespace {

int HttpStatusFor(const Status& status) {
  switch (status.code()) {
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kUnavailable:
      return 503;
    case StatusCode::kInvalidArgument:
    case StatusCode::kMismatch:
      return 400;
    default:
      return 500;
  }
}

// Reads an optional field of a JSON type; a wrong type is a 400 naming it.
template <typename T>
Status Field(const json& request, const char* key, T& out) {
  auto it = request.find(key);
  if (it == request.end() || it->is_null()) return Status::Ok();
  bool ok = false;
  if constexpr (std::is_same_v<T, bool>) {
    ok = it->is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    ok = it->is_number_integer();
  } else if constexpr (std::is_floating_point_v<T>) {
    ok = it->is_number();
  } else {
    ok = it->is_string();
  }
  if (!ok)
    return Status::InvalidArgument(std::string("'") + key + "' has the wrong type (" + it->dump() +
                                   ")");
  out = it->get<T>();
  return Status::Ok();
}

}  // namespace

CompletionService::CompletionService(std::shared_ptr<Engine> engine,
                                     std::shared_ptr<const model::Tokenizer> tokenizer,
                                     ServingOptions options)
    : engine_(std::move(engine)), tokenizer_(std::move(tokenizer)), options_(std::move(options)) {
  http_pool_ = std::make_unique<boost::asio::thread_pool>(
      static_cast<size_t>(std::max(1, options_.http_threads)));
  driver_ = std::thread([this] { Drive(); });
}

CompletionService::~CompletionService() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  driver_.join();
  {
    std::lock_guard lock(mutex_);
    for (auto& [id, promise] : pending_) {
      GenerationResult failed;
      failed.id = id;
      failed.finish_reason = "aborted";
      promise.set_value(std::move(failed));
    }
    pending_.clear();
  }
  http_pool_->join();
}

void CompletionService::Drive() {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      if (stopping_) return;
    }
    std::vector<GenerationResult> finished;
    if (options_.step_guard) {
      options_.step_guard([&] { finished = engine_->Step(); });
    } else {
      finished = engine_->Step();
    }
    if (finished.empty()) continue;
    std::lock_guard lock(mutex_);
    for (auto& r : finished) {
      auto it = pending_.find(r.id);
      if (it == pending_.end()) continue;
      it->second.set_value(std::move(r));
      pending_.erase(it);
    }
  }
}

Result<std::vector<GenerationResult>> CompletionService::Generate(
    std::vector<GenerationRequest> requests) {
  std::vector<std::future<GenerationResult>> futures;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return Status::Unavailable("the rollout worker is stopping");
    // Validate all first, so a bad request submits nothing.
    for (const auto& r : requests) FW_RETURN_IF_ERROR(engine_->Validate(r));
    for (auto& r : requests) {
      FW_ASSIGN_OR_RETURN(uint64_t id, engine_->Submit(std::move(r)));
      futures.push_back(pending_[id].get_future());
    }
  }
  wake_.notify_all();
  std::vector<GenerationResult> out;
  for (auto& f : futures) {
    out.push_back(f.get());
    if (out.back().finish_reason == "aborted")
      return Status::Unavailable("the rollout worker stopped");
  }
  return out;
}

transport::HttpResponse CompletionService::Complete(const std::string& body) {
  json request = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (request.is_discarded() || !request.is_object())
    return JsonError(400, "the body is not a JSON object");
  std::vector<int32_t> prompt;
  auto p = request.find("prompt");
  if (p == request.end()) return JsonError(400, "'prompt' is required");
  if (p->is_string()) {
    auto ids = tokenizer_->Encode(p->get<std::string>());
    if (!ids.ok()) return JsonError(400, "prompt: " + ids.status().message());
    prompt = std::move(*ids);
  } else if (p->is_array() && std::all_of(p->begin(), p->end(),
                                          [](const json& v) { return v.is_number_integer(); })) {
    for (const json& v : *p) {
      const int64_t id = v.get<int64_t>();
      if (id < INT32_MIN || id > INT32_MAX)
        return JsonError(400, "prompt token " + std::to_string(id) + " is out of range");
      prompt.push_back(static_cast<int32_t>(id));
    }
  } else {
    return JsonError(400, "'prompt' must be a string or an array of token ids");
  }
  GenerationRequest base;
  base.prompt = std::move(prompt);
  int64_t n = 1, seed = -1;
  bool stream = false, want_logprobs = false;
  Status parsed = Status::Ok();
  auto read = [&](Status s) {
    if (parsed.ok() && !s.ok()) parsed = s;
  };
  read(Field(request, "max_tokens", base.params.max_tokens));
  read(Field(request, "temperature", base.params.temperature));
  read(Field(request, "top_p", base.params.top_p));
  read(Field(request, "top_k", base.params.top_k));
  read(Field(request, "n", n));
  read(Field(request, "stream", stream));
  read(Field(request, "return_routing", base.params.return_routing));
  read(Field(request, "adapter", base.adapter));
  if (request.contains("seed") && !request["seed"].is_null()) {
    if (!request["seed"].is_number_integer())
      read(Status::InvalidArgument("'seed' must be an integer"));
    else
      seed = request["seed"].get<int64_t>();
  }
  if (request.contains("logprobs") && !request["logprobs"].is_null()) {
    const json& l = request["logprobs"];
    want_logprobs = l.is_boolean() ? l.get<bool>() : (l.is_number() && l.get<double>() > 0);
  }
  if (request.contains("stop") && !request["stop"].is_null()) {
    const json& stop = request["stop"];
    const json list = stop.is_array() ? stop : json::array({stop});
    for (const json& s : list) {
      if (s.is_number_integer()) {
        base.params.stop_tokens.push_back(s.get<int32_t>());
      } else if (s.is_string()) {
        auto ids = tokenizer_->Encode(s.get<std::string>());
        if (!ids.ok() || ids->size() != 1) {
          read(
              Status::InvalidArgument("stop '" + s.get<std::string>() + "' is not a single token"));
        } else {
          base.params.stop_tokens.push_back((*ids)[0]);
        }
      } else {
        read(Status::InvalidArgument("'stop' entries must be token ids or single-token strings"));
      }
    }
  }
  if (!parsed.ok()) return JsonError(400, parsed.message());
  if (stream) return JsonError(400, "streaming is not supported (set stream to false)");
  if (n < 1 || n > options_.max_n) {
    return JsonError(400, "'n' must be in [1, " + std::to_string(options_.max_n) + "], got " +
                              std::to_string(n));
  }
  if (seed >= 0) base.params.seed = static_cast<uint64_t>(seed);
  std::vector<GenerationRequest> requests;
  for (int64_t i = 0; i < n; ++i) {
    GenerationRequest r = base;
    if (seed >= 0) r.params.seed = static_cast<uint64_t>(seed) + static_cast<uint64_t>(i);
    requests.push_back(std::move(r));
  }
  auto results = Generate(std::move(requests));
  if (!results.ok()) return JsonError(HttpStatusFor(results.status()), results.status().message());

  const model::ModelConfig& config = engine_->config();
  json choices = json::array();
  int64_t completion_tokens = 0;
  for (size_t i = 0; i < results->size(); ++i) {
    const GenerationResult& r = (*results)[i];
    auto text = tokenizer_->Decode(r.tokens);
    json choice = {{"index", i},
                   {"text", text.ok() ? *text : std::string()},
                   {"token_ids", r.tokens},
                   {"policy_versions", r.versions},
                   {"finish_reason", r.finish_reason}};
    if (want_logprobs) {
      json tokens = json::array();
      for (int32_t t : r.tokens) {
        auto piece = tokenizer_->Decode(std::vector<int32_t>{t});
        tokens.push_back(piece.ok() ? *piece : std::string());
      }
      choice["logprobs"] = {{"tokens", tokens}, {"token_logprobs", r.logprobs}};
    }
    if (base.params.return_routing && config.num_experts > 0) {
      choice["routing"] = r.routing;
      choice["routing_shape"] = {static_cast<int64_t>(r.prompt.size() + r.tokens.size()) - 1,
                                 config.NumMoeLayers(), config.num_experts_per_tok};
      choice["routing_bytes_per_index"] = r.routing_bytes_per_index;
    }
    completion_tokens += static_cast<int64_t>(r.tokens.size());
    choices.push_back(std::move(choice));
  }
  const int64_t prompt_tokens = static_cast<int64_t>(base.prompt.size());
  json answer = {{"id", "cmpl-" + std::to_string((*results)[0].id)},
                 {"object", "text_completion"},
                 {"created", std::chrono::duration_cast<std::chrono::seconds>(
                                 std::chrono::system_clock::now().time_since_epoch())
                                 .count()},
                 {"model", base.adapter.empty() ? options_.model_name : base.adapter},
                 {"choices", choices},
                 {"usage",
                  {{"prompt_tokens", prompt_tokens},
                   {"completion_tokens", completion_tokens},
                   {"total_tokens", prompt_tokens * n + completion_tokens}}}};
  // Byte-level text need not be valid UTF-8: invalid bytes become U+FFFD in JSON.
  return {200, "application/json", answer.dump(-1, ' ', false, json::error_handler_t::replace)};
}

transport::awaitable<transport::HttpResponse> CompletionService::HandleHttp(std::string body) {
  auto work = [this, body = std::move(body)] { return Complete(body); };
  std::optional<transport::HttpResponse> answer =
      co_await transport::RunOn(*http_pool_, std::move(work));
  if (!answer) co_return JsonError(503, "the rollout worker is stopping");
  co_return std::move(*answer);
}

void CompletionService::Register(transport::HttpServer& server) {
  server.RoutePost(
      "/v1/completions",
      [this](std::string, std::string body) { return HandleHttp(std::move(body)); }, 1 << 20,
      transport::kScopeSample);
}

}  // namespace flywheel::rollout
