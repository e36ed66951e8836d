"""Tool calls in a conversation, end to end on the bundled model (SmolLM2-135M), which a
llama.cpp grammar makes write a Hermes ``<tool_call>`` for ``add``: the call is approved,
run, stored as a tool message, and the decode after it reads only the result and the
template's few tokens (llama.cpp's count, exactly); the conversation then resumes from disk
with a greedy reply equal to a full prefill's."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import llama_cpp._internals as internals
import pytest
from textual.widgets import SelectionList

from kvchat.config import McpServerConfig, load_settings
from kvchat.engine import common_prefix
from kvchat.service.chat import ChatService
from kvchat.service.tools import DENIED, CallRequest, Decision
from kvchat.tools.box import ToolBox
from kvchat.tools.calls import CallFormat
from kvchat.tui.screens.tool_call import ToolCallDialog, ToolsDialog
from tests.conftest import REPO
from tests.e2e.tui.test_tui import (  # noqa: F401
    SIZE,
    make_app,
    no_background_failures,
    open_id,
    quit_app,
    ready,
    service_of,
    wait_until,
)

# The reply the grammar allows: one Hermes call of demo.add with two small numbers.
ADD_CALL = (
    'root ::= "<tool_call>\\n{\\"name\\": \\"demo.add\\", \\"arguments\\": {\\"a\\": " num '
    '", \\"b\\": " num "}}\\n</tool_call>"\n'
    "num ::= [1-9] [0-9]?\n"
)


def demo_box() -> ToolBox:
    """The tools test server (tests/mcp_server.py) as server "demo", over stdio."""
    config = McpServerConfig(command=sys.executable, args=[str(REPO / "tests" / "mcp_server.py")])
    return ToolBox({"demo": config})


@pytest.fixture
def decoded_by_llama(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counts: list[int] = []
    real = internals.llama_cpp.llama_decode

    def counting(ctx, batch):  # noqa: ANN001 - ctypes values
        counts.append(int(batch.n_tokens))
        return real(ctx, batch)

    monkeypatch.setattr(internals.llama_cpp, "llama_decode", counting)
    return counts


def test_a_model_made_call_is_approved_stored_and_read_alone(
    kvhome: Path, decoded_by_llama: list[int]
) -> None:
    settings = load_settings(n_ctx=2048, temperature=0.0, max_tokens=80, n_threads=1)
    service = ChatService(settings, home=kvhome)
    box = demo_box()
    service.tools.attach(box)
    service.tools.format = CallFormat.HERMES
    asked: list[CallRequest] = []

    def approve(request: CallRequest) -> Decision:
        asked.append(request)
        return "once"

    try:
        session = service.sessions.new_session().id
        decoded_by_llama.clear()
        turn = service.tools.send(
            session, "What is 2 plus 3? Use the add tool.", approve, grammar=ADD_CALL
        )
        [request] = asked
        assert request.qualified == "demo.add" and set(request.arguments) == {"a", "b"}
        total = request.arguments["a"] + request.arguments["b"]
        [step] = turn.steps
        assert step.result is not None and step.result.text == str(total)
        assert len(turn.reports) == 2 and turn.note is None
        messages = service.store.messages(session)
        assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[2].content == str(total)
        [call] = service.store.tool_calls([messages[1].id])[messages[1].id]
        assert call.name == "demo.add" and json.loads(call.arguments) == request.arguments
        record = service.store.tool_records([messages[2].id])[messages[2].id]
        assert (record.name, record.full_text, record.is_error) == ("demo.add", str(total), False)
        assert record.call_id == call.call_id

        # The decode after the result: the tool message and the template's tokens, exactly.
        engine = service.engine.token_level()
        assert engine is not None
        chat = [m.as_chat() for m in messages[:2]]
        # What the settle left the context holding: the history up to the next user's words.
        first = engine.chat_tokens(chat + [{"role": "user", "content": "A"}])
        held = first[
            : common_prefix(first, engine.chat_tokens(chat + [{"role": "user", "content": "B"}]))
        ]
        prompt = engine.chat_tokens(chat + [messages[2].as_chat()])
        after = turn.reports[1].tokens
        assert after.prompt == len(prompt)
        assert after.reused == common_prefix(prompt, held)
        assert after.decoded == len(prompt) - after.reused
        template = after.decoded - engine.count_tokens(str(total))
        assert 0 < template <= 8
        print(
            f"after the result: reused {after.reused}, decoded {after.decoded} "
            f"(result {engine.count_tokens(str(total))} + template {template})"
        )
        # Exported with the call and its result.
        exported = json.loads(service.sessions.export(session, "json"))
        reply, result = exported["messages"][1], exported["messages"][2]
        assert reply["tool_calls"][0]["function"]["name"] == "demo.add"
        assert (result["role"], result["tool_call_id"], result["content"]) == (
            "tool",
            call.call_id,
            str(total),
        )
        assert "## Tool result" in service.sessions.export(session, "md")
        assert '<div class="msg tool"' in service.sessions.export(session, "html")
    finally:
        service.close()

    # The conversation with its call resumes from disk like any other: greedy after the
    # restore equals greedy after a full prefill (a copy of the home, read with no restore).
    copy = kvhome.parent / "prefilled"
    shutil.copytree(kvhome, copy)
    replies = []
    for where, no_restore in ((kvhome, False), (copy, True)):
        again = ChatService(settings, home=where)
        try:
            report = again.send(session, "And 4 plus 4?", no_restore=no_restore)
            assert report.restore.source == ("none" if no_restore else "disk")
            replies.append((report.reply, report.tokens.prompt))
        finally:
            again.close()
    assert replies[0] == replies[1]


def test_a_direct_call_goes_into_the_conversation_as_text(kvhome: Path) -> None:
    """/tool's service call: approved, stored as a tool message, no model turn; a result that
    spells control tokens is read by the next turn as text (one <|im_end|> per message)."""
    settings = load_settings(n_ctx=2048, temperature=0.0, max_tokens=16, n_threads=1)
    service = ChatService(settings, home=kvhome)
    service.tools.attach(demo_box())
    asked: list[CallRequest] = []

    def deny_then_allow(request: CallRequest) -> Decision:
        asked.append(request)
        return "deny" if len(asked) == 1 else "always"

    try:
        session = service.sessions.new_session().id
        denied = service.tools.call_directly(
            session, "demo.add", '{"a": 20, "b": 22}', deny_then_allow
        )
        assert denied.decision == "deny" and denied.result is None
        step = service.tools.call_directly(
            session, "demo.add", '{"a": 20, "b": 22}', deny_then_allow
        )
        assert step.result is not None and step.result.text == "42" and not step.request.by_model
        again = service.tools.call_directly(session, "add", {"a": 1, "b": 1}, deny_then_allow)
        assert again.result is not None and again.result.text == "2"
        assert len(asked) == 2  # "always": the third call was not asked about
        looks = service.tools.call_directly(session, "demo.tokens", "", deny_then_allow)
        assert looks.result is not None and "<|im_end|>" in looks.result.text
        messages = service.store.messages(session)
        assert [m.role for m in messages] == ["tool"] * 4
        assert [m.content for m in messages[:3]] == [DENIED, "42", "2"]
        records = service.store.tool_records([m.id for m in messages])
        assert records[messages[0].id].is_error and not records[messages[1].id].is_error

        report = service.send(session, "Thanks.")
        engine = service.engine.token_level()
        assert engine is not None
        prompt = engine.chat_tokens([m.as_chat() for m in service.store.messages(session)[:-1]])
        im_end = engine.tokenize("<|im_end|>")
        assert len(im_end) > 1  # as text; the special token is the template's alone
        [end_id] = service.engine.llm.tokenize(b"<|im_end|>", add_bos=False, special=True)  # type: ignore[attr-defined]
        assert prompt.count(end_id) == 6  # the template's system message, four tools, the user's
        assert report.message_id is not None
    finally:
        service.close()


async def test_calls_are_approved_in_the_app(kvhome: Path) -> None:
    """Through the app (Pilot): the model's forced call asks in the dialog (o: once), runs,
    and the reply after it is stored; /tool asks (a: always) and adds its result."""
    server = {"command": sys.executable, "args": [str(REPO / "tests" / "mcp_server.py")]}
    app = make_app(mcp={"servers": {"demo": server}}, max_tokens=80)
    async with app.run_test(size=SIZE) as pilot:
        main = await ready(app)
        service = service_of(app)
        service.tools.format = CallFormat.HERMES
        service.tools.grammar = ADD_CALL
        main.prompt.focus()
        main.prompt.insert("What is 2 plus 3? Use the add tool.")
        await pilot.press("enter")
        await wait_until(lambda: isinstance(app.screen, ToolCallDialog))
        dialog = app.screen
        assert isinstance(dialog, ToolCallDialog) and dialog.request.qualified == "demo.add"
        await pilot.press("o")
        await wait_until(lambda: main.turn is None and main.last_turn is not None)
        await wait_until(lambda: main.housekeeping_idle)
        session = open_id(main)
        messages = service.store.messages(session)
        assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert main.last_report is not None and main.last_report.message_id == messages[-1].id
        # The app defers the settle; the reply after the result still reads only the result
        # and the template's tokens (the settle runs before it).
        engine = service.engine.token_level()
        assert engine is not None
        chat = [m.as_chat() for m in messages[:2]]
        first = engine.chat_tokens(chat + [{"role": "user", "content": "A"}])
        held = first[
            : common_prefix(first, engine.chat_tokens(chat + [{"role": "user", "content": "B"}]))
        ]
        prompt = engine.chat_tokens(chat + [messages[2].as_chat()])
        after = main.last_report.tokens
        assert (after.prompt, after.reused) == (len(prompt), common_prefix(prompt, held))
        assert after.decoded == len(prompt) - after.reused == 9
        await wait_until(lambda: [v.role for v in main.conversation.views].count("tool") == 1)

        service.tools.grammar = None
        main.prompt.insert('/tool demo.add {"a": 20, "b": 22}')
        await pilot.press("enter")
        await wait_until(lambda: isinstance(app.screen, ToolCallDialog))
        await pilot.press("a")
        await wait_until(lambda: len(service.store.messages(session)) == 5)
        assert service.store.messages(session)[-1].content == "42"
        await wait_until(lambda: [v.role for v in main.conversation.views].count("tool") == 2)

        main.prompt.insert("/tools off demo.add")
        await pilot.press("enter")

        def listed() -> str:
            return "\n".join(n.message for n in app._notifications if n.title == "Tools")

        await wait_until(lambda: "[ ] demo.add · always" in listed())
        assert "demo · running · approve ask" in listed()
        assert "Replies are read for calls as hermes" in listed()
        assert not service.tools.enabled(session, "demo.add")
        # Kept with the session: "a" above, and off here.
        kept = service.store.get_session(session).settings
        assert kept["tools_off"] == ["demo.add"] and kept["tools_always"] == ["demo.add"]

        main.prompt.insert("/tools")  # the dialog: Space turns demo.add back on, Ctrl+S keeps it
        await pilot.press("enter")
        await wait_until(lambda: isinstance(app.screen, ToolsDialog))
        choices = app.screen.query_one("#tool-list", SelectionList)
        names = [choices.get_option_at_index(i).value for i in range(choices.option_count)]
        assert "demo.add" in names and "demo.add" not in choices.selected
        choices.highlighted = names.index("demo.add")
        await pilot.press("space")
        await pilot.press("ctrl+s")
        await wait_until(lambda: service.tools.enabled(session, "demo.add"))
        await quit_app(app)
    assert app.return_code == 0


def test_each_limit_is_one_line_and_nothing_is_lost(kvhome: Path) -> None:
    """A tool that hangs (timeout), dies mid-call, returns 10 MiB (cut for the model, whole
    in the store) or fails: one line each, the call's tool message stored, the next call
    and the next turn go on."""
    settings = load_settings(n_ctx=2048, temperature=0.0, max_tokens=8, n_threads=1)
    service = ChatService(settings, home=kvhome)
    service.tools.attach(demo_box())
    service.tools.timeout_s = 2.0

    def allow(request: CallRequest) -> Decision:
        return "once"

    try:
        session = service.sessions.new_session().id
        hang = service.tools.call_directly(session, "demo.hang", "", allow)
        assert hang.result is None and "\n" not in hang.line
        assert hang.line == "demo.hang gave no result within 2 s"
        service.tools.timeout_s = None  # the server's own cap (60 s) from here on
        die = service.tools.call_directly(session, "demo.die", "", allow)
        assert die.result is None and "\n" not in die.line and die.line
        huge = service.tools.call_directly(session, "demo.huge", '{"mib": 10}', allow)
        assert huge.result is not None and huge.result.truncated
        assert len(huge.result.full_text) == 10 * 1024 * 1024
        fail = service.tools.call_directly(session, "demo.fail", "", allow)
        assert fail.result is not None and fail.result.is_error
        after = service.tools.call_directly(session, "demo.add", '{"a": 1, "b": 2}', allow)
        assert after.result is not None and after.result.text == "3"  # the server came back

        messages = service.store.messages(session)
        assert [m.role for m in messages] == ["tool"] * 5
        records = service.store.tool_records([m.id for m in messages])
        kept = [records[m.id] for m in messages]
        assert [r.is_error for r in kept] == [True, True, False, True, False]
        assert kept[2].truncated and len(kept[2].full_text) == 10 * 1024 * 1024
        assert len(messages[2].content) < 20_000  # what the model reads is the cut text
        print(f"\nlimits: hang -> {hang.line!r}; die -> {die.line!r}; huge -> {huge.line!r}")
        report = service.send(session, "Go on.")
        assert report.message_id is not None
    finally:
        service.close()
