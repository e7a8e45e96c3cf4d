// The sparse checkpoint-delta codec.
//
// A delta turns checkpoint `base` (version b) into checkpoint `target` (version t) bit
// for bit. Both must have the same tensor names, dtypes and shapes. The codec compares
// serving-dtype bit patterns word by word (a word is the dtype's element size: 1, 2, 4
// or 8 bytes; sub-byte dtypes are diffed per byte) and never does float arithmetic.
//
// Each tensor is cut into independent chunks (word ranges). A chunk holds either
//   * a sparse encoding: Rice-coded gaps between changed positions (index stream) and
//     rANS-coded word differences (value stream), or
//   * a dense encoding: target XOR base, or the target itself, byte-plane shuffled,
// whichever is smallest; then zstd or lz4 over the chunk when that makes it smaller.
// Every chunk carries an XXH3-64 checksum; the manifest carries base and target version
// numbers and XXH3-128 hashes of every tensor and of the whole checkpoint (checkpoint/hash.h).
// A keyframe is a full snapshot in the same container (every chunk literal).
// The byte layout is in delta/format.h and docs/DELTA_FORMAT.md.
//
// This API works on in-memory tensor views; delta/delta_file.h adapts it to files.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "checkpoint/hash.h"
#include "checkpoint/tensor.h"

namespace flywheel::delta {

enum class Compressor : uint8_t { kNone = 0, kZstd = 1, kLz4 = 2 };
const char* CompressorName(Compressor compressor);
Result<Compressor> ParseCompressor(std::string_view name);

// kSparseContext: sparse, coded conditioned on the base words (delta/format.h, kind 3).
enum class ChunkKind : uint8_t { kSparse = 0, kDenseXor = 1, kLiteral = 2, kSparseContext = 3 };
const char* ChunkKindName(ChunkKind kind);

// Called from worker threads as work completes: (done, total) in bytes of checkpoint.
using ProgressFn = std::function<void(uint64_t done_bytes, uint64_t total_bytes)>;

struct EncodeOptions {
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  Compressor compressor = Compressor::kZstd;
  int zstd_level = 3;
  int threads = 1;
  // Sparse chunks of float dtypes coded conditioned on the base words (chunk kind 3,
  // delta/format.h): ~0.71x the order-0 floor on bf16 AdamW steps, 15-18% smaller FP8
  // deltas, but encode and apply run 2-2.6x slower per thread today (they walk every base
  // word; docs/BENCHMARKS.md). Off by default: where CPU, not the link, bounds the sync
  // (the seeds' 64-core, 10 Gbit/s case) the plain coding is faster end to end. On for
  // link-bound fleets (`flywheel publish --context-coding`). Either decodes everywhere.
  bool context_coding = false;
  // Chunk size in bytes of tensor data (rounded down to whole words), in
  // [4 KiB, 64 MiB]; a chunk never holds more than kMaxChunkWords words.
  uint64_t chunk_bytes = 4 << 20;
  // Metadata stored in the manifest (e.g. the target file's __metadata__).
  std::map<std::string, std::string> metadata;
  // Optional already known per-tensor hashes, index-aligned with the checkpoint views
  // (e.g. a publisher that hashed the previous version already). Empty: computed here.
  std::vector<Hash128> base_tensor_hashes;
  std::vector<Hash128> target_tensor_hashes;
  ProgressFn progress;
};

// Per-tensor entry of a manifest.
struct TensorEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t byte_size = 0;
  Hash128 base_hash;  // zero in a keyframe
  Hash128 target_hash;
  uint64_t changed_words = 0;  // words that differ from the base (all words in a keyframe)
  uint32_t first_chunk = 0;    // index into Manifest::chunks
  uint32_t chunk_count = 0;
};

struct ChunkEntry {
  uint32_t tensor_index = 0;
  uint64_t word_begin = 0;
  uint64_t word_count = 0;
  ChunkKind kind = ChunkKind::kSparse;
  Compressor compressor = Compressor::kNone;
  uint64_t changed_words = 0;
  uint64_t raw_bytes = 0;       // payload size before compression
  uint64_t payload_bytes = 0;   // stored size
  uint64_t payload_offset = 0;  // from the payload section (format 1) or the container (2)
  uint64_t checksum = 0;        // XXH3-64 of the stored payload
  // The chunk's place in the container: its index in the chunk table (format 1), or the
  // order of its record (format 2, where records come in the order they were encoded).
  // PreparedChunks is indexed by it.
  uint32_t record = 0;
};

struct Manifest {
  bool keyframe = false;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  Hash128 base_hash;  // zero in a keyframe
  Hash128 target_hash;
  std::map<std::string, std::string> metadata;
  std::vector<TensorEntry> tensors;  // target order
  std::vector<ChunkEntry> chunks;    // tensor order, then word order

  uint64_t total_bytes() const;    // bytes of the target checkpoint's tensor data
  uint64_t changed_words() const;  // summed over tensors
  uint64_t total_words() const;
};

// Limits applied while parsing untrusted input; every size read is checked against them
// before anything is allocated.
struct DecodeLimits {
  uint64_t max_manifest_bytes = 256ull << 20;
  uint64_t max_tensors = 1ull << 22;
  uint64_t max_chunks = 1ull << 24;
  // Words per chunk and raw (decompressed) bytes per chunk: the per-thread scratch of a
  // chunk decode is bounded by these (about 12 bytes per word at most).
  uint64_t max_chunk_words = 1ull << 24;
  uint64_t max_chunk_raw_bytes = 1ull << 28;
  // Sum of the declared tensor sizes (what DecodeKeyframe allocates).
  uint64_t max_total_bytes = 1ull << 40;
  uint64_t max_name_bytes = 1 << 16;
  uint64_t max_metadata_bytes = 16 << 20;
};

// The encoder's largest chunk in words (DecodeLimits::max_chunk_words by default).
inline constexpr uint64_t kMaxChunkWords = 1ull << 24;
inline constexpr int kMaxThreads = 1024;

class StreamReader;

// An encoded delta or keyframe, validated up to its manifest. Chunk payloads are
// verified (checksum, structure, bounds) when they are decoded. Holds a view of the
// container bytes: keep them alive while the DeltaView is used.
class DeltaView {
 public:
  static Result<DeltaView> Parse(std::span<const std::byte> container,
                                 const DecodeLimits& limits = {});
  const Manifest& manifest() const { return manifest_; }
  std::span<const std::byte> payload(const ChunkEntry& chunk) const {
    return payloads_.subspan(chunk.payload_offset, chunk.payload_bytes);
  }
  std::span<const std::byte> bytes() const { return bytes_; }
  bool streamed() const { return streamed_; }  // format 2

 private:
  friend class StreamReader;
  static Result<DeltaView> ParseStreamed(std::span<const std::byte> container,
                                         const DecodeLimits& limits);
  bool streamed_ = false;
  Manifest manifest_;
  std::span<const std::byte> bytes_;
  std::span<const std::byte> payloads_;
};

// Encodes the delta base -> target. Fails (Mismatch) if names, dtypes or shapes differ.
Result<std::vector<std::byte>> Encode(const CheckpointView& base, const CheckpointView& target,
                                      const EncodeOptions& options);
// Encodes a keyframe: a full snapshot of `target` (options.base_version is ignored).
Result<std::vector<std::byte>> EncodeKeyframe(const CheckpointView& target,
                                              const EncodeOptions& options);

// ---- streamed containers (format 2, delta/format.h) ------------------------------------

// Where an encoder writes a streamed container: Begin once with an upper bound of the
// container's size, then Write with consecutive byte ranges. Calls come from the
// encoder's threads, one at a time; an error stops the encode and is returned by it.
class StreamSink {
 public:
  virtual ~StreamSink() = default;
  virtual Status Begin(uint64_t size_bound) = 0;
  virtual Status Write(std::span<const std::byte> bytes) = 0;
};

// Encode / EncodeKeyframe, written to `sink` as a format-2 container: every chunk goes
// out as soon as it is encoded (so a reader can use it before the encode ends), the
// target hashes last. The same checks and the same chunk payloads as Encode.
Status EncodeStreamed(const CheckpointView& base, const CheckpointView& target,
                      const EncodeOptions& options, StreamSink& sink);
Status EncodeKeyframeStreamed(const CheckpointView& target, const EncodeOptions& options,
                              StreamSink& sink);

// Reads a format-2 container while its bytes arrive front to back: Advance with the
// bytes in so far parses the header and prologue once they are whole, then every chunk
// record whose header and payload are whole (payloads are not verified here: their
// checksums are checked where they are decoded). Nothing in the partial container is
// trusted: every field is checked against DecodeLimits as it is read, and a malformed
// part fails Advance (Corruption naming it) for good. DeltaView::Parse of the whole
// container checks what can be checked only at the end.
class StreamReader {
 public:
  explicit StreamReader(const DecodeLimits& limits = {});
  ~StreamReader();
  StreamReader(StreamReader&&) noexcept;
  StreamReader& operator=(StreamReader&&) noexcept;

  // Whether `prefix` (at least 10 bytes) starts a format-2 container.
  static bool IsStreamed(std::span<const std::byte> prefix);

  // `prefix`: the container's first bytes, at least as many as in the previous call, and
  // the same ones.
  Status Advance(std::span<const std::byte> prefix);
  bool has_prologue() const;
  bool ended() const;  // the end record was read
  // Versions, base hash, metadata and tensors (no target hashes before ended()), with
  // the chunks read so far in record order (payload offsets from the container's start).
  const Manifest& manifest() const;
  uint64_t max_chunks() const;  // the prologue's bound on chunk records
  // Tensors whose record is in (all their chunk records before it; manifest().tensors[i]
  // has its target hash and changed words), in the order the records came.
  const std::vector<uint32_t>& finished_tensors() const;
  // Chunk record `record` alone, as a view of one tensor and one chunk (its `record`
  // field kept) over `container` (which must hold its payload), for
  // PreparedChunks::Prepare.
  DeltaView ChunkView(size_t record, std::span<const std::byte> container) const;

 private:
  friend class DeltaView;
  struct State;
  std::unique_ptr<State> state_;
};

// Words of one chunk that an apply wrote: every word of [word_begin, word_begin +
// word_count) when `all` (dense chunks, keyframes), else those at `positions` (relative to
// word_begin, ascending).
struct ChangedWords {
  size_t state_index = 0;  // into the state passed to ApplyInPlace
  uint64_t word_begin = 0;
  uint64_t word_count = 0;
  bool all = false;
  std::vector<uint32_t> positions;
};

struct ApplyStats {
  uint64_t changed_words = 0;
  uint64_t chunks = 0;
  uint64_t tensors_verified_ahead = 0;  // hashes taken from PreparedChunks::VerifyTensor
  std::vector<Hash128> tensor_hashes;  // verified target hashes, aligned with the state
  std::vector<ChangedWords> changes;   // with ApplyOptions::report_changes
};

class PreparedChunks;

struct ApplyOptions {
  int threads = 1;  // in [1, kMaxThreads]
  // Sparse chunks already decoded (e.g. while the delta was arriving): used instead of
  // decoding them again. Chunks it does not hold are decoded as usual.
  PreparedChunks* prepared = nullptr;
  // Already verified per-tensor hashes of the state, index-aligned with it (a worker keeps
  // them from its last apply). Empty: the state is hashed and checked against the
  // delta's base hashes before anything is written.
  std::vector<Hash128> state_tensor_hashes;
  // Keep undo records so a failure restores the state (ApplyInPlace). An apply into a
  // scratch copy that is thrown away on failure may turn this off.
  bool restore_on_failure = true;
  // Report which words the apply wrote (ApplyStats::changes), for a consumer that keeps a
  // derived copy in step (the rollout engine's fp32 mirror of bf16 weights).
  bool report_changes = false;
  ProgressFn progress;
  // Called on the applying thread with each chunk's stored payload (DeltaView::payload)
  // once the apply has read it for the last time: a caller applying a mapped file drops
  // those pages as it goes (MappedReleaser::Done), so a large delta is never resident whole.
  std::function<void(std::span<const std::byte> payload)> payload_read;
  // Called once the whole target is in place and verified, before ApplyInPlace returns,
  // with the stats it is about to return: a consumer that must take the new version too
  // (the rollout engine patching its mirror) says yes or no. An error restores the state to
  // the base exactly and is returned as the apply's own (REQUIRES: restore_on_failure).
  std::function<Status(const ApplyStats&)> before_commit;
};

// Sparse chunks of one delta decoded ahead of ApplyInPlace, while the rest of the delta is
// still arriving: per chunk, the changed positions and the words they get (6 bytes per
// changed bf16 word), computed from the base the apply will patch. Prepare may run for
// different chunks on several threads at once, and concurrently with the ApplyInPlace that
// consumes them: each chunk is either prepared or claimed by the apply, never both (a
// chunk the apply reaches first is decoded there as usual). Nothing is written to any
// state here; ApplyInPlace still verifies the base before and every hash after, so a
// chunk prepared against other bytes than the base only makes the apply fail and roll
// back, exactly as a corrupt chunk would.
class PreparedChunks {
 public:
  // For a delta of `chunk_count` chunks (format 2: its max_chunks); at most `budget_bytes`
  // of decoded data are kept. Chunks are identified by ChunkEntry::record.
  PreparedChunks(size_t chunk_count, uint64_t budget_bytes);
  ~PreparedChunks();
  PreparedChunks(const PreparedChunks&) = delete;
  PreparedChunks& operator=(const PreparedChunks&) = delete;

  // Decodes chunk `index` of `delta` (its stored bytes must be complete; it is kept under
  // the chunk's record number) against
  // `base_tensor`, the bytes of the tensor the chunk patches. Returns whether it was kept:
  // false for a chunk that is not sparse, over the budget, already prepared or claimed by
  // the apply, or that does not decode (the apply then reports the error as usual).
  bool Prepare(const DeltaView& delta, size_t index, std::span<const std::byte> base_tensor);

  size_t prepared() const;  // chunks prepared so far
  size_t used() const;      // of those, consumed by an apply

  // Verifies tensor `tensor` (its index in the delta's manifest) ahead of the apply: copies
  // `base_tensor`, writes the prepared words of `records` (every chunk of the tensor, all
  // sparse) into the copy and hashes it. True, and the hash is kept, when every one of the
  // chunks is prepared (it waits for one being prepared now) and the hash is
  // `target_hash`. ApplyInPlace does not rehash a tensor verified so when it writes every
  // one of its chunks from here. REQUIRES: no apply takes these chunks meanwhile.
  bool VerifyTensor(size_t tensor, std::span<const uint32_t> records, int word_bytes,
                    std::span<const std::byte> base_tensor, const Hash128& target_hash);
  bool VerifiedHash(size_t tensor, Hash128* hash) const;

 private:
  friend struct PreparedAccess;
  struct Chunk;
  std::unique_ptr<Chunk[]> chunks_;
  size_t count_;
  uint64_t budget_bytes_;
  std::atomic<uint64_t> bytes_{0};
  std::atomic<size_t> prepared_{0}, used_{0};
  mutable std::mutex verified_mu_;
  std::map<size_t, Hash128> verified_;  // tensor -> hash verified ahead
};

// Applies `delta` to `state` in place. Either the whole target is in place and every
// tensor hash and the checkpoint hash verify, or `state` is exactly as before and a
// non-OK status says what was wrong (wrong base, corrupted chunk, hash mismatch).
// A keyframe may be applied too: it overwrites the state (same layout required).
Result<ApplyStats> ApplyInPlace(MutableCheckpointView& state, const DeltaView& delta,
                                const ApplyOptions& options = {});

// Decodes a keyframe into a new checkpoint (target order), verifying every hash.
Result<OwnedCheckpoint> DecodeKeyframe(const DeltaView& keyframe, int threads = 1);

// Copies `base` into a new checkpoint laid out in the manifest's tensor order and applies
// `delta` to it. `base` is never written.
Result<OwnedCheckpoint> ApplyToCopy(const CheckpointView& base, const DeltaView& delta,
                                    const ApplyOptions& options = {});

// Per-tensor statistics from a delta's manifest (delta/inspect.h sums them up).
struct TensorStats {
  std::string name;
  DType dtype = DType::kU8;
  uint64_t elements = 0;
  uint64_t words = 0;
  uint64_t changed_words = 0;
  uint64_t stored_bytes = 0;  // chunk payloads of this tensor
  uint64_t sparse_chunks = 0, dense_chunks = 0, literal_chunks = 0;
};
std::vector<TensorStats> Inspect(const DeltaView& delta);

}  // namespace flywheel::delta
