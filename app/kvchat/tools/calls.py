"""Tool calls in a model's finished reply, for the chat-template families kvchat's catalog
holds: pure functions, no model, no I/O.

A reply is a model's text, so it is read like any text from outside: bounded (its length,
a call's size, JSON nesting), and anything that is not a well-formed call in the model's
format is one clear line (:class:`ToolCallError`), never a traceback.

Which format a model uses is read from its chat template's text (:func:`call_format`):

* ``hermes`` (Qwen 2.5/3, Hermes, SmolLM3...): ``<tool_call>{"name": …, "arguments": …}</tool_call>``
* ``llama3`` (Llama 3.1-3.3): ``{"name": …, "parameters": …}`` alone, or after ``<|python_tag|>``
* ``mistral``: ``[TOOL_CALLS][{"name": …, "arguments": …}]`` or ``[TOOL_CALLS]name[ARGS]{…}``
* ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.NAME … <|message|>{…}<|call|>``
* ``granite``: ``<|tool_call|>[…]`` or ``<tool_call>[…]``
* ``lfm2``: ``<|tool_call_start|>[name(arg=value, …)]<|tool_call_end|>``
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvchat.errors import KvchatError

# A reply longer than this is not searched for calls (a model's reply is a few thousand
# characters; this is many times the largest max_tokens allows).
MAX_REPLY_CHARS = 1 << 20
# One call's JSON (or LFM2 call list) at most.
MAX_CALL_CHARS = 64 * 1024
# Brackets and braces nested at most this deep in a call.
MAX_DEPTH = 32
# Calls in one reply at most.
MAX_CALLS = 16
# A tool's name: what MCP allows (letters, digits, _ - .), bounded.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
# A call id a model wrote (Mistral's 9 characters; any short plain id).
CALL_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}")


class CallFormat(StrEnum):
    """How a model family writes a tool call."""

    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    HARMONY = "harmony"
    GRANITE = "granite"
    LFM2 = "lfm2"


class ToolCallError(KvchatError):
    """A reply's tool call that cannot be read, or a model whose format is unknown: one line."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name as the model wrote it, its arguments (a JSON
    object), and the call's id when the format carries one ("" otherwise)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    call_id: str = ""

    @property
    def arguments_json(self) -> str:
        """The arguments as compact JSON (what is stored and shown)."""
        return json.dumps(self.arguments, ensure_ascii=False, separators=(", ", ": "))


@dataclass(frozen=True)
class ParsedReply:
    """A reply cut into its text (the calls taken out, stripped) and its calls, in order."""

    text: str
    calls: tuple[ToolCall, ...] = ()


# --- which format --------------------------------------------------------------------------

# Marks in a chat template's text, checked in this order (the first found decides): the
# more specific spellings first (Granite 4 and LFM2 templates mention <tool_call> too).
TEMPLATE_MARKS: tuple[tuple[CallFormat, tuple[str, ...]], ...] = (
    (CallFormat.HARMONY, ("<|channel|>", "to=functions.")),
    (CallFormat.LFM2, ("<|tool_call_start|>",)),
    (CallFormat.MISTRAL, ("[TOOL_CALLS]",)),
    (CallFormat.GRANITE, ("<|start_of_role|>", "tool")),
    (CallFormat.HERMES, ("<tool_call>",)),
    (CallFormat.LLAMA3, ("<|python_tag|>",)),
    (CallFormat.LLAMA3, ("<|start_header_id|>", "ipython")),
)


def detect_format(template: str | None) -> CallFormat | None:
    """The tool-call format a chat template's text shows, or None when it shows none."""
    if not template:
        return None
    for found, marks in TEMPLATE_MARKS:
        if all(mark in template for mark in marks):
            return found
    return None


def call_format(template: str | None, model: str = "this model") -> CallFormat:
    """:func:`detect_format`, or one clear line saying tools cannot be used with ``model``."""
    found = detect_format(template)
    if found is None:
        known = ", ".join(f.value for f in CallFormat)
        raise ToolCallError(
            f"{model}'s chat template shows no tool-call format kvchat reads ({known}): "
            "its replies are not read for tool calls (/tool still runs one)"
        )
    return found


def named_format(name: str) -> CallFormat:
    """A format named by the user (a setting), or one clear line."""
    try:
        return CallFormat(name.strip().lower())
    except ValueError:
        known = ", ".join(f.value for f in CallFormat)
        raise ToolCallError(f"unknown tool-call format {name[:40]!r}: one of {known}") from None


# --- bounded values --------------------------------------------------------------------------


def nesting_depth(text: str) -> int:
    """The deepest bracket/brace nesting of ``text`` outside JSON/Python strings."""
    depth = deepest = 0
    quote = ""
    escaped = False
    for char in text:
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
            continue
        if char in "\"'":
            quote = char
        elif char in "[{(":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]})":
            depth = max(0, depth - 1)
    return deepest


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_CALL_CHARS:
        raise ToolCallError(
            f"{what} is {len(text):,} characters: more than the {MAX_CALL_CHARS:,} a call may have"
        )
    if nesting_depth(text) > MAX_DEPTH:
        raise ToolCallError(f"{what} nests deeper than {MAX_DEPTH} levels")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is not a finite number")
    return value


def bounded_json(text: str, what: str = "the tool call") -> Any:
    """``text`` parsed as strict JSON (no NaN/Infinity), at most :data:`MAX_CALL_CHARS`
    characters and :data:`MAX_DEPTH` levels deep; else one line."""
    text = text.strip()
    _check_size(text, what)
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise ToolCallError(f"{what} is not valid JSON: {_short(str(exc))}") from None


def _json_values(text: str, what: str) -> Iterator[Any]:
    """The JSON values written one after another in ``text`` (separated by spaces, commas or
    semicolons, as Llama 3 writes several calls), each bounded like :func:`bounded_json`."""
    text = text.strip()
    _check_size(text, what)
    decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
    at = 0
    for _ in range(MAX_CALLS + 1):
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at >= len(text):
            return
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError) as exc:
            raise ToolCallError(f"{what} is not valid JSON: {_short(str(exc))}") from None
        yield value
    raise ToolCallError(f"{what} holds more than {MAX_CALLS} calls")


def _short(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 120 else line[:117] + "..."


def checked_name(name: Any, what: str = "the tool call") -> str:
    """A tool's name as a model wrote it, if it is a plain bounded name; else one line."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = _short(repr(name))[:60]
        raise ToolCallError(f"{what} names no tool kvchat can call ({shown})")
    return name


def checked_arguments(arguments: Any, what: str = "the tool call") -> dict[str, Any]:
    """A call's arguments: a JSON object (a string holding one is read too: some models
    write ``"arguments": "{…}"``); None or absent is ``{}``."""
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        arguments = bounded_json(arguments, f"{what}'s arguments") if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{what}'s arguments are not a JSON object")
    return arguments


def _call_of(value: Any, what: str, arguments_key: str = "arguments") -> ToolCall:
    """A call from its JSON object ``{"name": …, "arguments"|"parameters": …, "id"?: …}``."""
    if not isinstance(value, dict):
        raise ToolCallError(f"{what} is not a JSON object with a name")
    name = checked_name(value.get("name"), what)
    arguments = value.get(arguments_key, value.get("parameters", value.get("arguments")))
    call_id = value.get("id", "")
    if not isinstance(call_id, str) or (call_id and not CALL_ID.fullmatch(call_id)):
        call_id = ""
    return ToolCall(name, checked_arguments(arguments, what), call_id)


def _calls_of(value: Any, what: str) -> list[ToolCall]:
    """Calls from one JSON value: an object, or a list of them."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ToolCallError(f"{what} is an empty list")
    return [_call_of(item, what) for item in items]


def _bounded(calls: list[ToolCall]) -> tuple[ToolCall, ...]:
    if len(calls) > MAX_CALLS:
        raise ToolCallError(f"the reply makes {len(calls)} tool calls: at most {MAX_CALLS}")
    return tuple(calls)


# --- the families ----------------------------------------------------------------------------


def _tagged(reply: str, start: str, end: str | None) -> tuple[str, list[str]]:
    """``reply`` without its ``start…end`` blocks, and the blocks' insides; a block left open
    runs to the reply's end (the model stopped at its end-of-turn token)."""
    text: list[str] = []
    blocks: list[str] = []
    at = 0
    while True:
        begin = reply.find(start, at)
        if begin < 0:
            text.append(reply[at:])
            break
        text.append(reply[at:begin])
        inside = begin + len(start)
        close = reply.find(end, inside) if end else -1
        if close < 0:
            blocks.append(reply[inside:])
            break
        blocks.append(reply[inside:close])
        at = close + len(end or "")
        if len(blocks) > MAX_CALLS:
            raise ToolCallError(f"the reply makes more than {MAX_CALLS} tool calls")
    return "".join(text).strip(), blocks


def _hermes(reply: str) -> ParsedReply:
    text, blocks = _tagged(reply, "<tool_call>", "</tool_call>")
    calls: list[ToolCall] = []
    for block in blocks:
        calls += _calls_of(bounded_json(block), "the tool call")
    return ParsedReply(text, _bounded(calls))


def _granite(reply: str) -> ParsedReply:
    if "<|tool_call|>" in reply:
        at = reply.index("<|tool_call|>")
        body = reply[at + len("<|tool_call|>") :]
        calls = _calls_of(bounded_json(body), "the tool call")
        return ParsedReply(reply[:at].strip(), _bounded(calls))
    return _hermes(reply)


def _llama3(reply: str) -> ParsedReply:
    tag = "<|python_tag|>"
    if tag in reply:
        at = reply.index(tag)
        text, body = reply[:at].strip(), reply[at + len(tag) :]
        body = body.split("<|eom_id|>")[0].split("<|eot_id|>")[0]
    else:
        stripped = reply.strip()
        if not stripped.startswith("{") or '"name"' not in stripped:
            return ParsedReply(stripped)  # plain text: Llama 3 writes a call as the whole reply
        text, body = "", stripped
    calls = [_call_of(v, "the tool call") for v in _json_values(body, "the tool call")]
    if not calls:
        raise ToolCallError("the tool call after <|python_tag|> is empty")
    return ParsedReply(text, _bounded(calls))


def _mistral(reply: str) -> ParsedReply:
    tag = "[TOOL_CALLS]"
    if tag not in reply:
        return ParsedReply(reply.strip())
    at = reply.index(tag)
    text = reply[:at].strip()
    body = reply[at + len(tag) :].split("</s>")[0].strip()
    if body.startswith("["):  # [TOOL_CALLS][{...}, ...]
        return ParsedReply(text, _bounded(_calls_of(bounded_json(body), "the tool call")))
    calls: list[ToolCall] = []  # v11+: [TOOL_CALLS]name[ARGS]{...} (one per tag)
    for part in body.split(tag):
        name, args_tag, rest = part.partition("[ARGS]")
        if not args_tag:
            raise ToolCallError(
                "the tool call after [TOOL_CALLS] is neither a list nor name[ARGS]{…}"
            )
        call_id = ""
        if "[CALL_ID]" in name:
            name, _, call_id = name.partition("[CALL_ID]")
            call_id = call_id.strip() if CALL_ID.fullmatch(call_id.strip()) else ""
        calls.append(
            ToolCall(
                checked_name(name.strip()),
                checked_arguments(bounded_json(rest, "the tool call's arguments")),
                call_id,
            )
        )
    return ParsedReply(text, _bounded(calls))


HARMONY_ENDS = ("<|call|>", "<|end|>", "<|return|>", "<|start|>")
HARMONY_RECIPIENT = re.compile(r"to=([^\s<]+)")
HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z]+)")


def _harmony(reply: str) -> ParsedReply:
    """Messages ``header<|message|>body<end>``: a header naming ``to=functions.NAME`` is a
    call; the bodies of final (or unmarked) messages are the text; analysis is not."""
    if "<|message|>" not in reply:
        return ParsedReply(reply.strip())
    text: list[str] = []
    calls: list[ToolCall] = []
    at = 0
    while at < len(reply):
        mark = reply.find("<|message|>", at)
        if mark < 0:
            break
        header = reply[at:mark]
        body_at = mark + len("<|message|>")
        ends = [e for e in (reply.find(t, body_at) for t in HARMONY_ENDS) if e >= 0]
        end = min(ends) if ends else len(reply)
        body = reply[body_at:end]
        recipient = HARMONY_RECIPIENT.search(header)
        channel = HARMONY_CHANNEL.search(header)
        if recipient is not None:
            target = recipient.group(1)
            if not target.startswith("functions."):
                raise ToolCallError(
                    f"the reply calls {_short(target)[:60]!r}, a built-in tool kvchat does not have"
                )
            calls.append(
                ToolCall(
                    checked_name(target[len("functions.") :]),
                    checked_arguments(bounded_json(body)),
                )
            )
            if len(calls) > MAX_CALLS:
                raise ToolCallError(f"the reply makes more than {MAX_CALLS} tool calls")
        elif channel is None or channel.group(1) == "final":
            text.append(body)
        at = end
        for token in HARMONY_ENDS:
            if reply.startswith(token, at) and token != "<|start|>":
                at += len(token)
                break
    return ParsedReply("".join(text).strip(), _bounded(calls))


def _lfm2(reply: str) -> ParsedReply:
    text, blocks = _tagged(reply, "<|tool_call_start|>", "<|tool_call_end|>")
    calls: list[ToolCall] = []
    for block in blocks:
        calls += _python_calls(block)
    return ParsedReply(text, _bounded(calls))


def _python_calls(block: str) -> list[ToolCall]:
    """``[name(arg=value, …), …]`` read as Python syntax (never run): literal values only."""
    block = block.strip()
    if block.startswith("[{") or block.startswith("{"):  # LFM2 told to write JSON
        return _calls_of(bounded_json(block), "the tool call")
    _check_size(block, "the tool call")
    try:
        tree = ast.parse(block, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolCallError(
            f"the tool call is not name(arg=value) syntax: {_short(str(exc))}"
        ) from None
    items = tree.elts if isinstance(tree, ast.List | ast.Tuple) else [tree]
    if not items:
        raise ToolCallError("the tool call is an empty list")
    calls = []
    for item in items[: MAX_CALLS + 1]:
        if not isinstance(item, ast.Call) or item.args:
            raise ToolCallError("the tool call is not name(arg=value, …)")
        name = _dotted(item.func)
        arguments: dict[str, Any] = {}
        for keyword in item.keywords:
            if keyword.arg is None:
                raise ToolCallError("the tool call passes **arguments")
            arguments[keyword.arg] = _literal(keyword.value)
        calls.append(ToolCall(checked_name(name), arguments))
    return calls


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ToolCallError("the tool call does not name a tool")


def _literal(node: ast.expr) -> Any:
    """A literal as a JSON value (strings, finite numbers, booleans, None, lists, dicts with
    string keys); anything else is one line."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as exc:
        raise ToolCallError(
            f"a tool call's argument is not a literal: {_short(str(exc))}"
        ) from None
    return _json_value(value)


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolCallError("a tool call's argument is not a finite number")
        return value
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v) for k, v in value.items()}
    raise ToolCallError(f"a tool call's argument is a {type(value).__name__}, not a JSON value")


PARSERS = {
    CallFormat.HERMES: _hermes,
    CallFormat.LLAMA3: _llama3,
    CallFormat.MISTRAL: _mistral,
    CallFormat.HARMONY: _harmony,
    CallFormat.GRANITE: _granite,
    CallFormat.LFM2: _lfm2,
}


def parse_reply(reply: str, fmt: CallFormat) -> ParsedReply:
    """A finished reply's text and tool calls in format ``fmt``; a call that cannot be read
    is one line (:class:`ToolCallError`)."""
    if len(reply) > MAX_REPLY_CHARS:
        raise ToolCallError(
            f"the reply is {len(reply):,} characters: more than the {MAX_REPLY_CHARS:,} "
            "searched for tool calls"
        )
    return PARSERS[fmt](reply)
