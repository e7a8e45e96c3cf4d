// Prometheus text exposition for a role's status document: what every flywheel process
// serves on GET /metrics (publisher, relay, worker, trainer, training service).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace flywheel::ops {

// Every number and boolean at the top level of `status` as a flywheel_<name> metric,
// labelled with the document's role, region and node_id. Known keys have their Prometheus
// name, type (counter or gauge) and help text in one table (ops/metrics.cc); any other key
// follows the same conventions by rule: "_ms" and "_us" become "_seconds" (scaled), a name
// ending in "_total" is a counter. An object in ops::Histogram's form ({"histogram": ...})
// becomes a Prometheus histogram (_bucket with le, _sum, _count). Strings, arrays and other
// objects are left out.
std::string MetricsText(const nlohmann::json& status);

}  // namespace flywheel::ops
