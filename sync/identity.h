// Who a node is (role, region, id), as it says in its Hello and Reports.
#pragma once

#include <string>

#include "transport/flywheel.pb.h"

namespace flywheel::sync {

struct NodeIdentity {
  wire::Role role = wire::WORKER;
  std::string region;
  std::string node_id;
};
const char* RoleName(wire::Role role);
// "<role>-<region>-<hostname>-<pid>"
std::string DefaultNodeId(wire::Role role, const std::string& region);

}  // namespace flywheel::sync
