#include "delta/delta_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "checkpoint/safetensors.h"
#include "tests/delta/test_checkpoints.h"

namespace flywheel::delta {
namespace {

namespace fs = std::filesystem;
using testing::Mutate;
using testing::RandomCheckpoint;

class DeltaFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("flywheel_delta_file_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    v1_ = RandomCheckpoint(testing::MixedSpecs(), 1);
    v2_ = Mutate(v1_, 0.03, 2);
    v3_ = Mutate(v2_, 0.03, 3);
    ASSERT_TRUE(WriteSafetensors(P("v1.safetensors"), v1_.view(), {{"format", "pt"}}).ok());
    ASSERT_TRUE(
        WriteSafetensors(P("v2.safetensors"), v2_.view(), {{"format", "pt"}, {"step", "2"}}).ok());
    ASSERT_TRUE(WriteSafetensors(P("v3.safetensors"), v3_.view(), {}).ok());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string P(const std::string& name) const { return (dir_ / name).string(); }

  // Reads a checkpoint file back as owned tensors in file order.
  static OwnedCheckpoint Load(const std::string& path) {
    auto file = SafetensorsFile::Open(path);
    EXPECT_TRUE(file.ok()) << file.status().ToString();
    OwnedCheckpoint out;
    for (const TensorView& t : file->tensors()) {
      out.tensors.push_back({t.name, t.dtype, t.shape, {t.data.begin(), t.data.end()}});
    }
    return out;
  }
  static Hash128 HashOf(const std::string& path) {
    auto ckpt = Checkpoint::Open(path);
    EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    return *CheckpointHash(ckpt->tensors());
  }

  fs::path dir_;
  OwnedCheckpoint v1_, v2_, v3_;
};

TEST_F(DeltaFileTest, EncodeApplyRoundTripKeepsMetadata) {
  EncodeOptions options;
  options.base_version = 1, options.target_version = 2;
  auto stats = EncodeFiles(P("v1.safetensors"), P("v2.safetensors"), P("d12.fwd"), options);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_GT(stats->changed_words, 0u);
  EXPECT_EQ(stats->delta_bytes, fs::file_size(P("d12.fwd")));
  auto applied = ApplyFiles(P("v1.safetensors"), P("d12.fwd"), P("out.safetensors"));
  ASSERT_TRUE(applied.ok()) << applied.status().ToString();
  EXPECT_EQ(applied->target_version, 2u);
  EXPECT_EQ(HashOf(P("out.safetensors")), HashOf(P("v2.safetensors")));
  EXPECT_EQ(applied->target_hash, HashOf(P("v2.safetensors")));
  auto file = SafetensorsFile::Open(P("out.safetensors"));
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->metadata().at("step"), "2");
  EXPECT_TRUE(testing::SameBytes(Load(P("out.safetensors")), v2_));
}

TEST_F(DeltaFileTest, ChainOfFiles) {
  ASSERT_TRUE(EncodeFiles(P("v1.safetensors"), P("v2.safetensors"), P("d12.fwd"), {}).ok());
  ASSERT_TRUE(EncodeFiles(P("v2.safetensors"), P("v3.safetensors"), P("d23.fwd"), {}).ok());
  ASSERT_TRUE(ApplyFiles(P("v1.safetensors"), P("d12.fwd"), P("a2.safetensors")).ok());
  ASSERT_TRUE(ApplyFiles(P("a2.safetensors"), P("d23.fwd"), P("a3.safetensors")).ok());
  EXPECT_EQ(HashOf(P("a3.safetensors")), HashOf(P("v3.safetensors")));
}

TEST_F(DeltaFileTest, KeyframeNeedsNoBase) {
  ASSERT_TRUE(EncodeKeyframeFile(P("v3.safetensors"), P("k3.fwd"), {}).ok());
  auto applied = ApplyFiles("", P("k3.fwd"), P("out.safetensors"));
  ASSERT_TRUE(applied.ok()) << applied.status().ToString();
  EXPECT_EQ(HashOf(P("out.safetensors")), HashOf(P("v3.safetensors")));
}

TEST_F(DeltaFileTest, DeltaWithoutBaseIsAnError) {
  ASSERT_TRUE(EncodeFiles(P("v1.safetensors"), P("v2.safetensors"), P("d12.fwd"), {}).ok());
  auto applied = ApplyFiles("", P("d12.fwd"), P("out.safetensors"));
  EXPECT_EQ(applied.status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(P("out.safetensors")));
}

TEST_F(DeltaFileTest, WrongBaseLeavesNoOutputAndKeepsExistingFile) {
  ASSERT_TRUE(EncodeFiles(P("v2.safetensors"), P("v3.safetensors"), P("d23.fwd"), {}).ok());
  { std::ofstream(P("existing.safetensors")) << "keep me"; }
  auto applied = ApplyFiles(P("v1.safetensors"), P("d23.fwd"), P("existing.safetensors"));
  ASSERT_FALSE(applied.ok());
  EXPECT_EQ(applied.status().code(), StatusCode::kMismatch);
  std::ifstream in(P("existing.safetensors"));
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "keep me");
  // No temporary file is left behind.
  int files = 0;
  for (auto& e : fs::directory_iterator(dir_))
    files += e.path().filename().string().find(".tmp-") != std::string::npos;
  EXPECT_EQ(files, 0);
}

TEST_F(DeltaFileTest, CorruptedDeltaFileLeavesNoOutput) {
  ASSERT_TRUE(EncodeFiles(P("v1.safetensors"), P("v2.safetensors"), P("d12.fwd"), {}).ok());
  auto bytes = *ReadDeltaFile(P("d12.fwd"));
  bytes[bytes.size() - 3] ^= std::byte{0xff};
  ASSERT_TRUE(WriteFileAtomically(P("bad.fwd"), bytes).ok());
  auto applied = ApplyFiles(P("v1.safetensors"), P("bad.fwd"), P("out.safetensors"));
  ASSERT_FALSE(applied.ok());
  EXPECT_EQ(applied.status().code(), StatusCode::kCorruption);
  EXPECT_FALSE(fs::exists(P("out.safetensors")));
}

TEST_F(DeltaFileTest, ShardedBaseWorks) {
  std::map<std::string, std::string> weight_map;
  for (size_t i = 0; i < v1_.tensors.size(); ++i) {
    weight_map[v1_.tensors[i].name] =
        i % 2 ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  }
  ASSERT_TRUE(WriteShardedCheckpoint(P("sharded"), v1_.view(), weight_map, {}).ok());
  EXPECT_EQ(HashOf(P("sharded")), HashOf(P("v1.safetensors")));
  ASSERT_TRUE(EncodeFiles(P("sharded"), P("v2.safetensors"), P("d12.fwd"), {}).ok());
  ASSERT_TRUE(ApplyFiles(P("sharded"), P("d12.fwd"), P("out.safetensors")).ok());
  EXPECT_EQ(HashOf(P("out.safetensors")), HashOf(P("v2.safetensors")));
}

TEST_F(DeltaFileTest, MissingFilesAreNamed) {
  auto r = EncodeFiles(P("nope.safetensors"), P("v2.safetensors"), P("d.fwd"), {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("nope.safetensors"), std::string::npos);
  auto d = ReadDeltaFile(P("nope.fwd"));
  EXPECT_EQ(d.status().code(), StatusCode::kNotFound);
  EXPECT_NE(d.status().message().find("nope.fwd"), std::string::npos);
}

}  // namespace
}  // namespace flywheel::delta
