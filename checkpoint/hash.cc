#include "checkpoint/hash.h"

#include <xxhash.h>
// Run-time dispatch to the AVX2/AVX-512 builds of XXH3 in Debian's libxxhash.
#include <xxh_x86dispatch.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <numeric>

#include "base/hex.h"
#include "checkpoint/parallel.h"

namespace flywheel {

std::string Hash128::ToHex() const { return Hex64(high) + Hex64(low); }

Result<Hash128> Hash128::FromHex(std::string_view hex) {
  if (hex.size() != 32) {
    return Status::InvalidArgument("hash must be 32 hex digits, got " + std::to_string(hex.size()) +
                                   " characters");
  }
  Result<uint64_t> high = HexDecode64(hex.substr(0, 16));
  Result<uint64_t> low = HexDecode64(hex.substr(16));
  if (!high.ok()) return high.status().WithContext("hash");
  if (!low.ok()) return low.status().WithContext("hash (low half)");
  return Hash128{*low, *high};
}

Hash128 HashBytes(std::span<const std::byte> bytes) {
  XXH128_hash_t h = XXH3_128bits_dispatch(bytes.data(), bytes.size());
  return {h.low64, h.high64};
}

StreamingHash::StreamingHash() : state_(XXH3_createState()) {
  if (state_ == nullptr) throw std::bad_alloc();
  XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_));
}
StreamingHash::~StreamingHash() {
  XXH3_freeState(static_cast<XXH3_state_t*>(state_));
}
void StreamingHash::Update(const void* data, size_t size) {
  if (size > 0) XXH3_128bits_update_dispatch(static_cast<XXH3_state_t*>(state_), data, size);
}
Hash128 StreamingHash::Finish() {
  XXH128_hash_t h = XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_));
  return {h.low64, h.high64};
}

uint64_t HashBytes64(std::span<const std::byte> bytes) {
  return XXH3_64bits_dispatch(bytes.data(), bytes.size());
}

namespace {
void PutU32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
}  // namespace

Result<Hash128> CheckpointHashFromTensorHashes(const CheckpointView& tensors,
                                               std::span<const Hash128> tensor_hashes) {
  if (tensor_hashes.size() != tensors.size()) {
    return Status::InvalidArgument("checkpoint hash: " + std::to_string(tensor_hashes.size()) +
                                   " tensor hashes for " + std::to_string(tensors.size()) +
                                   " tensors");
  }
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors[a].name < tensors[b].name; });
  std::string record("FWCKPT1", 8);
  PutU64(record, tensors.size());
  for (size_t k = 0; k < order.size(); ++k) {
    const TensorView& t = tensors[order[k]];
    if (k > 0 && tensors[order[k - 1]].name == t.name) {
      return Status::InvalidArgument("checkpoint has two tensors named '" + t.name + "'");
    }
    PutU32(record, static_cast<uint32_t>(t.name.size()));
    record += t.name;
    record.push_back(static_cast<char>(t.dtype));
    PutU32(record, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) PutU64(record, static_cast<uint64_t>(d));
    PutU64(record, t.data.size());
    PutU64(record, tensor_hashes[order[k]].low);
    PutU64(record, tensor_hashes[order[k]].high);
  }
  XXH128_hash_t h = XXH3_128bits(record.data(), record.size());
  return Hash128{h.low64, h.high64};
}

Result<Hash128> CheckpointHash(const CheckpointView& tensors, int threads) {
  std::vector<Hash128> hashes(tensors.size());
  // Biggest tensors first so that threads finish together.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors[a].data.size() > tensors[b].data.size(); });
  ParallelFor(order.size(), threads,
              [&](size_t k) { hashes[order[k]] = TensorHash(tensors[order[k]]); });
  return CheckpointHashFromTensorHashes(tensors, hashes);
}

}  // namespace flywheel
