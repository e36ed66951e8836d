"""The KV snapshot index: one row per session snapshot, the chunks they share, counters."""

from __future__ import annotations

from collections.abc import Sequence

from kvchat.store.base import SqlBase, now
from kvchat.store.models import ChunkRow, SnapshotRow


class SnapshotsSql(SqlBase):
    """Snapshot rows and chunk rows (the files are kvcache's), and the cache counters."""

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
