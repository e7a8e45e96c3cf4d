#include "delta/delta_file.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <unordered_map>

#include "checkpoint/parallel.h"
#include "checkpoint/safetensors.h"

namespace flywheel::delta {
namespace {

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

Result<std::vector<std::byte>> ReadDeltaFile(const std::string& path, Env* env) {
  return env->ReadFile(path);
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
