#include "sync/role.h"

#include "ops/metrics.h"
#include "ops/ready_file.h"
#include "transport/api.h"

namespace flywheel::sync {

Result<std::unique_ptr<transport::HttpServer>> StartStatusServer(
    asio::any_io_executor executor, const CommonOptions& options,
    std::shared_ptr<asio::ssl::context> tls, std::function<nlohmann::json()> status,
    std::string write_token) {
  transport::HttpServerOptions http_options;
  http_options.token = options.token;
  http_options.write_token = std::move(write_token);
  http_options.scoped_tokens = options.scoped_tokens;
  http_options.tls = std::move(tls);
  FW_ASSIGN_OR_RETURN(auto server,
                      transport::HttpServer::Start(executor, options.http, http_options));
  transport::AddStatusRoutes(*server, std::move(status), ops::MetricsText);
  return server;
}

Status WriteRoleReadyFile(const CommonOptions& common, const NodeIdentity& identity,
                          uint16_t http_port, std::optional<transport::Endpoint> listen) {
  if (common.ready_file.empty()) return Status::Ok();
  nlohmann::json ready = {{"http", transport::Endpoint{common.http.host, http_port}.ToString()},
                          {"node_id", identity.node_id}};
  if (listen) ready["listen"] = listen->ToString();
  return ops::WriteReadyFile(common.ready_file, ready);
}

Result<TlsContexts> MakeTlsContexts(const transport::TlsOptions& tls, bool need_server,
                                    bool need_client) {
  TlsContexts contexts;
  if (!tls.enabled()) return contexts;
  if (need_server) {
    FW_ASSIGN_OR_RETURN(contexts.server, transport::MakeServerTlsContext(tls));
  }
  if (need_client) {
    FW_ASSIGN_OR_RETURN(contexts.client, transport::MakeClientTlsContext(tls));
  }
  return contexts;
}

NodeIdentity MakeIdentity(wire::Role role, const CommonOptions& common) {
  return {role, common.region,
          common.node_id.empty() ? DefaultNodeId(role, common.region) : common.node_id};
}

UpstreamOptions MakeUpstreamOptions(const CommonOptions& common,
                                    std::vector<transport::Endpoint> endpoints,
                                    std::shared_ptr<asio::ssl::context> tls,
                                    NodeIdentity identity, int streams, int window) {
  UpstreamOptions upstream;
  upstream.endpoints = std::move(endpoints);
  upstream.tls = std::move(tls);
  upstream.token = common.token;
  upstream.identity = std::move(identity);
  upstream.connection = common.connection;
  if (common.wan_shaped()) {
    upstream.connection.shaping = transport::MakeLinkShaping(common.wan_rate, common.wan_latency_ms);
  }
  upstream.streams = streams;
  upstream.window = window;
  upstream.max_artifact_bytes = common.max_artifact_bytes;
  return upstream;
}

ServerOptions MakeServerOptions(const CommonOptions& common, transport::Endpoint listen,
                                NodeIdentity identity, std::shared_ptr<asio::ssl::context> tls) {
  ServerOptions server;
  server.listen = std::move(listen);
  server.identity = std::move(identity);
  server.listener.tls = std::move(tls);
  server.listener.token = common.token;
  server.listener.connection = common.connection;
  server.listener.egress = common.egress;
  return server;
}

}  // namespace flywheel::sync
