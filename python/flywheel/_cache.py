"""The local push cache (the base of the next local delta) and the ``flywheel`` binary.

Layout, shared with the C++ ``flywheel push``::

    <root>/<key>/model.safetensors            a one-file checkpoint, or
    <root>/<key>/checkpoint/                  a sharded one (shards + model.safetensors.index.json)
    <root>/<key>/last.json                    {"url", "version", "weights_hash"}

``<root>`` is ``$FLYWHEEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/flywheel/push``, else
``~/.cache/flywheel/push``; ``<key>`` is the first 16 hex digits of the SHA-256 of the
publisher URL exactly as given (``last.json`` records it so). ``<key>`` is replaced as a
whole by this client: the new copy is
staged in ``<root>/<key>.staging-*`` (``last.json`` written last) and renamed into place;
a crash leaves either the old copy, the new one or none (the next push is then full).
Processes pushing to the same URL serialise on ``<root>/<key>.lock``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from typing import Any, Dict, Iterator, List, Optional

from .errors import DeltaError
from .safetensors import INDEX_FILE_NAME, SINGLE_FILE_NAME, CheckpointFile

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock
    fcntl = None  # type: ignore[assignment]

_log = logging.getLogger("flywheel")

LAST_FILE_NAME = "last.json"
SHARDED_DIR_NAME = "checkpoint"


def cache_root() -> str:
    """The cache root directory from the environment (not created here)."""
    if os.environ.get("FLYWHEEL_CACHE_DIR"):
        return os.environ["FLYWHEEL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flywheel", "push")


def cache_key(url: str) -> str:
    """First 16 hex digits of SHA-256 of the URL as given."""
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]


def find_flywheel_binary() -> Optional[str]:
    """``$FLYWHEEL_BIN`` when set (it must be executable), else ``flywheel`` on ``PATH``."""
    explicit = os.environ.get("FLYWHEEL_BIN")
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        _log.warning("FLYWHEEL_BIN=%s is not an executable file: pushing full checkpoints",
                     explicit)
        return None
    return shutil.which("flywheel")


class PushCache:
    """The cached copy of the last checkpoint this machine pushed to one URL."""

    def __init__(self, url: str, root: Optional[str] = None):
        self.url = url
        self.root = root or cache_root()
        self.key = cache_key(url)
        self.path = os.path.join(self.root, self.key)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Holds the URL's cache lock (blocking) and removes stale staging copies."""
        os.makedirs(self.root, exist_ok=True)
        with open(os.path.join(self.root, self.key + ".lock"), "a+b") as lock_file:
            if fcntl is not None:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
            try:
                # Under the lock no other push to this URL is running: leftovers are stale.
                for stale in glob.glob(os.path.join(self.root, self.key + ".staging-*")) + \
                        glob.glob(os.path.join(self.root, self.key + ".old-*")):
                    shutil.rmtree(stale, ignore_errors=True)
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)

    def checkpoint(self) -> Optional[str]:
        """The cached checkpoint (a file or a sharded directory), None when there is none."""
        single = os.path.join(self.path, SINGLE_FILE_NAME)
        if os.path.isfile(single):
            return single
        sharded = os.path.join(self.path, SHARDED_DIR_NAME)
        if os.path.isfile(os.path.join(sharded, INDEX_FILE_NAME)):
            return sharded
        return None

    def last(self) -> Optional[Dict[str, Any]]:
        """``last.json`` when it is for this URL and the checkpoint beside it exists."""
        try:
            with open(os.path.join(self.path, LAST_FILE_NAME), "rb") as last_file:
                last = json.load(last_file)
        except (OSError, ValueError):
            return None
        if not isinstance(last, dict) or last.get("url") != self.url or \
                not isinstance(last.get("version"), int) or isinstance(last["version"], bool):
            return None
        return last if self.checkpoint() is not None else None

    def new_staging(self) -> str:
        """A new empty staging directory, to fill and then pass to :meth:`install`."""
        os.makedirs(self.root, exist_ok=True)
        path = os.path.join(self.root, f"{self.key}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(path)
        return path

    def temp_file(self, suffix: str) -> str:
        """A new empty temporary file under the cache root (same disk as the cache)."""
        os.makedirs(self.root, exist_ok=True)
        handle, path = tempfile.mkstemp(prefix=f"{self.key}.staging-", suffix=suffix, dir=self.root)
        os.close(handle)
        return path

    def install(self, staging: str, files: List[CheckpointFile], version: int,
                weights_hash: str) -> None:
        """Makes ``staging`` the cache: copies the ``files`` it lacks into it (under their
        upload names; into ``checkpoint/`` when sharded), writes ``last.json``, and renames
        it to ``<root>/<key>``. ``staging`` no longer exists afterwards (on error too)."""
        try:
            directory = staging
            if any(file.name == INDEX_FILE_NAME for file in files):
                directory = os.path.join(staging, SHARDED_DIR_NAME)
                os.makedirs(directory, exist_ok=True)
            for file in files:
                destination = os.path.join(directory, file.name)
                if os.path.abspath(file.path) != os.path.abspath(destination):
                    shutil.copyfile(file.path, destination)
            last = {"url": self.url, "version": version, "weights_hash": weights_hash}
            with open(os.path.join(staging, LAST_FILE_NAME), "w", encoding="utf-8") as out:
                json.dump(last, out)
                out.flush()
                os.fsync(out.fileno())
            old = None
            if os.path.exists(self.path):
                old = os.path.join(self.root,
                                   f"{self.key}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
                os.rename(self.path, old)
            os.rename(staging, self.path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if os.path.exists(staging):
                shutil.rmtree(staging, ignore_errors=True)


def encode_delta(binary: str, base: str, target: str, out: str, base_version: int,
                 target_version: int, timeout: float = 3600.0) -> None:
    """Runs ``flywheel delta encode`` from checkpoint ``base`` to ``target`` into ``out``.

    Raises DeltaError with the command's stderr when it fails or runs past ``timeout``.
    """
    command = [binary, "delta", "encode", "--base", base, "--target", target, "--out", out,
               "--base-version", str(base_version), "--target-version", str(target_version)]
    try:
        result = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DeltaError(f"{' '.join(command)}: {error}") from error
    if result.returncode != 0:
        detail = result.stderr.decode("utf-8", "replace").strip()[-2000:]
        raise DeltaError(f"{' '.join(command)} exited with {result.returncode}: {detail}")
    if not os.path.isfile(out) or os.path.getsize(out) == 0:
        raise DeltaError(f"{' '.join(command)} wrote no delta to {out}")
