// Generated checkpoint pairs for the codec benchmark.
//
// A generated checkpoint looks like a small decoder-only transformer (HF tensor names,
// e.g. `model.layers.3.self_attn.q_proj.weight`) scaled to a requested size. Its fp32
// master weights start at ~N(0, 0.02) (norm weights at 1.0) and take AdamW steps with
// fresh N(0, 1) gradients; after every step the masters are cast to bf16 with
// round-to-nearest-even, which is the serving checkpoint a trainer would publish. Most
// Adam updates (about the learning rate) are far below one bf16 ulp of a weight of
// magnitude ~0.02, so only a few percent of the bf16 words change per step at lr 1e-6:
// the sparsity the delta codec is built for.
//
// Generation is deterministic for a given seed: the random streams are tied to fixed
// blocks of parameters, not to threads, so the thread count changes only the speed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <functional>

#include "base/status.h"
#include "checkpoint/tensor.h"

namespace flywheel::bench {

// Dimensions of the generated model (no GQA, tied embeddings, no biases).
struct TransformerShape {
  int64_t hidden = 0;
  int64_t intermediate = 0;  // ~2.75 * hidden, a multiple of 64
  int64_t layers = 0;
  int64_t vocab = 0;

  // Parameters of all tensors together.
  uint64_t parameters() const;
};

// Picks a shape whose bf16 checkpoint is about `checkpoint_bytes`: hidden 1024 (halved for
// small sizes, down to 64), about three quarters of the parameters in layers and the rest
// in the embedding (whose vocab is chosen to fill the budget, rounded to 64).
TransformerShape ShapeForBytes(uint64_t checkpoint_bytes);

// One tensor of a generated checkpoint and where its words lie in the concatenated buffer.
struct TensorLayout {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t word_offset = 0;  // in bf16 words from the start of the buffer
  uint64_t words = 0;
  bool is_norm = false;  // RMSNorm weight: initialised to 1.0 instead of N(0, 0.02)
};

// The tensors of `shape` in HF order: embed_tokens, then per layer input_layernorm,
// q/k/v/o_proj, post_attention_layernorm, gate/up/down_proj, then the final norm.
std::vector<TensorLayout> TransformerTensors(const TransformerShape& shape);

// The generators' random streams: the words are cut into blocks of kBlockWords, and each
// (step, block) has its own stream seeded from StreamState, so the output does not depend
// on the thread count.
inline constexpr uint64_t kBlockWords = 1 << 16;
inline uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t StreamState(uint64_t seed, uint64_t step, uint64_t block);

// The bf16 tensors of `tensors` over `words` (which must hold the layout's words).
CheckpointView Bf16View(const std::vector<TensorLayout>& tensors, const std::vector<uint16_t>& words);

struct AdamWConfig {
  double learning_rate = 1e-6;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double epsilon = 1e-8;
  double weight_decay = 0.01;  // decoupled: p -= lr * weight_decay * p
};

struct GeneratorOptions {
  uint64_t checkpoint_bytes = 128ull << 20;
  AdamWConfig adamw;
  // The pair is (bf16 after step adam_steps - 1, bf16 after step adam_steps); step 0 is
  // the initialisation. REQUIRES: adam_steps >= 1.
  int adam_steps = 3;
  uint64_t seed = 1;
  int threads = 2;
  double init_stddev = 0.02;
};

// Two consecutive bf16 serving checkpoints over one layout. The views returned point
// into this object: keep it alive (and unmoved) while they are used.
struct CheckpointPair {
  TransformerShape shape;
  std::vector<TensorLayout> tensors;
  std::vector<uint16_t> base;    // bf16 bit patterns after step k-1, tensors concatenated
  std::vector<uint16_t> target;  // after step k

  uint64_t bytes() const { return base.size() * sizeof(uint16_t); }
  CheckpointView BaseView() const { return ViewOf(base); }
  CheckpointView TargetView() const { return ViewOf(target); }
  // Views of the same layout over another buffer of bytes() bytes (e.g. an apply target).
  CheckpointView ViewOf(const std::vector<uint16_t>& words) const;
  MutableCheckpointView MutableViewOf(std::vector<uint16_t>& words) const;
};

// Generates the pair; fails on unusable options (size too small, adam_steps < 1).
Result<CheckpointPair> GenerateCheckpointPair(const GeneratorOptions& options);

// A run of consecutive bf16 serving checkpoints from one simulation (options.adam_steps is
// ignored): `each(step, view)` is called after AdamW steps 1..versions with the bf16 words
// of that step; its error stops the run and is returned. Also returns the layout's shape.
Status GenerateCheckpointSequence(
    const GeneratorOptions& options, int versions,
    const std::function<Status(int step, const CheckpointView& view)>& each);

// fp32 -> bf16 with round-to-nearest-even. NaN stays NaN (sign kept, quiet bit set) rather
// than rounding into infinity; values past the largest bf16 round to infinity.
uint16_t FloatToBf16(float value);
float Bf16ToFloat(uint16_t bits);

}  // namespace flywheel::bench
