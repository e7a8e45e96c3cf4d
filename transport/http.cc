#include "transport/http.h"

#include <openssl/sha.h>
#include <openssl/ssl.h>
#include <spdlog/spdlog.h>

#include <boost/beast/http.hpp>
#include <cctype>
#include <charconv>
#include <exception>
#include <limits>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <vector>

#include "base/hex.h"
#include "transport/api.h"

namespace flywheel::transport {
namespace http = beast::http;

namespace {

constexpr uint32_t kHeaderLimit = 8 * 1024;
// GET routes: a request body is only read so that a stray POST can be answered 405. POST
// routes set their own limit.
constexpr uint64_t kRequestBodyLimit = 16 * 1024;
constexpr uint64_t kResponseBodyLimit = 64 * 1024 * 1024;
// While a stream route's handler runs, the server reads what the client sends (to notice it
// leaving) into the connection's buffer; it stops reading once this much is pipelined.
constexpr size_t kPipelinedLimit = 64 * 1024;
// A connection serves at most this many requests, then closes (nginx's keepalive_requests).
constexpr int kRequestsPerConnection = 1000;
// After an answer sent before the body was read (401, 403, 413), the server reads and drops
// at most this much of the body for at most kLingerTime before it closes, so that the client
// reads the answer instead of a reset (nginx's lingering close, bounded).
constexpr size_t kLingerBytes = 64 * 1024;
constexpr std::chrono::milliseconds kLingerTime{1000};

using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

// The bearer token of an "Authorization: Bearer <token>" header ("" when absent).
std::string_view BearerToken(const Request& request) {
  auto it = request.find(http::field::authorization);
  if (it == request.end()) return {};
  std::string_view value(it->value().data(), it->value().size());
  constexpr std::string_view kScheme = "bearer ";
  if (value.size() < kScheme.size()) return {};
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(value[i])) != kScheme[i]) return {};
  }
  value.remove_prefix(kScheme.size());
  while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  return value;
}

}  // namespace

struct HttpServer::Impl {
  struct RouteEntry {
    HttpHandler handler;
    bool is_public = false;
    uint32_t scope = kScopeRead;
    ErrorShape shape = ErrorShape::kFlywheel;
  };

  Impl(asio::any_io_executor executor, HttpServerOptions options)
      : executor(executor), acceptor(executor), options(std::move(options)) {}

  // A RoutePost (handler) or a RoutePostStream (stream_handler): exactly one is set.
  struct PostEntry {
    HttpPostHandler handler;
    HttpStreamHandler stream_handler;
    uint64_t body_limit = 0;
    uint32_t scope = kScopeRead;
    ErrorShape shape = ErrorShape::kFlywheel;
  };
  struct ApiEntry {
    HttpApiHandler handler;
    uint64_t body_limit = 0;
    HttpBodyLimit limit_for;  // null: body_limit for every request
    HttpBodyStreamed streamed;  // null: every body is read whole
  };

  // The scopes of the request's bearer token: every scope when the server has no tokens,
  // 0 for a missing or unknown one.
  uint32_t ScopesOf(const Request& request) const;
  // Null when the request's token grants `scope`; else the 401 or 403 to send.
  std::optional<Response> Deny(const Request& request, uint32_t scope) const;
  Credential CredentialOf(const Request& request) const;
  // The API route for `path` (longest prefix), or null.
  const ApiEntry* FindApi(std::string_view path) const;
  // `reader`: the body of a streamed request (`request` then holds the header only).
  awaitable<Response> HandleApi(Request& request, const ApiEntry& entry, std::string peer,
                                HttpBodyReader* reader = nullptr);
  // The API route whose handler reads this request's body itself (ApiEntry::streamed), or null.
  const ApiEntry* StreamedApi(const Request& request) const;
  static Response ToResponse(HttpResponse result);
  // The error shape of the route a request goes to (flywheel's when there is none).
  ErrorShape ShapeOf(const Request& request) const;
  // An error the server answers itself, in the shape of the request's route.
  Response ErrorFor(const Request& request, http::status status, std::string code,
                    std::string message) const;
  // Version, Server header, keep-alive and Content-Length, as every answer has them.
  void Finish(const Request& request, Response& response) const;

  Response Handle(const Request& request);
  awaitable<Response> HandlePost(const Request& request, const PostEntry& entry);
  // The body limit for a request whose header has been read, and the largest of all.
  uint64_t BodyLimit(const Request& request) const;
  uint64_t MaxBodyLimit() const;
  void StopAll();

  asio::any_io_executor executor;
  tcp::acceptor acceptor;
  HttpServerOptions options;
  uint16_t port = 0;
  std::map<std::string, RouteEntry, std::less<>> routes;
  std::map<std::string, PostEntry, std::less<>> post_routes;
  std::map<std::string, ApiEntry, std::less<>> api_routes;
  // One per connection, from accept to the end of its coroutine: what max_connections,
  // max_connections_per_address and the eviction of idle connections count.
  struct Session {
    std::string address;        // the client's address (no port)
    std::string peer;           // "address:port"
    beast::tcp_stream* stream = nullptr;  // set while the session's coroutine runs
    bool idle = true;           // waiting for a request's header (no request in progress)
    bool served = false;        // answered at least one request (a kept-alive connection)
    std::chrono::steady_clock::time_point idle_since = std::chrono::steady_clock::now();
    bool evicted = false;       // closed to make room: no longer counted
  };
  std::list<Session> sessions;
  size_t evicted_pending = 0;  // evicted sessions whose coroutines have not ended yet
  std::map<std::string, size_t, std::less<>> per_address;  // counted sessions per address
  std::chrono::steady_clock::time_point last_refusal_log{};

  size_t counted_sessions() const { return sessions.size() - evicted_pending; }
  // Closes the idle connection that has waited longest for its next request (kept-alive
  // ones before fresh ones), of `address` when it is not empty; false when none is idle.
  bool EvictIdle(std::string_view address);
  // Answers that need no body, decided from the header alone: 401 for a missing or unknown
  // token, 403 for a token without the route's scope. Null: read the body.
  std::optional<Response> Admit(const Request& request) const;
  bool has_tokens() const {
    return !options.token.empty() || !options.write_token.empty() || !options.scoped_tokens.empty();
  }
  bool stopped = false;
};

namespace {

using Impl = HttpServer::Impl;

// Holds a connection's place in Impl::sessions (and the Impl itself) for as long as its
// coroutine frame exists, even if the frame is destroyed before it ever ran.
class SessionSlot {
 public:
  SessionSlot(std::shared_ptr<Impl> impl, std::string address, std::string peer)
      : impl_(std::move(impl)) {
    impl_->sessions.push_back(Impl::Session{std::move(address), std::move(peer)});
    session_ = std::prev(impl_->sessions.end());
    ++impl_->per_address[session_->address];
  }
  SessionSlot(SessionSlot&& other) noexcept
      : impl_(std::move(other.impl_)), session_(other.session_) {}
  SessionSlot& operator=(SessionSlot&&) = delete;
  ~SessionSlot() {
    if (!impl_) return;
    if (session_->evicted) {
      --impl_->evicted_pending;
    } else if (auto it = impl_->per_address.find(session_->address);
               it != impl_->per_address.end() && --it->second == 0) {
      impl_->per_address.erase(it);
    }
    impl_->sessions.erase(session_);
  }
  Impl& impl() const { return *impl_; }
  Impl::Session& session() const { return *session_; }

 private:
  std::shared_ptr<Impl> impl_;
  std::list<Impl::Session>::iterator session_;
};

// Makes a session's stream closable (by Stop() or an eviction) while the session runs.
class LiveStream {
 public:
  LiveStream(Impl::Session& session, beast::tcp_stream& stream) : session_(session) {
    session_.stream = &stream;
  }
  LiveStream(const LiveStream&) = delete;
  LiveStream& operator=(const LiveStream&) = delete;
  ~LiveStream() { session_.stream = nullptr; }

 private:
  Impl::Session& session_;
};

}  // namespace

// The connection side of an HttpStream; StreamState below binds it to a stream type.
struct HttpStream::State {
  explicit State(const asio::any_io_executor& executor) : watch_done(executor) {
    watch_done.expires_at(asio::steady_timer::time_point::max());
  }
  virtual ~State() = default;

  // Writes `bytes` to the connection within the server's write deadline.
  virtual awaitable<error_code> Send(std::string bytes) = 0;

  // The status line and headers of the streamed answer.
  std::string HeaderText() const;

  // Sets `gone` and runs the OnGone callbacks (once).
  void MarkGone();

  std::string content_type = "text/event-stream";
  unsigned version = 11;    // of the request; below 11: no chunking, the close ends the body
  bool keep_alive = false;  // announced in the header; the connection serves more requests
  bool started = false;     // the header went out (or its write failed)
  bool writing = false;     // a Write() is in progress
  bool gone = false;
  bool handler_done = false;  // the handler returned: no more callbacks, the watch stops
  bool watching = false;      // WatchForDisconnect is running
  std::vector<std::function<void()>> on_gone;
  // Cancelled when WatchForDisconnect ends (never expires by itself).
  asio::steady_timer watch_done;
};

std::string HttpStream::State::HeaderText() const {
  http::response<http::empty_body> header{http::status::ok, version};
  header.set(http::field::server, "flywheel");
  header.set(http::field::content_type, content_type);
  header.set(http::field::cache_control, "no-cache");
  header.set("X-Accel-Buffering", "no");
  if (version >= 11) header.chunked(true);
  header.keep_alive(keep_alive);
  std::ostringstream text;
  text << header.base();
  return std::move(text).str();
}

void HttpStream::State::MarkGone() {
  if (gone) return;
  gone = true;
  std::vector<std::function<void()>> callbacks = std::move(on_gone);
  on_gone.clear();
  for (std::function<void()>& callback : callbacks) {
    try {
      callback();
    } catch (const std::exception& e) {
      spdlog::warn("http: a stream's OnGone callback failed: {}", e.what());
    }
  }
}

HttpStream::HttpStream(std::shared_ptr<State> state) : state_(std::move(state)) {}

HttpStream::~HttpStream() = default;

void HttpStream::set_content_type(std::string content_type) {
  state_->content_type = std::move(content_type);
}

bool HttpStream::gone() const {
  return state_->gone;
}

void HttpStream::OnGone(std::function<void()> callback) {
  if (!callback || state_->handler_done) return;
  if (state_->gone) {
    callback();
    return;
  }
  state_->on_gone.push_back(std::move(callback));
}

awaitable<bool> HttpStream::Write(std::string data) {
  State& state = *state_;
  if (state.gone) co_return false;
  if (state.writing) {
    spdlog::error("http: HttpStream::Write while another Write is in progress");
    co_return false;
  }
  std::string frame;
  if (!state.started) {
    frame = state.HeaderText();
    state.started = true;
  }
  if (!data.empty() && state.version >= 11) {
    char size[16];
    const auto end = std::to_chars(size, size + sizeof(size), data.size(), 16).ptr;
    frame.append(size, end).append("\r\n").append(data).append("\r\n");
  } else {
    frame.append(data);
  }
  if (frame.empty()) co_return true;
  state.writing = true;
  awaitable<error_code> send = state.Send(std::move(frame));
  const error_code ec = co_await std::move(send);
  state.writing = false;
  if (ec) {
    spdlog::debug("http: cannot write to a stream: {}", ec.message());
    state.MarkGone();
  }
  co_return !state.gone;
}

namespace {

template <typename Stream>
struct StreamState final : HttpStream::State {
  StreamState(Impl& impl, Stream& stream, beast::flat_buffer& buffer)
      : State(stream.get_executor()), impl(impl), stream(stream), buffer(buffer) {}

  awaitable<error_code> Send(std::string bytes) override {
    error_code ec;
    beast::get_lowest_layer(stream).expires_after(impl.options.timeout);
    co_await asio::async_write(stream, asio::buffer(bytes),
                               asio::redirect_error(use_awaitable, ec));
    co_return ec;
  }

  Impl& impl;
  Stream& stream;
  // The connection's read buffer: bytes the client pipelines go where the next request's
  // read looks for them.
  beast::flat_buffer& buffer;
};

// Reads from the connection while a stream route's handler runs, so that a client that
// closes (or resets) it is noticed at once. Ends when the handler is done (the session
// cancels the read), the client is gone, or kPipelinedLimit bytes are buffered. The stream
// must not be read by anything else meanwhile; writes may go on beside it.
template <typename Stream>
awaitable<void> WatchForDisconnect(std::shared_ptr<StreamState<Stream>> state) {
  while (!state->handler_done && state->buffer.size() < kPipelinedLimit) {
    error_code ec;
    // Only the read's deadline: a Write in progress keeps its own.
    beast::get_lowest_layer(state->stream).expires_never();
    const size_t read = co_await state->stream.async_read_some(
        state->buffer.prepare(4096), asio::redirect_error(use_awaitable, ec));
    state->buffer.commit(read);
    if (ec) {
      if (!state->handler_done || ec != asio::error::operation_aborted) {
        spdlog::debug("http: a stream's client is gone: {}", ec.message());
        state->MarkGone();
      }
      co_return;
    }
  }
}

// What ServeRequests does after a stream route's request.
enum class StreamEnd {
  kRespond,      // send `response` (nothing was streamed)
  kNextRequest,  // the stream ended cleanly; read the next request
  kClose,        // the stream ended cleanly; close the connection
  kAbort,        // close the connection at once (client gone, write failed, handler threw)
};

// Runs WatchForDisconnect beside a stream route's handler (see HttpStream).
template <typename Stream>
void StartWatch(Impl& impl, const std::shared_ptr<StreamState<Stream>>& state) {
  state->watching = true;
  asio::co_spawn(impl.executor, WatchForDisconnect(state), [state](std::exception_ptr error) {
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        spdlog::warn("http: watching a stream failed: {}", e.what());
      } catch (...) {
        spdlog::warn("http: watching a stream failed");
      }
    }
    state->watching = false;
    state->watch_done.cancel();
  });
}

// After a stream route's handler streamed: ends the chunked body (the last chunk), or says
// why the connection closes instead.
template <typename Stream>
awaitable<StreamEnd> EndStream(Impl& impl, Stream& stream, const StreamState<Stream>& state,
                               bool failed) {
  if (failed || state.gone || impl.stopped) co_return StreamEnd::kAbort;
  if (state.version < 11) co_return StreamEnd::kClose;  // the close ends the body
  static constexpr std::string_view kLastChunk = "0\r\n\r\n";
  error_code ec;
  beast::get_lowest_layer(stream).expires_after(impl.options.timeout);
  co_await asio::async_write(stream, asio::buffer(kLastChunk.data(), kLastChunk.size()),
                             asio::redirect_error(use_awaitable, ec));
  if (ec) {
    spdlog::debug("http: cannot end a stream: {}", ec.message());
    co_return StreamEnd::kAbort;
  }
  co_return state.keep_alive ? StreamEnd::kNextRequest : StreamEnd::kClose;
}

// Serves a POST to a stream route: checks access, runs the handler with an HttpStream while
// WatchForDisconnect runs beside it, and ends the chunked body when the handler streamed.
// REQUIRES: `entry` stays valid until this coroutine first suspends (it copies the handler).
template <typename Stream>
awaitable<StreamEnd> ServeStream(Impl& impl, Stream& stream, beast::flat_buffer& buffer,
                                 Request& request, const Impl::PostEntry& entry,
                                 Response& response) {
  HttpStreamHandler handler = entry.stream_handler;  // the route table may change meanwhile
  if (std::optional<Response> denied = impl.Deny(request, entry.scope)) {
    response = std::move(*denied);
    impl.Finish(request, response);
    co_return StreamEnd::kRespond;
  }
  beast::tcp_stream& lowest = beast::get_lowest_layer(stream);
  error_code ec;
  lowest.socket().set_option(tcp::no_delay(true), ec);

  auto state = std::make_shared<StreamState<Stream>>(impl, stream, buffer);
  state->version = request.version();
  state->keep_alive = request.keep_alive() && request.version() >= 11 && !impl.stopped;
  StartWatch(impl, state);

  const std::string target(request.target());
  std::optional<HttpResponse> result;
  bool failed = false;
  {
    HttpStream writer(state);
    try {
      // Named first: GCC 12 mishandles temporaries inside a co_await full-expression.
      std::string body = std::move(request.body());
      awaitable<std::optional<HttpResponse>> call = handler(target, std::move(body), writer);
      result = co_await std::move(call);
    } catch (const std::exception& e) {
      spdlog::warn("http: stream handler for {} failed: {}", target, e.what());
      failed = true;
    }
  }
  state->handler_done = true;
  state->on_gone.clear();
  if (state->watching) {
    // Ends the watch's read; bytes it already read stay in `buffer`.
    lowest.socket().cancel(ec);
    co_await state->watch_done.async_wait(asio::redirect_error(use_awaitable, ec));
  }

  if (state->started) {
    if (result)
      spdlog::warn("http: stream handler for {} returned a response after streaming", target);
    awaitable<StreamEnd> end = EndStream(impl, stream, *state, failed);
    co_return co_await std::move(end);
  }
  if (!failed && !result) {
    spdlog::warn("http: stream handler for {} neither streamed nor answered", target);
    failed = true;
  }
  response = failed || result->status < 100 || result->status > 599
                 ? impl.ErrorFor(request, http::status::internal_server_error, "internal",
                                 "internal error")
                 : Impl::ToResponse(std::move(*result));
  impl.Finish(request, response);
  if (state->gone) response.keep_alive(false);
  co_return StreamEnd::kRespond;
}

// Reads and drops what the client still sends (the body of a refused request), bounded by
// kLingerBytes and kLingerTime, so that a close right after the answer does not reset it.
template <typename Stream>
awaitable<void> Linger(Stream& stream) {
  beast::tcp_stream& lowest = beast::get_lowest_layer(stream);
  error_code ec;
  if constexpr (std::is_same_v<Stream, beast::tcp_stream>) {
    lowest.socket().shutdown(tcp::socket::shutdown_send, ec);
  }
  lowest.expires_after(kLingerTime);
  size_t dropped = 0;
  char sink[4096];
  while (dropped < kLingerBytes) {
    const size_t n =
        co_await stream.async_read_some(asio::buffer(sink), asio::redirect_error(use_awaitable, ec));
    if (ec) break;
    dropped += n;
  }
}

// Writes `response` (a refusal or limit answer that closes the connection) and lingers.
template <typename Stream>
awaitable<void> RefuseAndClose(Impl& impl, Stream& stream, Response response) {
  response.keep_alive(false);
  response.prepare_payload();
  error_code ec;
  beast::get_lowest_layer(stream).expires_after(impl.options.timeout);
  co_await http::async_write(stream, response, asio::redirect_error(use_awaitable, ec));
  if (ec) co_return;
  awaitable<void> linger = Linger(stream);
  co_await std::move(linger);
}

// What ReadRequest ended with.
enum class ReadEnd {
  kRequest,      // a whole request is in the parser
  kEndOfStream,  // the client closed cleanly between requests
  kClosed,       // refused, failed or stopping: close the connection
};

// Reads one request into `parser`: the header into a buffer that holds at most kHeaderLimit
// bytes; access is decided from the header alone (Impl::Admit), so a client without a valid
// token is answered 401 and the connection closed before any of its body is read; then the
// route's body limit applies, to a Content-Length at once and to a chunked body as it
// arrives (413). A header over its limit is 431.
template <typename Stream>
awaitable<ReadEnd> ReadRequest(Impl& impl, Impl::Session& session, Stream& stream,
                               beast::flat_buffer& buffer,
                               http::request_parser<http::string_body>& parser) {
  beast::tcp_stream& lowest = beast::get_lowest_layer(stream);
  parser.header_limit(kHeaderLimit);
  // The parser checks Content-Length against this when the header completes, before the
  // route is known: the largest limit here, the route's own right after the header.
  parser.body_limit(impl.MaxBodyLimit());
  error_code ec;
  session.idle = true;
  session.idle_since = std::chrono::steady_clock::now();
  // Nothing beyond a header's worth is read before the request is admitted (bytes a
  // client pipelined earlier may already be here).
  buffer.max_size(std::max<size_t>(kHeaderLimit, buffer.size()));
  lowest.expires_after(impl.options.timeout);
  co_await http::async_read_header(stream, buffer, parser, asio::redirect_error(use_awaitable, ec));
  session.idle = false;
  if (ec == http::error::buffer_overflow) ec = http::error::header_limit;
  std::optional<Response> refused;
  if (!ec && !impl.stopped) refused = impl.Admit(parser.get());
  if (!ec && !impl.stopped && !refused) {
    buffer.max_size(std::numeric_limits<size_t>::max());
    const uint64_t limit = impl.BodyLimit(parser.get());
    if (parser.content_length() && *parser.content_length() > limit) {
      ec = http::error::body_limit;
    } else {
      parser.body_limit(limit);  // a chunked body is checked against it as it arrives
      // A streamed route's handler reads the body itself (BodyReader).
      if (impl.StreamedApi(parser.get()) == nullptr) {
        lowest.expires_after(impl.options.timeout);
        co_await http::async_read(stream, buffer, parser, asio::redirect_error(use_awaitable, ec));
      }
    }
  }
  if (ec == http::error::end_of_stream) co_return ReadEnd::kEndOfStream;
  if (ec == http::error::header_limit) {
    refused = impl.ErrorFor(parser.get(), http::status::request_header_fields_too_large,
                            "header_too_large",
                            "request header too large (limit " + std::to_string(kHeaderLimit) +
                                " bytes)");
  } else if (ec == http::error::body_limit) {
    refused = impl.ErrorFor(parser.get(), http::status::payload_too_large, "too_large",
                            "request body too large (limit " +
                                std::to_string(impl.BodyLimit(parser.get())) +
                                " bytes for this route)");
  }
  if (refused) {
    // An Admit() refusal answers a whole header; a limit's may answer a partial one, whose
    // version is not known: those keep HTTP/1.1.
    if (!ec) impl.Finish(parser.get(), *refused);
    // Named first: GCC 12 mishandles temporaries inside a co_await full-expression.
    awaitable<void> refuse = RefuseAndClose(impl, stream, std::move(*refused));
    co_await std::move(refuse);
    co_return ReadEnd::kClosed;
  }
  if (ec) {
    // Peers cause these (disconnects, timeouts, garbage); logging them louder would let
    // any client flood the log.
    spdlog::debug("http: closing connection after read error: {}", ec.message());
    co_return ReadEnd::kClosed;
  }
  co_return impl.stopped ? ReadEnd::kClosed : ReadEnd::kRequest;
}

// The body of a streamed API request (HttpBodyReader), read from the connection as the
// handler asks for it: the header's parser, moved into one that writes into the handler's
// buffers (buffer_body), so that no more than one read's worth is held here.
template <typename Stream>
class BodyReader final : public HttpBodyReader {
 public:
  // REQUIRES: `header` read the header and none of the body.
  BodyReader(Impl& impl, Stream& stream, beast::flat_buffer& buffer,
             http::request_parser<http::string_body>&& header, uint64_t limit)
      : impl_(impl), stream_(stream), buffer_(buffer), parser_(std::move(header)), limit_(limit) {}

  awaitable<Result<size_t>> Read(std::span<std::byte> out) override {
    while (error_.ok() && !parser_.is_done()) {
      parser_.get().body().data = out.data();
      parser_.get().body().size = out.size();
      error_code ec;
      beast::get_lowest_layer(stream_).expires_after(impl_.options.timeout);
      co_await http::async_read_some(stream_, buffer_, parser_,
                                     asio::redirect_error(use_awaitable, ec));
      const size_t got = out.size() - parser_.get().body().size;
      if (ec == http::error::need_buffer) ec = {};  // `out` is full
      if (ec == http::error::body_limit) {
        error_ = Status::ResourceExhausted("request body too large (limit " +
                                           std::to_string(limit_) +
                                           " bytes for this route)");
      } else if (ec) {
        error_ = Status::Unavailable("the request body ended after " +
                                     std::to_string(read_ + got) + " bytes: " + ec.message());
      }
      if (!error_.ok()) co_return error_;
      read_ += got;
      if (got > 0) co_return got;
    }
    if (!error_.ok()) co_return error_;
    co_return size_t{0};
  }

  std::optional<uint64_t> content_length() const override {
    if (!parser_.content_length()) return std::nullopt;
    return *parser_.content_length();
  }
  uint64_t bytes_read() const override { return read_; }

  // Reads and drops what the handler left of the body: Ok once it ended.
  awaitable<Status> Drain() {
    std::vector<std::byte> sink(256 * 1024);
    for (;;) {
      awaitable<Result<size_t>> read = Read(sink);
      Result<size_t> got = co_await std::move(read);
      if (!got.ok()) co_return got.status();
      if (*got == 0) co_return Status::Ok();
    }
  }

 private:
  Impl& impl_;
  Stream& stream_;
  beast::flat_buffer& buffer_;
  http::request_parser<http::buffer_body> parser_;
  const uint64_t limit_;  // the route's body limit, for the 413's message
  uint64_t read_ = 0;
  Status error_;
};

// Serves a request to a streamed API route: the handler reads the body through a
// BodyReader; what it leaves is read and dropped before the answer goes out, so that the
// connection can serve the next request. A body that fails (the client left, a deadline, a
// chunked body past the limit: 413) closes the connection.
template <typename Stream>
awaitable<StreamEnd> ServeStreamedApi(Impl& impl, Impl::Session& session, Stream& stream,
                                      beast::flat_buffer& buffer,
                                      http::request_parser<http::string_body>& parser,
                                      const Impl::ApiEntry& entry, Response& response) {
  Request header(parser.get().base());  // the parser's message moves into the reader's
  if (beast::iequals(header[http::field::expect], "100-continue")) {
    // Admitted and within the limit: a client that waits for this (curl -T) sends at once.
    static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    error_code ec;
    beast::get_lowest_layer(stream).expires_after(impl.options.timeout);
    co_await asio::async_write(stream, asio::buffer(kContinue.data(), kContinue.size()),
                               asio::redirect_error(use_awaitable, ec));
    if (ec) co_return StreamEnd::kAbort;
  }
  BodyReader<Stream> reader(impl, stream, buffer, std::move(parser), impl.BodyLimit(header));
  std::string peer = session.peer;
  awaitable<Response> handled = impl.HandleApi(header, entry, std::move(peer), &reader);
  response = co_await std::move(handled);
  awaitable<Status> drain = reader.Drain();
  const Status drained = co_await std::move(drain);
  if (drained.ok()) co_return StreamEnd::kRespond;
  if (drained.code() == StatusCode::kResourceExhausted) {
    Response refused = impl.ErrorFor(header, http::status::payload_too_large, "too_large",
                                     drained.message());
    impl.Finish(header, refused);
    awaitable<void> refuse = RefuseAndClose(impl, stream, std::move(refused));
    co_await std::move(refuse);
  } else {
    spdlog::debug("http: closing connection: {}", drained.message());
  }
  co_return StreamEnd::kAbort;
}

// Answers one request by its route: into `response` (kRespond), or streamed (the other
// StreamEnd values).
template <typename Stream>
awaitable<StreamEnd> Dispatch(Impl& impl, Impl::Session& session, Stream& stream,
                              beast::flat_buffer& buffer,
                              http::request_parser<http::string_body>& parser,
                              Response& response) {
  Request& request = parser.get();
  if (const Impl::ApiEntry* streamed = impl.StreamedApi(request)) {
    awaitable<StreamEnd> serve =
        ServeStreamedApi(impl, session, stream, buffer, parser, *streamed, response);
    co_return co_await std::move(serve);
  }
  const std::string_view target(request.target().data(), request.target().size());
  const std::string_view path = target.substr(0, target.find('?'));
  auto post = impl.post_routes.find(path);
  const bool is_post = request.method() == http::verb::post && post != impl.post_routes.end();
  const Impl::ApiEntry* api = nullptr;
  if (!impl.routes.count(path) && !impl.post_routes.count(path)) api = impl.FindApi(path);
  if (is_post && post->second.stream_handler) {
    awaitable<StreamEnd> serve = ServeStream(impl, stream, buffer, request, post->second, response);
    co_return co_await std::move(serve);
  }
  if (is_post) {
    awaitable<Response> handled = impl.HandlePost(request, post->second);
    response = co_await std::move(handled);
  } else if (api != nullptr) {
    // The body moves into the handler's request (a part may be large); nothing after this
    // reads it again.
    std::string peer = session.peer;
    awaitable<Response> handled = impl.HandleApi(request, *api, std::move(peer));
    response = co_await std::move(handled);
  } else {
    response = impl.Handle(request);
  }
  co_return StreamEnd::kRespond;
}

// Serves requests on an established stream until the peer closes, an error, a timeout or
// a request without keep-alive. Returns true when the connection ended cleanly (so a TLS
// close_notify is worth sending).
template <typename Stream>
awaitable<bool> ServeRequests(Impl& impl, Impl::Session& session, Stream& stream) {
  beast::tcp_stream& lowest = beast::get_lowest_layer(stream);
  beast::flat_buffer buffer;
  for (int served = 0; served < kRequestsPerConnection; ++served) {
    http::request_parser<http::string_body> parser;
    awaitable<ReadEnd> read = ReadRequest(impl, session, stream, buffer, parser);
    const ReadEnd got = co_await std::move(read);
    if (got != ReadEnd::kRequest) co_return got == ReadEnd::kEndOfStream;

    Response response;
    awaitable<StreamEnd> dispatch = Dispatch(impl, session, stream, buffer, parser, response);
    const StreamEnd end = co_await std::move(dispatch);
    if (end != StreamEnd::kRespond) {
      session.served = true;
      if (end == StreamEnd::kNextRequest) continue;
      co_return end == StreamEnd::kClose;
    }
    // A refused credential ends the connection: a client cannot keep a slot by retrying
    // a wrong token on it.
    if (response.result() == http::status::unauthorized ||
        served + 1 == kRequestsPerConnection) {
      response.keep_alive(false);
    }
    error_code ec;
    lowest.expires_after(impl.options.timeout);
    co_await http::async_write(stream, response, asio::redirect_error(use_awaitable, ec));
    session.served = true;
    if (ec) {
      spdlog::debug("http: cannot write response: {}", ec.message());
      co_return false;
    }
    if (!response.keep_alive()) co_return true;
  }
  co_return true;
}

awaitable<void> RunSession(SessionSlot slot, tcp::socket socket) {
  Impl& impl = slot.impl();
  Impl::Session& session = slot.session();
  try {
    if (impl.stopped || session.evicted) co_return;
    error_code ec;
    if (impl.options.tls) {
      beast::ssl_stream<beast::tcp_stream> stream(std::move(socket), *impl.options.tls);
      beast::tcp_stream& lowest = beast::get_lowest_layer(stream);
      LiveStream live(session, lowest);
      lowest.expires_after(impl.options.timeout);
      co_await stream.async_handshake(asio::ssl::stream_base::server,
                                      asio::redirect_error(use_awaitable, ec));
      if (ec) {
        spdlog::debug("http: TLS handshake failed: {}", ec.message());
        co_return;
      }
      if (co_await ServeRequests(impl, session, stream) && !impl.stopped && !session.evicted) {
        lowest.expires_after(impl.options.timeout);
        co_await stream.async_shutdown(asio::redirect_error(use_awaitable, ec));
      }
    } else {
      beast::tcp_stream stream(std::move(socket));
      LiveStream live(session, stream);
      if (co_await ServeRequests(impl, session, stream) && !session.evicted) {
        stream.socket().shutdown(tcp::socket::shutdown_send, ec);
      }
    }
  } catch (const std::exception& e) {
    spdlog::warn("http: session failed: {}", e.what());
  }
}

// Makes room for a connection from `address`: true when it is under both limits, or an idle
// connection was closed to make room.
bool MakeRoom(Impl& impl, const std::string& address) {
  auto it = impl.per_address.find(address);
  const size_t from_address = it == impl.per_address.end() ? 0 : it->second;
  if (from_address >= impl.options.max_connections_per_address) {
    // Only this address's own idle connections make room for it.
    return impl.EvictIdle(address);
  }
  if (impl.counted_sessions() >= impl.options.max_connections) return impl.EvictIdle("");
  return true;
}

awaitable<void> AcceptLoop(std::shared_ptr<Impl> impl) {
  try {
    for (;;) {
      error_code ec;
      tcp::socket socket =
          co_await impl->acceptor.async_accept(asio::redirect_error(use_awaitable, ec));
      if (impl->stopped || ec == asio::error::operation_aborted) co_return;
      if (ec) {
        // Typically EMFILE; back off briefly instead of spinning on the error.
        spdlog::warn("http: accept on port {} failed: {}", impl->port, ec.message());
        asio::steady_timer timer(impl->executor, std::chrono::milliseconds(50));
        co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
        continue;
      }
      const tcp::endpoint remote = socket.remote_endpoint(ec);
      if (ec) continue;  // already gone
      std::string address = remote.address().to_string();
      if (!MakeRoom(*impl, address)) {
        // Every connection is busy: refuse this one. Logged at most once a second, so that a
        // flood of connections cannot flood the log.
        const auto now = std::chrono::steady_clock::now();
        if (now - impl->last_refusal_log >= std::chrono::seconds(1)) {
          impl->last_refusal_log = now;
          spdlog::warn("http: {} connections open ({} from {}), all busy: closing a new one",
                       impl->counted_sessions(), impl->per_address[address], address);
        }
        socket.close(ec);
        continue;
      }
      std::string peer = address + ":" + std::to_string(remote.port());
      asio::co_spawn(impl->executor,
                     RunSession(SessionSlot(impl, std::move(address), std::move(peer)),
                                std::move(socket)),
                     [](std::exception_ptr error) {
                       if (!error) return;
                       try {
                         std::rethrow_exception(error);
                       } catch (const std::exception& e) {
                         spdlog::warn("http: session failed: {}", e.what());
                       } catch (...) {
                         spdlog::warn("http: session failed");
                       }
                     });
    }
  } catch (const std::exception& e) {
    spdlog::warn("http: accept loop on port {} failed: {}", impl->port, e.what());
  }
}

}  // namespace

Response HttpServer::Impl::Handle(const Request& request) {
  const std::string target(request.target());
  const std::string_view path = std::string_view(target).substr(0, target.find('?'));
  const bool is_head = request.method() == http::verb::head;
  Response response;
  auto route = routes.find(path);
  const std::string method(request.method_string());
  if (route == routes.end() && post_routes.count(path)) {
    response = ErrorFor(request, http::status::method_not_allowed, "method_not_allowed",
                        method + " is not allowed on " + std::string(path) + "; use POST");
    response.set(http::field::allow, "POST");
  } else if (request.method() != http::verb::get && !is_head) {
    response = ErrorFor(request, http::status::method_not_allowed, "method_not_allowed",
                        method + " is not allowed on " + std::string(path) + "; use GET");
    response.set(http::field::allow, "GET, HEAD");
  } else if (route == routes.end()) {
    response = ErrorFor(request, http::status::not_found, "not_found",
                        "no route " + std::string(path));
  } else if (std::optional<Response> denied;
             !route->second.is_public && (denied = Deny(request, route->second.scope))) {
    response = std::move(*denied);
  } else {
    HttpResponse result;
    bool failed = false;
    try {
      result = route->second.handler(target);
    } catch (const std::exception& e) {
      spdlog::warn("http: handler for {} failed: {}", path, e.what());
      failed = true;
    }
    if (!failed && (result.status < 100 || result.status > 599)) {
      spdlog::warn("http: handler for {} returned status {}", path, result.status);
      failed = true;
    }
    response = failed ? ErrorFor(request, http::status::internal_server_error, "internal",
                                 "internal error")
                      : ToResponse(std::move(result));
  }
  Finish(request, response);
  if (is_head) response.body().clear();  // keeps the Content-Length of the GET
  return response;
}

uint64_t HttpServer::Impl::BodyLimit(const Request& request) const {
  const std::string_view target(request.target().data(), request.target().size());
  const std::string_view path = target.substr(0, target.find('?'));
  auto post = post_routes.find(path);
  if (request.method() == http::verb::post && post != post_routes.end())
    return post->second.body_limit;
  if (!routes.count(path) && !post_routes.count(path)) {
    if (const ApiEntry* api = FindApi(path)) {
      if (!api->limit_for) return api->body_limit;
      const std::string_view method(request.method_string().data(), request.method_string().size());
      return std::min(api->body_limit, api->limit_for(method, path));
    }
  }
  return kRequestBodyLimit;
}

const HttpServer::Impl::ApiEntry* HttpServer::Impl::StreamedApi(const Request& request) const {
  const std::string_view target(request.target().data(), request.target().size());
  const std::string_view path = target.substr(0, target.find('?'));
  if (routes.count(path) || post_routes.count(path)) return nullptr;
  const ApiEntry* api = FindApi(path);
  if (api == nullptr || !api->streamed) return nullptr;
  const std::string_view method(request.method_string().data(), request.method_string().size());
  return api->streamed(method, path) ? api : nullptr;
}

uint32_t HttpServer::Impl::ScopesOf(const Request& request) const {
  if (options.token.empty() && options.write_token.empty() && options.scoped_tokens.empty()) {
    return ~0u;
  }
  const std::string_view presented = BearerToken(request);
  if (presented.empty()) return 0;
  bool admin_elsewhere = false;
  for (const ScopedToken& scoped : options.scoped_tokens) admin_elsewhere |= (scoped.scopes & kScopeAdmin) != 0;
  // Every comparison runs, so the time taken does not say which token matched.
  uint32_t scopes = 0;
  if (!options.token.empty() && TokensEqual(presented, options.token)) scopes |= kScopeFleet;
  if (!options.write_token.empty() && TokensEqual(presented, options.write_token)) {
    scopes |= kScopeRead | kScopePush | (admin_elsewhere ? 0u : uint32_t{kScopeAdmin});
  }
  for (const ScopedToken& scoped : options.scoped_tokens) {
    if (!scoped.token.empty() && TokensEqual(presented, scoped.token)) scopes |= scoped.scopes;
  }
  return scopes;
}

std::optional<Response> HttpServer::Impl::Deny(const Request& request, uint32_t scope) const {
  const uint32_t scopes = ScopesOf(request);
  if (scopes & scope) return std::nullopt;
  if (scopes == 0) {
    Response response = ErrorFor(request, http::status::unauthorized, "unauthorized",
                                 "missing or unknown bearer token");
    response.set(http::field::www_authenticate, "Bearer");
    return response;
  }
  return ErrorFor(request, http::status::forbidden, "forbidden",
                  std::string("this token does not grant '") + ScopeName(scope) + "'");
}

Credential HttpServer::Impl::CredentialOf(const Request& request) const {
  const uint32_t scopes = ScopesOf(request);
  if (scopes == ~0u) return Credential::kNone;  // no tokens at all
  if (scopes & kScopePush) return Credential::kWrite;
  return scopes != 0 ? Credential::kRead : Credential::kNone;
}

const HttpServer::Impl::ApiEntry* HttpServer::Impl::FindApi(std::string_view path) const {
  const ApiEntry* best = nullptr;
  size_t best_length = 0;
  for (const auto& [prefix, entry] : api_routes) {
    const bool match = path == prefix || (path.size() > prefix.size() && path.starts_with(prefix) &&
                                          path[prefix.size()] == '/');
    if (match && prefix.size() >= best_length) {
      best = &entry;
      best_length = prefix.size();
    }
  }
  return best;
}

awaitable<Response> HttpServer::Impl::HandleApi(Request& request, const ApiEntry& entry,
                                                std::string peer, HttpBodyReader* reader) {
  HttpRequest api;
  api.method = std::string(request.method_string());
  api.target = std::string(request.target());
  api.path = api.target.substr(0, api.target.find('?'));
  api.body = std::move(request.body());
  api.body_reader = reader;
  api.credential = CredentialOf(request);
  api.scopes = ScopesOf(request);
  api.peer = std::move(peer);
  if (api.scopes != 0 && api.scopes != ~0u) api.identity = TokenIdentity(BearerToken(request));
  HttpResponse result;
  bool failed = false;
  try {
    HttpApiHandler handler = entry.handler;  // the route table may change while this runs
    awaitable<HttpResponse> call = handler(std::move(api));
    result = co_await std::move(call);
  } catch (const std::exception& e) {
    spdlog::warn("http: handler for {} failed: {}", std::string(request.target()), e.what());
    failed = true;
  }
  Response response = failed || result.status < 100 || result.status > 599
                          ? ErrorFor(request, http::status::internal_server_error, "internal",
                                     "internal error")
                          : ToResponse(std::move(result));
  if (response.result() == http::status::unauthorized) {
    response.set(http::field::www_authenticate, "Bearer");
  }
  Finish(request, response);
  co_return response;
}

Response HttpServer::Impl::ToResponse(HttpResponse result) {
  Response response;
  response.result(static_cast<unsigned>(result.status));
  if (!result.content_type.empty()) response.set(http::field::content_type, result.content_type);
  response.body() = std::move(result.body);
  return response;
}

ErrorShape HttpServer::Impl::ShapeOf(const Request& request) const {
  const std::string_view target(request.target().data(), request.target().size());
  const std::string_view path = target.substr(0, target.find('?'));
  if (auto route = routes.find(path); route != routes.end()) return route->second.shape;
  if (auto post = post_routes.find(path); post != post_routes.end()) return post->second.shape;
  return ErrorShape::kFlywheel;
}

Response HttpServer::Impl::ErrorFor(const Request& request, http::status status, std::string code,
                                    std::string message) const {
  const ApiError error{static_cast<int>(status), std::move(code), std::move(message)};
  return ToResponse(ErrorResponse(error, ShapeOf(request)));
}

void HttpServer::Impl::Finish(const Request& request, Response& response) const {
  response.version(request.version());
  response.set(http::field::server, "flywheel");
  response.keep_alive(request.keep_alive() && !stopped);
  response.prepare_payload();
}

uint64_t HttpServer::Impl::MaxBodyLimit() const {
  uint64_t limit = kRequestBodyLimit;
  for (const auto& [path, entry] : post_routes) limit = std::max(limit, entry.body_limit);
  for (const auto& [path, entry] : api_routes) limit = std::max(limit, entry.body_limit);
  return limit;
}

awaitable<Response> HttpServer::Impl::HandlePost(const Request& request, const PostEntry& entry) {
  const std::string target(request.target());
  Response response;
  if (std::optional<Response> denied = Deny(request, entry.scope)) {
    response = std::move(*denied);
  } else {
    HttpResponse result;
    bool failed = false;
    try {
      HttpPostHandler handler = entry.handler;  // the route table may change while this runs
      // Named first: GCC 12 mishandles temporaries inside a co_await full-expression.
      std::string body = request.body();
      awaitable<HttpResponse> call = handler(target, std::move(body));
      result = co_await std::move(call);
    } catch (const std::exception& e) {
      spdlog::warn("http: POST handler for {} failed: {}", target, e.what());
      failed = true;
    }
    response = failed || result.status < 100 || result.status > 599
                   ? ErrorFor(request, http::status::internal_server_error, "internal",
                              "internal error")
                   : ToResponse(std::move(result));
  }
  Finish(request, response);
  co_return response;
}

void HttpServer::Impl::StopAll() {
  if (stopped) return;
  stopped = true;
  error_code ec;
  acceptor.close(ec);
  // Closing a stream completes its pending operation with an error, which ends the
  // session (later, on the executor: the list does not change meanwhile).
  for (Session& session : sessions) {
    if (session.stream != nullptr) session.stream->close();
  }
}

bool HttpServer::Impl::EvictIdle(std::string_view address) {
  Session* oldest = nullptr;
  for (Session& session : sessions) {
    if (session.evicted || !session.idle || session.stream == nullptr) continue;
    if (!address.empty() && session.address != address) continue;
    // Kept-alive connections go first: a fresh one may be about to send its request.
    if (oldest == nullptr || (session.served && !oldest->served) ||
        (session.served == oldest->served && session.idle_since < oldest->idle_since)) {
      oldest = &session;
    }
  }
  if (oldest == nullptr) return false;
  spdlog::debug("http: closing an idle connection from {} to make room", oldest->peer);
  oldest->evicted = true;
  ++evicted_pending;
  if (auto it = per_address.find(oldest->address); it != per_address.end() && --it->second == 0) {
    per_address.erase(it);
  }
  oldest->stream->close();
  return true;
}

std::optional<Response> HttpServer::Impl::Admit(const Request& request) const {
  const std::string_view target(request.target().data(), request.target().size());
  const std::string_view path = target.substr(0, target.find('?'));
  if (auto route = routes.find(path); route != routes.end()) {
    if (route->second.is_public) return std::nullopt;
    return Deny(request, route->second.scope);
  }
  if (auto post = post_routes.find(path); post != post_routes.end()) {
    if (request.method() != http::verb::post) return std::nullopt;  // 405, no body read
    return Deny(request, post->second.scope);
  }
  // API routes decide on scopes themselves, from the request; but a client that presents no
  // valid token at all is refused before its body is read when it sends one.
  if (FindApi(path) != nullptr && has_tokens() && ScopesOf(request) == 0) {
    const bool has_body = request.chunked() || (request.has_content_length() &&
                                                request[http::field::content_length] != "0");
    if (has_body) {
      Response response = ErrorFor(request, http::status::unauthorized, "unauthorized",
                                   "missing or unknown bearer token");
      response.set(http::field::www_authenticate, "Bearer");
      return response;
    }
  }
  return std::nullopt;
}

HttpServer::HttpServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() {
  if (impl_) impl_->StopAll();
}

Result<std::unique_ptr<HttpServer>> HttpServer::Start(asio::any_io_executor executor,
                                                      const Endpoint& listen,
                                                      HttpServerOptions options) {
  const std::string where = "cannot listen on " + listen.ToString();
  auto impl = std::make_shared<Impl>(executor, std::move(options));
  error_code ec;
  asio::ip::address address = asio::ip::make_address(listen.host, ec);
  if (ec) {
    tcp::resolver resolver(executor);
    auto results =
        resolver.resolve(listen.host, std::to_string(listen.port), tcp::resolver::passive, ec);
    if (ec || results.empty()) {
      return Status::Unavailable(where + ": cannot resolve " + listen.host + ": " +
                                 (ec ? ec.message() : "no addresses"));
    }
    address = results.begin()->endpoint().address();
  }
  const tcp::endpoint endpoint(address, listen.port);
  tcp::acceptor& acceptor = impl->acceptor;
  if (acceptor.open(endpoint.protocol(), ec); ec) {
    return Status::Unavailable(where + ": " + ec.message());
  }
  if (acceptor.set_option(asio::socket_base::reuse_address(true), ec); ec) {
    return Status::Unavailable(where + ": " + ec.message());
  }
  if (acceptor.bind(endpoint, ec); ec) return Status::Unavailable(where + ": " + ec.message());
  if (acceptor.listen(asio::socket_base::max_listen_connections, ec); ec) {
    return Status::Unavailable(where + ": " + ec.message());
  }
  impl->port = acceptor.local_endpoint(ec).port();
  if (ec) return Status::Unavailable(where + ": " + ec.message());

  asio::co_spawn(executor, AcceptLoop(impl), asio::detached);
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

void HttpServer::Route(const std::string& path, HttpHandler handler, bool is_public,
                       uint32_t scope, ErrorShape shape) {
  impl_->routes[path] = Impl::RouteEntry{std::move(handler), is_public, scope, shape};
}

void HttpServer::RoutePost(const std::string& path, HttpPostHandler handler, uint64_t body_limit,
                           uint32_t scope, ErrorShape shape) {
  impl_->post_routes[path] = Impl::PostEntry{std::move(handler), nullptr, body_limit, scope, shape};
}

void HttpServer::RoutePostStream(const std::string& path, HttpStreamHandler handler,
                                 uint64_t body_limit, uint32_t scope, ErrorShape shape) {
  impl_->post_routes[path] = Impl::PostEntry{nullptr, std::move(handler), body_limit, scope, shape};
}

std::string TokenIdentity(std::string_view token) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest);
  return "token:" + HexEncode(std::span<const uint8_t>(digest, 8));
}

const char* ScopeName(uint32_t scope) {
  switch (scope) {
    case kScopeRead:
      return "read";
    case kScopeSample:
      return "sample";
    case kScopeSubmit:
      return "submit";
    case kScopePush:
      return "push";
    case kScopeAdmin:
      return "admin";
    case kScopeTrain:
      return "train";
    default:
      return "several scopes";
  }
}

Result<uint32_t> ParseScopes(const std::string& text) {
  uint32_t scopes = 0;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string name = text.substr(begin, end - begin);
    uint32_t scope = 0;
    for (uint32_t bit : {kScopeRead, kScopeSample, kScopeSubmit, kScopePush, kScopeAdmin, kScopeTrain}) {
      if (name == ScopeName(bit)) scope = bit;
    }
    if (scope == 0) {
      return Status::InvalidArgument("unknown scope '" + name +
                                     "' (expected read, sample, submit, push, admin or train)");
    }
    scopes |= scope;
    begin = end + 1;
  }
  return scopes;
}

void HttpServer::RouteApi(const std::string& prefix, HttpApiHandler handler, uint64_t body_limit,
                          HttpBodyLimit limit_for, HttpBodyStreamed streamed) {
  impl_->api_routes[prefix] = Impl::ApiEntry{std::move(handler), body_limit, std::move(limit_for),
                                             std::move(streamed)};
}

uint16_t HttpServer::port() const {
  return impl_->port;
}

void HttpServer::Stop() {
  impl_->StopAll();
}

namespace {

struct GetContext {
  Endpoint endpoint;
  std::string target;
  const HttpGetOptions& options;
  std::chrono::steady_clock::time_point deadline;
  http::verb method = http::verb::get;
  std::string body;
  std::string content_type;
  // Non-null: the body is read as it arrives and handed to *on_data (HttpPostStream).
  const std::function<bool(std::string_view)>* on_data = nullptr;
};

// Maps a failed step to Unavailable, naming the step ("connect", "TLS handshake", ...).
Status StepFailed(const std::string& step, const error_code& ec) {
  std::string reason = ec == beast::error::timeout ? "timed out" : ec.message();
  return Status::Unavailable(step + ": " + reason);
}

HttpResponse StatusAndType(const http::response_header<>& header) {
  HttpResponse result;
  result.status = static_cast<int>(header.result_int());
  auto content_type = header.find(http::field::content_type);
  result.content_type =
      content_type == header.end() ? std::string() : std::string(content_type->value());
  return result;
}

// Reads a response piece by piece, handing each to *get.on_data (or collecting the body
// when that is empty) until it ends or on_data returns false.
template <typename Stream>
awaitable<Result<HttpResponse>> ReadStreamed(GetContext& get, Stream& stream) {
  beast::tcp_stream& lowest = beast::get_lowest_layer(stream);
  beast::flat_buffer buffer;
  http::response_parser<http::buffer_body> parser;
  // The call's deadline bounds a stream. Not boost::none: Boost 1.74 then rejects every
  // Content-Length.
  parser.body_limit(std::numeric_limits<std::uint64_t>::max());
  error_code ec;
  lowest.expires_at(get.deadline);
  co_await http::async_read_header(stream, buffer, parser, asio::redirect_error(use_awaitable, ec));
  if (ec) co_return StepFailed("read response", ec);
  HttpResponse result = StatusAndType(parser.get().base());
  const std::function<bool(std::string_view)>& on_data = *get.on_data;
  std::vector<char> piece(16 * 1024);
  while (!parser.is_done()) {
    parser.get().body().data = piece.data();
    parser.get().body().size = piece.size();
    lowest.expires_at(get.deadline);
    co_await http::async_read_some(stream, buffer, parser, asio::redirect_error(use_awaitable, ec));
    if (ec == http::error::need_buffer) ec = {};  // `piece` is full
    if (ec) co_return StepFailed("read response body", ec);
    const size_t size = piece.size() - parser.get().body().size;
    if (size == 0) continue;
    if (!on_data) {
      if (result.body.size() + size > kResponseBodyLimit) {
        co_return Status::Unavailable("read response body: over " +
                                      std::to_string(kResponseBodyLimit) + " bytes");
      }
      result.body.append(piece.data(), size);
    } else if (!on_data(std::string_view(piece.data(), size))) {
      lowest.close();
      co_return result;
    }
  }
  co_return result;
}

template <typename Stream>
awaitable<Result<HttpResponse>> Exchange(GetContext& get, Stream& stream) {
  beast::tcp_stream& lowest = beast::get_lowest_layer(stream);
  Request request{get.method, get.target, 11};
  request.set(http::field::host, get.endpoint.ToString());
  if (get.method != http::verb::get && get.method != http::verb::head) {
    if (!get.content_type.empty()) request.set(http::field::content_type, get.content_type);
    request.body() = get.body;
    request.prepare_payload();
  }
  request.set(http::field::user_agent, "flywheel");
  if (!get.options.token.empty()) {
    request.set(http::field::authorization, "Bearer " + get.options.token);
  }
  request.keep_alive(false);
  error_code ec;
  lowest.expires_at(get.deadline);
  co_await http::async_write(stream, request, asio::redirect_error(use_awaitable, ec));
  // A server may answer (401, 413) and close before the whole body is sent: its answer is
  // still worth reading. Any other failure ends the call.
  const bool answered_early = ec == asio::error::broken_pipe || ec == asio::error::connection_reset;
  if (ec && !answered_early) co_return StepFailed("send request", ec);
  const error_code write_error = ec;
  if (get.on_data != nullptr) co_return co_await ReadStreamed(get, stream);

  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(kResponseBodyLimit);
  lowest.expires_at(get.deadline);
  co_await http::async_read(stream, buffer, parser, asio::redirect_error(use_awaitable, ec));
  if (ec) co_return StepFailed(write_error ? "send request" : "read response", write_error ? write_error : ec);
  Response response = parser.release();
  HttpResponse result = StatusAndType(response.base());
  result.body = std::move(response.body());
  co_return result;
}

awaitable<Result<HttpResponse>> Fetch(GetContext& get) {
  auto executor = co_await asio::this_coro::executor;
  error_code ec;
  std::vector<tcp::endpoint> addresses;
  asio::ip::address address = asio::ip::make_address(get.endpoint.host, ec);
  if (!ec) {
    addresses.emplace_back(address, get.endpoint.port);
  } else {
    // Bounded by the system resolver, not by the deadline.
    tcp::resolver resolver(executor);
    auto results =
        co_await resolver.async_resolve(get.endpoint.host, std::to_string(get.endpoint.port),
                                        asio::redirect_error(use_awaitable, ec));
    if (ec) co_return StepFailed("resolve " + get.endpoint.host, ec);
    for (const auto& entry : results) addresses.push_back(entry.endpoint());
  }

  beast::tcp_stream tcp_stream(executor);
  tcp_stream.expires_at(get.deadline);
  co_await tcp_stream.async_connect(addresses, asio::redirect_error(use_awaitable, ec));
  if (ec) co_return StepFailed("connect", ec);
  if (!get.options.tls) co_return co_await Exchange(get, tcp_stream);

  beast::ssl_stream<beast::tcp_stream> stream(std::move(tcp_stream), *get.options.tls);
  const std::string& host = get.endpoint.host;
  asio::ip::make_address(host, ec);
  // SNI carries names only, never addresses (RFC 6066).
  if (ec && SSL_set_tlsext_host_name(stream.native_handle(), host.c_str()) != 1) {
    co_return Status::Unavailable("cannot set TLS server name " + host);
  }
  stream.set_verify_mode(asio::ssl::verify_peer, ec);
  if (!ec) stream.set_verify_callback(asio::ssl::host_name_verification(host), ec);
  if (ec) co_return StepFailed("configure TLS", ec);
  beast::get_lowest_layer(stream).expires_at(get.deadline);
  co_await stream.async_handshake(asio::ssl::stream_base::client,
                                  asio::redirect_error(use_awaitable, ec));
  if (ec) co_return StepFailed("TLS handshake", ec);
  co_return co_await Exchange(get, stream);
}

// co_spawn's completion wants a default-constructible result, so the outcome goes to `out`.
awaitable<void> RunGet(GetContext get, std::optional<Result<HttpResponse>>* out) {
  *out = co_await Fetch(get);
}

}  // namespace

namespace {

Result<HttpResponse> Request1(const Endpoint& endpoint, const std::string& target,
                              const HttpGetOptions& options, http::verb method,
                              const std::string& body, const std::string& content_type,
                              const std::function<bool(std::string_view)>* on_data = nullptr) {
  const std::string url =
      std::string(options.tls ? "https://" : "http://") + endpoint.ToString() + target;
  std::optional<Result<HttpResponse>> result;
  try {
    asio::io_context io_context;
    GetContext get{.endpoint = endpoint,
                   .target = target,
                   .options = options,
                   .deadline = std::chrono::steady_clock::now() + options.timeout,
                   .method = method,
                   .body = body,
                   .content_type = content_type,
                   .on_data = on_data};
    asio::co_spawn(io_context, RunGet(std::move(get), &result), [&](std::exception_ptr error) {
      if (!error) return;
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        result = Status::Unavailable(e.what());
      } catch (...) {
        result = Status::Unavailable("unknown exception");
      }
    });
    io_context.run();
  } catch (const std::exception& e) {
    result = Status::Unavailable(e.what());
  }
  if (!result) result = Status::Internal("request did not complete");
  if (!result->ok()) {
    return result->status().WithContext(std::string(http::to_string(method)) + " " + url);
  }
  return std::move(*result);
}

}  // namespace

Result<HttpResponse> HttpGet(const Endpoint& endpoint, const std::string& target,
                             const HttpGetOptions& options) {
  return Request1(endpoint, target, options, http::verb::get, {}, {});
}

Result<HttpResponse> HttpCall(const Endpoint& endpoint, const std::string& method,
                              const std::string& target, const std::string& body,
                              const HttpGetOptions& options, const std::string& content_type) {
  const http::verb verb = http::string_to_verb(method);
  if (verb == http::verb::unknown) {
    return Status::InvalidArgument("unknown HTTP method '" + method + "'");
  }
  return Request1(endpoint, target, options, verb, body, body.empty() ? std::string() : content_type);
}

Result<HttpResponse> HttpPost(const Endpoint& endpoint, const std::string& target,
                              const std::string& body, const HttpGetOptions& options,
                              const std::string& content_type) {
  return Request1(endpoint, target, options, http::verb::post, body, content_type);
}

Result<HttpResponse> HttpPostStream(const Endpoint& endpoint, const std::string& target,
                                    const std::string& body, const HttpGetOptions& options,
                                    const std::function<bool(std::string_view)>& on_data,
                                    const std::string& content_type) {
  return Request1(endpoint, target, options, http::verb::post, body, content_type, &on_data);
}

}  // namespace flywheel::transport
