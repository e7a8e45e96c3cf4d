#include "model/weights.h"

#include <cstring>
#include <set>

#include "checkpoint/safetensors.h"

namespace flywheel::model {

namespace {

std::optional<torch::ScalarType> TorchType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return torch::kFloat;
    case DType::kBF16:
      return torch::kBFloat16;
    case DType::kF16:
      return torch::kHalf;
    case DType::kF64:
      return torch::kDouble;
    case DType::kI64:
      return torch::kLong;
    case DType::kI32:
      return torch::kInt;
    case DType::kU8:
      return torch::kByte;
    default:
      return std::nullopt;
  }
}

std::string Shape(const std::vector<int64_t>& shape) {
  return c10::str(c10::IntArrayRef(shape));
}

bool IsAdapterName(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

constexpr const char* kPeftPrefix = "base_model.model.";

Status CopyInto(torch::Tensor& param, const TensorView& view, const std::string& source) {
  if (view.shape != param.sizes().vec()) {
    return Status::Mismatch(source + ": tensor " + view.name + " has shape " + Shape(view.shape) +
                            ", the model expects " + c10::str(param.sizes()));
  }
  if (view.dtype != DType::kF32 && view.dtype != DType::kBF16 && view.dtype != DType::kF16) {
    return Status::InvalidArgument(source + ": tensor " + view.name + " has dtype " +
                                   DTypeName(view.dtype) + "; weights must be F32, BF16 or F16");
  }
  FW_ASSIGN_OR_RETURN(torch::Tensor value, ToTorch(view));
  torch::NoGradGuard no_grad;
  param.copy_(value.to(param.scalar_type()));
  return Status::Ok();
}

}  // namespace

Result<torch::Tensor> ToTorch(const TensorView& view) {
  auto type = TorchType(view.dtype);
  if (!type) {
    return Status::InvalidArgument("tensor " + view.name + ": dtype " + DTypeName(view.dtype) +
                                   " has no torch equivalent here");
  }
  FW_ASSIGN_OR_RETURN(uint64_t bytes, TensorByteSize(view.dtype, view.shape));
  if (bytes != view.data.size()) {
    return Status::Corruption("tensor " + view.name + ": " + std::to_string(view.data.size()) +
                              " bytes for shape " + Shape(view.shape));
  }
  torch::Tensor out = torch::empty(view.shape, torch::TensorOptions().dtype(*type));
  if (bytes > 0) std::memcpy(out.data_ptr(), view.data.data(), bytes);
  return out;
}

Result<OwnedTensor> FromTorch(const std::string& name, const torch::Tensor& tensor, DType dtype) {
  auto type = TorchType(dtype);
  if (!type)
    return Status::InvalidArgument(std::string("cannot export to dtype ") + DTypeName(dtype));
  torch::Tensor cast = tensor.detach().to(torch::kCPU).to(*type).contiguous();
  OwnedTensor out;
  out.name = name;
  out.dtype = dtype;
  out.shape = cast.sizes().vec();
  out.data.resize(cast.numel() * cast.element_size());
  if (!out.data.empty()) std::memcpy(out.data.data(), cast.data_ptr(), out.data.size());
  return out;
}

Status LoadWeights(TransformerImpl& model, const CheckpointView& checkpoint,
                   const std::string& source) {
  std::map<std::string, const TensorView*> by_name;
  for (const TensorView& t : checkpoint) by_name[t.name] = &t;
  std::set<std::string> used;
  for (auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    if (IsAdapterName(name)) continue;
    auto it = by_name.find(name);
    if (it == by_name.end()) return Status::NotFound(source + ": missing tensor " + name);
    FW_RETURN_IF_ERROR(CopyInto(item.value(), *it->second, source));
    used.insert(name);
  }
  for (const TensorView& t : checkpoint) {
    if (used.count(t.name)) continue;
    const bool tolerated = (t.name == "lm_head.weight" && model.config().tie_word_embeddings) ||
                           t.name.find("rotary_emb.inv_freq") != std::string::npos;
    if (!tolerated) {
      return Status::InvalidArgument(source + ": tensor " + t.name +
                                     " is not a parameter of this model");
    }
  }
  return Status::Ok();
}

Status LoadAdapters(TransformerImpl& model, const CheckpointView& checkpoint,
                    const std::string& source) {
  if (!model.lora_enabled())
    return Status::InvalidArgument(source + ": the model has no LoRA adapters");
  std::map<std::string, const TensorView*> by_name;
  for (const TensorView& t : checkpoint) {
    std::string name = t.name;
    if (name == kAdapterConfigTensor) continue;
    if (name.rfind(kPeftPrefix, 0) == 0) name = name.substr(std::strlen(kPeftPrefix));
    if (!IsAdapterName(name)) {
      return Status::InvalidArgument(source + ": tensor " + t.name +
                                     " is not a LoRA adapter tensor");
    }
    by_name[name] = &t;
  }
  size_t found = 0;
  for (auto& item : model.named_parameters()) {
    if (!IsAdapterName(item.key())) continue;
    auto it = by_name.find(item.key());
    if (it == by_name.end())
      return Status::NotFound(source + ": missing adapter tensor " + item.key());
    FW_RETURN_IF_ERROR(CopyInto(item.value(), *it->second, source));
    ++found;
  }
  if (found != by_name.size()) {
    return Status::InvalidArgument(source +
                                   ": holds adapters for projections this model does not adapt");
  }
  return Status::Ok();
}

Result<OwnedCheckpoint> SnapshotWeights(TransformerImpl& model, DType dtype, bool adapters_only) {
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32) {
    return Status::InvalidArgument(std::string("serving dtype must be BF16, F16 or F32, got ") +
                                   DTypeName(dtype));
  }
  if (adapters_only && !model.lora_enabled()) {
    return Status::InvalidArgument("an adapters-only snapshot needs LoRA enabled");
  }
  OwnedCheckpoint out;
  for (auto& item : model.named_parameters()) {
    // Full snapshots carry the base tensors; adapter snapshots only the LoRA factors.
    if (IsAdapterName(item.key()) != adapters_only) continue;
    const std::string name = adapters_only ? kPeftPrefix + item.key() : item.key();
    FW_ASSIGN_OR_RETURN(OwnedTensor t, FromTorch(name, item.value(), dtype));
    out.tensors.push_back(std::move(t));
  }
  if (!adapters_only) {
    // Packed frozen experts: their dequantized values (exact in BF16 and F32).
    for (const auto& [name, packed] : model.PackedWeights()) {
      FW_ASSIGN_OR_RETURN(OwnedTensor t, FromTorch(name, packed->Dequantize(), dtype));
      out.tensors.push_back(std::move(t));
    }
  }
  if (adapters_only) {
    // The adapter config travels with the factors (and is covered by the same hash).
    const std::string text = AdapterConfigJson(model).dump();
    OwnedTensor config;
    config.name = kAdapterConfigTensor;
    config.dtype = DType::kU8;
    config.shape = {static_cast<int64_t>(text.size())};
    config.data.resize(text.size());
    std::memcpy(config.data.data(), text.data(), text.size());
    out.tensors.push_back(std::move(config));
  }
  return out;
}

nlohmann::json AdapterConfigJson(const TransformerImpl& model) {
  const LoraOptions& lora = model.lora().value();
  return {{"peft_type", "LORA"},
          {"r", lora.rank},
          {"lora_alpha", lora.alpha},
          {"target_modules", lora.targets},
          {"base_model_config", model.config().ToJson()}};
}

Status SaveModel(TransformerImpl& model, const std::string& path, DType dtype) {
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint snapshot, SnapshotWeights(model, dtype));
  return WriteSafetensors(path, snapshot.view(),
                          {{"config", model.config().ToJson().dump()}, {"format", "pt"}});
}

}  // namespace flywheel::model
