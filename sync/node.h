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
#include "delta/hash.h"
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
  // does not verify or describe it (each refusal is logged and counted once per artifact
  // and signature), keeps the facts of the others, and lowers the head to the newest
  // artifact left (a forged head cannot make a node look stale).
  void Filter(Catalog* catalog, const std::string& who);
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
  std::set<std::pair<ArtifactKey, std::string>> counted_;  // (artifact, signature) refused
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

struct ServerOptions {
  transport::Endpoint listen;
  transport::ListenerOptions listener;
  NodeIdentity identity;
  std::chrono::milliseconds report_timeout{10000};  // a node not reporting is dropped
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
  // Nodes below this one (from their Reports), newest report per node id.
  std::vector<FleetNode> Fleet() const;
  uint64_t pieces_served() const { return pieces_served_; }
  void Stop();

 private:
  Server(ServerOptions options, PieceSource* source, LinkRegistry* links);
  awaitable<void> OnPeer(std::shared_ptr<Connection> connection);
  awaitable<void> ServeControl(std::shared_ptr<Connection> connection);
  awaitable<void> ServeData(std::shared_ptr<Connection> connection);

  ServerOptions options_;
  PieceSource* source_;
  LinkRegistry* links_;
  std::unique_ptr<transport::Listener> listener_;
  wire::Catalog catalog_;
  std::set<std::shared_ptr<Connection>> control_peers_;
  std::map<std::string, FleetNode> fleet_;
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
};

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
  std::chrono::steady_clock::time_point last_progress_;
};

}  // namespace flywheel::sync
