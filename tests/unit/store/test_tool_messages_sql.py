"""Tool calls and tool messages in the store (m021_tool_messages): kept whole, read back,
gone with their message and their session."""

from __future__ import annotations

from pathlib import Path

from kvchat.store import Store
from kvchat.store.tools_sql import ToolRecord


def record(full: str, **changes: object) -> ToolRecord:
    base = dict(
        message_id=0,
        name="demo.add",
        call_id="call_1",
        arguments='{"a": 2, "b": 3}',
        is_error=False,
        truncated=False,
        full_text=full,
        seconds=0.25,
    )
    base.update(changes)
    return ToolRecord(**base)  # type: ignore[arg-type]


def test_a_tool_message_keeps_its_call_and_whole_result(tmp_path: Path):
    store = Store(tmp_path / "kv.db")
    session = store.create_session("tools")
    asked = store.add_message(
        session.id, "assistant", '<tool_call>{"name": "demo.add"}</tool_call>'
    )
    store.set_tool_calls(asked.id, [("call_1", "demo.add", '{"a": 2, "b": 3}')])
    full = "x" * 5000
    shown = full[:100] + "\n[cut: 5,000 characters, 100 shown]"
    message = store.add_tool_message(session.id, shown, record(full, truncated=True), token_count=7)
    store.close()

    store = Store(tmp_path / "kv.db")
    roles = [(m.role, m.content) for m in store.messages(session.id)]
    assert roles[1] == ("tool", shown)
    [call] = store.tool_calls([asked.id, message.id])[asked.id]
    assert (call.call_id, call.name, call.arguments) == ("call_1", "demo.add", '{"a": 2, "b": 3}')
    kept = store.tool_records([asked.id, message.id])
    assert list(kept) == [message.id]
    assert kept[message.id].full_text == full
    assert kept[message.id].truncated and not kept[message.id].is_error
    assert kept[message.id].seconds == 0.25
    assert store.messages(session.id)[1].token_count == 7

    store.delete_message(message.id)
    assert store.tool_records([message.id]) == {}
    store.delete_session(session.id)
    assert store.tool_calls([asked.id]) == {}
    store.close()


def test_calls_recorded_again_replace_the_earlier_ones(tmp_path: Path):
    store = Store(tmp_path / "kv.db")
    session = store.create_session("tools")
    asked = store.add_message(session.id, "assistant", "calls")
    store.set_tool_calls(asked.id, [("a", "s.one", "{}"), ("b", "s.two", "{}")])
    store.set_tool_calls(asked.id, [("c", "s.three", "{}")])
    assert [c.name for c in store.tool_calls([asked.id])[asked.id]] == ["s.three"]
    store.close()


def test_a_copy_keeps_the_calls_and_tool_messages(tmp_path: Path):
    store = Store(tmp_path / "kv.db")
    session = store.create_session("tools")
    asked = store.add_message(session.id, "assistant", "calls")
    store.set_tool_calls(asked.id, [("c", "s.x", "{}")])
    result = store.add_tool_message(session.id, "42", record("42"))
    copy = store.copy_session(session.id, "branch")
    made = store.messages(copy.id)
    assert [c.name for c in store.tool_calls([made[0].id])[made[0].id]] == ["s.x"]
    assert store.tool_records([made[1].id])[made[1].id].full_text == "42"
    cut = store.copy_session(session.id, "shorter", upto_message=asked.id)
    assert len(store.messages(cut.id)) == 1 and result.id not in [
        m.id for m in store.messages(cut.id)
    ]
    store.close()
