// FP8 serving snapshots (model/fp8.h): the E4M3FN codec against a reference written here
// from the format's definition, block quantization (shapes, scales, error bound, determinism,
// stability, partial dequantization), and HF-layout snapshots of a tiny model loaded back,
// including a checkpoint built by hand and malformed ones refused by name.
#include "model/fp8.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <set>

#include "checkpoint/safetensors.h"
#include "model/model.h"
#include "model/weights.h"
#include "tests/model/tiny_models.h"

namespace flywheel::model {
namespace {

namespace fs = std::filesystem;

// ---- The reference, from the definition of E4M3FN ----
// 1 sign bit, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is subnormal
// (2^-6 * m/8); S.1111.111 is NaN; no infinity.

double ReferenceDecode(int code) {
  const int sign = code >> 7, exponent = (code >> 3) & 15, mantissa = code & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = exponent == 0 ? std::pow(2.0, -6) * (mantissa / 8.0)
                                         : std::pow(2.0, exponent - 7) * (1.0 + mantissa / 8.0);
  return sign ? -magnitude : magnitude;
}

// Nearest finite E4M3 value by distance, ties to the code with an even mantissa, |x| >= 448
// (inf included) saturating to 448, NaN to S.1111.111.
int ReferenceEncode(float x) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7F;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448) return sign | 0x7E;
  // Positive codes 0x00..0x7E increase with their value: the last one at or below a.
  int low = 0;
  while (low + 1 <= 0x7E && ReferenceDecode(low + 1) <= a) ++low;
  if (ReferenceDecode(low) == a) return sign | low;
  const int high = low + 1;
  const double below = a - ReferenceDecode(low), above = ReferenceDecode(high) - a;
  if (below < above) return sign | low;
  if (above < below) return sign | high;
  return sign | ((low & 1) == 0 ? low : high);
}

bool SameBits(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// ---- (a) E4M3FN scalars ----

TEST(E4M3Test, EveryCodeDecodesAsDefined) {
  for (int code = 0; code < 256; ++code) {
    const double expected = ReferenceDecode(code);
    const float got = E4M3ToFloat(static_cast<uint8_t>(code));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << code;
      EXPECT_TRUE(code == 0x7F || code == 0xFF) << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), expected) << code;
      EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << code;
    }
  }
  EXPECT_EQ(E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
}

TEST(E4M3Test, EveryFiniteCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    EXPECT_EQ(FloatToE4M3(E4M3ToFloat(static_cast<uint8_t>(code))), code) << code;
  }
}

// Every midpoint between neighbouring codes (ties), the floats one ulp either side of it,
// and each code's own value one ulp either side, for both signs.
TEST(E4M3Test, CodeBoundariesRoundToNearestEven) {
  int checked = 0;
  for (int sign : {0, 0x80}) {
    for (int low = 0; low < 0x7E; ++low) {
      const float a = static_cast<float>(ReferenceDecode(sign | low));
      const float b = static_cast<float>(ReferenceDecode(sign | (low + 1)));
      const float mid = static_cast<float>((static_cast<double>(a) + b) / 2);
      ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(a) + b) / 2) << "not exact";
      const float toward_zero = std::nextafter(mid, 0.0f);
      const float away = std::nextafter(mid, sign ? -1e9f : 1e9f);
      const int even = (low & 1) == 0 ? low : low + 1;
      EXPECT_EQ(FloatToE4M3(mid), sign | even) << mid;
      EXPECT_EQ(FloatToE4M3(toward_zero), sign | low) << toward_zero;
      EXPECT_EQ(FloatToE4M3(away), sign | (low + 1)) << away;
      for (float x : {a, std::nextafter(a, 0.0f), std::nextafter(a, sign ? -1e9f : 1e9f)}) {
        EXPECT_EQ(FloatToE4M3(x), ReferenceEncode(x)) << x;
        ++checked;
      }
      checked += 3;
    }
  }
  EXPECT_GT(checked, 1500);
}

// A strided sweep over all float bit patterns (normal, subnormal, huge), both signs.
TEST(E4M3Test, MatchesTheReferenceOnASweepOfAllFloats) {
  int mismatches = 0;
  for (uint64_t bits = 0; bits < 0x80000000u; bits += 2003) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float x = std::bit_cast<float>(static_cast<uint32_t>(bits) | sign);
      if (FloatToE4M3(x) != ReferenceEncode(x) && ++mismatches < 10) {
        ADD_FAILURE() << x << ": " << int(FloatToE4M3(x)) << " vs " << ReferenceEncode(x);
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(E4M3Test, OverflowAndInfinitySaturate) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {448.0f, std::nextafter(448.0f, 1e9f), 449.0f, 463.99f, 464.0f, 479.99f, 480.0f,
                  1e6f, std::numeric_limits<float>::max(), inf}) {
    EXPECT_EQ(FloatToE4M3(x), 0x7E) << x;
    EXPECT_EQ(FloatToE4M3(-x), 0xFE) << x;
  }
  // Below the largest value: 416 and 448 are neighbours, 432 ties to 448 (mantissa 110).
  EXPECT_EQ(FloatToE4M3(432.0f), 0x7E);
  EXPECT_EQ(FloatToE4M3(std::nextafter(432.0f, 0.0f)), 0x7D);
}

TEST(E4M3Test, NaNKeepsItsSign) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FloatToE4M3(nan), 0x7F);
  EXPECT_EQ(FloatToE4M3(-nan), 0xFF);
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::signaling_NaN()), 0x7F);
  EXPECT_EQ(FloatToE4M3(std::bit_cast<float>(0xFFC00001u)), 0xFF);
  EXPECT_TRUE(std::isnan(E4M3ToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(E4M3ToFloat(0xFF)));
  EXPECT_TRUE(std::signbit(E4M3ToFloat(0xFF)));
}

TEST(E4M3Test, SignedZerosAndSubnormals) {
  EXPECT_EQ(FloatToE4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
  EXPECT_TRUE(SameBits(E4M3ToFloat(0x80), -0.0f));
  const float unit = std::ldexp(1.0f, -9);  // the smallest subnormal
  EXPECT_EQ(FloatToE4M3(unit), 0x01);
  EXPECT_EQ(FloatToE4M3(-unit), 0x81);
  EXPECT_EQ(FloatToE4M3(unit / 2), 0x00);  // tie between 0 and 2^-9: even is 0
  EXPECT_EQ(FloatToE4M3(-unit / 2), 0x80);
  EXPECT_EQ(FloatToE4M3(std::nextafter(unit / 2, 1.0f)), 0x01);
  EXPECT_EQ(FloatToE4M3(1.5f * unit), 0x02);  // tie between 1 and 2 units: 2
  EXPECT_EQ(FloatToE4M3(2.5f * unit), 0x02);  // tie between 2 and 3 units: 2
  EXPECT_EQ(FloatToE4M3(7.5f * unit), 0x08);  // tie between 7 units and 2^-6: 2^-6
  EXPECT_EQ(FloatToE4M3(7.0f * unit), 0x07);
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(FloatToE4M3(-std::numeric_limits<float>::min()), 0x80);
}

// ---- (b) Block quantization ----

std::vector<float> RandomMatrix(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    // Magnitudes from 1e-4 to 1e2 across row bands, so blocks get different scales.
    const float band = std::pow(10.0f, static_cast<float>((r / 37) % 7) - 4.0f);
    for (int64_t c = 0; c < cols; ++c) w[r * cols + c] = normal(rng) * band * (1 + c % 5);
  }
  return w;
}

float BlockAmax(const std::vector<float>& w, int64_t cols, int64_t block, int64_t br, int64_t bc,
                int64_t rows) {
  float amax = 0;
  for (int64_t r = br * block; r < std::min(rows, (br + 1) * block); ++r) {
    for (int64_t c = bc * block; c < std::min(cols, (bc + 1) * block); ++c) {
      amax = std::max(amax, std::fabs(w[r * cols + c]));
    }
  }
  return amax;
}

bool IsPowerOfTwo(float s) {
  int exponent;
  return s > 0 && std::frexp(s, &exponent) == 0.5f;
}

struct Shape2 {
  int64_t rows, cols, block;
};

TEST(Fp8BlockTest, ScalesAreTheSmallestPowersOfTwoThatFit) {
  for (Shape2 s : std::vector<Shape2>{{200, 300, 128},
                                      {1, 1, 128},
                                      {3, 7, 128},
                                      {129, 127, 128},
                                      {256, 128, 128},
                                      {200, 300, 16},
                                      {33, 65, 32}}) {
    const std::vector<float> w = RandomMatrix(s.rows, s.cols, 7);
    const Fp8Block q = QuantizeBlockwise(w.data(), s.rows, s.cols, s.block);
    const int64_t block_rows = (s.rows + s.block - 1) / s.block;
    const int64_t block_cols = (s.cols + s.block - 1) / s.block;
    ASSERT_EQ(q.data.size(), static_cast<size_t>(s.rows * s.cols));
    ASSERT_EQ(q.scale_inv.size(), static_cast<size_t>(block_rows * block_cols));
    EXPECT_EQ(Fp8ScaleShape(s.rows, s.cols, s.block),
              (std::vector<int64_t>{block_rows, block_cols}));
    for (int64_t br = 0; br < block_rows; ++br) {
      for (int64_t bc = 0; bc < block_cols; ++bc) {
        const float scale = q.scale_inv[br * block_cols + bc];
        const double amax = BlockAmax(w, s.cols, s.block, br, bc, s.rows);
        EXPECT_TRUE(IsPowerOfTwo(scale)) << scale;
        EXPECT_LE(amax / scale, 448.0) << br << "," << bc;
        EXPECT_GT(amax / (scale / 2), 448.0) << br << "," << bc;  // the smallest one
      }
    }
  }
}

TEST(Fp8BlockTest, ScaleForAmaxAtItsBoundaries) {
  EXPECT_EQ(Fp8ScaleForAmax(0.0f), 1.0f);
  EXPECT_EQ(Fp8ScaleForAmax(448.0f), 1.0f);
  EXPECT_EQ(Fp8ScaleForAmax(std::nextafter(448.0f, 1e9f)), 2.0f);
  EXPECT_EQ(Fp8ScaleForAmax(224.0f), 0.5f);
  EXPECT_EQ(Fp8ScaleForAmax(std::nextafter(224.0f, 1e9f)), 1.0f);
  EXPECT_EQ(Fp8ScaleForAmax(1.0f), std::ldexp(1.0f, -8));      // 1 / 2^-8 = 256 <= 448
  EXPECT_EQ(Fp8ScaleForAmax(0.4375f), std::ldexp(1.0f, -10));  // 448 * 2^-10 exactly
  EXPECT_EQ(Fp8ScaleForAmax(0.44f), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8ScaleForAmax(std::numeric_limits<float>::max()), std::ldexp(1.0f, 120));
  // Below 448 * 2^-140 the scale stays at 2^-140, so fp8 * scale is an exact fp32.
  EXPECT_EQ(Fp8ScaleForAmax(std::numeric_limits<float>::denorm_min()),
            std::ldexp(1.0f, kFp8MinScaleExponent));
  EXPECT_EQ(Fp8ScaleForAmax(std::numeric_limits<float>::quiet_NaN()), 1.0f);
}

TEST(Fp8BlockTest, DequantizedValuesAreWithinTheE4M3ErrorBound) {
  const int64_t rows = 200, cols = 300, block = 128;
  const std::vector<float> w = RandomMatrix(rows, cols, 11);
  const Fp8Block q = QuantizeBlockwise(w.data(), rows, cols, block);
  std::vector<float> back(w.size());
  DequantizeBlockwise(q.data.data(), q.scale_inv.data(), rows, cols, block, back.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = q.scale_inv[(r / block) * 3 + c / block];
      const double x = w[r * cols + c], y = back[r * cols + c];
      // Half an ulp: 2^-4 relative in the normal range, 2^-10 * scale among subnormals.
      const double bound = std::max(std::ldexp(std::fabs(x), -4), std::ldexp(double(scale), -10));
      ASSERT_LE(std::fabs(y - x), bound) << r << "," << c << ": " << x << " -> " << y;
      // Dequantization is the exact product of the code's value and the scale.
      ASSERT_EQ(y, ReferenceDecode(q.data[r * cols + c]) * scale);
    }
  }
}

TEST(Fp8BlockTest, ZeroBlockHasScaleOneAndNonFiniteValuesAreKept) {
  const int64_t rows = 4, cols = 6, block = 2;
  std::vector<float> w(rows * cols, 0.0f);
  w[0 * cols + 2] = 3.0f;  // block (0, 1)
  w[0 * cols + 3] = std::numeric_limits<float>::quiet_NaN();
  w[1 * cols + 2] = -std::numeric_limits<float>::infinity();
  w[2 * cols + 4] = -0.0f;  // block (1, 2): all zeros
  const Fp8Block q = QuantizeBlockwise(w.data(), rows, cols, block);
  EXPECT_EQ(q.scale_inv[0], 1.0f);
  EXPECT_EQ(q.scale_inv[1], std::ldexp(1.0f, -7));  // amax 3: 3 * 2^7 = 384 <= 448
  EXPECT_EQ(q.scale_inv[5], 1.0f);
  EXPECT_EQ(q.data[0 * cols + 2], FloatToE4M3(384.0f));
  EXPECT_EQ(q.data[0 * cols + 3], 0x7F);
  EXPECT_EQ(q.data[1 * cols + 2], 0xFE);  // -inf saturates to -448 * scale
  EXPECT_EQ(q.data[2 * cols + 4], 0x80);
}

TEST(Fp8BlockTest, SameInputGivesTheSameBytes) {
  const std::vector<float> w = RandomMatrix(200, 300, 5);
  const Fp8Block a = QuantizeBlockwise(w.data(), 200, 300);
  const Fp8Block b = QuantizeBlockwise(std::vector<float>(w).data(), 200, 300);
  EXPECT_EQ(a.data, b.data);
  EXPECT_EQ(std::memcmp(a.scale_inv.data(), b.scale_inv.data(), a.scale_inv.size() * 4), 0);
}

// A step that moves every weight of a block by 1e-6 relative keeps its scale, so only the
// codes whose rounding flipped change; crossing 448 * 2^k changes that one block's scale.
TEST(Fp8BlockTest, SmallStepsKeepTheScale) {
  const int64_t rows = 256, cols = 256, block = 128;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uniform(-0.25f, 0.25f);
  std::vector<float> w(rows * cols);
  for (float& x : w) x = uniform(rng);
  w[5 * cols + 7] = 0.3f;  // block (0, 0): amax 0.3 in (0.21875, 0.4375], scale 2^-10
  const Fp8Block before = QuantizeBlockwise(w.data(), rows, cols, block);
  EXPECT_EQ(before.scale_inv[0], std::ldexp(1.0f, -10));

  std::vector<float> stepped = w;
  std::uniform_real_distribution<float> jitter(-1e-6f, 1e-6f);
  for (float& x : stepped) x *= 1 + jitter(rng);
  const Fp8Block after = QuantizeBlockwise(stepped.data(), rows, cols, block);
  EXPECT_EQ(after.scale_inv, before.scale_inv);
  size_t changed = 0;
  for (size_t i = 0; i < w.size(); ++i) changed += after.data[i] != before.data[i];
  EXPECT_LT(changed, w.size() / 100);

  stepped[5 * cols + 7] = 0.44f;  // crosses 448 * 2^-10
  const Fp8Block crossed = QuantizeBlockwise(stepped.data(), rows, cols, block);
  EXPECT_EQ(crossed.scale_inv[0], std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::equal(crossed.scale_inv.begin() + 1, crossed.scale_inv.end(),
                         before.scale_inv.begin() + 1));
}

TEST(Fp8BlockTest, PartialDequantizationMatchesTheWhole) {
  const int64_t rows = 200, cols = 300, block = 128;
  const std::vector<float> w = RandomMatrix(rows, cols, 9);
  const Fp8Block q = QuantizeBlockwise(w.data(), rows, cols, block);
  std::vector<float> whole(w.size());
  DequantizeBlockwise(q.data.data(), q.scale_inv.data(), rows, cols, block, whole.data());
  const float sentinel = -12345.0f;
  struct Range {
    int64_t begin, count;
  };
  for (Range range : std::vector<Range>{
           {0, 1}, {0, 300}, {299, 2}, {150, 1000}, {127, 130}, {59999, 1}, {0, 60000}, {777, 0}}) {
    std::vector<float> out(w.size(), sentinel);
    DequantizeElementRange(q.data.data(), q.scale_inv.data(), rows, cols, block, range.begin,
                           range.count, out.data());
    for (int64_t i = 0; i < rows * cols; ++i) {
      const bool inside = i >= range.begin && i < range.begin + range.count;
      ASSERT_TRUE(SameBits(out[i], inside ? whole[i] : sentinel)) << range.begin << " " << i;
    }
  }
  const std::vector<int64_t> blocks = {5, 0, 3};  // of 2 x 3: (1, 2), (0, 0), (1, 0)
  std::vector<float> out(w.size(), sentinel);
  DequantizeBlocks(q.data.data(), q.scale_inv.data(), rows, cols, block, blocks, out.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t index = (r / block) * 3 + c / block;
      const bool inside = std::find(blocks.begin(), blocks.end(), index) != blocks.end();
      ASSERT_TRUE(SameBits(out[r * cols + c], inside ? whole[r * cols + c] : sentinel));
    }
  }
}

// ---- (c) Model snapshots ----

const TensorView* Find(const CheckpointView& view, const std::string& name) {
  for (const TensorView& t : view) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

OwnedTensor* FindOwned(OwnedCheckpoint& checkpoint, const std::string& name) {
  for (OwnedTensor& t : checkpoint.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// The values a FP8 tensor and its scales stand for, computed from the reference decoder.
torch::Tensor ReferenceDequantize(const TensorView& weight, const TensorView& scale,
                                  int64_t block) {
  EXPECT_EQ(scale.dtype, DType::kF32);
  const int64_t rows = weight.shape[0], cols = weight.shape[1];
  const int64_t block_cols = scale.shape[1];
  const auto* codes = reinterpret_cast<const uint8_t*>(weight.data.data());
  const auto* scales = reinterpret_cast<const float*>(scale.data.data());
  torch::Tensor out = torch::empty({rows, cols}, torch::kFloat);
  float* values = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      values[r * cols + c] = static_cast<float>(ReferenceDecode(codes[r * cols + c])) *
                             scales[(r / block) * block_cols + c / block];
    }
  }
  return out;
}

TEST(Fp8SnapshotTest, HfNamesAndDtypes) {
  torch::manual_seed(1);
  TransformerImpl model(testing::TinyConfig({.experts = 4}));
  auto snapshot = SnapshotWeightsFp8(model);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status().ToString();
  const CheckpointView view = snapshot->view();
  auto dtype_of = [&](const std::string& name) {
    const TensorView* t = Find(view, name);
    EXPECT_NE(t, nullptr) << name;
    return t ? t->dtype : DType::kU8;
  };
  for (const char* name :
       {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight"}) {
    EXPECT_EQ(dtype_of(name), DType::kF8_E4M3) << name;
    EXPECT_EQ(dtype_of(std::string(name) + "_scale_inv"), DType::kF32) << name;
  }
  for (const char* name :
       {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.1.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.input_layernorm.weight"}) {
    EXPECT_EQ(dtype_of(name), DType::kBF16) << name;
    EXPECT_EQ(Find(view, std::string(name) + "_scale_inv"), nullptr) << name;
  }
  const TensorView* k_scale = Find(view, "model.layers.0.self_attn.k_proj.weight_scale_inv");
  ASSERT_NE(k_scale, nullptr);
  EXPECT_EQ(k_scale->shape, (std::vector<int64_t>{1, 1}));  // k_proj [16, 32]
  const size_t fp8_count = Fp8WeightNames(model).size();
  EXPECT_EQ(fp8_count, 2 * (4 + 4 * 3));  // per layer: q, k, v, o + 4 experts x 3
  EXPECT_EQ(view.size(), model.named_parameters().size() + fp8_count);
  EXPECT_EQ(Fp8QuantizationConfig(128),
            nlohmann::json::parse(R"({"quant_method": "fp8", "fmt": "e4m3",
              "activation_scheme": "dynamic", "weight_block_size": [128, 128]})"));
}

// Blocks of 16 so that the tiny projections ([16..64] x [32..64]) hold several.
TEST(Fp8SnapshotTest, RoundTripLoadsExactlyTheDequantizedValues) {
  const int64_t block = 16;
  torch::manual_seed(2);
  TransformerImpl model(testing::TinyConfig({.experts = 4, .mlp_only_layers = {0}}));
  auto snapshot = SnapshotWeightsFp8(model, {.block = block});
  ASSERT_TRUE(snapshot.ok()) << snapshot.status().ToString();
  const CheckpointView view = snapshot->view();
  EXPECT_EQ(Find(view, "model.layers.0.mlp.gate_proj.weight_scale_inv")->shape,
            (std::vector<int64_t>{4, 2}));  // [64, 32]

  torch::manual_seed(3);
  TransformerImpl loaded(testing::TinyConfig({.experts = 4, .mlp_only_layers = {0}}));
  Status s = LoadFp8Weights(loaded, view, "snapshot", block);
  ASSERT_TRUE(s.ok()) << s.ToString();
  const std::vector<std::string> fp8_names = Fp8WeightNames(model);
  const std::set<std::string> fp8(fp8_names.begin(), fp8_names.end());
  auto theirs = loaded.named_parameters();
  for (const auto& p : model.named_parameters()) {
    torch::Tensor expected;
    if (fp8.count(p.key())) {
      const TensorView* weight = Find(view, p.key());
      const TensorView* scale = Find(view, p.key() + "_scale_inv");
      ASSERT_TRUE(weight && scale) << p.key();
      expected = ReferenceDequantize(*weight, *scale, block);
    } else {
      expected = p.value().detach().to(torch::kBFloat16).to(torch::kFloat);
    }
    EXPECT_TRUE(torch::equal(theirs[p.key()], expected)) << p.key();
  }

  // BF16 scales (as Qwen3's FP8 releases store them) load to the same values.
  OwnedCheckpoint bf16_scales = *snapshot;
  for (OwnedTensor& t : bf16_scales.tensors) {
    if (t.name.ends_with("_scale_inv")) {
      auto fp32 = ToTorch(TensorView{t.name, t.dtype, t.shape, t.data});
      ASSERT_TRUE(fp32.ok());
      auto converted = FromTorch(t.name, *fp32, DType::kBF16);
      ASSERT_TRUE(converted.ok());
      t = std::move(*converted);
    }
  }
  torch::manual_seed(4);
  TransformerImpl again(testing::TinyConfig({.experts = 4, .mlp_only_layers = {0}}));
  ASSERT_TRUE(LoadFp8Weights(again, bf16_scales.view(), "bf16 scales", block).ok());
  auto third = again.named_parameters();
  for (const auto& p : theirs) EXPECT_TRUE(torch::equal(third[p.key()], p.value())) << p.key();
}

fs::path TempDir(const std::string& name) {
  fs::path dir =
      fs::temp_directory_path() / ("flywheel_fp8_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

OwnedTensor TensorFromBytes(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const void* bytes, size_t size) {
  OwnedTensor t{name, dtype, std::move(shape), std::vector<std::byte>(size)};
  std::memcpy(t.data.data(), bytes, size);
  return t;
}

// An FP8 checkpoint written here, not by SnapshotWeightsFp8: random finite codes and
// DeepSeek-style scales that are not powers of two, in 128-blocks (gate/up [200, 32] and
// down [32, 200] have two). It must give the logits of a model holding the values those
// tensors stand for.
TEST(Fp8LoadTest, HandWrittenCheckpointGivesTheLogitsOfItsDequantizedValues) {
  model::ModelConfig config = testing::TinyConfig();
  config.intermediate_size = 200;
  torch::manual_seed(5);
  TransformerImpl source(config);
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  OwnedCheckpoint fp8, fp32;
  for (const auto& p : source.named_parameters()) {
    const std::string& name = p.key();
    if (!name.ends_with("_proj.weight")) {  // norms, embeddings, lm_head: BF16
      torch::Tensor bf16 = p.value().detach().to(torch::kBFloat16).contiguous();
      fp8.tensors.push_back(TensorFromBytes(name, DType::kBF16, bf16.sizes().vec(), bf16.data_ptr(),
                                            bf16.numel() * 2));
      torch::Tensor value = bf16.to(torch::kFloat);
      fp32.tensors.push_back(TensorFromBytes(name, DType::kF32, value.sizes().vec(),
                                             value.data_ptr(), value.numel() * 4));
      continue;
    }
    const int64_t rows = p.value().size(0), cols = p.value().size(1);
    const int64_t block_rows = (rows + 127) / 128, block_cols = (cols + 127) / 128;
    std::vector<uint8_t> codes(rows * cols);
    for (uint8_t& code : codes) {
      code = static_cast<uint8_t>(byte(rng));
      if ((code & 0x7F) == 0x7F) code ^= 1;  // no NaN
    }
    std::vector<float> scales(block_rows * block_cols);
    for (float& s : scales) s = (0.5f + unit(rng)) * 0.02f / 448.0f;  // amax / 448
    std::vector<float> values(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        values[r * cols + c] = static_cast<float>(ReferenceDecode(codes[r * cols + c])) *
                               scales[(r / 128) * block_cols + c / 128];
      }
    }
    fp8.tensors.push_back(
        TensorFromBytes(name, DType::kF8_E4M3, {rows, cols}, codes.data(), codes.size()));
    fp8.tensors.push_back(TensorFromBytes(name + "_scale_inv", DType::kF32,
                                          {block_rows, block_cols}, scales.data(),
                                          scales.size() * 4));
    fp32.tensors.push_back(
        TensorFromBytes(name, DType::kF32, {rows, cols}, values.data(), values.size() * 4));
  }
  EXPECT_EQ(Find(fp8.view(), "model.layers.1.mlp.down_proj.weight_scale_inv")->shape,
            (std::vector<int64_t>{1, 2}));

  const fs::path dir = TempDir("handmade");
  const std::string path = (dir / "model.safetensors").string();
  nlohmann::json config_json = config.ToJson();
  config_json["quantization_config"] = Fp8QuantizationConfig();
  ASSERT_TRUE(WriteSafetensors(path, fp8.view(), {{"config", config_json.dump()}}).ok());
  auto file = Checkpoint::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();

  torch::manual_seed(6);
  TransformerImpl from_fp8(config);
  Status s = LoadFp8Weights(from_fp8, file->tensors(), path);
  ASSERT_TRUE(s.ok()) << s.ToString();
  torch::manual_seed(7);
  TransformerImpl from_fp32(config);
  ASSERT_TRUE(LoadWeights(from_fp32, fp32.view(), "fp32").ok());
  auto expected = from_fp32.named_parameters();
  for (const auto& p : from_fp8.named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), expected[p.key()])) << p.key();
  }
  torch::manual_seed(8);
  const torch::Tensor tokens = torch::randint(config.vocab_size, {2, 9}, torch::kLong);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(from_fp8.forward(tokens).logits, from_fp32.forward(tokens).logits));
  fs::remove_all(dir);
}

class Fp8MalformedTest : public ::testing::Test {
 protected:
  static constexpr const char* kWeight = "model.layers.0.self_attn.q_proj.weight";
  static constexpr const char* kScale = "model.layers.0.self_attn.q_proj.weight_scale_inv";

  void SetUp() override {
    torch::manual_seed(9);
    model_ = std::make_unique<TransformerImpl>(testing::TinyConfig());
    auto snapshot = SnapshotWeightsFp8(*model_);
    ASSERT_TRUE(snapshot.ok());
    good_ = std::move(*snapshot);
    torch::manual_seed(10);
    target_ = std::make_unique<TransformerImpl>(testing::TinyConfig());
    for (const auto& p : target_->named_parameters()) before_[p.key()] = p.value().clone();
  }

  // Loads `bad` into the target, expects `code` and a message holding every needle, and
  // checks that nothing was written.
  void ExpectRefused(const OwnedCheckpoint& bad, StatusCode code,
                     const std::vector<std::string>& needles) {
    Status s = LoadFp8Weights(*target_, bad.view(), "bad.safetensors");
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), code) << s.ToString();
    EXPECT_NE(s.message().find("bad.safetensors"), std::string::npos) << s.message();
    for (const std::string& needle : needles) {
      EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    }
    for (const auto& p : target_->named_parameters()) {
      EXPECT_TRUE(torch::equal(p.value(), before_[p.key()])) << p.key();
    }
  }

  std::unique_ptr<TransformerImpl> model_, target_;
  OwnedCheckpoint good_;
  std::map<std::string, torch::Tensor> before_;
};

TEST_F(Fp8MalformedTest, TheGoodOneLoads) {
  EXPECT_TRUE(LoadFp8Weights(*target_, good_.view(), "good").ok());
}

TEST_F(Fp8MalformedTest, MissingScale) {
  OwnedCheckpoint bad = good_;
  std::erase_if(bad.tensors, [](const OwnedTensor& t) { return t.name == kScale; });
  ExpectRefused(bad, StatusCode::kNotFound, {std::string("missing tensor ") + kScale, kWeight});
}

TEST_F(Fp8MalformedTest, ScaleOfTheWrongShape) {
  OwnedCheckpoint bad = good_;
  OwnedTensor* scale = FindOwned(bad, kScale);
  scale->shape = {2, 1};
  scale->data.resize(8);
  ExpectRefused(bad, StatusCode::kMismatch, {kScale, "[2, 1]", "expected [1, 1]"});
}

TEST_F(Fp8MalformedTest, ScaleOfTheWrongDtype) {
  OwnedCheckpoint bad = good_;
  FindOwned(bad, kScale)->dtype = DType::kI32;
  ExpectRefused(bad, StatusCode::kInvalidArgument, {kScale, "I32"});
}

TEST_F(Fp8MalformedTest, NonFiniteScale) {
  OwnedCheckpoint bad = good_;
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(FindOwned(bad, kScale)->data.data(), &inf, 4);
  ExpectRefused(bad, StatusCode::kInvalidArgument, {kScale, "non-finite"});
}

TEST_F(Fp8MalformedTest, E5M2Weight) {
  OwnedCheckpoint bad = good_;
  FindOwned(bad, kWeight)->dtype = DType::kF8_E5M2;
  ExpectRefused(bad, StatusCode::kInvalidArgument, {kWeight, "F8_E5M2", "F8_E4M3"});
}

TEST_F(Fp8MalformedTest, WeightOfTheWrongShape) {
  OwnedCheckpoint bad = good_;
  FindOwned(bad, kWeight)->shape = {16, 64};
  ExpectRefused(bad, StatusCode::kMismatch, {kWeight, "[16, 64]"});
}

TEST_F(Fp8MalformedTest, ScaleWithoutItsWeight) {
  OwnedCheckpoint bad = good_;
  OwnedTensor orphan = *FindOwned(bad, kScale);
  orphan.name = "model.layers.0.self_attn.x_proj.weight_scale_inv";
  bad.tensors.push_back(orphan);
  ExpectRefused(bad, StatusCode::kInvalidArgument,
                {"model.layers.0.self_attn.x_proj.weight_scale_inv has no weight"});
}

TEST_F(Fp8MalformedTest, ScaleOfAWeightThatIsNotFp8) {
  OwnedCheckpoint bad = good_;
  OwnedTensor scale = *FindOwned(bad, kScale);
  scale.name = "model.layers.0.mlp.gate_proj.weight_scale_inv";
  scale.shape = {1, 1};
  bad.tensors.push_back(scale);
  // gate_proj stays FP8 in the snapshot; make it BF16 so the scale has nothing to scale.
  OwnedTensor* gate = FindOwned(bad, "model.layers.0.mlp.gate_proj.weight");
  auto bf16 = FromTorch(gate->name, torch::zeros({64, 32}), DType::kBF16);
  ASSERT_TRUE(bf16.ok());
  *gate = std::move(*bf16);
  ExpectRefused(bad, StatusCode::kInvalidArgument,
                {"model.layers.0.mlp.gate_proj.weight_scale_inv scales", "BF16"});
}

TEST_F(Fp8MalformedTest, Fp8VectorIsRefused) {
  OwnedCheckpoint bad = good_;
  OwnedTensor* norm = FindOwned(bad, "model.norm.weight");
  norm->dtype = DType::kF8_E4M3;
  norm->data.resize(32);
  ExpectRefused(bad, StatusCode::kInvalidArgument, {"model.norm.weight", "only matrices"});
}

TEST_F(Fp8MalformedTest, MissingWeight) {
  OwnedCheckpoint bad = good_;
  std::erase_if(bad.tensors, [](const OwnedTensor& t) { return t.name == kWeight; });
  ExpectRefused(bad, StatusCode::kNotFound, {std::string("missing tensor ") + kWeight});
}

}  // namespace
}  // namespace flywheel::model
