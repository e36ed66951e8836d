"""ToolTurns' steps without a model: which tool a model's name means, who is asked, what a
failed or denied call stores, and where a harmony call is read from (the reply as written)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvchat.config import load_settings
from kvchat.kvcache import RestoreResult
from kvchat.service.reports import TokenCounts, TurnReport
from kvchat.service.tools import CallRequest, Decision, ToolTurn, ToolTurns
from kvchat.store import Store
from kvchat.tools.api import ServerState, ToolResult, ToolSpec, ToolTimeoutError
from kvchat.tools.calls import CallFormat, ToolCall

SCHEMA: dict[str, Any] = {"type": "object"}


class Runner:
    """Two servers: "calc" (ask) with add and echo, "auto" (always) with echo and slow."""

    def __init__(self) -> None:
        self.called: list[str] = []

    def servers(self) -> list[ServerState]:
        return [
            ServerState("calc", "stdio", True, "ask", "running", None, 2, "x"),
            ServerState("auto", "stdio", True, "always", "running", None, 2, "y"),
        ]

    def tools(self) -> list[ToolSpec]:
        return [
            ToolSpec("calc", "add", "Adds.", SCHEMA),
            ToolSpec("calc", "echo", "Echoes.", SCHEMA),
            ToolSpec("auto", "echo", "Echoes too.", SCHEMA),
            ToolSpec("auto", "slow", "Hangs.", SCHEMA),
        ]

    def call(self, qualified: str, arguments: Any, *, timeout_s: float | None = None) -> ToolResult:
        self.called.append(qualified)
        if qualified == "auto.slow":
            raise ToolTimeoutError("auto.slow gave no result within 1 s")
        return ToolResult("ok", "ok", False, False, 0.0)

    def close(self) -> None:
        pass


def make(tmp_path: Path) -> tuple[ToolTurns, Store, Runner, str]:
    store = Store(tmp_path / "kv.db")
    host = SimpleNamespace(settings=load_settings(), loaded=None)
    tools = ToolTurns(host, store, None, SimpleNamespace(), None)  # type: ignore[arg-type]
    runner = Runner()
    tools.attach(runner)
    tools.format = CallFormat.HERMES
    return tools, store, runner, store.create_session("t").id


def test_names_asking_and_outcomes(tmp_path: Path) -> None:
    tools, store, runner, session = make(tmp_path)
    asked: list[str] = []

    def approve(request: CallRequest) -> Decision:
        asked.append(request.qualified)
        return "deny" if request.qualified == "calc.echo" else "once"

    steps = [
        tools._run_call(session, ToolCall("add", {}, "a"), approve),  # one tool has the name
        tools._run_call(session, ToolCall("echo", {}, "b"), approve),  # two have it: none
        tools._run_call(session, ToolCall("calc.echo", {}, "c"), approve),  # denied
        tools._run_call(session, ToolCall("auto.echo", {}, "d"), approve),  # not asked
        tools._run_call(session, ToolCall("auto.slow", {}, "e"), approve),  # times out
    ]
    assert asked == ["calc.add", "calc.echo"]
    assert runner.called == ["calc.add", "auto.echo", "auto.slow"]
    assert [s.line for s in steps] == [
        "calc.add: done in 0.00 s",
        "the model called echo, which no tool on here is",
        "calc.echo: not allowed",
        "auto.echo: done in 0.00 s",
        "auto.slow gave no result within 1 s",
    ]
    messages = store.messages(session)
    records = store.tool_records([m.id for m in messages])
    assert [m.content for m in messages] == [
        "ok",
        "No tool named echo is available.",
        "The user did not allow this call.",
        "ok",
        "The call failed: auto.slow gave no result within 1 s",
    ]
    assert [records[m.id].is_error for m in messages] == [False, True, True, False, True]
    assert [records[m.id].call_id for m in messages] == ["a", "b", "c", "d", "e"]
    tools.set_enabled(session, "calc.add", False)
    assert tools._spec(session, "add") is None and tools.offered(session) is not None
    store.close()


def test_tools_off_and_always_are_kept_with_their_session(tmp_path: Path) -> None:
    """Which tools are off in a session, and which the user let run in it without asking,
    are the session's: another session is asked, and a restart (a new ToolTurns on the same
    database) keeps both."""
    tools, store, runner, session = make(tmp_path)
    other = store.create_session("u").id
    asked: list[tuple[str, str]] = []

    def always(request: CallRequest) -> Decision:
        asked.append((request.session_id, request.qualified))
        return "always"

    tools.set_enabled(session, "calc.echo", False)
    tools._run_call(session, ToolCall("calc.add", {}, "a"), always)
    tools._run_call(session, ToolCall("calc.add", {}, "b"), always)  # not asked again
    tools._run_call(other, ToolCall("calc.add", {}, "c"), always)  # another session: asked
    assert asked == [(session, "calc.add"), (other, "calc.add")]
    assert runner.called == ["calc.add"] * 3

    again, _, _, _ = make(tmp_path)  # a restart: the same database
    assert not again.enabled(session, "calc.echo") and again.enabled(other, "calc.echo")
    assert [s.qualified for s in again.available(session)] == ["calc.add", "auto.echo", "auto.slow"]
    assert again.offered(session) is not None and len(again.offered(session) or []) == 3
    assert again.always(session) == {"calc.add"} == again.always(other)
    again._run_call(session, ToolCall("calc.add", {}, "d"), always)
    assert len(asked) == 2
    again.set_always(session, "calc.add", False)  # /tools ask calc.add
    again.set_enabled(session, "calc.echo", True)
    again._run_call(session, ToolCall("calc.add", {}, "e"), always)
    assert asked[-1] == (session, "calc.add") and len(asked) == 3
    assert store.get_session(session).settings == {"tools_always": ["calc.add"]}
    branch = store.copy_session(session, "a branch")  # a fork or an edit keeps the choices
    assert again.always(branch.id) == {"calc.add"} and again.enabled(branch.id, "calc.echo")
    again.set_always(session, "calc.add", False)
    assert store.get_session(session).settings == {}
    store.close()


def test_a_harmony_call_is_read_from_the_reply_as_written(tmp_path: Path) -> None:
    tools, store, _, session = make(tmp_path)
    tools.format = CallFormat.HARMONY
    written = (
        "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>commentary"
        ' to=functions.calc.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
    )
    reply = store.add_message(session, "assistant", '{"a": 2, "b": 3}')
    report = TurnReport(
        session,
        '{"a": 2, "b": 3}',
        TokenCounts(),
        RestoreResult("none"),
        None,
        None,
        "stop",
        message_id=reply.id,
    )
    assert tools._calls_of(ToolTurn([report])) == []  # the split reply has no header left
    report.written = written
    [call] = tools._calls_of(ToolTurn([report]))
    assert (call.name, call.arguments) == ("calc.add", {"a": 2, "b": 3})
    [stored] = store.tool_calls([reply.id])[reply.id]
    assert stored.name == "calc.add" and stored.call_id == call.call_id
    store.close()
