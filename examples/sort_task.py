"""The demo's sort task and the connection to a flywheel service, shared by
examples/rl_sort.py and examples/custom_loss.py (both written against the public API of the
`flywheel` package only).

The task is pipeline/task.h's "sort": the prompt is `digits` random digits and ">", the
answer the digits sorted ascending ("3142>" -> "1234"). Tokens are the CharTokenizer's over
the alphabet "0123456789+=>" (id = index), BOS = 13, EOS = 14; a prompt is BOS + its
characters, a completion the answer's characters then EOS. The problem space is split by
an FNV-1a hash of the prompt into a training part and a held-out part (about 1 in 8), exactly
as Task::IsHeldOut does, so these examples never train on a prompt the C++ demo holds out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from typing import Dict, List, Optional, Sequence, Tuple

try:
    import flywheel
except ImportError:  # run from a checkout without installing: use ../python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import flywheel

ALPHABET = "0123456789+=>"
BOS = len(ALPHABET)
EOS = len(ALPHABET) + 1
VOCAB_SIZE = len(ALPHABET) + 2
EVAL_SEED = 4242  # the demo's held-out draw (rl/rl_loop.cc)


def encode(text: str) -> List[int]:
    """The CharTokenizer's ids of `text` (every character must be in the alphabet)."""
    return [ALPHABET.index(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    """The text of `ids`; BOS and EOS decode to nothing (as CharTokenizer::Decode)."""
    return "".join(ALPHABET[i] for i in ids if 0 <= i < len(ALPHABET))


def is_held_out(prompt: str) -> bool:
    """Task::IsHeldOut: FNV-1a (64-bit) of the prompt's bytes; held out when
    (hash >> 32) % 8 == 0."""
    value = 1469598103934665603
    for byte in prompt.encode():
        value = ((value ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return (value >> 32) % 8 == 0


class SortTask:
    def __init__(self, digits: int = 6):
        if not 1 <= digits <= 16:
            raise ValueError(f"digits = {digits} is out of range for task 'sort' (1..16)")
        self.digits = digits
        self.max_tokens = digits + 1  # the answer, then EOS

    def random(self, rng: random.Random) -> Tuple[str, str]:
        digits = "".join(rng.choice("0123456789") for _ in range(self.digits))
        return digits + ">", "".join(sorted(digits))

    def sample(self, rng: random.Random, held_out: bool = False) -> Tuple[str, str]:
        """A random (prompt, answer) from the training part, or from the held-out part."""
        while True:
            prompt, answer = self.random(rng)
            if is_held_out(prompt) == held_out:
                return prompt, answer

    def held_out(self, count: int, seed: int = EVAL_SEED) -> List[Tuple[str, str]]:
        """`count` distinct held-out problems (fewer when the part is smaller)."""
        rng = random.Random(seed)
        seen, problems = set(), []
        for _ in range(count * 50):
            if len(problems) == count:
                break
            prompt, answer = self.sample(rng, held_out=True)
            if prompt not in seen:
                seen.add(prompt)
                problems.append((prompt, answer))
        return problems


def prompt_ids(prompt: str) -> List[int]:
    return [BOS] + encode(prompt)


def reward(completion_ids: Sequence[int], answer: str) -> float:
    """1 for an exact match of the completion (EOS removed) with the answer, else 0."""
    ids = list(completion_ids)
    if ids and ids[-1] == EOS:
        ids.pop()
    return 1.0 if decode(ids) == answer else 0.0


def sft_datum(prompt: str, answer: str) -> "flywheel.Datum":
    """A supervised example as the demo's SFT warm-up renders it: BOS + prompt, then the
    answer and EOS, weighted on the answer and EOS only."""
    return flywheel.Datum.from_prompt_completion(prompt_ids(prompt), encode(answer) + [EOS])


def accuracy(sampler: "flywheel.SamplingClient", task: SortTask,
             problems: Sequence[Tuple[str, str]], min_version: Optional[int] = None) -> float:
    """Greedy (temperature 0) exact-match accuracy of the served policy on `problems`."""
    futures: List[Future] = [
        sampler.sample_async(prompt_ids(prompt), n=1, max_tokens=task.max_tokens,
                             temperature=0.0, logprobs=False, min_version=min_version)
        for prompt, _ in problems]
    correct = sum(reward(f.result()[0].tokens, answer) for f, (_, answer) in zip(futures, problems))
    return correct / len(problems) if problems else 0.0


# ---------------------------------------------------------------------------------------
# The service: given by URLs, by a service.json, or launched here


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service")
    group.add_argument("--trainer", help="the training service's URL (flywheel serve-trainer)")
    group.add_argument("--workers", help="rollout workers' URLs, comma-separated")
    group.add_argument("--token-file", help="file holding the bearer token (train + read)")
    group.add_argument("--service", metavar="DIR",
                       help="read DIR/service.json (as `flywheel service` writes it)")
    group.add_argument("--launch", action="store_true",
                       help="start `flywheel service --run-dir DIR` here and stop it at the end")
    group.add_argument("--run-dir", help="--launch: the service's run directory (default: new)")
    group.add_argument("--flywheel", help="--launch: the flywheel binary "
                       "(default: $FLYWHEEL_BIN, else PATH, else this checkout's build/bin/flywheel)")
    group.add_argument("--service-arg", action="append", default=[], metavar="ARG",
                       help="--launch: one more argument for `flywheel service` (repeatable)")


class Service:
    """The trainer URL, worker URLs and token of a running service; with --launch, the
    `flywheel service` child process too (stopped by close())."""

    def __init__(self, trainer: str, workers: List[str], token: Optional[str],
                 process: Optional[subprocess.Popen] = None, run_dir: Optional[str] = None):
        self.trainer, self.workers, self.token = trainer, workers, token
        self.process, self.run_dir = process, run_dir

    @classmethod
    def from_arguments(cls, args: argparse.Namespace, say=print) -> "Service":
        if args.launch:
            return cls.launch(args, say)
        if args.service:
            return cls.from_file(os.path.join(args.service, "service.json"))
        if not args.trainer or not args.workers:
            raise SystemExit("give --trainer URL --workers URL,URL [--token-file F], "
                             "--service DIR, or --launch")
        return cls(args.trainer, [u for u in args.workers.split(",") if u],
                   _read_token(args.token_file))

    @classmethod
    def from_file(cls, path: str) -> "Service":
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
        token_file = document.get("token_file")
        if token_file and not os.path.isabs(token_file):
            token_file = os.path.join(os.path.dirname(path), token_file)
        workers = document.get("workers") or []
        if not document.get("trainer") or not workers:
            raise SystemExit(f"{path}: needs 'trainer' and 'workers'")
        return cls(document["trainer"], list(workers), _read_token(token_file))

    @classmethod
    def launch(cls, args: argparse.Namespace, say=print, timeout: float = 300.0) -> "Service":
        binary = args.flywheel or os.environ.get("FLYWHEEL_BIN") or shutil.which("flywheel")
        if not binary:
            # Run from a checkout: the binary `tools/dev build` makes.
            built = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                 os.environ.get("FLYWHEEL_BUILD_DIR", "build"), "bin", "flywheel")
            binary = os.path.normpath(built) if os.access(built, os.X_OK) else None
        if not binary or not os.path.exists(binary):
            raise SystemExit("--launch needs the flywheel binary: --flywheel PATH, "
                             "$FLYWHEEL_BIN, flywheel on PATH, or build/bin/flywheel in this "
                             "checkout (run `tools/dev build` first)")
        run_dir = args.run_dir or tempfile.mkdtemp(prefix="flywheel-service-")
        os.makedirs(run_dir, exist_ok=True)
        log_path = os.path.join(run_dir, "service.log")
        command = [binary, "service", "--run-dir", run_dir] + list(args.service_arg)
        say(f"launching: {' '.join(command)}  (log: {log_path})")
        log = open(log_path, "ab")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        log.close()
        service_file = os.path.join(run_dir, "service.json")
        deadline = time.monotonic() + timeout
        while not os.path.exists(service_file):
            if process.poll() is not None:
                raise SystemExit(f"flywheel service exited with {process.returncode} before "
                                 f"writing {service_file}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                _stop(process)
                raise SystemExit(f"no {service_file} after {timeout:g} s:\n{_tail(log_path)}")
            time.sleep(0.1)
        time.sleep(0.05)  # written by rename, but be gentle with a slow filesystem
        service = cls.from_file(service_file)
        service.process, service.run_dir = process, run_dir
        with open(service_file, encoding="utf-8") as file:
            document = json.load(file)
        if document.get("dashboard"):
            token = _read_token(document.get("dashboard_token_file"))
            say(f"dashboard: {document['dashboard']}" + (f"#token={token}" if token else ""))
        return service

    def close(self) -> None:
        if self.process is not None:
            _stop(self.process)
            self.process = None

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _read_token(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    with open(path, encoding="utf-8") as file:
        return file.read().strip() or None


def _stop(process: subprocess.Popen) -> None:
    """SIGINT (as Ctrl-C: the service stops its roles), then SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return "".join(file.readlines()[-lines:])
    except OSError:
        return "(no log)"


def check_model(info: Dict) -> None:
    """Refuses a service whose model does not use the sort task's vocabulary."""
    model = info.get("model") or {}
    vocab = model.get("vocab_size")
    if vocab is not None and vocab != VOCAB_SIZE:
        raise SystemExit(f"the service's model has vocab_size {vocab}; the sort task's "
                         f"CharTokenizer needs {VOCAB_SIZE} (alphabet {ALPHABET!r} + BOS + EOS)")
