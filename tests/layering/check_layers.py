#!/usr/bin/env python3
"""The layering check: no #include may point up a layer, and no folder below model/ may
include libtorch.

The layers are the module table of docs/ARCHITECTURE.md (and shared/DESIGN.md). A folder
may include its own headers and those of the folders it may depend on, directly or through
them; anything else is an arrow pointing up (or sideways, e.g. trainer/ <-> rollout/) and
fails the check with the file, the line and the arrow.

  check_layers.py [--root DIR]   check the tree (default: this repository)
  check_layers.py --self-test    check that the checker catches what it must
"""

import os
import re
import sys
import tempfile

import cscan

# folder -> the folders it may include directly (transitive closure taken below).
MAY_DEPEND_ON = {
    "base": [],
    "kernels": ["base"],
    "checkpoint": ["base"],
    "delta": ["base", "kernels", "checkpoint"],
    "transport": ["base"],
    "ops": ["base"],
    "tokenizer": ["base"],
    "sync": ["delta", "transport", "ops"],
    # push/: the push product (API, uploads, client), an extension of sync/'s publisher.
    "push": ["sync"],
    "model": ["delta", "tokenizer"],
    # data/: datasets (JSONL: SFT, DPO, RL) and chat-template rendering with loss masks.
    "data": ["tokenizer"],
    # grading/: built-in and external graders, the environment protocol.
    "grading": ["transport", "ops"],
    "pipeline": ["transport", "ops", "data", "grading"],
    "trainer": ["model", "sync"],
    "rollout": ["model", "sync", "transport", "tokenizer", "pipeline"],
    "rl": ["trainer", "rollout", "pipeline", "push"],
    "service": ["rl", "trainer", "rollout", "pipeline"],
    # testing/ (fault proxy): for tests and benchmarks only; no production folder includes it.
    "testing": ["transport"],
    "bench": ["service", "rl", "trainer", "rollout", "pipeline", "push", "sync", "model", "ops",
              "testing"],
    "tools": ["bench", "service", "rl", "trainer", "rollout", "pipeline", "push", "sync", "model",
              "ops"],
}
# Headers a folder may not include although its layer could: the trainer keeps sync/ for
# the version vocabulary (sync/version_log.h) but knows no publisher; the RL run and the
# training service wire a publisher into it (TrainingClient::AttachPublisher).
FORBIDDEN_HEADERS = {
    "trainer": {"sync/publisher.h"},
}
# Folders that may include anything (they sit above every layer).
TOP = {"tests", "examples"}
# Folders whose code must stay torch-free: relays, publishers and the coordinator must not
# load libtorch.
TORCH_FREE = {"base", "kernels", "checkpoint", "delta", "transport", "ops", "tokenizer", "sync",
              "push", "pipeline", "testing", "data", "grading"}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")


def closure(table):
    result = {}
    for folder in table:
        seen, todo = set(), list(table[folder])
        while todo:
            dep = todo.pop()
            if dep in seen:
                continue
            seen.add(dep)
            todo.extend(table.get(dep, []))
        result[folder] = seen | {folder}
    return result


def check(root):
    """Returns a list of violations, one string each."""
    allowed = closure(MAY_DEPEND_ON)
    known = set(MAY_DEPEND_ON) | TOP
    problems = []
    for folder in sorted(os.listdir(root)):
        if folder not in MAY_DEPEND_ON:
            continue
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in sorted(files):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        bracket, target = m.groups()
                        if bracket == "<":
                            if target.startswith(("torch/", "ATen/", "c10/")) and folder in TORCH_FREE:
                                problems.append(f"{rel}:{number}: {folder}/ must stay torch-free "
                                                f"but includes <{target}>")
                            continue
                        if target in FORBIDDEN_HEADERS.get(folder, ()):
                            problems.append(f"{rel}:{number}: {folder}/ must not include "
                                            f"\"{target}\" (FORBIDDEN_HEADERS)")
                            continue
                        top = target.split("/", 1)[0]
                        if "/" not in target or top not in known:
                            continue  # a generated or same-folder header
                        if top not in allowed[folder]:
                            problems.append(f"{rel}:{number}: {folder}/ -> {top}/ points up a "
                                            f"layer (\"{target}\"); {folder}/ may use: "
                                            f"{', '.join(sorted(allowed[folder] - {folder})) or 'nothing'}")
    return problems


def self_test():
    """The checker must flag an upward include, a sideways one, a forbidden header and torch
    below model/."""
    cases = {
        "delta/bad.cc": '#include "sync/node.h"\n',         # up
        "trainer/bad.cc": '#include "rollout/engine.h"\n',  # sideways
        "trainer/publishes.cc": '#include "sync/publisher.h"\n',  # a forbidden header
        "sync/bad.h": "#include <torch/torch.h>\n",         # torch below model/
        "rollout/good.cc": '#include "model/model.h"\n#include "delta/delta.h"\n',
        "tests/any.cc": '#include "rl/rl_loop.h"\n',
    }
    with tempfile.TemporaryDirectory() as root:
        for rel, text in cases.items():
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as f:
                f.write(text)
        problems = check(root)
    flagged = {p.split(":", 1)[0] for p in problems}
    expected = {"delta/bad.cc", "trainer/bad.cc", "trainer/publishes.cc", "sync/bad.h"}
    if flagged != expected:
        print(f"self-test FAILED: flagged {sorted(flagged)}, expected {sorted(expected)}")
        return 1
    print(f"self-test: the {len(expected)} bad includes were flagged, the good ones were not")
    return 0


def main():
    return cscan.main(__doc__, check, self_test,
                      lambda count: f"{count} include(s) point up a layer",
                      "layering: no include points up a layer")


if __name__ == "__main__":
    sys.exit(main())
