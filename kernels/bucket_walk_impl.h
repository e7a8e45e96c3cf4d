// Private to kernels.cc and kernels_avx2.cc: the walks of SelectBucketed and RankBucketed
// (kernels.h), written once over an `Ops` policy that supplies the bucket bytes of a
// stripe of words, the mask of one bucket in 64 bucket bytes, a population count and a
// select-nth-set-bit. kernels.cc instantiates them with plain C++ operations (the
// references), kernels_avx2.cc with AVX2, POPCNT and BMI2.
//
// The walks go stripe by stripe (kBucketStripeWords words) and within a stripe stream by
// stream: each stream's pass over the stripe's bucket bytes (4 KiB, in L1) is a tight
// loop that mostly just counts, which the branch predictor follows.
//
// Included inside an anonymous namespace of each file, so that every instantiation has
// internal linkage (an AVX2 instantiation must never be picked for a plain caller). For
// the same reason it uses no library templates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

// Bucket bytes of one stripe, padded to whole 64-word blocks with a byte no bucket has.
struct StripeBuckets {
  alignas(64) uint8_t bytes[flywheel::kernels::kBucketStripeWords];
  size_t blocks = 0;
};

template <typename Ops>
void FillStripe(const unsigned char* base, size_t begin, size_t len, size_t elem_size,
                const flywheel::kernels::BucketContext& context, StripeBuckets* stripe) {
  Ops::Buckets(base, begin, len, elem_size, context, stripe->bytes);
  stripe->blocks = (len + 63) / 64;
  for (size_t j = len; j < stripe->blocks * 64; ++j) stripe->bytes[j] = 0xFF;
}

// One stream's pass over a stripe for the decoder: appends its changed words.
template <typename Ops>
bool SelectInStripe(const StripeBuckets& stripe, size_t begin,
                    const flywheel::kernels::BucketStream& s, uint64_t* seen, size_t* cursor,
                    uint32_t* out_positions, uint8_t* out_stream, uint8_t stream, size_t* listed,
                    size_t max_out) {
  uint64_t low = *seen;
  size_t c = *cursor;
  uint64_t next = c < s.rank_count ? s.ranks[c] : UINT64_MAX;
  if (next < low) return false;  // below the previous stripe's ranks
  for (size_t block = 0; block < stripe.blocks; ++block) {
    const uint64_t mask = Ops::Mask64(stripe.bytes + block * 64, s.bucket);
    const uint64_t high = low + static_cast<uint64_t>(Ops::Popcount(mask));
    if (next >= high && !s.inverted) {
      low = high;
      continue;
    }
    uint64_t selected = 0;
    while (next < high) {
      selected |= Ops::SelectBit(mask, static_cast<int>(next - low));
      const uint64_t taken = next;
      ++c;
      next = c < s.rank_count ? s.ranks[c] : UINT64_MAX;
      if (next <= taken) return false;  // ranks not strictly ascending
    }
    low = high;
    uint64_t changed = s.inverted ? mask & ~selected : selected;
    if (*listed + static_cast<size_t>(Ops::Popcount(changed)) > max_out) return false;
    for (; changed; changed &= changed - 1) {
      out_positions[*listed] = static_cast<uint32_t>(begin + block * 64 + __builtin_ctzll(changed));
      out_stream[(*listed)++] = stream;
    }
  }
  *seen = low;
  *cursor = c;
  return true;
}

// Decoder walk; see kernels::SelectBucketed.
template <typename Ops>
size_t SelectBucketedWalk(const unsigned char* base, size_t n, size_t elem_size,
                          const flywheel::kernels::BucketContext& context,
                          const flywheel::kernels::BucketStream* streams, size_t stream_count,
                          uint32_t* out_positions, uint8_t* out_stream, size_t max_out,
                          uint64_t* words_in_stream) {
  uint64_t seen[flywheel::kernels::kNumBuckets] = {};
  size_t cursor[flywheel::kernels::kNumBuckets] = {};
  StripeBuckets stripe;
  size_t listed = 0;
  for (size_t begin = 0; begin < n; begin += flywheel::kernels::kBucketStripeWords) {
    const size_t left = n - begin;
    const size_t len = left < flywheel::kernels::kBucketStripeWords
                           ? left
                           : flywheel::kernels::kBucketStripeWords;
    FillStripe<Ops>(base, begin, len, elem_size, context, &stripe);
    for (size_t j = 0; j < stream_count; ++j) {
      if (!SelectInStripe<Ops>(stripe, begin, streams[j], &seen[j], &cursor[j], out_positions,
                               out_stream, static_cast<uint8_t>(j), &listed, max_out)) {
        return SIZE_MAX;
      }
    }
  }
  for (size_t j = 0; j < stream_count; ++j) {
    if (cursor[j] != streams[j].rank_count) return SIZE_MAX;  // a rank past its bucket
    words_in_stream[j] = seen[j];
  }
  return listed;
}

// Encoder walk; see kernels::RankBucketed.
template <typename Ops>
size_t RankBucketedWalk(const unsigned char* base, size_t n, size_t elem_size,
                        const flywheel::kernels::BucketContext& context,
                        const uint8_t* stream_buckets, size_t stream_count,
                        const uint32_t* positions, size_t m, uint32_t* out_order,
                        uint8_t* out_stream, uint32_t* const* ranks, uint64_t* words_in_stream) {
  constexpr size_t kBlocks = flywheel::kernels::kBucketStripeWords / 64;
  uint64_t seen[flywheel::kernels::kNumBuckets] = {};
  size_t filled[flywheel::kernels::kNumBuckets] = {};
  uint64_t changed[kBlocks];
  size_t first_change[kBlocks];  // index into positions of the block's first change
  StripeBuckets stripe;
  size_t next = 0, listed = 0;
  for (size_t begin = 0; begin < n; begin += flywheel::kernels::kBucketStripeWords) {
    const size_t left = n - begin;
    const size_t len = left < flywheel::kernels::kBucketStripeWords
                           ? left
                           : flywheel::kernels::kBucketStripeWords;
    FillStripe<Ops>(base, begin, len, elem_size, context, &stripe);
    for (size_t block = 0; block < stripe.blocks; ++block) {
      changed[block] = 0;
      first_change[block] = next;
      const size_t end = begin + block * 64 + 64;
      for (; next < m && positions[next] < end; ++next) {
        changed[block] |= uint64_t{1} << (positions[next] - begin - block * 64);
      }
    }
    for (size_t j = 0; j < stream_count; ++j) {
      uint64_t low = seen[j];
      for (size_t block = 0; block < stripe.blocks; ++block) {
        const uint64_t mask = Ops::Mask64(stripe.bytes + block * 64, stream_buckets[j]);
        for (uint64_t hit = mask & changed[block]; hit; hit &= hit - 1) {
          const uint64_t below = (uint64_t{1} << __builtin_ctzll(hit)) - 1;
          ranks[j][filled[j]++] = static_cast<uint32_t>(low + Ops::Popcount(mask & below));
          out_order[listed] =
              static_cast<uint32_t>(first_change[block] + Ops::Popcount(changed[block] & below));
          out_stream[listed++] = static_cast<uint8_t>(j);
        }
        low += static_cast<uint64_t>(Ops::Popcount(mask));
      }
      seen[j] = low;
    }
  }
  for (size_t j = 0; j < stream_count; ++j) words_in_stream[j] = seen[j];
  return listed;
}
