#include "delta/delta_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <unordered_map>

#include "delta/parallel.h"
#include "delta/safetensors.h"

namespace flywheel::delta {
namespace {

std::string Errno(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

std::string DirOf(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string TempNameFor(const std::string& path) {
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  std::random_device rd;
  return dir + "." + base + ".tmp-" + std::to_string(getpid()) + "-" + std::to_string(rd());
}

Result<FileEncodeStats> EncodeToFile(const Checkpoint* base, const Checkpoint& target,
                                     const std::string& out_path, EncodeOptions options) {
  std::map<std::string, std::string> metadata = target.metadata();
  for (const auto& [k, v] : options.metadata) metadata[k] = v;
  options.metadata = std::move(metadata);
  auto bytes = base ? Encode(base->tensors(), target.tensors(), options)
                    : EncodeKeyframe(target.tensors(), options);
  if (!bytes.ok()) return bytes.status();
  auto view = DeltaView::Parse(*bytes);
  if (!view.ok())
    return Status::Internal("encoder produced an unreadable delta: " + view.status().message());
  FW_RETURN_IF_ERROR(WriteFileAtomically(out_path, *bytes));
  FileEncodeStats stats;
  stats.checkpoint_bytes = view->manifest().total_bytes();
  stats.delta_bytes = bytes->size();
  stats.changed_words = view->manifest().changed_words();
  stats.total_words = view->manifest().total_words();
  stats.base_hash = view->manifest().base_hash;
  stats.target_hash = view->manifest().target_hash;
  return stats;
}

}  // namespace

Status WriteFileAtomically(const std::string& path, std::span<const std::byte> bytes) {
  const std::string temp = TempNameFor(path);
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(Errno("cannot create", temp));
  auto fail = [&](const std::string& what) {
    Status st = Status::IOError(Errno(what, temp));
    ::close(fd);
    ::unlink(temp.c_str());
    return st;
  };
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) errno = EIO;
    if (n <= 0) return fail("cannot write");
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) return fail("cannot fsync");
  if (::close(fd) != 0) {
    ::unlink(temp.c_str());
    return Status::IOError(Errno("cannot close", temp));
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    Status st = Status::IOError(Errno("cannot rename to", path));
    ::unlink(temp.c_str());
    return st;
  }
  int dir = ::open(DirOf(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
  return Status::Ok();
}

Result<std::vector<std::byte>> ReadDeltaFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return errno == ENOENT ? Status::NotFound(Errno("cannot open", path))
                           : Status::IOError(Errno("cannot open", path));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::IOError(path + " is not a regular file");
  }
  std::vector<std::byte> bytes;
  try {
    bytes.resize(static_cast<size_t>(st.st_size));
  } catch (const std::bad_alloc&) {
    ::close(fd);
    return Status::ResourceExhausted("cannot hold " + path + " (" + std::to_string(st.st_size) +
                                     " bytes) in memory");
  }
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      Status s = Status::IOError(Errno("cannot read", path));
      ::close(fd);
      return s;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (done != bytes.size()) return Status::IOError(path + " changed size while being read");
  return bytes;
}

Result<FileEncodeStats> EncodeFiles(const std::string& base_path, const std::string& target_path,
                                    const std::string& out_path, EncodeOptions options) {
  auto base = Checkpoint::Open(base_path);
  if (!base.ok()) return base.status();
  auto target = Checkpoint::Open(target_path);
  if (!target.ok()) return target.status();
  return EncodeToFile(&*base, *target, out_path, std::move(options));
}

Result<FileEncodeStats> EncodeKeyframeFile(const std::string& target_path,
                                           const std::string& out_path, EncodeOptions options) {
  auto target = Checkpoint::Open(target_path);
  if (!target.ok()) return target.status();
  return EncodeToFile(nullptr, *target, out_path, std::move(options));
}

Result<FileApplyStats> ApplyFiles(const std::string& base_path, const std::string& delta_path,
                                  const std::string& out_path, const ApplyOptions& options) {
  auto mapped = MappedFile::Open(delta_path);
  if (!mapped.ok()) return mapped.status();
  auto view = DeltaView::Parse(mapped->bytes());
  if (!view.ok()) return view.status().WithContext(delta_path);
  const Manifest& m = view->manifest();
  if (!m.keyframe && base_path.empty()) {
    return Status::InvalidArgument(delta_path + " is a delta from version " +
                                   std::to_string(m.base_version) + ": it needs a base checkpoint");
  }

  // Check the base against the manifest before anything is written or reserved on disk.
  std::optional<Checkpoint> base;
  std::vector<size_t> source(m.tensors.size());
  if (!m.keyframe) {
    auto opened = Checkpoint::Open(base_path);
    if (!opened.ok()) return opened.status();
    base.emplace(std::move(*opened));
    const CheckpointView& b = base->tensors();
    if (b.size() != m.tensors.size()) {
      return Status::Mismatch("refusing to apply: base " + base_path + " has " +
                              std::to_string(b.size()) + " tensors, the delta's base has " +
                              std::to_string(m.tensors.size()));
    }
    std::unordered_map<std::string_view, size_t> by_name;
    for (size_t i = 0; i < b.size(); ++i) by_name.emplace(b[i].name, i);
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      const TensorEntry& t = m.tensors[i];
      auto it = by_name.find(t.name);
      if (it == by_name.end()) {
        return Status::Mismatch("refusing to apply: base " + base_path + " has no tensor '" +
                                t.name + "'");
      }
      const TensorView& bt = b[it->second];
      if (bt.data.size() != t.byte_size || bt.dtype != t.dtype || bt.shape != t.shape) {
        return Status::Mismatch("refusing to apply: tensor '" + t.name + "' of base " + base_path +
                                " differs in dtype or shape from the delta's");
      }
      source[i] = it->second;
    }
  }

  CheckpointView layout;
  for (const TensorEntry& t : m.tensors) layout.push_back({t.name, t.dtype, t.shape, {}});
  auto writer = SafetensorsWriter::Create(out_path, layout, m.metadata);
  if (!writer.ok()) return writer.status();
  MutableCheckpointView& out = writer->tensors();
  ApplyOptions inner = options;
  inner.restore_on_failure = false;   // the output is a scratch file until Commit
  inner.state_tensor_hashes.clear();  // hash what is really in the file
  if (base) {
    const CheckpointView& b = base->tensors();
    ParallelFor(out.size(), std::clamp(options.threads, 1, kMaxThreads), [&](size_t i) {
      if (!out[i].data.empty()) {
        std::memcpy(out[i].data.data(), b[source[i]].data.data(), out[i].data.size());
      }
    });
  }
  auto applied = ApplyInPlace(out, *view, inner);
  if (!applied.ok()) return applied.status();
  FW_RETURN_IF_ERROR(writer->Commit());
  FileApplyStats stats;
  stats.target_version = m.target_version;
  stats.target_hash = m.target_hash;
  stats.changed_words = m.changed_words();
  return stats;
}

Result<DeltaSummary> InspectDeltaFile(const std::string& path) {
  FW_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, ReadDeltaFile(path));
  FW_ASSIGN_OR_RETURN(DeltaView view, DeltaView::Parse(bytes));
  return SummarizeDelta(view);
}

}  // namespace flywheel::delta
