// PowerCutEnv: an Env that knows what a power cut would leave of a directory tree, in the
// manner of leveldb's FaultInjectionTestEnv. It forwards to a real Env and records, for
// every file and directory under `root`, what is on stable storage:
//
//   * a file's bytes once WritableFile::Sync returned (never synced: none);
//   * a directory's entries (names, and which file or directory each one is) once SyncDir
//     returned for it, or CreateDirs synced it as the parent of a directory it made.
//
// PowerCut() then rebuilds the tree as the disk would hold it after the power went: every
// write, creation, rename and removal not yet synced is undone, so a file renamed into
// place without a directory sync is gone (or the old one is back), a file whose name was
// synced but not its bytes is empty (Tear::kHalfOfUnsynced: holds half of its unsynced
// bytes instead, a torn write), a removal not synced is undone.
//
// CutAt(n) makes the n-th mutating call (counting from 0) and every later one fail with
// IOError "power cut", as if the machine stopped there: creating, writing, allocating,
// syncing, closing a file; renaming, removing, syncing or creating directories. Reads,
// listings, locks and clocks are not steps and keep working. A test runs an operation once
// to count its steps (steps()), then once per step with the cut there.
//
// Files are told apart by inode; a file or directory made through this Env gets a new
// identity even when the kernel reuses an inode number. Everything under `root` when the
// PowerCutEnv is made (and after each PowerCut) counts as durable.
//
// Thread-safe (one lock); meant for tests of code that writes from one thread at a time.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "base/env.h"

namespace flywheel {

class PowerCutEnv : public EnvWrapper {
 public:
  enum class Tear {
    kDropUnsynced,    // unsynced bytes are lost (what fsync-ordered code must survive)
    kHalfOfUnsynced,  // half of a file's unsynced bytes made it (a torn write)
  };

  // REQUIRES: `root` is an existing directory that only this test writes.
  explicit PowerCutEnv(std::string root, Env* target = Env::Default());

  // The `step`-th mutating call from now on (0-based, counted since the last PowerCut or
  // construction) and every later one fail; -1: none does.
  void CutAt(int64_t step);
  int64_t steps() const;  // mutating calls so far
  bool was_cut() const;   // a call failed because of the cut

  // Replaces the tree under root by what the disk holds after a power cut now, then takes
  // that as the durable state, counts steps from 0 and cuts nowhere. Call it once the code
  // under test has stopped (its objects destroyed).
  Status PowerCut(Tear tear = Tear::kDropUnsynced);

  // Calls a WritableFile makes (for the file wrapper).
  Status Step(const std::string& what, const std::string& path);
  void NoteSynced(int fd);

  Result<std::unique_ptr<WritableFile>> NewTempFile(
      const std::string& path, std::optional<uint32_t> permissions = std::nullopt) override;
  Result<std::unique_ptr<WritableFile>> NewAppendableFile(const std::string& path) override;
  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path, OpenMode mode,
                                                        uint32_t permissions) override;
  Status RenameFile(const std::string& from, const std::string& to) override;
  Status RemoveFile(const std::string& path) override;
  Status RemoveAll(const std::string& path) override;
  Status SyncDir(const std::string& dir) override;
  Status CreateDirs(const std::string& dir) override;

 private:
  struct Entry {
    uint64_t id = 0;
    bool directory = false;
  };
  using Listing = std::map<std::string, Entry>;

  // REQUIRES: mu_ held, for all below.
  std::optional<Entry> EntryOf(const std::string& path);  // lstat; assigns unknown inodes an id
  void NewIdentity(const std::string& path);  // a file or directory this Env just made
  void Forget(const std::string& path);       // about to be removed: its inode may be reused
  void RecordListing(const std::string& dir);
  void Snapshot(const std::string& dir);  // everything under dir as durable
  // The contents of every file under dir by identity; with record_listings, each directory's
  // listing is recorded as durable on the way (Snapshot).
  void CurrentContents(const std::string& dir, std::map<uint64_t, std::string>* out,
                       bool record_listings = false);
  Status Rebuild(uint64_t dir_id, const std::string& path, Tear tear,
                 const std::map<uint64_t, std::string>& current);
  Result<std::unique_ptr<WritableFile>> Wrap(Result<std::unique_ptr<WritableFile>> file,
                                             bool fresh);

  const std::string root_;
  mutable std::mutex mu_;
  int64_t steps_ = 0;        // GUARDED_BY(mu_)
  int64_t cut_at_ = -1;      // GUARDED_BY(mu_)
  bool was_cut_ = false;     // GUARDED_BY(mu_)
  uint64_t next_id_ = 1;     // GUARDED_BY(mu_)
  uint64_t root_id_ = 0;     // GUARDED_BY(mu_)
  std::map<ino_t, uint64_t> id_of_inode_;     // GUARDED_BY(mu_)
  std::map<uint64_t, std::string> contents_;  // GUARDED_BY(mu_): synced bytes per file
  std::map<uint64_t, Listing> listings_;      // GUARDED_BY(mu_): synced entries per dir
};

}  // namespace flywheel
