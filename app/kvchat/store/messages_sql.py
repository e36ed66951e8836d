"""The messages table and its full-text index."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvchat.errors import KvchatError
from kvchat.store.connection import SqlBase, _translate, now
from kvchat.store.rows import Message, MessageWindow, SearchHit
from kvchat.store.sessions_sql import (
    TRUE_ID,
    check_counts,
    check_index_counts,
    counts_problem,
)
from kvchat.store.versions_sql import sync_current_version

# A search ranks at most this many matches, the newest (see MessagesSql.search).
RANKED_MATCHES = 5000


def append_message(
    sql: SqlBase,
    conn: sqlite3.Connection,
    session_id: str,
    role: str,
    content: str,
    stamp: str,
    token_count: int = 0,
    partial: bool = False,
    finish_reason: str | None = None,
    reasoning: str = "",
) -> int:
    """Within the caller's transaction: check the session's counts, insert the message,
    move the session's updated time; the new message's id."""
    problem = check_counts(conn, session_id)
    if problem is not None:
        raise sql._found_damage(problem)
    cursor = conn.execute(
        "INSERT INTO messages (session_id, role, content, created, token_count, partial,"
        " finish_reason, reasoning) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (session_id, role, content, stamp, token_count, int(partial), finish_reason, reasoning),
    )
    conn.execute("UPDATE sessions SET updated=? WHERE id=?", (stamp, session_id))
    message_id = cursor.lastrowid
    assert message_id is not None
    return message_id


class MessagesSql(SqlBase):
    """Messages: append, read, update, delete; full-text search."""

    @staticmethod
    def _message(row: dict[str, Any]) -> Message:
        return Message(
            id=row["id"],
            session_id=row["session_id"],
            role=row["role"],
            content=row["content"],
            created=row["created"],
            token_count=row["token_count"] or 0,
            partial=bool(row["partial"]),
            finish_reason=row.get("finish_reason"),
            reasoning=row.get("reasoning") or "",
        )

    def add_message(
        self,
        session_id: str,
        role: str,
        content: str,
        *,
        token_count: int = 0,
        partial: bool = False,
        finish_reason: str | None = None,
        reasoning: str = "",
    ) -> Message:
        """Append a message and commit it (durable once this returns)."""
        stamp = now()
        with self._tx() as conn:
            message_id = append_message(
                self,
                conn,
                session_id,
                role,
                content,
                stamp,
                token_count,
                partial,
                finish_reason,
                reasoning,
            )
        # Built from what was written, not read back: once the commit returned, nothing may
        # fail (a caller that saw an error would write the message again, as a second row).
        return Message(
            id=message_id,
            session_id=session_id,
            role=role,
            content=content,
            created=stamp,
            token_count=token_count or 0,
            partial=bool(partial),
            finish_reason=finish_reason,
            reasoning=reasoning or "",
        )

    @contextmanager
    def waiting_at_most(self, seconds: float) -> Iterator[None]:
        """Writes in the block wait at most ``seconds`` for another connection's write lock
        (not the connection's usual 30 s), and none waits for a big file's background check:
        they raise KvchatError at once instead. For a reply saved as it streams, whose save
        is tried again a moment later: a database held by another process must not hold up
        the reply (the engine thread saves it between tokens)."""
        with self._lock:
            if self._checked is not None and not self._checked.is_set():
                raise KvchatError(
                    f"the database {self.path} is still being checked (a big file's integrity "
                    "check runs in the background); writes wait for its verdict"
                )
            conn = self._open_conn()
            try:
                (before,) = conn.execute("PRAGMA busy_timeout").fetchone()
                conn.execute(f"PRAGMA busy_timeout={max(0, int(seconds * 1000))}")
            except sqlite3.DatabaseError as exc:
                raise _translate(self.path, exc) from None
            try:
                yield
            finally:
                conn.execute(f"PRAGMA busy_timeout={int(before)}")

    def get_message(self, message_id: int) -> Message:
        rows = self._rows("SELECT * FROM messages WHERE id=?", (message_id,))
        if not rows:
            raise KvchatError(f"no message with id {message_id}")
        return self._message(rows[0])

    def messages(self, session_id: str) -> list[Message]:
        """The session's messages in order; raises DamagedDatabase when they do not read as
        its row records them (a damaged index hides some: never a shortened history)."""
        rows = self._rows(
            "SELECT m.*, s.n_messages AS _n, s.last_message_id AS _last, s.n_tokens AS _tokens,"
            f" {TRUE_ID} AS _true_id"
            " FROM sessions s LEFT JOIN messages m ON m.session_id = s.id"
            " WHERE s.id=? ORDER BY m.id",
            (session_id,),
        )
        if not rows:
            self._missing_by_index(session_id)  # a session its id index hides is damage
            return []
        if rows[0]["_true_id"] != session_id:  # the id index led to another session's row
            raise self._found_damage(
                f"session {session_id}: its index leads to another session's row"
            )
        found = [r for r in rows if r["id"] is not None]
        recorded = (rows[0]["_n"], rows[0]["_last"], rows[0]["_tokens"])
        read = (
            len(found),
            max((r["id"] for r in found), default=0),
            sum(r["token_count"] or 0 for r in found),
        )
        problem = counts_problem(recorded, read, session_id)
        if problem is not None:
            raise self._found_damage(problem)
        return [self._message(r) for r in found]

    def messages_page(
        self, session_id: str, limit: int, *, before: int | None = None
    ) -> list[Message]:
        """Up to ``limit`` of the session's messages just before message id ``before`` (the
        last ones when None), in order: one range read of the (session, id) index, so a
        5,000-message session opens at its end and pages back. Raises DamagedDatabase when
        that index does not count the session's messages as its row records them."""
        with self._reading() as conn:
            self._check_index(conn, session_id)
            return self._before(session_id, limit, before)

    def message_window(
        self,
        session_id: str,
        limit: int,
        *,
        around: int | None = None,
        before_hit: int = 0,
        from_start: bool = False,
    ) -> MessageWindow:
        """Up to ``limit`` of the session's messages and where they sit, in one read
        transaction on the (session, id) index, never the whole session: the last ones; or
        (``from_start``) the first ones; or ``before_hit`` before the message id ``around``,
        that message and those after it (the last ones when it is not the session's).
        Raises KvchatError for no such session, DamagedDatabase when the index does not
        count the session's messages as its row records them."""
        limit = max(0, limit)
        with self._reading() as conn:
            self._check_index(conn, session_id)
            row = conn.execute(
                "SELECT updated, n_messages FROM sessions WHERE id=?", (session_id,)
            ).fetchone()
            if row is None:
                raise KvchatError(f"no session with id {session_id}")
            updated, total = str(row[0]), int(row[1])
            number = 0
            if around is not None:
                (number,) = conn.execute(
                    "SELECT CASE WHEN EXISTS (SELECT 1 FROM messages WHERE id=? AND"
                    " session_id=?) THEN (SELECT COUNT(*) FROM messages WHERE session_id=?"
                    " AND id<=?) ELSE 0 END",
                    (around, session_id, session_id, around),
                ).fetchone()
            if number and around is not None:
                earlier = self._before(session_id, min(before_hit, limit - 1), around)
                rows = self._rows(
                    "SELECT * FROM messages WHERE session_id=? AND id>=? ORDER BY id LIMIT ?",
                    (session_id, around, limit - len(earlier)),
                )
                messages = earlier + [self._message(r) for r in rows]
                first = int(number) - 1 - len(earlier)
            elif from_start:
                rows = self._rows(
                    "SELECT * FROM messages WHERE session_id=? ORDER BY id LIMIT ?",
                    (session_id, limit),
                )
                messages, first = [self._message(r) for r in rows], 0
            else:
                messages = self._before(session_id, limit, None)
                first = total - len(messages)
        return MessageWindow(messages, first, total, updated)

    def _before(self, session_id: str, limit: int, before: int | None) -> list[Message]:
        """Up to ``limit`` of the session's messages before id ``before`` (the last ones when
        None), in order."""
        rows = self._rows(
            "SELECT * FROM messages WHERE session_id=? AND id<? ORDER BY id DESC LIMIT ?",
            (session_id, before if before is not None else 2**62, max(0, limit)),
        )
        return [self._message(r) for r in reversed(rows)]

    def _check_index(self, conn: sqlite3.Connection, session_id: str) -> None:
        problem = check_index_counts(conn, session_id)
        if problem is not None:
            raise self._found_damage(problem)

    def delete_message(self, message_id: int) -> None:
        with self._tx() as conn:
            conn.execute("DELETE FROM messages WHERE id=?", (message_id,))

    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Full-text search over every message, best match first.

        A word in many messages would have every one of them ranked (bm25 over 500,000
        messages takes ~0.5 s): past :data:`RANKED_MATCHES` matches, only the newest that
        many (by message id, read backwards from the index: no ranking) are ranked."""
        terms = " ".join('"' + word.replace('"', '""') + '"' for word in query.split())
        if not terms:
            return []
        bound = self._rows(
            "SELECT rowid FROM messages_fts WHERE messages_fts MATCH ?"
            " ORDER BY rowid DESC LIMIT 1 OFFSET ?",
            (terms, RANKED_MATCHES - 1),
        )
        since = bound[0]["rowid"] if bound else 0
        rows = self._rows(
            """
            SELECT m.*, s.title AS session_title,
                   snippet(messages_fts, 0, char(2), char(3), '…', 12) AS snippet
            FROM messages_fts
            JOIN messages m ON m.id = messages_fts.rowid
            JOIN sessions s ON s.id = m.session_id
            WHERE messages_fts MATCH ? AND messages_fts.rowid >= ?
            ORDER BY rank LIMIT ?
            """,
            (terms, since, limit),
        )
        return [
            SearchHit(
                message=self._message(r), session_title=r["session_title"], snippet=r["snippet"]
            )
            for r in rows
        ]

    def update_message(
        self,
        message_id: int,
        content: str,
        partial: bool,
        *,
        token_count: int | None = None,
        finish_reason: str | None = None,
        reasoning: str | None = None,
    ) -> Message:
        """Replace a message's text and partial mark (a reply saved as it streams, then
        finished or continued), committed; the search index follows by its triggers.
        ``token_count``, ``finish_reason`` and ``reasoning`` change only when given."""
        stamp = now()
        with self._tx() as conn:
            owner = conn.execute(
                "SELECT session_id FROM messages WHERE id=?", (message_id,)
            ).fetchone()
            problem = check_counts(conn, owner[0]) if owner is not None else None
            if problem is not None:
                raise self._found_damage(problem)
            cursor = conn.execute(
                "UPDATE messages SET content=?, partial=?, token_count=COALESCE(?, token_count),"
                " finish_reason=COALESCE(?, finish_reason), reasoning=COALESCE(?, reasoning)"
                " WHERE id=?",
                (content, int(partial), token_count, finish_reason, reasoning, message_id),
            )
            if cursor.rowcount == 0:
                raise KvchatError(f"no message with id {message_id}")
            sync_current_version(conn, message_id)
            conn.execute(
                "UPDATE sessions SET updated=? WHERE id=(SELECT session_id FROM messages"
                " WHERE id=?)",
                (stamp, message_id),
            )
        return self.get_message(message_id)
