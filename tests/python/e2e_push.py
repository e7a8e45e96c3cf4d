#!/usr/bin/env python3
"""End-to-end test of the push API: a trainer anywhere pushes, the fleet serves.

    tests/python/e2e_push.py BUILD/bin

Starts on loopback, with free ports and a temporary directory: `flywheel publish` (a push
token and a read token), one `flywheel relay` and one model-less `flywheel worker` behind
it. Runs examples/train_and_push.py against the publisher (FLYWHEEL_BIN = BUILD/bin/flywheel,
its own FLYWHEEL_CACHE_DIR), then checks that the worker's GET /v1/status reports the last
version with the ledger row's weights_hash, and that the second push onward were deltas.
Every process it started is stopped, on failure too. Bounded: 240 s in all.

Exit status: 0 passed, 1 failed (the message names the step), 77 skipped (no torch).
"""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

import flywheel  # noqa: E402

TOTAL_LIMIT_S = 240
STEPS = 3
PUSH_TOKEN = "e2e-push-token"
READ_TOKEN = "e2e-read-token"
SKIP = 77


class StepFailed(Exception):
    pass


class Fleet:
    """The processes this test started, stopped (whole process group) by :meth:`stop`."""

    def __init__(self, work_dir: str, deadline: float):
        self.work_dir = work_dir
        self.deadline = deadline
        self.processes = []  # (name, Popen, log path)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, name: str, command, ready_name: str) -> dict:
        """Starts ``command`` (logging to <work>/<name>.log) and returns its ready file."""
        ready_file = os.path.join(self.work_dir, ready_name)
        log_path = os.path.join(self.work_dir, f"{name}.log")
        command = list(command) + ["--ready-file", ready_file]
        print(f"e2e: starting {name}: {' '.join(command)}", flush=True)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append((name, process, log_path))
        limit = time.monotonic() + min(30.0, self.remaining())
        while time.monotonic() < limit:
            if os.path.exists(ready_file):
                with open(ready_file, encoding="utf-8") as ready:
                    return json.load(ready)
            if process.poll() is not None:
                raise StepFailed(f"{name} exited with {process.returncode} before it was "
                                 f"ready:\n{tail(log_path)}")
            time.sleep(0.05)
        raise StepFailed(f"{name} wrote no ready file {ready_file} within 30 s:\n{tail(log_path)}")

    def check_alive(self) -> None:
        for name, process, log_path in self.processes:
            if process.poll() is not None:
                raise StepFailed(f"{name} exited with {process.returncode}:\n{tail(log_path)}")

    def stop(self) -> None:
        for _, process, _ in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for name, process, _ in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"e2e: {name} ignored SIGTERM for 10 s: killing it", flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)

    def print_logs(self) -> None:
        for name, _, log_path in self.processes:
            print(f"---- {name} ({log_path}) ----\n{tail(log_path)}", file=sys.stderr)


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as log:
            return b"\n".join(log.read().splitlines()[-lines:]).decode("utf-8", "replace")
    except OSError as error:
        return f"(no log: {error})"


@contextlib.contextmanager
def step(name: str):
    print(f"e2e: {name}", flush=True)
    try:
        yield
    except StepFailed as error:
        raise StepFailed(f"step '{name}' failed: {error}") from None
    except (flywheel.FlywheelError, OSError, KeyError, ValueError, TypeError) as error:
        raise StepFailed(f"step '{name}' failed: {type(error).__name__}: {error}") from None


def run(bin_dir: str, work_dir: str, fleet: Fleet) -> None:
    binary = os.path.join(bin_dir, "flywheel")
    with step("check the build"):
        if not os.access(binary, os.X_OK):
            raise StepFailed(f"{binary} is not an executable")
    push_token_file = os.path.join(work_dir, "push.token")
    read_token_file = os.path.join(work_dir, "read.token")
    for path, token in ((push_token_file, PUSH_TOKEN), (read_token_file, READ_TOKEN)):
        with open(path, "w", encoding="utf-8") as out:
            out.write(token + "\n")
        os.chmod(path, 0o600)  # flywheel refuses a token file others can read
    os.makedirs(os.path.join(work_dir, "watch"))

    with step("start the publisher"):
        publisher = fleet.start("publisher", [
            binary, "publish", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
            "--state-dir", os.path.join(work_dir, "publisher-state"),
            "--watch", os.path.join(work_dir, "watch"),
            "--token-file", read_token_file, "--push-token-file", push_token_file,
        ], "publisher.ready")
    with step("start the relay"):
        relay = fleet.start("relay", [
            binary, "relay", "--region", "home", "--upstream", publisher["listen"],
            "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--token-file", read_token_file,
        ], "relay.ready")
    with step("start the worker"):
        worker = fleet.start("worker", [
            binary, "worker", "--region", "home", "--upstream", relay["listen"],
            "--http", "127.0.0.1:0", "--token-file", read_token_file,
        ], "worker.ready")

    publisher_url = f"http://{publisher['http']}"
    with step(f"run examples/train_and_push.py ({STEPS} steps) against {publisher_url}"):
        env = dict(os.environ, FLYWHEEL_BIN=binary,
                   FLYWHEEL_CACHE_DIR=os.path.join(work_dir, "push-cache"),
                   PYTHONPATH=os.pathsep.join(
                       [os.path.join(REPO, "python")] +
                       ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        step_timeout = max(10.0, min(60.0, fleet.remaining() / (STEPS + 1)))
        try:
            result = subprocess.run(
                [sys.executable, os.path.join(REPO, "examples", "train_and_push.py"),
                 "--url", publisher_url, "--token-file", push_token_file,
                 "--steps", str(STEPS), "--wait", "1.0", "--timeout", str(step_timeout)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, timeout=max(1.0, fleet.remaining() - 20))
        except subprocess.TimeoutExpired as error:
            raise StepFailed(f"did not finish in {error.timeout:.0f} s:\n"
                             f"{(error.output or b'').decode('utf-8', 'replace')}") from None
        output = result.stdout.decode("utf-8", "replace")
        print(output, end="", flush=True)
        if result.returncode != 0:
            raise StepFailed(f"exited with {result.returncode}")
        for number in range(1, STEPS + 1):
            if f"step {number}: version " not in output:
                raise StepFailed(f"no line for step {number} in its output")
        fleet.check_alive()

    reader = flywheel.Client(publisher_url, READ_TOKEN, timeout=10)
    with step("read the ledger"):
        rows = [row for row in reader.versions()["versions"] if row.get("source") == "push"]
        if len(rows) != STEPS:
            raise StepFailed(f"{len(rows)} pushed versions in the ledger, expected {STEPS}: "
                             f"{[row.get('version') for row in rows]}")
        last = rows[-1]
        for row in rows:
            print(f"e2e:   v{row['version']} {row.get('upload_kind')} "
                  f"{row.get('uploaded_bytes')} bytes uploaded, metadata {row.get('metadata')}")

    with step(f"check the worker serves v{last['version']} with the ledger's weights_hash"):
        worker_client = flywheel.Client(f"http://{worker['http']}", READ_TOKEN, timeout=10)
        status = worker_client.status()
        limit = time.monotonic() + min(20.0, max(1.0, fleet.remaining()))
        # wait_serving already saw the worker's report; its own status may lag a moment.
        while status.get("version") != last["version"] and time.monotonic() < limit:
            time.sleep(0.2)
            status = worker_client.status()
        if status.get("version") != last["version"]:
            raise StepFailed(f"worker status says version {status.get('version')}")
        if status.get("weights_hash") != last["weights_hash"]:
            raise StepFailed(f"worker weights_hash {status.get('weights_hash')} != ledger "
                             f"{last['weights_hash']}")

    with step("check the second push onward were deltas"):
        kinds = [row.get("upload_kind") for row in rows]
        if kinds[0] != "full" or any(kind != "delta" for kind in kinds[1:]):
            raise StepFailed(f"upload kinds {kinds}, expected full then deltas")
        full_bytes = rows[0]["uploaded_bytes"]
        for row in rows[1:]:
            if not row["uploaded_bytes"] < full_bytes:
                raise StepFailed(f"v{row['version']}'s delta is {row['uploaded_bytes']} bytes, "
                                 f"not below the full checkpoint's {full_bytes}")


def main() -> int:
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} BUILD/bin", file=sys.stderr)
        return 2
    if importlib.util.find_spec("torch") is None:  # the example trains with it
        print(f"SKIP: torch is not importable by {sys.executable}", flush=True)
        return SKIP
    work_dir = tempfile.mkdtemp(prefix="flywheel-e2e-push-")
    fleet = Fleet(work_dir, time.monotonic() + TOTAL_LIMIT_S)
    passed = False
    try:
        run(os.path.abspath(sys.argv[1]), work_dir, fleet)
        passed = True
    except StepFailed as error:
        print(f"e2e FAILED: {error}", file=sys.stderr, flush=True)
    finally:
        fleet.stop()
        if not passed:
            fleet.print_logs()
            print(f"e2e: logs and state kept in {work_dir}", file=sys.stderr)
    if passed:
        shutil.rmtree(work_dir, ignore_errors=True)
        print("e2e: passed")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
