#include "ops/metrics.h"

#include <cstdio>
#include <string>

namespace flywheel::ops {

namespace {

// How a /v1/status key becomes a Prometheus metric: its name (flywheel_ prefix added),
// whether it is a counter, its help text, and the factor to base units (seconds).
struct MetricSpec {
  const char* key;
  const char* name;
  bool counter;
  const char* help;
  double scale = 1;
};

// Every number the roles report (sync/role_status.h, rl::TrainerStatus). Names follow the
// Prometheus conventions: counters end in _total, units are suffixes in base units.
const MetricSpec kMetrics[] = {
    {"version", "version", false, "Version served (publisher: its head)"},
    {"head_version", "head_version", false, "Newest version announced upstream"},
    {"staleness", "staleness_versions", false, "Versions behind the head"},
    {"max_staleness", "max_staleness_versions", false, "Staleness bound announced (0: none)"},
    {"bytes_in", "received_bytes_total", true, "Bytes received on all links"},
    {"bytes_out", "sent_bytes_total", true, "Bytes sent on all links"},
    {"wan_bytes_in", "wan_received_bytes_total", true, "Bytes received on shaped (WAN) links"},
    {"wan_bytes_out", "wan_sent_bytes_total", true, "Bytes sent on shaped (WAN) links"},
    {"last_swap_ms", "last_swap_seconds", false, "Head announced to new version served, last swap", 1e-3},
    {"swap_unix_us", "swap_timestamp_seconds", false, "When the served version began serving (Unix time)", 1e-6},
    {"last_version", "last_version", false, "Highest version ever published"},
    {"artifacts_retained", "artifacts_retained", false, "Artifacts in the version log"},
    {"log_bytes", "log_bytes", false, "Bytes of the artifacts in the version log"},
    {"join_bytes", "join_bytes", false, "Bytes a worker joining at the head fetches (keyframe + deltas)"},
    {"last_publish_ms", "last_publish_seconds", false, "Time to validate, encode and write the last version", 1e-3},
    {"last_first_piece_ms", "last_first_piece_seconds", false, "Time to the first servable piece of the last delta (streamed encode)", 1e-3},
    {"streaming_version", "streaming_version", false, "Version being encoded and streamed now (0: none)"},
    {"last_artifact_bytes", "last_artifact_bytes", false, "Bytes of the last version's artifacts"},
    {"published_total", "published_total", true, "Versions published"},
    {"drops_rejected", "drops_rejected_total", true, "Drops rejected (malformed or replayed)"},
    {"pieces_served", "pieces_served_total", true, "Pieces served to downstream nodes"},
    {"last_sign_ms", "last_sign_seconds", false, "Time to hash and sign the last version's artifacts", 1e-3},
    {"connected", "connected", false, "1 if the control channel upstream is up"},
    {"cache_bytes", "cache_bytes", false, "Bytes of artifacts cached"},
    {"piece_requests", "piece_requests_total", true, "Pieces requested upstream"},
    {"pieces_verified", "pieces_verified_total", true, "Pieces received that matched their hash"},
    {"pieces_rejected", "pieces_rejected_total", true, "Pieces received that did not match their hash (refetched)"},
    {"piece_bytes", "piece_received_bytes_total", true, "Piece payload bytes received"},
    {"fetch_failures", "fetch_failures_total", true, "Artifact fetches that failed"},
    {"stale", "stale", false, "1 if further behind the head than max_staleness"},
    {"last_apply_ms", "last_apply_seconds", false, "Time to apply and verify the last artifact", 1e-3},
    {"last_apply_chunks_early", "last_apply_chunks_early", false, "Chunks of the last delta decoded while it was still arriving"},
    {"arriving_chunks_decoded", "arriving_chunks_decoded", false, "Chunks of the delta arriving now decoded so far"},
    {"last_swap_pause_ms", "last_swap_pause_seconds", false, "Time the serving engine paused for the last swap", 1e-3},
    {"swaps_total", "swaps_total", true, "Versions swapped in"},
    {"exports_total", "exports_total", true, "Versions exported to --export-dir"},
    {"export_failures_total", "export_failures_total", true, "Exports to --export-dir that failed"},
    {"artifacts_rejected", "artifacts_rejected_total", true, "Artifacts that did not apply (wrong base, corrupt)"},
    {"swaps_refused", "swaps_refused_total", true, "Versions the serving engine refused"},
    {"engine_running", "engine_running_requests", false, "Requests the rollout engine is decoding"},
    {"engine_waiting", "engine_waiting_requests", false, "Requests queued for a cache slot"},
    {"kv_cache_bytes", "kv_cache_bytes", false, "Bytes of the engine's KV cache (request and prefix slots)"},
    {"prefix_cache_hits_total", "prefix_cache_hits_total", true, "Prompts that reused a cached prefix"},
    {"prefix_tokens_reused_total", "prefix_tokens_reused_total", true, "Prompt tokens copied from a cached prefix instead of prefilled"},
    {"prefill_tokens_total", "prefill_tokens_total", true, "Prompt tokens prefilled"},
    {"prefix_cache_entries", "prefix_cache_entries", false, "Prefix slots holding a usable prefix"},
    {"prefix_cache_slots", "prefix_cache_slots", false, "Prefix slots"},
    {"kv_cache_usage", "kv_cache_usage_ratio", false, "Share of the engine's request slots in use"},
    {"request_queue_time", "request_queue_time_seconds", false, "From a request's arrival at the engine to its prefill"},
    {"time_to_first_token", "time_to_first_token_seconds", false, "From a request's arrival at the engine to its first token"},
    {"inter_token_latency", "inter_token_latency_seconds", false, "Between two tokens of a request"},
    {"e2e_request_latency", "e2e_request_latency_seconds", false, "From a request's arrival at the engine to its last token"},
    {"older_heads_ignored", "older_heads_ignored_total", true, "Catalogs announcing an older head than served"},
    {"trusted_keys", "trusted_keys", false, "Publisher keys trusted (0: signatures not checked)"},
    {"signature_failures_total", "signature_failures_total", true, "Artifacts refused: unsigned, wrongly signed or forged"},
    {"replays_refused_total", "replays_refused_total", true, "Validly signed versions refused as replays"},
    // The trainer (rl::TrainerStatus).
    {"step", "step", false, "Optimizer steps taken"},
    {"accuracy", "accuracy_ratio", false, "Held-out accuracy at the last evaluation"},
    {"mean_reward", "mean_reward", false, "Mean reward of the last step's samples"},
    {"resumed", "resumed", false, "1 if this run resumed from saved state"},
    {"claims", "claims_total", true, "Groups handed out to workers"},
    {"groups_accepted", "groups_accepted_total", true, "Groups submitted and queued"},
    {"groups_trained", "groups_trained_total", true, "Groups taken into training batches"},
    {"samples_dropped_stale", "samples_dropped_stale_total", true, "Samples dropped as too stale"},
    {"leases_expired", "leases_expired_total", true, "Claims whose lease lapsed"},
    {"submissions_refused", "submissions_refused_total", true, "Late, repeated or malformed submissions"},
    {"queued_groups", "queued_groups", false, "Groups waiting to be trained"},
};

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

// A status key with no entry above: the same conventions by rule.
MetricSpec SpecByRule(const std::string& key, std::string* name, std::string* help) {
  MetricSpec spec{key.c_str(), nullptr, false, nullptr};
  std::string base = key;
  if (base.ends_with("_ms")) {
    base = base.substr(0, base.size() - 3) + "_seconds";
    spec.scale = 1e-3;
  } else if (base.ends_with("_us")) {
    base = base.substr(0, base.size() - 3) + "_seconds";
    spec.scale = 1e-6;
  }
  spec.counter = base.ends_with("_total");
  *name = base;
  *help = key + " from /v1/status";
  return spec;
}

// `value` in ops::Histogram's form as a Prometheus histogram named `name`.
std::string HistogramText(const std::string& name, const std::string& help,
                          const std::string& labels, const nlohmann::json& value) {
  const nlohmann::json& h = value["histogram"];
  if (!h.is_object() || !h["le"].is_array() || !h["buckets"].is_array() ||
      h["le"].size() != h["buckets"].size()) {
    return {};
  }
  // `labels` is {a="..",b=".."}: `le` goes inside its braces.
  const std::string open = labels.substr(0, labels.size() - 1) + ",le=\"";
  std::string text = "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  char number[64];
  for (size_t i = 0; i < h["le"].size(); ++i) {
    std::snprintf(number, sizeof number, "%.17g", h["le"][i].get<double>());
    text += name + "_bucket" + open + number + "\"} " +
            std::to_string(h["buckets"][i].get<uint64_t>()) + "\n";
  }
  const uint64_t count = h.value("count", uint64_t{0});
  text += name + "_bucket" + open + "+Inf\"} " + std::to_string(count) + "\n";
  std::snprintf(number, sizeof number, "%.17g", h.value("sum", 0.0));
  text += name + "_sum" + labels + " " + number + "\n";
  text += name + "_count" + labels + " " + std::to_string(count) + "\n";
  return text;
}

}  // namespace

std::string MetricsText(const nlohmann::json& status) {
  const std::string labels = "{role=\"" + Label(status.value("role", "")) + "\",region=\"" +
                             Label(status.value("region", "")) + "\",node=\"" +
                             Label(status.value("node_id", "")) + "\"}";
  std::string text;
  for (const auto& [key, value] : status.items()) {
    if (value.is_object() && value.contains("histogram")) {
      std::string name = key, help = key + " from /v1/status";
      for (const MetricSpec& candidate : kMetrics) {
        if (key == candidate.key) {
          name = candidate.name;
          help = candidate.help;
        }
      }
      text += HistogramText("flywheel_" + name, help, labels, value);
      continue;
    }
    double number = 0;
    if (value.is_boolean()) {
      number = value.get<bool>() ? 1 : 0;
    } else if (value.is_number()) {
      number = value.get<double>();
    } else {
      continue;
    }
    std::string suffix, help;
    MetricSpec spec{};
    const MetricSpec* known = nullptr;
    for (const MetricSpec& candidate : kMetrics) {
      if (key == candidate.key) known = &candidate;
    }
    if (known != nullptr) {
      spec = *known;
      suffix = spec.name;
      help = spec.help;
    } else {
      spec = SpecByRule(key, &suffix, &help);
    }
    const std::string name = "flywheel_" + suffix;
    text += "# HELP " + name + " " + help + "\n";
    text += "# TYPE " + name + (spec.counter ? " counter\n" : " gauge\n");
    char number_text[64];
    std::snprintf(number_text, sizeof number_text, "%.17g", number * spec.scale);
    text += name + labels + " " + number_text + "\n";
  }
  return text;
}

}  // namespace flywheel::ops
