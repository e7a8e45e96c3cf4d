// Private to the codec (encode.cc, container_parse.cc, apply.cc, codec_common.cc): the
// pieces the encoder and the decoder share. Not part of the public API; include
// delta/delta.h instead.
//
// Threading: the per-thread state here (zstd contexts, Scratch) lives in thread_local
// storage, so every function may be called from pool threads concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "base/status.h"
#include "delta/delta.h"
#include "checkpoint/hash.h"

namespace flywheel::delta::internal {

using ByteVec = std::vector<uint8_t>;

// 'name', for error messages.
std::string Quote(const std::string& name);

// XXH3-64 of a chunk payload or of the container's header and manifest.
uint64_t Checksum(std::span<const uint8_t> bytes);

// True when `stored` is not the checksum of `bytes`. Fuzzing builds (tests/fuzz/clang)
// never report a mismatch, so that mutated inputs reach the manifest parser and the chunk
// decoders instead of stopping at the first checksum.
bool ChecksumMismatch(uint64_t stored, std::span<const uint8_t> bytes);

// The declared changed words and raw and stored sizes of chunk `e` (words of `w` bytes)
// must be possible for its kind and word count, and within `limits` (container_parse.cc).
Status CheckChunkSizes(const std::string& where, const ChunkEntry& e, int w,
                       const DecodeLimits& limits);

inline const uint8_t* U8(std::span<const std::byte> s) {
  return reinterpret_cast<const uint8_t*>(s.data());
}
inline uint8_t* U8(std::span<std::byte> s) {
  return reinterpret_cast<uint8_t*>(s.data());
}

// ---- byte-plane shuffle (dense chunks) -----------------------------------------------

// dst[b*n+i] = src[i*w+b]: byte b of every word goes to plane b.
// REQUIRES: src holds n*w bytes, dst has room for n*w bytes.
void Shuffle(const uint8_t* src, size_t n, int w, uint8_t* dst);

// dst[i*w+b] = op(dst[i*w+b], src[b*n+i]): the inverse of Shuffle, combined with the
// existing bytes (overwrite for literal chunks, XOR for dense-xor chunks).
template <typename Op>
void Unshuffle(const uint8_t* src, size_t n, int w, uint8_t* dst, Op op) {
  for (int b = 0; b < w; ++b) {
    const uint8_t* plane = src + static_cast<size_t>(b) * n;
    for (size_t i = 0; i < n; ++i) dst[i * w + b] = op(dst[i * w + b], plane[i]);
  }
}

// ---- compressors ----------------------------------------------------------------------

// Compresses `raw` into `out`; returns false (and leaves `out` empty) when the result
// would not be smaller than the raw bytes, or when `compressor` is kNone.
bool Compress(Compressor compressor, int zstd_level, const ByteVec& raw, ByteVec* out);

// Corruption unless the zstd frame in `stored` declares exactly `raw_bytes` of content.
// Checked before any buffer of that size is allocated.
Status CheckZstdFrameSize(std::span<const uint8_t> stored, uint64_t raw_bytes);

// Decompresses exactly `raw_bytes` bytes into `dst` (kNone: copies). Corruption when the
// stored bytes do not decode to that size.
// REQUIRES: dst has room for raw_bytes bytes.
Status Decompress(Compressor compressor, std::span<const uint8_t> stored, uint64_t raw_bytes,
                  uint8_t* dst);

// ---- per-thread scratch ---------------------------------------------------------------

// The unsigned and signed integer of a word of W bytes.
template <int W>
struct WordOf {
  using U = std::conditional_t<
      W == 1, uint8_t,
      std::conditional_t<W == 2, uint16_t, std::conditional_t<W == 4, uint32_t, uint64_t>>>;
  using S = std::make_signed_t<U>;
};

// Buffers a chunk encode or decode needs, reused across chunks on one thread.
struct Scratch {
  std::vector<uint32_t> positions;
  std::vector<uint32_t> gaps;
  std::vector<uint64_t> z;
  ByteVec words_a, words_b;
  ByteVec raw, raw2, packed, packed2;
  // The context-coded chunk (context_coding.cc): ranks of every stream, the coding order
  // of the changes, each change's stream, the differences in coding order.
  std::vector<uint32_t> ranks, order;
  ByteVec contexts;
  std::vector<uint64_t> z2;
  std::vector<uint64_t> base_words;  // the base word of each changed word (encoder)
};
Scratch& ThreadScratch();

// Scratch only grows (shrinking and growing again would zero-fill the difference).
template <typename V>
void Grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// Pool threads live for the process: after an unusually large chunk, gives its scratch
// back instead of holding the peak forever.
void TrimScratch(Scratch& s);

// ---- hashing ----------------------------------------------------------------------------

// `given` when not empty (InvalidArgument unless it has one hash per tensor of `view`),
// else the tensor hashes of `view` computed on `threads` threads, largest tensor first.
// `role` ("base", "target", "state") names the checkpoint in errors.
Result<std::vector<Hash128>> HashesOrCompute(const CheckpointView& view,
                                             const std::vector<Hash128>& given, int threads,
                                             const char* role);

// InvalidArgument unless `threads` is in [1, kMaxThreads].
Status CheckThreads(int threads);

}  // namespace flywheel::delta::internal
