#include "sync/link_registry.h"

#include "sync/identity.h"

namespace flywheel::sync {

void LinkRegistry::Add(std::shared_ptr<Connection> connection, bool upstream) {
  live_[std::move(connection)] = Link{upstream};
}

void LinkRegistry::Remove(const std::shared_ptr<Connection>& connection) {
  auto it = live_.find(connection);
  if (it == live_.end()) return;
  closed_in_ += connection->bytes_in();
  closed_out_ += connection->bytes_out();
  if (connection->shaped()) {
    closed_wan_in_ += connection->bytes_in();
    closed_wan_out_ += connection->bytes_out();
  }
  const bool downstream_control = !it->second.upstream && connection->hello.channel() == wire::CONTROL;
  live_.erase(it);
  if (downstream_control && on_downstream_left_) on_downstream_left_();
}

uint64_t LinkRegistry::bytes_in() const {
  uint64_t total = closed_in_;
  for (const auto& [connection, link] : live_) total += connection->bytes_in();
  return total;
}
uint64_t LinkRegistry::bytes_out() const {
  uint64_t total = closed_out_;
  for (const auto& [connection, link] : live_) total += connection->bytes_out();
  return total;
}
uint64_t LinkRegistry::wan_bytes_in() const {
  uint64_t total = closed_wan_in_;
  for (const auto& [connection, link] : live_) {
    if (connection->shaped()) total += connection->bytes_in();
  }
  return total;
}
uint64_t LinkRegistry::wan_bytes_out() const {
  uint64_t total = closed_wan_out_;
  for (const auto& [connection, link] : live_) {
    if (connection->shaped()) total += connection->bytes_out();
  }
  return total;
}

nlohmann::json LinkRegistry::ToJson() const {
  nlohmann::json links = nlohmann::json::array();
  for (const auto& [connection, link] : live_) {
    const bool upstream = link.upstream;
    const wire::Hello& hello = connection->hello;
    const wire::Welcome& welcome = connection->welcome;
    const bool control = upstream ? false : hello.channel() == wire::CONTROL;
    links.push_back({
        {"peer", connection->peer()},
        {"direction", upstream ? "upstream" : "downstream"},
        {"node_id", upstream ? welcome.node_id() : hello.node_id()},
        {"region", upstream ? welcome.region() : hello.region()},
        {"role", RoleName(upstream ? welcome.role() : hello.role())},
        {"channel", upstream ? "" : (control ? "control" : "data")},
        {"bytes_in", connection->bytes_in()},
        {"bytes_out", connection->bytes_out()},
        {"shaped", connection->shaped()},
    });
  }
  return links;
}

}  // namespace flywheel::sync
