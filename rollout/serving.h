// The serving side of a rollout worker: a thread that drives the engine, the same requests
// in-process (the RL loop) and over HTTP in the style users already script against
// (OpenAI-compatible completions over text or token ids).
//
// POST /v1/completions, JSON:
//   prompt          string (tokenized) or array of token ids            (required)
//   max_tokens      int, default 16;  temperature (default 1), top_p (1), top_k (0 = off)
//   n               samples per prompt, 1..max_n (each with seed + i when a seed is given)
//   seed            int; stop: array of token ids or single-token strings
//   logprobs        true (or a number): include per-token logprobs and tokens
//   return_routing  MoE routing per token (uint8 ids, layout in `routing_shape`)
//   adapter         a loaded LoRA adapter; model: ignored; stream: true is refused
// Answer: {"id","object":"text_completion","created","model","choices":[{"index","text",
//   "token_ids","policy_versions","finish_reason", "logprobs":{"tokens","token_logprobs"},
//   "routing","routing_shape"}],"usage":{"prompt_tokens","completion_tokens","total_tokens"}}.
// Errors: 400 {"error":{"message","type":"invalid_request_error"}} for bad JSON, bad
// parameters or an over-long prompt; 404 for an unknown adapter; 503 once stopping. A bad
// request never disturbs the others.
#pragma once

#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/status.h"
#include "rollout/engine.h"
#include "model/tokenizer.h"
#include "transport/http.h"

namespace flywheel::rollout {

// {"error":{"message","type"}} with `status`, as the completions API answers errors.
transport::HttpResponse JsonError(int status, const std::string& message);

struct ServingOptions {
  int64_t max_n = 16;
  std::string model_name = "flywheel";
  int http_threads = 16;  // HTTP requests waiting for their samples at once
  // Runs every engine step (the argument) inside it, e.g. under the sync worker's shared
  // weights lock when the engine computes straight from the served weights (fp32 serving:
  // rollout/mirror.h AliasWeights), so a swap never lands in the middle of a step.
  std::function<void(const std::function<void()>&)> step_guard;
};

class CompletionService {
 public:
  CompletionService(std::shared_ptr<Engine> engine, std::shared_ptr<const model::Tokenizer> tokenizer,
                    ServingOptions options = {});
  // Stops the driver; requests still waiting fail with Unavailable.
  ~CompletionService();

  // In-process: submits every request (all or none: a bad one fails the call), waits for
  // their results, in order.
  Result<std::vector<GenerationResult>> Generate(std::vector<GenerationRequest> requests);
  // The JSON API without HTTP: status and body of the answer to a completions request.
  transport::HttpResponse Complete(const std::string& body);
  // Adds POST /v1/completions to `server` (call on its executor or before it serves).
  void Register(transport::HttpServer& server);
  // The route's handler: Complete() on a pool thread, so the server goes on serving.
  transport::awaitable<transport::HttpResponse> HandleHttp(std::string body);

  Engine& engine() { return *engine_; }

 private:
  void Drive();

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<const model::Tokenizer> tokenizer_;
  ServingOptions options_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::map<uint64_t, std::promise<GenerationResult>> pending_;  // GUARDED_BY(mutex_)
  std::unique_ptr<boost::asio::thread_pool> http_pool_;
  std::thread driver_;
};

}  // namespace flywheel::rollout
