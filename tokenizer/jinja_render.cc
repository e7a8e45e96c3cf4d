// The interpreter of the chat-template language: statements, expressions, and the builtin
// filters, tests, methods and globals, with jinja2's (Python's) semantics. The lexer and
// parser are in jinja_parse.cc, values in jinja_value.cc.
#include "tokenizer/chat_template.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <optional>

#include "base/env.h"
#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_value.h"

namespace flywheel::tokenizer {

namespace jinja {
namespace {

// ---------------------------------------------------------------------------------------------
// Scopes and runtime objects

// Variables of one frame. jinja2 gives a frame to the template, to each for-loop iteration,
// to macro calls and to the bodies of block sets, filter blocks, with and generation; `if`
// has none. Lookups fall through to the enclosing frame; assignments stay in their frame.
struct Scope {
  explicit Scope(std::shared_ptr<Scope> parent_scope) : parent(std::move(parent_scope)) {
    vars.reserve(4);
  }

  const Value* Find(int id) const {
    for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
      for (const auto& [k, v] : s->vars) {
        if (k == id) return &v;
      }
    }
    return nullptr;
  }
  void Set(int id, Value value) {
    for (auto& [k, v] : vars) {
      if (k == id) {
        v = std::move(value);
        return;
      }
    }
    vars.emplace_back(id, std::move(value));
  }

  std::shared_ptr<Scope> parent;
  std::vector<std::pair<int, Value>> vars;
};
using ScopePtr = std::shared_ptr<Scope>;

struct MacroObject final : Object {
  std::string Repr() const override { return "<Macro '" + definition->name + "'>"; }
  const Stmt* definition = nullptr;
  // Weak: the scope holds the macro, and a macro outliving its scope is refused at the call.
  std::weak_ptr<Scope> closure;
};

struct LoopObject final : Object {
  std::string Repr() const override {
    return "<LoopContext " + std::to_string(index + 1) + "/" + std::to_string(items->size()) + ">";
  }
  std::shared_ptr<const ValueList> items;
  size_t index = 0;
};

struct MethodObject final : Object {
  std::string Repr() const override {
    return "<built-in method " + name + " of " + TypeName(self) + " object>";
  }
  Value self;
  std::optional<MethodId> method;  // none: a Python method this subset does not implement
  std::string name;
};

struct FunctionObject final : Object {
  std::string Repr() const override { return "<function " + name + ">"; }
  GlobalId id = GlobalId::kRange;
  std::string name;
};

Status Error(std::string message) {
  return Status::InvalidArgument(std::move(message));
}

// Prefixes the template line unless the message has one already.
Status Locate(const Status& status, int line) {
  static constexpr std::string_view kPrefix = "chat template line ";
  if (status.ok() || status.message().compare(0, kPrefix.size(), kPrefix) == 0) return status;
  return Status(status.code(),
                std::string(kPrefix) + std::to_string(line) + ": " + status.message());
}

// Python's object_type_repr, for undefined messages: "dict object", "None".
std::string ObjectTypeRepr(const Value& v) {
  if (v.is_none()) return "None";
  return std::string(TypeName(v)) + " object";
}

Value NoAttribute(const Value& obj, std::string_view name) {
  return Value::Undefined("'" + ObjectTypeRepr(obj) + "' has no attribute '" + std::string(name) +
                          "'");
}

Value UnsafeAttribute(const Value& obj, std::string_view name) {
  return Value::Undefined("access to attribute '" + std::string(name) + "' of '" + TypeName(obj) +
                          "' object is unsafe.");
}

struct Args {
  ValueList positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// Binds `args` to a Python signature of positional-or-keyword parameters `names`.
Result<std::vector<std::optional<Value>>> Bind(const Args& args,
                                               std::initializer_list<std::string_view> names,
                                               std::string_view callee) {
  std::vector<std::optional<Value>> out(names.size());
  if (args.positional.size() > names.size()) {
    return Error(std::string(callee) + "() takes at most " + std::to_string(names.size()) +
                 " argument(s) (" + std::to_string(args.positional.size()) + " given)");
  }
  for (size_t i = 0; i < args.positional.size(); ++i) out[i] = args.positional[i];
  for (const auto& [key, value] : args.keyword) {
    auto it = std::find(names.begin(), names.end(), key);
    if (it == names.end()) {
      return Error(std::string(callee) + "() got an unexpected keyword argument '" + key + "'");
    }
    size_t index = static_cast<size_t>(it - names.begin());
    if (out[index]) {
      return Error(std::string(callee) + "() got multiple values for argument '" + key + "'");
    }
    out[index] = value;
  }
  return out;
}

Result<std::string> StringArg(const std::optional<Value>& v, std::string_view what) {
  if (!v || !v->is_string()) {
    return Error(std::string(what) + " must be a string, not " + (v ? TypeName(*v) : "nothing"));
  }
  return v->as_string();
}

Result<int64_t> IntArg(const Value& v, std::string_view what) {
  if (v.is_int() || v.is_bool()) return v.integer();
  return Error(std::string(what) + " must be an integer, not " + TypeName(v));
}

// Python's int(s, base) for a str: whitespace around, a sign, `_` between digits, and for
// base 16 / 8 / 2 the 0x / 0o / 0b prefix.
std::optional<int64_t> ParsePythonInt(std::string_view s, int64_t base) {
  std::string t = pystr::Strip(s, nullptr, true, true);
  size_t i = 0;
  bool negative = false;
  if (i < t.size() && (t[i] == '+' || t[i] == '-')) negative = t[i++] == '-';
  if (base == 0) {
    base = 10;
    if (i + 1 < t.size() && t[i] == '0') {
      char p = static_cast<char>(t[i + 1] | 0x20);
      base = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 10;
    }
  }
  if (base < 2 || base > 36) return std::nullopt;
  if (i + 1 < t.size() && t[i] == '0') {
    char p = static_cast<char>(t[i + 1] | 0x20);
    if ((base == 16 && p == 'x') || (base == 8 && p == 'o') || (base == 2 && p == 'b')) {
      i += 2;
      if (i < t.size() && t[i] == '_') ++i;
    }
  }
  if (i >= t.size()) return std::nullopt;
  int64_t value = 0;
  bool previous_digit = false;
  for (; i < t.size(); ++i) {
    char c = t[i];
    if (c == '_') {
      if (!previous_digit || i + 1 >= t.size() || t[i + 1] == '_') return std::nullopt;
      previous_digit = false;
      continue;
    }
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') {
      digit = (c | 0x20) - 'a' + 10;
    } else {
      return std::nullopt;
    }
    if (digit >= base) return std::nullopt;
    if (__builtin_mul_overflow(value, base, &value) ||
        __builtin_add_overflow(value, digit, &value)) {
      return std::nullopt;
    }
    previous_digit = true;
  }
  return negative ? -value : value;
}

// Python's float(s) for a str.
std::optional<double> ParsePythonFloat(std::string_view s) {
  std::string t = pystr::Strip(s, nullptr, true, true);
  std::string lower = pystr::Lower(t);
  std::string_view body = lower;
  double sign = 1;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    sign = body[0] == '-' ? -1 : 1;
    body.remove_prefix(1);
  }
  if (body == "inf" || body == "infinity") return sign * HUGE_VAL;
  if (body == "nan") return std::nan("");
  std::string clean;
  bool digits = false;
  bool previous_digit = false;
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c >= '0' && c <= '9') {
      digits = true;
      previous_digit = true;
      clean += c;
    } else if (c == '_') {
      if (!previous_digit || i + 1 >= body.size() || body[i + 1] < '0' || body[i + 1] > '9') {
        return std::nullopt;
      }
      previous_digit = false;
    } else if (c == '.' || c == 'e' || c == '+' || c == '-') {
      previous_digit = false;
      clean += c;
    } else {
      return std::nullopt;
    }
  }
  if (!digits) return std::nullopt;
  char* end = nullptr;
  double v = std::strtod(clean.c_str(), &end);
  if (end != clean.c_str() + clean.size()) return std::nullopt;
  return sign * v;
}

// Python's slice.indices(length), then the selected indices.
Result<std::vector<int64_t>> SliceIndices(int64_t length, const std::optional<int64_t>& start_arg,
                                          const std::optional<int64_t>& stop_arg,
                                          const std::optional<int64_t>& step_arg) {
  int64_t step = step_arg.value_or(1);
  if (step == 0) return Error("slice step cannot be zero");
  auto adjust = [&](const std::optional<int64_t>& v, int64_t if_missing) {
    if (!v) return if_missing;
    int64_t x = *v;
    if (x < 0) {
      x += length;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= length) {
      x = step < 0 ? length - 1 : length;
    }
    return x;
  };
  int64_t start = adjust(start_arg, step < 0 ? length - 1 : 0);
  int64_t stop = adjust(stop_arg, step < 0 ? -1 : length);
  std::vector<int64_t> out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
    out.push_back(i);
    if (__builtin_add_overflow(i, step, &i)) break;
  }
  return out;
}

// What `for`, `list`, `join` and friends iterate: items of a list / tuple / generator, keys of
// a dict, characters of a str; an undefined value iterates as empty.
Result<std::shared_ptr<const ValueList>> Iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kList:
    case Value::Kind::kTuple:
    case Value::Kind::kIterator:
      return v.list_ptr();
    case Value::Kind::kDict: {
      auto keys = std::make_shared<ValueList>();
      keys->reserve(v.as_dict().size());
      for (const auto& [k, item] : v.as_dict().items()) keys->push_back(Value::String(k));
      return std::shared_ptr<const ValueList>(std::move(keys));
    }
    case Value::Kind::kString: {
      auto chars = std::make_shared<ValueList>();
      for (char32_t c : pystr::Decode(v.as_string())) {
        std::string s;
        pystr::AppendCodePoint(c, &s);
        chars->push_back(Value::String(std::move(s)));
      }
      return std::shared_ptr<const ValueList>(std::move(chars));
    }
    case Value::Kind::kUndefined:
      return std::make_shared<const ValueList>();
    case Value::Kind::kLoop: {
      auto* loop = static_cast<LoopObject*>(v.object());
      return loop->items;
    }
    default:
      return Error(std::string("'") + TypeName(v) + "' object is not iterable");
  }
}

// Python's `item in container`.
Result<bool> In(const Value& item, const Value& container) {
  switch (container.kind()) {
    case Value::Kind::kString:
      if (!item.is_string()) {
        if (item.is_undefined()) return Error(item.undefined_message());
        return Error(std::string("'in <string>' requires string as left operand, not ") +
                     TypeName(item));
      }
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
    case Value::Kind::kIterator:
      for (const Value& v : container.as_list()) {
        if (Equals(v, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      if (item.kind() == Value::Kind::kList || item.kind() == Value::Kind::kDict) {
        return Error(std::string("unhashable type: '") + TypeName(item) + "'");
      }
      return item.is_string() && container.as_dict().Find(item.as_string()) != nullptr;
    case Value::Kind::kUndefined:
      return false;
    default:
      return Error(std::string("argument of type '") + TypeName(container) + "' is not iterable");
  }
}

Status UndefinedOperand(const Value& a, const Value& b) {
  return Error(a.is_undefined() ? a.undefined_message() : b.undefined_message());
}

// The most bytes (or items) one `*`, `%` width or indent may produce: far beyond any prompt,
// and a template cannot exhaust memory with a typo.
constexpr int64_t kMaxRepeat = int64_t{64} << 20;

Result<Value> Repeat(const Value& seq, int64_t times) {
  int64_t unit = seq.is_string() ? static_cast<int64_t>(seq.as_string().size())
                                 : static_cast<int64_t>(seq.as_list().size());
  if (times > 0 && unit > 0 && times > kMaxRepeat / unit) {
    return Status::ResourceExhausted("repetition result larger than 64 MiB");
  }
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += seq.as_string();
    return Value::String(std::move(out));
  }
  ValueList out;
  for (int64_t i = 0; i < times; ++i) {
    out.insert(out.end(), seq.as_list().begin(), seq.as_list().end());
  }
  return seq.kind() == Value::Kind::kTuple ? Value::Tuple(std::move(out))
                                           : Value::List(std::move(out));
}

// Python's printf-style `fmt % args`: conversions s r a d i u x X o e E f F g G c and %%,
// with flags, width, precision and %(key)s for a dict argument.
Result<Value> PercentFormat(const std::string& fmt, const Value& args) {
  ValueList positional;
  const Dict* mapping = nullptr;
  if (args.kind() == Value::Kind::kTuple) {
    positional = args.as_list();
  } else {
    positional.push_back(args);
  }
  // CPython treats any non-tuple, non-str argument with __getitem__ as a mapping: it never
  // complains about unconverted arguments then.
  bool mapping_like = args.is_dict() || args.kind() == Value::Kind::kList || args.is_undefined();
  if (args.is_dict()) mapping = &args.as_dict();
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) return Error("incomplete format");
    const Value* arg = nullptr;
    if (fmt[i] == '(') {
      size_t close = fmt.find(')', i);
      if (close == std::string::npos) return Error("incomplete format key");
      if (mapping == nullptr) return Error("format requires a mapping");
      std::string key = fmt.substr(i + 1, close - i - 1);
      arg = mapping->Find(key);
      if (arg == nullptr) return Error("KeyError: '" + key + "'");
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::string_view("-+ #0").find(fmt[i]) != std::string_view::npos) {
      flags += fmt[i++];
    }
    auto take_arg = [&]() -> Result<const Value*> {
      if (next >= positional.size()) return Error("not enough arguments for format string");
      return &positional[next++];
    };
    auto number = [&](std::optional<int64_t>* out_number) -> Status {
      if (i < fmt.size() && fmt[i] == '*') {
        ++i;
        FW_ASSIGN_OR_RETURN(const Value* star, take_arg());
        if (!star->is_int()) return Error("* wants int");
        *out_number = star->as_int();
        return Status::Ok();
      }
      if (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') {
        int64_t n = 0;
        while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') n = n * 10 + (fmt[i++] - '0');
        *out_number = n;
      }
      return Status::Ok();
    };
    std::optional<int64_t> width;
    std::optional<int64_t> precision;
    FW_RETURN_IF_ERROR(number(&width));
    if (i < fmt.size() && fmt[i] == '.') {
      ++i;
      precision = 0;
      FW_RETURN_IF_ERROR(number(&precision));
    }
    while (i < fmt.size() && (fmt[i] == 'h' || fmt[i] == 'l' || fmt[i] == 'L')) ++i;
    if (i >= fmt.size()) return Error("incomplete format");
    char conversion = fmt[i];
    if (conversion == '%') {
      out += '%';
      continue;
    }
    if (arg == nullptr) {
      FW_ASSIGN_OR_RETURN(arg, take_arg());
    }
    std::string piece;
    bool left = flags.find('-') != std::string::npos;
    switch (conversion) {
      case 's':
      case 'r':
      case 'a': {
        if (conversion == 's') {
          piece = Str(*arg);
        } else {
          AppendRepr(*arg, &piece);
        }
        if (precision) {
          std::u32string cps = pystr::Decode(piece);
          if (static_cast<int64_t>(cps.size()) > *precision) {
            piece =
                pystr::Encode(std::u32string_view(cps).substr(0, static_cast<size_t>(*precision)));
          }
        }
        break;
      }
      case 'c':
        if (arg->is_string() && pystr::Length(arg->as_string()) == 1) {
          piece = arg->as_string();
        } else if (arg->is_int()) {
          pystr::AppendCodePoint(static_cast<char32_t>(arg->as_int()), &piece);
        } else {
          return Error("%c requires int or char");
        }
        break;
      case 'd':
      case 'i':
      case 'u':
      case 'x':
      case 'X':
      case 'o':
      case 'e':
      case 'E':
      case 'f':
      case 'F':
      case 'g':
      case 'G': {
        bool integral = std::string_view("diuxXo").find(conversion) != std::string_view::npos;
        if (!arg->is_number() || (arg->is_float() && std::string_view("xXo").find(conversion) !=
                                                         std::string_view::npos)) {
          if (arg->is_undefined()) return Error(arg->undefined_message());
          bool needs_int = std::string_view("xXo").find(conversion) != std::string_view::npos;
          return Error(std::string("%") + conversion +
                       " format: " + (needs_int ? "an integer" : "a real number") +
                       " is required, not " + TypeName(*arg));
        }
        std::string spec = "%" + flags;
        if (precision) spec += "." + std::to_string(*precision);
        char buf[512];
        if (integral) {
          int64_t v = arg->is_float() ? static_cast<int64_t>(arg->as_float()) : arg->integer();
          char c = conversion == 'i' || conversion == 'u' ? 'd' : conversion;
          spec += "ll";
          spec += c;
          std::snprintf(buf, sizeof buf, spec.c_str(), static_cast<long long>(v));
          piece = buf;
          if (flags.find('#') != std::string::npos && conversion == 'o') {
            size_t zero = piece.find('0');  // Python writes 0o17, C writes 017
            if (zero != std::string::npos) piece.insert(zero + 1, "o");
          }
        } else {
          spec += conversion;
          std::snprintf(buf, sizeof buf, spec.c_str(), arg->number());
          piece = buf;
        }
        break;
      }
      default:
        return Error(std::string("unsupported format character '") + conversion + "'");
    }
    if (width && *width > kMaxRepeat)
      return Status::ResourceExhausted("format width larger than 64 MiB");
    if (width) {
      auto length = static_cast<int64_t>(pystr::Length(piece));
      if (length < *width) {
        std::string pad(static_cast<size_t>(*width - length), ' ');
        bool zero_pad = flags.find('0') != std::string::npos && !left && conversion != 's' &&
                        conversion != 'r' && conversion != 'a' && conversion != 'c';
        if (zero_pad) {
          size_t sign =
              !piece.empty() && (piece[0] == '-' || piece[0] == '+' || piece[0] == ' ') ? 1 : 0;
          piece.insert(sign, std::string(pad.size(), '0'));
        } else {
          piece = left ? piece + pad : pad + piece;
        }
      }
    }
    out += piece;
  }
  if (next < positional.size() && !mapping_like) {
    return Error("not all arguments converted during string formatting");
  }
  return Value::String(std::move(out));
}

Status OperandError(const char* op, const Value& a, const Value& b) {
  return Error(std::string("unsupported operand type(s) for ") + op + ": '" + TypeName(a) +
               "' and '" + TypeName(b) + "'");
}

Result<Value> Arithmetic(BinaryOp op, const Value& a, const Value& b) {
  // str % x formats (x may even be undefined: it has __getitem__, so it counts as a mapping).
  if (a.is_string() && op == BinaryOp::kMod) return PercentFormat(a.as_string(), b);
  if (a.is_undefined() || b.is_undefined()) return UndefinedOperand(a, b);
  static constexpr const char* kSymbols[] = {"+", "-", "*", "/", "//", "%", "**"};
  const char* symbol = kSymbols[static_cast<int>(op)];
  bool numbers = a.is_number() && b.is_number();
  bool ints = numbers && !a.is_float() && !b.is_float();
  auto overflow = [&]() { return Error(std::string("integer overflow in ") + symbol); };
  switch (op) {
    case BinaryOp::kAdd:
      if (ints) {
        int64_t r;
        if (__builtin_add_overflow(a.integer(), b.integer(), &r)) return overflow();
        return Value::Int(r);
      }
      if (numbers) return Value::Float(a.number() + b.number());
      if (a.is_string() && b.is_string()) return Value::String(a.as_string() + b.as_string());
      if ((a.kind() == Value::Kind::kList || a.kind() == Value::Kind::kTuple) &&
          a.kind() == b.kind()) {
        ValueList out = a.as_list();
        out.insert(out.end(), b.as_list().begin(), b.as_list().end());
        return a.kind() == Value::Kind::kTuple ? Value::Tuple(std::move(out))
                                               : Value::List(std::move(out));
      }
      if (a.is_string() || a.kind() == Value::Kind::kList) {
        return Error(std::string("can only concatenate ") + TypeName(a) + " (not \"" + TypeName(b) +
                     "\") to " + TypeName(a));
      }
      return OperandError(symbol, a, b);
    case BinaryOp::kSub:
      if (ints) {
        int64_t r;
        if (__builtin_sub_overflow(a.integer(), b.integer(), &r)) return overflow();
        return Value::Int(r);
      }
      if (numbers) return Value::Float(a.number() - b.number());
      return OperandError(symbol, a, b);
    case BinaryOp::kMul:
      if (ints) {
        int64_t r;
        if (__builtin_mul_overflow(a.integer(), b.integer(), &r)) return overflow();
        return Value::Int(r);
      }
      if (numbers) return Value::Float(a.number() * b.number());
      if ((a.is_string() || a.kind() == Value::Kind::kList || a.kind() == Value::Kind::kTuple) &&
          (b.is_int() || b.is_bool())) {
        return Repeat(a, b.integer());
      }
      if ((b.is_string() || b.kind() == Value::Kind::kList || b.kind() == Value::Kind::kTuple) &&
          (a.is_int() || a.is_bool())) {
        return Repeat(b, a.integer());
      }
      return OperandError(symbol, a, b);
    case BinaryOp::kDiv:
      if (!numbers) return OperandError(symbol, a, b);
      if (b.number() == 0) return Error(ints ? "division by zero" : "float division by zero");
      return Value::Float(a.number() / b.number());
    case BinaryOp::kFloorDiv:
    case BinaryOp::kMod: {
      if (!numbers) return OperandError(symbol, a, b);
      if (ints) {
        int64_t x = a.integer();
        int64_t y = b.integer();
        if (y == 0) return Error("integer division or modulo by zero");
        int64_t q = x / y;
        int64_t r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) {
          --q;
          r += y;
        }
        return Value::Int(op == BinaryOp::kFloorDiv ? q : r);
      }
      double x = a.number();
      double y = b.number();
      if (y == 0) {
        return Error(op == BinaryOp::kFloorDiv ? "float floor division by zero" : "float modulo");
      }
      // CPython's float_divmod.
      double mod = std::fmod(x, y);
      double div = (x - mod) / y;
      if (mod != 0) {
        if ((y < 0) != (mod < 0)) {
          mod += y;
          div -= 1.0;
        }
      } else {
        mod = std::copysign(0.0, y);
      }
      if (op == BinaryOp::kMod) return Value::Float(mod);
      double floordiv;
      if (div != 0) {
        floordiv = std::floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
      } else {
        floordiv = std::copysign(0.0, x / y);
      }
      return Value::Float(floordiv);
    }
    case BinaryOp::kPow: {
      if (!numbers) return OperandError(symbol, a, b);
      if (ints && b.integer() >= 0) {
        int64_t result = 1;
        int64_t base = a.integer();
        for (int64_t e = b.integer(); e > 0; --e) {
          if (__builtin_mul_overflow(result, base, &result)) return overflow();
          if (result == 0 || result == 1) break;
        }
        return Value::Int(result);
      }
      if (a.number() == 0 && b.number() < 0) {
        return Error("0.0 cannot be raised to a negative power");
      }
      double r = std::pow(a.number(), b.number());
      if (std::isnan(r) && !std::isnan(a.number()) && !std::isnan(b.number())) {
        return Error("negative number raised to a fractional power (a complex number)");
      }
      if (std::isinf(r) && std::isfinite(a.number()) && std::isfinite(b.number())) {
        return Error("OverflowError: (34, 'Numerical result out of range')");
      }
      return Value::Float(r);
    }
  }
  return Error("unknown operator");
}

// ---------------------------------------------------------------------------------------------
// The renderer

class Renderer {
 public:
  explicit Renderer(const Template& tmpl) : tmpl_(tmpl) {}

  Result<std::string> Render(const nlohmann::ordered_json& context) {
    if (!context.is_object()) return Error("chat template context must be a JSON object");
    auto root = std::make_shared<Scope>(nullptr);
    for (const auto& [key, value] : context.items()) {
      auto it = tmpl_.name_ids.find(key);
      if (it != tmpl_.name_ids.end()) root->Set(it->second, FromJson(value));
    }
    StartUndefined(tmpl_.undefined_at_start, root.get());
    std::string out;
    out.reserve(4096);
    Flow flow = Flow::kNormal;
    FW_RETURN_IF_ERROR(ExecBody(tmpl_.body, root, &out, &flow));
    return out;
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  static constexpr int kMaxMacroDepth = 256;

  // --- statements ---

  // A new frame's scope, with the names jinja2 starts undefined in it (Stmt::undefined_in_body).
  ScopePtr NewFrame(const ScopePtr& parent, const std::vector<int>& undefined) {
    auto scope = std::make_shared<Scope>(parent);
    StartUndefined(undefined, scope.get());
    return scope;
  }
  void StartUndefined(const std::vector<int>& undefined, Scope* scope) {
    for (int id : undefined)
      scope->Set(id, Value::Undefined("'" + tmpl_.names[id] + "' is undefined"));
  }

  Status ExecBody(const Body& body, const ScopePtr& scope, std::string* out, Flow* flow) {
    for (const StmtPtr& stmt : body) {
      FW_RETURN_IF_ERROR(Exec(*stmt, scope, out, flow));
      if (*flow != Flow::kNormal) return Status::Ok();
    }
    return Status::Ok();
  }

  Result<std::string> RenderBody(const Body& body, const ScopePtr& scope) {
    std::string out;
    Flow flow = Flow::kNormal;
    FW_RETURN_IF_ERROR(ExecBody(body, scope, &out, &flow));
    return out;
  }

  Status Exec(const Stmt& s, const ScopePtr& scope, std::string* out, Flow* flow) {
    switch (s.kind) {
      case Stmt::Kind::kText:
        *out += s.text;
        return Status::Ok();
      case Stmt::Kind::kPrint:
        for (const ExprPtr& e : s.exprs) {
          FW_ASSIGN_OR_RETURN(Value v, Eval(*e, scope));
          AppendStr(v, out);
        }
        return Status::Ok();
      case Stmt::Kind::kIf:
        for (size_t i = 0; i < s.exprs.size(); ++i) {
          FW_ASSIGN_OR_RETURN(Value test, Eval(*s.exprs[i], scope));
          if (Truthy(test)) return ExecBody(s.bodies[i], scope, out, flow);
        }
        if (s.bodies.size() > s.exprs.size()) return ExecBody(s.bodies.back(), scope, out, flow);
        return Status::Ok();
      case Stmt::Kind::kFor:
        return Locate(ExecFor(s, scope, out), s.line);
      case Stmt::Kind::kSet: {
        FW_ASSIGN_OR_RETURN(Value v, Eval(*s.exprs[0], scope));
        return Locate(Assign(s.targets[0], std::move(v), *scope), s.line);
      }
      case Stmt::Kind::kSetBlock: {
        FW_ASSIGN_OR_RETURN(std::string text,
                            RenderBody(s.bodies[0], NewFrame(scope, s.undefined_in_body)));
        Value v = Value::String(std::move(text));
        if (s.filter) {
          FW_ASSIGN_OR_RETURN(v, EvalFilter(*s.filter, scope, &v));
        }
        return Locate(Assign(s.targets[0], std::move(v), *scope), s.line);
      }
      case Stmt::Kind::kMacro: {
        auto macro = std::make_shared<MacroObject>();
        macro->definition = &s;
        macro->closure = scope;
        scope->Set(s.name_id, Value::MakeObject(Value::Kind::kMacro, std::move(macro)));
        return Status::Ok();
      }
      case Stmt::Kind::kFilterBlock: {
        FW_ASSIGN_OR_RETURN(std::string text,
                            RenderBody(s.bodies[0], NewFrame(scope, s.undefined_in_body)));
        Value v = Value::String(std::move(text));
        FW_ASSIGN_OR_RETURN(v, EvalFilter(*s.filter, scope, &v));
        AppendStr(v, out);
        return Status::Ok();
      }
      case Stmt::Kind::kScope: {
        ScopePtr inner = NewFrame(scope, s.undefined_in_body);
        for (size_t i = 0; i < s.targets.size(); ++i) {
          FW_ASSIGN_OR_RETURN(Value v, Eval(*s.exprs[i], scope));
          FW_RETURN_IF_ERROR(Locate(Assign(s.targets[i], std::move(v), *inner), s.line));
        }
        Flow inner_flow = Flow::kNormal;
        return ExecBody(s.bodies[0], inner, out, &inner_flow);
      }
      case Stmt::Kind::kBreak:
        *flow = Flow::kBreak;
        return Status::Ok();
      case Stmt::Kind::kContinue:
        *flow = Flow::kContinue;
        return Status::Ok();
    }
    return Status::Internal("unknown statement");
  }

  Status ExecFor(const Stmt& s, const ScopePtr& scope, std::string* out) {
    FW_ASSIGN_OR_RETURN(Value iterable, Eval(*s.exprs[0], scope));
    FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(iterable));
    if (s.exprs.size() > 1) {  // {% for x in xs if test %}: the loop sees only what passes
      auto kept = std::make_shared<ValueList>();
      for (const Value& item : *items) {
        auto test_scope = std::make_shared<Scope>(scope);
        FW_RETURN_IF_ERROR(Assign(s.targets[0], item, *test_scope));
        FW_ASSIGN_OR_RETURN(Value keep, Eval(*s.exprs[1], test_scope));
        if (Truthy(keep)) kept->push_back(item);
      }
      items = std::move(kept);
    }
    if (items->empty()) {
      Flow flow = Flow::kNormal;
      return ExecBody(s.bodies[1], NewFrame(scope, s.undefined_in_else), out, &flow);
    }
    auto loop = std::make_shared<LoopObject>();
    loop->items = items;
    Value loop_value = Value::MakeObject(Value::Kind::kLoop, loop);
    for (size_t i = 0; i < items->size(); ++i) {
      loop->index = i;
      ScopePtr iteration = NewFrame(scope, s.undefined_in_body);
      FW_RETURN_IF_ERROR(Assign(s.targets[0], (*items)[i], *iteration));
      iteration->Set(Template::kLoopId, loop_value);
      Flow flow = Flow::kNormal;
      FW_RETURN_IF_ERROR(ExecBody(s.bodies[0], iteration, out, &flow));
      if (flow == Flow::kBreak) break;
    }
    return Status::Ok();
  }

  Status Assign(const Target& target, Value value, Scope& scope) {
    switch (target.kind) {
      case Target::Kind::kName:
        scope.Set(target.name_id, std::move(value));
        return Status::Ok();
      case Target::Kind::kTuple: {
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(value));
        if (items->size() != target.items.size()) {
          if (items->size() < target.items.size()) {
            return Error("not enough values to unpack (expected " +
                         std::to_string(target.items.size()) + ", got " +
                         std::to_string(items->size()) + ")");
          }
          return Error("too many values to unpack (expected " +
                       std::to_string(target.items.size()) + ")");
        }
        for (size_t i = 0; i < items->size(); ++i) {
          FW_RETURN_IF_ERROR(Assign(target.items[i], (*items)[i], scope));
        }
        return Status::Ok();
      }
      case Target::Kind::kNamespaceAttribute: {
        const Value* ns = scope.Find(target.name_id);
        if (ns == nullptr || ns->kind() != Value::Kind::kNamespace) {
          if (ns == nullptr || ns->is_undefined()) {
            return Error("'" + target.name + "' is undefined");
          }
          return Error("cannot assign attribute on non-namespace object");
        }
        static_cast<Namespace*>(ns->object())->attributes.Set(target.attribute, std::move(value));
        return Status::Ok();
      }
    }
    return Status::Internal("unknown assignment target");
  }

  // --- expressions ---

  Result<Value> Eval(const Expr& e, const ScopePtr& scope) {
    Result<Value> r = EvalInner(e, scope);
    if (!r.ok()) return Locate(r.status(), e.line);
    return r;
  }

  Value Lookup(const Expr& name, const Scope& scope) {
    if (const Value* v = scope.Find(name.id)) return *v;
    if (auto global = LookupGlobal(name.name)) {
      auto f = std::make_shared<FunctionObject>();
      f->id = *global;
      f->name = name.name;
      return Value::MakeObject(Value::Kind::kFunction, std::move(f));
    }
    return Value::Undefined("'" + name.name + "' is undefined");
  }

  Result<Value> EvalInner(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case Expr::Kind::kConst:
        return e.constant;
      case Expr::Kind::kName:
        return Lookup(e, *scope);
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        ValueList items;
        items.reserve(e.children.size());
        for (const ExprPtr& c : e.children) {
          FW_ASSIGN_OR_RETURN(Value v, Eval(*c, scope));
          items.push_back(std::move(v));
        }
        return e.kind == Expr::Kind::kList ? Value::List(std::move(items))
                                           : Value::Tuple(std::move(items));
      }
      case Expr::Kind::kDict: {
        Dict dict;
        for (size_t i = 0; i + 1 < e.children.size(); i += 2) {
          FW_ASSIGN_OR_RETURN(Value key, Eval(*e.children[i], scope));
          FW_ASSIGN_OR_RETURN(Value value, Eval(*e.children[i + 1], scope));
          if (!key.is_string()) {
            return Error(std::string("dict keys must be strings here, not ") + TypeName(key));
          }
          dict.Set(key.as_string(), std::move(value));
        }
        return Value::MakeDict(std::move(dict));
      }
      case Expr::Kind::kGetAttr: {
        FW_ASSIGN_OR_RETURN(Value obj, Eval(*e.children[0], scope));
        return GetAttr(obj, e.name, e.attribute_flags);
      }
      case Expr::Kind::kGetItem: {
        FW_ASSIGN_OR_RETURN(Value obj, Eval(*e.children[0], scope));
        const Expr& index = *e.children[1];
        if (index.kind == Expr::Kind::kSlice) return EvalSlice(obj, index, scope);
        FW_ASSIGN_OR_RETURN(Value key, Eval(index, scope));
        return GetItem(obj, key);
      }
      case Expr::Kind::kSlice:
        return Error("a slice is only allowed as a subscript");
      case Expr::Kind::kCall:
        return EvalCall(e, scope);
      case Expr::Kind::kFilter:
        return EvalFilter(e, scope, nullptr);
      case Expr::Kind::kTest: {
        FW_ASSIGN_OR_RETURN(Value operand, Eval(*e.children[0], scope));
        FW_ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1, scope));
        FW_ASSIGN_OR_RETURN(bool result,
                            ApplyTest(static_cast<TestId>(e.id), e.name, operand, args));
        return Value::Bool(result);
      }
      case Expr::Kind::kNot: {
        FW_ASSIGN_OR_RETURN(Value v, Eval(*e.children[0], scope));
        return Value::Bool(!Truthy(v));
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        FW_ASSIGN_OR_RETURN(Value v, Eval(*e.children[0], scope));
        if (v.is_undefined()) return Error(v.undefined_message());
        if (!v.is_number()) {
          return Error(std::string("bad operand type for unary ") +
                       (e.kind == Expr::Kind::kNeg ? "-" : "+") + ": '" + TypeName(v) + "'");
        }
        if (v.is_float())
          return Value::Float(e.kind == Expr::Kind::kNeg ? -v.as_float() : v.as_float());
        if (e.kind == Expr::Kind::kNeg && v.integer() == INT64_MIN)
          return Error("integer overflow in -");
        return Value::Int(e.kind == Expr::Kind::kNeg ? -v.integer() : v.integer());
      }
      case Expr::Kind::kBinary: {
        FW_ASSIGN_OR_RETURN(Value a, Eval(*e.children[0], scope));
        FW_ASSIGN_OR_RETURN(Value b, Eval(*e.children[1], scope));
        if (e.binary_op == BinaryOp::kPow && e.children[0]->folds_to_constant &&
            !e.children[1]->folds_to_constant && a.is_number() &&
            (a.is_float() ? std::signbit(a.as_float()) : a.integer() < 0)) {
          // jinja2 writes a folded negative constant into the Python it generates without
          // parentheses, so `-2 ** x` is -(2 ** x) there.
          Value magnitude = a.is_float() ? Value::Float(-a.as_float()) : Value::Int(-a.integer());
          FW_ASSIGN_OR_RETURN(Value power, Arithmetic(BinaryOp::kPow, magnitude, b));
          if (power.is_float()) return Value::Float(-power.as_float());
          return Value::Int(-power.integer());
        }
        return Arithmetic(e.binary_op, a, b);
      }
      case Expr::Kind::kConcat: {
        std::string out;
        for (const ExprPtr& c : e.children) {
          FW_ASSIGN_OR_RETURN(Value v, Eval(*c, scope));
          AppendStr(v, &out);
        }
        return Value::String(std::move(out));
      }
      case Expr::Kind::kAnd:
      case Expr::Kind::kOr: {
        FW_ASSIGN_OR_RETURN(Value left, Eval(*e.children[0], scope));
        if (Truthy(left) == (e.kind == Expr::Kind::kOr)) return left;
        return Eval(*e.children[1], scope);
      }
      case Expr::Kind::kCompare: {
        FW_ASSIGN_OR_RETURN(Value left, Eval(*e.children[0], scope));
        for (size_t i = 0; i < e.compare_ops.size(); ++i) {
          FW_ASSIGN_OR_RETURN(Value right, Eval(*e.children[i + 1], scope));
          FW_ASSIGN_OR_RETURN(bool holds, CompareValues(e.compare_ops[i], left, right));
          if (!holds) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case Expr::Kind::kCondExpr: {
        FW_ASSIGN_OR_RETURN(Value test, Eval(*e.children[0], scope));
        if (Truthy(test)) return Eval(*e.children[1], scope);
        if (e.children[2]) return Eval(*e.children[2], scope);
        return Value::Undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
      }
    }
    return Status::Internal("unknown expression");
  }

  static Result<bool> CompareValues(CompareOp op, const Value& a, const Value& b) {
    switch (op) {
      case CompareOp::kEq:
        return Equals(a, b);
      case CompareOp::kNe:
        return !Equals(a, b);
      case CompareOp::kIn:
        return In(a, b);
      case CompareOp::kNotIn: {
        FW_ASSIGN_OR_RETURN(bool in, In(a, b));
        return !in;
      }
      default:
        break;
    }
    static constexpr const char* kSymbols[] = {"==", "!=", "<", "<=", ">", ">="};
    Result<int> c = Compare(a, b);
    if (!c.ok()) {
      if (a.is_undefined() || b.is_undefined()) return c.status();
      return Error(std::string("'") + kSymbols[static_cast<int>(op)] +
                   "' not supported between instances of '" + TypeName(a) + "' and '" +
                   TypeName(b) + "'");
    }
    switch (op) {
      case CompareOp::kLt:
        return *c < 0;
      case CompareOp::kLe:
        return *c <= 0;
      case CompareOp::kGt:
        return *c > 0;
      case CompareOp::kGe:
        return *c >= 0;
      default:
        return false;
    }
  }

  Result<Args> EvalArgs(const Expr& e, size_t first_child, const ScopePtr& scope) {
    Args args;
    for (size_t i = first_child; i < e.children.size(); ++i) {
      FW_ASSIGN_OR_RETURN(Value v, Eval(*e.children[i], scope));
      args.positional.push_back(std::move(v));
    }
    for (const auto& [key, expr] : e.kwargs) {
      FW_ASSIGN_OR_RETURN(Value v, Eval(*expr, scope));
      args.keyword.emplace_back(key, std::move(v));
    }
    return args;
  }

  Result<Value> EvalSlice(const Value& obj, const Expr& slice, const ScopePtr& scope) {
    std::optional<int64_t> parts[3];
    bool valid = true;
    for (int i = 0; i < 3; ++i) {
      if (!slice.children[static_cast<size_t>(i)]) continue;
      FW_ASSIGN_OR_RETURN(Value v, Eval(*slice.children[static_cast<size_t>(i)], scope));
      if (v.is_int() || v.is_bool()) {
        parts[i] = v.integer();
      } else if (!v.is_none()) {
        valid = false;  // Python: TypeError, which jinja2's getitem turns into undefined
      }
    }
    if (obj.is_undefined()) return Error(obj.undefined_message());
    if (!valid || !(obj.is_string() || obj.kind() == Value::Kind::kList ||
                    obj.kind() == Value::Kind::kTuple)) {
      return Value::Undefined(ObjectTypeRepr(obj) + " has no element slice");
    }
    if (obj.is_string()) {
      const std::string& s = obj.as_string();
      if (pystr::IsAscii(s)) {
        FW_ASSIGN_OR_RETURN(
            std::vector<int64_t> indices,
            SliceIndices(static_cast<int64_t>(s.size()), parts[0], parts[1], parts[2]));
        std::string out;
        out.reserve(indices.size());
        for (int64_t i : indices) out.push_back(s[static_cast<size_t>(i)]);
        return Value::String(std::move(out));
      }
      std::u32string cps = pystr::Decode(s);
      FW_ASSIGN_OR_RETURN(
          std::vector<int64_t> indices,
          SliceIndices(static_cast<int64_t>(cps.size()), parts[0], parts[1], parts[2]));
      std::string out;
      for (int64_t i : indices) pystr::AppendCodePoint(cps[static_cast<size_t>(i)], &out);
      return Value::String(std::move(out));
    }
    const ValueList& items = obj.as_list();
    FW_ASSIGN_OR_RETURN(
        std::vector<int64_t> indices,
        SliceIndices(static_cast<int64_t>(items.size()), parts[0], parts[1], parts[2]));
    ValueList out;
    out.reserve(indices.size());
    for (int64_t i : indices) out.push_back(items[static_cast<size_t>(i)]);
    return obj.kind() == Value::Kind::kTuple ? Value::Tuple(std::move(out))
                                             : Value::List(std::move(out));
  }

  // --- attribute and item access (jinja2's sandboxed getattr / getitem) ---

  static Value BoundMethod(const Value& self, std::string_view name) {
    auto m = std::make_shared<MethodObject>();
    m->self = self;
    m->method = LookupMethod(name);
    m->name = std::string(name);
    return Value::MakeObject(Value::Kind::kMethod, std::move(m));
  }

  // The AttributeFlag bit that says `obj`'s type has a method of some name.
  static uint8_t MethodFlag(const Value& obj) {
    switch (obj.kind()) {
      case Value::Kind::kString:
        return kStrAttribute;
      case Value::Kind::kList:
        return kListAttribute;
      case Value::Kind::kTuple:
        return kTupleAttribute;
      case Value::Kind::kDict:
        return kDictAttribute;
      default:
        return 0;
    }
  }

  // Python's getattr(obj, name): a method of a builtin type, a namespace or loop attribute.
  // Empty when `obj` has no such attribute. `flags`: BuiltinAttributeFlags(name).
  static std::optional<Value> PythonAttribute(const Value& obj, std::string_view name,
                                              uint8_t flags) {
    switch (obj.kind()) {
      case Value::Kind::kString:
      case Value::Kind::kTuple:
        if ((flags & MethodFlag(obj)) != 0) return BoundMethod(obj, name);
        return std::nullopt;
      case Value::Kind::kList:
        if ((flags & kListAttribute) != 0) return BoundMethod(obj, name);
        if ((flags & kListUnsafeAttribute) != 0) return UnsafeAttribute(obj, name);
        return std::nullopt;
      case Value::Kind::kDict:
        if ((flags & kDictAttribute) != 0) return BoundMethod(obj, name);
        if ((flags & kDictUnsafeAttribute) != 0) return UnsafeAttribute(obj, name);
        return std::nullopt;
      case Value::Kind::kNamespace: {
        const Value* v = static_cast<Namespace*>(obj.object())->attributes.Find(name);
        if (v != nullptr) return *v;
        return std::nullopt;
      }
      case Value::Kind::kLoop:
        return LoopAttribute(obj, name);
      default:
        return std::nullopt;
    }
  }

  static std::optional<Value> LoopAttribute(const Value& obj, std::string_view name) {
    const auto& loop = *static_cast<LoopObject*>(obj.object());
    auto index = static_cast<int64_t>(loop.index);
    auto length = static_cast<int64_t>(loop.items->size());
    if (name == "index") return Value::Int(index + 1);
    if (name == "index0") return Value::Int(index);
    if (name == "revindex") return Value::Int(length - index);
    if (name == "revindex0") return Value::Int(length - index - 1);
    if (name == "first") return Value::Bool(index == 0);
    if (name == "last") return Value::Bool(index == length - 1);
    if (name == "length") return Value::Int(length);
    if (name == "depth") return Value::Int(1);
    if (name == "depth0") return Value::Int(0);
    if (name == "previtem") {
      if (index == 0) return Value::Undefined("there is no previous item");
      return (*loop.items)[static_cast<size_t>(index - 1)];
    }
    if (name == "nextitem") {
      if (index + 1 >= length) return Value::Undefined("there is no next item");
      return (*loop.items)[static_cast<size_t>(index + 1)];
    }
    if (name == "cycle") return BoundMethod(obj, name);
    return std::nullopt;
  }

  // obj.name: the attribute first, then obj["name"]. `flags`: BuiltinAttributeFlags(name).
  static Result<Value> GetAttr(const Value& obj, std::string_view name, uint8_t flags) {
    if (obj.is_undefined()) return Error(obj.undefined_message());
    if (!name.empty() && name[0] == '_') return UnsafeAttribute(obj, name);
    if (auto attribute = PythonAttribute(obj, name, flags)) return *attribute;
    if (obj.is_dict()) {
      if (const Value* v = obj.as_dict().Find(name)) return *v;
    }
    return NoAttribute(obj, name);
  }

  // obj[key]: the item first, then the attribute `key` names; undefined when neither exists
  // (an index out of range included).
  static Result<Value> GetItem(const Value& obj, const Value& key) {
    if (obj.is_undefined()) return Error(obj.undefined_message());
    switch (obj.kind()) {
      case Value::Kind::kDict:
        if (key.is_string()) {
          if (const Value* v = obj.as_dict().Find(key.as_string())) return *v;
        }
        break;
      case Value::Kind::kList:
      case Value::Kind::kTuple:
        if (key.is_int() || key.is_bool()) {
          const ValueList& items = obj.as_list();
          int64_t i = key.integer();
          if (i < 0) i += static_cast<int64_t>(items.size());
          if (i >= 0 && i < static_cast<int64_t>(items.size()))
            return items[static_cast<size_t>(i)];
        }
        break;
      case Value::Kind::kString:
        if (key.is_int() || key.is_bool()) {
          std::u32string cps = pystr::Decode(obj.as_string());
          int64_t i = key.integer();
          if (i < 0) i += static_cast<int64_t>(cps.size());
          if (i >= 0 && i < static_cast<int64_t>(cps.size())) {
            std::string s;
            pystr::AppendCodePoint(cps[static_cast<size_t>(i)], &s);
            return Value::String(std::move(s));
          }
        }
        break;
      default:
        break;
    }
    if (key.is_string()) {
      if (!key.as_string().empty() && key.as_string()[0] == '_') {
        return UnsafeAttribute(obj, key.as_string());
      }
      if (auto attribute =
              PythonAttribute(obj, key.as_string(), BuiltinAttributeFlags(key.as_string()))) {
        return *attribute;
      }
      return NoAttribute(obj, key.as_string());
    }
    std::string repr;
    AppendRepr(key, &repr);
    return Value::Undefined(ObjectTypeRepr(obj) + " has no element " + repr);
  }

  // jinja2's make_attrgetter: "a.b.0" looks up a, then b, then item 0. A `fallback` (map's
  // default) replaces an undefined result after each step.
  static Result<Value> GetPath(Value item, const Value& attribute,
                               const Value* fallback = nullptr) {
    auto step = [&](const Value& key) -> Status {
      FW_ASSIGN_OR_RETURN(item, GetItem(item, key));
      if (fallback != nullptr && item.is_undefined()) item = *fallback;
      return Status::Ok();
    };
    if (!attribute.is_string()) {
      FW_RETURN_IF_ERROR(step(attribute));
      return item;
    }
    for (const std::string& part : pystr::Split(attribute.as_string(), &kDot, -1)) {
      bool digits =
          !part.empty() && part.size() < 18 &&
          std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
      FW_RETURN_IF_ERROR(step(digits ? Value::Int(std::stoll(part)) : Value::String(part)));
    }
    return item;
  }
  static inline const std::string kDot = ".";

  // --- calls ---

  // Python's order: the callee first, then the arguments.
  Result<Value> EvalCall(const Expr& e, const ScopePtr& scope) {
    const Expr& callee = *e.children[0];
    if (callee.kind == Expr::Kind::kGetAttr) {
      FW_ASSIGN_OR_RETURN(Value obj, Eval(*callee.children[0], scope));
      // A supported method of a builtin type: called without binding it first.
      if (callee.id >= 0 && (callee.attribute_flags & MethodFlag(obj)) != 0) {
        FW_ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1, scope));
        return CallMethod(obj, static_cast<MethodId>(callee.id), callee.name, args);
      }
      FW_ASSIGN_OR_RETURN(Value method, GetAttr(obj, callee.name, callee.attribute_flags));
      FW_ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1, scope));
      return CallValue(method, std::move(args));
    }
    if (callee.kind == Expr::Kind::kName) {
      std::optional<Value> function;
      if (const Value* v = scope->Find(callee.id)) function = *v;
      FW_ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1, scope));
      if (function) return CallValue(*function, std::move(args));
      if (auto global = LookupGlobal(callee.name)) return CallGlobal(*global, std::move(args));
      return Error("'" + callee.name + "' is undefined");
    }
    FW_ASSIGN_OR_RETURN(Value function, Eval(callee, scope));
    FW_ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1, scope));
    return CallValue(function, std::move(args));
  }

  Result<Value> CallValue(const Value& callee, Args args) {
    switch (callee.kind()) {
      case Value::Kind::kMacro:
        return CallMacro(*static_cast<MacroObject*>(callee.object()), std::move(args));
      case Value::Kind::kMethod: {
        const auto& m = *static_cast<MethodObject*>(callee.object());
        if (!m.method) {
          return Error("method '" + m.name + "' of '" + TypeName(m.self) + "' is not supported");
        }
        return CallMethod(m.self, *m.method, m.name, args);
      }
      case Value::Kind::kFunction:
        return CallGlobal(static_cast<FunctionObject*>(callee.object())->id, std::move(args));
      case Value::Kind::kUndefined:
        return Error(callee.undefined_message());
      default:
        return Error(std::string("'") + TypeName(callee) + "' object is not callable");
    }
  }

  Result<Value> CallMacro(const MacroObject& macro, Args args) {
    const Stmt& def = *macro.definition;
    ScopePtr closure = macro.closure.lock();
    if (!closure) {
      return Error("macro '" + def.name + "' called after the scope that defined it ended");
    }
    if (depth_ >= kMaxMacroDepth) return Error("macro '" + def.name + "' recursion is too deep");
    size_t n = def.param_ids.size();
    if (args.positional.size() > n && !def.catches_varargs) {
      return Error("macro '" + def.name + "' takes not more than " + std::to_string(n) +
                   " argument(s)");
    }
    ScopePtr scope = NewFrame(closure, def.undefined_in_body);
    std::vector<std::optional<Value>> bound(n);
    for (size_t i = 0; i < n && i < args.positional.size(); ++i) bound[i] = args.positional[i];
    Dict extra_kwargs;
    for (auto& [key, value] : args.keyword) {
      auto it = std::find(def.param_names.begin(), def.param_names.end(), key);
      size_t i = static_cast<size_t>(it - def.param_names.begin());
      if (it != def.param_names.end() && !bound[i]) {
        bound[i] = std::move(value);
      } else if (def.catches_kwargs) {
        extra_kwargs.Set(key, std::move(value));
      } else {
        return Error("macro '" + def.name + "' takes no keyword argument '" + key + "'");
      }
    }
    size_t first_default = n - def.defaults.size();
    for (size_t i = 0; i < n; ++i) {
      if (!bound[i]) {
        if (i >= first_default) {
          // Defaults are evaluated at the call, in the macro's scope (earlier parameters seen).
          FW_ASSIGN_OR_RETURN(Value v, Eval(*def.defaults[i - first_default], scope));
          bound[i] = std::move(v);
        } else {
          bound[i] = Value::Undefined("parameter '" + def.param_names[i] + "' was not provided");
        }
      }
      scope->Set(def.param_ids[i], std::move(*bound[i]));
    }
    if (def.catches_varargs) {
      ValueList rest;
      for (size_t i = n; i < args.positional.size(); ++i) rest.push_back(args.positional[i]);
      scope->Set(Template::kVarargsId, Value::Tuple(std::move(rest)));
    }
    if (def.catches_kwargs)
      scope->Set(Template::kKwargsId, Value::MakeDict(std::move(extra_kwargs)));
    ++depth_;
    Result<std::string> text = RenderBody(def.bodies[0], scope);
    --depth_;
    if (!text.ok()) return text.status();
    return Value::String(std::move(text).value());
  }

  static Status NoArgs(const Args& args, std::string_view name) {
    if (!args.positional.empty() || !args.keyword.empty()) {
      return Error(std::string(name) + "() takes no arguments");
    }
    return Status::Ok();
  }

  // str.format with automatic ({}), numbered ({0}) and named ({name}) fields, !s / !r.
  static Result<Value> Format(const std::string& fmt, const Args& args) {
    std::string out;
    size_t next_auto = 0;
    for (size_t i = 0; i < fmt.size(); ++i) {
      char c = fmt[i];
      if (c == '}') {
        if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
          out += '}';
          ++i;
          continue;
        }
        return Error("Single '}' encountered in format string");
      }
      if (c != '{') {
        out += c;
        continue;
      }
      if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
        out += '{';
        ++i;
        continue;
      }
      size_t close = fmt.find('}', i);
      if (close == std::string::npos) return Error("Single '{' encountered in format string");
      std::string field = fmt.substr(i + 1, close - i - 1);
      i = close;
      char conversion = 's';
      if (size_t bang = field.find('!'); bang != std::string::npos) {
        if (bang + 2 != field.size() || (field[bang + 1] != 's' && field[bang + 1] != 'r')) {
          return Error("str.format: unsupported conversion in '{" + field + "}'");
        }
        conversion = field[bang + 1];
        field.resize(bang);
      }
      if (field.find_first_of(":.[") != std::string::npos) {
        return Error("str.format: format specs, attributes and indexes are not supported ('{" +
                     field + "}')");
      }
      const Value* v = nullptr;
      if (field.empty() ||
          std::all_of(field.begin(), field.end(), [](char d) { return d >= '0' && d <= '9'; })) {
        size_t index = field.empty() ? next_auto++ : std::stoul(field);
        if (index >= args.positional.size()) {
          return Error("Replacement index " + std::to_string(index) +
                       " out of range for positional args tuple");
        }
        v = &args.positional[index];
      } else {
        for (const auto& [key, value] : args.keyword) {
          if (key == field) v = &value;
        }
        if (v == nullptr) return Error("str.format: no argument named '" + field + "'");
      }
      if (conversion == 'r') {
        AppendRepr(*v, &out);
      } else {
        AppendStr(*v, &out);
      }
    }
    return Value::String(std::move(out));
  }

  Result<Value> CallMethod(const Value& self, MethodId method, const std::string& name,
                           const Args& args) {
    std::string qualified = std::string(TypeName(self)) + "." + name;
    if (self.is_string()) return CallStrMethod(self.as_string(), method, qualified, args);
    if (self.kind() == Value::Kind::kList || self.kind() == Value::Kind::kTuple) {
      FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"value"}, qualified));
      if (!a[0]) return Error(qualified + "() takes exactly one argument (0 given)");
      const ValueList& items = self.as_list();
      if (method == MethodId::kCount) {
        return Value::Int(std::count_if(items.begin(), items.end(),
                                        [&](const Value& v) { return Equals(v, *a[0]); }));
      }
      if (method == MethodId::kIndex) {
        for (size_t i = 0; i < items.size(); ++i) {
          if (Equals(items[i], *a[0])) return Value::Int(static_cast<int64_t>(i));
        }
        return Error(std::string(TypeName(self)) + ".index(x): x not in " + TypeName(self));
      }
    }
    if (self.is_dict()) {
      const Dict& dict = self.as_dict();
      switch (method) {
        case MethodId::kItems: {
          FW_RETURN_IF_ERROR(NoArgs(args, qualified));
          ValueList items;
          items.reserve(dict.size());
          for (const auto& [k, v] : dict.items())
            items.push_back(Value::Tuple({Value::String(k), v}));
          return Value::List(std::move(items));
        }
        case MethodId::kKeys: {
          FW_RETURN_IF_ERROR(NoArgs(args, qualified));
          ValueList keys;
          for (const auto& [k, v] : dict.items()) keys.push_back(Value::String(k));
          return Value::List(std::move(keys));
        }
        case MethodId::kValues: {
          FW_RETURN_IF_ERROR(NoArgs(args, qualified));
          ValueList values;
          for (const auto& [k, v] : dict.items()) values.push_back(v);
          return Value::List(std::move(values));
        }
        case MethodId::kGet: {
          if (!args.keyword.empty()) return Error(qualified + "() takes no keyword arguments");
          if (args.positional.empty() || args.positional.size() > 2) {
            return Error(qualified + "() takes 1 or 2 arguments");
          }
          const Value& key = args.positional[0];
          if (key.is_string()) {
            if (const Value* v = dict.Find(key.as_string())) return *v;
          }
          return args.positional.size() > 1 ? args.positional[1] : Value::None();
        }
        default:
          break;
      }
    }
    if (self.kind() == Value::Kind::kLoop && method == MethodId::kCycle) {
      if (args.positional.empty()) return Error("no items for cycling given");
      const auto& loop = *static_cast<LoopObject*>(self.object());
      return args.positional[loop.index % args.positional.size()];
    }
    return Error("method '" + qualified + "' is not supported");
  }

  Result<Value> CallStrMethod(const std::string& s, MethodId method, const std::string& qualified,
                              const Args& args) {
    auto optional_string = [&](const std::optional<Value>& v,
                               std::string_view what) -> Result<std::optional<std::string>> {
      if (!v || v->is_none()) return std::optional<std::string>();
      if (!v->is_string()) {
        return Error(qualified + "() " + std::string(what) + " must be str or None, not " +
                     TypeName(*v));
      }
      return std::optional<std::string>(v->as_string());
    };
    switch (method) {
      case MethodId::kStartswith:
      case MethodId::kEndswith: {
        if (!args.keyword.empty()) return Error(qualified + "() takes no keyword arguments");
        if (args.positional.size() != 1) {
          return Error(qualified + "() with start / end arguments is not supported");
        }
        const Value& arg = args.positional[0];
        ValueList candidates;
        if (arg.is_string()) {
          candidates.push_back(arg);
        } else if (arg.kind() == Value::Kind::kTuple) {
          candidates = arg.as_list();
        } else {
          return Error(qualified + " first arg must be str or a tuple of str, not " +
                       TypeName(arg));
        }
        for (const Value& c : candidates) {
          if (!c.is_string()) {
            return Error(std::string("tuple for ") + qualified + " must only contain str, not " +
                         TypeName(c));
          }
          const std::string& affix = c.as_string();
          bool hit = method == MethodId::kStartswith
                         ? s.compare(0, affix.size(), affix) == 0
                         : s.size() >= affix.size() &&
                               s.compare(s.size() - affix.size(), affix.size(), affix) == 0;
          if (hit) return Value::Bool(true);
        }
        return Value::Bool(false);
      }
      case MethodId::kSplit:
      case MethodId::kRsplit: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"sep", "maxsplit"}, qualified));
        FW_ASSIGN_OR_RETURN(std::optional<std::string> sep, optional_string(a[0], "sep"));
        int64_t maxsplit = -1;
        if (a[1]) {
          FW_ASSIGN_OR_RETURN(maxsplit, IntArg(*a[1], "maxsplit"));
        }
        if (sep && sep->empty()) return Error("empty separator");
        const std::string* sep_ptr = sep ? &*sep : nullptr;
        std::vector<std::string> parts = method == MethodId::kSplit
                                             ? pystr::Split(s, sep_ptr, maxsplit)
                                             : pystr::RSplit(s, sep_ptr, maxsplit);
        ValueList out;
        out.reserve(parts.size());
        for (std::string& p : parts) out.push_back(Value::String(std::move(p)));
        return Value::List(std::move(out));
      }
      case MethodId::kSplitlines: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"keepends"}, qualified));
        if (a[0] && Truthy(*a[0])) return Error(qualified + "(keepends=True) is not supported");
        ValueList out;
        for (std::string& p : pystr::SplitLines(s)) out.push_back(Value::String(std::move(p)));
        return Value::List(std::move(out));
      }
      case MethodId::kStrip:
      case MethodId::kLstrip:
      case MethodId::kRstrip: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"chars"}, qualified));
        FW_ASSIGN_OR_RETURN(std::optional<std::string> chars, optional_string(a[0], "arg"));
        return Value::String(pystr::Strip(s, chars ? &*chars : nullptr, method != MethodId::kRstrip,
                                          method != MethodId::kLstrip));
      }
      case MethodId::kUpper:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::String(pystr::Upper(s));
      case MethodId::kLower:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::String(pystr::Lower(s));
      case MethodId::kTitle:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::String(pystr::Title(s));
      case MethodId::kCapitalize:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::String(pystr::Capitalize(s));
      case MethodId::kReplace: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"old", "new", "count"}, qualified));
        FW_ASSIGN_OR_RETURN(std::string old_text, StringArg(a[0], qualified + "() old"));
        FW_ASSIGN_OR_RETURN(std::string new_text, StringArg(a[1], qualified + "() new"));
        int64_t count = -1;
        if (a[2]) {
          FW_ASSIGN_OR_RETURN(count, IntArg(*a[2], "count"));
        }
        return Value::String(pystr::Replace(s, old_text, new_text, count));
      }
      case MethodId::kJoin: {
        if (args.positional.size() != 1 || !args.keyword.empty()) {
          return Error(qualified + "() takes exactly one argument");
        }
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(args.positional[0]));
        std::string out;
        for (size_t i = 0; i < items->size(); ++i) {
          const Value& item = (*items)[i];
          if (!item.is_string()) {
            return Error("sequence item " + std::to_string(i) + ": expected str instance, " +
                         TypeName(item) + " found");
          }
          if (i > 0) out += s;
          out += item.as_string();
        }
        return Value::String(std::move(out));
      }
      case MethodId::kFind:
      case MethodId::kRfind:
      case MethodId::kCount:
      case MethodId::kIndex: {
        if (args.positional.size() != 1 || !args.keyword.empty()) {
          return Error(qualified + "() with start / end arguments is not supported");
        }
        FW_ASSIGN_OR_RETURN(std::string sub,
                            StringArg(args.positional[0], qualified + "() argument"));
        if (method == MethodId::kCount) return Value::Int(pystr::Count(s, sub));
        int64_t at = pystr::Find(s, sub, method == MethodId::kRfind);
        if (method == MethodId::kIndex && at < 0) return Error("substring not found");
        return Value::Int(at);
      }
      case MethodId::kRemoveprefix:
      case MethodId::kRemovesuffix: {
        if (args.positional.size() != 1 || !args.keyword.empty()) {
          return Error(qualified + "() takes exactly one argument");
        }
        FW_ASSIGN_OR_RETURN(std::string affix,
                            StringArg(args.positional[0], qualified + "() argument"));
        if (method == MethodId::kRemoveprefix) {
          if (s.compare(0, affix.size(), affix) == 0) return Value::String(s.substr(affix.size()));
        } else if (s.size() >= affix.size() &&
                   s.compare(s.size() - affix.size(), affix.size(), affix) == 0) {
          return Value::String(s.substr(0, s.size() - affix.size()));
        }
        return Value::String(s);
      }
      case MethodId::kIsdigit:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::Bool(pystr::IsDigit(s));
      case MethodId::kIsalpha:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::Bool(pystr::IsAlpha(s));
      case MethodId::kIsalnum:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::Bool(pystr::IsAlnum(s));
      case MethodId::kIsspace:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::Bool(pystr::IsSpaceString(s));
      case MethodId::kIslower:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::Bool(pystr::IsLower(s));
      case MethodId::kIsupper:
        FW_RETURN_IF_ERROR(NoArgs(args, qualified));
        return Value::Bool(pystr::IsUpper(s));
      case MethodId::kFormat:
        return Format(s, args);
      default:
        return Error("method '" + qualified + "' is not supported");
    }
  }

  Result<Value> CallGlobal(GlobalId id, Args args) {
    switch (id) {
      case GlobalId::kRange: {
        if (!args.keyword.empty()) return Error("range() takes no keyword arguments");
        std::vector<int64_t> p;
        for (const Value& v : args.positional) {
          FW_ASSIGN_OR_RETURN(int64_t i, IntArg(v, "range() argument"));
          p.push_back(i);
        }
        if (p.empty() || p.size() > 3) return Error("range expected 1 to 3 arguments");
        int64_t start = p.size() == 1 ? 0 : p[0];
        int64_t stop = p.size() == 1 ? p[0] : p[1];
        int64_t step = p.size() == 3 ? p[2] : 1;
        if (step == 0) return Error("range() arg 3 must not be zero");
        ValueList out;
        for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
          if (out.size() >= 100000) {
            return Error(
                "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
          }
          out.push_back(Value::Int(i));
          if (__builtin_add_overflow(i, step, &i)) break;
        }
        return Value::List(std::move(out));
      }
      case GlobalId::kNamespace:
      case GlobalId::kDict: {
        Dict dict;
        if (args.positional.size() > 1) {
          return Error(std::string(id == GlobalId::kDict ? "dict" : "namespace") +
                       "() takes at most one positional argument");
        }
        if (!args.positional.empty()) {
          const Value& init = args.positional[0];
          if (init.is_dict()) {
            dict = init.as_dict();
          } else {
            FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> pairs, Iterate(init));
            for (const Value& pair : *pairs) {
              FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> kv, Iterate(pair));
              if (kv->size() != 2 || !(*kv)[0].is_string()) {
                return Error("dictionary update sequence elements must be (str, value) pairs");
              }
              dict.Set((*kv)[0].as_string(), (*kv)[1]);
            }
          }
        }
        for (auto& [key, value] : args.keyword) dict.Set(key, std::move(value));
        if (id == GlobalId::kDict) return Value::MakeDict(std::move(dict));
        auto ns = std::make_shared<Namespace>();
        ns->attributes = std::move(dict);
        return Value::MakeObject(Value::Kind::kNamespace, std::move(ns));
      }
      case GlobalId::kRaiseException: {
        std::string message = args.positional.empty() ? "" : Str(args.positional[0]);
        return Error("raise_exception: " + message);
      }
      case GlobalId::kStrftimeNow: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"format"}, "strftime_now"));
        FW_ASSIGN_OR_RETURN(std::string format, StringArg(a[0], "strftime_now() format"));
        std::time_t now = static_cast<std::time_t>(UnixMicrosNow() / 1000000);
        std::tm local{};
        localtime_r(&now, &local);
        std::string out(256 + format.size() * 8, '\0');
        size_t n =
            format.empty() ? 0 : std::strftime(out.data(), out.size(), format.c_str(), &local);
        out.resize(n);
        return Value::String(std::move(out));
      }
    }
    return Error("unknown function");
  }

  // --- filters ---

  // `e` is a kFilter; `input` overrides its operand (filter blocks and block sets, whose
  // innermost operand is null).
  Result<Value> EvalFilter(const Expr& e, const ScopePtr& scope, const Value* input) {
    Value operand;
    if (e.children[0]) {
      if (e.children[0]->kind == Expr::Kind::kFilter) {
        FW_ASSIGN_OR_RETURN(operand, EvalFilter(*e.children[0], scope, input));
      } else {
        FW_ASSIGN_OR_RETURN(operand, Eval(*e.children[0], scope));
      }
    } else if (input != nullptr) {
      operand = *input;
    }
    FW_ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1, scope));
    Result<Value> r = ApplyFilter(static_cast<FilterId>(e.id), e.name, operand, std::move(args));
    if (!r.ok()) return Locate(r.status(), e.line);
    return r;
  }

  // A filter named by a string (map's first argument).
  Result<Value> ApplyFilterByName(const Value& name, const Value& input, Args args) {
    if (!name.is_string()) return Error("map: the filter name must be a string");
    auto id = LookupFilter(name.as_string());
    if (!id) return Error("unsupported filter '" + name.as_string() + "'");
    return ApplyFilter(*id, name.as_string(), input, std::move(args));
  }

  static Value IgnoreCase(const Value& v) {
    return v.is_string() ? Value::String(pystr::Lower(v.as_string())) : v;
  }

  // The sort / unique / min / max key: item (or its attribute path), lower-cased when
  // `case_sensitive` is false.
  static Result<Value> SortKey(const Value& item, const std::optional<Value>& attribute,
                               bool case_sensitive) {
    Value key = item;
    if (attribute && !attribute->is_none()) {
      FW_ASSIGN_OR_RETURN(key, GetPath(item, *attribute));
    }
    return case_sensitive ? key : IgnoreCase(key);
  }

  Result<Value> ApplyFilter(FilterId id, const std::string& name, const Value& input, Args args) {
    switch (id) {
      case FilterId::kAbs: {
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        if (input.is_float()) return Value::Float(std::fabs(input.as_float()));
        if (input.is_int() || input.is_bool()) {
          if (input.integer() == INT64_MIN) return Error("integer overflow in abs()");
          return Value::Int(std::abs(input.integer()));
        }
        return Error(std::string("bad operand type for abs(): '") + TypeName(input) + "'");
      }
      case FilterId::kAttr: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"name"}, name));
        FW_ASSIGN_OR_RETURN(std::string attribute, StringArg(a[0], "attr() name"));
        if (input.is_undefined()) return Error(input.undefined_message());
        if (!attribute.empty() && attribute[0] == '_') return UnsafeAttribute(input, attribute);
        if (auto v = PythonAttribute(input, attribute, BuiltinAttributeFlags(attribute))) return *v;
        return NoAttribute(input, attribute);
      }
      case FilterId::kCapitalize:
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        return Value::String(pystr::Capitalize(Str(input)));
      case FilterId::kDefault: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"default_value", "boolean"}, name));
        bool boolean = a[1] && Truthy(*a[1]);
        if (input.is_undefined() || (boolean && !Truthy(input))) {
          return a[0] ? *a[0] : Value::String("");
        }
        return input;
      }
      case FilterId::kDictsort: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"case_sensitive", "by", "reverse"}, name));
        if (input.is_undefined()) return Error(input.undefined_message());
        if (!input.is_dict())
          return Error(std::string("dictsort: '") + TypeName(input) +
                       "' object has no attribute 'items'");
        bool case_sensitive = a[0] && Truthy(*a[0]);
        int position = 0;
        if (a[1]) {
          FW_ASSIGN_OR_RETURN(std::string by, StringArg(a[1], "dictsort() by"));
          if (by != "key" && by != "value") {
            return Error("You can only sort by either \"key\" or \"value\"");
          }
          position = by == "value" ? 1 : 0;
        }
        ValueList items;
        for (const auto& [k, v] : input.as_dict().items()) {
          items.push_back(Value::Tuple({Value::String(k), v}));
        }
        FW_RETURN_IF_ERROR(
            SortBy(&items, a[2] && Truthy(*a[2]), [&](const Value& item) -> Result<Value> {
              const Value& key = item.as_list()[static_cast<size_t>(position)];
              return case_sensitive ? key : IgnoreCase(key);
            }));
        return Value::List(std::move(items));
      }
      case FilterId::kFirst:
      case FilterId::kLast: {
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        bool first = id == FilterId::kFirst;
        if (!first && input.kind() == Value::Kind::kIterator) {
          return Error("'generator' object is not reversible");
        }
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
        if (items->empty()) {
          return Value::Undefined(first ? "No first item, sequence was empty."
                                        : "No last item, sequence was empty.");
        }
        return first ? items->front() : items->back();
      }
      case FilterId::kFloat: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"default"}, name));
        Value fallback = a[0] ? *a[0] : Value::Float(0.0);
        if (input.is_undefined()) return Error(input.undefined_message());
        if (input.is_number()) return Value::Float(input.number());
        if (input.is_string()) {
          if (auto d = ParsePythonFloat(input.as_string())) return Value::Float(*d);
        }
        return fallback;
      }
      case FilterId::kIndent:
        return Indent(input, args, name);
      case FilterId::kInt: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"default", "base"}, name));
        Value fallback = a[0] ? *a[0] : Value::Int(0);
        int64_t base = 10;
        if (a[1]) {
          FW_ASSIGN_OR_RETURN(base, IntArg(*a[1], "int() base"));
        }
        if (input.is_undefined()) return Error(input.undefined_message());
        if (input.is_int() || input.is_bool()) return Value::Int(input.integer());
        if (input.is_float()) {
          double d = input.as_float();
          if (std::isnan(d)) return fallback;
          if (std::isinf(d) || std::fabs(d) >= 9.2e18) {
            return Error("cannot convert float " + FormatFloat(d) + " to a 64-bit integer");
          }
          return Value::Int(static_cast<int64_t>(d));
        }
        if (input.is_string()) {
          if (auto i = ParsePythonInt(input.as_string(), base)) return Value::Int(*i);
          if (auto d = ParsePythonFloat(input.as_string())) {
            if (std::isnan(*d)) return fallback;
            if (std::isinf(*d) || std::fabs(*d) >= 9.2e18) {
              return Error("cannot convert float " + FormatFloat(*d) + " to a 64-bit integer");
            }
            return Value::Int(static_cast<int64_t>(*d));
          }
        }
        return fallback;
      }
      case FilterId::kItems: {
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        if (input.is_undefined()) return Value::Iterator({});
        if (!input.is_dict()) return Error("Can only get item pairs from a mapping.");
        ValueList items;
        for (const auto& [k, v] : input.as_dict().items()) {
          items.push_back(Value::Tuple({Value::String(k), v}));
        }
        return Value::Iterator(std::move(items));
      }
      case FilterId::kJoin: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"d", "attribute"}, name));
        std::string separator = a[0] ? Str(*a[0]) : "";
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
        std::string out;
        for (size_t i = 0; i < items->size(); ++i) {
          if (i > 0) out += separator;
          if (a[1] && !a[1]->is_none()) {
            FW_ASSIGN_OR_RETURN(Value v, GetPath((*items)[i], *a[1]));
            AppendStr(v, &out);
          } else {
            AppendStr((*items)[i], &out);
          }
        }
        return Value::String(std::move(out));
      }
      case FilterId::kLength:
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        switch (input.kind()) {
          case Value::Kind::kUndefined:
            return Value::Int(0);
          case Value::Kind::kString:
            return Value::Int(static_cast<int64_t>(pystr::Length(input.as_string())));
          case Value::Kind::kList:
          case Value::Kind::kTuple:
            return Value::Int(static_cast<int64_t>(input.as_list().size()));
          case Value::Kind::kDict:
            return Value::Int(static_cast<int64_t>(input.as_dict().size()));
          case Value::Kind::kLoop:
            return Value::Int(
                static_cast<int64_t>(static_cast<LoopObject*>(input.object())->items->size()));
          default:
            return Error(std::string("object of type '") + TypeName(input) + "' has no len()");
        }
      case FilterId::kList: {
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
        return Value::List(*items);
      }
      case FilterId::kLower:
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        return Value::String(pystr::Lower(Str(input)));
      case FilterId::kUpper:
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        return Value::String(pystr::Upper(Str(input)));
      case FilterId::kMap:
        return Map(input, std::move(args));
      case FilterId::kMax:
      case FilterId::kMin: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"case_sensitive", "attribute"}, name));
        bool case_sensitive = a[0] && Truthy(*a[0]);
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
        if (items->empty()) return Value::Undefined("No aggregated item, sequence was empty.");
        size_t best = 0;
        FW_ASSIGN_OR_RETURN(Value best_key, SortKey((*items)[0], a[1], case_sensitive));
        for (size_t i = 1; i < items->size(); ++i) {
          FW_ASSIGN_OR_RETURN(Value key, SortKey((*items)[i], a[1], case_sensitive));
          FW_ASSIGN_OR_RETURN(int c, Compare(key, best_key));
          if (id == FilterId::kMax ? c > 0 : c < 0) {
            best = i;
            best_key = std::move(key);
          }
        }
        return (*items)[best];
      }
      case FilterId::kSelect:
      case FilterId::kReject:
      case FilterId::kSelectattr:
      case FilterId::kRejectattr:
        return SelectOrReject(id, input, std::move(args));
      case FilterId::kReplace: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"old", "new", "count"}, name));
        if (!a[0] || !a[1]) return Error("replace() missing the old / new arguments");
        int64_t count = -1;
        if (a[2] && !a[2]->is_none()) {
          FW_ASSIGN_OR_RETURN(count, IntArg(*a[2], "replace() count"));
        }
        return Value::String(pystr::Replace(Str(input), Str(*a[0]), Str(*a[1]), count));
      }
      case FilterId::kReverse: {
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        if (input.is_string()) {
          std::u32string cps = pystr::Decode(input.as_string());
          std::reverse(cps.begin(), cps.end());
          return Value::String(pystr::Encode(cps));
        }
        if (input.kind() != Value::Kind::kUndefined && !input.is_sequence() && !input.is_dict()) {
          return Error("reverse: argument must be iterable");
        }
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
        ValueList out(items->rbegin(), items->rend());
        // reversed() of a list is an iterator; a generator is listed first, then reversed.
        return input.kind() == Value::Kind::kIterator ? Value::List(std::move(out))
                                                      : Value::Iterator(std::move(out));
      }
      case FilterId::kRound:
        return Round(input, args, name);
      case FilterId::kSort: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"reverse", "case_sensitive", "attribute"}, name));
        bool case_sensitive = a[1] && Truthy(*a[1]);
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
        ValueList out = *items;
        std::vector<Value> attributes;  // "a,b": sort by a, then b
        if (a[2] && a[2]->is_string()) {
          for (std::string& part : pystr::Split(a[2]->as_string(), &kComma, -1)) {
            attributes.push_back(Value::String(std::move(part)));
          }
        } else if (a[2] && !a[2]->is_none()) {
          attributes.push_back(*a[2]);
        }
        FW_RETURN_IF_ERROR(
            SortBy(&out, a[0] && Truthy(*a[0]), [&](const Value& item) -> Result<Value> {
              if (attributes.empty()) return case_sensitive ? item : IgnoreCase(item);
              ValueList keys;
              for (const Value& attribute : attributes) {
                FW_ASSIGN_OR_RETURN(Value key, SortKey(item, attribute, case_sensitive));
                keys.push_back(std::move(key));
              }
              return Value::List(std::move(keys));
            }));
        return Value::List(std::move(out));
      }
      case FilterId::kString:
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        return Value::String(Str(input));
      case FilterId::kSum: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"attribute", "start"}, name));
        Value total = a[1] ? *a[1] : Value::Int(0);
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
        for (const Value& item : *items) {
          Value v = item;
          if (a[0] && !a[0]->is_none()) {
            FW_ASSIGN_OR_RETURN(v, GetPath(item, *a[0]));
          }
          FW_ASSIGN_OR_RETURN(total, Arithmetic(BinaryOp::kAdd, total, v));
        }
        return total;
      }
      case FilterId::kTitle:
        FW_RETURN_IF_ERROR(NoArgs(args, name));
        return Value::String(pystr::JinjaTitle(Str(input)));
      case FilterId::kTojson:
        return ToJson(input, args);
      case FilterId::kTrim: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"chars"}, name));
        std::optional<std::string> chars;
        if (a[0] && !a[0]->is_none()) {
          FW_ASSIGN_OR_RETURN(chars, StringArg(a[0], "trim() chars"));
        }
        return Value::String(pystr::Strip(Str(input), chars ? &*chars : nullptr, true, true));
      }
      case FilterId::kUnique: {
        FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"case_sensitive", "attribute"}, name));
        bool case_sensitive = a[0] && Truthy(*a[0]);
        FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
        ValueList out;
        ValueList seen;
        for (const Value& item : *items) {
          FW_ASSIGN_OR_RETURN(Value key, SortKey(item, a[1], case_sensitive));
          if (key.kind() == Value::Kind::kList || key.is_dict()) {
            return Error(std::string("unhashable type: '") + TypeName(key) + "'");
          }
          bool duplicate =
              std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return Equals(s, key); });
          if (!duplicate) {
            seen.push_back(std::move(key));
            out.push_back(item);
          }
        }
        return Value::Iterator(std::move(out));
      }
    }
    return Error("unsupported filter '" + name + "'");
  }
  static inline const std::string kComma = ",";

  // Python's sorted(items, key=key, reverse=reverse): stable, and a reverse sort keeps equal
  // items in their order.
  template <typename KeyFn>
  static Status SortBy(ValueList* items, bool reverse, KeyFn key_fn) {
    std::vector<std::pair<Value, size_t>> keyed;
    keyed.reserve(items->size());
    for (size_t i = 0; i < items->size(); ++i) {
      FW_ASSIGN_OR_RETURN(Value key, key_fn((*items)[i]));
      keyed.emplace_back(std::move(key), i);
    }
    Status error;
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
      if (!error.ok()) return false;
      Result<int> c = reverse ? Compare(y.first, x.first) : Compare(x.first, y.first);
      if (!c.ok()) {
        error = c.status();
        return false;
      }
      return *c < 0;
    });
    FW_RETURN_IF_ERROR(error);
    ValueList out;
    out.reserve(items->size());
    for (const auto& [key, index] : keyed) out.push_back((*items)[index]);
    *items = std::move(out);
    return Status::Ok();
  }

  Result<Value> Indent(const Value& input, const Args& args, const std::string& name) {
    FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"width", "first", "blank"}, name));
    if (input.is_undefined()) return Error(input.undefined_message());
    if (!input.is_string()) {
      return Error(std::string("indent: unsupported operand type(s) for +=: '") + TypeName(input) +
                   "' and 'str'");
    }
    std::string indention = "    ";
    if (a[0]) {
      if (a[0]->is_string()) {
        indention = a[0]->as_string();
      } else {
        FW_ASSIGN_OR_RETURN(int64_t width, IntArg(*a[0], "indent() width"));
        if (width > kMaxRepeat)
          return Status::ResourceExhausted("indent() width larger than 64 MiB");
        indention.assign(static_cast<size_t>(std::max<int64_t>(width, 0)), ' ');
      }
    }
    bool first = a[1] && Truthy(*a[1]);
    bool blank = a[2] && Truthy(*a[2]);
    std::vector<std::string> lines = pystr::SplitLines(input.as_string() + "\n");
    std::string out;
    if (blank) {
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i > 0) out += "\n" + indention;
        out += lines[i];
      }
    } else {
      out = lines.empty() ? "" : lines[0];
      for (size_t i = 1; i < lines.size(); ++i) {
        out += "\n";
        if (!lines[i].empty()) out += indention;
        out += lines[i];
      }
    }
    if (first) out = indention + out;
    return Value::String(std::move(out));
  }

  Result<Value> Round(const Value& input, const Args& args, const std::string& name) {
    FW_ASSIGN_OR_RETURN(auto a, Bind(args, {"precision", "method"}, name));
    int64_t precision = 0;
    if (a[0]) {
      FW_ASSIGN_OR_RETURN(precision, IntArg(*a[0], "round() precision"));
    }
    std::string method = "common";
    if (a[1]) {
      FW_ASSIGN_OR_RETURN(method, StringArg(a[1], "round() method"));
    }
    if (method != "common" && method != "ceil" && method != "floor") {
      return Error("method must be common, ceil or floor");
    }
    if (input.is_undefined()) return Error(input.undefined_message());
    if (!input.is_number()) {
      return Error(std::string("type ") + TypeName(input) + " doesn't define __round__ method");
    }
    double scale = std::pow(10.0, static_cast<double>(precision));
    if (method != "common") {
      double scaled = input.number() * scale;
      return Value::Float((method == "ceil" ? std::ceil(scaled) : std::floor(scaled)) / scale);
    }
    if (!input.is_float()) return Value::Int(input.integer());  // round(int, n) stays an int
    double d = input.as_float();
    if (std::isnan(d) || std::isinf(d)) return Value::Float(d);
    if (precision >= 0 && precision < 300) {
      // Python rounds the exact binary value half to even, as printf does.
      char buf[400];
      std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(precision), d);
      return Value::Float(std::strtod(buf, nullptr));
    }
    return Value::Float(std::nearbyint(d * scale) / scale);
  }

  Result<Value> ToJson(const Value& input, const Args& args) {
    // transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    FW_ASSIGN_OR_RETURN(
        auto a, Bind(args, {"ensure_ascii", "indent", "separators", "sort_keys"}, "tojson"));
    JsonOptions options;
    options.ensure_ascii = a[0] && Truthy(*a[0]);
    if (a[1] && !a[1]->is_none()) {
      if (a[1]->is_string()) {
        options.indent = a[1]->as_string();
      } else {
        FW_ASSIGN_OR_RETURN(int64_t width, IntArg(*a[1], "tojson() indent"));
        options.indent = std::string(static_cast<size_t>(std::max<int64_t>(width, 0)), ' ');
      }
      options.item_separator = ",";
    }
    if (a[2] && !a[2]->is_none()) {
      const Value& separators = *a[2];
      if (!(separators.kind() == Value::Kind::kList || separators.kind() == Value::Kind::kTuple) ||
          separators.as_list().size() != 2 || !separators.as_list()[0].is_string() ||
          !separators.as_list()[1].is_string()) {
        return Error("tojson() separators must be an (item_separator, key_separator) pair");
      }
      options.item_separator = separators.as_list()[0].as_string();
      options.key_separator = separators.as_list()[1].as_string();
    }
    options.sort_keys = a[3] && Truthy(*a[3]);
    std::string out;
    FW_RETURN_IF_ERROR(AppendJson(input, options, &out));
    return Value::String(std::move(out));
  }

  Result<Value> Map(const Value& input, Args args) {
    if (!Truthy(input)) return Value::Iterator({});
    FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
    ValueList out;
    out.reserve(items->size());
    if (args.positional.empty()) {
      std::optional<Value> attribute;
      std::optional<Value> fallback;
      for (const auto& [key, value] : args.keyword) {
        if (key == "attribute") {
          attribute = value;
        } else if (key == "default") {
          fallback = value;
        } else {
          return Error("Unexpected keyword argument '" + key + "'");
        }
      }
      if (!attribute) return Error("map requires a filter argument");
      const Value* default_value = fallback && !fallback->is_none() ? &*fallback : nullptr;
      for (const Value& item : *items) {
        FW_ASSIGN_OR_RETURN(Value v, GetPath(item, *attribute, default_value));
        out.push_back(std::move(v));
      }
      return Value::Iterator(std::move(out));
    }
    Value filter_name = args.positional[0];
    args.positional.erase(args.positional.begin());
    for (const Value& item : *items) {
      FW_ASSIGN_OR_RETURN(Value v, ApplyFilterByName(filter_name, item, args));
      out.push_back(std::move(v));
    }
    return Value::Iterator(std::move(out));
  }

  Result<Value> SelectOrReject(FilterId id, const Value& input, Args args) {
    if (!Truthy(input)) return Value::Iterator({});
    bool by_attribute = id == FilterId::kSelectattr || id == FilterId::kRejectattr;
    bool select = id == FilterId::kSelect || id == FilterId::kSelectattr;
    size_t offset = 0;
    Value attribute;
    if (by_attribute) {
      if (args.positional.empty()) return Error("Missing parameter for attribute name");
      attribute = args.positional[0];
      offset = 1;
    }
    std::optional<TestId> test;
    std::string test_name;
    Args test_args;
    if (args.positional.size() > offset) {
      const Value& test_value = args.positional[offset];
      if (!test_value.is_string()) return Error("the test name must be a string");
      test_name = test_value.as_string();
      test = LookupTest(test_name);
      if (!test) return Error("unsupported test '" + test_name + "'");
      test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(offset) + 1,
                                  args.positional.end());
      test_args.keyword = args.keyword;
    }
    FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(input));
    ValueList out;
    for (const Value& item : *items) {
      Value subject = item;
      if (by_attribute) {
        FW_ASSIGN_OR_RETURN(subject, GetPath(item, attribute));
      }
      bool passes;
      if (test) {
        FW_ASSIGN_OR_RETURN(passes, ApplyTest(*test, test_name, subject, test_args));
      } else {
        passes = Truthy(subject);
      }
      if (passes == select) out.push_back(item);
    }
    return Value::Iterator(std::move(out));
  }

  // --- tests ---

  Result<bool> ApplyTest(TestId id, const std::string& name, const Value& v, const Args& args) {
    auto one_arg = [&]() -> Result<Value> {
      if (args.positional.size() != 1 || !args.keyword.empty()) {
        return Error("test '" + name + "' takes exactly one argument");
      }
      return args.positional[0];
    };
    auto no_arg = [&]() -> Status {
      if (!args.positional.empty() || !args.keyword.empty()) {
        return Error("test '" + name + "' takes no arguments");
      }
      return Status::Ok();
    };
    switch (id) {
      case TestId::kDefined:
      case TestId::kUndefined:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_undefined() == (id == TestId::kUndefined);
      case TestId::kNone:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_none();
      case TestId::kBoolean:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_bool();
      case TestId::kFalse:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_bool() && !v.as_bool();
      case TestId::kTrue:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_bool() && v.as_bool();
      case TestId::kInteger:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_int();
      case TestId::kFloat:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_float();
      case TestId::kNumber:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_number();
      case TestId::kString:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_string();
      case TestId::kMapping:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_dict();
      case TestId::kSequence:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_string() || v.kind() == Value::Kind::kList || v.kind() == Value::Kind::kTuple ||
               v.is_dict() || v.is_undefined();
      case TestId::kIterable:
        FW_RETURN_IF_ERROR(no_arg());
        return v.is_string() || v.is_sequence() || v.is_dict() || v.is_undefined() ||
               v.kind() == Value::Kind::kLoop;
      case TestId::kCallable:
        FW_RETURN_IF_ERROR(no_arg());
        return v.kind() == Value::Kind::kMacro || v.kind() == Value::Kind::kMethod ||
               v.kind() == Value::Kind::kFunction || v.kind() == Value::Kind::kLoop ||
               v.is_undefined();
      case TestId::kSameas: {
        FW_ASSIGN_OR_RETURN(Value other, one_arg());
        if (v.kind() != other.kind()) return false;
        switch (v.kind()) {
          case Value::Kind::kNone:
            return true;
          case Value::Kind::kBool:
            return v.as_bool() == other.as_bool();
          case Value::Kind::kInt:  // CPython caches -5..256
            return v.as_int() == other.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
          case Value::Kind::kList:
          case Value::Kind::kTuple:
          case Value::Kind::kIterator:
            return v.list_ptr() == other.list_ptr();
          default:
            return v.is_object() && v.object() == other.object();
        }
      }
      case TestId::kOdd:
      case TestId::kEven:
      case TestId::kDivisibleby: {
        Value divisor = Value::Int(2);
        if (id == TestId::kDivisibleby) {
          FW_ASSIGN_OR_RETURN(divisor, one_arg());
        } else {
          FW_RETURN_IF_ERROR(no_arg());
        }
        FW_ASSIGN_OR_RETURN(Value r, Arithmetic(BinaryOp::kMod, v, divisor));
        return Equals(r, Value::Int(id == TestId::kOdd ? 1 : 0));
      }
      case TestId::kIn: {
        FW_ASSIGN_OR_RETURN(Value container, one_arg());
        return In(v, container);
      }
      case TestId::kEq:
      case TestId::kNe:
      case TestId::kGt:
      case TestId::kGe:
      case TestId::kLt:
      case TestId::kLe: {
        FW_ASSIGN_OR_RETURN(Value other, one_arg());
        static constexpr CompareOp kOps[] = {CompareOp::kEq, CompareOp::kNe, CompareOp::kGt,
                                             CompareOp::kGe, CompareOp::kLt, CompareOp::kLe};
        return CompareValues(kOps[static_cast<int>(id) - static_cast<int>(TestId::kEq)], v, other);
      }
      case TestId::kLower:
        FW_RETURN_IF_ERROR(no_arg());
        return pystr::IsLower(Str(v));
      case TestId::kUpper:
        FW_RETURN_IF_ERROR(no_arg());
        return pystr::IsUpper(Str(v));
    }
    return Error("unsupported test '" + name + "'");
  }

  const Template& tmpl_;
  int depth_ = 0;
};

}  // namespace
}  // namespace jinja

struct ChatTemplate::Program {
  std::unique_ptr<jinja::Template> tmpl;
};

Result<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  FW_ASSIGN_OR_RETURN(std::unique_ptr<jinja::Template> tmpl, jinja::ParseTemplate(source));
  auto program = std::make_shared<Program>();
  program->tmpl = std::move(tmpl);
  ChatTemplate result;
  result.program_ = std::move(program);
  return result;
}

Result<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  return jinja::Renderer(*program_->tmpl).Render(context);
}

}  // namespace flywheel::tokenizer
