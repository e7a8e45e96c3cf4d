#include "bench/trainer_bench.h"

#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <thread>

#include "bench/util.h"

namespace flywheel::bench {

namespace {

constexpr double kFusedTarget = 1.4;     // fused >= 1.4x custom (issue target)
constexpr double kLossTolerance = 1e-4;  // fused and custom compute the same PPO loss

}  // namespace

Status RunTrainerReport(const TrainerReportOptions& options, std::ostream& out) {
  const auto& b = options.bench;
  out << "flywheel trainer benchmark: forward_backward throughput (fused loss vs "
         "forward_backward_custom) and "
         "the bf16 sparsity of RL updates\n";
  std::string preamble = "batch: " + std::to_string(b.sequences) + " sequences x " +
                         std::to_string(b.sequence_length) +
                         " tokens (the first quarter a prompt with weight 0); loss ppo (clip "
                         "0.2/0.28), token-mean; fp32 compute; median of " +
                         std::to_string(b.repetitions) + " timed calls after " +
                         std::to_string(b.warmup) + " warm-up\n";
  FW_ASSIGN_OR_RETURN(trainer::TrainerBenchResult result, trainer::RunTrainerBench(b, std::cerr));
  preamble += "machine: " + std::to_string(std::thread::hardware_concurrency()) +
              " hardware threads, torch threads " + std::to_string(result.threads) + "\n";
  preamble += "dense model: " + result.dense_config + "\n";
  preamble += "moe model: " + result.moe_config + "\n";
  preamble += "sparsity: demo dense model after " + std::to_string(b.pretrain_steps) +
              " SFT steps (AdamW lr " + Fixed(b.pretrain_lr, 4) +
              "), then PPO steps; changed = bf16 bit patterns of the sampler snapshot that "
              "differ from the previous step's\n";
  out << preamble << "\n";

  Table throughput{{"model", "params M", "tokens/call", "fused s", "fused tok/s", "custom s",
                    "custom tok/s", "fused vs custom", "forward tok/s", "loss abs diff"},
                   {}};
  std::vector<std::string> checks;
  bool correct = true;
  for (const auto& row : result.throughput) {
    const double tokens = static_cast<double>(row.tokens);
    const double ratio = row.custom_seconds / row.fused_seconds;
    throughput.rows.push_back({row.model, Fixed(row.parameters / 1e6, 1),
                               std::to_string(row.tokens), Fixed(row.fused_seconds, 3),
                               Fixed(tokens / row.fused_seconds, 0), Fixed(row.custom_seconds, 3),
                               Fixed(tokens / row.custom_seconds, 0), Fixed(ratio, 2) + "x",
                               Fixed(tokens / row.forward_seconds, 0), [&] {
                                 char buffer[32];
                                 std::snprintf(buffer, sizeof(buffer), "%.1e", row.loss_difference);
                                 return std::string(buffer);
                               }()});
    checks.push_back("fused forward_backward >= " + Fixed(kFusedTarget, 1) +
                     "x forward_backward_custom (" + row.model + "): " +
                     (ratio >= kFusedTarget ? "PASS" : "FAIL") + " (" + Fixed(ratio, 2) + "x)");
    if (!(row.loss_difference <= kLossTolerance)) {
      correct = false;
      checks.push_back("fused and custom PPO losses agree (" + row.model + "): FAIL (differ by " +
                       std::to_string(row.loss_difference) + ")");
    }
  }
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
