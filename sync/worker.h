// `flywheel worker`: holds the serving copy of the weights in memory and keeps it current.
//
// It subscribes upstream (a relay, or the publisher; several upstreams in order of
// preference, with failover), and on every catalog whose head is newer than what it
// serves it plans the cheapest path: the chain of deltas from its own version, else the
// newest keyframe and the deltas after it. Each artifact is fetched over parallel streams,
// every piece verified against the catalog's hash (a bad piece is fetched again, never
// used), then applied in one step under an exclusive lock: readers see the old version or
// the new one, never a mix, and the target hash is verified before the new version is
// served. A joining worker (nothing served yet) decodes and verifies a streamed keyframe
// tensor by tensor while it arrives, into a staging buffer (sync/keyframe_stager.h), and
// takes it only whole and verified. A delta that does not apply (wrong base, corrupt) is
// rejected and the worker falls back to a keyframe; a catalog that announces an older
// version than the one served never moves the worker back.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status.h"
#include "delta/delta.h"
#include "checkpoint/hash.h"
#include "checkpoint/tensor.h"
#include "sync/role.h"
#include "transport/endpoint.h"
#include "transport/http.h"

namespace flywheel::sync {

// A verified new version, handed to WorkerOptions::on_swap under the exclusive weights
// lock before it is served: `changes` lists the words the apply wrote (delta::ApplyInPlace
// with report_changes; indices into `weights`), unless `full` (a keyframe decoded into a new
// layout), when every word is new.
struct SwapEvent {
  uint64_t version = 0;
  const CheckpointView* weights = nullptr;
  const std::vector<delta::ChangedWords>* changes = nullptr;
  bool full = false;
  // With `full`: the weights served until now, still intact during the call (the new
  // version was decoded into new buffers), so a hook can go back to them; else null.
  const CheckpointView* previous = nullptr;
};

struct WorkerOptions {
  CommonOptions common;
  std::vector<transport::Endpoint> upstreams;  // in order of preference
  std::string export_dir;  // non-empty: write v<version>.safetensors here after every swap
  int export_keep = 2;     // newest exports kept in export_dir
  int streams = 4;         // parallel data streams per artifact
  int window = 8;          // piece requests in flight per stream
  // A joining worker (nothing served yet) decodes and verifies a streamed keyframe tensor
  // by tensor while it arrives, into a buffer allocated once from the keyframe's declared
  // sizes (at most common.max_artifact_bytes, or physical memory), and fetches a keyframe
  // the publisher is still encoding. false: the keyframe is decoded once it is whole (the
  // behaviour before streamed keyframes; `bench join` compares the two).
  bool stage_keyframes = true;
  // After Stop(): how long the HTTP endpoint keeps answering (its status says "leaving")
  // before it closes. 0: it closes at once. `flywheel worker` lingers briefly on SIGTERM.
  std::chrono::milliseconds leave_linger{0};
  // Runs on every swap (see SwapEvent), e.g. to patch an inference engine's compute copy
  // between its decode steps. Readers of the weights wait while it runs: keep it short. Its
  // duration is reported as last_swap_pause_ms in /v1/status. An error refuses the version:
  // the weights are restored to the version served before (bit for bit), which stays served
  // and advertised; the refusal is logged, counted (swaps_refused in /v1/status and
  // /metrics) and that artifact is not tried again. On an error the hook must leave its own
  // copy as it was before the call (the rollout engine validates before it patches).
  std::function<Status(const SwapEvent&)> on_swap;
  // Called once with the worker's HTTP server right after it starts, on the executor's
  // thread, to add routes (the rollout engine's POST /v1/completions).
  std::function<void(transport::HttpServer&)> configure_http;
  // Adds fields to every /v1/status document (and so to /metrics), e.g. the rollout
  // engine's counters; called on the HTTP thread, so it must be thread-safe.
  std::function<void(nlohmann::json&)> extend_status;
};

class Worker {
 public:
  // Binds the HTTP endpoint and starts subscribing on `executor` (the caller runs it).
  static Result<std::unique_ptr<Worker>> Start(asio::any_io_executor executor,
                                               WorkerOptions options);
  // REQUIRES: the executor no longer runs (or Stop() was called and it drained).
  ~Worker();

  // Leaves: stops subscribing, closes the downloads in flight and the control channel (its
  // close is the leave: the upstream forgets this node at once, no timeout), and
  // reports "leaving" in /v1/status until the HTTP endpoint closes (leave_linger later).
  // The version served stays readable. Thread-safe.
  void Stop();

  uint16_t http_port() const;
  uint64_t version() const;  // 0 until the first version is served
  Hash128 weights_hash() const;
  // Runs `fn` with the serving weights under a shared lock: a swap waits for it, and it
  // never sees a half-applied version. `fn` gets version 0 and no tensors before the
  // first version.
  void WithWeights(const std::function<void(uint64_t, const CheckpointView&)>& fn) const;
  // The /v1/status document. Call on the executor's thread. Its "join" object times how
  // this worker came to serve its first head (Unix microseconds, 0 until reached):
  // started (Start), first_catalog, keyframe_fetch / keyframe_fetched / keyframe_served
  // (keyframe_version), the deltas applied after it (count, fetch and apply ms), done (the
  // head's swap) and the process's CPU seconds by then.
  nlohmann::json StatusJson() const;

  struct Impl;

 private:
  explicit Worker(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace flywheel::sync
