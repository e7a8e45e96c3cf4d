// The streamed container (format 2, delta/format.h): StreamReader, which reads it while it
// arrives, and DeltaView::Parse of a whole one. Every field is checked against
// DecodeLimits as it is read; what only the whole container can show (chunks of a tensor
// overlapping, the changed counts adding up, a keyframe covering every word) is checked
// by ParseStreamed.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <unordered_map>

#include "delta/codec_internal.h"
#include "delta/delta.h"
#include "delta/format.h"
#include "delta/wire.h"

namespace flywheel::delta {

using internal::ChecksumMismatch;
using internal::Quote;

namespace {

// The largest chunk record header (tag, 3 + 3 varints, 2 bytes, 2 checksums).
constexpr uint64_t kMaxRecordHeader = 1 + 6 * 10 + 2 + 8 + 8;

Hash128 GetHash(wire::Reader& r) {
  Hash128 h;
  h.low = r.Fixed(8);
  h.high = r.Fixed(8);
  return h;
}

}  // namespace

struct StreamReader::State {
  DecodeLimits limits;
  Manifest m;  // chunks in record order, offsets from the container's start
  bool has_prologue = false;
  bool ended = false;
  Status error;
  uint64_t max_chunks = 0;
  uint64_t pos = 0;  // the first byte not parsed yet
  std::vector<uint64_t> words;  // per tensor
  std::vector<uint8_t> finished;         // per tensor: its tensor record is in
  std::vector<uint32_t> finished_order;  // tensors by the arrival of their record

  Status Fail(Status status) {
    error = status;
    return status;
  }
  Status Truncated(const std::string& where) {
    return Fail(Status::Corruption("delta prologue truncated or malformed in " + where));
  }
  // The prologue (format.h) once `in` holds it whole; nothing until then.
  Status ParsePrologue(std::span<const uint8_t> in);
  // The fixed header at p[0..40): its flags and the prologue's size.
  Status ParseHeader(const uint8_t* p, uint64_t* flags, uint64_t* prologue_bytes);
  Status ParseMetadata(wire::Reader& r);
  Status ParseTensors(wire::Reader& r);
  Status ParseTensorEntry(wire::Reader& r, uint64_t i, TensorEntry* t);
  // Parses the record at `pos` if `in` holds it whole; false in *done when it does not.
  Status ParseRecord(std::span<const uint8_t> in, bool* done);
  Status ParseChunkRecord(std::span<const uint8_t> in, bool* done);
  Status ParseEndRecord(std::span<const uint8_t> in, bool* done);
  Status ParseTensorRecord(std::span<const uint8_t> in, bool* done);
};

StreamReader::StreamReader(const DecodeLimits& limits) : state_(std::make_unique<State>()) {
  state_->limits = limits;
}
StreamReader::~StreamReader() = default;
StreamReader::StreamReader(StreamReader&&) noexcept = default;
StreamReader& StreamReader::operator=(StreamReader&&) noexcept = default;

bool StreamReader::IsStreamed(std::span<const std::byte> prefix) {
  if (prefix.size() < 10) return false;
  const uint8_t* p = internal::U8(prefix);
  return std::memcmp(p, format::kMagic, 8) == 0 &&
         wire::LoadFixed(p + 8, 2) == format::kStreamedVersion;
}

bool StreamReader::has_prologue() const { return state_->has_prologue; }
bool StreamReader::ended() const { return state_->ended; }
const Manifest& StreamReader::manifest() const { return state_->m; }
uint64_t StreamReader::max_chunks() const { return state_->max_chunks; }
const std::vector<uint32_t>& StreamReader::finished_tensors() const {
  return state_->finished_order;
}

Status StreamReader::State::ParsePrologue(std::span<const uint8_t> in) {
  if (in.size() < format::kStreamedHeaderBytes) return Status::Ok();
  uint64_t flags = 0;
  uint64_t prologue_bytes = 0;
  FW_RETURN_IF_ERROR(ParseHeader(in.data(), &flags, &prologue_bytes));
  if (in.size() - format::kStreamedHeaderBytes < prologue_bytes) return Status::Ok();
  const std::span<const uint8_t> prologue = in.subspan(format::kStreamedHeaderBytes, prologue_bytes);
  if (ChecksumMismatch(wire::LoadFixed(in.data() + 24, 8), prologue)) {
    return Fail(Status::Corruption("streamed delta prologue checksum mismatch"));
  }
  m.keyframe = flags & format::kFlagKeyframe;
  wire::Reader r(prologue);
  m.base_version = r.Varint();
  m.target_version = r.Varint();
  m.base_hash = GetHash(r);
  if (r.failed()) return Truncated("the version fields");
  if (m.keyframe && m.base_hash != Hash128{}) return Fail(Status::Corruption("keyframe names a base hash"));
  FW_RETURN_IF_ERROR(ParseMetadata(r));
  FW_RETURN_IF_ERROR(ParseTensors(r));
  max_chunks = r.Varint();
  if (r.failed()) return Truncated("the chunk bound");
  if (max_chunks > limits.max_chunks) {
    return Fail(Status::ResourceExhausted("delta declares up to " + std::to_string(max_chunks) +
                                          " chunks, limit " + std::to_string(limits.max_chunks)));
  }
  if (r.remaining() != 0) {
    return Fail(Status::Corruption("delta prologue has " + std::to_string(r.remaining()) +
                                   " trailing bytes"));
  }
  has_prologue = true;
  finished.assign(m.tensors.size(), 0);
  pos = format::kStreamedHeaderBytes + prologue_bytes;
  return Status::Ok();
}

Status StreamReader::State::ParseHeader(const uint8_t* p, uint64_t* flags,
                                        uint64_t* prologue_bytes) {
  if (std::memcmp(p, format::kMagic, 8) != 0) {
    return Fail(Status::Corruption("not a flywheel delta (bad magic at byte 0)"));
  }
  if (wire::LoadFixed(p + 8, 2) != format::kStreamedVersion) {
    return Fail(Status::Corruption("not a streamed (format 2) delta"));
  }
  if (ChecksumMismatch(wire::LoadFixed(p + 32, 8), {p, 32})) {
    return Fail(Status::Corruption("streamed delta header checksum mismatch (bytes 0..39)"));
  }
  *flags = wire::LoadFixed(p + 10, 2);
  if ((*flags & ~uint64_t{format::kFlagKeyframe}) != 0) {
    return Fail(Status::Corruption("delta header has unknown flags " + std::to_string(*flags)));
  }
  if (wire::LoadFixed(p + 12, 4) != 0) {
    return Fail(Status::Corruption("delta header's reserved field is not zero"));
  }
  *prologue_bytes = wire::LoadFixed(p + 16, 8);
  if (*prologue_bytes > limits.max_manifest_bytes) {
    return Fail(Status::ResourceExhausted("delta prologue of " + std::to_string(*prologue_bytes) +
                                          " bytes exceeds the limit of " +
                                          std::to_string(limits.max_manifest_bytes)));
  }
  return Status::Ok();
}

Status StreamReader::State::ParseMetadata(wire::Reader& r) {
  const uint64_t metadata_count = r.Varint();
  uint64_t metadata_bytes = 0;
  for (uint64_t i = 0; i < metadata_count && !r.failed(); ++i) {
    const uint64_t key_len = r.Varint();
    auto key = r.Bytes(key_len);
    const uint64_t value_len = r.Varint();
    auto value = r.Bytes(value_len);
    if (r.failed()) break;
    metadata_bytes += key_len + value_len;
    if (metadata_bytes > limits.max_metadata_bytes) {
      return Fail(Status::ResourceExhausted("delta metadata exceeds " +
                                            std::to_string(limits.max_metadata_bytes) + " bytes"));
    }
    if (!m.metadata.emplace(std::string(key.begin(), key.end()), std::string(value.begin(), value.end()))
             .second) {
      return Fail(Status::Corruption("delta metadata has a duplicate key"));
    }
  }
  if (r.failed()) return Truncated("the metadata");
  return Status::Ok();
}

Status StreamReader::State::ParseTensors(wire::Reader& r) {
  const uint64_t tensor_count = r.Varint();
  if (r.failed()) return Truncated("the tensor count");
  if (tensor_count > limits.max_tensors) {
    return Fail(Status::ResourceExhausted("delta declares " + std::to_string(tensor_count) +
                                          " tensors, limit " + std::to_string(limits.max_tensors)));
  }
  std::unordered_map<std::string, size_t> names;
  uint64_t total_bytes = 0;
  for (uint64_t i = 0; i < tensor_count; ++i) {
    TensorEntry t;
    FW_RETURN_IF_ERROR(ParseTensorEntry(r, i, &t));
    if (t.byte_size > limits.max_total_bytes - total_bytes) {
      return Fail(Status::ResourceExhausted("delta tensors declare more than " +
                                            std::to_string(limits.max_total_bytes) +
                                            " bytes in all (at tensor " + Quote(t.name) + ")"));
    }
    total_bytes += t.byte_size;
    if (m.keyframe && t.base_hash != Hash128{}) {
      return Fail(Status::Corruption("keyframe tensor " + Quote(t.name) + " names a base hash"));
    }
    if (!names.emplace(t.name, i).second) {
      return Fail(Status::Corruption("delta names tensor " + Quote(t.name) + " twice"));
    }
    words.push_back(t.byte_size / DTypeWordBytes(t.dtype));
    m.tensors.push_back(std::move(t));
  }
  return Status::Ok();
}

Status StreamReader::State::ParseTensorEntry(wire::Reader& r, uint64_t i, TensorEntry* t) {
  const uint64_t name_len = r.Varint();
  if (name_len == 0 || name_len > limits.max_name_bytes) {
    return Fail(Status::Corruption("delta tensor " + std::to_string(i) + " has a name of " +
                                   std::to_string(name_len) + " bytes"));
  }
  auto name = r.Bytes(name_len);
  const uint8_t dtype = r.U8();
  const uint64_t rank = r.Varint();
  if (r.failed()) return Truncated("tensor " + std::to_string(i));
  t->name.assign(name.begin(), name.end());
  if (dtype >= kNumDTypes) {
    return Fail(Status::Corruption("delta tensor " + Quote(t->name) + " has unknown dtype " +
                                   std::to_string(dtype)));
  }
  t->dtype = static_cast<DType>(dtype);
  if (rank > format::kMaxRank) {
    return Fail(Status::Corruption("delta tensor " + Quote(t->name) + " has rank " + std::to_string(rank)));
  }
  for (uint64_t d = 0; d < rank; ++d) {
    const uint64_t dim = r.Varint();
    if (dim > (uint64_t{1} << 62)) {
      return Fail(Status::Corruption("delta tensor " + Quote(t->name) + " has a huge dimension"));
    }
    t->shape.push_back(static_cast<int64_t>(dim));
  }
  t->base_hash = GetHash(r);
  if (r.failed()) return Truncated("tensor " + Quote(t->name));
  auto bytes = TensorByteSize(t->dtype, t->shape);
  if (!bytes.ok()) {
    return Fail(Status::Corruption("delta tensor " + Quote(t->name) + ": " + bytes.status().message()));
  }
  t->byte_size = *bytes;
  return Status::Ok();
}

Status StreamReader::State::ParseChunkRecord(std::span<const uint8_t> in, bool* done) {
  const std::span<const uint8_t> rest = in.subspan(pos);
  wire::Reader r(rest);
  r.U8();  // the tag
  ChunkEntry e;
  const uint64_t tensor = r.Varint();
  e.word_begin = r.Varint();
  e.word_count = r.Varint();
  const uint8_t kind = r.U8();
  const uint8_t compressor = r.U8();
  e.changed_words = r.Varint();
  e.raw_bytes = r.Varint();
  e.payload_bytes = r.Varint();
  e.checksum = r.Fixed(8);
  const size_t covered = r.position();
  const uint64_t header_checksum = r.Fixed(8);
  const std::string where = "chunk record " + std::to_string(m.chunks.size());
  if (r.failed()) {
    if (rest.size() < kMaxRecordHeader) return Status::Ok();  // not all here yet
    return Fail(Status::Corruption("delta " + where + " is malformed"));
  }
  if (ChecksumMismatch(header_checksum, rest.first(covered))) {
    return Fail(Status::Corruption("delta " + where + " header checksum mismatch"));
  }
  if (tensor >= m.tensors.size()) {
    return Fail(Status::Corruption("delta " + where + " names tensor " + std::to_string(tensor) +
                                   " of " + std::to_string(m.tensors.size())));
  }
  if (m.chunks.size() >= max_chunks) {
    return Fail(Status::Corruption("delta has more chunk records than its bound " +
                                   std::to_string(max_chunks)));
  }
  const TensorEntry& t = m.tensors[tensor];
  const std::string named = where + " (tensor " + Quote(t.name) + ")";
  if (finished[tensor]) {
    return Fail(Status::Corruption("delta " + named + " comes after the tensor's record"));
  }
  if (kind > 3 || compressor > 2) {
    return Fail(Status::Corruption("delta " + named + " has unknown kind " + std::to_string(kind) +
                                   " or compressor " + std::to_string(compressor) +
                                   " (this build reads kinds 0..3, compressors 0..2)"));
  }
  e.tensor_index = static_cast<uint32_t>(tensor);
  e.kind = static_cast<ChunkKind>(kind);
  e.compressor = static_cast<Compressor>(compressor);
  const uint64_t n = words[tensor];
  if (e.word_count == 0 || e.word_begin > n || e.word_count > n - e.word_begin) {
    return Fail(Status::Corruption("delta " + named + " covers words [" + std::to_string(e.word_begin) +
                                   ", +" + std::to_string(e.word_count) + ") outside the tensor's " +
                                   std::to_string(n) + " words"));
  }
  if (e.word_count > limits.max_chunk_words) {
    return Fail(Status::ResourceExhausted("delta " + named + " holds " + std::to_string(e.word_count) +
                                          " words, limit " + std::to_string(limits.max_chunk_words)));
  }
  if (Status st = internal::CheckChunkSizes("delta " + named, e, DTypeWordBytes(t.dtype), limits); !st.ok()) {
    return Fail(st);
  }
  if (m.keyframe && e.kind != ChunkKind::kLiteral) {
    return Fail(Status::Corruption("delta " + named + " of a keyframe is not literal"));
  }
  const uint64_t header_bytes = r.position();
  if (e.payload_bytes > rest.size() - header_bytes) return Status::Ok();  // payload not all here
  e.payload_offset = pos + header_bytes;
  e.record = static_cast<uint32_t>(m.chunks.size());
  m.chunks.push_back(e);
  pos += header_bytes + e.payload_bytes;
  *done = true;
  return Status::Ok();
}

Status StreamReader::State::ParseEndRecord(std::span<const uint8_t> in, bool* done) {
  const std::span<const uint8_t> rest = in.subspan(pos);
  wire::Reader r(rest);
  r.U8();
  const uint64_t records = r.Varint();
  const Hash128 target_hash = GetHash(r);
  std::vector<std::pair<Hash128, uint64_t>> per_tensor(m.tensors.size());
  for (auto& [hash, changed] : per_tensor) {
    hash = GetHash(r);
    changed = r.Varint();
  }
  const size_t covered = r.position();
  const uint64_t checksum = r.Fixed(8);
  if (r.failed()) {
    if (rest.size() < 1 + 10 + 16 + 26 * m.tensors.size() + 8) return Status::Ok();
    return Fail(Status::Corruption("delta end record is malformed"));
  }
  if (ChecksumMismatch(checksum, rest.first(covered))) {
    return Fail(Status::Corruption("delta end record checksum mismatch"));
  }
  if (records != m.chunks.size()) {
    return Fail(Status::Corruption("delta end record counts " + std::to_string(records) +
                                   " chunk records, the container holds " +
                                   std::to_string(m.chunks.size())));
  }
  for (size_t i = 0; i < per_tensor.size(); ++i) {
    if (!finished[i]) {
      return Fail(Status::Corruption("delta tensor " + Quote(m.tensors[i].name) +
                                     " has no tensor record before the end record"));
    }
    if (m.tensors[i].target_hash != per_tensor[i].first ||
        m.tensors[i].changed_words != per_tensor[i].second) {
      return Fail(Status::Corruption("delta end record disagrees with the record of tensor " +
                                     Quote(m.tensors[i].name)));
    }
  }
  m.target_hash = target_hash;
  pos += r.position();
  ended = true;
  *done = true;
  return Status::Ok();
}

Status StreamReader::State::ParseTensorRecord(std::span<const uint8_t> in, bool* done) {
  const std::span<const uint8_t> rest = in.subspan(pos);
  wire::Reader r(rest);
  r.U8();
  const uint64_t tensor = r.Varint();
  const Hash128 hash = GetHash(r);
  const uint64_t changed = r.Varint();
  const size_t covered = r.position();
  const uint64_t checksum = r.Fixed(8);
  if (r.failed()) {
    if (rest.size() < 1 + 10 + 16 + 10 + 8) return Status::Ok();
    return Fail(Status::Corruption("delta tensor record at byte " + std::to_string(pos) +
                                   " is malformed"));
  }
  if (ChecksumMismatch(checksum, rest.first(covered))) {
    return Fail(Status::Corruption("delta tensor record at byte " + std::to_string(pos) +
                                   " checksum mismatch"));
  }
  if (tensor >= m.tensors.size() || finished[tensor]) {
    return Fail(Status::Corruption("delta tensor record names tensor " + std::to_string(tensor) +
                                   (tensor < m.tensors.size() ? " a second time" : " of " +
                                   std::to_string(m.tensors.size()))));
  }
  TensorEntry& t = m.tensors[tensor];
  if (changed > words[tensor]) {
    return Fail(Status::Corruption("delta tensor " + Quote(t.name) + " declares " +
                                   std::to_string(changed) + " changed words of " +
                                   std::to_string(words[tensor])));
  }
  t.target_hash = hash;
  t.changed_words = changed;
  finished[tensor] = 1;
  finished_order.push_back(static_cast<uint32_t>(tensor));
  pos += r.position();
  *done = true;
  return Status::Ok();
}

Status StreamReader::State::ParseRecord(std::span<const uint8_t> in, bool* done) {
  *done = false;
  const uint8_t tag = in[pos];
  if (tag == format::kTagChunk) return ParseChunkRecord(in, done);
  if (tag == format::kTagTensor) return ParseTensorRecord(in, done);
  if (tag == format::kTagEnd) return ParseEndRecord(in, done);
  return Fail(Status::Corruption("delta has an unknown record tag " + std::to_string(tag) +
                                 " at byte " + std::to_string(pos)));
}

Status StreamReader::Advance(std::span<const std::byte> prefix) {
  State& s = *state_;
  if (!s.error.ok()) return s.error;
  const std::span<const uint8_t> in(internal::U8(prefix), prefix.size());
  if (!s.has_prologue) {
    FW_RETURN_IF_ERROR(s.ParsePrologue(in));
    if (!s.has_prologue) return Status::Ok();
  }
  while (!s.ended && s.pos < in.size()) {
    bool done = false;
    FW_RETURN_IF_ERROR(s.ParseRecord(in, &done));
    if (!done) break;
  }
  return Status::Ok();
}

DeltaView StreamReader::ChunkView(size_t record, std::span<const std::byte> container) const {
  const State& s = *state_;
  DeltaView view;
  view.streamed_ = true;
  view.bytes_ = container;
  view.payloads_ = container;
  Manifest& m = view.manifest_;
  m.keyframe = s.m.keyframe;
  m.base_version = s.m.base_version;
  m.target_version = s.m.target_version;
  m.base_hash = s.m.base_hash;
  ChunkEntry chunk = s.m.chunks.at(record);
  TensorEntry tensor = s.m.tensors[chunk.tensor_index];
  tensor.first_chunk = 0;
  tensor.chunk_count = 1;
  chunk.tensor_index = 0;
  m.tensors.push_back(std::move(tensor));
  m.chunks.push_back(chunk);
  return view;
}

Result<DeltaView> DeltaView::ParseStreamed(std::span<const std::byte> container,
                                           const DecodeLimits& limits) {
  StreamReader reader(limits);
  FW_RETURN_IF_ERROR(reader.Advance(container));
  StreamReader::State& s = *reader.state_;
  if (!s.has_prologue) {
    return Status::Corruption("streamed delta of " + std::to_string(container.size()) +
                              " bytes ends inside its header or prologue");
  }
  if (!s.ended) {
    return Status::Corruption("streamed delta is truncated: it ends after " +
                              std::to_string(s.m.chunks.size()) +
                              " chunk records without its end record");
  }
  if (s.pos != container.size()) {
    return Status::Corruption("streamed delta has " + std::to_string(container.size() - s.pos) +
                              " bytes after its end record");
  }
  Manifest& m = s.m;
  // Chunks grouped by tensor, in word order; each chunk keeps its record number.
  std::vector<ChunkEntry> chunks = std::move(m.chunks);
  std::stable_sort(chunks.begin(), chunks.end(), [](const ChunkEntry& a, const ChunkEntry& b) {
    return a.tensor_index != b.tensor_index ? a.tensor_index < b.tensor_index
                                            : a.word_begin < b.word_begin;
  });
  m.chunks.clear();
  size_t c = 0;
  for (uint32_t ti = 0; ti < m.tensors.size(); ++ti) {
    TensorEntry& t = m.tensors[ti];
    const uint64_t words = s.words[ti];
    t.first_chunk = static_cast<uint32_t>(c);
    uint64_t next_free = 0, changed = 0, covered = 0;
    for (; c < chunks.size() && chunks[c].tensor_index == ti; ++c) {
      const ChunkEntry& e = chunks[c];
      if (e.word_begin < next_free) {
        return Status::Corruption("delta tensor " + Quote(t.name) + " has overlapping chunks at word " +
                                  std::to_string(e.word_begin));
      }
      next_free = e.word_begin + e.word_count;
      changed += e.changed_words;
      covered += e.word_count;
    }
    t.chunk_count = static_cast<uint32_t>(c - t.first_chunk);
    if (t.changed_words > words || changed != t.changed_words) {
      return Status::Corruption("delta tensor " + Quote(t.name) + " declares " +
                                std::to_string(t.changed_words) + " changed words, its chunks " +
                                std::to_string(changed));
    }
    if (m.keyframe && covered != words) {
      return Status::Corruption("keyframe does not cover every word of tensor " + Quote(t.name));
    }
    if (!m.keyframe && t.chunk_count == 0 && t.base_hash != t.target_hash) {
      return Status::Corruption("delta tensor " + Quote(t.name) +
                                " has no chunks but different base and target hashes");
    }
  }
  m.chunks = std::move(chunks);
  DeltaView view;
  view.streamed_ = true;
  view.bytes_ = container;
  view.payloads_ = container;
  view.manifest_ = std::move(m);
  return view;
}

}  // namespace flywheel::delta
