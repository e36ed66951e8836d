"""The only place that speaks SQL."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlite_utils

from kvchat.config import ensure_private_dir
from kvchat.errors import KvchatError
from kvchat.store.locks import file_lock
from kvchat.store.migrations import migrate
from kvchat.store.models import ChunkRow, Message, SearchHit, Session, SessionSummary, SnapshotRow


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _create_private_file(path: Path) -> None:
    """Create ``path`` as 0600 before SQLite opens it; its -wal/-shm inherit the mode."""
    if path.exists():
        return
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)


def _insert_session(
    conn: sqlite3.Connection,
    title: str,
    system_prompt: str | None,
    settings: dict[str, Any] | None,
    stamp: str | None = None,
) -> str:
    """Insert a new session row (in the caller's transaction); returns its fresh id."""
    stamp = stamp or now()
    session_id = _new_session_id(conn)
    conn.execute(
        "INSERT INTO sessions (id, title, system_prompt, settings, created, updated)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (session_id, title, system_prompt, json.dumps(settings or {}), stamp, stamp),
    )
    return session_id


def _new_session_id(conn: sqlite3.Connection) -> str:
    while True:
        session_id = secrets.token_hex(4)
        if not conn.execute("SELECT 1 FROM sessions WHERE id=?", (session_id,)).fetchone():
            return session_id


class DamagedDatabase(KvchatError):
    """The database file fails SQLite's checks: kvchat refuses to write to it."""


class StoreFull(KvchatError):
    """The disk is full: SQLite could not commit."""


def damaged_message(path: Path, detail: str) -> str:
    return (
        f"the database {path} is damaged ({detail}); nothing was written to it. "
        "Run `kvchat doctor` to move it aside and salvage the text into a fresh database"
    )


def _translate(path: Path, exc: sqlite3.DatabaseError) -> Exception:
    """One clear line for what SQLite raises on a full disk, a busy or a damaged file.

    Anything else (a constraint violation: a bug, not the user's problem) stays as it is.
    """
    text = str(exc)
    if isinstance(exc, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.InterfaceError):
        return exc
    if "full" in text:
        return StoreFull(f"the disk is full: could not write to {path} ({text})")
    if "locked" in text or "busy" in text:
        return KvchatError(f"the database {path} is busy (another kvchat is writing): {text}")
    if "malformed" in text or "not a database" in text or "encrypted" in text:
        return DamagedDatabase(damaged_message(path, text))
    return KvchatError(f"database error in {path}: {text}")


class Store:
    """Sessions, messages and the KV snapshot index in one SQLite file (WAL).

    Opening checks the file (``PRAGMA quick_check``) and runs the migrations while holding
    an exclusive lock on ``<db>.lock``, so two processes opening a new home never race.
    A damaged file raises :class:`DamagedDatabase` and is never written to.
    """

    def __init__(self, path: Path, *, check: bool = True) -> None:
        self.path = path
        self._lock = threading.RLock()
        ensure_private_dir(path.parent)
        try:
            with file_lock(self.lock_path(path)):
                _create_private_file(path)
                conn = sqlite3.connect(path, check_same_thread=False, timeout=30)
                self.db = sqlite_utils.Database(conn)
                try:
                    if check:
                        self._quick_check()
                    self.db.execute("PRAGMA journal_mode=WAL")
                    self.db.execute("PRAGMA synchronous=FULL")
                    self.db.execute("PRAGMA foreign_keys=ON")
                    with self._lock:
                        self.applied_migrations = migrate(self.db)
                except BaseException:
                    conn.close()
                    raise
        except sqlite3.DatabaseError as exc:
            raise _translate(path, exc) from None
        except OSError as exc:
            raise KvchatError(f"cannot open the database {path}: {exc.strerror or exc}") from None

    @staticmethod
    def lock_path(path: Path) -> Path:
        return path.with_name(path.name + ".lock")

    def _quick_check(self) -> None:
        result = [row[0] for row in self.db.execute("PRAGMA quick_check").fetchall()]
        if result != ["ok"]:
            raise DamagedDatabase(damaged_message(self.path, "; ".join(map(str, result[:3]))))

    def close(self) -> None:
        self.db.conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        try:
            with self._lock, self.db.conn as conn:
                yield conn
        except sqlite3.DatabaseError as exc:
            raise _translate(self.path, exc) from None

    def _rows(
        self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()
    ) -> list[dict[str, Any]]:
        try:
            with self._lock:
                cursor = self.db.execute(sql, params)
                names = [d[0] for d in cursor.description]
                return [dict(zip(names, row)) for row in cursor.fetchall()]
        except sqlite3.DatabaseError as exc:
            raise _translate(self.path, exc) from None

    # --- sessions -------------------------------------------------------------------------

    def create_session(
        self,
        title: str = "New chat",
        system_prompt: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Session:
        with self._tx() as conn:
            session_id = _insert_session(conn, title, system_prompt, settings)
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
        )

    def get_session(self, session_id: str) -> Session:
        rows = self._rows("SELECT * FROM sessions WHERE id=?", (session_id,))
        if not rows:
            raise KvchatError(f"no session with id {session_id}")
        return self._session(rows[0])

    def resolve_session(self, ref: str) -> Session:
        """A session by exact id, else by unique title prefix (case-insensitive)."""
        rows = self._rows("SELECT * FROM sessions WHERE id=?", (ref,))
        if rows:
            return self._session(rows[0])
        pattern = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._rows(
            "SELECT * FROM sessions WHERE title LIKE ? ESCAPE '\\' ORDER BY updated DESC",
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
                   (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.id) AS n_messages,
                   (SELECT COALESCE(SUM(token_count), 0) FROM messages m
                     WHERE m.session_id = s.id) AS n_tokens,
                   CASE WHEN typeof(k.n_bytes) = 'integer' AND k.n_bytes >= 0
                        THEN k.n_bytes ELSE 0 END AS snapshot_bytes,
                   CASE WHEN typeof(k.n_tokens) = 'integer' AND k.n_tokens >= 0
                        THEN k.n_tokens ELSE 0 END AS snapshot_tokens
            FROM sessions s LEFT JOIN kv_snapshots k ON k.session_id = s.id
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
        appended: all in one transaction, so a kill leaves the whole copy or nothing."""
        source = self.get_session(source_id)
        stamp = now()
        with self._tx() as conn:
            session_id = _insert_session(conn, title, source.system_prompt, source.settings, stamp)
            last = upto_message if upto_message is not None else 2**62
            conn.execute(
                "INSERT INTO messages (session_id, role, content, created, token_count, partial)"
                " SELECT ?, role, content, created, token_count, partial FROM messages"
                " WHERE session_id=? AND id<=? ORDER BY id",
                (session_id, source_id, last),
            )
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
        """Delete a session, its messages and its snapshot row (the caller removes files)."""
        with self._tx() as conn:
            conn.execute("DELETE FROM kv_snapshots WHERE session_id=?", (session_id,))
            conn.execute("DELETE FROM messages WHERE session_id=?", (session_id,))
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

    # --- messages -------------------------------------------------------------------------

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
        )

    def add_message(
        self,
        session_id: str,
        role: str,
        content: str,
        *,
        token_count: int = 0,
        partial: bool = False,
    ) -> Message:
        """Append a message and commit it (durable once this returns)."""
        stamp = now()
        with self._tx() as conn:
            cursor = conn.execute(
                "INSERT INTO messages (session_id, role, content, created, token_count, partial)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, role, content, stamp, token_count, int(partial)),
            )
            conn.execute("UPDATE sessions SET updated=? WHERE id=?", (stamp, session_id))
            message_id = cursor.lastrowid
        assert message_id is not None
        return self.get_message(message_id)

    def get_message(self, message_id: int) -> Message:
        rows = self._rows("SELECT * FROM messages WHERE id=?", (message_id,))
        if not rows:
            raise KvchatError(f"no message with id {message_id}")
        return self._message(rows[0])

    def messages(self, session_id: str) -> list[Message]:
        rows = self._rows("SELECT * FROM messages WHERE session_id=? ORDER BY id", (session_id,))
        return [self._message(r) for r in rows]

    def delete_message(self, message_id: int) -> None:
        with self._tx() as conn:
            conn.execute("DELETE FROM messages WHERE id=?", (message_id,))

    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Full-text search over every message, best match first."""
        terms = " ".join('"' + word.replace('"', '""') + '"' for word in query.split())
        if not terms:
            return []
        rows = self._rows(
            """
            SELECT m.*, s.title AS session_title,
                   snippet(messages_fts, 0, char(2), char(3), '…', 12) AS snippet
            FROM messages_fts
            JOIN messages m ON m.id = messages_fts.rowid
            JOIN sessions s ON s.id = m.session_id
            WHERE messages_fts MATCH ?
            ORDER BY rank LIMIT ?
            """,
            (terms, limit),
        )
        return [
            SearchHit(
                message=self._message(r), session_title=r["session_title"], snippet=r["snippet"]
            )
            for r in rows
        ]

    # --- snapshot index -------------------------------------------------------------------

    def get_snapshot(self, session_id: str) -> SnapshotRow | None:
        rows = self._rows("SELECT * FROM kv_snapshots WHERE session_id=?", (session_id,))
        return SnapshotRow.from_row(rows[0]) if rows else None

    def put_snapshot(self, row: SnapshotRow, new_chunks: Sequence[ChunkRow] = ()) -> None:
        """Insert or replace a session's snapshot row and index its new chunks, atomically.

        Called after the files were renamed into place.
        """
        stamp = now()
        row.created = row.created or stamp
        row.last_used = stamp
        values = row.to_row()
        columns = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self._tx() as conn:
            for chunk in new_chunks:
                conn.execute(
                    "INSERT OR REPLACE INTO kv_chunks"
                    " (key, path, start, n_tokens, n_bytes, checksum, created, last_used)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        chunk.key,
                        chunk.path,
                        chunk.start,
                        chunk.n_tokens,
                        chunk.n_bytes,
                        chunk.checksum,
                        stamp,
                        stamp,
                    ),
                )
            conn.execute(
                f"INSERT OR REPLACE INTO kv_snapshots ({columns}) VALUES ({marks})",
                tuple(values.values()),
            )

    def snapshots(self) -> list[SnapshotRow]:
        """Every snapshot row, least recently used first."""
        rows = self._rows("SELECT * FROM kv_snapshots ORDER BY last_used, session_id")
        return [SnapshotRow.from_row(r) for r in rows]

    def get_chunks(self, keys: list[str]) -> dict[str, ChunkRow]:
        found: dict[str, ChunkRow] = {}
        for start in range(0, len(keys), 500):
            batch = keys[start : start + 500]
            marks = ", ".join("?" for _ in batch)
            for r in self._rows(f"SELECT * FROM kv_chunks WHERE key IN ({marks})", tuple(batch)):
                found[r["key"]] = ChunkRow(**r)
        return found

    def all_chunks(self) -> list[ChunkRow]:
        return [ChunkRow(**r) for r in self._rows("SELECT * FROM kv_chunks")]

    def unreferenced_chunks(self) -> list[ChunkRow]:
        """Chunks that no snapshot's chain (or window checkpoint list) uses any more."""
        rows = self._rows(
            """
            SELECT c.* FROM kv_chunks c
            WHERE NOT EXISTS (
                SELECT 1 FROM kv_snapshots s, json_each(
                    CASE WHEN json_valid(s.chunk_keys) THEN s.chunk_keys ELSE '[]' END
                ) k
                WHERE s.format = 'chunks' AND k.value = c.key
            )
            AND NOT EXISTS (
                SELECT 1 FROM kv_snapshots s, json_each(
                    CASE WHEN json_valid(s.checkpoints) THEN s.checkpoints ELSE '[]' END
                ) k
                WHERE s.format = 'chunks' AND json_extract(k.value, '$[2]') = c.key
            )
            """
        )
        return [ChunkRow(**r) for r in rows]

    def delete_chunks(self, keys: list[str]) -> None:
        with self._tx() as conn:
            conn.executemany("DELETE FROM kv_chunks WHERE key=?", [(k,) for k in keys])

    def bump_counters(self, **deltas: int) -> None:
        """Add to persistent cache counters (kept in ``meta`` as ``counter:NAME``)."""
        with self._tx() as conn:
            for name, delta in deltas.items():
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE"
                    " SET value = CAST(value AS INTEGER) + excluded.value",
                    (f"counter:{name}", delta),
                )

    def counters(self) -> dict[str, int]:
        rows = self._rows("SELECT key, value FROM meta WHERE key LIKE 'counter:%'")
        return {r["key"].removeprefix("counter:"): int(r["value"]) for r in rows}

    def touch_snapshot(self, session_id: str) -> None:
        with self._tx() as conn:
            conn.execute(
                "UPDATE kv_snapshots SET last_used=? WHERE session_id=?", (now(), session_id)
            )

    def delete_snapshot(self, session_id: str) -> None:
        with self._tx() as conn:
            conn.execute("DELETE FROM kv_snapshots WHERE session_id=?", (session_id,))

    def snapshot_paths(self) -> set[str]:
        """Every file a row points to: blob snapshots and chunks."""
        blobs = {r["path"] for r in self._rows("SELECT path FROM kv_snapshots WHERE format='blob'")}
        return blobs | {r["path"] for r in self._rows("SELECT path FROM kv_chunks")}

    def integrity_check(self) -> str:
        return str(self._rows("PRAGMA integrity_check")[0]["integrity_check"])

    # --- imports (kvchat.transfer) ----------------------------------------------------------

    def claimed_sessions(self, key: str) -> list[str]:
        """The sessions that meta ``key`` (an import's record) names and that still exist."""
        value = self.get_meta(key)
        try:
            ids = json.loads(value) if value else []
        except ValueError:
            return []
        ids = [ids] if isinstance(ids, str) else ids if isinstance(ids, list) else []
        return [
            i
            for i in ids
            if isinstance(i, str) and self._rows("SELECT 1 FROM sessions WHERE id=?", (i,))
        ]

    def import_sessions(
        self, sessions: Sequence[dict[str, Any]], file_key: str
    ) -> list[tuple[str, bool]]:
        """Insert whole sessions with their messages in one transaction (all or nothing).

        Each item: ``title``, ``system_prompt``, ``settings``, ``created``/``updated`` (None:
        now), ``messages`` as (role, content, created or None, token_count, partial), and
        ``key``: a meta key for its content, or None. An item whose key names a session that
        still exists is not inserted again. ``file_key`` records every session of the file.
        Returns (session id, inserted now) per item. Raises KvchatError if ``file_key``
        already names live sessions (another import of the same file won the race).
        """
        stamp = now()
        results: list[tuple[str, bool]] = []
        with self._tx() as conn:
            # The first write takes the database's write lock: the checks below can't race.
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (?, '[]') ON CONFLICT(key) DO NOTHING",
                (file_key,),
            )

            def live(key: str) -> list[str]:
                row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
                try:
                    ids = json.loads(row[0]) if row and row[0] else []
                except ValueError:
                    return []
                ids = [ids] if isinstance(ids, str) else ids if isinstance(ids, list) else []
                found = [
                    i
                    for i in ids
                    if isinstance(i, str)
                    and conn.execute("SELECT 1 FROM sessions WHERE id=?", (i,)).fetchone()
                ]
                return found

            taken = live(file_key)
            if taken:
                raise KvchatError(f"this file was already imported as {', '.join(taken)}")
            for item in sessions:
                key = item.get("key")
                earlier = live(key) if key else []
                if earlier:
                    results.append((earlier[0], False))
                    continue
                session_id = _new_session_id(conn)
                created = item.get("created") or stamp
                conn.execute(
                    "INSERT INTO sessions (id, title, system_prompt, settings, created, updated)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        session_id,
                        item["title"],
                        item.get("system_prompt"),
                        json.dumps(item.get("settings") or {}),
                        created,
                        item.get("updated") or created,
                    ),
                )
                conn.executemany(
                    "INSERT INTO messages"
                    " (session_id, role, content, created, token_count, partial)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (session_id, role, content, when or created, tokens, int(partial))
                        for role, content, when, tokens, partial in item["messages"]
                    ],
                )
                if key:
                    conn.execute(
                        "INSERT INTO meta (key, value) VALUES (?, ?)"
                        " ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                        (key, json.dumps(session_id)),
                    )
                results.append((session_id, True))
            conn.execute(
                "UPDATE meta SET value=? WHERE key=?",
                (json.dumps([session_id for session_id, _ in results]), file_key),
            )
        return results

    def update_message(
        self, message_id: int, content: str, partial: bool, *, token_count: int | None = None
    ) -> Message:
        """Replace a message's text and partial mark (a reply saved as it streams, then
        finished or continued), committed; the search index follows by its triggers."""
        stamp = now()
        with self._tx() as conn:
            cursor = conn.execute(
                "UPDATE messages SET content=?, partial=?, token_count=COALESCE(?, token_count)"
                " WHERE id=?",
                (content, int(partial), token_count, message_id),
            )
            if cursor.rowcount == 0:
                raise KvchatError(f"no message with id {message_id}")
            conn.execute(
                "UPDATE sessions SET updated=? WHERE id=(SELECT session_id FROM messages"
                " WHERE id=?)",
                (stamp, message_id),
            )
        return self.get_message(message_id)
