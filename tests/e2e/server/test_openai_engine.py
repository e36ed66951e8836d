"""Any OpenAI-compatible server as the engine, against a real
llama-server's ``/v1/chat/completions``: no mock server.

One llama-server (the binary ``kvchat server build`` makes, on the bundled model, with an
API key and ``--ignore-eos`` so every reply runs to its token limit) serves the module; a
small recording proxy in front of it keeps each request body and reply stream as they went
over the wire, so the tests compare kvchat's figures with the server's own numbers and
check what was sent.
"""

from __future__ import annotations

import http.client
import json
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvchat.engine.openai import figures_of, read_chunk
from kvchat.service.chat import ChatService
from kvchat.service.reports import TokenCounts
from tests.conftest import REPO, clean_env, run_cli, run_cli_here
from tests.e2e.server.test_server import Server
from tests.helpers import greedy_service

KEY = "team-key-7"
KEYED = {"KVCHAT_OPENAI_API_KEY": KEY}
GREEDY = ["--temperature", "0", "--max-tokens", "12"]


@dataclass
class Exchange:
    path: str
    request: bytes
    reply: bytes

    def events(self) -> list[dict[str, Any]]:
        """The reply stream's JSON events (``data: {...}`` lines)."""
        found = []
        for line in self.reply.decode().splitlines():
            if line.startswith("data: {"):
                found.append(json.loads(line[len("data: ") :]))
        return found


class RecordingProxy:
    """Forwards every request to ``upstream`` as it is and keeps what went each way."""

    def __init__(self, upstream: str) -> None:
        self.exchanges: list[Exchange] = []
        parts = urlsplit(upstream)
        host, port = parts.hostname or "", parts.port
        exchanges = self.exchanges

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size) if size else None
                upstream_conn = http.client.HTTPConnection(host, port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                upstream_conn.request(self.command, self.path, body=body, headers=headers)
                reply = upstream_conn.getresponse()
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(name, value)
                self.send_header("Connection", "close")
                self.end_headers()
                kept = b""
                listening = True
                while True:
                    line = reply.readline()
                    if not line:
                        break
                    kept += line
                    if not listening:
                        continue  # kvchat hung up once it had what it needed: still recorded
                    try:
                        self.wfile.write(line)
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        listening = False
                upstream_conn.close()
                exchanges.append(Exchange(self.path, body or b"", kept))

            do_GET = _forward
            do_POST = _forward

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def chats(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.path.endswith("/chat/completions")]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(
        tmp_path_factory.mktemp("openai") / "slots",
        slots=1,
        extra=("--api-key", KEY, "--ignore-eos"),
    )
    yield running
    running.stop()


@pytest.fixture
def proxy(server: Server) -> Iterator[RecordingProxy]:
    recording = RecordingProxy(server.url)
    yield recording
    recording.close()


def ask(home: Path, url: str, *args: str, check: bool = True, **env: str):  # type: ignore[no-untyped-def]
    return run_cli_here(home, "--openai", f"{url}/v1", "ask", *args, *GREEDY, env=env, check=check)


def stored(home: Path, role: str) -> list[tuple[str, str, int]]:
    conn = sqlite3.connect(home / "kvchat.db")
    rows = conn.execute(
        "SELECT content, reasoning, partial FROM messages WHERE role = ? ORDER BY id", (role,)
    ).fetchall()
    conn.close()
    return [(r[0], r[1] or "", int(r[2])) for r in rows]


def usage_of(exchange: Exchange) -> dict[str, Any]:
    (last,) = [e for e in exchange.events() if e.get("usage")]
    return last


def test_ask_streams_stores_and_shows_the_servers_cached_tokens_on_turn_two(
    proxy: RecordingProxy, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    first = ask(home, proxy.url, "Hi", **KEYED)
    reply = first.stdout.strip()
    assert reply and [(c.strip(), r, p) for c, r, p in stored(home, "assistant")] == [
        (reply, "", 0)
    ]
    assert "OpenAI-compatible server" in first.stderr and "not kvchat's" in first.stderr
    conn = sqlite3.connect(home / "kvchat.db")
    (session,) = conn.execute("SELECT id FROM sessions").fetchone()
    conn.close()
    second = ask(home, proxy.url, "--session", session, "And then?", "--json", **KEYED).json
    server_said = usage_of(proxy.chats()[1])
    cached = server_said["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert second["tokens"]["reused"] == cached
    assert second["tokens"]["prompt"] == server_said["usage"]["prompt_tokens"]
    assert second["tokens"]["decoded"] == server_said["timings"]["prompt_n"]
    assert second["tokens"]["generated"] == 12  # --ignore-eos: the whole budget
    assert second["remote"] == {"url": f"{proxy.url}/v1", "figures": "usage+timings", "note": None}
    assert second["restore"]["from"] == "none" and "not kvchat's" in second["restore"]["reason"]
    assert second["snapshot"]["bytes"] == 0
    assert [c for c, _, _ in stored(home, "user")] == ["Hi", "And then?"]
    cache = run_cli(home, "--openai", f"{proxy.url}/v1", "cache").stdout
    assert cache.count("\n") == 1 and "not kvchat's" in cache and "no snapshot" in cache


def remote_service(home: Path, url: str, **settings: Any) -> ChatService:
    """A service over ``home`` whose engine is the server at ``url`` (the caller closes it)."""
    return greedy_service(
        home, engine="openai", openai_url=f"{url}/v1", openai_api_key=KEY, **settings
    )


def one_turn(home: Path, url: str, text: str = "Hi") -> str:
    """A session with one answered turn, made in this process; its id."""
    service = remote_service(home, url)
    try:
        return service.start(text, max_tokens=4).session_id
    finally:
        service.close()


def test_the_request_prefix_is_byte_stable_and_carries_session_affinity(
    proxy: RecordingProxy, kvhome: Path
) -> None:
    service = remote_service(kvhome, proxy.url, max_tokens=4)
    try:
        report = service.start("Hi", system_prompt="Be brief.", seed=1)
        session = report.session_id
        service.send(session, "More?", seed=2)
        service.sessions.configure(session, settings={"think": True})
        service.send(session, "Why?")
        last_sent = service.engine.last_request  # type: ignore[attr-defined]
    finally:
        service.close()
    bodies = [e.request for e in proxy.chats()]
    assert last_sent == bodies[-1]  # the engine's copy is the bytes that went out
    assert len(bodies) == 3
    for earlier, later in zip(bodies, bodies[1:]):
        # The earlier request up to the end of its last message is where the later starts.
        prefix = earlier[: earlier.index(b'}], "stream"') + 1]
        assert later.startswith(prefix)
    sent = [json.loads(b) for b in bodies]
    assert [len(s["messages"]) for s in sent] == [2, 4, 6]  # system, then two per turn
    assert sent[2]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert all(set(m) == {"role", "content"} for s in sent for m in s["messages"])
    assert all(s["prompt_cache_key"] == session for s in sent)
    assert all(s["id_slot"] == 0 and s["cache_prompt"] is True for s in sent)
    assert [s.get("chat_template_kwargs") for s in sent] == [
        None,
        None,
        {"enable_thinking": True},
    ]
    assert all(KEY.encode() not in b for b in bodies)


def test_cancel_mid_reply_keeps_the_message_and_the_part_said(server: Server, kvhome: Path) -> None:
    service = remote_service(kvhome, server.url, max_tokens=200)
    pieces: list[str] = []
    try:
        session = service.sessions.new_session()
        report = service.send(
            session.id, "Tell me a story.", on_token=pieces.append, cancel=lambda: len(pieces) >= 3
        )
        messages = service.sessions.messages(session.id)
    finally:
        service.close()
    assert report.finish_reason == "cancelled"
    assert len(pieces) == 3 and report.reply == "".join(pieces)
    assert [(m.role, m.content, m.partial) for m in messages] == [
        ("user", "Tell me a story.", False),
        ("assistant", report.reply, True),
    ]
    # The stream was closed before the server's last chunk: it reported no figures.
    assert report.to_json()["tokens"]["reused"] is None
    assert "reused not reported" in report.summary()


def test_a_wrong_key_is_one_clear_line_and_the_message_stays(server: Server, kvhome: Path) -> None:
    home = kvhome
    session = one_turn(home, server.url)
    wrong = ask(home, server.url, "--session", session, "Still there?", check=False,
                KVCHAT_OPENAI_API_KEY="not-the-key")  # fmt: skip
    assert wrong.returncode == 2
    assert wrong.stderr.count("\n") == 1 and "Traceback" not in wrong.stderr
    assert "refused the API key" in wrong.stderr and "KVCHAT_OPENAI_API_KEY" in wrong.stderr
    assert "your message is saved" in wrong.stderr and "not-the-key" not in wrong.stderr
    assert [c for c, _, _ in stored(home, "user")] == ["Hi", "Still there?"]
    config = run_cli(home, "--openai", f"{server.url}/v1", "config", env=KEYED).stdout
    assert KEY not in config and "(set)" in config


def test_the_servers_figures_or_not_reported() -> None:
    both = figures_of(
        {
            "prompt_tokens": 46,
            "completion_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 45},
        },
        {"cache_n": 45, "prompt_n": 1},
    )
    assert (both.prompt, both.reused, both.decoded, both.generated) == (46, 45, 1, 8)
    usage_only = figures_of({"prompt_tokens": 30, "completion_tokens": 5}, None)
    assert (usage_only.prompt, usage_only.reused, usage_only.decoded) == (30, None, None)
    timings_only = figures_of(None, {"cache_n": 20, "prompt_n": 4})
    assert (timings_only.prompt, timings_only.reused, timings_only.decoded) == (24, 20, 4)
    none = figures_of(None, None)
    assert (none.prompt, none.reused, none.source) == (None, None, "")
    counts = TokenCounts(30, 0, 0, 5, unreported=("reused", "decoded"))
    assert counts.shown("reused") == "not reported" and counts.value("prompt") == 30
    chunk = read_chunk(
        {"choices": [{"delta": {"reasoning_content": "Let me see.", "content": None}}]}
    )
    assert (chunk.reasoning, chunk.content, chunk.finish_reason) == ("Let me see.", "", None)


def test_a_server_killed_mid_reply_keeps_the_part_shown_and_says_so(
    server: Server, kvhome: Path
) -> None:
    """The reply shown before the server died is stored as it was shown, marked partial,
    and the status line says the server broke off (issue 37, item 4: it was not stored)."""
    home = kvhome
    session = one_turn(home, server.url)
    env = clean_env()
    env.update(KVCHAT_HOME=str(home), **KEYED)
    argv = ["--openai", f"{server.url}/v1", "ask", "--session", session, "Tell me a story."]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", *argv, "--max-tokens", "900"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Unbuffered: a buffered read(1) keeps the rest of what it read ("ne" of "One") in a
        # buffer communicate() then bypasses, so the test saw less than was shown.
        bufsize=0,
    )
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    assert first  # the reply is streaming
    server.stop(signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        server.start()  # for whatever runs after
    stderr = err.decode()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "OpenAI-compatible server" in stderr and "saved, marked partial" in stderr
    assert [c for c, _, _ in stored(home, "user")] == ["Hi", "Tell me a story."]
    said = stored(home, "assistant")[-1]
    assert said[0].strip() and said[0].strip() in (first + out).decode() and said[2] == 1


async def test_the_app_replies_through_the_server_and_says_whose_kv_it_is(
    server: Server, kvhome: Path
) -> None:
    from kvchat.config import Settings
    from kvchat.tui.app import KvchatApp
    from tests.e2e.tui.test_tui import SIZE, quit_app, ready, send, wait_until

    settings = Settings(
        temperature=0, max_tokens=8, openai_url=f"{server.url}/v1", openai_api_key=KEY
    )
    app = KvchatApp(settings, cursor_blink=False)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        # "ready · OpenAI-compatible server … not kvchat's …" once the engine is up
        await wait_until(lambda: "loading" not in main.status.turn_text)
        status = main.status.turn_text
        assert f"OpenAI-compatible server {server.url}/v1" in status and "not kvchat's" in status
        reply = await send(pilot, main, "Hi! What is 2+2?")
        assert reply.role == "assistant" and reply.text.strip()
        assert main.last_report is not None and main.last_report.remote == f"{server.url}/v1"
        assert main.last_report.tokens.generated == 8  # --ignore-eos: the whole budget
        await quit_app(app)
    assert app.worker_errors == []
