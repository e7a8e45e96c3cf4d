#include "bench/join_bench.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <vector>

#include "base/env.h"
#include "bench/checkpoint_gen.h"
#include "bench/util.h"
#include "checkpoint/hash.h"
#include "delta/delta.h"
#include "ops/process.h"
#include "sync/publisher.h"
#include "sync/relay.h"
#include "sync/worker.h"

namespace flywheel::bench {
namespace {

using namespace std::chrono_literals;
namespace asio = transport::asio;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// An io_context on a thread of its own, stopped and joined on the way out.
class IoThread {
 public:
  IoThread() : work_(asio::make_work_guard(io_)), thread_([this] { io_.run(); }) {}
  ~IoThread() { Stop(); }
  // Lets the work posted drain for a moment, then stops the thread (the roles on it go
  // after this, as in `flywheel worker`).
  void Stop() {
    if (!thread_.joinable()) return;
    work_.reset();
    (void)ops::WaitUntil([&] { return io_.stopped(); }, 200ms, "the io_context to drain");
    io_.stop();
    thread_.join();
  }
  asio::any_io_executor executor() { return io_.get_executor(); }
  // Runs `fn` on the thread and waits for it.
  template <typename Fn>
  auto Run(Fn fn) {
    std::packaged_task<decltype(fn())()> task(std::move(fn));
    auto result = task.get_future();
    asio::post(io_, [&task] { task(); });
    return result.get();
  }

 private:
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
};

sync::CommonOptions Common(const std::string& region, const std::string& node, int threads) {
  sync::CommonOptions common;
  common.region = region;
  common.node_id = node;
  common.http = {"127.0.0.1", 0};
  common.threads = threads;
  return common;
}

// The publisher and the relay, on one network thread.
struct Upstreams {
  IoThread io;
  std::unique_ptr<sync::Publisher> publisher;
  std::unique_ptr<sync::Relay> relay;
  ~Upstreams() {
    if (relay) relay->Stop();
    if (publisher) publisher->Stop();
    io.Stop();
    relay.reset();
    publisher.reset();
  }
};

Status StartUpstreams(const JoinBenchOptions& options, const std::string& dir, Upstreams& up) {
  sync::PublisherOptions publisher;
  publisher.common = Common("home", "join-publisher", options.threads);
  publisher.listen = {"127.0.0.1", 0};
  publisher.log.dir = dir + "/publisher";
  publisher.log.keyframe_every = 1000;  // one keyframe, then the chain
  publisher.log.keyframe_cost = 0;
  publisher.log.threads = options.threads;
  FW_ASSIGN_OR_RETURN(up.publisher, up.io.Run([&] {
    return sync::Publisher::Start(up.io.executor(), publisher);
  }));
  sync::RelayOptions relay;
  relay.common = Common("home", "join-relay", 1);
  relay.listen = {"127.0.0.1", 0};
  relay.upstreams = {{"127.0.0.1", up.publisher->port()}};
  FW_ASSIGN_OR_RETURN(up.relay, up.io.Run([&] { return sync::Relay::Start(up.io.executor(), relay); }));
  return Status::Ok();
}

// The published versions: the keyframe and the chain after it, and the head's hash.
struct Published {
  std::vector<sync::ArtifactInfo> artifacts;
  uint64_t head = 0;
  Hash128 head_hash;
};

Result<Published> PublishSequence(const JoinBenchOptions& options, sync::Publisher& publisher) {
  GeneratorOptions generator;
  generator.checkpoint_bytes = options.model_bytes;
  generator.adamw.learning_rate = options.learning_rate;
  generator.seed = options.seed;
  generator.threads = options.threads;
  Published published;
  Status generated = GenerateCheckpointSequence(
      generator, 1 + options.chain, [&](int step, const CheckpointView& view) -> Status {
        FW_ASSIGN_OR_RETURN(std::vector<sync::ArtifactInfo> written,
                            publisher.Publish(static_cast<uint64_t>(step), view));
        for (sync::ArtifactInfo& info : written) published.artifacts.push_back(std::move(info));
        FW_ASSIGN_OR_RETURN(published.head_hash, CheckpointHash(view, options.threads));
        published.head = static_cast<uint64_t>(step);
        return Status::Ok();
      });
  FW_RETURN_IF_ERROR(generated);
  if (published.artifacts.empty() || published.artifacts[0].kind != sync::ArtifactKind::kKeyframe) {
    return Status::Internal("join bench: the first version was not published as a keyframe");
  }
  return published;
}

// A worker joining through the relay: seconds from its start until it serves the head.
Result<double> Join(const JoinBenchOptions& options, uint16_t relay_port, const Published& head,
                    double link_rate, bool stage_keyframes, const std::string& name) {
  IoThread io;
  sync::WorkerOptions worker_options;
  worker_options.common = Common("home", name, options.threads);
  worker_options.common.wan_rate = link_rate;  // shapes the worker's upstream links
  worker_options.upstreams = {{"127.0.0.1", relay_port}};
  worker_options.stage_keyframes = stage_keyframes;
  const auto start = Clock::now();
  FW_ASSIGN_OR_RETURN(std::unique_ptr<sync::Worker> worker, io.Run([&] {
    return sync::Worker::Start(io.executor(), worker_options);
  }));
  Status served = ops::WaitUntil([&] { return worker->version() >= head.head; },
                                 std::chrono::milliseconds(600'000), name + " serving the head", 2ms);
  const double seconds = SecondsSince(start);
  const Hash128 hash = worker->weights_hash();
  const uint64_t version = worker->version();
  worker->Stop();
  io.Stop();
  worker.reset();
  if (!served.ok()) return served;
  if (version != head.head || hash != head.head_hash) {
    return Status::Mismatch(name + " serves v" + std::to_string(version) + " hashing to " +
                            hash.ToHex() + ", the head is v" + std::to_string(head.head) + " " +
                            head.head_hash.ToHex());
  }
  return seconds;
}

// The keyframe decoded whole and the chain applied in place, timed apart.
Status MeasureDecodeAndChain(const JoinBenchOptions& options, const Published& published,
                             JoinBenchResult& result) {
  FW_ASSIGN_OR_RETURN(std::vector<std::byte> keyframe_bytes,
                      Env::Default()->ReadFile(published.artifacts[0].path));
  FW_ASSIGN_OR_RETURN(delta::DeltaView keyframe, delta::DeltaView::Parse(keyframe_bytes));
  auto start = Clock::now();
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint state, delta::DecodeKeyframe(keyframe, options.threads));
  result.keyframe_decode_seconds = SecondsSince(start);
  result.keyframe_bytes = keyframe_bytes.size();
  keyframe_bytes = {};
  MutableCheckpointView view = state.mutable_view();
  for (size_t i = 1; i < published.artifacts.size(); ++i) {
    FW_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, Env::Default()->ReadFile(published.artifacts[i].path));
    FW_ASSIGN_OR_RETURN(delta::DeltaView delta, delta::DeltaView::Parse(bytes));
    delta::ApplyOptions apply;
    apply.threads = options.threads;
    start = Clock::now();
    FW_RETURN_IF_ERROR(delta::ApplyInPlace(view, delta, apply).status());
    result.chain_apply_seconds += SecondsSince(start);
    result.chain_bytes += bytes.size();
  }
  FW_ASSIGN_OR_RETURN(Hash128 hash, CheckpointHash(state.view(), options.threads));
  if (hash != published.head_hash) {
    return Status::Mismatch("join bench: keyframe and chain rebuild " + hash.ToHex() +
                            ", the head is " + published.head_hash.ToHex());
  }
  return Status::Ok();
}

void Print(const JoinBenchResult& r, std::ostream& out) {
  Table table;
  table.header = {"term", "value"};
  auto mb = [](uint64_t bytes) { return Fixed(static_cast<double>(bytes) / 1e6, 1) + " MB"; };
  table.rows = {
      {"model (bf16)", mb(r.model_bytes)},
      {"keyframe", mb(r.keyframe_bytes)},
      {"chain (deltas)", mb(r.chain_bytes)},
      {"link", Fixed(r.link_bytes_per_second * 8 / 1e9, 2) + " Gbit/s"},
      {"keyframe / link", Fixed(r.transfer_seconds, 2) + " s"},
      {"keyframe decode, whole (measured apart)", Fixed(r.keyframe_decode_seconds, 2) + " s"},
      {"chain apply (measured apart)", Fixed(r.chain_apply_seconds, 2) + " s"},
      {"target: 1.3 x keyframe/link + chain apply", Fixed(r.target_seconds(), 2) + " s"},
      {"join, keyframe staged as it arrives", Fixed(r.streamed_seconds, 2) + " s"},
      {"join, keyframe decoded once whole (peer)", Fixed(r.buffered_seconds, 2) + " s"},
      {"sequential estimate (transfer + decode + chain)", Fixed(r.sequential_seconds(), 2) + " s"},
      {"streamed join / target", Fixed(r.ratio(), 3) + " " + PassFail(r.pass())},
      {"peer join / streamed join", Fixed(r.buffered_seconds / r.streamed_seconds, 2) + " x"},
  };
  out << RenderText(table);
}

}  // namespace

Result<JoinBenchResult> RunJoinBench(const JoinBenchOptions& options, std::ostream& out) {
  if (options.chain < 0 || options.threads < 1 || options.link_bytes_per_second <= 0) {
    return Status::InvalidArgument("join bench: --chain >= 0, --threads >= 1 and a positive link rate");
  }
  ScopedWorkDir work;
  FW_RETURN_IF_ERROR(work.Prepare("", "flywheel-join", false));
  JoinBenchResult result;
  result.model_bytes = options.model_bytes;
  result.link_bytes_per_second = options.link_bytes_per_second;
  Upstreams up;
  FW_RETURN_IF_ERROR(StartUpstreams(options, work.path(), up));
  FW_ASSIGN_OR_RETURN(Published published, PublishSequence(options, *up.publisher));
  FW_RETURN_IF_ERROR(MeasureDecodeAndChain(options, published, result));
  result.transfer_seconds = static_cast<double>(result.keyframe_bytes) / options.link_bytes_per_second;
  const uint16_t relay = up.relay->port();
  // Unshaped: the relay fetches and caches every artifact, so both joins read its cache.
  FW_RETURN_IF_ERROR(Join(options, relay, published, 0, true, "join-warmup").status());
  FW_ASSIGN_OR_RETURN(result.buffered_seconds,
                      Join(options, relay, published, options.link_bytes_per_second, false, "join-buffered"));
  FW_ASSIGN_OR_RETURN(result.streamed_seconds,
                      Join(options, relay, published, options.link_bytes_per_second, true, "join-streamed"));
  Print(result, out);
  if (!options.json_out.empty()) {
    nlohmann::ordered_json json = {
        {"model_bytes", result.model_bytes},       {"keyframe_bytes", result.keyframe_bytes},
        {"chain_bytes", result.chain_bytes},       {"link_bytes_per_second", result.link_bytes_per_second},
        {"transfer_seconds", result.transfer_seconds},
        {"keyframe_decode_seconds", result.keyframe_decode_seconds},
        {"chain_apply_seconds", result.chain_apply_seconds},
        {"target_seconds", result.target_seconds()}, {"streamed_seconds", result.streamed_seconds},
        {"buffered_seconds", result.buffered_seconds},
        {"sequential_seconds", result.sequential_seconds()}, {"ratio", result.ratio()},
        {"pass", result.pass()}};
    const std::string text = json.dump(2) + "\n";
    FW_RETURN_IF_ERROR(WriteFileAtomically(options.json_out, std::as_bytes(std::span(text)), Env::Default()));
  }
  if (options.check && !result.pass()) {
    return Status::Mismatch("join bench: the streamed join took " + Fixed(result.streamed_seconds, 2) +
                            " s, over its target of " + Fixed(result.target_seconds(), 2) + " s");
  }
  return result;
}

}  // namespace flywheel::bench
