// Checkpoints made up for tests: random bytes, and copies with a chosen fraction of words
// changed in realistic (+-1..2 ulp) or arbitrary ways.
#pragma once

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "delta/delta.h"
#include "checkpoint/hash.h"
#include "checkpoint/tensor.h"

namespace flywheel::testing {

// Collects a streamed (format-2) encode.
struct BytesSink : delta::StreamSink {
  Status Begin(uint64_t size_bound) override {
    bound = size_bound;
    return Status::Ok();
  }
  Status Write(std::span<const std::byte> more) override {
    bytes.insert(bytes.end(), more.begin(), more.end());
    return Status::Ok();
  }
  std::vector<std::byte> bytes;
  uint64_t bound = 0;
};

struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

inline OwnedCheckpoint RandomCheckpoint(const std::vector<TensorSpec>& specs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  OwnedCheckpoint ckpt;
  for (const TensorSpec& s : specs) {
    OwnedTensor t{s.name, s.dtype, s.shape, {}};
    t.data.resize(*TensorByteSize(s.dtype, s.shape));
    for (auto& b : t.data) b = static_cast<std::byte>(rng());
    ckpt.tensors.push_back(std::move(t));
  }
  return ckpt;
}

enum class Change { kSmallSteps, kArbitrary };

// Changes about `density` of the words of every tensor. Small steps add +-1 or +-2 to the
// word read as an integer of its width (one or two ulp of a float); arbitrary replaces it
// with a different random word.
inline OwnedCheckpoint Mutate(const OwnedCheckpoint& in, double density, uint64_t seed,
                              Change change = Change::kSmallSteps) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution pick(density);
  OwnedCheckpoint out = in;
  for (OwnedTensor& t : out.tensors) {
    const int w = DTypeWordBytes(t.dtype);
    const size_t words = t.data.size() / w;
    for (size_t i = 0; i < words; ++i) {
      if (!pick(rng)) continue;
      uint64_t v = 0;
      std::memcpy(&v, t.data.data() + i * w, w);
      uint64_t old = v;
      if (change == Change::kSmallSteps) {
        int64_t step = (rng() & 1 ? 1 : -1) * ((rng() % 10) == 0 ? 2 : 1);
        v += static_cast<uint64_t>(step);
      } else {
        do v = rng();
        while (w < 8 && ((v ^ old) & ((uint64_t{1} << (8 * w)) - 1)) == 0);
      }
      std::memcpy(t.data.data() + i * w, &v, w);
    }
  }
  return out;
}

inline bool SameBytes(const OwnedCheckpoint& a, const OwnedCheckpoint& b) {
  if (a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    if (a.tensors[i].name != b.tensors[i].name || a.tensors[i].data != b.tensors[i].data)
      return false;
  }
  return true;
}

// The checkpoint hash of `checkpoint`; a failure fails the calling test (and gives {}).
inline Hash128 HashOf(const OwnedCheckpoint& checkpoint) {
  Result<Hash128> hash = CheckpointHash(checkpoint.view());
  EXPECT_TRUE(hash.ok()) << hash.status().ToString();
  return hash.ok() ? *hash : Hash128{};
}

inline std::vector<TensorSpec> MixedSpecs() {
  return {
      {"model.embed_tokens.weight", DType::kBF16, {257, 64}},
      {"model.layers.0.self_attn.q_proj.weight", DType::kBF16, {64, 64}},
      {"model.layers.0.input_layernorm.weight", DType::kF32, {64}},
      {"model.layers.0.mlp.up_proj.weight", DType::kF16, {173, 64}},
      {"scalar", DType::kF64, {}},
      {"empty", DType::kBF16, {0, 7}},
      {"counts", DType::kI64, {33}},
      {"mask", DType::kBool, {101}},
      {"fp8", DType::kF8_E4M3, {3, 7}},
      {"fp4", DType::kF4, {10}},
      {"complex", DType::kC64, {5}},
  };
}

// Words (DTypeWordBytes each) that differ between two checkpoints of the same layout,
// counted directly: what the encoder's counts must equal.
inline uint64_t DirectlyChangedWords(const OwnedCheckpoint& before, const OwnedCheckpoint& after) {
  uint64_t changed = 0;
  for (size_t t = 0; t < after.tensors.size(); ++t) {
    const size_t word = static_cast<size_t>(DTypeWordBytes(after.tensors[t].dtype));
    const auto& a = before.tensors[t].data;
    const auto& b = after.tensors[t].data;
    for (size_t i = 0; i + word <= b.size(); i += word) {
      changed += !std::equal(a.begin() + i, a.begin() + i + word, b.begin() + i);
    }
  }
  return changed;
}

// Parse/Encode that record a failure in the running test (and return an empty result).
inline delta::DeltaView MustParse(const std::vector<std::byte>& bytes) {
  auto view = delta::DeltaView::Parse(bytes);
  EXPECT_TRUE(view.ok()) << view.status().ToString();
  return view.ok() ? *view : delta::DeltaView();
}

inline std::vector<std::byte> MustEncode(const OwnedCheckpoint& base, const OwnedCheckpoint& target,
                                         delta::EncodeOptions options = {}) {
  auto bytes = delta::Encode(base.view(), target.view(), options);
  EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
  return bytes.ok() ? *bytes : std::vector<std::byte>();
}

}  // namespace flywheel::testing
