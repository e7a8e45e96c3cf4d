#include "bench/trainer_measure.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "trainer/training_client.h"

namespace flywheel::trainer {

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Sequences whose continuation is learnable (a repeating pattern per sequence, with noise),
// so SFT makes real progress and the RL steps start from a trained model.
std::vector<Datum> MakeBatch(int sequences, int length, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Datum> out;
  for (int i = 0; i < sequences; ++i) {
    const int period = 3 + static_cast<int>(rng() % 13);
    std::vector<int32_t> pattern(period);
    for (auto& t : pattern) t = static_cast<int32_t>(rng() % vocab);
    std::vector<int32_t> seq(length + 1);
    for (int t = 0; t <= length; ++t)
      seq[t] = rng() % 10 == 0 ? static_cast<int32_t>(rng() % vocab) : pattern[t % period];
    Datum d;
    d.tokens.assign(seq.begin(), seq.end() - 1);
    d.target_tokens.assign(seq.begin() + 1, seq.end());
    // As in RL batches, a prompt (the first quarter) carries no loss.
    d.weights.assign(length, 1.0f);
    std::fill(d.weights.begin(), d.weights.begin() + length / 4, 0.0f);
    out.push_back(std::move(d));
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
  FW_ASSIGN_OR_RETURN(auto client,
                      TrainingClient::Create({.config = config, .seed = options.seed}));
  ThroughputRow row;
  row.model = name;
  row.parameters = CountParameters(*client);
  auto batch =
      MakeBatch(options.sequences, options.sequence_length, config.vocab_size, options.seed + 1);
  FW_RETURN_IF_ERROR(AddRlFields(*client, batch, options.seed + 2));
  for (const Datum& d : batch) row.tokens += static_cast<int64_t>(d.tokens.size());
  const LossConfig ppo{.clip_low = 0.2, .clip_high = 0.28};
  CustomLossFn custom = [&](const std::vector<Datum>& datums,
                            const std::vector<torch::Tensor>& lps) {
    return UserPpo(datums, lps, ppo.clip_low, ppo.clip_high);
  };
  // lr 0 and no decay: optim_step only clears the gradients, the weights stay put, so every
  // call sees the same model and the two losses can be compared.
  const AdamWParams clear{.lr = 0, .weight_decay = 0, .grad_clip = 0};
  std::vector<double> fused, custom_times, forward;
  double fused_loss = 0, custom_loss = 0;
  for (int i = 0; i < options.warmup + options.repetitions; ++i) {
    const bool timed = i >= options.warmup;
    auto start = Clock::now();
    FW_ASSIGN_OR_RETURN(Metrics m, client->ForwardBackward(batch, "ppo", ppo));
    if (timed) fused.push_back(Seconds(start));
    fused_loss = m.loss;
    FW_RETURN_IF_ERROR(client->OptimStep(clear).status());

    start = Clock::now();
    FW_ASSIGN_OR_RETURN(Metrics c, client->ForwardBackwardCustom(batch, custom));
    if (timed) custom_times.push_back(Seconds(start));
    custom_loss = c.loss;
    FW_RETURN_IF_ERROR(client->OptimStep(clear).status());

    start = Clock::now();
    FW_RETURN_IF_ERROR(client->Forward(batch).status());
    if (timed) forward.push_back(Seconds(start));
    progress << "[trainer bench] " << name << ": " << (timed ? "rep " : "warmup ")
             << (timed ? i - options.warmup + 1 : i + 1) << "  fused " << (timed ? fused.back() : 0)
             << " s, custom " << (timed ? custom_times.back() : 0) << " s\n"
             << std::flush;
  }
  row.fused_seconds = Median(fused);
  row.custom_seconds = Median(custom_times);
  row.forward_seconds = Median(forward);
  row.loss_difference = std::abs(fused_loss - custom_loss);
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
                      TrainingClient::Create({.config = config, .seed = options.seed}));
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

}  // namespace

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
  torch::set_num_threads(options.threads > 0
                             ? options.threads
                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  TrainerBenchResult result;
  result.threads = torch::get_num_threads();
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
