// What the trainer tests share: a tiny model config, a client that must be created,
// random ragged sequences, and copies of a client's parameters to compare.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <random>
#include <vector>

#include "tests/model/tiny_models.h"
#include "trainer/training_client.h"

namespace flywheel::trainer {

inline model::ModelConfig Tiny(bool moe = false) {
  return testing::TinyConfig({.vocab = 40, .experts = moe ? 4 : 0, .moe_intermediate = 32});
}

// Null (and a test failure) when Create fails.
inline std::unique_ptr<TrainingClient> MakeClient(TrainerOptions options) {
  auto client = TrainingClient::Create(std::move(options));
  EXPECT_TRUE(client.ok()) << client.status().ToString();
  return client.ok() ? std::move(*client) : nullptr;
}

// Random sequences; datum i predicts its own next token.
inline std::vector<Datum> Sequences(int count, int length, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Datum> out;
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> seq(length + 1);
    for (auto& t : seq) t = static_cast<int32_t>(rng() % vocab);
    Datum d;
    const int this_length = length - i % 3;  // ragged
    d.tokens.assign(seq.begin(), seq.begin() + this_length);
    d.target_tokens.assign(seq.begin() + 1, seq.begin() + this_length + 1);
    out.push_back(std::move(d));
  }
  return out;
}

// A copy of every parameter of the client's model, in order.
inline std::vector<torch::Tensor> Params(TrainingClient& client) {
  std::vector<torch::Tensor> out;
  for (const auto& p : client.model().named_parameters()) out.push_back(p.value().detach().clone());
  return out;
}

// Whether two parameter lists are equal, tensor by tensor, bit for bit.
inline bool AllEqual(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace flywheel::trainer
