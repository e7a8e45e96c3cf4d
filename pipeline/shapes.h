// Training shapes (issue 36): named profiles that fix a run's limits and layout, so a user
// names a shape instead of tuning each key, and the service side knows what it must hold.
// Shipped as TOML files in shapes/ (built into the binary); a user's own in --shapes-dir
// (one *.toml a shape; a user shape of a shipped shape's name replaces it).
//
//   name = "cpu-small"                  # the file's shape; required
//   description = "..."
//   [model]    max_context = 2048       # longest sequence, prompt + completion (required)
//              mode = "full"            # or "lora"
//              lora_rank = [8, 64]      # "lora": the allowed rank range
//   [trainer]  threads = 2              # run.threads
//              data_parallel_ranks = 1
//   [workers]  max_batch = 16           # fleet.worker_max_batch
//              kv_cache_mib = 512       # each worker's KV-cache budget (0: none)
//   [serving]  dtype = "bf16"           # model.serving ("bf16" or "fp8")
//
// A shape owns the run.toml keys it sets (Owned()): run.threads, fleet.worker_max_batch,
// model.serving and the [shape] section. `--shape NAME` with a --set or a --config entry
// for one of them is refused by name, as the training-loop keys (lr, group size, ...) stay
// free. `flywheel train` and `flywheel demo` train full weights on one trainer rank: a LoRA
// shape or one with data_parallel_ranks > 1 is refused for them, saying so. The trainer
// checks the limits at start (CheckShapeLimits).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "pipeline/run_config.h"

namespace flywheel::pipeline {

struct Shape {
  std::string name, description;
  std::string source;  // "shipped" or the file's path
  int64_t max_context = 0;
  std::string mode = "full";
  int64_t lora_rank_min = 0, lora_rank_max = 0;
  int64_t trainer_threads = 1;
  int64_t data_parallel_ranks = 1;
  int64_t worker_max_batch = 32;
  int64_t kv_cache_mib = 0;
  std::string serving = "bf16";

  // The run.toml keys the shape owns, as "section.key" with the value it gives them.
  std::vector<std::pair<std::string, std::string>> Owned() const;
  // Parses one shape file. InvalidArgument naming `source:key` for a missing, mistyped,
  // out-of-range or unknown key.
  static Result<Shape> FromToml(const std::string& text, const std::string& source);
};

// The shipped shapes, then `user_dir`'s (empty: none) replacing any of the same name. A
// malformed file is an error naming it and its key; a missing directory is NotFound.
Result<std::vector<Shape>> LoadShapes(const std::string& user_dir);
// NotFound naming the shapes there are.
Result<Shape> FindShape(const std::string& name, const std::string& user_dir);

// Sets the keys `shape` owns on `config` (and its [shape] section). `user_keys`: the
// "section.key"s the user set (--set, --config); one the shape owns is InvalidArgument
// naming it and the shape. `command`: "train" or "demo", for the refusal of shapes it
// cannot run (LoRA, several data-parallel ranks).
Status ApplyShape(const Shape& shape, const std::vector<std::string>& user_keys, const std::string& command,
                  RunConfig& config);

// The "section.key"s a run.toml file sets. InvalidArgument when it does not parse.
Result<std::vector<std::string>> RunTomlKeys(const std::string& path);

// The run's limits from its [shape]: ResourceExhausted naming the shape and the figure when
// the longest sequence (`context` tokens) or a worker's KV cache (`kv_bytes`) exceeds them.
Status CheckShapeLimits(const RunConfig& config, int64_t context, uint64_t kv_bytes);

// The shipped shape files' texts (built into the binary from shapes/*.toml).
const std::vector<std::pair<std::string, std::string>>& ShippedShapeFiles();

}  // namespace flywheel::pipeline
