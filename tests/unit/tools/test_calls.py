"""Tool calls read from a finished reply, per family (kvchat.tools.calls)."""

from __future__ import annotations

import pytest

from kvchat.tools.calls import (
    MAX_DEPTH,
    CallFormat,
    ToolCall,
    ToolCallError,
    call_format,
    detect_format,
    named_format,
    parse_reply,
)

ADD = ToolCall("add", {"a": 2, "b": 3})


@pytest.mark.parametrize(
    ("fmt", "reply", "text", "calls"),
    [
        (
            CallFormat.HERMES,
            'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
            "Sure.",
            [ADD],
        ),
        (  # arguments as a JSON string, two calls, the last left open at the end of turn
            CallFormat.HERMES,
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}</tool_call>'
            '<tool_call>{"name": "s.x", "arguments": {}}',
            "",
            [ADD, ToolCall("s.x", {})],
        ),
        (CallFormat.HERMES, "No calls here.", "No calls here.", []),
        (
            CallFormat.LLAMA3,
            '{"name": "add", "parameters": {"a": 2, "b": 3}}',
            "",
            [ADD],
        ),
        (
            CallFormat.LLAMA3,
            'Let me.<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}; '
            '{"name": "s.x", "parameters": {}}<|eom_id|>',
            "Let me.",
            [ADD, ToolCall("s.x", {})],
        ),
        (CallFormat.LLAMA3, "{not a call}", "{not a call}", []),
        (
            CallFormat.MISTRAL,
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "abcDEF123"}]',
            "",
            [ToolCall("add", {"a": 2, "b": 3}, "abcDEF123")],
        ),
        (
            CallFormat.MISTRAL,
            '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]s.x[ARGS]{}',
            "",
            [ADD, ToolCall("s.x", {})],
        ),
        (
            CallFormat.HARMONY,
            "<|channel|>analysis<|message|>I should add.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
            '{"a": 2, "b": 3}<|call|>',
            "",
            [ADD],
        ),
        (
            CallFormat.HARMONY,
            "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final"
            "<|message|>Five.<|return|>",
            "Five.",
            [],
        ),
        (
            CallFormat.GRANITE,
            '<|tool_call|>[{"name": "add", "arguments": {"a": 2, "b": 3}}]',
            "",
            [ADD],
        ),
        (
            CallFormat.GRANITE,
            'Ok <tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>',
            "Ok",
            [ADD],
        ),
        (
            CallFormat.LFM2,
            'Checking.<|tool_call_start|>[add(a=2, b=3), s.x(q="x", n=[1, 2.5], f=None)]'
            "<|tool_call_end|>",
            "Checking.",
            [ADD, ToolCall("s.x", {"q": "x", "n": [1, 2.5], "f": None})],
        ),
        (
            CallFormat.LFM2,
            '<|tool_call_start|>[{"name": "add", "arguments": {"a": 2, "b": 3}}]<|tool_call_end|>',
            "",
            [ADD],
        ),
    ],
)
def test_each_family(fmt: CallFormat, reply: str, text: str, calls: list[ToolCall]) -> None:
    parsed = parse_reply(reply, fmt)
    assert parsed.text == text
    assert [(c.name, c.arguments, c.call_id) for c in parsed.calls] == [
        (c.name, c.arguments, c.call_id) for c in calls
    ]


@pytest.mark.parametrize(
    ("fmt", "reply", "says"),
    [
        (CallFormat.HERMES, "<tool_call>{nope}</tool_call>", "not valid JSON"),
        (CallFormat.HERMES, '<tool_call>{"name": "a b"}</tool_call>', "names no tool"),
        (
            CallFormat.HERMES,
            '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
            "not a JSON object",
        ),
        (
            CallFormat.HERMES,
            '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>',
            "not valid JSON",
        ),
        (
            CallFormat.HERMES,
            "<tool_call>" + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
            "deeper",
        ),
        (
            CallFormat.HERMES,
            '<tool_call>{"name": "a", "arguments": {"x": "' + "y" * 70000 + '"}}',
            "characters",
        ),
        (
            CallFormat.HARMONY,
            "<|channel|>commentary to=browser.search<|message|>{}<|call|>",
            "built-in",
        ),
        (CallFormat.LFM2, "<|tool_call_start|>[add(1, 2)]<|tool_call_end|>", "name(arg=value"),
        (
            CallFormat.LFM2,
            "<|tool_call_start|>[add(a=__import__('os'))]<|tool_call_end|>",
            "not a literal",
        ),
        (CallFormat.LFM2, "<|tool_call_start|>[add(a={1, 2})]<|tool_call_end|>", "set"),
        (CallFormat.LFM2, "<|tool_call_start|>[add(a=1e999)]<|tool_call_end|>", "finite"),
        (  # found by the campaign: json.loads reads 1e999 as inf
            CallFormat.HERMES,
            '<tool_call>{"name": "a", "arguments": {"x": 1e999}}</tool_call>',
            "not valid JSON",
        ),
        (CallFormat.MISTRAL, "[TOOL_CALLS]add{}", "name[ARGS]"),
    ],
)
def test_a_call_that_cannot_be_read_is_one_line(fmt: CallFormat, reply: str, says: str) -> None:
    with pytest.raises(ToolCallError) as caught:
        parse_reply(reply, fmt)
    message = str(caught.value)
    assert says in message and "\n" not in message and len(message) < 300


def test_the_format_comes_from_the_template() -> None:
    assert (
        detect_format("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}<|im_start|>")
        == CallFormat.HERMES
    )
    assert detect_format("<|start_header_id|>ipython<|end_header_id|>") == CallFormat.LLAMA3
    assert detect_format("[AVAILABLE_TOOLS][TOOL_CALLS]") == CallFormat.MISTRAL
    assert (
        detect_format("<|start|>{{ m }}<|channel|>commentary to=functions.x") == CallFormat.HARMONY
    )
    assert detect_format("<|start_of_role|>tools<|end_of_role|><tool_call>") == CallFormat.GRANITE
    assert detect_format("<|tool_call_start|> <tool_call>") == CallFormat.LFM2
    assert detect_format("{{ messages }}") is None and detect_format(None) is None
    with pytest.raises(ToolCallError, match="SmolLM2's chat template shows no tool-call format"):
        call_format("<|im_start|>{{ m }}", "SmolLM2")
    assert named_format(" Hermes ") == CallFormat.HERMES
    with pytest.raises(ToolCallError, match="unknown tool-call format"):
        named_format("xml")
