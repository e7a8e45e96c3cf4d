#include "base/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>
#include <random>
#include <thread>
#include <utility>

namespace flywheel {

Status ErrnoStatus(std::string_view what, const std::string& path, int err) {
  // strerror_r (the GNU form, which returns the text) because strerror may share one
  // buffer between threads.
  char buffer[256];
  const char* text = ::strerror_r(err, buffer, sizeof(buffer));
  std::string message = path + ": " + std::string(what) + ": " + text;
  if (err == ENOENT) return Status::NotFound(std::move(message));
  if (err == ENOSPC || err == EDQUOT) return Status::ResourceExhausted(std::move(message));
  return Status::IOError(std::move(message));
}

namespace {

// Splits `path` into its directory ("." when none) and file name.
Result<std::pair<std::string, std::string>> SplitPath(const std::string& path) {
  const size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (dir.empty()) dir = "/";
  if (name.empty() || name == "." || name == "..") {
    return Status::InvalidArgument(path + ": not a file path");
  }
  return std::make_pair(std::move(dir), std::move(name));
}

// pwrite(2) of all of `bytes` at `offset` (short writes and EINTR retried).
Status PwriteAll(int fd, const std::string& path, uint64_t offset,
                 std::span<const std::byte> bytes) {
  if (fd < 0) return Status::IOError(path + ": write at an offset: the file is not open");
  size_t done = 0;
  while (done < bytes.size()) {
    const size_t chunk = std::min<size_t>(bytes.size() - done, size_t{1} << 30);
    const ssize_t written =
        ::pwrite(fd, bytes.data() + done, chunk, static_cast<off_t>(offset + done));
    if (written < 0) {
      const int error = errno;
      if (error == EINTR) continue;
      return ErrnoStatus("write at offset " + std::to_string(offset + done), path, error);
    }
    if (written == 0) return ErrnoStatus("write", path, EIO);
    done += static_cast<size_t>(written);
  }
  return Status::Ok();
}

Status FallocateAll(int fd, const std::string& path, uint64_t size) {
  if (fd < 0) return Status::IOError(path + ": allocate: the file is not open");
  if (size == 0) return Status::Ok();
  // posix_fallocate returns the error instead of setting errno.
  const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (error != 0) return ErrnoStatus("allocate " + std::to_string(size) + " bytes", path, error);
  return Status::Ok();
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  Status Append(std::span<const std::byte> bytes) override {
    const std::byte* cursor = bytes.data();
    size_t left = bytes.size();
    while (left > 0) {
      // At most 1 GiB per call: Linux writes no more than about 2 GiB at once anyway.
      const ssize_t written = ::write(fd_, cursor, std::min<size_t>(left, size_t{1} << 30));
      if (written < 0) {
        const int error = errno;
        if (error == EINTR) continue;
        return ErrnoStatus("write", path_, error);
      }
      if (written == 0) return ErrnoStatus("write", path_, EIO);
      cursor += written;
      left -= static_cast<size_t>(written);
    }
    return Status::Ok();
  }

  Status WriteAt(uint64_t offset, std::span<const std::byte> bytes) override {
    return PwriteAll(fd_, path_, offset, bytes);
  }
  Status Allocate(uint64_t size) override { return FallocateAll(fd_, path_, size); }

  Status Sync() override {
    if (::fsync(fd_) != 0) return ErrnoStatus("fsync", path_, errno);
    return Status::Ok();
  }

  Status Close() override {
    // close(2) releases the descriptor even when it reports an error: never retry it.
    if (::close(std::exchange(fd_, -1)) != 0) return ErrnoStatus("close", path_, errno);
    return Status::Ok();
  }

  const std::string& path() const override { return path_; }
  int fd() const override { return fd_; }

 private:
  std::string path_;
  int fd_;
};

class PosixMappedRegion final : public MappedRegion {
 public:
  PosixMappedRegion(void* data, size_t size) : data_(data), size_(size) {}
  ~PosixMappedRegion() override {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  std::span<const std::byte> bytes() const override {
    return {static_cast<const std::byte*>(data_), size_};
  }
  void Release(std::span<const std::byte> range) const override {
    if (data_ == nullptr || range.empty()) return;
    static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t map_begin = reinterpret_cast<uintptr_t>(data_);
    const uintptr_t begin =
        std::max(reinterpret_cast<uintptr_t>(range.data()), map_begin) & ~(page - 1);
    const uintptr_t end =
        std::min(reinterpret_cast<uintptr_t>(range.data()) + range.size(), map_begin + size_);
    if (end <= begin) return;
    // Only advice: on failure the pages stay resident, which costs memory, not correctness.
    ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }

 private:
  void* data_;
  size_t size_;
};

// Closes a descriptor on every return path.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

class PosixFileLock final : public Env::FileLock {
 public:
  explicit PosixFileLock(int fd) : fd_(fd) {}
  ~PosixFileLock() override { ::close(fd_); }  // closing releases the flock

 private:
  int fd_;
};

int OpenFlags(Env::OpenMode mode) {
  switch (mode) {
    case Env::OpenMode::kCreateNew:
      return O_WRONLY | O_CREAT | O_EXCL;
    case Env::OpenMode::kTruncate:
      return O_WRONLY | O_CREAT | O_TRUNC;
    case Env::OpenMode::kExisting:
      return O_WRONLY;
  }
  return O_WRONLY;
}

// Opens `path` read-only and checks that it is a regular file; returns its size.
Result<size_t> OpenRegular(const std::string& path, int& fd_out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("open", path, errno);
  fd_out = fd;
  struct stat info;
  if (::fstat(fd, &info) != 0) return ErrnoStatus("stat", path, errno);
  if (!S_ISREG(info.st_mode)) return Status::IOError(path + ": not a regular file");
  return static_cast<size_t>(info.st_size);
}

class PosixEnv final : public Env {
 public:
  Result<std::vector<std::byte>> ReadFile(const std::string& path) override {
    int raw_fd = -1;
    Result<size_t> size = OpenRegular(path, raw_fd);
    ScopedFd fd(raw_fd);
    if (!size.ok()) return size.status();
    std::vector<std::byte> bytes;
    try {
      bytes.resize(*size);
    } catch (const std::bad_alloc&) {
      return Status::ResourceExhausted(path + ": cannot hold " + std::to_string(*size) +
                                       " bytes in memory");
    }
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
      if (n < 0) {
        const int error = errno;
        if (error == EINTR) continue;
        return ErrnoStatus("read", path, error);
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    if (done != bytes.size()) return Status::IOError(path + ": changed size while being read");
    return bytes;
  }

  Result<std::unique_ptr<MappedRegion>> MapReadOnly(const std::string& path) override {
    int raw_fd = -1;
    Result<size_t> size = OpenRegular(path, raw_fd);
    ScopedFd fd(raw_fd);  // the mapping outlives the descriptor
    if (!size.ok()) return size.status();
    if (*size == 0) return std::unique_ptr<MappedRegion>(new PosixMappedRegion(nullptr, 0));
    void* map = ::mmap(nullptr, *size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (map == MAP_FAILED) return ErrnoStatus("mmap", path, errno);
    return std::unique_ptr<MappedRegion>(new PosixMappedRegion(map, *size));
  }

  Result<std::unique_ptr<WritableFile>> NewTempFile(const std::string& path,
                                                    std::optional<uint32_t> permissions) override {
    FW_ASSIGN_OR_RETURN(auto parts, SplitPath(path));
    static std::mutex generator_mutex;
    static std::mt19937_64 generator{std::random_device{}()};
    const std::string prefix = (parts.first == "/" ? "" : parts.first) + "/." + parts.second +
                               ".tmp-" + std::to_string(::getpid()) + "-";
    // O_EXCL makes a name collision (another writer, a leftover) an EEXIST: try another.
    for (int attempt = 0; attempt < 16; ++attempt) {
      uint64_t random = 0;
      {
        std::lock_guard lock(generator_mutex);
        random = generator();
      }
      char suffix[16];
      std::snprintf(suffix, sizeof(suffix), "%08x", static_cast<uint32_t>(random));
      std::string temp = prefix + suffix;
      const int fd = ::open(temp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd >= 0) {
        auto file = std::make_unique<PosixWritableFile>(std::move(temp), fd);
        if (permissions && ::fchmod(fd, *permissions & 07777) != 0) {
          const int error = errno;
          (void)::unlink(file->path().c_str());
          return ErrnoStatus("chmod", file->path(), error);
        }
        return std::unique_ptr<WritableFile>(std::move(file));
      }
      const int error = errno;
      if (error != EEXIST) return ErrnoStatus("create temporary file", parts.first, error);
    }
    return Status::IOError(path + ": could not find a free temporary file name");
  }

  Result<std::unique_ptr<WritableFile>> NewAppendableFile(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoStatus("open for appending", path, errno);
    return std::unique_ptr<WritableFile>(new PosixWritableFile(path, fd));
  }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path, OpenMode mode,
                                                        uint32_t permissions) override {
    const int fd = ::open(path.c_str(), OpenFlags(mode) | O_CLOEXEC, permissions & 07777);
    if (fd < 0) return ErrnoStatus("open for writing", path, errno);
    auto file = std::make_unique<PosixWritableFile>(path, fd);
    if (mode == OpenMode::kCreateNew && ::fchmod(fd, permissions & 07777) != 0) {
      return ErrnoStatus("chmod", path, errno);
    }
    return std::unique_ptr<WritableFile>(std::move(file));
  }

  Result<uint32_t> FileMode(const std::string& path) override {
    struct stat info;
    if (::stat(path.c_str(), &info) != 0) return ErrnoStatus("stat", path, errno);
    return static_cast<uint32_t>(info.st_mode & 07777);
  }

  Result<std::string> MakeTempDir(const std::string& prefix) override {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string base = tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
    std::string pattern = base + "/" + prefix + "XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      return ErrnoStatus("create temporary directory", pattern, errno);
    }
    return pattern;
  }

  Status RenameFile(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      const int error = errno;  // before building the message, which allocates
      return ErrnoStatus("rename to " + to, from, error);
    }
    return Status::Ok();
  }

  Status RemoveFile(const std::string& path) override {
    if (::remove(path.c_str()) != 0) return ErrnoStatus("remove", path, errno);
    return Status::Ok();
  }

  Status RemoveAll(const std::string& path) override {
    std::error_code error;
    std::filesystem::remove_all(path, error);
    if (error) return ErrnoStatus("remove recursively", path, error.value());
    return Status::Ok();
  }

  Status SyncDir(const std::string& dir) override {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open directory for fsync", dir, errno);
    ScopedFd closer(fd);
    if (::fsync(fd) != 0) return ErrnoStatus("fsync directory", dir, errno);
    return Status::Ok();
  }

  Status CreateDirs(const std::string& dir) override {
    if (dir.empty()) return Status::InvalidArgument("create directory: empty path");
    if (IsDirectory(dir)) return Status::Ok();
    const std::string parent = DirName(dir);
    if (parent != dir) FW_RETURN_IF_ERROR(CreateDirs(parent));
    if (::mkdir(dir.c_str(), 0755) != 0) {
      const int error = errno;
      if (error != EEXIST || !IsDirectory(dir)) return ErrnoStatus("create directory", dir, error);
      return Status::Ok();  // another thread or process made it meanwhile
    }
    return SyncDir(parent);
  }

  bool IsDirectory(const std::string& path) override {
    struct stat info;
    return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
  }

  Result<std::unique_ptr<FileLock>> LockFile(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoStatus("open lock file", path, errno);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      ::close(fd);
      if (error == EWOULDBLOCK) {
        return Status::Unavailable(path + ": locked by another holder (another process, or "
                                          "another object in this one)");
      }
      return ErrnoStatus("lock", path, error);
    }
    return std::unique_ptr<FileLock>(new PosixFileLock(fd));
  }

  Result<std::vector<std::string>> ListDir(const std::string& dir) override {
    DIR* handle = ::opendir(dir.c_str());
    if (handle == nullptr) return ErrnoStatus("list directory", dir, errno);
    std::vector<std::string> names;
    for (;;) {
      errno = 0;
      const dirent* entry = ::readdir(handle);
      if (entry == nullptr) break;
      const std::string_view name = entry->d_name;
      if (name != "." && name != "..") names.emplace_back(name);
    }
    const int error = errno;
    ::closedir(handle);
    if (error != 0) return ErrnoStatus("list directory", dir, error);
    std::sort(names.begin(), names.end());
    return names;
  }

  bool FileExists(const std::string& path) override {
    struct stat info;
    return ::stat(path.c_str(), &info) == 0;
  }

  int64_t NowMicros() override {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  SteadyTime SteadyNow() override { return std::chrono::steady_clock::now(); }
  void SleepFor(std::chrono::microseconds duration) override {
    std::this_thread::sleep_for(duration);
  }
  void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 SteadyTime deadline) override {
    cv.wait_until(lock, deadline);
  }
};

}  // namespace

Env* Env::Default() {
  // Leaked on purpose: it may be used from other static destructors and detached threads.
  static Env* const env = new PosixEnv;
  return env;
}

// ---------------------------------------------------------------------------------------
// ManualClock

ManualClock::ManualClock(int64_t start_unix_micros, Env* target)
    : EnvWrapper(target), start_unix_micros_(start_unix_micros) {}

void ManualClock::Advance(std::chrono::microseconds duration) {
  {
    std::lock_guard lock(mutex_);
    elapsed_ += duration;
  }
  advanced_.notify_all();
}

int64_t ManualClock::NowMicros() {
  std::lock_guard lock(mutex_);
  return start_unix_micros_ + elapsed_.count();
}

SteadyTime ManualClock::SteadyNow() {
  std::lock_guard lock(mutex_);
  // An hour past the steady epoch, so that "now - 5 s" is still a valid time point.
  return SteadyTime(std::chrono::hours(1) + elapsed_);
}

void ManualClock::SleepFor(std::chrono::microseconds duration) {
  std::unique_lock lock(mutex_);
  const std::chrono::microseconds wake = elapsed_ + duration;
  advanced_.wait(lock, [&] { return elapsed_ >= wake; });
}

void ManualClock::WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                            SteadyTime deadline) {
  if (SteadyNow() >= deadline) return;
  cv.wait_for(lock, std::chrono::milliseconds(1));
}

// ---------------------------------------------------------------------------------------
// AtomicFile

Result<AtomicFile> AtomicFile::Create(const std::string& path, Env* env,
                                      std::optional<uint32_t> permissions) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, env->NewTempFile(path, permissions));
  AtomicFile atomic;
  atomic.env_ = env;
  atomic.path_ = path;
  atomic.file_ = std::move(file);
  return atomic;
}

AtomicFile::AtomicFile(AtomicFile&& other) noexcept {
  *this = std::move(other);
}

AtomicFile& AtomicFile::operator=(AtomicFile&& other) noexcept {
  if (this != &other) {
    Abandon();
    env_ = other.env_;
    path_ = std::move(other.path_);
    file_ = std::move(other.file_);
  }
  return *this;
}

void AtomicFile::Abandon() {
  if (file_ == nullptr) return;
  const std::string temp = file_->path();
  file_.reset();  // closes the descriptor
  (void)env_->RemoveFile(temp);
}

Status AtomicFile::Commit() {
  if (file_ == nullptr) {
    return Status::InvalidArgument(path_ + ": commit of an atomic file that is not open "
                                           "(already committed, abandoned or moved from)");
  }
  Status status = file_->Sync();
  if (status.ok()) status = file_->Close();
  if (status.ok()) status = env_->RenameFile(file_->path(), path_);
  if (!status.ok()) {
    Abandon();
    return status;
  }
  file_.reset();  // renamed: nothing left to remove
  return env_->SyncDir(DirName(path_));
}

Status WriteFileAtomically(const std::string& path, std::span<const std::byte> bytes, Env* env,
                           std::optional<uint32_t> permissions) {
  FW_ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(path, env, permissions));
  FW_RETURN_IF_ERROR(file.Append(bytes));
  return file.Commit();
}

Status RemoveFileDurably(const std::string& path, Env* env) {
  Status removed = env->RemoveFile(path);
  if (removed.code() == StatusCode::kNotFound) return Status::Ok();
  FW_RETURN_IF_ERROR(removed);
  return env->SyncDir(DirName(path));
}

std::string DirName(const std::string& path) {
  const size_t slash = path.find_last_not_of('/') == std::string::npos
                           ? std::string::npos
                           : path.rfind('/', path.find_last_not_of('/'));
  if (slash == std::string::npos) return path.starts_with('/') ? "/" : ".";
  const size_t end = path.find_last_not_of('/', slash);
  return end == std::string::npos ? "/" : path.substr(0, end + 1);
}

Status WritableFile::WriteAt(uint64_t offset, std::span<const std::byte> bytes) {
  return PwriteAll(fd(), path(), offset, bytes);
}

Status WritableFile::Allocate(uint64_t size) { return FallocateAll(fd(), path(), size); }

void MappedReleaser::Done(std::span<const std::byte> bytes) {
  const uint64_t before = done_bytes_.fetch_add(bytes.size());
  if (before / slice_bytes_ != (before + bytes.size()) / slice_bytes_) ReleaseAll();
}

Status CheckPrivateFile(const std::string& path, std::string_view what, Env* env) {
  FW_ASSIGN_OR_RETURN(const uint32_t mode, env->FileMode(path));
  if ((mode & 077) == 0) return Status::Ok();
  char octal[8];
  std::snprintf(octal, sizeof(octal), "%04o", static_cast<unsigned>(mode));
  return Status::InvalidArgument(std::string(what) + " " + path + " has mode " + octal +
                                 ": group or others can access it, and it holds a secret; "
                                 "make it private with: chmod 600 " + path);
}

}  // namespace flywheel
