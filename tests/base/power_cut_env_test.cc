// The Env's durable-write primitives (new files, positioned writes, directories, locks,
// durable removal) and the PowerCutEnv that the crash-consistency tests stand on: each
// kind of unsynced change it must undo, one test each, and an atomic write cut at every
// step, against a copy of it with the directory fsync left out (which must lose a write
// it acknowledged: the harness sees the bug that fsync ordering prevents).
#include "tests/base/power_cut_env.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace flywheel {
namespace {

std::span<const std::byte> Bytes(const std::string& text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

class PowerCutEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::string> dir = real_->MakeTempDir("flywheel_power_cut.");
    ASSERT_TRUE(dir.ok()) << dir.status().ToString();
    dir_ = *dir;
  }
  void TearDown() override { EXPECT_TRUE(real_->RemoveAll(dir_).ok()); }

  std::string P(const std::string& name) const { return dir_ + "/" + name; }
  // The file's contents, or "<absent>".
  std::string Read(const std::string& name) const {
    Result<std::vector<std::byte>> bytes = real_->ReadFile(P(name));
    if (!bytes.ok()) return "<absent>";
    return std::string(reinterpret_cast<const char*>(bytes->data()), bytes->size());
  }
  void Put(const std::string& name, const std::string& text) {
    ASSERT_TRUE(WriteFileAtomically(P(name), Bytes(text), real_).ok());
  }

  Env* real_ = Env::Default();
  std::string dir_;
};

// ---------------------------------------------------------------------------------------
// The Env primitives

TEST_F(PowerCutEnvTest, NewWritableFileCreatesTruncatesOrOpensAsAsked) {
  auto created = real_->NewWritableFile(P("f"), Env::OpenMode::kCreateNew, 0600);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  ASSERT_TRUE((*created)->Append(Bytes("hello")).ok());
  ASSERT_TRUE((*created)->Close().ok());
  EXPECT_EQ(*real_->FileMode(P("f")), 0600u);
  EXPECT_EQ(real_->NewWritableFile(P("f"), Env::OpenMode::kCreateNew).status().code(),
            StatusCode::kIOError);  // exists
  EXPECT_EQ(real_->NewWritableFile(P("absent"), Env::OpenMode::kExisting).status().code(),
            StatusCode::kNotFound);
  auto existing = real_->NewWritableFile(P("f"), Env::OpenMode::kExisting);
  ASSERT_TRUE(existing.ok());
  ASSERT_TRUE((*existing)->WriteAt(1, Bytes("EL")).ok());
  ASSERT_TRUE((*existing)->Close().ok());
  EXPECT_EQ(Read("f"), "hELlo");
  auto truncated = real_->NewWritableFile(P("f"), Env::OpenMode::kTruncate);
  ASSERT_TRUE(truncated.ok());
  ASSERT_TRUE((*truncated)->Close().ok());
  EXPECT_EQ(Read("f"), "");
}

TEST_F(PowerCutEnvTest, AllocateReservesTheBytes) {
  auto file = real_->NewWritableFile(P("f"), Env::OpenMode::kCreateNew);
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*file)->Allocate(4096).ok());
  ASSERT_TRUE((*file)->WriteAt(4000, Bytes("end")).ok());
  ASSERT_TRUE((*file)->Close().ok());
  EXPECT_EQ(Read("f").size(), 4096u);
  EXPECT_EQ(Read("f").substr(4000, 3), "end");
}

TEST_F(PowerCutEnvTest, CreateDirsMakesParentsAndAcceptsAnExistingDirectory) {
  ASSERT_TRUE(real_->CreateDirs(P("a/b/c")).ok());
  EXPECT_TRUE(real_->IsDirectory(P("a/b/c")));
  EXPECT_TRUE(real_->CreateDirs(P("a/b/c")).ok());
  Put("file", "x");
  EXPECT_FALSE(real_->CreateDirs(P("file")).ok());
  EXPECT_FALSE(real_->IsDirectory(P("file")));
}

TEST_F(PowerCutEnvTest, ALockFileHasOneHolderAtATime) {
  auto first = real_->LockFile(P("LOCK"));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(real_->LockFile(P("LOCK")).status().code(), StatusCode::kUnavailable);
  first->reset();
  EXPECT_TRUE(real_->LockFile(P("LOCK")).ok());
}

TEST_F(PowerCutEnvTest, RemoveFileDurablyAcceptsAMissingFile) {
  Put("f", "x");
  EXPECT_TRUE(RemoveFileDurably(P("f"), real_).ok());
  EXPECT_EQ(Read("f"), "<absent>");
  EXPECT_TRUE(RemoveFileDurably(P("f"), real_).ok());
}

TEST(DirNameTest, TheDirectoryOfAPath) {
  EXPECT_EQ(DirName("/a/b/c"), "/a/b");
  EXPECT_EQ(DirName("/a/b/c/"), "/a/b");
  EXPECT_EQ(DirName("/a"), "/");
  EXPECT_EQ(DirName("/"), "/");
  EXPECT_EQ(DirName("a"), ".");
  EXPECT_EQ(DirName("a//b"), "a");
}

// ---------------------------------------------------------------------------------------
// What a power cut undoes, one kind of change each

TEST_F(PowerCutEnvTest, BytesAppendedButNotSyncedAreLost) {
  Put("log", "one\n");
  PowerCutEnv env(dir_);
  auto file = env.NewAppendableFile(P("log"));
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*file)->Append(Bytes("two\n")).ok());
  ASSERT_TRUE((*file)->Sync().ok());
  ASSERT_TRUE((*file)->Append(Bytes("three\n")).ok());
  file->reset();
  EXPECT_EQ(Read("log"), "one\ntwo\nthree\n");  // before the cut: all of it
  ASSERT_TRUE(env.PowerCut().ok());
  EXPECT_EQ(Read("log"), "one\ntwo\n");
}

TEST_F(PowerCutEnvTest, ATornWriteKeepsHalfOfTheUnsyncedBytes) {
  Put("log", "one\n");
  PowerCutEnv env(dir_);
  auto file = env.NewAppendableFile(P("log"));
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*file)->Append(Bytes("twotwo\n!")).ok());
  file->reset();
  ASSERT_TRUE(env.PowerCut(PowerCutEnv::Tear::kHalfOfUnsynced).ok());
  EXPECT_EQ(Read("log"), "one\ntwot");
}

TEST_F(PowerCutEnvTest, ARenameWithoutADirectorySyncIsUndone) {
  Put("state", "old");
  PowerCutEnv env(dir_);
  auto temp = env.NewTempFile(P("state"));
  ASSERT_TRUE(temp.ok());
  ASSERT_TRUE((*temp)->Append(Bytes("new")).ok());
  ASSERT_TRUE((*temp)->Sync().ok());
  ASSERT_TRUE((*temp)->Close().ok());
  ASSERT_TRUE(env.RenameFile((*temp)->path(), P("state")).ok());
  EXPECT_EQ(Read("state"), "new");
  ASSERT_TRUE(env.PowerCut().ok());
  EXPECT_EQ(Read("state"), "old");
  EXPECT_EQ(real_->ListDir(dir_)->size(), 1u);  // the temporary name was never synced either
}

TEST_F(PowerCutEnvTest, AFileWhoseNameWasSyncedButNotItsBytesIsEmpty) {
  PowerCutEnv env(dir_);
  auto file = env.NewWritableFile(P("f"), Env::OpenMode::kCreateNew, 0644);
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE((*file)->Append(Bytes("data")).ok());
  ASSERT_TRUE((*file)->Close().ok());
  ASSERT_TRUE(env.SyncDir(dir_).ok());
  ASSERT_TRUE(env.PowerCut().ok());
  EXPECT_EQ(Read("f"), "");
}

TEST_F(PowerCutEnvTest, ARemovalWithoutADirectorySyncIsUndone) {
  Put("a", "A");
  PowerCutEnv env(dir_);
  ASSERT_TRUE(env.RemoveFile(P("a")).ok());
  EXPECT_EQ(Read("a"), "<absent>");
  ASSERT_TRUE(env.PowerCut().ok());
  EXPECT_EQ(Read("a"), "A");
  // Synced, the removal sticks (a directory fsync persists every change in it).
  ASSERT_TRUE(RemoveFileDurably(P("a"), &env).ok());
  ASSERT_TRUE(env.PowerCut().ok());
  EXPECT_EQ(Read("a"), "<absent>");
}

TEST_F(PowerCutEnvTest, DirectoriesFromCreateDirsSurviveAndTheirUnsyncedFilesDoNot) {
  PowerCutEnv env(dir_);
  ASSERT_TRUE(env.CreateDirs(P("x/y")).ok());
  ASSERT_TRUE(WriteFileAtomically(P("x/y/kept"), Bytes("k"), &env).ok());
  auto lost = env.NewWritableFile(P("x/lost"), Env::OpenMode::kCreateNew, 0644);
  ASSERT_TRUE(lost.ok());
  ASSERT_TRUE((*lost)->Close().ok());
  ASSERT_TRUE(env.PowerCut().ok());
  EXPECT_TRUE(real_->IsDirectory(P("x/y")));
  EXPECT_EQ(Read("x/y/kept"), "k");
  EXPECT_EQ(Read("x/lost"), "<absent>");
}

TEST_F(PowerCutEnvTest, TheCutFailsThatStepAndEveryLaterOne) {
  PowerCutEnv env(dir_);
  env.CutAt(1);
  auto file = env.NewWritableFile(P("f"), Env::OpenMode::kCreateNew, 0644);  // step 0
  ASSERT_TRUE(file.ok());
  const Status cut = (*file)->Append(Bytes("x"));  // step 1
  EXPECT_EQ(cut.code(), StatusCode::kIOError);
  EXPECT_NE(cut.message().find("power cut"), std::string::npos);
  EXPECT_FALSE((*file)->Sync().ok());
  EXPECT_FALSE(env.SyncDir(dir_).ok());
  EXPECT_TRUE(env.was_cut());
  EXPECT_EQ(env.steps(), 4);
}

// ---------------------------------------------------------------------------------------
// An atomic write, cut at every step

// WriteFileAtomically without the directory fsync after the rename: the bug the Env's
// AtomicFile does not have.
Status WriteWithoutDirectorySync(Env* env, const std::string& path, const std::string& text) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, env->NewTempFile(path));
  FW_RETURN_IF_ERROR(file->Append(Bytes(text)));
  FW_RETURN_IF_ERROR(file->Sync());
  FW_RETURN_IF_ERROR(file->Close());
  return env->RenameFile(file->path(), path);
}

// Cuts `write` (old -> new) at every step; returns how many acknowledged writes were lost,
// and checks that every outcome is the old file or the new one, whole.
template <typename Write>
int LostAcknowledgedWrites(const std::string& dir, Write write, int* cut_points) {
  const std::string path = dir + "/state";
  int lost = 0;
  for (int64_t step = 0;; ++step) {
    EXPECT_TRUE(WriteFileAtomically(path, Bytes("old contents")).ok());
    PowerCutEnv env(dir);
    env.CutAt(step);
    const bool acknowledged = write(&env, path, "new contents").ok();
    const bool cut = env.was_cut();
    EXPECT_TRUE(env.PowerCut().ok());
    Result<std::vector<std::byte>> bytes = Env::Default()->ReadFile(path);
    const std::string after =
        bytes.ok() ? std::string(reinterpret_cast<const char*>(bytes->data()), bytes->size()) : "";
    EXPECT_TRUE(after == "old contents" || after == "new contents") << "step " << step << ": '" << after << "'";
    if (acknowledged && after != "new contents") ++lost;
    if (!cut) {
      *cut_points = static_cast<int>(step);
      return lost;
    }
  }
}

TEST_F(PowerCutEnvTest, AnAtomicWriteLosesNothingItAcknowledgedAtAnyCut) {
  int cut_points = 0;
  const int lost = LostAcknowledgedWrites(
      dir_,
      [](Env* env, const std::string& path, const std::string& text) {
        return WriteFileAtomically(path, Bytes(text), env);
      },
      &cut_points);
  EXPECT_EQ(lost, 0);
  EXPECT_EQ(cut_points, 6);  // create, append, fsync, close, rename, directory fsync
}

TEST_F(PowerCutEnvTest, TheHarnessCatchesAnAtomicWriteWithoutTheDirectorySync) {
  int cut_points = 0;
  const int lost = LostAcknowledgedWrites(dir_, WriteWithoutDirectorySync, &cut_points);
  // Cut after the rename (or not at all): acknowledged, and the rename is undone.
  EXPECT_GE(lost, 1) << "the power-cut harness did not see the missing directory fsync";
}

}  // namespace
}  // namespace flywheel
