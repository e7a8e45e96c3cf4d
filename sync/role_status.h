// What each role reports at GET /v1/status and /metrics, typed. A role fills its status
// struct; ToJson renders any of them (the fields every role shares once, in RoleStatus,
// then the role's own), and ops::MetricsText (ops/metrics.h) turns the top-level numbers and
// booleans of that document into Prometheus samples. So the keys a fleet view, a test or
// a dashboard reads are defined here, once, and cannot drift between the roles.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sync/link_registry.h"
#include "sync/upstream.h"

namespace flywheel::sync {

// The traffic of a node's links: totals (counters in /metrics) and the live links.
struct LinkTraffic {
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  uint64_t wan_bytes_in = 0;  // on shaped (WAN) links
  uint64_t wan_bytes_out = 0;
  nlohmann::json links = nlohmann::json::array();
  static LinkTraffic Of(const LinkRegistry& links);
};

// What every role reports.
struct RoleStatus {
  std::string role;  // "publisher", "relay", "worker"
  std::string region;
  std::string node_id;
  uint64_t version = 0;      // what it serves (publisher: its head)
  std::string weights_hash;  // of `version`; "" before the first
  uint64_t head_version = 0;
  uint64_t staleness = 0;  // head_version - version
  uint64_t max_staleness = 0;
  std::string upstream;  // "" for the publisher
  LinkTraffic traffic;
  double last_swap_ms = 0;   // workers; 0 elsewhere
  uint64_t swap_unix_us = 0;  // workers; 0 elsewhere
};

// Signed versions (sync/signing.h) as a relay or worker checks them.
struct SignatureStatus {
  uint64_t trusted_keys = 0;           // 0: signatures are not checked
  uint64_t signature_failures = 0;     // artifacts refused: unsigned, bad or forged
  uint64_t replays_refused = 0;        // validly signed but older than what is served
  std::string last_signature_error;
  std::string run_id;                  // of the version served (worker) / newest cached (relay)
};

// A node of the fleet as its reports reached this one. The publisher knows where each is
// behind and through whom it reported (`detailed`); a relay lists its region's nodes.
struct FleetNodeStatus {
  std::string node_id;
  std::string region;
  std::string role;
  uint64_t version = 0;
  bool detailed = false;
  uint64_t staleness = 0;  // detailed only
  std::string upstream;    // detailed only
  std::string via;         // detailed only
};

struct PublisherStatus {
  RoleStatus common;
  uint64_t last_version = 0;
  std::vector<FleetNodeStatus> nodes;
  uint64_t artifacts_retained = 0;
  uint64_t log_bytes = 0;
  uint64_t join_bytes = 0;  // what a worker joining at the head fetches (sync/version_log.h)
  double last_publish_ms = 0;
  // Streamed deltas: from the same start to the first piece of the last delta being
  // served (0 when it was not streamed), and when its encode ended (Unix microseconds).
  double last_first_piece_ms = 0;
  uint64_t last_encode_done_unix_us = 0;
  uint64_t streaming_version = 0;  // the version being encoded and streamed now (0: none)
  uint64_t streaming_pieces = 0;   // its pieces served so far
  uint64_t last_artifact_bytes = 0;
  uint64_t published_total = 0;
  std::vector<std::pair<uint64_t, std::string>> rejected_drops;  // version, reason
  uint64_t pieces_served = 0;
  std::string signing_key_id;  // "" when versions are not signed
  std::string run_id;
  double last_sign_ms = 0;     // hashing and signing the last version's artifacts
  std::string last_error;      // the last failure to sign or record a version
};

struct CachedArtifactStatus {
  std::string artifact;  // "delta 3->4" / "keyframe 4"
  uint64_t pieces = 0;
  uint64_t cached_pieces = 0;
};

struct RelayStatus {
  RoleStatus common;
  bool connected = false;
  uint64_t cache_bytes = 0;
  std::vector<CachedArtifactStatus> artifacts;
  std::vector<FleetNodeStatus> nodes;
  FetchCounters fetch;
  uint64_t pieces_served = 0;
  uint64_t fetch_failures = 0;
  SignatureStatus signatures;
};

struct WorkerStatus {
  RoleStatus common;
  // "joining" (nothing served yet), "serving", or "leaving" (Worker::Stop was called, e.g.
  // SIGTERM: downloads closed, its upstream told; the version served stays readable until
  // the process exits). `leaving` is the same as a boolean (a /metrics gauge).
  bool leaving = false;
  bool stale = false;  // further behind the head than max_staleness
  bool connected = false;
  double last_apply_ms = 0;
  uint64_t last_apply_chunks_early = 0;  // chunks of the last delta decoded while arriving
  // When the first of them was decoded (Unix microseconds; 0: none), and how many chunks
  // of the delta arriving now (streamed or not) are decoded so far.
  uint64_t last_early_decode_unix_us = 0;
  uint64_t arriving_chunks_decoded = 0;
  double last_swap_pause_ms = 0;
  uint64_t swaps_total = 0;
  uint64_t exports_total = 0;
  FetchCounters fetch;
  uint64_t artifacts_rejected = 0;
  uint64_t swaps_refused = 0;
  uint64_t older_heads_ignored = 0;
  uint64_t export_failures = 0;
  std::string last_error;
  SignatureStatus signatures;
};

nlohmann::json ToJson(const PublisherStatus& status);
nlohmann::json ToJson(const RelayStatus& status);
nlohmann::json ToJson(const WorkerStatus& status);

}  // namespace flywheel::sync
