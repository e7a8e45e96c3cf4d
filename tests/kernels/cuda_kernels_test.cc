// The CUDA kernels against the CPU references, bit for bit, on awkward sizes. Without a
// usable device (or without nvcc) every call must report Unavailable, never abort; the
// comparison tests skip with the reason.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <utility>
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

// Runs check(base, target, n, elem_size) for every element size, n in `sizes` and density:
// `base` random bytes, `target` a copy perturbed at that density, their seeds counted up
// from `seed`. Stops at the first fatal failure, as an ASSERT in the loops themselves would.
template <typename Sizes, typename Check>
void ForEachCase(uint64_t seed, const Sizes& sizes, Check check) {
  for (size_t elem_size : kElemSizes) {
    for (size_t n : sizes) {
      for (double density : kDensities) {
        SCOPED_TRACE(testing::Message()
                     << "elem_size " << elem_size << " n " << n << " density " << density);
        const auto base = RandomBytes(n * elem_size, seed++);
        const auto target = Perturb(base, elem_size, density, seed++);
        check(base, target, n, elem_size);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// The scalar kernels' changes from `base` to `target`: the changed positions and the
// target's values there.
struct Changes {
  std::vector<uint32_t> positions;
  std::vector<unsigned char> values;
};
Changes ScalarChanges(const std::vector<unsigned char>& base,
                      const std::vector<unsigned char>& target, size_t n, size_t elem_size) {
  Changes changes;
  changes.positions.resize(n);
  changes.positions.resize(
      CompareCompactScalar(base.data(), target.data(), n, elem_size, changes.positions.data()));
  changes.values.resize(changes.positions.size() * elem_size);
  GatherScalar(target.data(), elem_size, changes.positions.data(), changes.values.data(),
               changes.positions.size());
  return changes;
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

  const Result<cuda::DeviceBuffer> buffer = cuda::DeviceBuffer::Allocate(16);
  ASSERT_FALSE(buffer.ok());
  EXPECT_EQ(buffer.status().code(), StatusCode::kUnavailable) << buffer.status().ToString();
  const Result<size_t> on_device = cuda::CompareCompactOnDevice(
      a, b, 4, 2, positions, 4, nullptr, cuda::CompareCompactScratchBytes(4));
  ASSERT_FALSE(on_device.ok());
  EXPECT_EQ(on_device.status().code(), StatusCode::kUnavailable) << on_device.status().ToString();
  const Status scatter_on_device = cuda::ScatterApplyOnDevice(dst, 4, 2, where, value, 1);
  EXPECT_EQ(scatter_on_device.code(), StatusCode::kUnavailable) << scatter_on_device.ToString();
  const Status checksums_on_device = cuda::ChunkChecksumsOnDevice(a, sizeof(a), 4, &sum);
  EXPECT_EQ(checksums_on_device.code(), StatusCode::kUnavailable) << checksums_on_device.ToString();
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
  ForEachCase(1, kSizes, [](const auto& base, const auto& target, size_t n, size_t elem_size) {
    std::vector<uint32_t> want(n), got(n);
    want.resize(CompareCompactScalar(base.data(), target.data(), n, elem_size, want.data()));
    const Result<size_t> count =
        cuda::CompareCompact(base.data(), target.data(), n, elem_size, got.data());
    ASSERT_TRUE(count.ok()) << count.status().ToString();
    got.resize(*count);
    ASSERT_EQ(got, want);
  });
}

TEST(CudaKernelsTest, ScatterApplyMatchesScalar) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  ForEachCase(100, kSizes, [](const auto& base, const auto& target, size_t n, size_t elem_size) {
    const Changes changes = ScalarChanges(base, target, n, elem_size);
    const std::vector<uint32_t>& positions = changes.positions;
    std::vector<unsigned char> want = base, got = base;
    ScatterApplyScalar(want.data(), elem_size, positions.data(), changes.values.data(),
                       positions.size());
    const Status status = cuda::ScatterApply(got.data(), n, elem_size, positions.data(),
                                             changes.values.data(), positions.size());
    ASSERT_TRUE(status.ok()) << status.ToString();
    ASSERT_EQ(got, want);
    ASSERT_EQ(got, target);
  });
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

// ---------------------------------------------------------------------------------------
// Device-memory entry points.

// A device copy of `bytes`; fails the test on error.
cuda::DeviceBuffer ToDevice(const std::vector<unsigned char>& bytes) {
  Result<cuda::DeviceBuffer> buffer = cuda::DeviceBuffer::Allocate(bytes.size());
  EXPECT_TRUE(buffer.ok()) << buffer.status().ToString();
  if (!buffer.ok()) return {};
  const Status copied = buffer->CopyFromHost(bytes.data(), bytes.size());
  EXPECT_TRUE(copied.ok()) << copied.ToString();
  return std::move(buffer).value();
}

// A device buffer of `bytes` bytes of 0xA5, so that unwritten output and stale scratch show.
cuda::DeviceBuffer Poisoned(size_t bytes) {
  return ToDevice(std::vector<unsigned char>(bytes, 0xA5));
}

// Sizes past one group of the two-level scan (1024 tiles of 2048 elements), with the last
// tile partial.
constexpr size_t kLargeSizes[] = {(size_t{1} << 21) + 1, (size_t{3} << 21) + 5};

TEST(CudaKernelsTest, CompareCompactOnDeviceMatchesScalar) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  std::vector<size_t> sizes(std::begin(kSizes), std::end(kSizes));
  sizes.insert(sizes.end(), std::begin(kLargeSizes), std::end(kLargeSizes));
  ForEachCase(200, sizes, [](const auto& base, const auto& target, size_t n, size_t elem_size) {
    std::vector<uint32_t> want(n);
    want.resize(CompareCompactScalar(base.data(), target.data(), n, elem_size, want.data()));
    const cuda::DeviceBuffer d_base = ToDevice(base);
    const cuda::DeviceBuffer d_target = ToDevice(target);
    const cuda::DeviceBuffer d_positions = Poisoned(n * sizeof(uint32_t));
    const size_t scratch_bytes = cuda::CompareCompactScratchBytes(n);
    const cuda::DeviceBuffer d_scratch = Poisoned(scratch_bytes);
    const Result<size_t> count = cuda::CompareCompactOnDevice(
        d_base.data(), d_target.data(), n, elem_size, d_positions.As<uint32_t>(), n,
        d_scratch.data(), scratch_bytes);
    ASSERT_TRUE(count.ok()) << count.status().ToString();
    std::vector<uint32_t> got(*count);
    ASSERT_TRUE(d_positions.CopyToHost(got.data(), got.size() * sizeof(uint32_t)).ok());
    ASSERT_EQ(got, want);
  });
}

TEST(CudaKernelsTest, CompareCompactOnDeviceReportsTooManyChanges) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  const size_t n = 5003;
  const auto base = RandomBytes(n * 2, 300);
  const auto target = Perturb(base, 2, 0.5, 301);
  std::vector<uint32_t> want(n);
  want.resize(CompareCompactScalar(base.data(), target.data(), n, 2, want.data()));
  ASSERT_GT(want.size(), 100u);
  const size_t capacity = want.size() / 2;
  const cuda::DeviceBuffer d_base = ToDevice(base);
  const cuda::DeviceBuffer d_target = ToDevice(target);
  // One guard entry past the capacity, which must stay poisoned.
  const cuda::DeviceBuffer d_positions = Poisoned((capacity + 1) * sizeof(uint32_t));
  const size_t scratch_bytes = cuda::CompareCompactScratchBytes(n);
  const cuda::DeviceBuffer d_scratch = Poisoned(scratch_bytes);
  const Result<size_t> count =
      cuda::CompareCompactOnDevice(d_base.data(), d_target.data(), n, 2, d_positions.As<uint32_t>(),
                                   capacity, d_scratch.data(), scratch_bytes);
  ASSERT_FALSE(count.ok());
  EXPECT_EQ(count.status().code(), StatusCode::kResourceExhausted) << count.status().ToString();
  EXPECT_NE(count.status().message().find(std::to_string(want.size())), std::string::npos)
      << count.status().ToString();
  std::vector<uint32_t> got(capacity + 1);
  ASSERT_TRUE(d_positions.CopyToHost(got.data(), got.size() * sizeof(uint32_t)).ok());
  EXPECT_EQ(got.back(), 0xA5A5A5A5u);
  got.pop_back();
  want.resize(capacity);
  EXPECT_EQ(got, want);
}

TEST(CudaKernelsTest, CompareCompactOnDeviceRejectsBadArguments) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  const size_t n = 1000;
  const cuda::DeviceBuffer d_data = Poisoned(n * 4 + 8);
  const cuda::DeviceBuffer d_positions = Poisoned(n * sizeof(uint32_t));
  const size_t scratch_bytes = cuda::CompareCompactScratchBytes(n);
  const cuda::DeviceBuffer d_scratch = Poisoned(scratch_bytes);
  const auto* bytes = d_data.As<unsigned char>();
  const Result<size_t> small_scratch = cuda::CompareCompactOnDevice(
      bytes, bytes, n, 4, d_positions.As<uint32_t>(), n, d_scratch.data(), scratch_bytes - 1);
  EXPECT_EQ(small_scratch.status().code(), StatusCode::kInvalidArgument)
      << small_scratch.status().ToString();
  const Result<size_t> misaligned = cuda::CompareCompactOnDevice(
      bytes + 2, bytes, n, 4, d_positions.As<uint32_t>(), n, d_scratch.data(), scratch_bytes);
  EXPECT_EQ(misaligned.status().code(), StatusCode::kInvalidArgument)
      << misaligned.status().ToString();
  const Result<size_t> too_many =
      cuda::CompareCompactOnDevice(bytes, bytes, (size_t{1} << 32) + 1, 1,
                                   d_positions.As<uint32_t>(), n, d_scratch.data(), scratch_bytes);
  EXPECT_EQ(too_many.status().code(), StatusCode::kInvalidArgument) << too_many.status().ToString();
}

TEST(CudaKernelsTest, ScatterApplyOnDeviceMatchesScalar) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  uint64_t seed = 400;
  for (size_t elem_size : kElemSizes) {
    for (size_t n : {size_t{1}, size_t{733}, kLargeSizes[0]}) {
      SCOPED_TRACE(testing::Message() << "elem_size " << elem_size << " n " << n);
      const auto base = RandomBytes(n * elem_size, seed++);
      const auto target = Perturb(base, elem_size, 0.3, seed++);
      const Changes changes = ScalarChanges(base, target, n, elem_size);
      const std::vector<uint32_t>& positions = changes.positions;
      const std::vector<unsigned char>& values = changes.values;
      cuda::DeviceBuffer d_dst = ToDevice(base);
      const cuda::DeviceBuffer d_positions = ToDevice(std::vector<unsigned char>(
          reinterpret_cast<const unsigned char*>(positions.data()),
          reinterpret_cast<const unsigned char*>(positions.data() + positions.size())));
      const cuda::DeviceBuffer d_values = ToDevice(values);
      const Status status =
          cuda::ScatterApplyOnDevice(d_dst.data(), n, elem_size, d_positions.As<uint32_t>(),
                                     d_values.data(), positions.size());
      ASSERT_TRUE(status.ok()) << status.ToString();
      std::vector<unsigned char> got(n * elem_size);
      ASSERT_TRUE(d_dst.CopyToHost(got.data(), got.size()).ok());
      ASSERT_EQ(got, target);
    }
  }
}

TEST(CudaKernelsTest, ScatterApplyOnDeviceNamesTheFirstOutOfRangeEntry) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  const uint32_t positions[] = {1, 3, 9, 0, 12};  // entries 2 and 4 are out of range
  const uint16_t values[] = {11, 13, 19, 10, 22};
  std::vector<unsigned char> start(4 * sizeof(uint16_t), 0x5A);
  cuda::DeviceBuffer d_dst = ToDevice(start);
  const cuda::DeviceBuffer d_positions =
      ToDevice(std::vector<unsigned char>(reinterpret_cast<const unsigned char*>(positions),
                                          reinterpret_cast<const unsigned char*>(positions + 5)));
  const cuda::DeviceBuffer d_values =
      ToDevice(std::vector<unsigned char>(reinterpret_cast<const unsigned char*>(values),
                                          reinterpret_cast<const unsigned char*>(values + 5)));
  const Status bad = cuda::ScatterApplyOnDevice(d_dst.data(), 4, 2, d_positions.As<uint32_t>(),
                                                d_values.data(), 5);
  ASSERT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
  EXPECT_NE(bad.message().find("position 9 (entry 2)"), std::string::npos) << bad.ToString();
  // The record of the bad entry is reset: an in-range call afterwards succeeds.
  const Status good = cuda::ScatterApplyOnDevice(d_dst.data(), 4, 2, d_positions.As<uint32_t>(),
                                                 d_values.data(), 2);
  EXPECT_TRUE(good.ok()) << good.ToString();
  uint16_t got[4];
  ASSERT_TRUE(d_dst.CopyToHost(got, sizeof(got)).ok());
  EXPECT_EQ(got[0], 10);
  EXPECT_EQ(got[1], 11);
  EXPECT_EQ(got[2], 0x5A5A);
  EXPECT_EQ(got[3], 13);
}

TEST(CudaKernelsTest, ChunkChecksumsOnDeviceMatchScalar) {
  if (!cuda::Available()) GTEST_SKIP() << cuda::DeviceDescription();
  const auto data = RandomBytes((1u << 20) + 333, 500);
  const cuda::DeviceBuffer d_data = ToDevice(data);
  for (size_t chunk : {size_t{1000}, size_t{64} << 10}) {
    SCOPED_TRACE(testing::Message() << "chunk " << chunk);
    const size_t chunks = (data.size() + chunk - 1) / chunk;
    std::vector<uint64_t> want(chunks), got(chunks);
    ChunkChecksumsScalar(data.data(), data.size(), chunk, want.data());
    const cuda::DeviceBuffer d_out = Poisoned(chunks * sizeof(uint64_t));
    const Status status =
        cuda::ChunkChecksumsOnDevice(d_data.data(), data.size(), chunk, d_out.As<uint64_t>());
    ASSERT_TRUE(status.ok()) << status.ToString();
    ASSERT_TRUE(d_out.CopyToHost(got.data(), got.size() * sizeof(uint64_t)).ok());
    ASSERT_EQ(got, want);
  }
}

}  // namespace
}  // namespace flywheel::kernels
