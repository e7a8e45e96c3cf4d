// cuda_kernels_bench: the CUDA kernels of kernels/cuda.h on device memory, against the
// HBM floor measured in the same run, on an RL-step-like pair of bf16 checkpoints.
//
//   cuda_kernels_bench [--elements N] [--changed-fraction F] [--runs R] [--warmup W]
//
// Builds a random bf16 base of N elements (default 2^31 + 3*2^20 + 5: 4 GiB and a partial
// tile, past 1024 groups of the compaction's scan) and a target with about F of its
// elements changed in their low mantissa bits, copies both to the device, then times with
// CUDA events (median of R runs after W warm-ups):
//   floor      cudaMemcpy device-to-device of the same N*2 bytes (bytes read + written)
//   scan       CompareCompactOnDevice(base, target): reads base and target, writes positions
//   apply      ScatterApplyOnDevice(base copy, positions, values): reads positions and
//              values, writes the changed elements
//   checksums  ChunkChecksumsOnDevice(target) at 4 MiB (the codec's default) and 64 KiB
//              chunks: reads the data, writes 8 bytes per chunk
// and prints each kernel's GB/s and its ratio to the floor's. Every timed result is checked:
// the scan's positions equal the planted changes, the apply reproduces the target bit for
// bit, sampled checksums equal ChunkChecksumsScalar.
//
// Exit status: 0 all checks passed; 1 a wrong result; 2 bad usage or a CUDA/runtime error;
// 77 no usable CUDA device (nothing measured).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/status.h"
#include "bench/stats.h"
#include "bench/util.h"
#include "checkpoint/parallel.h"
#include "kernels/cuda.h"
#include "kernels/kernels.h"

namespace flywheel::bench {
namespace {

namespace cuda = kernels::cuda;

constexpr int kExitWrongResult = 1;
constexpr int kExitError = 2;
constexpr int kExitNoDevice = 77;

struct Options {
  uint64_t elements = (uint64_t{1} << 31) + (uint64_t{3} << 20) + 5;
  double changed_fraction = 0.015;
  int runs = 20;
  int warmup = 3;
};

bool ParseOptions(int argc, char** argv, Options* options) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return false;
    const char* value = argv[++i];
    char* end = nullptr;
    if (flag == "--elements") {
      options->elements = std::strtoull(value, &end, 10);
    } else if (flag == "--changed-fraction") {
      options->changed_fraction = std::strtod(value, &end);
    } else if (flag == "--runs") {
      options->runs = static_cast<int>(std::strtol(value, &end, 10));
    } else if (flag == "--warmup") {
      options->warmup = static_cast<int>(std::strtol(value, &end, 10));
    } else {
      return false;
    }
    if (end == value || *end != '\0') return false;
  }
  return options->elements > 0 && options->elements <= (uint64_t{1} << 32) &&
         options->changed_fraction > 0 && options->changed_fraction < 1 && options->runs > 0 &&
         options->warmup >= 0;
}

Status CudaStatus(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return Status::Ok();
  return Status::Internal(what + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                          ")");
}

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A random bf16 base, and a target that differs from it in about `fraction` of the
// elements, each in 1 to 7 of its low mantissa bits (an optimizer step's small change).
struct Checkpoints {
  std::vector<uint16_t> base;
  std::vector<uint16_t> target;
  std::vector<uint32_t> planted;  // ascending positions of the changed elements
};

Checkpoints Generate(uint64_t elements, double fraction) {
  constexpr uint64_t kBlock = uint64_t{1} << 22;
  const uint64_t blocks = (elements + kBlock - 1) / kBlock;
  const auto threshold = static_cast<uint64_t>(fraction * 18446744073709551616.0);
  Checkpoints out;
  out.base.resize(elements);
  out.target.resize(elements);
  std::vector<std::vector<uint32_t>> planted(blocks);
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  ParallelFor(blocks, threads, [&](uint64_t block) {
    uint64_t state = 0x5EED0000ull + block;
    const uint64_t begin = block * kBlock;
    const uint64_t end = std::min(elements, begin + kBlock);
    for (uint64_t i = begin; i < end; ++i) {
      const uint64_t draw = SplitMix64(state);
      const auto value = static_cast<uint16_t>(draw >> 48);
      out.base[i] = value;
      out.target[i] = value;
      if (SplitMix64(state) < threshold) {
        out.target[i] = static_cast<uint16_t>(value ^ (1 + draw % 127));
        planted[block].push_back(static_cast<uint32_t>(i));
      }
    }
  });
  for (const auto& block : planted)
    out.planted.insert(out.planted.end(), block.begin(), block.end());
  return out;
}

// Median, lowest and highest of `runs` timings of fn() (a Status-returning call on the
// legacy default stream), in milliseconds, after `warmup` untimed calls.
struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  double max_ms = 0;
};

template <typename Fn>
Result<Timing> Time(int warmup, int runs, const Fn& fn) {
  for (int i = 0; i < warmup; ++i) FW_RETURN_IF_ERROR(fn());
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  FW_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&start), "cudaEventCreate"));
  FW_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&stop), "cudaEventCreate"));
  std::vector<double> times;
  Status status;
  for (int i = 0; i < runs && status.ok(); ++i) {
    status = CudaStatus(cudaEventRecord(start), "cudaEventRecord");
    if (status.ok()) status = fn();
    if (status.ok()) status = CudaStatus(cudaEventRecord(stop), "cudaEventRecord");
    if (status.ok()) status = CudaStatus(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    if (status.ok())
      status = CudaStatus(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  FW_RETURN_IF_ERROR(status);
  const Spread spread = Summarize(std::move(times));
  return Timing{spread.median, spread.min, spread.max};
}

struct Row {
  std::string name;
  uint64_t bytes = 0;  // bytes the operation must move through device memory
  Timing timing;
};

double GBps(const Row& row) {
  return static_cast<double>(row.bytes) / (row.timing.median_ms * 1e-3) / 1e9;
}

// Distinct 32-byte sectors of a bf16 array that hold at least one of `positions`.
uint64_t SectorsTouched(const std::vector<uint32_t>& positions) {
  uint64_t sectors = 0;
  uint64_t last = ~uint64_t{0};
  for (uint32_t position : positions) {
    const uint64_t sector = uint64_t{position} * 2 / 32;
    sectors += sector != last;
    last = sector;
  }
  return sectors;
}

struct Check {
  std::string what;
  bool pass = false;
};

Status ChecksumsMatchScalar(const std::vector<uint16_t>& data, uint64_t chunk_bytes,
                            const cuda::DeviceBuffer& d_sums, bool* pass) {
  const uint64_t size = data.size() * sizeof(uint16_t);
  const uint64_t chunks = (size + chunk_bytes - 1) / chunk_bytes;
  std::vector<uint64_t> got(chunks);
  FW_RETURN_IF_ERROR(d_sums.CopyToHost(got.data(), chunks * sizeof(uint64_t)));
  // The first, the last (shorter) and six more spread over the data.
  std::vector<uint64_t> sample = {0, chunks - 1};
  for (uint64_t k = 1; k <= 6; ++k) sample.push_back(chunks * k / 7);
  const auto* bytes = reinterpret_cast<const unsigned char*>(data.data());
  *pass = true;
  for (uint64_t k : sample) {
    const uint64_t offset = k * chunk_bytes;
    const uint64_t length = std::min(chunk_bytes, size - offset);
    uint64_t want = 0;
    kernels::ChunkChecksumsScalar(bytes + offset, length, length, &want);
    if (got[k] != want) {
      std::printf("  checksum of chunk %llu (%llu bytes at %llu): device %016llx, scalar %016llx\n",
                  static_cast<unsigned long long>(k), static_cast<unsigned long long>(length),
                  static_cast<unsigned long long>(offset), static_cast<unsigned long long>(got[k]),
                  static_cast<unsigned long long>(want));
      *pass = false;
    }
  }
  return Status::Ok();
}

// The benchmark's device memory: base and target, a destination, the scan's output and
// scratch, the planted positions and values, and the checksums.
struct DeviceData {
  uint64_t n = 0, bytes = 0, changed = 0, capacity = 0;
  size_t scratch_bytes = 0;
  cuda::DeviceBuffer base, target, dst, found, scratch, planted, values, sums;
};

Result<DeviceData> Upload(const Checkpoints& data) {
  DeviceData d;
  d.n = data.base.size();
  d.bytes = d.n * sizeof(uint16_t);
  d.changed = data.planted.size();
  d.capacity = std::min<uint64_t>(d.n, 2 * d.changed + 1024);
  d.scratch_bytes = cuda::CompareCompactScratchBytes(d.n);
  FW_ASSIGN_OR_RETURN(d.base, cuda::DeviceBuffer::Allocate(d.bytes));
  FW_ASSIGN_OR_RETURN(d.target, cuda::DeviceBuffer::Allocate(d.bytes));
  FW_ASSIGN_OR_RETURN(d.dst, cuda::DeviceBuffer::Allocate(d.bytes));
  FW_ASSIGN_OR_RETURN(d.found, cuda::DeviceBuffer::Allocate(d.capacity * sizeof(uint32_t)));
  FW_ASSIGN_OR_RETURN(d.scratch, cuda::DeviceBuffer::Allocate(d.scratch_bytes));
  FW_ASSIGN_OR_RETURN(d.planted, cuda::DeviceBuffer::Allocate(d.changed * sizeof(uint32_t)));
  FW_ASSIGN_OR_RETURN(d.values, cuda::DeviceBuffer::Allocate(d.changed * sizeof(uint16_t)));
  const uint64_t max_chunks = (d.bytes + (64 << 10) - 1) / (64 << 10);
  FW_ASSIGN_OR_RETURN(d.sums, cuda::DeviceBuffer::Allocate(max_chunks * sizeof(uint64_t)));
  FW_RETURN_IF_ERROR(d.base.CopyFromHost(data.base.data(), d.bytes));
  FW_RETURN_IF_ERROR(d.target.CopyFromHost(data.target.data(), d.bytes));
  std::vector<uint16_t> values(d.changed);
  kernels::GatherScalar(data.target.data(), sizeof(uint16_t), data.planted.data(), values.data(),
                        d.changed);
  FW_RETURN_IF_ERROR(d.planted.CopyFromHost(data.planted.data(), d.changed * sizeof(uint32_t)));
  FW_RETURN_IF_ERROR(d.values.CopyFromHost(values.data(), d.changed * sizeof(uint16_t)));
  return d;
}

// Scan: compare + compact; it must find exactly the planted changes.
Status MeasureScan(const Options& options, const Checkpoints& data, DeviceData& d,
                   std::vector<Row>* rows, std::vector<Check>* checks) {
  size_t found = 0;
  Row scan{"scan: CompareCompactOnDevice", 2 * d.bytes + d.changed * sizeof(uint32_t), {}};
  FW_ASSIGN_OR_RETURN(scan.timing, Time(options.warmup, options.runs, [&]() -> Status {
                        FW_ASSIGN_OR_RETURN(found, cuda::CompareCompactOnDevice(
                                                       d.base.data(), d.target.data(), d.n, 2,
                                                       d.found.As<uint32_t>(), d.capacity,
                                                       d.scratch.data(), d.scratch_bytes));
                        return Status::Ok();
                      }));
  rows->push_back(scan);
  std::vector<uint32_t> positions(found);
  FW_RETURN_IF_ERROR(d.found.CopyToHost(positions.data(), found * sizeof(uint32_t)));
  checks->push_back({"scan found the " + Grouped(d.changed) + " planted changes, in order (found " +
                         Grouped(found) + ")",
                     positions == data.planted});
  return Status::Ok();
}

// Apply: scatter the changed values into a copy of base; it must reproduce the target.
Status MeasureApply(const Options& options, const Checkpoints& data, DeviceData& d,
                    std::vector<Row>* rows, std::vector<Check>* checks,
                    std::vector<std::string>* notes) {
  FW_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy(d.dst.data(), d.base.data(), d.bytes, cudaMemcpyDeviceToDevice), "reset dst"));
  Row apply{
      "apply: ScatterApplyOnDevice", d.changed * (sizeof(uint32_t) + 2 * sizeof(uint16_t)), {}};
  FW_ASSIGN_OR_RETURN(apply.timing, Time(options.warmup, options.runs, [&]() -> Status {
                        return cuda::ScatterApplyOnDevice(d.dst.data(), d.n, 2,
                                                          d.planted.As<uint32_t>(), d.values.data(),
                                                          d.changed);
                      }));
  rows->push_back(apply);
  std::vector<uint16_t> applied(d.n);
  FW_RETURN_IF_ERROR(d.dst.CopyToHost(applied.data(), d.bytes));
  checks->push_back({"apply reproduced the target bit for bit (" +
                         Fixed(static_cast<double>(d.bytes) / 1e9, 2) + " GB compared on the host)",
                     std::memcmp(applied.data(), data.target.data(), d.bytes) == 0});
  const uint64_t sectors = SectorsTouched(data.planted);
  notes->push_back(
      "apply writes " + Grouped(d.changed * 2) + " bytes of changed elements into " +
      Grouped(sectors) + " distinct 32-byte sectors (" +
      Fixed(static_cast<double>(sectors * 32) / 1e6, 1) +
      " MB): the memory system moves whole sectors, so its GB/s counts " +
      Fixed(static_cast<double>(sectors * 32) / static_cast<double>(d.changed * 2), 1) +
      "x fewer bytes than DRAM writes");
  return Status::Ok();
}

// Checksums at the codec's default chunk (4 MiB) and at 64 KiB, checked against the scalar.
Status MeasureChecksums(const Options& options, const Checkpoints& data, DeviceData& d,
                        std::vector<Row>* rows, std::vector<Check>* checks) {
  for (uint64_t chunk_bytes : {uint64_t{4} << 20, uint64_t{64} << 10}) {
    const uint64_t chunks = (d.bytes + chunk_bytes - 1) / chunk_bytes;
    Row row{"checksums: ChunkChecksumsOnDevice, " + std::to_string(chunk_bytes >> 10) +
                " KiB chunks (" + Grouped(chunks) + ")",
            d.bytes + chunks * sizeof(uint64_t),
            {}};
    FW_ASSIGN_OR_RETURN(row.timing, Time(options.warmup, options.runs, [&]() -> Status {
                          return cuda::ChunkChecksumsOnDevice(d.target.data(), d.bytes, chunk_bytes,
                                                              d.sums.As<uint64_t>());
                        }));
    rows->push_back(row);
    bool pass = false;
    FW_RETURN_IF_ERROR(ChecksumsMatchScalar(data.target, chunk_bytes, d.sums, &pass));
    checks->push_back({"checksums (" + std::to_string(chunk_bytes >> 10) +
                           " KiB chunks) equal ChunkChecksumsScalar on 8 sampled chunks",
                       pass});
  }
  return Status::Ok();
}

// Runs every measurement and check; wrong results land in `checks`, errors in the Status.
Status Run(const Options& options, std::vector<Row>* rows, std::vector<Check>* checks,
           std::vector<std::string>* notes) {
  const uint64_t n = options.elements;
  const uint64_t bytes = n * sizeof(uint16_t);
  std::printf("generating %.2f GiB bf16 base and target (%.2f%% changed) ...\n",
              static_cast<double>(bytes) / (1ull << 30), options.changed_fraction * 100);
  std::fflush(stdout);
  const Checkpoints data = Generate(n, options.changed_fraction);
  const uint64_t changed = data.planted.size();
  notes->push_back(Grouped(n) + " bf16 elements (" + Fixed(static_cast<double>(bytes) / 1e9, 2) +
                   " GB), " + Grouped(changed) + " changed (" +
                   Fixed(100.0 * static_cast<double>(changed) / static_cast<double>(n), 3) + "%)");
  FW_ASSIGN_OR_RETURN(DeviceData d, Upload(data));
  // The floor: a device-to-device copy of the same bytes, counting reads and writes.
  Row floor_row{"floor: cudaMemcpy device to device", 2 * bytes, {}};
  FW_ASSIGN_OR_RETURN(
      floor_row.timing, Time(options.warmup, options.runs, [&]() -> Status {
        return CudaStatus(cudaMemcpy(d.dst.data(), d.base.data(), bytes, cudaMemcpyDeviceToDevice),
                          "cudaMemcpy(device to device)");
      }));
  rows->push_back(floor_row);
  FW_RETURN_IF_ERROR(MeasureScan(options, data, d, rows, checks));
  FW_RETURN_IF_ERROR(MeasureApply(options, data, d, rows, checks, notes));
  return MeasureChecksums(options, data, d, rows, checks);
}

int Main(int argc, char** argv) {
  Options options;
  if (!ParseOptions(argc, argv, &options)) {
    std::fprintf(stderr,
                 "usage: cuda_kernels_bench [--elements N (1..2^32)] [--changed-fraction F (0..1)]"
                 " [--runs R] [--warmup W]\n");
    return kExitError;
  }
  if (!cuda::Available()) {
    std::printf("cuda_kernels_bench: no usable CUDA device (%s); nothing measured\n",
                cuda::DeviceDescription().c_str());
    return kExitNoDevice;
  }
  cudaDeviceProp properties{};
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  if (cudaGetDeviceProperties(&properties, 0) != cudaSuccess ||
      cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    std::fprintf(stderr, "cuda_kernels_bench: cannot read the device's properties\n");
    return kExitError;
  }
  std::printf("device: %s, %d SMs, %.0f MB L2, %.1f GB memory (%.1f GB free)\n",
              cuda::DeviceDescription().c_str(), properties.multiProcessorCount,
              properties.l2CacheSize / 1e6, total_bytes / 1e9, free_bytes / 1e9);
  std::printf(
      "command: cuda_kernels_bench --elements %llu --changed-fraction %g --runs %d "
      "--warmup %d\n",
      static_cast<unsigned long long>(options.elements), options.changed_fraction, options.runs,
      options.warmup);

  std::vector<Row> rows;
  std::vector<Check> checks;
  std::vector<std::string> notes;
  const Status status = Run(options, &rows, &checks, &notes);

  if (!rows.empty()) {
    const double floor = GBps(rows.front());
    Table table;
    table.header = {"operation", "bytes moved", "median ms", "min-max ms", "GB/s", "x floor"};
    for (const Row& row : rows) {
      table.rows.push_back({row.name, Grouped(row.bytes), Fixed(row.timing.median_ms, 3),
                            Fixed(row.timing.min_ms, 3) + "-" + Fixed(row.timing.max_ms, 3),
                            Fixed(GBps(row), 0), Fixed(GBps(row) / floor, 3)});
    }
    std::printf("\n%s\n", RenderText(table).c_str());
    for (const std::string& note : notes) std::printf("  %s\n", note.c_str());
    std::printf("\nMarkdown:\n\n%s", RenderMarkdown(table).c_str());
  }
  int failures = 0;
  std::printf("\nChecks:\n");
  for (const Check& check : checks) {
    std::printf("  %s  %s\n", PassFail(check.pass).c_str(), check.what.c_str());
    failures += !check.pass;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "cuda_kernels_bench: %s\n", status.ToString().c_str());
    return kExitError;
  }
  if (failures > 0) {
    std::printf("%d wrong result(s)\n", failures);
    return kExitWrongResult;
  }
  return 0;
}

}  // namespace
}  // namespace flywheel::bench

int main(int argc, char** argv) {
  return flywheel::bench::Main(argc, argv);
}
