// RunTrainer: the phases of a trainer run, each a unit of its own (rl/trainer_process.h,
// rl/warmup.h, rl/rl_step.h, rl/publish.h, rl/evaluator.h, rl/run_report.h); this file
// only orders them.
#include "rl/rl_loop.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <optional>

#include "model/fp8.h"
#include "rl/evaluator.h"
#include "rl/publish.h"
#include "rl/rl_step.h"
#include "rl/run_report.h"
#include "rl/trainer_process.h"
#include "rl/warmup.h"
#include "trainer/training_client.h"

namespace flywheel::rl {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using pipeline::RunConfig;
using pipeline::StepRow;
using trainer::TrainerOptions;
using trainer::TrainingClient;

Result<std::unique_ptr<TrainingClient>> CreateClient(const RunConfig& config, const RunSetup& setup) {
  TrainerOptions trainer_options;
  trainer_options.config = setup.model_config;
  trainer_options.seed = static_cast<uint64_t>(config.run.seed);
  trainer_options.threads = static_cast<int>(config.run.threads);
  trainer_options.fp8_serving = config.model.serving == "fp8";
  trainer_options.fp8_qat = config.model.fp8_qat;
  trainer_options.init_weights = setup.init_weights;  // model.dir's weights, when set
  return TrainingClient::Create(trainer_options);
}

// The progress and trainer state an earlier run left in `state_dir` (loaded into `client`),
// or nothing for a fresh run.
Result<std::optional<RunProgress>> LoadSavedState(const fs::path& state_dir, TrainingClient& client) {
  const fs::path progress_path = state_dir / "progress.json";
  const fs::path trainer_state = state_dir / "trainer";
  Result<std::optional<RunProgress>> progress = LoadProgress(progress_path.string());
  if (fs::exists(progress_path) && (!progress.ok() || !fs::exists(trainer_state))) {
    return Status::Corruption(progress_path.string() + " is unreadable or " + trainer_state.string() +
                              " is missing: start with a fresh state dir" +
                              (progress.ok() ? "" : " (" + progress.status().message() + ")"));
  }
  if (!progress.ok() || !progress->has_value()) return progress;
  FW_RETURN_IF_ERROR(client.LoadState(trainer_state.string()));
  return progress;
}

// What the dashboard shows of a batch: each group's first sample, decoded.
std::vector<pipeline::RolloutView> RolloutViews(const std::vector<pipeline::Group>& groups, uint64_t step,
                                                const model::Tokenizer& tokenizer) {
  std::vector<pipeline::RolloutView> views;
  for (const pipeline::Group& group : groups) {
    if (group.samples.empty()) continue;
    const pipeline::Sample& sample = group.samples.front();
    std::vector<int32_t> tokens = sample.tokens;
    if (!tokens.empty() && tokens.back() == tokenizer.eos()) tokens.pop_back();
    Result<std::string> text = tokenizer.Decode(tokens);
    views.push_back({.step = step,
                     .version = sample.versions.empty() ? 0 : sample.versions.front(),
                     .worker = group.worker,
                     .prompt = group.problem.prompt,
                     .completion = text.ok() ? *text : "(not decodable: " + text.status().message() + ")",
                     .reward = sample.reward});
  }
  return views;
}

// One trainer run after its wiring: warm-up (or resume), the RL loop, the report.
class TrainerRun {
 public:
  TrainerRun(const TrainRunOptions& options, const RunSetup& setup, TrainingClient& client,
             TrainerServices& services, RunProgress progress, bool resumed)
      : options_(options),
        config_(options.config),
        setup_(setup),
        client_(client),
        services_(services),
        evaluator_(setup.model_config,
                   setup.task->HeldOut(static_cast<size_t>(options.config.run.eval_prompts), 4242),
                   setup.tokenizer, setup.max_tokens,
                   options.config.model.serving == "fp8" ? model::kFp8BlockSize : 0),
        loss_(MakeLossSetup(options.config)),
        progress_(std::move(progress)),
        resumed_(resumed),
        wall_before_(progress_.wall_s) {
    batch_options_.group_size = static_cast<size_t>(config_.algorithm.group_size);
    batch_options_.drop_all_equal = loss_.drop_all_equal;
    batch_options_.routing_replay = setup.model_config.num_experts > 0 && config_.model.routing_replay;
    evaluator_.SetGrader(&services.grader());
  }

  Status WarmUpOrResume() { return resumed_ ? Resume() : StartFresh(); }
  Status RunRlLoop();
  Status Finish(Status failure);

 private:
  Status StartFresh();
  Status Resume();
  Status Step(const std::vector<pipeline::Group>& groups);
  void NoteTransfer(const PublishedVersion& published, StepRow& row);
  Status MaybeEvaluate(StepRow& row);
  Result<PublishedVersion> Publish(uint64_t version);
  Status SaveState();
  // kl_coef > 0: the policy as RL started (<state>/reference, written once after the
  // warm-up), whose logprobs each step's datums carry as ref_logprobs.
  Status LoadReference(bool write);
  double Wall() const {
    return wall_before_ + std::chrono::duration<double>(Clock::now() - started_).count();
  }
  void Say(const std::string& line) const {
    if (!options_.quiet) std::cout << line << std::endl;
  }

  const TrainRunOptions& options_;
  const RunConfig& config_;
  const RunSetup& setup_;
  TrainingClient& client_;
  TrainerServices& services_;
  Evaluator evaluator_;
  const LossSetup loss_;
  BatchOptions batch_options_;
  RunProgress progress_;
  const bool resumed_;
  const double wall_before_;
  const Clock::time_point started_ = Clock::now();
  // The RL loop's running state.
  bool reached_ = false;
  uint64_t wan_before_ = 0;
  Clock::time_point last_step_time_;
  std::unique_ptr<TrainingClient> reference_;
  double last_sync_ms_ = -1;
  uint64_t last_sync_version_ = 0;
};

Result<PublishedVersion> TrainerRun::Publish(uint64_t version) {
  FW_ASSIGN_OR_RETURN(PublishedVersion published,
                      PublishVersion(client_, services_.coordinator(), version));
  progress_.version = version;
  return published;
}

Status TrainerRun::SaveState() {
  progress_.wall_s = Wall();
  FW_RETURN_IF_ERROR(client_.SaveState((fs::path(options_.state_dir) / "trainer").string()));
  return SaveProgress((fs::path(options_.state_dir) / "progress.json").string(), progress_);
}

Status TrainerRun::StartFresh() {
  services_.SetPhase("warm-up");
  FW_ASSIGN_OR_RETURN(progress_.initial_accuracy, evaluator_.Accuracy(client_.model()));
  Say("untrained policy: held-out accuracy " + std::to_string(progress_.initial_accuracy) + " on " +
      std::to_string(config_.run.eval_prompts) + " prompts (" + config_.task.name + ", " +
      std::to_string(config_.task.digits) + " digits)");
  WarmupContext context;
  context.adam = loss_.adam;
  context.say = [this](const std::string& line) { Say(line); };
  context.stop = &StopFlag();
  context.max_tokens = setup_.model_config.max_position_embeddings;
  context.warn = [](const std::string& line) { spdlog::warn("{}", line); };
  if (config_.sft.steps > 0) FW_RETURN_IF_ERROR(RunSft(client_, config_, *setup_.tokenizer, context));
  if (config_.dpo.steps > 0) FW_RETURN_IF_ERROR(RunDpo(client_, config_, *setup_.tokenizer, context));
  FW_ASSIGN_OR_RETURN(progress_.warmup_accuracy, evaluator_.Accuracy(client_.model()));
  progress_.last_accuracy = progress_.warmup_accuracy;
  if (config_.sft.steps > 0 || config_.dpo.steps > 0) {
    Say("after warm-up: held-out accuracy " + std::to_string(progress_.warmup_accuracy));
  }
  FW_RETURN_IF_ERROR(LoadReference(/*write=*/true));
  // Version 1, or above what an earlier attempt published before it could save progress.
  FW_RETURN_IF_ERROR(Publish(services_.publisher().version() + 1).status());
  return SaveState();
}

Status TrainerRun::LoadReference(bool write) {
  if (!(config_.algorithm.kl_coef > 0)) return Status::Ok();
  const std::string dir = (fs::path(options_.state_dir) / "reference").string();
  if (write) FW_RETURN_IF_ERROR(client_.SaveState(dir).WithContext("saving the KL reference policy"));
  FW_ASSIGN_OR_RETURN(reference_, CreateClient(config_, setup_));
  Status loaded = reference_->LoadState(dir);
  if (!loaded.ok()) {
    return loaded.WithContext("the KL reference policy (" + dir + ", algorithm.kl_coef > 0): start a fresh state dir");
  }
  Say("KL reference: the policy RL starts from (algorithm.kl_coef " + std::to_string(config_.algorithm.kl_coef) + ")");
  return Status::Ok();
}

Status TrainerRun::Resume() {
  FW_RETURN_IF_ERROR(LoadReference(/*write=*/false));
  const std::optional<uint64_t> to_publish =
      VersionToPublishOnResume(services_.publisher().version(), progress_.version);
  if (to_publish) {
    FW_RETURN_IF_ERROR(Publish(*to_publish).status());
  } else {
    services_.coordinator().SetVersion(progress_.version);  // already served
  }
  Say("resumed after optimizer step " + std::to_string(client_.step()) + ", version " +
      std::to_string(progress_.version) + " (" + std::to_string(progress_.rows.size()) +
      " RL steps done)");
  return Status::Ok();
}

Status TrainerRun::RunRlLoop() {
  services_.SetPhase("rl");
  pipeline::Coordinator& coordinator = services_.coordinator();
  wan_before_ = services_.PublisherStatusNow().common.traffic.wan_bytes_out;
  last_step_time_ = Clock::now();
  Clock::time_point last_report = Clock::now();
  reached_ = progress_.time_to_target_s >= 0;
  while (!StopRequested() && static_cast<int64_t>(progress_.rows.size()) < config_.run.max_steps &&
         Wall() < config_.run.time_limit_s && !reached_) {
    if (Status failed = coordinator.failure(); !failed.ok()) {
      // The grader failed for good: the run stops, its state kept for a resume.
      FW_RETURN_IF_ERROR(SaveState().WithContext("saving the trainer state"));
      return Status::Unavailable("the run stopped: " + failed.message());
    }
    // A full batch; after 30 s without one, whatever arrived (a fleet smaller than a batch).
    const bool partial = Clock::now() - last_step_time_ > std::chrono::seconds(30);
    std::vector<pipeline::Group> groups =
        coordinator.TakeBatch(Clock::now() + std::chrono::seconds(1), partial);
    if (!groups.empty()) {
      FW_RETURN_IF_ERROR(Step(groups));
    } else if (Clock::now() - last_report > std::chrono::seconds(15)) {
      Say("waiting for samples: " + std::to_string(coordinator.queued()) + " of " +
          std::to_string(config_.algorithm.groups_per_step) + " groups queued");
      last_report = Clock::now();
    }
  }
  return Status::Ok();
}

Status TrainerRun::Step(const std::vector<pipeline::Group>& groups) {
  FW_ASSIGN_OR_RETURN(StepBatch batch, MakeStepBatch(groups, progress_.version, batch_options_));
  services_.dashboard().AddRollouts(RolloutViews(groups, progress_.rows.size() + 1, *setup_.tokenizer));
  if (reference_ && !batch.datums.empty()) {
    Result<trainer::ForwardOutput> reference = reference_->Forward(batch.datums);
    if (!reference.ok()) return reference.status().WithContext("the KL reference's forward at step " + std::to_string(progress_.rows.size() + 1));
    for (size_t i = 0; i < batch.datums.size(); ++i) batch.datums[i].ref_logprobs = std::move(reference->logprobs[i]);
  }
  StepRow row;
  row.step = progress_.rows.size() + 1;
  row.samples = batch.samples;
  row.mean_reward = batch.mean_reward;
  row.staleness_mean = batch.staleness_mean;
  row.staleness_max = batch.staleness_max;
  FW_RETURN_IF_ERROR(TrainStep(client_, batch, loss_, &row));
  // Publish the new version; the state follows (a crash in between resumes from the
  // previous state and publishes above the lost version).
  const uint64_t new_version = progress_.version + 1;
  Result<PublishedVersion> published = Publish(new_version);
  if (!published.ok()) {
    return published.status().WithContext("publishing version " + std::to_string(new_version));
  }
  NoteTransfer(*published, row);
  FW_RETURN_IF_ERROR(MaybeEvaluate(row));
  row.wall_s = Wall();
  progress_.rows.push_back(row);
  Say(StepLine(row, config_.pipeline.max_staleness, progress_.last_accuracy));
  services_.NoteStep(row, progress_.version, progress_.last_accuracy, resumed_);
  if (static_cast<int64_t>(row.step) % config_.run.state_every == 0 || reached_) {
    FW_RETURN_IF_ERROR(SaveState().WithContext("saving the trainer state"));
  }
  return Status::Ok();
}

// The version's bytes, the WAN traffic and sync latency since the last step, the pace.
void TrainerRun::NoteTransfer(const PublishedVersion& published, StepRow& row) {
  pipeline::Coordinator& coordinator = services_.coordinator();
  row.version = published.version;
  row.full_bytes = published.full_bytes;
  row.delta_density = published.delta_density;
  row.delta_bytes = published.delta_bytes;
  row.keyframe_bytes = published.keyframe_bytes;
  const uint64_t wan_now = services_.PublisherStatusNow().common.traffic.wan_bytes_out;
  row.wan_bytes = wan_now - std::min(wan_now, wan_before_);
  wan_before_ = wan_now;
  for (const auto& synced : coordinator.TakeSynced()) {
    last_sync_ms_ = synced.ms;
    last_sync_version_ = synced.version;
  }
  row.sync_ms = last_sync_ms_;
  row.sync_version = last_sync_version_;
  row.dropped_stale = coordinator.stats().samples_dropped_stale;
  const Clock::time_point now = Clock::now();
  const double seconds = std::chrono::duration<double>(now - last_step_time_).count();
  row.samples_per_s = static_cast<double>(row.samples) / std::max(1e-6, seconds);
  last_step_time_ = now;
}

Status TrainerRun::MaybeEvaluate(StepRow& row) {
  if (static_cast<int64_t>(row.step) % config_.run.eval_every != 0) return Status::Ok();
  Result<double> accuracy = evaluator_.Accuracy(client_.model());
  if (!accuracy.ok()) return accuracy.status().WithContext("evaluation");
  row.eval_accuracy = *accuracy;
  progress_.last_accuracy = *accuracy;
  if (config_.run.target_accuracy > 0 && *accuracy >= config_.run.target_accuracy) {
    reached_ = true;
    progress_.time_to_target_s = Wall();
  }
  return Status::Ok();
}

Status TrainerRun::Finish(Status failure) {
  services_.coordinator().Finish();
  services_.SetPhase(failure.ok() ? "done" : "failed");
  FW_RETURN_IF_ERROR(failure);
  FW_RETURN_IF_ERROR(SaveState());
  SummaryInputs inputs;
  inputs.config = &config_;
  for (const auto& p : client_.model().parameters()) inputs.parameters += p.numel();
  inputs.progress = &progress_;
  inputs.reached_target = reached_;
  inputs.wall_seconds = Wall();
  inputs.stats = services_.coordinator().stats();
  inputs.resumed = resumed_;
  pipeline::RunSummary summary = MakeRunSummary(inputs);
  summary.eval_score = progress_.last_accuracy;
  summary.grader = services_.grader().name();
  summary.grader_restarts = services_.grader().counters().restarts;
  FW_RETURN_IF_ERROR(pipeline::WriteRollouts(options_.report_dir, services_.dashboard().rollouts()));
  return WriteRunReport(options_.report_dir, progress_.rows, summary);
}

}  // namespace

Result<std::string> ModelConfigJson(const RunConfig& config, int64_t vocab) {
  FW_ASSIGN_OR_RETURN(model::ModelConfig model_config, MakeModelConfig(config, vocab));
  return model_config.ToJson().dump(2);
}

Status RunTrainer(const TrainRunOptions& options) {
  FW_ASSIGN_OR_RETURN(RunSetup setup, PrepareRun(options));
  FW_RETURN_IF_ERROR(CheckRunMemory(options, setup));
  FW_ASSIGN_OR_RETURN(std::unique_ptr<TrainingClient> client, CreateClient(options.config, setup));
  FW_ASSIGN_OR_RETURN(std::optional<RunProgress> saved, LoadSavedState(options.state_dir, *client));
  const bool resumed = saved.has_value();
  RunProgress progress = resumed ? std::move(*saved) : RunProgress{};
  FW_ASSIGN_OR_RETURN(std::unique_ptr<TrainerServices> services,
                      TrainerServices::Start(options, setup, progress.rows.size()));
  client->AttachPublisher(&services->publisher());
  if (!options.ready_file.empty()) {
    FW_RETURN_IF_ERROR(services->WriteReadyFile(options.ready_file, setup));
  }
  for (const StepRow& row : progress.rows) services->dashboard().AddStep(row);
  InstallStopSignals();
  TrainerRun run(options, setup, *client, *services, std::move(progress), resumed);
  FW_RETURN_IF_ERROR(run.WarmUpOrResume());
  const Status failure = run.RunRlLoop();
  FW_RETURN_IF_ERROR(run.Finish(failure));
  return WriteMemoryRecord(options, setup);
}

}  // namespace flywheel::rl
