"""The training client against a whole `flywheel service` (serve-trainer + relay + rollout
workers, docs/TRAINING_API.md): two LoRA sessions served side by side by one worker, each
adapter sampling exactly as its own session computes and never as the other's; unknown
adapters and models refused; and the SDK examples (examples/rl_sort.py, custom_loss.py)
running to their JSON summary with short budgets.

Needs the binary: FLYWHEEL_TEST_BIN=build/bin/flywheel (ctest runs this file as
python.training_fleet); skipped without it. Every `flywheel service` (and what it started)
is stopped at the end, also when a test fails.

Run: FLYWHEEL_TEST_BIN=build/bin/flywheel /usr/bin/python3 -m pytest \\
         tests/python/test_training_fleet.py -q
"""

import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import flywheel
from flywheel._http import HttpSession
from flywheel.training import Datum

np = pytest.importorskip("numpy")

BINARY = os.path.abspath(os.environ["FLYWHEEL_TEST_BIN"]) if os.environ.get(
    "FLYWHEEL_TEST_BIN") else ""
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLES = os.path.join(ROOT, "examples")
STARTUP_S = 120
EXAMPLE_TIMEOUT_S = 120  # one example run; each takes 5-7 s on a 2-core machine
TEST_TIME_LIMIT_S = 180  # conftest's 60 s is too tight for a loaded CI machine

# The sort task's CharTokenizer (examples/sort_task.py): digits, '+', '=', '>', BOS, EOS.
BOS, EOS, ARROW = 13, 14, 12
# bf16 serving against the trainer's float32 forward: observed differences are ~3e-3.
LOGPROB_TOLERANCE = 0.05


def _binary_problem():
    if not BINARY:
        return "set FLYWHEEL_TEST_BIN to the flywheel binary (ctest: python.training_fleet)"
    if not os.access(BINARY, os.X_OK):
        return f"FLYWHEEL_TEST_BIN={BINARY} is not an executable"
    try:
        help_text = subprocess.run([BINARY, "service", "--help"], capture_output=True,
                                   text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{BINARY} service --help failed: {error}"
    if help_text.returncode != 0:
        return f"{BINARY} has no service command: {help_text.stderr.strip()[:200]}"
    return None


_PROBLEM = _binary_problem()
if _PROBLEM is not None and BINARY:
    # Given a binary that does not work (ctest always gives one): a failure, never a skip.
    pytest.fail(_PROBLEM, pytrace=False)
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


@pytest.fixture(autouse=True)
def time_bound():
    """Overrides conftest's 60 s bound (an example run plus its service start)."""
    faulthandler.dump_traceback_later(TEST_TIME_LIMIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _stop_group(process, first=signal.SIGINT, grace=30):
    """Stops a child started with start_new_session=True and everything it started: ``first``
    to the child (Ctrl-C: `flywheel service` and the examples stop what they started), then
    SIGKILL to its whole process group (ours: the child leads it)."""
    if process.poll() is None:
        process.send_signal(first)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(process.pid)
    if process.poll() is None:
        process.wait(10)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a reused id of someone else's group
        return False


def _group_outlives(pgid, grace):
    """Whether processes of the group are still there ``grace`` seconds from now."""
    deadline = time.monotonic() + grace
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Service:
    """One `flywheel service` on loopback, its run directory in a temporary directory."""

    def __init__(self, run_dir, *extra):
        self.run_dir = run_dir
        self.log_path = run_dir / "service.log"
        command = [BINARY, "service", "--run-dir", str(run_dir), "--ready-timeout", "60",
                   *extra]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        service_file = run_dir / "service.json"
        deadline = time.monotonic() + STARTUP_S
        while True:
            if service_file.exists():
                try:
                    self.endpoints = json.loads(service_file.read_text())
                    break
                except ValueError:
                    pass  # still being written
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"flywheel service exited with {self.process.returncode}:\n"
                                   + self.log())
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"flywheel service not ready after {STARTUP_S} s:\n"
                                   + self.log())
            time.sleep(0.05)
        self.trainer = self.endpoints["trainer"]
        self.workers = list(self.endpoints["workers"])
        self.token = open(self.endpoints["token_file"], encoding="utf-8").read().strip()

    def log(self):
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self):
        _stop_group(self.process)


# ---------------------------------------------------------------------------------------
# Two LoRA sessions, one worker


@pytest.fixture(scope="module")
def lora_service(tmp_path_factory):
    running = Service(tmp_path_factory.mktemp("service-lora"), "--lora-rank", "4",
                      "--workers", "1", "--seed", "7")
    yield running
    running.stop()


def training_prompts(count=8, seed=0):
    rng = np.random.default_rng(seed)
    return [[BOS] + rng.integers(0, 10, 6).tolist() + [ARROW] for _ in range(count)]


def towards(digit, prompts):
    """Cross-entropy datums teaching one fixed answer: six times ``digit``, then EOS."""
    return [Datum.from_prompt_completion(p, [digit] * 6 + [EOS]) for p in prompts]


# Prompts neither session trained on.
TEST_PROMPTS = [[BOS] + [int(c) for c in digits] + [ARROW]
                for digits in ("152804", "999111", "372615", "000000")]


class TwoAdapters:
    """Sessions alpha (taught "333333") and beta (taught "777777"), both published and
    served by the service's one worker."""

    def __init__(self, service):
        self.service = service
        self.client = flywheel.ServiceClient(service.trainer, service.token)
        self.alpha = self.client.create_session(name="alpha")
        self.beta = self.client.create_session(name="beta")
        self.sessions = {"alpha": self.alpha, "beta": self.beta}
        self.samplers = {name: flywheel.SamplingClient(service.workers, service.token,
                                                       adapter=name)
                         for name in ("alpha", "beta")}
        self.base = flywheel.SamplingClient(service.workers, service.token)
        self.published = {}

    def train(self, steps=5, lr=1e-2):
        """Interleaved, pipelined steps of both sessions; returns each one's losses."""
        prompts = training_prompts()
        batches = {"alpha": towards(3, prompts), "beta": towards(7, prompts)}
        futures = {"alpha": [], "beta": []}
        for _ in range(steps):
            for name, session in self.sessions.items():
                futures[name].append(session.forward_backward_async(batches[name],
                                                                    loss="cross_entropy"))
                session.optim_step_async(lr=lr)
        return {name: [f.result().loss for f in fs] for name, fs in futures.items()}

    def publish(self):
        for name, session in self.sessions.items():
            self.published[name] = session.save_weights_for_sampler()
        last = max(p.version for p in self.published.values())
        for sampler in self.samplers.values():
            sampler.wait_for_version(last, timeout=60)
        return last

    def close(self):
        for sampler in list(self.samplers.values()) + [self.base]:
            sampler.close()
        for session in self.sessions.values():
            session.close()
        self.client.close()


@pytest.fixture(scope="module")
def adapters(lora_service):
    pair = TwoAdapters(lora_service)
    try:
        pair.losses = pair.train()
        pair.version = pair.publish()
        yield pair
    finally:
        pair.close()


def greedy(sampler, prompt, min_version=None):
    return sampler.sample(prompt, n=1, max_tokens=7, temperature=0.0, logprobs=True,
                          min_version=min_version)[0]


def completion_logprobs(session, sample):
    """The session's forward logprobs of the sample's completion tokens."""
    logprobs = session.forward([sample.to_datum()]).logprobs[0]
    return np.asarray(logprobs[len(sample.prompt_tokens) - 1:], dtype=np.float64)


def test_both_sessions_trained_and_published_their_adapters(adapters):
    for name, losses in adapters.losses.items():
        assert losses[-1] < 0.6 * losses[0], f"{name} did not learn: {losses}"
    alpha, beta = adapters.published["alpha"], adapters.published["beta"]
    assert (alpha.adapter, beta.adapter) == ("alpha", "beta")
    assert beta.version > alpha.version  # one sequence of versions for every session
    assert alpha.adapter_hash != beta.adapter_hash
    worker = HttpSession(adapters.service.workers[0], adapters.service.token, 30, None)
    try:
        models = {m["id"]: m for m in worker.json("GET", "/v1/models")["data"]}
    finally:
        worker.close()
    assert {"alpha", "beta"} <= set(models)
    assert models["alpha"]["parent"] == models["beta"]["parent"] is not None
    assert models[models["alpha"]["parent"]]["parent"] is None  # the served base model


def test_each_adapter_samples_as_its_own_session_and_not_as_the_other(adapters):
    own_answer = {"alpha": 3, "beta": 7}
    for name, other in (("alpha", "beta"), ("beta", "alpha")):
        for prompt in TEST_PROMPTS:
            sample = greedy(adapters.samplers[name], prompt, min_version=adapters.version)
            assert sample.logprobs is not None and len(sample.logprobs) == len(sample.tokens)
            assert min(sample.policy_versions) >= adapters.version
            assert sample.tokens[0] == own_answer[name], (name, sample.tokens)
            sampled = np.asarray(sample.logprobs, dtype=np.float64)
            own = completion_logprobs(adapters.sessions[name], sample)
            theirs = completion_logprobs(adapters.sessions[other], sample)
            assert np.max(np.abs(sampled - own)) <= LOGPROB_TOLERANCE, (name, sampled, own)
            # The other adapter gives these tokens far lower logprobs: nothing was mixed.
            assert np.max(np.abs(sampled - theirs)) > 1.0, (name, sampled, theirs)
            assert float(np.sum(theirs)) < float(np.sum(own)) - 5.0


def test_the_base_answers_differ_from_both_adapters(adapters):
    fresh = adapters.client.create_session(name="fresh")  # LoRA B starts at 0: the base
    try:
        for prompt in TEST_PROMPTS:
            base = greedy(adapters.base, prompt, min_version=adapters.version)
            answers = {name: greedy(sampler, prompt).tokens
                       for name, sampler in adapters.samplers.items()}
            assert base.tokens != answers["alpha"] and base.tokens != answers["beta"]
            sampled = np.asarray(base.logprobs, dtype=np.float64)
            assert np.max(np.abs(sampled - completion_logprobs(fresh, base))) <= LOGPROB_TOLERANCE
            for name, session in adapters.sessions.items():
                assert np.max(np.abs(sampled - completion_logprobs(session, base))) > 0.2, name
    finally:
        fresh.close()


def test_the_model_field_selects_the_base_or_an_adapter(adapters):
    worker = HttpSession(adapters.service.workers[0], adapters.service.token, 30, None)
    try:
        models = worker.json("GET", "/v1/models")["data"]
    finally:
        worker.close()
    served = next(m["id"] for m in models if m["parent"] is None)
    prompt = TEST_PROMPTS[0]
    base = greedy(adapters.base, prompt)
    assert adapters.base.sample(prompt, max_tokens=7, temperature=0.0,
                                model=served)[0].tokens == base.tokens
    for name, sampler in adapters.samplers.items():
        by_model = adapters.base.sample(prompt, max_tokens=7, temperature=0.0, model=name)[0]
        assert by_model.tokens == greedy(sampler, prompt).tokens


def test_an_unknown_adapter_or_model_is_a_404(adapters):
    with flywheel.SamplingClient(adapters.service.workers, adapters.service.token,
                                 adapter="gamma") as unknown:
        with pytest.raises(flywheel.NotFound, match="gamma") as error:
            unknown.sample(TEST_PROMPTS[0], max_tokens=4)
        assert error.value.status == 404
        with pytest.raises(flywheel.WaitTimeout):
            unknown.wait_for_version(adapters.version, timeout=0.5)
    with pytest.raises(flywheel.NotFound, match="no-such-model") as error:
        adapters.base.sample(TEST_PROMPTS[0], max_tokens=4, model="no-such-model")
    assert error.value.status == 404
    # Refusals leave the worker serving both adapters.
    assert greedy(adapters.samplers["alpha"], TEST_PROMPTS[0]).tokens[0] == 3


def test_a_new_version_of_one_adapter_leaves_the_other_unchanged(adapters):
    prompt = TEST_PROMPTS[1]
    before = {name: greedy(sampler, prompt) for name, sampler in adapters.samplers.items()}
    adapters.beta.forward_backward(towards(5, training_prompts(seed=1)), loss="cross_entropy")
    adapters.beta.optim_step(lr=5e-2)
    published = adapters.beta.save_weights_for_sampler()
    adapters.samplers["beta"].wait_for_version(published.version, timeout=60)
    alpha = greedy(adapters.samplers["alpha"], prompt, min_version=published.version)
    beta = greedy(adapters.samplers["beta"], prompt, min_version=published.version)
    assert alpha.tokens == before["alpha"].tokens
    assert np.max(np.abs(np.subtract(alpha.logprobs, before["alpha"].logprobs))) < 1e-3
    assert np.max(np.abs(np.subtract(beta.logprobs, before["beta"].logprobs))) > 1e-2
    own = completion_logprobs(adapters.beta, beta)
    assert np.max(np.abs(np.asarray(beta.logprobs) - own)) <= LOGPROB_TOLERANCE


def test_a_closed_sessions_adapter_is_unloaded(adapters):
    gamma = adapters.client.create_session(name="gamma")
    sampler = flywheel.SamplingClient(adapters.service.workers, adapters.service.token,
                                      adapter="gamma")
    try:
        gamma.forward_backward(towards(1, training_prompts()), loss="cross_entropy")
        gamma.optim_step(lr=1e-2)
        sampler.wait_for_version(gamma.save_weights_for_sampler().version, timeout=60)
        assert greedy(sampler, TEST_PROMPTS[0]).tokens
        gamma.close()
        # The next version (any session's) no longer carries gamma; the worker drops it.
        version = adapters.alpha.save_weights_for_sampler().version
        adapters.samplers["alpha"].wait_for_version(version, timeout=60)
        with pytest.raises(flywheel.NotFound, match="gamma"):
            sampler.sample(TEST_PROMPTS[0], max_tokens=4)
        assert greedy(adapters.samplers["alpha"], TEST_PROMPTS[0]).tokens[0] == 3
    finally:
        sampler.close()
        gamma.close()


SERVER_IDLE_CLOSE_S = 10  # transport/http.h: the server drops a connection idle this long


def test_sessions_close_after_their_connections_idled(lora_service):
    """A kept-alive connection the server closed while idle is reopened for the DELETE of
    close() and delete_session (GET and DELETE are retried once on a fresh connection)."""
    with flywheel.ServiceClient(lora_service.trainer, lora_service.token) as service:
        first = service.create_session(name="idle-1")
        second = service.create_session(name="idle-2")
        first.get_info()
        second.get_info()
        service.info()
        time.sleep(SERVER_IDLE_CLOSE_S + 1.5)
        first.close()
        service.delete_session(second.session_id)
        second.close(delete=False)
        names = {s["name"] for s in service.info()["sessions"]}
        assert not names & {"idle-1", "idle-2"}


# ---------------------------------------------------------------------------------------
# The examples, with short budgets


def run_example(tmp_path, script, *arguments):
    """Runs ``examples/<script> --launch`` to its end; returns (stdout, the final JSON
    summary). The example starts and stops its own `flywheel service`; it must leave no
    process behind."""
    run_dir = tmp_path / "service"
    command = [sys.executable, os.path.join(EXAMPLES, script), "--launch",
               "--flywheel", BINARY, "--run-dir", str(run_dir), *arguments]
    environment = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"),
                       PATH=os.defpath, PYTHONUNBUFFERED="1")
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, text=True, env=environment,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        output, _ = process.communicate()
        pytest.fail(f"{script} ran over {EXAMPLE_TIMEOUT_S} s:\n{output[-4000:]}")
    finally:
        leaked = _group_outlives(process.pid, grace=10)
        _kill_group(process.pid)
    seconds = time.monotonic() - started
    service_log = run_dir / "service.log"
    log = service_log.read_text(errors="replace")[-2000:] if service_log.exists() else ""
    assert process.returncode == 0, f"{script} exited {process.returncode}:\n{output[-4000:]}\n{log}"
    assert not leaked, f"{script} left processes of its service running"
    start = output.rfind("\n{")
    assert start >= 0, f"{script} printed no JSON summary:\n{output[-4000:]}"
    summary = json.loads(output[start + 1:])
    print(f"{script}: {seconds:.1f} s")
    return output, summary


def step_lines(output):
    return [line for line in output.splitlines() if re.match(r"step +\d+ ", line)]


def test_rl_sort_runs_to_its_summary(tmp_path):
    output, summary = run_example(
        tmp_path, "rl_sort.py", "--max-steps", "6", "--eval-every", "3", "--eval-prompts", "32",
        "--time-limit", "120", "--target", "0", "--service-arg=--workers=1")
    assert summary["steps"] == 6 and summary["task"] == "sort-6"
    assert summary["samples"] == 6 * 8 * 8  # groups of 8, 8 groups a step
    assert summary["versions"] >= summary["steps"] + 1  # a version after SFT, one a step
    for key in ("warmup_accuracy", "final_accuracy"):
        assert 0.0 <= summary[key] <= 1.0, (key, summary[key])
    assert summary["warmup_accuracy"] > 0.0  # 30 SFT steps teach some of the task
    assert summary["reached_target"] is False and summary["time_to_target_s"] is None
    assert 0 < summary["wall_seconds"] < 120
    lines = step_lines(output)
    assert len(lines) == 6 and sum("held-out" in line for line in lines) == 2
    grads = [float(re.search(r"grad (\S+)", line).group(1)) for line in lines]
    assert max(grads) > 0  # the RL steps moved the weights


@pytest.mark.parametrize("loss,mode", [("numpy", "lora"), ("torch", "full")])
def test_custom_loss_runs_to_its_summary(tmp_path, loss, mode):
    if loss == "torch":
        pytest.importorskip("torch")
    service_arguments = ["--service-arg=--workers=1"]
    if mode == "lora":
        service_arguments.append("--service-arg=--lora-rank=8")
    output, summary = run_example(
        tmp_path, "custom_loss.py", "--loss", loss, "--steps", "4", "--eval-every", "2",
        "--eval-prompts", "32", *service_arguments)
    assert summary["steps"] == 4 and summary["loss"] == f"reinforce-tis ({loss})"
    for key in ("warmup_accuracy", "final_accuracy", "reward_first_tenth", "reward_last_tenth"):
        assert 0.0 <= summary[key] <= 1.0, (key, summary[key])
    assert summary["wall_seconds"] > 0
    lines = step_lines(output)
    assert len(lines) == 4 and sum("held-out" in line for line in lines) == 2
    assert "after SFT warm-up" in output


# ---------------------------------------------------------------------------------------
# Training shapes (pipeline/shapes.h) for `flywheel service`


def test_a_lora_shape_starts_the_service_in_lora_mode_within_its_limits(tmp_path):
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    (shapes / "lora.toml").write_text('name = "lora-small"\n[model]\nmax_context = 128\nmode = "lora"\n'
                                      'lora_rank = [4, 16]\n[workers]\nmax_batch = 6\n')
    (tmp_path / "run").mkdir()
    service = Service(tmp_path / "run", "--shape", "lora-small", "--shapes-dir", str(shapes), "--workers", "1")
    try:
        assert service.endpoints["mode"] == "lora"
        commands = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if str(tmp_path / "run") in " ".join(args):
                commands.append(args)
        trainer = next(a for a in commands if "serve-trainer" in a)
        worker = next(a for a in commands if "worker" in a[1:2])
        assert trainer[trainer.index("--lora-rank") + 1] == "4", trainer  # the range's smallest
        # The shape's 128-token context, capped at the preset model's 64 positions.
        assert worker[worker.index("--max-sequence") + 1] == "64", worker
        assert worker[worker.index("--max-batch") + 1] == "6", worker
    finally:
        service.stop()


@pytest.mark.parametrize("extra, message", [
    (["--shape", "demo-cpu", "--threads", "2"], "--threads is set by shape 'demo-cpu'"),
    (["--shape", "demo-cpu", "--lora-rank", "4"], "shape 'demo-cpu' trains full weights"),
    (["--shape", "nope"], "no shape 'nope'"),
])
def test_a_shape_refuses_what_it_owns_before_anything_starts(tmp_path, extra, message):
    done = subprocess.run([BINARY, "service", "--run-dir", str(tmp_path / "run"), *extra],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert not (tmp_path / "run" / "logs" / "trainer.out").exists()
