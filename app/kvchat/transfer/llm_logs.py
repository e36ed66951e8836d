"""simonw/llm's ``logs.db``, opened read-only: one session per conversation.

Two generations of tables, both read:

* ``conversations`` + ``responses`` (what llm wrote before 0.36, and still reads): each
  response is a prompt and its reply; the first ``system`` is the system prompt; a
  conversation's responses in ``datetime_utc``, then ``id``, order.
* ``threads`` + ``messages`` + ``parts`` (llm 0.36's content-addressed store): a thread's
  history is the chain from its ``tip_message_hash`` up the ``parent_hash`` links; text
  parts are kept (text borrowed from ``fragments`` resolved), a reply's tool calls with it
  and each tool result as a tool message; reasoning and attachments are left out and
  counted.

A thread made from a conversation keeps its id, so a conversation that is also a thread
is read once, from the thread.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from kvchat.transfer.common import (
    MAX_MESSAGES,
    MAX_SESSIONS,
    MAX_TEXT_CHARS,
    BadFile,
    ImportedCall,
    ImportedMessage,
    ImportedSession,
    ImportedTool,
    check_text,
    default_title,
    imported_call,
    iso_time,
    parse_json,
)

NAME = "llm logs.db"
MAGIC = b"SQLite format 3\x00"


@contextmanager
def _open(path: Path) -> Iterator[sqlite3.Connection]:
    uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error as exc:
        raise BadFile(path, f"cannot open the database read-only ({exc})") from None
    with closing(conn):
        # Nothing stored in the file runs as code here: no triggers or views are trusted.
        conn.execute("PRAGMA query_only=ON")
        conn.execute("PRAGMA trusted_schema=OFF")
        yield conn


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info([{table}])")}


def _text(path: Path, value: object, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        raise BadFile(path, f"{where} is binary, not text")
    return check_text(path, value, where) or ""


def _limited(conn: sqlite3.Connection, path: Path, sql: str, what: str) -> None:
    """Refuse a table whose rows or longest text are over the limits, before reading rows."""
    rows, longest = conn.execute(sql).fetchone()
    if rows > MAX_MESSAGES:
        raise BadFile(path, f"{rows:,} {what} is over the {MAX_MESSAGES:,}-message limit")
    if (longest or 0) > MAX_TEXT_CHARS:
        raise BadFile(path, f"a text in {what} is over {MAX_TEXT_CHARS:,} characters")


def _legacy(conn: sqlite3.Connection, path: Path, skip: set[str]) -> list[ImportedSession]:
    """Sessions from ``conversations`` + ``responses`` (conversations in ``skip`` excepted)."""
    columns = _columns(conn, "responses")
    needed = {"id", "prompt", "response", "conversation_id", "datetime_utc"}
    if not needed <= columns:
        missing = ", ".join(sorted(needed - columns))
        raise BadFile(path, f"the responses table has no {missing} column")
    _limited(
        conn,
        path,
        "SELECT count(*), max(max(coalesce(length(prompt), 0), coalesce(length(response), 0),"
        " coalesce(length(system), 0))) FROM responses",
        "responses",
    )
    names: dict[str, str] = {}
    if "conversations" in _tables(conn) and {"id", "name"} <= _columns(conn, "conversations"):
        for conv_id, name in conn.execute("SELECT id, name FROM conversations"):
            if isinstance(conv_id, str) and isinstance(name, str):
                names[conv_id] = name
    rows = conn.execute(
        "SELECT id, conversation_id, prompt, system, response, datetime_utc FROM responses"
        " ORDER BY datetime_utc, id"
    )
    grouped: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        conv_id = row[1] if isinstance(row[1], str) and row[1] else f"response:{row[0]}"
        if conv_id not in skip:
            grouped.setdefault(conv_id, []).append(row)
    sessions = []
    for conv_id, responses in grouped.items():
        system: str | None = None
        messages: list[ImportedMessage] = []
        for response_id, _, prompt, system_text, reply, when in responses:
            where = f"response {response_id!s:.40}"
            created = iso_time(when)
            system = system or _text(path, system_text, f"{where} system") or None
            prompt_text = _text(path, prompt, f"{where} prompt")
            reply_text = _text(path, reply, f"{where} response")
            if prompt_text:
                messages.append(ImportedMessage("user", prompt_text, created=created))
            if reply_text:
                messages.append(ImportedMessage("assistant", reply_text, created=created))
        if not messages:
            continue
        name = names.get(conv_id)
        sessions.append(
            ImportedSession(
                title=_text(path, name, "a conversation name") if name else default_title(messages),
                system_prompt=system,
                settings={},
                messages=messages,
                source_key=f"llm:{conv_id}",
                created=iso_time(responses[0][5]),
                updated=iso_time(responses[-1][5]),
            )
        )
    return sessions


_CHAIN_SQL = """
WITH RECURSIVE chain(hash, parent_hash, role, depth) AS (
    SELECT hash, parent_hash, role, 0 FROM messages WHERE hash = ?
    UNION ALL
    SELECT m.hash, m.parent_hash, m.role, c.depth + 1
    FROM messages m JOIN chain c ON m.hash = c.parent_hash
    WHERE c.depth < ?
)
SELECT hash, role FROM chain ORDER BY depth DESC
"""


def _part_text(
    conn: sqlite3.Connection, path: Path, text: object, payload: object, where: str
) -> str:
    """A text part's text: the ``text`` column, or its ``text_ref`` pieces resolved."""
    if text is not None:
        return _text(path, text, where)
    data = parse_json(path, payload, f"{where}'s payload") if isinstance(payload, str) else None
    pieces = data.get("text_ref") if isinstance(data, dict) else None
    if not isinstance(pieces, list):
        return ""
    out: list[str] = []
    for piece in pieces:
        if isinstance(piece, dict) and isinstance(piece.get("literal"), str):
            out.append(piece["literal"])
        elif isinstance(piece, dict) and isinstance(piece.get("fragment"), int):
            found = conn.execute(
                "SELECT content FROM fragments WHERE id = ? AND length(content) <= ?",
                (piece["fragment"], MAX_TEXT_CHARS),
            ).fetchone()
            out.append(_text(path, found[0] if found else None, f"{where} fragment"))
    return _text(path, "".join(out), where)


def _tool_call(path: Path, payload: str, where: str) -> ImportedCall:
    """A ``tool_call`` part: ``{"name", "arguments", "tool_call_id"}``."""
    data = parse_json(path, payload, f"{where}'s payload")
    if not isinstance(data, dict):
        raise BadFile(path, f"{where}'s payload is not an object")
    return imported_call(
        path, data.get("name"), data.get("tool_call_id"), data.get("arguments"), where
    )


def _tool_result(
    path: Path, payload: str, called: dict[str, ImportedCall], where: str
) -> ImportedMessage:
    """A ``tool_result`` part (``{"name", "output", "tool_call_id", "exception"?}``) as a
    tool message, with the arguments of the call it answers where the thread has it."""
    data = parse_json(path, payload, f"{where}'s payload")
    if not isinstance(data, dict):
        raise BadFile(path, f"{where}'s payload is not an object")
    call_id, name, _ = imported_call(path, data.get("name"), data.get("tool_call_id"), {}, where)
    arguments = called[call_id][2] if call_id in called else "{}"
    output = _text(path, data.get("output"), f"{where} output")
    failed = data.get("exception")
    if isinstance(failed, str) and failed:
        output = output or _text(path, failed, f"{where} exception")
    tool = ImportedTool(name, call_id, arguments, is_error=bool(failed))
    return ImportedMessage("tool", output, tool=tool)


def _threads(conn: sqlite3.Connection, path: Path) -> list[ImportedSession]:
    """Sessions from ``threads`` + ``messages`` + ``parts`` (llm 0.36 and later)."""
    _limited(
        conn,
        path,
        "SELECT count(*), max(CASE WHEN type = 'text' THEN max(coalesce(length(text), 0),"
        " coalesce(length(payload), 0)) END) FROM parts",
        "message parts",
    )
    has_turns = "turns" in _tables(conn)
    sessions = []
    threads = conn.execute(
        "SELECT id, name, tip_message_hash, datetime_utc FROM threads"
        " WHERE tip_message_hash IS NOT NULL ORDER BY datetime_utc, id"
    ).fetchall()
    total = 0
    for thread_id, name, tip, when in threads:
        where = f"thread {thread_id!s:.40}"
        chain = conn.execute(_CHAIN_SQL, (tip, MAX_MESSAGES - total)).fetchall()
        total += len(chain)
        if total > MAX_MESSAGES:
            raise BadFile(path, f"the threads hold over {MAX_MESSAGES:,} messages")
        if len({message_hash for message_hash, _ in chain}) != len(chain):
            raise BadFile(path, f"{where}: the message chain forms a cycle")
        system: str | None = None
        messages: list[ImportedMessage] = []
        skipped = 0
        called: dict[str, ImportedCall] = {}  # the thread's calls, by id, for their results
        for message_hash, role in chain:
            parts = conn.execute(
                "SELECT type, text, CASE WHEN type IN ('text', 'tool_call', 'tool_result')"
                " AND length(payload) <= ? THEN payload END FROM parts"
                " WHERE message_hash = ? ORDER BY position",
                (MAX_TEXT_CHARS, message_hash),
            ).fetchall()
            texts = []
            calls: list[ImportedCall] = []
            results: list[ImportedMessage] = []
            for kind, text, payload in parts:
                if kind == "text":
                    texts.append(_part_text(conn, path, text, payload, f"{where} message text"))
                elif kind == "tool_call" and isinstance(payload, str):
                    calls.append(_tool_call(path, payload, f"{where} tool call"))
                    called[calls[-1][0]] = calls[-1]
                elif kind == "tool_result" and isinstance(payload, str):
                    results.append(_tool_result(path, payload, called, f"{where} tool result"))
                else:
                    skipped += kind != "reasoning"
            messages += results
            content = "\n".join(t for t in texts if t)
            if role == "tool" or not (content.strip() or calls):
                skipped += role == "tool" and not results
                continue
            if role == "assistant" and calls:
                messages.append(ImportedMessage(role, content, calls=tuple(calls)))
                continue
            if role == "system":
                if not messages and system is None:
                    system = content
                else:
                    skipped += 1
            elif role in ("user", "assistant"):
                messages.append(ImportedMessage(role, content))
            else:
                raise BadFile(path, f"{where}: a message has an unknown role {role!r}")
        if not messages:
            continue
        updated = None
        if has_turns:
            (last,) = conn.execute(
                "SELECT max(datetime_utc) FROM turns WHERE thread_id = ?", (thread_id,)
            ).fetchone()
            updated = iso_time(last)
        created = iso_time(when)
        sessions.append(
            ImportedSession(
                title=_text(path, name, f"{where} name") if name else default_title(messages),
                system_prompt=system,
                settings={},
                messages=[m._replace(created=created) for m in messages],
                source_key=f"llm:{thread_id}",
                created=created,
                updated=updated or created,
                skipped=skipped,
            )
        )
    return sessions


def read(path: Path) -> list[ImportedSession]:
    try:
        with _open(path) as conn:
            tables = _tables(conn)
            sessions: list[ImportedSession] = []
            threads: set[str] = set()
            if {"threads", "messages", "parts"} <= tables:
                sessions += _threads(conn, path)
                threads = {row[0] for row in conn.execute("SELECT id FROM threads")}
            if "responses" in tables:
                sessions += _legacy(conn, path, threads)
            if not {"responses", "threads"} & tables:
                raise BadFile(path, "an SQLite database, but not an llm logs.db")
    except sqlite3.Error as exc:
        raise BadFile(path, f"the database cannot be read ({exc})") from None
    if len(sessions) > MAX_SESSIONS:
        raise BadFile(path, f"{len(sessions):,} conversations is over the {MAX_SESSIONS:,} limit")
    if not sessions:
        raise BadFile(path, "the logs hold no conversation to import")
    return sessions
