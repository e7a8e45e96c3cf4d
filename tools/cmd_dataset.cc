// `flywheel dataset make` (the demo's digit tasks as JSONL files) and `flywheel model
// make-tiny` (the demo's tiny model as an HF model directory): the files `flywheel demo`
// trains on, and that `flywheel train --model DIR --dataset F` takes.
#include <CLI/CLI.hpp>
#include <iostream>
#include <memory>
#include <string>

#include "pipeline/run_config.h"
#include "pipeline/task.h"
#include "tools/commands.h"
#ifdef FLYWHEEL_WITH_TORCH
#include "rl/trainer_process.h"
#endif

namespace flywheel::tools {
namespace {

struct DatasetArgs {
  pipeline::TaskFilesOptions files;
  int64_t count = 4000, eval_count = 256, seed = 1;
  // model make-tiny
  std::string out_dir;
  bool moe = false;
};

Status RunDatasetMake(const std::string& task, DatasetArgs args) {
  if (args.count < 1) return Status::InvalidArgument("--count must be at least 1, got " + std::to_string(args.count));
  if (args.eval_count < 1) {
    return Status::InvalidArgument("--eval-count must be at least 1, got " + std::to_string(args.eval_count));
  }
  args.files.task.name = task;
  args.files.count = static_cast<size_t>(args.count);
  args.files.eval_count = static_cast<size_t>(args.eval_count);
  args.files.seed = static_cast<uint64_t>(args.seed);
  Result<pipeline::TaskFilesWritten> written = pipeline::MakeTaskFiles(args.files);
  if (!written.ok()) return Failed("dataset make " + task, written.status());
  std::cout << "wrote " << written->train << " training lines to " << args.files.out;
  if (!args.files.eval_out.empty()) std::cout << ", " << written->eval << " held-out lines to " << args.files.eval_out;
  if (!args.files.sft_out.empty()) std::cout << ", " << written->sft << " SFT examples to " << args.files.sft_out;
  std::cout << std::endl;
  return Status::Ok();
}

Status RunMakeTiny(const DatasetArgs& args) {
#ifdef FLYWHEEL_WITH_TORCH
  pipeline::RunConfig config;
  config.task.name = args.files.task.name;
  config.task.digits = args.files.task.digits;
  config.model.preset = args.moe ? "tiny-moe" : "tiny";
  config.run.seed = args.seed;
  FW_RETURN_IF_ERROR(config.Validate());
  Status written = rl::WriteTinyModelDir(config, args.out_dir);
  if (!written.ok()) return Failed("model make-tiny", written);
  std::cout << "wrote " << config.model.preset << " to " << args.out_dir
            << " (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)" << std::endl;
  return Status::Ok();
#else
  return TorchOnly("model make-tiny");
#endif
}

void AddMakeFlags(CLI::App* make, DatasetArgs& args) {
  make->add_option("--out", args.files.out, "The RL JSONL of the training part")->type_name("F")->required();
  make->add_option("--eval-out", args.files.eval_out,
                   "The held-out part as another RL JSONL (disjoint from --out by construction)")
      ->type_name("F");
  make->add_option("--sft", args.files.sft_out,
                   "Also --count SFT examples of the training part ({\"messages\": [user, assistant]})")
      ->type_name("F");
  make->add_option("--count", args.count, "Training lines (and SFT examples)")->capture_default_str();
  make->add_option("--eval-count", args.eval_count, "Distinct held-out problems (fewer when the part is smaller)")
      ->capture_default_str();
  make->add_option("--digits", args.files.task.digits, "sort/reverse: string length; add: digits per operand")
      ->capture_default_str();
  make->add_option("--seed", args.seed, "Random seed")->capture_default_str();
}

}  // namespace

void AddDatasetCommands(CLI::App& app, Action& action) {
  CLI::App* dataset = app.add_subcommand("dataset", "Datasets as JSONL files");
  dataset->require_subcommand(1);
  CLI::App* make = dataset->add_subcommand(
      "make",
      "The demo's verifiable digit tasks as JSONL files: an RL JSONL of the training part,\n"
      "one line per problem, {\"messages\": [{\"role\": \"user\", \"content\": \"3142>\"}],\n"
      "\"answer\": \"1234\"}; with --eval-out the held-out part (prompts training never sees,\n"
      "split by a hash of the prompt), with --sft SFT examples {\"messages\": [user, assistant]}.\n"
      "Tasks: sort (\"3142>\" -> \"1234\"), reverse (\"3142>\" -> \"2413\"), add (\"47+85=\" -> \"132\").\n"
      "Files are written atomically.");
  make->require_subcommand(1);
  for (const char* task : {"sort", "reverse", "add"}) {
    auto args = std::make_shared<DatasetArgs>();
    CLI::App* sub = make->add_subcommand(task, std::string("The ") + task + " task");
    AddMakeFlags(sub, *args);
    const std::string name = task;
    sub->callback([args, name, &action] { action = [args, name] { return RunDatasetMake(name, *args); }; });
  }
  make->footer(
      "\nExamples:\n"
      "  flywheel dataset make sort --out train.jsonl --eval-out eval.jsonl --sft sft.jsonl\n"
      "  flywheel dataset make add --digits 3 --count 10000 --out add.jsonl");

  CLI::App* model = app.add_subcommand("model", "Model directories");
  model->require_subcommand(1);
  auto args = std::make_shared<DatasetArgs>();
  CLI::App* tiny = model->add_subcommand(
      "make-tiny",
      "The demo's tiny model as an HF model directory: config.json, model.safetensors (F32,\n"
      "initialised as the trainer initialises it for --seed), tokenizer.json (the digits,\n"
      "+ = >, <s> and </s>) and tokenizer_config.json with a minimal chat template.\n"
      "`flywheel train --model DIR` and `flywheel demo --model DIR` start from it.");
  tiny->add_option("--out", args->out_dir, "The directory (created if missing)")->type_name("DIR")->required();
  tiny->add_flag("--moe", args->moe, "The MoE variant (tiny-moe)");
  tiny->add_option("--seed", args->seed, "The initialisation's seed (run.seed)")->capture_default_str();
  MarkTorchOnly(tiny);
  tiny->callback([args, &action] { action = [args] { return RunMakeTiny(*args); }; });
}

}  // namespace flywheel::tools
