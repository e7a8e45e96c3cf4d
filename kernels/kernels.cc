// Scalar references of the codec's hot loops, and the run-time dispatch to the AVX2
// versions (kernels_avx2.cc, checksum.cc). The references are deliberately plain: one
// memcmp/memcpy per element, so that they are obviously correct.
#include "kernels/kernels.h"

#include <cstring>

namespace flywheel::kernels {

// Defined in kernels_avx2.cc and checksum.cc, the only files compiled for AVX2.
// REQUIRES: HaveAvx2(); elem_size is 1, 2, 4 or 8.
namespace avx2 {
size_t CompareCompact(const void* base, const void* target, size_t n, size_t elem_size,
                      uint32_t* out_positions);
size_t CountChanged(const void* base, const void* target, size_t n, size_t elem_size);
void ScatterApply(void* dst, size_t elem_size, const uint32_t* positions, const void* values,
                  size_t count);
void Gather(const void* src, size_t elem_size, const uint32_t* positions, void* out, size_t count);
size_t ChunkChecksums(const void* data, size_t size, size_t chunk_bytes, uint64_t* out);
void Unshuffle(const void* src, size_t n, size_t elem_size, void* dst);
size_t SelectBucketed(const void* base, size_t n, size_t elem_size, const BucketContext& context,
                      const BucketStream* streams, size_t stream_count, uint32_t* out_positions,
                      uint8_t* out_stream, size_t max_out, uint64_t* words_in_stream);
size_t RankBucketed(const void* base, size_t n, size_t elem_size, const BucketContext& context,
                    const uint8_t* stream_buckets, size_t stream_count, const uint32_t* positions,
                    size_t m, uint32_t* out_order, uint8_t* out_stream, uint32_t* const* ranks,
                    uint64_t* words_in_stream);
}  // namespace avx2

bool HaveAvx2() {
  // kernels_avx2.cc is also built with -mbmi -mbmi2 -mpopcnt, so the compiler
  // may use any of those instructions there; all of them must be present. libgcc's
  // "avx2" check includes the OS saving YMM state (XGETBV).
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
                           __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
  return have;
}

size_t CompareCompactScalar(const void* base, const void* target, size_t n, size_t elem_size,
                            uint32_t* out_positions) {
  const auto* a = static_cast<const unsigned char*>(base);
  const auto* b = static_cast<const unsigned char*>(target);
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i * elem_size, b + i * elem_size, elem_size) != 0) {
      out_positions[count++] = static_cast<uint32_t>(i);
    }
  }
  return count;
}

size_t CountChangedScalar(const void* base, const void* target, size_t n, size_t elem_size) {
  const auto* a = static_cast<const unsigned char*>(base);
  const auto* b = static_cast<const unsigned char*>(target);
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    count += std::memcmp(a + i * elem_size, b + i * elem_size, elem_size) != 0;
  }
  return count;
}

void ScatterApplyScalar(void* dst, size_t elem_size, const uint32_t* positions, const void* values,
                        size_t count) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* v = static_cast<const unsigned char*>(values);
  for (size_t i = 0; i < count; ++i) {
    std::memcpy(d + size_t{positions[i]} * elem_size, v + i * elem_size, elem_size);
  }
}

void GatherScalar(const void* src, size_t elem_size, const uint32_t* positions, void* out,
                  size_t count) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* o = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < count; ++i) {
    std::memcpy(o + i * elem_size, s + size_t{positions[i]} * elem_size, elem_size);
  }
}

namespace {

// The AVX2 code is specialised for the four element sizes of the format; anything else
// (a programmer error upstream) still gets the right answer from the reference.
bool UseAvx2(size_t elem_size) {
  return (elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8) && HaveAvx2();
}

}  // namespace

size_t CompareCompact(const void* base, const void* target, size_t n, size_t elem_size,
                      uint32_t* out_positions) {
  if (UseAvx2(elem_size)) return avx2::CompareCompact(base, target, n, elem_size, out_positions);
  return CompareCompactScalar(base, target, n, elem_size, out_positions);
}

size_t CountChanged(const void* base, const void* target, size_t n, size_t elem_size) {
  if (UseAvx2(elem_size)) return avx2::CountChanged(base, target, n, elem_size);
  return CountChangedScalar(base, target, n, elem_size);
}

void ScatterApply(void* dst, size_t elem_size, const uint32_t* positions, const void* values,
                  size_t count) {
  if (UseAvx2(elem_size)) return avx2::ScatterApply(dst, elem_size, positions, values, count);
  ScatterApplyScalar(dst, elem_size, positions, values, count);
}

void Gather(const void* src, size_t elem_size, const uint32_t* positions, void* out, size_t count) {
  if (UseAvx2(elem_size)) return avx2::Gather(src, elem_size, positions, out, count);
  GatherScalar(src, elem_size, positions, out, count);
}

size_t ChunkChecksums(const void* data, size_t size, size_t chunk_bytes, uint64_t* out) {
  if (HaveAvx2()) return avx2::ChunkChecksums(data, size, chunk_bytes, out);
  return ChunkChecksumsScalar(data, size, chunk_bytes, out);
}

void UnshuffleScalar(const void* src, size_t n, size_t elem_size, void* dst) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (size_t b = 0; b < elem_size; ++b) {
    const unsigned char* plane = s + b * n;
    for (size_t i = 0; i < n; ++i) d[i * elem_size + b] = plane[i];
  }
}

void Unshuffle(const void* src, size_t n, size_t elem_size, void* dst) {
  if (elem_size == 1) return void(n == 0 ? dst : std::memcpy(dst, src, n));
  if (UseAvx2(elem_size)) return avx2::Unshuffle(src, n, elem_size, dst);
  UnshuffleScalar(src, n, elem_size, dst);
}

void ScatterAddZigZagScalar(void* dst, size_t elem_size, const uint32_t* positions,
                            const uint64_t* zigzag_diffs, size_t count, void* old_values) {
  auto* d = static_cast<unsigned char*>(dst);
  auto* old = static_cast<unsigned char*>(old_values);
  for (size_t i = 0; i < count; ++i) {
    unsigned char* p = d + size_t{positions[i]} * elem_size;
    if (old) std::memcpy(old + i * elem_size, p, elem_size);
    uint64_t value = 0;
    for (size_t b = 0; b < elem_size; ++b) value |= uint64_t{p[b]} << (8 * b);
    const uint64_t z = zigzag_diffs[i];
    value += (z >> 1) ^ (~(z & 1) + 1);
    for (size_t b = 0; b < elem_size; ++b) p[b] = static_cast<unsigned char>(value >> (8 * b));
  }
}

namespace {

// One fixed-size load/add/store per element, unrolled by four. Not SIMD: AVX2 has no
// scatter, and the positions are data dependent.
template <typename Word, bool kKeepOld>
void ScatterAddZigZagT(unsigned char* d, const uint32_t* positions, const uint64_t* z, size_t count,
                       unsigned char* old) {
  auto add = [&](size_t i) {
    unsigned char* p = d + size_t{positions[i]} * sizeof(Word);
    Word value;
    std::memcpy(&value, p, sizeof(Word));
    if constexpr (kKeepOld) std::memcpy(old + i * sizeof(Word), &value, sizeof(Word));
    value = static_cast<Word>(value + static_cast<Word>((z[i] >> 1) ^ (~(z[i] & 1) + 1)));
    std::memcpy(p, &value, sizeof(Word));
  };
  size_t i = 0;
  for (; i + 4 <= count; i += 4) {
    add(i);
    add(i + 1);
    add(i + 2);
    add(i + 3);
  }
  for (; i < count; ++i) add(i);
}

}  // namespace

template <typename Word>
void ScatterAddZigZagW(unsigned char* d, const uint32_t* positions, const uint64_t* z, size_t count,
                       unsigned char* old) {
  if (old) return ScatterAddZigZagT<Word, true>(d, positions, z, count, old);
  ScatterAddZigZagT<Word, false>(d, positions, z, count, nullptr);
}

void ScatterAddZigZag(void* dst, size_t elem_size, const uint32_t* positions,
                      const uint64_t* zigzag_diffs, size_t count, void* old_values) {
  auto* d = static_cast<unsigned char*>(dst);
  auto* old = static_cast<unsigned char*>(old_values);
  switch (elem_size) {
    case 1:
      return ScatterAddZigZagW<uint8_t>(d, positions, zigzag_diffs, count, old);
    case 2:
      return ScatterAddZigZagW<uint16_t>(d, positions, zigzag_diffs, count, old);
    case 4:
      return ScatterAddZigZagW<uint32_t>(d, positions, zigzag_diffs, count, old);
    case 8:
      return ScatterAddZigZagW<uint64_t>(d, positions, zigzag_diffs, count, old);
    default:
      return ScatterAddZigZagScalar(dst, elem_size, positions, zigzag_diffs, count, old_values);
  }
}

// ---- context buckets ------------------------------------------------------------------

namespace {

#include "kernels/bucket_walk_impl.h"

// The reference operations: one word at a time, bit by bit.
struct ScalarOps {
  static void Buckets(const unsigned char* base, size_t begin, size_t len, size_t elem_size,
                      const BucketContext& context, uint8_t* out) {
    for (size_t j = 0; j < len; ++j) {
      uint64_t word = 0;
      std::memcpy(&word, base + (begin + j) * elem_size, elem_size);  // little-endian
      out[j] = static_cast<uint8_t>(BucketOf(word, context));
    }
  }
  static uint64_t Mask64(const uint8_t* bytes, uint8_t bucket) {
    uint64_t mask = 0;
    for (int j = 0; j < 64; ++j) mask |= uint64_t{bytes[j] == bucket} << j;
    return mask;
  }
  static int Popcount(uint64_t x) {
    int bits = 0;
    for (; x; x &= x - 1) ++bits;
    return bits;
  }
  // The bit of the rank-th (from 0) set bit of mask. REQUIRES: rank < Popcount(mask).
  static uint64_t SelectBit(uint64_t mask, int rank) {
    for (int k = 0; k < rank; ++k) mask &= mask - 1;
    return mask & (~mask + 1);
  }
};

}  // namespace

size_t SelectBucketedScalar(const void* base, size_t n, size_t elem_size,
                            const BucketContext& context, const BucketStream* streams,
                            size_t stream_count, uint32_t* out_positions, uint8_t* out_stream,
                            size_t max_out, uint64_t* words_in_stream) {
  return SelectBucketedWalk<ScalarOps>(static_cast<const unsigned char*>(base), n, elem_size,
                                       context, streams, stream_count, out_positions, out_stream,
                                       max_out, words_in_stream);
}

size_t RankBucketedScalar(const void* base, size_t n, size_t elem_size,
                          const BucketContext& context, const uint8_t* stream_buckets,
                          size_t stream_count, const uint32_t* positions, size_t m,
                          uint32_t* out_order, uint8_t* out_stream, uint32_t* const* ranks,
                          uint64_t* words_in_stream) {
  return RankBucketedWalk<ScalarOps>(static_cast<const unsigned char*>(base), n, elem_size,
                                     context, stream_buckets, stream_count, positions, m,
                                     out_order, out_stream, ranks, words_in_stream);
}

size_t SelectBucketed(const void* base, size_t n, size_t elem_size, const BucketContext& context,
                      const BucketStream* streams, size_t stream_count, uint32_t* out_positions,
                      uint8_t* out_stream, size_t max_out, uint64_t* words_in_stream) {
  if (UseAvx2(elem_size)) {
    return avx2::SelectBucketed(base, n, elem_size, context, streams, stream_count,
                                out_positions, out_stream, max_out, words_in_stream);
  }
  return SelectBucketedScalar(base, n, elem_size, context, streams, stream_count, out_positions,
                              out_stream, max_out, words_in_stream);
}

size_t RankBucketed(const void* base, size_t n, size_t elem_size, const BucketContext& context,
                    const uint8_t* stream_buckets, size_t stream_count, const uint32_t* positions,
                    size_t m, uint32_t* out_order, uint8_t* out_stream, uint32_t* const* ranks,
                    uint64_t* words_in_stream) {
  if (UseAvx2(elem_size)) {
    return avx2::RankBucketed(base, n, elem_size, context, stream_buckets, stream_count,
                              positions, m, out_order, out_stream, ranks, words_in_stream);
  }
  return RankBucketedScalar(base, n, elem_size, context, stream_buckets, stream_count, positions,
                            m, out_order, out_stream, ranks, words_in_stream);
}

}  // namespace flywheel::kernels
