// entropy::DecodeApplySparse (the plain sparse chunk decoded and applied in one pass)
// against its three-pass reference, RiceDecodePositions + DecodeValues +
// kernels::ScatterAddZigZagScalar: bit for bit on random and adversarial streams (every
// gap 0, escaped gaps, changes at both chunk ends, odd counts, every Rice parameter,
// every word width), and on corrupt streams the same verdict, with the region untouched.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "delta/entropy.h"
#include "kernels/kernels.h"

namespace flywheel::delta::entropy {
namespace {

// A sparse chunk's two streams and what they decode to.
struct Streams {
  int k = 0;
  std::vector<uint8_t> index, values;
  size_t count = 0;
  uint64_t limit = 0;
};

Streams Encode(const std::vector<uint32_t>& positions, const std::vector<uint64_t>& z,
               uint64_t limit, int k = -1) {
  std::vector<uint32_t> gaps;
  uint32_t next = 0;
  for (uint32_t p : positions) gaps.push_back(p - next), next = p + 1;
  Streams s;
  s.k = k >= 0 ? k : ChooseRiceK(gaps);
  RiceEncode(gaps, s.k, &s.index);
  EncodeValues(z, &s.values);
  s.count = positions.size();
  s.limit = limit;
  return s;
}

// What one decode did: its verdict, the region after it, and (on success) the undo record.
struct Outcome {
  bool ok = false;
  std::vector<uint8_t> region;
  std::vector<uint32_t> positions;
  std::vector<uint8_t> old;
};

Outcome Reference(const Streams& s, int w, const std::vector<uint8_t>& region) {
  Outcome out;
  out.region = region;
  out.positions.assign(s.count, 0);
  out.old.assign(s.count * w, 0);
  std::vector<uint64_t> z(s.count);
  out.ok = RiceDecodePositions(s.index, s.k, s.count, s.limit, out.positions.data()).ok() &&
           DecodeValues(s.values, s.count, z.data()).ok();
  if (out.ok) {
    kernels::ScatterAddZigZagScalar(out.region.data(), w, out.positions.data(), z.data(), s.count,
                                    out.old.data());
  } else {
    out.positions.clear();
    out.old.clear();
  }
  return out;
}

Outcome Fused(const Streams& s, int w, const std::vector<uint8_t>& region, FusedLoopIsa isa) {
  Outcome out;
  out.region = region;
  out.positions.assign(s.count, 0);
  out.old.assign(s.count * w, 0);
  SparseTarget target;
  target.isa = isa;
  target.region = out.region.data();
  target.w = w;
  target.positions_out = out.positions.data();
  target.old_out = out.old.data();
  out.ok = DecodeApplySparse(s.index, s.k, s.values, s.count, s.limit, target).ok();
  if (!out.ok) {
    out.positions.clear();
    out.old.clear();
  }
  return out;
}

// Both loops agree with the reference; returns whether the reference accepted.
bool ExpectSame(const Streams& s, int w, const std::vector<uint8_t>& region,
                const std::string& what) {
  const Outcome want = Reference(s, w, region);
  for (FusedLoopIsa isa : {FusedLoopIsa::kAuto, FusedLoopIsa::kBaseline}) {
    const Outcome got = Fused(s, w, region, isa);
    const std::string where = what + (isa == FusedLoopIsa::kAuto ? " (auto)" : " (baseline)");
    EXPECT_EQ(got.ok, want.ok) << where;
    EXPECT_TRUE(got.region == want.region) << where;
    EXPECT_EQ(got.positions, want.positions) << where;
    EXPECT_EQ(got.old, want.old) << where;
    if (!got.ok) EXPECT_TRUE(got.region == region) << where << ": a failed decode wrote";
  }
  return want.ok;
}

std::vector<uint8_t> RandomRegion(std::mt19937_64& rng, size_t bytes) {
  std::vector<uint8_t> region(bytes);
  for (uint8_t& b : region) b = static_cast<uint8_t>(rng());
  return region;
}

// Zigzagged differences for a word of w bytes: mostly +-1 ulp (symbols 0..3), some
// medium, some spanning the whole word (extra bits).
std::vector<uint64_t> RandomZ(std::mt19937_64& rng, size_t count, int w, double wide_share) {
  std::vector<uint64_t> z(count);
  std::uniform_real_distribution<double> u(0, 1);
  const uint64_t word_mask = w == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * w)) - 1;
  for (uint64_t& v : z) {
    const double r = u(rng);
    if (r < wide_share) {
      v = (rng() & word_mask) | 1;  // any value the word can hold, >= 1
    } else if (r < 0.2) {
      v = 1 + rng() % 60;
    } else {
      v = 1 + rng() % 4;
    }
  }
  return z;
}

std::vector<uint32_t> RandomPositions(std::mt19937_64& rng, uint64_t n, double density) {
  std::vector<uint32_t> positions;
  std::bernoulli_distribution pick(density);
  for (uint64_t i = 0; i < n; ++i)
    if (pick(rng)) positions.push_back(static_cast<uint32_t>(i));
  return positions;
}

TEST(SparseApplyTest, MatchesReferenceAcrossDensitiesAndWidths) {
  std::mt19937_64 rng(7);
  for (int w : {1, 2, 4, 8}) {
    for (double density : {0.0005, 0.023, 0.145, 0.6, 1.0}) {
      const uint64_t n = 50'001;
      const auto positions = RandomPositions(rng, n, density);
      const auto z = RandomZ(rng, positions.size(), w, 0.01);
      const Streams s = Encode(positions, z, n);
      EXPECT_TRUE(ExpectSame(s, w, RandomRegion(rng, n * w),
                             "w " + std::to_string(w) + " density " + std::to_string(density)));
    }
  }
}

TEST(SparseApplyTest, EveryGapZero) {
  std::mt19937_64 rng(8);
  for (uint64_t n : {1, 2, 3, 7, 733, 65'536}) {
    std::vector<uint32_t> positions(n);
    for (uint64_t i = 0; i < n; ++i) positions[i] = static_cast<uint32_t>(i);
    const Streams s = Encode(positions, RandomZ(rng, n, 2, 0.0), n);
    EXPECT_EQ(s.k, 0);
    EXPECT_TRUE(ExpectSame(s, 2, RandomRegion(rng, n * 2), "n " + std::to_string(n)));
  }
}

TEST(SparseApplyTest, EveryRiceParameterAndEscapedGaps) {
  std::mt19937_64 rng(9);
  const uint64_t n = 3'000'000;
  // Gaps from 0 to ~2^21: with a small k the large ones are escaped (q >= 31).
  std::vector<uint32_t> positions = {0};
  while (positions.back() < n - (1u << 21) - 2) {
    const uint32_t gap = static_cast<uint32_t>(rng() % 4 == 0 ? rng() % (1u << 21) : rng() % 40);
    positions.push_back(positions.back() + gap + 1);
  }
  positions.push_back(static_cast<uint32_t>(n - 1));  // the chunk's last word
  const auto z = RandomZ(rng, positions.size(), 2, 0.05);
  const std::vector<uint8_t> region = RandomRegion(rng, n * 2);
  for (int k = 0; k <= kMaxRiceK; ++k) {
    const Streams s = Encode(positions, z, n, k);
    EXPECT_TRUE(ExpectSame(s, 2, region, "k " + std::to_string(k)));
  }
}

TEST(SparseApplyTest, SmallAndOddCounts) {
  std::mt19937_64 rng(10);
  for (size_t count : {1, 2, 3, 4, 5, 17}) {
    const uint64_t n = 40;
    std::vector<uint32_t> positions;
    for (size_t i = 0; i < count; ++i) positions.push_back(static_cast<uint32_t>(i * 2 + 1));
    if (count > 0) positions.back() = n - 1;
    const Streams s = Encode(positions, RandomZ(rng, count, 4, 0.3), n);
    EXPECT_TRUE(ExpectSame(s, 4, RandomRegion(rng, n * 4), "count " + std::to_string(count)));
  }
}

TEST(SparseApplyTest, PositionPastLimitWritesNothing) {
  std::mt19937_64 rng(11);
  const uint64_t n = 10'000;
  const auto positions = RandomPositions(rng, n, 0.1);
  Streams s = Encode(positions, RandomZ(rng, positions.size(), 2, 0.0), n);
  s.limit = positions[positions.size() / 2];  // half the changes lie past it
  EXPECT_FALSE(ExpectSame(s, 2, RandomRegion(rng, n * 2), "limit"));
}

// Every byte of either stream flipped, each stream truncated and extended: the fused
// decode gives the reference's verdict, and a refused stream leaves the region as it was.
TEST(SparseApplyTest, CorruptStreamsGiveTheReferenceVerdict) {
  std::mt19937_64 rng(12);
  const uint64_t n = 4'000;
  const auto positions = RandomPositions(rng, n, 0.15);
  const Streams good = Encode(positions, RandomZ(rng, positions.size(), 2, 0.02), n);
  const std::vector<uint8_t> region = RandomRegion(rng, n * 2);
  int refused = 0, cases = 0;
  for (int which = 0; which < 2; ++which) {
    const size_t size = which == 0 ? good.index.size() : good.values.size();
    for (size_t at = 0; at < size; ++at) {
      Streams bad = good;
      std::vector<uint8_t>& bytes = which == 0 ? bad.index : bad.values;
      bytes[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
      refused += !ExpectSame(bad, 2, region, "flip " + std::to_string(which) + "/" +
                                                 std::to_string(at));
      ++cases;
    }
    for (size_t cut : {size_t{1}, size_t{2}, size_t{9}, size / 2}) {
      Streams bad = good;
      std::vector<uint8_t>& bytes = which == 0 ? bad.index : bad.values;
      bytes.resize(bytes.size() - std::min(cut, bytes.size()));
      refused += !ExpectSame(bad, 2, region, "cut " + std::to_string(cut));
      ++cases;
    }
    Streams longer = good;
    (which == 0 ? longer.index : longer.values).push_back(0x5a);
    refused += !ExpectSame(longer, 2, region, "extended");
    ++cases;
  }
  EXPECT_GT(refused, cases / 2);  // most corruptions are caught by the decoders themselves
}

}  // namespace
}  // namespace flywheel::delta::entropy
