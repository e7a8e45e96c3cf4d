// Corrupted, truncated and forged deltas: each case by name. The rule under test: a bad
// delta is a clear error, never a partial or wrong output, and never a huge allocation.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "delta/delta.h"
#include "delta/delta_file.h"
#include "checkpoint/hash.h"
#include "checkpoint/parallel.h"
#include "tests/delta/test_checkpoints.h"

namespace flywheel::delta {
namespace {

using testing::Mutate;
using testing::RandomCheckpoint;
using testing::SameBytes;

constexpr size_t kHeader = 48;

uint64_t Load64(const std::vector<std::byte>& b, size_t at) {
  uint64_t v;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}
void Store64(std::vector<std::byte>& b, size_t at, uint64_t v) {
  std::memcpy(b.data() + at, &v, 8);
}

// Recomputes the header's checksums, as a forger who knows the format would.
void Reseal(std::vector<std::byte>& b) {
  uint64_t manifest_bytes = Load64(b, 16);
  std::span<const std::byte> manifest(b.data() + kHeader,
                                      std::min<uint64_t>(manifest_bytes, b.size() - kHeader));
  Store64(b, 32, HashBytes64(manifest));
  Store64(b, 40, HashBytes64({b.data(), 40}));
}

// Appends an unsigned LEB128 varint.
void Varint(std::vector<std::byte>& out, uint64_t v) {
  while (v >= 0x80) out.push_back(static_cast<std::byte>(v | 0x80)), v >>= 7;
  out.push_back(static_cast<std::byte>(v));
}

class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = RandomCheckpoint(
        {{"a", DType::kBF16, {3000}}, {"b", DType::kF32, {500}}, {"c", DType::kU8, {64}}}, 1);
    target_ = Mutate(base_, 0.05, 2);
    EncodeOptions options;
    options.chunk_bytes = 4096;
    options.base_version = 7;
    options.target_version = 8;
    delta_ = *Encode(base_.view(), target_.view(), options);
    auto view = DeltaView::Parse(delta_);
    ASSERT_TRUE(view.ok());
    manifest_bytes_ = Load64(delta_, 16);
    for (const ChunkEntry& c : view->manifest().chunks)
      chunk_offsets_.push_back(kHeader + manifest_bytes_ + c.payload_offset);
  }

  // Parse + apply into a copy of the base; returns the status and checks that on failure
  // the state is exactly the base (nothing half-applied).
  Status TryApply(const std::vector<std::byte>& bytes) {
    auto view = DeltaView::Parse(bytes);
    if (!view.ok()) return view.status();
    OwnedCheckpoint state = base_;
    auto mv = state.mutable_view();
    auto result = ApplyInPlace(mv, *view);
    if (!result.ok()) {
      EXPECT_TRUE(SameBytes(state, base_))
          << "state changed by a failed apply: " << result.status().ToString();
      return result.status();
    }
    EXPECT_TRUE(SameBytes(state, target_)) << "apply succeeded with a wrong result";
    return Status::Ok();
  }

  OwnedCheckpoint base_, target_;
  std::vector<std::byte> delta_;
  uint64_t manifest_bytes_ = 0;
  std::vector<size_t> chunk_offsets_;
};

TEST_F(CorruptionTest, IntactDeltaApplies) {
  EXPECT_TRUE(TryApply(delta_).ok());
}

TEST_F(CorruptionTest, FlippedByteInEveryRegionIsDetected) {
  // Every single byte of the container is covered by a checksum or a check.
  ASSERT_LT(delta_.size(), 20000u);
  for (size_t i = 0; i < delta_.size(); ++i) {
    auto bad = delta_;
    bad[i] ^= std::byte{0x40};
    Status st = TryApply(bad);
    EXPECT_FALSE(st.ok()) << "flip at byte " << i << " went unnoticed";
  }
}

TEST_F(CorruptionTest, BadMagic) {
  auto bad = delta_;
  bad[0] = std::byte{'X'};
  Status st = TryApply(bad);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find("magic"), std::string::npos);
}

TEST_F(CorruptionTest, HeaderChecksumMismatch) {
  auto bad = delta_;
  bad[9] ^= std::byte{1};
  EXPECT_NE(TryApply(bad).message().find("header checksum"), std::string::npos);
}

TEST_F(CorruptionTest, UnsupportedVersionAndFlags) {
  auto bad = delta_;
  bad[8] = std::byte{3};
  Reseal(bad);
  EXPECT_NE(TryApply(bad).message().find("version 3"), std::string::npos);
  bad = delta_;
  bad[11] = std::byte{0x80};
  Reseal(bad);
  EXPECT_NE(TryApply(bad).message().find("flags"), std::string::npos);
}

TEST_F(CorruptionTest, ManifestChecksumMismatch) {
  auto bad = delta_;
  bad[kHeader + 3] ^= std::byte{1};
  EXPECT_NE(TryApply(bad).message().find("manifest checksum"), std::string::npos);
}

TEST_F(CorruptionTest, ChunkChecksumMismatch) {
  for (size_t offset : chunk_offsets_) {
    auto bad = delta_;
    bad[offset] ^= std::byte{1};
    Status st = TryApply(bad);
    EXPECT_EQ(st.code(), StatusCode::kCorruption);
    EXPECT_NE(st.message().find("checksum mismatch"), std::string::npos) << st.message();
  }
}

TEST_F(CorruptionTest, TruncationAtEverySectionBoundary) {
  std::vector<size_t> cuts = {0,
                              1,
                              8,
                              47,
                              kHeader,
                              kHeader + 1,
                              kHeader + manifest_bytes_ - 1,
                              kHeader + manifest_bytes_,
                              delta_.size() - 1};
  for (size_t offset : chunk_offsets_) cuts.push_back(offset), cuts.push_back(offset + 1);
  for (size_t cut : cuts) {
    if (cut >= delta_.size()) continue;
    std::vector<std::byte> bad(delta_.begin(), delta_.begin() + cut);
    Status st = TryApply(bad);
    EXPECT_EQ(st.code(), StatusCode::kCorruption) << "cut at " << cut;
    EXPECT_FALSE(st.message().empty());
  }
}

TEST_F(CorruptionTest, TrailingGarbage) {
  auto bad = delta_;
  bad.push_back(std::byte{0});
  EXPECT_NE(TryApply(bad).message().find("truncated or padded"), std::string::npos);
}

TEST_F(CorruptionTest, OversizedManifestLength) {
  auto bad = delta_;
  Store64(bad, 16, uint64_t{1} << 60);
  Reseal(bad);
  Status st = TryApply(bad);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  bad = delta_;
  Store64(bad, 16, manifest_bytes_ + 1000);  // within limits but past the file
  Reseal(bad);
  EXPECT_EQ(TryApply(bad).code(), StatusCode::kCorruption);
}

TEST_F(CorruptionTest, OversizedPayloadLength) {
  auto bad = delta_;
  Store64(bad, 24, ~uint64_t{0});
  Reseal(bad);
  EXPECT_EQ(TryApply(bad).code(), StatusCode::kCorruption);
}

// Builds a container around a hand-made manifest.
std::vector<std::byte> Container(const std::vector<std::byte>& manifest, size_t payload_bytes = 0) {
  std::vector<std::byte> out(kHeader + manifest.size() + payload_bytes);
  std::memcpy(out.data(), "FWDELTA\0", 8);
  out[8] = std::byte{1};
  Store64(out, 16, manifest.size());
  Store64(out, 24, payload_bytes);
  std::copy(manifest.begin(), manifest.end(), out.begin() + kHeader);
  Reseal(out);
  return out;
}

std::vector<std::byte> ManifestPrefix() {
  std::vector<std::byte> m;
  Varint(m, 1);
  Varint(m, 2);
  m.resize(m.size() + 32);  // base + target hash
  Varint(m, 0);             // no metadata
  return m;
}

TEST_F(CorruptionTest, HugeTensorCountDoesNotAllocate) {
  auto m = ManifestPrefix();
  Varint(m, uint64_t{1} << 40);
  Status st = DeltaView::Parse(Container(m)).status();
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  m = ManifestPrefix();
  Varint(m, 1000);  // plausible count, but the manifest ends here
  EXPECT_EQ(DeltaView::Parse(Container(m)).status().code(), StatusCode::kCorruption);
}

TEST_F(CorruptionTest, HugeNameLength) {
  auto m = ManifestPrefix();
  Varint(m, 1);
  Varint(m, uint64_t{1} << 50);
  EXPECT_EQ(DeltaView::Parse(Container(m)).status().code(), StatusCode::kCorruption);
}

TEST_F(CorruptionTest, HugeShapeOverflows) {
  auto m = ManifestPrefix();
  Varint(m, 1);
  Varint(m, 1);
  m.push_back(std::byte{'x'});
  m.push_back(std::byte{9});  // BF16
  Varint(m, 3);
  for (int i = 0; i < 3; ++i) Varint(m, uint64_t{1} << 40);
  m.resize(m.size() + 32);
  Varint(m, 0);
  Varint(m, 0);
  Varint(m, 0);
  Status st = DeltaView::Parse(Container(m)).status();
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find("'x'"), std::string::npos);
}

TEST_F(CorruptionTest, OversizedVarint) {
  auto m = ManifestPrefix();
  for (int i = 0; i < 11; ++i) m.push_back(std::byte{0xff});
  EXPECT_EQ(DeltaView::Parse(Container(m)).status().code(), StatusCode::kCorruption);
}

// A one-tensor delta whose single chunk claims a huge raw size (a decompression bomb).
TEST_F(CorruptionTest, ChunkRawSizeBomb) {
  auto m = ManifestPrefix();
  Varint(m, 1);
  Varint(m, 1);
  m.push_back(std::byte{'x'});
  m.push_back(std::byte{1});  // U8
  Varint(m, 1);
  Varint(m, 1 << 20);
  m.resize(m.size() + 32);
  Varint(m, 1);  // changed words
  Varint(m, 1);  // chunks
  Varint(m, 1);  // chunk table
  Varint(m, 0);
  Varint(m, 1 << 20);
  m.push_back(std::byte{0});     // sparse
  m.push_back(std::byte{1});     // zstd
  Varint(m, 1);                  // changed
  Varint(m, uint64_t{1} << 40);  // raw bytes
  Varint(m, 16);
  m.resize(m.size() + 8);
  Status st = DeltaView::Parse(Container(m, 16)).status();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("raw size"), std::string::npos) << st.message();
}

// A manifest with one U8 tensor of `words` words and one chunk of the given shape.
std::vector<std::byte> OneChunkManifest(bool keyframe, uint64_t words, uint8_t kind,
                                        uint8_t compressor, uint64_t changed, uint64_t raw_bytes,
                                        uint64_t payload_bytes, uint64_t chunk_words = 0) {
  if (chunk_words == 0) chunk_words = words;
  auto m = ManifestPrefix();
  if (keyframe) std::fill(m.begin() + 2, m.begin() + 18, std::byte{0});
  Varint(m, 1);
  Varint(m, 1);
  m.push_back(std::byte{'x'});
  m.push_back(std::byte{1});  // U8
  Varint(m, 1);
  Varint(m, words);
  m.resize(m.size() + 32);
  Varint(m, changed);
  Varint(m, 1);  // chunks of the tensor
  Varint(m, 1);  // chunk table
  Varint(m, 0);
  Varint(m, chunk_words);
  m.push_back(std::byte{kind});
  m.push_back(std::byte{compressor});
  Varint(m, changed);
  Varint(m, raw_bytes);
  Varint(m, payload_bytes);
  m.resize(m.size() + 8);
  return m;
}

TEST_F(CorruptionTest, SparseChunkClaimingMoreChangesThanItsBytesCanHold) {
  // 2^24 changes declared in a 3-byte raw chunk: refused while parsing.
  auto m = OneChunkManifest(false, 1 << 24, 0, 0, 1 << 24, 3, 3);
  Status st = DeltaView::Parse(Container(m, 3)).status();
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find("changes in only 3 bytes"), std::string::npos) << st.message();
}

TEST_F(CorruptionTest, ChunkLargerThanTheWordLimit) {
  auto m = OneChunkManifest(false, (1u << 24) + 1, 0, 0, 1, 16, 16);
  EXPECT_EQ(DeltaView::Parse(Container(m, 16)).status().code(), StatusCode::kResourceExhausted);
}

TEST_F(CorruptionTest, DeclaredTotalSizeOverflowIsRefused) {
  // Two chunkless tensors of 2^62 bytes each: their sum must not wrap.
  auto m = ManifestPrefix();
  Varint(m, 2);
  for (char name : {'a', 'b'}) {
    Varint(m, 1);
    m.push_back(std::byte(name));
    m.push_back(std::byte{1});  // U8
    Varint(m, 1);
    Varint(m, uint64_t{1} << 62);
    m.resize(m.size() + 32);
    Varint(m, 0);
    Varint(m, 0);
  }
  Varint(m, 0);
  EXPECT_EQ(DeltaView::Parse(Container(m)).status().code(), StatusCode::kResourceExhausted);
}

TEST_F(CorruptionTest, ForgedKeyframeIsRefusedBeforeAllocating) {
  // 16 MiB declared as one zstd literal chunk with a 1-byte payload.
  auto m = OneChunkManifest(true, 1 << 24, 2, 1, 1 << 24, 1 << 24, 1);
  auto bytes = Container(m, 1);
  Store64(bytes, 8, (Load64(bytes, 8) & 0xffff) | (uint64_t{1} << 16));  // keyframe flag
  Reseal(bytes);
  auto view = DeltaView::Parse(bytes);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  auto decoded = DecodeKeyframe(*view);
  EXPECT_EQ(decoded.status().code(), StatusCode::kCorruption);
}

TEST_F(CorruptionTest, FileApplyChecksTheBaseBeforeReservingTheOutput) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("flywheel_corrupt_" + std::to_string(getpid()));
  fs::create_directories(dir);
  // A delta naming a 512 GiB tensor, and a base path that does not exist.
  auto m = OneChunkManifest(false, uint64_t{1} << 39, 0, 0, 1, 16, 16, 64);
  ASSERT_TRUE(WriteFileAtomically((dir / "d.fwd").string(), Container(m, 16)).ok());
  auto applied = ApplyFiles((dir / "missing.safetensors").string(), (dir / "d.fwd").string(),
                            (dir / "out.safetensors").string());
  ASSERT_FALSE(applied.ok());
  EXPECT_NE(applied.status().message().find("missing.safetensors"), std::string::npos)
      << applied.status().message();
  EXPECT_FALSE(fs::exists(dir / "out.safetensors"));
  fs::remove_all(dir);
}

TEST(ParallelForTest, ExceptionsReachTheCallerAfterEveryWorkerStopped) {
  std::atomic<int> ran{0};
  EXPECT_THROW(flywheel::ParallelFor(1000, 4,
                                     [&](size_t i) {
                                       ++ran;
                                       if (i == 10) throw std::runtime_error("boom");
                                     }),
               std::runtime_error);
  // The pool is still usable afterwards.
  std::atomic<int> sum{0};
  flywheel::ParallelFor(100, 4, [&](size_t i) { sum += static_cast<int>(i); });
  EXPECT_EQ(sum.load(), 4950);
}

TEST_F(CorruptionTest, ForgedTargetHashRollsBack) {
  // Valid checksums everywhere, but the manifest promises another target: the apply
  // must fail after writing and restore the state.
  auto view = DeltaView::Parse(delta_);
  ASSERT_TRUE(view.ok());
  // The target checkpoint hash sits after two varints (versions 7 and 8) and the base hash.
  auto bad = delta_;
  bad[kHeader + 2 + 16] ^= std::byte{1};
  Reseal(bad);
  Status st = TryApply(bad);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find("after apply"), std::string::npos) << st.message();
}

TEST_F(CorruptionTest, DeltaForOtherLayoutIsRefused) {
  auto other = RandomCheckpoint(
      {{"a", DType::kBF16, {3001}}, {"b", DType::kF32, {500}}, {"c", DType::kU8, {64}}}, 1);
  auto view = DeltaView::Parse(delta_);
  auto mv = other.mutable_view();
  auto result = ApplyInPlace(mv, *view);
  EXPECT_EQ(result.status().code(), StatusCode::kMismatch);
  EXPECT_NE(result.status().message().find("'a'"), std::string::npos);
}

}  // namespace
}  // namespace flywheel::delta
