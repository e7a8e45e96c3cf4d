// The HTTP side of every role (Boost.Beast, C++20 coroutines): GET /v1/status (JSON),
// GET /metrics (Prometheus text), GET /healthz, POST routes whose answers may be streamed
// as they are produced (server-sent events); plus a small blocking client that tests,
// benchmarks and scripts use to read them.
//
// When a token is configured, every route except the public ones (/healthz) requires
// "Authorization: Bearer <token>", compared in constant time; a missing or wrong token is
// answered 401 with "WWW-Authenticate: Bearer". Tokens are scoped (Scope below): each
// route names the scope it needs, and a known token without it is answered 403. Unknown paths are
// 404, methods other than GET/HEAD (or POST on POST routes) 405. Every answer the server makes
// itself (401, 403, 404, 405, 413, 431, and 500 for a handler that throws) is JSON in the
// route's ErrorShape (transport/api.h): {"error": {"code", "message"}} unless the route is an
// OpenAI one. Every read and write has a
// deadline (except the read that watches a streaming client, see HttpStream); request headers
// are size-limited; the server serves each connection in its own coroutine and closes it after
// an error.
//
// Against hostile clients (what nginx and Envoy do, in small):
//  * Access is decided from the header alone: a request without a valid token for its route
//    (and, on API routes, any request with a body and no valid token at all) is answered
//    401/403 before any of its body is read — at most 8 KiB of it arrives before the answer —
//    and the connection is closed. Every 401 closes the connection.
//  * Each route's body limit applies to a Content-Length at once and to a chunked body as it
//    arrives (413, connection closed).
//  * Slots: at most max_connections connections, at most max_connections_per_address from one
//    client address. A new connection over a limit closes the idle connection (one waiting
//    for its next request) that has waited longest — kept-alive ones first, of the same
//    address when that address is at its own limit — and is refused only when every
//    connection it could replace is busy. So keep-alive connections cannot hold the server:
//    a request every few seconds does not keep a slot that someone else needs.
//  * A connection serves at most 1000 requests, then closes (nginx's keepalive_requests).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
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

// Which error body a route's errors have, the server's own refusals included (401, 403, 405,
// 413, 500): flywheel's one shape, or OpenAI's for the OpenAI-compatible routes. The bodies
// and the Status -> HTTP table are in transport/api.h.
enum class ErrorShape {
  kFlywheel,  // {"error": {"code", "message", ...details}}
  kOpenAi,    // {"error": {"message", "type", "param", "code"}}
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
  kScopeTrain = 1u << 5,   // the training service's calls (docs/TRAINING_API.md)
};
// HttpServerOptions::token's scopes: what the fleet's own processes do with each other.
inline constexpr uint32_t kScopeFleet = kScopeRead | kScopeSample | kScopeSubmit;
// "read", "sample", "submit", "push", "admin", "train" (one scope bit), for messages and flags.
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

// The body of a request to an API route that streams bodies (RouteApi's `streamed`): read
// piece by piece as the handler asks for it, never whole. Made by the server for one
// request; use it on the server's executor only, while the handler runs.
class HttpBodyReader {
 public:
  virtual ~HttpBodyReader() = default;
  // Reads the next bytes of the body into `buffer` (de-chunked): how many, at least 1 while
  // any remain, 0 once the body ended. Each read has the server's per-read deadline.
  // Unavailable when the client left, a deadline passed or the body is malformed (the body
  // ended short of its Content-Length included); ResourceExhausted when a chunked body goes
  // past the route's limit. After an error every further Read() fails the same way, and the
  // server closes the connection once the handler returns (answering a ResourceExhausted
  // with 413, an Unavailable with nothing). REQUIRES: !buffer.empty(); one Read() at a time.
  virtual awaitable<Result<size_t>> Read(std::span<std::byte> buffer) = 0;
  // The Content-Length the client declared; nullopt for a chunked body.
  virtual std::optional<uint64_t> content_length() const = 0;
  // Body bytes read so far.
  virtual uint64_t bytes_read() const = 0;
};

// A request to an API route (RouteApi): read whole, or (a streamed route) with its body
// to be read through body_reader.
struct HttpRequest {
  std::string method;  // "GET", "PUT", "POST", "DELETE", ...
  std::string target;  // path and query
  std::string path;    // target without the query
  std::string body;  // empty when body_reader is set
  // A streamed route's body, not read yet: the handler reads what it needs; the server
  // reads and drops whatever it leaves before the answer is sent. Null otherwise.
  HttpBodyReader* body_reader = nullptr;
  Credential credential = Credential::kNone;
  uint32_t scopes = 0;  // of the bearer token (every scope when the server has no tokens)
  std::string peer;     // the client's "address:port"
  // Who sent it, without being a secret: TokenIdentity() of the presented token when it is
  // one of the server's; empty when the server has no tokens or the token is unknown.
  std::string identity;
};

// A bearer token's name that is no secret: "token:" + the first 16 hex digits of the
// SHA-256 of the token (stable across restarts and token-file order; safe to log and store).
std::string TokenIdentity(std::string_view token);

// The body limit of one request of an API route, from its method and path.
using HttpBodyLimit = std::function<uint64_t(std::string_view method, std::string_view path)>;
// Whether one request of an API route streams its body (HttpRequest::body_reader), from its
// method and path.
using HttpBodyStreamed = std::function<bool(std::string_view method, std::string_view path)>;

// Serves every method of an API route; it decides on access itself (from
// HttpRequest::credential). Runs as a coroutine on the server's executor.
using HttpApiHandler = std::function<awaitable<HttpResponse>(HttpRequest request)>;

// Produces the response to a POST of the route's path from its body. Runs as a coroutine on
// the server's executor: long work belongs on another thread (see transport::RunOn), so
// that the server keeps serving while it runs.
using HttpPostHandler =
    std::function<awaitable<HttpResponse>(std::string target, std::string body)>;

// The writer of one streamed answer (RoutePostStream): the server makes one per request and
// hands it to the handler, and it lives until the handler's coroutine returns. Use it on
// the server's executor only.
//
// While the handler runs, the server reads from the connection to notice a client that
// leaves: its close (or reset) makes gone() true and runs the OnGone() callbacks at once,
// even while the handler is not writing. A client that half-closes its side after the
// request counts as gone too. Bytes a client pipelines meanwhile are kept for the next
// request; after 64 KiB of them the server stops reading, and only a failed write then
// tells that the client left. That read has no deadline: the handler's own run time bounds
// it, as it bounds a RoutePost request.
class HttpStream {
 public:
  struct State;  // the server's side of the connection
  explicit HttpStream(std::shared_ptr<State> state);
  ~HttpStream();
  HttpStream(const HttpStream&) = delete;
  HttpStream& operator=(const HttpStream&) = delete;

  // The Content-Type of the streamed answer. REQUIRES: before the first Write(); the
  // default is "text/event-stream".
  void set_content_type(std::string content_type);

  // The first call sends the status line and headers: 200, the content type,
  // "Transfer-Encoding: chunked", "Cache-Control: no-cache", "X-Accel-Buffering: no"
  // (HTTP/1.0 clients get no chunking, and the connection's close ends the body). Every
  // call then sends `data` as one chunk, at once (TCP_NODELAY); an empty `data` sends no
  // chunk. Each call has the server's per-write deadline. Returns false when the client is
  // gone, the write failed or its deadline passed (gone() is then true and the connection
  // will be closed): stop producing and return.
  // REQUIRES: no other Write() of this stream is in progress.
  awaitable<bool> Write(std::string data);

  // True once the client closed the connection, a write failed, or the server stopped.
  bool gone() const;

  // Runs `callback` once on the server's executor when the client is gone before the
  // handler returns: at once (inside this call) if it already is, otherwise from the
  // server's read or a failed Write(). Callbacks never run after the handler returned, so
  // they may refer to the handler's locals. They must not throw. For freeing the work the
  // answer was for.
  void OnGone(std::function<void()> callback);

 private:
  std::shared_ptr<State> state_;
};

// Produces the answer to a POST of a stream route's path. Either returns the whole
// response without calling stream.Write(), or streams it with stream.Write() and returns
// std::nullopt; the server then ends the chunked body and keeps the connection when it can.
// A response returned after Write() is ignored; std::nullopt without a Write() is answered
// 500. A handler that throws after its first Write() ends the connection without the
// terminating chunk, so that the client sees a truncated answer. Runs as a coroutine on the
// server's executor, like HttpPostHandler.
using HttpStreamHandler = std::function<awaitable<std::optional<HttpResponse>>(
    std::string target, std::string body, HttpStream& stream)>;

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
  size_t max_connections = 256;              // see "Slots" above
  size_t max_connections_per_address = 128;  // connections from one client address
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
  // `shape`: the body of the errors the server answers for this route itself.
  void Route(const std::string& path, HttpHandler handler, bool is_public = false,
             uint32_t scope = kScopeRead, ErrorShape shape = ErrorShape::kFlywheel);
  // Adds a POST route that needs a token with `scope`; bodies over `body_limit` bytes are
  // answered 413. A GET of the path is 405. REQUIRES: as Route().
  void RoutePost(const std::string& path, HttpPostHandler handler, uint64_t body_limit,
                 uint32_t scope, ErrorShape shape = ErrorShape::kFlywheel);
  // Adds a POST route whose handler may stream its answer (HttpStream): otherwise as
  // RoutePost(), and it replaces a RoutePost() of the same path (and the other way round).
  // Stop() closes open streams: their handlers see gone() and their OnGone() callbacks run;
  // io_context::run() returns once they have returned. REQUIRES: as Route().
  void RoutePostStream(const std::string& path, HttpStreamHandler handler, uint64_t body_limit,
                       uint32_t scope, ErrorShape shape = ErrorShape::kFlywheel);

  // Adds an API route: every method on `prefix` and on paths below it ("prefix/..."); the
  // longest matching prefix wins over shorter ones, and exact Route/RoutePost paths win
  // over API routes. Bodies over `body_limit` bytes are answered 413 before the handler
  // runs. The server does no authentication for these routes: the handler checks
  // HttpRequest::scopes. `limit_for` (optional) lowers the limit per request from its method
  // and path, before any of the body is read (an upload route: large PUTs, small POSTs).
  // `streamed` (optional) says which requests the handler reads through
  // HttpRequest::body_reader instead of whole (an upload's parts): the limit applies the
  // same, to a Content-Length at once and to a chunked body as it arrives.
  // REQUIRES: as Route().
  void RouteApi(const std::string& prefix, HttpApiHandler handler, uint64_t body_limit = 1 << 20,
                HttpBodyLimit limit_for = nullptr, HttpBodyStreamed streamed = nullptr);

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

// POSTs `body` (as `content_type`) to http(s)://endpoint<target> and calls `on_data` with
// each piece of the response body as it arrives (de-chunked; pieces do not follow chunk or
// event boundaries). Returning false from `on_data` closes the connection at once (a client
// that leaves mid-stream) and ends the call successfully. The result holds the status and
// content type, and the body only when `on_data` is null. options.timeout bounds the whole
// call, stream included; failures are Unavailable as for HttpGet, also after some data
// arrived (a connection that ends before the body does is one).
Result<HttpResponse> HttpPostStream(const Endpoint& endpoint, const std::string& target,
                                    const std::string& body, const HttpGetOptions& options,
                                    const std::function<bool(std::string_view)>& on_data,
                                    const std::string& content_type = "application/json");

}  // namespace flywheel::transport
