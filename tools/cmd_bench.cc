// `flywheel bench codec` and `flywheel demo`: both run bench::RunCodecBench, the same code
// as build/bin/codec_bench.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "bench/codec_bench.h"
#include "tools/commands.h"

namespace flywheel::tools {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

struct BenchArgs {
  bench::CodecBenchOptions options;
  uint64_t size_mb = bench::CodecBenchOptions{}.checkpoint_bytes / kMiB;
  bool no_peers = false;
};

Status RunBench(BenchArgs args) {
  args.options.checkpoint_bytes = args.size_mb * kMiB;
  if (args.no_peers) args.options.run_peers = false;
  spdlog::debug("bench codec: {} MiB, {} learning rates, {} steps, {} reps, peers {}", args.size_mb,
                args.options.learning_rates.size(), args.options.adam_steps,
                args.options.repetitions, args.options.run_peers);
  Status status = bench::RunCodecBench(args.options, std::cout);
  std::cout.flush();
  if (!status.ok()) return Failed("codec benchmark failed", status);
  return Status::Ok();
}

// CLI11 check: "" when `text` is a learning rate in (0, 1], else what is wrong with it.
std::string CheckLearningRate(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !(value > 0.0 && value <= 1.0)) {
    return "learning rate '" + text + "' is not a number in (0, 1]";
  }
  return {};
}

constexpr const char* kDemoBanner =
    "flywheel demo\n"
    "=============\n"
    "Generates two consecutive RL policy checkpoints (bf16 weights in transformer-like\n"
    "shapes, one AdamW step apart at small learning rates, as in RL fine-tuning), encodes\n"
    "the delta between them, applies it back and checks the result bit for bit. The table\n"
    "compares the delta's size and speed with what one would use instead: zstd of the full\n"
    "checkpoint, zstd --patch-from and xdelta3, and with the entropy floor (the size an\n"
    "ideal coder of the changed positions and values, taken as independent, would reach).\n";

}  // namespace

void AddBenchCommands(CLI::App& app, Action& action) {
  CLI::App* bench_app = app.add_subcommand("bench", "Benchmarks that also check their results");
  bench_app->require_subcommand(1);
  bench_app->footer("\nExample:\n  flywheel bench codec --size-mb 64 --no-peers");

  auto args = std::make_shared<BenchArgs>();
  bench::CodecBenchOptions& options = args->options;
  CLI::App* codec = bench_app->add_subcommand(
      "codec",
      "Benchmark the delta codec against zstd, zstd --patch-from and xdelta3.\n"
      "Runs on generated consecutive RL checkpoints (bf16, AdamW steps), with the entropy\n"
      "floor and the full checkpoint size as references. Every row is a correctness run\n"
      "too: each delta is applied and compared bit for bit with its target.");
  codec->add_option("--size-mb", args->size_mb, "Size of one bf16 checkpoint in MiB")
      ->type_name("N")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 20).description(""))
      ->capture_default_str();
  codec
      ->add_option("--lr", options.learning_rates,
                   "Learning rates, one row group each (default: 1e-6,1e-5)")
      ->type_name("X")
      ->delimiter(',')
      ->check(CheckLearningRate);
  codec->add_option("--steps", options.adam_steps, "AdamW steps before the measured pair")
      ->type_name("N")
      ->check(CLI::Range(1, 1000000).description(""))
      ->capture_default_str();
  codec
      ->add_option("--threads", options.threads,
                   "Thread counts to measure encode/apply with (default: 1,2)")
      ->type_name("N")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024).description(""));
  codec->add_option("--reps", options.repetitions, "Timed repetitions; the best is reported")
      ->type_name("N")
      ->check(CLI::Range(1, 1000).description(""))
      ->capture_default_str();
  codec->add_option("--seed", options.seed, "Seed of the generated checkpoints")
      ->type_name("N")
      ->capture_default_str();
  codec->add_flag("--no-peers", args->no_peers, "Skip the peer tools (zstd, xdelta3)");
  codec->add_option("--markdown", options.markdown_out, "Also write the table as Markdown here")
      ->type_name("PATH");
  codec->add_option("--json", options.json_out, "Also write the raw results as JSON here")
      ->type_name("PATH");
  codec
      ->add_option("--work-dir", options.work_dir,
                   "Scratch directory for peer files (default: a fresh one under $TMPDIR)")
      ->type_name("PATH");
  codec->footer(
      "\nExamples:\n"
      "  flywheel bench codec --size-mb 64 --lr 1e-6,1e-5 --threads 1,2\n"
      "  flywheel bench codec --markdown docs/BENCHMARKS.md --json bench.json");
  codec->callback([args, &action] { action = [args] { return RunBench(*args); }; });

  auto demo_args = std::make_shared<BenchArgs>();
  CLI::App* demo = app.add_subcommand(
      "demo",
      "Show what flywheel does: delta vs zstd / xdelta3 on generated RL checkpoints.\n"
      "Runs the codec benchmark with its defaults on two generated consecutive RL\n"
      "checkpoints and prints the delta's size and speed next to zstd, zstd --patch-from,\n"
      "xdelta3 and the entropy floor.");
  demo->add_option("--size-mb", demo_args->size_mb, "Size of one bf16 checkpoint in MiB")
      ->type_name("N")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 20).description(""))
      ->capture_default_str();
  demo->add_option("--markdown", demo_args->options.markdown_out,
                   "Also write the table as Markdown here")
      ->type_name("PATH");
  demo->footer("\nExample:\n  flywheel demo --size-mb 32");
  demo->callback([demo_args, &action] {
    action = [demo_args] {
      std::cout << kDemoBanner << std::endl;
      return RunBench(*demo_args);
    };
  });
}

}  // namespace flywheel::tools
