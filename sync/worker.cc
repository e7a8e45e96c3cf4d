#include "sync/worker.h"

#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <unordered_map>

#include "base/env.h"
#include "delta/delta.h"
#include "delta/format.h"
#include "checkpoint/safetensors.h"
#include "delta/wire.h"
#include "sync/catalog_verifier.h"
#include "sync/keyframe_stager.h"
#include "sync/role_status.h"
#include "sync/sha256_stream.h"
#include "sync/upstream.h"

namespace flywheel::sync {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using transport::Clock;

class EarlyDecoder;

struct Worker::Impl : std::enable_shared_from_this<Worker::Impl> {
  Impl(asio::any_io_executor executor, WorkerOptions options)
      : executor(executor),
        options(std::move(options)),
        cpu(static_cast<size_t>(std::max(1, this->options.common.threads))),
        catalog_changed(executor) {}

  asio::any_io_executor executor;
  WorkerOptions options;
  NodeIdentity identity;
  asio::thread_pool cpu;
  // Decoding and verifying ahead run on one thread of their own at the lowest CPU
  // priority (nice 19) while a delta arrives: on a host the publisher or other roles share
  // they only take idle cores. Before an apply takes the chunks its priority is restored,
  // so a chunk it is decoding cannot hold the apply up.
  // A process that may not raise a thread's priority back (no CAP_SYS_NICE, RLIMIT_NICE
  // too low) decodes ahead on the CPU pool at normal priority instead (ahead_tid stays 0).
  asio::thread_pool ahead{1};
  std::atomic<pid_t> ahead_tid{0};
  std::atomic<int> ahead_nice{0};
  void AheadPriority(int nice) {  // one syscall per change, not per chunk scheduled
    const pid_t tid = ahead_tid.load();
    if (tid != 0 && ahead_nice.exchange(nice) != nice) {
      ::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice);
    }
  }
  // On the ahead thread: whether it can go to nice 19 and back.
  void ProbeAheadPriority() {
    const pid_t tid = static_cast<pid_t>(::gettid());
    const int before = ::getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
    if (::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 19) != 0) return;
    if (::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), before) != 0) {
      // This thread stays at nice 19, unused: decoding ahead goes to the CPU pool.
      spdlog::info("decoding ahead at normal priority: this process cannot raise a thread's "
                   "priority back from nice 19 (needs CAP_SYS_NICE or RLIMIT_NICE)");
      return;
    }
    ahead_tid = tid;
  }
  asio::thread_pool& AheadPool() { return ahead_tid.load() != 0 ? ahead : cpu; }
  LinkRegistry links;
  std::unique_ptr<Upstream> upstream;
  std::unique_ptr<transport::HttpServer> http;
  std::atomic<bool> stopped{false};
  std::atomic<bool> leaving{false};  // Stop() was called

  // Network-thread state.
  Catalog catalog;
  bool have_catalog = false;
  transport::Signal catalog_changed;
  std::map<uint64_t, Clock::time_point> head_seen;  // when a head version was first announced
  std::map<std::pair<ArtifactKey, std::string>, bool> rejected;  // (artifact, target hash)
  std::map<ArtifactKey, std::unique_ptr<Download>> downloads;    // partial, kept for resume
  // With trusted keys: each download's SHA-256, advanced as its pieces arrive.
  std::map<ArtifactKey, std::unique_ptr<PrefixSha256>> hashers;
  // Each delta download's chunks decoded ahead, and the one arriving now (for status).
  std::map<ArtifactKey, std::shared_ptr<EarlyDecoder>> early_decoders;
  std::shared_ptr<EarlyDecoder> arriving;
  // A joining worker's keyframe downloads, staged tensor by tensor as they arrive, and the
  // one arriving now (for status).
  std::map<ArtifactKey, std::shared_ptr<KeyframeStager>> keyframe_stagers;
  std::shared_ptr<KeyframeStager> arriving_keyframe;
  uint64_t catalog_generation = 0;  // catalogs received
  uint64_t last_early_decode_unix_us = 0;
  void Forget(const ArtifactKey& key) {
    downloads.erase(key);
    hashers.erase(key);
    early_decoders.erase(key);
    keyframe_stagers.erase(key);
  }
  // The download of `info`, kept (or grown, for a delta still streaming) when one for the
  // same pieces exists, else a new one; with its hasher and early decoder.
  struct Transfer {
    Download* download;
    PrefixSha256* hasher;                 // null without trusted keys
    std::shared_ptr<EarlyDecoder> early;  // null for a keyframe
    // A keyframe fetched while nothing is served (a joining worker); else null.
    std::shared_ptr<KeyframeStager> stager;
    void Advance() const;  // pieces arrived
  };
  // The most bytes of tensors a staged keyframe may declare (the worker's artifact limit).
  uint64_t StagingLimit() const {
    return options.common.max_artifact_bytes != 0 ? options.common.max_artifact_bytes
                                                  : PhysicalMemoryBytes();
  }
  Transfer Prepare(const ArtifactInfo& info);
  // A delta the upstream is still streaming from the version served: fetched and decoded
  // ahead as far as it is listed. With nothing served, a keyframe still streaming (the
  // first version being published): fetched and staged ahead.
  const ArtifactInfo* StreamingFromServed() const;
  awaitable<void> Prefetch(ArtifactInfo info);
  uint64_t artifacts_rejected = 0;
  uint64_t last_apply_chunks_early = 0;  // of those, decoded while it was arriving
  uint64_t swaps = 0;
  uint64_t exports = 0;
  double last_swap_ms = 0;
  double last_apply_ms = 0;
  std::atomic<uint64_t> last_swap_pause_us{0};  // time spent in options.on_swap
  std::atomic<uint64_t> swaps_refused{0};       // versions options.on_swap refused
  std::string last_error;
  uint64_t ignored_older_heads = 0;
  uint64_t export_failures = 0;
  std::unique_ptr<CatalogVerifier> verifier;  // --trust-key
  ManifestFacts served_facts;  // the signed manifest of the version served (run_id "" if none)

  // How this worker joined: from Start to serving the head of the catalog for the first
  // time, step by step (Unix microseconds; 0: not yet), reported as "join" in /v1/status
  // so that a restarted worker's time to the head can be taken apart (`bench churn`).
  // Network-thread state.
  struct JoinTimeline {
    uint64_t started_unix_us = 0;           // Worker::Start
    uint64_t first_catalog_unix_us = 0;     // subscribed: the first catalog arrived
    uint64_t keyframe_version = 0;
    uint64_t keyframe_fetch_unix_us = 0;    // its fetch began
    uint64_t keyframe_fetched_unix_us = 0;  // its last piece arrived
    uint64_t keyframe_served_unix_us = 0;   // decoded, verified and swapped in
    int deltas = 0;                         // applied after it on the way to the head
    double deltas_fetch_ms = 0, deltas_apply_ms = 0;
    uint64_t done_unix_us = 0;  // when the head was served (its swap)
    double cpu_seconds = 0;     // this process's CPU time (user + system) by then
  } join;
  void NoteJoinStep(const ArtifactInfo& info, Clock::time_point fetch_start, double fetch_ms);
  void NoteJoinDone();
  nlohmann::json JoinJson() const;

  // The serving weights.
  mutable std::shared_mutex weights_mutex;
  OwnedCheckpoint weights;
  std::vector<Hash128> tensor_hashes;
  std::atomic<uint64_t> version{0};
  Hash128 hash;  // guarded by weights_mutex
  // What is served, as one snapshot for the network thread (which must never wait for an
  // apply): version, hash and swap time always belong together.
  struct Served {
    uint64_t version = 0;
    Hash128 hash;
    uint64_t swap_unix_us = 0;  // when this version started being served
  };
  mutable std::mutex served_mutex;
  Served served;
  Served ServedNow() const {
    std::lock_guard lock(served_mutex);
    return served;
  }
  void PublishServed() {  // REQUIRES: weights_mutex held
    std::lock_guard lock(served_mutex);
    if (served.version != version.load() || served.hash != hash)
      served.swap_unix_us = UnixMicrosNow();
    served.version = version.load();
    served.hash = hash;
  }

  // Hands the verified new version (`view`) to options.on_swap; its error refuses it.
  // REQUIRES: weights_mutex held exclusively.
  flywheel::Status NotifySwap(uint64_t new_version, const CheckpointView& view,
                              const std::vector<delta::ChangedWords>* changes, bool full,
                              const CheckpointView* previous = nullptr) {
    if (!options.on_swap) return flywheel::Status::Ok();
    const auto start = Clock::now();
    static const std::vector<delta::ChangedWords> kNone;
    flywheel::Status accepted = options.on_swap(
        SwapEvent{new_version, &view, changes ? changes : &kNone, full, previous});
    last_swap_pause_us.store(static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count()));
    if (!accepted.ok()) {
      swaps_refused.fetch_add(1);
      return flywheel::Status(accepted.code(), "the serving engine refused v" +
                                                   std::to_string(new_version) + ": " +
                                                   accepted.message());
    }
    return accepted;
  }

  awaitable<void> UpdateLoop();
  // One artifact of a plan: fetched, checked and applied; false when the plan stops here
  // (fetch failed, signature or freshness refused, apply refused): replan.
  awaitable<bool> Update(const ArtifactInfo& info);
  // With trusted keys: the manifest was verified with the catalog; now the bytes must be
  // the ones signed, and the version newer than the one served. The verified facts, or
  // the refusal (counted as a replay, or as forged bytes whose download is dropped).
  Result<ManifestFacts> CheckSigned(const ArtifactInfo& info, const Transfer& transfer);
  // Counts and logs the swap to the version now served (returned).
  uint64_t RecordSwap(const ArtifactKey& key, Clock::time_point fetch_start, double fetch_ms,
                      Clock::time_point apply_start, const EarlyDecoder* early);
  awaitable<void> ExportServing(uint64_t serving);  // to options.export_dir, on the CPU pool
  std::vector<ArtifactInfo> Plan();
  Status Apply(const ArtifactInfo& info, std::span<const std::byte> bytes,
               delta::PreparedChunks* prepared = nullptr, KeyframeStager* stager = nullptr);
  // A keyframe into new buffers: the stager's tensors when it staged and verified them
  // all while they arrived, else decoded whole here.
  Result<OwnedCheckpoint> DecodeKeyframe(const delta::DeltaView& view, int threads,
                                         KeyframeStager* stager);
  // The steps of Apply. REQUIRES (ApplyKeyframeInPlace): weights_mutex held exclusively
  // and the weights in the keyframe's layout.
  flywheel::Status ApplyDelta(const std::string& what, const delta::DeltaView& view, int threads,
                              delta::PreparedChunks* prepared);
  flywheel::Status ApplyKeyframeInPlace(const delta::DeltaView& view, int threads);
  flywheel::Status Export(uint64_t serving_version);
  WorkerStatus CurrentStatus() const;
  nlohmann::json StatusJson() const {  // CurrentStatus, with the join's timeline
    nlohmann::json json = ToJson(CurrentStatus());
    json["join"] = JoinJson();
    if (options.extend_status) options.extend_status(json);
    return json;
  }
  void OnCatalog(Catalog received);
  // What this worker reports upstream: its version, hash and traffic.
  wire::Report MakeReport();
};

void Worker::Impl::OnCatalog(Catalog received) {
  verifier->Filter(&received, "worker " + identity.node_id);
  if (received.head_version < version.load()) {
    // A replayed or restarted-older upstream: never move back.
    ++ignored_older_heads;
    spdlog::warn("upstream announces head v{} but this worker serves v{}; ignoring it",
                 received.head_version, version.load());
  }
  if (join.first_catalog_unix_us == 0) join.first_catalog_unix_us = UnixMicrosNow();
  if (received.head_version != 0 && !head_seen.count(received.head_version)) {
    head_seen[received.head_version] = Clock::now();
  }
  catalog = std::move(received);
  have_catalog = true;
  ++catalog_generation;
  catalog_changed.Notify();
}

// Decodes a delta's sparse chunks on the CPU pool while the rest of its pieces are still
// arriving (delta::PreparedChunks), so that the apply after the last piece mostly writes
// words and verifies. A chunk is decoded once the pieces received in order from the
// start hold it: for a format-1 delta once the manifest is in, for a streamed (format-2)
// one as each chunk record lands, before the publisher has even finished encoding.
// Chunks are decoded against the weights served, read under the shared lock, and only
// while they are the delta's base; nothing is written to them here, and the apply
// verifies the base before and every hash after as always.
class EarlyDecoder : public std::enable_shared_from_this<EarlyDecoder> {
 public:
  // Decoded data kept per artifact at most (6 bytes per changed bf16 word): past it, the
  // remaining chunks are decoded by the apply.
  static constexpr uint64_t kBudgetBytes = 256ull << 20;

  EarlyDecoder(Worker::Impl* worker, std::shared_ptr<const GrowableBytes> bytes)
      : worker_(worker), bytes_(std::move(bytes)) {}

  // Pieces arrived (the network thread): schedules every chunk the in-order prefix now
  // holds whole.
  void Advance(const Download& download) {
    if (closed_ || download.info.piece_bytes == 0) return;
    while (prefix_pieces_ < download.have.size() && download.have[prefix_pieces_]) ++prefix_pieces_;
    const uint64_t prefix = std::min(download.info.size_bytes, prefix_pieces_ * download.info.piece_bytes);
    if (prefix < 10 || prefix == prefix_) return;
    prefix_ = prefix;
    const std::span<const std::byte> bytes(bytes_->data(), prefix);
    if (!streamed_ && !view_) streamed_ = delta::StreamReader::IsStreamed(bytes);
    if (streamed_) {
      AdvanceStreamed(bytes);
    } else {
      AdvanceBuffered(download, bytes);
    }
  }

  // No chunk starts decoding after this; the apply takes what is ready.
  delta::PreparedChunks* Close() {
    closed_ = true;
    return prepared_.get();
  }
  size_t decoded() const { return prepared_ ? prepared_->used() : 0; }
  size_t prepared() const { return prepared_ ? prepared_->prepared() : 0; }
  uint64_t first_decode_unix_us() const { return first_decode_unix_us_.load(); }

 private:
  // Format 2: every chunk record as it completes.
  void AdvanceStreamed(std::span<const std::byte> bytes) {
    if (!reader_.Advance(bytes).ok()) {
      closed_ = true;  // the apply will say what is wrong, if anything
      return;
    }
    if (!reader_.has_prologue()) return;
    const delta::Manifest& m = reader_.manifest();
    if (m.keyframe) {
      closed_ = true;
      return;
    }
    if (!prepared_) {
      base_version_ = m.base_version;
      base_hash_ = m.base_hash;
      prepared_ = std::make_unique<delta::PreparedChunks>(reader_.max_chunks(), kBudgetBytes);
    }
    records_of_.resize(m.tensors.size());
    for (; next_ < m.chunks.size(); ++next_) {
      const delta::ChunkEntry& e = m.chunks[next_];
      records_of_[e.tensor_index].push_back(Sparse(e.kind) ? e.record : kNotSparse);
      if (!Sparse(e.kind)) continue;
      Schedule(std::make_shared<const delta::DeltaView>(reader_.ChunkView(next_, bytes)), 0);
    }
    // A tensor whose record is in has all its chunks scheduled: verify it once they are
    // decoded (the pool runs tasks in order), so the apply need not hash it again.
    const std::vector<uint32_t>& finished = reader_.finished_tensors();
    for (; next_tensor_ < finished.size(); ++next_tensor_) {
      const uint32_t t = finished[next_tensor_];
      const std::vector<uint32_t>& records = records_of_[t];
      if (records.empty() ||
          std::find(records.begin(), records.end(), kNotSparse) != records.end()) {
        continue;
      }
      const delta::TensorEntry& entry = m.tensors[t];
      asio::post(worker_->AheadPool(), [self = shared_from_this(), t, records, name = entry.name,
                                w = DTypeWordBytes(entry.dtype), hash = entry.target_hash] {
        self->Verify(t, records, name, w, hash);
      });
    }
  }

  // Format 1: the manifest first, then each chunk whose payload the prefix covers.
  void AdvanceBuffered(const Download& download, std::span<const std::byte> bytes) {
    if (!view_) {
      if (bytes.size() < delta::format::kHeaderBytes) return;
      const uint64_t manifest_bytes =
          delta::wire::LoadFixed(reinterpret_cast<const uint8_t*>(bytes.data()) + 16, 8);
      if (manifest_bytes > download.info.size_bytes ||
          bytes.size() < delta::format::kHeaderBytes + manifest_bytes) {
        return;
      }
      // The payloads are not read here: each chunk's checksum is checked when it is decoded.
      Result<delta::DeltaView> view = delta::DeltaView::Parse(download.bytes->bytes());
      if (!view.ok() || view->manifest().keyframe) {
        closed_ = true;
        return;
      }
      view_ = std::make_shared<const delta::DeltaView>(std::move(*view));
      payload_start_ = delta::format::kHeaderBytes + manifest_bytes;
      base_version_ = view_->manifest().base_version;
      base_hash_ = view_->manifest().base_hash;
      prepared_ = std::make_unique<delta::PreparedChunks>(view_->manifest().chunks.size(), kBudgetBytes);
    }
    const delta::Manifest& m = view_->manifest();
    for (; next_ < m.chunks.size(); ++next_) {
      const delta::ChunkEntry& e = m.chunks[next_];
      if (payload_start_ + e.payload_offset + e.payload_bytes > bytes.size()) break;
      if (Sparse(e.kind) && e.payload_bytes != 0) Schedule(view_, next_);
    }
  }

  void Schedule(std::shared_ptr<const delta::DeltaView> view, size_t chunk) {
    worker_->AheadPriority(19);
    asio::post(worker_->AheadPool(), [self = shared_from_this(), view = std::move(view), chunk] {
      self->Decode(*view, chunk);
    });
  }

  // On the CPU pool. ~Worker joins the pool before the worker goes away, and a stopped
  // worker starts no decode.
  void Decode(const delta::DeltaView& view, size_t chunk) {
    if (closed_ || worker_->stopped) return;
    std::shared_lock lock(worker_->weights_mutex);
    if (closed_) return;  // the apply may have run meanwhile: these are no longer the base
    if (worker_->version.load() != base_version_ || worker_->hash != base_hash_) return;
    // The served base's tensors by name, found once (the layout cannot change while it is
    // the base).
    std::call_once(mapped_, [&] {
      for (const OwnedTensor& tensor : worker_->weights.tensors) by_name_.emplace(tensor.name, &tensor);
    });
    const delta::Manifest& m = view.manifest();
    auto it = by_name_.find(m.tensors[m.chunks[chunk].tensor_index].name);
    if (it == by_name_.end()) return;
    if (prepared_->Prepare(view, chunk, it->second->data)) {
      uint64_t none = 0;
      first_decode_unix_us_.compare_exchange_strong(none, UnixMicrosNow());
    }
  }

  // On the CPU pool, as Decode.
  void Verify(uint32_t tensor, const std::vector<uint32_t>& records, const std::string& name,
              int word_bytes, const Hash128& target_hash) {
    if (closed_ || worker_->stopped) return;
    std::shared_lock lock(worker_->weights_mutex);
    if (closed_) return;
    if (worker_->version.load() != base_version_ || worker_->hash != base_hash_) return;
    std::call_once(mapped_, [&] {
      for (const OwnedTensor& t : worker_->weights.tensors) by_name_.emplace(t.name, &t);
    });
    auto it = by_name_.find(name);
    if (it == by_name_.end()) return;
    if (prepared_->VerifyTensor(tensor, records, word_bytes, it->second->data, target_hash)) {
      verified_.fetch_add(1);
    }
  }

 public:
  uint64_t verified() const { return verified_.load(); }

 private:
  static constexpr uint32_t kNotSparse = ~uint32_t{0};
  // The kinds PreparedChunks decodes ahead: sparse chunks, context-modelled ones included.
  static bool Sparse(delta::ChunkKind kind) {
    return kind == delta::ChunkKind::kSparse || kind == delta::ChunkKind::kSparseContext;
  }
  Worker::Impl* worker_;
  const std::shared_ptr<const GrowableBytes> bytes_;
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> verified_{0};
  std::vector<std::vector<uint32_t>> records_of_;  // format 2: per tensor, its chunk records
  size_t next_tensor_ = 0;                          // format 2: finished tensors looked at
  // Network-thread state.
  uint64_t prefix_pieces_ = 0;  // pieces present from the start
  uint64_t prefix_ = 0;         // bytes those hold
  bool streamed_ = false;
  delta::StreamReader reader_;                      // format 2
  std::shared_ptr<const delta::DeltaView> view_;    // format 1
  uint64_t payload_start_ = 0;                      // format 1
  size_t next_ = 0;                                 // the next chunk to look at
  // Set before the first Schedule, read by Decode.
  uint64_t base_version_ = 0;
  Hash128 base_hash_;
  std::unique_ptr<delta::PreparedChunks> prepared_;
  std::once_flag mapped_;
  std::unordered_map<std::string, const OwnedTensor*> by_name_;
  std::atomic<uint64_t> first_decode_unix_us_{0};
};

void Worker::Impl::Transfer::Advance() const {
  if (hasher) hasher->Advance(*download);
  if (early) early->Advance(*download);
  if (stager) stager->Advance(*download);
}

std::vector<ArtifactInfo> Worker::Impl::Plan() {
  const uint64_t head = catalog.head_version;
  const Served now = ServedNow();
  const uint64_t current = now.version;
  if (head <= current) return {};
  const Hash128 current_hash = now.hash;
  auto usable = [&](const ArtifactInfo& info) {
    return !info.streaming && !rejected.count({KeyOf(info), info.target_hash.ToHex()});
  };
  // The chain of deltas from (from_version, from_hash) up to the head.
  auto chain = [&](uint64_t from_version, Hash128 from_hash, std::vector<ArtifactInfo>* path) {
    while (from_version < head) {
      const ArtifactInfo* next = nullptr;
      for (const ArtifactInfo& info : catalog.artifacts) {
        if (info.kind == ArtifactKind::kDelta && info.base_version == from_version &&
            info.base_hash == from_hash && usable(info)) {
          next = &info;
        }
      }
      if (next == nullptr) return false;
      path->push_back(*next);
      from_version = next->target_version;
      from_hash = next->target_hash;
    }
    return true;
  };
  std::vector<ArtifactInfo> path;
  if (current != 0 && chain(current, current_hash, &path)) return path;
  // Else the newest usable keyframe and the deltas after it.
  for (auto it = catalog.artifacts.rbegin(); it != catalog.artifacts.rend(); ++it) {
    if (it->kind != ArtifactKind::kKeyframe || it->target_version > head || !usable(*it)) continue;
    if (it->target_version <= current) break;  // nothing newer than what we serve
    path = {*it};
    if (chain(it->target_version, it->target_hash, &path)) return path;
  }
  return {};
}

namespace {

bool SameLayout(const OwnedCheckpoint& weights, const delta::Manifest& manifest) {
  if (weights.tensors.size() != manifest.tensors.size()) return false;
  for (size_t i = 0; i < weights.tensors.size(); ++i) {
    const OwnedTensor& t = weights.tensors[i];
    const delta::TensorEntry& e = manifest.tensors[i];
    if (t.name != e.name || t.dtype != e.dtype || t.shape != e.shape) return false;
  }
  return true;
}

}  // namespace

flywheel::Status Worker::Impl::Apply(const ArtifactInfo& info, std::span<const std::byte> bytes,
                                     delta::PreparedChunks* prepared, KeyframeStager* stager) {
  const std::string what = Describe(KeyOf(info));
  FW_ASSIGN_OR_RETURN(delta::DeltaView view, delta::DeltaView::Parse(bytes));
  const delta::Manifest& manifest = view.manifest();
  if (manifest.keyframe != (info.kind == ArtifactKind::kKeyframe) ||
      manifest.target_version != info.target_version || manifest.target_hash != info.target_hash ||
      (!manifest.keyframe &&
       (manifest.base_version != info.base_version || manifest.base_hash != info.base_hash))) {
    return flywheel::Status::Corruption(what + " does not match its catalog entry");
  }
  const int threads = std::max(1, options.common.threads);
  if (!manifest.keyframe) return ApplyDelta(what, view, threads, prepared);
  // A keyframe: in place when the layout is the same (no second copy of the weights).
  {
    std::unique_lock lock(weights_mutex);
    if (version.load() != 0 && SameLayout(weights, manifest)) {
      return ApplyKeyframeInPlace(view, threads);
    }
  }
  FW_ASSIGN_OR_RETURN(OwnedCheckpoint decoded, DecodeKeyframe(view, threads, stager));
  std::vector<Hash128> hashes;
  for (const delta::TensorEntry& entry : manifest.tensors) hashes.push_back(entry.target_hash);
  std::unique_lock lock(weights_mutex);
  // The engine sees the new buffers first; refused, they are dropped and nothing changed.
  {
    const CheckpointView previous = weights.view();
    FW_RETURN_IF_ERROR(NotifySwap(manifest.target_version, decoded.view(), nullptr, true,
                                  version.load() != 0 ? &previous : nullptr));
  }
  weights = std::move(decoded);  // the tensors' buffers move, so views of them stay valid
  tensor_hashes = std::move(hashes);
  hash = manifest.target_hash;
  version.store(manifest.target_version);
  PublishServed();
  return flywheel::Status::Ok();
}

Result<OwnedCheckpoint> Worker::Impl::DecodeKeyframe(const delta::DeltaView& view, int threads,
                                                    KeyframeStager* stager) {
  if (stager != nullptr && view.streamed()) {  // a format-1 keyframe is never staged
    std::string why_not;
    std::optional<OwnedCheckpoint> staged = stager->Take(view.manifest(), &why_not);
    if (staged) return std::move(*staged);
    spdlog::warn("keyframe v{} was not staged while it arrived ({}); decoding it whole",
                 view.manifest().target_version, why_not);
  }
  return delta::DecodeKeyframe(view, threads);
}

flywheel::Status Worker::Impl::ApplyDelta(const std::string& what, const delta::DeltaView& view,
                                          int threads, delta::PreparedChunks* prepared) {
  const delta::Manifest& manifest = view.manifest();
  std::unique_lock lock(weights_mutex);
  if (version.load() != manifest.base_version || hash != manifest.base_hash) {
    return flywheel::Status::Mismatch(what + " applies to v" +
                                      std::to_string(manifest.base_version) + " (" +
                                      manifest.base_hash.ToHex() + ") but this worker serves v" +
                                      std::to_string(version.load()) + " (" + hash.ToHex() + ")");
  }
  delta::ApplyOptions apply;
  apply.threads = threads;
  apply.prepared = prepared;
  apply.state_tensor_hashes = tensor_hashes;
  apply.report_changes = static_cast<bool>(options.on_swap);
  if (options.on_swap) {
    // The engine takes the version while the undo records still exist, so its refusal
    // restores the base.
    apply.before_commit = [&](const delta::ApplyStats& applied) {
      return NotifySwap(manifest.target_version, weights.view(), &applied.changes, false);
    };
  }
  MutableCheckpointView state = weights.mutable_view();
  FW_ASSIGN_OR_RETURN(delta::ApplyStats stats, delta::ApplyInPlace(state, view, apply));
  tensor_hashes = std::move(stats.tensor_hashes);
  hash = manifest.target_hash;
  version.store(manifest.target_version);
  PublishServed();
  return flywheel::Status::Ok();
}

flywheel::Status Worker::Impl::ApplyKeyframeInPlace(const delta::DeltaView& view, int threads) {
  const delta::Manifest& manifest = view.manifest();
  delta::ApplyOptions apply;
  apply.threads = threads;
  // Without an engine the undo log (a whole copy) is not kept: a failed keyframe leaves
  // nothing served until a good one. With an engine that may refuse the version it is.
  apply.restore_on_failure = static_cast<bool>(options.on_swap);
  apply.report_changes = static_cast<bool>(options.on_swap);
  if (options.on_swap) {
    apply.before_commit = [&](const delta::ApplyStats& applied) {
      return NotifySwap(manifest.target_version, weights.view(), &applied.changes, false);
    };
  }
  MutableCheckpointView state = weights.mutable_view();
  Result<delta::ApplyStats> stats = delta::ApplyInPlace(state, view, apply);
  if (!stats.ok() && apply.restore_on_failure) return stats.status();  // the old version stays
  if (!stats.ok()) {
    // The weights are partly overwritten: serve nothing until a good keyframe.
    version.store(0);
    hash = Hash128{};
    tensor_hashes.clear();
    PublishServed();
    return stats.status();
  }
  tensor_hashes = std::move(stats->tensor_hashes);
  hash = manifest.target_hash;
  version.store(manifest.target_version);
  PublishServed();
  return flywheel::Status::Ok();
}

flywheel::Status Worker::Impl::Export(uint64_t serving_version) {
  std::shared_lock lock(weights_mutex);
  if (version.load() != serving_version) return flywheel::Status::Ok();  // a newer swap already happened
  std::error_code ec;
  fs::create_directories(options.export_dir, ec);
  if (ec) {
    return flywheel::Status::IOError("cannot create export directory " + options.export_dir + ": " +
                                     ec.message());
  }
  char name[64];
  std::snprintf(name, sizeof name, "v%llu.safetensors",
                static_cast<unsigned long long>(serving_version));
  const std::string path = (fs::path(options.export_dir) / name).string();
  std::map<std::string, std::string> metadata{{"flywheel_version", std::to_string(serving_version)},
                                              {"flywheel_weights_hash", hash.ToHex()}};
  flywheel::Status status = WriteSafetensors(path, weights.view(), metadata);
  lock.unlock();
  if (!status.ok()) return status;
  // Keep the newest export_keep files v<N>.safetensors.
  std::vector<std::pair<uint64_t, fs::path>> exported;
  for (const auto& entry : fs::directory_iterator(options.export_dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (file.size() > 13 && file[0] == 'v' && file.ends_with(".safetensors")) {
      const std::string digits = file.substr(1, file.size() - 13);
      if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos) {
        exported.emplace_back(std::stoull(digits), entry.path());
      }
    }
  }
  std::sort(exported.rbegin(), exported.rend());
  for (size_t i = static_cast<size_t>(std::max(1, options.export_keep)); i < exported.size(); ++i) {
    fs::remove(exported[i].second, ec);
  }
  return flywheel::Status::Ok();
}

Worker::Impl::Transfer Worker::Impl::Prepare(const ArtifactInfo& info) {
  const ArtifactKey key = KeyOf(info);
  auto& slot = downloads[key];
  if (!slot || (slot->info != info && !(slot->info.streaming && slot->Extend(info)))) {
    slot = std::make_unique<Download>(info);
    hashers.erase(key);
    early_decoders.erase(key);
    keyframe_stagers.erase(key);
  }
  Transfer transfer{slot.get(), nullptr, nullptr, nullptr};
  if (verifier->enabled()) {
    auto& owned = hashers[key];
    if (!owned) owned = std::make_unique<PrefixSha256>();
    transfer.hasher = owned.get();
  }
  if (info.kind == ArtifactKind::kDelta) {
    auto& early = early_decoders[key];
    if (!early) early = std::make_shared<EarlyDecoder>(this, slot->bytes);
    early->Advance(*slot);  // pieces a resumed or grown download holds already
    transfer.early = early;
  }
  auto stager = keyframe_stagers.find(key);
  if (info.kind == ArtifactKind::kKeyframe && options.stage_keyframes &&
      (stager != keyframe_stagers.end() || ServedNow().version == 0)) {
    // Joining: no weights to patch in place, so the keyframe is staged as it arrives.
    if (stager == keyframe_stagers.end()) {
      stager = keyframe_stagers
                   .emplace(key, std::make_shared<KeyframeStager>(cpu, slot->bytes, StagingLimit()))
                   .first;
    }
    stager->second->Advance(*slot);
    transfer.stager = stager->second;
  }
  arriving = transfer.early;
  arriving_keyframe = transfer.stager;
  return transfer;
}

const ArtifactInfo* Worker::Impl::StreamingFromServed() const {
  const Served now = ServedNow();
  if (now.version == 0) {
    for (const ArtifactInfo& info : catalog.artifacts) {
      // Not with trusted keys: nothing unsigned is fetched before its signed entry comes.
      if (info.streaming && info.kind == ArtifactKind::kKeyframe && options.stage_keyframes &&
          !verifier->enabled() && info.target_version > catalog.head_version &&
          !rejected.count({KeyOf(info), Hash128{}.ToHex()})) {
        return &info;
      }
    }
    return nullptr;
  }
  for (const ArtifactInfo& info : catalog.artifacts) {
    if (info.streaming && info.kind == ArtifactKind::kDelta && info.base_version == now.version &&
        info.base_hash == now.hash && !rejected.count({KeyOf(info), Hash128{}.ToHex()})) {
      return &info;
    }
  }
  return nullptr;
}

awaitable<void> Worker::Impl::Prefetch(ArtifactInfo info) {
  const ArtifactKey key = KeyOf(info);
  Transfer transfer = Prepare(info);
  Download& download = *transfer.download;
  if (download.all_known()) co_return;
  std::function<void(uint32_t)> on_piece = [transfer](uint32_t) { transfer.Advance(); };
  flywheel::Status fetched = co_await upstream->Fetch(download, on_piece);
  if (!fetched.ok()) {
    spdlog::debug("fetching {} while it streams: {}", Describe(key), fetched.message());
    if (fetched.code() == StatusCode::kNotFound) Forget(key);
    co_await transport::SleepFor(100ms);
  }
}

awaitable<void> Worker::Impl::UpdateLoop() {
  auto self = shared_from_this();
  while (!stopped) {
    const uint64_t generation = catalog_generation;
    std::vector<ArtifactInfo> plan = have_catalog ? Plan() : std::vector<ArtifactInfo>{};
    if (plan.empty()) {
      if (have_catalog && join.done_unix_us == 0 && version.load() != 0) NoteJoinDone();
      // Up to date with the head: a delta the publisher is still encoding is fetched and
      // decoded as far as it is listed, and the next catalog lists more.
      if (const ArtifactInfo* streaming = have_catalog ? StreamingFromServed() : nullptr) {
        co_await Prefetch(*streaming);
      }
      if (catalog_generation == generation && !stopped) co_await catalog_changed.Wait();
      continue;
    }
    for (const ArtifactInfo& info : plan) {
      if (stopped) co_return;
      const bool swapped = co_await Update(info);
      if (!swapped) break;  // replan from the next catalog
    }
  }
}

awaitable<bool> Worker::Impl::Update(const ArtifactInfo& info) {
  const ArtifactKey key = KeyOf(info);
  Transfer transfer = Prepare(info);
  Download& download = *transfer.download;
  std::shared_ptr<EarlyDecoder> early = transfer.early;
  std::function<void(uint32_t)> on_piece = [transfer](uint32_t) { transfer.Advance(); };
  const auto fetch_start = Clock::now();
  flywheel::Status fetched = co_await upstream->Fetch(download, on_piece);
  if (!fetched.ok()) {
    last_error = "fetching " + Describe(key) + ": " + fetched.message();
    spdlog::warn("{}", last_error);
    if (fetched.code() == StatusCode::kNotFound) {
      // Gone upstream (retention, or a relay restart): replan from the next catalog.
      Forget(key);
    }
    co_await transport::SleepFor(200ms);
    co_return false;
  }
  const auto fetch_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - fetch_start).count();
  const auto apply_start = Clock::now();
  auto bytes = download.bytes;
  auto task = std::make_shared<ArtifactInfo>(info);
  std::optional<ManifestFacts> facts;
  if (verifier->enabled()) {
    Result<ManifestFacts> trusted = CheckSigned(info, transfer);
    if (!trusted.ok()) {
      last_error = "refused " + Describe(key) + ": " + trusted.status().message();
      spdlog::error("{} (still serving v{})", last_error, version.load());
      // Forged bytes are not the artifact's fault: fetch it again, after a pause (the
      // upstream may fail over to an honest one meanwhile).
      co_await transport::SleepFor(1s);
      co_return false;
    }
    facts = std::move(*trusted);
  }
  delta::PreparedChunks* prepared = early ? early->Close() : nullptr;
  AheadPriority(0);  // a chunk being decoded ahead now must not hold the apply up
  std::shared_ptr<KeyframeStager> stager = transfer.stager;
  auto apply = [this, task, bytes, prepared, stager] {
    return Apply(*task, bytes->bytes(), prepared, stager.get());
  };
  flywheel::Status applied = (co_await transport::RunOn(cpu, apply)).value();
  last_apply_chunks_early = early ? early->decoded() : stager ? stager->chunks_staged() : 0;
  last_early_decode_unix_us = early ? early->first_decode_unix_us() : 0;
  arriving.reset();
  arriving_keyframe.reset();
  Forget(key);
  if (!applied.ok()) {
    ++artifacts_rejected;
    rejected[{key, info.target_hash.ToHex()}] = true;
    last_error = "rejected " + Describe(key) + ": " + applied.message();
    spdlog::error("{}", last_error);
    co_return false;  // replan: a keyframe path avoids the rejected artifact
  }
  if (facts) served_facts = *facts;
  const uint64_t serving = RecordSwap(key, fetch_start, fetch_ms, apply_start, early.get());
  if (join.done_unix_us == 0) NoteJoinStep(info, fetch_start, fetch_ms);
  if (!options.export_dir.empty()) co_await ExportServing(serving);
  co_return true;
}

Result<ManifestFacts> Worker::Impl::CheckSigned(const ArtifactInfo& info,
                                                const Transfer& transfer) {
  const ArtifactKey key = KeyOf(info);
  const ManifestFacts* known = verifier->FactsOf(key);
  if (known == nullptr) {
    return flywheel::Status::Mismatch(Describe(key) + " is no longer in a verified catalog");
  }
  if (flywheel::Status fresh = CheckFresh(served_facts, *known); !fresh.ok()) {
    verifier->CountReplay(fresh.message());
    rejected[{key, info.target_hash.ToHex()}] = true;
    return fresh;
  }
  ManifestFacts facts = *known;
  // Most of the hash was computed while the pieces arrived; the tail is left.
  if (flywheel::Status same = transfer.hasher->Check(*transfer.download, facts); !same.ok()) {
    Forget(key);
    verifier->CountForged(same.message());
    return same;
  }
  return facts;
}

uint64_t Worker::Impl::RecordSwap(const ArtifactKey& key, Clock::time_point fetch_start,
                                  double fetch_ms, Clock::time_point apply_start,
                                  const EarlyDecoder* early) {
  const auto now = Clock::now();
  last_apply_ms = std::chrono::duration<double, std::milli>(now - apply_start).count();
  const uint64_t serving = version.load();
  auto seen = head_seen.find(serving);
  last_swap_ms = std::chrono::duration<double, std::milli>(
                     now - (seen != head_seen.end() ? seen->second : fetch_start))
                     .count();
  ++swaps;
  upstream->ReportNow();  // readiness (GET /v1/wait on the publisher) learns it now
  last_error.clear();
  spdlog::info("serving v{} ({}; fetched in {:.0f} ms, applied in {:.0f} ms, {} chunk(s) "
               "decoded and {} tensor(s) verified while arriving)",
               serving, Describe(key), fetch_ms, last_apply_ms, last_apply_chunks_early,
               early ? early->verified() : 0);
  head_seen.erase(head_seen.begin(), head_seen.upper_bound(serving));
  return serving;
}

void Worker::Impl::NoteJoinStep(const ArtifactInfo& info, Clock::time_point fetch_start,
                                double fetch_ms) {
  if (info.kind == ArtifactKind::kKeyframe) {
    // A keyframe restarts the count: the deltas before it were no part of this way in.
    const uint64_t served_us = ServedNow().swap_unix_us;
    const auto since_start = std::chrono::duration<double, std::micro>(Clock::now() - fetch_start);
    const uint64_t now_us = UnixMicrosNow();
    join.keyframe_version = info.target_version;
    join.keyframe_fetch_unix_us = now_us - static_cast<uint64_t>(since_start.count());
    join.keyframe_fetched_unix_us = join.keyframe_fetch_unix_us + static_cast<uint64_t>(fetch_ms * 1000);
    join.keyframe_served_unix_us = served_us;
    join.deltas = 0;
    join.deltas_fetch_ms = join.deltas_apply_ms = 0;
    return;
  }
  ++join.deltas;
  join.deltas_fetch_ms += fetch_ms;
  join.deltas_apply_ms += last_apply_ms;
}

void Worker::Impl::NoteJoinDone() {
  join.done_unix_us = ServedNow().swap_unix_us;
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  join.cpu_seconds = seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

nlohmann::json Worker::Impl::JoinJson() const {
  return {{"started_unix_us", join.started_unix_us},
          {"first_catalog_unix_us", join.first_catalog_unix_us},
          {"keyframe_version", join.keyframe_version},
          {"keyframe_fetch_unix_us", join.keyframe_fetch_unix_us},
          {"keyframe_fetched_unix_us", join.keyframe_fetched_unix_us},
          {"keyframe_served_unix_us", join.keyframe_served_unix_us},
          {"deltas", join.deltas},
          {"deltas_fetch_ms", join.deltas_fetch_ms},
          {"deltas_apply_ms", join.deltas_apply_ms},
          {"done_unix_us", join.done_unix_us},
          {"cpu_seconds", join.cpu_seconds}};
}

awaitable<void> Worker::Impl::ExportServing(uint64_t serving) {
  auto export_weights = [this, serving] { return Export(serving); };
  flywheel::Status exported = (co_await transport::RunOn(cpu, export_weights)).value();
  if (exported.ok()) {
    ++exports;
    co_return;
  }
  // Serving goes on; the failure shows in /v1/status and /metrics until an export
  // succeeds.
  ++export_failures;
  last_error = "exporting v" + std::to_string(serving) + ": " + exported.message();
  spdlog::error("{}", last_error);
}

WorkerStatus Worker::Impl::CurrentStatus() const {
  WorkerStatus s;
  const Served now = ServedNow();
  const uint64_t serving = now.version;
  const uint64_t head = std::max(catalog.head_version, serving);
  s.common = {.role = "worker",
              .region = identity.region,
              .node_id = identity.node_id,
              .version = serving,
              .weights_hash = serving == 0 ? "" : now.hash.ToHex(),
              .head_version = head,
              .staleness = head - serving,
              .max_staleness = catalog.max_staleness,
              .upstream = upstream->current(),
              .traffic = LinkTraffic::Of(links),
              .last_swap_ms = last_swap_ms,
              .swap_unix_us = now.swap_unix_us};
  s.leaving = leaving.load();
  s.stale = catalog.max_staleness != 0 && head - serving > catalog.max_staleness;
  s.connected = upstream->connected();
  s.last_apply_ms = last_apply_ms;
  s.last_apply_chunks_early = last_apply_chunks_early;
  s.last_early_decode_unix_us = last_early_decode_unix_us;
  s.arriving_chunks_decoded = arriving            ? arriving->prepared()
                              : arriving_keyframe ? arriving_keyframe->chunks_staged()
                                                  : 0;
  s.last_swap_pause_ms = static_cast<double>(last_swap_pause_us.load()) / 1000.0;
  s.swaps_total = swaps;
  s.exports_total = exports;
  s.fetch = upstream->counters();
  s.artifacts_rejected = artifacts_rejected;
  s.swaps_refused = swaps_refused.load();
  s.older_heads_ignored = ignored_older_heads;
  s.export_failures = export_failures;
  s.last_error = last_error;
  s.signatures = {.trusted_keys = verifier->trusted_keys(),
                  .signature_failures = verifier->failures(),
                  .replays_refused = verifier->replays(),
                  .last_signature_error = verifier->last_error(),
                  .run_id = served_facts.run_id};
  return s;
}

wire::Report Worker::Impl::MakeReport() {
  wire::Report report;
  wire::NodeState* node = report.add_nodes();
  node->set_node_id(identity.node_id);
  node->set_region(identity.region);
  node->set_role(wire::WORKER);
  const Served served = ServedNow();
  node->set_version(served.version);
  node->set_weights_hash(HashBytesOf(served.hash));
  node->set_bytes_in(links.bytes_in());
  node->set_bytes_out(links.bytes_out());
  node->set_upstream(upstream->current());
  return report;
}

Result<std::unique_ptr<Worker>> Worker::Start(asio::any_io_executor executor,
                                              WorkerOptions options) {
  if (options.upstreams.empty()) return Status::InvalidArgument("a worker needs an --upstream");
  if (options.common.region.empty()) return Status::InvalidArgument("a worker needs a --region");
  FW_ASSIGN_OR_RETURN(TlsContexts tls, MakeTlsContexts(options.common.tls, true, true));
  FW_ASSIGN_OR_RETURN(TrustedKeys trusted, TrustedKeys::Load(options.common.trust_keys));
  auto impl = std::make_shared<Impl>(executor, options);
  impl->join.started_unix_us = UnixMicrosNow();
  asio::post(impl->ahead, [raw = impl.get()] { raw->ProbeAheadPriority(); });
  impl->verifier = std::make_unique<CatalogVerifier>(std::move(trusted));
  impl->identity = MakeIdentity(wire::WORKER, options.common);
  impl->upstream = std::make_unique<Upstream>(
      executor,
      MakeUpstreamOptions(options.common, options.upstreams, tls.client, impl->identity,
                          options.streams, options.window),
      &impl->links);
  Impl* raw = impl.get();
  FW_ASSIGN_OR_RETURN(impl->http, StartStatusServer(executor, options.common, tls.server,
                                                    [raw] { return raw->StatusJson(); }));
  if (options.configure_http) options.configure_http(*impl->http);
  SpawnControlChannel(executor, impl);
  asio::co_spawn(executor, impl->UpdateLoop(), asio::detached);
  FW_RETURN_IF_ERROR(WriteRoleReadyFile(options.common, impl->identity, impl->http->port(),
                                        std::nullopt));
  spdlog::info("worker {} (region {}) serving HTTP on port {}", impl->identity.node_id,
               impl->identity.region, impl->http->port());
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

Worker::~Worker() {
  impl_->stopped = true;
  impl_->cpu.join();
  impl_->ahead.join();
}

void Worker::Stop() {
  auto impl = impl_;
  impl->stopped = true;
  impl->leaving = true;
  asio::post(impl->executor, [impl] {
    impl->upstream->Stop();
    impl->catalog_changed.Notify();
    if (!impl->http) return;
    if (impl->options.leave_linger.count() <= 0) {
      impl->http->Stop();
      return;
    }
    auto timer = std::make_shared<asio::steady_timer>(impl->executor, impl->options.leave_linger);
    timer->async_wait([impl, timer](const transport::error_code&) { impl->http->Stop(); });
  });
}

uint16_t Worker::http_port() const {
  return impl_->http->port();
}
uint64_t Worker::version() const {
  return impl_->version.load();
}
Hash128 Worker::weights_hash() const {
  std::shared_lock lock(impl_->weights_mutex);
  return impl_->hash;
}
void Worker::WithWeights(const std::function<void(uint64_t, const CheckpointView&)>& fn) const {
  std::shared_lock lock(impl_->weights_mutex);
  if (impl_->version.load() == 0) {
    fn(0, {});
    return;
  }
  fn(impl_->version.load(), impl_->weights.view());
}
nlohmann::json Worker::StatusJson() const {
  return impl_->StatusJson();
}

}  // namespace flywheel::sync
