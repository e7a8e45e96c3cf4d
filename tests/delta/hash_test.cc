#include "checkpoint/hash.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include "tests/delta/test_checkpoints.h"

namespace flywheel {
namespace {

TEST(HashTest, TensorHashIsXxh3OfTheBytes) {
  auto ckpt = testing::RandomCheckpoint({{"w", DType::kBF16, {1000}}}, 1);
  XXH128_hash_t h = XXH3_128bits(ckpt.tensors[0].data.data(), ckpt.tensors[0].data.size());
  Hash128 ours = TensorHash(ckpt.view()[0]);
  EXPECT_EQ(ours.low, h.low64);
  EXPECT_EQ(ours.high, h.high64);
}

TEST(HashTest, HexRoundTripAndCanonicalOrder) {
  Hash128 h{0x0123456789abcdefull, 0xfedcba9876543210ull};
  EXPECT_EQ(h.ToHex(), "fedcba98765432100123456789abcdef");
  EXPECT_EQ(*Hash128::FromHex(h.ToHex()), h);
  EXPECT_FALSE(Hash128::FromHex("xyz").ok());
  EXPECT_FALSE(Hash128::FromHex(std::string(32, 'g')).ok());
}

TEST(HashTest, CheckpointHashIgnoresTensorOrder) {
  auto ckpt = testing::RandomCheckpoint(testing::MixedSpecs(), 2);
  auto reversed = ckpt;
  std::reverse(reversed.tensors.begin(), reversed.tensors.end());
  EXPECT_EQ(*CheckpointHash(ckpt.view()), *CheckpointHash(reversed.view()));
  EXPECT_EQ(*CheckpointHash(ckpt.view(), 1), *CheckpointHash(ckpt.view(), 4));
}

TEST(HashTest, CheckpointHashCoversNamesDtypesShapesAndBytes) {
  auto ckpt = testing::RandomCheckpoint({{"a", DType::kF32, {4, 6}}, {"b", DType::kU8, {10}}}, 3);
  Hash128 h = *CheckpointHash(ckpt.view());
  auto renamed = ckpt;
  renamed.tensors[0].name = "c";
  EXPECT_NE(*CheckpointHash(renamed.view()), h);
  auto reshaped = ckpt;
  reshaped.tensors[0].shape = {6, 4};
  EXPECT_NE(*CheckpointHash(reshaped.view()), h);
  auto retyped = ckpt;
  retyped.tensors[0].dtype = DType::kI32;
  EXPECT_NE(*CheckpointHash(retyped.view()), h);
  auto flipped = ckpt;
  flipped.tensors[1].data[9] ^= std::byte{1};
  EXPECT_NE(*CheckpointHash(flipped.view()), h);
  // Moving bytes between tensors keeps the concatenation but not the hash.
  OwnedCheckpoint split{{{"a", DType::kU8, {2}, {std::byte{1}, std::byte{2}}},
                         {"b", DType::kU8, {1}, {std::byte{3}}}}};
  OwnedCheckpoint split2{{{"a", DType::kU8, {1}, {std::byte{1}}},
                          {"b", DType::kU8, {2}, {std::byte{2}, std::byte{3}}}}};
  EXPECT_NE(*CheckpointHash(split.view()), *CheckpointHash(split2.view()));
}

TEST(HashTest, DuplicateNamesAreAnError) {
  OwnedCheckpoint dup{
      {{"a", DType::kU8, {1}, {std::byte{1}}}, {"a", DType::kU8, {1}, {std::byte{1}}}}};
  auto h = CheckpointHash(dup.view());
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("'a'"), std::string::npos);
}

TEST(HashTest, EmptyCheckpointHasAHash) {
  OwnedCheckpoint empty;
  EXPECT_TRUE(CheckpointHash(empty.view()).ok());
}

}  // namespace
}  // namespace flywheel
