// The streamed container (format 2): what the encoder writes as it goes, read whole
// (DeltaView::Parse) and while it arrives (StreamReader), with chunks decoded ahead from
// the partial container.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "delta/delta.h"
#include "delta/format.h"
#include "checkpoint/hash.h"
#include "tests/delta/test_checkpoints.h"

namespace flywheel::delta {
namespace {

using testing::Change;
using testing::MixedSpecs;
using testing::Mutate;
using testing::RandomCheckpoint;
using testing::SameBytes;

// Collects what the encoder writes, and when: the container size after each Write.
class VectorSink : public StreamSink {
 public:
  Status Begin(uint64_t size_bound) override {
    ++begins;
    bound = size_bound;
    return Status::Ok();
  }
  Status Write(std::span<const std::byte> bytes) override {
    if (fail_after_writes >= 0 && writes >= fail_after_writes) {
      return Status::IOError("disk full (test)");
    }
    ++writes;
    bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
    return Status::Ok();
  }
  std::vector<std::byte> bytes_;
  uint64_t bound = 0;
  int begins = 0;
  int writes = 0;
  int fail_after_writes = -1;
};

std::vector<testing::TensorSpec> ChunkySpecs() {
  // Several 64 KiB chunks per tensor (chunk_bytes below), bf16 and f32.
  return {{"a", DType::kBF16, {256, 1024}}, {"b", DType::kBF16, {128, 1024}},
          {"c", DType::kF32, {64, 1024}}, {"norm", DType::kF32, {1024}}};
}

EncodeOptions Options(int threads) {
  EncodeOptions options;
  options.base_version = 4;
  options.target_version = 5;
  options.threads = threads;
  options.chunk_bytes = 64 << 10;
  options.metadata = {{"format", "pt"}};
  return options;
}

TEST(StreamedContainerTest, RoundTripsLikeTheBufferedEncoding) {
  for (int threads : {1, 3}) {
    for (auto specs : {ChunkySpecs(), MixedSpecs()}) {
      const OwnedCheckpoint base = RandomCheckpoint(specs, 11);
      const OwnedCheckpoint target = Mutate(base, 0.05, 12, Change::kSmallSteps);
      VectorSink sink;
      ASSERT_TRUE(EncodeStreamed(base.view(), target.view(), Options(threads), sink).ok());
      EXPECT_EQ(sink.begins, 1);
      EXPECT_LE(sink.bytes_.size(), sink.bound);
      Result<DeltaView> streamed = DeltaView::Parse(sink.bytes_);
      ASSERT_TRUE(streamed.ok()) << streamed.status().ToString();
      EXPECT_TRUE(streamed->streamed());
      Result<std::vector<std::byte>> buffered = Encode(base.view(), target.view(), Options(threads));
      ASSERT_TRUE(buffered.ok());
      Result<DeltaView> plain = DeltaView::Parse(*buffered);
      ASSERT_TRUE(plain.ok());
      const Manifest& a = streamed->manifest();
      const Manifest& b = plain->manifest();
      EXPECT_EQ(a.base_version, 4u);
      EXPECT_EQ(a.target_version, 5u);
      EXPECT_EQ(a.base_hash, b.base_hash);
      EXPECT_EQ(a.target_hash, b.target_hash);
      EXPECT_EQ(a.metadata, b.metadata);
      ASSERT_EQ(a.tensors.size(), b.tensors.size());
      for (size_t i = 0; i < a.tensors.size(); ++i) {
        EXPECT_EQ(a.tensors[i].target_hash, b.tensors[i].target_hash) << a.tensors[i].name;
        EXPECT_EQ(a.tensors[i].changed_words, b.tensors[i].changed_words) << a.tensors[i].name;
      }
      ASSERT_EQ(a.chunks.size(), b.chunks.size());
      for (size_t c = 0; c < a.chunks.size(); ++c) {
        EXPECT_EQ(a.chunks[c].tensor_index, b.chunks[c].tensor_index);
        EXPECT_EQ(a.chunks[c].word_begin, b.chunks[c].word_begin);
        EXPECT_EQ(a.chunks[c].checksum, b.chunks[c].checksum);
      }
      Result<OwnedCheckpoint> applied = ApplyToCopy(base.view(), *streamed);
      ASSERT_TRUE(applied.ok()) << applied.status().ToString();
      EXPECT_TRUE(SameBytes(*applied, target));
    }
  }
}

TEST(StreamedContainerTest, KeyframeRoundTrips) {
  const OwnedCheckpoint target = RandomCheckpoint(MixedSpecs(), 3);
  VectorSink sink;
  ASSERT_TRUE(EncodeKeyframeStreamed(target.view(), Options(2), sink).ok());
  Result<DeltaView> view = DeltaView::Parse(sink.bytes_);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  EXPECT_TRUE(view->manifest().keyframe);
  Result<OwnedCheckpoint> decoded = DecodeKeyframe(*view, 2);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_TRUE(SameBytes(*decoded, target));
}

// A reader fed the container a slice at a time sees every chunk record once its bytes are
// in, decodes them ahead against the base, and the apply uses exactly those.
TEST(StreamedContainerTest, ReaderDecodesChunksWhileTheContainerArrives) {
  const OwnedCheckpoint base = RandomCheckpoint(ChunkySpecs(), 21);
  const OwnedCheckpoint target = Mutate(base, 0.03, 22, Change::kArbitrary);
  VectorSink sink;
  ASSERT_TRUE(EncodeStreamed(base.view(), target.view(), Options(2), sink).ok());
  const std::vector<std::byte>& bytes = sink.bytes_;

  StreamReader reader;
  std::unique_ptr<PreparedChunks> prepared;
  size_t seen = 0, decoded_before_end = 0, verified = 0, verified_tensors = 0;
  for (size_t step = 0;; ++step) {
    const size_t have = std::min(bytes.size(), step * 4099);
    const std::span<const std::byte> prefix(bytes.data(), have);
    ASSERT_TRUE(reader.Advance(prefix).ok());
    if (!reader.has_prologue()) continue;
    if (!prepared) prepared = std::make_unique<PreparedChunks>(reader.max_chunks(), 1ull << 30);
    const Manifest& m = reader.manifest();
    for (; seen < m.chunks.size(); ++seen) {
      const ChunkEntry& e = m.chunks[seen];
      ASSERT_LE(e.payload_offset + e.payload_bytes, prefix.size()) << "a record used before its payload is in";
      DeltaView chunk = reader.ChunkView(seen, prefix);
      const OwnedTensor& tensor = base.tensors[e.tensor_index];
      if (e.kind == ChunkKind::kSparse) {
        EXPECT_TRUE(prepared->Prepare(chunk, 0, tensor.data));
        if (!reader.ended()) ++decoded_before_end;
      }
    }
    // Each tensor whose record is in is verified on a copy of the base.
    for (; verified < reader.finished_tensors().size(); ++verified) {
      const uint32_t t = reader.finished_tensors()[verified];
      std::vector<uint32_t> records;
      bool all_sparse = true;
      for (const ChunkEntry& e : m.chunks) {
        if (e.tensor_index != t) continue;
        records.push_back(e.record);
        all_sparse = all_sparse && e.kind == ChunkKind::kSparse;
      }
      if (records.empty() || !all_sparse) continue;
      EXPECT_TRUE(prepared->VerifyTensor(t, records, DTypeWordBytes(m.tensors[t].dtype),
                                         base.tensors[t].data, m.tensors[t].target_hash))
          << m.tensors[t].name;
      ++verified_tensors;
    }
    if (have == bytes.size()) break;
  }
  EXPECT_TRUE(reader.ended());
  EXPECT_EQ(reader.finished_tensors().size(), base.tensors.size());
  EXPECT_GT(verified_tensors, 0u);
  EXPECT_EQ(seen, reader.manifest().chunks.size());
  EXPECT_GT(decoded_before_end, 4u);

  Result<DeltaView> whole = DeltaView::Parse(bytes);
  ASSERT_TRUE(whole.ok());
  OwnedCheckpoint state = base;
  MutableCheckpointView view = state.mutable_view();
  ApplyOptions apply;
  apply.prepared = prepared.get();
  Result<ApplyStats> stats = ApplyInPlace(view, *whole, apply);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_TRUE(SameBytes(state, target));
  // Every chunk decoded ahead was used by the apply, none decoded twice.
  EXPECT_EQ(prepared->used(), prepared->prepared());
  EXPECT_GE(prepared->used(), decoded_before_end);
  // The tensors verified ahead were not hashed again.
  EXPECT_EQ(stats->tensors_verified_ahead, verified_tensors);
}

// A tensor "verified" against other bytes than the base the apply patches is never
// trusted: the hash it got is not the delta's target hash, so the apply rehashes it, and
// chunks prepared from the wrong base make the apply fail and restore the state.
TEST(StreamedContainerTest, VerificationAgainstOtherBytesIsNotTrusted) {
  const OwnedCheckpoint base = RandomCheckpoint(ChunkySpecs(), 71);
  const OwnedCheckpoint other = Mutate(base, 0.01, 72, Change::kArbitrary);
  const OwnedCheckpoint target = Mutate(base, 0.03, 73, Change::kArbitrary);
  VectorSink sink;
  ASSERT_TRUE(EncodeStreamed(base.view(), target.view(), Options(1), sink).ok());
  Result<DeltaView> whole = DeltaView::Parse(sink.bytes_);
  ASSERT_TRUE(whole.ok());
  const Manifest& m = whole->manifest();
  PreparedChunks prepared(m.chunks.size() + 8, 1ull << 30);
  for (size_t c = 0; c < m.chunks.size(); ++c) {
    prepared.Prepare(*whole, c, other.tensors[m.chunks[c].tensor_index].data);
  }
  size_t attempted = 0;
  for (uint32_t t = 0; t < m.tensors.size(); ++t) {
    std::vector<uint32_t> records;
    for (uint32_t c = m.tensors[t].first_chunk; c < m.tensors[t].first_chunk + m.tensors[t].chunk_count; ++c) {
      records.push_back(m.chunks[c].record);
    }
    if (records.empty()) continue;
    ++attempted;
    EXPECT_FALSE(prepared.VerifyTensor(t, records, DTypeWordBytes(m.tensors[t].dtype),
                                       other.tensors[t].data, m.tensors[t].target_hash))
        << "a tensor built on other bytes verified: " << m.tensors[t].name;
    Hash128 ignored;
    EXPECT_FALSE(prepared.VerifiedHash(t, &ignored));
  }
  EXPECT_GT(attempted, 0u);
  OwnedCheckpoint state = base;
  MutableCheckpointView view = state.mutable_view();
  ApplyOptions apply;
  apply.prepared = &prepared;
  Result<ApplyStats> stats = ApplyInPlace(view, *whole, apply);
  EXPECT_FALSE(stats.ok());
  EXPECT_TRUE(SameBytes(state, base)) << "a refused apply left changes";
}

TEST(StreamedContainerTest, EveryTensorHasItsRecordAfterItsChunks) {
  const OwnedCheckpoint base = RandomCheckpoint(MixedSpecs(), 74);
  const OwnedCheckpoint target = Mutate(base, 0.05, 75, Change::kSmallSteps);
  for (int threads : {1, 4}) {
    VectorSink sink;
    ASSERT_TRUE(EncodeStreamed(base.view(), target.view(), Options(threads), sink).ok());
    StreamReader reader;
    ASSERT_TRUE(reader.Advance(sink.bytes_).ok());
    ASSERT_TRUE(reader.ended());
    std::vector<uint32_t> order = reader.finished_tensors();
    std::sort(order.begin(), order.end());
    ASSERT_EQ(order.size(), base.tensors.size());
    for (uint32_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], i);
  }
}

TEST(StreamedContainerTest, EveryTruncationAndTrailingByteIsRefused) {
  const OwnedCheckpoint base = RandomCheckpoint(MixedSpecs(), 31);
  const OwnedCheckpoint target = Mutate(base, 0.1, 32, Change::kSmallSteps);
  VectorSink sink;
  ASSERT_TRUE(EncodeStreamed(base.view(), target.view(), Options(1), sink).ok());
  const std::vector<std::byte>& bytes = sink.bytes_;
  for (size_t size = 0; size < bytes.size(); size += 1 + size / 16) {
    std::vector<std::byte> cut(bytes.begin(), bytes.begin() + size);
    Result<DeltaView> view = DeltaView::Parse(cut);
    EXPECT_FALSE(view.ok()) << "a container cut to " << size << " of " << bytes.size()
                            << " bytes parsed";
  }
  std::vector<std::byte> padded = bytes;
  padded.push_back(std::byte{0});
  Result<DeltaView> view = DeltaView::Parse(padded);
  ASSERT_FALSE(view.ok());
  EXPECT_NE(view.status().message().find("after its end record"), std::string::npos)
      << view.status().ToString();
}

// A flipped byte anywhere is caught: in a header, prologue or record by the parser, in a
// payload by the apply; the state is left as it was.
TEST(StreamedContainerTest, FlippedBytesAreCaughtAndNothingIsApplied) {
  const OwnedCheckpoint base = RandomCheckpoint(ChunkySpecs(), 41);
  const OwnedCheckpoint target = Mutate(base, 0.02, 42, Change::kArbitrary);
  VectorSink sink;
  ASSERT_TRUE(EncodeStreamed(base.view(), target.view(), Options(2), sink).ok());
  const std::vector<std::byte>& bytes = sink.bytes_;
  int refused_by_parse = 0, refused_by_apply = 0;
  for (size_t at = 0; at < bytes.size(); at += 1 + bytes.size() / 300) {
    std::vector<std::byte> bad = bytes;
    bad[at] ^= std::byte{0x20};
    Result<DeltaView> view = DeltaView::Parse(bad);
    if (!view.ok()) {
      ++refused_by_parse;
      continue;
    }
    OwnedCheckpoint state = base;
    MutableCheckpointView mutable_state = state.mutable_view();
    Result<ApplyStats> stats = ApplyInPlace(mutable_state, *view);
    EXPECT_FALSE(stats.ok()) << "a flip at byte " << at << " went through";
    EXPECT_TRUE(SameBytes(state, base)) << "a failed apply left changes (byte " << at << ")";
    ++refused_by_apply;
  }
  EXPECT_GT(refused_by_parse, 0);
  EXPECT_GT(refused_by_apply, 0);
}

TEST(StreamedContainerTest, ASinkErrorStopsTheEncode) {
  const OwnedCheckpoint base = RandomCheckpoint(ChunkySpecs(), 51);
  const OwnedCheckpoint target = Mutate(base, 0.02, 52, Change::kArbitrary);
  for (int fail_after : {0, 1, 2, 5}) {
    VectorSink sink;
    sink.fail_after_writes = fail_after;
    Status status = EncodeStreamed(base.view(), target.view(), Options(2), sink);
    ASSERT_FALSE(status.ok()) << "fail after " << fail_after;
    EXPECT_NE(status.message().find("disk full"), std::string::npos) << status.ToString();
  }
}

TEST(StreamedContainerTest, ReaderRefusesARecordOverItsBoundOrAnUnknownTag) {
  const OwnedCheckpoint base = RandomCheckpoint(ChunkySpecs(), 61);
  const OwnedCheckpoint target = Mutate(base, 0.02, 62, Change::kArbitrary);
  VectorSink sink;
  ASSERT_TRUE(EncodeStreamed(base.view(), target.view(), Options(1), sink).ok());
  StreamReader reader;
  ASSERT_TRUE(reader.Advance(sink.bytes_).ok());
  ASSERT_TRUE(reader.ended());
  // The first record's tag comes right after the prologue (its size: header bytes 16..23).
  uint64_t prologue_bytes = 0;
  std::memcpy(&prologue_bytes, sink.bytes_.data() + 16, 8);
  const uint64_t prologue_end = format::kStreamedHeaderBytes + prologue_bytes;
  ASSERT_EQ(static_cast<uint8_t>(sink.bytes_[prologue_end]), format::kTagChunk);
  std::vector<std::byte> bad = sink.bytes_;
  bad[prologue_end] = std::byte{7};
  StreamReader strict;
  Status status = strict.Advance(bad);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("unknown record tag 7"), std::string::npos) << status.ToString();
  EXPECT_FALSE(strict.Advance(bad).ok()) << "a failed reader must stay failed";
}

}  // namespace
}  // namespace flywheel::delta
