#include "checkpoint/parallel.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace flywheel {
namespace {

class Pool {
 public:
  void Submit(size_t helpers, std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mu_);
    // Grow to the largest fan-out ever asked for (bounded).
    while (threads_.size() < std::min<size_t>(helpers, kMaxThreads)) {
      threads_.emplace_back([this] { Work(); });
      threads_.back().detach();
    }
    for (size_t i = 0; i < helpers; ++i) queue_.push_back(job);
    ready_.notify_all();
  }

 private:
  static constexpr size_t kMaxThreads = 256;
  void Work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [&] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> queue_;  // GUARDED_BY(mu_)
  std::vector<std::thread> threads_;         // GUARDED_BY(mu_)
};

}  // namespace

void SubmitToPool(size_t helpers, std::function<void()> job) {
  // Leaked on purpose: detached workers may outlive static destruction.
  static Pool* pool = new Pool;
  pool->Submit(helpers, std::move(job));
}

}  // namespace flywheel
