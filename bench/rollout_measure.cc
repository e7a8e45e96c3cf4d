#include "bench/rollout_measure.h"

#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "delta/delta.h"
#include "rollout/engine.h"
#include "rollout/mirror.h"
#include "model/weights.h"

namespace flywheel::rollout {

namespace {

using Clock = std::chrono::steady_clock;

uint64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

std::vector<GenerationRequest> Requests(int64_t batch, const RolloutBenchOptions& o, int64_t vocab,
                                        uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<GenerationRequest> out;
  for (int64_t i = 0; i < batch; ++i) {
    GenerationRequest r;
    for (int64_t t = 0; t < o.prompt_tokens; ++t)
      r.prompt.push_back(static_cast<int32_t>(rng() % vocab));
    r.params.max_tokens = o.new_tokens;
    r.params.temperature = 1.0;
    r.params.seed = seed + i;
    out.push_back(std::move(r));
  }
  return out;
}

// The next version's serving copy: `fraction` of the bf16 words moved by one ulp, as small
// RL steps do.
OwnedCheckpoint NextVersion(const OwnedCheckpoint& current, double fraction, std::mt19937_64& rng) {
  OwnedCheckpoint next = current;
  std::bernoulli_distribution flip(fraction);
  for (OwnedTensor& t : next.tensors) {
    const size_t words = t.data.size() / 2;
    for (size_t i = 0; i < words; ++i) {
      if (!flip(rng)) continue;
      uint16_t bits;
      std::memcpy(&bits, t.data.data() + 2 * i, 2);
      bits = static_cast<uint16_t>(bits + ((rng() & 1) ? 1 : -1));
      std::memcpy(t.data.data() + 2 * i, &bits, 2);
    }
  }
  return next;
}

Status CheckOptions(const RolloutBenchOptions& options) {
  if (options.batches.empty() || options.prompt_tokens < 1 || options.new_tokens < 1 ||
      options.swaps < 1 || !(options.changed_fraction > 0 && options.changed_fraction < 1) ||
      options.threads < 0) {
    return Status::InvalidArgument(
        "bench rollout: batches, prompt and new tokens, swaps must be >= 1 and the "
        "changed fraction in (0, 1)");
  }
  for (int64_t b : options.batches) {
    if (b < 1 || b > 1024)
      return Status::InvalidArgument("bench rollout: batch sizes must be in [1, 1024]");
  }
  return Status::Ok();
}

// A freshly initialised model's weights as the serving copy (seeded by options.seed).
Result<OwnedCheckpoint> ServingCopy(const model::ModelConfig& config, DType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  model::TransformerImpl trained(config);
  return model::SnapshotWeights(trained, dtype);
}

// Tokens per second at every batch size (after a one-request warm-up).
Status MeasureThroughput(Engine& engine, const RolloutBenchOptions& options,
                         const std::string& name, int64_t vocab, RolloutBenchResult& result,
                         std::ostream& progress) {
  FW_RETURN_IF_ERROR(engine.Generate(Requests(1, options, vocab, 7)).status());  // warm-up
  for (int64_t batch : options.batches) {
    auto start = Clock::now();
    FW_ASSIGN_OR_RETURN(auto out, engine.Generate(Requests(batch, options, vocab, 100 + batch)));
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    int64_t tokens = 0;
    for (const auto& r : out) tokens += static_cast<int64_t>(r.tokens.size());
    result.throughput.push_back({name, batch, tokens, seconds});
    progress << "[rollout bench] " << name << " batch " << batch << ": " << tokens << " tokens in "
             << seconds << " s\n"
             << std::flush;
  }
  return Status::Ok();
}

// Swaps with requests in flight: a real delta applied to the serving copy with its changed
// words reported, the mirror patched between two decode steps.
Status MeasureSwaps(Engine& engine, model::TransformerImpl& mirror, OwnedCheckpoint& serving,
                    const RolloutBenchOptions& options, int64_t max_batch, int64_t vocab,
                    RolloutModelRow& row, std::ostream& progress) {
  std::mt19937_64 rng(options.seed + 99);
  for (const auto& r : Requests(std::min<int64_t>(8, max_batch), options, vocab, 5)) {
    FW_RETURN_IF_ERROR(engine.Submit(r).status());
  }
  engine.Step();
  for (int s = 0; s < options.swaps; ++s) {
    OwnedCheckpoint next = NextVersion(serving, options.changed_fraction, rng);
    delta::EncodeOptions encode;
    encode.base_version = 1 + s;
    encode.target_version = 2 + s;
    FW_ASSIGN_OR_RETURN(auto bytes, delta::Encode(serving.view(), next.view(), encode));
    FW_ASSIGN_OR_RETURN(delta::DeltaView view, delta::DeltaView::Parse(bytes));
    delta::ApplyOptions apply;
    apply.report_changes = true;
    MutableCheckpointView state = serving.mutable_view();
    FW_ASSIGN_OR_RETURN(delta::ApplyStats stats, delta::ApplyInPlace(state, view, apply));
    const CheckpointView weights = serving.view();
    uint64_t patched = 0;
    FW_RETURN_IF_ERROR(engine.Swap(2 + s, [&]() -> Status {
      FW_ASSIGN_OR_RETURN(MirrorStats m, PatchMirror(mirror, weights, stats.changes));
      patched = m.words_patched;
      return Status::Ok();
    }));
    row.swap_pause_ms.push_back(engine.last_swap_pause_ms());
    row.words_patched_per_swap = patched;
    engine.Step();  // the requests in flight go on
    progress << "[rollout bench] " << row.model << " swap " << s + 1 << ": " << patched
             << " words, pause " << engine.last_swap_pause_ms() << " ms\n"
             << std::flush;
  }
  return Status::Ok();
}

// The mirror must equal the served weights after the swaps.
Status CheckMirror(const model::ModelConfig& config, model::TransformerImpl& mirror,
                   const OwnedCheckpoint& serving) {
  auto check = std::make_shared<model::TransformerImpl>(config);
  FW_RETURN_IF_ERROR(LoadMirror(*check, serving.view()));
  auto want = check->named_parameters();
  for (const auto& p : mirror.named_parameters()) {
    if (!torch::equal(p.value(), want[p.key()])) {
      return Status::Internal(
          "bench rollout: the patched mirror differs from the served weights at " + p.key());
    }
  }
  return Status::Ok();
}

// bf16 serving with the engine's fp32 mirror: memory, throughput, swaps in flight.
Result<RolloutModelRow> MeasureMirrored(const std::string& name, const model::ModelConfig& config,
                                        const RolloutBenchOptions& options, int64_t max_batch,
                                        RolloutBenchResult& result, std::ostream& progress) {
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint serving, ServingCopy(config, DType::kBF16, options.seed));
  ::malloc_trim(0);  // what the generating model freed goes back before measuring
  const uint64_t rss_before = ResidentBytes();
  auto mirror = std::make_shared<model::TransformerImpl>(config);
  FW_RETURN_IF_ERROR(LoadMirror(*mirror, serving.view()));
  const EngineOptions engine_options{.max_batch = max_batch,
                                     .max_sequence = options.prompt_tokens + options.new_tokens};
  FW_ASSIGN_OR_RETURN(auto engine, Engine::Create(mirror, engine_options, 1));
  RolloutModelRow row;
  row.model = name;
  for (const auto& p : mirror->parameters()) {
    row.parameters += p.numel();
    row.mirror_bytes += p.numel() * 4;
  }
  for (const auto& t : serving.tensors) row.serving_bytes += t.data.size();
  row.kv_cache_bytes = engine->cache_bytes();
  FW_RETURN_IF_ERROR(
      MeasureThroughput(*engine, options, name, config.vocab_size, result, progress));
  // The engine side after serving the largest batch: mirror, KV cache, activations, torch.
  ::malloc_trim(0);
  const uint64_t rss_after = ResidentBytes();
  row.rss_growth_bytes = rss_after > rss_before ? rss_after - rss_before : 0;
  FW_RETURN_IF_ERROR(MeasureSwaps(*engine, *mirror, serving, options, max_batch, config.vocab_size,
                                  row, progress));
  FW_RETURN_IF_ERROR(CheckMirror(config, *mirror, serving));
  while (engine->active() + engine->waiting() > 0) engine->Step();
  return row;
}

// fp32 serving without a mirror: the model's parameters are views of the F32 serving copy.
Result<RolloutModelRow> MeasureAliased(const std::string& name, const model::ModelConfig& config,
                                       const RolloutBenchOptions& options, int64_t max_batch,
                                       std::ostream& progress) {
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint serving, ServingCopy(config, DType::kF32, options.seed));
  ::malloc_trim(0);
  const uint64_t rss_before = ResidentBytes();
  auto model = std::make_shared<model::TransformerImpl>(config);
  FW_RETURN_IF_ERROR(AliasWeights(*model, serving.view()));
  ::malloc_trim(0);  // the parameters' own storage, replaced by the views, goes back
  const EngineOptions engine_options{.max_batch = max_batch,
                                     .max_sequence = options.prompt_tokens + options.new_tokens};
  FW_ASSIGN_OR_RETURN(auto engine, Engine::Create(model, engine_options, 1));
  RolloutModelRow row;
  row.model = name;
  row.serving = "fp32, no mirror";
  for (const auto& p : model->parameters()) row.parameters += p.numel();
  for (const auto& t : serving.tensors) row.serving_bytes += t.data.size();
  row.kv_cache_bytes = engine->cache_bytes();
  FW_RETURN_IF_ERROR(
      engine->Generate(Requests(max_batch, options, config.vocab_size, 100 + max_batch)).status());
  ::malloc_trim(0);
  const uint64_t rss_after = ResidentBytes();
  row.rss_growth_bytes = rss_after > rss_before ? rss_after - rss_before : 0;
  // The views must be the serving copy itself, tensor by tensor.
  std::map<std::string, const void*> served;
  for (const auto& t : serving.tensors) served[t.name] = t.data.data();
  for (const auto& p : model->named_parameters()) {
    if (served[p.key()] != p.value().data_ptr()) {
      return Status::Internal("bench rollout: fp32 serving copied " + p.key() +
                              " instead of viewing the served tensor");
    }
  }
  progress << "[rollout bench] " << name << " fp32 serving without a mirror: RSS +"
           << row.rss_growth_bytes / 1e6 << " MB\n"
           << std::flush;
  return row;
}

}  // namespace

Result<RolloutBenchResult> RunRolloutBench(const RolloutBenchOptions& options,
                                           std::ostream& progress) {
  FW_RETURN_IF_ERROR(CheckOptions(options));
  torch::set_num_threads(options.threads > 0
                             ? options.threads
                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  torch::NoGradGuard no_grad;
  RolloutBenchResult result;
  result.threads = torch::get_num_threads();
  std::vector<std::pair<std::string, model::ModelConfig>> models = {
      {"dense", model::DemoDenseConfig()}};
  if (options.moe) models.emplace_back("moe", model::DemoMoeConfig());
  const int64_t max_batch = *std::max_element(options.batches.begin(), options.batches.end());
  for (const auto& [name, config] : models) {
    FW_ASSIGN_OR_RETURN(RolloutModelRow row,
                        MeasureMirrored(name, config, options, max_batch, result, progress));
    result.models.push_back(std::move(row));
  }
  for (const auto& [name, config] : models) {
    FW_ASSIGN_OR_RETURN(RolloutModelRow row,
                        MeasureAliased(name, config, options, max_batch, progress));
    result.models.push_back(std::move(row));
  }
  return result;
}

}  // namespace flywheel::rollout
