// An in-process upstream serving catalogs no publisher would send, and one worker below it
// (tests/sync/fleet_test.cc CraftedUpstreamTest, tests/sync/keyframe_stream_test.cc
// JoinTest): CraftedSource serves whatever artifacts the test made, CraftedUpstreamFixture
// starts a sync::Server over it and a sync::Worker dialling it (through whatever
// UpstreamPort puts between), announces catalogs, waits on the worker's status and
// watches every version the worker serves against the hashes the test allows.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/hash.h"
#include "ops/process.h"
#include "sync/server.h"
#include "sync/worker.h"

namespace flywheel::sync::crafted {

// Runs `fn` on `io`'s thread and waits for it.
inline void RunOnIo(asio::io_context& io, const std::function<void()>& fn) {
  std::promise<void> done;
  asio::post(io.get_executor(), [&] {
    fn();
    done.set_value();
  });
  done.get_future().get();
}

// Serves artifacts the test made, whatever their catalog entries claim. Thread-safe.
class CraftedSource : public PieceSource {
 public:
  void Put(const ArtifactInfo& info, std::vector<std::byte> bytes) {
    std::lock_guard lock(mutex_);
    artifacts_[KeyOf(info)] = {info,
                               std::make_shared<const std::vector<std::byte>>(std::move(bytes))};
  }

  // Requests for an artifact not Put are answered only after 5 s (NotFound), so that a
  // downloader keeps what it set aside for it meanwhile.
  void HoldMissing() { hold_missing_ = true; }

  awaitable<Result<Piece>> GetPiece(const ArtifactKey& key, uint32_t index) override {
    std::shared_ptr<const std::vector<std::byte>> bytes;
    uint64_t piece_bytes = 0;
    {
      std::lock_guard lock(mutex_);
      auto it = artifacts_.find(key);
      if (it != artifacts_.end()) {
        bytes = it->second.bytes;
        piece_bytes = it->second.info.piece_bytes;
      }
    }
    if (!bytes) {
      if (hold_missing_) co_await transport::SleepFor(std::chrono::seconds(5));
      co_return Status::NotFound("no " + Describe(key));
    }
    const uint64_t begin = static_cast<uint64_t>(index) * piece_bytes;
    if (begin >= bytes->size()) co_return Status::NotFound(Describe(key) + " has no such piece");
    const uint64_t end = std::min<uint64_t>(bytes->size(), begin + piece_bytes);
    Piece piece{bytes, std::span<const std::byte>(*bytes).subspan(begin, end - begin)};
    co_return piece;
  }

 private:
  struct Stored {
    ArtifactInfo info;
    std::shared_ptr<const std::vector<std::byte>> bytes;
  };
  std::mutex mutex_;
  std::map<ArtifactKey, Stored> artifacts_;
  std::atomic<bool> hold_missing_{false};
};

class CraftedUpstreamFixture : public ::testing::Test {
 protected:
  using json = nlohmann::json;
  static constexpr auto kCraftedWait = std::chrono::milliseconds(20000);

  // A derived fixture's chance to change the server and the worker before they start.
  virtual void Configure(ServerOptions& /*server*/, WorkerOptions& /*worker*/) {}
  // The port the worker dials, given the server's (on the io thread; a derived fixture may
  // put a proxy between them).
  virtual uint16_t UpstreamPort(uint16_t server_port) { return server_port; }
  // How a failed wait prints the worker's last status.
  virtual std::string Summary(const json& status) { return status.dump(1); }

  void SetUp() override { StartRoles(); }

  // Starts the io thread, the server over source_ and the worker dialling it.
  void StartRoles() {
    using namespace std::chrono_literals;
    io_ = std::make_unique<asio::io_context>(1);
    work_.emplace(asio::make_work_guard(*io_));
    io_thread_ = std::thread([this] { io_->run(); });
    transport::ConnectionOptions connection;
    connection.heartbeat = 100ms;
    connection.idle_timeout = 1000ms;
    connection.io_timeout = 2000ms;
    ServerOptions server_options;
    server_options.listen = {"127.0.0.1", 0};
    server_options.identity = {wire::PUBLISHER, "home", "crafted-publisher"};
    server_options.listener.connection = connection;
    WorkerOptions worker_options;
    worker_options.common.region = "home";
    worker_options.common.node_id = "worker";
    worker_options.common.http = {"127.0.0.1", 0};
    worker_options.common.connection = connection;
    Configure(server_options, worker_options);
    if (HasFatalFailure()) return;
    Status started = Status::Ok();
    OnIo([&] {
      Result<std::unique_ptr<Server>> server =
          Server::Start(io_->get_executor(), server_options, &source_, &links_);
      if (!server.ok()) {
        started = server.status();
        return;
      }
      server_ = std::move(*server);
      worker_options.upstreams = {{"127.0.0.1", UpstreamPort(server_->port())}};
      Result<std::unique_ptr<Worker>> worker = Worker::Start(io_->get_executor(), worker_options);
      if (!worker.ok()) {
        started = worker.status();
        return;
      }
      worker_ = std::move(*worker);
    });
    ASSERT_TRUE(started.ok()) << started.ToString();
  }

  void TearDown() override {
    StopWatching();
    if (!io_) return;
    if (worker_) worker_->Stop();
    OnIo([&] {
      if (server_) server_->Stop();
    });
    // The posted stops close every connection. Once the io_context runs out of work it has;
    // it often keeps a timer longer than that, so it is stopped after at most 100 ms anyway.
    work_.reset();
    (void)ops::WaitUntil([&] { return io_->stopped(); }, std::chrono::milliseconds(100),
                         "the io_context to run out of work");
    io_->stop();
    io_thread_.join();
    // As in `flywheel worker`: the roles go first, then the io_context.
    worker_.reset();
    server_.reset();
    io_.reset();
  }

  // Runs `fn` on the io thread and waits for it.
  void OnIo(const std::function<void()>& fn) { RunOnIo(*io_, fn); }

  void Announce(std::vector<ArtifactInfo> artifacts, uint64_t head_version, Hash128 head_hash,
                std::map<ArtifactKey, SignedManifest> signatures = {}) {
    Catalog catalog;
    catalog.signatures = std::move(signatures);
    catalog.artifacts = std::move(artifacts);
    catalog.head_version = head_version;
    catalog.head_hash = head_hash;
    wire::Catalog on_wire = ToWire(catalog);
    OnIo([&] { server_->SetCatalog(on_wire); });
  }

  json WorkerStatus() {
    json status;
    OnIo([&] { status = worker_->StatusJson(); });
    return status;
  }

  bool WaitWorker(const std::string& what, const std::function<bool(const json&)>& holds) {
    json last;
    const Status waited = ops::WaitUntil(
        [&] {
          last = WorkerStatus();
          return holds(last);
        },
        kCraftedWait, "worker " + what, std::chrono::milliseconds(20));
    if (waited.ok()) return true;
    ADD_FAILURE() << waited.ToString() << "; last status:\n" << Summary(last);
    return false;
  }

  // Watches the serving weights from another thread: whenever the worker serves version v,
  // its bytes must hash to allowed[v], and versions never go back.
  void WatchWeights(std::map<uint64_t, Hash128> allowed) {
    allowed_ = std::move(allowed);
    watching_ = true;
    watcher_ = std::thread([this] {
      uint64_t highest = 0;
      while (watching_) {
        worker_->WithWeights([&](uint64_t version, const CheckpointView& weights) {
          if (version == 0) return;
          ++samples_;
          Result<Hash128> hash = CheckpointHash(weights);
          std::lock_guard lock(violations_mutex_);
          auto it = allowed_.find(version);
          if (it == allowed_.end() || !hash.ok() || *hash != it->second) {
            violations_.push_back("served v" + std::to_string(version) +
                                  " with weights hashing to " +
                                  (hash.ok() ? hash->ToHex() : hash.status().ToString()));
          }
          if (version < highest)
            violations_.push_back("went back from v" + std::to_string(highest));
          highest = std::max(highest, version);
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // a sampler's pace
      }
    });
  }

  std::vector<std::string> StopWatching() {
    watching_ = false;
    if (watcher_.joinable()) watcher_.join();
    std::lock_guard lock(violations_mutex_);
    return violations_;
  }

  std::unique_ptr<asio::io_context> io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::thread io_thread_;
  CraftedSource source_;
  LinkRegistry links_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<Worker> worker_;

  std::map<uint64_t, Hash128> allowed_;
  std::atomic<bool> watching_{false};
  std::thread watcher_;
  std::atomic<uint64_t> samples_{0};
  std::mutex violations_mutex_;
  std::vector<std::string> violations_;
};

}  // namespace flywheel::sync::crafted
