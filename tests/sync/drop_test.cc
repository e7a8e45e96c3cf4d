#include "sync/drop.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "checkpoint/hash.h"
#include "tests/delta/test_checkpoints.h"

namespace flywheel::sync {
namespace {

namespace fs = std::filesystem;
using flywheel::testing::RandomCheckpoint;
using flywheel::testing::TensorSpec;

std::vector<TensorSpec> Specs() {
  return {
      {"a.weight", DType::kBF16, {16, 8}},
      {"b.weight", DType::kF32, {12}},
      {"c.bias", DType::kBF16, {5}},
  };
}

void Touch(const fs::path& path, const std::string& text = "") {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::vector<uint64_t> Versions(const std::vector<Drop>& drops) {
  std::vector<uint64_t> versions;
  for (const Drop& d : drops) versions.push_back(d.version);
  return versions;
}

class DropTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "drop_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // <dir>/<name>/model.safetensors, and COMMIT when `commit`.
  fs::path MakeDrop(const std::string& name, bool commit = true) {
    const fs::path drop = dir_ / name;
    fs::create_directories(drop);
    EXPECT_TRUE(
        WriteSafetensors((drop / "model.safetensors").string(), checkpoint_.view(), {}).ok());
    if (commit) Touch(drop / kCommitMarker);
    return drop;
  }

  fs::path dir_;
  OwnedCheckpoint checkpoint_ = RandomCheckpoint(Specs(), 3);
};

TEST_F(DropTest, EmptyWatchDirectoryHasNoDrops) {
  auto drops = ScanDrops(dir_.string(), 0);
  ASSERT_TRUE(drops.ok()) << drops.status().ToString();
  EXPECT_TRUE(drops->empty());
}

TEST_F(DropTest, MissingWatchDirectoryFails) {
  auto drops = ScanDrops((dir_ / "missing").string(), 0);
  ASSERT_FALSE(drops.ok());
  EXPECT_NE(drops.status().message().find((dir_ / "missing").string()), std::string::npos);
}

TEST_F(DropTest, UncommittedDropIsIgnored) {
  MakeDrop("3", /*commit=*/false);
  MakeDrop("4");
  auto drops = ScanDrops(dir_.string(), 0);
  ASSERT_TRUE(drops.ok());
  EXPECT_EQ(Versions(*drops), std::vector<uint64_t>{4});
  EXPECT_EQ((*drops)[0].path, (dir_ / "4").string());
}

TEST_F(DropTest, NamesThatAreNotVersionsAreIgnored) {
  for (const char* name : {"abc", "12a", "-3", "+4", "007", "00", " 5", "1e3",
                           "12345678901234567890" /* 20 digits */}) {
    MakeDrop(name);
  }
  Touch(dir_ / "15");  // a file, not a directory
  MakeDrop("0");
  MakeDrop("9999999999999999999");  // 19 digits: the largest accepted
  auto drops = ScanDrops(dir_.string(), 0);
  ASSERT_TRUE(drops.ok());
  EXPECT_EQ(Versions(*drops), std::vector<uint64_t>{9999999999999999999ull});
}

TEST_F(DropTest, VersionZeroIsNeverAboveAfterVersion) {
  MakeDrop("0");
  // after_version 0 excludes version 0: a drop must be above what was published.
  auto drops = ScanDrops(dir_.string(), 0);
  ASSERT_TRUE(drops.ok());
  EXPECT_TRUE(drops->empty());
}

TEST_F(DropTest, OrderIsNumericNotLexical) {
  for (const char* name : {"10", "9", "100", "2"}) MakeDrop(name);
  auto drops = ScanDrops(dir_.string(), 0);
  ASSERT_TRUE(drops.ok());
  EXPECT_EQ(Versions(*drops), (std::vector<uint64_t>{2, 9, 10, 100}));
}

TEST_F(DropTest, OnlyVersionsAfterTheGivenOneAreListed) {
  for (const char* name : {"10", "9", "100", "2"}) MakeDrop(name);
  auto drops = ScanDrops(dir_.string(), 9);
  ASSERT_TRUE(drops.ok());
  EXPECT_EQ(Versions(*drops), (std::vector<uint64_t>{10, 100}));
  drops = ScanDrops(dir_.string(), 100);
  ASSERT_TRUE(drops.ok());
  EXPECT_TRUE(drops->empty());
}

TEST_F(DropTest, SingleFileDropOpens) {
  const fs::path path = MakeDrop("1");
  auto checkpoint = OpenDrop(Drop{1, path.string()});
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_FALSE(checkpoint->sharded());
  EXPECT_EQ(*CheckpointHash(checkpoint->tensors()), *CheckpointHash(checkpoint_.view()));
}

TEST_F(DropTest, ShardedDropOpens) {
  const fs::path drop = dir_ / "7";
  std::map<std::string, std::string> weight_map = {
      {"a.weight", "model-00001-of-00002.safetensors"},
      {"b.weight", "model-00002-of-00002.safetensors"},
      {"c.bias", "model-00002-of-00002.safetensors"},
  };
  ASSERT_TRUE(WriteShardedCheckpoint(drop.string(), checkpoint_.view(), weight_map, {}).ok());
  Touch(drop / kCommitMarker);
  auto drops = ScanDrops(dir_.string(), 0);
  ASSERT_TRUE(drops.ok());
  ASSERT_EQ(Versions(*drops), std::vector<uint64_t>{7});
  auto checkpoint = OpenDrop((*drops)[0]);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_TRUE(checkpoint->sharded());
  EXPECT_EQ(checkpoint->tensors().size(), 3u);
  EXPECT_EQ(*CheckpointHash(checkpoint->tensors()), *CheckpointHash(checkpoint_.view()));
}

TEST_F(DropTest, MalformedSafetensorsIsRejectedNamingTheDrop) {
  const fs::path drop = dir_ / "5";
  fs::create_directories(drop);
  Touch(drop / "model.safetensors", std::string("\x10\0\0\0\0\0\0\0{\"a\":", 13));
  Touch(drop / kCommitMarker);
  auto checkpoint = OpenDrop(Drop{5, drop.string()});
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().message().rfind("drop " + drop.string() + ": ", 0), 0u)
      << checkpoint.status().message();
  EXPECT_NE(checkpoint.status().message().find("model.safetensors"), std::string::npos)
      << checkpoint.status().message();
}

TEST_F(DropTest, DropWithoutCheckpointIsRejectedNamingTheDrop) {
  const fs::path drop = dir_ / "6";
  fs::create_directories(drop);
  Touch(drop / kCommitMarker);
  auto checkpoint = OpenDrop(Drop{6, drop.string()});
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(checkpoint.status().message().rfind("drop " + drop.string() + ": ", 0), 0u)
      << checkpoint.status().message();
}

}  // namespace
}  // namespace flywheel::sync
