// The request scheduler of a rollout worker: one thread that drives the engine (Step after
// Step while any request is in flight) and routes what each step produced, token events and
// finished generations, to the job that submitted the request. The OpenAI API
// (rollout/openai_api.h) and the in-process RL loop submit through it.
//
// Thread safety: every method may be called from any thread. A job's fields are guarded by
// its own mutex `m`; the scheduler's routes by its own. Never call into the scheduler while
// holding a job's mutex.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "base/status.h"
#include "rollout/engine.h"

namespace flywheel::rollout {

class RequestScheduler {
 public:
  // One caller's generations: the engine requests it submitted (by choice) and what they
  // produced. The scheduler fills `events` (when want_events), `results` and `news`, and
  // notifies `cv`; the caller reads them under `m`.
  struct Job {
    std::mutex m;
    std::condition_variable cv;
    bool want_events = true;
    std::vector<uint64_t> ids;                              // engine ids, by choice
    std::deque<std::pair<size_t, TokenEvent>> events;       // GUARDED_BY(m): (choice, event)
    std::vector<std::optional<GenerationResult>> results;  // GUARDED_BY(m)
    bool news = false;     // GUARDED_BY(m): a result arrived
    bool aborted = false;  // GUARDED_BY(m): the scheduler stopped
    bool gone = false;     // GUARDED_BY(m): the client left (set by the caller, see Cancel)
  };

  // Runs every engine step (the argument) inside it, e.g. under the sync worker's shared
  // weights lock (ServingOptions::step_guard); null: steps run as they are.
  using StepGuard = std::function<void(const std::function<void()>&)>;

  // Starts the driver thread.
  RequestScheduler(std::shared_ptr<Engine> engine, StepGuard step_guard);
  // Stop().
  ~RequestScheduler();
  RequestScheduler(const RequestScheduler&) = delete;
  RequestScheduler& operator=(const RequestScheduler&) = delete;

  // Stops the driver; jobs still waiting are marked aborted and woken, and later Submits
  // are Unavailable. Idempotent.
  void Stop();

  // Submits the job's requests, all or none: every request is validated first, and one the
  // engine refuses takes the others out again. Unavailable once stopping.
  Status Submit(const std::shared_ptr<Job>& job, std::vector<GenerationRequest> requests);
  // Drops the job's unfinished requests (done with, or a client that left: then whoever
  // waits on the job wakes up with `gone` set).
  void Cancel(const std::shared_ptr<Job>& job, bool client_left = false);
  // Drops these engine requests (their routes go at once, the engine's between two steps).
  void CancelIds(const std::vector<uint64_t>& ids);
  // In-process: submits every request (all or none), waits for their results, in order.
  Result<std::vector<GenerationResult>> Generate(std::vector<GenerationRequest> requests);

  Engine& engine() { return *engine_; }

 private:
  void Drive();
  // Hands a step's events and results to their jobs. REQUIRES: mutex_ held.
  void Route(std::vector<TokenEvent>& events, std::vector<GenerationResult>& finished);

  std::shared_ptr<Engine> engine_;
  StepGuard step_guard_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;                                               // GUARDED_BY(mutex_)
  std::map<uint64_t, std::pair<std::shared_ptr<Job>, size_t>> routes_;  // GUARDED_BY(mutex_)
  std::vector<uint64_t> cancels_;                                       // GUARDED_BY(mutex_)
  std::thread driver_;
};

}  // namespace flywheel::rollout
