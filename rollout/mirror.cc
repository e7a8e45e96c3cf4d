#include "rollout/mirror.h"

#include <c10/util/Half.h>

#include <cstring>
#include <map>

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

}  // namespace

Status LoadMirror(model::TransformerImpl& model, const CheckpointView& weights) {
  return model::LoadWeights(model, weights, "serving copy");
}

Status LoadMirrorOrRestore(model::TransformerImpl& model, const CheckpointView& weights,
                           const CheckpointView* previous) {
  Status loaded = LoadMirror(model, weights);
  if (loaded.ok() || previous == nullptr) return loaded;
  // The mirror is a function of the served words: loading the previous version again
  // restores it exactly.
  Status restored = LoadMirror(model, *previous);
  if (!restored.ok()) {
    return Status::Internal(loaded.message() + "; restoring the previous version failed too: " +
                            restored.message());
  }
  return loaded;
}

Result<MirrorStats> PatchMirror(model::TransformerImpl& model, const CheckpointView& weights,
                                const std::vector<delta::ChangedWords>& changes) {
  auto params = model.named_parameters();
  MirrorStats stats;
  std::vector<torch::Tensor*> by_index(weights.size(), nullptr);
  for (size_t i = 0; i < weights.size(); ++i) {
    torch::Tensor* p = params.find(weights[i].name);
    if (!p) {
      ++stats.tensors_ignored;
      continue;
    }
    FW_RETURN_IF_ERROR(CheckServing(weights[i], *p));
    by_index[i] = p;
  }
  // Everything is checked before the first word is written, so an error leaves the mirror
  // as it was (the worker then keeps serving the version before).
  for (const delta::ChangedWords& c : changes) {
    if (c.state_index >= weights.size())
      return Status::Internal("swap change names tensor index out of range");
    const torch::Tensor* p = by_index[c.state_index];
    if (p && c.word_begin + c.word_count > static_cast<uint64_t>(p->numel())) {
      return Status::Internal("swap change of " + weights[c.state_index].name +
                              " runs past the tensor");
    }
  }
  torch::NoGradGuard no_grad;
  for (const delta::ChangedWords& c : changes) {
    torch::Tensor* p = by_index[c.state_index];
    if (!p) continue;
    const TensorView& src = weights[c.state_index];
    float* dst = p->data_ptr<float>();
    if (c.all) {
      Convert(
          src, dst, c.word_begin, [](size_t i) { return i; }, c.word_count);
      stats.words_patched += c.word_count;
    } else {
      Convert(
          src, dst, c.word_begin, [&](size_t i) { return static_cast<uint64_t>(c.positions[i]); },
          c.positions.size());
      stats.words_patched += c.positions.size();
    }
  }
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
