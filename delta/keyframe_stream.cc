#include "delta/keyframe_stream.h"

#include <new>
#include <string>

#include "delta/codec_internal.h"
#include "kernels/kernels.h"

namespace flywheel::delta {

Result<OwnedCheckpoint> AllocateKeyframeStaging(const Manifest& prologue, uint64_t max_bytes) {
  if (!prologue.keyframe) {
    return Status::InvalidArgument("a keyframe staging buffer for a delta (v" +
                                   std::to_string(prologue.base_version) + " -> v" +
                                   std::to_string(prologue.target_version) + ")");
  }
  uint64_t total = 0;
  for (const TensorEntry& t : prologue.tensors) {
    if (t.byte_size > max_bytes - total) {
      return Status::ResourceExhausted(
          "keyframe v" + std::to_string(prologue.target_version) +
          " declares more than " + std::to_string(max_bytes) +
          " bytes of tensors (the limit for a staging buffer), at tensor " +
          internal::Quote(t.name));
    }
    total += t.byte_size;
  }
  OwnedCheckpoint staging;
  try {
    staging.tensors.reserve(prologue.tensors.size());
    for (const TensorEntry& t : prologue.tensors) {
      staging.tensors.push_back({t.name, t.dtype, t.shape, std::vector<std::byte>(t.byte_size)});
    }
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("cannot allocate " + std::to_string(total) +
                                     " bytes to stage keyframe v" +
                                     std::to_string(prologue.target_version));
  }
  return staging;
}

Status DecodeKeyframeChunk(const DeltaView& chunk_view, std::span<std::byte> tensor_data) {
  const Manifest& m = chunk_view.manifest();
  if (m.tensors.size() != 1 || m.chunks.size() != 1) {
    return Status::InvalidArgument("DecodeKeyframeChunk takes a view of one chunk");
  }
  const ChunkEntry& e = m.chunks[0];
  const TensorEntry& t = m.tensors[0];
  const std::string where = "keyframe chunk record " + std::to_string(e.record) + " (tensor " +
                            internal::Quote(t.name) + ", words " + std::to_string(e.word_begin) +
                            ".." + std::to_string(e.word_begin + e.word_count) + ")";
  if (!m.keyframe || e.kind != ChunkKind::kLiteral) {
    return Status::Corruption(where + ": not a literal chunk of a keyframe");
  }
  const int w = DTypeWordBytes(t.dtype);
  const uint64_t words = tensor_data.size() / static_cast<uint64_t>(w);
  if (tensor_data.size() != t.byte_size || e.word_begin > words ||
      e.word_count > words - e.word_begin || e.raw_bytes != e.word_count * w) {
    return Status::Corruption(where + ": words or raw size outside the tensor's " +
                              std::to_string(tensor_data.size()) + " bytes");
  }
  const std::span<const std::byte> stored = chunk_view.payload(e);
  const std::span<const uint8_t> stored_u8(internal::U8(stored), stored.size());
  if (internal::ChecksumMismatch(e.checksum, stored_u8)) {
    return Status::Corruption(where + ": checksum mismatch");
  }
  internal::Scratch& s = internal::ThreadScratch();
  const uint8_t* raw = stored_u8.data();
  if (e.compressor != Compressor::kNone) {
    if (e.compressor == Compressor::kZstd) {
      FW_RETURN_IF_ERROR(internal::CheckZstdFrameSize(stored_u8, e.raw_bytes).WithContext(where));
    }
    try {
      // Grow, not resize: Decompress writes all raw_bytes, so bytes kept from an earlier
      // chunk need no zeroing (resize to a smaller last chunk and back zero-filled them).
      internal::Grow(s.raw, e.raw_bytes);
    } catch (const std::bad_alloc&) {
      return Status::ResourceExhausted(where + ": out of memory for decoding scratch");
    }
    FW_RETURN_IF_ERROR(
        internal::Decompress(e.compressor, stored_u8, e.raw_bytes, s.raw.data()).WithContext(where));
    raw = s.raw.data();
  } else if (stored_u8.size() != e.raw_bytes) {
    return Status::Corruption(where + ": stored size differs from raw size");
  }
  kernels::Unshuffle(raw, e.word_count, static_cast<size_t>(w),
                     internal::U8(tensor_data) + e.word_begin * w);
  internal::TrimScratch(s);
  return Status::Ok();
}

}  // namespace flywheel::delta
