"""A ChatGPT data export's ``conversations.json``: many conversations, each a message tree.

Each conversation's ``mapping`` holds nodes ``{id, message, parent, children}``; the branch
the user last saw is the path from ``current_node`` up the ``parent`` links. On it, nodes
without a message, hidden ones (``metadata.is_visually_hidden_from_conversation``),
non-text content (images, browsing displays, reasoning summaries) and empty messages are
left out; a system message before the first user or assistant message becomes the system
prompt. A tool call (an assistant message whose ``recipient`` is a tool, its text or code
the input) is a reply with that call; a tool's message (role ``tool``, its text or
execution output) is a tool message answering the call before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kvchat.transfer.common import (
    MAX_MESSAGES,
    MAX_SESSIONS,
    BadFile,
    ImportedCall,
    ImportedMessage,
    ImportedSession,
    ImportedTool,
    check_text,
    default_title,
    imported_call,
    iso_time,
)

NAME = "ChatGPT export"
NO_CONVERSATION = "no conversation in it has a message to import"
_TEXT_TYPES = ("text", "multimodal_text")
# Content whose ``text`` field is a tool's input (code) or output.
_TOOL_TEXT_TYPES = ("code", "execution_output", "text", "multimodal_text")
_ROLES = ("user", "assistant", "system", "tool")


def first_matches(first: object) -> bool:
    """Whether the first element of a list is a ChatGPT conversation (the list is then
    read one conversation at a time)."""
    return isinstance(first, dict) and isinstance(first.get("mapping"), dict)


def matches(document: object) -> bool:
    if isinstance(document, dict):
        return isinstance(document.get("mapping"), dict)
    return (
        isinstance(document, list)
        and bool(document)
        and all(isinstance(c, dict) and isinstance(c.get("mapping"), dict) for c in document)
    )


def _branch(path: Path, mapping: dict[str, Any], current: object, where: str) -> list[Any]:
    """The nodes from the root to ``current``, following ``parent`` links (cycles refused)."""
    if not isinstance(current, str) or current not in mapping:
        raise BadFile(path, f"{where} has no current_node in its mapping")
    chain: list[Any] = []
    seen: set[str] = set()
    node_id: object = current
    while node_id is not None:
        if not isinstance(node_id, str) or node_id not in mapping:
            raise BadFile(path, f"{where}: node {str(node_id)[:40]!r} is not in the mapping")
        if node_id in seen:
            raise BadFile(path, f"{where}: the parent links form a cycle")
        seen.add(node_id)
        node = mapping[node_id]
        if not isinstance(node, dict):
            raise BadFile(path, f"{where}: node {node_id[:40]!r} is not an object")
        chain.append(node)
        node_id = node.get("parent")
    chain.reverse()
    return chain


def _message_text(path: Path, message: dict[str, Any], where: str) -> tuple[str | None, int]:
    """The message's text ("" when it has none), or None for one kvchat leaves out (a
    hidden message with text, a tool call, non-text content); and how many of its parts
    that are not text (an image in a multimodal message) were left out."""
    content = message.get("content")
    if not isinstance(content, dict):
        raise BadFile(path, f"{where} has no content")
    if content.get("content_type") not in _TEXT_TYPES:
        return None, 0
    parts = content.get("parts")
    if not isinstance(parts, list):
        raise BadFile(path, f"{where}.content has no parts")
    texts = []
    for number, part in enumerate(parts, 1):
        if isinstance(part, str):
            text = check_text(path, part, f"{where} part {number}")
            assert text is not None
            texts.append(text)
    dropped = sum(1 for part in parts if not isinstance(part, str))
    text = "\n".join(t for t in texts if t)
    if not text.strip():
        return "", dropped
    metadata = message.get("metadata")
    hidden = isinstance(metadata, dict) and metadata.get("is_visually_hidden_from_conversation")
    if hidden or message.get("recipient") not in (None, "all"):
        return None, 0
    return text, dropped


def _tool_text(path: Path, message: dict[str, Any], where: str) -> str | None:
    """A tool call's input or a tool's output: its text parts, or its ``text`` (code,
    execution output); None when it has neither (a browsing display, an image)."""
    content = message.get("content")
    if not isinstance(content, dict) or content.get("content_type") not in _TOOL_TEXT_TYPES:
        return None
    text = content.get("text")
    if isinstance(text, str):
        return check_text(path, text, f"{where}.content.text")
    parts = content.get("parts")
    if not isinstance(parts, list):
        return None
    texts = [check_text(path, p, f"{where} part") or "" for p in parts if isinstance(p, str)]
    joined = "\n".join(t for t in texts if t)
    return joined if joined.strip() else None


def _thoughts(path: Path, message: dict[str, Any], where: str) -> str | None:
    """A reasoning model's thoughts ("thoughts" content: each a summary and its text) as
    one text; "" for its recap ("Thought for 5 seconds"); None for any other message."""
    content = message.get("content")
    kind = content.get("content_type") if isinstance(content, dict) else None
    if kind == "reasoning_recap":
        return ""
    if kind != "thoughts" or not isinstance(content, dict):
        return None
    items = content.get("thoughts")
    texts: list[str] = []
    for number, item in enumerate(items if isinstance(items, list) else [], 1):
        if not isinstance(item, dict):
            continue
        for key in ("summary", "content"):
            text = item.get(key)
            if isinstance(text, str) and text.strip():
                texts.append(check_text(path, text, f"{where} thought {number}.{key}") or "")
    return "\n\n".join(t.strip() for t in texts if t.strip())


def _conversation(path: Path, conversation: Any, number: int) -> ImportedSession | None:
    where = f"conversation {number}"
    if not isinstance(conversation, dict):
        raise BadFile(path, f"{where} is not an object")
    mapping = conversation.get("mapping")
    if not isinstance(mapping, dict):
        raise BadFile(path, f"{where} has no mapping")
    nodes = _branch(path, mapping, conversation.get("current_node"), where)
    system: str | None = None
    messages: list[ImportedMessage] = []
    skipped = 0
    thoughts: list[str] = []  # a reasoning model's, for the reply that follows them
    last_call: ImportedCall | None = None  # what the next tool message answers
    for node in nodes:
        message = node.get("message")
        if message is None:
            continue
        node_where = f"{where}, node {str(node.get('id'))[:40]!r}"
        if not isinstance(message, dict):
            raise BadFile(path, f"{node_where}: the message is not an object")
        author = message.get("author")
        role = author.get("role") if isinstance(author, dict) else None
        if not isinstance(role, str):
            raise BadFile(path, f"{node_where}: the message has no author role")
        if role not in _ROLES:
            raise BadFile(path, f"{node_where}: unknown role {role!r}")
        if role == "assistant":
            thought = _thoughts(path, message, node_where)
            if thought is not None:
                thoughts += [thought] if thought else []
                continue
        recipient = message.get("recipient")
        if role == "assistant" and isinstance(recipient, str) and recipient not in ("all", ""):
            code = _tool_text(path, message, node_where)
            if code is None:
                skipped += 1
                continue
            arguments = {"input": code}
            call = imported_call(
                path, recipient, f"chatgpt-{node.get('id')!s:.40}", arguments, node_where
            )
            last_call = call
            created = iso_time(message.get("create_time"))
            messages.append(ImportedMessage("assistant", code, created=created, calls=(call,)))
            continue
        if role == "tool":
            output = _tool_text(path, message, node_where)
            if not output:
                skipped += 1
                continue
            author_name = author.get("name") if isinstance(author, dict) else None
            call_id, name, arguments = last_call or ("", author_name or "tool", "{}")
            if isinstance(author_name, str) and author_name.strip():
                call_id, name, arguments = imported_call(
                    path, author_name, call_id, arguments, node_where
                )
            tool = ImportedTool(name, call_id, arguments)
            created = iso_time(message.get("create_time"))
            messages.append(ImportedMessage("tool", output, created=created, tool=tool))
            last_call = None
            continue
        text, dropped = _message_text(path, message, node_where)
        skipped += dropped  # images and other parts that are not text
        if not text:
            skipped += text is None  # a tool's, hidden or non-text message; empty ones aren't
            continue
        if role == "system":
            if not messages and system is None:
                system = text
            else:
                skipped += 1
            continue
        created = iso_time(message.get("create_time"))
        reasoning = "\n\n".join(thoughts) if role == "assistant" else ""
        thoughts = [] if role == "assistant" else thoughts
        messages.append(ImportedMessage(role, text, created=created, reasoning=reasoning))
    if not messages:
        return None
    title = conversation.get("title")
    if isinstance(title, str) and title.strip():
        title = check_text(path, title, f"{where}.title")
    else:
        title = default_title(messages)
    source = conversation.get("conversation_id") or conversation.get("id")
    return ImportedSession(
        title=title,
        system_prompt=system,
        settings={},
        messages=messages,
        source_key=f"chatgpt:{source}" if isinstance(source, str) else None,
        created=iso_time(conversation.get("create_time")),
        updated=iso_time(conversation.get("update_time")),
        skipped=skipped,
    )


def sessions(path: Path, conversations: Iterable[Any]) -> Iterator[ImportedSession]:
    """The sessions of ``conversations`` as they come (a list, or a file read one
    conversation at a time); those with no text are left out. Over the session or message
    limits (messages counted as the mapping's nodes) raises :class:`BadFile`."""
    nodes = 0
    for number, conversation in enumerate(conversations, 1):
        if number > MAX_SESSIONS:
            raise BadFile(path, f"more than {MAX_SESSIONS:,} conversations is over the limit")
        if isinstance(conversation, dict) and isinstance(conversation.get("mapping"), dict):
            nodes += len(conversation["mapping"])
            if nodes > MAX_MESSAGES:
                raise BadFile(path, f"more than {MAX_MESSAGES:,} messages is over the limit")
        session = _conversation(path, conversation, number)
        if session is not None:
            yield session


def read(path: Path, document: Any) -> list[ImportedSession]:
    conversations = document if isinstance(document, list) else [document]
    if len(conversations) > MAX_SESSIONS:
        raise BadFile(
            path, f"{len(conversations):,} conversations is over the {MAX_SESSIONS:,} limit"
        )
    total = sum(
        len(c["mapping"])
        for c in conversations
        if isinstance(c, dict) and isinstance(c.get("mapping"), dict)
    )
    if total > MAX_MESSAGES:
        raise BadFile(path, f"{total:,} messages is over the {MAX_MESSAGES:,} limit")
    found = list(sessions(path, conversations))
    if not found:
        raise BadFile(path, NO_CONVERSATION)
    return found
