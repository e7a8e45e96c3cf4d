// HOST:PORT endpoints as they appear on the command line, and bearer-token comparison.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace flywheel::transport {

struct Endpoint {
  std::string host;  // a name or an IPv4/IPv6 address, without brackets
  uint16_t port = 0;
  std::string ToString() const {
    return host.find(':') != std::string::npos ? "[" + host + "]:" + std::to_string(port)
                                               : host + ":" + std::to_string(port);
  }
};

// Parses "host:port", "[v6]:port" or ":port" (all interfaces). Port 0 means "any free
// port" when listening.
inline Result<Endpoint> ParseEndpoint(std::string_view text) {
  Endpoint endpoint;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return Status::InvalidArgument("endpoint '" + std::string(text) +
                                     "' is not [IPv6]:PORT");
    }
    endpoint.host = std::string(text.substr(1, close - 1));
    port_text = text.substr(close + 2);
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) {
      return Status::InvalidArgument("endpoint '" + std::string(text) + "' has no ':PORT'");
    }
    endpoint.host = std::string(text.substr(0, colon));
    port_text = text.substr(colon + 1);
  }
  if (endpoint.host.empty()) endpoint.host = "0.0.0.0";
  unsigned port = 0;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port > 65535) {
    return Status::InvalidArgument("endpoint '" + std::string(text) + "' has port '" +
                                   std::string(port_text) + "', expected 0..65535");
  }
  endpoint.port = static_cast<uint16_t>(port);
  return endpoint;
}

// Compares a presented token with the configured one in time that depends only on the
// lengths, so a peer cannot find the token byte by byte from response times.
inline bool TokensEqual(std::string_view presented, std::string_view expected) {
  unsigned char diff = presented.size() == expected.size() ? 0 : 1;
  size_t n = expected.size();
  for (size_t i = 0; i < n; ++i) {
    unsigned char p = i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0;
    diff |= static_cast<unsigned char>(p ^ static_cast<unsigned char>(expected[i]));
  }
  return diff == 0;
}

}  // namespace flywheel::transport
