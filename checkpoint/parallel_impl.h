// Implementation details of checkpoint/parallel.h.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

namespace flywheel {
namespace parallel_detail {

// Shared between the caller and the helper jobs of one ParallelFor. Helpers that start
// after the caller closed it return without touching the (then dead) function.
struct Session {
  std::mutex mu;
  std::condition_variable idle;
  int running = 0;      // GUARDED_BY(mu)
  bool closed = false;  // GUARDED_BY(mu)
  std::atomic<size_t> next{0};
  std::exception_ptr error;  // GUARDED_BY(mu): the first exception a helper threw
};

}  // namespace parallel_detail

template <typename Fn>
void ParallelFor(size_t count, int threads, Fn&& fn) {
  size_t workers = std::min<size_t>(count, static_cast<size_t>(std::max(threads, 1)));
  if (workers <= 1) {
    for (size_t i = 0; i < count; ++i) fn(i);
    return;
  }
  auto session = std::make_shared<parallel_detail::Session>();
  // Runs indices until none are left; an exception stops the others early and is
  // returned, so that none ever leaves a pool thread (the caller rethrows the first).
  auto drain = [session, count, &fn]() -> std::exception_ptr {
    try {
      for (size_t i = session->next.fetch_add(1, std::memory_order_relaxed); i < count;
           i = session->next.fetch_add(1, std::memory_order_relaxed)) {
        fn(i);
      }
      return nullptr;
    } catch (...) {
      session->next.store(count, std::memory_order_relaxed);
      return std::current_exception();
    }
  };
  SubmitToPool(workers - 1, [session, drain] {
    {
      std::lock_guard<std::mutex> lock(session->mu);
      if (session->closed) return;
      ++session->running;
    }
    std::exception_ptr error = drain();
    std::lock_guard<std::mutex> lock(session->mu);
    if (error && !session->error) session->error = error;
    if (--session->running == 0) session->idle.notify_all();
  });
  std::exception_ptr error = drain();
  // Whatever happened, no helper may still be running `fn` when this frame unwinds.
  std::unique_lock<std::mutex> lock(session->mu);
  session->closed = true;
  session->idle.wait(lock, [&] { return session->running == 0; });
  if (!error) error = session->error;
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

}  // namespace flywheel
