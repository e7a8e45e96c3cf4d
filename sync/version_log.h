// The publisher's version log: a keyframe every K versions, deltas between, bounded
// retention, on disk under a state directory that survives restarts.
//
// Layout of the state directory:
//   LOCK                         flock()ed while a VersionLog is open (one publisher per dir)
//   log.json                     the commit record: every retained artifact, the head
//                                version and hash, and the highest version ever published
//   artifacts/v<20 digits>.keyframe   keyframe containers (delta/delta.h)
//   artifacts/v<20 digits>.delta      delta containers from the previous head version
// Artifacts are written atomically first, then log.json is replaced atomically; files
// that log.json does not name are leftovers of an interrupted append and are removed on
// Open. Every write goes through VersionLogOptions::env and is durable before Append
// returns: each artifact is fsynced and renamed into artifacts/, which is then fsynced,
// before log.json is (AtomicFile), so a power cut at any point leaves either the previous
// version or the new one, never a log.json naming an artifact that is not whole (the
// crash-consistency test, tests/sync/crash_consistency_test.cc, cuts at every step). The head checkpoint is not stored separately: Open rebuilds it from the latest
// keyframe and the deltas after it and checks it against the recorded head hash.
//
// log.json (format 1), written through a temporary file, fsync and rename:
//   {"format": 1, "last_version": u64, "head_version": u64, "head_hash": "<32 hex>",
//    "keyframe_every": u64 (the setting of the run that wrote it; informational),
//    "artifacts": [{"kind": "keyframe"|"delta", "base_version": u64 (0 for a keyframe),
//                   "target_version": u64, "base_hash": "<32 hex>", "target_hash": "<32 hex>",
//                   "size_bytes": u64, "piece_bytes": u64,
//                   "piece_hashes": ["<16 hex>", ...] (unsigned numbers are accepted too),
//                   "file": "artifacts/v<20 digits>.<kind>"}, ...]}
// Artifacts are listed by target version, a keyframe before the delta of the same version;
// "file" must be exactly the name the kind and target version give (nothing else is ever
// opened or deleted). Hashes print as Hash128::ToHex.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/env.h"
#include "base/growable_bytes.h"
#include "base/status.h"
#include "delta/delta.h"
#include "checkpoint/hash.h"
#include "checkpoint/tensor.h"

namespace flywheel::sync {

enum class ArtifactKind : uint8_t { kKeyframe = 0, kDelta = 1 };
const char* ArtifactKindName(ArtifactKind kind);

// One retained artifact: what a subscriber needs to fetch it piece by piece and to decide
// whether it applies to the weights it holds.
struct ArtifactInfo {
  ArtifactKind kind = ArtifactKind::kKeyframe;
  uint64_t base_version = 0;  // delta only
  uint64_t target_version = 0;
  Hash128 base_hash;  // checkpoint hash of the base; zero for a keyframe
  Hash128 target_hash;
  uint64_t size_bytes = 0;
  uint64_t piece_bytes = 0;            // transfer unit; the last piece may be shorter
  std::vector<uint64_t> piece_hashes;  // XXH3-64 (HashBytes64) of every piece
  std::string path;                    // absolute path of the container file
  // A delta still being encoded (published piece by piece): size_bytes and piece_hashes
  // cover the whole pieces so far, target_hash is zero, and the finished artifact is at
  // most size_bound bytes. Never in the log itself.
  bool streaming = false;
  uint64_t size_bound = 0;
  bool operator==(const ArtifactInfo&) const = default;
};

// Options may differ from the run that wrote the directory: the new ones apply from the
// next Append on (artifacts keep the piece size they were written with).
struct VersionLogOptions {
  std::string dir;  // the state directory (created if missing)
  // A keyframe is due when this is the keyframe_every-th version published after the
  // latest keyframe (counted in Appends, not version numbers): 10 gives keyframes at the
  // 1st, 11th, 21st... version; 1 makes every version a keyframe. Must be >= 1.
  uint64_t keyframe_every = 10;
  // Cost-based keyframes: a keyframe is also due when the deltas a joining worker fetches
  // after the latest keyframe to reach this version (this version's delta included) add up
  // to more than keyframe_cost x that keyframe's size: a fresh keyframe is then cheaper than
  // the chain. 0: by count only. Must be >= 0.
  double keyframe_cost = 1.0;
  // Retention after every Append: an artifact is kept if its target version is the latest
  // keyframe's version or later (so the head can always be rebuilt), or is among the
  // newest `retain` versions in the log; every other artifact is deleted.
  uint64_t retain = 20;
  bool deltas = true;              // false: keyframes only (the full-checkpoint baseline)
  uint64_t piece_bytes = 1 << 20;  // must be >= 1
  // Deltas are written as streamed containers (delta format 2): each chunk goes out as it
  // is encoded, so AppendOptions::on_stream can serve the pieces before the encode ends.
  // false: format-1 deltas, whole before anything is served.
  bool stream_deltas = true;
  delta::Compressor compressor = delta::Compressor::kZstd;
  // Deltas coded conditioned on the base words (delta::EncodeOptions::context_coding):
  // smaller, slower to encode and apply; off by default.
  bool context_coding = false;
  int threads = 1;  // encode/decode/hash threads, in [1, delta::kMaxThreads]
  // Every file the log reads and writes goes through this Env (null: Env::Default()).
  Env* env = nullptr;
};

// Told of bytes of a caller's container that the version log has read for the last time
// (for now), from the reading thread: a caller that mapped a large delta drops them from
// memory as they go (MappedReleaser::Done), so the delta is never resident whole.
using BytesReadFn = std::function<void(std::span<const std::byte> read)>;

// What a caller that hashed the checkpoint already (the embedded trainer) hands to Append,
// so the bytes are not hashed a second time.
struct AppendOptions {
  // Per-tensor hashes (checkpoint/hash.h TensorHash), index-aligned with the checkpoint. Empty:
  // Append hashes every tensor itself. REQUIRES: when given, they are the hashes of exactly
  // these bytes; Append does not re-read the bytes to check them (that is the point), and a
  // wrong hash publishes a version every worker refuses at apply time.
  std::vector<Hash128> tensor_hashes;
  // The checkpoint hash of those tensor hashes, when the caller has it: Append combines the
  // tensor hashes again (cheap: no pass over the bytes) and refuses a mismatch
  // (InvalidArgument) instead of publishing a version under a hash it was not given.
  std::optional<Hash128> checkpoint_hash;
  // A delta container from the head to exactly this checkpoint that the caller verified
  // (the push API applied it: ApplyDelta). When Append writes a delta it stores these
  // bytes as they are instead of encoding one. Its manifest must name the head as base
  // and `version` as target (InvalidArgument otherwise). Empty: Append encodes.
  std::span<const std::byte> encoded_delta;
  // Told of ranges of encoded_delta as Append finishes with them (its check, then each
  // piece once hashed and written). Optional.
  BytesReadFn encoded_delta_read;
  // While a streamed delta is encoded (VersionLogOptions::stream_deltas, no
  // encoded_delta): called from the encoding thread as whole pieces are written, at most
  // every 10 ms and for the first piece at once, with the delta's entry so far
  // (ArtifactInfo::streaming) and its bytes, which keep their address and only grow (at
  // least the entry's size_bytes are written). Nothing is committed yet: the caller may
  // serve these pieces, never as a finished version.
  std::function<void(const ArtifactInfo& partial, std::shared_ptr<const GrowableBytes> bytes)>
      on_stream;
  // An untrusted delta container from the head to `version` (the push API's upload),
  // applied to the log's head IN PLACE: no copy of the head. Under the log's lock, Append
  // applies it (undo records kept), checks the result against the delta's own tensor and
  // target hashes, writes the artifacts (the container itself as the version's delta) and
  // log.json, and only then drops the undo records (delta::ApplyOptions::before_commit):
  // any failure before log.json is durable restores the head bit for bit and publishes
  // nothing. Refused: a base that is not the head (Mismatch, naming both), a keyframe or
  // another target version (InvalidArgument), a delta that does not produce its own
  // hashes (Corruption). REQUIRES: `checkpoint` is empty (the head is the checkpoint) and
  // tensor_hashes, checkpoint_hash and encoded_delta are not given; encoded_delta_read is
  // told of the container's bytes as the parse, the apply and the write finish with them.
  std::span<const std::byte> apply_in_place;
};

// A version's weights rebuilt from the log (Rebuild, ApplyDelta).
struct RebuiltCheckpoint {
  uint64_t version = 0;
  OwnedCheckpoint checkpoint;
  std::vector<Hash128> tensor_hashes;  // verified, aligned with checkpoint
  Hash128 hash;                        // checkpoint hash
};

// What a worker joining at the head fetches: the latest keyframe and the deltas after it
// (0 for an empty log).
uint64_t JoinBytes(const std::vector<ArtifactInfo>& artifacts);

struct AppendResult {
  std::vector<ArtifactInfo> artifacts;  // the new artifacts, keyframe first
  // Why a keyframe was written: "first", "layout" (the tensors changed), "no-deltas",
  // "every" (keyframe_every), "cost" (keyframe_cost); "" when none was.
  std::string keyframe_reason;
  // The delta's counts as the encoder wrote them into its manifest (delta/delta.h
  // TensorEntry::changed_words), in codec words (the dtype's element size); both 0 when no
  // delta was written (first version, layout change, deltas off).
  bool wrote_delta = false;
  uint64_t changed_words = 0;
  uint64_t total_words = 0;
  // Tensors this Append hashed itself: 0 when AppendOptions::tensor_hashes were given, else
  // every tensor once. The encoder never hashes (it is always handed the hashes).
  uint64_t tensors_hashed = 0;
  // When the encode of the delta (or keyframe) ended, before the artifacts were written
  // and committed; with a streamed delta, its pieces were served before this.
  std::chrono::system_clock::time_point encoded_at;
  // The published checkpoint's tensor bytes (the head's after an apply_in_place).
  uint64_t checkpoint_bytes = 0;
};

// Thread-safe: Append runs on one thread at a time (it serializes itself) while
// Artifacts()/head_*() may be called from any thread; they see either the state before
// an Append or after it. The head's tensor bytes are kept in memory (a copy of the last
// published checkpoint) to encode the next delta from. They are read only under the
// Append lock (Rebuild, ApplyDelta, Append itself), and an in-place apply
// (AppendOptions::apply_in_place) holds that lock from its first write to its commit or
// its restore, so no reader ever sees a head that is part base, part target.
class VersionLog {
 public:
  // Opens or creates the log. Recovers an existing one: reads log.json, checks every
  // artifact's size and piece hashes, rebuilds and verifies the head, then removes files
  // log.json does not name. Fails (with the reason and the file) if the options are
  // unusable (InvalidArgument), the directory is locked by another VersionLog, in this
  // process or another (Unavailable), log.json is malformed (Corruption naming the
  // field), an artifact is missing (NotFound) or corrupt (Corruption), or the rebuilt
  // head does not match the recorded hash; a failed Open deletes nothing.
  static Result<std::unique_ptr<VersionLog>> Open(const VersionLogOptions& options);
  ~VersionLog();

  // Publishes `checkpoint` as `version`. REQUIRES nothing of the caller: version 0 and
  // a version not above last_version() are refused (InvalidArgument: versions only move
  // forward, even across restarts), and so is a tensor whose bytes do not match its dtype
  // and shape. Writes the delta from the head when there is a head with the same tensor
  // names/dtypes/shapes (in order) and deltas are on, and a keyframe when due (first
  // version, layout change, keyframe_every reached, or deltas off): a keyframe version
  // with a same-layout predecessor gets both. Writes them, then log.json (which already
  // reflects retention), then deletes the artifacts retention dropped. On any failure
  // before log.json is replaced nothing changes, on disk or in memory; a failure to
  // delete a dropped file afterwards is only logged (the next Open removes it). Returns
  // the new artifacts, keyframe first.
  Result<std::vector<ArtifactInfo>> Append(uint64_t version, const CheckpointView& checkpoint);
  // The same, with what the caller already knows of `checkpoint` (AppendOptions) and what
  // the encoder counted (AppendResult).
  Result<AppendResult> Append(uint64_t version, const CheckpointView& checkpoint,
                              const AppendOptions& options);

  // Retained artifacts, ordered by target_version (a keyframe before a delta of the same
  // version).
  std::vector<ArtifactInfo> Artifacts() const;
  bool empty() const;             // nothing published yet
  uint64_t head_version() const;  // 0 when empty
  Hash128 head_hash() const;      // checkpoint hash (checkpoint/hash.h) of the head
  uint64_t last_version() const;  // highest version ever published (== head_version())
  // A copy of the head's tensor hashes (aligned with the head's tensor order).
  std::vector<Hash128> head_tensor_hashes() const;

  // Versions whose weights the retained artifacts can rebuild: every retained keyframe and
  // every version a chain of retained deltas reaches from one. Ascending.
  std::vector<uint64_t> RebuildableVersions() const;
  // The weights of `version`: a copy of the head, or decoded from the newest retained
  // keyframe at or below it and the deltas after it, every hash verified. NotFound (naming
  // RebuildableVersions()) when the artifacts no longer reach it. Runs while no Append does.
  Result<RebuiltCheckpoint> Rebuild(uint64_t version) const;
  // Applies an untrusted delta container to this log's copy of its base version (the
  // manifest's base_version, whose hash must be the manifest's base_hash: Mismatch
  // otherwise, NotFound when the base cannot be rebuilt) and returns the target, verified
  // against the delta's own tensor and target hashes (Corruption when they do not match).
  // `read` (optional) is told of the container's bytes as the parse and each chunk's
  // apply finish with them.
  Result<RebuiltCheckpoint> ApplyDelta(std::span<const std::byte> container, int threads,
                                       const BytesReadFn& read = {}) const;

 private:
  struct State;
  class AppendRun;  // one Append's steps
  explicit VersionLog(std::unique_ptr<State> state);
  Result<RebuiltCheckpoint> RebuildLocked(uint64_t version) const;  // REQUIRES: append_mu held
  // AppendOptions::apply_in_place. REQUIRES: append_mu held.
  Result<AppendResult> AppendInPlaceLocked(uint64_t version, const CheckpointView& checkpoint,
                                           const AppendOptions& given);
  std::unique_ptr<State> state_;
};

// Splits `bytes` into pieces of `piece_bytes` and hashes each (HashBytes64): one hash per
// started piece, so none for empty bytes. A `piece_bytes` of 0 means one piece.
std::vector<uint64_t> PieceHashes(std::span<const std::byte> bytes, uint64_t piece_bytes);

}  // namespace flywheel::sync
