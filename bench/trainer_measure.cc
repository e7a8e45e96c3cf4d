#include "bench/trainer_measure.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "bench/pattern_batch.h"
#include "trainer/training_client.h"

namespace flywheel::trainer {

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// What one call cost: wall time, CPU time of all the process's threads (less sensitive to
// other processes on a shared machine than wall time), and minor page faults (fresh pages
// the allocator had returned to the kernel).
struct Cost {
  double wall = 0, cpu = 0;
  int64_t faults = 0;
  double loss = 0;
};

class CostMeter {
 public:
  CostMeter() : start_(Clock::now()), cpu_(CpuSeconds()), faults_(Faults()) {}
  Cost Stop(double loss) const {
    return {Seconds(start_), CpuSeconds() - cpu_, Faults() - faults_, loss};
  }

 private:
  static double CpuSeconds() {
    timespec t{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  }
  static int64_t Faults() {
    rusage usage{};
    ::getrusage(RUSAGE_SELF, &usage);
    return usage.ru_minflt;
  }
  Clock::time_point start_;
  double cpu_;
  int64_t faults_;
};

// bench::PatternBatch with, as in RL batches, a prompt (the first quarter) that carries no loss.
std::vector<Datum> MakeBatch(int sequences, int length, int64_t vocab, uint64_t seed) {
  std::vector<Datum> out = bench::PatternBatch(sequences, length, vocab, seed);
  for (Datum& d : out) {
    d.weights.assign(length, 1.0f);
    std::fill(d.weights.begin(), d.weights.begin() + length / 4, 0.0f);
  }
  return out;
}

// Sampling logprobs = the model's own (plus sampler noise), group-style advantages.
Status AddRlFields(TrainingClient& client, std::vector<Datum>& datums, uint64_t seed) {
  FW_ASSIGN_OR_RETURN(ForwardOutput forward, client.Forward(datums));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0, 0.02f);
  for (size_t i = 0; i < datums.size(); ++i) {
    datums[i].logprobs = forward.logprobs[i];
    for (float& lp : datums[i].logprobs) lp += noise(rng);
    datums[i].advantages.assign(datums[i].tokens.size(),
                                (i % 2 ? 1.0f : -1.0f) * (1 + 0.1f * (i % 3)));
  }
  return Status::Ok();
}

// PPO written the way a user writes it for forward_backward_custom: per datum, in torch.
Result<torch::Tensor> UserPpo(const std::vector<Datum>& datums,
                              const std::vector<torch::Tensor>& logprobs, double clip_low,
                              double clip_high) {
  torch::Tensor total = torch::zeros({});
  double tokens = 0;
  for (size_t i = 0; i < datums.size(); ++i) {
    torch::Tensor sampling = torch::tensor(datums[i].logprobs);
    torch::Tensor adv = torch::tensor(datums[i].advantages);
    torch::Tensor ratio = (logprobs[i] - sampling).exp();
    torch::Tensor weights = torch::tensor(datums[i].weights);
    torch::Tensor loss = torch::max(-ratio * adv, -ratio.clamp(1 - clip_low, 1 + clip_high) * adv);
    total = total + (loss * weights).sum();
    tokens += weights.sum().item<double>();
  }
  return total / tokens;
}

int64_t CountParameters(TrainingClient& client) {
  int64_t n = 0;
  for (const auto& p : client.model().parameters()) n += p.numel();
  return n;
}

Result<ThroughputRow> Throughput(const std::string& name, const model::ModelConfig& config,
                                 const TrainerBenchOptions& options, std::ostream& progress) {
  FW_ASSIGN_OR_RETURN(FusedVsCustomTiming timing,
                      MeasureFusedVsCustom(config,
                                           {.sequences = options.sequences,
                                            .sequence_length = options.sequence_length,
                                            .warmup = options.warmup,
                                            .repetitions = options.repetitions,
                                            .seed = options.seed,
                                            .threads = options.threads},
                                           name, &progress));
  ThroughputRow row;
  row.model = name;
  row.parameters = timing.parameters;
  row.tokens = timing.tokens;
  row.fused = Summarize(timing.fused);
  row.custom = Summarize(timing.custom);
  row.forward = Summarize(timing.forward);
  row.pair_ratio = timing.MedianPairRatio();
  row.warmup_fused = timing.warmup_fused;
  row.warmup_custom = timing.warmup_custom;
  row.loss_difference = timing.loss_difference;
  return row;
}

int64_t CountChanged(const OwnedCheckpoint& a, const OwnedCheckpoint& b, int64_t& elements) {
  int64_t changed = 0;
  elements = 0;
  for (size_t t = 0; t < a.tensors.size(); ++t) {
    const auto& x = a.tensors[t].data;
    const auto& y = b.tensors[t].data;
    const size_t words = x.size() / 2;
    for (size_t i = 0; i < words; ++i) {
      uint16_t u, v;
      std::memcpy(&u, x.data() + 2 * i, 2);
      std::memcpy(&v, y.data() + 2 * i, 2);
      changed += u != v;
    }
    elements += static_cast<int64_t>(words);
  }
  return changed;
}

Result<std::vector<SparsityRow>> Sparsity(const TrainerBenchOptions& options,
                                          std::ostream& progress) {
  const model::ModelConfig config = model::DemoDenseConfig();
  FW_ASSIGN_OR_RETURN(auto client,
                      TrainingClient::Create(
                          {.config = config, .seed = options.seed, .threads = options.threads}));
  // Shorter sequences for the many pretraining steps.
  auto sft = MakeBatch(options.sequences, std::min(options.sequence_length, 128), config.vocab_size,
                       options.seed + 3);
  double loss = 0;
  for (int step = 0; step < options.pretrain_steps; ++step) {
    FW_ASSIGN_OR_RETURN(Metrics m, client->ForwardBackward(sft, "cross_entropy"));
    loss = m.loss;
    FW_RETURN_IF_ERROR(client->OptimStep({.lr = options.pretrain_lr}).status());
    if ((step + 1) % 10 == 0 || step + 1 == options.pretrain_steps) {
      progress << "[trainer bench] sparsity: SFT step " << step + 1 << "/" << options.pretrain_steps
               << " loss " << loss << "\n"
               << std::flush;
    }
  }
  const std::string state = (std::filesystem::temp_directory_path() /
                             ("flywheel_trainer_bench_" + std::to_string(::getpid())))
                                .string();
  FW_RETURN_IF_ERROR(client->SaveState(state));
  auto rl = MakeBatch(options.sequences, std::min(options.sequence_length, 128), config.vocab_size,
                      options.seed + 4);
  std::vector<SparsityRow> rows;
  uint64_t version = 0;
  for (double lr : options.learning_rates) {
    FW_RETURN_IF_ERROR(client->LoadState(state));
    FW_ASSIGN_OR_RETURN(SamplerSnapshot previous, client->SaveWeightsForSampler(++version));
    for (int step = 1; step <= options.rl_steps; ++step) {
      auto batch = rl;
      FW_RETURN_IF_ERROR(AddRlFields(*client, batch, options.seed + 10 + step));
      FW_RETURN_IF_ERROR(
          client->ForwardBackward(batch, "ppo", {.clip_low = 0.2, .clip_high = 0.28}).status());
      FW_RETURN_IF_ERROR(client->OptimStep({.lr = lr}).status());
      FW_ASSIGN_OR_RETURN(SamplerSnapshot next, client->SaveWeightsForSampler(++version));
      SparsityRow row{.learning_rate = lr, .step = step};
      row.changed = CountChanged(previous.checkpoint, next.checkpoint, row.elements);
      progress << "[trainer bench] sparsity: lr " << lr << " step " << step << ": "
               << 100.0 * static_cast<double>(row.changed) / static_cast<double>(row.elements)
               << "% changed\n"
               << std::flush;
      rows.push_back(row);
      previous = std::move(next);
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(state, ec);
  return rows;
}

double MedianRatio(const std::vector<double>& numerators, const std::vector<double>& denominators) {
  std::vector<double> ratios;
  for (size_t i = 0; i < numerators.size() && i < denominators.size(); ++i) {
    if (denominators[i] > 0) ratios.push_back(numerators[i] / denominators[i]);
  }
  return Summarize(ratios).median;
}

}  // namespace

double FusedVsCustomTiming::MedianPairRatio() const { return MedianRatio(custom, fused); }
double FusedVsCustomTiming::MedianPairCpuRatio() const {
  return MedianRatio(custom_cpu, fused_cpu);
}

Result<FusedVsCustomTiming> MeasureFusedVsCustom(const model::ModelConfig& config,
                                                 const FusedVsCustomOptions& options,
                                                 const std::string& name, std::ostream* progress) {
  if (options.sequences < 1 || options.sequence_length < 2 || options.repetitions < 1 ||
      options.warmup < 0) {
    return Status::InvalidArgument(
        "fused vs custom: sequences and repetitions must be >= 1, sequence length >= 2, "
        "warmup >= 0");
  }
  FW_ASSIGN_OR_RETURN(auto client, TrainingClient::Create({.config = config,
                                                            .seed = options.seed,
                                                            .threads = options.threads}));
  FusedVsCustomTiming timing;
  timing.parameters = CountParameters(*client);
  auto batch =
      MakeBatch(options.sequences, options.sequence_length, config.vocab_size, options.seed + 1);
  FW_RETURN_IF_ERROR(AddRlFields(*client, batch, options.seed + 2));
  for (const Datum& d : batch) timing.tokens += static_cast<int64_t>(d.tokens.size());
  const LossConfig ppo{.clip_low = 0.2, .clip_high = 0.28};
  CustomLossFn custom = [&](const std::vector<Datum>& datums,
                            const std::vector<torch::Tensor>& lps) {
    return UserPpo(datums, lps, ppo.clip_low, ppo.clip_high);
  };
  // Every call starts from no gradients, the same weights and the same optimizer state:
  // the gradients are dropped, not stepped on (an optimizer step would also move the
  // moments and the step count, and a real step the weights).
  auto fused_call = [&]() -> Result<Cost> {
    const CostMeter meter;
    FW_ASSIGN_OR_RETURN(Metrics m, client->ForwardBackward(batch, "ppo", ppo));
    const Cost cost = meter.Stop(m.loss);
    client->DiscardGradients();
    return cost;
  };
  auto custom_call = [&]() -> Result<Cost> {
    const CostMeter meter;
    FW_ASSIGN_OR_RETURN(Metrics m, client->ForwardBackwardCustom(batch, custom));
    const Cost cost = meter.Stop(m.loss);
    client->DiscardGradients();
    return cost;
  };
  for (int i = 0; i < options.warmup + options.repetitions; ++i) {
    const bool timed = i >= options.warmup;
    Cost f, c;
    if (i % 2 == 0) {
      FW_ASSIGN_OR_RETURN(f, fused_call());
      FW_ASSIGN_OR_RETURN(c, custom_call());
    } else {
      FW_ASSIGN_OR_RETURN(c, custom_call());
      FW_ASSIGN_OR_RETURN(f, fused_call());
    }
    timing.loss_difference = std::max(timing.loss_difference, std::abs(f.loss - c.loss));
    (timed ? timing.fused : timing.warmup_fused).push_back(f.wall);
    (timed ? timing.custom : timing.warmup_custom).push_back(c.wall);
    if (timed) {
      timing.fused_cpu.push_back(f.cpu);
      timing.custom_cpu.push_back(c.cpu);
    }
    Cost forward;
    if (options.forward) {
      const CostMeter meter;
      FW_RETURN_IF_ERROR(client->Forward(batch).status());
      forward = meter.Stop(0);
      if (timed) timing.forward.push_back(forward.wall);
    }
    if (progress) {
      *progress << "[trainer bench] " << name << ": "
                << (timed ? "rep " + std::to_string(i - options.warmup + 1)
                          : "warmup " + std::to_string(i + 1))
                << (i % 2 == 0 ? " (fused first)" : " (custom first)") << "  fused " << f.wall
                << " s (cpu " << f.cpu << " s, " << f.faults << " faults), custom " << c.wall
                << " s (cpu " << c.cpu << " s, " << c.faults << " faults), ratio "
                << c.wall / f.wall << " (cpu " << c.cpu / f.cpu << ")";
      if (options.forward) *progress << ", forward " << forward.wall << " s";
      *progress << "\n" << std::flush;
    }
  }
  return timing;
}

Result<TrainerBenchResult> RunTrainerBench(const TrainerBenchOptions& options,
                                           std::ostream& progress) {
  if (options.sequences < 1 || options.sequence_length < 2 || options.repetitions < 1 ||
      options.warmup < 0 || options.pretrain_steps < 0 || options.rl_steps < 1 ||
      options.threads < 0) {
    return Status::InvalidArgument(
        "bench trainer: sequences, repetitions and rl steps must be >= 1, "
        "sequence length >= 2, warmup, pretrain steps and threads >= 0");
  }
  for (double lr : options.learning_rates) {
    if (!(lr > 0 && lr < 1))
      return Status::InvalidArgument("bench trainer: learning rate " + std::to_string(lr) +
                                     " is not in (0, 1)");
  }
  // The split every TrainingClient makes (trainer/training_client.h): the bench measures
  // the trainer as it runs, not a configuration of its own.
  const CpuThreads threads = ConfigureCpuThreads(options.threads);
  TrainerBenchResult result;
  result.threads = threads.torch;
  result.blas_threads = threads.blas;
  result.dense_config = model::DemoDenseConfig().ToJson().dump();
  result.moe_config = model::DemoMoeConfig().ToJson().dump();
  FW_ASSIGN_OR_RETURN(ThroughputRow dense,
                      Throughput("dense", model::DemoDenseConfig(), options, progress));
  result.throughput.push_back(dense);
  if (options.moe) {
    FW_ASSIGN_OR_RETURN(ThroughputRow moe,
                        Throughput("moe", model::DemoMoeConfig(), options, progress));
    result.throughput.push_back(moe);
  }
  FW_ASSIGN_OR_RETURN(result.sparsity, Sparsity(options, progress));
  return result;
}

}  // namespace flywheel::trainer
