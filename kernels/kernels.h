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

// True when the vectorised paths above run AVX2 code on this CPU.
bool HaveAvx2();

}  // namespace flywheel::kernels
