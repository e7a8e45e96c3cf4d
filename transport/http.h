// The HTTP side of every role (Boost.Beast, C++20 coroutines): GET /v1/status (JSON),
// GET /metrics (Prometheus text), GET /healthz; plus a small blocking client that tests,
// benchmarks and scripts use to read them.
//
// When a token is configured, every route except the public ones (/healthz) requires
// "Authorization: Bearer <token>", compared in constant time; a missing or wrong token is
// answered 401 with "WWW-Authenticate: Bearer". Tokens are scoped (Scope below): each
// route names the scope it needs, and a known token without it is answered 403. Unknown paths are 404, methods other than
// GET/HEAD (or POST on POST routes) 405. Every read and write has a deadline; request headers are
// size-limited; the server serves each connection in its own coroutine and closes it after an
// error.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "transport/asio.h"
#include "transport/endpoint.h"

namespace flywheel::transport {

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
};

// Produces the response for one GET of the route's path; `target` is the full request
// target (path and query). Called on the server's executor.
using HttpHandler = std::function<HttpResponse(const std::string& target)>;

// What a bearer token may do: a bit set. Each route needs one scope.
enum Scope : uint32_t {
  kScopeRead = 1u << 0,    // GET status, metrics, versions, readiness
  kScopeSample = 1u << 1,  // a worker's POST /v1/completions
  kScopeSubmit = 1u << 2,  // the trainer's POST /v1/rollout/claim and /v1/rollout/submit
  kScopePush = 1u << 3,    // the publisher's uploads (push API)
  kScopeAdmin = 1u << 4,   // pin and unpin
};
// HttpServerOptions::token's scopes: what the fleet's own processes do with each other.
inline constexpr uint32_t kScopeFleet = kScopeRead | kScopeSample | kScopeSubmit;
// "read", "sample", "submit", "push", "admin" (one scope bit), for messages and flags.
const char* ScopeName(uint32_t scope);
// "read,submit" -> kScopeRead | kScopeSubmit; InvalidArgument naming an unknown scope.
Result<uint32_t> ParseScopes(const std::string& text);

// A token and what it may do.
struct ScopedToken {
  std::string token;
  uint32_t scopes = 0;
};

// Which of the server's tokens a request's bearer header carried.
enum class Credential {
  kNone,   // no header, or a token the server does not know (or the server has no tokens)
  kRead,   // HttpServerOptions::token
  kWrite,  // HttpServerOptions::write_token
};

// A request to an API route (RouteApi), read whole.
struct HttpRequest {
  std::string method;  // "GET", "PUT", "POST", "DELETE", ...
  std::string target;  // path and query
  std::string path;    // target without the query
  std::string body;
  Credential credential = Credential::kNone;
  uint32_t scopes = 0;  // of the bearer token (every scope when the server has no tokens)
  std::string peer;     // the client's "address:port"
};

// Serves every method of an API route; it decides on access itself (from
// HttpRequest::credential). Runs as a coroutine on the server's executor.
using HttpApiHandler = std::function<awaitable<HttpResponse>(HttpRequest request)>;

// Produces the response to a POST of the route's path from its body. Runs as a coroutine on
// the server's executor: long work belongs on another thread (see transport::RunOn), so
// that the server keeps serving while it runs.
using HttpPostHandler =
    std::function<awaitable<HttpResponse>(std::string target, std::string body)>;

struct HttpServerOptions {
  // The fleet token: kScopeFleet. Empty, with no other token: no authentication.
  std::string token;
  // A second credential that API routes see as Credential::kWrite (the publisher's push
  // token): read, push, and admin unless a scoped token grants admin. Empty: none.
  std::string write_token;
  // Further tokens with their own scopes (a dashboard's read-only token, a rollout
  // worker's submit token, an operator's admin token).
  std::vector<ScopedToken> scoped_tokens;
  std::shared_ptr<asio::ssl::context> tls;   // null: plain HTTP
  std::chrono::milliseconds timeout{10000};  // per read/write/handshake
  size_t max_connections = 256;              // further connections are closed at once
};

class HttpServer {
 public:
  // Binds `listen` (port 0: a free port) and starts accepting on `executor`.
  static Result<std::unique_ptr<HttpServer>> Start(asio::any_io_executor executor,
                                                   const Endpoint& listen,
                                                   HttpServerOptions options);
  // Stops the server (see Stop()). REQUIRES: the executor's io_context still exists.
  ~HttpServer();

  // Adds a route for an exact path. Public routes need no token; the others a token with
  // `scope`. REQUIRES: called on the server's executor (or before any request arrives).
  void Route(const std::string& path, HttpHandler handler, bool is_public = false,
             uint32_t scope = kScopeRead);
  // Adds a POST route that needs a token with `scope`; bodies over `body_limit` bytes are
  // answered 413. A GET of the path is 405. REQUIRES: as Route().
  void RoutePost(const std::string& path, HttpPostHandler handler, uint64_t body_limit,
                 uint32_t scope);

  // Adds an API route: every method on `prefix` and on paths below it ("prefix/..."); the
  // longest matching prefix wins over shorter ones, and exact Route/RoutePost paths win
  // over API routes. Bodies over `body_limit` bytes are answered 413 before the handler
  // runs. The server does no authentication for these routes: the handler checks
  // HttpRequest::scopes. REQUIRES: as Route().
  void RouteApi(const std::string& prefix, HttpApiHandler handler, uint64_t body_limit = 1 << 20);

  uint16_t port() const;
  // Stops accepting and closes open connections. Idempotent. Must be called on the
  // server's executor thread (or after the executor stopped).
  void Stop();

  struct Impl;

 private:
  explicit HttpServer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

struct HttpGetOptions {
  std::string token;                        // sent as a bearer token when non-empty
  std::shared_ptr<asio::ssl::context> tls;  // null: plain HTTP
  std::chrono::milliseconds timeout{5000};  // for the whole request
};

// GET http(s)://endpoint<target>; blocking, on its own io_context. Any HTTP status is a
// successful result; connection, TLS or parse failures (and timeouts) are Unavailable.
Result<HttpResponse> HttpGet(const Endpoint& endpoint, const std::string& target,
                             const HttpGetOptions& options = {});
// Any method, with `body` sent as `content_type` unless both are empty; otherwise as HttpGet.
Result<HttpResponse> HttpCall(const Endpoint& endpoint, const std::string& method,
                              const std::string& target, const std::string& body,
                              const HttpGetOptions& options = {},
                              const std::string& content_type = "application/json");
// POST `body` (as `content_type`) to http(s)://endpoint<target>; otherwise as HttpGet.
Result<HttpResponse> HttpPost(const Endpoint& endpoint, const std::string& target,
                              const std::string& body, const HttpGetOptions& options = {},
                              const std::string& content_type = "application/json");

}  // namespace flywheel::transport
