// The context-bucket walks (kernels.h: RankBucketed, SelectBucketed): the AVX2 versions
// against the scalar references bit for bit, and the pair against ground truth: ranking
// the changed words and selecting them back lists exactly the changed words, in the
// documented order (stripe, then stream, then position).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "kernels/kernels.h"

namespace flywheel::kernels {
namespace {

constexpr size_t kSizes[] = {1, 3, 63, 64, 65, 733, 4095, 4096, 4097, 10007};

struct Case {
  size_t elem_size;
  BucketContext context;
};

// bf16-like (16-bit words, 8-bit field), FP8 e4m3 (8-bit words, 4-bit field), f32.
const Case kCases[] = {
    {2, {7, 0xff, 110}},
    {1, {3, 0xf, 0}},
    {4, {23, 0xff, 115}},
    {2, {7, 0xff, 0}},  // one bucket: every field clamps to 15
};

struct Walk {
  std::vector<uint32_t> positions;  // listed changed words
  std::vector<uint8_t> stream;
  std::vector<std::vector<uint32_t>> ranks;
  std::vector<uint64_t> words_in;
};

std::vector<unsigned char> RandomBase(size_t n, size_t elem_size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> base(n * elem_size + 1);
  for (auto& b : base) b = static_cast<unsigned char>(rng());
  return base;
}

std::vector<uint32_t> RandomChanges(size_t n, double density, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution pick(density);
  std::vector<uint32_t> out;
  for (size_t i = 0; i < n; ++i)
    if (pick(rng)) out.push_back(static_cast<uint32_t>(i));
  return out;
}

// The buckets holding changes (ascending), as the encoder picks its streams.
std::vector<uint8_t> StreamBuckets(const unsigned char* base, const Case& c,
                                   const std::vector<uint32_t>& changes) {
  std::set<uint8_t> used;
  for (uint32_t p : changes) {
    uint64_t word = 0;
    std::memcpy(&word, base + p * c.elem_size, c.elem_size);
    used.insert(static_cast<uint8_t>(BucketOf(word, c.context)));
  }
  return {used.begin(), used.end()};
}

template <typename Fn>
Walk Rank(Fn rank, const unsigned char* base, size_t n, const Case& c,
          const std::vector<uint8_t>& buckets, const std::vector<uint32_t>& changes) {
  Walk w;
  w.positions.resize(changes.size());
  w.stream.resize(changes.size());
  w.ranks.assign(buckets.size(), std::vector<uint32_t>(changes.size() + 1));
  w.words_in.resize(buckets.size());
  std::vector<uint32_t*> ranks;
  for (auto& r : w.ranks) ranks.push_back(r.data());
  const size_t listed =
      rank(base, n, c.elem_size, c.context, buckets.data(), buckets.size(), changes.data(),
           changes.size(), w.positions.data(), w.stream.data(), ranks.data(), w.words_in.data());
  EXPECT_EQ(listed, changes.size());
  for (uint32_t& order : w.positions) order = changes[order];  // index -> word
  return w;
}

TEST(BucketWalkTest, FastMatchesScalarAndSelectInvertsRank) {
  for (const Case& c : kCases) {
    for (size_t n : kSizes) {
      for (double density : {0.001, 0.05, 0.5, 0.97}) {
        SCOPED_TRACE(testing::Message() << "elem " << c.elem_size << " n " << n << " density "
                                        << density << " offset " << c.context.offset);
        const auto base_storage = RandomBase(n, c.elem_size, n * 7 + c.elem_size);
        const unsigned char* base = base_storage.data() + 1;  // unaligned
        const std::vector<uint32_t> changes = RandomChanges(n, density, n + 3);
        const std::vector<uint8_t> buckets = StreamBuckets(base, c, changes);
        const Walk fast = Rank(RankBucketed, base, n, c, buckets, changes);
        const Walk scalar = Rank(RankBucketedScalar, base, n, c, buckets, changes);
        ASSERT_EQ(fast.positions, scalar.positions);
        ASSERT_EQ(fast.stream, scalar.stream);
        ASSERT_EQ(fast.words_in, scalar.words_in);
        ASSERT_EQ(fast.ranks, scalar.ranks);
        // Select back, half the streams inverted (listing their unchanged words).
        std::vector<std::vector<uint32_t>> coded(buckets.size());
        std::vector<BucketStream> streams(buckets.size());
        for (size_t j = 0; j < buckets.size(); ++j) {
          const size_t changed_here =
              std::count(fast.stream.begin(), fast.stream.end(), static_cast<uint8_t>(j));
          std::vector<uint32_t> ranks(fast.ranks[j].begin(), fast.ranks[j].begin() + changed_here);
          const bool inverted = j % 2 == 1;
          if (inverted) {
            for (uint32_t r = 0; r < fast.words_in[j]; ++r)
              if (!std::binary_search(ranks.begin(), ranks.end(), r)) coded[j].push_back(r);
          } else {
            coded[j] = ranks;
          }
          streams[j] = {buckets[j], inverted, coded[j].data(), coded[j].size()};
        }
        for (auto select : {SelectBucketed, SelectBucketedScalar}) {
          std::vector<uint32_t> positions(changes.size() + 1);
          std::vector<uint8_t> stream(changes.size() + 1);
          std::vector<uint64_t> words_in(buckets.size());
          const size_t listed =
              select(base, n, c.elem_size, c.context, streams.data(), streams.size(),
                     positions.data(), stream.data(), changes.size(), words_in.data());
          ASSERT_EQ(listed, changes.size());
          positions.resize(listed);
          stream.resize(listed);
          EXPECT_EQ(positions, fast.positions);
          EXPECT_EQ(stream, fast.stream);
          EXPECT_EQ(words_in, fast.words_in);
        }
      }
    }
  }
}

TEST(BucketWalkTest, ListedOrderIsStripeThenStreamThenPosition) {
  const Case c = kCases[0];
  const size_t n = 3 * kBucketStripeWords + 5;
  const auto base_storage = RandomBase(n, 2, 11);
  const std::vector<uint32_t> changes = RandomChanges(n, 0.1, 12);
  const std::vector<uint8_t> buckets = StreamBuckets(base_storage.data(), c, changes);
  const Walk w = Rank(RankBucketed, base_storage.data(), n, c, buckets, changes);
  for (size_t i = 1; i < w.positions.size(); ++i) {
    const auto key = [&](size_t k) {
      return std::tuple(w.positions[k] / kBucketStripeWords, w.stream[k], w.positions[k]);
    };
    ASSERT_LT(key(i - 1), key(i)) << "at " << i;
  }
}

TEST(BucketWalkTest, InconsistentStreamsAreRefused) {
  const Case c = kCases[1];
  const size_t n = 700;
  const auto base_storage = RandomBase(n, 1, 5);
  const unsigned char* base = base_storage.data();
  std::vector<uint64_t> words_in(1);
  std::vector<uint32_t> positions(n), ranks_past = {0, 100000};
  std::vector<uint8_t> stream(n);
  for (auto select : {SelectBucketed, SelectBucketedScalar}) {
    // A rank past the words of its bucket.
    BucketStream past{3, false, ranks_past.data(), ranks_past.size()};
    EXPECT_EQ(select(base, n, 1, c.context, &past, 1, positions.data(), stream.data(), n,
                     words_in.data()),
              SIZE_MAX);
    // More changed words than the caller allows (an inverted stream listing nothing).
    BucketStream all{3, true, nullptr, 0};
    EXPECT_EQ(select(base, n, 1, c.context, &all, 1, positions.data(), stream.data(), 2,
                     words_in.data()),
              SIZE_MAX);
    // Ranks not ascending.
    std::vector<uint32_t> down = {5, 2};  // the same 64-word block or not: both refused
    BucketStream unsorted{3, false, down.data(), down.size()};
    EXPECT_EQ(select(base, n, 1, c.context, &unsorted, 1, positions.data(), stream.data(), n,
                     words_in.data()),
              SIZE_MAX);
  }
}

}  // namespace
}  // namespace flywheel::kernels
