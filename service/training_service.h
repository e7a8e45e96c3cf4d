// The training service (`flywheel serve-trainer`): the embedded trainer behind the HTTP API
// of docs/TRAINING_API.md, with sessions.
//
//   full mode  one session at a time trains every weight
//   LoRA mode  (TrainerOptions::lora) many sessions share one frozen base; each has its own
//              adapter, AdamW moments, step and accumulation (trainer::TrainableState),
//              swapped into the one model for its calls
//
// One trainer thread runs every call; a session's calls run in `seq` order (answers of the
// last ones are kept, so a retry is answered without running twice). HTTP handlers decode on
// a pool and wait there, never on the network thread. save_weights_for_sampler publishes
// through the in-process publisher: full mode publishes the weights; LoRA mode publishes the
// base plus every session's latest adapter under model::kServedAdapterPrefix + <name>/, so
// workers serve each session's adapter by name. Sessions expire after an idle timeout;
// save_state writes <state>/sessions/<id>/<name>, and a restarted service restores every
// session that saved a state (from its latest one) under the same id.
//
// Owners. A session belongs to the identity that opened it (below). Every request about a
// session from another identity (a read, a call, a close) is answered exactly as for an id
// that never existed: 404 "unknown session <id>", so that one token learns nothing of
// another's sessions (GitHub and S3 answer private objects the same way). A saved state
// (sessions/<id>/<name>) is loaded, by load_state or from_state, only by the owner of
// session <id>, recorded in sessions/<id>/session.json; another identity gets the 404 of a
// state that does not exist. Listings (GET /v1/train/sessions, /v1/train/info) show the
// caller's own sessions. Session names stay one namespace (they name served adapters): a
// name another identity uses is 409 name_taken, without its session's id.
//
// Caps. Open sessions are capped per identity (max_sessions_per_identity) and in all
// (max_sessions); a create past either is 409 too_many_sessions naming the cap and its flag.
// Restored sessions count, but a restart never refuses to restore one.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "trainer/training_client.h"
#include "transport/http.h"

namespace flywheel::sync {
class Publisher;
}

namespace flywheel::service {

struct TrainingServiceOptions {
  trainer::TrainerOptions trainer;  // model, initial weights, seed, LoRA (sets the mode), dtype
  std::string state_dir;            // sessions/ lives here (required)
  std::chrono::milliseconds session_idle_timeout{std::chrono::hours(1)};
  std::chrono::milliseconds seq_wait{std::chrono::minutes(1)};
  int64_t max_batch_tokens = 1 << 18;
  uint64_t max_body_bytes = 256ull << 20;
  size_t answers_kept = 64;  // per session, for retries
  int http_threads = 32;     // requests decoded or waiting for their call at once
  // Open sessions one identity may hold (serve-trainer --max-sessions-per-token), and all
  // identities together (--max-sessions).
  int max_sessions_per_identity = 8;
  int max_sessions = 64;
  Status Validate() const;
};

// ---- identities ----
//
// An identity names who calls without being a secret: "token:" + the first 16 hex digits of
// the SHA-256 of the bearer token (stable across restarts and token-file order; what
// session.json records as "owner" and GET /v1/train/info answers as "identity"). With no
// tokens configured every request is kAnonymousIdentity, which also owns the sessions saved
// before owners were recorded.
//
// The identity of a request comes from the HTTP server (transport::HttpRequest::identity:
// transport::TokenIdentity of the presented token).
inline constexpr std::string_view kAnonymousIdentity = "anonymous";

// The identity of a bearer token ("token:<16 hex>"): transport::TokenIdentity.
std::string TokenIdentity(std::string_view token);

// Who sent `request`: kAnonymousIdentity when the server has no tokens (every scope), else
// the presented token's identity.
std::string IdentityOf(const transport::HttpRequest& request);

class TrainingService {
 public:
  // Builds the trainer, restores the sessions saved under state_dir and, with a publisher,
  // publishes the starting weights as the version after the publisher's head (workers can
  // serve the base before any session saves).
  static Result<std::unique_ptr<TrainingService>> Create(TrainingServiceOptions options,
                                                         sync::Publisher* publisher);
  ~TrainingService();  // calls still waiting are answered 503
  TrainingService(const TrainingService&) = delete;
  TrainingService& operator=(const TrainingService&) = delete;

  // GET/POST/DELETE under /v1/train (scopes: GETs read or train, the rest train), plus
  // the status routes (transport::AddStatusRoutes). Call on the server's executor before it
  // serves. Errors are the one shape and table of transport/api.h.
  void Register(transport::HttpServer& server);
  // One request of `identity` without HTTP (blocking; what the routes run on their pool).
  transport::HttpResponse Handle(const std::string& method, const std::string& path, const std::string& body,
                       std::string_view identity = kAnonymousIdentity);

  nlohmann::json StatusJson();
  uint64_t version() const;  // the last version published (0: none)
  bool lora() const;

  struct Impl;

 private:
  explicit TrainingService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flywheel::service
