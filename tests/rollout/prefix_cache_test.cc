// Shared prefixes and chunked prefill in the rollout engine. Shared prefixes
// (EngineOptions::share_prefixes): the samples of a
// group prefill their prompt once and equal the unshared samples bit for bit (dense and MoE
// with routing); an episode's next turn prefills only its new tokens; a swap or a new
// adapter version is never served from a prefix computed before it; the prefix slots evict
// by LRU and never serve a wrong prefix under pressure. Chunked prefill
// (EngineOptions::prefill_chunk): running requests get a token every step while a long
// prompt is prefilled, the answers equal one-shot prefill's, and a swap between chunks
// starts the prefill again on the new weights.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "rollout/engine.h"
#include "tests/model/tiny_models.h"

namespace flywheel::rollout {
namespace {

std::shared_ptr<model::TransformerImpl> MakeModel(bool moe, uint64_t seed) {
  torch::manual_seed(seed);
  auto m = std::make_shared<model::TransformerImpl>(
      testing::TinyConfig({.vocab = 50, .experts = moe ? 6 : 0}));
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) {
    if (p.dim() == 2) p.mul_(8);  // sharp distributions: greedy and sampled paths differ
  }
  return m;
}

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<model::TransformerImpl> m, bool share,
                                   int64_t prefix_slots = -1, int64_t max_batch = 16) {
  auto engine = Engine::Create(std::move(m),
                               {.max_batch = max_batch,
                                .max_sequence = 128,
                                .share_prefixes = share,
                                .prefix_slots = prefix_slots},
                               1);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(*engine) : nullptr;
}

GenerationRequest Request(std::vector<int32_t> prompt, int64_t max_tokens, double temperature,
                          std::optional<uint64_t> seed, bool routing = false) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.params.max_tokens = max_tokens;
  r.params.temperature = temperature;
  r.params.seed = seed;
  r.params.return_routing = routing;
  return r;
}

std::vector<int32_t> Prompt(int32_t first, size_t length) {
  std::vector<int32_t> p(length);
  for (size_t i = 0; i < length; ++i) p[i] = (first + static_cast<int32_t>(i * 7)) % 50;
  return p;
}

// Floats compared as bits: "equal" here means the same float, not a close one.
bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A group of 8 seeded samples of one 40-token prompt, with another request beside them.
std::vector<GenerationRequest> Group(bool routing) {
  std::vector<GenerationRequest> requests;
  for (uint64_t s = 0; s < 8; ++s) requests.push_back(Request(Prompt(3, 40), 12, 1.0, s, routing));
  requests.push_back(Request(Prompt(11, 9), 12, 1.0, 99, routing));
  return requests;
}

TEST(PrefixCacheTest, AGroupPrefillsItsPromptOnceAndEqualsTheUnsharedSamplesBitForBit) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    auto m = MakeModel(moe, 21);
    auto shared = MakeEngine(m, true);
    auto unshared = MakeEngine(m, false);
    auto a = shared->Generate(Group(moe));
    auto b = unshared->Generate(Group(moe));
    ASSERT_TRUE(a.ok() && b.ok());
    std::set<std::vector<int32_t>> distinct;
    for (size_t i = 0; i < a->size(); ++i) {
      EXPECT_EQ((*a)[i].tokens, (*b)[i].tokens) << "request " << i;
      EXPECT_TRUE(SameBits((*a)[i].logprobs, (*b)[i].logprobs)) << "request " << i;
      EXPECT_EQ((*a)[i].routing, (*b)[i].routing) << "request " << i;
      if (moe) EXPECT_FALSE((*a)[i].routing.empty());
      distinct.insert((*a)[i].tokens);
    }
    EXPECT_GE(distinct.size(), 6u);  // the seeds sampled different answers
    const PrefixStats s = shared->prefix_stats();
    EXPECT_EQ(s.hits, 7u);
    EXPECT_EQ(s.tokens_reused, 7u * 40);
    EXPECT_EQ(s.tokens_prefilled, 40u + 9);
    EXPECT_EQ(unshared->prefix_stats().hits, 0u);
    EXPECT_EQ(unshared->prefix_stats().tokens_prefilled, 8u * 40 + 9);
  }
}

// A group whose samples arrive in different steps (the first is already decoding): they
// take the prefix from the request in flight, all but the last prompt token.
TEST(PrefixCacheTest, ALateSampleTakesThePrefixOfARequestInFlight) {
  auto m = MakeModel(false, 22);
  auto engine = MakeEngine(m, true, /*prefix_slots=*/0);
  ASSERT_TRUE(engine->Submit(Request(Prompt(5, 30), 20, 0, std::nullopt)).ok());
  engine->Step();
  engine->Step();
  ASSERT_TRUE(engine->Submit(Request(Prompt(5, 30), 20, 0, std::nullopt)).ok());
  std::vector<GenerationResult> done;
  while (done.size() < 2) {
    for (auto& r : engine->Step()) done.push_back(std::move(r));
  }
  EXPECT_EQ(done[0].tokens, done[1].tokens);  // greedy: the same answer
  const PrefixStats s = engine->prefix_stats();
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.tokens_reused, 29u);
  EXPECT_EQ(s.tokens_prefilled, 31u);
}

// The turns of an episode: each turn's prompt is the last turn's prompt, its answer and a
// tool's reply. With prefix slots only the new tokens are prefilled; the answers equal
// the unshared engine's (greedy tokens exactly, logprobs to float rounding: the new
// tokens are a second chunk of the prefill).
TEST(PrefixCacheTest, AnEpisodesTurnsPrefillOnlyTheirNewTokens) {
  auto m = MakeModel(false, 23);
  auto shared = MakeEngine(m, true);
  auto unshared = MakeEngine(m, false);
  std::vector<int32_t> history = Prompt(1, 24);
  uint64_t expected_prefilled = 0, cached = 0;
  for (int turn = 0; turn < 6; ++turn) {
    SCOPED_TRACE("turn " + std::to_string(turn));
    auto a = shared->Generate({Request(history, 8, 0, std::nullopt)});
    auto b = unshared->Generate({Request(history, 8, 0, std::nullopt)});
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ((*a)[0].tokens, (*b)[0].tokens);
    for (size_t t = 0; t < (*a)[0].logprobs.size(); ++t) {
      EXPECT_NEAR((*a)[0].logprobs[t], (*b)[0].logprobs[t], 1e-5);
    }
    expected_prefilled += history.size() - cached;
    EXPECT_EQ(shared->prefix_stats().tokens_prefilled, expected_prefilled);
    // The answer's last token was sampled, never fed: it is not cached.
    history.insert(history.end(), (*a)[0].tokens.begin(), (*a)[0].tokens.end());
    cached = history.size() - 1;
    const std::vector<int32_t> tool = Prompt(turn + 30, 5);
    history.insert(history.end(), tool.begin(), tool.end());
  }
  // Turns 2..6 each prefilled the previous answer's last token and the tool's 5.
  EXPECT_EQ(expected_prefilled, 24u + 5 * 6);
  EXPECT_EQ(shared->prefix_stats().hits, 5u);
  EXPECT_GE(shared->prefix_stats().entries, 1);
}

// After a swap the weights differ: a prefix computed by the old ones is not reused, and
// the answer equals a fresh engine's on the new weights.
TEST(PrefixCacheTest, ASwapNeverServesAPrefixComputedBeforeIt) {
  auto m = MakeModel(false, 24);
  auto engine = MakeEngine(m, true);
  const std::vector<int32_t> prompt = Prompt(2, 32);
  ASSERT_TRUE(engine->Generate({Request(prompt, 6, 0, std::nullopt)}).ok());
  ASSERT_TRUE(engine
                  ->Swap(2,
                         [&] {
                           torch::NoGradGuard no_grad;
                           for (auto& p : m->parameters()) p.mul_(1.25);
                           return Status::Ok();
                         })
                  .ok());
  EXPECT_EQ(engine->prefix_stats().entries, 0);
  const uint64_t before = engine->prefix_stats().tokens_prefilled;
  auto after = engine->Generate({Request(prompt, 6, 0, std::nullopt)});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(engine->prefix_stats().tokens_prefilled - before, prompt.size());
  auto fresh = MakeEngine(m, false)->Generate({Request(prompt, 6, 0, std::nullopt)});
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ((*after)[0].tokens, (*fresh)[0].tokens);
  EXPECT_TRUE(SameBits((*after)[0].logprobs, (*fresh)[0].logprobs));
  EXPECT_EQ((*after)[0].versions, std::vector<uint64_t>(6, 2));
}

// Two prefix slots, five episodes: the least recently used prefixes go, the newest stay,
// and every answer (reused or recomputed) is the unshared engine's.
TEST(PrefixCacheTest, ThePrefixSlotsEvictTheLeastRecentlyUsedAndStayCorrect) {
  auto m = MakeModel(false, 25);
  auto shared = MakeEngine(m, true, /*prefix_slots=*/2, /*max_batch=*/3);
  auto unshared = MakeEngine(m, false, 0, 3);
  std::vector<std::vector<int32_t>> histories;
  for (int e = 0; e < 5; ++e) {
    histories.push_back(Prompt(e * 9 + 1, 20));
    auto a = shared->Generate({Request(histories.back(), 4, 0, std::nullopt)});
    ASSERT_TRUE(a.ok());
    histories.back().insert(histories.back().end(), (*a)[0].tokens.begin(), (*a)[0].tokens.end());
  }
  EXPECT_EQ(shared->prefix_stats().entries, 2);
  EXPECT_EQ(shared->prefix_stats().slots, 2);
  // Episode 0's prefix was evicted: its next turn prefills all of it. Episode 4's is kept.
  for (int e : {0, 4}) {
    SCOPED_TRACE("episode " + std::to_string(e));
    const uint64_t before = shared->prefix_stats().tokens_prefilled;
    auto a = shared->Generate({Request(histories[e], 6, 0, std::nullopt)});
    auto b = unshared->Generate({Request(histories[e], 6, 0, std::nullopt)});
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ((*a)[0].tokens, (*b)[0].tokens);
    const uint64_t prefilled = shared->prefix_stats().tokens_prefilled - before;
    EXPECT_EQ(prefilled, e == 0 ? histories[e].size() : 1u);
  }
  // Under pressure: many requests with overlapping prompts through 3 slots; each answer is
  // the unshared one.
  std::vector<GenerationRequest> crowd;
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> p = histories[i % 5];
    p.resize(p.size() - (i % 3));
    crowd.push_back(Request(p, 5 + i % 4, 0, std::nullopt));
  }
  auto a = shared->Generate(crowd);
  auto b = unshared->Generate(crowd);
  ASSERT_TRUE(a.ok() && b.ok());
  for (size_t i = 0; i < crowd.size(); ++i) EXPECT_EQ((*a)[i].tokens, (*b)[i].tokens) << i;
}

std::unique_ptr<Engine> ChunkedEngine(std::shared_ptr<model::TransformerImpl> m, int64_t chunk) {
  auto engine = Engine::Create(std::move(m),
                               {.max_batch = 4, .max_sequence = 128, .share_prefixes = false,
                                .prefill_chunk = chunk},
                               1);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(*engine) : nullptr;
}

// Two requests decode (one ends mid-way, moving the prefilling rows down a slot); a
// 70-token prompt arrives and is prefilled 8 tokens a step. Per step: one token for each
// running request, none for the new one until its 9th step.
struct ChunkedRun {
  std::map<uint64_t, GenerationResult> done;
  std::vector<std::map<uint64_t, int>> tokens_per_step;  // after the long prompt arrived
};

ChunkedRun RunWithALongArrival(Engine& engine) {
  ChunkedRun run;
  auto collect = [&](std::vector<TokenEvent>* events) {
    for (auto& r : engine.Step(events)) run.done.emplace(r.id, std::move(r));
  };
  EXPECT_TRUE(engine.Submit(Request(Prompt(4, 5), 6, 0, std::nullopt)).ok());   // id 1
  EXPECT_TRUE(engine.Submit(Request(Prompt(9, 7), 30, 0, std::nullopt)).ok());  // id 2
  collect(nullptr);
  collect(nullptr);
  EXPECT_TRUE(engine.Submit(Request(Prompt(17, 70), 10, 0, std::nullopt)).ok());  // id 3
  while (run.done.size() < 3) {
    std::vector<TokenEvent> events;
    collect(&events);
    std::map<uint64_t, int> counts;
    for (const TokenEvent& e : events) counts[e.id] += 1;
    run.tokens_per_step.push_back(counts);
  }
  return run;
}

TEST(ChunkedPrefillTest, RunningRequestsKeepDecodingAndTheAnswersEqualOneShotPrefill) {
  auto m = MakeModel(false, 27);
  auto chunked = ChunkedEngine(m, 8);
  auto whole = ChunkedEngine(m, 0);
  const ChunkedRun a = RunWithALongArrival(*chunked);
  const ChunkedRun b = RunWithALongArrival(*whole);
  for (uint64_t id : {1, 2, 3}) {
    SCOPED_TRACE("request " + std::to_string(id));
    EXPECT_EQ(a.done.at(id).tokens, b.done.at(id).tokens);
    for (size_t t = 0; t < a.done.at(id).logprobs.size(); ++t) {
      EXPECT_NEAR(a.done.at(id).logprobs[t], b.done.at(id).logprobs[t], 1e-5);
    }
  }
  // 70 tokens in chunks of 8: the first token of request 3 comes in the 9th step, and
  // every step before it gave request 2 one token (request 1 ended in the 4th).
  ASSERT_GE(a.tokens_per_step.size(), 9u);
  for (size_t step = 0; step < 8; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    EXPECT_EQ(a.tokens_per_step[step].count(3), 0u);
    EXPECT_EQ(a.tokens_per_step[step].at(2), 1);
  }
  EXPECT_EQ(a.tokens_per_step[8].at(3), 2);  // its prefill token and its first decoded one
  // One-shot: request 3 starts at once.
  EXPECT_EQ(b.tokens_per_step[0].at(3), 2);
  EXPECT_EQ(chunked->prefix_stats().tokens_prefilled, whole->prefix_stats().tokens_prefilled);
}

TEST(ChunkedPrefillTest, ASwapBetweenChunksStartsThePrefillAgainOnTheNewWeights) {
  auto m = MakeModel(false, 28);
  auto engine = ChunkedEngine(m, 8);
  ASSERT_TRUE(engine->Submit(Request(Prompt(9, 7), 40, 0, std::nullopt)).ok());
  engine->Step();
  const std::vector<int32_t> prompt = Prompt(5, 60);
  ASSERT_TRUE(engine->Submit(Request(prompt, 6, 0, std::nullopt)).ok());
  for (int i = 0; i < 3; ++i) engine->Step();  // 24 of its 60 tokens prefilled
  EXPECT_EQ(engine->active(), 2u);
  ASSERT_TRUE(engine
                  ->Swap(2,
                         [&] {
                           torch::NoGradGuard no_grad;
                           for (auto& p : m->parameters()) p.mul_(1.25);
                           return Status::Ok();
                         })
                  .ok());
  std::map<uint64_t, GenerationResult> done;
  while (done.size() < 2) {
    for (auto& r : engine->Step()) done.emplace(r.id, std::move(r));
  }
  EXPECT_EQ(done.at(2).versions, std::vector<uint64_t>(6, 2));
  auto fresh = ChunkedEngine(m, 0)->Generate({Request(prompt, 6, 0, std::nullopt)});
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(done.at(2).tokens, (*fresh)[0].tokens);
  for (size_t t = 0; t < done.at(2).logprobs.size(); ++t) {
    EXPECT_NEAR(done.at(2).logprobs[t], (*fresh)[0].logprobs[t], 1e-5);
  }
  EXPECT_EQ(engine->prefix_stats().tokens_prefilled, 7u + 24 + 60);  // 24 computed twice
}

TEST(ChunkedPrefillTest, ARequestCancelledMidPrefillFreesItsSlot) {
  auto m = MakeModel(false, 29);
  auto engine = ChunkedEngine(m, 8);
  ASSERT_TRUE(engine->Submit(Request(Prompt(9, 7), 20, 0, std::nullopt)).ok());
  engine->Step();
  auto long_id = engine->Submit(Request(Prompt(5, 60), 6, 0, std::nullopt));
  ASSERT_TRUE(long_id.ok());
  engine->Step();
  EXPECT_EQ(engine->active(), 2u);
  EXPECT_TRUE(engine->Cancel(*long_id));
  EXPECT_EQ(engine->active(), 1u);
  EXPECT_FALSE(engine->Cancel(*long_id));
  auto after = engine->Generate({Request(Prompt(3, 12), 4, 0, std::nullopt)});
  ASSERT_TRUE(after.ok());
  auto alone = ChunkedEngine(m, 0)->Generate({Request(Prompt(3, 12), 4, 0, std::nullopt)});
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ((*after)[0].tokens, (*alone)[0].tokens);
}

TEST(PrefixCacheTest, ABadPrefixSlotCountIsRefused) {
  auto engine = Engine::Create(MakeModel(false, 26), {.max_batch = 4, .max_sequence = 32, .prefix_slots = -2}, 1);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("prefix_slots"), std::string::npos);
  EngineOptions off{.max_batch = 8, .share_prefixes = false};
  EXPECT_EQ(off.PrefixSlots(), 0);
  EngineOptions defaults{.max_batch = 8};
  EXPECT_EQ(defaults.PrefixSlots(), 2);
  auto chunk = Engine::Create(MakeModel(false, 26), {.max_batch = 4, .max_sequence = 32, .prefill_chunk = -1}, 1);
  ASSERT_FALSE(chunk.ok());
  EXPECT_NE(chunk.status().message().find("prefill_chunk"), std::string::npos);
}

}  // namespace
}  // namespace flywheel::rollout
