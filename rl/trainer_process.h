// The trainer process's wiring, apart from the training itself:
//   PrepareRun     checks the options, creates the state and report directories, builds the
//                  task, its tokenizer and the model config (written to <state>/config.json);
//                  with model.dir, all three come from an HF model directory (LoadModelDir)
//   WriteTinyModelDir  the demo's tiny model as an HF directory (what model.dir takes)
//   TrainerServices  the in-process publisher (version log under <state>/versions) and the
//                  coordinator's HTTP endpoint, on one I/O thread owned by the object
//   stop signals   SIGINT/SIGTERM set a flag the loop polls, so the state is saved on exit
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "base/status.h"
#include "grading/grader.h"
#include "model/memory_plan.h"
#include "model/model_config.h"
#include "model/tokenizer.h"
#include "tokenizer/hf_tokenizer.h"
#include "pipeline/coordinator.h"
#include "pipeline/dashboard.h"
#include "pipeline/run_record.h"
#include "pipeline/task.h"
#include "rl/rl_loop.h"
#include "sync/publisher.h"

namespace flywheel::rl {

// What a run is about, fixed for its whole life.
struct RunSetup {
  std::unique_ptr<pipeline::Task> task;
  std::shared_ptr<const model::Tokenizer> tokenizer;  // the task's characters, or model.dir's
  model::ModelConfig model_config;
  std::string model_config_path;  // <state>/config.json, as the workers load it
  int64_t max_tokens = 0;         // per answer: the task's longest answer + EOS
  int64_t max_prompt_tokens = 0;  // BOS + the longest prompt
  int64_t max_turns = 1;           // grading.max_turns
  int64_t max_episode_tokens = 0;  // grading.max_episode_tokens
  std::string init_weights;       // model.dir: the weights the trainer starts from
  std::string worker_tokenizer;   // the workers' --tokenizer: "chars:<alphabet>" or model.dir
};

// An HF model directory checked and read: its config.json, the path of its weights
// (model.safetensors or model.safetensors.index.json) and its tokenizer (tokenizer.json,
// tokenizer_config.json). InvalidArgument, one line naming the missing or mismatched file.
struct ModelDir {
  model::ModelConfig config;
  std::string weights;
  std::shared_ptr<const tokenizer::HfTokenizer> tokenizer;
};
Result<ModelDir> LoadModelDir(const std::string& dir);

// The tiny preset (model.preset, run.seed) written as an HF model directory `dir` (created
// if missing): config.json, model.safetensors (F32, the trainer's own initialisation for
// that seed), and the task alphabet's tokenizer.json and tokenizer_config.json.
Status WriteTinyModelDir(const pipeline::RunConfig& config, const std::string& dir);

// The model of a run: config.model.config (a config.json; InvalidArgument when its vocabulary
// is smaller than `vocab`) or the tiny preset (dense or MoE) for `vocab` ids.
Result<model::ModelConfig> MakeModelConfig(const pipeline::RunConfig& config, int64_t vocab);

// The grader settings of a run's config (grading.*, [[grader]]; none: exact_match).
grading::GraderSettings MakeGraderSettings(const pipeline::RunConfig& config);

// Validates options.config (and that SFT/DPO steps come with a dataset), creates the
// directories and writes the model config. InvalidArgument for bad options, IOError when a
// directory or the config cannot be written.
Result<RunSetup> PrepareRun(const TrainRunOptions& options);

// The publisher and the coordinator's routes (POST /v1/rollout/claim, /v1/rollout/submit;
// GET /v1/status) served on one I/O thread. The destructor stops HTTP, then the publisher,
// then joins the thread. Thread-safe unless noted.
class TrainerServices {
 public:
  // `rows_done` (RL steps already taken, on a resume) varies the coordinator's seed so a
  // resumed run does not replay the same problems.
  static Result<std::unique_ptr<TrainerServices>> Start(const TrainRunOptions& options,
                                                        const RunSetup& setup, uint64_t rows_done);
  ~TrainerServices();
  TrainerServices(const TrainerServices&) = delete;
  TrainerServices& operator=(const TrainerServices&) = delete;

  sync::Publisher& publisher();
  pipeline::Coordinator& coordinator();
  // The run's grader (grading.command, grading.url, or the [[grader]] tables; none:
  // exact_match against "answer"), shared by the coordinator and the evaluation.
  grading::AsyncGrader& grader();
  // The port of the coordinator's HTTP server (POST /v1/rollout/..., GET /v1/status).
  uint16_t http_port() const;
  // The publisher's status (its counters are read on the I/O thread); blocks until answered.
  sync::PublisherStatus PublisherStatusNow();
  // Writes {"listen","http","publisher_http","model_config","tokenizer","max_sequence"} to `path`
  // atomically: the fleet launcher waits for this file.
  Status WriteReadyFile(const std::string& path, const RunSetup& setup) const;

  // What GET /v1/status answers besides the coordinator's live counters.
  void SetPhase(const std::string& phase);
  // Also adds the row to the dashboard.
  void NoteStep(const pipeline::StepRow& row, uint64_t version, double accuracy, bool resumed);
  // What GET /dashboard shows (pipeline/dashboard.h): the steps, the latest rollouts.
  pipeline::DashboardFeed& dashboard();

  struct Impl;

 private:
  explicit TrainerServices(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What the trainer's GET /v1/status answers: its progress as of the last step, and the
// coordinator's counters live.
struct TrainerStatus {
  std::string phase = "starting";  // "starting", "sft", "dpo", "rl", "done", ...
  uint64_t step = 0;
  uint64_t version = 0;
  bool stepped = false;  // accuracy, mean_reward and resumed are reported after a step
  double accuracy = 0;
  double mean_reward = 0;
  bool resumed = false;
  pipeline::CoordinatorStats coordinator;
  size_t queued_groups = 0;
};
nlohmann::json ToJson(const TrainerStatus& status);

// <state>/dashboard.token: the dashboard's read-only token (when the trainer has tokens).
std::string DashboardTokenPath(const std::string& state_dir);
// The dashboard's header for a run: its task, model and algorithm, the group size.
nlohmann::json DashboardRun(const pipeline::RunConfig& config);

// The run's memory plan (model/memory_plan.h): the trainer, and with options.local_fleet the
// config's relays and workers too, at the run's longest sequence.
model::MemoryPlan PlanRunMemory(const TrainRunOptions& options, const RunSetup& setup);
// ResourceExhausted naming the shape's limit a run exceeds ([shape]: the longest sequence, a
// worker's KV cache), or with the plan in the message when run.check_memory is set and the
// plan does not fit this machine's available memory.
Status CheckRunMemory(const TrainRunOptions& options, const RunSetup& setup);
// <report>/memory.json: the plan and the trainer's measured peak RSS (getrusage), written at
// the end of the run so that the two can be compared.
Status WriteMemoryRecord(const TrainRunOptions& options, const RunSetup& setup);

// SIGINT and SIGTERM set StopRequested() from now on.
void InstallStopSignals();
bool StopRequested();
const std::atomic<bool>& StopFlag();

}  // namespace flywheel::rl
