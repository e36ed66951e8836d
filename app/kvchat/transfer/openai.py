"""OpenAI-style chat JSON: ``{"messages": [...]}`` or a bare list of ``{role, content}``.

``content`` is a string or a list of parts, of which the text ones (``{"type": "text",
"text": ...}``, and the Responses API's ``input_text``/``output_text``) are kept. Leading
``system``/``developer`` messages become the system prompt. Tool results, tool-call-only
assistant messages and non-text parts have no place in kvchat: they are left out and
counted; any other role is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvchat.transfer.common import (
    MAX_MESSAGES,
    BadFile,
    ImportedMessage,
    ImportedSession,
    check_text,
    default_title,
    reply_parts,
)

NAME = "OpenAI JSON"
_SYSTEM = ("system", "developer")
_TOOL = ("tool", "function")
_TEXT_PARTS = ("text", "input_text", "output_text")


def _is_message(item: object) -> bool:
    return isinstance(item, dict) and "role" in item


def matches(document: object) -> bool:
    if isinstance(document, dict):
        return isinstance(document.get("messages"), list)
    return isinstance(document, list) and bool(document) and all(map(_is_message, document))


def _text(path: Path, content: object, where: str) -> tuple[str | None, int]:
    """The message's text (None: no text at all) and how many non-text parts it had."""
    if isinstance(content, str):
        return check_text(path, content, where), 0
    if content is None:
        return None, 0
    if not isinstance(content, list):
        raise BadFile(path, f"{where} is neither text nor a list of parts")
    texts: list[str] = []
    other = 0
    for number, part in enumerate(content, 1):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadFile(path, f"{where} part {number} has no type")
        if part["type"] in _TEXT_PARTS:
            text = check_text(path, part.get("text"), f"{where} part {number}.text")
            assert text is not None
            texts.append(text)
        else:
            other += 1
    return ("\n".join(texts) if texts else None), other


def read(path: Path, document: Any) -> list[ImportedSession]:
    items = document["messages"] if isinstance(document, dict) else document
    if not items:
        raise BadFile(path, "the file holds no messages")
    if len(items) > MAX_MESSAGES:
        raise BadFile(path, f"{len(items):,} messages is over the {MAX_MESSAGES:,} limit")
    system: list[str] = []
    messages: list[ImportedMessage] = []
    skipped = 0
    for index, item in enumerate(items):
        where = f"message {index + 1}"
        if not isinstance(item, dict):
            raise BadFile(path, f"{where} is not an object")
        role = item.get("role")
        if not isinstance(role, str):
            raise BadFile(path, f"{where} has no role")
        if "content" not in item:
            raise BadFile(path, f"{where} has no content")
        if role in _TOOL:
            skipped += 1
            continue
        if role not in ("user", "assistant", *_SYSTEM):
            raise BadFile(path, f"{where} has an unknown role {role!r}")
        text, other = _text(path, item["content"], f"{where}.content")
        skipped += other
        if role in _SYSTEM:
            if messages:
                raise BadFile(
                    path,
                    f"{where} is a system message after the conversation started "
                    "(kvchat keeps one system prompt per session)",
                )
            if text:
                system.append(text)
            continue
        if text is None:
            skipped += 1  # an assistant turn that only calls tools, or an image alone
            continue
        thought = item.get("reasoning_content", item.get("reasoning"))
        answer, reasoning = reply_parts(path, role, text, thought, where)
        messages.append(ImportedMessage(role, answer, reasoning=reasoning))
    title = document.get("title") if isinstance(document, dict) else None
    if isinstance(title, str) and title.strip():
        title = check_text(path, title, "title")
    else:
        title = default_title(messages)
    return [
        ImportedSession(
            title=title,
            system_prompt="\n\n".join(system) or None,
            settings={},
            messages=messages,
            skipped=skipped,
        )
    ]
