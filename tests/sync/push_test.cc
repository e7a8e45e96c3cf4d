// The publisher's push API (docs/PUSH_API.md) over real HTTP on 127.0.0.1: an in-process
// sync::Publisher (and, where the fleet matters, an in-process model-less sync::Worker) on
// one io_context thread; requests come from transport::HttpCall and from the push client
// (sync/push_client.h) on the test thread. Connection cuts come from a proxy outside the
// code under test (pipeline/fault_proxy.h); a full staging disk is a real 1 MiB tmpfs.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mount.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "delta/delta.h"
#include "delta/hash.h"
#include "delta/safetensors.h"
#include "pipeline/process.h"
#include "sync/publisher.h"
#include "sync/push_client.h"
#include "sync/worker.h"
#include "tests/delta/test_checkpoints.h"
#include "pipeline/fault_proxy.h"
#include "transport/http.h"

namespace flywheel::sync {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using json = nlohmann::json;
using flywheel::testing::MustEncode;
using flywheel::testing::Mutate;
using flywheel::testing::RandomCheckpoint;
using flywheel::testing::TensorSpec;

constexpr char kPushToken[] = "push-secret-1";
constexpr char kReadToken[] = "read-secret-1";

std::vector<TensorSpec> Specs() {
  return {{"model.layers.0.mlp.up_proj.weight", DType::kBF16, {256, 512}},
          {"model.layers.0.mlp.down_proj.weight", DType::kBF16, {512, 256}},
          {"model.norm.weight", DType::kF32, {256}}};
}

std::string Str(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

std::string Xxh3Hex(const std::string& body) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx",
                static_cast<unsigned long long>(HashBytes64(std::as_bytes(std::span(body)))));
  return text;
}

std::string Serialized(const OwnedCheckpoint& checkpoint) {
  auto bytes = SerializeSafetensors(checkpoint.view(), {});
  EXPECT_TRUE(bytes.ok());
  return bytes.ok() ? Str(*bytes) : std::string();
}

std::string HashOf(const OwnedCheckpoint& checkpoint) {
  auto hash = CheckpointHash(checkpoint.view());
  return hash.ok() ? hash->ToHex() : std::string();
}

struct Answer {
  int status = 0;
  json body;
  std::string code() const { return body.is_object() ? body["error"].value("code", "") : ""; }
};

class PushTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "push_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    io_ = std::make_unique<asio::io_context>(1);
    work_.emplace(asio::make_work_guard(*io_));
    io_thread_ = std::thread([this] { io_->run(); });
    options_.common.http = {"127.0.0.1", 0};
    options_.common.token = kReadToken;
    options_.common.connection.heartbeat = 100ms;
    options_.common.connection.idle_timeout = 1000ms;
    options_.listen = {"127.0.0.1", 0};
    options_.log.dir = (dir_ / "state").string();
    options_.push.token = kPushToken;
    options_.push.max_part_bytes = 1 << 20;
  }

  void TearDown() override {
    if (worker_) worker_->Stop();
    if (publisher_) publisher_->Stop();
    work_.reset();
    (void)pipeline::WaitUntil([&] { return io_->stopped(); }, 200ms, "the io_context to drain");
    io_->stop();
    io_thread_.join();
    worker_.reset();
    publisher_.reset();
    io_.reset();
    if (mounted_) ::umount2(mounted_->c_str(), MNT_DETACH);
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  void StartPublisher() {
    Result<std::unique_ptr<Publisher>> started = Publisher::Start(io_->get_executor(), options_);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    publisher_ = std::move(*started);
    endpoint_ = {"127.0.0.1", publisher_->http_port()};
  }

  void StartWorker() {
    WorkerOptions options;
    options.common.region = "eu";
    options.common.node_id = "worker-1";
    options.common.http = {"127.0.0.1", 0};
    options.common.token = kReadToken;
    options.common.connection = options_.common.connection;
    options.upstreams = {{"127.0.0.1", publisher_->port()}};
    Result<std::unique_ptr<Worker>> started = Worker::Start(io_->get_executor(), options);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    worker_ = std::move(*started);
  }

  Answer Call(const std::string& method, const std::string& target, const std::string& body = {},
              const std::string& token = kPushToken,
              const std::string& type = "application/json") {
    transport::HttpGetOptions options;
    options.token = token;
    options.timeout = 30s;
    auto response = transport::HttpCall(endpoint_, method, target, body, options, type);
    EXPECT_TRUE(response.ok()) << response.status().ToString();
    if (!response.ok()) return {};
    Answer answer{response->status, json::parse(response->body, nullptr, false)};
    return answer;
  }

  // Creates an upload of `body` (a full checkpoint unless `spec` says otherwise).
  Answer Create(const std::string& body, json spec = json::object()) {
    spec["size"] = body.size();
    if (!spec.contains("digest")) spec["digest"] = {{"algorithm", "xxh3_64"}, {"value", Xxh3Hex(body)}};
    return Call("POST", "/v1/uploads", spec.dump());
  }

  Answer Put(const std::string& id, uint64_t offset, const std::string& part) {
    return Call("PUT", "/v1/uploads/" + id + "?offset=" + std::to_string(offset), part, kPushToken,
                "application/octet-stream");
  }

  // Create, one part, commit: the commit's answer.
  Answer PushWhole(const std::string& body, json spec = json::object()) {
    Answer created = Create(body, spec);
    if (created.status != 201) return created;
    const std::string id = created.body["id"];
    Answer put = Put(id, 0, body);
    EXPECT_EQ(put.status, 200) << put.body.dump();
    return Call("POST", "/v1/uploads/" + id + "/commit");
  }

  PushClientOptions ClientOptions() const {
    PushClientOptions options;
    options.url = "http://" + endpoint_.ToString();
    options.token = kPushToken;
    options.cache_dir = (dir_ / "cache").string();
    options.timeout = 30s;
    return options;
  }

  bool WorkerServes(uint64_t version) {
    return pipeline::WaitUntil([&] { return worker_->version() >= version; }, 20s,
                               "the worker to serve v" + std::to_string(version))
        .ok();
  }

  fs::path dir_;
  std::unique_ptr<asio::io_context> io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::thread io_thread_;
  PublisherOptions options_;
  std::unique_ptr<Publisher> publisher_;
  std::unique_ptr<Worker> worker_;
  transport::Endpoint endpoint_;
  std::optional<std::string> mounted_;
  OwnedCheckpoint v1_ = RandomCheckpoint(Specs(), 1);
};

TEST_F(PushTest, FullPushIsPublishedAndInTheLedger) {
  StartPublisher();
  Answer committed = PushWhole(Serialized(v1_), {{"version", 5}, {"metadata", {{"step", 5}}},
                                                 {"client", "alice@trainer"}});
  ASSERT_EQ(committed.status, 200) << committed.body.dump();
  EXPECT_EQ(committed.body["version"], 5);
  EXPECT_EQ(committed.body["weights_hash"], HashOf(v1_));
  EXPECT_EQ(committed.body["source"], "push");
  EXPECT_EQ(committed.body["upload_kind"], "full");
  EXPECT_EQ(committed.body["pushed_by"]["client"], "alice@trainer");
  EXPECT_EQ(publisher_->version(), 5u);
  Answer versions = Call("GET", "/v1/versions", {}, kReadToken);
  ASSERT_EQ(versions.status, 200);
  ASSERT_EQ(versions.body["versions"].size(), 1u);
  EXPECT_EQ(versions.body["versions"][0]["metadata"]["step"], 5);
  EXPECT_EQ(versions.body["versions"][0]["rebuildable"], true);
  EXPECT_EQ(Call("GET", "/v1/versions/5", {}, kReadToken).body["version"], 5);
  EXPECT_EQ(Call("GET", "/v1/versions/4", {}, kReadToken).status, 404);
  EXPECT_TRUE(fs::is_empty(dir_ / "state" / "uploads"));  // staging removed
}

TEST_F(PushTest, ShardedFullPushWithIndex) {
  StartPublisher();
  // Two shards and the index, as HF writes them.
  OwnedCheckpoint first, second;
  first.tensors = {v1_.tensors[0]};
  second.tensors = {v1_.tensors[1], v1_.tensors[2]};
  const std::string a = Serialized(first), b = Serialized(second);
  json weight_map = {{v1_.tensors[0].name, "model-00001-of-00002.safetensors"},
                     {v1_.tensors[1].name, "model-00002-of-00002.safetensors"},
                     {v1_.tensors[2].name, "model-00002-of-00002.safetensors"}};
  const std::string index = json{{"metadata", json::object()}, {"weight_map", weight_map}}.dump();
  json files = json::array({{{"name", "model-00001-of-00002.safetensors"}, {"size", a.size()}},
                            {{"name", "model-00002-of-00002.safetensors"}, {"size", b.size()}},
                            {{"name", "model.safetensors.index.json"}, {"size", index.size()}}});
  Answer committed = PushWhole(a + b + index, {{"files", files}});
  ASSERT_EQ(committed.status, 200) << committed.body.dump();
  EXPECT_EQ(committed.body["weights_hash"], HashOf(v1_));
  EXPECT_EQ(committed.body["version"], 1);  // "next" on an empty log
}

TEST_F(PushTest, DeltaAgainstTheHeadIsStoredAsSent) {
  options_.log.keyframe_every = 100;
  StartPublisher();
  ASSERT_EQ(PushWhole(Serialized(v1_)).status, 200);
  const OwnedCheckpoint v2 = Mutate(v1_, 0.03, 7);
  delta::EncodeOptions encode;
  encode.base_version = 1;
  encode.target_version = 2;
  const std::string delta = Str(MustEncode(v1_, v2, encode));
  Answer committed = PushWhole(delta, {{"kind", "delta"}, {"base_version", 1}});
  ASSERT_EQ(committed.status, 200) << committed.body.dump();
  EXPECT_EQ(committed.body["version"], 2);
  EXPECT_EQ(committed.body["weights_hash"], HashOf(v2));
  EXPECT_EQ(committed.body["upload_kind"], "delta");
  EXPECT_EQ(committed.body["uploaded_bytes"], delta.size());
  EXPECT_EQ(committed.body["delta_bytes"], delta.size());  // not re-encoded
  auto stored = Env::Default()->ReadFile(
      (dir_ / "state" / "artifacts" / "v00000000000000000002.delta").string());
  ASSERT_TRUE(stored.ok()) << stored.status().ToString();
  EXPECT_EQ(Str(*stored), delta);
}

TEST_F(PushTest, PartsOutOfOrderAndRepeated) {
  StartPublisher();
  const std::string body = Serialized(v1_);
  Answer created = Create(body);
  ASSERT_EQ(created.status, 201) << created.body.dump();
  const std::string id = created.body["id"];
  const size_t part = body.size() / 3 + 1;
  for (size_t offset : {2 * part, 0ul, part, 0ul}) {  // reverse-ish, the first one twice
    Answer put = Put(id, offset, body.substr(offset, part));
    ASSERT_EQ(put.status, 200) << put.body.dump();
  }
  Answer state = Call("GET", "/v1/uploads/" + id);
  EXPECT_EQ(state.body["received_bytes"], body.size());
  EXPECT_TRUE(state.body["missing"].empty());
  EXPECT_EQ(Call("POST", "/v1/uploads/" + id + "/commit").status, 200);
}

TEST_F(PushTest, ClientResumesAfterAConnectionCutMidPart) {
  StartPublisher();
  const fs::path file = dir_ / "v1.safetensors";
  ASSERT_TRUE(WriteSafetensors(file.string(), v1_.view(), {}).ok());
  const uint64_t size = fs::file_size(file);
  // The cut falls inside the third part's body: parts 1 and 2 are acknowledged first.
  pipeline::FaultProxy proxy(endpoint_.port, {.cut_upstream_after_bytes = 2 * 64 * 1024 + 30000});
  ASSERT_TRUE(proxy.ok()) << proxy.error();
  PushClientOptions options = ClientOptions();
  options.url = "http://127.0.0.1:" + std::to_string(proxy.port());
  options.part_bytes = 64 * 1024;
  options.use_delta = false;
  Result<PushOutcome> pushed = Push(options, {file.string(), 3, json::object()});
  ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
  EXPECT_EQ(proxy.cuts(), 1);
  EXPECT_GE(pushed->resumes, 1);
  EXPECT_EQ(pushed->row["weights_hash"], HashOf(v1_));
  // Only the part that was cut is sent again.
  EXPECT_LE(pushed->sent_bytes, size + 64 * 1024);
  EXPECT_GT(pushed->sent_bytes, size);
}

TEST_F(PushTest, TokensArePushScoped) {
  StartPublisher();
  const std::string body = Serialized(v1_);
  json spec = {{"size", body.size()}, {"digest", {{"algorithm", "xxh3_64"}, {"value", Xxh3Hex(body)}}}};
  EXPECT_EQ(Call("POST", "/v1/uploads", spec.dump(), "").status, 401);
  EXPECT_EQ(Call("POST", "/v1/uploads", spec.dump(), "wrong").status, 401);
  Answer read = Call("POST", "/v1/uploads", spec.dump(), kReadToken);
  EXPECT_EQ(read.status, 403);
  EXPECT_EQ(read.code(), "forbidden");
  EXPECT_EQ(Call("POST", "/v1/pin", R"({"version": 1})", kReadToken).status, 403);
  EXPECT_EQ(Call("POST", "/v1/unpin", "{}", kReadToken).status, 403);
  EXPECT_TRUE(fs::is_empty(dir_ / "state" / "uploads"));  // nothing staged
  EXPECT_EQ(Call("GET", "/v1/versions", {}, kReadToken).status, 200);
  EXPECT_EQ(Call("GET", "/v1/versions", {}, kPushToken).status, 200);
  EXPECT_EQ(Call("GET", "/v1/versions", {}, "").status, 401);
  EXPECT_EQ(publisher_->version(), 0u);
}

TEST_F(PushTest, AnAdminTokenTakesPinAwayFromThePushTokenAndADashboardOnlyReads) {
  options_.common.scoped_tokens = {{"ops-token", transport::kScopeAdmin | transport::kScopeRead},
                                   {"dashboard-token", transport::kScopeRead}};
  StartPublisher();
  ASSERT_EQ(PushWhole(Serialized(v1_)).status, 200);
  // The push token pushes but no longer pins; the admin token pins; the dashboard reads.
  Answer by_pusher = Call("POST", "/v1/pin", R"({"version": 1})", kPushToken);
  EXPECT_EQ(by_pusher.status, 403);
  EXPECT_EQ(by_pusher.code(), "forbidden");
  EXPECT_EQ(Call("POST", "/v1/pin", R"({"version": 1})", "dashboard-token").status, 403);
  const std::string body = Serialized(v1_);
  json spec = {{"size", body.size()}, {"digest", {{"algorithm", "xxh3_64"}, {"value", Xxh3Hex(body)}}}};
  EXPECT_EQ(Call("POST", "/v1/uploads", spec.dump(), "dashboard-token").status, 403);
  EXPECT_EQ(Call("POST", "/v1/uploads", spec.dump(), "ops-token").status, 403);
  EXPECT_EQ(Call("GET", "/v1/versions", {}, "dashboard-token").status, 200);
  EXPECT_EQ(Call("POST", "/v1/pin", R"({"version": 1})", "ops-token").status, 200);
  EXPECT_EQ(Call("POST", "/v1/unpin", "{}", "ops-token").status, 200);
  // Status and metrics: any token with read.
  for (const char* token : {"dashboard-token", "ops-token", kPushToken, kReadToken}) {
    transport::HttpGetOptions get;
    get.token = token;
    Result<transport::HttpResponse> metrics =
        transport::HttpGet({"127.0.0.1", publisher_->http_port()}, "/metrics", get);
    ASSERT_TRUE(metrics.ok());
    EXPECT_EQ(metrics->status, 200) << token;
  }
}

TEST_F(PushTest, NoPushTokenMeansNoPushes) {
  options_.push.token.clear();
  StartPublisher();
  Answer answer = Call("POST", "/v1/uploads", "{}", kReadToken);
  EXPECT_EQ(answer.status, 403);
  EXPECT_EQ(answer.code(), "push_disabled");
}

TEST_F(PushTest, BodyHashMismatchPublishesNothing) {
  StartPublisher();
  const std::string body = Serialized(v1_);
  Answer committed = PushWhole(
      body, {{"digest", {{"algorithm", "xxh3_64"}, {"value", Xxh3Hex(body + "x")}}}});
  EXPECT_EQ(committed.status, 422);
  EXPECT_EQ(committed.code(), "body_hash_mismatch");
  EXPECT_EQ(publisher_->version(), 0u);
  EXPECT_TRUE(fs::is_empty(dir_ / "state" / "uploads"));
}

TEST_F(PushTest, TruncatedBodyIsIncomplete) {
  StartPublisher();
  const std::string body = Serialized(v1_);
  Answer created = Create(body);
  const std::string id = created.body["id"];
  ASSERT_EQ(Put(id, 0, body.substr(0, body.size() - 100)).status, 200);
  Answer committed = Call("POST", "/v1/uploads/" + id + "/commit");
  EXPECT_EQ(committed.status, 422);
  EXPECT_EQ(committed.code(), "incomplete");
  EXPECT_EQ(committed.body["error"]["missing"], json::array({{body.size() - 100, body.size()}}));
  EXPECT_EQ(publisher_->version(), 0u);
}

TEST_F(PushTest, InvalidSafetensorsIsRefusedByName) {
  StartPublisher();
  std::string body = Serialized(v1_);
  body.resize(body.size() - 8);  // the last tensor's data runs past the end
  Answer committed = PushWhole(body);
  EXPECT_EQ(committed.status, 422);
  EXPECT_EQ(committed.code(), "invalid_checkpoint");
  EXPECT_EQ(publisher_->version(), 0u);
}

TEST_F(PushTest, DeltaAgainstUnknownBaseIs409AndTheClientFallsBack) {
  StartPublisher();
  ASSERT_EQ(PushWhole(Serialized(v1_), {{"version", 3}}).status, 200);
  Answer refused = Create("0123456789", {{"kind", "delta"}, {"base_version", 2}});
  EXPECT_EQ(refused.status, 409);
  EXPECT_EQ(refused.code(), "unknown_base");
  EXPECT_EQ(refused.body["error"]["held_versions"], json::array({3}));
  // The client's cache says it pushed v2 (to another publisher at this address, say).
  const fs::path file = dir_ / "v4.safetensors";
  const OwnedCheckpoint v4 = Mutate(v1_, 0.03, 4);
  ASSERT_TRUE(WriteSafetensors(file.string(), v4.view(), {}).ok());
  PushClientOptions options = ClientOptions();
  const std::string cache = PushCacheDir(options.cache_dir, options.url);
  fs::create_directories(cache);
  ASSERT_TRUE(WriteSafetensors(cache + "/model.safetensors", v1_.view(), {}).ok());
  const std::string last = json{{"url", options.url}, {"version", 2}}.dump();
  ASSERT_TRUE(WriteFileAtomically(cache + "/last.json", std::as_bytes(std::span(last))).ok());
  Result<PushOutcome> pushed = Push(options, {file.string(), std::nullopt, json::object()});
  ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
  EXPECT_TRUE(pushed->fell_back);
  EXPECT_EQ(pushed->kind, "full");
  EXPECT_EQ(pushed->row["version"], 4);
  EXPECT_EQ(pushed->row["weights_hash"], HashOf(v4));
  // The cache now holds v4: the next push is a delta against it.
  const fs::path file5 = dir_ / "v5.safetensors";
  const OwnedCheckpoint v5 = Mutate(v4, 0.03, 5);
  ASSERT_TRUE(WriteSafetensors(file5.string(), v5.view(), {}).ok());
  Result<PushOutcome> next = Push(options, {file5.string(), std::nullopt, json::object()});
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->kind, "delta");
  EXPECT_LT(next->uploaded_bytes * 5, next->checkpoint_bytes);
  EXPECT_EQ(next->row["weights_hash"], HashOf(v5));
}

TEST_F(PushTest, OlderOrEqualVersionIs409) {
  StartPublisher();
  ASSERT_EQ(PushWhole(Serialized(v1_), {{"version", 7}}).status, 200);
  for (uint64_t version : {7, 6}) {
    Answer refused = Create(Serialized(v1_), {{"version", version}});
    EXPECT_EQ(refused.status, 409);
    EXPECT_EQ(refused.code(), "version_conflict");
    EXPECT_EQ(refused.body["error"]["head_version"], 7);
  }
}

TEST_F(PushTest, OversizedUploadIs413) {
  options_.push.max_upload_bytes = 1000;
  StartPublisher();
  Answer refused = Create(Serialized(v1_));
  EXPECT_EQ(refused.status, 413);
  EXPECT_EQ(refused.code(), "too_large");
}

TEST_F(PushTest, MalformedRequestsAreClear400s) {
  StartPublisher();
  for (const char* body : {"not json", "[]", R"({"size": -1})", R"({"size": 1, "kind": "zip"})",
                           R"({"size": 4, "digest": {"algorithm": "md5", "value": "00"}})",
                           R"({"size": 4, "files": [{"name": "../x", "size": 4}]})"}) {
    Answer answer = Call("POST", "/v1/uploads", body);
    EXPECT_EQ(answer.status, 400) << body;
    EXPECT_EQ(answer.code(), "bad_request") << body;
  }
  EXPECT_EQ(Call("POST", "/v1/pin", R"({"version": 1, "client": 7})").status, 400);
  EXPECT_EQ(Call("PUT", "/v1/uploads/u-none?offset=0", "x").status, 404);
  EXPECT_TRUE(fs::is_empty(dir_ / "state" / "uploads"));
}

TEST_F(PushTest, TwoClientsPushingTheSameVersionOneWins) {
  StartPublisher();
  const std::string a = Serialized(v1_), b = Serialized(Mutate(v1_, 0.05, 9));
  std::vector<std::string> ids;
  for (const std::string* body : {&a, &b}) {
    Answer created = Create(*body, {{"version", 2}});
    ASSERT_EQ(created.status, 201);
    ids.push_back(created.body["id"]);
    ASSERT_EQ(Put(ids.back(), 0, *body).status, 200);
  }
  auto commit = [&](const std::string& id) { return Call("POST", "/v1/uploads/" + id + "/commit"); };
  auto first = std::async(std::launch::async, commit, ids[0]);
  auto second = std::async(std::launch::async, commit, ids[1]);
  const Answer x = first.get(), y = second.get();
  EXPECT_EQ((x.status == 200) + (y.status == 200), 1) << x.body.dump() << y.body.dump();
  const Answer& loser = x.status == 200 ? y : x;
  EXPECT_EQ(loser.status, 409);
  EXPECT_EQ(loser.code(), "version_conflict");
  EXPECT_EQ(publisher_->version(), 2u);
}

TEST_F(PushTest, StagingDiskFullPublishesNothing) {
  const fs::path staging = dir_ / "staging";
  fs::create_directories(staging);
  if (::mount("tmpfs", staging.c_str(), "tmpfs", 0, "size=1m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs (needs root): " << std::strerror(errno);
  }
  mounted_ = staging.string();
  options_.push.staging_dir = staging.string();
  StartPublisher();
  ASSERT_EQ(PushWhole(Serialized(v1_)).status, 200);  // ~0.5 MB fits
  const std::string big = Serialized(RandomCheckpoint({{"w", DType::kBF16, {1024, 1024}}}, 2));
  Answer refused = Create(big);
  EXPECT_EQ(refused.status, 507) << refused.body.dump();
  EXPECT_EQ(refused.code(), "insufficient_storage");
  EXPECT_EQ(publisher_->version(), 1u);
  EXPECT_TRUE(fs::is_empty(staging));
  EXPECT_EQ(Call("GET", "/v1/status", {}, kReadToken).status, 200);
}

TEST_F(PushTest, AbandonedUploadExpires) {
  options_.push.upload_expiry = 200ms;
  StartPublisher();
  Answer created = Create(Serialized(v1_));
  ASSERT_EQ(created.status, 201);
  const std::string id = created.body["id"];
  ASSERT_TRUE(pipeline::WaitUntil([&] { return fs::is_empty(dir_ / "state" / "uploads"); }, 5s,
                                  "the upload to expire")
                  .ok());
  Answer gone = Call("GET", "/v1/uploads/" + id);
  EXPECT_EQ(gone.status, 410);
  EXPECT_EQ(gone.code(), "upload_expired");
}

TEST_F(PushTest, PinServesAnEarlierVersionAsANewOneAndUnpinResumes) {
  StartPublisher();
  StartWorker();
  const OwnedCheckpoint v2 = Mutate(v1_, 0.03, 2);
  ASSERT_EQ(PushWhole(Serialized(v1_)).status, 200);
  ASSERT_EQ(PushWhole(Serialized(v2)).status, 200);
  ASSERT_TRUE(WorkerServes(2));
  Answer pinned = Call("POST", "/v1/pin", R"({"version": 1})");
  ASSERT_EQ(pinned.status, 200) << pinned.body.dump();
  EXPECT_EQ(pinned.body["version"], 3);
  EXPECT_EQ(pinned.body["source"], "pin");
  EXPECT_EQ(pinned.body["pinned_to"], 1);
  EXPECT_EQ(pinned.body["weights_hash"], HashOf(v1_));
  ASSERT_TRUE(WorkerServes(3));
  EXPECT_EQ(worker_->weights_hash().ToHex(), HashOf(v1_));
  Answer refused = PushWhole(Serialized(Mutate(v2, 0.03, 4)));
  EXPECT_EQ(refused.status, 409);
  EXPECT_EQ(refused.code(), "pinned");
  EXPECT_EQ(Call("GET", "/v1/versions", {}, kReadToken).body["pin"]["pinned_to"], 1);
  ASSERT_EQ(Call("POST", "/v1/unpin", "{}").status, 200);
  Answer resumed = PushWhole(Serialized(Mutate(v2, 0.03, 4)));
  EXPECT_EQ(resumed.status, 200) << resumed.body.dump();
  EXPECT_EQ(resumed.body["version"], 4);
  EXPECT_EQ(Call("POST", "/v1/pin", R"({"version": 99})").status, 404);
}

TEST_F(PushTest, ReadinessAndLongPoll) {
  StartPublisher();
  StartWorker();
  ASSERT_EQ(PushWhole(Serialized(v1_)).status, 200);
  Answer ready = Call("GET", "/v1/wait?version=1&fraction=1&timeout_ms=20000", {}, kReadToken);
  ASSERT_EQ(ready.status, 200);
  EXPECT_EQ(ready.body["ready"], true) << ready.body.dump();
  EXPECT_EQ(ready.body["workers"], 1);
  EXPECT_EQ(ready.body["regions"]["eu"]["serving"], 1);
  const auto start = std::chrono::steady_clock::now();
  Answer waited = Call("GET", "/v1/wait?version=2&timeout_ms=300", {}, kReadToken);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 290ms);
  EXPECT_EQ(waited.body["ready"], false);
  EXPECT_EQ(waited.body["serving"], 0);
  EXPECT_EQ(Call("GET", "/v1/readiness?version=1", {}, kReadToken).body["fraction"], 1.0);
  EXPECT_EQ(Call("GET", "/v1/wait?fraction=abc", {}, kReadToken).status, 400);
}

TEST_F(PushTest, WorkersReportASwapAtOnce) {
  // A worker reports right after a swap (Upstream::ReportNow) instead of at its next
  // one-second report, so the long-poll answers within the swap's own time: over five
  // pushes the mean wait stays far below the half second a timed report would average.
  StartPublisher();
  StartWorker();
  OwnedCheckpoint weights = v1_;
  double total_ms = 0;
  for (uint64_t version = 1; version <= 5; ++version) {
    weights = Mutate(weights, 0.02, version);
    ASSERT_EQ(PushWhole(Serialized(weights)).status, 200);
    Answer ready = Call("GET", "/v1/wait?version=" + std::to_string(version) + "&timeout_ms=10000",
                        {}, kReadToken);
    ASSERT_EQ(ready.body["ready"], true) << ready.body.dump();
    total_ms += ready.body["waited_ms"].get<double>();
  }
  EXPECT_LT(total_ms / 5, 300.0);
}

TEST_F(PushTest, LedgerSurvivesARestart) {
  StartPublisher();
  ASSERT_EQ(PushWhole(Serialized(v1_), {{"metadata", {{"run", "r1"}}}}).status, 200);
  publisher_->Stop();
  publisher_.reset();
  // The state directory is free once the stopped publisher's last coroutine let go of it.
  Result<std::unique_ptr<Publisher>> restarted = Status::Unavailable("not started");
  ASSERT_TRUE(pipeline::WaitUntil(
                  [&] {
                    restarted = Publisher::Start(io_->get_executor(), options_);
                    return restarted.ok();
                  },
                  5s, "the publisher to restart on its state directory")
                  .ok())
      << restarted.status().ToString();
  publisher_ = std::move(*restarted);
  endpoint_ = {"127.0.0.1", publisher_->http_port()};
  Answer versions = Call("GET", "/v1/versions", {}, kReadToken);
  ASSERT_EQ(versions.body["versions"].size(), 1u);
  EXPECT_EQ(versions.body["versions"][0]["metadata"]["run"], "r1");
}

}  // namespace
}  // namespace flywheel::sync
