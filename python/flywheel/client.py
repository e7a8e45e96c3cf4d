"""The client of the publisher's push API (docs/PUSH_API.md).

A push uploads a checkpoint through the resumable upload routes and commits it as a new
version; readiness and ``wait`` tell when the fleet serves it. When a ``flywheel`` binary
is available (``$FLYWHEEL_BIN`` or ``PATH``) and this machine pushed to the same URL
before, the push sends a delta from that cached checkpoint instead of the whole one.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import logging
import math
import os
import shutil
import socket
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _cache
from ._http import HttpSession
from .errors import (ConnectionFailed, DeltaError, InvalidDelta, UnknownBase, VersionConflict,
                     WaitTimeout)
from .safetensors import SINGLE_FILE_NAME, CheckpointFile, checkpoint_files, write_state_dict

_log = logging.getLogger("flywheel")

#: Called after every part with (bytes the server holds, total bytes of the body).
ProgressCallback = Callable[[int, int], None]

DEFAULT_PART_SIZE = 8 << 20
_MAX_WAIT_MS = 60_000  # the server's cap on one long-poll (docs/PUSH_API.md)


class _Body:
    """The upload body: the concatenation of ``files``, read by absolute byte range."""

    def __init__(self, files: Sequence[CheckpointFile], stack: contextlib.ExitStack):
        self.files = list(files)
        self.size = sum(f.size for f in self.files)
        self._handles = [stack.enter_context(open(f.path, "rb")) for f in self.files]

    def read(self, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of the body; raises OSError if a file shrank."""
        chunks = []
        file_start = 0
        for file, handle in zip(self.files, self._handles):
            file_end = file_start + file.size
            if begin < file_end and end > file_start:
                handle.seek(max(begin, file_start) - file_start)
                length = min(end, file_end) - max(begin, file_start)
                chunk = handle.read(length)
                if len(chunk) != length:
                    raise OSError(f"{file.path}: shorter than its {file.size} bytes "
                                  "(modified during the push?)")
                chunks.append(chunk)
            file_start = file_end
        return b"".join(chunks)

    def sha256(self) -> str:
        """Hex SHA-256 of the whole body."""
        digest = hashlib.sha256()
        step = 8 << 20
        for begin in range(0, self.size, step):
            digest.update(self.read(begin, min(begin + step, self.size)))
        return digest.hexdigest()


def _default_client_name() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _check_version(version: Any, minimum: int = 0) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < minimum:
        raise ValueError(f"version must be an int >= {minimum}, not {version!r}")


class Client:
    """A client of one publisher.

    ``url``: the publisher's HTTP address (``http://host:port`` or ``https://...``).
    ``token``: the bearer token (the push token for pushes and pins; either token for
    reads). ``timeout``: seconds for connecting and for every socket operation.
    ``ca_file``: CA bundle to verify an https server with (default: the system's).
    ``cert_file``/``key_file``: a client certificate for a publisher that requires one
    (started with ``--tls-ca``).
    ``client_name``: recorded in the ledger as who pushed (default ``user@host``).
    ``part_size``: bytes per upload part. ``retries``: consecutive transport failures an
    upload survives (each followed by a state request and only the missing bytes).
    ``commit_timeout``: seconds the commit (validation and publication) may take.

    Errors: server answers raise :class:`~flywheel.errors.ApiError` subclasses, transport
    failures :class:`~flywheel.errors.ConnectionFailed`. Not thread-safe.
    """

    def __init__(self, url: str, token: Optional[str] = None, *, timeout: float = 60,
                 ca_file: Optional[str] = None, cert_file: Optional[str] = None,
                 key_file: Optional[str] = None, client_name: Optional[str] = None,
                 part_size: int = DEFAULT_PART_SIZE, retries: int = 5,
                 commit_timeout: float = 600):
        if part_size <= 0:
            raise ValueError(f"part_size must be positive, not {part_size}")
        self.url = url
        self.client_name = client_name or _default_client_name()
        self.part_size = part_size
        self.retries = retries
        self.commit_timeout = commit_timeout
        if token is None:
            # Tokens stay off command lines: the environment is the other place for one.
            token = os.environ.get("FLYWHEEL_TOKEN") or None
        self._session = HttpSession(url, token, timeout, ca_file, cert_file, key_file)

    def close(self) -> None:
        """Closes the connection."""
        self._session.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -----------------------------------------------------------------------------------
    # Reads

    def versions(self) -> Dict[str, Any]:
        """``GET /v1/versions``: ``{"head_version", "pin", "versions": [rows, oldest first]}``."""
        return self._session.json("GET", "/v1/versions")

    def version(self, version: int) -> Dict[str, Any]:
        """``GET /v1/versions/{v}``: one ledger row; NotFound when unknown."""
        _check_version(version)
        return self._session.json("GET", f"/v1/versions/{version}")

    def readiness(self, version: Optional[int] = None) -> Dict[str, Any]:
        """``GET /v1/readiness``: how many workers serve ``version`` (default: the head)."""
        if version is not None:
            _check_version(version)
        return self._session.json("GET", "/v1/readiness", query={"version": version})

    def status(self) -> Dict[str, Any]:
        """``GET /v1/status``: the publisher's status document."""
        return self._session.json("GET", "/v1/status")

    def wait_serving(self, version: int, fraction: float = 1.0, timeout: float = 60.0,
                     min_workers: int = 1) -> Dict[str, Any]:
        """Blocks until at least ``max(min_workers, ceil(fraction x workers))`` workers
        serve ``version`` or later, and returns that readiness document (with
        ``"ready": true``).

        Uses the ``GET /v1/wait`` long-poll, issued again until ``timeout`` seconds have
        passed in all (each request waits on the server; nothing polls in a loop). Raises
        :class:`~flywheel.errors.WaitTimeout` (a ``TimeoutError``) carrying the last
        readiness when the fleet is not there in time.
        """
        _check_version(version)
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], not {fraction}")
        deadline = time.monotonic() + max(0.0, timeout)
        last: Optional[Dict[str, Any]] = None
        while True:
            started = time.monotonic()
            remaining = deadline - started
            if remaining <= 0 and last is not None:
                break
            wait_ms = min(_MAX_WAIT_MS, max(0, int(remaining * 1000)))
            last = self._session.json(
                "GET", "/v1/wait",
                query={"version": version, "fraction": repr(float(fraction)),
                       "timeout_ms": wait_ms, "min_workers": min_workers},
                timeout=wait_ms / 1000 + self._session.timeout)
            if last.get("ready"):
                return last
            # A not-ready answer before the wait elapsed should not happen; never spin on it.
            elapsed = time.monotonic() - started
            if elapsed < 0.25 and deadline - time.monotonic() > 0:
                time.sleep(min(0.25 - elapsed, max(0.0, deadline - time.monotonic())))
        needed = max(min_workers, math.ceil(fraction * (last.get("workers") or 0)))
        raise WaitTimeout(
            f"version {version} not served by {needed} worker(s) within {timeout:g} s "
            f"({self.url}): {last.get('serving')} of {last.get('workers')} serve it, "
            f"head v{last.get('head_version')}", last)

    # -----------------------------------------------------------------------------------
    # Rollback

    def pin(self, version: int, metadata: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
        """``POST /v1/pin``: republishes ``version``'s weights as a new version and holds the
        fleet there; returns the new ledger row. NotFound / UnknownBase when it cannot."""
        _check_version(version)
        return self._session.json("POST", "/v1/pin",
                                  document={"version": version, "metadata": dict(metadata or {})},
                                  timeout=self.commit_timeout, fresh_connection=True)

    def unpin(self) -> Dict[str, Any]:
        """``POST /v1/unpin``: follows pushes and drops again; ``{"pin": null, "head_version"}``."""
        return self._session.json("POST", "/v1/unpin", document={}, fresh_connection=True)

    # -----------------------------------------------------------------------------------
    # Push

    def push(self, checkpoint: Union[str, "os.PathLike[str]", Mapping[str, Any]],
             version: Optional[int] = None, metadata: Optional[Mapping[str, Any]] = None, *,
             wait: Optional[float] = None, progress: Optional[ProgressCallback] = None,
             wait_timeout: float = 60.0, delta: bool = True) -> Dict[str, Any]:
        """Publishes a checkpoint as a new version and returns its ledger row.

        ``checkpoint``: a ``.safetensors`` file, a directory with ``model.safetensors`` or
        shards plus ``model.safetensors.index.json``, or a state_dict (a mapping of name to
        ``torch.Tensor`` / ``numpy.ndarray``), written as BF16 safetensors with its names.
        ``version``: the version number, above the head; None publishes as head + 1.
        ``metadata``: a JSON object recorded in the ledger.
        ``wait``: a fraction of the workers; when given, returns only once that fraction
        serves the new version (:meth:`wait_serving` with ``wait_timeout``).
        ``progress(sent, total)``: called after every part.
        ``delta``: False always uploads the whole checkpoint.

        With a ``flywheel`` binary and a cached copy of the last checkpoint pushed to this
        URL, the upload is a delta from it (``flywheel delta encode``); when the publisher
        can no longer rebuild that base (``unknown_base``), the delta does not validate, or
        encoding fails, the whole checkpoint is uploaded instead. After a successful push
        the cache holds this checkpoint (only while a binary is available).
        """
        if version is not None:
            _check_version(version, minimum=1)
        if wait is not None and not 0 < wait <= 1:
            raise ValueError(f"wait must be a fraction in (0, 1], not {wait}")
        binary = _cache.find_flywheel_binary() if delta else None
        cache = _cache.PushCache(self.url) if binary else None
        with contextlib.ExitStack() as stack:
            if cache is not None:
                stack.enter_context(cache.locked())
            staging = cache.new_staging() if cache is not None else None
            if staging is not None:
                stack.callback(shutil.rmtree, staging, True)  # a no-op once installed
            files, target = self._checkpoint_source(checkpoint, staging, stack)
            row = None
            if cache is not None:
                row = self._push_delta(cache, binary, files, target, version, metadata, progress)
            if row is None:
                row = self._upload("full", files, "next" if version is None else version,
                                   metadata, progress)
            if cache is not None:
                try:
                    cache.install(staging, files, int(row["version"]),
                                  str(row.get("weights_hash", "")))
                except OSError as error:
                    _log.warning("push cache %s not updated (%s): the next push is full",
                                 cache.path, error)
        if wait is not None:
            self.wait_serving(int(row["version"]), fraction=wait, timeout=wait_timeout)
        return row

    def _checkpoint_source(self, checkpoint: Any, staging: Optional[str],
                           stack: contextlib.ExitStack) -> Tuple[List[CheckpointFile], str]:
        """The files to upload and the path ``flywheel delta encode`` takes as target."""
        if isinstance(checkpoint, (str, os.PathLike)):
            path = os.fspath(checkpoint)
            return checkpoint_files(path), path
        if isinstance(checkpoint, Mapping):
            directory = staging
            if directory is None:
                directory = tempfile.mkdtemp(prefix="flywheel-push-")
                stack.callback(shutil.rmtree, directory, True)
            path = os.path.join(directory, SINGLE_FILE_NAME)
            write_state_dict(checkpoint, path, metadata={"format": "pt"})
            return checkpoint_files(path), path
        raise TypeError(f"checkpoint must be a path or a state_dict mapping, "
                        f"not {type(checkpoint).__name__}")

    def _push_delta(self, cache: _cache.PushCache, binary: str, files: List[CheckpointFile],
                    target: str, version: Optional[int], metadata: Optional[Mapping[str, Any]],
                    progress: Optional[ProgressCallback]) -> Optional[Dict[str, Any]]:
        """Uploads a delta from the cached checkpoint; None when a full upload must be done
        instead (no usable cache, encoding failed, or the publisher refused the base)."""
        last = cache.last()
        if last is None:
            return None
        base_version = last["version"]
        # The delta records its target version, so "next" is resolved here.
        target_version = version if version is not None else \
            int(self.versions()["head_version"]) + 1
        if target_version <= base_version:
            return None  # the full upload reports the conflict
        delta_path = cache.temp_file(".fwd")
        try:
            try:
                _cache.encode_delta(binary, cache.checkpoint(), target, delta_path,
                                    base_version, target_version)
            except DeltaError as error:
                _log.warning("delta encoding failed, pushing the full checkpoint: %s", error)
                return None
            delta_size = os.path.getsize(delta_path)
            if delta_size >= sum(f.size for f in files):
                _log.info("delta (%d bytes) is not smaller than the checkpoint: pushing it whole",
                          delta_size)
                return None
            delta_file = CheckpointFile("delta", delta_path, delta_size)
            try:
                return self._upload("delta", [delta_file], target_version, metadata, progress,
                                    base_version=base_version)
            except UnknownBase as error:
                _log.info("publisher cannot rebuild v%d (%s): pushing the full checkpoint",
                          base_version, error.message)
            except InvalidDelta as error:
                _log.warning("publisher rejected the delta from cached v%d (%s): pushing the "
                             "full checkpoint", base_version, error.message)
            except VersionConflict:
                if version is not None:
                    raise
                _log.info("another push took v%d: pushing the full checkpoint as the next",
                          target_version)
            return None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(delta_path)

    def _upload(self, kind: str, files: List[CheckpointFile], version: Union[int, str],
                metadata: Optional[Mapping[str, Any]], progress: Optional[ProgressCallback],
                base_version: Optional[int] = None) -> Dict[str, Any]:
        """Creates an upload, sends the body in parts (resuming after transport failures),
        commits it and returns the ledger row. The upload is aborted if anything but the
        commit fails."""
        with contextlib.ExitStack() as stack:
            body = _Body(files, stack)
            request: Dict[str, Any] = {
                "version": version, "kind": kind, "size": body.size,
                "digest": {"algorithm": "sha256", "value": body.sha256()},
                "metadata": dict(metadata or {}), "client": self.client_name}
            if kind == "full":
                request["files"] = [{"name": f.name, "size": f.size} for f in files]
            else:
                request["base_version"] = base_version
            state = self._session.json("POST", "/v1/uploads", document=request,
                                       fresh_connection=True)
            upload_id = str(state["id"])
            try:
                self._send(upload_id, body, state.get("missing", [[0, body.size]]), progress)
            except BaseException:
                self._abort(upload_id)
                raise
            return self._commit(upload_id)

    def _send(self, upload_id: str, body: _Body, missing: List[List[int]],
              progress: Optional[ProgressCallback]) -> None:
        """Sends the ``missing`` ranges in parts of at most ``part_size``. After a transport
        failure it asks for the upload's state and sends only what is still missing; gives
        up after ``retries`` consecutive failures."""
        pending = [(int(begin), int(end)) for begin, end in missing if end > begin]
        path = f"/v1/uploads/{upload_id}"
        failures = 0
        need_state = False
        while pending or need_state:
            try:
                if need_state:
                    state = self._session.json("GET", path)
                    pending = [(int(b), int(e)) for b, e in state.get("missing", []) if e > b]
                    need_state = False
                    continue
                begin, end = pending[0]
                part_end = min(end, begin + self.part_size)
                state = self._session.json("PUT", path, query={"offset": begin},
                                           body=body.read(begin, part_end))
                failures = 0
                pending[0] = (part_end, end)
                if part_end == end:
                    pending.pop(0)
                if progress is not None:
                    received = state.get("received_bytes")
                    if not isinstance(received, int):
                        received = body.size - sum(e - b for b, e in pending)
                    progress(received, body.size)
            except ConnectionFailed as error:
                failures += 1
                if failures > self.retries:
                    raise ConnectionFailed(
                        self._session.url_of(path),
                        f"upload gave up after {failures} failed attempts in a row: "
                        f"{error.reason}") from error
                _log.info("upload %s: %s; resuming (attempt %d of %d)", upload_id, error,
                          failures, self.retries)
                time.sleep(min(5.0, 0.2 * 2 ** (failures - 1)))
                need_state = True

    def _commit(self, upload_id: str) -> Dict[str, Any]:
        """Commits; on any error answer the server has removed the upload."""
        path = f"/v1/uploads/{upload_id}/commit"
        try:
            return self._session.json("POST", path, document={}, timeout=self.commit_timeout,
                                      fresh_connection=True)
        except ConnectionFailed as error:
            raise ConnectionFailed(
                error.url, f"{error.reason}; the commit's outcome is unknown: "
                "see Client.versions()") from error

    def _abort(self, upload_id: str) -> None:
        """Best effort ``DELETE``: the publisher also expires abandoned uploads."""
        with contextlib.suppress(Exception):
            self._session.request("DELETE", f"/v1/uploads/{upload_id}",
                                  timeout=min(5.0, self._session.timeout))
