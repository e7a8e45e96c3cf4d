// kernels::Unshuffle (AVX2 where the CPU has it) against UnshuffleScalar, bit for bit, on
// random inputs of awkward sizes, every element size and unaligned pointers; the
// reference against ground truth (the inverse of a byte-plane shuffle done here).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/kernels.h"

namespace flywheel::kernels {
namespace {

constexpr size_t kElemSizes[] = {1, 2, 3, 4, 8};
constexpr size_t kCounts[] = {0, 1, 31, 32, 33, 63, 64, 65, 4095, (1u << 20) + 7};
constexpr unsigned char kGuard = 0xA5;

std::vector<unsigned char> RandomBytes(size_t size, uint64_t seed) {
  std::vector<unsigned char> out(size);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < size; i += 8) {
    const uint64_t word = rng();
    std::memcpy(&out[i], &word, std::min<size_t>(8, size - i));
  }
  return out;
}

// Unshuffles the n*w bytes at src+offset into a buffer whose bytes before `offset` and
// after the output are guards; checks the guards and returns the output.
std::vector<unsigned char> RunUnshuffle(bool vectorised, const std::vector<unsigned char>& planes,
                               size_t n, size_t w, size_t offset) {
  std::vector<unsigned char> src(offset + planes.size());
  std::memcpy(src.data() + offset, planes.data(), planes.size());
  std::vector<unsigned char> dst(offset + n * w + 64, kGuard);
  if (vectorised) {
    Unshuffle(src.data() + offset, n, w, dst.data() + offset);
  } else {
    UnshuffleScalar(src.data() + offset, n, w, dst.data() + offset);
  }
  for (size_t i = 0; i < offset; ++i) EXPECT_EQ(dst[i], kGuard) << "wrote before dst at " << i;
  for (size_t i = offset + n * w; i < dst.size(); ++i) {
    EXPECT_EQ(dst[i], kGuard) << "wrote past dst at " << i;
  }
  return {dst.begin() + offset, dst.begin() + offset + n * w};
}

TEST(UnshuffleTest, ReferenceInvertsAByteplaneShuffle) {
  for (size_t w : kElemSizes) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{33}, size_t{4095}}) {
      const std::vector<unsigned char> words = RandomBytes(n * w, 7 * n + w);
      std::vector<unsigned char> planes(n * w);
      for (size_t b = 0; b < w; ++b) {
        for (size_t i = 0; i < n; ++i) planes[b * n + i] = words[i * w + b];
      }
      EXPECT_EQ(RunUnshuffle(false, planes, n, w, 0), words) << "w=" << w << " n=" << n;
    }
  }
}

TEST(UnshuffleTest, VectorisedMatchesReferenceBitForBit) {
  if (!HaveAvx2()) GTEST_SKIP() << "no AVX2: Unshuffle runs the reference";
  uint64_t seed = 1;
  for (size_t w : kElemSizes) {
    for (size_t n : kCounts) {
      for (size_t offset : {size_t{0}, size_t{1}}) {
        const std::vector<unsigned char> planes = RandomBytes(n * w, seed++);
        const std::vector<unsigned char> want = RunUnshuffle(false, planes, n, w, offset);
        const std::vector<unsigned char> got = RunUnshuffle(true, planes, n, w, offset);
        ASSERT_EQ(got.size(), want.size());
        ASSERT_TRUE(got == want) << "w=" << w << " n=" << n << " offset=" << offset;
      }
    }
  }
}

// Byte values that are easy to mistake for one another (equal planes, all ones, zeros):
// a lane mix-up shows as a wrong element index in the first mismatch.
TEST(UnshuffleTest, ElementIndexPatternsLandInPlace) {
  for (size_t w : {size_t{2}, size_t{4}, size_t{8}}) {
    const size_t n = 97;
    std::vector<unsigned char> planes(n * w);
    for (size_t b = 0; b < w; ++b) {
      for (size_t i = 0; i < n; ++i) planes[b * n + i] = static_cast<unsigned char>(i + 100 * b);
    }
    const std::vector<unsigned char> got = RunUnshuffle(true, planes, n, w, 0);
    for (size_t i = 0; i < n; ++i) {
      for (size_t b = 0; b < w; ++b) {
        ASSERT_EQ(got[i * w + b], static_cast<unsigned char>(i + 100 * b))
            << "w=" << w << " element " << i << " byte " << b;
      }
    }
  }
}

}  // namespace
}  // namespace flywheel::kernels
