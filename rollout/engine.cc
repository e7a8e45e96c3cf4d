#include "rollout/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>

#include "base/env.h"
#include "model/weights.h"

namespace flywheel::rollout {
namespace {

// For every row of `logits` [R, V]: the min(want[r], V) token ids with the highest logits,
// highest first, equal logits by lower id. One topk over all rows, one more entry than the
// most any row wants: a row whose cut falls inside a run of equal logits (its k-th and
// (k+1)-th entries are equal, where topk may have picked any of them) is completed by one
// scan of that row for the lowest ids at the cut.
std::vector<std::vector<int64_t>> TopTokens(const torch::Tensor& logits,
                                            const std::vector<int64_t>& want) {
  const torch::Tensor scores = logits.to(torch::kFloat).contiguous();
  const int64_t rows = scores.size(0), vocab = scores.size(1);
  int64_t most = 0;
  for (int64_t k : want) most = std::max(most, std::min(k, vocab));
  const int64_t fetched = std::min(most + 1, vocab);
  auto [values, indices] = scores.topk(fetched, /*dim=*/-1, /*largest=*/true, /*sorted=*/true);
  values = values.contiguous();
  indices = indices.contiguous();
  std::vector<std::vector<int64_t>> out(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t k = std::min(want[r], vocab);
    const float* value = values.data_ptr<float>() + r * fetched;
    const int64_t* index = indices.data_ptr<int64_t>() + r * fetched;
    std::vector<std::pair<float, int64_t>> entries;
    const float cut = value[k - 1];
    if (k < fetched && value[k] == cut) {
      // Everything above the cut is in the topk; the rest are the lowest ids at the cut.
      for (int64_t i = 0; i < k && value[i] > cut; ++i) entries.emplace_back(value[i], index[i]);
      const float* row = scores.data_ptr<float>() + r * vocab;
      for (int64_t t = 0; t < vocab && static_cast<int64_t>(entries.size()) < k; ++t) {
        if (row[t] == cut) entries.emplace_back(cut, t);
      }
    } else {
      for (int64_t i = 0; i < k; ++i) entries.emplace_back(value[i], index[i]);
    }
    // topk orders by value only: order each run of equal values by id.
    for (size_t i = 0; i < entries.size();) {
      size_t end = i + 1;
      while (end < entries.size() && entries[end].first == entries[i].first) ++end;
      std::sort(entries.begin() + i, entries.begin() + end,
                [](const auto& a, const auto& b) { return a.second < b.second; });
      i = end;
    }
    out[r].reserve(k);
    for (const auto& entry : entries) out[r].push_back(entry.second);
  }
  return out;
}

// Draws the next token from `scaled` (logits / temperature; log_normaliser: their
// log-sum-exp): the most likely at temperature 0, else from the top_k, top_p nucleus.
int64_t DrawToken(const SamplingParams& p, const std::vector<double>& scaled,
                  double log_normaliser, std::mt19937_64& rng) {
  const int64_t vocab = static_cast<int64_t>(scaled.size());
  if (p.temperature == 0) return std::max_element(scaled.begin(), scaled.end()) - scaled.begin();
  std::vector<int64_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  // Highest probability first; ties by token id, so the order never depends on the sort.
  auto by_prob = [&](int64_t a, int64_t b) {
    return scaled[a] > scaled[b] || (scaled[a] == scaled[b] && a < b);
  };
  int64_t keep = vocab;
  if (p.top_k > 0 && p.top_k < vocab) {
    keep = p.top_k;
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), by_prob);
  } else if (p.top_p < 1) {
    std::sort(order.begin(), order.end(), by_prob);
  }
  std::vector<double> probs(keep);
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += probs[i] = std::exp(scaled[order[i]] - log_normaliser);
  if (p.top_p < 1) {
    if (p.top_k == 0 || p.top_k >= vocab) std::sort(order.begin(), order.begin() + keep, by_prob);
    double cumulative = 0;
    int64_t nucleus = 0;
    while (nucleus < keep && cumulative < p.top_p * kept) cumulative += probs[nucleus++];
    keep = std::max<int64_t>(nucleus, 1);
    kept = cumulative > 0 ? cumulative : probs[0];
  }
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng) * kept;
  double cumulative = 0;
  for (int64_t i = 0; i < keep; ++i) {
    cumulative += probs[i];
    if (u < cumulative) return order[i];
  }
  return order[keep - 1];
}

// The `k` most likely tokens of a masked distribution (finite entries only), most likely
// first, equal values by lower token id (as TopTokens orders them).
std::vector<int64_t> MaskedTop(const std::vector<double>& scaled, int64_t k) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < static_cast<int64_t>(scaled.size()); ++i) {
    if (std::isfinite(scaled[i])) ids.push_back(i);
  }
  k = std::min<int64_t>(k, static_cast<int64_t>(ids.size()));
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int64_t a, int64_t b) {
    return scaled[a] > scaled[b] || (scaled[a] == scaled[b] && a < b);
  });
  ids.resize(k);
  return ids;
}

}  // namespace

Status SamplingParams::Validate(int64_t vocab) const {
  if (!(temperature >= 0 && std::isfinite(temperature))) {
    return Status::InvalidArgument("temperature must be a finite number >= 0, got " +
                                   std::to_string(temperature));
  }
  if (top_k < 0)
    return Status::InvalidArgument("top_k must be >= 0 (0 = off), got " + std::to_string(top_k));
  if (!(top_p > 0 && top_p <= 1))
    return Status::InvalidArgument("top_p must be in (0, 1], got " + std::to_string(top_p));
  if (max_tokens < 1)
    return Status::InvalidArgument("max_tokens must be >= 1, got " + std::to_string(max_tokens));
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs) {
    return Status::InvalidArgument("top_logprobs must be in [0, " +
                                   std::to_string(kMaxTopLogprobs) + "], got " +
                                   std::to_string(top_logprobs));
  }
  for (int32_t t : stop_tokens) {
    if (t < 0 || t >= vocab) {
      return Status::InvalidArgument("stop token " + std::to_string(t) +
                                     " is outside the vocabulary [0, " + std::to_string(vocab) +
                                     ")");
    }
  }
  if (guide && guide->vocab_size() > vocab) {
    return Status::InvalidArgument("the grammar's vocabulary has " + std::to_string(guide->vocab_size()) +
                                   " tokens, the model's " + std::to_string(vocab));
  }
  return Status::Ok();
}

Status EngineOptions::Validate(const model::ModelConfig& config) const {
  if (max_batch < 1)
    return Status::InvalidArgument("max_batch must be >= 1, got " + std::to_string(max_batch));
  if (max_sequence < 2 || max_sequence > config.max_position_embeddings) {
    return Status::InvalidArgument("max_sequence must be in [2, max_position_embeddings = " +
                                   std::to_string(config.max_position_embeddings) + "], got " +
                                   std::to_string(max_sequence));
  }
  if (prefill_chunk < 0) {
    return Status::InvalidArgument("prefill_chunk must be >= 0 (0: whole prompts), got " +
                                   std::to_string(prefill_chunk));
  }
  if (prefix_slots < -1) {
    return Status::InvalidArgument("prefix_slots must be >= 0 (or -1: max_batch / 4), got " +
                                   std::to_string(prefix_slots));
  }
  return Status::Ok();
}

int64_t EngineOptions::PrefixSlots() const {
  if (!share_prefixes) return 0;
  return prefix_slots < 0 ? std::max<int64_t>(1, max_batch / 4) : prefix_slots;
}

Engine::Engine(std::shared_ptr<model::TransformerImpl> model, EngineOptions options,
               uint64_t version)
    : model_(std::move(model)), options_(options), version_(version) {
  cache_ = model_->NewCache(options_.max_batch, options_.max_sequence);
  if (const int64_t slots = options_.PrefixSlots(); slots > 0) {
    prefix_cache_ = model_->NewCache(slots, options_.max_sequence);
    kept_.resize(static_cast<size_t>(slots));
  }
  serving_since_us_ = UnixMicrosNow();
  multi_lora_ = std::make_shared<model::MultiLora>();
  model_->AttachMultiLora(multi_lora_);
}

Result<std::unique_ptr<Engine>> Engine::Create(std::shared_ptr<model::TransformerImpl> model,
                                               EngineOptions options, uint64_t version) {
  if (!model) return Status::InvalidArgument("engine: no model");
  FW_RETURN_IF_ERROR(options.Validate(model->config()));
  return std::unique_ptr<Engine>(new Engine(std::move(model), options, version));
}

Status Engine::Validate(const GenerationRequest& request) {
  std::lock_guard lock(mutex_);
  return ValidateLocked(request);
}

Status Engine::ValidateLocked(const GenerationRequest& request) const {
  const model::ModelConfig& config = model_->config();
  if (request.prompt.empty()) return Status::InvalidArgument("the prompt is empty");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t t = request.prompt[i];
    if (t < 0 || t >= config.vocab_size) {
      return Status::InvalidArgument("prompt token " + std::to_string(t) + " at position " +
                                     std::to_string(i) + " is outside the vocabulary [0, " +
                                     std::to_string(config.vocab_size) + ")");
    }
  }
  FW_RETURN_IF_ERROR(request.params.Validate(config.vocab_size));
  if (!request.adapter.empty() && !adapter_slots_.count(request.adapter)) {
    return Status::NotFound("unknown adapter '" + request.adapter + "'");
  }
  if (request.params.max_tokens > options_.max_sequence - static_cast<int64_t>(request.prompt.size())) {
    return Status::InvalidArgument(
        "prompt of " + std::to_string(request.prompt.size()) + " tokens + max_tokens " +
        std::to_string(request.params.max_tokens) + " exceeds the engine's max_sequence " +
        std::to_string(options_.max_sequence));
  }
  return Status::Ok();
}

Result<uint64_t> Engine::Submit(GenerationRequest request) {
  std::lock_guard lock(mutex_);
  FW_RETURN_IF_ERROR(ValidateLocked(request));
  const model::ModelConfig& config = model_->config();
  auto sequence = std::make_unique<Sequence>();
  sequence->id = next_id_++;
  sequence->result.id = sequence->id;
  sequence->result.prompt = request.prompt;
  sequence->result.routing_bytes_per_index = config.num_experts > 256 ? 2 : 1;
  sequence->rng.seed(request.params.seed ? *request.params.seed : std::random_device{}());
  sequence->request = std::move(request);
  sequence->submitted = std::chrono::steady_clock::now();
  const uint64_t id = sequence->id;
  waiting_.push_back(std::move(sequence));
  queued_.store(static_cast<int64_t>(waiting_.size()));
  return id;
}

void Engine::AppendRouting(Sequence& sequence, const std::vector<torch::Tensor>& routing,
                           int64_t row, int64_t tokens) {
  if (!sequence.request.params.return_routing || routing.empty()) return;
  const int64_t k = routing[0].size(2);
  std::vector<torch::Tensor> rows;
  for (const auto& layer : routing) rows.push_back(layer[row].narrow(0, 0, tokens));  // [tokens, k]
  torch::Tensor packed = torch::stack(rows, 1).contiguous();  // [tokens, L, k]
  const int64_t* data = packed.data_ptr<int64_t>();
  const int width = sequence.result.routing_bytes_per_index;
  for (int64_t i = 0; i < tokens * static_cast<int64_t>(routing.size()) * k; ++i) {
    sequence.result.routing.push_back(static_cast<uint8_t>(data[i] & 0xff));
    if (width == 2) sequence.result.routing.push_back(static_cast<uint8_t>((data[i] >> 8) & 0xff));
  }
}

bool Engine::Scale(const Sequence& sequence, const torch::Tensor& logits_in,
                   std::vector<double>& scaled) const {
  const SamplingParams& p = sequence.request.params;
  torch::Tensor logits = logits_in.to(torch::kDouble).contiguous();
  const double* raw = logits.data_ptr<double>();
  const int64_t vocab = logits.numel();
  const double temperature = p.temperature > 0 ? p.temperature : 1.0;
  scaled.resize(vocab);
  if (!p.guide) {
    for (int64_t i = 0; i < vocab; ++i) scaled[i] = raw[i] / temperature;
    return true;
  }
  const std::shared_ptr<const tokenizer::TokenMask> mask = p.guide->Allowed(sequence.guide_state);
  auto stop = [&](int64_t t) {
    return mask->accepting && std::find(p.stop_tokens.begin(), p.stop_tokens.end(), t) != p.stop_tokens.end();
  };
  bool any = false;
  for (int64_t i = 0; i < vocab; ++i) {
    const bool allowed = mask->Allows(i) || stop(i);
    scaled[i] = allowed ? raw[i] / temperature : -std::numeric_limits<double>::infinity();
    any = any || allowed;
  }
  return any;
}

bool Engine::GuidedStep(Sequence& sequence, int64_t token) {
  const SamplingParams& p = sequence.request.params;
  sequence.result.guided = true;
  const std::shared_ptr<const tokenizer::TokenMask> mask = p.guide->Allowed(sequence.guide_state);
  if (std::find(p.stop_tokens.begin(), p.stop_tokens.end(), token) != p.stop_tokens.end())
    return mask->accepting || mask->Allows(token);
  const int32_t next = p.guide->Advance(sequence.guide_state, static_cast<int32_t>(token));
  if (next < 0) return false;
  sequence.guide_state = next;
  return true;
}

bool Engine::Sample(Sequence& sequence, const torch::Tensor& logits_in,
                    const std::vector<int64_t>& top_tokens_in, std::vector<TokenEvent>* events) {
  const SamplingParams& p = sequence.request.params;
  GenerationResult& r = sequence.result;
  std::vector<double> scaled;
  if (!Scale(sequence, logits_in, scaled)) {  // the grammar allows nothing more
    r.finish_reason = p.guide->Allowed(sequence.guide_state)->accepting ? "stop" : "grammar";
    latencies_.end_to_end.Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - sequence.submitted).count());
    return true;
  }
  const int64_t vocab = static_cast<int64_t>(scaled.size());
  const double top = *std::max_element(scaled.begin(), scaled.end());
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(scaled[i] - top);
  const double log_normaliser = top + std::log(sum);
  // The one expression for every reported logprob, sampled and top alike.
  auto logprob = [&](int64_t t) { return static_cast<float>(scaled[t] - log_normaliser); };
  // Guided: the alternatives of the masked distribution.
  const std::vector<int64_t> top_tokens =
      p.guide && p.top_logprobs > 0 ? MaskedTop(scaled, p.top_logprobs) : top_tokens_in;

  const int64_t token = DrawToken(p, scaled, log_normaliser, sequence.rng);
  if (p.guide && !GuidedStep(sequence, token)) {
    // Only NaN scores (a temperature so small that the logits overflow) draw a token the
    // mask gave probability 0: the request ends before it, as at a dead end.
    r.finish_reason = "grammar";
    latencies_.end_to_end.Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - sequence.submitted).count());
    return true;
  }
  r.tokens.push_back(static_cast<int32_t>(token));
  r.logprobs.push_back(logprob(token));
  r.versions.push_back(version_);
  if (p.top_logprobs > 0) {
    std::vector<TokenLogprob>& alternatives = r.top_logprobs.emplace_back();
    alternatives.reserve(top_tokens.size());
    for (int64_t t : top_tokens) alternatives.push_back({static_cast<int32_t>(t), logprob(t)});
  }
  bool finished = false;
  if (std::find(p.stop_tokens.begin(), p.stop_tokens.end(), token) != p.stop_tokens.end()) {
    r.finish_reason = "stop";
    finished = true;
  } else if (static_cast<int64_t>(r.tokens.size()) >= p.max_tokens) {
    r.finish_reason = "length";
    finished = true;
  }
  const auto now = std::chrono::steady_clock::now();
  auto seconds = [&](auto from) { return std::chrono::duration<double>(now - from).count(); };
  (r.tokens.size() == 1 ? latencies_.first_token : latencies_.inter_token)
      .Observe(seconds(r.tokens.size() == 1 ? sequence.submitted : sequence.last_token));
  sequence.last_token = now;
  if (finished) latencies_.end_to_end.Observe(seconds(sequence.submitted));
  if (events) {
    events->push_back(
        {.id = sequence.id,
         .token = r.tokens.back(),
         .logprob = r.logprobs.back(),
         .version = r.versions.back(),
         .top = p.top_logprobs > 0 ? r.top_logprobs.back() : std::vector<TokenLogprob>{},
         .finished = finished});
  }
  return finished;
}

namespace {

// Prefixes shorter than this are not kept after their request finishes.
constexpr int64_t kMinKeptTokens = 4;

// Token `i` of what `prompt` + `generated` put in the cache.
int32_t CachedToken(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated,
                    int64_t i) {
  const int64_t p = static_cast<int64_t>(prompt.size());
  return i < p ? prompt[i] : generated[i - p];
}

}  // namespace

bool Engine::NeedsRouting(const Sequence& sequence) const {
  return sequence.request.params.return_routing && model_->config().num_experts > 0;
}

Engine::PrefixMatch Engine::FindPrefix(const Sequence& sequence, int64_t limit) {
  const std::vector<int32_t>& prompt = sequence.request.prompt;
  const bool routing = NeedsRouting(sequence);
  PrefixMatch best;
  auto common = [&](auto token_at, int64_t available) {
    const int64_t most = std::min(limit, available);
    int64_t n = 0;
    while (n < most && token_at(n) == prompt[n]) ++n;
    return n;
  };
  for (size_t slot = 0; slot < active_.size(); ++slot) {
    const Sequence& s = *active_[slot];
    if (s.epoch != prefix_epoch_ || s.request.adapter != sequence.request.adapter) continue;
    if (routing && !NeedsRouting(s)) continue;
    const int64_t n = common(
        [&](int64_t i) { return CachedToken(s.request.prompt, s.result.tokens, i); }, s.length);
    if (n > best.tokens) {
      best = {&cache_, static_cast<int64_t>(slot), n, routing ? &s.result.routing : nullptr,
              s.length, nullptr};
    }
  }
  for (size_t slot = 0; slot < kept_.size(); ++slot) {
    if (!kept_[slot]) continue;
    KeptPrefix& k = *kept_[slot];
    if (k.epoch != prefix_epoch_ || k.adapter != sequence.request.adapter) continue;
    if (routing && !k.has_routing) continue;
    const int64_t size = static_cast<int64_t>(k.tokens.size());
    const int64_t n = common([&](int64_t i) { return k.tokens[i]; }, size);
    if (n > best.tokens) {
      best = {&prefix_cache_, static_cast<int64_t>(slot), n, routing ? &k.routing : nullptr, size,
              &k};
    }
  }
  return best;
}

int64_t Engine::TakePrefix(Sequence& sequence, int64_t slot, const PrefixMatch& match) {
  cache_.CopyPrefix(*match.cache, match.slot, slot, match.tokens);
  if (match.routing != nullptr && match.routing_tokens > 0) {
    const size_t per_token = match.routing->size() / static_cast<size_t>(match.routing_tokens);
    std::vector<uint8_t>& routing = sequence.result.routing;
    routing.insert(routing.end(), match.routing->begin(),
                   match.routing->begin() + static_cast<std::ptrdiff_t>(per_token * match.tokens));
  }
  if (match.kept != nullptr) match.kept->last_used = ++prefix_clock_;
  prefix_hits_.fetch_add(1);
  prefix_tokens_reused_.fetch_add(static_cast<uint64_t>(match.tokens));
  return match.tokens;
}

void Engine::KeepPrefix(const Sequence& sequence, int64_t slot) {
  if (kept_.empty() || sequence.epoch != prefix_epoch_ || sequence.length < kMinKeptTokens) return;
  const std::vector<int32_t>& prompt = sequence.request.prompt;
  std::vector<int32_t> tokens(static_cast<size_t>(sequence.length));
  for (int64_t i = 0; i < sequence.length; ++i) {
    tokens[i] = CachedToken(prompt, sequence.result.tokens, i);
  }
  const bool routing = NeedsRouting(sequence);
  auto starts_with = [](const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
    return a.size() >= b.size() && std::equal(b.begin(), b.end(), a.begin());
  };
  // An entry that already covers these tokens is touched; one they extend is replaced;
  // else an empty or stale slot, else the least recently used.
  size_t target = kept_.size();
  for (size_t i = 0; i < kept_.size(); ++i) {
    if (!kept_[i]) continue;
    KeptPrefix& k = *kept_[i];
    if (k.epoch != prefix_epoch_ || k.adapter != sequence.request.adapter) continue;
    if ((k.has_routing || !routing) && starts_with(k.tokens, tokens)) {
      k.last_used = ++prefix_clock_;
      return;
    }
    if (starts_with(tokens, k.tokens)) target = i;
  }
  if (target == kept_.size()) {
    uint64_t oldest = std::numeric_limits<uint64_t>::max();
    for (size_t i = 0; i < kept_.size(); ++i) {
      const uint64_t used = !kept_[i] || kept_[i]->epoch != prefix_epoch_ ? 0 : kept_[i]->last_used;
      if (used < oldest) {
        oldest = used;
        target = i;
      }
    }
  }
  prefix_cache_.CopyPrefix(cache_, slot, static_cast<int64_t>(target), sequence.length);
  KeptPrefix kept{std::move(tokens), sequence.request.adapter, prefix_epoch_, {}, routing,
                  ++prefix_clock_};
  if (routing) kept.routing = sequence.result.routing;  // covers exactly the cached tokens
  kept_[target] = std::move(kept);
  prefix_entries_.store(std::count_if(kept_.begin(), kept_.end(), [&](const auto& k) {
    return k && k->epoch == prefix_epoch_;
  }));
}

void Engine::InvalidatePrefixes() {
  ++prefix_epoch_;
  prefix_entries_.store(0);
}

PrefixStats Engine::prefix_stats() const {
  return {prefix_hits_.load(), prefix_tokens_reused_.load(), prefill_tokens_.load(),
          prefix_entries_.load(), static_cast<int64_t>(kept_.size())};
}

void Engine::BeginPrefill(Sequence& sequence, int64_t slot) {
  const auto& prompt = sequence.request.prompt;
  const int64_t length = static_cast<int64_t>(prompt.size());
  const bool routing = NeedsRouting(sequence);
  if (sequence.queued) {
    sequence.queued = false;
    latencies_.queue.Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - sequence.submitted).count());
  }
  sequence.epoch = prefix_epoch_;
  sequence.length = 0;
  sequence.logits = torch::Tensor();
  sequence.result.routing.clear();
  if (!options_.share_prefixes) return;
  const LastPrefill& sibling = last_prefill_;
  if (sibling.slot >= 0 && sibling.prompt == prompt &&
      sibling.adapter == sequence.request.adapter && (sibling.has_routing || !routing)) {
    // A sample of the same group: its rows and its logits, bit for bit.
    cache_.CopyPrefix(cache_, sibling.slot, slot, length);
    if (routing) sequence.result.routing = sibling.routing;
    sequence.logits = sibling.logits;
    sequence.length = length;
    prefix_hits_.fetch_add(1);
    prefix_tokens_reused_.fetch_add(static_cast<uint64_t>(length));
    return;
  }
  // At most all but the last token: its logits are needed.
  const PrefixMatch match = FindPrefix(sequence, length - 1);
  if (match.tokens > 0) sequence.length = TakePrefix(sequence, slot, match);
}

void Engine::PrefillChunk(Sequence& sequence, int64_t slot, int64_t upto) {
  const auto& prompt = sequence.request.prompt;
  const int64_t length = static_cast<int64_t>(prompt.size());
  const int64_t from = sequence.length, fresh = upto - from;
  torch::Tensor tokens =
      torch::tensor(std::vector<int64_t>(prompt.begin() + from, prompt.begin() + upto), torch::kLong)
          .view({1, fresh});
  torch::Tensor positions = torch::arange(from, upto, torch::kLong).view({1, fresh});
  model::CacheSpan span{&cache_, slot, positions};
  AssignAdapters({&sequence});
  model::ForwardResult out = model_->Hidden(tokens, positions, {}, {}, &span);
  multi_lora_->row_adapter.clear();
  AppendRouting(sequence, out.routing, 0, fresh);
  prefill_tokens_.fetch_add(static_cast<uint64_t>(fresh));
  sequence.length = upto;
  if (upto < length) return;
  sequence.logits = model_->LmHead(out.hidden.select(1, fresh - 1));
  if (options_.share_prefixes) {
    const bool routing = NeedsRouting(sequence);
    last_prefill_ = {prompt, sequence.request.adapter, slot, sequence.logits,
                     routing ? sequence.result.routing : std::vector<uint8_t>{}, routing};
  }
}

void Engine::Place(std::unique_ptr<Sequence> sequence, int64_t slot,
                   std::vector<GenerationResult>& finished, std::vector<TokenEvent>* events) {
  const int64_t top_logprobs = sequence->request.params.top_logprobs;
  const std::vector<int64_t> top = top_logprobs > 0 ? TopTokens(sequence->logits, {top_logprobs})[0]
                                                    : std::vector<int64_t>{};
  sequence->finished_at_prefill = Sample(*sequence, sequence->logits[0], top, events);
  sequence->logits = torch::Tensor();
  if (sequence->finished_at_prefill) {
    KeepPrefix(*sequence, slot);
    finished.push_back(std::move(sequence->result));
  } else {
    active_.push_back(std::move(sequence));
  }
}

void Engine::ContinuePrefill(std::vector<GenerationResult>& finished,
                             std::vector<TokenEvent>* events) {
  Sequence& sequence = *prefilling_;
  const int64_t slot = prefilling_slot_;
  // Weights or adapters changed since the last chunk: start again on the new ones.
  if (sequence.epoch != prefix_epoch_) BeginPrefill(sequence, slot);
  const int64_t length = static_cast<int64_t>(sequence.request.prompt.size());
  const int64_t upto =
      active_.empty() ? length : std::min(length, sequence.length + options_.prefill_chunk);
  if (sequence.length < upto) PrefillChunk(sequence, slot, upto);
  if (sequence.length == length) Place(std::move(prefilling_), slot, finished, events);
}

void Engine::SettlePrefilling() {
  const int64_t slot = static_cast<int64_t>(active_.size());
  if (!prefilling_ || prefilling_slot_ == slot) return;
  cache_.CopyPrefix(cache_, prefilling_slot_, slot, prefilling_->length);
  prefilling_slot_ = slot;
}

std::unique_ptr<Engine::Sequence> Engine::RemoveActive(int64_t slot) {
  std::unique_ptr<Sequence> removed = std::move(active_[slot]);
  const int64_t last = static_cast<int64_t>(active_.size()) - 1;
  if (slot != last) {
    cache_.MoveSlot(last, slot);
    active_[slot] = std::move(active_[last]);
  }
  active_.pop_back();
  return removed;
}

bool Engine::Cancel(uint64_t id) {
  std::lock_guard lock(mutex_);
  auto has_id = [id](const std::unique_ptr<Sequence>& s) { return s->id == id; };
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), has_id); it != waiting_.end()) {
    waiting_.erase(it);
    queued_.store(static_cast<int64_t>(waiting_.size()));
    return true;
  }
  if (auto it = std::find_if(active_.begin(), active_.end(), has_id); it != active_.end()) {
    RemoveActive(it - active_.begin());
    SettlePrefilling();
    running_.store(static_cast<int64_t>(active()));
    return true;
  }
  if (prefilling_ && prefilling_->id == id) {
    prefilling_.reset();
    running_.store(static_cast<int64_t>(active()));
    return true;
  }
  return false;
}

void Engine::Admit(std::vector<GenerationResult>& finished, std::vector<TokenEvent>* events) {
  last_prefill_ = LastPrefill{};
  if (prefilling_) ContinuePrefill(finished, events);
  const int64_t chunk = options_.prefill_chunk;
  // Requests admitted together (a group) are not chunked for each other: only requests
  // decoding since an earlier step would be stalled.
  const bool others_decoding = !active_.empty();
  while (!prefilling_ && !waiting_.empty() &&
         static_cast<int64_t>(active_.size()) < options_.max_batch) {
    std::unique_ptr<Sequence> sequence = std::move(waiting_.front());
    waiting_.pop_front();
    const int64_t slot = static_cast<int64_t>(active_.size());
    const int64_t length = static_cast<int64_t>(sequence->request.prompt.size());
    BeginPrefill(*sequence, slot);
    if (chunk > 0 && others_decoding && length - sequence->length > chunk) {
      // Others are decoding: one chunk now, the rest in the next steps.
      PrefillChunk(*sequence, slot, sequence->length + chunk);
      prefilling_ = std::move(sequence);
      prefilling_slot_ = slot;
      break;
    }
    if (sequence->length < length) PrefillChunk(*sequence, slot, length);
    Place(std::move(sequence), slot, finished, events);
  }
  last_prefill_ = LastPrefill{};  // the rows it names move when requests finish
}

std::vector<GenerationResult> Engine::Step(std::vector<TokenEvent>* emitted) {
  std::lock_guard lock(mutex_);
  torch::NoGradGuard no_grad;
  std::vector<GenerationResult> finished;
  std::vector<TokenEvent> events;
  std::vector<TokenEvent>* record = emitted ? &events : nullptr;
  // Sampling order is admission then slot order; consumers get request order.
  auto emit = [&] {
    if (!emitted) return;
    std::stable_sort(events.begin(), events.end(),
                     [](const TokenEvent& a, const TokenEvent& b) { return a.id < b.id; });
    emitted->insert(emitted->end(), std::make_move_iterator(events.begin()),
                    std::make_move_iterator(events.end()));
  };
  auto counts = [&] {
    running_.store(static_cast<int64_t>(active()));
    queued_.store(static_cast<int64_t>(waiting_.size()));
  };
  Admit(finished, record);
  if (active_.empty()) {
    counts();
    emit();
    return finished;
  }

  const int64_t batch = static_cast<int64_t>(active_.size());
  torch::Tensor tokens = torch::empty({batch, 1}, torch::kLong);
  torch::Tensor positions = torch::empty({batch, 1}, torch::kLong);
  for (int64_t i = 0; i < batch; ++i) {
    tokens[i][0] = active_[i]->result.tokens.back();
    positions[i][0] = active_[i]->length;
  }
  model::CacheSpan span{&cache_, 0, positions};
  std::vector<Sequence*> rows;
  for (auto& a : active_) rows.push_back(a.get());
  AssignAdapters(rows);
  model::ForwardResult out = model_->Hidden(tokens, positions, {}, {}, &span);
  multi_lora_->row_adapter.clear();
  torch::Tensor logits = model_->LmHead(out.hidden.squeeze(1));  // [B, V]
  // Top logprobs: one topk over just the rows whose requests asked.
  std::vector<std::vector<int64_t>> top(batch);
  std::vector<int64_t> asking, want;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t k = active_[i]->request.params.top_logprobs;
    if (k > 0) {
      asking.push_back(i);
      want.push_back(k);
    }
  }
  if (!asking.empty()) {
    const torch::Tensor rows_asking =
        static_cast<int64_t>(asking.size()) == batch
            ? logits
            : logits.index_select(0, torch::tensor(asking, torch::kLong));
    std::vector<std::vector<int64_t>> ids = TopTokens(rows_asking, want);
    for (size_t j = 0; j < asking.size(); ++j) top[asking[j]] = std::move(ids[j]);
  }
  std::vector<bool> done(batch);
  for (int64_t i = 0; i < batch; ++i) {
    Sequence& sequence = *active_[i];
    sequence.length += 1;
    AppendRouting(sequence, out.routing, i, 1);
    done[i] = Sample(sequence, logits[i], top[i], record);
  }
  // Compact from the back: the last active request moves into a finished one's slot.
  for (int64_t i = batch - 1; i >= 0; --i) {
    if (!done[i]) continue;
    KeepPrefix(*active_[i], i);
    finished.push_back(std::move(RemoveActive(i)->result));
  }
  SettlePrefilling();
  counts();
  emit();
  return finished;
}

Result<std::vector<GenerationResult>> Engine::Generate(std::vector<GenerationRequest> requests) {
  std::vector<uint64_t> ids;
  for (auto& request : requests) {
    FW_ASSIGN_OR_RETURN(uint64_t id, Submit(std::move(request)));
    ids.push_back(id);
  }
  std::map<uint64_t, GenerationResult> done;
  while (done.size() < ids.size()) {
    for (auto& r : Step()) done.emplace(r.id, std::move(r));
  }
  std::vector<GenerationResult> out;
  for (uint64_t id : ids) out.push_back(std::move(done.at(id)));
  return out;
}

Status Engine::Swap(uint64_t version, const std::function<Status()>& patch) {
  std::lock_guard lock(mutex_);
  const auto start = std::chrono::steady_clock::now();  // decoding is held from here
  if (version < version_) {
    return Status::InvalidArgument("engine: version " + std::to_string(version) +
                                   " is older than the current " + std::to_string(version_));
  }
  Status patched = patch();
  InvalidatePrefixes();  // whatever the patch wrote
  if (patched.ok()) {
    version_ = version;
    serving_since_us_ = UnixMicrosNow();
    swaps_.fetch_add(1);
  }
  last_swap_pause_ms_.store(
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  return patched;
}

std::pair<uint64_t, int64_t> Engine::serving() {
  std::lock_guard lock(mutex_);
  return {version_, serving_since_us_};
}

void Engine::AssignAdapters(const std::vector<Sequence*>& sequences) {
  multi_lora_->row_adapter.clear();
  bool any = false;
  for (Sequence* s : sequences) {
    auto it =
        s->request.adapter.empty() ? adapter_slots_.end() : adapter_slots_.find(s->request.adapter);
    multi_lora_->row_adapter.push_back(
        it == adapter_slots_.end() ? -1 : static_cast<int64_t>(it->second));
    any |= it != adapter_slots_.end();
  }
  if (!any) multi_lora_->row_adapter.clear();
}

Status Engine::LoadAdapter(const std::string& name, const CheckpointView& adapter) {
  if (name.empty()) return Status::InvalidArgument("adapter name is empty");
  const auto shapes = model_->ProjectionShapes();
  const TensorView* config_tensor = nullptr;
  std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> factors;
  const std::string prefix = "base_model.model.";
  for (const TensorView& t : adapter) {
    if (t.name == model::kAdapterConfigTensor) {
      config_tensor = &t;
      continue;
    }
    std::string tname = t.name.rfind(prefix, 0) == 0 ? t.name.substr(prefix.size()) : t.name;
    const bool is_a =
        tname.size() > 14 && tname.compare(tname.size() - 14, 14, ".lora_A.weight") == 0;
    const bool is_b =
        tname.size() > 14 && tname.compare(tname.size() - 14, 14, ".lora_B.weight") == 0;
    if (!is_a && !is_b)
      return Status::InvalidArgument("adapter '" + name + "': tensor " + t.name +
                                     " is not a LoRA factor");
    const std::string module = tname.substr(0, tname.size() - 14);
    if (!shapes.count(module)) {
      return Status::InvalidArgument("adapter '" + name + "': " + module +
                                     " is not a projection of this model");
    }
    FW_ASSIGN_OR_RETURN(torch::Tensor value, model::ToTorch(t));
    (is_a ? factors[module].first : factors[module].second) = value.to(torch::kFloat);
  }
  if (!config_tensor)
    return Status::InvalidArgument("adapter '" + name + "' lacks its config tensor " +
                                   model::kAdapterConfigTensor);
  const std::string text(reinterpret_cast<const char*>(config_tensor->data.data()),
                         config_tensor->data.size());
  nlohmann::json config = nlohmann::json::parse(text, nullptr, false);
  if (config.is_discarded() || !config.contains("r") || !config.contains("lora_alpha")) {
    return Status::InvalidArgument("adapter '" + name + "': malformed adapter config");
  }
  if (!config["r"].is_number() || !config["lora_alpha"].is_number()) {
    return Status::InvalidArgument("adapter '" + name + "': r and lora_alpha must be numbers");
  }
  const double rank = config["r"].get<double>(), alpha = config["lora_alpha"].get<double>();
  if (!(rank > 0) || !(alpha > 0))
    return Status::InvalidArgument("adapter '" + name + "': r and lora_alpha must be > 0");
  std::map<std::string, model::LoraFactors> loaded;
  for (auto& [module, ab] : factors) {
    const auto [out, in] = shapes.at(module);
    if (!ab.first.defined() || !ab.second.defined()) {
      return Status::InvalidArgument("adapter '" + name + "': " + module +
                                     " lacks lora_A or lora_B");
    }
    if (ab.first.dim() != 2 || ab.second.dim() != 2 || ab.first.size(0) != rank ||
        ab.first.size(1) != in || ab.second.size(0) != out || ab.second.size(1) != rank) {
      return Status::Mismatch("adapter '" + name + "': factors of " + module + " have shapes " +
                              c10::str(ab.first.sizes()) + " and " + c10::str(ab.second.sizes()) +
                              ", expected [" + std::to_string(static_cast<int64_t>(rank)) + ", " +
                              std::to_string(in) + "] and [" + std::to_string(out) + ", " +
                              std::to_string(static_cast<int64_t>(rank)) + "]");
    }
    loaded[module] = {ab.first, ab.second, alpha / rank};
  }
  if (loaded.empty()) return Status::InvalidArgument("adapter '" + name + "' has no factors");
  std::lock_guard lock(mutex_);
  auto it = adapter_slots_.find(name);
  if (it != adapter_slots_.end()) {
    multi_lora_->adapters[it->second] = std::move(loaded);
    InvalidatePrefixes();
    return Status::Ok();
  }
  size_t slot = multi_lora_->adapters.size();
  for (size_t i = 0; i < multi_lora_->adapters.size(); ++i) {
    if (multi_lora_->adapters[i].empty()) {
      slot = i;
      break;
    }
  }
  if (slot == multi_lora_->adapters.size()) multi_lora_->adapters.emplace_back();
  multi_lora_->adapters[slot] = std::move(loaded);
  adapter_slots_[name] = slot;
  return Status::Ok();
}

Status Engine::UnloadAdapter(const std::string& name) {
  std::lock_guard lock(mutex_);
  auto it = adapter_slots_.find(name);
  if (it == adapter_slots_.end()) return Status::NotFound("unknown adapter '" + name + "'");
  auto uses = [&](const std::unique_ptr<Sequence>& s) { return s->request.adapter == name; };
  if (std::any_of(active_.begin(), active_.end(), uses) ||
      std::any_of(waiting_.begin(), waiting_.end(), uses) || (prefilling_ && uses(prefilling_))) {
    return Status::InvalidArgument("adapter '" + name + "' is in use by a request in flight");
  }
  multi_lora_->adapters[it->second].clear();
  adapter_slots_.erase(it);
  InvalidatePrefixes();  // a later adapter of the same name is another
  return Status::Ok();
}

std::vector<std::string> Engine::adapters() {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (const auto& [name, slot] : adapter_slots_) names.push_back(name);
  return names;
}

Status Engine::SetVersion(uint64_t version) {
  std::lock_guard lock(mutex_);
  if (version < version_) {
    return Status::InvalidArgument("engine: version " + std::to_string(version) +
                                   " is older than the current " + std::to_string(version_));
  }
  version_ = version;
  InvalidatePrefixes();
  return Status::Ok();
}

}  // namespace flywheel::rollout
