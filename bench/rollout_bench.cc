#include "bench/rollout_bench.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <thread>

#include "bench/stats.h"
#include "bench/util.h"

namespace flywheel::bench {

namespace {

constexpr double kPauseTargetMs = 50;
constexpr double kMirrorTarget = 3.2;    // x bf16 weights, plus the KV cache
constexpr double kNoMirrorTarget = 1.3;  // x f32 weights, plus the KV cache: fp32 serving, no mirror

std::string Preamble(const rollout::RolloutBenchOptions& b, int threads) {
  std::string preamble =
      "flywheel rollout benchmark: generation throughput, in-flight swap pause, worker memory\n";
  preamble += "requests: " + std::to_string(b.prompt_tokens) + "-token prompts, " +
              std::to_string(b.new_tokens) +
              " new tokens each, temperature 1; demo-size models (see the trainer benchmark); fp32 "
              "compute on an "
              "fp32 mirror of the bf16 serving copy\n";
  preamble += "swaps: " + std::to_string(b.swaps) + " versions, " +
              Fixed(100 * b.changed_fraction, 1) +
              "% of bf16 words changed each, delta applied to the serving copy, mirror patched at "
              "the written words "
              "with 8 requests in flight\n";
  preamble += "memory: bf16 serving + fp32 mirror (the default), and f32 serving without a mirror "
              "(the engine's parameters view the served tensors; the largest batch generated)\n";
  preamble += "machine: " + std::to_string(std::thread::hardware_concurrency()) +
              " hardware threads, torch threads " + std::to_string(threads) + "\n";
  return preamble;
}

Table ThroughputTable(const rollout::RolloutBenchResult& result) {
  Table throughput{{"model", "batch", "tokens", "seconds", "tokens/s", "vs batch 1"}, {}};
  std::map<std::string, double> single;
  for (const auto& row : result.throughput) {
    const double rate = row.tokens / row.seconds;
    if (row.batch == 1) single[row.model] = rate;
    throughput.rows.push_back(
        {row.model, std::to_string(row.batch), std::to_string(row.tokens), Fixed(row.seconds, 2),
         Fixed(rate, 1), single.count(row.model) ? Fixed(rate / single[row.model], 2) + "x" : "-"});
  }
  return throughput;
}

// One row of the memory table and its checks: fp32 serving without a mirror.
void AddUnmirroredRow(const rollout::RolloutModelRow& row, Table& memory,
                      std::vector<std::string>& checks) {
  const double worker = static_cast<double>(row.serving_bytes + row.rss_growth_bytes);
  const double limit = kNoMirrorTarget * row.serving_bytes + row.kv_cache_bytes;
  memory.rows.push_back({row.model, row.serving, Fixed(row.parameters / 1e6, 1),
                         Fixed(row.serving_bytes / 1e6, 1), "-", Fixed(row.kv_cache_bytes / 1e6, 1),
                         Fixed(row.rss_growth_bytes / 1e6, 1), Fixed(worker / 1e6, 1),
                         Fixed(worker / row.serving_bytes, 2) + "x", Fixed(limit / 1e6, 1), "-",
                         "-"});
  checks.push_back("worker memory <= " + Fixed(kNoMirrorTarget, 1) +
                   "x fp32 serving weights + KV cache without a mirror (" + row.model +
                   "): " + (worker <= limit ? "PASS" : "FAIL") + " (" + Fixed(worker / 1e6, 1) +
                   " MB measured against " + Fixed(limit / 1e6, 1) + " MB)");
}

// One row of the memory table and its checks: bf16 serving with the fp32 mirror.
void AddMirroredRow(const rollout::RolloutModelRow& row, Table& memory,
                    std::vector<std::string>& checks) {
  const Spread pauses = Summarize(row.swap_pause_ms);
  const double worker = static_cast<double>(row.serving_bytes + row.rss_growth_bytes);
  const double limit = kMirrorTarget * row.serving_bytes + row.kv_cache_bytes;
  memory.rows.push_back({row.model, row.serving, Fixed(row.parameters / 1e6, 1),
                         Fixed(row.serving_bytes / 1e6, 1), Fixed(row.mirror_bytes / 1e6, 1),
                         Fixed(row.kv_cache_bytes / 1e6, 1), Fixed(row.rss_growth_bytes / 1e6, 1),
                         Fixed(worker / 1e6, 1), Fixed(worker / row.serving_bytes, 2) + "x",
                         Fixed(limit / 1e6, 1),
                         Fixed(pauses.median, 2) + ", " + Fixed(pauses.max, 2),
                         std::to_string(row.words_patched_per_swap)});
  checks.push_back("swap pause <= " + Fixed(kPauseTargetMs, 0) + " ms (" + row.model +
                   "): " + (pauses.max <= kPauseTargetMs ? "PASS" : "FAIL") + " (worst " +
                   Fixed(pauses.max, 2) + " ms)");
  checks.push_back(
      "worker memory <= " + Fixed(kMirrorTarget, 1) +
      "x bf16 weights + KV cache with the fp32 mirror (" + row.model +
      "): " + (worker <= limit ? "PASS" : "FAIL") + " (" + Fixed(worker / 1e6, 1) +
      " MB measured against " + Fixed(limit / 1e6, 1) + " MB; serving + mirror + KV alone " +
      Fixed((row.serving_bytes + row.mirror_bytes + row.kv_cache_bytes) / 1e6, 1) + " MB)");
}

}  // namespace

Status RunRolloutReport(const RolloutReportOptions& options, std::ostream& out) {
  FW_ASSIGN_OR_RETURN(rollout::RolloutBenchResult result,
                      rollout::RunRolloutBench(options.bench, std::cerr));
  const std::string preamble = Preamble(options.bench, result.threads);
  out << preamble << "\n";
  const Table throughput = ThroughputTable(result);
  Table memory{{"model", "serving", "params M", "serving copy MB", "fp32 mirror MB", "KV cache MB",
                "engine RSS growth MB", "worker MB (serving + growth)", "vs serving copy", "limit MB",
                "swap pause ms (median, max)", "words patched"},
               {}};
  std::vector<std::string> checks;
  for (const auto& row : result.models) {
    if (row.mirror_bytes > 0) {
      AddMirroredRow(row, memory, checks);
    } else {
      AddUnmirroredRow(row, memory, checks);
    }
  }
  out << "throughput\n"
      << RenderText(throughput) << "\nworker memory and swap pause\n"
      << RenderText(memory) << "\nchecks\n";
  for (const auto& c : checks) out << "  - " << c << "\n";
  if (!options.markdown_out.empty()) {
    std::string section = "## Rollout benchmark\n\n```\n" + preamble + "```\n\n### Throughput\n\n" +
                          RenderMarkdown(throughput) + "\n### Worker memory and swap pause\n\n" +
                          RenderMarkdown(memory) + "\n### Checks\n\n";
    for (const auto& c : checks) section += "- " + c + "\n";
    FW_RETURN_IF_ERROR(WriteMarkdownSection(options.markdown_out, "## Rollout benchmark", section));
  }
  return Status::Ok();
}

}  // namespace flywheel::bench
