// ChatRenderer: loss masks over exactly the assistant tokens, for the real Qwen3 template
// (tools, multi-turn, <think>), the Llama-3.1 template and a template with generation blocks,
// on the tiny tokenizers of tests/tokenizer/data given those templates' special tokens.
// The text-level spans are compared with a jinja2 reference (tests/data/render_spans.py,
// run once for the suite; without python3-jinja2 those cases skip, which fails a CI run); the
// token-level masks are checked against the spans and, for a few turns, against the literal
// text the turn must train.
#include "data/render.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace flywheel::data {
namespace {

using nlohmann::ordered_json;

const std::string kSourceDir = FLYWHEEL_SOURCE_DIR;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A tiny tokenizer.json from tests/tokenizer/data with `specials` added as special tokens
// (after the vocabulary) and its byte-level pre-tokenizer adding no prefix space (as Qwen2's
// and Llama-3's do not).
std::unique_ptr<tokenizer::HfTokenizer> TinyTokenizer(const std::string& file,
                                                      const std::vector<std::string>& specials,
                                                      const std::string& bos, const std::string& eos) {
  ordered_json json = ordered_json::parse(ReadFile(kSourceDir + "/tests/tokenizer/data/" + file));
  int next = 0;
  for (const auto& token : json["added_tokens"]) next = std::max(next, token["id"].get<int>() + 1);
  for (const std::string& content : specials)
    json["added_tokens"].push_back({{"id", next++}, {"content", content}, {"single_word", false},
                                    {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                                    {"special", true}});
  if (json["pre_tokenizer"]["type"] == "ByteLevel") json["pre_tokenizer"]["add_prefix_space"] = false;
  ordered_json config = {{"bos_token", bos.empty() ? ordered_json() : ordered_json(bos)},
                         {"eos_token", eos}};
  auto loaded = tokenizer::HfTokenizer::FromJson(json.dump(), config.dump());
  EXPECT_TRUE(loaded.ok()) << loaded.status().ToString();
  return loaded.ok() ? std::move(loaded).value() : nullptr;
}

std::unique_ptr<tokenizer::HfTokenizer> QwenTokenizer() {
  return TinyTokenizer("tiny_bytelevel.json",
                       {"<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                        "</tool_call>", "<tool_response>", "</tool_response>", "<|endoftext|>"},
                       "", "<|im_end|>");
}

std::unique_ptr<tokenizer::HfTokenizer> LlamaTokenizer() {
  return TinyTokenizer("tiny_llama3.json",
                       {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"},
                       "<|begin_of_text|>", "<|eot_id|>");
}

const std::string kQwen3 = ReadFile(kSourceDir + "/tests/tokenizer/templates/qwen3.jinja");
const std::string kLlama31 = ReadFile(kSourceDir + "/tests/tokenizer/templates/llama31.jinja");
// Qwen-style, with transformers' generation blocks around each assistant turn's content and
// end token (as SmolLM3's and OLMo's templates have them).
const std::string kGenerationTemplate =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}"
    "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

const ordered_json kTools = ordered_json::parse(R"([{"type": "function", "function": {
  "name": "add", "description": "Adds two numbers.", "parameters": {"type": "object",
  "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}])");

ordered_json Msg(const std::string& role, const std::string& content) {
  return {{"role", role}, {"content", content}};
}

ordered_json ToolCall(const std::string& id, const std::string& name, ordered_json arguments) {
  return {{"role", "assistant"}, {"content", ""},
          {"tool_calls", {{{"id", id}, {"type", "function"},
                           {"function", {{"name", name}, {"arguments", arguments}}}}}}};
}

struct Conversation {
  std::string name;
  ordered_json messages;
  std::vector<bool> trained;
  ordered_json tools;
  ordered_json extra = ordered_json::object();
};

std::vector<Conversation> Conversations(bool llama) {
  ordered_json extra = llama ? ordered_json{{"date_string", "26 Jul 2024"}} : ordered_json::object();
  std::vector<Conversation> out = {
      {"Single", {Msg("system", "Be brief."), Msg("user", "Hi there"), Msg("assistant", "Hello there.")},
       {false, false, true}, nullptr, extra},
      {"MultiTurn", {Msg("user", "2+2?"), Msg("assistant", "4"), Msg("user", "and 3+3?"), Msg("assistant", "6")},
       {false, true, false, true}, nullptr, extra},
      {"WeightZero", {Msg("user", "2+2?"), Msg("assistant", "5"), Msg("user", "sure?"), Msg("assistant", "4")},
       {false, false, false, true}, nullptr, extra},
      {"Unicode", {Msg("user", "café?"), Msg("assistant", "Oui: café 日本 😀")}, {false, true}, nullptr, extra},
      {"Tools", {Msg("user", "What is 2+3?"), ToolCall("c1", "add", {{"a", 2}, {"b", 3}}),
                 {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "5"}}, Msg("assistant", "It is 5.")},
       {false, true, false, true}, kTools, extra},
  };
  if (!llama) {
    out.push_back({"Think", {Msg("user", "2+2?"), Msg("assistant", "<think>\nadd them\n</think>\n\n4")},
                   {false, true}, nullptr, extra});
    out.push_back({"ThinkMultiTurn", {Msg("user", "2+2?"), Msg("assistant", "<think>\nadd\n</think>\n\n4"),
                                      Msg("user", "3+3?"), Msg("assistant", "<think>\nadd again\n</think>\n\n6")},
                   {false, true, false, true}, nullptr, extra});
    out.push_back({"ThinkingOff", {Msg("user", "2+2?"), Msg("assistant", "4")}, {false, true}, nullptr,
                   {{"enable_thinking", false}}});
  }
  return out;
}

// Runs the jinja2 reference once over `cases`; nullopt when jinja2 is missing (exit 77).
std::optional<ordered_json> Reference(const ordered_json& cases, std::string* why) {
  char in_path[] = "/tmp/render_spans_in_XXXXXX";
  int fd = mkstemp(in_path);
  if (fd < 0) return std::nullopt;
  std::string body = cases.dump();
  if (write(fd, body.data(), body.size()) != static_cast<ssize_t>(body.size())) return std::nullopt;
  close(fd);
  std::string command = "/usr/bin/python3 " + kSourceDir + "/tests/data/render_spans.py < " + in_path;
  FILE* pipe = popen(command.c_str(), "r");
  std::string out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) out.append(buffer, n);
  int status = pclose(pipe);
  std::remove(in_path);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    *why = "jinja2 is not installed";
    return std::nullopt;
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "reference failed: " << out;
  return ordered_json::parse(out, nullptr, false);
}

ordered_json ReferenceCase(const std::string& source, const Conversation& c,
                           const tokenizer::HfTokenizer& tok, const ChatRenderer& renderer) {
  ordered_json j = {{"template", source}, {"messages", c.messages}, {"trained", c.trained},
                    {"extra", c.extra}, {"bos_token", tok.bos_token()}, {"eos_token", tok.eos_token()},
                    {"end_of_turn", renderer.end_of_turn()}};
  if (!c.tools.is_null()) j["tools"] = c.tools;
  return j;
}

// The bytes of the trained tokens, run by run: a run of consecutive trained tokens decodes
// to one string.
std::vector<std::string> TrainedRuns(const tokenizer::HfTokenizer& tok, const TokenizedSequence& s) {
  std::vector<std::string> runs;
  std::vector<int32_t> run;
  for (size_t i = 0; i <= s.ids.size(); ++i) {
    if (i < s.ids.size() && s.loss_mask[i]) {
      run.push_back(s.ids[i]);
    } else if (!run.empty()) {
      runs.push_back(*tok.Decode(run, /*skip_special_tokens=*/false));
      run.clear();
    }
  }
  return runs;
}

struct Suite {
  std::string template_name;
  std::string source;
  bool llama;
};

class MasksMatchReference : public ::testing::TestWithParam<Suite> {};

TEST_P(MasksMatchReference, SpansAndTokens) {
  const Suite& suite = GetParam();
  auto tok = suite.llama ? LlamaTokenizer() : QwenTokenizer();
  ASSERT_NE(tok, nullptr);
  auto parsed = tokenizer::ChatTemplate::Parse(suite.source);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  std::vector<Conversation> conversations = Conversations(suite.llama);
  std::vector<ChatRenderer> renderers;
  ordered_json cases = ordered_json::array();
  for (const Conversation& c : conversations) {
    auto renderer = ChatRenderer::Create(tok.get(), *parsed, {.extra_context = c.extra});
    ASSERT_TRUE(renderer.ok()) << renderer.status().ToString();
    cases.push_back(ReferenceCase(suite.source, c, *tok, *renderer));
    renderers.push_back(std::move(renderer).value());
  }
  std::string why;
  std::optional<ordered_json> reference = Reference(cases, &why);
  if (!reference) GTEST_SKIP() << why;
  ASSERT_TRUE(reference->is_array() && reference->size() == conversations.size());
  for (size_t k = 0; k < conversations.size(); ++k) {
    const Conversation& c = conversations[k];
    SCOPED_TRACE(c.name);
    const ordered_json& want = (*reference)[k];
    ASSERT_FALSE(want.contains("error")) << want.dump();
    auto got = renderers[k].TrainedSpans(c.messages, c.trained, c.tools);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(SpanMethodName(got->first), want["method"].get<std::string>());
    ASSERT_EQ(got->second.size(), want["sequences"].size());
    for (size_t s = 0; s < got->second.size(); ++s) {
      const TextSpans& spans = got->second[s];
      EXPECT_EQ(spans.text, want["sequences"][s]["text"].get<std::string>());
      ordered_json got_spans = ordered_json::array();
      for (auto [b, e] : spans.spans) got_spans.push_back({b, e});
      EXPECT_EQ(got_spans, want["sequences"][s]["spans"]);
      // Tokens: the trained ones decode to exactly the spans' text, nothing straddles.
      auto tokens = renderers[k].Tokenize(spans);
      ASSERT_TRUE(tokens.ok()) << tokens.status().ToString();
      EXPECT_EQ(tokens->straddling_tokens, 0);
      std::vector<std::string> runs = TrainedRuns(*tok, *tokens), expected;
      for (auto [b, e] : spans.spans) expected.push_back(spans.text.substr(b, e - b));
      EXPECT_EQ(runs, expected);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Templates, MasksMatchReference,
                         ::testing::Values(Suite{"qwen3", kQwen3, false},
                                           Suite{"llama31", kLlama31, true},
                                           Suite{"generation", kGenerationTemplate, false}),
                         [](const auto& info) { return info.param.template_name; });

// The trained text of each sequence of `example` rendered by `renderer`, run by run.
std::vector<std::vector<std::string>> Trained(const tokenizer::HfTokenizer& tok,
                                              const ChatRenderer& renderer, const Example& example,
                                              SpanMethod* method = nullptr) {
  auto rendered = renderer.RenderSft(example);
  EXPECT_TRUE(rendered.ok()) << rendered.status().ToString();
  std::vector<std::vector<std::string>> out;
  if (!rendered.ok()) return out;
  if (method != nullptr) *method = rendered->method;
  for (const TokenizedSequence& s : rendered->sequences) out.push_back(TrainedRuns(tok, s));
  return out;
}

Example SftExample(const Conversation& c) {
  Example e;
  e.messages = c.messages;
  e.trained = c.trained;
  e.tools = c.tools;
  return e;
}

using Runs = std::vector<std::vector<std::string>>;

// The literal text each template must train, written out by hand.
TEST(RenderTest, Qwen3TrainsContentThinkAndEndToken) {
  auto tok = QwenTokenizer();
  auto renderer = ChatRenderer::Create(tok.get(), *tokenizer::ChatTemplate::Parse(kQwen3));
  ASSERT_TRUE(renderer.ok());
  std::vector<Conversation> cs = Conversations(false);
  SpanMethod method;
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[0]), &method),
            Runs{{"<think>\n\n</think>\n\nHello there.<|im_end|>"}});
  EXPECT_EQ(method, SpanMethod::kPrefixes);
  // Multi-turn: Qwen3 drops an earlier turn's think block once a user turn follows, so each
  // turn is its own sequence, as the model saw it when it answered.
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[1]), &method),
            (Runs{{"<think>\n\n</think>\n\n4<|im_end|>"}, {"<think>\n\n</think>\n\n6<|im_end|>"}}));
  EXPECT_EQ(method, SpanMethod::kPerTurn);
  // Weight 0: the wrong answer is not trained.
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[2])), Runs{{"<think>\n\n</think>\n\n4<|im_end|>"}});
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[4])),
            (Runs{{"<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": "
                   "3}}\n</tool_call><|im_end|>"},
                  {"<think>\n\n</think>\n\nIt is 5.<|im_end|>"}}));
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[5])), Runs{{"<think>\nadd them\n</think>\n\n4<|im_end|>"}});
}

TEST(RenderTest, Llama31TrainsContentAndEotOnly) {
  auto tok = LlamaTokenizer();
  auto renderer = ChatRenderer::Create(tok.get(), *tokenizer::ChatTemplate::Parse(kLlama31),
                                       {.extra_context = {{"date_string", "26 Jul 2024"}}});
  ASSERT_TRUE(renderer.ok());
  std::vector<Conversation> cs = Conversations(true);
  SpanMethod method;
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[1]), &method), (Runs{{"4<|eot_id|>", "6<|eot_id|>"}}));
  EXPECT_EQ(method, SpanMethod::kPrefixes);
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[2])), Runs{{"4<|eot_id|>"}});
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[4])),
            (Runs{{"{\"name\": \"add\", \"parameters\": {\"a\": 2, \"b\": 3}}<|eot_id|>",
                   "It is 5.<|eot_id|>"}}));
}

TEST(RenderTest, GenerationBlocksHonourWeightZero) {
  auto tok = QwenTokenizer();
  auto renderer = ChatRenderer::Create(tok.get(), *tokenizer::ChatTemplate::Parse(kGenerationTemplate));
  ASSERT_TRUE(renderer.ok());
  std::vector<Conversation> cs = Conversations(false);
  SpanMethod method;
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[1]), &method), (Runs{{"4<|im_end|>", "6<|im_end|>"}}));
  EXPECT_EQ(method, SpanMethod::kGenerationBlocks);
  EXPECT_EQ(Trained(*tok, *renderer, SftExample(cs[2])), Runs{{"4<|im_end|>"}});
}

TEST(RenderTest, DpoMasksEachCompletion) {
  auto tok = QwenTokenizer();
  auto renderer = ChatRenderer::Create(tok.get(), *tokenizer::ChatTemplate::Parse(kQwen3));
  ASSERT_TRUE(renderer.ok());
  Example e;
  e.messages = {Msg("user", "Say hi")};
  e.trained = {false};
  e.chosen = {Msg("assistant", "Hello!")};
  e.rejected = {Msg("assistant", "No.")};
  auto dpo = renderer->RenderDpo(e);
  ASSERT_TRUE(dpo.ok()) << dpo.status().ToString();
  EXPECT_EQ(TrainedRuns(*tok, dpo->chosen), std::vector<std::string>{"<think>\n\n</think>\n\nHello!<|im_end|>"});
  EXPECT_EQ(TrainedRuns(*tok, dpo->rejected), std::vector<std::string>{"<think>\n\n</think>\n\nNo.<|im_end|>"});
  auto prompt = renderer->RenderPrompt(e);
  ASSERT_TRUE(prompt.ok());
  EXPECT_EQ(prompt->text, "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(dpo->prompt_tokens, static_cast<int64_t>(prompt->ids.size()));
  std::vector<int32_t> head(dpo->chosen.ids.begin(), dpo->chosen.ids.begin() + dpo->prompt_tokens);
  EXPECT_EQ(head, prompt->ids);
}

TEST(RenderTest, TooLongIsDroppedWholeAndCounted) {
  auto tok = QwenTokenizer();
  auto unbounded = ChatRenderer::Create(tok.get(), *tokenizer::ChatTemplate::Parse(kQwen3));
  Example e = SftExample(Conversations(false)[0]);
  auto full = unbounded->RenderSft(e);
  ASSERT_TRUE(full.ok());
  int64_t n = static_cast<int64_t>(full->sequences[0].ids.size());
  auto exact = ChatRenderer::Create(tok.get(), *tokenizer::ChatTemplate::Parse(kQwen3), {.max_tokens = n});
  EXPECT_TRUE(exact->RenderSft(e).ok());
  auto tight = ChatRenderer::Create(tok.get(), *tokenizer::ChatTemplate::Parse(kQwen3), {.max_tokens = n - 1});
  auto dropped = tight->RenderSft(e);
  ASSERT_FALSE(dropped.ok());
  EXPECT_EQ(dropped.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(dropped.status().message(),
            std::to_string(n) + " tokens, over max_tokens " + std::to_string(n - 1));
  RenderTally tally;
  e.source = {"d.jsonl", 4, 0};
  tally.Record(e.source, dropped.status());
  tally.Record(e.source, Status::Ok());
  EXPECT_EQ(tally.too_long, 1);
  EXPECT_EQ(tally.rendered, 1);
  EXPECT_EQ(tally.problems.at(0), "d.jsonl:4: " + dropped.status().message());
  // A prompt that fills the context leaves no room to answer.
  auto prompt = unbounded->RenderPrompt(e);
  auto no_room = ChatRenderer::Create(tok.get(), *tokenizer::ChatTemplate::Parse(kQwen3),
                                      {.max_tokens = static_cast<int64_t>(prompt->ids.size())});
  EXPECT_EQ(no_room->RenderPrompt(e).status().code(), StatusCode::kResourceExhausted);
}

// BPE merges markup with content ("Xi" + "ng" -> "X", "ing"): the straddling token is
// trained whole and counted.
TEST(RenderTest, StraddlingTokenIsTrainedAndCounted) {
  auto tok = QwenTokenizer();
  auto tmpl = tokenizer::ChatTemplate::Parse(
      "{% for m in messages %}{% if m.role == 'assistant' %}Xi{% generation %}{{ m.content }}"
      "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}");
  ASSERT_TRUE(tmpl.ok());
  auto renderer = ChatRenderer::Create(tok.get(), *tmpl);
  Example e = SftExample({"", {Msg("user", "q "), Msg("assistant", "ng")}, {false, true}, nullptr});
  auto rendered = renderer->RenderSft(e);
  ASSERT_TRUE(rendered.ok()) << rendered.status().ToString();
  const TokenizedSequence& s = rendered->sequences[0];
  EXPECT_EQ(s.straddling_tokens, 1);
  EXPECT_EQ(TrainedRuns(*tok, s), std::vector<std::string>{"ing"});
}

TEST(RenderTest, UnplaceableSpansAndTemplateErrorsAreNamed) {
  auto tok = QwenTokenizer();
  auto renderer = ChatRenderer::Create(tok.get(), *tokenizer::ChatTemplate::Parse(kQwen3));
  // NFC changes the text: the tokens cannot be mapped back onto the rendered bytes.
  Example decomposed = SftExample({"", {Msg("user", "x"), Msg("assistant", "cafe\xcc\x81")}, {false, true}, nullptr});
  auto mismatch = renderer->RenderSft(decomposed);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_EQ(mismatch.status().code(), StatusCode::kMismatch);
  EXPECT_NE(mismatch.status().message().find("byte for byte"), std::string::npos);
  // Llama 3.1 refuses two tool calls in one turn: the template's own message comes through.
  auto llama = LlamaTokenizer();
  auto llama_renderer = ChatRenderer::Create(llama.get(), *tokenizer::ChatTemplate::Parse(kLlama31));
  ordered_json two = ToolCall("a", "add", {{"a", 1}, {"b", 2}});
  two["tool_calls"].push_back(two["tool_calls"][0]);
  auto refused = llama_renderer->RenderSft(SftExample({"", {Msg("user", "x"), two}, {false, true}, nullptr}));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("chat template cannot render the line"), std::string::npos);
  EXPECT_NE(refused.status().message().find("only supports single tool-calls"), std::string::npos);
  // No chat_template in the tokenizer's config.
  EXPECT_FALSE(ChatRenderer::Create(tok.get()).ok());
}

}  // namespace
}  // namespace flywheel::data
