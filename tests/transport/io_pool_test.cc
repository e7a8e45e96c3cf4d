// IoPool (transport/io_pool.h): a loop is not stopped and freed while another pool still
// holds its work (the egress tests' hang: a hop's frame on the pool released the loop's
// work after the loop had resumed and the test had destroyed it); Shutdown destroys what
// is queued and keeps the context valid; threads carry their names.
#include "transport/io_pool.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>

namespace flywheel::transport {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// What co_spawn(strand, task, use_awaitable) does on the pool when `task` ends (asio
// 1.18, impl/co_spawn.hpp): it dispatches the result to the awaiting loop, then finishes
// its frame, and only then lets go of the loop's work (`handler_work`). Here the frame's
// end takes 300 ms, so the loop has resumed (and the test moved on) long before.
void HopTail(asio::any_io_executor pool, asio::io_context& loop,
             std::shared_ptr<std::promise<void>> resumed, std::shared_ptr<std::atomic<bool>> tail) {
  auto handler_work = asio::make_work_guard(loop);
  auto body = [handler_work = std::move(handler_work), resumed, tail]() mutable {
    auto resume = [resumed] { resumed->set_value(); };
    asio::dispatch(handler_work.get_executor(), resume);
    std::this_thread::sleep_for(300ms);  // the rest of the frame, on the pool thread
    *tail = true;
    handler_work.reset();
  };
  asio::post(pool, std::move(body));
}

// Without the drain the loop was stopped and freed at once, its work count still held by
// the hop's frame on the pool, which then wrote to freed memory (a next loop at the same
// address saw its run() return, and Loop::Call hung: the 1-in-30 hang).
TEST(IoPoolTest, StopWaitsWhileAHopOnAnotherPoolStillHoldsTheLoop) {
  IoPool pool(2, "pool");
  for (int round = 0; round < 3; ++round) {
    auto tail = std::make_shared<std::atomic<bool>>(false);
    {
      IoPool loop(1, "loop", 5s);
      auto resumed = std::make_shared<std::promise<void>>();
      std::future<void> done = resumed->get_future();
      HopTail(asio::make_strand(pool.executor()), loop.context(), resumed, tail);
      ASSERT_EQ(done.wait_for(5s), std::future_status::ready);
      EXPECT_FALSE(*tail) << "the hop's frame went before the loop resumed: the race is not set up";
      // The loop goes here.
    }
    EXPECT_TRUE(*tail) << "round " << round
                       << ": the loop was stopped while the pool still held its work";
  }
}

TEST(IoPoolTest, StopGivesUpOnWorkThatDoesNotEndAfterTheDrain) {
  IoPool loop(1, "loop", 100ms);
  auto forever = std::make_shared<asio::steady_timer>(loop.executor(), Clock::time_point::max());
  forever->async_wait([forever](error_code) {});
  const auto start = Clock::now();
  EXPECT_FALSE(loop.Stop()) << "a timer that never fires let the work end";
  EXPECT_GE(Clock::now() - start, 90ms);
  EXPECT_LT(Clock::now() - start, 3s);
  EXPECT_TRUE(loop.Stop()) << "Stop is idempotent";
}

TEST(IoPoolTest, ShutdownDestroysQueuedHandlersAndKeepsTheContext) {
  IoPool pool(1, "pool", 5s);  // nothing holds work: Stop() drains at once
  auto held = std::make_shared<int>(7);
  ASSERT_TRUE(pool.Stop());
  asio::post(pool.executor(), [held] {});  // queued on a stopped pool: never runs
  EXPECT_EQ(held.use_count(), 2);
  pool.Shutdown();
  EXPECT_EQ(held.use_count(), 1) << "the queued handler outlived Shutdown";
  // Still a valid context: another's handler may still release work on it.
  auto guard = asio::make_work_guard(pool.context());
  guard.reset();
}

TEST(IoPoolTest, ThreadsAreNamedAndCounted) {
  IoPool pool(3, "egress-long-name");
  EXPECT_EQ(pool.threads(), 3);
  EXPECT_EQ(pool.CpuSeconds().size(), 3u);
  std::promise<std::string> named;
  asio::post(pool.executor(), [&named] {
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof name);
    named.set_value(name);
  });
  const std::string name = named.get_future().get();
  EXPECT_EQ(name.rfind("egress-long-", 0), 0u) << name;
  EXPECT_LE(name.size(), 15u);
  pool.Stop();
  EXPECT_TRUE(pool.CpuSeconds().empty());
}

}  // namespace
}  // namespace flywheel::transport
