// Tensor views: the vocabulary the codec, the file adapters and (later) the trainer and
// workers share. A view never owns memory; whoever made it keeps the bytes alive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel {

// Every dtype of the safetensors spec. Values are stable: they are written into the
// delta container's manifest (see delta/format.h).
enum class DType : uint8_t {
  kBool = 0,
  kU8 = 1,
  kI8 = 2,
  kF8_E5M2 = 3,
  kF8_E4M3 = 4,
  kF8_E8M0 = 5,
  kI16 = 6,
  kU16 = 7,
  kF16 = 8,
  kBF16 = 9,
  kI32 = 10,
  kU32 = 11,
  kF32 = 12,
  kF64 = 13,
  kI64 = 14,
  kU64 = 15,
  kC64 = 16,      // complex64: two f32
  kF4 = 17,       // float4 e2m1, packed two per byte
  kF6_E2M3 = 18,  // float6, packed
  kF6_E3M2 = 19,  // float6, packed
};
inline constexpr int kNumDTypes = 20;

// The safetensors spelling ("BF16"), or nullptr for an out-of-range value.
const char* DTypeName(DType dtype);
// "[2, 3]": a shape as error messages print it.
std::string ShapeString(std::span<const int64_t> shape);
// Parses the safetensors spelling; nullopt for an unknown name.
std::optional<DType> ParseDType(std::string_view name);
// Size of one element in bits (4, 6, 8, 16, 32, 64 or 128).
int DTypeBits(DType dtype);
// The unit the codec diffs in: the element size in bytes (1, 2, 4, 8). Sub-byte dtypes
// are diffed byte by byte; C64 as 8-byte words.
int DTypeWordBytes(DType dtype);

// Number of elements of `shape` (1 for rank 0), or an error on negative dims / overflow.
Result<uint64_t> ElementCount(std::span<const int64_t> shape);
// Bytes that `shape` of `dtype` occupies, with overflow and sub-byte alignment checks.
Result<uint64_t> TensorByteSize(DType dtype, std::span<const int64_t> shape);

struct TensorView {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;
};

struct MutableTensorView {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::span<std::byte> data;

  TensorView view() const { return {name, dtype, shape, data}; }
};

// A checkpoint is a list of named tensors (order carries no meaning for hashing).
using CheckpointView = std::vector<TensorView>;
using MutableCheckpointView = std::vector<MutableTensorView>;

// Owns the bytes of a checkpoint in memory (tests, benchmarks, in-process trainers).
struct OwnedTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;
};
struct OwnedCheckpoint {
  std::vector<OwnedTensor> tensors;

  CheckpointView view() const;
  MutableCheckpointView mutable_view();
};

}  // namespace flywheel
