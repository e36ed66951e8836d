"""The KV snapshot index: one current row per session, earlier rows kept per setting (the
shelf), the chunks they share, counters."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from kvchat.store.connection import SqlBase, now
from kvchat.store.rows import ChunkRow, SnapshotRow


class SnapshotsSql(SqlBase):
    """Snapshot rows and chunk rows (the files are kvcache's), and the cache counters."""

    def get_snapshot(self, session_id: str) -> SnapshotRow | None:
        rows = self._rows("SELECT * FROM kv_snapshots WHERE session_id=?", (session_id,))
        return SnapshotRow.from_row(rows[0]) if rows else None

    def put_snapshot(self, row: SnapshotRow, new_chunks: Sequence[ChunkRow] = ()) -> None:
        """Insert or replace a session's snapshot row and index its new chunks, atomically.

        Called after the files were renamed into place. A previous row that the new one does
        not continue (another n_ctx's window, other KV types, another branch of the reply)
        is not thrown away: it goes to the shelf, one row per fingerprint, where a longer
        row is never replaced by a shorter one (see :meth:`shelved_snapshots`).
        """
        stamp = now()
        row.created = row.created or stamp
        row.last_used = stamp
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
            previous = _one(conn, "SELECT * FROM kv_snapshots WHERE session_id=?", row.session_id)
            if previous is not None:
                old = SnapshotRow.from_row(previous)
                if old.token_ids != row.token_ids[: len(old.token_ids)]:
                    _shelve(conn, old)  # not a continuation: kept for its own setting
            _put(conn, "kv_snapshots", row.to_row())

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
        """Chunks that no snapshot's chain (or window checkpoint list) uses any more, current
        or shelved."""
        rows = self._rows(
            """
            WITH rows AS (
                SELECT format, chunk_keys, checkpoints FROM kv_snapshots
                UNION ALL SELECT format, chunk_keys, checkpoints FROM kv_snapshot_shelf
            )
            SELECT c.* FROM kv_chunks c
            WHERE NOT EXISTS (
                SELECT 1 FROM rows s, json_each(
                    CASE WHEN json_valid(s.chunk_keys) THEN s.chunk_keys ELSE '[]' END
                ) k
                WHERE s.format = 'chunks' AND k.value = c.key
            )
            AND NOT EXISTS (
                SELECT 1 FROM rows s, json_each(
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
        """Forget a session's saved KV: its current row and its shelved ones."""
        with self._tx() as conn:
            conn.execute("DELETE FROM kv_snapshots WHERE session_id=?", (session_id,))
            conn.execute("DELETE FROM kv_snapshot_shelf WHERE session_id=?", (session_id,))

    def snapshot_paths(self) -> set[str]:
        """Every file a row points to: blob snapshots and chunks."""
        blobs = {r["path"] for r in self._rows("SELECT path FROM kv_snapshots WHERE format='blob'")}
        return blobs | {r["path"] for r in self._rows("SELECT path FROM kv_chunks")}

    # --- the shelf: earlier snapshots of a session, one per fingerprint ---------------------

    def shelved_snapshots(self, session_id: str | None = None) -> list[SnapshotRow]:
        """A session's shelved rows (all sessions' when None), least recently used first.

        A shelved row is a snapshot the session's current one replaced without continuing
        it; a restore under a setting it suits takes it back (:meth:`promote_snapshot`).
        Its chunks stay referenced: only chunked rows are shelved (a blob's file is
        rewritten in place by the next save).
        """
        where, params = ("WHERE session_id=?", (session_id,)) if session_id else ("", ())
        rows = self._rows(
            f"SELECT * FROM kv_snapshot_shelf {where} ORDER BY last_used, session_id", params
        )
        return [SnapshotRow.from_row(r) for r in rows]

    def promote_snapshot(self, session_id: str, fingerprint: dict[str, Any]) -> bool:
        """Make the shelved row of this fingerprint the session's current snapshot, and
        shelve the current one, in one transaction. False when no such row is shelved."""
        key = shelf_key(fingerprint)
        with self._tx() as conn:
            shelved = _one(
                conn,
                "SELECT * FROM kv_snapshot_shelf WHERE session_id=? AND shelf_key=?",
                session_id,
                key,
            )
            if shelved is None:
                return False
            conn.execute(
                "DELETE FROM kv_snapshot_shelf WHERE session_id=? AND shelf_key=?",
                (session_id, key),
            )
            current = _one(conn, "SELECT * FROM kv_snapshots WHERE session_id=?", session_id)
            if current is not None:
                _shelve(conn, SnapshotRow.from_row(current))
            shelved.pop("shelf_key")
            shelved["last_used"] = now()
            _put(conn, "kv_snapshots", shelved)
        return True

    def delete_shelved(self, session_id: str, fingerprint: dict[str, Any]) -> None:
        with self._tx() as conn:
            conn.execute(
                "DELETE FROM kv_snapshot_shelf WHERE session_id=? AND shelf_key=?",
                (session_id, shelf_key(fingerprint)),
            )


def shelf_key(fingerprint: dict[str, Any]) -> str:
    """The shelf's key for a fingerprint: one shelved row per setting that made the KV."""
    text = json.dumps(fingerprint, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _one(conn: sqlite3.Connection, sql: str, *params: Any) -> dict[str, Any] | None:
    cursor = conn.execute(sql, params)
    row = cursor.fetchone()
    return None if row is None else dict(zip([d[0] for d in cursor.description], row))


def _put(conn: sqlite3.Connection, table: str, values: dict[str, Any]) -> None:
    """Insert or replace one row of ``table`` (a literal of this module) from ``values``."""
    conn.execute(
        f"INSERT OR REPLACE INTO {table} ({', '.join(values)})"
        f" VALUES ({', '.join('?' for _ in values)})",
        tuple(values.values()),
    )


def _shelve(conn: sqlite3.Connection, row: SnapshotRow) -> None:
    """Keep ``row`` on the shelf (in the caller's transaction), unless the shelf already
    holds a longer row of its fingerprint: a longer usable snapshot is never replaced by a
    shorter one. Blob rows and damaged rows are not kept."""
    if row.format != "chunks" or row.damage:
        return
    key = shelf_key(row.fingerprint)
    held = conn.execute(
        "SELECT n_tokens FROM kv_snapshot_shelf WHERE session_id=? AND shelf_key=?",
        (row.session_id, key),
    ).fetchone()
    if held is not None and isinstance(held[0], int) and held[0] > row.n_tokens:
        return
    _put(conn, "kv_snapshot_shelf", {**row.to_row(), "shelf_key": key})
