// The HTTP side of every role (Boost.Beast, C++20 coroutines): GET /v1/status (JSON),
// GET /metrics (Prometheus text), GET /healthz; plus a small blocking client that tests,
// benchmarks and scripts use to read them.
//
// When a token is configured, every route except the public ones (/healthz) requires
// "Authorization: Bearer <token>", compared in constant time; a missing or wrong token is
// answered 401 with "WWW-Authenticate: Bearer". Unknown paths are 404, methods other than
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
  std::string peer;  // the client's "address:port"
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
  std::string token;                         // empty: no authentication
  // A second credential that API routes see as Credential::kWrite (the publisher's push
  // token). Plain routes accept it wherever they accept `token`. Empty: none.
  std::string write_token;
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

  // Adds a route for an exact path. Public routes need no token.
  // REQUIRES: called on the server's executor (or before any request arrives).
  void Route(const std::string& path, HttpHandler handler, bool is_public = false);
  // Adds a POST route; bodies over `body_limit` bytes are answered 413. A GET of the path is
  // 405. REQUIRES: as Route().
  void RoutePost(const std::string& path, HttpPostHandler handler, uint64_t body_limit = 1 << 20);

  // Adds an API route: every method on `prefix` and on paths below it ("prefix/..."); the
  // longest matching prefix wins over shorter ones, and exact Route/RoutePost paths win
  // over API routes. Bodies over `body_limit` bytes are answered 413 before the handler
  // runs. The server does no authentication for these routes: the handler checks
  // HttpRequest::credential. REQUIRES: as Route().
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
