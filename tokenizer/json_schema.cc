#include "tokenizer/json_schema.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "tokenizer/grammar.h"

namespace flywheel::tokenizer {
namespace {

using ojson = nlohmann::ordered_json;

const std::set<std::string> kKeywords = {
    "type",     "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "minLength", "maxLength", "pattern",  "format", "enum", "const", "anyOf"};
const std::set<std::string> kAnnotations = {"title",   "description", "default",  "examples",
                                            "$schema", "$id",         "$comment", "readOnly",
                                            "writeOnly", "deprecated"};

constexpr const char* kComma = ",[ ]?";
constexpr const char* kColon = ":[ ]?";
constexpr const char* kChar = "(?:[^\"\\\\\\x00-\\x1f]|\\\\[\"\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4})";
constexpr const char* kInteger = "-?(?:0|[1-9][0-9]{0,15})";
constexpr const char* kNumber = "-?(?:0|[1-9][0-9]{0,15})(?:\\.[0-9]{1,16})?(?:[eE][+-]?[0-9]{1,2})?";
constexpr const char* kDate = "[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])";
constexpr const char* kTime =
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])";
constexpr const char* kUuid = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";

Status Unsupported(const std::string& what, const std::string& path) {
  return Status::InvalidArgument(what + " at " + path + " is not supported");
}

Status Bad(const std::string& what, const std::string& path) {
  return Status::InvalidArgument(what + " at " + path);
}

// A non-negative integer keyword, or `fallback` when absent.
Result<int64_t> Count(const ojson& s, const char* key, int64_t fallback, const std::string& path) {
  auto it = s.find(key);
  if (it == s.end()) return fallback;
  if (!it->is_number_integer() || it->get<int64_t>() < 0)
    return Bad(std::string("'") + key + "' must be a non-negative integer", path);
  if (it->get<int64_t>() > kRegexMaxRepeat)
    return Bad(std::string("'") + key + "' over " + std::to_string(kRegexMaxRepeat), path);
  return it->get<int64_t>();
}

// "{min,max}" (max -1: unbounded).
std::string Bounds(int64_t min, int64_t max) {
  return "{" + std::to_string(min) + "," + (max < 0 ? std::string() : std::to_string(max)) + "}";
}

class Compiler {
 public:
  Result<std::string> Value(const ojson& s, const std::string& path, int depth) {
    if (depth > kJsonSchemaMaxDepth) return Bad("a schema nested deeper than " + std::to_string(kJsonSchemaMaxDepth), path);
    if (s.is_boolean()) return Unsupported(s.get<bool>() ? "the schema 'true' (any value)" : "the schema 'false'", path);
    if (!s.is_object()) return Bad("a schema must be an object", path);
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (!kKeywords.count(it.key()) && !kAnnotations.count(it.key())) return Unsupported("'" + it.key() + "'", path);
    }
    if (auto e = s.find("const"); e != s.end()) return EscapeRegex(e->dump());
    if (auto e = s.find("enum"); e != s.end()) return Enum(*e, path);
    if (auto a = s.find("anyOf"); a != s.end()) return AnyOf(*a, path, depth);
    auto type = s.find("type");
    if (type == s.end()) {
      if (s.contains("properties")) return Object(s, path, depth);
      return Unsupported("a schema without 'type'", path);
    }
    if (type->is_array()) {
      if (type->empty()) return Bad("'type' is an empty list", path);
      std::string out;
      for (const ojson& t : *type) {
        ojson one = s;
        one["type"] = t;
        FW_ASSIGN_OR_RETURN(std::string r, Value(one, path, depth));
        out += (out.empty() ? "(?:" : "|") + r;
      }
      return out + ")";
    }
    if (!type->is_string()) return Bad("'type' must be a string or a list of strings", path);
    return Typed(type->get<std::string>(), s, path, depth);
  }

 private:
  Result<std::string> Typed(const std::string& type, const ojson& s, const std::string& path, int depth) {
    if (type == "string") return String(s, path);
    if (type == "integer") return std::string(kInteger);
    if (type == "number") return std::string(kNumber);
    if (type == "boolean") return std::string("(?:true|false)");
    if (type == "null") return std::string("null");
    if (type == "object") return Object(s, path, depth);
    if (type == "array") return Array(s, path, depth);
    return Bad("unknown type '" + type + "'", path);
  }

  static Result<std::string> Enum(const ojson& values, const std::string& path) {
    if (!values.is_array() || values.empty()) return Bad("'enum' must be a non-empty list", path);
    std::string out = "(?:";
    for (size_t i = 0; i < values.size(); ++i) out += (i ? "|" : "") + EscapeRegex(values[i].dump());
    return out + ")";
  }

  Result<std::string> AnyOf(const ojson& options, const std::string& path, int depth) {
    if (!options.is_array() || options.empty()) return Bad("'anyOf' must be a non-empty list", path);
    std::string out = "(?:";
    for (size_t i = 0; i < options.size(); ++i) {
      FW_ASSIGN_OR_RETURN(std::string r, Value(options[i], path + ".anyOf[" + std::to_string(i) + "]", depth + 1));
      out += (i ? "|" : "") + r;
    }
    return out + ")";
  }

  static Result<std::string> String(const ojson& s, const std::string& path) {
    FW_ASSIGN_OR_RETURN(int64_t min, Count(s, "minLength", 0, path));
    FW_ASSIGN_OR_RETURN(int64_t max, Count(s, "maxLength", -1, path));
    if (max >= 0 && max < min) return Bad("'maxLength' below 'minLength'", path);
    const bool bounded = s.contains("minLength") || s.contains("maxLength");
    if (auto f = s.find("format"); f != s.end()) {
      if (s.contains("pattern") || bounded) return Unsupported("'format' with 'pattern' or lengths", path);
      const std::string format = f->is_string() ? f->get<std::string>() : f->dump();
      if (format == "date") return "\"" + std::string(kDate) + "\"";
      if (format == "time") return "\"" + std::string(kTime) + "\"";
      if (format == "date-time") return "\"" + std::string(kDate) + "T" + kTime + "\"";
      if (format == "uuid") return "\"" + std::string(kUuid) + "\"";
      return Unsupported("format '" + format + "' (supported: date, time, date-time, uuid)", path);
    }
    if (auto p = s.find("pattern"); p != s.end()) {
      if (bounded) return Unsupported("'pattern' with 'minLength' or 'maxLength'", path);
      if (!p->is_string()) return Bad("'pattern' must be a string", path);
      return Pattern(p->get<std::string>(), path);
    }
    return "\"" + std::string(kChar) + Bounds(min, max) + "\"";
  }

  // The pattern, checked to write nothing a JSON string must escape.
  static Result<std::string> Pattern(std::string pattern, const std::string& path) {
    if (!pattern.empty() && pattern.front() == '^') pattern.erase(0, 1);
    if (!pattern.empty() && pattern.back() == '$' && (pattern.size() < 2 || pattern[pattern.size() - 2] != '\\'))
      pattern.pop_back();
    auto compiled = CompileRegex(pattern);
    if (!compiled.ok()) return Bad("'pattern': " + compiled.status().message(), path);
    ByteGrammar& g = **compiled;
    std::set<std::string> seen = {g.Start()};
    std::vector<std::string> todo = {g.Start()};
    while (!todo.empty()) {
      const std::string state = todo.back();
      todo.pop_back();
      for (int b = 0; b < 256; ++b) {
        std::string next = state;
        if (!g.Step(next, static_cast<uint8_t>(b))) continue;
        if (b == '"' || b == '\\' || b < 0x20)
          return Unsupported("'pattern' that can write '\"', '\\' or a control character", path);
        if (seen.insert(next).second) todo.push_back(std::move(next));
      }
    }
    return "\"(?:" + pattern + ")\"";
  }

  Result<std::string> Object(const ojson& s, const std::string& path, int depth) {
    auto props = s.find("properties");
    if (props == s.end() || !props->is_object())
      return Unsupported("an object without 'properties' (for any object use response_format json_object)", path);
    std::set<std::string> required;
    if (auto r = s.find("required"); r != s.end()) {
      if (!r->is_array()) return Bad("'required' must be a list", path);
      for (const ojson& name : *r) {
        if (!name.is_string() || !props->contains(name.get<std::string>()))
          return Bad("required property " + name.dump() + " is not in 'properties'", path);
        required.insert(name.get<std::string>());
      }
    }
    std::vector<std::string> parts;
    std::vector<bool> needed;
    for (auto it = props->begin(); it != props->end(); ++it) {
      FW_ASSIGN_OR_RETURN(std::string v, Value(it.value(), path + ".properties." + it.key(), depth + 1));
      parts.push_back(EscapeRegex(ojson(it.key()).dump()) + kColon + v);
      needed.push_back(required.count(it.key()) > 0);
    }
    return "\\{" + Members(parts, needed) + "\\}";
  }

  // The properties in order, each optional one present or not, commas between: one
  // alternative per property that can come first (those up to the first required one).
  static std::string Members(const std::vector<std::string>& parts, const std::vector<bool>& needed) {
    std::string alternatives;
    bool any_required = false;
    for (size_t first = 0; first < parts.size(); ++first) {
      std::string alt = parts[first];
      for (size_t j = first + 1; j < parts.size(); ++j)
        alt += "(?:" + std::string(kComma) + parts[j] + ")" + (needed[j] ? "" : "?");
      alternatives += (alternatives.empty() ? "" : "|") + alt;
      if (needed[first]) {
        any_required = true;
        break;
      }
    }
    if (parts.empty()) return "";
    return "(?:" + alternatives + ")" + (any_required ? "" : "?");
  }

  Result<std::string> Array(const ojson& s, const std::string& path, int depth) {
    auto items = s.find("items");
    if (items == s.end()) return Unsupported("an array without 'items'", path);
    FW_ASSIGN_OR_RETURN(int64_t min, Count(s, "minItems", 0, path));
    FW_ASSIGN_OR_RETURN(int64_t max, Count(s, "maxItems", -1, path));
    if (max >= 0 && max < min) return Bad("'maxItems' below 'minItems'", path);
    FW_ASSIGN_OR_RETURN(std::string item, Value(*items, path + ".items", depth + 1));
    if (max == 0) return std::string("\\[\\]");
    const std::string rest = "(?:" + std::string(kComma) + item + ")" +
                             Bounds(std::max<int64_t>(min - 1, 0), max < 0 ? -1 : max - 1);
    const std::string some = "(?:" + item + rest + ")";
    return "\\[" + some + (min == 0 ? "?" : "") + "\\]";
  }
};

int64_t CodePoints(const std::string& s) {
  return std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<uint8_t>(c) & 0xC0) != 0x80; });
}

bool TypeMatches(const std::string& type, const ojson& v) {
  if (type == "string") return v.is_string();
  if (type == "integer") return v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>());
  if (type == "number") return v.is_number();
  if (type == "boolean") return v.is_boolean();
  if (type == "null") return v.is_null();
  if (type == "object") return v.is_object();
  if (type == "array") return v.is_array();
  return false;
}

Status Check(const ojson& s, const ojson& v, const std::string& path);

Status CheckContents(const ojson& s, const ojson& v, const std::string& path) {
  if (v.is_string()) {
    const int64_t n = CodePoints(v.get<std::string>());
    if (n < s.value("minLength", int64_t{0}) || (s.contains("maxLength") && n > s["maxLength"].get<int64_t>()))
      return Status::Mismatch(path + ": string length " + std::to_string(n) + " outside the bounds");
    if (auto p = s.find("pattern"); p != s.end()) {
      auto g = CompileRegex(p->get<std::string>());
      if (!g.ok() || !GrammarAccepts(**g, v.get<std::string>()))
        return Status::Mismatch(path + ": " + ojson(v).dump() + " does not match the pattern");
    }
  }
  if (v.is_array()) {
    const int64_t n = static_cast<int64_t>(v.size());
    if (n < s.value("minItems", int64_t{0}) || (s.contains("maxItems") && n > s["maxItems"].get<int64_t>()))
      return Status::Mismatch(path + ": " + std::to_string(n) + " items, outside the bounds");
    if (auto items = s.find("items"); items != s.end()) {
      for (size_t i = 0; i < v.size(); ++i) FW_RETURN_IF_ERROR(Check(*items, v[i], path + "[" + std::to_string(i) + "]"));
    }
  }
  if (v.is_object() && s.contains("properties")) {
    const ojson& props = s["properties"];
    for (const ojson& name : s.value("required", ojson::array())) {
      if (!v.contains(name.get<std::string>())) return Status::Mismatch(path + ": required " + name.dump() + " missing");
    }
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (props.contains(it.key())) {
        FW_RETURN_IF_ERROR(Check(props[it.key()], it.value(), path + "." + it.key()));
      } else if (s.value("additionalProperties", ojson(true)) == ojson(false)) {
        return Status::Mismatch(path + ": property '" + it.key() + "' is not allowed");
      }
    }
  }
  return Status::Ok();
}

Status Check(const ojson& s, const ojson& v, const std::string& path) {
  if (auto c = s.find("const"); c != s.end() && *c != v) return Status::Mismatch(path + ": not the const value");
  if (auto e = s.find("enum"); e != s.end() && std::find(e->begin(), e->end(), v) == e->end())
    return Status::Mismatch(path + ": " + v.dump() + " is not in the enum");
  if (auto a = s.find("anyOf"); a != s.end()) {
    bool any = false;
    for (const ojson& option : *a) any = any || Check(option, v, path).ok();
    if (!any) return Status::Mismatch(path + ": matches no 'anyOf' option");
  }
  if (auto t = s.find("type"); t != s.end()) {
    bool ok = false;
    if (t->is_array()) {
      for (const ojson& one : *t) ok = ok || TypeMatches(one.get<std::string>(), v);
    } else {
      ok = TypeMatches(t->get<std::string>(), v);
    }
    if (!ok) return Status::Mismatch(path + ": " + v.dump() + " is not of type " + t->dump());
  }
  return CheckContents(s, v, path);
}

}  // namespace

Result<std::string> JsonSchemaRegex(const ojson& schema) { return Compiler().Value(schema, "$", 0); }

Status CheckJsonSchema(const ojson& schema, const ojson& value) { return Check(schema, value, "$"); }

}  // namespace flywheel::tokenizer
