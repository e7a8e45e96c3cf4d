#!/usr/bin/env python3
"""Reference for tests/data/render_test.cc: where a conversation's trained assistant turns are
in its chat-template rendering, computed with Python jinja2 (set up as transformers'
apply_chat_template, tests/tokenizer/render_chat_template.py) by the rules data/render.h
states:

  generation blocks  the template has {% generation %}: the spans the blocks produced, tracked
                     as transformers' AssistantTracker tracks them (the length of the output
                     streamed so far when a block ends), matched in order to the assistant
                     messages (weight 0 drops one);
  prefixes           otherwise, turn i spans from the common prefix of
                     render(messages[:i], add_generation_prompt=True) and
                     render(messages[:i+1]) to the end of the latter, cut after the last
                     end-of-turn marker in it; one sequence (the whole conversation) when each
                     render(messages[:i+1]) is a prefix of the whole render,
  per turn           else one sequence per trained turn.

stdin: a JSON list of {"template", "messages", "trained": [bool], "tools"?, "extra"?: {...},
"bos_token", "eos_token", "end_of_turn": [str]}.
stdout: a JSON list of {"method", "sequences": [{"text", "spans": [[begin, end]]}]} with byte
(UTF-8) offsets, or {"error": "..."}. Exits 77 when jinja2 cannot be imported.
"""
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tokenizer"))
try:
    import jinja2
    import jinja2.ext
    import jinja2.sandbox
    from jinja2.ext import Extension
    import render_chat_template as reference
except ImportError as e:  # pragma: no cover
    print(f"jinja2 is not installed: {e}", file=sys.stderr)
    sys.exit(77)


class TrackingAssistant(Extension):
    """transformers' AssistantTracker with its index tracking."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        environment.extend(activate_tracker=self.activate_tracker)
        self._rendered_blocks = None
        self._generation_indices = None

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(
            self.call_method("_generation_support"), [], [], body
        ).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        rv = caller()
        if self._rendered_blocks is not None:
            start = len("".join(self._rendered_blocks))
            self._generation_indices.append((start, start + len(rv)))
        return rv

    def activate_tracker(self, rendered_blocks, generation_indices):
        self._rendered_blocks = rendered_blocks
        self._generation_indices = generation_indices


def environment():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[TrackingAssistant, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = reference.tojson
    env.globals["raise_exception"] = reference.raise_exception
    env.globals["strftime_now"] = reference.strftime_now
    return env


def byte_offset(text, char_index):
    return len(text[:char_index].encode("utf-8"))


class Case:
    def __init__(self, env, case):
        self.case = case
        self.template = env.from_string(case["template"])
        self.env = env

    def context(self, messages, add_generation_prompt):
        context = dict(self.case.get("extra", {}))
        context["messages"] = messages
        if self.case.get("tools") is not None:
            context["tools"] = self.case["tools"]
        context["add_generation_prompt"] = add_generation_prompt
        context["bos_token"] = self.case["bos_token"]
        context["eos_token"] = self.case["eos_token"]
        return context

    def render(self, messages, add_generation_prompt):
        return self.template.render(**self.context(messages, add_generation_prompt))

    def generation_spans(self):
        blocks, indices = [], []
        self.env.activate_tracker(blocks, indices)
        try:
            for chunk in self.template.generate(**self.context(self.case["messages"], False)):
                blocks.append(chunk)
        finally:
            self.env.activate_tracker(None, None)
        return "".join(blocks), indices

    def turn_span(self, i):
        messages = self.case["messages"]
        prompt = self.render(messages[:i], True)
        with_turn = self.render(messages[: i + 1], False)
        begin = len(os.path.commonprefix([prompt, with_turn]))
        end = len(with_turn)
        cut = None
        for marker in self.case["end_of_turn"]:
            at = with_turn.rfind(marker, begin, end)
            if at >= 0 and (cut is None or at + len(marker) > cut):
                cut = at + len(marker)
        return with_turn, begin, (end if cut is None else cut)


def spans_by_generation(case):
    text, indices = case.generation_spans()
    messages, trained = case.case["messages"], case.case["trained"]
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    indices = [(b, e) for b, e in indices if e > b]
    if len(indices) == len(assistants):
        indices = [span for span, i in zip(indices, assistants) if trained[i]]
    elif not all(trained[i] for i in assistants):
        raise ValueError("generation blocks do not match the assistant messages")
    spans = [[byte_offset(text, b), byte_offset(text, e)] for b, e in indices]
    return {"method": "generation blocks", "sequences": [{"text": text, "spans": spans}]}


def spans_by_prefixes(case):
    messages, trained = case.case["messages"], case.case["trained"]
    turns = [case.turn_span(i) for i in range(len(messages)) if trained[i]]
    whole = case.render(messages, False)
    stable = all(whole.startswith(text) for text, _, _ in turns)
    stable = stable and all(turns[k][1] >= turns[k - 1][2] for k in range(1, len(turns)))
    as_bytes = lambda text, b, e: [byte_offset(text, b), byte_offset(text, e)]
    if stable:
        spans = [as_bytes(whole, b, e) for _, b, e in turns]
        return {"method": "prefixes", "sequences": [{"text": whole, "spans": spans}]}
    return {
        "method": "per turn",
        "sequences": [{"text": t, "spans": [as_bytes(t, b, e)]} for t, b, e in turns],
    }


def main():
    env = environment()
    results = []
    for raw in json.loads(sys.stdin.read()):
        try:
            case = Case(env, raw)
            if re.search(r"\{%[-+]?\s*generation\s*[-+]?%\}", raw["template"]):
                results.append(spans_by_generation(case))
            else:
                results.append(spans_by_prefixes(case))
        except Exception as e:  # noqa: BLE001 - every failure is a result to compare
            results.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
