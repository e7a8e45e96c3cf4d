// The framed data plane: frame parsing, Dial/Listener (hello, token, protocol), hostile
// peers (oversized frames, garbage, silence), heartbeats and deadlines, backpressure,
// shaping, TLS with mutual authentication. Loopback only; every listener and thread
// stops at the end of its test.
#include "transport/connection.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "tests/transport/cert_suite.h"
#include "transport/certs.h"
#include "transport/frame.h"
#include "transport/io_pool.h"
#include "transport/tls.h"

namespace flywheel::transport {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// ---- frames ---------------------------------------------------------------------------

std::vector<std::byte> Bytes(const std::string& text) {
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  return bytes;
}

std::array<std::byte, kFramePrefixBytes> Prefix(uint32_t magic, uint32_t header_bytes,
                                                uint64_t payload_bytes) {
  std::array<std::byte, kFramePrefixBytes> prefix;
  std::memcpy(prefix.data(), &magic, 4);
  std::memcpy(prefix.data() + 4, &header_bytes, 4);
  std::memcpy(prefix.data() + 8, &payload_bytes, 8);
  return prefix;
}

TEST(FrameTest, RoundTripsHeaderAndPayload) {
  wire::Header header;
  header.mutable_piece()->set_target_version(7);
  header.mutable_piece()->set_index(3);
  const std::vector<std::byte> payload = Bytes("0123456789");
  const std::vector<std::byte> wire_bytes = EncodeFrame(header, payload);
  ASSERT_GT(wire_bytes.size(), kFramePrefixBytes + payload.size());

  Result<FramePrefix> prefix = ParseFramePrefix(
      std::span<const std::byte, kFramePrefixBytes>(wire_bytes.data(), kFramePrefixBytes), {}, "p");
  ASSERT_TRUE(prefix.ok()) << prefix.status().ToString();
  EXPECT_EQ(prefix->payload_bytes, payload.size());
  EXPECT_EQ(kFramePrefixBytes + prefix->header_bytes + prefix->payload_bytes, wire_bytes.size());
  Result<wire::Header> parsed = ParseFrameHeader(
      std::span<const std::byte>(wire_bytes).subspan(kFramePrefixBytes, prefix->header_bytes),
      *prefix, "p");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->piece().target_version(), 7u);
  EXPECT_EQ(parsed->piece().index(), 3u);
  EXPECT_EQ(std::string(FrameKindName(*parsed)), "piece");
  EXPECT_TRUE(std::equal(payload.begin(), payload.end(),
                         wire_bytes.end() - static_cast<ptrdiff_t>(payload.size())));
}

TEST(FrameTest, BadMagicIsCorruptionNamingThePeer) {
  const auto prefix = Prefix(0x20544547 /* "GET " */, 10, 0);
  Result<FramePrefix> parsed = ParseFramePrefix(prefix, {}, "10.0.0.9:4000");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption);
  EXPECT_NE(parsed.status().message().find("10.0.0.9:4000"), std::string::npos);
  EXPECT_NE(parsed.status().message().find("not a flywheel frame"), std::string::npos)
      << parsed.status().message();
}

TEST(FrameTest, LengthsOverTheLimitsAreRejectedBeforeAllocation) {
  FrameLimits limits;
  limits.max_header_bytes = 1000;
  limits.max_payload_bytes = 5000;
  EXPECT_TRUE(ParseFramePrefix(Prefix(kFrameMagic, 1000, 5000), limits, "p").ok());
  Result<FramePrefix> header = ParseFramePrefix(Prefix(kFrameMagic, 1001, 0), limits, "p");
  ASSERT_FALSE(header.ok());
  EXPECT_EQ(header.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(header.status().message().find("1001"), std::string::npos) << header.status().message();
  Result<FramePrefix> payload =
      ParseFramePrefix(Prefix(kFrameMagic, 10, uint64_t{1} << 62), limits, "p");
  ASSERT_FALSE(payload.ok());
  EXPECT_EQ(payload.status().code(), StatusCode::kResourceExhausted);
}

TEST(FrameTest, HeaderMustBeProtobufAndRepeatThePayloadLength) {
  wire::Header header;
  header.mutable_heartbeat()->set_unix_ms(1);
  std::vector<std::byte> good = EncodeFrame(header, Bytes("abc"));
  Result<FramePrefix> prefix = ParseFramePrefix(
      std::span<const std::byte, kFramePrefixBytes>(good.data(), kFramePrefixBytes), {}, "p");
  ASSERT_TRUE(prefix.ok());
  const auto header_bytes =
      std::span<const std::byte>(good).subspan(kFramePrefixBytes, prefix->header_bytes);
  FramePrefix lying = *prefix;
  lying.payload_bytes = 4;
  Result<wire::Header> mismatch = ParseFrameHeader(header_bytes, lying, "p");
  ASSERT_FALSE(mismatch.ok());
  EXPECT_EQ(mismatch.status().code(), StatusCode::kCorruption);

  const std::vector<std::byte> junk(prefix->header_bytes, std::byte{0xff});
  Result<wire::Header> garbage = ParseFrameHeader(junk, *prefix, "p");
  ASSERT_FALSE(garbage.ok());
  EXPECT_EQ(garbage.status().code(), StatusCode::kCorruption);
}

// ---- connections ----------------------------------------------------------------------

// An io_context on its own thread (one network thread, as in a flywheel process). It goes
// only once nothing holds work on it (up to 5 s): a connection on an egress pool (the
// FLYWHEEL_TEST_EGRESS_THREADS one outlives every test) still holds the loop's work for a
// moment after the loop's coroutine resumed (transport/io_pool.h).
class Loop {
 public:
  Loop() : pool_(1, "test-loop", 5s), io_(pool_.context()) {}
  asio::any_io_executor executor() { return io_.get_executor(); }

  // Runs `task` on the loop and waits for its result (bounded: a hang fails the test).
  template <typename T>
  T Await(awaitable<T> task, std::chrono::seconds limit = 10s) {
    auto promise = std::make_shared<std::promise<T>>();
    std::future<T> future = promise->get_future();
    asio::co_spawn(io_, Fulfil(std::move(task), promise), asio::detached);
    if (future.wait_for(limit) != std::future_status::ready) {
      ADD_FAILURE() << "the task did not finish in " << limit.count() << " s";
      std::abort();  // a hung coroutine would be destroyed under the test's feet
    }
    return future.get();
  }
  // Runs `fn` on the loop thread and waits for it.
  template <typename Fn>
  auto Call(Fn fn) {
    std::packaged_task<decltype(fn())()> task(std::move(fn));
    auto future = task.get_future();
    asio::post(io_, [&task] { task(); });
    return future.get();
  }

 private:
  template <typename T>
  static awaitable<void> Fulfil(awaitable<T> task, std::shared_ptr<std::promise<T>> promise) {
    promise->set_value(co_await std::move(task));
  }

  IoPool pool_;
  asio::io_context& io_;
};

// A frame header needs a body; a piece is the common one.
wire::Header PieceHeader(uint32_t index) {
  wire::Header header;
  header.mutable_piece()->set_index(index);
  return header;
}

wire::Hello TestHello(const std::string& token = "") {
  wire::Hello hello;
  hello.set_token(token);
  hello.set_role(wire::WORKER);
  hello.set_region("test");
  hello.set_node_id("client");
  hello.set_channel(wire::DATA);
  return hello;
}

// What the server side saw of its peers.
struct ServerLog {
  std::mutex mutex;
  std::vector<std::string> closed;  // close reasons
  std::atomic<int> peers{0};
  std::atomic<uint64_t> max_bytes_in{0};
  std::atomic<uint32_t> received{0};  // frames drained in order (Behavior::kIgnore)

  void Closed(const std::string& reason) {
    std::lock_guard lock(mutex);
    closed.push_back(reason);
  }
  std::string All() {
    std::lock_guard lock(mutex);
    std::string all;
    for (const std::string& reason : closed) all += reason + "\n";
    return all;
  }
};

// The server's behavior with each peer.
enum class Behavior { kEcho, kIgnore };

awaitable<void> Echo(std::shared_ptr<Connection> connection, std::shared_ptr<ServerLog> log) {
  ++log->peers;
  while (true) {
    Result<Frame> frame = co_await connection->Receive();
    if (!frame.ok()) {
      log->Closed(frame.status().message());
      co_return;
    }
    if (!(co_await connection->Send(std::move(*frame))).ok()) co_return;
  }
}

awaitable<Result<Frame>> SendAndReceive(std::shared_ptr<Connection> connection, Frame frame) {
  Status sent = co_await connection->Send(std::move(frame));
  if (!sent.ok()) co_return sent;
  co_return co_await connection->Receive(3000ms, "the echo");
}

// Accepts the peer, then does not read until told (backpressure tests), recording how
// much the connection read from its socket meanwhile; then drains, counting frames.
awaitable<void> Ignore(std::shared_ptr<Connection> connection, std::shared_ptr<ServerLog> log,
                       std::shared_ptr<std::atomic<bool>> release) {
  ++log->peers;
  while (!*release && !connection->closed()) {
    log->max_bytes_in = std::max<uint64_t>(log->max_bytes_in, connection->bytes_in());
    co_await SleepFor(5ms);
  }
  while (true) {
    Result<Frame> frame = co_await connection->Receive();
    if (!frame.ok()) {
      log->Closed(frame.status().message());
      co_return;
    }
    if (frame->header.piece().index() == log->received) ++log->received;  // in order only
  }
}

class ConnectionTest : public CertificateSuite {
 protected:
  void TearDown() override {
    if (listener_)
      loop_.Call([this] {
        listener_->Stop();
        return 0;
      });
    loop_.Call([this] {
      listener_.reset();
      return 0;
    });
  }

  // Starts a listener on 127.0.0.1 (a free port) with `options`.
  void Listen(ListenerOptions options, Behavior behavior = Behavior::kEcho) {
    auto bound = loop_.Call([&] {
      return Listener::Bind(loop_.executor(), Endpoint{"127.0.0.1", 0}, std::move(options));
    });
    ASSERT_TRUE(bound.ok()) << bound.status().ToString();
    listener_ = std::move(*bound);
    auto log = log_;
    auto release = release_;
    auto welcome = [](const wire::Hello&) {
      wire::Welcome welcome;
      welcome.set_node_id("server");
      welcome.set_role(wire::PUBLISHER);
      return welcome;
    };
    Listener::PeerHandler handler;
    if (behavior == Behavior::kEcho) {
      handler = [log](std::shared_ptr<Connection> connection) { return Echo(connection, log); };
    } else {
      handler = [log, release](std::shared_ptr<Connection> connection) {
        return Ignore(connection, log, release);
      };
    }
    loop_.Call([&] {
      listener_->Start(welcome, handler);
      return 0;
    });
    port_ = listener_->port();
    ASSERT_NE(port_, 0);
  }

  DialOptions DialTo() const {
    DialOptions options;
    options.endpoint = Endpoint{"127.0.0.1", port_};
    options.timeout = 3000ms;
    return options;
  }

  Result<std::shared_ptr<Connection>> DialNow(DialOptions options,
                                              wire::Hello hello = TestHello()) {
    return loop_.Await(Dial(std::move(options), std::move(hello)));
  }

  // A plain blocking socket to the listener, for bytes no flywheel node would send.
  int RawConnect() const {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port_);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    return fd;
  }
  static void RawSend(int fd, const void* data, size_t size) {
    ASSERT_EQ(::send(fd, data, size, MSG_NOSIGNAL), static_cast<ssize_t>(size));
  }
  // Reads until the peer closes (true) or `limit` passes (false); what came is in `*got`.
  static bool ClosedByPeerWithin(int fd, std::chrono::milliseconds limit,
                                 std::string* got = nullptr) {
    const auto deadline = Clock::now() + limit;
    char buffer[4096];
    while (Clock::now() < deadline) {
      pollfd ready{fd, POLLIN, 0};
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (::poll(&ready, 1, static_cast<int>(std::max<int64_t>(1, left.count()))) <= 0) continue;
      const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
      if (n <= 0) return true;  // EOF or reset
      if (got) got->append(buffer, static_cast<size_t>(n));
    }
    return false;
  }

  // The frame the other end sent first, read from a raw socket (e.g. a Refused).
  static Result<wire::Header> RawReadFrame(int fd) {
    std::string bytes;
    ClosedByPeerWithin(fd, 2000ms, &bytes);
    if (bytes.size() < kFramePrefixBytes) return Status::Unavailable("no frame");
    std::array<std::byte, kFramePrefixBytes> prefix_bytes;
    std::memcpy(prefix_bytes.data(), bytes.data(), kFramePrefixBytes);
    Result<FramePrefix> prefix = ParseFramePrefix(prefix_bytes, {}, "server");
    if (!prefix.ok()) return prefix.status();
    if (bytes.size() < kFramePrefixBytes + prefix->header_bytes)
      return Status::Unavailable("short");
    std::vector<std::byte> header(prefix->header_bytes);
    std::memcpy(header.data(), bytes.data() + kFramePrefixBytes, header.size());
    return ParseFrameHeader(header, *prefix, "server");
  }

  // Whether a well-behaved client is still served (the listener survived).
  void ExpectStillServing() {
    Result<std::shared_ptr<Connection>> dialed = DialNow(DialTo());
    ASSERT_TRUE(dialed.ok()) << dialed.status().ToString();
    wire::Header header;
    header.mutable_piece()->set_index(42);
    auto connection = *dialed;
    Result<Frame> echoed = loop_.Await(SendAndReceive(connection, MakeFrame(header)));
    ASSERT_TRUE(echoed.ok()) << echoed.status().ToString();
    EXPECT_EQ(echoed->header.piece().index(), 42u);
    loop_.Call([&] {
      connection->Close(Status::Unavailable("test done"));
      return 0;
    });
  }

  Loop loop_;
  std::unique_ptr<Listener> listener_;
  uint16_t port_ = 0;
  std::shared_ptr<ServerLog> log_ = std::make_shared<ServerLog>();
  std::shared_ptr<std::atomic<bool>> release_ = std::make_shared<std::atomic<bool>>(false);
};

TEST_F(ConnectionTest, DialExchangesFramesWithPayloads) {
  Listen({});
  Result<std::shared_ptr<Connection>> dialed = DialNow(DialTo());
  ASSERT_TRUE(dialed.ok()) << dialed.status().ToString();
  auto connection = *dialed;
  EXPECT_EQ(connection->welcome.node_id(), "server");
  EXPECT_EQ(connection->welcome.protocol(), kProtocolVersion);

  auto payload = std::make_shared<std::vector<std::byte>>(3u << 20);
  for (size_t i = 0; i < payload->size(); ++i) (*payload)[i] = static_cast<std::byte>(i * 7 + 1);
  wire::Header header;
  header.mutable_piece()->set_index(9);
  Frame frame = MakeFrame(std::move(header), payload, *payload);
  Result<Frame> echoed = loop_.Await(SendAndReceive(connection, std::move(frame)));
  ASSERT_TRUE(echoed.ok()) << echoed.status().ToString();
  EXPECT_EQ(echoed->header.piece().index(), 9u);
  ASSERT_EQ(echoed->payload.size(), payload->size());
  EXPECT_TRUE(std::equal(payload->begin(), payload->end(), echoed->payload.begin()));
  EXPECT_GE(connection->bytes_out(), payload->size());
  EXPECT_GE(connection->bytes_in(), payload->size());
  loop_.Call([&] {
    connection->Close(Status::Unavailable("test done"));
    return 0;
  });
}

TEST_F(ConnectionTest, WrongOrMissingTokenIsRefusedWithTheReason) {
  ListenerOptions options;
  options.token = "s3cret";
  Listen(options);
  Result<std::shared_ptr<Connection>> wrong = DialNow(DialTo(), TestHello("s3cre7"));
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(wrong.status().message().find("refused by 127.0.0.1:"), std::string::npos)
      << wrong.status().message();
  EXPECT_NE(wrong.status().message().find("wrong token"), std::string::npos)
      << wrong.status().message();

  Result<std::shared_ptr<Connection>> longer = DialNow(DialTo(), TestHello("s3cret-and-more"));
  ASSERT_FALSE(longer.ok());
  EXPECT_NE(longer.status().message().find("wrong token"), std::string::npos);

  Result<std::shared_ptr<Connection>> missing = DialNow(DialTo(), TestHello(""));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("missing token"), std::string::npos)
      << missing.status().message();
  EXPECT_EQ(log_->peers, 0) << "a refused peer reached the handler";

  Result<std::shared_ptr<Connection>> right = DialNow(DialTo(), TestHello("s3cret"));
  ASSERT_TRUE(right.ok()) << right.status().ToString();
  EXPECT_TRUE(right.value()->hello.token().empty());
  loop_.Call([&] {
    right.value()->Close(Status::Unavailable("test done"));
    return 0;
  });
}

TEST_F(ConnectionTest, OtherProtocolVersionIsRefused) {
  Listen({});
  const int fd = RawConnect();
  wire::Header header;
  *header.mutable_hello() = TestHello();
  header.mutable_hello()->set_protocol(kProtocolVersion + 98);
  const std::vector<std::byte> bytes = EncodeFrame(header);
  RawSend(fd, bytes.data(), bytes.size());
  Result<wire::Header> reply = RawReadFrame(fd);
  ::close(fd);
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  ASSERT_TRUE(reply->has_refused()) << FrameKindName(*reply);
  EXPECT_NE(reply->refused().reason().find("protocol 99 is not supported"), std::string::npos)
      << reply->refused().reason();
  ExpectStillServing();
}

TEST_F(ConnectionTest, FirstFrameMustBeAHello) {
  Listen({});
  const int fd = RawConnect();
  wire::Header header;
  header.mutable_piece_request()->set_index(1);
  const std::vector<std::byte> bytes = EncodeFrame(header);
  RawSend(fd, bytes.data(), bytes.size());
  Result<wire::Header> reply = RawReadFrame(fd);
  ::close(fd);
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  ASSERT_TRUE(reply->has_refused());
  EXPECT_NE(reply->refused().reason().find("must be a hello"), std::string::npos)
      << reply->refused().reason();
}

TEST_F(ConnectionTest, GarbageBytesCloseTheConnectionAndTheListenerSurvives) {
  Listen({});
  for (const std::string& garbage :
       {std::string("GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n"), std::string(4096, '\xa5'),
        std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11) +
            std::string(40, '\x01') /* a TLS hello */}) {
    const int fd = RawConnect();
    RawSend(fd, garbage.data(), garbage.size());
    std::string got;
    EXPECT_TRUE(ClosedByPeerWithin(fd, 2000ms, &got)) << "garbage kept the connection open";
    EXPECT_TRUE(got.empty()) << "the server answered garbage with " << got.size() << " bytes";
    ::close(fd);
  }
  EXPECT_EQ(log_->peers, 0);
  ExpectStillServing();
}

TEST_F(ConnectionTest, OversizedFrameBeforeTheHelloIsRefusedWithoutAllocating) {
  Listen({});
  // A valid prefix that announces a 1 GiB payload: limits allow 64 MiB after a hello and
  // no payload at all before one.
  for (const auto& prefix : {Prefix(kFrameMagic, 100, 1ull << 30), Prefix(kFrameMagic, 100, 4096),
                             Prefix(kFrameMagic, 8u << 20, 0)}) {
    const int fd = RawConnect();
    RawSend(fd, prefix.data(), prefix.size());
    EXPECT_TRUE(ClosedByPeerWithin(fd, 2000ms)) << "an oversized frame kept the connection open";
    ::close(fd);
  }
  ExpectStillServing();
}

TEST_F(ConnectionTest, OversizedFrameAfterTheHelloClosesOnlyThatConnection) {
  ListenerOptions options;
  options.connection.limits.max_payload_bytes = 1u << 20;
  Listen(options);
  DialOptions dial = DialTo();
  dial.connection.limits.max_payload_bytes = 8u << 20;  // the client would send more
  Result<std::shared_ptr<Connection>> dialed = DialNow(dial);
  ASSERT_TRUE(dialed.ok()) << dialed.status().ToString();
  auto connection = *dialed;
  auto payload = std::make_shared<std::vector<std::byte>>((1u << 20) + 1);
  wire::Header header;
  header.mutable_piece()->set_index(1);
  Result<Frame> echoed =
      loop_.Await(SendAndReceive(connection, MakeFrame(header, payload, *payload)));
  ASSERT_FALSE(echoed.ok()) << "the server echoed a frame over its limit";
  EXPECT_EQ(echoed.status().code(), StatusCode::kUnavailable) << echoed.status().ToString();
  // The server says why in its close reason.
  for (int i = 0; i < 100 && log_->All().empty(); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_NE(log_->All().find("payload"), std::string::npos) << log_->All();
  ExpectStillServing();
}

TEST_F(ConnectionTest, PeerSilentBeforeTheHelloIsDropped) {
  ListenerOptions options;
  options.handshake_timeout = 300ms;
  Listen(options);
  const int fd = RawConnect();
  const auto start = Clock::now();
  EXPECT_TRUE(ClosedByPeerWithin(fd, 3000ms));
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, 250ms);
  EXPECT_LT(waited, 2500ms);
  ::close(fd);
}

TEST_F(ConnectionTest, DeadPeerIsNoticedByTheMissingHeartbeats) {
  ListenerOptions options;
  options.connection.heartbeat = 100ms;
  options.connection.idle_timeout = 400ms;
  Listen(options);
  // A peer that says hello, then stops (a frozen process: the socket stays open).
  const int fd = RawConnect();
  wire::Header header;
  *header.mutable_hello() = TestHello();
  header.mutable_hello()->set_protocol(kProtocolVersion);
  const std::vector<std::byte> hello = EncodeFrame(header);
  RawSend(fd, hello.data(), hello.size());
  const auto start = Clock::now();
  std::string got;
  EXPECT_TRUE(ClosedByPeerWithin(fd, 3000ms, &got));
  const auto waited = Clock::now() - start;
  ::close(fd);
  EXPECT_GE(waited, 350ms);
  EXPECT_LT(waited, 2500ms);
  EXPECT_GT(got.size(), 0u) << "no welcome or heartbeat came";
  for (int i = 0; i < 100 && log_->All().empty(); ++i) std::this_thread::sleep_for(10ms);
  EXPECT_NE(log_->All().find("sent nothing (not even a heartbeat)"), std::string::npos)
      << log_->All();
}

TEST_F(ConnectionTest, LiveButIdlePeersStayConnected) {
  ListenerOptions options;
  options.connection.heartbeat = 100ms;
  options.connection.idle_timeout = 400ms;
  Listen(options);
  DialOptions dial = DialTo();
  dial.connection.heartbeat = 100ms;
  dial.connection.idle_timeout = 400ms;
  Result<std::shared_ptr<Connection>> dialed = DialNow(dial);
  ASSERT_TRUE(dialed.ok()) << dialed.status().ToString();
  std::this_thread::sleep_for(1200ms);  // three idle timeouts, heartbeats only
  auto connection = *dialed;
  EXPECT_FALSE(loop_.Call([&] { return connection->closed(); }))
      << loop_.Call([&] { return connection->close_reason().ToString(); });
  wire::Header header;
  header.mutable_piece()->set_index(5);
  Result<Frame> echoed = loop_.Await(SendAndReceive(connection, MakeFrame(header)));
  ASSERT_TRUE(echoed.ok()) << echoed.status().ToString();
  EXPECT_TRUE(log_->All().empty()) << log_->All();
  loop_.Call([&] {
    connection->Close(Status::Unavailable("test done"));
    return 0;
  });
}

// A reader that stops reading holds its sender to bounded memory: the sender's Send()
// waits, and nothing piles up beyond the two queue limits and the socket buffers.
TEST_F(ConnectionTest, BackpressureBoundsWhatASlowReaderBuffers) {
  constexpr size_t kLimit = 256u << 10;
  constexpr size_t kFrame = 64u << 10;
  constexpr size_t kTotal = 64u << 20;
  ListenerOptions options;
  options.connection.max_inbound_bytes = kLimit;
  Listen(options, Behavior::kIgnore);
  DialOptions dial = DialTo();
  dial.connection.max_queued_bytes = kLimit;
  Result<std::shared_ptr<Connection>> dialed = DialNow(dial);
  ASSERT_TRUE(dialed.ok()) << dialed.status().ToString();
  auto connection = *dialed;

  auto payload = std::make_shared<std::vector<std::byte>>(kFrame, std::byte{7});
  auto sent_frames = std::make_shared<std::atomic<size_t>>(0);
  auto sender = [](std::shared_ptr<Connection> c, std::shared_ptr<std::vector<std::byte>> p,
                   std::shared_ptr<std::atomic<size_t>> sent) -> awaitable<Status> {
    for (size_t i = 0; i < kTotal / kFrame; ++i) {
      wire::Header header;
      header.mutable_piece()->set_index(static_cast<uint32_t>(i));
      Status status = co_await c->Send(MakeFrame(std::move(header), p, *p));
      if (!status.ok()) co_return status;
      ++*sent;
    }
    co_return Status::Ok();
  };
  std::future<Status> sending =
      asio::co_spawn(loop_.executor(), sender(connection, payload, sent_frames), asio::use_future);
  std::this_thread::sleep_for(500ms);
  const size_t queued = sent_frames->load() * kFrame;
  EXPECT_EQ(sending.wait_for(0ms), std::future_status::timeout)
      << "all 64 MiB went into a reader that reads nothing";
  // Both queues plus loopback socket buffers (a few MiB at most).
  EXPECT_LT(queued, 16u << 20) << "the sender queued " << queued << " bytes";
  EXPECT_LE(log_->max_bytes_in.load(), kLimit + 2 * (kFrame + 1024))
      << "the reader read past its limit";

  *release_ = true;  // the reader catches up: everything arrives
  ASSERT_EQ(sending.wait_for(20s), std::future_status::ready);
  EXPECT_TRUE(sending.get().ok());
  for (int i = 0; i < 2000 && log_->received < kTotal / kFrame; ++i)
    std::this_thread::sleep_for(5ms);
  EXPECT_EQ(log_->received.load(), kTotal / kFrame) << "frames lost or out of order";
  loop_.Call([&] {
    connection->Close(Status::Unavailable("test done"));
    return 0;
  });
}

TEST_F(ConnectionTest, ShapedLinkAddsLatencyAndCapsTheRate) {
  Listen({});
  DialOptions dial = DialTo();
  dial.connection.shaping = MakeLinkShaping(/*rate=*/4e6, /*latency_ms=*/50);
  Result<std::shared_ptr<Connection>> dialed = DialNow(dial);
  ASSERT_TRUE(dialed.ok()) << dialed.status().ToString();
  auto connection = *dialed;

  // One small frame: about one RTT of added latency (50 ms each way on this side's link).
  auto start = Clock::now();
  Result<Frame> echoed = loop_.Await(SendAndReceive(connection, MakeFrame(PieceHeader(0))));
  ASSERT_TRUE(echoed.ok()) << echoed.status().ToString();
  const auto rtt = Clock::now() - start;
  EXPECT_GE(rtt, 95ms);
  EXPECT_LT(rtt, 1000ms);

  // 2 MB out and 2 MB back through 4 MB/s buckets in each direction: about 0.5 s each way
  // at least, pipelined.
  auto payload = std::make_shared<std::vector<std::byte>>(64u << 10);
  auto pump = [](std::shared_ptr<Connection> c,
                 std::shared_ptr<std::vector<std::byte>> p) -> awaitable<Status> {
    constexpr int kFrames = 32;  // 2 MiB
    for (int i = 0; i < kFrames; ++i) {
      Status sent = co_await c->Send(MakeFrame(PieceHeader(static_cast<uint32_t>(i)), p, *p));
      if (!sent.ok()) co_return sent;
    }
    for (int i = 0; i < kFrames; ++i) {
      Result<Frame> frame = co_await c->Receive(5000ms, "an echo");
      if (!frame.ok()) co_return frame.status();
    }
    co_return Status::Ok();
  };
  start = Clock::now();
  Status pumped = loop_.Await(pump(connection, payload), 20s);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_TRUE(pumped.ok()) << pumped.ToString();
  EXPECT_GE(seconds, 0.45) << "4 MB/s shaping let 2 MiB through faster";
  EXPECT_LT(seconds, 5.0);
  loop_.Call([&] {
    connection->Close(Status::Unavailable("test done"));
    return 0;
  });
}

TEST_F(ConnectionTest, TlsWithMutualAuthentication) {
  ListenerOptions options;
  auto server = MakeServerTlsContext({Path("server.crt"), Path("server.key"), Path("ca.crt")});
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  options.tls = *server;
  Listen(options);

  auto with_cert = MakeClientTlsContext({Path("client.crt"), Path("client.key"), Path("ca.crt")});
  ASSERT_TRUE(with_cert.ok()) << with_cert.status().ToString();
  DialOptions dial = DialTo();
  dial.tls = *with_cert;
  Result<std::shared_ptr<Connection>> dialed = DialNow(dial);
  ASSERT_TRUE(dialed.ok()) << dialed.status().ToString();
  auto payload = std::make_shared<std::vector<std::byte>>(5u << 20, std::byte{3});
  Result<Frame> echoed =
      loop_.Await(SendAndReceive(*dialed, MakeFrame(PieceHeader(1), payload, *payload)));
  ASSERT_TRUE(echoed.ok()) << echoed.status().ToString();
  EXPECT_EQ(echoed->payload.size(), payload->size());
  loop_.Call([&] {
    dialed.value()->Close(Status::Unavailable("test done"));
    return 0;
  });

  // No client certificate: the handshake (or the first read after it) fails.
  auto without_cert = MakeClientTlsContext({"", "", Path("ca.crt")});
  ASSERT_TRUE(without_cert.ok());
  dial.tls = *without_cert;
  Result<std::shared_ptr<Connection>> anonymous = DialNow(dial);
  ASSERT_FALSE(anonymous.ok()) << "a client without a certificate was served";
  EXPECT_EQ(anonymous.status().code(), StatusCode::kUnavailable) << anonymous.status().ToString();

  // A certificate from a CA the server does not trust.
  auto rogue = MakeClientTlsContext({Path("rogue.crt"), Path("rogue.key"), Path("ca.crt")});
  ASSERT_TRUE(rogue.ok()) << rogue.status().ToString();
  dial.tls = *rogue;
  EXPECT_FALSE(DialNow(dial).ok()) << "a rogue client certificate was accepted";

  // Plain TCP against the TLS port.
  dial.tls = nullptr;
  Result<std::shared_ptr<Connection>> plain = DialNow(dial);
  ASSERT_FALSE(plain.ok());
  EXPECT_EQ(log_->peers, 1) << "only the authenticated client reached the handler";
}

TEST_F(ConnectionTest, TlsClientAgainstPlainListenerFails) {
  Listen({});
  auto client = MakeClientTlsContext({Path("client.crt"), Path("client.key"), Path("ca.crt")});
  ASSERT_TRUE(client.ok());
  DialOptions dial = DialTo();
  dial.tls = *client;
  Result<std::shared_ptr<Connection>> dialed = DialNow(dial);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), StatusCode::kUnavailable) << dialed.status().ToString();
  ExpectStillServing();
}

TEST_F(ConnectionTest, UnreachableUpstreamNamesTheEndpoint) {
  Listen({});
  DialOptions dial = DialTo();
  loop_.Call([this] {
    listener_->Stop();
    return 0;
  });
  Result<std::shared_ptr<Connection>> dialed = DialNow(dial);
  ASSERT_FALSE(dialed.ok());
  EXPECT_EQ(dialed.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(dialed.status().message().find("127.0.0.1:" + std::to_string(port_)), std::string::npos)
      << dialed.status().message();
}

TEST(RunOnTest, RunsOnThePoolAndResumesOnTheLoop) {
  Loop loop;
  asio::thread_pool pool(1);
  const auto loop_thread = loop.Call([] { return std::this_thread::get_id(); });
  auto task = [&pool, loop_thread]() -> awaitable<bool> {
    auto work = [] { return std::this_thread::get_id(); };
    std::optional<std::thread::id> worker = co_await RunOn(pool, work);
    co_return worker.has_value() &&
        *worker != loop_thread&& std::this_thread::get_id() == loop_thread;
  };
  EXPECT_TRUE(loop.Await(task()));
  pool.join();
}

}  // namespace
}  // namespace flywheel::transport
