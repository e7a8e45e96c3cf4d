// `flywheel bench churn` (tools/bench_commands.h): many small workers, killed and restarted
// while versions are published (bench/churn_bench.h).
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>

#include "bench/churn_bench.h"
#include "tools/bench_commands.h"

namespace flywheel::tools {

void AddChurnBenchCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::ChurnBenchOptions>();
  CLI::App* churn = bench_app.add_subcommand(
      "churn",
      "Benchmark sync under churn: one publisher, --relays relays and --workers model-less\n"
      "workers as separate flywheel processes on loopback; --publishes generated versions\n"
      "(bf16, AdamW steps) dropped every --publish-interval-s while every --churn-period-s\n"
      "--churn-percent of the workers are killed (alternately SIGKILL and SIGTERM) and\n"
      "restarted. Checks: every worker serves each new version within --deadline-s of its\n"
      "commit (p50/p99/max), no worker reports an unpublished hash, each restarted worker\n"
      "serves the head within --deadline-s of starting, a SIGTERMed worker says \"leaving\",\n"
      "exits cleanly and its relay forgets it at once. Reports the relays' CPU, RSS and open\n"
      "descriptors. Raises RLIMIT_NOFILE to its hard limit.");
  churn->add_option("--flywheel", options->flywheel_binary, "The flywheel binary to start (default: this one)")
      ->type_name("PATH");
  churn->add_option("--workers", options->workers, "Workers")->check(CLI::Range(1, 10000))->capture_default_str();
  churn->add_option("--relays", options->relays, "Relays")->check(CLI::Range(1, 64))->capture_default_str();
  churn->add_option("--publishes", options->publishes, "Measured publishes after the first version")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  churn->add_option("--churn-percent", options->churn_percent, "Workers killed and restarted per round, % (0: none)")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  churn->add_option("--churn-period-s", options->churn_period_seconds, "Seconds between churn rounds")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  churn->add_option("--publish-interval-s", options->publish_interval_seconds, "Seconds between publishes")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  churn->add_option("--model-mb", options->checkpoint_bytes, "MiB of bf16 in the generated model (default 15)")
      ->type_name("MIB")
      ->transform([](std::string text) { return std::to_string(std::stoull(text) << 20); });
  churn->add_option("--lr", options->learning_rate, "AdamW learning rate of the simulated steps")
      ->check(CLI::Range(1e-9, 1.0))
      ->capture_default_str();
  churn->add_option("--keyframe-every", options->keyframe_every,
                    "The publisher's --keyframe-every (1: a keyframe at the head, a restarted worker\n"
                    "applies no delta; 0: the publisher's default)")
      ->capture_default_str();
  churn->add_option("--deadline-s", options->serve_deadline_seconds, "Target: seconds to serve a new version")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  churn->add_option("--seed", options->seed, "Seed of the checkpoints and of the victims")->capture_default_str();
  churn->add_option("--work-dir", options->work_dir, "Scratch directory (default: a fresh one, removed)")
      ->type_name("PATH");
  churn->add_flag("--keep", options->keep, "Keep the work directory (state, logs/)");
  churn->add_option("--json", options->json_out, "Also write the results as JSON here")->type_name("PATH");
  churn->callback([options, &action] {
    action = [options]() -> Status {
      Result<bench::ChurnBenchResult> result = bench::RunChurnBench(*options, std::cout);
      std::cout.flush();
      if (!result.ok()) return Failed("churn benchmark failed", result.status());
      return Status::Ok();
    };
  });
}

}  // namespace flywheel::tools
