// The Unicode facts tokenizers need, fast: code point classes for split patterns (\p{L},
// \p{N}, \s as Unicode's White_Space), UTF-8 decoding that survives invalid input, lossy
// UTF-8 repair, and NFC/NFKC/NFD/NFKD normalization (ICU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace flywheel::tokenizer::unicode {

enum Class : uint8_t {
  kLetter = 1,  // general category L* (\p{L})
  kNumber = 2,  // N* (\p{N})
  kSpace = 4,   // White_Space (\s in Rust's and Oniguruma's Unicode mode)
};

// The class bits of `cp` (0 for anything else, and for values past U+10FFFF).
uint8_t ClassOf(char32_t cp);

// Decodes the code point at s[i]. Sets `length` to its byte count (>= 1). An invalid or
// truncated sequence decodes as one byte long with `valid` false and code point U+FFFD.
char32_t DecodeAt(std::string_view s, size_t i, size_t& length, bool& valid);

void AppendUtf8(char32_t cp, std::string& out);

// Appends `bytes` to `out` as valid UTF-8: each maximal invalid subpart becomes U+FFFD (the
// practice of WHATWG and Rust's from_utf8_lossy). When `final` is false, an incomplete
// sequence at the very end is left out and its length returned, to be completed by bytes
// still to come; otherwise it becomes U+FFFD and the result is 0.
size_t AppendLossy(std::string_view bytes, std::string& out, bool final);

enum class NormalForm { kNFC, kNFKC, kNFD, kNFKD };
// `text` in the normal form (text that is already in it is copied once, not rebuilt).
Result<std::string> Normalize(std::string_view text, NormalForm form);

}  // namespace flywheel::tokenizer::unicode
