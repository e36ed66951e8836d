"""Housekeeping of the cold tier: deleting snapshots, dropping unused chunks and damaged
rows, the disk budget, and removing orphans (files no row points to, temp files of dead
writers).

Only KV files and their rows are ever deleted here; conversation text never is. A file is
deleted only when kvchat can prove it wrote it: its name is one kvchat derives from a key
(a session id, a chunk key) exactly, it is a regular file (never a symlink), and it lies in
the snapshot directory or one of its chunk subdirectories, each a real directory. A
``path`` column is compared with the derived name, never used to open or unlink: a row
whose path is not its own name loses its row, never a file. Anything else found under
the snapshot directory is left alone.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.chains import verify_chain, window_key
from kvchat.kvcache.cold.files import (
    dir_problem,
    entries,
    regular_file,
    remove_file,
    temp_writer_alive,
)
from kvchat.kvcache.fingerprint import fingerprint_problem
from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.store import ChunkRow, SnapshotRow, Store
from kvchat.store.locks import SessionBusy

# Unreferenced files younger than this may belong to another kvchat process that renamed
# its file and is about to commit the row; older ones are orphans.
ORPHAN_GRACE_S = 60.0
# ``meta`` key recording why a session's snapshot is gone (evicted, or dropped as damaged).
GONE_KEY = "evicted:{}"


def _count(value: object) -> int:
    """A byte or token count from a row; anything else (damage) counts as 0."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return 0


def gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.3g} GiB"


def window_keys(row: SnapshotRow) -> list[str]:
    """The keys of a snapshot's window pieces (sliding-window models)."""
    if row.format != "chunks":
        return []
    return [entry[2] for entry in row.checkpoints if isinstance(entry[2], str)]


def chunk_row_problem(chunk: ChunkRow) -> str | None:
    """Why a chunk's index row can't be trusted, or None."""
    if not fmt.valid_key(chunk.key):
        return f"chunk key {str(chunk.key)[:40]!r} is not a key"
    if chunk.path != fmt.chunk_name(chunk.key):
        return f"chunk {chunk.key[:12]} names a file that is not its own ({chunk.path!r})"
    for name in ("start", "n_tokens", "n_bytes"):
        value = getattr(chunk, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"chunk {chunk.key[:12]} has a damaged {name} ({value!r})"
    if chunk.n_tokens == 0:
        return f"chunk {chunk.key[:12]} holds no tokens"
    return None


class Housekeeper:
    """Deletes and accounts for snapshot files under ``directory`` and their rows.

    With ``disabled`` set (the directory can't be trusted) rows are still managed, but no
    file is ever touched.
    """

    def __init__(
        self, directory: Path, chunk_dir: Path, store: Store, disabled: str | None = None
    ) -> None:
        self.directory = directory
        self.chunk_dir = chunk_dir
        self.store = store
        self.disabled = disabled

    # --- file names derived from keys -----------------------------------------------------

    def blob_path(self, row: SnapshotRow) -> Path | None:
        """The blob file of ``row`` when its stored name is one kvchat gives its session."""
        if row.format == "blob" and fmt.is_blob_name(row.session_id, row.path):
            return self.directory / row.path
        return None

    def chunk_path(self, key: str) -> Path | None:
        """A chunk's file, from its key alone (None for a string that is not a key)."""
        return self.chunk_dir / fmt.chunk_name(key) if fmt.valid_key(key) else None

    def files(self, row: SnapshotRow) -> list[Path]:
        """The files holding a snapshot's data."""
        if row.format == "blob":
            path = self.blob_path(row)
            return [path] if path is not None else []
        keys = row.chunk_keys + window_keys(row)
        index = self.store.get_chunks(keys)
        paths = [self.chunk_path(key) for key in keys if key in index]
        return [path for path in paths if path is not None]

    def _remove(self, path: Path | None) -> bool:
        """Remove one of our files: a regular file in a real directory of ours."""
        if path is None or self.disabled is not None:
            return False
        if path.parent != self.directory and dir_problem(path.parent) is not None:
            return False
        return remove_file(path)

    # --- deleting -------------------------------------------------------------------------

    def remove_blob(self, row: SnapshotRow) -> bool:
        """Remove a blob row's file, if its stored name is its session's (else nothing)."""
        return self._remove(self.blob_path(row))

    def delete(self, session_id: str) -> None:
        """Forget a session's snapshot (its text is untouched)."""
        row = self.store.get_snapshot(session_id)
        self.store.delete_snapshot(session_id)
        self.clear_gone(session_id)
        if row is not None:
            self.remove_blob(row)
        self.drop_unreferenced_chunks()

    def forget_chunks(self, chunks: list[ChunkRow]) -> None:
        """Delete these chunks' rows, then their files (only a file a row names rightly)."""
        self.store.delete_chunks([c.key for c in chunks])
        for chunk in chunks:
            if chunk_row_problem(chunk) is None:
                self._remove(self.chunk_path(chunk.key))

    def unreferenced_chunks(self) -> list[ChunkRow]:
        """Chunks that no snapshot's chain uses any more (current or shelved).

        Worked out here from parsed rows rather than with SQLite's ``json_each`` (which
        fails on the whole query when one row's ``chunk_keys`` is not JSON). Chunks are
        listed before rows, so a chunk committed with its row meanwhile is never taken for
        unused.
        """
        chunks = self.store.all_chunks()
        used = {
            key
            for row in self.store.snapshots() + self.store.shelved_snapshots()
            if row.format == "chunks"
            for key in row.chunk_keys + window_keys(row)
        }
        return [c for c in chunks if c.key not in used]

    def drop_unreferenced_chunks(self) -> int:
        """Delete chunks no snapshot uses any more; returns bytes freed."""
        unused = self.unreferenced_chunks()
        if not unused:
            return 0
        self.forget_chunks(unused)
        return sum(_count(c.n_bytes) for c in unused)

    def clear(self, session_id: str | None = None) -> int:
        """Delete one session's snapshot, or all of them; returns how many."""
        rows = self.store.snapshots()
        targets = [r for r in rows if session_id is None or r.session_id == session_id]
        for row in targets:
            self.delete(row.session_id)
        return len(targets)

    # --- damage ---------------------------------------------------------------------------

    def row_problem(self, row: SnapshotRow, index: dict[str, ChunkRow] | None = None) -> str | None:
        """Why a snapshot row can never be loaded (checked without reading files), or None.

        A fingerprint of another model is no damage: that snapshot is fine for it.
        """
        if row.damage:
            return f"the snapshot's index row is damaged ({row.damage})"
        if row.n_tokens < 0 or row.n_bytes < 0 or len(row.token_ids) != row.n_tokens:
            return "the snapshot's index row is damaged (negative or mismatched sizes)"
        fingerprint = fingerprint_problem(row.fingerprint)
        if fingerprint is not None:
            return f"the snapshot's fingerprint is damaged ({fingerprint})"
        if row.format == "blob":
            if self.blob_path(row) is None:
                return f"the snapshot row names a file that is not its own ({row.path!r})"
            return None
        if row.layout is None:
            return "chunked snapshot has no layout"
        try:
            kvlayout.check_desc(row.layout)
        except kvlayout.LayoutError as exc:
            return f"the snapshot's layout is damaged: {exc}"
        if row.checksum != fmt.chain_checksum(row.chunk_keys):
            return "snapshot chunk list does not match its index row"
        try:
            verify_chain(row, index or self.store.get_chunks(row.chunk_keys), row.n_tokens)
        except SnapshotRejected as rejected:
            return rejected.reason
        for start, end, key in row.checkpoints:
            if (
                not fmt.valid_key(key)
                or end > row.n_tokens
                or key != window_key(row.fingerprint, row.token_ids, start, end)
            ):
                return "the snapshot's window checkpoint keys do not match its tokens"
        return None

    def drop_damaged(self) -> dict[str, str]:
        """Remove every index row that can never be loaded; returns {session id: why}.

        First chunk rows that are not ours (a key that is not a key, a path that is not the
        key's name, damaged counts: their rows go, no file is touched), then snapshot rows
        with damaged columns, a blob name that is not their session's, a damaged layout, or
        chunk keys that do not derive from their tokens (another session's, or an older key
        scheme's). Then the chunks nobody uses any more. Each dropped session's next restore
        says why its snapshot is gone.
        """
        bad_chunks = [c for c in self.store.all_chunks() if chunk_row_problem(c) is not None]
        if bad_chunks:
            self.store.delete_chunks([c.key for c in bad_chunks])
        dropped: dict[str, str] = {}
        for row in self.store.snapshots():
            problem = self.row_problem(row)
            if problem is None:
                continue
            self.store.delete_snapshot(row.session_id)
            self.remove_blob(row)
            self.mark_gone(row.session_id, {"why": "damaged", "detail": problem})
            dropped[row.session_id] = problem
        self.drop_unreferenced_chunks()
        return dropped

    # --- why a snapshot is gone -----------------------------------------------------------

    def mark_gone(self, session_id: str, why: dict[str, object]) -> None:
        self.store.set_meta(GONE_KEY.format(session_id), json.dumps(why))

    def clear_gone(self, session_id: str) -> None:
        """A new snapshot (or an explicit delete): the old reason no longer holds."""
        self.store.delete_meta(GONE_KEY.format(session_id))

    def gone_reason(self, session_id: str) -> str | None:
        """Why the session has no snapshot although it had one (evicted, dropped), or None."""
        text = self.store.get_meta(GONE_KEY.format(session_id))
        if not text:
            return None
        try:
            why = json.loads(text)
        except ValueError:
            return None
        if not isinstance(why, dict):
            return None
        if why.get("why") == "budget":
            return (
                "its snapshot was evicted to keep the disk budget "
                f"({gib(_count(why.get('budget_bytes')))})"
            )
        if why.get("why") == "damaged":
            return f"its snapshot was removed as damaged ({why.get('detail')})"
        return None

    # --- the budget -----------------------------------------------------------------------

    def disk_bytes(self) -> int:
        """Bytes of snapshot data on disk (each shared chunk counted once)."""
        blobs = sum(_count(r.n_bytes) for r in self.store.snapshots() if r.format == "blob")
        return blobs + sum(_count(c.n_bytes) for c in self.store.all_chunks())

    def snapshot_bytes(self, row: SnapshotRow) -> int:
        """Bytes on disk of one snapshot alone (a chain's chunks, shared or not)."""
        if row.format == "blob":
            return _count(row.n_bytes)
        keys = set(row.chunk_keys) | set(window_keys(row))
        index = self.store.get_chunks(list(keys))
        return sum(_count(index[key].n_bytes) for key in keys if key in index)

    def enforce_budget(
        self,
        budget_bytes: int | None,
        keep: str | None = None,
        hold: Callable[[str], AbstractContextManager[None]] | None = None,
    ) -> list[str]:
        """Evict least recently used snapshots (never ``keep``, never a reading the document
        library pins) until ``budget_bytes`` holds, those shelved for other settings first.
        With ``hold`` (a session's turn lock, tried once), a session is evicted only while
        holding it: one with a turn running is skipped.

        Each evicted session's next restore says it was evicted, and for what budget.
        """
        if budget_bytes is None:
            return []
        evicted: list[str] = []
        used = self.disk_bytes()
        # Snapshots kept for other settings go first (least recently used first).
        for row in self.store.shelved_snapshots():
            if used <= budget_bytes:
                return evicted
            self.store.delete_shelved(row.session_id, row.fingerprint)
            self.drop_unreferenced_chunks()
            used = self.disk_bytes()
        pinned = self.store.pinned_sessions()
        for row in self.store.snapshots():
            if used <= budget_bytes:
                break
            if row.session_id == keep or row.session_id in pinned:
                continue
            try:
                with hold(row.session_id) if hold is not None else nullcontext():
                    self.delete(row.session_id)
                    self.mark_gone(row.session_id, {"why": "budget", "budget_bytes": budget_bytes})
            except SessionBusy:
                continue  # a turn is running on it: its snapshot is in use
            evicted.append(row.session_id)
            used = self.disk_bytes()
        return evicted

    def over_budget_note(self, budget_bytes: int | None) -> str | None:
        """A line for ``kvchat cache`` when the snapshots on disk exceed the budget, or None.

        Names the case where one snapshot alone is larger than the budget: it is kept while
        its session is in use, so every turn of that session goes over the budget.
        """
        if budget_bytes is None:
            return None
        used = self.disk_bytes()
        if used <= budget_bytes:
            return None
        rows = self.store.snapshots()
        pinned = self.store.pinned_sessions()
        kept = sum(self.snapshot_bytes(r) for r in rows if r.session_id in pinned)
        if kept > budget_bytes:
            return (
                f"the document library's readings use {kept / 2**20:.1f} MiB, more than the "
                f"disk budget ({gib(budget_bytes)}): they are never evicted; `kvchat docs rm` "
                "frees them, or raise disk_cache_gib"
            )
        sizes = [(self.snapshot_bytes(r), r.session_id) for r in rows if r.session_id not in pinned]
        largest, session_id = max(sizes, default=(0, ""))
        if largest > budget_bytes:
            return (
                f"the snapshot of session {session_id} ({largest / 2**20:.1f} MiB) is larger "
                f"than the disk budget ({gib(budget_bytes)}): it is kept while that session "
                "is in use, so the budget is exceeded; raise disk_cache_gib to keep it"
            )
        return (
            f"snapshots use {used / 2**20:.1f} MiB, over the disk budget "
            f"({gib(budget_bytes)}); `kvchat cache gc` evicts the least recently used"
        )

    # --- orphans --------------------------------------------------------------------------

    def _our_names(self) -> tuple[set[str], set[str]]:
        """Blob names rows point to rightly, and chunk keys with a row."""
        blobs = {r.path for r in self.store.snapshots() if r.format == "blob" and self.blob_path(r)}
        chunks = {c.key for c in self.store.all_chunks() if fmt.valid_key(c.key)}
        return blobs, chunks

    def cleanup_orphans(self) -> list[str]:
        """Remove temp files of dead writers and files no row points to.

        Looks only at names kvchat writes: ``<session>-<stamp>.kvs`` in the snapshot
        directory, ``<key[:2]>/<key>.kvc`` in the chunk directory, and their
        ``.<pid>.tmp`` temp files. Never follows a symlink; ignores everything else.
        """
        if self.disabled is not None:
            return []
        blobs, chunks = self._our_names()
        removed: list[str] = []
        now = time.time()

        def consider(directory: Path, name: str, referenced: bool) -> None:
            path = directory / name
            info = regular_file(path)
            if info is None:
                return
            if name.endswith(".tmp"):
                if temp_writer_alive(name):
                    return
            elif referenced or now - info.st_mtime < ORPHAN_GRACE_S:
                return
            if remove_file(path):
                removed.append(name)

        for entry in entries(self.directory):
            name = entry.name
            temp = fmt.TEMP_NAME.fullmatch(name)
            final = temp["final"] if temp else name
            if fmt.BLOB_NAME.fullmatch(final):
                consider(self.directory, name, temp is None and name in blobs)
        if dir_problem(self.chunk_dir) is not None:
            return removed
        for sub in entries(self.chunk_dir):
            if not fmt.CHUNK_SUBDIR.fullmatch(sub.name) or not _real_dir(sub):
                continue
            for entry in entries(Path(sub.path)):
                name = entry.name
                temp = fmt.TEMP_NAME.fullmatch(name)
                match = fmt.CHUNK_FILE.fullmatch(temp["final"] if temp else name)
                if match is None or not match["key"].startswith(sub.name):
                    continue
                consider(Path(sub.path), name, temp is None and match["key"] in chunks)
        return removed


def _real_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return False
