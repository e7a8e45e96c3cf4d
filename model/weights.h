// Model weights <-> safetensors checkpoints with Hugging Face tensor names.
#pragma once

#include <torch/torch.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "base/status.h"
#include "checkpoint/tensor.h"
#include "model/model.h"

namespace flywheel::model {

// Copies every parameter of `model` from `checkpoint` (F32, BF16 or F16; converted to the
// parameter's fp32). Every parameter must be present with its exact shape; tensors the
// model does not have are errors too, except `lm_head.weight` of a tied model and
// rotary `inv_freq` buffers, which HF checkpoints sometimes carry. LoRA adapter tensors
// are only looked up when the model has adapters and `adapters_only` is false.
// `source` names the checkpoint in messages.
Status LoadWeights(TransformerImpl& model, const CheckpointView& checkpoint,
                   const std::string& source);

// Loads LoRA adapter tensors (as written by SnapshotWeights with adapters_only) into a model
// whose adapters are enabled; accepts PEFT's `base_model.model.` prefix.
Status LoadAdapters(TransformerImpl& model, const CheckpointView& checkpoint,
                    const std::string& source);

// The model's parameters cast to `dtype` (BF16, F16 or F32) under their HF names: all of
// them, or with `adapters_only` just the LoRA tensors under PEFT names
// (`base_model.model.<name>`) plus the U8 tensor kAdapterConfigTensor holding
// AdapterConfigJson() as UTF-8 (so the config syncs and hashes with the factors). The cast
// rounds to nearest even, as torch's .to() does.
Result<OwnedCheckpoint> SnapshotWeights(TransformerImpl& model, DType dtype,
                                        bool adapters_only = false);

inline constexpr const char* kAdapterConfigTensor = "flywheel.adapter_config";
// In a version served to workers, session <name>'s adapter rides beside the base weights as
// "flywheel.adapters/<name>/" + the adapters-only snapshot's tensor names (its PEFT factors
// and its kAdapterConfigTensor): the training service's LoRA sessions. Workers load each
// such group as adapter <name> (rollout/worker_engine.h) and ignore them as base weights.
inline constexpr const char* kServedAdapterPrefix = "flywheel.adapters/";
// PEFT's adapter_config.json fields (peft_type, r, lora_alpha, target_modules) plus the base
// model's config. REQUIRES: LoRA enabled.
nlohmann::json AdapterConfigJson(const TransformerImpl& model);

// Safetensors bytes <-> tensors.
Result<torch::Tensor> ToTorch(const TensorView& view);  // a copy, in the view's dtype
Result<OwnedTensor> FromTorch(const std::string& name, const torch::Tensor& tensor, DType dtype);

// A model's own checkpoint file: config in the metadata ("config" = config.json text).
Status SaveModel(TransformerImpl& model, const std::string& path, DType dtype = DType::kBF16);

}  // namespace flywheel::model
