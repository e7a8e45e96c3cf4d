#include "tokenizer/unicode.h"

#include <unicode/normalizer2.h>
#include <unicode/bytestream.h>
#include <unicode/uchar.h>

#include <memory>
#include <mutex>
#include <vector>

namespace flywheel::tokenizer::unicode {

namespace {

constexpr char32_t kMaxCodePoint = 0x10FFFF;

const std::vector<uint8_t>& Table() {
  static const std::vector<uint8_t>* table = [] {
    auto* t = new std::vector<uint8_t>(kMaxCodePoint + 1);
    for (char32_t c = 0; c <= kMaxCodePoint; ++c) {
      uint8_t bits = 0;
      switch (u_charType(static_cast<UChar32>(c))) {
        case U_UPPERCASE_LETTER:
        case U_LOWERCASE_LETTER:
        case U_TITLECASE_LETTER:
        case U_MODIFIER_LETTER:
        case U_OTHER_LETTER:
          bits |= kLetter;
          break;
        case U_DECIMAL_DIGIT_NUMBER:
        case U_LETTER_NUMBER:
        case U_OTHER_NUMBER:
          bits |= kNumber;
          break;
        default:
          break;
      }
      if (u_isUWhiteSpace(static_cast<UChar32>(c))) bits |= kSpace;
      (*t)[c] = bits;
    }
    return t;
  }();
  return *table;
}

}  // namespace

uint8_t ClassOf(char32_t cp) {
  static const uint8_t* table = Table().data();
  return cp <= kMaxCodePoint ? table[cp] : 0;
}

char32_t DecodeAt(std::string_view s, size_t i, size_t& length, bool& valid) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  valid = true;
  if (b0 < 0x80) {
    length = 1;
    return b0;
  }
  size_t need;
  char32_t cp, min;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2, cp = b0 & 0x1F, min = 0x80;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3, cp = b0 & 0x0F, min = 0x800;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    length = 1, valid = false;
    return 0xFFFD;
  }
  if (i + need > s.size()) {
    length = 1, valid = false;
    return 0xFFFD;
  }
  for (size_t k = 1; k < need; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) {
      length = 1, valid = false;
      return 0xFFFD;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)) {
    length = 1, valid = false;
    return 0xFFFD;
  }
  length = need;
  return cp;
}

void AppendUtf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t AppendLossy(std::string_view s, std::string& out, bool final) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) {
      out.push_back(static_cast<char>(b0));
      ++i;
      continue;
    }
    // The length of the sequence b0 starts and the range of its second byte (Unicode's
    // table of well-formed sequences); anything else is a one-byte invalid subpart.
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      need = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      need = 3;
      if (b0 == 0xE0) lo = 0xA0;
      if (b0 == 0xED) hi = 0x9F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      need = 4;
      if (b0 == 0xF0) lo = 0x90;
      if (b0 == 0xF4) hi = 0x8F;
    }
    if (need == 0) {
      AppendUtf8(0xFFFD, out);
      ++i;
      continue;
    }
    size_t k = 1;
    for (; k < need && i + k < s.size(); ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      const bool ok = k == 1 ? (b >= lo && b <= hi) : (b & 0xC0) == 0x80;
      if (!ok) break;
    }
    if (k == need) {
      out.append(s.substr(i, need));
      i += need;
    } else if (i + k == s.size() && !final) {
      return s.size() - i;  // a valid start, cut short: wait for the rest
    } else {
      AppendUtf8(0xFFFD, out);  // the maximal subpart [i, i + k) is invalid
      i += k;
    }
  }
  return 0;
}

Result<std::string> Normalize(std::string_view text, NormalForm form) {
  UErrorCode error = U_ZERO_ERROR;
  const icu::Normalizer2* normalizer = nullptr;
  switch (form) {
    case NormalForm::kNFC:
      normalizer = icu::Normalizer2::getNFCInstance(error);
      break;
    case NormalForm::kNFKC:
      normalizer = icu::Normalizer2::getNFKCInstance(error);
      break;
    case NormalForm::kNFD:
      normalizer = icu::Normalizer2::getNFDInstance(error);
      break;
    case NormalForm::kNFKD:
      normalizer = icu::Normalizer2::getNFKDInstance(error);
      break;
  }
  if (U_FAILURE(error) || normalizer == nullptr)
    return Status::Internal(std::string("ICU normalizer: ") + u_errorName(error));
  bool ascii = true;
  for (unsigned char c : text) {
    if (c >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return std::string(text);  // ASCII is in every normal form
  const icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
  if (normalizer->isNormalizedUTF8(piece, error) && U_SUCCESS(error)) return std::string(text);
  error = U_ZERO_ERROR;
  std::string out;
  out.reserve(text.size() + text.size() / 8);
  icu::StringByteSink<std::string> sink(&out);
  normalizer->normalizeUTF8(0, piece, sink, nullptr, error);
  if (U_FAILURE(error))
    return Status::InvalidArgument(std::string("text cannot be normalized: ") + u_errorName(error));
  return out;
}

}  // namespace flywheel::tokenizer::unicode
