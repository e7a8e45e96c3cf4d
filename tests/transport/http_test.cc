// The HTTP endpoints over loopback: routing, authentication, limits, deadlines, TLS with
// mutual authentication, streamed answers, and Stop(). The server runs on its own thread;
// requests come from the test thread through HttpGet, HttpPostStream or a raw socket.
#include "transport/http.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>

#include "tests/transport/cert_suite.h"
#include "transport/certs.h"
#include "transport/tls.h"

namespace flywheel::transport {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

// An HttpServer on 127.0.0.1 with a few routes, run on its own thread.
class TestServer {
 public:
  explicit TestServer(HttpServerOptions options = {}) {
    auto server =
        HttpServer::Start(io_context_.get_executor(), {"127.0.0.1", 0}, std::move(options));
    EXPECT_TRUE(server.ok()) << server.status().ToString();
    if (!server.ok()) return;
    server_ = std::move(server).value();
    server_->Route("/v1/status", [](const std::string& target) {
      return HttpResponse{200, "application/json", R"({"target":")" + target + R"("})"};
    });
    server_->Route("/metrics", [](const std::string&) {
      return HttpResponse{200, "text/plain; version=0.0.4", "flywheel_up 1\n"};
    });
    server_->Route("/throws", [](const std::string&) -> HttpResponse {
      throw std::runtime_error("handler bug");
    });
    server_->Route("/bad-status", [](const std::string&) {
      return HttpResponse{1000, "text/plain", ""};
    });
    // A POST route whose handler suspends (a timer) before answering: the server keeps
    // serving other requests meanwhile.
    server_->RoutePost(
        "/v1/echo",
        [this](std::string target, std::string body) -> awaitable<HttpResponse> {
          asio::steady_timer timer(io_context_, milliseconds(20));
          co_await timer.async_wait(use_awaitable);
          co_return HttpResponse{200, "application/json", target + " " + body};
        },
        /*body_limit=*/64, kScopeSubmit);
    server_->Route(
        "/healthz",
        [](const std::string&) {
          return HttpResponse{200, "text/plain", "ok\n"};
        },
        /*is_public=*/true);
    thread_ = std::thread([this] {
      io_context_.run();
      returned_.set_value();
    });
  }

  ~TestServer() {
    if (!thread_.joinable()) return;
    asio::post(io_context_, [this] { server_->Stop(); });
    if (returned_future_.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
      ADD_FAILURE() << "io_context::run() did not return after Stop()";
      io_context_.stop();
    }
    thread_.join();
  }

  // Calls Stop() on the server's thread; true when io_context::run() then returns by itself.
  bool StopAndWait(milliseconds limit) {
    asio::post(io_context_, [this] { server_->Stop(); });
    bool returned = returned_future_.wait_for(limit) == std::future_status::ready;
    if (!returned) io_context_.stop();
    thread_.join();
    return returned;
  }

  // Runs `add` on the server's thread, where routes may be added while it serves.
  void AddRoutes(const std::function<void(HttpServer&)>& add) {
    std::promise<void> done;
    asio::post(io_context_, [&] {
      add(*server_);
      done.set_value();
    });
    done.get_future().wait();
  }

  asio::any_io_executor executor() { return io_context_.get_executor(); }
  bool started() const { return server_ != nullptr; }
  Endpoint endpoint() const { return {"127.0.0.1", server_->port()}; }
  uint16_t port() const { return server_->port(); }

 private:
  asio::io_context io_context_;
  std::unique_ptr<HttpServer> server_;
  std::promise<void> returned_;
  std::future<void> returned_future_ = returned_.get_future();
  std::thread thread_;
};

// A blocking loopback socket whose reads give up after `receive_timeout`.
class RawClient {
 public:
  // `source`: the local address to connect from (another loopback address is another
  // client address to the server).
  explicit RawClient(uint16_t port, milliseconds receive_timeout = milliseconds(5000),
                     const char* source = nullptr)
      : socket_(io_context_) {
    error_code ec;
    if (source != nullptr) {
      socket_.open(tcp::v4());
      socket_.bind({asio::ip::make_address(source), 0}, ec);
      EXPECT_FALSE(ec) << ec.message();
    }
    socket_.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
    EXPECT_FALSE(ec) << ec.message();
    timeval tv{};
    tv.tv_sec = receive_timeout.count() / 1000;
    tv.tv_usec = (receive_timeout.count() % 1000) * 1000;
    ::setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }

  void Send(const std::string& bytes) {
    error_code ec;
    asio::write(socket_, asio::buffer(bytes), ec);
    EXPECT_FALSE(ec) << ec.message();
  }

  // Reads until what arrived contains `needle` (or the connection ends); returns it all.
  std::string ReadUntil(const std::string& needle) {
    std::string received;
    char buffer[4096];
    while (received.find(needle) == std::string::npos) {
      error_code ec;
      size_t n = socket_.read_some(asio::buffer(buffer), ec);
      received.append(buffer, n);
      if (ec) break;
    }
    return received;
  }

  // Reads until the server closes the connection (or the receive timeout); returns what
  // arrived and sets `end` to the error that ended it.
  std::string ReadToEnd(error_code* end = nullptr) {
    std::string received;
    char buffer[4096];
    for (;;) {
      error_code ec;
      size_t n = socket_.read_some(asio::buffer(buffer), ec);
      received.append(buffer, n);
      if (ec) {
        if (end != nullptr) *end = ec;
        return received;
      }
    }
  }

 private:
  asio::io_context io_context_;
  tcp::socket socket_;
};

// Sends `request` on a connection of its own; returns all the server answers until it closes.
std::string Exchange(uint16_t port, const std::string& request) {
  RawClient client(port);
  client.Send(request);
  return client.ReadToEnd();
}

// `request` is answered 405 with an Allow header that starts with `allow`.
void ExpectMethodNotAllowed(uint16_t port, const std::string& request, const std::string& allow) {
  const std::string response = Exchange(port, request);
  EXPECT_EQ(response.rfind("HTTP/1.1 405", 0), 0u) << response;
  EXPECT_NE(response.find("Allow: " + allow), std::string::npos) << response;
}

size_t CountOccurrences(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

HttpGetOptions GetOptions(std::string token, std::shared_ptr<asio::ssl::context> tls = nullptr,
                          milliseconds timeout = milliseconds(5000)) {
  HttpGetOptions options;
  options.token = std::move(token);
  options.tls = std::move(tls);
  options.timeout = timeout;
  return options;
}

bool ClosedByPeer(const error_code& ec) {
  return ec == asio::error::eof || ec == asio::error::connection_reset;
}

// Connects and sends nothing; returns how long the server took to close the connection
// (a test failure unless it closed it without a byte).
std::chrono::steady_clock::duration TimeUntilASilentClientIsClosed(uint16_t port) {
  const auto start = std::chrono::steady_clock::now();
  RawClient silent(port);
  error_code end;
  EXPECT_EQ(silent.ReadToEnd(&end), "");
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
  return std::chrono::steady_clock::now() - start;
}

TEST(HttpTest, RoutesReturnTheirBodies) {
  TestServer server;
  ASSERT_TRUE(server.started());
  auto status = HttpGet(server.endpoint(), "/v1/status?verbose=1");
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->status, 200);
  EXPECT_EQ(status->content_type, "application/json");
  EXPECT_EQ(status->body, R"({"target":"/v1/status?verbose=1"})");

  auto metrics = HttpGet(server.endpoint(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status().ToString();
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->content_type, "text/plain; version=0.0.4");
  EXPECT_EQ(metrics->body, "flywheel_up 1\n");
}

TEST(HttpTest, UnknownPathIs404) {
  TestServer server;
  ASSERT_TRUE(server.started());
  for (const char* target : {"/", "/v1/status/", "/v1", "/metricsx"}) {
    auto response = HttpGet(server.endpoint(), target);
    ASSERT_TRUE(response.ok()) << response.status().ToString();
    EXPECT_EQ(response->status, 404) << target;
  }
}

TEST(HttpTest, OtherMethodsAre405) {
  TestServer server;
  ASSERT_TRUE(server.started());
  for (const char* method : {"POST", "PUT", "DELETE"}) {
    ExpectMethodNotAllowed(server.port(),
                           std::string(method) +
                               " /v1/status HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                               "Connection: close\r\n\r\n{}",
                           "GET, HEAD");
  }
}

TEST(HttpTest, PostRoutesGetTheBodyAndKeepTheirLimits) {
  TestServer server;
  ASSERT_TRUE(server.started());
  auto echo = HttpPost(server.endpoint(), "/v1/echo?x=1", R"({"a":1})");
  ASSERT_TRUE(echo.ok()) << echo.status().ToString();
  EXPECT_EQ(echo->status, 200);
  EXPECT_EQ(echo->body, R"(/v1/echo?x=1 {"a":1})");
  // A GET of a POST route is 405 naming POST.
  ExpectMethodNotAllowed(server.port(),
                         "GET /v1/echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "POST");
  // The route's own body limit.
  auto big = HttpPost(server.endpoint(), "/v1/echo", std::string(65, 'x'));
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_EQ(big->status, 413);
  auto health = HttpGet(server.endpoint(), "/healthz");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->status, 200);
}

TEST(HttpTest, HeadSendsHeadersOnly) {
  TestServer server;
  ASSERT_TRUE(server.started());
  const std::string response =
      Exchange(server.port(), "HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 200", 0), 0u) << response;
  EXPECT_NE(response.find("Content-Length: 14\r\n"), std::string::npos) << response;
  EXPECT_EQ(response.substr(response.size() - 4), "\r\n\r\n") << response;
}

TEST(HttpTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  TestServer server;
  ASSERT_TRUE(server.started());
  RawClient client(server.port());
  client.Send("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
  client.Send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  client.Send("GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::string responses = client.ReadToEnd();
  EXPECT_EQ(CountOccurrences(responses, "HTTP/1.1 200 OK"), 3u) << responses;
  EXPECT_EQ(CountOccurrences(responses, "flywheel_up 1"), 1u) << responses;
}

TEST(HttpTest, FailingHandlerIs500) {
  TestServer server;
  ASSERT_TRUE(server.started());
  auto response = HttpGet(server.endpoint(), "/throws");
  ASSERT_TRUE(response.ok()) << response.status().ToString();
  EXPECT_EQ(response->status, 500);
  auto bad_status = HttpGet(server.endpoint(), "/bad-status");
  ASSERT_TRUE(bad_status.ok()) << bad_status.status().ToString();
  EXPECT_EQ(bad_status->status, 500);
  // The server is still serving.
  auto health = HttpGet(server.endpoint(), "/healthz");
  ASSERT_TRUE(health.ok()) << health.status().ToString();
  EXPECT_EQ(health->status, 200);
}

TEST(HttpTest, TokenIsRequiredExceptOnPublicRoutes) {
  HttpServerOptions options;
  options.token = "s3cret-token";
  TestServer server(options);
  ASSERT_TRUE(server.started());

  auto missing = HttpGet(server.endpoint(), "/v1/status");
  ASSERT_TRUE(missing.ok()) << missing.status().ToString();
  EXPECT_EQ(missing->status, 401);

  for (const char* wrong : {"s3cret-tokeN", "s3cret-toke", "s3cret-token2", "x"}) {
    auto response = HttpGet(server.endpoint(), "/metrics", GetOptions(wrong));
    ASSERT_TRUE(response.ok()) << response.status().ToString();
    EXPECT_EQ(response->status, 401) << wrong;
  }

  auto right = HttpGet(server.endpoint(), "/v1/status", GetOptions("s3cret-token"));
  ASSERT_TRUE(right.ok()) << right.status().ToString();
  EXPECT_EQ(right->status, 200);
  EXPECT_EQ(right->body, R"({"target":"/v1/status"})");

  auto health = HttpGet(server.endpoint(), "/healthz");
  ASSERT_TRUE(health.ok()) << health.status().ToString();
  EXPECT_EQ(health->status, 200);

  auto post_missing = HttpPost(server.endpoint(), "/v1/echo", "{}");
  ASSERT_TRUE(post_missing.ok());
  EXPECT_EQ(post_missing->status, 401);
  auto post_right = HttpPost(server.endpoint(), "/v1/echo", "{}", GetOptions("s3cret-token"));
  ASSERT_TRUE(post_right.ok());
  EXPECT_EQ(post_right->status, 200);
}

TEST(HttpTest, EveryRouteRefusesATokenOfTheWrongScopeAndAMissingOne) {
  HttpServerOptions options;
  options.token = "fleet-token";
  options.write_token = "push-token";
  options.scoped_tokens = {{"dashboard-token", kScopeRead},
                           {"rollout-token", kScopeSubmit},
                           {"ops-token", kScopeAdmin | kScopeRead}};
  TestServer server(options);
  ASSERT_TRUE(server.started());
  // (token, status of GET /v1/status [read], status of POST /v1/echo [submit])
  const std::vector<std::tuple<std::string, int, int>> cases = {
      {"", 401, 401},                   // missing
      {"nobody", 401, 401},             // unknown
      {"fleet-token", 200, 200},        // read, sample, submit
      {"push-token", 200, 403},         // read, push
      {"dashboard-token", 200, 403},    // read only: cannot submit samples
      {"rollout-token", 403, 200},      // submit only: cannot read status
      {"ops-token", 200, 403},
  };
  for (const auto& [token, read, submit] : cases) {
    auto got = HttpGet(server.endpoint(), "/v1/status", GetOptions(token));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->status, read) << "GET with '" << token << "'";
    auto metrics = HttpGet(server.endpoint(), "/metrics", GetOptions(token));
    ASSERT_TRUE(metrics.ok());
    EXPECT_EQ(metrics->status, read) << "GET /metrics with '" << token << "'";
    auto posted = HttpPost(server.endpoint(), "/v1/echo", "{}", GetOptions(token));
    ASSERT_TRUE(posted.ok()) << posted.status().ToString();
    EXPECT_EQ(posted->status, submit) << "POST with '" << token << "'";
    if (submit == 403) {
      EXPECT_NE(posted->body.find("does not grant 'submit'"), std::string::npos) << posted->body;
    }
  }
  // /healthz stays public.
  auto health = HttpGet(server.endpoint(), "/healthz");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->status, 200);
}

TEST(HttpTest, ScopesParseByNameAndUnknownOnesAreNamed) {
  Result<uint32_t> scopes = ParseScopes("read,submit");
  ASSERT_TRUE(scopes.ok());
  EXPECT_EQ(*scopes, kScopeRead | kScopeSubmit);
  EXPECT_EQ(*ParseScopes("admin"), uint32_t{kScopeAdmin});
  Result<uint32_t> bad = ParseScopes("read,write");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'write'"), std::string::npos);
  EXPECT_FALSE(ParseScopes("").ok());
  EXPECT_FALSE(ParseScopes("read,").ok());
}

TEST(HttpTest, UnauthorizedNamesTheBearerScheme) {
  HttpServerOptions options;
  options.token = "s3cret-token";
  TestServer server(options);
  ASSERT_TRUE(server.started());
  const std::string response = Exchange(
      server.port(),
      "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic czNjcmV0LXRva2Vu\r\n"
      "Connection: close\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 401", 0), 0u) << response;
  EXPECT_NE(response.find("WWW-Authenticate: Bearer"), std::string::npos) << response;
  EXPECT_EQ(response.find("flywheel_up"), std::string::npos) << response;
}

TEST(HttpTest, OversizedHeaderIsRejected) {
  TestServer server;
  ASSERT_TRUE(server.started());
  RawClient client(server.port());
  client.Send("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: " + std::string(16 * 1024, 'a') +
              "\r\n\r\n");
  error_code end;
  std::string response = client.ReadToEnd(&end);
  // Either the 431 arrives or the close overtakes it; the request is never served.
  EXPECT_TRUE(response.empty() || response.rfind("HTTP/1.1 431", 0) == 0) << response;
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();

  auto huge_token = HttpGet(server.endpoint(), "/healthz", GetOptions(std::string(16384, 't')));
  EXPECT_TRUE(!huge_token.ok() || huge_token->status == 431);
}

TEST(HttpTest, SilentConnectionIsClosedAfterTheTimeout) {
  HttpServerOptions options;
  options.timeout = milliseconds(200);
  TestServer server(options);
  ASSERT_TRUE(server.started());

  const auto elapsed = TimeUntilASilentClientIsClosed(server.port());
  EXPECT_GE(elapsed, milliseconds(150));
  EXPECT_LT(elapsed, milliseconds(3000));

  // Half a request line, then nothing: closed as well.
  RawClient slow(server.port());
  slow.Send("GET /healthz HTTP/1.1\r\nHo");
  error_code end;
  EXPECT_EQ(slow.ReadToEnd(&end), "");
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
}

// A POST route whose handler holds its connection busy for `busy`.
void AddSlowRoute(TestServer& server, milliseconds busy) {
  server.AddRoutes([executor = server.executor(), busy](HttpServer& http) {
    http.RoutePost(
        "/v1/slow",
        [executor, busy](std::string, std::string) -> awaitable<HttpResponse> {
          asio::steady_timer timer(executor, busy);
          co_await timer.async_wait(use_awaitable);
          co_return HttpResponse{200, "text/plain", "done\n"};
        },
        64, kScopeSubmit);
  });
}

TEST(HttpTest, ConnectionsBeyondTheLimitAreClosedWhenEveryOneIsBusy) {
  HttpServerOptions options;
  options.max_connections = 1;
  TestServer server(options);
  ASSERT_TRUE(server.started());
  AddSlowRoute(server, milliseconds(1000));
  RawClient first(server.port());
  first.Send("POST /v1/slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
  std::this_thread::sleep_for(milliseconds(100));
  RawClient second(server.port());
  error_code end;
  EXPECT_EQ(second.ReadToEnd(&end), "");
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
  // The busy connection was never touched.
  EXPECT_NE(first.ReadToEnd().find("done"), std::string::npos);
}

// Keep-alive cannot hold a slot: a kept-alive connection waiting for its next request is
// closed to make room for a new client (the server's limit here: one connection).
TEST(HttpTest, AnIdleKeptAliveConnectionMakesRoomForANewClient) {
  HttpServerOptions options;
  options.max_connections = 1;
  TestServer server(options);
  ASSERT_TRUE(server.started());
  RawClient idle(server.port());
  idle.Send("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_NE(idle.ReadUntil("ok\n").find("HTTP/1.1 200"), std::string::npos);
  auto fresh = HttpGet(server.endpoint(), "/healthz");
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_EQ(fresh->status, 200);
  error_code end;
  EXPECT_EQ(idle.ReadToEnd(&end), "");
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
}

// One address gets at most max_connections_per_address slots; another address still gets in
// even when the first one's connections are all busy.
TEST(HttpTest, OneAddressHoldsAtMostItsShareOfTheSlots) {
  HttpServerOptions options;
  options.max_connections = 8;
  options.max_connections_per_address = 2;
  TestServer server(options);
  ASSERT_TRUE(server.started());
  AddSlowRoute(server, milliseconds(1000));
  const std::string slow =
      "POST /v1/slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
  RawClient a1(server.port(), milliseconds(5000), "127.0.0.2");
  RawClient a2(server.port(), milliseconds(5000), "127.0.0.2");
  a1.Send(slow);
  a2.Send(slow);
  std::this_thread::sleep_for(milliseconds(100));
  RawClient a3(server.port(), milliseconds(5000), "127.0.0.2");
  error_code end;
  EXPECT_EQ(a3.ReadToEnd(&end), "");  // its address is at its limit, both busy
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
  auto other = HttpGet(server.endpoint(), "/healthz");  // from 127.0.0.1
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  EXPECT_EQ(other->status, 200);
}

// The hole: one address opens 300 keep-alive sockets and sends GET /healthz on each every
// second, reconnecting whatever the server closes. Before, the first 256 held every slot for
// good and every other client was refused. Now a real client is served throughout, and its
// latency stays near the undisturbed one.
TEST(HttpTest, ThreeHundredKeepAliveSocketsDoNotStarveARealClient) {
  TestServer server;
  ASSERT_TRUE(server.started());
  const auto measure = [&](int requests, int* failures) {
    std::vector<double> ms;
    for (int i = 0; i < requests; ++i) {
      const auto start = std::chrono::steady_clock::now();
      auto response = HttpGet(server.endpoint(), "/v1/status");
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      if (!response.ok() || response->status != 200) ++*failures;
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() * 99 / 100];
  };
  int failures = 0;
  const double undisturbed_p99 = measure(200, &failures);
  ASSERT_EQ(failures, 0);

  std::atomic<bool> stop{false};
  std::atomic<int> attacker_requests{0}, attacker_reconnects{0};
  std::thread attacker([&] {
    std::vector<std::unique_ptr<RawClient>> sockets;
    for (int i = 0; i < 300; ++i)
      sockets.push_back(std::make_unique<RawClient>(server.port(), milliseconds(200)));
    while (!stop) {
      for (auto& socket : sockets) {
        if (stop) break;
        socket->Send("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
        if (socket->ReadUntil("ok\n").find("ok\n") == std::string::npos) {
          socket = std::make_unique<RawClient>(server.port(), milliseconds(200));
          ++attacker_reconnects;
        } else {
          ++attacker_requests;
        }
      }
      std::this_thread::sleep_for(milliseconds(1000));
    }
  });
  std::this_thread::sleep_for(milliseconds(1500));  // every socket has sent a request
  const double attacked_p99 = measure(200, &failures);
  stop = true;
  attacker.join();
  std::printf("real client p99: undisturbed %.3f ms, beside 300 keep-alive sockets %.3f ms "
              "(%.2fx); the attacker made %d requests and reconnected %d times\n",
              undisturbed_p99, attacked_p99, attacked_p99 / undisturbed_p99,
              attacker_requests.load(), attacker_reconnects.load());
  EXPECT_EQ(failures, 0) << "real requests refused while the attacker held keep-alive sockets";
  // The target is 2x; a few milliseconds of slack absorb this shared machine's scheduling
  // noise on sub-millisecond figures.
  EXPECT_LE(attacked_p99, 2 * undisturbed_p99 + 5.0);
}

// A request without a valid token is answered before its body is read, and the connection
// closed: here the client sends the header of a 256 MiB body and nothing more, and the 401
// arrives at once (before, the server waited for the body).
TEST(HttpTest, UnauthenticatedBodiesAreRefusedBeforeAnyOfThemIsRead) {
  HttpServerOptions options;
  options.token = "fleet-token";
  options.scoped_tokens = {{"dashboard-token", kScopeRead}};
  TestServer server(options);
  ASSERT_TRUE(server.started());
  server.AddRoutes([](HttpServer& http) {
    http.RoutePost(
        "/v1/big", [](std::string, std::string body) -> awaitable<HttpResponse> {
          co_return HttpResponse{200, "text/plain", std::to_string(body.size())};
        },
        256 << 20, kScopeSubmit);
    http.RouteApi(
        "/v1/api", [](HttpRequest request) -> awaitable<HttpResponse> {
          co_return HttpResponse{200, "text/plain", std::to_string(request.body.size())};
        },
        256 << 20);
  });
  struct Case {
    const char* path;
    const char* token;
    const char* answer;
  };
  for (const Case& c : {Case{"/v1/big", nullptr, "HTTP/1.1 401"},
                        Case{"/v1/big", "wrong", "HTTP/1.1 401"},
                        Case{"/v1/big", "dashboard-token", "HTTP/1.1 403"},
                        Case{"/v1/api", nullptr, "HTTP/1.1 401"},
                        Case{"/v1/api", "wrong", "HTTP/1.1 401"}}) {
    for (const char* framing : {"Content-Length: 268435456", "Transfer-Encoding: chunked"}) {
      RawClient client(server.port(), milliseconds(2000));
      const auto start = std::chrono::steady_clock::now();
      client.Send(std::string("POST ") + c.path + " HTTP/1.1\r\nHost: x\r\n" + framing + "\r\n" +
                  (c.token ? std::string("Authorization: Bearer ") + c.token + "\r\n" : "") +
                  "\r\n");
      error_code end;
      const std::string response = client.ReadToEnd(&end);
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_EQ(response.rfind(c.answer, 0), 0u) << c.path << " " << framing << ": " << response;
      EXPECT_NE(response.find("Connection: close"), std::string::npos) << response;
      EXPECT_TRUE(ClosedByPeer(end)) << end.message();
      EXPECT_LT(waited, 1.5) << "the answer waited for the body";
    }
  }
  // A client that sends its whole (1 MiB) body anyway still reads the 401.
  auto sent = HttpPost(server.endpoint(), "/v1/big", std::string(1 << 20, 'x'));
  ASSERT_TRUE(sent.ok()) << sent.status().ToString();
  EXPECT_EQ(sent->status, 401);
  auto right = HttpPost(server.endpoint(), "/v1/big", std::string(1 << 20, 'x'), GetOptions("fleet-token"));
  ASSERT_TRUE(right.ok()) << right.status().ToString();
  EXPECT_EQ(right->body, std::to_string(1 << 20));
}

// A chunked body is held to its route's limit as it arrives: the 413 comes after the first
// chunk past it, without waiting for the rest (before, chunked bodies were read up to the
// largest limit of any route).
TEST(HttpTest, ChunkedBodiesKeepTheirRoutesLimit) {
  TestServer server;
  ASSERT_TRUE(server.started());
  RawClient client(server.port(), milliseconds(2000));
  client.Send("POST /v1/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n" +
              std::string(1024, 'x') + "\r\n");  // and never the last chunk
  error_code end;
  const std::string response = client.ReadToEnd(&end);
  EXPECT_EQ(response.rfind("HTTP/1.1 413", 0), 0u) << response;
  EXPECT_NE(response.find("limit 64 bytes"), std::string::npos) << response;
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
}

// A refused token ends the connection: a client cannot keep a slot by sending requests the
// server refuses.
TEST(HttpTest, A401ClosesTheConnection) {
  HttpServerOptions options;
  options.token = "fleet-token";
  TestServer server(options);
  ASSERT_TRUE(server.started());
  RawClient client(server.port(), milliseconds(2000));
  client.Send("GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n");
  error_code end;
  const std::string responses = client.ReadToEnd(&end);
  EXPECT_EQ(CountOccurrences(responses, "HTTP/1.1 401"), 1u) << responses;
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
}

TEST(HttpTest, StopClosesConnectionsAndRunReturns) {
  TestServer server;
  ASSERT_TRUE(server.started());
  RawClient idle(server.port());
  RawClient kept_alive(server.port());
  kept_alive.Send("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_TRUE(server.StopAndWait(milliseconds(2000)));
  error_code end;
  EXPECT_EQ(idle.ReadToEnd(&end), "");
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
  std::string response = kept_alive.ReadToEnd(&end);
  EXPECT_EQ(CountOccurrences(response, "HTTP/1.1 200"), 1u) << response;
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
}

TEST(HttpTest, StopWithoutConnectionsRunReturns) {
  TestServer server;
  ASSERT_TRUE(server.started());
  EXPECT_TRUE(server.StopAndWait(milliseconds(2000)));
}

TEST(HttpTest, UnreachableServerIsUnavailableNamingTheEndpoint) {
  uint16_t port;
  {
    // A port that was free a moment ago and now has no listener.
    asio::io_context io_context;
    tcp::acceptor acceptor(io_context, {asio::ip::make_address("127.0.0.1"), 0});
    port = acceptor.local_endpoint().port();
  }
  auto response = HttpGet({"127.0.0.1", port}, "/healthz");
  ASSERT_FALSE(response.ok());
  EXPECT_EQ(response.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(response.status().message().find("127.0.0.1:" + std::to_string(port)),
            std::string::npos)
      << response.status().ToString();
}

TEST(HttpTest, ClientTimeoutIsUnavailable) {
  // A listener that never answers.
  asio::io_context io_context;
  tcp::acceptor acceptor(io_context, {asio::ip::make_address("127.0.0.1"), 0});
  auto start = std::chrono::steady_clock::now();
  auto response = HttpGet({"127.0.0.1", acceptor.local_endpoint().port()}, "/healthz",
                          GetOptions("", nullptr, milliseconds(200)));
  auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(response.ok());
  EXPECT_EQ(response.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(response.status().message().find("timed out"), std::string::npos)
      << response.status().ToString();
  EXPECT_LT(elapsed, milliseconds(3000));
}

TEST(HttpTest, ListeningOnABadAddressFails) {
  asio::io_context io_context;
  auto server = HttpServer::Start(io_context.get_executor(), {"192.0.2.1", 0}, {});
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(server.status().message().find("192.0.2.1"), std::string::npos);
}

// A one-shot event that a handler awaits on the server's thread, without blocking it, and
// that another thread or an OnGone callback sets. Held by shared_ptr so that a handler
// still waiting when a test fails early does not outlive it.
class Event : public std::enable_shared_from_this<Event> {
 public:
  static std::shared_ptr<Event> Make(asio::any_io_executor executor) {
    return std::shared_ptr<Event>(new Event(std::move(executor)));
  }
  // From any thread.
  void Set() {
    asio::post(executor_, [self = shared_from_this()] { self->SetHere(); });
  }
  // On the server's thread.
  void SetHere() {
    set_ = true;
    timer_.cancel();
  }
  awaitable<void> Wait() {
    while (!set_) {
      error_code ec;
      co_await timer_.async_wait(asio::redirect_error(use_awaitable, ec));
    }
  }

 private:
  explicit Event(asio::any_io_executor executor)
      : executor_(executor), timer_(executor, asio::steady_timer::time_point::max()) {}
  asio::any_io_executor executor_;
  asio::steady_timer timer_;
  bool set_ = false;
};

using Clock = std::chrono::steady_clock;
using StreamResult = awaitable<std::optional<HttpResponse>>;

// POST /v1/stream: "data: <body>", then waits for `release`, then "data: 2".
void AddTwoChunkRoute(TestServer& server, std::shared_ptr<Event> release) {
  server.AddRoutes([release](HttpServer& http) {
    http.RoutePostStream(
        "/v1/stream",
        [release](std::string, std::string body, HttpStream& stream) -> StreamResult {
          if (!co_await stream.Write("data: " + body + "\n\n")) co_return std::nullopt;
          co_await release->Wait();
          co_await stream.Write("data: 2\n\n");
          co_return std::nullopt;
        },
        /*body_limit=*/64, kScopeSample);
  });
}

// The client sees the first chunk while the handler still waits to write the second.
void ExpectChunksArriveWhileTheHandlerRuns(TestServer& server, const HttpGetOptions& options) {
  auto release = Event::Make(server.executor());
  AddTwoChunkRoute(server, release);
  std::string received;
  bool released = false;
  auto result =
      HttpPostStream(server.endpoint(), "/v1/stream", "1", options, [&](std::string_view piece) {
        received += piece;
        if (!released && received.find("\n\n") != std::string::npos) {
          // The handler waits for `release`: chunk 1 came alone.
          EXPECT_EQ(received, "data: 1\n\n");
          released = true;
          release->Set();
        }
        return true;
      });
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_TRUE(released);
  EXPECT_EQ(result->status, 200);
  EXPECT_EQ(result->content_type, "text/event-stream");
  EXPECT_EQ(result->body, "");
  EXPECT_EQ(received, "data: 1\n\ndata: 2\n\n");
}

// What a stream handler saw after its client left. Written on the server's thread before
// `returned` is set.
struct LeaveProbe {
  std::optional<Clock::time_point> gone_at;  // when the OnGone callback ran
  bool gone_after_wait = false;
  bool late_callback_ran_at_once = false;
  bool write_after_gone = true;
  int chunks_written = 0;
  std::promise<void> returned;
};

// POST /v1/wait: one chunk, then waits for what only its OnGone callback releases.
// POST /v1/produce: writes a chunk every 5 ms until a write fails.
void AddLeaveRoutes(TestServer& server, std::shared_ptr<LeaveProbe> waiting,
                    std::shared_ptr<LeaveProbe> producing) {
  server.AddRoutes([=](HttpServer& http) {
    http.RoutePostStream(
        "/v1/wait",
        [waiting](std::string, std::string, HttpStream& stream) -> StreamResult {
          auto gone = Event::Make(co_await asio::this_coro::executor);
          stream.OnGone([waiting, gone] {
            waiting->gone_at = Clock::now();
            gone->SetHere();
          });
          co_await stream.Write("data: 1\n\n");
          co_await gone->Wait();
          waiting->gone_after_wait = stream.gone();
          bool ran = false;
          stream.OnGone([&ran] { ran = true; });
          waiting->late_callback_ran_at_once = ran;
          waiting->write_after_gone = co_await stream.Write("data: 2\n\n");
          waiting->returned.set_value();
          co_return std::nullopt;
        },
        /*body_limit=*/64, kScopeSample);
    http.RoutePostStream(
        "/v1/produce",
        [producing](std::string, std::string, HttpStream& stream) -> StreamResult {
          stream.OnGone([producing] { producing->gone_at = Clock::now(); });
          asio::steady_timer timer(co_await asio::this_coro::executor);
          while (co_await stream.Write("data: more\n\n")) {
            ++producing->chunks_written;
            timer.expires_after(milliseconds(5));
            co_await timer.async_wait(use_awaitable);
          }
          producing->gone_after_wait = stream.gone();
          producing->write_after_gone = false;
          producing->returned.set_value();
          co_return std::nullopt;
        },
        /*body_limit=*/64, kScopeSample);
  });
}

// A client that leaves after the first chunk: the waiting handler's OnGone runs promptly
// (it is not writing), the producing one's next Write fails; both return.
void ExpectLeavingClientIsNoticed(TestServer& server, const HttpGetOptions& options) {
  auto waiting = std::make_shared<LeaveProbe>();
  auto producing = std::make_shared<LeaveProbe>();
  AddLeaveRoutes(server, waiting, producing);
  for (const auto& [target, probe] : {std::pair{"/v1/wait", waiting}, {"/v1/produce", producing}}) {
    std::future<void> returned = probe->returned.get_future();
    std::string received;
    auto result =
        HttpPostStream(server.endpoint(), target, "{}", options, [&](std::string_view piece) {
          received += piece;
          return false;  // leave at once
        });
    const Clock::time_point left = Clock::now();
    ASSERT_TRUE(result.ok()) << target << ": " << result.status().ToString();
    EXPECT_EQ(result->status, 200) << target;
    EXPECT_EQ(received.rfind("data: ", 0), 0u) << target << ": " << received;
    ASSERT_EQ(returned.wait_for(std::chrono::seconds(5)), std::future_status::ready)
        << target << ": the handler did not return after its client left";
    ASSERT_TRUE(probe->gone_at.has_value()) << target;
    const auto delay = std::chrono::duration_cast<milliseconds>(*probe->gone_at - left);
    // Typically well under a millisecond; generous for a loaded machine.
    EXPECT_LT(delay, milliseconds(500)) << target;
    EXPECT_TRUE(probe->gone_after_wait) << target;
    EXPECT_FALSE(probe->write_after_gone) << target;
  }
  EXPECT_TRUE(waiting->late_callback_ran_at_once);
  // The server goes on serving.
  auto health = HttpGet(server.endpoint(), "/healthz", options);
  ASSERT_TRUE(health.ok()) << health.status().ToString();
  EXPECT_EQ(health->status, 200);
}

TEST(HttpStreamTest, ChunksArriveWhileTheHandlerRuns) {
  TestServer server;
  ASSERT_TRUE(server.started());
  ExpectChunksArriveWhileTheHandlerRuns(server, GetOptions(""));
}

TEST(HttpStreamTest, StreamIsChunkedUnbufferedAndKeepsTheConnection) {
  TestServer server;
  ASSERT_TRUE(server.started());
  auto release = Event::Make(server.executor());
  AddTwoChunkRoute(server, release);
  RawClient client(server.port());
  client.Send("POST /v1/stream HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n1");
  std::string head = client.ReadUntil("data: 1\n\n\r\n");
  EXPECT_EQ(head.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << head;
  for (const char* field : {"Content-Type: text/event-stream\r\n", "Cache-Control: no-cache\r\n",
                            "X-Accel-Buffering: no\r\n", "Transfer-Encoding: chunked\r\n"}) {
    EXPECT_NE(head.find(field), std::string::npos) << field << " in " << head;
  }
  EXPECT_EQ(head.find("Content-Length"), std::string::npos) << head;
  EXPECT_NE(head.find("\r\n\r\n9\r\ndata: 1\n\n\r\n"), std::string::npos) << head;
  // A request pipelined while the handler waits is no sign of a client leaving; it is
  // served after the stream.
  client.Send("GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::this_thread::sleep_for(milliseconds(50));  // lets the server read it meanwhile
  release->Set();
  error_code end;
  std::string rest = client.ReadToEnd(&end);
  EXPECT_EQ(rest.rfind("9\r\ndata: 2\n\n\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n", 0), 0u) << rest;
  EXPECT_EQ(rest.substr(rest.size() - 3), "ok\n") << rest;
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
}

TEST(HttpStreamTest, Http10ClientGetsAnUnchunkedStreamEndedByTheClose) {
  TestServer server;
  ASSERT_TRUE(server.started());
  auto release = Event::Make(server.executor());
  release->Set();
  AddTwoChunkRoute(server, release);
  RawClient client(server.port());
  client.Send("POST /v1/stream HTTP/1.0\r\nContent-Length: 1\r\n\r\n1");
  error_code end;
  std::string response = client.ReadToEnd(&end);
  EXPECT_EQ(response.rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << response;
  EXPECT_EQ(response.find("Transfer-Encoding"), std::string::npos) << response;
  EXPECT_EQ(response.substr(response.find("\r\n\r\n") + 4), "data: 1\n\ndata: 2\n\n");
  EXPECT_TRUE(ClosedByPeer(end)) << end.message();
}

TEST(HttpStreamTest, StreamRouteMayAnswerWhole) {
  TestServer server;
  ASSERT_TRUE(server.started());
  server.AddRoutes([](HttpServer& http) {
    http.RoutePostStream(
        "/v1/answer",
        [](std::string target, std::string body, HttpStream& stream) -> StreamResult {
          const std::string mode = target.substr(target.find('?') + 1);
          if (mode == "whole") co_return HttpResponse{201, "application/json", body};
          if (mode == "nothing") co_return std::nullopt;
          if (mode == "throw") throw std::runtime_error("handler bug");
          co_await stream.Write("data: 1\n\n");
          if (mode == "throw-after-write") throw std::runtime_error("handler bug");
          co_return HttpResponse{201, "application/json", "ignored"};  // "answer-after-write"
        },
        /*body_limit=*/64, kScopeSample);
  });
  auto whole = HttpPost(server.endpoint(), "/v1/answer?whole", R"({"a":1})");
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(whole->status, 201);
  EXPECT_EQ(whole->content_type, "application/json");
  EXPECT_EQ(whole->body, R"({"a":1})");
  // HttpPostStream without on_data collects the body.
  auto collected = HttpPostStream(server.endpoint(), "/v1/answer?whole", "{}", {}, nullptr);
  ASSERT_TRUE(collected.ok()) << collected.status().ToString();
  EXPECT_EQ(collected->status, 201);
  EXPECT_EQ(collected->body, "{}");

  for (const char* target : {"/v1/answer?nothing", "/v1/answer?throw"}) {
    auto response = HttpPost(server.endpoint(), target, "{}");
    ASSERT_TRUE(response.ok()) << response.status().ToString();
    EXPECT_EQ(response->status, 500) << target;
  }
  std::string received;
  auto collect = [&](std::string_view piece) {
    received += piece;
    return true;
  };
  // A handler that fails mid-stream: the body ends without its terminating chunk.
  auto truncated =
      HttpPostStream(server.endpoint(), "/v1/answer?throw-after-write", "{}", {}, collect);
  EXPECT_FALSE(truncated.ok());
  EXPECT_EQ(received, "data: 1\n\n");
  received.clear();
  auto streamed =
      HttpPostStream(server.endpoint(), "/v1/answer?answer-after-write", "{}", {}, collect);
  ASSERT_TRUE(streamed.ok()) << streamed.status().ToString();
  EXPECT_EQ(streamed->status, 200);
  EXPECT_EQ(received, "data: 1\n\n");
}

TEST(HttpStreamTest, StreamRouteKeepsAuthenticationAndLimits) {
  HttpServerOptions options;
  options.token = "fleet-token";
  options.scoped_tokens = {{"dashboard-token", kScopeRead}};
  TestServer server(options);
  ASSERT_TRUE(server.started());
  auto release = Event::Make(server.executor());
  release->Set();
  AddTwoChunkRoute(server, release);
  const auto no_data = [](std::string_view) { return true; };
  auto missing = HttpPostStream(server.endpoint(), "/v1/stream", "1", {}, no_data);
  ASSERT_TRUE(missing.ok()) << missing.status().ToString();
  EXPECT_EQ(missing->status, 401);
  auto read_only =
      HttpPostStream(server.endpoint(), "/v1/stream", "1", GetOptions("dashboard-token"), nullptr);
  ASSERT_TRUE(read_only.ok()) << read_only.status().ToString();
  EXPECT_EQ(read_only->status, 403);
  EXPECT_NE(read_only->body.find("does not grant 'sample'"), std::string::npos) << read_only->body;
  auto too_big =
      HttpPost(server.endpoint(), "/v1/stream", std::string(65, 'x'), GetOptions("fleet-token"));
  ASSERT_TRUE(too_big.ok()) << too_big.status().ToString();
  EXPECT_EQ(too_big->status, 413);
  auto right = HttpPost(server.endpoint(), "/v1/stream", "1", GetOptions("fleet-token"));
  ASSERT_TRUE(right.ok()) << right.status().ToString();
  EXPECT_EQ(right->status, 200);
  EXPECT_EQ(right->body, "data: 1\n\ndata: 2\n\n");  // HttpPost de-chunks as well
  // A GET of a stream route is 405 naming POST.
  ExpectMethodNotAllowed(server.port(),
                         "GET /v1/stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                         "POST");
}

TEST(HttpStreamTest, ClientLeavingMidStreamIsNoticedWhileTheHandlerWaits) {
  TestServer server;
  ASSERT_TRUE(server.started());
  ExpectLeavingClientIsNoticed(server, GetOptions(""));
}

TEST(HttpStreamTest, ClientThatStopsReadingHitsTheWriteDeadline) {
  HttpServerOptions options;
  options.timeout = milliseconds(300);
  TestServer server(options);
  ASSERT_TRUE(server.started());
  auto probe = std::make_shared<LeaveProbe>();
  std::future<void> returned = probe->returned.get_future();
  server.AddRoutes([probe](HttpServer& http) {
    http.RoutePostStream(
        "/v1/flood",
        [probe](std::string, std::string, HttpStream& stream) -> StreamResult {
          const std::string chunk(256 * 1024, 'x');
          while (co_await stream.Write(chunk)) ++probe->chunks_written;
          probe->gone_after_wait = stream.gone();
          probe->returned.set_value();
          co_return std::nullopt;
        },
        /*body_limit=*/64, kScopeSample);
  });
  RawClient client(server.port());
  const Clock::time_point start = Clock::now();
  client.Send("POST /v1/flood HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  // Never reads: the socket buffers fill up and a write waits out its deadline.
  ASSERT_EQ(returned.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_GE(Clock::now() - start, milliseconds(250));
  EXPECT_TRUE(probe->gone_after_wait);
  EXPECT_GT(probe->chunks_written, 0);
}

TEST(HttpStreamTest, StopWhileStreamingEndsTheStreamsAndRunReturns) {
  TestServer server;
  ASSERT_TRUE(server.started());
  auto waiting = std::make_shared<LeaveProbe>();
  auto producing = std::make_shared<LeaveProbe>();
  AddLeaveRoutes(server, waiting, producing);
  std::future<void> waiting_returned = waiting->returned.get_future();
  std::future<void> producing_returned = producing->returned.get_future();
  // Each client runs on its own thread and tells when its first chunk arrived.
  auto stream = [&](const char* target, std::promise<void>* first) {
    return std::async(std::launch::async, [&server, target, first] {
      bool told = false;
      return HttpPostStream(server.endpoint(), target, "{}", GetOptions(""), [&](std::string_view) {
        if (!told) first->set_value();
        told = true;
        return true;
      });
    });
  };
  std::promise<void> waiting_first, producing_first;
  auto waiting_client = stream("/v1/wait", &waiting_first);
  auto producing_client = stream("/v1/produce", &producing_first);
  ASSERT_EQ(waiting_first.get_future().wait_for(std::chrono::seconds(5)),
            std::future_status::ready);
  ASSERT_EQ(producing_first.get_future().wait_for(std::chrono::seconds(5)),
            std::future_status::ready);

  EXPECT_TRUE(server.StopAndWait(milliseconds(2000)));
  EXPECT_EQ(waiting_returned.wait_for(milliseconds(0)), std::future_status::ready);
  EXPECT_EQ(producing_returned.wait_for(milliseconds(0)), std::future_status::ready);
  EXPECT_TRUE(waiting->gone_after_wait);
  EXPECT_TRUE(producing->gone_after_wait);
  // The clients see the streams end without their terminating chunk.
  ASSERT_EQ(waiting_client.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  ASSERT_EQ(producing_client.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_FALSE(waiting_client.get().ok());
  EXPECT_FALSE(producing_client.get().ok());
}

class HttpsTest : public CertificateSuite {
 protected:
  static void SetUpTestSuite() {
    CertificateSuite::SetUpTestSuite();
    CertificateOptions other_host;
    other_host.hosts = {"other.example"};
    const Status status = WriteTestCertificates(*dir_ + "/other", other_host);
    ASSERT_TRUE(status.ok()) << status.ToString();
  }

  static std::shared_ptr<asio::ssl::context> Server(const TlsOptions& options) {
    auto context = MakeServerTlsContext(options);
    EXPECT_TRUE(context.ok()) << context.status().ToString();
    return context.ok() ? *context : nullptr;
  }
  static std::shared_ptr<asio::ssl::context> Client(const TlsOptions& options) {
    auto context = MakeClientTlsContext(options);
    EXPECT_TRUE(context.ok()) << context.status().ToString();
    return context.ok() ? *context : nullptr;
  }
  static HttpServerOptions MutualServer() {
    HttpServerOptions options;
    options.tls = Server({Path("server.crt"), Path("server.key"), Path("ca.crt")});
    options.timeout = milliseconds(2000);
    return options;
  }
};

void ExpectUnavailable(const Result<HttpResponse>& response) {
  ASSERT_FALSE(response.ok()) << "status " << response->status;
  EXPECT_EQ(response.status().code(), StatusCode::kUnavailable) << response.status().ToString();
  EXPECT_NE(response.status().message().find("127.0.0.1:"), std::string::npos)
      << response.status().ToString();
}

TEST_F(HttpsTest, ClientWithCertificateIsServed) {
  TestServer server(MutualServer());
  ASSERT_TRUE(server.started());
  auto tls = Client({Path("client.crt"), Path("client.key"), Path("ca.crt")});
  auto response = HttpGet(server.endpoint(), "/v1/status", GetOptions("", tls));
  ASSERT_TRUE(response.ok()) << response.status().ToString();
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->body, R"({"target":"/v1/status"})");

  // By name as well: SNI and DNS-name verification.
  auto by_name = HttpGet({"localhost", server.port()}, "/healthz", GetOptions("", tls));
  ASSERT_TRUE(by_name.ok()) << by_name.status().ToString();
  EXPECT_EQ(by_name->status, 200);
}

TEST_F(HttpsTest, ClientWithoutCertificateIsRejected) {
  TestServer server(MutualServer());
  ASSERT_TRUE(server.started());
  ExpectUnavailable(
      HttpGet(server.endpoint(), "/healthz", GetOptions("", Client({"", "", Path("ca.crt")}))));
}

TEST_F(HttpsTest, ClientWithRogueCertificateIsRejected) {
  TestServer server(MutualServer());
  ASSERT_TRUE(server.started());
  auto tls = Client({Path("rogue.crt"), Path("rogue.key"), Path("ca.crt")});
  ExpectUnavailable(HttpGet(server.endpoint(), "/healthz", GetOptions("", tls)));
  // The server keeps serving good clients.
  auto good = Client({Path("client.crt"), Path("client.key"), Path("ca.crt")});
  auto response = HttpGet(server.endpoint(), "/healthz", GetOptions("", good));
  ASSERT_TRUE(response.ok()) << response.status().ToString();
}

TEST_F(HttpsTest, ServerFromAnotherCaIsRejected) {
  TestServer server(MutualServer());
  ASSERT_TRUE(server.started());
  auto tls = Client({Path("client.crt"), Path("client.key"), Path("rogue-ca.crt")});
  ExpectUnavailable(HttpGet(server.endpoint(), "/healthz", GetOptions("", tls)));
}

TEST_F(HttpsTest, ServerCertificateForAnotherHostIsRejected) {
  HttpServerOptions options;
  options.tls = Server({Path("other/server.crt"), Path("other/server.key"), ""});
  TestServer server(options);
  ASSERT_TRUE(server.started());
  auto tls = Client({"", "", Path("other/ca.crt")});
  auto response = HttpGet(server.endpoint(), "/healthz", GetOptions("", tls));
  ExpectUnavailable(response);
  EXPECT_NE(response.status().message().find("TLS handshake"), std::string::npos)
      << response.status().ToString();
}

TEST_F(HttpsTest, ServerWithoutCaServesClientsWithoutCertificates) {
  HttpServerOptions options;
  options.tls = Server({Path("server.crt"), Path("server.key"), ""});
  TestServer server(options);
  ASSERT_TRUE(server.started());
  auto response =
      HttpGet(server.endpoint(), "/healthz", GetOptions("", Client({"", "", Path("ca.crt")})));
  ASSERT_TRUE(response.ok()) << response.status().ToString();
  EXPECT_EQ(response->status, 200);
}

TEST_F(HttpsTest, TokenStillRequiredOverTls) {
  HttpServerOptions options = MutualServer();
  options.token = "tls-token";
  TestServer server(options);
  ASSERT_TRUE(server.started());
  auto tls = Client({Path("client.crt"), Path("client.key"), Path("ca.crt")});
  auto missing = HttpGet(server.endpoint(), "/metrics", GetOptions("", tls));
  ASSERT_TRUE(missing.ok()) << missing.status().ToString();
  EXPECT_EQ(missing->status, 401);
  auto right = HttpGet(server.endpoint(), "/metrics", GetOptions("tls-token", tls));
  ASSERT_TRUE(right.ok()) << right.status().ToString();
  EXPECT_EQ(right->status, 200);
}

TEST_F(HttpsTest, PlainClientAgainstTlsServerFailsCleanly) {
  TestServer server(MutualServer());
  ASSERT_TRUE(server.started());
  ExpectUnavailable(
      HttpGet(server.endpoint(), "/healthz", GetOptions("", nullptr, milliseconds(3000))));
  // The failed handshake closed only that connection.
  auto tls = Client({Path("client.crt"), Path("client.key"), Path("ca.crt")});
  auto response = HttpGet(server.endpoint(), "/healthz", GetOptions("", tls));
  ASSERT_TRUE(response.ok()) << response.status().ToString();
}

TEST_F(HttpsTest, TlsClientAgainstPlainServerFailsCleanly) {
  TestServer server;
  ASSERT_TRUE(server.started());
  auto tls = Client({Path("client.crt"), Path("client.key"), Path("ca.crt")});
  ExpectUnavailable(HttpGet(server.endpoint(), "/healthz", GetOptions("", tls)));
}

TEST_F(HttpsTest, SilentTlsConnectionIsClosedAfterTheTimeout) {
  HttpServerOptions options = MutualServer();
  options.timeout = milliseconds(200);
  TestServer server(options);
  ASSERT_TRUE(server.started());
  EXPECT_LT(TimeUntilASilentClientIsClosed(server.port()), milliseconds(3000));
}

TEST_F(HttpsTest, StreamsOverTls) {
  TestServer server(MutualServer());
  ASSERT_TRUE(server.started());
  const HttpGetOptions options =
      GetOptions("", Client({Path("client.crt"), Path("client.key"), Path("ca.crt")}));
  ExpectChunksArriveWhileTheHandlerRuns(server, options);
  ExpectLeavingClientIsNoticed(server, options);
}

TEST_F(HttpsTest, StopWhileStreamingOverTls) {
  TestServer server(MutualServer());
  ASSERT_TRUE(server.started());
  auto waiting = std::make_shared<LeaveProbe>();
  AddLeaveRoutes(server, waiting, std::make_shared<LeaveProbe>());
  std::future<void> returned = waiting->returned.get_future();
  std::promise<void> first;
  auto client = std::async(std::launch::async, [&] {
    bool told = false;
    return HttpPostStream(
        server.endpoint(), "/v1/wait", "{}",
        GetOptions("", Client({Path("client.crt"), Path("client.key"), Path("ca.crt")})),
        [&](std::string_view) {
          if (!told) first.set_value();
          told = true;
          return true;
        });
  });
  ASSERT_EQ(first.get_future().wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_TRUE(server.StopAndWait(milliseconds(2000)));
  EXPECT_EQ(returned.wait_for(milliseconds(0)), std::future_status::ready);
  ASSERT_EQ(client.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_FALSE(client.get().ok());
}

TEST_F(HttpsTest, StopClosesTlsConnections) {
  TestServer server(MutualServer());
  ASSERT_TRUE(server.started());
  RawClient idle(server.port());
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_TRUE(server.StopAndWait(milliseconds(2000)));
}

}  // namespace
}  // namespace flywheel::transport
