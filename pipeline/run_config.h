// The run configuration of a pipeline-RL run: one TOML file, every value defaulted, unknown
// keys and wrong types are errors that name the key. `flywheel demo` writes the file it
// runs with into its report directory, so a run can be repeated with `--config`.
//
//   [run]        seed, max_steps, time_limit_s, target_accuracy (stop when reached; 0: run
//                all steps), eval_every, eval_prompts, threads (trainer), state_every,
//                check_memory (true: the trainer refuses a run whose memory plan,
//                model/memory_plan.h, does not fit this machine)
//   [model]      preset ("tiny", "tiny-moe"), config (a config.json; overrides the preset),
//                dir (an HF model directory: config.json, safetensors weights sharded or
//                not, tokenizer.json, tokenizer_config.json's chat template; the trainer
//                starts from its weights and the workers serve its tokenizer),
//                routing_replay (MoE: train on the experts the sampler used), serving
//                ("bf16", or "fp8": projection weights F8_E4M3 with 128x128 block scales),
//                fp8_qat (with fp8: train on the fake-quantized weights workers serve)
//   [task]       name (sort, reverse, add), digits; dataset (an RL JSONL: prompts from its
//                "messages", its other fields handed to the grader; replaces the generated
//                task), eval_dataset (its held-out lines; empty: eval_fraction of the
//                prompts, 0.125, held out by a hash of the prompt)
//   [algorithm]  name (grpo, dapo, gspo, cispo), group_size, groups_per_step, lr,
//                temperature, clip_low, clip_high, tis_cap, weight_decay, grad_clip,
//                max_tokens (per completion; 0: the task's longest answer + 1),
//                zero_variance_filter (drop groups whose graded rewards are all equal),
//                kl_coef (KL penalty against the policy RL started from; 0: none)
//   [grading]    command (an external grader process, docs/GRADERS.md), url (one over
//                HTTP), timeout_s (per sample), max_failures (ungraded in a row before the
//                run stops), max_in_flight, max_turns (> 1: an environment that may answer
//                with messages; docs/GRADERS.md), max_episode_tokens; neither command nor
//                url: the [[grader]] tables
//   [[grader]]   built-in graders, summed by weight: type, weight, name, and the type's
//                parameters (docs/GRADERS.md); none at all: exact_match against "answer"
//   [sft]        dataset (JSONL, OpenAI chat format), steps, batch_size, lr
//   [dpo]        dataset (JSONL preference pairs), steps, batch_size, lr, beta
//   [pipeline]   max_staleness (0: synchronous, generate then train), lease_s
//   [fleet]      regions, workers_per_region, wan_rate_mbit, wan_latency_ms,
//                keyframe_every, worker_max_batch
//   [shape]      name, max_context, kv_cache_mib: set by --shape (pipeline/shapes.h), not
//                by hand
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "grading/grader.h"
#include "pipeline/task.h"

namespace flywheel::pipeline {

struct RunConfig {
  struct Run {
    int64_t seed = 1;
    int64_t max_steps = 5000;
    double time_limit_s = 600;
    double target_accuracy = 0.8;
    int64_t eval_every = 5;
    int64_t eval_prompts = 256;
    int64_t threads = 1;
    int64_t state_every = 1;
    bool check_memory = true;
  } run;
  struct Model {
    std::string preset = "tiny";
    std::string config;
    std::string dir;
    bool routing_replay = true;
    std::string serving = "bf16";
    bool fp8_qat = false;
  } model;
  TaskConfig task;
  struct Algorithm {
    std::string name = "grpo";
    int64_t group_size = 8;
    int64_t groups_per_step = 8;
    double lr = 5e-5;
    double temperature = 1.0;
    double clip_low = 0.2;
    double clip_high = 0.2;  // dapo: 0.28 unless set
    double tis_cap = 2.0;
    double weight_decay = 0.0;
    double grad_clip = 1.0;
    int64_t max_tokens = 0;
    bool zero_variance_filter = true;
    double kl_coef = 0;  // > 0: k3 KL against the policy RL started from, in the loss
  } algorithm;
  struct Grading {
    std::string command;
    std::string url;
    double timeout_s = 30;
    int64_t max_failures = 20;
    int64_t max_in_flight = 64;
    int64_t max_turns = 1;             // > 1: the grader is a multi-turn environment
    int64_t max_episode_tokens = 1024;  // model and environment tokens of one episode
  } grading;
  // The [[grader]] tables in order (empty: exact_match against "answer" unless grading
  // names a command or url).
  std::vector<grading::GraderSpec> graders;
  struct Sft {
    std::string dataset;
    int64_t steps = 0;
    int64_t batch_size = 32;
    double lr = 1e-3;
  } sft;
  struct Dpo {
    std::string dataset;
    int64_t steps = 0;
    int64_t batch_size = 16;
    double lr = 1e-4;
    double beta = 0.1;
  } dpo;
  struct Pipeline {
    int64_t max_staleness = 2;
    double lease_s = 20;
  } pipeline;
  struct Fleet {
    std::vector<std::string> regions = {"us", "eu"};
    int64_t workers_per_region = 2;
    double wan_rate_mbit = 100;
    double wan_latency_ms = 20;
    int64_t keyframe_every = 20;
    int64_t worker_max_batch = 64;
  } fleet;
  // The training shape the run was made with (pipeline/shapes.h; "" none) and the limits it
  // sets, which the trainer checks at start: the longest sequence (prompt + completion), and
  // each worker's KV-cache budget. 0: no limit.
  struct ShapeLimits {
    std::string name;
    int64_t max_context = 0;
    int64_t kv_cache_mib = 0;
  } shape;

  // Range checks; messages name the key ("algorithm.group_size = 1: ...").
  Status Validate() const;
  // Parses TOML text (`source` names it in errors); validates.
  static Result<RunConfig> FromToml(const std::string& text, const std::string& source);
  static Result<RunConfig> Load(const std::string& path);
  // Every key with its value, in the sections above (parses back to the same config).
  std::string ToToml() const;
  // Overrides one key from "section.key=value" (the CLI's --set).
  Status Set(const std::string& assignment);
};

}  // namespace flywheel::pipeline
