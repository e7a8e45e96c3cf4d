#include "transport/frame.h"

#include <cstring>

namespace flywheel::transport {
namespace {

void PutU32(std::byte* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<std::byte>(value >> (8 * i));
}
void PutU64(std::byte* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>(value >> (8 * i));
}
uint64_t GetLE(const std::byte* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(in[i]) << (8 * i);
  return value;
}

}  // namespace

size_t Frame::wire_bytes() const {
  return kFramePrefixBytes + header.ByteSizeLong() + payload.size();
}

Frame MakeFrame(wire::Header header, std::shared_ptr<const void> owner,
                std::span<const std::byte> payload) {
  Frame frame;
  frame.header = std::move(header);
  frame.payload_owner = std::move(owner);
  frame.payload = payload;
  frame.header.set_payload_bytes(payload.size());
  return frame;
}

std::vector<std::byte> EncodeFrameHead(Frame& frame) {
  frame.header.set_payload_bytes(frame.payload.size());
  const size_t header_bytes = frame.header.ByteSizeLong();
  std::vector<std::byte> head(kFramePrefixBytes + header_bytes);
  PutU32(head.data(), kFrameMagic);
  PutU32(head.data() + 4, static_cast<uint32_t>(header_bytes));
  PutU64(head.data() + 8, frame.payload.size());
  frame.header.SerializeWithCachedSizesToArray(
      reinterpret_cast<uint8_t*>(head.data() + kFramePrefixBytes));
  return head;
}

std::vector<std::byte> EncodeFrame(const wire::Header& header, std::span<const std::byte> payload) {
  Frame frame;
  frame.header = header;
  frame.payload = payload;
  std::vector<std::byte> bytes = EncodeFrameHead(frame);
  bytes.insert(bytes.end(), payload.begin(), payload.end());
  return bytes;
}

Result<FramePrefix> ParseFramePrefix(std::span<const std::byte, kFramePrefixBytes> prefix,
                                     const FrameLimits& limits, const std::string& peer) {
  const uint32_t magic = static_cast<uint32_t>(GetLE(prefix.data(), 4));
  if (magic != kFrameMagic) {
    char text[16];
    std::snprintf(text, sizeof text, "0x%08x", magic);
    return Status::Corruption("peer " + peer + " sent bytes that are not a flywheel frame (magic " +
                              text + ", expected 0x31465746 'FWF1'): not a flywheel peer, or " +
                              "TLS on one side only");
  }
  FramePrefix result;
  result.header_bytes = static_cast<uint32_t>(GetLE(prefix.data() + 4, 4));
  result.payload_bytes = GetLE(prefix.data() + 8, 8);
  if (result.header_bytes == 0 || result.header_bytes > limits.max_header_bytes) {
    return Status::ResourceExhausted("peer " + peer + " sent a frame header of " +
                                     std::to_string(result.header_bytes) +
                                     " bytes (limit " + std::to_string(limits.max_header_bytes) +
                                     ")");
  }
  if (result.payload_bytes > limits.max_payload_bytes) {
    return Status::ResourceExhausted("peer " + peer + " sent a frame with a payload of " +
                                     std::to_string(result.payload_bytes) + " bytes (limit " +
                                     std::to_string(limits.max_payload_bytes) + ")");
  }
  return result;
}

Result<wire::Header> ParseFrameHeader(std::span<const std::byte> bytes, const FramePrefix& prefix,
                                      const std::string& peer) {
  wire::Header header;
  if (!header.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return Status::Corruption("peer " + peer + " sent a frame header that is not a valid " +
                              "protobuf Header (" + std::to_string(bytes.size()) + " bytes)");
  }
  if (header.payload_bytes() != prefix.payload_bytes) {
    return Status::Corruption("peer " + peer + " sent a frame whose header says " +
                              std::to_string(header.payload_bytes()) +
                              " payload bytes but whose prefix says " +
                              std::to_string(prefix.payload_bytes));
  }
  if (header.body_case() == wire::Header::BODY_NOT_SET) {
    return Status::Corruption("peer " + peer + " sent a frame without a message body");
  }
  return header;
}

const char* FrameKindName(const wire::Header& header) {
  switch (header.body_case()) {
    case wire::Header::kHello: return "hello";
    case wire::Header::kWelcome: return "welcome";
    case wire::Header::kRefused: return "refused";
    case wire::Header::kHeartbeat: return "heartbeat";
    case wire::Header::kCatalog: return "catalog";
    case wire::Header::kReport: return "report";
    case wire::Header::kPieceRequest: return "piece request";
    case wire::Header::kPiece: return "piece";
    case wire::Header::kPieceUnavailable: return "piece unavailable";
    case wire::Header::BODY_NOT_SET: break;
  }
  return "empty";
}

}  // namespace flywheel::transport
