// The engine's compute weights kept in step with the sync worker's serving copy.
//
// The serving copy (bf16 by default, the bits that deltas patch and hashes cover) is the
// source of truth. This CPU has no fast bf16 matmul, so the engine computes on an fp32
// mirror: the model's parameters. A bf16 -> fp32 conversion is exact, so the mirror holds
// exactly the served values. On every swap the mirror is patched only at the words the
// delta wrote (sync::SwapEvent::changes); it is converted wholesale only at load and when a
// keyframe arrives in a new layout.
//
// FP8 serving (model/fp8.h): a projection weight served as F8_E4M3 `<name>` with block
// scales `<name>_scale_inv` is mirrored as its fp32 dequantization (DequantizeBlockwise, the
// product in fp32). A delta that writes bytes of `<name>` re-dequantizes exactly those
// elements; one that writes words of `<name>_scale_inv` re-dequantizes each whole block
// whose scale changed. Either way the mirror equals a fresh dequantization of the served
// version, bit for bit, after every swap. `fp8_block` is the weight_block_size the version
// was quantized with (config.json's quantization_config; HF's 128 by default).
#pragma once

#include <torch/torch.h>

#include "base/status.h"
#include "delta/delta.h"
#include "checkpoint/tensor.h"
#include "model/fp8.h"
#include "model/model.h"

namespace flywheel::rollout {

struct MirrorStats {
  // Mirror elements written: the delta's changed words, plus every element of an FP8 block
  // whose scale changed.
  uint64_t words_patched = 0;
  // Serving tensors the model has no parameter for (an FP8 weight's scale tensor is not
  // counted: it is its weight's).
  uint64_t tensors_ignored = 0;
};

// Loads every parameter of `model` from `weights` (BF16, F16 or F32, same shapes; with any
// F8_E4M3 tensor, model::LoadFp8Weights with blocks of `fp8_block`).
Status LoadMirror(model::TransformerImpl& model, const CheckpointView& weights,
                  int64_t fp8_block = model::kFp8BlockSize);
// LoadMirror, and when it fails half-way, LoadMirror(*previous) (the version served before;
// null: none to go back to), so that a refused keyframe leaves the mirror as it was.
Status LoadMirrorOrRestore(model::TransformerImpl& model, const CheckpointView& weights,
                           const CheckpointView* previous,
                           int64_t fp8_block = model::kFp8BlockSize);

// fp32 serving without a mirror: the model's parameters become views of the served F32
// tensors themselves (no copy). Deltas the sync worker applies in place show up in the
// model at once, so engine steps must not overlap an apply (ServingOptions::step_guard);
// a keyframe decoded into new buffers needs AliasWeights again. Errors name a missing,
// misshapen or non-F32 tensor.
Status AliasWeights(model::TransformerImpl& model, const CheckpointView& weights);
// Whether every tensor of `weights` is F32 (the worker then serves without a mirror). An FP8
// version (F8_E4M3 weights) never is: it is computed from the mirror.
bool AllF32(const CheckpointView& weights);

// Patches the parameters at `changes` (indices into `weights`, the new serving copy).
// Tensors of `weights` without a parameter of that name are counted, not errors (an
// adapter config rides along with adapters). F8_E4M3 weights as in the file comment; their
// scale tensors must be F32, BF16 or F16 of Fp8ScaleShape(rows, cols, fp8_block), all
// finite. Everything is checked before the first word is written: an error (misshapen or
// missing scales, a change out of range) leaves the mirror as it was.
// REQUIRES: fp8_block > 0.
Result<MirrorStats> PatchMirror(model::TransformerImpl& model, const CheckpointView& weights,
                                const std::vector<delta::ChangedWords>& changes,
                                int64_t fp8_block = model::kFp8BlockSize);

}  // namespace flywheel::rollout
