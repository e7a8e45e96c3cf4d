// `flywheel bench join` (tools/bench_commands.h): a worker joining at the head of a model
// through a relay over a shaped link (bench/join_bench.h).
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>

#include "bench/join_bench.h"
#include "tools/bench_commands.h"

namespace flywheel::tools {

void AddJoinBenchCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::JoinBenchOptions>();
  auto link_mbit = std::make_shared<double>(1000);
  auto model_mb = std::make_shared<uint64_t>(1024);
  CLI::App* join = bench_app.add_subcommand(
      "join",
      "Benchmark a worker joining at the head: an in-process publisher (a keyframe of a\n"
      "generated bf16 model and --chain deltas), one relay, and a worker whose upstream link\n"
      "is shaped to --link-mbit. Times the join with the keyframe decoded and verified tensor\n"
      "by tensor while it arrives against the join with the keyframe decoded once whole (the\n"
      "peer); measures the keyframe decode and the chain apply apart in the same run.\n"
      "Target: join <= 1.3 x (keyframe bytes / link rate) + chain apply. Checks the worker's\n"
      "weights hash against the head's.");
  join->add_option("--model-mb", *model_mb, "MiB of bf16 in the generated model")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  join->add_option("--link-mbit", *link_mbit, "The joining worker's link, Mbit/s")
      ->check(CLI::Range(1.0, 1e6))
      ->capture_default_str();
  join->add_option("--chain", options->chain, "Deltas published after the keyframe")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  join->add_option("--lr", options->learning_rate, "AdamW learning rate of the simulated steps")
      ->check(CLI::Range(1e-9, 1.0))
      ->capture_default_str();
  join->add_option("--threads", options->threads, "CPU threads of each role")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  join->add_option("--seed", options->seed, "Seed of the generated weights")->capture_default_str();
  join->add_option("--json", options->json_out, "Also write the results as JSON here")->type_name("PATH");
  join->add_flag("--no-check", [options](int64_t) { options->check = false; },
                 "Report a missed target without failing");
  join->callback([options, link_mbit, model_mb, &action] {
    options->link_bytes_per_second = *link_mbit * 1e6 / 8;
    options->model_bytes = *model_mb << 20;
    action = [options]() -> Status {
      Result<bench::JoinBenchResult> result = bench::RunJoinBench(*options, std::cout);
      std::cout.flush();
      if (!result.ok()) return Failed("join benchmark failed", result.status());
      return Status::Ok();
    };
  });
}

}  // namespace flywheel::tools
