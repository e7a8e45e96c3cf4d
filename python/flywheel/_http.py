"""HTTP/1.1 transport of the client: one keep-alive connection, bearer token, TLS.

Every transport failure (refused, reset, timed out, TLS) becomes
:class:`~flywheel.errors.ConnectionFailed` naming the URL; every non-2xx answer becomes
the :class:`~flywheel.errors.ApiError` subclass of its error code. Not thread-safe: one
:class:`HttpSession` per thread.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.parse
from typing import Any, Dict, Mapping, Optional, Tuple

from ._version import __version__
from .errors import ConnectionFailed, api_error

# Failures that mean the connection is unusable; the request may or may not have arrived.
_TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


class HttpSession:
    """Requests against one server ``base_url`` (``http://`` or ``https://``, optional path
    prefix). ``timeout`` bounds connecting and every socket read/write, in seconds."""

    def __init__(self, base_url: str, token: Optional[str], timeout: float,
                 ca_file: Optional[str], cert_file: Optional[str] = None,
                 key_file: Optional[str] = None):
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"url {base_url!r}: expected http://HOST:PORT or https://HOST:PORT")
        if parsed.query or parsed.fragment:
            raise ValueError(f"url {base_url!r}: no query or fragment expected")
        self.base_url = base_url.rstrip("/")
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._https else 80)
        self._prefix = parsed.path.rstrip("/")
        self._timeout = timeout
        self._ssl_context: Optional[ssl.SSLContext] = None
        if self._https:
            self._ssl_context = ssl.create_default_context(cafile=ca_file)
            if cert_file:
                # A publisher started with --tls-ca verifies its clients too.
                self._ssl_context.load_cert_chain(cert_file, key_file)
        elif ca_file or cert_file:
            raise ValueError(f"ca_file/cert_file given but url {base_url!r} is not https")
        self._headers = {"User-Agent": f"flywheel-python/{__version__}"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._connection: Optional[http.client.HTTPConnection] = None

    @property
    def timeout(self) -> float:
        """The default per-operation timeout in seconds."""
        return self._timeout

    @property
    def connected(self) -> bool:
        """Whether a kept-alive connection is open (the next request reuses it; the server
        may have closed it while it was idle)."""
        return self._connection is not None

    def close(self) -> None:
        """Closes the keep-alive connection (the next request opens a new one)."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def url_of(self, path: str, query: Optional[Mapping[str, Any]] = None) -> str:
        """The full URL of ``path`` (which starts with ``/``) for messages."""
        return self.base_url + self._target(path, query)

    def _target(self, path: str, query: Optional[Mapping[str, Any]]) -> str:
        target = self._prefix + path
        if query:
            target += "?" + urllib.parse.urlencode(
                {k: v for k, v in query.items() if v is not None})
        return target

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout,
                                               context=self._ssl_context)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def request(self, method: str, path: str, *, query: Optional[Mapping[str, Any]] = None,
                body: Optional[bytes] = None, content_type: Optional[str] = None,
                timeout: Optional[float] = None, fresh_connection: bool = False
                ) -> Tuple[int, bytes]:
        """Sends one request and reads the whole answer: ``(status, body)``.

        ``timeout`` overrides the session's for this request (a long-poll, a commit).
        ``fresh_connection`` closes the keep-alive connection first: for requests that
        must not be sent twice (a GET or DELETE, both idempotent, on a reused connection
        that the server closed while idle is retried once on a new one; nothing else is
        retried here).
        Raises ConnectionFailed on any transport failure.
        """
        timeout = self._timeout if timeout is None else timeout
        if fresh_connection:
            self.close()
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = content_type or "application/octet-stream"
        target = self._target(path, query)
        retry_stale = method in ("GET", "DELETE") and self._connection is not None
        while True:
            reused = self._connection is not None
            if self._connection is None:
                self._connection = self._connect(timeout)
            connection = self._connection
            connection.timeout = timeout
            if connection.sock is not None:
                connection.sock.settimeout(timeout)
            try:
                connection.request(method, target, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
                if response.will_close:
                    self.close()
                return response.status, data
            except _TRANSPORT_ERRORS as error:
                self.close()
                stale = isinstance(error, (http.client.RemoteDisconnected, ConnectionResetError,
                                           BrokenPipeError))
                if retry_stale and reused and stale:
                    retry_stale = False
                    continue
                raise ConnectionFailed(self.base_url + target, _describe(error, timeout)) from error

    def json(self, method: str, path: str, *, query: Optional[Mapping[str, Any]] = None,
             document: Any = None, body: Optional[bytes] = None,
             timeout: Optional[float] = None, fresh_connection: bool = False) -> Dict[str, Any]:
        """A request whose answer is a JSON object: returns it for a 2xx status.

        ``document`` is sent as a JSON body, ``body`` as octets. Raises the ApiError
        subclass of the server's error code for any other status, ConnectionFailed on
        transport failures or a 2xx answer that is not JSON.
        """
        content_type = None
        if document is not None:
            body = json.dumps(document).encode("utf-8")
            content_type = "application/json"
        status, data = self.request(method, path, query=query, body=body,
                                    content_type=content_type, timeout=timeout,
                                    fresh_connection=fresh_connection)
        url = self.url_of(path, query)
        if not 200 <= status < 300:
            raise api_error(status, data, url)
        try:
            answer = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ConnectionFailed(
                url, f"HTTP {status} answer is not JSON: {data[:200]!r}") from None
        if not isinstance(answer, dict):
            raise ConnectionFailed(url, f"HTTP {status} answer is not a JSON object")
        return answer


def _describe(error: BaseException, timeout: float) -> str:
    if isinstance(error, (socket.timeout, TimeoutError)):
        return f"timed out after {timeout:g} s"
    if isinstance(error, ssl.SSLError):
        return f"TLS: {error}"
    if isinstance(error, http.client.RemoteDisconnected):
        return "the server closed the connection without an answer"
    return f"{type(error).__name__}: {error}"
