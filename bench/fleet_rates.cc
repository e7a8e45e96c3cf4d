#include "bench/fleet_rates.h"

#include <openssl/evp.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <future>
#include <thread>

#include "bench/checkpoint_gen.h"
#include "bench/stats.h"
#include "checkpoint/hash.h"
#include "checkpoint/parallel.h"
#include "delta/delta.h"
#include "sync/version_log.h"
#include "transport/certs.h"
#include "transport/connection.h"
#include "transport/tls.h"

namespace flywheel::bench {
namespace {

using SteadyClock = std::chrono::steady_clock;

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

// CPU seconds of this process so far (every thread): a measurement made on one thread
// counts the core it used, not the time it waited for one on a busy machine.
double ProcessCpuSeconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return double(now.tv_sec) + now.tv_nsec / 1e9;
}

// ---- a generated FP8 pair ---------------------------------------------------------------

constexpr int64_t kTile = 128;        // model/fp8.h kFp8BlockSize
constexpr float kE4M3Max = 448.0f;
constexpr int kMinScaleExponent = -140;

// fp32 -> E4M3 with round to nearest even, saturating at 448 (model/fp8.cc's FloatToE4M3:
// that library links libtorch, this one stays torch-free).
uint8_t ToE4M3(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7F;
  if (magnitude >= 0x43E00000u) return sign | 0x7E;
  if (magnitude >= 0x3C800000u) {
    const uint32_t lsb = (magnitude >> 20) & 1;
    const uint32_t rounded = (magnitude + 0x7FFFFu + lsb) >> 20;
    return sign | static_cast<uint8_t>(rounded - ((127 - 7) << 3));
  }
  const uint32_t biased_exponent = magnitude >> 23;
  const uint32_t significand =
      biased_exponent == 0 ? magnitude : (magnitude & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 141 - std::max<uint32_t>(biased_exponent, 1);
  if (shift > 24) return sign;
  const uint32_t units = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t up = rest > half || (rest == half && (units & 1) != 0) ? 1 : 0;
  return sign | static_cast<uint8_t>(units + up);
}

// The power of two model/fp8.cc's Fp8ScaleForAmax picks: the smallest with amax <= 448 x it.
float ScaleForAmax(float amax) {
  if (!(amax > 0)) return 1.0f;
  int exponent = std::ilogb(amax) - 8;
  while (double(amax) > std::ldexp(448.0, exponent)) ++exponent;
  while (double(amax) <= std::ldexp(448.0, exponent - 1)) --exponent;
  return std::ldexp(1.0f, std::max(exponent, kMinScaleExponent));
}

// Quantizes the [rows, cols] matrix `w` in 128 x 128 tiles into `codes` and `scales`
// (row-major, ceil(rows/128) x ceil(cols/128)), one band of tile rows per task.
void Quantize(const float* w, int64_t rows, int64_t cols, int threads, uint8_t* codes,
              float* scales) {
  const int64_t bands = (rows + kTile - 1) / kTile, tile_cols = (cols + kTile - 1) / kTile;
  ParallelFor(static_cast<size_t>(bands), threads, [&](size_t band) {
    const int64_t r0 = int64_t(band) * kTile, r1 = std::min(rows, r0 + kTile);
    for (int64_t tc = 0; tc < tile_cols; ++tc) {
      const int64_t c0 = tc * kTile, c1 = std::min(cols, c0 + kTile);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      const float scale = ScaleForAmax(amax);
      scales[band * tile_cols + tc] = scale;
      const double inverse = std::ldexp(1.0, -std::ilogb(scale));
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          codes[r * cols + c] = ToE4M3(static_cast<float>(double(w[r * cols + c]) * inverse));
    }
  });
}

// fp32 masters of the whole layout (~N(0, 0.02): the sum of four uniforms; norms 1.0).
std::vector<float> Masters(const std::vector<TensorLayout>& tensors, uint64_t words, uint64_t seed,
                           int threads) {
  std::vector<float> master(words);
  const float scale = 0.02f * std::sqrt(3.0f) / 65536.0f;
  ParallelFor((words + kBlockWords - 1) / kBlockWords, threads, [&](size_t block) {
    uint64_t state = StreamState(seed, 0, block);
    const uint64_t end = std::min<uint64_t>(words, (block + 1) * kBlockWords);
    for (uint64_t i = block * kBlockWords; i < end; ++i) {
      const uint64_t b = SplitMix64(state);
      const float sum = float((b & 0xFFFF) + ((b >> 16) & 0xFFFF) + ((b >> 32) & 0xFFFF) + (b >> 48));
      master[i] = (sum + 2.0f - 2.0f * 65536.0f) * scale;
    }
  });
  for (const TensorLayout& t : tensors)
    if (t.is_norm) std::fill_n(master.begin() + t.word_offset, t.words, 1.0f);
  return master;
}

// The masters after one step of lr x s (|s| uniform in [0.5, 1.5), random sign).
std::vector<float> Stepped(const std::vector<float>& master, double lr, uint64_t seed, int threads) {
  std::vector<float> out(master.size());
  const float rate = static_cast<float>(lr);
  ParallelFor((master.size() + kBlockWords - 1) / kBlockWords, threads, [&](size_t block) {
    uint64_t state = StreamState(seed, 1, block);
    const uint64_t end = std::min<uint64_t>(master.size(), (block + 1) * kBlockWords);
    for (uint64_t i = block * kBlockWords; i < end; ++i) {
      const uint32_t bits = static_cast<uint32_t>(SplitMix64(state));
      const float size = 0.5f + float(bits & 0xFFFFFF) / 16777216.0f;
      out[i] = master[i] - rate * ((bits >> 31) != 0 ? -size : size);
    }
  });
  return out;
}

// The FP8 checkpoint of `w`: each matrix F8_E4M3 followed by its F32 `_scale_inv`, norms BF16.
OwnedCheckpoint Fp8Checkpoint(const std::vector<TensorLayout>& tensors, const std::vector<float>& w,
                              int threads) {
  OwnedCheckpoint out;
  for (const TensorLayout& t : tensors) {
    const float* data = w.data() + t.word_offset;
    if (t.is_norm || t.shape.size() != 2) {
      OwnedTensor tensor{t.name, DType::kBF16, t.shape, std::vector<std::byte>(t.words * 2)};
      for (uint64_t i = 0; i < t.words; ++i) {
        const uint16_t bf16 = FloatToBf16(data[i]);
        std::memcpy(tensor.data.data() + 2 * i, &bf16, 2);
      }
      out.tensors.push_back(std::move(tensor));
      continue;
    }
    const int64_t rows = t.shape[0], cols = t.shape[1];
    const std::vector<int64_t> scale_shape = {(rows + kTile - 1) / kTile, (cols + kTile - 1) / kTile};
    OwnedTensor codes{t.name, DType::kF8_E4M3, t.shape, std::vector<std::byte>(t.words)};
    OwnedTensor scales{t.name + "_scale_inv", DType::kF32, scale_shape,
                       std::vector<std::byte>(scale_shape[0] * scale_shape[1] * 4)};
    Quantize(data, rows, cols, threads, reinterpret_cast<uint8_t*>(codes.data.data()),
             reinterpret_cast<float*>(scales.data.data()));
    out.tensors.push_back(std::move(codes));
    out.tensors.push_back(std::move(scales));
  }
  return out;
}

// Share of the F8 words of `a` that differ in `b`.
double F8ChangedShare(const OwnedCheckpoint& a, const OwnedCheckpoint& b) {
  uint64_t words = 0, changed = 0;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    if (a.tensors[i].dtype != DType::kF8_E4M3) continue;
    const auto& x = a.tensors[i].data;
    const auto& y = b.tensors[i].data;
    words += x.size();
    for (size_t j = 0; j < x.size(); ++j) changed += x[j] != y[j];
  }
  return words == 0 ? 0 : double(changed) / words;
}

}  // namespace

Result<Fp8Pair> GenerateFp8Pair(uint64_t fp8_bytes, double changed_fraction, uint64_t seed,
                                int threads) {
  if (fp8_bytes < (1u << 20) || !(changed_fraction > 0 && changed_fraction < 0.5))
    return Status::InvalidArgument("fp8 pair: needs >= 1 MiB and a changed share in (0, 0.5)");
  const std::vector<TensorLayout> tensors = TransformerTensors(ShapeForBytes(fp8_bytes * 2));
  const uint64_t words = tensors.back().word_offset + tensors.back().words;
  const std::vector<float> master = Masters(tensors, words, seed, threads);
  Fp8Pair pair;
  pair.base = Fp8Checkpoint(tensors, master, threads);
  // The share changed grows about linearly with the step while it is small: a few rounds of
  // lr x (wanted / got) from a first guess land within 2% of the wanted share.
  double lr = 1e-4;
  for (int round = 0; round < 5; ++round) {
    pair.target = Fp8Checkpoint(tensors, Stepped(master, lr, seed, threads), threads);
    const double got = F8ChangedShare(pair.base, pair.target);
    if (round == 4 || !(got > 0)) break;
    if (std::fabs(got / changed_fraction - 1) < 0.02) break;
    lr *= std::clamp(changed_fraction / got, 0.1, 10.0);
  }
  pair.learning_rate = lr;
  return pair;
}

namespace {

class VectorSink : public delta::StreamSink {
 public:
  Status Begin(uint64_t size_bound) override {
    bytes_.clear();
    bytes_.reserve(size_bound);
    return Status::Ok();
  }
  Status Write(std::span<const std::byte> bytes) override {
    bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
    return Status::Ok();
  }
  std::vector<std::byte>& bytes() { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

Status SameAs(const MutableCheckpointView& state, const CheckpointView& target) {
  for (size_t i = 0; i < target.size(); ++i) {
    if (state[i].data.size() != target[i].data.size() ||
        std::memcmp(state[i].data.data(), target[i].data.data(), target[i].data.size()) != 0)
      return Status::Internal("fleet rates: the applied delta differs from the target in " +
                              target[i].name);
  }
  return Status::Ok();
}

}  // namespace

Result<CodecRates> MeasureCodecRates(const CheckpointView& base, const CheckpointView& target,
                                     int repeats) {
  CodecRates rates;
  std::vector<Hash128> base_hashes;
  for (const TensorView& t : base) {
    base_hashes.push_back(TensorHash(t));
    rates.bytes += t.data.size();
    rates.words += t.data.size() / std::max<size_t>(static_cast<size_t>(DTypeWordBytes(t.dtype)), 1);
  }
  const sync::VersionLogOptions log;  // the publisher's defaults
  delta::EncodeOptions encode;
  encode.base_version = 1;
  encode.target_version = 2;
  encode.compressor = log.compressor;
  encode.threads = 1;
  encode.base_tensor_hashes = base_hashes;
  VectorSink sink;
  std::vector<double> encode_seconds, apply_seconds, encode_wall, apply_wall;
  OwnedCheckpoint state;
  for (const TensorView& t : base)
    state.tensors.push_back({t.name, t.dtype, t.shape, std::vector<std::byte>(t.data.begin(), t.data.end())});
  for (int i = 0; i < std::max(repeats, 1); ++i) {
    const SteadyClock::time_point start = SteadyClock::now();
    const double cpu = ProcessCpuSeconds();
    FW_RETURN_IF_ERROR(delta::EncodeStreamed(base, target, encode, sink));
    encode_seconds.push_back(ProcessCpuSeconds() - cpu);
    encode_wall.push_back(SecondsSince(start));
  }
  FW_ASSIGN_OR_RETURN(const delta::DeltaView view, delta::DeltaView::Parse(sink.bytes()));
  rates.delta_bytes = sink.bytes().size();
  rates.changed_words = view.manifest().changed_words();
  delta::ApplyOptions apply;
  apply.threads = 1;
  apply.state_tensor_hashes = base_hashes;
  for (int i = 0; i < std::max(repeats, 1); ++i) {
    for (size_t t = 0; t < base.size(); ++t)
      std::memcpy(state.tensors[t].data.data(), base[t].data.data(), base[t].data.size());
    MutableCheckpointView mutable_state = state.mutable_view();
    const SteadyClock::time_point start = SteadyClock::now();
    const double cpu = ProcessCpuSeconds();
    FW_RETURN_IF_ERROR(delta::ApplyInPlace(mutable_state, view, apply).status());
    apply_seconds.push_back(ProcessCpuSeconds() - cpu);
    apply_wall.push_back(SecondsSince(start));
    FW_RETURN_IF_ERROR(SameAs(mutable_state, target));
  }
  rates.encode_seconds = Median(encode_seconds, 0);
  rates.apply_seconds = Median(apply_seconds, 0);
  rates.encode_wall_seconds = Median(encode_wall, 0);
  rates.apply_wall_seconds = Median(apply_wall, 0);
  if (rates.changed_words == 0) return Status::Internal("fleet rates: the pair has no change");
  return rates;
}


// ---- TLS: one stream, and one through a forwarder ----------------------------------------

namespace {

namespace tr = transport;
namespace asio = transport::asio;
using transport::awaitable;

double ThreadCpuSeconds(std::thread& thread) {
  clockid_t clock;
  timespec now{};
  if (pthread_getcpuclockid(thread.native_handle(), &clock) != 0 || clock_gettime(clock, &now) != 0)
    return std::nan("");
  return double(now.tv_sec) + now.tv_nsec / 1e9;
}

// What every side of one run shares; each field is touched on one io thread only, the
// promises are the hand-over to the measuring thread.
struct StreamShared {
  uint64_t total = 0;
  std::promise<Result<double>> received;  // wall seconds, first frame to last at the sink
  std::promise<Status> sent;
  bool received_set = false;
  std::vector<std::shared_ptr<tr::Connection>> source_side, relay_side, sink_side;
  tr::DialOptions sink_dial;  // the forwarder's dial to the sink
  std::string cipher;
};

awaitable<void> SinkLoop(std::shared_ptr<tr::Connection> connection, std::shared_ptr<StreamShared> s) {
  s->sink_side.push_back(connection);
  uint64_t got = 0;
  SteadyClock::time_point first{};
  while (got < s->total) {
    auto receiving = connection->Receive();
    Result<tr::Frame> frame = co_await std::move(receiving);
    if (!frame.ok()) {
      if (!s->received_set) s->received.set_value(frame.status());
      s->received_set = true;
      co_return;
    }
    if (got == 0) first = SteadyClock::now();
    got += frame->payload.size();
  }
  if (!s->received_set) s->received.set_value(SecondsSince(first));
  s->received_set = true;
}

awaitable<void> ForwardLoop(std::shared_ptr<tr::Connection> in, std::shared_ptr<StreamShared> s) {
  s->relay_side.push_back(in);
  wire::Hello hello;
  hello.set_role(wire::CLIENT);
  hello.set_channel(wire::DATA);
  auto dialing = tr::Dial(s->sink_dial, hello);
  Result<std::shared_ptr<tr::Connection>> out = co_await std::move(dialing);
  if (!out.ok()) {
    in->Close(out.status());
    co_return;
  }
  s->relay_side.push_back(*out);
  uint64_t forwarded = 0;
  while (forwarded < s->total) {
    auto receiving = in->Receive();
    Result<tr::Frame> frame = co_await std::move(receiving);
    if (!frame.ok()) co_return;
    forwarded += frame->payload.size();
    auto sending = (*out)->Send(std::move(*frame));
    const Status sent = co_await std::move(sending);
    if (!sent.ok()) co_return;
  }
}

awaitable<void> SourceLoop(tr::DialOptions dial, std::shared_ptr<std::vector<std::byte>> payload,
                           std::shared_ptr<StreamShared> s) {
  wire::Hello hello;
  hello.set_role(wire::CLIENT);
  hello.set_channel(wire::DATA);
  auto dialing = tr::Dial(dial, hello);
  Result<std::shared_ptr<tr::Connection>> connection = co_await std::move(dialing);
  if (!connection.ok()) {
    s->sent.set_value(connection.status());
    co_return;
  }
  s->source_side.push_back(*connection);
  s->cipher = (*connection)->tls_cipher();
  Status status = Status::Ok();
  for (uint64_t sent = 0; sent < s->total && status.ok(); sent += payload->size()) {
    wire::Header header;
    header.mutable_piece()->set_index(static_cast<uint32_t>(sent / payload->size()));
    tr::Frame frame = tr::MakeFrame(std::move(header), payload, std::span<const std::byte>(*payload));
    auto sending = (*connection)->Send(std::move(frame));
    status = co_await std::move(sending);
  }
  s->sent.set_value(status);
}

struct Tls {
  std::shared_ptr<asio::ssl::context> server, client;
};

Result<Tls> MakeTls() {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("flywheel-fleet-rates-" + std::to_string(getpid())))
                              .string();
  FW_RETURN_IF_ERROR(tr::WriteTestCertificates(dir, {}));
  Tls tls;
  auto server = tr::MakeServerTlsContext({dir + "/server.crt", dir + "/server.key", dir + "/ca.crt"});
  auto client = tr::MakeClientTlsContext({dir + "/client.crt", dir + "/client.key", dir + "/ca.crt"});
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  FW_ASSIGN_OR_RETURN(tls.server, std::move(server));
  FW_ASSIGN_OR_RETURN(tls.client, std::move(client));
  return tls;
}

struct StreamResult {
  double seconds = 0;
  double source_cpu = 0, relay_cpu = 0, sink_cpu = 0;
  std::string cipher;
};

void CloseAll(asio::io_context& io, std::vector<std::shared_ptr<tr::Connection>>* connections,
              tr::Listener* listener) {
  asio::post(io, [connections, listener] {
    if (listener != nullptr) listener->Stop();
    for (auto& c : *connections) c->Close(Status::Unavailable("fleet rates: done"));
  });
}

// `bytes` of 1 MiB frames over one TLS stream, source -> sink, or source -> forwarder ->
// sink; each role on its own io thread.
Result<StreamResult> RunStream(const Tls& tls, uint64_t bytes, bool forward) {
  constexpr uint64_t kFrame = 1 << 20;
  auto shared = std::make_shared<StreamShared>();
  shared->total = std::max<uint64_t>(bytes / kFrame, 1) * kFrame;
  asio::io_context source_io(1), relay_io(1), sink_io(1);
  tr::ListenerOptions listening;
  listening.tls = tls.server;
  FW_ASSIGN_OR_RETURN(auto sink, tr::Listener::Bind(sink_io.get_executor(),
                                                    tr::Endpoint{"127.0.0.1", 0}, listening));
  sink->Start([](const wire::Hello&) { return wire::Welcome(); },
              [shared](std::shared_ptr<tr::Connection> c) -> awaitable<void> {
                co_await SinkLoop(c, shared);
              });
  shared->sink_dial.endpoint = tr::Endpoint{"127.0.0.1", sink->port()};
  shared->sink_dial.tls = tls.client;
  std::unique_ptr<tr::Listener> relay;
  tr::DialOptions dial = shared->sink_dial;
  if (forward) {
    FW_ASSIGN_OR_RETURN(relay, tr::Listener::Bind(relay_io.get_executor(),
                                                  tr::Endpoint{"127.0.0.1", 0}, listening));
    relay->Start([](const wire::Hello&) { return wire::Welcome(); },
                 [shared](std::shared_ptr<tr::Connection> c) -> awaitable<void> {
                   co_await ForwardLoop(c, shared);
                 });
    dial.endpoint = tr::Endpoint{"127.0.0.1", relay->port()};
  }
  auto payload = std::make_shared<std::vector<std::byte>>(kFrame, std::byte{0x5a});
  auto received = shared->received.get_future();
  auto sent = shared->sent.get_future();
  asio::co_spawn(source_io, SourceLoop(dial, payload, shared), asio::detached);
  auto g1 = asio::make_work_guard(source_io), g2 = asio::make_work_guard(relay_io),
       g3 = asio::make_work_guard(sink_io);
  std::thread sink_thread([&] { sink_io.run(); }), relay_thread([&] { relay_io.run(); }),
      source_thread([&] { source_io.run(); });
  const double cpu0[3] = {ThreadCpuSeconds(source_thread), ThreadCpuSeconds(relay_thread),
                          ThreadCpuSeconds(sink_thread)};
  Result<double> seconds = Status::Unavailable("fleet rates: the stream did not finish");
  if (received.wait_for(std::chrono::minutes(5)) == std::future_status::ready) seconds = received.get();
  StreamResult result;
  result.source_cpu = ThreadCpuSeconds(source_thread) - cpu0[0];
  result.relay_cpu = ThreadCpuSeconds(relay_thread) - cpu0[1];
  result.sink_cpu = ThreadCpuSeconds(sink_thread) - cpu0[2];
  if (sent.wait_for(std::chrono::seconds(10)) == std::future_status::ready && seconds.ok()) {
    const Status status = sent.get();
    if (!status.ok()) seconds = status;
  }
  CloseAll(source_io, &shared->source_side, nullptr);
  CloseAll(relay_io, &shared->relay_side, relay.get());
  CloseAll(sink_io, &shared->sink_side, sink.get());
  g1.reset(), g2.reset(), g3.reset();
  source_io.stop(), relay_io.stop(), sink_io.stop();
  source_thread.join(), relay_thread.join(), sink_thread.join();
  FW_RETURN_IF_ERROR(seconds.status());
  result.seconds = *seconds;
  result.cipher = shared->cipher;
  return result;
}

// Bytes per CPU-second of sealing 16 KiB records with the AEAD `cipher` names, one thread.
double AeadPerCore(const std::string& cipher) {
  const EVP_CIPHER* aead = cipher.find("CHACHA") != std::string::npos ? EVP_chacha20_poly1305()
                           : cipher.find("128") != std::string::npos  ? EVP_aes_128_gcm()
                                                                      : EVP_aes_256_gcm();
  std::vector<unsigned char> in(16384, 0x5a), out(16384 + 32), key(32, 7), iv(12, 1), tag(16);
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  if (ctx == nullptr || EVP_EncryptInit_ex(ctx, aead, nullptr, key.data(), nullptr) != 1) {
    EVP_CIPHER_CTX_free(ctx);
    return std::nan("");
  }
  timespec t0{}, t1{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
  constexpr int kRecords = 16384;  // 256 MiB
  bool ok = true;
  for (int i = 0; i < kRecords && ok; ++i) {
    int length = 0;
    std::memcpy(iv.data(), &i, sizeof(i));
    ok = EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, iv.data()) == 1 &&
         EVP_EncryptUpdate(ctx, out.data(), &length, in.data(), int(in.size())) == 1 &&
         EVP_EncryptFinal_ex(ctx, out.data() + length, &length) == 1 &&
         EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, 16, tag.data()) == 1;
  }
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  EVP_CIPHER_CTX_free(ctx);
  const double seconds = double(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
  return ok ? double(kRecords) * in.size() / seconds : std::nan("");
}

}  // namespace

Result<TlsRates> MeasureTlsRates(uint64_t bytes) {
  FW_ASSIGN_OR_RETURN(const Tls tls, MakeTls());
  FW_ASSIGN_OR_RETURN(const StreamResult direct, RunStream(tls, bytes, false));
  FW_ASSIGN_OR_RETURN(const StreamResult forwarded, RunStream(tls, bytes, true));
  TlsRates rates;
  rates.cipher = direct.cipher;
  rates.bytes = std::max<uint64_t>(bytes >> 20, 1) << 20;
  const double b = double(rates.bytes);
  rates.stream_bytes_per_second = b / direct.seconds;
  rates.send_per_core = b / direct.source_cpu;
  rates.receive_per_core = b / direct.sink_cpu;
  rates.forward_per_core = b / forwarded.relay_cpu;
  rates.forward_bytes_per_second = b / forwarded.seconds;
  rates.aes_gcm_per_core = AeadPerCore(rates.cipher);
  return rates;
}

MeasuredRates IsolatedRates::Projection() const {
  MeasuredRates rates;
  rates.encode_words_per_second = fp8.encode_words_per_second();
  rates.apply_words_per_second = fp8.apply_words_per_second();
  rates.tls_send_bytes_per_second = tls.send_per_core;
  rates.tls_receive_bytes_per_second = tls.receive_per_core;
  rates.relay_forward_bytes_per_second = tls.forward_per_core;
  rates.bits_per_changed_word = fp8.bits_per_changed_word();
  return rates;
}

std::vector<std::string> IsolatedRates::Lines() const {
  auto gbs = [](double v) { return Fixed(v / 1e9, 3) + " GB/s"; };
  return {
      "FP8 pair: " + Fixed(fp8.bytes / 1e6, 0) + " MB, " + Fixed(fp8.changed_fraction() * 100, 2) +
          "% of words changed (step lr " + Fixed(fp8_learning_rate * 1e6, 2) + "e-6), delta " +
          Fixed(fp8.delta_bytes / 1e6, 2) + " MB = " + Fixed(fp8.bits_per_changed_word(), 2) +
          " bits per changed word",
      "encode (hash + EncodeStreamed, 1 thread, alone): " + gbs(fp8.encode_words_per_second()) +
          " of FP8 words per CPU-second (median " + Fixed(fp8.encode_seconds, 3) + " CPU s, " +
          Fixed(fp8.encode_wall_seconds, 3) + " s wall)",
      "apply (ApplyInPlace + verify, 1 thread, alone): " + gbs(fp8.apply_words_per_second()) +
          " per CPU-second (median " + Fixed(fp8.apply_seconds, 3) + " CPU s, " +
          Fixed(fp8.apply_wall_seconds, 3) + " s wall), rebuilt the target bit for bit",
      "TLS one stream (" + tls.cipher + ", " + Fixed(tls.bytes / 1e9, 2) + " GB, 1 MiB frames): " +
          gbs(tls.stream_bytes_per_second) + " wall; per core: seal+send " + gbs(tls.send_per_core) +
          ", receive+open " + gbs(tls.receive_per_core),
      "AEAD one-core ceiling (16 KiB records, the same cipher): " + gbs(tls.aes_gcm_per_core) +
          "; TLS seal+send per core / it = " + Fixed(tls.send_per_core / tls.aes_gcm_per_core, 3),
      "relay forward (receive + re-send through a forwarder thread): " +
          gbs(tls.forward_per_core) + " per core, " + gbs(tls.forward_bytes_per_second) + " wall",
  };
}

Result<IsolatedRates> MeasureIsolatedRates(const IsolatedRatesOptions& options) {
  IsolatedRates rates;
  {
    FW_ASSIGN_OR_RETURN(Fp8Pair pair, GenerateFp8Pair(options.fp8_bytes, options.changed_fraction,
                                                      options.seed, options.threads));
    rates.fp8_learning_rate = pair.learning_rate;
    FW_ASSIGN_OR_RETURN(rates.fp8,
                        MeasureCodecRates(pair.base.view(), pair.target.view(), options.repeats));
  }
  FW_ASSIGN_OR_RETURN(rates.tls, MeasureTlsRates(options.tls_bytes));
  return rates;
}

}  // namespace flywheel::bench
