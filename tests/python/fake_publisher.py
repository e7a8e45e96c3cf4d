"""An in-process fake of the publisher's push API (docs/PUSH_API.md), for client tests.

It keeps the spec's upload state machine (create, parts at offsets, state with ``missing``
ranges, commit checks, abort), the ledger, pins and the ``wait`` long-poll, and records
every request so tests can check what the client sent. It does not apply deltas: a delta
commit is accepted when its base is held, and its body is kept as it came.

Fault seams: ``cut_puts`` maps the index of a PUT (0 for the first one) to a byte count:
that PUT's connection is dropped after reading that many bytes of its body (the bytes
read are kept, as a real server keeps what reached its disk); ``fail_next`` answers the
next matching request with a given error.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

from flywheel.safetensors import INDEX_FILE_NAME, SafetensorsError, read_header


@dataclass
class Upload:
    id: str
    request: Dict[str, Any]
    body: bytearray
    received: List[Tuple[int, int]] = field(default_factory=list)  # merged, sorted

    def missing(self) -> List[List[int]]:
        gaps, position = [], 0
        for begin, end in self.received:
            if begin > position:
                gaps.append([position, begin])
            position = max(position, end)
        if position < len(self.body):
            gaps.append([position, len(self.body)])
        return gaps

    def add(self, begin: int, end: int) -> None:
        ranges = sorted(self.received + [(begin, end)])
        merged: List[Tuple[int, int]] = []
        for b, e in ranges:
            if merged and b <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((b, e))
        self.received = merged


@dataclass
class Request:
    method: str
    path: str
    query: Dict[str, str]
    authorization: Optional[str]
    body_bytes: int  # bytes of the body the server read


class ApiFailure(Exception):
    def __init__(self, status: int, code: str, message: str, **details: Any):
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details


class FakePublisher:
    """Start with :meth:`start`; ``url`` is then ``http://127.0.0.1:<port>``."""

    def __init__(self, push_token: Optional[str] = "push-secret",
                 read_token: Optional[str] = "read-secret", max_upload_bytes: int = 1 << 30):
        self.push_token = push_token
        self.read_token = read_token
        self.max_upload_bytes = max_upload_bytes
        self.lock = threading.Condition()
        self.uploads: Dict[str, Upload] = {}
        self.rows: List[Dict[str, Any]] = []
        self.bodies: Dict[int, bytes] = {}  # version -> the committed upload body
        self.files: Dict[int, Dict[str, bytes]] = {}  # version -> full upload's files
        self.pin: Optional[Dict[str, Any]] = None
        self.unrebuildable: set = set()  # versions whose weights "cannot be rebuilt"
        self.requests: List[Request] = []
        self.cut_puts: Dict[int, int] = {}
        self.puts_seen = 0
        self.fail_next: List[Tuple[str, str, ApiFailure]] = []
        self.workers = 2
        self.serving_version = 0  # every worker serves this version
        self.wait_cap_ms: Optional[int] = None  # the server's own cap on one long-poll
        self._next_id = 1
        self.scheme = "http"
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, tls: Optional[Tuple[str, str]] = None,
              client_ca: Optional[str] = None) -> "FakePublisher":
        """Serves on a free loopback port; ``tls`` = (certificate, key) PEM files: https;
        ``client_ca``: clients must present a certificate it signed (as --tls-ca does)."""
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            if client_ca is not None:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(client_ca)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            with self.lock:
                self.lock.notify_all()
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._server.server_address[1]}"

    # -- test helpers --------------------------------------------------------------------

    @property
    def head(self) -> int:
        return self.rows[-1]["version"] if self.rows else 0

    def set_serving(self, version: int) -> None:
        with self.lock:
            self.serving_version = version
            self.lock.notify_all()

    def requests_to(self, method: str, prefix: str) -> List[Request]:
        return [r for r in self.requests if r.method == method and r.path.startswith(prefix)]

    # -- the API -------------------------------------------------------------------------

    def authorize(self, authorization: Optional[str], push: bool) -> None:
        token = None
        if authorization and authorization.startswith("Bearer "):
            token = authorization[len("Bearer "):]
        if token is None or token not in (self.push_token, self.read_token):
            raise ApiFailure(401, "unauthorized", "missing or unknown bearer token")
        if push and self.push_token is None:
            raise ApiFailure(403, "push_disabled", "no push token configured")
        if push and token != self.push_token:
            raise ApiFailure(403, "forbidden", "the read token cannot push")

    def create(self, request: Dict[str, Any]) -> Dict[str, Any]:
        size, kind, version = request.get("size"), request.get("kind"), request.get("version")
        if not isinstance(size, int) or kind not in ("full", "delta") or \
                not (version == "next" or isinstance(version, int)):
            raise ApiFailure(400, "bad_request", f"bad upload request {request}")
        if request.get("digest", {}).get("algorithm") != "sha256":
            raise ApiFailure(400, "bad_request", "digest algorithm must be sha256 here")
        if size > self.max_upload_bytes:
            raise ApiFailure(413, "too_large",
                             f"size {size} above the {self.max_upload_bytes}-byte limit")
        if isinstance(version, int) and version <= self.head:
            raise ApiFailure(409, "version_conflict",
                             f"version {version} is not above the head v{self.head}",
                             head_version=self.head)
        if kind == "full":
            files = request.get("files") or [{"name": "model.safetensors", "size": size}]
            if sum(f["size"] for f in files) != size or \
                    any("/" in f["name"] or ".." in f["name"] for f in files):
                raise ApiFailure(400, "bad_request",
                                 "files do not add up to size or a name is not plain")
        else:
            base = request.get("base_version")
            if not isinstance(base, int) or "files" in request:
                raise ApiFailure(400, "bad_request", "a delta needs base_version and no files")
            if base not in self.held_versions():
                raise ApiFailure(409, "unknown_base", f"cannot rebuild base v{base}",
                                 held_versions=self.held_versions())
        if self.pin is not None:
            raise ApiFailure(409, "pinned", "the fleet is pinned", pin=self.pin)
        upload = Upload(f"u-{self._next_id}", request, bytearray(size))
        self._next_id += 1
        self.uploads[upload.id] = upload
        return self.state(upload)

    def held_versions(self) -> List[int]:
        return [r["version"] for r in self.rows if r["version"] not in self.unrebuildable]

    def state(self, upload: Upload) -> Dict[str, Any]:
        missing = upload.missing()
        return {"id": upload.id, "kind": upload.request["kind"],
                "version": upload.request["version"], "size": len(upload.body),
                "received_bytes": len(upload.body) - sum(e - b for b, e in missing),
                "missing": missing, "expires_in_s": 3600.0}

    def upload_of(self, upload_id: str) -> Upload:
        if upload_id not in self.uploads:
            raise ApiFailure(404, "not_found", f"unknown upload {upload_id}")
        return self.uploads[upload_id]

    def commit(self, upload: Upload) -> Dict[str, Any]:
        del self.uploads[upload.id]  # removed whatever the outcome
        request, body = upload.request, bytes(upload.body)
        if upload.missing():
            raise ApiFailure(422, "incomplete", "bytes are missing", missing=upload.missing())
        if hashlib.sha256(body).hexdigest() != request["digest"]["value"]:
            raise ApiFailure(422, "body_hash_mismatch", "the body does not hash to the digest")
        if self.pin is not None:
            raise ApiFailure(409, "pinned", "the fleet is pinned", pin=self.pin)
        version = self.head + 1 if request["version"] == "next" else request["version"]
        if version <= self.head:
            raise ApiFailure(409, "version_conflict", f"version {version} is not above the "
                             f"head v{self.head}", head_version=self.head)
        files: Dict[str, bytes] = {}
        if request["kind"] == "full":
            position = 0
            for spec in request.get("files") or [{"name": "model.safetensors", "size": len(body)}]:
                files[spec["name"]] = body[position:position + spec["size"]]
                position += spec["size"]
            for name, data in files.items():
                if name != INDEX_FILE_NAME:
                    try:
                        read_header(io.BytesIO(data), len(data), name)
                    except SafetensorsError as error:
                        raise ApiFailure(422, "invalid_checkpoint", str(error)) from None
        weights_hash = hashlib.sha256(body).hexdigest()[:32]
        row = self.add_row(version, "push", weights_hash, request["metadata"],
                           upload_kind=request["kind"], uploaded_bytes=len(body),
                           client=request.get("client"))
        self.bodies[version] = body
        self.files[version] = files
        return row

    def add_row(self, version: int, source: str, weights_hash: str, metadata: Dict[str, Any],
                **extra: Any) -> Dict[str, Any]:
        row = {"version": version, "weights_hash": weights_hash, "source": source,
               "created_unix_ms": int(time.time() * 1000), "metadata": metadata,
               "upload_kind": extra.get("upload_kind"),
               "uploaded_bytes": extra.get("uploaded_bytes", 0),
               "pushed_by": {"client": extra.get("client"), "token": "push"},
               "pinned_to": extra.get("pinned_to"), "rebuildable": True}
        self.rows.append(row)
        return row

    def readiness(self, version: int) -> Dict[str, Any]:
        serving = self.workers if self.serving_version >= version else 0
        return {"version": version, "head_version": self.head, "workers": self.workers,
                "serving": serving, "fraction": serving / self.workers if self.workers else 0.0,
                "regions": {"home": {"workers": self.workers, "serving": serving}}}

    def wait(self, query: Dict[str, str]) -> Dict[str, Any]:
        version = int(query.get("version", self.head))
        fraction = float(query.get("fraction", 1.0))
        timeout_ms = int(query.get("timeout_ms", 30000))
        if self.wait_cap_ms is not None:
            timeout_ms = min(timeout_ms, self.wait_cap_ms)
        min_workers = int(query.get("min_workers", 1))
        started = time.monotonic()
        deadline = started + timeout_ms / 1000
        with self.lock:
            while True:
                readiness = self.readiness(version)
                needed = max(min_workers, -(-int(fraction * 1000) * self.workers // 1000))
                ready = readiness["serving"] >= needed
                remaining = deadline - time.monotonic()
                if ready or remaining <= 0:
                    break
                self.lock.wait(remaining)
        readiness["ready"] = ready
        readiness["waited_ms"] = int((time.monotonic() - started) * 1000)
        return readiness

    def route(self, method: str, path: str, query: Dict[str, str], body: bytes,
              authorization: Optional[str]) -> Tuple[int, Dict[str, Any]]:
        for index, (fail_method, prefix, failure) in enumerate(self.fail_next):
            if fail_method == method and path.startswith(prefix):
                del self.fail_next[index]
                raise failure
        parts = path.strip("/").split("/")
        document = json.loads(body) if body and method == "POST" else {}
        if parts[:2] == ["v1", "uploads"]:
            self.authorize(authorization, push=True)
            if method == "POST" and len(parts) == 2:
                return 201, self.create(document)
            upload = self.upload_of(parts[2])
            if method == "POST" and parts[3:] == ["commit"]:
                return 200, self.commit(upload)
            if method == "GET":
                return 200, self.state(upload)
            if method == "DELETE":
                del self.uploads[upload.id]
                return 200, {"id": upload.id, "aborted": True}
            raise ApiFailure(400, "bad_request", f"{method} {path}")
        if method == "POST" and path in ("/v1/pin", "/v1/unpin"):
            self.authorize(authorization, push=True)
            if path == "/v1/unpin":
                self.pin = None
                return 200, {"pin": None, "head_version": self.head}
            target = document["version"]
            rows = [r for r in self.rows if r["version"] == target]
            if not rows:
                raise ApiFailure(404, "not_found", f"version {target} is not in the ledger")
            row = self.add_row(self.head + 1, "pin", rows[0]["weights_hash"],
                               document.get("metadata", {}), pinned_to=target)
            self.pin = {"pinned_to": target, "published_as": row["version"], "since_unix_ms": 0}
            return 200, row
        self.authorize(authorization, push=False)
        if path == "/v1/versions":
            return 200, {"head_version": self.head, "pin": self.pin, "versions": self.rows}
        if parts[:2] == ["v1", "versions"] and len(parts) == 3:
            for row in self.rows:
                if str(row["version"]) == parts[2]:
                    return 200, row
            raise ApiFailure(404, "not_found", f"version {parts[2]} is not in the ledger")
        if path == "/v1/readiness":
            return 200, self.readiness(int(query.get("version", self.head)))
        if path == "/v1/wait":
            return 200, self.wait(query)
        if path == "/v1/status":
            return 200, {"role": "publisher", "version": self.head}
        raise ApiFailure(404, "not_found", f"no route {method} {path}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in separate writes
    fake: FakePublisher

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _handle(self) -> None:
        fake = self.fake
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        length = int(self.headers.get("Content-Length") or 0)
        record = Request(self.command, url.path, query, self.headers.get("Authorization"), 0)
        with fake.lock:
            fake.requests.append(record)
            cut = None
            if self.command == "PUT":
                cut = fake.cut_puts.get(fake.puts_seen)
                fake.puts_seen += 1
        if cut is not None and cut < length:
            body = self.rfile.read(cut)
            record.body_bytes = len(body)
            self._store_part(url.path, query, body)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        body = self.rfile.read(length) if length else b""
        record.body_bytes = len(body)
        try:
            with fake.lock:
                if self.command == "PUT":
                    status, answer = self._put(url.path, query, body)
                elif self.command == "GET" and url.path == "/v1/wait":
                    status, answer = None, None
                else:
                    status, answer = fake.route(self.command, url.path, query, body,
                                                record.authorization)
            if status is None:  # the long-poll waits without holding the lock
                fake.authorize(record.authorization, push=False)
                status, answer = 200, fake.wait(query)
        except ApiFailure as failure:
            status = failure.status
            answer = {"error": {"code": failure.code, "message": failure.message,
                                **failure.details}}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)

    def _put(self, path: str, query: Dict[str, str], body: bytes) -> Tuple[int, Dict[str, Any]]:
        fake = self.fake
        for index, (fail_method, prefix, failure) in enumerate(fake.fail_next):
            if fail_method == "PUT" and path.startswith(prefix):
                del fake.fail_next[index]
                raise failure
        fake.authorize(self.headers.get("Authorization"), push=True)
        upload = self._store_part(path, query, body)
        return 200, fake.state(upload)

    def _store_part(self, path: str, query: Dict[str, str], body: bytes) -> Upload:
        fake = self.fake
        with fake.lock:
            upload = fake.upload_of(path.strip("/").split("/")[2])
            offset = int(query["offset"])
            if offset < 0 or offset + len(body) > len(upload.body):
                raise ApiFailure(400, "bad_request", f"part [{offset}, {offset + len(body)}) "
                                 f"outside the declared size {len(upload.body)}")
            upload.body[offset:offset + len(body)] = body
            if body:
                upload.add(offset, offset + len(body))
            return upload

    do_GET = do_PUT = do_POST = do_DELETE = _handle
