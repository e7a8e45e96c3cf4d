// `flywheel checkpoint hash | info`.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/hash.h"
#include "checkpoint/safetensors.h"
#include "tools/commands.h"
#include "tools/progress.h"

namespace flywheel::tools {
namespace {

struct HashArgs {
  std::vector<std::string> paths;
  int threads = DefaultThreads();
};

// Prints `<32 hex>  <path>` per checkpoint, as sha256sum does; stops at the first failure
// so that the error stays the last (and only) line on stderr.
Status RunHash(const HashArgs& args) {
  for (const std::string& path : args.paths) {
    const std::string what = "cannot hash " + path;
    Result<Checkpoint> checkpoint = Checkpoint::Open(path);
    if (!checkpoint.ok()) return Failed(what, checkpoint.status());
    Result<Hash128> hash = CheckpointHash(checkpoint->tensors(), args.threads);
    if (!hash.ok()) return Failed(what, hash.status());
    std::cout << hash->ToHex() << "  " << path << std::endl;
    spdlog::debug("hash: {} tensors in {}", checkpoint->tensors().size(), path);
  }
  return Status::Ok();
}

struct InfoArgs {
  std::string path;
};

Status RunInfo(const InfoArgs& args) {
  Result<Checkpoint> checkpoint = Checkpoint::Open(args.path);
  if (!checkpoint.ok()) return Failed("cannot read " + args.path, checkpoint.status());
  const CheckpointView& tensors = checkpoint->tensors();

  uint64_t total_bytes = 0;
  size_t name_width = 4, shape_width = 5;
  std::set<std::string> shards;
  for (const TensorView& tensor : tensors) {
    total_bytes += tensor.data.size();
    name_width = std::max(name_width, tensor.name.size());
    shape_width = std::max(shape_width, ShapeString(tensor.shape).size());
  }
  for (const auto& [name, shard] : checkpoint->weight_map()) shards.insert(shard);

  std::printf("%s\n", args.path.c_str());
  if (checkpoint->sharded()) {
    std::printf("  layout        sharded, %zu shards\n", shards.size());
  } else {
    std::printf("  layout        single file\n");
  }
  std::printf("  tensors       %zu\n", tensors.size());
  std::printf("  bytes         %llu (%s)\n", static_cast<unsigned long long>(total_bytes),
              FormatBytes(total_bytes).c_str());
  for (const auto& [key, value] : checkpoint->metadata()) {
    std::printf("  metadata      %s = %s\n", key.c_str(), value.c_str());
  }
  std::printf("\n");
  const int name_w = static_cast<int>(name_width);
  const int shape_w = static_cast<int>(shape_width);
  std::printf("%-*s  %-7s %-*s %14s%s\n", name_w, "name", "dtype", shape_w, "shape", "bytes",
              checkpoint->sharded() ? "  shard" : "");
  for (const TensorView& tensor : tensors) {
    const char* dtype = DTypeName(tensor.dtype);
    std::string shard;
    if (checkpoint->sharded()) {
      auto it = checkpoint->weight_map().find(tensor.name);
      shard = "  " + (it == checkpoint->weight_map().end() ? std::string("?") : it->second);
    }
    std::printf("%-*s  %-7s %-*s %14llu%s\n", name_w, tensor.name.c_str(), dtype ? dtype : "?",
                shape_w, ShapeString(tensor.shape).c_str(),
                static_cast<unsigned long long>(tensor.data.size()), shard.c_str());
  }
  std::fflush(stdout);
  return Status::Ok();
}

}  // namespace

void AddCheckpointCommands(CLI::App& app, Action& action) {
  CLI::App* checkpoint_app =
      app.add_subcommand("checkpoint", "Hash and describe checkpoints (.safetensors or sharded)");
  checkpoint_app->require_subcommand(1);
  checkpoint_app->footer(
      "\nA checkpoint is a .safetensors file, a directory with model.safetensors.index.json\n"
      "(sharded) or a single model.safetensors, or the index file itself.");

  auto hash_args = std::make_shared<HashArgs>();
  CLI::App* hash = checkpoint_app->add_subcommand(
      "hash",
      "Print the content hash of each checkpoint as '<32 hex>  <path>' (like sha256sum).\n"
      "The hash (XXH3-128 over a canonical record of every tensor's name, dtype, shape and\n"
      "bytes) does not depend on tensor order, header formatting or sharding: it is the\n"
      "hash a delta names for its base and target. Stops at the first checkpoint that\n"
      "cannot be read.");
  hash->add_option("paths", hash_args->paths, "Checkpoints to hash")->type_name("PATH")->required();
  hash->add_option("--threads", hash_args->threads, "Worker threads (default: all cores)")
      ->type_name("N")
      ->check(CLI::Range(1, 1024).description(""));
  hash->footer("\nExample:\n  flywheel checkpoint hash s101.safetensors sharded_s101/");
  hash->callback([hash_args, &action] { action = [hash_args] { return RunHash(*hash_args); }; });

  auto info_args = std::make_shared<InfoArgs>();
  CLI::App* info = checkpoint_app->add_subcommand(
      "info", "List a checkpoint's tensors (dtype, shape, bytes, shard) and its metadata");
  info->add_option("path", info_args->path, "Checkpoint")->type_name("PATH")->required();
  info->footer("\nExample:\n  flywheel checkpoint info sharded_s101/");
  info->callback([info_args, &action] { action = [info_args] { return RunInfo(*info_args); }; });
}

}  // namespace flywheel::tools
