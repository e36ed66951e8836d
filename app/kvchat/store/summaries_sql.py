"""Compaction summaries (migration m022_compaction).

A summary stands for a session's messages up to ``upto_message_id``: the model reads it
instead of them, while the messages themselves stay (searchable, exported). A session's
newest summary is the one its prompts use; the earlier ones are kept as history. Deleted
with their session (ON DELETE CASCADE).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvchat.errors import KvchatError
from kvchat.store.connection import SqlBase, now


@dataclass(frozen=True)
class Summary:
    """One compaction of a session: what the model reads in place of its older messages."""

    id: int
    session_id: str
    upto_message_id: int  # the last message it stands for
    text: str
    replaced_tokens: int  # the tokens of the messages it stands for, when it was made
    created: str

    def to_json(self) -> dict[str, Any]:
        return {
            "upto_message_id": self.upto_message_id,
            "text": self.text,
            "replaced_tokens": self.replaced_tokens,
            "created": self.created,
        }


def _summary(row: dict[str, Any]) -> Summary:
    return Summary(
        id=int(row["id"]),
        session_id=str(row["session_id"]),
        upto_message_id=int(row["upto_message_id"]),
        text=str(row["text"]),
        replaced_tokens=int(row["replaced_tokens"]),
        created=str(row["created"]),
    )


class SummariesSql(SqlBase):
    """The summaries table."""

    def summaries(self, session_id: str) -> list[Summary]:
        """Every summary of ``session_id``, oldest first."""
        rows = self._rows("SELECT * FROM summaries WHERE session_id=? ORDER BY id", (session_id,))
        return [_summary(row) for row in rows]

    def current_summary(self, session_id: str) -> Summary | None:
        """The summary the session's prompts use now (its newest), or None."""
        rows = self._rows(
            "SELECT * FROM summaries WHERE session_id=? ORDER BY id DESC LIMIT 1", (session_id,)
        )
        return _summary(rows[0]) if rows else None

    def copy_summaries(self, source_id: str, target_id: str, added: int = 0) -> int:
        """Give a branch (``target_id``: copies of ``source_id``'s first messages, in order,
        then ``added`` messages of its own) the source's summaries that stand for messages
        it copied; returns how many. One transaction; a source without summaries costs one
        indexed read."""
        if not self._rows("SELECT 1 FROM summaries WHERE session_id=? LIMIT 1", (source_id,)):
            return 0
        with self._tx() as conn:

            def ids(session_id: str) -> list[int]:
                rows = conn.execute(
                    "SELECT id FROM messages WHERE session_id=? ORDER BY id", (session_id,)
                )
                return [row[0] for row in rows]

            source, target = ids(source_id), ids(target_id)
            copied = max(0, len(target) - added)
            place = {message_id: n for n, message_id in enumerate(source[:copied])}
            rows = conn.execute(
                "SELECT upto_message_id, text, replaced_tokens, created FROM summaries"
                " WHERE session_id=? ORDER BY id",
                (source_id,),
            ).fetchall()
            kept = [
                (target_id, target[place[upto]], text, tokens, created)
                for upto, text, tokens, created in rows
                if upto in place
            ]
            conn.executemany(
                "INSERT INTO summaries (session_id, upto_message_id, text, replaced_tokens,"
                " created) VALUES (?, ?, ?, ?, ?)",
                kept,
            )
        return len(kept)

    def add_summary(
        self, session_id: str, upto_message_id: int, text: str, replaced_tokens: int
    ) -> Summary:
        """Store a summary whole, in one transaction: ``upto_message_id`` must be one of the
        session's messages."""
        with self._tx() as conn:
            found = conn.execute(
                "SELECT 1 FROM messages WHERE id=? AND session_id=?",
                (upto_message_id, session_id),
            ).fetchone()
            if found is None:
                raise KvchatError(f"session {session_id} has no message {upto_message_id}")
            cursor = conn.execute(
                "INSERT INTO summaries (session_id, upto_message_id, text, replaced_tokens,"
                " created) VALUES (?, ?, ?, ?, ?)",
                (session_id, upto_message_id, text, replaced_tokens, now()),
            )
            row_id = cursor.lastrowid
        rows = self._rows("SELECT * FROM summaries WHERE id=?", (row_id,))
        return _summary(rows[0])


def insert_imported_summaries(
    conn: sqlite3.Connection,
    session_id: str,
    summaries: Sequence[tuple[int, str, int]],
    message_ids: Sequence[int],
    stamp: str,
) -> None:
    """An import's summaries (message index, text, replaced tokens), in its transaction: each
    stands for the messages up to the one its index names (checked by the reader)."""
    conn.executemany(
        "INSERT INTO summaries (session_id, upto_message_id, text, replaced_tokens, created)"
        " VALUES (?, ?, ?, ?, ?)",
        [
            (session_id, message_ids[index], text, tokens, stamp)
            for index, text, tokens in summaries
        ],
    )
