// Lexer and parser of the chat-template language; see tokenizer/jinja_ast.h.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>

#include "tokenizer/jinja_ast.h"

namespace flywheel::tokenizer::jinja {

namespace {

template <typename Id, size_t N>
std::optional<Id> Lookup(const std::pair<const char*, Id> (&table)[N], std::string_view name) {
  for (const auto& [n, id] : table) {
    if (name == n) return id;
  }
  return std::nullopt;
}

constexpr std::pair<const char*, FilterId> kFilters[] = {
    {"abs", FilterId::kAbs},
    {"attr", FilterId::kAttr},
    {"capitalize", FilterId::kCapitalize},
    {"count", FilterId::kLength},
    {"d", FilterId::kDefault},
    {"default", FilterId::kDefault},
    {"dictsort", FilterId::kDictsort},
    {"first", FilterId::kFirst},
    {"float", FilterId::kFloat},
    {"indent", FilterId::kIndent},
    {"int", FilterId::kInt},
    {"items", FilterId::kItems},
    {"join", FilterId::kJoin},
    {"last", FilterId::kLast},
    {"length", FilterId::kLength},
    {"list", FilterId::kList},
    {"lower", FilterId::kLower},
    {"map", FilterId::kMap},
    {"max", FilterId::kMax},
    {"min", FilterId::kMin},
    {"reject", FilterId::kReject},
    {"rejectattr", FilterId::kRejectattr},
    {"replace", FilterId::kReplace},
    {"reverse", FilterId::kReverse},
    {"round", FilterId::kRound},
    {"select", FilterId::kSelect},
    {"selectattr", FilterId::kSelectattr},
    {"sort", FilterId::kSort},
    {"string", FilterId::kString},
    {"sum", FilterId::kSum},
    {"title", FilterId::kTitle},
    {"tojson", FilterId::kTojson},
    {"trim", FilterId::kTrim},
    {"unique", FilterId::kUnique},
    {"upper", FilterId::kUpper},
};

constexpr std::pair<const char*, TestId> kTests[] = {
    {"defined", TestId::kDefined},
    {"undefined", TestId::kUndefined},
    {"none", TestId::kNone},
    {"boolean", TestId::kBoolean},
    {"false", TestId::kFalse},
    {"true", TestId::kTrue},
    {"integer", TestId::kInteger},
    {"float", TestId::kFloat},
    {"number", TestId::kNumber},
    {"string", TestId::kString},
    {"mapping", TestId::kMapping},
    {"sequence", TestId::kSequence},
    {"iterable", TestId::kIterable},
    {"callable", TestId::kCallable},
    {"sameas", TestId::kSameas},
    {"odd", TestId::kOdd},
    {"even", TestId::kEven},
    {"divisibleby", TestId::kDivisibleby},
    {"in", TestId::kIn},
    {"==", TestId::kEq},
    {"eq", TestId::kEq},
    {"equalto", TestId::kEq},
    {"!=", TestId::kNe},
    {"ne", TestId::kNe},
    {">", TestId::kGt},
    {"gt", TestId::kGt},
    {"greaterthan", TestId::kGt},
    {">=", TestId::kGe},
    {"ge", TestId::kGe},
    {"<", TestId::kLt},
    {"lt", TestId::kLt},
    {"lessthan", TestId::kLt},
    {"<=", TestId::kLe},
    {"le", TestId::kLe},
    {"lower", TestId::kLower},
    {"upper", TestId::kUpper},
};

constexpr std::pair<const char*, MethodId> kMethods[] = {
    {"startswith", MethodId::kStartswith},
    {"endswith", MethodId::kEndswith},
    {"split", MethodId::kSplit},
    {"rsplit", MethodId::kRsplit},
    {"splitlines", MethodId::kSplitlines},
    {"strip", MethodId::kStrip},
    {"lstrip", MethodId::kLstrip},
    {"rstrip", MethodId::kRstrip},
    {"upper", MethodId::kUpper},
    {"lower", MethodId::kLower},
    {"replace", MethodId::kReplace},
    {"title", MethodId::kTitle},
    {"capitalize", MethodId::kCapitalize},
    {"join", MethodId::kJoin},
    {"find", MethodId::kFind},
    {"rfind", MethodId::kRfind},
    {"count", MethodId::kCount},
    {"index", MethodId::kIndex},
    {"removeprefix", MethodId::kRemoveprefix},
    {"removesuffix", MethodId::kRemovesuffix},
    {"isdigit", MethodId::kIsdigit},
    {"isalpha", MethodId::kIsalpha},
    {"isalnum", MethodId::kIsalnum},
    {"isspace", MethodId::kIsspace},
    {"islower", MethodId::kIslower},
    {"isupper", MethodId::kIsupper},
    {"format", MethodId::kFormat},
    {"items", MethodId::kItems},
    {"keys", MethodId::kKeys},
    {"values", MethodId::kValues},
    {"get", MethodId::kGet},
    {"cycle", MethodId::kCycle},
};

constexpr std::pair<const char*, GlobalId> kGlobals[] = {
    {"range", GlobalId::kRange},
    {"namespace", GlobalId::kNamespace},
    {"dict", GlobalId::kDict},
    {"raise_exception", GlobalId::kRaiseException},
    {"strftime_now", GlobalId::kStrftimeNow},
};

// Python's names for the attributes of builtin types, so that `d.items` is the method (as in
// Python) and not the key "items". The sandbox hides the mutating ones (they are undefined).
constexpr std::string_view kStrAttributes[] = {
    "capitalize",   "casefold",    "center",    "count",      "encode",       "endswith",
    "expandtabs",   "find",        "format",    "format_map", "index",        "isalnum",
    "isalpha",      "isascii",     "isdecimal", "isdigit",    "isidentifier", "islower",
    "isnumeric",    "isprintable", "isspace",   "istitle",    "isupper",      "join",
    "ljust",        "lower",       "lstrip",    "maketrans",  "partition",    "removeprefix",
    "removesuffix", "replace",     "rfind",     "rindex",     "rjust",        "rpartition",
    "rsplit",       "rstrip",      "split",     "splitlines", "startswith",   "strip",
    "swapcase",     "title",       "translate", "upper",      "zfill"};
constexpr std::string_view kListAttributes[] = {"copy", "count", "index"};
constexpr std::string_view kTupleAttributes[] = {"count", "index"};
constexpr std::string_view kDictAttributes[] = {"copy",  "fromkeys", "get",
                                                "items", "keys",     "values"};
constexpr std::string_view kListUnsafe[] = {"append", "clear",  "extend",  "insert",
                                            "pop",    "remove", "reverse", "sort"};
constexpr std::string_view kDictUnsafe[] = {"clear", "pop", "popitem", "setdefault", "update"};

template <size_t N>
bool Contains(const std::string_view (&names)[N], std::string_view name) {
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

}  // namespace

uint8_t BuiltinAttributeFlags(std::string_view name) {
  uint8_t flags = 0;
  if (Contains(kStrAttributes, name)) flags |= kStrAttribute;
  if (Contains(kListAttributes, name)) flags |= kListAttribute;
  if (Contains(kTupleAttributes, name)) flags |= kTupleAttribute;
  if (Contains(kDictAttributes, name)) flags |= kDictAttribute;
  if (Contains(kListUnsafe, name)) flags |= kListUnsafeAttribute;
  if (Contains(kDictUnsafe, name)) flags |= kDictUnsafeAttribute;
  return flags;
}

std::optional<FilterId> LookupFilter(std::string_view name) {
  return Lookup(kFilters, name);
}
std::optional<TestId> LookupTest(std::string_view name) {
  return Lookup(kTests, name);
}
std::optional<MethodId> LookupMethod(std::string_view name) {
  return Lookup(kMethods, name);
}
std::optional<GlobalId> LookupGlobal(std::string_view name) {
  return Lookup(kGlobals, name);
}

namespace {

// ---------------------------------------------------------------------------------------------
// Lexer (jinja2/lexer.py with trim_blocks=True, lstrip_blocks=True)

struct Token {
  enum class Type : uint8_t {
    kData,
    kVariableBegin,
    kVariableEnd,
    kBlockBegin,
    kBlockEnd,
    kName,
    kString,
    kInteger,
    kFloat,
    kOperator,
    kEof,
  };
  Type type = Type::kEof;
  int line = 1;
  std::string text;  // data, name, string value, operator
  int64_t integer = 0;
  double number = 0;
};

Status SyntaxError(int line, const std::string& message) {
  return Status::InvalidArgument("chat template line " + std::to_string(line) + ": " + message);
}

bool IsDigit(char c) {
  return c >= '0' && c <= '9';
}
bool IsNameStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool IsNameChar(char c) {
  return IsNameStart(c) || IsDigit(c);
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Newlines become \n and one trailing newline goes (keep_trailing_newline=False).
    source_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        source_.push_back('\n');
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        source_.push_back(source[i]);
      }
    }
    if (!source_.empty() && source_.back() == '\n') source_.pop_back();
  }

  Result<std::vector<Token>> Run() {
    size_t n = source_.size();
    while (pos_ < n) {
      size_t tag = FindTagStart(pos_);
      if (tag == std::string::npos) {
        EmitData(source_.substr(pos_));
        pos_ = n;
        break;
      }
      char kind = source_[tag + 1];
      size_t after_open = tag + 2;
      char sign = after_open < n && (source_[after_open] == '-' || source_[after_open] == '+')
                      ? source_[after_open]
                      : 0;
      size_t raw_end = kind == '%' ? MatchRawBegin(tag) : std::string::npos;
      std::string text = source_.substr(pos_, tag - pos_);
      EmitData(StripBefore(std::move(text), sign, /*is_variable=*/kind == '{'));
      AdvanceTo(tag);
      if (raw_end != std::string::npos) {
        line_starting_ = source_[raw_end - 1] == '\n';
        AdvanceTo(raw_end);
        FW_RETURN_IF_ERROR(LexRaw());
        continue;
      }
      line_starting_ = false;
      AdvanceTo(after_open + (sign != 0 ? 1 : 0));
      if (kind == '#') {
        FW_RETURN_IF_ERROR(LexComment());
      } else {
        FW_RETURN_IF_ERROR(LexTag(kind == '%'));
      }
    }
    Token eof;
    eof.type = Token::Type::kEof;
    eof.line = line_;
    tokens_.push_back(std::move(eof));
    return std::move(tokens_);
  }

 private:
  size_t FindTagStart(size_t from) const {
    size_t p = from;
    while ((p = source_.find('{', p)) != std::string::npos) {
      if (p + 1 < source_.size()) {
        char c = source_[p + 1];
        if (c == '{' || c == '%' || c == '#') return p;
      }
      ++p;
    }
    return std::string::npos;
  }

  // Python's `\s` at `p`: the whitespace character's length there, or 0.
  size_t SpaceAt(size_t p) const {
    if (p >= source_.size()) return 0;
    auto b = static_cast<unsigned char>(source_[p]);
    if (b < 0x80) return pystr::IsSpace(b) ? 1 : 0;
    size_t len = b >= 0xf0 ? 4 : b >= 0xe0 ? 3 : 2;
    std::u32string c = pystr::Decode(std::string_view(source_).substr(p, len));
    return c.size() == 1 && pystr::IsSpace(c[0]) ? len : 0;
  }
  size_t SkipSpaces(size_t p) const {
    size_t len;
    while ((len = SpaceAt(p)) != 0) p += len;
    return p;
  }

  // `{%(-|+|)\s*raw\s*(-%}\s*|%})` at `p`: the position after it, or npos.
  size_t MatchRawBegin(size_t p) const {
    size_t q = p + 2;
    if (q < source_.size() && (source_[q] == '-' || source_[q] == '+')) ++q;
    q = SkipSpaces(q);
    if (source_.compare(q, 3, "raw") != 0) return std::string::npos;
    q = SkipSpaces(q + 3);
    if (source_.compare(q, 3, "-%}") == 0) return SkipSpaces(q + 3);
    if (source_.compare(q, 2, "%}") == 0) return q + 2;
    return std::string::npos;
  }

  // The data before a tag, as the tag's whitespace control leaves it: `-` strips all
  // whitespace before the tag; lstrip_blocks strips the spaces and tabs between the start of
  // the line and a block or comment tag, unless the tag says `+`.
  std::string StripBefore(std::string text, char sign, bool is_variable) const {
    if (sign == '-') return pystr::Strip(text, nullptr, false, true);
    if (sign == '+' || is_variable) return text;
    size_t newline = text.rfind('\n');
    size_t l_pos = newline == std::string::npos ? 0 : newline + 1;
    if (l_pos == 0 && !line_starting_) return text;
    if (l_pos >= text.size()) return text;
    std::u32string rest = pystr::Decode(std::string_view(text).substr(l_pos));
    for (char32_t c : rest) {
      if (!pystr::IsSpace(c)) return text;
    }
    text.resize(l_pos);
    return text;
  }

  void EmitData(std::string text) {
    if (text.empty()) return;
    Token t;
    t.type = Token::Type::kData;
    t.line = line_;
    t.text = std::move(text);
    tokens_.push_back(std::move(t));
  }

  // Advances over source_[pos_, end), counting lines.
  void AdvanceTo(size_t end) {
    for (size_t i = pos_; i < end; ++i) {
      if (source_[i] == '\n') ++line_;
    }
    pos_ = end;
  }

  // After `{#`: up to `#}`, `-#}` (strips the whitespace after) or `+#}`; trim_blocks drops
  // one newline after a plain `#}`.
  Status LexComment() {
    int start_line = line_;
    size_t q = source_.find("#}", pos_);
    if (q == std::string::npos) return SyntaxError(start_line, "missing end of comment tag '#}'");
    size_t end = q + 2;
    char sign = q > pos_ ? source_[q - 1] : 0;
    if (sign == '-') {
      end = SkipSpaces(end);
    } else if (sign != '+' && end < source_.size() && source_[end] == '\n') {
      ++end;
    }
    AdvanceTo(end);
    line_starting_ = source_[end - 1] == '\n';
    return Status::Ok();
  }

  // After `{% raw %}`: the text up to `{% endraw %}` is data, as it is.
  Status LexRaw() {
    int start_line = line_;
    size_t search = pos_;
    while (true) {
      size_t p = source_.find("{%", search);
      if (p == std::string::npos) return SyntaxError(start_line, "missing '{% endraw %}'");
      size_t q = p + 2;
      char sign = 0;
      if (q < source_.size() && (source_[q] == '-' || source_[q] == '+')) sign = source_[q++];
      q = SkipSpaces(q);
      if (source_.compare(q, 6, "endraw") != 0) {
        search = p + 1;
        continue;
      }
      q = SkipSpaces(q + 6);
      size_t end;
      if (source_.compare(q, 3, "+%}") == 0) {
        end = q + 3;
      } else if (source_.compare(q, 3, "-%}") == 0) {
        end = SkipSpaces(q + 3);
      } else if (source_.compare(q, 2, "%}") == 0) {
        end = q + 2;
        if (end < source_.size() && source_[end] == '\n') ++end;
      } else {
        search = p + 1;
        continue;
      }
      EmitData(StripBefore(source_.substr(pos_, p - pos_), sign, false));
      AdvanceTo(end);
      line_starting_ = source_[end - 1] == '\n';
      return Status::Ok();
    }
  }

  // The end of the tag at pos_ (`%}` / `-%}` / `+%}` or `}}` / `-}}`): its end, or npos.
  size_t MatchTagEnd(bool block) const {
    const std::string& s = source_;
    if (block) {
      if (s.compare(pos_, 3, "+%}") == 0) return pos_ + 3;
      if (s.compare(pos_, 3, "-%}") == 0) return SkipSpaces(pos_ + 3);
      if (s.compare(pos_, 2, "%}") == 0) {
        size_t end = pos_ + 2;
        return end < s.size() && s[end] == '\n' ? end + 1 : end;
      }
      return std::string::npos;
    }
    if (s.compare(pos_, 3, "-}}") == 0) return SkipSpaces(pos_ + 3);
    if (s.compare(pos_, 2, "}}") == 0) return pos_ + 2;
    return std::string::npos;
  }

  void Emit(Token::Type type, std::string text = {}) {
    Token t;
    t.type = type;
    t.line = line_;
    t.text = std::move(text);
    tokens_.push_back(std::move(t));
  }

  // `(\d+_)*\d+` at p: its end, or npos.
  size_t MatchDigits(size_t p) const {
    if (p >= source_.size() || !IsDigit(source_[p])) return std::string::npos;
    while (true) {
      while (p < source_.size() && IsDigit(source_[p])) ++p;
      if (p + 1 < source_.size() && source_[p] == '_' && IsDigit(source_[p + 1])) {
        ++p;
        continue;
      }
      return p;
    }
  }

  // jinja2's float_re at pos_: its end, or npos.
  size_t MatchFloat() const {
    if (pos_ > 0 && source_[pos_ - 1] == '.') return std::string::npos;
    size_t p = MatchDigits(pos_);
    if (p == std::string::npos) return p;
    auto exponent = [&](size_t q) -> size_t {
      if (q >= source_.size() || (source_[q] != 'e' && source_[q] != 'E')) return std::string::npos;
      ++q;
      if (q < source_.size() && (source_[q] == '+' || source_[q] == '-')) ++q;
      return MatchDigits(q);
    };
    if (p < source_.size() && source_[p] == '.') {
      size_t frac = MatchDigits(p + 1);
      if (frac != std::string::npos) {
        size_t e = exponent(frac);
        return e != std::string::npos ? e : frac;
      }
    }
    return exponent(p);
  }

  // jinja2's integer_re at pos_: its end and value.
  Result<size_t> MatchInteger(int64_t* value) const {
    const std::string& s = source_;
    size_t p = pos_;
    int base = 10;
    auto is_base_digit = [&](char c) {
      c = static_cast<char>(c | 0x20);
      if (base == 2) return c == '0' || c == '1';
      if (base == 8) return c >= '0' && c <= '7';
      if (base == 16) return IsDigit(c) || (c >= 'a' && c <= 'f');
      return IsDigit(c);
    };
    size_t digits_start = p;
    if (s[p] == '0' && p + 1 < s.size() &&
        std::string_view("bBoOxX").find(s[p + 1]) != std::string_view::npos) {
      char b = static_cast<char>(s[p + 1] | 0x20);
      base = b == 'b' ? 2 : b == 'o' ? 8 : 16;
      size_t q = p + 2;
      size_t end = std::string::npos;
      while (true) {
        size_t r = q < s.size() && s[q] == '_' ? q + 1 : q;
        if (r < s.size() && is_base_digit(s[r])) {
          q = r + 1;
          end = q;
        } else {
          break;
        }
      }
      if (end != std::string::npos) {
        digits_start = p + 2;
        p = end;
      } else {
        base = 10;
        p = p + 1;  // just "0"
      }
    } else if (s[p] == '0') {
      ++p;
      while (true) {
        size_t r = p < s.size() && s[p] == '_' ? p + 1 : p;
        if (r < s.size() && s[r] == '0') {
          p = r + 1;
        } else {
          break;
        }
      }
    } else {
      ++p;
      while (true) {
        size_t r = p < s.size() && s[p] == '_' ? p + 1 : p;
        if (r < s.size() && IsDigit(s[r])) {
          p = r + 1;
        } else {
          break;
        }
      }
    }
    std::string digits;
    for (size_t i = digits_start; i < p; ++i) {
      if (s[i] != '_') digits += s[i];
    }
    errno = 0;
    char* end = nullptr;
    long long v = std::strtoll(digits.c_str(), &end, base);
    if (errno == ERANGE)
      return SyntaxError(line_, "integer literal too large: " + s.substr(pos_, p - pos_));
    *value = v;
    return p;
  }

  // A string literal at pos_ (quote included), unescaped as Python's unicode-escape codec
  // does: the end, and the value in *value; npos when the quote is never closed.
  Result<size_t> MatchString(std::string* value) const {
    const std::string& s = source_;
    char quote = s[pos_];
    size_t p = pos_ + 1;
    std::string raw;
    while (p < s.size() && s[p] != quote) {
      if (s[p] == '\\') {
        if (p + 1 >= s.size()) return std::string::npos;
        raw += s[p++];
      }
      raw += s[p++];
    }
    if (p >= s.size()) return std::string::npos;
    FW_RETURN_IF_ERROR(Unescape(raw, value));
    return p + 1;
  }

  Status Unescape(const std::string& raw, std::string* out) const {
    size_t i = 0;
    while (i < raw.size()) {
      char c = raw[i];
      if (c != '\\') {
        out->push_back(c);
        ++i;
        continue;
      }
      char e = raw[i + 1];
      i += 2;
      FW_RETURN_IF_ERROR(UnescapeOne(raw, e, &i, out));
    }
    return Status::Ok();
  }

  // The escape `\e` whose text goes on at raw[*i]: appends its value and moves *i past it.
  Status UnescapeOne(const std::string& raw, char e, size_t* i, std::string* out) const {
    static constexpr std::pair<char, char> kSimpleEscapes[] = {
        {'\\', '\\'}, {'\'', '\''}, {'"', '"'},  {'a', '\a'}, {'b', '\b'},
        {'f', '\f'},  {'n', '\n'},  {'r', '\r'}, {'t', '\t'}, {'v', '\v'}};
    if (e == '\n') return Status::Ok();  // line continuation
    for (const auto& [name, value] : kSimpleEscapes) {
      if (e == name) {
        out->push_back(value);
        return Status::Ok();
      }
    }
    if (e == 'x' || e == 'u' || e == 'U') return UnescapeHex(raw, e, i, out);
    if (e == 'N')
      return SyntaxError(line_, "\\N{...} escapes in string literals are not supported");
    if (e >= '0' && e <= '7') {
      // Up to three octal digits, `e` the first.
      uint32_t v = static_cast<uint32_t>(e - '0');
      for (int k = 0; k < 2 && *i < raw.size() && raw[*i] >= '0' && raw[*i] <= '7'; ++k) {
        v = v * 8 + static_cast<uint32_t>(raw[(*i)++] - '0');
      }
      pystr::AppendCodePoint(v, out);
      return Status::Ok();
    }
    if (static_cast<unsigned char>(e) >= 0x80) {
      ReescapeNonAscii(raw, i, out);
      return Status::Ok();
    }
    out->push_back('\\');  // not an escape: Python keeps the backslash
    out->push_back(e);
    return Status::Ok();
  }

  static int HexDigitValue(char c) {
    if (IsDigit(c)) return c - '0';
    c = static_cast<char>(c | 0x20);
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }

  // \xNN, \uNNNN, \UNNNNNNNN (`e` the letter; the digits at raw[*i]).
  Status UnescapeHex(const std::string& raw, char e, size_t* i, std::string* out) const {
    int width = e == 'x' ? 2 : e == 'u' ? 4 : 8;
    uint32_t v = 0;
    for (int k = 0; k < width; ++k) {
      size_t at = *i + static_cast<size_t>(k);
      int h = at < raw.size() ? HexDigitValue(raw[at]) : -1;
      if (h < 0) {
        return SyntaxError(line_, std::string("truncated \\") + e + " escape in a string literal");
      }
      v = v * 16 + static_cast<uint32_t>(h);
    }
    if (v > 0x10ffff) return SyntaxError(line_, "illegal Unicode character in a string literal");
    *i += static_cast<size_t>(width);
    pystr::AppendCodePoint(v, out);
    return Status::Ok();
  }

  // A backslash before a non-ASCII character (whose first byte is raw[*i - 1]): Python first
  // writes the character as \xNN / \uNNNN / \UNNNNNNNN and the backslash escapes that escape's
  // backslash, so the text is the escape itself.
  static void ReescapeNonAscii(const std::string& raw, size_t* i, std::string* out) {
    size_t start = *i - 1;
    size_t len = 1;
    while (start + len < raw.size() &&
           (static_cast<unsigned char>(raw[start + len]) & 0xc0) == 0x80)
      ++len;
    std::u32string cp = pystr::Decode(std::string_view(raw).substr(start, len));
    char32_t v = cp.empty() ? 0 : cp[0];
    char buf[16];
    if (v <= 0xff) {
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(v));
    } else if (v <= 0xffff) {
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(v));
    } else {
      std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(v));
    }
    *out += buf;
    *i = start + len;
  }

  // The expression tokens of a `{% %}` or `{{ }}` tag, and its end.
  Status LexTag(bool block) {
    int start_line = line_;
    Emit(block ? Token::Type::kBlockBegin : Token::Type::kVariableBegin);
    std::vector<char> balance;  // the closing brackets still expected, innermost last
    const std::string& s = source_;
    while (pos_ < s.size()) {
      if (balance.empty()) {
        size_t end = MatchTagEnd(block);
        if (end != std::string::npos) {
          Emit(block ? Token::Type::kBlockEnd : Token::Type::kVariableEnd);
          AdvanceTo(end);
          line_starting_ = s[end - 1] == '\n';
          return Status::Ok();
        }
      }
      if (SpaceAt(pos_) != 0) {
        AdvanceTo(SkipSpaces(pos_));
        continue;
      }
      char c = s[pos_];
      if (IsDigit(c)) {
        FW_RETURN_IF_ERROR(LexNumber());
      } else if (IsNameStart(c)) {
        size_t end = pos_ + 1;
        while (end < s.size() && IsNameChar(s[end])) ++end;
        Emit(Token::Type::kName, s.substr(pos_, end - pos_));
        AdvanceTo(end);
      } else if (c == '\'' || c == '"') {
        FW_RETURN_IF_ERROR(LexString());
      } else {
        FW_RETURN_IF_ERROR(LexOperator(&balance));
      }
    }
    return SyntaxError(start_line, std::string("unterminated '") + (block ? "{%" : "{{") +
                                       "': the template ends inside it");
  }

  // A float or integer literal at pos_ (`_` between digits allowed).
  Status LexNumber() {
    const std::string& s = source_;
    size_t end = MatchFloat();
    Token t;
    t.line = line_;
    if (end != std::string::npos) {
      std::string text;
      for (size_t i = pos_; i < end; ++i) {
        if (s[i] != '_') text += s[i];
      }
      t.type = Token::Type::kFloat;
      t.number = std::strtod(text.c_str(), nullptr);
    } else {
      FW_ASSIGN_OR_RETURN(end, MatchInteger(&t.integer));
      t.type = Token::Type::kInteger;
    }
    tokens_.push_back(std::move(t));
    AdvanceTo(end);
    return Status::Ok();
  }

  // A string literal at pos_.
  Status LexString() {
    char quote = source_[pos_];
    Token t;
    t.type = Token::Type::kString;
    t.line = line_;
    FW_ASSIGN_OR_RETURN(size_t end, MatchString(&t.text));
    if (end == std::string::npos) {
      return SyntaxError(line_, std::string("unterminated string literal starting with ") + quote);
    }
    tokens_.push_back(std::move(t));
    AdvanceTo(end);
    return Status::Ok();
  }

  // An operator at pos_; brackets must pair up (`balance`: the closers still expected).
  Status LexOperator(std::vector<char>* balance) {
    const std::string& s = source_;
    char c = s[pos_];
    static constexpr std::string_view kTwoChar[] = {"//", "**", "==", "!=", ">=", "<="};
    std::string op;
    for (std::string_view two : kTwoChar) {
      if (s.compare(pos_, 2, two) == 0) op = two;
    }
    if (op.empty() && std::string_view("+-/*%~[](){}><=.:|,;").find(c) != std::string_view::npos) {
      op = std::string(1, c);
    }
    if (op.empty()) {
      if (static_cast<unsigned char>(c) >= 0x80) {
        return SyntaxError(line_, "unexpected character in a tag (identifiers must be ASCII)");
      }
      return SyntaxError(line_, std::string("unexpected character '") + c + "' in a tag");
    }
    if (op == "{" || op == "(" || op == "[") {
      balance->push_back(op == "{" ? '}' : op == "(" ? ')' : ']');
    } else if (op == "}" || op == ")" || op == "]") {
      if (balance->empty()) return SyntaxError(line_, "unexpected '" + op + "'");
      if (balance->back() != op[0]) {
        return SyntaxError(line_, "unexpected '" + op + "', expected '" + balance->back() + "'");
      }
      balance->pop_back();
    }
    Emit(Token::Type::kOperator, op);
    AdvanceTo(pos_ + op.size());
    return Status::Ok();
  }

  std::string source_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

// ---------------------------------------------------------------------------------------------
// Parser (jinja2/parser.py)

// Tags jinja2 knows that this subset does not implement.
constexpr std::string_view kUnsupportedTags[] = {"block", "extends",    "include", "import",
                                                 "from",  "autoescape", "call",    "do"};

class Parser {
 public:
  Parser(std::vector<Token> tokens, Template* tmpl) : tokens_(std::move(tokens)), tmpl_(tmpl) {
    Intern("loop");
    Intern("varargs");
    Intern("kwargs");
  }

  Status Run() {
    FW_ASSIGN_OR_RETURN(tmpl_->body, Subparse({}));
    if (cur().type != Token::Type::kEof) return Fail("unexpected '" + Describe(cur()) + "'");
    // A call of a bare name must name a global or something the template defines (a macro,
    // or a variable a macro is assigned to): the context holds only JSON data.
    for (const auto& [name, line] : called_names_) {
      if (LookupGlobal(name)) continue;
      if (assigned_names_.count(name) != 0) continue;
      return SyntaxError(line, "unsupported function '" + name + "'");
    }
    return Status::Ok();
  }

 private:
  using Type = Token::Type;

  const Token& cur() const { return tokens_[pos_]; }
  const Token& look() const { return tokens_[std::min(pos_ + 1, tokens_.size() - 1)]; }
  void Next() {
    if (pos_ + 1 < tokens_.size()) ++pos_;
  }
  static bool IsName(const Token& t, std::string_view name) {
    return t.type == Type::kName && t.text == name;
  }
  static bool IsOp(const Token& t, std::string_view op) {
    return t.type == Type::kOperator && t.text == op;
  }
  bool SkipOp(std::string_view op) {
    if (!IsOp(cur(), op)) return false;
    Next();
    return true;
  }
  bool SkipName(std::string_view name) {
    if (!IsName(cur(), name)) return false;
    Next();
    return true;
  }
  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Type::kData:
        return "template data";
      case Type::kVariableBegin:
        return "{{";
      case Type::kVariableEnd:
        return "}}";
      case Type::kBlockBegin:
        return "{%";
      case Type::kBlockEnd:
        return "%}";
      case Type::kName:
      case Type::kOperator:
        return t.text;
      case Type::kString:
        return "string literal";
      case Type::kInteger:
      case Type::kFloat:
        return "number";
      case Type::kEof:
        return "end of template";
    }
    return "token";
  }
  Status Fail(const std::string& message) const { return SyntaxError(cur().line, message); }
  Status ExpectOp(std::string_view op) {
    if (!SkipOp(op))
      return Fail("expected '" + std::string(op) + "', got '" + Describe(cur()) + "'");
    return Status::Ok();
  }
  Status ExpectType(Type type, std::string_view what) {
    if (cur().type != type) {
      if (cur().type == Type::kEof)
        return Fail("unexpected end of template, expected " + std::string(what));
      return Fail("expected " + std::string(what) + ", got '" + Describe(cur()) + "'");
    }
    Next();
    return Status::Ok();
  }
  Result<std::string> ExpectName() {
    if (cur().type != Type::kName) return Fail("expected a name, got '" + Describe(cur()) + "'");
    std::string name = cur().text;
    Next();
    return name;
  }

  int Intern(const std::string& name) {
    auto [it, inserted] = tmpl_->name_ids.emplace(name, static_cast<int>(tmpl_->names.size()));
    if (inserted) tmpl_->names.push_back(name);
    return it->second;
  }

  ExprPtr NewExpr(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    e->folds_to_constant = kind == Expr::Kind::kConst;
    return e;
  }

  // --- statements ---

  // Statements and data up to a `{%` whose tag is one of `end_tags` (left as the current
  // token), or to the end of the template.
  Result<Body> Subparse(const std::vector<std::string_view>& end_tags) {
    NestingGuard guard(&nesting_, 6);
    FW_RETURN_IF_ERROR(CheckNesting());
    Body body;
    while (cur().type != Type::kEof) {
      const Token& t = cur();
      if (t.type == Type::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        Next();
      } else if (t.type == Type::kVariableBegin) {
        int line = t.line;
        Next();
        FW_ASSIGN_OR_RETURN(ExprPtr e, ParseTuple(false, true, {}, false));
        FW_RETURN_IF_ERROR(ExpectType(Type::kVariableEnd, "'}}'"));
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kPrint;
        s->line = line;
        s->exprs.push_back(std::move(e));
        body.push_back(std::move(s));
      } else if (t.type == Type::kBlockBegin) {
        Next();
        for (std::string_view end : end_tags) {
          if (IsName(cur(), end)) return body;
        }
        FW_ASSIGN_OR_RETURN(StmtPtr s, ParseStatement());
        body.push_back(std::move(s));
        FW_RETURN_IF_ERROR(ExpectType(Type::kBlockEnd, "'%}'"));
      } else {
        return Fail("unexpected '" + Describe(t) + "'");
      }
    }
    return body;
  }

  // After a statement's head: `%}`, then the body up to one of `end_tags`. With
  // `drop_needle` the end tag's name is consumed.
  Result<Body> ParseStatements(const std::vector<std::string_view>& end_tags, bool drop_needle,
                               std::string_view opened, int opened_line) {
    SkipOp(":");
    FW_RETURN_IF_ERROR(ExpectType(Type::kBlockEnd, "'%}'"));
    FW_ASSIGN_OR_RETURN(Body body, Subparse(end_tags));
    if (cur().type == Type::kEof) {
      std::string expected;
      for (std::string_view end : end_tags) {
        expected += (expected.empty() ? "'" : " or '") + std::string(end) + "'";
      }
      return SyntaxError(opened_line, "unterminated '{% " + std::string(opened) +
                                          " %}': the template ends before " + expected);
    }
    if (drop_needle) Next();
    return body;
  }

  StmtPtr NewStmt(Stmt::Kind kind, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  Result<StmtPtr> ParseStatement() {
    const Token& t = cur();
    if (t.type != Type::kName) return Fail("tag name expected, got '" + Describe(t) + "'");
    const std::string tag = t.text;
    if (tag == "for") return ParseFor();
    if (tag == "if") return ParseIf();
    if (tag == "set") return ParseSet();
    if (tag == "macro") return ParseMacro();
    if (tag == "filter") return ParseFilterBlock();
    if (tag == "with") return ParseWith();
    if (tag == "generation") return ParseGeneration();
    if (tag == "print") return ParsePrint();
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) return Fail("'{% " + tag + " %}' outside a for loop");
      Next();
      return NewStmt(tag == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue, t.line);
    }
    for (std::string_view unsupported : kUnsupportedTags) {
      if (tag == unsupported) return Fail("unsupported tag '{% " + tag + " %}'");
    }
    return Fail("unknown tag '{% " + tag + " %}'");
  }

  Result<StmtPtr> ParseFor() {
    int line = cur().line;
    Next();
    auto s = NewStmt(Stmt::Kind::kFor, line);
    FW_ASSIGN_OR_RETURN(Target target, ParseAssignTarget(true, false, {"in"}, false));
    s->targets.push_back(std::move(target));
    if (!SkipName("in")) return Fail("expected 'in' in a for loop, got '" + Describe(cur()) + "'");
    FW_ASSIGN_OR_RETURN(ExprPtr iterable, ParseTuple(false, false, {"recursive"}, false));
    s->exprs.push_back(std::move(iterable));
    if (SkipName("if")) {
      FW_ASSIGN_OR_RETURN(ExprPtr test, ParseExpression(true));
      s->exprs.push_back(std::move(test));
    }
    if (IsName(cur(), "recursive")) return Fail("unsupported: recursive for loops");
    ++loop_depth_;
    auto body = ParseStatements({"endfor", "else"}, false, "for", line);
    --loop_depth_;
    if (!body.ok()) return body.status();
    s->bodies.push_back(std::move(body).value());
    bool has_else = IsName(cur(), "else");
    Next();
    if (has_else) {
      FW_ASSIGN_OR_RETURN(Body else_body, ParseStatements({"endfor"}, true, "for", line));
      s->bodies.push_back(std::move(else_body));
    } else {
      s->bodies.emplace_back();
    }
    return s;
  }

  Result<StmtPtr> ParseIf() {
    int line = cur().line;
    Next();
    auto s = NewStmt(Stmt::Kind::kIf, line);
    while (true) {
      FW_ASSIGN_OR_RETURN(ExprPtr test, ParseTuple(false, false, {}, false));
      s->exprs.push_back(std::move(test));
      FW_ASSIGN_OR_RETURN(Body body, ParseStatements({"elif", "else", "endif"}, false, "if", line));
      s->bodies.push_back(std::move(body));
      std::string end = cur().text;
      Next();
      if (end == "elif") continue;
      if (end == "else") {
        FW_ASSIGN_OR_RETURN(Body else_body, ParseStatements({"endif"}, true, "if", line));
        s->bodies.push_back(std::move(else_body));
      }
      break;
    }
    return s;
  }

  Result<StmtPtr> ParseSet() {
    int line = cur().line;
    Next();
    FW_ASSIGN_OR_RETURN(Target target, ParseAssignTarget(true, false, {}, true));
    if (SkipOp("=")) {
      auto s = NewStmt(Stmt::Kind::kSet, line);
      FW_ASSIGN_OR_RETURN(ExprPtr value, ParseTuple(false, true, {}, false));
      s->targets.push_back(std::move(target));
      s->exprs.push_back(std::move(value));
      return s;
    }
    auto s = NewStmt(Stmt::Kind::kSetBlock, line);
    if (IsOp(cur(), "|")) {
      FW_ASSIGN_OR_RETURN(s->filter, ParseFilter(nullptr, false));
    }
    FW_ASSIGN_OR_RETURN(Body body, ParseStatements({"endset"}, true, "set", line));
    s->targets.push_back(std::move(target));
    s->bodies.push_back(std::move(body));
    return s;
  }

  Result<StmtPtr> ParseMacro() {
    int line = cur().line;
    Next();
    auto s = NewStmt(Stmt::Kind::kMacro, line);
    FW_ASSIGN_OR_RETURN(s->name, ExpectName());
    s->name_id = Intern(s->name);
    assigned_names_.insert(s->name);
    FW_RETURN_IF_ERROR(ExpectOp("("));
    while (!IsOp(cur(), ")")) {
      if (!s->param_names.empty()) FW_RETURN_IF_ERROR(ExpectOp(","));
      FW_ASSIGN_OR_RETURN(std::string param, ExpectName());
      s->param_ids.push_back(Intern(param));
      s->param_names.push_back(param);
      assigned_names_.insert(param);
      if (SkipOp("=")) {
        FW_ASSIGN_OR_RETURN(ExprPtr def, ParseExpression(true));
        s->defaults.push_back(std::move(def));
      } else if (!s->defaults.empty()) {
        return Fail("non-default argument follows default argument");
      }
    }
    FW_RETURN_IF_ERROR(ExpectOp(")"));
    int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;
    macro_uses_.push_back({false, false});
    auto body = ParseStatements({"endmacro"}, true, "macro", line);
    loop_depth_ = saved_loop_depth;
    s->catches_varargs = macro_uses_.back().first;
    s->catches_kwargs = macro_uses_.back().second;
    macro_uses_.pop_back();
    if (!body.ok()) return body.status();
    s->bodies.push_back(std::move(body).value());
    return s;
  }

  Result<StmtPtr> ParseFilterBlock() {
    int line = cur().line;
    Next();
    auto s = NewStmt(Stmt::Kind::kFilterBlock, line);
    FW_ASSIGN_OR_RETURN(s->filter, ParseFilter(nullptr, true));
    FW_ASSIGN_OR_RETURN(Body body, ParseStatements({"endfilter"}, true, "filter", line));
    s->bodies.push_back(std::move(body));
    return s;
  }

  Result<StmtPtr> ParseWith() {
    int line = cur().line;
    Next();
    auto s = NewStmt(Stmt::Kind::kScope, line);
    while (cur().type != Type::kBlockEnd) {
      if (!s->targets.empty()) FW_RETURN_IF_ERROR(ExpectOp(","));
      FW_ASSIGN_OR_RETURN(Target target, ParseAssignTarget(true, false, {}, false));
      FW_RETURN_IF_ERROR(ExpectOp("="));
      FW_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
      s->targets.push_back(std::move(target));
      s->exprs.push_back(std::move(value));
    }
    FW_ASSIGN_OR_RETURN(Body body, ParseStatements({"endwith"}, true, "with", line));
    s->bodies.push_back(std::move(body));
    return s;
  }

  // transformers' AssistantTracker: `{% generation %}...{% endgeneration %}` renders its
  // body as a call block does (in a scope of its own).
  Result<StmtPtr> ParseGeneration() {
    int line = cur().line;
    Next();
    auto s = NewStmt(Stmt::Kind::kScope, line);
    s->generation = true;
    FW_ASSIGN_OR_RETURN(Body body, ParseStatements({"endgeneration"}, true, "generation", line));
    s->bodies.push_back(std::move(body));
    return s;
  }

  Result<StmtPtr> ParsePrint() {
    int line = cur().line;
    Next();
    auto s = NewStmt(Stmt::Kind::kPrint, line);
    while (cur().type != Type::kBlockEnd) {
      if (!s->exprs.empty()) FW_RETURN_IF_ERROR(ExpectOp(","));
      FW_ASSIGN_OR_RETURN(ExprPtr e, ParseExpression(true));
      s->exprs.push_back(std::move(e));
    }
    return s;
  }

  // parse_assign_target: a name, `ns.attr` (with_namespace), or a tuple of names.
  Result<Target> ParseAssignTarget(bool with_tuple, bool name_only,
                                   const std::vector<std::string_view>& extra_end,
                                   bool with_namespace) {
    Target target;
    if (with_namespace && cur().type == Type::kName && IsOp(look(), ".")) {
      target.kind = Target::Kind::kNamespaceAttribute;
      target.name = cur().text;
      target.name_id = Intern(target.name);
      Next();
      Next();
      FW_ASSIGN_OR_RETURN(target.attribute, ExpectName());
      return target;
    }
    if (name_only || !with_tuple) {
      FW_ASSIGN_OR_RETURN(target.name, ExpectName());
      target.name_id = Intern(target.name);
      assigned_names_.insert(target.name);
      return target;
    }
    // parse_tuple(simplified=True): primaries separated by commas.
    std::vector<Target> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) FW_RETURN_IF_ERROR(ExpectOp(","));
      if (IsTupleEnd(extra_end)) break;
      Target item;
      if (SkipOp("(")) {
        FW_ASSIGN_OR_RETURN(item, ParseAssignTarget(true, false, {}, false));
        FW_RETURN_IF_ERROR(ExpectOp(")"));
      } else {
        if (cur().type != Type::kName || IsName(cur(), "true") || IsName(cur(), "false") ||
            IsName(cur(), "none") || IsName(cur(), "True") || IsName(cur(), "False") ||
            IsName(cur(), "None")) {
          return Fail("can't assign to '" + Describe(cur()) + "'");
        }
        item.name = cur().text;
        item.name_id = Intern(item.name);
        assigned_names_.insert(item.name);
        Next();
      }
      items.push_back(std::move(item));
      if (IsOp(cur(), ",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (items.empty())
        return Fail("expected an assignment target, got '" + Describe(cur()) + "'");
      return std::move(items[0]);
    }
    target.kind = Target::Kind::kTuple;
    target.items = std::move(items);
    return target;
  }

  // --- expressions ---

  bool IsTupleEnd(const std::vector<std::string_view>& extra_end) const {
    Type type = cur().type;
    if (type == Type::kVariableEnd || type == Type::kBlockEnd || IsOp(cur(), ")")) return true;
    for (std::string_view end : extra_end) {
      if (IsName(cur(), end)) return true;
    }
    return false;
  }

  Result<ExprPtr> ParseTuple(bool simplified, bool with_condexpr,
                             const std::vector<std::string_view>& extra_end,
                             bool explicit_parentheses) {
    int line = cur().line;
    std::vector<ExprPtr> args;
    bool is_tuple = false;
    while (true) {
      if (!args.empty()) FW_RETURN_IF_ERROR(ExpectOp(","));
      if (IsTupleEnd(extra_end)) break;
      Result<ExprPtr> item = simplified ? ParsePrimary() : ParseExpression(with_condexpr);
      if (!item.ok()) return item.status();
      args.push_back(std::move(item).value());
      if (IsOp(cur(), ",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!args.empty()) return std::move(args[0]);
      if (!explicit_parentheses)
        return Fail("expected an expression, got '" + Describe(cur()) + "'");
    }
    auto e = NewExpr(Expr::Kind::kTuple, line);
    e->children = std::move(args);
    return e;
  }

  // Bounds the parser's recursion (nested brackets, `not not ...`, nested blocks), so that no
  // template can overflow the stack here or in the interpreter.
  static constexpr int kMaxNesting = 600;
  struct NestingGuard {
    // A block counts as several levels: each costs the parser and the interpreter more stack.
    explicit NestingGuard(int* depth, int weight = 1) : depth_(depth), weight_(weight) {
      *depth_ += weight_;
    }
    ~NestingGuard() { *depth_ -= weight_; }
    int* depth_;
    int weight_;
  };
  Status CheckNesting() const {
    if (nesting_ > kMaxNesting)
      return Fail("the template nests deeper than " + std::to_string(kMaxNesting) + " levels");
    return Status::Ok();
  }

  Result<ExprPtr> ParseExpression(bool with_condexpr) {
    NestingGuard guard(&nesting_);
    FW_RETURN_IF_ERROR(CheckNesting());
    if (with_condexpr) return ParseCondExpr();
    return ParseOr();
  }

  Result<ExprPtr> ParseCondExpr() {
    int line = cur().line;
    FW_ASSIGN_OR_RETURN(ExprPtr expr1, ParseOr());
    while (SkipName("if")) {
      FW_ASSIGN_OR_RETURN(ExprPtr expr2, ParseOr());
      ExprPtr expr3;
      if (SkipName("else")) {
        FW_ASSIGN_OR_RETURN(expr3, ParseCondExpr());
      }
      auto e = NewExpr(Expr::Kind::kCondExpr, line);
      e->children.push_back(std::move(expr2));
      e->children.push_back(std::move(expr1));
      e->children.push_back(std::move(expr3));
      expr1 = std::move(e);
    }
    return expr1;
  }

  Result<ExprPtr> ParseOr() {
    FW_ASSIGN_OR_RETURN(ExprPtr left, ParseAnd());
    while (IsName(cur(), "or")) {
      int line = cur().line;
      Next();
      FW_ASSIGN_OR_RETURN(ExprPtr right, ParseAnd());
      auto e = NewExpr(Expr::Kind::kOr, line);
      e->children.push_back(std::move(left));
      e->children.push_back(std::move(right));
      left = std::move(e);
    }
    return left;
  }

  Result<ExprPtr> ParseAnd() {
    FW_ASSIGN_OR_RETURN(ExprPtr left, ParseNot());
    while (IsName(cur(), "and")) {
      int line = cur().line;
      Next();
      FW_ASSIGN_OR_RETURN(ExprPtr right, ParseNot());
      auto e = NewExpr(Expr::Kind::kAnd, line);
      e->children.push_back(std::move(left));
      e->children.push_back(std::move(right));
      left = std::move(e);
    }
    return left;
  }

  Result<ExprPtr> ParseNot() {
    NestingGuard guard(&nesting_);
    FW_RETURN_IF_ERROR(CheckNesting());
    if (IsName(cur(), "not")) {
      int line = cur().line;
      Next();
      FW_ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
      auto e = NewExpr(Expr::Kind::kNot, line);
      e->children.push_back(std::move(operand));
      return e;
    }
    return ParseCompare();
  }

  Result<ExprPtr> ParseCompare() {
    int line = cur().line;
    FW_ASSIGN_OR_RETURN(ExprPtr expr, ParseMath1());
    ExprPtr compare;
    while (true) {
      std::optional<CompareOp> op;
      const Token& t = cur();
      if (t.type == Type::kOperator) {
        if (t.text == "==") op = CompareOp::kEq;
        if (t.text == "!=") op = CompareOp::kNe;
        if (t.text == "<") op = CompareOp::kLt;
        if (t.text == "<=") op = CompareOp::kLe;
        if (t.text == ">") op = CompareOp::kGt;
        if (t.text == ">=") op = CompareOp::kGe;
        if (op) Next();
      } else if (IsName(t, "in")) {
        op = CompareOp::kIn;
        Next();
      } else if (IsName(t, "not") && IsName(look(), "in")) {
        op = CompareOp::kNotIn;
        Next();
        Next();
      }
      if (!op) break;
      FW_ASSIGN_OR_RETURN(ExprPtr right, ParseMath1());
      if (!compare) {
        compare = NewExpr(Expr::Kind::kCompare, line);
        compare->children.push_back(std::move(expr));
      }
      compare->compare_ops.push_back(*op);
      compare->children.push_back(std::move(right));
    }
    if (compare) return compare;
    return expr;
  }

  Result<ExprPtr> Binary(BinaryOp op, int line, ExprPtr left, ExprPtr right) {
    auto e = NewExpr(Expr::Kind::kBinary, line);
    e->binary_op = op;
    e->folds_to_constant = left->folds_to_constant && right->folds_to_constant;
    e->children.push_back(std::move(left));
    e->children.push_back(std::move(right));
    return e;
  }

  Result<ExprPtr> ParseMath1() {
    FW_ASSIGN_OR_RETURN(ExprPtr left, ParseConcat());
    while (IsOp(cur(), "+") || IsOp(cur(), "-")) {
      BinaryOp op = cur().text == "+" ? BinaryOp::kAdd : BinaryOp::kSub;
      int line = cur().line;
      Next();
      FW_ASSIGN_OR_RETURN(ExprPtr right, ParseConcat());
      FW_ASSIGN_OR_RETURN(left, Binary(op, line, std::move(left), std::move(right)));
    }
    return left;
  }

  Result<ExprPtr> ParseConcat() {
    int line = cur().line;
    FW_ASSIGN_OR_RETURN(ExprPtr first, ParseMath2());
    if (!IsOp(cur(), "~")) return first;
    auto e = NewExpr(Expr::Kind::kConcat, line);
    e->children.push_back(std::move(first));
    while (SkipOp("~")) {
      FW_ASSIGN_OR_RETURN(ExprPtr next, ParseMath2());
      e->children.push_back(std::move(next));
    }
    return e;
  }

  Result<ExprPtr> ParseMath2() {
    FW_ASSIGN_OR_RETURN(ExprPtr left, ParsePow());
    while (true) {
      std::optional<BinaryOp> op;
      if (IsOp(cur(), "*")) op = BinaryOp::kMul;
      if (IsOp(cur(), "/")) op = BinaryOp::kDiv;
      if (IsOp(cur(), "//")) op = BinaryOp::kFloorDiv;
      if (IsOp(cur(), "%")) op = BinaryOp::kMod;
      if (!op) break;
      int line = cur().line;
      Next();
      FW_ASSIGN_OR_RETURN(ExprPtr right, ParsePow());
      FW_ASSIGN_OR_RETURN(left, Binary(*op, line, std::move(left), std::move(right)));
    }
    return left;
  }

  Result<ExprPtr> ParsePow() {
    FW_ASSIGN_OR_RETURN(ExprPtr left, ParseUnary(true));
    while (IsOp(cur(), "**")) {
      int line = cur().line;
      Next();
      FW_ASSIGN_OR_RETURN(ExprPtr right, ParseUnary(true));
      FW_ASSIGN_OR_RETURN(left, Binary(BinaryOp::kPow, line, std::move(left), std::move(right)));
    }
    return left;
  }

  Result<ExprPtr> ParseUnary(bool with_filter) {
    NestingGuard guard(&nesting_);
    FW_RETURN_IF_ERROR(CheckNesting());
    int line = cur().line;
    ExprPtr node;
    if (IsOp(cur(), "-") || IsOp(cur(), "+")) {
      bool negate = cur().text == "-";
      Next();
      FW_ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
      node = NewExpr(negate ? Expr::Kind::kNeg : Expr::Kind::kPos, line);
      node->folds_to_constant = operand->folds_to_constant;
      node->children.push_back(std::move(operand));
    } else {
      FW_ASSIGN_OR_RETURN(node, ParsePrimary());
    }
    FW_ASSIGN_OR_RETURN(node, ParsePostfix(std::move(node)));
    if (with_filter) {
      FW_ASSIGN_OR_RETURN(node, ParseFilterExpr(std::move(node)));
    }
    return node;
  }

  Result<ExprPtr> ParsePrimary() {
    const Token& t = cur();
    int line = t.line;
    if (t.type == Type::kName) {
      ExprPtr e;
      if (t.text == "true" || t.text == "false" || t.text == "True" || t.text == "False") {
        e = NewExpr(Expr::Kind::kConst, line);
        e->constant = Value::Bool(t.text == "true" || t.text == "True");
      } else if (t.text == "none" || t.text == "None") {
        e = NewExpr(Expr::Kind::kConst, line);
        e->constant = Value::None();
      } else {
        e = NewExpr(Expr::Kind::kName, line);
        e->name = t.text;
        e->id = Intern(t.text);
        if (!macro_uses_.empty()) {
          if (e->id == Template::kVarargsId) macro_uses_.back().first = true;
          if (e->id == Template::kKwargsId) macro_uses_.back().second = true;
        }
      }
      Next();
      return e;
    }
    if (t.type == Type::kString) {
      std::string text;
      while (cur().type == Type::kString) {  // adjacent literals concatenate
        text += cur().text;
        Next();
      }
      auto e = NewExpr(Expr::Kind::kConst, line);
      e->constant = Value::String(std::move(text));
      return e;
    }
    if (t.type == Type::kInteger || t.type == Type::kFloat) {
      auto e = NewExpr(Expr::Kind::kConst, line);
      e->constant = t.type == Type::kInteger ? Value::Int(t.integer) : Value::Float(t.number);
      Next();
      return e;
    }
    if (IsOp(t, "(")) {
      Next();
      FW_ASSIGN_OR_RETURN(ExprPtr e, ParseTuple(false, true, {}, true));
      FW_RETURN_IF_ERROR(ExpectOp(")"));
      return e;
    }
    if (IsOp(t, "[")) {
      Next();
      auto e = NewExpr(Expr::Kind::kList, line);
      while (!IsOp(cur(), "]")) {
        if (!e->children.empty()) FW_RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(cur(), "]")) break;
        FW_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
        e->children.push_back(std::move(item));
      }
      FW_RETURN_IF_ERROR(ExpectOp("]"));
      return e;
    }
    if (IsOp(t, "{")) {
      Next();
      auto e = NewExpr(Expr::Kind::kDict, line);
      while (!IsOp(cur(), "}")) {
        if (!e->children.empty()) FW_RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(cur(), "}")) break;
        FW_ASSIGN_OR_RETURN(ExprPtr key, ParseExpression(true));
        FW_RETURN_IF_ERROR(ExpectOp(":"));
        FW_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        e->children.push_back(std::move(key));
        e->children.push_back(std::move(value));
      }
      FW_RETURN_IF_ERROR(ExpectOp("}"));
      return e;
    }
    if (t.type == Type::kEof) return Fail("unexpected end of template");
    return Fail("unexpected '" + Describe(t) + "'");
  }

  Result<ExprPtr> ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(cur(), ".") || IsOp(cur(), "[")) {
        FW_ASSIGN_OR_RETURN(node, ParseSubscript(std::move(node)));
      } else if (IsOp(cur(), "(")) {
        FW_ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        break;
      }
    }
    return node;
  }

  Result<ExprPtr> ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp(cur(), "|")) {
        FW_ASSIGN_OR_RETURN(node, ParseFilter(std::move(node), false));
      } else if (IsName(cur(), "is")) {
        FW_ASSIGN_OR_RETURN(node, ParseTest(std::move(node)));
      } else if (IsOp(cur(), "(")) {
        FW_ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        break;
      }
    }
    return node;
  }

  Result<ExprPtr> ParseSubscript(ExprPtr node) {
    int line = cur().line;
    if (SkipOp(".")) {
      const Token& attr = cur();
      if (attr.type == Type::kName) {
        auto e = NewExpr(Expr::Kind::kGetAttr, line);
        e->name = attr.text;
        if (auto method = LookupMethod(attr.text)) e->id = static_cast<int>(*method);
        e->attribute_flags = BuiltinAttributeFlags(attr.text);
        e->children.push_back(std::move(node));
        Next();
        return e;
      }
      if (attr.type != Type::kInteger) return Fail("expected a name or a number after '.'");
      auto index = NewExpr(Expr::Kind::kConst, line);
      index->constant = Value::Int(attr.integer);
      Next();
      auto e = NewExpr(Expr::Kind::kGetItem, line);
      e->children.push_back(std::move(node));
      e->children.push_back(std::move(index));
      return e;
    }
    FW_RETURN_IF_ERROR(ExpectOp("["));
    std::vector<ExprPtr> args;
    while (!IsOp(cur(), "]")) {
      if (!args.empty()) FW_RETURN_IF_ERROR(ExpectOp(","));
      FW_ASSIGN_OR_RETURN(ExprPtr arg, ParseSubscribed());
      args.push_back(std::move(arg));
    }
    FW_RETURN_IF_ERROR(ExpectOp("]"));
    ExprPtr arg;
    if (args.size() == 1) {
      arg = std::move(args[0]);
    } else {
      arg = NewExpr(Expr::Kind::kTuple, line);
      arg->children = std::move(args);
    }
    auto e = NewExpr(Expr::Kind::kGetItem, line);
    e->children.push_back(std::move(node));
    e->children.push_back(std::move(arg));
    return e;
  }

  Result<ExprPtr> ParseSubscribed() {
    int line = cur().line;
    std::vector<ExprPtr> args;
    if (IsOp(cur(), ":")) {
      Next();
      args.push_back(nullptr);
    } else {
      FW_ASSIGN_OR_RETURN(ExprPtr node, ParseExpression(true));
      if (!IsOp(cur(), ":")) return node;
      Next();
      args.push_back(std::move(node));
    }
    auto at_end = [&] { return IsOp(cur(), "]") || IsOp(cur(), ","); };
    if (IsOp(cur(), ":")) {
      args.push_back(nullptr);
    } else if (!at_end()) {
      FW_ASSIGN_OR_RETURN(ExprPtr stop, ParseExpression(true));
      args.push_back(std::move(stop));
    } else {
      args.push_back(nullptr);
    }
    if (SkipOp(":")) {
      if (!at_end()) {
        FW_ASSIGN_OR_RETURN(ExprPtr step, ParseExpression(true));
        args.push_back(std::move(step));
      } else {
        args.push_back(nullptr);
      }
    } else {
      args.push_back(nullptr);
    }
    auto e = NewExpr(Expr::Kind::kSlice, line);
    e->children = std::move(args);
    return e;
  }

  // `(args, name=value, ...)` into e->children (after what is already there) and e->kwargs.
  Status ParseCallArgs(Expr* e) {
    FW_RETURN_IF_ERROR(ExpectOp("("));
    bool require_comma = false;
    while (!IsOp(cur(), ")")) {
      if (require_comma) {
        FW_RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(cur(), ")")) break;  // trailing comma
      }
      if (IsOp(cur(), "*") || IsOp(cur(), "**")) {
        return Fail("unsupported: '" + cur().text + "' arguments in a call");
      }
      if (cur().type == Type::kName && IsOp(look(), "=")) {
        std::string key = cur().text;
        Next();
        Next();
        FW_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        e->kwargs.emplace_back(std::move(key), std::move(value));
      } else {
        if (!e->kwargs.empty()) return Fail("positional argument follows keyword argument");
        FW_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        e->children.push_back(std::move(value));
      }
      require_comma = true;
    }
    return ExpectOp(")");
  }

  Result<ExprPtr> ParseCall(ExprPtr callee) {
    int line = cur().line;
    if (callee->kind == Expr::Kind::kName) {
      called_names_.emplace_back(callee->name, line);
    } else if (callee->kind == Expr::Kind::kGetAttr && callee->id < 0) {
      return Fail("unsupported method '" + callee->name + "'");
    }
    auto e = NewExpr(Expr::Kind::kCall, line);
    e->children.push_back(std::move(callee));
    FW_RETURN_IF_ERROR(ParseCallArgs(e.get()));
    return e;
  }

  // The filter or test a string literal names in map / select / reject / selectattr /
  // rejectattr must exist.
  Status CheckNamedBuiltin(const Expr& e) {
    auto filter = static_cast<FilterId>(e.id);
    size_t index;  // children index of the name argument
    bool is_test;
    switch (filter) {
      case FilterId::kMap:
        if (e.children.size() < 2) return Status::Ok();
        index = 1;
        is_test = false;
        break;
      case FilterId::kSelect:
      case FilterId::kReject:
        index = 1;
        is_test = true;
        break;
      case FilterId::kSelectattr:
      case FilterId::kRejectattr:
        index = 2;
        is_test = true;
        break;
      default:
        return Status::Ok();
    }
    if (e.children.size() <= index) return Status::Ok();
    const Expr& arg = *e.children[index];
    if (arg.kind != Expr::Kind::kConst || !arg.constant.is_string()) return Status::Ok();
    const std::string& name = arg.constant.as_string();
    if (is_test ? LookupTest(name).has_value() : LookupFilter(name).has_value())
      return Status::Ok();
    return SyntaxError(arg.line, std::string("unsupported ") + (is_test ? "test" : "filter") +
                                     " '" + name + "' (named in '" + e.name + "')");
  }

  Result<ExprPtr> ParseFilter(ExprPtr node, bool start_inline) {
    while (IsOp(cur(), "|") || start_inline) {
      if (!start_inline) Next();
      start_inline = false;
      int line = cur().line;
      FW_ASSIGN_OR_RETURN(std::string name, ExpectName());
      while (SkipOp(".")) {
        FW_ASSIGN_OR_RETURN(std::string part, ExpectName());
        name += "." + part;
      }
      auto filter = LookupFilter(name);
      if (!filter) return SyntaxError(line, "unsupported filter '" + name + "'");
      auto e = NewExpr(Expr::Kind::kFilter, line);
      e->name = name;
      e->id = static_cast<int>(*filter);
      e->children.push_back(std::move(node));
      if (IsOp(cur(), "(")) FW_RETURN_IF_ERROR(ParseCallArgs(e.get()));
      FW_RETURN_IF_ERROR(CheckNamedBuiltin(*e));
      node = std::move(e);
    }
    return node;
  }

  Result<ExprPtr> ParseTest(ExprPtr node) {
    int line = cur().line;
    Next();  // is
    bool negated = SkipName("not");
    FW_ASSIGN_OR_RETURN(std::string name, ExpectName());
    while (SkipOp(".")) {
      FW_ASSIGN_OR_RETURN(std::string part, ExpectName());
      name += "." + part;
    }
    auto test = LookupTest(name);
    if (!test) return SyntaxError(line, "unsupported test '" + name + "'");
    auto e = NewExpr(Expr::Kind::kTest, line);
    e->name = name;
    e->id = static_cast<int>(*test);
    e->children.push_back(std::move(node));
    const Token& t = cur();
    if (IsOp(t, "(")) {
      FW_RETURN_IF_ERROR(ParseCallArgs(e.get()));
    } else if ((t.type == Type::kName || t.type == Type::kString || t.type == Type::kInteger ||
                t.type == Type::kFloat || IsOp(t, "(") || IsOp(t, "[") || IsOp(t, "{")) &&
               !IsName(t, "else") && !IsName(t, "or") && !IsName(t, "and")) {
      if (IsName(t, "is")) return Fail("You cannot chain multiple tests with is");
      FW_ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
      FW_ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
      e->children.push_back(std::move(arg));
    }
    if (!negated) return e;
    auto n = NewExpr(Expr::Kind::kNot, line);
    n->children.push_back(std::move(e));
    return n;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  Template* tmpl_;
  int loop_depth_ = 0;
  int nesting_ = 0;
  // Per macro being parsed: whether its body names varargs / kwargs.
  std::vector<std::pair<bool, bool>> macro_uses_;
  std::vector<std::pair<std::string, int>> called_names_;
  std::set<std::string> assigned_names_;
};

// ---------------------------------------------------------------------------------------------
// Scoping (jinja2/idtracking.py): which names each frame starts with undefined.
//
// jinja2 compiles every frame (the template, a for-loop iteration, a macro call, the body of
// a block set, filter block, with or generation) to Python locals decided statically: a name
// the frame reads before it assigns it, or that an enclosing frame knows, starts as the
// context's or the enclosing frame's value; a name the frame only assigns starts undefined. A
// frame knows a name when it reads, assigns or binds it anywhere in its own statements
// (nested frames excluded); an `if` merges its branches, and a name assigned in only some of
// them keeps the outer value. The interpreter looks names up through the enclosing scopes,
// which gives the same values except for those undefined starts, recorded here.

class ScopeAnalysis {
 public:
  explicit ScopeAnalysis(Template* tmpl) : tmpl_(tmpl) {}

  void Run() {
    Symbols root;
    std::vector<Stmt*> nested;
    VisitBody(tmpl_->body, &root, &nested);
    tmpl_->undefined_at_start = root.Undefined();
    for (Stmt* s : nested) AnalyzeNested(s, root);
  }

 private:
  enum class Load : uint8_t { kParameter, kResolve, kAlias, kUndefined };

  struct Symbols {
    const Symbols* parent = nullptr;
    std::map<int, Load> refs;
    std::set<int> stores;

    bool FindRef(int id) const {
      for (const Symbols* s = this; s != nullptr; s = s->parent) {
        if (s->refs.count(id) != 0) return true;
      }
      return false;
    }
    void LoadName(int id) {
      if (!FindRef(id)) refs[id] = Load::kResolve;
    }
    void Store(int id) {
      stores.insert(id);
      if (refs.count(id) == 0) {
        refs[id] = parent != nullptr && parent->FindRef(id) ? Load::kAlias : Load::kUndefined;
      }
    }
    void Parameter(int id) {
      stores.insert(id);
      refs[id] = Load::kParameter;
    }
    // A name assigned in only some branches keeps the outer (or the context's) value.
    void BranchUpdate(const std::vector<Symbols>& branches) {
      std::map<int, size_t> counts;
      for (const Symbols& b : branches) {
        for (int id : b.stores) {
          if (stores.count(id) == 0) ++counts[id];
        }
      }
      for (const Symbols& b : branches) {
        for (const auto& [id, load] : b.refs) refs[id] = load;
        stores.insert(b.stores.begin(), b.stores.end());
      }
      for (const auto& [id, count] : counts) {
        if (count == branches.size()) continue;
        refs[id] = parent != nullptr && parent->FindRef(id) ? Load::kAlias : Load::kResolve;
      }
    }
    std::vector<int> Undefined() const {
      std::vector<int> out;
      for (const auto& [id, load] : refs) {
        if (load == Load::kUndefined) out.push_back(id);
      }
      return out;
    }
  };

  void VisitExpr(const Expr* e, Symbols* symbols) {
    if (e == nullptr) return;
    if (e->kind == Expr::Kind::kName) symbols->LoadName(e->id);
    for (const ExprPtr& child : e->children) VisitExpr(child.get(), symbols);
    for (const auto& [key, value] : e->kwargs) VisitExpr(value.get(), symbols);
  }

  void StoreTarget(const Target& target, Symbols* symbols, bool as_parameter) {
    switch (target.kind) {
      case Target::Kind::kName:
        if (as_parameter) {
          symbols->Parameter(target.name_id);
        } else {
          symbols->Store(target.name_id);
        }
        return;
      case Target::Kind::kTuple:
        for (const Target& item : target.items) StoreTarget(item, symbols, as_parameter);
        return;
      case Target::Kind::kNamespaceAttribute:
        symbols->LoadName(target.name_id);
        return;
    }
  }

  void VisitBody(const Body& body, Symbols* symbols, std::vector<Stmt*>* nested) {
    for (const StmtPtr& s : body) VisitStmt(s.get(), symbols, nested);
  }

  // jinja2's FrameSymbolVisitor: what `s` does to the frame it is in; the frames nested in it
  // go to `nested`, to be analyzed once this frame is complete.
  void VisitStmt(Stmt* s, Symbols* symbols, std::vector<Stmt*>* nested) {
    switch (s->kind) {
      case Stmt::Kind::kText:
      case Stmt::Kind::kBreak:
      case Stmt::Kind::kContinue:
        return;
      case Stmt::Kind::kPrint:
        for (const ExprPtr& e : s->exprs) VisitExpr(e.get(), symbols);
        return;
      case Stmt::Kind::kIf: {
        // jinja2's If node: test, body, the elif chain (If nodes without else), else.
        VisitExpr(s->exprs[0].get(), symbols);
        std::vector<Symbols> branches;
        branches.push_back(*symbols);
        VisitBody(s->bodies[0], &branches.back(), nested);
        Symbols elifs = *symbols;
        for (size_t i = 1; i < s->exprs.size(); ++i) {
          VisitExpr(s->exprs[i].get(), &elifs);
          std::vector<Symbols> elif_branches(3, elifs);
          VisitBody(s->bodies[i], &elif_branches[0], nested);
          elifs.BranchUpdate(elif_branches);
        }
        branches.push_back(std::move(elifs));
        branches.push_back(*symbols);
        if (s->bodies.size() > s->exprs.size())
          VisitBody(s->bodies.back(), &branches.back(), nested);
        symbols->BranchUpdate(branches);
        return;
      }
      case Stmt::Kind::kFor:
        VisitExpr(s->exprs[0].get(), symbols);
        nested->push_back(s);
        return;
      case Stmt::Kind::kSet:
        VisitExpr(s->exprs[0].get(), symbols);
        StoreTarget(s->targets[0], symbols, false);
        return;
      case Stmt::Kind::kSetBlock:
        StoreTarget(s->targets[0], symbols, false);
        nested->push_back(s);
        return;
      case Stmt::Kind::kMacro:
        symbols->Store(s->name_id);
        nested->push_back(s);
        return;
      case Stmt::Kind::kFilterBlock:
        VisitExpr(s->filter.get(), symbols);
        nested->push_back(s);
        return;
      case Stmt::Kind::kScope:
        for (const ExprPtr& e : s->exprs) VisitExpr(e.get(), symbols);
        nested->push_back(s);
        return;
    }
  }

  // Analyzes the frames `s` opens, whose enclosing frame's symbols are `parent` (complete).
  void AnalyzeNested(Stmt* s, const Symbols& parent) {
    auto frame = [&](const Body& body, auto&& before) {
      Symbols symbols;
      symbols.parent = &parent;
      before(&symbols);
      std::vector<Stmt*> nested;
      VisitBody(body, &symbols, &nested);
      std::vector<int> undefined = symbols.Undefined();
      for (Stmt* n : nested) AnalyzeNested(n, symbols);
      return undefined;
    };
    switch (s->kind) {
      case Stmt::Kind::kFor:
        s->undefined_in_body = frame(s->bodies[0], [&](Symbols* symbols) {
          StoreTarget(s->targets[0], symbols, true);
          symbols->Parameter(Template::kLoopId);
        });
        s->undefined_in_else = frame(s->bodies[1], [](Symbols*) {});
        return;
      case Stmt::Kind::kMacro:
        s->undefined_in_body = frame(s->bodies[0], [&](Symbols* symbols) {
          for (int id : s->param_ids) symbols->Parameter(id);
          for (const ExprPtr& d : s->defaults) VisitExpr(d.get(), symbols);
          symbols->Parameter(Template::kVarargsId);
          symbols->Parameter(Template::kKwargsId);
        });
        return;
      case Stmt::Kind::kFilterBlock:
        s->undefined_in_body =
            frame(s->bodies[0], [&](Symbols* symbols) { VisitExpr(s->filter.get(), symbols); });
        return;
      case Stmt::Kind::kScope:
        s->undefined_in_body = frame(s->bodies[0], [&](Symbols* symbols) {
          for (const Target& t : s->targets) StoreTarget(t, symbols, true);
        });
        return;
      case Stmt::Kind::kSetBlock:
        s->undefined_in_body = frame(s->bodies[0], [](Symbols*) {});
        return;
      default:
        return;
    }
  }

  Template* tmpl_;
};

}  // namespace

Result<std::unique_ptr<Template>> ParseTemplate(std::string_view source) {
  FW_ASSIGN_OR_RETURN(std::vector<Token> tokens, Lexer(source).Run());
  auto tmpl = std::make_unique<Template>();
  Parser parser(std::move(tokens), tmpl.get());
  FW_RETURN_IF_ERROR(parser.Run());
  ScopeAnalysis(tmpl.get()).Run();
  return tmpl;
}

namespace {
bool BodyHasGeneration(const Body& body) {
  for (const StmtPtr& stmt : body) {
    if (stmt->generation) return true;
    for (const Body& inner : stmt->bodies)
      if (BodyHasGeneration(inner)) return true;
  }
  return false;
}
}  // namespace

bool HasGenerationBlocks(const Template& tmpl) { return BodyHasGeneration(tmpl.body); }

}  // namespace flywheel::tokenizer::jinja
