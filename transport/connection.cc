#include "transport/connection.h"

#include "transport/io_pool.h"
#include "transport/tls_stream.h"

#include "base/env.h"

#include <spdlog/spdlog.h>

#include <array>
#include <cstdlib>
#include <unordered_set>

namespace flywheel::transport {

using namespace std::chrono_literals;

// A plain socket or our batched TLS stream (transport/tls_stream.h: one socket write per
// 512 KB of records, not per 16 KB record as with Asio's ssl::stream); deadlines are the
// watchdog's and DeadlineGuard's.
struct Connection::Stream {
  std::optional<tcp::socket> plain;
  std::unique_ptr<TlsStream> tls;
  std::string cipher;  // the suite the handshake chose (set when the Connection is made)

  tcp::socket& lowest() { return tls ? tls->next_layer() : *plain; }

  template <typename Buffers>
  awaitable<size_t> Read(const Buffers& buffers, error_code& ec) {
    if (tls) co_return co_await tls->Read(buffers, ec);
    co_return co_await asio::async_read(*plain, buffers, asio::redirect_error(use_awaitable, ec));
  }
  template <typename Buffers>
  awaitable<size_t> Write(const Buffers& buffers, error_code& ec) {
    if (tls) co_return co_await tls->Write(buffers, ec);
    co_return co_await asio::async_write(*plain, buffers, asio::redirect_error(use_awaitable, ec));
  }
  void Close() {
    error_code ignored;
    lowest().shutdown(tcp::socket::shutdown_both, ignored);
    lowest().close(ignored);
  }
};

namespace {

// Closes the stream's socket if the guarded steps (connect, TLS handshake) are not done by
// the deadline; the pending operation then fails and `expired()` tells why.
class DeadlineGuard {
 public:
  DeadlineGuard(std::shared_ptr<Connection::Stream> stream, Clock::time_point deadline)
      : timer_(stream->lowest().get_executor(), deadline), expired_(std::make_shared<bool>(false)) {
    timer_.async_wait([stream, expired = expired_](error_code ec) {
      if (ec) return;
      *expired = true;
      stream->Close();
    });
  }
  ~DeadlineGuard() { timer_.cancel(); }
  bool expired() const { return *expired_; }

 private:
  asio::steady_timer timer_;
  std::shared_ptr<bool> expired_;
};

}  // namespace

awaitable<void> SleepFor(Clock::duration duration) {
  asio::steady_timer timer(co_await asio::this_coro::executor, duration);
  error_code ec;
  co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
}

namespace {

std::string Millis(std::chrono::milliseconds ms) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", static_cast<double>(ms.count()) / 1000.0);
  return text;
}

std::string PeerName(tcp::socket& socket) {
  error_code ec;
  tcp::endpoint remote = socket.remote_endpoint(ec);
  if (ec) return "(unknown peer)";
  Endpoint endpoint{remote.address().to_string(), remote.port()};
  return endpoint.ToString();
}

}  // namespace

Connection::Connection(std::shared_ptr<Stream> stream, std::string peer, ConnectionOptions options)
    : stream_(std::move(stream)),
      peer_(std::move(peer)),
      options_(std::move(options)),
      outbound_ready_(stream_->lowest().get_executor()),
      outbound_space_(stream_->lowest().get_executor()),
      inbound_ready_(stream_->lowest().get_executor()),
      inbound_space_(stream_->lowest().get_executor()),
      watchdog_timer_(stream_->lowest().get_executor()) {
  shaped_ = options_.shaping.active();
  // Read once, here: later OpenSSL may swap the session (a client taking a ticket) on
  // the connection's thread while another thread asks.
  if (stream_->tls) {
    const char* name = SSL_get_cipher_name(stream_->tls->native_handle());
    if (name != nullptr) stream_->cipher = name;
  }
}

Connection::~Connection() = default;

std::string Connection::tls_cipher() const {
  return stream_->cipher;
}

asio::any_io_executor Connection::executor() const {
  return stream_->lowest().get_executor();
}

void Connection::Start() {
  last_rx_ = last_tx_ = Clock::now();
  auto self = shared_from_this();
  auto ex = executor();
  asio::co_spawn(
      ex, [self]() { return self->ReadLoop(); }, asio::detached);
  asio::co_spawn(
      ex, [self]() { return self->WriteLoop(); }, asio::detached);
  asio::co_spawn(
      ex, [self]() { return self->HeartbeatLoop(); }, asio::detached);
  asio::co_spawn(
      ex, [self]() { return self->Watchdog(); }, asio::detached);
}

Status Connection::close_reason() const {
  std::lock_guard<std::mutex> lock(reason_mutex_);
  return close_reason_;
}

void Connection::set_shaping(LinkShaping shaping) {
  auto self = shared_from_this();
  asio::dispatch(executor(), [self, shaping = std::move(shaping)]() mutable {
    self->shaped_ = shaping.active();
    self->options_.shaping = std::move(shaping);
  });
}

void Connection::set_limits(FrameLimits limits) {
  auto self = shared_from_this();
  asio::dispatch(executor(), [self, limits] { self->options_.limits = limits; });
}

void Connection::Close(Status reason) {
  auto self = shared_from_this();
  asio::dispatch(executor(),
                 [self, reason = std::move(reason)]() mutable { self->CloseHere(std::move(reason)); });
}

void Connection::CloseAfterFlush(Status reason) {
  auto self = shared_from_this();
  asio::dispatch(executor(), [self, reason = std::move(reason)]() mutable {
    self->CloseAfterFlushHere(std::move(reason));
  });
}

void Connection::CloseHere(Status reason) {
  if (closed_) return;
  closed_ = true;
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    close_reason_ =
        reason.ok() ? Status::Unavailable("connection to " + peer_ + " closed") : reason;
  }
  closed_flag_.store(true, std::memory_order_release);
  spdlog::debug("connection {}: closed: {}", peer_, close_reason_.ToString());
  stream_->Close();
  watchdog_timer_.cancel();
  outbound_ready_.Notify();
  outbound_space_.Notify();
  inbound_ready_.Notify();
  inbound_space_.Notify();
}

void Connection::CloseAfterFlushHere(Status reason) {
  if (closed_) return;
  if (outbound_.empty() && !write_started_) {
    CloseHere(std::move(reason));
    return;
  }
  close_after_flush_ = true;
  std::lock_guard<std::mutex> lock(reason_mutex_);
  close_reason_ = std::move(reason);
}

awaitable<Status> Connection::SendHop(std::shared_ptr<Connection> self,
                                      std::shared_ptr<Frame> frame) {
  co_return co_await self->SendHere(std::move(*frame));
}

awaitable<Status> Connection::Send(Frame frame) {
  const asio::any_io_executor here = co_await asio::this_coro::executor;
  if (here == executor()) co_return co_await SendHere(std::move(frame));
  auto hop = asio::co_spawn(executor(),
                            SendHop(shared_from_this(), std::make_shared<Frame>(std::move(frame))),
                            use_awaitable);
  co_return co_await std::move(hop);
}

awaitable<Status> Connection::SendHere(Frame frame) {
  while (!closed_ && outbound_bytes_ > options_.max_queued_bytes) co_await outbound_space_.Wait();
  if (closed_ || close_after_flush_) {
    co_return closed_ ? close_reason_
                      : Status::Unavailable("connection to " + peer_ + " is closing");
  }
  const size_t bytes = frame.wire_bytes();
  const Clock::time_point now = Clock::now();
  const Clock::time_point due =
      options_.shaping.egress.active() ? options_.shaping.egress.Due(bytes, now) : now;
  outbound_.push_back(Outbound{std::move(frame), due, bytes});
  outbound_bytes_ += bytes;
  outbound_ready_.Notify();
  co_return Status::Ok();
}

awaitable<std::optional<Result<Frame>>> Connection::ReceiveHop(
    std::shared_ptr<Connection> self,
    std::shared_ptr<std::pair<std::chrono::milliseconds, std::string>> deadline) {
  if (deadline == nullptr) co_return co_await self->ReceiveHere();
  co_return co_await self->ReceiveHere(deadline->first, std::move(deadline->second));
}

awaitable<Result<Frame>> Connection::Receive() {
  const asio::any_io_executor here = co_await asio::this_coro::executor;
  if (here == executor()) co_return co_await ReceiveHere();
  auto hop = asio::co_spawn(executor(), ReceiveHop(shared_from_this(), nullptr), use_awaitable);
  std::optional<Result<Frame>> frame = co_await std::move(hop);
  co_return std::move(*frame);
}

awaitable<Result<Frame>> Connection::Receive(std::chrono::milliseconds timeout,
                                             const std::string& what) {
  const asio::any_io_executor here = co_await asio::this_coro::executor;
  if (here == executor()) co_return co_await ReceiveHere(timeout, what);
  auto deadline = std::make_shared<std::pair<std::chrono::milliseconds, std::string>>(timeout, what);
  auto hop = asio::co_spawn(executor(), ReceiveHop(shared_from_this(), deadline), use_awaitable);
  std::optional<Result<Frame>> frame = co_await std::move(hop);
  co_return std::move(*frame);
}

awaitable<Result<Frame>> Connection::ReceiveHere() {
  while (true) {
    while (inbound_.empty() && !closed_) co_await inbound_ready_.Wait();
    if (inbound_.empty()) co_return close_reason_;
    const Clock::time_point due = inbound_.front().due;
    if (due > Clock::now()) {
      co_await SleepFor(due - Clock::now());
      continue;  // the queue may have been closed meanwhile; look again
    }
    Inbound item = std::move(inbound_.front());
    inbound_.pop_front();
    inbound_bytes_ -= item.bytes;
    inbound_space_.Notify();
    co_return std::move(item.frame);
  }
}

awaitable<Result<Frame>> Connection::ReceiveHere(std::chrono::milliseconds timeout,
                                                 std::string what) {
  // A watchdog closes the connection if the frame does not come in time.
  auto self = shared_from_this();
  auto done = std::make_shared<bool>(false);
  auto timer = std::make_shared<asio::steady_timer>(executor(), timeout);
  timer->async_wait([self, done, timeout, what](error_code ec) {
    if (ec || *done) return;
    self->CloseHere(Status::Unavailable("timed out after " + Millis(timeout) + " waiting for " +
                                        what + " from " + self->peer_));
  });
  Result<Frame> frame = co_await ReceiveHere();
  *done = true;
  timer->cancel();
  co_return frame;
}

awaitable<void> Connection::ReadLoop() {
  auto self = shared_from_this();
  std::array<std::byte, kFramePrefixBytes> prefix_bytes;
  std::vector<std::byte> header_bytes;
  while (!closed_) {
    if (inbound_bytes_ > options_.max_inbound_bytes) {
      reader_paused_ = true;
      while (!closed_ && inbound_bytes_ > options_.max_inbound_bytes)
        co_await inbound_space_.Wait();
      reader_paused_ = false;
      last_rx_ = Clock::now();
      continue;
    }
    error_code ec;
    co_await stream_->Read(asio::buffer(prefix_bytes), ec);
    if (ec) {
      CloseHere(Status::Unavailable("connection to " + peer_ + " lost: " + ec.message()));
      co_return;
    }
    last_rx_ = Clock::now();
    Result<FramePrefix> prefix = ParseFramePrefix(prefix_bytes, options_.limits, peer_);
    if (!prefix.ok()) {
      spdlog::warn("{}", prefix.status().message());
      CloseHere(prefix.status());
      co_return;
    }
    header_bytes.resize(prefix->header_bytes);
    co_await stream_->Read(asio::buffer(header_bytes), ec);
    if (ec) {
      CloseHere(Status::Unavailable("connection to " + peer_ +
                                " lost in a frame header: " + ec.message()));
      co_return;
    }
    Result<wire::Header> header = ParseFrameHeader(header_bytes, *prefix, peer_);
    if (!header.ok()) {
      spdlog::warn("{}", header.status().message());
      CloseHere(header.status());
      co_return;
    }
    // Not zeroed: every byte is read into it before anyone sees it.
    const size_t payload_bytes = prefix->payload_bytes;
    std::shared_ptr<std::byte[]> payload(new std::byte[payload_bytes]);
    // In slices, so that a long payload on a slow link counts as progress.
    constexpr size_t kSlice = 1u << 20;
    for (size_t offset = 0; offset < payload_bytes && !ec; offset += kSlice) {
      const size_t n = std::min(kSlice, payload_bytes - offset);
      co_await stream_->Read(asio::buffer(payload.get() + offset, n), ec);
      last_rx_ = Clock::now();
    }
    if (ec) {
      CloseHere(Status::Unavailable("connection to " + peer_ + " lost in the middle of a " +
                                FrameKindName(*header) + " frame: " + ec.message()));
      co_return;
    }
    const size_t bytes = kFramePrefixBytes + prefix->header_bytes + prefix->payload_bytes;
    bytes_in_.fetch_add(bytes, std::memory_order_relaxed);
    if (header->has_heartbeat()) continue;
    Inbound item;
    item.frame.header = std::move(*header);
    item.frame.payload = std::span<const std::byte>(payload.get(), payload_bytes);
    item.frame.payload_owner = std::move(payload);
    item.bytes = bytes;
    const Clock::time_point now = Clock::now();
    item.due = options_.shaping.ingress.active() ? options_.shaping.ingress.Due(bytes, now) : now;
    inbound_bytes_ += bytes;
    inbound_.push_back(std::move(item));
    inbound_ready_.Notify();
  }
}

awaitable<void> Connection::WriteLoop() {
  auto self = shared_from_this();
  while (true) {
    while (outbound_.empty() && !closed_) {
      if (close_after_flush_) {
        CloseHere(close_reason_);
        co_return;
      }
      co_await outbound_ready_.Wait();
    }
    if (closed_) co_return;
    if (outbound_.front().due > Clock::now()) {
      co_await SleepFor(outbound_.front().due - Clock::now());
      continue;
    }
    Outbound item = std::move(outbound_.front());
    outbound_.pop_front();
    std::vector<std::byte> head = EncodeFrameHead(item.frame);
    const size_t head_bytes = head.size();
    std::array<asio::const_buffer, 2> buffers{
        asio::buffer(head), asio::buffer(item.frame.payload.data(), item.frame.payload.size())};
    write_started_ = Clock::now();
    error_code ec;
    if (!options_.gather_writes && !stream_->tls) {
      head.insert(head.end(), item.frame.payload.begin(), item.frame.payload.end());
      co_await stream_->Write(asio::buffer(head), ec);
    } else {
      co_await stream_->Write(buffers, ec);
    }
    write_started_.reset();
    outbound_bytes_ -= item.bytes;
    outbound_space_.Notify();
    if (ec) {
      CloseHere(Status::Unavailable("connection to " + peer_ + " lost while sending: " + ec.message()));
      co_return;
    }
    last_tx_ = Clock::now();
    bytes_out_.fetch_add(head_bytes + item.frame.payload.size(), std::memory_order_relaxed);
  }
}

awaitable<void> Connection::HeartbeatLoop() {
  auto self = shared_from_this();
  asio::steady_timer timer(executor());
  while (!closed_) {
    timer.expires_after(options_.heartbeat / 2);
    error_code ec;
    co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
    if (closed_ || close_after_flush_) co_return;
    if (Clock::now() - last_tx_ < options_.heartbeat || !outbound_.empty()) continue;
    wire::Header header;
    header.mutable_heartbeat()->set_unix_ms(static_cast<uint64_t>(UnixMicrosNow() / 1000));
    // Unshaped and outside the queue limit: it carries no data and must not wait.
    Frame frame = MakeFrame(std::move(header));
    const size_t bytes = frame.wire_bytes();
    outbound_.push_back(Outbound{std::move(frame), Clock::now(), bytes});
    outbound_bytes_ += bytes;
    last_tx_ = Clock::now();
    outbound_ready_.Notify();
  }
}

awaitable<void> Connection::Watchdog() {
  auto self = shared_from_this();
  const auto period = std::min<Clock::duration>(options_.heartbeat / 2, 250ms);
  while (!closed_) {
    watchdog_timer_.expires_after(period);
    error_code ec;
    co_await watchdog_timer_.async_wait(asio::redirect_error(use_awaitable, ec));
    if (closed_) co_return;
    const Clock::time_point now = Clock::now();
    if (!reader_paused_ && now - last_rx_ > options_.idle_timeout) {
      CloseHere(Status::Unavailable("peer " + peer_ + " sent nothing (not even a heartbeat) for " +
                                Millis(options_.idle_timeout)));
    } else if (write_started_ && now - *write_started_ > options_.io_timeout) {
      CloseHere(Status::Unavailable("a write to " + peer_ + " did not complete in " +
                                Millis(options_.io_timeout) + " (peer not reading)"));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Dial

namespace {

Status StepFailed(const std::string& step, const Endpoint& endpoint, const error_code& ec) {
  return Status::Unavailable(step + " to " + endpoint.ToString() + " failed: " + ec.message());
}

// Dial on the running coroutine's executor (the connection's from then on).
awaitable<Result<std::shared_ptr<Connection>>> DialHere(DialOptions options, wire::Hello hello) {
  auto executor = co_await asio::this_coro::executor;
  const Clock::time_point deadline = Clock::now() + options.timeout;
  const Endpoint& endpoint = options.endpoint;
  error_code ec;
  tcp::resolver resolver(executor);
  auto addresses = co_await resolver.async_resolve(endpoint.host, std::to_string(endpoint.port),
                                                   asio::redirect_error(use_awaitable, ec));
  if (ec) co_return StepFailed("resolving", endpoint, ec);

  auto stream = std::make_shared<Connection::Stream>();
  stream->plain.emplace(executor);
  {
    DeadlineGuard guard(stream, deadline);
    co_await asio::async_connect(*stream->plain, addresses,
                                 asio::redirect_error(use_awaitable, ec));
    if (guard.expired()) ec = asio::error::timed_out;
  }
  if (ec) co_return StepFailed("connecting", endpoint, ec);
  stream->plain->set_option(tcp::no_delay(true), ec);
  if (options.tls) {
    stream->tls = std::make_unique<TlsStream>(std::move(*stream->plain), *options.tls);
    stream->plain.reset();
    if (!stream->tls->SetServerName(endpoint.host)) {
      co_return Status::Unavailable("cannot set TLS server name " + endpoint.host);
    }
    DeadlineGuard guard(stream, deadline);
    co_await stream->tls->Handshake(/*server=*/false, ec);
    if (guard.expired()) ec = asio::error::timed_out;
    if (ec) co_return StepFailed("TLS handshake", endpoint, ec);
  }

  auto connection =
      std::make_shared<Connection>(std::move(stream), endpoint.ToString(), options.connection);
  connection->Start();
  hello.set_protocol(kProtocolVersion);
  wire::Header header;
  *header.mutable_hello() = std::move(hello);
  Status sent = co_await connection->Send(MakeFrame(std::move(header)));
  if (!sent.ok()) co_return sent;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  Result<Frame> reply = co_await connection->Receive(std::max(left, 1ms), "the welcome");
  if (!reply.ok()) {
    connection->Close(reply.status());
    co_return reply.status();
  }
  if (reply->header.has_refused()) {
    connection->Close(Status::Unavailable("refused"));
    co_return Status::Unavailable("refused by " + endpoint.ToString() + ": " +
                                  reply->header.refused().reason());
  }
  if (!reply->header.has_welcome()) {
    Status bad = Status::Corruption(endpoint.ToString() + " answered the hello with a " +
                                    FrameKindName(reply->header) + " frame, not a welcome");
    connection->Close(bad);
    co_return bad;
  }
  if (reply->header.welcome().protocol() != kProtocolVersion) {
    Status bad = Status::Mismatch(endpoint.ToString() + " speaks protocol " +
                                  std::to_string(reply->header.welcome().protocol()) +
                                  ", this node " + std::to_string(kProtocolVersion));
    connection->Close(bad);
    co_return bad;
  }
  connection->welcome = reply->header.welcome();
  co_return connection;
}

struct DialCall {
  DialOptions options;
  wire::Hello hello;
};

awaitable<std::optional<Result<std::shared_ptr<Connection>>>> DialOnStrand(
    std::shared_ptr<DialCall> call) {
  co_return co_await DialHere(std::move(call->options), std::move(call->hello));
}

}  // namespace

asio::any_io_executor TestEgressPool() {
  // Lives until exit: every io_context a test destroys must first have let go of it
  // (IoPool's drain), as its handlers hold that context's work for a moment after a hop.
  static IoPool* const pool = []() -> IoPool* {
    const char* text = std::getenv("FLYWHEEL_TEST_EGRESS_THREADS");
    const int threads = text != nullptr ? std::atoi(text) : 0;
    if (threads < 1) return nullptr;
    spdlog::warn("FLYWHEEL_TEST_EGRESS_THREADS: connections run on a pool of {} threads", threads);
    return new IoPool(threads, "test-egress");
  }();
  if (pool == nullptr) return {};
  return pool->executor();
}

awaitable<Result<std::shared_ptr<Connection>>> Dial(DialOptions options, wire::Hello hello) {
  if (!options.egress) options.egress = TestEgressPool();
  if (!options.egress) co_return co_await DialHere(std::move(options), std::move(hello));
  const asio::any_io_executor strand = asio::make_strand(options.egress);
  auto call = std::make_shared<DialCall>();
  call->options = std::move(options);
  call->hello = std::move(hello);
  auto hop = asio::co_spawn(strand, DialOnStrand(call), use_awaitable);
  std::optional<Result<std::shared_ptr<Connection>>> connection = co_await std::move(hop);
  co_return std::move(*connection);
}

// ---------------------------------------------------------------------------------------
// Listener

namespace {

// The server side of the TLS handshake, on the stream's executor; timed_out past deadline.
awaitable<error_code> ServerHandshake(std::shared_ptr<Connection::Stream> stream,
                                      std::shared_ptr<Clock::time_point> deadline) {
  error_code ec;
  DeadlineGuard guard(stream, *deadline);
  co_await stream->tls->Handshake(/*server=*/true, ec);
  if (guard.expired()) ec = asio::error::timed_out;
  co_return ec;
}

}  // namespace

// The largest frame header a peer may send before its Hello was accepted.
constexpr uint32_t kMaxHelloBytes = 64u << 10;

struct Listener::Impl : std::enable_shared_from_this<Listener::Impl> {
  Impl(asio::any_io_executor executor, ListenerOptions options)
      : acceptor(executor), options(std::move(options)) {}

  tcp::acceptor acceptor;
  ListenerOptions options;
  bool stopped = false;
  std::unordered_set<std::shared_ptr<Connection>> connections;  // handshaken, alive
  size_t pending = 0;                                           // in the handshake
  std::function<wire::Welcome(const wire::Hello&)> make_welcome;
  PeerHandler on_peer;

  awaitable<void> AcceptLoop();
  awaitable<void> Serve(tcp::socket socket);
};

awaitable<void> Listener::Impl::AcceptLoop() {
  auto self = shared_from_this();
  while (!stopped) {
    error_code ec;
    // With an egress pool the socket (and so the connection) lives on a strand of its own.
    const asio::any_io_executor socket_executor =
        options.egress ? asio::any_io_executor(asio::make_strand(options.egress))
                       : acceptor.get_executor();
    tcp::socket socket = co_await acceptor.async_accept(socket_executor,
                                                        asio::redirect_error(use_awaitable, ec));
    if (stopped) co_return;
    if (ec) {
      if (ec == asio::error::operation_aborted) co_return;
      spdlog::warn("accept failed: {}", ec.message());
      co_await SleepFor(std::chrono::milliseconds(50));  // e.g. out of file descriptors
      continue;
    }
    if (connections.size() + pending >= options.max_connections) {
      spdlog::warn("refusing {}: {} connections already open", PeerName(socket),
                   options.max_connections);
      continue;  // the socket closes here
    }
    socket.set_option(tcp::no_delay(true), ec);
    asio::co_spawn(acceptor.get_executor(), Serve(std::move(socket)), asio::detached);
  }
}

awaitable<void> Listener::Impl::Serve(tcp::socket socket) {
  auto self = shared_from_this();
  const std::string peer = PeerName(socket);
  ++pending;
  auto stream = std::make_shared<Connection::Stream>();
  error_code ec;
  if (options.tls) {
    stream->tls = std::make_unique<TlsStream>(std::move(socket), *options.tls);
    const auto deadline = std::make_shared<Clock::time_point>(Clock::now() + options.handshake_timeout);
    if (stream->lowest().get_executor() == acceptor.get_executor()) {
      ec = co_await ServerHandshake(stream, deadline);
    } else {  // on the connection's strand: the handshake's CPU work on the egress pool
      auto hop = asio::co_spawn(stream->lowest().get_executor(), ServerHandshake(stream, deadline),
                                use_awaitable);
      ec = co_await std::move(hop);
    }
    if (ec) {
      spdlog::warn("TLS handshake with {} failed: {}", peer, ec.message());
      --pending;
      co_return;
    }
  } else {
    stream->plain.emplace(std::move(socket));
  }
  // The Hello decides the link's shaping, so the connection starts unshaped for it; and
  // until the Hello is accepted, frames are small (no payload) whatever the limits.
  ConnectionOptions connection_options = options.connection;
  connection_options.limits.max_header_bytes =
      std::min<uint32_t>(connection_options.limits.max_header_bytes, kMaxHelloBytes);
  connection_options.limits.max_payload_bytes = 0;
  auto connection = std::make_shared<Connection>(std::move(stream), peer, connection_options);
  connection->Start();
  Result<Frame> first = co_await connection->Receive(options.handshake_timeout, "the hello");
  --pending;
  if (!first.ok()) {
    spdlog::warn("no hello from {}: {}", peer, first.status().message());
    connection->Close(first.status());
    co_return;
  }
  auto refuse = [&](const std::string& reason) -> awaitable<void> {
    spdlog::warn("refusing {}: {}", peer, reason);
    wire::Header header;
    header.mutable_refused()->set_reason(reason);
    (void)co_await connection->Send(MakeFrame(std::move(header)));
    connection->CloseAfterFlush(Status::Unavailable("refused: " + reason));
  };
  if (!first->header.has_hello()) {
    co_await refuse(std::string("the first frame must be a hello, got a ") +
                    FrameKindName(first->header));
    co_return;
  }
  const wire::Hello& hello = first->header.hello();
  if (hello.protocol() != kProtocolVersion) {
    co_await refuse("protocol " + std::to_string(hello.protocol()) +
                    " is not supported (this node speaks " + std::to_string(kProtocolVersion) +
                    ")");
    co_return;
  }
  if (!options.token.empty() && !TokensEqual(hello.token(), options.token)) {
    co_await refuse(hello.token().empty() ? "missing token" : "wrong token");
    co_return;
  }
  if (stopped) {
    connection->Close(Status::Unavailable("listener stopped"));
    co_return;
  }
  connection->hello = hello;
  connection->hello.clear_token();
  connection->set_limits(options.connection.limits);
  if (options.shaping_for) connection->set_shaping(options.shaping_for(hello));
  wire::Header welcome;
  *welcome.mutable_welcome() = make_welcome(hello);
  welcome.mutable_welcome()->set_protocol(kProtocolVersion);
  if (!(co_await connection->Send(MakeFrame(std::move(welcome)))).ok()) co_return;
  connections.insert(connection);
  co_await on_peer(connection);
  connection->Close(Status::Unavailable("done"));
  connections.erase(connection);
}

Result<std::unique_ptr<Listener>> Listener::Bind(asio::any_io_executor executor,
                                                 const Endpoint& endpoint,
                                                 ListenerOptions options) {
  if (!options.egress) options.egress = TestEgressPool();
  auto impl = std::make_shared<Impl>(executor, std::move(options));
  error_code ec;
  asio::ip::address address = asio::ip::make_address(endpoint.host, ec);
  if (ec) {
    tcp::resolver resolver(executor);
    auto results = resolver.resolve(endpoint.host, std::to_string(endpoint.port), ec);
    if (ec || results.empty()) {
      return Status::InvalidArgument("cannot resolve listen address " + endpoint.ToString() + ": " +
                                     ec.message());
    }
    address = results.begin()->endpoint().address();
  }
  tcp::endpoint bind_to(address, endpoint.port);
  impl->acceptor.open(bind_to.protocol(), ec);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(bind_to, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::Unavailable("cannot listen on " + endpoint.ToString() + ": " + ec.message());
  }
  return std::unique_ptr<Listener>(new Listener(std::move(impl)));
}

Listener::~Listener() {
  Stop();
}

void Listener::Start(std::function<wire::Welcome(const wire::Hello&)> make_welcome,
                     PeerHandler on_peer) {
  impl_->make_welcome = std::move(make_welcome);
  impl_->on_peer = std::move(on_peer);
  asio::co_spawn(impl_->acceptor.get_executor(), impl_->AcceptLoop(), asio::detached);
}

uint16_t Listener::port() const {
  error_code ec;
  return impl_->acceptor.local_endpoint(ec).port();
}

void Listener::Stop() {
  if (impl_->stopped) return;
  impl_->stopped = true;
  error_code ignored;
  impl_->acceptor.close(ignored);
  auto connections = impl_->connections;
  for (const auto& connection : connections) {
    connection->Close(Status::Unavailable("this node is shutting down"));
  }
}

}  // namespace flywheel::transport
