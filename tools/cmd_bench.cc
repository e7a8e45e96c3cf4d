// `flywheel bench codec|fleet|trainer|rollout|parity|fp8`: the benchmark reports (the codec one
// is also build/bin/codec_bench); `bench pipeline` is registered from cmd_rl.cc.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/codec_bench.h"
#include "bench/fleet_bench.h"
#include "bench/fp8_bench.h"
#include "bench/stream_bench.h"
#include "bench/parity_bench.h"
#include "bench/rollout_bench.h"
#include "bench/serving_bench.h"
#include "bench/training_api_bench.h"
#include "bench/packed_experts_bench.h"
#include "bench/push_bench.h"
#include "bench/signing_bench.h"
#include "bench/startup_bench.h"
#include "bench/tokenizer_bench.h"
#include "bench/trainer_bench.h"
#include "tools/bench_commands.h"
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

Status RunFleet(const bench::FleetBenchOptions& options) {
  spdlog::debug("bench fleet: {} params, {} updates, {} regions x {} workers, {} strategies",
                options.parameters, options.updates, options.regions, options.workers_per_region,
                options.strategies.size());
  Status status = bench::RunFleetBench(options, std::cout);
  std::cout.flush();
  if (!status.ok()) return Failed("fleet benchmark failed", status);
  return Status::Ok();
}

// The simulated steps, timeouts, scratch space and outputs of `bench fleet` (the fleet's
// shape and WAN are set in AddFleetCommand).
void AddFleetRunOptions(CLI::App* fleet, bench::FleetBenchOptions& options) {
  fleet
      ->add_option("--lr", options.learning_rate,
                   "Size of each simulated optimiser step; sets how many bf16 words change")
      ->type_name("X")
      ->check(CheckLearningRate)
      ->capture_default_str();
  fleet
      ->add_option("--keyframe-every", options.keyframe_every,
                   "delta-relay: publisher keyframe period (default: the publisher's own)")
      ->type_name("K")
      ->check(CLI::Range(1, 1000000).description(""));
  fleet->add_option("--seed", options.seed, "Seed of the generated checkpoints")
      ->type_name("N")
      ->capture_default_str();
  fleet->add_option("--threads", options.threads, "Threads to generate and hash checkpoints")
      ->type_name("N")
      ->check(CLI::Range(1, 1024).description(""))
      ->capture_default_str();
  fleet
      ->add_option("--update-timeout-s", options.update_timeout_seconds,
                   "Fail an update not served everywhere after this long (default: derived from "
                   "full-direct's WAN bytes)")
      ->type_name("S")
      ->check(CLI::PositiveNumber.description(""));
  fleet
      ->add_option("--stream-seconds", options.stream_seconds,
                   "Length of the loopback stream comparison with iperf3; 0 skips it")
      ->type_name("S")
      ->check(CLI::Range(0, 600).description(""))
      ->capture_default_str();
  fleet
      ->add_option("--work-dir", options.work_dir,
                   "Scratch directory for drops, state and role logs (default: a fresh one "
                   "under $TMPDIR, removed at the end)")
      ->type_name("PATH");
  fleet->add_flag("--keep", options.keep, "Keep the work directory (drops, state, logs/)");
  fleet->add_flag("--pin", options.pin,
                  "Pin the publisher to CPU 0 and the relays and workers to the other CPUs, as\n"
                  "a trainer host and the fleet are separate hardware (needs 2+ CPUs)");
  fleet
      ->add_option("--markdown", options.markdown_out,
                   "Write the tables as the '## Fleet benchmark' section of this Markdown file "
                   "(replaced if present, else appended)")
      ->type_name("PATH");
  fleet->add_option("--json", options.json_out, "Also write the raw results as JSON here")
      ->type_name("PATH");
  fleet
      ->add_option("--rates-fp8-mb", options.rates_fp8_mb,
                   "Size of the generated FP8 pair the projection's encode and apply rates are "
                   "measured on (alone, one thread)")
      ->type_name("MB")
      ->check(CLI::Range(1, 16384).description(""))
      ->capture_default_str();
  fleet
      ->add_option("--rates-tls-mb", options.rates_tls_mb,
                   "Bytes of the TLS streams (direct and through a forwarder) the projection's "
                   "per-core rates are measured on")
      ->type_name("MB")
      ->check(CLI::Range(1, 65536).description(""))
      ->capture_default_str();
  fleet->add_flag("--projection-only", options.projection_only,
                  "Only measure the projection's input rates (each role alone) and print the\n"
                  "1 TiB FP8 projection: no fleet is started");
}

void AddFleetCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::FleetBenchOptions>();
  CLI::App* fleet = bench_app.add_subcommand(
      "fleet",
      "Benchmark cross-region weight sync on a local fleet of processes.\n"
      "Starts a publisher (region home), a relay and workers per region as separate\n"
      "flywheel processes on loopback, drops generated consecutive checkpoints (bf16,\n"
      "small optimiser steps) into the publisher's watch directory, and measures, per\n"
      "update, the time from the drop's COMMIT to every worker serving it with the expected\n"
      "weights hash, and the bytes that crossed the WAN. Three strategies side by side:\n"
      "  full-direct  full checkpoints from the publisher to every worker (the peer)\n"
      "  full-relay   full checkpoints through one relay per region\n"
      "  delta-relay  keyframes and sparse deltas through the relays (flywheel's default)\n"
      "  delta-relay-signed  the same with signed versions (only when named in --strategies;\n"
      "               checked within 2 % of delta-relay's median)\n"
      "  delta-relay-buffered  the same with a publisher that serves a delta only once it\n"
      "               is wholly encoded (--buffered-deltas; only when named): the peer of\n"
      "               the streamed publish, checked slower than delta-relay\n"
      "The publisher emulates the WAN (--wan-rate per remote region and direction, and\n"
      "--wan-latency-ms each way); relay -> worker links are unshaped. Checks: delta-relay\n"
      "within 1.3 x (delta bytes / WAN rate + RTT) + 0.5 s, and its WAN bytes at most 1/50\n"
      "of full-direct's. Ends with one loopback stream of flywheel (TCP, then TLS) against\n"
      "iperf3 with the same write size, as a ratio (target >= 0.70 for TCP).\n"
      "Needs about (1.7 x workers + 2.75 x relays + 2.5) x checkpoint bytes of memory\n"
      "(about 22 GB with the defaults); refuses to start with less.");
  fleet
      ->add_option("--flywheel", options->flywheel_binary,
                   "The flywheel binary whose roles are started (default: this one)")
      ->type_name("PATH");
  fleet
      ->add_option("--params", options->parameters,
                   "bf16 parameters per checkpoint (2 bytes each; default: a 1 GB checkpoint)")
      ->type_name("N")
      ->check(CLI::Range(uint64_t{32768}, uint64_t{1} << 40).description(""))
      ->capture_default_str();
  fleet->add_option("--updates", options->updates, "Measured updates after the initial version")
      ->type_name("N")
      ->check(CLI::Range(1, 10000).description(""))
      ->capture_default_str();
  fleet->add_option("--regions", options->regions, "Remote regions, each with a relay")
      ->type_name("N")
      ->check(CLI::Range(1, 64).description(""))
      ->capture_default_str();
  fleet->add_option("--workers-per-region", options->workers_per_region, "Workers per region")
      ->type_name("N")
      ->check(CLI::Range(1, 256).description(""))
      ->capture_default_str();
  fleet
      ->add_option("--strategies", options->strategies,
                   "Strategies to run, in this order (default: full-direct,full-relay,delta-relay)")
      ->type_name("LIST")
      ->delimiter(',')
      ->check(CLI::IsMember({bench::kFullDirect, bench::kFullRelay, bench::kDeltaRelay,
                                     bench::kDeltaRelaySigned, bench::kDeltaRelayBuffered}));
  fleet
      ->add_option("--wan-rate", options->wan_bytes_per_second,
                   "Emulated WAN rate in bytes/s per remote region and direction (1 Gbit/s)")
      ->type_name("B/s")
      ->check(CLI::Range(uint64_t{1000}, uint64_t{1} << 40).description(""))
      ->capture_default_str();
  fleet
      ->add_option("--wan-latency-ms", options->wan_latency_ms,
                   "Emulated one-way WAN latency (RTT is twice this)")
      ->type_name("MS")
      ->check(CLI::Range(0, 10000).description(""))
      ->capture_default_str();
  AddFleetRunOptions(fleet, *options);
  fleet->footer(
      "\nExamples:\n"
      "  flywheel bench fleet --params 20000000 --updates 2\n"
      "  flywheel bench fleet --strategies delta-relay --wan-rate 12500000 --wan-latency-ms 75\n"
      "  flywheel bench fleet --markdown docs/BENCHMARKS.md --json fleet.json");
  fleet->callback([options, &action] { action = [options] { return RunFleet(*options); }; });
}

void AddTrainerCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::TrainerReportOptions>();
  auto& b = options->bench;
  CLI::App* trainer = bench_app.add_subcommand(
      "trainer",
      "Benchmark the embedded trainer on the demo-size models (about 20M parameters).\n"
      "Throughput: forward_backward tokens/s of the dense and the MoE model with the fused\n"
      "PPO loss, against the same loss through forward_backward_custom (a no-grad forward\n"
      "for logprobs, the user's loss, then a forward+backward) on the same batch; the two\n"
      "losses are checked equal. Target: fused >= 1.4x custom.\n"
      "Sparsity: trains the dense model with SFT first, then takes PPO steps at each\n"
      "learning rate and reports the share of bf16 weights that change per step (what\n"
      "makes deltas small). Takes a few minutes on 2 cores.");
  trainer->add_option("--sequences", b.sequences, "Sequences per call")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  trainer->add_option("--length", b.sequence_length, "Tokens per sequence")
      ->capture_default_str()
      ->check(CLI::Range(2, 4096));
  trainer
      ->add_option("--reps", b.repetitions,
                   "Timed (fused, custom) pairs, order alternating (median and spread reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  trainer->add_option("--warmup", b.warmup, "Warm-up pairs (printed, left out of the statistics)")
      ->capture_default_str()
      ->check(CLI::Range(0, 100));
  trainer->add_flag("!--no-moe", b.moe, "Skip the MoE model");
  trainer
      ->add_option("--pretrain-steps", b.pretrain_steps,
                   "SFT steps before the sparsity measurement")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  trainer->add_option("--rl-steps", b.rl_steps, "PPO steps measured per learning rate")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  trainer->add_option("--lr", b.learning_rates, "Learning rates of the sparsity measurement")
      ->delimiter(',')
      ->type_name("LR[,LR...]")
      ->check(CLI::Range(1e-12, 0.5).description(""))
      ->capture_default_str();
  trainer->add_option("--threads", b.threads, "torch threads (0: one per hardware thread)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  trainer->add_option("--seed", b.seed, "Seed of the models and batches")->capture_default_str();
  trainer
      ->add_option("--markdown", options->markdown_out,
                   "Write the tables as the '## Trainer benchmark' section of this Markdown file")
      ->type_name("PATH");
  trainer->footer(
      "\nExamples:\n"
      "  flywheel bench trainer --sequences 4 --length 128 --no-moe\n"
      "  flywheel bench trainer --markdown docs/BENCHMARKS.md");
  MarkTorchOnly(trainer);
  trainer->callback([options, &action] {
    action = [options]() -> Status {
#ifdef FLYWHEEL_WITH_TORCH
      Status status = bench::RunTrainerReport(*options, std::cout);
#else
      Status status = TorchOnly("bench trainer");
#endif
      std::cout.flush();
      if (!status.ok()) return Failed("trainer benchmark failed", status);
      return Status::Ok();
    };
  });
}

void AddRolloutCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::RolloutReportOptions>();
  auto& b = options->bench;
  CLI::App* rollout = bench_app.add_subcommand(
      "rollout",
      "Benchmark the rollout engine on the demo-size models.\n"
      "Throughput: generated tokens/s of the dense and MoE models at each batch size.\n"
      "Swap: applies real deltas (a share of bf16 words changed) to a bf16 serving copy and\n"
      "patches the engine's fp32 mirror at the written words between two decode steps with\n"
      "requests in flight; reports the pause (target <= 50 ms) and checks the mirror equals\n"
      "the served weights. Memory: serving copy, mirror and KV cache against the bf16\n"
      "weights (target <= 3.2x + KV cache), and the process RSS growth.");
  rollout->add_option("--batch", b.batches, "Batch sizes")
      ->delimiter(',')
      ->type_name("N[,N...]")
      ->capture_default_str();
  rollout->add_option("--prompt-tokens", b.prompt_tokens, "Prompt length")
      ->capture_default_str()
      ->check(CLI::Range(1, 2048));
  rollout->add_option("--new-tokens", b.new_tokens, "Tokens generated per request")
      ->capture_default_str()
      ->check(CLI::Range(1, 2048));
  rollout->add_option("--swaps", b.swaps, "Measured swaps per model")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  rollout
      ->add_option("--changed", b.changed_fraction,
                   "Share of bf16 words changed per swapped version")
      ->capture_default_str()
      ->check(CLI::Range(1e-9, 0.999));
  rollout->add_flag("!--no-moe", b.moe, "Skip the MoE model");
  rollout->add_option("--threads", b.threads, "torch threads (0: one per hardware thread)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  rollout
      ->add_option("--markdown", options->markdown_out,
                   "Write the tables as the '## Rollout benchmark' section of this Markdown file")
      ->type_name("PATH");
  MarkTorchOnly(rollout);
  rollout->callback([options, &action] {
    action = [options]() -> Status {
#ifdef FLYWHEEL_WITH_TORCH
      Status status = bench::RunRolloutReport(*options, std::cout);
#else
      Status status = TorchOnly("bench rollout");
#endif
      std::cout.flush();
      if (!status.ok()) return Failed("rollout benchmark failed", status);
      return Status::Ok();
    };
  });
}

// `flywheel bench serving --quick`: the sizes of the CTest form.
void QuickServing(bench::ServingBenchOptions& o) {
  o.prompt_tokens = 16;
  o.max_tokens = 16;
  o.rounds = 1;
  o.check = false;
  o.prefixes = {.group_prompt_tokens = 128, .group_n = 4, .group_max_tokens = 8,
                .turns = 3, .turn_tokens = 32, .rounds = 1, .running = 4,
                .long_prompt_tokens = 200, .prefill_chunk = 16, .check_timing = false};
  o.structured = {.requests = 16, .concurrent = 8, .rounds = 1, .check_timing = false};
  o.decode = {.concurrent = 8, .prompt_tokens = 16, .steps = 6, .small_model = true, .check_timing = false};
}

void AddServingBenchCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::ServingBenchOptions>();
  CLI::App* serving = bench_app.add_subcommand(
      "serving",
      "Time to the first streamed token against the whole answer: the demo-size dense model\n"
      "behind a worker's completions route on loopback, the same seeded request streamed\n"
      "(stream: true) and whole. Checks the streamed text equals the whole answer's, the first\n"
      "token within 0.25x the whole answer's time, and the streamed end within 1.15x.\n"
      "Then shared prefixes, engine to engine: a group of n samples of one long prompt against\n"
      "one sample (and against the group with sharing off), and a multi-turn episode's prompt\n"
      "tokens prefilled against its history. Checks: the shared group equals the unshared one\n"
      "bit for bit, the episode prefills only its new tokens, the group within 1.6x one sample.\n"
      "Then chunked prefill: running requests' step time while a long prompt arrives, chunked\n"
      "and whole; checks the same answer both ways and the worst step within 1.5x undisturbed.\n"
      "Then structured outputs: JSON-schema answers (every one must parse and validate) and\n"
      "the guided decode step against an unguided one (target: within 15%). Then decode\n"
      "throughput of 32 sequences on a 167M-parameter model against OpenBLAS's GEMM GFLOP/s\n"
      "(target: at least half).");
  serving->add_option("--prompt-tokens", options->prompt_tokens, "Prompt length")
      ->capture_default_str()->check(CLI::Range(1, 512));
  serving->add_option("--max-tokens", options->max_tokens, "Tokens generated per answer")
      ->capture_default_str()->check(CLI::Range(1, 512));
  serving->add_option("--rounds", options->rounds, "Measured rounds (medians)")
      ->capture_default_str()->check(CLI::Range(1, 100));
  serving->add_option("--tokenizer", options->tokenizer,
                      "An HF tokenizer.json (or model directory); the model takes its vocabulary")
      ->type_name("PATH");
  serving->add_option("--threads", options->threads, "torch threads (0: one per hardware thread)")
      ->capture_default_str();
  serving->add_option("--group-prompt-tokens", options->prefixes.group_prompt_tokens,
                      "Shared prefixes: the group's prompt length")
      ->capture_default_str()->check(CLI::Range(2, 3000));
  serving->add_option("--group-n", options->prefixes.group_n, "Shared prefixes: samples per group")
      ->capture_default_str()->check(CLI::Range(2, 64));
  serving->add_option("--group-max-tokens", options->prefixes.group_max_tokens,
                      "Shared prefixes: tokens generated per sample (and per episode turn)")
      ->capture_default_str()->check(CLI::Range(1, 256));
  serving->add_option("--turns", options->prefixes.turns, "Shared prefixes: turns of the episode")
      ->capture_default_str()->check(CLI::Range(1, 16));
  serving->add_option("--turn-tokens", options->prefixes.turn_tokens,
                      "Shared prefixes: tokens each turn adds to the episode's history")
      ->capture_default_str()->check(CLI::Range(2, 600));
  serving->add_option("--running", options->prefixes.running,
                      "Chunked prefill: requests decoding when the long prompt arrives")
      ->capture_default_str()->check(CLI::Range(1, 64));
  serving->add_option("--long-prompt-tokens", options->prefixes.long_prompt_tokens,
                      "Chunked prefill: the arriving prompt's length")
      ->capture_default_str()->check(CLI::Range(2, 4000));
  serving->add_option("--prefill-chunk", options->prefixes.prefill_chunk,
                      "Chunked prefill: tokens of the long prompt prefilled per step")
      ->capture_default_str()->check(CLI::Range(1, 4000));
  serving->add_option("--section", options->section,
                      "Run only this part: http, prefixes, structured or decode (not with --markdown)")
      ->check(CLI::IsMember({"http", "prefixes", "structured", "decode"}));
  serving->add_option("--structured-requests", options->structured.requests,
                      "Structured outputs: JSON-schema answers sampled and validated")
      ->capture_default_str()->check(CLI::Range(1, 10000));
  serving->add_flag("--quick", [options](int64_t) { QuickServing(*options); },
                    "A short form for CTest: small sizes, one round; timing targets reported, not enforced\n"
                    "(exactness checks still fail the run)");
  serving->add_flag("!--no-check", options->check, "Report without failing on a missed target");
  serving->add_option("--markdown", options->markdown_out,
                      "Write the report as the '## Serving benchmark' section of this Markdown file")
      ->type_name("PATH");
  MarkTorchOnly(serving);
  serving->callback([options, &action] {
    action = [options]() -> Status {
#ifdef FLYWHEEL_WITH_TORCH
      Status status = bench::RunServingBench(*options, std::cout);
#else
      Status status = TorchOnly("bench serving");
#endif
      std::cout.flush();
      if (!status.ok()) return Failed("serving benchmark failed", status);
      return Status::Ok();
    };
  });
}

void AddTrainingApiBenchCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::TrainingApiBenchOptions>();
  CLI::App* api = bench_app.add_subcommand(
      "training-api",
      "The training service's API against the in-process trainer, on the demo's model and\n"
      "batch over loopback HTTP: forward_backward's overhead (target <= 1.10x), a loss computed\n"
      "by the client (forward + forward_backward_custom) vs built-in, and two LoRA sessions\n"
      "trained at once vs one after the other. Checks losses match and the adapters agree.");
  api->add_option("--rounds", options->rounds, "Timed pairs (medians)")
      ->capture_default_str()->check(CLI::Range(1, 1000));
  api->add_option("--lora-steps", options->lora_steps, "Steps per LoRA session")
      ->capture_default_str()->check(CLI::Range(1, 1000));
  api->add_option("--threads", options->threads, "Compute threads (0: one per hardware thread)")
      ->capture_default_str();
  api->add_flag("!--no-check", options->check, "Report without failing on a missed target");
  api->add_option("--markdown", options->markdown_out,
                  "Write the report as the '## Training API benchmark' section of this Markdown file")
      ->type_name("PATH");
  MarkTorchOnly(api);
  api->callback([options, &action] {
    action = [options]() -> Status {
#ifdef FLYWHEEL_WITH_TORCH
      Status status = bench::RunTrainingApiBench(*options, std::cout);
#else
      Status status = TorchOnly("bench training-api");
#endif
      std::cout.flush();
      if (!status.ok()) return Failed("training API benchmark failed", status);
      return Status::Ok();
    };
  });
}

void AddPackedExpertsBenchCommand(CLI::App& bench_app, Action& action) {
  auto o = std::make_shared<bench::PackedExpertsBenchOptions>();
  CLI::App* packed = bench_app.add_subcommand(
      "packed-experts",
      "LoRA training of a MoE model with its frozen experts packed (fp8 128x128 block scales,\n"
      "int8 per-row, int4 per group of 32; power-of-two scales) against the same training\n"
      "unpacked: frozen-expert memory vs bf16 (target <= 0.30x) and step time vs unpacked\n"
      "(target <= 1.20x). Checks that packed training equals unpacked training on the\n"
      "dequantized experts (loss and adapter gradients to 1e-6).");
  packed->add_option("--hidden", o->hidden, "Hidden size")->capture_default_str()
      ->check(CLI::Range(8, 8192));
  packed->add_option("--layers", o->layers, "MoE layers")->capture_default_str()
      ->check(CLI::Range(1, 64));
  packed->add_option("--experts", o->experts, "Experts per layer")->capture_default_str()
      ->check(CLI::Range(1, 512));
  packed->add_option("--top-k", o->top_k, "Experts per token")->capture_default_str()
      ->check(CLI::Range(1, 64));
  packed->add_option("--expert-intermediate", o->expert_intermediate, "Expert MLP width")
      ->capture_default_str()->check(CLI::Range(1, 65536));
  packed->add_option("--sequences", o->sequences, "Sequences per step")->capture_default_str()
      ->check(CLI::Range(1, 1024));
  packed->add_option("--tokens", o->tokens, "Tokens per sequence")->capture_default_str()
      ->check(CLI::Range(1, 8192));
  packed->add_option("--rounds", o->rounds, "Timed rounds (medians)")->capture_default_str()
      ->check(CLI::Range(1, 1000));
  packed->add_option("--threads", o->threads, "Compute threads (0: one per hardware thread)")
      ->capture_default_str();
  packed->add_flag("!--no-check", o->check, "Report without failing on a missed target");
  packed->add_option("--markdown", o->markdown_out,
                     "Write the report as the '## Packed experts benchmark' section of this "
                     "Markdown file")
      ->type_name("PATH");
  MarkTorchOnly(packed);
  packed->callback([o, &action] {
    action = [o]() -> Status {
#ifdef FLYWHEEL_WITH_TORCH
      Status status = bench::RunPackedExpertsBench(*o, std::cout);
#else
      Status status = TorchOnly("bench packed-experts");
#endif
      std::cout.flush();
      if (!status.ok()) return Failed("packed experts benchmark failed", status);
      return Status::Ok();
    };
  });
}

// `--small` takes Fp8BenchOptions::Small() for every size option not given on the line.
struct Fp8Args {
  bench::Fp8BenchOptions options;
  bool small = false;
  std::vector<std::pair<CLI::Option*, std::function<void(bench::Fp8BenchOptions&)>>> sized;
};

[[maybe_unused]] bench::Fp8BenchOptions Fp8Options(const Fp8Args& args) {
  if (!args.small) return args.options;
  bench::Fp8BenchOptions options = args.options;
  const bench::Fp8BenchOptions small = bench::Fp8BenchOptions::Small();
  options.hidden = small.hidden;
  options.layers = small.layers;
  options.sft_steps = small.sft_steps;
  options.rl_steps = small.rl_steps;
  options.sequence_length = small.sequence_length;
  for (const auto& [option, keep_given] : args.sized) {
    if (option->count() > 0) keep_given(options);
  }
  return options;
}

// The options `--small` gives other values unless they are on the line.
void AddFp8SizeOptions(CLI::App& fp8_app, Fp8Args& args) {
  CLI::App* fp8 = &fp8_app;
  bench::Fp8BenchOptions& o = args.options;
  auto sized = [&](CLI::Option* option, auto field) {
    args.sized.emplace_back(option,
                            [field, &o](bench::Fp8BenchOptions& to) { to.*field = o.*field; });
    return option;
  };
  sized(fp8->add_option("--hidden", o.hidden, "Hidden size: the model's size (a multiple of 64)"),
        &bench::Fp8BenchOptions::hidden)
      ->capture_default_str()
      ->check(CLI::Range(128, 8192));
  sized(fp8->add_option("--layers", o.layers, "Transformer layers"),
        &bench::Fp8BenchOptions::layers)
      ->capture_default_str()
      ->check(CLI::Range(1, 128));
  sized(
      fp8->add_option("--sft-steps", o.sft_steps, "SFT steps (AdamW, lr 1e-3) before the RL steps"),
      &bench::Fp8BenchOptions::sft_steps)
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  sized(fp8->add_option("--rl-steps", o.rl_steps, "Measured RL (PPO) steps"),
        &bench::Fp8BenchOptions::rl_steps)
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  sized(fp8->add_option("--length", o.sequence_length, "Tokens per sequence"),
        &bench::Fp8BenchOptions::sequence_length)
      ->capture_default_str()
      ->check(CLI::Range(4, 4096));
}

void AddFp8BenchCommand(CLI::App& bench_app, Action& action) {
  auto args = std::make_shared<Fp8Args>();
  bench::Fp8BenchOptions& o = args->options;
  CLI::App* fp8 = bench_app.add_subcommand(
      "fp8",
      "FP8 against BF16 serving of the same trainer masters, one run on a dense model: per RL\n"
      "step at lr 1e-6 after a short SFT, the share of served words changed and the delta (as\n"
      "the publisher encodes it) as % of the FP8 and BF16 checkpoints (goal <= 1.5%; peers:\n"
      "zstd -19 and -3 of the XOR of consecutive FP8 checkpoints, the full checkpoint); bits\n"
      "per changed F8 byte against the entropy floor (target <= 1.05x); k3 sampler vs trainer\n"
      "for FP8 without and with QAT and for BF16 (target: QAT <= 2x BF16). Checks that every\n"
      "delta rebuilds the next checkpoint and the peers round-trip.");
  fp8->add_flag("--small", args->small,
                "A quick run: hidden 256, 2 layers, 8 SFT steps, 2 RL steps, 32-token sequences "
                "(options given on the line still apply)");
  AddFp8SizeOptions(*fp8, *args);
  fp8->add_option("--vocab", o.vocab, "Vocabulary size (embeddings and lm_head stay BF16)")
      ->capture_default_str()
      ->check(CLI::Range(64, 1 << 20));
  fp8->add_option("--lr", o.rl_lr, "Learning rate of the RL steps")
      ->capture_default_str()
      ->check(CLI::Range(1e-12, 0.5));
  fp8->add_option("--block", o.block, "FP8 block size (TrainerOptions::fp8_block)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  fp8->add_flag("!--no-peers", o.run_peers, "Skip the zstd peers");
  fp8->add_option("--threads", o.threads, "torch threads (0: one per hardware thread)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  fp8->add_option("--seed", o.seed, "Seed of the model and batches")->capture_default_str();
  fp8->add_option("--markdown", o.markdown_out,
                  "Write the tables as the '## FP8 benchmark' section of this Markdown file")
      ->type_name("PATH");
  fp8->footer(
      "\nExamples:\n"
      "  flywheel bench fp8 --small\n"
      "  flywheel bench fp8 --markdown docs/BENCHMARKS.md");
  MarkTorchOnly(fp8);
  fp8->callback([args, &action] {
    action = [args]() -> Status {
#ifdef FLYWHEEL_WITH_TORCH
      Status status = bench::RunFp8Bench(Fp8Options(*args), std::cout);
#else
      Status status = TorchOnly("bench fp8");
#endif
      std::cout.flush();
      if (!status.ok()) return Failed("FP8 benchmark failed", status);
      return Status::Ok();
    };
  });
}

void AddParityCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::ParityReportOptions>();
  auto& b = options->bench;
  CLI::App* parity = bench_app.add_subcommand(
      "parity",
      "Check that the trainer trains what the engine sampled.\n"
      "The engine samples from the served bf16 weights of the demo-size dense and MoE models;\n"
      "the trainer recomputes the same sequences' logprobs on those very weights (MoE without\n"
      "and with routing replay) and on its fp32 masters. Reports mean k3 and max |delta\n"
      "logprob|; target k3 <= 1e-6 on the served weights.");
  parity->add_option("--requests", b.requests, "Sampled sequences")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  parity->add_option("--prompt-tokens", b.prompt_tokens, "Prompt length")
      ->capture_default_str()
      ->check(CLI::Range(1, 90));
  parity->add_option("--new-tokens", b.new_tokens, "Sampled tokens per sequence")
      ->capture_default_str()
      ->check(CLI::Range(1, 2048));
  parity->add_option("--sft-steps", b.sft_steps, "SFT steps that sharpen the models first")
      ->capture_default_str()
      ->check(CLI::Range(0, 10000));
  parity->add_flag("!--no-moe", b.moe, "Skip the MoE model");
  parity->add_option("--threads", b.threads, "torch threads (0: one per hardware thread)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  parity
      ->add_option("--markdown", options->markdown_out,
                   "Write the table as the '## Parity benchmark' section of this Markdown file")
      ->type_name("PATH");
  MarkTorchOnly(parity);
  parity->callback([options, &action] {
    action = [options]() -> Status {
#ifdef FLYWHEEL_WITH_TORCH
      Status status = bench::RunParityReport(*options, std::cout);
#else
      Status status = TorchOnly("bench parity");
#endif
      std::cout.flush();
      if (!status.ok()) return Failed("parity benchmark failed", status);
      return Status::Ok();
    };
  });
}

void AddStartupCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::StartupBenchOptions>();
  CLI::App* startup = bench_app.add_subcommand(
      "startup",
      "Benchmark what a command costs before it does anything: the torch-free flywheel\n"
      "against flywheel-torch (libtorch loaded at start, as every command was before the\n"
      "split), with /bin/true and python3 -c pass as peers. Wall time of --help and of\n"
      "`checkpoint hash` of a 1 MB checkpoint, and the resident memory of an idle publisher,\n"
      "relay and model-less worker started by each. Fails when flywheel's --help or hash\n"
      "takes over 50 ms or an idle relay or worker holds over 40 MB.");
  startup->add_option("--reps", options->reps, "Runs per command (median reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  startup->add_flag("!--no-check", options->check, "Report without failing on a missed target");
  startup->add_flag("--cold", options->cold,
                    "Drop the page cache before each timed run (root; target 100 ms)");
  startup
      ->add_option("--markdown", options->markdown_out,
                   "Write the table as the '## Startup benchmark' section of this Markdown file")
      ->type_name("PATH");
  startup->callback([options, &action] {
    action = [options]() -> Status {
      Status status = bench::RunStartupBench(*options, std::cout);
      std::cout.flush();
      if (!status.ok()) return Failed("startup benchmark failed", status);
      return Status::Ok();
    };
  });
}

void AddPushBenchCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::PushBenchOptions>();
  auto size_mb = std::make_shared<uint64_t>(1024);
  auto link_gbit = std::make_shared<double>(1.0);
  CLI::App* push = bench_app.add_subcommand(
      "push",
      "Benchmark bring-your-own-trainer pushes end to end: a publisher (push API), a relay and\n"
      "workers on loopback, the upload link shaped in a proxy; pushes v1 in full, then AdamW\n"
      "steps as local deltas, each until every worker serves it; curl -T of the full file\n"
      "over the same link is the peer. Checks the workers' weights hashes, that a delta push\n"
      "uploads <= 1/40 of the checkpoint, and push -> all serving <= 1.3 x the wire floor +\n"
      "the fleet's own sync time.");
  push->add_option("--size-mb", *size_mb, "Checkpoint size (bf16)")->capture_default_str()
      ->check(CLI::Range(uint64_t{4}, uint64_t{16384}));
  push->add_option("--link-gbit", *link_gbit, "Upload link rate (0: unshaped)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 400.0));
  push->add_option("--workers", options->workers, "Workers behind the relay")->capture_default_str();
  push->add_option("--steps", options->steps, "Delta pushes after the full one")->capture_default_str();
  push->add_option("--threads", options->threads, "Encode and publisher threads")->capture_default_str();
  push->add_option("--work-dir", options->work_dir, "Scratch directory (default: a temporary one)");
  push->add_flag("--keep", options->keep, "Keep the work directory (logs, state)");
  push->add_flag("!--no-check", options->check, "Report without failing on a missed target");
  push->add_option("--markdown", options->markdown_out,
                   "Write the table as the '## Push benchmark' section of this Markdown file")
      ->type_name("PATH");
  push->callback([options, size_mb, link_gbit, &action] {
    action = [options, size_mb, link_gbit]() -> Status {
      options->checkpoint_bytes = *size_mb << 20;
      options->link_bits_per_s = *link_gbit * 1e9;
      Status status = bench::RunPushBench(*options, std::cout);
      std::cout.flush();
      if (!status.ok()) return Failed("push benchmark failed", status);
      return Status::Ok();
    };
  });
}

void AddSigningBenchCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::SigningBenchOptions>();
  auto size_mb = std::make_shared<uint64_t>(1024);
  CLI::App* signing = bench_app.add_subcommand(
      "signing",
      "What signed versions cost per version: Ed25519 sign/verify of a manifest, and the\n"
      "SHA-256 of a real delta and keyframe of an RL-like AdamW step (publisher and each\n"
      "receiver), against openssl speed -evp sha256 (one core). Checks <= 5 ms per manifest.");
  signing->add_option("--size-mb", *size_mb, "Checkpoint size (bf16)")->capture_default_str()
      ->check(CLI::Range(uint64_t{4}, uint64_t{16384}));
  signing->add_option("--lr", options->learning_rate, "AdamW learning rate of the step")->capture_default_str();
  signing->add_option("--rounds", options->rounds, "Manifest sign/verify repetitions")->capture_default_str()
      ->check(CLI::Range(1, 100000));
  signing->add_option("--threads", options->threads, "Generation and encode threads")->capture_default_str();
  signing->add_flag("!--no-check", options->check, "Report without failing on a missed target");
  signing->add_option("--markdown", options->markdown_out,
                      "Write the report as the '## Signing benchmark' section of this Markdown file")
      ->type_name("PATH");
  signing->callback([options, size_mb, &action] {
    action = [options, size_mb]() -> Status {
      options->checkpoint_bytes = *size_mb << 20;
      Status status = bench::RunSigningBench(*options, std::cout);
      std::cout.flush();
      if (!status.ok()) return Failed("signing benchmark failed", status);
      return Status::Ok();
    };
  });
}

void AddTokenizerBenchCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::TokenizerBenchOptions>();
  CLI::App* tokenizer = bench_app.add_subcommand(
      "tokenizer",
      "Encode throughput of an HF tokenizer.json on one thread, on generated mixed-language\n"
      "text, against @huggingface/tokenizers (node, installed from npm when missing) on the same\n"
      "text, whose ids must equal ours. Checks >= 20 MB/s.");
  tokenizer->add_option("--tokenizer", options->tokenizer, "tokenizer.json or a model directory")
      ->required()->type_name("PATH");
  tokenizer->add_option("--megabytes", options->megabytes, "Size of the text")->capture_default_str()
      ->check(CLI::Range(0.01, 1024.0));
  tokenizer->add_option("--rounds", options->rounds, "Timed encodes (the best counts)")
      ->capture_default_str()->check(CLI::Range(1, 100));
  tokenizer->add_option("--min-mb-per-s", options->min_mb_per_s, "The throughput target")
      ->capture_default_str();
  tokenizer->add_option("--reference-dir", options->reference_dir,
                        "A folder whose node_modules has @huggingface/tokenizers (default: "
                        "~/.cache/flywheel/npm-tokenizers, installed when missing)")
      ->type_name("DIR");
  tokenizer->add_flag("!--no-reference", options->reference, "Do not run the reference");
  tokenizer->add_flag("!--no-check", options->check, "Report without failing on a missed target");
  tokenizer->add_option("--markdown", options->markdown_out,
                        "Write the report as the '## Tokenizer benchmark' section of this Markdown file")
      ->type_name("PATH");
  tokenizer->callback([options, &action] {
    action = [options]() -> Status {
      Status status = bench::RunTokenizerBench(*options, std::cout);
      std::cout.flush();
      if (!status.ok()) return Failed("tokenizer benchmark failed", status);
      return Status::Ok();
    };
  });
}

void AddStreamBenchCommand(CLI::App& bench_app, Action& action) {
  auto options = std::make_shared<bench::LoopbackStreamOptions>();
  CLI::App* stream = bench_app.add_subcommand(
      "stream",
      "One flywheel data stream over loopback against its peers: iperf3's single TCP stream\n"
      "and openssl speed -evp aes-128-gcm on one core (the crypto floor), then flywheel's\n"
      "framed stream plain, with TLS 1.3, and with TLS 1.3 over several connections.\n"
      "Checks TCP >= 0.70 x iperf3 and one TLS stream >= 0.60 x iperf3.");
  stream->add_option("--seconds", options->seconds, "iperf3's duration (flywheel moves as much)")
      ->capture_default_str()
      ->check(CLI::Range(1, 600));
  stream->add_option("--streams", options->streams, "Connections in the multi-stream TLS run")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  stream->add_flag("!--no-check", options->check, "Report without failing on a missed target");
  stream->add_option("--markdown", options->markdown_out,
                     "Write the table as the '## Loopback stream benchmark' section of this "
                     "Markdown file")
      ->type_name("PATH");
  stream->callback([options, &action] {
    action = [options]() -> Status {
      Status status = bench::RunLoopbackStreamBench(*options, std::cout);
      std::cout.flush();
      if (!status.ok()) return Failed("stream benchmark failed", status);
      return Status::Ok();
    };
  });
}

}  // namespace

void AddBenchCommands(CLI::App& app, Action& action) {
  CLI::App* bench_app = app.add_subcommand("bench", "Benchmarks that also check their results");
  bench_app->require_subcommand(1);
  bench_app->footer(
      "\nExamples:\n  flywheel bench codec --size-mb 64 --no-peers\n"
      "  flywheel bench fleet --params 20000000 --updates 2");

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

  AddFleetCommand(*bench_app, action);
  AddStartupCommand(*bench_app, action);
  AddPushBenchCommand(*bench_app, action);
  AddSigningBenchCommand(*bench_app, action);
  AddTokenizerBenchCommand(*bench_app, action);
  AddServingBenchCommand(*bench_app, action);
  AddTrainingApiBenchCommand(*bench_app, action);
  AddPackedExpertsBenchCommand(*bench_app, action);
  AddFp8BenchCommand(*bench_app, action);
  AddStreamBenchCommand(*bench_app, action);
  AddTrainerCommand(*bench_app, action);
  AddRolloutCommand(*bench_app, action);
  AddParityCommand(*bench_app, action);
  AddEgressBenchCommand(*bench_app, action);
  AddChurnBenchCommand(*bench_app, action);
  AddJoinBenchCommand(*bench_app, action);

  AddPipelineBenchCommand(*bench_app, action);
}

}  // namespace flywheel::tools
