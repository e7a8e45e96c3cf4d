// `flywheel delta encode | apply | inspect`.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "delta/delta.h"
#include "delta/delta_file.h"
#include "checkpoint/hash.h"
#include "tools/commands.h"
#include "tools/progress.h"

namespace flywheel::tools {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Percent(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
}

std::string FormatBits(double bits) {
  if (bits < 0) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", bits);
  return text;
}

// A keyframe's base hash is zero: print "-" rather than 32 zeros.
std::string HashOrDash(const Hash128& hash) {
  return hash == Hash128{} ? "-" : hash.ToHex();
}

// ---------------------------------------------------------------------------------------
// delta encode

struct EncodeArgs {
  std::string base_path;
  std::string target_path;
  std::string out_path;
  std::string codec = "zstd";
  int level = 3;
  int threads = DefaultThreads();
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  bool target_version_given = false;
  bool keyframe = false;
  delta::Compressor compressor = delta::Compressor::kZstd;
  bool context_coding = false;
};

Status RunEncode(const EncodeArgs& args) {
  delta::EncodeOptions options;
  options.base_version = args.base_version;
  options.target_version = args.target_version_given ? args.target_version : args.base_version + 1;
  options.compressor = args.compressor;
  options.context_coding = args.context_coding;
  options.zstd_level = args.level;
  options.threads = args.threads;
  ProgressBar progress;
  options.progress = progress.Callback();
  spdlog::debug("encode: base={} target={} out={} codec={} level={} threads={} versions {}->{}",
                args.base_path, args.target_path, args.out_path, args.codec, args.level,
                args.threads, options.base_version, options.target_version);

  const Clock::time_point start = Clock::now();
  Result<delta::FileEncodeStats> result =
      args.keyframe ? delta::EncodeKeyframeFile(args.target_path, args.out_path, options)
                    : delta::EncodeFiles(args.base_path, args.target_path, args.out_path, options);
  progress.Finish();
  if (!result.ok()) {
    return Failed(args.keyframe
                      ? "cannot encode keyframe of " + args.target_path
                      : "cannot encode delta " + args.base_path + " -> " + args.target_path,
                  result.status());
  }
  const double seconds = SecondsSince(start);
  const delta::FileEncodeStats& stats = *result;
  char line[1024];
  std::snprintf(
      line, sizeof(line),
      "%s %s: %llu of %llu words changed (%.3f%%), %s = %.2f%% of %s target, "
      "%s bits/changed word, base %s, target %s, %.2f s",
      args.keyframe ? "keyframe" : "delta", args.out_path.c_str(),
      static_cast<unsigned long long>(stats.changed_words),
      static_cast<unsigned long long>(stats.total_words),
      Percent(stats.changed_words, stats.total_words), FormatBytes(stats.delta_bytes).c_str(),
      Percent(stats.delta_bytes, stats.checkpoint_bytes),
      FormatBytes(stats.checkpoint_bytes).c_str(),
      FormatBits(delta::BitsPerChangedWord(stats.delta_bytes, stats.changed_words)).c_str(),
      HashOrDash(stats.base_hash).c_str(), stats.target_hash.ToHex().c_str(), seconds);
  std::cout << line << std::endl;
  spdlog::debug("encode: {} bytes in {:.3f} s ({:.1f} MB/s of checkpoint)", stats.delta_bytes,
                seconds, static_cast<double>(stats.checkpoint_bytes) / 1e6 / seconds);
  return Status::Ok();
}

void AddEncode(CLI::App& delta_app, Action& action) {
  auto args = std::make_shared<EncodeArgs>();
  CLI::App* encode = delta_app.add_subcommand(
      "encode",
      "Encode the delta from checkpoint --base to checkpoint --target into --out.\n"
      "With --keyframe, write a full snapshot of --target instead (no base). Checkpoints\n"
      "are .safetensors files or sharded directories with the same tensor names, dtypes\n"
      "and shapes. Prints one summary line: changed words, density, delta size and its\n"
      "share of the target, bits per changed word, base and target hashes.");
  encode->add_option("--base", args->base_path, "Base checkpoint (the version workers hold)")
      ->type_name("PATH");
  encode->add_option("--target", args->target_path, "Target checkpoint (the new version)")
      ->type_name("PATH")
      ->required();
  encode->add_option("--out", args->out_path, "Delta file to write (atomically)")
      ->type_name("PATH")
      ->required();
  encode->add_option("--codec", args->codec, "Compressor over each chunk: zstd, lz4 or none")
      ->type_name("NAME")
      ->capture_default_str();
  CLI::Option* level = encode->add_option("--level", args->level, "zstd level (1-19; zstd only)")
                           ->type_name("N")
                           ->check(CLI::Range(1, 19).description(""))
                           ->capture_default_str();
  encode->add_option("--threads", args->threads, "Worker threads (default: all cores)")
      ->type_name("N")
      ->check(CLI::Range(1, 1024).description(""));
  encode->add_option("--base-version", args->base_version, "Version number of the base")
      ->type_name("N")
      ->capture_default_str();
  CLI::Option* target_version = encode
                                    ->add_option("--target-version", args->target_version,
                                                 "Version number of the target (default: base + 1)")
                                    ->type_name("N");
  encode->add_flag("--keyframe", args->keyframe,
                   "Write a keyframe: a full snapshot of --target that applies without a base");
  encode->add_flag("--context-coding", args->context_coding,
                   "Code sparse chunks conditioned on the base words (chunk kind 3): smaller,\n"
                   "2-2.6x slower to encode and apply (docs/BENCHMARKS.md)");
  encode->footer(
      "\nExamples:\n"
      "  flywheel delta encode --base s100.safetensors --target s101.safetensors --out 101.fwd\n"
      "  flywheel delta encode --target s101.safetensors --out 101.key --keyframe "
      "--target-version 101");

  encode->callback([args, &action, level, target_version] {
    if (args->keyframe && !args->base_path.empty()) {
      throw CLI::ValidationError("--base", "a keyframe has no base; drop --base or --keyframe");
    }
    if (!args->keyframe && args->base_path.empty()) {
      throw CLI::RequiredError("--base (or --keyframe)");
    }
    Result<delta::Compressor> compressor = delta::ParseCompressor(args->codec);
    if (!compressor.ok()) {
      throw CLI::ValidationError(
          "--codec", "unknown codec '" + args->codec + "' (expected zstd, lz4 or none)");
    }
    args->compressor = *compressor;
    if (level->count() > 0 && args->compressor != delta::Compressor::kZstd) {
      throw CLI::ValidationError("--level", "applies to --codec zstd only");
    }
    args->target_version_given = target_version->count() > 0;
    action = [args] { return RunEncode(*args); };
  });
}

// ---------------------------------------------------------------------------------------
// delta apply

struct ApplyArgs {
  std::string base_path;
  std::string delta_path;
  std::string out_path;
  int threads = DefaultThreads();
};

Status RunApply(const ApplyArgs& args) {
  delta::ApplyOptions options;
  options.threads = args.threads;
  // The output is a fresh file that is discarded on failure: no undo records needed.
  options.restore_on_failure = false;
  ProgressBar progress;
  options.progress = progress.Callback();
  spdlog::debug("apply: base={} delta={} out={} threads={}", args.base_path, args.delta_path,
                args.out_path, args.threads);

  const Clock::time_point start = Clock::now();
  Result<delta::FileApplyStats> result =
      delta::ApplyFiles(args.base_path, args.delta_path, args.out_path, options);
  progress.Finish();
  if (!result.ok()) {
    return Failed(args.base_path.empty()
                      ? "cannot apply " + args.delta_path + " without a base"
                      : "cannot apply " + args.delta_path + " to base " + args.base_path,
                  result.status());
  }
  const double seconds = SecondsSince(start);
  char line[1024];
  std::snprintf(line, sizeof(line), "wrote %s: version %llu, hash %s, %llu changed words, %.2f s",
                args.out_path.c_str(), static_cast<unsigned long long>(result->target_version),
                result->target_hash.ToHex().c_str(),
                static_cast<unsigned long long>(result->changed_words), seconds);
  std::cout << line << std::endl;
  return Status::Ok();
}

void AddApply(CLI::App& delta_app, Action& action) {
  auto args = std::make_shared<ApplyArgs>();
  CLI::App* apply = delta_app.add_subcommand(
      "apply",
      "Apply --delta to checkpoint --base; write the target checkpoint to --out.\n"
      "The output is one .safetensors file. The base is hashed and must be the one the\n"
      "delta was made from; every tensor and the whole output are verified against the\n"
      "delta's hashes. --base may be left out when --delta is a keyframe. On failure --out\n"
      "is not written (an existing file there is left as it was).");
  apply->add_option("--base", args->base_path, "Base checkpoint (not needed for a keyframe)")
      ->type_name("PATH");
  apply->add_option("--delta", args->delta_path, "Delta or keyframe file")
      ->type_name("PATH")
      ->required();
  apply->add_option("--out", args->out_path, "Target checkpoint to write (atomically)")
      ->type_name("PATH")
      ->required();
  apply->add_option("--threads", args->threads, "Worker threads (default: all cores)")
      ->type_name("N")
      ->check(CLI::Range(1, 1024).description(""));
  apply->footer(
      "\nExamples:\n"
      "  flywheel delta apply --base s100.safetensors --delta 101.fwd --out s101.safetensors\n"
      "  flywheel delta apply --delta 101.key --out s101.safetensors");
  apply->callback([args, &action] { action = [args] { return RunApply(*args); }; });
}

// ---------------------------------------------------------------------------------------
// delta inspect

struct InspectArgs {
  std::string delta_path;
  bool json = false;
};

std::string FormatChunkKinds(const delta::ChunkKindCounts& counts) {
  std::string text;
  auto add = [&](uint64_t count, const char* name) {
    if (count == 0) return;
    if (!text.empty()) text += ", ";
    text += std::to_string(count) + " " + name;
  };
  add(counts.sparse, delta::ChunkKindName(delta::ChunkKind::kSparse));
  add(counts.dense, delta::ChunkKindName(delta::ChunkKind::kDenseXor));
  add(counts.literal, delta::ChunkKindName(delta::ChunkKind::kLiteral));
  return text.empty() ? "-" : text;
}

delta::ChunkKindCounts ChunkKinds(const delta::TensorStats& tensor) {
  return {tensor.sparse_chunks, tensor.dense_chunks, tensor.literal_chunks};
}

nlohmann::json ChunkKindsJson(const delta::ChunkKindCounts& counts) {
  return {{"sparse", counts.sparse}, {"dense", counts.dense}, {"literal", counts.literal}};
}

nlohmann::json BitsJson(double bits) {
  return bits < 0 ? nlohmann::json(nullptr) : nlohmann::json(bits);
}

nlohmann::json TensorJson(const delta::TensorStats& tensor, const delta::TensorEntry& entry) {
  nlohmann::json out;
  out["name"] = tensor.name;
  out["dtype"] = DTypeName(tensor.dtype) ? DTypeName(tensor.dtype) : "?";
  out["shape"] = entry.shape;
  out["bytes"] = entry.byte_size;
  out["elements"] = tensor.elements;
  out["words"] = tensor.words;
  out["changed_words"] = tensor.changed_words;
  out["stored_bytes"] = tensor.stored_bytes;
  out["bits_per_changed_word"] =
      BitsJson(delta::BitsPerChangedWord(tensor.stored_bytes, tensor.changed_words));
  out["chunks"] = ChunkKindsJson(ChunkKinds(tensor));
  return out;
}

void PrintInspectJson(const std::string& path, const delta::DeltaSummary& summary) {
  const delta::Manifest& manifest = summary.manifest;
  const delta::DeltaTotals& total = summary.total;
  nlohmann::json out;
  out["file"] = path;
  out["file_bytes"] = summary.file_bytes;
  out["keyframe"] = manifest.keyframe;
  out["base_version"] =
      manifest.keyframe ? nlohmann::json(nullptr) : nlohmann::json(manifest.base_version);
  out["target_version"] = manifest.target_version;
  out["base_hash"] =
      manifest.keyframe ? nlohmann::json(nullptr) : nlohmann::json(manifest.base_hash.ToHex());
  out["target_hash"] = manifest.target_hash.ToHex();
  out["compressors"] = summary.compressor_chunks;
  out["metadata"] = manifest.metadata;
  nlohmann::json list = nlohmann::json::array();
  for (size_t i = 0; i < summary.tensors.size(); ++i) {
    list.push_back(TensorJson(summary.tensors[i], manifest.tensors[i]));
  }
  out["tensors"] = std::move(list);
  out["total"] = {
      {"tensors", summary.tensors.size()},
      {"elements", total.elements},
      {"words", total.words},
      {"changed_words", total.changed_words},
      {"density", total.changed_fraction()},
      {"stored_bytes", total.stored_bytes},
      {"target_bytes", summary.target_bytes},
      {"bits_per_changed_word",
       BitsJson(delta::BitsPerChangedWord(total.stored_bytes, total.changed_words))},
      {"chunks", ChunkKindsJson(total.chunks)},
  };
  std::cout << out.dump(2) << std::endl;
}

// The header lines: kind, hashes, compressors, sizes, metadata.
void PrintInspectHeader(const std::string& path, const delta::DeltaSummary& summary) {
  const delta::Manifest& manifest = summary.manifest;
  const delta::DeltaTotals& total = summary.total;
  std::string compressor_text;
  for (const auto& [name, count] : summary.compressor_chunks) {
    if (!compressor_text.empty()) compressor_text += ", ";
    compressor_text += name + " (" + std::to_string(count) + " chunks)";
  }
  std::printf("%s\n", path.c_str());
  if (manifest.keyframe) {
    std::printf("  kind          keyframe of version %llu\n",
                static_cast<unsigned long long>(manifest.target_version));
  } else {
    std::printf("  kind          delta, version %llu -> %llu\n",
                static_cast<unsigned long long>(manifest.base_version),
                static_cast<unsigned long long>(manifest.target_version));
  }
  std::printf("  base hash     %s\n",
              HashOrDash(manifest.keyframe ? Hash128{} : manifest.base_hash).c_str());
  std::printf("  target hash   %s\n", manifest.target_hash.ToHex().c_str());
  std::printf("  compressor    %s\n", compressor_text.empty() ? "-" : compressor_text.c_str());
  std::printf("  total bytes   %llu (%s) for %llu bytes of tensors (%.2f%%)\n",
              static_cast<unsigned long long>(summary.file_bytes),
              FormatBytes(summary.file_bytes).c_str(),
              static_cast<unsigned long long>(summary.target_bytes),
              Percent(summary.file_bytes, summary.target_bytes));
  std::printf(
      "  changed       %llu of %llu words (%.3f%%), %s bits per changed word\n",
      static_cast<unsigned long long>(total.changed_words),
      static_cast<unsigned long long>(total.words), Percent(total.changed_words, total.words),
      FormatBits(delta::BitsPerChangedWord(total.stored_bytes, total.changed_words)).c_str());
  for (const auto& [key, value] : manifest.metadata) {
    std::printf("  metadata      %s = %s\n", key.c_str(), value.c_str());
  }
  std::printf("\n");
}

// One row per tensor and a total row.
void PrintInspectTable(const delta::DeltaSummary& summary) {
  const delta::DeltaTotals& total = summary.total;
  size_t name_width = 5;
  for (const delta::TensorStats& tensor : summary.tensors)
    name_width = std::max(name_width, tensor.name.size());
  const int width = static_cast<int>(name_width);
  std::printf("%-*s  %-7s %14s %14s %14s %12s  %s\n", width, "name", "dtype", "elements", "changed",
              "stored bytes", "bits/changed", "chunks");
  for (const delta::TensorStats& tensor : summary.tensors) {
    const char* dtype = DTypeName(tensor.dtype);
    std::printf(
        "%-*s  %-7s %14llu %14llu %14llu %12s  %s\n", width, tensor.name.c_str(),
        dtype ? dtype : "?", static_cast<unsigned long long>(tensor.elements),
        static_cast<unsigned long long>(tensor.changed_words),
        static_cast<unsigned long long>(tensor.stored_bytes),
        FormatBits(delta::BitsPerChangedWord(tensor.stored_bytes, tensor.changed_words)).c_str(),
        FormatChunkKinds(ChunkKinds(tensor)).c_str());
  }
  std::printf(
      "%-*s  %-7s %14llu %14llu %14llu %12s  %s\n", width, "total", "",
      static_cast<unsigned long long>(total.elements),
      static_cast<unsigned long long>(total.changed_words),
      static_cast<unsigned long long>(total.stored_bytes),
      FormatBits(delta::BitsPerChangedWord(total.stored_bytes, total.changed_words)).c_str(),
      FormatChunkKinds(total.chunks).c_str());
  std::fflush(stdout);
}

Status RunInspect(const InspectArgs& args) {
  Result<delta::DeltaSummary> summary = delta::InspectDeltaFile(args.delta_path);
  if (!summary.ok()) return Failed("cannot inspect " + args.delta_path, summary.status());
  if (args.json) {
    PrintInspectJson(args.delta_path, *summary);
    return Status::Ok();
  }
  PrintInspectHeader(args.delta_path, *summary);
  PrintInspectTable(*summary);
  return Status::Ok();
}

void AddInspect(CLI::App& delta_app, Action& action) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* inspect = delta_app.add_subcommand(
      "inspect",
      "Show what a delta or keyframe holds, per tensor and in total.\n"
      "Header: versions, base and target hashes, compressors, total bytes. Per tensor:\n"
      "dtype, elements, changed elements, stored bytes, bits per changed element and chunk\n"
      "kinds (sparse, dense XOR, literal). The manifest is validated; chunk payloads are\n"
      "not decoded (use 'delta apply' to verify them).");
  inspect->add_option("delta", args->delta_path, "Delta or keyframe file")
      ->type_name("PATH")
      ->required();
  inspect->add_flag("--json", args->json, "Print one JSON object instead of the table");
  inspect->footer("\nExample:\n  flywheel delta inspect 101.fwd --json | jq .total");
  inspect->callback([args, &action] { action = [args] { return RunInspect(*args); }; });
}

}  // namespace

void AddDeltaCommands(CLI::App& app, Action& action) {
  CLI::App* delta_app =
      app.add_subcommand("delta", "Encode, apply and inspect checkpoint deltas (and keyframes)");
  delta_app->require_subcommand(1);
  delta_app->footer(
      "\nExamples:\n"
      "  flywheel delta encode --base s100.safetensors --target s101.safetensors --out 101.fwd\n"
      "  flywheel delta apply --base s100.safetensors --delta 101.fwd --out s101.safetensors\n"
      "  flywheel delta inspect 101.fwd");
  AddEncode(*delta_app, action);
  AddApply(*delta_app, action);
  AddInspect(*delta_app, action);
}

}  // namespace flywheel::tools
