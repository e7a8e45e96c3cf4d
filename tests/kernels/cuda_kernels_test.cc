// The CUDA kernels against the CPU references, bit for bit, on awkward sizes. Without a
// usable device (or without nvcc) every call must report Unavailable, never abort; the
// comparison tests skip with the reason.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda.h"
#include "kernels/kernels.h"

namespace flywheel::kernels {
namespace {

constexpr size_t kElemSizes[] = {1, 2, 4, 8};
constexpr size_t kSizes[] = {0, 1, 3, 7, 31, 32, 33, 733, 1002, 2047, 2048, 2049, (1u << 20) + 13};
constexpr double kDensities[] = {0.0, 0.02, 0.5, 1.0};

std::vector<unsigned char> RandomBytes(size_t size, uint64_t seed) {
  std::vector<unsigned char> bytes(size);
  std::mt19937_64 rng(seed);
  for (auto& byte : bytes) byte = static_cast<unsigned char>(rng());
  return bytes;
}

// A copy of `base` with a bit flipped in about `density` of its elements.
std::vector<unsigned char> Perturb(const std::vector<unsigned char>& base, size_t elem_size,
                                   double density, uint64_t seed) {
  std::vector<unsigned char> target = base;
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution pick(density);
  for (size_t i = 0; i < base.size() / elem_size; ++i) {
    if (pick(rng))
      target[i * elem_size + rng() % elem_size] ^= static_cast<unsigned char>(1u << (rng() % 8));
  }
  return target;
}

TEST(CudaKernelsTest, UnavailableIsAStatusNotACrash) {
  if (cuda::Available()) GTEST_SKIP() << "device present: " << cuda::DeviceDescription();
  EXPECT_FALSE(cuda::DeviceDescription().empty());
  uint32_t positions[4];
  const uint16_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 5};
  const Result<size_t> compact = cuda::CompareCompact(a, b, 4, 2, positions);
  ASSERT_FALSE(compact.ok());
  EXPECT_EQ(compact.status().code(), StatusCode::kUnavailable) << compact.status().ToString();
  uint16_t dst[4] = {};
  const uint32_t where[1] = {3};
  const uint16_t value[1] = {7};
  const Status scatter = cuda::ScatterApply(dst, 4, 2, where, value, 1);
  EXPECT_EQ(scatter.code(), StatusCode::kUnavailable) << scatter.ToString();
  uint64_t sum = 0;
  const Status checksums = cuda::ChunkChecksums(a, sizeof(a), 4, &sum);
  EXPECT_EQ(checksums.code(), StatusCode::kUnavailable) << checksums.ToString();
}

TEST(CudaKernelsTest, RejectsBadArgumentsBeforeTouchingTheDevice) {
  uint32_t positions[4];
  const uint8_t a[12] = {}, b[12] = {};
  const Result<size_t> compact = cuda::CompareCompact(a, b, 4, 3, positions);
  ASSERT_FALSE(compact.ok());
  // Without CUDA in the build, Unavailable is the honest answer to everything.
  const StatusCode bad_argument =
      cuda::DeviceDescription().find("built without CUDA") == std::string::npos
          ? StatusCode::kInvalidArgument
          : StatusCode::kUnavailable;
  EXPECT_EQ(compact.status().code(), bad_argument) << compact.status().ToString();
  uint32_t dst[4] = {};
  const uint32_t out_of_range[1] = {4};
  const uint32_t value[1] = {1};
  const Status scatter = cuda::ScatterApply(dst, 4, 4, out_of_range, value, 1);
  EXPECT_EQ(scatter.code(), bad_argument) << scatter.ToString();
}

TEST(CudaKernelsTest, CompareCompactMatchesScalar) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  uint64_t seed = 1;
  for (size_t elem_size : kElemSizes) {
    for (size_t n : kSizes) {
      for (double density : kDensities) {
        SCOPED_TRACE(testing::Message()
                     << "elem_size " << elem_size << " n " << n << " density " << density);
        const auto base = RandomBytes(n * elem_size, seed++);
        const auto target = Perturb(base, elem_size, density, seed++);
        std::vector<uint32_t> want(n), got(n);
        want.resize(CompareCompactScalar(base.data(), target.data(), n, elem_size, want.data()));
        const Result<size_t> count =
            cuda::CompareCompact(base.data(), target.data(), n, elem_size, got.data());
        ASSERT_TRUE(count.ok()) << count.status().ToString();
        got.resize(*count);
        ASSERT_EQ(got, want);
      }
    }
  }
}

TEST(CudaKernelsTest, ScatterApplyMatchesScalar) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  uint64_t seed = 100;
  for (size_t elem_size : kElemSizes) {
    for (size_t n : kSizes) {
      for (double density : kDensities) {
        SCOPED_TRACE(testing::Message()
                     << "elem_size " << elem_size << " n " << n << " density " << density);
        const auto base = RandomBytes(n * elem_size, seed++);
        const auto target = Perturb(base, elem_size, density, seed++);
        std::vector<uint32_t> positions(n);
        positions.resize(
            CompareCompactScalar(base.data(), target.data(), n, elem_size, positions.data()));
        std::vector<unsigned char> values(positions.size() * elem_size);
        GatherScalar(target.data(), elem_size, positions.data(), values.data(), positions.size());
        std::vector<unsigned char> want = base, got = base;
        ScatterApplyScalar(want.data(), elem_size, positions.data(), values.data(),
                           positions.size());
        const Status status = cuda::ScatterApply(got.data(), n, elem_size, positions.data(),
                                                 values.data(), positions.size());
        ASSERT_TRUE(status.ok()) << status.ToString();
        ASSERT_EQ(got, want);
        ASSERT_EQ(got, target);
      }
    }
  }
}

TEST(CudaKernelsTest, ChunkChecksumsMatchScalar) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  const auto storage = RandomBytes((3u << 20) + 1, 7);
  const unsigned char* data = storage.data() + 1;  // unaligned chunk starts on the host side
  for (size_t chunk : {1u, 7u, 16u, 17u, 64u, 128u, 129u, 240u, 241u, 1024u, 4096u, 1u << 20}) {
    for (size_t size : {size_t{0}, size_t{1}, chunk - 1, chunk, chunk + 1, 3 * chunk + 5,
                        size_t{1000003}, storage.size() - 1}) {
      SCOPED_TRACE(testing::Message() << "chunk " << chunk << " size " << size);
      const size_t chunks = (size + chunk - 1) / chunk;
      std::vector<uint64_t> want(chunks), got(chunks);
      ASSERT_EQ(ChunkChecksumsScalar(data, size, chunk, want.data()), chunks);
      const Status status = cuda::ChunkChecksums(data, size, chunk, got.data());
      ASSERT_TRUE(status.ok()) << status.ToString();
      ASSERT_EQ(got, want);
    }
  }
}

}  // namespace
}  // namespace flywheel::kernels
