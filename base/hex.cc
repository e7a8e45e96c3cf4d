#include "base/hex.h"

namespace flywheel {
namespace {

constexpr char kDigits[] = "0123456789abcdef";

std::string Encode(const uint8_t* data, size_t size) {
  std::string out(2 * size, '0');
  for (size_t i = 0; i < size; ++i) {
    out[2 * i] = kDigits[data[i] >> 4];
    out[2 * i + 1] = kDigits[data[i] & 0xf];
  }
  return out;
}

Status NotADigit(std::string_view hex, size_t offset) {
  return Status::InvalidArgument("'" + std::string(1, hex[offset]) + "' at offset " +
                                 std::to_string(offset) + " is not a hex digit");
}

}  // namespace

std::string HexEncode(std::span<const std::byte> bytes) {
  return Encode(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

std::string HexEncode(std::span<const uint8_t> bytes) {
  return Encode(bytes.data(), bytes.size());
}

std::string HexEncode(std::string_view bytes) {
  return Encode(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

std::string Hex64(uint64_t value) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, value >>= 4) out[static_cast<size_t>(i)] = kDigits[value & 0xf];
  return out;
}

int HexDigitValue(char c, HexCase accept) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (accept == HexCase::kAny && c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool IsHex(std::string_view text, HexCase accept) {
  if (text.empty()) return false;
  for (char c : text) {
    if (HexDigitValue(c, accept) < 0) return false;
  }
  return true;
}

Result<std::string> HexDecode(std::string_view hex, HexCase accept) {
  if (hex.size() % 2 != 0) {
    return Status::InvalidArgument("hex text has an odd length (" + std::to_string(hex.size()) +
                                   ")");
  }
  std::string out(hex.size() / 2, '\0');
  for (size_t i = 0; i < hex.size(); ++i) {
    const int digit = HexDigitValue(hex[i], accept);
    if (digit < 0) return NotADigit(hex, i);
    out[i / 2] = static_cast<char>(static_cast<uint8_t>(out[i / 2]) << 4 | digit);
  }
  return out;
}

Result<uint64_t> HexDecode64(std::string_view hex, HexCase accept) {
  if (hex.empty() || hex.size() > 16) {
    return Status::InvalidArgument("a 64-bit hex value has 1 to 16 digits, got " +
                                   std::to_string(hex.size()));
  }
  uint64_t value = 0;
  for (size_t i = 0; i < hex.size(); ++i) {
    const int digit = HexDigitValue(hex[i], accept);
    if (digit < 0) return NotADigit(hex, i);
    value = value << 4 | static_cast<uint64_t>(digit);
  }
  return value;
}

}  // namespace flywheel
