// `flywheel publish`: holds the version log (sync/version_log.h) and serves it.
//
// New versions come from a watched directory (bring-your-own-trainer drops, sync/drop.h),
// polled every poll interval, and from Publish(), the in-process API the embedded trainer
// calls. A malformed drop, or one whose version is not above the last published (a replay,
// or a version already used before a restart), is rejected with a logged reason, listed in
// /v1/status, and never retried; the publisher keeps serving the last good version.
//
// The HTTP port also serves the version ledger (<state-dir>/ledger.log: every version, its
// source, sizes and metadata), readiness and its long-poll, and, with a push token, the
// push API: resumable uploads of full checkpoints or deltas, and pin/unpin
// (sync/push_api.h, docs/PUSH_API.md).
//
// Links to peers whose region differs from the publisher's are shaped by --wan-rate and
// --wan-latency-ms: one token bucket per remote region and direction, shared by every
// connection from that region (so four workers of one region share its WAN link).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "checkpoint/tensor.h"
#include "sync/push_api.h"
#include "sync/role.h"
#include "sync/role_status.h"
#include "sync/version_log.h"
#include "transport/endpoint.h"

namespace flywheel::sync {

struct PublisherOptions {
  CommonOptions common;  // region defaults to "home"
  transport::Endpoint listen;
  VersionLogOptions log;  // dir = --state-dir
  std::string watch_dir;  // empty: only Publish()
  std::chrono::milliseconds poll{50};
  uint64_t max_staleness = 0;  // announced to subscribers; 0: unbounded
  PushOptions push;  // the push API (docs/PUSH_API.md); off without a push token
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
