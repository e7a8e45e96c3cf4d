#include "sync/node.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <tuple>

namespace flywheel::sync {

using namespace std::chrono_literals;
using transport::Clock;
using transport::Frame;
using transport::FrameKindName;
using transport::MakeFrame;

// ---- the catalog on the wire -------------------------------------------------------

std::string HashBytesOf(const Hash128& hash) {
  std::string bytes(16, '\0');
  std::memcpy(bytes.data(), &hash.low, 8);
  std::memcpy(bytes.data() + 8, &hash.high, 8);
  return bytes;
}

Result<Hash128> HashFromBytes(const std::string& bytes, const std::string& what) {
  if (bytes.size() != 16) {
    return Status::Corruption(what + " is " + std::to_string(bytes.size()) + " bytes, not 16");
  }
  Hash128 hash;
  std::memcpy(&hash.low, bytes.data(), 8);
  std::memcpy(&hash.high, bytes.data() + 8, 8);
  return hash;
}

wire::Artifact ToWire(const ArtifactInfo& info) {
  wire::Artifact artifact;
  artifact.set_kind(info.kind == ArtifactKind::kKeyframe ? wire::KEYFRAME : wire::DELTA);
  artifact.set_base_version(info.base_version);
  artifact.set_target_version(info.target_version);
  if (info.kind == ArtifactKind::kDelta) artifact.set_base_hash(HashBytesOf(info.base_hash));
  if (!info.streaming) artifact.set_target_hash(HashBytesOf(info.target_hash));
  artifact.set_size_bytes(info.size_bytes);
  artifact.set_piece_bytes(info.piece_bytes);
  for (uint64_t hash : info.piece_hashes) artifact.add_piece_hashes(hash);
  if (info.streaming) {
    artifact.set_streaming(true);
    artifact.set_size_bound(info.size_bound);
  }
  return artifact;
}

std::string Describe(const ArtifactKey& key) {
  return std::string(ArtifactKindName(key.kind)) + " v" + std::to_string(key.target_version);
}

Result<ArtifactInfo> FromWire(const wire::Artifact& artifact, uint64_t max_piece_bytes) {
  ArtifactInfo info;
  info.kind = artifact.kind() == wire::KEYFRAME ? ArtifactKind::kKeyframe : ArtifactKind::kDelta;
  const std::string what = "catalog entry " + Describe(KeyOf(info));
  if (artifact.kind() != wire::KEYFRAME && artifact.kind() != wire::DELTA) {
    return Status::Corruption("catalog entry of unknown kind " + std::to_string(artifact.kind()));
  }
  info.base_version = artifact.base_version();
  info.target_version = artifact.target_version();
  if (info.target_version == 0) return Status::Corruption(what + ": target version 0");
  if (info.kind == ArtifactKind::kDelta) {
    if (info.base_version >= info.target_version) {
      return Status::Corruption(what + ": base version " + std::to_string(info.base_version) +
                                " is not below the target");
    }
    FW_ASSIGN_OR_RETURN(info.base_hash, HashFromBytes(artifact.base_hash(), what + " base hash"));
  }
  info.streaming = artifact.streaming();
  if (info.streaming) {
    if (info.kind != ArtifactKind::kDelta || !artifact.target_hash().empty()) {
      return Status::Corruption(what + ": a streaming entry must be a delta without a target hash");
    }
  } else {
    FW_ASSIGN_OR_RETURN(info.target_hash,
                        HashFromBytes(artifact.target_hash(), what + " target hash"));
  }
  info.size_bytes = artifact.size_bytes();
  info.piece_bytes = artifact.piece_bytes();
  if (info.piece_bytes == 0 || info.piece_bytes > max_piece_bytes) {
    return Status::Corruption(what + ": piece size " + std::to_string(info.piece_bytes) +
                              " outside [1, " + std::to_string(max_piece_bytes) + "]");
  }
  if (info.streaming) {
    info.size_bound = artifact.size_bound();
    if (info.size_bytes % info.piece_bytes != 0 || info.size_bound < info.size_bytes ||
        info.size_bound > kMaxStreamingBound) {
      return Status::Corruption(what + ": streaming entry of " + std::to_string(info.size_bytes) +
                                " bytes (whole pieces only) bounded by " +
                                std::to_string(info.size_bound) + " (at most " +
                                std::to_string(kMaxStreamingBound) + ")");
    }
  }
  const uint64_t pieces = (info.size_bytes + info.piece_bytes - 1) / info.piece_bytes;
  if (pieces != static_cast<uint64_t>(artifact.piece_hashes_size())) {
    return Status::Corruption(what + ": " + std::to_string(artifact.piece_hashes_size()) +
                              " piece hashes for " + std::to_string(pieces) + " pieces");
  }
  info.piece_hashes.assign(artifact.piece_hashes().begin(), artifact.piece_hashes().end());
  return info;
}

const ArtifactInfo* Catalog::Find(const ArtifactKey& key) const {
  for (const ArtifactInfo& info : artifacts) {
    if (KeyOf(info) == key) return &info;
  }
  return nullptr;
}

const SignedManifest* Catalog::SignatureOf(const ArtifactKey& key) const {
  auto it = signatures.find(key);
  return it == signatures.end() ? nullptr : &it->second;
}

wire::Catalog ToWire(const Catalog& catalog) {
  wire::Catalog out;
  for (const ArtifactInfo& info : catalog.artifacts) {
    wire::Artifact* artifact = out.add_artifacts();
    *artifact = ToWire(info);
    if (const SignedManifest* signed_manifest = catalog.SignatureOf(KeyOf(info))) {
      artifact->set_manifest(signed_manifest->manifest);
      artifact->set_signature(signed_manifest->signature);
    }
  }
  out.set_head_version(catalog.head_version);
  out.set_head_hash(HashBytesOf(catalog.head_hash));
  out.set_max_staleness(catalog.max_staleness);
  return out;
}

Result<Catalog> FromWire(const wire::Catalog& catalog, uint64_t max_piece_bytes) {
  Catalog out;
  for (const wire::Artifact& artifact : catalog.artifacts()) {
    FW_ASSIGN_OR_RETURN(ArtifactInfo info, FromWire(artifact, max_piece_bytes));
    if (out.Find(KeyOf(info)) != nullptr) {
      return Status::Corruption("catalog lists " + Describe(KeyOf(info)) + " twice");
    }
    if (!artifact.manifest().empty() || !artifact.signature().empty()) {
      // Checked against trusted keys by whoever needs it; here only bounded.
      if (artifact.manifest().size() > 4096 || artifact.signature().size() > 512) {
        return Status::Corruption("catalog entry " + Describe(KeyOf(info)) +
                                  ": oversized manifest or signature");
      }
      out.signatures[KeyOf(info)] = {artifact.manifest(), artifact.signature()};
    }
    out.artifacts.push_back(std::move(info));
  }
  // By target version, a keyframe before the delta of the same version.
  std::sort(out.artifacts.begin(), out.artifacts.end(), [](const auto& a, const auto& b) {
    return std::tie(a.target_version, a.kind) < std::tie(b.target_version, b.kind);
  });
  out.head_version = catalog.head_version();
  if (out.head_version != 0) {
    FW_ASSIGN_OR_RETURN(out.head_hash, HashFromBytes(catalog.head_hash(), "catalog head hash"));
  }
  out.max_staleness = catalog.max_staleness();
  return out;
}

void CatalogVerifier::Filter(Catalog* catalog, const std::string& who) {
  if (!enabled()) return;
  std::map<ArtifactKey, ManifestFacts> facts;
  std::vector<ArtifactInfo> kept;
  std::vector<ArtifactInfo> streaming;
  // Refusals of artifacts this catalog no longer lists are forgotten (see the header).
  std::set<ArtifactKey> listed;
  for (const ArtifactInfo& info : catalog->artifacts) listed.insert(KeyOf(info));
  std::erase_if(counted_, [&](const auto& refusal) { return !listed.count(refusal.first); });
  size_t refused = 0;
  std::string first_refusal;
  auto refuse = [&](const ArtifactKey& key, uint64_t signature_hash, std::string message,
                    bool failure) {
    auto [it, inserted] = counted_.try_emplace(key, signature_hash);
    if (!inserted) {
      if (it->second == signature_hash) return;  // refused before with this signature
      it->second = signature_hash;
    }
    if (failure) ++failures_;
    if (refused++ == 0) first_refusal = message;
    last_error_ = std::move(message);
  };
  for (ArtifactInfo& info : catalog->artifacts) {
    const ArtifactKey key = KeyOf(info);
    if (info.streaming) {
      streaming.push_back(std::move(info));
      continue;
    }
    const SignedManifest* signed_manifest = catalog->SignatureOf(key);
    static const SignedManifest kUnsigned;
    Result<ManifestFacts> verified =
        VerifyManifest(trusted_, signed_manifest ? *signed_manifest : kUnsigned, info);
    if (!verified.ok()) {
      const std::string& signature = signed_manifest ? signed_manifest->signature : std::string();
      // 0 stands for the streaming bound below; a signature hashing to 0 is only counted
      // together with it.
      refuse(key, HashBytes64(std::as_bytes(std::span(signature))) | 1, verified.status().message(),
             /*failure=*/true);
      catalog->signatures.erase(key);
      continue;
    }
    facts[key] = *verified;
    kept.push_back(std::move(info));
  }
  // Deltas still streaming cannot be signed yet: they pass unverified, and nothing of
  // them is applied or kept before their finished, signed entry verifies. So that a forged
  // one cannot make a node fetch without end, one may list at most twice the largest
  // verified artifact (a delta is never larger than the dense checkpoint) plus 64 MiB.
  uint64_t largest = 0;
  for (const ArtifactInfo& info : kept) largest = std::max(largest, info.size_bytes);
  const uint64_t streaming_limit = 2 * largest + (uint64_t{64} << 20);
  for (const ArtifactInfo& info : streaming) {
    if (info.size_bound <= streaming_limit) {
      kept.push_back(info);
    } else {
      refuse(KeyOf(info), 0,
             Describe(KeyOf(info)) + " streams with a bound of " + std::to_string(info.size_bound) +
                 " bytes, over " + std::to_string(streaming_limit) +
                 " (twice the largest verified artifact); not fetched",
             /*failure=*/false);
    }
  }
  if (refused == 1) {
    spdlog::error("{}: refused: {}", who, first_refusal);
  } else if (refused > 1) {
    spdlog::error("{}: refused {} artifacts of a catalog, the first: {}", who, refused, first_refusal);
  }
  std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) {
    return std::tie(a.target_version, a.kind) < std::tie(b.target_version, b.kind);
  });
  catalog->artifacts = std::move(kept);
  facts_ = std::move(facts);
  uint64_t newest = 0;
  Hash128 newest_hash;
  for (const ArtifactInfo& info : catalog->artifacts) {
    if (!info.streaming && info.target_version >= newest) {
      newest = info.target_version;
      newest_hash = info.target_hash;
    }
  }
  if (catalog->head_version > newest ||
      (catalog->head_version == newest && catalog->head_hash != newest_hash)) {
    catalog->head_version = newest;
    catalog->head_hash = newest_hash;
  }
}

const ManifestFacts* CatalogVerifier::FactsOf(const ArtifactKey& key) const {
  auto it = facts_.find(key);
  return it == facts_.end() ? nullptr : &it->second;
}

void CatalogVerifier::CountForged(const std::string& message) {
  ++failures_;
  last_error_ = message;
}

void CatalogVerifier::CountReplay(const std::string& message) {
  ++replays_;
  last_error_ = message;
}

// ---- identity and links --------------------------------------------------------------

const char* RoleName(wire::Role role) {
  switch (role) {
    case wire::PUBLISHER:
      return "publisher";
    case wire::RELAY:
      return "relay";
    case wire::WORKER:
      return "worker";
    case wire::CLIENT:
      return "client";
    default:
      return "unknown";
  }
}

std::string DefaultNodeId(wire::Role role, const std::string& region) {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "host");
  return std::string(RoleName(role)) + "-" + region + "-" + host + "-" + std::to_string(getpid());
}

void LinkRegistry::Add(std::shared_ptr<Connection> connection, bool upstream) {
  live_[std::move(connection)] = Link{upstream};
}

void LinkRegistry::Remove(const std::shared_ptr<Connection>& connection) {
  auto it = live_.find(connection);
  if (it == live_.end()) return;
  closed_in_ += connection->bytes_in();
  closed_out_ += connection->bytes_out();
  if (connection->shaped()) {
    closed_wan_in_ += connection->bytes_in();
    closed_wan_out_ += connection->bytes_out();
  }
  live_.erase(it);
}

uint64_t LinkRegistry::bytes_in() const {
  uint64_t total = closed_in_;
  for (const auto& [connection, link] : live_) total += connection->bytes_in();
  return total;
}
uint64_t LinkRegistry::bytes_out() const {
  uint64_t total = closed_out_;
  for (const auto& [connection, link] : live_) total += connection->bytes_out();
  return total;
}
uint64_t LinkRegistry::wan_bytes_in() const {
  uint64_t total = closed_wan_in_;
  for (const auto& [connection, link] : live_) {
    if (connection->shaped()) total += connection->bytes_in();
  }
  return total;
}
uint64_t LinkRegistry::wan_bytes_out() const {
  uint64_t total = closed_wan_out_;
  for (const auto& [connection, link] : live_) {
    if (connection->shaped()) total += connection->bytes_out();
  }
  return total;
}

nlohmann::json LinkRegistry::ToJson() const {
  nlohmann::json links = nlohmann::json::array();
  for (const auto& [connection, link] : live_) {
    const bool upstream = link.upstream;
    const wire::Hello& hello = connection->hello;
    const wire::Welcome& welcome = connection->welcome;
    const bool control = upstream ? false : hello.channel() == wire::CONTROL;
    links.push_back({
        {"peer", connection->peer()},
        {"direction", upstream ? "upstream" : "downstream"},
        {"node_id", upstream ? welcome.node_id() : hello.node_id()},
        {"region", upstream ? welcome.region() : hello.region()},
        {"role", RoleName(upstream ? welcome.role() : hello.role())},
        {"channel", upstream ? "" : (control ? "control" : "data")},
        {"bytes_in", connection->bytes_in()},
        {"bytes_out", connection->bytes_out()},
        {"shaped", connection->shaped()},
    });
  }
  return links;
}

// ---- Server -----------------------------------------------------------------------------

namespace {

// Coroutines take shared_ptr parameters only (see transport::RunOn on GCC 12).
awaitable<void> SendCatalog(std::shared_ptr<Connection> peer,
                            std::shared_ptr<wire::Header> header) {
  (void)co_await peer->Send(MakeFrame(*header));
}

}  // namespace

Server::Server(ServerOptions options, PieceSource* source, LinkRegistry* links)
    : options_(std::move(options)), source_(source), links_(links) {}

Server::~Server() {
  Stop();
}

Result<std::unique_ptr<Server>> Server::Start(asio::any_io_executor executor, ServerOptions options,
                                              PieceSource* source, LinkRegistry* links) {
  std::unique_ptr<Server> server(new Server(options, source, links));
  FW_ASSIGN_OR_RETURN(server->listener_,
                      transport::Listener::Bind(executor, options.listen, options.listener));
  Server* self = server.get();
  self->listener_->Start(
      [self](const wire::Hello&) {
        wire::Welcome welcome;
        welcome.set_role(self->options_.identity.role);
        welcome.set_region(self->options_.identity.region);
        welcome.set_node_id(self->options_.identity.node_id);
        welcome.set_max_staleness(self->catalog_.max_staleness());
        welcome.set_heartbeat_ms(
            static_cast<uint32_t>(self->options_.listener.connection.heartbeat.count()));
        return welcome;
      },
      [self](std::shared_ptr<Connection> connection) {
        return self->OnPeer(std::move(connection));
      });
  return server;
}

uint16_t Server::port() const {
  return listener_->port();
}

void Server::Stop() {
  if (listener_) listener_->Stop();
}

void Server::SetCatalog(wire::Catalog catalog) {
  catalog_ = std::move(catalog);
  wire::Header header;
  *header.mutable_catalog() = catalog_;
  auto shared = std::make_shared<wire::Header>(std::move(header));
  for (const auto& peer : control_peers_) {
    // Fire and forget: a peer whose queue is full gets the catalog when it drains.
    asio::co_spawn(peer->executor(), SendCatalog(peer, shared), asio::detached);
  }
}

std::vector<FleetNode> Server::Fleet() const {
  std::vector<FleetNode> nodes;
  const auto now = Clock::now();
  for (const auto& [id, entry] : fleet_) {
    if (now - entry.node.seen <= options_.report_timeout) nodes.push_back(entry.node);
  }
  return nodes;
}

uint64_t Server::fleet_nodes_omitted() const {
  uint64_t omitted = 0;
  for (const auto& [peer, held] : peer_fleets_) omitted += held.omitted;
  return omitted;
}

void BoundReport(wire::Report* report, size_t max_bytes, size_t max_nodes) {
  if (report->nodes_size() == 0) return;
  // The sender, then the nodes below it while both bounds hold. Each listed node costs its
  // size, a tag byte and a length of at most 5 bytes; omitted_nodes at most 11 bytes.
  size_t bytes = 11 + report->nodes(0).ByteSizeLong() + 6;
  int keep = 1;
  while (keep < report->nodes_size() && static_cast<size_t>(keep) < max_nodes) {
    const size_t node_bytes = report->nodes(keep).ByteSizeLong() + 6;
    if (bytes + node_bytes > max_bytes) break;
    bytes += node_bytes;
    ++keep;
  }
  const int dropped = report->nodes_size() - keep;
  if (dropped == 0) return;
  report->mutable_nodes()->DeleteSubrange(keep, dropped);
  report->set_omitted_nodes(report->omitted_nodes() + static_cast<uint64_t>(dropped));
}

namespace {

// Why one NodeState of a Report is refused, or "" when it may be taken.
std::string NodeStateProblem(const wire::NodeState& node) {
  if (node.node_id().empty()) return "a node without an id";
  if (node.node_id().size() > kMaxNodeIdBytes || node.region().size() > kMaxNodeIdBytes ||
      node.upstream().size() > kMaxNodeUpstreamBytes) {
    return "a node id, region or upstream over " + std::to_string(kMaxNodeIdBytes) + " bytes";
  }
  if (!node.weights_hash().empty() && node.weights_hash().size() != 16) {
    return "a weights hash of " + std::to_string(node.weights_hash().size()) + " bytes";
  }
  if (node.role() != wire::RELAY && node.role() != wire::WORKER && node.role() != wire::CLIENT) {
    return std::string("a node of role ") + RoleName(node.role());
  }
  return "";
}

}  // namespace

Status Server::ApplyReport(const Connection& peer, const wire::Report& report) {
  const wire::Hello& hello = peer.hello;
  const std::string who = std::string(RoleName(hello.role())) + " " + hello.node_id();
  if (report.nodes_size() == 0 || report.nodes(0).node_id() != hello.node_id() ||
      report.nodes(0).role() != hello.role()) {
    return Status::InvalidArgument("report from " + who + " at " + peer.peer() +
                                   " does not start with " + who + " itself");
  }
  if (hello.role() != wire::RELAY && report.nodes_size() > 1) {
    return Status::InvalidArgument("report from " + who + " at " + peer.peer() + " lists " +
                                   std::to_string(report.nodes_size() - 1) +
                                   " other nodes; only a relay speaks for nodes below it");
  }
  const auto now = Clock::now();
  uint64_t refused = 0;
  std::string first_problem;
  auto refuse = [&](const std::string& problem) {
    ++refused;
    if (first_problem.empty()) first_problem = problem;
  };
  // The well-formed nodes listed, each once (the first listing counts).
  std::vector<const wire::NodeState*> listed;
  std::set<std::string> listed_ids;
  for (const wire::NodeState& node : report.nodes()) {
    if (std::string problem = NodeStateProblem(node); !problem.empty()) {
      refuse(problem);
    } else if (listed_ids.insert(node.node_id()).second) {
      listed.push_back(&node);
    }
  }
  bool changed = false;
  // The report replaces what this connection listed before: what it no longer lists goes.
  PeerFleet& held = peer_fleets_[&peer];
  for (auto it = held.held.begin(); it != held.held.end();) {
    if (listed_ids.count(*it)) {
      ++it;
      continue;
    }
    auto entry = fleet_.find(*it);
    if (entry != fleet_.end() && entry->second.holder == &peer) {
      fleet_.erase(entry);
      changed = true;
    }
    it = held.held.erase(it);
  }
  auto expired = [&](const FleetEntry& entry) {
    return now - entry.node.seen > options_.report_timeout;
  };
  auto drop = [&](std::map<std::string, FleetEntry>::iterator entry) {
    auto holder = peer_fleets_.find(entry->second.holder);
    if (holder != peer_fleets_.end()) holder->second.held.erase(entry->first);
    return fleet_.erase(entry);
  };
  bool swept = false;
  size_t taken = 0;
  for (const wire::NodeState* node : listed) {
    auto known = fleet_.find(node->node_id());
    if (known != fleet_.end() && known->second.holder != &peer) {
      if (!expired(known->second)) {
        refuse("node " + node->node_id() + " is reported through " + known->second.node.via);
        continue;
      }
      drop(known);  // its reporter stopped reporting it: free for another
      known = fleet_.end();
    }
    if (taken >= options_.max_fleet_nodes_per_peer) {
      if (known != fleet_.end()) {
        drop(known);
        changed = true;
      }
      refuse("over " + std::to_string(options_.max_fleet_nodes_per_peer) +
             " nodes through one connection");
      continue;
    }
    if (known == fleet_.end()) {
      if (fleet_.size() >= options_.max_fleet_nodes && !swept) {
        swept = true;  // drop the expired ones, at most once per report
        for (auto it = fleet_.begin(); it != fleet_.end();) it = expired(it->second) ? drop(it) : std::next(it);
      }
      if (fleet_.size() >= options_.max_fleet_nodes) {
        refuse("over " + std::to_string(options_.max_fleet_nodes) + " nodes in the fleet");
        continue;
      }
      changed = true;
      known = fleet_.emplace(node->node_id(), FleetEntry{{}, &peer}).first;
      held.held.insert(node->node_id());
    } else if (known->second.node.state.version() != node->version()) {
      changed = true;
    }
    known->second.node = FleetNode{*node, hello.node_id(), now};
    ++taken;
  }
  held.omitted = std::min<uint64_t>(report.omitted_nodes(), uint64_t{1} << 32) + refused;
  fleet_nodes_refused_ += refused;
  if (refused > 0 && !held.warned) {
    held.warned = true;  // once per connection: a hostile peer cannot flood the log
    spdlog::warn("report from {} at {}: {} node(s) refused, first: {}", who, peer.peer(), refused,
                 first_problem);
  }
  if (changed && options_.on_fleet_change) options_.on_fleet_change();
  return Status::Ok();
}

void Server::ReleaseFleet(const Connection& peer) {
  auto held = peer_fleets_.find(&peer);
  if (held == peer_fleets_.end()) return;
  for (const std::string& id : held->second.held) {
    auto it = fleet_.find(id);
    if (it != fleet_.end() && it->second.holder == &peer) fleet_.erase(it);
  }
  peer_fleets_.erase(held);
}

awaitable<void> Server::OnPeer(std::shared_ptr<Connection> connection) {
  links_->Add(connection, /*upstream=*/false);
  if (connection->hello.channel() == wire::CONTROL) {
    co_await ServeControl(connection);
  } else {
    co_await ServeData(connection);
  }
  links_->Remove(connection);
}

awaitable<void> Server::ServeControl(std::shared_ptr<Connection> connection) {
  control_peers_.insert(connection);
  spdlog::info("{} {} ({}, region {}) subscribed from {}", RoleName(connection->hello.role()),
               connection->hello.node_id(), "control", connection->hello.region(),
               connection->peer());
  wire::Header header;
  *header.mutable_catalog() = catalog_;
  Status status = co_await connection->Send(MakeFrame(std::move(header)));
  while (status.ok()) {
    Result<Frame> frame = co_await connection->Receive();
    if (!frame.ok()) {
      status = frame.status();
      break;
    }
    if (frame->header.has_report()) {
      status = ApplyReport(*connection, frame->header.report());
    } else {
      status = Status::Corruption(std::string("unexpected ") + FrameKindName(frame->header) +
                                  " frame on a control channel");
    }
    if (!status.ok()) connection->Close(status);
  }
  control_peers_.erase(connection);
  // The nodes behind this connection left with it (or report again elsewhere).
  ReleaseFleet(*connection);
  spdlog::info("{} {} left: {}", RoleName(connection->hello.role()), connection->hello.node_id(),
               status.message());
}

awaitable<void> Server::ServeData(std::shared_ptr<Connection> connection) {
  while (true) {
    Result<Frame> frame = co_await connection->Receive();
    if (!frame.ok()) co_return;
    if (!frame->header.has_piece_request()) {
      connection->Close(Status::Corruption(
          std::string("unexpected ") + FrameKindName(frame->header) + " frame on a data channel"));
      co_return;
    }
    const wire::PieceRequest& request = frame->header.piece_request();
    ArtifactKey key{
        request.kind() == wire::KEYFRAME ? ArtifactKind::kKeyframe : ArtifactKind::kDelta,
        request.target_version()};
    Result<PieceSource::Piece> piece = co_await source_->GetPiece(key, request.index());
    wire::Header header;
    if (!piece.ok()) {
      wire::PieceUnavailable* unavailable = header.mutable_piece_unavailable();
      unavailable->set_kind(request.kind());
      unavailable->set_target_version(request.target_version());
      unavailable->set_index(request.index());
      unavailable->set_reason(piece.status().message());
      if (!(co_await connection->Send(MakeFrame(std::move(header)))).ok()) co_return;
      continue;
    }
    wire::Piece* out = header.mutable_piece();
    out->set_kind(request.kind());
    out->set_target_version(request.target_version());
    out->set_index(request.index());
    // Send() waits while this connection's queue is full: a slow peer stops this loop,
    // which stops reading its requests (bounded memory per peer).
    if (!(co_await connection->Send(MakeFrame(std::move(header), piece->owner, piece->bytes)))
             .ok()) {
      co_return;
    }
    ++pieces_served_;
  }
}

// ---- Upstream ----------------------------------------------------------------------------

Download::Download(ArtifactInfo artifact)
    : info(std::move(artifact)), have(info.piece_hashes.size(), false) {
  Result<std::shared_ptr<GrowableBytes>> buffer =
      GrowableBytes::Create(info.streaming ? info.size_bound : info.size_bytes);
  if (!buffer.ok()) throw std::bad_alloc();
  bytes = std::move(*buffer);
  (void)bytes->Resize(info.size_bytes);
}

std::span<const std::byte> Download::piece(uint32_t index) const {
  const uint64_t begin = static_cast<uint64_t>(index) * info.piece_bytes;
  const uint64_t end = std::min(info.size_bytes, begin + info.piece_bytes);
  return std::span<const std::byte>(bytes->data() + begin, end - begin);
}

bool Download::Extend(const ArtifactInfo& newer) {
  if (!info.streaming || KeyOf(newer) != KeyOf(info) || newer.piece_bytes != info.piece_bytes ||
      newer.base_version != info.base_version || newer.base_hash != info.base_hash ||
      newer.piece_hashes.size() < info.piece_hashes.size() ||
      newer.size_bytes > bytes->capacity() || newer.size_bytes < info.size_bytes) {
    return false;
  }
  // Pieces verified against the streaming list must be the same pieces in the new one.
  if (!std::equal(info.piece_hashes.begin(), info.piece_hashes.end(), newer.piece_hashes.begin())) {
    return false;
  }
  if (!bytes->Resize(newer.size_bytes).ok()) return false;
  have.resize(newer.piece_hashes.size(), false);
  info = newer;
  return true;
}

uint64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return uint64_t{1} << 40;  // unknown: 1 TiB
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

std::vector<std::string> DropOversized(Catalog* catalog, uint64_t max_bytes) {
  std::vector<std::string> dropped;
  std::erase_if(catalog->artifacts, [&](const ArtifactInfo& info) {
    const uint64_t reserved = info.streaming ? info.size_bound : info.size_bytes;
    if (reserved <= max_bytes) return false;
    dropped.push_back("catalog entry " + Describe(KeyOf(info)) + " announces " +
                      std::to_string(reserved) + " bytes, over this node's limit of " +
                      std::to_string(max_bytes) + " (max_artifact_bytes); not fetched");
    catalog->signatures.erase(KeyOf(info));
    return true;
  });
  return dropped;
}

Upstream::Upstream(asio::any_io_executor executor, UpstreamOptions options, LinkRegistry* links)
    : executor_(std::move(executor)), options_(std::move(options)), links_(links) {
  if (options_.max_artifact_bytes == 0) options_.max_artifact_bytes = PhysicalMemoryBytes();
  data_.resize(static_cast<size_t>(std::max(1, options_.streams)));
  data_index_.resize(data_.size(), 0);
}

Upstream::~Upstream() {
  Stop();
}

void Upstream::Stop() {
  stopped_ = true;
  if (control_) control_->Close(Status::Unavailable("stopping"));
  for (auto& connection : data_) {
    if (connection) connection->Close(Status::Unavailable("stopping"));
  }
}

void Upstream::ReportNow() {
  report_now_ = true;
  if (auto timer = report_timer_.lock()) timer->cancel();
}

std::string Upstream::current() const {
  return control_ ? options_.endpoints[control_index_].ToString() : std::string();
}

awaitable<Result<std::shared_ptr<Connection>>> Upstream::DialAny(wire::Channel channel,
                                                                 size_t* index) {
  Status last = Status::Unavailable("no upstream configured");
  for (size_t i = 0; i < options_.endpoints.size() && !stopped_; ++i) {
    transport::DialOptions dial;
    dial.endpoint = options_.endpoints[i];
    dial.tls = options_.tls;
    dial.timeout = options_.dial_timeout;
    dial.connection = options_.connection;
    wire::Hello hello;
    hello.set_token(options_.token);
    hello.set_role(options_.identity.role);
    hello.set_region(options_.identity.region);
    hello.set_node_id(options_.identity.node_id);
    hello.set_channel(channel);
    Result<std::shared_ptr<Connection>> connection = co_await transport::Dial(dial, hello);
    if (connection.ok()) {
      *index = i;
      links_->Add(*connection, /*upstream=*/true);
      co_return connection;
    }
    spdlog::debug("upstream {}: {}", dial.endpoint.ToString(), connection.status().message());
    last = connection.status();
  }
  co_return stopped_ ? Status::Unavailable("stopping") : last;
}

awaitable<void> Upstream::ReportLoop(std::shared_ptr<Connection> connection,
                                     std::shared_ptr<bool> reporting,
                                     std::shared_ptr<size_t> index_ptr) {
  const size_t index = *index_ptr;
  auto next_prefer = Clock::now() + options_.prefer_retry;
  auto timer = std::make_shared<asio::steady_timer>(executor_);
  report_timer_ = timer;
  // Half the header limit: a report never cuts its own control channel.
  const size_t max_report_bytes = options_.connection.limits.max_header_bytes / 2;
  uint64_t last_omitted = 0;
  while (*reporting && !connection->closed()) {
    report_now_ = false;
    wire::Header header;
    wire::Report* report = header.mutable_report();
    *report = report_();
    BoundReport(report, max_report_bytes);
    if (last_omitted == 0 && report->omitted_nodes() > 0) {
      spdlog::warn("report to {} lists {} node(s) below this one and counts {} more",
                   connection->peer(), report->nodes_size() - 1, report->omitted_nodes());
    }
    last_omitted = report->omitted_nodes();
    if (!(co_await connection->Send(MakeFrame(std::move(header)))).ok()) co_return;
    // ReportNow cuts the wait short; 50 ms at least between reports all the same.
    timer->expires_after(report_now_ ? 50ms : 1000ms);
    transport::error_code ignored;
    co_await timer->async_wait(asio::redirect_error(transport::use_awaitable, ignored));
    if (report_now_) {
      timer->expires_after(50ms);
      co_await timer->async_wait(asio::redirect_error(transport::use_awaitable, ignored));
    }
    if (index != 0 && Clock::now() >= next_prefer && *reporting) {
      next_prefer = Clock::now() + options_.prefer_retry;
      transport::DialOptions probe;
      probe.endpoint = options_.endpoints[0];
      probe.tls = options_.tls;
      probe.timeout = options_.dial_timeout;
      wire::Hello hello;
      hello.set_token(options_.token);
      hello.set_role(wire::CLIENT);
      hello.set_region(options_.identity.region);
      hello.set_node_id(options_.identity.node_id + "-probe");
      hello.set_channel(wire::DATA);
      auto probed = co_await transport::Dial(probe, hello);
      if (probed.ok()) {
        (*probed)->Close(Status::Unavailable("probe done"));
        spdlog::info("preferred upstream {} is back; switching", probe.endpoint.ToString());
        connection->Close(Status::Unavailable("switching to the preferred upstream"));
      }
    }
  }
}

awaitable<void> Upstream::RunControl(std::function<void(Catalog)> on_catalog,
                                     std::function<wire::Report()> make_report) {
  Status last_error;
  while (!stopped_) {
    size_t index = 0;
    Result<std::shared_ptr<Connection>> dialed = co_await DialAny(wire::CONTROL, &index);
    if (!dialed.ok()) {
      if (last_error.message() != dialed.status().message()) {
        spdlog::warn("no upstream reachable: {}", dialed.status().message());
      }
      last_error = dialed.status();
      co_await transport::SleepFor(options_.retry_delay);
      continue;
    }
    last_error = Status::Ok();
    control_ = *dialed;
    control_index_ = index;
    auto connection = control_;
    spdlog::info("subscribed to {} {} at {}", RoleName(connection->welcome.role()),
                 connection->welcome.node_id(), connection->peer());
    // Reports go out every second; while failed over, the preferred upstream is retried.
    auto reporting = std::make_shared<bool>(true);
    report_ = make_report;
    asio::co_spawn(executor_, ReportLoop(connection, reporting, std::make_shared<size_t>(index)),
                   asio::detached);
    while (true) {
      Result<Frame> frame = co_await connection->Receive();
      if (!frame.ok()) {
        if (!stopped_) spdlog::warn("control channel: {}", frame.status().message());
        break;
      }
      if (!frame->header.has_catalog()) {
        connection->Close(Status::Corruption(std::string("unexpected ") +
                                             FrameKindName(frame->header) +
                                             " frame on the control channel"));
        continue;
      }
      Result<Catalog> catalog = FromWire(frame->header.catalog(), options_.max_piece_bytes);
      if (!catalog.ok()) {
        spdlog::warn("ignoring a bad catalog from {}: {}", connection->peer(),
                     catalog.status().message());
        continue;
      }
      // Nothing a peer announces reserves more than this node allows (Download).
      std::vector<std::string> dropped = DropOversized(&*catalog, options_.max_artifact_bytes);
      std::set<std::string> logged;
      for (std::string& message : dropped) {
        if (!logged_oversized_.count(message)) spdlog::error("{}: {}", connection->peer(), message);
        logged.insert(std::move(message));
      }
      last_catalog_error_ = logged.empty() ? std::string() : *logged.begin();
      logged_oversized_ = std::move(logged);
      on_catalog(std::move(*catalog));
    }
    *reporting = false;
    links_->Remove(connection);
    if (control_ == connection) control_.reset();
    if (!stopped_) co_await transport::SleepFor(options_.retry_delay);
  }
}

awaitable<void> Upstream::StreamTask(std::shared_ptr<FetchState> state,
                                     std::shared_ptr<int> stream) {
  state->results[*stream] = co_await RunStream(*stream, *state->download, *state->pending,
                                               *state->requeued, *state->on_piece);
  --state->running;
  state->requeued->Notify();
  state->finished->Notify();
}

awaitable<Status> Upstream::Fetch(Download& download, std::function<void(uint32_t)> on_piece) {
  if (download.all_known()) co_return Status::Ok();
  // The pieces listed now: a streaming entry may list more while this runs (Extend), and
  // those are for the next Fetch.
  const size_t known = download.have.size();
  std::vector<uint32_t> pending;  // a stack: the lowest index on top
  for (size_t i = known; i-- > 0;) {
    if (!download.have[i]) pending.push_back(static_cast<uint32_t>(i));
  }
  transport::Signal requeued(executor_);
  last_progress_ = Clock::now();
  const int streams = static_cast<int>(data_.size());
  transport::Signal finished(executor_);
  auto state = std::make_shared<FetchState>(FetchState{
      &download, &pending, &requeued, &on_piece, std::vector<Status>(streams), streams, &finished});
  for (int s = 0; s < streams; ++s) {
    asio::co_spawn(executor_, StreamTask(state, std::make_shared<int>(s)), asio::detached);
  }
  while (state->running > 0) co_await finished.Wait();
  if (std::find(download.have.begin(), download.have.begin() + known, false) ==
      download.have.begin() + known) {
    co_return Status::Ok();
  }
  for (const Status& status : state->results) {
    if (!status.ok()) co_return status;
  }
  co_return Status::Unavailable("fetch of " + Describe(KeyOf(download.info)) + " did not complete");
}

awaitable<Status> Upstream::RunStream(int stream, Download& download,
                                      std::vector<uint32_t>& pending, transport::Signal& requeued,
                                      const std::function<void(uint32_t)>& on_piece) {
  const ArtifactKey key = KeyOf(download.info);
  const wire::ArtifactKind kind =
      key.kind == ArtifactKind::kKeyframe ? wire::KEYFRAME : wire::DELTA;
  std::vector<uint32_t> in_flight;
  auto requeue_in_flight = [&] {
    for (uint32_t index : in_flight) {
      if (!download.have[index]) pending.push_back(index);
    }
    in_flight.clear();
    requeued.Notify();
  };
  int unavailable_strikes = 0;
  // Until nothing is left to ask for: a stream with nothing pending and nothing in
  // flight is done (requests another stream gives back are its own to redo).
  while (!pending.empty() || !in_flight.empty()) {
    if (stopped_) co_return Status::Unavailable("stopping");
    if (Clock::now() - last_progress_ > options_.give_up) {
      requeue_in_flight();
      co_return Status::Unavailable("no progress fetching " + Describe(key) + " for " +
                                    std::to_string(options_.give_up.count() / 1000) + " s");
    }
    std::shared_ptr<Connection>& connection = data_[stream];
    if (!connection || connection->closed()) {
      // Requests still in flight died with the connection (frames already received were
      // handled): another stream, or this one after a redial, asks again.
      if (!in_flight.empty()) requeue_in_flight();
      if (connection) links_->Remove(connection);
      connection.reset();
      if (pending.empty()) continue;  // nothing left for this stream
      size_t index = 0;
      Result<std::shared_ptr<Connection>> dialed = co_await DialAny(wire::DATA, &index);
      if (!dialed.ok()) {
        co_await transport::SleepFor(options_.retry_delay);
        continue;
      }
      connection = *dialed;
      data_index_[stream] = index;
      spdlog::debug("data stream {} connected to {} (pending {}, in flight {})", stream,
                    connection->peer(), pending.size(), in_flight.size());
    }
    // Fill the window.
    Status sent;
    while (static_cast<int>(in_flight.size()) < options_.window && !pending.empty() && sent.ok()) {
      const uint32_t index = pending.back();
      pending.pop_back();
      if (download.have[index]) continue;
      wire::Header header;
      wire::PieceRequest* request = header.mutable_piece_request();
      request->set_kind(kind);
      request->set_target_version(key.target_version);
      request->set_index(index);
      in_flight.push_back(index);
      ++counters_.piece_requests;
      sent = co_await connection->Send(MakeFrame(std::move(header)));
    }
    if (!sent.ok()) {
      requeue_in_flight();
      continue;
    }
    if (in_flight.empty()) break;  // everything pending was here already
    // Answers come in order; a connection that keeps sending heartbeats but no piece for
    // this long is closed, and its requests go elsewhere.
    Result<Frame> frame = co_await connection->Receive(options_.give_up, "a piece");
    if (!frame.ok()) {
      spdlog::info("data stream {} to {}: {}; resuming {} with {}/{} pieces verified", stream,
                   connection->peer(), frame.status().message(), Describe(key), download.have_count,
                   download.have.size());
      requeue_in_flight();
      continue;
    }
    const wire::Header& header = frame->header;
    uint32_t index = 0;
    if (header.has_piece()) {
      index = header.piece().index();
    } else if (header.has_piece_unavailable()) {
      index = header.piece_unavailable().index();
    } else {
      connection->Close(Status::Corruption(std::string("unexpected ") + FrameKindName(header) +
                                           " frame on a data channel"));
      requeue_in_flight();
      continue;
    }
    auto it = std::find(in_flight.begin(), in_flight.end(), index);
    const bool matches =
        it != in_flight.end() &&
        (header.has_piece() ? header.piece().target_version()
                            : header.piece_unavailable().target_version()) == key.target_version;
    if (!matches) {
      connection->Close(Status::Corruption("upstream " + connection->peer() +
                                           " sent a piece that was not requested"));
      requeue_in_flight();
      continue;
    }
    in_flight.erase(it);
    if (header.has_piece_unavailable()) {
      // The upstream does not serve it (any more): another upstream may.
      spdlog::warn("{} does not serve {} piece {}: {}", connection->peer(), Describe(key), index,
                   header.piece_unavailable().reason());
      pending.push_back(index);
      requeue_in_flight();
      connection->Close(Status::Unavailable("artifact not served"));
      if (++unavailable_strikes >= 3) {
        co_return Status::NotFound("upstream does not serve " + Describe(key) + ": " +
                                   header.piece_unavailable().reason());
      }
      continue;
    }
    std::span<const std::byte> expected = download.piece(index);
    if (download.have[index]) continue;  // a duplicate after a requeue
    if (frame->payload.size() != expected.size() ||
        HashBytes64(frame->payload) != download.info.piece_hashes[index]) {
      ++counters_.pieces_rejected;
      spdlog::warn("{} piece {} from {} failed its checksum; fetching it again", Describe(key),
                   index, connection->peer());
      pending.push_back(index);
      requeued.Notify();
      continue;
    }
    std::memcpy(const_cast<std::byte*>(expected.data()), frame->payload.data(), expected.size());
    download.have[index] = true;
    ++download.have_count;
    ++counters_.pieces_verified;
    counters_.piece_bytes += expected.size();
    last_progress_ = Clock::now();
    unavailable_strikes = 0;
    if (on_piece) on_piece(index);
  }
  requeued.Notify();
  co_return Status::Ok();
}

}  // namespace flywheel::sync
