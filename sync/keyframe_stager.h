// A joining worker's keyframe, decoded and verified tensor by tensor while it arrives.
//
// The worker hands every verified piece of a streamed (format-2) keyframe to Advance, on
// its network thread. Once the in-order prefix holds the prologue, a staging checkpoint is
// allocated once from the declared tensor sizes (refused past `max_bytes`), and every
// chunk record whose bytes are in is decoded into it on the CPU pool; a tensor is hashed
// and checked against its TensorRecord as soon as its record and all its chunks are in.
// Take, at apply time, hands over the staged checkpoint only when every tensor of the
// finished keyframe was decoded and verified here and the checkpoint hash matches; else
// nothing (the caller decodes the whole keyframe the usual way). Nothing is ever served
// from here: a half-decoded keyframe stays in the stager until it is thrown away.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "base/growable_bytes.h"
#include "checkpoint/tensor.h"
#include "delta/delta.h"
#include "sync/upstream.h"

namespace flywheel::sync {

class KeyframeStager : public std::enable_shared_from_this<KeyframeStager> {
 public:
  // `bytes`: the download's buffer (its address never changes); `pool`: where chunks are
  // decoded and tensors hashed (it must outlive every task posted, e.g. joined first).
  KeyframeStager(asio::thread_pool& pool, std::shared_ptr<const GrowableBytes> bytes,
                 uint64_t max_bytes);

  // Pieces arrived (the network thread): schedules every chunk record the in-order prefix
  // now holds whole, and the check of every tensor whose record is in.
  void Advance(const Download& download);

  // On a pool thread, once the whole keyframe is in: waits for the decodes in flight and
  // checks the rest; the staged checkpoint when every tensor of `finished` (the whole
  // container's manifest) was staged and verified, else nothing and why in `why_not`.
  // The stager is spent afterwards.
  std::optional<OwnedCheckpoint> Take(const delta::Manifest& finished, std::string* why_not);

  uint64_t chunks_staged() const { return chunks_staged_.load(); }
  uint64_t tensors_verified() const { return tensors_verified_.load(); }
  // The first error (a chunk that does not decode, a tensor whose hash differs, a staging
  // buffer refused); empty while none.
  std::string error() const;

 private:
  struct TensorState {
    uint32_t scheduled = 0, decoded = 0;
    bool finished = false;  // its TensorRecord is in
    bool verify_posted = false;   // a check of it is queued
    bool verify_started = false;  // a check of it runs (or ran)
    bool verified = false;
    Hash128 expected;
  };
  void AdvanceReader(std::span<const std::byte> prefix);
  bool Allocate();  // on the pool, once: false when the staging buffer is refused
  void PostDecode(delta::DeltaView chunk, uint32_t tensor);
  std::vector<uint32_t> SettleTasks();  // tensors whose check Take runs itself
  void DecodeChunk(const delta::DeltaView& chunk, uint32_t tensor);
  void MaybeVerify(uint32_t tensor);  // REQUIRES: mu_ not held
  void Verify(uint32_t tensor);
  void Fail(const std::string& error);

  asio::thread_pool& pool_;
  const std::shared_ptr<const GrowableBytes> bytes_;
  const uint64_t max_bytes_;
  // Network-thread state.
  delta::StreamReader reader_;
  uint64_t prefix_pieces_ = 0;
  uint64_t prefix_ = 0;
  size_t next_chunk_ = 0;
  size_t next_finished_ = 0;
  bool closed_ = false;  // nothing more is scheduled
  // Shared with the pool.
  delta::Manifest prologue_;  // its tensors, copied before the first task is posted
  std::once_flag allocate_once_;
  bool allocated_ = false;   // set once, within allocate_once_
  OwnedCheckpoint staging_;  // allocated by the first task (Allocate), then fixed in size
  mutable std::mutex mu_;
  std::condition_variable idle_;
  uint64_t decoding_ = 0;             // decode tasks posted, not finished; guarded by mu_
  uint64_t verifying_ = 0;            // checks running; guarded by mu_
  std::vector<TensorState> tensors_;  // guarded by mu_ (sized before the first task)
  std::string error_;                 // guarded by mu_
  std::atomic<uint64_t> chunks_staged_{0}, tensors_verified_{0};
};

}  // namespace flywheel::sync
