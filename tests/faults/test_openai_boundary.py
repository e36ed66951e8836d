"""A hostile or broken OpenAI-compatible server: every shape ends in a
clean reply or one KvchatError line, in bounded time, and a reply that was shown is stored.

A real HTTP server on 127.0.0.1, started by the test, serves each case's ``/v1/models``,
``/props`` and ``/v1/chat/completions`` as raw bytes (any status, headers, SSE lines,
keep-alives, delays); a turn runs through :class:`kvchat.service.chat.ChatService` with
``engine openai`` in this process, on a worker thread with a deadline. The named cases are
the shapes the issue reproduced; the generated campaign (``stress``) mixes hostile values
into every field kvchat reads, a sample of it runs by default.
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvchat.config import load_settings
from kvchat.errors import KvchatError
from kvchat.service.chat import ChatService
from kvchat.service.reasoning import THINK_CLOSE, THINK_OPEN
from tests.faults.hostile_http import LocalServer, RawHandler, is_one_clean_line, sse

MAX_TOKENS = 16
# The caps of a stream in these tests (the defaults are minutes): see StreamLimits.
IDLE_S, TOTAL_S, FINISHED_S = 1.0, 3.0, 0.5
# A turn may take no longer than this (the slowest case: the total cap, then the store).
TURN_DEADLINE_S = 20.0

Writer = Callable[["Handler"], None]


# --- the server -----------------------------------------------------------------------------


def delta(content: str = "", reasoning: str = "", finish: str | None = None) -> dict[str, Any]:
    piece: dict[str, Any] = {}
    if content:
        piece["content"] = content
    if reasoning:
        piece["reasoning_content"] = reasoning
    return {
        "object": "chat.completion.chunk",
        "choices": [{"delta": piece, "finish_reason": finish}],
    }


def usage(prompt: Any = 10, completion: Any = 3, cached: Any = 4, **timings: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }
    if timings:
        event["timings"] = timings
    return event


GOOD_STREAM = sse(delta("Hel"), delta("lo."), delta(finish="stop"), usage())
MODELS = {"object": "list", "data": [{"id": "m1", "owned_by": "llamacpp", "meta": {"n_ctx": 4096}}]}


@dataclass
class Case:
    """What the server answers for one case: a body (bytes) or a writer for each path."""

    name: str
    chat: bytes | Writer = GOOD_STREAM
    models: bytes | Writer = json.dumps(MODELS).encode()
    props: bytes | Writer = b'{"total_slots": 2}'
    chat_status: int = 200
    models_status: int = 200
    chat_type: str = "text/event-stream"
    # The model setting (None: the list's first); with it, a broken list is passed over.
    model: str | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)


class Handler(RawHandler):
    server: HostileServer

    def _answer(self) -> None:
        case = self.server.case
        size = int(self.headers.get("Content-Length") or 0)
        if size:
            self.server.bodies.append(self.rfile.read(size))
        if self.path.endswith("/models"):
            what, status, kind = case.models, case.models_status, "application/json"
        elif self.path.endswith("/props"):
            what, status, kind = case.props, 200, "application/json"
        else:
            what, status, kind = case.chat, case.chat_status, case.chat_type
        try:
            if callable(what):
                what(self)
            else:
                self.raw(status, what, kind)
        except OSError:
            pass  # the client went away: that is its right

    do_GET = _answer
    do_POST = _answer


class HostileServer(LocalServer):
    def __init__(self) -> None:
        self.case = Case("good")
        self.bodies: list[bytes] = []
        super().__init__(Handler)


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileServer]:
    server = HostileServer()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def short_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream caps of these tests: a second of silence, three seconds in all."""
    from kvchat.engine import openai

    limits = getattr(openai, "StreamLimits", None)
    if limits is not None:
        monkeypatch.setattr(
            openai,
            "StreamLimits",
            lambda: limits(idle_s=IDLE_S, total_s=TOTAL_S, finished_idle_s=FINISHED_S),
        )


# --- one turn, and what must hold ---------------------------------------------------------------


@dataclass
class Outcome:
    shown: str
    error: BaseException | None
    report: Any
    seconds: float
    rows: list[tuple[str, str, str, int, Any]]  # role, content, reasoning, partial, tokens


def run_turn(server: HostileServer, case: Case, home: Path) -> Outcome:
    """One turn of ``case`` through the service, on a thread with a deadline."""
    server.case = case
    server.bodies.clear()
    settings: dict[str, Any] = {
        "engine": "openai",
        "openai_url": f"{server.url}/v1",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    if case.model is not None:
        settings["openai_model"] = case.model
    shown: list[str] = []
    result: dict[str, Any] = {}

    def work() -> None:
        service = ChatService(load_settings(**settings), home=home)
        try:
            session = service.sessions.new_session()
            result["session"] = session.id
            result["report"] = service.send(session.id, "Hi", on_token=shown.append)
        except BaseException as exc:  # noqa: BLE001 (what the case is about)
            result["error"] = exc
        finally:
            try:
                service.close()
            except BaseException as exc:  # noqa: BLE001
                result.setdefault("error", exc)

    started = time.monotonic()
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(TURN_DEADLINE_S)
    seconds = time.monotonic() - started
    assert not worker.is_alive(), f"{case.name}: the turn ran past {TURN_DEADLINE_S} s"
    rows: list[tuple[str, str, str, int, Any]] = []
    if (home / "kvchat.db").exists():
        conn = sqlite3.connect(home / "kvchat.db")
        rows = [
            (r[0], r[1], r[2] or "", int(r[3]), r[4])
            for r in conn.execute(
                "SELECT role, content, reasoning, partial, token_count FROM messages ORDER BY id"
            )
        ]
        conn.close()
    return Outcome("".join(shown), result.get("error"), result.get("report"), seconds, rows)


def shown_parts(shown: str) -> tuple[str, str]:
    """The reasoning and the answer of what the caller's stream showed."""
    if not shown.startswith(f"{THINK_OPEN}\n"):
        return "", shown
    body = shown[len(THINK_OPEN) + 1 :]
    reasoning, _, answer = body.partition(f"\n{THINK_CLOSE}\n\n")
    return reasoning, answer


def check(outcome: Outcome, name: str) -> None:
    """What must hold whatever the server sent."""
    error = outcome.error
    assert error is None or isinstance(error, KvchatError), (
        f"{name}: {type(error).__name__}: {error}"
    )
    if error is not None:
        assert is_one_clean_line(str(error)), f"{name}: {str(error)!r}"
        # A turn that failed showed nothing: what was shown would be the reply.
        assert not outcome.shown, f"{name}: shown {outcome.shown!r}, then {error}"
        # The user's message stays, unanswered.
        assert [r[0] for r in outcome.rows] == ["user"], f"{name}: {outcome.rows}"
        return
    report = outcome.report
    assert report is not None
    summary = report.summary()
    assert is_one_clean_line(summary), f"{name}: {summary!r}"
    json.dumps(report.to_json(), allow_nan=False)  # finite, and only valid text
    tokens = report.tokens
    values = {n: tokens.value(n) for n in ("prompt", "reused", "decoded", "generated")}
    for figure, value in values.items():
        assert value is None or 0 <= value <= 10**9, f"{name}: {figure} = {value}"
    if values["prompt"] is not None:
        for part in ("reused", "decoded"):
            assert values[part] is None or values[part] <= values["prompt"], (name, values)
    assert report.tokens_per_s is None or 0 <= report.tokens_per_s < 10**10
    reasoning, answer = shown_parts(outcome.shown)
    assistant = [r for r in outcome.rows if r[0] == "assistant"]
    if not (answer.strip() or reasoning):
        assert assistant == [], f"{name}: nothing shown, yet stored {assistant}"
        return
    # What was shown is what is stored, and a reply cut short is marked partial.
    assert len(assistant) == 1, f"{name}: shown {outcome.shown!r}, stored {assistant}"
    _, content, stored_reasoning, partial, token_count = assistant[0]
    assert (content, stored_reasoning) == (answer, reasoning.strip()), name
    assert partial == int(report.partial), name
    assert report.message_id is not None and report.reply_error is None, name
    assert token_count is None or 0 <= token_count <= 10**9, name
    if report.finish_reason == "cancelled":
        assert report.remote_note and "partial" in report.remote_note, (name, summary)


def run_case(server: HostileServer, case: Case, home: Path) -> Outcome:
    outcome = run_turn(server, case, home)
    check(outcome, case.name)
    return outcome


# --- writers for streams that take their time ---------------------------------------------------


def slow_stream(lines: Iterator[bytes] | list[bytes], every_s: float, head: bytes = b"") -> Writer:
    """A stream whose lines come every ``every_s`` seconds (after ``head`` at once)."""

    def write(handler: Handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(head)
        handler.wfile.flush()
        started = time.monotonic()
        for line in lines:
            if time.monotonic() - started > TURN_DEADLINE_S + 5:
                return
            handler.wfile.write(line)
            handler.wfile.flush()
            time.sleep(every_s)

    return write


def endless_deltas() -> Iterator[bytes]:
    n = 0
    while True:
        n += 1
        yield b"data: " + json.dumps(delta(f"w{n} ")).encode() + b"\n\n"


def endless(line: bytes) -> Iterator[bytes]:
    while True:
        yield line


def stalled_after(head: bytes, seconds: float = 30.0) -> Writer:
    """``head``, then nothing (the connection stays open)."""

    def write(handler: Handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        handler.wfile.write(head)
        handler.wfile.flush()
        time.sleep(seconds)

    return write


# --- the shapes the issue reproduced, each a test that fails on 11cd244 -----------------------------

NESTED = b"[" * 200_000 + b"]" * 200_000
NESTED_OBJECT = b'{"a":' * 50_000 + b"1" + b"}" * 50_000


def test_choices_that_are_not_a_list_are_one_line(hostile: HostileServer, kvhome: Path) -> None:
    outcome = run_case(hostile, Case("choices 5", chat=sse({"choices": 5})), kvhome)
    assert outcome.error is not None and "choices" in str(outcome.error)


@pytest.mark.parametrize(
    "case",
    [
        Case("nested SSE event", chat=sse(NESTED)),
        Case("nested SSE object", chat=sse(NESTED_OBJECT)),
        Case("nested 500 body", chat=NESTED, chat_status=500),
        Case("nested /models", models=NESTED),
        Case("nested /props", props=NESTED),
        Case("nested error event", chat=b"error: " + NESTED + b"\n\n"),
    ],
    ids=lambda c: c.name,
)
def test_deep_nesting_is_refused_before_it_is_parsed(
    hostile: HostileServer, kvhome: Path, case: Case
) -> None:
    outcome = run_case(hostile, case, kvhome)
    if case.name in ("nested /props",):
        assert outcome.error is None  # a hint the server did not give: one slot
        assert json.loads(hostile.bodies[-1]).get("id_slot") is None
    else:
        assert outcome.error is not None


@pytest.mark.parametrize("bad", ["Infinity", "-Infinity", "1e999", "NaN", '"fast"', "-5", "1e30"])
@pytest.mark.parametrize("where", ["usage", "cached", "timings", "speed", "n_ctx", "total_slots"])
def test_figures_that_are_not_counts_are_not_shown(
    hostile: HostileServer, kvhome: Path, bad: str, where: str
) -> None:
    events: list[bytes] = [
        json.dumps(delta("Hi")).encode(),
        json.dumps(delta(finish="stop")).encode(),
    ]
    models: bytes = json.dumps(MODELS).encode()
    props = b'{"total_slots": 2}'
    good_timings = '"timings": {"cache_n": 4, "prompt_n": 6, "predicted_n": 2, '
    if where == "usage":
        events.append(f'{{"choices": [], "usage": {{"prompt_tokens": {bad}}}}}'.encode())
    elif where == "cached":
        events.append(
            (
                '{"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2, '
                f'"prompt_tokens_details": {{"cached_tokens": {bad}}}}}}}'
            ).encode()
        )
    elif where == "timings":
        events.append(
            f'{{"choices": [], "timings": {{"cache_n": {bad}, "prompt_n": {bad}}}}}'.encode()
        )
    elif where == "speed":
        events.append(f'{{"choices": [], {good_timings}"predicted_per_second": {bad}}}}}'.encode())
    elif where == "n_ctx":
        models = (
            '{"data": [{"id": "m1", "owned_by": "llamacpp", "meta": {"n_ctx": ' + bad + "}}]}"
        ).encode()
    else:
        props = ('{"total_slots": ' + bad + "}").encode()
    case = Case(f"{where}={bad}", chat=sse(*events), models=models, props=props)
    outcome = run_case(hostile, case, kvhome)
    if where == "n_ctx" and bad in ("Infinity", "-Infinity", "1e999", "NaN"):
        # Not JSON kvchat reads: the list is refused in one line, or passed over when the
        # model is set.
        assert outcome.error is not None and "not finite" in str(outcome.error)
        case.model = "m1"
        outcome = run_case(hostile, case, kvhome.parent / "model-set")
    assert outcome.error is None and outcome.report.reply == "Hi"
    if where in ("usage", "cached", "timings"):
        shown = outcome.report.to_json()["tokens"]
        if where == "usage" and bad not in ("1e30",):
            assert shown["prompt"] is None
        assert outcome.report.remote_note and "not shown" in outcome.report.remote_note


def test_a_huge_count_never_reaches_the_database(hostile: HostileServer, kvhome: Path) -> None:
    """10^30 completion tokens: SQLite's integers end at 2^63 (an OverflowError before)."""
    chat = sse(delta("Hi"), delta(finish="stop"), usage(10, 10**30, 4))
    outcome = run_case(hostile, Case("10^30", chat=chat), kvhome)
    assert outcome.error is None and outcome.report.to_json()["tokens"]["generated"] is None


def test_a_lone_surrogate_is_stored_and_shown_as_a_replacement(
    hostile: HostileServer, kvhome: Path
) -> None:
    chat = sse(b'{"choices": [{"delta": {"content": "a\\ud800b"}}]}', delta(finish="stop"))
    outcome = run_case(hostile, Case("lone surrogate", chat=chat), kvhome)
    assert outcome.error is None and outcome.report.reply == "a\ufffdb"


def test_more_cached_than_prompt_tokens_is_not_shown(hostile: HostileServer, kvhome: Path) -> None:
    chat = sse(delta("Hi"), delta(finish="stop"), usage(10, 2, 50))
    outcome = run_case(hostile, Case("cached 50 of 10", chat=chat), kvhome)
    tokens = outcome.report.to_json()["tokens"]
    assert tokens["prompt"] == 10 and tokens["reused"] is None and tokens["decoded"] is None
    assert "50 cached of 10 prompt tokens" in outcome.report.summary()
    negative = sse(delta("Hi"), delta(finish="stop"), usage(-3, -2, -1))
    outcome = run_case(hostile, Case("negatives", chat=negative), kvhome.parent / "n")
    assert outcome.report.to_json()["tokens"]["prompt"] is None


def test_a_stream_that_never_ends_stops_at_max_tokens_and_stores_what_was_shown(
    hostile: HostileServer, kvhome: Path
) -> None:
    case = Case("endless deltas", chat=slow_stream(endless_deltas(), 0.01))
    outcome = run_case(hostile, case, kvhome)
    report = outcome.report
    assert outcome.error is None and report.finish_reason == "cancelled"
    assert outcome.shown.count(" ") == MAX_TOKENS  # the pieces kvchat took
    assert [r[1:4] for r in outcome.rows if r[0] == "assistant"] == [(outcome.shown, "", 1)]
    assert "max_tokens" in report.summary() and "saved, marked partial" in report.summary()
    assert outcome.seconds < TOTAL_S + 5


def test_keepalives_alone_do_not_hold_a_stream(hostile: HostileServer, kvhome: Path) -> None:
    before = Case("keep-alives only", chat=slow_stream(endless(b": ping\n\n"), 0.1))
    outcome = run_case(hostile, before, kvhome)
    assert outcome.error is not None and "keep-alives" in str(outcome.error)
    assert outcome.seconds < IDLE_S + 5
    head = sse(delta("Partly "), delta("said"), done=False)
    after = Case("text, then keep-alives", chat=slow_stream(endless(b": ping\n\n"), 0.1, head))
    outcome = run_case(hostile, after, kvhome.parent / "after")
    assert outcome.error is None and outcome.report.reply == "Partly said"
    assert outcome.rows[-1][1:4] == ("Partly said", "", 1)


def test_a_slow_drip_that_never_makes_an_event_is_cut_off(
    hostile: HostileServer, kvhome: Path
) -> None:
    drip = Case("one byte at a time", chat=slow_stream(endless(b"d"), 0.05))
    outcome = run_case(hostile, drip, kvhome)
    assert outcome.error is not None and outcome.seconds < TOTAL_S + 5


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param(b'data: {"choices": 5}\n\n', id="bad chunk"),
        pytest.param(b"data: " + NESTED + b"\n\n", id="nested"),
        pytest.param(b'data: {"error": {"message": "\\u001b[31mboom"}}\n\n', id="error event"),
        pytest.param(b'data: {"usage": {"prompt_tokens": NaN}}\n\n', id="NaN"),
        pytest.param(b"", id="cut off"),
        pytest.param(
            b'data: {"choices": [{"delta": {"reasoning_content": "late"}}]}\n\n',
            id="reasoning after the answer",
        ),
    ],
)
def test_a_reply_broken_off_mid_stream_is_stored_as_shown(
    hostile: HostileServer, kvhome: Path, tail: bytes
) -> None:
    """Before, any failure after the first piece left the shown text unsaved (or a partial
    copy of another length) and the line said no reply was saved."""
    head = sse(delta("One "), delta("two "), delta("three"), done=False)
    outcome = run_case(hostile, Case("mid-stream", chat=head + tail), kvhome)
    assert outcome.error is None
    assert outcome.report.reply == "One two three" and outcome.report.partial
    assert outcome.rows[-1][1:4] == ("One two three", "", 1)
    assert "\x1b" not in outcome.report.summary()


def test_a_stream_that_stalls_after_its_finish_is_whole(
    hostile: HostileServer, kvhome: Path
) -> None:
    chat = stalled_after(sse(delta("Done."), delta(finish="stop"), done=False))
    outcome = run_case(hostile, Case("stall after finish", chat=chat), kvhome)
    assert outcome.error is None and outcome.report.finish_reason == "stop"
    assert outcome.rows[-1][1:4] == ("Done.", "", 0)


def test_a_server_that_does_not_stream_is_read_as_one_completion(
    hostile: HostileServer, kvhome: Path
) -> None:
    completion = {
        "choices": [
            {"message": {"role": "assistant", "content": "Whole."}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2},
    }
    case = Case("not streamed", chat=json.dumps(completion).encode(), chat_type="application/json")
    outcome = run_case(hostile, case, kvhome)
    assert outcome.report.reply == "Whole." and outcome.report.tokens.prompt == 9


@pytest.mark.e2e
def test_the_cli_says_one_line_for_a_hostile_model_list(
    hostile: HostileServer, kvhome: Path
) -> None:
    """The CLI's own process: no traceback on stderr, one line, exit 2."""
    from tests.conftest import run_cli

    hostile.case = Case("nested /models (cli)", models=NESTED)
    result = run_cli(kvhome, "--openai", f"{hostile.url}/v1", "ask", "Hi", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "nested deeper" in result.stderr


# --- the generated campaign ---------------------------------------------------------------------

HOSTILE_VALUES: list[bytes] = [
    b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1e308", b"-1", b"-0", b"0.5",
    b"1" + b"0" * 30, b"9" * 5000, b"true", b"null", b'"fast"', b'"12"', b"[]", b"{}",
    b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
    b'"\\ud800"', b'"\\udfff tail"', b'"\\u001b[2J\\u001b]0;owned\\u0007"', b'"\\u0000"',
    b'"' + b"x" * 70_000 + b'"', b"1e-400", b"2e9", b"1000000001", b"123456789012345678901234567",
]  # fmt: skip

# Where a hostile value goes: a template with {} in an event, a model list or props.
SLOTS: list[tuple[str, str]] = [
    ("chat", '{{"choices": {}}}'),
    ("chat", '{{"choices": [{}]}}'),
    ("chat", '{{"choices": [{{"delta": {}}}]}}'),
    ("chat", '{{"choices": [{{"delta": {{"content": {}}}}}]}}'),
    ("chat", '{{"choices": [{{"delta": {{"reasoning_content": {}}}}}]}}'),
    ("chat", '{{"choices": [{{"delta": {{}}, "finish_reason": {}}}]}}'),
    ("chat", '{{"choices": [], "usage": {}}}'),
    ("chat", '{{"choices": [], "usage": {{"prompt_tokens": {}}}}}'),
    ("chat", '{{"choices": [], "usage": {{"completion_tokens": {}}}}}'),
    ("chat", '{{"choices": [], "usage": {{"prompt_tokens": 5, "prompt_tokens_details": {{"cached_tokens": {}}}}}}}'),
    ("chat", '{{"choices": [], "timings": {}}}'),
    ("chat", '{{"choices": [], "timings": {{"cache_n": {}, "prompt_n": 3}}}}'),
    ("chat", '{{"choices": [], "timings": {{"cache_n": 2, "prompt_n": {}}}}}'),
    ("chat", '{{"choices": [], "timings": {{"predicted_n": 3, "predicted_per_second": {}}}}}'),
    ("chat", '{{"error": {}}}'),
    ("chat", '{{"error": {{"message": {}}}}}'),
    ("chat", "{}"),
    ("models", '{{"data": {}}}'),
    ("models", '{{"data": [{{"id": {}}}]}}'),
    ("models", '{{"data": [{{"id": "m", "owned_by": "llamacpp", "meta": {{"n_ctx": {}}}}}]}}'),
    ("models", '{{"data": [{{"id": "m", "owned_by": {}}}]}}'),
    ("models", "{}"),
    ("props", '{{"total_slots": {}}}'),
    ("props", "{}"),
    ("error500", '{{"error": {{"message": {}}}}}'),
    ("error500", "{}"),
]  # fmt: skip

# Where in the stream the hostile event comes.
POSITIONS = ("first", "after text", "after finish", "as error line")


def generated_case(seed: int) -> Case:
    rng = random.Random(seed)
    where, template = rng.choice(SLOTS)
    value = rng.choice(HOSTILE_VALUES)
    # The templates are str.format's: "{}" is where the value goes ("{}" alone: all of it).
    hostile_json = template.format("@V@").encode().replace(b"@V@", value)
    name = f"#{seed} {where} {template[:40]} <- {value[:30]!r}"
    keepalive = rng.choice((0, 0, 0, 2))
    if where == "chat":
        position = rng.choice(POSITIONS)
        text = [delta("Alpha "), delta("beta")]
        end = [delta(finish=rng.choice(("stop", "length"))), usage()]
        if position == "first":
            body = sse(hostile_json, *text, *end, keepalive=keepalive)
        elif position == "after text":
            body = sse(*text, hostile_json, *end, keepalive=keepalive)
        elif position == "after finish":
            body = sse(*text, *end[:1], hostile_json, end[1], keepalive=keepalive)
        else:
            body = sse(*text, done=False) + b"error: " + hostile_json + b"\n\n"
        if rng.random() < 0.15:
            body = body[: rng.randrange(len(body) + 1)]  # cut anywhere
        return Case(name, chat=body)
    if where == "models":
        return Case(name, models=hostile_json, model=rng.choice((None, "given")))
    if where == "props":
        return Case(name, props=hostile_json)
    return Case(name, chat=hostile_json, chat_status=rng.choice((400, 500, 503)))


CAMPAIGN = 240
SAMPLE = 20


def campaign_home(kvhome: Path, seed: int) -> Path:
    return kvhome.parent / f"home{seed}"


@pytest.mark.parametrize("seed", range(0, CAMPAIGN, CAMPAIGN // SAMPLE))
def test_a_sample_of_the_hostile_campaign(hostile: HostileServer, kvhome: Path, seed: int) -> None:
    run_case(hostile, generated_case(seed), campaign_home(kvhome, seed))


@pytest.mark.stress
def test_the_hostile_campaign(hostile: HostileServer, kvhome: Path) -> None:
    """Every generated case; the failures are listed together at the end."""
    failures: list[str] = []
    for seed in range(CAMPAIGN):
        case = generated_case(seed)
        try:
            run_case(hostile, case, campaign_home(kvhome, seed))
        except AssertionError as exc:
            failures.append(f"{case.name}: {str(exc)[:300]}")
    print(f"hostile OpenAI campaign: {CAMPAIGN} cases, {len(failures)} failures")
    assert not failures, "\n".join(failures)
