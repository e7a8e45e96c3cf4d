// CUDA versions of the codec's hot loops (see kernels/cuda.h), each behind a host
// launcher that returns a Status and checks every CUDA call. The CPU references in
// kernels/kernels.h define the expected results; tests/kernels/cuda_kernels_test.cc
// compares the two bit for bit.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/cuda.h"

namespace flywheel::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------
// Errors and device memory.

Status CudaError(cudaError_t error, const char* what) {
  std::string message =
      std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")";
  switch (error) {
    case cudaErrorMemoryAllocation:
      return Status::ResourceExhausted(std::move(message));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
    case cudaErrorNoKernelImageForDevice:
      return Status::Unavailable(std::move(message));
    default:
      return Status::Internal(std::move(message));
  }
}

#define FW_CUDA_RETURN_IF_ERROR(call, what)                                    \
  do {                                                                         \
    const cudaError_t fw_cuda_error_ = (call);                                 \
    if (fw_cuda_error_ != cudaSuccess) return CudaError(fw_cuda_error_, what); \
  } while (0)

// Owns one cudaMalloc allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }

  Status Allocate(size_t bytes, const char* what) {
    // A zero-byte request still gets a valid pointer, so kernels never see nullptr.
    FW_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes), what);
    return Status::Ok();
  }
  Status CopyIn(const void* host, size_t bytes, const char* what) {
    if (bytes == 0) return Status::Ok();
    FW_CUDA_RETURN_IF_ERROR(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice), what);
    return Status::Ok();
  }
  Status CopyOut(void* host, size_t bytes, const char* what) const {
    if (bytes == 0) return Status::Ok();
    FW_CUDA_RETURN_IF_ERROR(cudaMemcpy(host, ptr_, bytes, cudaMemcpyDeviceToHost), what);
    return Status::Ok();
  }
  template <typename T>
  T* As() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

// Launch errors (bad configuration, no image for this device) surface at once; faults
// inside the kernel surface at the next synchronisation, which names the kernel too.
Status CheckLaunch(const char* kernel) {
  FW_CUDA_RETURN_IF_ERROR(cudaGetLastError(), kernel);
  FW_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), kernel);
  return Status::Ok();
}

Status CheckElemSize(size_t elem_size, const char* what) {
  if (elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8) return Status::Ok();
  return Status::InvalidArgument(std::string(what) + ": element size " + std::to_string(elem_size) +
                                 " is not 1, 2, 4 or 8");
}

// ---------------------------------------------------------------------------------------
// Compare + compact, in ascending order: (1) count the changed elements of each tile,
// (2) exclusive scan of the tile counts into output offsets, (3) each tile writes its
// positions from its offset, ordered inside the tile by a block-wide ballot scan.

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItemsPerThread = 8;
constexpr uint64_t kTileElements = uint64_t{kThreads} * kItemsPerThread;
constexpr int kScanThreads = 1024;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;

// Element `item` of thread t in a tile is tile_start + item * kThreads + t, so that each
// step reads kThreads consecutive elements (coalesced) and the steps go up in order.
template <typename T>
__global__ void CountTileChangesKernel(const T* base, const T* target, uint64_t n,
                                       uint32_t* tile_counts) {
  __shared__ uint32_t warp_totals[kWarps];
  const uint64_t tile_start = uint64_t{blockIdx.x} * kTileElements;
  uint32_t changed = 0;
  for (int item = 0; item < kItemsPerThread; ++item) {
    const uint64_t i = tile_start + uint64_t(item) * kThreads + threadIdx.x;
    if (i < n && base[i] != target[i]) ++changed;
  }
  changed = __reduce_add_sync(kFullWarp, changed);
  if (threadIdx.x % 32 == 0) warp_totals[threadIdx.x / 32] = changed;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t total = 0;
    for (int w = 0; w < kWarps; ++w) total += warp_totals[w];
    tile_counts[blockIdx.x] = total;
  }
}

// One block of kScanThreads: tile_offsets[k] = sum of tile_counts[0..k), *total = sum of
// all. 64-bit sums: n may be 2^32, so the total may not fit in 32 bits.
__global__ void ExclusiveScanKernel(const uint32_t* tile_counts, uint64_t tiles,
                                    uint64_t* tile_offsets, uint64_t* total) {
  __shared__ uint64_t warp_sums[kScanThreads / 32];
  __shared__ uint64_t carry;
  const unsigned lane = threadIdx.x % 32;
  const unsigned warp = threadIdx.x / 32;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (uint64_t start = 0; start < tiles; start += kScanThreads) {
    const uint64_t k = start + threadIdx.x;
    const uint64_t value = k < tiles ? tile_counts[k] : 0;
    uint64_t inclusive = value;
    for (unsigned d = 1; d < 32; d <<= 1) {
      const uint64_t up = __shfl_up_sync(kFullWarp, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
      uint64_t sum = warp_sums[lane];
      for (unsigned d = 1; d < 32; d <<= 1) {
        const uint64_t up = __shfl_up_sync(kFullWarp, sum, d);
        if (lane >= d) sum += up;
      }
      warp_sums[lane] = sum;
    }
    __syncthreads();
    const uint64_t exclusive = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + inclusive - value;
    if (k < tiles) tile_offsets[k] = exclusive;
    __syncthreads();  // every thread has read `carry` and `warp_sums`
    if (threadIdx.x == kScanThreads - 1) carry = exclusive + value;
    __syncthreads();
  }
  if (threadIdx.x == 0) *total = carry;
}

template <typename T>
__global__ void CompactTileKernel(const T* base, const T* target, uint64_t n,
                                  const uint32_t* tile_counts, const uint64_t* tile_offsets,
                                  uint32_t* out_positions) {
  __shared__ uint32_t warp_counts[kWarps];
  if (tile_counts[blockIdx.x] == 0) return;  // uniform across the block
  const unsigned lane = threadIdx.x % 32;
  const unsigned warp = threadIdx.x / 32;
  const uint64_t tile_start = uint64_t{blockIdx.x} * kTileElements;
  uint64_t next = tile_offsets[blockIdx.x];
  for (int item = 0; item < kItemsPerThread; ++item) {
    const uint64_t i = tile_start + uint64_t(item) * kThreads + threadIdx.x;
    const bool differs = i < n && base[i] != target[i];
    const unsigned ballot = __ballot_sync(kFullWarp, differs);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    uint32_t before_warp = 0;
    uint32_t step_total = 0;
    for (unsigned w = 0; w < kWarps; ++w) {
      const uint32_t c = warp_counts[w];
      before_warp += w < warp ? c : 0;
      step_total += c;
    }
    if (differs) {
      const uint32_t before_lane = __popc(ballot & ((1u << lane) - 1));
      out_positions[next + before_warp + before_lane] = static_cast<uint32_t>(i);
    }
    next += step_total;
    __syncthreads();  // warp_counts is rewritten by the next step
  }
}

template <typename T>
Status CompareCompactOnDevice(const void* base, const void* target, uint64_t n,
                              uint32_t* out_positions, size_t* changed) {
  const uint64_t tiles = (n + kTileElements - 1) / kTileElements;
  const size_t bytes = n * sizeof(T);
  DeviceBuffer d_base, d_target, d_counts, d_offsets, d_total, d_positions;
  FW_RETURN_IF_ERROR(d_base.Allocate(bytes, "cudaMalloc(base)"));
  FW_RETURN_IF_ERROR(d_target.Allocate(bytes, "cudaMalloc(target)"));
  FW_RETURN_IF_ERROR(d_counts.Allocate(tiles * sizeof(uint32_t), "cudaMalloc(tile counts)"));
  FW_RETURN_IF_ERROR(d_offsets.Allocate(tiles * sizeof(uint64_t), "cudaMalloc(tile offsets)"));
  FW_RETURN_IF_ERROR(d_total.Allocate(sizeof(uint64_t), "cudaMalloc(total)"));
  FW_RETURN_IF_ERROR(d_positions.Allocate(n * sizeof(uint32_t), "cudaMalloc(positions)"));
  FW_RETURN_IF_ERROR(d_base.CopyIn(base, bytes, "cudaMemcpy(base to device)"));
  FW_RETURN_IF_ERROR(d_target.CopyIn(target, bytes, "cudaMemcpy(target to device)"));

  CountTileChangesKernel<T><<<static_cast<unsigned>(tiles), kThreads>>>(
      d_base.As<T>(), d_target.As<T>(), n, d_counts.As<uint32_t>());
  FW_RETURN_IF_ERROR(CheckLaunch("CountTileChangesKernel"));
  ExclusiveScanKernel<<<1, kScanThreads>>>(d_counts.As<uint32_t>(), tiles, d_offsets.As<uint64_t>(),
                                           d_total.As<uint64_t>());
  FW_RETURN_IF_ERROR(CheckLaunch("ExclusiveScanKernel"));
  CompactTileKernel<T><<<static_cast<unsigned>(tiles), kThreads>>>(
      d_base.As<T>(), d_target.As<T>(), n, d_counts.As<uint32_t>(), d_offsets.As<uint64_t>(),
      d_positions.As<uint32_t>());
  FW_RETURN_IF_ERROR(CheckLaunch("CompactTileKernel"));

  uint64_t total = 0;
  FW_RETURN_IF_ERROR(d_total.CopyOut(&total, sizeof(total), "cudaMemcpy(total to host)"));
  if (total > n) {
    return Status::Internal("cuda::CompareCompact: device counted " + std::to_string(total) +
                            " changes in " + std::to_string(n) + " elements");
  }
  FW_RETURN_IF_ERROR(d_positions.CopyOut(out_positions, total * sizeof(uint32_t),
                                         "cudaMemcpy(positions to host)"));
  *changed = static_cast<size_t>(total);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Scatter.

template <typename T>
__global__ void ScatterApplyKernel(T* dst, const uint32_t* positions, const T* values,
                                   uint64_t count) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += stride) {
    dst[positions[i]] = values[i];
  }
}

unsigned GridFor(uint64_t work_items) {
  const uint64_t blocks = (work_items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 ? (blocks == 0 ? 1 : blocks) : 65535);
}

template <typename T>
Status ScatterApplyOnDevice(void* dst, uint64_t dst_elements, const uint32_t* positions,
                            const void* values, uint64_t count) {
  DeviceBuffer d_dst, d_positions, d_values;
  FW_RETURN_IF_ERROR(d_dst.Allocate(dst_elements * sizeof(T), "cudaMalloc(dst)"));
  FW_RETURN_IF_ERROR(d_positions.Allocate(count * sizeof(uint32_t), "cudaMalloc(positions)"));
  FW_RETURN_IF_ERROR(d_values.Allocate(count * sizeof(T), "cudaMalloc(values)"));
  FW_RETURN_IF_ERROR(d_dst.CopyIn(dst, dst_elements * sizeof(T), "cudaMemcpy(dst to device)"));
  FW_RETURN_IF_ERROR(
      d_positions.CopyIn(positions, count * sizeof(uint32_t), "cudaMemcpy(positions to device)"));
  FW_RETURN_IF_ERROR(d_values.CopyIn(values, count * sizeof(T), "cudaMemcpy(values to device)"));
  ScatterApplyKernel<T><<<GridFor(count), kThreads>>>(d_dst.As<T>(), d_positions.As<uint32_t>(),
                                                      d_values.As<T>(), count);
  FW_RETURN_IF_ERROR(CheckLaunch("ScatterApplyKernel"));
  return d_dst.CopyOut(dst, dst_elements * sizeof(T), "cudaMemcpy(dst to host)");
}

// ---------------------------------------------------------------------------------------
// XXH3-64 (seed 0, default secret), one thread per chunk. A transcription of the
// reference algorithm (xxhash.h 0.8, scalar path) that runs on host and device; the
// test compares it with XXH3_64bits on every length class: 0, 1-3, 4-8, 9-16, 17-128,
// 129-240 and > 240 bytes (whole 1 KiB blocks, partial stripes, the last stripe).

#define FW_XXH3_DEFAULT_SECRET                                                                    \
  0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, \
      0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67,   \
      0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff,   \
      0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81,   \
      0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b,   \
      0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef,   \
      0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc,   \
      0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8,   \
      0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3,   \
      0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda,   \
      0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47,   \
      0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95,   \
      0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e

constexpr size_t kSecretSize = 192;
__constant__ uint8_t kDeviceSecret[kSecretSize] = {FW_XXH3_DEFAULT_SECRET};
// The functions below are __host__ __device__ so that the transcription can be checked
// against libxxhash on a machine without a GPU (pass this host copy of the secret).
[[maybe_unused]] constexpr uint8_t kHostSecret[kSecretSize] = {FW_XXH3_DEFAULT_SECRET};
#undef FW_XXH3_DEFAULT_SECRET

constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ull;
constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ull;
constexpr size_t kStripeLen = 64;
constexpr size_t kSecretConsumeRate = 8;
constexpr size_t kSecretSizeMin = 136;
constexpr size_t kMidsizeStartOffset = 3;
constexpr size_t kMidsizeLastOffset = 17;
constexpr size_t kSecretLastAccStart = 7;
constexpr size_t kSecretMergeAccsStart = 11;

// Both CPUs and NVIDIA GPUs are little-endian, as XXH3's reads are defined.
__host__ __device__ inline uint64_t Read64(const uint8_t* p) {
  uint64_t v;
  memcpy(&v, p, sizeof(v));
  return v;
}
__host__ __device__ inline uint32_t Read32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, sizeof(v));
  return v;
}
__host__ __device__ inline uint64_t Rotl64(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}
__host__ __device__ inline uint32_t Swap32(uint32_t x) {
  return ((x << 24) & 0xff000000u) | ((x << 8) & 0x00ff0000u) | ((x >> 8) & 0x0000ff00u) |
         ((x >> 24) & 0x000000ffu);
}
__host__ __device__ inline uint64_t Swap64(uint64_t x) {
  return (uint64_t{Swap32(static_cast<uint32_t>(x))} << 32) |
         Swap32(static_cast<uint32_t>(x >> 32));
}
__host__ __device__ inline uint64_t Mul128Fold64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 product = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
#endif
}
__host__ __device__ inline uint64_t Xxh64Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  h ^= h >> 32;
  return h;
}
__host__ __device__ inline uint64_t Xxh3Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kPrimeMx1;
  h ^= h >> 32;
  return h;
}
__host__ __device__ inline uint64_t Rrmxmx(uint64_t h, uint64_t len) {
  h ^= Rotl64(h, 49) ^ Rotl64(h, 24);
  h *= kPrimeMx2;
  h ^= (h >> 35) + len;
  h *= kPrimeMx2;
  h ^= h >> 28;
  return h;
}
__host__ __device__ inline uint64_t Mix16B(const uint8_t* input, const uint8_t* secret,
                                           uint64_t seed) {
  return Mul128Fold64(Read64(input) ^ (Read64(secret) + seed),
                      Read64(input + 8) ^ (Read64(secret + 8) - seed));
}

__host__ __device__ inline uint64_t Xxh3Len0To16(const uint8_t* input, size_t len,
                                                 const uint8_t* secret, uint64_t seed) {
  if (len > 8) {
    const uint64_t bitflip1 = (Read64(secret + 24) ^ Read64(secret + 32)) + seed;
    const uint64_t bitflip2 = (Read64(secret + 40) ^ Read64(secret + 48)) - seed;
    const uint64_t lo = Read64(input) ^ bitflip1;
    const uint64_t hi = Read64(input + len - 8) ^ bitflip2;
    const uint64_t acc = len + Swap64(lo) + hi + Mul128Fold64(lo, hi);
    return Xxh3Avalanche(acc);
  }
  if (len >= 4) {
    seed ^= uint64_t{Swap32(static_cast<uint32_t>(seed))} << 32;
    const uint32_t in1 = Read32(input);
    const uint32_t in2 = Read32(input + len - 4);
    const uint64_t bitflip = (Read64(secret + 8) ^ Read64(secret + 16)) - seed;
    const uint64_t in64 = in2 + (uint64_t{in1} << 32);
    return Rrmxmx(in64 ^ bitflip, len);
  }
  if (len > 0) {
    const uint32_t c1 = input[0];
    const uint32_t c2 = input[len >> 1];
    const uint32_t c3 = input[len - 1];
    const uint32_t combined =
        (c1 << 16) | (c2 << 24) | (c3 << 0) | (static_cast<uint32_t>(len) << 8);
    const uint64_t bitflip = (Read32(secret) ^ Read32(secret + 4)) + seed;
    return Xxh64Avalanche(uint64_t{combined} ^ bitflip);
  }
  return Xxh64Avalanche(seed ^ (Read64(secret + 56) ^ Read64(secret + 64)));
}

__host__ __device__ inline uint64_t Xxh3Len17To128(const uint8_t* input, size_t len,
                                                   const uint8_t* secret, uint64_t seed) {
  uint64_t acc = len * kPrime64_1;
  if (len > 32) {
    if (len > 64) {
      if (len > 96) {
        acc += Mix16B(input + 48, secret + 96, seed);
        acc += Mix16B(input + len - 64, secret + 112, seed);
      }
      acc += Mix16B(input + 32, secret + 64, seed);
      acc += Mix16B(input + len - 48, secret + 80, seed);
    }
    acc += Mix16B(input + 16, secret + 32, seed);
    acc += Mix16B(input + len - 32, secret + 48, seed);
  }
  acc += Mix16B(input + 0, secret + 0, seed);
  acc += Mix16B(input + len - 16, secret + 16, seed);
  return Xxh3Avalanche(acc);
}

__host__ __device__ inline uint64_t Xxh3Len129To240(const uint8_t* input, size_t len,
                                                    const uint8_t* secret, uint64_t seed) {
  uint64_t acc = len * kPrime64_1;
  const size_t rounds = len / 16;
  for (size_t i = 0; i < 8; ++i) acc += Mix16B(input + 16 * i, secret + 16 * i, seed);
  acc = Xxh3Avalanche(acc);
  for (size_t i = 8; i < rounds; ++i) {
    acc += Mix16B(input + 16 * i, secret + 16 * (i - 8) + kMidsizeStartOffset, seed);
  }
  acc += Mix16B(input + len - 16, secret + kSecretSizeMin - kMidsizeLastOffset, seed);
  return Xxh3Avalanche(acc);
}

__host__ __device__ inline void Accumulate512(uint64_t* acc, const uint8_t* input,
                                              const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t data = Read64(input + 8 * i);
    const uint64_t key = data ^ Read64(secret + 8 * i);
    acc[i ^ 1] += data;
    acc[i] += (key & 0xFFFFFFFFu) * (key >> 32);
  }
}

__host__ __device__ inline void ScrambleAcc(uint64_t* acc, const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= Read64(secret + 8 * i);
    a *= kPrime32_1;
    acc[i] = a;
  }
}

// Seed 0 only: the seeded long hash derives a custom secret, which nothing here needs.
__host__ __device__ inline uint64_t Xxh3LongSeed0(const uint8_t* input, size_t len,
                                                  const uint8_t* secret) {
  uint64_t acc[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                     kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  const size_t stripes_per_block = (kSecretSize - kStripeLen) / kSecretConsumeRate;
  const size_t block_len = kStripeLen * stripes_per_block;
  const size_t blocks = (len - 1) / block_len;
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t s = 0; s < stripes_per_block; ++s) {
      Accumulate512(acc, input + b * block_len + s * kStripeLen, secret + s * kSecretConsumeRate);
    }
    ScrambleAcc(acc, secret + kSecretSize - kStripeLen);
  }
  const size_t last_stripes = ((len - 1) - block_len * blocks) / kStripeLen;
  for (size_t s = 0; s < last_stripes; ++s) {
    Accumulate512(acc, input + blocks * block_len + s * kStripeLen,
                  secret + s * kSecretConsumeRate);
  }
  Accumulate512(acc, input + len - kStripeLen,
                secret + kSecretSize - kStripeLen - kSecretLastAccStart);

  uint64_t result = len * kPrime64_1;
  const uint8_t* merge_secret = secret + kSecretMergeAccsStart;
  for (int i = 0; i < 4; ++i) {
    result += Mul128Fold64(acc[2 * i] ^ Read64(merge_secret + 16 * i),
                           acc[2 * i + 1] ^ Read64(merge_secret + 16 * i + 8));
  }
  return Xxh3Avalanche(result);
}

// XXH3_64bits(input, len) with `secret` = the 192-byte default secret.
__host__ __device__ inline uint64_t Xxh3_64(const uint8_t* input, size_t len,
                                            const uint8_t* secret) {
  if (len <= 16) return Xxh3Len0To16(input, len, secret, 0);
  if (len <= 128) return Xxh3Len17To128(input, len, secret, 0);
  if (len <= 240) return Xxh3Len129To240(input, len, secret, 0);
  return Xxh3LongSeed0(input, len, secret);
}

__global__ void ChunkChecksumsKernel(const uint8_t* data, uint64_t size, uint64_t chunk_bytes,
                                     uint64_t chunks, uint64_t* out) {
  __shared__ uint8_t secret[kSecretSize];
  for (unsigned i = threadIdx.x; i < kSecretSize; i += blockDim.x) secret[i] = kDeviceSecret[i];
  __syncthreads();
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t k = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; k < chunks; k += stride) {
    const uint64_t offset = k * chunk_bytes;
    const uint64_t remaining = size - offset;
    const uint64_t length = remaining < chunk_bytes ? remaining : chunk_bytes;
    out[k] = Xxh3_64(data + offset, length, secret);
  }
}

// ---------------------------------------------------------------------------------------
// Device discovery.

struct DeviceProbe {
  bool usable = false;
  std::string description;
};

DeviceProbe ProbeDevice() {
  DeviceProbe probe;
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear it so that it does not resurface at a later call
    probe.description = std::string("no CUDA device: ") + cudaGetErrorString(error);
    return probe;
  }
  if (count == 0) {
    probe.description = "no CUDA device: cudaGetDeviceCount found none";
    return probe;
  }
  cudaDeviceProp properties{};
  error = cudaGetDeviceProperties(&properties, 0);
  if (error != cudaSuccess) {
    cudaGetLastError();
    probe.description = std::string("no CUDA device: ") + cudaGetErrorString(error);
    return probe;
  }
  // This build carries code for one architecture (CMAKE_CUDA_ARCHITECTURES); asking for a
  // kernel's attributes fails when the device cannot load it.
  cudaFuncAttributes attributes{};
  error = cudaFuncGetAttributes(&attributes, ExclusiveScanKernel);
  const std::string device = std::string(properties.name) + " (sm_" +
                             std::to_string(properties.major) + std::to_string(properties.minor) +
                             ")";
  if (error != cudaSuccess) {
    cudaGetLastError();
    probe.description = "no usable CUDA device: " + device +
                        " cannot run this build's kernels: " + cudaGetErrorString(error);
    return probe;
  }
  probe.usable = true;
  probe.description = device;
  return probe;
}

const DeviceProbe& Probe() {
  static const DeviceProbe probe = ProbeDevice();
  return probe;
}

Status RequireDevice() {
  if (Probe().usable) return Status::Ok();
  return Status::Unavailable(Probe().description);
}

}  // namespace

bool Available() {
  return Probe().usable;
}

std::string DeviceDescription() {
  return Probe().description;
}

Result<size_t> CompareCompact(const void* base, const void* target, size_t n, size_t elem_size,
                              uint32_t* out_positions) {
  FW_RETURN_IF_ERROR(CheckElemSize(elem_size, "cuda::CompareCompact"));
  if (n > (uint64_t{1} << 32)) {
    return Status::InvalidArgument("cuda::CompareCompact: " + std::to_string(n) +
                                   " elements; positions are 32-bit, at most 2^32");
  }
  FW_RETURN_IF_ERROR(RequireDevice());
  if (n == 0) return size_t{0};
  size_t changed = 0;
  const Status status = [&]() -> Status {
    switch (elem_size) {
      case 1:
        return CompareCompactOnDevice<uint8_t>(base, target, n, out_positions, &changed);
      case 2:
        return CompareCompactOnDevice<uint16_t>(base, target, n, out_positions, &changed);
      case 4:
        return CompareCompactOnDevice<uint32_t>(base, target, n, out_positions, &changed);
      default:
        return CompareCompactOnDevice<uint64_t>(base, target, n, out_positions, &changed);
    }
  }();
  if (!status.ok()) return status.WithContext("cuda::CompareCompact");
  return changed;
}

Status ScatterApply(void* dst, size_t dst_elements, size_t elem_size, const uint32_t* positions,
                    const void* values, size_t count) {
  FW_RETURN_IF_ERROR(CheckElemSize(elem_size, "cuda::ScatterApply"));
  for (size_t i = 0; i < count; ++i) {
    if (positions[i] >= dst_elements) {
      return Status::InvalidArgument("cuda::ScatterApply: position " +
                                     std::to_string(positions[i]) + " (entry " + std::to_string(i) +
                                     ") is out of range for " + std::to_string(dst_elements) +
                                     " elements");
    }
  }
  FW_RETURN_IF_ERROR(RequireDevice());
  if (count == 0) return Status::Ok();
  const Status status = [&]() -> Status {
    switch (elem_size) {
      case 1:
        return ScatterApplyOnDevice<uint8_t>(dst, dst_elements, positions, values, count);
      case 2:
        return ScatterApplyOnDevice<uint16_t>(dst, dst_elements, positions, values, count);
      case 4:
        return ScatterApplyOnDevice<uint32_t>(dst, dst_elements, positions, values, count);
      default:
        return ScatterApplyOnDevice<uint64_t>(dst, dst_elements, positions, values, count);
    }
  }();
  return status.WithContext("cuda::ScatterApply");
}

Status ChunkChecksums(const void* data, size_t size, size_t chunk_bytes, uint64_t* out) {
  if (chunk_bytes == 0) return Status::InvalidArgument("cuda::ChunkChecksums: chunk_bytes is 0");
  FW_RETURN_IF_ERROR(RequireDevice());
  if (size == 0) return Status::Ok();
  const uint64_t chunks = (size + chunk_bytes - 1) / chunk_bytes;
  DeviceBuffer d_data, d_out;
  FW_RETURN_IF_ERROR(d_data.Allocate(size, "cuda::ChunkChecksums: cudaMalloc(data)"));
  FW_RETURN_IF_ERROR(
      d_out.Allocate(chunks * sizeof(uint64_t), "cuda::ChunkChecksums: cudaMalloc(out)"));
  FW_RETURN_IF_ERROR(d_data.CopyIn(data, size, "cuda::ChunkChecksums: cudaMemcpy(data to device)"));
  ChunkChecksumsKernel<<<GridFor(chunks), kThreads>>>(d_data.As<uint8_t>(), size, chunk_bytes,
                                                      chunks, d_out.As<uint64_t>());
  FW_RETURN_IF_ERROR(CheckLaunch("cuda::ChunkChecksums: ChunkChecksumsKernel"));
  return d_out.CopyOut(out, chunks * sizeof(uint64_t),
                       "cuda::ChunkChecksums: cudaMemcpy(checksums to host)");
}

}  // namespace flywheel::kernels::cuda
