"""kvchat's own JSON export (``kvchat export --format json``; a bundle's messages.json).

``{"format": "kvchat.session/1", "session": {...}, "documents": [...], "messages": [...],
"message_meta": [...]}``: the session's system prompt (also the first message, role
``system``), its sampling settings, its documents placed as they were
(:mod:`kvchat.transfer.imported_documents`; older exports have none), every message with its
``partial`` flag, and per message its time and token count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvchat.transfer.common import (
    MAX_MESSAGES,
    BadFile,
    ImportedCall,
    ImportedMessage,
    ImportedSession,
    ImportedTool,
    check_settings,
    check_text,
    imported_call,
    iso_time,
    reply_parts,
    require,
)
from kvchat.transfer.imported_documents import read_documents
from kvchat.transfer.imported_summaries import read_summaries

FORMAT = "kvchat.session/1"
NAME = "kvchat JSON"


def _tool_parts(
    path: Path, item: dict[str, Any], role: str, where: str
) -> tuple[ImportedTool | None, tuple[ImportedCall, ...]]:
    """A tool message's tool (``tool_call_id``, ``name``, ``kvchat_tool``) or a reply's
    calls (``tool_calls``, OpenAI's shape), as kvchat's JSON export writes them."""
    if role == "tool":
        extra = item.get("kvchat_tool") or {}
        if not isinstance(extra, dict):
            raise BadFile(path, f"{where}.kvchat_tool is not an object")
        call_id, name, arguments = imported_call(
            path, item.get("name"), item.get("tool_call_id"), extra.get("arguments"), where
        )
        flags = [extra.get(key, False) for key in ("is_error", "truncated")]
        if not all(isinstance(flag, bool) for flag in flags):
            raise BadFile(path, f"{where}.kvchat_tool's is_error and truncated are true or false")
        full = check_text(path, extra.get("full_text"), f"{where}.full_text", optional=True)
        return ImportedTool(name, call_id, arguments, flags[0], flags[1], full), ()
    calls = item.get("tool_calls")
    if role != "assistant" or calls is None:
        return None, ()
    if not isinstance(calls, list) or len(calls) > 64:
        raise BadFile(path, f"{where}.tool_calls is not a list of at most 64 calls")
    found = []
    for number, call in enumerate(calls, 1):
        at = f"{where} call {number}"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise BadFile(path, f"{at} has no function")
        found.append(
            imported_call(path, function.get("name"), call.get("id"), function.get("arguments"), at)
        )
    return None, tuple(found)


def matches(document: object) -> bool:
    return isinstance(document, dict) and document.get("format") == FORMAT


def read(path: Path, document: Any) -> list[ImportedSession]:
    session = require(path, document, "session", dict, "the export")
    items = require(path, document, "messages", list, "the export")
    if len(items) > MAX_MESSAGES:
        raise BadFile(path, f"{len(items):,} messages is over the {MAX_MESSAGES:,} limit")
    title = check_text(path, session.get("title"), "session.title")
    assert title is not None
    system = check_text(path, session.get("system_prompt"), "session.system_prompt", optional=True)
    settings = check_settings(path, session.get("settings"), "session.settings")
    meta = document.get("message_meta")
    if meta is not None and not isinstance(meta, list):
        raise BadFile(path, "message_meta is not a list")
    messages: list[ImportedMessage] = []
    kept: dict[int, int] = {}  # index in the file's messages -> in the imported ones
    for index, item in enumerate(items):
        where = f"message {index + 1}"
        role = require(path, item, "role", str, where)
        content = check_text(path, item.get("content"), f"{where}.content")
        assert content is not None
        if role == "system":
            if index == 0 and content == (system or ""):
                continue  # the system prompt, repeated as the first message
            raise BadFile(
                path,
                f"{where} is a system message after the start (kvchat keeps one system prompt)",
            )
        if role not in ("user", "assistant", "tool"):
            raise BadFile(path, f"{where} has an unknown role {role!r}")
        tool, calls = _tool_parts(path, item, role, where)
        partial = item.get("partial", False)
        if not isinstance(partial, bool):
            raise BadFile(path, f"{where}.partial is not true or false")
        created, tokens = None, 0
        if meta is not None and len(messages) < len(meta) and isinstance(meta[len(messages)], dict):
            entry = meta[len(messages)]
            created = iso_time(entry.get("created"))
            count = entry.get("token_count")
            if isinstance(count, int) and not isinstance(count, bool) and 0 <= count < 1 << 31:
                tokens = count
        answer, reasoning = reply_parts(path, role, content, item.get("reasoning_content"), where)
        kept[index] = len(messages)
        messages.append(
            ImportedMessage(role, answer, partial, created, tokens, reasoning, tool, calls)
        )
    source_id = session.get("id")
    return [
        ImportedSession(
            title=title,
            system_prompt=system or None,
            settings=settings,
            messages=messages,
            source_key=f"kvchat:{source_id}" if isinstance(source_id, str) else None,
            created=iso_time(session.get("created")),
            updated=iso_time(session.get("updated")),
            documents=read_documents(path, document.get("documents"), kept),
            summaries=read_summaries(path, document.get("summaries"), kept),
        )
    ]
