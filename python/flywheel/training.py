"""The client of the training service (``flywheel serve-trainer``, docs/TRAINING_API.md).

    import flywheel
    service = flywheel.ServiceClient("http://trainer:7300", token=token)
    trainer = service.create_session(name="sort-rl")
    metrics = trainer.forward_backward(datums, loss="ppo", clip_low=0.2, tis_cap=2.0)
    trainer.optim_step(lr=5e-5)
    weights = trainer.save_weights_for_sampler()     # weights.version, weights.adapter

Every call of a session carries a ``seq``: the client numbers the calls 1, 2, ... in the
order they are made, and the server runs them in that order whatever order their requests
arrive in. So the ``*_async`` variants (which return :class:`concurrent.futures.Future`)
may have several calls in flight, each on its own connection, and they still run in order.
A call whose connection fails is sent once more with the same ``seq``; the server repeats
its answer instead of running it twice. Server errors raise the
:class:`~flywheel.errors.ApiError` subclass of their code (``SessionConflict``,
``SeqTimeout``, ``SeqReplayed``, ``NameTaken``, ``TooManySessions``, ``TooLarge``,
``NotFound``, ``BadRequest``, ...) carrying the server's message.

A session belongs to the token that opened it: with another token its id, its calls and
its saved states are ``NotFound``, as if they did not exist.

A :class:`Datum` is one sequence: position ``i`` of ``tokens`` predicts
``target_tokens[i]``; every other field is per position too (``routing``: T x MoE layers x
top_k). Batches travel as the binary FWB1 container (:mod:`flywheel._wire`).
"""

from __future__ import annotations

import array
import json
import logging
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _wire
from ._http import HttpSession
from .errors import ApiError, ConnectionFailed, FlywheelError, api_error

try:
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

_log = logging.getLogger("flywheel")

#: The datum fields in the order they travel, with their wire dtype.
DATUM_FIELDS: Tuple[Tuple[str, str], ...] = (
    ("tokens", "i32"), ("target_tokens", "i32"), ("weights", "f32"), ("logprobs", "f32"),
    ("advantages", "f32"), ("ref_logprobs", "f32"), ("policy_versions", "u64"),
    ("routing", "i32"))

#: ``loss_config`` keys the server knows (docs/TRAINING_API.md); others are refused there.
LOSS_CONFIG_KEYS = ("aggregation", "norm_length", "clip_low", "clip_high", "dual_clip",
                    "cispo_low", "cispo_high", "dro_beta", "dpo_beta", "kl_coef",
                    "kl_estimator", "tis_cap")
#: ``adam`` keys of optim_step.
ADAM_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip")

#: A loss written in Python, for :meth:`TrainingClient.forward_backward_custom`.
LossFn = Callable[[List["Datum"], List[Any]], Tuple[float, List[Any]]]


def _vector(values: Sequence[Any], dtype: str) -> Any:
    """A 1-D numpy array of the wire dtype when numpy is there, else an array.array."""
    if _np is not None:
        return _np.asarray(values, dtype=_wire.DTYPES[dtype][1][1:])
    return array.array(_wire.DTYPES[dtype][2], values)


def _full(count: int, value: float, dtype: str) -> Any:
    if _np is not None:
        return _np.full(count, value, dtype=_wire.DTYPES[dtype][1][1:])
    return array.array(_wire.DTYPES[dtype][2], [value]) * count


@dataclass
class Datum:
    """One training sequence; every field but ``tokens`` and ``target_tokens`` is optional,
    and a batch gives a field for every datum or for none.

    ``tokens``/``target_tokens``: i32, length T >= 1. ``weights``: the loss weight of each
    position (absent: all 1). ``logprobs``: the sampler's logprob of each target (RL losses,
    TIS). ``advantages``: per position (RL losses). ``ref_logprobs``: a reference policy's
    (dpo, kl_coef > 0). ``policy_versions``: the version that sampled each target.
    ``routing``: MoE routing replay, T x moe_layers x top_k expert ids, token-major.
    Values may be lists, ``array.array`` or numpy arrays.
    """

    tokens: Any
    target_tokens: Any
    weights: Any = None
    logprobs: Any = None
    advantages: Any = None
    ref_logprobs: Any = None
    policy_versions: Any = None
    routing: Any = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_prompt_completion(cls, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                               logprobs: Optional[Sequence[float]] = None,
                               advantage: Optional[float] = None,
                               policy_versions: Optional[Sequence[int]] = None,
                               routing: Optional[Sequence[int]] = None) -> "Datum":
        """The datum of a prompt and its completion: ``tokens`` = (prompt + completion)[:-1],
        ``target_tokens`` = (prompt + completion)[1:], so the last prompt position predicts
        the first completion token. Weight 1 on the completion's targets, 0 on the prompt's.

        ``logprobs``/``policy_versions`` (one per completion token, as a sampler returns
        them) land on the completion's positions (0 before). ``advantage`` is set on every
        position (the weights keep the prompt's out of the loss). ``routing`` is passed
        through: the sampler's covers exactly these T positions.
        REQUIRES: a non-empty prompt and completion.
        """
        prompt = [int(t) for t in prompt_ids]
        completion = [int(t) for t in completion_ids]
        if not prompt or not completion:
            raise ValueError("from_prompt_completion needs a non-empty prompt and completion "
                             f"(got {len(prompt)} and {len(completion)} tokens)")
        full = prompt + completion
        length = len(full) - 1
        first = len(prompt) - 1  # the position that predicts completion[0]
        weights = [0.0] * first + [1.0] * len(completion)
        datum = cls(tokens=_vector(full[:-1], "i32"), target_tokens=_vector(full[1:], "i32"),
                    weights=_vector(weights, "f32"))
        if logprobs is not None:
            if len(logprobs) != len(completion):
                raise ValueError(f"{len(logprobs)} logprobs for {len(completion)} completion tokens")
            datum.logprobs = _vector([0.0] * first + [float(v) for v in logprobs], "f32")
        if policy_versions is not None:
            if len(policy_versions) != len(completion):
                raise ValueError(f"{len(policy_versions)} policy_versions for "
                                 f"{len(completion)} completion tokens")
            versions = [int(v) for v in policy_versions]
            datum.policy_versions = _vector([versions[0]] * first + versions, "u64")
        if advantage is not None:
            datum.advantages = _full(length, float(advantage), "f32")
        if routing is not None and len(routing):
            if len(routing) % length:
                raise ValueError(f"routing of {len(routing)} values does not split into "
                                 f"{length} positions")
            datum.routing = _vector(routing, "i32")
        return datum


class Answer(dict):
    """A JSON answer: a dict whose keys also read as attributes (``metrics.loss``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class ForwardResult:
    """``forward``'s answer: per datum, the logprob of each target (length T) and, for an MoE
    model, the routing used (T x moe_layers x top_k; None for dense models)."""

    logprobs: List[Any]
    routing: Optional[List[Any]] = None


class PreparedBatch:
    """Datums checked and turned into wire arrays once (a batch sent twice, e.g. by
    forward_backward_custom, is encoded once)."""

    def __init__(self, datums: Sequence[Datum]):
        if isinstance(datums, Datum):
            raise TypeError("expected a list of Datum, got one Datum")
        self.datums = list(datums)
        if not self.datums:
            raise ValueError("a batch needs at least one datum")
        for index, datum in enumerate(self.datums):
            if not isinstance(datum, Datum):
                raise TypeError(f"datum {index} is a {type(datum).__name__}, not a Datum")
        self.lengths = [len(d.tokens) for d in self.datums]
        for index, length in enumerate(self.lengths):
            if length < 1:
                raise ValueError(f"datum {index}: tokens is empty (T must be >= 1)")
        self.arrays: List[Tuple[str, str, bytes]] = []
        for name, dtype in DATUM_FIELDS:
            values = [getattr(d, name) for d in self.datums]
            given = [v is not None for v in values]
            if not any(given):
                if name in ("tokens", "target_tokens"):
                    raise ValueError(f"every datum needs {name}")
                continue
            if not all(given):
                missing = given.index(False)
                raise ValueError(f"{name} is given for some datums but not datum {missing}: "
                                 "a field is given for every datum or for none")
            data, counts = _wire.concat(name, dtype, values)
            self._check_counts(name, counts)
            self.arrays.append((name, dtype, data))

    def _check_counts(self, name: str, counts: List[int]) -> None:
        if name != "routing":
            for index, (count, length) in enumerate(zip(counts, self.lengths)):
                if count != length:
                    raise ValueError(f"datum {index}: {name} has {count} values, tokens {length}")
            return
        per_token = None
        for index, (count, length) in enumerate(zip(counts, self.lengths)):
            if count % length or count == 0:
                raise ValueError(f"datum {index}: routing has {count} values, not a multiple "
                                 f"of its {length} positions")
            if per_token is None:
                per_token = count // length
            elif count // length != per_token:
                raise ValueError(f"datum {index}: routing has {count // length} indices per "
                                 f"position, datum 0 has {per_token}")

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.arrays)

    def encode(self, header: Mapping[str, Any],
               extra: Sequence[Tuple[str, str, Any]] = ()) -> bytes:
        document = {"lengths": self.lengths}
        document.update(header)
        return _wire.encode(document, list(self.arrays) + list(extra))


class _SessionPool:
    """Idle keep-alive connections to one server; a call takes one for itself (HttpSession is
    not thread-safe) and gives it back."""

    def __init__(self, url: str, token: Optional[str], timeout: float, ca_file: Optional[str],
                 cert_file: Optional[str], key_file: Optional[str]):
        self._args = (url, token, timeout, ca_file, cert_file, key_file)
        self._idle: List[HttpSession] = []
        self._lock = threading.Lock()
        self._closed = False
        self.probe = HttpSession(*self._args)  # checks the URL now; also names URLs

    def acquire(self) -> HttpSession:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return HttpSession(*self._args)

    def release(self, session: HttpSession) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(session)
                return
        session.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for session in idle:
            session.close()

    def json(self, method: str, path: str, document: Any = None) -> Dict[str, Any]:
        session = self.acquire()
        try:
            return session.json(method, path, document=document)
        finally:
            self.release(session)


def _token_or_env(token: Optional[str]) -> Optional[str]:
    # Tokens stay off command lines: the environment is the other place for one.
    return token if token is not None else (os.environ.get("FLYWHEEL_TOKEN") or None)


class ServiceClient:
    """The training server as a whole: its info, its sessions, and new sessions.

    ``url``: ``http://host:port`` or ``https://...``; ``token``: a token with the ``train``
    scope (``read`` suffices for :meth:`info`); default ``$FLYWHEEL_TOKEN``. ``timeout``:
    seconds for connecting and every socket operation of a call (a call may wait behind the
    calls before it). ``max_in_flight``: calls of a session sent at once.
    """

    def __init__(self, url: str, token: Optional[str] = None, *, timeout: float = 600.0,
                 ca_file: Optional[str] = None, cert_file: Optional[str] = None,
                 key_file: Optional[str] = None, max_in_flight: int = 8):
        self.url = url
        self._options = dict(token=_token_or_env(token), timeout=timeout, ca_file=ca_file,
                             cert_file=cert_file, key_file=key_file, max_in_flight=max_in_flight)
        self._pool = _SessionPool(url, self._options["token"], timeout, ca_file, cert_file,
                                  key_file)

    def info(self) -> Answer:
        """``GET /v1/train/info``: mode, model config, parameters, lora, version (last
        published), sessions, limits."""
        return Answer(self._pool.json("GET", "/v1/train/info"))

    def create_session(self, name: Optional[str] = None,
                       from_state: Optional[str] = None) -> "TrainingClient":
        """A new session (``POST /v1/train/sessions``) and its client. ``name``: the adapter
        name workers serve a LoRA session under (default: the id); ``from_state``: a path
        :meth:`TrainingClient.save_state` returned (by a session of this token), to start
        from. Raises SessionConflict (full mode, a session is open), NameTaken,
        TooManySessions (this token's or the server's cap of open sessions), NotFound (no
        such state of this token)."""
        return TrainingClient(self.url, name=name, from_state=from_state, **self._options)

    def session(self, session_id: str) -> "TrainingClient":
        """A client of an existing session (e.g. after a restart of this program)."""
        return TrainingClient(self.url, session=session_id, **self._options)

    def delete_session(self, session_id: str) -> None:
        """``DELETE /v1/train/sessions/{id}``; its saved states remain."""
        self._pool.json("DELETE", f"/v1/train/sessions/{session_id}")

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class TrainingClient:
    """One training session.

    ``TrainingClient(url, token)`` creates a session (``name``, ``from_state`` as
    :meth:`ServiceClient.create_session`); ``TrainingClient(url, token, session=ID)``
    attaches to an existing one, numbering its calls after the calls the session has run.

    Every method has an ``*_async`` twin returning a Future; the synchronous one is
    ``*_async(...).result()``. Calls run on the server in the order they were made here,
    from any thread. Arguments are checked (and batches encoded) before a call is
    numbered, so a refused argument raises at once and uses no ``seq``.
    """

    def __init__(self, url: str, token: Optional[str] = None, *, session: Optional[str] = None,
                 name: Optional[str] = None, from_state: Optional[str] = None,
                 timeout: float = 600.0, ca_file: Optional[str] = None,
                 cert_file: Optional[str] = None, key_file: Optional[str] = None,
                 max_in_flight: int = 8):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, not {max_in_flight}")
        self.url = url
        self._pool = _SessionPool(url, _token_or_env(token), timeout, ca_file, cert_file,
                                  key_file)
        self._lock = threading.Lock()
        self._closed = False
        if session is None:
            if name is not None and not isinstance(name, str):
                raise TypeError(f"name must be a string, not {type(name).__name__}")
            request: Dict[str, Any] = {}
            if name is not None:
                request["name"] = name
            if from_state is not None:
                request["from_state"] = from_state
            # Not retried: a create that reached the server but lost its answer would
            # otherwise make a second session (or fail with name_taken).
            session_info = self._opening(lambda: self._pool.json(
                "POST", "/v1/train/sessions", request))
            next_seq = 1
        else:
            if name is not None or from_state is not None:
                raise ValueError("name/from_state are for a new session, not with session=")
            session_info = self._opening(lambda: self._pool.json(
                "GET", f"/v1/train/sessions/{session}"))
            # The session info's next_seq is the seq the server runs next (not in
            # docs/TRAINING_API.md; without it: one after the calls run, right for sessions
            # whose every call carried a seq).
            next_seq = int(session_info.get("next_seq", int(session_info.get("calls", 0)) + 1))
        self.session_info = Answer(session_info)
        self.session_id = str(session_info["id"])
        self.name = str(session_info.get("name", self.session_id))
        self.mode = session_info.get("mode")
        self._next_seq = next_seq  # GUARDED_BY(_lock)
        self._executor = ThreadPoolExecutor(max_workers=max_in_flight,
                                            thread_name_prefix=f"flywheel-{self.session_id}")

    # -----------------------------------------------------------------------------------
    # Plumbing

    def _opening(self, request: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
        """The session's first request; its connections are closed when it fails."""
        try:
            return request()
        except BaseException:
            self._pool.close()
            raise

    def _path(self, call: str) -> str:
        return f"/v1/train/sessions/{self.session_id}/{call}"

    def _submit(self, seqs: int, build: Callable[[int], Any],
                run: Callable[..., Any]) -> Future:
        """Numbers the next ``seqs`` calls, builds the first one's body with its seq (a build
        that raises uses no seq) and runs ``run(first_seq, body)`` on the executor. FIFO:
        a call never waits for a thread behind a later call."""
        with self._lock:
            if self._closed:
                raise FlywheelError(f"training client of session {self.session_id} is closed")
            seq = self._next_seq
            body = build(seq)
            self._next_seq += seqs
            return self._executor.submit(run, seq, body)

    def _post(self, call: str, seq: int, body: bytes, content_type: str) -> bytes:
        """One call: POST, then once more with the same seq if the transport failed (the
        server repeats the answer of a seq it ran). A failure on a kept-alive connection the
        server may have closed while idle is sent again without counting as that retry."""
        path = self._path(call)
        retries, stale_retry, fresh = 1, 1, False
        while True:
            session = self._pool.acquire()
            if fresh:
                session.close()  # after a failure: a new connection, not another idle one
            reused = session.connected
            try:
                status, data = session.request("POST", path, body=body, content_type=content_type)
            except ConnectionFailed as error:
                if reused and stale_retry:
                    stale_retry -= 1
                elif retries:
                    retries -= 1
                else:
                    raise
                _log.info("%s (seq %d): %s; sending it again with the same seq", call, seq, error)
                fresh = True
                continue
            finally:
                self._pool.release(session)
            if not 200 <= status < 300:
                raise api_error(status, data, session.url_of(path))
            return data

    def _post_json(self, call: str, seq: int, body: bytes) -> Answer:
        data = self._post(call, seq, body, "application/json")
        return Answer(_parse_json(data, self._pool.probe.url_of(self._path(call))))

    def _post_batch(self, call: str, seq: int, body: bytes) -> bytes:
        return self._post(call, seq, body, _wire.CONTENT_TYPE)

    def _json_call(self, call: str, document: Mapping[str, Any],
                   parse: Callable[[Answer], Any] = lambda a: a) -> Future:
        fields = dict(document)

        def build(seq: int) -> bytes:
            return json.dumps(dict(fields, seq=seq), allow_nan=False).encode("utf-8")

        return self._submit(1, build, lambda seq, body: parse(self._post_json(call, seq, body)))

    def _fill_gap(self, seq: int) -> None:
        """Sends a harmless ordered call (get_info) with ``seq``, so the calls after it do
        not wait for a seq that would otherwise never come (and fail with seq_timeout)."""
        try:
            self._post_json("get_info", seq, json.dumps({"seq": seq}).encode("utf-8"))
        except FlywheelError as error:
            _log.warning("session %s: seq %d could not be filled (%s); later calls may fail "
                         "with seq_timeout", self.session_id, seq, error)

    # -----------------------------------------------------------------------------------
    # Calls

    def forward_async(self, datums: Sequence[Datum]) -> Future:
        """Future of :meth:`forward`."""
        batch = PreparedBatch(datums)
        return self._submit(1, lambda seq: batch.encode({"seq": seq}),
                            lambda seq, body: self._forward_result(
                                self._post_batch("forward", seq, body), batch.lengths))

    def forward(self, datums: Sequence[Datum]) -> ForwardResult:
        """The policy's logprob of every target (no gradients) and, for MoE models, the
        routing it used."""
        return self.forward_async(datums).result()

    def _forward_result(self, data: bytes, lengths: List[int]) -> ForwardResult:
        header, arrays = _wire.decode(data)
        answered = header.get("lengths", lengths)
        if list(answered) != list(lengths):
            raise _wire.WireError(f"forward answered lengths {answered}, the batch has {lengths}")
        if "logprobs" not in arrays:
            raise _wire.WireError("forward's answer has no 'logprobs' array")
        logprobs = _wire.split("logprobs", arrays["logprobs"], lengths)
        routing = None
        if "routing" in arrays and len(arrays["routing"]):
            routing = _wire.split("routing", arrays["routing"], lengths, per_token=None)
        return ForwardResult(logprobs=logprobs, routing=routing)

    def forward_backward_async(self, datums: Sequence[Datum], loss: str = "ppo",
                               loss_config: Optional[Mapping[str, Any]] = None,
                               **config: Any) -> Future:
        """Future of :meth:`forward_backward`."""
        merged = _loss_config(loss_config, config)
        if not isinstance(loss, str) or not loss:
            raise ValueError(f"loss must be a loss name, not {loss!r}")
        batch = PreparedBatch(datums)
        header = {"loss": loss, "loss_config": merged}
        return self._submit(1, lambda seq: batch.encode(dict(header, seq=seq)),
                            lambda seq, body: _metrics(self._post_json_batch(
                                "forward_backward", seq, body)))

    def forward_backward(self, datums: Sequence[Datum], loss: str = "ppo",
                         loss_config: Optional[Mapping[str, Any]] = None,
                         **config: Any) -> Answer:
        """One forward and backward with a built-in loss; the gradients accumulate until
        :meth:`optim_step`. ``loss``: cross_entropy, importance_sampling, ppo, cispo, dro,
        gspo, dpo. ``loss_config`` (a dict, or keywords): aggregation, norm_length,
        clip_low, clip_high, dual_clip, cispo_low, cispo_high, dro_beta, dpo_beta, kl_coef,
        kl_estimator, tis_cap (each defaulting as the server's ``trainer::LossConfig``).
        Returns the metrics: loss, kl_sampler_k3, clip_fraction, kl_reference,
        tis_truncated, aux_loss, grad_norm, tokens_per_s, sequences, tokens, step."""
        return self.forward_backward_async(datums, loss, loss_config, **config).result()

    def _post_json_batch(self, call: str, seq: int, body: bytes) -> Answer:
        data = self._post_batch(call, seq, body)
        return Answer(_parse_json(data, self._pool.probe.url_of(self._path(call))))

    def forward_backward_custom_async(self, datums: Sequence[Datum], loss_fn: LossFn) -> Future:
        """Future of :meth:`forward_backward_custom` (``loss_fn`` runs on a client thread)."""
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(datums, logprobs) -> (loss, grads)")
        batch = PreparedBatch(datums)

        def run(seq: int, forward_body: bytes) -> Answer:
            # seq: the forward; seq + 1: the custom backward, sent once the loss is known.
            try:
                answer = self._post_batch("forward", seq, forward_body)
            except ApiError:
                self._fill_gap(seq + 1)  # the server ran seq (and refused it)
                raise
            # (A forward lost on the transport leaves seq itself missing: nothing to fill.)
            try:
                result = self._forward_result(answer, batch.lengths)
                loss_value, grads = _call_loss(loss_fn, batch, result)
                extra = [("grads", "f32", _wire.concat("grads", "f32", grads)[0])]
                if result.routing is not None and not batch.has("routing"):
                    # Replay the routing the forward used, so pass 2 routes as pass 1 did.
                    extra.insert(0, ("routing", "i32", _wire.concat("routing", "i32",
                                                                   result.routing)[0]))
                body = batch.encode({"seq": seq + 1, "loss_value": loss_value}, extra)
            except BaseException:
                self._fill_gap(seq + 1)
                raise
            return _metrics(self._post_json_batch("forward_backward_custom", seq + 1, body))

        return self._submit(2, lambda seq: batch.encode({"seq": seq}), run)

    def forward_backward_custom(self, datums: Sequence[Datum], loss_fn: LossFn) -> Answer:
        """A loss written in Python: a ``forward`` for the policy's logprobs, then
        ``loss_fn(datums, logprobs) -> (loss_value, grads)`` here, then the server's second
        pass backpropagates ``sum_t logprob[t] * grads[t]`` (which has the loss's gradient)
        into the accumulated gradients. Two calls, two seqs, one server-side backward.

        ``logprobs``: one array per datum (numpy float32 when numpy is there, else
        ``array('f')``), length T, the current policy's logprob of each target.
        ``loss_value``: a finite float (reported as ``metrics.loss``). ``grads``: one
        sequence per datum, length T: d loss / d logprob[t]. Positions whose grad is 0 are
        skipped by the second pass. The loss should be normalised as the built-in ones are
        (e.g. a token mean); the server then scales as it does for them, so
        :meth:`optim_step` steps the same. :func:`flywheel.rl.ppo_loss_fn` is the built-in
        ppo written this way; :func:`torch_loss_fn` takes a torch loss instead of grads.
        If ``loss_fn`` raises, its exception is raised here and nothing is applied."""
        return self.forward_backward_custom_async(datums, loss_fn).result()

    def optim_step_async(self, lr: Optional[float] = None, *, adam: Optional[Mapping] = None,
                         **params: Any) -> Future:
        """Future of :meth:`optim_step`."""
        document = dict(adam or {})
        if lr is not None:
            document["lr"] = lr
        document.update({k: v for k, v in params.items() if v is not None})
        unknown = sorted(set(document) - set(ADAM_KEYS))
        if unknown:
            raise ValueError(f"unknown AdamW parameter(s) {unknown} (known: {list(ADAM_KEYS)})")
        for key, value in document.items():
            _check_number(f"adam {key}", value)
        return self._json_call("optim_step", {"adam": document}, _metrics)

    def optim_step(self, lr: Optional[float] = None, *, adam: Optional[Mapping] = None,
                   **params: Any) -> Answer:
        """AdamW on the accumulated gradients: ``lr``, ``beta1``, ``beta2``, ``eps``,
        ``weight_decay``, ``grad_clip`` (max global norm; 0 off), each defaulting as the
        server's ``trainer::AdamWParams``. Returns the metrics (``grad_norm``, ``step``)."""
        return self.optim_step_async(lr, adam=adam, **params).result()

    def save_weights_for_sampler_async(self) -> Future:
        return self._json_call("save_weights_for_sampler", {})

    def save_weights_for_sampler(self) -> Answer:
        """Publishes the weights (LoRA: this session's adapter) to the workers as the next
        version. Returns ``version``, ``adapter`` (the name workers serve a LoRA session
        under; None in full mode), ``weights_hash``, ``bytes``, ``delta_bytes``,
        ``keyframe_bytes``. :meth:`SamplingClient.wait_for_version` waits for it."""
        return self.save_weights_for_sampler_async().result()

    def save_state_async(self, name: Optional[str] = None) -> Future:
        return self._json_call("save_state", {} if name is None else {"name": name})

    def save_state(self, name: Optional[str] = None) -> Answer:
        """Saves weights, optimizer moments, step and pending gradients on the server
        (default name ``step-<step>``); returns ``path`` (for :meth:`load_state` or
        ``create_session(from_state=...)``) and ``step``."""
        return self.save_state_async(name).result()

    def load_state_async(self, path: str) -> Future:
        return self._json_call("load_state", {"path": path})

    def load_state(self, path: str) -> Answer:
        """Replaces the session's weights, moments and step with a saved state's; returns
        the session info."""
        return self.load_state_async(path).result()

    def get_info_async(self) -> Future:
        return self._json_call("get_info", {})

    def get_info(self) -> Answer:
        """The session info, ordered among the session's calls (after every earlier one):
        id, name, mode, step, last_version, pending, idle_s, calls, saved_states."""
        return self.get_info_async().result()

    def session_status(self) -> Answer:
        """The session info now (``GET``, not ordered among the calls)."""
        return Answer(self._pool.json("GET", f"/v1/train/sessions/{self.session_id}"))

    def info(self) -> Answer:
        """The server's ``GET /v1/train/info``."""
        return Answer(self._pool.json("GET", "/v1/train/info"))

    def close(self, delete: bool = True) -> None:
        """Waits for the calls in flight, then deletes the session on the server (unless
        ``delete=False``: it then lives until the server's idle timeout, and
        ``TrainingClient(url, token, session=id)`` attaches to it again). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        try:
            if delete:
                self._pool.json("DELETE", f"/v1/train/sessions/{self.session_id}")
        finally:
            self._pool.close()

    def __enter__(self) -> "TrainingClient":
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an error already in flight is the one to see, not the close's
            self.close()
        except FlywheelError as error:
            _log.warning("closing session %s after an error: %s", self.session_id, error)


def _parse_json(data: bytes, url: str) -> Dict[str, Any]:
    try:
        answer = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ConnectionFailed(url, f"answer is not JSON: {data[:200]!r}") from None
    if not isinstance(answer, dict):
        raise ConnectionFailed(url, "answer is not a JSON object")
    return answer


def _metrics(answer: Answer) -> Answer:
    return Answer(answer.get("metrics", answer))


def _check_number(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, not {value!r}")


def _loss_config(loss_config: Optional[Mapping[str, Any]], keywords: Mapping[str, Any]
                 ) -> Dict[str, Any]:
    merged = dict(loss_config or {})
    merged.update(keywords)
    unknown = sorted(set(merged) - set(LOSS_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown loss_config key(s) {unknown} (known: {list(LOSS_CONFIG_KEYS)})")
    for key, value in merged.items():
        if key not in ("aggregation", "kl_estimator"):
            _check_number(f"loss_config {key}", value)
    return merged


def _call_loss(loss_fn: LossFn, batch: PreparedBatch, result: ForwardResult
               ) -> Tuple[float, List[Any]]:
    """Runs the user's loss and checks what it returned (a finite loss, one finite gradient
    of length T per datum)."""
    answer = loss_fn(batch.datums, result.logprobs)
    try:
        loss_value, grads = answer
    except (TypeError, ValueError):
        raise TypeError("loss_fn must return (loss_value, grads)") from None
    loss_value = float(loss_value)
    if not math.isfinite(loss_value):
        raise ValueError(f"loss_fn returned a loss that is not finite: {loss_value}")
    grads = list(grads)
    if len(grads) != len(batch.lengths):
        raise ValueError(f"loss_fn returned {len(grads)} gradients for {len(batch.lengths)} datums")
    checked = []
    for index, (grad, length) in enumerate(zip(grads, batch.lengths)):
        if _np is not None:
            grad = _np.asarray(grad, dtype=_np.float32).reshape(-1)
        if len(grad) != length:
            raise ValueError(f"loss_fn: gradient {index} has {len(grad)} values, the datum {length}")
        if not _wire.finite(grad):
            raise ValueError(f"loss_fn: gradient {index} is not finite")
        checked.append(grad)
    return loss_value, checked


def torch_loss_fn(fn: Callable[[List[Datum], List[Any]], Any], dtype: Any = None) -> LossFn:
    """A :meth:`TrainingClient.forward_backward_custom` loss from a torch one:
    ``fn(datums, logprobs)`` gets one 1-D tensor per datum (requiring grad) and returns a
    scalar tensor; autograd gives the grads. ``dtype``: of the tensors (default float32,
    as the server computes). Needs torch (imported when the loss runs)."""

    def loss_fn(datums: List[Datum], logprobs: List[Any]) -> Tuple[float, List[Any]]:
        import torch  # optional dependency, only for this helper

        tensor_dtype = dtype if dtype is not None else torch.float32
        leaves = [torch.tensor(list(lp) if _np is None else _np.asarray(lp),
                               dtype=tensor_dtype, requires_grad=True) for lp in logprobs]
        loss = fn(datums, leaves)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("the torch loss must return a scalar tensor")
        grads = torch.autograd.grad(loss.reshape(()), leaves, allow_unused=True)
        out = []
        for leaf, grad in zip(leaves, grads):
            grad = torch.zeros_like(leaf) if grad is None else grad
            out.append(grad.detach().to(torch.float32).numpy() if _np is not None
                       else array.array("f", grad.detach().tolist()))
        return float(loss.detach()), out

    return loss_fn
