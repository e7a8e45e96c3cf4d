#include "rollout/scheduler.h"

#include <algorithm>

namespace flywheel::rollout {

RequestScheduler::RequestScheduler(std::shared_ptr<Engine> engine, StepGuard step_guard)
    : engine_(std::move(engine)), step_guard_(std::move(step_guard)) {
  driver_ = std::thread([this] { Drive(); });
}

RequestScheduler::~RequestScheduler() {
  Stop();
}

void RequestScheduler::Stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (driver_.joinable()) driver_.join();
  std::lock_guard lock(mutex_);
  for (auto& [id, route] : routes_) {
    std::lock_guard job_lock(route.first->m);
    route.first->aborted = true;
    route.first->cv.notify_all();
  }
  routes_.clear();
}

void RequestScheduler::Drive() {
  for (;;) {
    std::vector<uint64_t> cancels;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !routes_.empty() || !cancels_.empty(); });
      if (stopping_) return;
      cancels.swap(cancels_);
    }
    for (uint64_t id : cancels) engine_->Cancel(id);
    {
      std::lock_guard lock(mutex_);
      if (routes_.empty()) continue;
    }
    std::vector<TokenEvent> events;
    std::vector<GenerationResult> finished;
    if (step_guard_) {
      step_guard_([&] { finished = engine_->Step(&events); });
    } else {
      finished = engine_->Step(&events);
    }
    if (events.empty() && finished.empty()) continue;
    std::lock_guard lock(mutex_);
    Route(events, finished);
  }
}

void RequestScheduler::Route(std::vector<TokenEvent>& events,
                             std::vector<GenerationResult>& finished) {
  std::vector<std::shared_ptr<Job>> touched;  // owned: a finished route may hold the last reference
  for (TokenEvent& e : events) {
    auto it = routes_.find(e.id);
    if (it == routes_.end() || !it->second.first->want_events) continue;
    Job& job = *it->second.first;
    std::lock_guard job_lock(job.m);
    job.events.emplace_back(it->second.second, std::move(e));
    touched.push_back(it->second.first);
  }
  for (GenerationResult& r : finished) {
    auto it = routes_.find(r.id);
    if (it == routes_.end()) continue;
    Job& job = *it->second.first;
    {
      std::lock_guard job_lock(job.m);
      job.results[it->second.second] = std::move(r);
      job.news = true;
    }
    touched.push_back(it->second.first);
    routes_.erase(it);
  }
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (const auto& job : touched) job->cv.notify_all();
}

Status RequestScheduler::Submit(const std::shared_ptr<Job>& job,
                                std::vector<GenerationRequest> requests) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return Status::Unavailable("the rollout worker is stopping");
    // Validate all first, so a bad request submits nothing.
    for (const auto& r : requests) FW_RETURN_IF_ERROR(engine_->Validate(r));
    job->results.resize(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      auto id = engine_->Submit(std::move(requests[i]));
      if (!id.ok()) {
        // All or none: what went in already comes out again.
        for (uint64_t submitted : job->ids) {
          routes_.erase(submitted);
          cancels_.push_back(submitted);
        }
        wake_.notify_all();
        return id.status();
      }
      job->ids.push_back(*id);
      routes_[*id] = {job, i};
    }
  }
  wake_.notify_all();
  return Status::Ok();
}

void RequestScheduler::CancelIds(const std::vector<uint64_t>& ids) {
  {
    std::lock_guard lock(mutex_);
    for (uint64_t id : ids) {
      if (routes_.erase(id) > 0) cancels_.push_back(id);
    }
  }
  wake_.notify_all();
}

void RequestScheduler::Cancel(const std::shared_ptr<Job>& job, bool client_left) {
  CancelIds(job->ids);
  if (!client_left) return;
  std::lock_guard job_lock(job->m);
  job->gone = true;
  job->cv.notify_all();
}

Result<std::vector<GenerationResult>> RequestScheduler::Generate(
    std::vector<GenerationRequest> requests) {
  auto job = std::make_shared<Job>();
  job->want_events = false;
  const size_t n = requests.size();
  FW_RETURN_IF_ERROR(Submit(job, std::move(requests)));
  std::unique_lock lock(job->m);
  job->cv.wait(lock, [&] {
    return job->aborted || std::all_of(job->results.begin(), job->results.end(),
                                       [](const auto& r) { return r.has_value(); });
  });
  if (job->aborted) return Status::Unavailable("the rollout worker stopped");
  std::vector<GenerationResult> out;
  out.reserve(n);
  for (auto& r : job->results) out.push_back(std::move(*r));
  return out;
}

}  // namespace flywheel::rollout
