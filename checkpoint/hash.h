// Content hashes. A tensor's hash is XXH3-128 of its raw bytes. A checkpoint's hash is
// XXH3-128 of a canonical record of all its tensors sorted by name, so it depends only
// on names, dtypes, shapes and bytes: not on the order of tensors in a file, on header
// formatting, or on how the checkpoint is sharded.
//
// Canonical record, per tensor in ascending byte-wise name order (all integers LE):
//   u32 name_length, name bytes, u8 dtype (DType value), u32 rank, i64 dims[rank],
//   u64 byte_size, 16 bytes tensor hash (low 64 bits first, then high).
// preceded by the 8 bytes "FWCKPT1\0" and u64 tensor_count.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "checkpoint/tensor.h"

namespace flywheel {

struct Hash128 {
  uint64_t low = 0;
  uint64_t high = 0;

  bool operator==(const Hash128&) const = default;
  // 32 lowercase hex digits, high half first (as XXH128 canonical form prints).
  std::string ToHex() const;
  static Result<Hash128> FromHex(std::string_view hex);
};

Hash128 HashBytes(std::span<const std::byte> bytes);

// XXH3-128 of bytes fed in pieces: Finish() equals HashBytes of their concatenation.
// Lets a pass that reads a tensor block by block hash it while the block is in cache.
class StreamingHash {
 public:
  StreamingHash();
  ~StreamingHash();
  StreamingHash(const StreamingHash&) = delete;
  StreamingHash& operator=(const StreamingHash&) = delete;
  void Update(const void* data, size_t size);
  Hash128 Finish();

 private:
  void* state_;  // XXH3_state_t
};
uint64_t HashBytes64(std::span<const std::byte> bytes);
inline Hash128 TensorHash(const TensorView& tensor) {
  return HashBytes(tensor.data);
}

// Checkpoint hash from already computed per-tensor hashes (`tensor_hashes[i]` belongs to
// `tensors[i]`). Fails on duplicate names.
Result<Hash128> CheckpointHashFromTensorHashes(const CheckpointView& tensors,
                                               std::span<const Hash128> tensor_hashes);
// Hashes every tensor with up to `threads` threads, then combines.
Result<Hash128> CheckpointHash(const CheckpointView& tensors, int threads = 1);

}  // namespace flywheel
