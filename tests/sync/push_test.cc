// The publisher's push API (docs/PUSH_API.md) over real HTTP on 127.0.0.1: an in-process
// sync::Publisher (and, where the fleet matters, an in-process model-less sync::Worker) on
// one io_context thread; requests come from transport::HttpCall and from the push client
// (push/push_client.h) on the test thread. Connection cuts come from a proxy outside the
// code under test (testing/fault_proxy.h); a full staging disk is a real 1 MiB tmpfs.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <nlohmann/json.hpp>
#include <fstream>
#include <thread>

#include "delta/delta.h"
#include "checkpoint/hash.h"
#include "checkpoint/safetensors.h"
#include "ops/process.h"
#include "sync/publisher.h"
#include "sync/ledger.h"
#include "push/push_api.h"
#include "push/push_client.h"
#include "push/uploads.h"
#include "sync/worker.h"
#include "tests/delta/test_checkpoints.h"
#include "testing/fault_proxy.h"
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

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
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
    push_.token = kPushToken;
    push_.max_part_bytes = 1 << 20;
  }

  void TearDown() override {
    if (worker_) worker_->Stop();
    if (publisher_) publisher_->Stop();
    work_.reset();
    (void)ops::WaitUntil([&] { return io_->stopped(); }, 200ms, "the io_context to drain");
    io_->stop();
    io_thread_.join();
    worker_.reset();
    publisher_.reset();
    io_.reset();
    if (mounted_) ::umount2(mounted_->c_str(), MNT_DETACH);
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // options_ with the push API (push_) installed, as `flywheel publish` does.
  PublisherOptions WithPush() const {
    PublisherOptions options = options_;
    EnablePushApi(options, push_);
    return options;
  }

  void StartPublisher() {
    Result<std::unique_ptr<Publisher>> started = Publisher::Start(io_->get_executor(), WithPush());
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
    return ops::WaitUntil([&] { return worker_->version() >= version; }, 20s,
                               "the worker to serve v" + std::to_string(version))
        .ok();
  }

  fs::path dir_;
  std::unique_ptr<asio::io_context> io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::thread io_thread_;
  PublisherOptions options_;
  PushOptions push_;  // installed on options_ by WithPush()
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
  testing::FaultProxy proxy(endpoint_.port, {.cut_upstream_after_bytes = 2 * 64 * 1024 + 30000});
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

// A PUT of a part sent over a raw socket in small writes: `body(offset, out)` fills `out`
// with the body bytes from `offset`; after `cut_after` bytes of the body the socket is
// closed without an answer (a client that leaves mid-part). The answer's status and body
// (0 when cut).
struct RawAnswer {
  int status = 0;
  json body;
};
RawAnswer RawPut(uint16_t port, const std::string& target, uint64_t length,
                 const std::function<void(uint64_t, std::span<char>)>& body,
                 uint64_t cut_after = UINT64_MAX, size_t write_bytes = 64 << 10) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  const std::string header = "PUT " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" +
                             "Authorization: Bearer " + kPushToken +
                             "\r\nContent-Type: application/octet-stream\r\nContent-Length: " +
                             std::to_string(length) + "\r\nConnection: close\r\n\r\n";
  bool sent = ::send(fd, header.data(), header.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(header.size());
  std::vector<char> piece(write_bytes);
  for (uint64_t at = 0; sent && at < std::min(length, cut_after); at += piece.size()) {
    const size_t size = std::min<uint64_t>({piece.size(), length - at, cut_after - at});
    body(at, std::span(piece.data(), size));
    sent = ::send(fd, piece.data(), size, MSG_NOSIGNAL) == static_cast<ssize_t>(size);
  }
  RawAnswer answer;
  if (cut_after < length) {
    ::close(fd);
    return answer;
  }
  std::string text;
  char buffer[4096];
  for (ssize_t got; (got = ::recv(fd, buffer, sizeof(buffer), 0)) > 0;) text.append(buffer, got);
  ::close(fd);
  if (text.size() > 12) answer.status = std::atoi(text.c_str() + 9);
  const size_t body_at = text.find("\r\n\r\n");
  if (body_at != std::string::npos) answer.body = json::parse(text.substr(body_at + 4), nullptr, false);
  return answer;
}

std::function<void(uint64_t, std::span<char>)> BytesOf(const std::string& body, uint64_t from) {
  return [&body, from](uint64_t at, std::span<char> out) {
    std::memcpy(out.data(), body.data() + from + at, out.size());
  };
}

// A part whose bytes do not hash to the client's ?xxh3= is refused by name (422
// part_hash_mismatch), and what it wrote counts as missing again, also where it overwrote
// an acknowledged part; the right bytes sent again complete the upload.
TEST_F(PushTest, APartWithAWrongDigestIsRefusedAndItsBytesAreNotKept) {
  StartPublisher();
  const std::string body = Serialized(v1_);
  Answer created = Create(body);
  ASSERT_EQ(created.status, 201) << created.body.dump();
  const std::string id = created.body["id"];
  const uint64_t half = body.size() / 2;
  ASSERT_EQ(Put(id, 0, body.substr(0, half)).status, 200);
  std::string wrong = body.substr(0, half);
  wrong[100] ^= 1;
  const std::string target = "/v1/uploads/" + id + "?offset=0&xxh3=" + Xxh3Hex(body.substr(0, half));
  RawAnswer refused = RawPut(endpoint_.port, target, half, BytesOf(wrong, 0), UINT64_MAX, 4096);
  EXPECT_EQ(refused.status, 422) << refused.body.dump();
  ASSERT_TRUE(refused.body.is_object()) << refused.body.dump();
  EXPECT_EQ(refused.body["error"]["code"], "part_hash_mismatch");
  const std::string message = refused.body["error"]["message"];
  EXPECT_NE(message.find("offset 0 of upload " + id), std::string::npos) << message;
  Answer state = Call("GET", "/v1/uploads/" + id);
  EXPECT_EQ(state.body["received_bytes"], 0u) << state.body.dump();
  EXPECT_EQ(Call("POST", "/v1/uploads/" + id + "/commit").code(), "incomplete");
  // The right bytes with their digest, then the rest: the upload completes.
  RawAnswer right = RawPut(endpoint_.port, target, half, BytesOf(body, 0), UINT64_MAX, 4096);
  EXPECT_EQ(right.status, 200) << right.body.dump();
  ASSERT_EQ(Put(id, half, body.substr(half)).status, 200);
  Answer committed = Call("POST", "/v1/uploads/" + id + "/commit");
  EXPECT_EQ(committed.status, 200) << committed.body.dump();
  EXPECT_EQ(committed.body["weights_hash"], HashOf(v1_));
  Answer malformed = Call("PUT", "/v1/uploads/" + id + "?offset=0&xxh3=zz", "ab", kPushToken,
                          "application/octet-stream");
  EXPECT_EQ(malformed.status, 400);
  EXPECT_NE(malformed.body.dump().find("xxh3"), std::string::npos) << malformed.body.dump();
}

// A client that leaves mid-part leaves only whole acknowledged parts: the part's range
// (and any acknowledged bytes it reached) count as missing; sending it again completes the
// upload, and the connection's slot is free again.
TEST_F(PushTest, APartCutMidBodyLeavesOnlyWholeAcknowledgedRanges) {
  StartPublisher();
  const std::string body = Serialized(v1_);
  Answer created = Create(body);
  ASSERT_EQ(created.status, 201) << created.body.dump();
  const std::string id = created.body["id"];
  const uint64_t third = body.size() / 3;
  ASSERT_EQ(Put(id, 0, body.substr(0, third)).status, 200);
  const std::string target = "/v1/uploads/" + id + "?offset=" + std::to_string(third);
  RawAnswer cut = RawPut(endpoint_.port, target, body.size() - third, BytesOf(body, third),
                         third / 2, 8192);
  EXPECT_EQ(cut.status, 0);
  // The server notices the close and drops the part.
  json state;
  ASSERT_TRUE(ops::WaitUntil([&] {
                state = Call("GET", "/v1/uploads/" + id).body;
                return state.value("received_bytes", 0ull) == third &&
                       Call("POST", "/v1/uploads/" + id + "/commit").code() == "incomplete";
              }, 10s, "the cut part to be dropped").ok())
      << state.dump();
  EXPECT_EQ(state["missing"], json::array({{third, body.size()}}));
  RawAnswer again = RawPut(endpoint_.port, target, body.size() - third, BytesOf(body, third));
  EXPECT_EQ(again.status, 200) << again.body.dump();
  Answer committed = Call("POST", "/v1/uploads/" + id + "/commit");
  EXPECT_EQ(committed.status, 200) << committed.body.dump();
}

// A chunked part past the part limit is answered 413 as it arrives; nothing of it counts.
TEST_F(PushTest, AChunkedPartPastTheLimitIs413) {
  StartPublisher();
  const std::string body(3 << 20, 'x');
  Answer created = Create(body);
  ASSERT_EQ(created.status, 201) << created.body.dump();
  const std::string id = created.body["id"];
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(endpoint_.port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  std::string request = "PUT /v1/uploads/" + id + "?offset=0 HTTP/1.1\r\nHost: x\r\n" +
                        "Authorization: Bearer " + kPushToken +
                        "\r\nTransfer-Encoding: chunked\r\n\r\n";
  const std::string chunk(64 << 10, 'x');
  for (int i = 0; i < 24; ++i) request += "10000\r\n" + chunk + "\r\n";  // 1.5 MiB > 1 MiB
  request += "0\r\n\r\n";
  (void)::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string text;
  char buffer[4096];
  for (ssize_t got; (got = ::recv(fd, buffer, sizeof(buffer), 0)) > 0;) text.append(buffer, got);
  ::close(fd);
  EXPECT_EQ(text.rfind("HTTP/1.1 413", 0), 0u) << text.substr(0, 200);
  EXPECT_NE(text.find("too_large"), std::string::npos) << text;
  EXPECT_EQ(Call("GET", "/v1/uploads/" + id).body["received_bytes"], 0u);
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
  push_.token.clear();
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
  push_.max_upload_bytes = 1000;
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
  StartWorker();
  const OwnedCheckpoint other = Mutate(v1_, 0.05, 9);
  const std::string a = Serialized(v1_), b = Serialized(other);
  ASSERT_NE(HashOf(v1_), HashOf(other));
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
  // The head holds the winner's weights, not the loser's nor a mix: in the winner's ledger
  // row, in the publisher's status, and in the bytes a worker serves.
  const std::string winner_hash = HashOf(x.status == 200 ? v1_ : other);
  const Answer& winner = x.status == 200 ? x : y;
  EXPECT_EQ(winner.body["weights_hash"], winner_hash) << winner.body.dump();
  EXPECT_EQ(Call("GET", "/v1/status", {}, kReadToken).body["weights_hash"], winner_hash);
  ASSERT_TRUE(WorkerServes(2));
  std::string served;
  worker_->WithWeights([&](uint64_t version, const CheckpointView& weights) {
    Result<Hash128> hash = CheckpointHash(weights);
    served = "v" + std::to_string(version) + " " + (hash.ok() ? hash->ToHex() : hash.status().ToString());
  });
  EXPECT_EQ(served, "v2 " + winner_hash);
}

TEST_F(PushTest, StagingDiskFullPublishesNothing) {
  const fs::path staging = dir_ / "staging";
  fs::create_directories(staging);
  if (::mount("tmpfs", staging.c_str(), "tmpfs", 0, "size=1m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs (needs root): " << std::strerror(errno);
  }
  mounted_ = staging.string();
  push_.staging_dir = staging.string();
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
  push_.upload_expiry = 200ms;
  StartPublisher();
  Answer created = Create(Serialized(v1_));
  ASSERT_EQ(created.status, 201);
  const std::string id = created.body["id"];
  ASSERT_TRUE(ops::WaitUntil([&] { return fs::is_empty(dir_ / "state" / "uploads"); }, 5s,
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
  ASSERT_TRUE(ops::WaitUntil(
                  [&] {
                    restarted = Publisher::Start(io_->get_executor(), WithPush());
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

// ---- issue 33: uploads across a publisher restart ----------------------------------------

// Restarts the in-process publisher on its state directory (and staging area).
void RestartPublisher(PushTest& test, std::unique_ptr<Publisher>& publisher, asio::io_context& io,
                      const PublisherOptions& options, transport::Endpoint& endpoint) {
  publisher->Stop();
  publisher.reset();
  Result<std::unique_ptr<Publisher>> restarted = Status::Unavailable("not started");
  ASSERT_TRUE(ops::WaitUntil(
                  [&] {
                    restarted = Publisher::Start(io.get_executor(), options);
                    return restarted.ok();
                  },
                  5s, "the publisher to restart on its state directory")
                  .ok())
      << restarted.status().ToString();
  publisher = std::move(*restarted);
  endpoint = {"127.0.0.1", publisher->http_port()};
}

// An upload half sent survives a restart: the client finds the staged ranges, a changed
// declaration is refused by name, a tampered staging file is dropped by its digest and
// reported missing, and what was missing completes the upload.
TEST_F(PushTest, AnUploadSurvivesARestartAndATamperedRangeIsMissingAgain) {
  push_.max_part_bytes = 64 * 1024;
  StartPublisher();
  const std::string body = Serialized(v1_);
  ASSERT_GT(body.size(), 4u * 64 * 1024);
  Answer created = Create(body);
  ASSERT_EQ(created.status, 201) << created.body.dump();
  const std::string id = created.body["id"];
  const uint64_t part = 64 * 1024;
  for (uint64_t offset = 0; offset < 3 * part; offset += part) {
    ASSERT_EQ(Put(id, offset, body.substr(offset, part)).status, 200);
  }
  RestartPublisher(*this, publisher_, *io_, WithPush(), endpoint_);
  Answer state = Call("GET", "/v1/uploads/" + id);
  ASSERT_EQ(state.status, 200) << state.body.dump();
  EXPECT_EQ(state.body["received_bytes"], 3 * part);
  EXPECT_EQ(state.body["missing"], json::array({json::array({3 * part, body.size()})}));

  // Resuming with another size or digest: refused by name, nothing changes.
  json again = {{"resume", id}, {"size", body.size() + 1},
                {"digest", {{"algorithm", "xxh3_64"}, {"value", Xxh3Hex(body)}}}};
  Answer refused = Call("POST", "/v1/uploads", again.dump());
  EXPECT_EQ(refused.status, 409);
  EXPECT_EQ(refused.code(), "upload_mismatch");
  EXPECT_NE(refused.body["error"].value("message", "").find("size"), std::string::npos)
      << refused.body.dump();
  again["size"] = body.size();
  again["digest"]["value"] = Xxh3Hex(body + "x");
  refused = Call("POST", "/v1/uploads", again.dump());
  EXPECT_EQ(refused.code(), "upload_mismatch");
  EXPECT_NE(refused.body["error"].value("message", "").find("digest"), std::string::npos);
  again["digest"]["value"] = Xxh3Hex(body);
  Answer resumed = Call("POST", "/v1/uploads", again.dump());
  EXPECT_EQ(resumed.status, 200) << resumed.body.dump();
  EXPECT_EQ(resumed.body["id"], id);

  // A byte of the second part changed on disk while the publisher was down.
  publisher_->Stop();
  const fs::path staged = dir_ / "state" / "uploads" / id / "model.safetensors";
  {
    std::fstream file(staged, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(part + 100));
    file.put(static_cast<char>(body[part + 100] ^ 0x20));
  }
  RestartPublisher(*this, publisher_, *io_, WithPush(), endpoint_);
  state = Call("GET", "/v1/uploads/" + id);
  ASSERT_EQ(state.status, 200);
  EXPECT_EQ(state.body["received_bytes"], 2 * part);
  EXPECT_EQ(state.body["missing"], json::array({json::array({part, 2 * part}),
                                                json::array({3 * part, body.size()})}));
  EXPECT_EQ(publisher_->version(), 0u);
  for (const auto& range : state.body["missing"]) {
    for (uint64_t offset = range[0]; offset < range[1].get<uint64_t>(); offset += part) {
      const uint64_t length = std::min<uint64_t>(part, range[1].get<uint64_t>() - offset);
      ASSERT_EQ(Put(id, offset, body.substr(offset, length)).status, 200);
    }
  }
  Answer committed = Call("POST", "/v1/uploads/" + id + "/commit");
  ASSERT_EQ(committed.status, 200) << committed.body.dump();
  EXPECT_EQ(committed.body["weights_hash"], HashOf(v1_));
}

#ifdef FLYWHEEL_BIN
// A real `flywheel publish` killed with SIGKILL in the middle of an upload and started
// again on the same ports: the push client (through a proxy shaping its upload link and
// counting its bytes) resumes from the ranges the restarted publisher recovered and sends
// only what was missing: the checkpoint once, plus at most the part in flight at the kill.
TEST(PushRestartTest, AKilledPublisherRestartsAndTheClientSendsOnlyTheMissingRanges) {
  std::string pattern = (fs::temp_directory_path() / "push_kill_test.XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const fs::path dir = pattern;
  const fs::path token = dir / "push.token";
  WriteText(token.string(), kPushToken);
  fs::permissions(token, fs::perms::owner_read | fs::perms::owner_write);
  const fs::path file = dir / "model.safetensors";
  const std::vector<TensorSpec> specs = {{"w", DType::kBF16, {2048, 2048}}};  // 8 MiB
  const OwnedCheckpoint model = RandomCheckpoint(specs, 9);
  ASSERT_TRUE(WriteSafetensors(file.string(), model.view(), {}).ok());
  const uint64_t size = fs::file_size(file);
  const Result<uint16_t> port = ops::FreePort();
  ASSERT_TRUE(port.ok());
  const transport::Endpoint http{"127.0.0.1", *port};
  const std::vector<std::string> args = {
      "publish", "--listen", "127.0.0.1:0", "--http", http.ToString(), "--state-dir",
      (dir / "state").string(), "--push-token-file", token.string()};
  ops::ProcessGroup processes(dir.string());
  processes.set_grace(3s);
  auto start = [&]() -> size_t {
    Result<size_t> index = processes.Start("publisher", FLYWHEEL_BIN, args);
    EXPECT_TRUE(index.ok()) << index.status().ToString();
    transport::HttpGetOptions get;
    get.timeout = 1s;
    EXPECT_TRUE(ops::WaitUntil([&] { return transport::HttpGet(http, "/healthz", get).ok(); }, 15s,
                               "the publisher to answer")
                    .ok())
        << processes.Output(*index);
    return *index;
  };
  size_t publisher = start();
  constexpr uint64_t kPart = 256 << 10;
  testing::FaultProxy proxy(*port, {.upstream_bytes_per_s = 8e6});  // ~1 s for the body
  ASSERT_TRUE(proxy.ok()) << proxy.error();
  PushClientOptions options;
  options.url = "http://127.0.0.1:" + std::to_string(proxy.port());
  options.token = kPushToken;
  options.cache_dir = (dir / "cache").string();
  options.timeout = 10s;
  options.part_bytes = kPart;
  options.use_delta = false;
  auto pushed = std::async(std::launch::async, [&] { return Push(options, {file.string(), 1, json::object()}); });
  ASSERT_TRUE(ops::WaitUntil([&] { return proxy.upstream_bytes() > size / 2; }, 20s,
                             "half the body to go up").ok());
  processes.Kill(publisher);
  publisher = start();
  Result<PushOutcome> outcome = pushed.get();
  ASSERT_TRUE(outcome.ok()) << outcome.status().ToString() << "\n" << processes.Output(publisher);
  EXPECT_GE(outcome->resumes, 1);
  EXPECT_EQ(outcome->row["weights_hash"], HashOf(model));
  std::printf("killed mid-upload: body %llu bytes, part bytes sent %llu, bytes through the proxy "
              "%llu (resumes %d)\n",
              static_cast<unsigned long long>(size),
              static_cast<unsigned long long>(outcome->sent_bytes),
              static_cast<unsigned long long>(proxy.upstream_bytes()), outcome->resumes);
  // Only the part cut by the kill (if one was in flight) is sent again; the proxy's count
  // (headers, JSON and the cut part's bytes included) says the same from outside the client.
  EXPECT_GE(outcome->sent_bytes, size);
  EXPECT_LE(outcome->sent_bytes, size + kPart);
  EXPECT_LE(proxy.upstream_bytes(), size + 2 * kPart);
  (void)processes.StopAll();
  std::error_code ignored;
  fs::remove_all(dir, ignored);
}

// VmRSS of a process, in bytes.
uint64_t ProcessRss(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) << 10;
  }
  return 0;
}

// Samples a process's VmRSS every millisecond until Stop(): the peak.
class RssSampler {
 public:
  explicit RssSampler(pid_t pid) : pid_(pid), peak_(ProcessRss(pid)) {
    thread_ = std::thread([this] {
      while (!done_) {
        peak_ = std::max(peak_.load(), ProcessRss(pid_));
        std::this_thread::sleep_for(1ms);
      }
    });
  }
  ~RssSampler() { (void)Stop(); }
  uint64_t Stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
    return peak_;
  }

 private:
  const pid_t pid_;
  std::atomic<uint64_t> peak_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// A full push of a 96 MiB model to a publisher process, its one part sent in 64 KiB TCP
// writes: the body streams to the staging file, so the publisher's RSS while the part
// arrives stays within its idle RSS + 16 MiB (it held the whole part before). The commit's
// peak is printed against issue 33's bound (idle + head + 64 MiB for a 1 GB push, here
// head + 32 MiB) and held to what it is today, so that a new whole copy fails: the head,
// the keyframe encoded in memory and the mapped staged checkpoint (3 x head + 64 MiB).
TEST(PushRssTest, AFullPushStreamsToStagingAndHoldsAtMostTheHead) {
  std::string pattern = (fs::temp_directory_path() / "push_rss_test.XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const fs::path dir = pattern;
  const fs::path token = dir / "push.token";
  WriteText(token.string(), kPushToken);
  fs::permissions(token, fs::perms::owner_read | fs::perms::owner_write);
  std::string body;
  uint64_t head_bytes = 0;
  {
    std::vector<TensorSpec> specs;
    for (int i = 0; i < 6; ++i) specs.push_back({"layers." + std::to_string(i) + ".w", DType::kBF16, {2048, 4096}});
    const OwnedCheckpoint model = RandomCheckpoint(specs, 11);
    for (const TensorView& t : model.view()) head_bytes += t.data.size();
    body = Serialized(model);
  }
  const Result<uint16_t> port = ops::FreePort();
  ASSERT_TRUE(port.ok());
  const transport::Endpoint http{"127.0.0.1", *port};
  ops::ProcessGroup processes(dir.string());
  Result<size_t> index = processes.Start(
      "publisher", FLYWHEEL_BIN,
      {"publish", "--listen", "127.0.0.1:0", "--http", http.ToString(), "--state-dir",
       (dir / "state").string(), "--push-token-file", token.string(), "--max-part-mib", "256",
       "--keyframe-every", "1000", "--threads", "2"});
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  transport::HttpGetOptions call;
  call.token = kPushToken;
  call.timeout = 60s;
  ASSERT_TRUE(ops::WaitUntil([&] { return transport::HttpGet(http, "/healthz", call).ok(); }, 15s,
                             "the publisher to answer").ok()) << processes.Output(*index);
  const pid_t pid = processes.pid(*index);
  const json spec = {{"size", body.size()}, {"digest", {{"algorithm", "xxh3_64"}, {"value", Xxh3Hex(body)}}}};
  auto created = transport::HttpPost(http, "/v1/uploads", spec.dump(), call);
  ASSERT_TRUE(created.ok() && created->status == 201) << (created.ok() ? created->body : "");
  const std::string id = json::parse(created->body)["id"];
  const uint64_t idle = ProcessRss(pid);
  RssSampler upload(pid);
  RawAnswer put = RawPut(*port, "/v1/uploads/" + id + "?offset=0&xxh3=" + Xxh3Hex(body),
                         body.size(), BytesOf(body, 0));
  const uint64_t upload_peak = upload.Stop();
  ASSERT_EQ(put.status, 200) << put.body.dump();
  RssSampler commit(pid);
  auto committed = transport::HttpPost(http, "/v1/uploads/" + id + "/commit", {}, call);
  const uint64_t commit_peak = commit.Stop();
  ASSERT_TRUE(committed.ok() && committed->status == 200) << (committed.ok() ? committed->body : "");
  const double mib = 1 << 20;
  std::printf("full push of %.0f MiB (head %.0f MiB): publisher RSS idle %.0f MiB, peak while the "
              "part arrived %.0f MiB (+%.0f; bound +16), peak through the commit %.0f MiB (+%.0f; "
              "issue 33's bound head + 32 = +%.0f: %s)\n",
              body.size() / mib, head_bytes / mib, idle / mib, upload_peak / mib,
              (upload_peak - std::min(upload_peak, idle)) / mib, commit_peak / mib,
              (commit_peak - std::min(commit_peak, idle)) / mib, (head_bytes + (32 << 20)) / mib,
              commit_peak <= idle + head_bytes + (32ull << 20) ? "met" : "NOT met");
  EXPECT_LE(upload_peak, idle + (16ull << 20));
  EXPECT_LE(commit_peak, idle + 3 * head_bytes + (64ull << 20));
  (void)processes.StopAll();
  std::error_code ignored;
  fs::remove_all(dir, ignored);
}
#endif  // FLYWHEEL_BIN

// What a crash leaves in the staging directory that is not an upload (a foreign file, a
// directory without its record, a record that does not parse, a file of the wrong size, a
// stray file inside an upload) is removed and named; the real upload is kept.
TEST(UploadStoreTest, LeftoversOfACrashAreRemovedByNameAndUploadsKept) {
  std::string pattern = (fs::temp_directory_path() / "uploads_test.XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  UploadStoreOptions options;
  options.dir = pattern + "/staging";
  std::string kept;
  {
    auto store = UploadStore::Open(options);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    UploadSpec spec;
    spec.size = 8192;
    spec.files = {{"model.safetensors", 8192}};
    spec.digest = {"xxh3_64", "0000000000000000"};
    auto a = (*store)->Create(spec);
    auto b = (*store)->Create(spec);
    auto c = (*store)->Create(spec);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    kept = a->id;
    ASSERT_TRUE((*store)->Write(kept, 0, std::vector<std::byte>(4096, std::byte{3})).ok());
    fs::remove(fs::path(options.dir) / b->id / ".upload.json");       // a crash during create
    fs::resize_file(fs::path(options.dir) / c->id / "model.safetensors", 100);  // wrong size
  }
  const std::string partial_record = options.dir + "/u-0123456789abcdef0123456789abcdef";
  fs::create_directories(partial_record);
  WriteText(partial_record + "/.upload.json", "{\"id\": \"u-0123");  // torn
  WriteText(options.dir + "/notes.txt", "foreign");
  WriteText(options.dir + "/" + kept + "/extra.bin", "stray");
  auto store = UploadStore::Open(options);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  std::string notes;
  for (const std::string& note : (*store)->recovery()) notes += note + "\n";
  EXPECT_NE(notes.find("notes.txt"), std::string::npos) << notes;
  EXPECT_NE(notes.find("u-0123456789abcdef0123456789abcdef"), std::string::npos) << notes;
  EXPECT_NE(notes.find("extra.bin"), std::string::npos) << notes;
  EXPECT_NE(notes.find("not the declared 8192"), std::string::npos) << notes;
  EXPECT_NE(notes.find("no readable .upload.json"), std::string::npos) << notes;
  EXPECT_EQ(std::distance(fs::directory_iterator(options.dir), fs::directory_iterator()), 1);
  auto state = (*store)->State(kept);
  ASSERT_TRUE(state.ok()) << state.status().ToString();
  EXPECT_EQ(state->received_bytes, 4096u);
  EXPECT_FALSE(fs::exists(options.dir + "/" + kept + "/extra.bin"));
  store->reset();
  std::error_code ignored;
  fs::remove_all(pattern, ignored);
}

// ---- issue 31: hostile clients of the push API ------------------------------------------

// A body nested `depth` arrays deep inside a JSON string field of an object, as a hostile
// client sends it: the bytes are valid JSON; copying or dumping the value recurses once per
// level.
std::string Nested(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST_F(PushTest, DeepJsonInAnUploadOrPinIsAClear400AndTheServerServesOn) {
  push_.max_part_bytes = 4 << 20;  // the route takes 4 MiB parts
  StartPublisher();
  // A create is a control body: 1 MiB at most, whatever the parts may be; refused (413, by
  // the HTTP server) before it is read.
  transport::HttpGetOptions push;
  push.token = kPushToken;
  auto huge = transport::HttpCall(endpoint_, "POST", "/v1/uploads",
                                  json{{"metadata", {{"x", std::string(2 << 20, 'x')}}}}.dump(), push);
  ASSERT_TRUE(huge.ok()) << huge.status().ToString();
  EXPECT_EQ(huge->status, 413);
  EXPECT_NE(huge->body.find("limit 1048576 bytes"), std::string::npos) << huge->body;
  const std::string deep = Nested(500000);  // 1 MB: inside the control routes' body limit
  const std::string upload = R"({"size": 4, "digest": {"algorithm": "xxh3_64", "value": "0000000000000000"}, "metadata": {"x": )" + deep + "}}";
  Answer refused = Call("POST", "/v1/uploads", upload);
  EXPECT_EQ(refused.status, 400) << refused.body.dump().substr(0, 200);
  EXPECT_EQ(refused.code(), "bad_request");
  EXPECT_NE(refused.body["error"].value("message", "").find("nested deeper than 64"), std::string::npos)
      << refused.body.dump().substr(0, 300);
  Answer pin = Call("POST", "/v1/pin", R"({"version": 1, "metadata": {"x": )" + deep + "}}");
  EXPECT_EQ(pin.status, 400);
  EXPECT_NE(pin.body["error"].value("message", "").find("nested deeper than 64"), std::string::npos);
  // Still serving, and nothing was staged.
  EXPECT_EQ(Call("GET", "/v1/versions", {}, kReadToken).status, 200);
  EXPECT_TRUE(fs::is_empty(dir_ / "state" / "uploads"));
}

// /proc/self/status fields, in bytes.
struct Rss {
  uint64_t anon = 0;   // RssAnon: memory the process holds itself
  uint64_t total = 0;  // VmRSS: RssAnon + RssFile (mapped file pages, reclaimable page cache)
};
Rss ReadRss() {
  std::ifstream status("/proc/self/status");
  Rss rss;
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) rss.anon = std::stoull(line.substr(8)) << 10;
    if (line.rfind("VmRSS:", 0) == 0) rss.total = std::stoull(line.substr(6)) << 10;
  }
  return rss;
}

// Pushes a dense delta of about `mib` MiB against a head of the same size, commits it while
// a thread samples the process's RSS, and checks the commit's peak above the RSS just
// before it: at most the head's size (the rebuilt base the delta is applied to) + 64 MiB,
// in anonymous memory and in VmRSS (which also counts the mapped delta's resident pages).
// The upload is never read whole into memory, nor kept resident as it is read.
class LargeDeltaPushTest : public PushTest {
 public:
  void Run(uint64_t mib) {
    options_.log.keyframe_every = 1000;  // the keyframe encode is the log's cost, not the commit's
    options_.log.keyframe_cost = 0;
    push_.max_part_bytes = 64 << 20;
    options_.common.threads = 2;
    StartPublisher();
    // Tensors of 16 MiB of bf16: a realistic layer size.
    std::vector<TensorSpec> specs;
    for (uint64_t i = 0; i < mib / 16; ++i) {
      specs.push_back({"model.layers." + std::to_string(i) + ".weight", DType::kBF16, {4096, 2048}});
    }
    const uint64_t head_bytes = mib << 20;
    std::string delta;
    {
      OwnedCheckpoint v1 = RandomCheckpoint(specs, 1);
      ASSERT_TRUE(publisher_->Publish(1, v1.view()).ok());
      OwnedCheckpoint v2 = RandomCheckpoint(specs, 2);  // every word changes: a dense delta
      delta::EncodeOptions encode;
      encode.base_version = 1;
      encode.target_version = 2;
      encode.threads = 2;
      encode.compressor = delta::Compressor::kNone;
      delta = Str(MustEncode(v1, v2, encode));
    }
    ASSERT_GE(delta.size(), head_bytes);
    Answer created = Create(delta, {{"kind", "delta"}, {"base_version", 1}});
    ASSERT_EQ(created.status, 201) << created.body.dump();
    const std::string id = created.body["id"];
    for (size_t offset = 0; offset < delta.size(); offset += push_.max_part_bytes) {
      ASSERT_EQ(Put(id, offset, delta.substr(offset, push_.max_part_bytes)).status, 200);
    }
    const uint64_t delta_bytes = delta.size();
    delta = std::string();
    const Rss before = ReadRss();
    std::atomic<bool> done{false};
    Rss peak = before;
    std::thread sampler([&] {
      while (!done) {
        const Rss now = ReadRss();
        peak.anon = std::max(peak.anon, now.anon);
        peak.total = std::max(peak.total, now.total);
        std::this_thread::sleep_for(1ms);
      }
    });
    transport::HttpGetOptions call;
    call.token = kPushToken;
    call.timeout = 600s;
    auto committed = transport::HttpCall(endpoint_, "POST", "/v1/uploads/" + id + "/commit", {}, call);
    done = true;
    sampler.join();
    ASSERT_TRUE(committed.ok()) << committed.status().ToString();
    EXPECT_EQ(committed->status, 200) << committed->body;
    const double mi = 1 << 20;
    std::printf("commit of a %.0f MiB delta against a %.0f MiB head: RSS before %.0f MiB "
                "(anonymous %.0f MiB); peak above it: anonymous +%.0f MiB, VmRSS +%.0f MiB "
                "(limit: head + 64 MiB = %.0f MiB)\n",
                delta_bytes / mi, head_bytes / mi, before.total / mi, before.anon / mi,
                (peak.anon - before.anon) / mi, (peak.total - before.total) / mi,
                (head_bytes + (64 << 20)) / mi);
    // Both: the commit's own memory, and the mapped delta's pages it keeps resident.
    EXPECT_LE(peak.anon - before.anon, head_bytes + (64ull << 20));
    EXPECT_LE(peak.total - before.total, head_bytes + (64ull << 20));
    EXPECT_EQ(publisher_->version(), 2u);
  }
};

TEST_F(LargeDeltaPushTest, CommitOfA64MiBDeltaHoldsAtMostTheHeadPlus64MiB) { Run(64); }
// By hand: push_test --gtest_also_run_disabled_tests --gtest_filter='*1GiB*'
TEST_F(LargeDeltaPushTest, DISABLED_CommitOfA1GiBDeltaHoldsAtMostTheHeadPlus64MiB) { Run(1024); }

// Bytes this process passed to write(2) so far (/proc/self/io wchar).
uint64_t BytesWritten() {
  std::ifstream io("/proc/self/io");
  std::string key;
  uint64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  return 0;
}

TEST(LedgerTest, AChangeDoesNotRewriteEveryRowsMetadata) {
  std::string pattern = (fs::temp_directory_path() / "ledger_test.XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::string path = pattern + "/ledger.log";
  {
    auto ledger = Ledger::Open(path);
    ASSERT_TRUE(ledger.ok()) << ledger.status().ToString();
    const std::string big(256 << 10, 'm');  // a client may send up to 1 MiB per row
    for (uint64_t version = 1; version <= 20; ++version) {
      LedgerRow row;
      row.version = version;
      row.source = VersionSource::kPush;
      row.metadata = {{"notes", big}};
      ASSERT_TRUE((*ledger)->Record(std::move(row)).ok());
    }
    const uint64_t before = BytesWritten();
    ASSERT_TRUE((*ledger)->SetPin(PinState{3, 21, 1}).ok());
    LedgerRow row;
    row.version = 21;
    row.source = VersionSource::kPin;
    row.pinned_to = 3;
    ASSERT_TRUE((*ledger)->Record(std::move(row)).ok());
    const uint64_t written = BytesWritten() - before;
    EXPECT_LT(written, 16u << 10) << "a pin and a small row rewrote " << written << " bytes";
  }
  // Everything survives a reopen.
  auto reopened = Ledger::Open(path);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  ASSERT_EQ((*reopened)->Rows().size(), 21u);
  EXPECT_EQ((*reopened)->Rows()[4].metadata["notes"].get<std::string>().size(), 256u << 10);
  ASSERT_TRUE((*reopened)->pin().has_value());
  EXPECT_EQ((*reopened)->pin()->pinned_to, 3u);
  EXPECT_EQ((*reopened)->EventsJson().size(), 1u);
  std::error_code ignored;
  fs::remove_all(pattern, ignored);
}

// Recovery of the append-only ledger (sync/ledger.h), one case at a time.
class LedgerRecoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::string> made = Env::Default()->MakeTempDir("ledger_recovery.");
    ASSERT_TRUE(made.ok());
    dir_ = *made;
    path_ = dir_ + "/ledger.log";
  }
  void TearDown() override { (void)Env::Default()->RemoveAll(dir_); }

  static LedgerRow Row(uint64_t version) {
    LedgerRow row;
    row.version = version;
    row.source = VersionSource::kPush;
    row.metadata = {{"step", version}};
    return row;
  }
  // A ledger with rows 1..3 and a pin, closed.
  void WriteThreeRowsAndAPin() {
    auto ledger = Ledger::Open(path_);
    ASSERT_TRUE(ledger.ok()) << ledger.status().ToString();
    for (uint64_t v = 1; v <= 3; ++v) ASSERT_TRUE((*ledger)->Record(Row(v)).ok());
    ASSERT_TRUE((*ledger)->SetPin(PinState{1, 3, 5}).ok());
  }
  std::string Contents() const {
    auto bytes = Env::Default()->ReadFile(path_);
    return bytes.ok() ? Str(*bytes) : std::string();
  }
  void Overwrite(const std::string& text) const {
    ASSERT_TRUE(WriteFileAtomically(path_, std::as_bytes(std::span(text.data(), text.size()))).ok());
  }

  std::string dir_, path_;
};

TEST_F(LedgerRecoveryTest, TruncatedTrailingRecordIsIgnored) {
  WriteThreeRowsAndAPin();
  std::string text = Contents();
  const size_t last_line = text.rfind('\n', text.size() - 2) + 1;
  for (size_t cut : {text.size() - 1, last_line + 10, last_line + 1}) {
    Overwrite(text.substr(0, cut));
    auto ledger = Ledger::Open(path_);
    ASSERT_TRUE(ledger.ok()) << cut << ": " << ledger.status().ToString();
    EXPECT_EQ((*ledger)->Rows().size(), 3u);
    EXPECT_FALSE((*ledger)->pin().has_value()) << "the torn pin record counted";
    // The log was cut back to whole records: a new change lands on a clean line.
    ASSERT_TRUE((*ledger)->Record(Row(4)).ok());
    ledger->reset();
    auto reopened = Ledger::Open(path_);
    ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
    EXPECT_EQ((*reopened)->Rows().size(), 4u);
    Overwrite(text);
  }
}

TEST_F(LedgerRecoveryTest, ChecksumMismatchBeforeTheEndIsCorruption) {
  WriteThreeRowsAndAPin();
  std::string text = Contents();
  const size_t second = text.find('\n') + 1;  // the first row's record
  text[second + 30] ^= 1;
  Overwrite(text);
  auto ledger = Ledger::Open(path_);
  ASSERT_FALSE(ledger.ok());
  EXPECT_EQ(ledger.status().code(), StatusCode::kCorruption);
  EXPECT_NE(ledger.status().message().find("at byte " + std::to_string(second)), std::string::npos)
      << ledger.status().message();
}

TEST_F(LedgerRecoveryTest, DeepJsonInARecordIsCorruptionNotACrash) {
  WriteThreeRowsAndAPin();
  const std::string json = "{\"row\": " + Nested(100000) + "}";
  // Framed and checksummed as the publisher would write it: only the parse can refuse it.
  Overwrite(Contents() + Xxh3Hex(json) + " " + json + "\n");
  auto ledger = Ledger::Open(path_);
  ASSERT_FALSE(ledger.ok());
  EXPECT_EQ(ledger.status().code(), StatusCode::kCorruption);
  EXPECT_NE(ledger.status().message().find("nested deeper than 64"), std::string::npos)
      << ledger.status().message();
}

TEST_F(LedgerRecoveryTest, AFormat1LedgerIsTakenOver) {
  const std::string old_json =
      json{{"format", 1},
           {"rows", {ToJson(Row(1)), ToJson(Row(2))}},
           {"pin", ToJson(std::optional<PinState>(PinState{1, 2, 9}))},
           {"events", {{{"event", "pin"}, {"at_unix_ms", 9}}}}}
          .dump();
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/ledger.json",
                                  std::as_bytes(std::span(old_json.data(), old_json.size())))
                  .ok());
  {
    auto ledger = Ledger::Open(path_);
    ASSERT_TRUE(ledger.ok()) << ledger.status().ToString();
    EXPECT_EQ((*ledger)->Rows().size(), 2u);
    EXPECT_EQ((*ledger)->pin()->published_as, 2u);
  }
  EXPECT_FALSE(fs::exists(dir_ + "/ledger.json"));
  auto reopened = Ledger::Open(path_);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_EQ((*reopened)->Rows().size(), 2u);
  EXPECT_EQ((*reopened)->Rows()[1].metadata["step"], 2);
  EXPECT_EQ((*reopened)->pin()->pinned_to, 1u);
  EXPECT_EQ((*reopened)->EventsJson().size(), 1u);
}

// Fails every Sync of an appendable file while `fail` is set: an fsync that reports EIO.
class FailingSyncEnv : public EnvWrapper {
 public:
  FailingSyncEnv() : EnvWrapper(Env::Default()) {}
  std::atomic<bool> fail{false};
  Result<std::unique_ptr<WritableFile>> NewAppendableFile(const std::string& path) override {
    FW_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, target()->NewAppendableFile(path));
    return std::unique_ptr<WritableFile>(new File(std::move(file), &fail));
  }

 private:
  class File : public WritableFile {
   public:
    File(std::unique_ptr<WritableFile> file, std::atomic<bool>* fail) : file_(std::move(file)), fail_(fail) {}
    Status Append(std::span<const std::byte> bytes) override { return file_->Append(bytes); }
    Status Sync() override {
      return *fail_ ? Status::IOError(file_->path() + ": fsync: injected fault") : file_->Sync();
    }
    Status Close() override { return file_->Close(); }
    const std::string& path() const override { return file_->path(); }
    int fd() const override { return file_->fd(); }

   private:
    std::unique_ptr<WritableFile> file_;
    std::atomic<bool>* fail_;
  };
};

TEST_F(LedgerRecoveryTest, AFailedFsyncIsNotAcknowledgedAndTheNextChangeRewrites) {
  FailingSyncEnv env;
  auto ledger = Ledger::Open(path_, &env);
  ASSERT_TRUE(ledger.ok()) << ledger.status().ToString();
  ASSERT_TRUE((*ledger)->Record(Row(1)).ok());
  env.fail = true;
  const Status failed = (*ledger)->Record(Row(2));
  EXPECT_EQ(failed.code(), StatusCode::kIOError);
  EXPECT_NE(failed.message().find("injected"), std::string::npos);
  EXPECT_EQ((*ledger)->Rows().size(), 1u);  // not acknowledged, not kept
  EXPECT_FALSE((*ledger)->SetPin(PinState{1, 1, 1}).ok());
  EXPECT_FALSE((*ledger)->pin().has_value());
  env.fail = false;
  ASSERT_TRUE((*ledger)->Record(Row(2)).ok());
  ledger->reset();
  auto reopened = Ledger::Open(path_);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  ASSERT_EQ((*reopened)->Rows().size(), 2u);  // the unacknowledged bytes did not survive
  EXPECT_FALSE((*reopened)->pin().has_value());
}

TEST(UploadStoreTest, ASmallPartIsWrittenWhileA64MiBPartIsInFlight) {
  std::string pattern = (fs::temp_directory_path() / "uploads_test.XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  UploadStoreOptions options;
  options.dir = pattern + "/staging";
  auto store = UploadStore::Open(options);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto spec = [](uint64_t size) {
    UploadSpec spec;
    spec.size = size;
    spec.files = {{"model.safetensors", size}};
    spec.digest = {"xxh3_64", "0000000000000000"};
    return spec;
  };
  auto big = (*store)->Create(spec(64 << 20));
  auto small = (*store)->Create(spec(4096));
  ASSERT_TRUE(big.ok() && small.ok());
  // A disk that takes its time: the big upload's file becomes a FIFO nobody reads yet, so
  // its 64 MiB write stays in flight until the test opens the other end.
  const std::string fifo = options.dir + "/" + big->id + "/model.safetensors";
  ASSERT_EQ(::unlink(fifo.c_str()), 0);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::vector<std::byte> part(64 << 20, std::byte{7});
  auto slow = std::async(std::launch::async, [&] { return (*store)->Write(big->id, 0, part); });
  std::this_thread::sleep_for(200ms);  // the big write is in flight
  const std::vector<std::byte> bytes(4096, std::byte{1});
  auto quick = std::async(std::launch::async, [&] { return (*store)->Write(small->id, 0, bytes); });
  const bool completed = quick.wait_for(2s) == std::future_status::ready;
  EXPECT_TRUE(completed) << "the small write waited for the 64 MiB one";
  // Quotas still hold while the big write is in flight (asked only when the store is not
  // stuck behind it, so that the old behaviour fails here instead of hanging).
  if (completed) {
    EXPECT_EQ((*store)->staged_bytes(), (64u << 20) + 4096u);
  }
  // Release the slow writer (it cannot write a FIFO at an offset: it fails, which is fine).
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  (void)slow.get();
  ::close(reader);
  auto quick_result = quick.get();
  ASSERT_TRUE(quick_result.ok()) << quick_result.status().ToString();
  EXPECT_EQ(quick_result->received_bytes, 4096u);
  store->reset();
  std::error_code ignored;
  fs::remove_all(pattern, ignored);
}

TEST_F(PushTest, WaitNeedsAReadTokenWhenOnlyScopedTokensAreConfigured) {
  options_.common.token.clear();
  push_.token.clear();
  options_.common.scoped_tokens = {{"dashboard-token", transport::kScopeRead},
                                   {"sampler-token", transport::kScopeSample}};
  options_.watch_dir = (dir_ / "drops").string();
  fs::create_directories(options_.watch_dir);
  StartPublisher();
  for (const char* target : {"/v1/wait?version=5&timeout_ms=200", "/v1/readiness", "/v1/versions"}) {
    EXPECT_EQ(Call("GET", target, {}, "").status, 401) << target;
    EXPECT_EQ(Call("GET", target, {}, "sampler-token").status, 403) << target;
    EXPECT_EQ(Call("GET", target, {}, "dashboard-token").status, 200) << target;
  }
}

TEST_F(PushTest, WaitIsCappedInTimeAndInWaiters) {
  StartPublisher();
  // Ready at once (no worker is needed): the answer says the wait it was granted.
  Answer capped = Call("GET", "/v1/wait?min_workers=0&timeout_ms=600000", {}, kReadToken);
  ASSERT_EQ(capped.status, 200) << capped.body.dump();
  EXPECT_EQ(capped.body["timeout_ms"], 60000) << capped.body.dump();
  // 32 waiters hold their slots; the 33rd is refused at once, and other routes still answer.
  std::vector<std::future<Answer>> waiters;
  for (int i = 0; i < 32; ++i) {
    waiters.push_back(std::async(std::launch::async, [&] {
      return Call("GET", "/v1/wait?version=9&timeout_ms=4000", {}, kReadToken);
    }));
  }
  std::this_thread::sleep_for(1000ms);
  const auto start = std::chrono::steady_clock::now();
  Answer refused = Call("GET", "/v1/wait?version=9&timeout_ms=4000", {}, kReadToken);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1000ms);
  EXPECT_EQ(refused.status, 503) << refused.body.dump();
  EXPECT_EQ(refused.code(), "too_many_waiters");
  EXPECT_EQ(Call("GET", "/v1/versions", {}, kReadToken).status, 200);
  for (auto& waiter : waiters) EXPECT_EQ(waiter.get().status, 200);
  // Once they are gone, a new waiter is served.
  EXPECT_EQ(Call("GET", "/v1/wait?min_workers=0", {}, kReadToken).status, 200);
}

}  // namespace
}  // namespace flywheel::sync
