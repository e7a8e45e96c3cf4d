#include "base/env.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace flywheel {
namespace {

std::span<const std::byte> Bytes(const std::string& text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

std::string Text(const std::vector<std::byte>& bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// Fails the n-th file operation (counting from 0) with an injected I/O error; every
// operation before and after it goes to the real Env. The operations an atomic write makes
// are: create the temporary file, each append, sync, close, rename, directory sync.
class FaultInjectionEnv : public EnvWrapper {
 public:
  explicit FaultInjectionEnv(int fail_at) : EnvWrapper(Env::Default()), fail_at_(fail_at) {}

  int operations() const { return operations_; }
  bool injected() const { return injected_; }

  // The next operation: an injected error when it is number fail_at_.
  Status Step(const std::string& what, const std::string& path) {
    if (operations_++ != fail_at_) return Status::Ok();
    injected_ = true;
    return Status::IOError(path + ": " + what + ": injected fault");
  }

  Result<std::unique_ptr<WritableFile>> NewTempFile(
      const std::string& path, std::optional<uint32_t> permissions = std::nullopt) override;
  Status RenameFile(const std::string& from, const std::string& to) override {
    FW_RETURN_IF_ERROR(Step("rename", from));
    return EnvWrapper::RenameFile(from, to);
  }
  Status SyncDir(const std::string& dir) override {
    FW_RETURN_IF_ERROR(Step("sync directory", dir));
    return EnvWrapper::SyncDir(dir);
  }

 private:
  const int fail_at_;
  int operations_ = 0;
  bool injected_ = false;
};

class FaultyFile : public WritableFile {
 public:
  FaultyFile(FaultInjectionEnv* env, std::unique_ptr<WritableFile> file)
      : env_(env), file_(std::move(file)) {}
  Status Append(std::span<const std::byte> bytes) override {
    FW_RETURN_IF_ERROR(env_->Step("write", path()));
    return file_->Append(bytes);
  }
  Status Sync() override {
    FW_RETURN_IF_ERROR(env_->Step("fsync", path()));
    return file_->Sync();
  }
  Status Close() override {
    // A failed close(2) still releases the descriptor; so does this one.
    Status injected = env_->Step("close", path());
    Status closed = file_->Close();
    return injected.ok() ? closed : injected;
  }
  const std::string& path() const override { return file_->path(); }
  int fd() const override { return file_->fd(); }

 private:
  FaultInjectionEnv* env_;
  std::unique_ptr<WritableFile> file_;
};

Result<std::unique_ptr<WritableFile>> FaultInjectionEnv::NewTempFile(
    const std::string& path, std::optional<uint32_t> permissions) {
  FW_RETURN_IF_ERROR(Step("create temporary file", path));
  FW_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, EnvWrapper::NewTempFile(path, permissions));
  return std::unique_ptr<WritableFile>(new FaultyFile(this, std::move(file)));
}

class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::string> dir = env_->MakeTempDir("flywheel_env_test.");
    ASSERT_TRUE(dir.ok()) << dir.status().ToString();
    dir_ = *dir;
  }
  void TearDown() override { EXPECT_TRUE(env_->RemoveAll(dir_).ok()); }

  std::string P(const std::string& name) const { return dir_ + "/" + name; }
  std::vector<std::string> Entries() const {
    Result<std::vector<std::string>> names = env_->ListDir(dir_);
    EXPECT_TRUE(names.ok()) << names.status().ToString();
    return names.ok() ? *names : std::vector<std::string>{};
  }
  std::string Read(const std::string& path) const {
    Result<std::vector<std::byte>> bytes = env_->ReadFile(path);
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    return bytes.ok() ? Text(*bytes) : std::string();
  }

  Env* env_ = Env::Default();
  std::string dir_;
};

// ---------------------------------------------------------------------------------------
// errno -> Status

TEST(ErrnoStatusTest, MessageNamesPathOperationAndError) {
  const Status status = ErrnoStatus("open", "/no/such/file", ENOENT);
  EXPECT_EQ(status.code(), StatusCode::kNotFound);
  EXPECT_EQ(status.message(), std::string("/no/such/file: open: ") + std::strerror(ENOENT));
}

TEST(ErrnoStatusTest, CodesFollowTheError) {
  EXPECT_EQ(ErrnoStatus("write", "f", ENOSPC).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus("write", "f", EDQUOT).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus("open", "f", EACCES).code(), StatusCode::kIOError);
  EXPECT_EQ(ErrnoStatus("fsync", "f", EIO).code(), StatusCode::kIOError);
  EXPECT_EQ(ErrnoStatus("rename to g", "f", EXDEV).message(),
            std::string("f: rename to g: ") + std::strerror(EXDEV));
}

// ---------------------------------------------------------------------------------------
// Atomic writes

TEST_F(EnvTest, WriteFileAtomicallyCreatesAndReplaces) {
  ASSERT_TRUE(WriteFileAtomically(P("out"), Bytes("first")).ok());
  EXPECT_EQ(Read(P("out")), "first");
  ASSERT_TRUE(WriteFileAtomically(P("out"), Bytes("second, longer")).ok());
  EXPECT_EQ(Read(P("out")), "second, longer");
  ASSERT_TRUE(WriteFileAtomically(P("out"), Bytes("")).ok());
  EXPECT_EQ(Read(P("out")), "");
  EXPECT_EQ(Entries(), std::vector<std::string>{"out"});  // no temporary file left
}

// Fail each operation of an atomic write in turn: before the rename the old file is intact
// and no temporary file is left; a failure after it (the directory sync) is reported, but
// the new file is already in place.
TEST_F(EnvTest, AtomicWriteFailingAtEveryOperationLeavesOldFileOrNewFile) {
  int fail_at = 0;
  for (;; ++fail_at) {
    ASSERT_TRUE(WriteFileAtomically(P("out"), Bytes("old contents")).ok());
    FaultInjectionEnv faulty(fail_at);
    Status status = [&]() -> Status {
      FW_ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(P("out"), &faulty));
      FW_RETURN_IF_ERROR(file.Append(Bytes("new ")));
      FW_RETURN_IF_ERROR(file.Append(Bytes("contents ")));
      FW_RETURN_IF_ERROR(file.Append(Bytes("in three parts")));
      return file.Commit();
    }();
    if (!faulty.injected()) {
      ASSERT_TRUE(status.ok()) << status.ToString();
      EXPECT_EQ(Read(P("out")), "new contents in three parts");
      EXPECT_EQ(Entries(), std::vector<std::string>{"out"});
      break;
    }
    SCOPED_TRACE("failing operation " + std::to_string(fail_at));
    EXPECT_EQ(status.code(), StatusCode::kIOError);
    EXPECT_NE(status.message().find("injected fault"), std::string::npos) << status.message();
    const bool renamed = fail_at == 7;  // only the directory sync comes after the rename
    EXPECT_EQ(Read(P("out")), renamed ? "new contents in three parts" : "old contents");
    EXPECT_EQ(Entries(), std::vector<std::string>{"out"});
  }
  // create, 3 appends, sync, close, rename, directory sync.
  EXPECT_EQ(fail_at, 8);
}

TEST_F(EnvTest, AbandonedAtomicFileRemovesItsTemporaryFile) {
  ASSERT_TRUE(WriteFileAtomically(P("model.bin"), Bytes("keep")).ok());
  {
    Result<AtomicFile> file = AtomicFile::Create(P("model.bin"));
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    ASSERT_TRUE(file->Append(Bytes("discarded")).ok());
    const std::vector<std::string> entries = Entries();
    ASSERT_EQ(entries.size(), 2u);
    EXPECT_EQ(entries[0].rfind(".model.bin.tmp-", 0), 0u) << entries[0];
    EXPECT_EQ(file->file().path(), P(entries[0]));
  }
  EXPECT_EQ(Entries(), std::vector<std::string>{"model.bin"});
  EXPECT_EQ(Read(P("model.bin")), "keep");
}

TEST_F(EnvTest, AtomicFileCommitsOnce) {
  Result<AtomicFile> file = AtomicFile::Create(P("once"));
  ASSERT_TRUE(file.ok());
  AtomicFile moved = std::move(*file);
  EXPECT_EQ(file->Commit().code(), StatusCode::kInvalidArgument);  // moved from
  ASSERT_TRUE(moved.Commit().ok());
  EXPECT_FALSE(moved.is_open());
  EXPECT_EQ(moved.Commit().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Entries(), std::vector<std::string>{"once"});
}

TEST_F(EnvTest, TemporaryFileInMissingDirectoryNamesIt) {
  Result<AtomicFile> file = AtomicFile::Create(P("absent/out"));
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find(P("absent")), std::string::npos)
      << file.status().message();
  EXPECT_EQ(AtomicFile::Create(P("")).status().code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------
// Reading and mapping

TEST_F(EnvTest, MapReadOnlyRegularAndEmptyFiles) {
  ASSERT_TRUE(WriteFileAtomically(P("regular"), Bytes("mapped bytes")).ok());
  Result<std::unique_ptr<MappedRegion>> region = env_->MapReadOnly(P("regular"));
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  const std::span<const std::byte> bytes = (*region)->bytes();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
            "mapped bytes");

  ASSERT_TRUE(WriteFileAtomically(P("empty"), {}).ok());
  Result<std::unique_ptr<MappedRegion>> empty = env_->MapReadOnly(P("empty"));
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE((*empty)->bytes().empty());
}

TEST_F(EnvTest, MapReadOnlyErrorsNameThePath) {
  Result<std::unique_ptr<MappedRegion>> missing = env_->MapReadOnly(P("missing"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), P("missing") + ": open: " + std::strerror(ENOENT));

  Result<std::unique_ptr<MappedRegion>> directory = env_->MapReadOnly(dir_);
  ASSERT_FALSE(directory.ok());
  EXPECT_EQ(directory.status().code(), StatusCode::kIOError);
  EXPECT_EQ(directory.status().message(), dir_ + ": not a regular file");
}

TEST_F(EnvTest, ReadFileWholeMissingAndDirectory) {
  ASSERT_TRUE(WriteFileAtomically(P("f"), Bytes("whole file")).ok());
  EXPECT_EQ(Read(P("f")), "whole file");
  Result<std::vector<std::byte>> missing = env_->ReadFile(P("missing"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(P("missing")), std::string::npos);
  Result<std::vector<std::byte>> directory = env_->ReadFile(dir_);
  EXPECT_EQ(directory.status().code(), StatusCode::kIOError);
  EXPECT_NE(directory.status().message().find(dir_), std::string::npos);
}

// ---------------------------------------------------------------------------------------
// Directories

TEST_F(EnvTest, ListRenameRemoveExists) {
  EXPECT_TRUE(Entries().empty());
  ASSERT_TRUE(WriteFileAtomically(P("b"), Bytes("2")).ok());
  ASSERT_TRUE(WriteFileAtomically(P("a"), Bytes("1")).ok());
  EXPECT_EQ(Entries(), (std::vector<std::string>{"a", "b"}));  // sorted, no . or ..
  ASSERT_TRUE(env_->RenameFile(P("a"), P("c")).ok());
  EXPECT_FALSE(env_->FileExists(P("a")));
  EXPECT_TRUE(env_->FileExists(P("c")));
  const Status rename_missing = env_->RenameFile(P("a"), P("d"));
  EXPECT_EQ(rename_missing.code(), StatusCode::kNotFound);
  EXPECT_EQ(rename_missing.message(), P("a") + ": rename to " + P("d") + ": " + std::strerror(ENOENT));
  ASSERT_TRUE(env_->RemoveFile(P("c")).ok());
  EXPECT_EQ(env_->RemoveFile(P("c")).code(), StatusCode::kNotFound);
  EXPECT_EQ(Entries(), std::vector<std::string>{"b"});
  EXPECT_EQ(env_->ListDir(P("none")).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(env_->SyncDir(dir_).ok());
  EXPECT_EQ(env_->SyncDir(P("none")).code(), StatusCode::kNotFound);
}

TEST_F(EnvTest, TempDirsAreFreshAndRemovedWithTheirContents) {
  Result<std::string> one = env_->MakeTempDir("flywheel_env_test.");
  Result<std::string> two = env_->MakeTempDir("flywheel_env_test.");
  ASSERT_TRUE(one.ok() && two.ok());
  EXPECT_NE(*one, *two);
  ASSERT_TRUE(WriteFileAtomically(*one + "/inside", Bytes("x")).ok());
  ASSERT_TRUE(env_->RemoveAll(*one).ok());
  ASSERT_TRUE(env_->RemoveAll(*two).ok());
  EXPECT_FALSE(env_->FileExists(*one));
  EXPECT_TRUE(env_->RemoveAll(*one).ok());  // nothing there is fine
}

// ---------------------------------------------------------------------------------------
// Clocks

TEST(ClockTest, DefaultClocksMove) {
  Env* env = Env::Default();
  const int64_t system = std::chrono::duration_cast<std::chrono::microseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  EXPECT_LT(std::abs(env->NowMicros() - system), 1'000'000);
  const SteadyTime before = env->SteadyNow();
  env->SleepFor(std::chrono::milliseconds(2));
  EXPECT_GE(env->SteadyNow() - before, std::chrono::milliseconds(2));
}

TEST(ClockTest, ManualClockAdvancesOnlyWhenTold) {
  ManualClock clock(/*start_unix_micros=*/5'000'000);
  const SteadyTime start = clock.SteadyNow();
  EXPECT_EQ(clock.NowMicros(), 5'000'000);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // real time passes...
  EXPECT_EQ(clock.NowMicros(), 5'000'000);                     // ...this clock's does not
  EXPECT_EQ(clock.SteadyNow(), start);
  clock.Advance(std::chrono::microseconds(1500));
  EXPECT_EQ(clock.NowMicros(), 5'001'500);
  EXPECT_EQ(clock.SteadyNow() - start, std::chrono::microseconds(1500));
  clock.Advance(std::chrono::seconds(3600));
  EXPECT_EQ(clock.NowMicros(), 5'001'500 + 3'600'000'000);
}

TEST(ClockTest, ManualClockSleepEndsWhenAdvancedPastIt) {
  ManualClock clock;
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    clock.SleepFor(std::chrono::milliseconds(10));
    woke = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(woke);
  clock.Advance(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(woke);  // 5 of 10 ms
  clock.Advance(std::chrono::milliseconds(5));
  sleeper.join();
  EXPECT_TRUE(woke);
}

TEST(ClockTest, ManualClockTimedWaitEndsAtTheDrivenDeadline) {
  ManualClock clock;
  std::mutex mutex;
  std::condition_variable cv;
  const SteadyTime deadline = clock.SteadyNow() + std::chrono::seconds(30);
  std::atomic<bool> done{false};
  std::thread waiter([&] {
    std::unique_lock lock(mutex);
    while (clock.SteadyNow() < deadline) clock.WaitUntil(cv, lock, deadline);
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(done);  // 30 s of this clock never pass by themselves
  clock.Advance(std::chrono::seconds(30));
  waiter.join();
  EXPECT_TRUE(done);
  // A deadline already passed returns at once.
  std::unique_lock lock(mutex);
  clock.WaitUntil(cv, lock, deadline);
}

// ---------------------------------------------------------------------------------------
// Secrets: a token file open to group or others is refused, as ssh refuses such a key.

TEST_F(EnvTest, PrivateFileCheckRefusesAFileOthersCanRead) {
  const std::string path = P("push.token");
  ASSERT_TRUE(WriteFileAtomically(path, Bytes("secret\n"), env_).ok());
  for (mode_t mode : {0644, 0640, 0604, 0660, 0620}) {
    ASSERT_EQ(::chmod(path.c_str(), mode), 0);
    const Status status = CheckPrivateFile(path, "--token-file", env_);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << std::oct << mode;
    char octal[8];
    std::snprintf(octal, sizeof(octal), "%04o", static_cast<unsigned>(mode));
    EXPECT_NE(status.message().find(path), std::string::npos) << status.message();
    EXPECT_NE(status.message().find(octal), std::string::npos) << status.message();
    EXPECT_NE(status.message().find("chmod 600 " + path), std::string::npos) << status.message();
    EXPECT_NE(status.message().find("--token-file"), std::string::npos) << status.message();
  }
  for (mode_t mode : {0600, 0400}) {
    ASSERT_EQ(::chmod(path.c_str(), mode), 0);
    EXPECT_TRUE(CheckPrivateFile(path, "--token-file", env_).ok()) << std::oct << mode;
  }
  EXPECT_EQ(CheckPrivateFile(P("missing.token"), "--token-file", env_).code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace flywheel
