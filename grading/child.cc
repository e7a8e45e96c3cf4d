#include "grading/child.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

extern char** environ;

namespace flywheel::grading {

Result<std::vector<std::string>> SplitCommand(const std::string& command) {
  std::vector<std::string> words;
  std::string word;
  bool in_word = false;
  char quote = 0;
  for (size_t i = 0; i < command.size(); ++i) {
    const char c = command[i];
    if (quote != 0) {
      if (c == quote) {
        quote = 0;
      } else if (c == '\\' && quote == '"' && i + 1 < command.size() &&
                 (command[i + 1] == '"' || command[i + 1] == '\\')) {
        word.push_back(command[++i]);
      } else {
        word.push_back(c);
      }
    } else if (c == '\'' || c == '"') {
      quote = c;
      in_word = true;
    } else if (c == '\\' && i + 1 < command.size()) {
      word.push_back(command[++i]);
      in_word = true;
    } else if (std::isspace(static_cast<unsigned char>(c))) {
      if (in_word) words.push_back(std::move(word));
      word.clear();
      in_word = false;
    } else {
      word.push_back(c);
      in_word = true;
    }
  }
  if (quote != 0)
    return Status::InvalidArgument("command '" + command + "' has an unterminated quote");
  if (in_word) words.push_back(std::move(word));
  if (words.empty()) return Status::InvalidArgument("the command is empty");
  return words;
}

Child::~Child() {
  if (running()) Kill();
  CloseAll();
}

namespace {

void CloseFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

void Child::CloseStdin() {
  CloseFd(stdin_fd_);
}
void Child::CloseStdout() {
  CloseFd(stdout_fd_);
}
void Child::CloseStderr() {
  CloseFd(stderr_fd_);
}

void Child::CloseAll() {
  CloseStdin();
  CloseStdout();
  CloseStderr();
}

Status Child::Start(const std::vector<std::string>& argv) {
  int in[2], out[2], err[2];
  if (::pipe2(in, O_CLOEXEC) != 0)
    return Status::IOError(std::string("pipe: ") + std::strerror(errno));
  if (::pipe2(out, O_CLOEXEC) != 0) {
    const int error = errno;
    ::close(in[0]), ::close(in[1]);
    return Status::IOError(std::string("pipe: ") + std::strerror(error));
  }
  if (::pipe2(err, O_CLOEXEC) != 0) {
    const int error = errno;
    ::close(in[0]), ::close(in[1]), ::close(out[0]), ::close(out[1]);
    return Status::IOError(std::string("pipe: ") + std::strerror(error));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err[1], 2);
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setsigdefault(&attributes, &defaults);
  posix_spawnattr_setpgroup(&attributes, 0);
  posix_spawnattr_setflags(&attributes,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int error = ::posix_spawnp(&pid, args[0], &actions, &attributes, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  ::close(in[0]), ::close(out[1]), ::close(err[1]);
  if (error != 0) {
    ::close(in[1]), ::close(out[0]), ::close(err[0]);
    const std::string why =
        std::string("cannot execute '") + argv[0] + "': " + std::strerror(error);
    return error == ENOENT ? Status::NotFound(why) : Status::IOError(why);
  }
  for (int fd : {in[1], out[0], err[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  pid_ = pid;
  stdin_fd_ = in[1];
  stdout_fd_ = out[0];
  stderr_fd_ = err[0];
  return Status::Ok();
}

bool Child::TryReap(int* wait_status) {
  if (pid_ <= 0) return true;
  int status = 0;
  const pid_t reaped = ::waitpid(pid_, &status, WNOHANG);
  if (reaped == 0) return false;
  if (wait_status != nullptr) *wait_status = reaped == pid_ ? status : 0;
  pid_ = -1;
  CloseAll();
  return true;
}

bool Child::WaitFor(std::chrono::milliseconds limit, int* wait_status) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!TryReap(wait_status)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

int Child::Stop(std::chrono::milliseconds grace) {
  int wait_status = 0;
  if (!running()) return wait_status;
  CloseStdin();
  if (WaitFor(grace, &wait_status)) return wait_status;
  ::kill(-pid_, SIGTERM);
  if (WaitFor(grace, &wait_status)) return wait_status;
  return Kill();
}

int Child::Kill() {
  int wait_status = 0;
  if (!running()) return wait_status;
  ::kill(-pid_, SIGKILL);
  while (::waitpid(pid_, &wait_status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  CloseAll();
  return wait_status;
}

}  // namespace flywheel::grading
