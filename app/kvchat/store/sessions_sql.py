"""The sessions table and the meta key/value table."""

from __future__ import annotations

import json
import secrets
import sqlite3
from typing import Any

from kvchat.errors import KvchatError
from kvchat.store.connection import SqlBase, _translate, now
from kvchat.store.documents_sql import copy_session_documents
from kvchat.store.rows import Session, SessionSummary
from kvchat.store.tags import column_text, stored_tags


def insert_session(
    conn: sqlite3.Connection,
    title: str,
    system_prompt: str | None,
    settings: dict[str, Any] | None,
    stamp: str | None = None,
    parent_id: str | None = None,
) -> str:
    """Insert a new session row (in the caller's transaction); returns its fresh id."""
    stamp = stamp or now()
    session_id = new_session_id(conn)
    conn.execute(
        "INSERT INTO sessions (id, title, system_prompt, settings, created, updated, parent_id)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (session_id, title, system_prompt, json.dumps(settings or {}), stamp, stamp, parent_id),
    )
    return session_id


# The sessions a list shows: conversations. A reading of documents that conversations share
# (kvchat.service.documents) is a session row too, so its KV has an owner, but with a
# 24-digit id: never listed, counted, found by title or shown in the app.
LISTED = "length(s.id) = 8"


# What the session row records about its messages, and what its messages read now: one
# statement, so both come from the same moment.
# A session row's own id, read from the table by rowid: a damaged id index can hand back
# another session's row for an id (its entries out of order), and may answer ``s.id`` from
# its own damaged key.
TRUE_ID = "(SELECT x.id FROM sessions x WHERE x.rowid = s.rowid)"

_COUNTS_SQL = f"""
SELECT {TRUE_ID}, s.n_messages, s.last_message_id, s.n_tokens,
       (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id),
       (SELECT COALESCE(MAX(m.id), 0) FROM messages m WHERE m.session_id = s.id),
       (SELECT COALESCE(SUM(m.token_count), 0) FROM messages m WHERE m.session_id = s.id)
FROM sessions s WHERE s.id = ?
"""


def counts_problem(
    recorded: tuple[Any, ...], found: tuple[Any, ...], session_id: str
) -> str | None:
    """Why a session's messages (count, last id, token sum) do not read as its row records
    them, or None when they do."""
    if tuple(recorded) == tuple(found):
        return None
    return (
        f"session {session_id} records {recorded[0]} messages (last #{recorded[1]}, "
        f"{recorded[2]} tokens) but {found[0]} read back (last #{found[1]}, {found[2]} tokens): "
        "an index of the file is damaged"
    )


def check_counts(conn: sqlite3.Connection, session_id: str) -> str | None:
    """Why ``session_id``'s messages disagree with its row (damage), or None (also when
    there is no such session)."""
    row, problem = _own_row(conn, _COUNTS_SQL, session_id)
    if row is None:
        return problem
    return counts_problem(row[1:4], row[4:], session_id)


# The same check on what the (session, id) index alone answers (count and last id, no
# table row read): what a page read relies on, in the time of a count of index entries.
_INDEX_COUNTS_SQL = f"""
SELECT {TRUE_ID}, s.n_messages, s.last_message_id,
       (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id),
       (SELECT COALESCE(MAX(m.id), 0) FROM messages m WHERE m.session_id = s.id)
FROM sessions s WHERE s.id = ?
"""


def check_index_counts(conn: sqlite3.Connection, session_id: str) -> str | None:
    """Why the (session, id) index disagrees with the session's row on how many messages
    it has and which is last (damage), or None (also when there is no such session)."""
    row, problem = _own_row(conn, _INDEX_COUNTS_SQL, session_id)
    if row is None:
        return problem
    if tuple(row[1:3]) == tuple(row[3:5]):
        return None
    return (
        f"session {session_id} records {row[1]} messages (last #{row[2]}) but its index finds"
        f" {row[3]} (last #{row[4]}): an index of the file is damaged"
    )


def _own_row(
    conn: sqlite3.Connection, sql: str, session_id: str
) -> tuple[tuple[Any, ...] | None, str | None]:
    """The row ``sql`` reads for ``session_id`` when it is that session's own, else (None,
    None) for no such session or (None, why) when the id index hides or misplaces it."""
    row = conn.execute(sql, (session_id,)).fetchone()
    if row is not None and row[0] == session_id:
        return tuple(row), None
    hidden = conn.execute("SELECT 1 FROM sessions NOT INDEXED WHERE id=?", (session_id,)).fetchone()
    if row is None and hidden is None:
        return None, None
    return None, _hidden_session(session_id)


def _hidden_session(session_id: str) -> str:
    return f"session {session_id} is in the sessions table but its index does not find it"


def new_session_id(conn: sqlite3.Connection) -> str:
    while True:
        session_id = secrets.token_hex(4)
        if not conn.execute("SELECT 1 FROM sessions WHERE id=?", (session_id,)).fetchone():
            return session_id


class SessionsSql(SqlBase):
    """Sessions: create, find, list, update, copy, delete; salvage rows; meta keys."""

    def create_session(
        self,
        title: str = "New chat",
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Session:
        with self._tx() as conn:
            session_id = insert_session(conn, title, system_prompt, settings)
        return self.get_session(session_id)

    @staticmethod
    def _session(row: dict[str, Any]) -> Session:
        return Session(
            id=row["id"],
            title=row["title"],
            system_prompt=row["system_prompt"],
            settings=json.loads(row["settings"] or "{}"),
            created=row["created"],
            updated=row["updated"],
            parent_id=row.get("parent_id"),
            pinned=bool(row.get("pinned")),
            tags=stored_tags(row.get("tags")),
        )

    def get_session(self, session_id: str) -> Session:
        row = self._by_id(session_id)
        if row is None:
            raise KvchatError(f"no session with id {session_id}")
        return self._session(row)

    def _by_id(self, session_id: str) -> dict[str, Any] | None:
        """The session row of this id, checked to be that session's own (a damaged id index
        can point elsewhere, or nowhere: both raise DamagedDatabase); None when none."""
        rows = self._rows(
            f"SELECT s.*, {TRUE_ID} AS _true_id FROM sessions s WHERE s.id=?", (session_id,)
        )
        if rows and rows[0]["_true_id"] == session_id:
            return rows[0]
        if rows:
            raise self._found_damage(_hidden_session(session_id))
        self._missing_by_index(session_id)
        return None

    def _missing_by_index(self, session_id: str) -> None:
        """A session the id index does not find but the table holds is damage: raise it."""
        try:
            hidden = self._rows("SELECT 1 FROM sessions NOT INDEXED WHERE id=?", (session_id,))
        except KvchatError:
            return  # the scan itself fails: the caller's "no session" stands
        if hidden:
            raise self._found_damage(_hidden_session(session_id))

    def check_session(self, session_id: str) -> None:
        """Raise DamagedDatabase when the session's messages disagree with its row."""
        try:
            with self._lock:
                problem = check_counts(self._open_conn(), session_id)
        except sqlite3.DatabaseError as exc:
            raise _translate(self.path, exc) from None
        if problem is not None:
            raise self._found_damage(problem)

    def resolve_session(self, ref: str) -> Session:
        """A session by exact id, else by unique title prefix (case-insensitive)."""
        row = self._by_id(ref)
        if row is not None:
            return self._session(row)
        pattern = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._rows(
            f"SELECT * FROM sessions s WHERE title LIKE ? ESCAPE '\\' AND {LISTED}"
            " ORDER BY updated DESC",
            (pattern,),
        )
        if not rows:
            raise KvchatError(f"no session matches {ref!r} (see `kvchat list`)")
        if len(rows) > 1:
            names = ", ".join(f"{r['id']} ({r['title']})" for r in rows[:5])
            raise KvchatError(f"{ref!r} matches {len(rows)} sessions: {names}; use an id")
        return self._session(rows[0])

    def list_sessions(self) -> list[SessionSummary]:
        rows = self._rows(
            """
            SELECT s.*,
                   CASE WHEN typeof(k.n_bytes) = 'integer' AND k.n_bytes >= 0
                        THEN k.n_bytes ELSE 0 END AS snapshot_bytes,
                   CASE WHEN typeof(k.n_tokens) = 'integer' AND k.n_tokens >= 0
                        THEN k.n_tokens ELSE 0 END AS snapshot_tokens
            FROM sessions s LEFT JOIN kv_snapshots k ON k.session_id = s.id
            WHERE """
            + LISTED
            + """
            ORDER BY s.updated DESC, s.rowid DESC
            """
        )
        return [
            SessionSummary(
                session=self._session(r),
                messages=r["n_messages"],
                tokens=r["n_tokens"],
                snapshot_bytes=r["snapshot_bytes"],
                snapshot_tokens=r["snapshot_tokens"],
            )
            for r in rows
        ]

    def update_session(
        self,
        session_id: str,
        *,
        title: str | None = None,
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Session:
        changes: dict[str, Any] = {"updated": now()}
        if title is not None:
            changes["title"] = title
        if system_prompt is not None:
            changes["system_prompt"] = system_prompt or None
        if settings is not None:
            changes["settings"] = json.dumps(settings)
        assignments = ", ".join(f"{k}=?" for k in changes)
        with self._tx() as conn:
            conn.execute(
                f"UPDATE sessions SET {assignments} WHERE id=?", (*changes.values(), session_id)
            )
        return self.get_session(session_id)

    def set_pinned(self, session_id: str, pinned: bool) -> Session:
        """Pin the session (listed first) or unpin it; its ``updated`` time stays."""
        with self._tx() as conn:
            conn.execute("UPDATE sessions SET pinned=? WHERE id=?", (int(pinned), session_id))
        return self.get_session(session_id)

    def set_tags(self, session_id: str, tags: tuple[str, ...]) -> Session:
        """Replace the session's tags (parsed by :func:`kvchat.store.tags.parse_tags`);
        its ``updated`` time stays."""
        with self._tx() as conn:
            conn.execute("UPDATE sessions SET tags=? WHERE id=?", (column_text(tags), session_id))
        return self.get_session(session_id)

    def copy_session(
        self,
        source_id: str,
        title: str,
        *,
        upto_message: int | None = None,
        then: tuple[str, str, int] | None = None,
    ) -> Session:
        """A new session with ``source_id``'s settings and messages (up to and including
        ``upto_message``; all by default), plus ``then`` = (role, content, token_count)
        appended: all in one transaction, so a kill leaves the whole copy or nothing. The
        copy records ``source_id`` as its parent (the sidebar's branch view)."""
        source = self.get_session(source_id)
        stamp = now()
        with self._tx() as conn:
            problem = check_counts(conn, source_id)
            if problem is not None:
                raise self._found_damage(problem)
            session_id = insert_session(
                conn, title, source.system_prompt, source.settings, stamp, parent_id=source_id
            )
            last = upto_message if upto_message is not None else 2**62
            conn.execute(
                "INSERT INTO messages (session_id, role, content, created, token_count, partial,"
                " finish_reason, reasoning) SELECT ?, role, content, created, token_count,"
                " partial, finish_reason, reasoning FROM messages WHERE session_id=? AND id<=?"
                " ORDER BY id",
                (session_id, source_id, last),
            )
            copied = [
                row[0]
                for row in conn.execute(
                    "SELECT id FROM messages WHERE session_id=? AND id<=? ORDER BY id",
                    (source_id, last),
                )
            ]
            made = [
                row[0]
                for row in conn.execute(
                    "SELECT id FROM messages WHERE session_id=? ORDER BY id", (session_id,)
                )
            ]
            copy_session_documents(conn, source_id, session_id, dict(zip(copied, made)))
            # A branch keeps its parent's tags (not its pin) and its replies' figures.
            if source.tags:
                conn.execute(
                    "UPDATE sessions SET tags=? WHERE id=?", (column_text(source.tags), session_id)
                )
            conn.executemany(
                "INSERT INTO message_figures (message_id, model, prompt_tokens, reused, decoded,"
                " generated, ttft_ms, tokens_per_s, seconds, kv, recorded) SELECT ?, model,"
                " prompt_tokens, reused, decoded, generated, ttft_ms, tokens_per_s, seconds, kv,"
                " recorded FROM message_figures WHERE message_id = ?",
                list(zip(made, copied)),
            )
            from kvchat.store.tools_sql import copy_tool_rows  # it imports this module

            copy_tool_rows(conn, list(zip(made, copied)))  # its calls and tool messages
            if then is not None:
                role, content, token_count = then
                conn.execute(
                    "INSERT INTO messages (session_id, role, content, created, token_count)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (session_id, role, content, stamp, token_count),
                )
        return self.get_session(session_id)

    def restore_session(self, row: dict[str, Any]) -> bool:
        """Insert a salvaged session row as it was (``kvchat doctor``); False if unusable."""
        if not isinstance(row.get("id"), str) or not isinstance(row.get("title"), str):
            return False
        settings = row.get("settings") if isinstance(row.get("settings"), str) else "{}"
        try:
            json.loads(settings)
        except ValueError:
            settings = "{}"
        stamp = now()
        with self._tx() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO sessions"
                " (id, title, system_prompt, settings, created, updated) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    row["id"],
                    row["title"],
                    row.get("system_prompt") if isinstance(row.get("system_prompt"), str) else None,
                    settings,
                    row.get("created") if isinstance(row.get("created"), str) else stamp,
                    row.get("updated") if isinstance(row.get("updated"), str) else stamp,
                ),
            )
        return True

    def restore_message(self, row: dict[str, Any]) -> bool:
        """Insert a salvaged message row as it was (``kvchat doctor``); False if unusable."""
        if not isinstance(row.get("content"), str) or row.get("role") not in (
            "user",
            "assistant",
            "system",
        ):
            return False
        with self._tx() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO messages"
                " (id, session_id, role, content, created, token_count, partial)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    row.get("id") if isinstance(row.get("id"), int) else None,
                    row["session_id"],
                    row["role"],
                    row["content"],
                    row.get("created") if isinstance(row.get("created"), str) else now(),
                    row.get("token_count") if isinstance(row.get("token_count"), int) else 0,
                    1 if row.get("partial") else 0,
                ),
            )
        return True

    def delete_session(self, session_id: str) -> None:
        """Delete a session, its messages and its snapshot row (the caller removes files);
        its branches move up to its own parent (or become roots)."""
        with self._tx() as conn:
            conn.execute(
                "UPDATE sessions SET parent_id=(SELECT parent_id FROM sessions WHERE id=?)"
                " WHERE parent_id=?",
                (session_id, session_id),
            )
            conn.execute("DELETE FROM kv_snapshots WHERE session_id=?", (session_id,))
            conn.execute("DELETE FROM kv_snapshot_shelf WHERE session_id=?", (session_id,))
            conn.execute("DELETE FROM messages WHERE session_id=?", (session_id,))
            conn.execute("DELETE FROM session_documents WHERE session_id=?", (session_id,))
            conn.execute("DELETE FROM sessions WHERE id=?", (session_id,))

    def get_meta(self, key: str) -> str | None:
        rows = self._rows("SELECT value FROM meta WHERE key=?", (key,))
        return rows[0]["value"] if rows else None

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as conn:
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?)"
                " ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, value),
            )

    def delete_meta(self, key: str) -> None:
        with self._tx() as conn:
            conn.execute("DELETE FROM meta WHERE key=?", (key,))
