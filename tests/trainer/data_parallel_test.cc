// Data parallel over c10d/Gloo: two real processes on loopback (this test binary, started
// again as a child rank) train on halves of a batch; both end bit-identical to each other
// and equal (up to float summation order) to one process training on the whole batch.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <random>

#include "checkpoint/safetensors.h"
#include "ops/process.h"
#include "tests/model/tiny_models.h"
#include "trainer/training_client.h"
#include "model/weights.h"

namespace flywheel::trainer {
namespace {

namespace fs = std::filesystem;

constexpr int kSteps = 3;
constexpr int kDatums = 8;

model::ModelConfig Config() {
  // Several of the 8 experts stay unused on one rank: the has-gradient flags matter.
  model::ModelConfig c = testing::TinyConfig({.vocab = 40, .experts = 8});
  // The load-balancing loss is a product of batch means, so per-rank (and per-call) values
  // do not add up to the whole batch's, in any framework; leave it out of the equality check.
  c.router_aux_loss_coef = 0;
  return c;
}

std::vector<Datum> Batch() {
  std::mt19937 rng(21);
  std::normal_distribution<float> noise(0, 0.3f);
  std::vector<Datum> out;
  for (int i = 0; i < kDatums; ++i) {
    Datum d;
    const int length = 6 + i % 4;
    for (int t = 0; t < length; ++t) {
      d.tokens.push_back(static_cast<int32_t>(rng() % 40));
      d.target_tokens.push_back(static_cast<int32_t>(rng() % 40));
      d.logprobs.push_back(-3.7f + noise(rng));
      d.advantages.push_back(i % 2 ? 1.0f : -1.0f);
    }
    out.push_back(std::move(d));
  }
  return out;
}

// Trains kSteps of PPO on `datums`; returns the grad norm of every step.
std::vector<double> Train(TrainingClient& client, const std::vector<Datum>& datums) {
  std::vector<double> norms;
  for (int step = 0; step < kSteps; ++step) {
    if (!datums.empty()) {
      auto m = client.ForwardBackward(datums, "ppo", {.clip_high = 0.28});
      EXPECT_TRUE(m.ok()) << m.status().ToString();
    }
    auto s = client.OptimStep({.lr = 1e-3});
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    norms.push_back(s.ok() ? s->grad_norm : -1);
  }
  return norms;
}

// The child rank: runs only when started by TwoProcessesMatchOneProcess.
TEST(DataParallelChild, DISABLED_Rank) {
  const char* rank_env = std::getenv("FLYWHEEL_DP_RANK");
  const char* init = std::getenv("FLYWHEEL_DP_INIT");
  const char* out = std::getenv("FLYWHEEL_DP_OUT");
  ASSERT_TRUE(rank_env && init && out) << "started without the parent's environment";
  const int rank = std::atoi(rank_env);
  torch::set_num_threads(1);
  DataParallelOptions dp{
      .init_method = init, .rank = rank, .world_size = 2, .timeout = std::chrono::seconds(60)};
  // Different seeds: rank 0's weights must reach rank 1 through the initial broadcast.
  auto client = TrainingClient::Create(
      {.config = Config(), .seed = rank == 0 ? 31u : 999u, .data_parallel = dp});
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  const auto all = Batch();
  // Rank 0 takes 3 datums, rank 1 the other 5: unequal shares still normalise globally.
  const auto mine = rank == 0 ? std::vector<Datum>(all.begin(), all.begin() + 3)
                              : std::vector<Datum>(all.begin() + 3, all.end());
  const auto norms = Train(**client, mine);
  ASSERT_TRUE(model::SaveModel((*client)->model(),
                               std::string(out) + "/rank" + rank_env + ".safetensors", DType::kF32)
                  .ok());
  std::ofstream(std::string(out) + "/rank" + rank_env + ".norms")
      << std::setprecision(17) << norms[0] << " " << norms[1] << " " << norms[2];
}

// Starts this test binary again as rank `rank` (only DataParallelChild.DISABLED_Rank runs);
// its output goes to <dir>/rank<rank>.out and .err.
Result<size_t> StartRank(ops::ProcessGroup& processes, int rank, const std::string& init,
                         const std::string& out) {
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  ops::StartOptions options;
  options.env = {"FLYWHEEL_DP_RANK=" + std::to_string(rank), "FLYWHEEL_DP_INIT=" + init,
                 "FLYWHEEL_DP_OUT=" + out, "OMP_NUM_THREADS=1"};
  return processes.Start("rank" + std::to_string(rank), self,
                         {"--gtest_filter=DataParallelChild.DISABLED_Rank",
                          "--gtest_also_run_disabled_tests"},
                         options);
}

// Waits up to `limit` for a rank to exit; kills it past that. Its exit code, or -1 (with
// the rank's output tail in the failure message).
int Reap(ops::ProcessGroup& processes, size_t index, std::chrono::seconds limit) {
  Result<int> exit_code = processes.WaitExitCode(index, limit);
  if (!exit_code.ok()) {
    processes.Kill(index);
    ADD_FAILURE() << exit_code.status().ToString();
    return -1;
  }
  if (*exit_code != 0) {
    ADD_FAILURE() << processes.name(index) << " exited with " << *exit_code << ":\n"
                  << ops::FileTail(processes.stdout_path(index), 2000) << "\n"
                  << ops::FileTail(processes.stderr_path(index), 2000);
  }
  return *exit_code;
}

TEST(DataParallelTest, TwoProcessesMatchOneProcess) {
  const fs::path dir =
      fs::temp_directory_path() / ("flywheel_dp_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string init = "file://" + (dir / "rendezvous").string();
  // The group stops both ranks however the test ends.
  ops::ProcessGroup processes(dir.string());
  const Result<size_t> rank0 = StartRank(processes, 0, init, dir.string());
  const Result<size_t> rank1 = StartRank(processes, 1, init, dir.string());
  ASSERT_TRUE(rank0.ok()) << rank0.status().ToString();
  ASSERT_TRUE(rank1.ok()) << rank1.status().ToString();

  // Meanwhile, the single-process reference on the whole batch.
  auto single = TrainingClient::Create({.config = Config(), .seed = 31});
  ASSERT_TRUE(single.ok());
  const auto norms = Train(**single, Batch());

  EXPECT_EQ(Reap(processes, *rank0, std::chrono::seconds(240)), 0);
  EXPECT_EQ(Reap(processes, *rank1, std::chrono::seconds(240)), 0);
  auto r0 = Checkpoint::Open((dir / "rank0.safetensors").string());
  auto r1 = Checkpoint::Open((dir / "rank1.safetensors").string());
  ASSERT_TRUE(r0.ok() && r1.ok()) << "a rank wrote no weights";
  ASSERT_EQ(r0->tensors().size(), r1->tensors().size());
  auto params = (*single)->model().named_parameters();
  double max_diff = 0;
  for (size_t i = 0; i < r0->tensors().size(); ++i) {
    const TensorView& a = r0->tensors()[i];
    const TensorView& b = r1->tensors()[i];
    ASSERT_EQ(a.name, b.name);
    EXPECT_TRUE(std::equal(a.data.begin(), a.data.end(), b.data.begin(), b.data.end()))
        << "ranks diverged on " << a.name;
    auto ta = model::ToTorch(a);
    ASSERT_TRUE(ta.ok());
    max_diff = std::max(max_diff, (*ta - params[a.name]).abs().max().item<double>());
  }
  // Adam steps of lr 1e-3: the ranks agree with one process to 1% of a step.
  EXPECT_LT(max_diff, 1e-5);
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream in(dir / ("rank" + std::to_string(rank) + ".norms"));
    for (int step = 0; step < kSteps; ++step) {
      double norm = 0;
      ASSERT_TRUE(in >> norm);
      EXPECT_NEAR(norm, norms[step], 1e-5 * norms[step]) << "rank " << rank << " step " << step;
    }
  }
  fs::remove_all(dir);
}

TEST(DataParallelTest, BadOptionsAreClearErrors) {
  auto bad_rank = DataParallel::Join({.init_method = "file:///tmp/x", .rank = 2, .world_size = 2});
  ASSERT_FALSE(bad_rank.ok());
  EXPECT_NE(bad_rank.status().message().find("outside [0, 2)"), std::string::npos);
  auto bad_init = DataParallel::Join({.init_method = "env://", .rank = 0, .world_size = 1});
  ASSERT_FALSE(bad_init.ok());
  EXPECT_NE(bad_init.status().message().find("tcp:// or file://"), std::string::npos);
  auto bad_port =
      DataParallel::Join({.init_method = "tcp://127.0.0.1:notaport", .rank = 0, .world_size = 1});
  ASSERT_FALSE(bad_port.ok());
  EXPECT_NE(bad_port.status().message().find("bad port"), std::string::npos);
}

}  // namespace
}  // namespace flywheel::trainer
