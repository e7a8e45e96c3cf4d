// Google Benchmark of the codec's hot loops, scalar reference vs the vectorised (AVX2)
// version, on the realistic input: ~2% of 2- or 4-byte words changed, spread uniformly.
// Throughput is tensor bytes per second (n * elem_size; compare reads two such arrays).
// After the runs a table gives vectorised/scalar and each kernel against the memory
// read floor measured in the same run (compare: two streams; checksums: one stream;
// unshuffle: a memcpy of the same bytes).
// Every benchmark checks its results against ground truth and counts wrong ones.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/kernels.h"

namespace flywheel::kernels {
namespace {

constexpr double kChangedFraction = 0.02;
constexpr size_t kChecksumChunkBytes = 64 << 10;

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// base/target of `bytes` bytes differing in ~2% of their elements (a flipped low bit,
// like a small weight update), the changed positions, and the new values at them.
struct Dataset {
  size_t elem_size = 0;
  size_t n = 0;
  std::vector<unsigned char> base, target, values;
  std::vector<uint32_t> changed;
};

const Dataset& GetDataset(size_t elem_size, size_t bytes) {
  // One dataset at a time: benchmarks are registered grouped by dataset.
  static std::unique_ptr<Dataset> cached;
  if (cached && cached->elem_size == elem_size && cached->base.size() == bytes) return *cached;
  cached.reset();
  auto d = std::make_unique<Dataset>();
  d->elem_size = elem_size;
  d->n = bytes / elem_size;
  d->base.resize(bytes);
  uint64_t state = elem_size * 1000003 + bytes;
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t word = SplitMix64(state);
    std::memcpy(&d->base[i], &word, 8);
  }
  d->target = d->base;
  const auto threshold = static_cast<uint64_t>(kChangedFraction * 18446744073709551616.0);
  for (size_t i = 0; i < d->n; ++i) {
    if (SplitMix64(state) >= threshold) continue;
    d->target[i * elem_size] ^= 1;
    d->changed.push_back(static_cast<uint32_t>(i));
  }
  d->values.resize(d->changed.size() * elem_size);
  GatherScalar(d->target.data(), elem_size, d->changed.data(), d->values.data(), d->changed.size());
  cached = std::move(d);
  return *cached;
}

using CompareFn = size_t (*)(const void*, const void*, size_t, size_t, uint32_t*);
using ScatterFn = void (*)(void*, size_t, const uint32_t*, const void*, size_t);
using ChecksumFn = size_t (*)(const void*, size_t, size_t, uint64_t*);

void BM_ReadFloor(benchmark::State& state, size_t bytes, int streams) {
  const Dataset& d = GetDataset(2, bytes);
  const auto* a = reinterpret_cast<const uint64_t*>(d.base.data());
  const auto* b = reinterpret_cast<const uint64_t*>(d.target.data());
  const size_t words = bytes / 8;
  for (auto _ : state) {
    uint64_t x0 = 0, x1 = 0, x2 = 0, x3 = 0;
    for (size_t i = 0; i + 4 <= words; i += 4) {
      x0 ^= a[i];
      x1 ^= a[i + 1];
      x2 ^= a[i + 2];
      x3 ^= a[i + 3];
    }
    if (streams == 2) {
      for (size_t i = 0; i + 4 <= words; i += 4) {
        x0 ^= b[i];
        x1 ^= b[i + 1];
        x2 ^= b[i + 2];
        x3 ^= b[i + 3];
      }
    }
    benchmark::DoNotOptimize(x0 ^ x1 ^ x2 ^ x3);
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(bytes));
}

void BM_CompareCompact(benchmark::State& state, CompareFn fn, size_t elem_size, size_t bytes) {
  const Dataset& d = GetDataset(elem_size, bytes);
  std::vector<uint32_t> out(d.n);
  int64_t wrong = 0;
  for (auto _ : state) {
    const size_t count = fn(d.base.data(), d.target.data(), d.n, elem_size, out.data());
    wrong += count != d.changed.size();
    benchmark::DoNotOptimize(out.data());
  }
  if (std::memcmp(out.data(), d.changed.data(), d.changed.size() * 4) != 0) ++wrong;
  state.counters["wrong"] = double(wrong);
  state.counters["changed_fraction"] = double(d.changed.size()) / double(d.n);
  if (wrong != 0) state.SkipWithError("positions differ from ground truth");
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(bytes));
}

void BM_ScatterApply(benchmark::State& state, ScatterFn fn, size_t elem_size, size_t bytes) {
  const Dataset& d = GetDataset(elem_size, bytes);
  std::vector<unsigned char> dst = d.base;
  for (auto _ : state) {
    // Idempotent: every iteration writes the same values to the same positions.
    fn(dst.data(), elem_size, d.changed.data(), d.values.data(), d.changed.size());
    benchmark::ClobberMemory();
  }
  const bool wrong = dst != d.target;
  state.counters["wrong"] = wrong;
  if (wrong) state.SkipWithError("result differs from target");
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(bytes));
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(d.changed.size()));
}

void BM_ChunkChecksums(benchmark::State& state, ChecksumFn fn, size_t bytes) {
  const Dataset& d = GetDataset(2, bytes);
  const size_t chunks = (bytes + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
  std::vector<uint64_t> out(chunks), want(chunks);
  ChunkChecksumsScalar(d.base.data(), bytes, kChecksumChunkBytes, want.data());
  for (auto _ : state) {
    fn(d.base.data(), bytes, kChecksumChunkBytes, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  const bool wrong = out != want;
  state.counters["wrong"] = wrong;
  if (wrong) state.SkipWithError("checksums differ from the scalar reference");
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(bytes));
}

// The keyframe decoder's byte-plane unshuffle: planes made from the dataset's words by
// the shuffle, unshuffled back; the result must be the words bit for bit.
using UnshuffleFn = void (*)(const void*, size_t, size_t, void*);
void BM_Unshuffle(benchmark::State& state, UnshuffleFn fn, size_t elem_size, size_t bytes) {
  const Dataset& d = GetDataset(elem_size, bytes);
  std::vector<unsigned char> planes(bytes), out(bytes);
  for (size_t b = 0; b < elem_size; ++b) {
    for (size_t i = 0; i < d.n; ++i) planes[b * d.n + i] = d.base[i * elem_size + b];
  }
  for (auto _ : state) {
    fn(planes.data(), d.n, elem_size, out.data());
    benchmark::ClobberMemory();
  }
  const bool wrong = out != d.base;
  state.counters["wrong"] = wrong;
  if (wrong) state.SkipWithError("unshuffled bytes differ from the words");
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(bytes));
}

// The unshuffle's floor: a memcpy of the same bytes (one read stream, one write stream).
void BM_MemcpyFloor(benchmark::State& state, size_t bytes) {
  const Dataset& d = GetDataset(2, bytes);
  std::vector<unsigned char> out(bytes);
  for (auto _ : state) {
    std::memcpy(out.data(), d.base.data(), bytes);
    benchmark::ClobberMemory();
  }
  if (out != d.base) state.SkipWithError("memcpy differs");
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(bytes));
}

std::string SizeName(size_t bytes) {
  return bytes >= (1 << 20) ? std::to_string(bytes >> 20) + "MiB"
                            : std::to_string(bytes >> 10) + "KiB";
}

void RegisterAll() {
  const char* vectorised = HaveAvx2() ? "avx2" : "dispatch-noavx2";
  // An L2-resident size (compute-bound) and a DRAM-resident one (bandwidth-bound).
  for (size_t bytes : {size_t{256} << 10, size_t{64} << 20}) {
    const std::string size = SizeName(bytes);
    // The floor bounds only the DRAM-resident size; in cache this loop is compute-bound.
    if (bytes >= (size_t{64} << 20)) {
      benchmark::RegisterBenchmark(("ReadFloor/2streams/" + size).c_str(), BM_ReadFloor, bytes, 2);
      benchmark::RegisterBenchmark(("ReadFloor/1stream/" + size).c_str(), BM_ReadFloor, bytes, 1);
    }
    for (size_t elem : {size_t{2}, size_t{4}}) {
      const std::string prefix = "/elem" + std::to_string(elem) + "/" + size + "/";
      benchmark::RegisterBenchmark(("CompareCompact" + prefix + "scalar").c_str(),
                                   BM_CompareCompact, &CompareCompactScalar, elem, bytes);
      benchmark::RegisterBenchmark(("CompareCompact" + prefix + vectorised).c_str(),
                                   BM_CompareCompact, &CompareCompact, elem, bytes);
      benchmark::RegisterBenchmark(("ScatterApply" + prefix + "scalar").c_str(), BM_ScatterApply,
                                   &ScatterApplyScalar, elem, bytes);
      benchmark::RegisterBenchmark(("ScatterApply" + prefix + vectorised).c_str(), BM_ScatterApply,
                                   &ScatterApply, elem, bytes);
    }
    benchmark::RegisterBenchmark(("MemcpyFloor/" + size).c_str(), BM_MemcpyFloor, bytes);
    for (size_t elem : {size_t{2}, size_t{4}, size_t{8}}) {
      const std::string name = "Unshuffle/elem" + std::to_string(elem) + "/" + size + "/";
      benchmark::RegisterBenchmark((name + "scalar").c_str(), BM_Unshuffle, &UnshuffleScalar, elem,
                                   bytes);
      benchmark::RegisterBenchmark((name + vectorised).c_str(), BM_Unshuffle, &Unshuffle, elem,
                                   bytes);
    }
    const std::string prefix = "/chunk64KiB/" + size + "/";
    benchmark::RegisterBenchmark(("ChunkChecksums" + prefix + "scalar").c_str(), BM_ChunkChecksums,
                                 &ChunkChecksumsScalar, bytes);
    benchmark::RegisterBenchmark(("ChunkChecksums" + prefix + vectorised).c_str(),
                                 BM_ChunkChecksums, &ChunkChecksums, bytes);
  }
}

// Prints the console output as usual, then the ratios: vectorised/scalar for each
// kernel, and each kernel's throughput as a fraction of the memory read floor.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred || run.run_type != Run::RT_Iteration) continue;
      const auto it = run.counters.find("bytes_per_second");
      if (it != run.counters.end()) rates_[run.benchmark_name()] = it->second.value;
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\n%-36s %10s %10s %9s %16s\n", "kernel (tensor bytes)", "scalar", "vector",
                "vec/scal", "vec/read floor");
    for (const auto& [name, scalar_rate] : rates_) {
      const std::string suffix = "/scalar";
      if (name.size() < suffix.size() ||
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      const std::string stem = name.substr(0, name.size() - suffix.size());
      const double vector_rate = RateWithPrefix(stem + "/", "/scalar");
      const std::string size = stem.substr(stem.rfind('/') + 1);
      double floor_rate = 0;
      if (stem.rfind("CompareCompact", 0) == 0) floor_rate = Rate("ReadFloor/2streams/" + size);
      if (stem.rfind("ChunkChecksums", 0) == 0) floor_rate = Rate("ReadFloor/1stream/" + size);
      if (stem.rfind("Unshuffle", 0) == 0) floor_rate = Rate("MemcpyFloor/" + size);
      char floor_text[32] = "-";
      if (floor_rate > 0 && vector_rate > 0) {
        std::snprintf(floor_text, sizeof(floor_text), "%.2f", vector_rate / floor_rate);
      }
      std::printf("%-36s %7.2f GB/s %6.2f GB/s %8.2fx %16s\n", stem.c_str(), scalar_rate / 1e9,
                  vector_rate / 1e9, scalar_rate > 0 ? vector_rate / scalar_rate : 0.0, floor_text);
    }
    std::printf("read floor (tensor bytes/s): ");
    for (const auto& [name, rate] : rates_) {
      if (name.rfind("ReadFloor/", 0) == 0)
        std::printf("%s %.2f GB/s  ", name.c_str() + 10, rate / 1e9);
      if (name.rfind("MemcpyFloor/", 0) == 0)
        std::printf("memcpy/%s %.2f GB/s  ", name.c_str() + 12, rate / 1e9);
    }
    std::printf("\n");
  }

 private:
  double Rate(const std::string& name) const {
    const auto it = rates_.find(name);
    return it == rates_.end() ? 0.0 : it->second;
  }
  // The rate of the benchmark named `prefix` + anything but `excluded_suffix`.
  double RateWithPrefix(const std::string& prefix, const std::string& excluded_suffix) const {
    for (const auto& [name, rate] : rates_) {
      if (name.rfind(prefix, 0) == 0 && "/" + name.substr(prefix.size()) != excluded_suffix) {
        return rate;
      }
    }
    return 0.0;
  }

  std::map<std::string, double> rates_;
};

}  // namespace
}  // namespace flywheel::kernels

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  flywheel::kernels::RegisterAll();
  flywheel::kernels::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
