"""Tool calls and tool messages (migration m021_tool_messages).

An assistant message that called tools keeps its text as the model wrote it (the calls in
it); ``tool_calls`` lists the calls read from it. A message of role ``tool`` holds what the
model read of a result (``messages.content``: the result, cut at the result cap);
``tool_messages`` keeps its tool, call id, arguments, flags and the whole result. Both are
deleted with their message (ON DELETE CASCADE).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvchat.store.connection import SqlBase, now
from kvchat.store.messages_sql import append_message
from kvchat.store.rows import Message

TOOL_ROLE = "tool"


@dataclass(frozen=True)
class StoredCall:
    """One call an assistant message made, as the model wrote it."""

    message_id: int
    position: int
    call_id: str
    name: str
    arguments: str  # JSON object

    def to_json(self) -> dict[str, Any]:
        return {"id": self.call_id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class ToolRecord:
    """What a tool message is about: the tool, the call and its whole result."""

    message_id: int
    name: str  # qualified: server.tool
    call_id: str
    arguments: str  # JSON object
    is_error: bool
    truncated: bool
    full_text: str
    seconds: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "call_id": self.call_id,
            "arguments": self.arguments,
            "is_error": self.is_error,
            "truncated": self.truncated,
            "full_text": self.full_text,
            "seconds": self.seconds,
        }


def _record(row: dict[str, Any]) -> ToolRecord:
    seconds = row["seconds"]
    return ToolRecord(
        message_id=int(row["message_id"]),
        name=str(row["name"]),
        call_id=str(row["call_id"]),
        arguments=str(row["arguments"]),
        is_error=bool(row["is_error"]),
        truncated=bool(row["truncated"]),
        full_text=str(row["full_text"]),
        seconds=float(seconds) if isinstance(seconds, int | float) else None,
    )


def insert_imported_tools(
    conn: sqlite3.Connection, tools: Iterable[Sequence[Any]], ids: Sequence[int]
) -> None:
    """An import's tool rows, in its transaction: per (message index, tool or None, calls),
    the tool message's record (tool: name, call id, arguments, is_error, truncated, whole
    text or None for the message's own) and the reply's calls ((call id, name, arguments))."""
    for index, tool, calls in tools:
        message_id = ids[index]
        if tool is not None:
            name, call_id, arguments, is_error, truncated, full_text = tool
            conn.execute(
                "INSERT INTO tool_messages (message_id, name, call_id, arguments, is_error,"
                " truncated, full_text, seconds) VALUES (?, ?, ?, ?, ?, ?,"
                " COALESCE(?, (SELECT content FROM messages WHERE id=?)), NULL)",
                (
                    message_id,
                    name,
                    call_id,
                    arguments,
                    int(is_error),
                    int(truncated),
                    full_text,
                    message_id,
                ),
            )
        conn.executemany(
            "INSERT INTO tool_calls (message_id, position, call_id, name, arguments)"
            " VALUES (?, ?, ?, ?, ?)",
            [(message_id, i, cid, name, args) for i, (cid, name, args) in enumerate(calls)],
        )


def copy_tool_rows(conn: sqlite3.Connection, pairs: Sequence[tuple[int, int]]) -> None:
    """A copied session's tool rows (a fork, an edit): per (new message id, source id),
    the calls the source reply made and the source tool message's record."""
    conn.executemany(
        "INSERT INTO tool_calls (message_id, position, call_id, name, arguments)"
        " SELECT ?, position, call_id, name, arguments FROM tool_calls WHERE message_id = ?",
        pairs,
    )
    conn.executemany(
        "INSERT INTO tool_messages (message_id, name, call_id, arguments, is_error, truncated,"
        " full_text, seconds) SELECT ?, name, call_id, arguments, is_error, truncated, full_text,"
        " seconds FROM tool_messages WHERE message_id = ?",
        pairs,
    )


class ToolsSql(SqlBase):
    """The tool_calls and tool_messages tables."""

    def set_tool_calls(self, message_id: int, calls: list[tuple[str, str, str]]) -> None:
        """Record the calls (call id, name, arguments JSON) assistant message ``message_id``
        made, in order, replacing any recorded before (one transaction)."""
        with self._tx() as conn:
            conn.execute("DELETE FROM tool_calls WHERE message_id=?", (message_id,))
            conn.executemany(
                "INSERT INTO tool_calls (message_id, position, call_id, name, arguments)"
                " VALUES (?, ?, ?, ?, ?)",
                [(message_id, i, cid, name, args) for i, (cid, name, args) in enumerate(calls)],
            )

    def tool_calls(self, message_ids: list[int]) -> dict[int, list[StoredCall]]:
        """The calls each of ``message_ids`` made (absent: none), in order."""
        found: dict[int, list[StoredCall]] = {}
        for start in range(0, len(message_ids), 500):
            part = message_ids[start : start + 500]
            marks = ",".join("?" * len(part))
            rows = self._rows(
                f"SELECT * FROM tool_calls WHERE message_id IN ({marks})"
                " ORDER BY message_id, position",
                tuple(part),
            )
            for row in rows:
                found.setdefault(int(row["message_id"]), []).append(
                    StoredCall(
                        int(row["message_id"]),
                        int(row["position"]),
                        str(row["call_id"]),
                        str(row["name"]),
                        str(row["arguments"]),
                    )
                )
        return found

    def add_tool_message(
        self,
        session_id: str,
        content: str,
        record: ToolRecord,
        *,
        token_count: int = 0,
    ) -> Message:
        """Append a message of role ``tool`` (``content``: what the model reads) and its
        record, in one transaction (durable once this returns; ``record.message_id`` is
        ignored)."""
        stamp = now()
        with self._tx() as conn:
            message_id = append_message(
                self, conn, session_id, TOOL_ROLE, content, stamp, token_count
            )
            conn.execute(
                "INSERT INTO tool_messages (message_id, name, call_id, arguments, is_error,"
                " truncated, full_text, seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    message_id,
                    record.name,
                    record.call_id,
                    record.arguments,
                    int(record.is_error),
                    int(record.truncated),
                    record.full_text,
                    record.seconds,
                ),
            )
        return Message(
            id=message_id,
            session_id=session_id,
            role=TOOL_ROLE,
            content=content,
            created=stamp,
            token_count=token_count,
            partial=False,
        )

    def tool_records(self, message_ids: list[int]) -> dict[int, ToolRecord]:
        """The records of those of ``message_ids`` that are tool messages."""
        found: dict[int, ToolRecord] = {}
        for start in range(0, len(message_ids), 500):
            part = message_ids[start : start + 500]
            marks = ",".join("?" * len(part))
            rows = self._rows(
                f"SELECT * FROM tool_messages WHERE message_id IN ({marks})", tuple(part)
            )
            for row in rows:
                found[int(row["message_id"])] = _record(row)
        return found
