// Length-prefixed frames: the unit of the data plane.
//
// A frame is a 16-byte prefix, one serialized wire::Header, then the payload:
//
//   u32 magic "FWF1" (little-endian 0x31465746) | u32 header_bytes | u64 payload_bytes
//   header_bytes bytes of wire::Header (protobuf) | payload_bytes raw bytes
//
// Bulk bytes (artifact pieces) travel in the payload, never inside protobuf. Both lengths
// are checked against FrameLimits before anything is allocated, so a peer cannot make a
// reader allocate more than the limits allow; the header's payload_bytes must repeat the
// prefix's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "transport/flywheel.pb.h"

namespace flywheel::transport {

inline constexpr uint32_t kFrameMagic = 0x31465746;  // "FWF1" read as little-endian u32
inline constexpr size_t kFramePrefixBytes = 16;
inline constexpr uint32_t kProtocolVersion = 1;

struct FrameLimits {
  uint32_t max_header_bytes = 1u << 20;
  uint64_t max_payload_bytes = 64ull << 20;
};

struct FramePrefix {
  uint32_t header_bytes = 0;
  uint64_t payload_bytes = 0;
};

// A received or outgoing frame. The payload is shared so that a relay can send the same
// cached piece to many peers without copying it.
struct Frame {
  wire::Header header;
  std::shared_ptr<const void> payload_owner;  // keeps `payload` alive
  std::span<const std::byte> payload;

  size_t wire_bytes() const;  // prefix + header + payload
};

// A frame with `header` and a payload that `owner` keeps alive.
Frame MakeFrame(wire::Header header, std::shared_ptr<const void> owner = {},
                std::span<const std::byte> payload = {});

// Prefix and header bytes of `frame` (the payload follows them on the wire).
// Sets header.payload_bytes from the payload.
std::vector<std::byte> EncodeFrameHead(Frame& frame);

// Whole frame bytes (tests and tools).
std::vector<std::byte> EncodeFrame(const wire::Header& header,
                                   std::span<const std::byte> payload = {});

// Checks the prefix; errors name `peer` and say what was wrong (bad magic: not a flywheel
// peer or a TLS/plain mismatch; a length over the limit).
Result<FramePrefix> ParseFramePrefix(std::span<const std::byte, kFramePrefixBytes> prefix,
                                     const FrameLimits& limits, const std::string& peer);

// Parses the header bytes and checks that it repeats the prefix's payload length.
Result<wire::Header> ParseFrameHeader(std::span<const std::byte> bytes,
                                      const FramePrefix& prefix, const std::string& peer);

// "piece", "catalog", ...: the header's body, for messages.
const char* FrameKindName(const wire::Header& header);

}  // namespace flywheel::transport
