#include "transport/io_pool.h"

#include <pthread.h>
#include <time.h>

namespace flywheel::transport {

IoPool::IoPool(int threads, std::string name, std::chrono::milliseconds drain)
    : context_(threads), guard_(asio::make_work_guard(context_)), drain_(drain) {
  running_ = threads;
  for (int i = 0; i < threads; ++i) {
    const std::string thread_name = (name + "-" + std::to_string(i)).substr(0, 15);
    threads_.emplace_back([this, thread_name] {
      pthread_setname_np(pthread_self(), thread_name.c_str());
      context_.run();
      std::lock_guard<std::mutex> lock(mutex_);
      --running_;
      ended_.notify_all();
    });
  }
}

IoPool::~IoPool() {
  Shutdown();
}

bool IoPool::Stop() {
  if (stopped_) return true;
  stopped_ = true;
  guard_.reset();
  bool drained;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    drained = ended_.wait_for(lock, drain_, [this] { return running_ == 0; });
  }
  context_.stop();
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
  threads_.clear();
  return drained;
}

void IoPool::Shutdown() {
  Stop();
  if (shut_down_) return;
  shut_down_ = true;
  context_.shutdown();
}

std::vector<double> IoPool::CpuSeconds() {
  std::vector<double> seconds;
  for (std::thread& thread : threads_) {
    clockid_t clock;
    timespec ts{};
    if (pthread_getcpuclockid(thread.native_handle(), &clock) == 0 &&
        clock_gettime(clock, &ts) == 0) {
      seconds.push_back(static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9);
    }
  }
  return seconds;
}

}  // namespace flywheel::transport
