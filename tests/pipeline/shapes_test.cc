// pipeline/shapes.h: the shipped shapes, resolving a shape onto a run config, refusing an
// override of a key the shape owns (by name) while training-loop keys stay free, a user's
// shapes directory, malformed shape files named by file:key, the limits the trainer checks.
#include "pipeline/shapes.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace flywheel::pipeline {
namespace {

namespace fs = std::filesystem;

fs::path ShapesDir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("fw-shapes-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

const char* kMine = R"(name = "mine"
description = "a user's shape"
[model]
max_context = 100
[trainer]
threads = 3
[workers]
max_batch = 5
kv_cache_mib = 7
)";

TEST(ShapesTest, TheShippedShapesParseAndOwnTheirKeys) {
  Result<std::vector<Shape>> shapes = LoadShapes("");
  ASSERT_TRUE(shapes.ok()) << shapes.status().ToString();
  ASSERT_GE(shapes->size(), 3u);
  Result<Shape> demo = FindShape("demo-cpu", "");
  ASSERT_TRUE(demo.ok()) << demo.status().ToString();
  EXPECT_EQ(demo->source, "shipped");
  EXPECT_EQ(demo->max_context, 64);
  Result<Shape> fp8 = FindShape("cpu-small-fp8", "");
  ASSERT_TRUE(fp8.ok());
  EXPECT_EQ(fp8->serving, "fp8");
  const Status missing = FindShape("nope", "").status();
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("demo-cpu"), std::string::npos) << missing.message();  // lists them
}

TEST(ShapesTest, ApplyingAShapeSetsWhatItOwnsAndRefusesOverridesByName) {
  Result<Shape> shape = FindShape("cpu-small-fp8", "");
  ASSERT_TRUE(shape.ok());
  RunConfig config;
  // Training-loop keys stay free.
  ASSERT_TRUE(ApplyShape(*shape, {"algorithm.lr", "algorithm.group_size", "run.max_steps"}, "demo", config).ok());
  EXPECT_EQ(config.run.threads, 4);
  EXPECT_EQ(config.fleet.worker_max_batch, 16);
  EXPECT_EQ(config.model.serving, "fp8");
  EXPECT_EQ(config.shape.name, "cpu-small-fp8");
  EXPECT_EQ(config.shape.max_context, 2048);
  // The config's text names the shape, so a resumed run keeps it.
  EXPECT_NE(config.ToToml().find("cpu-small-fp8"), std::string::npos);
  for (const char* owned : {"run.threads", "fleet.worker_max_batch", "model.serving", "shape.max_context"}) {
    RunConfig other;
    const Status refused = ApplyShape(*shape, {"algorithm.lr", owned}, "demo", other);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << owned;
    EXPECT_NE(refused.message().find(owned), std::string::npos) << refused.message();
    EXPECT_NE(refused.message().find("cpu-small-fp8"), std::string::npos) << refused.message();
  }
}

TEST(ShapesTest, LoraAndDataParallelShapesAreRefusedForTrainAndDemoSayingWhy) {
  const fs::path dir = ShapesDir("lora");
  std::ofstream(dir / "lora.toml") << "name = \"lora-8\"\n[model]\nmax_context = 512\nmode = \"lora\"\nlora_rank = [8, 64]\n";
  std::ofstream(dir / "dp.toml") << "name = \"dp-2\"\n[model]\nmax_context = 512\n[trainer]\ndata_parallel_ranks = 2\n";
  RunConfig config;
  Result<Shape> lora = FindShape("lora-8", dir.string());
  ASSERT_TRUE(lora.ok()) << lora.status().ToString();
  EXPECT_EQ(lora->lora_rank_max, 64);
  Status refused = ApplyShape(*lora, {}, "train", config);
  EXPECT_NE(refused.message().find("LoRA"), std::string::npos) << refused.message();
  Result<Shape> dp = FindShape("dp-2", dir.string());
  ASSERT_TRUE(dp.ok());
  refused = ApplyShape(*dp, {}, "train", config);
  EXPECT_NE(refused.message().find("data-parallel"), std::string::npos) << refused.message();
  fs::remove_all(dir);
}

TEST(ShapesTest, AUsersDirectoryAddsAndReplacesShapes) {
  const fs::path dir = ShapesDir("user");
  std::ofstream(dir / "mine.toml") << kMine;
  std::ofstream(dir / "demo.toml") << "name = \"demo-cpu\"\n[model]\nmax_context = 32\n";
  std::ofstream(dir / "notes.txt") << "not a shape";
  Result<Shape> mine = FindShape("mine", dir.string());
  ASSERT_TRUE(mine.ok()) << mine.status().ToString();
  EXPECT_EQ(mine->trainer_threads, 3);
  EXPECT_EQ(mine->kv_cache_mib, 7);
  EXPECT_EQ(mine->source, (dir / "mine.toml").string());
  Result<Shape> replaced = FindShape("demo-cpu", dir.string());
  ASSERT_TRUE(replaced.ok());
  EXPECT_EQ(replaced->max_context, 32);
  std::ofstream(dir / "twice.toml") << kMine;
  const Status twice = LoadShapes(dir.string()).status();
  EXPECT_NE(twice.message().find("defined twice"), std::string::npos) << twice.message();
  EXPECT_EQ(LoadShapes((dir / "absent").string()).status().code(), StatusCode::kNotFound);
  fs::remove_all(dir);
}

TEST(ShapesTest, AMalformedShapeFileIsNamedByFileAndKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"name = \"x\"\n[model]\nmax_context = \"long\"\n", "f.toml:model.max_context has the wrong type"},
      {"name = \"x\"\n[model]\nmax_context = 8\nwidth = 3\n", "f.toml:model.width is not a shape key"},
      {"name = \"x\"\n", "f.toml:model.max_context is missing"},
      {"[model]\nmax_context = 8\n", "f.toml:name is missing"},
      {"name = \"x\"\n[model]\nmax_context = 8\n[serving]\ndtype = \"int3\"\n", "f.toml:serving.dtype must be"},
      {"name = \"x\"\n[model]\nmax_context = 8\nmode = \"lora\"\n", "f.toml:model.lora_rank must be"},
      {"name = \"x\"\ncolour = 1\n[model]\nmax_context = 8\n", "f.toml:colour is not a shape key"},
      {"name = \n", "f.toml:1"},
  };
  for (const auto& [text, expected] : cases) {
    const Status status = Shape::FromToml(text, "f.toml").status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(status.message().find(expected), std::string::npos) << status.message();
  }
}

TEST(ShapesTest, RunTomlKeysAndTheLimitsTheTrainerChecks) {
  const fs::path dir = ShapesDir("keys");
  std::ofstream(dir / "run.toml") << "[run]\nthreads = 2\nmax_steps = 3\n[algorithm]\nlr = 1e-4\n";
  Result<std::vector<std::string>> keys = RunTomlKeys((dir / "run.toml").string());
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  std::sort(keys->begin(), keys->end());
  EXPECT_EQ(*keys, (std::vector<std::string>{"algorithm.lr", "run.max_steps", "run.threads"}));
  RunConfig config;
  EXPECT_TRUE(CheckShapeLimits(config, 100000, 1ull << 40).ok());  // no shape: no limits
  config.shape = {"demo-cpu", 64, 1};
  EXPECT_TRUE(CheckShapeLimits(config, 64, 1 << 20).ok());
  Status over = CheckShapeLimits(config, 65, 0);
  EXPECT_EQ(over.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("65 tokens"), std::string::npos) << over.message();
  over = CheckShapeLimits(config, 10, (1 << 20) + 1);
  EXPECT_NE(over.message().find("KV cache"), std::string::npos) << over.message();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace flywheel::pipeline
