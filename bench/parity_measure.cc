#include "bench/parity_measure.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <thread>

#include "checkpoint/safetensors.h"
#include "rollout/engine.h"
#include "rollout/mirror.h"
#include "trainer/training_client.h"
#include "model/weights.h"

namespace flywheel::rollout {

namespace {

std::vector<trainer::Datum> SftData(int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<trainer::Datum> out(8);
  for (auto& d : out) {
    const int period = 3 + static_cast<int>(rng() % 7);
    std::vector<int32_t> pattern(period);
    for (auto& t : pattern) t = static_cast<int32_t>(rng() % vocab);
    for (int t = 0; t < 96; ++t) {
      d.tokens.push_back(pattern[t % period]);
      d.target_tokens.push_back(pattern[(t + 1) % period]);
    }
  }
  return out;
}

struct Comparison {
  double k3 = 0, max_diff = 0;
  int64_t tokens = 0;
};

Comparison Compare(const std::vector<GenerationResult>& sampled,
                   const trainer::ForwardOutput& recomputed) {
  Comparison c;
  for (size_t i = 0; i < sampled.size(); ++i) {
    const size_t offset = sampled[i].prompt.size() - 1;
    for (size_t t = 0; t < sampled[i].tokens.size(); ++t) {
      const double delta =
          static_cast<double>(sampled[i].logprobs[t]) - recomputed.logprobs[i][offset + t];
      c.k3 +=
          std::exp(delta) - delta - 1;  // k3 of the sampler's distribution against the trainer's
      c.max_diff = std::max(c.max_diff, std::abs(delta));
      ++c.tokens;
    }
  }
  c.k3 /= std::max<int64_t>(c.tokens, 1);
  return c;
}

// The fraction of MoE layer-token routings (top-k sets) on which engine and trainer agree;
// -1 when there were none.
double RoutingAgreement(const std::vector<GenerationResult>& sampled,
                        const trainer::ForwardOutput& free_run, int64_t k) {
  int64_t same = 0, total = 0;
  for (size_t i = 0; i < sampled.size(); ++i) {
    const auto& engine_routing = sampled[i].routing;
    const auto& trainer_routing = free_run.routing[i];
    for (size_t group = 0; group + k <= engine_routing.size(); group += k) {
      std::vector<int32_t> a(engine_routing.begin() + group, engine_routing.begin() + group + k);
      std::vector<int32_t> b(trainer_routing.begin() + group, trainer_routing.begin() + group + k);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      same += a == b;
      ++total;
    }
  }
  return total ? static_cast<double>(same) / total : -1;
}

// The engine on the served bf16 weights (its exact fp32 mirror) samples continuations of
// prompts cut from the SFT data.
Result<std::vector<GenerationResult>> SampleServed(const ParityBenchOptions& options,
                                                   const model::ModelConfig& config,
                                                   const trainer::SamplerSnapshot& served,
                                                   const std::vector<trainer::Datum>& data) {
  auto mirror = std::make_shared<model::TransformerImpl>(config);
  FW_RETURN_IF_ERROR(LoadMirror(*mirror, served.checkpoint.view()));
  FW_ASSIGN_OR_RETURN(auto engine,
                      Engine::Create(mirror,
                                     {.max_batch = options.requests,
                                      .max_sequence = options.prompt_tokens + options.new_tokens},
                                     1));
  std::vector<GenerationRequest> requests;
  for (int64_t i = 0; i < options.requests; ++i) {
    GenerationRequest r;
    const auto& source = data[i % data.size()].tokens;
    r.prompt.assign(source.begin() + i % 5, source.begin() + i % 5 + options.prompt_tokens);
    r.params.max_tokens = options.new_tokens;
    r.params.temperature = 1.0;
    r.params.seed = options.seed + 100 + i;
    r.params.return_routing = config.num_experts > 0;
    requests.push_back(std::move(r));
  }
  return engine->Generate(requests);
}

// The trainer's datums for the sampled sequences (prompt and completion, shifted targets).
std::vector<trainer::Datum> DatumsOf(const std::vector<GenerationResult>& sampled) {
  std::vector<trainer::Datum> datums;
  for (const auto& r : sampled) {
    trainer::Datum d;
    d.tokens = r.prompt;
    d.tokens.insert(d.tokens.end(), r.tokens.begin(), r.tokens.end() - 1);
    d.target_tokens.assign(r.prompt.begin() + 1, r.prompt.end());
    d.target_tokens.insert(d.target_tokens.end(), r.tokens.begin(), r.tokens.end());
    datums.push_back(std::move(d));
  }
  return datums;
}

// One model: SFT the masters, serve their bf16 snapshot, sample, and compare the sampler's
// logprobs with the trainer's on the served weights (with routing replay for MoE) and on
// the fp32 masters.
Status MeasureModel(const ParityBenchOptions& options, const std::string& name,
                    const model::ModelConfig& config, const std::string& dir,
                    std::vector<ParityRow>& rows, std::ostream& progress) {
  FW_ASSIGN_OR_RETURN(auto masters,
                      trainer::TrainingClient::Create({.config = config, .seed = options.seed}));
  const auto data = SftData(config.vocab_size, options.seed + 1);
  for (int step = 0; step < options.sft_steps; ++step) {
    FW_RETURN_IF_ERROR(masters->ForwardBackward(data, "cross_entropy").status());
    FW_RETURN_IF_ERROR(masters->OptimStep({.lr = 1e-3}).status());
  }
  progress << "[parity bench] " << name << ": " << options.sft_steps << " SFT steps done\n"
           << std::flush;
  FW_ASSIGN_OR_RETURN(trainer::SamplerSnapshot served, masters->SaveWeightsForSampler(1));
  const std::string served_file = dir + "/" + name + ".safetensors";
  FW_RETURN_IF_ERROR(WriteSafetensors(served_file, served.checkpoint.view(), {}));
  FW_ASSIGN_OR_RETURN(auto sampled, SampleServed(options, config, served, data));
  std::vector<trainer::Datum> datums = DatumsOf(sampled);
  FW_ASSIGN_OR_RETURN(auto on_served, trainer::TrainingClient::Create(
                                          {.config = config, .init_weights = served_file}));
  FW_ASSIGN_OR_RETURN(trainer::ForwardOutput free_run, on_served->Forward(datums));
  Comparison plain = Compare(sampled, free_run);
  ParityRow row{name, "served weights", plain.tokens, plain.k3, plain.max_diff};
  if (config.num_experts > 0) {
    row.routing_agreement = RoutingAgreement(sampled, free_run, config.num_experts_per_tok);
  }
  rows.push_back(row);
  if (config.num_experts > 0) {
    for (size_t i = 0; i < datums.size(); ++i)
      datums[i].routing.assign(sampled[i].routing.begin(), sampled[i].routing.end());
    FW_ASSIGN_OR_RETURN(trainer::ForwardOutput replayed, on_served->Forward(datums));
    Comparison with_replay = Compare(sampled, replayed);
    rows.push_back({name, "served weights + routing replay", with_replay.tokens, with_replay.k3,
                    with_replay.max_diff});
  }
  FW_ASSIGN_OR_RETURN(trainer::ForwardOutput on_masters, masters->Forward(datums));
  Comparison master = Compare(sampled, on_masters);
  rows.push_back(
      {name, "fp32 masters (policy mismatch)", master.tokens, master.k3, master.max_diff});
  progress << "[parity bench] " << name << ": compared " << plain.tokens << " tokens\n"
           << std::flush;
  return Status::Ok();
}

}  // namespace

Result<std::vector<ParityRow>> RunParityBench(const ParityBenchOptions& options,
                                              std::ostream& progress) {
  if (options.requests < 1 || options.prompt_tokens < 1 || options.new_tokens < 1 ||
      options.sft_steps < 0) {
    return Status::InvalidArgument("bench parity: requests, prompt and new tokens must be >= 1");
  }
  torch::set_num_threads(options.threads > 0
                             ? options.threads
                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  std::vector<ParityRow> rows;
  std::vector<std::pair<std::string, model::ModelConfig>> models = {
      {"dense", model::DemoDenseConfig()}};
  if (options.moe) models.emplace_back("moe", model::DemoMoeConfig());
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("flywheel_parity_" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(dir);
  Status status;
  for (const auto& [name, config] : models) {
    status = MeasureModel(options, name, config, dir, rows, progress);
    if (!status.ok()) break;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  FW_RETURN_IF_ERROR(status);
  return rows;
}

}  // namespace flywheel::rollout
