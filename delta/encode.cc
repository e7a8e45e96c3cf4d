// The delta encoder: Encode and EncodeKeyframe. Checks the options and pairs base and
// target tensors, cuts every tensor into chunks, encodes the chunks in parallel (sparse,
// dense-xor or literal, whichever stores smallest), hashes both checkpoints, and writes
// header + manifest + payloads as laid out in delta/format.h.
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <optional>
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
using internal::Checksum;
using internal::Grow;
using internal::Quote;
using internal::Scratch;
using internal::U8;

// ---- one chunk ----------------------------------------------------------------------

struct ChunkTask {
  uint32_t tensor_index;
  uint64_t word_begin;
  uint64_t word_count;
};

// Below this many changes a chunk is coded both ways and the smaller kept.
constexpr size_t kContextTryBoth = 4096;

struct EncodedChunk {
  ChunkEntry entry;
  ByteVec payload;
  bool present = false;  // false: no word of the chunk changed, nothing is stored
  Status error;          // ResourceExhausted when scratch could not be allocated
};

// For the changed words just found in one block: the gap to the previous change, the
// zigzagged difference and the base word, read while the block is in cache.
// base_words may be null (only the context coding reads them).
template <int W>
void GapsAndDiffs(const uint8_t* base, const uint8_t* target, const uint32_t* block_positions,
                  size_t found, uint32_t block_begin, uint32_t& next_free, uint32_t* gaps,
                  uint64_t* z, uint64_t* base_words) {
  using U = typename internal::WordOf<W>::U;
  using S = typename internal::WordOf<W>::S;
  for (size_t i = 0; i < found; ++i) {
    const uint32_t p = block_positions[i];
    U b, t;
    std::memcpy(&b, base + size_t{p} * W, W);
    std::memcpy(&t, target + size_t{p} * W, W);
    z[i] = entropy::ZigZag(static_cast<S>(static_cast<U>(t - b)));
    if (base_words != nullptr) base_words[i] = b;
    gaps[i] = block_begin + p - next_free;
    next_free = block_begin + p + 1;
  }
}

// Compares base and target in cache-sized blocks (feeding each block to the hashers first,
// when given) and, for the changed words, fills s.gaps and s.z while the block is still in
// cache. Returns the number of changed words. s.base_words is filled only `with_base_words`
// (the context coding's need).
size_t CompareAndGather(int w, const uint8_t* base, const uint8_t* target, size_t n, Scratch& s,
                        StreamingHash* base_hasher, StreamingHash* target_hasher,
                        bool with_base_words) {
  constexpr size_t kBlockBytes = 64 << 10;
  const size_t block_words = kBlockBytes / w;
  Grow(s.positions, std::min(n, block_words));
  Grow(s.gaps, n);
  Grow(s.z, n);
  if (with_base_words) Grow(s.base_words, n);
  size_t m = 0;
  uint32_t next_free = 0;
  for (size_t begin = 0; begin < n; begin += block_words) {
    const size_t len = std::min(block_words, n - begin);
    const uint8_t* b = base + begin * w;
    const uint8_t* t = target + begin * w;
    if (base_hasher) base_hasher->Update(b, len * w);
    if (target_hasher) target_hasher->Update(t, len * w);
    const size_t found = kernels::CompareCompact(b, t, len, w, s.positions.data());
    if (found == 0) continue;
    const uint32_t block_begin = static_cast<uint32_t>(begin);
    uint32_t* gaps = s.gaps.data() + m;
    uint64_t* z = s.z.data() + m;
    uint64_t* base_words = with_base_words ? s.base_words.data() + m : nullptr;
    switch (w) {
      case 1:
        GapsAndDiffs<1>(b, t, s.positions.data(), found, block_begin, next_free, gaps, z,
                          base_words);
        break;
      case 2:
        GapsAndDiffs<2>(b, t, s.positions.data(), found, block_begin, next_free, gaps, z,
                          base_words);
        break;
      case 4:
        GapsAndDiffs<4>(b, t, s.positions.data(), found, block_begin, next_free, gaps, z,
                          base_words);
        break;
      default:
        GapsAndDiffs<8>(b, t, s.positions.data(), found, block_begin, next_free, gaps, z,
                          base_words);
        break;
    }
    m += found;
  }
  return m;
}

// Builds the raw sparse chunk from s.gaps and s.z (m changed words).
void BuildSparseRaw(size_t m, Scratch& s, ByteVec* raw) {
  const std::span<const uint32_t> gaps(s.gaps.data(), m);
  const std::span<const uint64_t> z(s.z.data(), m);
  int k = entropy::ChooseRiceK(gaps);
  // Per-thread buffers: fresh ones of the coders' worst-case sizes would be page-faulted
  // in on every chunk.
  thread_local ByteVec index, values;
  index.clear();
  values.clear();
  entropy::RiceEncode(gaps, k, &index);
  raw->clear();
  raw->push_back(static_cast<uint8_t>(k));
  entropy::EncodeValues(z, &values);
  format::ValueCoding coding = format::ValueCoding::kRans;
  if (m < 256) {
    ByteVec gamma;
    entropy::EncodeValuesGamma(z, &gamma);
    if (gamma.size() < values.size()) {
      values.assign(gamma.begin(), gamma.end());
      coding = format::ValueCoding::kGamma;
    }
  }
  raw->push_back(static_cast<uint8_t>(coding));
  wire::PutVarint(raw, index.size());
  wire::PutBytes(raw, index);
  wire::PutBytes(raw, values);
  // As TrimScratch: a pool thread does not hold an unusually large chunk's peak forever.
  constexpr size_t kKeepBytes = 64 << 20;
  if (index.capacity() > kKeepBytes) ByteVec().swap(index);
  if (values.capacity() > kKeepBytes) ByteVec().swap(values);
}

// Keeps `raw` (or its compressed form) as the chunk's payload when it stores smaller than
// what `out` holds so far. The payload is copied out at its exact size: the scratch
// buffers keep their (already mapped) memory for the next chunk, which would otherwise
// page-fault a fresh buffer of the chunk's worst-case size in.
void KeepIfSmaller(ChunkKind kind, ByteVec& raw, ByteVec& packed, const EncodeOptions& options,
                   EncodedChunk& out, bool try_compress = true) {
  bool compressed =
      try_compress && internal::Compress(options.compressor, options.zstd_level, raw, &packed);
  uint64_t stored = compressed ? packed.size() : raw.size();
  bool better = !out.present || stored < out.entry.payload_bytes;
  if (!better) return;
  out.present = true;
  out.entry.kind = kind;
  out.entry.compressor = compressed ? options.compressor : Compressor::kNone;
  out.entry.raw_bytes = raw.size();
  out.entry.payload_bytes = stored;
  const ByteVec& kept = compressed ? packed : raw;
  out.payload.assign(kept.begin(), kept.end());
}

// Tries the two dense forms of n words (XOR with the base, and the target itself).
void TryDense(int w, size_t n, const uint8_t* b, const uint8_t* t, Scratch& s,
              const EncodeOptions& options, EncodedChunk& out) {
  const uint64_t dense_bytes = n * w;
  s.raw2.resize(dense_bytes);
  s.words_a.resize(dense_bytes);
  for (size_t i = 0; i < dense_bytes; ++i) s.words_a[i] = t[i] ^ b[i];
  internal::Shuffle(s.words_a.data(), n, w, s.raw2.data());
  KeepIfSmaller(ChunkKind::kDenseXor, s.raw2, s.packed2, options, out);
  s.raw2.resize(dense_bytes);  // KeepIfSmaller may have swapped the buffer out
  internal::Shuffle(t, n, w, s.raw2.data());
  KeepIfSmaller(ChunkKind::kLiteral, s.raw2, s.packed2, options, out);
}

// The m changed words as a context-coded chunk (kind 3) into s.raw2, kept when smaller
// than the plain sparse form in `out`. Small chunks try both (the per-bucket tables can
// outweigh the gain); larger ones go straight to the context coding.
void TrySparseContext(const kernels::BucketContext& field, int w, size_t n, const uint8_t* b,
                      size_t m, Scratch& s, const EncodeOptions& options, EncodedChunk& out) {
  Grow(s.positions, m);
  int64_t previous = -1;
  for (size_t i = 0; i < m; ++i) {
    previous += static_cast<int64_t>(s.gaps[i]) + 1;
    s.positions[i] = static_cast<uint32_t>(previous);
  }
  internal::EncodeSparseContext(field, b, n, w, {s.positions.data(), m}, {s.z.data(), m},
                                {s.base_words.data(), m}, s, &s.raw2);
  KeepIfSmaller(ChunkKind::kSparseContext, s.raw2, s.packed2, options, out, false);
}

// Encodes one chunk; `base` is null for a keyframe. The hashers, when given, are fed the
// chunk's bytes (in order: the caller runs a tensor's chunks in order on one thread).
// `context`: the dtype's exponent field when it has one (and the context coding is on).
EncodedChunk EncodeChunk(const ChunkTask& task, int w, const uint8_t* base, const uint8_t* target,
                         const EncodeOptions& options, bool keyframe,
                         const std::optional<kernels::BucketContext>& context,
                         StreamingHash* base_hasher = nullptr,
                         StreamingHash* target_hasher = nullptr) {
  Scratch& s = internal::ThreadScratch();
  EncodedChunk out;
  ChunkEntry& e = out.entry;
  e.tensor_index = task.tensor_index;
  e.word_begin = task.word_begin;
  e.word_count = task.word_count;
  const size_t n = task.word_count;
  const uint8_t* t = target + task.word_begin * w;
  const uint8_t* b = base ? base + task.word_begin * w : nullptr;
  const uint64_t dense_bytes = n * w;

  if (keyframe) {
    if (target_hasher) target_hasher->Update(t, dense_bytes);
    s.raw.resize(dense_bytes);
    internal::Shuffle(t, n, w, s.raw.data());
    e.changed_words = n;
    KeepIfSmaller(ChunkKind::kLiteral, s.raw, s.packed, options, out);
  } else {
    size_t m = CompareAndGather(w, b, t, n, s, base_hasher, target_hasher, context.has_value());
    if (m == 0) return out;
    e.changed_words = m;
    if (!context || m < kContextTryBoth) {
      BuildSparseRaw(m, s, &s.raw);
      // Rice-coded positions and rANS-coded values are at their entropy already: a general
      // compressor only costs time there (it never stored smaller in the codec bench).
      const bool entropy_coded =
          s.raw.size() > 1 && s.raw[1] == static_cast<uint8_t>(format::ValueCoding::kRans);
      KeepIfSmaller(ChunkKind::kSparse, s.raw, s.packed, options, out, !entropy_coded);
    }
    if (context) TrySparseContext(*context, w, n, b, m, s, options, out);
    // Dense forms are tried only when the sparse one is not clearly small.
    if (out.entry.payload_bytes * 8 > dense_bytes) TryDense(w, n, b, t, s, options, out);
  }
  e.checksum = Checksum(out.payload);
  internal::TrimScratch(s);
  return out;
}

// ---- checking the inputs --------------------------------------------------------------

Status ValidateView(const TensorView& t, const char* role) {
  FW_ASSIGN_OR_RETURN(uint64_t bytes, TensorByteSize(t.dtype, t.shape));
  if (bytes != t.data.size()) {
    return Status::InvalidArgument(std::string(role) + " tensor " + Quote(t.name) + " has " +
                                   std::to_string(t.data.size()) +
                                   " bytes, its dtype and shape need " + std::to_string(bytes));
  }
  return Status::Ok();
}

// What the default DecodeLimits would refuse is refused here, so every delta this encoder
// writes can be read back.
Status CheckOptions(const CheckpointView& target, const EncodeOptions& options) {
  FW_RETURN_IF_ERROR(internal::CheckThreads(options.threads));
  if (options.chunk_bytes < 4096 || options.chunk_bytes > (64ull << 20)) {
    return Status::InvalidArgument("chunk size must be in [4 KiB, 64 MiB], got " +
                                   std::to_string(options.chunk_bytes));
  }
  const DecodeLimits limits;
  if (target.size() > limits.max_tensors) {
    return Status::InvalidArgument("checkpoint has " + std::to_string(target.size()) +
                                   " tensors, more than a delta can hold (" +
                                   std::to_string(limits.max_tensors) + ")");
  }
  uint64_t metadata_bytes = 0;
  for (const auto& [key, value] : options.metadata) metadata_bytes += key.size() + value.size();
  if (metadata_bytes > limits.max_metadata_bytes) {
    return Status::InvalidArgument("metadata of " + std::to_string(metadata_bytes) +
                                   " bytes exceeds " + std::to_string(limits.max_metadata_bytes));
  }
  for (const TensorView& t : target) {
    if (t.name.size() > limits.max_name_bytes || t.shape.size() > format::kMaxRank) {
      return Status::InvalidArgument("tensor " + Quote(t.name.substr(0, 64)) +
                                     " has a name over 64 KiB or a rank over 64");
    }
  }
  if (options.compressor == Compressor::kZstd &&
      (options.zstd_level < 1 || options.zstd_level > ZSTD_maxCLevel())) {
    return Status::InvalidArgument("zstd level must be in [1, " + std::to_string(ZSTD_maxCLevel()) +
                                   "], got " + std::to_string(options.zstd_level));
  }
  return Status::Ok();
}

// Validates the target's tensors; fills `target_index` (name -> index in target).
Status IndexTarget(const CheckpointView& target,
                   std::unordered_map<std::string, size_t>* target_index) {
  for (size_t i = 0; i < target.size(); ++i) {
    FW_RETURN_IF_ERROR(ValidateView(target[i], "target"));
    if (target[i].name.empty())
      return Status::InvalidArgument("target has a tensor with an empty name");
    if (!target_index->emplace(target[i].name, i).second) {
      return Status::InvalidArgument("target has two tensors named " + Quote(target[i].name));
    }
  }
  return Status::Ok();
}

// Pairs every target tensor with its base tensor by name: `base_aligned` gets the base
// tensors in target order. Mismatch when names, dtypes or shapes differ.
Status AlignBase(const CheckpointView& base, const CheckpointView& target,
                 const std::unordered_map<std::string, size_t>& target_index,
                 CheckpointView* base_aligned) {
  if (base.size() != target.size()) {
    return Status::Mismatch("base has " + std::to_string(base.size()) + " tensors, target has " +
                            std::to_string(target.size()));
  }
  base_aligned->resize(target.size());
  std::vector<bool> seen(target.size(), false);
  for (const TensorView& bt : base) {
    FW_RETURN_IF_ERROR(ValidateView(bt, "base"));
    auto it = target_index.find(bt.name);
    if (it == target_index.end()) {
      return Status::Mismatch("base tensor " + Quote(bt.name) + " is not in the target");
    }
    if (seen[it->second])
      return Status::InvalidArgument("base has two tensors named " + Quote(bt.name));
    seen[it->second] = true;
    const TensorView& tt = target[it->second];
    if (bt.dtype != tt.dtype || bt.shape != tt.shape) {
      return Status::Mismatch("tensor " + Quote(bt.name) + " differs in dtype or shape: base " +
                              DTypeName(bt.dtype) + ", target " + DTypeName(tt.dtype));
    }
    (*base_aligned)[it->second] = bt;
  }
  return Status::Ok();
}

// ---- the container --------------------------------------------------------------------

// The fields both header forms (whole and streamed) open with: magic, format version,
// flags, four reserved bytes.
ByteVec HeaderStart(uint64_t version, bool keyframe) {
  ByteVec header(format::kMagic, format::kMagic + 8);
  wire::PutFixed(&header, version, 2);
  wire::PutFixed(&header, keyframe ? format::kFlagKeyframe : 0, 2);
  wire::PutFixed(&header, 0, 4);
  return header;
}

void PutHash(ByteVec* out, const Hash128& h) {
  wire::PutFixed(out, h.low, 8);
  wire::PutFixed(out, h.high, 8);
}

void PutMetadata(ByteVec* out, const std::map<std::string, std::string>& metadata) {
  wire::PutVarint(out, metadata.size());
  for (const auto& [key, value] : metadata) {
    wire::PutString(out, key);
    wire::PutString(out, value);
  }
}

// A tensor's name, dtype and shape, as both container formats write them.
void PutLayout(ByteVec* out, const TensorView& t) {
  wire::PutString(out, t.name);
  wire::PutU8(out, static_cast<uint8_t>(t.dtype));
  wire::PutVarint(out, t.shape.size());
  for (int64_t d : t.shape) wire::PutVarint(out, static_cast<uint64_t>(d));
}

// A chunk's fields from word_begin to the payload checksum, as both formats write them.
void PutChunkFields(ByteVec* out, const ChunkEntry& e) {
  wire::PutVarint(out, e.word_begin);
  wire::PutVarint(out, e.word_count);
  wire::PutU8(out, static_cast<uint8_t>(e.kind));
  wire::PutU8(out, static_cast<uint8_t>(e.compressor));
  wire::PutVarint(out, e.changed_words);
  wire::PutVarint(out, e.raw_bytes);
  wire::PutVarint(out, e.payload_bytes);
  wire::PutFixed(out, e.checksum, 8);
}

// The word ranges of every tensor: tensor i's chunks are tasks[first_task[i] ..
// first_task[i + 1]).
struct ChunkPlan {
  std::vector<ChunkTask> tasks;
  std::vector<size_t> first_task;
  uint64_t total_bytes = 0;
  uint64_t largest_tensor_bytes = 0;
};

ChunkPlan PlanChunks(const CheckpointView& target, uint64_t chunk_bytes) {
  ChunkPlan plan;
  plan.first_task.assign(target.size() + 1, 0);
  for (size_t i = 0; i < target.size(); ++i) {
    const int w = DTypeWordBytes(target[i].dtype);
    const uint64_t words = target[i].data.size() / w;
    const uint64_t chunk_words =
        std::min<uint64_t>(kMaxChunkWords, std::max<uint64_t>(1, chunk_bytes / w));
    plan.first_task[i] = plan.tasks.size();
    for (uint64_t begin = 0; begin < words; begin += chunk_words) {
      plan.tasks.push_back({static_cast<uint32_t>(i), begin, std::min(chunk_words, words - begin)});
    }
    plan.total_bytes += target[i].data.size();
    plan.largest_tensor_bytes =
        std::max<uint64_t>(plan.largest_tensor_bytes, target[i].data.size());
  }
  plan.first_task[target.size()] = plan.tasks.size();
  return plan;
}

// One Encode or EncodeKeyframe call, from validated inputs to the container bytes.
class DeltaEncoder {
 public:
  // `base_aligned` holds the base tensors in target order (empty for a keyframe).
  DeltaEncoder(const CheckpointView* base, const CheckpointView& target,
               CheckpointView base_aligned, std::unordered_map<std::string, size_t> target_index,
               const EncodeOptions& options, StreamSink* sink = nullptr)
      : sink_(sink),
        keyframe_(base == nullptr),
        base_(base),
        target_(target),
        base_aligned_(std::move(base_aligned)),
        target_index_(std::move(target_index)),
        options_(options),
        plan_(PlanChunks(target, options.chunk_bytes)),
        encoded_(plan_.tasks.size()),
        base_hashes_(target.size()),
        target_hashes_(target.size()) {}

  Result<std::vector<std::byte>> Run();
  // Run, written to the sink as a format-2 container.
  Status RunStreamed();

 private:
  // Streaming: the header and prologue; one chunk's record; the end record.
  Status BeginStream(const Hash128& base_hash);
  void StreamChunk(size_t k);
  void StreamTensor(size_t i);  // tensor i's record: all its chunks are out, its hash known
  Status EndStream(const Hash128& target_hash);

  void EncodeTask(size_t k, StreamingHash* base_hasher, StreamingHash* target_hasher);
  void EncodeAndHash();
  Status TakeGivenBaseHashes();
  Status HashThenEncode();
  ByteVec BuildManifest(const Hash128& base_hash, const Hash128& target_hash) const;
  Result<std::vector<std::byte>> Assemble(const ByteVec& manifest) const;

  StreamSink* const sink_;  // null: Run assembles the container in memory
  std::mutex sink_mu_;      // one Write at a time, each record whole
  Status sink_error_;       // the first failed Write (guarded by sink_mu_)
  uint64_t records_ = 0;    // chunk records written (guarded by sink_mu_)
  std::vector<uint64_t> streamed_changed_;  // per tensor (guarded by sink_mu_)
  // Streaming without fused hashing: per tensor, chunk tasks not finished yet.
  std::unique_ptr<std::atomic<uint64_t>[]> tasks_left_;
  bool base_hashed_ = false;  // base_hashes_ hold the base's hashes already
  const bool keyframe_;
  const CheckpointView* base_;  // null for a keyframe
  const CheckpointView& target_;
  const CheckpointView base_aligned_;
  std::unordered_map<std::string, size_t> target_index_;
  const EncodeOptions& options_;
  const ChunkPlan plan_;
  std::vector<EncodedChunk> encoded_;                 // index-aligned with plan_.tasks
  std::vector<Hash128> base_hashes_, target_hashes_;  // target order
  std::atomic<uint64_t> done_bytes_{0};
};

void DeltaEncoder::EncodeTask(size_t k, StreamingHash* base_hasher, StreamingHash* target_hasher) {
  const ChunkTask& task = plan_.tasks[k];
  const TensorView& target = target_[task.tensor_index];
  const int w = DTypeWordBytes(target.dtype);
  const uint8_t* b = keyframe_ ? nullptr : U8(base_aligned_[task.tensor_index].data);
  const std::optional<kernels::BucketContext> context =
      options_.context_coding ? internal::ExponentFieldOf(target.dtype) : std::nullopt;
  try {
    encoded_[k] = EncodeChunk(task, w, b, U8(target.data), options_, keyframe_, context,
                              base_hasher, target_hasher);
  } catch (const std::bad_alloc&) {
    encoded_[k] = EncodedChunk{};
    encoded_[k].error =
        Status::ResourceExhausted("out of memory encoding tensor " + Quote(target.name));
  }
  if (sink_ != nullptr) StreamChunk(k);
  uint64_t done = done_bytes_.fetch_add(task.word_count * w) + task.word_count * w;
  if (options_.progress) options_.progress(done, plan_.total_bytes);
}

// Hashing inside the compare pass reads every byte once instead of twice; a tensor's
// chunks then run in order on one thread, largest tensor first.
void DeltaEncoder::EncodeAndHash() {
  std::vector<size_t> order(target_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t c) { return target_[a].data.size() > target_[c].data.size(); });
  // Given base hashes (a publisher's cached head) are taken as they are; only the target
  // is hashed then.
  const bool hash_base = !keyframe_ && !base_hashed_ && options_.base_tensor_hashes.empty();
  ParallelFor(order.size(), options_.threads, [&](size_t j) {
    const size_t i = order[j];
    StreamingHash base_hasher, target_hasher;
    for (size_t k = plan_.first_task[i]; k < plan_.first_task[i + 1]; ++k) {
      EncodeTask(k, hash_base ? &base_hasher : nullptr, &target_hasher);
    }
    target_hashes_[i] = target_hasher.Finish();
    if (hash_base) base_hashes_[i] = base_hasher.Finish();
    if (sink_ != nullptr) StreamTensor(i);
  });
}

// The caller's base hashes (index-aligned with `base`), placed at their target tensors.
Status DeltaEncoder::TakeGivenBaseHashes() {
  if (base_hashed_) return Status::Ok();
  base_hashed_ = true;
  FW_ASSIGN_OR_RETURN(
      std::vector<Hash128> given,
      internal::HashesOrCompute(*base_, options_.base_tensor_hashes, options_.threads, "base"));
  for (size_t i = 0; i < base_->size(); ++i) {
    base_hashes_[target_index_[(*base_)[i].name]] = given[i];
  }
  return Status::Ok();
}

// Hashes first (given or computed; base hashes are given index-aligned with `base`), then
// encodes every chunk of every tensor whose bytes changed.
Status DeltaEncoder::HashThenEncode() {
  std::vector<bool> skip(plan_.tasks.size(), false);
  FW_ASSIGN_OR_RETURN(target_hashes_,
                      internal::HashesOrCompute(target_, options_.target_tensor_hashes,
                                                options_.threads, "target"));
  if (!keyframe_) {
    FW_RETURN_IF_ERROR(TakeGivenBaseHashes());
    // Unchanged tensors (equal hashes and bytes) need no comparison at all.
    for (size_t i = 0; i < target_.size(); ++i) {
      if (base_hashes_[i] == target_hashes_[i] &&
          std::ranges::equal(base_aligned_[i].data, target_[i].data)) {
        for (size_t k = plan_.first_task[i]; k < plan_.first_task[i + 1]; ++k) skip[k] = true;
        done_bytes_ += target_[i].data.size();
      }
    }
  }
  if (sink_ != nullptr) {
    // A tensor's record goes out when its last chunk is done (at once when none is left).
    tasks_left_.reset(new std::atomic<uint64_t>[target_.size()]);
    for (size_t i = 0; i < target_.size(); ++i) {
      uint64_t left = 0;
      for (size_t k = plan_.first_task[i]; k < plan_.first_task[i + 1]; ++k) left += !skip[k];
      tasks_left_[i] = left;
      if (left == 0) StreamTensor(i);
    }
  }
  ParallelFor(plan_.tasks.size(), options_.threads, [&](size_t k) {
    if (skip[k]) return;
    EncodeTask(k, nullptr, nullptr);
    const uint32_t i = plan_.tasks[k].tensor_index;
    if (sink_ != nullptr && tasks_left_[i].fetch_sub(1) == 1) StreamTensor(i);
  });
  return Status::Ok();
}

ByteVec DeltaEncoder::BuildManifest(const Hash128& base_hash, const Hash128& target_hash) const {
  std::vector<uint64_t> changed(target_.size(), 0), chunk_count(target_.size(), 0);
  uint64_t present_chunks = 0;
  for (const EncodedChunk& c : encoded_) {
    if (!c.present) continue;
    changed[c.entry.tensor_index] += c.entry.changed_words;
    ++chunk_count[c.entry.tensor_index];
    ++present_chunks;
  }
  ByteVec manifest;
  manifest.reserve(256 + target_.size() * 96 + present_chunks * 40);
  wire::PutVarint(&manifest, keyframe_ ? 0 : options_.base_version);
  wire::PutVarint(&manifest, options_.target_version);
  PutHash(&manifest, keyframe_ ? Hash128{} : base_hash);
  PutHash(&manifest, target_hash);
  PutMetadata(&manifest, options_.metadata);
  wire::PutVarint(&manifest, target_.size());
  for (size_t i = 0; i < target_.size(); ++i) {
    const TensorView& t = target_[i];
    PutLayout(&manifest, t);
    PutHash(&manifest, keyframe_ ? Hash128{} : base_hashes_[i]);
    PutHash(&manifest, target_hashes_[i]);
    wire::PutVarint(&manifest, keyframe_ ? t.data.size() / DTypeWordBytes(t.dtype) : changed[i]);
    wire::PutVarint(&manifest, chunk_count[i]);
  }
  wire::PutVarint(&manifest, present_chunks);
  for (const EncodedChunk& c : encoded_) {
    if (!c.present) continue;
    PutChunkFields(&manifest, c.entry);
  }
  return manifest;
}

// Header, manifest and the present chunks' payloads, in chunk order.
Result<std::vector<std::byte>> DeltaEncoder::Assemble(const ByteVec& manifest) const {
  uint64_t payload_bytes = 0;
  for (const EncodedChunk& c : encoded_) {
    if (c.present) payload_bytes += c.payload.size();
  }
  ByteVec header = HeaderStart(format::kVersion, keyframe_);
  wire::PutFixed(&header, manifest.size(), 8);
  wire::PutFixed(&header, payload_bytes, 8);
  wire::PutFixed(&header, Checksum(manifest), 8);
  wire::PutFixed(&header, Checksum(header), 8);

  std::vector<std::byte> out;
  try {
    out.resize(header.size() + manifest.size() + payload_bytes);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("cannot allocate " + std::to_string(out.size()) +
                                     " bytes for the delta");
  }
  uint8_t* p = reinterpret_cast<uint8_t*>(out.data());
  std::memcpy(p, header.data(), header.size());
  p += header.size();
  std::memcpy(p, manifest.data(), manifest.size());
  p += manifest.size();
  for (const EncodedChunk& c : encoded_) {
    if (!c.present) continue;
    std::memcpy(p, c.payload.data(), c.payload.size());
    p += c.payload.size();
  }
  return out;
}

Result<std::vector<std::byte>> DeltaEncoder::Run() {
  // The target is hashed here unless its hashes are given (the base's may be: a
  // publisher keeps its head's).
  const bool hash_here = options_.target_tensor_hashes.empty();
  // Fusing hashing into the compare pass serializes each tensor's chunks: only when no
  // tensor is so large that it would leave the other threads idle.
  const bool fused =
      hash_here &&
      (options_.threads == 1 || plan_.largest_tensor_bytes * options_.threads <= plan_.total_bytes);
  if (fused) {
    if (!keyframe_ && !options_.base_tensor_hashes.empty()) {
      FW_RETURN_IF_ERROR(TakeGivenBaseHashes());
    }
    EncodeAndHash();
  } else {
    FW_RETURN_IF_ERROR(HashThenEncode());
  }
  Hash128 base_hash;
  if (!keyframe_) {
    FW_ASSIGN_OR_RETURN(base_hash, CheckpointHashFromTensorHashes(base_aligned_, base_hashes_));
  }
  FW_ASSIGN_OR_RETURN(Hash128 target_hash, CheckpointHashFromTensorHashes(target_, target_hashes_));
  for (const EncodedChunk& c : encoded_) FW_RETURN_IF_ERROR(c.error);

  const ByteVec manifest = BuildManifest(base_hash, target_hash);
  const DecodeLimits limits;
  if (manifest.size() > limits.max_manifest_bytes) {
    return Status::InvalidArgument(
        "the delta's manifest would be " + std::to_string(manifest.size()) + " bytes, over the " +
        std::to_string(limits.max_manifest_bytes) + "-byte limit: use larger chunks");
  }
  return Assemble(manifest);
}

Status DeltaEncoder::BeginStream(const Hash128& base_hash) {
  ByteVec prologue;
  wire::PutVarint(&prologue, keyframe_ ? 0 : options_.base_version);
  wire::PutVarint(&prologue, options_.target_version);
  PutHash(&prologue, keyframe_ ? Hash128{} : base_hash);
  PutMetadata(&prologue, options_.metadata);
  wire::PutVarint(&prologue, target_.size());
  for (size_t i = 0; i < target_.size(); ++i) {
    PutLayout(&prologue, target_[i]);
    PutHash(&prologue, keyframe_ ? Hash128{} : base_hashes_[i]);
  }
  wire::PutVarint(&prologue, plan_.tasks.size());
  if (prologue.size() > DecodeLimits{}.max_manifest_bytes) {
    return Status::InvalidArgument("the delta's prologue would be " +
                                   std::to_string(prologue.size()) + " bytes, over the limit");
  }
  ByteVec header = HeaderStart(format::kStreamedVersion, keyframe_);
  wire::PutFixed(&header, prologue.size(), 8);
  wire::PutFixed(&header, Checksum(prologue), 8);
  wire::PutFixed(&header, Checksum(header), 8);
  // Every stored payload is at most the chunk's dense size (a larger sparse form is never
  // kept), and every record header at most 79 bytes.
  uint64_t bound = header.size() + prologue.size() + 1 + 10 + 16 + 26 * target_.size() + 8 +
                   target_.size() * (1 + 10 + 16 + 10 + 8);
  for (const ChunkTask& task : plan_.tasks) {
    bound += 79 + task.word_count * DTypeWordBytes(target_[task.tensor_index].dtype);
  }
  streamed_changed_.assign(target_.size(), 0);
  FW_RETURN_IF_ERROR(sink_->Begin(bound));
  FW_RETURN_IF_ERROR(sink_->Write(std::as_bytes(std::span(header.data(), header.size()))));
  return sink_->Write(std::as_bytes(std::span(prologue.data(), prologue.size())));
}

// Runs on the encoding thread that finished chunk `k`: its record goes out at once and
// its payload is freed.
void DeltaEncoder::StreamChunk(size_t k) {
  EncodedChunk& c = encoded_[k];
  if (!c.present || !c.error.ok()) return;
  const ChunkEntry& e = c.entry;
  ByteVec header;
  wire::PutU8(&header, format::kTagChunk);
  wire::PutVarint(&header, e.tensor_index);
  PutChunkFields(&header, e);
  wire::PutFixed(&header, Checksum(header), 8);
  {
    std::lock_guard lock(sink_mu_);
    if (sink_error_.ok()) {
      sink_error_ = sink_->Write(std::as_bytes(std::span(header.data(), header.size())));
    }
    if (sink_error_.ok()) {
      sink_error_ = sink_->Write(std::as_bytes(std::span(c.payload.data(), c.payload.size())));
    }
    ++records_;
    streamed_changed_[e.tensor_index] += e.changed_words;
  }
  c.payload = ByteVec();
}

void DeltaEncoder::StreamTensor(size_t i) {
  std::lock_guard lock(sink_mu_);
  const TensorView& t = target_[i];
  ByteVec record;
  wire::PutU8(&record, format::kTagTensor);
  wire::PutVarint(&record, i);
  PutHash(&record, target_hashes_[i]);
  wire::PutVarint(&record, keyframe_ ? t.data.size() / DTypeWordBytes(t.dtype) : streamed_changed_[i]);
  wire::PutFixed(&record, Checksum(record), 8);
  if (sink_error_.ok()) {
    sink_error_ = sink_->Write(std::as_bytes(std::span(record.data(), record.size())));
  }
}

Status DeltaEncoder::EndStream(const Hash128& target_hash) {
  ByteVec end;
  wire::PutU8(&end, format::kTagEnd);
  wire::PutVarint(&end, records_);
  PutHash(&end, target_hash);
  for (size_t i = 0; i < target_.size(); ++i) {
    PutHash(&end, target_hashes_[i]);
    const TensorView& t = target_[i];
    wire::PutVarint(&end, keyframe_ ? t.data.size() / DTypeWordBytes(t.dtype) : streamed_changed_[i]);
  }
  wire::PutFixed(&end, Checksum(end), 8);
  return sink_->Write(std::as_bytes(std::span(end.data(), end.size())));
}

Status DeltaEncoder::RunStreamed() {
  // The prologue names the base's hashes, so they are known (given or hashed) first; the
  // target is hashed in the compare pass as in Run.
  Hash128 base_hash;
  if (!keyframe_) {
    FW_RETURN_IF_ERROR(TakeGivenBaseHashes());
    FW_ASSIGN_OR_RETURN(base_hash, CheckpointHashFromTensorHashes(base_aligned_, base_hashes_));
  }
  FW_RETURN_IF_ERROR(BeginStream(base_hash));
  const bool hash_here = options_.target_tensor_hashes.empty();
  const bool fused =
      hash_here &&
      (options_.threads == 1 || plan_.largest_tensor_bytes * options_.threads <= plan_.total_bytes);
  if (fused) {
    EncodeAndHash();
  } else {
    FW_RETURN_IF_ERROR(HashThenEncode());
  }
  for (const EncodedChunk& c : encoded_) FW_RETURN_IF_ERROR(c.error);
  {
    std::lock_guard lock(sink_mu_);
    FW_RETURN_IF_ERROR(sink_error_);
  }
  FW_ASSIGN_OR_RETURN(Hash128 target_hash, CheckpointHashFromTensorHashes(target_, target_hashes_));
  return EndStream(target_hash);
}

// What both encoders start from: the options checked, the target indexed by name, the
// base (null for a keyframe) aligned to the target's order.
struct EncoderInputs {
  std::unordered_map<std::string, size_t> target_index;
  CheckpointView base_aligned;
};

Result<EncoderInputs> PrepareInputs(const CheckpointView* base, const CheckpointView& target,
                                    const EncodeOptions& options) {
  FW_RETURN_IF_ERROR(CheckOptions(target, options));
  EncoderInputs inputs;
  FW_RETURN_IF_ERROR(IndexTarget(target, &inputs.target_index));
  if (base != nullptr) {
    FW_RETURN_IF_ERROR(AlignBase(*base, target, inputs.target_index, &inputs.base_aligned));
  }
  return inputs;
}

Status StreamedImpl(const CheckpointView* base, const CheckpointView& target,
                    const EncodeOptions& options, StreamSink& sink) {
  FW_ASSIGN_OR_RETURN(EncoderInputs inputs, PrepareInputs(base, target, options));
  DeltaEncoder encoder(base, target, std::move(inputs.base_aligned), std::move(inputs.target_index),
                       options, &sink);
  return encoder.RunStreamed();
}

// `base` is null for a keyframe.
Result<std::vector<std::byte>> EncodeImpl(const CheckpointView* base, const CheckpointView& target,
                                          const EncodeOptions& options) {
  FW_ASSIGN_OR_RETURN(EncoderInputs inputs, PrepareInputs(base, target, options));
  DeltaEncoder encoder(base, target, std::move(inputs.base_aligned), std::move(inputs.target_index),
                       options);
  return encoder.Run();
}

}  // namespace

Result<std::vector<std::byte>> Encode(const CheckpointView& base, const CheckpointView& target,
                                      const EncodeOptions& options) {
  return EncodeImpl(&base, target, options);
}

Result<std::vector<std::byte>> EncodeKeyframe(const CheckpointView& target,
                                              const EncodeOptions& options) {
  return EncodeImpl(nullptr, target, options);
}

Status EncodeStreamed(const CheckpointView& base, const CheckpointView& target,
                      const EncodeOptions& options, StreamSink& sink) {
  return StreamedImpl(&base, target, options, sink);
}

Status EncodeKeyframeStreamed(const CheckpointView& target, const EncodeOptions& options,
                              StreamSink& sink) {
  return StreamedImpl(nullptr, target, options, sink);
}

}  // namespace flywheel::delta
