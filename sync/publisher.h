// `flywheel publish`: holds the version log (sync/version_log.h) and serves it.
//
// New versions come from a watched directory (bring-your-own-trainer drops, sync/drop.h),
// polled every poll interval, and from Publish(), the in-process API the embedded trainer
// calls. A malformed drop, or one whose version is not above the last published (a replay,
// or a version already used before a restart), is rejected with a logged reason, listed in
// /v1/status, and never retried; the publisher keeps serving the last good version.
//
// Every version is recorded in the version ledger (<state-dir>/ledger.log: every version,
// its source, sizes and metadata; sync/ledger.h). A product above sync/ may extend the
// publisher through PublisherOptions::extension: the push API (push/push_api.h,
// docs/PUSH_API.md) serves the ledger, readiness and its long-poll, resumable uploads and
// pin/unpin on the publisher's HTTP port that way.
//
// Links to peers whose region differs from the publisher's are shaped by --wan-rate and
// --wan-latency-ms: one token bucket per remote region and direction, shared by every
// connection from that region (so four workers of one region share its WAN link).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "checkpoint/tensor.h"
#include "sync/ledger.h"
#include "sync/role.h"
#include "sync/role_status.h"
#include "sync/server.h"
#include "sync/version_log.h"
#include "transport/endpoint.h"
#include "transport/http.h"

namespace flywheel::sync {

// What an extension (the push API) publishes through: the publisher that owns it.
class PublishTarget {
 public:
  virtual ~PublishTarget() = default;
  virtual const VersionLog& version_log() const = 0;
  // Appends `checkpoint` as `version` to the log, records `row` (its version, hash, sizes and
  // time filled in) in the ledger and announces it. Thread-safe; blocks while encoding.
  virtual Result<LedgerRow> Publish(uint64_t version, const CheckpointView& checkpoint,
                                    const AppendOptions& known, LedgerRow row) = 0;
  // The nodes below the publisher. REQUIRES: called on the network thread.
  virtual std::vector<FleetNode> Fleet() const = 0;
};

// What the publisher hands an extension when it starts. Every pointer outlives the
// extension (the publisher stops and destroys it first).
struct PublisherContext {
  asio::any_io_executor executor;  // the network thread's
  PublishTarget* target = nullptr;
  Ledger* ledger = nullptr;  // opened by the publisher, <state-dir>/ledger.log
  transport::HttpServer* http = nullptr;  // routes are added before requests arrive
  asio::thread_pool* cpu = nullptr;  // the publisher's encoding pool
  int threads = 0;  // --threads
  std::string state_dir;
  // Whether reads need a token (the publisher has a read token, a push token or scoped ones).
  bool read_token_required = false;
};

// A product built on the publisher (push/push_api.h: the push API).
class PublisherExtension {
 public:
  virtual ~PublisherExtension() = default;
  // Stops background work. Called on the network thread when the publisher stops.
  virtual void Stop() = 0;
  // Whether the fleet is pinned: drops wait in the watched directory while it is.
  virtual bool pinned() const = 0;
};

// Builds the extension; called once by Publisher::Start after the HTTP server started, on
// the thread that calls Start. An error fails the start.
using PublisherExtensionFactory =
    std::function<Result<std::unique_ptr<PublisherExtension>>(const PublisherContext&)>;

struct PublisherOptions {
  CommonOptions common;  // region defaults to "home"
  transport::Endpoint listen;
  VersionLogOptions log;  // dir = --state-dir
  std::string watch_dir;  // empty: only Publish()
  std::chrono::milliseconds poll{50};
  uint64_t max_staleness = 0;  // announced to subscribers; 0: unbounded
  // The push token (push/push_api.h): also accepted for reads, and reads need a token once
  // it is set. Set with `extension` by EnablePushApi (push/push_api.h).
  std::string push_token;
  PublisherExtensionFactory extension;  // empty: none
  // --signing-key: an Ed25519 private key (sync/signing.h). Every artifact served is then
  // signed; signatures and the run id persist in <state-dir>/signatures.json.
  std::string signing_key;
};

class Publisher {
 public:
  static Result<std::unique_ptr<Publisher>> Start(asio::any_io_executor executor,
                                                  PublisherOptions options);
  ~Publisher();
  void Stop();  // thread-safe

  // Publishes `checkpoint` as `version` and announces it. Thread-safe; must not be called
  // on the executor's thread (it blocks while encoding). Versions only move forward.
  Result<std::vector<ArtifactInfo>> Publish(uint64_t version, const CheckpointView& checkpoint);
  // The same for a caller that hashed `checkpoint` already (the embedded trainer): the
  // hashes in `known` are used as they are (VersionLog::Append's AppendOptions contract),
  // and the result carries the encoder's changed-word counts.
  Result<AppendResult> Publish(uint64_t version, const CheckpointView& checkpoint,
                               const AppendOptions& known);

  uint16_t port() const;
  uint16_t http_port() const;
  uint64_t version() const;
  nlohmann::json StatusJson() const;  // call on the executor's thread
  PublisherStatus CurrentStatus() const;  // the same, typed

  struct Impl;

 private:
  explicit Publisher(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace flywheel::sync
