// The egress pool (ListenerOptions::egress, DialOptions::egress): a relay's connections
// each on a strand of a multi-threaded pool, the role logic on its network thread.
// - 8 children of one relay receive identical bytes, and the sealing ran on the pool
//   (more than one of its threads worked, more than the network thread);
// - a child that stops reading does not stall the others: they finish while the relay
//   still holds the stalled link, and the relay's write to it times out alone;
// - a connection's frames are never interleaved (TLS and plain) while coroutines on
//   several threads Send on it at once;
// - `--egress-threads 0` (or negative) is refused naming the flag, before anything starts.
// Loopback only; every thread and listener stops at the end of its test.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <future>
#include <latch>
#include <random>
#include <thread>

#include "sync/link_registry.h"
#include "sync/server.h"
#include "transport/certs.h"
#include "transport/connection.h"
#include "transport/io_pool.h"
#include "transport/tls.h"

namespace flywheel::sync {
namespace {

using namespace std::chrono_literals;
using transport::Clock;
using transport::Frame;

// The relay's network loop and egress pool, the children's and senders' pools: IoPools
// (transport/io_pool.h), all stopped, then all shut down, before any of them goes.
using transport::IoPool;

// Runs `fn` on `io`'s thread and returns its result.
template <typename Fn>
auto On(asio::io_context& io, Fn fn) {
  std::promise<decltype(fn())> result;
  asio::post(io, [&] { result.set_value(fn()); });
  return result.get_future().get();
}

constexpr uint64_t kPieceBytes = 256u << 10;
constexpr uint32_t kPieces = 32;

std::shared_ptr<std::vector<std::byte>> RandomBytes(size_t size, uint64_t seed) {
  auto bytes = std::make_shared<std::vector<std::byte>>(size);
  std::mt19937_64 random(seed);
  for (auto& b : *bytes) b = static_cast<std::byte>(random());
  return bytes;
}

class MemorySource : public PieceSource {
 public:
  explicit MemorySource(std::shared_ptr<std::vector<std::byte>> bytes) : bytes_(std::move(bytes)) {}
  awaitable<Result<Piece>> GetPiece(const ArtifactKey&, uint32_t index) override {
    if (index >= kPieces) co_return Status::NotFound("no such piece");
    Piece piece{bytes_, std::span<const std::byte>(bytes_->data() + index * kPieceBytes, kPieceBytes)};
    co_return piece;
  }

 private:
  std::shared_ptr<std::vector<std::byte>> bytes_;
};

struct TlsContexts {
  std::shared_ptr<asio::ssl::context> server, client;
};

TlsContexts MakeTls() {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("flywheel-egress-test-" + std::to_string(getpid())))
                              .string();
  EXPECT_TRUE(transport::WriteTestCertificates(dir, {}).ok());
  TlsContexts tls;
  tls.server = *transport::MakeServerTlsContext({dir + "/server.crt", dir + "/server.key", dir + "/ca.crt"});
  tls.client = *transport::MakeClientTlsContext({dir + "/client.crt", dir + "/client.key", dir + "/ca.crt"});
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return tls;
}

// A relay's serving side: a network thread for the role logic, a 4-thread egress pool.
struct Relay {
  explicit Relay(transport::ConnectionOptions connection, std::shared_ptr<asio::ssl::context> tls)
      : source(RandomBytes(kPieceBytes * kPieces, 33)), memory(source.bytes()) {
    ServerOptions options;
    options.listen = transport::Endpoint{"127.0.0.1", 0};
    options.identity = NodeIdentity{wire::RELAY, "test", "egress-relay"};
    options.listener.tls = std::move(tls);
    options.listener.egress = pool.executor();
    options.listener.connection = connection;
    auto started = On(network.context(), [&] {
      return Server::Start(network.executor(), options, &memory, &links);
    });
    EXPECT_TRUE(started.ok()) << started.status().ToString();
    if (started.ok()) server = std::move(*started);
  }
  ~Relay() {
    On(network.context(), [&] {
      if (server) server->Stop();
      return 0;
    });
    std::this_thread::sleep_for(50ms);
    pool.Stop();
    network.Stop();
    pool.Shutdown();
    network.Shutdown();
    server.reset();
  }
  size_t live_links() {
    return On(network.context(), [&] { return links.ToJson().size(); });
  }
  struct Source {
    explicit Source(std::shared_ptr<std::vector<std::byte>> b) : data(std::move(b)) {}
    std::shared_ptr<std::vector<std::byte>> bytes() const { return data; }
    std::shared_ptr<std::vector<std::byte>> data;
  } source;
  IoPool network{1, "relay-net"};
  IoPool pool{4, "relay-egress"};
  LinkRegistry links;
  MemorySource memory;
  std::unique_ptr<Server> server;
};

// One child: dials from a strand of the children's pool, asks for pieces.
struct Child {
  std::shared_ptr<Connection> connection;
  std::vector<std::byte> received;
  Status status = Status::Ok();
  Clock::time_point finished;
};

awaitable<Status> Request(std::shared_ptr<Connection> connection, uint32_t index) {
  wire::Header header;
  header.mutable_piece_request()->set_kind(wire::DELTA);
  header.mutable_piece_request()->set_target_version(1);
  header.mutable_piece_request()->set_index(index);
  co_return co_await connection->Send(transport::MakeFrame(std::move(header)));
}

awaitable<void> DialChild(std::shared_ptr<Child> child, std::shared_ptr<transport::DialOptions> dial,
                          std::latch* dialled) {
  wire::Hello hello;
  hello.set_role(wire::WORKER);
  hello.set_channel(wire::DATA);
  hello.set_node_id("child");
  auto connection = co_await transport::Dial(*dial, hello);
  if (connection.ok()) {
    child->connection = *connection;
  } else {
    child->status = connection.status();
  }
  dialled->count_down();
}

// Fetches `pieces` pieces (index i % kPieces), 4 requests in flight.
awaitable<void> Fetch(std::shared_ptr<Child> child, uint32_t pieces, std::latch* done) {
  uint32_t requested = 0, received = 0;
  Status status = Status::Ok();
  while (status.ok() && requested < std::min<uint32_t>(4, pieces)) {
    status = co_await Request(child->connection, requested++ % kPieces);
  }
  while (status.ok() && received < pieces) {
    Result<Frame> frame = co_await child->connection->Receive();
    if (!frame.ok()) {
      status = frame.status();
      break;
    }
    ++received;
    child->received.insert(child->received.end(), frame->payload.begin(), frame->payload.end());
    if (requested < pieces) status = co_await Request(child->connection, requested++ % kPieces);
  }
  child->status = status;
  child->finished = Clock::now();
  done->count_down();
}

std::vector<std::shared_ptr<Child>> DialChildren(IoPool& pool, uint16_t port,
                                                 std::shared_ptr<asio::ssl::context> tls, int count,
                                                 transport::ConnectionOptions options = {}) {
  auto dial = std::make_shared<transport::DialOptions>();
  dial->endpoint = transport::Endpoint{"127.0.0.1", port};
  dial->tls = std::move(tls);
  dial->connection = options;
  std::vector<std::shared_ptr<Child>> children;
  std::latch dialled(count);
  for (int i = 0; i < count; ++i) {
    children.push_back(std::make_shared<Child>());
    asio::co_spawn(asio::make_strand(pool.context()), DialChild(children.back(), dial, &dialled),
                   asio::detached);
  }
  dialled.wait();
  for (auto& child : children) EXPECT_TRUE(child->status.ok()) << child->status.ToString();
  return children;
}

void CloseAll(std::vector<std::shared_ptr<Child>>& children) {
  for (auto& child : children) {
    if (child->connection) child->connection->Close(Status::Unavailable("test done"));
  }
}

TEST(EgressPoolTest, EightChildrenOfOneRelayReceiveIdenticalBytes) {
  TlsContexts tls = MakeTls();
  Relay relay({}, tls.server);
  ASSERT_NE(relay.server, nullptr);
  IoPool children_pool(2, "children");
  auto children = DialChildren(children_pool, relay.server->port(), tls.client, 8);
  const std::vector<double> pool_before = relay.pool.CpuSeconds();
  const double network_before = relay.network.CpuSeconds()[0];
  std::latch done(8);
  for (auto& child : children) {
    if (!child->connection) GTEST_SKIP() << "dial failed";
    asio::co_spawn(child->connection->executor(), Fetch(child, 4 * kPieces, &done), asio::detached);
  }
  done.wait();
  const std::vector<double> pool_after = relay.pool.CpuSeconds();
  const double network_cpu = relay.network.CpuSeconds()[0] - network_before;
  std::vector<std::byte> expected;
  for (int round = 0; round < 4; ++round) {
    expected.insert(expected.end(), relay.source.data->begin(), relay.source.data->end());
  }
  for (auto& child : children) {
    ASSERT_TRUE(child->status.ok()) << child->status.ToString();
    ASSERT_EQ(child->received.size(), expected.size());
    EXPECT_EQ(std::memcmp(child->received.data(), expected.data(), expected.size()), 0);
  }
  // The sealing and writing ran on the pool, on more than one of its threads.
  double pool_cpu = 0;
  int busy_threads = 0;
  for (size_t i = 0; i < pool_after.size(); ++i) {
    pool_cpu += pool_after[i] - pool_before[i];
    if (pool_after[i] - pool_before[i] > 0.002) ++busy_threads;
  }
  EXPECT_GE(busy_threads, 2) << "pool CPU " << pool_cpu << " s";
  EXPECT_GT(pool_cpu, network_cpu);
  CloseAll(children);
}

TEST(EgressPoolTest, AStalledChildTimesOutAloneWhileTheOthersFinish) {
  TlsContexts tls = MakeTls();
  transport::ConnectionOptions relay_options;
  relay_options.io_timeout = 2000ms;
  Relay relay(relay_options, tls.server);
  ASSERT_NE(relay.server, nullptr);
  IoPool children_pool(2, "children");
  transport::ConnectionOptions stalled_options;
  stalled_options.max_inbound_bytes = kPieceBytes;
  auto stalled = DialChildren(children_pool, relay.server->port(), tls.client, 1, stalled_options);
  auto others = DialChildren(children_pool, relay.server->port(), tls.client, 7);
  ASSERT_TRUE(stalled[0]->connection);
  // The stalled child asks for 50 MiB and never reads: its reader pauses, TCP fills up.
  std::promise<Status> asked;
  auto ask = [](std::shared_ptr<Connection> connection, std::promise<Status>* asked) -> awaitable<void> {
    Status status = Status::Ok();
    for (uint32_t i = 0; i < 200 && status.ok(); ++i) status = co_await Request(connection, i % kPieces);
    asked->set_value(status);
  };
  asio::co_spawn(stalled[0]->connection->executor(), ask(stalled[0]->connection, &asked), asio::detached);
  ASSERT_TRUE(asked.get_future().get().ok());
  std::this_thread::sleep_for(300ms);  // the relay's writes to it are blocked by now
  const Clock::time_point start = Clock::now();
  std::latch done(7);
  for (auto& child : others) {
    ASSERT_TRUE(child->connection);
    asio::co_spawn(child->connection->executor(), Fetch(child, kPieces, &done), asio::detached);
  }
  done.wait();
  for (auto& child : others) {
    ASSERT_TRUE(child->status.ok()) << child->status.ToString();
    EXPECT_EQ(std::memcmp(child->received.data(), relay.source.data->data(), kPieceBytes * kPieces), 0);
  }
  // They finished while the relay still held the stalled link (its timeout had not fired).
  EXPECT_EQ(relay.live_links(), 8u) << "the others finished after "
                                    << std::chrono::duration<double>(Clock::now() - start).count() << " s";
  CloseAll(others);
  // The relay drops the stalled child on its own, once a write to it took io_timeout.
  const Clock::time_point deadline = Clock::now() + 10s;
  while (relay.live_links() > 0 && Clock::now() < deadline) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(relay.live_links(), 0u) << "the relay never dropped the stalled child";
  CloseAll(stalled);
}

// ---- frames never interleave ----------------------------------------------------------

constexpr int kSenders = 8;
constexpr int kFramesPerSender = 40;

awaitable<void> SendFrames(std::shared_ptr<Connection> connection, int sender, std::latch* sent) {
  std::mt19937 random(static_cast<uint32_t>(sender));
  for (int seq = 0; seq < kFramesPerSender; ++seq) {
    const size_t size = 1 + random() % (300u << 10);
    auto payload = std::make_shared<std::vector<std::byte>>(
        size, static_cast<std::byte>(sender * 31 + seq));
    wire::Header header;
    header.mutable_piece()->set_index(static_cast<uint32_t>(sender << 16 | seq));
    std::span<const std::byte> bytes(*payload);
    Status status = co_await connection->Send(transport::MakeFrame(std::move(header), payload, bytes));
    if (!status.ok()) break;
  }
  sent->count_down();
}

// Receives every frame; an error describes the first one out of place.
awaitable<void> CheckFrames(std::shared_ptr<Connection> connection, std::promise<std::string>* verdict) {
  std::vector<int> next(kSenders, 0);
  std::string problem;
  for (int i = 0; i < kSenders * kFramesPerSender && problem.empty(); ++i) {
    Result<Frame> frame = co_await connection->Receive();
    if (!frame.ok()) {
      problem = "receive failed: " + frame.status().ToString();
      break;
    }
    const uint32_t index = frame->header.piece().index();
    const int sender = static_cast<int>(index >> 16), seq = static_cast<int>(index & 0xffff);
    if (sender >= kSenders || seq != next[sender]) {
      problem = "frame " + std::to_string(index) + " out of order";
      break;
    }
    ++next[sender];
    const auto fill = static_cast<std::byte>(sender * 31 + seq);
    for (std::byte b : frame->payload) {
      if (b != fill) {
        problem = "frame " + std::to_string(index) + " holds another frame's bytes";
        break;
      }
    }
  }
  verdict->set_value(problem);
}

class InterleaveTest : public ::testing::TestWithParam<bool> {};

TEST_P(InterleaveTest, ConcurrentSendersNeverInterleaveFrames) {
  const bool use_tls = GetParam();
  TlsContexts tls = use_tls ? MakeTls() : TlsContexts{};
  IoPool network(1, "net"), pool(4, "egress"), senders(4, "senders");
  transport::ListenerOptions options;
  options.tls = tls.server;
  options.egress = pool.executor();
  auto listener = On(network.context(), [&] {
    return transport::Listener::Bind(network.executor(), transport::Endpoint{"127.0.0.1", 0}, options);
  });
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  std::promise<std::string> verdict;
  On(network.context(), [&] {
    (*listener)->Start([](const wire::Hello&) { return wire::Welcome(); },
                       [&verdict](std::shared_ptr<Connection> connection) -> awaitable<void> {
                         co_await CheckFrames(connection, &verdict);
                       });
    return 0;
  });
  auto dial = std::make_shared<transport::DialOptions>();
  dial->endpoint = transport::Endpoint{"127.0.0.1", (*listener)->port()};
  dial->tls = tls.client;
  dial->egress = pool.executor();
  std::promise<Result<std::shared_ptr<Connection>>> dialled;
  auto dial_once = [](std::shared_ptr<transport::DialOptions> dial,
                      std::promise<Result<std::shared_ptr<Connection>>>* out) -> awaitable<void> {
    wire::Hello hello;
    hello.set_channel(wire::DATA);
    out->set_value(co_await transport::Dial(*dial, hello));
  };
  asio::co_spawn(senders.context(), dial_once(dial, &dialled), asio::detached);
  Result<std::shared_ptr<Connection>> connection = dialled.get_future().get();
  ASSERT_TRUE(connection.ok()) << connection.status().ToString();
  // Each sender on the senders' pool itself (no strand): they run on 4 threads at once.
  std::latch sent(kSenders);
  for (int sender = 0; sender < kSenders; ++sender) {
    asio::co_spawn(senders.context(), SendFrames(*connection, sender, &sent), asio::detached);
  }
  sent.wait();
  auto future = verdict.get_future();
  ASSERT_EQ(future.wait_for(20s), std::future_status::ready);
  EXPECT_EQ(future.get(), "");
  (*connection)->Close(Status::Unavailable("test done"));
  On(network.context(), [&] {
    (*listener)->Stop();
    return 0;
  });
  std::this_thread::sleep_for(50ms);
  senders.Stop();
  pool.Stop();
  network.Stop();
  for (IoPool* each : {&senders, &pool, &network}) each->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(TlsAndPlain, InterleaveTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Tls" : "Plain"; });

// ---- --egress-threads on the command line ---------------------------------------------

// Runs `flywheel <args>`; its exit status and what it printed.
std::pair<int, std::string> RunFlywheel(const std::string& args) {
  const std::string command = std::string(FLYWHEEL_BIN) + " " + args + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  std::string output;
  char buffer[512];
  while (pipe != nullptr && std::fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  const int status = pipe != nullptr ? ::pclose(pipe) : -1;
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

TEST(EgressThreadsFlagTest, ZeroOrNegativeIsRefusedNamingTheFlagAndNothingStarts) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("flywheel-egress-flag-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir / "watch");
  const std::string state = (dir / "state").string();
  auto [publish_code, publish_out] = RunFlywheel(
      "publish --egress-threads 0 --listen 127.0.0.1:0 --http 127.0.0.1:0 --state-dir " + state +
      " --watch " + (dir / "watch").string());
  EXPECT_EQ(publish_code, 1) << publish_out;
  EXPECT_NE(publish_out.find("publish: --egress-threads must be 1 or more (got 0)"), std::string::npos)
      << publish_out;
  EXPECT_FALSE(std::filesystem::exists(state)) << "nothing may be published or created";
  auto [relay_code, relay_out] = RunFlywheel(
      "relay --egress-threads -2 --listen 127.0.0.1:0 --http 127.0.0.1:0 --region r "
      "--upstream 127.0.0.1:1");
  EXPECT_EQ(relay_code, 1) << relay_out;
  EXPECT_NE(relay_out.find("relay: --egress-threads must be 1 or more (got -2)"), std::string::npos)
      << relay_out;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace flywheel::sync
