// Applying a parsed delta: ApplyInPlace (verify the base, decode and apply every chunk in
// parallel with undo records, verify the target, roll back on any failure), and the two
// calls built on it, DecodeKeyframe and ApplyToCopy.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <new>
#include <optional>
#include <thread>
#include <unordered_map>

#include "delta/codec_internal.h"
#include "delta/context_coding.h"
#include "delta/delta.h"
#include "delta/entropy.h"
#include "delta/format.h"
#include "checkpoint/parallel.h"
#include "delta/wire.h"
#include "kernels/kernels.h"

namespace flywheel::delta {
namespace {

using internal::ByteVec;
using internal::ChecksumMismatch;
using internal::Grow;
using internal::Quote;
using internal::Scratch;
using internal::U8;

// What a chunk overwrote, to put it back if the apply as a whole fails.
struct UndoRecord {
  bool applied = false;
  bool from_prepared = false;       // written from PreparedChunks
  std::vector<uint32_t> positions;  // sparse: positions (relative to word_begin)
  ByteVec old_bytes;                // sparse: old words at positions; dense: the old range
};

std::string ChunkName(const Manifest& m, size_t index) {
  const ChunkEntry& e = m.chunks[index];
  return "chunk " + std::to_string(index) + " (tensor " + Quote(m.tensors[e.tensor_index].name) +
         ", words " + std::to_string(e.word_begin) + ".." +
         std::to_string(e.word_begin + e.word_count) + ")";
}

// Verifies chunk `index`'s checksum and returns its raw (decompressed) bytes: the stored
// bytes themselves, or s.raw.
Result<std::span<const uint8_t>> RawChunk(const DeltaView& delta, size_t index, Scratch& s) {
  const Manifest& m = delta.manifest();
  const ChunkEntry& e = m.chunks[index];
  auto stored = delta.payload(e);
  std::span<const uint8_t> stored_u8(U8(stored), stored.size());
  if (ChecksumMismatch(e.checksum, stored_u8)) {
    return Status::Corruption(ChunkName(m, index) + ": checksum mismatch");
  }
  if (e.compressor == Compressor::kNone) {
    if (stored_u8.size() != e.raw_bytes) {
      return Status::Corruption(ChunkName(m, index) + ": stored size differs from raw size");
    }
    return stored_u8;
  }
  if (e.compressor == Compressor::kZstd) {
    Status st = internal::CheckZstdFrameSize(stored_u8, e.raw_bytes);
    if (!st.ok()) return st.WithContext(ChunkName(m, index));
  }
  s.raw.resize(e.raw_bytes);
  Status st = internal::Decompress(e.compressor, stored_u8, e.raw_bytes, s.raw.data());
  if (!st.ok()) return st.WithContext(ChunkName(m, index));
  return std::span<const uint8_t>(s.raw);
}

bool IsSparse(ChunkKind kind) {
  return kind == ChunkKind::kSparse || kind == ChunkKind::kSparseContext;
}

// Decodes a context-coded chunk against the base words at `region` (the chunk's words).
Status DecodeSparseContext(const Manifest& m, size_t index, std::span<const uint8_t> raw,
                           const uint8_t* region, Scratch& s) {
  const ChunkEntry& e = m.chunks[index];
  const DType dtype = m.tensors[e.tensor_index].dtype;
  const std::optional<kernels::BucketContext> field = internal::ExponentFieldOf(dtype);
  if (!field) {
    return Status::Corruption(ChunkName(m, index) + " is context-coded, but dtype " +
                              DTypeName(dtype) + " has no exponent field to take contexts from");
  }
  Status st = internal::DecodeSparseContext(*field, raw, region, e.word_count,
                                            DTypeWordBytes(dtype), e.changed_words, s);
  if (!st.ok()) return st.WithContext(ChunkName(m, index));
  return Status::Ok();
}

// Decodes a sparse chunk (either kind) into s.positions and zigzagged differences into
// s.z; `region` holds the chunk's base words.
Status DecodeSparse(const Manifest& m, size_t index, std::span<const uint8_t> raw,
                    const uint8_t* region, Scratch& s) {
  const ChunkEntry& e = m.chunks[index];
  if (e.kind == ChunkKind::kSparseContext) return DecodeSparseContext(m, index, raw, region, s);
  wire::Reader r(raw);
  int k = r.U8();
  uint8_t coding = r.U8();
  uint64_t index_bytes = r.Varint();
  auto index_stream = r.Bytes(index_bytes);
  if (r.failed()) return Status::Corruption(ChunkName(m, index) + ": sparse header truncated");
  const size_t count = e.changed_words;
  // Every Rice code is at least one bit: refuse before sizing scratch from `count`.
  if (count > 8 * index_stream.size()) {
    return Status::Corruption(ChunkName(m, index) + ": index stream of " +
                              std::to_string(index_stream.size()) + " bytes cannot hold " +
                              std::to_string(count) + " changes");
  }
  Grow(s.positions, count);
  Grow(s.z, count);
  Status st =
      entropy::RiceDecodePositions(index_stream, k, count, e.word_count, s.positions.data());
  if (st.ok()) {
    if (coding == static_cast<uint8_t>(format::ValueCoding::kRans)) {
      st = entropy::DecodeValues(r.Rest(), count, s.z.data());
    } else if (coding == static_cast<uint8_t>(format::ValueCoding::kGamma)) {
      st = entropy::DecodeValuesGamma(r.Rest(), count, s.z.data());
    } else {
      st = Status::Corruption("unknown value coding " + std::to_string(coding));
    }
  }
  if (!st.ok()) return st.WithContext(ChunkName(m, index));
  return Status::Ok();
}

// A plain sparse chunk whose values are rANS-coded, decoded and applied in one pass
// (entropy::DecodeApplySparse, which puts every word back when the chunk is corrupt).
// False when the chunk is coded otherwise (or malformed): the caller decodes it whole first.
bool TryApplyFused(const ChunkEntry& e, int w, std::span<const uint8_t> raw, uint8_t* region,
                   bool keep_undo, bool keep_positions, UndoRecord* undo, Scratch& s,
                   Status* status) {
  if (e.kind != ChunkKind::kSparse) return false;
  wire::Reader r(raw);
  const int k = r.U8();
  const uint8_t coding = r.U8();
  const uint64_t index_bytes = r.Varint();
  const std::span<const uint8_t> index_stream = r.Bytes(index_bytes);
  const size_t count = e.changed_words;
  if (r.failed() || coding != static_cast<uint8_t>(format::ValueCoding::kRans) ||
      !entropy::FusedRiceK(k) || count > 8 * index_stream.size()) {
    return false;
  }
  entropy::SparseTarget target;
  target.region = region;
  target.w = w;
  if (keep_undo || keep_positions) {
    undo->positions.resize(count);
    target.positions_out = undo->positions.data();
  } else {
    Grow(s.positions, count);
    target.positions_out = s.positions.data();
  }
  if (keep_undo) {
    undo->old_bytes.resize(count * w);
    target.old_out = undo->old_bytes.data();
  } else {
    Grow(s.words_a, count * w);
    target.old_out = s.words_a.data();
  }
  *status = entropy::DecodeApplySparse(index_stream, k, r.Rest(), count, e.word_count, target);
  if (!status->ok()) {
    undo->positions.clear();
    undo->old_bytes.clear();
  }
  return true;
}

// Decodes and applies sparse chunk `index` (either kind) to `region`, its words, keeping
// in `undo` what it overwrote (keep_undo) and which words it wrote (keep_positions). A
// corrupt chunk leaves the region as it was.
Status ApplySparse(const Manifest& m, size_t index, std::span<const uint8_t> raw,
                   uint8_t* region, bool keep_undo, bool keep_positions, UndoRecord* undo,
                   Scratch& s) {
  const ChunkEntry& e = m.chunks[index];
  const int w = DTypeWordBytes(m.tensors[e.tensor_index].dtype);
  Status fused;
  if (TryApplyFused(e, w, raw, region, keep_undo, keep_positions, undo, s, &fused)) {
    return fused.ok() ? fused : fused.WithContext(ChunkName(m, index));
  }
  FW_RETURN_IF_ERROR(DecodeSparse(m, index, raw, region, s));
  const size_t count = e.changed_words;
  void* old_values = nullptr;
  if (keep_undo || keep_positions) {
    undo->positions.assign(s.positions.begin(), s.positions.begin() + count);
  }
  if (keep_undo) {
    undo->old_bytes.resize(count * w);
    old_values = undo->old_bytes.data();
  }
  kernels::ScatterAddZigZag(region, w, s.positions.data(), s.z.data(), count, old_values);
  return Status::Ok();
}

enum PreparedState : int { kEmpty = 0, kPreparing = 1, kReady = 2, kClaimed = 3 };

// Writes the words a PreparedChunks decoded for chunk `index` into `tensor_data`, keeping
// in `undo` what it overwrote (keep_undo) and which words it wrote (keep_positions).
void ApplyPrepared(const Manifest& m, size_t index, std::vector<uint32_t>&& positions,
                   ByteVec&& words, std::span<std::byte> tensor_data, bool keep_undo,
                   bool keep_positions, UndoRecord* undo) {
  const ChunkEntry& e = m.chunks[index];
  const int w = DTypeWordBytes(m.tensors[e.tensor_index].dtype);
  uint8_t* region = U8(tensor_data) + e.word_begin * w;
  const size_t count = positions.size();
  if (keep_undo) {
    undo->old_bytes.resize(count * w);
    kernels::Gather(region, w, positions.data(), undo->old_bytes.data(), count);
  }
  kernels::ScatterApply(region, w, positions.data(), words.data(), count);
  if (keep_undo || keep_positions) undo->positions = std::move(positions);
  words = ByteVec();
  undo->applied = true;
}

}  // namespace

// kEmpty -> kPreparing -> kReady (Prepare) -> kClaimed (the apply takes it); kEmpty ->
// kClaimed when the apply gets there first; kPreparing -> kClaimed when Prepare gives up.
struct PreparedChunks::Chunk {
  std::atomic<int> state{kEmpty};
  uint64_t word_begin = 0;
  std::vector<uint32_t> positions;
  ByteVec words;  // the new words at `positions`, each word's bytes as in the tensor
};

// The apply's side of PreparedChunks.
struct PreparedAccess {
  // Chunk record `index` as prepared, taken by the apply; false when the apply must decode
  // it itself (not prepared, or given up). Waits for a Prepare of it in progress.
  static bool Take(PreparedChunks* prepared, size_t index, std::vector<uint32_t>* positions,
                   ByteVec* words) {
    if (prepared == nullptr || index >= prepared->count_) return false;
    PreparedChunks::Chunk& chunk = prepared->chunks_[index];
    while (true) {
      int state = chunk.state.load(std::memory_order_acquire);
      if (state == kReady) {
        *positions = std::move(chunk.positions);
        *words = std::move(chunk.words);
        chunk.state.store(kClaimed, std::memory_order_release);
        prepared->used_.fetch_add(1);
        return true;
      }
      if (state == kClaimed) return false;
      if (state == kEmpty) {
        if (chunk.state.compare_exchange_weak(state, kClaimed)) return false;
        continue;
      }
      std::this_thread::yield();  // a Prepare of this chunk is running
    }
  }
};

namespace {

// Decodes chunk `index` completely (so a corrupt chunk touches nothing), then writes it
// into `tensor_data`, keeping in `undo` what it overwrote (keep_undo) and which words it
// wrote (keep_positions). A chunk `prepared` holds is written from there.
Status ApplyChunkImpl(const DeltaView& delta, size_t index, std::span<std::byte> tensor_data,
                      bool keep_undo, bool keep_positions, UndoRecord* undo,
                      PreparedChunks* prepared) {
  const Manifest& m = delta.manifest();
  const ChunkEntry& e = m.chunks[index];
  if (IsSparse(e.kind)) {
    std::vector<uint32_t> positions;
    ByteVec words;
    if (PreparedAccess::Take(prepared, e.record, &positions, &words)) {
      ApplyPrepared(m, index, std::move(positions), std::move(words), tensor_data, keep_undo,
                    keep_positions, undo);
      undo->from_prepared = true;
      return Status::Ok();
    }
  }
  const int w = DTypeWordBytes(m.tensors[e.tensor_index].dtype);
  Scratch& s = internal::ThreadScratch();
  FW_ASSIGN_OR_RETURN(std::span<const uint8_t> raw, RawChunk(delta, index, s));
  uint8_t* region = U8(tensor_data) + e.word_begin * w;
  const size_t n = e.word_count;

  if (IsSparse(e.kind)) {
    FW_RETURN_IF_ERROR(ApplySparse(m, index, raw, region, keep_undo, keep_positions, undo, s));
  } else {
    if (keep_undo) undo->old_bytes.assign(region, region + n * w);
    if (e.kind == ChunkKind::kLiteral) {
      kernels::Unshuffle(raw.data(), n, static_cast<size_t>(w), region);
    } else {
      internal::Unshuffle(raw.data(), n, w, region,
                          [](uint8_t old, uint8_t v) { return static_cast<uint8_t>(old ^ v); });
    }
  }
  undo->applied = true;
  return Status::Ok();
}

// ApplyChunkImpl, with allocation failure reported as a status so that the caller's
// rollback runs (no exception leaves a pool thread).
Status ApplyChunk(const DeltaView& delta, size_t index, std::span<std::byte> tensor_data,
                  bool keep_undo, bool keep_positions, UndoRecord* undo, PreparedChunks* prepared) {
  try {
    Status st =
        ApplyChunkImpl(delta, index, tensor_data, keep_undo, keep_positions, undo, prepared);
    internal::TrimScratch(internal::ThreadScratch());
    return st;
  } catch (const std::bad_alloc&) {
    if (undo->applied) return Status::Internal("allocation failed after a chunk was applied");
    return Status::ResourceExhausted(ChunkName(delta.manifest(), index) +
                                     ": out of memory for decoding scratch");
  }
}

void Undo(const Manifest& m, size_t index, std::span<std::byte> tensor_data,
          const UndoRecord& undo) {
  if (!undo.applied) return;
  const ChunkEntry& e = m.chunks[index];
  const int w = DTypeWordBytes(m.tensors[e.tensor_index].dtype);
  uint8_t* region = U8(tensor_data) + e.word_begin * w;
  if (IsSparse(e.kind)) {
    kernels::ScatterApply(region, w, undo.positions.data(), undo.old_bytes.data(),
                          undo.positions.size());
  } else {
    std::memcpy(region, undo.old_bytes.data(), undo.old_bytes.size());
  }
}

// Undo records, one per chunk, recycled per calling thread (a worker applies delta after
// delta) so that their memory is mapped once rather than page-faulted in on every apply.
// Records over 256 MiB in all are freed instead of kept.
class UndoRecords {
 public:
  explicit UndoRecords(size_t chunks) : records_(std::move(Recycled())) {
    records_.resize(chunks);
    for (UndoRecord& u : records_) {
      u.applied = false;
      u.from_prepared = false;
      u.positions.clear();
      u.old_bytes.clear();
    }
  }
  ~UndoRecords() {
    size_t bytes = 0;
    for (const UndoRecord& u : records_)
      bytes += u.positions.capacity() * 4 + u.old_bytes.capacity();
    if (bytes <= (256u << 20)) Recycled() = std::move(records_);
  }
  UndoRecords(const UndoRecords&) = delete;
  UndoRecords& operator=(const UndoRecords&) = delete;

  UndoRecord& operator[](size_t chunk) { return records_[chunk]; }

 private:
  static std::vector<UndoRecord>& Recycled() {
    thread_local std::vector<UndoRecord> recycled;
    return recycled;
  }
  std::vector<UndoRecord> records_;
};

// One ApplyInPlace call.
class Applier {
 public:
  Applier(MutableCheckpointView& state, const DeltaView& delta, const ApplyOptions& options)
      : state_(state), delta_(delta), m_(delta.manifest()), options_(options) {}

  Result<ApplyStats> Run();

 private:
  Status MapState();
  Status CheckBase();
  Status ApplyChunks();
  Status VerifyTarget();
  void Rollback();
  ApplyStats Stats();

  MutableCheckpointView& state_;
  const DeltaView& delta_;
  const Manifest& m_;
  const ApplyOptions& options_;
  std::vector<size_t> state_of_;  // state_of_[i]: the state tensor manifest tensor i patches
  CheckpointView state_view_;
  std::vector<Hash128> hashes_;      // aligned with the state
  std::optional<UndoRecords> undo_;  // from ApplyChunks on
  uint64_t trusted_tensors_ = 0;     // verified ahead, not rehashed
};

Status Applier::MapState() {
  if (state_.size() != m_.tensors.size()) {
    return Status::Mismatch("state has " + std::to_string(state_.size()) + " tensors, the delta " +
                            std::to_string(m_.tensors.size()));
  }
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t i = 0; i < state_.size(); ++i) by_name.emplace(state_[i].name, i);
  state_of_.resize(m_.tensors.size());
  for (size_t i = 0; i < m_.tensors.size(); ++i) {
    const TensorEntry& t = m_.tensors[i];
    auto it = by_name.find(t.name);
    if (it == by_name.end()) return Status::Mismatch("state has no tensor " + Quote(t.name));
    const MutableTensorView& st = state_[it->second];
    if (st.dtype != t.dtype || st.shape != t.shape || st.data.size() != t.byte_size) {
      return Status::Mismatch("tensor " + Quote(t.name) +
                              " differs in dtype, shape or size from the delta's");
    }
    state_of_[i] = it->second;
  }
  state_view_.reserve(state_.size());
  for (const MutableTensorView& t : state_) state_view_.push_back(t.view());
  return Status::Ok();
}

// The state must be the delta's base, tensor by tensor and as a whole (a keyframe has no
// base: its hashes start out zero).
Status Applier::CheckBase() {
  if (m_.keyframe) {
    hashes_.assign(state_.size(), Hash128{});
    return Status::Ok();
  }
  FW_ASSIGN_OR_RETURN(hashes_, internal::HashesOrCompute(state_view_, options_.state_tensor_hashes,
                                                         options_.threads, "state"));
  for (size_t i = 0; i < m_.tensors.size(); ++i) {
    if (hashes_[state_of_[i]] != m_.tensors[i].base_hash) {
      return Status::Mismatch("refusing to apply: this delta's base is version " +
                              std::to_string(m_.base_version) + " (" + m_.base_hash.ToHex() +
                              ") but tensor " + Quote(m_.tensors[i].name) +
                              " of the state differs from it");
    }
  }
  FW_ASSIGN_OR_RETURN(Hash128 base_hash, CheckpointHashFromTensorHashes(state_view_, hashes_));
  if (base_hash != m_.base_hash) {
    return Status::Mismatch("refusing to apply: state hash " + base_hash.ToHex() +
                            " is not the delta's base " + m_.base_hash.ToHex());
  }
  return Status::Ok();
}

// Decodes and applies every chunk; stops early after a failure, rolls back and returns
// the first failing chunk's status.
Status Applier::ApplyChunks() {
  UndoRecords& undo = undo_.emplace(m_.chunks.size());
  std::vector<Status> errors(m_.chunks.size());
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> done_bytes{0};
  uint64_t total_bytes = 0;  // progress counts the word ranges that chunks cover
  for (const ChunkEntry& e : m_.chunks)
    total_bytes += e.word_count * DTypeWordBytes(m_.tensors[e.tensor_index].dtype);
  ParallelFor(m_.chunks.size(), options_.threads, [&](size_t c) {
    if (failed.load(std::memory_order_relaxed)) return;
    const ChunkEntry& e = m_.chunks[c];
    errors[c] = ApplyChunk(delta_, c, state_[state_of_[e.tensor_index]].data,
                           options_.restore_on_failure, options_.report_changes, &undo[c],
                           options_.prepared);
    if (!errors[c].ok()) failed = true;
    if (options_.payload_read) options_.payload_read(delta_.payload(e));
    const uint64_t bytes = e.word_count * DTypeWordBytes(m_.tensors[e.tensor_index].dtype);
    uint64_t done = done_bytes.fetch_add(bytes) + bytes;
    if (options_.progress) options_.progress(done, total_bytes);
  });
  if (failed) {
    Rollback();
    for (const Status& st : errors)
      if (!st.ok()) return st;
  }
  return Status::Ok();
}

// Every tensor that chunks touched is rehashed; untouched ones keep their base hash,
// which the manifest says equals the target hash.
Status Applier::VerifyTarget() {
  std::vector<size_t> touched;
  for (size_t i = 0; i < m_.tensors.size(); ++i) {
    if (m_.tensors[i].chunk_count > 0)
      touched.push_back(i);
    else
      hashes_[state_of_[i]] = m_.tensors[i].target_hash;
  }
  // A tensor PreparedChunks verified ahead (its prepared words on a copy of this base hash
  // to the target hash) is not hashed again when every one of its chunks was written from
  // those words: the bytes are the ones that were hashed.
  std::vector<size_t> rehash;
  for (size_t i : touched) {
    Hash128 verified;
    bool trusted = options_.prepared != nullptr &&
                   options_.prepared->VerifiedHash(i, &verified) &&
                   verified == m_.tensors[i].target_hash;
    const TensorEntry& t = m_.tensors[i];
    for (uint32_t c = t.first_chunk; trusted && c < t.first_chunk + t.chunk_count; ++c) {
      trusted = (*undo_)[c].from_prepared;
    }
    if (trusted) {
      hashes_[state_of_[i]] = verified;
      ++trusted_tensors_;
    } else {
      rehash.push_back(i);
    }
  }
  std::sort(rehash.begin(), rehash.end(),
            [&](size_t a, size_t b) { return m_.tensors[a].byte_size > m_.tensors[b].byte_size; });
  ParallelFor(rehash.size(), options_.threads, [&](size_t k) {
    size_t si = state_of_[rehash[k]];
    hashes_[si] = TensorHash(state_view_[si]);
  });
  for (size_t i : touched) {
    if (hashes_[state_of_[i]] != m_.tensors[i].target_hash) {
      Rollback();
      return Status::Corruption(
          "tensor " + Quote(m_.tensors[i].name) + " hashes to " + hashes_[state_of_[i]].ToHex() +
          " after apply, the delta promises " + m_.tensors[i].target_hash.ToHex());
    }
  }
  FW_ASSIGN_OR_RETURN(Hash128 target_hash, CheckpointHashFromTensorHashes(state_view_, hashes_));
  if (target_hash != m_.target_hash) {
    Rollback();
    return Status::Corruption("checkpoint hashes to " + target_hash.ToHex() +
                              " after apply, the delta promises " + m_.target_hash.ToHex());
  }
  return Status::Ok();
}

void Applier::Rollback() {
  if (!options_.restore_on_failure) return;
  for (size_t c = 0; c < m_.chunks.size(); ++c) {
    Undo(m_, c, state_[state_of_[m_.chunks[c].tensor_index]].data, (*undo_)[c]);
  }
}

ApplyStats Applier::Stats() {
  ApplyStats stats;
  stats.changed_words = m_.changed_words();
  stats.chunks = m_.chunks.size();
  stats.tensors_verified_ahead = trusted_tensors_;
  stats.tensor_hashes = std::move(hashes_);
  if (options_.report_changes) {
    stats.changes.reserve(m_.chunks.size());
    for (size_t c = 0; c < m_.chunks.size(); ++c) {
      const ChunkEntry& e = m_.chunks[c];
      ChangedWords changed;
      changed.state_index = state_of_[e.tensor_index];
      changed.word_begin = e.word_begin;
      changed.word_count = e.word_count;
      changed.all = !IsSparse(e.kind);
      if (!changed.all) {
        changed.positions = (*undo_)[c].positions;
        // A context-coded chunk lists its changes bucket by bucket, not in word order.
        if (e.kind == ChunkKind::kSparseContext) {
          std::sort(changed.positions.begin(), changed.positions.end());
        }
      }
      stats.changes.push_back(std::move(changed));
    }
  }
  return stats;
}

Result<ApplyStats> Applier::Run() {
  FW_RETURN_IF_ERROR(internal::CheckThreads(options_.threads));
  if (options_.before_commit && !options_.restore_on_failure) {
    return Status::InvalidArgument(
        "before_commit needs restore_on_failure (a refusal restores the base)");
  }
  FW_RETURN_IF_ERROR(MapState());
  FW_RETURN_IF_ERROR(CheckBase());
  FW_RETURN_IF_ERROR(ApplyChunks());
  FW_RETURN_IF_ERROR(VerifyTarget());
  ApplyStats stats = Stats();
  if (options_.before_commit) {
    Status accepted = options_.before_commit(stats);
    if (!accepted.ok()) {
      Rollback();
      return accepted;
    }
  }
  return stats;
}

Result<OwnedCheckpoint> AllocateLike(const Manifest& m) {
  OwnedCheckpoint out;
  uint64_t total = m.total_bytes();
  if (total > (uint64_t{1} << 40)) {
    return Status::ResourceExhausted("delta target of " + std::to_string(total) +
                                     " bytes is too large to hold in memory");
  }
  try {
    out.tensors.reserve(m.tensors.size());
    for (const TensorEntry& t : m.tensors) {
      out.tensors.push_back({t.name, t.dtype, t.shape, std::vector<std::byte>(t.byte_size)});
    }
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("cannot allocate " + std::to_string(total) +
                                     " bytes for the target");
  }
  return out;
}

// The target is allocated from declared sizes: first check what can be checked cheaply
// (every chunk's checksum and zstd frame size), so a forged keyframe costs no memory.
Status PrecheckKeyframe(const DeltaView& keyframe) {
  const Manifest& m = keyframe.manifest();
  for (size_t c = 0; c < m.chunks.size(); ++c) {
    auto stored = keyframe.payload(m.chunks[c]);
    std::span<const uint8_t> bytes(U8(stored), stored.size());
    if (ChecksumMismatch(m.chunks[c].checksum, bytes)) {
      return Status::Corruption(ChunkName(m, c) + ": checksum mismatch");
    }
    if (m.chunks[c].compressor == Compressor::kZstd) {
      Status st = internal::CheckZstdFrameSize(bytes, m.chunks[c].raw_bytes);
      if (!st.ok()) return st.WithContext(ChunkName(m, c));
    }
  }
  return Status::Ok();
}

// base_of[i]: the tensor of `base` that manifest tensor i applies to.
Result<std::vector<size_t>> MapBase(const CheckpointView& base, const Manifest& m) {
  if (base.size() != m.tensors.size()) {
    return Status::Mismatch("base has " + std::to_string(base.size()) + " tensors, the delta " +
                            std::to_string(m.tensors.size()));
  }
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t i = 0; i < base.size(); ++i) by_name.emplace(base[i].name, i);
  std::vector<size_t> base_of(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    auto it = by_name.find(m.tensors[i].name);
    if (it == by_name.end())
      return Status::Mismatch("base has no tensor " + Quote(m.tensors[i].name));
    const TensorView& b = base[it->second];
    if (b.dtype != m.tensors[i].dtype || b.shape != m.tensors[i].shape ||
        b.data.size() != m.tensors[i].byte_size) {
      return Status::Mismatch("tensor " + Quote(b.name) +
                              " differs in dtype, shape or size from the delta's");
    }
    base_of[i] = it->second;
  }
  return base_of;
}

}  // namespace

// ---- chunks decoded ahead ---------------------------------------------------------------

PreparedChunks::PreparedChunks(size_t chunk_count, uint64_t budget_bytes)
    : chunks_(new Chunk[chunk_count]), count_(chunk_count), budget_bytes_(budget_bytes) {}

PreparedChunks::~PreparedChunks() = default;

size_t PreparedChunks::prepared() const { return prepared_.load(); }
size_t PreparedChunks::used() const { return used_.load(); }

namespace {

// words[i] += the difference z[i] encodes (wrapping in the word's width).
template <typename U>
void AddZigZag(uint8_t* words, const uint64_t* z, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    U word;
    std::memcpy(&word, words + i * sizeof(U), sizeof(U));
    const uint64_t d = (z[i] >> 1) ^ (0 - (z[i] & 1));
    word = static_cast<U>(word + static_cast<U>(d));
    std::memcpy(words + i * sizeof(U), &word, sizeof(U));
  }
}

}  // namespace

bool PreparedChunks::Prepare(const DeltaView& delta, size_t index,
                             std::span<const std::byte> base_tensor) {
  const Manifest& m = delta.manifest();
  if (index >= m.chunks.size()) return false;
  const ChunkEntry& e = m.chunks[index];
  if (e.record >= count_ || !IsSparse(e.kind)) return false;
  const int w = DTypeWordBytes(m.tensors[e.tensor_index].dtype);
  if (base_tensor.size() != m.tensors[e.tensor_index].byte_size) return false;
  const uint64_t need = e.changed_words * (sizeof(uint32_t) + w);
  if (bytes_.fetch_add(need) + need > budget_bytes_) {
    bytes_.fetch_sub(need);
    return false;
  }
  Chunk& chunk = chunks_[e.record];
  int expected = kEmpty;
  if (!chunk.state.compare_exchange_strong(expected, kPreparing)) {
    bytes_.fetch_sub(need);
    return false;
  }
  bool ok = false;
  try {
    Scratch& s = internal::ThreadScratch();
    Result<std::span<const uint8_t>> raw = RawChunk(delta, index, s);
    const uint8_t* region = U8(base_tensor) + e.word_begin * w;
    if (raw.ok() && DecodeSparse(m, index, *raw, region, s).ok()) {
      const size_t count = e.changed_words;
      chunk.positions.assign(s.positions.begin(), s.positions.begin() + count);
      chunk.words.resize(count * w);
      kernels::Gather(region, w, chunk.positions.data(), chunk.words.data(), count);
      switch (w) {
        case 1: AddZigZag<uint8_t>(chunk.words.data(), s.z.data(), count); break;
        case 2: AddZigZag<uint16_t>(chunk.words.data(), s.z.data(), count); break;
        case 4: AddZigZag<uint32_t>(chunk.words.data(), s.z.data(), count); break;
        default: AddZigZag<uint64_t>(chunk.words.data(), s.z.data(), count); break;
      }
      ok = true;
    }
    internal::TrimScratch(s);
  } catch (const std::bad_alloc&) {
    ok = false;
  }
  if (!ok) {
    chunk.positions = {};
    chunk.words = {};
    bytes_.fetch_sub(need);
    chunk.state.store(kClaimed, std::memory_order_release);  // the apply decodes it and says why
    return false;
  }
  chunk.word_begin = e.word_begin;
  prepared_.fetch_add(1);
  chunk.state.store(kReady, std::memory_order_release);
  return true;
}

bool PreparedChunks::VerifyTensor(size_t tensor, std::span<const uint32_t> records, int word_bytes,
                                  std::span<const std::byte> base_tensor,
                                  const Hash128& target_hash) {
  if (base_tensor.size() % word_bytes != 0) return false;
  // Every chunk must be prepared: wait for one being prepared now.
  for (uint32_t r : records) {
    if (r >= count_) return false;
    while (true) {
      const int state = chunks_[r].state.load(std::memory_order_acquire);
      if (state == kReady) break;
      if (state != kPreparing) return false;
      std::this_thread::yield();
    }
  }
  // The patched tensor is hashed block by block, each block copied into a small buffer
  // (in cache) with the prepared words written over it: one read of the base, as a rehash
  // after the apply would be, and nothing tensor-sized allocated.
  std::vector<const Chunk*> chunks;
  for (uint32_t r : records) chunks.push_back(&chunks_[r]);
  std::sort(chunks.begin(), chunks.end(),
            [](const Chunk* a, const Chunk* b) { return a->word_begin < b->word_begin; });
  const uint64_t words = base_tensor.size() / word_bytes;
  for (const Chunk* chunk : chunks) {
    if (!chunk->positions.empty() && chunk->word_begin + chunk->positions.back() >= words) return false;
  }
  constexpr uint64_t kBlockBytes = 64 << 10;  // a multiple of every word size
  thread_local std::vector<uint8_t> block;
  block.resize(kBlockBytes);
  StreamingHash hasher;
  size_t ci = 0, pi = 0;
  const uint8_t* base = U8(base_tensor);
  for (uint64_t begin = 0; begin < base_tensor.size(); begin += kBlockBytes) {
    const uint64_t length = std::min<uint64_t>(kBlockBytes, base_tensor.size() - begin);
    std::memcpy(block.data(), base + begin, length);
    const uint64_t end_word = (begin + length) / word_bytes;
    while (ci < chunks.size()) {
      const Chunk& chunk = *chunks[ci];
      if (pi == chunk.positions.size()) {
        ++ci, pi = 0;
        continue;
      }
      const uint64_t word = chunk.word_begin + chunk.positions[pi];
      if (word >= end_word) break;
      std::memcpy(block.data() + (word * word_bytes - begin), chunk.words.data() + pi * word_bytes,
                  word_bytes);
      ++pi;
    }
    hasher.Update(block.data(), length);
  }
  const Hash128 hash = hasher.Finish();
  if (hash != target_hash) return false;
  std::lock_guard lock(verified_mu_);
  verified_[tensor] = hash;
  return true;
}

bool PreparedChunks::VerifiedHash(size_t tensor, Hash128* hash) const {
  std::lock_guard lock(verified_mu_);
  auto it = verified_.find(tensor);
  if (it == verified_.end()) return false;
  *hash = it->second;
  return true;
}

Result<ApplyStats> ApplyInPlace(MutableCheckpointView& state, const DeltaView& delta,
                                const ApplyOptions& options) {
  Applier applier(state, delta, options);
  return applier.Run();
}

Result<OwnedCheckpoint> DecodeKeyframe(const DeltaView& keyframe, int threads) {
  const Manifest& m = keyframe.manifest();
  if (!m.keyframe) return Status::InvalidArgument("not a keyframe (a delta needs a base)");
  if (threads < 1 || threads > kMaxThreads) {
    return Status::InvalidArgument("threads must be in [1, " + std::to_string(kMaxThreads) + "]");
  }
  FW_RETURN_IF_ERROR(PrecheckKeyframe(keyframe));
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint out, AllocateLike(m));
  MutableCheckpointView view = out.mutable_view();
  ApplyOptions options;
  options.threads = threads;
  options.restore_on_failure = false;
  FW_RETURN_IF_ERROR(ApplyInPlace(view, keyframe, options).status());
  return out;
}

Result<OwnedCheckpoint> ApplyToCopy(const CheckpointView& base, const DeltaView& delta,
                                    const ApplyOptions& options) {
  const Manifest& m = delta.manifest();
  if (m.keyframe) return DecodeKeyframe(delta, options.threads);
  FW_ASSIGN_OR_RETURN(std::vector<size_t> base_of, MapBase(base, m));
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint out, AllocateLike(m));
  ParallelFor(m.tensors.size(), options.threads, [&](size_t i) {
    const TensorView& b = base[base_of[i]];
    if (!b.data.empty()) std::memcpy(out.tensors[i].data.data(), b.data.data(), b.data.size());
  });
  MutableCheckpointView view = out.mutable_view();
  ApplyOptions inner = options;
  inner.restore_on_failure = false;
  if (!options.state_tensor_hashes.empty()) {
    if (options.state_tensor_hashes.size() != base.size()) {
      return Status::InvalidArgument("state tensor hashes do not match the base's tensor count");
    }
    inner.state_tensor_hashes.resize(m.tensors.size());
    for (size_t i = 0; i < m.tensors.size(); ++i)
      inner.state_tensor_hashes[i] = options.state_tensor_hashes[base_of[i]];
  }
  FW_RETURN_IF_ERROR(ApplyInPlace(view, delta, inner).status());
  return out;
}

}  // namespace flywheel::delta
