// safetensors reading (mmap, zero-copy views), validation and writing.
//
// Format (the public spec): u64 little-endian N, then N bytes of UTF-8 JSON, then the
// data section. The JSON maps tensor names to {"dtype", "shape", "data_offsets":[b, e]}
// (offsets relative to the data section) plus an optional "__metadata__" object of
// string to string. The reference writer pads the JSON with spaces to a multiple of 8.
//
// Validation follows the reference reader: N <= 100 MB (kMaxHeaderBytes) and within the
// file; the JSON is an object; every entry has a known dtype, non-negative dims, and
// data_offsets whose length equals dtype size x element count (overflow checked; sub-byte
// dtypes must fill whole bytes); sorted by offset the entries are contiguous from 0 with
// no gap or overlap and the last one ends exactly at end of file; no duplicate names;
// __metadata__ values are strings. Every violation is a Corruption status naming the
// file and the tensor.
//
// Sharded checkpoints: a directory (or its model.safetensors.index.json) whose
// {"weight_map": {tensor: shard_file}} names shard files in the same directory; shard
// names must not contain path separators or "..". Every tensor of every shard must be in
// the weight map and vice versa.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/env.h"
#include "base/status.h"
#include "checkpoint/tensor.h"

namespace flywheel {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// A read-only memory mapping of a whole file. Move-only; unmaps on destruction.
class MappedFile {
 public:
  // Env::MapReadOnly; errors name the path.
  static Result<MappedFile> Open(const std::string& path, Env* env = Env::Default());
  MappedFile() = default;
  MappedFile(MappedFile&&) noexcept;
  MappedFile& operator=(MappedFile&&) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const std::byte> bytes() const {
    return region_ ? region_->bytes() : std::span<const std::byte>();
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<MappedRegion> region_;
};

// A parsed safetensors image. Tensors are listed in data-offset order; their `data`
// spans point into the image (zero copy).
struct SafetensorsImage {
  std::vector<TensorView> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t header_bytes = 0;  // N, the JSON length
};

// Parses and validates `bytes`; `source` names the file in error messages.
Result<SafetensorsImage> ParseSafetensors(std::span<const std::byte> bytes,
                                          const std::string& source);

// One safetensors file, mapped. Move-only; views stay valid while it lives.
class SafetensorsFile {
 public:
  static Result<SafetensorsFile> Open(const std::string& path);
  const std::vector<TensorView>& tensors() const { return image_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return image_.metadata; }
  const std::string& path() const { return file_.path(); }

 private:
  MappedFile file_;
  SafetensorsImage image_;
};

// A checkpoint on disk: one .safetensors file, or a sharded directory.
class Checkpoint {
 public:
  // `path`: a .safetensors file, a directory holding model.safetensors.index.json or a
  // single model.safetensors, or the index file itself.
  static Result<Checkpoint> Open(const std::string& path);

  // All tensors of all shards (shard order, then offset order).
  const CheckpointView& tensors() const { return tensors_; }
  // Metadata of the single file, or of the first shard.
  const std::map<std::string, std::string>& metadata() const;
  // Shard file name (not path) holding each tensor; empty for a single file.
  const std::map<std::string, std::string>& weight_map() const { return weight_map_; }
  bool sharded() const { return !weight_map_.empty(); }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  CheckpointView tensors_;
  std::map<std::string, std::string> weight_map_;
};

// Serialises tensors (in the given order, contiguous) with the header padded with spaces
// to a multiple of 8, as the reference writer does. Fails on duplicate names or a data
// size that does not match dtype and shape.
Result<std::vector<std::byte>> SerializeSafetensors(
    const CheckpointView& tensors, const std::map<std::string, std::string>& metadata);

// The header bytes (u64 N + padded JSON) for tensors laid out contiguously in the given
// order; data offsets are computed from dtype and shape (the spans are not read).
Result<std::vector<std::byte>> SafetensorsHeader(
    const CheckpointView& tensors, const std::map<std::string, std::string>& metadata);

// Writes atomically: a temporary file in the same directory, fsync, then rename.
Status WriteSafetensors(const std::string& path, const CheckpointView& tensors,
                        const std::map<std::string, std::string>& metadata);

// A new safetensors file laid out in place through a writable mapping, so large outputs
// are produced without an extra copy. Data lands in a temporary file next to `path`;
// Commit() msyncs and renames it over `path`. Destroying an uncommitted writer removes the
// temporary file: nothing half-written is ever visible under `path`.
class SafetensorsWriter {
 public:
  // `layout` supplies names, dtypes and shapes (its spans are ignored).
  static Result<SafetensorsWriter> Create(const std::string& path, const CheckpointView& layout,
                                          const std::map<std::string, std::string>& metadata);
  SafetensorsWriter() = default;
  SafetensorsWriter(SafetensorsWriter&&) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) noexcept;
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  // Writable views of every tensor, in layout order.
  MutableCheckpointView& tensors() { return tensors_; }
  Status Commit();

 private:
  void Abandon();
  std::string path_;
  std::byte* map_ = nullptr;
  size_t map_size_ = 0;
  AtomicFile file_;  // the temporary file the mapping writes, renamed over path_ by Commit
  MutableCheckpointView tensors_;
};

// Writes a sharded checkpoint into directory `dir` (created if missing): every shard
// through a temporary name and rename, the index (model.safetensors.index.json with
// metadata.total_size and weight_map) last. `weight_map` assigns each tensor a shard name.
Status WriteShardedCheckpoint(const std::string& dir, const CheckpointView& tensors,
                              const std::map<std::string, std::string>& weight_map,
                              const std::map<std::string, std::string>& metadata);

}  // namespace flywheel
