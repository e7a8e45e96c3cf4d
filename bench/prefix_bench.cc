#include "bench/prefix_bench.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#include "bench/stats.h"
#include "model/model.h"
#include "model/model_config.h"
#include "rollout/engine.h"

namespace flywheel::bench {

namespace {

using Clock = std::chrono::steady_clock;
using rollout::Engine;
using rollout::GenerationRequest;
using rollout::GenerationResult;
using rollout::TokenEvent;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::vector<int32_t> RandomTokens(std::mt19937_64& rng, int64_t count, int64_t vocab) {
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return tokens;
}

GenerationRequest Sample(const std::vector<int32_t>& prompt, int64_t max_tokens, uint64_t seed) {
  GenerationRequest r;
  r.prompt = prompt;
  r.params.max_tokens = max_tokens;
  r.params.temperature = 1.0;
  r.params.seed = seed;
  return r;
}

bool SameResults(const std::vector<GenerationResult>& a, const std::vector<GenerationResult>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].tokens != b[i].tokens || a[i].logprobs.size() != b[i].logprobs.size()) return false;
    if (std::memcmp(a[i].logprobs.data(), b[i].logprobs.data(),
                    a[i].logprobs.size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

struct GroupTimes {
  std::vector<double> one, shared, unshared;
  bool same = true;
  uint64_t prefilled_shared = 0, prefilled_unshared = 0;  // the last round's
};

Result<GroupTimes> TimeGroups(const PrefixBenchOptions& o, Engine& shared, Engine& unshared,
                              int64_t vocab) {
  std::mt19937_64 rng(11);
  GroupTimes t;
  for (int round = -1; round < o.rounds; ++round) {  // round -1 warms up
    const std::vector<int32_t> prompt = RandomTokens(rng, o.group_prompt_tokens, vocab);
    std::vector<GenerationRequest> group;
    for (int64_t i = 0; i < o.group_n; ++i) group.push_back(Sample(prompt, o.group_max_tokens, i));
    // One sample of another prompt of the same length: nothing of it is cached.
    const std::vector<int32_t> other = RandomTokens(rng, o.group_prompt_tokens, vocab);
    auto start = Clock::now();
    FW_RETURN_IF_ERROR(unshared.Generate({Sample(other, o.group_max_tokens, 0)}).status());
    const double one = Since(start);
    const uint64_t before_shared = shared.prefix_stats().tokens_prefilled;
    start = Clock::now();
    FW_ASSIGN_OR_RETURN(std::vector<GenerationResult> a, shared.Generate(group));
    const double shared_s = Since(start);
    const uint64_t before_unshared = unshared.prefix_stats().tokens_prefilled;
    start = Clock::now();
    FW_ASSIGN_OR_RETURN(std::vector<GenerationResult> b, unshared.Generate(group));
    const double unshared_s = Since(start);
    t.same = t.same && SameResults(a, b);
    if (round < 0) continue;
    t.one.push_back(one);
    t.shared.push_back(shared_s);
    t.unshared.push_back(unshared_s);
    t.prefilled_shared = shared.prefix_stats().tokens_prefilled - before_shared;
    t.prefilled_unshared = unshared.prefix_stats().tokens_prefilled - before_unshared;
  }
  return t;
}

struct EpisodeCounts {
  uint64_t prefilled = 0, history = 0, expected_new = 0;
  double shared_s = 0, unshared_s = 0;
  bool same_tokens = true;
};

// One episode through both engines, greedy (so the histories agree whatever the engine).
Result<EpisodeCounts> RunEpisode(const PrefixBenchOptions& o, Engine& shared, Engine& unshared,
                                 int64_t vocab) {
  std::mt19937_64 rng(13);
  EpisodeCounts c;
  std::vector<int32_t> history = RandomTokens(rng, o.turn_tokens, vocab);
  const uint64_t before = shared.prefix_stats().tokens_prefilled;
  int64_t cached = 0;
  for (int64_t turn = 0; turn < o.turns; ++turn) {
    GenerationRequest request = Sample(history, o.group_max_tokens, 0);
    request.params.temperature = 0;
    auto start = Clock::now();
    FW_ASSIGN_OR_RETURN(std::vector<GenerationResult> a, shared.Generate({request}));
    c.shared_s += Since(start);
    start = Clock::now();
    FW_ASSIGN_OR_RETURN(std::vector<GenerationResult> b, unshared.Generate({request}));
    c.unshared_s += Since(start);
    c.same_tokens = c.same_tokens && a[0].tokens == b[0].tokens;
    c.history += history.size();
    c.expected_new += history.size() - static_cast<size_t>(cached);
    history.insert(history.end(), a[0].tokens.begin(), a[0].tokens.end());
    cached = static_cast<int64_t>(history.size()) - 1;  // the last answer token is not fed
    const std::vector<int32_t> tool =
        RandomTokens(rng, o.turn_tokens - static_cast<int64_t>(a[0].tokens.size()), vocab);
    history.insert(history.end(), tool.begin(), tool.end());
  }
  c.prefilled = shared.prefix_stats().tokens_prefilled - before;
  return c;
}

struct ArrivalTimes {
  double undisturbed = 0;  // median step of the running requests alone
  double worst = 0, median = 0;  // steps while the long prompt is prefilled
  double first_token = 0;        // from its Submit to its first token
  double joining = 0;            // the step it joined the decoding batch in
  std::vector<int32_t> answer;
};

// `running` requests decode; after 10 undisturbed steps the long prompt arrives.
Result<ArrivalTimes> TimeArrival(const PrefixBenchOptions& o, std::shared_ptr<model::TransformerImpl> model,
                                 int64_t chunk) {
  const int64_t chunks = chunk > 0 ? (o.long_prompt_tokens + chunk - 1) / chunk : 1;
  const int64_t decode_tokens = chunks + 40;
  FW_ASSIGN_OR_RETURN(auto engine,
                      Engine::Create(model,
                                     {.max_batch = o.running + 1,
                                      .max_sequence = std::max(o.long_prompt_tokens + 8, 16 + decode_tokens),
                                      .share_prefixes = false,
                                      .prefill_chunk = chunk},
                                     1));
  std::mt19937_64 rng(17);
  for (int64_t i = 0; i < o.running; ++i) {
    FW_RETURN_IF_ERROR(engine->Submit(Sample(RandomTokens(rng, 16, 256), decode_tokens, i)).status());
  }
  engine->Step();  // their prefills
  ArrivalTimes t;
  std::vector<double> steps;
  for (int i = 0; i < 10; ++i) {
    const auto start = Clock::now();
    engine->Step();
    steps.push_back(Since(start));
  }
  t.undisturbed = Median(steps);
  GenerationRequest long_prompt = Sample(RandomTokens(rng, o.long_prompt_tokens, 256), 4, 0);
  long_prompt.params.temperature = 0;
  const auto arrived = Clock::now();
  FW_ASSIGN_OR_RETURN(const uint64_t id, engine->Submit(long_prompt));
  steps.clear();
  for (bool first = false; !first;) {
    std::vector<TokenEvent> events;
    const auto start = Clock::now();
    engine->Step(&events);
    steps.push_back(Since(start));
    if (engine->running() < o.running) return Status::Internal("a running request ended early");
    for (const TokenEvent& e : events) first = first || e.id == id;
  }
  t.first_token = Since(arrived);
  // The last step is the one it joins the batch in (its last chunk, its first token, and a
  // decode over its 4k cache: every later step's cost, not a stall).
  t.joining = steps.back();
  if (steps.size() > 1) steps.pop_back();
  t.worst = *std::max_element(steps.begin(), steps.end());
  t.median = Median(steps);
  while (true) {  // the long prompt's answer, to compare
    for (GenerationResult& r : engine->Step()) {
      if (r.id == id) {
        t.answer = r.tokens;
        return t;
      }
    }
  }
}

std::string ArrivalReport(const PrefixBenchOptions& o, const ArrivalTimes& c, const ArrivalTimes& w,
                          bool& met) {
  char text[1600];
  // Whole prefill has no steps before the joining one: its stall is that step.
  const double whole_worst = w.worst > 0 ? std::max(w.worst, w.joining) : w.joining;
  met = c.worst <= 1.5 * c.undisturbed;
  std::snprintf(text, sizeof(text),
                "\n| %lld requests decoding while a %lld-token prompt arrives | undisturbed step (ms) | "
                "worst step while it prefills (ms) | median (ms) | worst vs undisturbed | step it "
                "joins in (ms) | its first token (s) |\n|---|---|---|---|---|---|---|\n"
                "| chunked prefill, %lld tokens a step | %.1f | %.1f | %.1f | %.2fx | %.1f | %.2f |\n"
                "| whole prefill (before) | %.1f | %.1f | %.1f | %.2fx | %.1f | %.2f |\n"
                "\nchecks: the long prompt's answer is the same both ways: %s; worst step while it "
                "prefills within 1.5x the undisturbed one: %s%s\n",
                static_cast<long long>(o.running), static_cast<long long>(o.long_prompt_tokens),
                static_cast<long long>(o.prefill_chunk), c.undisturbed * 1e3, c.worst * 1e3,
                c.median * 1e3, c.worst / c.undisturbed, c.joining * 1e3, c.first_token,
                w.undisturbed * 1e3, whole_worst * 1e3, whole_worst * 1e3,
                whole_worst / w.undisturbed, w.joining * 1e3, w.first_token,
                c.answer == w.answer ? "yes" : "NO", met ? "yes" : "NO",
                o.check_timing ? "" : " (not enforced)");
  return text;
}

std::string Report(const PrefixBenchOptions& o, int64_t parameters, const GroupTimes& g,
                   const EpisodeCounts& e, bool& targets_met) {
  const double one = Median(g.one), shared = Median(g.shared), unshared = Median(g.unshared);
  std::ostringstream report;
  char line[640];
  std::snprintf(line, sizeof(line),
                "### Shared prefixes\n\nmodel: demo dense (%.1fM parameters, fp32, random "
                "weights), %d threads, engine calls (no HTTP); medians of %d rounds, a fresh "
                "prompt each round\n\n| group of %lld on a %lld-token prompt, %lld tokens each | "
                "wall (s) | vs one sample | prompt tokens prefilled |\n|---|---|---|---|\n",
                static_cast<double>(parameters) / 1e6, torch::get_num_threads(), o.rounds,
                static_cast<long long>(o.group_n), static_cast<long long>(o.group_prompt_tokens),
                static_cast<long long>(o.group_max_tokens));
  report << line;
  std::snprintf(line, sizeof(line), "| one sample | %.3f | 1.00x | %lld |\n", one,
                static_cast<long long>(o.group_prompt_tokens));
  report << line;
  std::snprintf(line, sizeof(line), "| group, shared prefix | %.3f | %.2fx | %llu |\n", shared,
                shared / one, static_cast<unsigned long long>(g.prefilled_shared));
  report << line;
  std::snprintf(line, sizeof(line), "| group, every sample prefilled (before) | %.3f | %.2fx | %llu |\n",
                unshared, unshared / one, static_cast<unsigned long long>(g.prefilled_unshared));
  report << line;
  std::snprintf(line, sizeof(line),
                "\n| episode: %lld turns of %lld tokens | prompt tokens prefilled | wall (s) |\n"
                "|---|---|---|\n| shared prefixes | %llu (the new tokens: %llu) | %.3f |\n"
                "| every turn prefilled whole (before) | %llu (the history's length, summed) | %.3f |\n",
                static_cast<long long>(o.turns), static_cast<long long>(o.turn_tokens),
                static_cast<unsigned long long>(e.prefilled),
                static_cast<unsigned long long>(e.expected_new), e.shared_s,
                static_cast<unsigned long long>(e.history), e.unshared_s);
  report << line;
  targets_met = shared <= 1.6 * one;
  std::snprintf(line, sizeof(line),
                "\nchecks: shared group equals the unshared group bit for bit (tokens, logprobs): "
                "%s; episode prefilled only its new tokens: %s, greedy answers equal: %s; group "
                "within 1.6x one sample: %s%s\n",
                g.same ? "yes" : "NO", e.prefilled == e.expected_new ? "yes" : "NO",
                e.same_tokens ? "yes" : "NO", targets_met ? "yes" : "NO",
                o.check_timing ? "" : " (not enforced)");
  report << line;
  return report.str();
}

}  // namespace

Result<std::string> RunPrefixBench(const PrefixBenchOptions& o, bool& targets_met) {
  model::ModelConfig config = model::DemoDenseConfig();
  const int64_t longest =
      std::max({o.group_prompt_tokens, o.turns * o.turn_tokens, o.long_prompt_tokens}) + o.group_max_tokens;
  if (o.prefill_chunk < 1) return Status::InvalidArgument("the prefill chunk must be >= 1 token");
  if (o.turn_tokens <= o.group_max_tokens) {
    return Status::InvalidArgument("turn tokens must exceed the tokens generated per turn");
  }
  if (longest > config.max_position_embeddings) {
    return Status::InvalidArgument("the longest sequence (" + std::to_string(longest) +
                                   " tokens) exceeds the model's " +
                                   std::to_string(config.max_position_embeddings));
  }
  torch::manual_seed(1);
  auto model = std::make_shared<model::TransformerImpl>(config);
  const int64_t batch = std::max<int64_t>(o.group_n, 4);
  auto engines = [&]() -> Result<std::pair<std::unique_ptr<Engine>, std::unique_ptr<Engine>>> {
    FW_ASSIGN_OR_RETURN(auto shared, Engine::Create(model, {.max_batch = batch, .max_sequence = longest}, 1));
    FW_ASSIGN_OR_RETURN(auto unshared, Engine::Create(model, {.max_batch = batch, .max_sequence = longest,
                                                              .share_prefixes = false}, 1));
    return std::make_pair(std::move(shared), std::move(unshared));
  };
  // Prompts of 256 token values; the episode on engines of its own (nothing cached before).
  FW_ASSIGN_OR_RETURN(auto for_groups, engines());
  FW_ASSIGN_OR_RETURN(GroupTimes group, TimeGroups(o, *for_groups.first, *for_groups.second, 256));
  FW_ASSIGN_OR_RETURN(auto for_episode, engines());
  FW_ASSIGN_OR_RETURN(EpisodeCounts episode, RunEpisode(o, *for_episode.first, *for_episode.second, 256));
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  std::string report = Report(o, parameters, group, episode, targets_met);
  FW_ASSIGN_OR_RETURN(const ArrivalTimes chunked, TimeArrival(o, model, o.prefill_chunk));
  FW_ASSIGN_OR_RETURN(const ArrivalTimes whole, TimeArrival(o, model, 0));
  bool arrival_met = false;
  report += ArrivalReport(o, chunked, whole, arrival_met);
  targets_met = targets_met && arrival_met;
  if (chunked.answer != whole.answer) {
    return Status::Mismatch("the long prompt's answer differs with chunked prefill\n" + report);
  }
  if (!group.same) return Status::Mismatch("the shared group differs from the unshared group\n" + report);
  if (episode.prefilled != episode.expected_new || !episode.same_tokens) {
    return Status::Mismatch("the episode prefilled more than its new tokens, or its answers differ\n" + report);
  }
  if (o.check_timing && !targets_met) return Status::Mismatch("a timing target was missed\n" + report);
  return report;
}

}  // namespace flywheel::bench
