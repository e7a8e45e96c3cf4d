// The connections of one node (upstream and downstream) and the bytes they carried,
// closed ones included, for /v1/status and /metrics. Network-thread state; not thread-safe.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "transport/connection.h"

namespace flywheel::sync {

using transport::Connection;

class LinkRegistry {
 public:
  void Add(std::shared_ptr<Connection> connection, bool upstream);
  // A downstream control connection removed here means its node left (a clean leave
  // closes it after its last frame; a killed process's socket is closed by the kernel):
  // `on_downstream_left` runs then, on the caller's thread, after the Server forgot the
  // node. A relay uses it to tell its own upstream at once rather than at its next report.
  void Remove(const std::shared_ptr<Connection>& connection);
  void set_on_downstream_left(std::function<void()> on_downstream_left) {
    on_downstream_left_ = std::move(on_downstream_left);
  }
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
  std::function<void()> on_downstream_left_;
  uint64_t closed_in_ = 0, closed_out_ = 0, closed_wan_in_ = 0, closed_wan_out_ = 0;
};

}  // namespace flywheel::sync
