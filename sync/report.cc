#include "sync/report.h"

#include <cstdint>

namespace flywheel::sync {

void BoundReport(wire::Report* report, size_t max_bytes, size_t max_nodes) {
  if (report->nodes_size() == 0) return;
  // The sender, then the nodes below it while both bounds hold. Each listed node costs its
  // size, a tag byte and a length of at most 5 bytes; omitted_nodes at most 11 bytes.
  size_t bytes = 11 + report->nodes(0).ByteSizeLong() + 6;
  int keep = 1;
  while (keep < report->nodes_size() && static_cast<size_t>(keep) < max_nodes) {
    const size_t node_bytes = report->nodes(keep).ByteSizeLong() + 6;
    if (bytes + node_bytes > max_bytes) break;
    bytes += node_bytes;
    ++keep;
  }
  const int dropped = report->nodes_size() - keep;
  if (dropped == 0) return;
  report->mutable_nodes()->DeleteSubrange(keep, dropped);
  report->set_omitted_nodes(report->omitted_nodes() + static_cast<uint64_t>(dropped));
}

}  // namespace flywheel::sync
