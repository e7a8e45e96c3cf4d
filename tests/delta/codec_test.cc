#include <gtest/gtest.h>
#include <zstd.h>

#include <cmath>
#include <cstring>
#include <thread>

#include "delta/delta.h"
#include "checkpoint/hash.h"
#include "tests/delta/test_checkpoints.h"

namespace flywheel::delta {
namespace {

using testing::Change;
using testing::Mutate;
using testing::MustEncode;
using testing::MustParse;
using testing::RandomCheckpoint;
using testing::SameBytes;

OwnedCheckpoint MustApply(const OwnedCheckpoint& base, const std::vector<std::byte>& delta) {
  auto view = DeltaView::Parse(delta);
  EXPECT_TRUE(view.ok()) << view.status().ToString();
  auto out = ApplyToCopy(base.view(), *view);
  EXPECT_TRUE(out.ok()) << out.status().ToString();
  return out.ok() ? *out : OwnedCheckpoint{};
}

TEST(CodecTest, RoundTripEveryWordSizeAndDensity) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 1);
  for (double density : {0.0, 0.001, 0.02, 0.3, 1.0}) {
    for (Change change : {Change::kSmallSteps, Change::kArbitrary}) {
      auto target = Mutate(base, density, 2, change);
      for (Compressor c : {Compressor::kZstd, Compressor::kLz4, Compressor::kNone}) {
        EncodeOptions options;
        options.compressor = c;
        options.chunk_bytes = 4096;  // many chunks per tensor
        auto delta = MustEncode(base, target, options);
        EXPECT_TRUE(SameBytes(MustApply(base, delta), target))
            << "density " << density << " codec " << CompressorName(c);
      }
    }
  }
}

TEST(CodecTest, AwkwardSizesForEveryWidth) {
  for (DType dtype : {DType::kU8, DType::kBF16, DType::kF32, DType::kF64}) {
    for (int64_t n : {1, 3, 7, 733, 1'000'013}) {
      auto base = RandomCheckpoint({{"t", dtype, {n}}}, n);
      auto target = Mutate(base, 0.03, n + 1);
      EncodeOptions options;
      options.chunk_bytes = 64 << 10;
      auto delta = MustEncode(base, target, options);
      EXPECT_TRUE(SameBytes(MustApply(base, delta), target)) << DTypeName(dtype) << " n=" << n;
    }
  }
}

TEST(CodecTest, SpecialFloatBitPatternsAreExact) {
  // NaN payloads, signed zeros, subnormals, infinities: only bits matter.
  auto put32 = [](std::vector<std::byte>& d, size_t i, uint32_t v) {
    std::memcpy(d.data() + 4 * i, &v, 4);
  };
  OwnedCheckpoint base{{{"f", DType::kF32, {8}, std::vector<std::byte>(32)}}};
  OwnedCheckpoint target = base;
  const uint32_t base_bits[8] = {0x00000000, 0x7fc00001, 0x00000001, 0x7f800000,
                                 0x3f800000, 0xffc00000, 0x007fffff, 0x80000001};
  const uint32_t target_bits[8] = {0x80000000, 0x7fc00002, 0x00000002, 0xff800000,
                                   0x3f800000, 0x7fc00000, 0x00800000, 0x00000001};
  for (int i = 0; i < 8; ++i) {
    put32(base.tensors[0].data, i, base_bits[i]);
    put32(target.tensors[0].data, i, target_bits[i]);
  }
  auto delta = MustEncode(base, target);
  auto view = MustParse(delta);
  EXPECT_EQ(view.manifest().changed_words(), 7u);
  EXPECT_TRUE(SameBytes(MustApply(base, delta), target));
}

TEST(CodecTest, WrapAroundDifferences) {
  // 0x0000 -> 0xffff and 0x8000 <-> 0x7fff are +-1 steps modulo 2^16.
  OwnedCheckpoint base{{{"h", DType::kBF16, {4}, std::vector<std::byte>(8)}}};
  OwnedCheckpoint target = base;
  const uint16_t b[4] = {0x0000, 0xffff, 0x8000, 0x7fff};
  const uint16_t t[4] = {0xffff, 0x0000, 0x7fff, 0x8000};
  std::memcpy(base.tensors[0].data.data(), b, 8);
  std::memcpy(target.tensors[0].data.data(), t, 8);
  EXPECT_TRUE(SameBytes(MustApply(base, MustEncode(base, target)), target));
}

// report_changes: sparse chunks list exactly the words that differ; dense chunks (and
// keyframes) say "all" for a range that covers them.
TEST(CodecTest, ReportedChangesCoverExactlyTheChangedWords) {
  auto v1 = RandomCheckpoint(testing::MixedSpecs(), 21);
  for (double density : {0.01, 0.6}) {
    SCOPED_TRACE(density);
    auto v2 = Mutate(v1, density, 22);
    auto bytes = MustEncode(v1, v2);
    auto view = MustParse(bytes);
    for (bool restore : {true, false}) {
      OwnedCheckpoint state = v1;
      auto mv = state.mutable_view();
      ApplyOptions options;
      options.report_changes = true;
      options.restore_on_failure = restore;
      auto stats = ApplyInPlace(mv, view, options);
      ASSERT_TRUE(stats.ok()) << stats.status().ToString();
      ASSERT_TRUE(SameBytes(state, v2));
      std::vector<std::vector<bool>> covered(state.tensors.size());
      std::vector<std::vector<bool>> listed(state.tensors.size());
      for (size_t t = 0; t < state.tensors.size(); ++t) {
        const size_t words = state.tensors[t].data.size() / DTypeWordBytes(state.tensors[t].dtype);
        covered[t].assign(words, false);
        listed[t].assign(words, false);
      }
      bool any_sparse = false;
      for (const ChangedWords& c : stats->changes) {
        ASSERT_LT(c.state_index, state.tensors.size());
        if (c.all) {
          for (uint64_t i = 0; i < c.word_count; ++i)
            covered[c.state_index][c.word_begin + i] = true;
        } else {
          any_sparse = true;
          for (uint32_t p : c.positions) {
            ASSERT_LT(p, c.word_count);
            listed[c.state_index][c.word_begin + p] = true;
            covered[c.state_index][c.word_begin + p] = true;
          }
        }
      }
      if (density < 0.1) {
        EXPECT_TRUE(any_sparse);
      }
      for (size_t t = 0; t < state.tensors.size(); ++t) {
        const int w = DTypeWordBytes(v1.tensors[t].dtype);
        for (size_t i = 0; i < covered[t].size(); ++i) {
          const bool differs = std::memcmp(v1.tensors[t].data.data() + i * w,
                                           v2.tensors[t].data.data() + i * w, w) != 0;
          if (differs) {
            EXPECT_TRUE(covered[t][i])
                << v1.tensors[t].name << " word " << i << " changed, not reported";
          }
          if (listed[t][i]) {
            EXPECT_TRUE(differs) << v1.tensors[t].name << " word " << i << " listed, unchanged";
          }
        }
      }
    }
  }
  auto keyframe = EncodeKeyframe(v1.view(), {});
  ASSERT_TRUE(keyframe.ok());
  auto key_view = MustParse(*keyframe);
  OwnedCheckpoint state = Mutate(v1, 0.5, 23);
  auto mv = state.mutable_view();
  ApplyOptions options;
  options.report_changes = true;
  auto stats = ApplyInPlace(mv, key_view, options);
  ASSERT_TRUE(stats.ok());
  for (const ChangedWords& c : stats->changes) EXPECT_TRUE(c.all);
}

TEST(CodecTest, ChainAppliesInOrder) {
  auto v1 = RandomCheckpoint(testing::MixedSpecs(), 11);
  auto v2 = Mutate(v1, 0.02, 12);
  auto v3 = Mutate(v2, 0.02, 13);
  EncodeOptions o12;
  o12.base_version = 1, o12.target_version = 2;
  EncodeOptions o23;
  o23.base_version = 2, o23.target_version = 3;
  auto d12 = MustEncode(v1, v2, o12);
  auto d23 = MustEncode(v2, v3, o23);
  auto view12 = MustParse(d12);
  auto view23 = MustParse(d23);
  EXPECT_EQ(view12.manifest().target_hash, view23.manifest().base_hash);
  EXPECT_EQ(view23.manifest().target_hash, *CheckpointHash(v3.view()));

  OwnedCheckpoint state = v1;
  auto mv = state.mutable_view();
  ASSERT_TRUE(ApplyInPlace(mv, view12).ok());
  auto stats = ApplyInPlace(mv, view23);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_TRUE(SameBytes(state, v3));
  // The returned hashes let the next apply skip rehashing the state.
  auto v4 = Mutate(v3, 0.02, 14);
  auto d34 = MustEncode(v3, v4);
  auto view34 = MustParse(d34);
  ApplyOptions cached;
  cached.state_tensor_hashes = stats->tensor_hashes;
  ASSERT_TRUE(ApplyInPlace(mv, view34, cached).ok());
  EXPECT_TRUE(SameBytes(state, v4));
}

TEST(CodecTest, RefusesWrongBaseAndLeavesStateUntouched) {
  auto v1 = RandomCheckpoint(testing::MixedSpecs(), 21);
  auto v2 = Mutate(v1, 0.02, 22);
  auto v3 = Mutate(v2, 0.02, 23);
  auto d23 = MustEncode(v2, v3);
  auto view23 = MustParse(d23);
  OwnedCheckpoint state = v1;
  auto mv = state.mutable_view();
  auto result = ApplyInPlace(mv, view23);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kMismatch);
  EXPECT_NE(result.status().message().find("base"), std::string::npos);
  EXPECT_TRUE(SameBytes(state, v1));
  EXPECT_FALSE(ApplyToCopy(v1.view(), view23).ok());
}

TEST(CodecTest, RefusalBeforeCommitRestoresTheBaseExactly) {
  // A consumer that must take the new version too (the rollout engine) refuses it after the
  // whole target is in place and verified: the state goes back to the base bit for bit,
  // for a delta and for a keyframe applied in place.
  auto v1 = RandomCheckpoint(testing::MixedSpecs(), 31);
  auto v2 = Mutate(v1, 0.05, 32);
  auto delta12 = MustEncode(v1, v2);
  auto keyframe2 = EncodeKeyframe(v2.view(), {});
  ASSERT_TRUE(keyframe2.ok());
  for (const std::vector<std::byte>* bytes : {&delta12, &*keyframe2}) {
    auto view = MustParse(*bytes);
    OwnedCheckpoint state = v1;
    auto mv = state.mutable_view();
    ApplyOptions options;
    options.report_changes = true;
    bool saw_target = false;
    options.before_commit = [&](const ApplyStats& stats) {
      saw_target = SameBytes(state, v2) && !stats.changes.empty();
      return Status::Mismatch("engine says no");
    };
    auto result = ApplyInPlace(mv, view, options);
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().message(), "engine says no");
    EXPECT_TRUE(saw_target) << "before_commit must see the verified target";
    EXPECT_TRUE(SameBytes(state, v1));
    // Accepted, the apply commits as usual.
    options.before_commit = [](const ApplyStats&) { return Status::Ok(); };
    ASSERT_TRUE(ApplyInPlace(mv, view, options).ok());
    EXPECT_TRUE(SameBytes(state, v2));
  }
  // Without undo records a refusal could not restore anything: refused up front.
  OwnedCheckpoint state = v1;
  auto mv = state.mutable_view();
  ApplyOptions no_undo;
  no_undo.restore_on_failure = false;
  no_undo.before_commit = [](const ApplyStats&) { return Status::Ok(); };
  auto refused = ApplyInPlace(mv, MustParse(delta12), no_undo);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameBytes(state, v1));
}

TEST(CodecTest, RefusesLyingCachedHashes) {
  // Cached hashes that claim the state is the base are checked against the manifest;
  // if they lie, the target hash check still catches it and the state is restored.
  auto v1 = RandomCheckpoint(testing::MixedSpecs(), 31);
  auto v2 = Mutate(v1, 0.05, 32);
  auto v3 = Mutate(v2, 0.05, 33);
  auto d23 = MustEncode(v2, v3);
  auto view23 = MustParse(d23);
  OwnedCheckpoint state = v1;
  auto mv = state.mutable_view();
  ApplyOptions lying;
  for (const auto& t : view23.manifest().tensors) lying.state_tensor_hashes.push_back(t.base_hash);
  auto result = ApplyInPlace(mv, view23, lying);
  ASSERT_FALSE(result.ok());
  EXPECT_TRUE(SameBytes(state, v1));
}

TEST(CodecTest, KeyframeDecodesAndOverwrites) {
  auto v1 = RandomCheckpoint(testing::MixedSpecs(), 41);
  auto v5 = Mutate(v1, 0.2, 45, Change::kArbitrary);
  EncodeOptions options;
  options.target_version = 5;
  auto kf = EncodeKeyframe(v5.view(), options);
  ASSERT_TRUE(kf.ok()) << kf.status().ToString();
  auto view = MustParse(*kf);
  EXPECT_TRUE(view.manifest().keyframe);
  EXPECT_EQ(view.manifest().target_version, 5u);
  auto decoded = DecodeKeyframe(view);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_TRUE(SameBytes(*decoded, v5));
  OwnedCheckpoint state = v1;  // any state of the same layout
  auto mv = state.mutable_view();
  ASSERT_TRUE(ApplyInPlace(mv, view).ok());
  EXPECT_TRUE(SameBytes(state, v5));
  // Keyframe then delta equals the delta's target.
  auto v6 = Mutate(v5, 0.02, 46);
  ASSERT_TRUE(ApplyInPlace(mv, MustParse(MustEncode(v5, v6))).ok());
  EXPECT_TRUE(SameBytes(state, v6));
}

TEST(CodecTest, EncodingIsDeterministicAcrossThreadCounts) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 51);
  auto target = Mutate(base, 0.03, 52);
  EncodeOptions one, four;
  one.chunk_bytes = four.chunk_bytes = 4096;
  four.threads = 4;
  EXPECT_EQ(MustEncode(base, target, one), MustEncode(base, target, four));
  auto bytes = MustEncode(base, target, one);
  auto view = MustParse(bytes);
  ApplyOptions apply;
  apply.threads = 3;
  auto out = ApplyToCopy(base.view(), view, apply);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_TRUE(SameBytes(*out, target));
}

TEST(CodecTest, HashingInsideTheComparePassChangesNothing) {
  // Four equal tensors: with 2 threads the encoder hashes while comparing (no tensor is
  // too large to share out), also when only the base's hashes are given (a publisher's
  // cached head); with 5 threads or given hashes it hashes first. Same bytes.
  std::vector<testing::TensorSpec> specs;
  for (int i = 0; i < 4; ++i) specs.push_back({"t" + std::to_string(i), DType::kBF16, {300, 70}});
  auto base = RandomCheckpoint(specs, 55);
  auto target = Mutate(base, 0.02, 56);
  EncodeOptions fused, split, given;
  fused.chunk_bytes = split.chunk_bytes = given.chunk_bytes = 4096;
  fused.threads = 2;
  split.threads = 5;
  for (const auto& t : base.view()) given.base_tensor_hashes.push_back(TensorHash(t));
  for (const auto& t : target.view()) given.target_tensor_hashes.push_back(TensorHash(t));
  auto a = MustEncode(base, target, fused);
  EXPECT_EQ(a, MustEncode(base, target, split));
  EXPECT_EQ(a, MustEncode(base, target, given));
  EncodeOptions base_given = fused;
  base_given.base_tensor_hashes = given.base_tensor_hashes;
  EXPECT_EQ(a, MustEncode(base, target, base_given));
  // Given base hashes follow the base's own tensor order.
  OwnedCheckpoint reordered = base;
  std::reverse(reordered.tensors.begin(), reordered.tensors.end());
  base_given.base_tensor_hashes.clear();
  for (const auto& t : reordered.view()) base_given.base_tensor_hashes.push_back(TensorHash(t));
  EXPECT_EQ(a, MustEncode(reordered, target, base_given));
  auto k1 = EncodeKeyframe(target.view(), fused);
  auto k2 = EncodeKeyframe(target.view(), split);
  ASSERT_TRUE(k1.ok() && k2.ok());
  EXPECT_EQ(*k1, *k2);
}

TEST(CodecTest, TensorOrderDoesNotMatter) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 61);
  auto target = Mutate(base, 0.02, 62);
  OwnedCheckpoint reordered = base;
  std::reverse(reordered.tensors.begin(), reordered.tensors.end());
  auto delta = MustEncode(reordered, target);
  EXPECT_TRUE(SameBytes(MustApply(reordered, delta), target));
  EXPECT_EQ(*CheckpointHash(base.view()), *CheckpointHash(reordered.view()));
}

TEST(CodecTest, SparseDeltaIsSmall) {
  // bf16 words changed at 2% by +-1..2 ulp: positions ~7.1 bits + values ~1.5 bits.
  auto base = RandomCheckpoint({{"w", DType::kBF16, {2048, 1024}}}, 71);
  auto target = Mutate(base, 0.02, 72);
  auto delta = MustEncode(base, target);
  auto view = MustParse(delta);
  double bits = 8.0 * delta.size() / view.manifest().changed_words();
  EXPECT_LT(bits, 9.5);
  EXPECT_GT(bits, 7.0);  // below the entropy floor would mean a measuring mistake
}

TEST(CodecTest, DenseChangesFallBackToDenseEncoding) {
  // Every word replaced: the delta may not be much larger than zstd of the target.
  auto base = RandomCheckpoint({{"w", DType::kBF16, {512, 512}}}, 81);
  auto target = Mutate(base, 1.0, 82, Change::kArbitrary);
  // Give the target some structure (high bytes from a narrow range) so zstd can win.
  for (size_t i = 1; i < target.tensors[0].data.size(); i += 2) {
    target.tensors[0].data[i] =
        static_cast<std::byte>(0x3c + (static_cast<uint8_t>(target.tensors[0].data[i]) & 3));
  }
  auto delta = MustEncode(base, target);
  const auto& raw = target.tensors[0].data;
  std::vector<char> z(ZSTD_compressBound(raw.size()));
  size_t zsize = ZSTD_compress(z.data(), z.size(), raw.data(), raw.size(), 3);
  EXPECT_LT(delta.size(), zsize * 1.02 + 256);
  EXPECT_TRUE(SameBytes(MustApply(base, delta), target));
  auto view = MustParse(delta);
  EXPECT_NE(view.manifest().chunks[0].kind, ChunkKind::kSparse);
}

TEST(CodecTest, MismatchedCheckpointsAreRefusedByName) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 91);
  auto other_shape = base;
  other_shape.tensors[1].shape = {32, 128};
  auto r = Encode(base.view(), other_shape.view(), {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kMismatch);
  EXPECT_NE(r.status().message().find("q_proj"), std::string::npos);
  auto renamed = base;
  renamed.tensors[2].name = "other";
  r = Encode(base.view(), renamed.view(), {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("input_layernorm"), std::string::npos);
  auto fewer = base;
  fewer.tensors.pop_back();
  EXPECT_EQ(Encode(base.view(), fewer.view(), {}).status().code(), StatusCode::kMismatch);
  auto bad_size = base;
  bad_size.tensors[0].data.pop_back();
  EXPECT_EQ(Encode(base.view(), bad_size.view(), {}).status().code(), StatusCode::kInvalidArgument);
}

TEST(CodecTest, RejectsBadOptions) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 95);
  EncodeOptions options;
  options.threads = 0;
  EXPECT_EQ(Encode(base.view(), base.view(), options).status().code(),
            StatusCode::kInvalidArgument);
  options = {};
  options.chunk_bytes = 100;
  EXPECT_EQ(Encode(base.view(), base.view(), options).status().code(),
            StatusCode::kInvalidArgument);
  options = {};
  options.zstd_level = 99;
  EXPECT_EQ(Encode(base.view(), base.view(), options).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(CodecTest, InspectCountsMatchTheChange) {
  auto base = RandomCheckpoint({{"a", DType::kBF16, {100000}}, {"b", DType::kF32, {1000}}}, 97);
  auto target = base;
  for (int i = 0; i < 100; ++i) target.tensors[0].data[2 * i * 37] ^= std::byte{1};
  auto bytes = MustEncode(base, target);
  auto view = MustParse(bytes);
  auto stats = Inspect(view);
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].changed_words, 100u);
  EXPECT_EQ(stats[0].words, 100000u);
  EXPECT_EQ(stats[1].changed_words, 0u);
  EXPECT_EQ(stats[1].stored_bytes, 0u);
}

}  // namespace
}  // namespace flywheel::delta

namespace flywheel::delta {
namespace {

// The tensor of `checkpoint` a chunk of `view` patches.
std::span<const std::byte> TensorOf(const OwnedCheckpoint& checkpoint, const DeltaView& view,
                                    size_t chunk) {
  const std::string& name = view.manifest().tensors[view.manifest().chunks[chunk].tensor_index].name;
  for (const OwnedTensor& t : checkpoint.tensors) {
    if (t.name == name) return t.data;
  }
  return {};
}

TEST(PreparedChunksTest, ChunksDecodedAheadApplyToTheSameTarget) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 71);
  for (Change change : {Change::kSmallSteps, Change::kArbitrary}) {
    auto target = Mutate(base, 0.04, 72, change);
    EncodeOptions encode;
    encode.chunk_bytes = 4096;
    auto bytes = MustEncode(base, target, encode);
    DeltaView view = MustParse(bytes);
    const size_t chunks = view.manifest().chunks.size();
    size_t sparse = 0;
    for (const ChunkEntry& e : view.manifest().chunks) sparse += e.kind == ChunkKind::kSparse;
    ASSERT_GT(sparse, 4u);
    // Every other chunk ahead: the apply decodes the rest itself.
    PreparedChunks prepared(chunks, 1ull << 30);
    size_t kept = 0;
    for (size_t c = 0; c < chunks; c += 2) kept += prepared.Prepare(view, c, TensorOf(base, view, c));
    EXPECT_GT(kept, 0u);
    EXPECT_EQ(prepared.prepared(), kept);
    EXPECT_FALSE(prepared.Prepare(view, 0, TensorOf(base, view, 0))) << "prepared twice";
    OwnedCheckpoint state = base;
    auto mv = state.mutable_view();
    ApplyOptions options;
    options.prepared = &prepared;
    options.report_changes = true;
    auto applied = ApplyInPlace(mv, view, options);
    ASSERT_TRUE(applied.ok()) << applied.status().ToString();
    EXPECT_TRUE(SameBytes(state, target));
    EXPECT_EQ(prepared.used(), kept);
    // The changes reported are the same as without prepared chunks.
    OwnedCheckpoint plain = base;
    auto pv = plain.mutable_view();
    ApplyOptions plain_options;
    plain_options.report_changes = true;
    auto plain_applied = ApplyInPlace(pv, view, plain_options);
    ASSERT_TRUE(plain_applied.ok());
    ASSERT_EQ(applied->changes.size(), plain_applied->changes.size());
    for (size_t c = 0; c < applied->changes.size(); ++c) {
      EXPECT_EQ(applied->changes[c].positions, plain_applied->changes[c].positions) << c;
    }
    // Claimed by the apply, a chunk is never prepared again.
    EXPECT_FALSE(prepared.Prepare(view, 1, TensorOf(base, view, 1)));
  }
}

TEST(PreparedChunksTest, ChunksPreparedAgainstOtherBytesFailTheApplyAndRestoreTheState) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 73);
  auto target = Mutate(base, 0.04, 74);
  auto other = Mutate(base, 0.5, 75);
  EncodeOptions encode;
  encode.chunk_bytes = 4096;
  auto bytes = MustEncode(base, target, encode);
  DeltaView view = MustParse(bytes);
  PreparedChunks prepared(view.manifest().chunks.size(), 1ull << 30);
  size_t kept = 0;
  for (size_t c = 0; c < view.manifest().chunks.size(); ++c) {
    kept += prepared.Prepare(view, c, TensorOf(other, view, c));
  }
  ASSERT_GT(kept, 0u);
  OwnedCheckpoint state = base;
  auto mv = state.mutable_view();
  ApplyOptions options;
  options.prepared = &prepared;
  auto applied = ApplyInPlace(mv, view, options);
  ASSERT_FALSE(applied.ok()) << "words decoded against other bytes were applied";
  EXPECT_EQ(applied.status().code(), StatusCode::kCorruption) << applied.status().ToString();
  EXPECT_TRUE(SameBytes(state, base)) << "the state was not restored";
}

TEST(PreparedChunksTest, BudgetCorruptChunksAndARaceWithTheApply) {
  auto base = RandomCheckpoint(testing::MixedSpecs(), 76);
  auto target = Mutate(base, 0.04, 77);
  EncodeOptions encode;
  encode.chunk_bytes = 4096;
  auto bytes = MustEncode(base, target, encode);
  DeltaView view = MustParse(bytes);
  const size_t chunks = view.manifest().chunks.size();
  // No budget: nothing is kept, and the apply decodes everything itself.
  PreparedChunks none(chunks, 0);
  EXPECT_FALSE(none.Prepare(view, 0, TensorOf(base, view, 0)));
  // A chunk whose stored bytes are corrupt is not kept; the apply reports it by name.
  auto corrupt = bytes;
  const ChunkEntry& first = view.manifest().chunks[0];
  corrupt[view.payload(first).data() - view.bytes().data()] ^= std::byte{1};
  DeltaView corrupt_view = MustParse(corrupt);
  PreparedChunks guarded(chunks, 1ull << 30);
  EXPECT_FALSE(guarded.Prepare(corrupt_view, 0, TensorOf(base, corrupt_view, 0)));
  OwnedCheckpoint state = base;
  auto mv = state.mutable_view();
  ApplyOptions options;
  options.prepared = &guarded;
  auto applied = ApplyInPlace(mv, corrupt_view, options);
  ASSERT_FALSE(applied.ok());
  EXPECT_NE(applied.status().message().find("chunk 0"), std::string::npos) << applied.status().ToString();
  EXPECT_TRUE(SameBytes(state, base));
  // Prepare on another thread while the apply runs: each chunk is taken once, either way.
  for (int round = 0; round < 20; ++round) {
    PreparedChunks racing(chunks, 1ull << 30);
    OwnedCheckpoint copy = base;
    auto cv = copy.mutable_view();
    std::thread preparer([&] {
      for (size_t c = chunks; c-- > 0;) racing.Prepare(view, c, TensorOf(base, view, c));
    });
    ApplyOptions race_options;
    race_options.prepared = &racing;
    race_options.threads = 2;
    auto raced = ApplyInPlace(cv, view, race_options);
    preparer.join();
    ASSERT_TRUE(raced.ok()) << raced.status().ToString();
    EXPECT_TRUE(SameBytes(copy, target)) << "round " << round;
    EXPECT_LE(racing.used(), racing.prepared());
  }
}

}  // namespace
}  // namespace flywheel::delta
