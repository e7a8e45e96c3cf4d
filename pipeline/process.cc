#include "pipeline/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace flywheel::pipeline {

std::string FileTail(const std::string& path, size_t limit) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  const std::streamoff start = size > static_cast<std::streamoff>(limit) ? size - limit : 0;
  in.seekg(start);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  return start > 0 ? "..." + text : text;
}

Result<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError("cannot open " + path + ": " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::IOError("cannot read " + path);
  return text.str();
}

Result<size_t> ProcessGroup::Start(const std::string& name, const std::string& program,
                     const std::vector<std::string>& args) {
  Child child;
  child.name = name;
  child.command = program;
  for (const std::string& arg : args) child.command += " " + arg;
  child.stdout_path = log_dir_ + "/" + name + ".out";
  child.stderr_path = log_dir_ + "/" + name + ".err";
  // Everything the child needs is prepared here: between fork and exec it may only make
  // async-signal-safe calls.
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(program.c_str()));
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Status::IOError("cannot start " + name + ": fork: " + std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl
    const int in = ::open("/dev/null", O_RDONLY);
    const int out = ::open(child.stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open(child.stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (in < 0 || out < 0 || err < 0) ::_exit(126);
    ::dup2(in, 0);
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::execv(program.c_str(), argv.data());
    constexpr char kMessage[] = "exec failed\n";
    (void)!::write(2, kMessage, sizeof(kMessage) - 1);
    ::_exit(127);
  }
  child.pid = pid;
  children_.push_back(std::move(child));
  return children_.size() - 1;
}

Status ProcessGroup::CheckRunning(size_t index) {
  Child& child = children_[index];
  if (!child.exited) {
    int wait_status = 0;
    const pid_t got = ::waitpid(child.pid, &wait_status, WNOHANG);
    if (got == 0) return Status::Ok();
    child.exited = true;
    child.wait_status = got == child.pid ? wait_status : -1;
  }
  return Status::Unavailable(child.name + " (" + child.command + ") " + HowEnded(child) +
                             "; stderr: " + Tail(child));
}

Status ProcessGroup::CheckAllRunning() {
  for (size_t i = 0; i < children_.size(); ++i) FW_RETURN_IF_ERROR(CheckRunning(i));
  return Status::Ok();
}

Result<int> ProcessGroup::Wait(size_t index, std::chrono::milliseconds timeout) {
  Child& child = children_[index];
  const std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::now() + timeout;
  while (!child.exited) {
    int wait_status = 0;
    const pid_t got = ::waitpid(child.pid, &wait_status, WNOHANG);
    if (got != 0) {
      child.exited = true;
      child.wait_status = got == child.pid ? wait_status : -1;
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Status::Unavailable(child.name + " (" + child.command + ") did not finish within " +
                                 std::to_string(timeout.count() / 1000) + " s");
    }
    std::this_thread::sleep_for(kPoll);
  }
  return child.wait_status;
}

std::vector<std::string> ProcessGroup::StopAll() {
  for (const Child& child : children_) {
    if (!child.exited) ::kill(child.pid, SIGTERM);
  }
  const std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::now() + kGrace;
  std::vector<std::string> unclean;
  for (Child& child : children_) {
    if (child.exited) continue;
    int wait_status = 0;
    pid_t got = 0;
    while ((got = ::waitpid(child.pid, &wait_status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(kPoll);
    }
    if (got == 0) {
      ::kill(child.pid, SIGKILL);
      while ((got = ::waitpid(child.pid, &wait_status, 0)) < 0 && errno == EINTR) {
      }
      unclean.push_back(child.name + " did not stop within " +
                        std::to_string(kGrace.count()) + " s of SIGTERM and was killed");
    } else if (!(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0) &&
               !(WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGTERM)) {
      child.wait_status = wait_status;
      unclean.push_back(child.name + " " + HowEnded(child) +
                        " after SIGTERM; stderr: " + Tail(child));
    }
    child.exited = true;
    child.wait_status = wait_status;
  }
  children_.clear();
  return unclean;
}

std::string ProcessGroup::HowEnded(const Child& child) {
  if (child.wait_status < 0) return "is gone (not our child any more)";
  if (WIFEXITED(child.wait_status)) {
    return "exited with status " + std::to_string(WEXITSTATUS(child.wait_status));
  }
  if (WIFSIGNALED(child.wait_status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(child.wait_status)) + " (" +
           strsignal(WTERMSIG(child.wait_status)) + ")";
  }
  return "ended";
}

std::string ProcessGroup::Tail(const Child& child) {
  const std::string tail = FileTail(child.stderr_path, 600);
  return tail.empty() ? "(empty, " + child.stderr_path + ")" : tail;
}

void ProcessGroup::Signal(size_t index, int signal) {
  if (index < children_.size() && running(index)) ::kill(children_[index].pid, signal);
}

Result<nlohmann::json> AwaitReadyFile(ProcessGroup& processes, const std::string& path,
                                      const std::string& name, std::chrono::milliseconds timeout,
                                      size_t index) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!std::filesystem::exists(path)) {
    FW_RETURN_IF_ERROR(index == SIZE_MAX ? processes.CheckAllRunning() : processes.CheckRunning(index));
    if (std::chrono::steady_clock::now() > deadline) {
      return Status::Unavailable(name + " did not write its ready file " + path + " within " +
                                 std::to_string(timeout.count() / 1000) + " s");
    }
    std::this_thread::sleep_for(ProcessGroup::kPoll);
  }
  FW_ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(path));
  nlohmann::json ready = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!ready.is_object()) {
    return Status::Corruption(name + "'s ready file " + path + " is not a JSON object: " + text);
  }
  return ready;
}

}  // namespace flywheel::pipeline
