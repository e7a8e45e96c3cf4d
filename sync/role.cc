#include "sync/role.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "base/env.h"

namespace flywheel::sync {

namespace {

std::string Label(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

std::string MetricsText(const nlohmann::json& status) {
  const std::string labels = "{role=\"" + Label(status.value("role", "")) + "\",region=\"" +
                             Label(status.value("region", "")) + "\",node=\"" +
                             Label(status.value("node_id", "")) + "\"}";
  std::string text;
  for (const auto& [key, value] : status.items()) {
    double number = 0;
    if (value.is_boolean()) {
      number = value.get<bool>() ? 1 : 0;
    } else if (value.is_number()) {
      number = value.get<double>();
    } else {
      continue;
    }
    const std::string name = "flywheel_" + key;
    const bool counter = key.starts_with("bytes_") || key.starts_with("wan_bytes_") ||
                         key.starts_with("pieces_") || key.ends_with("_total");
    text += "# TYPE " + name + (counter ? " counter\n" : " gauge\n");
    char number_text[64];
    std::snprintf(number_text, sizeof number_text, "%.17g", number);
    text += name + labels + " " + number_text + "\n";
  }
  return text;
}

Result<std::unique_ptr<transport::HttpServer>> StartStatusServer(
    asio::any_io_executor executor, const CommonOptions& options,
    std::shared_ptr<asio::ssl::context> tls, std::function<nlohmann::json()> status,
    std::string write_token) {
  transport::HttpServerOptions http_options;
  http_options.token = options.token;
  http_options.write_token = std::move(write_token);
  http_options.tls = std::move(tls);
  FW_ASSIGN_OR_RETURN(auto server,
                      transport::HttpServer::Start(executor, options.http, http_options));
  server->Route(
      "/healthz",
      [](const std::string&) {
        return transport::HttpResponse{200, "text/plain", "ok\n"};
      },
      /*is_public=*/true);
  server->Route("/v1/status", [status](const std::string&) {
    return transport::HttpResponse{200, "application/json", status().dump(2) + "\n"};
  });
  server->Route("/metrics", [status](const std::string&) {
    return transport::HttpResponse{200, "text/plain; version=0.0.4", MetricsText(status())};
  });
  return server;
}

Status WriteReadyFile(const std::string& path, const nlohmann::json& document) {
  const std::string temp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(temp, std::ios::trunc);
    out << document.dump() << "\n";
    out.close();
    if (!out) return Status::IOError("cannot write ready file " + temp);
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    std::remove(temp.c_str());
    return Status::IOError("cannot rename " + temp + " to " + path);
  }
  return Status::Ok();
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
  return server;
}

uint64_t UnixMicrosNow() {
  return static_cast<uint64_t>(Env::Default()->NowMicros());
}

}  // namespace flywheel::sync
