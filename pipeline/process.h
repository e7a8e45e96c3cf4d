// Child processes of the tools that run a fleet on one machine (the fleet benchmark,
// `flywheel demo`, the pipeline benchmark): start, watch, signal and stop them, with their
// output in log files.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status.h"

namespace flywheel::pipeline {

// The last `limit` bytes of a text file, trimmed; "" when it cannot be read.
std::string FileTail(const std::string& path, size_t limit);
Result<std::string> ReadWholeFile(const std::string& path);

// Child processes, each with its stdout and stderr in
// <log_dir>/<name>.out and .err; a child also receives SIGTERM when the parent dies, so
// nothing outlives a killed run. The destructor stops and reaps whatever is still running.
class ProcessGroup {
 public:
  static constexpr std::chrono::milliseconds kPoll{10};
  static constexpr std::chrono::seconds kGrace{5};

  explicit ProcessGroup(std::string log_dir) : log_dir_(std::move(log_dir)) {}
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;
  ~ProcessGroup() { (void)StopAll(); }

  // Starts `program args...`; returns its index in this group.
  Result<size_t> Start(const std::string& name, const std::string& program,
                       const std::vector<std::string>& args);

  const std::string& stdout_path(size_t index) const { return children_[index].stdout_path; }

  // OK while the child runs; else an error naming it, how it ended and its stderr's tail.
  Status CheckRunning(size_t index);

  // CheckRunning for every child.
  Status CheckAllRunning();

  // Waits up to `timeout` for the child to exit by itself; returns its wait status, or
  // an error (naming it) on timeout.
  Result<int> Wait(size_t index, std::chrono::milliseconds timeout);

  // SIGTERM to every running child, up to kGrace for all of them to exit, then
  // SIGKILL; reaps all. Returns one line per child that did not stop cleanly.
  std::vector<std::string> StopAll();

  // Sends `signal` to the child if it still runs (a test's or a demo's fault injection).
  void Signal(size_t index, int signal);
  // Whether the child still runs (reaps it when it ended).
  bool running(size_t index) { return CheckRunning(index).ok(); }
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

  static std::string HowEnded(const Child& child);

  static std::string Tail(const Child& child);

  std::string log_dir_;
  std::vector<Child> children_;
};

// Waits up to `timeout` for `path` (a role's --ready-file) to appear while every child of
// `processes` (or only child `index`) still runs; returns its JSON ({"listen", "http"}).
Result<nlohmann::json> AwaitReadyFile(ProcessGroup& processes, const std::string& path,
                                      const std::string& name, std::chrono::milliseconds timeout,
                                      size_t index = SIZE_MAX);

}  // namespace flywheel::pipeline
