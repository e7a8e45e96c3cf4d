// The completions API over real HTTP on loopback: text and token prompts, n samples,
// logprobs, versions and routing in the answer, the same tokens as the in-process path,
// and 4xx answers for bad requests while the worker keeps serving.
#include "rollout/openai_api.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "tests/model/tiny_models.h"
#include "tests/rollout/taught_model.h"
#include "tokenizer/chat_template.h"
#include "transport/asio.h"

namespace flywheel::rollout {
namespace {

namespace asio = boost::asio;
using nlohmann::json;

class ServingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(3);
    // A byte-level vocabulary plus room: text prompts work.
    model_ =
        std::make_shared<model::TransformerImpl>(testing::TinyConfig({.vocab = 260, .experts = 4}));
    auto engine = Engine::Create(model_, {.max_batch = 8, .max_sequence = 128}, 7);
    ASSERT_TRUE(engine.ok());
    engine_ = std::shared_ptr<Engine>(std::move(*engine));
    ServingOptions options;
    // ChatML, as Qwen writes it (without tools): enough to exercise the chat route.
    auto chat = tokenizer::ChatTemplate::Parse(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}");
    ASSERT_TRUE(chat.ok()) << chat.status().ToString();
    options.chat_template = std::make_shared<tokenizer::ChatTemplate>(std::move(*chat));
    options.model_name = "tiny";
    service_ = std::make_unique<CompletionService>(engine_, std::make_shared<model::ByteTokenizer>(),
                                                   options);
    auto server = transport::HttpServer::Start(io_.get_executor(), {"127.0.0.1", 0}, {});
    ASSERT_TRUE(server.ok());
    server_ = std::move(*server);
    service_->Register(*server_);
    thread_ = std::thread([this] { io_.run(); });
  }

  void TearDown() override {
    asio::post(io_, [this] { server_->Stop(); });
    guard_.reset();
    io_.stop();
    if (thread_.joinable()) thread_.join();
    server_.reset();
    service_.reset();
  }

  std::pair<int, json> Post(const std::string& body, const std::string& path = "/v1/completions") {
    auto response = transport::HttpPost({"127.0.0.1", server_->port()}, path, body,
                                        {.timeout = std::chrono::seconds(60)});
    EXPECT_TRUE(response.ok()) << response.status().ToString();
    if (!response.ok()) return {0, json()};
    return {response->status, json::parse(response->body, nullptr, false)};
  }

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> guard_ = asio::make_work_guard(io_);
  std::thread thread_;
  std::shared_ptr<model::TransformerImpl> model_;
  std::shared_ptr<Engine> engine_;
  std::unique_ptr<CompletionService> service_;
  std::unique_ptr<transport::HttpServer> server_;
};

TEST_F(ServingTest, CompletionsOverHttpMatchTheInProcessPath) {
  auto [status, answer] =
      Post(R"({"prompt": "12+30=", "max_tokens": 6, "temperature": 1.0, "seed": 9,
                                   "n": 2, "logprobs": true, "return_routing": true})");
  ASSERT_EQ(status, 200) << answer.dump();
  ASSERT_EQ(answer["choices"].size(), 2u);
  EXPECT_EQ(answer["usage"]["prompt_tokens"], 6);
  EXPECT_EQ(answer["usage"]["completion_tokens"], 12);
  const json& first = answer["choices"][0];
  ASSERT_EQ(first["token_ids"].size(), 6u);
  EXPECT_EQ(first["logprobs"]["token_logprobs"].size(), 6u);
  EXPECT_EQ(first["policy_versions"], json::array({7, 7, 7, 7, 7, 7}));
  EXPECT_EQ(first["routing_shape"], json::array({11, 2, 2}));
  EXPECT_EQ(first["routing"].size(), 11u * 2 * 2);

  // The same request in-process: the same tokens (seed 9 for the first sample).
  GenerationRequest request;
  request.prompt = {'1', '2', '+', '3', '0', '='};
  request.params.max_tokens = 6;
  request.params.seed = 9;
  auto local = service_->Generate({request});
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(first["token_ids"].get<std::vector<int32_t>>(), (*local)[0].tokens);

  // Token-id prompts work too.
  auto [ids_status, ids_answer] =
      Post(R"({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})");
  ASSERT_EQ(ids_status, 200) << ids_answer.dump();
  EXPECT_EQ(ids_answer["choices"][0]["token_ids"].size(), 3u);
}

TEST_F(ServingTest, BadRequestsAre4xxAndTheWorkerKeepsServing) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "not valid JSON"},
      {R"({"max_tokens": 4})", "'prompt' is required"},
      {R"({"prompt": "hi", "max_tokens": 200})", "context (max_model_len) is 128 tokens"},
      {R"({"prompt": "hi", "temperature": -1})", "temperature"},
      {R"({"prompt": "hi", "top_p": 0})", "top_p"},
      {R"({"prompt": "hi", "n": 99})", "'n' must be in [1, 16]"},
      {R"({"prompt": "hi", "max_tokens": "many"})", "'max_tokens' has the wrong type"},
      {R"({"prompt": [1, 999]})", "outside the vocabulary"},
      {R"({"prompt": "hi", "logprobs": 21})", "top_logprobs must be in [0, 20]"},
      {R"({"prompt": "hi", "max_tokens": 9223372036854775800})", "context (max_model_len) is 128 tokens"},
      {R"({"prompt": "hi", "stop": [99999]})", "stop token 99999 is outside the vocabulary"},
      {R"({"prompt": "hi", "stop": [""]})", "'stop' entries must be non-empty strings"},
      {R"({"prompt": [], "max_tokens": 2})", "non-empty array of token ids"},
      {R"({"prompt": "hi", "guided_regex": "(a"})", "'guided_regex': regex: ')' expected"},
      {R"({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema":
          {"type": "integer", "minimum": 1}}}})", "'response_format': 'minimum' at $ is not supported"},
      {R"({"prompt": "hi", "guided_choice": []})", "'guided_choice' must be a non-empty list"},
  };
  for (const auto& [body, needle] : cases) {
    auto [status, answer] = Post(body);
    EXPECT_EQ(status, 400) << body;
    EXPECT_NE(answer.dump().find(needle), std::string::npos) << body << " -> " << answer.dump();
  }
  auto [missing, missing_answer] = Post(R"({"prompt": "hi", "adapter": "nope"})");
  EXPECT_EQ(missing, 404);
  EXPECT_NE(missing_answer.dump().find("unknown adapter 'nope'"), std::string::npos);
  // A model name that is neither the served one nor an adapter is a 404, not the base model.
  auto [other_model, other_answer] = Post(R"({"prompt": "hi", "model": "gpt-4o"})");
  EXPECT_EQ(other_model, 404) << other_answer.dump();
  EXPECT_NE(other_answer.dump().find("'gpt-4o'"), std::string::npos);
  auto [named, named_answer] = Post(R"({"prompt": "hi", "model": "tiny", "max_tokens": 2})");
  EXPECT_EQ(named, 200) << named_answer.dump();
  auto [ok, answer] = Post(R"({"prompt": "hi", "max_tokens": 2})");
  EXPECT_EQ(ok, 200) << answer.dump();
}

// The request that killed a worker with a segmentation fault: `temperature` as 100,000
// nested arrays in a 200 KB body (and a million in 2 MB, under the 4 MiB body limit), on every
// JSON route. Each is a 400 naming the nesting, and the worker keeps serving.
TEST_F(ServingTest, DeeplyNestedJsonIsRefusedOnEveryRouteAndTheWorkerKeepsServing) {
  for (int depth : {100000, 1000000}) {
    const std::string deep = std::string(depth, '[') + std::string(depth, ']');
    for (const char* path : {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}) {
      auto [status, answer] = Post(R"({"prompt": "hi", "temperature": )" + deep + "}", path);
      EXPECT_EQ(status, 400) << path;
      EXPECT_NE(answer.dump().find("nested deeper than 64 levels"), std::string::npos)
          << path << " -> " << answer.dump();
    }
  }
  auto [ok, answer] = Post(R"({"prompt": "hi", "max_tokens": 2})");
  EXPECT_EQ(ok, 200) << answer.dump();
}

// The events of a streamed answer: every `data:` payload, [DONE] included as a string.
struct Streamed {
  std::vector<json> chunks;
  bool done = false;
  std::string content_type;
  double first_chunk_s = 0, total_s = 0;
};

Streamed Stream(uint16_t port, const std::string& path, const std::string& body,
                size_t leave_after_chunks = SIZE_MAX) {
  Streamed out;
  std::string buffer;
  const auto start = std::chrono::steady_clock::now();
  auto response = transport::HttpPostStream(
      {"127.0.0.1", port}, path, body, {.timeout = std::chrono::seconds(60)},
      [&](std::string_view data) {
        buffer.append(data);
        for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
          std::string event = buffer.substr(0, end);
          buffer.erase(0, end + 2);
          EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
          const std::string payload = event.substr(6);
          if (out.chunks.empty() && !out.done) {
            out.first_chunk_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          }
          if (payload == "[DONE]") {
            out.done = true;
          } else {
            out.chunks.push_back(json::parse(payload));
          }
        }
        return out.chunks.size() < leave_after_chunks;
      });
  out.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (leave_after_chunks == SIZE_MAX) {
    EXPECT_TRUE(response.ok()) << response.status().ToString();
    if (response.ok()) {
      EXPECT_EQ(response->status, 200);
      out.content_type = response->content_type;
    }
  }
  return out;
}

TEST_F(ServingTest, StreamedCompletionsAddUpToTheWholeAnswer) {
  const std::string request =
      R"({"prompt": "12+30=", "max_tokens": 20, "temperature": 1.0, "seed": 5, "n": 2,
          "logprobs": 3, "ignore_eos": true)";
  auto [status, whole] = Post(request + "}");
  ASSERT_EQ(status, 200) << whole.dump();
  Streamed streamed = Stream(server_->port(), "/v1/completions",
                             request + R"(, "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(streamed.done);
  EXPECT_EQ(streamed.content_type, "text/event-stream");
  std::vector<std::string> text(2);
  std::vector<std::vector<int32_t>> ids(2);
  std::vector<std::vector<double>> logprobs(2);
  std::vector<std::string> finish(2);
  json usage;
  for (const json& chunk : streamed.chunks) {
    EXPECT_EQ(chunk["object"], "text_completion");
    if (chunk.contains("usage")) {
      EXPECT_TRUE(chunk["choices"].empty());
      usage = chunk["usage"];
      continue;
    }
    ASSERT_EQ(chunk["choices"].size(), 1u);
    const json& c = chunk["choices"][0];
    const size_t i = c["index"].get<size_t>();
    text[i] += c["text"].get<std::string>();
    for (const json& t : c["token_ids"]) ids[i].push_back(t.get<int32_t>());
    for (const json& l : c["logprobs"]["token_logprobs"]) logprobs[i].push_back(l.get<double>());
    EXPECT_EQ(c["logprobs"]["tokens"].size(), c["token_ids"].size());
    if (!c["finish_reason"].is_null()) finish[i] = c["finish_reason"];
  }
  for (size_t i = 0; i < 2; ++i) {
    const json& c = whole["choices"][i];
    EXPECT_EQ(text[i], c["text"].get<std::string>()) << i;
    EXPECT_EQ(ids[i], c["token_ids"].get<std::vector<int32_t>>()) << i;
    EXPECT_EQ(logprobs[i], c["logprobs"]["token_logprobs"].get<std::vector<double>>()) << i;
    EXPECT_EQ(finish[i], c["finish_reason"]);
    // The legacy top_logprobs: k entries per token, the most likely first.
    ASSERT_EQ(c["logprobs"]["top_logprobs"].size(), c["token_ids"].size());
    EXPECT_LE(c["logprobs"]["top_logprobs"][0].size(), 3u);
    EXPECT_GE(c["logprobs"]["top_logprobs"][0].size(), 1u);
  }
  EXPECT_EQ(usage, whole["usage"]);
  // Several chunks: tokens arrive as they are generated, not all at the end.
  EXPECT_GE(streamed.chunks.size(), 10u);
}

TEST_F(ServingTest, ChatStreamsAndMatchesTheWholeAnswer) {
  const std::string request =
      R"({"model": "tiny", "messages": [{"role": "system", "content": "Add."},
          {"role": "user", "content": [{"type": "text", "text": "12+30="}]}],
          "max_completion_tokens": 12, "seed": 11, "logprobs": true, "top_logprobs": 2,
          "ignore_eos": true)";
  auto [status, whole] = Post(request + "}", "/v1/chat/completions");
  ASSERT_EQ(status, 200) << whole.dump();
  EXPECT_EQ(whole["object"], "chat.completion");
  EXPECT_EQ(whole["model"], "tiny");
  const json& choice = whole["choices"][0];
  EXPECT_EQ(choice["message"]["role"], "assistant");
  ASSERT_EQ(choice["logprobs"]["content"].size(), 12u);
  for (const json& entry : choice["logprobs"]["content"]) {
    ASSERT_EQ(entry["top_logprobs"].size(), 2u);
    EXPECT_GE(entry["top_logprobs"][0]["logprob"].get<double>(), entry["top_logprobs"][1]["logprob"].get<double>());
    EXPECT_LE(entry["logprob"].get<double>(), entry["top_logprobs"][0]["logprob"].get<double>() + 1e-6);
    EXPECT_TRUE(entry["bytes"].is_array());
  }
  // The prompt is the rendered template, tokenized.
  const std::string rendered =
      "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n";
  EXPECT_EQ(whole["usage"]["prompt_tokens"], rendered.size());
  EXPECT_EQ(whole["prompt_token_ids"].size(), rendered.size());

  Streamed streamed = Stream(server_->port(), "/v1/chat/completions", request + R"(, "stream": true})");
  ASSERT_TRUE(streamed.done);
  std::string content;
  std::vector<int32_t> ids;
  size_t logprob_entries = 0;
  ASSERT_FALSE(streamed.chunks.empty());
  EXPECT_EQ(streamed.chunks[0]["choices"][0]["delta"]["role"], "assistant");
  for (const json& chunk : streamed.chunks) {
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    EXPECT_FALSE(chunk.contains("usage"));  // not asked for
    const json& c = chunk["choices"][0];
    content += c["delta"].value("content", "");
    for (const json& t : c["token_ids"]) ids.push_back(t.get<int32_t>());
    logprob_entries += c["logprobs"]["content"].size();
  }
  EXPECT_EQ(content, choice["message"]["content"].get<std::string>());
  EXPECT_EQ(ids, choice["token_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(logprob_entries, 12u);
  EXPECT_EQ(streamed.chunks.back()["choices"][0]["finish_reason"], "length");
}

// A service on its own engine and loopback server.
struct LocalServer {
  LocalServer(std::shared_ptr<Engine> engine, std::shared_ptr<const model::Tokenizer> tokenizer)
      : service(std::move(engine), std::move(tokenizer)) {
    auto started = transport::HttpServer::Start(io.get_executor(), {"127.0.0.1", 0}, {});
    EXPECT_TRUE(started.ok());
    server = std::move(*started);
    service.Register(*server);
    thread = std::thread([this] { io.run(); });
  }
  ~LocalServer() {
    asio::post(io, [this] { server->Stop(); });
    guard.reset();
    thread.join();
  }
  std::pair<int, json> Post(const std::string& body, const std::string& path = "/v1/completions") {
    auto response = transport::HttpPost({"127.0.0.1", server->port()}, path, body,
                                        {.timeout = std::chrono::seconds(60)});
    EXPECT_TRUE(response.ok()) << response.status().ToString();
    if (!response.ok()) return {0, json()};
    return {response->status, json::parse(response->body, nullptr, false)};
  }
  CompletionService service;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> guard = asio::make_work_guard(io);
  std::unique_ptr<transport::HttpServer> server;
  std::thread thread;
};

TEST_F(ServingTest, StopStringsSpanningTokensEndTheTextBeforeThem) {
  // One printable ASCII character per token, so text and tokens line up.
  std::string alphabet;
  for (char c = ' '; c <= '~'; ++c) alphabet.push_back(c);
  auto chars = model::CharTokenizer::Create(alphabet);
  ASSERT_TRUE(chars.ok());
  std::shared_ptr<const model::Tokenizer> tokenizer(std::move(*chars));
  torch::manual_seed(21);
  auto model = std::make_shared<model::TransformerImpl>(testing::TinyConfig({.vocab = 97}));
  auto engine = Engine::Create(model, {.max_batch = 4, .max_sequence = 64}, 1);
  ASSERT_TRUE(engine.ok());
  LocalServer local(std::shared_ptr<Engine>(std::move(*engine)), tokenizer);

  // Greedy output, then the same request stopped at a string made of its tokens 3..5:
  // the text ends before the string's first match, streamed or not, and generation stops.
  const std::string base = R"({"prompt": "abc", "max_tokens": 16, "temperature": 0, "ignore_eos": true)";
  auto [status, free_run] = local.Post(base + "}");
  ASSERT_EQ(status, 200) << free_run.dump();
  const auto ids = free_run["choices"][0]["token_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(ids.size(), 16u);
  if (std::any_of(ids.begin(), ids.end(), [](int32_t t) { return t >= 95; }))
    GTEST_SKIP() << "the greedy text has a BOS/EOS id";
  const std::string text = free_run["choices"][0]["text"];
  const std::string stop = text.substr(3, 3);
  const size_t cut = text.find(stop);
  const std::string request = base + R"(, "stop": ["never matches", )" + json(stop).dump();
  auto [stopped_status, stopped] = local.Post(request + "]}");
  ASSERT_EQ(stopped_status, 200) << stopped.dump();
  EXPECT_EQ(stopped["choices"][0]["text"], text.substr(0, cut));
  EXPECT_EQ(stopped["choices"][0]["finish_reason"], "stop");
  // The tokens run up to the one that completed the match.
  EXPECT_EQ(stopped["choices"][0]["token_ids"].size(), cut + 3);
  Streamed streamed = Stream(local.server->port(), "/v1/completions", request + R"(], "stream": true})");
  ASSERT_TRUE(streamed.done);
  std::string joined;
  for (const json& chunk : streamed.chunks) joined += chunk["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(joined, text.substr(0, cut));
  EXPECT_EQ(streamed.chunks.back()["choices"][0]["finish_reason"], "stop");

  // Sampled choices that stop at different tokens: each ends on its own, the others go on.
  json stops = json::array();
  for (char c = 'a'; c <= 'z'; ++c) stops.push_back(std::string(1, c));
  for (char c = 'A'; c <= 'P'; ++c) stops.push_back(std::string(1, c));
  json sampled = {{"prompt", "abc"}, {"max_tokens", 40}, {"n", 4}, {"seed", 1}, {"ignore_eos", true}, {"stop", stops}};
  auto [n_status, n_answer] = local.Post(sampled.dump());
  ASSERT_EQ(n_status, 200) << n_answer.dump();
  std::set<size_t> lengths;
  for (const json& c : n_answer["choices"]) {
    const std::string t = c["text"];
    for (const json& stop : stops) EXPECT_EQ(t.find(stop.get<std::string>()), std::string::npos) << t;
    lengths.insert(c["token_ids"].size());
  }
  EXPECT_GT(lengths.size(), 1u) << "the choices should stop at different tokens";

  // Without a chat template, chat says so and completions go on.
  auto [chat_status, chat] = local.Post(R"({"messages": [{"role": "user", "content": "x"}]})",
                                        "/v1/chat/completions");
  EXPECT_EQ(chat_status, 400);
  EXPECT_NE(chat.dump().find("no chat template"), std::string::npos) << chat.dump();
}

TEST_F(ServingTest, AClientThatLeavesMidStreamFreesItsSlotAtOnce) {
  // One cache slot: a second request can only run once the first is gone.
  auto engine = Engine::Create(model_, {.max_batch = 1, .max_sequence = 128}, 7);
  ASSERT_TRUE(engine.ok());
  std::shared_ptr<Engine> one_slot(std::move(*engine));
  LocalServer local(one_slot, std::make_shared<model::ByteTokenizer>());
  const uint16_t port = local.server->port();

  Streamed left = Stream(port, "/v1/completions",
                         R"({"prompt": "a long one", "max_tokens": 110, "ignore_eos": true, "stream": true})", 2);
  EXPECT_FALSE(left.done);
  const auto start = std::chrono::steady_clock::now();
  auto [status, next] = local.Post(R"({"prompt": "next", "max_tokens": 2, "ignore_eos": true})");
  EXPECT_EQ(status, 200) << next.dump();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The abandoned request had ~100 tokens to go; the slot must not wait for them.
  local.Post(R"({"prompt": "a long one", "max_tokens": 100, "ignore_eos": true})");
  const double hundred =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - waited;
  EXPECT_LT(waited, hundred / 3) << "the next request waited " << waited << " s; 100 tokens take "
                                 << hundred << " s";
  EXPECT_EQ(one_slot->active(), 0u);
}

TEST_F(ServingTest, ModelsTokenizeAndDetokenize) {
  auto models = transport::HttpGet({"127.0.0.1", server_->port()}, "/v1/models");
  ASSERT_TRUE(models.ok());
  json m = json::parse(models->body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  EXPECT_EQ(m["data"][0]["max_model_len"], 128);
  auto [status, tokens] = Post(R"({"prompt": "hi!", "return_token_strs": true})", "/tokenize");
  ASSERT_EQ(status, 200) << tokens.dump();
  EXPECT_EQ(tokens["tokens"], json::array({'h', 'i', '!'}));
  EXPECT_EQ(tokens["count"], 3);
  EXPECT_EQ(tokens["token_strs"], json::array({"h", "i", "!"}));
  auto [chat_status, chat] =
      Post(R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false})", "/tokenize");
  ASSERT_EQ(chat_status, 200);
  EXPECT_EQ(chat["count"], std::string("<|im_start|>user\nx<|im_end|>\n").size());
  auto [back_status, back] = Post(R"({"tokens": [104, 105, 257]})", "/detokenize");
  ASSERT_EQ(back_status, 200);
  EXPECT_EQ(back["prompt"], "hi");
  auto [bad, bad_answer] = Post(R"({"tokens": [104, 9999]})", "/detokenize");
  EXPECT_EQ(bad, 400);
  EXPECT_NE(bad_answer.dump().find("token 9999"), std::string::npos);
}

// A tiny model taught one answer (greedy decoding then writes it) with reasoning and two
// tool calls, served with a reasoning parser: the whole answer's parts, and the streamed
// deltas (reasoning_content, content, tool_calls with their indexes) adding up to them.
TEST(ServingPartsTest, ReasoningAndToolCallsStreamedEqualTheWholeAnswer) {
  auto model = testing::TaughtModel();
  const std::string answer = testing::kTaughtAnswer;
  auto engine = Engine::Create(model, {.max_batch = 4, .max_sequence = 256}, 1);
  ASSERT_TRUE(engine.ok());
  ServingOptions options;
  auto chat = tokenizer::ChatTemplate::Parse(testing::kTaughtTemplate);
  ASSERT_TRUE(chat.ok());
  options.chat_template = std::make_shared<tokenizer::ChatTemplate>(std::move(*chat));
  options.reasoning_parser = ReasoningParser::kQwen3;
  CompletionService service(std::shared_ptr<Engine>(std::move(*engine)),
                            std::make_shared<model::ByteTokenizer>(), options);
  const std::string request =
      R"({"messages": [{"role": "user", "content": "w?"}], "temperature": 0, "ignore_eos": true,
          "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}],
          "stop": ["<|im_end|>"], "max_tokens": )" + std::to_string(answer.size() + 16);
  transport::HttpResponse whole = service.Chat(request + "}");
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json whole_answer = json::parse(whole.body);
  const json message = whole_answer["choices"][0]["message"];
  std::string text;
  for (const json& id : whole_answer["choices"][0]["token_ids"]) text += static_cast<char>(id.get<int>());
  ASSERT_EQ(text.substr(0, answer.size()), answer) << "the model did not learn the answer";
  EXPECT_EQ(message["reasoning_content"], "cold?");
  EXPECT_EQ(message["content"], "Look:");
  ASSERT_EQ(message["tool_calls"].size(), 2u);
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "w");
  EXPECT_EQ(message["tool_calls"][0]["function"]["arguments"], R"({"c":1})");
  EXPECT_EQ(message["tool_calls"][1]["function"]["name"], "t");
  EXPECT_EQ(whole_answer["choices"][0]["finish_reason"], "tool_calls");

  transport::HttpResponse streamed = service.Chat(request + R"(, "stream": true})");
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  std::string reasoning, content, finish;
  json calls = json::array();
  size_t chunks = 0;
  for (size_t at = 0, end; (end = streamed.body.find("\n\n", at)) != std::string::npos; at = end + 2) {
    const std::string event = streamed.body.substr(at, end - at);
    if (event == "data: [DONE]") break;
    const json c = json::parse(event.substr(6))["choices"][0];
    ++chunks;
    reasoning += c["delta"].value("reasoning_content", "");
    content += c["delta"].value("content", "");
    for (const json& call : c["delta"].value("tool_calls", json::array())) {
      EXPECT_EQ(call["index"], calls.size());
      EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u);
      calls.push_back(call);
    }
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
  }
  EXPECT_GT(chunks, 10u);  // streamed token by token
  EXPECT_EQ(reasoning, "cold?");
  EXPECT_EQ(content, "Look:");
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0]["function"], message["tool_calls"][0]["function"]);
  EXPECT_EQ(calls[1]["function"], message["tool_calls"][1]["function"]);
  EXPECT_EQ(finish, "tool_calls");
}

}  // namespace
}  // namespace flywheel::rollout
