"""The cold tier: snapshot files on disk, indexed in SQLite.

Two formats. **Chunks** (the default): the seq state is cut into token ranges of
``chunk_tokens`` cells (see :mod:`kvchat.kvcache.layout`); keys and cuts come from
:mod:`kvchat.kvcache.chunking`, so any prefix that sessions, forks and regenerations
share is stored once, and a turn writes only the chunks that are new. **Blob**: the
whole state in one file, used when the layout parser does not recognise the bytes.

Files are written atomically (:mod:`kvchat.kvcache.files`) in the formats of
:mod:`kvchat.kvcache.format`, and only then are the rows committed, so a crash leaves
the old snapshot or the new one, never a row pointing at a broken file. Deleting,
budgets and orphans are :mod:`kvchat.kvcache.housekeeping`'s. Data dir 0700, files 0600.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from kvchat.engine import Engine
from kvchat.kvcache import chunking
from kvchat.kvcache import files as kvfiles
from kvchat.kvcache import format as fmt
from kvchat.kvcache import layout as kvlayout
from kvchat.kvcache.chunking import CHUNK_TOKENS, MIN_DONOR_TOKENS
from kvchat.kvcache.errors import SnapshotRejected
from kvchat.kvcache.files import STALL_ENV
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.kvcache.housekeeping import ORPHAN_GRACE_S, Housekeeper
from kvchat.store import ChunkRow, SnapshotRow, Store

__all__ = [
    "CHUNK_TOKENS",
    "MIN_DONOR_TOKENS",
    "ORPHAN_GRACE_S",
    "STALL_ENV",
    "RestoreResult",
    "SaveResult",
    "SnapshotRejected",
    "SnapshotStore",
]

Source = Literal["hot", "ram", "disk", "none"]


@dataclass
class RestoreResult:
    """How the session was made hot, for the turn report."""

    source: Source
    ms: float = 0.0
    bytes: int = 0
    tokens: int = 0
    reason: str | None = None
    # Set when the KV came from another session sharing this one's prefix (a fork, an edit).
    donor: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "from": self.source,
            "ms": round(self.ms, 2),
            "bytes": self.bytes,
            "tokens": self.tokens,
            "reason": self.reason,
            "donor": self.donor,
        }


@dataclass
class SaveResult:
    row: SnapshotRow
    bytes_written: int
    chunks_written: int = 0
    chunks_shared: int = 0
    evicted: list[str] = field(default_factory=list)


class SnapshotStore:
    """Saves and restores sessions' KV on disk, within a byte budget."""

    def __init__(
        self,
        directory: Path,
        store: Store,
        *,
        chunk_tokens: int = CHUNK_TOKENS,
        budget_bytes: int | None = None,
        chunked: bool = True,
    ) -> None:
        self.directory = directory
        self.chunk_dir = directory / "chunks"
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.budget_bytes = budget_bytes
        self.chunked = chunked
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvchat-chunks")
        self._housekeeper = Housekeeper(directory, self.chunk_dir, store)
        for path in (directory, self.chunk_dir):
            kvfiles.private_dir(path)

    # --- save -----------------------------------------------------------------------------

    def save(self, session_id: str, engine: Engine, fingerprint: Fingerprint) -> SaveResult:
        """Snapshot the context as ``session_id``'s KV, replacing its previous snapshot."""
        tokens = engine.tokens
        state = engine.state_get()
        previous = self.store.get_snapshot(session_id)
        layout = self._parse(engine, state) if self.chunked else None
        if layout is not None:
            result = self._save_chunks(session_id, tokens, state, layout, fingerprint)
        else:
            result = self._save_blob(session_id, tokens, state, fingerprint)
        if previous is not None and previous.format == "blob" and previous.path != result.row.path:
            (self.directory / previous.path).unlink(missing_ok=True)
        self.drop_unreferenced_chunks()
        result.evicted = self.enforce_budget(keep=session_id)
        self.store.bump_counters(bytes_written=result.bytes_written)
        return result

    @staticmethod
    def _parse(engine: Engine, state: memoryview) -> kvlayout.StateLayout | None:
        shape = engine.kv_shape()
        if shape is None:
            return None
        try:
            return kvlayout.parse(state, *shape)
        except kvlayout.LayoutError:
            return None

    def _save_blob(
        self, session_id: str, tokens: list[int], state: memoryview, fingerprint: Fingerprint
    ) -> SaveResult:
        parts, digest = fmt.blob_parts(session_id, fingerprint.to_dict(), tokens, state)
        name = fmt.blob_name(session_id)
        written = kvfiles.write_atomically(self.directory / name, parts)
        row = SnapshotRow(
            session_id=session_id,
            path=name,
            n_tokens=len(tokens),
            token_ids=tokens,
            fingerprint=fingerprint.to_dict(),
            n_bytes=len(state),
            checksum=digest,
        )
        self.store.put_snapshot(row)
        return SaveResult(row, written)

    def chunk_plan(
        self, fingerprint: Fingerprint, tokens: list[int], base: list[int]
    ) -> list[tuple[int, int, str]]:
        """(start, end, key) of every chunk of ``tokens``; see :func:`chunking.chunk_plan`.

        ``base`` lists chunk ends already stored for a prefix of ``tokens`` (the previous
        snapshot's, or the donor's): they are kept, so what a turn appends becomes new
        chunks and nothing stored is rewritten. After them, chunks end on multiples of
        ``chunk_tokens`` (so unrelated sessions cut shared prefixes alike), plus a tail.
        """
        return chunking.chunk_plan(fingerprint, tokens, base, self.chunk_tokens)

    def _save_chunks(
        self,
        session_id: str,
        tokens: list[int],
        state: memoryview,
        layout: kvlayout.StateLayout,
        fingerprint: Fingerprint,
    ) -> SaveResult:
        data = np.frombuffer(state, dtype=np.uint8)
        base = chunking.base_ends(self.store, session_id, tokens, fingerprint, max(len(tokens), 1))
        plan = self.chunk_plan(fingerprint, tokens, base)
        known = self.store.get_chunks([key for _, _, key in plan])
        new_rows: list[ChunkRow] = []
        written = shared = 0
        for start, end, key in plan:
            existing = known.get(key)
            if existing is not None and (self.chunk_dir / existing.path).is_file():
                shared += 1
                continue
            chunk = kvlayout.extract(data, layout, start, end)
            parts, digest = fmt.chunk_parts(key, start, end, chunk)
            name = fmt.chunk_name(key)
            (self.chunk_dir / key[:2]).mkdir(mode=0o700, exist_ok=True)
            written += kvfiles.write_atomically(self.chunk_dir / name, parts)
            new_rows.append(ChunkRow(key, name, start, end - start, len(chunk), digest))
        keys = [key for _, _, key in plan]
        row = SnapshotRow(
            session_id=session_id,
            path="",
            n_tokens=len(tokens),
            token_ids=tokens,
            fingerprint=fingerprint.to_dict(),
            n_bytes=len(state),
            checksum=fmt.chain_checksum(keys),
            format="chunks",
            chunk_keys=keys,
            layout=layout.describe(),
        )
        self.store.put_snapshot(row, new_rows)
        return SaveResult(row, written, chunks_written=len(new_rows), chunks_shared=shared)

    # --- restore --------------------------------------------------------------------------

    def restore(
        self,
        session_id: str,
        engine: Engine,
        fingerprint: Fingerprint,
        prompt: list[int] | None = None,
    ) -> RestoreResult:
        """Load the session's own snapshot; without one, the longest prefix another has.

        Never raises for a bad snapshot: the result carries the reason instead, and the
        context is left empty for a full prefill.
        """
        started = time.perf_counter()
        try:
            row, keep = self._pick(session_id, fingerprint, prompt, engine.n_ctx)
            self._load(row, engine, keep)
        except SnapshotRejected as rejected:
            engine.clear()
            self.store.bump_counters(restore_misses=1)
            return RestoreResult("none", reason=rejected.reason)
        elapsed = (time.perf_counter() - started) * 1000
        n_bytes = engine.state_size() if keep != row.n_tokens else row.n_bytes
        self.store.touch_snapshot(row.session_id)
        self.store.bump_counters(restores_disk=1, tokens_restored=keep, bytes_restored=n_bytes)
        donor_id = row.session_id if row.session_id != session_id else None
        return RestoreResult("disk", ms=elapsed, bytes=n_bytes, tokens=keep, donor=donor_id)

    def _pick(
        self, session_id: str, fingerprint: Fingerprint, prompt: list[int] | None, n_ctx: int
    ) -> tuple[SnapshotRow, int]:
        """The row to load and how many of its tokens to keep, if it fits this context."""
        row = self.store.get_snapshot(session_id)
        if row is None:
            donor = chunking.best_donor(self.store, session_id, fingerprint, prompt, n_ctx)
            if donor is None:
                raise SnapshotRejected("no snapshot saved for this session yet")
            row, keep = donor
        else:
            keep = row.n_tokens
        reason = fingerprint.mismatch(row.fingerprint)
        if reason is not None:
            raise SnapshotRejected(reason)
        if keep > n_ctx:
            raise SnapshotRejected(f"snapshot holds {keep} tokens but n_ctx is {n_ctx}")
        return row, keep

    def _load(self, row: SnapshotRow, engine: Engine, keep: int) -> None:
        if row.format == "chunks":
            self._load_chunks(row, engine, keep)
        else:
            self._load_blob(row, engine)

    def _load_blob(self, row: SnapshotRow, engine: Engine) -> None:
        """Map, verify and load one blob file."""
        path = self.directory / row.path
        with kvfiles.mapped(path) as mapped:
            state = fmt.read_blob(mapped, row, path.name)
            try:
                pointer = ctypes.cast(state.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
                if not engine.state_set(pointer, row.n_bytes, row.token_ids):
                    raise SnapshotRejected("llama.cpp rejected the snapshot state")
            finally:
                del state

    def _load_chunks(self, row: SnapshotRow, engine: Engine, keep: int) -> None:
        """Verify the chain's chunks covering the first ``keep`` tokens, reassemble, load."""
        if row.layout is None:
            raise SnapshotRejected("chunked snapshot has no layout")
        if row.checksum != fmt.chain_checksum(row.chunk_keys):
            raise SnapshotRejected("snapshot chunk list does not match its index row")
        index = self.store.get_chunks(row.chunk_keys)
        needed: list[tuple[ChunkRow, int]] = []
        covered = 0
        for key in row.chunk_keys:
            if covered >= keep:
                break
            entry = index.get(key)
            if entry is None:
                raise SnapshotRejected(f"snapshot chunk {key[:12]} is missing from the index")
            needed.append((entry, covered))
            covered += entry.n_tokens
        out = engine.state_buffer(kvlayout.layout_for(row.layout, keep).total)
        view = np.frombuffer(out, dtype=np.uint8)
        try:
            assembler = kvlayout.Assembler(view, row.layout, keep)
            with _ChunkSet() as chunks:

                def verify_and_place(entry: ChunkRow, start: int) -> int:
                    data = chunks.open(self.chunk_dir / entry.path, entry, start)
                    return assembler.place(data, start)

                # Two workers: numpy's copies release the GIL, so chunks land in parallel.
                futures = [self._workers.submit(verify_and_place, *item) for item in needed]
                wait(futures)
            placed = 0
            bad: list[tuple[ChunkRow, SnapshotRejected]] = []
            for (entry, _), future in zip(needed, futures):
                try:
                    placed += future.result()
                except SnapshotRejected as rejected:
                    bad.append((entry, rejected))
            if bad:
                # Forget the broken chunks, so the next save writes them again instead of
                # sharing them; any other chain using them falls back the same way.
                self._housekeeper.forget_chunks([entry for entry, _ in bad])
                raise bad[0][1]
            size = assembler.finish(placed)
        except kvlayout.LayoutError as exc:
            raise SnapshotRejected(f"snapshot chunks do not fit together: {exc}") from None
        finally:
            del view
        if not engine.state_set(out, size, row.token_ids[:keep]):
            raise SnapshotRejected("llama.cpp rejected the reassembled snapshot state")

    # --- housekeeping (see kvchat.kvcache.housekeeping) -----------------------------------

    def files(self, row: SnapshotRow) -> list[Path]:
        """The files holding a snapshot's data."""
        return self._housekeeper.files(row)

    def delete(self, session_id: str) -> None:
        """Forget a session's snapshot (its text is untouched)."""
        self._housekeeper.delete(session_id)

    def drop_unreferenced_chunks(self) -> int:
        """Delete chunks no snapshot uses any more; returns bytes freed."""
        return self._housekeeper.drop_unreferenced_chunks()

    def disk_bytes(self) -> int:
        """Bytes of snapshot data on disk (each shared chunk counted once)."""
        return self._housekeeper.disk_bytes()

    def enforce_budget(self, keep: str | None = None) -> list[str]:
        """Evict least recently used snapshots until the disk budget holds; never text."""
        return self._housekeeper.enforce_budget(self.budget_bytes, keep)

    def clear(self, session_id: str | None = None) -> int:
        """Delete one session's snapshot, or all of them; returns how many."""
        return self._housekeeper.clear(session_id)

    def cleanup_orphans(self) -> list[str]:
        """Remove temp files of dead writers and files no row points to."""
        return self._housekeeper.cleanup_orphans()


class _ChunkSet:
    """Maps and verifies chunk files one at a time; unmaps them all on exit."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []

    def __enter__(self) -> _ChunkSet:
        return self

    def __exit__(self, *exc: object) -> None:
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a view still alive (an exception's frame): GC unmaps it
                pass

    def open(self, path: Path, entry: ChunkRow, start: int) -> np.ndarray:
        """The chunk's verified bytes (checksum read leaves them in cache)."""
        mapped = kvfiles.map_file(path, f"chunk {path.name}")
        self._maps.append(mapped)
        return fmt.read_chunk(mapped, entry, start, path.name)
