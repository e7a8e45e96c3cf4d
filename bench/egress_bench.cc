#include "bench/egress_bench.h"

#include <openssl/evp.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <future>
#include <latch>
#include <random>
#include <thread>

#include "kernels/kernels.h"
#include "sync/link_registry.h"
#include "sync/server.h"
#include "transport/certs.h"
#include "transport/connection.h"
#include "transport/io_pool.h"
#include "transport/tls.h"

namespace flywheel::bench {

namespace {

namespace asio = transport::asio;
using transport::awaitable;
using transport::Clock;
using transport::Connection;
using transport::Frame;

// The cached artifact: random bytes and each piece's XXH3.
struct SourceBytes {
  std::shared_ptr<std::vector<std::byte>> bytes;
  uint64_t piece_bytes = 0;
  std::vector<uint64_t> piece_hashes;
  uint32_t pieces() const { return static_cast<uint32_t>(piece_hashes.size()); }
};

SourceBytes MakeSource(uint64_t size, uint64_t piece_bytes) {
  SourceBytes source;
  source.piece_bytes = piece_bytes;
  const uint64_t pieces = std::max<uint64_t>(size / piece_bytes, 1);
  source.bytes = std::make_shared<std::vector<std::byte>>(pieces * piece_bytes);
  std::mt19937_64 random(33);
  auto* words = reinterpret_cast<uint64_t*>(source.bytes->data());
  for (size_t i = 0; i < source.bytes->size() / 8; ++i) words[i] = random();
  source.piece_hashes.resize(pieces);
  kernels::ChunkChecksums(source.bytes->data(), source.bytes->size(), piece_bytes,
                          source.piece_hashes.data());
  return source;
}

// What the relay serves: piece i of the source, from memory (a relay's piece cache).
class MemorySource : public sync::PieceSource {
 public:
  explicit MemorySource(const SourceBytes* source) : source_(source) {}
  awaitable<Result<Piece>> GetPiece(const sync::ArtifactKey&, uint32_t index) override {
    if (index >= source_->pieces()) co_return Status::NotFound("no piece " + std::to_string(index));
    Piece piece{source_->bytes, std::span<const std::byte>(source_->bytes->data() +
                                                               index * source_->piece_bytes,
                                                           source_->piece_bytes)};
    co_return piece;
  }

 private:
  const SourceBytes* source_;
};

// One child: its connection (on a strand of the children's pool) and what it received.
struct Child {
  asio::any_io_executor strand;
  std::shared_ptr<Connection> connection;
  uint64_t pieces_to_fetch = 0;
  uint64_t bytes = 0;
  Status status = Status::Ok();
  std::latch* done = nullptr;
};

awaitable<void> DialChild(std::shared_ptr<Child> child, std::shared_ptr<transport::DialOptions> dial,
                          int number) {
  wire::Hello hello;
  hello.set_role(wire::WORKER);
  hello.set_channel(wire::DATA);
  hello.set_node_id("egress-child-" + std::to_string(number));
  Result<std::shared_ptr<Connection>> connection = co_await transport::Dial(*dial, hello);
  if (connection.ok()) {
    child->connection = *connection;
  } else {
    child->status = connection.status();
  }
  child->done->count_down();
}

awaitable<Status> RequestPiece(std::shared_ptr<Connection> connection, uint32_t index) {
  wire::Header header;
  wire::PieceRequest* request = header.mutable_piece_request();
  request->set_kind(wire::DELTA);
  request->set_target_version(1);
  request->set_index(index);
  co_return co_await connection->Send(transport::MakeFrame(std::move(header)));
}

// Keeps `window` requests in flight; checks each piece against the source's XXH3.
awaitable<void> RunChild(std::shared_ptr<Child> child, const SourceBytes* source, int window) {
  const std::shared_ptr<Connection>& connection = child->connection;
  uint64_t requested = 0, received = 0;
  Status status = Status::Ok();
  while (status.ok() && requested < child->pieces_to_fetch &&
         requested < static_cast<uint64_t>(window)) {
    status = co_await RequestPiece(connection, static_cast<uint32_t>(requested++ % source->pieces()));
  }
  while (status.ok() && received < child->pieces_to_fetch) {
    Result<Frame> frame = co_await connection->Receive();
    if (!frame.ok()) {
      status = frame.status();
      break;
    }
    const uint32_t expected = static_cast<uint32_t>(received % source->pieces());
    uint64_t hash = 0;
    kernels::ChunkChecksums(frame->payload.data(), frame->payload.size(),
                            std::max<size_t>(frame->payload.size(), 1), &hash);
    if (!frame->header.has_piece() || frame->header.piece().index() != expected ||
        frame->payload.size() != source->piece_bytes || hash != source->piece_hashes[expected]) {
      status = Status::Corruption("child " + connection->peer() + ": piece " +
                                  std::to_string(expected) + " arrived wrong (" +
                                  transport::FrameKindName(frame->header) + " frame)");
      break;
    }
    child->bytes += frame->payload.size();
    ++received;
    if (requested < child->pieces_to_fetch) {
      status = co_await RequestPiece(connection, static_cast<uint32_t>(requested++ % source->pieces()));
    }
  }
  child->status = status;
  child->done->count_down();
}

// The relay's network loop and egress pool and the children's pool are IoPools
// (transport/io_pool.h): each pool's threads' CPU seconds on demand.
double TotalCpuSeconds(transport::IoPool& pool) {
  double total = 0;
  for (double seconds : pool.CpuSeconds()) total += seconds;
  return total;
}

Status MakeTls(std::shared_ptr<asio::ssl::context>& server_tls,
               std::shared_ptr<asio::ssl::context>& client_tls) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("flywheel-egress-bench-" + std::to_string(getpid())))
                              .string();
  FW_RETURN_IF_ERROR(transport::WriteTestCertificates(dir, {}));
  FW_ASSIGN_OR_RETURN(server_tls, transport::MakeServerTlsContext(
                                      {dir + "/server.crt", dir + "/server.key", dir + "/ca.crt"}));
  FW_ASSIGN_OR_RETURN(client_tls, transport::MakeClientTlsContext(
                                      {dir + "/client.crt", dir + "/client.key", dir + "/ca.crt"}));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return Status::Ok();
}

// The relay side of one run: its network thread, its egress pool, the server.
struct RelaySide {
  RelaySide(int egress_threads) : network(1, "relay-net"), pool(egress_threads, "relay-egress") {}
  transport::IoPool network;
  transport::IoPool pool;
  sync::LinkRegistry links;
  std::unique_ptr<sync::Server> server;
  double CpuSeconds() { return TotalCpuSeconds(network) + TotalCpuSeconds(pool); }
};

Status StartRelay(RelaySide& relay, MemorySource* source,
                  std::shared_ptr<asio::ssl::context> tls, bool gather_writes) {
  sync::ServerOptions options;
  options.listen = transport::Endpoint{"127.0.0.1", 0};
  options.identity = sync::NodeIdentity{wire::RELAY, "bench", "egress-relay"};
  options.listener.tls = std::move(tls);
  options.listener.egress = relay.pool.executor();
  options.listener.connection.gather_writes = gather_writes;
  std::promise<Result<std::unique_ptr<sync::Server>>> started;
  asio::post(relay.network.context(), [&] {
    started.set_value(sync::Server::Start(relay.network.executor(), options, source,
                                          &relay.links));
  });
  FW_ASSIGN_OR_RETURN(relay.server, started.get_future().get());
  return Status::Ok();
}

// Stops accepting and closes the relay's connections (on its network thread), then gives
// the closes a moment to reach the pool; the server itself goes once no thread runs.
void StopRelay(RelaySide& relay) {
  std::promise<void> stopped;
  asio::post(relay.network.context(), [&] {
    if (relay.server) relay.server->Stop();
    stopped.set_value();
  });
  stopped.get_future().wait();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

// Dials every child (phase 1, not timed); the first failure, if any.
Status DialChildren(std::vector<std::shared_ptr<Child>>& children, transport::IoPool& pool,
                    std::shared_ptr<transport::DialOptions> dial) {
  std::latch dialled(static_cast<std::ptrdiff_t>(children.size()));
  for (size_t i = 0; i < children.size(); ++i) {
    children[i]->strand = asio::make_strand(pool.executor());
    children[i]->done = &dialled;
    asio::co_spawn(children[i]->strand, DialChild(children[i], dial, static_cast<int>(i)),
                   asio::detached);
  }
  dialled.wait();
  for (auto& child : children) FW_RETURN_IF_ERROR(child->status);
  return Status::Ok();
}

void CloseChildren(std::vector<std::shared_ptr<Child>>& children) {
  for (auto& child : children) {
    if (child->connection) child->connection->Close(Status::Unavailable("bench done"));
  }
}

}  // namespace

Result<EgressRun> MeasureRelayEgress(const EgressOptions& options, int children_count,
                                     int egress_threads, bool tls, bool gather_writes) {
  if (children_count < 1 || egress_threads < 1 || options.piece_bytes == 0 ||
      options.window < 1) {
    return Status::InvalidArgument("egress bench: children, threads, piece bytes, window >= 1");
  }
  const SourceBytes source = MakeSource(options.source_bytes, options.piece_bytes);
  MemorySource memory(&source);
  std::shared_ptr<asio::ssl::context> server_tls, client_tls;
  if (tls) FW_RETURN_IF_ERROR(MakeTls(server_tls, client_tls));
  RelaySide relay(egress_threads);
  FW_RETURN_IF_ERROR(StartRelay(relay, &memory, server_tls, gather_writes));
  transport::IoPool child_pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())),
                               "children");
  auto dial = std::make_shared<transport::DialOptions>();
  dial->endpoint = transport::Endpoint{"127.0.0.1", relay.server->port()};
  dial->tls = client_tls;
  std::vector<std::shared_ptr<Child>> children;
  const uint64_t pieces = std::max<uint64_t>(options.bytes / options.piece_bytes, 1);
  for (int i = 0; i < children_count; ++i) {
    children.push_back(std::make_shared<Child>());
    children.back()->pieces_to_fetch =
        std::max<uint64_t>(pieces / static_cast<uint64_t>(children_count), 1);
  }
  Status status = DialChildren(children, child_pool, dial);
  EgressRun run{.tls = tls, .gather_writes = gather_writes, .children = children_count,
                .egress_threads = egress_threads};
  if (status.ok()) {
    run.cipher = children[0]->connection->tls_cipher();
    std::latch done(children_count);
    const double cpu_before = relay.CpuSeconds();
    const Clock::time_point start = Clock::now();
    for (auto& child : children) {
      child->done = &done;
      asio::co_spawn(child->strand, RunChild(child, &source, options.window), asio::detached);
    }
    done.wait();
    run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    run.relay_cpu_seconds = relay.CpuSeconds() - cpu_before;
    for (auto& child : children) {
      if (status.ok()) status = child->status;
      run.bytes += child->bytes;
    }
  }
  CloseChildren(children);
  StopRelay(relay);
  child_pool.Stop();
  relay.pool.Stop();
  relay.network.Stop();
  for (transport::IoPool* pool : {&child_pool, &relay.pool, &relay.network}) pool->Shutdown();
  relay.server.reset();
  FW_RETURN_IF_ERROR(status);
  run.bytes_per_second = static_cast<double>(run.bytes) / std::max(run.seconds, 1e-9);
  run.relay_cores = run.relay_cpu_seconds / std::max(run.seconds, 1e-9);
  run.per_core_bytes_per_second =
      static_cast<double>(run.bytes) / std::max(run.relay_cpu_seconds, 1e-9);
  return run;
}

namespace {

// The AEAD of a TLS 1.3 suite name, and its display name.
const EVP_CIPHER* AeadOf(const std::string& suite, std::string* name) {
  if (suite.find("CHACHA20") != std::string::npos) {
    *name = "ChaCha20-Poly1305";
    return EVP_chacha20_poly1305();
  }
  if (suite.find("AES_128_GCM") != std::string::npos) {
    *name = "AES-128-GCM";
    return EVP_aes_128_gcm();
  }
  *name = "AES-256-GCM";
  return EVP_aes_256_gcm();
}

// One core sealing (or opening) 16 KiB records as TLS 1.3 does: a fresh nonce and 5 bytes
// of additional data per record, a 16-byte tag. Plaintext bytes per second.
Result<double> AeadRate(const EVP_CIPHER* cipher, bool seal, double seconds) {
  constexpr size_t kRecord = 16384;
  std::vector<unsigned char> key(32, 7), iv(12, 9), aad(5, 23), in(kRecord, 0x5a), out(kRecord + 32);
  unsigned char tag[16];
  std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)> ctx(EVP_CIPHER_CTX_new(),
                                                                         EVP_CIPHER_CTX_free);
  int n = 0;
  // The record to open: sealed once, so that every open checks a valid tag.
  std::vector<unsigned char> sealed(kRecord);
  if (EVP_EncryptInit_ex(ctx.get(), cipher, nullptr, key.data(), iv.data()) != 1 ||
      EVP_EncryptUpdate(ctx.get(), nullptr, &n, aad.data(), 5) != 1 ||
      EVP_EncryptUpdate(ctx.get(), sealed.data(), &n, in.data(), kRecord) != 1 ||
      EVP_EncryptFinal_ex(ctx.get(), out.data(), &n) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_AEAD_GET_TAG, 16, tag) != 1) {
    return Status::Internal("EVP seal failed");
  }
  const std::vector<unsigned char> sealed_iv = iv;
  if (!seal && EVP_DecryptInit_ex(ctx.get(), cipher, nullptr, key.data(), iv.data()) != 1) {
    return Status::Internal("EVP open init failed");
  }
  uint64_t records = 0;
  const Clock::time_point start = Clock::now();
  double elapsed = 0;
  while (elapsed < seconds) {
    for (int i = 0; i < 64; ++i, ++records) {
      bool ok;
      if (seal) {
        iv[11] = static_cast<unsigned char>(records);
        ok = EVP_EncryptInit_ex(ctx.get(), nullptr, nullptr, nullptr, iv.data()) == 1 &&
             EVP_EncryptUpdate(ctx.get(), nullptr, &n, aad.data(), 5) == 1 &&
             EVP_EncryptUpdate(ctx.get(), out.data(), &n, in.data(), kRecord) == 1 &&
             EVP_EncryptFinal_ex(ctx.get(), out.data() + n, &n) == 1 &&
             EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_AEAD_GET_TAG, 16, out.data() + kRecord) == 1;
      } else {
        ok = EVP_DecryptInit_ex(ctx.get(), nullptr, nullptr, nullptr, sealed_iv.data()) == 1 &&
             EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_AEAD_SET_TAG, 16, tag) == 1 &&
             EVP_DecryptUpdate(ctx.get(), nullptr, &n, aad.data(), 5) == 1 &&
             EVP_DecryptUpdate(ctx.get(), out.data(), &n, sealed.data(), kRecord) == 1 &&
             EVP_DecryptFinal_ex(ctx.get(), out.data() + n, &n) == 1;
      }
      if (!ok) return Status::Internal(seal ? "EVP seal failed" : "EVP open failed the tag");
    }
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  }
  if (!seal && !std::equal(in.begin(), in.end(), out.begin())) {
    return Status::Internal("EVP open did not give the sealed plaintext back");
  }
  return static_cast<double>(records * kRecord) / elapsed;
}

// `openssl speed -evp <aead> -bytes 16384 -seconds 1`: bytes per second, 0 when the binary
// is absent or its output is not understood.
double OpensslSpeed(const std::string& aead) {
  std::string name = aead == "ChaCha20-Poly1305" ? "chacha20-poly1305"
                                                  : (aead == "AES-128-GCM" ? "aes-128-gcm" : "aes-256-gcm");
  if (::access("/usr/bin/openssl", X_OK) != 0 && ::access("/usr/local/bin/openssl", X_OK) != 0) {
    return 0;
  }
  const std::string command = "openssl speed -evp " + name + " -bytes 16384 -seconds 1 2>/dev/null";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return 0;
  char line[512];
  std::string last;
  while (std::fgets(line, sizeof line, pipe) != nullptr) {
    if (std::string(line).find_first_not_of(" \n") != std::string::npos) last = line;
  }
  ::pclose(pipe);
  // "AES-256-GCM    4567890.12k": thousands of bytes per second.
  const size_t k = last.rfind('k');
  if (k == std::string::npos) return 0;
  const size_t begin = last.find_last_of(" \t", k);
  if (begin == std::string::npos) return 0;
  return std::strtod(last.substr(begin + 1, k - begin - 1).c_str(), nullptr) * 1000.0;
}

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

}  // namespace

Result<EgressRates> MeasureEgress(const EgressOptions& options) {
  EgressRates rates;
  rates.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = options.egress_threads > 0 ? options.egress_threads : rates.cores;
  FW_ASSIGN_OR_RETURN(rates.one_child, MeasureRelayEgress(options, 1, threads, true, true));
  FW_ASSIGN_OR_RETURN(rates.many_children,
                      MeasureRelayEgress(options, options.children, threads, true, true));
  FW_ASSIGN_OR_RETURN(rates.many_children_one_thread,
                      MeasureRelayEgress(options, options.children, 1, true, true));
  rates.fanout_ratio = Ratio(rates.many_children.bytes_per_second, rates.one_child.bytes_per_second);
  rates.pool_ratio = Ratio(rates.many_children.bytes_per_second,
                           rates.many_children_one_thread.bytes_per_second);
  const EVP_CIPHER* cipher = AeadOf(rates.one_child.cipher, &rates.aead);
  FW_ASSIGN_OR_RETURN(rates.seal_bytes_per_second, AeadRate(cipher, true, options.cipher_seconds));
  FW_ASSIGN_OR_RETURN(rates.open_bytes_per_second, AeadRate(cipher, false, options.cipher_seconds));
  if (options.openssl_speed) rates.openssl_speed_bytes_per_second = OpensslSpeed(rates.aead);
  rates.stream_vs_ceiling =
      Ratio(rates.one_child.bytes_per_second,
            std::min(rates.seal_bytes_per_second, rates.open_bytes_per_second));
  if (options.plain) {
    FW_ASSIGN_OR_RETURN(rates.plain_gather, MeasureRelayEgress(options, 1, threads, false, true));
    FW_ASSIGN_OR_RETURN(rates.plain_copy, MeasureRelayEgress(options, 1, threads, false, false));
    rates.gather_ratio =
        Ratio(rates.plain_gather.bytes_per_second, rates.plain_copy.bytes_per_second);
  }
  return rates;
}

namespace {

nlohmann::json RunJson(const EgressRun& run) {
  return {{"tls", run.tls},
          {"gather_writes", run.gather_writes},
          {"children", run.children},
          {"egress_threads", run.egress_threads},
          {"bytes", run.bytes},
          {"seconds", run.seconds},
          {"bytes_per_second", run.bytes_per_second},
          {"relay_cpu_seconds", run.relay_cpu_seconds},
          {"relay_cores", run.relay_cores},
          {"per_core_bytes_per_second", run.per_core_bytes_per_second},
          {"cipher", run.cipher}};
}

std::string Gbps(double bytes_per_second) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GB/s", bytes_per_second / 1e9);
  return text;
}

std::string RunRow(const std::string& label, const EgressRun& run) {
  char text[256];
  std::snprintf(text, sizeof text, "| %s | %d | %d | %s | %.2f | %s |\n", label.c_str(),
                run.children, run.egress_threads, Gbps(run.bytes_per_second).c_str(),
                run.relay_cores, Gbps(run.per_core_bytes_per_second).c_str());
  return text;
}

std::string Verdict(double value, double target) {
  char text[64];
  std::snprintf(text, sizeof text, "%.2fx (target >= %.2fx: %s)", value, target,
                value >= target ? "met" : "NOT met");
  return text;
}

}  // namespace

nlohmann::json EgressJson(const EgressRates& rates) {
  return {{"cores", rates.cores},
          {"one_child", RunJson(rates.one_child)},
          {"many_children", RunJson(rates.many_children)},
          {"many_children_one_thread", RunJson(rates.many_children_one_thread)},
          {"fanout_ratio", rates.fanout_ratio},
          {"pool_ratio", rates.pool_ratio},
          {"aead", rates.aead},
          {"seal_bytes_per_second", rates.seal_bytes_per_second},
          {"open_bytes_per_second", rates.open_bytes_per_second},
          {"openssl_speed_bytes_per_second", rates.openssl_speed_bytes_per_second},
          {"stream_vs_ceiling", rates.stream_vs_ceiling},
          {"plain_gather", RunJson(rates.plain_gather)},
          {"plain_copy", RunJson(rates.plain_copy)},
          {"gather_ratio", rates.gather_ratio},
          {"tls_seal_send_per_core_bytes_per_second", rates.one_child.per_core_bytes_per_second}};
}

std::string EgressReport(const EgressRates& rates) {
  std::string out = "relay egress on loopback, " + std::to_string(rates.cores) +
                    " cores, every piece checked (XXH3) at every child; cipher " +
                    rates.one_child.cipher + "\n\n";
  out += "| run | children | egress threads | total egress | relay cores used | per relay core |\n";
  out += "|---|---|---|---|---|---|\n";
  out += RunRow("TLS, 1 child", rates.one_child);
  out += RunRow("TLS, fan-out", rates.many_children);
  out += RunRow("TLS, fan-out, one thread (peer)", rates.many_children_one_thread);
  if (rates.plain_gather.bytes > 0) {
    out += RunRow("plain, gather sendmsg", rates.plain_gather);
    out += RunRow("plain, copy then write (peer)", rates.plain_copy);
  }
  out += "\nfan-out / 1 child: " + Verdict(rates.fanout_ratio, 1.8) + "\n";
  out += "fan-out, pool / one thread: " + Verdict(rates.pool_ratio, 1.0) + "\n";
  out += rates.aead + " one core, 16 KiB records: seal " + Gbps(rates.seal_bytes_per_second) +
         ", open " + Gbps(rates.open_bytes_per_second);
  if (rates.openssl_speed_bytes_per_second > 0) {
    out += ", `openssl speed -evp` " + Gbps(rates.openssl_speed_bytes_per_second);
  }
  out += "\none TLS stream / min(seal, open): " + Verdict(rates.stream_vs_ceiling, 0.9) + "\n";
  if (rates.plain_gather.bytes > 0) {
    out += "plain gather / copy: " + Verdict(rates.gather_ratio, 1.0) + "\n";
  }
  out += "TLS seal + send per relay core (projection input): " +
         Gbps(rates.one_child.per_core_bytes_per_second) + " (1 child), " +
         Gbps(rates.many_children.per_core_bytes_per_second) + " (fan-out)\n";
  return out;
}

}  // namespace flywheel::bench
