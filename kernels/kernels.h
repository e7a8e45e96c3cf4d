// Hot loops of the delta codec. Each has a plain scalar reference (`*Scalar`) and a
// vectorised CPU version chosen at run time (AVX2 when the CPU has it); tests compare
// them bit for bit on awkward sizes. CUDA versions live in kernels/cuda.h.
//
// Element sizes are 1, 2, 4 or 8 bytes; values are compared as bit patterns, never as
// floats, so NaN payloads, -0.0 and subnormals are just bits.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flywheel::kernels {

// Writes, in ascending order, the index of every element i < n whose `elem_size` bytes
// differ between `base` and `target`, into `out_positions`; returns how many.
// REQUIRES: out_positions has room for n entries; n <= 2^32. Entries past the returned
// count may be overwritten with junk (the AVX2 version stores without branching).
size_t CompareCompact(const void* base, const void* target, size_t n, size_t elem_size,
                      uint32_t* out_positions);
size_t CompareCompactScalar(const void* base, const void* target, size_t n, size_t elem_size,
                            uint32_t* out_positions);

// Number of differing elements (same definition as CompareCompact), without positions.
size_t CountChanged(const void* base, const void* target, size_t n, size_t elem_size);
size_t CountChangedScalar(const void* base, const void* target, size_t n, size_t elem_size);

// For i < count: copies element `values[i]` into element `positions[i]` of `dst`.
// REQUIRES: every position is in range (the decoder checks before calling).
void ScatterApply(void* dst, size_t elem_size, const uint32_t* positions, const void* values,
                  size_t count);
void ScatterApplyScalar(void* dst, size_t elem_size, const uint32_t* positions, const void* values,
                        size_t count);

// For i < count: out[i] = element `positions[i]` of `src` (the inverse of ScatterApply;
// used to gather base values and to save undo records).
void Gather(const void* src, size_t elem_size, const uint32_t* positions, void* out, size_t count);
void GatherScalar(const void* src, size_t elem_size, const uint32_t* positions, void* out,
                  size_t count);

// The sparse apply: for i < count, element positions[i] of `dst`, read as a little-endian
// unsigned integer of elem_size bytes, gets d added modulo 2^(8*elem_size), where d is
// zigzag_diffs[i] zigzag-decoded (z -> (z >> 1) ^ -(z & 1)). When `old_values` is not
// null, element i of it receives the element's previous bytes (an undo record, the same
// as a Gather before the update, without a second pass over memory).
// REQUIRES: every position is in range; positions distinct.
void ScatterAddZigZag(void* dst, size_t elem_size, const uint32_t* positions,
                      const uint64_t* zigzag_diffs, size_t count, void* old_values = nullptr);
void ScatterAddZigZagScalar(void* dst, size_t elem_size, const uint32_t* positions,
                            const uint64_t* zigzag_diffs, size_t count, void* old_values = nullptr);

// XXH3-64 (seed 0) of consecutive `chunk_bytes`-sized pieces of `data` (the last may be
// shorter): out[k] = XXH3_64(data + k*chunk_bytes, ...). ChunkChecksums uses the
// library's vectorised XXH3; ChunkChecksumsScalar is a build of XXH3 with vector code
// disabled. Returns the number of chunks (ceil(size / chunk_bytes); 0 for size 0).
// REQUIRES: chunk_bytes > 0.
size_t ChunkChecksums(const void* data, size_t size, size_t chunk_bytes, uint64_t* out);
size_t ChunkChecksumsScalar(const void* data, size_t size, size_t chunk_bytes, uint64_t* out);

// ---- context buckets (the context-modelled sparse coding, delta/format.h kind 3) ------
//
// A word's context is read from its BASE word (which the decoder holds): its exponent
// field e = (word >> shift) & field_mask, bucket clamp(e - offset, 0, kNumBuckets - 1).
// A chunk codes the changed words of each bucket as a separate stream of ranks (a word's
// rank is the number of words of its bucket before it in the chunk). Words are taken in
// stripes of kBucketStripeWords; the changed words are listed stripe by stripe, within a
// stripe by stream (streams in the order given), within a stream by position. That order
// is the one the values are coded in.

inline constexpr int kNumBuckets = 16;
inline constexpr size_t kBucketStripeWords = 4096;
inline constexpr size_t kMaxBucketStreams = kNumBuckets;

struct BucketContext {
  int shift = 0;            // of the exponent field in the word
  uint32_t field_mask = 0;  // the field after the shift
  int offset = 0;           // subtracted before clamping to [0, kNumBuckets)
};

// The bucket of one word (the definition the kernels below implement).
inline int BucketOf(uint64_t word, const BucketContext& c) {
  const int e = static_cast<int>((word >> c.shift) & c.field_mask) - c.offset;
  return e < 0 ? 0 : (e >= kNumBuckets ? kNumBuckets - 1 : e);
}

// One stream of a chunk: its bucket, whether it lists the UNCHANGED words of the bucket
// (used where most of the bucket changes), and its ranks, ascending.
struct BucketStream {
  uint8_t bucket = 0;
  bool inverted = false;
  const uint32_t* ranks = nullptr;
  size_t rank_count = 0;
};

// The decoder's walk: lists the changed words of `base` (n words of elem_size bytes) in
// the order above: out_positions[i] (chunk-relative word index) and out_stream[i] (index
// into `streams`). Fills words_in_stream[j] with the number of words in stream j's bucket.
// Returns the number listed, or SIZE_MAX when the streams are inconsistent with the base:
// more than max_out changed words, or a rank at or past the words of its bucket.
// REQUIRES: streams have distinct buckets; stream_count <= kMaxBucketStreams;
// elem_size 1, 2, 4 or 8; n <= 2^32.
size_t SelectBucketed(const void* base, size_t n, size_t elem_size, const BucketContext& context,
                      const BucketStream* streams, size_t stream_count, uint32_t* out_positions,
                      uint8_t* out_stream, size_t max_out, uint64_t* words_in_stream);
size_t SelectBucketedScalar(const void* base, size_t n, size_t elem_size,
                            const BucketContext& context, const BucketStream* streams,
                            size_t stream_count, uint32_t* out_positions, uint8_t* out_stream,
                            size_t max_out, uint64_t* words_in_stream);

// The encoder's walk: for the m changed words at `positions` (chunk-relative, ascending),
// out_order[i] is the index into `positions` of the i-th changed word in the order above
// and out_stream[i] its stream; ranks[j] (room for the changed words of bucket j's
// stream) receives the ranks of stream j's changed words, ascending, and
// words_in_stream[j] the words of its bucket. Changed words whose bucket has no stream
// are not listed; returns the number listed.
// REQUIRES: as SelectBucketed (inverted is ignored here); positions < n, ascending.
size_t RankBucketed(const void* base, size_t n, size_t elem_size, const BucketContext& context,
                    const uint8_t* stream_buckets, size_t stream_count, const uint32_t* positions,
                    size_t m, uint32_t* out_order, uint8_t* out_stream, uint32_t* const* ranks,
                    uint64_t* words_in_stream);
size_t RankBucketedScalar(const void* base, size_t n, size_t elem_size,
                          const BucketContext& context, const uint8_t* stream_buckets,
                          size_t stream_count, const uint32_t* positions, size_t m,
                          uint32_t* out_order, uint8_t* out_stream, uint32_t* const* ranks,
                          uint64_t* words_in_stream);

// ---- byte-plane unshuffle (dense and literal chunks, delta/format.h) ------------------
//
// The inverse of the codec's byte-plane shuffle: `src` holds elem_size planes of n bytes
// (plane b = byte b of every element); dst[i*elem_size+b] = src[b*n+i]. Overwrites dst
// (a keyframe's literal chunks). elem_size 1 is a copy.
// REQUIRES: src holds n*elem_size bytes, dst has room for them; they do not overlap.
void Unshuffle(const void* src, size_t n, size_t elem_size, void* dst);
void UnshuffleScalar(const void* src, size_t n, size_t elem_size, void* dst);

// True when the vectorised paths above run AVX2 code on this CPU.
bool HaveAvx2();

}  // namespace flywheel::kernels
