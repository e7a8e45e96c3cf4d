#!/usr/bin/env python3
"""The memory plan (model/memory_plan.h) against the processes' measured peak RSS.

Runs `flywheel demo` (2 regions x 1 worker, relays, the trainer) on a model config, samples
every relay's and worker's VmHWM from /proc while it runs, reads the trainer's own peak
(report/memory.json, getrusage at the end) and the plan the trainer made at start (the same
file), and prints plan vs measured per process with the ratio. Checks: the trainer, each
worker and the whole machine within 15%; the relays are reported (the plan counts their
cached keyframe uncompressed, an upper bound).

  bench/memory_plan_check.py FLYWHEEL_BIN [--params 100m|demo] [--steps N]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

CONFIG_100M = {"model_type": "qwen3", "vocab_size": 15, "hidden_size": 768, "intermediate_size": 2048,
               "num_hidden_layers": 16, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
               "max_position_embeddings": 512, "qk_norm": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "attention_bias": False}

RUN = """
[run]
max_steps = {steps}
target_accuracy = 1.0
time_limit_s = 600
eval_every = 100
eval_prompts = 16
[task]
name = "sort"
digits = 3
[algorithm]
group_size = 4
groups_per_step = 2
zero_variance_filter = false
[sft]
steps = 0
[fleet]
regions = ["us", "eu"]
workers_per_region = 1
worker_max_batch = 8
{model}
"""


def peaks():
    """VmHWM (bytes) of every running relay and worker, by its node id."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                args = f.read().split(b"\0")
            with open("/proc/%s/status" % pid) as f:
                status = f.read()
        except OSError:
            continue
        if len(args) < 2 or args[1] not in (b"relay", b"worker") or b"--node-id" not in args:
            continue
        node = args[args.index(b"--node-id") + 1].decode()
        match = re.search(r"VmHWM:\s+(\d+) kB", status)
        if match:
            found[node] = int(match.group(1)) * 1024
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("flywheel")
    parser.add_argument("--params", choices=["100m", "demo"], default="100m")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="fw-memory-plan-")
    model = ""
    if args.params == "100m":
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump(CONFIG_100M, f)
        model = '[model]\nconfig = "%s"' % os.path.join(work, "config.json")
    with open(os.path.join(work, "run.toml"), "w") as f:
        f.write(RUN.format(steps=args.steps, model=model))
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    demo = subprocess.Popen([args.flywheel, "demo", "--no-files", "--config", os.path.join(work, "run.toml"),
                             "--run-dir", os.path.join(work, "run")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    measured = {}
    while demo.poll() is None:
        for node, value in peaks().items():
            measured[node] = max(measured.get(node, 0), value)
        time.sleep(0.5)
    output = demo.stdout.read()
    if demo.returncode != 0:
        print(output)
        print("FAIL: the demo exited with %d" % demo.returncode)
        return 1
    with open(os.path.join(work, "run", "report", "memory.json")) as f:
        record = json.load(f)
    plan = record["plan"]
    rows = [("trainer", plan["trainer_bytes"], record["trainer_peak_rss_bytes"])]
    for node in sorted(measured):
        rows.append((node, plan["worker_bytes" if node.startswith("worker") else "relay_bytes"], measured[node]))
    rows.append(("whole machine", plan["total_bytes"], sum(m for _, _, m in rows)))
    mib = 1 << 20
    print("memory plan vs measured peak RSS (%s model, %d steps)" % (args.params, args.steps))
    print("| process | plan | measured | plan / measured |")
    print("|---|---|---|---|")
    failed = []
    for name, planned, got in rows:
        ratio = planned / got if got else float("inf")
        print("| %s | %.1f MiB | %.1f MiB | %.3f |" % (name, planned / mib, got / mib, ratio))
        if not name.startswith("relay") and abs(ratio - 1) > 0.15:
            failed.append(name)
    print("largest trainer terms: " + ", ".join(
        "%s %.0f MiB" % (t["name"], t["bytes"] / mib)
        for t in sorted((t for t in plan["terms"] if t["role"] == "trainer"), key=lambda t: -t["bytes"])[:3]))
    shutil.rmtree(work, ignore_errors=True)
    if failed:
        print("FAIL: outside 15%: " + ", ".join(failed))
        return 1
    print("PASS: the trainer, every worker and the machine within 15%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
