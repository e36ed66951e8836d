"""Reply versions: a regenerated reply keeps the earlier ones (issue 11 item 10).

The ``messages`` row always holds the current version (so everything that reads messages,
the search index included, sees the conversation as it reads now); ``reply_versions``
holds every version of a reply that has more than one, numbered from 1, and
``messages.version`` says which one is current (NULL: the reply has one version).
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

from kvchat.errors import KvchatError
from kvchat.store.connection import SqlBase, now
from kvchat.store.rows import Message


class VersionsSql(SqlBase):
    """Add a version to a reply, count them, make another one current."""

    if TYPE_CHECKING:

        def get_message(self, message_id: int) -> Message: ...  # (MessagesSql)

    def add_version(
        self,
        message_id: int,
        content: str,
        *,
        token_count: int = 0,
        partial: bool = False,
        finish_reason: str | None = None,
        reasoning: str = "",
    ) -> Message:
        """Make ``content`` the reply's new current version, keeping the earlier ones, in one
        transaction (a kill leaves the old reply current, or the new one: never neither)."""
        stamp = now()
        with self._tx() as conn:
            count = _ensure_versions(conn, message_id)
            conn.execute(
                "INSERT INTO reply_versions (message_id, n, content, token_count, partial, created,"
                " finish_reason, reasoning) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    message_id,
                    count + 1,
                    content,
                    token_count,
                    int(partial),
                    stamp,
                    finish_reason,
                    reasoning,
                ),
            )
            _make_current(conn, message_id, count + 1, stamp)
        return self.get_message(message_id)

    def version_of(self, message_id: int) -> tuple[int, int]:
        """(the current version's 1-based position, how many versions) of a message.

        A read: it does not wait for the integrity check that gates writes (the app's first
        paint reads it for the open session's last reply while a big file's check runs)."""
        with self._reading() as conn:
            row = conn.execute("SELECT version FROM messages WHERE id=?", (message_id,)).fetchone()
            if row is None:
                raise KvchatError(f"no message with id {message_id}")
            (count,) = conn.execute(
                "SELECT COUNT(*) FROM reply_versions WHERE message_id=?", (message_id,)
            ).fetchone()
        if not count or row[0] is None:
            return 1, 1
        return int(row[0]), int(count)

    def versions_in(self, session_id: str) -> dict[int, tuple[int, int]]:
        """{message id: (current position, count)} for the session's replies that have more
        than one version, in one query (a UI marks them all when it draws a session)."""
        rows = self._rows(
            "SELECT m.id, m.version, COUNT(v.n) AS count FROM messages m"
            " JOIN reply_versions v ON v.message_id = m.id"
            " WHERE m.session_id=? AND m.version IS NOT NULL GROUP BY m.id",
            (session_id,),
        )
        return {r["id"]: (r["version"], r["count"]) for r in rows if r["count"] > 1}

    def switch_version(self, message_id: int, step: int) -> Message | None:
        """Make the version ``step`` away (-1: previous, +1: next) current; None when there
        is none there (either end, or a reply with one version)."""
        with self._tx() as conn:
            row = conn.execute("SELECT version FROM messages WHERE id=?", (message_id,)).fetchone()
            if row is None:
                raise KvchatError(f"no message with id {message_id}")
            if row[0] is None:
                return None
            target = int(row[0]) + step
            found = conn.execute(
                "SELECT 1 FROM reply_versions WHERE message_id=? AND n=?", (message_id, target)
            ).fetchone()
            if step == 0 or found is None:
                return None
            _make_current(conn, message_id, target, now())
        return self.get_message(message_id)


def _ensure_versions(conn: sqlite3.Connection, message_id: int) -> int:
    """Record the reply's text as version 1 if it has no versions yet; returns the count."""
    (count,) = conn.execute(
        "SELECT COUNT(*) FROM reply_versions WHERE message_id=?", (message_id,)
    ).fetchone()
    if count:
        return int(count)
    cursor = conn.execute(
        "INSERT INTO reply_versions (message_id, n, content, token_count, partial, created,"
        " finish_reason, reasoning) SELECT id, 1, content, token_count, partial, created,"
        " finish_reason, reasoning FROM messages WHERE id=?",
        (message_id,),
    )
    if cursor.rowcount == 0:
        raise KvchatError(f"no message with id {message_id}")
    return 1


def _make_current(conn: sqlite3.Connection, message_id: int, n: int, stamp: str) -> None:
    """Copy version ``n`` into the message row (the search index follows by its triggers)."""
    conn.execute(
        "UPDATE messages SET version=?, content=v.content, token_count=v.token_count,"
        " partial=v.partial, finish_reason=v.finish_reason, reasoning=v.reasoning FROM"
        " (SELECT content, token_count, partial, finish_reason, reasoning FROM reply_versions"
        " WHERE message_id=? AND n=?) AS v"
        " WHERE messages.id=?",
        (n, message_id, n, message_id),
    )
    conn.execute(
        "UPDATE sessions SET updated=? WHERE id=(SELECT session_id FROM messages WHERE id=?)",
        (stamp, message_id),
    )


def sync_current_version(conn: sqlite3.Connection, message_id: int) -> None:
    """After a message row's text changed (a continued reply): its current version too."""
    conn.execute(
        "UPDATE reply_versions SET content=m.content, token_count=m.token_count,"
        " partial=m.partial, finish_reason=m.finish_reason, reasoning=m.reasoning FROM"
        " (SELECT content, token_count, partial, finish_reason, reasoning, version FROM messages"
        " WHERE id=?) AS m"
        " WHERE message_id=? AND n=m.version",
        (message_id, message_id),
    )
