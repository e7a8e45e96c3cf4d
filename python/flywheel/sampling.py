"""Sampling from the rollout workers (``flywheel worker --model ...``), by token ids.

    sampler = flywheel.SamplingClient(["http://w1:7280", "http://w2:7280"], token=token)
    for s in sampler.sample(prompt_ids, n=8, max_tokens=7, min_version=12):
        s.tokens, s.logprobs, s.policy_versions, s.finish_reason

A client of the workers' OpenAI-style ``POST /v1/completions`` (rollout/openai_api.h) with a
token-id prompt, reading flywheel's fields of each choice: ``token_ids``, the
``logprobs.token_logprobs``, ``policy_versions`` (the version that sampled each token) and,
with ``return_routing``, ``routing`` (MoE). Requests go round-robin over the workers; a
worker that cannot be reached (or is stopping) is skipped for the next one.
:meth:`SamplingClient.wait_for_version` polls the workers' ``GET /v1/status`` (``version``)
and, for a LoRA adapter, ``GET /v1/models``.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from .errors import ApiError, ConnectionFailed, StaleSample, Unavailable, WaitTimeout
from .training import Datum, _SessionPool, _token_or_env


@dataclass
class Sample:
    """One completion. ``tokens``: the generated ids (a stop token is kept as the last);
    ``logprobs``: the sampling logprob of each (None unless asked for); ``policy_versions``:
    the policy version that sampled each token; ``routing``: with ``return_routing`` on an
    MoE model, the expert ids of (prompt + completion - 1) positions x MoE layers x top_k,
    token-major (``routing_shape``), else None; ``finish_reason``: ``stop`` or ``length``."""

    prompt_tokens: List[int]
    tokens: List[int]
    logprobs: Optional[List[float]]
    policy_versions: List[int]
    finish_reason: str
    text: str = ""
    routing: Optional[List[int]] = None
    routing_shape: Optional[List[int]] = None
    worker: str = ""

    @property
    def version(self) -> Optional[int]:
        """The oldest version that sampled a token (None for an empty completion)."""
        return min(self.policy_versions) if self.policy_versions else None

    def to_datum(self, advantage: Optional[float] = None) -> Datum:
        """The training datum of this sample (:meth:`Datum.from_prompt_completion`), with its
        sampling logprobs, versions and routing."""
        return Datum.from_prompt_completion(self.prompt_tokens, self.tokens, self.logprobs,
                                            advantage, self.policy_versions or None,
                                            self.routing)


@dataclass
class _Worker:
    url: str
    pool: _SessionPool
    last_version: Optional[int] = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class SamplingClient:
    """Samples from a set of rollout workers.

    ``worker_urls``: a list of ``http(s)://host:port``, or one string of them separated by
    commas. ``token``: the workers' read token (default ``$FLYWHEEL_TOKEN``). ``adapter``:
    the LoRA adapter to sample from (a training session's name; None: the base / full
    policy). ``timeout``: seconds per socket operation. ``max_in_flight``: requests sent at
    once by the ``*_async`` methods. Thread-safe.
    """

    def __init__(self, worker_urls: Union[str, Sequence[str]], token: Optional[str] = None,
                 adapter: Optional[str] = None, *, timeout: float = 120.0,
                 ca_file: Optional[str] = None, cert_file: Optional[str] = None,
                 key_file: Optional[str] = None, max_in_flight: int = 32):
        if isinstance(worker_urls, str):
            worker_urls = [u.strip() for u in worker_urls.split(",") if u.strip()]
        urls = list(worker_urls)
        if not urls:
            raise ValueError("SamplingClient needs at least one worker URL")
        token = _token_or_env(token)
        self.adapter = adapter
        self._workers = [_Worker(url.rstrip("/"), _SessionPool(url, token, timeout, ca_file,
                                                               cert_file, key_file))
                         for url in urls]
        self._round_robin = itertools.count()
        self._rr_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max_in_flight,
                                            thread_name_prefix="flywheel-sample")

    @property
    def worker_urls(self) -> List[str]:
        return [w.url for w in self._workers]

    def _next_worker(self) -> int:
        with self._rr_lock:
            return next(self._round_robin) % len(self._workers)

    # -----------------------------------------------------------------------------------
    # Sampling

    def sample(self, prompt_ids: Sequence[int], n: int = 1, max_tokens: int = 16,
               temperature: float = 1.0, stop_token_ids: Optional[Sequence[int]] = None,
               seed: Optional[int] = None, logprobs: bool = True, return_routing: bool = False,
               min_version: Optional[int] = None, version_timeout: float = 60.0,
               **extra: Any) -> List[Sample]:
        """``n`` completions of the token-id prompt ``prompt_ids``.

        ``temperature`` 0 is greedy. Generation stops at the tokenizer's end tokens and at
        ``stop_token_ids`` (kept as the last token), or after ``max_tokens``. ``seed``: the
        i-th completion draws with seed + i. ``logprobs``: return each token's sampling
        logprob. ``return_routing``: MoE routing per position. ``min_version``: only samples
        whose every token was sampled by that version or later; an older answer is
        discarded and the request sent again once the worker serves it (within
        ``version_timeout`` seconds, else :class:`~flywheel.errors.StaleSample`).
        ``extra``: other completions fields (top_p, top_k, ignore_eos, ...), sent as they are.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        request: Dict[str, Any] = {"prompt": prompt, "n": int(n), "max_tokens": int(max_tokens),
                                   "temperature": float(temperature)}
        if stop_token_ids:
            request["stop_token_ids"] = [int(t) for t in stop_token_ids]
        if seed is not None:
            request["seed"] = int(seed)
        if logprobs:
            request["logprobs"] = True
        if return_routing:
            request["return_routing"] = True
        if self.adapter:
            request["adapter"] = self.adapter
        request.update(extra)
        deadline = time.monotonic() + version_timeout
        while True:
            samples = self._post_anywhere(request, prompt)
            if min_version is None:
                return samples
            oldest = min((s.version for s in samples if s.version is not None), default=None)
            if oldest is None or oldest >= min_version:
                return samples
            worker = self._worker(samples[0].worker)
            if time.monotonic() >= deadline:
                raise StaleSample(
                    f"{worker.url} answered with samples of v{oldest}, v{min_version} or later "
                    f"were asked for (waited {version_timeout:g} s)", min_version,
                    {w.url: w.last_version for w in self._workers})
            self._wait_worker(worker, min_version, deadline)

    def sample_async(self, prompt_ids: Sequence[int], **kwargs: Any) -> Future:
        """Future of :meth:`sample` (runs on this client's threads)."""
        return self._executor.submit(self.sample, prompt_ids, **kwargs)

    def _post_anywhere(self, request: Dict[str, Any], prompt: List[int]) -> List[Sample]:
        """POSTs to the next worker in turn; an unreachable or stopping worker passes the
        request to the one after it (each worker once)."""
        start = self._next_worker()
        error: Optional[Exception] = None
        for offset in range(len(self._workers)):
            worker = self._workers[(start + offset) % len(self._workers)]
            try:
                answer = self._post(worker, request)
            except (ConnectionFailed, Unavailable) as failure:
                error = failure
                continue
            samples = _samples_of(answer, prompt, worker.url)
            versions = [s.version for s in samples if s.version is not None]
            if versions:
                with worker.lock:
                    worker.last_version = max(worker.last_version or 0, max(versions))
            return samples
        assert error is not None
        raise error

    @staticmethod
    def _post(worker: _Worker, request: Dict[str, Any]) -> Dict[str, Any]:
        """POST /v1/completions; sent again at once when a kept-alive connection turns out
        closed (generation has no side effect to repeat)."""
        session = worker.pool.acquire()
        try:
            reused = session.connected
            try:
                return session.json("POST", "/v1/completions", document=request)
            except ConnectionFailed:
                if not reused:
                    raise
                return session.json("POST", "/v1/completions", document=request)
        finally:
            worker.pool.release(session)

    # -----------------------------------------------------------------------------------
    # Versions

    def worker_version(self, url_or_index: Union[str, int]) -> Optional[int]:
        """The version a worker serves now (``GET /v1/status``); for an adapter client, None
        until the worker lists the adapter in ``GET /v1/models``. Raises on transport
        failure."""
        worker = self._worker(url_or_index)
        status = worker.pool.json("GET", "/v1/status")
        version = status.get("version")
        if self.adapter:
            models = worker.pool.json("GET", "/v1/models")
            if not any(m.get("id") == self.adapter for m in models.get("data") or []):
                return None
        if isinstance(version, int):
            with worker.lock:
                worker.last_version = version
            return version
        return None

    def worker_versions(self) -> Dict[str, Optional[int]]:
        """Every worker's :meth:`worker_version`, None for one that cannot be asked."""
        out: Dict[str, Optional[int]] = {}
        for worker in self._workers:
            try:
                out[worker.url] = self.worker_version(worker.url)
            except (ConnectionFailed, ApiError):
                out[worker.url] = None
        return out

    def wait_for_version(self, version: int, timeout: float = 60.0, *, all_workers: bool = True,
                         poll_interval: float = 0.05) -> Dict[str, Optional[int]]:
        """Blocks until every worker (``all_workers=False``: one) serves ``version`` or
        later (and, for an adapter client, lists the adapter); returns each worker's
        version. Raises :class:`~flywheel.errors.WaitTimeout` (``readiness``: the versions)
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        pending = {w.url for w in self._workers}
        versions: Dict[str, Optional[int]] = {w.url: None for w in self._workers}
        while True:
            for worker in self._workers:
                if worker.url not in pending:
                    continue
                try:
                    versions[worker.url] = self.worker_version(worker.url)
                except (ConnectionFailed, ApiError):
                    versions[worker.url] = None
                current = versions[worker.url]
                if current is not None and current >= version:
                    pending.discard(worker.url)
            if not pending or (not all_workers and len(pending) < len(self._workers)):
                return versions
            if time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"version {version}{' of adapter ' + self.adapter if self.adapter else ''} "
                    f"not served by {'every worker' if all_workers else 'any worker'} within "
                    f"{timeout:g} s: {versions}", dict(versions))
            time.sleep(poll_interval)

    def _wait_worker(self, worker: _Worker, min_version: int, deadline: float) -> None:
        while True:
            try:
                current = self.worker_version(worker.url)
            except (ConnectionFailed, ApiError):
                current = None
            if current is not None and current >= min_version:
                return
            if time.monotonic() >= deadline:
                raise StaleSample(
                    f"{worker.url} serves v{worker.last_version}, samples of v{min_version} or "
                    "later were asked for", min_version,
                    {w.url: w.last_version for w in self._workers})
            time.sleep(0.05)

    def _worker(self, url_or_index: Union[str, int]) -> _Worker:
        if isinstance(url_or_index, int):
            return self._workers[url_or_index]
        for worker in self._workers:
            if worker.url == url_or_index.rstrip("/"):
                return worker
        raise KeyError(f"{url_or_index} is not one of this client's workers")

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for worker in self._workers:
            worker.pool.close()

    def __enter__(self) -> "SamplingClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _samples_of(answer: Dict[str, Any], prompt: List[int], url: str) -> List[Sample]:
    """The choices of a completions answer as Samples, in ``index`` order."""
    choices = answer.get("choices")
    if not isinstance(choices, list):
        raise ConnectionFailed(url, "completions answer has no 'choices' list")
    samples = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        tokens = [int(t) for t in choice.get("token_ids") or []]
        logprobs = None
        if isinstance(choice.get("logprobs"), dict):
            values = choice["logprobs"].get("token_logprobs")
            if values is not None:
                logprobs = [float(v) for v in values]
        routing, shape = choice.get("routing"), choice.get("routing_shape")
        if routing is not None:
            routing = _routing_ids(routing, int(choice.get("routing_bytes_per_index", 1)))
        samples.append(Sample(prompt_tokens=list(prompt), tokens=tokens, logprobs=logprobs,
                              policy_versions=[int(v) for v in choice.get("policy_versions") or []],
                              finish_reason=str(choice.get("finish_reason") or ""),
                              text=str(choice.get("text") or ""), routing=routing,
                              routing_shape=list(shape) if shape is not None else None,
                              worker=url))
    return samples


def _routing_ids(raw: Sequence[int], bytes_per_index: int) -> List[int]:
    """Expert ids from the worker's routing bytes (1 or 2 per index, little-endian)."""
    if bytes_per_index == 1:
        return [int(b) for b in raw]
    if bytes_per_index == 2 and len(raw) % 2 == 0:
        return [int(raw[i]) | (int(raw[i + 1]) << 8) for i in range(0, len(raw), 2)]
    raise ValueError(f"routing of {len(raw)} bytes with {bytes_per_index} bytes per index")
