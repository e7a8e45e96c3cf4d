// The completions API over real HTTP on loopback: text and token prompts, n samples,
// logprobs, versions and routing in the answer, the same tokens as the in-process path,
// and 4xx answers for bad requests while the worker keeps serving.
#include "rollout/serving.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "tests/model/tiny_models.h"
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
    auto engine = Engine::Create(model_, {.max_batch = 8, .max_sequence = 64}, 7);
    ASSERT_TRUE(engine.ok());
    engine_ = std::shared_ptr<Engine>(std::move(*engine));
    service_ = std::make_unique<CompletionService>(engine_, std::make_shared<model::ByteTokenizer>());
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

  std::pair<int, json> Post(const std::string& body) {
    auto response = transport::HttpPost({"127.0.0.1", server_->port()}, "/v1/completions", body,
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
      {"not json", "not a JSON object"},
      {R"({"max_tokens": 4})", "'prompt' is required"},
      {R"({"prompt": "hi", "max_tokens": 100})", "exceeds the engine's max_sequence"},
      {R"({"prompt": "hi", "temperature": -1})", "temperature"},
      {R"({"prompt": "hi", "top_p": 0})", "top_p"},
      {R"({"prompt": "hi", "n": 99})", "'n' must be in [1, 16]"},
      {R"({"prompt": "hi", "max_tokens": "many"})", "'max_tokens' has the wrong type"},
      {R"({"prompt": [1, 999]})", "outside the vocabulary"},
      {R"({"prompt": "hi", "stream": true})", "streaming is not supported"},
  };
  for (const auto& [body, needle] : cases) {
    auto [status, answer] = Post(body);
    EXPECT_EQ(status, 400) << body;
    EXPECT_NE(answer.dump().find(needle), std::string::npos) << body << " -> " << answer.dump();
  }
  auto [missing, missing_answer] = Post(R"({"prompt": "hi", "adapter": "nope"})");
  EXPECT_EQ(missing, 404);
  EXPECT_NE(missing_answer.dump().find("unknown adapter 'nope'"), std::string::npos);
  auto [ok, answer] = Post(R"({"prompt": "hi", "max_tokens": 2})");
  EXPECT_EQ(ok, 200) << answer.dump();
}

}  // namespace
}  // namespace flywheel::rollout
