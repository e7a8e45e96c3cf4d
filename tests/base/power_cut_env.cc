#include "tests/base/power_cut_env.h"

#include <sys/stat.h>
#include <unistd.h>

#include <utility>
#include <vector>

namespace flywheel {
namespace {

std::string Text(const std::vector<std::byte>& bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// Every call a file makes is a step; a synced file's bytes become durable.
class PowerCutFile final : public WritableFile {
 public:
  PowerCutFile(PowerCutEnv* env, std::unique_ptr<WritableFile> file)
      : env_(env), file_(std::move(file)) {}

  Status Append(std::span<const std::byte> bytes) override {
    FW_RETURN_IF_ERROR(env_->Step("write", path()));
    return file_->Append(bytes);
  }
  Status WriteAt(uint64_t offset, std::span<const std::byte> bytes) override {
    FW_RETURN_IF_ERROR(env_->Step("write at an offset", path()));
    return file_->WriteAt(offset, bytes);
  }
  Status Allocate(uint64_t size) override {
    FW_RETURN_IF_ERROR(env_->Step("allocate", path()));
    return file_->Allocate(size);
  }
  Status Sync() override {
    FW_RETURN_IF_ERROR(env_->Step("fsync", path()));
    FW_RETURN_IF_ERROR(file_->Sync());
    env_->NoteSynced(file_->fd());
    return Status::Ok();
  }
  Status Close() override {
    // The descriptor is released either way, as close(2) does.
    Status cut = env_->Step("close", path());
    Status closed = file_->Close();
    return cut.ok() ? closed : cut;
  }
  const std::string& path() const override { return file_->path(); }
  int fd() const override { return file_->fd(); }

 private:
  PowerCutEnv* env_;
  std::unique_ptr<WritableFile> file_;
};

}  // namespace

PowerCutEnv::PowerCutEnv(std::string root, Env* target)
    : EnvWrapper(target), root_(std::move(root)) {
  std::lock_guard lock(mu_);
  Snapshot(root_);
}

void PowerCutEnv::CutAt(int64_t step) {
  std::lock_guard lock(mu_);
  cut_at_ = step;
}

int64_t PowerCutEnv::steps() const {
  std::lock_guard lock(mu_);
  return steps_;
}

bool PowerCutEnv::was_cut() const {
  std::lock_guard lock(mu_);
  return was_cut_;
}

Status PowerCutEnv::Step(const std::string& what, const std::string& path) {
  std::lock_guard lock(mu_);
  const int64_t step = steps_++;
  if (cut_at_ < 0 || step < cut_at_) return Status::Ok();
  was_cut_ = true;
  return Status::IOError(path + ": " + what + ": power cut (step " + std::to_string(step) + ")");
}

std::optional<PowerCutEnv::Entry> PowerCutEnv::EntryOf(const std::string& path) {
  struct stat info;
  if (::lstat(path.c_str(), &info) != 0) return std::nullopt;
  auto [it, inserted] = id_of_inode_.try_emplace(info.st_ino, next_id_);
  if (inserted) ++next_id_;
  return Entry{it->second, S_ISDIR(info.st_mode)};
}

void PowerCutEnv::NewIdentity(const std::string& path) {
  struct stat info;
  if (::lstat(path.c_str(), &info) == 0) id_of_inode_[info.st_ino] = next_id_++;
}

void PowerCutEnv::Forget(const std::string& path) {
  struct stat info;
  if (::lstat(path.c_str(), &info) != 0) return;
  if (S_ISDIR(info.st_mode)) {
    Result<std::vector<std::string>> names = target()->ListDir(path);
    if (names.ok()) {
      for (const std::string& name : *names) Forget(path + "/" + name);
    }
  } else if (info.st_nlink > 1) {
    return;  // another name still holds the inode
  }
  id_of_inode_.erase(info.st_ino);
}

void PowerCutEnv::RecordListing(const std::string& dir) {
  const std::optional<Entry> self = EntryOf(dir);
  Result<std::vector<std::string>> names = target()->ListDir(dir);
  if (!self || !names.ok()) return;
  Listing listing;
  for (const std::string& name : *names) {
    if (std::optional<Entry> entry = EntryOf(dir + "/" + name)) listing[name] = *entry;
  }
  listings_[self->id] = std::move(listing);
}

void PowerCutEnv::Snapshot(const std::string& dir) {
  if (dir == root_) {
    id_of_inode_.clear();
    contents_.clear();
    listings_.clear();
    root_id_ = EntryOf(root_)->id;
  }
  CurrentContents(dir, &contents_, /*record_listings=*/true);
}

void PowerCutEnv::NoteSynced(int fd) {
  struct stat info;
  if (fd < 0 || ::fstat(fd, &info) != 0) return;
  // Read through /proc: the descriptor may be write-only.
  Result<std::vector<std::byte>> bytes = target()->ReadFile("/proc/self/fd/" + std::to_string(fd));
  if (!bytes.ok()) return;
  std::lock_guard lock(mu_);
  auto [it, inserted] = id_of_inode_.try_emplace(info.st_ino, next_id_);
  if (inserted) ++next_id_;
  contents_[it->second] = Text(*bytes);
}

Result<std::unique_ptr<WritableFile>> PowerCutEnv::Wrap(Result<std::unique_ptr<WritableFile>> file,
                                                        bool fresh) {
  if (!file.ok()) return file.status();
  if (fresh) {
    std::lock_guard lock(mu_);
    NewIdentity((*file)->path());
  }
  return std::unique_ptr<WritableFile>(new PowerCutFile(this, std::move(*file)));
}

Result<std::unique_ptr<WritableFile>> PowerCutEnv::NewTempFile(
    const std::string& path, std::optional<uint32_t> permissions) {
  FW_RETURN_IF_ERROR(Step("create a temporary file", path));
  return Wrap(target()->NewTempFile(path, permissions), true);
}

Result<std::unique_ptr<WritableFile>> PowerCutEnv::NewAppendableFile(const std::string& path) {
  FW_RETURN_IF_ERROR(Step("open for appending", path));
  const bool fresh = !target()->FileExists(path);
  return Wrap(target()->NewAppendableFile(path), fresh);
}

Result<std::unique_ptr<WritableFile>> PowerCutEnv::NewWritableFile(const std::string& path,
                                                                   OpenMode mode,
                                                                   uint32_t permissions) {
  FW_RETURN_IF_ERROR(Step("open for writing", path));
  const bool fresh = !target()->FileExists(path);
  return Wrap(target()->NewWritableFile(path, mode, permissions), fresh);
}

Status PowerCutEnv::RenameFile(const std::string& from, const std::string& to) {
  FW_RETURN_IF_ERROR(Step("rename to " + to, from));
  std::lock_guard lock(mu_);
  struct stat source, replaced;
  if (::lstat(from.c_str(), &source) == 0 && ::lstat(to.c_str(), &replaced) == 0 &&
      source.st_ino != replaced.st_ino) {
    Forget(to);
  }
  return target()->RenameFile(from, to);
}

Status PowerCutEnv::RemoveFile(const std::string& path) {
  FW_RETURN_IF_ERROR(Step("remove", path));
  std::lock_guard lock(mu_);
  Forget(path);
  return target()->RemoveFile(path);
}

Status PowerCutEnv::RemoveAll(const std::string& path) {
  FW_RETURN_IF_ERROR(Step("remove recursively", path));
  std::lock_guard lock(mu_);
  Forget(path);
  return target()->RemoveAll(path);
}

Status PowerCutEnv::SyncDir(const std::string& dir) {
  FW_RETURN_IF_ERROR(Step("fsync directory", dir));
  FW_RETURN_IF_ERROR(target()->SyncDir(dir));
  std::lock_guard lock(mu_);
  RecordListing(dir);
  return Status::Ok();
}

Status PowerCutEnv::CreateDirs(const std::string& dir) {
  if (dir.empty() || target()->IsDirectory(dir)) return target()->CreateDirs(dir);
  const std::string parent = DirName(dir);
  if (parent != dir) FW_RETURN_IF_ERROR(CreateDirs(parent));
  // One step: mkdir, then the parent's fsync (as the real CreateDirs does).
  FW_RETURN_IF_ERROR(Step("create directory", dir));
  FW_RETURN_IF_ERROR(target()->CreateDirs(dir));
  std::lock_guard lock(mu_);
  NewIdentity(dir);
  RecordListing(parent);
  return Status::Ok();
}

void PowerCutEnv::CurrentContents(const std::string& dir, std::map<uint64_t, std::string>* out,
                                  bool record_listings) {
  if (record_listings) RecordListing(dir);
  Result<std::vector<std::string>> names = target()->ListDir(dir);
  if (!names.ok()) return;
  for (const std::string& name : *names) {
    const std::string path = dir + "/" + name;
    const std::optional<Entry> entry = EntryOf(path);
    if (!entry) continue;
    if (entry->directory) {
      CurrentContents(path, out, record_listings);
    } else if (Result<std::vector<std::byte>> bytes = target()->ReadFile(path); bytes.ok()) {
      (*out)[entry->id] = Text(*bytes);
    }
  }
}

Status PowerCutEnv::Rebuild(uint64_t dir_id, const std::string& path, Tear tear,
                            const std::map<uint64_t, std::string>& current) {
  auto listing = listings_.find(dir_id);
  if (listing == listings_.end()) return Status::Ok();  // never synced: empty
  for (const auto& [name, entry] : listing->second) {
    const std::string child = path + "/" + name;
    if (entry.directory) {
      FW_RETURN_IF_ERROR(target()->CreateDirs(child));
      FW_RETURN_IF_ERROR(Rebuild(entry.id, child, tear, current));
      continue;
    }
    auto synced = contents_.find(entry.id);
    std::string bytes = synced == contents_.end() ? std::string() : synced->second;
    auto now = current.find(entry.id);
    if (tear == Tear::kHalfOfUnsynced && now != current.end() && now->second.size() > bytes.size()) {
      bytes += now->second.substr(bytes.size(), (now->second.size() - bytes.size()) / 2);
    }
    FW_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                        target()->NewWritableFile(child, OpenMode::kTruncate, 0644));
    FW_RETURN_IF_ERROR(file->Append(std::as_bytes(std::span(bytes.data(), bytes.size()))));
    FW_RETURN_IF_ERROR(file->Close());
  }
  return Status::Ok();
}

Status PowerCutEnv::PowerCut(Tear tear) {
  std::lock_guard lock(mu_);
  std::map<uint64_t, std::string> current;
  CurrentContents(root_, &current);
  FW_ASSIGN_OR_RETURN(std::vector<std::string> names, target()->ListDir(root_));
  for (const std::string& name : names) FW_RETURN_IF_ERROR(target()->RemoveAll(root_ + "/" + name));
  FW_RETURN_IF_ERROR(Rebuild(root_id_, root_, tear, current));
  Snapshot(root_);
  steps_ = 0;
  cut_at_ = -1;
  was_cut_ = false;
  return Status::Ok();
}

}  // namespace flywheel
