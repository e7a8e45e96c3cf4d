"""The exceptions of the flywheel client.

Every error answer of flywheel's APIs (the publisher, the training service, the HTTP
servers' own 401/403/404/405/413) is JSON, ``{"error": {"code", "message", ...}}``, with
the status of one Status -> HTTP table (docs/ARCHITECTURE.md, "The HTTP API kit";
docs/PUSH_API.md and docs/TRAINING_API.md, "Errors"). :func:`api_error` turns one into the
:class:`ApiError` subclass registered for its ``code`` (falling back on the HTTP status),
carrying the status, code, message and every extra field (``head_version``,
``held_versions``, ``pin``, ``missing``) in :attr:`ApiError.details`. The rollout workers'
OpenAI-style errors, ``{"error": {"message", "type", "param", "code"}}``, carry the same
codes; where an OpenAI-style server sends none (null), the ``type`` stands in for it.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional


class FlywheelError(Exception):
    """Base of every exception this package raises on purpose."""


class ConnectionFailed(FlywheelError, ConnectionError):
    """The server could not be reached or the connection broke; the message names the URL."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"cannot reach {url}: {reason}")
        self.url = url
        self.reason = reason


class DeltaError(FlywheelError):
    """``flywheel delta encode`` failed (the client then falls back to a full upload)."""


class WaitTimeout(FlywheelError, TimeoutError):
    """The fleet did not serve a version in time; :attr:`readiness` is the last answer."""

    def __init__(self, message: str, readiness: Optional[Dict[str, Any]]):
        super().__init__(message)
        self.readiness = readiness


class StaleSample(FlywheelError):
    """No worker answered with samples of at least ``min_version`` in time; ``versions`` maps
    each worker URL to the version it last reported (None: unknown)."""

    def __init__(self, message: str, min_version: int, versions: Dict[str, Optional[int]]):
        super().__init__(message)
        self.min_version = min_version
        self.versions = dict(versions)


class ApiError(FlywheelError):
    """An error answer of the server.

    Attributes: ``status`` (HTTP status), ``code`` (the stable error code, e.g.
    ``"version_conflict"``), ``message`` (the server's text), ``details`` (the other fields
    of the error object) and ``url`` (the request that failed).
    """

    def __init__(self, status: int, code: str, message: str,
                 details: Optional[Dict[str, Any]] = None, url: str = ""):
        super().__init__(f"{status} {code}: {message}" + (f" ({url})" if url else ""))
        self.status = status
        self.code = code
        self.message = message
        self.details = dict(details or {})
        self.url = url


class BadRequest(ApiError):
    """400 ``bad_request``: malformed JSON, a missing field, an offset outside the size."""


class Unauthorized(ApiError):
    """401 ``unauthorized``: the bearer token is missing or unknown."""


class Forbidden(ApiError):
    """403 ``forbidden``: a read token on a push route."""


class PushDisabled(Forbidden):
    """403 ``push_disabled``: the publisher has no push token configured."""


class NotFound(ApiError):
    """404 ``not_found``: unknown upload id or version."""


class VersionConflict(ApiError):
    """409 ``version_conflict``: the version is not above the head."""

    @property
    def head_version(self) -> Optional[int]:
        return self.details.get("head_version")


class UnknownBase(ApiError):
    """409 ``unknown_base``: the publisher cannot rebuild the delta's (or pin's) base."""

    @property
    def held_versions(self) -> List[int]:
        return list(self.details.get("held_versions") or [])


class Pinned(ApiError):
    """409 ``pinned``: commits are refused while the fleet is pinned."""

    @property
    def pin(self) -> Optional[Dict[str, Any]]:
        return self.details.get("pin")


class Expired(ApiError):
    """410 ``upload_expired``: the upload was abandoned too long and removed."""


class TooLarge(ApiError):
    """413 ``too_large``: the declared size or a part is above the publisher's limits."""


class Incomplete(ApiError):
    """422 ``incomplete``: commit while bytes are missing."""

    @property
    def missing(self) -> List[List[int]]:
        return [list(r) for r in self.details.get("missing") or []]


class BodyHashMismatch(ApiError):
    """422 ``body_hash_mismatch``: the received body does not hash to the digest."""


class InvalidCheckpoint(ApiError):
    """422 ``invalid_checkpoint``: the safetensors files do not validate."""


class InvalidDelta(ApiError):
    """422 ``invalid_delta``: the delta does not validate or apply to its base."""


class InsufficientStorage(ApiError):
    """507 ``insufficient_storage``: the publisher's staging disk is full."""


class SeqTimeout(ApiError):
    """408 ``seq_timeout``: a training call waited for an earlier ``seq`` that never came."""


class SessionConflict(ApiError):
    """409 ``session_conflict``: a full-mode training server already has a session."""


class SeqReplayed(ApiError):
    """409 ``seq_replayed``: a training call's ``seq`` ran too long ago to repeat its answer."""


class NameTaken(ApiError):
    """409 ``name_taken``: another training session has that name."""


class TooManySessions(ApiError):
    """409 ``too_many_sessions``: this token (``--max-sessions-per-token``) or the training
    server (``--max-sessions``) already holds as many open sessions as it may; close one."""


class MethodNotAllowed(ApiError):
    """405 ``method_not_allowed``: the route does not take this method."""


class Conflict(ApiError):
    """409 ``conflict``: well-formed, but does not fit the server's state (another base,
    other shapes, a stale version)."""


class InvalidContent(ApiError):
    """422 ``invalid_content``: the sent bytes violate their format (a checksum, a
    structure); sending them again will not help."""


class InternalError(ApiError):
    """500 ``internal``: the server failed (the message says how)."""


class Unavailable(ApiError):
    """503 ``unavailable``: the server is stopping (or not serving yet)."""


_BY_CODE = {
    "bad_request": BadRequest,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "push_disabled": PushDisabled,
    "not_found": NotFound,
    "version_conflict": VersionConflict,
    "unknown_base": UnknownBase,
    "pinned": Pinned,
    "upload_expired": Expired,
    "too_large": TooLarge,
    "incomplete": Incomplete,
    "body_hash_mismatch": BodyHashMismatch,
    "invalid_checkpoint": InvalidCheckpoint,
    "invalid_delta": InvalidDelta,
    "insufficient_storage": InsufficientStorage,
    "seq_timeout": SeqTimeout,
    "session_conflict": SessionConflict,
    "seq_replayed": SeqReplayed,
    "name_taken": NameTaken,
    "too_many_sessions": TooManySessions,
    "method_not_allowed": MethodNotAllowed,
    "conflict": Conflict,
    "invalid_content": InvalidContent,
    "internal": InternalError,
    "io_error": InternalError,
    "unavailable": Unavailable,
}

_BY_STATUS = {400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound,
              405: MethodNotAllowed, 409: Conflict, 410: Expired, 413: TooLarge,
              422: InvalidContent, 500: InternalError, 503: Unavailable,
              507: InsufficientStorage}


def api_error(status: int, body: bytes, url: str) -> ApiError:
    """The exception for an error answer: by ``code`` when the body is the JSON error
    document, else by HTTP status with the body's start as the message."""
    code, message, details = f"http_{status}", "", {}
    try:
        document = json.loads(body.decode("utf-8"))
        error = document["error"]
        # OpenAI-style errors may carry a null code; their "type" stands in for it then.
        code = str(error.get("code") or error["type"])
        message = str(error.get("message", ""))
        details = {k: v for k, v in error.items() if k not in ("code", "message")}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        message = body[:500].decode("utf-8", "replace").strip() or "(empty body)"
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status, ApiError)
    return cls(status, code, message, details, url)
