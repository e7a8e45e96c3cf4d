// Env: flywheel's one seam to the outside world, in the manner of leveldb's Env. Files
// (whole-file reads, read-only mappings, new, temporary and append-only files, positioned
// writes, renames, removals, directories and their fsync, lock files, listings) and clocks
// (wall-clock micros, a monotonic clock, sleeping and timed waits) go through an Env, so
// that:
//
//   * errno becomes a Status in one place (ErrnoStatus below), with one message shape:
//     "<path>: <what>: <strerror>";
//   * there is one atomic write (AtomicFile / WriteFileAtomically) and one mmap
//     (Env::MapReadOnly), both built from the Env's primitives;
//   * tests inject faults by wrapping an Env (EnvWrapper) and fail, say, the third write
//     or the rename, without copying the code under test;
//   * tests drive time (ManualClock) instead of sleeping until a lease or deadline lapses.
//
// Durability. Every piece of state flywheel acknowledges (a version in the version log, a
// ledger row, a saved trainer state, signatures, the push cache) is written through an
// Env, and is on stable storage before it is acknowledged: a file's bytes once
// WritableFile::Sync returned, a name (a created, renamed or removed file) once the
// directory holding it was synced (SyncDir). AtomicFile does both in the right order; a
// log appends, Syncs, and syncs its directory once when it creates the file; CreateDirs
// syncs the parent of each directory it creates. tests/base/power_cut_env.h drops
// everything not yet synced, the way a power cut does, to check that no code path
// acknowledges too early. Nothing outside base/ writes durable state any other way
// (tests/layering/durable_writes.py).
//
// Thread safety: every Env method may be called from any thread. Env::Default() lives for
// the whole process and is never deleted. A WritableFile or MappedRegion is used by one
// thread at a time.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace flywheel {

// The one place errno becomes a Status. The message is "<path>: <what>: <strerror(err)>";
// ENOENT gives NotFound, ENOSPC and EDQUOT ResourceExhausted, anything else IOError.
// REQUIRES: err != 0 (read errno right after the failing call, before anything that may
// allocate or call into libc).
Status ErrnoStatus(std::string_view what, const std::string& path, int err);

using SteadyTime = std::chrono::steady_clock::time_point;

// A file open for writing (Env::NewTempFile, NewAppendableFile, NewWritableFile). The
// destructor closes the file (ignoring errors) but never removes it: AtomicFile does that.
class WritableFile {
 public:
  virtual ~WritableFile() = default;

  // Appends all of `bytes` (short writes and EINTR are retried).
  virtual Status Append(std::span<const std::byte> bytes) = 0;
  // Writes all of `bytes` at `offset` (pwrite(2): the append position does not move; not
  // for files opened for appending). The default writes through fd(); IOError without one.
  virtual Status WriteAt(uint64_t offset, std::span<const std::byte> bytes);
  // Reserves the first `size` bytes on disk (posix_fallocate), so that a full disk fails
  // here and not at a later write: ResourceExhausted when the disk is full. The default
  // allocates through fd(); IOError without one.
  virtual Status Allocate(uint64_t size);
  // fsync: the data is on stable storage when this returns OK.
  virtual Status Sync() = 0;
  // Closes the descriptor; reports what close(2) reports. Nothing may be called after.
  virtual Status Close() = 0;
  virtual const std::string& path() const = 0;
  // The descriptor, for a caller that sizes or maps the file itself (SafetensorsWriter
  // writes through a shared mapping); -1 once closed or when the file has none.
  virtual int fd() const = 0;
};

// A read-only mapping of a whole file, unmapped on destruction. An empty file has an
// empty span (nothing is mapped).
class MappedRegion {
 public:
  virtual ~MappedRegion() = default;
  virtual std::span<const std::byte> bytes() const = 0;
  // Drops the pages holding `range` (a subspan of bytes(), widened to whole pages) from
  // the process's resident set (madvise MADV_DONTNEED). The bytes do not change: the
  // mapping is read-only, so a later read faults them back in from the page cache or the
  // file. Safe from any thread, also while another thread reads those bytes. For a reader
  // that goes through a file larger than the process should hold resident (see
  // MappedReleaser). The default does nothing.
  virtual void Release(std::span<const std::byte> range) const { (void)range; }
};

// Keeps a MappedRegion from becoming resident whole while readers go through it: each
// reader says which bytes it has finished with (Done, from any thread), and after every
// `slice_bytes` so reported the whole region is released. Releasing only the finished
// ranges would not do: a page fault also maps the cached pages around it (the kernel's
// fault-around, 64 KiB), so finished pages beside a range still to be read come back and
// stay. The region's resident pages stay below about slice_bytes + what the readers have
// in flight (a delta chunk each) + fault-around. REQUIRES: `region` outlives this.
class MappedReleaser {
 public:
  explicit MappedReleaser(const MappedRegion& region, uint64_t slice_bytes = 16 << 20)
      : region_(region), slice_bytes_(slice_bytes == 0 ? 1 : slice_bytes) {}
  MappedReleaser(const MappedReleaser&) = delete;
  MappedReleaser& operator=(const MappedReleaser&) = delete;

  // `bytes`: read for the last time by one reader (or for now: a later read is correct,
  // only slower). Thread-safe.
  void Done(std::span<const std::byte> bytes);
  // Releases the whole region now.
  void ReleaseAll() const { region_.Release(region_.bytes()); }

 private:
  const MappedRegion& region_;
  const uint64_t slice_bytes_;
  std::atomic<uint64_t> done_bytes_{0};
};

class Env {
 public:
  Env() = default;
  Env(const Env&) = delete;
  Env& operator=(const Env&) = delete;
  virtual ~Env() = default;

  // POSIX files and the process's real clocks.
  static Env* Default();

  // ---- Files. Every error names the path. ----

  // The whole regular file at `path`. NotFound when it does not exist, ResourceExhausted
  // when it cannot be held in memory, IOError when it is not a regular file or changes
  // size while being read.
  virtual Result<std::vector<std::byte>> ReadFile(const std::string& path) = 0;
  // Maps the regular file at `path` read-only (MAP_PRIVATE). Later writes to the file by
  // others may or may not show through; flywheel only maps files it will not rewrite in
  // place (every writer here renames a new file over the old one).
  virtual Result<std::unique_ptr<MappedRegion>> MapReadOnly(const std::string& path) = 0;
  // Creates a new, empty file in the directory of `path`, named
  // ".<name>.tmp-<pid>-<random>" (exclusive create, mode 0666 & ~umask, or exactly
  // `permissions` when given), for writing `path` atomically. InvalidArgument when `path`
  // names no file.
  virtual Result<std::unique_ptr<WritableFile>> NewTempFile(
      const std::string& path, std::optional<uint32_t> permissions = std::nullopt) = 0;
  // Opens `path` for appending, creating it (mode 0600) when missing; writes go to its
  // end. For append-only logs: Append, then Sync before acknowledging. A file created here
  // survives a crash only once its directory is synced too (SyncDir).
  virtual Result<std::unique_ptr<WritableFile>> NewAppendableFile(const std::string& path) = 0;
  // Opens `path` for writing at the start (Append) or anywhere (WriteAt). kCreateNew:
  // creates it, IOError ("File exists") when something is there already; kTruncate:
  // creates it or empties it; kExisting: opens it as it is, NotFound when missing. A file
  // this creates gets `permissions` exactly (fchmod, whatever the umask). As with any new
  // name, the file survives a crash only once its directory is synced too.
  enum class OpenMode { kCreateNew, kTruncate, kExisting };
  virtual Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                OpenMode mode,
                                                                uint32_t permissions = 0644) = 0;
  // The permission bits (st_mode & 07777) of `path`, following symlinks. NotFound when
  // there is nothing there.
  virtual Result<uint32_t> FileMode(const std::string& path) = 0;
  // Creates a new directory "<TMPDIR or /tmp>/<prefix>XXXXXX" and returns its path.
  virtual Result<std::string> MakeTempDir(const std::string& prefix) = 0;
  // rename(2): atomically replaces `to` (same filesystem).
  virtual Status RenameFile(const std::string& from, const std::string& to) = 0;
  // Removes a file or an empty directory. NotFound when there is nothing there.
  virtual Status RemoveFile(const std::string& path) = 0;
  // Removes `path` and everything under it; OK when there is nothing there.
  virtual Status RemoveAll(const std::string& path) = 0;
  // fsyncs the directory itself, so that a rename into it (or out of it), a file created
  // or removed in it, survives a crash.
  virtual Status SyncDir(const std::string& dir) = 0;
  // Creates `dir` and any missing parents (mode 0755 & ~umask), syncing the parent of each
  // directory it creates, so they survive a crash once this returns. OK when `dir` is a
  // directory already; IOError when something else is there.
  virtual Status CreateDirs(const std::string& dir) = 0;
  virtual bool IsDirectory(const std::string& path) = 0;
  // Creates `path` if missing and takes an exclusive flock(2) on it, held until the
  // returned object is destroyed (or the process exits). Unavailable when another holder
  // (this process or another) has it. For "one writer per state directory".
  class FileLock {
   public:
    virtual ~FileLock() = default;
  };
  virtual Result<std::unique_ptr<FileLock>> LockFile(const std::string& path) = 0;
  // The names in `dir` (no "." or ".."), sorted.
  virtual Result<std::vector<std::string>> ListDir(const std::string& dir) = 0;
  virtual bool FileExists(const std::string& path) = 0;

  // ---- Clocks. ----

  // Wall-clock time, microseconds since the Unix epoch. For timestamps that cross
  // processes or machines; not for measuring intervals (it may step).
  virtual int64_t NowMicros() = 0;
  // Monotonic time, for deadlines, leases and intervals within this process.
  virtual SteadyTime SteadyNow() = 0;
  virtual void SleepFor(std::chrono::microseconds duration) = 0;
  // Waits on `cv` (as cv.wait_until with `lock` held) until notified or until SteadyNow()
  // reaches `deadline`. May return early, like any condition-variable wait: callers
  // re-check their predicate and the deadline in a loop.
  virtual void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                         SteadyTime deadline) = 0;
};

// Wall-clock microseconds since the Unix epoch from Env::Default(): the process's one wall
// clock, for code that holds no Env (timestamps in status documents, ledgers, heartbeats).
// Code that a test must drive takes an Env* and calls its NowMicros() instead.
inline int64_t UnixMicrosNow() { return Env::Default()->NowMicros(); }

// Forwards every call to another Env. Derive from it and override the calls to intercept
// (fault injection, counting, a different clock).
class EnvWrapper : public Env {
 public:
  // REQUIRES: `target` outlives this wrapper.
  explicit EnvWrapper(Env* target) : target_(target) {}
  Env* target() const { return target_; }

  Result<std::vector<std::byte>> ReadFile(const std::string& path) override {
    return target_->ReadFile(path);
  }
  Result<std::unique_ptr<MappedRegion>> MapReadOnly(const std::string& path) override {
    return target_->MapReadOnly(path);
  }
  Result<std::unique_ptr<WritableFile>> NewTempFile(
      const std::string& path, std::optional<uint32_t> permissions = std::nullopt) override {
    return target_->NewTempFile(path, permissions);
  }
  Result<std::unique_ptr<WritableFile>> NewAppendableFile(const std::string& path) override {
    return target_->NewAppendableFile(path);
  }
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path, OpenMode mode,
                                                        uint32_t permissions) override {
    return target_->NewWritableFile(path, mode, permissions);
  }
  Result<uint32_t> FileMode(const std::string& path) override { return target_->FileMode(path); }
  Result<std::string> MakeTempDir(const std::string& prefix) override {
    return target_->MakeTempDir(prefix);
  }
  Status RenameFile(const std::string& from, const std::string& to) override {
    return target_->RenameFile(from, to);
  }
  Status RemoveFile(const std::string& path) override { return target_->RemoveFile(path); }
  Status RemoveAll(const std::string& path) override { return target_->RemoveAll(path); }
  Status SyncDir(const std::string& dir) override { return target_->SyncDir(dir); }
  Status CreateDirs(const std::string& dir) override { return target_->CreateDirs(dir); }
  bool IsDirectory(const std::string& path) override { return target_->IsDirectory(path); }
  Result<std::unique_ptr<FileLock>> LockFile(const std::string& path) override {
    return target_->LockFile(path);
  }
  Result<std::vector<std::string>> ListDir(const std::string& dir) override {
    return target_->ListDir(dir);
  }
  bool FileExists(const std::string& path) override { return target_->FileExists(path); }

  int64_t NowMicros() override { return target_->NowMicros(); }
  SteadyTime SteadyNow() override { return target_->SteadyNow(); }
  void SleepFor(std::chrono::microseconds duration) override { target_->SleepFor(duration); }
  void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 SteadyTime deadline) override {
    target_->WaitUntil(cv, lock, deadline);
  }

 private:
  Env* target_;
};

// An Env for tests whose clocks stand still until Advance() moves them; files go to
// `target`. Both clocks move together: NowMicros() starts at `start_unix_micros`,
// SteadyNow() at an arbitrary fixed point.
//
// SleepFor blocks until other threads have advanced the clock by the duration (as absl's
// SimulatedClock does), so a sleep on a clock nobody drives never returns. WaitUntil
// returns at once when the deadline has passed; otherwise it waits on the condition
// variable for at most a millisecond of real time, so that the caller's loop re-reads the
// clock and sees a deadline that another thread advanced past.
class ManualClock : public EnvWrapper {
 public:
  explicit ManualClock(int64_t start_unix_micros = 1'700'000'000'000'000,
                       Env* target = Env::Default());

  // Moves both clocks forward and wakes sleepers whose time has come.
  // REQUIRES: duration >= 0.
  void Advance(std::chrono::microseconds duration);

  int64_t NowMicros() override;
  SteadyTime SteadyNow() override;
  void SleepFor(std::chrono::microseconds duration) override;
  void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 SteadyTime deadline) override;

 private:
  const int64_t start_unix_micros_;
  std::mutex mutex_;
  std::condition_variable advanced_;
  std::chrono::microseconds elapsed_{0};  // GUARDED_BY(mutex_)
};

// Writes a file atomically and durably: the bytes go to a temporary file beside `path`
// (Env::NewTempFile), which Commit() fsyncs, closes, renames over `path`, and then fsyncs
// the directory; Commit() returns OK only once the new contents and the name are both on
// stable storage (a power cut after it returns leaves the new file, one before it either
// the old file or the new one, whole). Until Commit() succeeds `path` is untouched; a
// failed or abandoned AtomicFile removes its temporary file. Move-only.
class AtomicFile {
 public:
  AtomicFile() = default;  // holds nothing; Commit() fails
  // `permissions`: the new file's mode exactly (a key: 0600); default 0666 & ~umask.
  static Result<AtomicFile> Create(const std::string& path, Env* env = Env::Default(),
                                   std::optional<uint32_t> permissions = std::nullopt);
  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() { Abandon(); }

  // REQUIRES: is_open()
  Status Append(std::span<const std::byte> bytes) { return file_->Append(bytes); }
  // Sync, close, rename over the destination, sync the directory. On failure before the
  // rename the temporary file is removed and the destination is as it was. Afterwards the
  // AtomicFile holds nothing (a second Commit is InvalidArgument).
  Status Commit();
  // Closes and removes the temporary file (errors ignored); holds nothing afterwards.
  void Abandon();

  bool is_open() const { return file_ != nullptr; }
  const std::string& path() const { return path_; }  // the destination
  // REQUIRES: is_open()
  WritableFile& file() { return *file_; }

 private:
  Env* env_ = nullptr;
  std::string path_;
  std::unique_ptr<WritableFile> file_;
};

// AtomicFile::Create, Append, Commit.
Status WriteFileAtomically(const std::string& path, std::span<const std::byte> bytes,
                           Env* env = Env::Default(),
                           std::optional<uint32_t> permissions = std::nullopt);

// Removes the file at `path` and syncs its directory, so that the removal survives a
// crash. OK when there was nothing there.
Status RemoveFileDurably(const std::string& path, Env* env = Env::Default());

// The directory part of `path` ("." when it has none, "/" for a file at the root).
std::string DirName(const std::string& path);

// Checks that the file at `path` holds a secret only its owner can read (a bearer token),
// as ssh checks a private key: InvalidArgument when group or others have any access
// (mode & 077), with a message naming `what` (the flag it came from), the file, its mode
// and the chmod that fixes it; NotFound / IOError when it cannot be examined.
Status CheckPrivateFile(const std::string& path, std::string_view what, Env* env = Env::Default());

}  // namespace flywheel
