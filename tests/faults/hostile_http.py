"""What the hostile-server campaigns (test_openai_boundary, test_llama_server_boundary) share:
a local HTTP server in a thread whose handler writes raw bytes, the SSE framing, and what
"one clean line" means for the error kvchat gives."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def sse(*events: Any, done: bool = True, keepalive: int = 0) -> bytes:
    """A stream: each event a ``data:`` line (a dict is dumped as JSON; bytes go as they
    are), ``keepalive`` comment lines before each, then ``[DONE]`` unless ``done`` is off."""
    out = b""
    for event in events:
        out += b": keep-alive\n\n" * keepalive
        raw = event if isinstance(event, bytes) else json.dumps(event).encode()
        out += b"data: " + raw + b"\n\n"
    if done:
        out += b"data: [DONE]\n\n"
    return out


class RawHandler(BaseHTTPRequestHandler):
    """A handler that logs nothing and can answer with any bytes."""

    def log_message(self, *args: Any) -> None:
        pass

    def raw(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            pass  # kvchat hung up: what it does then is the test's question


class LocalServer(ThreadingHTTPServer):
    """A server on a free port of 127.0.0.1, serving in a thread of its own."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def is_one_clean_line(text: str) -> bool:
    """One line a terminal shows as it is: no line breaks, escapes, traceback or lone
    surrogates, and not empty or endless."""
    return (
        "\n" not in text
        and "\r" not in text
        and "\x1b" not in text
        and "Traceback" not in text
        and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        and 0 < len(text) <= 1000
    )
