// The OpenAI API of a rollout worker: the requests of the RL loop in-process and over HTTP
// in the form users already script against (OpenAI's completions and chat completions, as
// vLLM and SGLang serve them), on the request scheduler (rollout/scheduler.h) that drives
// the engine.
//
// POST /v1/completions, JSON:
//   prompt          string (tokenized with the tokenizer's special tokens, e.g. Llama's BOS)
//                   or array of token ids                                       (required)
//   max_tokens      int, default 16;  temperature (default 1), top_p (1), top_k (0 = off)
//   n               samples per prompt, 1..max_n (each with seed + i when a seed is given)
//   seed            int
//   stop            a string or a list of strings (any length: the text stops before the
//                   first match, which is left out) and/or token ids (the token is kept)
//   ignore_eos      true: do not stop at the tokenizer's end tokens (they stop by default)
//   logprobs        true, or k in 0..20: per-token logprobs (and the k most likely tokens);
//                   top_logprobs k as an alternative spelling
//   stream          true: server-sent events, one `data: {chunk}` per step, then
//                   `data: [DONE]`; stream_options.include_usage adds a usage chunk
//   return_routing  MoE routing per token (uint8 ids, layout in `routing_shape`)
//   adapter         a loaded LoRA adapter (`model` naming one works too; a `model` that is
//                   neither the served name nor a loaded adapter is a 404, never the base)
// POST /v1/chat/completions: messages (role, content as a string or text parts, tool_calls,
//   tool_call_id, name, reasoning_content), tools (handed to the chat template),
//   chat_template_kwargs (e.g. enable_thinking), add_generation_prompt (default true), and
//   max_tokens / max_completion_tokens (default: what the context has left), stop, n,
//   sampling and seed as above, logprobs (bool) + top_logprobs (0..20), stream, stream_options.
//   The answer's message has the text as `content`; with tools, `<tool_call>{json}</tool_call>`
//   blocks (the Hermes / Qwen form) become `tool_calls` with finish_reason "tool_calls";
//   with ServingOptions::reasoning_parser, the reasoning goes to `reasoning_content`
//   (tokenizer/answer_parser.h). Streamed, the same parts come as `delta.reasoning_content`,
//   `delta.content` and `delta.tool_calls` (index, id, type, function name and arguments,
//   each call in the chunk that closes it); concatenated, they equal the whole answer's.
// Structured outputs (both endpoints): response_format json_object / json_schema,
//   guided_json, guided_regex, guided_choice, structured_outputs (rollout/structured_output.h):
//   every token is sampled from the distribution masked to what the grammar allows, and
//   each choice says `"guided": true` (its logprobs are of the masked distribution, which an
//   RL loss must know). An answer cut by max_tokens is incomplete (finish_reason "length");
//   one the vocabulary cannot continue ends with finish_reason "grammar".
// GET /v1/models; POST /tokenize ({prompt, add_special_tokens} or {messages, ...}) and
// POST /detokenize ({tokens}) as vLLM answers them.
//
// Every answer keeps flywheel's fields beside OpenAI's: per choice `token_ids`,
// `policy_versions` (the policy version that sampled each token) and, with return_routing,
// `routing`; chat answers also `prompt_token_ids`. Streamed chunks carry the token ids and
// versions of the tokens they add.
//
// Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the
// status and code of transport/api.h's table (ErrorShape::kOpenAi), the server's own
// refusals (401, 403, 405, 413) included: 400 invalid_request_error for bad JSON, bad
// parameters, or a prompt plus max_tokens over the context (max_model_len); 404
// not_found_error for an unknown adapter; 503 server_error once stopping or before the
// first version. A client that leaves (mid-stream or while waiting) frees its requests'
// cache slots at once. A bad request never disturbs the others.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "model/tokenizer.h"
#include "rollout/engine.h"
#include "rollout/scheduler.h"
#include "rollout/structured_output.h"
#include "tokenizer/answer_parser.h"
#include "tokenizer/chat_template.h"
#include "transport/http.h"

namespace flywheel::rollout {

using tokenizer::AnswerParts;
using tokenizer::AnswerSplitter;
using tokenizer::ParsedToolCall;
using tokenizer::ParseReasoningParser;
using tokenizer::ReasoningParser;

struct ServingOptions {
  int64_t max_n = 16;
  std::string model_name = "flywheel";
  int http_threads = 16;  // HTTP requests waiting for their samples at once
  // Prompt plus completion tokens a request may use; 0: the engine's max_sequence (and never
  // more than it).
  int64_t max_model_len = 0;
  // The chat template of /v1/chat/completions (null: chat is answered 400 naming the
  // missing template), and the tokens it may refer to.
  std::shared_ptr<const tokenizer::ChatTemplate> chat_template;
  // Why there is no chat template (e.g. the model's could not be parsed), for chat's 400.
  std::string chat_template_error;
  std::string bos_token, eos_token;
  // Chat answers: reasoning moved into `reasoning_content` (tokenizer/answer_parser.h).
  ReasoningParser reasoning_parser = ReasoningParser::kNone;
  // Runs every engine step (the argument) inside it, e.g. under the sync worker's shared
  // weights lock when the engine computes straight from the served weights (fp32 serving:
  // rollout/mirror.h AliasWeights), so a swap never lands in the middle of a step.
  std::function<void(const std::function<void()>&)> step_guard;
};

class CompletionService {
 public:
  CompletionService(std::shared_ptr<Engine> engine, std::shared_ptr<const model::Tokenizer> tokenizer,
                    ServingOptions options = {});
  // Stops the scheduler; requests still waiting fail with Unavailable.
  ~CompletionService();

  // In-process: submits every request (all or none: a bad one fails the call), waits for
  // their results, in order.
  Result<std::vector<GenerationResult>> Generate(std::vector<GenerationRequest> requests);
  // The JSON APIs without HTTP (streaming requests are answered whole, as the SSE text):
  // status and body of the answer to a completions or chat completions request.
  transport::HttpResponse Complete(const std::string& body);
  transport::HttpResponse Chat(const std::string& body);
  // Adds the routes above to `server` (call on its executor or before it serves).
  void Register(transport::HttpServer& server);
  // The same routes, answered by the service `get` returns at the time of each request (503
  // while it returns null: a worker before its first version).
  static void RegisterRoutes(transport::HttpServer& server,
                             std::function<std::shared_ptr<CompletionService>()> get);

  // The routes' handlers. Handle: a completions (chat false) or chat completions request,
  // streamed when it asks to be; run on the server's executor.
  transport::awaitable<std::optional<transport::HttpResponse>> Handle(bool chat, std::string body,
                                                                      transport::HttpStream& stream);
  transport::HttpResponse Tokenize(const std::string& body);
  transport::HttpResponse Detokenize(const std::string& body);
  transport::HttpResponse Models();

  Engine& engine() { return *engine_; }
  int64_t max_model_len() const { return max_model_len_; }

  // One HTTP request's generations and what they produced (internal, shared with the
  // request's handler).
  using Job = RequestScheduler::Job;
  struct Call;

 private:
  // Parses a request, renders and tokenizes its prompt, and submits its choices.
  Result<std::shared_ptr<Call>> Prepare(bool chat, const std::string& body);
  transport::HttpResponse Answer(bool chat, const std::string& body);
  template <typename Fn>
  transport::awaitable<transport::HttpResponse> OnPool(Fn fn);

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<const model::Tokenizer> tokenizer_;
  ServingOptions options_;
  int64_t max_model_len_ = 0;
  std::unique_ptr<RequestScheduler> scheduler_;
  std::unique_ptr<GuideCache> guides_;
  std::unique_ptr<boost::asio::thread_pool> http_pool_;
};

}  // namespace flywheel::rollout
