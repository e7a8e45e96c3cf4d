"""Shared by the layering scripts (check_layers.py, durable_writes.py, function_length.py):
blanking C++ comments and literals, and the command-line frame of a tree check."""

import argparse
import os
import re


def _blank(text):
    return "".join(ch if ch == "\n" else " " for ch in text)


def strip(text, keep_literal=None):
    """Blanks out comments and string/char literals, keeping line structure (a literal that
    does not close on its line ends there). A quoted literal for which keep_literal(literal)
    is true stays as it is."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(_blank(text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(_blank(text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            closed = j < n and text[j] == c
            literal = text[i:j + 1] if closed else text[i:min(j, n)]
            if keep_literal is not None and closed and keep_literal(literal):
                out.append(literal)
            else:
                out.append(c + " " * (len(literal) - 2) + c if closed else c + " " * (len(literal) - 1))
            i = i + len(literal)
        else:
            out.append(c)
            i += 1
    return "".join(out)


def main(doc, check, self_test, failure, success):
    """The command line of a tree check: [--root DIR] or --self-test. `check(root)` returns
    the problems, one string each; `failure(count)` is the closing line when there are some,
    `success` the line when there are none. Returns the exit status."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    problems = check(os.path.abspath(args.root))
    for p in problems:
        print(p)
    if problems:
        print(failure(len(problems)))
        return 1
    print(success)
    return 0
