#!/usr/bin/env python3
"""Makes skipped tests visible, and under CI a failure unless their reason is allowed.

Reads the JUnit file of a ctest run (`ctest --output-junit FILE`; tools/dev test writes
build/Testing/junit.xml), finds every skip in it and prints each with its reason:

  - a GoogleTest GTEST_SKIP: the "<file>:<line>: Skipped" message before "[  SKIPPED ] Name (N ms)"
    (ctest counts these as Skipped through gtest_discover_tests' skip expression);
  - a pytest skip inside a ctest test that passed: the "pytest: SKIPPED <nodeid>: <reason>"
    lines tests/python/conftest.py prints for every skip;
  - a whole ctest test skipped (SKIP_RETURN_CODE 77 or a skip expression): its
    "SKIP: ..." / "skipped: ..." line, else what ctest says;
  - a disabled test (a DISABLED_ GoogleTest case: a manual measurement).

A skip is allowed when its reason matches one of the patterns listed in tests/ALLOWED_SKIPS.md
(the bullets that start with a backquoted Python regular expression). With CI=true (or 1,
yes) in the environment the script exits 1 when any skip is not allowed, and 2 when the JUnit
file is missing or unreadable; otherwise it only reports (exit 0).

  check_skips.py [--allowed FILE] JUNIT.xml
  check_skips.py --self-test
"""

import argparse
import os
import re
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ALLOWED = os.path.join(HERE, "ALLOWED_SKIPS.md")

PATTERN_BULLET = re.compile(r"^\s*[-*]\s+`([^`]+)`")
GTEST_SKIP_MARK = re.compile(r":\s*Skipped\s*$")
GTEST_SKIPPED_CASE = re.compile(r"^\[  SKIPPED \] (\S+) \(\d+ ms\)\s*$")
PYTEST_SKIP = re.compile(r"^pytest: SKIPPED (\S+): (.*)$")
WHOLE_SKIP = re.compile(r"^(?:SKIP|skipped)\s*:\s*(.+)$", re.IGNORECASE)


def allowed_patterns(path):
    """The backquoted regular expressions that start the bullets of `path`."""
    with open(path, encoding="utf-8") as f:
        return [re.compile(m.group(1)) for m in map(PATTERN_BULLET.match, f) if m]


def gtest_skips(output):
    """(case, reason) for every GTEST_SKIP in a GoogleTest run's output."""
    found, reason_lines, collecting = [], [], False
    for line in output.splitlines():
        case = GTEST_SKIPPED_CASE.match(line)
        if case:
            found.append((case.group(1), " ".join(reason_lines).strip()))
            reason_lines, collecting = [], False
        elif GTEST_SKIP_MARK.search(line):
            reason_lines, collecting = [], True
        elif line.startswith("[ RUN      ]"):
            reason_lines, collecting = [], False
        elif collecting:
            reason_lines.append(line.strip())
    return found


def skips(junit_text):
    """(ctest test, where, reason) for every skip in a ctest JUnit document."""
    root = ET.fromstring(junit_text)
    found = []
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        status = case.get("status", "")
        out = case.findtext("system-out") or ""
        if status == "disabled":
            found.append((name, name, "disabled"))
            continue
        inner = [(name if name.startswith(where) else f"{name} / {where}", reason)
                 for where, reason in gtest_skips(out)]
        inner += [(f"{name} / {m.group(1)}", m.group(2).strip())
                  for m in map(PYTEST_SKIP.match, out.splitlines()) if m]
        skipped = case.find("skipped")
        if skipped is not None and not inner:
            whole = [m.group(1).strip() for m in map(WHOLE_SKIP.match, out.splitlines()) if m]
            inner = [(name, whole[-1] if whole else
                      f"(no reason given; ctest: {skipped.get('message', 'skipped')})")]
        found += [(name, where, reason or "(no reason given)") for where, reason in inner]
    return found


def check(junit_text, patterns, ci, out=sys.stdout):
    """Prints every skip; returns the exit code (1: a skip not allowed, under CI)."""
    found = skips(junit_text)
    refused = 0
    for _, where, reason in found:
        ok = any(p.search(reason) for p in patterns)
        refused += not ok
        print(f"skipped{'' if ok else ' (NOT ALLOWED)'}: {where}: {reason}", file=out)
    print(f"{len(found)} skip(s), {refused} with a reason not in tests/ALLOWED_SKIPS.md"
          + (" (CI: failing the run)" if ci and refused else ""), file=out)
    return 1 if ci and refused else 0


def self_test():
    gtest_out = ("[ RUN      ] K.Cuda\n/x/k.cc:93: Skipped\nno CUDA device: none found\n"
                 "[  SKIPPED ] K.Cuda (0 ms)\n[  SKIPPED ] 1 test, listed below:\n"
                 "[  SKIPPED ] K.Cuda\n")
    promtool = ("[ RUN      ] F.Metrics\n/x/f.cc:9: Skipped\npromtool is not installed\n"
                "[  SKIPPED ] F.Metrics (1 ms)\n")
    junit = f"""<testsuite>
 <testcase name="K.Cuda" status="notrun"><skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>
  <system-out>{gtest_out}</system-out></testcase>
 <testcase name="F.Metrics" status="notrun"><skipped message="SKIP_REGULAR_EXPRESSION_MATCHED"/>
  <system-out>{promtool}</system-out></testcase>
 <testcase name="python.unit" status="run"><system-out>3 passed, 1 skipped
pytest: SKIPPED t.py::test_a: could not import 'numpy': No module named 'numpy'
</system-out></testcase>
 <testcase name="python.e2e" status="notrun"><skipped message="SKIP_RETURN_CODE=77"/>
  <system-out>SKIP: torch is not importable by /usr/bin/python3</system-out></testcase>
 <testcase name="Big.DISABLED_Measure" status="disabled"><system-out>Disabled</system-out></testcase>
 <testcase name="Ok.Case" status="run"><system-out>[  PASSED  ] 1 test.</system-out></testcase>
</testsuite>"""
    want = [("K.Cuda", "K.Cuda", "no CUDA device: none found"),
            ("F.Metrics", "F.Metrics", "promtool is not installed"),
            ("python.unit", "python.unit / t.py::test_a",
             "could not import 'numpy': No module named 'numpy'"),
            ("python.e2e", "python.e2e", "torch is not importable by /usr/bin/python3"),
            ("Big.DISABLED_Measure", "Big.DISABLED_Measure", "disabled")]
    got = skips(junit)
    problems = [] if got == want else [f"found {got}, want {want}"]
    patterns = allowed_patterns(DEFAULT_ALLOWED)
    with tempfile.TemporaryFile("w+") as sink:
        if check(junit, patterns, ci=True, out=sink) != 1:
            problems.append("under CI, skips outside the list did not fail the run")
        if check(junit, patterns, ci=False, out=sink) != 0:
            problems.append("outside CI, skips failed the run")
        allowed_only = junit.replace("promtool is not installed", "no CUDA device: x")
        allowed_only = re.sub(r'<testcase name="python\.(unit|e2e)".*?</testcase>', "",
                              allowed_only, flags=re.S)
        if check(allowed_only, patterns, ci=True, out=sink) != 0:
            problems.append("under CI, allowed skips failed the run")
    for problem in problems:
        print(f"self-test FAILED: {problem}")
    if not problems:
        print("self-test: skips found with their reasons; only listed reasons pass under CI")
    return 1 if problems else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", nargs="?")
    parser.add_argument("--allowed", default=DEFAULT_ALLOWED)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    ci = os.environ.get("CI", "").lower() in ("true", "1", "yes")
    try:
        with open(args.junit, encoding="utf-8", errors="replace") as f:
            text = f.read()
        ET.fromstring(text)
    except (OSError, TypeError, ET.ParseError) as error:
        print(f"check_skips: cannot read the ctest JUnit file {args.junit}: {error}")
        return 2 if ci else 0
    return check(text, allowed_patterns(args.allowed), ci)


if __name__ == "__main__":
    sys.exit(main())
