// The vectorised CPU kernels against their scalar references, bit for bit, on awkward
// sizes, densities, unaligned pointers and special float bit patterns; the references
// against ground truth known from how the inputs were made; ChunkChecksums against
// libxxhash's XXH3_64bits.
#include "kernels/kernels.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace flywheel::kernels {
namespace {

constexpr size_t kElemSizes[] = {1, 2, 4, 8};
constexpr size_t kSizes[] = {0, 1, 3, 7, 31, 32, 33, 733, 1002, (1u << 20) + 13};
constexpr double kDensities[] = {0.0, 0.02, 0.5, 1.0};

// Two arrays of n elements that differ in exactly the elements listed in `changed`,
// each starting `offset` bytes into its own allocation (offset 1: unaligned).
struct Pair {
  std::vector<unsigned char> base_storage;
  std::vector<unsigned char> target_storage;
  size_t offset = 0;
  size_t n = 0;
  size_t elem_size = 0;
  std::vector<uint32_t> changed;

  unsigned char* base() { return base_storage.data() + offset; }
  unsigned char* target() { return target_storage.data() + offset; }
};

Pair MakePair(size_t n, size_t elem_size, double density, size_t offset, uint64_t seed) {
  Pair p;
  p.offset = offset;
  p.n = n;
  p.elem_size = elem_size;
  p.base_storage.resize(n * elem_size + offset + 1);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < p.base_storage.size(); i += 8) {
    const uint64_t word = rng();
    std::memcpy(&p.base_storage[i], &word, std::min<size_t>(8, p.base_storage.size() - i));
  }
  p.target_storage = p.base_storage;
  // draw < threshold has probability `density`; 1.0 must pick every element.
  const auto threshold = static_cast<uint64_t>(density * 0x1p64);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t draw = rng();
    if (density < 1.0 && draw >= threshold) continue;
    // One flipped bit in one byte: the smallest possible difference.
    const size_t byte = (draw >> 8) % elem_size;
    p.target()[i * elem_size + byte] ^= static_cast<unsigned char>(1u << ((draw >> 4) % 8));
    p.changed.push_back(static_cast<uint32_t>(i));
  }
  return p;
}

std::vector<uint32_t> RunCompact(bool vectorised, const void* a, const void* b, size_t n,
                                 size_t elem_size) {
  std::vector<uint32_t> out(n);
  const size_t count = vectorised ? CompareCompact(a, b, n, elem_size, out.data())
                                  : CompareCompactScalar(a, b, n, elem_size, out.data());
  out.resize(count);
  return out;
}

TEST(KernelsTest, ReportsDispatch) {
  RecordProperty("avx2", HaveAvx2() ? "yes" : "no");
  if (!HaveAvx2()) GTEST_SKIP() << "no AVX2: the vectorised entry points run the references";
}

// Runs `check(pair, n, elem_size)` on a pair for every element size, length, density and
// alignment offset (seeds from `seed` on), stopping at the first fatal failure.
template <class Check>
void ForEachPair(uint64_t seed, const Check& check) {
  for (size_t elem_size : kElemSizes) {
    for (size_t n : kSizes) {
      for (double density : kDensities) {
        for (size_t offset : {0, 1}) {
          SCOPED_TRACE(testing::Message() << "elem_size " << elem_size << " n " << n << " density "
                                          << density << " offset " << offset);
          Pair p = MakePair(n, elem_size, density, offset, seed++);
          check(p, n, elem_size);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(KernelsTest, CompareCompactMatchesScalar) {
  ForEachPair(1, [](Pair& p, size_t n, size_t elem_size) {
    ASSERT_EQ(RunCompact(false, p.base(), p.target(), n, elem_size), p.changed);
    ASSERT_EQ(RunCompact(true, p.base(), p.target(), n, elem_size), p.changed);
  });
}

TEST(KernelsTest, CountChangedMatchesScalar) {
  ForEachPair(1000, [](Pair& p, size_t n, size_t elem_size) {
    ASSERT_EQ(CountChangedScalar(p.base(), p.target(), n, elem_size), p.changed.size());
    ASSERT_EQ(CountChanged(p.base(), p.target(), n, elem_size), p.changed.size());
  });
}

// Every single position, alone, of three 64-element blocks, one 32-byte tail vector and
// a scalar tail: each bit of each block mask, for every element size.
TEST(KernelsTest, EverySinglePositionIsFound) {
  for (size_t elem_size : kElemSizes) {
    const size_t n = 3 * 64 + 32 / elem_size + 3;
    Pair p = MakePair(n, elem_size, 0.0, 1, 7);
    for (size_t i = 0; i < n; ++i) {
      SCOPED_TRACE(testing::Message() << "elem_size " << elem_size << " position " << i);
      unsigned char* byte = p.target() + i * elem_size + elem_size - 1;
      *byte ^= 0x80;
      const std::vector<uint32_t> want = {static_cast<uint32_t>(i)};
      ASSERT_EQ(RunCompact(false, p.base(), p.target(), n, elem_size), want);
      ASSERT_EQ(RunCompact(true, p.base(), p.target(), n, elem_size), want);
      ASSERT_EQ(CountChanged(p.base(), p.target(), n, elem_size), 1u);
      *byte ^= 0x80;
    }
  }
}

TEST(KernelsTest, SingleChangeInLastElement) {
  for (size_t elem_size : kElemSizes) {
    for (size_t n : kSizes) {
      if (n == 0) continue;
      SCOPED_TRACE(testing::Message() << "elem_size " << elem_size << " n " << n);
      Pair p = MakePair(n, elem_size, 0.0, 0, n);
      p.target()[n * elem_size - 1] ^= 1;
      const std::vector<uint32_t> want = {static_cast<uint32_t>(n - 1)};
      ASSERT_EQ(RunCompact(false, p.base(), p.target(), n, elem_size), want);
      ASSERT_EQ(RunCompact(true, p.base(), p.target(), n, elem_size), want);
      ASSERT_EQ(CountChanged(p.base(), p.target(), n, elem_size), 1u);
    }
  }
}

// Values are bit patterns: -0.0 vs +0.0 and NaNs with other payloads are changes; a NaN
// with identical bits is not (as a float comparison it would be "unequal").
template <typename Word>
void ExpectBitPatternSemantics(const std::vector<Word>& base, const std::vector<Word>& target,
                               const std::vector<uint32_t>& want) {
  ASSERT_EQ(base.size(), target.size());
  // Repeat the pattern so that the vector loop, not only the tail, sees it.
  std::vector<Word> a, b;
  std::vector<uint32_t> expected;
  for (size_t rep = 0; rep < 40; ++rep) {
    for (uint32_t w : want) expected.push_back(static_cast<uint32_t>(a.size() + w));
    a.insert(a.end(), base.begin(), base.end());
    b.insert(b.end(), target.begin(), target.end());
  }
  EXPECT_EQ(RunCompact(false, a.data(), b.data(), a.size(), sizeof(Word)), expected);
  EXPECT_EQ(RunCompact(true, a.data(), b.data(), a.size(), sizeof(Word)), expected);
  EXPECT_EQ(CountChanged(a.data(), b.data(), a.size(), sizeof(Word)), expected.size());
}

TEST(KernelsTest, SignedZerosAndNaNPayloadsAreChanges) {
  // bf16: +0, -0, quiet NaN, NaN other payload, same NaN, 1.0, subnormal.
  ExpectBitPatternSemantics<uint16_t>({0x0000, 0x0000, 0x7FC0, 0x7FC0, 0x7FC1, 0x3F80, 0x0001},
                                      {0x8000, 0x0000, 0x7FC1, 0xFFC0, 0x7FC1, 0x3F80, 0x0002},
                                      {0, 2, 3, 6});
  // float32 and float64, same cases.
  ExpectBitPatternSemantics<uint32_t>(
      {0x00000000, 0x7FC00000, 0x7FC00000, 0x7FC00001, 0x3F800000, 0x00000001},
      {0x80000000, 0x7FC00001, 0xFFC00000, 0x7FC00001, 0x3F800000, 0x00000001}, {0, 1, 2});
  ExpectBitPatternSemantics<uint64_t>(
      {0x0000000000000000, 0x7FF8000000000000, 0x7FF8000000000001, 0x3FF0000000000000},
      {0x8000000000000000, 0x7FF8000000000001, 0x7FF8000000000001, 0x3FF0000000000000}, {0, 1});
  // fp8 words: 0x00 vs 0x80 (-0 in e4m3/e5m2), NaN payloads.
  ExpectBitPatternSemantics<uint8_t>({0x00, 0x7F, 0x7F, 0x7E}, {0x80, 0xFF, 0x7F, 0x7E}, {0, 1});
}

TEST(KernelsTest, GatherScatterRoundTrip) {
  uint64_t seed = 5000;
  for (size_t elem_size : kElemSizes) {
    for (size_t n : kSizes) {
      for (double density : kDensities) {
        SCOPED_TRACE(testing::Message()
                     << "elem_size " << elem_size << " n " << n << " density " << density);
        Pair p = MakePair(n, elem_size, density, 1, seed++);
        const size_t count = p.changed.size();
        const size_t bytes = n * elem_size;
        // Gather the new values (unaligned output), both ways.
        std::vector<unsigned char> values_scalar(count * elem_size + 1);
        std::vector<unsigned char> values(count * elem_size + 1);
        GatherScalar(p.target(), elem_size, p.changed.data(), values_scalar.data() + 1, count);
        Gather(p.target(), elem_size, p.changed.data(), values.data() + 1, count);
        ASSERT_EQ(values, values_scalar);
        // Scatter them onto copies of base: both must equal target.
        std::vector<unsigned char> applied_scalar(p.base(), p.base() + bytes);
        std::vector<unsigned char> applied(p.base(), p.base() + bytes);
        ScatterApplyScalar(applied_scalar.data(), elem_size, p.changed.data(),
                           values_scalar.data() + 1, count);
        ScatterApply(applied.data(), elem_size, p.changed.data(), values.data() + 1, count);
        ASSERT_TRUE(std::equal(applied_scalar.begin(), applied_scalar.end(), p.target()));
        ASSERT_TRUE(std::equal(applied.begin(), applied.end(), p.target()));
        // Gathering the old values and scattering them back undoes the update.
        Gather(p.base(), elem_size, p.changed.data(), values.data(), count);
        ScatterApply(applied.data(), elem_size, p.changed.data(), values.data(), count);
        ASSERT_TRUE(std::equal(applied.begin(), applied.end(), p.base()));
      }
    }
  }
}

std::vector<uint64_t> DirectXxh3(const unsigned char* data, size_t size, size_t chunk) {
  std::vector<uint64_t> out;
  for (size_t offset = 0; offset < size; offset += chunk) {
    out.push_back(XXH3_64bits(data + offset, size - offset < chunk ? size - offset : chunk));
  }
  return out;
}

TEST(KernelsTest, ScatterAddZigZagMatchesScalar) {
  std::mt19937_64 rng(99);
  for (size_t elem_size : kElemSizes) {
    for (size_t n : kSizes) {
      if (n == 0) continue;
      std::vector<unsigned char> a(n * elem_size + 1);
      for (auto& b : a) b = static_cast<unsigned char>(rng());
      std::vector<unsigned char> b = a;
      // Every 3rd position, with diffs from +-1 to the extremes of the width.
      std::vector<uint32_t> positions;
      std::vector<uint64_t> z;
      for (size_t i = 0; i < n; i += 3) {
        positions.push_back(static_cast<uint32_t>(i));
        uint64_t v = (rng() % 4 == 0) ? rng() : 1 + rng() % 4;
        if (elem_size < 8) v &= (uint64_t{1} << (8 * elem_size)) - 1;
        z.push_back(v == 0 ? 1 : v);
      }
      const std::vector<unsigned char> before = a;
      std::vector<unsigned char> old_a(positions.size() * elem_size), old_b(old_a.size());
      ScatterAddZigZag(a.data() + 1, elem_size, positions.data(), z.data(), positions.size(),
                       old_a.data());
      ScatterAddZigZagScalar(b.data() + 1, elem_size, positions.data(), z.data(), positions.size(),
                             old_b.data());
      ASSERT_EQ(a, b) << "elem_size " << elem_size << " n " << n;
      ASSERT_EQ(old_a, old_b);
      // The old values are an exact undo record.
      ScatterApply(a.data() + 1, elem_size, positions.data(), old_a.data(), positions.size());
      ASSERT_EQ(a, before);
      std::vector<unsigned char> c = before;
      ScatterAddZigZag(c.data() + 1, elem_size, positions.data(), z.data(), positions.size());
      ASSERT_EQ(c, b);
    }
  }
}

TEST(KernelsTest, ScatterAddZigZagWrapsAround) {
  // bf16 0x0000 - 1 = 0xffff, 0xffff + 1 = 0x0000, 0x7fff + 1 = 0x8000.
  uint16_t words[3] = {0x0000, 0xffff, 0x7fff};
  const uint32_t positions[3] = {0, 1, 2};
  const uint64_t z[3] = {1, 2, 2};  // -1, +1, +1
  ScatterAddZigZagScalar(words, 2, positions, z, 3);
  EXPECT_EQ(words[0], 0xffff);
  EXPECT_EQ(words[1], 0x0000);
  EXPECT_EQ(words[2], 0x8000);
}

TEST(KernelsTest, ChunkChecksumsMatchXxh3) {
  std::vector<unsigned char> storage((3u << 20) + 64);
  std::mt19937_64 rng(99);
  for (auto& byte : storage) byte = static_cast<unsigned char>(rng());
  const unsigned char* data = storage.data() + 1;  // unaligned
  for (size_t chunk : {1u, 7u, 64u, 240u, 241u, 4096u, 1u << 20}) {
    for (size_t size :
         {size_t{0}, size_t{1}, chunk - 1, chunk, chunk + 1, 3 * chunk + 5, size_t{1000003}}) {
      if (chunk == 1 && size > 100000) continue;  // a million 1-byte hashes add nothing
      SCOPED_TRACE(testing::Message() << "chunk " << chunk << " size " << size);
      const std::vector<uint64_t> want = DirectXxh3(data, size, chunk);
      std::vector<uint64_t> scalar(want.size() + 1, 0), vectorised(want.size() + 1, 0);
      ASSERT_EQ(ChunkChecksumsScalar(data, size, chunk, scalar.data()), want.size());
      ASSERT_EQ(ChunkChecksums(data, size, chunk, vectorised.data()), want.size());
      scalar.pop_back();  // the spare slot must not have been written
      vectorised.pop_back();
      ASSERT_EQ(scalar, want);
      ASSERT_EQ(vectorised, want);
    }
  }
}

// Every length up to 2 KiB covers each XXH3 length class and the 1 KiB block boundary.
TEST(KernelsTest, ChecksumsMatchXxh3OnEveryShortLength) {
  std::vector<unsigned char> data(2049);
  std::mt19937_64 rng(3);
  for (auto& byte : data) byte = static_cast<unsigned char>(rng());
  for (size_t len = 0; len < data.size(); ++len) {
    uint64_t scalar = 0, vectorised = 0;
    ChunkChecksumsScalar(data.data(), len, len == 0 ? 1 : len, &scalar);
    ChunkChecksums(data.data(), len, len == 0 ? 1 : len, &vectorised);
    if (len == 0) continue;  // no chunks, nothing written
    ASSERT_EQ(scalar, XXH3_64bits(data.data(), len)) << "len " << len;
    ASSERT_EQ(vectorised, XXH3_64bits(data.data(), len)) << "len " << len;
  }
}

}  // namespace
}  // namespace flywheel::kernels
