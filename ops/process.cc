#include "ops/process.h"

#include <sched.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

extern char** environ;

namespace flywheel::ops {
namespace {

using Clock = std::chrono::steady_clock;

std::string CommandLine(const std::string& program, const std::vector<std::string>& args) {
  std::string command = program;
  for (const std::string& arg : args) command += " " + arg;
  return command;
}

// This process's environment with `overrides` ("NAME=value") replacing or added.
std::vector<std::string> Environment(const std::vector<std::string>& overrides) {
  std::vector<std::string> entries;
  auto name_of = [](const std::string& entry) { return entry.substr(0, entry.find('=')); };
  std::map<std::string, size_t> position;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    entries.emplace_back(*entry);
    position.emplace(name_of(entries.back()), entries.size() - 1);
  }
  for (const std::string& entry : overrides) {
    auto it = position.find(name_of(entry));
    if (it != position.end()) {
      entries[it->second] = entry;
    } else {
      entries.push_back(entry);
      position.emplace(name_of(entry), entries.size() - 1);
    }
  }
  return entries;
}

// The one place that forks. stdin is /dev/null; stdout and stderr go to the given
// descriptors (or /dev/null when -1). The child gets SIGTERM when the starting thread exits.
Result<pid_t> Spawn(const std::string& program, const std::vector<std::string>& args,
                    const std::vector<std::string>& env, int stdout_fd, int stderr_fd,
                    const std::vector<int>& cpus = {}) {
  // Everything the child needs is prepared here: between fork and exec it may only make
  // async-signal-safe calls.
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(program.c_str()));
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  const std::vector<std::string> environment = Environment(env);
  std::vector<char*> envp;
  for (const std::string& entry : environment) envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);
  cpu_set_t affinity;
  CPU_ZERO(&affinity);
  for (int cpu : cpus) {
    if (cpu < 0 || cpu >= CPU_SETSIZE) {
      return Status::InvalidArgument("cannot start " + program + " on CPU " + std::to_string(cpu));
    }
    CPU_SET(cpu, &affinity);
  }
  const int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null_fd < 0) return Status::IOError(std::string("cannot open /dev/null: ") + std::strerror(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int error = errno;
    ::close(null_fd);
    return Status::IOError("cannot start " + program + ": fork: " + std::strerror(error));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl
    ::dup2(null_fd, 0);
    ::dup2(stdout_fd >= 0 ? stdout_fd : null_fd, 1);
    ::dup2(stderr_fd >= 0 ? stderr_fd : null_fd, 2);
    if (!cpus.empty() && ::sched_setaffinity(0, sizeof affinity, &affinity) != 0) {
      constexpr char kAffinity[] = "cannot set the CPU affinity\n";
      (void)!::write(2, kAffinity, sizeof(kAffinity) - 1);
      ::_exit(127);
    }
    ::execve(program.c_str(), argv.data(), envp.data());
    constexpr char kMessage[] = "exec failed\n";
    (void)!::write(2, kMessage, sizeof(kMessage) - 1);
    ::_exit(127);
  }
  ::close(null_fd);
  return pid;
}

int ExitCode(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

int WaitBlocking(pid_t pid) {
  int wait_status = 0;
  while (::waitpid(pid, &wait_status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return wait_status;
}

std::string Trimmed(std::string text, size_t limit) {
  if (text.size() > limit) text = "..." + text.substr(text.size() - limit);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  return text;
}

}  // namespace

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

Result<std::string> ExecutablePath() {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) return Status::IOError("cannot resolve /proc/self/exe: " + error.message());
  return self.string();
}

Result<uint16_t> FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::IOError(std::string("socket: ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof address;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const int error = errno;
    ::close(fd);
    return Status::IOError(std::string("cannot bind a loopback port: ") + std::strerror(error));
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

Status WaitUntil(const std::function<bool()>& condition, std::chrono::milliseconds timeout,
                 const std::string& what, std::chrono::milliseconds poll) {
  const Clock::time_point deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (condition()) return Status::Ok();
    std::this_thread::sleep_for(poll);
  }
  if (condition()) return Status::Ok();
  return Status::Unavailable("timed out after " + std::to_string(timeout.count()) +
                             " ms waiting for " + what);
}

std::string DescribeWaitStatus(int wait_status) {
  if (wait_status < 0) return "is gone (not our child any more)";
  if (WIFEXITED(wait_status)) return "exited with status " + std::to_string(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(wait_status)) + " (" +
           strsignal(WTERMSIG(wait_status)) + ")";
  }
  return "ended";
}

namespace {

// Reads the child's stdout (fd `out`, -1: none) and stderr (`err`) into `completion` until
// both reach end of file or `deadline` passes; closes both. Returns whether it timed out.
bool DrainPipes(int out, int err, Clock::time_point deadline, Completion& completion) {
  pollfd fds[2] = {{out, POLLIN, 0}, {err, POLLIN, 0}};
  std::string* sinks[2] = {&completion.out, &completion.err};
  bool timed_out = false;
  while (fds[0].fd >= 0 || fds[1].fd >= 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    const int ready = ::poll(fds, 2, static_cast<int>(left.count()));
    if (ready <= 0) continue;  // EINTR or the deadline: checked above
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buffer[65536];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
      }
    }
  }
  for (const pollfd& fd : fds) {
    if (fd.fd >= 0) ::close(fd.fd);
  }
  return timed_out;
}

// Waits for `pid` to exit until `deadline`; past it the child is killed (SIGKILL), reaped
// and the run is Unavailable. Returns the wait status.
Result<int> ReapBefore(pid_t pid, Clock::time_point deadline, const std::string& command,
                       std::chrono::milliseconds timeout) {
  int wait_status = 0;
  while (true) {
    const pid_t got = ::waitpid(pid, &wait_status, WNOHANG);
    if (got == pid) return wait_status;
    if (got < 0 && errno != EINTR) {
      return Status::IOError("waiting for " + command + ": " + std::strerror(errno));
    }
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      (void)WaitBlocking(pid);
      return Status::Unavailable(command + " did not finish within " +
                                 std::to_string(timeout.count()) + " ms (killed)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace

Result<Completion> RunToCompletion(const std::string& program,
                                   const std::vector<std::string>& args,
                                   const RunOptions& options) {
  const std::string command = CommandLine(program, args);
  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  int stdout_file = -1;
  auto close_all = [&] {
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1], stdout_file}) {
      if (fd >= 0) ::close(fd);
    }
  };
  if (::pipe2(err_pipe, O_CLOEXEC) != 0 ||
      (options.stdout_path.empty() && ::pipe2(out_pipe, O_CLOEXEC) != 0)) {
    const int error = errno;
    close_all();
    return Status::IOError("cannot run " + command + ": pipe: " + std::strerror(error));
  }
  if (!options.stdout_path.empty()) {
    stdout_file = ::open(options.stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (stdout_file < 0) {
      const int error = errno;
      close_all();
      return Status::IOError("cannot run " + command + ": cannot create " + options.stdout_path +
                             ": " + std::strerror(error));
    }
  }
  const Clock::time_point start = Clock::now();
  Result<pid_t> pid = Spawn(program, args, options.env,
                            stdout_file >= 0 ? stdout_file : out_pipe[1], err_pipe[1]);
  // The parent keeps only the read ends: end of file comes when the child exits.
  for (int* fd : {&out_pipe[1], &err_pipe[1], &stdout_file}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
  if (!pid.ok()) {
    close_all();
    return pid.status();
  }

  Completion completion;
  const Clock::time_point deadline = start + options.timeout;
  const bool timed_out = DrainPipes(out_pipe[0], err_pipe[0], deadline, completion);
  out_pipe[0] = err_pipe[0] = -1;  // DrainPipes closed them
  close_all();
  if (timed_out) {
    ::kill(*pid, SIGKILL);
    (void)WaitBlocking(*pid);
    return Status::Unavailable(command + " did not finish within " +
                               std::to_string(options.timeout.count()) + " ms (killed); stdout: " +
                               Trimmed(completion.out, 400) + "; stderr: " +
                               Trimmed(completion.err, 400));
  }
  // Both pipes are closed: the child has exited, or closed them and goes on; the deadline
  // still holds for the latter.
  FW_ASSIGN_OR_RETURN(const int wait_status, ReapBefore(*pid, deadline, command, options.timeout));
  completion.elapsed = Clock::now() - start;
  completion.exit_code = ExitCode(wait_status);
  return completion;
}

Result<size_t> ProcessGroup::Start(const std::string& name, const std::string& program,
                                   const std::vector<std::string>& args,
                                   const StartOptions& options) {
  int earlier = 0;
  for (const Child& child : children_) earlier += child.name == name;
  const std::string log_name = earlier == 0 ? name : name + ".restart" + std::to_string(earlier);
  Child child;
  child.name = name;
  child.command = CommandLine(program, args);
  child.stdout_path = log_dir_ + "/" + log_name + ".out";
  child.stderr_path = log_dir_ + "/" + log_name + ".err";
  const int out = ::open(child.stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = ::open(child.stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0 || err < 0) {
    const int error = errno;
    if (out >= 0) ::close(out);
    if (err >= 0) ::close(err);
    return Status::IOError("cannot start " + name + ": cannot create its logs in " + log_dir_ +
                           ": " + std::strerror(error));
  }
  Result<pid_t> pid = Spawn(program, args, options.env, out, err, options.cpus);
  ::close(out);
  ::close(err);
  if (!pid.ok()) return pid.status().WithContext("starting " + name);
  child.pid = *pid;
  children_.push_back(std::move(child));
  return children_.size() - 1;
}

std::string ProcessGroup::Output(size_t index) const {
  const Child& child = children_[index];
  std::string text;
  for (const std::string& path : {child.stdout_path, child.stderr_path}) {
    Result<std::string> part = ReadWholeFile(path);
    if (part.ok()) text += *part;
  }
  return text;
}

bool ProcessGroup::Reap(Child& child) {
  if (child.exited) return true;
  int wait_status = 0;
  pid_t got = 0;
  while ((got = ::waitpid(child.pid, &wait_status, WNOHANG)) < 0 && errno == EINTR) {
  }
  if (got == 0) return false;
  child.exited = true;
  child.wait_status = got == child.pid ? wait_status : -1;
  return true;
}

Status ProcessGroup::CheckRunning(size_t index) {
  Child& child = children_[index];
  if (!Reap(child)) return Status::Ok();
  return Status::Unavailable(child.name + " (" + child.command + ") " +
                             DescribeWaitStatus(child.wait_status) + "; stderr: " + Tail(child));
}

Status ProcessGroup::CheckAllRunning() {
  for (size_t i = 0; i < children_.size(); ++i) FW_RETURN_IF_ERROR(CheckRunning(i));
  return Status::Ok();
}

Result<int> ProcessGroup::Wait(size_t index, std::chrono::milliseconds timeout) {
  Child& child = children_[index];
  const Status ended = WaitUntil([&] { return Reap(child); }, timeout,
                                 child.name + " (" + child.command + ") to finish", kPoll);
  if (!ended.ok()) return ended;
  return child.wait_status;
}

Result<int> ProcessGroup::WaitExitCode(size_t index, std::chrono::milliseconds timeout) {
  FW_ASSIGN_OR_RETURN(const int wait_status, Wait(index, timeout));
  return ExitCode(wait_status);
}

Status ProcessGroup::Signal(size_t index, int signal) {
  FW_RETURN_IF_ERROR(CheckRunning(index));
  if (::kill(children_[index].pid, signal) != 0) {
    return Status::IOError("kill(" + children_[index].name + ", " + std::to_string(signal) +
                           "): " + std::strerror(errno));
  }
  return Status::Ok();
}

void ProcessGroup::Kill(size_t index) {
  Child& child = children_[index];
  if (Reap(child)) return;
  ::kill(child.pid, SIGKILL);
  child.wait_status = WaitBlocking(child.pid);
  child.exited = true;
}

int ProcessGroup::Stop(size_t index) {
  Child& child = children_[index];
  if (!Reap(child)) {
    ::kill(child.pid, SIGTERM);
    ::kill(child.pid, SIGCONT);
    if (!WaitUntil([&] { return Reap(child); }, grace_, child.name + " to stop", kPoll).ok()) {
      Kill(index);
    }
  }
  return child.wait_status;
}

std::vector<std::string> ProcessGroup::StopAll() {
  std::vector<bool> was_running(children_.size(), false);
  for (size_t i = 0; i < children_.size(); ++i) {
    Child& child = children_[i];
    if (Reap(child)) continue;
    was_running[i] = true;
    ::kill(child.pid, SIGTERM);
    ::kill(child.pid, SIGCONT);
  }
  (void)WaitUntil(
      [&] {
        bool all = true;
        for (size_t i = 0; i < children_.size(); ++i) all = Reap(children_[i]) && all;
        return all;
      },
      grace_, "every child to stop", kPoll);
  std::vector<std::string> unclean;
  for (size_t i = 0; i < children_.size(); ++i) {
    if (!was_running[i]) continue;
    Child& child = children_[i];
    if (!child.exited) {
      Kill(i);
      unclean.push_back(child.name + " did not stop within " + std::to_string(grace_.count()) +
                        " ms of SIGTERM and was killed");
    } else if (!(WIFEXITED(child.wait_status) && WEXITSTATUS(child.wait_status) == 0) &&
               !(WIFSIGNALED(child.wait_status) && WTERMSIG(child.wait_status) == SIGTERM)) {
      unclean.push_back(child.name + " " + DescribeWaitStatus(child.wait_status) +
                        " after SIGTERM; stderr: " + Tail(child));
    }
  }
  return unclean;
}

std::string ProcessGroup::Tail(const Child& child) {
  const std::string tail = FileTail(child.stderr_path, 600);
  return tail.empty() ? "(empty, " + child.stderr_path + ")" : tail;
}

Result<nlohmann::json> AwaitReadyFile(ProcessGroup& processes, const std::string& path,
                                      const std::string& name, std::chrono::milliseconds timeout,
                                      size_t index) {
  Status died = Status::Ok();
  const Status appeared = WaitUntil(
      [&] {
        if (std::filesystem::exists(path)) return true;
        died = index == SIZE_MAX ? processes.CheckAllRunning() : processes.CheckRunning(index);
        return !died.ok();
      },
      timeout, name + " to write its ready file " + path);
  FW_RETURN_IF_ERROR(died);
  FW_RETURN_IF_ERROR(appeared);
  FW_ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(path));
  nlohmann::json ready = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!ready.is_object()) {
    return Status::Corruption(name + "'s ready file " + path + " is not a JSON object: " + text);
  }
  return ready;
}

}  // namespace flywheel::ops
