// StartProcessGrader: one long-lived grader process, driven by one I/O thread (poll on its
// stdin, stdout, stderr and a wake-up pipe). docs/GRADERS.md "Failures" is the contract.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "grading/child.h"
#include "grading/grader.h"
#include "grading/internal.h"
#include "grading/protocol.h"

namespace flywheel::grading {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Longer stdout lines are dropped (counted as garbage) rather than buffered.
constexpr size_t kMaxLine = size_t{16} << 20;

std::string DescribeExit(int wait_status) {
  if (WIFEXITED(wait_status))
    return "exited with status " + std::to_string(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(wait_status)) + " (" +
           strsignal(WTERMSIG(wait_status)) + ")";
  }
  return "ended";
}

struct Request {
  Sample sample;
  OutcomeCallback done;
  int sends = 0;              // times written to a grader process
  Clock::time_point sent_at;  // the last write
};

using Finished = std::vector<std::pair<OutcomeCallback, Outcome>>;

class ProcessGrader final : public AsyncGrader {
 public:
  ProcessGrader(std::string command, std::vector<std::string> argv, ExternalGraderOptions options)
      : command_(std::move(command)),
        argv_(std::move(argv)),
        options_(options),
        streak_(options.max_grader_failures) {}
  ~ProcessGrader() override;

  Status Start();

  using AsyncGrader::Submit;
  void Submit(Sample sample, OutcomeCallback done) override;
  Status status() const override {
    std::lock_guard lock(mu_);
    return status_;
  }
  GraderCounters counters() const override {
    std::lock_guard lock(mu_);
    return counters_;
  }
  std::string name() const override { return command_; }

 private:
  void Loop();
  void Wake();
  // Under mu_: the steps of one round of the loop.
  void Dispatch(Finished& finished);
  void Expire(Clock::time_point now, Finished& finished);
  void Restart(Clock::time_point now, Finished& finished);
  void OnExit(const std::string& how, Finished& finished);
  void OnLine(std::string_view line, Finished& finished);
  void OnStderr(std::string_view bytes);
  void Complete(Request& request, Outcome outcome, Finished& finished);
  void Failure(const std::string& reason, Finished& finished);
  void FailAll(Finished& finished);
  std::string StderrTail() const;
  // Without mu_: moving bytes.
  bool Pump(Finished& finished);
  int PollTimeoutMs();

  const std::string command_;
  const std::vector<std::string> argv_;
  const ExternalGraderOptions options_;

  mutable std::mutex mu_;
  std::deque<Request> pending_;               // GUARDED_BY(mu_): not written yet
  std::map<std::string, Request> in_flight_;  // GUARDED_BY(mu_): written, by id
  GraderCounters counters_;                   // GUARDED_BY(mu_)
  Status status_;                             // GUARDED_BY(mu_)
  FailureStreak streak_;                      // GUARDED_BY(mu_)
  std::deque<std::string> stderr_lines_;      // GUARDED_BY(mu_)
  std::string write_buffer_;                  // GUARDED_BY(mu_)
  bool stopping_ = false;                     // GUARDED_BY(mu_)
  Clock::time_point restart_at_;              // GUARDED_BY(mu_)
  int crashes_in_a_row_ = 0;                  // GUARDED_BY(mu_)
  Clock::time_point last_output_;             // GUARDED_BY(mu_): the last stdout line

  // The I/O thread's own (and Start()'s, before the thread runs).
  Child child_;
  std::string stdout_buffer_;
  bool skipping_long_line_ = false;
  std::string stderr_partial_;  // GUARDED_BY(mu_)
  int wake_[2] = {-1, -1};
  std::thread thread_;
};

Status ProcessGrader::Start() {
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return Status::IOError(std::string("pipe: ") + std::strerror(errno));
  }
  Status started = child_.Start(argv_);
  if (!started.ok()) {
    return Status(started.code(),
                  "grader command '" + command_ + "' does not start: " + started.message());
  }
  last_output_ = Clock::now();
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

ProcessGrader::~ProcessGrader() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  Wake();
  if (thread_.joinable()) thread_.join();
  child_.Stop(options_.stop_grace);
  Finished finished;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, request] : in_flight_)
      Complete(request, Outcome::Ungraded("grader stopped"), finished);
    for (Request& request : pending_)
      Complete(request, Outcome::Ungraded("grader stopped"), finished);
    in_flight_.clear();
    pending_.clear();
  }
  for (auto& [done, outcome] : finished) done(std::move(outcome));
  for (int fd : wake_) {
    if (fd >= 0) ::close(fd);
  }
}

void ProcessGrader::Submit(Sample sample, OutcomeCallback done) {
  {
    std::lock_guard lock(mu_);
    ++counters_.submitted;
    pending_.push_back(Request{std::move(sample), std::move(done), 0, {}});
  }
  Wake();
}

void ProcessGrader::Wake() {
  const char byte = 1;
  (void)!::write(wake_[1], &byte, 1);
}

void ProcessGrader::Complete(Request& request, Outcome outcome, Finished& finished) {
  CountOutcome(counters_, outcome);
  finished.emplace_back(std::move(request.done), std::move(outcome));
}

// One more ungraded sample in a row; past the limit the grader fails.
void ProcessGrader::Failure(const std::string& reason, Finished& finished) {
  if (!streak_.Fail() || !status_.ok()) return;
  status_ = Status::Unavailable("grader '" + command_ + "' failed: more than " +
                                std::to_string(options_.max_grader_failures) +
                                " ungraded answers in a row (the last: " + reason +
                                "); its last stderr lines:\n" + StderrTail());
  FailAll(finished);
}

void ProcessGrader::FailAll(Finished& finished) {
  Outcome failed;
  failed.kind = OutcomeKind::kFailed;
  failed.reason = status_.message();
  for (auto& [id, request] : in_flight_) Complete(request, failed, finished);
  for (Request& request : pending_) Complete(request, failed, finished);
  in_flight_.clear();
  pending_.clear();
}

std::string ProcessGrader::StderrTail() const {
  std::string tail;
  for (const std::string& line : stderr_lines_) tail += line + "\n";
  if (!stderr_partial_.empty()) tail += stderr_partial_ + "\n";
  return tail.empty() ? "(none)" : tail;
}

void ProcessGrader::Dispatch(Finished& finished) {
  const Clock::time_point now = Clock::now();
  while (!pending_.empty() && in_flight_.size() < std::max<size_t>(options_.max_in_flight, 1)) {
    Request request = std::move(pending_.front());
    pending_.pop_front();
    if (in_flight_.count(request.sample.id)) {
      Complete(request, Outcome::Ungraded("id '" + request.sample.id + "' is already in flight"),
               finished);
      continue;
    }
    write_buffer_ += protocol::RequestText(request.sample);
    write_buffer_ += '\n';
    request.sent_at = now;
    ++request.sends;
    const std::string id = request.sample.id;
    in_flight_.emplace(id, std::move(request));
  }
}

void ProcessGrader::Expire(Clock::time_point now, Finished& finished) {
  bool silent = false;
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    if (now - it->second.sent_at < options_.timeout) {
      ++it;
      continue;
    }
    silent = silent || last_output_ <= it->second.sent_at;
    ++counters_.ungraded_timeout;
    const std::string reason =
        "no answer within " + std::to_string(options_.timeout.count()) + " ms";
    Complete(it->second, Outcome::Ungraded(reason), finished);
    it = in_flight_.erase(it);
    Failure(reason, finished);
  }
  // Nothing on stdout since the expired request was written: the process hangs. Kill it;
  // the requests it still holds are re-sent to its successor.
  if (silent && child_.running() && status_.ok()) {
    child_.Kill();
    OnExit(
        "hung (no output for " + std::to_string(options_.timeout.count()) + " ms) and was killed",
        finished);
  }
}

// The process ended: the requests it held are re-sent once, then ungraded.
void ProcessGrader::OnExit(const std::string& how, Finished& finished) {
  write_buffer_.clear();
  stdout_buffer_.clear();
  skipping_long_line_ = false;
  if (!stderr_partial_.empty()) OnStderr("\n");
  stderr_lines_.push_back("[flywheel] grader process " + how);
  while (stderr_lines_.size() > std::max<size_t>(options_.stderr_lines, 1))
    stderr_lines_.pop_front();
  std::vector<Request> resend;
  for (auto& [id, request] : in_flight_) {
    if (request.sends < 2) {
      ++counters_.resent;
      resend.push_back(std::move(request));
    } else {
      ++counters_.ungraded_crash;
      Complete(request, Outcome::Ungraded("the grader process " + how + " twice while holding it"),
               finished);
    }
  }
  in_flight_.clear();
  for (auto it = resend.rbegin(); it != resend.rend(); ++it) pending_.push_front(std::move(*it));
  ++crashes_in_a_row_;
  const int backoff_ms =
      crashes_in_a_row_ <= 1 ? 0 : std::min(2000, 50 << std::min(crashes_in_a_row_, 6));
  restart_at_ = Clock::now() + milliseconds(backoff_ms);
  Failure("the grader process " + how, finished);
}

// A restart that fails counts as a failure, as a crash does, and is tried again later.
void ProcessGrader::Restart(Clock::time_point now, Finished& finished) {
  if (child_.running() || now < restart_at_) return;
  ++counters_.restarts;
  Status started = child_.Start(argv_);
  if (!started.ok()) {
    stderr_lines_.push_back("[flywheel] restart failed: " + started.message());
    while (stderr_lines_.size() > std::max<size_t>(options_.stderr_lines, 1))
      stderr_lines_.pop_front();
    restart_at_ = now + milliseconds(500);
    Failure("the grader process could not be restarted: " + started.message(), finished);
    return;
  }
  last_output_ = now;
}

void ProcessGrader::OnLine(std::string_view line, Finished& finished) {
  last_output_ = Clock::now();
  protocol::Answer answer = protocol::ParseAnswer(line);
  if (answer.id.empty()) {
    ++counters_.garbage_lines;
    return;
  }
  auto found = in_flight_.find(answer.id);
  if (found == in_flight_.end()) {
    ++counters_.unknown_ids;
    return;
  }
  crashes_in_a_row_ = 0;
  if (answer.outcome.kind == OutcomeKind::kUngraded) {
    ++counters_.ungraded_bad_answer;
    const std::string reason = answer.outcome.reason;
    Complete(found->second, std::move(answer.outcome), finished);
    in_flight_.erase(found);
    Failure(reason, finished);
    return;
  }
  streak_.Succeed();
  Complete(found->second, std::move(answer.outcome), finished);
  in_flight_.erase(found);
}

void ProcessGrader::OnStderr(std::string_view bytes) {
  stderr_partial_.append(bytes);
  size_t newline;
  while ((newline = stderr_partial_.find('\n')) != std::string::npos) {
    stderr_lines_.push_back(stderr_partial_.substr(0, newline));
    stderr_partial_.erase(0, newline + 1);
    while (stderr_lines_.size() > std::max<size_t>(options_.stderr_lines, 1))
      stderr_lines_.pop_front();
  }
  if (stderr_partial_.size() > 4096) stderr_partial_.erase(0, stderr_partial_.size() - 4096);
}

// Reads what `fd` has now (non-blocking) into `into`; false at end of file or error.
bool ReadAvailable(int fd, std::string& into) {
  char buffer[65536];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n > 0) {
      into.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
}

void ProcessGrader::Loop() {
  // A write to a grader that exited must fail with EPIPE, not kill this process.
  sigset_t pipe_signal;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
  while (true) {
    Finished finished;
    bool stop = false;
    {
      std::lock_guard lock(mu_);
      stop = stopping_;
      if (!stop && !status_.ok()) {
        FailAll(finished);
        if (child_.running()) child_.Kill();
      } else if (!stop) {
        const Clock::time_point now = Clock::now();
        Restart(now, finished);
        if (child_.running()) Dispatch(finished);
        Expire(now, finished);
      }
    }
    for (auto& [done, outcome] : finished) done(std::move(outcome));
    if (stop) return;
    finished.clear();
    Pump(finished);
    for (auto& [done, outcome] : finished) done(std::move(outcome));
  }
}

int ProcessGrader::PollTimeoutMs() {
  std::lock_guard lock(mu_);
  const Clock::time_point now = Clock::now();
  Clock::time_point wake = now + milliseconds(1000);
  for (const auto& [id, request] : in_flight_)
    wake = std::min(wake, request.sent_at + options_.timeout);
  if (!child_.running() && status_.ok()) wake = std::min(wake, restart_at_);
  return static_cast<int>(std::clamp<int64_t>(
      std::chrono::duration_cast<milliseconds>(wake - now).count() + 1, 0, 1000));
}

// One poll of the wake-up pipe and the child's pipes, then the bytes moved both ways.
bool ProcessGrader::Pump(Finished& finished) {
  const int timeout_ms = PollTimeoutMs();
  bool want_write = false;
  {
    std::lock_guard lock(mu_);
    want_write = !write_buffer_.empty();
  }
  pollfd fds[4] = {{wake_[0], POLLIN, 0},
                   {child_.stdout_fd(), POLLIN, 0},
                   {child_.stderr_fd(), POLLIN, 0},
                   {want_write ? child_.stdin_fd() : -1, POLLOUT, 0}};
  if (::poll(fds, 4, timeout_ms) < 0 && errno != EINTR) return false;
  char drain[256];
  while (::read(wake_[0], drain, sizeof drain) > 0) {
  }
  std::string out, err;
  const bool stdout_open = child_.stdout_fd() < 0 || ReadAvailable(child_.stdout_fd(), out);
  if (child_.stderr_fd() >= 0 && !ReadAvailable(child_.stderr_fd(), err)) child_.CloseStderr();
  std::lock_guard lock(mu_);
  if (!err.empty()) OnStderr(err);
  if (!out.empty()) {
    stdout_buffer_ += out;
    size_t newline;
    while ((newline = stdout_buffer_.find('\n')) != std::string::npos) {
      if (!skipping_long_line_)
        OnLine(std::string_view(stdout_buffer_).substr(0, newline), finished);
      skipping_long_line_ = false;
      stdout_buffer_.erase(0, newline + 1);
    }
    if (stdout_buffer_.size() > kMaxLine) {
      ++counters_.garbage_lines;
      stdout_buffer_.clear();
      skipping_long_line_ = true;
    }
  }
  if (child_.stdin_fd() >= 0 && !write_buffer_.empty()) {
    const ssize_t n = ::write(child_.stdin_fd(), write_buffer_.data(), write_buffer_.size());
    if (n > 0) write_buffer_.erase(0, static_cast<size_t>(n));
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      write_buffer_.clear();  // EPIPE: the process is gone; its stdout's end tells how
      child_.CloseStdin();
    }
  }
  if (!stdout_open && child_.running()) {
    int wait_status = 0;
    for (int i = 0; i < 20 && !child_.TryReap(&wait_status); ++i) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    if (child_.running()) wait_status = child_.Kill();
    OnExit(DescribeExit(wait_status), finished);
  }
  return true;
}

}  // namespace

Result<std::unique_ptr<AsyncGrader>> StartProcessGrader(const std::string& command,
                                                        const ExternalGraderOptions& options) {
  auto argv = SplitCommand(command);
  if (!argv.ok()) return Status::InvalidArgument("grader command: " + argv.status().message());
  if (options.timeout.count() <= 0 || options.max_grader_failures < 0) {
    return Status::InvalidArgument("grader '" + command +
                                   "': timeout must be > 0 and max_grader_failures >= 0");
  }
  auto grader = std::make_unique<ProcessGrader>(command, std::move(argv).value(), options);
  FW_RETURN_IF_ERROR(grader->Start());
  return std::unique_ptr<AsyncGrader>(std::move(grader));
}

}  // namespace flywheel::grading
