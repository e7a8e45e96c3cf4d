// A byte buffer that grows in place: its address never changes, so readers may keep
// pointers into the bytes already written while a single writer appends more (an artifact
// that is still being encoded or still arriving piece by piece).
//
// The whole capacity is reserved as address space up front (an anonymous private mapping
// without swap reservation); pages become memory only when written. The bytes between
// size() and capacity() read as zero.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "base/status.h"

namespace flywheel {

class GrowableBytes {
 public:
  // Reserves `capacity` bytes (at least 1 page is mapped even for 0). ResourceExhausted
  // when the address space cannot be reserved.
  static Result<std::shared_ptr<GrowableBytes>> Create(uint64_t capacity);
  ~GrowableBytes();
  GrowableBytes(const GrowableBytes&) = delete;
  GrowableBytes& operator=(const GrowableBytes&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  // Bytes written so far: readers on other threads see at least the bytes below the size
  // they read (release/acquire).
  uint64_t size() const { return size_.load(std::memory_order_acquire); }
  uint64_t capacity() const { return capacity_; }
  std::span<const std::byte> bytes() const { return {data_, size()}; }
  std::span<std::byte> mutable_bytes() { return {data_, size()}; }

  // Writer side (one writer at a time). Append copies `bytes` after the current end;
  // Resize moves the end (bytes past the old end are whatever was written there, zero if
  // nothing was). Both refuse to pass the capacity (ResourceExhausted).
  Status Append(std::span<const std::byte> bytes);
  Status Resize(uint64_t size);

 private:
  GrowableBytes(std::byte* data, uint64_t capacity, uint64_t mapped)
      : data_(data), capacity_(capacity), mapped_(mapped) {}
  std::byte* data_;
  uint64_t capacity_;
  uint64_t mapped_;
  std::atomic<uint64_t> size_{0};
};

}  // namespace flywheel
