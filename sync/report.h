// What a node's Report (its own state and that of the nodes below it, sent up its control
// channel every second) may hold, and how a sender keeps it within bounds.
#pragma once

#include <cstddef>

#include "transport/flywheel.pb.h"

namespace flywheel::sync {

// What a node may put in one NodeState of a Report: longer ids, regions or upstreams and
// hashes other than 16 bytes are refused.
inline constexpr size_t kMaxNodeIdBytes = 256;
inline constexpr size_t kMaxNodeUpstreamBytes = 512;
// The most nodes a Report lists, its sender included (the rest are counted, not listed):
// what ServerOptions::max_fleet_nodes_per_peer takes by default.
inline constexpr size_t kMaxReportNodes = 2048;

// Bounds `report` (the sender first, then the nodes below it) so that it lists at most
// `max_nodes` nodes, the sender included, and serializes to at most `max_bytes`: nodes past
// either bound are dropped from the end and added to omitted_nodes. The sender is always
// kept (a NodeState within the limits above is far below any sane `max_bytes`).
void BoundReport(wire::Report* report, size_t max_bytes, size_t max_nodes = kMaxReportNodes);

}  // namespace flywheel::sync
