#include "bench/parity_bench.h"

#include <cstdio>
#include <iostream>

#include "bench/util.h"

namespace flywheel::bench {

namespace {

constexpr double kTargetK3 = 1e-6;

std::string Sci(double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.2e", v);
  return buffer;
}

}  // namespace

Status RunParityReport(const ParityReportOptions& options, std::ostream& out) {
  const auto& b = options.bench;
  FW_ASSIGN_OR_RETURN(auto rows, rollout::RunParityBench(b, std::cerr));
  std::string preamble =
      "flywheel parity benchmark: engine sampling logprobs against the trainer's recomputation\n"
      "models: the demo-size dense and MoE models after " +
      std::to_string(b.sft_steps) + " SFT steps; " + std::to_string(b.requests) + " requests x " +
      std::to_string(b.new_tokens) + " sampled tokens (temperature 1) after " +
      std::to_string(b.prompt_tokens) +
      "-token prompts\n"
      "served weights: the bf16 snapshot the engine computed from, loaded into the trainer; fp32 "
      "masters: the "
      "trainer's own weights (MoE: with routing replay)\n"
      "published production figures (same weights, GPU engines): k3 ~1e-4 to 7e-3\n";
  out << preamble << "\n";
  Table table{
      {"model", "trainer weights", "tokens", "mean k3", "max abs dlogprob", "routing agreement"},
      {}};
  std::vector<std::string> checks;
  for (const auto& row : rows) {
    char agreement[32] = "-";
    if (row.routing_agreement >= 0)
      std::snprintf(agreement, sizeof(agreement), "%.4f", row.routing_agreement);
    table.rows.push_back({row.model, row.comparison, std::to_string(row.tokens), Sci(row.mean_k3),
                          Sci(row.max_abs_diff), agreement});
    const bool checked = row.comparison == "served weights"
                             ? row.model == "dense"
                             : row.comparison == "served weights + routing replay";
    if (checked) {
      checks.push_back("k3 <= " + Sci(kTargetK3) + " on the served weights (" + row.model +
                       (row.model == "dense" ? "" : ", routing replay") +
                       "): " + (row.mean_k3 <= kTargetK3 ? "PASS" : "FAIL") + " (" +
                       Sci(row.mean_k3) + ")");
    }
  }
  out << RenderText(table) << "\nchecks\n";
  for (const auto& c : checks) out << "  - " << c << "\n";
  if (!options.markdown_out.empty()) {
    std::string section = "## Parity benchmark\n\n```\n" + preamble + "```\n\n" +
                          RenderMarkdown(table) + "\n### Checks\n\n";
    for (const auto& c : checks) section += "- " + c + "\n";
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Parity benchmark", section));
  }
  return Status::Ok();
}

}  // namespace flywheel::bench
