#include "checkpoint/tensor.h"

#include <array>
#include <numeric>
#include <string>

namespace flywheel {
namespace {

struct DTypeInfo {
  const char* name;
  int bits;
};

// Indexed by the DType value.
constexpr std::array<DTypeInfo, kNumDTypes> kDTypes = {{
    {"BOOL", 8},    {"U8", 8},   {"I8", 8},   {"F8_E5M2", 8}, {"F8_E4M3", 8},
    {"F8_E8M0", 8}, {"I16", 16}, {"U16", 16}, {"F16", 16},    {"BF16", 16},
    {"I32", 32},    {"U32", 32}, {"F32", 32}, {"F64", 64},    {"I64", 64},
    {"U64", 64},    {"C64", 64}, {"F4", 4},   {"F6_E2M3", 6}, {"F6_E3M2", 6},
}};

const DTypeInfo* Info(DType dtype) {
  const auto index = static_cast<size_t>(dtype);
  return index < kDTypes.size() ? &kDTypes[index] : nullptr;
}

}  // namespace

std::string ShapeString(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

const char* DTypeName(DType dtype) {
  const DTypeInfo* info = Info(dtype);
  return info ? info->name : nullptr;
}

std::optional<DType> ParseDType(std::string_view name) {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (name == kDTypes[i].name) return static_cast<DType>(i);
  }
  return std::nullopt;
}

int DTypeBits(DType dtype) {
  const DTypeInfo* info = Info(dtype);
  return info ? info->bits : 0;
}

int DTypeWordBytes(DType dtype) {
  const int bits = DTypeBits(dtype);
  return bits < 8 ? 1 : bits / 8;
}

Result<uint64_t> ElementCount(std::span<const int64_t> shape) {
  uint64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) {
      return Status::InvalidArgument("negative dimension " + std::to_string(dim) + " in shape " +
                                     ShapeString(shape));
    }
  }
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(dim), &count)) {
      return Status::InvalidArgument("element count of shape " + ShapeString(shape) +
                                     " overflows 64 bits");
    }
  }
  return count;
}

Result<uint64_t> TensorByteSize(DType dtype, std::span<const int64_t> shape) {
  const int bits = DTypeBits(dtype);
  if (bits == 0) {
    return Status::InvalidArgument("unknown dtype value " +
                                   std::to_string(static_cast<int>(dtype)));
  }
  FW_ASSIGN_OR_RETURN(const uint64_t count, ElementCount(shape));
  // count * bits / 8 without forming count * bits, which may overflow even when the byte
  // count fits: elements come in groups of 8/g that fill bits/g whole bytes.
  const uint64_t common = std::gcd(static_cast<uint64_t>(bits), uint64_t{8});
  const uint64_t elements_per_group = 8 / common;
  const uint64_t bytes_per_group = static_cast<uint64_t>(bits) / common;
  if (count % elements_per_group != 0) {
    return Status::InvalidArgument(std::string(DTypeName(dtype)) + " tensor of shape " +
                                   ShapeString(shape) + " has " + std::to_string(count) +
                                   " elements of " + std::to_string(bits) +
                                   " bits, which do not fill whole bytes");
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count / elements_per_group, bytes_per_group, &bytes)) {
    return Status::InvalidArgument("byte size of " + std::string(DTypeName(dtype)) + " " +
                                   ShapeString(shape) + " overflows 64 bits");
  }
  return bytes;
}

CheckpointView OwnedCheckpoint::view() const {
  CheckpointView views;
  views.reserve(tensors.size());
  for (const OwnedTensor& tensor : tensors) {
    views.push_back({tensor.name, tensor.dtype, tensor.shape, tensor.data});
  }
  return views;
}

MutableCheckpointView OwnedCheckpoint::mutable_view() {
  MutableCheckpointView views;
  views.reserve(tensors.size());
  for (OwnedTensor& tensor : tensors) {
    views.push_back({tensor.name, tensor.dtype, tensor.shape, tensor.data});
  }
  return views;
}

}  // namespace flywheel
