#include "sync/identity.h"

#include <unistd.h>

#include <cstring>

namespace flywheel::sync {

const char* RoleName(wire::Role role) {
  switch (role) {
    case wire::PUBLISHER:
      return "publisher";
    case wire::RELAY:
      return "relay";
    case wire::WORKER:
      return "worker";
    case wire::CLIENT:
      return "client";
    default:
      return "unknown";
  }
}

std::string DefaultNodeId(wire::Role role, const std::string& region) {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "host");
  return std::string(RoleName(role)) + "-" + region + "-" + host + "-" + std::to_string(getpid());
}

}  // namespace flywheel::sync
