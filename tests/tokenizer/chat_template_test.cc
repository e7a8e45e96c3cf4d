// ChatTemplate against Python jinja2 configured as transformers' apply_chat_template
// (tests/tokenizer/render_chat_template.py): every case of the `MatchesJinja2` suite renders
// here and there and must agree byte for byte, or both must fail. The reference runs once for
// the whole suite; without python3-jinja2 those cases are skipped (and fail a CI run,
// tests/ALLOWED_SKIPS.md); a reference that crashes fails them all. Refusals, error messages
// and speed are checked without the reference.
#include "tokenizer/chat_template.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace flywheel::tokenizer {
namespace {

using nlohmann::ordered_json;

const std::string kSourceDir = FLYWHEEL_SOURCE_DIR;
const std::string kReferenceScript = kSourceDir + "/tests/tokenizer/render_chat_template.py";
const std::string kTemplateDir = kSourceDir + "/tests/tokenizer/templates/";
constexpr const char* kPython = "/usr/bin/python3";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Case {
  std::string name;     // gtest parameter name
  std::string source;   // the template
  std::string context;  // JSON object
};

// ---------------------------------------------------------------------------------------------
// The language, snippet by snippet.

std::vector<Case> LanguageCases() {
  return {
      // Whitespace: trim_blocks, lstrip_blocks, - and + markers, comments, raw.
      {"TrimBlocksDropsNewlineAfterTag", "{% if true %}\nyes\n{% endif %}\nend\n", "{}"},
      {"LstripBlocksIndentedTags", "  {% if true %}\n    x\n  {% endif %}\n  y", "{}"},
      {"MinusStripsAllWhitespace", "a  \n {%- if true -%}  \n b \n {%- endif -%} \n c", "{}"},
      {"VariableMinus", "a \n {{- 'x' -}} \n b\n  {{ 'y' }}  \n", "{}"},
      {"PlusKeepsIndentation", "  {%+ if true %}x{% endif %}\n\t{%+ if true +%}\ny{% endif %}",
       "{}"},
      {"CommentsTrimAndStrip", "a\n  {# note #}\nb\n{#- note -#}  \n  c {# x +#}\nd", "{}"},
      {"LstripOnlyAtLineStart", "text  {% if true %}x{% endif %}\n \t {% if true %}y{% endif %}",
       "{}"},
      {"LineStartAfterTrimmedNewline", "{% if true %}\n  {% if true %}x{% endif %}\n{% endif %}",
       "{}"},
      {"TrailingNewlineDropped", "x\n\n", "{}"},
      {"NewlinesNormalized", "a\r\nb\rc\r\n{{ 'd' }}", "{}"},
      {"RawBlock",
       "{% raw %}{{ not rendered }} {% if %}{% endraw %}|\n  {%- raw -%}  {{x}}  {%- endraw -%}  y",
       "{}"},
      {"BracesInsideVariable", "{{ {'a': {'b': 1}} }} { not a tag } }}", "{}"},
      {"UnicodeWhitespaceStripped", "x\u3000\u00a0{%- if true %}y{% endif %}", "{}"},

      // Printing values as Python's str().
      {"PrintNoneTrueFalse", "{{ none }} {{ None }} {{ true }} {{ False }} {{ n }} {{ t }}",
       R"({"n": null, "t": true})"},
      {"IntAndFloatPrinting",
       "{{ 1 }} {{ 1.0 }} {{ 1.5e3 }} {{ 1e-5 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.1 + 0.2 "
       "}} "
       "{{ 10 / 4 }} {{ 10 / 5 }} {{ 10 // 4 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7.5 % 2 }} "
       "{{ -7.5 // 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 1_000 }} {{ 0x1F }} {{ 0o17 }} {{ 0b101 }}",
       "{}"},
      {"ContextNumbers", "{{ i }} {{ f }} {{ big }} {{ neg }} {{ tiny }} {{ huge }} {{ f + i }}",
       R"({"i": 3, "f": 2.0, "big": 12345678901234, "neg": -0.5, "tiny": 1.5e-7, "huge": 3e20})"},
      {"ContainerRepr",
       "{{ [1, 'a', none, true, 2.5] }} {{ {'k': 'v', 'n': [1]} }} {{ (1,) }} {{ (1, 2) }} "
       "{{ () }} {{ [] }} {{ {} }} {{ d }}",
       R"({"d": {"z": [1, {"y": null}], "a": "x"}})"},
      {"StringReprQuoting", R"({{ ["it's", 'say "hi"', 'both \' "', 'tab\there', 'nl\n', '\\'] }})",
       "{}"},
      {"StringReprUnicode", "{{ items }}",
       R"({"items": ["日本", "emoji 😀", "\u00a0nbsp", "\u200bzw", "\u0007bell", "\u007f", "é"]})"},
      {"StringLiteralEscapes", R"({{ 'a\tb\\c\x41\u00e9\U0001F600\101|\q|\'|\"' }})", "{}"},
      {"AdjacentStringLiterals", R"({{ 'a' 'b' "c" }})", "{}"},
      {"StringLineContinuation", "{{ \"one \\\ntwo\" }}", "{}"},

      // Operators.
      {"Concatenation", "{{ 'a' ~ 1 ~ none ~ true ~ nothing ~ 1.0 ~ [1] }}", "{}"},
      {"Arithmetic",
       "{{ 1 + 2 * 3 - 4 / 2 }} {{ (1 + 2) * 3 }} {{ 'ab' * 3 }} {{ 2 * 'x' }} {{ [1] * 2 }} "
       "{{ [1] + [2] }} {{ 'a' + 'b' }} {{ true + 1 }} {{ -3 }} {{ +3 }} {{ - 2.5 }} {{ 2 ** 3 ** "
       "2 }} "
       "{{ -2 ** 2 }} {{ 7 % -3 }} {{ 1 - 0.5 }}",
       "{}"},
      {"Comparisons",
       "{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} "
       "{{ 1 != 2 }} {{ none == none }} {{ [1] == [1] }} {{ {'a': 1} == {'a': 1} }} {{ 3 >= 3 }} "
       "{{ true == 1 }} {{ 'é' > 'z' }} {{ nothing == nothing2 }} {{ nothing == none }}",
       "{}"},
      {"InOperator",
       "{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'x' not in 'abc' }} "
       "{{ 1 in nothing }} {{ 1.0 in [1] }} {{ 'a' in ['a'] }} {{ 'tool_calls' in m }}",
       R"({"m": {"role": "assistant", "tool_calls": []}})"},
      {"AndOrReturnOperands",
       "{{ 0 or 'x' }} {{ 'a' and 'b' }} [{{ '' and 'b' }}] {{ none or [] }} {{ not 0 }} "
       "{{ not 'a' }} {{ nothing or 'fallback' }}",
       "{}"},
      {"ConditionalExpression",
       "{{ 'y' if true else 'n' }} {{ 'y' if false else 'n' }} [{{ 'y' if false }}] "
       "{{ 'a' if false else 'b' if true else 'c' }}",
       "{}"},
      {"NotAndTestPrecedence", "{{ not 1 == 2 }} {{ not x is defined }} {{ not x is not defined }}",
       "{}"},
      {"PercentFormatting",
       "{{ '%s and %s' % ('a', 1) }}|{{ '%(a)s=%(b)r' % {'a': 1, 'b': 'x'} }}|{{ '%s' % [1, 2] }}|"
       "{{ '%5s|%-5s|%.2s' % ('ab', 'cd', 'xyz') }}|{{ '%d%%' % 50 }}|{{ '%05.1f' % -2.25 }}|"
       "{{ '%+d %x %o %e' % (5, 255, 8, 12345.678) }}|{{ '%s' % none }}",
       "{}"},
      {"NegativeConstantPowerQuirk",
       "{{ -2 ** 2 }} {{ -2 ** two }} {{ (-2) ** two }} {{ -x ** 2 }} {{ (-1) ** 3 }} {{ (-1) ** 4 }} "
       "{{ (-2) ** 3 }} {{ 0 ** 0 }} {{ 0 ** 5 }} {{ 1 ** 99 }}", R"({"two": 2, "x": 3})"},
      {"FilterBindsTighterThanOperators",
       "{{ -1|abs }} {{ 'a' ~ 'b'|upper }} {{ [1, 2, 3]|length * 2 }} {{ 'x' + 'y'|upper }}", "{}"},

      // Attribute and item access.
      {"AttributeAndItemAccess",
       "{{ d.a }} {{ d['a'] }} {{ d.b.c }} {{ l[0] }} {{ l[-1] }} {{ l.1 }} [{{ l[10] }}] "
       "[{{ d.missing }}] [{{ d['missing'] }}] [{{ n.attr }}] [{{ s.nope }}] {{ d.b['c'] }}",
       R"({"d": {"a": 1, "b": {"c": "x"}}, "l": [10, 20, 30], "n": null, "s": "str"})"},
      {"DictMethodsShadowKeys",
       "{{ d['items'] }} {{ d.items() | list }} {{ d.get('items') }} {{ d.get('nope') }} "
       "{{ d.get('nope', 'dflt') }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.type }} "
       "{{ d.items is defined }} {{ d.update is defined }}",
       R"({"d": {"items": [1, 2], "type": "array"}})"},
      {"Slicing",
       "{{ l[1:] }} {{ l[:-1] }} {{ l[::-1] }} {{ l[::2] }} {{ l[-2:] }} {{ l[5:] }} "
       "{{ l[1:3:1] }} {{ l[3:0:-1] }} {{ s[1:3] }} {{ s[::-1] }} {{ u[::-1] }} {{ u[1] }} "
       "{{ u[-1] }} {{ u[1:3] }} {{ (1, 2, 3)[1:] }}",
       R"({"l": [1, 2, 3, 4], "s": "hello", "u": "日本語😀"})"},
      {"StringMethods",
       "{{ s.startswith('He') }} {{ s.endswith(('x', 'lo')) }} {{ s.split() }} {{ s.split('l') }} "
       "{{ s.split('l', 1) }} {{ s.rsplit('l', 1) }} [{{ '  a b  '.strip() }}] "
       "[{{ 'xxaxx'.strip('x') }}] [{{ '  a'.lstrip() }}] [{{ 'a  '.rstrip() }}] "
       "[{{ 'abc'.lstrip('ba') }}] [{{ '\\n\\nx\\n'.strip('\\n') }}] {{ s.upper() }} {{ s.lower() "
       "}} "
       "{{ s.replace('l', 'L') }} {{ s.replace('l', 'L', 1) }} {{ 'hello world-x'.title() }} "
       "{{ 'hELLO wORLD'.capitalize() }} {{ ', '.join(['a', 'b']) }} {{ s.find('l') }} "
       "{{ s.rfind('l') }} {{ s.find('z') }} {{ s.count('l') }} {{ s.index('e') }} "
       "{{ '12'.isdigit() }} {{ 'ab'.isalpha() }} {{ ' '.isspace() }} {{ 'ab'.islower() }} "
       "{{ 'AB'.isupper() }} {{ 'a1'.isalnum() }} {{ 'a{}b{}'.format(1, 'x') }} "
       "{{ '{0}-{name}-{0!r}'.format('p', name='n') }} {{ 'pre_x'.removeprefix('pre_') }} "
       "{{ 'x.py'.removesuffix('.py') }} {{ 'a\\nb\\r\\nc\\n'.splitlines() }}",
       R"({"s": "Hello"})"},
      {"UnicodeStringOperations",
       "{{ u|length }} {{ u.upper() }} {{ 'straße'.upper() }} {{ 'ÀÉΣ'.lower() }} {{ u[0] }} "
       "[{{ '\u3000 日本 \u00a0'.strip() }}] {{ 'éCOLE à paris'.title() }} {{ 'éa'.capitalize() }} "
       "{{ 'a😀b'.find('b') }} {{ 'x😀y😀'.split('😀') }} {{ 'ÀB'|lower }} {{ 'àb'|upper }}",
       R"({"u": "日本語😀"})"},
      {"SplitEdgeCases",
       "{{ '  a  b  c  '.split(none, 1) }} {{ '  a  b  c  '.rsplit(none, 1) }} {{ ''.split() }} "
       "{{ ''.split(',') }} {{ 'a,,b'.split(',') }} {{ 'a\\tb\\nc'.split() }} {{ "
       "'abc'.split('abc') }}",
       "{}"},

      // Tests.
      {"IsTests",
       "{{ x is defined }} {{ y is defined }} {{ y is undefined }} {{ n is none }} "
       "{{ x is number }} {{ f is float }} {{ x is integer }} {{ f is integer }} {{ t is boolean "
       "}} "
       "{{ t is true }} {{ t is false }} {{ s is string }} {{ d is mapping }} {{ l is sequence }} "
       "{{ s is sequence }} {{ d is iterable }} {{ x is odd }} {{ x is even }} "
       "{{ x is divisibleby 3 }} {{ x is equalto 3 }} {{ x is eq 3 }} {{ x is ne 3 }} "
       "{{ x is gt 2 }} {{ x is lt 2 }} {{ x is ge 3 }} {{ x is le 3 }} {{ x is greaterthan 1 }} "
       "{{ t is sameas true }} {{ n is sameas none }} {{ 'a' is in 'abc' }} {{ s is lower }} "
       "{{ s is upper }} {{ t is number }} {{ y is sequence }} {{ y is iterable }} "
       "{{ l is mapping }} {{ s is not none }} {{ range is callable }} {{ x is callable }} "
       "{{ l is iterable }} {{ x is iterable }} {{ f is odd }} {{ x is sameas 3 }}",
       R"({"x": 3, "f": 1.5, "t": true, "n": null, "s": "abc", "d": {}, "l": [1]})"},

      // Loops.
      {"LoopVariables",
       "{% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
       "{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}",
       R"({"l": ["a", "b", "c"]})"},
      {"LoopPrevNextCycle",
       "{% for x in l %}[{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }}]{% endfor %}"
       "{% for x in l %}{{ loop.cycle('a', 'b') }}{% endfor %}",
       R"({"l": [1, 2, 3]})"},
      {"LoopElse",
       "{% for x in [] %}x{% else %}empty{% endfor %} {% for x in l %}{{ x }}{% else %}no{% endfor "
       "%}",
       R"({"l": [1]})"},
      {"LoopFilter",
       "{% for x in l if x > 1 %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% endfor %}"
       "{% for x in l if x > 9 %}{% else %}none{% endfor %}",
       R"({"l": [1, 2, 3]})"},
      {"LoopBreakContinue",
       "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 %}{% break %}"
       "{% endif %}{{ x }}{% endfor %}",
       "{}"},
      {"LoopOverDicts",
       "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}"
       "{% for k, v in d|items %}{{ k }}{{ v }}{% endfor %}{% for k, v in d|dictsort %}{{ k }}{% "
       "endfor %}",
       R"({"d": {"b": 1, "a": 2}})"},
      {"LoopScoping",
       "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = x + 1 %}{{ x }}{% endfor %}{{ x }}"
       "{% for i in [1] %}{% set inner = 5 %}{% endfor %}[{{ inner }}][{{ i }}]",
       "{}"},
      {"NestedLoops",
       "{% for a in [1, 2] %}{% set outer = loop %}{% for b in 'xy' %}{{ a }}{{ b }}"
       "{{ outer.index }}{{ loop.index }} {% endfor %}{% endfor %}",
       "{}"},
      {"LoopOverStringsAndUndefined",
       "{% for c in 'a😀b' %}[{{ c }}]{% endfor %}{% for x in nothing %}x{% else %}none{% endfor %}",
       "{}"},
      {"LoopTupleUnpacking", "{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}", "{}"},
      {"ToolRenderingIdioms",
       "{% set users = msgs|selectattr('role', 'equalto', 'user')|list %}"
       "{% for m in msgs %}{{ m == users[-1] }},{{ m.get('tool_calls') is none }};{% endfor %}"
       "{% for key, val in fn.items() if key != 'return' %}{{ key }}={{ val|tojson }}"
       "{{ ', ' if not loop.last }}{% endfor %}|{{ (fn|tojson)[:-1] }}|{{ id[-9:] }}",
       R"({"msgs": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": []},
           {"role": "user", "content": "c"}],
           "fn": {"name": "f", "return": {"type": "string"}, "parameters": {"type": "object"}},
           "id": "call_0123456789abc"})"},

      // Assignment, namespaces, scopes.
      {"SetTuplesAndLists",
       "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c = [1, 2] %}{{ c }}{% set d = 1, 2 %}{{ d }}"
       "{% set (e, f) = 'xy' %}{{ e }}{{ f }}",
       "{}"},
      {"NamespaceAcrossLoop",
       "{% set ns = namespace(count=0, found=false) %}{% for x in [1, 2, 3] %}"
       "{% set ns.count = ns.count + x %}{% if x == 2 %}{% set ns.found = true %}{% endif %}"
       "{% endfor %}{{ ns.count }} {{ ns.found }} [{{ ns.missing }}]",
       "{}"},
      {"NamespaceFromDict", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}", "{}"},
      {"BlockSet",
       "{% set body %}\n  hello {{ name }}\n{% endset %}[{{ body }}]{% set up | upper %}abc{% "
       "endset %}"
       "{{ up }}",
       R"({"name": "you"})"},
      {"IfDoesNotScope", "{% if true %}{% set y = 5 %}{% endif %}{{ y }}", "{}"},
      {"WithBlock", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]", "{}"},
      {"PrintStatement", "{% print 'a', 1 %}", "{}"},
      {"BlockSetIntoNamespace",
       "{% set ns = namespace() %}{% set ns.text %}a{{ 1 }}{% endset %}{{ ns.text }}", "{}"},
      // jinja2 decides scopes statically (idtracking.py): a frame that assigns a name it never
      // read before starts with it undefined, even where the context has it.
      {"ScopingTopLevelSetHidesContextFromMacros",
       "{% macro m() %}<{{ x }}>{% endmacro %}{{ m() }}{% set x = 5 %}{{ m() }}", R"({"x": "X"})"},
      {"ScopingTopLevelSetHidesContextFromLoops",
       "{% for i in [1] %}[{{ x }}]{% endfor %}{% set x = 5 %}{{ x }}", R"({"x": "X"})"},
      {"ScopingReadBeforeSetKeepsContext",
       "[{{ x }}]{% set x = 5 %}{% for i in [1] %}{{ x }}{% endfor %}", R"({"x": "X"})"},
      {"ScopingNestedLoopSeesOuterIterationsUndefined",
       "{% for i in [1] %}{% for j in [1] %}[{{ x }}]{% endfor %}{% set x = 5 %}{% endfor %}",
       R"({"x": "X"})"},
      {"ScopingConditionalSetKeepsContext",
       "{% macro m() %}<{{ x }}>{% endmacro %}{{ m() }}{% if false %}{% set x = 1 %}{% endif %}",
       R"({"x": "X"})"},
      {"ScopingSetInBothBranchesHidesContext",
       "{% macro m() %}<{{ x }}>{% endmacro %}{{ m() }}{% if false %}{% set x = 1 %}{% else %}"
       "{% set x = 2 %}{% endif %}{{ m() }}",
       R"({"x": "X"})"},

      // Macros.
      {"MacroDefaultsAndKeywords",
       "{% macro greet(name, greeting='Hello', punct='!') %}{{ greeting }}, {{ name }}{{ punct }}"
       "{% endmacro %}{{ greet('A') }} {{ greet('B', 'Hi') }} {{ greet('C', punct='?') }} "
       "{{ greet(name='D') }}",
       "{}"},
      {"MacroVarargsKwargs",
       "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, x=4) }}", "{}"},
      {"MacroSeesTemplateVariables",
       "{% set g = 'G' %}{% macro m() %}{{ g }}{{ ctx }}{% endmacro %}{% set g = 'H' %}{{ m() }}",
       R"({"ctx": "C"})"},
      {"MacroRecursion",
       "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1)|int }}{% endif %}"
       "{% endmacro %}{{ fact(5) }}",
       "{}"},
      {"MacroMissingParameter",
       "{% macro m(a, b) %}[{{ a }}][{{ b }}][{{ b is defined }}]{% endmacro %}{{ m(1) }}", "{}"},
      {"MacroDefaultSeesEarlierParameter",
       "{% macro m(a, b=a ~ '!') %}{{ b }}{% endmacro %}{{ m('x') }}", "{}"},

      // Filters.
      {"StringFilters",
       "[{{ '  x '|trim }}] [{{ 'xxhixx'|trim('x') }}] {{ 'ab'|upper }} {{ 'AB'|lower }} "
       "{{ 'hello world-foo(bar <baz'|title }} {{ 'hELLo'|capitalize }} "
       "{{ 'aaa'|replace('a', 'b', 2) }} {{ 5|string ~ 'x' }} {{ none|string }} {{ nothing|upper "
       "}}",
       "{}"},
      {"SequenceFilters",
       "{{ l|length }} {{ l|count }} {{ l|first }} {{ l|last }} {{ l|join(', ') }} {{ l|join }} "
       "{{ l|reverse|list }} {{ l|sort }} {{ l|sort(reverse=true) }} {{ [3, 1, 2]|max }} "
       "{{ [3, 1, 2]|min }} {{ [1, 2, 3]|sum }} {{ l|list }} {{ 'abc'|list }} "
       "{{ [1, 1, 2, 1]|unique|list }} {{ ['b', 'A', 'a', 'B']|sort }} "
       "{{ ['b', 'A', 'a']|sort(case_sensitive=true) }} {{ ['A', 'a', 'b']|unique|list }} "
       "{{ 'abc'|reverse }} {{ 'abc'|first }} {{ ''|first is defined }} {{ []|last is defined }} "
       "{{ users|sort(attribute='age')|map(attribute='name')|join }} {{ users|sum(attribute='age') "
       "}} "
       "{{ users|max(attribute='age') }} {{ users|join(',', attribute='name') }}",
       R"({"l": [3, 1, 2], "users": [{"name": "b", "age": 30}, {"name": "a", "age": 20}]})"},
      {"DictFilters",
       "{{ d|length }} {{ d|items|list }} {{ d|dictsort }} {{ d|dictsort(by='value', reverse=true) "
       "}} "
       "{{ d|list }} {{ d|first }} {{ d|last }} {{ nothing|items|list }}",
       R"({"d": {"b": 1, "a": 2, "C": 0}})"},
      {"DefaultFilter",
       "{{ x|default('dflt') }} {{ none|default('dflt') }} {{ ''|default('dflt', true) }} "
       "{{ 0|d('z', true) }} {{ 'set'|d('z') }} [{{ x|default }}] {{ d.nope|default('dd') }}",
       R"({"d": {}})"},
      {"NumberFilters",
       "{{ '42'|int }} {{ '42.9'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} {{ -3.9|int "
       "}} "
       "{{ '0x1A'|int(base=16) }} {{ ' 7 '|int }} {{ '1_000'|int }} {{ '3.5'|float }} {{ 'x'|float "
       "}} "
       "{{ 2|float }} {{ -3|abs }} {{ -2.5|abs }} {{ 2.567|round(2) }} {{ 2.5|round }} "
       "{{ 3.5|round }} {{ 2.1|round(method='ceil') }} {{ 2.9|round(method='floor') }} "
       "{{ 5|round }} {{ true|int }} {{ none|int }} {{ '1e3'|float }}",
       "{}"},
      {"SelectRejectMap",
       "{{ msgs|selectattr('role', 'equalto', 'user')|list|length }} "
       "{{ msgs|rejectattr('role', 'eq', 'user')|map(attribute='content')|join(',') }} "
       "{{ [0, 1, 2, '', 'a']|select|list }} {{ [1, 2, 3, 4]|select('odd')|list }} "
       "{{ [1, 2, 3, 4]|reject('even')|list }} {{ msgs|map(attribute='content')|first }} "
       "{{ ['a', 'b']|map('upper')|list }} {{ msgs|selectattr('tool_calls')|list|length }} "
       "{{ msgs|map(attribute='missing', default='-')|list }} {{ [1, 2, 3]|select('gt', 1)|list }} "
       "{{ [1, 2]|map('string')|join('+') }} {{ msgs|selectattr('role', 'in', ['system', "
       "'tool'])|list|length }} "
       "{{ ['a', 'bb']|map('length')|list }} {{ msgs|selectattr('role', 'equalto', 'system')|list "
       "}}",
       R"({"msgs": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1", "tool_calls": [1]}, {"role": "user", "content": "u2"}]})"},
      {"IndentFilter",
       "{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent('>', "
       "blank=true) }}|"
       "{{ 'x'|indent(first=true) }}|{{ ''|indent }}",
       "{}"},
      {"FilterBlocks",
       "{% filter upper %}hello {{ name }}{% endfilter %}|{% filter trim|title %}  a b  {% "
       "endfilter %}",
       R"({"name": "you"})"},
      {"GenerationBlock",
       "{% for m in msgs %}{% generation %}{{ m }}{% set inner = 1 %}{% endgeneration %}{% endfor "
       "%}"
       "[{{ inner }}]",
       R"({"msgs": ["a", "b"]})"},

      // tojson, as transformers defines it.
      {"TojsonDefaults",
       "{{ d|tojson }} {{ l|tojson }} {{ s|tojson }} {{ none|tojson }} {{ true|tojson }} "
       "{{ 1.0|tojson }} {{ 1e100|tojson }} {{ (1, 2)|tojson }} {{ {}|tojson }} {{ []|tojson }} "
       "{{ 'é'|tojson(true) }}",
       R"({"d": {"z": 1, "a": {"y": [1, 2.5, null, true], "b": "x"}, "m": "日本"}, "l": [1, "two", 3.0], "s": "a\"b\\c\n\t\u0001\u001fé😀<>&'/\u007f\u2028"})"},
      {"TojsonOptions",
       "{{ d|tojson(indent=2) }}\n{{ d|tojson(indent=4, sort_keys=true) }}\n"
       "{{ d|tojson(separators=(',', ':')) }}\n{{ s|tojson(ensure_ascii=true) }}\n"
       "{{ d|tojson(indent='\\t') }}\n{{ [[], {}, [1]]|tojson(indent=1) }}\n{{ d|tojson(indent=0) "
       "}}",
       R"({"d": {"z": 1, "a": {"y": [1, 2.5, null, true], "b": "x"}, "m": "日本"}, "s": "é😀\n"})"},

      // Globals and undefined values.
      {"Globals",
       "{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(3, 0, -1)|list }} "
       "{{ dict(a=1, b='x') }} {{ range(0)|list }} {{ namespace is defined }}",
       "{}"},
      {"StrftimeNow", "{{ strftime_now('%Y') }}", "{}"},
      {"UndefinedIsEmptyAndFalsy",
       "[{{ nothing }}][{{ nothing|length }}][{{ nothing|default('d') }}][{{ nothing is defined }}]"
       "{% if nothing %}t{% else %}f{% endif %}[{{ nothing|string }}][{{ nothing|list }}]"
       "[{{ nothing|join }}][{{ nothing|first }}]",
       "{}"},

      // jinja2 raises on these; so must the renderer.
      {"ErrorAttributeOfUndefined", "{{ nothing.attr }}", "{}"},
      {"ErrorItemOfUndefined", "{{ messages[0].role }}", "{}"},
      {"ErrorArithmeticOnUndefined", "{{ nothing + 1 }}", "{}"},
      {"ErrorStrPlusInt", "{{ 'a' + 1 }}", "{}"},
      {"ErrorRaiseException", "{{ raise_exception('boom') }}", "{}"},
      {"ErrorDivisionByZero", "{{ 1 / 0 }}", "{}"},
      {"ErrorLengthOfGenerator", "{{ [1]|select|length }}", "{}"},
      {"ErrorTojsonOfUndefined", "{{ nothing|tojson }}", "{}"},
      {"ErrorUnpacking", "{% set a, b = [1] %}", "{}"},
      {"ErrorOrderingMixedTypes", "{{ 1 < 'a' }}", "{}"},
      {"ErrorSetAttributeOnDict", "{% set d = {} %}{% set d.x = 1 %}", "{}"},
      {"ErrorMacroTooManyArguments", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "{}"},
      {"ErrorItemsOfList", "{{ [1]|items|list }}", "{}"},
      {"ErrorStartswithOnUndefined", "{{ m.content.startswith('x') }}", R"({"m": {}})"},
      {"ErrorIntOfUndefined", "{{ nothing|int }}", "{}"},
  };
}

// ---------------------------------------------------------------------------------------------
// Real templates and conversations.

const char* kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city.",
    "parameters": {"type": "object", "properties": {
      "city": {"type": "string", "description": "City name, e.g. 東京"},
      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
      "days": {"type": "integer", "minimum": 1, "maximum": 7.5}},
      "required": ["city"]}}},
  {"type": "function", "function": {"name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {
      "query": {"type": "string"},
      "filters": {"type": "array", "items": {"type": "object", "properties": {"key": {"type": "string"}, "value": {"type": "string"}}}}},
      "required": ["query"]}}}
])";

std::string WithTools(const std::string& context_body) {
  return "{\"tools\": " + std::string(kTools) + ", " + context_body + "}";
}

std::vector<Case> TemplateCases() {
  const std::string qwen3 = ReadFile(kTemplateDir + "qwen3.jinja");
  const std::string llama31 = ReadFile(kTemplateDir + "llama31.jinja");
  const std::string llama2 = ReadFile(kTemplateDir + "llama2.jinja");
  const std::string mistral = ReadFile(kTemplateDir + "mistral.jinja");

  const std::string tool_conversation = R"("messages": [
      {"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What's the weather in Tokyo and Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "content": "{\"temperature\": 18}"},
      {"role": "tool", "content": "{\"temperature\": 12}"},
      {"role": "assistant", "content": "Tokyo is 18°C and Paris is 12°C."},
      {"role": "user", "content": "Thanks! 😀"}],
    "add_generation_prompt": true)";

  return {
      // Qwen3, the real chat_template.
      {"Qwen3SingleTurn", qwen3,
       R"({"messages": [{"role": "user", "content": "Hello"}], "add_generation_prompt": true})"},
      {"Qwen3MultiTurnWithSystem", qwen3,
       R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke."}],
           "add_generation_prompt": true})"},
      {"Qwen3NoGenerationPrompt", qwen3,
       R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
           "add_generation_prompt": false})"},
      {"Qwen3ThinkingDisabled", qwen3,
       R"({"messages": [{"role": "user", "content": "2+2?"}], "add_generation_prompt": true, "enable_thinking": false})"},
      {"Qwen3ThinkingEnabledExplicitly", qwen3,
       R"({"messages": [{"role": "user", "content": "2+2?"}], "add_generation_prompt": true, "enable_thinking": true})"},
      {"Qwen3ReasoningInContent", qwen3,
       R"({"messages": [{"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
           {"role": "user", "content": "And 3+3?"},
           {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n6"}],
           "add_generation_prompt": false})"},
      {"Qwen3ReasoningContentField", qwen3,
       R"({"messages": [{"role": "user", "content": "Why?"},
           {"role": "assistant", "content": "Because.", "reasoning_content": "\nThinking hard.\n"}],
           "add_generation_prompt": false})"},
      {"Qwen3ToolsAndToolCalls", qwen3, WithTools(tool_conversation)},
      {"Qwen3ToolsNoSystem", qwen3,
       WithTools(
           R"("messages": [{"role": "user", "content": "Search for cats"}], "add_generation_prompt": true)")},
      {"Qwen3ToolResponseAfterQuery", qwen3,
       WithTools(R"("messages": [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": "<think>\nNeed the tool.\n</think>\n\nLet me check.", "tool_calls": [
             {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
           {"role": "tool", "content": "<tool_response>rain</tool_response>"}],
           "add_generation_prompt": true)")},
      {"Qwen3Unicode", qwen3,
       R"({"messages": [{"role": "system", "content": "用中文回答。"},
           {"role": "user", "content": "你好，世界！🌍 \"quotes\" \\ back\tslash"},
           {"role": "assistant", "content": "你好！😀"}, {"role": "user", "content": "Ünïcödé ✓"}],
           "add_generation_prompt": true, "enable_thinking": false})"},

      // Llama 3.1 style: tools in the first user message, tojson(indent=4), raise_exception.
      {"Llama31SystemAndDate", llama31,
       R"({"bos_token": "<|begin_of_text|>", "date_string": "05 Mar 2025",
           "messages": [{"role": "system", "content": "  You are helpful.  "}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
           "add_generation_prompt": true})"},
      {"Llama31DateFromStrftimeNow", llama31,
       R"({"bos_token": "<|begin_of_text|>", "messages": [{"role": "user", "content": "Hi"}],
           "add_generation_prompt": false})"},
      {"Llama31ToolsInUserMessage", llama31,
       WithTools(R"("bos_token": "<|begin_of_text|>", "date_string": "05 Mar 2025",
           "messages": [{"role": "user", "content": "Weather in 東京?"},
             {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "東京", "days": 3}}}]},
             {"role": "tool", "content": "{\"temperature\": 21.5}"},
             {"role": "ipython", "content": {"ok": true}}],
           "add_generation_prompt": true)")},
      {"Llama31ToolsInSystemMessage", llama31,
       WithTools(
           R"("bos_token": "<|begin_of_text|>", "date_string": "05 Mar 2025", "tools_in_user_message": false,
           "messages": [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Weather?"}],
           "add_generation_prompt": true)")},
      {"Llama31BuiltinTools", llama31,
       R"({"bos_token": "<|begin_of_text|>", "date_string": "05 Mar 2025",
           "builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"],
           "messages": [{"role": "user", "content": "Search"},
             {"role": "assistant", "tool_calls": [{"function": {"name": "brave_search", "arguments": {"query": "cats", "lang": "en"}}}]},
             {"role": "tool", "content": "results"}],
           "add_generation_prompt": true})"},
      {"Llama31ErrorTwoToolCalls", llama31,
       R"({"bos_token": "", "date_string": "x", "messages": [{"role": "user", "content": "Hi"},
           {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}]}]})"},
      {"Llama31ErrorNoMessages", llama31,
       WithTools(
           R"("bos_token": "", "date_string": "x", "messages": [{"role": "system", "content": "only"}])")},

      // Llama 2 and Mistral: roles must alternate (loop.index0), bos/eos tokens.
      {"Llama2WithSystem", llama2,
       R"({"bos_token": "<s>", "eos_token": "</s>", "messages": [
           {"role": "system", "content": "Be kind."}, {"role": "user", "content": " Hi "},
           {"role": "assistant", "content": "Hello "}, {"role": "user", "content": "Bye"}]})"},
      {"Llama2ErrorRolesMustAlternate", llama2,
       R"({"bos_token": "<s>", "eos_token": "</s>", "messages": [
           {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})"},
      {"MistralConversation", mistral,
       R"({"bos_token": "<s>", "eos_token": "</s>", "messages": [
           {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
           {"role": "user", "content": "¿Qué tal? 😀"}]})"},
      {"MistralErrorSystemRole", mistral,
       R"({"bos_token": "<s>", "eos_token": "</s>", "messages": [{"role": "system", "content": "x"}]})"},
  };
}

std::vector<Case> AllCases() {
  std::vector<Case> cases = LanguageCases();
  for (Case& c : TemplateCases()) cases.push_back(std::move(c));
  return cases;
}

// ---------------------------------------------------------------------------------------------
// The reference.

struct ReferenceResult {
  bool ok = false;
  std::string text;  // the output, or the exception
};

// jinja2 not importable is a skip (listed by tests/check_skips.py; under CI=true it fails the
// run, tools/dev installs python3-jinja2). A reference that is there but crashes, exits
// non-zero or answers garbage is a failure of every case: never a skip.
struct Reference {
  std::string unavailable;                    // jinja2 cannot be imported: skip
  std::string broken;                         // the reference failed: fail
  std::map<size_t, ReferenceResult> results;  // by case index
};

// Renders the cases `indices` of `cases` in one python process (a JSON list in, a JSON list
// out).
Reference RunReference(const std::vector<Case>& cases, const std::vector<size_t>& indices) {
  Reference ref;
  if (std::system((std::string(kPython) + " -c 'import jinja2' >/dev/null 2>&1").c_str()) != 0) {
    ref.unavailable = std::string(kPython) +
                      " cannot import jinja2 (install python3-jinja2; tools/dev deps does)";
    return ref;
  }
  ordered_json request = ordered_json::array();
  for (size_t i : indices) {
    request.push_back(
        {{"template", cases[i].source}, {"context", ordered_json::parse(cases[i].context)}});
  }
  char path[] = "/tmp/chat_template_reference_XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) {
    ref.broken = "cannot create a temporary file";
    return ref;
  }
  std::string body = request.dump();
  bool written = write(fd, body.data(), body.size()) == static_cast<ssize_t>(body.size());
  close(fd);
  if (!written) {
    unlink(path);
    ref.broken = "cannot write the reference request";
    return ref;
  }
  std::string command =
      std::string(kPython) + " '" + kReferenceScript + "' < '" + std::string(path) + "'";
  FILE* pipe = popen(command.c_str(), "r");
  std::string output;
  if (pipe != nullptr) {
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) output.append(buf, n);
    int status = pclose(pipe);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
      ref.unavailable = "the reference cannot import jinja2 (exit 77)";
    } else if (status != 0) {
      ref.broken = "the reference " + command + " failed (" +
                   (WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                      : "wait status " + std::to_string(status)) +
                   "); its output: " + output.substr(0, 500);
    }
  } else {
    ref.broken = "cannot run " + command;
  }
  unlink(path);
  if (!ref.unavailable.empty() || !ref.broken.empty()) return ref;
  ordered_json results = ordered_json::parse(output, nullptr, /*allow_exceptions=*/false);
  if (!results.is_array() || results.size() != indices.size()) {
    ref.broken = "the reference answered something other than one result per case: " +
                 output.substr(0, 500);
    return ref;
  }
  for (size_t k = 0; k < indices.size(); ++k) {
    const auto& r = results[k];
    ReferenceResult result;
    result.ok = r.contains("output");
    result.text = result.ok ? r["output"].get<std::string>() : r["error"].get<std::string>();
    ref.results[indices[k]] = std::move(result);
  }
  return ref;
}

// The reference's answers for the cases this process runs: all of them in one python process
// for a plain run, one for each process ctest starts per case.
const Reference& SharedReference() {
  static const Reference ref = [] {
    std::vector<size_t> selected;
    const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
    for (int i = 0; i < unit.total_test_suite_count(); ++i) {
      const ::testing::TestSuite* suite = unit.GetTestSuite(i);
      if (std::string(suite->name()) != "Cases/MatchesJinja2") continue;
      for (int j = 0; j < suite->total_test_count(); ++j) {
        const ::testing::TestInfo* info = suite->GetTestInfo(j);
        if (info->should_run()) selected.push_back(std::stoul(info->value_param()));
      }
    }
    return RunReference(AllCases(), selected);
  }();
  return ref;
}

class MatchesJinja2 : public ::testing::TestWithParam<size_t> {};

TEST_P(MatchesJinja2, RendersIdentically) {
  static const std::vector<Case> cases = AllCases();
  const Case& c = cases[GetParam()];
  const Reference& ref = SharedReference();
  if (!ref.broken.empty()) FAIL() << "the jinja2 reference failed: " << ref.broken;
  if (!ref.unavailable.empty())
    GTEST_SKIP() << "reference renderer unavailable: " << ref.unavailable;
  auto found = ref.results.find(GetParam());
  ASSERT_NE(found, ref.results.end()) << "no reference result for this case";
  const ReferenceResult& expected = found->second;

  Result<ChatTemplate> tmpl = ChatTemplate::Parse(c.source);
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  Result<std::string> got = tmpl->Render(ordered_json::parse(c.context));
  if (!expected.ok) {
    EXPECT_FALSE(got.ok()) << "jinja2 raised " << expected.text << " but the render gave:\n"
                           << got.value();
    if (!got.ok() && expected.text.rfind("TemplateError: ", 0) == 0) {
      // raise_exception: the message must come through.
      EXPECT_NE(got.status().message().find(expected.text.substr(15)), std::string::npos)
          << got.status().ToString();
    }
    return;
  }
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, expected.text);
}

INSTANTIATE_TEST_SUITE_P(Cases, MatchesJinja2, ::testing::Range<size_t>(0, AllCases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           static const std::vector<Case> cases = AllCases();
                           return cases[info.param].name;
                         });

// ---------------------------------------------------------------------------------------------
// Refusals and errors, by name.

std::string ParseError(const std::string& source) {
  Result<ChatTemplate> tmpl = ChatTemplate::Parse(source);
  EXPECT_FALSE(tmpl.ok()) << "parsed: " << source;
  return tmpl.ok() ? "" : tmpl.status().message();
}

std::string RenderError(const std::string& source, const std::string& context = "{}") {
  Result<ChatTemplate> tmpl = ChatTemplate::Parse(source);
  EXPECT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  if (!tmpl.ok()) return "";
  Result<std::string> out = tmpl->Render(ordered_json::parse(context));
  EXPECT_FALSE(out.ok()) << "rendered: " << (out.ok() ? *out : "");
  return out.ok() ? "" : out.status().message();
}

TEST(ChatTemplateRefusal, IncludeIsRefusedByName) {
  std::string message = ParseError("a\n{% include \"x\" %}");
  EXPECT_NE(message.find("unsupported tag '{% include %}'"), std::string::npos) << message;
  EXPECT_NE(message.find("line 2"), std::string::npos) << message;
}

TEST(ChatTemplateRefusal, OtherUnsupportedTagsAreRefusedByName) {
  for (const char* tag : {"extends", "import", "from", "block", "call", "autoescape", "do"}) {
    std::string message = ParseError(std::string("{% ") + tag + " x %}");
    EXPECT_NE(message.find(std::string("'{% ") + tag + " %}'"), std::string::npos) << message;
  }
  std::string message = ParseError("{% frobnicate %}");
  EXPECT_NE(message.find("unknown tag '{% frobnicate %}'"), std::string::npos) << message;
}

TEST(ChatTemplateRefusal, UnknownFilterIsRefusedByName) {
  std::string message = ParseError("{{ x | frobnicate }}");
  EXPECT_NE(message.find("unsupported filter 'frobnicate'"), std::string::npos) << message;
  message = ParseError("{{ xs | map('frobnicate') | list }}");
  EXPECT_NE(message.find("unsupported filter 'frobnicate'"), std::string::npos) << message;
  message = ParseError("{% filter frobnicate %}x{% endfilter %}");
  EXPECT_NE(message.find("unsupported filter 'frobnicate'"), std::string::npos) << message;
}

TEST(ChatTemplateRefusal, UnknownTestIsRefusedByName) {
  std::string message = ParseError("{{ x is frobnicated }}");
  EXPECT_NE(message.find("unsupported test 'frobnicated'"), std::string::npos) << message;
  message = ParseError("{{ xs | select('frobnicated') | list }}");
  EXPECT_NE(message.find("unsupported test 'frobnicated'"), std::string::npos) << message;
}

TEST(ChatTemplateRefusal, UnknownMethodAndFunctionAreRefusedByName) {
  std::string message = ParseError("{% set _ = xs.append(1) %}");
  EXPECT_NE(message.find("unsupported method 'append'"), std::string::npos) << message;
  message = ParseError("{{ lipsum(2) }}");
  EXPECT_NE(message.find("unsupported function 'lipsum'"), std::string::npos) << message;
  message = ParseError("{{ f(*args) }}{% macro f() %}{% endmacro %}");
  EXPECT_NE(message.find("'*' arguments"), std::string::npos) << message;
  // A macro defined anywhere in the template may be called.
  EXPECT_TRUE(ChatTemplate::Parse("{{ later() }}{% macro later() %}{% endmacro %}").ok());
}

TEST(ChatTemplateRefusal, RecursiveLoopsAndStrayLoopControlsAreRefused) {
  std::string message = ParseError("{% for x in xs recursive %}{% endfor %}");
  EXPECT_NE(message.find("recursive"), std::string::npos) << message;
  message = ParseError("{% break %}");
  EXPECT_NE(message.find("'{% break %}' outside a for loop"), std::string::npos) << message;
}

TEST(ChatTemplateRefusal, UnterminatedConstructsNameWhatIsOpen) {
  std::string message = ParseError("x\n{% if a %}\n{% for b in c %}{% endfor %}");
  EXPECT_NE(message.find("unterminated '{% if %}'"), std::string::npos) << message;
  EXPECT_NE(message.find("'endif'"), std::string::npos) << message;
  EXPECT_NE(message.find("line 2"), std::string::npos) << message;
  message = ParseError("{% for x in y %}");
  EXPECT_NE(message.find("unterminated '{% for %}'"), std::string::npos) << message;
  message = ParseError("{{ x ");
  EXPECT_NE(message.find("unterminated '{{'"), std::string::npos) << message;
  message = ParseError("{# comment");
  EXPECT_NE(message.find("comment"), std::string::npos) << message;
  message = ParseError("{{ 'abc }}");
  EXPECT_NE(message.find("unterminated string literal"), std::string::npos) << message;
  message = ParseError("{% endif %}");
  EXPECT_NE(message.find("'{% endif %}'"), std::string::npos) << message;
}

TEST(ChatTemplateRender, RaiseExceptionFailsWithItsMessageAndLine) {
  std::string message =
      RenderError("\n\n{{ raise_exception('Conversation roles must alternate') }}");
  EXPECT_NE(message.find("raise_exception: Conversation roles must alternate"), std::string::npos)
      << message;
  EXPECT_NE(message.find("line 3"), std::string::npos) << message;
}

TEST(ChatTemplateRender, UndefinedMisuseFailsNamingTheVariable) {
  std::string message = RenderError("{{ messages[0].role }}");
  EXPECT_NE(message.find("'messages' is undefined"), std::string::npos) << message;
  message = RenderError("{{ m.content.strip() }}", R"({"m": {"role": "user"}})");
  EXPECT_NE(message.find("'dict object' has no attribute 'content'"), std::string::npos) << message;
}

TEST(ChatTemplateRender, ContextMustBeAnObject) {
  Result<ChatTemplate> tmpl = ChatTemplate::Parse("x");
  ASSERT_TRUE(tmpl.ok());
  EXPECT_FALSE(tmpl->Render(ordered_json::array()).ok());
}

TEST(ChatTemplateRender, KeyOrderOfTheContextIsKept) {
  Result<ChatTemplate> tmpl = ChatTemplate::Parse("{{ d|tojson }}");
  ASSERT_TRUE(tmpl.ok());
  Result<std::string> out = tmpl->Render(ordered_json::parse(R"({"d": {"z": 1, "a": 2, "m": 3}})"));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, R"({"z": 1, "a": 2, "m": 3})");
}

// Outputs jinja2 gave for the real Qwen3 template, kept here so that the renderer is checked
// even where the reference cannot run.
TEST(ChatTemplateGolden, Qwen3ToolCallWithThinkingDisabled) {
  Result<ChatTemplate> tmpl = ChatTemplate::Parse(ReadFile(kTemplateDir + "qwen3.jinja"));
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  Result<std::string> out = tmpl->Render(ordered_json::parse(R"({
      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "description": "東京"}}, "required": ["city"]}}}],
      "messages": [{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
        {"role": "tool", "content": "rain"}],
      "add_generation_prompt": true, "enable_thinking": false})"));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out,
            "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the "
            "user query.\n\nYou are provided with function signatures within <tools></tools> XML "
            "tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
            "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": "
            "\"string\", \"description\": \"東京\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor "
            "each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
            "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather?"
            "<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", "
            "\"arguments\": {\"city\": \"東京\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n"
            "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n"
            "</think>\n\n");
}

TEST(ChatTemplateGolden, WhitespaceControlAndPythonValues) {
  Result<ChatTemplate> tmpl = ChatTemplate::Parse(
      "{% for x in xs %}\n  {{- x }} {{ x is float }}\n{% endfor %}\n{{ [none, true, 1.0] }}\n");
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  Result<std::string> out = tmpl->Render(ordered_json::parse(R"({"xs": [1, 2.0]})"));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(*out, "1 False\n2.0 True\n[None, True, 1.0]");
}

// A Qwen3 render of a tool conversation (about 4 KB of output) stays well under a millisecond.
TEST(ChatTemplateSpeed, Qwen3RenderIsFast) {
  Result<ChatTemplate> tmpl = ChatTemplate::Parse(ReadFile(kTemplateDir + "qwen3.jinja"));
  ASSERT_TRUE(tmpl.ok()) << tmpl.status().ToString();
  ordered_json context = ordered_json::parse(WithTools(R"("messages": [
      {"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What's the weather in Tokyo and Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}},
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "{\"temperature\": 18}"},
      {"role": "tool", "content": "{\"temperature\": 12}"},
      {"role": "assistant", "content": "Tokyo is 18°C and Paris is 12°C. Anything else I can help with today?"},
      {"role": "user", "content": "Thanks! Could you also look up the forecast for the next three days in both cities, please?"},
      {"role": "assistant", "content": "<think>\nThe user wants a forecast.\n</think>\n\nSure, one moment."},
      {"role": "user", "content": "Great."}],
    "add_generation_prompt": true)"));
  // Ten more turns, for a prompt of several KB.
  ordered_json& messages = context["messages"];
  for (int i = 0; i < 10; ++i) {
    std::string question =
        "Question " + std::to_string(i) + ": what else should I pack for a rainy week in Tokyo?";
    messages.insert(messages.end() - 1,
                    ordered_json::object({{"role", "user"}, {"content", question}}));
    messages.insert(messages.end() - 1,
                    ordered_json::object(
                        {{"role", "assistant"},
                         {"content",
                          "<think>\nConsider the weather.\n</think>\n\nAn umbrella, a "
                          "light rain jacket, quick-drying shoes and a spare pair of socks."}}));
  }
  Result<std::string> first = tmpl->Render(context);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_GT(first->size(), 3000u);
  constexpr int kRenders = 200;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRenders; ++i) {
    Result<std::string> out = tmpl->Render(context);
    ASSERT_TRUE(out.ok());
    ASSERT_EQ(out->size(), first->size());
  }
  double micros =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
      kRenders;
  std::printf("qwen3 render: %zu bytes in %.1f us\n", first->size(), micros);
  EXPECT_LT(micros, 1000.0);
}

}  // namespace
}  // namespace flywheel::tokenizer

namespace flywheel::tokenizer {
namespace {

// Hostile templates: every prefix cut and thousands of byte changes of the real templates
// either parse or are refused with a message, and what parses renders or fails cleanly.
TEST(ChatTemplateRobustness, MangledTemplatesAreRefusedOrRenderCleanly) {
  const nlohmann::ordered_json context = {
      {"messages", {{{"role", "system"}, {"content", "s"}}, {{"role", "user"}, {"content", "u"}}}},
      {"add_generation_prompt", true},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"}};
  std::mt19937_64 rng(5);
  size_t parsed = 0, refused = 0;
  for (const char* name : {"qwen3.jinja", "llama31.jinja", "mistral.jinja"}) {
    std::ifstream in(std::string(FLYWHEEL_SOURCE_DIR) + "/tests/tokenizer/templates/" + name);
    std::stringstream buffer;
    buffer << in.rdbuf();
    const std::string source = buffer.str();
    ASSERT_FALSE(source.empty()) << name;
    const char alphabet[] = "{}%#-+()[].,:'\"|~ \n\tabcdefghijklmnopqrstuvwxyz0123456789=<>!*/\xff\xc3";
    for (int round = 0; round < 1500; ++round) {
      std::string text = source;
      if (round % 3 == 0) {
        text.resize(rng() % text.size());
      } else {
        for (int k = 0, n = 1 + static_cast<int>(rng() % 4); k < n; ++k)
          text[rng() % text.size()] = alphabet[rng() % (sizeof(alphabet) - 1)];
      }
      auto t = ChatTemplate::Parse(text);
      if (!t.ok()) {
        EXPECT_FALSE(t.status().message().empty());
        ++refused;
        continue;
      }
      ++parsed;
      auto out = t->Render(context);
      if (!out.ok()) EXPECT_FALSE(out.status().message().empty());
    }
  }
  EXPECT_GT(parsed, 100u);
  EXPECT_GT(refused, 100u);
}

// RenderWithGenerationSpans: the byte ranges transformers' AssistantTracker records, here
// checked by hand (tests/data/render_test.cc compares them with the tracker itself).
TEST(ChatTemplateGenerationSpans, ReportsEachBlockInOrder) {
  auto t = ChatTemplate::Parse(
      "{% for m in messages %}[{{ m.role }}]{% if m.role == 'assistant' %}{% generation %}"
      "{{ m.content }}<end>{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
      "{% generation %}{% endgeneration %}");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE(t->has_generation_blocks());
  auto out = t->RenderWithGenerationSpans(ordered_json::parse(
      R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "é1"},)"
      R"( {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]})"));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->text, "[user]q\n[assistant]é1<end>\n[user]q2\n[assistant]a2<end>\n");
  using Spans = std::vector<std::pair<size_t, size_t>>;
  // Byte offsets ("é" is two bytes); the empty block at the end is left out.
  EXPECT_EQ(out->generation_spans, (Spans{{19, 27}, {48, 55}}));
  EXPECT_EQ(out->text.substr(19, 8), "é1<end>");
  // Render gives the same text.
  EXPECT_EQ(*t->Render(ordered_json::parse(R"({"messages": []})")), "");
}

TEST(ChatTemplateGenerationSpans, BlockOutsideTheOutputIsRefused) {
  auto t = ChatTemplate::Parse(
      "{% macro turn(x) %}{% generation %}{{ x }}{% endgeneration %}{% endmacro %}{{ turn('a') }}");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE(t->has_generation_blocks());
  EXPECT_EQ(*t->Render(ordered_json::object()), "a");  // plain rendering is unaffected
  auto spans = t->RenderWithGenerationSpans(ordered_json::object());
  ASSERT_FALSE(spans.ok());
  EXPECT_NE(spans.status().message().find("generation block inside a macro"), std::string::npos)
      << spans.status().message();
  auto none = ChatTemplate::Parse("{{ add_generation_prompt }}");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_generation_blocks());
}

}  // namespace
}  // namespace flywheel::tokenizer
