"""The session list at any size: pages on the ``updated`` index (keyset pagination), a title
filter on a trigram index, a count, and what changed since a stamp (see migration m014)."""

from __future__ import annotations

from typing import Any

from kvchat.store.connection import SqlBase
from kvchat.store.rows import SessionChanges, SessionPage, SessionSummary
from kvchat.store.sessions_sql import LISTED, SessionsSql

# The list's columns: the session row and what its cold snapshot holds (0 when none, or
# when the row is not sane).
_SUMMARY_COLUMNS = """
    s.*, s.rowid AS _rowid,
    CASE WHEN typeof(k.n_bytes) = 'integer' AND k.n_bytes >= 0
         THEN k.n_bytes ELSE 0 END AS snapshot_bytes,
    CASE WHEN typeof(k.n_tokens) = 'integer' AND k.n_tokens >= 0
         THEN k.n_tokens ELSE 0 END AS snapshot_tokens
"""
# Shorter filters than this (the trigram index's unit) are matched by reading titles in
# list order, which stops at the page's end.
TRIGRAM = 3


def _like_pattern(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _phrase(text: str) -> str:
    """``text`` as one FTS5 phrase: its letters in this order, anywhere in a title."""
    return '"' + text.replace('"', '""') + '"'


class SessionListSql(SqlBase):
    """Pages of sessions, newest first; a title filter; a count; changes since a stamp."""

    def _summaries(self, rows: list[dict[str, Any]]) -> list[SessionSummary]:
        return [
            SessionSummary(
                session=SessionsSql._session(r),
                messages=r["n_messages"],
                tokens=r["n_tokens"],
                snapshot_bytes=r["snapshot_bytes"],
                snapshot_tokens=r["snapshot_tokens"],
            )
            for r in rows
        ]

    @staticmethod
    def _pin_tag_filter(pinned: bool, tag: str | None) -> tuple[str, list[Any]]:
        """The WHERE part (and its parameters) keeping pinned sessions (when ``pinned``)
        and those tagged ``tag`` (a parsed tag, when given)."""
        where, params = "", []
        if pinned:
            where += " AND s.pinned = 1"
        if tag:
            where += " AND (' ' || s.tags || ' ') LIKE ? ESCAPE '\\'"
            params.append(f"% {_like_pattern(tag).strip('%')} %")
        return where, params

    @staticmethod
    def _title_filter(title: str | None) -> tuple[str, list[Any]]:
        """The WHERE part (and its parameters) that keeps titles containing ``title``,
        case-insensitively; nothing for an empty filter."""
        text = " ".join((title or "").split())
        if not text:
            return "", []
        if len(text) >= TRIGRAM:
            return (
                " AND s.rowid IN (SELECT rowid FROM sessions_title_fts"
                " WHERE sessions_title_fts MATCH ?)",
                [_phrase(text)],
            )
        return " AND s.title LIKE ? ESCAPE '\\'", [_like_pattern(text)]

    def list_sessions_page(
        self,
        limit: int,
        after: tuple[str, int] | None = None,
        *,
        title: str | None = None,
        pinned: bool = False,
        tag: str | None = None,
    ) -> SessionPage:
        """Up to ``limit`` sessions, most recently updated first, starting after the cursor
        ``after`` (a previous page's ``next``); only titles containing ``title`` when given,
        only pinned ones with ``pinned``, only those tagged ``tag`` when given. One range
        read of the ``updated`` index: the cost is the page's, not the list's."""
        where, params = self._title_filter(title)
        more_where, more_params = self._pin_tag_filter(pinned, tag)
        where, params = where + more_where, params + more_params
        if after is not None:
            where += " AND (s.updated, s.rowid) < (?, ?)"
            params += [after[0], after[1]]
        rows = self._rows(
            f"SELECT {_SUMMARY_COLUMNS} FROM sessions s INDEXED BY sessions_by_updated"
            " LEFT JOIN kv_snapshots k ON k.session_id = s.id"
            f" WHERE {LISTED}{where} ORDER BY s.updated DESC, s.rowid DESC LIMIT ?",
            (*params, max(0, limit) + 1),
        )
        more = len(rows) > limit
        rows = rows[:limit]
        cursor = (rows[-1]["updated"], rows[-1]["_rowid"]) if more and rows else None
        return SessionPage(self._summaries(rows), cursor)

    def count_sessions(
        self, *, title: str | None = None, pinned: bool = False, tag: str | None = None
    ) -> int:
        """How many sessions there are (whose title contains ``title``, when given; pinned,
        with ``pinned``; tagged ``tag``, when given)."""
        where, params = self._title_filter(title)
        more_where, more_params = self._pin_tag_filter(pinned, tag)
        where, params = where + more_where, params + more_params
        rows = self._rows(
            f"SELECT COUNT(*) AS n FROM sessions s WHERE {LISTED}{where}", tuple(params)
        )
        return int(rows[0]["n"])

    def change_stamp(self) -> int:
        """The session list's change stamp now: it moves whenever any process makes,
        changes or deletes a session (one row read)."""
        rows = self._rows("SELECT n FROM change_clock WHERE id = 1")
        return int(rows[0]["n"]) if rows else 0

    def sessions_changed_since(self, stamp: int) -> SessionChanges:
        """Sessions made or changed after ``stamp`` (oldest change first) and the ids
        deleted after it, with the stamp to pass next time: indexed reads of what changed,
        never the whole list. Read in one transaction, so nothing falls between two looks."""
        with self._reading():
            now = self.change_stamp()
            rows = self._rows(
                f"SELECT {_SUMMARY_COLUMNS} FROM sessions s INDEXED BY sessions_by_changed"
                " LEFT JOIN kv_snapshots k ON k.session_id = s.id"
                f" WHERE s.changed > ? AND s.changed <= ? AND {LISTED} ORDER BY s.changed",
                (stamp, now),
            )
            deleted = self._rows(
                "SELECT id FROM sessions_deleted WHERE changed > ? AND changed <= ?"
                " ORDER BY changed",
                (stamp, now),
            )
        return SessionChanges(now, self._summaries(rows), [r["id"] for r in deleted])

    def message_count(self, session_id: str) -> int:
        """How many messages the session's row records (0 when there is no such session):
        one row, where ``len(messages(...))`` reads them all."""
        rows = self._rows("SELECT n_messages FROM sessions WHERE id=?", (session_id,))
        return int(rows[0]["n_messages"]) if rows else 0
