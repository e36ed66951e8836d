"""Housekeeping of the cold tier: deleting snapshots, dropping unused chunks, the disk
budget, and removing orphans (files no row points to, temp files of dead writers).

Only KV files and their rows are ever deleted here; conversation text never is.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvchat.kvcache.files import TEMP_SUFFIX, temp_writer_alive, walk
from kvchat.kvcache.format import CHUNK_SUFFIX, SUFFIX
from kvchat.store import ChunkRow, SnapshotRow, Store

# Unreferenced files younger than this may belong to another kvchat process that renamed
# its file and is about to commit the row; older ones are orphans.
ORPHAN_GRACE_S = 60.0


class Housekeeper:
    """Deletes and accounts for snapshot files under ``directory`` and their rows."""

    def __init__(self, directory: Path, chunk_dir: Path, store: Store) -> None:
        self.directory = directory
        self.chunk_dir = chunk_dir
        self.store = store

    def files(self, row: SnapshotRow) -> list[Path]:
        """The files holding a snapshot's data."""
        if row.format == "blob":
            return [self.directory / row.path]
        index = self.store.get_chunks(row.chunk_keys)
        return [self.chunk_dir / index[key].path for key in row.chunk_keys if key in index]

    def delete(self, session_id: str) -> None:
        """Forget a session's snapshot (its text is untouched)."""
        row = self.store.get_snapshot(session_id)
        self.store.delete_snapshot(session_id)
        if row is not None and row.format == "blob":
            (self.directory / row.path).unlink(missing_ok=True)
        self.drop_unreferenced_chunks()

    def forget_chunks(self, chunks: list[ChunkRow]) -> None:
        """Delete these chunks' rows, then their files."""
        self.store.delete_chunks([c.key for c in chunks])
        for chunk in chunks:
            (self.chunk_dir / chunk.path).unlink(missing_ok=True)

    def drop_unreferenced_chunks(self) -> int:
        """Delete chunks no snapshot uses any more; returns bytes freed."""
        unused = self.store.unreferenced_chunks()
        if not unused:
            return 0
        self.forget_chunks(unused)
        return sum(c.n_bytes for c in unused)

    def disk_bytes(self) -> int:
        """Bytes of snapshot data on disk (each shared chunk counted once)."""
        blobs = sum(r.n_bytes for r in self.store.snapshots() if r.format == "blob")
        return blobs + sum(c.n_bytes for c in self.store.all_chunks())

    def enforce_budget(self, budget_bytes: int | None, keep: str | None = None) -> list[str]:
        """Evict least recently used snapshots (never ``keep``) until ``budget_bytes`` holds."""
        if budget_bytes is None:
            return []
        evicted: list[str] = []
        for row in self.store.snapshots():
            if self.disk_bytes() <= budget_bytes:
                break
            if row.session_id == keep:
                continue
            self.delete(row.session_id)
            evicted.append(row.session_id)
        return evicted

    def clear(self, session_id: str | None = None) -> int:
        """Delete one session's snapshot, or all of them; returns how many."""
        rows = self.store.snapshots()
        targets = [r for r in rows if session_id is None or r.session_id == session_id]
        for row in targets:
            self.delete(row.session_id)
        return len(targets)

    def cleanup_orphans(self) -> list[str]:
        """Remove temp files of dead writers and files no row points to."""
        referenced = self.store.snapshot_paths()
        removed: list[str] = []
        now = time.time()
        for entry in walk(self.directory):
            name = entry.name
            root = self.chunk_dir if entry.parent != self.directory else self.directory
            relative = str(entry.relative_to(root))
            if name.endswith(TEMP_SUFFIX):
                if temp_writer_alive(name):
                    continue
            elif name.endswith((SUFFIX, CHUNK_SUFFIX)):
                if relative in referenced or now - entry.stat().st_mtime < ORPHAN_GRACE_S:
                    continue
            else:
                continue
            entry.unlink(missing_ok=True)
            removed.append(name)
        return removed
