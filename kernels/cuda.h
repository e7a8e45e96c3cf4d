// CUDA versions of the codec's hot loops. Compiled only when nvcc is present
// (FLYWHEEL_HAVE_CUDA); every entry point reports a missing device as a status instead
// of failing, so callers and tests can skip cleanly on machines without a GPU.
//
// Two sets of entry points with the same results, bit for bit, as the CPU kernels of the
// same name in kernels/kernels.h: host-memory conveniences (copy in, run, copy out) and
// device-memory entry points (`*OnDevice`) for data already on the GPU, which move nothing
// over PCIe but a count. The conveniences are built on the device entry points.
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

// ---------------------------------------------------------------------------------------
// Host-memory conveniences: copy in, run on the device, copy out. Same contracts as the
// CPU kernels of the same name in kernels/kernels.h.

Result<size_t> CompareCompact(const void* base, const void* target, size_t n, size_t elem_size,
                              uint32_t* out_positions);
// Every position is checked against dst_elements before anything runs; on
// InvalidArgument `dst` is untouched.
Status ScatterApply(void* dst, size_t dst_elements, size_t elem_size, const uint32_t* positions,
                    const void* values, size_t count);
Status ChunkChecksums(const void* data, size_t size, size_t chunk_bytes, uint64_t* out);

// ---------------------------------------------------------------------------------------
// Device memory.

// One cudaMalloc allocation on the current device, freed on destruction. Move-only.
class DeviceBuffer {
 public:
  // Unavailable without a usable device; ResourceExhausted when the device is out of
  // memory. A zero-byte buffer still has a valid, non-null pointer.
  static Result<DeviceBuffer> Allocate(size_t bytes);

  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  template <typename T>
  T* As() const {
    return static_cast<T*>(ptr_);
  }

  // Synchronous copies of `bytes` bytes at byte `offset` of this buffer.
  // InvalidArgument when offset + bytes > size().
  Status CopyFromHost(const void* host, size_t bytes, size_t offset = 0);
  Status CopyToHost(void* host, size_t bytes, size_t offset = 0) const;

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// ---------------------------------------------------------------------------------------
// Device-memory entry points. Every pointer below is device memory (a DeviceBuffer or
// cudaMalloc); element arrays must be aligned to their element size. Each call runs its
// kernels on the legacy default stream and returns after they have finished, so a caller
// may time it with events recorded on that stream around the call. Launch failures and
// faults inside a kernel come back as Internal (or Unavailable when the device cannot run
// this build's code), naming the kernel.

// Bytes of device scratch CompareCompactOnDevice needs for n elements: a bitmap of the
// changed elements (n/8 bytes) and per-2048-element tile counts and offsets (12 bytes per
// tile), about 0.131 bytes per element. (0 in a build without CUDA.)
size_t CompareCompactScratchBytes(size_t n);

// CompareCompact on device memory: writes, in ascending order, the index of every changed
// element into out_positions and returns how many changed. Reads base and target once.
// When more than `positions_capacity` elements changed, returns ResourceExhausted with
// the count in the message, and out_positions holds the first positions_capacity of them.
// REQUIRES: n <= 2^32 (else InvalidArgument); out_positions has room for
// positions_capacity entries; scratch holds scratch_bytes >= CompareCompactScratchBytes(n)
// bytes (else InvalidArgument) and is 256-byte aligned (cudaMalloc's pointers are).
// Scratch contents on entry do not matter.
Result<size_t> CompareCompactOnDevice(const void* base, const void* target, size_t n,
                                      size_t elem_size, uint32_t* out_positions,
                                      size_t positions_capacity, void* scratch,
                                      size_t scratch_bytes);

// ScatterApply on device memory: element positions[i] of dst gets element i of values.
// Positions are checked on the device as they are used: an entry whose position is
// >= dst_elements is never written, and the call returns InvalidArgument naming the first
// such entry (the in-range entries have been applied by then: treat dst as garbage).
// REQUIRES: positions distinct (duplicates race: either value may win).
Status ScatterApplyOnDevice(void* dst, size_t dst_elements, size_t elem_size,
                            const uint32_t* positions, const void* values, size_t count);

// ChunkChecksums on device memory: out[k] = XXH3_64(data + k*chunk_bytes, ...) for the
// ceil(size / chunk_bytes) chunks, the last possibly shorter. One thread per chunk, so it
// needs tens of thousands of chunks to keep the device busy.
// REQUIRES: chunk_bytes > 0 (else InvalidArgument); out has room for the chunks.
Status ChunkChecksumsOnDevice(const void* data, size_t size, size_t chunk_bytes, uint64_t* out);

}  // namespace flywheel::kernels::cuda
