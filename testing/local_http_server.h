// An HttpServer on 127.0.0.1 (any free port) with an io thread of its own: how a test or a
// benchmark serves, inside its own process, what a flywheel process would serve over HTTP
// (the training service, a coordinator). `configure` registers the routes on the io thread
// before Start returns. Stop() stops the server and leaves the io thread running (for
// owners whose handlers must go before the thread does); the destructor stops and joins.
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <thread>

#include "transport/http.h"

namespace flywheel::testing {

class LocalHttpServer {
 public:
  static Result<std::unique_ptr<LocalHttpServer>> Start(
      std::function<void(transport::HttpServer&)> configure,
      transport::HttpServerOptions options = {}) {
    auto self = std::unique_ptr<LocalHttpServer>(new LocalHttpServer());
    LocalHttpServer* raw = self.get();
    std::promise<Status> started;
    transport::asio::post(raw->io_, [raw, &configure, &options, &started] {
      auto server = transport::HttpServer::Start(
          raw->io_.get_executor(), transport::Endpoint{"127.0.0.1", 0}, std::move(options));
      if (!server.ok()) return started.set_value(server.status());
      raw->http_ = std::move(*server);
      configure(*raw->http_);
      started.set_value(Status::Ok());
    });
    raw->thread_ = std::thread([raw] { raw->io_.run(); });
    FW_RETURN_IF_ERROR(started.get_future().get());
    return self;
  }
  LocalHttpServer(const LocalHttpServer&) = delete;
  LocalHttpServer& operator=(const LocalHttpServer&) = delete;
  ~LocalHttpServer() {
    Stop();
    work_.reset();
    io_.stop();
    if (thread_.joinable()) thread_.join();
  }

  // Stops accepting and closes the server's connections (on the io thread); idempotent.
  void Stop() {
    std::promise<void> stopped;
    transport::asio::post(io_, [this, &stopped] {
      if (http_) http_->Stop();
      stopped.set_value();
    });
    stopped.get_future().wait();
  }
  transport::Endpoint endpoint() const { return {"127.0.0.1", http_->port()}; }

 private:
  LocalHttpServer() = default;
  transport::asio::io_context io_{1};
  transport::asio::executor_work_guard<transport::asio::io_context::executor_type> work_ =
      transport::asio::make_work_guard(io_);
  std::unique_ptr<transport::HttpServer> http_;
  std::thread thread_;
};

}  // namespace flywheel::testing
