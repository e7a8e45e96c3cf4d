#include "bench/fleet_bench.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "bench/checkpoint_gen.h"
#include "bench/fleet_projection.h"
#include "bench/fleet_rates.h"
#include "bench/peers.h"
#include "bench/stats.h"
#include "bench/stream_bench.h"
#include "bench/util.h"
#include "checkpoint/hash.h"
#include "checkpoint/parallel.h"
#include "checkpoint/safetensors.h"
#include "delta/delta_file.h"
#include "ops/process.h"
#include "sync/signing.h"
#include "transport/endpoint.h"
#include "transport/http.h"

namespace flywheel::bench {
namespace {

namespace fs = std::filesystem;
using ops::FileTail;
using ops::ProcessGroup;
using ops::ReadWholeFile;
using Json = nlohmann::ordered_json;
using SteadyClock = std::chrono::steady_clock;
constexpr double kNotMeasured = std::numeric_limits<double>::quiet_NaN();
constexpr const char* kHomeRegion = "home";
// How often the workers' status is polled while an update propagates.
constexpr std::chrono::milliseconds kPollInterval{10};
// How long a role may take to bind its ports and write its ready file.
constexpr std::chrono::seconds kReadyTimeout{30};
// The targets the run checks and prints PASS/FAIL for.
constexpr double kTargetSlack = 1.3;             // x (delta bytes / WAN rate + RTT)
constexpr double kTargetOverheadSeconds = 0.5;   // + this
constexpr double kWanFractionTarget = 1.0 / 50;  // delta-relay WAN bytes vs full-direct
constexpr double kSignedSlack = 1.02;             // delta-relay-signed vs delta-relay (issue 17)

// ---- small helpers -------------------------------------------------------------------

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

std::string Megabytes(double bytes) {
  return Fixed(bytes / 1e6, bytes < 1e7 ? 3 : 1);
}

std::string Gigabytes(double bytes) {
  return Fixed(bytes / 1e9, 2) + " GB";
}

// 1e-06 -> "1e-6".
std::string NumberText(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  std::string out = text;
  for (const char* padded : {"e-0", "e+0"}) {
    if (const size_t at = out.find(padded); at != std::string::npos) out.erase(at + 2, 1);
  }
  return out;
}

// MemAvailable from /proc/meminfo in bytes, or nullopt where there is none.
std::optional<uint64_t> MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

double LoadAverage() {
  double load = kNotMeasured;
  if (std::FILE* file = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(file, "%lf", &load) != 1) load = kNotMeasured;
    std::fclose(file);
  }
  return load;
}

// ---- the checkpoint sequence -----------------------------------------------------------


// Consecutive bf16 checkpoints of one simulated training run, one version at a time. The
// only state kept between versions are the fp32 masters (4 bytes per parameter), so a
// 1 GB bf16 checkpoint costs 2 GB here, not the 6 GB of checkpoint_gen's full AdamW.
//
// Version 1 holds the initial weights: ~N(0, 0.02) (the sum of four uniforms, scaled:
// bounded at 3.5 sigma, which changes nothing that matters here), norm weights 1.0. Each
// later version is one step: every master moves by lr x s, with a random sign and |s|
// uniform in [0.5, 1.5). That is the shape of early Adam steps, whose update
// m_hat / sqrt(v_hat) is exactly sign(g) at step 1 and stays about 1 in size for a while;
// weight decay (lr x 0.01 x w) is far smaller and left out. As in checkpoint_gen, most
// steps stay below one bf16 ulp, so at lr 1e-6 about 1-3% of the bf16 words change.
class CheckpointSequence {
 public:
  CheckpointSequence(uint64_t checkpoint_bytes, double learning_rate, uint64_t seed, int threads)
      : shape_(ShapeForBytes(checkpoint_bytes)),
        tensors_(TransformerTensors(shape_)),
        words_(tensors_.back().word_offset + tensors_.back().words),
        learning_rate_(static_cast<float>(learning_rate)),
        seed_(seed),
        threads_(threads),
        master_(new float[words_]) {}

  const TransformerShape& shape() const { return shape_; }
  const std::vector<TensorLayout>& tensors() const { return tensors_; }
  uint64_t words() const { return words_; }

  // Writes the next version's bf16 words into `out` (resized to words()) and returns how
  // many of them differ from the previous version (all of them for version 1).
  uint64_t Next(std::vector<uint16_t>& out) {
    out.resize(words_);
    const uint64_t step = step_++;
    if (step == 0) {
      Initialise(out);
      return words_;
    }
    return Step(step, out);
  }

  CheckpointView ViewOf(const std::vector<uint16_t>& words) const { return Bf16View(tensors_, words); }

 private:
  template <typename Fn>
  void ForEachBlock(uint64_t step, const Fn& fn) {
    const uint64_t blocks = (words_ + kBlockWords - 1) / kBlockWords;
    ParallelFor(blocks, threads_, [&](uint64_t block) {
      uint64_t state = StreamState(seed_, step, block);
      const uint64_t begin = block * kBlockWords;
      fn(begin, std::min(begin + kBlockWords, words_), state);
    });
  }

  void Initialise(std::vector<uint16_t>& out) {
    // Four 16-bit uniforms per draw; their sum has mean 2 and variance 1/3.
    const float scale = 0.02f * std::sqrt(3.0f) / 65536.0f;
    ForEachBlock(0, [&](uint64_t begin, uint64_t end, uint64_t& state) {
      for (uint64_t i = begin; i < end; ++i) {
        const uint64_t bits = SplitMix64(state);
        const float sum = static_cast<float>((bits & 0xFFFF) + ((bits >> 16) & 0xFFFF) +
                                             ((bits >> 32) & 0xFFFF) + (bits >> 48)) +
                          2.0f;  // the four +0.5 centring terms
        master_[i] = (sum - 2.0f * 65536.0f) * scale;
      }
    });
    for (const TensorLayout& tensor : tensors_) {
      if (tensor.is_norm) std::fill_n(master_.get() + tensor.word_offset, tensor.words, 1.0f);
    }
    ForEachBlock(0, [&](uint64_t begin, uint64_t end, uint64_t&) {
      for (uint64_t i = begin; i < end; ++i) out[i] = FloatToBf16(master_[i]);
    });
  }

  uint64_t Step(uint64_t step, std::vector<uint16_t>& out) {
    std::atomic<uint64_t> changed{0};
    ForEachBlock(step, [&](uint64_t begin, uint64_t end, uint64_t& state) {
      uint64_t block_changed = 0;
      // One 64-bit draw per two parameters: 32 random bits each.
      for (uint64_t i = begin; i < end; i += 2) {
        const uint64_t bits = SplitMix64(state);
        block_changed += StepOne(i, static_cast<uint32_t>(bits), out);
        if (i + 1 < end) block_changed += StepOne(i + 1, static_cast<uint32_t>(bits >> 32), out);
      }
      changed += block_changed;
    });
    return changed.load();
  }

  // Moves master i by lr x s (bit 31 of `bits`: the sign of s, bits 0..23: |s| - 0.5);
  // returns whether its bf16 word changed.
  bool StepOne(uint64_t i, uint32_t bits, std::vector<uint16_t>& out) {
    constexpr float kUnit = 1.0f / 16777216.0f;  // 2^-24
    const float size = 0.5f + static_cast<float>(bits & 0xFFFFFF) * kUnit;
    const float update = (bits >> 31) != 0 ? -size : size;
    const uint16_t before = FloatToBf16(master_[i]);
    master_[i] -= learning_rate_ * update;
    out[i] = FloatToBf16(master_[i]);
    return out[i] != before;
  }

  TransformerShape shape_;
  std::vector<TensorLayout> tensors_;
  uint64_t words_;
  float learning_rate_;
  uint64_t seed_;
  int threads_;
  uint64_t step_ = 0;
  // Left uninitialised by the allocation; Initialise() writes it block by block.
  std::unique_ptr<float[]> master_;
};

// One generated version, written once and linked into every strategy's watch directory.
struct StagedVersion {
  uint64_t version = 0;
  std::string model_path;    // <work>/staged/<version>/model.safetensors
  std::string weights_hash;  // CheckpointHash, hex
  uint64_t changed_words = 0;
};

struct StagedSequence {
  TransformerShape shape;
  size_t tensor_count = 0;
  uint64_t checkpoint_bytes = 0;  // the bf16 data, without the safetensors header
  uint64_t words = 0;
  std::vector<StagedVersion> versions;
};

// Generates versions 1 .. versions and writes each to <dir>/<version>/model.safetensors.
// Needs the masters plus one bf16 buffer; both are freed before this returns.
Result<StagedSequence> StageVersions(const FleetBenchOptions& options, uint64_t versions,
                                     const std::string& dir) {
  CheckpointSequence sequence(options.parameters * sizeof(uint16_t), options.learning_rate,
                              options.seed, options.threads);
  StagedSequence staged;
  staged.shape = sequence.shape();
  staged.tensor_count = sequence.tensors().size();
  staged.words = sequence.words();
  staged.checkpoint_bytes = sequence.words() * sizeof(uint16_t);
  std::vector<uint16_t> words;
  for (uint64_t version = 1; version <= versions; ++version) {
    const SteadyClock::time_point start = SteadyClock::now();
    StagedVersion entry;
    entry.version = version;
    entry.changed_words = sequence.Next(words);
    const CheckpointView view = sequence.ViewOf(words);
    FW_ASSIGN_OR_RETURN(const Hash128 hash, CheckpointHash(view, options.threads));
    entry.weights_hash = hash.ToHex();
    const std::string version_dir = dir + "/" + std::to_string(version);
    std::error_code error;
    fs::create_directories(version_dir, error);
    if (error) return Status::IOError("cannot create " + version_dir + ": " + error.message());
    entry.model_path = version_dir + "/model.safetensors";
    FW_RETURN_IF_ERROR(WriteSafetensors(entry.model_path, view, {{"format", "pt"}}));
    std::cerr << "[fleet bench] generated version " << version << " ("
              << Megabytes(static_cast<double>(staged.checkpoint_bytes)) << " MB, "
              << (version == 1 ? std::string("initial weights")
                               : Fixed(100.0 * entry.changed_words / staged.words, 2) +
                                     "% of bf16 words changed")
              << ") in " << Fixed(SecondsSince(start), 1) << " s\n";
    staged.versions.push_back(std::move(entry));
  }
  return staged;
}

// Publishes a staged version the way a trainer drops it: <watch>/<version>/ with the
// checkpoint (a hard link to the staged file, so the drop takes no copy), then an empty
// COMMIT file, last. Returns the commit time in unix microseconds.
Result<int64_t> DropVersion(const StagedVersion& staged, const std::string& watch_dir) {
  const std::string version_dir = watch_dir + "/" + std::to_string(staged.version);
  std::error_code error;
  fs::create_directories(version_dir, error);
  if (error) return Status::IOError("cannot create " + version_dir + ": " + error.message());
  const std::string model_path = version_dir + "/model.safetensors";
  fs::create_hard_link(staged.model_path, model_path, error);
  if (error) {
    error.clear();
    fs::copy_file(staged.model_path, model_path, error);
    if (error) {
      return Status::IOError("cannot place " + staged.model_path + " at " + model_path + ": " +
                             error.message());
    }
  }
  const std::string commit_path = version_dir + "/COMMIT";
  const int fd = ::open(commit_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0 || ::close(fd) != 0) {
    return Status::IOError("cannot create " + commit_path + ": " + std::strerror(errno));
  }
  return UnixMicrosNow();
}

// ---- child processes -------------------------------------------------------------------

// ---- the roles -------------------------------------------------------------------------

struct Node {
  std::string name;  // "publisher", "relay-us", "worker-eu-3"
  std::string region;
  size_t process = 0;
  transport::Endpoint listen;  // relays and the publisher
  transport::Endpoint http;
};

// Waits for a role's ready file ({"listen": "...", "http": "..."}) while checking that the
// role still runs; fills the node's endpoints.
Status AwaitReady(ProcessGroup& processes, const std::string& ready_file, bool has_listen,
                  Node& node) {
  Result<nlohmann::json> awaited =
      ops::AwaitReadyFile(processes, ready_file, node.name, kReadyTimeout);
  if (!awaited.ok()) return awaited.status().WithContext("starting the fleet");
  const nlohmann::json& ready = *awaited;
  auto endpoint = [&](const char* key, transport::Endpoint& into) -> Status {
    if (!ready.contains(key) || !ready[key].is_string()) {
      return Status::Corruption(node.name + "'s ready file " + ready_file + " has no \"" + key +
                                "\" string: " + ready.dump());
    }
    FW_ASSIGN_OR_RETURN(into, transport::ParseEndpoint(ready[key].get<std::string>()));
    return Status::Ok();
  };
  FW_RETURN_IF_ERROR(endpoint("http", node.http));
  if (has_listen) FW_RETURN_IF_ERROR(endpoint("listen", node.listen));
  return Status::Ok();
}

// The fields of GET /v1/status that the benchmark reads.
struct NodeStatus {
  uint64_t version = 0;
  std::string weights_hash;
  int64_t swap_unix_us = 0;
  uint64_t wan_bytes = 0;  // wan_bytes_in + wan_bytes_out
  uint64_t last_artifact_bytes = 0;
  double last_publish_ms = 0;  // publisher: validate + encode + write of the last version
  double last_apply_ms = 0;    // worker: apply + verify of the last artifact
};

Result<NodeStatus> FetchStatus(const Node& node) {
  transport::HttpGetOptions get_options;
  get_options.timeout = std::chrono::milliseconds(2000);
  Result<transport::HttpResponse> response =
      transport::HttpGet(node.http, "/v1/status", get_options);
  const std::string where = node.name + " GET http://" + node.http.ToString() + "/v1/status";
  if (!response.ok()) return response.status().WithContext(where);
  if (response->status != 200) {
    return Status::Unavailable(where + ": HTTP " + std::to_string(response->status) + ": " +
                               response->body.substr(0, 200));
  }
  const Json json = Json::parse(response->body, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) {
    return Status::Corruption(where + ": not a JSON object: " + response->body.substr(0, 200));
  }
  NodeStatus status;
  try {
    status.version = json.value("version", uint64_t{0});
    status.weights_hash = json.value("weights_hash", std::string());
    status.swap_unix_us = json.value("swap_unix_us", int64_t{0});
    status.wan_bytes =
        json.value("wan_bytes_in", uint64_t{0}) + json.value("wan_bytes_out", uint64_t{0});
    status.last_artifact_bytes = json.value("last_artifact_bytes", uint64_t{0});
    status.last_publish_ms = json.value("last_publish_ms", 0.0);
    status.last_apply_ms = json.value("last_apply_ms", 0.0);
  } catch (const Json::exception& error) {
    return Status::Corruption(where + ": unexpected field type: " + error.what());
  }
  return status;
}

// A running fleet of one strategy: the publisher, one relay per region (unless direct)
// and the workers.
struct Fleet {
  explicit Fleet(std::string log_dir) : processes(std::move(log_dir)) {}
  ProcessGroup processes;
  Node publisher;
  std::vector<Node> relays;
  std::vector<Node> workers;
};

bool UsesRelays(const std::string& strategy) {
  return strategy != kFullDirect;
}

bool IsDelta(const std::string& strategy) {
  return strategy == kDeltaRelay || strategy == kDeltaRelaySigned || strategy == kDeltaRelayBuffered;
}

constexpr const char* kLoopbackAny = "127.0.0.1:0";

std::vector<std::string> RegionNames(int regions) {
  static const char* const kNames[] = {"us", "eu", "ap", "sa", "af", "me"};
  std::vector<std::string> names;
  for (int i = 0; i < regions; ++i) {
    names.push_back(i < 6 ? kNames[i] : "region" + std::to_string(i + 1));
  }
  return names;
}

// Starts one strategy's processes, each writing its ready file into `ready_dir`; with
// --pin the publisher gets CPU 0 and everything else the other CPUs.
struct FleetLauncher {
  const FleetBenchOptions& options;
  const std::string& flywheel;
  const std::string& strategy;
  std::string ready_dir;
  Fleet& fleet;
  int cpus = static_cast<int>(std::thread::hardware_concurrency());
  std::vector<std::string> trust{};  // relays' and workers' --trust-key

  std::string ReadyFile(const Node& node) const { return ready_dir + "/" + node.name + ".json"; }

  Status Launch(Node& node, const std::string& role, std::vector<std::string> args) {
    args.insert(args.begin(), role);
    args.push_back("--ready-file");
    args.push_back(ReadyFile(node));
    ops::StartOptions start;
    const bool pin = options.pin && cpus >= 2;
    if (pin && role == "publish") {
      start.cpus = {0};
    } else if (pin) {
      for (int cpu = 1; cpu < cpus; ++cpu) start.cpus.push_back(cpu);
    }
    FW_ASSIGN_OR_RETURN(node.process,
                        fleet.processes.Start(strategy + "-" + node.name, flywheel, args, start));
    return Status::Ok();
  }

  // The publisher (signing when the strategy signs, so that `trust` names its key).
  Status StartPublisher(const std::string& strategy_dir, const std::string& watch_dir) {
    fleet.publisher.name = "publisher";
    fleet.publisher.region = kHomeRegion;
    std::vector<std::string> args = {
        "--listen",         kLoopbackAny,
        "--http",           kLoopbackAny,
        "--state-dir",      strategy_dir + "/publisher",
        "--watch",          watch_dir,
        "--region",         kHomeRegion,
        "--wan-rate",       std::to_string(options.wan_bytes_per_second),
        "--wan-latency-ms", std::to_string(options.wan_latency_ms)};
    if (strategy == kDeltaRelaySigned) {
      FW_ASSIGN_OR_RETURN(sync::KeyFiles keys, sync::GenerateSigningKeys(strategy_dir + "/keys"));
      args.insert(args.end(), {"--signing-key", keys.private_key});
      trust = {"--trust-key", keys.public_key};
    }
    if (strategy == kDeltaRelayBuffered) args.push_back("--buffered-deltas");
    if (!IsDelta(strategy)) {
      args.push_back("--no-deltas");
    } else if (options.keyframe_every > 0) {
      args.push_back("--keyframe-every");
      args.push_back(std::to_string(options.keyframe_every));
    }
    FW_RETURN_IF_ERROR(Launch(fleet.publisher, "publish", args));
    return AwaitReady(fleet.processes, ReadyFile(fleet.publisher), true, fleet.publisher);
  }

  Status StartRelays(const std::vector<std::string>& regions) {
    for (const std::string& region : regions) {
      Node& relay = fleet.relays.emplace_back();
      relay.name = "relay-" + region;
      relay.region = region;
      std::vector<std::string> args = {
          "--region", region,       "--upstream", fleet.publisher.listen.ToString(),
          "--listen", kLoopbackAny, "--http",     kLoopbackAny};
      args.insert(args.end(), trust.begin(), trust.end());
      FW_RETURN_IF_ERROR(Launch(relay, "relay", args));
    }
    for (Node& relay : fleet.relays) {
      FW_RETURN_IF_ERROR(AwaitReady(fleet.processes, ReadyFile(relay), true, relay));
    }
    return Status::Ok();
  }

  // Each region's workers, from its relay or (no relays) from the publisher.
  Status StartWorkers(const std::vector<std::string>& regions) {
    for (size_t r = 0; r < regions.size(); ++r) {
      const std::string upstream = UsesRelays(strategy) ? fleet.relays[r].listen.ToString()
                                                        : fleet.publisher.listen.ToString();
      for (int i = 1; i <= options.workers_per_region; ++i) {
        Node& worker = fleet.workers.emplace_back();
        worker.name = "worker-" + regions[r] + "-" + std::to_string(i);
        worker.region = regions[r];
        std::vector<std::string> args = {"--region", regions[r], "--upstream",
                                         upstream,   "--http",   kLoopbackAny};
        args.insert(args.end(), trust.begin(), trust.end());
        FW_RETURN_IF_ERROR(Launch(worker, "worker", args));
      }
    }
    for (Node& worker : fleet.workers) {
      FW_RETURN_IF_ERROR(AwaitReady(fleet.processes, ReadyFile(worker), false, worker));
    }
    return Status::Ok();
  }
};

// Starts the publisher, then the relays, then the workers (each tier all at once, the next
// when every one of them wrote its ready file).
Status StartFleet(const FleetBenchOptions& options, const std::string& flywheel,
                  const std::string& strategy, const std::string& strategy_dir,
                  const std::string& watch_dir, Fleet& fleet) {
  FleetLauncher launcher{options, flywheel, strategy, strategy_dir + "/ready", fleet};
  std::error_code error;
  fs::create_directories(launcher.ready_dir, error);
  if (error) return Status::IOError("cannot create " + launcher.ready_dir + ": " + error.message());
  FW_RETURN_IF_ERROR(launcher.StartPublisher(strategy_dir, watch_dir));
  const std::vector<std::string> regions = RegionNames(options.regions);
  if (UsesRelays(strategy)) FW_RETURN_IF_ERROR(launcher.StartRelays(regions));
  return launcher.StartWorkers(regions);
}

// ---- measuring one update --------------------------------------------------------------

struct UpdateResult {
  uint64_t version = 0;
  uint64_t changed_words = 0;
  // Commit of the drop to the last worker's swap, from the workers' swap_unix_us.
  double seconds = kNotMeasured;
  // Commit to the poll that saw the last worker done: an upper bound of `seconds`.
  double observed_seconds = kNotMeasured;
  uint64_t wan_bytes = 0;                // publisher's wan_bytes_in + out during the update
  uint64_t artifact_bytes = 0;           // publisher's last_artifact_bytes after it
  double target_seconds = kNotMeasured;  // delta-relay only
  // Where the time went: the publisher's encode (validate, encode, write) and the slowest
  // worker's apply (apply in place, verify, swap). The rest is transfer and waiting.
  double publish_seconds = kNotMeasured;
  double max_apply_seconds = kNotMeasured;

  bool meets_target() const { return seconds <= target_seconds; }
};

Result<NodeStatus> FetchPublisherStatus(Fleet& fleet) {
  // The publisher is busy while it encodes; give a slow answer a few more tries.
  Result<NodeStatus> status = FetchStatus(fleet.publisher);
  for (int attempt = 1; attempt < 5 && !status.ok(); ++attempt) {
    FW_RETURN_IF_ERROR(fleet.processes.CheckRunning(fleet.publisher.process));
    status = FetchStatus(fleet.publisher);
  }
  return status;
}

// Polls every worker until all of them serve `version` with `weights_hash`. Fails when a
// worker serves it with other weights, a role exits, or `timeout` passes. Fills the
// update's seconds and observed_seconds, relative to the commit.
Status AwaitWorkers(Fleet& fleet, const StagedVersion& staged, int64_t commit_unix_us,
                    SteadyClock::time_point commit_steady, double timeout_seconds,
                    UpdateResult& result) {
  const SteadyClock::time_point deadline =
      commit_steady + std::chrono::microseconds(static_cast<int64_t>(timeout_seconds * 1e6));
  std::vector<int64_t> swap_unix_us(fleet.workers.size(), 0);
  std::vector<std::string> last_seen(fleet.workers.size(), "no answer yet");
  size_t done = 0;
  while (true) {
    for (size_t i = 0; i < fleet.workers.size(); ++i) {
      if (swap_unix_us[i] != 0) continue;
      const Node& worker = fleet.workers[i];
      Result<NodeStatus> status = FetchStatus(worker);
      if (!status.ok()) {
        FW_RETURN_IF_ERROR(fleet.processes.CheckRunning(worker.process));
        last_seen[i] = status.status().ToString();
        continue;
      }
      last_seen[i] = "version " + std::to_string(status->version);
      if (status->version != staged.version) continue;
      if (status->weights_hash != staged.weights_hash) {
        return Status::Mismatch(worker.name + " serves version " + std::to_string(staged.version) +
                                " with weights_hash '" + status->weights_hash + "', expected " +
                                staged.weights_hash);
      }
      if (status->swap_unix_us < commit_unix_us) {
        // A status read between the version's swap and the update of its swap time still
        // shows the previous swap's: not done until the two agree (or the deadline).
        last_seen[i] += " with swap_unix_us " + std::to_string(status->swap_unix_us) +
                        ", before the commit at " + std::to_string(commit_unix_us);
        continue;
      }
      swap_unix_us[i] = status->swap_unix_us;
      const double apply_seconds = status->last_apply_ms * 1e-3;
      if (std::isnan(result.max_apply_seconds) || apply_seconds > result.max_apply_seconds) {
        result.max_apply_seconds = apply_seconds;
      }
      ++done;
    }
    if (done == fleet.workers.size()) break;
    FW_RETURN_IF_ERROR(fleet.processes.CheckAllRunning());
    if (SteadyClock::now() > deadline) {
      std::string behind;
      for (size_t i = 0; i < fleet.workers.size(); ++i) {
        if (swap_unix_us[i] != 0) continue;
        behind += (behind.empty() ? "" : ", ") + fleet.workers[i].name + " (" + last_seen[i] + ")";
      }
      return Status::Unavailable(std::to_string(fleet.workers.size() - done) + " of " +
                                 std::to_string(fleet.workers.size()) +
                                 " workers did not serve version " +
                                 std::to_string(staged.version) + " within " +
                                 Fixed(timeout_seconds, 0) + " s of its commit: " + behind);
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  result.observed_seconds = SecondsSince(commit_steady);
  const int64_t last_swap = *std::max_element(swap_unix_us.begin(), swap_unix_us.end());
  result.seconds = static_cast<double>(last_swap - commit_unix_us) * 1e-6;
  // The swap times come from the workers' clocks (this machine's): none can be later than
  // the poll that saw it, or the status field is wrong.
  constexpr double kClockSlackSeconds = 0.005;
  if (result.seconds > result.observed_seconds + kClockSlackSeconds) {
    return Status::Internal("a worker's swap_unix_us for version " +
                            std::to_string(staged.version) + " is " + Fixed(result.seconds, 3) +
                            " s after the commit, but the poll saw " + "every worker done " +
                            Fixed(result.observed_seconds, 3) + " s after it");
  }
  return Status::Ok();
}

// Drops one version and waits for the whole fleet to serve it; measures the update.
Result<UpdateResult> RunUpdate(Fleet& fleet, const StagedVersion& staged,
                               const std::string& watch_dir, double timeout_seconds) {
  UpdateResult result;
  result.version = staged.version;
  result.changed_words = staged.changed_words;
  FW_ASSIGN_OR_RETURN(const NodeStatus before, FetchPublisherStatus(fleet));
  FW_ASSIGN_OR_RETURN(const int64_t commit_unix_us, DropVersion(staged, watch_dir));
  const SteadyClock::time_point commit_steady = SteadyClock::now();
  FW_RETURN_IF_ERROR(
      AwaitWorkers(fleet, staged, commit_unix_us, commit_steady, timeout_seconds, result));
  FW_ASSIGN_OR_RETURN(const NodeStatus after, FetchPublisherStatus(fleet));
  result.wan_bytes = after.wan_bytes - std::min(after.wan_bytes, before.wan_bytes);
  result.artifact_bytes = after.last_artifact_bytes;
  result.publish_seconds = after.last_publish_ms * 1e-3;
  return result;
}

// ---- one strategy ----------------------------------------------------------------------

struct StrategyResult {
  std::string name;
  double initial_sync_seconds = kNotMeasured;  // version 1, not part of the statistics
  uint64_t initial_wan_bytes = 0;
  std::vector<UpdateResult> updates;
  std::vector<std::string> notes;  // roles that did not stop cleanly

  std::vector<double> Seconds() const {
    std::vector<double> values;
    for (const UpdateResult& update : updates) values.push_back(update.seconds);
    return values;
  }
  double median_seconds() const { return Median(Seconds(), kNotMeasured); }
  double max_seconds() const {
    const std::vector<double> values = Seconds();
    return values.empty() ? kNotMeasured : *std::max_element(values.begin(), values.end());
  }
  double mean_wan_bytes() const {
    if (updates.empty()) return kNotMeasured;
    double sum = 0;
    for (const UpdateResult& update : updates) sum += static_cast<double>(update.wan_bytes);
    return sum / updates.size();
  }
  double mean_artifact_bytes() const {
    if (updates.empty()) return kNotMeasured;
    double sum = 0;
    for (const UpdateResult& update : updates) sum += static_cast<double>(update.artifact_bytes);
    return sum / updates.size();
  }
};

// Seconds the delta strategy should need: 1.3 x (artifact bytes at the WAN rate + one
// RTT) + 0.5 s for discovering the drop, encoding, applying and the LAN hop.
double TargetSeconds(const FleetBenchOptions& options, uint64_t artifact_bytes) {
  const double rtt = 2.0 * options.wan_latency_ms / 1000.0;
  return kTargetSlack * (static_cast<double>(artifact_bytes) / options.wan_bytes_per_second + rtt) +
         kTargetOverheadSeconds;
}

// Default per-update timeout: generous for full-direct, whose workers in one region share
// that region's WAN bucket.
double UpdateTimeoutSeconds(const FleetBenchOptions& options, uint64_t checkpoint_bytes) {
  if (options.update_timeout_seconds > 0) return options.update_timeout_seconds;
  const double region_bytes = static_cast<double>(checkpoint_bytes) * options.workers_per_region;
  return 30.0 + 5.0 * region_bytes / options.wan_bytes_per_second;
}

std::string Elapsed(SteadyClock::time_point run_start) {
  return "elapsed " + Fixed(SecondsSince(run_start), 1) + " s";
}

Result<StrategyResult> RunStrategy(const FleetBenchOptions& options, const std::string& flywheel,
                                   const std::string& strategy, const StagedSequence& staged,
                                   const std::string& work_dir, SteadyClock::time_point run_start) {
  StrategyResult result;
  result.name = strategy;
  const std::string strategy_dir = work_dir + "/" + strategy;
  const std::string watch_dir = strategy_dir + "/watch";
  const std::string log_dir = work_dir + "/logs";
  std::error_code error;
  fs::create_directories(watch_dir, error);
  if (error) return Status::IOError("cannot create " + watch_dir + ": " + error.message());
  const double timeout_seconds = UpdateTimeoutSeconds(options, staged.checkpoint_bytes);
  const std::string tag = "[fleet bench] " + strategy + ": ";

  // Every strategy starts from the same disk state: what earlier strategies (or the
  // generator) wrote is on disk, not still being written back while this one is measured.
  ::sync();
  Fleet fleet(log_dir);
  std::cerr << tag << "starting publisher, " << (UsesRelays(strategy) ? options.regions : 0)
            << " relays, " << options.regions * options.workers_per_region << " workers ("
            << Elapsed(run_start) << ")\n";
  FW_RETURN_IF_ERROR(StartFleet(options, flywheel, strategy, strategy_dir, watch_dir, fleet));

  for (const StagedVersion& version : staged.versions) {
    const bool initial = version.version == 1;
    ::sync();  // the last update's writes are not written back during this one
    std::cerr << tag
              << (initial ? std::string("initial sync of version 1")
                          : "update " + std::to_string(version.version - 1) + "/" +
                                std::to_string(options.updates) + " (version " +
                                std::to_string(version.version) + ")")
              << " ..." << std::flush;
    Result<UpdateResult> update = RunUpdate(fleet, version, watch_dir, timeout_seconds);
    if (!update.ok()) {
      std::cerr << " failed\n";
      return update.status().WithContext(strategy + " version " + std::to_string(version.version));
    }
    std::cerr << " " << Fixed(update->seconds, 3) << " s, WAN " << Megabytes(update->wan_bytes)
              << " MB, artifacts " << Megabytes(update->artifact_bytes) << " MB ("
              << Elapsed(run_start) << ")\n";
    if (initial) {
      result.initial_sync_seconds = update->seconds;
      result.initial_wan_bytes = update->wan_bytes;
      continue;
    }
    if (IsDelta(strategy))
      update->target_seconds = TargetSeconds(options, update->artifact_bytes);
    result.updates.push_back(*update);
  }
  result.notes = fleet.processes.StopAll();
  for (const std::string& note : result.notes) std::cerr << tag << "note: " << note << "\n";
  if (!options.keep) fs::remove_all(strategy_dir, error);
  return result;
}

// ---- loopback stream: flywheel against iperf3 -------------------------------------------


// ---- output ----------------------------------------------------------------------------

const StrategyResult* FindStrategy(const std::vector<StrategyResult>& results,
                                   const std::string& name) {
  for (const StrategyResult& result : results) {
    if (result.name == name) return &result;
  }
  return nullptr;
}

Table UpdatesTable(const std::vector<StrategyResult>& results, const StagedSequence& staged) {
  Table table;
  table.header = {"strategy", "update",   "version",  "changed",  "artifacts MB", "WAN MB",
                  "sync s",   "polled s", "target s", "encode s", "apply s"};
  for (const StrategyResult& result : results) {
    for (size_t i = 0; i < result.updates.size(); ++i) {
      const UpdateResult& update = result.updates[i];
      table.rows.push_back({result.name, std::to_string(i + 1), std::to_string(update.version),
                            Fixed(100.0 * update.changed_words / staged.words, 2) + "%",
                            Megabytes(update.artifact_bytes), Megabytes(update.wan_bytes),
                            Fixed(update.seconds, 3), Fixed(update.observed_seconds, 3),
                            Fixed(update.target_seconds, 3), Fixed(update.publish_seconds, 2),
                            Fixed(update.max_apply_seconds, 2)});
    }
  }
  return table;
}

// "1/412" for a small fraction, "0.25x" otherwise.
std::string RatioText(double ratio) {
  if (!std::isfinite(ratio)) return "-";
  if (ratio > 0 && ratio < 0.1) return "1/" + Fixed(1.0 / ratio, 0);
  return Fixed(ratio, 3) + "x";
}

Table SummaryTable(const std::vector<StrategyResult>& results) {
  const StrategyResult* baseline = FindStrategy(results, kFullDirect);
  Table table;
  table.header = {"strategy",      "median s",           "max s",
                  "WAN MB/update", "WAN vs full-direct", "artifacts MB/update",
                  "initial sync s"};
  for (const StrategyResult& result : results) {
    const double ratio =
        baseline != nullptr ? result.mean_wan_bytes() / baseline->mean_wan_bytes() : kNotMeasured;
    table.rows.push_back({result.name, Fixed(result.median_seconds(), 3),
                          Fixed(result.max_seconds(), 3), Megabytes(result.mean_wan_bytes()),
                          RatioText(ratio), Megabytes(result.mean_artifact_bytes()),
                          Fixed(result.initial_sync_seconds, 2)});
  }
  return table;
}

// ---- stages and the paper-scale projection ---------------------------------------------

// Medians over delta-relay's updates of each stage's own time, and the rates they imply.
struct StageFigures {
  bool measured = false;
  double publish_seconds = kNotMeasured;  // the publisher's own path (1 thread)
  double wan_seconds = kNotMeasured;      // the update's WAN bytes at the emulated rate
  double apply_seconds = kNotMeasured;    // the slowest worker's apply + verify + swap
  double sync_seconds = kNotMeasured;     // commit -> every worker serving
  double bits_per_changed_word = kNotMeasured;
};

StageFigures MeasureStages(const FleetBenchOptions& options, const std::vector<StrategyResult>& results) {
  StageFigures figures;
  const StrategyResult* delta = FindStrategy(results, kDeltaRelay);
  if (delta == nullptr) delta = FindStrategy(results, kDeltaRelaySigned);
  if (delta == nullptr || delta->updates.empty()) return figures;
  std::vector<double> publish, wan, apply, bits;
  for (const UpdateResult& update : delta->updates) {
    publish.push_back(update.publish_seconds);
    // Each remote region's relay receives the artifact once over its own link.
    wan.push_back(static_cast<double>(update.wan_bytes) / std::max(options.regions, 1) /
                  static_cast<double>(options.wan_bytes_per_second));
    apply.push_back(update.max_apply_seconds);
    if (update.changed_words > 0) {
      bits.push_back(8.0 * static_cast<double>(update.artifact_bytes) /
                     static_cast<double>(update.changed_words));
    }
  }
  figures.measured = true;
  figures.publish_seconds = Median(publish, kNotMeasured);
  figures.wan_seconds = Median(wan, kNotMeasured);
  figures.apply_seconds = Median(apply, kNotMeasured);
  figures.sync_seconds = delta->median_seconds();
  figures.bits_per_changed_word = Median(bits, kNotMeasured);
  return figures;
}

constexpr double kPublisherPathTarget = 1.5e9;  // bytes of checkpoint per second
constexpr double kOverlapSlack = 1.3;
constexpr double kOverlapOverheadSeconds = 0.2;

Table StagesTable(const StageFigures& figures, const StagedSequence& staged) {
  Table table;
  table.header = {"stage (delta-relay, median)", "seconds", "GB/s of checkpoint"};
  const double bytes = static_cast<double>(staged.checkpoint_bytes);
  auto row = [&](const std::string& name, double seconds) {
    table.rows.push_back({name, Fixed(seconds, 3), Fixed(bytes / seconds / 1e9, 2)});
  };
  row("publisher's own path (validate + hash + encode + write, 1 thread)", figures.publish_seconds);
  row("WAN transfer (artifact at the emulated rate, per region)", figures.wan_seconds);
  row("apply (slowest worker: apply + verify + swap, 1 thread)", figures.apply_seconds);
  row("commit -> every worker serving", figures.sync_seconds);
  return table;
}

std::vector<std::string> StageChecks(const FleetBenchOptions& options, const StageFigures& figures,
                                     const StagedSequence& staged) {
  if (!figures.measured) return {"stage targets: n/a (needs --strategies delta-relay)"};
  std::vector<std::string> lines;
  const double path_rate = static_cast<double>(staged.checkpoint_bytes) / figures.publish_seconds;
  lines.push_back("publisher's own path >= " + Fixed(kPublisherPathTarget / 1e9, 1) +
                  " GB/s of checkpoint: " + PassFail(path_rate >= kPublisherPathTarget) + " (" +
                  Fixed(path_rate / 1e9, 2) + ")");
  const double rtt = 2.0 * options.wan_latency_ms / 1000.0;
  const double slowest =
      std::max({figures.publish_seconds, figures.wan_seconds, figures.apply_seconds});
  const double bound = kOverlapSlack * slowest + rtt + kOverlapOverheadSeconds;
  lines.push_back("stages overlap: sync <= " + Fixed(kOverlapSlack, 1) +
                  " x max(publish, WAN, apply) + RTT + " + Fixed(kOverlapOverheadSeconds, 1) +
                  " s: " + PassFail(figures.sync_seconds <= bound) + " (" +
                  Fixed(figures.sync_seconds, 3) + " s against " + Fixed(bound, 3) +
                  " s; the stages alone add up to " +
                  Fixed(figures.publish_seconds + figures.wan_seconds + figures.apply_seconds + rtt, 3) +
                  " s with the RTT)");
  return lines;
}

// ---- the projection's inputs, each measured alone ---------------------------------------

struct AloneRates {
  IsolatedRates isolated;
  // encode and apply of the run's own bf16 generator (the same lr), for the prediction of
  // this machine's run; absent with --projection-only.
  std::optional<CodecRates> bf16;
};

// Measured while no role of the fleet runs (they were all stopped), each on one thread.
Result<AloneRates> MeasureAlone(const FleetBenchOptions& options) {
  IsolatedRatesOptions rates;
  rates.fp8_bytes = options.rates_fp8_mb << 20;
  rates.tls_bytes = options.rates_tls_mb << 20;
  rates.seed = options.seed;
  rates.threads = options.threads;
  std::cerr << "[fleet bench] projection rates, each alone on one thread: FP8 pair of "
            << options.rates_fp8_mb << " MiB, TLS streams of " << options.rates_tls_mb
            << " MiB ..." << std::flush;
  AloneRates alone;
  FW_ASSIGN_OR_RETURN(alone.isolated, MeasureIsolatedRates(rates));
  if (!options.projection_only) {
    const uint64_t bytes = std::min<uint64_t>(options.parameters * 2, 256ull << 20);
    CheckpointSequence sequence(bytes, options.learning_rate, options.seed, options.threads);
    std::vector<uint16_t> base, target;
    sequence.Next(base);
    sequence.Next(target);
    FW_ASSIGN_OR_RETURN(CodecRates bf16, MeasureCodecRates(sequence.ViewOf(base),
                                                           sequence.ViewOf(target), 3));
    alone.bf16 = bf16;
  }
  std::cerr << " done\n";
  return alone;
}

// This run predicted by the projection's stage model, against what it measured.
struct LocalCheck {
  LocalFleet fleet;
  MeasuredRates rates;
  LocalPrediction prediction;
  double measured_seconds = kNotMeasured;  // delta-relay's median sync time
};

std::optional<LocalCheck> PredictThisRun(const FleetBenchOptions& options,
                                         const std::vector<StrategyResult>& results,
                                         const StagedSequence& staged, const AloneRates& alone) {
  const StrategyResult* delta = FindStrategy(results, kDeltaRelay);
  if (delta == nullptr) delta = FindStrategy(results, kDeltaRelaySigned);
  if (delta == nullptr || delta->updates.empty() || !alone.bf16) return std::nullopt;
  std::vector<double> artifacts;
  for (const UpdateResult& update : delta->updates) artifacts.push_back(double(update.artifact_bytes));
  LocalCheck check;
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  check.fleet = {double(staged.words), Median(artifacts, 0), double(options.wan_bytes_per_second),
                 2.0 * options.wan_latency_ms / 1000.0, options.regions, options.workers_per_region,
                 cores, cores};
  check.rates = alone.isolated.Projection();
  check.rates.encode_words_per_second = alone.bf16->encode_words_per_second();
  check.rates.apply_words_per_second = alone.bf16->apply_words_per_second();
  check.rates.bits_per_changed_word = alone.bf16->bits_per_changed_word();
  check.prediction = PredictLocalFleet(check.rates, check.fleet);
  check.measured_seconds = delta->median_seconds();
  return check;
}

Table LocalCheckTable(const LocalCheck& check) {
  Table table;
  table.header = {"stage (one update of this run)", "from", "seconds"};
  for (const ProjectionStage& stage : check.prediction.stages)
    table.rows.push_back({stage.name, stage.basis, Fixed(stage.seconds, 3)});
  table.rows.push_back({"every role's CPU for the update", "the stages' CPU x processes",
                        Fixed(check.prediction.cpu_seconds, 3)});
  table.rows.push_back({"predicted sync", check.prediction.formula, Fixed(check.prediction.seconds, 3)});
  table.rows.push_back({"measured sync (delta-relay, median)", "commit -> every worker serving",
                        Fixed(check.measured_seconds, 3)});
  table.rows.push_back({"measured / predicted", "",
                        Fixed(check.measured_seconds / check.prediction.seconds, 2) + "x"});
  return table;
}

// PASS/FAIL lines of the targets.
std::vector<std::string> Checks(const std::vector<StrategyResult>& results) {
  std::vector<std::string> lines;
  const StrategyResult* delta = FindStrategy(results, kDeltaRelay);
  const StrategyResult* baseline = FindStrategy(results, kFullDirect);
  const std::string time_target = "delta-relay sync time <= " + Fixed(kTargetSlack, 1) +
                                  " x (artifact bytes / WAN rate + RTT) + " +
                                  Fixed(kTargetOverheadSeconds, 1) + " s";
  if (delta == nullptr || delta->updates.empty()) {
    lines.push_back(time_target + ": n/a (needs --strategies delta-relay)");
  } else {
    size_t met = 0;
    const UpdateResult* worst = &delta->updates.front();
    const UpdateResult* best = worst;
    for (const UpdateResult& update : delta->updates) {
      met += update.meets_target();
      const double over = update.seconds - update.target_seconds;
      if (over > worst->seconds - worst->target_seconds) worst = &update;
      if (over < best->seconds - best->target_seconds) best = &update;
    }
    lines.push_back(time_target + ": " + PassFail(met == delta->updates.size()) + " (" +
                    std::to_string(met) + "/" + std::to_string(delta->updates.size()) +
                    " updates; best " + Fixed(best->seconds, 3) + " s, worst " +
                    Fixed(worst->seconds, 3) + " s, against " + Fixed(worst->target_seconds, 3) +
                    " s)");
  }
  const std::string wan_target =
      "delta-relay WAN bytes <= 1/" + Fixed(1.0 / kWanFractionTarget, 0) + " of full-direct";
  if (delta == nullptr || baseline == nullptr || delta->updates.empty() ||
      baseline->updates.empty()) {
    lines.push_back(wan_target + ": n/a (needs --strategies full-direct,delta-relay)");
  } else {
    const double ratio = delta->mean_wan_bytes() / baseline->mean_wan_bytes();
    lines.push_back(wan_target + ": " + PassFail(ratio <= kWanFractionTarget) + " (" +
                    Megabytes(delta->mean_wan_bytes()) + " MB against " +
                    Megabytes(baseline->mean_wan_bytes()) + " MB per update = " + RatioText(ratio) +
                    ")");
  }
  const StrategyResult* buffered = FindStrategy(results, kDeltaRelayBuffered);
  const std::string streamed_target = "delta-relay (streamed publish) median sync time < delta-relay-buffered's";
  if (delta == nullptr || buffered == nullptr || delta->updates.empty() ||
      buffered->updates.empty()) {
    lines.push_back(streamed_target + ": n/a (needs --strategies delta-relay,delta-relay-buffered)");
  } else {
    const double ratio = delta->median_seconds() / buffered->median_seconds();
    lines.push_back(streamed_target + ": " + PassFail(ratio < 1.0) + " (" +
                    Fixed(delta->median_seconds(), 3) + " s against " +
                    Fixed(buffered->median_seconds(), 3) + " s = " + Fixed(ratio, 3) + " x)");
  }
  const StrategyResult* signed_delta = FindStrategy(results, kDeltaRelaySigned);
  const std::string signed_target = "delta-relay-signed median sync time <= " +
                                    Fixed(kSignedSlack, 2) + " x delta-relay's";
  if (delta == nullptr || signed_delta == nullptr || delta->updates.empty() ||
      signed_delta->updates.empty()) {
    lines.push_back(signed_target + ": n/a (needs --strategies delta-relay,delta-relay-signed)");
  } else {
    const double ratio = signed_delta->median_seconds() / delta->median_seconds();
    lines.push_back(signed_target + ": " + PassFail(ratio <= kSignedSlack) + " (" +
                    Fixed(signed_delta->median_seconds(), 3) + " s against " +
                    Fixed(delta->median_seconds(), 3) + " s = " + Fixed(ratio, 3) + " x)");
  }
  return lines;
}

std::string Preamble(const FleetBenchOptions& options, const StagedSequence& staged) {
  const std::vector<std::string> regions = RegionNames(options.regions);
  std::string region_list;
  for (const std::string& region : regions)
    region_list += (region_list.empty() ? "" : ", ") + region;
  std::ostringstream out;
  out << "flywheel fleet benchmark: cross-region weight sync, full checkpoints direct vs "
         "through relays vs deltas through relays\n"
      << "fleet: publisher (region " << kHomeRegion << ") + " << options.regions << " regions ("
      << region_list << ") x (relay + " << options.workers_per_region
      << " workers); separate processes of the flywheel binary on loopback\n"
      << "WAN: " << Fixed(options.wan_bytes_per_second * 8 / 1e9, 2)
      << " Gbit/s per remote region and direction, " << options.wan_latency_ms
      << " ms one way (RTT " << 2 * options.wan_latency_ms
      << " ms), shaped by the publisher; relay -> workers unshaped\n"
      << "checkpoint: " << Grouped(staged.words)
      << " bf16 parameters = " << Megabytes(static_cast<double>(staged.checkpoint_bytes)) << " MB ("
      << staged.tensor_count << " tensors: hidden " << staged.shape.hidden << ", "
      << staged.shape.layers << " layers, vocab " << staged.shape.vocab << "); steps of ~lr "
      << NumberText(options.learning_rate) << " per fp32 master, cast to bf16\n"
      << "updates: " << options.updates << " measured after the initial version; delta-relay "
      << "keyframe every "
      << (options.keyframe_every > 0 ? std::to_string(options.keyframe_every)
                                     : std::string("(publisher default)"))
      << " versions\n"
      << "machine: " << std::thread::hardware_concurrency() << " hardware threads"
      << (options.pin && std::thread::hardware_concurrency() >= 2
              ? " (publisher pinned to CPU 0, relays and workers to the others)"
              : "");
  const double load = LoadAverage();
  if (std::isfinite(load)) out << ", load average " << Fixed(load, 2);
  out << "\n";
  return out.str();
}

std::vector<std::string> Legend() {
  return {
      "sync s: from the drop's COMMIT file to the last worker serving the new version with the "
      "expected weights hash (the workers' swap_unix_us)",
      "polled s: the same, as seen by polling GET /v1/status every 10 ms (an upper bound)",
      "encode s: the publisher's validate + encode + write of the version (last_publish_ms); "
      "apply s: the slowest worker's apply + verify + swap (last_apply_ms); the rest of sync s "
      "is transfer, relay hops and waiting for CPU (every role shares this machine's cores)",
      "WAN MB: bytes the publisher sent and received on links to other regions during the "
      "update (wan_bytes_out + wan_bytes_in)",
      "artifacts MB: what the publisher wrote for the version (last_artifact_bytes: the delta, "
      "plus the keyframe if one was written)"};
}

Json ResultsJson(const FleetBenchOptions& options, const StagedSequence& staged,
                 const std::vector<StrategyResult>& results, const LoopbackStreamReport& stream,
                 const std::vector<std::string>& checks, bool ok) {
  auto number = [](double value) { return std::isfinite(value) ? Json(value) : Json(nullptr); };
  Json json;
  json["benchmark"] = "flywheel fleet";
  json["ok"] = ok;
  json["topology"] = {{"home_region", kHomeRegion},
                      {"regions", RegionNames(options.regions)},
                      {"workers_per_region", options.workers_per_region},
                      {"wan_bytes_per_second", options.wan_bytes_per_second},
                      {"wan_latency_ms", options.wan_latency_ms}};
  json["checkpoint"] = {{"parameters", staged.words},
                        {"bytes", staged.checkpoint_bytes},
                        {"tensors", staged.tensor_count},
                        {"hidden", staged.shape.hidden},
                        {"layers", staged.shape.layers},
                        {"vocab", staged.shape.vocab},
                        {"learning_rate", options.learning_rate},
                        {"seed", options.seed}};
  Json strategies = Json::array();
  for (const StrategyResult& result : results) {
    Json updates = Json::array();
    for (const UpdateResult& update : result.updates) {
      updates.push_back({{"version", update.version},
                         {"changed_words", update.changed_words},
                         {"seconds", number(update.seconds)},
                         {"observed_seconds", number(update.observed_seconds)},
                         {"wan_bytes", update.wan_bytes},
                         {"artifact_bytes", update.artifact_bytes},
                         {"target_seconds", number(update.target_seconds)},
                         {"publish_seconds", number(update.publish_seconds)},
                         {"max_apply_seconds", number(update.max_apply_seconds)}});
    }
    strategies.push_back({{"name", result.name},
                          {"initial_sync_seconds", number(result.initial_sync_seconds)},
                          {"initial_wan_bytes", result.initial_wan_bytes},
                          {"median_seconds", number(result.median_seconds())},
                          {"max_seconds", number(result.max_seconds())},
                          {"mean_wan_bytes", number(result.mean_wan_bytes())},
                          {"mean_artifact_bytes", number(result.mean_artifact_bytes())},
                          {"updates", updates},
                          {"notes", result.notes}});
  }
  json["strategies"] = strategies;
  json["checks"] = checks;
  json["loopback_stream"] = LoopbackStreamJson(stream);
  return json;
}

// ---- setup -----------------------------------------------------------------------------

Status ValidateOptions(const FleetBenchOptions& options) {
  if (options.strategies.empty()) return Status::InvalidArgument("no strategy given");
  std::set<std::string> seen;
  for (const std::string& strategy : options.strategies) {
    if (strategy != kFullDirect && strategy != kFullRelay && strategy != kDeltaRelay &&
        strategy != kDeltaRelaySigned && strategy != kDeltaRelayBuffered) {
      return Status::InvalidArgument("unknown strategy '" + strategy + "' (expected " +
                                     kFullDirect + ", " + kFullRelay + ", " + kDeltaRelay + ", " +
                                     kDeltaRelaySigned + " or " + kDeltaRelayBuffered + ")");
    }
    if (!seen.insert(strategy).second) {
      return Status::InvalidArgument("strategy '" + strategy + "' is given twice");
    }
  }
  if (options.parameters < 32768) {
    return Status::InvalidArgument("--params must be at least 32768, got " +
                                   std::to_string(options.parameters));
  }
  if (options.updates < 1) {
    return Status::InvalidArgument("--updates must be >= 1, got " +
                                   std::to_string(options.updates));
  }
  if (options.regions < 1 || options.workers_per_region < 1) {
    return Status::InvalidArgument("need at least one region and one worker per region");
  }
  if (options.wan_bytes_per_second == 0) return Status::InvalidArgument("--wan-rate must be > 0");
  if (options.wan_latency_ms < 0) return Status::InvalidArgument("--wan-latency-ms must be >= 0");
  if (!(options.learning_rate > 0) || !std::isfinite(options.learning_rate)) {
    return Status::InvalidArgument("--lr must be positive, got " +
                                   NumberText(options.learning_rate));
  }
  if (options.threads < 1) return Status::InvalidArgument("threads must be >= 1");
  if (options.rates_fp8_mb < 1 || options.rates_tls_mb < 1)
    return Status::InvalidArgument("--rates-fp8-mb and --rates-tls-mb must be >= 1");
  return Status::Ok();
}

// Resident memory of each role in checkpoints (anonymous RSS, the peak over a full-relay
// run with 3 updates, measured at 400 MB and 1 GB checkpoints): a worker holds its weights
// plus the artifact it fetches; a relay caches the retained (compressed) artifacts; the
// publisher holds the checkpoint it encodes from and the artifact it serves.
constexpr double kWorkerCheckpoints = 1.7;
constexpr double kRelayCheckpoints = 2.75;
constexpr double kPublisherCheckpoints = 2.5;

// Refuses to start when the largest fleet of the run would not fit in MemAvailable
// (estimated from the figures above; on a tmpfs work dir the drops and the publisher's
// keyframes count too).
Status CheckMemory(const FleetBenchOptions& options, const std::string& work_dir) {
  const double checkpoint_bytes = static_cast<double>(options.parameters * sizeof(uint16_t));
  bool relays = false;
  for (const std::string& strategy : options.strategies) relays |= UsesRelays(strategy);
  const int workers = options.regions * options.workers_per_region;
  const int relay_count = relays ? options.regions : 0;
  double needed =
      (kWorkerCheckpoints * workers + kRelayCheckpoints * relay_count + kPublisherCheckpoints) *
      checkpoint_bytes;
  std::string how = "(" + Fixed(kWorkerCheckpoints, 2) + " x " + std::to_string(workers) +
                    " workers + " + Fixed(kRelayCheckpoints, 2) + " x " +
                    std::to_string(relay_count) + " relays + " + Fixed(kPublisherCheckpoints, 2) +
                    " for the publisher) x " + Gigabytes(checkpoint_bytes) + " checkpoint";
  struct statfs filesystem {};
  constexpr long kTmpfsMagic = 0x01021994;
  if (::statfs(work_dir.c_str(), &filesystem) == 0 && filesystem.f_type == kTmpfsMagic) {
    const double files = 2.0 * (options.updates + 1) * checkpoint_bytes;
    needed += files;
    how += " + " + Gigabytes(files) + " of drops and keyframes in tmpfs " + work_dir;
  }
  const std::optional<uint64_t> available = MemAvailableBytes();
  if (!available) return Status::Ok();  // not Linux-like: nothing to check against
  if (needed > static_cast<double>(*available)) {
    return Status::ResourceExhausted(
        "the fleet needs about " + Gigabytes(needed) + " of memory (" + how + "), but only " +
        Gigabytes(static_cast<double>(*available)) +
        " is available (MemAvailable); use a smaller --params or fewer --workers-per-region");
  }
  return Status::Ok();
}

Result<std::string> ResolveFlywheel(const FleetBenchOptions& options) {
  std::error_code error;
  std::string path = options.flywheel_binary;
  if (path.empty()) {
    FW_ASSIGN_OR_RETURN(path, ops::ExecutablePath());
  } else {
    path = fs::absolute(path, error).string();
  }
  if (::access(path.c_str(), X_OK) != 0) {
    return Status::NotFound("flywheel binary " + path +
                            " is not executable: " + std::strerror(errno));
  }
  return path;
}

// The report: its tables in order (each with its title), the projection's assumptions,
// the checks and the notes; printed as text and as Markdown alike.
struct FleetReport {
  std::vector<std::pair<std::string, Table>> sections;
  std::vector<std::string> projection_lines, checks, notes;
  Json projection_json;  // `projection` of --json
  bool fleet_ran = true;
};

Json StageJson(const std::vector<ProjectionStage>& stages) {
  Json json = Json::array();
  for (const ProjectionStage& stage : stages) {
    json.push_back({{"name", stage.name}, {"basis", stage.basis}, {"seconds", stage.seconds},
                    {"fill_seconds", stage.fill_seconds}, {"streamed", stage.streamed}});
  }
  return json;
}

Json ProjectionJson(const Projection& p, const ProjectionAssumptions& a, const AloneRates& alone,
                    const std::vector<std::string>& lines) {
  const MeasuredRates r = alone.isolated.Projection();
  const TlsRates& tls = alone.isolated.tls;
  const CodecRates& fp8 = alone.isolated.fp8;
  Json json;
  json["streamed_seconds"] = p.streamed_seconds;
  json["goal_seconds"] = a.goal_seconds;
  json["meets_goal"] = p.streamed_seconds <= a.goal_seconds;
  json["paced_by"] = p.slowest;
  json["formula"] = StreamedFormula();
  json["in_region_seconds"] = p.in_region_seconds;
  json["buffered_seconds"] = p.buffered_seconds;
  json["store_and_forward_seconds"] = p.store_and_forward_seconds;
  json["apply_overlapped_seconds"] = p.apply_overlapped_seconds;
  json["wan_floor_seconds"] = p.delta_bytes / (a.wan_bits_per_second / 8) + a.rtt_seconds;
  json["delta_bytes"] = p.delta_bytes;
  json["stages"] = StageJson(p.stages);
  json["rates"] = {{"encode_words_per_second", r.encode_words_per_second},
                   {"apply_words_per_second", r.apply_words_per_second},
                   {"tls_send_bytes_per_second", r.tls_send_bytes_per_second},
                   {"tls_receive_bytes_per_second", r.tls_receive_bytes_per_second},
                   {"relay_forward_bytes_per_second", r.relay_forward_bytes_per_second},
                   {"bits_per_changed_word", r.bits_per_changed_word},
                   {"tls_stream_bytes_per_second", tls.stream_bytes_per_second},
                   {"aead_one_core_bytes_per_second", tls.aes_gcm_per_core},
                   {"tls_cipher", tls.cipher},
                   {"fp8_pair_bytes", fp8.bytes},
                   {"fp8_changed_fraction", fp8.changed_fraction()},
                   {"fp8_delta_bytes", fp8.delta_bytes}};
  json["assumptions"] = {{"checkpoint_words", a.checkpoint_words},
                         {"changed_fraction", a.changed_fraction},
                         {"wan_bits_per_second", a.wan_bits_per_second},
                         {"lan_bits_per_second", a.lan_bits_per_second},
                         {"rtt_seconds", a.rtt_seconds},
                         {"trainer_cores", a.trainer_cores},
                         {"worker_cores", a.worker_cores},
                         {"relay_cores", a.relay_cores},
                         {"fan_out", a.fan_out},
                         {"tree_levels", a.tree_levels},
                         {"piece_bytes", a.piece_bytes},
                         {"encode_chunk_words", a.encode_chunk_words},
                         {"lines", lines}};
  return json;
}

// The projection's tables, lines, check and JSON; with `local`, this run's prediction too.
void AddProjection(FleetReport& report, const AloneRates& alone,
                   const std::optional<LocalCheck>& local) {
  const ProjectionAssumptions assume;
  const MeasuredRates rates = alone.isolated.Projection();
  const Projection projection = ProjectSeedsCase(rates, assume);
  report.sections.push_back({"Projection: 1 TiB FP8, 2% changed, 10 Gbit/s WAN, 64 cores, fan-out "
                             "8, from rates each measured alone",
                             ProjectionTable(projection, assume)});
  report.projection_lines = alone.isolated.Lines();
  for (const std::string& line : ProjectionAssumptionLines(rates, assume))
    report.projection_lines.push_back(line);
  const double wan_floor = projection.delta_bytes / (assume.wan_bits_per_second / 8) + assume.rtt_seconds;
  report.projection_lines.push_back(
      "bound from the measurement: the delta's WAN bytes alone take " + Fixed(wan_floor, 2) +
      " s (" + Fixed(projection.delta_bytes / 1e9, 2) + " GB at " +
      Fixed(assume.wan_bits_per_second / 1e9, 0) + " Gbit/s + RTT); the apply after the last "
      "piece " + Fixed(projection.stages.back().seconds, 2) + " s");
  const GoalRates goal = RatesForGoal(projection, assume);
  report.projection_lines.push_back(
      goal.reachable
          ? "what " + Fixed(assume.goal_seconds, 0) + " s asks with these hops (slowest " +
                Fixed(goal.slowest_hop_seconds, 2) + " s): encode >= " +
                Fixed(goal.encode_words_per_second / 1e9, 2) + " and apply >= " +
                Fixed(goal.apply_words_per_second / 1e9, 2) +
                " G FP8 words/s per thread (measured: " +
                Fixed(rates.encode_words_per_second / 1e9, 2) + " and " +
                Fixed(rates.apply_words_per_second / 1e9, 2) + ")"
          : "the hops alone (slowest " + Fixed(goal.slowest_hop_seconds, 2) + " s) take the " +
                Fixed(assume.goal_seconds, 0) + " s goal: no codec rate reaches it");
  report.checks.push_back("projected 1 TiB FP8 sync (streamed, as built) <= " +
                          Fixed(assume.goal_seconds, 0) + " s: " +
                          PassFail(projection.streamed_seconds <= assume.goal_seconds) + " (" +
                          Fixed(projection.streamed_seconds, 2) + " s, paced by " +
                          projection.slowest + "; in-region at " +
                          Fixed(assume.lan_bits_per_second / 1e9, 0) + " Gbit/s: " +
                          Fixed(projection.in_region_seconds, 2) + " s)");
  report.projection_json = ProjectionJson(projection, assume, alone, report.projection_lines);
  report.projection_json["goal_needs"] = {
      {"reachable", goal.reachable},
      {"slowest_hop_seconds", goal.slowest_hop_seconds},
      {"encode_words_per_second_per_thread", goal.encode_words_per_second},
      {"apply_words_per_second_per_thread", goal.apply_words_per_second}};
  if (!local) return;
  report.sections.push_back({"Stage model against this run (the same model, this run's shape, "
                             "rates measured alone, " + std::to_string(local->fleet.cores) +
                             " cores shared)", LocalCheckTable(*local)});
  report.checks.push_back("stage model vs this run: predicted " + Fixed(local->prediction.seconds, 3) +
                          " s, measured " + Fixed(local->measured_seconds, 3) + " s (measured / "
                          "predicted " + Fixed(local->measured_seconds / local->prediction.seconds, 2) +
                          "x; reported, no target)");
  report.projection_json["local_check"] = {
      {"predicted_seconds", local->prediction.seconds},
      {"measured_seconds", local->measured_seconds},
      {"measured_over_predicted", local->measured_seconds / local->prediction.seconds},
      {"cpu_seconds", local->prediction.cpu_seconds},
      {"formula", local->prediction.formula},
      {"bf16_encode_words_per_second", local->rates.encode_words_per_second},
      {"bf16_apply_words_per_second", local->rates.apply_words_per_second},
      {"stages", StageJson(local->prediction.stages)}};
}

FleetReport MakeReport(const FleetBenchOptions& options, const StagedSequence& staged,
                       const std::vector<StrategyResult>& results,
                       const LoopbackStreamReport& stream, const AloneRates& alone) {
  FleetReport report;
  report.checks = Checks(results);
  if (options.stream_seconds > 0) {
    for (const std::string& line : LoopbackStreamChecks(stream)) report.checks.push_back(line);
  }
  const StageFigures stages = MeasureStages(options, results);
  for (const std::string& line : StageChecks(options, stages, staged))
    report.checks.push_back(line);
  report.sections = {{"Per update", UpdatesTable(results, staged)},
                     {"Per strategy", SummaryTable(results)}};
  if (stages.measured)
    report.sections.push_back({"Stages, each on its own", StagesTable(stages, staged)});
  if (options.stream_seconds > 0) {
    report.sections.push_back(
        {"Loopback stream (" + LoopbackStreamSetup(stream) + ")", LoopbackStreamTable(stream)});
  }
  AddProjection(report, alone, PredictThisRun(options, results, staged, alone));
  for (const StrategyResult& result : results) {
    for (const std::string& note : result.notes) report.notes.push_back(result.name + ": " + note);
  }
  return report;
}

void PrintReport(const FleetReport& report, std::ostream& out) {
  for (const auto& [title, table] : report.sections)
    out << "\n" << title << ":\n" << RenderText(table);
  out << "\nprojection inputs (each measured alone) and assumptions:\n";
  for (const std::string& line : report.projection_lines) out << "  " << line << "\n";
  out << "\nchecks:\n";
  for (const std::string& line : report.checks) out << "  " << line << "\n";
  for (const std::string& note : report.notes) out << "  note: " << note << "\n";
  out << "\n";
  if (report.fleet_ran)
    for (const std::string& line : Legend()) out << line << "\n";
  out << std::flush;
}

std::string MarkdownReport(const FleetReport& report, const std::string& preamble) {
  std::string section = "## Fleet benchmark\n\n```\n" + preamble + "```\n";
  for (const auto& [title, table] : report.sections) {
    section += "\n### " + title + "\n\n" + RenderMarkdown(table);
  }
  section += "\n### Projection inputs (each measured alone) and assumptions\n\n";
  for (const std::string& line : report.projection_lines) section += "- " + line + "\n";
  section += "\n### Checks\n\n";
  for (const std::string& line : report.checks) section += "- " + line + "\n";
  for (const std::string& note : report.notes) section += "- note: " + note + "\n";
  section += "\n";
  for (const std::string& line : Legend()) section += "- " + line + "\n";
  return section;
}

// --projection-only: the rates, each alone, and the projection; no fleet.
Status RunProjectionOnly(const FleetBenchOptions& options, std::ostream& out) {
  std::ostringstream preamble;
  preamble << "flywheel fleet benchmark, projection only: the 1 TiB FP8 case from rates each "
              "measured alone on this machine (no fleet started)\nmachine: "
           << std::thread::hardware_concurrency() << " hardware threads";
  const double load = LoadAverage();
  if (std::isfinite(load)) preamble << ", load average " << Fixed(load, 2);
  preamble << "\n";
  out << preamble.str() << std::flush;
  FW_ASSIGN_OR_RETURN(const AloneRates alone, MeasureAlone(options));
  FleetReport report;
  report.fleet_ran = false;
  AddProjection(report, alone, std::nullopt);
  PrintReport(report, out);
  if (!options.markdown_out.empty()) {
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Fleet benchmark",
                                            MarkdownReport(report, preamble.str())));
  }
  if (!options.json_out.empty()) {
    Json json;
    json["benchmark"] = "flywheel fleet";
    json["ok"] = true;
    json["checks"] = report.checks;
    json["projection"] = report.projection_json;
    const std::string text = json.dump(2) + "\n";
    FW_RETURN_IF_ERROR(delta::WriteFileAtomically(options.json_out, std::as_bytes(std::span(text))));
  }
  return Status::Ok();
}

}  // namespace

Status RunFleetBench(const FleetBenchOptions& options, std::ostream& out) {
  FW_RETURN_IF_ERROR(ValidateOptions(options));
  if (options.projection_only) return RunProjectionOnly(options, out);
  FW_ASSIGN_OR_RETURN(const std::string flywheel, ResolveFlywheel(options));
  ScopedWorkDir work_dir;
  FW_RETURN_IF_ERROR(work_dir.Prepare(options.work_dir, "flywheel-fleet-bench", options.keep));
  FW_RETURN_IF_ERROR(CheckMemory(options, work_dir.path()));
  if (options.keep) std::cerr << "[fleet bench] work dir (kept): " << work_dir.path() << "\n";
  const std::string log_dir = work_dir.path() + "/logs";
  std::error_code error;
  fs::create_directories(log_dir, error);
  if (error) return Status::IOError("cannot create " + log_dir + ": " + error.message());
  const SteadyClock::time_point run_start = SteadyClock::now();
  FW_ASSIGN_OR_RETURN(const StagedSequence staged,
                      StageVersions(options, static_cast<uint64_t>(options.updates) + 1,
                                    work_dir.path() + "/staged"));
  const std::string preamble = Preamble(options, staged);
  out << preamble << "\n" << std::flush;
  std::vector<StrategyResult> results;
  for (const std::string& strategy : options.strategies) {
    FW_ASSIGN_OR_RETURN(StrategyResult result, RunStrategy(options, flywheel, strategy, staged,
                                                           work_dir.path(), run_start));
    results.push_back(std::move(result));
  }
  if (!options.keep) fs::remove_all(work_dir.path() + "/staged", error);
  // Every role has stopped: the projection's rates are measured with each role alone.
  FW_ASSIGN_OR_RETURN(const AloneRates alone, MeasureAlone(options));
  std::vector<Status> failures;
  LoopbackStreamReport stream;
  if (options.stream_seconds > 0) {
    LoopbackStreamOptions stream_options;
    stream_options.seconds = options.stream_seconds;
    stream_options.log_dir = log_dir;
    stream = MeasureLoopbackStreams(stream_options, failures);
  }
  const FleetReport report = MakeReport(options, staged, results, stream, alone);
  PrintReport(report, out);
  if (!options.markdown_out.empty()) {
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Fleet benchmark",
                                            MarkdownReport(report, preamble)));
  }
  if (!options.json_out.empty()) {
    Json json = ResultsJson(options, staged, results, stream, report.checks, failures.empty());
    json["projection"] = report.projection_json;
    const std::string text = json.dump(2) + "\n";
    FW_RETURN_IF_ERROR(delta::WriteFileAtomically(options.json_out, std::as_bytes(std::span(text))));
  }
  if (!failures.empty()) return failures.front();
  return Status::Ok();
}

}  // namespace flywheel::bench
