// The publisher's push API (docs/PUSH_API.md): resumable uploads, the version ledger,
// readiness and its long-poll, pin and unpin, as routes on the publisher's HTTP server.
// It is an extension of the publisher (sync/publisher.h: PublisherExtension), installed by
// EnablePushApi; the publisher itself knows nothing of it. (Still in namespace
// flywheel::sync, like the publisher it extends.)
//
// Routes run on the publisher's network thread; part writes go to an I/O pool and
// commits and pins (hash, validate, apply, encode) to the publisher's CPU pool, so the
// server keeps answering while they run. Every error is JSON {"error": {"code", "message",
// ...}} with the status and code the document lists.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "sync/ledger.h"
#include "sync/publisher.h"
#include "sync/server.h"
#include "push/uploads.h"
#include "sync/version_log.h"
#include "transport/http.h"

namespace flywheel::sync {

struct PushOptions {
  std::string token;        // the push credential; empty: push routes answer 403
  std::string staging_dir;  // empty: <state-dir>/uploads
  uint64_t staging_quota_bytes = 128ull << 30;
  uint64_t max_upload_bytes = 64ull << 30;
  uint64_t max_part_bytes = 64ull << 20;
  std::chrono::milliseconds upload_expiry{3600 * 1000};
  // GET /v1/wait: one long-poll waits at most this long (a longer timeout_ms is cut to it),
  // and at most max_waiters wait at once (more answer 503 too_many_waiters at once).
  std::chrono::milliseconds max_wait{60000};
  size_t max_waiters = 32;
};

// Readiness of the fleet for a version (GET /v1/readiness).
struct Readiness {
  uint64_t version = 0;
  uint64_t workers = 0;
  uint64_t serving = 0;  // workers whose last report holds >= version
  std::map<std::string, std::pair<uint64_t, uint64_t>> regions;  // region -> (workers, serving)
};
Readiness ReadinessOf(const std::vector<FleetNode>& fleet, uint64_t version);
nlohmann::json ToJson(const Readiness& readiness);

class PushApi : public PublisherExtension {
 public:
  // REQUIRES: target, ledger and cpu outlive the PushApi; `read_token_required` says
  // whether reads need a token (the publisher has a read token or a push token).
  PushApi(asio::any_io_executor executor, PushOptions options, PublishTarget* target,
          Ledger* ledger, std::unique_ptr<UploadStore> uploads, asio::thread_pool* cpu,
          int threads, bool read_token_required);
  ~PushApi() override;

  // Adds the routes. REQUIRES: on the server's executor, before requests arrive.
  void Register(transport::HttpServer& http);
  // Removes idle uploads every second until Stop().
  awaitable<void> ExpiryLoop();
  void Stop() override;
  // Whether the fleet is pinned (drops wait while it is).
  bool pinned() const override;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// Installs the push API on a publisher: `publisher.push_token` and `publisher.extension`,
// which opens the staging area (push.staging_dir, or <state-dir>/uploads), adds the routes
// and starts the expiry of idle uploads. Without a push token the read routes (versions,
// readiness, wait) still serve and the push routes answer 403.
void EnablePushApi(PublisherOptions& publisher, PushOptions push);

}  // namespace flywheel::sync
