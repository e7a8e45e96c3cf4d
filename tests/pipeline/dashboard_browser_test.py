#!/usr/bin/env python3
"""The dashboard in a real browser (issue 36): headless Chromium opens the URL that
`flywheel demo` prints, during a short run, and the test asserts through the DevTools
protocol what the page shows: points on every curve growing, every worker of the fleet
listed with the version it serves, rollouts present. After the run, `flywheel report serve`
serves the same page from the report directory. Then the training service: the SDK example
(examples/rl_sort.py --launch) runs its own loop against `flywheel service`, and the page
it prints shows the optimizer steps growing, the session with its calls, and the workers.
A screenshot of each is kept in the test
artifacts directory (FLYWHEEL_ARTIFACTS, default build/test-artifacts).

DevTools messages go over --remote-debugging-pipe (fds 3 and 4, NUL-terminated JSON), so
the test needs nothing beyond the standard library and Debian's chromium.

  dashboard_browser_test.py FLYWHEEL_BIN     exit 0: passed, 1: failed, 77: skipped
"""

import base64
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

SKIP = 77
CURVES_WITH_EVERY_STEP = ["reward", "loss", "k3", "clip", "staleness", "delta", "density", "rate", "counts"]


def fail(message):
    print("FAIL: " + message, flush=True)
    sys.exit(1)


class DevTools:
    """One headless Chromium, driven over its DevTools pipe."""

    def __init__(self, profile):
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        self.to_browser_r, self.to_browser_w = os.pipe()
        self.from_browser_r, self.from_browser_w = os.pipe()
        fds = (self.to_browser_r, self.from_browser_w)

        def wire():  # in the child: its fd 3 reads our commands, its fd 4 writes answers
            a, b = os.dup(fds[0]), os.dup(fds[1])
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.process = subprocess.Popen(
            [binary, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-dev-shm-usage", "--user-data-dir=" + profile, "--window-size=1400,1800",
             "about:blank"],
            preexec_fn=wire, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(self.to_browser_r)
        os.close(self.from_browser_w)
        self.next_id = 0
        self.answers = {}
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def _read(self):
        buffer = b""
        while True:
            try:
                data = os.read(self.from_browser_r, 1 << 16)
            except OSError:
                data = b""
            if not data:
                with self.cond:
                    self.answers["closed"] = True
                    self.cond.notify_all()
                return
            buffer += data
            while b"\0" in buffer:
                message, buffer = buffer.split(b"\0", 1)
                doc = json.loads(message)
                if "id" in doc:
                    with self.cond:
                        self.answers[doc["id"]] = doc
                        self.cond.notify_all()

    def call(self, method, params=None, session=None, timeout=30):
        self.next_id += 1
        ident = self.next_id
        message = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser_w, json.dumps(message).encode() + b"\0")
        deadline = time.time() + timeout
        with self.cond:
            while ident not in self.answers:
                if self.answers.get("closed"):
                    fail("chromium closed its DevTools pipe (during %s)" % method)
                left = deadline - time.time()
                if left <= 0:
                    fail("chromium did not answer %s within %d s" % (method, timeout))
                self.cond.wait(left)
            doc = self.answers.pop(ident)
        if "error" in doc:
            fail("%s: %s" % (method, doc["error"]))
        return doc.get("result", {})

    def page(self, method, params=None, timeout=30):
        return self.call(method, params, session=self.session, timeout=timeout)

    def evaluate(self, expression):
        result = self.page("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            fail("the page's script failed on %r: %s" % (expression, result["exceptionDetails"]))
        return result["result"].get("value")

    def screenshot(self, path):
        data = self.page("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        with open(path, "wb") as out:
            out.write(base64.b64decode(data))

    def close(self):
        try:
            self.call("Browser.close", timeout=5)
        except SystemExit:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# What the page drew, read from window.fw (pipeline/dashboard_page.cc).
STATE = """(() => {
  if (!window.fw) return null;
  const points = {};
  for (const [id, chart] of Object.entries(fw.charts)) points[id] = chart.data.datasets.map(d => d.data.filter(p => p.y !== null).length);
  const fleet = [...document.querySelectorAll('#fleet tbody tr')].map(r => [...r.children].map(c => c.textContent));
  const rollouts = [...document.querySelectorAll('#rollouts tbody tr')].map(r => [...r.children].map(c => c.textContent));
  const sessions = [...document.querySelectorAll('#sessions tbody tr')].map(r => [...r.children].map(c => c.textContent));
  const calls = [...document.querySelectorAll('#calls tbody tr')].map(r => [...r.children].map(c => c.textContent));
  return {sessions, calls, chartjs: fw.chartjs, polls: fw.polls, errors: fw.errors, steps: fw.steps.length, points, fleet, rollouts,
          error: document.getElementById('error').textContent, state: document.getElementById('state').textContent,
          hash: location.hash};
})()"""


def wait_for(browser, what, predicate, timeout):
    deadline = time.time() + timeout
    state = None
    while time.time() < deadline:
        state = browser.evaluate(STATE)
        if state and predicate(state):
            return state
        time.sleep(0.5)
    fail("the page did not show %s within %d s; last seen: %s" % (what, timeout, json.dumps(state)[:2000]))


CONFIG = """
[run]
max_steps = 40
target_accuracy = 1.0
time_limit_s = 240
eval_every = 5
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
"""


def start_demo(program, run_dir):
    config = os.path.join(run_dir, "run-config.toml")
    with open(config, "w") as out:
        out.write(CONFIG)
    process = subprocess.Popen([program, "demo", "--no-files", "--config", config, "--run-dir",
                                os.path.join(run_dir, "run")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout] + [lines.put(None)],
                     daemon=True).start()
    return process, lines


def await_line(lines, pattern, timeout, seen):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.time()))
        except queue.Empty:
            break
        if line is None:
            fail("the demo ended before printing %r; it printed:\n%s" % (pattern, "".join(seen[-40:])))
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    fail("no line matching %r within %d s; the demo printed:\n%s" % (pattern, timeout, "".join(seen[-40:])))


def check_live(browser, url, artifacts):
    browser.page("Page.enable")
    browser.page("Page.navigate", {"url": url})
    first = wait_for(browser, "its first steps", lambda s: s["polls"] > 0 and s["steps"] >= 2, 180)
    if not first["chartjs"]:
        fail("Chart.js did not load from /dashboard/chart.js (is libjs-chart.js installed at build time?)")
    if "token" in first["hash"]:
        fail("the token stayed in the address bar: " + first["hash"])
    later = wait_for(browser, "more steps", lambda s: s["steps"] >= first["steps"] + 2, 180)
    for curve in CURVES_WITH_EVERY_STEP:
        before, after = first["points"].get(curve), later["points"].get(curve)
        if not after or after[0] <= before[0]:
            fail("curve %s did not grow: %s -> %s" % (curve, before, after))
    if max(later["points"]["reward"][1], 0) == 0:
        later = wait_for(browser, "a held-out score", lambda s: s["points"]["reward"][1] > 0, 120)
    state = wait_for(browser, "both workers with their versions",
                     lambda s: sum(1 for r in s["fleet"] if r[2] == "worker" and r[3].isdigit()) == 2, 60)
    workers = [r for r in state["fleet"] if r[2] == "worker"]
    if sorted(r[1] for r in workers) != ["eu", "us"]:
        fail("the fleet view lists %s" % workers)
    if not any(r[2] == "relay" for r in state["fleet"]):
        fail("the fleet view lists no relay: %s" % state["fleet"])
    if not state["rollouts"] or not all(r[4] and r[2].startswith("worker-") for r in state["rollouts"]):
        fail("no rollouts (or rollouts without prompt and worker): %s" % state["rollouts"][:3])
    if state["errors"]:
        fail("the page counted %d failed polls (%s)" % (state["errors"], state["error"]))
    browser.screenshot(os.path.join(artifacts, "dashboard-live.png"))
    print("live: %d steps, points per curve %s, fleet %s, %d rollouts" %
          (state["steps"], {k: v for k, v in state["points"].items()}, [r[:4] for r in state["fleet"]],
           len(state["rollouts"])), flush=True)


def check_report(browser, program, report_dir, artifacts):
    with open(os.path.join(report_dir, "summary.json")) as f:
        steps = json.load(f)["steps"]
    server = subprocess.Popen([program, "report", "serve", report_dir], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        line = server.stdout.readline()
        match = re.search(r"(http://\S+/dashboard#token=\w+)", line)
        if not match:
            fail("`flywheel report serve` printed %r" % line)
        browser.page("Page.navigate", {"url": match.group(1)})
        state = wait_for(browser, "the finished run", lambda s: s["polls"] > 0 and s["steps"] == steps, 60)
        if state["points"]["reward"][0] != steps or not state["rollouts"]:
            fail("the report page shows %s" % json.dumps(state)[:1000])
        if "finished" not in state["state"]:
            fail("the report page does not say the run finished: " + state["state"])
        browser.screenshot(os.path.join(artifacts, "dashboard-report.png"))
        # Without the token (a fresh session): the page says why it shows nothing.
        browser.evaluate("sessionStorage.clear()")
        browser.page("Page.navigate", {"url": match.group(1).split("#")[0]})
        wait_for(browser, "the missing-token message", lambda s: "token" in s["error"], 30)
        print("report: %d steps, %d rollouts" % (state["steps"], len(state["rollouts"])), flush=True)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            fail("`flywheel report serve` did not stop on SIGINT")
    if server.returncode != 0:
        fail("`flywheel report serve` exited with %d" % server.returncode)


def check_service(browser, program, work, artifacts):
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "examples", "rl_sort.py")
    script = subprocess.Popen([sys.executable, example, "--launch", "--flywheel", program, "--run-dir",
                               os.path.join(work, "service"), "--digits", "3", "--sft-steps", "2",
                               "--max-steps", "200", "--target", "0", "--group-size", "4",
                               "--groups-per-step", "2", "--eval-every", "1000", "--eval-prompts", "8",
                               "--time-limit", "240"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in script.stdout] + [lines.put(None)],
                     daemon=True).start()
    seen = []
    try:
        url = await_line(lines, r"dashboard: (http://\S+/dashboard#token=\w+)", 240, seen).group(1)
        browser.page("Page.navigate", {"url": url})
        first = wait_for(browser, "the service's first optimizer steps",
                         lambda s: s["polls"] > 0 and s["steps"] >= 1 and s["sessions"], 240)
        later = wait_for(browser, "more optimizer steps", lambda s: s["steps"] >= first["steps"] + 2, 240)
        for curve in ["loss", "grad", "sequences"]:
            if later["points"][curve][0] <= first["points"][curve][0]:
                fail("service curve %s did not grow: %s -> %s" % (curve, first["points"], later["points"]))
        if "reward" in later["points"]:
            fail("the service page draws RL-run curves it has no data for: %s" % list(later["points"]))
        session = later["sessions"][0]
        if int(session[4]) < 3:
            fail("the session lists %s calls" % session[4])
        called = {row[1] for row in later["calls"]}
        if not {"forward_backward", "optim_step"} <= called:
            fail("the latest calls lack forward_backward/optim_step: %s" % sorted(called))
        workers = [r for r in later["fleet"] if r[2] == "worker"]
        if not workers or not all(r[3].isdigit() for r in workers):
            fail("the service's fleet view lists %s" % later["fleet"])
        browser.screenshot(os.path.join(artifacts, "dashboard-service.png"))
        print("service: %d steps, session %s, calls %s, workers %s" %
              (later["steps"], session, sorted(called), [r[:4] for r in workers]), flush=True)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGINT)  # the example stops the service it launched
            try:
                script.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(script.pid, signal.SIGKILL)


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    program = sys.argv[1]
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        print("SKIP: no chromium (apt install chromium; tools/dev installs it)")
        return SKIP
    artifacts = os.environ.get("FLYWHEEL_ARTIFACTS") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(program))), "test-artifacts")
    os.makedirs(artifacts, exist_ok=True)
    work = tempfile.mkdtemp(prefix="fw-dashboard-browser-")
    demo, lines = start_demo(program, work)
    browser = None
    seen = []
    try:
        url = await_line(lines, r"dashboard: (http://\S+/dashboard#token=\w+)", 180, seen).group(1)
        browser = DevTools(os.path.join(work, "profile"))
        check_live(browser, url, artifacts)
        deadline = time.time() + 300
        while demo.poll() is None and time.time() < deadline:
            try:
                line = lines.get(timeout=1)
                if line:
                    seen.append(line)
            except queue.Empty:
                pass
        if demo.returncode != 0:
            fail("the demo exited with %s:\n%s" % (demo.returncode, "".join(seen[-40:])))
        check_report(browser, program, os.path.join(work, "run", "report"), artifacts)
        check_service(browser, program, work, artifacts)
    finally:
        if browser:
            browser.close()
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGTERM)
            try:
                demo.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    print("PASS (screenshots in %s)" % artifacts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
