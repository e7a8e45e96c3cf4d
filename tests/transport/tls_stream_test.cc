// transport::TlsStream, the batched TLS 1.3 stream under every TLS data connection: both
// directions at once with key updates in the middle, server-name verification, and a peer
// that closes in the middle of a read.
#include "transport/tls_stream.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "tests/transport/cert_suite.h"
#include "transport/tls.h"

namespace flywheel::transport {
namespace {

class TlsStreamTest : public CertificateSuite {
 protected:
  // A connected server/client socket pair on `io`.
  std::pair<tcp::socket, tcp::socket> Pair() {
    tcp::acceptor acceptor(io_, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    tcp::socket client(io_);
    client.connect(acceptor.local_endpoint());
    tcp::socket server = acceptor.accept();
    return {std::move(server), std::move(client)};
  }
  std::shared_ptr<asio::ssl::context> ServerContext(const std::string& dir = "") {
    const std::string base = dir.empty() ? *dir_ : dir;
    auto context = MakeServerTlsContext({base + "/server.crt", base + "/server.key", ""});
    EXPECT_TRUE(context.ok()) << context.status().ToString();
    return context.ok() ? *context : nullptr;
  }
  std::shared_ptr<asio::ssl::context> ClientContext(const std::string& ca) {
    auto context = MakeClientTlsContext({"", "", ca});
    EXPECT_TRUE(context.ok()) << context.status().ToString();
    return context.ok() ? *context : nullptr;
  }
  // Runs the io_context until both coroutines finish (or 60 s pass).
  void RunBoth(awaitable<void> a, awaitable<void> b) {
    int done = 0;
    asio::co_spawn(io_, std::move(a), [&](std::exception_ptr) { ++done; });
    asio::co_spawn(io_, std::move(b), [&](std::exception_ptr) { ++done; });
    io_.run_for(std::chrono::seconds(60));
    io_.restart();
    ASSERT_EQ(done, 2) << "the exchange did not finish";
  }

  asio::io_context io_{1};
};

std::vector<unsigned char> Pattern(size_t bytes, uint32_t seed) {
  std::vector<unsigned char> data(bytes);
  uint32_t x = seed;
  for (unsigned char& byte : data) {
    x = x * 1664525u + 1013904223u;
    byte = static_cast<unsigned char>(x >> 24);
  }
  return data;
}

// Each side writes 24 MiB and reads the other's 24 MiB at the same time (a read and a write
// pending on one stream, as a connection's loops have them); the client asks for a key
// update between writes, so the server's read path must send its own KeyUpdate while the
// server's write path is busy with its batches.
TEST_F(TlsStreamTest, BothDirectionsAtOnceWithKeyUpdates) {
  auto [server_socket, client_socket] = Pair();
  auto server_context = ServerContext();
  auto client_context = ClientContext(Path("ca.crt"));
  auto server = std::make_shared<TlsStream>(std::move(server_socket), *server_context);
  auto client = std::make_shared<TlsStream>(std::move(client_socket), *client_context);
  ASSERT_TRUE(client->SetServerName("127.0.0.1"));

  constexpr size_t kBytes = 24u << 20, kWrite = 1u << 20;
  const std::vector<unsigned char> from_client = Pattern(kBytes, 1), from_server = Pattern(kBytes, 2);
  std::vector<unsigned char> at_server(kBytes), at_client(kBytes);
  error_code server_read_ec, server_write_ec, client_read_ec, client_write_ec, handshake[2];
  int key_updates = 0;

  auto side = [&](std::shared_ptr<TlsStream> stream, bool is_server, const std::vector<unsigned char>& out,
                  std::vector<unsigned char>& in, error_code& read_ec, error_code& write_ec,
                  error_code& handshake_ec) -> awaitable<void> {
    co_await stream->Handshake(is_server, handshake_ec);
    if (handshake_ec) co_return;
    auto reader = [&, stream]() -> awaitable<void> {
      for (size_t at = 0; at < in.size() && !read_ec; at += kWrite) {
        co_await stream->Read(asio::buffer(in.data() + at, kWrite), read_ec);
      }
    };
    auto executor = co_await asio::this_coro::executor;
    bool read_done = false;
    asio::co_spawn(executor, reader(), [&](std::exception_ptr) { read_done = true; });
    for (size_t at = 0; at < out.size() && !write_ec; at += kWrite) {
      if (!is_server && at % (6u << 20) == 0 && at > 0) {
        EXPECT_EQ(SSL_key_update(stream->native_handle(), SSL_KEY_UPDATE_REQUESTED), 1);
        ++key_updates;
      }
      co_await stream->Write(asio::buffer(out.data() + at, kWrite), write_ec);
    }
    asio::steady_timer poll(executor);
    while (!read_done) {
      poll.expires_after(std::chrono::milliseconds(1));
      error_code ignored;
      co_await poll.async_wait(asio::redirect_error(use_awaitable, ignored));
    }
  };
  RunBoth(side(server, true, from_server, at_server, server_read_ec, server_write_ec, handshake[0]),
          side(client, false, from_client, at_client, client_read_ec, client_write_ec, handshake[1]));
  ASSERT_FALSE(handshake[0]) << handshake[0].message();
  ASSERT_FALSE(handshake[1]) << handshake[1].message();
  EXPECT_FALSE(server_read_ec) << server_read_ec.message();
  EXPECT_FALSE(server_write_ec) << server_write_ec.message();
  EXPECT_FALSE(client_read_ec) << client_read_ec.message();
  EXPECT_FALSE(client_write_ec) << client_write_ec.message();
  EXPECT_EQ(key_updates, 3);
  EXPECT_TRUE(at_server == from_client) << "the server read other bytes than the client wrote";
  EXPECT_TRUE(at_client == from_server) << "the client read other bytes than the server wrote";
  EXPECT_STREQ(SSL_get_cipher_name(client->native_handle()),
               HasAesHardware() ? "TLS_AES_128_GCM_SHA256" : "TLS_CHACHA20_POLY1305_SHA256");
}

// The client checks the server's certificate against the name it dialled: an address or a
// DNS name the certificate does not carry fails the handshake; the name it carries passes.
TEST_F(TlsStreamTest, VerifiesTheServerName) {
  std::string other = Path("other-host");
  ASSERT_TRUE(WriteTestCertificates(other, {{"node-a.example"}, 30}).ok());
  auto server_context = ServerContext(other);
  auto client_context = ClientContext(other + "/ca.crt");
  for (const std::string name : {"127.0.0.1", "node-b.example", "node-a.example"}) {
    auto [server_socket, client_socket] = Pair();
    TlsStream server(std::move(server_socket), *server_context);
    TlsStream client(std::move(client_socket), *client_context);
    ASSERT_TRUE(client.SetServerName(name));
    error_code server_ec, client_ec;
    RunBoth(server.Handshake(true, server_ec), client.Handshake(false, client_ec));
    if (name == "node-a.example") {
      EXPECT_FALSE(client_ec) << client_ec.message();
      EXPECT_FALSE(server_ec) << server_ec.message();
    } else {
      EXPECT_TRUE(client_ec) << "a certificate for node-a.example was accepted for " << name;
      EXPECT_NE(client_ec.message().find("certificate verify failed"), std::string::npos)
          << client_ec.message();
      EXPECT_TRUE(server_ec) << "the server saw no alert for " << name;
    }
  }
}

// A peer that closes in the middle of a read: the read ends with an error and says how
// much arrived; the bytes that did arrive are the peer's.
TEST_F(TlsStreamTest, PeerClosingMidReadIsAnError) {
  auto [server_socket, client_socket] = Pair();
  auto server_context = ServerContext();
  auto client_context = ClientContext(Path("ca.crt"));
  TlsStream server(std::move(server_socket), *server_context);
  TlsStream client(std::move(client_socket), *client_context);
  ASSERT_TRUE(client.SetServerName("localhost"));
  const std::vector<unsigned char> sent = Pattern(300u << 10, 3);
  std::vector<unsigned char> received(1u << 20);
  error_code server_ec, client_ec, read_ec, write_ec;
  size_t got = 0;
  auto serve = [&]() -> awaitable<void> {
    co_await server.Handshake(true, server_ec);
    if (!server_ec) got = co_await server.Read(asio::buffer(received), read_ec);
  };
  auto dial = [&]() -> awaitable<void> {
    co_await client.Handshake(false, client_ec);
    if (client_ec) co_return;
    co_await client.Write(asio::buffer(sent), write_ec);
    error_code ignored;
    client.next_layer().shutdown(tcp::socket::shutdown_both, ignored);
    client.next_layer().close(ignored);
  };
  RunBoth(serve(), dial());
  ASSERT_FALSE(server_ec) << server_ec.message();
  ASSERT_FALSE(client_ec) << client_ec.message();
  ASSERT_FALSE(write_ec) << write_ec.message();
  EXPECT_TRUE(read_ec) << "a read of 1 MiB from a peer that sent 300 KiB succeeded";
  ASSERT_EQ(got, sent.size());
  EXPECT_TRUE(std::equal(sent.begin(), sent.end(), received.begin()));
}

}  // namespace
}  // namespace flywheel::transport
