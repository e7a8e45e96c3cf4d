#include "sync/server.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <iterator>

namespace flywheel::sync {

using transport::Clock;
using transport::Frame;
using transport::FrameKindName;
using transport::MakeFrame;

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

// A connection speaks for its own node first, and only a relay for nodes below it.
Status CheckSpeaksFor(const Connection& peer, const wire::Report& report) {
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
  return Status::Ok();
}

}  // namespace

// One Report on its way into the fleet map (ApplyReport).
struct Server::ReportPass {
  Clock::time_point now;
  uint64_t refused = 0;
  std::string first_problem;
  bool swept = false;  // the expired nodes were dropped already (at most once per report)
  size_t taken = 0;    // nodes this connection holds after the report, so far
  bool changed = false;

  void Refuse(std::string problem) {
    if (refused++ == 0) first_problem = std::move(problem);
  }
};

Status Server::ApplyReport(const Connection& peer, const wire::Report& report) {
  FW_RETURN_IF_ERROR(CheckSpeaksFor(peer, report));
  ReportPass pass{Clock::now()};
  // The well-formed nodes listed, each once (the first listing counts).
  std::vector<const wire::NodeState*> listed;
  std::set<std::string> listed_ids;
  for (const wire::NodeState& node : report.nodes()) {
    if (std::string problem = NodeStateProblem(node); !problem.empty()) {
      pass.Refuse(std::move(problem));
    } else if (listed_ids.insert(node.node_id()).second) {
      listed.push_back(&node);
    }
  }
  PeerFleet& held = peer_fleets_[&peer];
  pass.changed = ForgetUnlisted(peer, listed_ids, &held);
  for (const wire::NodeState* node : listed) TakeNode(peer, *node, &held, &pass);
  held.omitted = std::min<uint64_t>(report.omitted_nodes(), uint64_t{1} << 32) + pass.refused;
  fleet_nodes_refused_ += pass.refused;
  if (pass.refused > 0 && !held.warned) {
    held.warned = true;  // once per connection: a hostile peer cannot flood the log
    spdlog::warn("report from {} {} at {}: {} node(s) refused, first: {}",
                 RoleName(peer.hello.role()), peer.hello.node_id(), peer.peer(), pass.refused,
                 pass.first_problem);
  }
  if (pass.changed && options_.on_fleet_change) options_.on_fleet_change();
  return Status::Ok();
}

bool Server::ForgetUnlisted(const Connection& peer, const std::set<std::string>& listed_ids,
                            PeerFleet* held) {
  bool changed = false;
  for (auto it = held->held.begin(); it != held->held.end();) {
    if (listed_ids.count(*it)) {
      ++it;
      continue;
    }
    auto entry = fleet_.find(*it);
    if (entry != fleet_.end() && entry->second.holder == &peer) {
      fleet_.erase(entry);
      changed = true;
    }
    it = held->held.erase(it);
  }
  return changed;
}

void Server::TakeNode(const Connection& peer, const wire::NodeState& node, PeerFleet* held,
                      ReportPass* pass) {
  auto known = fleet_.find(node.node_id());
  if (known != fleet_.end() && known->second.holder != &peer) {
    if (!Expired(known->second, pass->now)) {
      pass->Refuse("node " + node.node_id() + " is reported through " + known->second.node.via);
      return;
    }
    DropFleetEntry(known);  // its reporter stopped reporting it: free for another
    known = fleet_.end();
  }
  if (pass->taken >= options_.max_fleet_nodes_per_peer) {
    if (known != fleet_.end()) {
      DropFleetEntry(known);
      pass->changed = true;
    }
    pass->Refuse("over " + std::to_string(options_.max_fleet_nodes_per_peer) +
                 " nodes through one connection");
    return;
  }
  if (known == fleet_.end()) {
    if (fleet_.size() >= options_.max_fleet_nodes && !pass->swept) {
      pass->swept = true;
      for (auto it = fleet_.begin(); it != fleet_.end();) {
        it = Expired(it->second, pass->now) ? DropFleetEntry(it) : std::next(it);
      }
    }
    if (fleet_.size() >= options_.max_fleet_nodes) {
      pass->Refuse("over " + std::to_string(options_.max_fleet_nodes) + " nodes in the fleet");
      return;
    }
    pass->changed = true;
    known = fleet_.emplace(node.node_id(), FleetEntry{{}, &peer}).first;
    held->held.insert(node.node_id());
  } else if (known->second.node.state.version() != node.version()) {
    pass->changed = true;
  }
  known->second.node = FleetNode{node, peer.hello.node_id(), pass->now};
  ++pass->taken;
}

bool Server::Expired(const FleetEntry& entry, Clock::time_point now) const {
  return now - entry.node.seen > options_.report_timeout;
}

Server::FleetMap::iterator Server::DropFleetEntry(FleetMap::iterator entry) {
  auto holder = peer_fleets_.find(entry->second.holder);
  if (holder != peer_fleets_.end()) holder->second.held.erase(entry->first);
  return fleet_.erase(entry);
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

}  // namespace flywheel::sync
