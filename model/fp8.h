// FP8 serving weights in the Hugging Face block layout (DeepSeek-V3, Qwen3-FP8, vLLM's block
// FP8). A projection weight W [out, in] is stored as two tensors:
//
//   <name>            F8_E4M3  [out, in]                                 (one byte an element)
//   <name>_scale_inv  F32      [ceil(out / B), ceil(in / B)]             (B = weight_block_size)
//
// and means W[r][c] = e4m3(<name>[r][c]) * <name>_scale_inv[r / B][c / B], the product taken
// in fp32. Despite its name, scale_inv is the factor that dequantizes (HF's spelling, kept so
// that vLLM and transformers read the snapshot as it is). config.json carries
// Fp8QuantizationConfig(B). Norms, embeddings, biases, MoE routers (`mlp.gate`) and lm_head
// are not quantized (they stay BF16).
//
// E4M3FN (torch.float8_e4m3fn; "fn": finite, no infinities): 1 sign bit, 4 exponent bits
// (bias 7), 3 mantissa bits:
//   exponent 1..15: (-1)^s * 2^(e - 7) * (1 + m / 8)
//   exponent 0:     (-1)^s * 2^-6 * (m / 8)           (subnormals; the smallest is 2^-9)
//   S.1111.111 (0x7F, 0xFF) is NaN; S.1111.110 = ±448 is the largest finite value.
//
// Block scales. Each block gets the smallest power of two s with amax / s <= 448, where amax
// is the largest finite |w| of the block. A power of two makes w / s and fp8 * s exact (only
// the rounding to 3 mantissa bits loses anything), and the scale stays put while the block's
// amax moves inside (448 * 2^(k-1), 448 * 2^k]: across consecutive RL steps a scale, and so
// its whole block of bytes, changes only when amax crosses such a boundary. Quantization is a
// pure function of the weights: the same input gives the same bytes on every machine.
//   - An all-zero block (amax = 0, or only NaN) gets scale 1.
//   - s is at least 2^kFp8MinScaleExponent (2^-140), so that every fp8 * s is an exact fp32;
//     a block whose amax is below 448 * 2^-140 (only fp32 subnormals) uses that scale.
//   - Non-finite weights do not count towards amax: NaN stays NaN (sign kept), ±inf becomes
//     ±448 * s (saturation, below).
//
// This header is torch-free; the model-facing functions at the end take a TransformerImpl
// (model/model.h) and are implemented with torch.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "checkpoint/tensor.h"

namespace flywheel::model {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr int64_t kFp8BlockSize = 128;  // HF weight_block_size [128, 128]
inline constexpr int kFp8MinScaleExponent = -140;
// The scale tensor of weight `<name>` is `<name>` + kFp8ScaleSuffix.
inline constexpr const char* kFp8ScaleSuffix = "_scale_inv";

// ---- E4M3FN scalars ----

// Rounds to the nearest E4M3FN value, ties to even (the code whose mantissa LSB is 0);
// subnormals are rounded exactly (no flush to zero). Finite values above 448 and ±inf
// saturate to ±448 (0x7E / 0xFE), as NVIDIA's __nv_cvt_float_to_fp8(..., __NV_SATFINITE,
// __NV_E4M3) and torch's saturating fp8 casts do; note that a plain torch `.to(float8_e4m3fn)`
// instead gives NaN from 480 up. NaN gives 0x7F, or 0xFF when its sign bit is set. -0 gives
// 0x80.
uint8_t FloatToE4M3(float value);
// Exact. 0x7F and 0xFF decode to NaN (E4M3FN has no infinity); 0x80 to -0.
float E4M3ToFloat(uint8_t code);

// ---- Block quantization (plain C++) ----

// The block scale for a block whose largest finite |w| is `amax` (the rule in the file
// comment): the smallest power of two s >= 2^kFp8MinScaleExponent with amax / s <= 448;
// 1 when amax is 0 or NaN.
// REQUIRES: amax >= 0 or NaN, not inf.
float Fp8ScaleForAmax(float amax);

// [ceil(rows / block), ceil(cols / block)]: the shape of a weight's scale tensor.
std::vector<int64_t> Fp8ScaleShape(int64_t rows, int64_t cols, int64_t block = kFp8BlockSize);

struct Fp8Block {
  std::vector<uint8_t> data;     // rows * cols E4M3 codes, row-major
  std::vector<float> scale_inv;  // Fp8ScaleShape(rows, cols, block), row-major
  int64_t rows = 0, cols = 0;
  int64_t block = kFp8BlockSize;
};

// Quantizes the row-major [rows, cols] matrix `w` in block x block tiles (the last ones
// cut short when rows or cols is not a multiple of block).
// REQUIRES: rows >= 0, cols >= 0, block > 0.
Fp8Block QuantizeBlockwise(const float* w, int64_t rows, int64_t cols,
                           int64_t block = kFp8BlockSize);

// out[r * cols + c] = E4M3ToFloat(data[r * cols + c]) * scale_inv[(r / block) * block_cols +
// c / block], in fp32, for every element. `scale_inv` may hold any values (checkpoints not
// written by QuantizeBlockwise, such as DeepSeek-V3's, use amax / 448); the product is then
// rounded to fp32 as torch's `fp8.float() * scale` is.
// REQUIRES: rows >= 0, cols >= 0, block > 0; `scale_inv` holds Fp8ScaleShape(rows, cols,
// block) values.
void DequantizeBlockwise(const uint8_t* data, const float* scale_inv, int64_t rows, int64_t cols,
                         int64_t block, float* out);

// DequantizeBlockwise for rows [row_begin, row_end) only (the same values), e.g. one thread's
// share; `data`, `scale_inv` and `out` are the whole matrix's.
// REQUIRES: 0 <= row_begin <= row_end <= rows; as DequantizeBlockwise.
void DequantizeRows(const uint8_t* data, const float* scale_inv, int64_t cols, int64_t block,
                    int64_t row_begin, int64_t row_end, float* out);

// Partial dequantization, for patching an fp32 mirror after a delta wrote some words of the
// served FP8 tensors: `out` is the whole [rows, cols] fp32 matrix; only the listed entries
// are written, each with the same value DequantizeBlockwise gives it.
//   DequantizeElementRange: flat elements [begin, begin + count) (bytes of `<name>` changed).
//   DequantizeBlocks: every element of each listed block; a block is a flat index into
//   scale_inv, block_row * ceil(cols / block) + block_col (words of `<name>_scale_inv`
//   changed, so the whole block's values did).
// REQUIRES: as DequantizeBlockwise; 0 <= begin, begin + count <= rows * cols; every block
// index in [0, scale_inv's element count).
void DequantizeElementRange(const uint8_t* data, const float* scale_inv, int64_t rows, int64_t cols,
                            int64_t block, int64_t begin, int64_t count, float* out);
void DequantizeBlocks(const uint8_t* data, const float* scale_inv, int64_t rows, int64_t cols,
                      int64_t block, std::span<const int64_t> blocks, float* out);

// ---- Model snapshots (torch) ----

class TransformerImpl;

struct Fp8Options {
  int64_t block = kFp8BlockSize;     // weight_block_size, both dimensions
  DType other_dtype = DType::kBF16;  // everything not quantized: BF16, F16 or F32
};

// The parameter names a snapshot stores as FP8: the weight of every projection
// TransformerImpl::ProjectionShapes() lists (attention q/k/v/o, dense MLP and MoE experts'
// gate/up/down) except the MoE routers (`...mlp.gate`) and `lm_head`. Sorted.
std::vector<std::string> Fp8WeightNames(TransformerImpl& model);

// Like SnapshotWeights (model/weights.h) without adapters: every base parameter under its HF
// name, the Fp8WeightNames() ones as F8_E4M3 `<name>` followed by F32 `<name>_scale_inv`
// (QuantizeBlockwise), all others cast to options.other_dtype (round to nearest even).
// Fails on a block below 1 or an other_dtype that is not BF16, F16 or F32.
Result<OwnedCheckpoint> SnapshotWeightsFp8(TransformerImpl& model, const Fp8Options& options = {});

// Loads a checkpoint whose weights may be F8_E4M3 with `<name>_scale_inv` block scales into
// the fp32 `model`, dequantizing them (DequantizeBlockwise, blocks of `block`); the other
// tensors are F32, BF16 or F16 as for LoadWeights, with the same tolerated extras (a tied
// model's lm_head.weight, rotary inv_freq). Scales may be F32, BF16 or F16 (HF's Qwen3 FP8
// releases store BF16 or F16 scales; all convert to fp32 exactly). Everything is checked
// before any parameter is written, so a refused checkpoint leaves the model as it was.
// Refused, each message naming the tensor and `source`:
//   a missing parameter tensor (NotFound), an F8_E4M3 weight without its scale (NotFound),
//   an F8 tensor of another format such as F8_E5M2 (InvalidArgument), an F8 tensor for a
//   parameter that is not a matrix, a weight or scale of the wrong shape (Mismatch), a scale
//   of another dtype (InvalidArgument), a non-finite scale, a scale tensor whose weight is
//   not in the checkpoint or is not F8_E4M3, a tensor that is not a parameter (InvalidArgument).
// REQUIRES: block > 0.
Status LoadFp8Weights(TransformerImpl& model, const CheckpointView& checkpoint,
                      const std::string& source, int64_t block = kFp8BlockSize);

// config.json's "quantization_config" for a snapshot with blocks of `block`:
// {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
//  "weight_block_size": [block, block]}.
nlohmann::json Fp8QuantizationConfig(int64_t block = kFp8BlockSize);

// quantization_config.weight_block_size of a config.json (or of a model directory's): [n, n]
// (or [n]) gives n; no quantization_config (or none with weight_block_size) gives HF's 128.
// Blocks that are not square are refused, naming the file: FP8 serving here quantizes square
// blocks only.
Result<int64_t> Fp8BlockFromConfig(const std::string& model_config);

}  // namespace flywheel::model
