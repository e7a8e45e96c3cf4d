"""In-process fakes of the training service (docs/TRAINING_API.md) and of a rollout
worker's completions API (rollout/openai_api.h), for the Python client's tests.

FakeTrainer keeps the contract's session and ordering rules (calls run in ``seq`` order, a
repeated seq gets the kept answer, an old one ``seq_replayed``, a gap ``seq_timeout``
after ``seq_wait`` seconds, full mode has one session) and answers with simple
deterministic numbers: forward's logprob of target y is ``-0.01 * (y + 1)``;
forward_backward's loss is the sum of the batch's advantages (0 without); the custom one's
is its ``loss_value``. It records every call in the order it ran.

Fault seams: ``drop_answer`` (a set of seqs): the first request with that seq runs, then
its connection is closed without an answer; ``delay`` (call -> seconds): sleep before
running a call; ``fail_call`` (call -> (status, code, message)): answer that error.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

from flywheel import _wire

LOSSES = {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "dpo"}
LOSS_KEYS = {"aggregation", "norm_length", "clip_low", "clip_high", "dual_clip", "cispo_low",
             "cispo_high", "dro_beta", "dpo_beta", "kl_coef", "kl_estimator", "tis_cap"}


class Failure(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class Session:
    id: str
    name: str
    next_seq: int = 1
    answers: Dict[int, Tuple[int, str, bytes]] = field(default_factory=dict)
    step: int = 0
    calls: int = 0
    saved: List[str] = field(default_factory=list)
    pending: int = 0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Fake:
    """What both fakes share: serving a handler class on a loopback port of its own."""

    _server: Optional[_Server] = None

    def _serve(self, handler: type) -> Any:
        self._server = _Server(("127.0.0.1", 0), handler)
        threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"


class FakeTrainer(_Fake):
    def __init__(self, mode: str = "full", seq_wait: float = 5.0):
        self.mode = mode
        self.seq_wait = seq_wait
        self.sessions: Dict[str, Session] = {}
        self.ran: List[Tuple[str, Optional[int], str]] = []  # (session, seq, call) in run order
        self.bodies: List[Tuple[str, Dict[str, Any]]] = []  # (call, decoded header or JSON)
        self.grads: List[List[float]] = []
        self.drop_answer: set = set()
        self.delay: Dict[str, float] = {}
        self.fail_call: Dict[str, Tuple[int, str, str]] = {}
        self.version = 0
        self.max_sessions_per_token = 8  # the real server's default (one token here)
        self.lock = threading.Condition()
        self._ids = 0
        self._server: Optional[_Server] = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "FakeTrainer":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_POST(self) -> None:
                fake._handle(self, "POST")

            def do_DELETE(self) -> None:
                fake._handle(self, "DELETE")

        return self._serve(Handler)

    # -- HTTP --------------------------------------------------------------------------
    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        try:
            status, content_type, answer = self._route(method, handler.path, body,
                                                        handler.headers.get("Content-Type", ""))
        except Failure as failure:
            status, content_type = failure.status, "application/json"
            answer = json.dumps({"error": {"code": failure.code,
                                           "message": failure.message}}).encode()
        except _Drop:
            handler.close_connection = True
            return
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(answer)))
        handler.end_headers()
        handler.wfile.write(answer)

    def _route(self, method: str, path: str, body: bytes, content_type: str
               ) -> Tuple[int, str, bytes]:
        if method == "GET" and path == "/v1/train/info":
            return self._json(200, {"mode": self.mode, "model": {"vocab_size": 15},
                                    "version": self.version,
                                    "sessions": sorted(self.sessions)})
        if method == "POST" and path == "/v1/train/sessions":
            return self._create(json.loads(body or b"{}"))
        match = re.fullmatch(r"/v1/train/sessions/([^/]+)(?:/([a-z_]+))?", path)
        if not match:
            raise Failure(404, "not_found", f"no route {method} {path}")
        session_id, call = match.groups()
        with self.lock:
            session = self.sessions.get(session_id)
        if session is None:
            raise Failure(404, "not_found", f"unknown or expired session '{session_id}'")
        if call is None:
            if method == "DELETE":
                with self.lock:
                    del self.sessions[session_id]
                return self._json(200, {})
            return self._json(200, self._info(session))
        return self._ordered(session, call, body, content_type)

    def _create(self, request: Dict[str, Any]) -> Tuple[int, str, bytes]:
        with self.lock:
            if self.mode == "full" and self.sessions:
                raise Failure(409, "session_conflict",
                              f"full mode: session '{next(iter(self.sessions))}' owns the weights")
            if len(self.sessions) >= self.max_sessions_per_token:
                raise Failure(409, "too_many_sessions",
                              f"this token already has {len(self.sessions)} open sessions, the "
                              f"most --max-sessions-per-token ({self.max_sessions_per_token}) "
                              "allows")
            self._ids += 1
            session_id = f"s{self._ids}"
            name = request.get("name") or session_id
            if any(s.name == name for s in self.sessions.values()):
                raise Failure(409, "name_taken", f"session name '{name}' is in use")
            session = Session(session_id, name)
            self.sessions[session_id] = session
        return self._json(201, self._info(session))

    def _info(self, session: Session) -> Dict[str, Any]:
        return {"id": session.id, "name": session.name, "mode": self.mode, "step": session.step,
                "last_version": self.version, "calls": session.calls,
                "pending": {"sequences": session.pending, "tokens": 0}, "idle_s": 0.0,
                "saved_states": list(session.saved)}

    def _ordered(self, session: Session, call: str, body: bytes, content_type: str
                 ) -> Tuple[int, str, bytes]:
        binary = content_type == _wire.CONTENT_TYPE
        if binary:
            try:
                header, arrays = _wire.decode(body)
            except _wire.WireError as error:
                raise Failure(400, "bad_request", str(error))
        else:
            header, arrays = json.loads(body or b"{}"), {}
        seq = header.get("seq")
        with self.lock:
            if seq is not None:
                if seq < session.next_seq:
                    if seq in session.answers:
                        return session.answers[seq]
                    raise Failure(409, "seq_replayed", f"seq {seq} ran too long ago")
                deadline = time.monotonic() + self.seq_wait
                while session.next_seq != seq:
                    if not self.lock.wait(max(0.0, deadline - time.monotonic())):
                        raise Failure(408, "seq_timeout",
                                      f"seq {session.next_seq} never arrived (seq {seq} waited)")
            self.bodies.append((call, {k: v for k, v in header.items() if k != "arrays"}))
            time.sleep(self.delay.get(call, 0.0))
            try:
                answer = self._run(session, call, header, arrays)
            except Failure as failure:
                answer = (failure.status, "application/json",
                          json.dumps({"error": {"code": failure.code,
                                                "message": failure.message}}).encode())
            self.ran.append((session.id, seq, call))
            session.calls += 1
            if seq is not None:
                session.answers[seq] = answer
                session.next_seq = seq + 1
                self.lock.notify_all()
                if seq in self.drop_answer:
                    self.drop_answer.discard(seq)
                    raise _Drop()
        return answer

    def _run(self, session: Session, call: str, header: Dict[str, Any],
             arrays: Dict[str, Any]) -> Tuple[int, str, bytes]:
        if call in self.fail_call:
            status, code, message = self.fail_call[call]
            raise Failure(status, code, message)
        if call == "forward":
            lengths = header["lengths"]
            targets = [int(t) for t in arrays["target_tokens"]]
            logprobs = [-0.01 * (t + 1) for t in targets]
            answer = _wire.encode({"lengths": lengths}, [("logprobs", "f32", logprobs)])
            return 200, _wire.CONTENT_TYPE, answer
        if call == "forward_backward":
            if header.get("loss") not in LOSSES:
                raise Failure(400, "bad_request", f"unknown loss '{header.get('loss')}'")
            unknown = set(header.get("loss_config", {})) - LOSS_KEYS
            if unknown:
                raise Failure(400, "bad_request", f"unknown loss_config key '{sorted(unknown)[0]}'")
            session.pending += len(header["lengths"])
            loss = float(sum(arrays["advantages"])) if "advantages" in arrays else 0.0
            return self._metrics(session, loss, len(header["lengths"]))
        if call == "forward_backward_custom":
            self.grads.append([float(g) for g in arrays["grads"]])
            session.pending += len(header["lengths"])
            return self._metrics(session, float(header["loss_value"]), len(header["lengths"]))
        if call == "optim_step":
            session.step += 1
            session.pending = 0
            return self._metrics(session, 0.0, 0, grad_norm=1.5)
        if call == "save_weights_for_sampler":
            self.version += 1
            return self._json(200, {"version": self.version,
                                    "adapter": session.name if self.mode == "lora" else None,
                                    "weights_hash": f"{session.step:032x}", "bytes": 100,
                                    "delta_bytes": 10, "keyframe_bytes": 0})
        if call == "save_state":
            path = f"sessions/{session.id}/{header.get('name') or f'step-{session.step}'}"
            session.saved.append(path)
            return self._json(200, {"path": path, "step": session.step})
        if call == "load_state":
            if header.get("path") not in session.saved:
                raise Failure(404, "not_found", f"no saved state '{header.get('path')}'")
            return self._json(200, self._info(session))
        if call == "get_info":
            return self._json(200, self._info(session))
        raise Failure(404, "not_found", f"unknown call '{call}'")

    def _metrics(self, session: Session, loss: float, sequences: int,
                 grad_norm: float = 0.0) -> Tuple[int, str, bytes]:
        return self._json(200, {"metrics": {
            "loss": loss, "kl_sampler_k3": 0.0, "clip_fraction": 0.0, "kl_reference": 0.0,
            "tis_truncated": 0.0, "aux_loss": 0.0, "grad_norm": grad_norm, "tokens_per_s": 0.0,
            "sequences": sequences, "tokens": 0, "step": session.step}})

    @staticmethod
    def _json(status: int, document: Any) -> Tuple[int, str, bytes]:
        return status, "application/json", json.dumps(document).encode()


class _Drop(Exception):
    """Close the connection without an answer (after the call ran)."""


class FakeWorker(_Fake):
    """``POST /v1/completions`` with a token-id prompt: choice i generates the prompt's
    tokens reversed, then ``eos``; every token's logprob is -0.5 and its version the
    worker's ``version``. ``GET /v1/status`` and ``GET /v1/models`` (with ``adapters``).
    ``requests`` records every completions request body."""

    def __init__(self, version: int = 1, eos: int = 14, adapters: Tuple[str, ...] = ()):
        self.version = version
        self.eos = eos
        self.adapters = list(adapters)
        self.requests: List[Dict[str, Any]] = []
        self.fail_with: Optional[Tuple[int, Dict[str, Any]]] = None
        self._server: Optional[_Server] = None

    def start(self) -> "FakeWorker":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, status: int, document: Any) -> None:
                data = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/status":
                    self.reply(200, {"role": "worker", "version": fake.version})
                elif self.path == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": "flywheel"}] + [
                        {"id": a, "parent": "flywheel"} for a in fake.adapters]})
                else:
                    self.reply(404, {"error": {"message": "no route", "type": "not_found"}})

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(request)
                if fake.fail_with is not None:
                    self.reply(*fake.fail_with)
                    return
                if request.get("adapter") and request["adapter"] not in fake.adapters:
                    self.reply(404, {"error": {"message": f"unknown adapter '{request['adapter']}'",
                                               "type": "invalid_request_error"}})
                    return
                tokens = list(reversed(request["prompt"]))[:request["max_tokens"] - 1] + [fake.eos]
                choices = []
                for i in range(request.get("n", 1)):
                    choice = {"index": i, "text": "", "finish_reason": "stop",
                              "token_ids": tokens, "policy_versions": [fake.version] * len(tokens),
                              "logprobs": ({"tokens": [], "token_logprobs": [-0.5] * len(tokens),
                                            "top_logprobs": None}
                                           if request.get("logprobs") else None)}
                    if request.get("return_routing"):
                        rows = len(request["prompt"]) + len(tokens) - 1
                        choice["routing"] = [1, 0, 2, 1] * rows  # 2 bytes per index, top-2
                        choice["routing_shape"] = [rows, 1, 2]
                        choice["routing_bytes_per_index"] = 2
                    choices.append(choice)
                self.reply(200, {"id": "cmpl-1", "object": "text_completion",
                                 "model": request.get("adapter") or "flywheel",
                                 "choices": choices})

        return self._serve(Handler)
