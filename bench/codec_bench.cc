#include "bench/codec_bench.h"

#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>

#include "bench/checkpoint_gen.h"
#include "bench/peers.h"
#include "bench/util.h"
#include "delta/delta.h"
#include "checkpoint/hash.h"
#include "ops/process.h"

namespace flywheel::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kNotMeasured = std::numeric_limits<double>::quiet_NaN();
// A peer tool that runs longer is stuck (the largest runs take a few minutes).
constexpr std::chrono::minutes kToolTimeout{30};

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// CPU time of all threads of this process so far.
double ProcessCpuSeconds() {
  timespec now{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + now.tv_nsec * 1e-9;
}

// Throughput with about three significant digits (peers can be far below 0.1 GB/s).
std::string Rate(double gbps) {
  if (!std::isfinite(gbps)) return "-";
  return Fixed(gbps, gbps >= 10 ? 1 : gbps >= 0.1 ? 2 : 3);
}


// 1e-06 -> "1e-6", 0.0003 -> "0.0003".
std::string LearningRateText(double learning_rate) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", learning_rate);
  std::string out = text;
  for (const char* padded : {"e-0", "e+0"}) {
    if (const size_t at = out.find(padded); at != std::string::npos) out.erase(at + 2, 1);
  }
  return out;
}

// ---- results -----------------------------------------------------------------------

enum class RoundTrip { kNotApplicable, kOk, kFail };

// One table row. Throughputs are GB/s of checkpoint, one entry per options.threads entry;
// NaN where not measured (peers run single-threaded; the floor and the full size are not
// codecs).
struct Row {
  std::string label;
  double bytes = 0;  // fractional for the entropy floor
  std::vector<double> encode_gbps;
  std::vector<double> apply_gbps;
  std::vector<double> apply_cached_gbps;
  // GB per CPU-second (all threads' CPU time), flywheel rows only: on a shared machine the
  // wall-clock columns also count time the benchmark spent waiting for a CPU.
  std::vector<double> encode_cpu_gbps;
  std::vector<double> apply_cpu_gbps;
  std::vector<double> apply_cached_cpu_gbps;
  RoundTrip round_trip = RoundTrip::kNotApplicable;
};

struct Group {
  double learning_rate = 0;
  size_t tensor_count = 0;
  uint64_t checkpoint_bytes = 0;
  uint64_t total_words = 0;
  uint64_t changed_words = 0;
  double position_bits = 0;  // per changed element
  double value_bits = 0;     // per changed element
  // The conditional entropy of the codec's context model (the base word's exponent
  // bucket, delta/format.h kind 3), per changed element: the bound for that model.
  double context_position_bits = 0;
  double context_value_bits = 0;
  std::vector<Row> rows;
  std::vector<std::string> skipped;  // peers that could not run, with the reason

  double density() const {
    return total_words == 0 ? 0 : static_cast<double>(changed_words) / total_words;
  }
  double floor_bits() const { return position_bits + value_bits; }
  double context_bits() const { return context_position_bits + context_value_bits; }
  double BitsPerChanged(const Row& row) const {
    return changed_words == 0 ? kNotMeasured : 8.0 * row.bytes / changed_words;
  }
  const Row* Find(const std::string& label) const {
    for (const Row& row : rows) {
      if (row.label == label) return &row;
    }
    return nullptr;
  }
};

constexpr const char* kFullRow = "full checkpoint";
constexpr const char* kZstdRow = "zstd -3";
constexpr const char* kPatchFromRow = "zstd --patch-from";
constexpr const char* kXdeltaRow = "xdelta3";
constexpr const char* kFlywheelZstdRow = "flywheel zstd";
constexpr const char* kFlywheelLz4Row = "flywheel lz4";
// zstd with the context-coded sparse chunks (delta::EncodeOptions::context_coding, off by
// default): the bits-below-the-floor row.
constexpr const char* kFlywheelContextRow = "flywheel context";
constexpr const char* kFloorRow = "entropy floor";

Row EmptyRow(const std::string& label, size_t thread_columns) {
  Row row;
  row.label = label;
  row.encode_gbps.assign(thread_columns, kNotMeasured);
  row.apply_gbps.assign(thread_columns, kNotMeasured);
  row.apply_cached_gbps.assign(thread_columns, kNotMeasured);
  row.encode_cpu_gbps.assign(thread_columns, kNotMeasured);
  row.apply_cpu_gbps.assign(thread_columns, kNotMeasured);
  row.apply_cached_cpu_gbps.assign(thread_columns, kNotMeasured);
  return row;
}

// ---- entropy floor -----------------------------------------------------------------

double BinaryEntropyBits(uint64_t changed, uint64_t words) {
  if (changed == 0 || changed == words) return 0;
  const double p = static_cast<double>(changed) / words;
  return -static_cast<double>(words) * (p * std::log2(p) + (1 - p) * std::log2(1 - p));
}

// The conditional entropy of positions and values given the context the codec uses: the
// bucket clamp(e - offset, 0, 15) of the base word's bf16 exponent e, with the offset
// putting the largest changed exponent in bucket 14 (one offset for the whole pair here;
// the codec picks one per chunk, which can only do better).
void ComputeContextEntropy(const CheckpointPair& pair, Group& group) {
  constexpr int kBuckets = 16;
  int largest = 0;
  for (size_t i = 0; i < pair.base.size(); ++i) {
    if (pair.base[i] != pair.target[i]) largest = std::max(largest, (pair.base[i] >> 7) & 0xff);
  }
  const int offset = std::max(0, largest - (kBuckets - 2));
  std::vector<uint64_t> words(kBuckets, 0), changed(kBuckets, 0);
  std::vector<std::vector<uint64_t>> values(kBuckets, std::vector<uint64_t>(1 << 16, 0));
  for (size_t i = 0; i < pair.base.size(); ++i) {
    const int bucket = std::clamp(((pair.base[i] >> 7) & 0xff) - offset, 0, kBuckets - 1);
    ++words[bucket];
    if (pair.base[i] == pair.target[i]) continue;
    ++changed[bucket];
    ++values[bucket][static_cast<uint16_t>(pair.target[i] - pair.base[i])];
  }
  double position = 0, value = 0;
  for (int b = 0; b < kBuckets; ++b) {
    position += BinaryEntropyBits(changed[b], words[b]);
    for (uint64_t count : values[b]) {
      if (count == 0) continue;
      value -= count * std::log2(static_cast<double>(count) / changed[b]);
    }
  }
  group.context_position_bits = position / group.changed_words;
  group.context_value_bits = value / group.changed_words;
}

// Counts changed words and computes the floor from the pair itself: n·H2(p) bits for the
// positions, the empirical entropy of the int16 bit-pattern differences for the values.
void ComputeFloor(const CheckpointPair& pair, Group& group) {
  std::vector<uint64_t> histogram(1 << 16, 0);
  uint64_t changed = 0;
  for (size_t i = 0; i < pair.base.size(); ++i) {
    if (pair.base[i] == pair.target[i]) continue;
    ++changed;
    ++histogram[static_cast<uint16_t>(pair.target[i] - pair.base[i])];
  }
  group.total_words = pair.base.size();
  group.changed_words = changed;
  group.position_bits = 0;
  group.value_bits = 0;
  if (changed == 0) return;
  const double p = group.density();
  const double h2 = p >= 1 ? 0 : -(p * std::log2(p) + (1 - p) * std::log2(1 - p));
  group.position_bits = h2 / p;
  double value_entropy = 0;
  for (uint64_t count : histogram) {
    if (count == 0) continue;
    const double q = static_cast<double>(count) / changed;
    value_entropy -= q * std::log2(q);
  }
  group.value_bits = value_entropy;
  ComputeContextEntropy(pair, group);
}

// ---- flywheel codec ----------------------------------------------------------------

// Compares every tensor of `state` with the target; names the first one that differs.
Status CompareWithTarget(const CheckpointPair& pair, const std::vector<uint16_t>& state,
                         const std::string& what) {
  for (const TensorLayout& tensor : pair.tensors) {
    const uint16_t* got = state.data() + tensor.word_offset;
    const uint16_t* want = pair.target.data() + tensor.word_offset;
    if (std::memcmp(got, want, tensor.words * sizeof(uint16_t)) == 0) continue;
    uint64_t word = 0;
    while (got[word] == want[word]) ++word;
    std::ostringstream message;
    message << what << ": tensor '" << tensor.name << "' differs from the target at word " << word
            << " (got 0x" << std::hex << got[word] << ", want 0x" << want[word] << ")";
    return Status::Internal(message.str());
  }
  return Status::Ok();
}

std::string ThreadsText(int threads) {
  return std::to_string(threads) + (threads == 1 ? " thread" : " threads");
}

// Encodes with every thread count, parses, applies (with and without cached base hashes)
// and checks every apply bit for bit. Fills `row`; returns the first failure.
Status MeasureFlywheel(const CheckpointPair& pair, delta::Compressor compressor, bool context,
                       const CodecBenchOptions& options, const Group& group,
                       const std::vector<Hash128>& base_hashes, Row& row) {
  const std::string name = row.label;
  const CheckpointView base = pair.BaseView();
  const CheckpointView target = pair.TargetView();
  const double gigabytes = pair.bytes() / 1e9;

  std::vector<std::byte> container;
  for (size_t column = 0; column < options.threads.size(); ++column) {
    delta::EncodeOptions encode_options;
    encode_options.base_version = 1;
    encode_options.target_version = 2;
    encode_options.compressor = compressor;
    encode_options.context_coding = context;
    encode_options.threads = options.threads[column];
    double best = std::numeric_limits<double>::infinity();
    double best_cpu = std::numeric_limits<double>::infinity();
    for (int rep = 0; rep < options.repetitions; ++rep) {
      const double cpu_start = ProcessCpuSeconds();
      const Clock::time_point start = Clock::now();
      Result<std::vector<std::byte>> encoded = delta::Encode(base, target, encode_options);
      const double seconds = SecondsSince(start);
      best_cpu = std::min(best_cpu, ProcessCpuSeconds() - cpu_start);
      if (!encoded.ok()) {
        return encoded.status().WithContext(name + " encode with " +
                                            ThreadsText(options.threads[column]));
      }
      best = std::min(best, seconds);
      if (container.empty()) {
        container = std::move(encoded).value();
      } else if (encoded->size() != container.size()) {
        std::cerr << "[codec bench] note: " << name << " with "
                  << ThreadsText(options.threads[column]) << " made " << encoded->size()
                  << " bytes, with " << ThreadsText(options.threads[0]) << " " << container.size()
                  << "\n";
      }
    }
    row.encode_gbps[column] = gigabytes / best;
    row.encode_cpu_gbps[column] = gigabytes / best_cpu;
  }
  row.bytes = static_cast<double>(container.size());

  Result<delta::DeltaView> view = delta::DeltaView::Parse(container);
  if (!view.ok()) return view.status().WithContext(name + ": parsing its own output");
  const uint64_t manifest_changed = view->manifest().changed_words();
  if (manifest_changed != group.changed_words) {
    return Status::Internal(name + ": the manifest counts " + std::to_string(manifest_changed) +
                            " changed words, the pair has " + std::to_string(group.changed_words));
  }

  std::vector<uint16_t> state(pair.base.size());
  MutableCheckpointView state_view = pair.MutableViewOf(state);
  for (bool cached : {false, true}) {
    for (size_t column = 0; column < options.threads.size(); ++column) {
      delta::ApplyOptions apply_options;
      apply_options.threads = options.threads[column];
      if (cached) apply_options.state_tensor_hashes = base_hashes;
      const std::string what = name + " apply" + (cached ? " with cached base hashes" : "") +
                               " with " + ThreadsText(options.threads[column]);
      double best = std::numeric_limits<double>::infinity();
      double best_cpu = std::numeric_limits<double>::infinity();
      for (int rep = 0; rep < options.repetitions; ++rep) {
        std::copy(pair.base.begin(), pair.base.end(), state.begin());
        const double cpu_start = ProcessCpuSeconds();
        const Clock::time_point start = Clock::now();
        Result<delta::ApplyStats> stats = delta::ApplyInPlace(state_view, *view, apply_options);
        const double seconds = SecondsSince(start);
        best_cpu = std::min(best_cpu, ProcessCpuSeconds() - cpu_start);
        if (!stats.ok()) return stats.status().WithContext(what);
        FW_RETURN_IF_ERROR(CompareWithTarget(pair, state, what));
        best = std::min(best, seconds);
      }
      (cached ? row.apply_cached_gbps : row.apply_gbps)[column] = gigabytes / best;
      (cached ? row.apply_cached_cpu_gbps : row.apply_cpu_gbps)[column] = gigabytes / best_cpu;
    }
  }
  return Status::Ok();
}

// ---- peer tools --------------------------------------------------------------------

// Runs `program args...` to completion (ops::RunToCompletion: stdin /dev/null, stdout
// to `stdout_path` or captured) and returns its wall time from start to exit. A non-zero
// exit is an error carrying the start of the tool's stderr.
Result<double> RunTool(const std::string& program, const std::vector<std::string>& args,
                       const std::string& stdout_path) {
  ops::RunOptions options;
  options.stdout_path = stdout_path;
  options.timeout = kToolTimeout;
  FW_ASSIGN_OR_RETURN(const ops::Completion done,
                      ops::RunToCompletion(program, args, options));
  if (done.exit_code == 0) return done.elapsed.count();
  std::string command = program;
  for (const std::string& arg : args) command += " " + arg;
  std::string err = done.err.substr(0, 400);
  while (!err.empty() && (err.back() == '\n' || err.back() == ' ')) err.pop_back();
  const std::string how = done.exit_code > 128
                              ? "was killed by signal " + std::to_string(done.exit_code - 128)
                              : "exited with status " + std::to_string(done.exit_code);
  return Status::IOError("'" + command + "' " + how + ": " + err);
}

Status WriteFile(const std::string& path, std::span<const std::byte> bytes) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr)
    return Status::IOError("cannot create " + path + ": " + std::strerror(errno));
  const size_t written = std::fwrite(bytes.data(), 1, bytes.size(), file);
  const bool closed = std::fclose(file) == 0;
  if (written != bytes.size() || !closed) {
    return Status::IOError("cannot write " + std::to_string(bytes.size()) + " bytes to " + path);
  }
  return Status::Ok();
}

// Byte-for-byte comparison of a decoded file with the expected bytes.
Status CompareFile(const std::string& path, std::span<const std::byte> expected,
                   const std::string& what) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return Status::IOError(what + ": cannot open " + path);
  std::vector<std::byte> buffer(1 << 20);
  uint64_t offset = 0;
  Status status;
  while (status.ok()) {
    const size_t got = std::fread(buffer.data(), 1, buffer.size(), file);
    if (got == 0) break;
    if (offset + got > expected.size()) {
      status = Status::Internal(what + ": decoded output is longer than the target (" +
                                std::to_string(expected.size()) + " bytes)");
    } else if (std::memcmp(buffer.data(), expected.data() + offset, got) != 0) {
      uint64_t at = 0;
      while (buffer[at] == expected[offset + at]) ++at;
      status = Status::Internal(what + ": decoded output differs from the target at byte " +
                                std::to_string(offset + at));
    }
    offset += got;
  }
  std::fclose(file);
  if (status.ok() && offset != expected.size()) {
    status = Status::Internal(what + ": decoded " + std::to_string(offset) +
                              " bytes, the target has " + std::to_string(expected.size()));
  }
  return status;
}

uint64_t FileSize(const std::string& path) {
  std::error_code error;
  const uint64_t size = std::filesystem::file_size(path, error);
  return error ? 0 : size;
}

// zstd needs a window covering the whole base for --patch-from, and the decoder must be
// told to accept windows above its default 128 MiB (2^27) limit.
int PatchFromWindowLog(uint64_t bytes) {
  int log = 27;
  while (log < 31 && (1ull << (log - 1)) < bytes) ++log;
  return log;
}

// One peer tool's encode and decode command lines. Each writes `encoded` / `decoded`,
// either as its output file argument or through stdout (`*_to_stdout`).
struct PeerSpec {
  std::string label;
  std::string tool;  // executable, and the Debian package that ships it
  std::vector<std::string> encode_args;
  bool encode_to_stdout = true;
  std::string encoded;
  std::vector<std::string> decode_args;
  bool decode_to_stdout = true;
  std::string decoded;
};

// Runs one peer: encode, decode, compare with the target. Fills `row`.
Status MeasurePeer(const PeerSpec& peer, const std::string& program,
                   std::span<const std::byte> target_bytes, Row& row) {
  Result<double> encode_seconds =
      RunTool(program, peer.encode_args, peer.encode_to_stdout ? peer.encoded : "");
  if (!encode_seconds.ok()) return encode_seconds.status().WithContext(peer.label + " encode");
  row.bytes = static_cast<double>(FileSize(peer.encoded));
  Result<double> decode_seconds =
      RunTool(program, peer.decode_args, peer.decode_to_stdout ? peer.decoded : "");
  if (!decode_seconds.ok()) return decode_seconds.status().WithContext(peer.label + " decode");
  const Status same = CompareFile(peer.decoded, target_bytes, peer.label + " round trip");
  std::error_code ignored;
  std::filesystem::remove(peer.decoded, ignored);
  std::filesystem::remove(peer.encoded, ignored);
  FW_RETURN_IF_ERROR(same);
  const double gigabytes = target_bytes.size() / 1e9;
  row.encode_gbps[0] = gigabytes / *encode_seconds;
  row.apply_gbps[0] = gigabytes / *decode_seconds;
  return Status::Ok();
}

// Runs the available peers on files in `work_dir`; appends their rows (in a fixed order)
// and records failures. Missing tools are reported and skipped.
void MeasurePeers(const CheckpointPair& pair, const std::string& work_dir, size_t thread_columns,
                  Group& group, std::vector<Status>& failures) {
  const std::string base_path = work_dir + "/base.bf16";
  const std::string target_path = work_dir + "/target.bf16";
  const auto base_bytes = std::as_bytes(std::span(pair.base));
  const auto target_bytes = std::as_bytes(std::span(pair.target));
  if (Status status = WriteFile(base_path, base_bytes); !status.ok()) {
    failures.push_back(status.WithContext("writing the peers' input"));
    return;
  }
  if (Status status = WriteFile(target_path, target_bytes); !status.ok()) {
    failures.push_back(status.WithContext("writing the peers' input"));
    return;
  }
  const std::string window = "--long=" + std::to_string(PatchFromWindowLog(pair.bytes()));
  const std::string zstd_out = work_dir + "/target.bf16.zst";
  const std::string patch_out = work_dir + "/target.bf16.patch.zst";
  const std::string vcdiff_out = work_dir + "/target.bf16.vcdiff";
  const std::string patch_from = "--patch-from=" + base_path;
  const std::vector<PeerSpec> peers = {
      {.label = kZstdRow,
       .tool = "zstd",
       .encode_args = {"-3", "-q", "-c", target_path},
       .encoded = zstd_out,
       .decode_args = {"-d", "-q", "-c", zstd_out},
       .decoded = zstd_out + ".out"},
      {.label = kPatchFromRow,
       .tool = "zstd",
       .encode_args = {"-q", "-c", window, patch_from, target_path},
       .encoded = patch_out,
       .decode_args = {"-d", "-q", "-c", window, patch_from, patch_out},
       .decoded = patch_out + ".out"},
      {.label = kXdeltaRow,
       .tool = "xdelta3",
       .encode_args = {"-e", "-f", "-s", base_path, target_path, vcdiff_out},
       .encode_to_stdout = false,
       .encoded = vcdiff_out,
       .decode_args = {"-d", "-f", "-s", base_path, vcdiff_out, vcdiff_out + ".out"},
       .decode_to_stdout = false,
       .decoded = vcdiff_out + ".out"},
  };
  for (const PeerSpec& peer : peers) {
    if (peer.label == kPatchFromRow && pair.bytes() > (1ull << 30)) {
      const std::string line = peer.label + ": zstd's largest window (2^31) cannot cover a " +
                               Fixed(pair.bytes() / 1e9, 1) + " GB base and target";
      std::cerr << "[codec bench] " << line << "\n";
      group.skipped.push_back(line);
      continue;
    }
    const std::optional<std::string> program = FindExecutable(peer.tool);
    if (!program) {
      const std::string line = peer.label + ": '" + peer.tool +
                               "' is not installed; install the Debian package '" + peer.tool +
                               "' (apt-get install " + peer.tool + ") to get this row";
      std::cerr << "[codec bench] " << line << "\n";
      group.skipped.push_back(line);
      continue;
    }
    std::cerr << "[codec bench]   " << peer.label << " ..." << std::flush;
    Row row = EmptyRow(peer.label, thread_columns);
    const Clock::time_point start = Clock::now();
    Status status = MeasurePeer(peer, *program, target_bytes, row);
    std::cerr << " " << Fixed(SecondsSince(start), 1) << " s\n";
    if (!status.ok()) {
      row.round_trip = RoundTrip::kFail;
      failures.push_back(status);
      std::cerr << "[codec bench] FAILED: " << status.ToString() << "\n";
    } else {
      row.round_trip = RoundTrip::kOk;
    }
    group.rows.push_back(std::move(row));
  }
  std::error_code ignored;
  for (const std::string& path : {base_path, target_path}) {
    std::filesystem::remove(path, ignored);
  }
}

// ---- output ------------------------------------------------------------------------

Table MakeTable(const Group& group, const CodecBenchOptions& options, bool markdown) {
  Table table;
  auto threads_suffix = [&](int threads) {
    return markdown ? " (" + ThreadsText(threads) + ")" : " " + std::to_string(threads) + "t";
  };
  table.header = {"", markdown ? "size (MB)" : "size MB", markdown ? "% of full" : "% full",
                  markdown ? "bits/changed elem" : "bits/chg"};
  for (int threads : options.threads) {
    table.header.push_back((markdown ? "encode GB/s" : "encode") + threads_suffix(threads));
  }
  for (int threads : options.threads) {
    table.header.push_back((markdown ? "apply GB/s" : "apply") + threads_suffix(threads));
  }
  for (int threads : options.threads) {
    table.header.push_back((markdown ? "apply* GB/s" : "apply*") + threads_suffix(threads));
  }
  table.header.push_back("round trip");
  for (const Row& row : group.rows) {
    std::vector<std::string> cells = {row.label, Fixed(row.bytes / 1e6, 3),
                                      Fixed(100.0 * row.bytes / group.checkpoint_bytes, 2),
                                      Fixed(group.BitsPerChanged(row), 2)};
    for (double value : row.encode_gbps) cells.push_back(Rate(value));
    for (double value : row.apply_gbps) cells.push_back(Rate(value));
    for (double value : row.apply_cached_gbps) cells.push_back(Rate(value));
    cells.push_back(row.round_trip == RoundTrip::kOk     ? "ok"
                    : row.round_trip == RoundTrip::kFail ? "FAIL"
                                                         : "-");
    table.rows.push_back(std::move(cells));
  }
  return table;
}

// Index of `threads` in options.threads, or -1.
int ThreadColumn(const CodecBenchOptions& options, int threads) {
  for (size_t i = 0; i < options.threads.size(); ++i) {
    if (options.threads[i] == threads) return static_cast<int>(i);
  }
  return -1;
}

std::string PassMiss(bool pass) {
  return pass ? "PASS" : "MISS";
}

// Ratio lines and target lines under a group's table.
struct Summary {
  std::vector<std::string> ratios;
  std::vector<std::string> targets;
};

double Speedup(const std::vector<double>& gbps, int one, int two) {
  if (one < 0 || two < 0) return kNotMeasured;
  return gbps[two] / gbps[one];
}

// The ratio of the codec's bits to its context model's conditional entropy, and that
// entropy against the order-0 floor.
std::string ContextRatio(const Group& group, double bits) {
  return "flywheel context bits / context-model conditional entropy: " +
         Fixed(bits / group.context_bits(), 3) + " (" + Fixed(bits, 2) + " vs " +
         Fixed(group.context_bits(), 2) + " = " + Fixed(group.context_position_bits, 2) +
         " position + " + Fixed(group.context_value_bits, 2) + " value; the model's entropy is " +
         Fixed(group.context_bits() / group.floor_bits(), 3) + "x the order-0 floor)";
}

// The context-coded row: its bits against the order-0 floor (the issue-33 target at ~2%)
// and against its own model's conditional entropy, and its per-thread speed beside the
// default coding's.
void AddContextLines(const Group& group, const CodecBenchOptions& options, Summary& summary) {
  const Row* context = group.Find(kFlywheelContextRow);
  const Row* plain = group.Find(kFlywheelZstdRow);
  if (context == nullptr || context->round_trip != RoundTrip::kOk) {
    summary.targets.push_back("flywheel context: n/a (no verified row)");
    return;
  }
  const double bits = group.BitsPerChanged(*context);
  const double to_floor = bits / group.floor_bits();
  summary.ratios.push_back("flywheel context bits / entropy floor bits: " + Fixed(to_floor, 3) +
                           " (" + Fixed(bits, 2) + " vs " + Fixed(group.floor_bits(), 2) + ")");
  summary.ratios.push_back(ContextRatio(group, bits));
  const int one = ThreadColumn(options, 1);
  if (one >= 0 && plain != nullptr && plain->round_trip == RoundTrip::kOk) {
    summary.ratios.push_back(
        "flywheel context / flywheel zstd, 1 thread: size " +
        Fixed(context->bytes / plain->bytes, 3) + ", encode " +
        Fixed(context->encode_gbps[one] / plain->encode_gbps[one], 2) + "x, apply* " +
        Fixed(context->apply_cached_gbps[one] / plain->apply_cached_gbps[one], 2) + "x");
  }
  const double density = group.density();
  if (density >= 0.005 && density <= 0.05) {
    summary.targets.push_back("flywheel context <= 0.75x the order-0 floor at ~2% (issue 33): " +
                              Fixed(to_floor, 3) + "x " + PassMiss(to_floor <= 0.75));
  }
  if (one >= 0) {
    summary.targets.push_back(
        "flywheel context per thread: encode " + Fixed(context->encode_gbps[one], 2) + " GB/s " +
        PassMiss(context->encode_gbps[one] >= 1) + ", apply* " +
        Fixed(context->apply_cached_gbps[one], 2) + " GB/s " +
        PassMiss(context->apply_cached_gbps[one] >= 2) + " (targets 1 / 2 GB/s)");
  }
}

Summary Summarise(const Group& group, const CodecBenchOptions& options) {
  Summary summary;
  const Row* flywheel = group.Find(kFlywheelZstdRow);
  const Row* xdelta = group.Find(kXdeltaRow);
  const int one = ThreadColumn(options, 1);
  const int two = ThreadColumn(options, 2);
  const bool flywheel_ok = flywheel != nullptr && flywheel->round_trip == RoundTrip::kOk;
  const bool xdelta_ok = xdelta != nullptr && xdelta->round_trip == RoundTrip::kOk;

  const std::string no_xdelta =
      options.run_peers ? "n/a (no verified xdelta3 row)" : "n/a (peers not run)";
  const double to_xdelta =
      flywheel_ok && xdelta_ok ? flywheel->bytes / xdelta->bytes : kNotMeasured;
  const double bits = flywheel_ok ? group.BitsPerChanged(*flywheel) : kNotMeasured;
  const double to_floor = bits / group.floor_bits();
  const double encode_speedup =
      flywheel_ok ? Speedup(flywheel->encode_gbps, one, two) : kNotMeasured;
  const double apply_speedup = flywheel_ok ? Speedup(flywheel->apply_gbps, one, two) : kNotMeasured;
  const double cached_speedup =
      flywheel_ok ? Speedup(flywheel->apply_cached_gbps, one, two) : kNotMeasured;

  summary.ratios.push_back(
      "flywheel zstd size / xdelta3 size: " +
      (std::isfinite(to_xdelta)
           ? Fixed(to_xdelta, 3) + (to_xdelta <= 1 ? " (" + Fixed(1 / to_xdelta, 1) + "x smaller)"
                                                   : " (" + Fixed(to_xdelta, 1) + "x larger)")
           : no_xdelta));
  summary.ratios.push_back("flywheel zstd bits / entropy floor bits: " + Fixed(to_floor, 3) + " (" +
                           Fixed(bits, 2) + " vs " + Fixed(group.floor_bits(), 2) + " = " +
                           Fixed(group.position_bits, 2) + " position + " +
                           Fixed(group.value_bits, 2) + " value)");
  AddContextLines(group, options, summary);
  if (one >= 0 && two >= 0) {
    summary.ratios.push_back("flywheel zstd 2 threads / 1 thread: encode " +
                             Fixed(encode_speedup, 2) + "x, apply " + Fixed(apply_speedup, 2) +
                             "x, apply* " + Fixed(cached_speedup, 2) + "x");
  }

  const double density = group.density();
  if (density >= 0.005 && density <= 0.05) {
    summary.targets.push_back("target <= 10 bits/changed at ~2% (stretch 9): " + Fixed(bits, 2) +
                              " " + PassMiss(bits <= 10) +
                              (bits <= 9 ? " (stretch PASS)" : " (stretch MISS)"));
  } else {
    summary.targets.push_back("target <= 10 bits/changed at ~2% (stretch 9): " + Fixed(bits, 2) +
                              " n/a at " + Fixed(100 * density, 1) + "% density");
  }
  summary.targets.push_back("size <= 1/3 xdelta3: " +
                            (std::isfinite(to_xdelta)
                                 ? Fixed(to_xdelta, 3) + " " + PassMiss(to_xdelta <= 1.0 / 3)
                                 : no_xdelta));
  if (one >= 0 && flywheel_ok) {
    const double encode = flywheel->encode_gbps[one];
    const double apply = flywheel->apply_gbps[one];
    const double cached = flywheel->apply_cached_gbps[one];
    auto per_cpu = [](double gbps) { return " (" + Fixed(gbps, 2) + " per CPU-second)"; };
    summary.targets.push_back("encode >= 1 GB/s/thread: " + Fixed(encode, 2) + " " +
                              PassMiss(encode >= 1) + per_cpu(flywheel->encode_cpu_gbps[one]));
    summary.targets.push_back("apply >= 2 GB/s/thread: " + Fixed(cached, 2) +
                              " with cached hashes " + PassMiss(cached >= 2) +
                              per_cpu(flywheel->apply_cached_cpu_gbps[one]) + ", " +
                              Fixed(apply, 2) + " rehashing the base " + PassMiss(apply >= 2) +
                              per_cpu(flywheel->apply_cpu_gbps[one]));
  } else {
    summary.targets.push_back("encode >= 1 GB/s/thread: n/a");
    summary.targets.push_back("apply >= 2 GB/s/thread: n/a");
  }
  if (one >= 0 && two >= 0 && flywheel_ok) {
    summary.targets.push_back("2 threads >= 1.7x: encode " + Fixed(encode_speedup, 2) + "x " +
                              PassMiss(encode_speedup >= 1.7) + ", apply " +
                              Fixed(cached_speedup, 2) + "x " + PassMiss(cached_speedup >= 1.7));
  } else {
    summary.targets.push_back("2 threads >= 1.7x: n/a (needs --threads 1,2)");
  }
  return summary;
}

std::string GroupTitle(const Group& group, const CodecBenchOptions& options) {
  std::ostringstream out;
  out << "lr " << LearningRateText(group.learning_rate) << ": " << group.tensor_count
      << " tensors, " << Fixed(group.checkpoint_bytes / 1e6, 1) << " MB bf16 ("
      << Grouped(group.total_words) << " words), " << Grouped(group.changed_words)
      << " changed = " << Fixed(100 * group.density(), 2) << "% (AdamW step "
      << options.adam_steps - 1 << " -> " << options.adam_steps << ")";
  return out.str();
}

std::string Legend(const CodecBenchOptions& options) {
  std::ostringstream out;
  out << "encode/apply: GB/s of bf16 checkpoint, best of " << options.repetitions
      << " (Nt = N threads); apply* = apply given the worker's cached base hashes (plain apply "
         "rehashes the base first).\n"
      << "peers: separate processes on the raw bf16 bytes of all tensors, one run each, "
         "timed with process start and page-cache file I/O; \"apply\" = decode.\n"
      << "bits/chg = 8 x size / changed words. round trip: every decode compared bit for bit "
         "with the target.\n"
      << "entropy floor: n x H2(p) bits for positions (p = changed fraction) + the entropy of the "
         "pair's own histogram of bf16 bit-pattern differences, per changed element\n"
      << "               (a floor for coders that treat positions and differences as "
         "independent draws).";
  return out.str();
}

std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof(escape), "\\u%04x", c);
      out += escape;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string JsonNumber(double value) {
  if (!std::isfinite(value)) return "null";
  std::ostringstream out;
  out << std::setprecision(10) << value;
  return out.str();
}

std::string JsonThreadMap(const std::vector<double>& values, const CodecBenchOptions& options) {
  std::string out = "{";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ", ";
    out += "\"" + std::to_string(options.threads[i]) + "\": " + JsonNumber(values[i]);
  }
  return out + "}";
}

std::string RenderJson(const std::vector<Group>& groups, const CodecBenchOptions& options,
                       const TransformerShape& shape, bool ok) {
  std::ostringstream out;
  out << "{\n  \"benchmark\": \"flywheel codec\",\n  \"ok\": " << (ok ? "true" : "false")
      << ",\n  \"checkpoint\": {\"bytes\": " << options.checkpoint_bytes
      << ", \"hidden\": " << shape.hidden << ", \"intermediate\": " << shape.intermediate
      << ", \"layers\": " << shape.layers << ", \"vocab\": " << shape.vocab
      << ", \"adam_steps\": " << options.adam_steps << ", \"seed\": " << options.seed
      << "},\n  \"repetitions\": " << options.repetitions << ",\n  \"groups\": [";
  for (size_t g = 0; g < groups.size(); ++g) {
    const Group& group = groups[g];
    out << (g > 0 ? "," : "") << "\n    {\"learning_rate\": " << JsonNumber(group.learning_rate)
        << ", \"tensors\": " << group.tensor_count
        << ", \"checkpoint_bytes\": " << group.checkpoint_bytes
        << ", \"total_words\": " << group.total_words
        << ", \"changed_words\": " << group.changed_words
        << ", \"density\": " << JsonNumber(group.density())
        << ",\n     \"floor_bits_per_changed\": {\"position\": " << JsonNumber(group.position_bits)
        << ", \"value\": " << JsonNumber(group.value_bits)
        << ", \"total\": " << JsonNumber(group.floor_bits()) << "},"
        << "\n     \"context_entropy_bits_per_changed\": {\"position\": "
        << JsonNumber(group.context_position_bits)
        << ", \"value\": " << JsonNumber(group.context_value_bits)
        << ", \"total\": " << JsonNumber(group.context_bits()) << "},\n     \"rows\": [";
    for (size_t r = 0; r < group.rows.size(); ++r) {
      const Row& row = group.rows[r];
      out << (r > 0 ? "," : "") << "\n       {\"name\": " << JsonString(row.label)
          << ", \"bytes\": " << JsonNumber(row.bytes)
          << ", \"fraction_of_full\": " << JsonNumber(row.bytes / group.checkpoint_bytes)
          << ", \"bits_per_changed\": " << JsonNumber(group.BitsPerChanged(row))
          << ", \"encode_gbps\": " << JsonThreadMap(row.encode_gbps, options)
          << ", \"apply_gbps\": " << JsonThreadMap(row.apply_gbps, options)
          << ", \"apply_cached_hashes_gbps\": " << JsonThreadMap(row.apply_cached_gbps, options)
          << ", \"encode_gb_per_cpu_second\": " << JsonThreadMap(row.encode_cpu_gbps, options)
          << ", \"apply_gb_per_cpu_second\": " << JsonThreadMap(row.apply_cpu_gbps, options)
          << ", \"apply_cached_hashes_gb_per_cpu_second\": "
          << JsonThreadMap(row.apply_cached_cpu_gbps, options) << ", \"round_trip\": "
          << (row.round_trip == RoundTrip::kOk     ? "\"ok\""
              : row.round_trip == RoundTrip::kFail ? "\"FAIL\""
                                                   : "null")
          << "}";
    }
    const Summary summary = Summarise(group, options);
    out << "\n     ],\n     \"ratios\": [";
    for (size_t i = 0; i < summary.ratios.size(); ++i) {
      out << (i > 0 ? ", " : "") << JsonString(summary.ratios[i]);
    }
    out << "],\n     \"targets\": [";
    for (size_t i = 0; i < summary.targets.size(); ++i) {
      out << (i > 0 ? ", " : "") << JsonString(summary.targets[i]);
    }
    out << "],\n     \"skipped\": [";
    for (size_t i = 0; i < group.skipped.size(); ++i) {
      out << (i > 0 ? ", " : "") << JsonString(group.skipped[i]);
    }
    out << "]}";
  }
  out << "\n  ]\n}\n";
  return out.str();
}

std::string Preamble(const CodecBenchOptions& options, const TransformerShape& shape) {
  std::ostringstream out;
  out << "flywheel codec benchmark: sparse bf16 checkpoint deltas vs zstd, zstd --patch-from, "
         "xdelta3 and the entropy floor\n"
      << "checkpoint: generated transformer (hidden " << shape.hidden << ", intermediate "
      << shape.intermediate << ", " << shape.layers << " layers, vocab " << shape.vocab
      << "), fp32 masters ~N(0, 0.02), norms 1.0;\n"
      << "            AdamW (beta1 0.9, beta2 0.999, eps 1e-8, wd 0.01) on fresh N(0,1) "
         "gradients, bf16 (round to nearest even) after each step\n"
      << "machine: " << std::thread::hardware_concurrency() << " hardware threads";
  // Timings on a busy machine mislead (the 2-thread column most of all): say so up front.
  double load = 0;
  if (std::FILE* file = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(file, "%lf", &load) == 1) out << ", load average " << Fixed(load, 2);
    std::fclose(file);
  }
  if (load >= 0.5 * std::thread::hardware_concurrency()) {
    out << " (busy: other processes share the CPUs, so throughputs are low and noisy)";
  }
  out << "\n";
  return out.str();
}

Status ValidateOptions(const CodecBenchOptions& options) {
  if (options.learning_rates.empty()) return Status::InvalidArgument("no learning rate given");
  for (double lr : options.learning_rates) {
    if (!(lr > 0) || !std::isfinite(lr)) {
      return Status::InvalidArgument("learning rate must be positive, got " + LearningRateText(lr));
    }
  }
  if (options.threads.empty()) return Status::InvalidArgument("no thread count given");
  for (int threads : options.threads) {
    if (threads < 1 || threads > 256) {
      return Status::InvalidArgument("thread count must be in [1, 256], got " +
                                     std::to_string(threads));
    }
  }
  if (options.repetitions < 1) {
    return Status::InvalidArgument("repetitions must be >= 1, got " +
                                   std::to_string(options.repetitions));
  }
  if (options.adam_steps < 1) {
    return Status::InvalidArgument("adam steps must be >= 1, got " +
                                   std::to_string(options.adam_steps));
  }
  if (options.checkpoint_bytes < (1ull << 20)) {
    return Status::InvalidArgument("checkpoint size must be at least 1 MiB, got " +
                                   std::to_string(options.checkpoint_bytes) + " bytes");
  }
  return Status::Ok();
}

// The flywheel rows of a group (zstd and lz4), each checked by a round trip; a failed one
// is kept with its status in `failures`.
void MeasureFlywheelRows(const CheckpointPair& pair, const CodecBenchOptions& options, Group& group,
                         std::vector<Status>& failures) {
  const size_t thread_columns = options.threads.size();
  std::vector<Hash128> base_hashes;
  for (const TensorView& tensor : pair.BaseView()) base_hashes.push_back(TensorHash(tensor));
  struct Variant {
    const char* label;
    delta::Compressor compressor;
    bool context;
  };
  const Variant variants[] = {{kFlywheelZstdRow, delta::Compressor::kZstd, false},
                              {kFlywheelLz4Row, delta::Compressor::kLz4, false},
                              {kFlywheelContextRow, delta::Compressor::kZstd, true}};
  for (const Variant& variant : variants) {
    Row row = EmptyRow(variant.label, thread_columns);
    std::cerr << "[codec bench]   " << row.label << " ..." << std::flush;
    const Clock::time_point flywheel_start = Clock::now();
    Status status = MeasureFlywheel(pair, variant.compressor, variant.context, options, group,
                                    base_hashes, row);
    std::cerr << " " << Fixed(SecondsSince(flywheel_start), 1) << " s\n";
    row.round_trip = status.ok() ? RoundTrip::kOk : RoundTrip::kFail;
    if (!status.ok()) {
      std::cerr << "[codec bench] FAILED: " << status.ToString() << "\n";
      failures.push_back(status);
    }
    group.rows.push_back(std::move(row));
  }
}

// One learning rate: a generated checkpoint pair, then every row of its table.
Result<Group> MeasureGroup(const CodecBenchOptions& options, double learning_rate,
                           const std::string& work_dir, std::vector<Status>& failures) {
  const size_t thread_columns = options.threads.size();
  GeneratorOptions generator;
  generator.checkpoint_bytes = options.checkpoint_bytes;
  generator.adamw.learning_rate = learning_rate;
  generator.adam_steps = options.adam_steps;
  generator.seed = options.seed;
  generator.threads = 2;
  std::cerr << "[codec bench] lr " << LearningRateText(learning_rate) << ": generating "
            << Fixed(options.checkpoint_bytes / 1e6, 1) << " MB checkpoint pair ...";
  const Clock::time_point start = Clock::now();
  FW_ASSIGN_OR_RETURN(const CheckpointPair pair, GenerateCheckpointPair(generator));
  std::cerr << " " << Fixed(SecondsSince(start), 1) << " s\n";
  Group group;
  group.learning_rate = learning_rate;
  group.tensor_count = pair.tensors.size();
  group.checkpoint_bytes = pair.bytes();
  ComputeFloor(pair, group);
  group.rows.push_back(EmptyRow(kFullRow, thread_columns));
  group.rows.back().bytes = static_cast<double>(group.checkpoint_bytes);
  if (options.run_peers) MeasurePeers(pair, work_dir, thread_columns, group, failures);
  MeasureFlywheelRows(pair, options, group, failures);
  group.rows.push_back(EmptyRow(kFloorRow, thread_columns));
  group.rows.back().bytes = group.floor_bits() * group.changed_words / 8;
  return group;
}

// A group's table, skipped peers, ratios and targets: as text to `out`, as Markdown appended
// to `markdown`.
void ReportGroup(const Group& group, const CodecBenchOptions& options, std::ostream& out,
                 std::string& markdown) {
  const Summary summary = Summarise(group, options);
  out << GroupTitle(group, options) << "\n" << RenderText(MakeTable(group, options, false));
  for (const std::string& line : group.skipped) out << "  skipped " << line << "\n";
  out << "  ratios:\n";
  for (const std::string& line : summary.ratios) out << "    " << line << "\n";
  out << "  targets:\n";
  for (const std::string& line : summary.targets) out << "    " << line << "\n";
  out << "\n" << std::flush;
  markdown += "\n## " + GroupTitle(group, options) + "\n\n" +
              RenderMarkdown(MakeTable(group, options, true)) + "\n";
  for (const std::string& line : group.skipped) markdown += "- skipped " + line + "\n";
  for (const std::string& line : summary.ratios) markdown += "- " + line + "\n";
  markdown += "\nTargets:\n\n";
  for (const std::string& line : summary.targets) markdown += "- " + line + "\n";
}

// Writes `markdown` to `path`, keeping the other benchmarks' sections that follow the codec's.
Status WriteCodecMarkdown(const std::string& path, std::string markdown) {
  std::ifstream existing(path, std::ios::binary);
  const std::string previous((std::istreambuf_iterator<char>(existing)),
                             std::istreambuf_iterator<char>());
  const size_t kept =
      std::min({previous.find("\n## Fleet benchmark"), previous.find("\n## Trainer benchmark"),
                previous.find("\n## Rollout benchmark"), previous.find("\n## Parity benchmark")});
  if (kept != std::string::npos) markdown += previous.substr(kept);
  return WriteFile(path, std::as_bytes(std::span(markdown)));
}

}  // namespace

Status RunCodecBench(const CodecBenchOptions& options, std::ostream& out) {
  FW_RETURN_IF_ERROR(ValidateOptions(options));
  ScopedWorkDir work_dir;
  if (options.run_peers) {
    // --work-dir is kept afterwards; a fresh one under $TMPDIR is removed.
    FW_RETURN_IF_ERROR(work_dir.Prepare(options.work_dir, "flywheel-codec-bench",
                                        /*keep=*/!options.work_dir.empty()));
  }
  const TransformerShape shape = ShapeForBytes(options.checkpoint_bytes);
  const std::string preamble = Preamble(options, shape);
  out << preamble << "\n" << std::flush;
  std::vector<Group> groups;
  std::vector<Status> failures;
  std::string markdown = "# flywheel codec benchmark\n\n```\n" + preamble + "```\n";
  for (double learning_rate : options.learning_rates) {
    FW_ASSIGN_OR_RETURN(Group group,
                        MeasureGroup(options, learning_rate, work_dir.path(), failures));
    ReportGroup(group, options, out, markdown);
    groups.push_back(std::move(group));
  }
  out << Legend(options) << "\n";
  markdown += "\n" + Legend(options) + "\n";
  if (!options.markdown_out.empty()) {
    FW_RETURN_IF_ERROR(WriteCodecMarkdown(options.markdown_out, std::move(markdown)));
  }
  if (!options.json_out.empty()) {
    const std::string json = RenderJson(groups, options, shape, failures.empty());
    FW_RETURN_IF_ERROR(WriteFile(options.json_out, std::as_bytes(std::span(json))));
  }
  if (!failures.empty()) {
    Status first = failures.front();
    if (failures.size() > 1) {
      first = first.WithContext(std::to_string(failures.size()) + " self-checks failed, first");
    }
    return first;
  }
  return Status::Ok();
}

}  // namespace flywheel::bench
