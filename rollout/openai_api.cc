#include "rollout/openai_api.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "base/env.h"
#include "base/hex.h"
#include "base/json.h"
#include "tokenizer/incremental.h"
#include "tokenizer/unicode.h"
#include "transport/api.h"
#include "transport/connection.h"

namespace flywheel::rollout {

namespace {

using nlohmann::json;
using ojson = nlohmann::ordered_json;

std::string Dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

}  // namespace

namespace {

// Every error of these routes: OpenAI's shape, by the table of transport/api.h.
transport::HttpResponse ErrorFor(const Status& status) {
  return transport::ErrorResponse(status, transport::ErrorShape::kOpenAi);
}

transport::HttpResponse BadRequest(std::string message) {
  return ErrorFor(Status::InvalidArgument(std::move(message)));
}

transport::HttpResponse Unavailable(std::string message) {
  return ErrorFor(Status::Unavailable(std::move(message)));
}

// Reads an optional field of a JSON type; a wrong type is InvalidArgument naming it.
template <typename T>
Status Field(const ojson& request, const char* key, T& out) {
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

int64_t NowSeconds() { return UnixMicrosNow() / 1000000; }

std::string RandomId(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return prefix + Hex64(salt * 0x9E3779B97F4A7C15ULL + counter++);
}

// The text of one token alone and its bytes (for logprobs).
std::pair<std::string, std::vector<int>> TokenBytes(const model::Tokenizer& tokenizer, int32_t id) {
  tokenizer::DecodeState state;
  state.pieces = 1;  // not the first token: no leading-space strip
  state.strip_left = 0;
  std::string bytes;
  if (!tokenizer.AppendPiece(id, /*skip_special_tokens=*/false, state, bytes).ok()) bytes.clear();
  std::string text;
  tokenizer::unicode::AppendLossy(bytes, text, true);
  std::vector<int> values(bytes.begin(), bytes.end());
  for (int& v : values) v &= 0xFF;
  return {text, values};
}

}  // namespace

// --- the service ---------------------------------------------------------------------------

CompletionService::CompletionService(std::shared_ptr<Engine> engine,
                                     std::shared_ptr<const model::Tokenizer> tokenizer,
                                     ServingOptions options)
    : engine_(std::move(engine)), tokenizer_(std::move(tokenizer)), options_(std::move(options)) {
  max_model_len_ = engine_->max_sequence();
  if (options_.max_model_len > 0) max_model_len_ = std::min(max_model_len_, options_.max_model_len);
  http_pool_ = std::make_unique<boost::asio::thread_pool>(
      static_cast<size_t>(std::max(1, options_.http_threads)));
  scheduler_ = std::make_unique<RequestScheduler>(engine_, options_.step_guard);
  guides_ = std::make_unique<GuideCache>(tokenizer_);
}

CompletionService::~CompletionService() {
  scheduler_->Stop();  // wakes the pool's waiters (their jobs are aborted); Submits fail
  http_pool_->join();
}

Result<std::vector<GenerationResult>> CompletionService::Generate(
    std::vector<GenerationRequest> requests) {
  return scheduler_->Generate(std::move(requests));
}

// --- one HTTP request ---------------------------------------------------------------------

namespace {

struct Choice {
  // The decoder continues after the prompt: a SentencePiece answer keeps its leading space.
  explicit Choice(const model::Tokenizer& tokenizer)
      : decoder(tokenizer, /*skip_special_tokens=*/true, /*after_prompt=*/true) {}
  tokenizer::IncrementalDecoder decoder;
  std::string text;  // decoded so far; cut before a stop string once one matched
  size_t sent = 0;   // bytes of `text` already streamed
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<uint64_t> versions;
  std::vector<std::vector<TokenLogprob>> top;
  std::vector<size_t> offsets;  // where each token's text starts in `text`
  size_t tokens_sent = 0;
  bool done = false;
  bool finish_sent = false;
  bool role_sent = false;
  bool has_result = false;
  std::string finish_reason;
  GenerationResult result;  // the engine's, for routing
  // Streamed chat answers with tools or a reasoning parser: the parts of the text sent.
  std::shared_ptr<AnswerSplitter> splitter;
  size_t calls_sent = 0;
};

}  // namespace

struct CompletionService::Call {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  int64_t top_logprobs = -1;  // -1: no logprobs
  bool return_routing = false;
  bool parse_tools = false;
  bool guided = false;  // a structured output: the choices say "guided": true
  ReasoningParser reasoning = ReasoningParser::kNone;  // chat only
  std::string model;
  std::string id;
  int64_t created = 0;
  std::vector<int32_t> prompt;
  std::vector<std::string> stop_strings;
  size_t max_stop = 0;
  std::shared_ptr<Job> job;
  std::vector<Choice> choices;
  std::vector<uint64_t> to_cancel;  // engine ids whose choice ended on a stop string

  // Takes what the engine produced into the choices. REQUIRES: job->m held.
  void Absorb() {
    while (!job->events.empty()) {
      auto [index, e] = std::move(job->events.front());
      job->events.pop_front();
      Choice& c = choices[index];
      if (c.done) continue;
      c.tokens.push_back(e.token);
      c.logprobs.push_back(e.logprob);
      c.versions.push_back(e.version);
      if (top_logprobs > 0) c.top.push_back(std::move(e.top));
      c.offsets.push_back(c.text.size());
      auto piece = c.decoder.Add(e.token);
      const size_t before = c.text.size();
      if (piece.ok()) c.text += *piece;
      if (!stop_strings.empty() && c.text.size() > before) {
        // A stop string may end in the new text: search from where it could start.
        const size_t from = before >= max_stop ? before - max_stop + 1 : 0;
        size_t cut = std::string::npos;
        for (const std::string& s : stop_strings) cut = std::min(cut, c.text.find(s, from));
        if (cut != std::string::npos) {
          c.text.resize(cut);
          c.done = true;
          c.finish_reason = "stop";
          if (!job->results[index]) to_cancel.push_back(job->ids[index]);
        }
      }
    }
    for (size_t i = 0; i < choices.size(); ++i) {
      Choice& c = choices[i];
      if (!job->results[i] || c.has_result) continue;
      c.result = std::move(*job->results[i]);
      c.has_result = true;
      if (!c.done) {
        c.text += c.decoder.Finish();
        c.done = true;
        c.finish_reason = c.result.finish_reason;
      }
    }
    job->news = false;
  }

  bool AllDone() const {
    return std::all_of(choices.begin(), choices.end(), [](const Choice& c) { return c.done; });
  }
};

namespace {

// OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]} for tokens
// [from, to) of a choice.
ojson ChatLogprobs(const model::Tokenizer& tok, const Choice& c, size_t from, size_t to, int64_t k) {
  ojson content = ojson::array();
  for (size_t i = from; i < to; ++i) {
    auto [text, bytes] = TokenBytes(tok, c.tokens[i]);
    ojson top = ojson::array();
    if (k > 0 && i < c.top.size()) {
      for (size_t j = 0; j < c.top[i].size() && static_cast<int64_t>(j) < k; ++j) {
        auto [t, b] = TokenBytes(tok, c.top[i][j].token);
        top.push_back({{"token", t}, {"logprob", c.top[i][j].logprob}, {"bytes", b}});
      }
    }
    content.push_back({{"token", text}, {"logprob", c.logprobs[i]}, {"bytes", bytes}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

// The legacy completions logprobs: tokens, token_logprobs, top_logprobs (token -> logprob
// maps), text_offset.
ojson CompletionLogprobs(const model::Tokenizer& tok, const Choice& c, size_t from, size_t to,
                         int64_t k, size_t text_base) {
  ojson tokens = ojson::array(), values = ojson::array(), tops = ojson::array(),
        offsets = ojson::array();
  for (size_t i = from; i < to; ++i) {
    tokens.push_back(TokenBytes(tok, c.tokens[i]).first);
    values.push_back(c.logprobs[i]);
    offsets.push_back(text_base + std::min(c.offsets[i], c.text.size()));
    if (k > 0) {
      ojson top = ojson::object();
      if (i < c.top.size()) {
        for (size_t j = 0; j < c.top[i].size() && static_cast<int64_t>(j) < k; ++j) {
          const std::string t = TokenBytes(tok, c.top[i][j].token).first;
          if (!top.contains(t)) top[t] = c.top[i][j].logprob;
        }
      }
      tops.push_back(top);
    }
  }
  ojson out = {{"tokens", tokens}, {"token_logprobs", values}};
  out["top_logprobs"] = k > 0 ? tops : ojson(nullptr);
  out["text_offset"] = offsets;
  return out;
}

// Tool calls in OpenAI's form; `first` is the index of the first (streamed deltas count on).
ojson ToolCallsJson(const std::vector<ParsedToolCall>& calls, size_t first, bool indexed) {
  ojson out = ojson::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    ojson call = {{"id", RandomId("call_")},
                  {"type", "function"},
                  {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (indexed) call["index"] = first + i;
    out.push_back(std::move(call));
  }
  return out;
}

// A chat message's content as the template sees it: a string (text parts joined by "\n").
Status FlattenContent(ojson& message, size_t index) {
  auto it = message.find("content");
  if (it == message.end() || it->is_null() || it->is_string()) return Status::Ok();
  if (!it->is_array())
    return Status::InvalidArgument("messages[" + std::to_string(index) +
                                   "].content must be a string or a list of text parts");
  std::string text;
  for (const ojson& part : *it) {
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
        !part["text"].is_string())
      return Status::InvalidArgument("messages[" + std::to_string(index) +
                                     "].content: only text parts ({\"type\": \"text\", \"text\": ...}) "
                                     "are supported, got " + part.dump());
    if (!text.empty()) text += "\n";
    text += part["text"].get<std::string>();
  }
  *it = text;
  return Status::Ok();
}

}  // namespace

// The steps of CompletionService::Prepare, each reading one part of a request.
namespace {

using Call = CompletionService::Call;

// A chat request's prompt: its messages (and tools) through the chat template, tokenized.
Status ChatPrompt(const ojson& request, const ServingOptions& options, const model::Tokenizer& tok,
                  Call& call) {
  if (!options.chat_template)
    return Status::InvalidArgument(
        options.chat_template_error.empty()
            ? "this worker has no chat template (its tokenizer_config.json has no "
              "chat_template); use /v1/completions"
            : "this worker's chat template is not supported (" + options.chat_template_error +
                  "); use /v1/completions");
  auto m = request.find("messages");
  if (m == request.end() || !m->is_array() || m->empty())
    return Status::InvalidArgument("'messages' must be a non-empty list");
  ojson messages = *m;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].is_object() || !messages[i].contains("role") || !messages[i]["role"].is_string())
      return Status::InvalidArgument("messages[" + std::to_string(i) + "] needs a string 'role'");
    FW_RETURN_IF_ERROR(FlattenContent(messages[i], i));
  }
  ojson context = ojson::object();
  if (auto k = request.find("chat_template_kwargs"); k != request.end() && !k->is_null()) {
    if (!k->is_object()) return Status::InvalidArgument("'chat_template_kwargs' must be an object");
    for (auto it = k->begin(); it != k->end(); ++it) context[it.key()] = it.value();
  }
  context["messages"] = messages;
  bool add_generation_prompt = true;
  FW_RETURN_IF_ERROR(Field(request, "add_generation_prompt", add_generation_prompt));
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = options.bos_token;
  context["eos_token"] = options.eos_token;
  std::string tool_choice = "auto";
  if (auto tc = request.find("tool_choice"); tc != request.end() && tc->is_string())
    tool_choice = tc->get<std::string>();
  if (auto t = request.find("tools"); t != request.end() && !t->is_null() && tool_choice != "none") {
    if (!t->is_array()) return Status::InvalidArgument("'tools' must be a list");
    context["tools"] = *t;
    call.parse_tools = !t->empty();
  }
  call.reasoning = options.reasoning_parser;
  auto rendered = options.chat_template->Render(context);
  if (!rendered.ok())
    return Status::InvalidArgument("the chat template failed: " + rendered.status().message());
  FW_ASSIGN_OR_RETURN(call.prompt, tok.Encode(*rendered));
  return Status::Ok();
}

// A completions request's prompt: a string (tokenized with the special tokens) or token ids.
Status CompletionPrompt(const ojson& request, const model::Tokenizer& tok, Call& call) {
  auto p = request.find("prompt");
  if (p == request.end()) return Status::InvalidArgument("'prompt' is required");
  if (p->is_string()) {
    auto ids = tok.EncodePrompt(p->get<std::string>());
    if (!ids.ok()) return Status::InvalidArgument("prompt: " + ids.status().message());
    call.prompt = std::move(*ids);
    return Status::Ok();
  }
  if (!p->is_array() || p->empty() ||
      !std::all_of(p->begin(), p->end(), [](const ojson& v) { return v.is_number_integer(); })) {
    return Status::InvalidArgument("'prompt' must be a string or a non-empty array of token ids");
  }
  for (const ojson& v : *p) {
    const int64_t id = v.get<int64_t>();
    if (id < INT32_MIN || id > INT32_MAX)
      return Status::InvalidArgument("prompt token " + std::to_string(id) + " is out of range");
    call.prompt.push_back(static_cast<int32_t>(id));
  }
  return Status::Ok();
}

// max_tokens: chat defaults to what the context has left, completions to 16 (OpenAI's); a
// prompt plus max_tokens over the context is refused.
Status MaxTokens(const ojson& request, bool chat, int64_t max_model_len, int64_t prompt_tokens,
                 SamplingParams& params) {
  int64_t max_tokens = -1;
  FW_RETURN_IF_ERROR(Field(request, "max_tokens", max_tokens));
  if (chat) FW_RETURN_IF_ERROR(Field(request, "max_completion_tokens", max_tokens));
  const int64_t left = max_model_len - prompt_tokens;
  if (max_tokens == -1) max_tokens = chat ? left : std::min<int64_t>(16, left);
  if (max_tokens < 1) return Status::InvalidArgument("max_tokens must be >= 1, got " + std::to_string(max_tokens));
  if (max_tokens > left)
    return Status::InvalidArgument("this worker's context (max_model_len) is " +
                                   std::to_string(max_model_len) + " tokens, but the prompt has " +
                                   std::to_string(prompt_tokens) + " and max_tokens asks for " +
                                   std::to_string(max_tokens) + " more");
  params.max_tokens = max_tokens;
  return Status::Ok();
}

// logprobs: chat has logprobs (bool) + top_logprobs; completions logprobs: k (or bool).
Status Logprobs(const ojson& request, Call& call, SamplingParams& params) {
  int64_t top = 0;
  FW_RETURN_IF_ERROR(Field(request, "top_logprobs", top));
  if (auto l = request.find("logprobs"); l != request.end() && !l->is_null()) {
    if (l->is_boolean()) {
      if (l->get<bool>()) call.top_logprobs = top;
    } else if (l->is_number_integer() && !call.chat) {
      call.top_logprobs = std::max<int64_t>(l->get<int64_t>(), top);
    } else {
      return Status::InvalidArgument(call.chat
                                         ? "'logprobs' must be true or false (top_logprobs gives k)"
                                         : "'logprobs' must be an integer k in [0, 20] or a boolean");
    }
  }
  if (call.chat && top > 0 && call.top_logprobs < 0)
    return Status::InvalidArgument("'top_logprobs' needs 'logprobs': true");
  if (call.top_logprobs > kMaxTopLogprobs || top < 0 || top > kMaxTopLogprobs)
    return Status::InvalidArgument("top_logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) + "]");
  params.top_logprobs = std::max<int64_t>(call.top_logprobs, 0);
  return Status::Ok();
}

// Stops: strings (any length) and token ids ("stop", "stop_token_ids"), and the tokenizer's
// end tokens unless ignore_eos.
Status Stops(const ojson& request, const model::Tokenizer& tok, bool ignore_eos, Call& call,
             SamplingParams& params) {
  if (auto s = request.find("stop"); s != request.end() && !s->is_null()) {
    const ojson list = s->is_array() ? *s : ojson::array({*s});
    for (const ojson& v : list) {
      if (v.is_number_integer()) {
        if (v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.vocab_size())
          return Status::InvalidArgument("stop token " + v.dump() + " is outside the vocabulary");
        params.stop_tokens.push_back(v.get<int32_t>());
      } else if (v.is_string() && !v.get<std::string>().empty()) {
        call.stop_strings.push_back(v.get<std::string>());
        call.max_stop = std::max(call.max_stop, call.stop_strings.back().size());
      } else {
        return Status::InvalidArgument("'stop' entries must be non-empty strings or token ids, got " + v.dump());
      }
    }
  }
  if (auto s = request.find("stop_token_ids"); s != request.end() && !s->is_null()) {
    if (!s->is_array()) return Status::InvalidArgument("'stop_token_ids' must be a list of token ids");
    for (const ojson& v : *s) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.vocab_size())
        return Status::InvalidArgument("'stop_token_ids' must be token ids in the vocabulary, got " + v.dump());
      params.stop_tokens.push_back(v.get<int32_t>());
    }
  }
  if (ignore_eos) return Status::Ok();
  for (int32_t t : tok.StopTokens()) {
    if (t >= 0 && std::find(params.stop_tokens.begin(), params.stop_tokens.end(), t) ==
                      params.stop_tokens.end())
      params.stop_tokens.push_back(t);
  }
  return Status::Ok();
}

// Sampling, the adapter (or model) and streaming options; `n` and `seed` for the choices.
Status Sampling(const ojson& request, const std::string& served_model, Call& call,
                GenerationRequest& base, int64_t& n, int64_t& seed, bool& ignore_eos) {
  FW_RETURN_IF_ERROR(Field(request, "temperature", base.params.temperature));
  FW_RETURN_IF_ERROR(Field(request, "top_p", base.params.top_p));
  FW_RETURN_IF_ERROR(Field(request, "top_k", base.params.top_k));
  if (base.params.top_k < 0) base.params.top_k = 0;  // vLLM spells "off" as -1
  FW_RETURN_IF_ERROR(Field(request, "n", n));
  FW_RETURN_IF_ERROR(Field(request, "stream", call.stream));
  FW_RETURN_IF_ERROR(Field(request, "ignore_eos", ignore_eos));
  FW_RETURN_IF_ERROR(Field(request, "return_routing", base.params.return_routing));
  call.return_routing = base.params.return_routing;
  FW_RETURN_IF_ERROR(Field(request, "adapter", base.adapter));
  FW_RETURN_IF_ERROR(Field(request, "seed", seed));
  std::string model;
  FW_RETURN_IF_ERROR(Field(request, "model", model));
  // A model name other than the served one names an adapter; one that is not loaded is a
  // 404 (as vLLM answers), never silently the base model: an RL client that asks for a
  // session's adapter must not get samples of another policy.
  if (base.adapter.empty() && !model.empty() && model != served_model) base.adapter = model;
  call.model = base.adapter.empty() ? served_model : base.adapter;
  if (auto so = request.find("stream_options"); so != request.end() && !so->is_null()) {
    if (!so->is_object()) return Status::InvalidArgument("'stream_options' must be an object");
    FW_RETURN_IF_ERROR(Field(*so, "include_usage", call.include_usage));
  }
  return Status::Ok();
}

}  // namespace

Result<std::shared_ptr<CompletionService::Call>> CompletionService::Prepare(bool chat,
                                                                           const std::string& body) {
  FW_ASSIGN_OR_RETURN(ojson request, ParseJson<ojson>(body, "the body"));
  if (!request.is_object()) return Status::InvalidArgument("the body is not a JSON object");
  auto call = std::make_shared<Call>();
  call->chat = chat;
  call->created = NowSeconds();
  call->id = RandomId(chat ? "chatcmpl-" : "cmpl-");
  const model::Tokenizer& tok = *tokenizer_;
  FW_RETURN_IF_ERROR(chat ? ChatPrompt(request, options_, tok, *call)
                          : CompletionPrompt(request, tok, *call));
  const int64_t prompt_tokens = static_cast<int64_t>(call->prompt.size());
  if (prompt_tokens >= max_model_len_)
    return Status::InvalidArgument("the prompt has " + std::to_string(prompt_tokens) +
                                   " tokens; this worker's context (max_model_len) is " +
                                   std::to_string(max_model_len_) + " tokens");
  GenerationRequest base;
  base.prompt = call->prompt;
  int64_t n = 1, seed = -1;
  bool ignore_eos = false;
  FW_RETURN_IF_ERROR(Sampling(request, options_.model_name, *call, base, n, seed, ignore_eos));
  FW_RETURN_IF_ERROR(MaxTokens(request, chat, max_model_len_, prompt_tokens, base.params));
  FW_RETURN_IF_ERROR(Logprobs(request, *call, base.params));
  FW_RETURN_IF_ERROR(Stops(request, tok, ignore_eos, *call, base.params));
  FW_ASSIGN_OR_RETURN(base.params.guide, guides_->ForRequest(request));
  call->guided = base.params.guide != nullptr;
  if (n < 1 || n > options_.max_n)
    return Status::InvalidArgument("'n' must be in [1, " + std::to_string(options_.max_n) + "], got " +
                                   std::to_string(n));
  std::vector<GenerationRequest> requests;
  for (int64_t i = 0; i < n; ++i) {
    GenerationRequest r = base;
    if (seed >= 0) r.params.seed = static_cast<uint64_t>(seed) + static_cast<uint64_t>(i);
    requests.push_back(std::move(r));
    call->choices.emplace_back(tok);
  }
  call->job = std::make_shared<Job>();
  FW_RETURN_IF_ERROR(scheduler_->Submit(call->job, std::move(requests)));
  return call;
}

namespace {

// Waits until the engine produced something for `call` (or it is over) and absorbs it; the
// engine ids to cancel (choices that ended on a stop string) go to `cancel`. Returns false
// when the service stopped.
bool WaitForNews(CompletionService::Call& call, std::vector<uint64_t>& cancel) {
  auto& job = *call.job;
  std::unique_lock lock(job.m);
  job.cv.wait(lock, [&] { return !job.events.empty() || job.news || job.aborted || job.gone; });
  if (job.aborted) return false;
  call.Absorb();
  cancel.swap(call.to_cancel);
  return true;
}

}  // namespace

namespace {

ojson RoutingFields(const model::ModelConfig& config, const Choice& c, bool wanted) {
  ojson out = ojson::object();
  if (!wanted || config.num_experts == 0) return out;
  if (!c.has_result) {
    // Ended on a stop string and cancelled: the engine kept no routing for it.
    out["routing"] = nullptr;
    return out;
  }
  out["routing"] = c.result.routing;
  out["routing_shape"] = {static_cast<int64_t>(c.result.prompt.size() + c.result.tokens.size()) - 1,
                          config.NumMoeLayers(), config.num_experts_per_tok};
  out["routing_bytes_per_index"] = c.result.routing_bytes_per_index;
  return out;
}

// The whole answer once every choice is done.
ojson WholeAnswer(const CompletionService::Call& call, const model::Tokenizer& tok,
                  const model::ModelConfig& config) {
  ojson choices = ojson::array();
  int64_t completion_tokens = 0;
  for (size_t i = 0; i < call.choices.size(); ++i) {
    const Choice& c = call.choices[i];
    ojson choice = {{"index", i}};
    std::string finish = c.finish_reason;
    if (call.chat) {
      ojson message = {{"role", "assistant"}, {"content", c.text}};
      if (call.parse_tools || call.reasoning != ReasoningParser::kNone) {
        const AnswerParts parts = AnswerSplitter(call.reasoning, call.parse_tools).Feed(c.text, true);
        message["content"] =
            parts.content.empty() && !parts.calls.empty() ? ojson(nullptr) : ojson(parts.content);
        if (call.reasoning != ReasoningParser::kNone) {
          message["reasoning_content"] = parts.reasoning.empty() ? ojson(nullptr) : ojson(parts.reasoning);
        }
        if (!parts.calls.empty()) {
          message["tool_calls"] = ToolCallsJson(parts.calls, 0, /*indexed=*/false);
          if (finish == "stop") finish = "tool_calls";
        }
      }
      choice["message"] = message;
      choice["logprobs"] = call.top_logprobs >= 0
                               ? ChatLogprobs(tok, c, 0, c.tokens.size(), call.top_logprobs)
                               : ojson(nullptr);
    } else {
      choice["text"] = c.text;
      choice["logprobs"] = call.top_logprobs >= 0
                               ? CompletionLogprobs(tok, c, 0, c.tokens.size(), call.top_logprobs, 0)
                               : ojson(nullptr);
    }
    choice["finish_reason"] = finish;
    if (call.guided) choice["guided"] = true;
    choice["token_ids"] = c.tokens;
    choice["policy_versions"] = c.versions;
    const ojson routing = RoutingFields(config, c, call.return_routing);
    for (auto it = routing.begin(); it != routing.end(); ++it) choice[it.key()] = it.value();
    completion_tokens += static_cast<int64_t>(c.tokens.size());
    choices.push_back(std::move(choice));
  }
  const int64_t prompt_tokens = static_cast<int64_t>(call.prompt.size());
  ojson answer = {{"id", call.id},
                  {"object", call.chat ? "chat.completion" : "text_completion"},
                  {"created", call.created},
                  {"model", call.model},
                  {"choices", choices},
                  {"usage",
                   {{"prompt_tokens", prompt_tokens},
                    {"completion_tokens", completion_tokens},
                    {"total_tokens", prompt_tokens + completion_tokens}}}};
  if (call.chat) answer["prompt_token_ids"] = call.prompt;
  return answer;
}

// A streamed chat chunk's delta for `text`, new in choice `c` (its role with the first).
ojson ChatDelta(const CompletionService::Call& call, Choice& c, const std::string& text, bool end) {
  ojson d = ojson::object();
  if (!c.role_sent) d["role"] = "assistant";
  if (!call.parse_tools && call.reasoning == ReasoningParser::kNone) {
    d["content"] = text;
    return d;
  }
  if (!c.splitter) c.splitter = std::make_shared<AnswerSplitter>(call.reasoning, call.parse_tools);
  const AnswerParts parts = c.splitter->Feed(text, end);
  if (!parts.reasoning.empty()) d["reasoning_content"] = parts.reasoning;
  d["content"] = parts.content;
  if (!parts.calls.empty()) {
    d["tool_calls"] = ToolCallsJson(parts.calls, c.calls_sent, /*indexed=*/true);
    c.calls_sent += parts.calls.size();
  }
  return d;
}

// The SSE text of what is new in `call` since the last call, and whether the stream ended
// (then with its usage chunk and [DONE]).
std::string NextEvents(CompletionService::Call& call, const model::Tokenizer& tok,
                       const model::ModelConfig& config, bool& ended) {
  std::string out;
  auto chunk = [&](ojson choice) {
    ojson c = {{"id", call.id},
               {"object", call.chat ? "chat.completion.chunk" : "text_completion"},
               {"created", call.created},
               {"model", call.model},
               {"choices", ojson::array({std::move(choice)})}};
    out += "data: " + Dump(c) + "\n\n";
  };
  for (size_t i = 0; i < call.choices.size(); ++i) {
    Choice& c = call.choices[i];
    // Text that could still turn out to start a stop string stays back until it cannot.
    size_t end = c.text.size();
    if (!c.done && call.max_stop > 1) {
      end = end >= call.max_stop - 1 ? end - (call.max_stop - 1) : 0;
      end = std::max(end, c.sent);
      while (end > c.sent && (static_cast<unsigned char>(c.text[end]) & 0xC0) == 0x80) --end;
    }
    const size_t tokens_end = c.tokens.size();
    const bool finishing = c.done && !c.finish_sent;
    if (end == c.sent && tokens_end == c.tokens_sent && !finishing && (c.role_sent || !call.chat)) continue;
    const std::string delta = c.text.substr(c.sent, end - c.sent);
    ojson choice = {{"index", i}};
    if (call.chat) {
      choice["delta"] = ChatDelta(call, c, delta, finishing);
      choice["logprobs"] = call.top_logprobs >= 0
                               ? ChatLogprobs(tok, c, c.tokens_sent, tokens_end, call.top_logprobs)
                               : ojson(nullptr);
    } else {
      choice["text"] = delta;
      choice["logprobs"] = call.top_logprobs >= 0 ? CompletionLogprobs(tok, c, c.tokens_sent, tokens_end,
                                                                       call.top_logprobs, 0)
                                                  : ojson(nullptr);
    }
    const bool called = call.chat && c.calls_sent > 0 && c.finish_reason == "stop";
    choice["finish_reason"] = finishing ? ojson(called ? "tool_calls" : c.finish_reason) : ojson(nullptr);
    if (call.guided) choice["guided"] = true;
    choice["token_ids"] = std::vector<int32_t>(c.tokens.begin() + static_cast<ptrdiff_t>(c.tokens_sent),
                                               c.tokens.end());
    choice["policy_versions"] = std::vector<uint64_t>(
        c.versions.begin() + static_cast<ptrdiff_t>(c.tokens_sent), c.versions.end());
    if (finishing) {
      const ojson routing = RoutingFields(config, c, call.return_routing);
      for (auto it = routing.begin(); it != routing.end(); ++it) choice[it.key()] = it.value();
    }
    c.role_sent = true;
    c.sent = end;
    c.tokens_sent = tokens_end;
    if (finishing) c.finish_sent = true;
    chunk(std::move(choice));
  }
  ended = call.AllDone();
  if (ended) {
    if (call.include_usage) {
      int64_t completion_tokens = 0;
      for (const Choice& c : call.choices) completion_tokens += static_cast<int64_t>(c.tokens.size());
      const int64_t prompt_tokens = static_cast<int64_t>(call.prompt.size());
      ojson usage = {{"id", call.id},
                     {"object", call.chat ? "chat.completion.chunk" : "text_completion"},
                     {"created", call.created},
                     {"model", call.model},
                     {"choices", ojson::array()},
                     {"usage",
                      {{"prompt_tokens", prompt_tokens},
                       {"completion_tokens", completion_tokens},
                       {"total_tokens", prompt_tokens + completion_tokens}}}};
      out += "data: " + Dump(usage) + "\n\n";
    }
    out += "data: [DONE]\n\n";
  }
  return out;
}

}  // namespace

transport::HttpResponse CompletionService::Answer(bool chat, const std::string& body) {
  auto prepared = Prepare(chat, body);
  if (!prepared.ok()) return ErrorFor(prepared.status());
  Call& call = **prepared;
  std::string sse;
  for (std::vector<uint64_t> cancel;; cancel.clear()) {
    if (!WaitForNews(call, cancel)) return Unavailable("the rollout worker stopped");
    if (!cancel.empty()) scheduler_->CancelIds(cancel);  // ended on a stop string: the rest is not needed
    if (call.stream) {
      bool ended = false;
      sse += NextEvents(call, *tokenizer_, engine_->config(), ended);
      if (ended) return {200, "text/event-stream", sse};
    } else if (call.AllDone()) {
      scheduler_->Cancel(call.job);
      return {200, "application/json", Dump(WholeAnswer(call, *tokenizer_, engine_->config()))};
    }
  }
}

transport::HttpResponse CompletionService::Complete(const std::string& body) {
  return Answer(/*chat=*/false, body);
}

transport::HttpResponse CompletionService::Chat(const std::string& body) {
  return Answer(/*chat=*/true, body);
}

namespace {

// What one wait on a call's job gave the HTTP handler.
struct HandlerStep {
  bool alive = true;   // false: the service stopped
  bool ended = false;  // every choice is done
  std::string sse;     // the events to stream
};

}  // namespace

// (GCC 12's coroutines: every co_await below is a statement of its own, with named operands,
// and every co_return returns a named local; temporaries inside co_await expressions are
// destroyed twice otherwise.)
transport::awaitable<std::optional<transport::HttpResponse>> CompletionService::Handle(
    bool chat, std::string body, transport::HttpStream& stream) {
  std::optional<transport::HttpResponse> answer;
  auto prepare = [this, chat, body = std::move(body)] { return Prepare(chat, body); };
  std::optional<Result<std::shared_ptr<Call>>> prepared =
      co_await transport::RunOn(*http_pool_, std::move(prepare));
  if (!prepared) {
    answer = Unavailable("the rollout worker is stopping");
    co_return answer;
  }
  if (!prepared->ok()) {
    answer = ErrorFor(prepared->status());
    co_return answer;
  }
  std::shared_ptr<Call> call = **prepared;
  // Ends the job's engine requests from a pool thread: the service's lock, which that
  // takes, is held by a Submit while the engine steps, and this runs on the network thread.
  auto drop = [this, call] { boost::asio::post(*http_pool_, [this, call] { scheduler_->Cancel(call->job); }); };
  // A client that leaves frees its requests' slots at once.
  // Marks the job at once (its waiter wakes); the engine requests are dropped on the pool,
  // since that takes the service's lock, which a Submit holds while the engine steps.
  stream.OnGone([this, call] {
    {
      std::lock_guard lock(call->job->m);
      call->job->gone = true;
    }
    call->job->cv.notify_all();
    boost::asio::post(*http_pool_, [this, call] { scheduler_->Cancel(call->job); });
  });
  for (;;) {
    auto wait = [this, call] {
      HandlerStep s;
      std::vector<uint64_t> cancel;
      s.alive = WaitForNews(*call, cancel);
      if (!cancel.empty()) scheduler_->CancelIds(cancel);  // ended on a stop string
      if (!s.alive) return s;
      if (call->stream) {
        s.sse = NextEvents(*call, *tokenizer_, engine_->config(), s.ended);
      } else {
        s.ended = call->AllDone();
      }
      return s;
    };
    std::optional<HandlerStep> step = co_await transport::RunOn(*http_pool_, std::move(wait));
    bool client_left = false;
    {
      std::lock_guard lock(call->job->m);
      client_left = call->job->gone;
    }
    if (!step || !step->alive || client_left) {
      drop();
      if (!client_left && !stream.gone()) answer = Unavailable("the rollout worker stopped");
      co_return answer;
    }
    if (!call->stream) {
      if (!step->ended) continue;
      drop();
      answer = transport::HttpResponse{200, "application/json",
                                       Dump(WholeAnswer(*call, *tokenizer_, engine_->config()))};
      co_return answer;
    }
    if (!step->sse.empty()) {
      std::string sse = std::move(step->sse);
      const bool written = co_await stream.Write(std::move(sse));
      if (!written) {
        drop();
        co_return answer;
      }
    }
    if (step->ended) {
      drop();
      co_return answer;
    }
  }
}

// --- tokenize, detokenize, models -----------------------------------------------------------

transport::HttpResponse CompletionService::Tokenize(const std::string& body) {
  Result<ojson> parsed = ParseJson<ojson>(body, "the body");
  if (!parsed.ok()) return ErrorFor(parsed.status());
  ojson request = std::move(parsed).value();
  if (!request.is_object()) return BadRequest("the body is not a JSON object");
  bool return_strs = false;
  Status s = Field(request, "return_token_strs", return_strs);
  if (!s.ok()) return ErrorFor(s);
  std::vector<int32_t> ids;
  if (request.contains("messages")) {
    if (!options_.chat_template) return BadRequest("this worker has no chat template");
    ojson messages = request["messages"];
    if (!messages.is_array()) return BadRequest("'messages' must be a list");
    for (size_t i = 0; i < messages.size(); ++i) {
      Status f = FlattenContent(messages[i], i);
      if (!f.ok()) return ErrorFor(f);
    }
    ojson context = request.value("chat_template_kwargs", ojson::object());
    if (!context.is_object()) return BadRequest("'chat_template_kwargs' must be an object");
    context["messages"] = messages;
    bool add_generation_prompt = true, add_special = false;
    Status f = Field(request, "add_generation_prompt", add_generation_prompt);
    if (f.ok()) f = Field(request, "add_special_tokens", add_special);
    if (!f.ok()) return ErrorFor(f);
    context["add_generation_prompt"] = add_generation_prompt;
    context["bos_token"] = options_.bos_token;
    context["eos_token"] = options_.eos_token;
    if (request.contains("tools") && !request["tools"].is_null()) context["tools"] = request["tools"];
    auto rendered = options_.chat_template->Render(context);
    if (!rendered.ok()) return BadRequest("the chat template failed: " + rendered.status().message());
    auto encoded = add_special ? tokenizer_->EncodePrompt(*rendered) : tokenizer_->Encode(*rendered);
    if (!encoded.ok()) return ErrorFor(encoded.status());
    ids = std::move(*encoded);
  } else {
    auto p = request.find("prompt");
    if (p == request.end() || !p->is_string()) return BadRequest("'prompt' (a string) or 'messages' is required");
    bool add_special = true;
    s = Field(request, "add_special_tokens", add_special);
    if (!s.ok()) return ErrorFor(s);
    auto encoded = add_special ? tokenizer_->EncodePrompt(p->get<std::string>())
                               : tokenizer_->Encode(p->get<std::string>());
    if (!encoded.ok()) return ErrorFor(encoded.status());
    ids = std::move(*encoded);
  }
  ojson answer = {{"count", ids.size()}, {"max_model_len", max_model_len_}, {"tokens", ids}};
  if (return_strs) {
    ojson strs = ojson::array();
    for (int32_t id : ids) strs.push_back(TokenBytes(*tokenizer_, id).first);
    answer["token_strs"] = strs;
  } else {
    answer["token_strs"] = nullptr;
  }
  return {200, "application/json", Dump(answer)};
}

transport::HttpResponse CompletionService::Detokenize(const std::string& body) {
  Result<ojson> parsed = ParseJson<ojson>(body, "the body");
  if (!parsed.ok()) return ErrorFor(parsed.status());
  ojson request = std::move(parsed).value();
  if (!request.is_object()) return BadRequest("the body is not a JSON object");
  auto t = request.find("tokens");
  if (t == request.end() || !t->is_array() ||
      !std::all_of(t->begin(), t->end(), [](const ojson& v) { return v.is_number_integer(); }))
    return BadRequest("'tokens' must be a list of token ids");
  std::vector<int32_t> ids;
  for (const ojson& v : *t) {
    const int64_t id = v.get<int64_t>();
    if (id < 0 || id >= tokenizer_->vocab_size())
      return BadRequest("token " + std::to_string(id) + " is outside the vocabulary [0, " +
                                std::to_string(tokenizer_->vocab_size()) + ")");
    ids.push_back(static_cast<int32_t>(id));
  }
  bool skip_special = true;
  if (Status f = Field(request, "skip_special_tokens", skip_special); !f.ok()) return ErrorFor(f);
  tokenizer::IncrementalDecoder decoder(*tokenizer_, skip_special);
  std::string text;
  for (int32_t id : ids) {
    auto piece = decoder.Add(id);
    if (!piece.ok()) return ErrorFor(piece.status());
    text += *piece;
  }
  text += decoder.Finish();
  return {200, "application/json", Dump(ojson{{"prompt", text}})};
}

transport::HttpResponse CompletionService::Models() {
  ojson data = ojson::array();
  const int64_t created = NowSeconds();
  data.push_back({{"id", options_.model_name},
                  {"object", "model"},
                  {"created", created},
                  {"owned_by", "flywheel"},
                  {"root", options_.model_name},
                  {"parent", nullptr},
                  {"max_model_len", max_model_len_}});
  for (const std::string& adapter : engine_->adapters()) {
    data.push_back({{"id", adapter},
                    {"object", "model"},
                    {"created", created},
                    {"owned_by", "flywheel"},
                    {"root", adapter},
                    {"parent", options_.model_name},
                    {"max_model_len", max_model_len_}});
  }
  return {200, "application/json", Dump(ojson{{"object", "list"}, {"data", data}})};
}

template <typename Fn>
transport::awaitable<transport::HttpResponse> CompletionService::OnPool(Fn fn) {
  std::optional<transport::HttpResponse> pooled = co_await transport::RunOn(*http_pool_, std::move(fn));
  transport::HttpResponse answer = pooled ? std::move(*pooled) : Unavailable("the rollout worker is stopping");
  co_return answer;
}

void CompletionService::Register(transport::HttpServer& server) {
  // A non-owning pointer: the service outlives its server's requests by contract.
  std::shared_ptr<CompletionService> self(std::shared_ptr<void>(), this);
  RegisterRoutes(server, [self] { return self; });
}

void CompletionService::RegisterRoutes(transport::HttpServer& server,
                                       std::function<std::shared_ptr<CompletionService>()> get) {
  using transport::HttpResponse;
  const auto not_yet = [] { return Unavailable("this worker serves no policy version yet"); };
  for (bool chat : {false, true}) {
    server.RoutePostStream(
        chat ? "/v1/chat/completions" : "/v1/completions",
        [get, chat, not_yet](std::string, std::string body, transport::HttpStream& stream)
            -> transport::awaitable<std::optional<HttpResponse>> {
          std::shared_ptr<CompletionService> service = get();
          std::optional<HttpResponse> answer;
          if (!service) {
            answer = not_yet();
            co_return answer;
          }
          transport::awaitable<std::optional<HttpResponse>> handled =
              service->Handle(chat, std::move(body), stream);
          answer = co_await std::move(handled);
          co_return answer;
        },
        4 << 20, transport::kScopeSample, transport::ErrorShape::kOpenAi);
  }
  for (bool tokenize : {true, false}) {
    server.RoutePost(
        tokenize ? "/tokenize" : "/detokenize",
        [get, tokenize, not_yet](std::string, std::string body) -> transport::awaitable<HttpResponse> {
          std::shared_ptr<CompletionService> service = get();
          HttpResponse answer;
          if (!service) {
            answer = not_yet();
            co_return answer;
          }
          auto fn = [service, tokenize, body = std::move(body)] {
            return tokenize ? service->Tokenize(body) : service->Detokenize(body);
          };
          transport::awaitable<HttpResponse> pooled = service->OnPool(std::move(fn));
          answer = co_await std::move(pooled);
          co_return answer;
        },
        4 << 20, transport::kScopeSample, transport::ErrorShape::kOpenAi);
  }
  server.Route(
      "/v1/models",
      [get, not_yet](const std::string&) {
        std::shared_ptr<CompletionService> service = get();
        return service ? service->Models() : not_yet();
      },
      false, transport::kScopeRead, transport::ErrorShape::kOpenAi);
}

}  // namespace flywheel::rollout
