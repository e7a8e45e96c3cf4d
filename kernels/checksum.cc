// ChunkChecksums with the AVX2 build of XXH3. This file is compiled with -mavx2 and is
// called only when HaveAvx2() (dispatch in kernels.cc; it must not live here, where the
// compiler may use AVX2 anywhere).
//
// XXH_INLINE_ALL gives every XXH3 function internal linkage and an XXH_INLINE_ prefix,
// so this copy clashes neither with checksum_scalar.cc nor with the system libxxhash.
#ifndef __AVX2__
#error "checksum.cc must be compiled with -mavx2 (see kernels/CMakeLists.txt)"
#endif
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace flywheel::kernels::avx2 {

// REQUIRES: chunk_bytes > 0.
// A deliberate twin of ChunkChecksumsScalar (checksum_scalar.cc), line for line: the two
// loops are the same C++ compiled against two builds of XXH3 (AVX2 here, scalar there), so
// they cannot share a body without one build's code leaking into the other's file.
size_t ChunkChecksums(const void* data, size_t size, size_t chunk_bytes, uint64_t* out) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  size_t chunks = 0;
  for (size_t offset = 0; offset < size; offset += chunk_bytes) {
    const size_t remaining = size - offset;
    const size_t length = remaining < chunk_bytes ? remaining : chunk_bytes;
    out[chunks++] = XXH3_64bits(bytes + offset, length);
  }
  return chunks;
}

}  // namespace flywheel::kernels::avx2
