// Containers written by the codec before the context-modelled sparse coding (chunk kind 3)
// existed, checked in under tests/delta/data/old_format with their base and target
// checkpoints (the tensors below, concatenated raw). Every one must still decode bit for
// bit: a change to the decoders that breaks an old delta fails here.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include "delta/delta.h"

namespace flywheel::delta {
namespace {

namespace fs = std::filesystem;

struct Spec {
  const char* name;
  DType dtype;
  std::vector<int64_t> shape;
};

// The layout the fixtures were written with (tensor order as in base.bin / target.bin).
const std::vector<Spec>& Specs() {
  static const std::vector<Spec> specs = {
      {"model.w.bf16", DType::kBF16, {64, 256}},   {"model.dense.bf16", DType::kBF16, {32, 64}},
      {"model.few.f32", DType::kF32, {100}},       {"model.lit.u8", DType::kU8, {300}},
      {"model.q.f8", DType::kF8_E4M3, {64, 128}},
  };
  return specs;
}

std::vector<std::byte> ReadFixture(const std::string& name) {
  const fs::path path = fs::path(FLYWHEEL_SOURCE_DIR) / "tests/delta/data/old_format" / name;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "missing fixture " << path;
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// The checkpoint in `file` cut into the fixture tensors.
OwnedCheckpoint Checkpoint(const std::string& file) {
  const std::vector<std::byte> bytes = ReadFixture(file);
  OwnedCheckpoint ckpt;
  size_t offset = 0;
  for (const Spec& s : Specs()) {
    const uint64_t size = *TensorByteSize(s.dtype, s.shape);
    EXPECT_LE(offset + size, bytes.size());
    OwnedTensor t{s.name, s.dtype, s.shape, {}};
    t.data.assign(bytes.begin() + offset, bytes.begin() + offset + size);
    ckpt.tensors.push_back(std::move(t));
    offset += size;
  }
  EXPECT_EQ(offset, bytes.size());
  return ckpt;
}

uint16_t FormatVersion(const std::vector<std::byte>& container) {
  return static_cast<uint16_t>(static_cast<unsigned>(container[8]) |
                               (static_cast<unsigned>(container[9]) << 8));
}

void ExpectSameBytes(const OwnedCheckpoint& got, const OwnedCheckpoint& want, size_t first,
                     size_t count) {
  ASSERT_EQ(got.tensors.size(), count);
  for (size_t i = 0; i < count; ++i) {
    EXPECT_EQ(got.tensors[i].name, want.tensors[first + i].name);
    EXPECT_TRUE(got.tensors[i].data == want.tensors[first + i].data)
        << "tensor " << want.tensors[first + i].name << " differs";
  }
}

void ExpectDeltaRebuildsTarget(const std::string& file, uint16_t version) {
  const OwnedCheckpoint base = Checkpoint("base.bin");
  const OwnedCheckpoint target = Checkpoint("target.bin");
  const std::vector<std::byte> container = ReadFixture(file);
  ASSERT_EQ(FormatVersion(container), version);
  auto delta = DeltaView::Parse(container);
  ASSERT_TRUE(delta.ok()) << delta.status().ToString();
  auto out = ApplyToCopy(base.view(), *delta);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ExpectSameBytes(*out, target, 0, Specs().size());
}

TEST(OldFormatTest, Format1DeltaStillDecodes) { ExpectDeltaRebuildsTarget("delta_v1.fwd", 1); }

TEST(OldFormatTest, Format2StreamedDeltaStillDecodes) {
  ExpectDeltaRebuildsTarget("delta_v2_streamed.fwd", 2);
}

TEST(OldFormatTest, KeyframesStillDecode) {
  const OwnedCheckpoint target = Checkpoint("target.bin");
  for (const auto& [file, version] :
       {std::pair<std::string, uint16_t>{"keyframe_v1.fwd", 1}, {"keyframe_v2_streamed.fwd", 2}}) {
    SCOPED_TRACE(file);
    const std::vector<std::byte> container = ReadFixture(file);
    ASSERT_EQ(FormatVersion(container), version);
    auto keyframe = DeltaView::Parse(container);
    ASSERT_TRUE(keyframe.ok()) << keyframe.status().ToString();
    auto out = DecodeKeyframe(*keyframe);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    ExpectSameBytes(*out, target, 0, Specs().size());
  }
}

TEST(OldFormatTest, Fp8DeltaStillDecodes) {
  const OwnedCheckpoint base = Checkpoint("base.bin");
  const OwnedCheckpoint target = Checkpoint("target.bin");
  const size_t fp8 = Specs().size() - 1;
  const std::vector<std::byte> container = ReadFixture("delta_v1_fp8.fwd");
  auto delta = DeltaView::Parse(container);
  ASSERT_TRUE(delta.ok()) << delta.status().ToString();
  for (const ChunkEntry& e : delta->manifest().chunks) EXPECT_EQ(e.kind, ChunkKind::kSparse);
  const OwnedTensor& t = base.tensors[fp8];
  CheckpointView base_fp8{TensorView{t.name, t.dtype, t.shape, t.data}};
  auto out = ApplyToCopy(base_fp8, *delta);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ExpectSameBytes(*out, target, fp8, 1);
}

TEST(OldFormatTest, UnknownFormatVersionIsRefusedByNumber) {
  std::vector<std::byte> container = ReadFixture("delta_v1.fwd");
  container[8] = std::byte{9};
  const uint64_t header_sum = XXH3_64bits(container.data(), 40);  // a well-formed header
  std::memcpy(container.data() + 40, &header_sum, 8);
  auto delta = DeltaView::Parse(container);
  ASSERT_FALSE(delta.ok());
  EXPECT_NE(delta.status().ToString().find("version 9"), std::string::npos)
      << delta.status().ToString();
}

}  // namespace
}  // namespace flywheel::delta
