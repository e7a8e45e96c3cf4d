// The process harness (ops/process.h) with /bin/sh, sleep and python3 as children:
// nothing outlives a group, a child that ignores SIGTERM is killed after the grace, ports
// come back, one-shot commands report their output and time out with a clear error.
#include "ops/process.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>
#include <filesystem>
#include <string>
#include <vector>

namespace flywheel::ops {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Whether `pid` names a process (zombies included): kill(pid, 0) fails with ESRCH once the
// process has been reaped.
bool ProcessExists(pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

// Whether a socket can be bound to 127.0.0.1:`port` right now.
bool Bindable(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return bound;
}

std::string Python3() {
  for (const char* path : {"/usr/bin/python3", "/usr/local/bin/python3"}) {
    if (::access(path, X_OK) == 0) return path;
  }
  return "";
}

class ProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "process_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  fs::path dir_;
};

TEST_F(ProcessTest, RunningChildIsStoppedAndReapedWhenTheGroupIsDestroyed) {
  pid_t pid = -1;
  {
    ProcessGroup processes(dir_.string());
    Result<size_t> sleeper = processes.Start("sleeper", "/bin/sleep", {"1000"});
    ASSERT_TRUE(sleeper.ok()) << sleeper.status().ToString();
    pid = processes.pid(*sleeper);
    ASSERT_TRUE(processes.running(*sleeper));
  }
  EXPECT_FALSE(ProcessExists(pid)) << "pid " << pid << " outlived its group";
}

TEST_F(ProcessTest, ChildIgnoringSigtermIsKilledAfterTheGrace) {
  ProcessGroup processes(dir_.string());
  processes.set_grace(300ms);
  const std::string ready = (dir_ / "trapped").string();
  // The shell ignores SIGTERM, says so through a file, then sleeps in slices so that it
  // stays the process the group knows (no exec into sleep).
  Result<size_t> stubborn = processes.Start(
      "stubborn", "/bin/sh",
      {"-c", "trap '' TERM; : > " + ready + "; while :; do sleep 0.05; done"});
  ASSERT_TRUE(stubborn.ok()) << stubborn.status().ToString();
  ASSERT_TRUE(WaitUntil([&] { return fs::exists(ready); }, 10s, "the trap to be set").ok());
  const pid_t pid = processes.pid(*stubborn);

  const Clock::time_point start = Clock::now();
  const std::vector<std::string> unclean = processes.StopAll();
  const auto took = Clock::now() - start;
  ASSERT_EQ(unclean.size(), 1u);
  EXPECT_NE(unclean[0].find("stubborn did not stop within 300 ms of SIGTERM and was killed"),
            std::string::npos)
      << unclean[0];
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 5s);
  EXPECT_FALSE(processes.running(*stubborn));
  EXPECT_FALSE(ProcessExists(pid));
}

TEST_F(ProcessTest, StopOneChildReturnsHowItEnded) {
  ProcessGroup processes(dir_.string());
  Result<size_t> sleeper = processes.Start("sleeper", "/bin/sleep", {"1000"});
  Result<size_t> other = processes.Start("other", "/bin/sleep", {"1000"});
  ASSERT_TRUE(sleeper.ok() && other.ok());
  const int wait_status = processes.Stop(*sleeper);
  EXPECT_TRUE(WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGTERM)
      << DescribeWaitStatus(wait_status);
  EXPECT_FALSE(processes.running(*sleeper));
  EXPECT_TRUE(processes.running(*other));
  EXPECT_FALSE(processes.Signal(*sleeper, SIGTERM).ok()) << "signalled a child that ended";
}

// What a failed ASSERT does: returns from the test body with processes started.
void StartThenFailEarly(const std::string& log_dir, std::vector<pid_t>& pids) {
  ProcessGroup processes(log_dir);
  for (const char* name : {"a", "b", "c"}) {
    Result<size_t> child = processes.Start(name, "/bin/sleep", {"1000"});
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    pids.push_back(processes.pid(*child));
  }
  ASSERT_TRUE(false) << "simulated failure: leaves the scope early (expected)";
  ADD_FAILURE() << "not reached";
}

TEST_F(ProcessTest, ProcessesStopWhenAnAssertionLeavesTheScope) {
  std::vector<pid_t> pids;
  {
    // The failing scope runs under a reporter that intercepts its failure, so that this
    // test checks the failure happened instead of failing itself.
    ::testing::TestPartResultArray failures;
    {
      ::testing::ScopedFakeTestPartResultReporter reporter(
          ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
      StartThenFailEarly(dir_.string(), pids);
    }
    ASSERT_EQ(failures.size(), 1);
    EXPECT_NE(std::string(failures.GetTestPartResult(0).message()).find("simulated failure"),
              std::string::npos);
  }
  ASSERT_EQ(pids.size(), 3u);
  for (pid_t pid : pids) EXPECT_FALSE(ProcessExists(pid)) << "pid " << pid << " was left running";
}

TEST_F(ProcessTest, ChildThatDiesIsReportedWithItsStderr) {
  ProcessGroup processes(dir_.string());
  Result<size_t> failing =
      processes.Start("failing", "/bin/sh", {"-c", "echo out; echo 'it broke' >&2; exit 3"});
  ASSERT_TRUE(failing.ok());
  Result<int> exit_code = processes.WaitExitCode(*failing, 10s);
  ASSERT_TRUE(exit_code.ok()) << exit_code.status().ToString();
  EXPECT_EQ(*exit_code, 3);
  const Status status = processes.CheckRunning(*failing);
  EXPECT_NE(status.message().find("failing (/bin/sh -c"), std::string::npos) << status.ToString();
  EXPECT_NE(status.message().find("exited with status 3"), std::string::npos) << status.ToString();
  EXPECT_NE(status.message().find("it broke"), std::string::npos) << status.ToString();
  EXPECT_EQ(processes.Output(*failing), "out\nit broke\n");
}

TEST_F(ProcessTest, RestartedNameKeepsTheEarlierLogs) {
  ProcessGroup processes(dir_.string());
  Result<size_t> first = processes.Start("role", "/bin/sh", {"-c", "echo first"});
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(processes.Wait(*first, 10s).ok());
  Result<size_t> second = processes.Start("role", "/bin/sh", {"-c", "echo second"});
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(processes.Wait(*second, 10s).ok());
  EXPECT_EQ(processes.stdout_path(*first), (dir_ / "role.out").string());
  EXPECT_EQ(processes.stdout_path(*second), (dir_ / "role.restart1.out").string());
  EXPECT_EQ(processes.Output(*first), "first\n");
  EXPECT_EQ(processes.Output(*second), "second\n");
}

TEST_F(ProcessTest, StartPassesTheEnvironment) {
  ProcessGroup processes(dir_.string());
  Result<size_t> child = processes.Start("env", "/bin/sh", {"-c", "echo \"$FLYWHEEL_X $HOME\""},
                                         {.env = {"FLYWHEEL_X=42", "HOME=/elsewhere"}});
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(processes.Wait(*child, 10s).ok());
  EXPECT_EQ(processes.Output(*child), "42 /elsewhere\n");
}

TEST_F(ProcessTest, StartPinsTheChildToTheGivenCpus) {
  ProcessGroup processes(dir_.string());
  const std::string show = "grep Cpus_allowed_list /proc/self/status";
  Result<size_t> pinned = processes.Start("pinned", "/bin/sh", {"-c", show}, {.cpus = {0}});
  Result<size_t> free = processes.Start("free", "/bin/sh", {"-c", show});
  ASSERT_TRUE(pinned.ok() && free.ok());
  ASSERT_TRUE(processes.Wait(*pinned, 10s).ok());
  ASSERT_TRUE(processes.Wait(*free, 10s).ok());
  EXPECT_EQ(processes.Output(*pinned), "Cpus_allowed_list:\t0\n");
  if (std::thread::hardware_concurrency() > 1) {
    EXPECT_NE(processes.Output(*free), "Cpus_allowed_list:\t0\n");
  }
  Result<size_t> bad = processes.Start("bad", "/bin/true", {}, {.cpus = {-1}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("CPU -1"), std::string::npos);
}

TEST_F(ProcessTest, AwaitReadyFileFailsFastWhenTheChildDies) {
  ProcessGroup processes(dir_.string());
  Result<size_t> dying = processes.Start("dying", "/bin/sh", {"-c", "echo 'no config' >&2; exit 2"});
  ASSERT_TRUE(dying.ok());
  const Clock::time_point start = Clock::now();
  Result<nlohmann::json> ready =
      AwaitReadyFile(processes, (dir_ / "never.ready").string(), "dying", 30s);
  ASSERT_FALSE(ready.ok());
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_NE(ready.status().message().find("no config"), std::string::npos)
      << ready.status().ToString();
}

TEST_F(ProcessTest, FreePortIsBindable) {
  Result<uint16_t> port = FreePort();
  ASSERT_TRUE(port.ok()) << port.status().ToString();
  EXPECT_NE(*port, 0);
  EXPECT_TRUE(Bindable(*port));
}

TEST_F(ProcessTest, PortsOfAGroupsServersAreFreeAfterItIsDestroyed) {
  const std::string python = Python3();
  if (python.empty()) GTEST_SKIP() << "python3 is not installed";
  std::vector<uint16_t> ports;
  {
    ProcessGroup processes(dir_.string());
    for (int i = 0; i < 3; ++i) {
      Result<uint16_t> port = FreePort();
      ASSERT_TRUE(port.ok()) << port.status().ToString();
      ports.push_back(*port);
      const std::string ready = (dir_ / ("server" + std::to_string(i) + ".ready")).string();
      // Listens, then writes its ready file atomically, then waits to be stopped.
      const std::string script =
          "import os, socket, sys, time\n"
          "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
          "open(sys.argv[2] + '.tmp', 'w').write('{}'); os.rename(sys.argv[2] + '.tmp', sys.argv[2])\n"
          "time.sleep(1000)\n";
      const std::string name = "server" + std::to_string(i);
      Result<size_t> server =
          processes.Start(name, python, {"-c", script, std::to_string(*port), ready});
      ASSERT_TRUE(server.ok()) << server.status().ToString();
      Result<nlohmann::json> up = AwaitReadyFile(processes, ready, name, 30s, *server);
      ASSERT_TRUE(up.ok()) << up.status().ToString();
      EXPECT_FALSE(Bindable(*port)) << "server" << i << " does not hold port " << *port;
    }
  }
  for (uint16_t port : ports) EXPECT_TRUE(Bindable(port)) << "port " << port << " leaked";
}

// The one way flywheel finds itself: this test program, as an absolute path that runs it.
TEST(ExecutablePathTest, IsThisProgram) {
  Result<std::string> self = ExecutablePath();
  ASSERT_TRUE(self.ok()) << self.status().ToString();
  EXPECT_TRUE(fs::path(*self).is_absolute()) << *self;
  EXPECT_EQ(fs::path(*self).filename(), "pipeline_test");
  EXPECT_TRUE(fs::equivalent(*self, "/proc/self/exe"));
  Result<Completion> listed =
      RunToCompletion(*self, {"--gtest_list_tests", "--gtest_filter=ExecutablePathTest.*"}, {});
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_NE(listed->out.find("IsThisProgram"), std::string::npos) << listed->out;
}

TEST(RunToCompletionTest, CapturesExitCodeStdoutAndStderr) {
  Result<Completion> done =
      RunToCompletion("/bin/sh", {"-c", "printf 'to out'; printf 'to err' >&2; exit 7"});
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->exit_code, 7);
  EXPECT_EQ(done->out, "to out");
  EXPECT_EQ(done->err, "to err");
  EXPECT_GT(done->elapsed.count(), 0.0);
}

TEST(RunToCompletionTest, LargeOutputOnBothStreamsDoesNotDeadlock) {
  // More than a pipe buffer (64 KiB) on each stream, interleaved.
  Result<Completion> done = RunToCompletion(
      "/bin/sh", {"-c", "i=0; while [ $i -lt 3000 ]; do echo 0123456789012345678901234567890123456789;"
                        " echo abcdefghijabcdefghijabcdefghijabcdefghij >&2; i=$((i+1)); done"});
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->exit_code, 0);
  EXPECT_EQ(done->out.size(), 3000u * 41);
  EXPECT_EQ(done->err.size(), 3000u * 41);
}

TEST(RunToCompletionTest, SignalIsReportedAs128PlusItsNumber) {
  Result<Completion> done = RunToCompletion("/bin/sh", {"-c", "kill -9 $$"});
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->exit_code, 128 + SIGKILL);
}

TEST(RunToCompletionTest, StdoutCanGoToAFile) {
  const fs::path path = fs::temp_directory_path() / ("run_to_file." + std::to_string(::getpid()));
  RunOptions options;
  options.stdout_path = path.string();
  Result<Completion> done = RunToCompletion("/bin/sh", {"-c", "echo data"}, options);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->out, "");
  Result<std::string> text = ReadWholeFile(path.string());
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "data\n");
  fs::remove(path);
}

TEST(RunToCompletionTest, TimesOutWithAClearError) {
  RunOptions options;
  options.timeout = 300ms;
  const Clock::time_point start = Clock::now();
  Result<Completion> done =
      RunToCompletion("/bin/sh", {"-c", "echo started; exec sleep 1000"}, options);
  ASSERT_FALSE(done.ok());
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_EQ(done.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(done.status().message().find("/bin/sh -c echo started; exec sleep 1000 did not "
                                         "finish within 300 ms"),
            std::string::npos)
      << done.status().ToString();
  EXPECT_NE(done.status().message().find("stdout: started"), std::string::npos)
      << done.status().ToString();
}

TEST(RunToCompletionTest, MissingProgramIsAnExitCodeNotAHang) {
  Result<Completion> done = RunToCompletion("/nonexistent/program", {});
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->exit_code, 127);
  EXPECT_EQ(done->err, "exec failed\n");
}

TEST(WaitUntilTest, OkWhenTheConditionComesTrue) {
  const Clock::time_point become_true = Clock::now() + 100ms;
  EXPECT_TRUE(WaitUntil([&] { return Clock::now() >= become_true; }, 10s, "the clock").ok());
}

TEST(WaitUntilTest, NamedErrorOnTimeout) {
  int asked = 0;
  const Status status = WaitUntil(
      [&] {
        ++asked;
        return false;
      },
      50ms, "the moon to turn blue");
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("timed out after 50 ms waiting for the moon to turn blue"),
            std::string::npos)
      << status.ToString();
  EXPECT_GE(asked, 2);
}

}  // namespace
}  // namespace flywheel::ops
