#!/usr/bin/env python3
"""Reference renderer for tests/tokenizer/chat_template_test.cc.

Renders chat templates with Python jinja2 set up as HF transformers' apply_chat_template sets
it up (transformers/utils/chat_template_utils.py, _compile_jinja_template):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
extensions=[AssistantTracker, loopcontrols]), the globals raise_exception and strftime_now,
and transformers' tojson filter.

stdin: {"template": str, "context": {...}}
  -> prints the rendered text; on an exception exits 1 with "Type: message" on stderr.
stdin: a JSON list of such objects (one process for a whole test suite)
  -> prints a JSON list of {"output": str} or {"error": "Type: message"}, one per input.
Exits 77 when jinja2 cannot be imported.
"""
import json
import sys
from datetime import datetime

try:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError as e:  # pragma: no cover
    print(f"jinja2 is not installed: {e}", file=sys.stderr)
    sys.exit(77)


class AssistantTracker(Extension):
    """transformers' {% generation %} tag, without the index tracking: renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(
            self.call_method("_generation_support"), [], [], body
        ).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(format):
    return datetime.now().strftime(format)


def make_environment():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(env, case):
    return env.from_string(case["template"]).render(**case.get("context", {}))


def main():
    request = json.loads(sys.stdin.read())
    env = make_environment()
    if isinstance(request, list):
        results = []
        for case in request:
            try:
                results.append({"output": render(env, case)})
            except Exception as e:  # noqa: BLE001 - every failure is a result to compare
                results.append({"error": f"{type(e).__name__}: {e}"})
        json.dump(results, sys.stdout)
        return 0
    try:
        sys.stdout.write(render(env, request))
    except Exception as e:  # noqa: BLE001
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
