#include "rollout/actor.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <random>

#include "model/tokenizer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/hf_tokenizer.h"
#include "rollout/openai_api.h"
#include "transport/api.h"
#include "transport/http.h"

namespace flywheel::rollout {
namespace {

using std::chrono::milliseconds;
using pipeline::ClaimAnswer;
using pipeline::SubmitRequest;

// The engine's routing bytes (one or two per expert id) as the protocol's int32 ids.
std::vector<int32_t> RoutingIds(const GenerationResult& r) {
  std::vector<int32_t> routing;
  routing.reserve(r.routing.size() / r.routing_bytes_per_index);
  for (size_t b = 0; b < r.routing.size(); b += r.routing_bytes_per_index) {
    routing.push_back(r.routing_bytes_per_index == 1 ? r.routing[b]
                                                     : r.routing[b] | (r.routing[b + 1] << 8));
  }
  return routing;
}

}  // namespace

transport::HttpGetOptions Actor::HttpOptions() const {
  transport::HttpGetOptions http;
  http.token = options_.token;
  http.tls = options_.tls;
  http.timeout = milliseconds(10000);
  return http;
}

Actor::Actor(ActorOptions options, std::function<std::shared_ptr<CompletionService>()> service,
             std::shared_ptr<const model::Tokenizer> tokenizer)
    : options_(std::move(options)), service_(std::move(service)), tokenizer_(std::move(tokenizer)) {
  if (const auto* hf = dynamic_cast<const tokenizer::HfTokenizer*>(tokenizer_.get());
      hf != nullptr && !hf->chat_template().empty()) {
    Result<tokenizer::ChatTemplate> parsed = tokenizer::ChatTemplate::Parse(hf->chat_template());
    if (parsed.ok()) chat_ = std::make_shared<tokenizer::ChatTemplate>(std::move(*parsed));
    bos_text_ = hf->bos_token();
    eos_text_ = hf->eos_token();
  }
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
      Result<milliseconds> round = Round(*service);
      if (round.ok()) {
        pause = *round;
        if (!reachable) spdlog::info("actor: the trainer at {} answers again", options_.trainer.ToString());
        reachable = true;
      } else {
        if (reachable) spdlog::warn("actor: {}; retrying every 500 ms", round.status().ToString());
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

Result<ClaimAnswer> Actor::PostClaim(CompletionService& service) {
  const auto [version, since_us] = service.engine().serving();
  pipeline::ClaimRequest request{.worker = options_.worker_id,
                                  .incarnation = incarnation_,
                                  .version = version,
                                  .serving_since_unix_us = since_us,
                                  .max_groups = options_.max_groups};
  const transport::HttpGetOptions http = HttpOptions();
  auto answer = transport::HttpPost(options_.trainer, "/v1/rollout/claim", ToJson(request), http);
  if (!answer.ok()) return Status::Unavailable("claim: " + answer.status().ToString());
  if (answer->status != 200) {
    // The trainer's errors are the one shape (transport/api.h): "HTTP 400 bad_request: ...".
    return Status::Unavailable("claim refused: " +
                               transport::DescribeErrorBody(answer->status, answer->body));
  }
  Result<ClaimAnswer> claim = pipeline::ParseClaimAnswer(answer->body);
  if (!claim.ok()) return Status::Unavailable("claim: " + claim.status().message());
  return claim;
}

std::vector<SubmitRequest> Actor::Sample(CompletionService& service, const ClaimAnswer& claim) {
  SamplingParams params;
  params.temperature = claim.temperature;
  params.max_tokens = claim.max_tokens;
  params.stop_tokens = {tokenizer_->eos()};
  params.return_routing = service.engine().config().num_experts > 0;
  std::vector<GenerationRequest> requests;
  std::vector<SubmitRequest> submissions;
  for (const pipeline::ClaimedGroup& group : claim.groups) {
    Result<std::vector<int32_t>> prompt = tokenizer_->Encode(group.prompt);
    if (!prompt.ok()) {  // its lease lapses and the trainer hands the prompt to another worker
      spdlog::warn("actor: prompt of claim {}: {}", group.claim, prompt.status().ToString());
      continue;
    }
    // BOS first, unless the model's chat template wrote it (Llama-3's <|begin_of_text|>).
    if (prompt->empty() || prompt->front() != tokenizer_->bos()) prompt->insert(prompt->begin(), tokenizer_->bos());
    for (int64_t i = 0; i < claim.group_size; ++i) requests.push_back({*prompt, params, ""});
    submissions.push_back({.worker = options_.worker_id, .incarnation = incarnation_, .claim = group.claim});
  }
  Result<std::vector<GenerationResult>> results = service.Generate(std::move(requests));
  if (!results.ok()) {
    spdlog::warn("actor: generation failed: {}", results.status().ToString());
    return {};  // the leases lapse and the prompts go to other workers
  }
  const int64_t layers = service.engine().config().NumMoeLayers();
  const int64_t top_k = service.engine().config().num_experts_per_tok;
  size_t next = 0;
  for (const pipeline::ClaimedGroup& group : claim.groups) {
    if (next == submissions.size() || submissions[next].claim != group.claim) continue;
    SubmitRequest& submission = submissions[next];
    for (int64_t i = 0; i < claim.group_size; ++i) {
      GenerationResult& r = (*results)[next * claim.group_size + i];
      std::vector<int32_t> answer_ids = r.tokens;
      if (!answer_ids.empty() && answer_ids.back() == tokenizer_->eos()) answer_ids.pop_back();
      Result<std::string> text = tokenizer_->Decode(answer_ids);
      // A completion that does not decode (a special token mid-answer) is simply wrong.
      pipeline::RolloutSample sample{.prompt_tokens = std::move(r.prompt),
                                      .tokens = std::move(r.tokens),
                                      .logprobs = std::move(r.logprobs),
                                      .versions = std::move(r.versions),
                                      .reward = text.ok() && *text == group.answer ? 1.0 : 0.0};
      if (!r.routing.empty()) {
        sample.routing = RoutingIds(r);
        const int64_t rows = static_cast<int64_t>(sample.prompt_tokens.size() + sample.tokens.size()) - 1;
        sample.routing_shape = {rows, layers, top_k};
      }
      submission.samples.push_back(std::move(sample));
      ++stats_.samples;
    }
    ++next;
  }
  return submissions;
}

Result<std::string> Actor::Continuation(const nlohmann::json& conversation, const nlohmann::json& added,
                                        const std::string& so_far) const {
  if (!chat_) {
    std::string text;
    for (const nlohmann::json& message : added) {
      if (message.contains("content") && message["content"].is_string()) text += message["content"].get<std::string>();
    }
    return text;
  }
  nlohmann::ordered_json messages = nlohmann::ordered_json::parse(conversation.dump());
  for (const nlohmann::json& message : added) messages.push_back(nlohmann::ordered_json::parse(message.dump()));
  const nlohmann::ordered_json context = {{"messages", messages}, {"add_generation_prompt", true},
                                          {"bos_token", bos_text_}, {"eos_token", eos_text_}};
  FW_ASSIGN_OR_RETURN(std::string rendered, chat_->Render(context));
  if (rendered.compare(0, so_far.size(), so_far) != 0) {
    return Status::NotFound("the chat template does not render the episode so far as a prefix");
  }
  return rendered.substr(so_far.size());
}

struct Actor::Episode {
  size_t submission = 0;
  int64_t index = 0;
  std::vector<int32_t> prompt, tokens;
  std::vector<float> logprobs;
  std::vector<uint64_t> versions;
  std::vector<uint8_t> mask;
  nlohmann::json conversation;  // as the trainer keeps it
  std::string text;             // the sequence as text, specials kept (prompt text first)
  size_t turn_start = 0;        // where this turn's model tokens begin in `tokens`
  bool live = true;
};

std::vector<Actor::Episode> Actor::BeginEpisodes(const ClaimAnswer& claim, std::vector<SubmitRequest>& submissions) {
  std::vector<Episode> episodes;
  for (const pipeline::ClaimedGroup& group : claim.groups) {
    Result<std::vector<int32_t>> prompt = tokenizer_->Encode(group.prompt);
    if (!prompt.ok()) {
      spdlog::warn("actor: prompt of claim {}: {}", group.claim, prompt.status().ToString());
      continue;
    }
    if (prompt->empty() || prompt->front() != tokenizer_->bos()) prompt->insert(prompt->begin(), tokenizer_->bos());
    submissions.push_back({.worker = options_.worker_id, .incarnation = incarnation_, .claim = group.claim});
    for (int64_t i = 0; i < claim.group_size; ++i) {
      Episode episode;
      episode.submission = submissions.size() - 1;
      episode.index = i;
      episode.prompt = *prompt;
      episode.conversation = group.messages;
      episode.text = group.prompt;
      episodes.push_back(std::move(episode));
    }
  }
  return episodes;
}

Result<std::vector<pipeline::TurnRequest>> Actor::SampleTurn(CompletionService& service, const ClaimAnswer& claim,
                                                             size_t submissions, std::vector<Episode>& episodes) {
  SamplingParams params;
  params.temperature = claim.temperature;
  params.max_tokens = claim.max_tokens;
  params.stop_tokens = {tokenizer_->eos()};
  std::vector<size_t> live;
  std::vector<GenerationRequest> requests;
  for (size_t e = 0; e < episodes.size(); ++e) {
    // No room for another turn within the episode's bound: it ends (ungraded).
    if (episodes[e].live && claim.max_episode_tokens > 0 &&
        static_cast<int64_t>(episodes[e].tokens.size()) + claim.max_tokens > claim.max_episode_tokens) {
      episodes[e].live = false;
    }
    if (!episodes[e].live) continue;
    std::vector<int32_t> sequence = episodes[e].prompt;
    sequence.insert(sequence.end(), episodes[e].tokens.begin(), episodes[e].tokens.end());
    requests.push_back({std::move(sequence), params, ""});
    live.push_back(e);
  }
  std::vector<pipeline::TurnRequest> turns(submissions);
  if (live.empty()) return turns;
  FW_ASSIGN_OR_RETURN(std::vector<GenerationResult> results, service.Generate(std::move(requests)));
  for (size_t k = 0; k < live.size(); ++k) {
    Episode& episode = episodes[live[k]];
    GenerationResult& r = results[k];
    tokenizer::DecodeState state;
    state.pieces = 1;  // mid-sequence: no leading-space stripping
    state.strip_left = 0;
    for (int32_t id : r.tokens) (void)tokenizer_->AppendPiece(id, /*skip_special_tokens=*/false, state, episode.text);
    episode.turn_start = episode.tokens.size();
    episode.tokens.insert(episode.tokens.end(), r.tokens.begin(), r.tokens.end());
    episode.logprobs.insert(episode.logprobs.end(), r.logprobs.begin(), r.logprobs.end());
    episode.versions.insert(episode.versions.end(), r.versions.begin(), r.versions.end());
    episode.mask.insert(episode.mask.end(), r.tokens.size(), 1);
    pipeline::TurnRequest& request = turns[episode.submission];
    request.worker = options_.worker_id;
    request.incarnation = incarnation_;
    request.samples.push_back({episode.index, r.tokens});
  }
  return turns;
}

void Actor::ContinueEpisode(Episode& episode, const pipeline::TurnOutcome& outcome, const ClaimAnswer& claim,
                            uint64_t claim_id) {
  // The turn as the trainer decodes it (its end-of-sequence token stripped), so that both
  // keep the same conversation.
  std::vector<int32_t> turn_ids(episode.tokens.begin() + static_cast<std::ptrdiff_t>(episode.turn_start),
                                episode.tokens.end());
  if (!turn_ids.empty() && turn_ids.back() == tokenizer_->eos()) turn_ids.pop_back();
  Result<std::string> completion = tokenizer_->Decode(turn_ids);
  if (completion.ok()) episode.conversation.push_back({{"role", "assistant"}, {"content", *completion}});
  Result<std::string> added = completion.ok() ? Continuation(episode.conversation, outcome.messages, episode.text)
                                              : Result<std::string>(completion.status());
  Result<std::vector<int32_t>> ids = added.ok() ? tokenizer_->Encode(*added) : Result<std::vector<int32_t>>(added.status());
  if (ids.ok() && claim.max_episode_tokens > 0 &&
      static_cast<int64_t>(episode.tokens.size() + ids->size()) + claim.max_tokens > claim.max_episode_tokens) {
    ids = Status::ResourceExhausted("the environment's messages leave no room for a turn within max_episode_tokens");
  }
  if (!ids.ok()) {
    spdlog::warn("actor: episode {} of claim {} ends: {}", episode.index, claim_id, ids.status().ToString());
    episode.live = false;
    return;
  }
  for (const nlohmann::json& message : outcome.messages) episode.conversation.push_back(message);
  episode.text += *added;
  const uint64_t version = episode.versions.empty() ? 0 : episode.versions.back();
  episode.tokens.insert(episode.tokens.end(), ids->begin(), ids->end());
  episode.logprobs.insert(episode.logprobs.end(), ids->size(), 0.0f);
  episode.versions.insert(episode.versions.end(), ids->size(), version);
  episode.mask.insert(episode.mask.end(), ids->size(), 0);
}

void Actor::PostTurn(const pipeline::TurnRequest& turn, size_t submission, const ClaimAnswer& claim,
                     std::vector<Episode>& episodes) {
  // The trainer answers once the environment has (each sample within its timeout).
  transport::HttpGetOptions http = HttpOptions();
  http.timeout = std::chrono::seconds(600);
  auto posted = transport::HttpPost(options_.trainer, "/v1/rollout/turn", ToJson(turn), http);
  Result<pipeline::TurnAnswer> answer =
      !posted.ok() ? Result<pipeline::TurnAnswer>(posted.status())
      : posted->status != 200
          ? Result<pipeline::TurnAnswer>(Status::Unavailable(transport::DescribeErrorBody(posted->status, posted->body)))
          : pipeline::ParseTurnAnswer(posted->body);
  if (!answer.ok()) {
    spdlog::warn("actor: turn of claim {}: {}", turn.claim, answer.status().ToString());
    for (Episode& episode : episodes) {
      if (episode.submission == submission) episode.live = false;
    }
    return;
  }
  for (const pipeline::TurnOutcome& outcome : answer->samples) {
    for (Episode& episode : episodes) {
      if (episode.submission != submission || episode.index != outcome.index || !episode.live) continue;
      if (outcome.kind == "continue") {
        ContinueEpisode(episode, outcome, claim, turn.claim);
      } else {
        episode.live = false;
      }
      break;
    }
  }
}

std::vector<SubmitRequest> Actor::SampleEpisodes(CompletionService& service, const ClaimAnswer& claim) {
  std::vector<SubmitRequest> submissions;
  std::vector<Episode> episodes = BeginEpisodes(claim, submissions);
  for (int64_t turn = 0; turn < claim.max_turns; ++turn) {
    Result<std::vector<pipeline::TurnRequest>> turns = SampleTurn(service, claim, submissions.size(), episodes);
    if (!turns.ok()) {
      spdlog::warn("actor: generation failed: {}", turns.status().ToString());
      return {};  // the leases lapse and the prompts go to other workers
    }
    bool any = false;
    for (size_t sub = 0; sub < turns->size(); ++sub) {
      pipeline::TurnRequest& request = (*turns)[sub];
      if (request.samples.empty()) continue;
      request.claim = submissions[sub].claim;
      PostTurn(request, sub, claim, episodes);
      any = true;
    }
    if (!any) break;
  }
  for (Episode& episode : episodes) {
    pipeline::RolloutSample sample{.prompt_tokens = std::move(episode.prompt),
                                    .tokens = std::move(episode.tokens),
                                    .logprobs = std::move(episode.logprobs),
                                    .versions = std::move(episode.versions)};
    sample.mask = std::move(episode.mask);
    submissions[episode.submission].samples.push_back(std::move(sample));
    ++stats_.samples;
  }
  return submissions;
}

Status Actor::PostSubmit(const SubmitRequest& submission) {
  const transport::HttpGetOptions http = HttpOptions();
  auto submitted = transport::HttpPost(options_.trainer, "/v1/rollout/submit", ToJson(submission), http);
  if (!submitted.ok()) return Status::Unavailable("submit: " + submitted.status().ToString());
  Result<pipeline::SubmitAnswer> verdict = pipeline::ParseSubmitAnswer(submitted->body);
  if (submitted->status == 200 && verdict.ok() && verdict->accepted) {
    ++stats_.groups_submitted;
  } else {
    ++stats_.groups_refused;
    spdlog::warn("actor: group of claim {} refused: {}", submission.claim,
                 verdict.ok() ? verdict->reason
                              : transport::DescribeErrorBody(submitted->status, submitted->body));
  }
  return Status::Ok();
}

Result<milliseconds> Actor::Round(CompletionService& service) {
  FW_ASSIGN_OR_RETURN(ClaimAnswer claim, PostClaim(service));
  if (claim.kind == ClaimAnswer::Kind::kWait) return milliseconds(claim.retry_ms);
  if (claim.kind == ClaimAnswer::Kind::kDone) return milliseconds(1000);
  const std::vector<SubmitRequest> submissions =
      claim.max_turns > 1 ? SampleEpisodes(service, claim) : Sample(service, claim);
  if (submissions.empty() && !claim.groups.empty()) return milliseconds(200);
  for (const SubmitRequest& submission : submissions) FW_RETURN_IF_ERROR(PostSubmit(submission));
  return milliseconds(0);
}

}  // namespace flywheel::rollout
