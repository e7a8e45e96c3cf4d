#include "bench/checkpoint_gen.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <thread>

#include "bench/util.h"
#include "checkpoint/parallel.h"

namespace flywheel::bench {
uint64_t StreamState(uint64_t seed, uint64_t step, uint64_t block) {
  uint64_t key = seed;
  key = SplitMix64(key) ^ (step * 0xD1B54A32D192ED03ull);
  key = SplitMix64(key) ^ (block * 0x8CB92BA72F3D8DD7ull);
  return SplitMix64(key);
}

namespace {

// xoshiro256+ (Blackman & Vigna). Its lowest bits are weak, so callers use the high ones.
class Xoshiro256Plus {
 public:
  explicit Xoshiro256Plus(uint64_t seed) {
    for (uint64_t& word : state_) word = SplitMix64(seed);
  }
  uint64_t Next() {
    const uint64_t result = state_[0] + state_[3];
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = (state_[3] << 45) | (state_[3] >> 19);
    return result;
  }

 private:
  uint64_t state_[4];
};

// The stream of one (step, block): independent of which thread runs it.
Xoshiro256Plus StreamFor(uint64_t seed, uint64_t step, uint64_t block) {
  return Xoshiro256Plus(StreamState(seed, step, block));
}

// ln(x) for normal positive finite x, to ~1e-7 relative: x = m * 2^e with m in
// [sqrt(1/2), sqrt(2)), ln(m) = 2 atanh(t) with t = (m - 1) / (m + 1), |t| <= 0.172.
// Branch-free and call-free so that the loops below vectorise.
inline float FastLog(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  // Shifting by the bits of sqrt(1/2) puts m in [sqrt(1/2), sqrt(2)).
  const uint32_t shifted = bits - 0x3F3504F3u;
  const int32_t exponent = static_cast<int32_t>(shifted) >> 23;
  const uint32_t mantissa_bits = (shifted & 0x007FFFFFu) + 0x3F3504F3u;
  float m;
  std::memcpy(&m, &mantissa_bits, sizeof(m));
  const float t = (m - 1.0f) / (m + 1.0f);
  const float t2 = t * t;
  const float series = 1.0f + t2 * (1.0f / 3 + t2 * (1.0f / 5 + t2 * (1.0f / 7 + t2 * (1.0f / 9))));
  return 2.0f * t * series + static_cast<float>(exponent) * 0.69314718f;
}

// sqrt(x) for x >= 0 to ~1e-7 relative, call-free (sqrtf's errno path stops -O2 from
// vectorising): a bit-level guess of 1/sqrt(x) and three Newton steps.
inline float FastSqrt(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t guess_bits = 0x5F375A86u - (bits >> 1);
  float inverse;
  std::memcpy(&inverse, &guess_bits, sizeof(inverse));
  for (int i = 0; i < 3; ++i) inverse *= 1.5f - 0.5f * x * inverse * inverse;
  return x * inverse;  // 0 for x == 0: the guess stays finite
}

// Box-Muller over a fixed batch (a compile-time trip count lets -O2 vectorise it). Each
// 64-bit draw gives two 24-bit uniforms (bits 40..63 and 16..39; the low bits of
// xoshiro256+ are weak) and two normals, written to out[i] and out[i + kPairs].
constexpr int kPairs = 256;
void NormalBatch(Xoshiro256Plus& rng, float* out) {
  constexpr float kUnit = 1.0f / 16777216.0f;  // 2^-24
  constexpr float kPi = 3.14159265358979f;
  float radius_input[kPairs];
  float angle_input[kPairs];
  for (int i = 0; i < kPairs; ++i) {
    const uint64_t bits = rng.Next();
    radius_input[i] = static_cast<float>((bits >> 40) + 1) * kUnit;  // (0, 1]
    angle_input[i] = static_cast<float>((bits >> 16) & 0xFFFFFF) * kUnit;
  }
  for (int i = 0; i < kPairs; ++i) {
    const float radius = FastSqrt(-2.0f * FastLog(radius_input[i]));
    // Angle a = 2 pi (u2 - 1/2) in [-pi, pi); with h = a / 2 in [-pi/2, pi/2):
    // sin a = 2 sin h cos h, cos a = 1 - 2 sin^2 h (Taylor series to ~1e-7).
    const float h = kPi * (angle_input[i] - 0.5f);
    const float h2 = h * h;
    const float sin_h =
        h *
        (1.0f + h2 * (-1.0f / 6 +
                      h2 * (1.0f / 120 +
                            h2 * (-1.0f / 5040 + h2 * (1.0f / 362880 + h2 * (-1.0f / 39916800))))));
    const float cos_h =
        1.0f +
        h2 * (-0.5f +
              h2 * (1.0f / 24 + h2 * (-1.0f / 720 + h2 * (1.0f / 40320 + h2 * (-1.0f / 3628800)))));
    out[i] = radius * (1.0f - 2.0f * sin_h * sin_h);
    out[i + kPairs] = radius * (2.0f * sin_h * cos_h);
  }
}

// Fills `out` with independent N(0, 1) values.
void FillStandardNormals(Xoshiro256Plus& rng, std::span<float> out) {
  size_t done = 0;
  for (; done + 2 * kPairs <= out.size(); done += 2 * kPairs) NormalBatch(rng, out.data() + done);
  if (done < out.size()) {
    float batch[2 * kPairs];
    NormalBatch(rng, batch);
    std::copy_n(batch, out.size() - done, out.data() + done);
  }
}

struct AdamWConstants {
  float beta1, beta2, epsilon;
  float decay;                    // lr * weight_decay
  float step_size;                // lr / (1 - beta1^t)
  float inverse_sqrt_correction;  // 1 / sqrt(1 - beta2^t)
};

// One AdamW update (PyTorch's order: decoupled decay, then the Adam step) of `count`
// parameters. Called with count == kAdamBatch, a compile-time trip count lets -O2
// vectorise it.
constexpr uint64_t kAdamBatch = 256;
inline void AdamWUpdate(const AdamWConstants& c, const float* __restrict gradient,
                        float* __restrict master, float* __restrict moment1,
                        float* __restrict moment2, uint64_t count) {
  for (uint64_t i = 0; i < count; ++i) {
    const float g = gradient[i];
    const float m = c.beta1 * moment1[i] + (1.0f - c.beta1) * g;
    const float v = c.beta2 * moment2[i] + (1.0f - c.beta2) * g * g;
    const float denominator = FastSqrt(v) * c.inverse_sqrt_correction + c.epsilon;
    const float decayed = master[i] - c.decay * master[i];
    moment1[i] = m;
    moment2[i] = v;
    master[i] = decayed - c.step_size * m / denominator;
  }
}

// fp32 master weights and AdamW moments over the concatenated tensors.
class AdamWSimulation {
 public:
  AdamWSimulation(const std::vector<TensorLayout>& tensors, uint64_t words,
                  const GeneratorOptions& options)
      : tensors_(tensors),
        options_(options),
        words_(words),
        master_(new float[words]),
        moment1_(new float[words]),
        moment2_(new float[words]) {}

  void Initialise() {
    const float stddev = static_cast<float>(options_.init_stddev);
    ForEachBlock(/*step=*/0, [&](uint64_t begin, uint64_t end, Xoshiro256Plus& rng) {
      std::span<float> block(master_.get() + begin, end - begin);
      FillStandardNormals(rng, block);
      for (float& weight : block) weight *= stddev;
      // First touch of the moments here too, so page faults are spread over the threads.
      std::fill(moment1_.get() + begin, moment1_.get() + end, 0.0f);
      std::fill(moment2_.get() + begin, moment2_.get() + end, 0.0f);
    });
    for (const TensorLayout& tensor : tensors_) {
      if (!tensor.is_norm) continue;
      std::fill_n(master_.get() + tensor.word_offset, tensor.words, 1.0f);
    }
  }

  // AdamW step `step` (1-based, for the bias correction) with fresh N(0, 1) gradients.
  void Step(int step) {
    const AdamWConfig& adamw = options_.adamw;
    AdamWConstants constants;
    constants.beta1 = static_cast<float>(adamw.beta1);
    constants.beta2 = static_cast<float>(adamw.beta2);
    constants.epsilon = static_cast<float>(adamw.epsilon);
    constants.decay = static_cast<float>(adamw.learning_rate * adamw.weight_decay);
    constants.step_size =
        static_cast<float>(adamw.learning_rate / (1.0 - std::pow(adamw.beta1, step)));
    constants.inverse_sqrt_correction =
        static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(adamw.beta2, step)));
    ForEachBlock(step, [&](uint64_t begin, uint64_t end, Xoshiro256Plus& rng) {
      float gradient[kBlockWords];
      const uint64_t count = end - begin;
      FillStandardNormals(rng, std::span<float>(gradient, count));
      uint64_t done = 0;
      for (; done + kAdamBatch <= count; done += kAdamBatch) {
        AdamWUpdate(constants, gradient + done, master_.get() + begin + done,
                    moment1_.get() + begin + done, moment2_.get() + begin + done, kAdamBatch);
      }
      AdamWUpdate(constants, gradient + done, master_.get() + begin + done,
                  moment1_.get() + begin + done, moment2_.get() + begin + done, count - done);
    });
  }

  void CastToBf16(std::vector<uint16_t>& out) const {
    out.resize(words_);
    const uint64_t blocks = (words_ + kBlockWords - 1) / kBlockWords;
    ParallelFor(blocks, options_.threads, [&](uint64_t block) {
      const uint64_t begin = block * kBlockWords;
      const uint64_t end = std::min<uint64_t>(begin + kBlockWords, words_);
      for (uint64_t i = begin; i < end; ++i) out[i] = FloatToBf16(master_[i]);
    });
  }

 private:
  template <typename Fn>
  void ForEachBlock(uint64_t step, const Fn& fn) {
    const uint64_t blocks = (words_ + kBlockWords - 1) / kBlockWords;
    ParallelFor(blocks, options_.threads, [&](uint64_t block) {
      Xoshiro256Plus rng = StreamFor(options_.seed, step, block);
      const uint64_t begin = block * kBlockWords;
      fn(begin, std::min(begin + kBlockWords, words_), rng);
    });
  }

  const std::vector<TensorLayout>& tensors_;
  const GeneratorOptions& options_;
  const uint64_t words_;
  // Left uninitialised by the allocation; Initialise() writes them block by block.
  std::unique_ptr<float[]> master_;
  std::unique_ptr<float[]> moment1_;
  std::unique_ptr<float[]> moment2_;
};

}  // namespace

uint64_t TransformerShape::parameters() const {
  const uint64_t per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden;
  return vocab * hidden + layers * per_layer + hidden;
}

TransformerShape ShapeForBytes(uint64_t checkpoint_bytes) {
  const double budget = static_cast<double>(checkpoint_bytes / sizeof(uint16_t));
  auto per_layer = [](int64_t hidden, int64_t intermediate) {
    return static_cast<double>(4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden);
  };
  auto intermediate_for = [](int64_t hidden) {
    return std::max<int64_t>(64, (hidden * 11 / 4 + 32) / 64 * 64);
  };
  TransformerShape shape;
  shape.hidden = 1024;
  // Halve the width until two layers fit, so small sizes still look like a model.
  while (shape.hidden > 64 &&
         budget < 2 * per_layer(shape.hidden, intermediate_for(shape.hidden))) {
    shape.hidden /= 2;
  }
  shape.intermediate = intermediate_for(shape.hidden);
  const double layer_params = per_layer(shape.hidden, shape.intermediate);
  shape.layers = std::max<int64_t>(1, std::llround(0.75 * budget / layer_params));
  while (shape.layers > 1 && shape.layers * layer_params + 64.0 * shape.hidden > budget) {
    --shape.layers;
  }
  const double left = budget - shape.layers * layer_params - shape.hidden;
  shape.vocab = std::max<int64_t>(64, static_cast<int64_t>(left / shape.hidden) / 64 * 64);
  return shape;
}

std::vector<TensorLayout> TransformerTensors(const TransformerShape& shape) {
  std::vector<TensorLayout> tensors;
  uint64_t offset = 0;
  auto add = [&](std::string name, std::vector<int64_t> dims, bool is_norm) {
    uint64_t words = 1;
    for (int64_t dim : dims) words *= static_cast<uint64_t>(dim);
    tensors.push_back({std::move(name), std::move(dims), offset, words, is_norm});
    offset += words;
  };
  const int64_t h = shape.hidden;
  const int64_t i = shape.intermediate;
  add("model.embed_tokens.weight", {shape.vocab, h}, false);
  for (int64_t layer = 0; layer < shape.layers; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    add(prefix + "input_layernorm.weight", {h}, true);
    add(prefix + "self_attn.q_proj.weight", {h, h}, false);
    add(prefix + "self_attn.k_proj.weight", {h, h}, false);
    add(prefix + "self_attn.v_proj.weight", {h, h}, false);
    add(prefix + "self_attn.o_proj.weight", {h, h}, false);
    add(prefix + "post_attention_layernorm.weight", {h}, true);
    add(prefix + "mlp.gate_proj.weight", {i, h}, false);
    add(prefix + "mlp.up_proj.weight", {i, h}, false);
    add(prefix + "mlp.down_proj.weight", {h, i}, false);
  }
  add("model.norm.weight", {h}, true);
  return tensors;
}

CheckpointView CheckpointPair::ViewOf(const std::vector<uint16_t>& words) const {
  return Bf16View(tensors, words);
}

CheckpointView Bf16View(const std::vector<TensorLayout>& tensors, const std::vector<uint16_t>& words) {
  CheckpointView view;
  view.reserve(tensors.size());
  const auto* bytes = reinterpret_cast<const std::byte*>(words.data());
  for (const TensorLayout& tensor : tensors) {
    view.push_back(TensorView{tensor.name,
                              DType::kBF16,
                              tensor.shape,
                              {bytes + tensor.word_offset * 2, tensor.words * 2}});
  }
  return view;
}

MutableCheckpointView CheckpointPair::MutableViewOf(std::vector<uint16_t>& words) const {
  MutableCheckpointView view;
  view.reserve(tensors.size());
  auto* bytes = reinterpret_cast<std::byte*>(words.data());
  for (const TensorLayout& tensor : tensors) {
    view.push_back(MutableTensorView{tensor.name,
                                     DType::kBF16,
                                     tensor.shape,
                                     {bytes + tensor.word_offset * 2, tensor.words * 2}});
  }
  return view;
}

Result<CheckpointPair> GenerateCheckpointPair(const GeneratorOptions& options) {
  if (options.adam_steps < 1) {
    return Status::InvalidArgument("adam_steps must be >= 1, got " +
                                   std::to_string(options.adam_steps));
  }
  if (options.checkpoint_bytes < (64ull << 10)) {
    return Status::InvalidArgument("checkpoint size must be at least 64 KiB, got " +
                                   std::to_string(options.checkpoint_bytes) + " bytes");
  }
  if (options.threads < 1) {
    return Status::InvalidArgument("threads must be >= 1, got " + std::to_string(options.threads));
  }
  CheckpointPair pair;
  pair.shape = ShapeForBytes(options.checkpoint_bytes);
  pair.tensors = TransformerTensors(pair.shape);
  const uint64_t words = pair.tensors.back().word_offset + pair.tensors.back().words;

  AdamWSimulation simulation(pair.tensors, words, options);
  simulation.Initialise();
  if (options.adam_steps == 1) simulation.CastToBf16(pair.base);
  for (int step = 1; step <= options.adam_steps; ++step) {
    simulation.Step(step);
    if (step == options.adam_steps - 1) simulation.CastToBf16(pair.base);
  }
  simulation.CastToBf16(pair.target);
  return pair;
}

Status GenerateCheckpointSequence(
    const GeneratorOptions& options, int versions,
    const std::function<Status(int step, const CheckpointView& view)>& each) {
  GeneratorOptions checked = options;
  checked.adam_steps = std::max(1, versions);
  CheckpointPair layout;  // validation and the layout only; no steps run here
  if (options.checkpoint_bytes < (64ull << 10) || options.threads < 1 || versions < 1) {
    return Status::InvalidArgument("checkpoint sequence: size >= 64 KiB, threads >= 1 and "
                                   "versions >= 1 required");
  }
  layout.shape = ShapeForBytes(options.checkpoint_bytes);
  layout.tensors = TransformerTensors(layout.shape);
  const uint64_t words = layout.tensors.back().word_offset + layout.tensors.back().words;
  AdamWSimulation simulation(layout.tensors, words, checked);
  simulation.Initialise();
  std::vector<uint16_t> bf16;
  for (int step = 1; step <= versions; ++step) {
    simulation.Step(step);
    simulation.CastToBf16(bf16);
    FW_RETURN_IF_ERROR(each(step, Bf16View(layout.tensors, bf16)));
  }
  return Status::Ok();
}

uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    // NaN: truncating could clear every mantissa bit left (turning it into infinity), and
    // rounding could carry into the sign; keep the sign and force a quiet NaN.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  const uint32_t rounding_bias = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float Bf16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

}  // namespace flywheel::bench
