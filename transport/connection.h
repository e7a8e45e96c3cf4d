// A framed, optionally TLS, optionally shaped connection between two flywheel nodes.
//
// Each Connection runs four coroutines on its executor: a reader that reads frames ahead
// into a bounded inbound queue, a writer that drains a bounded outbound queue (TLS records
// are sealed there), a heartbeat sender, and a watchdog. So:
// - every read and write has a deadline: a peer that sends nothing (not even the
//   heartbeat it owes every `heartbeat`) for `idle_timeout`, or a write that does not
//   complete in `io_timeout`, closes the connection with a status that says which;
// - Send() waits while more than `max_queued_bytes` are queued (backpressure: a slow
//   peer holds its sender's memory bounded, and the sender stops reading requests), and
//   the reader stops reading the socket while `max_inbound_bytes` wait to be received,
//   so TCP flow control pushes back on a fast peer;
// - shaped links delay each frame until its LinkShaper releases it (rate and latency).
// Dial() and Listener do the connect, the TLS handshake and the Hello/Welcome exchange
// (protocol version and bearer token, compared in constant time) under a deadline.
//
// Threads. A connection's executor (executor()) is its socket's: the process's network
// executor, or, with an egress pool (ListenerOptions::egress, DialOptions::egress), a
// strand of that pool of its own, so that the TLS sealing and socket writes of many
// connections run on many cores while each connection's reads and writes stay in order.
// Its queues, timers and stream are touched on that executor only. Every public member
// may be called from any executor: Send() and Receive() run on the connection's executor
// (a caller elsewhere hops there with co_spawn and resumes on its own executor; a caller
// on it runs inline), Close(), CloseAfterFlush(), set_shaping() and set_limits() are
// dispatched to it (inline when called on it), and the accessors read atomics or fields
// fixed before the connection is handed out (peer, hello, welcome). The role logic that
// owns a connection (catalog, caches, link registry) stays on its own executor.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "base/status.h"
#include "transport/asio.h"
#include "transport/endpoint.h"
#include "transport/frame.h"
#include "transport/shaper.h"

namespace flywheel::transport {

struct ConnectionOptions {
  FrameLimits limits;
  std::chrono::milliseconds heartbeat{1000};     // send a heartbeat when idle this long
  std::chrono::milliseconds idle_timeout{5000};  // drop a peer silent this long
  std::chrono::milliseconds io_timeout{10000};   // drop when one write takes this long
  size_t max_queued_bytes = 8u << 20;            // outbound; Send() waits beyond this
  size_t max_inbound_bytes = 8u << 20;           // read-ahead; reading pauses beyond this
  LinkShaping shaping;                           // none by default
  // Plain TCP: a frame's head and payload (a cached piece, shared) go out in one
  // scatter/gather sendmsg, never copied together; false copies them into one buffer
  // first (the benchmark's peer for the gather write). TLS always seals from the piece.
  bool gather_writes = true;
};

// Wakes every coroutine waiting on it (single-threaded use on one executor).
class Signal {
 public:
  explicit Signal(asio::any_io_executor executor)
      : timer_(std::move(executor), Clock::time_point::max()) {}
  awaitable<void> Wait() {
    error_code ec;
    co_await timer_.async_wait(asio::redirect_error(use_awaitable, ec));
  }
  void Notify() { timer_.cancel(); }

 private:
  asio::steady_timer timer_;
};

// Sleeps for `duration` on the current coroutine's executor.
awaitable<void> SleepFor(Clock::duration duration);

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  struct Stream;  // the socket: plain TCP or TLS over TCP

  Connection(std::shared_ptr<Stream> stream, std::string peer, ConnectionOptions options);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Starts the reader, writer, heartbeat and watchdog. Call once.
  void Start();

  // The next frame other than a heartbeat; the close reason once the connection closed.
  awaitable<Result<Frame>> Receive();
  // Receive() with a deadline (Unavailable "timed out waiting for ..." naming `what`).
  awaitable<Result<Frame>> Receive(std::chrono::milliseconds timeout, const std::string& what);
  // Queues `frame`; waits while the queue is over its limit. Fails once closed.
  awaitable<Status> Send(Frame frame);

  // Closes now: pending Receive/Send return `reason`. Idempotent (the first reason stays).
  // From another executor the close happens on the connection's, shortly after.
  void Close(Status reason);
  // Closes once everything queued so far was written (e.g. after a Refused).
  void CloseAfterFlush(Status reason);

  bool closed() const { return closed_flag_.load(std::memory_order_acquire); }
  Status close_reason() const;
  const std::string& peer() const { return peer_; }  // "host:port" of the other end
  std::string tls_cipher() const;  // the negotiated TLS suite; "" over plain TCP
  uint64_t bytes_in() const { return bytes_in_.load(std::memory_order_relaxed); }
  uint64_t bytes_out() const { return bytes_out_.load(std::memory_order_relaxed); }
  bool shaped() const { return shaped_.load(std::memory_order_relaxed); }
  // Shapes frames queued or read from now on (a listener decides after the Hello).
  void set_shaping(LinkShaping shaping);
  // Limits for frames whose prefix is read from now on (a listener widens them after the
  // Hello: an unauthenticated peer cannot make it allocate a large frame).
  void set_limits(FrameLimits limits);
  asio::any_io_executor executor() const;

  // What the Hello/Welcome exchange told about the other end.
  wire::Hello hello;      // server side: the client's Hello
  wire::Welcome welcome;  // client side: the server's Welcome

 private:
  // The members above, on the connection's executor.
  awaitable<Status> SendHere(Frame frame);
  awaitable<Result<Frame>> ReceiveHere();
  awaitable<Result<Frame>> ReceiveHere(std::chrono::milliseconds timeout, std::string what);
  void CloseHere(Status reason);
  void CloseAfterFlushHere(Status reason);
  // Hops from another executor (coroutines take shared_ptr parameters only: GCC 12).
  static awaitable<Status> SendHop(std::shared_ptr<Connection> self, std::shared_ptr<Frame> frame);
  static awaitable<std::optional<Result<Frame>>> ReceiveHop(
      std::shared_ptr<Connection> self,
      std::shared_ptr<std::pair<std::chrono::milliseconds, std::string>> deadline);

  awaitable<void> ReadLoop();
  awaitable<void> WriteLoop();
  awaitable<void> HeartbeatLoop();
  awaitable<void> Watchdog();

  struct Outbound {
    Frame frame;
    Clock::time_point due;
    size_t bytes;
  };
  struct Inbound {
    Frame frame;
    Clock::time_point due;
    size_t bytes;
  };

  std::shared_ptr<Stream> stream_;
  std::string peer_;
  ConnectionOptions options_;
  std::deque<Outbound> outbound_;
  std::deque<Inbound> inbound_;
  size_t outbound_bytes_ = 0;
  size_t inbound_bytes_ = 0;
  Signal outbound_ready_, outbound_space_, inbound_ready_, inbound_space_;
  asio::steady_timer watchdog_timer_;
  bool closed_ = false;  // on the executor; closed_flag_ repeats it for other threads
  std::atomic<bool> closed_flag_{false};
  std::atomic<bool> shaped_{false};
  bool close_after_flush_ = false;
  mutable std::mutex reason_mutex_;  // close_reason_: written on the executor, read anywhere
  Status close_reason_;
  Clock::time_point last_rx_, last_tx_;
  std::optional<Clock::time_point> write_started_;
  bool reader_paused_ = false;
  std::atomic<uint64_t> bytes_in_{0}, bytes_out_{0};
};

struct DialOptions {
  Endpoint endpoint;
  // Null: the connection runs on the dialling coroutine's executor. Otherwise on a strand
  // of this executor (an egress pool), dialled and handshaken there.
  asio::any_io_executor egress;
  std::shared_ptr<asio::ssl::context> tls;  // null: plain TCP
  std::chrono::milliseconds timeout{5000};  // connect + TLS handshake + Hello/Welcome
  ConnectionOptions connection;
};

// Tests only: with FLYWHEEL_TEST_EGRESS_THREADS=N in the environment, Dial and Listener
// give every connection whose options name no egress pool a strand of one process-wide
// pool of N threads, so that suites written for one thread run multi-threaded unchanged.
// Null (the default): no pool.
asio::any_io_executor TestEgressPool();

// Connects, handshakes and sends `hello`; returns the started connection once the peer
// answered Welcome (kept in connection->welcome). Refused is Unavailable with the peer's
// reason ("refused by 127.0.0.1:7000: wrong or missing token").
awaitable<Result<std::shared_ptr<Connection>>> Dial(DialOptions options, wire::Hello hello);

struct ListenerOptions {
  std::shared_ptr<asio::ssl::context> tls;            // null: plain TCP
  std::string token;                                  // empty: no token required
  std::chrono::milliseconds handshake_timeout{5000};  // TLS handshake + Hello
  size_t max_connections = 1024;                      // more are closed at once
  // Null: connections run on the listener's executor. Otherwise each accepted connection
  // runs on a strand of its own of this executor (an egress pool: its TLS handshake,
  // record sealing and socket I/O there); on_peer and make_welcome still run on the
  // listener's executor.
  asio::any_io_executor egress;
  ConnectionOptions connection;
  // Shaping for a peer, decided from its Hello (e.g. by region). Null: options above.
  std::function<LinkShaping(const wire::Hello&)> shaping_for;
};

// Accepts connections, does the TLS handshake and checks the Hello (protocol version,
// token), answers Welcome (from make_welcome) or Refused, then hands the started
// connection to on_peer in its own coroutine.
class Listener {
 public:
  using PeerHandler = std::function<awaitable<void>(std::shared_ptr<Connection>)>;

  static Result<std::unique_ptr<Listener>> Bind(asio::any_io_executor executor,
                                                const Endpoint& endpoint, ListenerOptions options);
  ~Listener();
  void Start(std::function<wire::Welcome(const wire::Hello&)> make_welcome, PeerHandler on_peer);
  uint16_t port() const;
  // Stops accepting and closes every connection it accepted. Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit Listener(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

namespace internal {
template <typename Fn>
struct PoolTask {
  explicit PoolTask(Fn f) : fn(std::move(f)) {}
  Fn fn;
  std::optional<std::invoke_result_t<Fn>> result;
};
// GCC 12.2 destroys a lambda or braced (aggregate) temporary that appears in a co_await
// full-expression twice (e.g. `co_await f([p] {...})` drops p's count by two). flywheel
// never writes one: lambdas and aggregates are named first, then passed.
template <typename Task>
awaitable<void> RunTaskBody(std::shared_ptr<Task> task) {
  task->result.emplace(task->fn());
  co_return;
}
template <typename Task>
awaitable<decltype(Task::result)> RunTask(asio::thread_pool* pool, std::shared_ptr<Task> task) {
  co_await asio::co_spawn(*pool, RunTaskBody(task), use_awaitable);
  co_return std::move(task->result);
}
}  // namespace internal

// Runs `fn` on `pool` and resumes the calling coroutine with its result on its own
// executor (CPU work off the network thread). Not a coroutine itself: `fn` moves into
// shared state before any coroutine frame exists.
template <typename Fn>
awaitable<std::optional<std::invoke_result_t<Fn>>> RunOn(asio::thread_pool& pool, Fn fn) {
  return internal::RunTask(&pool, std::make_shared<internal::PoolTask<Fn>>(std::move(fn)));
}

}  // namespace flywheel::transport
