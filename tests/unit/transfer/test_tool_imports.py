"""Tool calls and tool messages go out with an export and come back with its import
(kvchat's JSON, hence bundles); a file's tool parts are bounded, one line when they are not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvchat.config import load_settings
from kvchat.service.chat import ChatService, open_service
from kvchat.store.tools_sql import ToolRecord
from kvchat.transfer import BadFile, import_file

CALL = '<tool_call>\n{"name": "demo.add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture
def service(kvhome: Path) -> Iterator[ChatService]:
    with open_service(load_settings(), home=kvhome) as chat:
        yield chat


def session_with_tools(chat: ChatService) -> str:
    store = chat.store
    session = chat.sessions.new_session().id
    store.add_message(session, "user", "What is 2 plus 3?")
    reply = store.add_message(session, "assistant", CALL)
    store.set_tool_calls(reply.id, [("call_1", "demo.add", '{"a": 2, "b": 3}')])
    record = ToolRecord(0, "demo.add", "call_1", '{"a": 2, "b": 3}', False, True, "5" * 50, 0.1)
    store.add_tool_message(session, "5" * 10 + "\n[cut]", record)
    store.add_message(session, "assistant", "Five.")
    return session


def tool_rows(chat: ChatService, session: str) -> tuple[list[tuple[str, str]], list, list]:
    messages = chat.store.messages(session)
    ids = [m.id for m in messages]
    calls = [
        (c.call_id, c.name, json.loads(c.arguments))
        for found in chat.store.tool_calls(ids).values()
        for c in found
    ]
    records = [
        (r.name, r.call_id, json.loads(r.arguments), r.is_error, r.truncated, r.full_text)
        for r in chat.store.tool_records(ids).values()
    ]
    return [(m.role, m.content) for m in messages], calls, records


def test_an_export_with_tools_imports_back_whole(service: ChatService, tmp_path: Path) -> None:
    session = session_with_tools(service)
    path = tmp_path / "export.json"
    path.write_text(service.sessions.export(session, "json"), encoding="utf-8")
    [item] = import_file(service, path).sessions
    assert item.session != session
    assert tool_rows(service, item.session) == tool_rows(service, session)
    assert tool_rows(service, session)[2][0][5] == "5" * 50  # the whole result came back


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"name": None}, "no tool name"),
        ({"name": "x" * 500}, "no tool name"),
        ({"tool_call_id": 7}, "call id"),
        ({"kvchat_tool": {"arguments": "[1]"}}, "not a JSON object"),
        ({"kvchat_tool": {"arguments": "{"}}, "arguments"),
        ({"kvchat_tool": {"is_error": "yes"}}, "true or false"),
        ({"kvchat_tool": ["x"]}, "not an object"),
    ],
)
def test_a_bad_tool_message_is_one_line(
    service: ChatService, tmp_path: Path, change: dict[str, object], says: str
) -> None:
    session = session_with_tools(service)
    document = json.loads(service.sessions.export(session, "json"))
    document["session"]["id"] = "other"
    document["messages"][2].update(change)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(BadFile) as caught:
        import_file(service, path)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_bad_tool_calls_are_one_line(service: ChatService, tmp_path: Path) -> None:
    session = session_with_tools(service)
    document = json.loads(service.sessions.export(session, "json"))
    for calls, says in (
        ("x", "not a list"),
        ([{"id": "a"}], "no function"),
        ([{"function": {"name": "f", "arguments": '{"x": NaN}'}}], "NaN is not a JSON value"),
        ([{"function": {"name": "f"}}] * 65, "at most 64"),
    ):
        document["messages"][1]["tool_calls"] = calls
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(document), encoding="utf-8")
        with pytest.raises(BadFile, match=says):
            import_file(service, path)


def llm_tool_db(path: Path) -> Path:
    """A logs.db that llm itself wrote for a chain with one tool call (add) and its result."""
    import llm
    import sqlite_utils
    from llm.migrations import migrate

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    class Caller(llm.Model):
        model_id = "caller"
        can_stream = False
        supports_tools = True

        def execute(self, prompt, stream, response, conversation):  # noqa: ANN001, ANN202
            if prompt.tool_results:
                yield f"the sum is {prompt.tool_results[0].output}"
                return
            call = llm.ToolCall(name="add", arguments={"a": 2, "b": 3}, tool_call_id="call_1")
            response.add_tool_call(call)
            yield "Let me add."

    db = sqlite_utils.Database(path)
    migrate(db)
    chain = Caller().conversation(tools=[add]).chain("What is 2 plus 3?")
    chain.text()
    for response in chain.responses():
        response.log_to_db(db)
    db.close()
    return path


def test_llm_logs_keep_a_reply_s_calls_and_the_results(
    service: ChatService, tmp_path: Path
) -> None:
    [item] = import_file(service, llm_tool_db(tmp_path / "logs.db")).sessions
    messages, calls, records = tool_rows(service, item.session)
    assert messages[:3] == [
        ("user", "What is 2 plus 3?"),
        ("assistant", "Let me add."),
        ("tool", "5"),
    ]
    assert calls == [("call_1", "add", {"a": 2, "b": 3})]
    assert records == [("add", "call_1", {"a": 2, "b": 3}, False, False, "5")]
    assert item.skipped == 0
