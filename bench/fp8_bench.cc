#include "bench/fp8_bench.h"

#include <torch/torch.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <thread>

#include "base/env.h"
#include "bench/pattern_batch.h"
#include "bench/peers.h"
#include "bench/util.h"
#include "delta/delta.h"
#include "model/fp8.h"
#include "model/model.h"
#include "model/model_config.h"
#include "model/weights.h"
#include "ops/process.h"
#include "sync/version_log.h"
#include "trainer/training_client.h"

namespace flywheel::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using trainer::Datum;
using trainer::TrainingClient;

constexpr double kSeedsDeltaPercent = 1.98;  // Fireworks, 1 TiB FP8 model
constexpr double kDeltaGoalPercent = 1.5;
constexpr double kFloorTarget = 1.05;
constexpr double kQatK3Target = 2.0;
constexpr double kSftLr = 1e-3;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Percent(double part, double whole) {
  return whole > 0 ? 100.0 * part / whole : 0;
}

model::ModelConfig BenchConfig(const Fp8BenchOptions& options) {
  model::ModelConfig config = model::DemoDenseConfig();
  config.vocab_size = options.vocab;
  config.hidden_size = options.hidden;
  config.num_hidden_layers = options.layers;
  config.head_dim = 64;
  config.num_attention_heads = options.hidden / 64;
  config.num_key_value_heads = std::max<int64_t>(1, options.hidden / 128);
  config.intermediate_size = (options.hidden * 11 / 4 + 63) / 64 * 64;
  return config;
}

Status CheckOptions(const Fp8BenchOptions& o) {
  if (o.hidden < 128 || o.hidden % 64 != 0)
    return Status::InvalidArgument("bench fp8: hidden " + std::to_string(o.hidden) +
                                   " is not a multiple of 64 of at least 128");
  if (o.layers < 1 || o.vocab < 64 || o.sft_steps < 0 || o.rl_steps < 1 || o.sequences < 1 ||
      o.sequence_length < 4 || o.block < 1 || o.threads < 0)
    return Status::InvalidArgument(
        "bench fp8: layers, rl steps, sequences and block must be >= 1, vocab >= 64, "
        "sequence length >= 4, sft steps and threads >= 0");
  if (!(o.rl_lr > 0 && o.rl_lr < 1))
    return Status::InvalidArgument("bench fp8: RL learning rate " + std::to_string(o.rl_lr) +
                                   " is not in (0, 1)");
  return Status::Ok();
}

// ---- batches --------------------------------------------------------------------------

// An RL batch: the first quarter a prompt (weight 0), sampling logprobs the model's own plus
// sampler noise, group-style advantages.
Result<std::vector<Datum>> RlBatch(TrainingClient& client, const Fp8BenchOptions& o, int step) {
  std::vector<Datum> batch =
      PatternBatch(o.sequences, o.sequence_length, o.vocab, o.seed + 100 + step);
  FW_ASSIGN_OR_RETURN(trainer::ForwardOutput forward, client.Forward(batch));
  std::mt19937_64 rng(o.seed + 200 + step);
  std::normal_distribution<float> noise(0, 0.02f);
  for (size_t i = 0; i < batch.size(); ++i) {
    Datum& d = batch[i];
    d.weights.assign(d.tokens.size(), 1.0f);
    std::fill(d.weights.begin(), d.weights.begin() + d.tokens.size() / 4, 0.0f);
    d.logprobs = forward.logprobs[i];
    for (float& lp : d.logprobs) lp += noise(rng);
    d.advantages.assign(d.tokens.size(), (i % 2 ? 1.0f : -1.0f) * (1 + 0.1f * (i % 3)));
  }
  return batch;
}

Status Sft(TrainingClient& client, const Fp8BenchOptions& o, std::ostream& progress) {
  const auto batch = PatternBatch(o.sequences, o.sequence_length, o.vocab, o.seed + 3);
  for (int step = 0; step < o.sft_steps; ++step) {
    FW_ASSIGN_OR_RETURN(trainer::Metrics m, client.ForwardBackward(batch, "cross_entropy"));
    FW_RETURN_IF_ERROR(client.OptimStep({.lr = kSftLr}).status());
    if ((step + 1) % 10 == 0 || step + 1 == o.sft_steps)
      progress << "[fp8 bench] SFT step " << step + 1 << "/" << o.sft_steps << " loss " << m.loss
               << "\n"
               << std::flush;
  }
  return Status::Ok();
}

Status RlStep(TrainingClient& client, const Fp8BenchOptions& o, int step) {
  FW_ASSIGN_OR_RETURN(std::vector<Datum> batch, RlBatch(client, o, step));
  FW_RETURN_IF_ERROR(
      client.ForwardBackward(batch, "ppo", {.clip_low = 0.2, .clip_high = 0.28}).status());
  return client.OptimStep({.lr = o.rl_lr}).status();
}

// ---- snapshots and deltas ---------------------------------------------------------------

// One version served both ways from the same fp32 masters.
struct Served {
  OwnedCheckpoint fp8;   // SaveWeightsForSampler with fp8_serving (what is published)
  OwnedCheckpoint bf16;  // model::SnapshotWeights(BF16)
};

uint64_t DataBytes(const OwnedCheckpoint& checkpoint) {
  uint64_t bytes = 0;
  for (const OwnedTensor& t : checkpoint.tensors) bytes += t.data.size();
  return bytes;
}

Result<Served> Serve(TrainingClient& client, uint64_t version) {
  FW_ASSIGN_OR_RETURN(trainer::SamplerSnapshot snapshot, client.SaveWeightsForSampler(version));
  Served served;
  served.fp8 = std::move(snapshot.checkpoint);
  FW_ASSIGN_OR_RETURN(served.bf16, model::SnapshotWeights(client.model(), DType::kBF16));
  // Quantization is a pure function of the weights: a second snapshot has the same bytes.
  FW_ASSIGN_OR_RETURN(
      OwnedCheckpoint again,
      model::SnapshotWeightsFp8(client.model(), {.block = client.options().fp8_block}));
  if (again.tensors.size() != served.fp8.tensors.size())
    return Status::Internal("bench fp8: a second FP8 snapshot of version " +
                            std::to_string(version) + " has another tensor count");
  for (size_t i = 0; i < again.tensors.size(); ++i) {
    if (again.tensors[i].data != served.fp8.tensors[i].data)
      return Status::Internal("bench fp8: a second FP8 snapshot of version " +
                              std::to_string(version) + " differs in tensor " +
                              again.tensors[i].name);
  }
  return served;
}

class VectorSink : public delta::StreamSink {
 public:
  Status Begin(uint64_t size_bound) override {
    bytes_.reserve(size_bound);
    return Status::Ok();
  }
  Status Write(std::span<const std::byte> bytes) override {
    bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
    return Status::Ok();
  }
  std::vector<std::byte> Take() { return std::move(bytes_); }

 private:
  std::vector<std::byte> bytes_;
};

// The delta base -> target as the publisher writes it (sync::VersionLog::Append with
// VersionLogOptions' defaults: streamed container, its compressor and thread count).
// `context_coding` false: the sparse coding of the builds before the context-coded chunk
// (kinds 0..2), the "today" the issue's >= 25% target compares with.
Result<std::vector<std::byte>> EncodeAsPublisher(const OwnedCheckpoint& base,
                                                 const OwnedCheckpoint& target,
                                                 uint64_t base_version,
                                                 bool context_coding = true) {
  const sync::VersionLogOptions log;
  delta::EncodeOptions encode;
  encode.context_coding = context_coding;
  encode.base_version = base_version;
  encode.target_version = base_version + 1;
  encode.compressor = log.compressor;
  encode.threads = log.threads;
  if (!log.stream_deltas) return delta::Encode(base.view(), target.view(), encode);
  VectorSink sink;
  FW_RETURN_IF_ERROR(delta::EncodeStreamed(base.view(), target.view(), encode, sink));
  return sink.Take();
}

// Applies `bytes` to a copy of `base` as a worker does; the result must be `target` bit for
// bit.
Status CheckDeltaRebuildsTarget(const OwnedCheckpoint& base, const OwnedCheckpoint& target,
                                const delta::DeltaView& delta, const std::string& what) {
  OwnedCheckpoint state = base;
  MutableCheckpointView view = state.mutable_view();
  FW_RETURN_IF_ERROR(delta::ApplyInPlace(view, delta, {}).status().WithContext(what));
  for (size_t i = 0; i < target.tensors.size(); ++i) {
    const auto& got = state.tensors[i].data;
    const auto& want = target.tensors[i].data;
    if (got == want) continue;
    size_t at = 0;
    while (at < got.size() && at < want.size() && got[at] == want[at]) ++at;
    return Status::Internal(what + ": the applied delta differs from the target in tensor " +
                            target.tensors[i].name + " at byte " + std::to_string(at));
  }
  return Status::Ok();
}

// ---- what changed, and the floor ----------------------------------------------------------

struct Changes {
  uint64_t words = 0, changed = 0;        // all tensors, in their word size
  uint64_t f8_bytes = 0, f8_changed = 0;  // F8_E4M3 tensors
  uint64_t scale_words = 0, scale_changed = 0;
  std::array<uint64_t, 256> difference{};    // (target - base) mod 256 of changed F8 bytes
  std::array<uint64_t, 256> exclusive_or{};  // target ^ base of changed F8 bytes
  double tensor_position_bits = 0;           // sum over F8 tensors of n_i·H2(p_i)
  double tensor_value_bits = 0;              // sum over F8 tensors of m_i·H(differences_i)
  uint64_t rice_bits = 0;  // the gaps Rice-coded as delta/entropy.h does, best k per tensor
};

double H2(double p) {
  return p <= 0 || p >= 1 ? 0 : -(p * std::log2(p) + (1 - p) * std::log2(1 - p));
}

double Entropy(const std::array<uint64_t, 256>& histogram, uint64_t total) {
  double bits = 0;
  for (uint64_t count : histogram) {
    if (count == 0) continue;
    const double q = static_cast<double>(count) / static_cast<double>(total);
    bits -= q * std::log2(q);
  }
  return bits;
}

// Bits of Rice codes with escape (delta/entropy.h) for `gaps`, with the best k: what the
// codec's index stream costs for one chunk, before any zstd.
uint64_t RiceBits(const std::vector<uint32_t>& gaps) {
  uint64_t best = UINT64_MAX;
  for (int k = 0; k <= 31; ++k) {
    uint64_t bits = 0;
    for (uint32_t g : gaps) {
      const uint64_t q = g >> k;
      bits += q < 31 ? q + 1 + k : 31 + 1 + 6 + (64 - __builtin_clzll(g));
    }
    best = std::min(best, bits);
  }
  return best;
}

void CountF8(const OwnedTensor& a, const OwnedTensor& b, Changes& c) {
  const auto* x = reinterpret_cast<const uint8_t*>(a.data.data());
  const auto* y = reinterpret_cast<const uint8_t*>(b.data.data());
  std::array<uint64_t, 256> difference{};
  std::vector<uint32_t> gaps;
  uint64_t next_free = 0;
  for (size_t i = 0; i < a.data.size(); ++i) {
    if (x[i] == y[i]) continue;
    ++difference[static_cast<uint8_t>(y[i] - x[i])];
    ++c.exclusive_or[x[i] ^ y[i]];
    gaps.push_back(static_cast<uint32_t>(i - next_free));
    next_free = i + 1;
  }
  const uint64_t changed = gaps.size();
  for (size_t v = 0; v < 256; ++v) c.difference[v] += difference[v];
  c.f8_bytes += a.data.size();
  c.f8_changed += changed;
  const double n = static_cast<double>(a.data.size());
  c.tensor_position_bits += n * H2(static_cast<double>(changed) / n);
  if (changed == 0) return;
  c.tensor_value_bits += static_cast<double>(changed) * Entropy(difference, changed);
  c.rice_bits += RiceBits(gaps);
}

Changes CountChanges(const OwnedCheckpoint& base, const OwnedCheckpoint& target) {
  Changes c;
  for (size_t t = 0; t < base.tensors.size(); ++t) {
    const OwnedTensor& a = base.tensors[t];
    const OwnedTensor& b = target.tensors[t];
    const size_t word = static_cast<size_t>(DTypeWordBytes(a.dtype));
    uint64_t changed = 0;
    for (size_t w = 0; w < a.data.size() / word; ++w)
      changed += std::memcmp(&a.data[w * word], &b.data[w * word], word) != 0;
    c.words += a.data.size() / word;
    c.changed += changed;
    if (a.dtype == DType::kF8_E4M3) CountF8(a, b, c);
    if (a.name.ends_with(model::kFp8ScaleSuffix)) {
      c.scale_words += a.data.size() / word;
      c.scale_changed += changed;
    }
  }
  return c;
}

// The F8 part of a delta: stored payload bytes of the chunks of F8_E4M3 tensors, by kind.
struct F8Chunks {
  uint64_t payload_bytes = 0;
  int sparse = 0, dense = 0, compressed = 0;
};

F8Chunks F8Payload(const delta::Manifest& manifest) {
  F8Chunks out;
  for (const delta::ChunkEntry& chunk : manifest.chunks) {
    if (manifest.tensors[chunk.tensor_index].dtype != DType::kF8_E4M3) continue;
    out.payload_bytes += chunk.payload_bytes;
    const bool sparse = chunk.kind == delta::ChunkKind::kSparse ||
                        chunk.kind == delta::ChunkKind::kSparseContext;
    (sparse ? out.sparse : out.dense) += 1;
    out.compressed += chunk.compressor != delta::Compressor::kNone;
  }
  return out;
}

// ---- peers --------------------------------------------------------------------------------

// `zstd -<level>` of the XOR of the two checkpoints' tensor bytes (in tensor order); checks
// the round trip. nullopt when zstd is not installed.
Result<std::optional<uint64_t>> ZstdOfXor(const OwnedCheckpoint& base,
                                          const OwnedCheckpoint& target, int level,
                                          const std::string& dir) {
  const std::optional<std::string> zstd = FindExecutable("zstd");
  if (!zstd) return std::optional<uint64_t>();
  std::vector<char> xored;
  for (size_t t = 0; t < base.tensors.size(); ++t) {
    const auto& a = base.tensors[t].data;
    const auto& b = target.tensors[t].data;
    for (size_t i = 0; i < a.size(); ++i) xored.push_back(static_cast<char>(a[i] ^ b[i]));
  }
  const std::string raw = dir + "/xor.bin", packed = dir + "/xor.bin.zst", back = dir + "/xor.out";
  FW_RETURN_IF_ERROR(WriteFileAtomically(raw, std::as_bytes(std::span(xored))));
  ops::RunOptions run;
  run.timeout = std::chrono::minutes(5);
  run.stdout_path = packed;
  FW_ASSIGN_OR_RETURN(
      ops::Completion encoded,
      ops::RunToCompletion(*zstd, {"-" + std::to_string(level), "-q", "-c", raw}, run));
  run.stdout_path = back;
  FW_ASSIGN_OR_RETURN(ops::Completion decoded,
                      ops::RunToCompletion(*zstd, {"-d", "-q", "-c", packed}, run));
  if (encoded.exit_code != 0 || decoded.exit_code != 0)
    return Status::IOError("zstd -" + std::to_string(level) + " of the XOR failed: " + encoded.err +
                           decoded.err);
  std::error_code ec;
  const uint64_t size = fs::file_size(packed, ec);
  FW_ASSIGN_OR_RETURN(std::vector<std::byte> round_trip, Env::Default()->ReadFile(back));
  if (ec || round_trip.size() != xored.size() ||
      std::memcmp(round_trip.data(), xored.data(), xored.size()) != 0)
    return Status::Internal("zstd -" + std::to_string(level) + " did not give back the XOR");
  for (const std::string& path : {raw, packed, back}) fs::remove(path, ec);
  return std::optional<uint64_t>(size);
}

// ---- k3 -----------------------------------------------------------------------------------

struct Gap {
  std::string label;
  double k3 = 0;
  double max_abs = 0;  // largest |r|
  int64_t tokens = 0;
};

// A plain model (no QAT) of the trainer's config holding what a worker serves.
Result<std::unique_ptr<TrainingClient>> Sampler(const trainer::TrainerOptions& trained,
                                                const OwnedCheckpoint& snapshot, bool fp8) {
  FW_ASSIGN_OR_RETURN(
      auto served,
      TrainingClient::Create({.config = trained.config, .seed = 999, .threads = trained.threads}));
  const Status loaded = fp8 ? model::LoadFp8Weights(served->model(), snapshot.view(),
                                                    "FP8 snapshot", trained.fp8_block)
                            : model::LoadWeights(served->model(), snapshot.view(), "BF16 snapshot");
  FW_RETURN_IF_ERROR(loaded);
  return served;
}

// Teacher-forced contexts with the next token sampled from the sampler at every position.
std::vector<Datum> SampleTokens(TrainingClient& sampler, const std::vector<Datum>& contexts,
                                uint64_t seed) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> flat;
  for (const Datum& d : contexts) flat.insert(flat.end(), d.tokens.begin(), d.tokens.end());
  const int64_t rows = static_cast<int64_t>(contexts.size());
  torch::Tensor tokens = torch::tensor(flat).view({rows, -1});
  torch::Tensor probs =
      torch::softmax(sampler.model().forward(tokens).logits.to(torch::kDouble), -1).contiguous();
  const int64_t length = tokens.size(1), vocab = probs.size(2);
  const double* p = probs.data_ptr<double>();
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0, 1);
  std::vector<Datum> out = contexts;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t t = 0; t < length; ++t) {
      const double* row = p + (i * length + t) * vocab;
      double u = uniform(rng), sum = 0;
      int64_t token = vocab - 1;
      for (int64_t v = 0; v < vocab; ++v) {
        sum += row[v];
        if (u < sum) {
          token = v;
          break;
        }
      }
      out[i].target_tokens[t] = static_cast<int32_t>(token);
    }
  }
  return out;
}

Result<Gap> MeasureGap(const std::string& label, TrainingClient& trained, TrainingClient& sampler,
                       const Fp8BenchOptions& o) {
  const auto contexts = PatternBatch(o.sequences, o.sequence_length, o.vocab, o.seed + 7);
  const auto sampled = SampleTokens(sampler, contexts, o.seed + 8);
  FW_ASSIGN_OR_RETURN(trainer::ForwardOutput s, sampler.Forward(sampled));
  FW_ASSIGN_OR_RETURN(trainer::ForwardOutput t, trained.Forward(sampled));
  Gap gap{.label = label};
  for (size_t i = 0; i < sampled.size(); ++i) {
    for (size_t k = 0; k < sampled[i].tokens.size(); ++k) {
      const double r = static_cast<double>(t.logprobs[i][k]) - s.logprobs[i][k];
      gap.k3 += std::exp(r) - 1 - r;
      gap.max_abs = std::max(gap.max_abs, std::fabs(r));
      ++gap.tokens;
    }
  }
  gap.k3 /= static_cast<double>(gap.tokens);
  return gap;
}

// ---- the run ------------------------------------------------------------------------------

struct StepResult {
  int step = 0;
  Changes fp8, bf16;
  uint64_t fp8_delta = 0, bf16_delta = 0;
  F8Chunks f8;
  F8Chunks f8_plain;  // the same delta without the context coding (kinds 0..2)
  std::optional<uint64_t> zstd19, zstd3;
};

struct RunResult {
  model::ModelConfig config;
  uint64_t fp8_bytes = 0, bf16_bytes = 0, f8_weight_bytes = 0, scale_bytes = 0;
  size_t fp8_tensors = 0, bf16_tensors = 0;
  uint64_t fp8_fixed = 0, bf16_fixed = 0;  // the delta of a checkpoint with itself
  std::vector<StepResult> steps;
  std::vector<Gap> gaps;  // FP8 without QAT, FP8 with QAT, BF16
  std::string peers_skipped;
  double seconds = 0;
};

Result<uint64_t> CheckedDelta(const OwnedCheckpoint& base, const OwnedCheckpoint& target,
                              uint64_t version, const std::string& what, F8Chunks* f8,
                              bool context_coding = true) {
  FW_ASSIGN_OR_RETURN(std::vector<std::byte> bytes,
                      EncodeAsPublisher(base, target, version, context_coding));
  FW_ASSIGN_OR_RETURN(delta::DeltaView delta, delta::DeltaView::Parse(bytes));
  FW_RETURN_IF_ERROR(CheckDeltaRebuildsTarget(base, target, delta, what));
  if (f8 != nullptr) *f8 = F8Payload(delta.manifest());
  return static_cast<uint64_t>(bytes.size());
}

void DescribeCheckpoints(const Served& served, RunResult& r) {
  r.fp8_bytes = DataBytes(served.fp8);
  r.bf16_bytes = DataBytes(served.bf16);
  r.fp8_tensors = served.fp8.tensors.size();
  r.bf16_tensors = served.bf16.tensors.size();
  for (const OwnedTensor& t : served.fp8.tensors) {
    if (t.dtype == DType::kF8_E4M3) r.f8_weight_bytes += t.data.size();
    if (t.name.ends_with(model::kFp8ScaleSuffix)) r.scale_bytes += t.data.size();
  }
}

Status MeasureStep(const Served& before, const Served& after, int step, uint64_t version,
                   const Fp8BenchOptions& o, const std::string& dir, RunResult& r) {
  StepResult s{.step = step};
  s.fp8 = CountChanges(before.fp8, after.fp8);
  s.bf16 = CountChanges(before.bf16, after.bf16);
  const std::string at = " delta of RL step " + std::to_string(step);
  FW_ASSIGN_OR_RETURN(s.fp8_delta, CheckedDelta(before.fp8, after.fp8, version, "FP8" + at, &s.f8));
  FW_RETURN_IF_ERROR(CheckedDelta(before.fp8, after.fp8, version, "FP8 (kinds 0..2)" + at,
                                  &s.f8_plain, /*context_coding=*/false)
                         .status());
  FW_ASSIGN_OR_RETURN(s.bf16_delta,
                      CheckedDelta(before.bf16, after.bf16, version, "BF16" + at, nullptr));
  if (o.run_peers) {
    FW_ASSIGN_OR_RETURN(s.zstd19, ZstdOfXor(before.fp8, after.fp8, 19, dir));
    FW_ASSIGN_OR_RETURN(s.zstd3, ZstdOfXor(before.fp8, after.fp8, 3, dir));
    if (!s.zstd19) r.peers_skipped = "zstd is not installed (apt-get install zstd): no peer rows";
  }
  r.steps.push_back(std::move(s));
  return Status::Ok();
}

// SFT, then the measured RL steps on a trainer with fp8_serving; leaves the SFT state in
// `state_dir` and the trainer after its RL steps in `client`.
Status MeasureDeltas(TrainingClient& client, const Fp8BenchOptions& o, const std::string& dir,
                     const std::string& state_dir, RunResult& r, std::ostream& progress) {
  FW_RETURN_IF_ERROR(Sft(client, o, progress));
  FW_RETURN_IF_ERROR(client.SaveState(state_dir));
  uint64_t version = 1;
  FW_ASSIGN_OR_RETURN(Served previous, Serve(client, version));
  DescribeCheckpoints(previous, r);
  FW_ASSIGN_OR_RETURN(r.fp8_fixed,
                      CheckedDelta(previous.fp8, previous.fp8, 0, "FP8 no-op delta", nullptr));
  FW_ASSIGN_OR_RETURN(r.bf16_fixed,
                      CheckedDelta(previous.bf16, previous.bf16, 0, "BF16 no-op delta", nullptr));
  for (int step = 1; step <= o.rl_steps; ++step) {
    FW_RETURN_IF_ERROR(RlStep(client, o, step));
    FW_ASSIGN_OR_RETURN(Served next, Serve(client, version + 1));
    FW_RETURN_IF_ERROR(MeasureStep(previous, next, step, version, o, dir, r));
    const StepResult& s = r.steps.back();
    progress << "[fp8 bench] RL step " << step << ": FP8 delta " << s.fp8_delta << " B ("
             << Fixed(Percent(s.fp8_delta, r.fp8_bytes), 3) << "% of FP8), BF16 delta "
             << s.bf16_delta << " B\n"
             << std::flush;
    previous = std::move(next);
    ++version;
  }
  return Status::Ok();
}

// The k3 rows: the trainer above (FP8 and BF16 served) and a QAT trainer from the same SFT
// state given the same RL steps.
Status MeasureGaps(TrainingClient& plain, const trainer::TrainerOptions& options,
                   const Fp8BenchOptions& o, const std::string& state_dir, RunResult& r,
                   std::ostream& progress) {
  FW_ASSIGN_OR_RETURN(Served served, Serve(plain, static_cast<uint64_t>(o.rl_steps) + 2));
  FW_ASSIGN_OR_RETURN(auto fp8_sampler, Sampler(options, served.fp8, true));
  FW_ASSIGN_OR_RETURN(auto bf16_sampler, Sampler(options, served.bf16, false));
  trainer::TrainerOptions qat_options = options;
  qat_options.fp8_qat = true;
  FW_ASSIGN_OR_RETURN(auto qat, TrainingClient::Create(qat_options));
  FW_RETURN_IF_ERROR(qat->LoadState(state_dir));
  for (int step = 1; step <= o.rl_steps; ++step) FW_RETURN_IF_ERROR(RlStep(*qat, o, step));
  progress << "[fp8 bench] QAT trainer: " << o.rl_steps << " RL steps from the SFT state\n";
  FW_ASSIGN_OR_RETURN(Served qat_served, Serve(*qat, 1));
  FW_ASSIGN_OR_RETURN(auto qat_sampler, Sampler(qat_options, qat_served.fp8, true));
  FW_ASSIGN_OR_RETURN(Gap fp8,
                      MeasureGap("FP8 served, trainer without QAT", plain, *fp8_sampler, o));
  FW_ASSIGN_OR_RETURN(Gap with_qat,
                      MeasureGap("FP8 served, trainer with QAT", *qat, *qat_sampler, o));
  FW_ASSIGN_OR_RETURN(Gap bf16,
                      MeasureGap("BF16 served, trainer without QAT", plain, *bf16_sampler, o));
  r.gaps = {fp8, with_qat, bf16};
  return Status::Ok();
}

// ---- tables -------------------------------------------------------------------------------

std::string Share(uint64_t part, uint64_t whole, int digits = 4) {
  return Fixed(Percent(static_cast<double>(part), static_cast<double>(whole)), digits) + "%";
}

Table WordsTable(const RunResult& r) {
  Table t;
  t.header = {"RL step",
              "FP8: words changed",
              "F8 bytes changed",
              "scale words changed",
              "BF16: words changed",
              "FP8 / BF16 share"};
  for (const StepResult& s : r.steps) {
    const double fp8 = Percent(s.fp8.changed, s.fp8.words),
                 bf16 = Percent(s.bf16.changed, s.bf16.words);
    t.rows.push_back({std::to_string(s.step), Share(s.fp8.changed, s.fp8.words),
                      Share(s.fp8.f8_changed, s.fp8.f8_bytes),
                      Grouped(s.fp8.scale_changed) + " / " + Grouped(s.fp8.scale_words),
                      Share(s.bf16.changed, s.bf16.words),
                      Fixed(bf16 > 0 ? fp8 / bf16 : NAN, 3) + "x"});
  }
  return t;
}

std::string PeerCell(const std::optional<uint64_t>& bytes) {
  return bytes ? Grouped(*bytes) : "-";
}

Table DeltaTable(const RunResult& r) {
  Table t;
  t.header = {"RL step",           "FP8 delta B",         "% of FP8 ckpt",    "% of BF16 ckpt",
              "zstd -19 of XOR B", "flywheel / zstd -19", "zstd -3 of XOR B", "BF16 delta B",
              "% of BF16 ckpt",    "FP8 / BF16 delta",    "goal <= 1.5%",     "result"};
  for (const StepResult& s : r.steps) {
    const double percent = Percent(s.fp8_delta, r.fp8_bytes);
    t.rows.push_back(
        {std::to_string(s.step), Grouped(s.fp8_delta), Fixed(percent, 3) + "%",
         Share(s.fp8_delta, r.bf16_bytes, 3), PeerCell(s.zstd19),
         s.zstd19 ? Fixed(static_cast<double>(s.fp8_delta) / *s.zstd19, 3) + "x" : "-",
         PeerCell(s.zstd3), Grouped(s.bf16_delta), Share(s.bf16_delta, r.bf16_bytes, 3),
         Fixed(static_cast<double>(s.fp8_delta) / s.bf16_delta, 3) + "x",
         Fixed(percent / kDeltaGoalPercent, 3) + "x", PassFail(percent <= kDeltaGoalPercent)});
  }
  t.rows.push_back({"full checkpoint", Grouped(r.fp8_bytes), "100%",
                    Share(r.fp8_bytes, r.bf16_bytes, 1), "-", "-", "-", Grouped(r.bf16_bytes),
                    "100%", "-", "-", "-"});
  return t;
}

struct FloorBits {
  // Bits per changed F8 byte.
  double positions = 0, values = 0;
  double tensor_positions = 0, tensor_values = 0, xor_values = 0, rice = 0;  // diagnostics
  double total() const { return positions + values; }
};

FloorBits Floor(const Changes& c) {
  FloorBits f;
  if (c.f8_changed == 0) return f;
  const double n = static_cast<double>(c.f8_bytes), m = static_cast<double>(c.f8_changed);
  f.positions = n * H2(m / n) / m;
  f.values = Entropy(c.difference, c.f8_changed);
  f.tensor_positions = c.tensor_position_bits / m;
  f.xor_values = Entropy(c.exclusive_or, c.f8_changed);
  f.tensor_values = c.tensor_value_bits / m;
  f.rice = static_cast<double>(c.rice_bits) / m;
  return f;
}

Table CodecTable(const RunResult& r) {
  Table t;
  t.header = {"RL step",
              "changed F8 bytes",
              "F8 payload B (% of delta)",
              "flywheel bits/changed",
              "floor: positions",
              "floor: values (diff)",
              "floor total",
              "flywheel / floor",
              "target <= 1.05x",
              "result",
              "F8 chunks sparse/dense/zstd",
              "kinds 0..2 (before context coding) bits/changed",
              "context-coded / kinds 0..2",
              "target <= 0.75x (issue 33)",
              "result"};
  for (const StepResult& s : r.steps) {
    const FloorBits f = Floor(s.fp8);
    const double bits = s.fp8.f8_changed ? 8.0 * s.f8.payload_bytes / s.fp8.f8_changed : NAN;
    const double ratio = bits / f.total();
    const double plain_bits =
        s.fp8.f8_changed ? 8.0 * s.f8_plain.payload_bytes / s.fp8.f8_changed : NAN;
    const double to_plain = bits / plain_bits;
    t.rows.push_back(
        {std::to_string(s.step), Grouped(s.fp8.f8_changed),
         Grouped(s.f8.payload_bytes) + " (" + Share(s.f8.payload_bytes, s.fp8_delta, 1) + ")",
         Fixed(bits, 2), Fixed(f.positions, 2), Fixed(f.values, 2), Fixed(f.total(), 2),
         Fixed(ratio, 3) + "x", "<= 1.05x", PassFail(ratio <= kFloorTarget),
         std::to_string(s.f8.sparse) + "/" + std::to_string(s.f8.dense) + "/" +
             std::to_string(s.f8.compressed),
         Fixed(plain_bits, 2), Fixed(to_plain, 3) + "x", "<= 0.75x",
         PassFail(to_plain <= 0.75)});
  }
  return t;
}

Table GapTable(const RunResult& r) {
  Table t;
  t.header = {"sampler (what a worker serves)", "k3", "max abs(r)", "vs BF16", "target", "result"};
  const double bf16 = r.gaps.back().k3;
  for (size_t i = 0; i < r.gaps.size(); ++i) {
    const Gap& g = r.gaps[i];
    const bool qat = i == 1;
    char k3[32], max_abs[32];
    std::snprintf(k3, sizeof(k3), "%.3e", g.k3);
    std::snprintf(max_abs, sizeof(max_abs), "%.3e", g.max_abs);
    t.rows.push_back({g.label, k3, max_abs, Fixed(bf16 > 0 ? g.k3 / bf16 : NAN, 3) + "x",
                      qat ? "<= 2x BF16" : "-", qat ? PassFail(g.k3 <= kQatK3Target * bf16) : "-"});
  }
  return t;
}

std::string Describe(const RunResult& r, const Fp8BenchOptions& o) {
  const model::ModelConfig& c = r.config;
  const StepResult& last = r.steps.back();
  const double variable = Percent(static_cast<double>(last.fp8_delta) - r.fp8_fixed, r.fp8_bytes);
  return "Machine: " + std::to_string(std::thread::hardware_concurrency()) +
         " hardware threads. Model: dense qwen3, hidden " + std::to_string(c.hidden_size) + ", " +
         std::to_string(c.num_hidden_layers) + " layers, MLP " +
         std::to_string(c.intermediate_size) + ", vocab " + std::to_string(c.vocab_size) +
         "; FP8 blocks " + std::to_string(o.block) + ". " + std::to_string(o.sft_steps) +
         " SFT steps (lr 1e-3), then " + std::to_string(o.rl_steps) + " PPO steps at lr " +
         Fixed(o.rl_lr * 1e6, 2) + "e-6, batches of " + std::to_string(o.sequences) + " x " +
         std::to_string(o.sequence_length) + " tokens.\n" + "FP8 checkpoint " +
         Grouped(r.fp8_bytes) + " B in " + std::to_string(r.fp8_tensors) +
         " tensors: F8_E4M3 projection weights " + Grouped(r.f8_weight_bytes) + " B (" +
         Share(r.f8_weight_bytes, r.fp8_bytes, 1) + ", the linear-weight share), F32 scales " +
         Grouped(r.scale_bytes) + " B, the rest BF16. BF16 checkpoint " + Grouped(r.bf16_bytes) +
         " B in " + std::to_string(r.bf16_tensors) + " tensors.\n" +
         "Fixed bytes of a delta (a checkpoint against itself: manifest, hashes, chunk records): "
         "FP8 " +
         Grouped(r.fp8_fixed) + " B (" + Share(r.fp8_fixed, r.fp8_bytes, 3) + ", " +
         Fixed(static_cast<double>(r.fp8_fixed) / r.fp8_tensors, 0) + " B per tensor), BF16 " +
         Grouped(r.bf16_fixed) + " B (" +
         Fixed(static_cast<double>(r.bf16_fixed) / r.bf16_tensors, 0) +
         " B per tensor); the last FP8 delta without them: " + Fixed(variable, 3) +
         "% of the FP8 checkpoint. Seeds' figure: " + Fixed(kSeedsDeltaPercent, 2) +
         "% (Fireworks, 1 TiB FP8), goal <= " + Fixed(kDeltaGoalPercent, 1) + "%.\n";
}

std::string Notes(const RunResult& r) {
  const StepResult& last = r.steps.back();
  const FloorBits f = Floor(last.fp8);
  // The split into gaps and the rest holds for the plain sparse coding (kinds 0..2), whose
  // positions are the Rice gaps below; the context-coded chunks code positions otherwise.
  const double bits =
      last.fp8.f8_changed ? 8.0 * last.f8_plain.payload_bytes / last.fp8.f8_changed : 0;
  return "Deltas: delta::EncodeStreamed with sync::VersionLogOptions' defaults (as the publisher); "
         "every one applied and compared with the next checkpoint bit for bit. Bits per changed F8 "
         "byte count the stored payloads of the F8 tensors' chunks. Floor, as the codec bench "
         "computes it for bf16, here for 1-byte words: n·H2(p) for positions over all F8 bytes "
         "+ the empirical entropy of (target - base) mod 256, the value the codec codes "
         "(zigzagged, rANS). Where the bits go in the kinds 0..2 coding, last step, per "
         "changed F8 byte: the gaps "
         "Rice-coded as the codec does (best k per tensor) " +
         Fixed(f.rice, 2) + " bits against a position floor of " + Fixed(f.positions, 2) +
         " (per tensor " + Fixed(f.tensor_positions, 2) +
         "); the rest of the F8 payload (values, rANS tables, "
         "chunk headers) " +
         Fixed(bits - f.rice, 2) + " bits against a value floor of " + Fixed(f.values, 2) +
         " (per tensor " + Fixed(f.tensor_values, 2) +
         "; the entropy of target XOR base would be " + Fixed(f.xor_values, 2) + ").\n" +
         "k3 = mean of exp(r) - 1 - r, r = logp_trainer - logp_sampler, over " +
         std::to_string(r.gaps.front().tokens) +
         " tokens sampled from the sampler (teacher-forced held-out contexts); the QAT trainer "
         "starts from the same SFT state and takes the same RL steps. " +
         (r.peers_skipped.empty() ? "" : r.peers_skipped + ". ") + "Run time " +
         Fixed(r.seconds, 1) + " s.\n";
}

Status Report(const RunResult& r, const Fp8BenchOptions& o, std::ostream& out) {
  const std::string head = Describe(r, o), notes = Notes(r);
  out << "\nFP8 benchmark: FP8 vs BF16 serving of the same masters\n\n"
      << head << "\nServed words changed per RL step:\n"
      << RenderText(WordsTable(r))
      << "\nDelta bytes per RL step (peers: zstd of the XOR of the two FP8 checkpoints):\n"
      << RenderText(DeltaTable(r)) << "\nBits per changed F8 byte (F8 chunks of the FP8 delta):\n"
      << RenderText(CodecTable(r)) << "\nk3, sampler vs trainer, after the RL steps:\n"
      << RenderText(GapTable(r)) << "\n"
      << notes;
  if (o.markdown_out.empty()) return Status::Ok();
  // One paragraph per line in Markdown.
  auto paragraphs = [](std::string text) {
    for (size_t at = text.find('\n'); at != std::string::npos && at + 1 < text.size();
         at = text.find('\n', at + 2))
      text.insert(at, "\n");
    return text;
  };
  const std::string section =
      "## FP8 benchmark\n\n`flywheel bench fp8`: FP8 vs BF16 serving of the same fp32 masters, "
      "one run.\n\n" +
      paragraphs(head) + "\nServed words changed per RL step:\n\n" + RenderMarkdown(WordsTable(r)) +
      "\nDelta bytes per RL step (peers: zstd of the XOR of the two FP8 checkpoints):\n\n" +
      RenderMarkdown(DeltaTable(r)) + "\nBits per changed F8 byte:\n\n" +
      RenderMarkdown(CodecTable(r)) + "\nk3, sampler vs trainer:\n\n" +
      RenderMarkdown(GapTable(r)) + "\n" + paragraphs(notes);
  return WriteMarkdownSection(o.markdown_out, "## FP8 benchmark", section);
}

}  // namespace

Fp8BenchOptions Fp8BenchOptions::Small() {
  Fp8BenchOptions o;
  o.hidden = 256;
  o.layers = 2;
  o.sft_steps = 8;
  o.rl_steps = 2;
  o.sequence_length = 32;
  return o;
}

Status RunFp8Bench(const Fp8BenchOptions& options, std::ostream& out) {
  FW_RETURN_IF_ERROR(CheckOptions(options));
  const Clock::time_point start = Clock::now();
  ScopedWorkDir work;
  FW_RETURN_IF_ERROR(work.Prepare("", "fw-fp8-bench", false));
  const std::string state_dir = (fs::path(work.path()) / "sft_state").string();
  RunResult r;
  r.config = BenchConfig(options);
  const trainer::TrainerOptions trainer_options{.config = r.config,
                                                .seed = options.seed,
                                                .fp8_serving = true,
                                                .fp8_block = options.block,
                                                .threads = options.threads};
  FW_ASSIGN_OR_RETURN(auto client, TrainingClient::Create(trainer_options));
  out << "[fp8 bench] " << client->parameter_count() << " parameters\n" << std::flush;
  FW_RETURN_IF_ERROR(MeasureDeltas(*client, options, work.path(), state_dir, r, out));
  FW_RETURN_IF_ERROR(MeasureGaps(*client, trainer_options, options, state_dir, r, out));
  r.seconds = SecondsSince(start);
  return Report(r, options, out);
}

}  // namespace flywheel::bench
