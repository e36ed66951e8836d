"""``kvchat bench --peers`` reads a llama-server's replies (completions streamed as events,
slot save and restore answers): whatever a server sends, the bench's server client returns
typed values or raises one clean line (PeerServerError), in bounded time, never another
exception, a traceback or a hang. Named shapes, then a generated campaign (240 seeded cases
under ``stress``; a sample of 20 by default), each against a local server in a thread."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvchat.bench.peers import PeerServerError, ServerPeer
from tests.faults.hostile_http import LocalServer, RawHandler, is_one_clean_line, sse

Answer = Callable[[RawHandler], None]
CAMPAIGN = 240
SAMPLE = 20


class _Handler(RawHandler):
    answer: Answer

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        type(self).answer(self)

    do_GET = do_POST  # noqa: N815


def _client(server: LocalServer, tmp_path: Path) -> ServerPeer:
    """A client of ``server`` as the bench makes one, without starting a llama-server."""
    peer = object.__new__(ServerPeer)
    peer.host, peer.port = "127.0.0.1", int(server.server_address[1])
    peer.slot_dir = tmp_path
    peer.timeout = 2.0
    return peer


def _exercise(answer: Answer, tmp_path: Path) -> list[str]:
    """Each call of the client against a server answering ``answer``: what it returned or
    the line it raised. Any other exception fails the test."""
    handler = type("Handler", (_Handler,), {"answer": staticmethod(answer)})
    server = LocalServer(handler)
    outcomes: list[str] = []
    try:
        peer = _client(server, tmp_path)
        for call in (
            lambda: peer.completion([1, 2, 3], 4),
            lambda: peer.save("x.bin"),
            lambda: peer.restore("x.bin"),
        ):
            started = time.monotonic()
            try:
                result = call()
            except PeerServerError as exc:
                line = str(exc)
                assert is_one_clean_line(line), repr(line)
                outcomes.append(f"error: {line}")
            else:
                outcomes.append(f"ok: {result!r}"[:200])
            assert time.monotonic() - started < 15
    finally:
        server.close()
    return outcomes


def _status(code: int, body: bytes, kind: str = "application/json") -> Answer:
    return lambda h: h.raw(code, body, kind)


def _cut(h: RawHandler) -> None:
    h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Len")
    h.wfile.flush()
    h.close_connection = True


def _slow(h: RawHandler) -> None:
    time.sleep(3)  # longer than the client's timeout
    h.raw(200, b"{}")


NAMED: dict[str, Answer] = {
    "good": _status(
        200,
        sse({"content": "Hi"}, {"content": "!", "stop": True, "timings": {"prompt_n": 3}}),
    ),
    "http 500 with an escape": _status(500, b'{"error": {"message": "bad \\u001b[31mred"}}'),
    "not json": _status(200, b"<html>oops</html>"),
    "a data line not json": _status(200, b"data: {nope\n\n"),
    "deep json": _status(200, b"data: " + b"[" * 100_000 + b"\n\n"),
    "a 2 MiB line": _status(200, b"data: " + b"x" * (2 << 20)),
    "endless events": _status(200, sse(*({"content": "a"} for _ in range(5000)), done=False)),
    "content of the wrong type": _status(200, sse({"content": 7}, {"content": ["x"]}, {"stop": 1})),
    "timings of the wrong type": _status(200, sse({"content": "a", "stop": True, "timings": 5})),
    "cut headers": _cut,
    "slower than the timeout": _slow,
    "json list": _status(200, b"[1, 2, 3]"),
    "empty 200": _status(200, b""),
    "binary": _status(200, bytes(range(256)) * 64, "application/octet-stream"),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_named_server_replies_are_values_or_one_line(name: str, tmp_path: Path) -> None:
    outcomes = _exercise(NAMED[name], tmp_path)
    if name == "good":
        assert outcomes[0] == "ok: (" + outcomes[0][5:]  # a completion's tuple
        assert "'Hi!'" in outcomes[0] and outcomes[0].endswith(", 3)")
    if name in ("http 500 with an escape", "not json", "deep json", "a 2 MiB line"):
        assert outcomes[0].startswith("error: "), outcomes
    if name == "http 500 with an escape":
        assert outcomes[2] == "error: slot restore: HTTP 500: bad red"  # the escape gone
    if name == "endless events":
        assert outcomes[0] == "error: completion: more events than tokens asked for"


def _generated(seed: int) -> Answer:
    """One seeded hostile answer: a status, a framing and events mixed from the shapes a
    server could send."""
    rng = random.Random(seed)
    pieces: list[bytes] = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.randrange(9)
        if kind == 0:
            pieces.append(
                b"data: "
                + json.dumps({"content": rng.choice(["a", "", 5, None, "\x1b[2J"])}).encode()
                + b"\n\n"
            )
        elif kind == 1:
            pieces.append(
                b"data: "
                + json.dumps(
                    {
                        "stop": rng.choice([True, 1, "yes"]),
                        "timings": rng.choice(
                            [{"prompt_n": rng.randint(-5, 10**12)}, {"prompt_n": "7"}, [], None]
                        ),
                    }
                ).encode()
                + b"\n\n"
            )
        elif kind == 2:
            pieces.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
        elif kind == 3:
            pieces.append(b"data: " + b"{" * rng.randint(1, 5000) + b"\n")
        elif kind == 4:
            pieces.append(b": keep-alive\n\n" * rng.randint(1, 50))
        elif kind == 5:
            pieces.append(b"data: [DONE]\n\n")
        elif kind == 6:
            pieces.append(json.dumps({"error": {"message": "x" * rng.randint(0, 5000)}}).encode())
        elif kind == 7:
            pieces.append(
                json.dumps({"n_written": rng.choice([1, -1, "9", 10**30, None])}).encode()
            )
        else:
            pieces.append(b"\n" * rng.randint(1, 100))
    body = b"".join(pieces)
    status = rng.choice([200, 200, 200, 201, 204, 301, 400, 404, 500, 503])
    kind = rng.choice(["application/json", "text/event-stream", "text/html", ""])
    if rng.random() < 0.05:
        return _cut
    return _status(status, body, kind)


@pytest.mark.parametrize("seed", range(0, CAMPAIGN, CAMPAIGN // SAMPLE))
def test_a_sample_of_the_server_reply_campaign(seed: int, tmp_path: Path) -> None:
    assert len(_exercise(_generated(seed), tmp_path)) == 3


@pytest.mark.stress
def test_the_server_reply_campaign(tmp_path: Path) -> None:
    for seed in range(CAMPAIGN):
        assert len(_exercise(_generated(seed), tmp_path)) == 3, seed
