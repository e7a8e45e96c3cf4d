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

// What the receiving side shares across its connections (all on its one thread).
struct Receipt {
  uint64_t per_stream = 0;
  int open = 0;  // streams still receiving
  Clock::time_point first{};
  bool started = false, done = false;
  std::promise<Result<double>> seconds;
  std::vector<std::shared_ptr<Connection>> connections;
};

awaitable<void> ReceiveAll(std::shared_ptr<Connection> connection, std::shared_ptr<Receipt> receipt) {
  uint64_t received = 0;
  while (received < receipt->per_stream) {
    Result<Frame> frame = co_await connection->Receive();
    if (!frame.ok()) {
      if (!receipt->done) receipt->seconds.set_value(frame.status());
      receipt->done = true;
      co_return;
    }
    if (!receipt->started) receipt->first = Clock::now();
    receipt->started = true;
    received += frame->payload.size();
  }
  // Close only after the senders saw everything go out (they wait for this promise).
  if (--receipt->open == 0 && !receipt->done) {
    receipt->done = true;
    receipt->seconds.set_value(std::chrono::duration<double>(Clock::now() - receipt->first).count());
  }
}

// The dialling side: its streams, what they queued, and the first error.
struct Sent {
  std::vector<std::shared_ptr<Connection>> connections;
  int open = 0;
  uint64_t wire_bytes = 0;
  Status status = Status::Ok();
  std::string cipher;
  std::promise<void> done;
};

// One stream: dial, send `frames` frames of `payload`, record what went out.
awaitable<void> SendStream(DialOptions dial, std::shared_ptr<std::vector<std::byte>> payload,
                           uint64_t frames, std::shared_ptr<Sent> sent) {
  wire::Hello hello;
  hello.set_role(wire::CLIENT);
  hello.set_channel(wire::DATA);
  auto connection = co_await Dial(dial, hello);
  Status status = connection.status();
  if (connection.ok()) {
    sent->connections.push_back(*connection);
    sent->cipher = (*connection)->tls_cipher();
    status = co_await SendAll(*connection, payload, frames);
    sent->wire_bytes += (*connection)->bytes_out();
  }
  if (!status.ok() && sent->status.ok()) sent->status = status;
  if (--sent->open == 0) sent->done.set_value();
}

// Server and client TLS contexts from fresh test certificates (removed again: the contexts
// hold what they need).
Status MakeBenchTls(std::shared_ptr<asio::ssl::context>& server_tls,
                    std::shared_ptr<asio::ssl::context>& client_tls) {
  const std::string cert_dir = (std::filesystem::temp_directory_path() /
                                ("flywheel-stream-bench-" + std::to_string(getpid())))
                                   .string();
  FW_RETURN_IF_ERROR(WriteTestCertificates(cert_dir, {}));
  FW_ASSIGN_OR_RETURN(
      server_tls, MakeServerTlsContext(
                      {cert_dir + "/server.crt", cert_dir + "/server.key", cert_dir + "/ca.crt"}));
  FW_ASSIGN_OR_RETURN(
      client_tls, MakeClientTlsContext(
                      {cert_dir + "/client.crt", cert_dir + "/client.key", cert_dir + "/ca.crt"}));
  std::error_code ec;
  std::filesystem::remove_all(cert_dir, ec);
  return Status::Ok();
}

}  // namespace

Result<StreamBenchResult> MeasureLoopbackStream(const StreamBenchOptions& options) {
  if (options.frame_bytes == 0 || options.bytes < options.frame_bytes) {
    return Status::InvalidArgument("stream bench needs bytes >= frame_bytes > 0");
  }
  std::shared_ptr<asio::ssl::context> server_tls, client_tls;
  if (options.tls) FW_RETURN_IF_ERROR(MakeBenchTls(server_tls, client_tls));
  const int streams = std::max(options.streams, 1);
  const uint64_t frames = std::max<uint64_t>(options.bytes / options.frame_bytes / streams, 1);
  const uint64_t total = frames * options.frame_bytes * streams;

  asio::io_context server_io(1), client_io(1);
  ListenerOptions listener_options;
  listener_options.tls = server_tls;
  FW_ASSIGN_OR_RETURN(auto listener,
                      Listener::Bind(server_io.get_executor(), Endpoint{"127.0.0.1", 0},
                                     listener_options));
  auto receipt = std::make_shared<Receipt>();
  receipt->per_stream = frames * options.frame_bytes;
  receipt->open = streams;
  auto received_future = receipt->seconds.get_future();
  listener->Start([](const wire::Hello&) { return wire::Welcome(); },
                  [receipt](std::shared_ptr<Connection> connection) -> awaitable<void> {
                    receipt->connections.push_back(connection);
                    co_await ReceiveAll(connection, receipt);
                  });
  auto server_guard = asio::make_work_guard(server_io);
  std::thread server_thread([&] { server_io.run(); });

  DialOptions dial;
  dial.endpoint = Endpoint{"127.0.0.1", listener->port()};
  dial.tls = client_tls;
  auto payload = std::make_shared<std::vector<std::byte>>(options.frame_bytes, std::byte{0x5a});
  auto sent = std::make_shared<Sent>();
  sent->open = streams;
  auto sent_future = sent->done.get_future();
  for (int i = 0; i < streams; ++i) {
    asio::co_spawn(client_io, SendStream(dial, payload, frames, sent), asio::detached);
  }
  auto client_guard = asio::make_work_guard(client_io);
  std::thread client_thread([&] { client_io.run(); });

  sent_future.wait();
  Result<double> seconds = sent->status.ok() ? received_future.get() : Result<double>(sent->status);
  asio::post(client_io, [sent] {
    for (auto& connection : sent->connections) connection->Close(Status::Unavailable("bench done"));
  });
  asio::post(server_io, [&listener, receipt] {
    listener->Stop();
    for (auto& connection : receipt->connections)
      connection->Close(Status::Unavailable("bench done"));
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
  result.wire_bytes = sent->wire_bytes;
  result.cipher = sent->cipher;
  return result;
}

}  // namespace flywheel::transport
