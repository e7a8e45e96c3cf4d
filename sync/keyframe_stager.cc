#include "sync/keyframe_stager.h"

#include "checkpoint/hash.h"
#include "delta/keyframe_stream.h"

namespace flywheel::sync {

namespace {

delta::DecodeLimits StagingLimits(uint64_t max_bytes) {
  delta::DecodeLimits limits;
  limits.max_total_bytes = max_bytes;
  return limits;
}

}  // namespace

KeyframeStager::KeyframeStager(asio::thread_pool& pool, std::shared_ptr<const GrowableBytes> bytes,
                               uint64_t max_bytes)
    : pool_(pool), bytes_(std::move(bytes)), max_bytes_(max_bytes), reader_(StagingLimits(max_bytes)) {}

std::string KeyframeStager::error() const {
  std::lock_guard lock(mu_);
  return error_;
}

void KeyframeStager::Fail(const std::string& error) {
  std::lock_guard lock(mu_);
  if (error_.empty()) error_ = error;
}

void KeyframeStager::Advance(const Download& download) {
  if (closed_ || download.info.piece_bytes == 0) return;
  while (prefix_pieces_ < download.have.size() && download.have[prefix_pieces_]) ++prefix_pieces_;
  const uint64_t prefix =
      std::min(download.info.size_bytes, prefix_pieces_ * download.info.piece_bytes);
  if (prefix < 10 || prefix == prefix_) return;
  prefix_ = prefix;
  const std::span<const std::byte> bytes(bytes_->data(), prefix);
  if (!delta::StreamReader::IsStreamed(bytes)) {
    closed_ = true;  // a format-1 keyframe: decoded whole once it is in
    return;
  }
  AdvanceReader(bytes);
}

void KeyframeStager::AdvanceReader(std::span<const std::byte> prefix) {
  if (Status advanced = reader_.Advance(prefix); !advanced.ok()) {
    closed_ = true;  // the whole keyframe's parse says what is wrong, if anything
    Fail("keyframe stream: " + advanced.message());
    return;
  }
  if (!reader_.has_prologue()) return;
  const delta::Manifest& m = reader_.manifest();
  if (!m.keyframe) {
    closed_ = true;
    return;
  }
  {
    std::lock_guard lock(mu_);
    if (tensors_.empty()) {
      tensors_.resize(m.tensors.size());
      prologue_.keyframe = true;
      prologue_.target_version = m.target_version;
      prologue_.tensors = m.tensors;  // read by Allocate on the pool
    }
  }
  for (; next_chunk_ < m.chunks.size(); ++next_chunk_) {
    const uint32_t tensor = m.chunks[next_chunk_].tensor_index;
    {
      std::lock_guard lock(mu_);
      ++tensors_[tensor].scheduled;
    }
    PostDecode(reader_.ChunkView(next_chunk_, prefix), tensor);
  }
  const std::vector<uint32_t>& finished = reader_.finished_tensors();
  for (; next_finished_ < finished.size(); ++next_finished_) {
    const uint32_t tensor = finished[next_finished_];
    {
      std::lock_guard lock(mu_);
      tensors_[tensor].finished = true;
      tensors_[tensor].expected = m.tensors[tensor].target_hash;
    }
    MaybeVerify(tensor);
  }
  if (reader_.ended()) closed_ = true;
}

void KeyframeStager::PostDecode(delta::DeltaView chunk, uint32_t tensor) {
  {
    std::lock_guard lock(mu_);
    ++decoding_;
  }
  asio::post(pool_, [self = shared_from_this(), chunk = std::move(chunk), tensor] {
    self->DecodeChunk(chunk, tensor);
    std::lock_guard lock(self->mu_);
    if (--self->decoding_ == 0) self->idle_.notify_all();
  });
}

bool KeyframeStager::Allocate() {
  std::call_once(allocate_once_, [this] {
    Result<OwnedCheckpoint> staging = delta::AllocateKeyframeStaging(prologue_, max_bytes_);
    if (!staging.ok()) {
      Fail(staging.status().message());
      return;
    }
    staging_ = std::move(*staging);
    allocated_ = true;
  });
  return allocated_;
}

void KeyframeStager::DecodeChunk(const delta::DeltaView& chunk, uint32_t tensor) {
  if (!error().empty() || !Allocate()) return;
  const Status decoded = delta::DecodeKeyframeChunk(chunk, staging_.tensors[tensor].data);
  if (!decoded.ok()) {
    Fail(decoded.message());
    return;
  }
  chunks_staged_.fetch_add(1);
  {
    std::lock_guard lock(mu_);
    ++tensors_[tensor].decoded;
  }
  MaybeVerify(tensor);
}

void KeyframeStager::MaybeVerify(uint32_t tensor) {
  {
    std::lock_guard lock(mu_);
    TensorState& t = tensors_[tensor];
    if (!t.finished || t.verify_posted || t.decoded != t.scheduled || !error_.empty()) return;
    t.verify_posted = true;
  }
  asio::post(pool_, [self = shared_from_this(), tensor] {
    {
      std::lock_guard lock(self->mu_);
      TensorState& t = self->tensors_[tensor];
      if (t.verify_started) return;  // Take checks it itself
      t.verify_started = true;
      ++self->verifying_;
    }
    self->Verify(tensor);
    std::lock_guard lock(self->mu_);
    if (--self->verifying_ == 0) self->idle_.notify_all();
  });
}

void KeyframeStager::Verify(uint32_t tensor) {
  if (!Allocate()) return;
  const OwnedTensor& staged = staging_.tensors[tensor];
  const Hash128 hash = HashBytes(staged.data);
  std::lock_guard lock(mu_);
  TensorState& t = tensors_[tensor];
  if (hash != t.expected) {
    if (error_.empty()) {
      error_ = "keyframe tensor '" + staged.name + "' hashes to " + hash.ToHex() +
               ", its record says " + t.expected.ToHex();
    }
    return;
  }
  t.verified = true;
  tensors_verified_.fetch_add(1);
}

// Decode tasks were all posted before the apply that calls Take; the checks they posted
// may wait behind it in the pool's queue (a pool of one thread), so those not started yet
// run here instead.
std::vector<uint32_t> KeyframeStager::SettleTasks() {
  std::unique_lock lock(mu_);
  idle_.wait(lock, [this] { return decoding_ == 0; });
  std::vector<uint32_t> mine;
  for (uint32_t i = 0; i < tensors_.size(); ++i) {
    TensorState& t = tensors_[i];
    if (t.finished && t.decoded == t.scheduled && !t.verify_started && error_.empty()) {
      t.verify_started = true;
      mine.push_back(i);
    }
  }
  idle_.wait(lock, [this] { return verifying_ == 0; });
  return mine;
}

std::optional<OwnedCheckpoint> KeyframeStager::Take(const delta::Manifest& finished,
                                                    std::string* why_not) {
  for (uint32_t tensor : SettleTasks()) Verify(tensor);
  std::lock_guard lock(mu_);
  auto refuse = [&](std::string why) -> std::optional<OwnedCheckpoint> {
    *why_not = std::move(why);
    staging_ = {};
    return std::nullopt;
  };
  if (!error_.empty()) return refuse(error_);
  if (!allocated_ || tensors_.size() != finished.tensors.size()) {
    return refuse("the keyframe's prologue was not staged");
  }
  std::vector<Hash128> hashes;
  for (size_t i = 0; i < finished.tensors.size(); ++i) {
    const delta::TensorEntry& entry = finished.tensors[i];
    const OwnedTensor& staged = staging_.tensors[i];
    const TensorState& t = tensors_[i];
    if (staged.name != entry.name || staged.dtype != entry.dtype || staged.shape != entry.shape) {
      return refuse("tensor " + std::to_string(i) + " of the finished keyframe is not the one staged");
    }
    if (!t.verified || t.expected != entry.target_hash) {
      return refuse("tensor '" + entry.name + "' was not verified while arriving");
    }
    hashes.push_back(entry.target_hash);
  }
  Result<Hash128> hash = CheckpointHashFromTensorHashes(staging_.view(), hashes);
  if (!hash.ok() || *hash != finished.target_hash) {
    return refuse("the staged tensors do not make checkpoint " + finished.target_hash.ToHex());
  }
  return std::move(staging_);
}

}  // namespace flywheel::sync
