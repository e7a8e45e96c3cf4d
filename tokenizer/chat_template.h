// Chat templates: the Jinja `chat_template` of an HF `tokenizer_config.json`, rendered the
// way transformers' apply_chat_template renders it: Python jinja2's
// ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
// extensions=[loopcontrols]) with the globals raise_exception(msg) and strftime_now(fmt), and
// transformers' `tojson` filter (json.dumps(x, ensure_ascii=False, indent=None,
// separators=None, sort_keys=False): ", " and ": " separators, keys in insertion order).
// tests/tokenizer/chat_template_test.cc checks the output byte for byte against jinja2 itself.
//
// The supported subset (Parse refuses anything else, naming it):
//
//   Syntax      {{ }}, {% %}, {# #}; whitespace control {%- -%} {{- -}} {#- -#} and `+`;
//               trim_blocks / lstrip_blocks exactly as jinja2's lexer applies them; one
//               trailing newline of the source dropped; {% raw %}.
//   Statements  if / elif / else; for (tuple targets, `if` filter, else, loop.index, index0,
//               revindex, revindex0, first, last, length, previtem, nextitem, cycle());
//               break / continue; set (names, tuples, ns.attr) and block set (with a
//               filter); macro (defaults, keyword arguments, varargs / kwargs); filter
//               blocks; with; print; transformers' generation / endgeneration (renders its
//               body; RenderWithGenerationSpans reports where).
//               Refused: include, import, from, extends, block, call, autoescape, do,
//               recursive loops, and any unknown tag.
//   Expressions literals (str with Python escapes, int, float, true/false/none and their
//               capitalized forms, lists, tuples, dicts), attribute and item access, slices
//               ([::-1], negative indices), calls, filters, `is` tests, not / and / or
//               (returning operands, as Python), comparisons (chained), in / not in,
//               + - * / // % ** ~ (`%` on a str is printf formatting), unary - +,
//               `x if c else y`.
//               Refused: *args / **kwargs in calls.
//   Filters     abs attr capitalize count d default dictsort first float indent int items
//               join last length list lower map max min reject rejectattr replace reverse
//               round select selectattr sort string sum title tojson trim unique upper.
//               Refused (among others): safe, escape, format, groupby, batch, slice, truncate.
//   Tests       defined undefined none boolean true false integer float number string
//               mapping sequence iterable callable sameas odd even divisibleby in
//               eq/equalto/== ne/!= gt/greaterthan/> ge/>= lt/lessthan/< le/<= lower upper.
//   Methods     str: startswith endswith split rsplit splitlines strip lstrip rstrip upper
//               lower replace title capitalize join find rfind count index removeprefix
//               removesuffix isdigit isalpha isalnum isspace islower isupper format (plain
//               {} / {0} / {name} fields); dict: items keys values get; list / tuple:
//               count index; loop.cycle. Calling any other method is refused.
//   Globals     range, namespace, dict, raise_exception, strftime_now (local time); calling
//               any other name the template does not define (as a macro or variable) is
//               refused, even where the call would never run.
//
// Values follow Python: None/True/False print as "None"/"True"/"False", floats as repr()
// ("1.0", "1e-05"), lists and dicts as their repr; strings are indexed, sliced, measured and
// case-mapped by code point; 1 == 1.0 == True. Attributes follow jinja2's sandboxed getattr
// (`d.items` is the dict method, `d['items']` the key). An undefined variable is jinja2's
// default Undefined: it prints as "", is falsy, iterates as empty, and every other use
// (attribute or item access, arithmetic, ordering, calls) fails the render, as jinja2 raises
// there. Scopes are jinja2's, static ones included: a loop, macro or block that assigns a
// name it has not read before starts with it undefined, hiding the context's value.
//
// Where this differs from jinja2 (all outside what chat templates do): integers are 64-bit
// (overflow is an error, not a big int; JSON integers beyond int64 become floats); dict keys
// are strings; generators (select, map, unique, reverse, items) are drawn eagerly and can be
// iterated again; dict.items() / keys() / values() and range() are lists (they print as lists
// and tojson accepts them); `sameas` is identity only for None, booleans, small ints and
// containers; a macro called after the scope that defined it ended (kept in a namespace) is
// an error; a string repetition, `%` width or indent beyond 64 MiB, nesting deeper than a few
// hundred levels and macro recursion deeper than 256 are errors.
//
// Cost: Parse once per template; Render of a few KB of prompt takes about 0.1 ms.
//
// Thread safety: a ChatTemplate is immutable; Render may run concurrently on one instance.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace flywheel::tokenizer {

class ChatTemplate {
 public:
  // Parses `source`; a construct outside the supported subset is refused by name here, never
  // at render time. Errors name the template line.
  static Result<ChatTemplate> Parse(std::string_view source);

  // Renders with `context` as the template's variables (messages, tools,
  // add_generation_prompt, enable_thinking, bos_token, eos_token, ...). Key order of
  // objects is kept (tojson prints keys in the order given). Fails with kInvalidArgument,
  // naming the template line, where jinja2 raises: raise_exception(msg) (the message reads
  // "raise_exception: msg"), an undefined value used beyond printing or testing, a type
  // error; with kResourceExhausted past the size limits above; with kInvalidArgument when
  // `context` is not an object.
  Result<std::string> Render(const nlohmann::ordered_json& context) const;

  // The output and, for each transformers `{% generation %}` block that produced text, the
  // [begin, end) byte range of `text` it produced, in order: what transformers'
  // return_assistant_tokens_mask tracks. Render's errors, and kInvalidArgument naming the
  // line for a generation block that renders inside a macro, block set or filter block (its
  // place in the output is unknown).
  struct Rendered {
    std::string text;
    std::vector<std::pair<size_t, size_t>> generation_spans;
  };
  Result<Rendered> RenderWithGenerationSpans(const nlohmann::ordered_json& context) const;

  // Whether the template has `{% generation %}` blocks (anywhere, macros included).
  bool has_generation_blocks() const;

 private:
  struct Program;
  std::shared_ptr<const Program> program_;
};

}  // namespace flywheel::tokenizer
