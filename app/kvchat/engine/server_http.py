"""A small HTTP client for llama-server: JSON requests and server-sent event streams.

Only the standard library: ``http.client`` over TCP, or TLS with the system's trust
store (certificates and host names verified). An API key goes as a bearer token. Every
failure is a :class:`ServerError` whose message is one line naming the server.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from kvchat.errors import KvchatError

# Seconds to wait for a short request (props, tokenize, slot files).
REQUEST_TIMEOUT_S = 60.0
# Seconds a stream may stay silent (prompt processing on a slow machine sends progress).
STREAM_TIMEOUT_S = 600.0


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


class ServerClient:
    """Requests to one llama-server; a new connection per request (they are local or few)."""

    # How one-line errors name the server.
    label = "llama-server"

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = normalize_url(url)
        parts = urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        self._base = parts.path
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _send(
        self, method: str, path: str, body: Any, timeout: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connect(timeout)
        data = None if body is None else json.dumps(body).encode("utf-8")
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise self._unreachable(exc) from None
        try:
            conn.request(method, self._base + path, body=data, headers=self._headers)
            response = conn.getresponse()
        except TimeoutError as exc:
            conn.close()
            raise self._unreachable(exc) from None
        except (OSError, http.client.HTTPException) as exc:
            # Connected, then the connection ended before an answer: the server went away
            # while it had the request (a crash, a kill).
            conn.close()
            raise self._broken(exc) from None
        if response.status >= 400:
            try:
                raw = self._error_body(conn, response)
            except (OSError, http.client.HTTPException):
                raw = b""
            conn.close()
            raise self._refused(response.status, raw)
        return conn, response

    def _error_body(
        self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse
    ) -> bytes:
        """An HTTP error's body, for its message (the first 64 KiB)."""
        return response.read(65536)

    def get(self, path: str, timeout: float = REQUEST_TIMEOUT_S) -> Any:
        return self._json("GET", path, None, timeout)

    def post(self, path: str, body: Any, timeout: float = REQUEST_TIMEOUT_S) -> Any:
        return self._json("POST", path, body, timeout)

    def _json(self, method: str, path: str, body: Any, timeout: float) -> Any:
        conn, response = self._send(method, path, body, timeout)
        try:
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise self._broken(exc) from None
        finally:
            conn.close()
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"llama-server at {self.url} sent a reply that is not JSON") from None

    def stream(self, path: str, body: Any) -> EventStream:
        """POST ``body`` and read the reply as server-sent events (close it to cancel)."""
        conn, response = self._send("POST", path, body, STREAM_TIMEOUT_S)
        return EventStream(self, conn, response)

    # --- one-line errors --------------------------------------------------------------------

    def _unreachable(self, exc: BaseException) -> ServerError:
        if isinstance(exc, ssl.SSLCertVerificationError):
            why = f"its TLS certificate was not accepted ({exc.verify_message})"
        elif isinstance(exc, socket.timeout | TimeoutError):
            why = "no answer in time"
        else:
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return ServerError(f"cannot reach {self.label} at {self.url}: {why}")

    def _broken(self, exc: BaseException) -> ServerError:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return ServerError(
            f"{self.label} at {self.url} broke off the connection: {why}", dropped=True
        )

    def _refused(self, status: int, raw: bytes) -> ServerError:
        if status == 401:
            return ServerError(
                f"llama-server at {self.url} refused the API key (HTTP 401): set server_api_key "
                "(KVCHAT_SERVER_API_KEY) to the key it was started with (--api-key)",
                status,
            )
        message = ""
        try:
            detail = json.loads(raw)
            error = detail.get("error", detail) if isinstance(detail, dict) else detail
            message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
        except (ValueError, RecursionError):  # a hostile body: 64 KiB of "[", NaN, …
            message = raw[:200].decode("utf-8", "replace")
        message = " ".join(message.split())
        return ServerError(
            f"{self.label} at {self.url} answered HTTP {status}"
            + (f": {message}" if message else ""),
            status,
        )


class EventStream:
    """The ``data:`` events of a streaming reply, as JSON objects; :meth:`close` cancels."""

    def __init__(
        self,
        client: ServerClient,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
    ) -> None:
        self._client = client
        self._conn = conn
        self._response = response

    def __iter__(self) -> Iterator[dict[str, Any]]:
        data: list[str] = []
        while True:
            try:
                line = self._response.readline()
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise self._client._broken(exc) from None
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip("\r\n")
            if text:
                field, _, value = text.partition(":")
                if field in ("data", "error"):
                    data.append(value.removeprefix(" "))
                    if field == "error":
                        yield {"error": _loads(data.pop())}
                continue
            if not data:
                continue
            payload = "\n".join(data)
            data = []
            if payload == "[DONE]":
                return
            event = _loads(payload)
            yield event if isinstance(event, dict) else {"error": event}

    def close(self) -> None:
        """Drop the connection: llama-server stops the task it was running for it."""
        try:
            self._conn.close()
        except OSError:
            pass


def _loads(payload: str) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return {"message": payload}
