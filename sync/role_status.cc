#include "sync/role_status.h"

#include <sys/resource.h>

namespace flywheel::sync {
namespace {

using nlohmann::json;

// This process's peak resident memory (what `flywheel plan` is checked against).
uint64_t PeakRssBytes() {
  struct rusage usage {};
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;
}

json Common(const RoleStatus& s) {
  return {
      {"role", s.role},
      {"region", s.region},
      {"node_id", s.node_id},
      {"version", s.version},
      {"weights_hash", s.weights_hash},
      {"head_version", s.head_version},
      {"staleness", s.staleness},
      {"max_staleness", s.max_staleness},
      {"upstream", s.upstream},
      {"bytes_in", s.traffic.bytes_in},
      {"bytes_out", s.traffic.bytes_out},
      {"wan_bytes_in", s.traffic.wan_bytes_in},
      {"wan_bytes_out", s.traffic.wan_bytes_out},
      {"links", s.traffic.links},
      {"last_swap_ms", s.last_swap_ms},
      {"swap_unix_us", s.swap_unix_us},
      {"peak_rss_bytes", PeakRssBytes()},
  };
}

json Nodes(const std::vector<FleetNodeStatus>& nodes) {
  json out = json::array();
  for (const FleetNodeStatus& n : nodes) {
    json node = {{"node_id", n.node_id}, {"region", n.region}, {"role", n.role}, {"version", n.version}};
    if (n.detailed) {
      node["staleness"] = n.staleness;
      node["upstream"] = n.upstream;
      node["via"] = n.via;
    }
    out.push_back(std::move(node));
  }
  return out;
}

void AddFetch(json& out, const FetchCounters& fetch) {
  out["piece_requests"] = fetch.piece_requests;
  out["pieces_verified"] = fetch.pieces_verified;
  out["pieces_rejected"] = fetch.pieces_rejected;
  out["piece_bytes"] = fetch.piece_bytes;
}

void AddSignatures(json& out, const SignatureStatus& s) {
  out["trusted_keys"] = s.trusted_keys;
  out["signature_failures_total"] = s.signature_failures;
  out["replays_refused_total"] = s.replays_refused;
  out["last_signature_error"] = s.last_signature_error;
  out["run_id"] = s.run_id;
}

}  // namespace

LinkTraffic LinkTraffic::Of(const LinkRegistry& links) {
  return {links.bytes_in(), links.bytes_out(), links.wan_bytes_in(), links.wan_bytes_out(),
          links.ToJson()};
}

json ToJson(const PublisherStatus& s) {
  json out = Common(s.common);
  json rejected = json::array();
  for (const auto& [version, reason] : s.rejected_drops) {
    rejected.push_back({{"version", version}, {"reason", reason}});
  }
  out["last_version"] = s.last_version;
  out["nodes"] = Nodes(s.nodes);
  out["artifacts_retained"] = s.artifacts_retained;
  out["log_bytes"] = s.log_bytes;
  out["join_bytes"] = s.join_bytes;
  out["last_publish_ms"] = s.last_publish_ms;
  out["last_first_piece_ms"] = s.last_first_piece_ms;
  out["last_encode_done_unix_us"] = s.last_encode_done_unix_us;
  out["streaming_version"] = s.streaming_version;
  out["streaming_pieces"] = s.streaming_pieces;
  out["last_artifact_bytes"] = s.last_artifact_bytes;
  out["published_total"] = s.published_total;
  out["drops_rejected"] = s.rejected_drops.size();
  out["rejected_drops"] = std::move(rejected);
  out["pieces_served"] = s.pieces_served;
  out["signing_key_id"] = s.signing_key_id;
  out["run_id"] = s.run_id;
  out["last_sign_ms"] = s.last_sign_ms;
  out["last_error"] = s.last_error;
  return out;
}

json ToJson(const RelayStatus& s) {
  json out = Common(s.common);
  json artifacts = json::array();
  for (const CachedArtifactStatus& a : s.artifacts) {
    artifacts.push_back({{"artifact", a.artifact}, {"pieces", a.pieces}, {"cached_pieces", a.cached_pieces}});
  }
  out["connected"] = s.connected;
  out["cache_bytes"] = s.cache_bytes;
  out["artifacts"] = std::move(artifacts);
  out["nodes"] = Nodes(s.nodes);
  AddFetch(out, s.fetch);
  out["pieces_served"] = s.pieces_served;
  out["fetch_failures"] = s.fetch_failures;
  AddSignatures(out, s.signatures);
  return out;
}

json ToJson(const WorkerStatus& s) {
  json out = Common(s.common);
  out["state"] = s.leaving ? "leaving" : (s.common.version == 0 ? "joining" : "serving");
  out["leaving"] = s.leaving;
  out["stale"] = s.stale;
  out["connected"] = s.connected;
  out["last_apply_ms"] = s.last_apply_ms;
  out["last_apply_chunks_early"] = s.last_apply_chunks_early;
  out["last_early_decode_unix_us"] = s.last_early_decode_unix_us;
  out["arriving_chunks_decoded"] = s.arriving_chunks_decoded;
  out["last_swap_pause_ms"] = s.last_swap_pause_ms;
  out["swaps_total"] = s.swaps_total;
  out["exports_total"] = s.exports_total;
  AddFetch(out, s.fetch);
  out["artifacts_rejected"] = s.artifacts_rejected;
  out["swaps_refused"] = s.swaps_refused;
  out["older_heads_ignored"] = s.older_heads_ignored;
  out["export_failures_total"] = s.export_failures;
  out["last_error"] = s.last_error;
  AddSignatures(out, s.signatures);
  return out;
}

}  // namespace flywheel::sync
