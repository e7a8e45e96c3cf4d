// Values of the chat-template language (tokenizer/chat_template.h) and the Python semantics
// they follow, because what a template prints is Python's str() of them: truthiness, str()
// and repr(), == and <, json.dumps, and the str methods HF templates call. Strings are UTF-8
// and are indexed, sliced and measured by code point, as Python's str is.
//
// Private to flywheel_tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "base/status.h"

namespace flywheel::tokenizer::jinja {

class Value;
using ValueList = std::vector<Value>;

// A Python dict with str keys: insertion order is kept (json.dumps prints keys in it), a key
// set again keeps its place. Lookups are linear: template dicts are small.
class Dict {
 public:
  const Value* Find(std::string_view key) const;
  void Set(std::string key, Value value);
  const std::vector<std::pair<std::string, Value>>& items() const { return items_; }
  size_t size() const { return items_.size(); }

 private:
  std::vector<std::pair<std::string, Value>> items_;
};

// The runtime objects that are not data (namespaces, macros, loop state, bound methods,
// global functions); the interpreter defines them, Value only carries them.
struct Object {
  virtual ~Object() = default;
  // What Python's repr() shows for it ("<Macro 'name'>").
  virtual std::string Repr() const = 0;
};

// jinja2's Namespace: the one mutable value (`{% set ns.attr = ... %}`).
struct Namespace final : Object {
  Dict attributes;
  std::string Repr() const override;
};

class Value {
 public:
  enum class Kind : uint8_t {
    kUndefined,  // jinja2's default Undefined; carries the message an error on it reports
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kTuple,
    kIterator,  // what a generator (select, map, unique, items, ...) yields, already drawn
    kDict,
    kNamespace,
    kMacro,
    kLoop,
    kMethod,    // a bound method (`s.startswith` without the call)
    kFunction,  // a global: range, namespace, dict, raise_exception, strftime_now
  };

  Value() = default;  // undefined
  static Value Undefined(std::string message);
  static Value None();
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double d);
  static Value String(std::string s);
  static Value List(ValueList items);
  static Value Tuple(ValueList items);
  static Value Iterator(ValueList items);
  static Value MakeDict(Dict dict);
  // REQUIRES: kind is one of the Object kinds (kNamespace .. kFunction).
  static Value MakeObject(Kind kind, std::shared_ptr<Object> object);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  // bool, int and float: Python's numbers (bool is an int there).
  bool is_number() const { return kind_ == Kind::kBool || kind_ == Kind::kInt || is_float(); }
  bool is_string() const { return kind_ == Kind::kString; }
  // list, tuple or iterator: the kinds with ValueList storage.
  bool is_sequence() const {
    return kind_ == Kind::kList || kind_ == Kind::kTuple || kind_ == Kind::kIterator;
  }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_object() const { return kind_ >= Kind::kNamespace; }

  // Accessors. REQUIRES: the matching kind.
  bool as_bool() const { return std::get<bool>(data_); }
  int64_t as_int() const { return std::get<int64_t>(data_); }
  double as_float() const { return std::get<double>(data_); }
  const std::string& as_string() const { return *std::get<SharedString>(data_); }
  const ValueList& as_list() const { return *std::get<std::shared_ptr<const ValueList>>(data_); }
  const std::shared_ptr<const ValueList>& list_ptr() const {
    return std::get<std::shared_ptr<const ValueList>>(data_);
  }
  const Dict& as_dict() const { return *std::get<std::shared_ptr<const Dict>>(data_); }
  Object* object() const { return std::get<std::shared_ptr<Object>>(data_).get(); }
  const std::shared_ptr<Object>& object_ptr() const {
    return std::get<std::shared_ptr<Object>>(data_);
  }
  // An undefined value's error message ("'x' is undefined").
  // REQUIRES: is_undefined()
  std::string undefined_message() const;
  // bool or int as an int64 (Python's int(True) == 1). REQUIRES: kBool or kInt.
  int64_t integer() const { return is_bool() ? (as_bool() ? 1 : 0) : as_int(); }
  // Any number as a double. REQUIRES: is_number()
  double number() const { return is_float() ? as_float() : static_cast<double>(integer()); }

 private:
  Kind kind_ = Kind::kUndefined;
  // Strings are shared and immutable (as Python's are), so copying a Value never copies text.
  using SharedString = std::shared_ptr<const std::string>;
  std::variant<std::monostate, bool, int64_t, double, SharedString,
               std::shared_ptr<const ValueList>, std::shared_ptr<const Dict>,
               std::shared_ptr<Object>>
      data_;
};

// Python's type name of `v` ("str", "int", "dict", "NoneType", "generator", "Undefined", ...),
// for error messages.
const char* TypeName(const Value& v);
// Python's bool(v).
bool Truthy(const Value& v);
// Python's str(v), appended to `out`: None -> "None", True -> "True", 1.0 -> "1.0",
// undefined -> "", a list -> its repr.
void AppendStr(const Value& v, std::string* out);
std::string Str(const Value& v);
// Python's repr(v): strings quoted and escaped as Python does.
void AppendRepr(const Value& v, std::string* out);
// Python's repr of a float: the shortest digits that read back the same, "1.0", "1e+16",
// "1e-05", "inf", "nan".
std::string FormatFloat(double d);
// Python's ==: 1 == 1.0 == True; a list never equals a tuple; an undefined equals only an
// undefined.
bool Equals(const Value& a, const Value& b);
// Python's ordering for <, <=, >, >=: -1, 0 or 1; numbers, strings (by code point), and lists
// or tuples (element by element) order; anything else is a TypeError, returned as a Status.
Result<int> Compare(const Value& a, const Value& b);

// json.dumps(v, ensure_ascii=..., indent=..., separators=..., sort_keys=...) as transformers'
// `tojson` filter calls it.
struct JsonOptions {
  std::optional<std::string> indent;  // per level; none: one line
  std::string item_separator = ", ";  // json.dumps: "," when indent is given
  std::string key_separator = ": ";
  bool ensure_ascii = false;
  bool sort_keys = false;
};
// Fails as json.dumps does on what JSON cannot hold (undefined, a macro, a generator).
Status AppendJson(const Value& v, const JsonOptions& options, std::string* out);

// The template's view of a JSON value: objects become dicts (key order kept), arrays lists,
// integers ints (unsigned ones above INT64_MAX become floats) and other numbers floats.
Value FromJson(const nlohmann::ordered_json& json);

// Python str semantics on UTF-8. Bytes that are not UTF-8 count as one code point each and
// come back unchanged.
namespace pystr {

std::u32string Decode(std::string_view s);
std::string Encode(std::u32string_view code_points);
void AppendCodePoint(char32_t c, std::string* out);
size_t Length(std::string_view s);  // len(s)
bool IsAscii(std::string_view s);
// str.isspace() of one character (Unicode White_Space as Python defines it).
bool IsSpace(char32_t c);
// s.strip(chars) / lstrip / rstrip; `chars` null: whitespace.
std::string Strip(std::string_view s, const std::string* chars, bool left, bool right);
// s.split(sep, maxsplit) and s.rsplit(sep, maxsplit); `sep` null: runs of whitespace.
// REQUIRES: sep is null or not empty (the caller raises Python's ValueError).
std::vector<std::string> Split(std::string_view s, const std::string* sep, int64_t maxsplit);
std::vector<std::string> RSplit(std::string_view s, const std::string* sep, int64_t maxsplit);
// s.splitlines(): the line boundaries Python knows (\n, \r, \r\n, \v, \f, \x1c-\x1e, \x85,
// \u2028, \u2029), without the line ends.
std::vector<std::string> SplitLines(std::string_view s);
// s.replace(old, new, count); count < 0: all.
std::string Replace(std::string_view s, std::string_view old_text, std::string_view new_text,
                    int64_t count);
// s.upper(), s.lower(): full Unicode case mappings ("ß".upper() == "SS").
std::string Upper(std::string_view s);
std::string Lower(std::string_view s);
// s.title() and s.capitalize() as Python defines them.
std::string Title(std::string_view s);
std::string Capitalize(std::string_view s);
// jinja2's `title` filter: each word (split at whitespace and -({[<) upper-cases its first
// character and lower-cases the rest.
std::string JinjaTitle(std::string_view s);
// The predicates Python's str.islower() / isupper() / isdigit() / isalpha() / isalnum() /
// isspace() compute over a whole string.
bool IsLower(std::string_view s);
bool IsUpper(std::string_view s);
bool IsDigit(std::string_view s);
bool IsAlpha(std::string_view s);
bool IsAlnum(std::string_view s);
bool IsSpaceString(std::string_view s);
// s.find(sub) / s.rfind(sub) / s.count(sub) in code points; -1 when absent.
int64_t Find(std::string_view s, std::string_view sub, bool reverse);
int64_t Count(std::string_view s, std::string_view sub);

}  // namespace pystr

}  // namespace flywheel::tokenizer::jinja
