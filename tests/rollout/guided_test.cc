// Structured outputs in the rollout engine (SamplingParams::guide) and the OpenAI layer's
// guide cache: every answer is a word of its grammar, the reported logprobs are of the
// masked distribution, a grammar the vocabulary cannot continue ends with finish_reason
// "grammar", seeded guided samples equal each other with and without shared prefixes, and
// the cache refuses what a vocabulary cannot write.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <set>

#include "base/json.h"
#include "rollout/engine.h"
#include "rollout/structured_output.h"
#include "tests/model/tiny_models.h"
#include "tokenizer/json_schema.h"

namespace flywheel::rollout {
namespace {

using ojson = nlohmann::ordered_json;
constexpr int32_t kEos = 257;  // ByteTokenizer's

std::shared_ptr<model::TransformerImpl> ByteModel(uint64_t seed) {
  torch::manual_seed(seed);
  auto m = std::make_shared<model::TransformerImpl>(testing::TinyConfig({.vocab = 260}));
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) {
    if (p.dim() == 2) p.mul_(4);  // peaked distributions: the mask matters
  }
  return m;
}

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<model::TransformerImpl> m, bool share) {
  auto engine = Engine::Create(std::move(m), {.max_batch = 8, .max_sequence = 128, .share_prefixes = share}, 1);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return std::move(*engine);
}

std::shared_ptr<tokenizer::TokenGuide> Guide(ojson request) {
  static GuideCache cache(std::make_shared<model::ByteTokenizer>());
  auto guide = cache.ForRequest(request);
  EXPECT_TRUE(guide.ok()) << guide.status().ToString();
  return guide.ok() ? *guide : nullptr;
}

GenerationRequest Guided(std::shared_ptr<tokenizer::TokenGuide> guide, uint64_t seed, int64_t max_tokens) {
  GenerationRequest r;
  r.prompt = {'{', 'x', ':'};
  r.params.max_tokens = max_tokens;
  r.params.seed = seed;
  r.params.stop_tokens = {kEos};
  r.params.guide = std::move(guide);
  return r;
}

std::string Text(const GenerationResult& r) {
  std::string s;
  for (int32_t t : r.tokens) {
    if (t < 256) s += static_cast<char>(t);
  }
  return s;
}

ojson BoundedSchema() {
  return ojson::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 6},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["red", "green", 7]}, "maxItems": 2},
      "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"]})");
}

TEST(GuidedEngineTest, EverySchemaAnswerParsesAndValidates) {
  auto engine = MakeEngine(ByteModel(1), true);
  const ojson schema = BoundedSchema();
  auto guide = Guide({{"guided_json", schema}});
  std::vector<GenerationRequest> requests;
  for (uint64_t seed = 0; seed < 24; ++seed) requests.push_back(Guided(guide, seed, 125));  // the longest answer: 115 bytes and the stop token
  auto results = engine->Generate(requests);
  ASSERT_TRUE(results.ok()) << results.status().ToString();
  std::set<std::string> distinct;
  for (const GenerationResult& r : *results) {
    ASSERT_EQ(r.finish_reason, "stop") << Text(r);
    EXPECT_TRUE(r.guided);
    EXPECT_EQ(r.tokens.back(), kEos) << "the answer ends on the stop token, allowed once whole";
    auto value = ParseJson<ojson>(Text(r), "the answer");
    ASSERT_TRUE(value.ok()) << Text(r) << ": " << value.status().ToString();
    const Status valid = tokenizer::CheckJsonSchema(schema, *value);
    ASSERT_TRUE(valid.ok()) << Text(r) << ": " << valid.ToString();
    distinct.insert(Text(r));
  }
  EXPECT_GT(distinct.size(), 12u) << "sampled answers differ (the mask does not force one)";
}

TEST(GuidedEngineTest, LogprobsAreOfTheMaskedDistribution) {
  auto engine = MakeEngine(ByteModel(2), true);
  auto guide = Guide({{"guided_choice", {"yes", "no", "maybe"}}});
  GenerationRequest r = Guided(guide, 3, 10);
  r.params.top_logprobs = 5;
  auto results = engine->Generate({r, Guided(guide, 3, 10)});
  ASSERT_TRUE(results.ok());
  const GenerationResult& a = (*results)[0];
  const std::string text = Text(a);
  EXPECT_TRUE(text == "yes" || text == "no" || text == "maybe") << text;
  // First token: only 'y', 'n', 'm' are allowed; their probabilities sum to 1.
  ASSERT_FALSE(a.top_logprobs.empty());
  double mass = 0;
  for (const TokenLogprob& t : a.top_logprobs[0]) {
    EXPECT_TRUE(t.token == 'y' || t.token == 'n' || t.token == 'm') << t.token;
    mass += std::exp(t.logprob);
  }
  EXPECT_EQ(a.top_logprobs[0].size(), 3u);
  EXPECT_NEAR(mass, 1.0, 1e-5);
  // After the whole word only the stop token is left: logprob 0.
  EXPECT_EQ(a.tokens.back(), kEos);
  EXPECT_NEAR(a.logprobs.back(), 0.0, 1e-6);
  // top_logprobs does not change what is sampled.
  EXPECT_EQ(a.tokens, (*results)[1].tokens);
  EXPECT_EQ(a.logprobs, (*results)[1].logprobs);
}

TEST(GuidedEngineTest, AGrammarTheVocabularyCannotContinueEndsWithGrammar) {
  // The vocabulary writes "a", "c" and "d" only: "ab" cannot be finished, "cd" can.
  std::vector<std::string> pieces(260);
  pieces['a'] = "a", pieces['c'] = "c", pieces['d'] = "d";
  auto grammar = tokenizer::CompileRegex("ab|cd");
  ASSERT_TRUE(grammar.ok());
  auto guide = tokenizer::TokenGuide::Create(std::move(*grammar),
                                             tokenizer::TokenBytes::FromPieces(pieces));
  ASSERT_TRUE(guide.ok()) << guide.status().ToString();
  auto engine = MakeEngine(ByteModel(3), true);
  std::vector<GenerationRequest> requests;
  for (uint64_t seed = 0; seed < 16; ++seed) {
    GenerationRequest r = Guided(*guide, seed, 10);
    r.params.temperature = 5;  // both first letters get sampled
    requests.push_back(r);
  }
  auto results = engine->Generate(requests);
  ASSERT_TRUE(results.ok());
  std::set<std::string> ends;
  for (const GenerationResult& r : *results) {
    const std::string text = Text(r);
    if (r.finish_reason == "grammar") {
      EXPECT_EQ(text, "a");
      EXPECT_EQ(r.tokens.size(), 1u) << "no token is sampled at a dead end";
    } else {
      EXPECT_EQ(r.finish_reason, "stop");
      EXPECT_EQ(text, "cd");
    }
    ends.insert(r.finish_reason);
  }
  EXPECT_EQ(ends.size(), 2u) << "both outcomes were drawn";
  // The engine keeps serving after dead ends.
  EXPECT_EQ(engine->active(), 0u);
  auto after = engine->Generate({Guided(nullptr, 1, 3)});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ((*after)[0].tokens.size(), 3u);
}

// A temperature so small that the scaled logits overflow (a client may send 1e-300) makes
// the sampler's numbers NaN; a guided request then ends ("grammar") instead of walking its
// grammar from a state it does not have, and the engine keeps serving.
TEST(GuidedEngineTest, OverflowingLogitsEndTheRequestNotTheEngine) {
  auto engine = MakeEngine(ByteModel(5), true);
  auto guide = Guide({{"guided_choice", {"yes", "no"}}});
  std::vector<GenerationRequest> requests;
  for (double t : {1e-300, 1e-310}) {
    GenerationRequest r = Guided(guide, 1, 10);
    r.params.temperature = t;
    requests.push_back(r);
  }
  auto results = engine->Generate(requests);
  ASSERT_TRUE(results.ok()) << results.status().ToString();
  for (const GenerationResult& r : *results) {
    EXPECT_TRUE(r.finish_reason == "grammar" || r.finish_reason == "stop") << r.finish_reason;
    const std::string text = Text(r);
    EXPECT_TRUE(std::string("yes").rfind(text, 0) == 0 || std::string("no").rfind(text, 0) == 0 || text.size() <= 1)
        << text;
  }
  auto after = engine->Generate({Guided(guide, 2, 10)});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ((*after)[0].finish_reason, "stop");
}

TEST(GuidedEngineTest, SeededGuidedSamplesAreEqualWithAndWithoutSharedPrefixes) {
  auto model = ByteModel(4);
  auto guide = Guide({{"response_format", {{"type", "json_object"}}}});
  std::vector<GenerationRequest> group;
  for (uint64_t seed = 0; seed < 6; ++seed) group.push_back(Guided(guide, seed, 40));
  auto shared = MakeEngine(model, true)->Generate(group);
  auto alone = MakeEngine(model, false)->Generate(group);
  ASSERT_TRUE(shared.ok() && alone.ok());
  for (size_t i = 0; i < group.size(); ++i) {
    EXPECT_EQ((*shared)[i].tokens, (*alone)[i].tokens) << i;
    EXPECT_EQ((*shared)[i].logprobs, (*alone)[i].logprobs) << i;
    // Cut by max_tokens or not, the text is a prefix of some JSON object.
    auto g = tokenizer::JsonObjectGrammar();
    std::string state = g->Start();
    for (char c : Text((*shared)[i])) ASSERT_TRUE(g->Step(state, static_cast<uint8_t>(c))) << Text((*shared)[i]);
    if ((*shared)[i].finish_reason == "stop") {
      EXPECT_TRUE(g->Accepting(state));
    }
  }
}

TEST(GuideCacheTest, RefusesWhatTheRequestOrVocabularyCannotDoByField) {
  auto chars = tokenizer::CharTokenizer::Create("0123456789yes");
  ASSERT_TRUE(chars.ok());
  GuideCache cache(std::shared_ptr<const model::Tokenizer>(std::move(*chars)));
  const std::vector<std::pair<ojson, std::string>> bad = {
      {{{"guided_choice", {"yes", "no"}}}, "'guided_choice' entry \"no\" cannot be written"},
      {{{"guided_regex", "(a"}}, "'guided_regex': regex: ')' expected"},
      {{{"guided_regex", "[A-Z]+"}}, "no token that can begin regex '[A-Z]+'"},
      {{{"guided_json", {{"type", "integer"}, {"minimum", 0}}}}, "'guided_json': 'minimum' at $"},
      {{{"guided_grammar", "root ::= \"a\""}}, "'guided_grammar' (EBNF grammars) is not supported"},
      {{{"response_format", {{"type", "xml"}}}}, "must be text, json_object or json_schema"},
      {{{"response_format", {{"type", "json_schema"}}}}, "must be an object with a 'schema'"},
      {{{"guided_regex", "1"}, {"guided_choice", {"1"}}}, "give at most one"},
      {{{"structured_outputs", {{"choice", ojson::array()}}}}, "'structured_outputs.choice' must be a non-empty list"},
      {{{"guided_json", "{not json"}}, "'guided_json': not valid JSON"}};
  for (const auto& [request, words] : bad) {
    auto guide = cache.ForRequest(request);
    ASSERT_FALSE(guide.ok()) << request.dump();
    EXPECT_NE(guide.status().message().find(words), std::string::npos) << request.dump() << ": " << guide.status().message();
  }
  // What it can do: a cached guide is the same object.
  auto a = cache.ForRequest({{"guided_regex", "[0-9]{2}"}});
  auto b = cache.ForRequest({{"structured_outputs", {{"regex", "[0-9]{2}"}}}});
  ASSERT_TRUE(a.ok() && b.ok() && *a != nullptr);
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(cache.compiled(), 1);
  auto none = cache.ForRequest({{"response_format", {{"type", "text"}}}});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);
}

}  // namespace
}  // namespace flywheel::rollout
