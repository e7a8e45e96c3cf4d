// The subscribing side of replication (a relay's or worker's): a control channel with
// failover between upstreams, and parallel data streams that fetch an artifact piece by
// piece, verify every piece and resume after a broken connection from the pieces already
// verified.
//
// Every coroutine here runs on one executor (a process's network thread); CPU work
// (hashing, applying, encoding) runs elsewhere.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "base/growable_bytes.h"
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
  // The steps of RunStream (upstream.cc), on one stream's StreamRun.
  struct StreamRun;
  // Redials the stream after its connection closed: true once connected; false when
  // nothing is left for it, or no upstream answered (after retry_delay).
  awaitable<bool> Redial(StreamRun& run);
  // Asks for pending pieces until `window` requests are in flight on `connection`.
  awaitable<Status> FillWindow(StreamRun& run, Connection& connection);
  // Takes one answer: a piece, or the upstream's refusal to serve it (asked for again
  // elsewhere). A frame not asked for closes the connection. An error (NotFound) only
  // when the upstream refused three times in a row.
  Status TakeAnswer(StreamRun& run, Connection& connection, const transport::Frame& frame);
  // Verifies a received piece against its hash and keeps it, or asks for it again.
  void StorePiece(StreamRun& run, const Connection& connection, uint32_t index,
                  std::span<const std::byte> payload);

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
