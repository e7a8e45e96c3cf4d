// Streamed keyframes and joins (issue 33 part 4).
//
// KeyframeLogTest: the version log writes keyframes as streamed (format-2) containers and
// hands their pieces to AppendOptions::on_stream while it encodes them; an old log whose
// keyframe is format 1 still serves a joining worker.
// KeyframeStagerTest: sync::KeyframeStager fed piece by piece, without a network: tensors
// are staged and verified while the keyframe arrives, Take hands over only a whole,
// verified checkpoint, a corrupt chunk mid-keyframe leaves nothing to take, and absurd
// declared sizes allocate nothing.
// JoinTest: an in-process sync::Server with crafted catalogs and a sync::Worker: a worker
// joining while the keyframe still streams stages it ahead and serves only whole versions;
// a piece flipped on the wire mid-keyframe is refetched and nothing half-applied is served.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/env.h"
#include "checkpoint/hash.h"
#include "delta/delta.h"
#include "delta/keyframe_stream.h"
#include "ops/process.h"
#include "sync/keyframe_stager.h"
#include "sync/publisher.h"
#include "sync/server.h"
#include "sync/upstream.h"
#include "sync/version_log.h"
#include "sync/worker.h"
#include "testing/fault_proxy.h"
#include "tests/delta/test_checkpoints.h"
#include "tests/sync/crafted_upstream.h"

namespace flywheel::sync {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using json = nlohmann::json;
using flywheel::testing::RandomCheckpoint;
using flywheel::testing::HashOf;
using flywheel::testing::SameBytes;
using flywheel::testing::TensorSpec;

constexpr uint64_t kPieceBytes = 64 << 10;
constexpr auto kWait = std::chrono::milliseconds(20000);

// About 3 MB of bf16 in four tensors, plus an awkwardly sized f32 one.
std::vector<TensorSpec> Specs() {
  return {
      {"model.embed_tokens.weight", DType::kBF16, {1024, 512}},
      {"model.layers.0.mlp.up_proj.weight", DType::kBF16, {512, 1024}},
      {"model.layers.1.mlp.up_proj.weight", DType::kBF16, {512, 733}},
      {"model.layers.1.mlp.down_proj.weight", DType::kBF16, {256, 1002}},
      {"model.norm.weight", DType::kF32, {733}},
  };
}

using flywheel::testing::BytesSink;

// A streamed keyframe of `target` with small chunks (several per tensor).
std::vector<std::byte> StreamedKeyframe(const OwnedCheckpoint& target, uint64_t version,
                                        uint64_t* bound = nullptr) {
  delta::EncodeOptions options;
  options.target_version = version;
  options.chunk_bytes = 128 << 10;
  BytesSink sink;
  const Status encoded = delta::EncodeKeyframeStreamed(target.view(), options, sink);
  EXPECT_TRUE(encoded.ok()) << encoded.ToString();
  if (bound != nullptr) *bound = sink.bound;
  return std::move(sink.bytes);
}

ArtifactInfo KeyframeEntry(uint64_t version, const Hash128& hash, const std::vector<std::byte>& bytes) {
  ArtifactInfo info;
  info.kind = ArtifactKind::kKeyframe;
  info.target_version = version;
  info.target_hash = hash;
  info.size_bytes = bytes.size();
  info.piece_bytes = kPieceBytes;
  info.piece_hashes = PieceHashes(bytes, kPieceBytes);
  return info;
}

// What a publisher announces while `finished` is still encoded: its first `pieces` pieces.
ArtifactInfo StreamingEntry(const ArtifactInfo& finished, size_t pieces, uint64_t bound) {
  ArtifactInfo partial = finished;
  partial.streaming = true;
  partial.target_hash = Hash128{};
  partial.piece_hashes.resize(pieces);
  partial.size_bytes = pieces * finished.piece_bytes;
  partial.size_bound = bound;
  return partial;
}

fs::path TempDir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() /
                 ("keyframe_stream_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// ---- the version log ---------------------------------------------------------------------

TEST(KeyframeLogTest, KeyframesAreStreamedContainersServedWhileEncoded) {
  const fs::path dir = TempDir("log");
  VersionLogOptions options;
  options.dir = dir.string();
  options.piece_bytes = kPieceBytes;
  Result<std::unique_ptr<VersionLog>> log = VersionLog::Open(options);
  ASSERT_TRUE(log.ok()) << log.status().ToString();
  const OwnedCheckpoint v1 = RandomCheckpoint(Specs(), 1);
  std::vector<ArtifactInfo> partials;
  AppendOptions append;
  append.on_stream = [&](const ArtifactInfo& partial, std::shared_ptr<const GrowableBytes>) {
    partials.push_back(partial);
  };
  Result<AppendResult> written = (*log)->Append(1, v1.view(), append);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  ASSERT_EQ(written->artifacts.size(), 1u);
  const ArtifactInfo& keyframe = written->artifacts[0];
  ASSERT_EQ(keyframe.kind, ArtifactKind::kKeyframe);
  // Served while encoded: streaming entries of the keyframe whose pieces are the final ones.
  ASSERT_FALSE(partials.empty());
  for (const ArtifactInfo& partial : partials) {
    EXPECT_EQ(partial.kind, ArtifactKind::kKeyframe);
    EXPECT_TRUE(partial.streaming);
    EXPECT_GE(partial.size_bound, keyframe.size_bytes);
    ASSERT_LE(partial.piece_hashes.size(), keyframe.piece_hashes.size());
    EXPECT_TRUE(std::equal(partial.piece_hashes.begin(), partial.piece_hashes.end(),
                           keyframe.piece_hashes.begin()));
  }
  Result<std::vector<std::byte>> bytes = Env::Default()->ReadFile(keyframe.path);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_TRUE(delta::StreamReader::IsStreamed(*bytes)) << "the keyframe is not format 2";
  EXPECT_EQ(PieceHashes(*bytes, kPieceBytes), keyframe.piece_hashes);
  Result<delta::DeltaView> view = delta::DeltaView::Parse(*bytes);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  Result<OwnedCheckpoint> decoded = delta::DecodeKeyframe(*view);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_TRUE(SameBytes(*decoded, v1));
  fs::remove_all(dir);
}

// ---- the stager, piece by piece ------------------------------------------------------------

class KeyframeStagerTest : public ::testing::Test {
 protected:
  // Feeds `bytes` as `info`'s pieces up to `pieces` (in order) to `stager`.
  static void Feed(Download& download, KeyframeStager& stager, const std::vector<std::byte>& bytes,
                   size_t pieces) {
    for (size_t i = 0; i < pieces; ++i) {
      if (download.have[i]) continue;
      const uint64_t begin = i * kPieceBytes;
      const uint64_t end = std::min<uint64_t>(bytes.size(), begin + kPieceBytes);
      std::memcpy(download.bytes->data() + begin, bytes.data() + begin, end - begin);
      download.have[i] = true;
      ++download.have_count;
      stager.Advance(download);
    }
  }
  asio::thread_pool pool_{2};
};

TEST_F(KeyframeStagerTest, StagesTensorByTensorAndTakesOnlyAWholeVerifiedKeyframe) {
  const OwnedCheckpoint v1 = RandomCheckpoint(Specs(), 2);
  const std::vector<std::byte> bytes = StreamedKeyframe(v1, 1);
  const ArtifactInfo info = KeyframeEntry(1, HashOf(v1), bytes);
  ASSERT_GE(info.piece_hashes.size(), 8u);
  Download download(info);
  auto stager = std::make_shared<KeyframeStager>(pool_, download.bytes, uint64_t{1} << 30);
  Feed(download, *stager, bytes, info.piece_hashes.size() / 2);
  // Half the keyframe in: the chunks it holds are staged and the first tensors verified.
  ASSERT_TRUE(ops::WaitUntil([&] { return stager->tensors_verified() >= 1; }, kWait,
                             "a tensor verified from the first half").ok());
  EXPECT_GT(stager->chunks_staged(), 0u);
  EXPECT_LT(stager->tensors_verified(), v1.tensors.size());
  Feed(download, *stager, bytes, info.piece_hashes.size());
  Result<delta::DeltaView> view = delta::DeltaView::Parse(bytes);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  std::string why_not;
  std::optional<OwnedCheckpoint> staged = stager->Take(view->manifest(), &why_not);
  ASSERT_TRUE(staged.has_value()) << why_not;
  EXPECT_TRUE(SameBytes(*staged, v1));
  EXPECT_EQ(stager->tensors_verified(), v1.tensors.size());
  pool_.join();
}

TEST_F(KeyframeStagerTest, ACorruptChunkMidKeyframeLeavesNothingToTake) {
  const OwnedCheckpoint v1 = RandomCheckpoint(Specs(), 3);
  std::vector<std::byte> bytes = StreamedKeyframe(v1, 1);
  // Flip a byte in the middle (inside some chunk's payload): the pieces are hashed after
  // the flip, as if the publisher's own bytes were bad.
  bytes[bytes.size() / 2] ^= std::byte{0x10};
  const ArtifactInfo info = KeyframeEntry(1, HashOf(v1), bytes);
  Download download(info);
  auto stager = std::make_shared<KeyframeStager>(pool_, download.bytes, uint64_t{1} << 30);
  Feed(download, *stager, bytes, info.piece_hashes.size());
  delta::Manifest manifest;  // the whole container does not parse: take against the prologue
  delta::StreamReader reader;
  ASSERT_TRUE(reader.Advance(std::span<const std::byte>(bytes).first(bytes.size() / 2 - 1024)).ok());
  manifest = reader.manifest();
  std::string why_not;
  EXPECT_FALSE(stager->Take(manifest, &why_not).has_value());
  EXPECT_NE(why_not.find("checksum"), std::string::npos) << why_not;
  EXPECT_NE(stager->error(), "");
  pool_.join();
}

TEST_F(KeyframeStagerTest, AbsurdDeclaredSizesAllocateNothing) {
  const OwnedCheckpoint v1 = RandomCheckpoint(Specs(), 4);
  const std::vector<std::byte> bytes = StreamedKeyframe(v1, 1);
  const ArtifactInfo info = KeyframeEntry(1, HashOf(v1), bytes);
  Download download(info);
  // A limit below the declared sizes (the worker's memory limit, scaled down).
  auto stager = std::make_shared<KeyframeStager>(pool_, download.bytes, uint64_t{1} << 20);
  Feed(download, *stager, bytes, info.piece_hashes.size());
  Result<delta::DeltaView> view = delta::DeltaView::Parse(bytes);
  ASSERT_TRUE(view.ok());
  std::string why_not;
  EXPECT_FALSE(stager->Take(view->manifest(), &why_not).has_value());
  EXPECT_NE(stager->error().find(std::to_string(uint64_t{1} << 20)), std::string::npos)
      << stager->error();
  EXPECT_EQ(stager->chunks_staged(), 0u);
  // The codec's own check names the limit too.
  delta::Manifest forged = view->manifest();
  Result<OwnedCheckpoint> refused = delta::AllocateKeyframeStaging(forged, 1000);
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status().ToString();
  pool_.join();
}

// ---- a worker joining --------------------------------------------------------------------

using crafted::CraftedSource;
using crafted::RunOnIo;

uint64_t U64(const json& status, const char* key) {
  auto it = status.find(key);
  return it != status.end() && it->is_number_unsigned() ? it->get<uint64_t>() : 0;
}

// A crafted upstream (sync::Server over CraftedSource) and one worker, optionally through a
// fault proxy; a watcher checks every version the worker serves against its hash.
class JoinTest : public crafted::CraftedUpstreamFixture {
 protected:
  void SetUp() override {}  // each test starts the roles: Start(corrupt_pieces)
  void Start(int corrupt_pieces) {
    corrupt_pieces_ = corrupt_pieces;
    StartRoles();
  }
  void Configure(ServerOptions& /*server*/, WorkerOptions& worker) override {
    worker.common.threads = 2;
  }
  uint16_t UpstreamPort(uint16_t server_port) override {
    if (corrupt_pieces_ == 0) return server_port;
    testing::FaultProxyOptions corrupt;
    corrupt.corrupt_pieces = corrupt_pieces_;
    proxy_.emplace(server_port, corrupt);
    return proxy_->port();
  }
  void TearDown() override {
    CraftedUpstreamFixture::TearDown();
    proxy_.reset();
  }

  int corrupt_pieces_ = 0;
  std::optional<testing::FaultProxy> proxy_;
};

// The first version's keyframe is announced while it still streams (half its pieces, no
// target hash): the joining worker fetches and stages those pieces' tensors, serves
// nothing meanwhile, and once the finished entry comes fetches only the rest and serves
// exactly v1, built from what it staged.
TEST_F(JoinTest, WorkerJoiningMidKeyframeServesOnlyWholeVersions) {
  Start(0);
  const OwnedCheckpoint v1 = RandomCheckpoint(Specs(), 5);
  const Hash128 hash_1 = HashOf(v1);
  uint64_t bound = 0;
  const std::vector<std::byte> bytes = StreamedKeyframe(v1, 1, &bound);
  const ArtifactInfo k1 = KeyframeEntry(1, hash_1, bytes);
  const size_t half = k1.piece_hashes.size() / 2;
  source_.Put(k1, bytes);
  WatchWeights({{1, hash_1}});
  Announce({StreamingEntry(k1, half, bound)}, 0, Hash128{});
  ASSERT_TRUE(WaitWorker("staging the streaming keyframe",
                         [](const json& s) { return U64(s, "arriving_chunks_decoded") > 0; }));
  std::this_thread::sleep_for(300ms);  // by design: a partial keyframe is never served
  json status = WorkerStatus();
  EXPECT_EQ(U64(status, "version"), 0u) << status.dump(1);
  EXPECT_EQ(U64(status, "pieces_verified"), half) << status.dump(1);
  const uint64_t staged_ahead = U64(status, "arriving_chunks_decoded");

  Announce({k1}, 1, hash_1);
  ASSERT_TRUE(WaitWorker("serving v1", [&](const json& s) {
    return U64(s, "version") == 1 && s.value("weights_hash", "") == hash_1.ToHex();
  }));
  status = WorkerStatus();
  EXPECT_GE(U64(status, "last_apply_chunks_early"), staged_ahead) << status.dump(1);
  EXPECT_EQ(U64(status, "pieces_verified"), k1.piece_hashes.size()) << status.dump(1);
  EXPECT_EQ(U64(status, "artifacts_rejected"), 0u) << status.dump(1);
  worker_->WithWeights([&](uint64_t version, const CheckpointView& weights) {
    ASSERT_EQ(version, 1u);
    ASSERT_EQ(weights.size(), v1.tensors.size());
    for (size_t i = 0; i < weights.size(); ++i) {
      EXPECT_TRUE(std::equal(weights[i].data.begin(), weights[i].data.end(),
                             v1.tensors[i].data.begin(), v1.tensors[i].data.end()));
    }
  });
  const std::vector<std::string> violations = StopWatching();
  EXPECT_GT(samples_.load(), 0u);
  EXPECT_TRUE(violations.empty()) << violations.size() << " violations, first: " << violations.front();
}

// Pieces flipped on the wire while the keyframe arrives are caught by their piece hash,
// fetched again and never staged: the worker serves exactly v1, every chunk staged ahead.
TEST_F(JoinTest, FlippedPieceMidKeyframeIsRefetchedNothingHalfApplied) {
  Start(/*corrupt_pieces=*/3);
  const OwnedCheckpoint v1 = RandomCheckpoint(Specs(), 6);
  const Hash128 hash_1 = HashOf(v1);
  const std::vector<std::byte> bytes = StreamedKeyframe(v1, 1);
  const ArtifactInfo k1 = KeyframeEntry(1, hash_1, bytes);
  source_.Put(k1, bytes);
  WatchWeights({{1, hash_1}});
  Announce({k1}, 1, hash_1);
  ASSERT_TRUE(WaitWorker("serving v1", [&](const json& s) {
    return U64(s, "version") == 1 && s.value("weights_hash", "") == hash_1.ToHex();
  }));
  const json status = WorkerStatus();
  EXPECT_GE(U64(status, "pieces_rejected"), 1u) << status.dump(1);
  EXPECT_EQ(U64(status, "artifacts_rejected"), 0u) << status.dump(1);
  Result<delta::DeltaView> view = delta::DeltaView::Parse(bytes);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(U64(status, "last_apply_chunks_early"), view->manifest().chunks.size()) << status.dump(1);
  const std::vector<std::string> violations = StopWatching();
  EXPECT_TRUE(violations.empty()) << violations.size() << " violations, first: " << violations.front();
}

// A log written before keyframes streamed (format 1) serves a joining worker: the worker
// sees a buffered container, stages nothing and decodes it whole, then applies the delta.
TEST(KeyframeOldLogTest, FormatOneKeyframeInAnOldLogStillServes) {
  const fs::path dir = TempDir("old_log");
  const OwnedCheckpoint v1 = RandomCheckpoint(Specs(), 7);
  OwnedCheckpoint v2 = RandomCheckpoint(Specs(), 7);
  for (OwnedTensor& t : v2.tensors) {
    for (size_t i = 0; i < t.data.size(); i += 97) t.data[i] ^= std::byte{1};
  }
  {
    VersionLogOptions old_options;
    old_options.dir = dir.string();
    old_options.piece_bytes = kPieceBytes;
    old_options.stream_deltas = false;  // as logs were written before format 2
    Result<std::unique_ptr<VersionLog>> log = VersionLog::Open(old_options);
    ASSERT_TRUE(log.ok()) << log.status().ToString();
    Result<std::vector<ArtifactInfo>> written = (*log)->Append(1, v1.view());
    ASSERT_TRUE(written.ok()) << written.status().ToString();
    Result<std::vector<std::byte>> bytes = Env::Default()->ReadFile((*written)[0].path);
    ASSERT_TRUE(bytes.ok());
    ASSERT_FALSE(delta::StreamReader::IsStreamed(*bytes)) << "the old keyframe must be format 1";
  }
  asio::io_context io(1);
  auto work = asio::make_work_guard(io);
  std::thread io_thread([&] { io.run(); });
  PublisherOptions publisher_options;
  publisher_options.common.region = "home";
  publisher_options.common.node_id = "publisher";
  publisher_options.common.http = {"127.0.0.1", 0};
  publisher_options.listen = {"127.0.0.1", 0};
  publisher_options.log.dir = dir.string();
  publisher_options.log.piece_bytes = kPieceBytes;
  std::unique_ptr<Publisher> publisher;
  std::unique_ptr<Worker> worker;
  flywheel::Status started = flywheel::Status::Ok();
  RunOnIo(io, [&] {
    Result<std::unique_ptr<Publisher>> p = Publisher::Start(io.get_executor(), publisher_options);
    if (!p.ok()) {
      started = p.status();
      return;
    }
    publisher = std::move(*p);
  });
  ASSERT_TRUE(started.ok()) << started.ToString();
  Result<std::vector<ArtifactInfo>> published = publisher->Publish(2, v2.view());
  ASSERT_TRUE(published.ok()) << published.status().ToString();
  WorkerOptions worker_options;
  worker_options.common.region = "home";
  worker_options.common.node_id = "worker";
  worker_options.common.http = {"127.0.0.1", 0};
  worker_options.upstreams = {{"127.0.0.1", publisher->port()}};
  RunOnIo(io, [&] {
    Result<std::unique_ptr<Worker>> w = Worker::Start(io.get_executor(), worker_options);
    if (!w.ok()) {
      started = w.status();
      return;
    }
    worker = std::move(*w);
  });
  ASSERT_TRUE(started.ok()) << started.ToString();
  const Hash128 hash_2 = HashOf(v2);
  const flywheel::Status served = ops::WaitUntil(
      [&] { return worker->version() == 2 && worker->weights_hash() == hash_2; }, kWait,
      "the worker serving v2 from a format-1 keyframe and a delta");
  EXPECT_TRUE(served.ok()) << served.ToString();
  worker->Stop();
  publisher->Stop();
  work.reset();
  (void)ops::WaitUntil([&] { return io.stopped(); }, 100ms, "the io_context to run out of work");
  io.stop();
  io_thread.join();
  worker.reset();
  publisher.reset();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace flywheel::sync
