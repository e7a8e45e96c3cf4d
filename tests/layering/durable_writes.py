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

import os
import re
import sys
import tempfile

import cscan

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
    mode string of an fopen call ("w", "ab", "r+") stays visible: the fopen pattern needs it."""
    return cscan.strip(text, keep_literal=lambda literal: re.fullmatch(r'"[rwa]\+?b?\+?"', literal))


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
    return cscan.main(__doc__, check, self_test,
                      lambda count: f"{count} write(s) of state bypass the Env",
                      "durable writes: none bypasses the Env outside base/")


if __name__ == "__main__":
    sys.exit(main())
