#!/usr/bin/env python3
"""Function length in production code: no function body in any folder the build compiles
(the root CMakeLists.txt's add_subdirectory folders, tests/ excepted) may be longer than
--max lines (default 80), so that the code reads as parts with names. The one exception is
a data table named in function_length_allowlist.txt beside this script, with its reason.

A function is found by its body: a `{` that closes a signature (`...)`, `...) const`,
`...) -> T`, `...) override`, a constructor's initialiser list) at any nesting level that is
not itself inside a function. Braces inside the signature (a default argument `= {}`, a
lambda default, a member initialiser `a_{x}`) belong to the signature. Lines are counted from the signature's first line to the
closing brace. Lambdas and local classes count towards the function that holds them.

  function_length.py [--root DIR] [--max N] [--report K] [--allowlist FILE] [FOLDER ...]
  function_length.py --self-test
"""

import argparse
import os
import re
import sys
import tempfile

import cscan

# Folders that hold no production code, though the build may enter them.
NOT_PRODUCTION = {"tests"}
ALLOWLIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "function_length_allowlist.txt")
SUFFIXES = (".cc", ".h")
NOT_A_FUNCTION = re.compile(r"^\s*(namespace|struct|class|union|enum|extern)\b|=\s*$|\[\]\s*$")


def strip(text):
    """Blanks out comments and string/char literals, keeping line structure."""
    return cscan.strip(text)


# A `{` that opens a brace initialiser in a constructor's member initialiser list:
# `Foo::Foo(int x) : a_{x}, b_{y} {` (a lone `:` after the parameter list, the brace right
# after a member's name).
MEMBER_INIT = re.compile(r"\)\s*(?:noexcept\s*)?:(?!:)")
ENDS_WITH_NAME = re.compile(r"[\w>]\s*$")


def functions(text):
    """Yields (name, first_line, line_count) for every function body in `text`.

    Outside functions, the declaration of a `{` is the text since the previous `;` or the
    previous scope's `{` / `}`. Braces that belong to a declaration rather than end one
    (a default argument `= {}` or a lambda inside the parentheses, a member initialiser's
    `a_{x}`) are skipped as a unit, so the body's own `{` still sees the whole signature.
    """
    code = strip(text)
    depth = 0
    inside = None  # (depth at which the function's body opened, name, first line)
    line = 1
    stack = []  # the kind of each open brace: "function" / "scope" / "init" / "inner"
    boundary = 0  # where the declaration being read starts (outside functions)
    parens = 0  # open parentheses since `boundary`
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif inside is not None:
            if c == "{":
                stack.append("inner")
                depth += 1
            elif c == "}":
                depth -= 1
                kind = stack.pop() if stack else "scope"
                if kind == "function" and inside[0] == depth:
                    yield inside[1], inside[2], line - inside[2] + 1
                    inside = None
                    boundary, parens = i + 1, 0
        elif c == "(":
            parens += 1
        elif c == ")":
            parens = max(0, parens - 1)
        elif c == ";" and parens == 0:
            boundary = i + 1
        elif c == "{":
            decl = code[boundary:i]
            if parens > 0 or (MEMBER_INIT.search(decl) and ENDS_WITH_NAME.search(decl)):
                stack.append("init")
            elif (")" in decl and "(" in decl and not NOT_A_FUNCTION.search(decl.strip())
                  and not re.search(r"\b(if|for|while|switch|catch)\s*\(",
                                    decl.split("(")[0] + "(")):
                name_match = re.search(r"([~\w:<>]+)\s*\(", decl)
                lead = len(decl) - len(decl.lstrip())
                first = line - decl[lead:].count("\n")
                inside = (depth, name_match.group(1) if name_match else "?", first)
                stack.append("function")
            else:
                stack.append("scope")
                boundary, parens = i + 1, 0
            depth += 1
        elif c == "}":
            depth -= 1
            kind = stack.pop() if stack else "scope"
            if kind != "init":
                boundary, parens = i + 1, 0
    return


def measure(root, folders):
    found = []
    for folder in folders:
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in sorted(files):
                if name.endswith(SUFFIXES):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8", errors="replace") as f:
                        text = f.read()
                    rel = os.path.relpath(path, root)
                    for fn, first, count in functions(text):
                        found.append((count, rel, first, fn))
    found.sort(reverse=True)
    return found


def self_test():
    sample = (
        "namespace a {\n"                   # 1
        "struct S { int f() const { return 1; } };\n"  # 2: f, 1 line
        "// int fake() {\n"                 # 3
        "Status Long(int x,\n"              # 4
        "            int y) {\n"            # 5
        "  if (x) {\n"                      # 6
        "    auto l = [&] { return \"}\"; };\n"  # 7
        "  }\n"                             # 8
        "  return Ok();\n"                  # 9
        "}\n"                               # 10: Long = lines 4..10 = 7
        "const int kTable[] = {1, 2};\n"    # 11: not a function
        "Status WithDefault(int x,\n"       # 12
        "                   Options o = {}) {\n"  # 13: `= {}` in the signature
        "  Use(o);\n"                       # 14
        "  return Ok();\n"                  # 15
        "}\n"                               # 16: WithDefault = 12..16 = 5
        "Foo::Foo(int x) : a_{x},\n"        # 17: member initialisers in braces
        "                  b_{Make(x)} {\n"  # 18
        "  Init();\n"                       # 19
        "}\n"                               # 20: Foo::Foo = 17..20 = 4
        "Bar::Bar() noexcept : a_{1} {\n"   # 21: nothing but `a_{1}` before the body
        "  Init();\n"                       # 22
        "}\n"                               # 23: Bar::Bar = 3
        "void Run(std::function<void()> f = [] {}) {\n"  # 24: a lambda default argument
        "  f();\n"                          # 25
        "}\n"                               # 26: Run = 3
        "struct Options { uint64_t n = (uint64_t{1} << 31); };\n"  # 27: not a function
        "}  // namespace a\n"
    )
    got = sorted((name, first, count) for name, first, count in functions(sample))
    want = sorted([("f", 2, 1), ("Long", 4, 7), ("WithDefault", 12, 5), ("Foo::Foo", 17, 4),
                   ("Bar::Bar", 21, 3), ("Run", 24, 3)])
    if got != want:
        print(f"self-test FAILED: {got} != {want}")
        return 1
    print("self-test: function bodies measured as expected")
    return 0


def production_folders(root):
    """Every folder the root CMakeLists.txt adds (add_subdirectory), tests/ excepted: a new
    module is measured from the day it joins the build, without a list to keep by hand."""
    with open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8") as f:
        text = f.read()
    folders = re.findall(r"^\s*add_subdirectory\(\s*([\w/.-]+)", text, re.MULTILINE)
    return [folder for folder in dict.fromkeys(folders) if folder not in NOT_PRODUCTION]


def read_allowlist(path):
    """{(path, function): reason} from an allowlist file; a line without a reason is an error."""
    allowed = {}
    if not os.path.exists(path):
        return allowed
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            entry, _, reason = line.partition("#")
            entry, reason = entry.strip(), reason.strip()
            if not entry:
                continue
            where, sep, function = entry.rpartition(":")
            if not sep or not where or not function or not reason:
                raise ValueError(f"{path}:{number}: want 'path:function  # reason', got {line.strip()!r}")
            allowed[(where, function)] = reason
    return allowed


def check(found, limit, allowed):
    """The functions over `limit` not allowed, and the allowlist entries that match no
    function over the limit (stale: the table was split or shrank)."""
    over = [f for f in found if f[0] > limit and (f[1], f[3]) not in allowed]
    matched = {(f[1], f[3]) for f in found if f[0] > limit}
    stale = sorted(key for key in allowed if key not in matched)
    return over, stale


def allowlist_self_test():
    """The allowlist lets through exactly the functions it names, and fails on stale entries."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "allow.txt")
        with open(path, "w") as f:
            f.write("# comment\n\nkernels/table.cc:kTable  # a 300-entry lookup table\n"
                    "gone.cc:Old  # split since\n")
        allowed = read_allowlist(path)
        found = [(120, "kernels/table.cc", 1, "kTable"), (90, "sync/x.cc", 5, "Long"),
                 (10, "gone.cc", 1, "Old")]
        over, stale = check(found, 80, allowed)
        if [f[3] for f in over] != ["Long"] or stale != [("gone.cc", "Old")]:
            print(f"allowlist self-test FAILED: over {over}, stale {stale}")
            return 1
        with open(path, "w") as f:
            f.write("kernels/table.cc:kTable\n")  # no reason
        try:
            read_allowlist(path)
            print("allowlist self-test FAILED: an entry without a reason was accepted")
            return 1
        except ValueError:
            pass
        with open(os.path.join(tmp, "CMakeLists.txt"), "w") as f:
            f.write("add_subdirectory(base)\nadd_subdirectory(sync)\nif(X)\n  add_subdirectory(tests)\nendif()\n")
        if production_folders(tmp) != ["base", "sync"]:
            print(f"allowlist self-test FAILED: production folders {production_folders(tmp)}")
            return 1
    print("self-test: allowlist and production folders as expected")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    parser.add_argument("--max", type=int, default=80)
    parser.add_argument("--report", type=int, default=5, help="print the K longest")
    parser.add_argument("--allowlist", default=ALLOWLIST)
    parser.add_argument("--self-test", action="store_true")
    parser.add_argument("folders", nargs="*", help="default: every production folder")
    args = parser.parse_args()
    if args.self_test:
        return self_test() or allowlist_self_test()
    root = os.path.abspath(args.root)
    folders = args.folders or production_folders(root)
    missing = [folder for folder in folders if not os.path.isdir(os.path.join(root, folder))]
    if missing:
        print(f"no such folder under {root}: {', '.join(missing)}")
        return 1
    allowed = read_allowlist(args.allowlist)
    found = measure(root, folders)
    for count, rel, first, fn in found[:args.report]:
        note = "  (allowlisted: " + allowed[(rel, fn)] + ")" if (rel, fn) in allowed else ""
        print(f"{count:5d} lines  {rel}:{first}  {fn}{note}")
    over, stale = check(found, args.max, allowed)
    for count, rel, first, fn in over[args.report:]:
        print(f"{count:5d} lines  {rel}:{first}  {fn}")
    for rel, fn in stale:
        print(f"stale allowlist entry {rel}:{fn}: not over {args.max} lines (delete it)")
    if over or stale:
        if over:
            print(f"{len(over)} function(s) in {', '.join(folders)} are longer than {args.max} lines")
        return 1
    print(f"longest function in {', '.join(folders)}: {found[0][0] if found else 0} lines "
          f"(limit {args.max}, {len(allowed)} allowlisted)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
