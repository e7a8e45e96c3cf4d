// Weight sync end to end.
//
// FleetTest spawns real `flywheel publish|relay|worker` processes (FLYWHEEL_BIN) on
// 127.0.0.1, drops checkpoints into the publisher's watch directory the way an external
// trainer does, and watches every node through GET /v1/status. Faults come from outside
// the code under test: SIGSTOP/SIGCONT/SIGKILL, and a proxy that cuts or corrupts the
// byte stream (testing/fault_proxy.h).
//
// CraftedUpstreamTest needs catalogs no publisher would send (a delta that lies about its
// base, an older head): it runs a sync::Server with a test PieceSource and an in-process
// sync::Worker on one io_context.
//
// Every process runs with --heartbeat-ms 100 --peer-timeout-ms 1000 so that failures are
// noticed in about a second. The processes live in a ops::ProcessGroup (the harness),
// which stops and reaps them in TearDown whatever happened; every wait is a
// ops::WaitUntil on the condition itself.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "delta/delta.h"
#include "checkpoint/hash.h"
#include "checkpoint/safetensors.h"
#include "ops/process.h"
#include "sync/server.h"
#include "sync/upstream.h"
#include "sync/signing.h"
#include "sync/worker.h"
#include "tests/delta/test_checkpoints.h"
#include "tests/sync/crafted_upstream.h"
#include "tests/sync/promtool.h"
#include "testing/fault_proxy.h"
#include "transport/http.h"
#include "transport/certs.h"
#include "transport/tls.h"

namespace flywheel::sync {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using json = nlohmann::json;
using flywheel::testing::Change;
using flywheel::testing::FaultProxy;
using flywheel::testing::FaultProxyOptions;
using flywheel::testing::Mutate;
using flywheel::testing::RandomCheckpoint;
using flywheel::testing::HashOf;
using flywheel::testing::TensorSpec;
using Clock = std::chrono::steady_clock;

using crafted::RunOnIo;

constexpr auto kWait = std::chrono::milliseconds(20000);  // for anything a test waits on
constexpr uint64_t kPieceBytes = 64 << 10;                // --piece-kib 64
constexpr double kChangedFraction = 0.02;                 // words replaced per version

// About 6 MB of bf16 weights plus a small f32 tensor: random bytes, so a keyframe does not
// compress and a delta is a few percent of it.
std::vector<TensorSpec> FleetSpecs() {
  return {
      {"model.embed_tokens.weight", DType::kBF16, {1536, 1024}},
      {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {768, 1024}},
      {"model.layers.1.mlp.up_proj.weight", DType::kBF16, {768, 1024}},
      {"model.norm.weight", DType::kF32, {1024}},
  };
}

// About 1 MB, for the in-process fixture.
std::vector<TensorSpec> SmallSpecs() {
  return {
      {"model.embed_tokens.weight", DType::kBF16, {512, 512}},
      {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {256, 1024}},
      {"model.norm.weight", DType::kF32, {512}},
  };
}

// A training run as the fleet sees it: v1 is random, every next version replaces about
// kChangedFraction of the 16-bit words of the one before. Versions are made on first use.
class Lineage {
 public:
  Lineage(std::vector<TensorSpec> specs, uint64_t seed) : specs_(std::move(specs)), seed_(seed) {}

  const OwnedCheckpoint& At(uint64_t version) {
    auto it = versions_.find(version);
    if (it != versions_.end()) return it->second;
    OwnedCheckpoint made = version <= 1 ? RandomCheckpoint(specs_, seed_)
                                        : Mutate(At(version - 1), kChangedFraction,
                                                 seed_ * 1000003 + version, Change::kArbitrary);
    return versions_.emplace(version, std::move(made)).first->second;
  }
  std::string Hex(uint64_t version) { return HashOf(At(version)).ToHex(); }
  // Content no version of this lineage has: `version`'s predecessor changed differently.
  OwnedCheckpoint Impostor(uint64_t version) {
    return Mutate(At(version - 1), kChangedFraction, seed_ * 7919 + version + 1,
                  Change::kArbitrary);
  }

 private:
  std::vector<TensorSpec> specs_;
  uint64_t seed_;
  std::map<uint64_t, OwnedCheckpoint> versions_;
};

uint64_t U64(const json& status, const char* key) {
  auto it = status.find(key);
  return it != status.end() && it->is_number_unsigned() ? it->get<uint64_t>() : 0;
}

std::string Str(const json& status, const char* key) {
  auto it = status.find(key);
  return it != status.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// A status document without the bulky per-link list, for failure messages.
std::string Brief(json status) {
  if (status.is_object()) status.erase("links");
  return status.dump(1);
}

std::function<bool(const json&)> Serves(uint64_t version, const std::string& hash) {
  return [version, hash](const json& status) {
    return U64(status, "version") == version && Str(status, "weights_hash") == hash;
  };
}

bool WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  return out.good();
}

// ---- processes -----------------------------------------------------------------------

// One spawned flywheel process.
struct Node {
  std::string name;
  size_t index = SIZE_MAX;     // in FleetTest::processes_; SIZE_MAX when it did not start
  fs::path ready;              // --ready-file
  transport::Endpoint listen;  // data plane (publisher, relay)
  transport::Endpoint http;
  // What its HTTP endpoint wants from a client.
  std::string token;
  std::shared_ptr<asio::ssl::context> tls;

  std::string upstream() const { return listen.ToString(); }
};

class FleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "fleet_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    watch_ = dir_ / "watch";
    fs::create_directories(watch_);
    processes_ = std::make_unique<ops::ProcessGroup>(dir_.string());
    processes_->set_grace(3s);
  }

  void TearDown() override {
    if (processes_ == nullptr) return;
    (void)processes_->StopAll();
    if (HasFailure()) {
      for (const Node& node : nodes_) {
        if (node.index == SIZE_MAX) continue;
        std::cerr << "---- " << node.name << " (" << processes_->stdout_path(node.index)
                  << ", .err), last lines ----\n"
                  << Tail(node, 40);
      }
      std::cerr << "---- test directory kept: " << dir_.string() << "\n";
      return;
    }
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // Starts FLYWHEEL_BIN `args` in processes_: stdout and stderr go to <dir>/<name>.out and
  // .err (.restart<n>.out/.err when the name was started before).
  Node& Spawn(const std::string& name, const std::vector<std::string>& args) {
    Node& node = nodes_.emplace_back();
    node.name = name;
    node.ready = dir_ / (name + ".ready");
    std::vector<std::string> all_args;
    if (std::getenv("FLEET_TEST_VERBOSE") != nullptr) all_args.push_back("--verbose");  // debug logs
    all_args.insert(all_args.end(), args.begin(), args.end());
    std::error_code ignored;
    fs::remove(node.ready, ignored);
    Result<size_t> index = processes_->Start(name, FLYWHEEL_BIN, all_args);
    if (!index.ok()) {
      ADD_FAILURE() << index.status().ToString();
      return node;
    }
    node.index = *index;
    return node;
  }

  // Runs a one-shot `flywheel args...`; nullopt (with a failure) if it could not run or
  // timed out.
  std::optional<ops::Completion> Run(const std::vector<std::string>& args) {
    ops::RunOptions options;
    options.timeout = kWait;
    Result<ops::Completion> done = ops::RunToCompletion(FLYWHEEL_BIN, args, options);
    if (!done.ok()) {
      ADD_FAILURE() << done.status().ToString();
      return std::nullopt;
    }
    return std::move(*done);
  }

  // SIGTERM (and SIGCONT, in case it is stopped), SIGKILL after 3 s; always reaps. Its
  // waitpid status.
  int Stop(Node& node) { return node.index == SIZE_MAX ? -1 : processes_->Stop(node.index); }

  void KillNow(Node& node) {
    if (node.index != SIZE_MAX) processes_->Kill(node.index);
  }

  // SIGSTOP / SIGCONT; false (with a failure) if it no longer runs.
  bool Signal(Node& node, int signal) {
    const Status sent = node.index == SIZE_MAX ? Status::NotFound(node.name + " did not start")
                                               : processes_->Signal(node.index, signal);
    EXPECT_TRUE(sent.ok()) << sent.ToString();
    return sent.ok();
  }

  // Waits for a one-shot command to exit; its exit code, or -1 (with a failure).
  int WaitExit(Node& node, std::chrono::milliseconds timeout = kWait) {
    if (node.index == SIZE_MAX) return -1;
    Result<int> exit_code = processes_->WaitExitCode(node.index, timeout);
    if (!exit_code.ok()) {
      ADD_FAILURE() << exit_code.status().ToString();
      KillNow(node);
      return -1;
    }
    return *exit_code;
  }

  // Its stdout followed by its stderr, so far.
  std::string Output(const Node& node) const {
    return node.index == SIZE_MAX ? std::string() : processes_->Output(node.index);
  }

  std::string Tail(const Node& node, size_t lines) const {
    const std::string text = Output(node);
    size_t begin = text.size();
    for (size_t seen = 0; begin > 0 && seen <= lines; --begin) {
      if (text[begin - 1] == '\n') ++seen;
    }
    return text.substr(begin == 0 ? 0 : begin + 1);
  }

  // Waits for the node's --ready-file; false (with a failure) if it exits or times out.
  bool WaitReady(Node& node) {
    if (node.index == SIZE_MAX) return false;
    Result<json> ready = ops::AwaitReadyFile(*processes_, node.ready.string(), node.name,
                                                  kWait, node.index);
    if (!ready.ok()) {
      ADD_FAILURE() << ready.status().ToString() << "\n" << Tail(node, 20);
      return false;
    }
    auto endpoint = [&](const char* key, transport::Endpoint& into) {
      if (!ready->contains(key) || !(*ready)[key].is_string()) {
        ADD_FAILURE() << node.name << " ready file has no \"" << key << "\": " << ready->dump();
        return false;
      }
      Result<transport::Endpoint> parsed = transport::ParseEndpoint((*ready)[key].get<std::string>());
      if (!parsed.ok()) {
        ADD_FAILURE() << node.name << " ready file: " << parsed.status().ToString();
        return false;
      }
      into = *parsed;
      return true;
    };
    return endpoint("http", node.http) && (!ready->contains("listen") || endpoint("listen", node.listen));
  }

  std::vector<std::string> CommonArgs(const std::string& name) const {
    return {"--http",
            "127.0.0.1:0",
            "--node-id",
            name,
            "--ready-file",
            (dir_ / (name + ".ready")).string(),
            "--heartbeat-ms",
            "100",
            "--peer-timeout-ms",
            "1000"};
  }

  fs::path StateDir(const std::string& name) const { return dir_ / (name + ".state"); }

  // Role starters: spawn, then wait for the ready file. Null (with a failure) if it did
  // not come up.
  Node* Started(Node& node) { return WaitReady(node) ? &node : nullptr; }

  Node* StartPublisher(const std::string& name, const std::vector<std::string>& extra = {},
                       const std::string& listen = "127.0.0.1:0") {
    std::vector<std::string> args = {"publish",
                                     "--listen",
                                     listen,
                                     "--state-dir",
                                     StateDir(name).string(),
                                     "--watch",
                                     watch_.string(),
                                     "--piece-kib",
                                     std::to_string(kPieceBytes >> 10),
                                     "--poll-ms",
                                     "20"};
    for (const std::string& arg : CommonArgs(name)) args.push_back(arg);
    args.insert(args.end(), extra.begin(), extra.end());
    return Started(Spawn(name, args));
  }

  Node* StartRelay(const std::string& name, const std::string& region,
                   const std::vector<std::string>& upstreams,
                   const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"relay", "--region", region, "--listen", "127.0.0.1:0"};
    for (const std::string& upstream : upstreams) {
      args.push_back("--upstream");
      args.push_back(upstream);
    }
    for (const std::string& arg : CommonArgs(name)) args.push_back(arg);
    args.insert(args.end(), extra.begin(), extra.end());
    return Started(Spawn(name, args));
  }

  Node& SpawnWorker(const std::string& name, const std::string& region,
                    const std::vector<std::string>& upstreams,
                    const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"worker", "--region", region};
    for (const std::string& upstream : upstreams) {
      args.push_back("--upstream");
      args.push_back(upstream);
    }
    for (const std::string& arg : CommonArgs(name)) args.push_back(arg);
    args.insert(args.end(), extra.begin(), extra.end());
    return Spawn(name, args);
  }

  Node* StartWorker(const std::string& name, const std::string& region,
                    const std::vector<std::string>& upstreams,
                    const std::vector<std::string>& extra = {}) {
    return Started(SpawnWorker(name, region, upstreams, extra));
  }

  // ---- status ------------------------------------------------------------------------

  Result<transport::HttpResponse> Get(const Node& node, const std::string& target,
                                      const std::string& token) {
    transport::HttpGetOptions options;
    options.token = token;
    options.tls = node.tls;
    options.timeout = 2s;
    return transport::HttpGet(node.http, target, options);
  }

  std::optional<json> GetStatus(const Node& node) {
    Result<transport::HttpResponse> response = Get(node, "/v1/status", node.token);
    if (!response.ok() || response->status != 200) return std::nullopt;
    json status = json::parse(response->body, nullptr, /*allow_exceptions=*/false);
    if (status.is_discarded()) return std::nullopt;
    return status;
  }

  json StatusOrEmpty(const Node& node) { return GetStatus(node).value_or(json::object()); }

  // Polls `node`'s status until `holds`; on timeout adds a failure naming `what` with the
  // last status seen.
  bool WaitStatus(const Node& node, const std::string& what,
                  const std::function<bool(const json&)>& holds,
                  std::chrono::milliseconds timeout = kWait) {
    json last;
    const Status waited = ops::WaitUntil(
        [&] {
          std::optional<json> status = GetStatus(node);
          if (!status) return false;
          if (holds(*status)) return true;
          last = std::move(*status);
          return false;
        },
        timeout, node.name + " " + what, 20ms);
    if (waited.ok()) return true;
    ADD_FAILURE() << waited.ToString() << "; last status:\n" << Brief(last);
    return false;
  }

  // `holds` stays true of `node`'s status for `duration` (checked every 50 ms). The sleep
  // is by design: this proves that something does not change within a window.
  bool Holds(const Node& node, const std::string& what,
             const std::function<bool(const json&)>& holds, std::chrono::milliseconds duration) {
    const auto deadline = Clock::now() + duration;
    while (Clock::now() < deadline) {
      json status = StatusOrEmpty(node);
      if (!holds(status)) {
        ADD_FAILURE() << node.name << ": no longer " << what << "; status:\n" << Brief(status);
        return false;
      }
      std::this_thread::sleep_for(50ms);
    }
    return true;
  }

  // ---- drops -------------------------------------------------------------------------

  // Writes <watch>/<version>/model.safetensors, then the COMMIT marker unless `commit` is
  // false, as a trainer does.
  bool Drop(uint64_t version, const OwnedCheckpoint& checkpoint, bool commit = true) {
    const fs::path dir = watch_ / std::to_string(version);
    std::error_code ignored;
    fs::remove_all(dir, ignored);  // a replay starts from a fresh directory
    fs::create_directories(dir);
    const Status written =
        WriteSafetensors((dir / "model.safetensors").string(), checkpoint.view(), {});
    if (!written.ok()) {
      ADD_FAILURE() << "drop v" << version << ": " << written.ToString();
      return false;
    }
    if (commit && !WriteText(dir / "COMMIT", "")) {
      ADD_FAILURE() << "drop v" << version << ": cannot write COMMIT";
      return false;
    }
    return true;
  }

  // Drops lineage version `version` and waits until `publisher` serves it.
  bool Publish(const Node& publisher, uint64_t version) {
    return Drop(version, lineage_.At(version)) &&
           WaitStatus(publisher, "publishing v" + std::to_string(version),
                      Serves(version, lineage_.Hex(version)));
  }

  // A publisher listening on a fixed port (FreePort's race accepted: a restarted publisher
  // must come back on it), `listen`, and a worker following it. False (and a test failure)
  // when either does not start.
  bool StartOnAFixedPort(std::string* listen, Node** publisher, Node** worker) {
    const Result<uint16_t> port = ops::FreePort();
    EXPECT_TRUE(port.ok()) << port.status().ToString();
    if (!port.ok()) return false;
    *listen = "127.0.0.1:" + std::to_string(*port);
    *publisher = StartPublisher("publisher", {}, *listen);
    EXPECT_NE(*publisher, nullptr);
    if (*publisher == nullptr) return false;
    *worker = StartWorker("worker", "home", {*listen});
    EXPECT_NE(*worker, nullptr);
    return *worker != nullptr;
  }

  // A publisher that serves v1, the lineage's keyframe; its size in `keyframe_bytes`. Null
  // (and a test failure) when the publisher does not start or does not publish.
  Node* StartPublisherWithKeyframe(uint64_t* keyframe_bytes) {
    Node* publisher = StartPublisher("publisher");
    EXPECT_NE(publisher, nullptr);
    if (publisher == nullptr) return nullptr;
    const bool published = Publish(*publisher, 1);
    EXPECT_TRUE(published);
    if (!published) return nullptr;
    *keyframe_bytes = U64(StatusOrEmpty(*publisher), "last_artifact_bytes");
    return publisher;
  }

  fs::path dir_;
  fs::path watch_;
  std::unique_ptr<ops::ProcessGroup> processes_;  // after dir_ exists
  std::deque<Node> nodes_;  // stable addresses
  Lineage lineage_{FleetSpecs(), 1234};
};

// ---- the happy path ------------------------------------------------------------------------

TEST_F(FleetTest, HappyPathTwoRegions) {
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  std::map<std::string, Node*> relays;
  std::map<std::string, std::vector<Node*>> workers;
  for (const std::string region : {"us", "eu"}) {
    relays[region] = StartRelay("relay-" + region, region, {publisher->upstream()});
    ASSERT_NE(relays[region], nullptr);
  }
  for (const std::string region : {"us", "eu"}) {
    for (int i = 0; i < 2; ++i) {
      Node* worker = StartWorker("worker-" + region + "-" + std::to_string(i), region,
                                 {relays[region]->upstream()});
      ASSERT_NE(worker, nullptr);
      workers[region].push_back(worker);
    }
  }
  for (uint64_t version = 1; version <= 3; ++version) ASSERT_TRUE(Publish(*publisher, version));
  for (const auto& [region, nodes] : workers) {
    for (Node* worker : nodes) {
      ASSERT_TRUE(WaitStatus(*worker, "serving v3", Serves(3, lineage_.Hex(3))));
    }
  }

  // The publisher sees the whole fleet: the relays directly, the workers through their
  // relays' reports, all at v3.
  std::set<std::string> expected_nodes;
  for (const auto& [region, relay] : relays) expected_nodes.insert(relay->name);
  for (const auto& [region, nodes] : workers) {
    for (Node* worker : nodes) expected_nodes.insert(worker->name);
  }
  ASSERT_TRUE(WaitStatus(*publisher, "listing all 6 nodes at v3", [&](const json& status) {
    std::set<std::string> at_v3;
    for (const json& node : status.value("nodes", json::array())) {
      if (U64(node, "version") == 3) at_v3.insert(Str(node, "node_id"));
    }
    return at_v3 == expected_nodes;
  }));
  const json publisher_status = StatusOrEmpty(*publisher);
  for (const json& node : publisher_status["nodes"]) {
    const std::string id = Str(node, "node_id");
    const std::string region = Str(node, "region");
    EXPECT_EQ(Str(node, "role"), id.starts_with("relay") ? "relay" : "worker") << node.dump();
    EXPECT_EQ(Str(node, "via"), id.starts_with("relay") ? id : "relay-" + region) << node.dump();
  }

  // Cross-region bytes are paid once per region: each relay took every artifact from the
  // publisher once, and its workers took them from the relay.
  const uint64_t artifact_bytes = U64(publisher_status, "log_bytes");
  ASSERT_GT(artifact_bytes, 4u << 20) << Brief(publisher_status);
  EXPECT_LT(U64(publisher_status, "bytes_out"), 2 * artifact_bytes + (1u << 20))
      << Brief(publisher_status);
  for (const auto& [region, relay] : relays) {
    const json relay_status = StatusOrEmpty(*relay);
    uint64_t workers_in = 0;
    for (Node* worker : workers[region]) workers_in += U64(StatusOrEmpty(*worker), "bytes_in");
    const uint64_t relay_in = U64(relay_status, "bytes_in");
    EXPECT_GE(relay_in, artifact_bytes) << Brief(relay_status);
    EXPECT_LT(relay_in, artifact_bytes + artifact_bytes / 10 + (256u << 10)) << Brief(relay_status);
    EXPECT_GE(workers_in, 2 * artifact_bytes) << region;
    EXPECT_LT(relay_in, workers_in * 6 / 10)
        << region << ": relay took " << relay_in << " bytes, its workers " << workers_in;
    EXPECT_EQ(U64(relay_status, "pieces_rejected"), 0u);
  }
}

TEST_F(FleetTest, JoiningWorker) {
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  Node* relay = StartRelay("relay-eu", "eu", {publisher->upstream()});
  ASSERT_NE(relay, nullptr);
  for (uint64_t version = 1; version <= 3; ++version) ASSERT_TRUE(Publish(*publisher, version));
  ASSERT_TRUE(WaitStatus(*relay, "announcing v3",
                         [](const json& s) { return U64(s, "head_version") == 3; }));

  Node* worker = StartWorker("worker-late", "eu", {relay->upstream()});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(WaitStatus(*worker, "catching up to v3", Serves(3, lineage_.Hex(3))));
  ASSERT_TRUE(Publish(*publisher, 4));
  ASSERT_TRUE(WaitStatus(*worker, "following to v4", Serves(4, lineage_.Hex(4))));
  const json status = StatusOrEmpty(*worker);
  EXPECT_EQ(U64(status, "artifacts_rejected"), 0u);
  EXPECT_EQ(U64(status, "pieces_rejected"), 0u);
  EXPECT_EQ(Str(status, "upstream"), relay->upstream());
}

// ---- catching up -----------------------------------------------------------------------------

TEST_F(FleetTest, ChainCatchUp) {
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  Node* worker = StartWorker("worker", "home", {publisher->upstream()});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));
  const uint64_t keyframe_bytes = U64(StatusOrEmpty(*publisher), "last_artifact_bytes");
  ASSERT_GT(keyframe_bytes, 4u << 20);
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  const json before = StatusOrEmpty(*worker);

  ASSERT_TRUE(Signal(*worker, SIGSTOP));
  for (uint64_t version = 2; version <= 5; ++version) ASSERT_TRUE(Publish(*publisher, version));
  ASSERT_TRUE(Signal(*worker, SIGCONT));

  ASSERT_TRUE(WaitStatus(*worker, "catching up to v5", Serves(5, lineage_.Hex(5))));
  const json after = StatusOrEmpty(*worker);
  // Four deltas, no keyframe.
  const uint64_t fetched = U64(after, "piece_bytes") - U64(before, "piece_bytes");
  EXPECT_LT(fetched, keyframe_bytes / 4) << Brief(after);
  EXPECT_EQ(U64(after, "swaps_total") - U64(before, "swaps_total"), 4u) << Brief(after);
  EXPECT_EQ(U64(after, "artifacts_rejected"), 0u);
}

TEST_F(FleetTest, PastRetentionKeyframe) {
  // Keyframes at v1, v4, v7; after v8 only K7, D7 and D8 are retained.
  Node* publisher = StartPublisher("publisher", {"--retain", "2", "--keyframe-every", "3"});
  ASSERT_NE(publisher, nullptr);
  Node* worker = StartWorker("worker", "home", {publisher->upstream()});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));
  const uint64_t keyframe_bytes = U64(StatusOrEmpty(*publisher), "last_artifact_bytes");
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  const json before = StatusOrEmpty(*worker);

  ASSERT_TRUE(Signal(*worker, SIGSTOP));
  for (uint64_t version = 2; version <= 8; ++version) ASSERT_TRUE(Publish(*publisher, version));
  EXPECT_EQ(U64(StatusOrEmpty(*publisher), "artifacts_retained"), 3u);
  ASSERT_TRUE(Signal(*worker, SIGCONT));

  ASSERT_TRUE(WaitStatus(*worker, "catching up to v8", Serves(8, lineage_.Hex(8))));
  const json after = StatusOrEmpty(*worker);
  // Through keyframe v7: the delta chain from v1 is gone.
  EXPECT_GT(U64(after, "piece_bytes") - U64(before, "piece_bytes"), keyframe_bytes / 2)
      << Brief(after);
  EXPECT_EQ(U64(after, "artifacts_rejected"), 0u) << Brief(after);
  EXPECT_EQ(U64(after, "pieces_rejected"), 0u) << Brief(after);
}

// ---- failures in transit ---------------------------------------------------------------------

TEST_F(FleetTest, RelayKilledMidTransfer) {
  uint64_t keyframe_bytes = 0;
  Node* publisher = StartPublisherWithKeyframe(&keyframe_bytes);
  ASSERT_NE(publisher, nullptr);
  // 2 MB/s from the publisher: the 6 MB keyframe takes about 3 s through the relay.
  Node* relay = StartRelay("relay-eu", "eu", {publisher->upstream()}, {"--wan-rate", "2000000"});
  ASSERT_NE(relay, nullptr);
  ASSERT_TRUE(WaitStatus(*relay, "announcing v1",
                         [](const json& s) { return U64(s, "head_version") == 1; }));

  Node* worker = StartWorker("worker", "eu", {relay->upstream(), publisher->upstream()});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(WaitStatus(*worker, "receiving pieces",
                         [](const json& s) { return U64(s, "piece_bytes") > 0; }));
  const json at_kill = StatusOrEmpty(*worker);
  KillNow(*relay);
  EXPECT_EQ(Str(at_kill, "upstream"), relay->upstream()) << Brief(at_kill);
  EXPECT_LT(U64(at_kill, "piece_bytes"), keyframe_bytes) << "the transfer was over before the kill";

  ASSERT_TRUE(WaitStatus(*worker, "serving v1 via the publisher", Serves(1, lineage_.Hex(1))));
  const json after = StatusOrEmpty(*worker);
  EXPECT_EQ(U64(after, "pieces_rejected"), 0u) << Brief(after);
  EXPECT_EQ(U64(after, "artifacts_rejected"), 0u) << Brief(after);
  // Pieces verified before the kill were kept, none fetched twice.
  EXPECT_EQ(U64(after, "piece_bytes"), keyframe_bytes) << Brief(after);
  ASSERT_TRUE(WaitStatus(*worker, "subscribed to the publisher", [&](const json& s) {
    return Str(s, "upstream") == publisher->upstream();
  }));
  // And it keeps following from there.
  ASSERT_TRUE(Publish(*publisher, 2));
  ASSERT_TRUE(WaitStatus(*worker, "serving v2", Serves(2, lineage_.Hex(2))));
}

// ---- streaming through the hops -----------------------------------------------------------

// Cut-through: a relay serves a piece to its workers as soon as it has verified it, not
// once it holds the whole artifact.
TEST_F(FleetTest, RelayForwardsPiecesBeforeItHasTheWholeArtifact) {
  uint64_t keyframe_bytes = 0;
  Node* publisher = StartPublisherWithKeyframe(&keyframe_bytes);
  ASSERT_NE(publisher, nullptr);
  // 2 MB/s into the relay: the 6 MB keyframe takes about 3 s to reach it.
  Node* relay = StartRelay("relay-eu", "eu", {publisher->upstream()}, {"--wan-rate", "2000000"});
  ASSERT_NE(relay, nullptr);
  Node* worker = StartWorker("worker", "eu", {relay->upstream()});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(WaitStatus(*worker, "receiving pieces from the relay",
                         [](const json& s) { return U64(s, "piece_bytes") >= 3 * kPieceBytes; }));
  const json relay_then = StatusOrEmpty(*relay);
  EXPECT_LT(U64(relay_then, "piece_bytes"), keyframe_bytes)
      << "the relay already held the whole keyframe: " << Brief(relay_then);
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  EXPECT_EQ(U64(StatusOrEmpty(*worker), "pieces_rejected"), 0u);
}

// A worker decodes a delta's chunks on its CPU threads while the rest of the delta is still
// arriving over a slow link, and still serves exactly the published version.
TEST_F(FleetTest, WorkerDecodesChunksWhileTheDeltaArrives) {
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  Node* worker = StartWorker("worker", "eu", {publisher->upstream()}, {"--wan-rate", "2000000"});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  for (uint64_t version = 2; version <= 3; ++version) {
    ASSERT_TRUE(Publish(*publisher, version));
    ASSERT_TRUE(WaitStatus(*worker, "serving v" + std::to_string(version),
                           Serves(version, lineage_.Hex(version))));
    const json status = StatusOrEmpty(*worker);
    EXPECT_GT(U64(status, "last_apply_chunks_early"), 0u) << Brief(status);
    EXPECT_EQ(U64(status, "artifacts_rejected"), 0u) << Brief(status);
  }
  const json publisher_status = StatusOrEmpty(*publisher);
  EXPECT_GT(U64(publisher_status, "last_artifact_bytes"), 2 * kPieceBytes)
      << "the delta fits in too few pieces to arrive piece by piece: " << Brief(publisher_status);
}

// The publisher makes each piece of a delta servable as soon as it is encoded: a worker
// fetches v2's first chunks and decodes them ahead before the publisher has finished
// encoding v2. Both sides stamp the moment (Unix microseconds, one host): the worker its
// first chunk decoded ahead, the publisher the end of its encode.
TEST_F(FleetTest, WorkerDecodesBeforeThePublisherHasFinishedEncoding) {
  // 96 MB of bf16 weights, 15% of the words changed: an encode of many chunks on one thread.
  const std::vector<TensorSpec> specs = {
      {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {4096, 4096}},
      {"model.layers.0.mlp.down_proj.weight", DType::kBF16, {4096, 4096}},
      {"model.layers.1.mlp.up_proj.weight", DType::kBF16, {4096, 4096}},
      {"model.norm.weight", DType::kF32, {4096}},
  };
  const OwnedCheckpoint v1 = RandomCheckpoint(specs, 99);
  const OwnedCheckpoint v2 = Mutate(v1, 0.15, 100, Change::kArbitrary);
  Node* publisher = StartPublisher("publisher", {"--threads", "1"});
  ASSERT_NE(publisher, nullptr);
  // One worker on the publisher, one behind a relay (which forwards each piece on).
  Node* relay = StartRelay("relay-eu", "eu", {publisher->upstream()});
  ASSERT_NE(relay, nullptr);
  Node* direct = StartWorker("worker", "home", {publisher->upstream()});
  ASSERT_NE(direct, nullptr);
  Node* relayed = StartWorker("worker-eu", "eu", {relay->upstream()});
  ASSERT_NE(relayed, nullptr);
  ASSERT_TRUE(Drop(1, v1));
  for (Node* worker : {direct, relayed}) {
    ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, HashOf(v1).ToHex())));
  }
  ASSERT_TRUE(Drop(2, v2));
  for (Node* worker : {direct, relayed}) {
    ASSERT_TRUE(WaitStatus(*worker, "serving v2", Serves(2, HashOf(v2).ToHex())));
  }
  const json pub = StatusOrEmpty(*publisher);
  EXPECT_EQ(U64(StatusOrEmpty(*relay), "fetch_failures"), 0u);
  for (Node* worker : {direct, relayed}) {
    SCOPED_TRACE(worker == direct ? "the worker on the publisher" : "the worker behind the relay");
    const json work = StatusOrEmpty(*worker);
    EXPECT_GT(pub.value("last_first_piece_ms", 0.0), 0.0) << Brief(pub);
    EXPECT_LT(pub.value("last_first_piece_ms", 0.0), pub.value("last_publish_ms", 0.0)) << Brief(pub);
    const uint64_t encoded = U64(pub, "last_encode_done_unix_us");
    const uint64_t first_decode = U64(work, "last_early_decode_unix_us");
    ASSERT_GT(encoded, 0u) << Brief(pub);
    ASSERT_GT(first_decode, 0u) << "no chunk of v2 was decoded ahead: " << Brief(work);
    EXPECT_LT(first_decode, encoded)
        << "the worker's first chunk was decoded " << (first_decode - encoded)
        << " us after the publisher finished encoding";
    std::printf("first chunk decoded ahead %.1f ms before the publisher's encode ended; first "
                "piece servable %.1f ms into a %.1f ms publish\n",
                (static_cast<double>(encoded) - static_cast<double>(first_decode)) / 1000.0,
                pub.value("last_first_piece_ms", 0.0), pub.value("last_publish_ms", 0.0));
    EXPECT_GT(U64(work, "last_apply_chunks_early"), 0u) << Brief(work);
    EXPECT_EQ(U64(work, "artifacts_rejected"), 0u) << Brief(work);
    EXPECT_EQ(U64(work, "pieces_rejected"), 0u) << Brief(work);
  }
}

// A worker that joins while an update is still streaming through a slow relay serves only
// whole, published versions at every moment it is looked at, and ends on the newest. v2
// changes half the words (an artifact of several MB, seconds on the relay's 2 MB/s link), and
// the join is shown to land mid-stream: once the late worker is connected, the relay knows
// the head is v2 and still has no whole v2.
TEST_F(FleetTest, WorkerJoiningMidStreamServesOnlyWholeVersions) {
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  Node* relay = StartRelay("relay-eu", "eu", {publisher->upstream()}, {"--wan-rate", "2000000"});
  ASSERT_NE(relay, nullptr);
  Node* early = StartWorker("worker-early", "eu", {relay->upstream()});
  ASSERT_NE(early, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));
  ASSERT_TRUE(WaitStatus(*early, "serving v1", Serves(1, lineage_.Hex(1))));
  const OwnedCheckpoint v2 = Mutate(lineage_.At(1), 0.5, 4242, Change::kArbitrary);
  const OwnedCheckpoint v3 = Mutate(v2, kChangedFraction, 4243, Change::kArbitrary);
  const std::map<uint64_t, std::string> published = {
      {1, lineage_.Hex(1)}, {2, HashOf(v2).ToHex()}, {3, HashOf(v3).ToHex()}};
  ASSERT_TRUE(Drop(2, v2));
  ASSERT_TRUE(WaitStatus(*publisher, "publishing v2", Serves(2, published.at(2))));
  ASSERT_TRUE(WaitStatus(*relay, "learning of v2", [](const json& s) {
    return U64(s, "head_version") == 2;
  }));
  Node* late = StartWorker("worker-late", "eu", {relay->upstream()});
  ASSERT_NE(late, nullptr);
  ASSERT_TRUE(WaitStatus(*late, "connecting", [](const json& s) { return s.value("connected", false); }));
  const json relay_at_join = StatusOrEmpty(*relay);  // read after the join: what it had then, or more
  ASSERT_EQ(U64(relay_at_join, "head_version"), 2u) << Brief(relay_at_join);
  ASSERT_LT(U64(relay_at_join, "version"), 2u)
      << "the join did not land mid-stream: the relay had v2 whole before the late worker "
         "connected; "
      << Brief(relay_at_join);
  std::set<uint64_t> seen;
  const auto deadline = Clock::now() + kWait;
  while (Clock::now() < deadline) {
    const json status = StatusOrEmpty(*late);
    const uint64_t version = U64(status, "version");
    if (version != 0) {
      ASSERT_TRUE(published.count(version) && version <= 2) << Brief(status);
      ASSERT_EQ(Str(status, "weights_hash"), published.at(version))
          << "a version served with other weights: " << Brief(status);
      seen.insert(version);
    }
    if (version == 2) break;
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(seen.count(2)) << "the late worker never reached v2";
  ASSERT_TRUE(Drop(3, v3));
  ASSERT_TRUE(WaitStatus(*late, "serving v3", Serves(3, published.at(3))));
}

TEST_F(FleetTest, ConnectionCutMidChunk) {
  uint64_t keyframe_bytes = 0;
  Node* publisher = StartPublisherWithKeyframe(&keyframe_bytes);
  ASSERT_NE(publisher, nullptr);
  const uint64_t pieces = (keyframe_bytes + kPieceBytes - 1) / kPieceBytes;

  FaultProxyOptions cut;
  cut.cut_after_bytes = 1500000;  // not a piece boundary: mid-frame
  FaultProxy proxy(publisher->listen.port, cut);
  ASSERT_TRUE(proxy.ok()) << proxy.error();
  Node* worker = StartWorker("worker", "home", {"127.0.0.1:" + std::to_string(proxy.port())});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  EXPECT_EQ(proxy.cuts(), 1);
  EXPECT_GT(proxy.connections(), 5) << "no data stream reconnected after the cut";

  const json status = StatusOrEmpty(*worker);
  // Verified pieces are never fetched again; only requests in flight on the cut stream are
  // repeated.
  EXPECT_EQ(U64(status, "piece_bytes"), keyframe_bytes) << Brief(status);
  EXPECT_EQ(U64(status, "pieces_verified"), pieces) << Brief(status);
  EXPECT_EQ(U64(status, "pieces_rejected"), 0u) << Brief(status);
  EXPECT_GE(U64(status, "piece_requests"), pieces) << Brief(status);
  EXPECT_LE(U64(status, "piece_requests"), pieces + 4 * 8) << Brief(status);
}

TEST_F(FleetTest, RelayFlipsAByte) {
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));

  FaultProxyOptions corrupt;
  corrupt.corrupt_pieces = 3;
  FaultProxy proxy(publisher->listen.port, corrupt);
  ASSERT_TRUE(proxy.ok()) << proxy.error();
  Node* worker = StartWorker("worker", "home", {"127.0.0.1:" + std::to_string(proxy.port())});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  ASSERT_TRUE(Publish(*publisher, 2));
  ASSERT_TRUE(WaitStatus(*worker, "serving v2", Serves(2, lineage_.Hex(2))));

  EXPECT_EQ(proxy.corrupted(), 3);
  const json status = StatusOrEmpty(*worker);
  // Every damaged piece was caught by its checksum and fetched again; no artifact failed.
  EXPECT_EQ(U64(status, "pieces_rejected"), static_cast<uint64_t>(proxy.corrupted()))
      << Brief(status);
  EXPECT_EQ(U64(status, "artifacts_rejected"), 0u) << Brief(status);
}

// ---- what the publisher accepts ---------------------------------------------------------------

TEST_F(FleetTest, ReplayedOldVersion) {
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  std::vector<Node*> workers;
  for (int i = 0; i < 2; ++i) {
    workers.push_back(StartWorker("worker-" + std::to_string(i), "home", {publisher->upstream()}));
    ASSERT_NE(workers.back(), nullptr);
  }
  for (uint64_t version = 1; version <= 3; ++version) ASSERT_TRUE(Publish(*publisher, version));
  for (Node* worker : workers)
    ASSERT_TRUE(WaitStatus(*worker, "serving v3", Serves(3, lineage_.Hex(3))));

  // A replay of v2, and a v3 with other content.
  ASSERT_TRUE(Drop(2, lineage_.At(2)));
  ASSERT_TRUE(Drop(3, lineage_.Impostor(3)));
  const auto still_v3 = Serves(3, lineage_.Hex(3));
  EXPECT_TRUE(Holds(*publisher, "serving v3", still_v3, 1500ms));
  for (Node* worker : workers) EXPECT_TRUE(Holds(*worker, "serving v3", still_v3, 200ms));

  // The publisher is not wedged: the next version goes out.
  ASSERT_TRUE(Publish(*publisher, 4));
  for (Node* worker : workers)
    ASSERT_TRUE(WaitStatus(*worker, "serving v4", Serves(4, lineage_.Hex(4))));

  // publisher.h: a drop whose version is not above the last published is rejected with a
  // logged reason and listed in /v1/status.
  const json status = StatusOrEmpty(*publisher);
  std::set<uint64_t> rejected;
  for (const json& drop : status.value("rejected_drops", json::array())) {
    const uint64_t version = U64(drop, "version");
    rejected.insert(version);
    EXPECT_NE(Str(drop, "reason").find(std::to_string(version)), std::string::npos) << drop.dump();
  }
  EXPECT_EQ(rejected, (std::set<uint64_t>{2, 3})) << Brief(status);
  EXPECT_GE(U64(status, "drops_rejected"), 2u);
}

TEST_F(FleetTest, MalformedDrop) {
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  Node* worker = StartWorker("worker", "home", {publisher->upstream()});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));

  // v2: a truncated file, committed.
  ASSERT_TRUE(Drop(2, lineage_.At(2), /*commit=*/false));
  const fs::path truncated = watch_ / "2" / "model.safetensors";
  fs::resize_file(truncated, fs::file_size(truncated) / 2);
  ASSERT_TRUE(WriteText(watch_ / "2" / "COMMIT", ""));
  // v3: not a safetensors file at all.
  fs::create_directories(watch_ / "3");
  ASSERT_TRUE(WriteText(watch_ / "3" / "model.safetensors", "this is not a checkpoint\n"));
  ASSERT_TRUE(WriteText(watch_ / "3" / "COMMIT", ""));
  // v5: complete but never committed: not read at all.
  ASSERT_TRUE(Drop(5, lineage_.At(5), /*commit=*/false));

  ASSERT_TRUE(WaitStatus(*publisher, "rejecting v2 and v3",
                         [](const json& s) { return U64(s, "drops_rejected") >= 2; }));
  const json status = StatusOrEmpty(*publisher);
  EXPECT_TRUE(Serves(1, lineage_.Hex(1))(status)) << Brief(status);
  std::map<uint64_t, std::string> reasons;
  for (const json& drop : status["rejected_drops"])
    reasons[U64(drop, "version")] = Str(drop, "reason");
  ASSERT_EQ(reasons.size(), 2u) << Brief(status);
  for (const uint64_t version : {2, 3}) {
    const std::string& reason = reasons[version];
    EXPECT_NE(reason.find((watch_ / std::to_string(version)).string()), std::string::npos)
        << "the reason should name the drop: " << reason;
    EXPECT_NE(reason.find("model.safetensors"), std::string::npos) << reason;
  }
  EXPECT_NE(Output(*publisher).find("rejected drop"), std::string::npos);
  EXPECT_TRUE(Holds(*worker, "serving v1", Serves(1, lineage_.Hex(1)), 500ms));
  EXPECT_TRUE(Holds(
      *publisher, "ignoring uncommitted v5",
      [](const json& s) { return U64(s, "version") == 1 && U64(s, "drops_rejected") == 2; },
      500ms));

  // The next good drop goes out; v5 is never read (committing it later is too late).
  ASSERT_TRUE(Drop(4, lineage_.At(4)));
  ASSERT_TRUE(WaitStatus(*publisher, "publishing v4", Serves(4, lineage_.Hex(4))));
  ASSERT_TRUE(WaitStatus(*worker, "serving v4", Serves(4, lineage_.Hex(4))));
}

// ---- authentication ------------------------------------------------------------------------

TEST_F(FleetTest, WrongOrMissingToken) {
  const std::string token = "s3cret";
  Node* publisher = StartPublisher("publisher", {"--token", token});
  ASSERT_NE(publisher, nullptr);
  publisher->token = token;
  Node* relay = StartRelay("relay-eu", "eu", {publisher->upstream()}, {"--token", token});
  ASSERT_NE(relay, nullptr);
  relay->token = token;
  Node* worker = StartWorker("worker", "eu", {relay->upstream()}, {"--token", token});
  ASSERT_NE(worker, nullptr);
  worker->token = token;
  // Wrong and missing tokens, at the publisher and at the relay.
  Node* wrong_at_publisher =
      StartWorker("wrong-at-publisher", "home", {publisher->upstream()}, {"--token", "not-it"});
  Node* missing_at_publisher = StartWorker("missing-at-publisher", "home", {publisher->upstream()});
  Node* wrong_at_relay =
      StartWorker("wrong-at-relay", "eu", {relay->upstream()}, {"--token", "not-it"});
  ASSERT_NE(wrong_at_publisher, nullptr);
  ASSERT_NE(missing_at_publisher, nullptr);
  ASSERT_NE(wrong_at_relay, nullptr);
  wrong_at_publisher->token = wrong_at_relay->token = "not-it";

  ASSERT_TRUE(Publish(*publisher, 1));
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  for (Node* refused : {wrong_at_publisher, missing_at_publisher, wrong_at_relay}) {
    EXPECT_TRUE(Holds(
        *refused, "unsubscribed at v0",
        [](const json& s) {
          return U64(s, "version") == 0 && s.value("connected", true) == false &&
                 Str(s, "upstream").empty();
        },
        300ms));
  }
  EXPECT_NE(Output(*publisher).find("wrong token"), std::string::npos);
  EXPECT_NE(Output(*publisher).find("missing token"), std::string::npos);
  EXPECT_NE(Output(*relay).find("wrong token"), std::string::npos);
  const json publisher_status = StatusOrEmpty(*publisher);
  for (const json& node : publisher_status["nodes"]) {
    EXPECT_TRUE(Str(node, "node_id") == "relay-eu" || Str(node, "node_id") == "worker")
        << node.dump();
  }

  // Every route of every role: /healthz is public, the rest need the token.
  for (Node* node : {publisher, relay, worker}) {
    for (const std::string route : {"/v1/status", "/metrics"}) {
      for (const auto& [presented, expected] : std::vector<std::pair<std::string, int>>{
               {"", 401}, {"not-it", 401}, {token + "x", 401}, {token, 200}}) {
        Result<transport::HttpResponse> response = Get(*node, route, presented);
        ASSERT_TRUE(response.ok()) << node->name << route << ": " << response.status().ToString();
        EXPECT_EQ(response->status, expected)
            << node->name << " " << route << " with token '" << presented << "'";
      }
    }
    Result<transport::HttpResponse> health = Get(*node, "/healthz", "");
    ASSERT_TRUE(health.ok()) << health.status().ToString();
    EXPECT_EQ(health->status, 200) << node->name;
    Result<transport::HttpResponse> metrics = Get(*node, "/metrics", token);
    ASSERT_TRUE(metrics.ok());
    EXPECT_NE(metrics->body.find("flywheel_version{"), std::string::npos) << metrics->body;
  }
}

TEST_F(FleetTest, TlsMutualAuth) {
  const fs::path certs = dir_ / "certs";
  const std::optional<ops::Completion> made_certs = Run({"certs", "--out", certs.string()});
  ASSERT_TRUE(made_certs.has_value());
  ASSERT_EQ(made_certs->exit_code, 0) << made_certs->out << made_certs->err;
  auto file = [&](const char* name) { return (certs / name).string(); };

  Node* publisher = StartPublisher("publisher", {"--tls-cert", file("server.crt"), "--tls-key",
                                                 file("server.key"), "--tls-ca", file("ca.crt")});
  ASSERT_NE(publisher, nullptr);
  // Status over HTTPS: the publisher requires a client certificate there too.
  Result<std::shared_ptr<asio::ssl::context>> client_tls =
      transport::MakeClientTlsContext({file("client.crt"), file("client.key"), file("ca.crt")});
  ASSERT_TRUE(client_tls.ok()) << client_tls.status().ToString();
  publisher->tls = *client_tls;
  ASSERT_TRUE(Publish(*publisher, 1));

  Node* worker = StartWorker("worker", "home", {publisher->upstream()},
                             {"--tls-cert", file("client.crt"), "--tls-key", file("client.key"),
                              "--tls-ca", file("ca.crt")});
  ASSERT_NE(worker, nullptr);
  // A relay and a worker behind it, with the node certificate (it serves and dials), all
  // mutually authenticated.
  const std::vector<std::string> node_tls = {"--tls-cert", file("server.crt"),
                                             "--tls-key",  file("server.key"),
                                             "--tls-ca",   file("ca.crt")};
  Node* relay = StartRelay("relay-eu", "eu", {publisher->upstream()}, node_tls);
  ASSERT_NE(relay, nullptr);
  relay->tls = *client_tls;
  Node* eu_worker = StartWorker("worker-eu", "eu", {relay->upstream()}, node_tls);
  ASSERT_NE(eu_worker, nullptr);
  eu_worker->tls = *client_tls;
  ASSERT_TRUE(
      WaitStatus(*eu_worker, "serving v1 through the TLS relay", Serves(1, lineage_.Hex(1))));
  // A client certificate from a CA the publisher does not trust.
  Node* rogue = StartWorker("rogue", "home", {publisher->upstream()},
                            {"--tls-cert", file("rogue.crt"), "--tls-key", file("rogue.key"),
                             "--tls-ca", file("ca.crt")});
  ASSERT_NE(rogue, nullptr);
  // No certificate at all: a worker is a TLS server too (its HTTP endpoint), so it refuses
  // to start rather than run half-configured.
  Node& no_cert =
      SpawnWorker("no-cert", "home", {publisher->upstream()}, {"--tls-ca", file("ca.crt")});
  EXPECT_NE(WaitExit(no_cert), 0);
  EXPECT_NE(Output(no_cert).find("--tls-cert"), std::string::npos) << Tail(no_cert, 5);

  // The worker's sync is seen from the publisher (the worker's own HTTPS endpoint presents
  // client.crt, which a verifying client does not accept as a server certificate).
  ASSERT_TRUE(WaitStatus(*publisher, "seeing the worker at v1", [](const json& s) {
    for (const json& node : s.value("nodes", json::array())) {
      if (Str(node, "node_id") == "worker" && U64(node, "version") == 1) return true;
    }
    return false;
  }));
  ASSERT_TRUE(Publish(*publisher, 2));
  ASSERT_TRUE(WaitStatus(*publisher, "seeing the worker at v2", [](const json& s) {
    std::set<std::string> ids;
    for (const json& node : s.value("nodes", json::array())) {
      if (U64(node, "version") == 2) ids.insert(Str(node, "node_id"));
    }
    return ids.count("worker") == 1 && ids.count("worker-eu") == 1 && ids.count("rogue") == 0;
  }));
  ASSERT_TRUE(
      WaitStatus(*eu_worker, "serving v2 through the TLS relay", Serves(2, lineage_.Hex(2))));
  EXPECT_NE(Output(*publisher).find("TLS handshake with"), std::string::npos);

  // HTTPS: with the client certificate 200, without one no answer at all; plain HTTP to a
  // TLS endpoint does not get through either.
  Result<transport::HttpResponse> with_cert = Get(*publisher, "/v1/status", "");
  ASSERT_TRUE(with_cert.ok()) << with_cert.status().ToString();
  EXPECT_EQ(with_cert->status, 200);
  Result<std::shared_ptr<asio::ssl::context>> ca_only =
      transport::MakeClientTlsContext({"", "", file("ca.crt")});
  ASSERT_TRUE(ca_only.ok());
  transport::HttpGetOptions no_client_cert;
  no_client_cert.tls = *ca_only;
  no_client_cert.timeout = 2s;
  Result<transport::HttpResponse> without_cert =
      transport::HttpGet(publisher->http, "/v1/status", no_client_cert);
  EXPECT_FALSE(without_cert.ok() && without_cert->status == 200);
  transport::HttpGetOptions plain;
  plain.timeout = 2s;
  Result<transport::HttpResponse> over_plain =
      transport::HttpGet(publisher->http, "/v1/status", plain);
  EXPECT_FALSE(over_plain.ok() && over_plain->status == 200);
  Result<transport::HttpResponse> worker_status = Get(*worker, "/healthz", "");
  if (!worker_status.ok()) {
    // Documented, not asserted: see the comment above.
    std::cerr << "note: worker HTTPS with the CA: " << worker_status.status().ToString() << "\n";
  }
}

// ---- restarts and exports ------------------------------------------------------------------

TEST_F(FleetTest, PublisherRestart) {
  // A fixed port (FreePort's race accepted): the restarted publisher must come back on it.
  std::string listen;
  Node* publisher = nullptr;
  Node* worker = nullptr;
  ASSERT_TRUE(StartOnAFixedPort(&listen, &publisher, &worker));
  for (uint64_t version = 1; version <= 3; ++version) ASSERT_TRUE(Publish(*publisher, version));
  ASSERT_TRUE(WaitStatus(*worker, "serving v3", Serves(3, lineage_.Hex(3))));

  const int stopped = Stop(*publisher);
  EXPECT_TRUE(WIFEXITED(stopped) && WEXITSTATUS(stopped) == 0)
      << publisher->name << " " << ops::DescribeWaitStatus(stopped);
  // Same state directory, same port.
  Node* restarted = StartPublisher("publisher", {}, listen);
  ASSERT_NE(restarted, nullptr);
  json status = StatusOrEmpty(*restarted);
  EXPECT_TRUE(Serves(3, lineage_.Hex(3))(status)) << Brief(status);
  EXPECT_EQ(U64(status, "last_version"), 3u);
  EXPECT_TRUE(Holds(*worker, "serving v3", Serves(3, lineage_.Hex(3)), 300ms));

  // v3 is never reused, even with the drop rewritten after the restart.
  ASSERT_TRUE(Drop(3, lineage_.Impostor(3)));
  EXPECT_TRUE(Holds(*restarted, "serving the original v3", Serves(3, lineage_.Hex(3)), 1000ms));

  ASSERT_TRUE(Publish(*restarted, 4));
  ASSERT_TRUE(WaitStatus(*worker, "serving v4 after reconnecting", Serves(4, lineage_.Hex(4))));
  Node* late = StartWorker("worker-late", "home", {listen});
  ASSERT_NE(late, nullptr);
  ASSERT_TRUE(WaitStatus(*late, "serving v4", Serves(4, lineage_.Hex(4))));
  status = StatusOrEmpty(*restarted);
  EXPECT_EQ(U64(status, "published_total"), 1u) << Brief(status);
}

// The versions log.json names (its artifacts' target versions); empty if it cannot be read.
std::set<uint64_t> LoggedVersions(const fs::path& state) {
  std::ifstream log_file(state / "log.json");
  const json log = json::parse(log_file, nullptr, /*allow_exceptions=*/false);
  std::set<uint64_t> versions;
  if (!log.is_object()) return versions;
  for (const json& artifact : log.value("artifacts", json::array())) {
    versions.insert(artifact.value("target_version", uint64_t{0}));
  }
  return versions;
}

// A publisher killed at any point of an update (SIGKILL 0, 12, 24 and 36 ms after the
// drop's COMMIT, so that kills land while it validates, encodes or writes, or after it
// committed) leaves nothing that is not whole: restarted on the same state it serves the
// version it last committed or the new one, never anything else, keeps no artifact its log
// does not name, and publishes the drop; the worker follows every time. At least one kill
// must land mid-update, shown by the publisher itself: its status reported the version's
// delta streaming (encoded piece by piece) just before the kill, and the log it left does
// not name the version. When none of the four timed kills did, more versions are dropped
// and each killed as soon as it streams, up to version 12; none landing fails the test.
TEST_F(FleetTest, PublisherKilledMidUpdateRecovers) {
  std::string listen;
  Node* publisher = nullptr;
  Node* worker = nullptr;
  ASSERT_TRUE(StartOnAFixedPort(&listen, &publisher, &worker));
  ASSERT_TRUE(Publish(*publisher, 1));
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  const fs::path state = StateDir("publisher");
  std::vector<uint64_t> killed_mid_update;
  for (uint64_t version = 2; version <= 5 || (killed_mid_update.empty() && version <= 12);
       ++version) {
    ASSERT_TRUE(Drop(version, lineage_.At(version)));
    const auto streams = [version](const json& s) { return U64(s, "streaming_version") == version; };
    bool streaming = false;
    if (version <= 5) {
      std::this_thread::sleep_for(std::chrono::milliseconds(12 * (version - 2)));
      streaming = streams(StatusOrEmpty(*publisher));
    } else {
      streaming = ops::WaitUntil([&] { return streams(StatusOrEmpty(*publisher)); }, 5s,
                                 "v" + std::to_string(version) + " to stream", 1ms)
                      .ok();
    }
    KillNow(*publisher);
    if (streaming && !LoggedVersions(state).count(version)) killed_mid_update.push_back(version);
    publisher = StartPublisher("publisher", {}, listen);
    ASSERT_NE(publisher, nullptr);
    const json status = StatusOrEmpty(*publisher);
    const uint64_t head = U64(status, "version");
    ASSERT_TRUE(head == version - 1 || head == version) << Brief(status);
    EXPECT_TRUE(Serves(head, lineage_.Hex(head))(status)) << Brief(status);
    ASSERT_TRUE(WaitStatus(*publisher, "publishing v" + std::to_string(version),
                           Serves(version, lineage_.Hex(version))));
    ASSERT_TRUE(WaitStatus(*worker, "serving v" + std::to_string(version),
                           Serves(version, lineage_.Hex(version))));
    // Every artifact file is one the log names (a kill's partial file was removed).
    std::ifstream log_file(state / "log.json");
    const json log = json::parse(log_file, nullptr, /*allow_exceptions=*/false);
    std::set<std::string> named;
    for (const json& artifact : log.value("artifacts", json::array())) {
      named.insert(fs::path(artifact.value("file", "")).filename().string());
    }
    for (const auto& entry : fs::directory_iterator(state / "artifacts")) {
      EXPECT_TRUE(named.count(entry.path().filename().string()))
          << entry.path() << " is not in the log after the kill at v" << version;
    }
    EXPECT_EQ(U64(StatusOrEmpty(*worker), "artifacts_rejected"), 0u);
  }
  ASSERT_FALSE(killed_mid_update.empty())
      << "no kill landed mid-update (while the publisher streamed the version, before its log "
         "named it): the test did not exercise its scenario";
  std::printf("kills that landed mid-update: %zu (first at v%llu)\n", killed_mid_update.size(),
              static_cast<unsigned long long>(killed_mid_update.front()));
}

TEST_F(FleetTest, ExportDir) {
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  const fs::path exports = dir_ / "exports";
  Node* worker =
      StartWorker("worker", "home", {publisher->upstream()}, {"--export-dir", exports.string()});
  ASSERT_NE(worker, nullptr);
  auto listing = [&] {
    std::set<std::string> names;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(exports, ec))
      names.insert(entry.path().filename());
    return names;
  };

  for (uint64_t version = 1; version <= 2; ++version) ASSERT_TRUE(Publish(*publisher, version));
  ASSERT_TRUE(WaitStatus(*worker, "exporting v2", [&](const json& s) {
    return Serves(2, lineage_.Hex(2))(s) && U64(s, "exports_total") >= 2;
  }));
  // Written under a temporary name, then renamed: nothing else is ever left there.
  EXPECT_EQ(listing(), (std::set<std::string>{"v1.safetensors", "v2.safetensors"}));
  const fs::path v2 = exports / "v2.safetensors";
  Result<Checkpoint> exported = Checkpoint::Open(v2.string());
  ASSERT_TRUE(exported.ok()) << exported.status().ToString();
  Result<Hash128> hash = CheckpointHash(exported->tensors());
  ASSERT_TRUE(hash.ok());
  EXPECT_EQ(hash->ToHex(), lineage_.Hex(2));
  EXPECT_EQ(exported->metadata().count("flywheel_version")
                ? exported->metadata().at("flywheel_version")
                : "",
            "2");
  const std::optional<ops::Completion> hashed = Run({"checkpoint", "hash", v2.string()});
  ASSERT_TRUE(hashed.has_value());
  ASSERT_EQ(hashed->exit_code, 0) << hashed->out << hashed->err;
  EXPECT_NE((hashed->out + hashed->err).find(lineage_.Hex(2) + "  " + v2.string()),
            std::string::npos)
      << hashed->out << hashed->err;

  // --export-keep 2 (the default): v1 goes when v3 arrives.
  ASSERT_TRUE(Publish(*publisher, 3));
  ASSERT_TRUE(WaitStatus(*worker, "exporting v3", [&](const json& s) {
    return Serves(3, lineage_.Hex(3))(s) && U64(s, "exports_total") >= 3;
  }));
  EXPECT_EQ(listing(), (std::set<std::string>{"v2.safetensors", "v3.safetensors"}));
}

// ---- signed versions ------------------------------------------------------------------------

// `flywheel keys generate` for `name` under the test directory; the public key's path.
std::string PublicKeyOf(const fs::path& dir) { return (dir / "signing.pub").string(); }
std::string PrivateKeyOf(const fs::path& dir) { return (dir / "signing.key").string(); }

TEST_F(FleetTest, SignedVersionsThroughARelayAndKeyRotation) {
  const fs::path old_keys = dir_ / "keys-old", new_keys = dir_ / "keys-new";
  for (const fs::path& keys : {old_keys, new_keys}) {
    std::optional<ops::Completion> generated = Run({"keys", "generate", "--out", keys.string()});
    ASSERT_TRUE(generated);
    ASSERT_EQ(generated->exit_code, 0) << (generated->out + generated->err);
    EXPECT_NE((generated->out + generated->err).find("key id "), std::string::npos) << (generated->out + generated->err);
  }
  // Generating again refuses to overwrite.
  std::optional<ops::Completion> again = Run({"keys", "generate", "--out", old_keys.string()});
  ASSERT_TRUE(again);
  EXPECT_EQ(again->exit_code, 1);
  EXPECT_NE((again->out + again->err).find("refusing to overwrite"), std::string::npos) << (again->out + again->err);

  Node* publisher = StartPublisher("publisher", {"--signing-key", PrivateKeyOf(old_keys)});
  ASSERT_NE(publisher, nullptr);
  const std::vector<std::string> trust_both = {"--trust-key", PublicKeyOf(old_keys), "--trust-key",
                                               PublicKeyOf(new_keys)};
  Node* relay = StartRelay("relay", "eu", {publisher->upstream()}, trust_both);
  ASSERT_NE(relay, nullptr);
  Node* worker = StartWorker("worker", "eu", {relay->upstream()}, trust_both);
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));
  ASSERT_TRUE(Publish(*publisher, 2));
  ASSERT_TRUE(WaitStatus(*worker, "serving the signed v2", Serves(2, lineage_.Hex(2))));
  const json signed_status = StatusOrEmpty(*publisher);
  const std::string run_id = Str(signed_status, "run_id");
  EXPECT_EQ(run_id.size(), 16u) << Brief(signed_status);
  EXPECT_FALSE(Str(signed_status, "signing_key_id").empty());
  json worker_status = StatusOrEmpty(*worker);
  EXPECT_EQ(Str(worker_status, "run_id"), run_id);
  EXPECT_EQ(U64(worker_status, "signature_failures_total"), 0u) << Brief(worker_status);
  EXPECT_EQ(U64(worker_status, "trusted_keys"), 2u);

  // Rotation: the publisher restarts with the new key on the same state directory. Every
  // retained artifact is signed again by it; the run id stays.
  ASSERT_EQ(Stop(*publisher), 0);
  publisher = StartPublisher("publisher", {"--signing-key", PrivateKeyOf(new_keys)},
                             publisher->listen.ToString());
  ASSERT_NE(publisher, nullptr);
  EXPECT_EQ(Str(StatusOrEmpty(*publisher), "run_id"), run_id);
  ASSERT_TRUE(Publish(*publisher, 3));
  ASSERT_TRUE(WaitStatus(*worker, "serving v3 signed by the new key", Serves(3, lineage_.Hex(3))));
  // A worker that trusts only the old key refuses everything now; one that trusts only the
  // new key joins.
  Node* old_only = StartWorker("old-only", "eu", {relay->upstream()}, {"--trust-key", PublicKeyOf(old_keys)});
  Node* new_only = StartWorker("new-only", "eu", {relay->upstream()}, {"--trust-key", PublicKeyOf(new_keys)});
  ASSERT_NE(old_only, nullptr);
  ASSERT_NE(new_only, nullptr);
  ASSERT_TRUE(WaitStatus(*new_only, "joining at v3", Serves(3, lineage_.Hex(3))));
  ASSERT_TRUE(WaitStatus(*old_only, "refusing versions signed by the new key", [](const json& s) {
    return U64(s, "signature_failures_total") >= 1;
  }));
  EXPECT_TRUE(Holds(*old_only, "serving nothing", [](const json& s) { return U64(s, "version") == 0; }, 300ms));
  EXPECT_NE(Str(StatusOrEmpty(*old_only), "last_signature_error").find("not trusted"), std::string::npos);
  // Refusals are Prometheus counters.
  Result<transport::HttpResponse> metrics = Get(*old_only, "/metrics", "");
  ASSERT_TRUE(metrics.ok());
  EXPECT_NE(metrics->body.find("flywheel_signature_failures_total{"), std::string::npos) << metrics->body;
}

TEST_F(FleetTest, AnUnsignedPublisherIsRefusedByNodesThatRequireSignatures) {
  const fs::path keys = dir_ / "keys";
  std::optional<ops::Completion> generated = Run({"keys", "generate", "--out", keys.string()});
  ASSERT_TRUE(generated && generated->exit_code == 0);
  Node* publisher = StartPublisher("publisher");  // no --signing-key
  ASSERT_NE(publisher, nullptr);
  // The relay verifies before it caches or forwards: the worker behind it, which checks
  // nothing itself, is never offered the unsigned versions.
  Node* relay = StartRelay("relay", "eu", {publisher->upstream()}, {"--trust-key", PublicKeyOf(keys)});
  ASSERT_NE(relay, nullptr);
  Node* trusting = StartWorker("trusting", "home", {publisher->upstream()}, {"--trust-key", PublicKeyOf(keys)});
  Node* behind_relay = StartWorker("behind-relay", "eu", {relay->upstream()});
  ASSERT_NE(trusting, nullptr);
  ASSERT_NE(behind_relay, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));
  for (Node* node : {trusting, relay}) {
    ASSERT_TRUE(WaitStatus(*node, "refusing the unsigned v1",
                           [](const json& s) { return U64(s, "signature_failures_total") >= 1; }));
    EXPECT_NE(Str(StatusOrEmpty(*node), "last_signature_error").find("unsigned"), std::string::npos);
  }
  EXPECT_TRUE(Holds(*trusting, "serving nothing", [](const json& s) { return U64(s, "version") == 0; }, 300ms));
  const json relay_status = StatusOrEmpty(*relay);
  EXPECT_EQ(U64(relay_status, "cache_bytes"), 0u) << Brief(relay_status);
  EXPECT_EQ(U64(relay_status, "piece_requests"), 0u) << Brief(relay_status);
  const json behind = StatusOrEmpty(*behind_relay);
  EXPECT_EQ(U64(behind, "version"), 0u) << Brief(behind);
  EXPECT_EQ(U64(behind, "head_version"), 0u) << Brief(behind);

  // Bad key files stop a node at startup with the reason.
  std::optional<ops::Completion> missing = Run(
      {"worker", "--region", "eu", "--upstream", relay->upstream(), "--http", "127.0.0.1:0",
       "--trust-key", (dir_ / "nope.pub").string()});
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->exit_code, 1);
  EXPECT_NE((missing->out + missing->err).find("nope.pub"), std::string::npos) << (missing->out + missing->err);
  fs::permissions(keys / "signing.key", fs::perms::group_read | fs::perms::others_read,
                  fs::perm_options::add);
  std::optional<ops::Completion> open_key =
      Run({"publish", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state-dir",
           (dir_ / "other.state").string(), "--watch", watch_.string(), "--signing-key",
           PrivateKeyOf(keys)});
  ASSERT_TRUE(open_key);
  EXPECT_EQ(open_key->exit_code, 1);
  EXPECT_NE((open_key->out + open_key->err).find("chmod 600"), std::string::npos) << (open_key->out + open_key->err);
}

TEST_F(FleetTest, ScopedTokensFromFilesPerRouteAndNeverLogged) {
  // Tokens only from files (or the environment): none is on a command line.
  const std::map<std::string, std::string> tokens = {{"fleet", "fleet-Z8q2v"},
                                                     {"push", "push-Kd81x"},
                                                     {"dashboard", "dash-Yy3o0"},
                                                     {"rollout", "roll-Qq7e4"},
                                                     {"ops", "ops-Hh5t2"}};
  for (const auto& [name, token] : tokens) ASSERT_TRUE(WriteText(dir_ / (name + ".token"), token + "\n"));
  // Token files must be private to their owner (CheckPrivateFile, base/env.h).
  for (const auto& [name, token] : tokens) fs::permissions(dir_ / (name + ".token"), fs::perms::owner_read | fs::perms::owner_write);
  auto file = [&](const std::string& name) { return (dir_ / (name + ".token")).string(); };
  const std::vector<std::string> scoped = {"--scoped-token-file", "read:" + file("dashboard"),
                                           "--scoped-token-file", "submit:" + file("rollout")};
  std::vector<std::string> publisher_args = {"--token-file", file("fleet"), "--push-token-file",
                                             file("push"), "--scoped-token-file",
                                             "admin,read:" + file("ops")};
  publisher_args.insert(publisher_args.end(), scoped.begin(), scoped.end());
  Node* publisher = StartPublisher("publisher", publisher_args);
  ASSERT_NE(publisher, nullptr);
  std::vector<std::string> worker_args = {"--token-file", file("fleet")};
  worker_args.insert(worker_args.end(), scoped.begin(), scoped.end());
  Node* worker = StartWorker("worker", "home", {publisher->upstream()}, worker_args);
  ASSERT_NE(worker, nullptr);
  publisher->token = worker->token = tokens.at("fleet");
  ASSERT_TRUE(Publish(*publisher, 1));
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  // (token, status of GET /v1/status and /metrics): a rollout worker's submit-only token
  // reads nothing; unknown and missing ones are 401.
  for (Node* node : {publisher, worker}) {
    for (const auto& [presented, expected] : std::vector<std::pair<std::string, int>>{
             {"", 401}, {"nope", 401}, {tokens.at("dashboard"), 200}, {tokens.at("rollout"), 403},
             {tokens.at("fleet"), 200}}) {
      for (const char* route : {"/v1/status", "/metrics"}) {
        Result<transport::HttpResponse> got = Get(*node, route, presented);
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        EXPECT_EQ(got->status, expected) << node->name << " " << route << " with '" << presented << "'";
      }
    }
  }
  // The push API: the dashboard cannot push, the pusher cannot pin (ops has admin), ops can.
  transport::HttpGetOptions as;
  as.timeout = 5s;
  auto call = [&](const std::string& method, const std::string& target, const std::string& token) {
    as.token = token;
    Result<transport::HttpResponse> answer = transport::HttpCall(publisher->http, method, target, "{\"version\": 1}", as);
    return answer.ok() ? answer->status : -1;
  };
  EXPECT_EQ(call("POST", "/v1/uploads", tokens.at("dashboard")), 403);
  EXPECT_EQ(call("POST", "/v1/pin", tokens.at("push")), 403);
  EXPECT_EQ(call("POST", "/v1/pin", tokens.at("dashboard")), 403);
  EXPECT_EQ(call("POST", "/v1/pin", ""), 401);
  EXPECT_EQ(call("POST", "/v1/pin", tokens.at("ops")), 200);
  EXPECT_EQ(call("POST", "/v1/unpin", tokens.at("ops")), 200);
  // A bad scope is a startup error naming it.
  std::optional<ops::Completion> bad = Run({"worker", "--region", "eu", "--upstream",
                                                 publisher->upstream(), "--http", "127.0.0.1:0",
                                                 "--scoped-token-file", "write:" + file("ops")});
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->exit_code, 1);
  EXPECT_NE((bad->out + bad->err).find("unknown scope 'write'"), std::string::npos) << bad->out + bad->err;
  // No token ever reaches a log.
  for (const Node& node : nodes_) {
    const std::string logs = Output(node);
    for (const auto& [name, token] : tokens) {
      EXPECT_EQ(logs.find(token), std::string::npos) << node.name << " logged the " << name << " token";
    }
  }
}

// ---- failures where operators look ------------------------------------------------------

TEST_F(FleetTest, ExportToAFullDiskShowsInStatusAndMetrics) {
  const fs::path full = dir_ / "full";
  fs::create_directories(full);
  if (::mount("tmpfs", full.c_str(), "tmpfs", 0, "size=1m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs (needs root): " << std::strerror(errno);
  }
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{full.string()};
  Node* publisher = StartPublisher("publisher");
  ASSERT_NE(publisher, nullptr);
  Node* worker = StartWorker("worker", "home", {publisher->upstream()}, {"--export-dir", full.string()});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));
  // The weights (about 6 MB) do not fit in 1 MiB: serving goes on, the failure is visible.
  ASSERT_TRUE(WaitStatus(*worker, "reporting the failed export", [&](const json& s) {
    return Serves(1, lineage_.Hex(1))(s) && U64(s, "export_failures_total") >= 1;
  }));
  const json status = StatusOrEmpty(*worker);
  EXPECT_NE(Str(status, "last_error").find("No space left on device"), std::string::npos) << Brief(status);
  EXPECT_EQ(U64(status, "exports_total"), 0u);
  Result<transport::HttpResponse> metrics = Get(*worker, "/metrics", "");
  ASSERT_TRUE(metrics.ok());
  EXPECT_NE(metrics->body.find("flywheel_export_failures_total{role=\"worker\",region=\"home\",node=\"worker\"} 1"),
            std::string::npos) << metrics->body;
  // Nothing half-written is left behind under the export's name.
  EXPECT_FALSE(fs::exists(full / "v1.safetensors"));
}

TEST_F(FleetTest, EveryRolesMetricsPassPromtool) {
  const fs::path keys = dir_ / "keys";
  std::optional<ops::Completion> generated = Run({"keys", "generate", "--out", keys.string()});
  ASSERT_TRUE(generated && generated->exit_code == 0);
  Node* publisher = StartPublisher("publisher", {"--signing-key", PrivateKeyOf(keys)});
  ASSERT_NE(publisher, nullptr);
  Node* relay = StartRelay("relay", "eu", {publisher->upstream()}, {"--trust-key", PublicKeyOf(keys)});
  ASSERT_NE(relay, nullptr);
  Node* worker = StartWorker("worker", "eu", {relay->upstream()}, {"--trust-key", PublicKeyOf(keys)});
  ASSERT_NE(worker, nullptr);
  ASSERT_TRUE(Publish(*publisher, 1));
  ASSERT_TRUE(WaitStatus(*worker, "serving v1", Serves(1, lineage_.Hex(1))));
  for (Node* node : {publisher, relay, worker}) {
    Result<transport::HttpResponse> metrics = Get(*node, "/metrics", "");
    ASSERT_TRUE(metrics.ok()) << metrics.status().ToString();
    ASSERT_EQ(metrics->status, 200);
    std::optional<std::string> complaints = flywheel::testing::PromtoolComplaints(metrics->body);
    if (!complaints) GTEST_SKIP() << "promtool is not installed (apt install prometheus)";
    EXPECT_EQ(*complaints, "") << node->name << ":\n" << metrics->body;
  }
}

// ---- crafted catalogs, in process ------------------------------------------------------------

using crafted::CraftedSource;

// A catalog entry for `bytes`, with whatever base the test says it has.
ArtifactInfo Entry(ArtifactKind kind, uint64_t base_version, Hash128 base_hash,
                   uint64_t target_version, Hash128 target_hash,
                   const std::vector<std::byte>& bytes) {
  ArtifactInfo info;
  info.kind = kind;
  info.base_version = base_version;
  info.base_hash = base_hash;
  info.target_version = target_version;
  info.target_hash = target_hash;
  info.size_bytes = bytes.size();
  info.piece_bytes = kPieceBytes;
  info.piece_hashes = PieceHashes(bytes, kPieceBytes);
  return info;
}

class CraftedUpstreamTest : public crafted::CraftedUpstreamFixture {
 protected:
  std::string Summary(const json& status) override { return Brief(status); }

  // Serves `v1` as the keyframe of version 1 (hash `hash_1`, entry in `k1`), watches the
  // worker's weights against `allowed`, and waits until the worker serves v1.
  bool ServeKeyframeV1(const OwnedCheckpoint& v1, const Hash128& hash_1,
                       std::map<uint64_t, Hash128> allowed, ArtifactInfo* k1);
};

std::vector<std::byte> EncodedKeyframe(uint64_t version, const OwnedCheckpoint& target) {
  delta::EncodeOptions options;
  options.target_version = version;
  Result<std::vector<std::byte>> bytes = delta::EncodeKeyframe(target.view(), options);
  EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
  return bytes.ok() ? std::move(*bytes) : std::vector<std::byte>{};
}

bool CraftedUpstreamTest::ServeKeyframeV1(const OwnedCheckpoint& v1, const Hash128& hash_1,
                                          std::map<uint64_t, Hash128> allowed, ArtifactInfo* k1) {
  const std::vector<std::byte> k1_bytes = EncodedKeyframe(1, v1);
  *k1 = Entry(ArtifactKind::kKeyframe, 0, {}, 1, hash_1, k1_bytes);
  source_.Put(*k1, k1_bytes);
  WatchWeights(std::move(allowed));
  Announce({*k1}, 1, hash_1);
  return WaitWorker("serving v1", Serves(1, hash_1.ToHex()));
}

std::vector<Hash128> TensorHashes(const OwnedCheckpoint& checkpoint) {
  std::vector<Hash128> hashes;
  for (const TensorView& tensor : checkpoint.view()) hashes.push_back(TensorHash(tensor));
  return hashes;
}

TEST_F(CraftedUpstreamTest, WrongBaseDelta) {
  Lineage lineage(SmallSpecs(), 77);
  const OwnedCheckpoint& a = lineage.At(1);
  const OwnedCheckpoint b = RandomCheckpoint(SmallSpecs(), 4242);  // not in the lineage
  const OwnedCheckpoint c = Mutate(b, kChangedFraction, 5, Change::kArbitrary);
  const Hash128 hash_a = HashOf(a);

  const std::vector<std::byte> k1_bytes = EncodedKeyframe(1, a);
  const ArtifactInfo k1 = Entry(ArtifactKind::kKeyframe, 0, {}, 1, hash_a, k1_bytes);
  // Delta v2: the catalog says "from v1 (A)", the bytes were encoded from B.
  delta::EncodeOptions options;
  options.base_version = 1;
  options.target_version = 2;
  Result<std::vector<std::byte>> d2_bytes = delta::Encode(b.view(), c.view(), options);
  ASSERT_TRUE(d2_bytes.ok()) << d2_bytes.status().ToString();
  const ArtifactInfo d2 = Entry(ArtifactKind::kDelta, 1, hash_a, 2, HashOf(c), *d2_bytes);
  source_.Put(k1, k1_bytes);
  source_.Put(d2, *d2_bytes);
  const OwnedCheckpoint& v3 = lineage.At(3);
  WatchWeights({{1, hash_a}, {3, HashOf(v3)}});

  Announce({k1, d2}, 2, HashOf(c));
  ASSERT_TRUE(WaitWorker("rejecting delta v2",
                         [](const json& s) { return U64(s, "artifacts_rejected") >= 1; }));
  // By design: the rejection must not be followed by a swap within a window.
  std::this_thread::sleep_for(300ms);
  json status = WorkerStatus();
  EXPECT_TRUE(Serves(1, hash_a.ToHex())(status)) << Brief(status);
  EXPECT_NE(Str(status, "last_error").find("delta v2"), std::string::npos) << Brief(status);

  // The same, with a manifest that lies as well: it names A's tensor hashes as its base,
  // so only applying it shows the result is not C2. The worker must restore v1.
  const OwnedCheckpoint c2 = Mutate(b, kChangedFraction, 6, Change::kArbitrary);
  options.base_tensor_hashes = TensorHashes(a);
  Result<std::vector<std::byte>> lying_bytes = delta::Encode(b.view(), c2.view(), options);
  ASSERT_TRUE(lying_bytes.ok()) << lying_bytes.status().ToString();
  const ArtifactInfo lying = Entry(ArtifactKind::kDelta, 1, hash_a, 2, HashOf(c2), *lying_bytes);
  source_.Put(lying, *lying_bytes);
  Announce({k1, lying}, 2, HashOf(c2));
  ASSERT_TRUE(WaitWorker("rejecting the lying delta v2",
                         [](const json& s) { return U64(s, "artifacts_rejected") >= 2; }));
  std::this_thread::sleep_for(300ms);  // by design, as above
  status = WorkerStatus();
  EXPECT_TRUE(Serves(1, hash_a.ToHex())(status)) << Brief(status);

  // A good keyframe moves it on.
  const std::vector<std::byte> k3_bytes = EncodedKeyframe(3, v3);
  const ArtifactInfo k3 = Entry(ArtifactKind::kKeyframe, 0, {}, 3, HashOf(v3), k3_bytes);
  source_.Put(k3, k3_bytes);
  Announce({k1, lying, k3}, 3, HashOf(v3));
  ASSERT_TRUE(WaitWorker("serving v3", Serves(3, HashOf(v3).ToHex())));
  EXPECT_EQ(U64(WorkerStatus(), "artifacts_rejected"), 2u);

  const std::vector<std::string> violations = StopWatching();
  EXPECT_GT(samples_.load(), 0u);
  EXPECT_TRUE(violations.empty()) << violations.size()
                                  << " violations, first: " << violations.front();
  worker_->WithWeights([&](uint64_t version, const CheckpointView& weights) {
    EXPECT_EQ(version, 3u);
    Result<Hash128> hash = CheckpointHash(weights);
    ASSERT_TRUE(hash.ok());
    EXPECT_EQ(*hash, HashOf(v3));
  });
}

using flywheel::testing::BytesSink;

std::vector<std::byte> StreamedDelta(const OwnedCheckpoint& base, const OwnedCheckpoint& target,
                                     uint64_t base_version, uint64_t* bound) {
  delta::EncodeOptions options;
  options.base_version = base_version;
  options.target_version = base_version + 1;
  options.chunk_bytes = 256 << 10;
  BytesSink sink;
  const Status encoded = delta::EncodeStreamed(base.view(), target.view(), options, sink);
  EXPECT_TRUE(encoded.ok()) << encoded.ToString();
  *bound = sink.bound;
  return std::move(sink.bytes);
}

// The entry a publisher announces while `finished` is still being encoded: its first
// `pieces` pieces, no target hash.
ArtifactInfo StreamingEntry(const ArtifactInfo& finished, size_t pieces, uint64_t bound) {
  ArtifactInfo partial = finished;
  partial.streaming = true;
  partial.target_hash = Hash128{};
  partial.piece_hashes.resize(pieces);
  partial.size_bytes = pieces * finished.piece_bytes;
  partial.size_bound = bound;
  return partial;
}

// A delta announced while it is still streaming (its first pieces listed, no target
// hash): the worker fetches those pieces and decodes their chunks ahead without serving
// anything new; once the finished entry comes it fetches only the rest, applies with the
// chunks decoded ahead, and serves nothing but whole versions throughout.
TEST_F(CraftedUpstreamTest, StreamingDeltaIsDecodedAheadAndAppliedOnlyWhenFinished) {
  Lineage lineage(FleetSpecs(), 79);
  const OwnedCheckpoint& v1 = lineage.At(1);
  const OwnedCheckpoint v2 = Mutate(v1, 0.1, 80, Change::kArbitrary);
  const Hash128 hash_1 = HashOf(v1), hash_2 = HashOf(v2);
  ArtifactInfo k1;
  ASSERT_TRUE(ServeKeyframeV1(v1, hash_1, {{1, hash_1}, {2, hash_2}}, &k1));

  uint64_t bound = 0;
  const std::vector<std::byte> d2_bytes = StreamedDelta(v1, v2, 1, &bound);
  const ArtifactInfo d2 = Entry(ArtifactKind::kDelta, 1, hash_1, 2, hash_2, d2_bytes);
  ASSERT_GE(d2.piece_hashes.size(), 6u) << "the delta must span several pieces";
  const size_t half = d2.piece_hashes.size() / 2;
  source_.Put(d2, d2_bytes);
  Announce({k1, StreamingEntry(d2, half, bound)}, 1, hash_1);
  ASSERT_TRUE(WaitWorker("decoding the streaming delta ahead",
                         [](const json& s) { return U64(s, "arriving_chunks_decoded") > 0; }));
  // By design: a partial delta must not be applied within a window.
  std::this_thread::sleep_for(300ms);
  json status = WorkerStatus();
  EXPECT_TRUE(Serves(1, hash_1.ToHex())(status)) << Brief(status);
  EXPECT_EQ(U64(status, "swaps_total"), 1u) << Brief(status);
  const uint64_t decoded_ahead = U64(status, "arriving_chunks_decoded");
  const uint64_t k1_pieces = k1.piece_hashes.size();
  EXPECT_EQ(U64(status, "pieces_verified"), k1_pieces + half) << Brief(status);

  Announce({k1, d2}, 2, hash_2);
  ASSERT_TRUE(WaitWorker("serving v2", Serves(2, hash_2.ToHex())));
  status = WorkerStatus();
  EXPECT_GE(U64(status, "last_apply_chunks_early"), decoded_ahead) << Brief(status);
  // The pieces fetched while it streamed are not fetched again.
  EXPECT_EQ(U64(status, "pieces_verified"), k1_pieces + d2.piece_hashes.size()) << Brief(status);
  EXPECT_EQ(U64(status, "artifacts_rejected"), 0u) << Brief(status);
  const std::vector<std::string> violations = StopWatching();
  EXPECT_GT(samples_.load(), 0u);
  EXPECT_TRUE(violations.empty()) << violations.size() << " violations, first: " << violations.front();
}

// A stream that is replaced before it finishes (the publisher died mid-encode and v2 was
// published again with other weights): the finished entry lists other pieces, and the
// worker drops what it fetched of the first stream and serves the finished v2 exactly.
TEST_F(CraftedUpstreamTest, ReplacedStreamIsDroppedNotMixedIn) {
  Lineage lineage(FleetSpecs(), 81);
  const OwnedCheckpoint& v1 = lineage.At(1);
  const OwnedCheckpoint first = Mutate(v1, 0.1, 82, Change::kArbitrary);
  const OwnedCheckpoint second = Mutate(v1, 0.1, 83, Change::kArbitrary);
  const Hash128 hash_1 = HashOf(v1), hash_2 = HashOf(second);
  ArtifactInfo k1;
  ASSERT_TRUE(ServeKeyframeV1(v1, hash_1, {{1, hash_1}, {2, hash_2}}, &k1));

  uint64_t bound_first = 0, bound_second = 0;
  const std::vector<std::byte> first_bytes = StreamedDelta(v1, first, 1, &bound_first);
  const ArtifactInfo first_entry =
      Entry(ArtifactKind::kDelta, 1, hash_1, 2, HashOf(first), first_bytes);
  source_.Put(first_entry, first_bytes);
  Announce({k1, StreamingEntry(first_entry, first_entry.piece_hashes.size() / 2, bound_first)},
           1, hash_1);
  ASSERT_TRUE(WaitWorker("decoding the first stream ahead",
                         [](const json& s) { return U64(s, "arriving_chunks_decoded") > 0; }));

  const std::vector<std::byte> second_bytes = StreamedDelta(v1, second, 1, &bound_second);
  const ArtifactInfo second_entry = Entry(ArtifactKind::kDelta, 1, hash_1, 2, hash_2, second_bytes);
  source_.Put(second_entry, second_bytes);
  Announce({k1, second_entry}, 2, hash_2);
  ASSERT_TRUE(WaitWorker("serving the finished v2", Serves(2, hash_2.ToHex())));
  const json status = WorkerStatus();
  EXPECT_EQ(U64(status, "artifacts_rejected"), 0u) << Brief(status);
  EXPECT_EQ(U64(status, "pieces_rejected"), 0u) << Brief(status);
  const std::vector<std::string> violations = StopWatching();
  EXPECT_TRUE(violations.empty()) << violations.size() << " violations, first: " << violations.front();
}

TEST_F(CraftedUpstreamTest, OlderHeadIgnored) {
  Lineage lineage(SmallSpecs(), 78);
  const Hash128 hash_1 = HashOf(lineage.At(1));
  const Hash128 hash_3 = HashOf(lineage.At(3));
  const std::vector<std::byte> k1_bytes = EncodedKeyframe(1, lineage.At(1));
  const std::vector<std::byte> k3_bytes = EncodedKeyframe(3, lineage.At(3));
  const ArtifactInfo k1 = Entry(ArtifactKind::kKeyframe, 0, {}, 1, hash_1, k1_bytes);
  const ArtifactInfo k3 = Entry(ArtifactKind::kKeyframe, 0, {}, 3, hash_3, k3_bytes);
  source_.Put(k1, k1_bytes);
  source_.Put(k3, k3_bytes);
  WatchWeights({{1, hash_1}, {3, hash_3}});

  Announce({k1, k3}, 3, hash_3);
  ASSERT_TRUE(WaitWorker("serving v3", Serves(3, hash_3.ToHex())));
  // A restarted or replayed upstream announces v1 as its head.
  Announce({k1}, 1, hash_1);
  ASSERT_TRUE(WaitWorker("ignoring head v1",
                         [](const json& s) { return U64(s, "older_heads_ignored") >= 1; }));
  // By design: the older head must not cause a swap within a window.
  std::this_thread::sleep_for(300ms);
  const json status = WorkerStatus();
  EXPECT_TRUE(Serves(3, hash_3.ToHex())(status)) << Brief(status);
  EXPECT_EQ(U64(status, "swaps_total"), 1u) << Brief(status);
  const std::vector<std::string> violations = StopWatching();
  EXPECT_TRUE(violations.empty()) << violations.size()
                                  << " violations, first: " << violations.front();
}


// This process's address space (VmSize), what GrowableBytes reserves.
uint64_t AddressSpaceBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t pages = 0;
  statm >> pages;
  return pages * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

// A catalog entry is unsigned and no trusted key is configured: its size is the
// upstream's word. One announcing ~8 TiB (130,000 pieces of 64 MiB: as many piece hashes as
// one catalog frame holds) must not make the worker reserve it.
TEST_F(CraftedUpstreamTest, AnUnsignedEntryAnnouncing8TiBReservesNothing) {
  ArtifactInfo huge;
  huge.kind = ArtifactKind::kKeyframe;
  huge.target_version = 1;
  huge.target_hash = Hash128{5, 6};
  huge.piece_bytes = uint64_t{64} << 20;
  huge.size_bytes = 130000 * huge.piece_bytes;
  for (uint64_t i = 0; i < 130000; ++i) huge.piece_hashes.push_back(i);
  source_.HoldMissing();  // whatever the worker sets aside stays set aside while we look
  const uint64_t idle = AddressSpaceBytes();
  Announce({huge}, 1, huge.target_hash);
  uint64_t most = idle;
  const auto until = Clock::now() + 3s;
  while (Clock::now() < until) {
    most = std::max(most, AddressSpaceBytes());
    std::this_thread::sleep_for(2ms);  // a sampler's pace
  }
  const double reserved_gib = static_cast<double>(most - idle) / double(1 << 30);
  std::printf("address space reserved after an unsigned %.2f TiB announcement: %.3f GiB\n",
              static_cast<double>(huge.size_bytes) / double(uint64_t{1} << 40), reserved_gib);
  EXPECT_LT(most - idle, uint64_t{1} << 30) << "the announced size was reserved";
  const json status = WorkerStatus();  // still serving its HTTP side, nothing applied
  EXPECT_EQ(U64(status, "version"), 0u) << Brief(status);
}

// ---- fleet reports from fleet-token holders ------------------------------------------------

// A publisher's sync::Server in process. Honest nodes report through sync::Upstream, as
// relays and workers do; hostile ones hold the fleet token too (none is configured here:
// anyone may connect), dial a control channel claiming whatever Hello they like, and send
// whatever Report frames they like.
class FleetReportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    io_ = std::make_unique<asio::io_context>(1);
    work_.emplace(asio::make_work_guard(*io_));
    io_thread_ = std::thread([this] { io_->run(); });
    connection_.heartbeat = 100ms;
    connection_.idle_timeout = 1000ms;
    connection_.io_timeout = 2000ms;
    ServerOptions options;
    options.listen = {"127.0.0.1", 0};
    options.identity = {wire::PUBLISHER, "home", "publisher"};
    options.listener.connection = connection_;
    Status started = Status::Ok();
    OnIo([&] {
      Result<std::unique_ptr<Server>> server =
          Server::Start(io_->get_executor(), options, &source_, &links_);
      if (server.ok()) {
        server_ = std::move(*server);
      } else {
        started = server.status();
      }
    });
    ASSERT_TRUE(started.ok()) << started.ToString();
  }

  void TearDown() override {
    OnIo([&] {
      for (auto& upstream : upstreams_) upstream->Stop();
      for (auto& connection : hostile_) connection->Close(Status::Unavailable("test done"));
      server_->Stop();
    });
    work_.reset();
    (void)ops::WaitUntil([&] { return io_->stopped(); }, 100ms,
                              "the io_context to run out of work");
    io_->stop();
    io_thread_.join();
    upstreams_.clear();
    hostile_.clear();
    server_.reset();
    io_.reset();
  }

  void OnIo(const std::function<void()>& fn) { RunOnIo(*io_, fn); }

  // An honest node: reports report() every second, as relays and workers do.
  Upstream* Subscribe(wire::Role role, const std::string& node_id,
                      std::function<wire::Report()> report) {
    UpstreamOptions options;
    options.endpoints = {{"127.0.0.1", server_->port()}};
    options.identity = {role, "eu", node_id};
    options.connection = connection_;
    upstreams_.push_back(std::make_unique<Upstream>(io_->get_executor(), options, &links_));
    Upstream* upstream = upstreams_.back().get();
    OnIo([&] {
      asio::co_spawn(io_->get_executor(), upstream->RunControl([](Catalog) {}, std::move(report)),
                     asio::detached);
    });
    return upstream;
  }

  // A hostile fleet-token holder: says it is `role` `node_id` and sends `reports`.
  void Hostile(wire::Role role, const std::string& node_id, std::vector<wire::Report> reports) {
    std::promise<Status> sent;
    auto shared = std::make_shared<std::vector<wire::Report>>(std::move(reports));
    transport::DialOptions dial;
    dial.endpoint = {"127.0.0.1", server_->port()};
    dial.connection = connection_;
    wire::Hello hello;
    hello.set_role(role);
    hello.set_region("eu");
    hello.set_node_id(node_id);
    hello.set_channel(wire::CONTROL);
    asio::co_spawn(
        io_->get_executor(),
        [this, dial, hello, shared, &sent]() -> awaitable<void> {
          Result<std::shared_ptr<Connection>> connection = co_await transport::Dial(dial, hello);
          if (!connection.ok()) {
            sent.set_value(connection.status());
            co_return;
          }
          hostile_.push_back(*connection);
          Status status = Status::Ok();
          for (wire::Report& report : *shared) {
            wire::Header header;
            *header.mutable_report() = std::move(report);
            status = co_await (*connection)->Send(transport::MakeFrame(std::move(header)));
            if (!status.ok()) break;
          }
          sent.set_value(status);
        },
        asio::detached);
    const Status status = sent.get_future().get();
    ASSERT_TRUE(status.ok()) << node_id << ": " << status.ToString();
  }

  std::map<std::string, FleetNode> FleetNow() {
    std::map<std::string, FleetNode> fleet;
    OnIo([&] {
      for (FleetNode& node : server_->Fleet()) fleet[node.state.node_id()] = std::move(node);
    });
    return fleet;
  }

  bool WaitFleet(const std::string& what,
                 const std::function<bool(const std::map<std::string, FleetNode>&)>& holds,
                 std::chrono::milliseconds timeout = kWait) {
    size_t size = 0;
    const Status waited = ops::WaitUntil(
        [&] {
          const auto fleet = FleetNow();
          size = fleet.size();
          return holds(fleet);
        },
        timeout, "the fleet map: " + what, 20ms);
    if (waited.ok()) return true;
    ADD_FAILURE() << waited.ToString() << " (" << size << " nodes in the map)";
    return false;
  }

  static wire::NodeState State(const std::string& node_id, wire::Role role, uint64_t version) {
    wire::NodeState node;
    node.set_node_id(node_id);
    node.set_region("eu");
    node.set_role(role);
    node.set_version(version);
    return node;
  }

  static wire::Report ReportOf(std::initializer_list<wire::NodeState> nodes) {
    wire::Report report;
    for (const wire::NodeState& node : nodes) *report.add_nodes() = node;
    return report;
  }

  std::unique_ptr<asio::io_context> io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::thread io_thread_;
  transport::ConnectionOptions connection_;
  CraftedSource source_;
  LinkRegistry links_;
  std::unique_ptr<Server> server_;
  std::vector<std::unique_ptr<Upstream>> upstreams_;
  std::vector<std::shared_ptr<Connection>> hostile_;
};

// A fleet-token holder reports fake workers, overwrites a real worker's readiness (from a
// worker's connection, a relay's, and one claiming the real worker's own id) and floods
// the map with 100,000 nodes: none of it is taken beyond what the connection may speak
// for, the real worker's entry never changes, and the map stays bounded.
TEST_F(FleetReportTest, ForgedReportsFromAFleetTokenHolderAreRefusedOrBounded) {
  Subscribe(wire::WORKER, "worker-a",
            [] { return ReportOf({State("worker-a", wire::WORKER, 5)}); });
  ASSERT_TRUE(WaitFleet("worker-a at v5", [](const auto& fleet) {
    auto it = fleet.find("worker-a");
    return it != fleet.end() && it->second.state.version() == 5;
  }));
  // 100,000 fake workers from a connection that says it is a relay, in four reports
  // (each well within the frame header limit), after claiming worker-a at v0.
  std::vector<wire::Report> flood;
  flood.push_back(ReportOf({State("evil-relay", wire::RELAY, 1), State("worker-a", wire::WORKER, 0)}));
  for (int batch = 0; batch < 4; ++batch) {
    wire::Report report = ReportOf({State("evil-relay", wire::RELAY, 1)});
    for (int i = 0; i < 25000; ++i) {
      char id[32];
      std::snprintf(id, sizeof id, "fake-%d-%06d", batch, i);
      *report.add_nodes() = State(id, wire::WORKER, 99);
    }
    flood.push_back(std::move(report));
  }
  Hostile(wire::RELAY, "evil-relay", std::move(flood));
  ASSERT_TRUE(WaitFleet("the last flood report taken",
                        [](const auto& fleet) { return fleet.count("fake-3-000000") > 0; }));
  // A worker's connection speaking for others; one not starting with itself; one claiming
  // to be worker-a.
  Hostile(wire::WORKER, "mallory",
          {ReportOf({State("mallory", wire::WORKER, 1), State("fake-worker", wire::WORKER, 99),
                     State("worker-a", wire::WORKER, 0)})});
  Hostile(wire::WORKER, "mallory-2", {ReportOf({State("worker-a", wire::WORKER, 0)})});
  Hostile(wire::WORKER, "worker-a", {ReportOf({State("worker-a", wire::WORKER, 0)})});
  // worker-a's entry is sampled while the forged reports land and after.
  std::vector<std::string> violations;
  size_t most = 0;
  const auto until = Clock::now() + 1500ms;
  while (Clock::now() < until) {
    const auto fleet = FleetNow();
    most = std::max(most, fleet.size());
    auto it = fleet.find("worker-a");
    if (it == fleet.end()) {
      violations.push_back("worker-a missing");
    } else if (it->second.state.version() != 5 || it->second.via != "worker-a") {
      violations.push_back("worker-a at v" + std::to_string(it->second.state.version()) +
                           " via " + it->second.via);
    }
    if (fleet.count("fake-worker")) violations.push_back("fake-worker taken from a worker's report");
    std::this_thread::sleep_for(10ms);  // a sampler's pace
  }
  std::printf("fleet map after 100,000 forged nodes: at most %zu entries\n", most);
  EXPECT_TRUE(violations.empty()) << violations.size() << " violations, first: " << violations.front();
  EXPECT_LE(most, 4096u);
  uint64_t refused = 0;
  OnIo([&] { refused = server_->fleet_nodes_refused(); });
  EXPECT_GT(refused, 0u);
}

// A relay with more nodes below it than one report frame can carry (20,000 with long ids:
// ~1.5 MB, over the 1 MiB header limit) keeps its control channel: its report is bounded.
TEST_F(FleetReportTest, ARelaysReportOfALargeFleetKeepsItsControlChannel) {
  Upstream* relay = Subscribe(wire::RELAY, "big-relay", [] {
    wire::Report report = ReportOf({State("big-relay", wire::RELAY, 7)});
    for (int i = 0; i < 20000; ++i) {
      char id[96];
      std::snprintf(id, sizeof id, "worker-eu-west-rack-%04d-host-%06d-a-rather-long-node-id", i / 40, i);
      *report.add_nodes() = State(id, wire::WORKER, 7);
    }
    return report;
  });
  ASSERT_TRUE(WaitFleet("big-relay and the nodes below it", [](const auto& fleet) {
    return fleet.count("big-relay") > 0 && fleet.size() > 1000;
  }, 5000ms));
  // Several report intervals on: still connected, still listed.
  const auto until = Clock::now() + 2500ms;
  size_t fewest = SIZE_MAX;
  while (Clock::now() < until) {
    const auto fleet = FleetNow();
    fewest = std::min(fewest, fleet.size());
    bool connected = false;
    OnIo([&] { connected = relay->connected(); });
    EXPECT_TRUE(connected && fleet.count("big-relay")) << "the relay's control channel was cut";
    std::this_thread::sleep_for(50ms);  // a sampler's pace
  }
  std::printf("a relay reporting 20,000 nodes: at least %zu of them listed upstream\n", fewest - 1);
  // What did not fit is counted, not lost silently.
  uint64_t omitted = 0;
  OnIo([&] { omitted = server_->fleet_nodes_omitted(); });
  EXPECT_EQ(omitted, 20000u - (fewest - 1));
}


// ---- signed versions: a relay that holds a valid certificate but forges ----------------

// The crafted server plays a relay with a valid mTLS certificate (the worker verifies it
// and presents its own); the worker trusts one publisher key. Every forgery a relay can
// make is announced in turn; none may ever be served.
class SignedUpstreamTest : public CraftedUpstreamTest {
 protected:
  void Configure(ServerOptions& server, WorkerOptions& worker) override {
    std::string pattern = (fs::temp_directory_path() / "signed_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    ASSERT_TRUE(transport::WriteTestCertificates((dir_ / "certs").string()).ok());
    const transport::TlsOptions tls{(dir_ / "certs/server.crt").string(),
                                    (dir_ / "certs/server.key").string(),
                                    (dir_ / "certs/ca.crt").string()};
    Result<std::shared_ptr<asio::ssl::context>> server_tls = transport::MakeServerTlsContext(tls);
    ASSERT_TRUE(server_tls.ok()) << server_tls.status().ToString();
    server.listener.tls = *server_tls;
    server.identity = {wire::RELAY, "home", "forging-relay"};
    worker.common.tls = tls;
    Result<KeyFiles> publisher = GenerateSigningKeys((dir_ / "publisher").string());
    Result<KeyFiles> rogue = GenerateSigningKeys((dir_ / "rogue").string());
    ASSERT_TRUE(publisher.ok() && rogue.ok());
    Result<SigningKey> key = SigningKey::Load(publisher->private_key);
    Result<SigningKey> rogue_key = SigningKey::Load(rogue->private_key);
    ASSERT_TRUE(key.ok() && rogue_key.ok()) << key.status().ToString();
    key_ = *key;
    rogue_ = *rogue_key;
    worker.common.trust_keys = {publisher->public_key};
  }

  void TearDown() override {
    CraftedUpstreamTest::TearDown();
    std::error_code ignored;
    if (!dir_.empty()) fs::remove_all(dir_, ignored);
  }

  SignedManifest Sign(const SigningKey& key, const ArtifactInfo& info,
                      const std::vector<std::byte>& bytes, const std::string& run_id = "run-a",
                      uint64_t created_unix_ms = 2'000'000'000'000) {
    Result<SignedManifest> signed_manifest = SignArtifact(key, info, bytes, run_id, created_unix_ms);
    EXPECT_TRUE(signed_manifest.ok()) << signed_manifest.status().ToString();
    return signed_manifest.ok() ? *signed_manifest : SignedManifest{};
  }

  fs::path dir_;
  std::optional<SigningKey> key_, rogue_;
};

std::vector<std::byte> EncodedDelta(uint64_t base_version, const OwnedCheckpoint& base,
                                    uint64_t version, const OwnedCheckpoint& target) {
  delta::EncodeOptions options;
  options.base_version = base_version;
  options.target_version = version;
  Result<std::vector<std::byte>> bytes = delta::Encode(base.view(), target.view(), options);
  EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
  return bytes.ok() ? std::move(*bytes) : std::vector<std::byte>{};
}

TEST_F(SignedUpstreamTest, ForgedVersionsFromAnAuthenticatedRelayAreNeverServed) {
  Lineage lineage(SmallSpecs(), 91);
  const Hash128 h1 = HashOf(lineage.At(1)), h2 = HashOf(lineage.At(2));
  const std::vector<std::byte> k1_bytes = EncodedKeyframe(1, lineage.At(1));
  const ArtifactInfo k1 = Entry(ArtifactKind::kKeyframe, 0, {}, 1, h1, k1_bytes);
  const std::vector<std::byte> d2_bytes = EncodedDelta(1, lineage.At(1), 2, lineage.At(2));
  const ArtifactInfo d2 = Entry(ArtifactKind::kDelta, 1, h1, 2, h2, d2_bytes);
  const SignedManifest k1_signed = Sign(*key_, k1, k1_bytes);
  const SignedManifest d2_signed = Sign(*key_, d2, d2_bytes);
  // What a forger would serve as v2: other weights, self-consistent (its own hashes).
  const OwnedCheckpoint impostor = lineage.Impostor(2);
  const Hash128 forged_hash = HashOf(impostor);
  const std::vector<std::byte> forged_bytes = EncodedDelta(1, lineage.At(1), 2, impostor);
  const ArtifactInfo forged = Entry(ArtifactKind::kDelta, 1, h1, 2, forged_hash, forged_bytes);
  source_.Put(k1, k1_bytes);
  WatchWeights({{1, h1}, {2, h2}});  // the impostor's hash is never allowed

  Announce({k1}, 1, h1, {{KeyOf(k1), k1_signed}});
  ASSERT_TRUE(WaitWorker("serving the signed v1", Serves(1, h1.ToHex())));
  EXPECT_EQ(U64(WorkerStatus(), "signature_failures_total"), 0u);

  auto refused = [&](const std::string& what, uint64_t failures, const std::string& reason) {
    SCOPED_TRACE(what);
    ASSERT_TRUE(WaitWorker("refusing " + what, [&](const json& s) {
      return U64(s, "signature_failures_total") >= failures;
    }));
    std::this_thread::sleep_for(200ms);  // by design: no swap may follow within a window
    const json status = WorkerStatus();
    EXPECT_TRUE(Serves(1, h1.ToHex())(status)) << Brief(status);
    EXPECT_EQ(U64(status, "signature_failures_total"), failures) << Brief(status);
    EXPECT_NE(Str(status, "last_signature_error").find(reason), std::string::npos) << Brief(status);
  };
  source_.Put(forged, forged_bytes);
  // 1. Unsigned.
  Announce({k1, forged}, 2, forged_hash, {{KeyOf(k1), k1_signed}});
  refused("an unsigned delta", 1, "unsigned");
  // 2. Signed by a key the worker does not trust.
  Announce({k1, forged}, 2, forged_hash,
           {{KeyOf(k1), k1_signed}, {KeyOf(forged), Sign(*rogue_, forged, forged_bytes)}});
  refused("a delta signed by another key", 2, "not trusted");
  // 3. The publisher's genuine signature for v2, on the forger's entry.
  Announce({k1, forged}, 2, forged_hash, {{KeyOf(k1), k1_signed}, {KeyOf(forged), d2_signed}});
  refused("a genuine signature on a forged entry", 3, "differs from the catalog");
  // 4. A genuine signature of v2 moved onto a v3 entry (a replay under another number).
  ArtifactInfo renumbered = d2;
  renumbered.target_version = 3;
  Announce({k1, renumbered}, 3, h2, {{KeyOf(k1), k1_signed}, {KeyOf(renumbered), d2_signed}});
  refused("a signature of v2 on a v3 entry", 4, "is for v2");
  // 5. The entry and its piece hashes match the forged bytes and are signed by the trusted
  // key, but the signed SHA-256 is that of the genuine bytes: what an XXH3 piece-hash
  // collision would look like. Caught only once the bytes are in, before they are applied.
  std::vector<std::byte> same_size = d2_bytes;
  same_size[same_size.size() / 2] ^= std::byte{0x40};
  const ArtifactInfo colliding = Entry(ArtifactKind::kDelta, 1, h1, 2, h2, same_size);
  SignedManifest colliding_signed = Sign(*key_, colliding, d2_bytes);
  source_.Put(colliding, same_size);
  Announce({k1, colliding}, 2, h2, {{KeyOf(k1), k1_signed}, {KeyOf(colliding), colliding_signed}});
  refused("bytes without the signed SHA-256", 5, "signed SHA-256");
  // 6. A validly signed keyframe of an older run (signed before the served version): a
  // replay, refused and counted apart.
  const std::vector<std::byte> k5_bytes = EncodedKeyframe(5, impostor);
  const ArtifactInfo k5 = Entry(ArtifactKind::kKeyframe, 0, {}, 5, forged_hash, k5_bytes);
  source_.Put(k5, k5_bytes);
  Announce({k1, k5}, 5, forged_hash,
           {{KeyOf(k1), k1_signed}, {KeyOf(k5), Sign(*key_, k5, k5_bytes, "run-old", 1'000'000'000'000)}});
  ASSERT_TRUE(WaitWorker("refusing an older run's v5", [](const json& s) {
    return U64(s, "replays_refused_total") >= 1;
  }));
  EXPECT_NE(Str(WorkerStatus(), "last_signature_error").find("older run"), std::string::npos);

  // The genuine v2 still goes through.
  source_.Put(d2, d2_bytes);
  Announce({k1, d2}, 2, h2, {{KeyOf(k1), k1_signed}, {KeyOf(d2), d2_signed}});
  ASSERT_TRUE(WaitWorker("serving the signed v2", Serves(2, h2.ToHex())));
  const json status = WorkerStatus();
  EXPECT_EQ(Str(status, "run_id"), "run-a");
  EXPECT_EQ(U64(status, "trusted_keys"), 1u);
  const std::vector<std::string> violations = StopWatching();
  EXPECT_GT(samples_.load(), 0u);
  EXPECT_TRUE(violations.empty()) << violations.size() << " violations, first: " << violations.front();
}

// The run's own v2, validly signed, replayed after the worker served v3. As the head it is
// ignored (no plan goes back) and renumbered it does not verify; and once the worker serves
// nothing, so that v2 passes the plan, the signature and the byte checks, CheckFresh still
// refuses it as a replay of the same run. A signed keyframe whose payload is damaged (what a
// publisher's bad disk gives) gets the worker there: a failed in-place keyframe serves
// nothing until a good one. The serving weights never hold v2.
TEST_F(SignedUpstreamTest, AReplayedOlderSignedManifestOfTheSameRunIsRefused) {
  Lineage lineage(SmallSpecs(), 92);
  const Hash128 h2 = HashOf(lineage.At(2)), h3 = HashOf(lineage.At(3));
  const Hash128 h4 = HashOf(lineage.At(4)), h5 = HashOf(lineage.At(5));
  const std::vector<std::byte> k3_bytes = EncodedKeyframe(3, lineage.At(3));
  const ArtifactInfo k3 = Entry(ArtifactKind::kKeyframe, 0, {}, 3, h3, k3_bytes);
  const SignedManifest k3_signed = Sign(*key_, k3, k3_bytes);
  source_.Put(k3, k3_bytes);
  WatchWeights({{3, h3}, {5, h5}});  // never v2's weights, nor the damaged v4's
  Announce({k3}, 3, h3, {{KeyOf(k3), k3_signed}});
  ASSERT_TRUE(WaitWorker("serving the signed v3", Serves(3, h3.ToHex())));
  // The forger replays the run's genuine v2 keyframe, and claims it is the head: the worker
  // never goes back.
  const std::vector<std::byte> k2_bytes = EncodedKeyframe(2, lineage.At(2));
  const ArtifactInfo k2 = Entry(ArtifactKind::kKeyframe, 0, {}, 2, h2, k2_bytes);
  const SignedManifest k2_signed = Sign(*key_, k2, k2_bytes);
  source_.Put(k2, k2_bytes);
  Announce({k2}, 2, h2, {{KeyOf(k2), k2_signed}});
  ASSERT_TRUE(WaitWorker("ignoring the replayed head",
                         [](const json& s) { return U64(s, "older_heads_ignored") >= 1; }));
  std::this_thread::sleep_for(300ms);  // by design: no swap within a window
  EXPECT_TRUE(Serves(3, h3.ToHex())(WorkerStatus())) << Brief(WorkerStatus());
  // Renumbered as v4 it no longer verifies.
  ArtifactInfo renumbered = k2;
  renumbered.target_version = 4;
  source_.Put(renumbered, k2_bytes);
  Announce({renumbered}, 4, h2, {{KeyOf(renumbered), k2_signed}});
  ASSERT_TRUE(WaitWorker("refusing the renumbered replay",
                         [](const json& s) { return U64(s, "signature_failures_total") >= 1; }));
  std::this_thread::sleep_for(300ms);  // by design
  EXPECT_TRUE(Serves(3, h3.ToHex())(WorkerStatus())) << Brief(WorkerStatus());

  // A signed v4 keyframe with its last payload byte flipped: signed as it is, so it arrives
  // and verifies, and fails only while it is applied in place.
  std::vector<std::byte> k4_bytes = EncodedKeyframe(4, lineage.At(4));
  k4_bytes.back() ^= std::byte{0x01};
  const ArtifactInfo k4 = Entry(ArtifactKind::kKeyframe, 0, {}, 4, h4, k4_bytes);
  source_.Put(k4, k4_bytes);
  Announce({k3, k4}, 4, h4, {{KeyOf(k3), k3_signed}, {KeyOf(k4), Sign(*key_, k4, k4_bytes)}});
  ASSERT_TRUE(WaitWorker("serving nothing after the damaged v4", [](const json& s) {
    return U64(s, "artifacts_rejected") >= 1 && U64(s, "version") == 0;
  }));
  // Now v2 is above what the worker serves: only CheckFresh stands between it and the weights.
  Announce({k2}, 2, h2, {{KeyOf(k2), k2_signed}});
  ASSERT_TRUE(WaitWorker("refusing v2 as a replay of the run",
                         [](const json& s) { return U64(s, "replays_refused_total") >= 1; }));
  std::this_thread::sleep_for(300ms);  // by design: no swap within a window
  json status = WorkerStatus();
  EXPECT_EQ(U64(status, "version"), 0u) << Brief(status);
  EXPECT_NE(Str(status, "last_signature_error").find("a replayed version"), std::string::npos)
      << Brief(status);
  EXPECT_EQ(U64(status, "signature_failures_total"), 1u) << Brief(status);
  // The run goes on: its v5 is served.
  const std::vector<std::byte> k5_bytes = EncodedKeyframe(5, lineage.At(5));
  const ArtifactInfo k5 = Entry(ArtifactKind::kKeyframe, 0, {}, 5, h5, k5_bytes);
  source_.Put(k5, k5_bytes);
  Announce({k5}, 5, h5, {{KeyOf(k5), Sign(*key_, k5, k5_bytes)}});
  ASSERT_TRUE(WaitWorker("serving the signed v5", Serves(5, h5.ToHex())));
  const std::vector<std::string> violations = StopWatching();
  EXPECT_GT(samples_.load(), 0u);
  EXPECT_TRUE(violations.empty()) << violations.size() << " violations, first: " << violations.front();
}

}  // namespace
}  // namespace flywheel::sync
