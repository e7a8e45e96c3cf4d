#include "sync/publisher.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <filesystem>

#include "base/env.h"
#include "base/hex.h"
#include "base/json.h"
#include "checkpoint/safetensors.h"
#include "sync/drop.h"
#include "sync/server.h"
#include "sync/role_status.h"

namespace flywheel::sync {

using transport::Clock;

struct Publisher::Impl : PieceSource, PublishTarget, std::enable_shared_from_this<Publisher::Impl> {
  Impl(asio::any_io_executor executor, PublisherOptions options)
      : executor(executor), options(std::move(options)), cpu(1) {}

  asio::any_io_executor executor;
  PublisherOptions options;
  NodeIdentity identity;
  asio::thread_pool cpu;
  std::unique_ptr<VersionLog> log;
  LinkRegistry links;
  std::unique_ptr<Server> server;
  std::unique_ptr<transport::HttpServer> http;
  std::unique_ptr<Ledger> ledger;
  std::unique_ptr<PublisherExtension> extension;  // options.extension's, if any
  std::atomic<bool> stopped{false};
  std::map<std::string, transport::LinkShaping> region_shaping;

  // Signing (sync/signing.h): the key, this state directory's run id, and the signed
  // manifest of every artifact in the log. Written under publish_mutex (Append, Start),
  // read by Announce on the network thread: guarded by signing_mutex.
  std::optional<SigningKey> signing_key;
  std::string run_id;
  mutable std::mutex signing_mutex;
  std::map<ArtifactKey, SignedManifest> signed_artifacts;
  double last_sign_ms = 0;

  // Network-thread state.
  std::vector<ArtifactInfo> artifacts;  // as announced, the streaming delta included
  std::map<ArtifactKey, std::shared_ptr<MappedFile>> mapped;
  // The bytes of each streaming entry announced (a delta, and a keyframe, of the append).
  std::map<ArtifactKey, std::shared_ptr<const GrowableBytes>> streaming_bytes;

  // The delta being encoded now, as far as it is written (set by the append's sink,
  // cleared when the append ends), and whether an Announce is already posted for it.
  mutable std::mutex streaming_mutex;
  // Per kind: an append streams its delta, then its keyframe when one is due; both stay
  // until the append ends.
  struct Stream {
    ArtifactInfo entry;
    std::shared_ptr<const GrowableBytes> source;
  };
  std::map<ArtifactKind, Stream> streaming;
  std::atomic<bool> announce_posted{false};
  std::optional<Clock::time_point> first_piece_at;  // of the append running (publish_mutex)

  // Appends are serialized by publish_mutex (the watcher and Publish() both publish);
  // what status reads is under stats_mutex, so the network thread never waits for an encode.
  std::mutex publish_mutex;
  mutable std::mutex stats_mutex;
  std::map<uint64_t, std::string> rejected_drops;  // version -> reason
  // The COMMIT marker of every drop directory at or below the last version, as first seen
  // (or as published by this process): a marker that appears or changes later is a replay.
  std::map<uint64_t, std::pair<uint64_t, int64_t>> known_commits;  // version -> (inode, mtime ns)
  bool scanned_once = false;
  double last_publish_ms = 0;
  double last_first_piece_ms = 0;
  uint64_t last_encode_done_unix_us = 0;
  uint64_t last_artifact_bytes = 0;
  uint64_t published = 0;
  std::string last_error;
  // The head as status shows it: set with last_publish_ms and last_artifact_bytes at the
  // end of an append, so that a status showing version V also shows V's figures.
  uint64_t status_head = 0;
  Hash128 status_head_hash;

  // Appends, and records `row` (source and client fields set by the caller; the rest is
  // filled in here) in the ledger. last_publish_ms counts from `started` (a drop's open
  // and validation) or from the call.
  Result<AppendResult> Append(uint64_t version, const CheckpointView& checkpoint,
                              const AppendOptions& known, LedgerRow* row,
                              std::optional<Clock::time_point> started = std::nullopt);
  // PublishTarget, for an extension (the push API).
  const VersionLog& version_log() const override { return *log; }
  Result<LedgerRow> Publish(uint64_t version, const CheckpointView& checkpoint,
                            const AppendOptions& known, LedgerRow row) override;
  std::vector<FleetNode> Fleet() const override { return server->Fleet(); }
  void ScanDropsOnce();
  awaitable<void> WatchLoop();
  void Announce();
  // Called by the append's sink as a streamed delta grows: keeps its entry and posts an
  // Announce (one at a time).
  void OnStream(const ArtifactInfo& partial, std::shared_ptr<const GrowableBytes> bytes);
  awaitable<Result<Piece>> GetPiece(const ArtifactKey& key, uint32_t index) override;
  PublisherStatus CurrentStatus() const;
  // Opens the ledger and starts options.extension, if any.
  Status StartExtension();
  // Signs every artifact of the log that has no valid signature yet and rewrites
  // signatures.json (pruned to the log's artifacts). REQUIRES: publish_mutex held, or
  // before the publisher serves.
  Status SignArtifacts();
  // Reads signatures.json: the run id and the signatures that still verify.
  void LoadSignatures();
};

namespace {

const char* kSignaturesFile = "signatures.json";

}  // namespace

void Publisher::Impl::LoadSignatures() {
  const std::string path = options.log.dir + "/" + kSignaturesFile;
  Env* const env = options.log.env != nullptr ? options.log.env : Env::Default();
  Result<std::vector<std::byte>> bytes = env->ReadFile(path);
  if (!bytes.ok()) return;  // a first start: a new run id
  Result<nlohmann::json> parsed =
      ParseJson(std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size()), path,
                JsonLimits{.max_bytes = bytes->size()});
  const nlohmann::json document = parsed.ok() ? std::move(*parsed) : nlohmann::json();
  if (!document.is_object() || !document.contains("run_id") || !document["run_id"].is_string()) {
    spdlog::warn("{} does not parse; signing every artifact again under a new run id", path);
    return;
  }
  run_id = document["run_id"].get<std::string>();
  const TrustedKeys own = TrustedKeys::Of(*signing_key);
  std::map<ArtifactKey, ArtifactInfo> in_log;
  for (const ArtifactInfo& info : log->Artifacts()) in_log[KeyOf(info)] = info;
  if (!document.contains("artifacts") || !document["artifacts"].is_array()) return;
  for (const nlohmann::json& entry : document["artifacts"]) {
    if (!entry.is_object()) continue;
    const ArtifactKey key{entry.value("kind", "") == "keyframe" ? ArtifactKind::kKeyframe : ArtifactKind::kDelta,
                          entry.value("version", uint64_t{0})};
    auto info = in_log.find(key);
    Result<std::string> manifest = HexDecode(entry.value("manifest", ""), HexCase::kLower);
    Result<std::string> signature = HexDecode(entry.value("signature", ""), HexCase::kLower);
    if (info == in_log.end() || !manifest.ok() || !signature.ok()) continue;
    SignedManifest candidate{*manifest, *signature};
    // Kept only if this key signed it for exactly this artifact (a rotated key re-signs).
    if (VerifyManifest(own, candidate, info->second).ok()) signed_artifacts[key] = candidate;
  }
}

Status Publisher::Impl::SignArtifacts() {
  if (!signing_key) return Status::Ok();
  const auto start = Clock::now();
  if (run_id.empty()) run_id = NewRunId();
  std::map<ArtifactKey, SignedManifest> current;
  {
    std::lock_guard lock(signing_mutex);
    current = signed_artifacts;
  }
  std::map<ArtifactKey, SignedManifest> next;
  bool changed = false;
  for (const ArtifactInfo& info : log->Artifacts()) {
    auto it = current.find(KeyOf(info));
    if (it != current.end()) {
      next.insert(*it);
      continue;
    }
    FW_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(info.path));
    FW_ASSIGN_OR_RETURN(next[KeyOf(info)],
                        SignArtifact(*signing_key, info, file.bytes(), run_id, UnixMicrosNow() / 1000));
    changed = true;
  }
  changed = changed || next.size() != current.size();
  Env* const env = options.log.env != nullptr ? options.log.env : Env::Default();
  if (changed || !env->FileExists(options.log.dir + "/" + kSignaturesFile)) {
    nlohmann::json document = {{"run_id", run_id}, {"key_id", signing_key->key_id()},
                               {"artifacts", nlohmann::json::array()}};
    for (const auto& [key, signed_manifest] : next) {
      document["artifacts"].push_back({{"kind", ArtifactKindName(key.kind)},
                                       {"version", key.target_version},
                                       {"manifest", HexEncode(signed_manifest.manifest)},
                                       {"signature", HexEncode(signed_manifest.signature)}});
    }
    const std::string text = document.dump(1) + "\n";
    // Atomic and synced through the version log's Env, like the artifacts it signs.
    FW_RETURN_IF_ERROR(WriteFileAtomically(options.log.dir + "/" + kSignaturesFile,
                                           std::as_bytes(std::span(text.data(), text.size())), env));
  }
  std::lock_guard lock(signing_mutex);
  signed_artifacts = std::move(next);
  last_sign_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  return Status::Ok();
}

Status Publisher::Impl::StartExtension() {
  Env* const env = options.log.env != nullptr ? options.log.env : Env::Default();
  FW_ASSIGN_OR_RETURN(ledger, Ledger::Open(options.log.dir + "/ledger.log", env));
  if (!options.extension) return Status::Ok();
  // Any token configured (the fleet's, the push token, or only scoped ones) makes every
  // read need a token with the read scope.
  const bool read_token_required = !options.common.token.empty() || !options.push_token.empty() ||
                                   !options.common.scoped_tokens.empty();
  const PublisherContext context{.executor = executor,
                                 .target = this,
                                 .ledger = ledger.get(),
                                 .http = http.get(),
                                 .cpu = &cpu,
                                 .threads = options.common.threads,
                                 .state_dir = options.log.dir,
                                 .read_token_required = read_token_required};
  FW_ASSIGN_OR_RETURN(extension, options.extension(context));
  return Status::Ok();
}

Result<AppendResult> Publisher::Impl::Append(uint64_t version, const CheckpointView& checkpoint,
                                             const AppendOptions& known, LedgerRow* row,
                                             std::optional<Clock::time_point> started) {
  std::lock_guard lock(publish_mutex);
  const auto start = started.value_or(Clock::now());
  AppendOptions streamed = known;
  first_piece_at.reset();
  streamed.on_stream = [this](const ArtifactInfo& partial, std::shared_ptr<const GrowableBytes> bytes) {
    if (!first_piece_at) first_piece_at = Clock::now();
    OnStream(partial, std::move(bytes));
  };
  Result<AppendResult> written = log->Append(version, checkpoint, streamed);
  {
    // Whatever happened, the partial entry goes: the finished one (or none) replaces it
    // with the next Announce, which the caller posts on success.
    std::lock_guard streaming_lock(streaming_mutex);
    streaming.clear();
  }
  if (!written.ok()) {
    asio::post(executor, [self = shared_from_this()] { self->Announce(); });
    return written;
  }
  if (Status signed_ok = SignArtifacts(); !signed_ok.ok()) {
    // The version is in the log but unsigned: verifying nodes will refuse it, and the next
    // append (or a restart) signs it. Say so loudly.
    spdlog::error("published v{} but cannot sign it: {}", version, signed_ok.message());
    std::lock_guard lock(stats_mutex);
    last_error = "signing v" + std::to_string(version) + ": " + signed_ok.message();
  }
  row->version = version;
  row->weights_hash = log->head_hash().ToHex();
  row->created_unix_ms = UnixMicrosNow() / 1000;
  row->checkpoint_bytes = written->checkpoint_bytes;  // the head's, after an in-place apply
  for (const ArtifactInfo& info : written->artifacts) {
    (info.kind == ArtifactKind::kKeyframe ? row->keyframe_bytes : row->delta_bytes) += info.size_bytes;
  }
  // The version is published either way: a ledger that cannot be written is logged, and
  // the row is missing from GET /v1/versions until the next successful write.
  if (Status recorded = ledger->Record(*row); !recorded.ok()) {
    spdlog::error("published v{} but cannot record it: {}", version, recorded.message());
    std::lock_guard lock(stats_mutex);
    last_error = "recording v" + std::to_string(version) + " in the ledger: " + recorded.message();
  }
  std::lock_guard stats_lock(stats_mutex);
  last_publish_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  last_first_piece_ms =
      first_piece_at ? std::chrono::duration<double, std::milli>(*first_piece_at - start).count() : 0;
  last_encode_done_unix_us = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(written->encoded_at.time_since_epoch())
          .count());
  last_artifact_bytes = 0;
  for (const ArtifactInfo& info : written->artifacts) last_artifact_bytes += info.size_bytes;
  ++published;
  status_head = version;
  status_head_hash = log->head_hash();
  double sign_ms = 0;
  {
    std::lock_guard signing_lock(signing_mutex);
    sign_ms = signing_key ? last_sign_ms : 0;
  }
  spdlog::info("published v{}: {} artifact(s){}, {} bytes, in {:.0f} ms{}", version,
               written->artifacts.size(),
               written->keyframe_reason.empty() ? std::string()
                                                : " (keyframe: " + written->keyframe_reason + ")",
               last_artifact_bytes, last_publish_ms,
               signing_key ? fmt::format(" (signing {:.1f} ms)", sign_ms) : std::string());
  return written;
}

namespace {

std::pair<uint64_t, int64_t> CommitStamp(const Drop& drop) {
  struct stat info {};
  if (::stat((std::filesystem::path(drop.path) / kCommitMarker).c_str(), &info) != 0) return {0, 0};
  return {static_cast<uint64_t>(info.st_ino),
          static_cast<int64_t>(info.st_mtim.tv_sec) * 1000000000 + info.st_mtim.tv_nsec};
}

}  // namespace

void Publisher::Impl::ScanDropsOnce() {
  if (extension && extension->pinned()) return;  // drops wait in the directory until unpin
  Result<std::vector<Drop>> drops = ScanDrops(options.watch_dir, 0);
  if (!drops.ok()) {
    spdlog::warn("cannot scan {}: {}", options.watch_dir, drops.status().message());
    return;
  }
  const bool first_scan = !scanned_once;
  scanned_once = true;
  for (const Drop& drop : *drops) {
    if (stopped) return;
    {
      std::lock_guard lock(stats_mutex);
      if (rejected_drops.count(drop.version)) continue;
    }
    const uint64_t last = log->last_version();
    Status status;
    if (drop.version <= last) {
      // Versions only move forward: what was there at startup (or was published from this
      // directory) is history; a commit that appears or changes later is a replay.
      const auto stamp = CommitStamp(drop);
      auto [known, inserted] = known_commits.emplace(drop.version, stamp);
      if (first_scan || (!inserted && known->second == stamp)) continue;
      status = Status::InvalidArgument("version " + std::to_string(drop.version) +
                                       " is not above the last published v" + std::to_string(last) +
                                       " (a replayed or reused version)");
    } else {
      const auto opened = Clock::now();
      Result<Checkpoint> checkpoint = OpenDrop(drop);
      status = checkpoint.status();
      LedgerRow row;
      row.source = VersionSource::kDrop;
      row.metadata = {{"path", drop.path}};
      if (checkpoint.ok()) {
        status = Append(drop.version, checkpoint->tensors(), {}, &row, opened).status();
      }
      if (status.ok()) known_commits[drop.version] = CommitStamp(drop);
    }
    if (!status.ok()) {
      spdlog::error("rejected drop {}: {} (still serving v{})", drop.path, status.message(),
                    log->head_version());
      std::lock_guard lock(stats_mutex);
      rejected_drops[drop.version] = status.message();
      continue;
    }
    asio::post(executor, [self = shared_from_this()] { self->Announce(); });
  }
}

awaitable<void> Publisher::Impl::WatchLoop() {
  auto self = shared_from_this();
  while (!stopped) {
    // GCC 12 destroys lambda and braced temporaries in a co_await expression twice:
    // they are always named first (see transport::RunOn).
    auto scan = [this] {
      ScanDropsOnce();
      return 0;
    };
    co_await transport::RunOn(cpu, scan);
    co_await transport::SleepFor(options.poll);
  }
}

void Publisher::Impl::OnStream(const ArtifactInfo& partial,
                               std::shared_ptr<const GrowableBytes> bytes) {
  {
    std::lock_guard lock(streaming_mutex);
    streaming[partial.kind] = Stream{partial, std::move(bytes)};
  }
  if (!announce_posted.exchange(true)) {
    asio::post(executor, [self = shared_from_this()] { self->Announce(); });
  }
}

void Publisher::Impl::Announce() {
  announce_posted = false;
  // Only versions whose append has finished (signed, recorded) are announced; a delta
  // still being encoded goes out as a streaming entry.
  uint64_t head = 0;
  Hash128 head_hash;
  {
    std::lock_guard lock(stats_mutex);
    head = status_head;
    head_hash = status_head_hash;
  }
  artifacts.clear();
  for (ArtifactInfo& info : log->Artifacts()) {
    if (info.target_version <= head) artifacts.push_back(std::move(info));
  }
  streaming_bytes.clear();
  {
    std::lock_guard lock(streaming_mutex);
    for (const auto& [kind, stream] : streaming) {
      const ArtifactInfo& entry = stream.entry;
      // A delta only from the head; a keyframe of any version past it.
      if (entry.target_version > head &&
          (kind == ArtifactKind::kKeyframe ||
           (entry.base_version == head && entry.base_hash == head_hash))) {
        artifacts.push_back(entry);
        streaming_bytes[KeyOf(entry)] = stream.source;
      }
    }
  }
  std::map<ArtifactKey, std::shared_ptr<MappedFile>> kept;
  Catalog catalog;
  for (const ArtifactInfo& info : artifacts) {
    auto it = mapped.find(KeyOf(info));
    if (it != mapped.end() && !info.streaming) kept.insert(*it);
    catalog.artifacts.push_back(info);
  }
  {
    std::lock_guard lock(signing_mutex);
    for (const ArtifactInfo& info : artifacts) {
      auto it = signed_artifacts.find(KeyOf(info));
      if (it != signed_artifacts.end()) catalog.signatures[KeyOf(info)] = it->second;
    }
  }
  mapped = std::move(kept);
  catalog.head_version = head;
  catalog.head_hash = head_hash;
  catalog.max_staleness = options.max_staleness;
  if (server) server->SetCatalog(ToWire(catalog));
}

awaitable<Result<PieceSource::Piece>> Publisher::Impl::GetPiece(const ArtifactKey& key,
                                                                uint32_t index) {
  const ArtifactInfo* info = nullptr;
  for (const ArtifactInfo& candidate : artifacts) {
    if (KeyOf(candidate) == key) info = &candidate;
  }
  if (info == nullptr) co_return Status::NotFound("the publisher does not hold " + Describe(key));
  if (index >= info->piece_hashes.size()) {
    co_return Status::NotFound(Describe(key) + " has no piece " + std::to_string(index));
  }
  if (info->streaming) {
    // Written and hashed by the encoder already; the bytes never move.
    const uint64_t begin = static_cast<uint64_t>(index) * info->piece_bytes;
    auto bytes = streaming_bytes.find(key);
    if (bytes == streaming_bytes.end()) co_return Status::NotFound(Describe(key) + " is not streaming");
    Piece piece{bytes->second,
                std::span<const std::byte>(bytes->second->data() + begin, info->piece_bytes)};
    co_return piece;
  }
  auto& file = mapped[key];
  if (!file) {
    Result<MappedFile> opened = MappedFile::Open(info->path);
    if (!opened.ok()) {
      mapped.erase(key);
      co_return opened.status();
    }
    if (opened->bytes().size() != info->size_bytes) {
      mapped.erase(key);
      co_return Status::Corruption(info->path + " changed size on disk");
    }
    file = std::make_shared<MappedFile>(std::move(*opened));
  }
  const uint64_t begin = static_cast<uint64_t>(index) * info->piece_bytes;
  const uint64_t end = std::min(info->size_bytes, begin + info->piece_bytes);
  Piece piece{file, file->bytes().subspan(begin, end - begin)};
  co_return piece;
}

PublisherStatus Publisher::Impl::CurrentStatus() const {
  PublisherStatus s;
  uint64_t head = 0;
  Hash128 head_hash;
  {
    std::lock_guard lock(stats_mutex);
    head = status_head;
    head_hash = status_head_hash;
  }
  for (const FleetNode& node : server->Fleet()) {
    const uint64_t version = node.state.version();
    s.nodes.push_back({.node_id = node.state.node_id(),
                       .region = node.state.region(),
                       .role = RoleName(node.state.role()),
                       .version = version,
                       .detailed = true,
                       .staleness = head - std::min(head, version),
                       .upstream = node.state.upstream(),
                       .via = node.via});
  }
  s.common = {.role = "publisher",
              .region = identity.region,
              .node_id = identity.node_id,
              .version = head,
              .weights_hash = head == 0 ? "" : head_hash.ToHex(),
              .head_version = head,
              .max_staleness = options.max_staleness,
              .traffic = LinkTraffic::Of(links)};
  s.last_version = log->last_version();
  const std::vector<ArtifactInfo> logged = log->Artifacts();
  s.artifacts_retained = logged.size();
  for (const ArtifactInfo& info : logged) s.log_bytes += info.size_bytes;
  s.join_bytes = JoinBytes(logged);
  {
    std::lock_guard streaming_lock(streaming_mutex);
    // The keyframe when one streams (it is encoded after the delta), else the delta.
    if (!streaming.empty()) {
      const ArtifactInfo& entry = streaming.begin()->second.entry;
      s.streaming_version = entry.target_version;
      s.streaming_pieces = entry.piece_hashes.size();
    }
  }
  s.pieces_served = server->pieces_served();
  {
    std::lock_guard lock(signing_mutex);
    if (signing_key) {
      s.signing_key_id = signing_key->key_id();
      s.run_id = run_id;
      s.last_sign_ms = last_sign_ms;
    }
  }
  std::lock_guard lock(stats_mutex);
  s.last_error = last_error;
  s.last_publish_ms = last_publish_ms;
  s.last_first_piece_ms = last_first_piece_ms;
  s.last_encode_done_unix_us = last_encode_done_unix_us;
  s.last_artifact_bytes = last_artifact_bytes;
  s.published_total = published;
  s.rejected_drops.assign(rejected_drops.begin(), rejected_drops.end());
  return s;
}

Result<std::unique_ptr<Publisher>> Publisher::Start(asio::any_io_executor executor,
                                                    PublisherOptions options) {
  if (options.common.region.empty()) options.common.region = "home";
  FW_ASSIGN_OR_RETURN(TlsContexts tls, MakeTlsContexts(options.common.tls, true, false));
  auto impl = std::make_shared<Impl>(executor, options);
  impl->identity = MakeIdentity(wire::PUBLISHER, options.common);
  if (!options.signing_key.empty()) {
    FW_ASSIGN_OR_RETURN(SigningKey key, SigningKey::Load(options.signing_key));
    impl->signing_key = std::move(key);
  }
  FW_ASSIGN_OR_RETURN(impl->log, VersionLog::Open(options.log));
  impl->status_head = impl->log->head_version();
  impl->status_head_hash = impl->log->head_hash();
  if (!impl->log->empty()) {
    spdlog::info("recovered {}: head v{} ({}), {} artifacts", options.log.dir,
                 impl->log->head_version(), impl->log->head_hash().ToHex(),
                 impl->log->Artifacts().size());
  }
  if (impl->signing_key) {
    impl->LoadSignatures();
    FW_RETURN_IF_ERROR(impl->SignArtifacts());
    spdlog::info("signing every version with key {} (run {})", impl->signing_key->key_id(),
                 impl->run_id);
  }
  ServerOptions server = MakeServerOptions(options.common, options.listen, impl->identity, tls.server);
  if (options.common.wan_shaped()) {
    Impl* raw = impl.get();
    server.listener.shaping_for = [raw](const wire::Hello& hello) {
      if (hello.region() == raw->identity.region) return transport::LinkShaping{};
      auto it = raw->region_shaping.find(hello.region());
      if (it == raw->region_shaping.end()) {
        it = raw->region_shaping
                 .emplace(hello.region(),
                          transport::MakeLinkShaping(raw->options.common.wan_rate,
                                                     raw->options.common.wan_latency_ms))
                 .first;
      }
      return it->second;
    };
  }
  FW_ASSIGN_OR_RETURN(impl->server, Server::Start(executor, server, impl.get(), &impl->links));
  impl->Announce();
  Impl* raw = impl.get();
  FW_ASSIGN_OR_RETURN(impl->http,
                      StartStatusServer(executor, options.common, tls.server,
                                        [raw] { return ToJson(raw->CurrentStatus()); },
                                        options.push_token));
  FW_RETURN_IF_ERROR(impl->StartExtension());
  if (!options.watch_dir.empty()) asio::co_spawn(executor, impl->WatchLoop(), asio::detached);
  FW_RETURN_IF_ERROR(WriteRoleReadyFile(options.common, impl->identity, impl->http->port(),
                                        transport::Endpoint{options.listen.host, impl->server->port()}));
  spdlog::info("publisher {} listening on port {}, HTTP on port {}, watching {}",
               impl->identity.node_id, impl->server->port(), impl->http->port(),
               options.watch_dir.empty() ? "(nothing)" : options.watch_dir);
  return std::unique_ptr<Publisher>(new Publisher(std::move(impl)));
}

Publisher::~Publisher() {
  impl_->stopped = true;
  impl_->cpu.join();
}

void Publisher::Stop() {
  auto impl = impl_;
  impl->stopped = true;
  asio::post(impl->executor, [impl] {
    if (impl->extension) impl->extension->Stop();
    impl->server->Stop();
    if (impl->http) impl->http->Stop();
  });
}

Result<std::vector<ArtifactInfo>> Publisher::Publish(uint64_t version,
                                                     const CheckpointView& checkpoint) {
  FW_ASSIGN_OR_RETURN(AppendResult written, Publish(version, checkpoint, AppendOptions{}));
  return std::move(written.artifacts);
}

Result<AppendResult> Publisher::Publish(uint64_t version, const CheckpointView& checkpoint,
                                        const AppendOptions& known) {
  LedgerRow row;
  row.source = VersionSource::kTrainer;
  Result<AppendResult> written = impl_->Append(version, checkpoint, known, &row);
  if (written.ok()) asio::post(impl_->executor, [impl = impl_] { impl->Announce(); });
  return written;
}

Result<LedgerRow> Publisher::Impl::Publish(uint64_t version, const CheckpointView& checkpoint,
                                           const AppendOptions& known, LedgerRow row) {
  FW_RETURN_IF_ERROR(Append(version, checkpoint, known, &row).status());
  asio::post(executor, [self = shared_from_this()] { self->Announce(); });
  return row;
}

uint16_t Publisher::port() const {
  return impl_->server->port();
}
uint16_t Publisher::http_port() const {
  return impl_->http->port();
}
uint64_t Publisher::version() const {
  return impl_->log->head_version();
}
nlohmann::json Publisher::StatusJson() const {
  return ToJson(impl_->CurrentStatus());
}

PublisherStatus Publisher::CurrentStatus() const { return impl_->CurrentStatus(); }

}  // namespace flywheel::sync
