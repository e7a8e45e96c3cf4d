// CUDA versions of the codec's hot loops (see kernels/cuda.h), each behind a host
// launcher that returns a Status and checks every CUDA call. The CPU references in
// kernels/kernels.h define the expected results; tests/kernels/cuda_kernels_test.cc
// compares the two bit for bit.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "kernels/cuda.h"

namespace flywheel::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------
// Errors.

Status CudaError(cudaError_t error, const std::string& what) {
  // Clears the error so that a later cudaGetLastError does not report it again (sticky
  // errors, faults inside a kernel, stay: the context is lost).
  cudaGetLastError();
  std::string message =
      what + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")";
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

Status CheckAligned(const void* device_pointer, size_t alignment, const char* what,
                    const char* name) {
  if (reinterpret_cast<uintptr_t>(device_pointer) % alignment == 0) return Status::Ok();
  return Status::InvalidArgument(std::string(what) + ": " + name + " is not aligned to " +
                                 std::to_string(alignment) + " bytes");
}

// Returns fn(T{}) with T the unsigned integer of elem_size bytes (a tag: fn takes `auto`).
// REQUIRES: CheckElemSize(elem_size) passed.
template <typename Fn>
auto DispatchElemSize(size_t elem_size, Fn&& fn) {
  switch (elem_size) {
    case 1:
      return fn(uint8_t{});
    case 2:
      return fn(uint16_t{});
    case 4:
      return fn(uint32_t{});
    default:
      return fn(uint64_t{});
  }
}

// ---------------------------------------------------------------------------------------
// Compare + compact, in ascending order, reading base and target once:
//   (1) MarkChangesKernel: per tile of kTileElements elements, a bitmap word per 32
//       elements (bit b of word w: element 32w+b changed) and the tile's count;
//   (2) ExclusiveScanKernel twice: tile counts into offsets inside groups of kScanThreads
//       tiles, then the group sums into group offsets and the total;
//   (3) CompactKernel: one thread per bitmap word writes its elements' positions from
//       group offset + tile offset + the words before it in the tile.

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItemsPerThread = 8;
constexpr uint64_t kTileElements = uint64_t{kThreads} * kItemsPerThread;
constexpr uint64_t kWordsPerTile = kTileElements / 32;
constexpr unsigned kWarpsPerTile = kWordsPerTile / 32;
constexpr int kScanThreads = 1024;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;
constexpr size_t kScratchAlignment = 256;
static_assert(kWordsPerTile % 32 == 0 && kThreads % kWordsPerTile == 0,
              "CompactKernel: a tile is whole warps, a block whole tiles");

// Element `item` of thread t in a tile is tile_start + item * kThreads + t, so that each
// step reads kThreads consecutive elements (coalesced) and a warp's ballot is one bitmap
// word.
template <typename T>
__global__ void MarkChangesKernel(const T* __restrict__ base, const T* __restrict__ target,
                                  uint64_t n, uint32_t* __restrict__ bitmap,
                                  uint32_t* __restrict__ tile_counts) {
  __shared__ uint32_t warp_totals[kWarps];
  const unsigned lane = threadIdx.x % 32;
  const unsigned warp = threadIdx.x / 32;
  const uint64_t tile_start = uint64_t{blockIdx.x} * kTileElements;
  bool differs[kItemsPerThread];
  if (tile_start + kTileElements <= n) {
    // A whole tile: every load is issued before the first comparison.
    T a[kItemsPerThread];
    T b[kItemsPerThread];
#pragma unroll
    for (int item = 0; item < kItemsPerThread; ++item) {
      const uint64_t i = tile_start + uint64_t(item) * kThreads + threadIdx.x;
      a[item] = base[i];
      b[item] = target[i];
    }
#pragma unroll
    for (int item = 0; item < kItemsPerThread; ++item) differs[item] = a[item] != b[item];
  } else {
#pragma unroll
    for (int item = 0; item < kItemsPerThread; ++item) {
      const uint64_t i = tile_start + uint64_t(item) * kThreads + threadIdx.x;
      differs[item] = i < n && base[i] != target[i];
    }
  }
  uint32_t changed = 0;
#pragma unroll
  for (int item = 0; item < kItemsPerThread; ++item) {
    const unsigned ballot = __ballot_sync(kFullWarp, differs[item]);
    if (lane == 0) bitmap[(tile_start + uint64_t(item) * kThreads) / 32 + warp] = ballot;
    changed += __popc(ballot);
  }
  if (lane == 0) warp_totals[warp] = changed;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t total = 0;
    for (int w = 0; w < kWarps; ++w) total += warp_totals[w];
    tile_counts[blockIdx.x] = total;
  }
}

// Blocks of kScanThreads threads. Block b scans values[b*span, min((b+1)*span, count)):
// offsets[k] = sum of the values from the start of its range to k (exclusive), and
// block_sums[b] = the range's sum. 64-bit sums: n may be 2^32, so the total may not fit
// in 32 bits.
template <typename In>
__global__ void ExclusiveScanKernel(const In* values, uint64_t count, uint64_t span,
                                    uint64_t* offsets, uint64_t* block_sums) {
  __shared__ uint64_t warp_sums[kScanThreads / 32];
  __shared__ uint64_t carry;
  const unsigned lane = threadIdx.x % 32;
  const unsigned warp = threadIdx.x / 32;
  const uint64_t begin = uint64_t{blockIdx.x} * span;
  const uint64_t end = count - begin < span ? count : begin + span;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (uint64_t start = begin; start < end; start += kScanThreads) {
    const uint64_t k = start + threadIdx.x;
    const uint64_t value = k < end ? uint64_t{values[k]} : 0;
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
    if (k < end) offsets[k] = exclusive;
    __syncthreads();  // every thread has read `carry` and `warp_sums`
    if (threadIdx.x == kScanThreads - 1) carry = exclusive + value;
    __syncthreads();
  }
  if (threadIdx.x == 0) block_sums[blockIdx.x] = carry;
}

// One thread per bitmap word; a block is kThreads / kWordsPerTile whole tiles. Positions
// from `capacity` on are counted but not written.
__global__ void CompactKernel(const uint32_t* __restrict__ bitmap, uint64_t words,
                              const uint64_t* __restrict__ tile_offsets,
                              const uint64_t* __restrict__ group_offsets,
                              uint32_t* __restrict__ out_positions, uint64_t capacity) {
  __shared__ uint32_t warp_totals[kWarps];
  const unsigned lane = threadIdx.x % 32;
  const unsigned warp = threadIdx.x / 32;
  const uint64_t word_index = uint64_t{blockIdx.x} * kThreads + threadIdx.x;
  const uint32_t word = word_index < words ? bitmap[word_index] : 0;
  const uint32_t bits = __popc(word);
  uint32_t inclusive = bits;
  for (unsigned d = 1; d < 32; d <<= 1) {
    const uint32_t up = __shfl_up_sync(kFullWarp, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (word == 0) return;
  uint32_t before = inclusive - bits;
  for (unsigned w = warp - warp % kWarpsPerTile; w < warp; ++w) before += warp_totals[w];
  const uint64_t tile = word_index / kWordsPerTile;
  uint64_t next = group_offsets[tile / kScanThreads] + tile_offsets[tile] + before;
  // word_index < 2^27 since n <= 2^32, so the element index fits in 32 bits.
  const uint32_t first = static_cast<uint32_t>(word_index * 32);
  for (uint32_t rest = word; rest != 0; rest &= rest - 1) {
    if (next < capacity) out_positions[next] = first + static_cast<uint32_t>(__ffs(rest) - 1);
    ++next;
  }
}

size_t AlignScratch(size_t bytes) {
  return (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
}

// Where CompareCompactOnDevice keeps its intermediate arrays inside the caller's scratch.
struct CompactScratch {
  uint64_t tiles = 0;
  uint64_t groups = 0;
  size_t bitmap = 0, tile_counts = 0, tile_offsets = 0, group_sums = 0, group_offsets = 0,
         total = 0, bytes = 0;  // byte offsets, then the size
};

CompactScratch LayOutScratch(uint64_t n) {
  CompactScratch layout;
  layout.tiles = n == 0 ? 1 : (n + kTileElements - 1) / kTileElements;
  layout.groups = (layout.tiles + kScanThreads - 1) / kScanThreads;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t offset = at;
    at += AlignScratch(bytes);
    return offset;
  };
  layout.bitmap = take(layout.tiles * kWordsPerTile * sizeof(uint32_t));
  layout.tile_counts = take(layout.tiles * sizeof(uint32_t));
  layout.tile_offsets = take(layout.tiles * sizeof(uint64_t));
  layout.group_sums = take(layout.groups * sizeof(uint64_t));
  layout.group_offsets = take(layout.groups * sizeof(uint64_t));
  layout.total = take(sizeof(uint64_t));
  layout.bytes = at;
  return layout;
}

// REQUIRES: 0 < n <= 2^32; scratch laid out by LayOutScratch(n).
template <typename T>
Result<uint64_t> RunCompareCompact(const T* base, const T* target, uint64_t n,
                                   uint32_t* out_positions, uint64_t capacity, char* scratch) {
  const CompactScratch layout = LayOutScratch(n);
  auto* bitmap = reinterpret_cast<uint32_t*>(scratch + layout.bitmap);
  auto* tile_counts = reinterpret_cast<uint32_t*>(scratch + layout.tile_counts);
  auto* tile_offsets = reinterpret_cast<uint64_t*>(scratch + layout.tile_offsets);
  auto* group_sums = reinterpret_cast<uint64_t*>(scratch + layout.group_sums);
  auto* group_offsets = reinterpret_cast<uint64_t*>(scratch + layout.group_offsets);
  auto* total = reinterpret_cast<uint64_t*>(scratch + layout.total);

  MarkChangesKernel<T>
      <<<static_cast<unsigned>(layout.tiles), kThreads>>>(base, target, n, bitmap, tile_counts);
  FW_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "MarkChangesKernel");
  ExclusiveScanKernel<uint32_t><<<static_cast<unsigned>(layout.groups), kScanThreads>>>(
      tile_counts, layout.tiles, kScanThreads, tile_offsets, group_sums);
  FW_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "ExclusiveScanKernel(tiles)");
  ExclusiveScanKernel<uint64_t>
      <<<1, kScanThreads>>>(group_sums, layout.groups, layout.groups, group_offsets, total);
  FW_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "ExclusiveScanKernel(groups)");
  const uint64_t words = layout.tiles * kWordsPerTile;
  CompactKernel<<<static_cast<unsigned>((words + kThreads - 1) / kThreads), kThreads>>>(
      bitmap, words, tile_offsets, group_offsets, out_positions, capacity);
  FW_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "CompactKernel");

  // The copy waits for the kernels; a fault in any of them surfaces here.
  uint64_t changed = 0;
  FW_CUDA_RETURN_IF_ERROR(cudaMemcpy(&changed, total, sizeof(changed), cudaMemcpyDeviceToHost),
                          "MarkChanges/ExclusiveScan/CompactKernel, then cudaMemcpy(count)");
  if (changed > n) {
    return Status::Internal("device counted " + std::to_string(changed) + " changes in " +
                            std::to_string(n) + " elements");
  }
  return changed;
}

// ---------------------------------------------------------------------------------------
// Scatter. Entries whose position is out of range are not written; the first such entry
// is recorded here (kNoBadEntry when none). A __device__ variable is one per process and
// device, so ScatterApplyOnDevice calls are serialised by g_scatter_mutex.

constexpr unsigned long long kNoBadEntry = ~0ull;
__device__ unsigned long long g_first_bad_entry = kNoBadEntry;
std::mutex g_scatter_mutex;

template <typename T>
__global__ void ScatterApplyKernel(T* __restrict__ dst, uint64_t dst_elements,
                                   const uint32_t* __restrict__ positions,
                                   const T* __restrict__ values, uint64_t count) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint32_t position = positions[i];
    if (position < dst_elements) {
      dst[position] = values[i];
    } else {
      atomicMin(&g_first_bad_entry, static_cast<unsigned long long>(i));
    }
  }
}

unsigned GridFor(uint64_t work_items) {
  const uint64_t blocks = (work_items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 ? (blocks == 0 ? 1 : blocks) : 65535);
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
// On the device, memcpy from a pointer of unknown alignment compiles to byte loads (and
// a branch to a plain load for aligned pointers is merged back into them). So the device
// reads the one or two aligned words that hold the bytes and shifts: it never reads past
// the aligned word that holds the last byte, which is as mapped as that byte is.
__host__ __device__ inline uint64_t Read64(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  const unsigned shift = static_cast<unsigned>(address % 8) * 8;
  const auto* word = reinterpret_cast<const uint64_t*>(address - address % 8);
  if (shift == 0) return word[0];
  return (word[0] >> shift) | (word[1] << (64 - shift));
#else
  uint64_t v;
  memcpy(&v, p, sizeof(v));
  return v;
#endif
}
__host__ __device__ inline uint32_t Read32(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  const unsigned shift = static_cast<unsigned>(address % 4) * 8;
  const auto* word = reinterpret_cast<const uint32_t*>(address - address % 4);
  if (shift == 0) return word[0];
  return (word[0] >> shift) | (word[1] << (32 - shift));
#else
  uint32_t v;
  memcpy(&v, p, sizeof(v));
  return v;
#endif
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
  __shared__ alignas(8) uint8_t secret[kSecretSize];  // Read64 reads aligned words
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
  int multiprocessors = 1;
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
  error = cudaFuncGetAttributes(&attributes, ExclusiveScanKernel<uint32_t>);
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
  probe.multiprocessors = properties.multiProcessorCount > 0 ? properties.multiProcessorCount : 1;
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

// ---------------------------------------------------------------------------------------
// DeviceBuffer.

Result<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  FW_RETURN_IF_ERROR(RequireDevice());
  void* ptr = nullptr;
  // A zero-byte request still gets a valid pointer, so kernels never see nullptr.
  FW_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes),
                          "cudaMalloc(" + std::to_string(bytes) + " bytes)");
  DeviceBuffer buffer;
  buffer.ptr_ = ptr;
  buffer.size_ = bytes;
  return std::move(buffer);  // explicit: nvcc does not move into Result on its own
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), size_(other.size_) {
  other.ptr_ = nullptr;
  other.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = other.ptr_;
    size_ = other.size_;
    other.ptr_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

namespace {

Status CheckRange(size_t offset, size_t bytes, size_t size, const char* what) {
  if (offset <= size && bytes <= size - offset) return Status::Ok();
  return Status::InvalidArgument(std::string(what) + ": " + std::to_string(bytes) +
                                 " bytes at offset " + std::to_string(offset) +
                                 " do not fit in a buffer of " + std::to_string(size) + " bytes");
}

}  // namespace

Status DeviceBuffer::CopyFromHost(const void* host, size_t bytes, size_t offset) {
  FW_RETURN_IF_ERROR(CheckRange(offset, bytes, size_, "DeviceBuffer::CopyFromHost"));
  if (bytes == 0) return Status::Ok();
  FW_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(static_cast<char*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice),
      "DeviceBuffer::CopyFromHost: cudaMemcpy(" + std::to_string(bytes) + " bytes)");
  return Status::Ok();
}

Status DeviceBuffer::CopyToHost(void* host, size_t bytes, size_t offset) const {
  FW_RETURN_IF_ERROR(CheckRange(offset, bytes, size_, "DeviceBuffer::CopyToHost"));
  if (bytes == 0) return Status::Ok();
  FW_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost),
      "DeviceBuffer::CopyToHost: cudaMemcpy(" + std::to_string(bytes) + " bytes)");
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Device-memory entry points.

size_t CompareCompactScratchBytes(size_t n) {
  return LayOutScratch(n).bytes;
}

Result<size_t> CompareCompactOnDevice(const void* base, const void* target, size_t n,
                                      size_t elem_size, uint32_t* out_positions,
                                      size_t positions_capacity, void* scratch,
                                      size_t scratch_bytes) {
  constexpr const char* kWhat = "cuda::CompareCompactOnDevice";
  FW_RETURN_IF_ERROR(CheckElemSize(elem_size, kWhat));
  if (n > (uint64_t{1} << 32)) {
    return Status::InvalidArgument(std::string(kWhat) + ": " + std::to_string(n) +
                                   " elements; positions are 32-bit, at most 2^32");
  }
  if (scratch_bytes < CompareCompactScratchBytes(n)) {
    return Status::InvalidArgument(
        std::string(kWhat) + ": scratch of " + std::to_string(scratch_bytes) + " bytes; " +
        std::to_string(n) + " elements need " + std::to_string(CompareCompactScratchBytes(n)));
  }
  FW_RETURN_IF_ERROR(CheckAligned(base, elem_size, kWhat, "base"));
  FW_RETURN_IF_ERROR(CheckAligned(target, elem_size, kWhat, "target"));
  FW_RETURN_IF_ERROR(CheckAligned(out_positions, sizeof(uint32_t), kWhat, "out_positions"));
  FW_RETURN_IF_ERROR(CheckAligned(scratch, kScratchAlignment, kWhat, "scratch"));
  FW_RETURN_IF_ERROR(RequireDevice());
  if (n == 0) return size_t{0};
  Result<uint64_t> changed = DispatchElemSize(elem_size, [&](auto tag) -> Result<uint64_t> {
    using T = decltype(tag);
    return RunCompareCompact<T>(static_cast<const T*>(base), static_cast<const T*>(target), n,
                                out_positions, positions_capacity, static_cast<char*>(scratch));
  });
  if (!changed.ok()) return changed.status().WithContext(kWhat);
  if (*changed > positions_capacity) {
    return Status::ResourceExhausted(
        std::string(kWhat) + ": " + std::to_string(*changed) + " of " + std::to_string(n) +
        " elements changed; out_positions has room for " + std::to_string(positions_capacity));
  }
  return static_cast<size_t>(*changed);
}

Status ScatterApplyOnDevice(void* dst, size_t dst_elements, size_t elem_size,
                            const uint32_t* positions, const void* values, size_t count) {
  constexpr const char* kWhat = "cuda::ScatterApplyOnDevice";
  FW_RETURN_IF_ERROR(CheckElemSize(elem_size, kWhat));
  FW_RETURN_IF_ERROR(CheckAligned(dst, elem_size, kWhat, "dst"));
  FW_RETURN_IF_ERROR(CheckAligned(values, elem_size, kWhat, "values"));
  FW_RETURN_IF_ERROR(CheckAligned(positions, sizeof(uint32_t), kWhat, "positions"));
  FW_RETURN_IF_ERROR(RequireDevice());
  if (count == 0) return Status::Ok();
  std::lock_guard<std::mutex> lock(g_scatter_mutex);
  const Status launched = DispatchElemSize(elem_size, [&](auto tag) -> Status {
    using T = decltype(tag);
    ScatterApplyKernel<T><<<GridFor(count), kThreads>>>(
        static_cast<T*>(dst), dst_elements, positions, static_cast<const T*>(values), count);
    FW_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "ScatterApplyKernel");
    return Status::Ok();
  });
  FW_RETURN_IF_ERROR(launched.WithContext(kWhat));
  // The copy waits for the kernel; a fault in it surfaces here.
  unsigned long long first_bad = kNoBadEntry;
  FW_CUDA_RETURN_IF_ERROR(
      cudaMemcpyFromSymbol(&first_bad, g_first_bad_entry, sizeof(first_bad)),
      std::string(kWhat) + ": ScatterApplyKernel, then cudaMemcpyFromSymbol(first bad entry)");
  if (first_bad == kNoBadEntry) return Status::Ok();
  FW_CUDA_RETURN_IF_ERROR(cudaMemcpyToSymbol(g_first_bad_entry, &kNoBadEntry, sizeof(kNoBadEntry)),
                          std::string(kWhat) + ": cudaMemcpyToSymbol(reset first bad entry)");
  uint32_t position = 0;
  FW_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(&position, positions + first_bad, sizeof(position), cudaMemcpyDeviceToHost),
      std::string(kWhat) + ": cudaMemcpy(bad position)");
  return Status::InvalidArgument(std::string(kWhat) + ": position " + std::to_string(position) +
                                 " (entry " + std::to_string(first_bad) + ") is out of range for " +
                                 std::to_string(dst_elements) + " elements; it was not written");
}

Status ChunkChecksumsOnDevice(const void* data, size_t size, size_t chunk_bytes, uint64_t* out) {
  constexpr const char* kWhat = "cuda::ChunkChecksumsOnDevice";
  if (chunk_bytes == 0) return Status::InvalidArgument(std::string(kWhat) + ": chunk_bytes is 0");
  FW_RETURN_IF_ERROR(CheckAligned(out, sizeof(uint64_t), kWhat, "out"));
  FW_RETURN_IF_ERROR(RequireDevice());
  if (size == 0) return Status::Ok();
  const uint64_t chunks = (size + chunk_bytes - 1) / chunk_bytes;
  // One thread per chunk: with few chunks (a 4 GiB tensor in 4 MiB chunks is 1024), small
  // blocks spread them over every multiprocessor instead of crowding a few.
  const uint64_t per_multiprocessor =
      (chunks + Probe().multiprocessors - 1) / Probe().multiprocessors;
  const uint64_t block = std::min<uint64_t>(kThreads, (per_multiprocessor + 31) / 32 * 32);
  const uint64_t blocks = std::min<uint64_t>((chunks + block - 1) / block, 65535);
  ChunkChecksumsKernel<<<static_cast<unsigned>(blocks), static_cast<unsigned>(block)>>>(
      static_cast<const uint8_t*>(data), size, chunk_bytes, chunks, out);
  return CheckLaunch("ChunkChecksumsKernel").WithContext(kWhat);
}

// ---------------------------------------------------------------------------------------
// Host-memory conveniences, on the entry points above.

Result<size_t> CompareCompact(const void* base, const void* target, size_t n, size_t elem_size,
                              uint32_t* out_positions) {
  constexpr const char* kWhat = "cuda::CompareCompact";
  FW_RETURN_IF_ERROR(CheckElemSize(elem_size, kWhat));
  if (n > (uint64_t{1} << 32)) {
    return Status::InvalidArgument(std::string(kWhat) + ": " + std::to_string(n) +
                                   " elements; positions are 32-bit, at most 2^32");
  }
  FW_RETURN_IF_ERROR(RequireDevice());
  if (n == 0) return size_t{0};
  const size_t bytes = n * elem_size;
  const size_t scratch_bytes = CompareCompactScratchBytes(n);
  const auto run = [&]() -> Result<size_t> {
    FW_ASSIGN_OR_RETURN(DeviceBuffer d_base, DeviceBuffer::Allocate(bytes));
    FW_ASSIGN_OR_RETURN(DeviceBuffer d_target, DeviceBuffer::Allocate(bytes));
    FW_ASSIGN_OR_RETURN(DeviceBuffer d_positions, DeviceBuffer::Allocate(n * sizeof(uint32_t)));
    FW_ASSIGN_OR_RETURN(DeviceBuffer d_scratch, DeviceBuffer::Allocate(scratch_bytes));
    FW_RETURN_IF_ERROR(d_base.CopyFromHost(base, bytes));
    FW_RETURN_IF_ERROR(d_target.CopyFromHost(target, bytes));
    FW_ASSIGN_OR_RETURN(
        const size_t changed,
        CompareCompactOnDevice(d_base.data(), d_target.data(), n, elem_size,
                               d_positions.As<uint32_t>(), n, d_scratch.data(), scratch_bytes));
    FW_RETURN_IF_ERROR(d_positions.CopyToHost(out_positions, changed * sizeof(uint32_t)));
    return changed;
  };
  Result<size_t> changed = run();
  if (!changed.ok()) return changed.status().WithContext(kWhat);
  return *changed;
}

Status ScatterApply(void* dst, size_t dst_elements, size_t elem_size, const uint32_t* positions,
                    const void* values, size_t count) {
  constexpr const char* kWhat = "cuda::ScatterApply";
  FW_RETURN_IF_ERROR(CheckElemSize(elem_size, kWhat));
  for (size_t i = 0; i < count; ++i) {
    if (positions[i] >= dst_elements) {
      return Status::InvalidArgument(std::string(kWhat) + ": position " +
                                     std::to_string(positions[i]) + " (entry " + std::to_string(i) +
                                     ") is out of range for " + std::to_string(dst_elements) +
                                     " elements");
    }
  }
  FW_RETURN_IF_ERROR(RequireDevice());
  if (count == 0) return Status::Ok();
  const size_t dst_bytes = dst_elements * elem_size;
  const auto run = [&]() -> Status {
    FW_ASSIGN_OR_RETURN(DeviceBuffer d_dst, DeviceBuffer::Allocate(dst_bytes));
    FW_ASSIGN_OR_RETURN(DeviceBuffer d_positions, DeviceBuffer::Allocate(count * sizeof(uint32_t)));
    FW_ASSIGN_OR_RETURN(DeviceBuffer d_values, DeviceBuffer::Allocate(count * elem_size));
    FW_RETURN_IF_ERROR(d_dst.CopyFromHost(dst, dst_bytes));
    FW_RETURN_IF_ERROR(d_positions.CopyFromHost(positions, count * sizeof(uint32_t)));
    FW_RETURN_IF_ERROR(d_values.CopyFromHost(values, count * elem_size));
    FW_RETURN_IF_ERROR(ScatterApplyOnDevice(d_dst.data(), dst_elements, elem_size,
                                            d_positions.As<uint32_t>(), d_values.data(), count));
    return d_dst.CopyToHost(dst, dst_bytes);
  };
  return run().WithContext(kWhat);
}

Status ChunkChecksums(const void* data, size_t size, size_t chunk_bytes, uint64_t* out) {
  constexpr const char* kWhat = "cuda::ChunkChecksums";
  if (chunk_bytes == 0) return Status::InvalidArgument(std::string(kWhat) + ": chunk_bytes is 0");
  FW_RETURN_IF_ERROR(RequireDevice());
  if (size == 0) return Status::Ok();
  const uint64_t chunks = (size + chunk_bytes - 1) / chunk_bytes;
  const auto run = [&]() -> Status {
    FW_ASSIGN_OR_RETURN(DeviceBuffer d_data, DeviceBuffer::Allocate(size));
    FW_ASSIGN_OR_RETURN(DeviceBuffer d_out, DeviceBuffer::Allocate(chunks * sizeof(uint64_t)));
    FW_RETURN_IF_ERROR(d_data.CopyFromHost(data, size));
    FW_RETURN_IF_ERROR(
        ChunkChecksumsOnDevice(d_data.data(), size, chunk_bytes, d_out.As<uint64_t>()));
    return d_out.CopyToHost(out, chunks * sizeof(uint64_t));
  };
  return run().WithContext(kWhat);
}

}  // namespace flywheel::kernels::cuda
