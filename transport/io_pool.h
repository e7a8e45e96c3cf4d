// An io_context run by N named threads: a process's network loop (N = 1) or an egress
// pool (--egress-threads), and the tests' and benchmarks' loops.
//
// Two pools that hand work to each other (a connection on a strand of the egress pool,
// the role coroutine that awaits it on the network loop) hold each other's work: a
// coroutine hopping from the loop to a strand (co_spawn(strand, ..., use_awaitable))
// keeps a work count on the loop until its frame on the strand is gone, and that is
// *after* the loop's coroutine has resumed (the pool thread finishes the frame while the
// loop already runs on). So:
// - Stop() lets the threads run until nothing holds work on the context (up to `drain`),
//   then stops and joins them: a context stopped and destroyed at once, while another
//   thread still holds its work, is written to after it is freed (a later context at
//   the same address then sees its work count drop to zero and its run() return: the
//   egress tests' 1-in-30 hang);
// - Shutdown() destroys the handlers still queued, while the context itself stays valid:
//   shut every pool down first, destroy them after (each one's handlers may release work
//   on, or close sockets of, another). The destructor does Stop() and Shutdown().
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/asio.h"

namespace flywheel::transport {

class IoPool {
 public:
  // `threads` threads named "<name>-<i>" (at most 15 characters, as Linux keeps them)
  // run the context; Stop() waits up to `drain` for its work to end.
  explicit IoPool(int threads, std::string name = "io",
                  std::chrono::milliseconds drain = std::chrono::milliseconds(0));
  ~IoPool();
  IoPool(const IoPool&) = delete;
  IoPool& operator=(const IoPool&) = delete;

  asio::io_context& context() { return context_; }
  asio::any_io_executor executor() { return context_.get_executor(); }
  int threads() const { return static_cast<int>(threads_.size()); }

  // Drops the pool's own work guard, lets the threads run until no handler holds work on
  // the context (at most `drain`, the constructor's), then stops and joins them.
  // Returns whether the work ended by itself. Idempotent.
  bool Stop();
  // Stop(), then destroys every handler still queued or pending (timers, socket waits,
  // strands). The context stays valid until the destructor, for others' handlers.
  void Shutdown();

  // Each running thread's CPU seconds so far (empty once stopped).
  std::vector<double> CpuSeconds();

 private:
  // io_context::shutdown() is protected (it is the first half of the destructor).
  struct Context : asio::io_context {
    explicit Context(int hint) : asio::io_context(hint) {}
    using asio::io_context::shutdown;
  };

  Context context_;
  asio::executor_work_guard<asio::io_context::executor_type> guard_;
  std::chrono::milliseconds drain_;
  std::mutex mutex_;
  std::condition_variable ended_;
  int running_ = 0;  // threads whose run() has not returned
  bool stopped_ = false, shut_down_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace flywheel::transport
