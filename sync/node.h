// What the publisher, relays and workers share: the catalog on the wire, the serving side
// (Server: accepts downstream nodes, broadcasts the catalog, answers piece requests) and
// the subscribing side (Upstream: a control channel with failover between upstreams,
// and parallel data streams that fetch an artifact piece by piece, verify every piece and
// resume after a broken connection from the pieces already verified).
//
// Every coroutine here runs on one executor (a process's network thread); CPU work
// (hashing, applying, encoding) runs elsewhere.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "base/growable_bytes.h"
#include "base/status.h"
#include "checkpoint/hash.h"
#include "sync/signing.h"
#include "sync/version_log.h"
#include "transport/connection.h"

namespace flywheel::sync {

namespace asio = transport::asio;
using transport::awaitable;
using transport::Connection;

// ---- the catalog on the wire -------------------------------------------------------

std::string HashBytesOf(const Hash128& hash);  // 16 bytes, low half first
Result<Hash128> HashFromBytes(const std::string& bytes, const std::string& what);

// The largest bound a streaming catalog entry may announce (address space a node reserves
// for it; memory is used only as pieces arrive).
inline constexpr uint64_t kMaxStreamingBound = uint64_t{4} << 40;

wire::Artifact ToWire(const ArtifactInfo& info);
// Checks what a peer sent: sizes, hash lengths, piece count consistent with the size.
Result<ArtifactInfo> FromWire(const wire::Artifact& artifact, uint64_t max_piece_bytes);

// Identifies an artifact within a catalog.
struct ArtifactKey {
  ArtifactKind kind = ArtifactKind::kKeyframe;
  uint64_t target_version = 0;
  auto operator<=>(const ArtifactKey&) const = default;
};
inline ArtifactKey KeyOf(const ArtifactInfo& info) { return {info.kind, info.target_version}; }
std::string Describe(const ArtifactKey& key);  // "delta v12", "keyframe v10"

// A catalog as received: artifacts checked and ordered, head and staleness bound.
struct Catalog {
  std::vector<ArtifactInfo> artifacts;
  uint64_t head_version = 0;
  Hash128 head_hash;
  uint64_t max_staleness = 0;
  // The publisher's signed manifests (sync/signing.h), for the artifacts it signed.
  std::map<ArtifactKey, SignedManifest> signatures;
  const ArtifactInfo* Find(const ArtifactKey& key) const;
  const SignedManifest* SignatureOf(const ArtifactKey& key) const;
};
wire::Catalog ToWire(const Catalog& catalog);
Result<Catalog> FromWire(const wire::Catalog& catalog, uint64_t max_piece_bytes);

// A relay's or worker's check of the catalogs it receives against its trusted keys
// (sync/signing.h, steps 1-3). Network-thread state; not thread-safe.
class CatalogVerifier {
 public:
  explicit CatalogVerifier(TrustedKeys trusted) : trusted_(std::move(trusted)) {}
  bool enabled() const { return !trusted_.empty(); }
  uint64_t trusted_keys() const { return trusted_.key_ids().size(); }
  // Without trusted keys, does nothing. Else drops every artifact whose signed manifest
  // does not verify or describe it, keeps the facts of the others, and lowers the head to
  // the newest artifact left (a forged head cannot make a node look stale).
  //
  // A refusal is counted (failures()) and logged once per artifact and signature while
  // remembered: only the last refused signature of each artifact is remembered (as a
  // 64-bit hash), and only while catalogs keep listing the artifact. So what a node keeps
  // is bounded by the last catalog (itself bounded by the frame header limit), however
  // many forgeries arrive; an artifact refused again with another signature, or after
  // leaving the catalog, is counted again. One log line per catalog with new refusals.
  void Filter(Catalog* catalog, const std::string& who);
  // Refusals remembered now (see Filter): at most one per artifact of the last catalog.
  size_t remembered_refusals() const { return counted_.size(); }
  // The verified facts of an artifact of the last filtered catalog; null if none.
  const ManifestFacts* FactsOf(const ArtifactKey& key) const;
  // A downloaded artifact whose bytes do not have the signed SHA-256, or a validly signed
  // version that CheckFresh refused.
  void CountForged(const std::string& message);
  void CountReplay(const std::string& message);
  uint64_t failures() const { return failures_; }
  uint64_t replays() const { return replays_; }
  const std::string& last_error() const { return last_error_; }

 private:
  TrustedKeys trusted_;
  std::map<ArtifactKey, ManifestFacts> facts_;
  // Artifact of the last catalog -> hash of its last refused signature (0: refused for
  // its streaming bound).
  std::map<ArtifactKey, uint64_t> counted_;
  uint64_t failures_ = 0;
  uint64_t replays_ = 0;
  std::string last_error_;
};

// ---- who we are, and counters --------------------------------------------------------

struct NodeIdentity {
  wire::Role role = wire::WORKER;
  std::string region;
  std::string node_id;
};
const char* RoleName(wire::Role role);
// "<role>-<region>-<hostname>-<pid>"
std::string DefaultNodeId(wire::Role role, const std::string& region);

// Connections of one node and what closed ones carried, for /v1/status and /metrics.
class LinkRegistry {
 public:
  void Add(std::shared_ptr<Connection> connection, bool upstream);
  void Remove(const std::shared_ptr<Connection>& connection);
  uint64_t bytes_in() const;
  uint64_t bytes_out() const;
  uint64_t wan_bytes_in() const;  // on shaped links
  uint64_t wan_bytes_out() const;
  nlohmann::json ToJson() const;  // the live links
 private:
  struct Link {
    bool upstream = false;
  };
  std::map<std::shared_ptr<Connection>, Link> live_;
  uint64_t closed_in_ = 0, closed_out_ = 0, closed_wan_in_ = 0, closed_wan_out_ = 0;
};

// ---- the serving side ----------------------------------------------------------------

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

// What a node may put in one NodeState of a Report: longer ids, regions or upstreams and
// hashes other than 16 bytes are refused.
inline constexpr size_t kMaxNodeIdBytes = 256;
inline constexpr size_t kMaxNodeUpstreamBytes = 512;
// The most nodes a Report lists, its sender included (the rest are counted, not listed):
// what ServerOptions::max_fleet_nodes_per_peer takes by default.
inline constexpr size_t kMaxReportNodes = 2048;

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

// Bounds `report` (the sender first, then the nodes below it) so that it lists at most
// `max_nodes` nodes, the sender included, and serializes to at most `max_bytes`: nodes past
// either bound are dropped from the end and added to omitted_nodes. The sender is always
// kept (a NodeState within the limits above is far below any sane `max_bytes`).
void BoundReport(wire::Report* report, size_t max_bytes, size_t max_nodes = kMaxReportNodes);

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
  std::map<std::string, FleetEntry> fleet_;
  std::map<const Connection*, PeerFleet> peer_fleets_;
  uint64_t fleet_nodes_refused_ = 0;
  uint64_t pieces_served_ = 0;
};

// ---- the subscribing side --------------------------------------------------------------

struct UpstreamOptions {
  std::vector<transport::Endpoint> endpoints;  // in order of preference
  std::shared_ptr<asio::ssl::context> tls;     // null: plain TCP
  std::string token;
  NodeIdentity identity;
  transport::ConnectionOptions connection;     // incl. shaping of upstream links
  std::chrono::milliseconds dial_timeout{3000};
  int streams = 4;     // parallel data connections per transfer
  int window = 8;      // piece requests in flight per stream
  std::chrono::milliseconds retry_delay{200};
  std::chrono::milliseconds prefer_retry{5000};  // how often a failed-over node tries the preferred upstream
  std::chrono::milliseconds give_up{30000};      // a fetch with no progress this long fails
  uint64_t max_piece_bytes = 64ull << 20;
  // The most bytes a catalog entry may make this node reserve (its size, or a streaming
  // entry's bound): larger entries are dropped from every catalog received, with an error,
  // before anything is reserved. 0: this machine's physical memory (an artifact is held
  // in memory while it arrives). Applies to signed entries too: on a verifying node a
  // signed size is trusted only once its signature verifies, and never beyond this.
  uint64_t max_artifact_bytes = 0;
};

// This machine's physical memory in bytes.
uint64_t PhysicalMemoryBytes();

// Drops from `catalog` every artifact that would reserve more than `max_bytes` (its size,
// or a streaming entry's bound), with its signature; returns one message per artifact
// dropped.
std::vector<std::string> DropOversized(Catalog* catalog, uint64_t max_bytes);

// An artifact being downloaded: verified pieces survive failed attempts. The bytes never
// move (GrowableBytes), so a streaming artifact grows in place as its catalog entry does.
struct Download {
  ArtifactInfo info;
  std::shared_ptr<GrowableBytes> bytes;  // info.size_bytes long
  std::vector<bool> have;
  uint64_t have_count = 0;
  // Every piece the entry lists is here; complete() when the entry is final too.
  bool all_known() const { return have_count == have.size(); }
  bool complete() const { return all_known() && !info.streaming; }
  // Throws std::bad_alloc when the size (or a streaming entry's bound) cannot be reserved.
  // REQUIRES: the entry passed DropOversized (Upstream::RunControl does it), so that no
  // announcement reserves more than the node's max_artifact_bytes.
  explicit Download(ArtifactInfo artifact);
  std::span<const std::byte> piece(uint32_t index) const;
  // Takes a newer entry of the streaming artifact being downloaded (more pieces, or the
  // finished one): true, and the pieces held are kept, when it lists the same pieces
  // first within the reserved bound; false otherwise (start a new Download).
  bool Extend(const ArtifactInfo& newer);
};

struct FetchCounters {
  uint64_t piece_requests = 0;
  uint64_t pieces_verified = 0;
  uint64_t pieces_rejected = 0;  // checksum mismatch: refetched, never used
  uint64_t piece_bytes = 0;      // payload bytes received
};

class Upstream {
 public:
  Upstream(asio::any_io_executor executor, UpstreamOptions options, LinkRegistry* links);
  ~Upstream();

  // Keeps a control channel open to the most preferred reachable upstream, forever
  // (until Stop): calls on_catalog for every catalog received, sends make_report()
  // every report interval.
  awaitable<void> RunControl(std::function<void(Catalog)> on_catalog,
                             std::function<wire::Report()> make_report);
  // Fetches the pieces `download` lacks (of those its entry lists so far) over parallel
  // streams, verifying each against its
  // hash (a mismatching piece is counted, dropped and requested again). Fails when no
  // upstream made progress for give_up, the upstream does not have the artifact, or Stop.
  // on_piece (optional) is called for every verified piece.
  awaitable<Status> Fetch(Download& download, std::function<void(uint32_t)> on_piece = {});

  // Sends the next report now instead of at the next report interval (a node that just
  // swapped, a relay whose fleet changed), at most one every 50 ms. REQUIRES: on the
  // executor.
  void ReportNow();

  std::string current() const;  // the upstream of the control channel, "" if none
  // Why the last catalog received lost entries (DropOversized), "" if it lost none.
  const std::string& last_catalog_error() const { return last_catalog_error_; }
  const FetchCounters& counters() const { return counters_; }
  bool connected() const { return control_ != nullptr; }
  void Stop();

 private:
  struct FetchState {
    Download* download;
    std::vector<uint32_t>* pending;
    transport::Signal* requeued;
    const std::function<void(uint32_t)>* on_piece;
    std::vector<Status> results;
    int running;
    transport::Signal* finished;
  };
  awaitable<void> StreamTask(std::shared_ptr<FetchState> state, std::shared_ptr<int> stream);
  awaitable<void> ReportLoop(std::shared_ptr<Connection> connection, std::shared_ptr<bool> reporting,
                             std::shared_ptr<size_t> index);
  awaitable<Result<std::shared_ptr<Connection>>> DialAny(wire::Channel channel, size_t* index);
  awaitable<Status> RunStream(int stream, Download& download, std::vector<uint32_t>& pending,
                              transport::Signal& requeued,
                              const std::function<void(uint32_t)>& on_piece);

  asio::any_io_executor executor_;
  UpstreamOptions options_;
  LinkRegistry* links_;
  std::shared_ptr<Connection> control_;
  size_t control_index_ = 0;
  std::vector<std::shared_ptr<Connection>> data_;  // one per stream, reused across fetches
  std::vector<size_t> data_index_;
  FetchCounters counters_;
  std::function<wire::Report()> report_;
  std::weak_ptr<asio::steady_timer> report_timer_;  // the running report loop's sleep
  bool report_now_ = false;
  bool stopped_ = false;
  std::string last_catalog_error_;
  std::set<std::string> logged_oversized_;  // messages of the last catalog, logged once
  std::chrono::steady_clock::time_point last_progress_;
};

}  // namespace flywheel::sync
