// ChunkChecksumsScalar: XXH3 built with its vector code disabled, the reference that the
// AVX2 build (checksum.cc) and the CUDA kernel are compared against.
//
// XXH_INLINE_ALL gives every XXH3 function internal linkage and an XXH_INLINE_ prefix,
// so this copy clashes neither with checksum.cc nor with the system libxxhash.
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_SCALAR
#include <xxhash.h>

#include "kernels/kernels.h"

namespace flywheel::kernels {

// A deliberate twin of avx2::ChunkChecksums (checksum.cc), line for line: the same loop
// over a different build of XXH3 (XXH_SCALAR here, -mavx2 there). A shared body would have
// to be compiled once per build anyway, and this file must stay free of AVX2 code.
size_t ChunkChecksumsScalar(const void* data, size_t size, size_t chunk_bytes, uint64_t* out) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  size_t chunks = 0;
  for (size_t offset = 0; offset < size; offset += chunk_bytes) {
    const size_t remaining = size - offset;
    const size_t length = remaining < chunk_bytes ? remaining : chunk_bytes;
    out[chunks++] = XXH3_64bits(bytes + offset, length);
  }
  return chunks;
}

}  // namespace flywheel::kernels
