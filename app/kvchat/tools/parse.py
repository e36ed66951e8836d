"""What an MCP server sends, read once into bounded, typed values.

A server is outside kvchat: its tool list and its results are parsed here from their wire
shape (JSON-like dicts, as the SDK's models dump them ``by_alias``), never trusted. A tool
that cannot be read is left out with one line saying why; a result is text (other content is
a one-line note), cut for the model at a cap with a note, kept whole up to a hard cap.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from kvchat.text import one_line
from kvchat.tools.api import ToolError, ToolResult, ToolSpec

# A tool's name as MCP allows it (1-128 of letters, digits, _ - .); the qualified name is
# server.tool, and a server name has no dot, so the first dot splits them.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_TOOLS_PER_SERVER = 256
MAX_DESCRIPTION_CHARS = 4096
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 16
MAX_ARGUMENT_BYTES = 1024 * 1024
# What the model reads of one result, and what is kept of it at most.
RESULT_CAP_CHARS = 16_000
FULL_CAP_CHARS = 32 * 1024 * 1024
MAX_CONTENT_PARTS = 1024
_SURROGATE = re.compile("[\ud800-\udfff]")
# How much of a server's name, tool name or error text a message quotes.
QUOTE_CHARS = 80


def quoted(value: object) -> str:
    """``value`` as a message may quote it: one visible line, cut short."""
    text = one_line(str(value))
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 1] + "…"


def valid_text(text: str) -> str:
    """``text`` storable as UTF-8: a lone surrogate (JSON allows them) becomes U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted without recursion past ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(item, Mapping):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((child, depth + 1) for child in item)
    return deepest


def bounded_json(value: Any, what: str, max_bytes: int) -> str:
    """``value`` as compact JSON if it is plain JSON (no NaN or infinity, string keys, not
    too deep) of at most ``max_bytes``; else a :class:`ToolError` naming ``what``."""
    if _depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ToolError(f"{what} is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ToolError(f"{what} is not plain JSON ({quoted(exc)})") from exc
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ToolError(f"{what} is {size:,} bytes of JSON, over the {max_bytes:,} allowed")
    return text


def parse_tool(server: str, raw: Any) -> ToolSpec:
    """One entry of a server's ``tools/list`` as a :class:`ToolSpec`, or a ToolError."""
    if not isinstance(raw, Mapping):
        raise ToolError(f"a tool of server {server} is not an object")
    name = raw.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolError(
            f"server {server} lists a tool named {quoted(name)!s}: a name is 1-128 letters, "
            "digits, _ - or ."
        )
    description = raw.get("description")
    if description is None:
        description = raw.get("title") or ""
    if not isinstance(description, str):
        raise ToolError(f"tool {server}.{name}: its description is not text")
    description = valid_text(description).strip()
    if len(description) > MAX_DESCRIPTION_CHARS:
        description = description[: MAX_DESCRIPTION_CHARS - 1] + "…"
    schema = raw.get("inputSchema")
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, Mapping):
        raise ToolError(f"tool {server}.{name}: its input schema is not an object")
    if schema.get("type", "object") != "object":
        raise ToolError(f"tool {server}.{name}: its input schema's type is not object")
    text = bounded_json(schema, f"tool {server}.{name}'s input schema", MAX_SCHEMA_BYTES)
    bounded: dict[str, Any] = json.loads(text)
    bounded.setdefault("type", "object")
    return ToolSpec(server=server, name=name, description=description, input_schema=bounded)


def parse_tool_list(server: str, raw: Any) -> tuple[list[ToolSpec], list[str]]:
    """A server's listed tools (all pages joined) as specs, and one line for each left out.

    More than :data:`MAX_TOOLS_PER_SERVER` tools, or a name listed twice, leaves the extra
    ones out; a list that is not a list is a ToolError.
    """
    if not isinstance(raw, list):
        raise ToolError(f"server {server}'s tool list is not a list")
    tools: list[ToolSpec] = []
    dropped: list[str] = []
    seen: set[str] = set()
    for index, entry in enumerate(raw):
        if len(tools) >= MAX_TOOLS_PER_SERVER:
            dropped.append(
                f"server {server} lists {len(raw):,} tools; kvchat takes the first "
                f"{MAX_TOOLS_PER_SERVER}"
            )
            break
        try:
            spec = parse_tool(server, entry)
        except ToolError as exc:
            dropped.append(f"{exc} (entry {index + 1}, left out)")
            continue
        if spec.name in seen:
            dropped.append(f"server {server} lists {spec.name} twice; the first is kept")
            continue
        seen.add(spec.name)
        tools.append(spec)
    return tools, dropped


def check_arguments(qualified: str, arguments: Any) -> dict[str, Any]:
    """A call's arguments: a JSON object of at most :data:`MAX_ARGUMENT_BYTES`."""
    if not isinstance(arguments, Mapping):
        raise ToolError(f"the arguments of {qualified} must be a JSON object")
    text = bounded_json(arguments, f"the arguments of {qualified}", MAX_ARGUMENT_BYTES)
    parsed: dict[str, Any] = json.loads(text)
    return parsed


def parse_arguments(qualified: str, text: str) -> dict[str, Any]:
    """Arguments typed as JSON text (``kvchat tools call``, ``/tool``), bounded."""
    if len(text) > MAX_ARGUMENT_BYTES:
        raise ToolError(f"the arguments of {qualified} are over {MAX_ARGUMENT_BYTES:,} characters")
    try:
        value = json.loads(text or "{}", parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ToolError(f"the arguments of {qualified} are not JSON: {quoted(exc)}") from exc
    return check_arguments(qualified, value)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _size_note(value: Any) -> str:
    return f"{len(value):,} characters of base64" if isinstance(value, str) else "no data"


def content_text(part: Any) -> str:
    """One content block of a result as text: text as it is; anything else a note."""
    if not isinstance(part, Mapping):
        return "[kvchat: a content block that is not an object, left out]"
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        return valid_text(text) if isinstance(text, str) else "[kvchat: text block without text]"
    if kind in ("image", "audio"):
        mime = quoted(part.get("mimeType") or "unknown type")
        return f"[kvchat: {kind} ({mime}, {_size_note(part.get('data'))}) not shown to the model]"
    if kind == "resource":
        resource = part.get("resource")
        if isinstance(resource, Mapping):
            uri = quoted(resource.get("uri") or "")
            text = resource.get("text")
            if isinstance(text, str):
                return f"[resource {uri}]\n{valid_text(text)}"
            return f"[kvchat: resource {uri} ({_size_note(resource.get('blob'))}) not shown]"
        return "[kvchat: a resource block without a resource]"
    if kind == "resource_link":
        return f"[resource link: {quoted(part.get('uri') or '')}]"
    return f"[kvchat: a content block of type {quoted(kind)} not shown]"


def cut_for_model(full_text: str, cap: int) -> tuple[str, bool]:
    """``full_text`` as the model reads it: whole, or its first ``cap`` characters and a note."""
    if len(full_text) <= cap:
        return full_text, False
    note = (
        f"\n[kvchat: result truncated: the first {cap:,} of {len(full_text):,} characters "
        "are shown; the whole result is kept in the conversation]"
    )
    return full_text[:cap] + note, True


def parse_result(raw: Any, *, seconds: float, cap: int = RESULT_CAP_CHARS) -> ToolResult:
    """A ``tools/call`` result (wire shape) as a :class:`ToolResult`.

    Text blocks join with line breaks; with no content, ``structuredContent`` is the text
    (as JSON). Past :data:`FULL_CAP_CHARS` even the kept text is cut, with a note.
    """
    if not isinstance(raw, Mapping):
        raise ToolError("the tool's result is not an object")
    is_error = raw.get("isError") is True
    content = raw.get("content")
    parts: list[str] = []
    if isinstance(content, list):
        for part in content[:MAX_CONTENT_PARTS]:
            parts.append(content_text(part))
        if len(content) > MAX_CONTENT_PARTS:
            parts.append(f"[kvchat: {len(content) - MAX_CONTENT_PARTS:,} more blocks left out]")
    elif content is not None:
        raise ToolError("the tool's result content is not a list")
    if not parts and raw.get("structuredContent") is not None:
        try:
            parts.append(json.dumps(raw["structuredContent"], allow_nan=False, ensure_ascii=False))
        except (TypeError, ValueError, RecursionError):
            parts.append("[kvchat: structured content that is not plain JSON, left out]")
    full_text = "\n".join(parts)
    if len(full_text) > FULL_CAP_CHARS:
        full_text = (
            full_text[:FULL_CAP_CHARS]
            + f"\n[kvchat: cut at {FULL_CAP_CHARS:,} of {len(full_text):,} characters]"
        )
    text, truncated = cut_for_model(full_text, cap)
    seconds = seconds if math.isfinite(seconds) and seconds >= 0 else 0.0
    return ToolResult(
        text=text, full_text=full_text, is_error=is_error, truncated=truncated, seconds=seconds
    )


def split_qualified(qualified: str) -> tuple[str, str]:
    """``server.tool`` as (server, tool), or a ToolError."""
    server, dot, tool = qualified.partition(".")
    if not dot or not server or not tool:
        raise ToolError(f"name a tool as SERVER.TOOL, not {quoted(qualified)}")
    return server, tool
