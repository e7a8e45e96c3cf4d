// The interpreter of the chat-template language (jinja_render.h): statements, expressions,
// and the builtin filters, tests, methods and globals, with jinja2's (Python's) semantics.
// Each builtin is a small function; the filters and tests are tables indexed by the id the
// parser resolved (FilterId, TestId), str methods one by MethodId.
#include "tokenizer/jinja_render.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <optional>

#include "base/env.h"
#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_value.h"

namespace flywheel::tokenizer::jinja {
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

// One conversion of Python's printf-style format: %[(key)][flags][width][.precision]conversion.
struct PercentSpec {
  const Value* arg = nullptr;  // set by %(key)s; otherwise the next positional argument
  std::string flags;
  std::optional<int64_t> width;
  std::optional<int64_t> precision;
  char conversion = 0;

  bool Has(char flag) const { return flags.find(flag) != std::string::npos; }
};

// The right operand of `fmt % args`: a tuple's items in order, or the value itself; a dict is
// also the mapping %(key)s reads.
class PercentArgs {
 public:
  explicit PercentArgs(const Value& args)
      // CPython treats any non-tuple, non-str argument with __getitem__ as a mapping: it never
      // complains about unconverted arguments then.
      : mapping_like_(args.is_dict() || args.kind() == Value::Kind::kList || args.is_undefined()) {
    if (args.kind() == Value::Kind::kTuple) {
      positional_ = args.as_list();
    } else {
      positional_.push_back(args);
    }
    if (args.is_dict()) mapping_ = &args.as_dict();
  }

  Result<const Value*> Take() {
    if (next_ >= positional_.size()) return Error("not enough arguments for format string");
    return &positional_[next_++];
  }

  Result<const Value*> Key(const std::string& key) const {
    if (mapping_ == nullptr) return Error("format requires a mapping");
    const Value* v = mapping_->Find(key);
    if (v == nullptr) return Error("KeyError: '" + key + "'");
    return v;
  }

  Status CheckAllConverted() const {
    if (next_ < positional_.size() && !mapping_like_) {
      return Error("not all arguments converted during string formatting");
    }
    return Status::Ok();
  }

 private:
  ValueList positional_;
  const Dict* mapping_ = nullptr;
  bool mapping_like_;
  size_t next_ = 0;
};

// A width or precision at fmt[*i]: `*` (the next argument, an int) or digits; none otherwise.
Status ParsePercentNumber(const std::string& fmt, size_t* i, PercentArgs* args,
                          std::optional<int64_t>* number) {
  if (*i < fmt.size() && fmt[*i] == '*') {
    ++*i;
    FW_ASSIGN_OR_RETURN(const Value* star, args->Take());
    if (!star->is_int()) return Error("* wants int");
    *number = star->as_int();
    return Status::Ok();
  }
  if (*i < fmt.size() && fmt[*i] >= '0' && fmt[*i] <= '9') {
    int64_t n = 0;
    while (*i < fmt.size() && fmt[*i] >= '0' && fmt[*i] <= '9') n = n * 10 + (fmt[(*i)++] - '0');
    *number = n;
  }
  return Status::Ok();
}

// The conversion whose text starts at fmt[*i], just after its '%'; *i ends at the conversion
// character.
Result<PercentSpec> ParsePercentSpec(const std::string& fmt, size_t* i, PercentArgs* args) {
  PercentSpec spec;
  if (fmt[*i] == '(') {
    size_t close = fmt.find(')', *i);
    if (close == std::string::npos) return Error("incomplete format key");
    FW_ASSIGN_OR_RETURN(spec.arg, args->Key(fmt.substr(*i + 1, close - *i - 1)));
    *i = close + 1;
  }
  while (*i < fmt.size() && std::string_view("-+ #0").find(fmt[*i]) != std::string_view::npos) {
    spec.flags += fmt[(*i)++];
  }
  FW_RETURN_IF_ERROR(ParsePercentNumber(fmt, i, args, &spec.width));
  if (*i < fmt.size() && fmt[*i] == '.') {
    ++*i;
    spec.precision = 0;
    FW_RETURN_IF_ERROR(ParsePercentNumber(fmt, i, args, &spec.precision));
  }
  while (*i < fmt.size() && (fmt[*i] == 'h' || fmt[*i] == 'l' || fmt[*i] == 'L')) ++*i;
  if (*i >= fmt.size()) return Error("incomplete format");
  spec.conversion = fmt[*i];
  return spec;
}

// %s %r %a: str() or repr(), cut to `precision` code points.
std::string PercentText(const PercentSpec& spec) {
  std::string piece;
  if (spec.conversion == 's') {
    piece = Str(*spec.arg);
  } else {
    AppendRepr(*spec.arg, &piece);
  }
  if (spec.precision) {
    std::u32string cps = pystr::Decode(piece);
    if (static_cast<int64_t>(cps.size()) > *spec.precision) {
      piece =
          pystr::Encode(std::u32string_view(cps).substr(0, static_cast<size_t>(*spec.precision)));
    }
  }
  return piece;
}

// %c: one character, given as a str of length 1 or as a code point.
Result<std::string> PercentChar(const Value& arg) {
  std::string piece;
  if (arg.is_string() && pystr::Length(arg.as_string()) == 1) {
    piece = arg.as_string();
  } else if (arg.is_int()) {
    pystr::AppendCodePoint(static_cast<char32_t>(arg.as_int()), &piece);
  } else {
    return Error("%c requires int or char");
  }
  return piece;
}

// %d %i %u %x %X %o (integral) and %e %E %f %F %g %G, through C's printf.
Result<std::string> PercentNumber(const PercentSpec& spec) {
  const Value& arg = *spec.arg;
  char conversion = spec.conversion;
  bool integral = std::string_view("diuxXo").find(conversion) != std::string_view::npos;
  bool needs_int = std::string_view("xXo").find(conversion) != std::string_view::npos;
  if (!arg.is_number() || (arg.is_float() && needs_int)) {
    if (arg.is_undefined()) return Error(arg.undefined_message());
    return Error(std::string("%") + conversion +
                 " format: " + (needs_int ? "an integer" : "a real number") + " is required, not " +
                 TypeName(arg));
  }
  std::string format = "%" + spec.flags;
  if (spec.precision) format += "." + std::to_string(*spec.precision);
  char buf[512];
  if (!integral) {
    format += conversion;
    std::snprintf(buf, sizeof buf, format.c_str(), arg.number());
    return std::string(buf);
  }
  int64_t v = arg.is_float() ? static_cast<int64_t>(arg.as_float()) : arg.integer();
  format += "ll";
  format += conversion == 'i' || conversion == 'u' ? 'd' : conversion;
  std::snprintf(buf, sizeof buf, format.c_str(), static_cast<long long>(v));
  std::string piece = buf;
  if (spec.Has('#') && conversion == 'o') {
    size_t zero = piece.find('0');  // Python writes 0o17, C writes 017
    if (zero != std::string::npos) piece.insert(zero + 1, "o");
  }
  return piece;
}

Result<std::string> PercentPiece(const PercentSpec& spec) {
  switch (spec.conversion) {
    case 's':
    case 'r':
    case 'a':
      return PercentText(spec);
    case 'c':
      return PercentChar(*spec.arg);
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
    case 'G':
      return PercentNumber(spec);
    default:
      return Error(std::string("unsupported format character '") + spec.conversion + "'");
  }
}

// Pads `piece` to the width: spaces (left or right) or, for numbers, zeros after the sign.
Status PadPercentPiece(const PercentSpec& spec, std::string* piece) {
  if (spec.width && *spec.width > kMaxRepeat)
    return Status::ResourceExhausted("format width larger than 64 MiB");
  if (!spec.width) return Status::Ok();
  auto length = static_cast<int64_t>(pystr::Length(*piece));
  if (length >= *spec.width) return Status::Ok();
  auto pad = static_cast<size_t>(*spec.width - length);
  bool left = spec.Has('-');
  bool zero_pad = spec.Has('0') && !left && spec.conversion != 's' && spec.conversion != 'r' &&
                  spec.conversion != 'a' && spec.conversion != 'c';
  if (zero_pad) {
    size_t sign =
        !piece->empty() && ((*piece)[0] == '-' || (*piece)[0] == '+' || (*piece)[0] == ' ') ? 1 : 0;
    piece->insert(sign, std::string(pad, '0'));
  } else {
    *piece = left ? *piece + std::string(pad, ' ') : std::string(pad, ' ') + *piece;
  }
  return Status::Ok();
}

// Python's printf-style `fmt % args`: conversions s r a d i u x X o e E f F g G c and %%,
// with flags, width, precision and %(key)s for a dict argument.
Result<Value> PercentFormat(const std::string& fmt, const Value& args) {
  PercentArgs arguments(args);
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) return Error("incomplete format");
    FW_ASSIGN_OR_RETURN(PercentSpec spec, ParsePercentSpec(fmt, &i, &arguments));
    if (spec.conversion == '%') {
      out += '%';
      continue;
    }
    if (spec.arg == nullptr) {
      FW_ASSIGN_OR_RETURN(spec.arg, arguments.Take());
    }
    FW_ASSIGN_OR_RETURN(std::string piece, PercentPiece(spec));
    FW_RETURN_IF_ERROR(PadPercentPiece(spec, &piece));
    out += piece;
  }
  FW_RETURN_IF_ERROR(arguments.CheckAllConverted());
  return Value::String(std::move(out));
}
Status OperandError(const char* op, const Value& a, const Value& b) {
  return Error(std::string("unsupported operand type(s) for ") + op + ": '" + TypeName(a) +
               "' and '" + TypeName(b) + "'");
}

bool IsListOrTuple(const Value& v) {
  return v.kind() == Value::Kind::kList || v.kind() == Value::Kind::kTuple;
}

// The operands of one binary operation (neither undefined), classified once.
struct Operands {
  const Value& a;
  const Value& b;
  const char* symbol;
  bool numbers;  // both int, bool or float
  bool ints;     // both int or bool

  Status Overflow() const { return Error(std::string("integer overflow in ") + symbol); }
  Status Unsupported() const { return OperandError(symbol, a, b); }
};

Result<Value> Add(const Operands& o) {
  const Value& a = o.a;
  const Value& b = o.b;
  if (o.ints) {
    int64_t r;
    if (__builtin_add_overflow(a.integer(), b.integer(), &r)) return o.Overflow();
    return Value::Int(r);
  }
  if (o.numbers) return Value::Float(a.number() + b.number());
  if (a.is_string() && b.is_string()) return Value::String(a.as_string() + b.as_string());
  if (IsListOrTuple(a) && a.kind() == b.kind()) {
    ValueList out = a.as_list();
    out.insert(out.end(), b.as_list().begin(), b.as_list().end());
    return a.kind() == Value::Kind::kTuple ? Value::Tuple(std::move(out))
                                           : Value::List(std::move(out));
  }
  if (a.is_string() || a.kind() == Value::Kind::kList) {
    return Error(std::string("can only concatenate ") + TypeName(a) + " (not \"" + TypeName(b) +
                 "\") to " + TypeName(a));
  }
  return o.Unsupported();
}

Result<Value> Subtract(const Operands& o) {
  if (o.ints) {
    int64_t r;
    if (__builtin_sub_overflow(o.a.integer(), o.b.integer(), &r)) return o.Overflow();
    return Value::Int(r);
  }
  if (o.numbers) return Value::Float(o.a.number() - o.b.number());
  return o.Unsupported();
}

Result<Value> Multiply(const Operands& o) {
  const Value& a = o.a;
  const Value& b = o.b;
  if (o.ints) {
    int64_t r;
    if (__builtin_mul_overflow(a.integer(), b.integer(), &r)) return o.Overflow();
    return Value::Int(r);
  }
  if (o.numbers) return Value::Float(a.number() * b.number());
  if ((a.is_string() || IsListOrTuple(a)) && (b.is_int() || b.is_bool())) {
    return Repeat(a, b.integer());
  }
  if ((b.is_string() || IsListOrTuple(b)) && (a.is_int() || a.is_bool())) {
    return Repeat(b, a.integer());
  }
  return o.Unsupported();
}

Result<Value> Divide(const Operands& o) {
  if (!o.numbers) return o.Unsupported();
  if (o.b.number() == 0) return Error(o.ints ? "division by zero" : "float division by zero");
  return Value::Float(o.a.number() / o.b.number());
}

// Python's // and % on ints: the quotient rounds toward -inf, the remainder takes y's sign.
Result<Value> IntFloorDivMod(BinaryOp op, int64_t x, int64_t y) {
  if (y == 0) return Error("integer division or modulo by zero");
  int64_t q = x / y;
  int64_t r = x % y;
  if (r != 0 && ((r < 0) != (y < 0))) {
    --q;
    r += y;
  }
  return Value::Int(op == BinaryOp::kFloorDiv ? q : r);
}

// CPython's float_divmod.
Result<Value> FloatFloorDivMod(BinaryOp op, double x, double y) {
  if (y == 0) {
    return Error(op == BinaryOp::kFloorDiv ? "float floor division by zero" : "float modulo");
  }
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

Result<Value> FloorDivMod(BinaryOp op, const Operands& o) {
  if (!o.numbers) return o.Unsupported();
  if (o.ints) return IntFloorDivMod(op, o.a.integer(), o.b.integer());
  return FloatFloorDivMod(op, o.a.number(), o.b.number());
}

Result<Value> FloorDivide(const Operands& o) {
  return FloorDivMod(BinaryOp::kFloorDiv, o);
}

Result<Value> Modulo(const Operands& o) {
  return FloorDivMod(BinaryOp::kMod, o);
}

Result<Value> Power(const Operands& o) {
  if (!o.numbers) return o.Unsupported();
  double x = o.a.number();
  double y = o.b.number();
  if (o.ints && o.b.integer() >= 0) {
    const int64_t base = o.a.integer();
    const int64_t exponent = o.b.integer();
    if (base == 0) return Value::Int(exponent == 0 ? 1 : 0);
    if (base == 1) return Value::Int(1);
    if (base == -1) return Value::Int(exponent % 2 == 0 ? 1 : -1);
    int64_t result = 1;  // |base| >= 2 overflows within 63 steps
    for (int64_t e = exponent; e > 0; --e) {
      if (__builtin_mul_overflow(result, base, &result)) return o.Overflow();
    }
    return Value::Int(result);
  }
  if (x == 0 && y < 0) return Error("0.0 cannot be raised to a negative power");
  double r = std::pow(x, y);
  if (std::isnan(r) && !std::isnan(x) && !std::isnan(y)) {
    return Error("negative number raised to a fractional power (a complex number)");
  }
  if (std::isinf(r) && std::isfinite(x) && std::isfinite(y)) {
    return Error("OverflowError: (34, 'Numerical result out of range')");
  }
  return Value::Float(r);
}

// True when table[i] is the entry of the id whose value is i, for every i: a table indexed by
// an enum lists every id once, in the enum's order.
template <typename Entry, size_t N>
constexpr bool InIdOrder(const Entry (&table)[N]) {
  for (size_t i = 0; i < N; ++i) {
    if (static_cast<size_t>(table[i].id) != i) return false;
  }
  return true;
}

// The binary operators, in BinaryOp's order.
struct ArithmeticOperator {
  BinaryOp id;
  const char* symbol;
  Result<Value> (*apply)(const Operands&);
};
constexpr ArithmeticOperator kArithmetic[] = {
    {BinaryOp::kAdd, "+", Add},
    {BinaryOp::kSub, "-", Subtract},
    {BinaryOp::kMul, "*", Multiply},
    {BinaryOp::kDiv, "/", Divide},
    {BinaryOp::kFloorDiv, "//", FloorDivide},
    {BinaryOp::kMod, "%", Modulo},
    {BinaryOp::kPow, "**", Power},
};
static_assert(InIdOrder(kArithmetic) &&
              std::size(kArithmetic) == static_cast<size_t>(BinaryOp::kPow) + 1);

Result<Value> Arithmetic(BinaryOp op, const Value& a, const Value& b) {
  // str % x formats (x may even be undefined: it has __getitem__, so it counts as a mapping).
  if (a.is_string() && op == BinaryOp::kMod) return PercentFormat(a.as_string(), b);
  if (a.is_undefined() || b.is_undefined()) return UndefinedOperand(a, b);
  const auto index = static_cast<size_t>(op);
  if (index >= std::size(kArithmetic)) return Error("unknown operator");
  bool numbers = a.is_number() && b.is_number();
  Operands operands{a, b, kArithmetic[index].symbol, numbers,
                    numbers && !a.is_float() && !b.is_float()};
  return kArithmetic[index].apply(operands);
}

// ---------------------------------------------------------------------------------------------
// Comparison, attribute and item access (jinja2's sandboxed getattr / getitem)

Result<bool> CompareValues(CompareOp op, const Value& a, const Value& b) {
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
                 "' not supported between instances of '" + TypeName(a) + "' and '" + TypeName(b) +
                 "'");
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

Value BoundMethod(const Value& self, std::string_view name) {
  auto m = std::make_shared<MethodObject>();
  m->self = self;
  m->method = LookupMethod(name);
  m->name = std::string(name);
  return Value::MakeObject(Value::Kind::kMethod, std::move(m));
}

// The AttributeFlag bit that says `obj`'s type has a method of some name.
uint8_t MethodFlag(const Value& obj) {
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

std::optional<Value> LoopAttribute(const Value& obj, std::string_view name) {
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

// Python's getattr(obj, name): a method of a builtin type, a namespace or loop attribute.
// Empty when `obj` has no such attribute. `flags`: BuiltinAttributeFlags(name).
std::optional<Value> PythonAttribute(const Value& obj, std::string_view name, uint8_t flags) {
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

// obj.name: the attribute first, then obj["name"]. `flags`: BuiltinAttributeFlags(name).
Result<Value> GetAttr(const Value& obj, std::string_view name, uint8_t flags) {
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
Result<Value> GetItem(const Value& obj, const Value& key) {
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
        if (i >= 0 && i < static_cast<int64_t>(items.size())) return items[static_cast<size_t>(i)];
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

const std::string kDot = ".";

// jinja2's make_attrgetter: "a.b.0" looks up a, then b, then item 0. A `fallback` (map's
// default) replaces an undefined result after each step.
Result<Value> GetPath(Value item, const Value& attribute, const Value* fallback = nullptr) {
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

// ---------------------------------------------------------------------------------------------
// Tests (`x is name(args)`): one function each, in a table indexed by TestId

// One test application. `name` is as written (an alias included), for messages.
struct TestCall {
  TestId id;
  const std::string& name;
  const Value& value;
  const Args& args;

  Status NoArgs() const {
    if (!args.positional.empty() || !args.keyword.empty()) {
      return Error("test '" + name + "' takes no arguments");
    }
    return Status::Ok();
  }
  Result<Value> OneArg() const {
    if (args.positional.size() != 1 || !args.keyword.empty()) {
      return Error("test '" + name + "' takes exactly one argument");
    }
    return args.positional[0];
  }
};

// A test that takes no arguments and asks one question of the value.
template <bool (*Predicate)(const Value&)>
Result<bool> PredicateTest(const TestCall& call) {
  FW_RETURN_IF_ERROR(call.NoArgs());
  return Predicate(call.value);
}

bool IsDefinedValue(const Value& v) {
  return !v.is_undefined();
}
bool IsUndefinedValue(const Value& v) {
  return v.is_undefined();
}
bool IsNoneValue(const Value& v) {
  return v.is_none();
}
bool IsBooleanValue(const Value& v) {
  return v.is_bool();
}
bool IsFalseValue(const Value& v) {
  return v.is_bool() && !v.as_bool();
}
bool IsTrueValue(const Value& v) {
  return v.is_bool() && v.as_bool();
}
bool IsIntegerValue(const Value& v) {
  return v.is_int();
}
bool IsFloatValue(const Value& v) {
  return v.is_float();
}
bool IsNumberValue(const Value& v) {
  return v.is_number();
}
bool IsStringValue(const Value& v) {
  return v.is_string();
}
bool IsMappingValue(const Value& v) {
  return v.is_dict();
}
bool IsSequenceValue(const Value& v) {
  return v.is_string() || IsListOrTuple(v) || v.is_dict() || v.is_undefined();
}
bool IsIterableValue(const Value& v) {
  return v.is_string() || v.is_sequence() || v.is_dict() || v.is_undefined() ||
         v.kind() == Value::Kind::kLoop;
}
bool IsCallableValue(const Value& v) {
  return v.kind() == Value::Kind::kMacro || v.kind() == Value::Kind::kMethod ||
         v.kind() == Value::Kind::kFunction || v.kind() == Value::Kind::kLoop || v.is_undefined();
}
bool IsLowerValue(const Value& v) {
  return pystr::IsLower(Str(v));
}
bool IsUpperValue(const Value& v) {
  return pystr::IsUpper(Str(v));
}

// Python's `is`, as far as values without identity allow it.
Result<bool> SameasTest(const TestCall& call) {
  FW_ASSIGN_OR_RETURN(Value other, call.OneArg());
  const Value& v = call.value;
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

// odd, even (by 2, no argument) and divisibleby(n): value % n == 1 (odd) or 0.
Result<bool> DivisibilityTest(const TestCall& call) {
  Value divisor = Value::Int(2);
  if (call.id == TestId::kDivisibleby) {
    FW_ASSIGN_OR_RETURN(divisor, call.OneArg());
  } else {
    FW_RETURN_IF_ERROR(call.NoArgs());
  }
  FW_ASSIGN_OR_RETURN(Value r, Arithmetic(BinaryOp::kMod, call.value, divisor));
  return Equals(r, Value::Int(call.id == TestId::kOdd ? 1 : 0));
}

Result<bool> InTest(const TestCall& call) {
  FW_ASSIGN_OR_RETURN(Value container, call.OneArg());
  return In(call.value, container);
}

// eq ne gt ge lt le (and their aliases): the comparison operators.
Result<bool> ComparisonTest(const TestCall& call) {
  FW_ASSIGN_OR_RETURN(Value other, call.OneArg());
  static constexpr CompareOp kOps[] = {CompareOp::kEq, CompareOp::kNe, CompareOp::kGt,
                                       CompareOp::kGe, CompareOp::kLt, CompareOp::kLe};
  return CompareValues(kOps[static_cast<int>(call.id) - static_cast<int>(TestId::kEq)], call.value,
                       other);
}

struct TestEntry {
  TestId id;
  Result<bool> (*apply)(const TestCall&);
};
constexpr TestEntry kTests[] = {
    {TestId::kDefined, PredicateTest<IsDefinedValue>},
    {TestId::kUndefined, PredicateTest<IsUndefinedValue>},
    {TestId::kNone, PredicateTest<IsNoneValue>},
    {TestId::kBoolean, PredicateTest<IsBooleanValue>},
    {TestId::kFalse, PredicateTest<IsFalseValue>},
    {TestId::kTrue, PredicateTest<IsTrueValue>},
    {TestId::kInteger, PredicateTest<IsIntegerValue>},
    {TestId::kFloat, PredicateTest<IsFloatValue>},
    {TestId::kNumber, PredicateTest<IsNumberValue>},
    {TestId::kString, PredicateTest<IsStringValue>},
    {TestId::kMapping, PredicateTest<IsMappingValue>},
    {TestId::kSequence, PredicateTest<IsSequenceValue>},
    {TestId::kIterable, PredicateTest<IsIterableValue>},
    {TestId::kCallable, PredicateTest<IsCallableValue>},
    {TestId::kSameas, SameasTest},
    {TestId::kOdd, DivisibilityTest},
    {TestId::kEven, DivisibilityTest},
    {TestId::kDivisibleby, DivisibilityTest},
    {TestId::kIn, InTest},
    {TestId::kEq, ComparisonTest},
    {TestId::kNe, ComparisonTest},
    {TestId::kGt, ComparisonTest},
    {TestId::kGe, ComparisonTest},
    {TestId::kLt, ComparisonTest},
    {TestId::kLe, ComparisonTest},
    {TestId::kLower, PredicateTest<IsLowerValue>},
    {TestId::kUpper, PredicateTest<IsUpperValue>},
};
static_assert(InIdOrder(kTests) && std::size(kTests) == static_cast<size_t>(TestId::kUpper) + 1);

Result<bool> ApplyTest(TestId id, const std::string& name, const Value& v, const Args& args) {
  const auto index = static_cast<size_t>(id);
  if (index >= std::size(kTests)) return Error("unsupported test '" + name + "'");
  return kTests[index].apply(TestCall{id, name, v, args});
}

// ---------------------------------------------------------------------------------------------
// Methods and globals

Status NoArgs(const Args& args, std::string_view name) {
  if (!args.positional.empty() || !args.keyword.empty()) {
    return Error(std::string(name) + "() takes no arguments");
  }
  return Status::Ok();
}

// str.format with automatic ({}), numbered ({0}) and named ({name}) fields, !s / !r.
Result<Value> Format(const std::string& fmt, const Args& args) {
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

// str methods: one function each, in a table indexed by MethodId.

// One str method call: s.name(args). `qualified` is "str.name", for messages.
struct StrCall {
  const std::string& s;
  MethodId method;
  const std::string& qualified;
  const Args& args;

  // An optional str argument (None: absent).
  Result<std::optional<std::string>> OptionalString(const std::optional<Value>& v,
                                                    std::string_view what) const {
    if (!v || v->is_none()) return std::optional<std::string>();
    if (!v->is_string()) {
      return Error(qualified + "() " + std::string(what) + " must be str or None, not " +
                   TypeName(*v));
    }
    return std::optional<std::string>(v->as_string());
  }
  // The one positional argument of find / count / removeprefix and friends, a str.
  Result<std::string> OnlyStringArg(const char* arity_message) const {
    if (args.positional.size() != 1 || !args.keyword.empty()) {
      return Error(qualified + arity_message);
    }
    return StringArg(args.positional[0], qualified + "() argument");
  }
};

// A method without arguments that maps the str to a str (upper, lower, title, capitalize).
template <std::string (*Map)(std::string_view)>
Result<Value> StrMapMethod(const StrCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.qualified));
  return Value::String(Map(call.s));
}

// A method without arguments that asks a question of the whole str (isdigit, islower, ...).
template <bool (*Predicate)(std::string_view)>
Result<Value> StrPredicateMethod(const StrCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.qualified));
  return Value::Bool(Predicate(call.s));
}

bool HasPrefix(const std::string& s, const std::string& affix) {
  return s.compare(0, affix.size(), affix) == 0;
}
bool HasSuffix(const std::string& s, const std::string& affix) {
  return s.size() >= affix.size() && s.compare(s.size() - affix.size(), affix.size(), affix) == 0;
}

// startswith / endswith: one str or a tuple of them (start / end arguments unsupported).
Result<Value> AffixMethod(const StrCall& call) {
  const std::string& qualified = call.qualified;
  if (!call.args.keyword.empty()) return Error(qualified + "() takes no keyword arguments");
  if (call.args.positional.size() != 1) {
    return Error(qualified + "() with start / end arguments is not supported");
  }
  const Value& arg = call.args.positional[0];
  ValueList candidates;
  if (arg.is_string()) {
    candidates.push_back(arg);
  } else if (arg.kind() == Value::Kind::kTuple) {
    candidates = arg.as_list();
  } else {
    return Error(qualified + " first arg must be str or a tuple of str, not " + TypeName(arg));
  }
  for (const Value& c : candidates) {
    if (!c.is_string()) {
      return Error(std::string("tuple for ") + qualified + " must only contain str, not " +
                   TypeName(c));
    }
    bool hit = call.method == MethodId::kStartswith ? HasPrefix(call.s, c.as_string())
                                                    : HasSuffix(call.s, c.as_string());
    if (hit) return Value::Bool(true);
  }
  return Value::Bool(false);
}

// split / rsplit(sep=None, maxsplit=-1).
Result<Value> SplitMethod(const StrCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"sep", "maxsplit"}, call.qualified));
  FW_ASSIGN_OR_RETURN(std::optional<std::string> sep, call.OptionalString(a[0], "sep"));
  int64_t maxsplit = -1;
  if (a[1]) {
    FW_ASSIGN_OR_RETURN(maxsplit, IntArg(*a[1], "maxsplit"));
  }
  if (sep && sep->empty()) return Error("empty separator");
  const std::string* sep_ptr = sep ? &*sep : nullptr;
  std::vector<std::string> parts = call.method == MethodId::kSplit
                                       ? pystr::Split(call.s, sep_ptr, maxsplit)
                                       : pystr::RSplit(call.s, sep_ptr, maxsplit);
  ValueList out;
  out.reserve(parts.size());
  for (std::string& p : parts) out.push_back(Value::String(std::move(p)));
  return Value::List(std::move(out));
}

Result<Value> SplitlinesMethod(const StrCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"keepends"}, call.qualified));
  if (a[0] && Truthy(*a[0])) return Error(call.qualified + "(keepends=True) is not supported");
  ValueList out;
  for (std::string& p : pystr::SplitLines(call.s)) out.push_back(Value::String(std::move(p)));
  return Value::List(std::move(out));
}

// strip / lstrip / rstrip(chars=None).
Result<Value> StripMethod(const StrCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"chars"}, call.qualified));
  FW_ASSIGN_OR_RETURN(std::optional<std::string> chars, call.OptionalString(a[0], "arg"));
  return Value::String(pystr::Strip(call.s, chars ? &*chars : nullptr,
                                    call.method != MethodId::kRstrip,
                                    call.method != MethodId::kLstrip));
}

Result<Value> ReplaceMethod(const StrCall& call) {
  const std::string& qualified = call.qualified;
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"old", "new", "count"}, qualified));
  FW_ASSIGN_OR_RETURN(std::string old_text, StringArg(a[0], qualified + "() old"));
  FW_ASSIGN_OR_RETURN(std::string new_text, StringArg(a[1], qualified + "() new"));
  int64_t count = -1;
  if (a[2]) {
    FW_ASSIGN_OR_RETURN(count, IntArg(*a[2], "count"));
  }
  return Value::String(pystr::Replace(call.s, old_text, new_text, count));
}

Result<Value> JoinMethod(const StrCall& call) {
  if (call.args.positional.size() != 1 || !call.args.keyword.empty()) {
    return Error(call.qualified + "() takes exactly one argument");
  }
  FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(call.args.positional[0]));
  std::string out;
  for (size_t i = 0; i < items->size(); ++i) {
    const Value& item = (*items)[i];
    if (!item.is_string()) {
      return Error("sequence item " + std::to_string(i) + ": expected str instance, " +
                   TypeName(item) + " found");
    }
    if (i > 0) out += call.s;
    out += item.as_string();
  }
  return Value::String(std::move(out));
}

// find / rfind / count / index(sub), in code points (start / end arguments unsupported).
Result<Value> SearchMethod(const StrCall& call) {
  FW_ASSIGN_OR_RETURN(std::string sub,
                      call.OnlyStringArg("() with start / end arguments is not supported"));
  if (call.method == MethodId::kCount) return Value::Int(pystr::Count(call.s, sub));
  int64_t at = pystr::Find(call.s, sub, call.method == MethodId::kRfind);
  if (call.method == MethodId::kIndex && at < 0) return Error("substring not found");
  return Value::Int(at);
}

// removeprefix / removesuffix(affix).
Result<Value> RemoveAffixMethod(const StrCall& call) {
  FW_ASSIGN_OR_RETURN(std::string affix, call.OnlyStringArg("() takes exactly one argument"));
  const std::string& s = call.s;
  if (call.method == MethodId::kRemoveprefix) {
    if (HasPrefix(s, affix)) return Value::String(s.substr(affix.size()));
  } else if (HasSuffix(s, affix)) {
    return Value::String(s.substr(0, s.size() - affix.size()));
  }
  return Value::String(s);
}

Result<Value> FormatMethod(const StrCall& call) {
  return Format(call.s, call.args);
}

struct StrMethodEntry {
  MethodId id;
  Result<Value> (*call)(const StrCall&);  // null: not a str method
};
constexpr StrMethodEntry kStrMethods[] = {
    {MethodId::kStartswith, AffixMethod},
    {MethodId::kEndswith, AffixMethod},
    {MethodId::kSplit, SplitMethod},
    {MethodId::kRsplit, SplitMethod},
    {MethodId::kSplitlines, SplitlinesMethod},
    {MethodId::kStrip, StripMethod},
    {MethodId::kLstrip, StripMethod},
    {MethodId::kRstrip, StripMethod},
    {MethodId::kUpper, StrMapMethod<pystr::Upper>},
    {MethodId::kLower, StrMapMethod<pystr::Lower>},
    {MethodId::kReplace, ReplaceMethod},
    {MethodId::kTitle, StrMapMethod<pystr::Title>},
    {MethodId::kCapitalize, StrMapMethod<pystr::Capitalize>},
    {MethodId::kJoin, JoinMethod},
    {MethodId::kFind, SearchMethod},
    {MethodId::kRfind, SearchMethod},
    {MethodId::kCount, SearchMethod},
    {MethodId::kIndex, SearchMethod},
    {MethodId::kRemoveprefix, RemoveAffixMethod},
    {MethodId::kRemovesuffix, RemoveAffixMethod},
    {MethodId::kIsdigit, StrPredicateMethod<pystr::IsDigit>},
    {MethodId::kIsalpha, StrPredicateMethod<pystr::IsAlpha>},
    {MethodId::kIsalnum, StrPredicateMethod<pystr::IsAlnum>},
    {MethodId::kIsspace, StrPredicateMethod<pystr::IsSpaceString>},
    {MethodId::kIslower, StrPredicateMethod<pystr::IsLower>},
    {MethodId::kIsupper, StrPredicateMethod<pystr::IsUpper>},
    {MethodId::kFormat, FormatMethod},
    {MethodId::kItems, nullptr},
    {MethodId::kKeys, nullptr},
    {MethodId::kValues, nullptr},
    {MethodId::kGet, nullptr},
    {MethodId::kCycle, nullptr},
};
static_assert(InIdOrder(kStrMethods) &&
              std::size(kStrMethods) == static_cast<size_t>(MethodId::kCycle) + 1);

Result<Value> CallStrMethod(const std::string& s, MethodId method, const std::string& qualified,
                            const Args& args) {
  const auto index = static_cast<size_t>(method);
  if (index >= std::size(kStrMethods) || kStrMethods[index].call == nullptr) {
    return Error("method '" + qualified + "' is not supported");
  }
  return kStrMethods[index].call(StrCall{s, method, qualified, args});
}

// list / tuple, dict and loop methods; str methods go to CallStrMethod.
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
          return Error("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
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
      size_t n = format.empty() ? 0 : std::strftime(out.data(), out.size(), format.c_str(), &local);
      out.resize(n);
      return Value::String(std::move(out));
    }
  }
  return Error("unknown function");
}

// ---------------------------------------------------------------------------------------------
// Filters (`input | name(args)`): one function each, in a table indexed by FilterId

// One filter application. `name` is as written (an alias included), for messages.
struct FilterCall {
  FilterId id;
  const std::string& name;
  const Value& input;
  Args args;
};

Result<Value> ApplyFilter(FilterId id, const std::string& name, const Value& input, Args args);

// A filter named by a string (map's first argument).
Result<Value> ApplyFilterByName(const Value& name, const Value& input, Args args) {
  if (!name.is_string()) return Error("map: the filter name must be a string");
  auto id = LookupFilter(name.as_string());
  if (!id) return Error("unsupported filter '" + name.as_string() + "'");
  return ApplyFilter(*id, name.as_string(), input, std::move(args));
}

Value IgnoreCase(const Value& v) {
  return v.is_string() ? Value::String(pystr::Lower(v.as_string())) : v;
}

// The sort / unique / min / max key: item (or its attribute path), lower-cased when
// `case_sensitive` is false.
Result<Value> SortKey(const Value& item, const std::optional<Value>& attribute,
                      bool case_sensitive) {
  Value key = item;
  if (attribute && !attribute->is_none()) {
    FW_ASSIGN_OR_RETURN(key, GetPath(item, *attribute));
  }
  return case_sensitive ? key : IgnoreCase(key);
}

// Python's sorted(items, key=key, reverse=reverse): stable, and a reverse sort keeps equal
// items in their order.
template <typename KeyFn>
Status SortBy(ValueList* items, bool reverse, KeyFn key_fn) {
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

// indent(width=4, first=False, blank=False); width may be a str.
Result<Value> IndentFilter(FilterCall& call) {
  const Value& input = call.input;
  const Args& args = call.args;
  const std::string& name = call.name;
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
      if (width > kMaxRepeat) return Status::ResourceExhausted("indent() width larger than 64 MiB");
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

// round(precision=0, method='common').
Result<Value> RoundFilter(FilterCall& call) {
  const Value& input = call.input;
  const Args& args = call.args;
  const std::string& name = call.name;
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

Result<Value> TojsonFilter(FilterCall& call) {
  const Value& input = call.input;
  const Args& args = call.args;
  // transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
  FW_ASSIGN_OR_RETURN(auto a,
                      Bind(args, {"ensure_ascii", "indent", "separators", "sort_keys"}, "tojson"));
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

// map(filter_name, *args) or map(attribute=..., default=...).
Result<Value> MapFilter(FilterCall& call) {
  const Value& input = call.input;
  Args& args = call.args;
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

// select / reject(test_name, *args) and selectattr / rejectattr(attribute, test_name, *args).
Result<Value> SelectOrRejectFilter(FilterCall& call) {
  const FilterId id = call.id;
  const Value& input = call.input;
  const Args& args = call.args;
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

// A filter without arguments that maps str(input) to a str (capitalize, lower, upper, title).
template <std::string (*Map)(std::string_view)>
Result<Value> StrMapFilter(FilterCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.name));
  return Value::String(Map(Str(call.input)));
}

Result<Value> AbsFilter(FilterCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.name));
  const Value& input = call.input;
  if (input.is_float()) return Value::Float(std::fabs(input.as_float()));
  if (input.is_int() || input.is_bool()) {
    if (input.integer() == INT64_MIN) return Error("integer overflow in abs()");
    return Value::Int(std::abs(input.integer()));
  }
  return Error(std::string("bad operand type for abs(): '") + TypeName(input) + "'");
}

Result<Value> AttrFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"name"}, call.name));
  FW_ASSIGN_OR_RETURN(std::string attribute, StringArg(a[0], "attr() name"));
  const Value& input = call.input;
  if (input.is_undefined()) return Error(input.undefined_message());
  if (!attribute.empty() && attribute[0] == '_') return UnsafeAttribute(input, attribute);
  if (auto v = PythonAttribute(input, attribute, BuiltinAttributeFlags(attribute))) return *v;
  return NoAttribute(input, attribute);
}

// default(default_value='', boolean=False), also `d`.
Result<Value> DefaultFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"default_value", "boolean"}, call.name));
  bool boolean = a[1] && Truthy(*a[1]);
  if (call.input.is_undefined() || (boolean && !Truthy(call.input))) {
    return a[0] ? *a[0] : Value::String("");
  }
  return call.input;
}

// dictsort(case_sensitive=False, by='key', reverse=False): the (key, value) pairs, sorted.
Result<Value> DictsortFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"case_sensitive", "by", "reverse"}, call.name));
  const Value& input = call.input;
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
  FW_RETURN_IF_ERROR(SortBy(&items, a[2] && Truthy(*a[2]), [&](const Value& item) -> Result<Value> {
    const Value& key = item.as_list()[static_cast<size_t>(position)];
    return case_sensitive ? key : IgnoreCase(key);
  }));
  return Value::List(std::move(items));
}

// first / last: an end of the sequence, undefined when it is empty.
Result<Value> FirstOrLastFilter(FilterCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.name));
  bool first = call.id == FilterId::kFirst;
  if (!first && call.input.kind() == Value::Kind::kIterator) {
    return Error("'generator' object is not reversible");
  }
  FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(call.input));
  if (items->empty()) {
    return Value::Undefined(first ? "No first item, sequence was empty."
                                  : "No last item, sequence was empty.");
  }
  return first ? items->front() : items->back();
}

Result<Value> FloatFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"default"}, call.name));
  Value fallback = a[0] ? *a[0] : Value::Float(0.0);
  const Value& input = call.input;
  if (input.is_undefined()) return Error(input.undefined_message());
  if (input.is_number()) return Value::Float(input.number());
  if (input.is_string()) {
    if (auto d = ParsePythonFloat(input.as_string())) return Value::Float(*d);
  }
  return fallback;
}

// int() of a float: truncated; NaN gives the fallback, and beyond int64 is an error.
Result<Value> TruncateFloat(double d, const Value& fallback) {
  if (std::isnan(d)) return fallback;
  if (std::isinf(d) || std::fabs(d) >= 9.2e18) {
    return Error("cannot convert float " + FormatFloat(d) + " to a 64-bit integer");
  }
  return Value::Int(static_cast<int64_t>(d));
}

// int(default=0, base=10): strings parse as Python ints in `base`, then as floats.
Result<Value> IntFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"default", "base"}, call.name));
  Value fallback = a[0] ? *a[0] : Value::Int(0);
  int64_t base = 10;
  if (a[1]) {
    FW_ASSIGN_OR_RETURN(base, IntArg(*a[1], "int() base"));
  }
  const Value& input = call.input;
  if (input.is_undefined()) return Error(input.undefined_message());
  if (input.is_int() || input.is_bool()) return Value::Int(input.integer());
  if (input.is_float()) return TruncateFloat(input.as_float(), fallback);
  if (input.is_string()) {
    if (auto i = ParsePythonInt(input.as_string(), base)) return Value::Int(*i);
    if (auto d = ParsePythonFloat(input.as_string())) return TruncateFloat(*d, fallback);
  }
  return fallback;
}

Result<Value> ItemsFilter(FilterCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.name));
  const Value& input = call.input;
  if (input.is_undefined()) return Value::Iterator({});
  if (!input.is_dict()) return Error("Can only get item pairs from a mapping.");
  ValueList items;
  for (const auto& [k, v] : input.as_dict().items()) {
    items.push_back(Value::Tuple({Value::String(k), v}));
  }
  return Value::Iterator(std::move(items));
}

// join(d='', attribute=None).
Result<Value> JoinFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"d", "attribute"}, call.name));
  std::string separator = a[0] ? Str(*a[0]) : "";
  FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(call.input));
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

// length, also `count`.
Result<Value> LengthFilter(FilterCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.name));
  const Value& input = call.input;
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
}

Result<Value> ListFilter(FilterCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.name));
  FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(call.input));
  return Value::List(*items);
}

// max / min(case_sensitive=False, attribute=None): the first extreme item.
Result<Value> ExtremeFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"case_sensitive", "attribute"}, call.name));
  bool case_sensitive = a[0] && Truthy(*a[0]);
  FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(call.input));
  if (items->empty()) return Value::Undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  FW_ASSIGN_OR_RETURN(Value best_key, SortKey((*items)[0], a[1], case_sensitive));
  for (size_t i = 1; i < items->size(); ++i) {
    FW_ASSIGN_OR_RETURN(Value key, SortKey((*items)[i], a[1], case_sensitive));
    FW_ASSIGN_OR_RETURN(int c, Compare(key, best_key));
    if (call.id == FilterId::kMax ? c > 0 : c < 0) {
      best = i;
      best_key = std::move(key);
    }
  }
  return (*items)[best];
}

// replace(old, new, count=None) on str(input).
Result<Value> ReplaceFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"old", "new", "count"}, call.name));
  if (!a[0] || !a[1]) return Error("replace() missing the old / new arguments");
  int64_t count = -1;
  if (a[2] && !a[2]->is_none()) {
    FW_ASSIGN_OR_RETURN(count, IntArg(*a[2], "replace() count"));
  }
  return Value::String(pystr::Replace(Str(call.input), Str(*a[0]), Str(*a[1]), count));
}

Result<Value> ReverseFilter(FilterCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.name));
  const Value& input = call.input;
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

const std::string kComma = ",";

// sort(reverse=False, case_sensitive=False, attribute=None); "a,b" sorts by a, then b.
Result<Value> SortFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a,
                      Bind(call.args, {"reverse", "case_sensitive", "attribute"}, call.name));
  bool case_sensitive = a[1] && Truthy(*a[1]);
  FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(call.input));
  ValueList out = *items;
  std::vector<Value> attributes;
  if (a[2] && a[2]->is_string()) {
    for (std::string& part : pystr::Split(a[2]->as_string(), &kComma, -1)) {
      attributes.push_back(Value::String(std::move(part)));
    }
  } else if (a[2] && !a[2]->is_none()) {
    attributes.push_back(*a[2]);
  }
  FW_RETURN_IF_ERROR(SortBy(&out, a[0] && Truthy(*a[0]), [&](const Value& item) -> Result<Value> {
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

Result<Value> StringFilter(FilterCall& call) {
  FW_RETURN_IF_ERROR(NoArgs(call.args, call.name));
  return Value::String(Str(call.input));
}

// sum(attribute=None, start=0).
Result<Value> SumFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"attribute", "start"}, call.name));
  Value total = a[1] ? *a[1] : Value::Int(0);
  FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(call.input));
  for (const Value& item : *items) {
    Value v = item;
    if (a[0] && !a[0]->is_none()) {
      FW_ASSIGN_OR_RETURN(v, GetPath(item, *a[0]));
    }
    FW_ASSIGN_OR_RETURN(total, Arithmetic(BinaryOp::kAdd, total, v));
  }
  return total;
}

// trim(chars=None): strip on both sides.
Result<Value> TrimFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"chars"}, call.name));
  std::optional<std::string> chars;
  if (a[0] && !a[0]->is_none()) {
    FW_ASSIGN_OR_RETURN(chars, StringArg(a[0], "trim() chars"));
  }
  return Value::String(pystr::Strip(Str(call.input), chars ? &*chars : nullptr, true, true));
}

// unique(case_sensitive=False, attribute=None): the first item of each key, in order.
Result<Value> UniqueFilter(FilterCall& call) {
  FW_ASSIGN_OR_RETURN(auto a, Bind(call.args, {"case_sensitive", "attribute"}, call.name));
  bool case_sensitive = a[0] && Truthy(*a[0]);
  FW_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(call.input));
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

struct FilterEntry {
  FilterId id;
  Result<Value> (*apply)(FilterCall&);
};
constexpr FilterEntry kFilters[] = {
    {FilterId::kAbs, AbsFilter},
    {FilterId::kAttr, AttrFilter},
    {FilterId::kCapitalize, StrMapFilter<pystr::Capitalize>},
    {FilterId::kDefault, DefaultFilter},
    {FilterId::kDictsort, DictsortFilter},
    {FilterId::kFirst, FirstOrLastFilter},
    {FilterId::kFloat, FloatFilter},
    {FilterId::kIndent, IndentFilter},
    {FilterId::kInt, IntFilter},
    {FilterId::kItems, ItemsFilter},
    {FilterId::kJoin, JoinFilter},
    {FilterId::kLast, FirstOrLastFilter},
    {FilterId::kLength, LengthFilter},
    {FilterId::kList, ListFilter},
    {FilterId::kLower, StrMapFilter<pystr::Lower>},
    {FilterId::kMap, MapFilter},
    {FilterId::kMax, ExtremeFilter},
    {FilterId::kMin, ExtremeFilter},
    {FilterId::kReject, SelectOrRejectFilter},
    {FilterId::kRejectattr, SelectOrRejectFilter},
    {FilterId::kReplace, ReplaceFilter},
    {FilterId::kReverse, ReverseFilter},
    {FilterId::kRound, RoundFilter},
    {FilterId::kSelect, SelectOrRejectFilter},
    {FilterId::kSelectattr, SelectOrRejectFilter},
    {FilterId::kSort, SortFilter},
    {FilterId::kString, StringFilter},
    {FilterId::kSum, SumFilter},
    {FilterId::kTitle, StrMapFilter<pystr::JinjaTitle>},
    {FilterId::kTojson, TojsonFilter},
    {FilterId::kTrim, TrimFilter},
    {FilterId::kUnique, UniqueFilter},
    {FilterId::kUpper, StrMapFilter<pystr::Upper>},
};
static_assert(InIdOrder(kFilters) &&
              std::size(kFilters) == static_cast<size_t>(FilterId::kUpper) + 1);

Result<Value> ApplyFilter(FilterId id, const std::string& name, const Value& input, Args args) {
  const auto index = static_cast<size_t>(id);
  if (index >= std::size(kFilters)) return Error("unsupported filter '" + name + "'");
  FilterCall call{id, name, input, std::move(args)};
  return kFilters[index].apply(call);
}

// ---------------------------------------------------------------------------------------------
// The renderer: statements and expressions

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
    root_out_ = &out;
    Flow flow = Flow::kNormal;
    FW_RETURN_IF_ERROR(ExecBody(tmpl_.body, root, &out, &flow));
    return out;
  }

  // Where Render reports the output span of each generation block (null: nowhere).
  void set_generation_spans(std::vector<std::pair<size_t, size_t>>* spans) {
    generation_spans_ = spans;
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
      case Stmt::Kind::kScope:
        return ExecScope(s, scope, out);
      case Stmt::Kind::kBreak:
        *flow = Flow::kBreak;
        return Status::Ok();
      case Stmt::Kind::kContinue:
        *flow = Flow::kContinue;
        return Status::Ok();
    }
    return Status::Internal("unknown statement");
  }

  // with / generation: the body in a frame of its own; a generation block's output span is
  // reported when it writes to the template's own output.
  Status ExecScope(const Stmt& s, const ScopePtr& scope, std::string* out) {
    ScopePtr inner = NewFrame(scope, s.undefined_in_body);
    for (size_t i = 0; i < s.targets.size(); ++i) {
      FW_ASSIGN_OR_RETURN(Value v, Eval(*s.exprs[i], scope));
      FW_RETURN_IF_ERROR(Locate(Assign(s.targets[i], std::move(v), *inner), s.line));
    }
    bool report = s.generation && generation_spans_ != nullptr;
    if (report && out != root_out_)
      return Locate(Error("a generation block inside a macro, block set or filter block: its "
                          "span in the output is unknown"),
                    s.line);
    size_t begin = out->size();
    Flow inner_flow = Flow::kNormal;
    FW_RETURN_IF_ERROR(ExecBody(s.bodies[0], inner, out, &inner_flow));
    if (report && out->size() > begin) generation_spans_->emplace_back(begin, out->size());
    return Status::Ok();
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
      case Expr::Kind::kTuple:
        return EvalSequence(e, scope);
      case Expr::Kind::kDict:
        return EvalDict(e, scope);
      case Expr::Kind::kGetAttr: {
        FW_ASSIGN_OR_RETURN(Value obj, Eval(*e.children[0], scope));
        return GetAttr(obj, e.name, e.attribute_flags);
      }
      case Expr::Kind::kGetItem:
        return EvalGetItem(e, scope);
      case Expr::Kind::kSlice:
        return Error("a slice is only allowed as a subscript");
      case Expr::Kind::kCall:
        return EvalCall(e, scope);
      case Expr::Kind::kFilter:
        return EvalFilter(e, scope, nullptr);
      case Expr::Kind::kTest:
        return EvalTest(e, scope);
      case Expr::Kind::kNot: {
        FW_ASSIGN_OR_RETURN(Value v, Eval(*e.children[0], scope));
        return Value::Bool(!Truthy(v));
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos:
        return EvalUnary(e, scope);
      case Expr::Kind::kBinary:
        return EvalBinary(e, scope);
      case Expr::Kind::kConcat:
        return EvalConcat(e, scope);
      case Expr::Kind::kAnd:
      case Expr::Kind::kOr: {
        FW_ASSIGN_OR_RETURN(Value left, Eval(*e.children[0], scope));
        if (Truthy(left) == (e.kind == Expr::Kind::kOr)) return left;
        return Eval(*e.children[1], scope);
      }
      case Expr::Kind::kCompare:
        return EvalCompare(e, scope);
      case Expr::Kind::kCondExpr:
        return EvalCondExpr(e, scope);
    }
    return Status::Internal("unknown expression");
  }

  // [a, b] and (a, b).
  Result<Value> EvalSequence(const Expr& e, const ScopePtr& scope) {
    ValueList items;
    items.reserve(e.children.size());
    for (const ExprPtr& c : e.children) {
      FW_ASSIGN_OR_RETURN(Value v, Eval(*c, scope));
      items.push_back(std::move(v));
    }
    return e.kind == Expr::Kind::kList ? Value::List(std::move(items))
                                       : Value::Tuple(std::move(items));
  }

  Result<Value> EvalDict(const Expr& e, const ScopePtr& scope) {
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

  Result<Value> EvalGetItem(const Expr& e, const ScopePtr& scope) {
    FW_ASSIGN_OR_RETURN(Value obj, Eval(*e.children[0], scope));
    const Expr& index = *e.children[1];
    if (index.kind == Expr::Kind::kSlice) return EvalSlice(obj, index, scope);
    FW_ASSIGN_OR_RETURN(Value key, Eval(index, scope));
    return GetItem(obj, key);
  }

  Result<Value> EvalTest(const Expr& e, const ScopePtr& scope) {
    FW_ASSIGN_OR_RETURN(Value operand, Eval(*e.children[0], scope));
    FW_ASSIGN_OR_RETURN(Args args, EvalArgs(e, 1, scope));
    FW_ASSIGN_OR_RETURN(bool result, ApplyTest(static_cast<TestId>(e.id), e.name, operand, args));
    return Value::Bool(result);
  }

  // Unary - and +.
  Result<Value> EvalUnary(const Expr& e, const ScopePtr& scope) {
    FW_ASSIGN_OR_RETURN(Value v, Eval(*e.children[0], scope));
    bool negate = e.kind == Expr::Kind::kNeg;
    if (v.is_undefined()) return Error(v.undefined_message());
    if (!v.is_number()) {
      return Error(std::string("bad operand type for unary ") + (negate ? "-" : "+") + ": '" +
                   TypeName(v) + "'");
    }
    if (v.is_float()) return Value::Float(negate ? -v.as_float() : v.as_float());
    if (negate && v.integer() == INT64_MIN) return Error("integer overflow in -");
    return Value::Int(negate ? -v.integer() : v.integer());
  }

  Result<Value> EvalBinary(const Expr& e, const ScopePtr& scope) {
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

  // a ~ b ~ c: the str() of each, joined.
  Result<Value> EvalConcat(const Expr& e, const ScopePtr& scope) {
    std::string out;
    for (const ExprPtr& c : e.children) {
      FW_ASSIGN_OR_RETURN(Value v, Eval(*c, scope));
      AppendStr(v, &out);
    }
    return Value::String(std::move(out));
  }

  // a < b < c: each comparison in turn, stopping at the first that fails.
  Result<Value> EvalCompare(const Expr& e, const ScopePtr& scope) {
    FW_ASSIGN_OR_RETURN(Value left, Eval(*e.children[0], scope));
    for (size_t i = 0; i < e.compare_ops.size(); ++i) {
      FW_ASSIGN_OR_RETURN(Value right, Eval(*e.children[i + 1], scope));
      FW_ASSIGN_OR_RETURN(bool holds, CompareValues(e.compare_ops[i], left, right));
      if (!holds) return Value::Bool(false);
      left = std::move(right);
    }
    return Value::Bool(true);
  }

  // x if c else y; without an else, an undefined value that says so.
  Result<Value> EvalCondExpr(const Expr& e, const ScopePtr& scope) {
    FW_ASSIGN_OR_RETURN(Value test, Eval(*e.children[0], scope));
    if (Truthy(test)) return Eval(*e.children[1], scope);
    if (e.children[2]) return Eval(*e.children[2], scope);
    return Value::Undefined("the inline if-expression on line " + std::to_string(e.line) +
                            " evaluated to false and no else section was defined.");
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

  const Template& tmpl_;
  int depth_ = 0;
  const std::string* root_out_ = nullptr;
  std::vector<std::pair<size_t, size_t>>* generation_spans_ = nullptr;
};

}  // namespace

Result<std::string> RenderTemplate(const Template& tmpl, const nlohmann::ordered_json& context) {
  return Renderer(tmpl).Render(context);
}

Result<std::string> RenderTemplateWithGenerationSpans(
    const Template& tmpl, const nlohmann::ordered_json& context,
    std::vector<std::pair<size_t, size_t>>* spans) {
  Renderer renderer(tmpl);
  renderer.set_generation_spans(spans);
  return renderer.Render(context);
}

}  // namespace flywheel::tokenizer::jinja
