// The engine's compute weights kept in step with the sync worker's serving copy.
//
// The serving copy (bf16 by default, the bits that deltas patch and hashes cover) is the
// source of truth. This CPU has no fast bf16 matmul, so the engine computes on an fp32
// mirror: the model's parameters. A bf16 -> fp32 conversion is exact, so the mirror holds
// exactly the served values. On every swap the mirror is patched only at the words the
// delta wrote (sync::SwapEvent::changes); it is converted wholesale only at load and when a
// keyframe arrives in a new layout.
#pragma once

#include <torch/torch.h>

#include "base/status.h"
#include "delta/delta.h"
#include "delta/tensor.h"
#include "model/model.h"

namespace flywheel::rollout {

struct MirrorStats {
  uint64_t words_patched = 0;
  uint64_t tensors_ignored = 0;  // serving tensors the model has no parameter for
};

// Loads every parameter of `model` from `weights` (BF16, F16 or F32, same shapes).
Status LoadMirror(model::TransformerImpl& model, const CheckpointView& weights);
// LoadMirror, and when it fails half-way, LoadMirror(*previous) (the version served before;
// null: none to go back to), so that a refused keyframe leaves the mirror as it was.
Status LoadMirrorOrRestore(model::TransformerImpl& model, const CheckpointView& weights,
                           const CheckpointView* previous);

// fp32 serving without a mirror: the model's parameters become views of the served F32
// tensors themselves (no copy). Deltas the sync worker applies in place show up in the
// model at once, so engine steps must not overlap an apply (ServingOptions::step_guard);
// a keyframe decoded into new buffers needs AliasWeights again. Errors name a missing,
// misshapen or non-F32 tensor.
Status AliasWeights(model::TransformerImpl& model, const CheckpointView& weights);
// Whether every tensor of `weights` is F32 (the worker then serves without a mirror).
bool AllF32(const CheckpointView& weights);

// Patches the parameters at `changes` (indices into `weights`, the new serving copy).
// Tensors of `weights` without a parameter of that name are counted, not errors (an
// adapter config rides along with adapters).
Result<MirrorStats> PatchMirror(model::TransformerImpl& model, const CheckpointView& weights,
                                const std::vector<delta::ChangedWords>& changes);

}  // namespace flywheel::rollout
