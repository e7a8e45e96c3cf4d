// The container parser: DeltaView::Parse. Checks the 48-byte header, then reads and
// validates the manifest (versions, metadata, tensor table, chunk table) against
// DecodeLimits before anything sized from it is allocated. Chunk payloads are not
// decoded here; apply.cc verifies them.
#include <cstring>
#include <unordered_map>

#include "delta/codec_internal.h"
#include "delta/delta.h"
#include "delta/format.h"
#include "delta/wire.h"

namespace flywheel::delta {
namespace {

using internal::ChecksumMismatch;
using internal::Quote;

// Section sizes from a verified header.
struct Header {
  bool keyframe = false;
  uint64_t manifest_bytes = 0;
  uint64_t payload_bytes = 0;
};

Result<Header> ParseHeader(const uint8_t* p, uint64_t size, const DecodeLimits& limits) {
  if (size < format::kHeaderBytes) {
    return Status::Corruption("delta is " + std::to_string(size) +
                              " bytes, shorter than its 48-byte header");
  }
  if (std::memcmp(p, format::kMagic, 8) != 0) {
    return Status::Corruption("not a flywheel delta (bad magic at byte 0)");
  }
  if (ChecksumMismatch(wire::LoadFixed(p + 40, 8), {p, 40})) {
    return Status::Corruption("delta header checksum mismatch (bytes 0..47)");
  }
  const uint64_t version = wire::LoadFixed(p + 8, 2);
  const uint64_t flags = wire::LoadFixed(p + 10, 2);
  if (version != format::kVersion) {
    return Status::Corruption("delta format version " + std::to_string(version) +
                              " is not supported (this build reads versions 1 and 2)");
  }
  if ((flags & ~uint64_t{format::kFlagKeyframe}) != 0) {
    return Status::Corruption("delta header has unknown flags " + std::to_string(flags));
  }
  if (wire::LoadFixed(p + 12, 4) != 0) {
    return Status::Corruption("delta header's reserved field is not zero");
  }
  Header h;
  h.keyframe = flags & format::kFlagKeyframe;
  h.manifest_bytes = wire::LoadFixed(p + 16, 8);
  h.payload_bytes = wire::LoadFixed(p + 24, 8);
  if (h.manifest_bytes > limits.max_manifest_bytes) {
    return Status::ResourceExhausted("delta manifest of " + std::to_string(h.manifest_bytes) +
                                     " bytes exceeds the limit of " +
                                     std::to_string(limits.max_manifest_bytes));
  }
  if (h.manifest_bytes > size - format::kHeaderBytes ||
      h.payload_bytes != size - format::kHeaderBytes - h.manifest_bytes) {
    return Status::Corruption("delta is " + std::to_string(size) + " bytes but its header says " +
                              std::to_string(format::kHeaderBytes) + " + " +
                              std::to_string(h.manifest_bytes) + " (manifest) + " +
                              std::to_string(h.payload_bytes) + " (payloads): truncated or padded");
  }
  if (ChecksumMismatch(wire::LoadFixed(p + 32, 8), {p + format::kHeaderBytes, h.manifest_bytes})) {
    return Status::Corruption("delta manifest checksum mismatch");
  }
  return h;
}

using internal::CheckChunkSizes;

// Reads one manifest section by section into `m`, in the order of delta/format.h.
class ManifestParser {
 public:
  ManifestParser(std::span<const uint8_t> bytes, const Header& header, const DecodeLimits& limits,
                 Manifest& m)
      : r_(bytes), header_(header), limits_(limits), m_(m) {
    m_.keyframe = header.keyframe;
  }

  Status Parse();

 private:
  Status Truncated(const std::string& where) const {
    return Status::Corruption("delta manifest truncated or malformed in " + where);
  }
  Hash128 GetHash() {
    Hash128 h;
    h.low = r_.Fixed(8);
    h.high = r_.Fixed(8);
    return h;
  }
  Status ParseVersions();
  Status ParseMetadata();
  Status ParseTensors();
  Status ParseTensor(uint64_t i, TensorEntry& t);
  Status CheckTensorSizes(TensorEntry& t, uint64_t chunks);
  Status ParseChunks();
  Status ParseTensorChunks(uint32_t ti);
  Status ParseChunk(uint32_t ti, uint64_t& next_free, ChunkEntry& e);

  wire::Reader r_;
  const Header& header_;
  const DecodeLimits& limits_;
  Manifest& m_;
  std::unordered_map<std::string, size_t> names_;
  uint64_t declared_chunks_ = 0;
  uint64_t total_bytes_ = 0;     // declared tensor sizes so far
  uint64_t payload_offset_ = 0;  // chunk payloads so far
};

Status ManifestParser::Parse() {
  FW_RETURN_IF_ERROR(ParseVersions());
  FW_RETURN_IF_ERROR(ParseMetadata());
  FW_RETURN_IF_ERROR(ParseTensors());
  FW_RETURN_IF_ERROR(ParseChunks());
  if (r_.remaining() != 0) {
    return Status::Corruption("delta manifest has " + std::to_string(r_.remaining()) +
                              " trailing bytes");
  }
  if (payload_offset_ != header_.payload_bytes) {
    return Status::Corruption("delta chunks account for " + std::to_string(payload_offset_) +
                              " payload bytes, header says " +
                              std::to_string(header_.payload_bytes));
  }
  return Status::Ok();
}

Status ManifestParser::ParseVersions() {
  m_.base_version = r_.Varint();
  m_.target_version = r_.Varint();
  m_.base_hash = GetHash();
  m_.target_hash = GetHash();
  if (r_.failed()) return Truncated("the version fields");
  if (m_.keyframe && m_.base_hash != Hash128{})
    return Status::Corruption("keyframe names a base hash");
  return Status::Ok();
}

Status ManifestParser::ParseMetadata() {
  uint64_t metadata_count = r_.Varint();
  uint64_t metadata_bytes = 0;
  for (uint64_t i = 0; i < metadata_count && !r_.failed(); ++i) {
    uint64_t key_len = r_.Varint();
    auto key = r_.Bytes(key_len);
    uint64_t value_len = r_.Varint();
    auto value = r_.Bytes(value_len);
    metadata_bytes += key_len + value_len;
    if (r_.failed()) break;
    if (metadata_bytes > limits_.max_metadata_bytes) {
      return Status::ResourceExhausted("delta metadata exceeds " +
                                       std::to_string(limits_.max_metadata_bytes) + " bytes");
    }
    if (!m_.metadata
             .emplace(std::string(key.begin(), key.end()), std::string(value.begin(), value.end()))
             .second) {
      return Status::Corruption("delta metadata has a duplicate key");
    }
  }
  if (r_.failed()) return Truncated("the metadata");
  return Status::Ok();
}

Status ManifestParser::ParseTensors() {
  uint64_t tensor_count = r_.Varint();
  if (r_.failed()) return Truncated("the tensor count");
  if (tensor_count > limits_.max_tensors) {
    return Status::ResourceExhausted("delta declares " + std::to_string(tensor_count) +
                                     " tensors, limit " + std::to_string(limits_.max_tensors));
  }
  for (uint64_t i = 0; i < tensor_count; ++i) {
    TensorEntry t;
    FW_RETURN_IF_ERROR(ParseTensor(i, t));
    m_.tensors.push_back(std::move(t));
  }
  return Status::Ok();
}

// One tensor entry: name, dtype, shape, hashes, changed words, chunk count.
Status ManifestParser::ParseTensor(uint64_t i, TensorEntry& t) {
  uint64_t name_len = r_.Varint();
  if (name_len == 0 || name_len > limits_.max_name_bytes) {
    return Status::Corruption("delta tensor " + std::to_string(i) + " has a name of " +
                              std::to_string(name_len) + " bytes");
  }
  auto name = r_.Bytes(name_len);
  uint8_t dtype = r_.U8();
  uint64_t rank = r_.Varint();
  if (r_.failed()) return Truncated("tensor " + std::to_string(i));
  t.name.assign(name.begin(), name.end());
  if (dtype >= kNumDTypes) {
    return Status::Corruption("delta tensor " + Quote(t.name) + " has unknown dtype " +
                              std::to_string(dtype));
  }
  t.dtype = static_cast<DType>(dtype);
  if (rank > format::kMaxRank) {
    return Status::Corruption("delta tensor " + Quote(t.name) + " has rank " +
                              std::to_string(rank));
  }
  for (uint64_t d = 0; d < rank; ++d) {
    uint64_t dim = r_.Varint();
    if (dim > (uint64_t{1} << 62))
      return Status::Corruption("delta tensor " + Quote(t.name) + " has a huge dimension");
    t.shape.push_back(static_cast<int64_t>(dim));
  }
  t.base_hash = GetHash();
  t.target_hash = GetHash();
  t.changed_words = r_.Varint();
  uint64_t chunks = r_.Varint();
  if (r_.failed()) return Truncated("tensor " + Quote(t.name));
  FW_RETURN_IF_ERROR(CheckTensorSizes(t, chunks));
  if (m_.keyframe && t.base_hash != Hash128{}) {
    return Status::Corruption("keyframe tensor " + Quote(t.name) + " names a base hash");
  }
  if (!names_.emplace(t.name, i).second)
    return Status::Corruption("delta names tensor " + Quote(t.name) + " twice");
  t.first_chunk = static_cast<uint32_t>(declared_chunks_);
  t.chunk_count = static_cast<uint32_t>(chunks);
  declared_chunks_ += chunks;
  if (declared_chunks_ > limits_.max_chunks) {
    return Status::ResourceExhausted("delta declares more than " +
                                     std::to_string(limits_.max_chunks) + " chunks");
  }
  return Status::Ok();
}

// Sets t.byte_size; checks it and the declared counts against the limits and the shape.
Status ManifestParser::CheckTensorSizes(TensorEntry& t, uint64_t chunks) {
  auto bytes = TensorByteSize(t.dtype, t.shape);
  if (!bytes.ok())
    return Status::Corruption("delta tensor " + Quote(t.name) + ": " + bytes.status().message());
  t.byte_size = *bytes;
  if (t.byte_size > limits_.max_total_bytes - total_bytes_) {
    return Status::ResourceExhausted("delta tensors declare more than " +
                                     std::to_string(limits_.max_total_bytes) +
                                     " bytes in all (at tensor " + Quote(t.name) + ")");
  }
  total_bytes_ += t.byte_size;
  const uint64_t words = t.byte_size / DTypeWordBytes(t.dtype);
  if (chunks > limits_.max_chunks) {
    return Status::ResourceExhausted("delta tensor " + Quote(t.name) + " declares " +
                                     std::to_string(chunks) + " chunks, limit " +
                                     std::to_string(limits_.max_chunks));
  }
  if (t.changed_words > words || chunks > words) {
    return Status::Corruption("delta tensor " + Quote(t.name) + " declares " +
                              std::to_string(t.changed_words) + " changed words in " +
                              std::to_string(chunks) + " chunks but has " + std::to_string(words) +
                              " words");
  }
  return Status::Ok();
}

Status ManifestParser::ParseChunks() {
  uint64_t chunk_count = r_.Varint();
  if (r_.failed()) return Truncated("the chunk count");
  if (chunk_count != declared_chunks_) {
    return Status::Corruption("delta chunk table has " + std::to_string(chunk_count) +
                              " entries, tensors declare " + std::to_string(declared_chunks_));
  }
  for (uint32_t ti = 0; ti < m_.tensors.size(); ++ti) FW_RETURN_IF_ERROR(ParseTensorChunks(ti));
  return Status::Ok();
}

// The chunks of tensor `ti`: in word order, not overlapping, and adding up to the tensor's
// changed words (a keyframe's cover every word).
Status ManifestParser::ParseTensorChunks(uint32_t ti) {
  const TensorEntry& t = m_.tensors[ti];
  const uint64_t words = t.byte_size / DTypeWordBytes(t.dtype);
  uint64_t next_free = 0, changed_sum = 0, covered = 0;
  for (uint32_t c = 0; c < t.chunk_count; ++c) {
    ChunkEntry e;
    FW_RETURN_IF_ERROR(ParseChunk(ti, next_free, e));
    covered += e.word_count;
    changed_sum += e.changed_words;
    m_.chunks.push_back(e);
  }
  if (changed_sum != t.changed_words) {
    return Status::Corruption("delta tensor " + Quote(t.name) + " declares " +
                              std::to_string(t.changed_words) + " changed words, its chunks " +
                              std::to_string(changed_sum));
  }
  if (m_.keyframe && covered != words) {
    return Status::Corruption("keyframe does not cover every word of tensor " + Quote(t.name));
  }
  if (!m_.keyframe && t.chunk_count == 0 && t.base_hash != t.target_hash) {
    return Status::Corruption("delta tensor " + Quote(t.name) +
                              " has no chunks but different base and target hashes");
  }
  return Status::Ok();
}

// One chunk entry of tensor `ti`; `next_free` is the first word the chunk may start at
// and is advanced past it.
Status ManifestParser::ParseChunk(uint32_t ti, uint64_t& next_free, ChunkEntry& e) {
  const TensorEntry& t = m_.tensors[ti];
  const int w = DTypeWordBytes(t.dtype);
  const uint64_t words = t.byte_size / w;
  e.tensor_index = ti;
  e.word_begin = r_.Varint();
  e.word_count = r_.Varint();
  uint8_t kind = r_.U8();
  uint8_t compressor = r_.U8();
  e.changed_words = r_.Varint();
  e.raw_bytes = r_.Varint();
  e.payload_bytes = r_.Varint();
  e.checksum = r_.Fixed(8);
  std::string where =
      "chunk " + std::to_string(m_.chunks.size()) + " (tensor " + Quote(t.name) + ")";
  if (r_.failed()) return Truncated(where);
  if (kind > 3 || compressor > 2) {
    return Status::Corruption(where + " has unknown kind " + std::to_string(kind) +
                              " or compressor " + std::to_string(compressor) +
                              " (this build reads kinds 0..3, compressors 0..2)");
  }
  e.kind = static_cast<ChunkKind>(kind);
  e.compressor = static_cast<Compressor>(compressor);
  if (e.word_count == 0 || e.word_begin < next_free || e.word_begin > words ||
      e.word_count > words - e.word_begin) {
    return Status::Corruption(where + " covers words [" + std::to_string(e.word_begin) + ", +" +
                              std::to_string(e.word_count) +
                              ") outside or overlapping the tensor's " + std::to_string(words) +
                              " words");
  }
  if (e.word_count > limits_.max_chunk_words) {
    return Status::ResourceExhausted(where + " holds " + std::to_string(e.word_count) +
                                     " words, limit " + std::to_string(limits_.max_chunk_words));
  }
  next_free = e.word_begin + e.word_count;
  FW_RETURN_IF_ERROR(CheckChunkSizes(where, e, w, limits_));
  if (e.payload_bytes > header_.payload_bytes - payload_offset_) {
    return Status::Corruption(where + " payload runs past the end of the delta");
  }
  if (m_.keyframe && e.kind != ChunkKind::kLiteral) {
    return Status::Corruption(where + " of a keyframe is not literal");
  }
  e.payload_offset = payload_offset_;
  e.record = static_cast<uint32_t>(m_.chunks.size());
  payload_offset_ += e.payload_bytes;
  return Status::Ok();
}


}  // namespace

namespace internal {

Status CheckChunkSizes(const std::string& where, const ChunkEntry& e, int w,
                       const DecodeLimits& limits) {
  const uint64_t dense = e.word_count * w;
  const bool sparse = e.kind == ChunkKind::kSparse || e.kind == ChunkKind::kSparseContext;
  if (e.changed_words > e.word_count || (sparse && e.changed_words == 0)) {
    return Status::Corruption(where + " declares " + std::to_string(e.changed_words) +
                              " changed words of " + std::to_string(e.word_count));
  }
  if (!sparse && e.raw_bytes != dense) {
    return Status::Corruption(where + " is dense but its raw size " + std::to_string(e.raw_bytes) +
                              " is not " + std::to_string(dense));
  }
  // A sparse chunk costs at least one bit per change (the shortest Rice code) and at most
  // 24 bytes per change (escaped gap + 64-bit value), plus its headers and table.
  if (e.kind == ChunkKind::kSparse && e.changed_words > 8 * e.raw_bytes) {
    return Status::Corruption(where + " declares " + std::to_string(e.changed_words) +
                              " changes in only " + std::to_string(e.raw_bytes) + " bytes");
  }
  if (e.kind == ChunkKind::kSparse && e.raw_bytes > 64 + 24 * e.changed_words + 4 * 77) {
    return Status::Corruption(where + " declares an implausible raw size " +
                              std::to_string(e.raw_bytes));
  }
  // A context-coded chunk can spend under a bit per change (a bucket where nearly every
  // word changes lists the unchanged ones), so only the upper bound applies: per stream a
  // header and a table, per change at most an escaped rank and a 64-bit value.
  if (e.kind == ChunkKind::kSparseContext &&
      e.raw_bytes > 64 + 24 * e.changed_words + 16 * (24 + 4 * 77)) {
    return Status::Corruption(where + " declares an implausible raw size " +
                              std::to_string(e.raw_bytes));
  }
  if (e.raw_bytes > limits.max_chunk_raw_bytes) {
    return Status::ResourceExhausted(where + " raw size " + std::to_string(e.raw_bytes) +
                                     " exceeds the limit");
  }
  if (e.compressor == Compressor::kNone && e.payload_bytes != e.raw_bytes) {
    return Status::Corruption(where + " is uncompressed but stored and raw sizes differ");
  }
  return Status::Ok();
}

}  // namespace internal

Result<DeltaView> DeltaView::Parse(std::span<const std::byte> container,
                                   const DecodeLimits& limits) {
  const uint8_t* p = internal::U8(container);
  if (StreamReader::IsStreamed(container)) return ParseStreamed(container, limits);
  FW_ASSIGN_OR_RETURN(Header header, ParseHeader(p, container.size(), limits));
  DeltaView view;
  view.bytes_ = container;
  view.payloads_ = container.subspan(format::kHeaderBytes + header.manifest_bytes);
  ManifestParser parser({p + format::kHeaderBytes, header.manifest_bytes}, header, limits,
                        view.manifest_);
  FW_RETURN_IF_ERROR(parser.Parse());
  return view;
}

}  // namespace flywheel::delta
