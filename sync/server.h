// The serving side of replication (a publisher's or relay's): accepts downstream nodes,
// broadcasts the catalog over every control connection, keeps the fleet map from their
// Reports and answers piece requests on data connections.
//
// Every coroutine here runs on one executor (a process's network thread): the catalog, the
// fleet map and the PieceSource are touched there only. The connections themselves may run
// elsewhere: with ServerOptions::listener.egress (--egress-threads) each is on a strand of
// that pool, where its TLS records are sealed and its socket written, and Send/Receive hop
// to it and back (transport/connection.h). A piece handed to Send must therefore stay
// unchanged while any thread may still write it: PieceSource pieces are immutable bytes
// kept alive by their owner. CPU work (hashing, applying, encoding) runs elsewhere.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "sync/catalog.h"
#include "sync/identity.h"
#include "sync/link_registry.h"
#include "sync/report.h"
#include "transport/connection.h"

namespace flywheel::sync {

namespace asio = transport::asio;
using transport::awaitable;
using transport::Connection;

// Where a Server gets piece bytes. GetPiece may wait (a relay waits for a piece it is
// still fetching); NotFound means the artifact is not (or no longer) served.
class PieceSource {
 public:
  struct Piece {
    std::shared_ptr<const void> owner;
    std::span<const std::byte> bytes;
  };
  virtual ~PieceSource() = default;
  virtual awaitable<Result<Piece>> GetPiece(const ArtifactKey& key, uint32_t index) = 0;
};

struct ServerOptions {
  transport::Endpoint listen;
  transport::ListenerOptions listener;
  NodeIdentity identity;
  std::chrono::milliseconds report_timeout{10000};  // a node not reporting is dropped
  // Bounds of the fleet map (see Server::Fleet): nodes in all, and nodes one control
  // connection may hold (a worker's holds only the worker itself).
  size_t max_fleet_nodes = 4096;
  size_t max_fleet_nodes_per_peer = kMaxReportNodes;
  // Called on the executor when a report adds a node or changes a node's version (a relay
  // passes the news upstream at once: Upstream::ReportNow).
  std::function<void()> on_fleet_change;
};

// One node as seen in Reports.
struct FleetNode {
  wire::NodeState state;
  std::string via;  // the node whose connection reported it
  std::chrono::steady_clock::time_point seen;
};

class Server {
 public:
  static Result<std::unique_ptr<Server>> Start(asio::any_io_executor executor,
                                               ServerOptions options, PieceSource* source,
                                               LinkRegistry* links);
  ~Server();
  uint16_t port() const;
  // Replaces the catalog and sends it to every control peer.
  void SetCatalog(wire::Catalog catalog);
  const wire::Catalog& catalog() const { return catalog_; }
  // Nodes below this one (from their Reports), newest report per node id, those reported
  // within report_timeout only.
  //
  // A control connection speaks only for the nodes it may speak for: its Report must start
  // with the node of its Hello (same node id and role), and only a relay's may list more
  // (its subtree). A node id held by one connection is not taken by another until that
  // connection closes, stops listing it, or stops reporting for report_timeout (the first
  // reporter keeps it: a fleet-token holder cannot overwrite a worker's readiness). Each
  // Report replaces what its connection listed before; a connection holds at most
  // max_fleet_nodes_per_peer nodes and the map at most max_fleet_nodes. Nodes over a bound,
  // already held elsewhere, or with over-long fields are refused (fleet_nodes_refused);
  // a Report that does not start with its sender, or a non-relay's that lists other
  // nodes, closes the connection.
  std::vector<FleetNode> Fleet() const;
  // Nodes refused from Reports so far, and nodes the live control peers said they left out
  // of their Reports (BoundReport) or that were refused here.
  uint64_t fleet_nodes_refused() const { return fleet_nodes_refused_; }
  uint64_t fleet_nodes_omitted() const;
  uint64_t pieces_served() const { return pieces_served_; }
  void Stop();

 private:
  Server(ServerOptions options, PieceSource* source, LinkRegistry* links);
  awaitable<void> OnPeer(std::shared_ptr<Connection> connection);
  awaitable<void> ServeControl(std::shared_ptr<Connection> connection);
  awaitable<void> ServeData(std::shared_ptr<Connection> connection);
  // Takes a Report received on `peer` (see Fleet). An error: the peer lied about who it
  // is or speaks for; the connection is closed.
  Status ApplyReport(const Connection& peer, const wire::Report& report);
  void ReleaseFleet(const Connection& peer);  // the nodes `peer` held leave with it

  ServerOptions options_;
  PieceSource* source_;
  LinkRegistry* links_;
  std::unique_ptr<transport::Listener> listener_;
  wire::Catalog catalog_;
  std::set<std::shared_ptr<Connection>> control_peers_;
  struct FleetEntry {
    FleetNode node;
    const Connection* holder;  // the control connection that reported it
  };
  struct PeerFleet {
    std::set<std::string> held;  // node ids
    uint64_t omitted = 0;        // what its last Report left out or had refused
    bool warned = false;         // a refusal was logged already (once per connection)
  };
  using FleetMap = std::map<std::string, FleetEntry>;
  // The steps of ApplyReport (server.cc).
  struct ReportPass;
  // Drops the nodes `peer` held and its Report no longer lists; true if any was dropped.
  bool ForgetUnlisted(const Connection& peer, const std::set<std::string>& listed_ids,
                      PeerFleet* held);
  // Takes one well-formed node of `peer`'s Report into the fleet map, or refuses it.
  void TakeNode(const Connection& peer, const wire::NodeState& node, PeerFleet* held,
                ReportPass* pass);
  bool Expired(const FleetEntry& entry, std::chrono::steady_clock::time_point now) const;
  FleetMap::iterator DropFleetEntry(FleetMap::iterator entry);  // and from its holder

  FleetMap fleet_;
  std::map<const Connection*, PeerFleet> peer_fleets_;
  uint64_t fleet_nodes_refused_ = 0;
  uint64_t pieces_served_ = 0;
};

}  // namespace flywheel::sync
