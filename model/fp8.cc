#include "model/fp8.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "base/env.h"
#include "model/model.h"
#include "model/weights.h"

namespace flywheel::model {

// ---- E4M3FN scalars ----

uint8_t FloatToE4M3(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  constexpr uint32_t kInfBits = 0x7F800000u;
  constexpr uint32_t k448Bits = 0x43E00000u;        // 448.0f
  constexpr uint32_t kMinNormalBits = 0x3C800000u;  // 2^-6, E4M3's smallest normal
  if (magnitude > kInfBits) return sign | 0x7F;     // NaN
  if (magnitude >= k448Bits) return sign | 0x7E;    // saturate (inf included)
  if (magnitude >= kMinNormalBits) {
    // Keep 3 of fp32's 23 mantissa bits, ties to even; a carry out of the mantissa bumps
    // the exponent, which is what rounding up to the next binade means. Below 448 the
    // result is at most 448 (S.1111.110), never the NaN pattern.
    const uint32_t lsb = (magnitude >> 20) & 1;
    const uint32_t rounded = (magnitude + 0x7FFFFu + lsb) >> 20;  // fp32 exponent:mantissa
    return sign | static_cast<uint8_t>(rounded - ((127 - 7) << 3));
  }
  // Subnormal in E4M3 (below 2^-6): the code is the value in units of 2^-9, rounded to
  // nearest even; 8 units (2^-6) is code 0x08, the smallest normal, so the carry is right.
  const uint32_t biased_exponent = magnitude >> 23;
  const uint32_t significand =
      biased_exponent == 0 ? magnitude : (magnitude & 0x7FFFFFu) | 0x800000u;
  // value = significand * 2^(max(e, 1) - 150); in units of 2^-9: significand >> shift.
  const uint32_t shift = 141 - std::max<uint32_t>(biased_exponent, 1);
  if (shift > 24) return sign;  // below 2^-10: rounds to (signed) zero
  const uint32_t units = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rounded =
      units + ((remainder > half || (remainder == half && (units & 1))) ? 1 : 0);
  return sign | static_cast<uint8_t>(rounded);
}

namespace {

std::array<float, 256> BuildE4M3Table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 0xF, mantissa = code & 7;
    float magnitude;
    if (exponent == 15 && mantissa == 7) {
      magnitude = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      magnitude = std::ldexp(static_cast<float>(mantissa), -9);
    } else {
      magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
    }
    table[code] = (code & 0x80) ? -magnitude : magnitude;
  }
  return table;
}

const std::array<float, 256>& E4M3Table() {
  static const std::array<float, 256> table = BuildE4M3Table();
  return table;
}

int64_t CeilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Dequantizes rows [row_begin, row_end) x cols [col_begin, col_end) of one matrix.
void DequantizeRect(const uint8_t* data, const float* scale_inv, int64_t cols, int64_t block,
                    int64_t row_begin, int64_t row_end, int64_t col_begin, int64_t col_end,
                    float* out) {
  const std::array<float, 256>& table = E4M3Table();
  const int64_t block_cols = CeilDiv(cols, block);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* scales = scale_inv + (r / block) * block_cols;
    const uint8_t* in_row = data + r * cols;
    float* out_row = out + r * cols;
    for (int64_t c = col_begin; c < col_end;) {
      const int64_t segment_end = std::min(col_end, (c / block + 1) * block);
      const float scale = scales[c / block];
      for (; c < segment_end; ++c) out_row[c] = table[in_row[c]] * scale;
    }
  }
}

}  // namespace

float E4M3ToFloat(uint8_t code) {
  return E4M3Table()[code];
}

// ---- Block quantization ----

float Fp8ScaleForAmax(float amax) {
  assert(!std::isinf(amax) && !(amax < 0));
  if (!(amax > 0)) return 1.0f;  // all-zero block (or only NaN)
  // Smallest k with amax <= 448 * 2^k; 448 in [2^8, 2^9) puts k near ilogb(amax) - 8. The
  // comparisons are in double, where 448 * 2^k is exact for every k used here.
  int exponent = std::ilogb(amax) - 8;
  const double amax_d = amax;
  while (amax_d > std::ldexp(448.0, exponent)) ++exponent;
  while (amax_d <= std::ldexp(448.0, exponent - 1)) --exponent;
  exponent = std::max(exponent, kFp8MinScaleExponent);
  return std::ldexp(1.0f, exponent);
}

std::vector<int64_t> Fp8ScaleShape(int64_t rows, int64_t cols, int64_t block) {
  return {CeilDiv(rows, block), CeilDiv(cols, block)};
}

Fp8Block QuantizeBlockwise(const float* w, int64_t rows, int64_t cols, int64_t block) {
  assert(rows >= 0 && cols >= 0 && block > 0);
  Fp8Block out;
  out.rows = rows;
  out.cols = cols;
  out.block = block;
  out.data.resize(static_cast<size_t>(rows * cols));
  const int64_t block_rows = CeilDiv(rows, block), block_cols = CeilDiv(cols, block);
  out.scale_inv.resize(static_cast<size_t>(block_rows * block_cols));
  for (int64_t br = 0; br < block_rows; ++br) {
    const int64_t row_end = std::min(rows, (br + 1) * block);
    for (int64_t bc = 0; bc < block_cols; ++bc) {
      const int64_t col_begin = bc * block, col_end = std::min(cols, (bc + 1) * block);
      float amax = 0;
      for (int64_t r = br * block; r < row_end; ++r) {
        for (int64_t c = col_begin; c < col_end; ++c) {
          const float magnitude = std::fabs(w[r * cols + c]);
          if (magnitude > amax && std::isfinite(magnitude)) amax = magnitude;
        }
      }
      const float scale = Fp8ScaleForAmax(amax);
      out.scale_inv[br * block_cols + bc] = scale;
      // w / scale, exactly: in double the product by 2^-k never rounds, and its cast back to
      // fp32 is exact wherever the result is at least 2^-126, far below E4M3's rounding
      // threshold 2^-10 (smaller results become zero either way).
      const double inverse = std::ldexp(1.0, -std::ilogb(scale));
      for (int64_t r = br * block; r < row_end; ++r) {
        for (int64_t c = col_begin; c < col_end; ++c) {
          const float scaled = static_cast<float>(static_cast<double>(w[r * cols + c]) * inverse);
          out.data[r * cols + c] = FloatToE4M3(scaled);
        }
      }
    }
  }
  return out;
}

void DequantizeBlockwise(const uint8_t* data, const float* scale_inv, int64_t rows, int64_t cols,
                         int64_t block, float* out) {
  assert(rows >= 0 && cols >= 0 && block > 0);
  DequantizeRows(data, scale_inv, cols, block, 0, rows, out);
}

void DequantizeRows(const uint8_t* data, const float* scale_inv, int64_t cols, int64_t block,
                    int64_t row_begin, int64_t row_end, float* out) {
  assert(cols >= 0 && block > 0 && 0 <= row_begin && row_begin <= row_end);
  const std::array<float, 256>& table = E4M3Table();
  const int64_t block_cols = CeilDiv(cols, block);
  std::array<float, 256> scaled;
  // Block by block: the 256 codes' values times the block's scale, then one load per element
  // (the same fp32 product DequantizeRect computes).
  for (int64_t r0 = row_begin; r0 < row_end;) {
    const int64_t br = r0 / block, r1 = std::min(row_end, (br + 1) * block);
    for (int64_t bc = 0; bc < block_cols; ++bc) {
      const float scale = scale_inv[br * block_cols + bc];
      for (int code = 0; code < 256; ++code) scaled[code] = table[code] * scale;
      const int64_t c0 = bc * block, c1 = std::min(cols, c0 + block);
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* __restrict__ src = data + r * cols;
        float* __restrict__ dst = out + r * cols;
        for (int64_t c = c0; c < c1; ++c) dst[c] = scaled[src[c]];
      }
    }
    r0 = r1;
  }
}

void DequantizeElementRange(const uint8_t* data, const float* scale_inv, int64_t rows, int64_t cols,
                            int64_t block, int64_t begin, int64_t count, float* out) {
  assert(block > 0 && begin >= 0 && count >= 0 && begin + count <= rows * cols);
  (void)rows;
  const int64_t end = begin + count;
  // Row by row: a partial first row, whole rows, a partial last row.
  for (int64_t element = begin; element < end;) {
    const int64_t r = element / cols, c = element % cols;
    const int64_t row_stop = std::min(end, (r + 1) * cols);
    DequantizeRect(data, scale_inv, cols, block, r, r + 1, c, c + (row_stop - element), out);
    element = row_stop;
  }
}

void DequantizeBlocks(const uint8_t* data, const float* scale_inv, int64_t rows, int64_t cols,
                      int64_t block, std::span<const int64_t> blocks, float* out) {
  assert(block > 0);
  const int64_t block_cols = CeilDiv(cols, block);
  for (int64_t index : blocks) {
    assert(index >= 0 && index < CeilDiv(rows, block) * block_cols);
    const int64_t br = index / block_cols, bc = index % block_cols;
    DequantizeRect(data, scale_inv, cols, block, br * block, std::min(rows, (br + 1) * block),
                   bc * block, std::min(cols, (bc + 1) * block), out);
  }
}

// ---- Model snapshots ----

namespace {

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool IsAdapterName(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

std::string Shape(const std::vector<int64_t>& shape) {
  return ShapeString(shape);
}

bool IsFloatDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

bool IsF8(DType dtype) {
  return dtype == DType::kF8_E4M3 || dtype == DType::kF8_E5M2 || dtype == DType::kF8_E8M0;
}

Status CheckByteSize(const TensorView& view, const std::string& source) {
  FW_ASSIGN_OR_RETURN(uint64_t bytes, TensorByteSize(view.dtype, view.shape));
  if (bytes != view.data.size()) {
    return Status::Corruption(source + ": tensor " + view.name + " holds " +
                              std::to_string(view.data.size()) + " bytes, its dtype and shape " +
                              Shape(view.shape) + " need " + std::to_string(bytes));
  }
  return Status::Ok();
}

// One parameter's source, checked: either a plain float tensor, or FP8 codes with their
// scales already converted to fp32.
struct LoadPlan {
  torch::Tensor* param = nullptr;
  const TensorView* weight = nullptr;
  torch::Tensor scales;  // fp32, defined for FP8 weights
};

Result<torch::Tensor> CheckedScales(const TensorView& weight, const TensorView& scale,
                                    int64_t block, const std::string& source) {
  if (!IsFloatDType(scale.dtype)) {
    return Status::InvalidArgument(source + ": tensor " + scale.name + " has dtype " +
                                   DTypeName(scale.dtype) + "; block scales must be F32 (or " +
                                   "BF16, F16)");
  }
  const std::vector<int64_t> expected = Fp8ScaleShape(weight.shape[0], weight.shape[1], block);
  if (scale.shape != expected) {
    return Status::Mismatch(source + ": tensor " + scale.name + " has shape " + Shape(scale.shape) +
                            ", expected " + Shape(expected) + " (" + std::to_string(block) + "x" +
                            std::to_string(block) + " blocks of " + weight.name + " " +
                            Shape(weight.shape) + ")");
  }
  FW_RETURN_IF_ERROR(CheckByteSize(scale, source));
  FW_ASSIGN_OR_RETURN(torch::Tensor scales, ToTorch(scale));
  scales = scales.to(torch::kFloat).contiguous();
  const float* values = scales.data_ptr<float>();
  for (int64_t i = 0; i < scales.numel(); ++i) {
    if (!std::isfinite(values[i])) {
      return Status::InvalidArgument(source + ": tensor " + scale.name + " holds a non-finite " +
                                     "scale at block " + std::to_string(i));
    }
  }
  return scales;
}

Result<LoadPlan> PlanParameter(torch::Tensor& param, const TensorView& view,
                               const std::map<std::string, const TensorView*>& by_name,
                               int64_t block, const std::string& source) {
  if (view.shape != param.sizes().vec()) {
    return Status::Mismatch(source + ": tensor " + view.name + " has shape " + Shape(view.shape) +
                            ", the model expects " + c10::str(param.sizes()));
  }
  LoadPlan plan{&param, &view, {}};
  if (IsFloatDType(view.dtype)) {
    FW_RETURN_IF_ERROR(CheckByteSize(view, source));
    return plan;
  }
  if (!IsF8(view.dtype)) {
    return Status::InvalidArgument(source + ": tensor " + view.name + " has dtype " +
                                   DTypeName(view.dtype) +
                                   "; weights must be F32, BF16, F16 or F8_E4M3");
  }
  if (view.dtype != DType::kF8_E4M3) {
    return Status::InvalidArgument(source + ": tensor " + view.name + " has dtype " +
                                   DTypeName(view.dtype) +
                                   "; FP8 weights must be F8_E4M3 (e4m3fn)");
  }
  if (view.shape.size() != 2) {
    return Status::InvalidArgument(source + ": tensor " + view.name + " is F8_E4M3 with shape " +
                                   Shape(view.shape) + "; only matrices are block-quantized");
  }
  FW_RETURN_IF_ERROR(CheckByteSize(view, source));
  const std::string scale_name = view.name + kFp8ScaleSuffix;
  auto it = by_name.find(scale_name);
  if (it == by_name.end()) {
    return Status::NotFound(source + ": missing tensor " + scale_name +
                            ", the block scales of F8_E4M3 tensor " + view.name);
  }
  FW_ASSIGN_OR_RETURN(plan.scales, CheckedScales(view, *it->second, block, source));
  return plan;
}

// Why a tensor that no parameter took is refused, or "" when it is tolerated.
std::string UnusedTensorError(const TensorView& t, const TransformerImpl& model,
                              const std::map<std::string, const TensorView*>& by_name,
                              const std::set<std::string>& fp8_weights) {
  if (EndsWith(t.name, kFp8ScaleSuffix)) {
    const std::string weight = t.name.substr(0, t.name.size() - std::strlen(kFp8ScaleSuffix));
    if (fp8_weights.count(weight)) return "";
    auto it = by_name.find(weight);
    if (it == by_name.end()) return "tensor " + t.name + " has no weight " + weight;
    if (it->second->dtype != DType::kF8_E4M3) {
      return "tensor " + t.name + " scales " + weight + ", which is " +
             DTypeName(it->second->dtype) + ", not F8_E4M3";
    }
    return "tensor " + weight + " is not a parameter of this model";
  }
  const bool tolerated = (t.name == "lm_head.weight" && model.config().tie_word_embeddings) ||
                         t.name.find("rotary_emb.inv_freq") != std::string::npos;
  return tolerated ? "" : "tensor " + t.name + " is not a parameter of this model";
}

}  // namespace

std::vector<std::string> Fp8WeightNames(TransformerImpl& model) {
  std::vector<std::string> names;
  for (const auto& [module, shape] : model.ProjectionShapes()) {
    if (module == "lm_head" || EndsWith(module, ".mlp.gate")) continue;
    names.push_back(module + ".weight");
  }
  std::sort(names.begin(), names.end());
  return names;
}

Result<OwnedCheckpoint> SnapshotWeightsFp8(TransformerImpl& model, const Fp8Options& options) {
  if (options.block < 1) {
    return Status::InvalidArgument("FP8 block size must be at least 1, got " +
                                   std::to_string(options.block));
  }
  if (!IsFloatDType(options.other_dtype)) {
    return Status::InvalidArgument(
        std::string("the dtype of unquantized tensors must be BF16, F16 or F32, got ") +
        DTypeName(options.other_dtype));
  }
  const std::vector<std::string> names = Fp8WeightNames(model);
  const std::set<std::string> fp8(names.begin(), names.end());
  OwnedCheckpoint out;
  // The projections are quantized in parallel, one matrix per task, into slots laid out in
  // parameter order; each matrix's bytes do not depend on the threads.
  struct Job {
    size_t slot;  // out.tensors[slot] = weight, [slot + 1] = its scales
    torch::Tensor weight;
  };
  std::vector<Job> jobs;
  for (auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    if (IsAdapterName(name)) continue;
    if (!fp8.count(name)) {
      FW_ASSIGN_OR_RETURN(OwnedTensor t, FromTorch(name, item.value(), options.other_dtype));
      out.tensors.push_back(std::move(t));
      continue;
    }
    jobs.push_back(
        {out.tensors.size(), item.value().detach().to(torch::kCPU).to(torch::kFloat).contiguous()});
    out.tensors.push_back({name, DType::kF8_E4M3, jobs.back().weight.sizes().vec(), {}});
    out.tensors.push_back({name + kFp8ScaleSuffix, DType::kF32, {}, {}});
  }
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const torch::Tensor& w = jobs[j].weight;
      const Fp8Block q =
          QuantizeBlockwise(w.data_ptr<float>(), w.size(0), w.size(1), options.block);
      OwnedTensor& weight = out.tensors[jobs[j].slot];
      weight.data.resize(q.data.size());
      std::memcpy(weight.data.data(), q.data.data(), q.data.size());
      OwnedTensor& scale = out.tensors[jobs[j].slot + 1];
      scale.shape = Fp8ScaleShape(q.rows, q.cols, options.block);
      scale.data.resize(q.scale_inv.size() * sizeof(float));
      std::memcpy(scale.data.data(), q.scale_inv.data(), scale.data.size());
    }
  });
  return out;
}

Status LoadFp8Weights(TransformerImpl& model, const CheckpointView& checkpoint,
                      const std::string& source, int64_t block) {
  assert(block > 0);
  std::map<std::string, const TensorView*> by_name;
  for (const TensorView& t : checkpoint) by_name[t.name] = &t;
  // Check everything first, then write: a refused checkpoint changes nothing.
  std::vector<LoadPlan> plans;
  std::set<std::string> used, fp8_weights;
  auto params = model.named_parameters();
  for (auto& item : params) {
    const std::string& name = item.key();
    if (IsAdapterName(name)) continue;
    auto it = by_name.find(name);
    if (it == by_name.end()) return Status::NotFound(source + ": missing tensor " + name);
    FW_ASSIGN_OR_RETURN(LoadPlan plan,
                        PlanParameter(item.value(), *it->second, by_name, block, source));
    if (plan.scales.defined()) fp8_weights.insert(name);
    used.insert(name);
    plans.push_back(std::move(plan));
  }
  for (const TensorView& t : checkpoint) {
    if (used.count(t.name)) continue;
    const std::string error = UnusedTensorError(t, model, by_name, fp8_weights);
    if (!error.empty()) return Status::InvalidArgument(source + ": " + error);
  }
  torch::NoGradGuard no_grad;
  for (LoadPlan& plan : plans) {
    const TensorView& view = *plan.weight;
    torch::Tensor value;
    if (plan.scales.defined()) {
      value = torch::empty(view.shape, torch::kFloat);
      DequantizeBlockwise(reinterpret_cast<const uint8_t*>(view.data.data()),
                          plan.scales.data_ptr<float>(), view.shape[0], view.shape[1], block,
                          value.data_ptr<float>());
    } else {
      FW_ASSIGN_OR_RETURN(value, ToTorch(view));
    }
    plan.param->copy_(value.to(plan.param->scalar_type()));
  }
  return Status::Ok();
}

nlohmann::json Fp8QuantizationConfig(int64_t block) {
  return {{"quant_method", "fp8"},
          {"fmt", "e4m3"},
          {"activation_scheme", "dynamic"},
          {"weight_block_size", {block, block}}};
}

// quantization_config.weight_block_size of the model's config.json: [n, n] (or [n]) gives n;
// no quantization_config (or none with weight_block_size) gives HF's 128. Blocks that are
// not square are refused: FP8 serving here quantizes square blocks only.
Result<int64_t> Fp8BlockFromConfig(const std::string& model_config) {
  std::filesystem::path file = model_config;
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) file /= "config.json";
  FW_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, Env::Default()->ReadFile(file.string()));
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("quantization_config")) return kFp8BlockSize;
  const nlohmann::json& q = json["quantization_config"];
  if (!q.is_object() || !q.contains("weight_block_size")) return kFp8BlockSize;
  const nlohmann::json& size = q["weight_block_size"];
  const bool valid = size.is_array() && !size.empty() && size.size() <= 2 &&
                     size[0].is_number_integer() && size[0].get<int64_t>() > 0 &&
                     (size.size() == 1 || size[1] == size[0]);
  if (!valid) {
    return Status::InvalidArgument(file.string() +
                                   ": quantization_config.weight_block_size must be [n, n] "
                                   "with n > 0, got " +
                                   size.dump());
  }
  return size[0].get<int64_t>();
}


}  // namespace flywheel::model
