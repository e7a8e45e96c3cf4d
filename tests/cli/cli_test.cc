// The flywheel CLI end to end: spawns build/bin/flywheel (FLYWHEEL_BIN) on checkpoints
// made with the library and checks exit codes, stdout, the one-line stderr contract and
// that failed commands leave no output behind.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/tensor.h"
#include "ops/process.h"
#include "tests/delta/test_checkpoints.h"

namespace flywheel {
namespace {

namespace fs = std::filesystem;

constexpr std::chrono::milliseconds kCommandTimeout = std::chrono::seconds(60);

struct CommandResult {
  int exit_code = -1;  // 128 + signal when killed
  bool timed_out = false;
  std::string out;
  std::string err;
};

// Runs FLYWHEEL_BIN with `args` through the harness; stdin is /dev/null; killed after
// kCommandTimeout (then timed_out, with the harness's message in `err`).
CommandResult RunFlywheel(const std::vector<std::string>& args) {
  ops::RunOptions options;
  options.timeout = kCommandTimeout;
  Result<ops::Completion> completion = ops::RunToCompletion(FLYWHEEL_BIN, args, options);
  CommandResult result;
  if (!completion.ok()) {
    ADD_FAILURE() << completion.status().ToString();
    result.timed_out = true;
    result.err = completion.status().ToString();
    return result;
  }
  result.exit_code = completion->exit_code;
  result.out = std::move(completion->out);
  result.err = std::move(completion->err);
  return result;
}

std::string Describe(const CommandResult& result) {
  return "exit " + std::to_string(result.exit_code) + (result.timed_out ? " (timed out)" : "") +
         "\n--- stdout ---\n" + result.out + "--- stderr ---\n" + result.err;
}

// The error contract: exactly one line on stderr, "flywheel: <what failed>: <why>".
void ExpectOneErrorLine(const CommandResult& result) {
  EXPECT_FALSE(result.timed_out) << Describe(result);
  EXPECT_NE(result.exit_code, 0) << Describe(result);
  EXPECT_LT(result.exit_code, 128) << "killed by a signal\n" << Describe(result);
  EXPECT_EQ(result.err.rfind("flywheel: ", 0), 0u) << Describe(result);
  ASSERT_FALSE(result.err.empty());
  EXPECT_EQ(result.err.back(), '\n') << Describe(result);
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << Describe(result);
}

void ExpectSuccess(const CommandResult& result) {
  EXPECT_FALSE(result.timed_out) << Describe(result);
  EXPECT_EQ(result.exit_code, 0) << Describe(result);
  EXPECT_EQ(result.err, "") << Describe(result);
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteFile(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::set<std::string> ListDir(const fs::path& dir) {
  std::set<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

// A small model: bf16 matrices (one spanning two 4 MiB chunks) and f32 norms; random bytes
// (tests/delta/test_checkpoints.h).
OwnedCheckpoint MakeBase(uint64_t seed) {
  return testing::RandomCheckpoint(
      {
          {"model.embed_tokens.weight", DType::kBF16, {1536, 2048}},
          {"model.layers.0.self_attn.q_proj.weight", DType::kBF16, {256, 256}},
          {"model.layers.0.input_layernorm.weight", DType::kF32, {256}},
          {"model.norm.weight", DType::kF32, {3, 7}},
          {"lm_head.weight", DType::kBF16, {1, 733}},
      },
      seed);
}

// Changes ~`fraction` of the words of every tensor (each changed word surely differs).
// Returns the number of changed words per tensor name.
std::map<std::string, uint64_t> ChangeWords(OwnedCheckpoint& checkpoint, double fraction,
                                            uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution change(fraction);
  std::map<std::string, uint64_t> changed;
  for (OwnedTensor& tensor : checkpoint.tensors) {
    const size_t word_bytes = static_cast<size_t>(DTypeWordBytes(tensor.dtype));
    uint64_t count = 0;
    for (size_t offset = 0; offset + word_bytes <= tensor.data.size(); offset += word_bytes) {
      if (!change(rng)) continue;
      // Flip the lowest mantissa bit (little endian): a small, realistic update.
      tensor.data[offset] ^= std::byte{1};
      ++count;
    }
    changed[tensor.name] = count;
  }
  return changed;
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::path(::testing::TempDir()) / "flywheel_cli_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << pattern;
    dir_ = pattern;

    base_ = MakeBase(1);
    target_ = base_;
    changed_ = ChangeWords(target_, 0.03, 2);
    for (const auto& [name, count] : changed_) total_changed_ += count;
    metadata_ = {{"format", "pt"}, {"step", "101"}};
    ASSERT_TRUE(WriteSafetensors(Path("base.safetensors"), base_.view(), {{"format", "pt"}}).ok());
    ASSERT_TRUE(WriteSafetensors(Path("target.safetensors"), target_.view(), metadata_).ok());
  }

  void TearDown() override {
    std::error_code error;
    fs::remove_all(dir_, error);
  }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // The 32-hex checkpoint hash printed by `flywheel checkpoint hash`.
  std::string HashOf(const std::string& path) {
    CommandResult result = RunFlywheel({"checkpoint", "hash", path});
    ExpectSuccess(result);
    EXPECT_EQ(result.out.size(), 32 + 2 + path.size() + 1) << result.out;
    return result.out.substr(0, 32);
  }

  // Every tensor of `path` equals the same-named tensor of `expected`, and nothing else.
  void ExpectTensorsEqual(const std::string& path, const OwnedCheckpoint& expected) {
    Result<Checkpoint> checkpoint = Checkpoint::Open(path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    std::map<std::string, const OwnedTensor*> by_name;
    for (const OwnedTensor& tensor : expected.tensors) by_name[tensor.name] = &tensor;
    ASSERT_EQ(checkpoint->tensors().size(), expected.tensors.size());
    for (const TensorView& tensor : checkpoint->tensors()) {
      auto it = by_name.find(tensor.name);
      ASSERT_NE(it, by_name.end()) << tensor.name;
      EXPECT_EQ(tensor.dtype, it->second->dtype) << tensor.name;
      EXPECT_EQ(tensor.shape, it->second->shape) << tensor.name;
      ASSERT_EQ(tensor.data.size(), it->second->data.size()) << tensor.name;
      EXPECT_TRUE(std::equal(tensor.data.begin(), tensor.data.end(), it->second->data.begin()))
          << tensor.name;
    }
  }

  CommandResult Encode(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"delta",
                                     "encode",
                                     "--base",
                                     Path("base.safetensors"),
                                     "--target",
                                     Path("target.safetensors"),
                                     "--out",
                                     Path("d.fwd"),
                                     "--base-version",
                                     "100",
                                     "--target-version",
                                     "101"};
    args.insert(args.end(), extra.begin(), extra.end());
    return RunFlywheel(args);
  }

  fs::path dir_;
  OwnedCheckpoint base_;
  OwnedCheckpoint target_;
  std::map<std::string, uint64_t> changed_;
  uint64_t total_changed_ = 0;
  std::map<std::string, std::string> metadata_;
};

// ---------------------------------------------------------------------------------------
// Success paths

TEST_F(CliTest, EncodeApplyRoundTripIsBitExact) {
  CommandResult encode = Encode({"--threads", "2"});
  ExpectSuccess(encode);
  ASSERT_EQ(encode.exit_code, 0);
  EXPECT_EQ(std::count(encode.out.begin(), encode.out.end(), '\n'), 1) << encode.out;
  EXPECT_NE(encode.out.find(std::to_string(total_changed_)), std::string::npos) << encode.out;
  const std::string base_hash = HashOf(Path("base.safetensors"));
  const std::string target_hash = HashOf(Path("target.safetensors"));
  EXPECT_NE(base_hash, target_hash);
  EXPECT_NE(encode.out.find(base_hash), std::string::npos) << encode.out;
  EXPECT_NE(encode.out.find(target_hash), std::string::npos) << encode.out;
  EXPECT_LT(fs::file_size(Path("d.fwd")), fs::file_size(Path("target.safetensors")) / 4);

  CommandResult apply =
      RunFlywheel({"delta", "apply", "--base", Path("base.safetensors"), "--delta", Path("d.fwd"),
                   "--out", Path("out.safetensors"), "--threads", "2"});
  ExpectSuccess(apply);
  EXPECT_NE(apply.out.find("101"), std::string::npos) << apply.out;
  EXPECT_NE(apply.out.find(target_hash), std::string::npos) << apply.out;
  EXPECT_EQ(HashOf(Path("out.safetensors")), target_hash);
  ExpectTensorsEqual(Path("out.safetensors"), target_);
}

TEST_F(CliTest, KeyframeAppliesWithoutBase) {
  CommandResult encode =
      RunFlywheel({"delta", "encode", "--keyframe", "--target", Path("target.safetensors"), "--out",
                   Path("k.fwd"), "--target-version", "7"});
  ExpectSuccess(encode);
  CommandResult apply =
      RunFlywheel({"delta", "apply", "--delta", Path("k.fwd"), "--out", Path("out.safetensors")});
  ExpectSuccess(apply);
  EXPECT_EQ(HashOf(Path("out.safetensors")), HashOf(Path("target.safetensors")));
  ExpectTensorsEqual(Path("out.safetensors"), target_);

  CommandResult inspect = RunFlywheel({"delta", "inspect", Path("k.fwd"), "--json"});
  ExpectSuccess(inspect);
  nlohmann::json json = nlohmann::json::parse(inspect.out);
  EXPECT_TRUE(json["keyframe"].get<bool>());
  EXPECT_EQ(json["target_version"].get<uint64_t>(), 7u);
  EXPECT_EQ(json["target_hash"].get<std::string>(), HashOf(Path("target.safetensors")));
}

TEST_F(CliTest, Lz4CodecRoundTrips) {
  ExpectSuccess(Encode({"--codec", "lz4"}));
  CommandResult inspect = RunFlywheel({"delta", "inspect", Path("d.fwd"), "--json"});
  ExpectSuccess(inspect);
  nlohmann::json json = nlohmann::json::parse(inspect.out);
  EXPECT_FALSE(json["compressors"].contains("zstd")) << json["compressors"].dump();
  ExpectSuccess(RunFlywheel({"delta", "apply", "--base", Path("base.safetensors"), "--delta",
                             Path("d.fwd"), "--out", Path("out.safetensors")}));
  ExpectTensorsEqual(Path("out.safetensors"), target_);
}

TEST_F(CliTest, CheckpointHashFormatAndInvariance) {
  CommandResult result =
      RunFlywheel({"checkpoint", "hash", Path("base.safetensors"), Path("target.safetensors")});
  ExpectSuccess(result);
  const std::regex line_format("[0-9a-f]{32}  .+");
  std::istringstream lines(result.out);
  std::string line;
  std::vector<std::string> parsed;
  while (std::getline(lines, line)) {
    EXPECT_TRUE(std::regex_match(line, line_format)) << line;
    parsed.push_back(line);
  }
  ASSERT_EQ(parsed.size(), 2u) << result.out;
  EXPECT_EQ(parsed[0].substr(34), Path("base.safetensors"));
  EXPECT_EQ(parsed[1].substr(34), Path("target.safetensors"));

  // The same tensors in another order, with other metadata.
  OwnedCheckpoint reversed;
  reversed.tensors.assign(target_.tensors.rbegin(), target_.tensors.rend());
  ASSERT_TRUE(WriteSafetensors(Path("reversed.safetensors"), reversed.view(), {}).ok());
  // And sharded in two files.
  std::map<std::string, std::string> weight_map;
  for (size_t i = 0; i < target_.tensors.size(); ++i) {
    weight_map[target_.tensors[i].name] =
        i % 2 == 0 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  ASSERT_TRUE(WriteShardedCheckpoint(Path("sharded"), target_.view(), weight_map, {}).ok());

  const std::string target_hash = parsed[1].substr(0, 32);
  EXPECT_EQ(HashOf(Path("reversed.safetensors")), target_hash);
  EXPECT_EQ(HashOf(Path("sharded")), target_hash);
  EXPECT_EQ(HashOf(Path("sharded/model.safetensors.index.json")), target_hash);
  EXPECT_NE(parsed[0].substr(0, 32), target_hash);

  // A sharded base is a valid input to encode as well.
  ASSERT_TRUE(WriteShardedCheckpoint(Path("sharded_base"), base_.view(), weight_map, {}).ok());
  ExpectSuccess(RunFlywheel({"delta", "encode", "--base", Path("sharded_base"), "--target",
                             Path("sharded"), "--out", Path("s.fwd")}));
  ExpectSuccess(RunFlywheel({"delta", "apply", "--base", Path("sharded_base"), "--delta",
                             Path("s.fwd"), "--out", Path("s.safetensors")}));
  EXPECT_EQ(HashOf(Path("s.safetensors")), target_hash);
}

TEST_F(CliTest, InspectTextShowsEveryTensorAndTotals) {
  ExpectSuccess(Encode());
  CommandResult inspect = RunFlywheel({"delta", "inspect", Path("d.fwd")});
  ExpectSuccess(inspect);
  for (const OwnedTensor& tensor : target_.tensors) {
    EXPECT_NE(inspect.out.find(tensor.name), std::string::npos) << tensor.name;
  }
  EXPECT_NE(inspect.out.find("100 -> 101"), std::string::npos) << inspect.out;
  EXPECT_NE(inspect.out.find(HashOf(Path("base.safetensors"))), std::string::npos);
  EXPECT_NE(inspect.out.find(HashOf(Path("target.safetensors"))), std::string::npos);
  EXPECT_NE(inspect.out.find("BF16"), std::string::npos);
  EXPECT_NE(inspect.out.find("F32"), std::string::npos);
  // The totals row carries the exact number of changed words.
  std::istringstream lines(inspect.out);
  std::string line, total_line;
  while (std::getline(lines, line)) {
    if (line.rfind("total ", 0) == 0) total_line = line;
  }
  ASSERT_FALSE(total_line.empty()) << inspect.out;
  EXPECT_NE(total_line.find(" " + std::to_string(total_changed_) + " "), std::string::npos)
      << total_line;
}

TEST_F(CliTest, InspectJsonTotalsMatchWhatChanged) {
  ExpectSuccess(Encode());
  CommandResult inspect = RunFlywheel({"delta", "inspect", Path("d.fwd"), "--json"});
  ExpectSuccess(inspect);
  nlohmann::json json = nlohmann::json::parse(inspect.out);  // throws (fails) on bad JSON
  EXPECT_FALSE(json["keyframe"].get<bool>());
  EXPECT_EQ(json["base_version"].get<uint64_t>(), 100u);
  EXPECT_EQ(json["target_version"].get<uint64_t>(), 101u);
  EXPECT_EQ(json["base_hash"].get<std::string>(), HashOf(Path("base.safetensors")));
  EXPECT_EQ(json["target_hash"].get<std::string>(), HashOf(Path("target.safetensors")));
  EXPECT_EQ(json["file_bytes"].get<uint64_t>(), fs::file_size(Path("d.fwd")));
  EXPECT_EQ(json["metadata"]["step"].get<std::string>(), "101");

  uint64_t elements = 0, target_bytes = 0, stored_bytes = 0;
  ASSERT_EQ(json["tensors"].size(), target_.tensors.size());
  for (const nlohmann::json& tensor : json["tensors"]) {
    const std::string name = tensor["name"].get<std::string>();
    ASSERT_TRUE(changed_.count(name)) << name;
    EXPECT_EQ(tensor["changed_words"].get<uint64_t>(), changed_[name]) << name;
    stored_bytes += tensor["stored_bytes"].get<uint64_t>();
  }
  for (const OwnedTensor& tensor : target_.tensors) {
    elements += tensor.data.size() / static_cast<size_t>(DTypeWordBytes(tensor.dtype));
    target_bytes += tensor.data.size();
  }
  const nlohmann::json& total = json["total"];
  EXPECT_EQ(total["changed_words"].get<uint64_t>(), total_changed_);
  EXPECT_EQ(total["elements"].get<uint64_t>(), elements);
  EXPECT_EQ(total["words"].get<uint64_t>(), elements);
  EXPECT_EQ(total["target_bytes"].get<uint64_t>(), target_bytes);
  EXPECT_EQ(total["stored_bytes"].get<uint64_t>(), stored_bytes);
  EXPECT_LE(stored_bytes, json["file_bytes"].get<uint64_t>());
  EXPECT_GT(total["bits_per_changed_word"].get<double>(), 0.0);
  // Changed tensors have a chunk each, the 6 MiB one two (unchanged ones need none).
  uint64_t changed_tensors = 0;
  for (const auto& [name, count] : changed_) changed_tensors += count > 0 ? 1 : 0;
  const nlohmann::json& chunks = total["chunks"];
  EXPECT_GE(chunks["sparse"].get<uint64_t>() + chunks["dense"].get<uint64_t>() +
                chunks["literal"].get<uint64_t>(),
            changed_tensors + 1);
}

TEST_F(CliTest, CheckpointInfoListsTensorsAndMetadata) {
  CommandResult info = RunFlywheel({"checkpoint", "info", Path("target.safetensors")});
  ExpectSuccess(info);
  for (const OwnedTensor& tensor : target_.tensors) {
    EXPECT_NE(info.out.find(tensor.name), std::string::npos) << tensor.name;
  }
  EXPECT_NE(info.out.find("[1536, 2048]"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("step = 101"), std::string::npos) << info.out;
}

// ---------------------------------------------------------------------------------------
// Failures: one line on stderr, non-zero exit, no output file

TEST_F(CliTest, ApplyWithWrongBaseFailsAndWritesNothing) {
  ExpectSuccess(Encode());
  OwnedCheckpoint other = MakeBase(99);
  ASSERT_TRUE(WriteSafetensors(Path("other.safetensors"), other.view(), {}).ok());
  const std::set<std::string> before = ListDir(dir_);

  CommandResult apply = RunFlywheel({"delta", "apply", "--base", Path("other.safetensors"),
                                     "--delta", Path("d.fwd"), "--out", Path("out.safetensors")});
  ExpectOneErrorLine(apply);
  EXPECT_EQ(apply.exit_code, 1);
  EXPECT_NE(apply.err.find("base"), std::string::npos) << apply.err;
  EXPECT_NE(apply.err.find("other.safetensors"), std::string::npos) << apply.err;
  EXPECT_FALSE(fs::exists(Path("out.safetensors")));
  EXPECT_EQ(ListDir(dir_), before) << "a temporary file was left behind";
}

TEST_F(CliTest, ApplyFailureLeavesExistingOutputUntouched) {
  ExpectSuccess(Encode());
  WriteFile(Path("out.safetensors"), "precious bytes");
  OwnedCheckpoint other = MakeBase(99);
  ASSERT_TRUE(WriteSafetensors(Path("other.safetensors"), other.view(), {}).ok());
  ExpectOneErrorLine(RunFlywheel({"delta", "apply", "--base", Path("other.safetensors"), "--delta",
                                  Path("d.fwd"), "--out", Path("out.safetensors")}));
  EXPECT_EQ(ReadFile(Path("out.safetensors")), "precious bytes");

  std::string bytes = ReadFile(Path("d.fwd"));
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x40);
  WriteFile(Path("bad.fwd"), bytes);
  ExpectOneErrorLine(RunFlywheel({"delta", "apply", "--base", Path("base.safetensors"), "--delta",
                                  Path("bad.fwd"), "--out", Path("out.safetensors")}));
  EXPECT_EQ(ReadFile(Path("out.safetensors")), "precious bytes");
}

TEST_F(CliTest, CorruptDeltaIsRejected) {
  ExpectSuccess(Encode());
  std::string bytes = ReadFile(Path("d.fwd"));
  ASSERT_GT(bytes.size(), 64u);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x01);
  WriteFile(Path("bad.fwd"), bytes);
  const std::set<std::string> before = ListDir(dir_);

  CommandResult apply = RunFlywheel({"delta", "apply", "--base", Path("base.safetensors"),
                                     "--delta", Path("bad.fwd"), "--out", Path("out.safetensors")});
  ExpectOneErrorLine(apply);
  EXPECT_EQ(apply.exit_code, 1);
  EXPECT_NE(apply.err.find("bad.fwd"), std::string::npos) << apply.err;
  EXPECT_FALSE(fs::exists(Path("out.safetensors")));
  EXPECT_EQ(ListDir(dir_), before);
}

TEST_F(CliTest, TruncatedDeltaIsRejected) {
  ExpectSuccess(Encode());
  const std::string bytes = ReadFile(Path("d.fwd"));
  for (size_t length : {size_t{0}, size_t{7}, bytes.size() / 2, bytes.size() - 1}) {
    SCOPED_TRACE("truncated to " + std::to_string(length) + " bytes");
    WriteFile(Path("short.fwd"), bytes.substr(0, length));
    CommandResult apply =
        RunFlywheel({"delta", "apply", "--base", Path("base.safetensors"), "--delta",
                     Path("short.fwd"), "--out", Path("out.safetensors")});
    ExpectOneErrorLine(apply);
    EXPECT_FALSE(fs::exists(Path("out.safetensors")));
    CommandResult inspect = RunFlywheel({"delta", "inspect", Path("short.fwd")});
    ExpectOneErrorLine(inspect);
    EXPECT_EQ(inspect.out, "");
  }
}

TEST_F(CliTest, EncodeWithOtherShapesFails) {
  OwnedCheckpoint other = base_;
  other.tensors[3].shape = {7, 3};
  ASSERT_TRUE(WriteSafetensors(Path("other.safetensors"), other.view(), {}).ok());
  CommandResult encode =
      RunFlywheel({"delta", "encode", "--base", Path("other.safetensors"), "--target",
                   Path("target.safetensors"), "--out", Path("d.fwd")});
  ExpectOneErrorLine(encode);
  EXPECT_EQ(encode.exit_code, 1);
  EXPECT_FALSE(fs::exists(Path("d.fwd")));
}

TEST_F(CliTest, MissingInputNamesThePath) {
  const std::string missing = Path("no_such_checkpoint.safetensors");
  CommandResult encode = RunFlywheel({"delta", "encode", "--base", missing, "--target",
                                      Path("target.safetensors"), "--out", Path("d.fwd")});
  ExpectOneErrorLine(encode);
  EXPECT_NE(encode.err.find(missing), std::string::npos) << encode.err;
  EXPECT_FALSE(fs::exists(Path("d.fwd")));

  const std::string missing_delta = Path("no_such.fwd");
  CommandResult apply = RunFlywheel({"delta", "apply", "--base", Path("base.safetensors"),
                                     "--delta", missing_delta, "--out", Path("out.safetensors")});
  ExpectOneErrorLine(apply);
  EXPECT_NE(apply.err.find(missing_delta), std::string::npos) << apply.err;

  CommandResult inspect = RunFlywheel({"delta", "inspect", missing_delta});
  ExpectOneErrorLine(inspect);
  EXPECT_NE(inspect.err.find(missing_delta), std::string::npos) << inspect.err;

  CommandResult hash = RunFlywheel({"checkpoint", "hash", missing});
  ExpectOneErrorLine(hash);
  EXPECT_NE(hash.err.find(missing), std::string::npos) << hash.err;
  EXPECT_EQ(hash.out, "");
}

TEST_F(CliTest, ApplyOfDeltaWithoutBaseFails) {
  ExpectSuccess(Encode());
  CommandResult apply =
      RunFlywheel({"delta", "apply", "--delta", Path("d.fwd"), "--out", Path("out.safetensors")});
  ExpectOneErrorLine(apply);
  EXPECT_FALSE(fs::exists(Path("out.safetensors")));
}

// ---------------------------------------------------------------------------------------
// Usage

TEST_F(CliTest, UsageErrorsExitTwoWithOneLine) {
  const std::vector<std::vector<std::string>> bad_command_lines = {
      {},                                                           // no command
      {"delta"},                                                    // no subcommand
      {"frobnicate"},                                               // unknown command
      {"delta", "encode", "--target", Path("target.safetensors")},  // missing --out and --base
      {"delta", "encode", "--base", Path("base.safetensors"), "--target",
       Path("target.safetensors"), "--out", Path("d.fwd"), "--no-such-flag"},
      {"delta", "encode", "--base", Path("base.safetensors"), "--target",
       Path("target.safetensors"), "--out", Path("d.fwd"), "--codec", "gzip"},
      {"delta", "encode", "--base", Path("base.safetensors"), "--target",
       Path("target.safetensors"), "--out", Path("d.fwd"), "--threads", "zero"},
      {"delta", "apply", "--base", Path("base.safetensors"), "--out", Path("out.safetensors")},
      {"delta", "inspect"},
      {"checkpoint", "hash"},
  };
  for (const std::vector<std::string>& args : bad_command_lines) {
    std::string joined;
    for (const std::string& arg : args) joined += arg + " ";
    SCOPED_TRACE("flywheel " + joined);
    CommandResult result = RunFlywheel(args);
    ExpectOneErrorLine(result);
    EXPECT_EQ(result.exit_code, 2);
    EXPECT_NE(result.err.find("--help"), std::string::npos) << result.err;
    EXPECT_EQ(result.out, "");
  }
  EXPECT_FALSE(fs::exists(Path("d.fwd")));

  CommandResult missing_out = RunFlywheel({"delta", "encode", "--base", Path("base.safetensors"),
                                           "--target", Path("target.safetensors")});
  EXPECT_NE(missing_out.err.find("--out"), std::string::npos) << missing_out.err;
  CommandResult unknown = RunFlywheel({"checkpoint", "hash", "--bogus", Path("base.safetensors")});
  EXPECT_NE(unknown.err.find("--bogus"), std::string::npos) << unknown.err;
}

TEST_F(CliTest, VerboseLogsToStderrOnly) {
  CommandResult quiet = RunFlywheel({"checkpoint", "hash", Path("base.safetensors")});
  ExpectSuccess(quiet);
  CommandResult verbose = RunFlywheel({"-v", "checkpoint", "hash", Path("base.safetensors")});
  EXPECT_EQ(verbose.exit_code, 0) << Describe(verbose);
  EXPECT_EQ(verbose.out, quiet.out);
  EXPECT_NE(verbose.err, "");
  // The flag is accepted after the subcommand as well.
  CommandResult after = RunFlywheel({"checkpoint", "hash", "--verbose", Path("base.safetensors")});
  EXPECT_EQ(after.exit_code, 0) << Describe(after);
  EXPECT_EQ(after.out, quiet.out);
}

// A small run of the codec benchmark: the wiring, and that it checks its round trips.
TEST_F(CliTest, BenchCodecRunsAndWritesJson) {
  CommandResult bench =
      RunFlywheel({"bench", "codec", "--size-mb", "1", "--reps", "1", "--lr", "1e-5", "--threads",
                   "1", "--no-peers", "--json", Path("bench.json"), "--work-dir", dir_.string()});
  EXPECT_EQ(bench.exit_code, 0) << Describe(bench);
  EXPECT_NE(bench.out, "");
  ASSERT_TRUE(fs::exists(Path("bench.json")));
  EXPECT_TRUE(nlohmann::json::accept(ReadFile(Path("bench.json"))));
  EXPECT_EQ(RunFlywheel({"bench", "codec", "--lr", "2"}).exit_code, 2);
}

TEST_F(CliTest, PipelineRunConfigErrorsAreOneLineAndStartNothing) {
  // A bad value, an unknown key, a malformed file: exit 1, one line naming the key, and no
  // run directory is created.
  const std::string run_dir = Path("run");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"demo", "--run-dir", run_dir, "--set", "algorithm.group_size=1"},
        std::vector<std::string>{"demo", "--run-dir", run_dir, "--set", "algorithm.learning_rate=1"},
        std::vector<std::string>{"bench", "pipeline", "--run-dir", run_dir, "--set", "fleet.regions=[]"}}) {
    CommandResult result = RunFlywheel(args);
    EXPECT_EQ(result.exit_code, 1) << Describe(result);
    EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
    EXPECT_NE(result.err.find(args.back().substr(0, args.back().find('='))), std::string::npos)
        << result.err;
  }
  {
    std::ofstream(Path("bad.toml")) << "[algorithm]\ngroup_size = \"eight\"\n";
    CommandResult result = RunFlywheel({"demo", "--run-dir", run_dir, "--config", Path("bad.toml")});
    EXPECT_EQ(result.exit_code, 1) << Describe(result);
    EXPECT_NE(result.err.find("algorithm.group_size must be an integer"), std::string::npos) << result.err;
  }
  EXPECT_FALSE(fs::exists(run_dir));
  CommandResult nothing = RunFlywheel({"demo", "--resume", "--run-dir", run_dir});
  EXPECT_EQ(nothing.exit_code, 1) << Describe(nothing);
  EXPECT_NE(nothing.err.find("no run to resume"), std::string::npos) << nothing.err;
  EXPECT_EQ(RunFlywheel({"demo", "--resume"}).exit_code, 2);  // needs --run-dir
  EXPECT_EQ(RunFlywheel({"demo", "--config", Path("missing.toml")}).exit_code, 2);
  EXPECT_EQ(RunFlywheel({"train", "--config", Path("bad.toml")}).exit_code, 2);  // --state missing
}

TEST_F(CliTest, HelpMentionsEveryCommand) {
  CommandResult help = RunFlywheel({"--help"});
  ExpectSuccess(help);
  for (const char* word : {"delta", "checkpoint", "bench", "demo", "--version", "Examples"}) {
    EXPECT_NE(help.out.find(word), std::string::npos) << word << "\n" << help.out;
  }
  CommandResult delta_help = RunFlywheel({"delta", "--help"});
  ExpectSuccess(delta_help);
  for (const char* word : {"encode", "apply", "inspect"}) {
    EXPECT_NE(delta_help.out.find(word), std::string::npos) << word << "\n" << delta_help.out;
  }
  CommandResult checkpoint_help = RunFlywheel({"checkpoint", "--help"});
  ExpectSuccess(checkpoint_help);
  for (const char* word : {"hash", "info"}) {
    EXPECT_NE(checkpoint_help.out.find(word), std::string::npos) << word;
  }
  CommandResult encode_help = RunFlywheel({"delta", "encode", "--help"});
  ExpectSuccess(encode_help);
  for (const char* word : {"--base", "--target", "--out", "--codec", "--level", "--threads",
                           "--base-version", "--target-version", "--keyframe"}) {
    EXPECT_NE(encode_help.out.find(word), std::string::npos) << word;
  }
  CommandResult bench_help = RunFlywheel({"bench", "codec", "--help"});
  ExpectSuccess(bench_help);
  for (const char* word : {"--size-mb", "--lr", "--steps", "--reps", "--no-peers", "--markdown",
                           "--json", "--work-dir"}) {
    EXPECT_NE(bench_help.out.find(word), std::string::npos) << word;
  }
  CommandResult version = RunFlywheel({"--version"});
  ExpectSuccess(version);
  EXPECT_EQ(version.out.rfind("flywheel ", 0), 0u) << version.out;
}

// `flywheel` does not load libtorch (so that it starts in milliseconds and a relay or a
// model-less worker stays small); `flywheel-torch` beside it does, and runs the torch
// commands `flywheel` hands over.
std::string Ldd(const std::string& binary) {
  Result<ops::Completion> ldd = ops::RunToCompletion("/usr/bin/ldd", {binary}, {});
  if (!ldd.ok() || ldd->exit_code != 0) return "";
  return ldd->out;
}

TEST_F(CliTest, FlywheelLinksNoLibtorchAndFlywheelTorchDoes) {
  if (!fs::exists("/usr/bin/ldd")) GTEST_SKIP() << "no /usr/bin/ldd";
  const std::string torch_bin = (fs::path(FLYWHEEL_BIN).parent_path() / "flywheel-torch").string();
  const std::string plain = Ldd(FLYWHEEL_BIN);
  const std::string with_torch = Ldd(torch_bin);
  ASSERT_NE(plain.find("libc.so"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("libtorch"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("libc10"), std::string::npos) << plain;
  EXPECT_NE(with_torch.find("libtorch"), std::string::npos) << with_torch;
}

TEST_F(CliTest, TorchCommandsAreHandedOverToFlywheelTorch) {
  CommandResult train = RunFlywheel({"train", "--help"});
  ExpectSuccess(train);
  EXPECT_NE(train.out.find("--state"), std::string::npos) << train.out;
  CommandResult trainer = RunFlywheel({"-v", "bench", "trainer", "--help"});
  ExpectSuccess(trainer);
  EXPECT_NE(trainer.out.find("--sequences"), std::string::npos) << trainer.out;
  // A torch command's usage errors come from flywheel-torch, with the same contract.
  CommandResult bad = RunFlywheel({"worker", "--model", Path("missing.json"), "--no-such-flag"});
  EXPECT_EQ(bad.exit_code, 2) << Describe(bad);
  ExpectOneErrorLine(bad);
}

TEST_F(CliTest, MissingFlywheelTorchIsOneClearLine) {
  const std::string alone = Path("alone");
  fs::create_directories(alone);
  fs::copy_file(FLYWHEEL_BIN, alone + "/flywheel");
  Result<ops::Completion> run =
      ops::RunToCompletion(alone + "/flywheel", {"train", "--help"}, {});
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  EXPECT_EQ(run->exit_code, 1);
  EXPECT_NE(run->err.find("flywheel-torch"), std::string::npos) << run->err;
  EXPECT_NE(run->err.find("cannot be run"), std::string::npos) << run->err;
  EXPECT_EQ(std::count(run->err.begin(), run->err.end(), '\n'), 1) << run->err;
  // What needs no torch still runs.
  Result<ops::Completion> help = ops::RunToCompletion(alone + "/flywheel", {"--help"}, {});
  ASSERT_TRUE(help.ok());
  EXPECT_EQ(help->exit_code, 0);
}

// The torch commands are the ones their registration marks (MarkTorchOnly in
// tools/commands.h), not a list kept beside them: with no flywheel-torch to hand over to,
// each of them fails naming it, and the torch-free commands beside them still run.
TEST_F(CliTest, EveryTorchCommandAndOnlyThoseAreHandedOver) {
  const std::string alone = Path("alone-each");
  fs::create_directories(alone);
  fs::copy_file(FLYWHEEL_BIN, alone + "/flywheel");
  const std::vector<std::vector<std::string>> torch = {
      {"train", "--help"},           {"serve-trainer", "--help"},
      {"worker", "--help", "--model", "m.json"},
      {"bench", "trainer", "--help"}, {"bench", "rollout", "--help"},
      {"bench", "parity", "--help"},  {"bench", "pipeline", "--help"},
      {"bench", "serving", "--help"}, {"bench", "training-api", "--help"},
      {"bench", "packed-experts", "--help"}, {"-v", "bench", "fp8", "--help"}};
  for (const auto& args : torch) {
    Result<ops::Completion> run = ops::RunToCompletion(alone + "/flywheel", args, {});
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    EXPECT_EQ(run->exit_code, 1) << args[0] << " " << args[1] << ": " << run->out;
    EXPECT_NE(run->err.find("flywheel-torch"), std::string::npos) << args[0] << " " << args[1];
  }
  const std::vector<std::vector<std::string>> torch_free = {
      {"worker", "--help"}, {"bench", "--help"},   {"bench", "codec", "--help"},
      {"bench", "fleet", "--help"}, {"service", "--help"}, {"demo", "--help"},
      {"publish", "--help"}, {"push", "--help"}};
  for (const auto& args : torch_free) {
    Result<ops::Completion> run = ops::RunToCompletion(alone + "/flywheel", args, {});
    ASSERT_TRUE(run.ok()) << run.status().ToString();
    EXPECT_EQ(run->exit_code, 0) << args[0] << " " << args[1] << ": " << run->err;
  }
}

TEST_F(CliTest, BenchStartupMeetsItsTargets) {
  // flywheel's --help and a 1 MB hash within 50 ms, its idle relay and worker within 40 MB,
  // flywheel-torch measured beside it (the benchmark fails otherwise).
  CommandResult run = RunFlywheel({"bench", "startup", "--reps", "3", "--markdown", Path("b.md")});
  ExpectSuccess(run);
  for (const char* row : {"--help, ms", "checkpoint hash 1 MB", "idle relay RSS", "idle model-less worker RSS",
                          "/bin/true", "python3 -c pass"}) {
    EXPECT_NE(run.out.find(row), std::string::npos) << row << "\n" << run.out;
  }
  std::ifstream markdown(Path("b.md"));
  std::stringstream text;
  text << markdown.rdbuf();
  EXPECT_NE(text.str().find("## Startup benchmark"), std::string::npos) << text.str();
}

TEST_F(CliTest, PushVersionsPinAndUnpinAgainstAPublisher) {
  WriteFile(Path("push.token"), "cli-push-token\n");
  WriteFile(Path("read.token"), "cli-read-token\n");
  for (const char* token : {"push.token", "read.token"}) {  // token files must be private
    fs::permissions(Path(token), fs::perms::owner_read | fs::perms::owner_write);
  }
  fs::create_directories(Path("logs"));
  ops::ProcessGroup group(Path("logs"));
  Result<size_t> publisher = group.Start(
      "publisher", FLYWHEEL_BIN,
      {"publish", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state-dir", Path("state"),
       "--push-token-file", Path("push.token"), "--token-file", Path("read.token"),
       "--ready-file", Path("ready.json")});
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  Result<nlohmann::json> ready =
      ops::AwaitReadyFile(group, Path("ready.json"), "publisher", kCommandTimeout, *publisher);
  ASSERT_TRUE(ready.ok()) << ready.status().ToString();
  const std::string url = "http://" + (*ready)["http"].get<std::string>();
  const std::vector<std::string> auth = {"--token-file", Path("push.token")};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.end(), auth.begin(), auth.end());
    return RunFlywheel(args);
  };
  CommandResult first = with({"push", "--to", url, Path("base.safetensors"), "--meta", "step=1",
                              "--cache-dir", Path("cache")});
  ExpectSuccess(first);
  EXPECT_NE(first.out.find("pushed full"), std::string::npos) << first.out;
  CommandResult second = with({"push", "--to", url, Path("target.safetensors"), "--cache-dir",
                               Path("cache"), "--json"});
  ExpectSuccess(second);
  const nlohmann::json pushed = nlohmann::json::parse(second.out, nullptr, false);
  ASSERT_FALSE(pushed.is_discarded()) << second.out;
  EXPECT_EQ(pushed["kind"], "delta");
  EXPECT_LT(pushed["uploaded_bytes"].get<uint64_t>() * 10, pushed["checkpoint_bytes"].get<uint64_t>());
  EXPECT_EQ(pushed["row"]["weights_hash"], HashOf(Path("target.safetensors")));
  CommandResult versions = RunFlywheel({"versions", "--from", url, "--token-file",
                                        Path("read.token"), "--json"});
  ExpectSuccess(versions);
  const nlohmann::json ledger = nlohmann::json::parse(versions.out, nullptr, false);
  ASSERT_EQ(ledger["versions"].size(), 2u) << versions.out;
  EXPECT_EQ(ledger["versions"][0]["metadata"]["step"], 1);
  CommandResult pin = with({"pin", "--to", url, "1"});
  ExpectSuccess(pin);
  EXPECT_NE(pin.out.find("v3"), std::string::npos) << pin.out;
  EXPECT_NE(pin.out.find("pin of v1"), std::string::npos) << pin.out;
  ExpectSuccess(with({"unpin", "--to", url}));
  // The read token cannot push; a wrong URL or a missing token file is one clear line.
  CommandResult refused = RunFlywheel({"push", "--to", url, "--token-file", Path("read.token"),
                                       Path("base.safetensors"), "--no-delta"});
  ExpectOneErrorLine(refused);
  EXPECT_NE(refused.err.find("403 forbidden"), std::string::npos) << refused.err;
  ExpectOneErrorLine(with({"push", "--to", "ftp://x", Path("base.safetensors")}));
  ExpectOneErrorLine(RunFlywheel({"versions", "--from", url, "--token-file", Path("missing")}));
  EXPECT_EQ(refused.err.find("cli-read-token"), std::string::npos) << "a token reached stderr";
}

}  // namespace
}  // namespace flywheel
