// Structured-output grammars (tokenizer/grammar.h, json_schema.h, token_guide.h): the regex
// DFA against std::regex, the JSON-object machine against nlohmann's parser, schema regexes
// against the schema checker, and token masks against a brute-force walk.
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <regex>

#include "base/json.h"
#include "tokenizer/grammar.h"
#include "tokenizer/json_schema.h"
#include "tokenizer/token_guide.h"

namespace flywheel::tokenizer {
namespace {

using ojson = nlohmann::ordered_json;

std::unique_ptr<ByteGrammar> Regex(const std::string& pattern) {
  auto g = CompileRegex(pattern);
  EXPECT_TRUE(g.ok()) << pattern << ": " << g.status().ToString();
  return g.ok() ? std::move(*g) : nullptr;
}

// Random words of `g`: a byte at a time among those that continue it.
std::vector<std::string> RandomWords(ByteGrammar& g, std::mt19937_64& rng, int count, size_t max_bytes) {
  std::vector<std::string> words;
  for (int attempt = 0; attempt < count * 20 && static_cast<int>(words.size()) < count; ++attempt) {
    std::string state = g.Start(), text;
    while (text.size() < max_bytes) {
      if (g.Accepting(state) && rng() % 4 == 0) break;
      std::vector<uint8_t> next;
      for (int b = 0; b < 256; ++b) {
        std::string s = state;
        if (g.Step(s, static_cast<uint8_t>(b))) next.push_back(static_cast<uint8_t>(b));
      }
      if (next.empty()) break;
      // Prefer printable ASCII so that words end in reasonable time.
      std::vector<uint8_t> ascii;
      for (uint8_t b : next) if (b >= 0x20 && b < 0x7F) ascii.push_back(b);
      const std::vector<uint8_t>& from = !ascii.empty() && rng() % 8 != 0 ? ascii : next;
      const uint8_t b = from[rng() % from.size()];
      g.Step(state, b);
      text += static_cast<char>(b);
    }
    if (g.Accepting(state)) words.push_back(text);
  }
  return words;
}

TEST(RegexGrammarTest, MatchesLikeStdRegexOnRandomStrings) {
  const std::vector<std::string> patterns = {
      "a*b+", "(ab|cd){2,3}", "[a-c]x?[^ab]", "a{0,3}b{2}", "(?:ab)*c|d+", ".*a", "\\d{2}-\\w+",
      "(a|b)*abb", "[^a-c]*", "x{2,}", "(a?b?)+c", "^1 2$", "[-a]+", "a|", "(?:a|b|)c{0,1}"};
  const std::string alphabet = "abcdx-1 2";
  std::mt19937_64 rng(7);
  for (const std::string& pattern : patterns) {
    auto grammar = Regex(pattern);
    ASSERT_NE(grammar, nullptr);
    const std::regex reference(pattern.front() == '^' ? pattern.substr(1, pattern.size() - 2) : pattern);
    int matched = 0;
    for (int i = 0; i < 3000; ++i) {
      std::string s(rng() % 9, ' ');
      for (char& c : s) c = alphabet[rng() % alphabet.size()];
      const bool want = std::regex_match(s, reference);
      matched += want;
      ASSERT_EQ(GrammarAccepts(*grammar, s), want) << pattern << " on '" << s << "'";
    }
    // And the grammar's own random words (the strings that do match) match the reference.
    for (const std::string& word : RandomWords(*grammar, rng, 200, 12)) {
      // std::regex reads bytes, not UTF-8, and its '.' also stops at \r (ECMAScript; ours, as
      // Python's, only at \n): it judges printable ASCII words.
      if (std::any_of(word.begin(), word.end(), [](char c) { return c < 0x20 || c > 0x7E; })) continue;
      ++matched;
      ASSERT_TRUE(std::regex_match(word, reference)) << pattern << " on its word '" << word << "'";
    }
    EXPECT_GT(matched, 50) << pattern << ": too few matching strings; the test says little";
  }
}

TEST(RegexGrammarTest, CharactersAreUtf8CodePoints) {
  auto dot = Regex("^.$");
  EXPECT_TRUE(GrammarAccepts(*dot, "é"));
  EXPECT_TRUE(GrammarAccepts(*dot, "\xF0\x9F\x98\x80"));  // U+1F600, four bytes
  EXPECT_FALSE(GrammarAccepts(*dot, "éé"));
  EXPECT_FALSE(GrammarAccepts(*dot, "\xC3"));      // a lead byte alone
  EXPECT_FALSE(GrammarAccepts(*dot, "\xED\xA0\x80"));  // a surrogate
  EXPECT_FALSE(GrammarAccepts(*dot, "\n"));
  auto greek = Regex("[α-ω]+");
  EXPECT_TRUE(GrammarAccepts(*greek, "αβγ"));
  EXPECT_FALSE(GrammarAccepts(*greek, "abc"));
  auto not_greek = Regex("[^α-ω]");
  EXPECT_TRUE(GrammarAccepts(*not_greek, "a"));
  EXPECT_TRUE(GrammarAccepts(*not_greek, "ж"));
  EXPECT_FALSE(GrammarAccepts(*not_greek, "β"));
  EXPECT_TRUE(GrammarAccepts(*Regex("\\u00e9\\x41"), "éA"));
}

TEST(RegexGrammarTest, AWalkNeverEntersAStateItCannotFinish) {
  auto g = Regex("ab|ac");
  std::string state = g->Start();
  ASSERT_TRUE(g->Step(state, 'a'));
  std::string dead = state;
  EXPECT_FALSE(g->Step(dead, 'd'));
}

TEST(RegexGrammarTest, RefusesWhatItDoesNotSupportByName) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"(a", "')' expected"},         {"a)", "unbalanced"},
      {"(a)\\1", "back-references"},  {"(?=a)b", "lookaround"},
      {"\\bword", "word boundaries"}, {"[a", "unterminated class"},
      {"a{3,1}", "m < n"},            {"a{2000}", "over 1000"},
      {"*a", "nothing to repeat"},    {"(?i)a", "inline flags"},
      {"a++", "possessive"},          {"[[:alpha:]]", "POSIX"},
      {"(a{1000}){1000}", "automaton states"}, {"a^b", "'^' is only supported at the start"}};
  for (const auto& [pattern, words] : bad) {
    auto g = CompileRegex(pattern);
    ASSERT_FALSE(g.ok()) << pattern;
    EXPECT_NE(g.status().message().find(words), std::string::npos) << pattern << ": " << g.status().message();
  }
}

// A client's pattern can cost a worker little: what would take long to build is refused.
// (Before the work limit, the first took 46 s of one core.)
TEST(RegexGrammarTest, HostilePatternsAreRefusedOrCompiledQuickly) {
  for (const std::string pattern :
       {"(.|\\n){0,1000}x(.|\\n){0,100}", ".{0,1000}x.{0,40}", "(\\w+\\s?){1,1000}", "(a|b)*a(a|b){20}",
        "(.{0,1000}){0,1000}", "[^x]{0,1000}", "(a?){1000}a{1000}", "a{0,1000}b{0,1000}c{0,1000}"}) {
    const auto start = std::chrono::steady_clock::now();
    auto g = CompileRegex(pattern);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 3.0) << pattern << (g.ok() ? " compiled" : " refused: " + g.status().message());
  }
  // Bounded repetition builds in linear time: a JSON string of up to 1000 characters.
  EXPECT_TRUE(CompileRegex("[^x]{0,1000}").ok());
  auto long_string = JsonSchemaRegex(ojson::parse(R"({"type": "string", "maxLength": 1000})"));
  ASSERT_TRUE(long_string.ok());
  EXPECT_TRUE(CompileRegex(*long_string).ok());
  // Thirty optional properties (the regex repeats the rest once per possible first one)
  // compile; sixty are refused, quickly.
  auto optional = [](int count) {
    ojson schema = {{"type", "object"}, {"properties", ojson::object()}};
    for (int i = 0; i < count; ++i) schema["properties"]["p" + std::to_string(i)] = {{"type", "integer"}};
    return *JsonSchemaRegex(schema);
  };
  auto compiled = CompileRegex(optional(30), kJsonSchemaMaxRegexBytes);
  ASSERT_TRUE(compiled.ok()) << compiled.status().ToString();
  EXPECT_TRUE(GrammarAccepts(**compiled, R"({"p3":1,"p29":-2})"));
  EXPECT_TRUE(GrammarAccepts(**compiled, "{}"));
  EXPECT_FALSE(GrammarAccepts(**compiled, R"({"p29":1,"p3":2})"));
  const auto start = std::chrono::steady_clock::now();
  auto sixty = CompileRegex(optional(60), kJsonSchemaMaxRegexBytes);
  EXPECT_FALSE(sixty.ok());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 3.0);
}

// A random JSON value, nested at most `depth`.
ojson RandomJson(std::mt19937_64& rng, int depth, bool object) {
  const int kind = object ? 5 : static_cast<int>(rng() % (depth > 0 ? 7 : 5));
  switch (kind) {
    case 0: return static_cast<int64_t>(rng() % 2000) - 1000;
    case 1: return (static_cast<double>(rng() % 100000) - 5e4) / 7.0;
    case 2: {
      const char* strings[] = {"", "s", "q\"uote", "back\\slash\n", "/é", "\xF0\x9F\x98\x80x", "tab\t\u0001"};
      return std::string(strings[rng() % 7]);
    }
    case 3: return rng() % 2 == 0;
    case 4: return nullptr;
    case 5: {
      ojson o = ojson::object();
      for (uint64_t i = rng() % 4; i > 0; --i) o["k" + std::to_string(rng() % 9)] = RandomJson(rng, depth - 1, false);
      return o;
    }
    default: {
      ojson a = ojson::array();
      for (uint64_t i = rng() % 4; i > 0; --i) a.push_back(RandomJson(rng, depth - 1, false));
      return a;
    }
  }
}

TEST(JsonObjectGrammarTest, AcceptsJsonObjectsAndEveryPrefixContinues) {
  auto g = JsonObjectGrammar();
  std::mt19937_64 rng(3);
  for (int i = 0; i < 500; ++i) {
    const ojson doc = RandomJson(rng, 4, true);
    const std::string text = doc.dump(i % 3 == 0 ? 2 : -1);
    std::string state = g->Start();
    for (size_t b = 0; b < text.size(); ++b) {
      ASSERT_TRUE(g->Step(state, static_cast<uint8_t>(text[b]))) << text << " at byte " << b;
      if (b + 1 < text.size()) {
        ASSERT_FALSE(g->Accepting(state)) << text.substr(0, b + 1);
      }
    }
    ASSERT_TRUE(g->Accepting(state)) << text;
  }
}

TEST(JsonObjectGrammarTest, RefusesWhatIsNotOneJsonObject) {
  auto g = JsonObjectGrammar();
  for (const std::string bad :
       {"{", "{}x", "{} ", "[1]", "\"a\"", "{\"a\":01}", "{\"a\":tru}", "{\"a\" 1}", "{\"a\":1,}",
        "{\"a\":\"\x01\"}", "{\"a\":\"\xC3(\"}", "{\"a\":\"\\q\"}", "{\"a\":1.}", "{\"a\":-}",
        "{\"a\":[1,]}", "{'a':1}", "{\"a\":1}}", "{\"a\":\"\\u12g4\"}"}) {
    EXPECT_FALSE(GrammarAccepts(*g, bad)) << bad;
  }
  for (const std::string good : {"{}", " {\"a\" : [1, 2.5e-3, {\"b\": null}], \"c\": \"\\u00e9\"}",
                                 "{\"x\":-0.0E+12,\"y\":[[],[true,false]]}"}) {
    EXPECT_TRUE(GrammarAccepts(*g, good)) << good;
  }
  std::string deep = "{\"a\":";
  for (int i = 0; i < kJsonGrammarMaxDepth; ++i) deep += "[";
  EXPECT_FALSE(GrammarAccepts(*g, deep + "1")) << "nesting beyond the limit";
}

ojson Schema() {
  return ojson::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "minLength": 1, "maxLength": 8},
      "age": {"type": "integer"},
      "score": {"type": ["number", "null"]},
      "tags": {"type": "array", "items": {"enum": ["a", "b", 3, null]}, "minItems": 1, "maxItems": 3},
      "address": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                                                  "zip": {"type": "string", "format": "date"}},
                  "required": ["city"], "additionalProperties": false},
      "kind": {"const": "user"},
      "ok": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 2}]}
    },
    "required": ["name", "tags"],
    "title": "A person"
  })");
}

TEST(JsonSchemaTest, EveryWordOfTheRegexParsesAndValidates) {
  const ojson schema = Schema();
  auto regex = JsonSchemaRegex(schema);
  ASSERT_TRUE(regex.ok()) << regex.status().ToString();
  auto g = Regex(*regex);
  ASSERT_NE(g, nullptr);
  std::mt19937_64 rng(11);
  const std::vector<std::string> words = RandomWords(*g, rng, 300, 600);
  ASSERT_GE(words.size(), 250u);
  std::set<std::string> optional_seen;
  for (const std::string& w : words) {
    auto value = ParseJson<ojson>(w, "the word");
    ASSERT_TRUE(value.ok()) << w << ": " << value.status().ToString();
    const Status valid = CheckJsonSchema(schema, *value);
    ASSERT_TRUE(valid.ok()) << w << ": " << valid.ToString();
    for (const char* key : {"age", "score", "address", "kind", "ok"}) if (value->contains(key)) optional_seen.insert(key);
  }
  EXPECT_EQ(optional_seen.size(), 5u) << "every optional property appears in some word";
  // And hand-written valid documents are words of it.
  for (const std::string good : {R"({"name":"Al","tags":["a"]})",
                                 R"({"name": "Bo", "age": -12, "tags": [3, null], "address": {"city": "Oslo"}, "ok": true})",
                                 R"({"name":"\u00e9","score":null,"tags":["b"],"kind":"user"})"}) {
    EXPECT_TRUE(GrammarAccepts(*g, good)) << good;
  }
  for (const std::string bad : {R"({"tags":["a"],"name":"Al"})", R"({"name":"","tags":["a"]})",
                                R"({"name":"Al","tags":[]})", R"({"name":"Al","tags":["c"]})",
                                R"({"name":"Al","tags":["a"],"address":{"city":"oslo"}})"}) {
    EXPECT_FALSE(GrammarAccepts(*g, bad)) << bad;
  }
}

TEST(JsonSchemaTest, RefusesUnsupportedConstructsByNameAndPath) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"type":"object","properties":{"age":{"type":"integer","minimum":0}}})", "'minimum' at $.properties.age"},
      {R"({"$ref":"#/$defs/a"})", "'$ref' at $"},
      {R"({"type":"array"})", "an array without 'items' at $"},
      {R"({"type":"object"})", "an object without 'properties'"},
      {R"({"oneOf":[{"type":"string"}]})", "'oneOf' at $"},
      {R"({"type":"string","pattern":"a\"b"})", "can write '\"'"},
      {R"({"type":"string","pattern":"(a"})", "'pattern': regex"},
      {R"({"type":"string","format":"email"})", "format 'email'"},
      {R"({"type":"object","properties":{"a":{"type":"string"}},"required":["b"]})", "required property \"b\""},
      {R"({"type":"thing"})", "unknown type 'thing'"},
      {R"({"type":"array","items":{"type":"string"},"minItems":3,"maxItems":2})", "'maxItems' below 'minItems'"},
      {"{}", "a schema without 'type'"}};
  for (const auto& [schema, words] : bad) {
    auto r = JsonSchemaRegex(ojson::parse(schema));
    ASSERT_FALSE(r.ok()) << schema;
    EXPECT_NE(r.status().message().find(words), std::string::npos) << schema << ": " << r.status().message();
  }
}

// A vocabulary of every byte plus multi-byte pieces that cross grammar boundaries.
std::shared_ptr<const TokenBytes> TestVocabulary() {
  std::vector<std::string> pieces;
  for (int b = 0; b < 256; ++b) pieces.push_back(std::string(1, static_cast<char>(b)));
  for (const char* p : {"{\"", "\":", "\",\"", "name", "tags", "\":[\"", "\"]}", "true", "null", "12", "ab", "é",
                        "\xC3", "\xA9\"", "ac", "abb", "}}", ", ", "\": "}) {
    pieces.push_back(p);
  }
  pieces.push_back("");  // a special token: never allowed
  return TokenBytes::FromPieces(pieces);
}

TEST(TokenGuideTest, MasksEqualABruteForceWalkAndAdvanceFollowsThem) {
  auto vocabulary = TestVocabulary();
  for (const std::string& pattern : {std::string("(a|b)*abb"), *JsonSchemaRegex(Schema())}) {
    auto guide = TokenGuide::Create(Regex(pattern), vocabulary);
    ASSERT_TRUE(guide.ok()) << guide.status().ToString();
    auto brute = Regex(pattern);
    std::mt19937_64 rng(5);
    for (int walk = 0; walk < 30; ++walk) {
      int32_t state = TokenGuide::kStart;
      std::string text;
      for (int step = 0; step < 80; ++step) {
        auto mask = (*guide)->Allowed(state);
        std::vector<int32_t> allowed;
        for (int32_t t = 0; t < vocabulary->size(); ++t) {
          std::string s = brute->Start();
          bool ok = !vocabulary->piece(t).empty();
          for (char c : text + vocabulary->piece(t)) ok = ok && brute->Step(s, static_cast<uint8_t>(c));
          ASSERT_EQ(mask->Allows(t), ok) << pattern << " after '" << text << "', token " << t;
          if (ok) allowed.push_back(t);
        }
        ASSERT_EQ(mask->allowed, static_cast<int64_t>(allowed.size()));
        if (allowed.empty() || (mask->accepting && rng() % 3 == 0)) break;
        const int32_t token = allowed[rng() % allowed.size()];
        state = (*guide)->Advance(state, token);
        ASSERT_GE(state, 0);
        text += vocabulary->piece(token);
      }
    }
    EXPECT_EQ((*guide)->Advance(TokenGuide::kStart, static_cast<int32_t>(vocabulary->size() - 1)), -1);
  }
}

TEST(TokenGuideTest, AVocabularyThatCannotBeginTheGrammarIsRefused) {
  auto digits = TokenBytes::FromPieces({"0", "1", "2"});
  auto guide = TokenGuide::Create(Regex("yes|no"), digits);
  ASSERT_FALSE(guide.ok());
  EXPECT_NE(guide.status().message().find("regex 'yes|no'"), std::string::npos) << guide.status().message();
}

}  // namespace
}  // namespace flywheel::tokenizer
