// `flywheel relay`: one per region. Subscribes upstream once (failover between upstreams in
// order of preference), re-announces the upstream's catalog to the nodes of its region and
// serves them from its cache, so cross-region bytes are paid once per region.
//
// Deltas are fetched as soon as they are announced; keyframes only when a node asks for
// one (a joining worker, or one that fell behind past retention); once a keyframe is cached
// whole the older ones' bytes are released (fetched again only if asked for), so a
// publisher that keeps a keyframe at the head does not grow the relay by one keyframe per
// version. Pieces are served as they
// arrive (cut-through): a worker does not wait for the relay to hold a whole artifact.
// Every piece is verified against the catalog's hash before it is cached or served.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <vector>

#include "base/status.h"
#include "sync/role.h"
#include "transport/endpoint.h"

namespace flywheel::sync {

struct RelayOptions {
  CommonOptions common;  // --wan-rate/--wan-latency-ms shape the upstream links
  transport::Endpoint listen;
  std::vector<transport::Endpoint> upstreams;  // in order of preference
  int streams = 4;
  int window = 8;
};

class Relay {
 public:
  static Result<std::unique_ptr<Relay>> Start(asio::any_io_executor executor, RelayOptions options);
  ~Relay();
  void Stop();  // thread-safe
  uint16_t port() const;
  uint16_t http_port() const;
  nlohmann::json StatusJson() const;  // call on the executor's thread

  struct Impl;

 private:
  explicit Relay(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace flywheel::sync
