#include "base/growable_bytes.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

namespace flywheel {

Result<std::shared_ptr<GrowableBytes>> GrowableBytes::Create(uint64_t capacity) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  if (capacity > (uint64_t{1} << 46)) {
    return Status::ResourceExhausted("cannot reserve " + std::to_string(capacity) +
                                     " bytes of address space (over 64 TiB)");
  }
  const uint64_t mapped = std::max<uint64_t>(page, (capacity + page - 1) / page * page);
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return Status::ResourceExhausted("cannot reserve " + std::to_string(capacity) +
                                     " bytes of address space: " + std::strerror(errno));
  }
  return std::shared_ptr<GrowableBytes>(
      new GrowableBytes(static_cast<std::byte*>(p), capacity, mapped));
}

GrowableBytes::~GrowableBytes() { ::munmap(data_, mapped_); }

Status GrowableBytes::Append(std::span<const std::byte> bytes) {
  const uint64_t size = size_.load(std::memory_order_relaxed);
  if (bytes.size() > capacity_ - size) {
    return Status::ResourceExhausted("buffer of " + std::to_string(capacity_) +
                                     " bytes cannot take " + std::to_string(bytes.size()) +
                                     " more after " + std::to_string(size));
  }
  if (!bytes.empty()) std::memcpy(data_ + size, bytes.data(), bytes.size());
  size_.store(size + bytes.size(), std::memory_order_release);
  return Status::Ok();
}

Status GrowableBytes::Resize(uint64_t size) {
  if (size > capacity_) {
    return Status::ResourceExhausted("buffer of " + std::to_string(capacity_) +
                                     " bytes cannot grow to " + std::to_string(size));
  }
  size_.store(size, std::memory_order_release);
  return Status::Ok();
}

}  // namespace flywheel
