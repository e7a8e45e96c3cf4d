// The parsed form of a chat template (tokenizer/chat_template.h): the lexer and parser follow
// jinja2 3.1's (lexer.py, parser.py) with trim_blocks and lstrip_blocks on, and refuse every
// construct the interpreter (tokenizer/jinja_render.cc) does not implement, by name.
//
// Private to flywheel_tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"
#include "tokenizer/jinja_value.h"

namespace flywheel::tokenizer::jinja {

enum class BinaryOp : uint8_t { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum class CompareOp : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

// The builtins a template may name. The parser resolves names to these (and refuses names
// outside them); the interpreter switches on them.
enum class FilterId : uint8_t {
  kAbs,
  kAttr,
  kCapitalize,
  kDefault,
  kDictsort,
  kFirst,
  kFloat,
  kIndent,
  kInt,
  kItems,
  kJoin,
  kLast,
  kLength,
  kList,
  kLower,
  kMap,
  kMax,
  kMin,
  kReject,
  kRejectattr,
  kReplace,
  kReverse,
  kRound,
  kSelect,
  kSelectattr,
  kSort,
  kString,
  kSum,
  kTitle,
  kTojson,
  kTrim,
  kUnique,
  kUpper,
};
enum class TestId : uint8_t {
  kDefined,
  kUndefined,
  kNone,
  kBoolean,
  kFalse,
  kTrue,
  kInteger,
  kFloat,
  kNumber,
  kString,
  kMapping,
  kSequence,
  kIterable,
  kCallable,
  kSameas,
  kOdd,
  kEven,
  kDivisibleby,
  kIn,
  kEq,
  kNe,
  kGt,
  kGe,
  kLt,
  kLe,
  kLower,
  kUpper,
};
enum class MethodId : uint8_t {
  // str
  kStartswith,
  kEndswith,
  kSplit,
  kRsplit,
  kSplitlines,
  kStrip,
  kLstrip,
  kRstrip,
  kUpper,
  kLower,
  kReplace,
  kTitle,
  kCapitalize,
  kJoin,
  kFind,
  kRfind,
  kCount,  // also list.count
  kIndex,  // also list.index
  kRemoveprefix,
  kRemovesuffix,
  kIsdigit,
  kIsalpha,
  kIsalnum,
  kIsspace,
  kIslower,
  kIsupper,
  kFormat,
  // dict
  kItems,
  kKeys,
  kValues,
  kGet,
  // loop
  kCycle,
};
enum class GlobalId : uint8_t { kRange, kNamespace, kDict, kRaiseException, kStrftimeNow };

// Which builtin types have an attribute `name` (Python's dir(str), dir(list), ...), as
// AttributeFlag bits: the interpreter prefers these to a dict's keys, as Python's getattr does.
enum AttributeFlag : uint8_t {
  kStrAttribute = 1,
  kListAttribute = 2,
  kTupleAttribute = 4,
  kDictAttribute = 8,
  kListUnsafeAttribute = 16,  // mutating: the sandbox makes them undefined
  kDictUnsafeAttribute = 32,
};
uint8_t BuiltinAttributeFlags(std::string_view name);

std::optional<FilterId> LookupFilter(std::string_view name);
std::optional<TestId> LookupTest(std::string_view name);
std::optional<MethodId> LookupMethod(std::string_view name);
std::optional<GlobalId> LookupGlobal(std::string_view name);

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind : uint8_t {
    kConst,     // constant
    kName,      // id: the name's id
    kList,      // children
    kTuple,     // children
    kDict,      // children: key, value, key, value, ...
    kGetAttr,   // children[0].name; id: the MethodId of `name`, or -1
    kGetItem,   // children[0][children[1]]
    kSlice,     // children: start, stop, step (each may be null)
    kCall,      // children[0](children[1..], kwargs)
    kFilter,    // children[0] | name(children[1..], kwargs); id: FilterId. children[0] is
                // null in a filter block or a block set: the body's text goes there.
    kTest,      // children[0] is name(children[1..], kwargs); id: TestId
    kNot,       // children[0]
    kNeg,       // children[0]
    kPos,       // children[0]
    kBinary,    // children[0] binary_op children[1]
    kConcat,    // children joined with ~
    kAnd,       // children[0] and children[1]
    kOr,        // children[0] or children[1]
    kCompare,   // children[0] compare_ops[0] children[1] compare_ops[1] children[2] ...
    kCondExpr,  // children[1] if children[0] else children[2] (children[2] may be null)
  };

  Kind kind = Kind::kConst;
  int line = 0;
  // jinja2 folds this expression to a constant at compile time (literals and the unary and
  // binary operators on them); see the `**` quirk in the interpreter.
  bool folds_to_constant = false;
  BinaryOp binary_op = BinaryOp::kAdd;
  std::vector<CompareOp> compare_ops;
  int id = -1;
  uint8_t attribute_flags = 0;  // kGetAttr: BuiltinAttributeFlags(name)
  std::string name;
  Value constant;
  std::vector<ExprPtr> children;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

// Where `set`, `for` and `with` store values.
struct Target {
  enum class Kind : uint8_t { kName, kTuple, kNamespaceAttribute };
  Kind kind = Kind::kName;
  int name_id = -1;  // kName; kNamespaceAttribute: the namespace variable
  std::string name;
  std::string attribute;      // kNamespaceAttribute
  std::vector<Target> items;  // kTuple
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind : uint8_t {
    kText,         // text
    kPrint,        // {{ exprs[0] }}, {% print exprs... %}
    kIf,           // exprs: a test per branch; bodies: a body per test, then else's if any
    kFor,          // targets[0] in exprs[0] [if exprs[1]]; bodies: body, else
    kSet,          // targets[0] = exprs[0]
    kSetBlock,     // targets[0] = bodies[0] rendered, through `filter` if any
    kMacro,        // name(params) bodies[0]
    kFilterBlock,  // bodies[0] rendered, through `filter`
    kScope,        // with (targets = exprs) / generation: bodies[0] in a scope of its own
    kBreak,
    kContinue,
  };

  Kind kind = Kind::kText;
  int line = 0;
  std::string text;
  std::vector<ExprPtr> exprs;
  std::vector<Body> bodies;
  std::vector<Target> targets;
  ExprPtr filter;
  // kMacro
  std::string name;
  int name_id = -1;
  std::vector<int> param_ids;
  std::vector<std::string> param_names;
  std::vector<ExprPtr> defaults;  // for the last defaults.size() parameters
  bool catches_varargs = false;   // the body names `varargs`: extra positional arguments go there
  bool catches_kwargs = false;    // the body names `kwargs`: unknown keyword arguments go there
  // jinja2's scoping (idtracking.py): a frame that assigns a name it has not read before, and
  // that no enclosing frame knows, starts with the name undefined, hiding the context's value
  // until the assignment runs. The names (ids) each frame of this statement starts with
  // undefined: bodies[0]'s frame (for, macro, block set, filter block, with, generation) and,
  // for `for`, the else body's frame.
  std::vector<int> undefined_in_body;
  std::vector<int> undefined_in_else;
  // kScope: a transformers `{% generation %}` block (RenderTemplate reports its output span).
  bool generation = false;
};

struct Template {
  Body body;
  // Every identifier the template names, by id. Ids 0..2 are always loop, varargs, kwargs.
  std::vector<std::string> names;
  std::unordered_map<std::string, int> name_ids;
  static constexpr int kLoopId = 0;
  static constexpr int kVarargsId = 1;
  static constexpr int kKwargsId = 2;
  // The names the template's own frame starts with undefined (see Stmt::undefined_in_body).
  std::vector<int> undefined_at_start;
};

// Lexes and parses `source` as jinja2 would with trim_blocks and lstrip_blocks: newlines
// normalized to \n, one trailing newline dropped. Errors name the line and the construct.
Result<std::unique_ptr<Template>> ParseTemplate(std::string_view source);

// Whether any statement of `tmpl` (macro bodies included) is a `{% generation %}` block.
bool HasGenerationBlocks(const Template& tmpl);

}  // namespace flywheel::tokenizer::jinja
