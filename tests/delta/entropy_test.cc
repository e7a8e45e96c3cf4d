#include "delta/entropy.h"

#include <gtest/gtest.h>

#include <random>

namespace flywheel::delta::entropy {
namespace {

std::vector<uint32_t> GapsFromPositions(const std::vector<uint32_t>& positions) {
  std::vector<uint32_t> gaps;
  uint32_t next = 0;
  for (uint32_t p : positions) gaps.push_back(p - next), next = p + 1;
  return gaps;
}

TEST(EntropyTest, RiceRoundTripUniformPositions) {
  std::mt19937_64 rng(1);
  for (double density : {0.0001, 0.02, 0.3, 1.0}) {
    const uint32_t n = 200'003;
    std::vector<uint32_t> positions;
    std::bernoulli_distribution pick(density);
    for (uint32_t i = 0; i < n; ++i)
      if (pick(rng)) positions.push_back(i);
    auto gaps = GapsFromPositions(positions);
    int k = ChooseRiceK(gaps);
    std::vector<uint8_t> bytes;
    RiceEncode(gaps, k, &bytes);
    EXPECT_EQ(bytes.size(), (RiceCost(gaps, k) + 7) / 8);
    std::vector<uint32_t> decoded(positions.size());
    ASSERT_TRUE(RiceDecodePositions(bytes, k, positions.size(), n, decoded.data()).ok());
    EXPECT_EQ(decoded, positions) << "density " << density;
    if (density == 0.02) {
      // Geometric gaps at p = 0.02: entropy 7.07 bits; Rice is within a few percent.
      double bits = 8.0 * bytes.size() / positions.size();
      EXPECT_LT(bits, 7.3);
    }
  }
}

TEST(EntropyTest, RiceRoundTripEveryParameter) {
  // Every k, with gap sizes around 2^k and occasional escapes, so the register-window
  // fast path, its hand-over to the careful path and the tail all run.
  std::mt19937_64 rng(3);
  for (int k = 0; k <= kMaxRiceK; ++k) {
    std::vector<uint32_t> positions;
    uint64_t p = 0;
    for (int i = 0; i < 3000 && p < 0xffff0000u; ++i) {
      uint64_t gap = (rng() % 50 == 0) ? rng() % (uint64_t{1} << std::min(k + 8, 31))
                                       : rng() % (uint64_t{2} << k);
      p += gap;
      if (p >= 0xffff0000u) break;
      positions.push_back(static_cast<uint32_t>(p));
      ++p;
    }
    auto gaps = GapsFromPositions(positions);
    std::vector<uint8_t> bytes;
    RiceEncode(gaps, k, &bytes);
    std::vector<uint32_t> decoded(positions.size());
    ASSERT_TRUE(RiceDecodePositions(bytes, k, positions.size(), 0xffffffffull, decoded.data()).ok())
        << "k=" << k;
    ASSERT_EQ(decoded, positions) << "k=" << k;
    // One byte short is always detected.
    std::span<const uint8_t> cut(bytes.data(), bytes.size() - 1);
    EXPECT_FALSE(RiceDecodePositions(cut, k, positions.size(), 0xffffffffull, decoded.data()).ok())
        << "k=" << k;
  }
}

TEST(EntropyTest, RiceEscapesHugeGaps) {
  // Many tiny gaps make k small; one gap of 2^31 must still be coded compactly.
  std::vector<uint32_t> positions;
  for (uint32_t i = 0; i < 1000; ++i) positions.push_back(i * 2);
  positions.push_back(0x80000000u + 5);
  positions.push_back(0xfffffffeu);
  auto gaps = GapsFromPositions(positions);
  int k = ChooseRiceK(gaps);
  std::vector<uint8_t> bytes;
  RiceEncode(gaps, k, &bytes);
  EXPECT_LT(bytes.size(), 400u);
  std::vector<uint32_t> decoded(positions.size());
  ASSERT_TRUE(RiceDecodePositions(bytes, k, positions.size(), 0xffffffffull, decoded.data()).ok());
  EXPECT_EQ(decoded, positions);
}

TEST(EntropyTest, RiceRejectsPositionPastLimit) {
  std::vector<uint32_t> gaps = {5, 10};
  std::vector<uint8_t> bytes;
  RiceEncode(gaps, 2, &bytes);
  std::vector<uint32_t> decoded(2);
  Status st = RiceDecodePositions(bytes, 2, 2, 16, decoded.data());
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find("past the chunk"), std::string::npos);
}

TEST(EntropyTest, RiceRejectsTruncatedAndZeroRuns) {
  std::vector<uint32_t> gaps(100, 37);
  std::vector<uint8_t> bytes;
  RiceEncode(gaps, 5, &bytes);
  std::vector<uint32_t> decoded(100);
  std::span<const uint8_t> cut(bytes.data(), bytes.size() / 2);
  EXPECT_EQ(RiceDecodePositions(cut, 5, 100, 1 << 20, decoded.data()).code(),
            StatusCode::kCorruption);
  std::vector<uint8_t> zeros(64, 0);
  EXPECT_EQ(RiceDecodePositions(zeros, 5, 3, 1 << 20, decoded.data()).code(),
            StatusCode::kCorruption);
}

TEST(EntropyTest, ValueSymbolsCoverAllWidths) {
  EXPECT_EQ(ValueSymbol(1), 0);
  EXPECT_EQ(ValueSymbol(16), 15);
  EXPECT_EQ(ValueSymbol(17), 16);
  EXPECT_EQ(ValueSymbol(~uint64_t{0}), kNumValueSymbols - 1);
  EXPECT_EQ(UnZigZag(ZigZag(-1)), -1);
  EXPECT_EQ(UnZigZag(ZigZag(INT64_MIN)), INT64_MIN);
  EXPECT_EQ(UnZigZag(ZigZag(INT64_MAX)), INT64_MAX);
}

std::vector<uint64_t> SampleValues(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> z;
  std::discrete_distribution<int> kind({60, 30, 8, 2});
  for (size_t i = 0; i < count; ++i) {
    switch (kind(rng)) {
      case 0:
        z.push_back(1 + (rng() & 1));
        break;  // +-1 ulp
      case 1:
        z.push_back(3 + (rng() & 1));
        break;  // +-2 ulp
      case 2:
        z.push_back(5 + rng() % 60);
        break;  // a few ulp
      default:
        z.push_back((rng() | 1) >> (rng() % 64));
        break;  // anything, incl. 64-bit
    }
    if (z.back() == 0) z.back() = 1;
  }
  return z;
}

TEST(EntropyTest, RansRoundTrip) {
  for (size_t count : {1, 2, 17, 1000, 100'000}) {
    auto z = SampleValues(count, count);
    std::vector<uint8_t> bytes;
    EncodeValues(z, &bytes);
    std::vector<uint64_t> decoded(count);
    ASSERT_TRUE(DecodeValues(bytes, count, decoded.data()).ok()) << count;
    EXPECT_EQ(decoded, z);
  }
}

TEST(EntropyTest, RansSingleSymbol) {
  std::vector<uint64_t> z(5000, 2);
  std::vector<uint8_t> bytes;
  EncodeValues(z, &bytes);
  EXPECT_LT(bytes.size(), 16u);
  std::vector<uint64_t> decoded(z.size());
  ASSERT_TRUE(DecodeValues(bytes, z.size(), decoded.data()).ok());
  EXPECT_EQ(decoded, z);
}

TEST(EntropyTest, RansNearEntropyForUlpSteps) {
  // +-1 ulp at 45% each, +-2 at 5% each: entropy ~1.47 bits.
  std::mt19937_64 rng(7);
  std::discrete_distribution<int> d({45, 45, 5, 5});
  std::vector<uint64_t> z(200'000);
  for (auto& v : z) v = 1 + d(rng);
  std::vector<uint8_t> bytes;
  EncodeValues(z, &bytes);
  double bits = 8.0 * bytes.size() / z.size();
  EXPECT_LT(bits, 1.50);
}

TEST(EntropyTest, GammaRoundTrip) {
  auto z = SampleValues(5000, 3);
  z.push_back(~uint64_t{0});
  z.push_back(uint64_t{1} << 32);
  z.push_back((uint64_t{1} << 33) - 1);
  std::vector<uint8_t> bytes;
  EncodeValuesGamma(z, &bytes);
  std::vector<uint64_t> decoded(z.size());
  ASSERT_TRUE(DecodeValuesGamma(bytes, z.size(), decoded.data()).ok());
  EXPECT_EQ(decoded, z);
}

TEST(EntropyTest, TrailingBytesAreRejected) {
  std::vector<uint32_t> gaps = {3, 1, 40};
  std::vector<uint8_t> index;
  RiceEncode(gaps, 2, &index);
  std::vector<uint32_t> positions(3);
  ASSERT_TRUE(RiceDecodePositions(index, 2, 3, 1000, positions.data()).ok());
  index.push_back(0);
  EXPECT_EQ(RiceDecodePositions(index, 2, 3, 1000, positions.data()).code(),
            StatusCode::kCorruption);

  std::vector<uint64_t> z = {1, 2, 3, 1000};
  std::vector<uint8_t> gamma;
  EncodeValuesGamma(z, &gamma);
  gamma.push_back(0x55);
  std::vector<uint64_t> decoded(z.size());
  EXPECT_EQ(DecodeValuesGamma(gamma, z.size(), decoded.data()).code(), StatusCode::kCorruption);

  std::vector<uint64_t> small = {1, 2, 2, 1};  // no value needs extra bits
  std::vector<uint8_t> rans;
  EncodeValues(small, &rans);
  ASSERT_TRUE(DecodeValues(rans, small.size(), decoded.data()).ok());
  rans.push_back(0);
  EXPECT_EQ(DecodeValues(rans, small.size(), decoded.data()).code(), StatusCode::kCorruption);
}

TEST(EntropyTest, RansRejectsMalformedTables) {
  auto z = SampleValues(1000, 5);
  std::vector<uint8_t> bytes;
  EncodeValues(z, &bytes);
  std::vector<uint64_t> decoded(z.size());
  auto bad = bytes;
  bad[0] = 0;  // zero symbols
  EXPECT_EQ(DecodeValues(bad, z.size(), decoded.data()).code(), StatusCode::kCorruption);
  bad = bytes;
  bad[0] = 200;  // more symbols than exist
  EXPECT_EQ(DecodeValues(bad, z.size(), decoded.data()).code(), StatusCode::kCorruption);
  bad = bytes;
  bad[2] ^= 0x01;  // a frequency off by one: sum != 4096
  EXPECT_EQ(DecodeValues(bad, z.size(), decoded.data()).code(), StatusCode::kCorruption);
  for (size_t cut = 0; cut < bytes.size(); cut += 7) {
    std::span<const uint8_t> part(bytes.data(), cut);
    EXPECT_FALSE(DecodeValues(part, z.size(), decoded.data()).ok()) << cut;
  }
}

}  // namespace
}  // namespace flywheel::delta::entropy
