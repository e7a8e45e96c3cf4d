// What the sync roles (publish, relay, worker) share besides their data plane: the flags'
// options, the HTTP endpoints (/v1/status JSON, /metrics, /healthz), TLS contexts built
// from the flags, and how a role's options become its server and upstream options. The
// process plumbing every flywheel process shares lives in ops/: the Prometheus text
// (ops/metrics.h) and the --ready-file (ops/ready_file.h); the wall clock is base/env.h's.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "sync/identity.h"
#include "sync/server.h"
#include "sync/upstream.h"
#include "transport/connection.h"
#include "transport/http.h"
#include "transport/tls.h"

namespace flywheel::sync {

namespace asio = transport::asio;
using transport::awaitable;

struct CommonOptions {
  std::string region;
  std::string node_id;          // empty: DefaultNodeId
  transport::Endpoint http;     // port 0: any free port
  std::string token;            // empty: no authentication
  // --scoped-token-file: further HTTP tokens with their own scopes (transport/http.h).
  std::vector<transport::ScopedToken> scoped_tokens;
  transport::TlsOptions tls;    // none: plain TCP and HTTP
  std::string ready_file;       // empty: none
  double wan_rate = 0;          // bytes/s on WAN links, 0: unlimited
  double wan_latency_ms = 0;    // added one-way latency on WAN links
  int threads = 1;              // CPU threads (hashing, encoding, applying)
  transport::ConnectionOptions connection;
  // --trust-key (relays and workers): public keys (sync/signing.h). Non-empty: only
  // versions signed by one of them are cached, forwarded or applied.
  std::vector<std::string> trust_keys;
  // Relays and workers: the largest artifact a catalog may announce (UpstreamOptions::
  // max_artifact_bytes); 0: this machine's physical memory.
  uint64_t max_artifact_bytes = 0;
  // Publishers and relays (--egress-threads): the pool their downstream connections run on
  // (ListenerOptions::egress: TLS sealing and socket writes on many cores). Null: the
  // network thread's executor, as for a worker.
  asio::any_io_executor egress;
  bool wan_shaped() const { return wan_rate > 0 || wan_latency_ms > 0; }
};

// The HTTP side of a role: /healthz (public), /v1/status (status() as JSON) and /metrics
// (ops::MetricsText of status()). `write_token` is HttpServerOptions::write_token
// (the publisher's push token; empty elsewhere).
Result<std::unique_ptr<transport::HttpServer>> StartStatusServer(
    asio::any_io_executor executor, const CommonOptions& options,
    std::shared_ptr<asio::ssl::context> tls, std::function<nlohmann::json()> status,
    std::string write_token = {});

// Runs the control channel upstream of a relay or worker (`owner`, kept alive meanwhile):
// catalogs go to owner->OnCatalog, the reports sent up come from owner->MakeReport().
template <typename Owner>
void SpawnControlChannel(asio::any_io_executor executor, std::shared_ptr<Owner> owner) {
  asio::co_spawn(
      executor,
      [owner]() -> awaitable<void> {
        std::function<void(Catalog)> on_catalog = [raw = owner.get()](Catalog catalog) {
          raw->OnCatalog(std::move(catalog));
        };
        std::function<wire::Report()> make_report = [raw = owner.get()] { return raw->MakeReport(); };
        co_await owner->upstream->RunControl(on_catalog, make_report);
      },
      asio::detached);
}

// Writes the role's --ready-file (ops::WriteReadyFile) when the flags name one: its HTTP
// endpoint, its node id and, for a role that serves peers (publisher, relay), the endpoint
// it listens on.
Status WriteRoleReadyFile(const CommonOptions& common, const NodeIdentity& identity,
                          uint16_t http_port, std::optional<transport::Endpoint> listen);

// Server and client TLS contexts from the flags; both null when TLS is off.
struct TlsContexts {
  std::shared_ptr<asio::ssl::context> server;
  std::shared_ptr<asio::ssl::context> client;
};
Result<TlsContexts> MakeTlsContexts(const transport::TlsOptions& tls, bool need_server,
                                    bool need_client);

// Who this node is: its role, the flags' region and node id (or DefaultNodeId).
NodeIdentity MakeIdentity(wire::Role role, const CommonOptions& common);

// How a relay or worker reaches upstream: `endpoints` in order of preference, the flags'
// token and connection options (links shaped as WAN when the flags say so), the client
// TLS context, and `streams` x `window` piece requests in flight.
UpstreamOptions MakeUpstreamOptions(const CommonOptions& common,
                                    std::vector<transport::Endpoint> endpoints,
                                    std::shared_ptr<asio::ssl::context> tls,
                                    NodeIdentity identity, int streams, int window);

// The serving side of a publisher or relay: where it listens, who it is, the server TLS
// context and the flags' token and connection options.
ServerOptions MakeServerOptions(const CommonOptions& common, transport::Endpoint listen,
                                NodeIdentity identity, std::shared_ptr<asio::ssl::context> tls);

}  // namespace flywheel::sync
