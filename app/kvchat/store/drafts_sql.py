"""What is typed in a session's input and not sent yet (migration m020_drafts).

One row per session with a draft; an empty draft is no row. Deleted with its session
(ON DELETE CASCADE).
"""

from __future__ import annotations

from kvchat.store.connection import SqlBase, now


class DraftsSql(SqlBase):
    """The drafts table."""

    def draft(self, session_id: str) -> str:
        """The unsent text of ``session_id``'s input ("" when none)."""
        rows = self._rows("SELECT text FROM drafts WHERE session_id=?", (session_id,))
        return str(rows[0]["text"]) if rows else ""

    def set_drafts(self, drafts: dict[str, str]) -> None:
        """Keep each session's draft (an empty one removes it), in one transaction; a
        session that is gone (deleted by another process) is skipped."""
        with self._tx() as conn:
            for session_id, text in drafts.items():
                if not text:
                    conn.execute("DELETE FROM drafts WHERE session_id=?", (session_id,))
                    continue
                conn.execute(
                    "INSERT INTO drafts (session_id, text, updated) SELECT id, ?, ? FROM sessions"
                    " WHERE id=? ON CONFLICT(session_id) DO UPDATE SET text=excluded.text,"
                    " updated=excluded.updated",
                    (text, now(), session_id),
                )
