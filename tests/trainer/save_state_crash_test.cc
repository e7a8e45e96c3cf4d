// TrainingClient::SaveState under a power cut at every step of its writes (the
// crash-consistency test of the trainer, beside tests/sync/crash_consistency_test.cc): a
// state saved before stays loadable until the new save is acknowledged, the new one is
// loadable once it is, and whatever LoadState reads after the restart is one of the two,
// bit for bit; a torn file is refused, never loaded.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "tests/base/power_cut_env.h"
#include "tests/model/tiny_models.h"
#include "tests/trainer/trainer_test_util.h"
#include "trainer/training_client.h"

namespace flywheel::trainer {
namespace {

namespace fs = std::filesystem;
using Tear = PowerCutEnv::Tear;

TEST(SaveStateCrashTest, ASavedStateSurvivesAPowerCutAtEveryStepOfTheNextSave) {
  const fs::path root = fs::temp_directory_path() /
                        ("flywheel_save_state_crash_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "run");
  const std::string state = (root / "run" / "ckpt").string();
  const auto data = Sequences(2, 8, 40, 5);
  auto client = MakeClient({.config = Tiny(false), .seed = 3});
  ASSERT_NE(client, nullptr);
  auto train = [&] {
    ASSERT_TRUE(client->ForwardBackward(data, "cross_entropy").ok());
    ASSERT_TRUE(client->OptimStep({.lr = 1e-2}).ok());
  };
  train();
  ASSERT_TRUE(client->SaveState(state).ok());  // the acknowledged state before the cuts
  const std::vector<torch::Tensor> first = Params(*client);
  const fs::path golden = root / "golden";
  fs::copy(root / "run", golden, fs::copy_options::recursive);
  train();
  const std::vector<torch::Tensor> second = Params(*client);
  ASSERT_FALSE(AllEqual(first, second));

  int cut_points = 0, lost = 0, torn_refused = 0;
  for (Tear tear : {Tear::kDropUnsynced, Tear::kHalfOfUnsynced}) {
    for (int64_t step = 0;; ++step) {
      fs::remove_all(root / "run");
      fs::copy(golden, root / "run", fs::copy_options::recursive);
      PowerCutEnv env((root / "run").string());
      env.CutAt(step);
      TrainerOptions options = client->options();
      options.env = &env;
      auto saver = MakeClient(options);
      ASSERT_NE(saver, nullptr);
      ASSERT_TRUE(saver->ImportTrainable(client->ExportTrainable()).ok());
      const bool acknowledged = saver->SaveState(state).ok();
      const bool cut = env.was_cut();
      saver.reset();
      ASSERT_TRUE(env.PowerCut(tear).ok());

      auto loader = MakeClient({.config = Tiny(false), .seed = 77});
      const Status loaded = loader->LoadState(state);
      if (!loaded.ok()) {
        // Nothing may be refused here: the previous state stays whole until the new one is.
        ADD_FAILURE() << "cut at step " << step << ": " << loaded.ToString();
        ++lost;
        if (loaded.code() == StatusCode::kCorruption) ++torn_refused;
      } else {
        const std::vector<torch::Tensor> got = Params(*loader);
        const bool is_second = AllEqual(got, second);
        EXPECT_TRUE(is_second || AllEqual(got, first))
            << "cut at step " << step << ": a state that is neither save was loaded";
        if (acknowledged && !is_second) {
          ADD_FAILURE() << "cut at step " << step << ": the acknowledged save is lost";
          ++lost;
        }
        EXPECT_EQ(loader->step(), is_second ? 2u : 1u);
      }
      if (!cut) break;
      ++cut_points;
    }
  }
  std::printf("save_state: %d cut points, acknowledged state lost: %d (refused as torn: %d)\n",
              cut_points, lost, torn_refused);
  EXPECT_EQ(lost, 0);
  EXPECT_GT(cut_points, 20);
  fs::remove_all(root);
}

// A state file torn after its save (a disk that lied, or a copy cut short) is refused with
// a message naming the file, never loaded.
TEST(SaveStateCrashTest, AStateFileThatDoesNotMatchItsRecordedHashIsRefused) {
  const fs::path root = fs::temp_directory_path() /
                        ("flywheel_save_state_torn_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  auto client = MakeClient({.config = Tiny(false), .seed = 3});
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->SaveState((root / "ckpt").string()).ok());
  // Flip one byte of the last tensor's data: the file still parses.
  const fs::path weights = root / "ckpt" / "weights.safetensors";
  Result<std::vector<std::byte>> bytes = Env::Default()->ReadFile(weights.string());
  ASSERT_TRUE(bytes.ok());
  bytes->back() ^= std::byte{0x40};
  ASSERT_TRUE(WriteFileAtomically(weights.string(), *bytes).ok());
  auto loader = MakeClient({.config = Tiny(false), .seed = 9});
  const std::vector<torch::Tensor> before = Params(*loader);
  const Status loaded = loader->LoadState((root / "ckpt").string());
  EXPECT_EQ(loaded.code(), StatusCode::kCorruption) << loaded.ToString();
  EXPECT_NE(loaded.message().find("weights.safetensors"), std::string::npos) << loaded.message();
  EXPECT_TRUE(AllEqual(Params(*loader), before));  // nothing of it was loaded
  fs::remove_all(root);
}

}  // namespace
}  // namespace flywheel::trainer
