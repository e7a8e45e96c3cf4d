#include "tokenizer/jinja_value.h"

#include <unicode/locid.h>
#include <unicode/ucasemap.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace flywheel::tokenizer::jinja {

// ---------------------------------------------------------------------------------------------
// Dict and Value

const Value* Dict::Find(std::string_view key) const {
  for (const auto& [k, v] : items_) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::Set(std::string key, Value value) {
  for (auto& [k, v] : items_) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  items_.emplace_back(std::move(key), std::move(value));
}

std::string Namespace::Repr() const {
  std::string out = "<Namespace {";
  bool first = true;
  for (const auto& [k, v] : attributes.items()) {
    if (!first) out += ", ";
    first = false;
    AppendRepr(Value::String(k), &out);
    out += ": ";
    AppendRepr(v, &out);
  }
  out += "}>";
  return out;
}

Value Value::Undefined(std::string message) {
  Value v;
  v.data_ = std::make_shared<const std::string>(std::move(message));
  return v;
}
Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value Value::Bool(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.data_ = b;
  return v;
}
Value Value::Int(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.data_ = i;
  return v;
}
Value Value::Float(double d) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.data_ = d;
  return v;
}
Value Value::String(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.data_ = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::List(ValueList items) {
  Value v;
  v.kind_ = Kind::kList;
  v.data_ = std::shared_ptr<const ValueList>(std::make_shared<ValueList>(std::move(items)));
  return v;
}
Value Value::Tuple(ValueList items) {
  Value v = List(std::move(items));
  v.kind_ = Kind::kTuple;
  return v;
}
Value Value::Iterator(ValueList items) {
  Value v = List(std::move(items));
  v.kind_ = Kind::kIterator;
  return v;
}
Value Value::MakeDict(Dict dict) {
  Value v;
  v.kind_ = Kind::kDict;
  v.data_ = std::shared_ptr<const Dict>(std::make_shared<Dict>(std::move(dict)));
  return v;
}
Value Value::MakeObject(Kind kind, std::shared_ptr<Object> object) {
  Value v;
  v.kind_ = kind;
  v.data_ = std::move(object);
  return v;
}

std::string Value::undefined_message() const {
  if (const auto* s = std::get_if<SharedString>(&data_); s != nullptr && !(*s)->empty()) return **s;
  return "value is undefined";
}

// ---------------------------------------------------------------------------------------------
// Python semantics

const char* TypeName(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return "list";
    case Value::Kind::kTuple:
      return "tuple";
    case Value::Kind::kIterator:
      return "generator";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kNamespace:
      return "Namespace";
    case Value::Kind::kMacro:
      return "Macro";
    case Value::Kind::kLoop:
      return "LoopContext";
    case Value::Kind::kMethod:
    case Value::Kind::kFunction:
      return "builtin_function_or_method";
  }
  return "object";
}

bool Truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.as_bool();
    case Value::Kind::kInt:
      return v.as_int() != 0;
    case Value::Kind::kFloat:
      return v.as_float() != 0.0;
    case Value::Kind::kString:
      return !v.as_string().empty();
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return !v.as_list().empty();
    case Value::Kind::kDict:
      return v.as_dict().size() != 0;
    default:
      return true;  // generators and objects
  }
}

std::string FormatFloat(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  std::string out;
  if (std::signbit(d)) {
    out += '-';
    d = -d;
  }
  if (d == 0.0) return out + "0.0";
  // Shortest round-trip digits, then Python's layout (float_repr_style 'short', mode 'r').
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(end - buf));
  size_t e_pos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e_pos)) {
    if (c != '.') digits += c;
  }
  int exponent = 0;
  std::from_chars(sci.data() + e_pos + (sci[e_pos + 1] == '+' ? 2 : 1), sci.data() + sci.size(),
                  exponent);
  int decpt = exponent + 1;  // digits d1d2... mean 0.d1d2... * 10^decpt
  int ndigits = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0.";
      out.append(static_cast<size_t>(-decpt), '0');
      out += digits;
    } else if (decpt >= ndigits) {
      out += digits;
      out.append(static_cast<size_t>(decpt - ndigits), '0');
      out += ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(decpt));
      out += '.';
      out += digits.substr(static_cast<size_t>(decpt));
    }
    return out;
  }
  out += digits[0];
  if (ndigits > 1) {
    out += '.';
    out += digits.substr(1);
  }
  int e = decpt - 1;
  out += e < 0 ? "e-" : "e+";
  if (std::abs(e) < 10) out += '0';
  out += std::to_string(std::abs(e));
  return out;
}

namespace {

// Python's str.isprintable() for one character, which decides repr()'s escapes.
bool IsPrintable(char32_t c) {
  if (c == ' ') return true;
  if (c < 0x7f) return c >= 0x20;
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR:
      return false;
    default:
      return true;
  }
}

void AppendHex(uint32_t value, int width, std::string* out) {
  static const char kHex[] = "0123456789abcdef";
  for (int shift = (width - 1) * 4; shift >= 0; shift -= 4)
    out->push_back(kHex[(value >> shift) & 0xf]);
}

void AppendStringRepr(std::string_view s, std::string* out) {
  bool has_single = s.find('\'') != std::string_view::npos;
  bool has_double = s.find('"') != std::string_view::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  out->push_back(quote);
  for (char32_t c : pystr::Decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
    } else if (c == '\t') {
      *out += "\\t";
    } else if (c == '\n') {
      *out += "\\n";
    } else if (c == '\r') {
      *out += "\\r";
    } else if (IsPrintable(c)) {
      pystr::AppendCodePoint(c, out);
    } else if (c <= 0xff) {
      *out += "\\x";
      AppendHex(c, 2, out);
    } else if (c <= 0xffff) {
      *out += "\\u";
      AppendHex(c, 4, out);
    } else {
      *out += "\\U";
      AppendHex(c, 8, out);
    }
  }
  out->push_back(quote);
}

void AppendSequence(const Value& v, std::string* out) {
  const ValueList& items = v.as_list();
  bool tuple = v.kind() == Value::Kind::kTuple;
  out->push_back(tuple ? '(' : '[');
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) *out += ", ";
    AppendRepr(items[i], out);
  }
  if (tuple && items.size() == 1) out->push_back(',');
  out->push_back(tuple ? ')' : ']');
}

}  // namespace

void AppendStr(const Value& v, std::string* out) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return;
    case Value::Kind::kString:
      *out += v.as_string();
      return;
    default:
      AppendRepr(v, out);
  }
}

std::string Str(const Value& v) {
  std::string out;
  AppendStr(v, &out);
  return out;
}

void AppendRepr(const Value& v, std::string* out) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      *out += "Undefined";
      return;
    case Value::Kind::kNone:
      *out += "None";
      return;
    case Value::Kind::kBool:
      *out += v.as_bool() ? "True" : "False";
      return;
    case Value::Kind::kInt:
      *out += std::to_string(v.as_int());
      return;
    case Value::Kind::kFloat:
      *out += FormatFloat(v.as_float());
      return;
    case Value::Kind::kString:
      AppendStringRepr(v.as_string(), out);
      return;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      AppendSequence(v, out);
      return;
    case Value::Kind::kIterator:
      *out += "<generator object>";
      return;
    case Value::Kind::kDict: {
      out->push_back('{');
      bool first = true;
      for (const auto& [k, item] : v.as_dict().items()) {
        if (!first) *out += ", ";
        first = false;
        AppendStringRepr(k, out);
        *out += ": ";
        AppendRepr(item, out);
      }
      out->push_back('}');
      return;
    }
    default:
      *out += v.object()->Repr();
  }
}

bool Equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (!a.is_float() && !b.is_float()) return a.integer() == b.integer();
    return a.number() == b.number();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      const ValueList& x = a.as_list();
      const ValueList& y = b.as_list();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!Equals(x[i], y[i])) return false;
      }
      return true;
    }
    case Value::Kind::kIterator:
      return a.list_ptr() == b.list_ptr();
    case Value::Kind::kDict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (x.size() != y.size()) return false;
      for (const auto& [k, item] : x.items()) {
        const Value* other = y.Find(k);
        if (other == nullptr || !Equals(item, *other)) return false;
      }
      return true;
    }
    default:
      return a.object() == b.object();
  }
}

Result<int> Compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (!a.is_float() && !b.is_float()) {
      return a.integer() < b.integer() ? -1 : (a.integer() > b.integer() ? 1 : 0);
    }
    return a.number() < b.number() ? -1 : (a.number() > b.number() ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    int c = a.as_string().compare(b.as_string());  // UTF-8 byte order is code point order
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.kind() == b.kind() && (a.kind() == Value::Kind::kList || a.kind() == Value::Kind::kTuple)) {
    const ValueList& x = a.as_list();
    const ValueList& y = b.as_list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (Equals(x[i], y[i])) continue;
      return Compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  if (a.is_undefined()) return Status::InvalidArgument(a.undefined_message());
  if (b.is_undefined()) return Status::InvalidArgument(b.undefined_message());
  return Status::InvalidArgument(std::string("'<' not supported between instances of '") +
                                 TypeName(a) + "' and '" + TypeName(b) + "'");
}

// ---------------------------------------------------------------------------------------------
// JSON

namespace {

void AppendJsonString(std::string_view s, bool ensure_ascii, std::string* out) {
  out->push_back('"');
  if (!ensure_ascii) {
    for (char ch : s) {
      auto c = static_cast<unsigned char>(ch);
      switch (c) {
        case '"':
          *out += "\\\"";
          break;
        case '\\':
          *out += "\\\\";
          break;
        case '\n':
          *out += "\\n";
          break;
        case '\r':
          *out += "\\r";
          break;
        case '\t':
          *out += "\\t";
          break;
        case '\b':
          *out += "\\b";
          break;
        case '\f':
          *out += "\\f";
          break;
        default:
          if (c < 0x20) {
            *out += "\\u00";
            AppendHex(c, 2, out);
          } else {
            out->push_back(ch);
          }
      }
    }
  } else {
    for (char32_t c : pystr::Decode(s)) {
      if (c == '"' || c == '\\' || c == '\n' || c == '\r' || c == '\t' || c == '\b' || c == '\f') {
        std::string tmp(1, static_cast<char>(c));
        std::string escaped;
        AppendJsonString(tmp, false, &escaped);
        *out += escaped.substr(1, escaped.size() - 2);
      } else if (c >= 0x20 && c < 0x7f) {
        out->push_back(static_cast<char>(c));
      } else if (c <= 0xffff) {
        *out += "\\u";
        AppendHex(c, 4, out);
      } else {
        char32_t v = c - 0x10000;
        *out += "\\u";
        AppendHex(0xd800 + (v >> 10), 4, out);
        *out += "\\u";
        AppendHex(0xdc00 + (v & 0x3ff), 4, out);
      }
    }
  }
  out->push_back('"');
}

void AppendNewlineIndent(const JsonOptions& options, int level, std::string* out) {
  out->push_back('\n');
  for (int i = 0; i < level; ++i) *out += *options.indent;
}

Status AppendJsonAt(const Value& v, const JsonOptions& options, int level, std::string* out) {
  switch (v.kind()) {
    case Value::Kind::kNone:
      *out += "null";
      return Status::Ok();
    case Value::Kind::kBool:
      *out += v.as_bool() ? "true" : "false";
      return Status::Ok();
    case Value::Kind::kInt:
      *out += std::to_string(v.as_int());
      return Status::Ok();
    case Value::Kind::kFloat: {
      double d = v.as_float();
      if (std::isnan(d)) {
        *out += "NaN";
      } else if (std::isinf(d)) {
        *out += d < 0 ? "-Infinity" : "Infinity";
      } else {
        *out += FormatFloat(d);
      }
      return Status::Ok();
    }
    case Value::Kind::kString:
      AppendJsonString(v.as_string(), options.ensure_ascii, out);
      return Status::Ok();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      const ValueList& items = v.as_list();
      if (items.empty()) {
        *out += "[]";
        return Status::Ok();
      }
      out->push_back('[');
      if (options.indent) AppendNewlineIndent(options, level + 1, out);
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) {
          *out += options.item_separator;
          if (options.indent) AppendNewlineIndent(options, level + 1, out);
        }
        FW_RETURN_IF_ERROR(AppendJsonAt(items[i], options, level + 1, out));
      }
      if (options.indent) AppendNewlineIndent(options, level, out);
      out->push_back(']');
      return Status::Ok();
    }
    case Value::Kind::kDict: {
      const Dict& dict = v.as_dict();
      if (dict.size() == 0) {
        *out += "{}";
        return Status::Ok();
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& entry : dict.items()) entries.push_back(&entry);
      if (options.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      }
      out->push_back('{');
      if (options.indent) AppendNewlineIndent(options, level + 1, out);
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i > 0) {
          *out += options.item_separator;
          if (options.indent) AppendNewlineIndent(options, level + 1, out);
        }
        AppendJsonString(entries[i]->first, options.ensure_ascii, out);
        *out += options.key_separator;
        FW_RETURN_IF_ERROR(AppendJsonAt(entries[i]->second, options, level + 1, out));
      }
      if (options.indent) AppendNewlineIndent(options, level, out);
      out->push_back('}');
      return Status::Ok();
    }
    case Value::Kind::kUndefined:
      return Status::InvalidArgument("tojson: Object of type Undefined is not JSON serializable (" +
                                     v.undefined_message() + ")");
    default:
      return Status::InvalidArgument(std::string("tojson: Object of type ") + TypeName(v) +
                                     " is not JSON serializable");
  }
}

}  // namespace

Status AppendJson(const Value& v, const JsonOptions& options, std::string* out) {
  return AppendJsonAt(v, options, 0, out);
}

Value FromJson(const nlohmann::ordered_json& json) {
  using Type = nlohmann::ordered_json::value_t;
  switch (json.type()) {
    case Type::null:
    case Type::discarded:
      return Value::None();
    case Type::boolean:
      return Value::Bool(json.get<bool>());
    case Type::number_integer:
      return Value::Int(json.get<int64_t>());
    case Type::number_unsigned: {
      auto u = json.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value::Int(static_cast<int64_t>(u));
      return Value::Float(static_cast<double>(u));
    }
    case Type::number_float:
      return Value::Float(json.get<double>());
    case Type::string:
      return Value::String(json.get<std::string>());
    case Type::array: {
      ValueList items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(FromJson(item));
      return Value::List(std::move(items));
    }
    case Type::object: {
      Dict dict;
      for (const auto& [k, item] : json.items()) dict.Set(k, FromJson(item));
      return Value::MakeDict(std::move(dict));
    }
    case Type::binary:
      break;
  }
  return Value::None();
}

// ---------------------------------------------------------------------------------------------
// Python str semantics

namespace pystr {

namespace {

// Bytes that are not UTF-8 decode to U+DC80..U+DCFF (Python's surrogateescape) and encode back.
constexpr char32_t kEscapedByteBase = 0xdc00;

bool IsLineBreak(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

std::string IcuCaseMap(std::string_view s, bool upper) {
  icu::UnicodeString u =
      icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  if (upper) {
    u.toUpper(icu::Locale::getRoot());
  } else {
    u.toLower(icu::Locale::getRoot());
  }
  std::string out;
  u.toUTF8String(out);
  return out;
}

// Python's _PyUnicode_ToTitleFull of one character.
void AppendTitleCase(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c >= 'a' && c <= 'z' ? c - 32 : c));
    return;
  }
  std::string in;
  AppendCodePoint(c, &in);
  UErrorCode status = U_ZERO_ERROR;
  UCaseMap* map = ucasemap_open(
      "", U_TITLECASE_WHOLE_STRING | U_TITLECASE_NO_LOWERCASE | U_TITLECASE_NO_BREAK_ADJUSTMENT,
      &status);
  char buf[32];
  int32_t n = 0;
  if (U_SUCCESS(status)) {
    n = ucasemap_utf8ToTitle(map, buf, sizeof buf, in.data(), static_cast<int32_t>(in.size()),
                             &status);
  }
  if (map != nullptr) ucasemap_close(map);
  if (U_SUCCESS(status) && n > 0) {
    out->append(buf, static_cast<size_t>(n));
  } else {
    AppendCodePoint(static_cast<char32_t>(u_totitle(static_cast<UChar32>(c))), out);
  }
}

void AppendLowerCase(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c));
    return;
  }
  std::string in;
  AppendCodePoint(c, &in);
  *out += IcuCaseMap(in, false);
}

bool IsCased(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASED);
}
bool IsCaseIgnorable(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASE_IGNORABLE);
}

// Python's lower_ucs4 for cps[i]: the full lowercase mapping, where a capital sigma becomes
// the final form when it ends a word (Unicode's Final_Sigma context, over the whole string).
void AppendLowerAt(const std::u32string& cps, size_t i, std::string* out) {
  char32_t c = cps[i];
  if (c != 0x3a3) {
    AppendLowerCase(c, out);
    return;
  }
  size_t j = i;
  char32_t before = 0;
  while (j > 0) {
    before = cps[--j];
    if (!IsCaseIgnorable(before)) break;
  }
  bool final_sigma = i > 0 && !IsCaseIgnorable(before) ? IsCased(before) : false;
  if (final_sigma) {
    size_t k = i + 1;
    while (k < cps.size() && IsCaseIgnorable(cps[k])) ++k;
    final_sigma = k == cps.size() || !IsCased(cps[k]);
  }
  AppendCodePoint(final_sigma ? 0x3c2 : 0x3c3, out);
}

}  // namespace

std::u32string Decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      out.push_back(b);
      ++i;
      continue;
    }
    int len = b >= 0xf0 && b < 0xf5 ? 4 : b >= 0xe0 ? 3 : b >= 0xc2 && b < 0xe0 ? 2 : 0;
    if (b >= 0xf5) len = 0;
    char32_t c = len == 2 ? (b & 0x1f) : len == 3 ? (b & 0x0f) : (b & 0x07);
    bool ok = len > 0 && i + static_cast<size_t>(len) <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      auto cb = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((cb & 0xc0) != 0x80) ok = false;
      c = (c << 6) | (cb & 0x3f);
    }
    if (ok && ((len == 3 && (c < 0x800 || (c >= 0xd800 && c < 0xe000))) ||
               (len == 4 && (c < 0x10000 || c > 0x10ffff)))) {
      ok = false;
    }
    if (!ok) {
      out.push_back(kEscapedByteBase + b);
      ++i;
      continue;
    }
    out.push_back(c);
    i += static_cast<size_t>(len);
  }
  return out;
}

void AppendCodePoint(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else if (c >= kEscapedByteBase + 0x80 && c <= kEscapedByteBase + 0xff) {
    out->push_back(static_cast<char>(c - kEscapedByteBase));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3f)));
  }
}

std::string Encode(std::u32string_view code_points) {
  std::string out;
  out.reserve(code_points.size());
  for (char32_t c : code_points) AppendCodePoint(c, &out);
  return out;
}

bool IsAscii(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

size_t Length(std::string_view s) {
  if (IsAscii(s)) return s.size();
  return Decode(s).size();
}

bool IsSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

std::string Strip(std::string_view s, const std::string* chars, bool left, bool right) {
  std::u32string set;
  if (chars != nullptr) set = Decode(*chars);
  auto strip = [&](char32_t c) {
    return chars == nullptr ? IsSpace(c) : set.find(c) != std::u32string::npos;
  };
  // Only the edges are decoded: one code point at a time from each end.
  size_t begin = 0;
  size_t end = s.size();
  if (left) {
    while (begin < end) {
      size_t len = 1;
      while (begin + len < end && len < 4 &&
             (static_cast<unsigned char>(s[begin + len]) & 0xc0) == 0x80)
        ++len;
      std::u32string c = Decode(s.substr(begin, len));
      if (!strip(c[0])) break;
      begin += c.size() == 1 ? len : 1;  // an invalid sequence decodes byte by byte
    }
  }
  if (right) {
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && end - start < 4 &&
             (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80)
        --start;
      std::u32string c = Decode(s.substr(start, end - start));
      if (!strip(c.back())) break;
      end -= c.size() == 1 ? end - start : 1;
    }
  }
  return std::string(s.substr(begin, end - begin));
}

std::vector<std::string> Split(std::string_view s, const std::string* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (maxsplit < 0) maxsplit = INT64_MAX;
  if (sep != nullptr) {
    size_t pos = 0;
    while (maxsplit-- > 0) {
      size_t hit = s.find(*sep, pos);
      if (hit == std::string_view::npos) break;
      out.emplace_back(s.substr(pos, hit - pos));
      pos = hit + sep->size();
    }
    out.emplace_back(s.substr(pos));
    return out;
  }
  std::u32string cps = Decode(s);
  size_t n = cps.size();
  size_t i = 0;
  while (maxsplit-- > 0) {
    while (i < n && IsSpace(cps[i])) ++i;
    if (i == n) break;
    size_t j = i++;
    while (i < n && !IsSpace(cps[i])) ++i;
    out.push_back(Encode(std::u32string_view(cps).substr(j, i - j)));
  }
  if (i < n) {
    while (i < n && IsSpace(cps[i])) ++i;
    if (i != n) out.push_back(Encode(std::u32string_view(cps).substr(i)));
  }
  return out;
}

std::vector<std::string> RSplit(std::string_view s, const std::string* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (maxsplit < 0) maxsplit = INT64_MAX;
  if (sep != nullptr) {
    size_t end = s.size();
    while (maxsplit-- > 0) {
      if (end < sep->size()) break;
      size_t hit = s.rfind(*sep, end - sep->size());
      if (hit == std::string_view::npos) break;
      out.emplace_back(s.substr(hit + sep->size(), end - hit - sep->size()));
      end = hit;
    }
    out.emplace_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
    return out;
  }
  std::u32string cps = Decode(s);
  auto i = static_cast<int64_t>(cps.size()) - 1;
  while (maxsplit-- > 0) {
    while (i >= 0 && IsSpace(cps[static_cast<size_t>(i)])) --i;
    if (i < 0) break;
    int64_t j = i--;
    while (i >= 0 && !IsSpace(cps[static_cast<size_t>(i)])) --i;
    out.push_back(Encode(
        std::u32string_view(cps).substr(static_cast<size_t>(i + 1), static_cast<size_t>(j - i))));
  }
  if (i >= 0) {
    while (i >= 0 && IsSpace(cps[static_cast<size_t>(i)])) --i;
    if (i >= 0)
      out.push_back(Encode(std::u32string_view(cps).substr(0, static_cast<size_t>(i + 1))));
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> SplitLines(std::string_view s) {
  std::vector<std::string> out;
  std::u32string cps = Decode(s);
  size_t i = 0;
  size_t n = cps.size();
  while (i < n) {
    size_t j = i;
    while (i < n && !IsLineBreak(cps[i])) ++i;
    size_t eol = i;
    if (i < n) i += (cps[i] == '\r' && i + 1 < n && cps[i + 1] == '\n') ? 2 : 1;
    out.push_back(Encode(std::u32string_view(cps).substr(j, eol - j)));
  }
  return out;
}

std::string Replace(std::string_view s, std::string_view old_text, std::string_view new_text,
                    int64_t count) {
  if (count < 0) count = INT64_MAX;
  std::string out;
  if (old_text.empty()) {
    // Python inserts `new` before every character and at the end.
    std::u32string cps = Decode(s);
    for (char32_t c : cps) {
      if (count > 0) {
        out += new_text;
        --count;
      }
      AppendCodePoint(c, &out);
    }
    if (count > 0) out += new_text;
    return out;
  }
  size_t pos = 0;
  while (count-- > 0) {
    size_t hit = s.find(old_text, pos);
    if (hit == std::string_view::npos) break;
    out += s.substr(pos, hit - pos);
    out += new_text;
    pos = hit + old_text.size();
  }
  out += s.substr(pos);
  return out;
}

std::string Upper(std::string_view s) {
  if (IsAscii(s)) {
    std::string out(s);
    for (char& c : out) {
      if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
    }
    return out;
  }
  return IcuCaseMap(s, true);
}

std::string Lower(std::string_view s) {
  if (IsAscii(s)) {
    std::string out(s);
    for (char& c : out) {
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
    }
    return out;
  }
  return IcuCaseMap(s, false);
}

std::string Title(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  bool previous_is_cased = false;
  std::u32string cps = Decode(s);
  for (size_t i = 0; i < cps.size(); ++i) {
    char32_t c = cps[i];
    if (previous_is_cased) {
      AppendLowerAt(cps, i, &out);
    } else {
      AppendTitleCase(c, &out);
    }
    previous_is_cased = c < 0x80 ? ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') : IsCased(c);
  }
  return out;
}

std::string Capitalize(std::string_view s) {
  std::u32string cps = Decode(s);
  if (cps.empty()) return "";
  std::string out;
  AppendTitleCase(cps[0], &out);
  for (size_t i = 1; i < cps.size(); ++i) AppendLowerAt(cps, i, &out);
  return out;
}

std::string JinjaTitle(std::string_view s) {
  // re.split(r"([-\s({\[<]+)", s): separators stay as they are; each word is
  // word[0].upper() + word[1:].lower().
  auto is_separator = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || IsSpace(c);
  };
  std::u32string cps = Decode(s);
  std::string out;
  size_t i = 0;
  while (i < cps.size()) {
    if (is_separator(cps[i])) {
      AppendCodePoint(cps[i++], &out);
      continue;
    }
    size_t j = i;
    while (j < cps.size() && !is_separator(cps[j])) ++j;
    out += Upper(Encode(std::u32string_view(cps).substr(i, 1)));
    out += Lower(Encode(std::u32string_view(cps).substr(i + 1, j - i - 1)));
    i = j;
  }
  return out;
}

bool IsLower(std::string_view s) {
  bool cased = false;
  for (char32_t c : Decode(s)) {
    auto u = static_cast<UChar32>(c);
    if (u_hasBinaryProperty(u, UCHAR_UPPERCASE) || u_istitle(u)) return false;
    if (u_hasBinaryProperty(u, UCHAR_LOWERCASE)) cased = true;
  }
  return cased;
}

bool IsUpper(std::string_view s) {
  bool cased = false;
  for (char32_t c : Decode(s)) {
    auto u = static_cast<UChar32>(c);
    if (u_hasBinaryProperty(u, UCHAR_LOWERCASE) || u_istitle(u)) return false;
    if (u_hasBinaryProperty(u, UCHAR_UPPERCASE)) cased = true;
  }
  return cased;
}

bool IsDigit(std::string_view s) {
  if (s.empty()) return false;
  for (char32_t c : Decode(s)) {
    int type = u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE);
    if (type != U_NT_DECIMAL && type != U_NT_DIGIT) return false;
  }
  return true;
}

bool IsAlpha(std::string_view s) {
  if (s.empty()) return false;
  for (char32_t c : Decode(s)) {
    if (!u_isalpha(static_cast<UChar32>(c))) return false;
  }
  return true;
}

bool IsAlnum(std::string_view s) {
  if (s.empty()) return false;
  for (char32_t c : Decode(s)) {
    auto u = static_cast<UChar32>(c);
    if (!u_isalpha(u) && u_getIntPropertyValue(u, UCHAR_NUMERIC_TYPE) == U_NT_NONE) return false;
  }
  return true;
}

bool IsSpaceString(std::string_view s) {
  if (s.empty()) return false;
  for (char32_t c : Decode(s)) {
    if (!IsSpace(c)) return false;
  }
  return true;
}

int64_t Find(std::string_view s, std::string_view sub, bool reverse) {
  size_t hit = reverse ? s.rfind(sub) : s.find(sub);
  if (hit == std::string_view::npos) return -1;
  return static_cast<int64_t>(Length(s.substr(0, hit)));
}

int64_t Count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return static_cast<int64_t>(Length(s)) + 1;
  int64_t n = 0;
  size_t pos = 0;
  while ((pos = s.find(sub, pos)) != std::string_view::npos) {
    ++n;
    pos += sub.size();
  }
  return n;
}

}  // namespace pystr

}  // namespace flywheel::tokenizer::jinja
