"""A hostile or broken llama-server: whatever its JSON and SSE say, a
turn ends in a clean reply or one KvchatError line, in bounded time, and nothing it sent
reaches the database unchecked.

A fake llama-server on 127.0.0.1, in a thread, answers ``/props``, ``/v1/models``,
``/tokenize``, ``/apply-template``, ``/completion`` (server-sent events, with a slot that
remembers its tokens, so cache figures are a real server's) and the slot actions; a case
replaces one of its answers (or one event of a stream) with hostile bytes. A turn runs
through :class:`kvchat.service.chat.ChatService` with ``engine llama-server`` in this
process, on a worker thread with a deadline; the second turn of a case restores the first
turn's slot file (so the restore and its KV check meet the hostile answers too). The named
cases are the classes the OpenAI campaign found; the generated campaign (``stress``) mixes
hostile values into every field kvchat reads, a sample of it runs by default.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvchat.config import load_settings
from kvchat.errors import KvchatError
from kvchat.service.chat import ChatService
from tests.faults.hostile_http import LocalServer, RawHandler, is_one_clean_line
from tests.faults.hostile_http import sse as _sse

MAX_TOKENS = 8
IDLE_S, TOTAL_S, REQUEST_S = 1.0, 3.0, 2.0
TURN_DEADLINE_S = 30.0
N_CTX = 4096

Writer = Callable[["Handler"], None]


# --- the fake server -------------------------------------------------------------------------


def sse(*events: Any, done: bool = False) -> bytes:
    """llama-server's stream: its events, ``[DONE]`` only where asked."""
    return _sse(*events, done=done)


def _tokens(text: str) -> list[int]:
    return [(ord(c) % 997) + 3 for c in text]


def _top(prompt: list[int]) -> list[dict[str, Any]]:
    digest = hashlib.sha256(json.dumps(prompt).encode()).digest()
    return [{"id": int(b) + 1, "token": "x", "logprob": -(1 + b) / 7.0} for b in digest[:4]]


PROPS = {
    "default_generation_settings": {"n_ctx": N_CTX},
    "total_slots": 1,
    "model_path": "/models/fake.gguf",
    "model_ftype": "F16",
    "build_info": "b1-fake",
    "bos_token": "",
}
MODELS = {"data": [{"id": "fake", "meta": {"size": 5_000_000_000, "n_params": 7, "n_vocab": 1000}}]}


@dataclass
class Case:
    """One case: ``kind`` names the request whose answer is replaced by ``body`` (bytes or
    a writer); ``turn`` 2: only in the second turn (the first turn saved a slot file)."""

    name: str
    kind: str = ""
    body: bytes | Writer = b""
    status: int = 200
    turn: int = 1
    tags: tuple[str, ...] = field(default_factory=tuple)


class Handler(RawHandler):
    server: FakeServer

    def _answer(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        request = json.loads(self.rfile.read(size)) if size else {}
        path = urlsplit(self.path)
        kind, good = self.server.good(path.path, path.query, request)
        case = self.server.case
        try:
            if case.kind == kind and self.server.turn >= case.turn:
                if callable(case.body):
                    case.body(self)
                else:
                    stream = kind in ("prefill", "generate", "check")
                    self.raw(case.status, case.body, "text/event-stream" if stream else "")
                return
            stream = kind in ("prefill", "generate", "check")
            self.raw(200, good, "text/event-stream" if stream else "application/json")
        except OSError:
            pass

    do_GET = _answer
    do_POST = _answer


class FakeServer(LocalServer):
    def __init__(self) -> None:
        self.case = Case("good")
        self.turn = 1
        self.slot: list[int] = []
        self.files: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        super().__init__(Handler)

    def reset(self, case: Case) -> None:
        with self.lock:
            self.case, self.turn, self.slot, self.files = case, 1, [], {}

    def good(self, path: str, query: str, request: dict[str, Any]) -> tuple[str, bytes]:
        """Which request this is, and what a llama-server would answer."""
        with self.lock:
            return self._good(path, query, request)

    def _good(self, path: str, query: str, request: dict[str, Any]) -> tuple[str, bytes]:
        if path == "/props":
            return "props", json.dumps(PROPS).encode()
        if path == "/v1/models":
            return "models", json.dumps(MODELS).encode()
        if path == "/tokenize":
            text = str(request.get("content", ""))
            tokens = _tokens(text)
            if request.get("with_pieces"):
                pieces = [{"id": t, "piece": c} for t, c in zip(tokens, text, strict=True)]
                return "tokenize", json.dumps({"tokens": pieces}).encode()
            return "tokenize", json.dumps({"tokens": tokens}).encode()
        if path == "/apply-template":
            prompt = "".join(f"<{m['role']}>{m['content']}\n" for m in request["messages"])
            return "template", json.dumps({"prompt": prompt + "<assistant>"}).encode()
        if path.startswith("/slots/"):
            name = str(request.get("filename", ""))
            if "action=save" in query:
                self.files[name] = list(self.slot)
                body = {"n_saved": len(self.slot), "n_written": 100 * len(self.slot) + 7}
                return "save", json.dumps(body).encode()
            if "action=restore" in query:
                saved = self.files.get(name)
                if saved is None:
                    return "restore", b'{"error": {"code": 400, "message": "no such file"}}'
                self.slot = list(saved)
                body = {"n_restored": len(saved), "n_read": 100 * len(saved) + 7}
                return "restore", json.dumps(body).encode()
            self.slot = []
            return "erase", b"{}"
        # /completion
        prompt = [int(t) for t in request.get("prompt", [])]
        keep = 0
        if request.get("cache_prompt"):
            while keep < min(len(self.slot), len(prompt)) and self.slot[keep] == prompt[keep]:
                keep += 1
            keep = min(keep, len(prompt) - 1)
        n_predict = int(request.get("n_predict", 0))
        timings = {"cache_n": keep, "prompt_n": len(prompt) - keep, "predicted_per_second": 50.0}
        self.slot = list(prompt)
        if request.get("n_probs"):
            kind = "check"
            events: list[Any] = [
                {"content": "x", "tokens": [9], "stop": False, "completion_probabilities": [
                    {"id": 9, "logprob": -0.1, "top_logprobs": _top(prompt)}
                ]},
            ]  # fmt: skip
            final = {"stop": True, "stop_type": "limit", "tokens_predicted": 1}
        elif n_predict == 0:
            kind, events = "prefill", [{"prompt_progress": {"total": len(prompt)}, "tokens": [0]}]
            final = {"stop": True, "stop_type": "limit", "tokens_predicted": 0}
        else:
            kind = "generate"
            events = [
                {"content": "Alpha ", "tokens": [11], "stop": False},
                {"content": "beta", "tokens": [12], "stop": False},
            ]
            self.slot += [11, 12]
            final = {"stop": True, "stop_type": "eos", "tokens_predicted": 3}
        final.update(
            {"content": "", "tokens": [], "tokens_cached": len(self.slot), "timings": timings}
        )
        return kind, sse(*events, final)


@pytest.fixture(scope="module")
def fake() -> Any:
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def short_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second of silence, three seconds per stream, two per request."""
    from kvchat.engine import server_http

    monkeypatch.setattr(server_http, "STREAM_TIMEOUT_S", IDLE_S)
    monkeypatch.setattr(server_http, "STREAM_TOTAL_S", TOTAL_S, raising=False)
    monkeypatch.setattr(server_http, "REQUEST_TIMEOUT_S", REQUEST_S)


# --- one case, and what must hold -----------------------------------------------------------------


@dataclass
class Turn:
    shown: str
    error: BaseException | None
    report: Any


@dataclass
class Outcome:
    turns: list[Turn]
    seconds: float
    rows: list[tuple[str, str, int]]
    slots: list[tuple[bytes, int, int | None]]


def run_turns(server: FakeServer, case: Case, home: Path) -> Outcome:
    server.reset(case)
    settings = {
        "engine": "llama-server",
        "server_url": server.url,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "auto_title": False,
    }
    turns: list[Turn] = []

    def work() -> None:
        session_id = None
        for number in (1, 2):
            server.turn = number
            shown: list[str] = []
            error: BaseException | None = None
            report = None
            try:
                service = ChatService(load_settings(**settings), home=home)
            except BaseException as exc:  # noqa: BLE001 (what the case is about)
                turns.append(Turn("", exc, None))
                continue
            try:
                if session_id is None:
                    session_id = service.sessions.new_session().id
                report = service.send(session_id, f"Hi {number}", on_token=shown.append)
            except BaseException as exc:  # noqa: BLE001
                error = exc
            finally:
                try:
                    service.close()
                except BaseException as exc:  # noqa: BLE001
                    error = error or exc
            turns.append(Turn("".join(shown), error, report))

    started = time.monotonic()
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(TURN_DEADLINE_S)
    seconds = time.monotonic() - started
    assert not worker.is_alive(), f"{case.name}: the turns ran past {TURN_DEADLINE_S} s"
    rows: list[tuple[str, str, int]] = []
    slots: list[tuple[bytes, int, int | None]] = []
    if (home / "kvchat.db").exists():
        conn = sqlite3.connect(home / "kvchat.db")
        rows = [
            (r[0], r[1], int(r[2]))
            for r in conn.execute("SELECT role, content, partial FROM messages ORDER BY id")
        ]
        slots = list(conn.execute("SELECT token_ids, n_bytes, n_exact FROM server_slots"))
        conn.close()
    return Outcome(turns, seconds, rows, slots)


def check(outcome: Outcome, name: str) -> None:
    for number, turn in enumerate(outcome.turns, 1):
        error = turn.error
        assert error is None or isinstance(error, KvchatError), (
            f"{name} turn {number}: {type(error).__name__}: {error}"
        )
        if error is not None:
            assert is_one_clean_line(str(error)), f"{name}: {str(error)!r}"
            continue
        report = turn.report
        if report is None:
            continue
        assert is_one_clean_line(report.summary()), f"{name}: {report.summary()!r}"
        json.dumps(report.to_json(), allow_nan=False)
        tokens = report.tokens
        values = {n: tokens.value(n) for n in ("prompt", "reused", "decoded", "generated")}
        for figure, value in values.items():
            assert value is None or 0 <= value <= 10**9, f"{name}: {figure} = {value}"
        if values["prompt"] is not None:
            for part in ("reused", "decoded"):
                assert values[part] is None or values[part] <= values["prompt"], (name, values)
        assert report.tokens_per_s is None or 0 <= report.tokens_per_s < 10**10
    # What was shown is what is stored (a reply shown, then broken off, stays partial).
    stored = [content for role, content, _ in outcome.rows if role == "assistant"]
    shown = [t.shown for t in outcome.turns if t.shown]
    assert all(any(s.startswith(c) or c.startswith(s) for s in shown) for c in stored), (
        name,
        stored,
        shown,
    )
    for content in stored:
        assert not any(0xD800 <= ord(c) <= 0xDFFF for c in content), name
    for blob, n_bytes, n_exact in outcome.slots:
        assert len(blob) % 4 == 0 and 0 <= n_bytes <= 2**53, name
        assert n_exact is None or 0 <= n_exact <= len(blob) // 4, name


def run_case(server: FakeServer, case: Case, home: Path) -> Outcome:
    outcome = run_turns(server, case, home)
    check(outcome, case.name)
    return outcome


# --- writers for streams that take their time ---------------------------------------------------


def dripping(lines: list[bytes], every_s: float, forever: bool = False) -> Writer:
    def write(handler: Handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for line in lines:
                handler.wfile.write(line)
                handler.wfile.flush()
                time.sleep(every_s)
            if not forever:
                return

    return write


def slow_headers(handler: Handler) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n":
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        time.sleep(0.2)


# --- named cases ----------------------------------------------------------------------------


def test_a_good_server_gives_a_reply_and_a_checked_restore(fake: FakeServer, kvhome: Path) -> None:
    outcome = run_case(fake, Case("good"), kvhome)
    assert [t.error for t in outcome.turns] == [None, None]
    assert [t.shown for t in outcome.turns] == ["Alpha beta", "Alpha beta"]
    second = outcome.turns[1].report
    assert second.restore.source == "server", second.restore  # the KV check passed
    assert outcome.slots and outcome.slots[0][1] > 0


def test_a_restore_whose_kv_gives_other_figures_is_not_used(fake: FakeServer, kvhome: Path) -> None:
    """The fake's log-probabilities after the restore differ from those at the save."""
    other = sse(
        {"content": "x", "tokens": [9], "completion_probabilities": [
            {"id": 9, "logprob": -0.1, "top_logprobs": [{"id": 4, "logprob": -0.25}]}
        ]},
    )  # fmt: skip

    def changed(handler: Handler) -> None:
        size = len(fake.slot)
        final = {"stop": True, "tokens_cached": size, "timings": {"cache_n": size - 64 if size > 64 else 0, "prompt_n": 64}}  # fmt: skip
        handler.raw(200, other + sse(final), "text/event-stream")

    outcome = run_case(fake, Case("changed KV", "check", changed, turn=2), kvhome)
    second = outcome.turns[1]
    assert second.error is None and second.report.restore.source == "none"
    assert "full prefill" in (second.report.restore.reason or "")


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("props", b'{"default_generation_settings": {"n_ctx": 1e999}}'),
        ("props", b'{"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1000000000}'),
        ("props", b"[" * 200_000),
        ("props", b'{"default_generation_settings": {"n_ctx": "4096"}}'),
        ("models", b'{"data": [{"meta": {"size": NaN}}]}'),
        ("tokenize", b'{"tokens": [1e30]}'),
        ("tokenize", b'{"tokens": ["a"]}'),
        ("template", b'{"prompt": 5}'),
        ("save", b'{"n_saved": "abc", "n_written": 1}'),
        ("save", b'{"n_saved": 1e999}'),
        ("restore", b'{"n_restored": Infinity}'),
        ("generate", sse({"content": 5, "stop": False})),
        ("generate", sse({"content": "hi", "tokens": [10**30], "stop": False})),
        ("generate", sse({"content": "\\ud800", "stop": False})),
        ("prefill", sse({"stop": True, "timings": {"cache_n": -5, "prompt_n": 3}})),
        ("prefill", sse({"stop": True, "timings": {"cache_n": 10**12, "prompt_n": 3}})),
    ],
)
def test_named_hostile_shapes_are_one_line(
    fake: FakeServer, kvhome: Path, kind: str, body: bytes
) -> None:
    turn = 2 if kind == "restore" else 1
    run_case(fake, Case(f"{kind} {body[:40]!r}", kind, body, turn=turn), kvhome)


def test_a_stream_that_never_ends_is_cut_off(fake: FakeServer, kvhome: Path) -> None:
    line = b'data: {"content": "a", "tokens": [5], "stop": false}\n\n'
    outcome = run_case(fake, Case("endless", "generate", dripping([line], 0.01, True)), kvhome)
    assert outcome.seconds < TOTAL_S * 2 + 10


def test_keepalives_alone_do_not_hold_a_stream(fake: FakeServer, kvhome: Path) -> None:
    outcome = run_case(
        fake, Case("keep-alives", "prefill", dripping([b": keep-alive\n\n"], 0.1, True)), kvhome
    )
    error = outcome.turns[0].error
    assert error is not None and "no event for" in str(error), error


def test_headers_a_byte_at_a_time_are_cut_off(fake: FakeServer, kvhome: Path) -> None:
    outcome = run_case(fake, Case("slow headers", "props", slow_headers), kvhome)
    assert outcome.turns[0].error is not None


def test_a_huge_event_is_refused(fake: FakeServer, kvhome: Path) -> None:
    huge = b'data: {"content": "' + b"x" * (2 * 1024 * 1024) + b'"}\n\n'
    outcome = run_case(fake, Case("huge event", "generate", huge), kvhome)
    error = outcome.turns[0].error
    assert error is not None and "longer than 1,048,576 bytes" in str(error), error


# --- the generated campaign ---------------------------------------------------------------------

HOSTILE_VALUES: list[bytes] = [
    b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1", b"0.5", b"1" + b"0" * 30, b"9" * 5000,
    b"true", b"null", b'"fast"', b'"12"', b"[]", b"{}", b"[" * 40 + b"1" + b"]" * 40,
    b'"\\ud800"', b'"\\u001b[2J\\u001b]0;owned\\u0007"', b'"' + b"x" * 70_000 + b'"',
    b"2147483648", b"4294967295", b"1000000001", b"0",
]  # fmt: skip

# (request kind, template with {} where the value goes).
SLOTS: list[tuple[str, str]] = [
    ("props", '{{"default_generation_settings": {{"n_ctx": {}}}, "total_slots": 1}}'),
    ("props", '{{"default_generation_settings": {{"n_ctx": 4096}}, "total_slots": {}}}'),
    ("props", '{{"default_generation_settings": {{"n_ctx": 4096}}, "model_path": {}}}'),
    ("props", '{{"default_generation_settings": {{"n_ctx": 4096}}, "model_ftype": {}}}'),
    ("props", '{{"default_generation_settings": {{"n_ctx": 4096}}, "bos_token": {}}}'),
    ("props", '{{"default_generation_settings": {}}}'),
    ("props", "{}"),
    ("models", '{{"data": {}}}'),
    ("models", '{{"data": [{{"meta": {}}}]}}'),
    ("models", '{{"data": [{{"meta": {{"size": {}}}}}]}}'),
    ("models", '{{"data": [{{"meta": {{"n_vocab": {}}}}}]}}'),
    ("tokenize", '{{"tokens": {}}}'),
    ("tokenize", '{{"tokens": [1, {}]}}'),
    ("tokenize", '{{"tokens": [{{"id": {}, "piece": "ab"}}]}}'),
    ("template", '{{"prompt": {}}}'),
    ("template", "{}"),
    ("save", '{{"n_saved": {}, "n_written": 10}}'),
    ("save", '{{"n_saved": 3, "n_written": {}}}'),
    ("save", "{}"),
    ("restore", '{{"n_restored": {}, "n_read": 10}}'),
    ("restore", '{{"n_restored": 3, "n_read": {}}}'),
    ("restore", "{}"),
    ("generate", '{{"content": {}, "tokens": [5], "stop": false}}'),
    ("generate", '{{"content": "a", "tokens": {}, "stop": false}}'),
    ("generate", '{{"content": "a", "tokens": [{}], "stop": false}}'),
    ("generate", '{{"content": "", "stop": {}}}'),
    ("generate", '{{"stop": true, "tokens_predicted": {}, "tokens_cached": 3}}'),
    ("generate", '{{"stop": true, "tokens_cached": {}}}'),
    ("generate", '{{"stop": true, "stop_type": {}}}'),
    ("generate", '{{"stop": true, "truncated": {}}}'),
    ("generate", '{{"stop": true, "timings": {}}}'),
    ("generate", '{{"stop": true, "timings": {{"predicted_per_second": {}}}}}'),
    ("generate", '{{"stop": true, "timings": {{"cache_n": {}}}}}'),
    ("generate", '{{"error": {}}}'),
    ("generate", '{{"error": {{"message": {}}}}}'),
    ("prefill", '{{"stop": true, "timings": {{"cache_n": {}, "prompt_n": 3}}}}'),
    ("prefill", '{{"stop": true, "timings": {{"cache_n": 0, "prompt_n": {}}}}}'),
    ("prefill", '{{"stop": true, "tokens_cached": {}}}'),
    ("prefill", '{{"prompt_progress": {}, "tokens": [0]}}'),
    ("check", '{{"content": "x", "completion_probabilities": {}}}'),
    ("check", '{{"content": "x", "completion_probabilities": [{{"top_logprobs": {}}}]}}'),
    ("check", '{{"content": "x", "completion_probabilities": [{{"top_logprobs": [{{"id": 1, "logprob": {}}}]}}]}}'),
    ("check", '{{"stop": true, "timings": {{"cache_n": {}}}}}'),
]  # fmt: skip

STREAMS = ("generate", "prefill", "check")


def generated_case(seed: int) -> Case:
    rng = random.Random(seed)
    kind, template = rng.choice(SLOTS)
    value = rng.choice(HOSTILE_VALUES)
    hostile = template.format("@V@").encode().replace(b"@V@", value)
    turn = 2 if kind in ("restore", "check") or rng.random() < 0.3 else 1
    name = f"#{seed} {kind} {template[:50]} <- {value[:30]!r} (turn {turn})"
    if kind not in STREAMS:
        status = rng.choice((200, 200, 200, 400, 500))
        return Case(name, kind, hostile, status=status, turn=turn)
    good_events = {
        "generate": [{"content": "Alpha ", "tokens": [11], "stop": False}],
        "prefill": [{"prompt_progress": {"total": 3}, "tokens": [0]}],
        "check": [],
    }[kind]
    final = {"stop": True, "tokens_cached": 3, "timings": {"cache_n": 0, "prompt_n": 3}}
    position = rng.choice(("first", "middle", "instead of the last", "as error line", "cut"))
    if position == "first":
        body = sse(hostile, *good_events, final)
    elif position == "middle":
        body = sse(*good_events, hostile, final)
    elif position == "instead of the last":
        body = sse(*good_events, hostile)
    elif position == "as error line":
        body = sse(*good_events) + b"error: " + hostile + b"\n\n"
    else:
        whole = sse(*good_events, hostile, final)
        body = whole[: rng.randrange(len(whole) + 1)]
    return Case(f"{name} [{position}]", kind, body, turn=turn)


CAMPAIGN = 240
SAMPLE = 20


@pytest.mark.parametrize("seed", range(0, CAMPAIGN, CAMPAIGN // SAMPLE))
def test_a_sample_of_the_hostile_campaign(fake: FakeServer, kvhome: Path, seed: int) -> None:
    run_case(fake, generated_case(seed), kvhome.parent / f"home{seed}")


@pytest.mark.stress
def test_the_hostile_campaign(fake: FakeServer, kvhome: Path) -> None:
    """Every generated case; the failures are listed together at the end."""
    failures: list[str] = []
    for seed in range(CAMPAIGN):
        case = generated_case(seed)
        try:
            run_case(fake, case, kvhome.parent / f"home{seed}")
        except AssertionError as exc:
            failures.append(f"{case.name}: {str(exc)[:300]}")
    print(f"hostile llama-server campaign: {CAMPAIGN} cases, {len(failures)} failures")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("damage", ["fifo", "nesting", "link", "types"])
def test_a_damaged_supervisor_entry_is_no_server(tmp_path: Path, damage: str) -> None:
    """The supervisor's entry for a port (kvchat's own file, but one a crash or a hand can
    damage) is read bounded: a FIFO blocked, 200,000 '[' raised RecursionError on 0ac7b0e."""
    from kvchat.engine.server_registry import _read

    path = tmp_path / "entry.json"
    if damage == "fifo":
        os.mkfifo(path)
    elif damage == "nesting":
        path.write_text("[" * 200_000)
    elif damage == "link":
        target = tmp_path / "elsewhere.json"
        target.write_text('{"port": 1, "slot_dir": "/", "model_path": "m", "pid": 1, "url": "u"}')
        path.symlink_to(target)
    else:
        path.write_text('{"port": "eight", "slot_dir": [], "model_path": 1, "pid": 1}')
    assert _read(path) is None
