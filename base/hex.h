// Hexadecimal text: the one encoder and decoder for hashes, digests, signatures and ids.
//
// Encoding is always lowercase, two digits per byte, most significant nibble first, and
// 16 zero-padded digits for a 64-bit value. Decoding accepts lowercase only or either case
// (HexCase): formats flywheel writes itself (the version log, signatures.json, upload
// digests) are read lowercase-only, so that one value has one spelling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "base/status.h"

namespace flywheel {

enum class HexCase {
  kLower,  // 0-9 a-f only
  kAny,    // 0-9 a-f A-F
};

// "00ff10" for the bytes {0x00, 0xff, 0x10}.
std::string HexEncode(std::span<const std::byte> bytes);
std::string HexEncode(std::span<const uint8_t> bytes);
std::string HexEncode(std::string_view bytes);

// 16 lowercase digits, zero-padded: Hex64(255) == "00000000000000ff".
std::string Hex64(uint64_t value);

// The value of one hex digit, or -1 when `c` is not one (in `accept`'s case).
int HexDigitValue(char c, HexCase accept = HexCase::kAny);

// True when `text` is non-empty and every character is a hex digit (in `accept`'s case).
bool IsHex(std::string_view text, HexCase accept = HexCase::kAny);

// The bytes `hex` spells. InvalidArgument when its length is odd or a character is not a
// hex digit (the message names the character and its offset).
Result<std::string> HexDecode(std::string_view hex, HexCase accept = HexCase::kAny);

// The value of 1 to 16 hex digits, most significant first ("ff" -> 255). InvalidArgument
// when `hex` is empty, longer than 16 digits, or holds a character that is not a digit.
Result<uint64_t> HexDecode64(std::string_view hex, HexCase accept = HexCase::kAny);

}  // namespace flywheel
