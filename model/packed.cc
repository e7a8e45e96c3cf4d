#include "model/packed.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <bit>
#include <atomic>
#include <cmath>
#include <functional>

#include "model/fp8.h"

namespace flywheel::model {

namespace {

std::atomic<int64_t> dequantize_count{0};

constexpr int kMinExponent = -120, kMaxExponent = 120;

int64_t CeilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// 2^e for e in [kMinExponent, kMaxExponent] (a normal float), without a libm call.
float PowerOfTwo(int e) {
  return std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23);
}

// The smallest e in [kMinExponent, kMaxExponent] with amax / 2^e <= limit (0 for amax 0).
int PowerOfTwoExponent(float amax, int limit) {
  if (!(amax > 0)) return 0;
  int e = static_cast<int>(std::ceil(std::log2(static_cast<double>(amax) / limit)));
  // log2 may be off by one at exact powers of two: settle it exactly.
  while (e > kMinExponent && std::ldexp(static_cast<double>(amax), -(e - 1)) <= limit) --e;
  while (e < kMaxExponent && std::ldexp(static_cast<double>(amax), -e) > limit) ++e;
  return std::clamp(e, kMinExponent, kMaxExponent);
}

int QuantizeInt(float w, int exponent, int limit) {
  const double q = std::nearbyint(std::ldexp(static_cast<double>(w), -exponent));
  return static_cast<int>(std::clamp(q, -static_cast<double>(limit), static_cast<double>(limit)));
}

// Per row (int8) or per group of `group` inputs (int4): the exponent of each scale.
void PackInts(const float* w, int64_t rows, int64_t cols, int64_t group, int limit,
              int8_t* exponents, const std::function<void(int64_t, int64_t, int)>& put) {
  const int64_t groups = CeilDiv(cols, group);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = g * group, end = std::min(cols, begin + group);
      float amax = 0;
      for (int64_t c = begin; c < end; ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      const int e = PowerOfTwoExponent(amax, limit);
      exponents[r * groups + g] = static_cast<int8_t>(e);
      for (int64_t c = begin; c < end; ++c) put(r, c, QuantizeInt(w[r * cols + c], e, limit));
    }
  }
}

// The loops below write floats through pointers that the compiler would otherwise assume may
// alias the code bytes (char types alias everything), which keeps them scalar.
void DequantizeInt8Rows(const PackedWeight& p, int64_t begin, int64_t end, float* out) {
  const auto* data = reinterpret_cast<const int8_t*>(p.data.data_ptr<uint8_t>());
  const int8_t* exponents = p.scales.data_ptr<int8_t>();
  const int64_t cols = p.cols;
  for (int64_t r = begin; r < end; ++r) {
    const float scale = PowerOfTwo(exponents[r]);
    const int8_t* __restrict__ src = data + r * cols;
    float* __restrict__ dst = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<float>(src[c]) * scale;
  }
}

// int4 layout: each group of `block` inputs of a row owns Int4GroupBytes(block) bytes; its
// first ceil(len / 2) values sit in the low nibbles of those bytes, in order, the rest in the
// high nibbles, each nibble holding q + 8. Both halves then dequantize as contiguous runs,
// which GCC vectorizes.
int64_t Int4GroupBytes(int64_t block) {
  return (block + 1) / 2;
}

void DequantizeInt4Rows(const PackedWeight& p, int64_t begin, int64_t end, float* out) {
  const uint8_t* data = p.data.data_ptr<uint8_t>();
  const int8_t* exponents = p.scales.data_ptr<int8_t>();
  const int64_t groups = CeilDiv(p.cols, p.block), group_bytes = Int4GroupBytes(p.block);
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = PowerOfTwo(exponents[r * groups + g]);
      const int64_t first = g * p.block, len = std::min(p.block, p.cols - first);
      const int64_t low = (len + 1) / 2;
      const uint8_t* __restrict__ bytes = data + (r * groups + g) * group_bytes;
      float* __restrict__ dst = out + r * p.cols + first;
      for (int64_t i = 0; i < low; ++i) dst[i] = static_cast<float>((bytes[i] & 0x0F) - 8) * scale;
      float* __restrict__ high = dst + low;
      for (int64_t i = 0; i < len - low; ++i)
        high[i] = static_cast<float>((bytes[i] >> 4) - 8) * scale;
    }
  }
}

}  // namespace

const char* PackFormatName(PackFormat format) {
  switch (format) {
    case PackFormat::kNone:
      return "none";
    case PackFormat::kFp8:
      return "fp8";
    case PackFormat::kInt8:
      return "int8";
    case PackFormat::kInt4:
      return "int4";
  }
  return "?";
}

Result<PackFormat> ParsePackFormat(std::string_view name) {
  for (PackFormat f : {PackFormat::kNone, PackFormat::kFp8, PackFormat::kInt8, PackFormat::kInt4})
    if (name == PackFormatName(f)) return f;
  return Status::InvalidArgument("unknown packed format '" + std::string(name) +
                                 "' (expected none, fp8, int8 or int4)");
}

int64_t DefaultPackBlock(PackFormat format) {
  if (format == PackFormat::kFp8) return kFp8BlockSize;
  if (format == PackFormat::kInt4) return kInt4GroupSize;
  return 0;
}

int64_t PackedWeight::bytes() const {
  return data.numel() * data.element_size() + scales.numel() * scales.element_size();
}

torch::Tensor PackedWeight::Dequantize() const {
  dequantize_count.fetch_add(1, std::memory_order_relaxed);
  torch::Tensor out = torch::empty({rows, cols}, torch::kFloat);
  float* dst = out.data_ptr<float>();
  // ~64K weights per task: enough to amortise the thread hand-off.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, cols));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    switch (format) {
      case PackFormat::kFp8:
        DequantizeRows(data.data_ptr<uint8_t>(), scales.data_ptr<float>(), cols, block, begin, end,
                       dst);
        break;
      case PackFormat::kInt8:
        DequantizeInt8Rows(*this, begin, end, dst);
        break;
      case PackFormat::kInt4:
        DequantizeInt4Rows(*this, begin, end, dst);
        break;
      case PackFormat::kNone:
        break;
    }
  });
  return out;
}

Result<PackedWeight> PackWeight(const torch::Tensor& w, PackFormat format, int64_t block) {
  if (format == PackFormat::kNone)
    return Status::InvalidArgument("PackWeight: format 'none' packs nothing");
  if (block < 0) return Status::InvalidArgument("PackWeight: block must be >= 0");
  if (w.dim() != 2) {
    return Status::InvalidArgument("PackWeight: expected a 2-D weight, got " +
                                   std::to_string(w.dim()) + " dimensions");
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor master = w.detach().to(torch::kCPU, torch::kFloat).contiguous();
  if (!torch::isfinite(master).all().item<bool>())
    return Status::InvalidArgument("PackWeight: the weight holds NaN or inf");
  PackedWeight p;
  p.format = format;
  p.rows = master.size(0);
  p.cols = master.size(1);
  p.block = format == PackFormat::kInt8 ? 0 : (block > 0 ? block : DefaultPackBlock(format));
  const float* src = master.data_ptr<float>();
  if (format == PackFormat::kFp8) {
    const Fp8Block q = QuantizeBlockwise(src, p.rows, p.cols, p.block);
    p.data = torch::from_blob(const_cast<uint8_t*>(q.data.data()), {p.rows, p.cols}, torch::kUInt8)
                 .clone();
    const std::vector<int64_t> shape = Fp8ScaleShape(p.rows, p.cols, p.block);
    p.scales =
        torch::from_blob(const_cast<float*>(q.scale_inv.data()), shape, torch::kFloat).clone();
    return p;
  }
  if (format == PackFormat::kInt8) {
    p.data = torch::empty({p.rows, p.cols}, torch::kUInt8);
    p.scales = torch::empty({p.rows}, torch::kInt8);
    auto* out = reinterpret_cast<int8_t*>(p.data.data_ptr<uint8_t>());
    PackInts(src, p.rows, p.cols, std::max<int64_t>(p.cols, 1), 127, p.scales.data_ptr<int8_t>(),
             [&](int64_t r, int64_t c, int q) { out[r * p.cols + c] = static_cast<int8_t>(q); });
    return p;
  }
  const int64_t groups = CeilDiv(p.cols, p.block), group_bytes = Int4GroupBytes(p.block);
  p.data = torch::full({p.rows, groups * group_bytes}, 0x88, torch::kUInt8);  // q = 0 everywhere
  p.scales = torch::empty({p.rows, groups}, torch::kInt8);
  uint8_t* out = p.data.data_ptr<uint8_t>();
  PackInts(src, p.rows, p.cols, p.block, 7, p.scales.data_ptr<int8_t>(),
           [&](int64_t r, int64_t c, int q) {
             const int64_t g = c / p.block, k = c % p.block;
             const int64_t len = std::min(p.block, p.cols - g * p.block), low = (len + 1) / 2;
             uint8_t& byte = out[(r * groups + g) * group_bytes + (k < low ? k : k - low)];
             const auto nibble = static_cast<uint8_t>(q + 8);
             byte = k < low ? static_cast<uint8_t>((byte & 0xF0) | nibble)
                            : static_cast<uint8_t>((byte & 0x0F) | (nibble << 4));
           });
  return p;
}

int64_t PackedDequantizeCount() {
  return dequantize_count.load(std::memory_order_relaxed);
}

}  // namespace flywheel::model
