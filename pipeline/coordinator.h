// The trainer's side of the sample stream: hands out prompts to rollout workers, takes their
// scored groups back, and admits them to training under the staleness bound. Torch-free;
// the trainer process serves it over HTTP (POST /v1/rollout/claim and /v1/rollout/submit,
// JSON below) and takes batches from it.
//
// Staleness: a group's staleness is the trainer version it is trained at minus the oldest
// policy version among its tokens; at most max_staleness (k) is admitted. Pacing keeps it
// there without discarding work: a worker serving version w gets a claim only if the groups
// already out (claimed or queued) will be consumed early enough, i.e. the claim's group
// lands in batch i (counting from the next) with V + i - w <= k, where V is the trainer's
// version. k = 0 is synchronous RL: generate a batch on the current version, train, publish,
// and only then generate again. A group that is stale anyway (a worker swapped late) is
// dropped at admission, counted, and its prompt goes back to the pool.
//
// Leases: a claim not submitted within the lease goes back to the pool; so do a worker's
// claims when it comes back with a new incarnation (it restarted). A late or repeated
// submission of a claim that is no longer out is refused, so nothing is counted twice and
// no prompt is lost.
//
// The messages are typed (pipeline/rollout_protocol.h, shared with the workers' actor);
// HandleClaim/HandleSubmit take and answer the HTTP bodies.
//
// Grading (issue 34): with options.grader set, a worker's own reward is ignored. An accepted
// group is decoded (options.decode) and each completion handed to the grader with the
// problem's messages and fields; the group is queued once every sample has its outcome.
// Ungraded samples (grader timeout, crash, bad answer) are left out of the group; with
// zero_variance_filter, a group whose graded rewards are all equal is dropped (counted, its
// prompt not requeued: it was answered); a group with fewer than 2 graded samples is
// dropped either way. Grading runs on the grader's threads, never on TakeBatch's. A grader
// that fails for good (more than max_grader_failures ungraded in a row) makes failure()
// an error naming it; TakeBatch then returns at once.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "base/env.h"
#include "base/status.h"
#include "grading/grader.h"
#include "grading/zero_variance.h"
#include "pipeline/task.h"
#include "pipeline/rollout_protocol.h"

namespace flywheel::pipeline {

// One scored completion as a worker submits it (prompt and generated tokens, sampling
// logprobs, per-token versions, MoE routing, reward).
using Sample = pipeline::RolloutSample;

struct Group {
  uint64_t claim = 0;
  Problem problem;
  std::string worker;
  std::vector<Sample> samples;
  uint64_t oldest_version() const;
};

struct CoordinatorOptions {
  int64_t group_size = 8;
  int64_t groups_per_step = 8;
  int64_t max_staleness = 2;
  std::chrono::milliseconds lease{20000};
  double temperature = 1.0;
  int64_t max_tokens = 8;
  int64_t vocab_size = 0;  // bounds submitted token ids
  // Bounds on what a submission may hold, so that a hostile or broken worker cannot make
  // the trainer's forward fail: prompt tokens per sample (0: unbounded), and the MoE
  // routing the model replays (layers x top_k, expert ids below num_experts; 0: no MoE,
  // routing refused).
  int64_t max_prompt_tokens = 0;
  int64_t moe_layers = 0;
  int64_t top_k = 0;
  int64_t num_experts = 0;
  uint64_t seed = 1;
  // Grading (above). REQUIRES: grader outlives the Coordinator's use of it (its callbacks
  // reach the coordinator: stop it first). Null: the worker's reward is taken as sent.
  grading::AsyncGrader* grader = nullptr;
  // The completion text of generated tokens (the end-of-sequence token stripped); required
  // with a grader.
  std::function<Result<std::string>(const std::vector<int32_t>& tokens)> decode;
  bool zero_variance_filter = false;
  // Multi-turn environments (> 1; needs a grader): the worker sends each turn's completions
  // to HandleTurn, which asks the grader (the environment) and answers a reward or the
  // messages to continue with; an episode still going after max_turns is ungraded. A
  // submitted sample then holds every turn (model and environment tokens, `mask`), at most
  // max_episode_tokens of them.
  int64_t max_turns = 1;
  int64_t max_episode_tokens = 1024;
  // The clock leases, TakeBatch deadlines and worker liveness are measured on (its
  // SteadyNow and WaitUntil). Tests pass a ManualClock and advance it instead of sleeping.
  // REQUIRES: outlives the Coordinator.
  Env* env = Env::Default();
};

struct CoordinatorStats {
  uint64_t claims = 0;              // groups handed out
  uint64_t groups_accepted = 0;     // submitted and queued
  uint64_t groups_trained = 0;      // taken into batches
  uint64_t samples_dropped_stale = 0;
  uint64_t groups_dropped_stale = 0;
  uint64_t leases_expired = 0;      // groups whose claim lapsed (or whose worker restarted)
  uint64_t submissions_refused = 0;  // late, repeated or malformed submissions
  uint64_t waits = 0;               // claims answered "wait" (pacing)
  // Grading (options.grader set, or zero_variance_filter).
  uint64_t samples_graded = 0;
  uint64_t samples_ungraded = 0;          // left out of their group
  uint64_t groups_zero_variance = 0;      // dropped: all graded rewards equal
  uint64_t groups_too_few_graded = 0;     // dropped: fewer than 2 graded samples
  uint64_t groups_grading = 0;            // at the grader now
  // Multi-turn episodes (submitted).
  uint64_t episodes = 0;
  uint64_t episode_turns = 0;             // model turns over those episodes
  uint64_t episode_env_tokens = 0;        // environment tokens (masked out of the loss)
  uint64_t episode_model_tokens = 0;
  uint64_t episodes_max_turns = 0;        // ungraded: still going after max_turns
  std::map<std::string, uint64_t> groups_by_worker;  // accepted groups per worker
  std::map<std::string, uint64_t> leases_by_worker;  // claims out now, per worker
  // Why each worker's last refused submission was refused (at most 200 characters; at most
  // 1,024 workers, so that invented names cannot grow it without bound).
  std::map<std::string, std::string> last_error_by_worker;
};

// The grader's view of one completion of `problem`: a dataset line's messages and fields,
// or, for a generated task, its prompt as one user message and {"answer": answer}.
grading::Sample GradingSample(const Problem& problem, std::string id, std::string completion,
                              int64_t completion_tokens = -1);

class Coordinator {
 public:
  // The type of TakeBatch's deadline; its values come from options.env->SteadyNow().
  using Clock = std::chrono::steady_clock;
  Coordinator(const Task& task, CoordinatorOptions options);

  // InvalidArgument for a request without a worker or with max_groups < 1.
  Result<pipeline::ClaimAnswer> Claim(const pipeline::ClaimRequest& request);
  // Queues the group if its claim is out to this worker and the samples fit the claim and
  // the model; a group that does not fit closes its claim and returns the prompt.
  pipeline::SubmitAnswer Submit(pipeline::SubmitRequest request);
  // The HTTP bodies of POST /v1/rollout/claim and /v1/rollout/submit: parsed, answered and
  // rendered. A claim that does not parse is InvalidArgument naming what was wrong (the
  // route answers it 400 in the one error shape, transport/api.h); a submission that does
  // not parse is refused naming what was wrong, and one whose samples do not parse closes
  // its claim as Submit does.
  Result<std::string> HandleClaim(std::string_view body);
  std::string HandleSubmit(std::string_view body);
  // POST /v1/rollout/turn (multi-turn): grades this turn of the claim's live episodes and
  // answers each with its reward, the messages to continue with, or why it is ungraded.
  // Blocks until the grader answered (each sample within its timeout). InvalidArgument for
  // a request that does not parse, a claim that is not out to this worker, an index out of
  // range or of a finished episode, a second turn of a claim while one is at the
  // environment, or max_turns = 1. Each turn renews the claim's lease.
  Result<std::string> HandleTurn(std::string_view body);

  // The trainer's version (what it trains on now); claims and admission follow it.
  void SetVersion(uint64_t version);
  // Waits until groups_per_step groups are admitted at the current version (dropping stale
  // ones) and returns them; at `deadline` (on options.env's steady clock) returns nothing,
  // or with `partial` what there is; after Finish() returns what there is at once. A
  // returned batch counts as in training until the next SetVersion.
  std::vector<Group> TakeBatch(Clock::time_point deadline, bool partial = false);
  // Claims are answered "done" from now on; TakeBatch returns at once.
  void Finish();
  CoordinatorStats stats() const;
  size_t queued() const;
  // OK, or the grader's error once it failed for good.
  Status failure() const;

  // Sync latency, from what the workers say in their claims ("version" and
  // "serving_since_unix_us", the wall-clock time they began serving it): the trainer
  // published `version` at `unix_us`...
  void NotePublished(uint64_t version, int64_t unix_us);
  // ... and every version that all live workers (those that claimed in the last 5 s) now
  // serve, once, oldest first, with the time from its publication to the last worker's swap.
  struct Synced {
    uint64_t version = 0;
    double ms = 0;
    size_t workers = 0;
  };
  std::vector<Synced> TakeSynced();

 private:
  struct Episode {
    nlohmann::json conversation;  // the prompt messages, then every turn so far
    int64_t turns = 0;
    bool done = false;
    std::optional<double> reward;  // done: the environment's reward, or nullopt (ungraded)
  };
  struct Lease {
    Problem problem;
    std::string worker;
    std::string incarnation;
    Clock::time_point expires;
    std::vector<Episode> episodes;  // multi-turn: one per sample, from the first turn
    bool turn_in_flight = false;    // a turn of this claim is at the environment
  };
  void ExpireLeases(Clock::time_point now);  // REQUIRES: mutex_
  Problem NextProblem();                      // REQUIRES: mutex_
  Status ValidateGroup(const std::vector<Sample>& samples) const;
  // Hands an accepted group's samples to the grader (outside mutex_).
  void Grade(uint64_t claim);
  // One sample's outcome; the last of its group admits or drops the group.
  void Graded(uint64_t claim, size_t index, grading::Outcome outcome);
  // HandleTurn's parts: checks the turn and marks it in flight (under mutex_); asks the
  // environment (outside it); records the outcomes and renders the answer (under it).
  struct TurnResult {
    std::string text;  // the turn's completion, decoded
    nlohmann::json message;  // the same as an assistant message, tool calls parsed
    grading::Outcome outcome;
  };
  Result<std::vector<grading::Sample>> BeginTurn(const TurnRequest& request);
  std::vector<TurnResult> AskEnvironment(const TurnRequest& request, std::vector<grading::Sample> samples);
  Result<std::string> FinishTurn(const TurnRequest& request, std::vector<TurnResult> results);
  // Queues a scored group, or drops it (zero variance, too few graded). REQUIRES: mutex_
  void Admit(Group group, const std::vector<std::optional<double>>& rewards);
  // Refuses a submission; when its claim is out to that worker, closes it and requeues the
  // prompt. REQUIRES: mutex_
  pipeline::SubmitAnswer RefuseAndRequeue(const pipeline::SubmitRequest& request,
                                           const std::string& reason);

  const Task& task_;
  CoordinatorOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::mt19937_64 rng_;
  uint64_t epoch_;  // random per process: claims of an earlier trainer run never match
  uint64_t next_claim_ = 1;
  uint64_t version_ = 0;
  bool finished_ = false;
  bool in_training_ = false;  // a batch was taken and its version is not published yet
  std::deque<Problem> requeued_;
  std::map<uint64_t, Lease> leases_;
  std::map<std::string, std::string> incarnations_;  // worker -> latest incarnation
  struct WorkerView {
    Clock::time_point last_claim;
    uint64_t first_version = 0;               // serving when first seen
    std::map<uint64_t, int64_t> served_since;  // published version -> when it served it
  };
  std::map<std::string, WorkerView> workers_;
  std::map<uint64_t, int64_t> published_;  // version -> unix us, until every worker swapped
  std::deque<Group> queue_;
  struct Grading {
    Group group;
    std::vector<std::optional<double>> rewards;  // nullopt: ungraded
    size_t pending = 0;
  };
  std::map<uint64_t, Grading> grading_;  // by claim
  grading::ZeroVarianceFilter zero_variance_;
  Status failure_;
  CoordinatorStats stats_;
};

}  // namespace flywheel::pipeline
