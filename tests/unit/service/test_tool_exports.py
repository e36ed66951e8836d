"""Exports carry tool calls and tool messages: which tool, which call, its arguments, the
result the model read and (where it was cut) the whole one; a result's text stays text."""

from __future__ import annotations

import json

from markdown_it import MarkdownIt

from kvchat.service.exports import ToolParts, to_html, to_json, to_markdown
from kvchat.store import Message, Session
from kvchat.store.tools_sql import StoredCall, ToolRecord

SESSION = Session("abcd1234", "Tools", None, {}, "2026-01-01", "2026-01-01")
CALL = '<tool_call>\n{"name": "demo.add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
WHOLE = "```\n## You\n<script>x</script>\n" + "z" * 200
MESSAGES = [
    Message(1, SESSION.id, "user", "What is 2 plus 3?", "2026-01-01", 0, False),
    Message(2, SESSION.id, "assistant", CALL, "2026-01-01", 0, False),
    Message(3, SESSION.id, "tool", WHOLE[:40] + "\n[cut]", "2026-01-01", 0, False),
    Message(4, SESSION.id, "assistant", "Five.", "2026-01-01", 0, False),
]
TOOLS = ToolParts(
    {2: [StoredCall(2, 0, "call_1", "demo.add", '{"a": 2, "b": 3}')]},
    {3: ToolRecord(3, "demo.add", "call_1", '{"a": 2, "b": 3}', False, True, WHOLE, 0.5)},
)


def test_markdown_names_the_call_and_keeps_results_fenced() -> None:
    text = to_markdown(SESSION, MESSAGES, tools=TOOLS)
    tokens = MarkdownIt().parse(text)
    headings = [
        tokens[i + 1].content for i, t in enumerate(tokens) if t.tag == "h2" and t.nesting == 1
    ]
    assert headings == ["You", "Assistant", "Tool result", "Assistant"]  # "## You" stays inside
    assert 'demo.add({"a": 2, "b": 3}) · call call\\_1' in text
    assert "_Tool calls: demo.add" in text
    assert WHOLE in text  # the whole result, in its own fence after the one the model read


def test_json_is_openai_shaped_with_the_whole_result() -> None:
    document = json.loads(to_json(SESSION, MESSAGES, tools=TOOLS))
    reply, result = document["messages"][1], document["messages"][2]
    assert reply["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "demo.add", "arguments": '{"a": 2, "b": 3}'},
        }
    ]
    assert (result["role"], result["tool_call_id"], result["name"]) == (
        "tool",
        "call_1",
        "demo.add",
    )
    assert result["kvchat_tool"]["full_text"] == WHOLE and result["kvchat_tool"]["truncated"]


def test_html_escapes_results() -> None:
    page = to_html(SESSION, MESSAGES, tools=TOOLS)
    assert "<script>x" not in page and "&lt;script&gt;x" in page
    assert '<div class="msg tool"' in page and "The whole result" in page
