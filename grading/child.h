// A child process with its stdin, stdout and stderr on pipes: the process grader's
// plumbing. Private to grading/.
//
// Started with posix_spawnp in a process group of its own (so that a stop reaches what it
// starts), with an empty signal mask and SIGPIPE at its default; the parent's ends of the
// pipes are non-blocking and close-on-exec. Nothing kills it when this process dies: it sees
// end-of-file on stdin and is expected to exit then (a line loop does).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::grading {

// Splits a command line into words as a shell splits quotes ('...', "...") and backslashes;
// no expansions. InvalidArgument for an unterminated quote or an empty command.
Result<std::vector<std::string>> SplitCommand(const std::string& command);

class Child {
 public:
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  // Kill() when still running.
  ~Child();

  // Starts `argv` (argv[0] looked up in PATH). IOError or NotFound naming argv[0] when it
  // cannot be executed. REQUIRES: !running().
  Status Start(const std::vector<std::string>& argv);

  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  int stdin_fd() const { return stdin_fd_; }    // -1 once closed
  int stdout_fd() const { return stdout_fd_; }  // -1 once closed
  int stderr_fd() const { return stderr_fd_; }  // -1 once closed

  void CloseStdin();
  void CloseStdout();
  void CloseStderr();

  // Reaps the child if it has exited; true (and the wait status) once it has.
  bool TryReap(int* wait_status);
  // Closes stdin, waits up to `grace` for an exit, then SIGTERM to its group and up to
  // `grace` again, then SIGKILL; reaps it. Returns the wait status.
  int Stop(std::chrono::milliseconds grace);
  // SIGKILL to its group and reap. Returns the wait status.
  int Kill();

 private:
  void CloseAll();
  bool WaitFor(std::chrono::milliseconds limit, int* wait_status);

  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
};

}  // namespace flywheel::grading
