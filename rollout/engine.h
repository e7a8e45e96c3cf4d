// The rollout engine: batched autoregressive generation on the shared transformer
// (model/model.h) with a KV cache and continuous batching, so what is sampled is what
// the trainer trains.
//
// Scheduling: every Step() first admits waiting requests into free cache slots (a prefill
// of the prompt each), then decodes one token for every active request in one batched
// forward. Active requests always occupy slots [0, active): when one finishes, the last
// slot's cache moves into its place, so a decode step attends over a view of the cache,
// never a copy.
//
// Per generated token the engine returns the token id, its sampling logprob, the policy
// version whose weights produced it, and for MoE models the routing: the top-k experts of
// every MoE layer for every token the trainer will feed back (the prompt and all generated
// tokens but the last), packed as uint8 (uint16 when a model has more than 256 experts).
//
// Sampling logprob: log softmax(logits / temperature) at the chosen token (before top-k /
// top-p truncation; temperature 0, greedy, reports the untempered distribution), so at
// temperature 1 it is exactly the logprob the trainer recomputes. Seeded requests draw from
// their own generator: the same request and seed give the same tokens whatever else is in
// the batch. With top_logprobs = k, every generated token also carries the k most likely
// tokens of that same distribution, computed the same way (so the sampled token's logprob
// equals its entry there, bit for bit).
//
// Shared prefixes (EngineOptions::share_prefixes): a prompt is not prefilled from scratch
// when the engine already holds keys and values for its leading tokens, computed by the
// current weights (and adapter) for another request: a sample of the same group admitted in
// the same step (its whole prompt: the prefill's logits are reused too), a request in
// flight, or a finished request kept in the prefix slots (LRU; the turns of an episode, a
// common system prompt). Those rows are copied into the request's cache slot and only the
// rest of the prompt is prefilled. A prefix computed before a swap or an adapter change is
// never reused. For a whole-prompt match the copy is exact, so a seeded sample's tokens and
// logprobs equal the unshared ones bit for bit; a partial match prefills the remaining
// tokens as a second chunk, whose floating-point sums may group differently (see
// docs/ROLLOUT.md).
//
// Chunked prefill (EngineOptions::prefill_chunk): a long prompt arriving while other
// requests decode is prefilled a chunk per Step, before that Step's decode; its first token
// is sampled when the last chunk is in. A swap between two chunks starts its prefill again
// (rows computed by older weights are not mixed with newer ones).
//
// Streaming: Step(&events) also reports every token it generated, one TokenEvent each, so a
// consumer can forward tokens as they are sampled; Cancel drops a request mid-flight.
//
// One thread drives Submit/Step (the serving layer owns that thread); Swap may come from
// another (the sync worker's apply thread) and runs between two steps.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "base/status.h"
#include "checkpoint/tensor.h"
#include "ops/histogram.h"
#include "model/model.h"
#include "tokenizer/token_guide.h"

namespace flywheel::rollout {

// The most alternatives a request may ask for per generated token (SamplingParams::top_logprobs).
inline constexpr int64_t kMaxTopLogprobs = 20;

// One entry of a token's top-logprobs list.
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;  // log softmax(logits / temperature), as the sampling logprob
};

struct SamplingParams {
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // (0, 1]
  std::optional<uint64_t> seed;
  int64_t max_tokens = 16;
  std::vector<int32_t> stop_tokens;  // generation ends after emitting one of these
  bool return_routing = false;       // MoE: also return the routing matrix
  // 0..kMaxTopLogprobs: per generated token, the min(top_logprobs, vocab) most likely tokens
  // of the distribution the sampling logprob comes from (before top-k / top-p truncation),
  // most likely first, equal logits by lower token id. 0: none, and no cost.
  int64_t top_logprobs = 0;
  // Structured output: each token is sampled from the distribution masked to the tokens the
  // grammar allows next (the request's stop tokens too, once the text so far is a whole
  // word of it); the sampling logprob and top logprobs are those of the masked distribution
  // (GenerationResult::guided says so). When the grammar allows nothing (a dead end for
  // this vocabulary) the request ends without a token: finish_reason "grammar" ("stop" when
  // the text is whole).
  std::shared_ptr<tokenizer::TokenGuide> guide;

  // Names the bad field and value; `vocab` bounds the stop tokens.
  Status Validate(int64_t vocab) const;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  SamplingParams params;
  std::string adapter;  // a loaded LoRA adapter's name; empty: the base model
};

struct GenerationResult {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;     // generated
  std::vector<float> logprobs;     // one per generated token
  std::vector<uint64_t> versions;  // the policy version that sampled each generated token
  // One list per generated token when params.top_logprobs > 0 (see SamplingParams); empty
  // otherwise.
  std::vector<std::vector<TokenLogprob>> top_logprobs;
  // With return_routing on a MoE model: (prompt + generated - 1) tokens x MoE layers x top-k,
  // token-major, one byte per index (two, little endian, when experts > 256).
  std::vector<uint8_t> routing;
  int routing_bytes_per_index = 1;
  std::string finish_reason;  // "stop", "length" or "grammar" (see SamplingParams::guide)
  bool guided = false;        // the logprobs are of a grammar-masked distribution
};

// One generated token as Step reports it while a request is in flight (streaming).
struct TokenEvent {
  uint64_t id = 0;  // the request
  int32_t token = 0;
  float logprob = 0;
  uint64_t version = 0;           // the policy version that sampled it
  std::vector<TokenLogprob> top;  // when the request asked for top_logprobs
  // This was the request's last token; its result is in the same Step's return value. (A
  // guided request whose grammar allows nothing more ends without a last token event.)
  bool finished = false;
};

struct EngineOptions {
  int64_t max_batch = 32;       // cache slots: requests decoded together
  int64_t max_sequence = 1024;  // prompt + generated tokens per request
  bool share_prefixes = true;   // see "Shared prefixes" above
  // Cache slots (beside max_batch) keeping the prefixes of finished requests, least recently
  // used evicted first; 0: only prefixes of requests in the same step or in flight are
  // shared. -1: max_batch / 4, at least 1.
  int64_t prefix_slots = -1;
  // Chunked prefill: a prompt arriving while others decode (requests admitted in an earlier
  // step; a group arriving together is not chunked), with more than this many tokens
  // left to prefill, is prefilled this many tokens per Step, each chunk before that step's
  // decode, so running requests wait one chunk per token rather than the whole prompt. One
  // such prompt at a time holds the next slot; later arrivals wait behind it. 0: whole.
  int64_t prefill_chunk = 256;
  Status Validate(const model::ModelConfig& config) const;
  int64_t PrefixSlots() const;  // prefix_slots with -1 resolved (0 when not sharing)
};

// Request latencies since the engine started, from Submit (thread-safe; Prometheus
// histograms in a worker's /metrics).
struct LatencyHistograms {
  ops::Histogram queue;        // Submit -> its prefill begins
  ops::Histogram first_token;  // Submit -> its first token
  ops::Histogram inter_token;  // between two tokens of one request
  ops::Histogram end_to_end;   // Submit -> its last token (finished requests only)
};

// What prefix sharing saved, since the engine started (thread-safe reads).
struct PrefixStats {
  uint64_t hits = 0;            // prompts that reused a prefix
  uint64_t tokens_reused = 0;   // prompt tokens whose keys and values were copied
  uint64_t tokens_prefilled = 0;  // prompt tokens computed
  int64_t entries = 0;          // prefix slots holding a usable prefix
  int64_t slots = 0;            // prefix slots
};

class Engine {
 public:
  // `model` is used for inference only (no gradients); `version` is the policy version of
  // its current weights.
  static Result<std::unique_ptr<Engine>> Create(std::shared_ptr<model::TransformerImpl> model,
                                                EngineOptions options, uint64_t version);

  // Validates and queues a request; returns its id. Errors name the bad field
  // (InvalidArgument; NotFound for an unknown adapter).
  Result<uint64_t> Submit(GenerationRequest request);
  // The checks Submit makes, without queueing.
  Status Validate(const GenerationRequest& request);
  // One scheduler iteration (admit + prefill, then one batched decode step); returns the
  // requests that finished in it. With `emitted`, also appends one event per token generated
  // in this iteration (a request just admitted gets two: its prefill token and its first
  // decoded one), ordered by request id and, within a request, by position; the last token
  // of a request that finished here is among them, marked `finished`. Concatenating a
  // request's events gives its result's tokens, logprobs, versions and top_logprobs.
  std::vector<GenerationResult> Step(std::vector<TokenEvent>* emitted = nullptr);
  // Drops waiting or active request `id`: it produces no result and no further events, and
  // its cache slot is free for the next Step (the last active request moves into it, as
  // when one finishes). Returns false when `id` is unknown or already finished (its result
  // was returned). Call it from the thread that drives Submit/Step, between steps.
  bool Cancel(uint64_t id);
  // Submits `requests`, steps until they finish, returns their results in order.
  Result<std::vector<GenerationResult>> Generate(std::vector<GenerationRequest> requests);

  // The weights changed between steps (in-flight swap): tokens sampled from now on carry
  // `version`. Versions only move forward.
  Status SetVersion(uint64_t version);
  // The in-flight swap from another thread: waits for the current step to end, runs
  // `patch` (which updates the model's weights), sets `version`, and lets decoding resume;
  // requests in flight keep going. The time the engine was held is the swap pause.
  Status Swap(uint64_t version, const std::function<Status()>& patch);
  double last_swap_pause_ms() const { return last_swap_pause_ms_.load(); }

  // Multi-LoRA on the frozen base: loads, or replaces between two steps, adapter `name` from
  // an adapters-only snapshot (trainer::TrainingClient::SaveWeightsForSampler in LoRA mode:
  // PEFT-named lora_A / lora_B factors plus the flywheel.adapter_config tensor). Requests
  // choose it by name; a replacement applies to their next token.
  Status LoadAdapter(const std::string& name, const CheckpointView& adapter);
  // Refused while a waiting or active request uses it.
  Status UnloadAdapter(const std::string& name);
  std::vector<std::string> adapters();
  uint64_t swaps() const { return swaps_.load(); }
  uint64_t version() const { return version_; }
  // The version served and the wall-clock time (unix microseconds) it started being
  // served; thread-safe (waits for the current step).
  std::pair<uint64_t, int64_t> serving();

  // Requests holding a cache slot (decoding, or the one being prefilled in chunks).
  size_t active() const { return active_.size() + (prefilling_ ? 1 : 0); }
  size_t waiting() const { return waiting_.size(); }
  // The KV cache: the request slots and the prefix slots.
  int64_t cache_bytes() const { return cache_.bytes() + prefix_cache_.bytes(); }
  PrefixStats prefix_stats() const;
  const LatencyHistograms& latencies() const { return latencies_; }
  int64_t max_batch() const { return options_.max_batch; }
  // Thread-safe counts of requests decoding and queued (for status documents).
  int64_t running() const { return running_.load(); }
  int64_t queued() const { return queued_.load(); }
  int64_t max_sequence() const { return options_.max_sequence; }
  const model::ModelConfig& config() const { return model_->config(); }

 private:
  struct Sequence {
    uint64_t id = 0;
    GenerationRequest request;
    GenerationResult result;
    int64_t length = 0;  // tokens whose keys and values are cached
    std::mt19937_64 rng;
    bool finished_at_prefill = false;
    uint64_t epoch = 0;    // prefix_epoch_ when its prefill began
    torch::Tensor logits;  // [1, V] at the prompt's last token, once prefilled
    std::chrono::steady_clock::time_point submitted, last_token;
    bool queued = true;  // its queue time is not yet observed
    int32_t guide_state = tokenizer::TokenGuide::kStart;  // with request.params.guide
  };

  // A finished request's cached tokens, kept in prefix slot `slot` of prefix_cache_.
  struct KeptPrefix {
    std::vector<int32_t> tokens;
    std::string adapter;
    uint64_t epoch = 0;
    std::vector<uint8_t> routing;  // the tokens' MoE routing, when it was returned
    bool has_routing = false;
    uint64_t last_used = 0;
  };
  // Where a prompt's leading tokens are cached already.
  struct PrefixMatch {
    const model::KvCache* cache = nullptr;
    int64_t slot = 0;
    int64_t tokens = 0;                        // 0: no match
    const std::vector<uint8_t>* routing = nullptr;  // its routing bytes, token-major
    int64_t routing_tokens = 0;                // tokens `routing` covers
    KeptPrefix* kept = nullptr;                // a prefix slot's entry (LRU touch)
  };
  // The whole prompt prefilled last in this step's admissions: a sibling with the same
  // prompt and adapter takes its rows and logits.
  struct LastPrefill {
    std::vector<int32_t> prompt;
    std::string adapter;
    int64_t slot = -1;
    torch::Tensor logits;  // [1, V]
    std::vector<uint8_t> routing;
    bool has_routing = false;
  };

  Engine(std::shared_ptr<model::TransformerImpl> model, EngineOptions options, uint64_t version);
  // REQUIRES: mutex_. Prefills waiting requests into free slots; those that finish at once
  // go to `finished`.
  void Admit(std::vector<GenerationResult>& finished, std::vector<TokenEvent>* events);
  // The prefill of `sequence` into cache slot `slot`, in three parts (REQUIRES: mutex_):
  // BeginPrefill takes what is cached already (a sibling's whole prompt with its logits, or
  // a prefix) and sets sequence.length to the prompt tokens in the cache; PrefillChunk
  // computes the prompt's tokens [length, upto) (and the logits when upto is the end);
  // Place samples the first token and moves the request to active_ or `finished`.
  void BeginPrefill(Sequence& sequence, int64_t slot);
  void PrefillChunk(Sequence& sequence, int64_t slot, int64_t upto);
  void Place(std::unique_ptr<Sequence> sequence, int64_t slot,
             std::vector<GenerationResult>& finished, std::vector<TokenEvent>* events);
  // REQUIRES: mutex_. The next chunk of prefilling_ (all of it when nothing decodes).
  void ContinuePrefill(std::vector<GenerationResult>& finished, std::vector<TokenEvent>* events);
  // REQUIRES: mutex_. After requests left active_: prefilling_'s rows move down to the
  // slot after the last active one.
  void SettlePrefilling();
  // Samples from `logits` [V] for `sequence`; appends token, logprob, version and, when the
  // request asked, the top logprobs of `top_tokens` (the ids from TopTokens, most likely
  // first); returns whether the sequence finished. With `events`, appends the token's event.
  bool Sample(Sequence& sequence, const torch::Tensor& logits,
              const std::vector<int64_t>& top_tokens, std::vector<TokenEvent>* events);
  // The grammar's side of sampling `token`: false when its mask did not allow it (the
  // state is left as it was); else the state moves past it (not for a stop token).
  bool GuidedStep(Sequence& sequence, int64_t token);
  // `logits` / temperature, masked to what the request's grammar allows (-inf elsewhere);
  // false when nothing is allowed.
  bool Scale(const Sequence& sequence, const torch::Tensor& logits, std::vector<double>& scaled) const;
  // REQUIRES: mutex_. Removes active_[slot], moving the last active request (and its cache
  // slot) into its place; returns the removed request.
  std::unique_ptr<Sequence> RemoveActive(int64_t slot);
  Status ValidateLocked(const GenerationRequest& request) const;  // REQUIRES: mutex_
  // REQUIRES: mutex_. The longest usable cached prefix of `sequence`'s prompt, at most
  // `limit` tokens, from the requests in flight and the prefix slots.
  PrefixMatch FindPrefix(const Sequence& sequence, int64_t limit);
  // REQUIRES: mutex_. Copies `match` into cache slot `slot` (and its routing into the
  // result); returns the tokens copied.
  int64_t TakePrefix(Sequence& sequence, int64_t slot, const PrefixMatch& match);
  // REQUIRES: mutex_. Keeps the cached tokens of `sequence` (in cache slot `slot`, finished)
  // in a prefix slot.
  void KeepPrefix(const Sequence& sequence, int64_t slot);
  // REQUIRES: mutex_. The weights or adapters changed: no prefix computed before is reused.
  void InvalidatePrefixes();
  // Whether `sequence`'s result carries MoE routing (return_routing on a MoE model).
  bool NeedsRouting(const Sequence& sequence) const;
  void AppendRouting(Sequence& sequence, const std::vector<torch::Tensor>& routing, int64_t row,
                     int64_t tokens);

  std::shared_ptr<model::TransformerImpl> model_;
  EngineOptions options_;
  std::mutex mutex_;  // Submit, Step, Swap and the adapter calls exclude each other
  std::shared_ptr<model::MultiLora> multi_lora_;
  std::map<std::string, size_t> adapter_slots_;  // name -> index in multi_lora_->adapters
  // REQUIRES: mutex_. Row r of the next forward uses the adapter of `sequences[r]`.
  void AssignAdapters(const std::vector<Sequence*>& sequences);
  std::atomic<double> last_swap_pause_ms_{0};
  std::atomic<uint64_t> swaps_{0};
  uint64_t version_;
  int64_t serving_since_us_ = 0;  // GUARDED_BY(mutex_)
  uint64_t next_id_ = 1;
  model::KvCache cache_;
  model::KvCache prefix_cache_;              // EngineOptions::PrefixSlots() slots
  std::vector<std::optional<KeptPrefix>> kept_;  // one per prefix slot
  uint64_t prefix_epoch_ = 0;
  uint64_t prefix_clock_ = 0;
  LastPrefill last_prefill_;  // reset at every Step's admissions
  // The request being prefilled in chunks, in cache slot prefilling_slot_ (== the number
  // of active requests once settled).
  std::unique_ptr<Sequence> prefilling_;
  int64_t prefilling_slot_ = 0;
  std::atomic<uint64_t> prefix_hits_{0}, prefix_tokens_reused_{0}, prefill_tokens_{0};
  std::atomic<int64_t> prefix_entries_{0}, running_{0}, queued_{0};
  LatencyHistograms latencies_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> active_;  // active_[i] lives in cache slot i
};

}  // namespace flywheel::rollout
