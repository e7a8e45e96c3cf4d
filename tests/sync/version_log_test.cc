#include "sync/version_log.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "delta/delta_file.h"
#include "tests/delta/test_checkpoints.h"

namespace flywheel::sync {
namespace {

namespace fs = std::filesystem;
using testing::DirectlyChangedWords;
using flywheel::testing::Mutate;
using flywheel::testing::RandomCheckpoint;
using flywheel::testing::SameBytes;
using flywheel::testing::TensorSpec;

std::vector<TensorSpec> SmallSpecs() {
  return {
      {"embed.weight", DType::kBF16, {96, 40}},
      {"layers.0.q_proj.weight", DType::kBF16, {40, 40}},
      {"layers.0.norm.weight", DType::kF32, {40}},
      {"scalar", DType::kF32, {}},
  };
}

std::string ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string Kinds(const std::vector<ArtifactInfo>& artifacts) {
  std::string kinds;
  for (const ArtifactInfo& a : artifacts) {
    if (!kinds.empty()) kinds += " ";
    kinds += (a.kind == ArtifactKind::kKeyframe ? "K" : "D") + std::to_string(a.target_version);
  }
  return kinds;
}

class VersionLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "version_log_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  VersionLogOptions Options() const {
    VersionLogOptions options;
    options.dir = (dir_ / "state").string();
    options.keyframe_every = 3;
    options.retain = 100;
    options.piece_bytes = 1000;  // several pieces per artifact
    options.threads = 2;
    return options;
  }

  std::unique_ptr<VersionLog> OpenOrDie(const VersionLogOptions& options) {
    auto log = VersionLog::Open(options);
    EXPECT_TRUE(log.ok()) << log.status().ToString();
    return log.ok() ? std::move(log).value() : nullptr;
  }

  // The checkpoint of `version`: a random start, then a few words changed per version.
  const OwnedCheckpoint& Version(uint64_t version) {
    auto it = checkpoints_.find(version);
    if (it != checkpoints_.end()) return it->second;
    OwnedCheckpoint ckpt = checkpoints_.empty()
                               ? RandomCheckpoint(SmallSpecs(), 7)
                               : Mutate(std::prev(checkpoints_.end())->second, 0.01, version);
    return checkpoints_.emplace(version, std::move(ckpt)).first->second;
  }

  std::vector<ArtifactInfo> AppendOrDie(VersionLog& log, uint64_t version) {
    auto added = log.Append(version, Version(version).view());
    EXPECT_TRUE(added.ok()) << "version " << version << ": " << added.status().ToString();
    return added.ok() ? *added : std::vector<ArtifactInfo>{};
  }

  std::set<std::string> ArtifactFiles() const {
    std::set<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_ / "state" / "artifacts")) {
      names.insert(entry.path().string());
    }
    return names;
  }

  static std::set<std::string> Paths(const std::vector<ArtifactInfo>& artifacts) {
    std::set<std::string> paths;
    for (const ArtifactInfo& a : artifacts) paths.insert(a.path);
    return paths;
  }

  fs::path dir_;
  std::map<uint64_t, OwnedCheckpoint> checkpoints_;
};

TEST_F(VersionLogTest, FirstVersionIsKeyframeOnly) {
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  EXPECT_TRUE(log->empty());
  EXPECT_EQ(log->head_version(), 0u);
  std::vector<ArtifactInfo> added = AppendOrDie(*log, 1);
  ASSERT_EQ(added.size(), 1u);
  const ArtifactInfo& keyframe = added[0];
  EXPECT_EQ(keyframe.kind, ArtifactKind::kKeyframe);
  EXPECT_EQ(keyframe.target_version, 1u);
  EXPECT_EQ(keyframe.base_version, 0u);
  EXPECT_EQ(keyframe.base_hash, Hash128{});
  EXPECT_EQ(keyframe.target_hash, *CheckpointHash(Version(1).view()));
  EXPECT_EQ(keyframe.size_bytes, fs::file_size(keyframe.path));
  EXPECT_EQ(keyframe.piece_bytes, 1000u);
  EXPECT_EQ(keyframe.piece_hashes.size(), (keyframe.size_bytes + 999) / 1000);
  EXPECT_EQ(fs::path(keyframe.path),
            dir_ / "state" / "artifacts" / "v00000000000000000001.keyframe");
  EXPECT_FALSE(log->empty());
  EXPECT_EQ(log->head_version(), 1u);
  EXPECT_EQ(log->last_version(), 1u);
  EXPECT_EQ(log->head_hash(), keyframe.target_hash);
  EXPECT_EQ(log->Artifacts(), added);
  std::vector<Hash128> tensor_hashes = log->head_tensor_hashes();
  ASSERT_EQ(tensor_hashes.size(), Version(1).tensors.size());
  for (size_t i = 0; i < tensor_hashes.size(); ++i) {
    EXPECT_EQ(tensor_hashes[i], TensorHash(Version(1).view()[i]));
  }
}

TEST_F(VersionLogTest, LaterVersionsAreDeltasFromTheHead) {
  VersionLogOptions options = Options();
  options.keyframe_every = 100;
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  AppendOrDie(*log, 1);
  uint64_t previous = 1;
  for (uint64_t version : {2, 5, 9}) {  // gaps between version numbers are fine
    std::vector<ArtifactInfo> added = AppendOrDie(*log, version);
    ASSERT_EQ(added.size(), 1u);
    EXPECT_EQ(added[0].kind, ArtifactKind::kDelta);
    EXPECT_EQ(added[0].base_version, previous);
    EXPECT_EQ(added[0].target_version, version);
    EXPECT_EQ(added[0].base_hash, *CheckpointHash(Version(previous).view()));
    EXPECT_EQ(added[0].target_hash, *CheckpointHash(Version(version).view()));
    EXPECT_LT(added[0].size_bytes, log->Artifacts().front().size_bytes);  // sparse changes
    EXPECT_EQ(log->head_version(), version);
    previous = version;
  }
  EXPECT_EQ(Kinds(log->Artifacts()), "K1 D2 D5 D9");
}

TEST_F(VersionLogTest, KeyframeEveryKVersionsAlsoHasADelta) {
  auto log = OpenOrDie(Options());  // keyframe_every = 3
  ASSERT_TRUE(log);
  for (uint64_t v = 1; v <= 7; ++v) AppendOrDie(*log, v);
  EXPECT_EQ(Kinds(log->Artifacts()), "K1 D2 D3 K4 D4 D5 D6 K7 D7");
  for (const ArtifactInfo& a : log->Artifacts()) {
    if (a.kind == ArtifactKind::kDelta) {
      EXPECT_EQ(a.base_version, a.target_version - 1);
    }
  }

  VersionLogOptions every_version = Options();
  every_version.dir = (dir_ / "every").string();
  every_version.keyframe_every = 1;
  auto every = OpenOrDie(every_version);
  ASSERT_TRUE(every);
  for (uint64_t v = 1; v <= 3; ++v) AppendOrDie(*every, v);
  EXPECT_EQ(Kinds(every->Artifacts()), "K1 K2 D2 K3 D3");
}

TEST_F(VersionLogTest, CostBasedKeyframeWhenTheChainOutweighsAFraction) {
  VersionLogOptions options = Options();
  options.keyframe_every = 1000;  // the count never decides here
  options.keyframe_cost = 0.2;
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  uint64_t keyframe_bytes = 0, chain_bytes = 0, by_cost = 0;
  for (uint64_t v = 1; v <= 16; ++v) {
    Result<AppendResult> added = log->Append(v, Version(v).view(), AppendOptions{});
    ASSERT_TRUE(added.ok()) << added.status().ToString();
    const ArtifactInfo* keyframe = nullptr;
    const ArtifactInfo* delta = nullptr;
    for (const ArtifactInfo& a : added->artifacts) (a.kind == ArtifactKind::kKeyframe ? keyframe : delta) = &a;
    if (v == 1) {
      ASSERT_NE(keyframe, nullptr);
      EXPECT_EQ(added->keyframe_reason, "first");
    } else {
      ASSERT_NE(delta, nullptr) << "v" << v;
      // Due exactly when the deltas since the last keyframe, this one included, exceed
      // 0.2 x that keyframe.
      const bool due = static_cast<double>(chain_bytes + delta->size_bytes) > 0.2 * keyframe_bytes;
      EXPECT_EQ(keyframe != nullptr, due) << "v" << v << ": chain " << chain_bytes << " + "
                                          << delta->size_bytes << " vs keyframe " << keyframe_bytes;
      EXPECT_EQ(added->keyframe_reason, due ? "cost" : "") << "v" << v;
      by_cost += due;
    }
    if (keyframe != nullptr) {
      keyframe_bytes = keyframe->size_bytes;
      chain_bytes = 0;
    } else {
      chain_bytes += delta->size_bytes;
    }
    EXPECT_EQ(JoinBytes(log->Artifacts()), keyframe_bytes + chain_bytes) << "v" << v;
  }
  EXPECT_GE(by_cost, 2u) << "the deltas never added up to 0.2 of a keyframe: the test proves nothing";

  // 0 turns it off: the same versions, keyframes by count only.
  options.dir = (dir_ / "by-count").string();
  options.keyframe_cost = 0;
  options.keyframe_every = 5;
  auto by_count = OpenOrDie(options);
  ASSERT_TRUE(by_count);
  for (uint64_t v = 1; v <= 11; ++v) AppendOrDie(*by_count, v);
  EXPECT_EQ(Kinds(by_count->Artifacts()), "K1 D2 D3 D4 D5 K6 D6 D7 D8 D9 D10 K11 D11");
  options.keyframe_cost = -1;
  options.dir = (dir_ / "bad").string();
  EXPECT_FALSE(VersionLog::Open(options).ok());
}

TEST_F(VersionLogTest, KeyframeCadenceSurvivesReopenWithNewOptions) {
  VersionLogOptions options = Options();
  options.keyframe_every = 10;
  {
    auto log = OpenOrDie(options);
    ASSERT_TRUE(log);
    for (uint64_t v = 1; v <= 4; ++v) AppendOrDie(*log, v);
  }
  options.keyframe_every = 4;  // v2, v3, v4 and now v5 make four since the keyframe
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  std::vector<ArtifactInfo> added = AppendOrDie(*log, 5);
  EXPECT_EQ(Kinds(added), "K5 D5");
}

TEST_F(VersionLogTest, VersionsOnlyMoveForward) {
  {
    auto log = OpenOrDie(Options());
    ASSERT_TRUE(log);
    auto zero = log->Append(0, Version(1).view());
    EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
    AppendOrDie(*log, 5);
    const std::vector<ArtifactInfo> before = log->Artifacts();
    for (uint64_t stale : {5, 3}) {
      auto refused = log->Append(stale, Version(6).view());
      ASSERT_FALSE(refused.ok());
      EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(refused.status().message().find("version " + std::to_string(stale)),
                std::string::npos)
          << refused.status().message();
      EXPECT_NE(refused.status().message().find("version 5"), std::string::npos);
    }
    EXPECT_EQ(log->Artifacts(), before);
    EXPECT_EQ(ArtifactFiles(), Paths(before));
  }
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  EXPECT_EQ(log->last_version(), 5u);
  EXPECT_EQ(log->Append(5, Version(6).view()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(log->Append(4, Version(6).view()).status().code(), StatusCode::kInvalidArgument);
  AppendOrDie(*log, 6);
  EXPECT_EQ(log->head_version(), 6u);
}

TEST_F(VersionLogTest, LayoutChangeIsAKeyframeWithoutDelta) {
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  AppendOrDie(*log, 1);

  std::vector<TensorSpec> reshaped = SmallSpecs();
  reshaped[0].shape = {97, 40};
  const OwnedCheckpoint v2 = RandomCheckpoint(reshaped, 2);
  auto added = log->Append(2, v2.view());
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_EQ(Kinds(*added), "K2");

  // Same bytes and shapes but a dtype changed, then a tensor renamed, then reordered.
  OwnedCheckpoint v3 = v2;
  v3.tensors[2].dtype = DType::kI32;
  added = log->Append(3, v3.view());
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_EQ(Kinds(*added), "K3");
  OwnedCheckpoint v4 = v3;
  v4.tensors[1].name = "layers.0.k_proj.weight";
  added = log->Append(4, v4.view());
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_EQ(Kinds(*added), "K4");
  OwnedCheckpoint v5 = v4;
  std::swap(v5.tensors[0], v5.tensors[3]);
  added = log->Append(5, v5.view());
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_EQ(Kinds(*added), "K5");

  // The same layout again: back to deltas, from the new head.
  const OwnedCheckpoint v6 = Mutate(v5, 0.01, 6);
  added = log->Append(6, v6.view());
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  ASSERT_EQ(Kinds(*added), "D6");
  EXPECT_EQ((*added)[0].base_hash, *CheckpointHash(v5.view()));
  EXPECT_EQ(log->head_hash(), *CheckpointHash(v6.view()));
}

TEST_F(VersionLogTest, DeltasOffWritesKeyframesOnly) {
  VersionLogOptions options = Options();
  options.deltas = false;
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  for (uint64_t v = 1; v <= 4; ++v) {
    std::vector<ArtifactInfo> added = AppendOrDie(*log, v);
    EXPECT_EQ(Kinds(added), "K" + std::to_string(v));
  }
  EXPECT_EQ(Kinds(log->Artifacts()), "K1 K2 K3 K4");
}

TEST_F(VersionLogTest, RetentionKeepsLatestKeyframeAndNewestVersions) {
  VersionLogOptions options = Options();  // keyframes at 1, 4, 7
  options.retain = 2;
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  for (uint64_t v = 1; v <= 6; ++v) AppendOrDie(*log, v);
  // Everything from the keyframe at 4 on, though only 5 and 6 are the newest two.
  EXPECT_EQ(Kinds(log->Artifacts()), "K4 D4 D5 D6");
  EXPECT_EQ(ArtifactFiles(), Paths(log->Artifacts()));
  for (uint64_t v = 7; v <= 8; ++v) AppendOrDie(*log, v);
  EXPECT_EQ(Kinds(log->Artifacts()), "K7 D7 D8");
  EXPECT_EQ(ArtifactFiles(), Paths(log->Artifacts()));
  log.reset();

  // A wider window after a restart applies from the next Append; what was deleted stays
  // deleted.
  options.retain = 5;
  log = OpenOrDie(options);
  ASSERT_TRUE(log);
  EXPECT_EQ(Kinds(log->Artifacts()), "K7 D7 D8");
  for (uint64_t v = 9; v <= 12; ++v) AppendOrDie(*log, v);
  // Newest five: 8..12; latest keyframe: 10.
  EXPECT_EQ(Kinds(log->Artifacts()), "D8 D9 K10 D10 D11 D12");
  EXPECT_EQ(ArtifactFiles(), Paths(log->Artifacts()));

  options.retain = 0;
  log.reset();
  log = OpenOrDie(options);
  ASSERT_TRUE(log);
  AppendOrDie(*log, 13);
  EXPECT_EQ(Kinds(log->Artifacts()), "K13 D13");
  EXPECT_EQ(ArtifactFiles(), Paths(log->Artifacts()));
}

TEST_F(VersionLogTest, ReopenRecoversHeadAndArtifacts) {
  std::vector<ArtifactInfo> artifacts;
  Hash128 head_hash;
  std::vector<Hash128> tensor_hashes;
  {
    auto log = OpenOrDie(Options());
    ASSERT_TRUE(log);
    for (uint64_t v = 1; v <= 5; ++v) AppendOrDie(*log, v);
    artifacts = log->Artifacts();
    head_hash = log->head_hash();
    tensor_hashes = log->head_tensor_hashes();
  }
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  EXPECT_EQ(log->Artifacts(), artifacts);
  EXPECT_EQ(log->head_version(), 5u);
  EXPECT_EQ(log->last_version(), 5u);
  EXPECT_EQ(log->head_hash(), head_hash);
  EXPECT_EQ(log->head_tensor_hashes(), tensor_hashes);
  // The rebuilt head is the base of the next delta.
  std::vector<ArtifactInfo> added = AppendOrDie(*log, 6);
  ASSERT_EQ(Kinds(added), "D6");
  auto bytes = delta::ReadDeltaFile(added[0].path);
  ASSERT_TRUE(bytes.ok());
  auto view = delta::DeltaView::Parse(*bytes);
  ASSERT_TRUE(view.ok());
  auto applied = delta::ApplyToCopy(Version(5).view(), *view);
  ASSERT_TRUE(applied.ok()) << applied.status().ToString();
  EXPECT_TRUE(SameBytes(*applied, Version(6)));
}

TEST_F(VersionLogTest, ReopenRemovesLeftoversOfAnInterruptedAppend) {
  std::vector<ArtifactInfo> artifacts;
  {
    auto log = OpenOrDie(Options());
    ASSERT_TRUE(log);
    for (uint64_t v = 1; v <= 2; ++v) AppendOrDie(*log, v);
    artifacts = log->Artifacts();
  }
  const fs::path state = dir_ / "state";
  // A crash after writing version 3's artifacts but before log.json named them, one in the
  // middle of writing, and one in the middle of replacing log.json.
  WriteText(state / "artifacts" / "v00000000000000000003.delta", "not committed");
  WriteText(state / "artifacts" / ".v00000000000000000003.keyframe.tmp-1-2", "half");
  WriteText(state / ".log.json.tmp-1-2", "{");
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  EXPECT_EQ(log->Artifacts(), artifacts);
  EXPECT_EQ(ArtifactFiles(), Paths(artifacts));
  EXPECT_FALSE(fs::exists(state / ".log.json.tmp-1-2"));
  EXPECT_EQ(log->head_version(), 2u);
  EXPECT_EQ(Kinds(AppendOrDie(*log, 3)), "D3");
}

TEST_F(VersionLogTest, ReopenWithoutLogRemovesStrayArtifacts) {
  const fs::path artifacts = dir_ / "state" / "artifacts";
  fs::create_directories(artifacts);
  WriteText(artifacts / "v00000000000000000001.keyframe", "crashed before the first commit");
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  EXPECT_TRUE(log->empty());
  EXPECT_TRUE(ArtifactFiles().empty());
}

TEST_F(VersionLogTest, CorruptedArtifactFailsOpenNamingTheFile) {
  std::vector<ArtifactInfo> artifacts;
  {
    auto log = OpenOrDie(Options());
    ASSERT_TRUE(log);
    for (uint64_t v = 1; v <= 5; ++v) AppendOrDie(*log, v);
    artifacts = log->Artifacts();
  }
  // Both an artifact the head is rebuilt from (D5) and one it is not (D2).
  for (const char* name : {"D2", "D5", "K4"}) {
    SCOPED_TRACE(name);
    const ArtifactInfo* target = nullptr;
    for (const ArtifactInfo& a : artifacts) {
      if (Kinds({a}) == name) target = &a;
    }
    ASSERT_NE(target, nullptr);
    const std::string original = ReadText(target->path);
    std::string flipped = original;
    flipped[flipped.size() / 2] ^= 0x20;
    WriteText(target->path, flipped);
    auto log = VersionLog::Open(Options());
    ASSERT_FALSE(log.ok());
    EXPECT_EQ(log.status().code(), StatusCode::kCorruption);
    EXPECT_NE(log.status().message().find(target->path), std::string::npos)
        << log.status().message();
    EXPECT_NE(log.status().message().find("piece"), std::string::npos) << log.status().message();

    WriteText(target->path, original.substr(0, original.size() - 1));
    log = VersionLog::Open(Options());
    ASSERT_FALSE(log.ok());
    EXPECT_NE(log.status().message().find(target->path), std::string::npos)
        << log.status().message();

    fs::remove(target->path);
    log = VersionLog::Open(Options());
    ASSERT_FALSE(log.ok());
    EXPECT_EQ(log.status().code(), StatusCode::kNotFound);
    EXPECT_NE(log.status().message().find(target->path), std::string::npos)
        << log.status().message();

    WriteText(target->path, original);
    ASSERT_TRUE(VersionLog::Open(Options()).ok());
  }
}

TEST_F(VersionLogTest, MalformedLogFailsOpen) {
  {
    auto log = OpenOrDie(Options());
    ASSERT_TRUE(log);
    for (uint64_t v = 1; v <= 2; ++v) AppendOrDie(*log, v);
  }
  const fs::path log_path = dir_ / "state" / "log.json";
  const std::string original = ReadText(log_path);
  auto expect_corruption = [&](const std::string& text, const std::string& mentions) {
    WriteText(log_path, text);
    auto log = VersionLog::Open(Options());
    ASSERT_FALSE(log.ok());
    EXPECT_EQ(log.status().code(), StatusCode::kCorruption) << log.status().ToString();
    EXPECT_NE(log.status().message().find(log_path.string()), std::string::npos)
        << log.status().message();
    EXPECT_NE(log.status().message().find(mentions), std::string::npos) << log.status().message();
  };
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string text = original;
    size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? text : text.replace(at, from.size(), to);
  };
  expect_corruption(original.substr(0, original.size() / 2), "JSON");
  expect_corruption("", "JSON");
  expect_corruption("[]", "object");
  expect_corruption(replaced("\"format\": 1", "\"format\": 2"), "format");
  expect_corruption(replaced("\"head_version\": 2", "\"head_version\": \"2\""), "head_version");
  expect_corruption(replaced("\"head_version\": 2", "\"head_version\": 1"), "head_version");
  expect_corruption(replaced("\"target_hash\": \"", "\"target_hash\": \"zz"), "target_hash");
  expect_corruption(replaced("\"kind\": \"delta\"", "\"kind\": \"patch\""), "kind");
  expect_corruption(replaced("\"file\": \"artifacts/", "\"file\": \"../"), "file");
  expect_corruption(replaced("\"piece_hashes\": [", "\"piece_hashes\": [1,"), "piece_hashes");
  expect_corruption(replaced("\"size_bytes\": ", "\"size_bytes\": 1"), "size_bytes");
  WriteText(log_path, original);
  EXPECT_TRUE(VersionLog::Open(Options()).ok());
}

TEST_F(VersionLogTest, SecondOpenOfALockedDirectoryFails) {
  auto first = OpenOrDie(Options());
  ASSERT_TRUE(first);
  auto second = VersionLog::Open(Options());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find("LOCK"), std::string::npos) << second.status().message();
  first.reset();
  EXPECT_TRUE(VersionLog::Open(Options()).ok());
}

TEST_F(VersionLogTest, RetainedArtifactsReproduceEveryVersion) {
  VersionLogOptions options = Options();
  options.retain = 5;
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  for (uint64_t v = 1; v <= 9; ++v) AppendOrDie(*log, v);
  const std::vector<ArtifactInfo> artifacts = log->Artifacts();
  EXPECT_EQ(Kinds(artifacts), "D5 D6 K7 D7 D8 D9");

  // Every artifact on its own: a keyframe decodes to its version, a delta turns its base
  // version into its target version.
  for (const ArtifactInfo& a : artifacts) {
    SCOPED_TRACE(Kinds({a}));
    auto bytes = delta::ReadDeltaFile(a.path);
    ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
    EXPECT_EQ(PieceHashes(*bytes, a.piece_bytes), a.piece_hashes);
    auto view = delta::DeltaView::Parse(*bytes);
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    EXPECT_EQ(view->manifest().target_version, a.target_version);
    auto decoded = a.kind == ArtifactKind::kKeyframe
                       ? delta::DecodeKeyframe(*view)
                       : delta::ApplyToCopy(Version(a.base_version).view(), *view);
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_TRUE(SameBytes(*decoded, Version(a.target_version)));
    EXPECT_EQ(*CheckpointHash(decoded->view()), a.target_hash);
  }

  // A subscriber joining now: the latest keyframe, then every later delta in place.
  OwnedCheckpoint state;
  for (const ArtifactInfo& a : artifacts) {
    if (a.target_version < 7 || (a.target_version == 7 && a.kind == ArtifactKind::kDelta)) {
      continue;
    }
    auto bytes = delta::ReadDeltaFile(a.path);
    ASSERT_TRUE(bytes.ok());
    auto view = delta::DeltaView::Parse(*bytes);
    ASSERT_TRUE(view.ok());
    if (a.kind == ArtifactKind::kKeyframe) {
      auto decoded = delta::DecodeKeyframe(*view);
      ASSERT_TRUE(decoded.ok());
      state = std::move(decoded).value();
    } else {
      MutableCheckpointView state_view = state.mutable_view();
      auto applied = delta::ApplyInPlace(state_view, *view);
      ASSERT_TRUE(applied.ok()) << applied.status().ToString();
    }
    EXPECT_EQ(*CheckpointHash(state.view()), a.target_hash);
  }
  EXPECT_EQ(*CheckpointHash(state.view()), log->head_hash());
  EXPECT_TRUE(SameBytes(state, Version(9)));
}

TEST_F(VersionLogTest, FailedAppendChangesNothing) {
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  AppendOrDie(*log, 1);
  const std::vector<ArtifactInfo> before = log->Artifacts();

  // A tensor whose bytes do not fit its shape.
  OwnedCheckpoint bad = Version(2);
  bad.tensors[0].data.pop_back();
  auto refused = log->Append(2, bad.view());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("embed.weight"), std::string::npos);

  // log.json cannot be replaced (a directory stands in its way): the artifacts already
  // written for version 2 are removed again and the head stays at version 1.
  const fs::path log_path = dir_ / "state" / "log.json";
  fs::rename(log_path, dir_ / "log.json.saved");
  fs::create_directories(log_path / "blocker");
  refused = log->Append(2, Version(2).view());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kIOError) << refused.status().ToString();
  EXPECT_EQ(log->Artifacts(), before);
  EXPECT_EQ(log->head_version(), 1u);
  EXPECT_EQ(log->head_hash(), *CheckpointHash(Version(1).view()));
  EXPECT_EQ(ArtifactFiles(), Paths(before));

  fs::remove_all(log_path);
  fs::rename(dir_ / "log.json.saved", log_path);
  std::vector<ArtifactInfo> added = AppendOrDie(*log, 2);
  ASSERT_EQ(Kinds(added), "D2");
  EXPECT_EQ(added[0].base_hash, *CheckpointHash(Version(1).view()));
  log.reset();
  EXPECT_TRUE(VersionLog::Open(Options()).ok());
}

TEST_F(VersionLogTest, ReadersSeeConsistentSnapshotsDuringAppends) {
  VersionLogOptions options = Options();
  options.retain = 2;
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  AppendOrDie(*log, 1);
  std::atomic<bool> done{false};
  std::atomic<int> bad_snapshots{0};
  std::thread reader([&] {
    while (!done) {
      std::vector<ArtifactInfo> snapshot = log->Artifacts();
      bool ordered =
          !snapshot.empty() &&
          std::is_sorted(snapshot.begin(), snapshot.end(), [](const auto& a, const auto& b) {
            return a.target_version < b.target_version;
          });
      if (!ordered) ++bad_snapshots;
      (void)log->head_hash();
      (void)log->head_tensor_hashes();
    }
  });
  for (uint64_t v = 2; v <= 8; ++v) AppendOrDie(*log, v);
  done = true;
  reader.join();
  EXPECT_EQ(bad_snapshots, 0);
}

TEST_F(VersionLogTest, OpenRejectsBadOptions) {
  VersionLogOptions options = Options();
  options.keyframe_every = 0;
  EXPECT_EQ(VersionLog::Open(options).status().code(), StatusCode::kInvalidArgument);
  options = Options();
  options.piece_bytes = 0;
  EXPECT_EQ(VersionLog::Open(options).status().code(), StatusCode::kInvalidArgument);
  options = Options();
  options.threads = 0;
  EXPECT_EQ(VersionLog::Open(options).status().code(), StatusCode::kInvalidArgument);
}

uint64_t AllWords(const OwnedCheckpoint& checkpoint) {
  uint64_t words = 0;
  for (const OwnedTensor& t : checkpoint.tensors) words += t.data.size() / DTypeWordBytes(t.dtype);
  return words;
}

// The trainer's path: it hashes its snapshot once and hands the hashes over; Append then
// reads the bytes only to encode them, and reports the encoder's changed-word counts.
TEST_F(VersionLogTest, AppendWithGivenHashesHashesNothingAndCountsChangedWords) {
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  for (uint64_t version = 1; version <= 4; ++version) {
    SCOPED_TRACE(version);
    const OwnedCheckpoint& checkpoint = Version(version);
    AppendOptions known;
    for (const OwnedTensor& t : checkpoint.tensors) known.tensor_hashes.push_back(HashBytes(t.data));
    known.checkpoint_hash = *CheckpointHash(checkpoint.view());
    auto added = log->Append(version, checkpoint.view(), known);
    ASSERT_TRUE(added.ok()) << added.status().ToString();
    EXPECT_EQ(added->tensors_hashed, 0u);
    EXPECT_EQ(log->head_hash(), *known.checkpoint_hash);
    if (version == 1) {
      EXPECT_FALSE(added->wrote_delta);  // keyframe only: nothing to compare with
      EXPECT_EQ(added->changed_words, 0u);
      continue;
    }
    ASSERT_TRUE(added->wrote_delta);
    const uint64_t direct = DirectlyChangedWords(Version(version - 1), checkpoint);
    EXPECT_GT(direct, 0u);
    EXPECT_EQ(added->changed_words, direct);
    EXPECT_EQ(added->total_words, AllWords(checkpoint));
  }
  // What it wrote applies and verifies like any other version: the hashes were right.
  auto reopened = VersionLog::Open(Options());
  EXPECT_FALSE(reopened.ok());  // still locked by `log`
  log.reset();
  auto again = OpenOrDie(Options());
  ASSERT_TRUE(again);
  EXPECT_EQ(again->head_hash(), *CheckpointHash(Version(4).view()));
}

TEST_F(VersionLogTest, AppendWithoutGivenHashesHashesEveryTensorOnce) {
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  AppendOrDie(*log, 1);
  auto added = log->Append(2, Version(2).view(), AppendOptions{});
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_EQ(added->tensors_hashed, Version(2).tensors.size());
  EXPECT_EQ(added->changed_words, DirectlyChangedWords(Version(1), Version(2)));
}

TEST_F(VersionLogTest, AppendRefusesGivenHashesThatDisagree) {
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  const OwnedCheckpoint& checkpoint = Version(1);
  AppendOptions known;
  for (const OwnedTensor& t : checkpoint.tensors) known.tensor_hashes.push_back(HashBytes(t.data));
  known.checkpoint_hash = *CheckpointHash(Version(2).view());  // of other bytes
  auto refused = log->Append(1, checkpoint.view(), known);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  known.checkpoint_hash.reset();
  known.tensor_hashes.pop_back();  // one hash short
  refused = log->Append(1, checkpoint.view(), known);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(log->empty());
}

// A pushed delta (the push API's commit): ApplyDelta and Append read the caller's
// container where it lies and tell the caller of every byte they are done with, the
// payloads chunk by chunk and the stored copy piece by piece, so that a caller that mapped
// a large file can drop it from memory as they go. The stored artifact is the container
// byte for byte, with its piece hashes.
TEST_F(VersionLogTest, AGivenDeltaIsReportedReadAsItIsAppliedAndStored) {
  VersionLogOptions options = Options();
  options.keyframe_cost = 0;  // the delta alone
  options.piece_bytes = 64;   // many pieces of a small delta
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  AppendOrDie(*log, 1);
  delta::EncodeOptions encode;
  encode.base_version = 1;
  encode.target_version = 2;
  encode.chunk_bytes = 4096;  // several chunks
  auto container = delta::Encode(Version(1).view(), Version(2).view(), encode);
  ASSERT_TRUE(container.ok()) << container.status().ToString();
  const std::span<const std::byte> bytes(*container);
  auto delta_view = delta::DeltaView::Parse(bytes);
  ASSERT_TRUE(delta_view.ok());
  ASSERT_GT(delta_view->manifest().chunks.size(), 1u);

  std::mutex mu;  // the apply reports from its threads
  std::vector<std::span<const std::byte>> applied;
  auto rebuilt = log->ApplyDelta(bytes, 2, [&](std::span<const std::byte> read) {
    std::lock_guard lock(mu);
    applied.push_back(read);
  });
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().ToString();
  for (const delta::ChunkEntry& chunk : delta_view->manifest().chunks) {
    const std::span<const std::byte> payload = delta_view->payload(chunk);
    EXPECT_EQ(std::count_if(applied.begin(), applied.end(),
                            [&](std::span<const std::byte> read) {
                              return read.data() == payload.data() && read.size() == payload.size();
                            }),
              1);
  }

  std::vector<std::span<const std::byte>> stored;
  AppendOptions known;
  known.tensor_hashes = rebuilt->tensor_hashes;
  known.checkpoint_hash = rebuilt->hash;
  known.encoded_delta = bytes;
  known.encoded_delta_read = [&](std::span<const std::byte> read) { stored.push_back(read); };
  auto added = log->Append(2, rebuilt->checkpoint.view(), known);
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  ASSERT_EQ(added->artifacts.size(), 1u);
  const ArtifactInfo& artifact = added->artifacts[0];
  EXPECT_EQ(ReadText(artifact.path),
            std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  EXPECT_EQ(artifact.piece_hashes, PieceHashes(bytes, options.piece_bytes));
  // Each piece is reported once it is written, in order, between the checks' whole reads.
  std::vector<std::span<const std::byte>> pieces;
  for (std::span<const std::byte> read : stored) {
    if (read.size() != bytes.size()) pieces.push_back(read);
  }
  ASSERT_EQ(pieces.size(), artifact.piece_hashes.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_EQ(pieces[i].data(), bytes.data() + i * options.piece_bytes);
    EXPECT_LE(pieces[i].size(), options.piece_bytes);
  }
  EXPECT_EQ(pieces.back().data() + pieces.back().size(), bytes.data() + bytes.size());
}

// Fails the replacement of log.json while `fail` is set: the step after the artifacts are
// written and before the log is durable.
class FailLogRenameEnv : public EnvWrapper {
 public:
  FailLogRenameEnv() : EnvWrapper(Env::Default()) {}
  Status RenameFile(const std::string& from, const std::string& to) override {
    if (fail && to.size() >= 9 && to.compare(to.size() - 9, 9, "/log.json") == 0) {
      ++failed;
      return Status::IOError("injected: cannot rename " + from + " to " + to);
    }
    return EnvWrapper::RenameFile(from, to);
  }
  std::atomic<bool> fail{false};
  std::atomic<int> failed{0};
};

class InPlaceTest : public VersionLogTest {
 protected:
  // The delta container from version `base` to `target` of Version().
  std::vector<std::byte> DeltaBytes(uint64_t base, uint64_t target) {
    delta::EncodeOptions encode;
    encode.base_version = base;
    encode.target_version = target;
    encode.chunk_bytes = 4096;  // several chunks
    auto container = delta::Encode(Version(base).view(), Version(target).view(), encode);
    EXPECT_TRUE(container.ok()) << container.status().ToString();
    return container.ok() ? *container : std::vector<std::byte>{};
  }
  static Result<AppendResult> AppendInPlace(VersionLog& log, uint64_t version,
                                            std::span<const std::byte> container) {
    AppendOptions in_place;
    in_place.apply_in_place = container;
    return log.Append(version, CheckpointView{}, in_place);
  }
  // The head's bytes as a reader gets them, hashed from the bytes themselves.
  static Hash128 HeadBytesHash(const VersionLog& log) {
    auto rebuilt = log.Rebuild(log.head_version());
    EXPECT_TRUE(rebuilt.ok()) << rebuilt.status().ToString();
    return rebuilt.ok() ? *CheckpointHash(rebuilt->checkpoint.view()) : Hash128{};
  }
};

TEST_F(InPlaceTest, ADeltaFromTheHeadIsAppliedInPlaceAndStoredAsSent) {
  auto log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  AppendOrDie(*log, 1);
  const std::vector<std::byte> container = DeltaBytes(1, 2);
  auto added = AppendInPlace(*log, 2, container);
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  ASSERT_EQ(Kinds(added->artifacts), "D2");
  EXPECT_EQ(ReadText(added->artifacts[0].path),
            std::string(reinterpret_cast<const char*>(container.data()), container.size()));
  uint64_t bytes = 0;
  for (const OwnedTensor& t : Version(2).tensors) bytes += t.data.size();
  EXPECT_EQ(added->checkpoint_bytes, bytes);
  EXPECT_EQ(log->head_version(), 2u);
  EXPECT_EQ(log->head_hash(), *CheckpointHash(Version(2).view()));
  EXPECT_EQ(HeadBytesHash(*log), *CheckpointHash(Version(2).view()));
  // The next version encodes from the patched head; a reopen rebuilds it from disk.
  AppendOrDie(*log, 3);
  log.reset();
  log = OpenOrDie(Options());
  ASSERT_TRUE(log);
  EXPECT_EQ(log->head_version(), 3u);
  auto v2 = log->Rebuild(2);
  ASSERT_TRUE(v2.ok()) << v2.status().ToString();
  EXPECT_TRUE(SameBytes(v2->checkpoint, Version(2)));
}

// A failure after the apply and before log.json is durable, a corrupt delta, a delta from
// another base: each restores the head bit for bit and publishes nothing.
TEST_F(InPlaceTest, AFailureBeforeTheLogIsDurableRestoresTheHeadBitForBit) {
  FailLogRenameEnv env;
  VersionLogOptions options = Options();
  options.env = &env;
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  AppendOrDie(*log, 1);
  const std::vector<ArtifactInfo> before = log->Artifacts();
  const Hash128 v1 = *CheckpointHash(Version(1).view());
  auto unchanged = [&] {
    EXPECT_EQ(log->head_version(), 1u);
    EXPECT_EQ(log->head_hash(), v1);
    EXPECT_EQ(HeadBytesHash(*log), v1);  // every byte of the head is the base's again
    EXPECT_EQ(log->Artifacts(), before);
    EXPECT_EQ(ArtifactFiles(), Paths(before));
  };
  const std::vector<std::byte> container = DeltaBytes(1, 2);
  env.fail = true;
  auto refused = AppendInPlace(*log, 2, container);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(env.failed, 1);
  EXPECT_EQ(refused.status().code(), StatusCode::kIOError) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("injected"), std::string::npos);
  unchanged();
  env.fail = false;

  // A payload byte flipped: the apply's own verification refuses it (Corruption).
  std::vector<std::byte> corrupt = container;
  auto parsed = delta::DeltaView::Parse(corrupt);
  ASSERT_TRUE(parsed.ok());
  const std::span<const std::byte> payload = parsed->payload(parsed->manifest().chunks.back());
  ASSERT_FALSE(payload.empty());
  corrupt[payload.data() - corrupt.data() + payload.size() / 2] ^= std::byte{0x40};
  refused = AppendInPlace(*log, 2, corrupt);
  ASSERT_FALSE(refused.ok());
  unchanged();

  // A delta from another base (2 -> 3 while the head is 1): Mismatch, naming both.
  refused = AppendInPlace(*log, 3, DeltaBytes(2, 3));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kMismatch);
  EXPECT_NE(refused.status().message().find("the head is v1"), std::string::npos)
      << refused.status().ToString();
  unchanged();

  auto added = AppendInPlace(*log, 2, container);
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_EQ(HeadBytesHash(*log), *CheckpointHash(Version(2).view()));
  log.reset();
  options.env = nullptr;
  log = OpenOrDie(options);
  ASSERT_TRUE(log);
  EXPECT_EQ(log->head_version(), 2u);
}

// Readers of the head (Rebuild) while in-place applies run, some of them failing after the
// apply: every head a reader gets hashes, byte for byte, to a published version's hash.
TEST_F(InPlaceTest, ConcurrentReadersNeverSeeAMixedHead) {
  FailLogRenameEnv env;
  VersionLogOptions options = Options();
  options.env = &env;
  options.keyframe_every = 1000;
  auto log = OpenOrDie(options);
  ASSERT_TRUE(log);
  AppendOrDie(*log, 1);
  std::set<std::string> published = {CheckpointHash(Version(1).view())->ToHex()};
  std::mutex mu;
  std::atomic<bool> done{false};
  std::atomic<int> reads{0}, mixed{0};
  std::thread reader([&] {
    while (!done) {
      const Hash128 seen = HeadBytesHash(*log);
      std::lock_guard lock(mu);
      if (!published.count(seen.ToHex())) ++mixed;
      ++reads;
    }
  });
  for (uint64_t v = 2; v <= 9; ++v) {
    const std::vector<std::byte> container = DeltaBytes(v - 1, v);
    {
      std::lock_guard lock(mu);  // published before the apply starts
      published.insert(CheckpointHash(Version(v).view())->ToHex());
    }
    env.fail = true;  // applied in full, then refused at the log: restored
    ASSERT_FALSE(AppendInPlace(*log, v, container).ok());
    env.fail = false;
    auto added = AppendInPlace(*log, v, container);
    ASSERT_TRUE(added.ok()) << added.status().ToString();
  }
  while (reads < 20) std::this_thread::yield();
  done = true;
  reader.join();
  EXPECT_EQ(mixed, 0) << "of " << reads << " reads";
  EXPECT_EQ(log->head_version(), 9u);
}

TEST(PieceHashesTest, SplitsIntoPiecesWithAShortLastOne) {
  std::vector<std::byte> bytes(10);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i * 7 + 1);
  const std::span<const std::byte> all(bytes);

  EXPECT_TRUE(PieceHashes({}, 4).empty());

  const std::vector<uint64_t> exact = PieceHashes(all.first(8), 4);
  ASSERT_EQ(exact.size(), 2u);
  EXPECT_EQ(exact[0], HashBytes64(all.subspan(0, 4)));
  EXPECT_EQ(exact[1], HashBytes64(all.subspan(4, 4)));

  const std::vector<uint64_t> remainder = PieceHashes(all, 4);
  ASSERT_EQ(remainder.size(), 3u);
  EXPECT_EQ(remainder[0], exact[0]);
  EXPECT_EQ(remainder[1], exact[1]);
  EXPECT_EQ(remainder[2], HashBytes64(all.subspan(8, 2)));

  EXPECT_EQ(PieceHashes(all, 10), std::vector<uint64_t>{HashBytes64(all)});
  EXPECT_EQ(PieceHashes(all, 1000), std::vector<uint64_t>{HashBytes64(all)});
  EXPECT_EQ(PieceHashes(all, 0), std::vector<uint64_t>{HashBytes64(all)});
  EXPECT_EQ(PieceHashes(all, 1).size(), 10u);
}

}  // namespace
}  // namespace flywheel::sync
