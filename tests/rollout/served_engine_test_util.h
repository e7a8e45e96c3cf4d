// What the rollout tests that serve a WorkerEngine over HTTP share: the tiny model they
// serve, a fixture base that runs the engine's routes on a loopback server, and the greedy
// completion request they send.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "rollout/worker_engine.h"
#include "tests/model/tiny_models.h"
#include "transport/asio.h"
#include "transport/http.h"

namespace flywheel::rollout {

// The tiny model the serving tests use (60 ids: room for the chars tokenizer).
inline model::ModelConfig TinyServed() {
  return flywheel::testing::TinyConfig({.vocab = 60});
}

// A greedy request for 6 tokens of `prompt` with their logprobs, EOS ignored.
inline nlohmann::json GreedyCompletion(const std::vector<int32_t>& prompt) {
  return {{"prompt", prompt},
          {"max_tokens", 6},
          {"temperature", 0},
          {"logprobs", 1},
          {"ignore_eos", true}};
}

// A fixture base: StartServing creates the engine and serves its routes on a loopback
// HttpServer run by an io thread of its own; StopServing undoes it (safe if never started).
class ServedEngineTest : public ::testing::Test {
 protected:
  void StartServing(const WorkerEngineOptions& options) {
    auto engine = WorkerEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::move(*engine);
    auto server = transport::HttpServer::Start(io_.get_executor(), {"127.0.0.1", 0}, {});
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
    engine_->Register(*server_);
    io_thread_ = std::thread([this] { io_.run(); });
  }

  void StopServing() {
    if (server_) boost::asio::post(io_, [this] { server_->Stop(); });
    guard_.reset();
    io_.stop();
    if (io_thread_.joinable()) io_thread_.join();
    server_.reset();
    engine_.reset();
  }

  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> guard_ =
      boost::asio::make_work_guard(io_);
  std::thread io_thread_;
  std::unique_ptr<WorkerEngine> engine_;
  std::unique_ptr<transport::HttpServer> server_;
};

}  // namespace flywheel::rollout
