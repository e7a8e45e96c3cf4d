// The connections of one node (upstream and downstream) and the bytes they carried,
// closed ones included, for /v1/status and /metrics. Network-thread state; not thread-safe.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>

#include "transport/connection.h"

namespace flywheel::sync {

using transport::Connection;

class LinkRegistry {
 public:
  void Add(std::shared_ptr<Connection> connection, bool upstream);
  void Remove(const std::shared_ptr<Connection>& connection);
  uint64_t bytes_in() const;
  uint64_t bytes_out() const;
  uint64_t wan_bytes_in() const;  // on shaped links
  uint64_t wan_bytes_out() const;
  nlohmann::json ToJson() const;  // the live links
 private:
  struct Link {
    bool upstream = false;
  };
  std::map<std::shared_ptr<Connection>, Link> live_;
  uint64_t closed_in_ = 0, closed_out_ = 0, closed_wan_in_ = 0, closed_wan_out_ = 0;
};

}  // namespace flywheel::sync
