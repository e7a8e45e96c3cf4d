// Packed frozen weights: a projection weight that is never trained (a MoE expert under LoRA)
// stored in a low-precision format and dequantized to fp32 only while a matmul needs it.
//
// Formats (all scales are powers of two, so every dequantized value q * 2^e is exact in fp32
// and, but for blocks of magnitude below ~2^-122, in bf16: a base served in bf16 or f32 is
// bit for bit the base the trainer computes with; f16 cannot hold all of them):
//   fp8  E4M3 codes with one fp32 scale per block x block tile: exactly model/fp8.h's
//        QuantizeBlockwise, the bytes an FP8 snapshot serves (1 byte + 4 / block^2 per weight).
//   int8 integers in [-127, 127] with one power-of-two scale per output row, stored as its
//        int8 exponent: 2^e is the smallest power of two with amax / 2^e <= 127.
//   int4 integers in [-7, 7], two per byte, with one power-of-two scale per group of `block`
//        consecutive inputs of a row (default 32; the group's first half in the low nibbles of
//        its ceil(block / 2) bytes, the second half in the high nibbles): 0.5 + 1 / 32 bytes per
//        weight, 0.27x of bf16. Lossy like QLoRA's 4-bit base; the trainer and the served
//        base still agree exactly, since both use the dequantized values.
// Rounding is to nearest, ties to even; NaN and inf are refused when packing.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace flywheel::model {

enum class PackFormat { kNone, kFp8, kInt8, kInt4 };

inline constexpr int64_t kInt4GroupSize = 32;

// "none", "fp8", "int8", "int4".
const char* PackFormatName(PackFormat format);
Result<PackFormat> ParsePackFormat(std::string_view name);
// The block (fp8) or group (int4) size a format uses by default; 0 for int8 and none.
int64_t DefaultPackBlock(PackFormat format);

struct PackedWeight {
  PackFormat format = PackFormat::kNone;
  int64_t rows = 0, cols = 0;
  int64_t block = 0;     // fp8: the tile side; int4: the group length; int8: unused (0)
  torch::Tensor data;    // uint8: fp8 [rows, cols]; int8 (as uint8) [rows, cols];
                         // int4 [rows, ceil(cols / block) * ceil(block / 2)]
  torch::Tensor scales;  // fp8: float scale_inv [ceil(rows/block), ceil(cols/block)];
                         // int8: int8 exponents [rows]; int4: int8 exponents
                         // [rows, ceil(cols / block)]

  // Bytes held (data + scales).
  int64_t bytes() const;
  // The fp32 [rows, cols] weight these bytes stand for; multithreaded over rows.
  torch::Tensor Dequantize() const;
};

// Packs the fp32 [rows, cols] matrix `w` (its values, not its gradient). `block` 0 picks
// DefaultPackBlock(format). Fails on another format than fp8/int8/int4, a block below 0, a
// non-finite value, or a tensor that is not 2-D.
Result<PackedWeight> PackWeight(const torch::Tensor& w, PackFormat format, int64_t block = 0);

// How many times PackedWeight::Dequantize ran in this process (for tests that check that the
// backward pass dequantizes again instead of keeping every expert's fp32 weight alive).
int64_t PackedDequantizeCount();

}  // namespace flywheel::model
