// CUDA versions of the codec's hot loops. Compiled only when nvcc is present
// (FLYWHEEL_HAVE_CUDA); every entry point reports a missing device as a status instead
// of failing, so callers and tests can skip cleanly on machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/status.h"

namespace flywheel::kernels::cuda {

// True when this build has CUDA kernels and a CUDA device is usable.
bool Available();
// A one-line description of why Available() is false (or the device name when true).
std::string DeviceDescription();

// Host-memory conveniences: copy in, run on the device, copy out. Same contracts as the
// CPU kernels of the same name in kernels/kernels.h.
Result<size_t> CompareCompact(const void* base, const void* target, size_t n, size_t elem_size,
                              uint32_t* out_positions);
Status ScatterApply(void* dst, size_t dst_elements, size_t elem_size, const uint32_t* positions,
                    const void* values, size_t count);
Status ChunkChecksums(const void* data, size_t size, size_t chunk_bytes, uint64_t* out);

}  // namespace flywheel::kernels::cuda
