"""`kvchat models pull` at its boundary with the network and the models folder.

The numbered failures, each against the real `kvchat` and a local hub-shaped server
(tests/hub_server.py): the token never goes to another origin on a redirect; a link or a
FIFO at ``models/.FILE.partial`` is refused before anything is downloaded, and nothing is
written through it; no published sha256 (or the hub's API failing) gives no file its final
name unless ``--no-verify`` says so; a 1 B/s server (body or headers) is cut off.

Then a generated campaign (``stress``: 240 cases; a sample of 20 by default) against the
download itself (kvchat.cli.hub_download) and what the hub publishes: hostile redirects,
statuses, ranges, lengths, drips, stalls and resets, and whatever sits at the ``.partial``
path. Every case ends in the file as served or in one KvchatError line, within its time
bound, with the token only ever at the first origin and nothing outside the folder written.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvchat.cli import hub_download
from kvchat.cli.hub_download import Published, download, published
from kvchat.errors import KvchatError
from tests.conftest import run_cli
from tests.hub_server import HubServer

REPO_ID, FILE = "acme/tiny-GGUF", "tiny.gguf"
DATA = b"GGUF" + hashlib.sha256(b"kvchat pull").digest() * 4_000  # ~128 KB
TOKEN = "hf_boundarytesttoken0123456789"


@pytest.fixture
def hub() -> Iterator[HubServer]:
    server = HubServer({(REPO_ID, FILE): DATA})
    yield server
    server.close()


def _env(hub: HubServer, home: Path) -> dict[str, str]:
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(home / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_TOKEN": TOKEN,
    }


def _pull(home: Path, hub: HubServer, *extra: str, check: bool = False) -> Any:
    args = ("models", "pull", "--repo", REPO_ID, "--file", FILE, *extra)
    return run_cli(home, *args, env=_env(hub, home), check=check)


def _last_line(result: Any) -> str:
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------- 37.6, as filed


@pytest.mark.e2e
def test_the_token_is_not_sent_to_another_origin_on_a_redirect(kvhome: Path, hub: HubServer):
    cdn = HubServer({(REPO_ID, FILE): DATA})
    hub.redirect_to = cdn.url  # another port: another origin
    try:
        result = _pull(kvhome, hub, check=True)
    finally:
        cdn.close()
    assert (kvhome / "models" / FILE).read_bytes() == DATA
    assert "matches" in result.stdout
    at_hub = [auth for _, path, auth in hub.authorizations if "/resolve/" in path]
    assert at_hub and all(auth == f"Bearer {TOKEN}" for auth in at_hub)
    assert cdn.authorizations, "the redirect was not followed"
    assert [auth for *_, auth in cdn.authorizations] == [None] * len(cdn.authorizations)


@pytest.mark.e2e
def test_a_link_at_the_partial_path_is_not_written_through(kvhome: Path, hub: HubServer):
    outside = kvhome.parent / "outside.txt"
    outside.write_bytes(b"nineteen bytes here")
    models = kvhome / "models"
    models.mkdir(parents=True)
    os.symlink(outside, models / f".{FILE}.partial")
    result = _pull(kvhome, hub)
    assert result.returncode == 2
    assert "is a link" in _last_line(result) and "nothing was downloaded" in _last_line(result)
    assert outside.read_bytes() == b"nineteen bytes here"
    assert (models / f".{FILE}.partial").is_symlink()  # left for the user to look at
    assert not (models / FILE).exists()
    assert not [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p]


@pytest.mark.e2e
def test_a_fifo_at_the_partial_path_is_refused_at_once(kvhome: Path, hub: HubServer):
    models = kvhome / "models"
    models.mkdir(parents=True)
    os.mkfifo(models / f".{FILE}.partial")
    started = time.monotonic()
    result = _pull(kvhome, hub)
    assert time.monotonic() - started < 60
    assert result.returncode == 2 and "is a FIFO" in _last_line(result)
    assert not (models / FILE).exists()


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["no sha256 published", "the hub's API answers 500"])
def test_an_unverifiable_file_gets_no_final_name_unless_asked(
    kvhome: Path, hub: HubServer, how: str
):
    if how.startswith("no sha256"):
        hub.no_sha256 = True
    else:
        hub.api_error = 500
    refused = _pull(kvhome, hub)
    assert refused.returncode == 2
    line = _last_line(refused)
    assert "cannot verify" in line and "nothing was downloaded" in line and "--no-verify" in line
    assert not (kvhome / "models" / FILE).exists()
    taken = _pull(kvhome, hub, "--no-verify", check=True)
    assert (kvhome / "models" / FILE).read_bytes() == DATA
    assert "not verified (--no-verify" in taken.stdout
    assert hashlib.sha256(DATA).hexdigest() in taken.stdout


class Drip:
    """An HTTP server that sends its headers (``slow_headers``) or its body a byte at a time,
    every ``pause`` seconds, for ever; noting the Authorization header of each request."""

    def __init__(self, slow_headers: bool = False, pause: float = 0.2) -> None:
        self.slow_headers, self.pause = slow_headers, pause
        self.authorizations: list[str | None] = []
        self.stop = threading.Event()
        drip = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                drip.authorizations.append(self.headers.get("Authorization"))
                try:
                    if drip.slow_headers:
                        head = b"HTTP/1.1 200 OK\r\nX-Padding: " + b"a" * 100_000
                    else:
                        self.send_response(200)
                        self.send_header("Content-Length", str(1 << 30))
                        self.end_headers()
                        self.wfile.flush()
                        head = b"x" * 100_000
                    for byte in head:
                        if drip.stop.is_set():
                            return
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(drip.pause)
                except OSError:
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/file.gguf"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("slow_headers", [False, True], ids=["body", "headers"])
def test_a_dripping_server_is_cut_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_headers: bool
) -> None:
    # The floors, scaled down: 1 KiB/s over 1 s, headers within 1.5 s (60 s in use).
    monkeypatch.setattr(hub_download, "RATE_WINDOW_S", 1.0)
    monkeypatch.setattr(hub_download, "MIN_RATE", 1024)
    monkeypatch.setattr(hub_download, "HEADERS_S", 1.5)
    server = Drip(slow_headers=slow_headers, pause=0.05)
    started = time.monotonic()
    try:
        with pytest.raises(KvchatError) as caught:
            download(server.url, {}, tmp_path / ".f.gguf.partial", None, "f.gguf", room=1 << 30)
    finally:
        server.close()
    assert time.monotonic() - started < 10
    why = str(caught.value)
    assert "stopped" in why and "run the same pull again" in why
    assert ("too slow" in why) if not slow_headers else ("no answer within" in why)


# --------------------------------------------------------------------------- the campaign


class Origin:
    """A scriptable server: each request answers as ``script(handler, hits)`` says."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []
        self.behaviour: Any = None
        self.stop = threading.Event()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                origin.authorizations.append(self.headers.get("Authorization"))
                try:
                    origin.behaviour(self, origin)
                except OSError:
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _send(handler: Any, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
    handler.send_response(status)
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    if "Content-Length" not in (headers or {}):
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
    handler.wfile.flush()


def _serve(handler: Any, data: bytes, extra: bytes = b"", honour_range: bool = True) -> None:
    wanted = handler.headers.get("Range")
    start = int(wanted.split("=")[1].rstrip("-")) if wanted and honour_range else 0
    if start:
        rng = f"bytes {start}-{len(data) - 1}/{len(data)}"
        _send(handler, 206, data[start:] + extra, {"Content-Range": rng})
    else:
        _send(handler, 200, data + extra)


def _behaviours(rng: random.Random, data: bytes, cdn: str) -> tuple[str, Any]:
    """One hostile (or fine) way for a server to answer a download."""
    kind = rng.choice(
        [
            "fine",
            "redirect-cross",
            "redirect-same",
            "redirect-loop",
            "redirect-scheme",
            "status",
            "longer",
            "shorter",
            "bad-range",
            "ignore-range",
            "reset",
            "stall",
            "drip-body",
            "drip-headers",
            "bad-length",
        ]
    )
    if kind == "fine":
        return kind, lambda h, o: _serve(h, data)
    if kind == "redirect-cross":
        hops = rng.randint(1, 3)

        def cross(h: Any, o: Any) -> None:
            _send(h, rng.choice([301, 302, 303, 307, 308]), b"", {"Location": cdn + "/x" * hops})

        return kind, cross
    if kind == "redirect-same":
        return (
            kind,
            lambda h, o: (
                _serve(h, data)
                if h.path.endswith("/here")
                else _send(h, 302, b"", {"Location": "/here"})
            ),
        )
    if kind == "redirect-loop":
        return kind, lambda h, o: _send(h, 302, b"", {"Location": h.path + "x"})
    if kind == "redirect-scheme":
        target = rng.choice(["file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://x/"])
        return kind, lambda h, o: _send(h, 302, b"", {"Location": target})
    if kind == "status":
        status = rng.choice([400, 401, 403, 404, 416, 429, 500, 502, 503])
        return kind, lambda h, o: _send(h, status, b"{" * rng.randint(0, 5000))
    if kind == "longer":
        extra = os.urandom(rng.randint(1, 300_000))
        return kind, lambda h, o: _serve(h, data, extra)
    if kind == "shorter":
        cut = rng.randint(0, len(data) - 1)
        return kind, lambda h, o: _send(h, 200, data[:cut])
    if kind == "bad-range":
        lie = rng.choice(["bytes 0-9/10", "bytes 5-", "junk", "bytes 99999999-1/2"])
        return kind, lambda h, o: _send(h, 206, data[:100], {"Content-Range": lie})
    if kind == "ignore-range":
        return kind, lambda h, o: _serve(h, data, honour_range=False)
    if kind == "reset":
        cut = rng.randint(0, len(data))

        def reset(h: Any, o: Any) -> None:
            h.send_response(200)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data[:cut])
            h.wfile.flush()
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            h.connection.close()

        return kind, reset
    if kind == "stall":

        def stall(h: Any, o: Any) -> None:
            h.send_response(200)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data[: len(data) // 3])
            h.wfile.flush()
            o.stop.wait(10)

        return kind, stall
    if kind in ("drip-body", "drip-headers"):

        def drip(h: Any, o: Any) -> None:
            if kind == "drip-body":
                h.send_response(200)
                h.send_header("Content-Length", str(len(data)))
                h.end_headers()
                h.wfile.flush()
                body = data
            else:
                body = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"z" * 10_000
            for at in range(len(body)):
                if o.stop.is_set():
                    return
                h.wfile.write(body[at : at + 1])
                h.wfile.flush()
                time.sleep(0.02)

        return kind, drip
    length = rng.choice(["-1", "abc", str(1 << 70), "1e9"])
    return kind, lambda h, o: _send(h, 200, data, {"Content-Length": length})


def _partial_kind(rng: random.Random, partial: Path, outside: Path, data: bytes) -> str:
    kind = rng.choice(["none", "none", "own", "own-longer", "link", "dangling", "fifo", "dir"])
    if kind == "own":
        partial.write_bytes(data[: rng.randint(1, len(data) - 1)])
    elif kind == "own-longer":
        partial.write_bytes(data + b"junk")
    elif kind == "link":
        os.symlink(outside, partial)
    elif kind == "dangling":
        os.symlink(outside.parent / "nowhere", partial)
    elif kind == "fifo":
        os.mkfifo(partial)
    elif kind == "dir":
        partial.mkdir()
    return kind


def _download_case(seed: int, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(hub_download, "RATE_WINDOW_S", 0.5)
    monkeypatch.setattr(hub_download, "MIN_RATE", 4096)
    monkeypatch.setattr(hub_download, "HEADERS_S", 1.5)
    monkeypatch.setattr(hub_download, "STALL_S", 1.5)
    data = os.urandom(rng.randint(1, 200_000))
    case = root / f"case{seed}"
    models = case / "models"
    models.mkdir(parents=True)
    outside = case / "outside.txt"
    outside.write_bytes(b"not yours")
    partial = models / ".m.gguf.partial"
    partial_kind = _partial_kind(rng, partial, outside, data)
    hub, cdn = Origin(), Origin()
    kind, hub.behaviour = _behaviours(rng, data, cdn.base)
    cdn.behaviour = lambda h, o: _serve(h, data)
    size = len(data) if rng.random() < 0.8 else None
    started = time.monotonic()
    outcome: str
    try:
        download(
            hub.base + "/resolve/main/m.gguf",
            {"Authorization": f"Bearer {TOKEN}"},
            partial,
            size,
            "m.gguf",
            room=1 << 20,
        )
        outcome = "done"
    except KvchatError as exc:
        outcome = str(exc)
        assert "\n" not in outcome and outcome, (kind, partial_kind)
    finally:
        hub.close()
        cdn.close()
    took = time.monotonic() - started
    where = f"seed {seed}: {kind}, partial {partial_kind}, size {size}: {outcome[:200]}"
    assert took < 15, where
    assert outside.read_bytes() == b"not yours", where
    assert all(auth is None for auth in cdn.authorizations), where
    if partial_kind in ("link", "dangling", "fifo", "dir"):
        assert outcome != "done", where
        assert not (outside.parent / "nowhere").exists(), where
    if outcome == "done" and size is not None:  # exactly what was published
        assert partial.read_bytes() == data, where
    elif outcome == "done":  # no size known (--no-verify): what the server sent, capped
        assert partial.stat().st_size <= max(1 << 20, len(data) + 4), where
    elif partial.is_file() and not partial.is_symlink() and size is not None:
        assert partial.stat().st_size <= size, where


class _Item:
    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


class _Api:
    def __init__(self, paths: Any, info: Any) -> None:
        self._paths, self._info = paths, info

    def get_paths_info(self, repo: str, files: list[str]) -> Any:
        if isinstance(self._paths, BaseException):
            raise self._paths
        return self._paths

    def model_info(self, repo: str, files_metadata: bool = False) -> Any:
        if isinstance(self._info, BaseException):
            raise self._info
        return self._info


def _published_case(seed: int) -> None:
    rng = random.Random(seed)
    good = hashlib.sha256(str(seed).encode()).hexdigest()
    shas: list[Any] = [good, good.upper(), "0" * 63, "g" * 64, 5, None, ["x"], good + "\n", ""]
    sizes: list[Any] = [10, 0, -1, True, "12", 1 << 70, 2.5, None]
    failures: list[BaseException] = [
        ValueError("bad json"),
        RecursionError("deep"),
        OverflowError("inf"),
        UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogate"),
        KeyError("siblings"),
    ]

    def item(name: str = "m.gguf") -> Any:
        lfs: Any = rng.choice([{"sha256": rng.choice(shas)}, None, "lfs", 7])
        return _Item(path=name, rfilename=name, size=rng.choice(sizes), lfs=lfs)

    paths: Any = rng.choice([[item()], [item("other")], [], failures[rng.randrange(5)]])
    siblings: Any = rng.choice([[item()], None, [item("other"), item()]])
    info: Any = rng.choice([_Item(siblings=siblings), failures[rng.randrange(5)]])
    hub = _Item(HfApi=lambda: _Api(paths, info))
    facts = published(hub, "acme/repo", "m.gguf")
    assert isinstance(facts, Published)
    assert facts.sha256 is None or (len(facts.sha256) == 64 and facts.sha256 == good), facts
    assert facts.size is None or (type(facts.size) is int and 0 < facts.size < 1 << 62), facts
    assert facts.sha256 is not None or (facts.problem and "\n" not in facts.problem), facts


CAMPAIGN = 240
SAMPLE = range(0, CAMPAIGN, CAMPAIGN // 20)


@pytest.mark.parametrize("seed", SAMPLE)
def test_hostile_downloads_sample(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _download_case(seed, tmp_path, monkeypatch)
    _published_case(seed)


@pytest.mark.stress
@pytest.mark.parametrize("seed", range(CAMPAIGN))
def test_hostile_downloads_campaign(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _download_case(seed, tmp_path, monkeypatch)
    _published_case(seed)
