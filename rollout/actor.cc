#include "rollout/actor.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <random>

#include "rollout/serving.h"
#include "model/tokenizer.h"
#include "transport/http.h"

namespace flywheel::rollout {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;

}  // namespace

Actor::Actor(ActorOptions options, std::function<std::shared_ptr<CompletionService>()> service,
             std::shared_ptr<const model::Tokenizer> tokenizer)
    : options_(std::move(options)), service_(std::move(service)), tokenizer_(std::move(tokenizer)) {
  std::random_device device;
  incarnation_ = std::to_string(device()) + "-" + std::to_string(device());
  thread_ = std::thread([this] { Run(); });
}

Actor::~Actor() {
  stopping_ = true;
  if (thread_.joinable()) thread_.join();
}

void Actor::Run() {
  bool reachable = true;
  while (!stopping_) {
    milliseconds pause{100};
    std::shared_ptr<CompletionService> service = service_();
    if (service) {
      try {
        pause = Round(*service);
        if (!reachable) spdlog::info("actor: the trainer at {} answers again", options_.trainer.ToString());
        reachable = true;
      } catch (const std::exception& error) {
        if (reachable) spdlog::warn("actor: {}; retrying every 500 ms", error.what());
        reachable = false;
        ++stats_.trainer_unreachable;
        pause = milliseconds(500);
      }
    }
    // Sleep in small slices so that a stop is prompt.
    const auto until = std::chrono::steady_clock::now() + pause;
    while (!stopping_ && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::min(pause, milliseconds(20)));
    }
  }
}

milliseconds Actor::Round(CompletionService& service) {
  transport::HttpGetOptions http;
  http.token = options_.token;
  http.timeout = milliseconds(10000);
  const auto [version, since_us] = service.engine().serving();
  const json claim_request = {{"worker", options_.worker_id},
                              {"incarnation", incarnation_},
                              {"version", version},
                              {"serving_since_unix_us", since_us},
                              {"max_groups", options_.max_groups}};
  auto answer = transport::HttpPost(options_.trainer, "/v1/rollout/claim", claim_request.dump(), http);
  if (!answer.ok()) throw std::runtime_error("claim: " + answer.status().ToString());
  if (answer->status != 200) {
    throw std::runtime_error("claim: HTTP " + std::to_string(answer->status) + ": " +
                             answer->body.substr(0, 200));
  }
  const json claim = json::parse(answer->body, nullptr, /*allow_exceptions=*/false);
  const std::string status = claim.is_object() ? claim.value("status", "") : "";
  if (status == "wait") return milliseconds(claim.value("retry_ms", 50));
  if (status == "done") return milliseconds(1000);
  if (status != "ok") throw std::runtime_error("claim: unexpected answer " + answer->body.substr(0, 200));

  const int64_t group_size = claim.value("group_size", int64_t{1});
  SamplingParams params;
  params.temperature = claim.value("temperature", 1.0);
  params.max_tokens = claim.value("max_tokens", int64_t{16});
  params.stop_tokens = {tokenizer_->eos()};
  params.return_routing = service.engine().config().num_experts > 0;
  std::vector<GenerationRequest> requests;
  std::vector<json> groups;
  for (const json& group : claim.at("groups")) {
    Result<std::vector<int32_t>> prompt = tokenizer_->Encode(group.at("prompt").get<std::string>());
    if (!prompt.ok()) throw std::runtime_error("claim: prompt: " + prompt.status().ToString());
    prompt->insert(prompt->begin(), tokenizer_->bos());
    for (int64_t i = 0; i < group_size; ++i) {
      requests.push_back(GenerationRequest{*prompt, params, ""});
    }
    groups.push_back(group);
  }
  Result<std::vector<GenerationResult>> results = service.Generate(std::move(requests));
  if (!results.ok()) {
    spdlog::warn("actor: generation failed: {}", results.status().ToString());
    return milliseconds(200);  // the leases lapse and the prompts go to other workers
  }
  const int64_t layers = service.engine().config().NumMoeLayers();
  const int64_t top_k = service.engine().config().num_experts_per_tok;
  for (size_t g = 0; g < groups.size(); ++g) {
    json samples = json::array();
    const std::string answer_text = groups[g].at("answer").get<std::string>();
    for (int64_t i = 0; i < group_size; ++i) {
      const GenerationResult& r = (*results)[g * group_size + i];
      std::vector<int32_t> answer_ids = r.tokens;
      if (!answer_ids.empty() && answer_ids.back() == tokenizer_->eos()) answer_ids.pop_back();
      Result<std::string> text = tokenizer_->Decode(answer_ids);
      // A completion that does not decode (a special token mid-answer) is simply wrong.
      const double reward = text.ok() ? (*text == answer_text ? 1.0 : 0.0) : 0.0;
      json sample = {{"prompt_tokens", r.prompt},
                     {"tokens", r.tokens},
                     {"logprobs", r.logprobs},
                     {"versions", r.versions},
                     {"reward", reward}};
      if (!r.routing.empty()) {
        std::vector<int32_t> routing;
        routing.reserve(r.routing.size() / r.routing_bytes_per_index);
        for (size_t b = 0; b < r.routing.size(); b += r.routing_bytes_per_index) {
          routing.push_back(r.routing_bytes_per_index == 1 ? r.routing[b]
                                                           : r.routing[b] | (r.routing[b + 1] << 8));
        }
        const int64_t rows = static_cast<int64_t>(r.prompt.size() + r.tokens.size()) - 1;
        sample["routing"] = std::move(routing);
        sample["routing_shape"] = {rows, layers, top_k};
      }
      samples.push_back(std::move(sample));
      ++stats_.samples;
    }
    const json submit = {{"worker", options_.worker_id},
                         {"incarnation", incarnation_},
                         {"claim", groups[g].at("claim")},
                         {"samples", std::move(samples)}};
    auto submitted = transport::HttpPost(options_.trainer, "/v1/rollout/submit", submit.dump(), http);
    if (!submitted.ok()) throw std::runtime_error("submit: " + submitted.status().ToString());
    const json verdict = json::parse(submitted->body, nullptr, false);
    if (submitted->status == 200 && verdict.is_object() && verdict.value("accepted", false)) {
      ++stats_.groups_submitted;
    } else {
      ++stats_.groups_refused;
      spdlog::warn("actor: group of claim {} refused: {}", groups[g].at("claim").dump(),
                   submitted->body.substr(0, 300));
    }
  }
  return milliseconds(0);
}

}  // namespace flywheel::rollout
