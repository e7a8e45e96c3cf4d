#include "sync/relay.h"

#include <spdlog/spdlog.h>

#include <deque>
#include <map>

#include "sync/catalog_verifier.h"
#include "sync/role_status.h"
#include "sync/server.h"
#include "sync/sha256_stream.h"
#include "sync/upstream.h"

namespace flywheel::sync {

using namespace std::chrono_literals;

struct Relay::Impl : PieceSource, std::enable_shared_from_this<Relay::Impl> {
  Impl(asio::any_io_executor executor, RelayOptions options)
      : executor(executor), options(std::move(options)), queued(executor) {}

  struct Cached {
    explicit Cached(const ArtifactInfo& info, asio::any_io_executor executor)
        : download(info), arrived(executor) {}
    Download download;
    transport::Signal arrived;
    bool queued = false;
    bool dropped = false;   // no longer in the upstream's catalog
    Status error;           // the last fetch failure, until the next attempt
    PrefixSha256 sha;       // signed versions: the bytes' SHA-256 as the pieces arrive
  };

  asio::any_io_executor executor;
  RelayOptions options;
  std::unique_ptr<CatalogVerifier> verifier;  // --trust-key
  NodeIdentity identity;
  LinkRegistry links;
  std::unique_ptr<Upstream> upstream;
  std::unique_ptr<Server> server;
  std::unique_ptr<transport::HttpServer> http;
  bool stopped = false;

  Catalog catalog;
  std::map<ArtifactKey, std::shared_ptr<Cached>> cache;
  std::deque<ArtifactKey> fetch_queue;
  transport::Signal queued;
  uint64_t fetch_failures = 0;

  void OnCatalog(Catalog received);
  // What this relay reports upstream: itself and the fleet below it.
  wire::Report MakeReport();
  void Enqueue(const ArtifactKey& key, bool urgent);
  awaitable<void> FetchLoop();
  awaitable<Result<Piece>> GetPiece(const ArtifactKey& key, uint32_t index) override;
  RelayStatus CurrentStatus() const;
  const ArtifactInfo* NewestComplete() const;
  // Once keyframe `newest` is cached whole, the older keyframes' bytes are dead weight (a
  // joining worker plans from the newest): their entries are emptied, to be fetched again
  // only if a node asks. A complete entry has no waiter; pieces in flight keep their bytes.
  void ReleaseOlderKeyframes(const ArtifactKey& newest);
};

void Relay::Impl::ReleaseOlderKeyframes(const ArtifactKey& newest) {
  for (auto& [key, entry] : cache) {
    if (key.kind != ArtifactKind::kKeyframe || key.target_version >= newest.target_version ||
        !entry->download.complete()) {
      continue;
    }
    spdlog::info("relay: released {} ({} bytes): {} is cached", Describe(key),
                 entry->download.info.size_bytes, Describe(newest));
    entry = std::make_shared<Cached>(entry->download.info, executor);
  }
}

void Relay::Impl::Enqueue(const ArtifactKey& key, bool urgent) {
  auto it = cache.find(key);
  if (it == cache.end() || it->second->queued || it->second->download.all_known()) return;
  it->second->queued = true;
  if (urgent) {
    fetch_queue.push_front(key);
  } else {
    fetch_queue.push_back(key);
  }
  queued.Notify();
}

void Relay::Impl::OnCatalog(Catalog received) {
  // With trusted keys, what is not signed by one of them is neither fetched, cached nor
  // announced downstream.
  verifier->Filter(&received, "relay " + identity.node_id);
  std::map<ArtifactKey, std::shared_ptr<Cached>> kept;
  for (const ArtifactInfo& info : received.artifacts) {
    auto it = cache.find(KeyOf(info));
    if (it != cache.end() && it->second->download.info == info) {
      kept[KeyOf(info)] = it->second;
    } else if (it != cache.end() && it->second->download.info.streaming &&
               it->second->download.Extend(info)) {
      // A delta still streaming from the publisher grew (or finished): the pieces held
      // stay, and are forwarded as they are.
      kept[KeyOf(info)] = it->second;
      it->second->arrived.Notify();
    } else {
      kept[KeyOf(info)] = std::make_shared<Cached>(info, executor);
    }
  }
  for (auto& [key, entry] : cache) {
    if (!kept.count(key) || kept[key] != entry) {
      entry->dropped = true;
      entry->arrived.Notify();
    }
  }
  cache = std::move(kept);
  catalog = std::move(received);
  // Deltas are small and every node needs them: fetch them now. Keyframes on demand.
  for (const ArtifactInfo& info : catalog.artifacts) {
    if (info.kind == ArtifactKind::kDelta) Enqueue(KeyOf(info), false);
  }
  server->SetCatalog(ToWire(catalog));
}

awaitable<void> Relay::Impl::FetchLoop() {
  auto self = shared_from_this();
  while (!stopped) {
    if (fetch_queue.empty()) {
      co_await queued.Wait();
      continue;
    }
    const ArtifactKey key = fetch_queue.front();
    fetch_queue.pop_front();
    auto it = cache.find(key);
    if (it == cache.end()) continue;
    std::shared_ptr<Cached> entry = it->second;
    entry->error = Status::Ok();
    const bool hashing = verifier->enabled();
    std::function<void(uint32_t)> on_piece = [entry, hashing](uint32_t) {
      entry->arrived.Notify();
      if (hashing) entry->sha.Advance(entry->download);
    };
    Status status = co_await upstream->Fetch(entry->download, on_piece);
    entry->queued = false;
    if (status.ok() && !entry->download.complete()) {
      // A streaming delta: every piece listed so far is here; the next catalog lists more
      // (OnCatalog queues it again), and the finished one is checked like any other.
      if (!entry->download.all_known()) Enqueue(key, false);
      continue;
    }
    if (status.ok() && verifier->enabled() && !entry->dropped) {
      // Pieces went on as they arrived (checked against the signed piece list); the whole
      // artifact must now have the signed SHA-256, or it leaves the cache.
      const ManifestFacts* facts = verifier->FactsOf(key);
      if (facts == nullptr) {
        status = Status::Mismatch(Describe(key) + " is no longer in a verified catalog");
      } else {
        status = entry->sha.Check(entry->download, *facts);  // the tail is left to hash
      }
      if (!status.ok()) {
        verifier->CountForged(status.message());
        spdlog::error("relay: {}; dropped from the cache", status.message());
        auto current = cache.find(key);
        if (current != cache.end() && current->second == entry) {
          auto fresh = std::make_shared<Cached>(entry->download.info, executor);
          current->second = fresh;
          entry->dropped = true;
          entry->arrived.Notify();
          co_await transport::SleepFor(1s);
          Enqueue(key, false);
        }
        continue;
      }
    }
    if (!status.ok() && !entry->dropped) {
      ++fetch_failures;
      entry->error = status;
      spdlog::warn("relay: fetching {}: {}", Describe(key), status.message());
      entry->arrived.Notify();  // waiting nodes are told, and try another upstream
      co_await transport::SleepFor(200ms);
    } else if (status.ok()) {
      spdlog::info("relay: cached {} ({} bytes)", Describe(key), entry->download.info.size_bytes);
      if (key.kind == ArtifactKind::kKeyframe && !entry->dropped) ReleaseOlderKeyframes(key);
    }
  }
}

awaitable<Result<PieceSource::Piece>> Relay::Impl::GetPiece(const ArtifactKey& key, uint32_t index) {
  auto it = cache.find(key);
  if (it == cache.end()) {
    co_return Status::NotFound("this relay's catalog has no " + Describe(key));
  }
  std::shared_ptr<Cached> entry = it->second;
  if (index >= entry->download.have.size()) {
    co_return Status::NotFound(Describe(key) + " has no piece " + std::to_string(index));
  }
  if (!entry->download.have[index]) Enqueue(key, /*urgent=*/true);
  while (!entry->download.have[index]) {
    if (entry->dropped) co_return Status::NotFound(Describe(key) + " was dropped upstream");
    if (!entry->error.ok()) co_return Status::Unavailable("relay cannot fetch " + Describe(key) + ": " + entry->error.message());
    if (stopped) co_return Status::Unavailable("relay stopping");
    co_await entry->arrived.Wait();
  }
  Piece piece{entry->download.bytes, entry->download.piece(index)};
  co_return piece;
}

const ArtifactInfo* Relay::Impl::NewestComplete() const {
  const ArtifactInfo* newest = nullptr;
  for (const auto& [key, entry] : cache) {
    if (entry->download.complete() &&
        (newest == nullptr || entry->download.info.target_version > newest->target_version)) {
      newest = &entry->download.info;
    }
  }
  return newest;
}

RelayStatus Relay::Impl::CurrentStatus() const {
  RelayStatus s;
  const ArtifactInfo* newest = NewestComplete();
  const uint64_t version = newest ? newest->target_version : 0;
  for (const auto& [key, entry] : cache) {
    s.cache_bytes += entry->download.have_count == 0 ? 0 : entry->download.info.size_bytes;
    s.artifacts.push_back({Describe(key), entry->download.have.size(), entry->download.have_count});
  }
  for (const FleetNode& node : server->Fleet()) {
    s.nodes.push_back({.node_id = node.state.node_id(),
                       .region = node.state.region(),
                       .role = RoleName(node.state.role()),
                       .version = node.state.version()});
  }
  s.common = {.role = "relay",
              .region = identity.region,
              .node_id = identity.node_id,
              .version = version,
              .weights_hash = newest ? newest->target_hash.ToHex() : "",
              .head_version = catalog.head_version,
              .staleness = catalog.head_version - std::min(version, catalog.head_version),
              .max_staleness = catalog.max_staleness,
              .upstream = upstream->current(),
              .traffic = LinkTraffic::Of(links)};
  s.connected = upstream->connected();
  s.fetch = upstream->counters();
  s.pieces_served = server->pieces_served();
  s.fetch_failures = fetch_failures;
  s.signatures = {.trusted_keys = verifier->trusted_keys(),
                  .signature_failures = verifier->failures(),
                  .replays_refused = verifier->replays(),
                  .last_signature_error = verifier->last_error(),
                  .run_id = ""};
  if (const ArtifactInfo* newest_info = NewestComplete()) {
    if (const ManifestFacts* facts = verifier->FactsOf(KeyOf(*newest_info))) s.signatures.run_id = facts->run_id;
  }
  return s;
}

wire::Report Relay::Impl::MakeReport() {
  wire::Report report;
  wire::NodeState* self = report.add_nodes();
  self->set_node_id(identity.node_id);
  self->set_region(identity.region);
  self->set_role(wire::RELAY);
  const ArtifactInfo* newest = NewestComplete();
  self->set_version(newest ? newest->target_version : 0);
  self->set_bytes_in(links.bytes_in());
  self->set_bytes_out(links.bytes_out());
  self->set_upstream(upstream->current());
  // Upstream::ReportLoop bounds it (BoundReport): what does not fit is counted.
  for (const FleetNode& node : server->Fleet()) *report.add_nodes() = node.state;
  report.set_omitted_nodes(server->fleet_nodes_omitted());
  return report;
}

Result<std::unique_ptr<Relay>> Relay::Start(asio::any_io_executor executor, RelayOptions options) {
  if (options.upstreams.empty()) return Status::InvalidArgument("a relay needs an --upstream");
  if (options.common.region.empty()) return Status::InvalidArgument("a relay needs a --region");
  FW_ASSIGN_OR_RETURN(TlsContexts tls, MakeTlsContexts(options.common.tls, true, true));
  FW_ASSIGN_OR_RETURN(TrustedKeys trusted, TrustedKeys::Load(options.common.trust_keys));
  auto impl = std::make_shared<Impl>(executor, options);
  impl->verifier = std::make_unique<CatalogVerifier>(std::move(trusted));
  impl->identity = MakeIdentity(wire::RELAY, options.common);
  impl->upstream = std::make_unique<Upstream>(
      executor,
      MakeUpstreamOptions(options.common, options.upstreams, tls.client, impl->identity,
                          options.streams, options.window),
      &impl->links);

  // A child that leaves (its control connection closed) is forgotten by the Server at once;
  // the nodes above learn it now too, not at this relay's next periodic report.
  impl->links.set_on_downstream_left([raw = impl.get()] {
    if (raw->upstream && !raw->stopped) raw->upstream->ReportNow();
  });
  ServerOptions server = MakeServerOptions(options.common, options.listen, impl->identity, tls.server);
  server.on_fleet_change = [raw = impl.get()] {
    if (raw->upstream) raw->upstream->ReportNow();  // a worker swapped: tell upstream now
  };
  FW_ASSIGN_OR_RETURN(impl->server, Server::Start(executor, server, impl.get(), &impl->links));
  Impl* raw = impl.get();
  FW_ASSIGN_OR_RETURN(impl->http, StartStatusServer(executor, options.common, tls.server,
                                                    [raw] { return ToJson(raw->CurrentStatus()); }));
  SpawnControlChannel(executor, impl);
  asio::co_spawn(executor, impl->FetchLoop(), asio::detached);
  FW_RETURN_IF_ERROR(WriteRoleReadyFile(options.common, impl->identity, impl->http->port(),
                                        transport::Endpoint{options.listen.host, impl->server->port()}));
  spdlog::info("relay {} (region {}) listening on port {}, HTTP on port {}", impl->identity.node_id,
               impl->identity.region, impl->server->port(), impl->http->port());
  return std::unique_ptr<Relay>(new Relay(std::move(impl)));
}

Relay::~Relay() { impl_->stopped = true; }

void Relay::Stop() {
  auto impl = impl_;
  asio::post(impl->executor, [impl] {
    impl->stopped = true;
    impl->upstream->Stop();
    impl->server->Stop();
    impl->queued.Notify();
    for (auto& [key, entry] : impl->cache) entry->arrived.Notify();
    if (impl->http) impl->http->Stop();
  });
}

uint16_t Relay::port() const { return impl_->server->port(); }
uint16_t Relay::http_port() const { return impl_->http->port(); }
nlohmann::json Relay::StatusJson() const { return ToJson(impl_->CurrentStatus()); }

}  // namespace flywheel::sync
