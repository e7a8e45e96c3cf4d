#!/usr/bin/env python3
"""Durable writes go through Env: outside base/, no production code writes, renames or
removes files with the calls that bypass it.

base/env.h is flywheel's one seam to files. Its atomic write fsyncs the file and its
directory, its logs fsync every record before it is acknowledged, and a test can wrap it
to inject faults or cut the power at any step (tests/base/power_cut_env.h). Code that
writes with std::ofstream, or renames or unlinks with the C or std::filesystem calls,
does none of that, and no test can fault it. So those calls may appear only in base/ (the
Env's own implementation) and in code that is not production: tests/, bench/, examples/,
tools/dev/ (and build output).

Flagged, outside comments and string literals:
  std::ofstream / ofstream / std::fstream      write a file without fsync
  fs::rename, std::filesystem::rename          a rename nobody syncs
  ::rename(, std::rename(, rename(             (the C call, any spelling)
  ::unlink(, unlink(, unlinkat(                a removal nobody syncs
  fopen(..., "w"/"a"/"r+")                     C stdio writes

  durable_writes.py [--root DIR]   check the tree (default: this repository)
  durable_writes.py --self-test    plant each forbidden call and check that it is flagged
"""

import argparse
import os
import re
import sys
import tempfile

SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh", ".cpp", ".hpp")
# Not production code, or not ours.
EXCLUDED = {"tests", "bench", "examples", "docs", "python", "third_party", "flywheel-runs"}
EXCLUDED_PATHS = {os.path.join("tools", "dev")}
# The Env itself.
ALLOWED = {"base"}

FORBIDDEN = [
    (re.compile(r"\b(?:std::)?(?:basic_)?o?fstream\b"), "std::ofstream / fstream (no fsync, no Env)"),
    (re.compile(r"\b(?:fs|filesystem)::rename\s*\("), "std::filesystem::rename (a rename nobody syncs)"),
    (re.compile(r"(?:::|\bstd::|(?<![\w:.>]))rename(?:at2?)?\s*\("), "rename(2) (a rename nobody syncs)"),
    (re.compile(r"(?:::|(?<![\w:.>]))unlink(?:at)?\s*\("), "unlink(2) (a removal nobody syncs)"),
    (re.compile(r"\bfopen\s*\([^;]*\"[wa]|\bfopen\s*\([^;]*\"r\+"), "fopen for writing"),
]


def strip(text):
    """Blanks out comments and string literals (keeping line structure), except that the
    mode string of an fopen call stays visible."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif text[i] in "\"'":
            quote, j = text[i], i + 1
            while j < n and text[j] != quote and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            literal = text[i:j + 1]
            # Mode strings ("w", "ab", "r+") stay: the fopen pattern needs them.
            keep = quote == '"' and re.fullmatch(r'"[rwa]\+?b?\+?"', literal)
            out.append(literal if keep else quote + " " * max(0, j - i - 1) + quote)
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def production_files(root):
    for folder in sorted(os.listdir(root)):
        top = os.path.join(root, folder)
        if not os.path.isdir(top) or folder.startswith((".", "build")) or folder in EXCLUDED:
            continue
        for dirpath, dirnames, files in os.walk(top):
            rel_dir = os.path.relpath(dirpath, root)
            dirnames[:] = [d for d in dirnames if os.path.join(rel_dir, d) not in EXCLUDED_PATHS]
            for name in sorted(files):
                if name.endswith(SOURCE_SUFFIXES):
                    yield folder, os.path.join(dirpath, name)


def check(root):
    """Returns a list of violations, one string each."""
    problems = []
    for folder, path in production_files(root):
        if folder in ALLOWED:
            continue
        rel = os.path.relpath(path, root)
        with open(path, encoding="utf-8", errors="replace") as f:
            text = strip(f.read())
        for number, line in enumerate(text.split("\n"), 1):
            if re.match(r"\s*#\s*include\b", line):
                continue  # <fstream> is also for reading
            for pattern, what in FORBIDDEN:
                if pattern.search(line):
                    problems.append(f"{rel}:{number}: {what}: write through base/env.h "
                                    f"(WriteFileAtomically, AtomicFile, NewAppendableFile + "
                                    f"Sync, RenameFile + SyncDir, RemoveFileDurably)")
                    break  # one report per line
    return problems


def self_test():
    """Each forbidden call, planted in a production folder, is flagged; the same text in
    base/, tests/, bench/, tools/dev/, a comment or a string is not; Env calls are not."""
    bad = {
        "sync/a.cc": "#include <fstream>\nvoid F() { std::ofstream out(path); }\n",
        "trainer/b.cc": "void F() { fs::rename(a, b, ec); }\n",
        "rl/c.cc": "void F() { std::filesystem::rename(a, b); }\n",
        "sync/d.cc": "void F() { ::unlink(path.c_str()); }\n",
        "transport/e.cc": "void F() { if (::rename(a, b) != 0) {} }\n",
        "pipeline/f.cc": "void F() { std::rename(a, b); }\n",
        "tools/g.cc": 'void F() { FILE* f = std::fopen(path, "wb"); }\n',
        "service/h.cc": "void F() { unlink(path); }\n",
    }
    good = {
        "base/env.cc": "void F() { ::rename(a, b); ::unlink(p); std::ofstream o; }\n",
        "tests/t.cc": "void F() { std::ofstream(p) << 1; fs::rename(a, b); }\n",
        "bench/b.cc": "void F() { std::ofstream(p) << 1; }\n",
        "tools/dev/x.cc": "void F() { ::unlink(p); }\n",
        "sync/ok.cc": ('// std::ofstream and ::unlink( are fine in a comment\n'
                       'const char* k = "fs::rename(a, b) in a string";\n'
                       'Status F() { return env->RenameFile(a, b); }\n'
                       'void G() { std::ifstream in(p); FILE* f = std::fopen(p, "rb"); }\n'
                       'void H() { Status s = env->RemoveFile(p); s = RemoveFileDurably(p); }\n'),
    }
    with tempfile.TemporaryDirectory() as root:
        for rel, text in {**bad, **good}.items():
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as f:
                f.write(text)
        problems = check(root)
    flagged = {p.split(":", 1)[0] for p in problems}
    if flagged != set(bad):
        print(f"self-test FAILED: flagged {sorted(flagged)}, expected {sorted(bad)}")
        for p in problems:
            print("  " + p)
        return 1
    print(f"self-test: the {len(bad)} planted writes that bypass Env were flagged; "
          f"base/, tests/, bench/, tools/dev/, comments, strings and Env calls were not")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__,
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
        print(f"{len(problems)} write(s) of state bypass the Env")
        return 1
    print("durable writes: none bypasses the Env outside base/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
