// AVX2 versions of the compare/scatter/gather kernels. This file alone is compiled with
// -mavx2 -mbmi -mbmi2 -mpopcnt; kernels.cc calls into it only when HaveAvx2().
//
// Keep everything here in internal linkage and free of inline library templates
// (std::min, containers, ...): an inline function instantiated in this file carries AVX2
// code, and the linker could pick that copy for callers on a CPU without AVX2.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/kernels.h"

namespace flywheel::kernels::avx2 {
namespace {

constexpr size_t kVectorBytes = 32;

// Bit set for every element of one 32-byte vector whose bits differ between `a` and `b`.
// Element j of the vector maps to bit (j << MaskShift<kElem>) of the result.
template <size_t kElem>
inline uint32_t DiffMask(__m256i a, __m256i b);

template <>
inline uint32_t DiffMask<1>(__m256i a, __m256i b) {
  return ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a, b)));
}
// Both byte-mask bits of a 16-bit lane are equal; keeping the even one avoids a PEXT
// (microcoded and very slow on AMD before Zen 3) and costs a shift per found position.
template <>
inline uint32_t DiffMask<2>(__m256i a, __m256i b) {
  return ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi16(a, b))) & 0x55555555u;
}
template <>
inline uint32_t DiffMask<4>(__m256i a, __m256i b) {
  const __m256 eq = _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b));
  return ~static_cast<uint32_t>(_mm256_movemask_ps(eq)) & 0xFFu;
}
template <>
inline uint32_t DiffMask<8>(__m256i a, __m256i b) {
  const __m256d eq = _mm256_castsi256_pd(_mm256_cmpeq_epi64(a, b));
  return ~static_cast<uint32_t>(_mm256_movemask_pd(eq)) & 0xFu;
}

template <size_t kElem>
constexpr unsigned MaskShift() {
  return kElem == 2 ? 1 : 0;
}

inline __m256i Load(const unsigned char* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Compare-and-compact works on blocks of 64 elements (64 * kElem bytes): one 64-bit
// mask per block, bit j set when element j differs. At ~2% density a block holds about
// one change, so the per-block cost (loads, compares, a few packs, one emit sequence)
// dominates and one mask per block beats one per 32-byte vector by ~2x.
constexpr size_t kBlockElements = 64;

template <size_t kElem>
inline uint64_t BlockDiffMask(const unsigned char* a, const unsigned char* b);

template <>
inline uint64_t BlockDiffMask<1>(const unsigned char* a, const unsigned char* b) {
  const uint32_t eq0 =
      static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(Load(a), Load(b))));
  const uint32_t eq1 =
      static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(Load(a + 32), Load(b + 32))));
  return ~(uint64_t{eq0} | uint64_t{eq1} << 32);
}

// 32 16-bit compares -> 32 mask bits in element order. packs works within 128-bit
// lanes, giving the quarters in the order (0, 2, 1, 3); permute4x64 restores them.
inline uint32_t EqualMask16x32(const unsigned char* a, const unsigned char* b) {
  const __m256i eq0 = _mm256_cmpeq_epi16(Load(a), Load(b));
  const __m256i eq1 = _mm256_cmpeq_epi16(Load(a + 32), Load(b + 32));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi16(eq0, eq1), 0xD8);
  return static_cast<uint32_t>(_mm256_movemask_epi8(packed));
}

template <>
inline uint64_t BlockDiffMask<2>(const unsigned char* a, const unsigned char* b) {
  return ~(uint64_t{EqualMask16x32(a, b)} | uint64_t{EqualMask16x32(a + 64, b + 64)} << 32);
}

// 32 32-bit compares -> 32 mask bits in element order. Two rounds of in-lane packs
// leave the eight 4-element groups in the order (0, 2, 4, 6, 1, 3, 5, 7).
inline uint32_t EqualMask32x32(const unsigned char* a, const unsigned char* b) {
  const __m256i eq0 = _mm256_cmpeq_epi32(Load(a), Load(b));
  const __m256i eq1 = _mm256_cmpeq_epi32(Load(a + 32), Load(b + 32));
  const __m256i eq2 = _mm256_cmpeq_epi32(Load(a + 64), Load(b + 64));
  const __m256i eq3 = _mm256_cmpeq_epi32(Load(a + 96), Load(b + 96));
  const __m256i packed =
      _mm256_packs_epi16(_mm256_packs_epi32(eq0, eq1), _mm256_packs_epi32(eq2, eq3));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_permutevar8x32_epi32(packed, order)));
}

template <>
inline uint64_t BlockDiffMask<4>(const unsigned char* a, const unsigned char* b) {
  return ~(uint64_t{EqualMask32x32(a, b)} | uint64_t{EqualMask32x32(a + 128, b + 128)} << 32);
}

template <>
inline uint64_t BlockDiffMask<8>(const unsigned char* a, const unsigned char* b) {
  uint64_t equal = 0;
  for (int v = 0; v < 16; ++v) {
    const __m256i eq = _mm256_cmpeq_epi64(Load(a + 32 * v), Load(b + 32 * v));
    equal |= uint64_t(_mm256_movemask_pd(_mm256_castsi256_pd(eq))) << (4 * v);
  }
  return ~equal;
}

// Appends `first + j` for every bit j of `mask` to `out`, ascending; returns the new end.
// Writes four slots even when fewer bits are set (tzcnt(0) = 64 gives a junk value) so
// that the common block with one or two changes takes no data-dependent branch. That
// stays inside the caller's buffer: with k positions written before a block starting at
// element e, k <= e, and e + 64 <= n for every full block.
inline uint32_t* EmitBlockPositions(uint64_t mask, uint32_t first, uint32_t* out) {
  const unsigned count = static_cast<unsigned>(_mm_popcnt_u64(mask));
  out[0] = first + static_cast<uint32_t>(_tzcnt_u64(mask));
  mask = _blsr_u64(mask);
  out[1] = first + static_cast<uint32_t>(_tzcnt_u64(mask));
  mask = _blsr_u64(mask);
  out[2] = first + static_cast<uint32_t>(_tzcnt_u64(mask));
  mask = _blsr_u64(mask);
  out[3] = first + static_cast<uint32_t>(_tzcnt_u64(mask));
  mask = _blsr_u64(mask);
  if (count > 4) {
    uint32_t* p = out + 4;
    while (mask != 0) {
      *p++ = first + static_cast<uint32_t>(_tzcnt_u64(mask));
      mask = _blsr_u64(mask);
    }
  }
  return out + count;
}

// Tail after the last full block: one 32-byte vector at a time, then element by element.
template <size_t kElem>
inline uint32_t* CompactTail(const unsigned char* a, const unsigned char* b, size_t first, size_t n,
                             uint32_t* out) {
  constexpr unsigned kShift = MaskShift<kElem>();
  size_t i = first;
  for (; i + kVectorBytes / kElem <= n; i += kVectorBytes / kElem) {
    uint32_t mask = DiffMask<kElem>(Load(a + i * kElem), Load(b + i * kElem));
    while (mask != 0) {
      *out++ = static_cast<uint32_t>(i + (_tzcnt_u32(mask) >> kShift));
      mask = _blsr_u32(mask);
    }
  }
  for (; i < n; ++i) {
    if (std::memcmp(a + i * kElem, b + i * kElem, kElem) != 0) *out++ = static_cast<uint32_t>(i);
  }
  return out;
}

template <size_t kElem>
size_t CompareCompactT(const unsigned char* a, const unsigned char* b, size_t n,
                       uint32_t* out_positions) {
  uint32_t* out = out_positions;
  size_t i = 0;
  for (; i + kBlockElements <= n; i += kBlockElements) {
    // No "mask == 0" skip: at 2% density about 28% of blocks are equal, a branch that
    // mispredicts often enough to cost more (measured: -20% for 4-byte words) than the
    // four junk stores of an empty block.
    out = EmitBlockPositions(BlockDiffMask<kElem>(a + i * kElem, b + i * kElem),
                             static_cast<uint32_t>(i), out);
  }
  out = CompactTail<kElem>(a, b, i, n, out);
  return static_cast<size_t>(out - out_positions);
}

template <size_t kElem>
size_t CountChangedT(const unsigned char* a, const unsigned char* b, size_t n) {
  size_t count = 0;
  size_t i = 0;
  for (; i + kBlockElements <= n; i += kBlockElements) {
    count += _mm_popcnt_u64(BlockDiffMask<kElem>(a + i * kElem, b + i * kElem));
  }
  for (; i + kVectorBytes / kElem <= n; i += kVectorBytes / kElem) {
    count += _mm_popcnt_u32(DiffMask<kElem>(Load(a + i * kElem), Load(b + i * kElem)));
  }
  for (; i < n; ++i) count += std::memcmp(a + i * kElem, b + i * kElem, kElem) != 0;
  return count;
}

// AVX2 has gather but no scatter, and its gathers are no faster than scalar loads for
// positions this far apart. So these are plain loops, not SIMD: specialised per element
// size (fixed-size memcpy compiles to one load and one store) and unrolled by four so
// that independent loads and stores overlap.
template <size_t kElem>
void ScatterApplyT(unsigned char* dst, const uint32_t* positions, const unsigned char* values,
                   size_t count) {
  size_t i = 0;
  for (; i + 4 <= count; i += 4) {
    std::memcpy(dst + size_t{positions[i]} * kElem, values + i * kElem, kElem);
    std::memcpy(dst + size_t{positions[i + 1]} * kElem, values + (i + 1) * kElem, kElem);
    std::memcpy(dst + size_t{positions[i + 2]} * kElem, values + (i + 2) * kElem, kElem);
    std::memcpy(dst + size_t{positions[i + 3]} * kElem, values + (i + 3) * kElem, kElem);
  }
  for (; i < count; ++i) {
    std::memcpy(dst + size_t{positions[i]} * kElem, values + i * kElem, kElem);
  }
}

template <size_t kElem>
void GatherT(const unsigned char* src, const uint32_t* positions, unsigned char* out,
             size_t count) {
  size_t i = 0;
  for (; i + 4 <= count; i += 4) {
    std::memcpy(out + i * kElem, src + size_t{positions[i]} * kElem, kElem);
    std::memcpy(out + (i + 1) * kElem, src + size_t{positions[i + 1]} * kElem, kElem);
    std::memcpy(out + (i + 2) * kElem, src + size_t{positions[i + 2]} * kElem, kElem);
    std::memcpy(out + (i + 3) * kElem, src + size_t{positions[i + 3]} * kElem, kElem);
  }
  for (; i < count; ++i) {
    std::memcpy(out + i * kElem, src + size_t{positions[i]} * kElem, kElem);
  }
}

const unsigned char* Bytes(const void* p) {
  return static_cast<const unsigned char*>(p);
}
unsigned char* Bytes(void* p) {
  return static_cast<unsigned char*>(p);
}

}  // namespace

// kernels.cc dispatches here only for elem_size 1, 2, 4 or 8 on a CPU with AVX2.
size_t CompareCompact(const void* base, const void* target, size_t n, size_t elem_size,
                      uint32_t* out_positions) {
  switch (elem_size) {
    case 1:
      return CompareCompactT<1>(Bytes(base), Bytes(target), n, out_positions);
    case 2:
      return CompareCompactT<2>(Bytes(base), Bytes(target), n, out_positions);
    case 4:
      return CompareCompactT<4>(Bytes(base), Bytes(target), n, out_positions);
    default:
      return CompareCompactT<8>(Bytes(base), Bytes(target), n, out_positions);
  }
}

size_t CountChanged(const void* base, const void* target, size_t n, size_t elem_size) {
  switch (elem_size) {
    case 1:
      return CountChangedT<1>(Bytes(base), Bytes(target), n);
    case 2:
      return CountChangedT<2>(Bytes(base), Bytes(target), n);
    case 4:
      return CountChangedT<4>(Bytes(base), Bytes(target), n);
    default:
      return CountChangedT<8>(Bytes(base), Bytes(target), n);
  }
}

void ScatterApply(void* dst, size_t elem_size, const uint32_t* positions, const void* values,
                  size_t count) {
  switch (elem_size) {
    case 1:
      return ScatterApplyT<1>(Bytes(dst), positions, Bytes(values), count);
    case 2:
      return ScatterApplyT<2>(Bytes(dst), positions, Bytes(values), count);
    case 4:
      return ScatterApplyT<4>(Bytes(dst), positions, Bytes(values), count);
    default:
      return ScatterApplyT<8>(Bytes(dst), positions, Bytes(values), count);
  }
}

void Gather(const void* src, size_t elem_size, const uint32_t* positions, void* out, size_t count) {
  switch (elem_size) {
    case 1:
      return GatherT<1>(Bytes(src), positions, Bytes(out), count);
    case 2:
      return GatherT<2>(Bytes(src), positions, Bytes(out), count);
    case 4:
      return GatherT<4>(Bytes(src), positions, Bytes(out), count);
    default:
      return GatherT<8>(Bytes(src), positions, Bytes(out), count);
  }
}

// ---- context buckets ------------------------------------------------------------------

namespace {

#include "kernels/bucket_walk_impl.h"

// The bucket bytes of 32 consecutive 16-bit words at `p`, in word order.
inline __m256i Buckets16(const unsigned char* p, __m128i shift, __m256i field, __m256i offset) {
  const __m256i top = _mm256_set1_epi16(kNumBuckets - 1);
  __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  a = _mm256_sub_epi16(_mm256_and_si256(_mm256_srl_epi16(a, shift), field), offset);
  b = _mm256_sub_epi16(_mm256_and_si256(_mm256_srl_epi16(b, shift), field), offset);
  a = _mm256_min_epi16(_mm256_max_epi16(a, _mm256_setzero_si256()), top);
  b = _mm256_min_epi16(_mm256_max_epi16(b, _mm256_setzero_si256()), top);
  // packus interleaves the 128-bit lanes of a and b; the permute puts them back in order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8);
}

// The bucket bytes of 32 consecutive 8-bit words at `p`. The 16-bit shift lets bits of
// the neighbouring byte in; the field mask (at most 8 bits after the shift) drops them.
inline __m256i Buckets8(const unsigned char* p, __m128i shift, __m256i field, __m256i offset) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  v = _mm256_and_si256(_mm256_srl_epi16(v, shift), field);
  return _mm256_min_epu8(_mm256_subs_epu8(v, offset), _mm256_set1_epi8(kNumBuckets - 1));
}

struct Avx2Ops {
  static void Buckets(const unsigned char* base, size_t begin, size_t len, size_t elem_size,
                      const BucketContext& context, uint8_t* out) {
    // Whole 64-word blocks of 16- and 8-bit words (fields of at most 8 bits after the
    // shift) in vectors; the rest one word at a time.
    const bool vector = (elem_size == 2 && context.field_mask <= 0xFF) ||
                        (elem_size == 1 && context.field_mask <= 0xFF && context.offset >= 0 &&
                         context.offset <= 0xFF);
    size_t j = 0;
    if (vector) {
      const __m128i shift = _mm_cvtsi32_si128(context.shift);
      if (elem_size == 2) {
        const __m256i field = _mm256_set1_epi16(static_cast<short>(context.field_mask));
        const __m256i offset = _mm256_set1_epi16(static_cast<short>(context.offset));
        for (; j + 32 <= len; j += 32) {
          const __m256i b = Buckets16(base + (begin + j) * 2, shift, field, offset);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), b);
        }
      } else {
        const __m256i field = _mm256_set1_epi8(static_cast<char>(context.field_mask));
        const __m256i offset = _mm256_set1_epi8(static_cast<char>(context.offset));
        for (; j + 32 <= len; j += 32) {
          const __m256i b = Buckets8(base + begin + j, shift, field, offset);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), b);
        }
      }
    }
    for (; j < len; ++j) {
      uint64_t word = 0;
      std::memcpy(&word, base + (begin + j) * elem_size, elem_size);
      int e = static_cast<int>((word >> context.shift) & context.field_mask) - context.offset;
      out[j] = static_cast<uint8_t>(e < 0 ? 0 : (e >= kNumBuckets ? kNumBuckets - 1 : e));
    }
  }
  static uint64_t Mask64(const uint8_t* bytes, uint8_t bucket) {
    const __m256i b = _mm256_set1_epi8(static_cast<char>(bucket));
    const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m256i hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes + 32));
    const uint32_t low = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, b)));
    const uint32_t high = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, b)));
    return uint64_t{low} | (uint64_t{high} << 32);
  }
  static int Popcount(uint64_t x) { return static_cast<int>(_mm_popcnt_u64(x)); }
  static uint64_t SelectBit(uint64_t mask, int rank) {
    return _pdep_u64(uint64_t{1} << rank, mask);
  }
};

}  // namespace

size_t SelectBucketed(const void* base, size_t n, size_t elem_size, const BucketContext& context,
                      const BucketStream* streams, size_t stream_count, uint32_t* out_positions,
                      uint8_t* out_stream, size_t max_out, uint64_t* words_in_stream) {
  return SelectBucketedWalk<Avx2Ops>(Bytes(base), n, elem_size, context, streams, stream_count,
                                     out_positions, out_stream, max_out, words_in_stream);
}

size_t RankBucketed(const void* base, size_t n, size_t elem_size, const BucketContext& context,
                    const uint8_t* stream_buckets, size_t stream_count, const uint32_t* positions,
                    size_t m, uint32_t* out_order, uint8_t* out_stream, uint32_t* const* ranks,
                    uint64_t* words_in_stream) {
  return RankBucketedWalk<Avx2Ops>(Bytes(base), n, elem_size, context, stream_buckets,
                                   stream_count, positions, m, out_order, out_stream, ranks,
                                   words_in_stream);
}

// ---- byte-plane unshuffle ---------------------------------------------------------------
//
// 32 elements per step: one 32-byte load from each plane, then unpack steps that pair
// bytes, then 16-bit and 32-bit groups. The unpacks work within 128-bit lanes, so the
// last step's permute2x128 puts the low lanes (elements 0..15) before the high lanes
// (elements 16..31).

namespace {

inline __m256i LoadPlane(const unsigned char* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline void Store(unsigned char* p, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

// Stores x[0..2k) (pairs holding elements of the low lane then the high lane) as the
// 32 elements of one step: low lanes of every pair first, then high lanes.
template <int K>
inline void StoreLanes(unsigned char* d, const __m256i* x) {
  for (int j = 0; j < K; ++j) {
    Store(d + 32 * j, _mm256_permute2x128_si256(x[2 * j], x[2 * j + 1], 0x20));
    Store(d + 32 * (K + j), _mm256_permute2x128_si256(x[2 * j], x[2 * j + 1], 0x31));
  }
}

void Unshuffle2(const unsigned char* s, size_t n, unsigned char* d, size_t steps) {
  for (size_t k = 0; k < steps; ++k, d += 64) {
    const __m256i a = LoadPlane(s + 32 * k), b = LoadPlane(s + n + 32 * k);
    const __m256i x[2] = {_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b)};
    StoreLanes<1>(d, x);
  }
}

void Unshuffle4(const unsigned char* s, size_t n, unsigned char* d, size_t steps) {
  for (size_t k = 0; k < steps; ++k, d += 128) {
    const unsigned char* p = s + 32 * k;
    const __m256i p0 = LoadPlane(p), p1 = LoadPlane(p + n);
    const __m256i p2 = LoadPlane(p + 2 * n), p3 = LoadPlane(p + 3 * n);
    const __m256i t0 = _mm256_unpacklo_epi8(p0, p1), t1 = _mm256_unpackhi_epi8(p0, p1);
    const __m256i t2 = _mm256_unpacklo_epi8(p2, p3), t3 = _mm256_unpackhi_epi8(p2, p3);
    const __m256i x[4] = {_mm256_unpacklo_epi16(t0, t2), _mm256_unpackhi_epi16(t0, t2),
                          _mm256_unpacklo_epi16(t1, t3), _mm256_unpackhi_epi16(t1, t3)};
    StoreLanes<2>(d, x);
  }
}

// Bytes 0..3 (or 4..7) of 32 elements as 4-byte groups, in the order
// [0..3|16..19], [4..7|20..23], [8..11|24..27], [12..15|28..31].
inline void Quads(const unsigned char* p, size_t n, __m256i* u) {
  const __m256i p0 = LoadPlane(p), p1 = LoadPlane(p + n);
  const __m256i p2 = LoadPlane(p + 2 * n), p3 = LoadPlane(p + 3 * n);
  const __m256i t0 = _mm256_unpacklo_epi8(p0, p1), t1 = _mm256_unpackhi_epi8(p0, p1);
  const __m256i t2 = _mm256_unpacklo_epi8(p2, p3), t3 = _mm256_unpackhi_epi8(p2, p3);
  u[0] = _mm256_unpacklo_epi16(t0, t2);
  u[1] = _mm256_unpackhi_epi16(t0, t2);
  u[2] = _mm256_unpacklo_epi16(t1, t3);
  u[3] = _mm256_unpackhi_epi16(t1, t3);
}

void Unshuffle8(const unsigned char* s, size_t n, unsigned char* d, size_t steps) {
  for (size_t k = 0; k < steps; ++k, d += 256) {
    __m256i u[4], v[4], x[8];
    Quads(s + 32 * k, n, u);
    Quads(s + 4 * n + 32 * k, n, v);
    for (int j = 0; j < 4; ++j) {
      x[2 * j] = _mm256_unpacklo_epi32(u[j], v[j]);
      x[2 * j + 1] = _mm256_unpackhi_epi32(u[j], v[j]);
    }
    StoreLanes<4>(d, x);
  }
}

}  // namespace

void Unshuffle(const void* src, size_t n, size_t elem_size, void* dst) {
  const unsigned char* s = Bytes(src);
  unsigned char* d = Bytes(dst);
  const size_t steps = n / 32;
  switch (elem_size) {
    case 2:
      Unshuffle2(s, n, d, steps);
      break;
    case 4:
      Unshuffle4(s, n, d, steps);
      break;
    case 8:
      Unshuffle8(s, n, d, steps);
      break;
    default:
      return UnshuffleScalar(src, n, elem_size, dst);
  }
  for (size_t b = 0; b < elem_size; ++b) {
    for (size_t i = steps * 32; i < n; ++i) d[i * elem_size + b] = s[b * n + i];
  }
}

}  // namespace flywheel::kernels::avx2
