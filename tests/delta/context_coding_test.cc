// The context-modelled sparse chunks (kind 3, delta/format.h): round trips bit for bit on
// bf16 and FP8 at densities from 0.1% to 60% (where most of a bucket changes, its stream
// lists the unchanged words), tiny tensors, chunk boundaries, a single bucket; the plain
// coding when it is switched off; corrupt kind-3 streams refused with a message and no
// out-of-bounds access (run under ASan/valgrind).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "delta/context_coding.h"
#include "delta/delta.h"

namespace flywheel::delta {
namespace {

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A bf16 tensor of ~N(0, scale) values and its target after an update of `step` (the
// words whose ulp is small change most, as in training). `one_exponent`: every base word
// has the same exponent (one bucket).
std::pair<OwnedTensor, OwnedTensor> Bf16Pair(const std::string& name, int64_t words, float scale,
                                             float step, uint64_t seed, bool one_exponent = false) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0, 1);
  OwnedTensor base{name, DType::kBF16, {words}, std::vector<std::byte>(words * 2)};
  OwnedTensor target = base;
  auto* b = reinterpret_cast<uint16_t*>(base.data.data());
  auto* t = reinterpret_cast<uint16_t*>(target.data.data());
  for (int64_t i = 0; i < words; ++i) {
    float w = normal(rng) * scale;
    if (one_exponent) w = std::copysign(1.0f + std::fabs(w) / (16 * scale + 1e-30f), w);
    b[i] = ToBf16(w);
    t[i] = ToBf16(FromBf16(b[i]) + step * normal(rng));
  }
  return {std::move(base), std::move(target)};
}

// An FP8 e4m3 tensor and its target: a random fraction `density` of the words moves by
// one or two codes, more often for small magnitudes.
std::pair<OwnedTensor, OwnedTensor> Fp8Pair(int64_t words, double density, uint64_t seed) {
  std::mt19937_64 rng(seed);
  OwnedTensor base{"fp8", DType::kF8_E4M3, {words}, std::vector<std::byte>(words)};
  OwnedTensor target = base;
  auto* b = reinterpret_cast<uint8_t*>(base.data.data());
  auto* t = reinterpret_cast<uint8_t*>(target.data.data());
  std::uniform_real_distribution<double> u(0, 1);
  for (int64_t i = 0; i < words; ++i) {
    uint8_t v = static_cast<uint8_t>(rng());
    if ((v & 0x7f) >= 0x7e) v &= 0xf0;  // no NaN codes, no saturation at the top
    b[i] = t[i] = v;
    const int exponent = (v >> 3) & 0xf;
    const double p = std::min(1.0, density * std::exp2(3.0 - exponent));
    if (u(rng) < p) t[i] = static_cast<uint8_t>(v + ((rng() & 1) ? 1 : -1));
  }
  return {std::move(base), std::move(target)};
}

struct Pair {
  OwnedCheckpoint base, target;
  void Add(std::pair<OwnedTensor, OwnedTensor> p) {
    base.tensors.push_back(std::move(p.first));
    target.tensors.push_back(std::move(p.second));
  }
};

enum class Kinds { kAny, kSomeContext, kNoContext };

// Encodes, checks which kinds were written, applies to a copy and compares bit for bit.
void ExpectRoundTrip(const Pair& pair, EncodeOptions options, Kinds kinds) {
  auto delta = Encode(pair.base.view(), pair.target.view(), options);
  ASSERT_TRUE(delta.ok()) << delta.status().ToString();
  auto view = DeltaView::Parse(*delta);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  bool any_context = false;
  for (const ChunkEntry& e : view->manifest().chunks)
    any_context |= e.kind == ChunkKind::kSparseContext;
  if (kinds != Kinds::kAny) EXPECT_EQ(any_context, kinds == Kinds::kSomeContext);
  auto out = ApplyToCopy(pair.base.view(), *view);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  for (size_t i = 0; i < pair.target.tensors.size(); ++i) {
    ASSERT_TRUE(out->tensors[i].data == pair.target.tensors[i].data) << "tensor " << i;
  }
}

TEST(ContextCodingTest, Bf16RoundTripsAcrossDensities) {
  // step / scale sets the density: about 0.1% .. 60% of the words change.
  for (float step : {2e-6f, 2e-5f, 2e-4f, 2e-3f, 2e-2f}) {
    SCOPED_TRACE(step);
    Pair pair;
    pair.Add(Bf16Pair("w", 300000, 0.02f, step, 1));
    EncodeOptions options;
    options.context_coding = true;
    options.chunk_bytes = 64 << 10;
    ExpectRoundTrip(pair, options, Kinds::kSomeContext);
  }
}

TEST(ContextCodingTest, Fp8RoundTripsAcrossDensities) {
  for (double density : {0.001, 0.01, 0.05, 0.2, 0.6}) {
    SCOPED_TRACE(density);
    Pair pair;
    pair.Add(Fp8Pair(1 << 20, density, 2));
    EncodeOptions options;
    options.context_coding = true;
    options.chunk_bytes = 256 << 10;
    options.compressor = Compressor::kLz4;
    // Where most words change, a dense chunk may store smaller: any kind is fine there.
    ExpectRoundTrip(pair, options, density <= 0.05 ? Kinds::kSomeContext : Kinds::kAny);
  }
}

TEST(ContextCodingTest, TinyTensorsAndChunkBoundaries) {
  Pair pair;
  int seed = 10;
  for (int64_t words : {1, 2, 3, 63, 64, 65, 2047, 2048, 2049, 4095, 4096, 4097, 8193}) {
    pair.Add(Bf16Pair("t" + std::to_string(words), words, 0.02f, 0.02f, seed++));
  }
  EncodeOptions options;
  options.context_coding = true;
  options.chunk_bytes = 4096;  // 2048 bf16 words a chunk: tensors end on and off boundaries
  ExpectRoundTrip(pair, options, Kinds::kAny);
}

TEST(ContextCodingTest, AllWordsInOneBucketAndMostOfItChanged) {
  Pair pair;
  pair.Add(Bf16Pair("one", 100000, 0.02f, 4e-3f, 3, /*one_exponent=*/true));
  EncodeOptions options;
  options.context_coding = true;
  ExpectRoundTrip(pair, options, Kinds::kSomeContext);
}

TEST(ContextCodingTest, SwitchedOffWritesOnlyTheOldKinds) {
  Pair pair;
  pair.Add(Bf16Pair("w", 100000, 0.02f, 2e-4f, 4));
  pair.Add(Fp8Pair(50000, 0.05, 5));
  EncodeOptions options;
  options.context_coding = false;
  ExpectRoundTrip(pair, options, Kinds::kNoContext);
}

TEST(ContextCodingTest, SmallerThanThePlainCodingOnTrainingLikeUpdates) {
  Pair pair;
  pair.Add(Bf16Pair("w", 1 << 20, 0.02f, 1e-4f, 6));
  EncodeOptions plain, context;
  plain.context_coding = false;
  context.context_coding = true;
  auto a = Encode(pair.base.view(), pair.target.view(), plain);
  auto b = Encode(pair.base.view(), pair.target.view(), context);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_LT(b->size(), a->size() * 9 / 10) << a->size() << " vs " << b->size();
}

TEST(ContextCodingTest, StreamedContainerCarriesContextChunks) {
  Pair pair;
  pair.Add(Bf16Pair("w", 50000, 0.02f, 2e-4f, 7));
  struct Sink : StreamSink {
    std::vector<std::byte> bytes;
    Status Begin(uint64_t) override { return Status::Ok(); }
    Status Write(std::span<const std::byte> b) override {
      bytes.insert(bytes.end(), b.begin(), b.end());
      return Status::Ok();
    }
  } sink;
  EncodeOptions options;
  options.context_coding = true;
  options.chunk_bytes = 16 << 10;
  ASSERT_TRUE(EncodeStreamed(pair.base.view(), pair.target.view(), options, sink).ok());
  auto view = DeltaView::Parse(sink.bytes);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  auto out = ApplyToCopy(pair.base.view(), *view);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_TRUE(out->tensors[0].data == pair.target.tensors[0].data);
}

// ---- corrupt kind-3 chunks -----------------------------------------------------------

// A raw kind-3 chunk of `pair`'s tensor 0 and what it decodes against.
struct RawChunk {
  std::vector<uint8_t> raw;
  std::vector<uint8_t> base;
  size_t words = 0;
  size_t changed = 0;
};

RawChunk MakeRawChunk(DType dtype) {
  Pair pair;
  if (dtype == DType::kBF16) {
    pair.Add(Bf16Pair("w", 5000, 0.02f, 2e-3f, 8));
  } else {
    pair.Add(Fp8Pair(5000, 0.3, 9));
  }
  const int w = DTypeWordBytes(dtype);
  RawChunk c;
  c.words = 5000;
  c.base.assign(reinterpret_cast<const uint8_t*>(pair.base.tensors[0].data.data()),
                reinterpret_cast<const uint8_t*>(pair.base.tensors[0].data.data()) + c.words * w);
  const uint8_t* t = reinterpret_cast<const uint8_t*>(pair.target.tensors[0].data.data());
  std::vector<uint32_t> positions;
  std::vector<uint64_t> z, base_words;
  for (size_t i = 0; i < c.words; ++i) {
    uint64_t bw = 0, tw = 0;
    std::memcpy(&bw, c.base.data() + i * w, w);
    std::memcpy(&tw, t + i * w, w);
    if (bw == tw) continue;
    positions.push_back(static_cast<uint32_t>(i));
    const int64_t d = w == 1 ? static_cast<int8_t>(tw - bw) : static_cast<int16_t>(tw - bw);
    z.push_back((static_cast<uint64_t>(d) << 1) ^ static_cast<uint64_t>(d >> 63));
    base_words.push_back(bw);
  }
  c.changed = positions.size();
  internal::Scratch s;
  internal::ByteVec raw;
  internal::EncodeSparseContext(*internal::ExponentFieldOf(dtype), c.base.data(), c.words, w,
                                positions, z, base_words, s, &raw);
  c.raw.assign(raw.begin(), raw.end());
  return c;
}

Status Decode(const RawChunk& c, const std::vector<uint8_t>& raw, DType dtype) {
  internal::Scratch s;
  return internal::DecodeSparseContext(*internal::ExponentFieldOf(dtype), raw, c.base.data(),
                                       c.words, DTypeWordBytes(dtype), c.changed, s);
}

TEST(ContextCodingCorruptionTest, IntactChunkDecodes) {
  for (DType dtype : {DType::kBF16, DType::kF8_E4M3}) {
    const RawChunk c = MakeRawChunk(dtype);
    ASSERT_GT(c.changed, 100u);
    EXPECT_TRUE(Decode(c, c.raw, dtype).ok());
  }
}

TEST(ContextCodingCorruptionTest, EveryTruncationIsRefused) {
  for (DType dtype : {DType::kBF16, DType::kF8_E4M3}) {
    const RawChunk c = MakeRawChunk(dtype);
    for (size_t len = 0; len < c.raw.size(); len += 1 + len / 64) {
      std::vector<uint8_t> cut(c.raw.begin(), c.raw.begin() + len);
      const Status st = Decode(c, cut, dtype);
      EXPECT_FALSE(st.ok()) << "truncated to " << len;
      EXPECT_FALSE(st.message().empty());
    }
  }
}

TEST(ContextCodingCorruptionTest, FlippedBitsNeverCrash) {
  // A flip may leave a valid chunk (a Rice gap that still fits its bucket, a value's extra
  // bits): the container's payload checksum catches those. Here only no crash and no
  // out-of-bounds access is required (ASan/valgrind check that), and most are refused.
  for (DType dtype : {DType::kBF16, DType::kF8_E4M3}) {
    const RawChunk c = MakeRawChunk(dtype);
    std::mt19937_64 rng(1);
    size_t refused = 0;
    for (int i = 0; i < 2000; ++i) {
      std::vector<uint8_t> bad = c.raw;
      bad[rng() % bad.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
      refused += !Decode(c, bad, dtype).ok();
    }
    EXPECT_GT(refused, 500u);
  }
}

TEST(ContextCodingCorruptionTest, HeaderFieldsAreNamed) {
  const RawChunk c = MakeRawChunk(DType::kBF16);
  std::vector<uint8_t> bad = c.raw;
  bad[1] = 17;  // stream count
  EXPECT_NE(Decode(c, bad, DType::kBF16).message().find("stream count 17"), std::string::npos);
  bad = c.raw;
  bad[2] = 16;  // first stream's bucket
  EXPECT_NE(Decode(c, bad, DType::kBF16).message().find("bucket 16"), std::string::npos);
  bad = c.raw;
  bad[3] |= 0x40;  // an unknown flag beside the Rice parameter
  EXPECT_NE(Decode(c, bad, DType::kBF16).message().find("unknown flags"), std::string::npos);
  // One change more than the streams list.
  RawChunk more = c;
  more.changed += 1;
  EXPECT_NE(Decode(more, c.raw, DType::kBF16).message().find("changes, the chunk declares"),
            std::string::npos);
  // A different base puts the words in other buckets: the ranks no longer fit.
  RawChunk other = c;
  for (size_t i = 0; i < other.base.size(); i += 2) other.base[i + 1] ^= 0x40;
  EXPECT_FALSE(Decode(other, c.raw, DType::kBF16).ok());
}

TEST(ContextCodingCorruptionTest, ContextChunkOfADtypeWithoutExponentIsRefused) {
  EXPECT_FALSE(internal::ExponentFieldOf(DType::kU8).has_value());
  EXPECT_FALSE(internal::ExponentFieldOf(DType::kF8_E8M0).has_value());
  EXPECT_TRUE(internal::ExponentFieldOf(DType::kBF16).has_value());
  EXPECT_TRUE(internal::ExponentFieldOf(DType::kF8_E4M3).has_value());
}

}  // namespace
}  // namespace flywheel::delta
