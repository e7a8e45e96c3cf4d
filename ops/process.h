// The process harness: how flywheel's tools and tests run other programs. `flywheel demo`,
// the fleet and codec benchmarks and every multi-process test start their children here
// and nowhere else.
//
//   * FreePort: a loopback port for a role whose address must be known before it starts.
//   * RunToCompletion: a one-shot command (a CLI invocation, a peer tool like zstd) with
//     its exit code and output, killed after a timeout.
//   * ProcessGroup: long-running roles (publisher, relay, worker, trainer) with their
//     output in log files; start, watch, signal, stop one, stop all. The destructor stops
//     and reaps everything still running, so a test that leaves early (a failed ASSERT
//     returns from the test body) leaves no process behind.
//   * AwaitReadyFile, WaitUntil: waiting on a role's --ready-file or on any condition, with
//     a deadline and an error that names what was awaited.
//
// Every child gets stdin from /dev/null and receives SIGTERM when the thread that started
// it exits (PR_SET_PDEATHSIG), so nothing outlives a killed parent. Start children from a
// thread that lives as long as they should (a test's main thread, a tool's main()).
//
// Thread safety: a ProcessGroup is used by one thread at a time; the free functions are
// thread-safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::ops {

// How often the waits below look again.
inline constexpr std::chrono::milliseconds kPollInterval{10};

// The last `limit` bytes of a text file, trimmed; "" when it cannot be read.
std::string FileTail(const std::string& path, size_t limit);
Result<std::string> ReadWholeFile(const std::string& path);

// This executable's absolute path (/proc/self/exe resolved): how flywheel finds itself, and
// flywheel-torch beside it, to run as a child. IOError naming /proc/self/exe when it cannot
// be resolved.
Result<std::string> ExecutablePath();

// A TCP port on 127.0.0.1 that was free when this returned (bound to port 0, read back,
// closed). Nothing reserves it: until the caller's child binds it, another process, or
// the kernel handing the same ephemeral port to someone else's connect(), can take it, and
// the child then fails to start with "address in use". So:
//   * where a role supports it, pass "127.0.0.1:0" and read the bound port from its
//     --ready-file instead (every flywheel role writes {"listen", "http"} there);
//   * use FreePort only where the address must be fixed up front: a process that is
//     restarted later at the same address, or peers started before the one they reach;
//   * a caller that must not fail on the race starts the child again with a new port when
//     it exits before its ready file appears.
Result<uint16_t> FreePort();

// Polls `condition` every `poll` until it returns true or `timeout` has passed (it is asked
// once more at the deadline). OK once it held; Unavailable "timed out after <n> ms waiting
// for <what>" otherwise. This is the only way tests wait for something to happen: never a
// bare sleep.
Status WaitUntil(const std::function<bool()>& condition, std::chrono::milliseconds timeout,
                 const std::string& what, std::chrono::milliseconds poll = kPollInterval);

// A one-shot command's ending and output.
struct Completion {
  int exit_code = -1;  // 128 + the signal's number when a signal ended it
  std::string out;     // its stdout, unless RunOptions::stdout_path sent it to a file
  std::string err;     // its stderr
  std::chrono::duration<double> elapsed{0};  // from start to exit
};

struct RunOptions {
  // The child is killed (SIGKILL) and reaped when it runs longer.
  std::chrono::milliseconds timeout{60000};
  // When set, stdout goes to this file (created or truncated) instead of Completion::out:
  // for tools whose output is data (a compressor writing to stdout).
  std::string stdout_path;
  // "NAME=value" entries added to this process's environment (an entry replaces a variable
  // of the same name).
  std::vector<std::string> env;
};

// Runs `program args...` (a path, not looked up in PATH) until it exits. Returns its
// Completion whatever its exit code; errors: IOError when it cannot be started,
// Unavailable "<command> did not finish within <n> ms" (with the tails of its stdout and
// stderr) when it timed out.
Result<Completion> RunToCompletion(const std::string& program,
                                   const std::vector<std::string>& args,
                                   const RunOptions& options = {});

// How a child ended, from a waitpid status: "exited with status 3", "was killed by signal
// 9 (Killed)".
std::string DescribeWaitStatus(int wait_status);

struct StartOptions {
  // "NAME=value" entries added to this process's environment (see RunOptions::env).
  std::vector<std::string> env;
  // Non-empty: the child runs on these CPUs only (sched_setaffinity before exec; its
  // threads and children inherit it), as processes on separate hardware would.
  std::vector<int> cpus;
};

// Long-running children, each with its stdout and stderr in <log_dir>/<name>.out and .err
// (a name started again in the same group logs to <name>.restart<n>.out and .err, so a
// restart keeps the earlier logs). A child is known by the index Start returns, valid for
// the group's lifetime; a child that has ended keeps its index, logs and wait status.
class ProcessGroup {
 public:
  // How long Stop and StopAll wait after SIGTERM before SIGKILL.
  static constexpr std::chrono::milliseconds kDefaultGrace{5000};
  static constexpr std::chrono::milliseconds kPoll = kPollInterval;

  // REQUIRES: `log_dir` exists.
  explicit ProcessGroup(std::string log_dir) : log_dir_(std::move(log_dir)) {}
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;
  // StopAll.
  ~ProcessGroup() { (void)StopAll(); }

  void set_grace(std::chrono::milliseconds grace) { grace_ = grace; }

  // Starts `program args...` (a path); returns its index in this group.
  Result<size_t> Start(const std::string& name, const std::string& program,
                       const std::vector<std::string>& args, const StartOptions& options = {});

  const std::string& name(size_t index) const { return children_[index].name; }
  const std::string& stdout_path(size_t index) const { return children_[index].stdout_path; }
  const std::string& stderr_path(size_t index) const { return children_[index].stderr_path; }
  // Its process id (also after it ended: then only for messages).
  pid_t pid(size_t index) const { return children_[index].pid; }
  // Its stdout followed by its stderr, as written so far: for tests that look for a line.
  std::string Output(size_t index) const;

  // OK while the child runs; else Unavailable naming it, how it ended and its stderr's tail.
  Status CheckRunning(size_t index);
  // CheckRunning for every child.
  Status CheckAllRunning();
  // Whether the child still runs (reaps it when it ended).
  bool running(size_t index) { return CheckRunning(index).ok(); }

  // Waits up to `timeout` for the child to exit by itself; returns its waitpid status, or
  // Unavailable (naming it) on timeout, the child left running.
  Result<int> Wait(size_t index, std::chrono::milliseconds timeout);
  // The child's exit code once it has exited (128 + signal when a signal ended it), or
  // Unavailable on timeout: Wait for one-shot commands.
  Result<int> WaitExitCode(size_t index, std::chrono::milliseconds timeout);

  // Sends `signal` to the child (a test's or a demo's fault injection, SIGSTOP/SIGCONT
  // included). Unavailable when it no longer runs.
  Status Signal(size_t index, int signal);
  // SIGKILL, then reaps it: running() is false on return.
  void Kill(size_t index);
  // SIGTERM (and SIGCONT, should it be stopped), up to the grace for it to exit, then
  // SIGKILL; reaps it. Returns its waitpid status.
  int Stop(size_t index);
  // Stop for every running child at once (one grace for all of them). Returns one line per
  // child that did not stop cleanly (exit 0 or SIGTERM).
  std::vector<std::string> StopAll();

  size_t size() const { return children_.size(); }

 private:
  struct Child {
    std::string name;
    std::string command;
    std::string stdout_path;
    std::string stderr_path;
    pid_t pid = -1;
    bool exited = false;
    int wait_status = 0;
  };

  // Reaps the child if it has exited; true once it has.
  static bool Reap(Child& child);
  static std::string Tail(const Child& child);

  std::string log_dir_;
  std::chrono::milliseconds grace_ = kDefaultGrace;
  std::vector<Child> children_;
};

// Waits up to `timeout` for `path` (a role's --ready-file, written atomically) to appear
// while every child of `processes` (or only child `index`) still runs; returns its JSON
// object ({"listen", "http"}). Errors name `name` and say whether it died (with its
// stderr's tail) or timed out.
Result<nlohmann::json> AwaitReadyFile(ProcessGroup& processes, const std::string& path,
                                      const std::string& name, std::chrono::milliseconds timeout,
                                      size_t index = SIZE_MAX);

}  // namespace flywheel::ops
