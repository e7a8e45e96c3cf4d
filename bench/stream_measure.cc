#include "bench/stream_measure.h"

#include <unistd.h>

#include <filesystem>
#include <future>
#include <thread>

#include "transport/certs.h"
#include "transport/connection.h"
#include "transport/tls.h"

namespace flywheel::transport {

namespace {

awaitable<Status> SendAll(std::shared_ptr<Connection> connection,
                          std::shared_ptr<std::vector<std::byte>> payload, uint64_t frames) {
  for (uint64_t i = 0; i < frames; ++i) {
    wire::Header header;
    wire::Piece* piece = header.mutable_piece();
    piece->set_index(static_cast<uint32_t>(i));
    Frame frame = MakeFrame(std::move(header), payload, std::span<const std::byte>(*payload));
    Status sent = co_await connection->Send(std::move(frame));
    if (!sent.ok()) co_return sent;
  }
  co_return Status::Ok();
}

awaitable<void> ReceiveAll(std::shared_ptr<Connection> connection, uint64_t bytes,
                           std::shared_ptr<std::promise<Result<double>>> done) {
  uint64_t received = 0;
  Clock::time_point start{};
  while (received < bytes) {
    Result<Frame> frame = co_await connection->Receive();
    if (!frame.ok()) {
      done->set_value(frame.status());
      co_return;
    }
    if (received == 0) start = Clock::now();
    received += frame->payload.size();
  }
  // Close only after the sender saw everything go out (it waits for this promise).
  done->set_value(std::chrono::duration<double>(Clock::now() - start).count());
}

}  // namespace

Result<StreamBenchResult> MeasureLoopbackStream(const StreamBenchOptions& options) {
  if (options.frame_bytes == 0 || options.bytes < options.frame_bytes) {
    return Status::InvalidArgument("stream bench needs bytes >= frame_bytes > 0");
  }
  std::shared_ptr<asio::ssl::context> server_tls, client_tls;
  std::string cert_dir;
  if (options.tls) {
    cert_dir = (std::filesystem::temp_directory_path() /
                ("flywheel-stream-bench-" + std::to_string(getpid())))
                   .string();
    FW_RETURN_IF_ERROR(WriteTestCertificates(cert_dir, {}));
    FW_ASSIGN_OR_RETURN(server_tls, MakeServerTlsContext({cert_dir + "/server.crt",
                                                          cert_dir + "/server.key",
                                                          cert_dir + "/ca.crt"}));
    FW_ASSIGN_OR_RETURN(client_tls, MakeClientTlsContext({cert_dir + "/client.crt",
                                                          cert_dir + "/client.key",
                                                          cert_dir + "/ca.crt"}));
    std::error_code ec;
    std::filesystem::remove_all(cert_dir, ec);  // the contexts hold what they need
  }
  const uint64_t frames = options.bytes / options.frame_bytes;
  const uint64_t total = frames * options.frame_bytes;

  asio::io_context server_io(1), client_io(1);
  ListenerOptions listener_options;
  listener_options.tls = server_tls;
  FW_ASSIGN_OR_RETURN(auto listener,
                      Listener::Bind(server_io.get_executor(), Endpoint{"127.0.0.1", 0},
                                     listener_options));
  auto received = std::make_shared<std::promise<Result<double>>>();
  auto received_future = received->get_future();
  std::shared_ptr<Connection> server_side;
  listener->Start([](const wire::Hello&) { return wire::Welcome(); },
                  [&, received](std::shared_ptr<Connection> connection) -> awaitable<void> {
                    server_side = connection;
                    co_await ReceiveAll(connection, total, received);
                  });
  auto server_guard = asio::make_work_guard(server_io);
  std::thread server_thread([&] { server_io.run(); });

  DialOptions dial;
  dial.endpoint = Endpoint{"127.0.0.1", listener->port()};
  dial.tls = client_tls;
  auto payload = std::make_shared<std::vector<std::byte>>(options.frame_bytes, std::byte{0x5a});
  std::promise<Result<uint64_t>> sent;
  auto sent_future = sent.get_future();
  std::shared_ptr<Connection> client_side;
  asio::co_spawn(
      client_io,
      [&]() -> awaitable<void> {
        wire::Hello hello;
        hello.set_role(wire::CLIENT);
        hello.set_channel(wire::DATA);
        auto connection = co_await Dial(dial, hello);
        if (!connection.ok()) {
          sent.set_value(connection.status());
          co_return;
        }
        client_side = *connection;
        Status status = co_await SendAll(client_side, payload, frames);
        if (!status.ok()) {
          sent.set_value(status);
          co_return;
        }
        sent.set_value(client_side->bytes_out());
      },
      asio::detached);
  auto client_guard = asio::make_work_guard(client_io);
  std::thread client_thread([&] { client_io.run(); });

  Result<uint64_t> queued = sent_future.get();
  Result<double> seconds = queued.ok() ? received_future.get() : Result<double>(queued.status());
  asio::post(client_io, [&] {
    if (client_side) client_side->Close(Status::Unavailable("bench done"));
  });
  asio::post(server_io, [&] {
    listener->Stop();
    if (server_side) server_side->Close(Status::Unavailable("bench done"));
  });
  client_guard.reset();
  server_guard.reset();
  client_io.stop();
  server_io.stop();
  client_thread.join();
  server_thread.join();
  if (!seconds.ok()) return seconds.status();
  StreamBenchResult result;
  result.seconds = *seconds;
  result.bytes_per_second = static_cast<double>(total) / std::max(result.seconds, 1e-9);
  result.wire_bytes = queued.ok() ? *queued : 0;
  return result;
}

}  // namespace flywheel::transport
