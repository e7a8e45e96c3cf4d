#include "bench/trainer_bench.h"

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <map>
#include <thread>

#include "bench/util.h"

namespace flywheel::bench {

namespace {

constexpr double kDenseTarget = 1.4;     // fused >= 1.4x custom, dense (issue target)
constexpr double kMoeTarget = 1.3;       // fused >= 1.3x custom, MoE (routing costs both alike)
constexpr double kSpreadTarget = 0.10;   // (max - min) / median of the timed calls
constexpr double kLossTolerance = 1e-4;  // fused and custom compute the same PPO loss

std::string Seconds(const std::vector<double>& values) {
  std::string out;
  for (double v : values) out += (out.empty() ? "" : ", ") + Fixed(v, 3);
  return out.empty() ? "none" : out + " s";
}

// What the numbers mean and what they were measured on (the machine's load around the run).
std::string Preamble(const trainer::TrainerBenchOptions& b,
                     const trainer::TrainerBenchResult& result, double load_before,
                     double load_after) {
  std::string preamble = "batch: " + std::to_string(b.sequences) + " sequences x " +
                         std::to_string(b.sequence_length) +
                         " tokens (the first quarter a prompt with weight 0); loss ppo (clip "
                         "0.2/0.28), token-mean; fp32 compute; " +
                         std::to_string(b.repetitions) + " timed (fused, custom) pairs after " +
                         std::to_string(b.warmup) +
                         " warm-up pair(s), the order alternating per pair, gradients dropped "
                         "after every call (weights and optimizer state constant); seconds are "
                         "median [min-max] per call, spread = (max-min)/median, ratio = median "
                         "over pairs of custom/fused; bound = 1 + forward/fused, the ratio if "
                         "the custom path cost exactly one extra no-grad forward\n";
  preamble +=
      "machine: " + std::to_string(std::thread::hardware_concurrency()) +
      " hardware threads, torch threads " + std::to_string(result.threads) + ", OpenBLAS threads " +
      (result.blas_threads > 0 ? std::to_string(result.blas_threads) : "n/a") + ", load average " +
      Fixed(load_before, 2) + " before, " + Fixed(load_after, 2) + " after\n";
  preamble += "dense model: " + result.dense_config + "\n";
  preamble += "moe model: " + result.moe_config + "\n";
  preamble += "sparsity: demo dense model after " + std::to_string(b.pretrain_steps) +
              " SFT steps (AdamW lr " + Fixed(b.pretrain_lr, 4) +
              "), then PPO steps; changed = bf16 bit patterns of the sampler snapshot that "
              "differ from the previous step's\n";
  return preamble;
}

std::string SpreadCell(const trainer::Spread& s) {
  return Fixed(s.median, 3) + " [" + Fixed(s.min, 3) + "-" + Fixed(s.max, 3) + "]";
}

// The throughput table and its checks; false in `correct` when fused and custom losses differ.
Table ThroughputTable(const trainer::TrainerBenchResult& result, std::vector<std::string>& checks,
                      bool& correct) {
  Table throughput{{"model", "params M", "tokens/call", "fused s", "fused spread", "fused tok/s",
                    "custom s", "custom spread", "custom tok/s", "fused vs custom", "bound",
                    "forward tok/s", "loss abs diff"},
                   {}};
  for (const auto& row : result.throughput) {
    const double tokens = static_cast<double>(row.tokens);
    const double target = row.model == "moe" ? kMoeTarget : kDenseTarget;
    const double bound = 1 + row.forward.median / row.fused.median;
    char loss_difference[32];
    std::snprintf(loss_difference, sizeof(loss_difference), "%.1e", row.loss_difference);
    throughput.rows.push_back(
        {row.model, Fixed(row.parameters / 1e6, 1), std::to_string(row.tokens),
         SpreadCell(row.fused), Fixed(100 * row.fused.spread(), 1) + "%",
         Fixed(tokens / row.fused.median, 0), SpreadCell(row.custom),
         Fixed(100 * row.custom.spread(), 1) + "%", Fixed(tokens / row.custom.median, 0),
         Fixed(row.pair_ratio, 2) + "x", Fixed(bound, 2) + "x",
         Fixed(tokens / row.forward.median, 0), loss_difference});
    checks.push_back("warm-up (" + row.model + "): fused " + Seconds(row.warmup_fused) +
                     ", custom " + Seconds(row.warmup_custom));
    checks.push_back("fused forward_backward >= " + Fixed(target, 1) +
                     "x forward_backward_custom (" + row.model + "): " +
                     (row.pair_ratio >= target ? "PASS" : "FAIL") + " (" +
                     Fixed(row.pair_ratio, 2) + "x)");
    const double spread = std::max(row.fused.spread(), row.custom.spread());
    checks.push_back("spread of the timed calls <= " + Fixed(100 * kSpreadTarget, 0) + "% (" +
                     row.model + "): " + (spread <= kSpreadTarget ? "PASS" : "FAIL") + " (fused " +
                     Fixed(100 * row.fused.spread(), 1) + "%, custom " +
                     Fixed(100 * row.custom.spread(), 1) + "%)");
    if (!(row.loss_difference <= kLossTolerance)) {
      correct = false;
      checks.push_back("fused and custom PPO losses agree (" + row.model + "): FAIL (differ by " +
                       std::to_string(row.loss_difference) + ")");
    }
  }
  return throughput;
}

// The sparsity table, and the mean changed fraction per learning rate in `checks`.
Table SparsityTable(const trainer::TrainerBenchResult& result, std::vector<std::string>& checks) {
  Table sparsity{{"lr", "step", "bf16 elements", "changed", "changed %", "unchanged %"}, {}};
  std::map<double, std::pair<double, int>> mean_changed;
  for (const auto& row : result.sparsity) {
    const double fraction = static_cast<double>(row.changed) / static_cast<double>(row.elements);
    char lr[32];
    std::snprintf(lr, sizeof(lr), "%g", row.learning_rate);
    sparsity.rows.push_back({lr, std::to_string(row.step), std::to_string(row.elements),
                             std::to_string(row.changed), Fixed(100 * fraction, 3),
                             Fixed(100 * (1 - fraction), 3)});
    mean_changed[row.learning_rate].first += fraction;
    mean_changed[row.learning_rate].second += 1;
  }
  for (const auto& [lr, sum] : mean_changed) {
    char text[64];
    std::snprintf(text, sizeof(text), "%g", lr);
    checks.push_back(std::string("mean bf16 elements changed per step at lr ") + text + ": " +
                     Fixed(100 * sum.first / sum.second, 3) + "%");
  }
  return sparsity;
}

}  // namespace

Status RunTrainerReport(const TrainerReportOptions& options, std::ostream& out) {
  out << "flywheel trainer benchmark: forward_backward throughput (fused loss vs "
         "forward_backward_custom) and "
         "the bf16 sparsity of RL updates\n";
  // Timings on a shared machine mean little without the load they were taken under.
  double load_before[1] = {-1};
  ::getloadavg(load_before, 1);
  FW_ASSIGN_OR_RETURN(trainer::TrainerBenchResult result,
                      trainer::RunTrainerBench(options.bench, std::cerr));
  double load_after[1] = {-1};
  ::getloadavg(load_after, 1);
  const std::string preamble = Preamble(options.bench, result, load_before[0], load_after[0]);
  out << preamble << "\n";
  std::vector<std::string> checks;
  bool correct = true;
  const Table throughput = ThroughputTable(result, checks, correct);
  const Table sparsity = SparsityTable(result, checks);
  out << "throughput\n"
      << RenderText(throughput) << "\nsparsity\n"
      << RenderText(sparsity) << "\nchecks\n";
  for (const auto& c : checks) out << "  - " << c << "\n";
  out << "\n  fused: one forward and one backward with the loss inside; custom: a no-grad forward "
         "for logprobs, the "
         "user's PPO in torch per datum, then a forward+backward of sum(logprob x "
         "dLoss/dlogprob)\n";
  if (!options.markdown_out.empty()) {
    std::string section = "## Trainer benchmark\n\n```\n" + preamble + "```\n\n### Throughput\n\n" +
                          RenderMarkdown(throughput) + "\n### Sparsity of RL updates (bf16)\n\n" +
                          RenderMarkdown(sparsity) + "\n### Checks\n\n";
    for (const auto& c : checks) section += "- " + c + "\n";
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Trainer benchmark", section));
  }
  if (!correct) return Status::Internal("trainer benchmark: fused and custom losses disagree");
  return Status::Ok();
}

}  // namespace flywheel::bench
