// kernels/cuda.h for builds without nvcc (or with FLYWHEEL_CUDA=OFF): nothing is
// available, and every call says so instead of failing differently.
#include <string>

#include "kernels/cuda.h"

namespace flywheel::kernels::cuda {
namespace {

constexpr const char* kWhy = "built without CUDA (nvcc not found or FLYWHEEL_CUDA=OFF)";

Status NotBuilt(const char* what) {
  return Status::Unavailable(std::string(what) + ": " + kWhy);
}

}  // namespace

bool Available() {
  return false;
}

std::string DeviceDescription() {
  return kWhy;
}

Result<size_t> CompareCompact(const void*, const void*, size_t, size_t, uint32_t*) {
  return NotBuilt("cuda::CompareCompact");
}

Status ScatterApply(void*, size_t, size_t, const uint32_t*, const void*, size_t) {
  return NotBuilt("cuda::ScatterApply");
}

Status ChunkChecksums(const void*, size_t, size_t, uint64_t*) {
  return NotBuilt("cuda::ChunkChecksums");
}

Result<DeviceBuffer> DeviceBuffer::Allocate(size_t) {
  return NotBuilt("cuda::DeviceBuffer::Allocate");
}

// No DeviceBuffer ever holds memory here: Allocate is the only way to get some.
DeviceBuffer::DeviceBuffer(DeviceBuffer&&) noexcept {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&&) noexcept {
  return *this;
}

DeviceBuffer::~DeviceBuffer() = default;

Status DeviceBuffer::CopyFromHost(const void*, size_t, size_t) {
  return NotBuilt("cuda::DeviceBuffer::CopyFromHost");
}

Status DeviceBuffer::CopyToHost(void*, size_t, size_t) const {
  return NotBuilt("cuda::DeviceBuffer::CopyToHost");
}

size_t CompareCompactScratchBytes(size_t) {
  return 0;
}

Result<size_t> CompareCompactOnDevice(const void*, const void*, size_t, size_t, uint32_t*, size_t,
                                      void*, size_t) {
  return NotBuilt("cuda::CompareCompactOnDevice");
}

Status ScatterApplyOnDevice(void*, size_t, size_t, const uint32_t*, const void*, size_t) {
  return NotBuilt("cuda::ScatterApplyOnDevice");
}

Status ChunkChecksumsOnDevice(const void*, size_t, size_t, uint64_t*) {
  return NotBuilt("cuda::ChunkChecksumsOnDevice");
}

}  // namespace flywheel::kernels::cuda
