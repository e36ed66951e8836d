"""A small HTTP client for llama-server: JSON requests and server-sent event streams.

Only the standard library: ``http.client`` over TCP, or TLS with the system's trust
store (certificates and host names verified). An API key goes as a bearer token. Every
failure is a :class:`ServerError` whose message is one line naming the server.

Every byte the server sends is read with the discipline of
:mod:`kvchat.engine.openai_wire` (issue 37): the status line and headers within the
request's time, a JSON body at most :data:`~kvchat.engine.openai_wire.MAX_BODY_BYTES`
within :data:`REQUEST_TIMEOUT_S`, bounded JSON (depth, finite numbers, integers of bounded
length), a stream's events each at most
:data:`~kvchat.engine.openai_wire.MAX_EVENT_BYTES` with an idle and a total deadline
(:attr:`ServerClient.limits`); anything else is one line, never a traceback.

What differs between kinds of server (how errors name it, how a refusal reads, how a
connection is watched, how a reply is read) is a :class:`ServerDialect` the client is given:
:class:`LlamaServerDialect` by default, the OpenAI-compatible one in
:mod:`kvchat.engine.openai`.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

from kvchat.engine.openai_wire import (
    ERROR_BODY_S,
    MAX_ERROR_BYTES,
    EventReader,
    StreamLimits,
    WireError,
    WireTimeout,
    error_message,
    line_of,
    loads,
    read_body,
)
from kvchat.errors import KvchatError

# Seconds to wait for a short request (props, tokenize, slot files), its body included.
REQUEST_TIMEOUT_S = 60.0
# Seconds a stream may stay silent (prompt processing on a slow machine sends progress).
STREAM_TIMEOUT_S = 600.0
# Seconds a whole stream may last (a reply of thousands of tokens on a slow CPU).
STREAM_TOTAL_S = 4 * 3600.0


class ServerError(KvchatError):
    """llama-server could not be reached, refused a request, or broke off.

    ``dropped``: the request reached the server and the connection then ended without a
    whole answer (the server died or was killed while working on it), as opposed to a
    server that could not be reached at all or answered with an HTTP error.
    """

    def __init__(self, message: str, status: int | None = None, *, dropped: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.dropped = dropped


def normalize_url(url: str) -> str:
    """``url`` as ``scheme://host[:port][/path]`` without a trailing slash; a bare
    ``host:port`` gets ``http://``. Raises ServerError for what is not an HTTP(S) URL."""
    text = url.strip()
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"not an http(s) server URL: {url!r}")
    try:
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        raise ServerError(f"not a valid port in the server URL {url!r}") from None
    if parts.query or parts.fragment:
        raise ServerError(f"the server URL may not carry a query or fragment: {url!r}")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


class ReplyRead(NamedTuple):
    """How a JSON reply is read: its time cap, what it is called in a
    :class:`~kvchat.engine.openai_wire.WireError`, and the path a bad one names ("": none)."""

    total_s: float
    what: str
    where: str


class ServerDialect(Protocol):
    """What tells one kind of server apart for :class:`ServerClient` (its policy)."""

    @property
    def label(self) -> str:
        """How one-line errors name the server."""
        ...

    def refused(self, url: str, status: int, raw: bytes) -> ServerError:
        """The one line for an HTTP error ``status`` whose body begins with ``raw``."""
        ...

    def watch(self, conn: http.client.HTTPConnection, timeout: float) -> Callable[[], None]:
        """Watch a request's connection from before it opens; what it returns stops the watch
        once the answer's head (an HTTP error: its body too) has been read or has failed."""
        ...

    def reply(self, path: str, timeout: float) -> ReplyRead:
        """How the JSON reply to a request for ``path`` with ``timeout`` seconds is read."""
        ...


def answered(label: str, url: str, status: int, raw: bytes) -> ServerError:
    """The one line for an HTTP error that is not about the API key."""
    message = error_message(raw)  # bounded: 64 KiB of "[", NaN, escapes are one line
    return ServerError(
        f"{label} at {url} answered HTTP {status}" + (f": {message}" if message else ""),
        status,
    )


def _unwatched() -> None:
    """Nothing to stop: the request's own watchdog (see :meth:`ServerClient.send`) suffices."""


@dataclass(frozen=True)
class LlamaServerDialect:
    """llama-server: an API key it was started with, a reply named by its path."""

    label: str = "llama-server"

    def refused(self, url: str, status: int, raw: bytes) -> ServerError:
        if status == 401:
            return ServerError(
                f"llama-server at {url} refused the API key (HTTP 401): set server_api_key "
                "(KVCHAT_SERVER_API_KEY) to the key it was started with (--api-key)",
                status,
            )
        return answered(self.label, url, status, raw)

    def watch(self, conn: http.client.HTTPConnection, timeout: float) -> Callable[[], None]:
        return _unwatched

    def reply(self, path: str, timeout: float) -> ReplyRead:
        return ReplyRead(total_s=timeout, what="a reply", where=path)


class ServerClient:
    """Requests to one server (llama-server unless ``dialect`` says otherwise); a new
    connection per request (they are local or few)."""

    def __init__(
        self, url: str, api_key: str | None = None, dialect: ServerDialect | None = None
    ) -> None:
        self.dialect: ServerDialect = dialect or LlamaServerDialect()
        self.url = normalize_url(url)
        parts = urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        self._base = parts.path
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        # The caps of a stream (tests shorten them).
        self.limits = StreamLimits(idle_s=STREAM_TIMEOUT_S, total_s=STREAM_TOTAL_S)
        # Seconds a short request may take in all (its answer's body included).
        self.request_s = REQUEST_TIMEOUT_S

    @property
    def label(self) -> str:
        """How one-line errors name the server."""
        return self.dialect.label

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def send(
        self, method: str, path: str, body: Any, timeout: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request and read its answer's head: the open connection and the response
        (its body unread), or the one-line :class:`ServerError` of an HTTP error."""
        conn = self._connect(timeout)
        unwatch = self.dialect.watch(conn, timeout)
        try:
            return self._exchange(conn, method, path, body, timeout)
        finally:
            unwatch()

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        method: str,
        path: str,
        body: Any,
        timeout: float,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        data = None if body is None else json.dumps(body).encode("utf-8")
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise self._unreachable(exc) from None
        # The status line and headers must come within ``timeout`` in all: a server that
        # sends them a byte at a time is cut off (the socket's own timeout is per read).
        cutoff = threading.Event()
        watchdog = threading.Timer(timeout, _shut, (conn, cutoff))
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request(method, self._base + path, body=data, headers=self._headers)
            response = conn.getresponse()
        except TimeoutError as exc:
            conn.close()
            raise self._unreachable(exc) from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # Connected, then the connection ended before an answer: the server went away
            # while it had the request (a crash, a kill), or it took too long to answer.
            conn.close()
            if cutoff.is_set():
                raise self._unreachable(TimeoutError()) from None
            raise self.broken(exc) from None
        finally:
            watchdog.cancel()
        if response.status >= 400:
            try:
                raw = self._error_body(conn, response)
            except (OSError, http.client.HTTPException):
                raw = b""
            conn.close()
            raise self.dialect.refused(self.url, response.status, raw)
        return conn, response

    def _error_body(
        self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse
    ) -> bytes:
        """An HTTP error's body, for its message (the first 64 KiB, within seconds)."""
        return read_body(conn, response, MAX_ERROR_BYTES, ERROR_BODY_S, truncate=True)

    def get(self, path: str, timeout: float | None = None) -> Any:
        return self._json("GET", path, None, self.request_s if timeout is None else timeout)

    def post(self, path: str, body: Any, timeout: float | None = None) -> Any:
        return self._json("POST", path, body, self.request_s if timeout is None else timeout)

    def _json(self, method: str, path: str, body: Any, timeout: float) -> Any:
        conn, response = self.send(method, path, body, timeout)
        read = self.dialect.reply(path, timeout)
        try:
            raw = read_body(conn, response, total_s=read.total_s)
        except WireError as exc:
            raise self._bad_reply(exc.what, read.where) from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise self.broken(exc) from None
        finally:
            conn.close()
        try:
            return loads(raw, read.what)
        except WireError as exc:
            raise self._bad_reply(exc.what, read.where) from None

    def stream(self, path: str, body: Any) -> EventStream:
        """POST ``body`` and read the reply as server-sent events (close it to cancel)."""
        conn, response = self.send("POST", path, body, self.limits.idle_s)
        return EventStream(self, conn, response)

    def sent(self, what: str) -> ServerError:
        """The one line for a reply that is not what kvchat reads (``what``: how)."""
        return self._bad_reply(what)

    def _bad_reply(self, what: str, path: str = "") -> ServerError:
        """The one line for a reply that is not what kvchat reads (``what``: how)."""
        where = f" to {path.split('?')[0]}" if path else ""
        return ServerError(f"{self.label} at {self.url} sent{where} {what}")

    # --- one-line errors --------------------------------------------------------------------

    def _unreachable(self, exc: BaseException) -> ServerError:
        if isinstance(exc, ssl.SSLCertVerificationError):
            why = f"its TLS certificate was not accepted ({exc.verify_message})"
        elif isinstance(exc, socket.timeout | TimeoutError):
            why = "no answer in time"
        else:
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return ServerError(f"cannot reach {self.label} at {self.url}: {why}")

    def broken(self, exc: BaseException) -> ServerError:
        """The one line for a connection that ended without a whole answer (``dropped``)."""
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return ServerError(
            f"{self.label} at {self.url} broke off the connection: {why}", dropped=True
        )


class EventStream:
    """The ``data:`` events of a streaming reply, each a bounded JSON object (an ``error:``
    line, or an event that is not an object, comes as ``{"error": …}``); :meth:`close`
    cancels. The caps of :attr:`ServerClient.limits` hold: a stream that sends no event for
    ``idle_s`` (keep-alives do not count), lasts past ``total_s``, or sends an event or a
    stream too large is one :class:`ServerError` line."""

    def __init__(
        self,
        client: ServerClient,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
    ) -> None:
        self._client = client
        self._conn = conn
        self._reader = EventReader(conn, response, client.limits, client.broken)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for event in self._reader:
                yield event if isinstance(event, dict) else {"error": event}
        except WireTimeout as exc:
            raise ServerError(f"{self._client.label} at {self._client.url}: {exc.what}") from None
        except WireError as exc:
            raise self._client._bad_reply(exc.what) from None

    def close(self) -> None:
        """Drop the connection: llama-server stops the task it was running for it."""
        try:
            self._conn.close()
        except OSError:
            pass


def _shut(conn: http.client.HTTPConnection, cutoff: threading.Event) -> None:
    """A request's answer did not come in time: shut its socket (the read then fails)."""
    cutoff.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


__all__ = [
    "EventStream",
    "LlamaServerDialect",
    "ReplyRead",
    "ServerClient",
    "ServerDialect",
    "ServerError",
    "answered",
    "line_of",
    "normalize_url",
]
