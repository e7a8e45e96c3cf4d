#include "rollout/mirror.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <unordered_map>

#include "model/fp8.h"
#include "model/weights.h"

namespace flywheel::rollout {

namespace {

// Converts `count` words starting at word `begin` (or at begin + positions[i]) of a serving
// tensor into the fp32 parameter.
template <typename Index>
void Convert(const TensorView& src, float* dst, uint64_t begin, const Index& index, size_t count) {
  const std::byte* data = src.data.data();
  switch (src.dtype) {
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        const uint64_t w = begin + index(i);
        uint16_t bits;
        std::memcpy(&bits, data + 2 * w, 2);
        const uint32_t wide = static_cast<uint32_t>(bits) << 16;
        std::memcpy(dst + w, &wide, 4);
      }
      break;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        const uint64_t w = begin + index(i);
        uint16_t bits;
        std::memcpy(&bits, data + 2 * w, 2);
        dst[w] = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
      }
      break;
    default:  // F32
      for (size_t i = 0; i < count; ++i) {
        const uint64_t w = begin + index(i);
        std::memcpy(dst + w, data + 4 * w, 4);
      }
      break;
  }
}

Status CheckServing(const TensorView& src, const torch::Tensor& param) {
  if (src.dtype != DType::kBF16 && src.dtype != DType::kF16 && src.dtype != DType::kF32) {
    return Status::InvalidArgument("serving tensor " + src.name + " has dtype " +
                                   DTypeName(src.dtype) +
                                   "; the engine computes from BF16, F16 or F32");
  }
  if (src.shape != param.sizes().vec() || !param.is_contiguous() ||
      param.scalar_type() != torch::kFloat) {
    return Status::Mismatch("serving tensor " + src.name + " does not match the model's parameter");
  }
  return Status::Ok();
}

bool HasFp8(const CheckpointView& weights) {
  for (const TensorView& t : weights) {
    if (t.dtype == DType::kF8_E4M3) return true;
  }
  return false;
}

// The fp32 values of a scale tensor (F32, BF16 or F16: all convert exactly).
std::vector<float> ScalesToFloat(const TensorView& scales) {
  std::vector<float> out(scales.data.size() / DTypeWordBytes(scales.dtype));
  Convert(
      scales, out.data(), 0, [](size_t i) { return i; }, out.size());
  return out;
}

// An F8_E4M3 weight of the serving copy and the scale tensor it is dequantized with.
struct Fp8Weight {
  torch::Tensor* param = nullptr;
  size_t scale_index = 0;
  int64_t rows = 0, cols = 0;
  std::vector<float> scales;  // filled only for the weights a swap touches
  std::vector<int64_t> changed_blocks;
};

Status CheckFp8Serving(const CheckpointView& weights, size_t index, torch::Tensor& param,
                       const std::unordered_map<std::string, size_t>& by_name, int64_t block,
                       Fp8Weight& out) {
  const TensorView& src = weights[index];
  if (src.shape.size() != 2 || src.shape != param.sizes().vec() || !param.is_contiguous() ||
      param.scalar_type() != torch::kFloat) {
    return Status::Mismatch("serving tensor " + src.name +
                            " (F8_E4M3) does not match the model's parameter");
  }
  const std::string scale_name = src.name + model::kFp8ScaleSuffix;
  auto it = by_name.find(scale_name);
  if (it == by_name.end()) {
    return Status::NotFound("serving tensor " + src.name + " is F8_E4M3 but " + scale_name +
                            " is not served");
  }
  const TensorView& scales = weights[it->second];
  if (scales.dtype != DType::kF32 && scales.dtype != DType::kBF16 && scales.dtype != DType::kF16) {
    return Status::InvalidArgument("serving tensor " + scale_name + " has dtype " +
                                   DTypeName(scales.dtype) + "; scales must be F32, BF16 or F16");
  }
  if (scales.shape != model::Fp8ScaleShape(src.shape[0], src.shape[1], block)) {
    return Status::Mismatch("serving tensor " + scale_name + " does not have the shape of " +
                            src.name + "'s blocks of " + std::to_string(block));
  }
  out.param = &param;
  out.scale_index = it->second;
  out.rows = src.shape[0];
  out.cols = src.shape[1];
  return Status::Ok();
}

// Re-dequantizes the elements `c` wrote into an FP8 weight's mirror: [word_begin, word_begin
// + word_count) when c.all, else word_begin + each position, one call per run of
// consecutive positions. REQUIRES: w.scales holds the version's scales.
void DequantizeChanged(const TensorView& src, Fp8Weight& w, const delta::ChangedWords& c,
                       int64_t block) {
  const auto* data = reinterpret_cast<const uint8_t*>(src.data.data());
  float* dst = w.param->data_ptr<float>();
  if (c.all) {
    model::DequantizeElementRange(data, w.scales.data(), w.rows, w.cols, block,
                                  static_cast<int64_t>(c.word_begin),
                                  static_cast<int64_t>(c.word_count), dst);
    return;
  }
  size_t i = 0;
  while (i < c.positions.size()) {
    size_t j = i + 1;
    while (j < c.positions.size() && c.positions[j] == c.positions[j - 1] + 1) ++j;
    model::DequantizeElementRange(data, w.scales.data(), w.rows, w.cols, block,
                                  static_cast<int64_t>(c.word_begin + c.positions[i]),
                                  static_cast<int64_t>(j - i), dst);
    i = j;
  }
}

}  // namespace

Status LoadMirror(model::TransformerImpl& model, const CheckpointView& weights, int64_t fp8_block) {
  if (HasFp8(weights)) return model::LoadFp8Weights(model, weights, "serving copy", fp8_block);
  return model::LoadWeights(model, weights, "serving copy");
}

Status LoadMirrorOrRestore(model::TransformerImpl& model, const CheckpointView& weights,
                           const CheckpointView* previous, int64_t fp8_block) {
  Status loaded = LoadMirror(model, weights, fp8_block);
  if (loaded.ok() || previous == nullptr) return loaded;
  // The mirror is a function of the served words: loading the previous version again
  // restores it exactly.
  Status restored = LoadMirror(model, *previous, fp8_block);
  if (!restored.ok()) {
    return Status::Internal(loaded.message() + "; restoring the previous version failed too: " +
                            restored.message());
  }
  return loaded;
}

namespace {

// Which parameter mirrors each serving tensor: by index (null: none), and for FP8 weights
// their scale tensors and dequantization state.
struct MirrorMap {
  std::vector<torch::Tensor*> by_index;
  // FP8 weights by their index, and their scale tensors' index -> the weight's index.
  std::map<size_t, Fp8Weight> fp8;
  std::unordered_map<size_t, size_t> weight_of_scale;
};

// Pairs every serving tensor with its parameter and checks the pair (CheckServing,
// CheckFp8Serving); counts the tensors without one.
Result<MirrorMap> MapParameters(torch::OrderedDict<std::string, torch::Tensor>& params,
                                const CheckpointView& weights, int64_t fp8_block,
                                MirrorStats* stats) {
  MirrorMap map;
  map.by_index.assign(weights.size(), nullptr);
  std::unordered_map<std::string, size_t> by_name;
  for (size_t i = 0; i < weights.size(); ++i) by_name.emplace(weights[i].name, i);
  for (size_t i = 0; i < weights.size(); ++i) {
    torch::Tensor* p = params.find(weights[i].name);
    if (!p) continue;
    if (weights[i].dtype == DType::kF8_E4M3) {
      Fp8Weight w;
      FW_RETURN_IF_ERROR(CheckFp8Serving(weights, i, *p, by_name, fp8_block, w));
      map.weight_of_scale[w.scale_index] = i;
      map.fp8.emplace(i, std::move(w));
    } else {
      FW_RETURN_IF_ERROR(CheckServing(weights[i], *p));
    }
    map.by_index[i] = p;
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!map.by_index[i] && !map.weight_of_scale.contains(i)) ++stats->tensors_ignored;
  }
  return map;
}

// Checks every change against its tensor's size, and fills the fp32 scales of each FP8
// weight a change touches (its bytes or its scales), all finite.
Status CheckChanges(const CheckpointView& weights, const std::vector<delta::ChangedWords>& changes,
                    MirrorMap& map) {
  for (const delta::ChangedWords& c : changes) {
    if (c.state_index >= weights.size())
      return Status::Internal("swap change names tensor index out of range");
    const TensorView& t = weights[c.state_index];
    const bool mirrored = map.by_index[c.state_index] || map.weight_of_scale.contains(c.state_index);
    const uint64_t words = t.data.size() / DTypeWordBytes(t.dtype);
    const uint64_t last =
        c.all ? c.word_begin + c.word_count
              : (c.positions.empty() ? 0 : c.word_begin + uint64_t{c.positions.back()} + 1);
    if (mirrored && (c.word_begin + c.word_count > words || last > words)) {
      return Status::Internal("swap change of " + t.name + " runs past the tensor");
    }
    size_t weight = c.state_index;
    if (auto s = map.weight_of_scale.find(c.state_index); s != map.weight_of_scale.end()) {
      weight = s->second;
    }
    auto w = map.fp8.find(weight);
    if (w == map.fp8.end() || !w->second.scales.empty()) continue;
    w->second.scales = ScalesToFloat(weights[w->second.scale_index]);
    for (const float scale : w->second.scales) {
      if (!std::isfinite(scale)) {
        return Status::InvalidArgument("serving tensor " + weights[w->second.scale_index].name +
                                       " holds a non-finite scale");
      }
    }
  }
  return Status::Ok();
}

// Writes the changed words into the mirror; a changed scale word only marks its block
// (RedequantizeBlocks).
void WriteChanges(const CheckpointView& weights, const std::vector<delta::ChangedWords>& changes,
                  MirrorMap& map, int64_t fp8_block, MirrorStats* stats) {
  for (const delta::ChangedWords& c : changes) {
    const TensorView& src = weights[c.state_index];
    if (auto s = map.weight_of_scale.find(c.state_index); s != map.weight_of_scale.end()) {
      // A scale word is a whole block: collected, then re-dequantized once.
      std::vector<int64_t>& blocks = map.fp8.at(s->second).changed_blocks;
      if (c.all) {
        for (uint64_t b = 0; b < c.word_count; ++b) blocks.push_back(c.word_begin + b);
      } else {
        for (const uint32_t p : c.positions) blocks.push_back(c.word_begin + p);
      }
      continue;
    }
    torch::Tensor* p = map.by_index[c.state_index];
    if (!p) continue;
    stats->words_patched += c.all ? c.word_count : c.positions.size();
    if (auto w = map.fp8.find(c.state_index); w != map.fp8.end()) {
      DequantizeChanged(src, w->second, c, fp8_block);
      continue;
    }
    float* dst = p->data_ptr<float>();
    if (c.all) {
      Convert(
          src, dst, c.word_begin, [](size_t i) { return i; }, c.word_count);
    } else {
      Convert(
          src, dst, c.word_begin, [&](size_t i) { return static_cast<uint64_t>(c.positions[i]); },
          c.positions.size());
    }
  }
}

// Re-dequantizes every FP8 block whose scale changed.
void RedequantizeBlocks(const CheckpointView& weights, MirrorMap& map, int64_t fp8_block,
                        MirrorStats* stats) {
  for (auto& [index, w] : map.fp8) {
    if (w.changed_blocks.empty()) continue;
    model::DequantizeBlocks(reinterpret_cast<const uint8_t*>(weights[index].data.data()),
                            w.scales.data(), w.rows, w.cols, fp8_block, w.changed_blocks,
                            w.param->data_ptr<float>());
    const int64_t block_cols = (w.cols + fp8_block - 1) / fp8_block;
    for (const int64_t b : w.changed_blocks) {
      const int64_t r0 = (b / block_cols) * fp8_block, c0 = (b % block_cols) * fp8_block;
      stats->words_patched += static_cast<uint64_t>(std::min(fp8_block, w.rows - r0) *
                                                    std::min(fp8_block, w.cols - c0));
    }
  }
}

}  // namespace

Result<MirrorStats> PatchMirror(model::TransformerImpl& model, const CheckpointView& weights,
                                const std::vector<delta::ChangedWords>& changes,
                                int64_t fp8_block) {
  auto params = model.named_parameters();  // the map points into it
  MirrorStats stats;
  FW_ASSIGN_OR_RETURN(MirrorMap map, MapParameters(params, weights, fp8_block, &stats));
  // Everything is checked before the first word is written, so an error leaves the mirror
  // as it was (the worker then keeps serving the version before).
  FW_RETURN_IF_ERROR(CheckChanges(weights, changes, map));
  torch::NoGradGuard no_grad;
  WriteChanges(weights, changes, map, fp8_block, &stats);
  RedequantizeBlocks(weights, map, fp8_block, &stats);
  return stats;
}

bool AllF32(const CheckpointView& weights) {
  for (const TensorView& t : weights) {
    if (t.dtype != DType::kF32) return false;
  }
  return !weights.empty();
}

Status AliasWeights(model::TransformerImpl& model, const CheckpointView& weights) {
  std::map<std::string, const TensorView*> by_name;
  for (const TensorView& t : weights) by_name[t.name] = &t;
  torch::NoGradGuard no_grad;
  // Check everything first, so a refused version leaves the model as it was.
  auto params = model.named_parameters();
  for (const auto& item : params) {
    auto it = by_name.find(item.key());
    if (it == by_name.end()) {
      return Status::NotFound("the served weights have no tensor " + item.key());
    }
    if (it->second->dtype != DType::kF32) {
      return Status::InvalidArgument("serving tensor " + item.key() + " is " +
                                     DTypeName(it->second->dtype) +
                                     "; serving without a mirror needs F32");
    }
    FW_RETURN_IF_ERROR(CheckServing(*it->second, item.value()));
    if (reinterpret_cast<uintptr_t>(it->second->data.data()) % alignof(float) != 0) {
      return Status::InvalidArgument("serving tensor " + item.key() + " is not 4-byte aligned");
    }
  }
  for (auto& item : params) {
    const TensorView& t = *by_name[item.key()];
    item.value().set_data(torch::from_blob(const_cast<std::byte*>(t.data.data()), t.shape,
                                           torch::TensorOptions().dtype(torch::kFloat32)));
  }
  return Status::Ok();
}

}  // namespace flywheel::rollout
