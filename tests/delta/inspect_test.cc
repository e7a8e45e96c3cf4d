// SummarizeDelta and InspectDeltaFile (delta/inspect.h): the totals behind
// `flywheel delta inspect`, checked against the manifest and the per-tensor statistics.
#include "delta/inspect.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "delta/delta_file.h"
#include "tests/delta/test_checkpoints.h"

namespace flywheel::delta {
namespace {

namespace fs = std::filesystem;
using testing::Mutate;
using testing::MustEncode;
using testing::MustParse;
using testing::RandomCheckpoint;

// The totals are the sums of the per-tensor statistics and agree with the manifest.
void ExpectConsistent(const DeltaSummary& s, const std::vector<std::byte>& bytes) {
  DeltaTotals sum;
  for (const TensorStats& t : s.tensors) {
    sum.elements += t.elements;
    sum.words += t.words;
    sum.changed_words += t.changed_words;
    sum.stored_bytes += t.stored_bytes;
    sum.chunks.sparse += t.sparse_chunks;
    sum.chunks.dense += t.dense_chunks;
    sum.chunks.literal += t.literal_chunks;
  }
  EXPECT_EQ(s.total.elements, sum.elements);
  EXPECT_EQ(s.total.words, sum.words);
  EXPECT_EQ(s.total.changed_words, sum.changed_words);
  EXPECT_EQ(s.total.stored_bytes, sum.stored_bytes);
  EXPECT_EQ(s.total.chunks.sparse, sum.chunks.sparse);
  EXPECT_EQ(s.total.chunks.dense, sum.chunks.dense);
  EXPECT_EQ(s.total.chunks.literal, sum.chunks.literal);

  EXPECT_EQ(s.file_bytes, bytes.size());
  EXPECT_EQ(s.target_bytes, s.manifest.total_bytes());
  EXPECT_EQ(s.total.words, s.manifest.total_words());
  EXPECT_EQ(s.total.changed_words, s.manifest.changed_words());
  ASSERT_EQ(s.tensors.size(), s.manifest.tensors.size());
  for (size_t i = 0; i < s.tensors.size(); ++i)
    EXPECT_EQ(s.tensors[i].name, s.manifest.tensors[i].name);

  const uint64_t chunks = s.manifest.chunks.size();
  EXPECT_EQ(s.total.chunks.sparse + s.total.chunks.dense + s.total.chunks.literal, chunks);
  uint64_t by_compressor = 0, payload_bytes = 0;
  for (const auto& [name, count] : s.compressor_chunks) by_compressor += count;
  for (const ChunkEntry& c : s.manifest.chunks) payload_bytes += c.payload_bytes;
  EXPECT_EQ(by_compressor, chunks);
  EXPECT_EQ(s.total.stored_bytes, payload_bytes);
}

TEST(InspectTest, TotalsOfASparseDelta) {
  auto base = RandomCheckpoint({{"a", DType::kBF16, {100000}}, {"b", DType::kF32, {1000}}}, 97);
  auto target = base;
  for (int i = 0; i < 100; ++i) target.tensors[0].data[2 * i * 37] ^= std::byte{1};
  EncodeOptions options;
  options.base_version = 7;
  options.target_version = 8;
  auto bytes = MustEncode(base, target, options);
  DeltaSummary s = SummarizeDelta(MustParse(bytes));
  ExpectConsistent(s, bytes);
  EXPECT_FALSE(s.manifest.keyframe);
  EXPECT_EQ(s.manifest.base_version, 7u);
  EXPECT_EQ(s.manifest.target_version, 8u);
  EXPECT_EQ(s.total.elements, 101000u);
  EXPECT_EQ(s.total.words, 101000u);
  EXPECT_EQ(s.total.changed_words, 100u);
  EXPECT_EQ(s.target_bytes, 100000u * 2 + 1000u * 4);
  EXPECT_DOUBLE_EQ(s.total.changed_fraction(), 100.0 / 101000.0);
  EXPECT_GT(s.total.chunks.sparse, 0u);
  EXPECT_EQ(s.total.chunks.literal, 0u);
}

TEST(InspectTest, TotalsOfAMixedDelta) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 1);
  auto target = Mutate(base, 0.3, 2, testing::Change::kArbitrary);
  EncodeOptions options;
  options.chunk_bytes = 4096;
  auto bytes = MustEncode(base, target, options);
  ExpectConsistent(SummarizeDelta(MustParse(bytes)), bytes);
}

TEST(InspectTest, KeyframeCountsEveryWordAsChanged) {
  auto target = RandomCheckpoint(testing::MixedSpecs(), 3);
  EncodeOptions options;
  options.target_version = 5;
  auto bytes = EncodeKeyframe(target.view(), options);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  DeltaSummary s = SummarizeDelta(MustParse(*bytes));
  ExpectConsistent(s, *bytes);
  EXPECT_TRUE(s.manifest.keyframe);
  EXPECT_EQ(s.total.changed_words, s.total.words);
  EXPECT_EQ(s.total.chunks.literal, s.manifest.chunks.size());
  EXPECT_EQ(s.total.chunks.sparse + s.total.chunks.dense, 0u);
}

TEST(InspectTest, CompressorsAreCountedByName) {
  auto base = RandomCheckpoint({{"a", DType::kBF16, {50000}}}, 4);
  auto target = Mutate(base, 0.01, 5);
  EncodeOptions options;
  options.compressor = Compressor::kNone;
  auto bytes = MustEncode(base, target, options);
  DeltaSummary s = SummarizeDelta(MustParse(bytes));
  ASSERT_EQ(s.compressor_chunks.size(), 1u);
  EXPECT_EQ(s.compressor_chunks.begin()->first, "none");
  EXPECT_EQ(s.compressor_chunks.begin()->second, s.manifest.chunks.size());
}

TEST(InspectTest, UnchangedCheckpointHasNoBitsPerChangedWord) {
  auto base = RandomCheckpoint({{"a", DType::kF32, {1000}}}, 6);
  auto bytes = MustEncode(base, base);
  DeltaSummary s = SummarizeDelta(MustParse(bytes));
  ExpectConsistent(s, bytes);
  EXPECT_EQ(s.total.changed_words, 0u);
  EXPECT_EQ(s.total.stored_bytes, 0u);
  EXPECT_TRUE(s.compressor_chunks.empty());
  EXPECT_LT(BitsPerChangedWord(s.total.stored_bytes, s.total.changed_words), 0.0);
  EXPECT_EQ(s.total.changed_fraction(), 0.0);
}

TEST(InspectTest, EmptyCheckpointHasZeroDensity) {
  OwnedCheckpoint empty;
  auto bytes = MustEncode(empty, empty);
  DeltaSummary s = SummarizeDelta(MustParse(bytes));
  ExpectConsistent(s, bytes);
  EXPECT_EQ(s.total.words, 0u);
  EXPECT_EQ(s.total.changed_fraction(), 0.0);
}

TEST(InspectTest, BitsPerChangedWord) {
  EXPECT_DOUBLE_EQ(BitsPerChangedWord(100, 800), 1.0);
  EXPECT_DOUBLE_EQ(BitsPerChangedWord(3, 2), 12.0);
  EXPECT_LT(BitsPerChangedWord(0, 0), 0.0);
  EXPECT_LT(BitsPerChangedWord(10, 0), 0.0);
}

class InspectFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("flywheel_inspect_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string P(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(InspectFileTest, FileSummaryMatchesInMemorySummary) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 7);
  auto target = Mutate(base, 0.05, 8);
  EncodeOptions options;
  options.metadata = {{"step", "8"}};
  auto bytes = MustEncode(base, target, options);
  ASSERT_TRUE(WriteFileAtomically(P("8.fwd"), bytes).ok());
  auto from_file = InspectDeltaFile(P("8.fwd"));
  ASSERT_TRUE(from_file.ok()) << from_file.status().ToString();
  DeltaSummary in_memory = SummarizeDelta(MustParse(bytes));
  ExpectConsistent(*from_file, bytes);
  EXPECT_EQ(from_file->file_bytes, in_memory.file_bytes);
  EXPECT_EQ(from_file->total.stored_bytes, in_memory.total.stored_bytes);
  EXPECT_EQ(from_file->total.changed_words, in_memory.total.changed_words);
  EXPECT_EQ(from_file->compressor_chunks, in_memory.compressor_chunks);
  EXPECT_EQ(from_file->manifest.metadata, in_memory.manifest.metadata);
  EXPECT_EQ(from_file->manifest.target_hash, in_memory.manifest.target_hash);
}

TEST_F(InspectFileTest, MissingFileFails) {
  auto summary = InspectDeltaFile(P("missing.fwd"));
  ASSERT_FALSE(summary.ok());
  EXPECT_NE(summary.status().message().find("missing.fwd"), std::string::npos)
      << summary.status().ToString();
}

TEST_F(InspectFileTest, CorruptManifestFails) {
  auto base = RandomCheckpoint({{"a", DType::kBF16, {1000}}}, 9);
  auto bytes = MustEncode(base, Mutate(base, 0.1, 10));
  bytes[60] ^= std::byte{0x40};  // inside the manifest: its checksum no longer matches
  ASSERT_TRUE(WriteFileAtomically(P("bad.fwd"), bytes).ok());
  auto summary = InspectDeltaFile(P("bad.fwd"));
  ASSERT_FALSE(summary.ok());
  EXPECT_EQ(summary.status().code(), StatusCode::kCorruption) << summary.status().ToString();
}

}  // namespace
}  // namespace flywheel::delta
