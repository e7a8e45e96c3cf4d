// A client of the publisher's push API (docs/PUSH_API.md), behind `flywheel push`,
// `flywheel versions`, `flywheel pin` and `flywheel unpin`.
//
// Push keeps a local cache of the last checkpoint it pushed to each publisher URL, under
// <cache root>/<first 16 hex digits of SHA-256 of the URL>/ (the Python client uses the
// same layout): `model.safetensors` (a single file) or `checkpoint/` (a sharded directory),
// and `last.json` {"url", "version", "weights_hash"}. The cache root is $FLYWHEEL_CACHE_DIR,
// else $XDG_CACHE_HOME/flywheel/push, else ~/.cache/flywheel/push. When the cache holds a
// checkpoint of the same layout, Push encodes the delta from it locally and uploads that;
// when the publisher no longer holds that base (409 unknown_base) or the layout differs,
// it uploads the full checkpoint. Uploads resume after a broken connection from the
// publisher's record of the bytes it has (no byte it acknowledged is sent again).
//
// The cache is written through an Env (PushClientOptions::env), durably and in an order a
// crash cannot turn into a lie: last.json is removed first, the checkpoint copied and
// synced and renamed into place, last.json written last (atomically). A crash part-way
// leaves no cache, and the next push sends the full checkpoint.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include "base/env.h"
#include "base/status.h"

namespace flywheel::sync {

struct PushClientOptions {
  std::string url;      // http://host:port or https://host:port
  std::string token;    // the push token (reads accept it too)
  std::string ca_file;  // https: the CA the publisher's certificate is verified against
  // https to a publisher that requires client certificates (--tls-ca): this one (PEM).
  std::string cert_file, key_file;
  std::chrono::milliseconds timeout{120000};  // per HTTP request
  std::string cache_dir;                      // empty: the default cache root
  bool use_delta = true;
  uint64_t part_bytes = 16ull << 20;
  int retries = 8;      // attempts per part and per request after a broken connection
  std::string client;   // recorded in the ledger as who pushed (default: user@host)
  int threads = 1;      // delta encode threads
  Env* env = nullptr;   // the cache's files; null: Env::Default()
};

struct PushRequest {
  std::string checkpoint;                 // .safetensors file or (sharded) directory
  std::optional<uint64_t> version;        // nullopt: the head + 1
  nlohmann::json metadata = nlohmann::json::object();
};

struct PushOutcome {
  nlohmann::json row;                   // the ledger row of the new version
  std::string kind;                     // "full" or "delta"
  uint64_t uploaded_bytes = 0;          // the body
  uint64_t sent_bytes = 0;              // part bytes actually sent (resends included)
  uint64_t checkpoint_bytes = 0;        // the full body's size, for the ratio
  bool fell_back = false;               // a delta was refused (unknown base) and full sent
  std::string fallback_reason;
  int resumes = 0;                      // broken connections recovered from
  double encode_seconds = 0;
  double upload_seconds = 0;            // create + parts + commit
  double commit_seconds = 0;            // the commit alone: the publisher verifies and publishes
};

using PushProgress = std::function<void(uint64_t sent, uint64_t total)>;

// Pushes one checkpoint. Errors name what failed: the checkpoint, the publisher's answer
// (status, code and message), or the connection after the retries.
Result<PushOutcome> Push(const PushClientOptions& options, const PushRequest& request,
                         const PushProgress& progress = {});

// One JSON call to the API: `method` `path` with `body` (null: none). A non-2xx answer is
// an error carrying the publisher's status, code and message.
Result<nlohmann::json> CallPublisher(const PushClientOptions& options, const std::string& method,
                                     const std::string& path,
                                     const nlohmann::json& body = nullptr);

// Waits (GET /v1/wait, re-issued until `timeout`) until `fraction` of the workers (at least
// `min_workers`) serve >= version. Returns the last readiness document; Unavailable when the
// time ran out.
Result<nlohmann::json> WaitServing(const PushClientOptions& options, uint64_t version,
                                   double fraction, std::chrono::milliseconds timeout,
                                   uint64_t min_workers = 1);

// The cache directory for `url` under `root` ("" : the default root).
std::string PushCacheDir(const std::string& root, const std::string& url);

}  // namespace flywheel::sync
