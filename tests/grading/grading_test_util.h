// Test helpers for grading_test: a temporary directory, grader scripts written into it, and
// the check that every process a grader started has ended.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "grading/grader.h"

namespace flywheel::grading::testing {

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "grading_test.XXXXXX").string();
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

inline std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

inline std::string Python() {
  return std::filesystem::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
}

// Writes a grader script into `dir`. Every script starts by appending its process id to
// <dir>/pids (see AllEnded); `body` follows, with PIDS and DIR defined.
inline std::string WriteGrader(const TempDir& dir, const std::string& name,
                               const std::string& body) {
  const std::string path = dir.File(name);
  WriteText(path, "import json, os, sys, time\nDIR = " + std::string("'") + dir.path() +
                      "'\nwith open(os.path.join(DIR, 'pids'), 'a') as f:\n"
                      "    f.write(str(os.getpid()) + '\\n')\n" +
                      body);
  return Python() + " " + path;
}

// The process ids the scripts of `dir` recorded.
inline std::vector<pid_t> RecordedPids(const TempDir& dir) {
  std::vector<pid_t> pids;
  std::istringstream lines(ReadText(dir.File("pids")));
  for (long pid; lines >> pid;) pids.push_back(static_cast<pid_t>(pid));
  return pids;
}

// True when no process that a script of `dir` recorded still exists (they were reaped).
inline bool AllEnded(const TempDir& dir) {
  for (pid_t pid : RecordedPids(dir)) {
    if (::kill(pid, 0) == 0 || errno != ESRCH) return false;
  }
  return true;
}

inline Sample MakeSample(std::string id, std::string completion,
                         nlohmann::json fields = nlohmann::json::object()) {
  Sample sample;
  sample.id = std::move(id);
  sample.messages = nlohmann::json::array({{{"role", "user"}, {"content", "question"}}});
  sample.completion = std::move(completion);
  sample.fields = std::move(fields);
  return sample;
}

// Waits for a future with a bound; a test that would hang fails instead.
inline Outcome Await(std::future<Outcome>& future,
                     std::chrono::milliseconds limit = std::chrono::seconds(15)) {
  if (future.wait_for(limit) != std::future_status::ready) {
    ADD_FAILURE() << "no outcome within " << limit.count() << " ms";
    return Outcome::Ungraded("test: no outcome");
  }
  return future.get();
}

}  // namespace flywheel::grading::testing
