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

File names derive from keys (the session id, a chunk key), never from a stored path. The
snapshot directory and its ``chunks/`` directory are used only when each is a real
directory (created 0700 when missing, never chmod-ed when present): a symlink or a file in
their place disables snapshots, with the reason, and the chat goes on with full prefills.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvchat.engine import Engine
from kvchat.kvcache import chunking, windows
from kvchat.kvcache import files as kvfiles
from kvchat.kvcache import format as fmt
from kvchat.kvcache import layout as kvlayout
from kvchat.kvcache.chunking import CHUNK_TOKENS, MIN_DONOR_TOKENS
from kvchat.kvcache.errors import SnapshotRejected, SnapshotsUnavailable
from kvchat.kvcache.files import STALL_ENV
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.kvcache.housekeeping import ORPHAN_GRACE_S, Housekeeper, chunk_row_problem
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
    "SnapshotsUnavailable",
]

Source = Literal["hot", "ram", "disk", "server", "none"]


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
    # Set when the snapshots on disk still exceed the budget (see over_budget_note).
    over_budget: str | None = None
    # Why the state was stored whole (one blob) instead of in chunks, or None.
    whole_reason: str | None = None
    checkpoints_written: int = 0


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
        # Why snapshots are off (the directory is a symlink, a file, can't be made), or None.
        self.disabled: str | None = kvfiles.prepare_dir(directory) or kvfiles.prepare_dir(
            self.chunk_dir
        )
        self._housekeeper = Housekeeper(directory, self.chunk_dir, store, self.disabled)

    # --- save -----------------------------------------------------------------------------

    def save(self, session_id: str, engine: Engine, fingerprint: Fingerprint) -> SaveResult:
        """Snapshot the context as ``session_id``'s KV, replacing its previous snapshot.

        Raises :class:`SnapshotsUnavailable` (an OSError) when snapshots are disabled.
        """
        if self.disabled is not None:
            raise SnapshotsUnavailable(f"snapshots are disabled: {self.disabled}")
        if not fmt.valid_session_id(session_id):
            raise SnapshotsUnavailable(f"not a session id kvchat makes: {session_id!r}")
        tokens = engine.tokens
        state = engine.state_get()
        previous = self.store.get_snapshot(session_id)
        taker = getattr(engine, "take_checkpoints", None)
        pending = taker() if taker is not None else []
        if self.chunked:
            layout, why = self._parse(engine, state)
        else:
            layout, why = None, None  # whole by the user's choice (snapshot_chunks = false)
        if layout is not None:
            result = self._save_chunks(
                session_id, tokens, state, layout, fingerprint, engine, pending
            )
        else:
            result = self._save_blob(session_id, tokens, state, fingerprint)
            result.whole_reason = why
        self._housekeeper.clear_gone(session_id)
        if previous is not None and previous.path != result.row.path:
            self._housekeeper.remove_blob(previous)
        self.drop_unreferenced_chunks()
        result.evicted = self.enforce_budget(keep=session_id)
        result.over_budget = self.over_budget_note()
        self.store.bump_counters(bytes_written=result.bytes_written)
        return result

    @staticmethod
    def _parse(engine: Engine, state: memoryview) -> tuple[kvlayout.StateLayout | None, str | None]:
        """The state's layout, or None and why it is stored whole."""
        problem = getattr(engine, "chunk_problem", None)
        why = problem() if problem is not None else None
        if why:
            return None, why
        spec_of = getattr(engine, "kv_spec", None)
        spec = spec_of() if spec_of is not None else None
        shape = engine.kv_shape() if spec is None else None
        if spec is None and shape is None:
            return None, "the model's layers keep KV of different sizes and no spec says which"
        try:
            if spec is not None:
                return kvlayout.parse(state, spec=spec), ""
            assert shape is not None
            return kvlayout.parse(state, *shape), ""
        except kvlayout.LayoutError as exc:
            return None, f"llama.cpp's state is not a layout kvchat can cut ({exc})"

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
        engine: Engine | None = None,
        pending: list[tuple[int, Any]] | None = None,
    ) -> SaveResult:
        data = np.frombuffer(state, dtype=np.uint8)
        base = chunking.base_ends(self.store, session_id, tokens, fingerprint, max(len(tokens), 1))
        plan = self.chunk_plan(fingerprint, tokens, base)
        known = self.store.get_chunks([key for _, _, key in plan])
        new_rows: list[ChunkRow] = []
        written = shared = 0
        subdir_problems: dict[str, str | None] = {}
        for start, end, key in plan:
            existing = known.get(key)
            path = self.chunk_dir / fmt.chunk_name(key)
            if key[:2] not in subdir_problems:
                subdir_problems[key[:2]] = kvfiles.prepare_dir(path.parent)
            if (
                existing is not None
                and chunk_row_problem(existing) is None
                and (existing.start, existing.n_tokens) == (start, end - start)
                and subdir_problems[key[:2]] is None
                and kvfiles.regular_file(path) is not None
            ):
                shared += 1
                continue
            chunk = kvlayout.extract(data, layout, start, end)
            parts, digest = fmt.chunk_parts(key, start, end, chunk)
            name = fmt.chunk_name(key)
            problem = subdir_problems[key[:2]]
            if problem is None and os.path.lexists(path) and kvfiles.regular_file(path) is None:
                problem = f"{path} is in the way (not a file kvchat wrote)"
            if problem is not None:
                raise SnapshotsUnavailable(f"cannot write snapshot chunks: {problem}")
            written += kvfiles.write_atomically(path, parts)
            new_rows.append(ChunkRow(key, name, start, end - start, len(chunk), digest))
        keys = [key for _, _, key in plan]
        checkpoints: list[list[object]] = []
        written_windows = 0
        if layout.swa is not None:
            assert engine is not None
            checkpoints, window_rows, window_bytes = self._save_windows(
                session_id, tokens, data, layout, fingerprint, engine, pending or [], known
            )
            new_rows += window_rows
            written += window_bytes
            written_windows = len(window_rows)
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
            checkpoints=checkpoints,
        )
        self.store.put_snapshot(row, new_rows)
        return SaveResult(
            row,
            written,
            chunks_written=len(new_rows) - written_windows,
            chunks_shared=shared,
            checkpoints_written=written_windows,
        )

    def _save_windows(
        self,
        session_id: str,
        tokens: list[int],
        data: np.ndarray,
        layout: kvlayout.StateLayout,
        fingerprint: Fingerprint,
        engine: Engine,
        pending: list[tuple[int, Any]],
        known: dict[str, ChunkRow],
    ) -> tuple[list[list[object]], list[ChunkRow], int]:
        """Write the window cells of a sliding-window state (see :mod:`windows`): those of
        the state's end and of the checkpoints the engine took while decoding, as grid
        pieces, each written once; keep the pieces of the chain this one continues.
        Returns the row's piece list, the new chunk rows and the bytes written."""
        fp = fingerprint.to_dict()
        assert layout.swa is not None
        spec = kvlayout.swa_spec(layout.describe())
        assert spec is not None
        n = len(tokens)
        sections: list[tuple[int, np.ndarray, kvlayout.StateLayout]] = []
        end_section = data[layout.swa.offset : layout.total]
        try:
            parsed = kvlayout.parse_section(memoryview(end_section), spec, n, header=False)
            sections.append((n, end_section, parsed))
        except kvlayout.LayoutError:
            pass
        for position, partial in pending:
            if position > n:
                continue
            body = np.frombuffer(partial, dtype=np.uint8)[8:]
            try:
                parsed = kvlayout.parse_section(memoryview(body), spec, position, header=False)
            except kvlayout.LayoutError:
                continue  # not the window this state's layout has: leave it out
            sections.append((position, body, parsed))
        pieces: dict[str, windows.Piece] = {
            p.key: p for p in self._inherited_windows(session_id, tokens, fingerprint)
        }
        fresh: dict[str, tuple[windows.Piece, np.ndarray]] = {}
        # The furthest first: a cell some piece already holds is not written again.
        for position, body, parsed in sorted(sections, key=lambda item: -item[0]):
            for start, end in windows.grid(parsed.first_pos, position):
                if windows.cover(list(pieces.values()), start, end) is not None:
                    continue
                first = parsed.first_pos
                cells = kvlayout.extract(body, parsed, start - first, end - first)
                key = chunking.window_key(fp, tokens, start, end)
                piece = windows.Piece(start, end, key)
                pieces[key] = piece
                fresh[key] = (piece, cells)
        present = self.store.get_chunks(list(fresh))
        new_rows: list[ChunkRow] = []
        written = 0
        for key, (piece, cells) in fresh.items():
            path = self.chunk_dir / fmt.chunk_name(key)
            existing = present.get(key) or known.get(key)
            if (
                existing is not None
                and chunk_row_problem(existing) is None
                and (existing.start, existing.n_tokens) == (piece.start, piece.end - piece.start)
                and kvfiles.regular_file(path) is not None
            ):
                continue
            problem = kvfiles.prepare_dir(path.parent)
            if problem is None and os.path.lexists(path) and kvfiles.regular_file(path) is None:
                problem = f"{path} is in the way (not a file kvchat wrote)"
            if problem is not None:
                raise SnapshotsUnavailable(f"cannot write window checkpoints: {problem}")
            parts, digest = fmt.chunk_parts(key, piece.start, piece.end, cells)
            written += kvfiles.write_atomically(path, parts)
            new_rows.append(
                ChunkRow(
                    key,
                    fmt.chunk_name(key),
                    piece.start,
                    piece.end - piece.start,
                    len(cells),
                    digest,
                )
            )
        listed = sorted(pieces.values(), key=lambda p: (p.start, p.end))
        return [p.to_json() for p in listed], new_rows, written

    def _inherited_windows(
        self, session_id: str, tokens: list[int], fingerprint: Fingerprint
    ) -> list[windows.Piece]:
        """Window pieces of the chain this state continues (its own previous snapshot, else
        the donor it was restored from) that lie within the shared prefix and are stored."""
        fp = fingerprint.to_dict()
        row = self.store.get_snapshot(session_id)
        if row is None or row.damage or row.format != "chunks" or row.fingerprint != fp:
            donor = chunking.best_donor(self.store, session_id, fingerprint, tokens, len(tokens))
            row = donor[0] if donor else None
        if row is None or not row.checkpoints:
            return []
        shared = chunking.common_prefix(row.token_ids, tokens)
        candidates = [
            piece
            for piece in windows.pieces_of(row)
            if piece.end <= shared
            and fmt.valid_key(piece.key)
            and piece.key == chunking.window_key(fp, tokens, piece.start, piece.end)
        ]
        index = self.store.get_chunks([piece.key for piece in candidates])
        return [
            piece
            for piece in candidates
            if piece.key in index and chunk_row_problem(index[piece.key]) is None
        ]

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
            if self.disabled is not None:
                raise SnapshotRejected(f"snapshots are disabled: {self.disabled}")
            row, keep = self._pick(session_id, fingerprint, prompt, engine.n_ctx)
            window = self._window_point(row, keep, prompt, engine)
            if window is not None:
                keep = window.tokens
            self._load(row, engine, keep, window)
        except (SnapshotRejected, OSError) as exc:
            engine.clear()
            self.store.bump_counters(restore_misses=1)
            if isinstance(exc, SnapshotRejected):
                reason = exc.reason
            else:
                reason = f"could not read the snapshot ({exc.strerror or exc})"
            return RestoreResult("none", reason=reason)
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
                gone = self._housekeeper.gone_reason(session_id)
                raise SnapshotRejected(gone or "no snapshot saved for this session yet")
            row, keep = donor
        else:
            keep = row.n_tokens
        if row.damage:
            raise SnapshotRejected(f"the snapshot's index row is damaged ({row.damage})")
        if keep < 0:
            raise SnapshotRejected(f"the snapshot's index row is damaged ({keep} tokens)")
        reason = fingerprint.mismatch(row.fingerprint)
        if reason is not None:
            raise SnapshotRejected(reason)
        if keep > n_ctx:
            raise SnapshotRejected(f"snapshot holds {keep} tokens but n_ctx is {n_ctx}")
        return row, keep

    @staticmethod
    def _window_point(
        row: SnapshotRow, keep: int, prompt: list[int] | None, engine: Engine
    ) -> windows.WindowPoint | None:
        """For a sliding-window chain: the checkpoint to restore at (see
        :func:`windows.choose`). A whole-state snapshot must fit the prompt as it is: its
        window can't be cut back. Raises :class:`SnapshotRejected` saying why not."""
        if row.format == "chunks" and isinstance(row.layout, dict) and "swa" in row.layout:
            windows.check_keys(row)
            return windows.choose(row, keep, prompt, engine)
        if row.format == "blob" and keep == row.n_tokens:
            # A whole state has no checkpoints: it serves any prompt the window reaches.
            target = prompt if prompt is not None else windows.continuation(row.token_ids)
            start = windows.deepest_start(row.token_ids, target)
            floor = windows.restore_floor(engine, row.n_tokens)
            if start < floor:
                raise SnapshotRejected(
                    f"sliding-window model: the snapshot is stored whole ({row.n_tokens:,} "
                    f"tokens) and its window cannot be cut back to token {start:,}"
                )
        return None

    def _load(
        self, row: SnapshotRow, engine: Engine, keep: int, window: windows.WindowPoint | None
    ) -> None:
        if row.format == "chunks":
            self._load_chunks(row, engine, keep, window)
        else:
            self._load_blob(row, engine)

    def _load_blob(self, row: SnapshotRow, engine: Engine) -> None:
        """Map, verify and load one blob file (named by the session id, never by the row)."""
        path = self._housekeeper.blob_path(row)
        if path is None:
            raise SnapshotRejected(
                f"the snapshot row names a file that is not its own ({row.path!r})"
            )
        mapped = kvfiles.map_file(path, path.name)
        with mapped:
            state = fmt.read_blob(mapped, row, path.name)
            try:
                pointer = ctypes.cast(state.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
                if not engine.state_set(pointer, row.n_bytes, row.token_ids):
                    raise SnapshotRejected("llama.cpp rejected the snapshot state")
            finally:
                del state

    def _load_chunks(
        self, row: SnapshotRow, engine: Engine, keep: int, window: windows.WindowPoint | None
    ) -> None:
        """Verify the chain's chunks covering the first ``keep`` tokens, reassemble, load
        (with the window checkpoint ``window`` appended, for a sliding-window chain)."""
        if row.layout is None:
            raise SnapshotRejected("chunked snapshot has no layout")
        if row.checksum != fmt.chain_checksum(row.chunk_keys):
            raise SnapshotRejected("snapshot chunk list does not match its index row")
        # The chunks must be this row's: their keys re-derive from its tokens and fingerprint.
        needed = chunking.verify_chain(row, self.store.get_chunks(row.chunk_keys), keep)
        try:
            target = kvlayout.layout_for(row.layout, keep)
        except kvlayout.LayoutError as exc:
            raise SnapshotRejected(f"the snapshot's layout is damaged: {exc}") from None
        # The chunks hold every cell's bytes, so a layout asking for more than they hold is
        # damaged, and chunk files shorter than their rows say are found before the state
        # buffer is sized: nothing read from the database decides an allocation alone.
        row_bytes = sum(entry.n_bytes for entry, _ in needed)
        if keep * target.per_cell_bytes() > row_bytes:
            self._find_bad_chunk(needed)  # a chunk row that lies about its size, else:
            raise SnapshotRejected("the snapshot's layout does not match its chunks")
        file_bytes = 0
        for subdir in {entry.key[:2] for entry, _ in needed}:
            problem = kvfiles.dir_problem(self.chunk_dir / subdir)
            if problem is not None and os.path.lexists(self.chunk_dir / subdir):
                raise SnapshotRejected(f"snapshot chunks are not readable: {problem}")
        for entry, _ in needed:
            info = kvfiles.regular_file(self.chunk_dir / fmt.chunk_name(entry.key))
            file_bytes += info.st_size if info is not None else 0
        if file_bytes < row_bytes:
            self._find_bad_chunk(needed)
            raise SnapshotRejected("snapshot chunk files do not match their index rows")
        with _ChunkSet() as sections:
            section = self._window_section(row, keep, window, sections)
            extra = len(section) if section is not None else 0
            out = engine.state_buffer(target.total + extra)
            view = np.frombuffer(out, dtype=np.uint8)
            if section is not None:
                view[target.total : target.total + extra] = section
            del section
            self._assemble(row, engine, keep, needed, out, view, extra)

    def _window_section(
        self,
        row: SnapshotRow,
        keep: int,
        window: windows.WindowPoint | None,
        sections: _ChunkSet,
    ) -> np.ndarray | None:
        """The verified window part of the state to restore (None: not a sliding-window
        chain)."""
        if window is None:
            return None
        assert row.layout is not None
        index = self.store.get_chunks([piece.key for piece in window.pieces])
        loaded: list[tuple[windows.Piece, np.ndarray]] = []
        for piece in window.pieces:
            entry = index.get(piece.key)
            if entry is None or chunk_row_problem(entry) is not None:
                raise SnapshotRejected(
                    f"window checkpoint cells {piece.start:,}-{piece.end:,} are missing "
                    "from the index"
                )
            if (entry.start, entry.n_tokens) != (piece.start, piece.end - piece.start):
                raise SnapshotRejected(
                    f"window checkpoint cells {piece.start:,}-{piece.end:,} say they cover "
                    "other positions"
                )
            path = self.chunk_dir / fmt.chunk_name(piece.key)
            try:
                loaded.append((piece, sections.open(path, entry, entry.start)))
            except SnapshotRejected:
                self._housekeeper.forget_chunks([entry])
                raise
        return windows.assemble_window(loaded, row.layout, window.first, keep)

    def _assemble(
        self,
        row: SnapshotRow,
        engine: Engine,
        keep: int,
        needed: list[tuple[ChunkRow, int]],
        out: Any,
        view: np.ndarray,
        extra: int,
    ) -> None:
        """Place the chain's chunks in ``out`` (the window part, ``extra`` bytes, is there
        already) and load the state."""
        assert row.layout is not None
        try:
            assembler = kvlayout.Assembler(view, row.layout, keep)
            with _ChunkSet() as chunks:

                def verify_and_place(entry: ChunkRow, start: int) -> int:
                    path = self.chunk_dir / fmt.chunk_name(entry.key)
                    data = chunks.open(path, entry, start)
                    try:
                        return assembler.place(data, start)
                    except (ValueError, TypeError, IndexError, struct.error) as exc:
                        raise kvlayout.LayoutError(str(exc)) from None

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
            size = assembler.finish(placed) + extra
        except kvlayout.LayoutError as exc:
            raise SnapshotRejected(f"snapshot chunks do not fit together: {exc}") from None
        finally:
            del view
        if not engine.state_set(out, size, row.token_ids[:keep]):
            raise SnapshotRejected("llama.cpp rejected the reassembled snapshot state")

    def _find_bad_chunk(self, needed: list[tuple[ChunkRow, int]]) -> None:
        """Verify each chunk against its row (missing, a symlink, truncated, foreign, a row
        that lies about its size...): the first bad one is forgotten, so the next save
        writes it again, and its reason raised. Returns when every chunk checks out. Runs
        only when the sizes show that something is wrong."""
        with _ChunkSet() as chunks:
            for entry, start in needed:
                try:
                    chunks.open(self.chunk_dir / fmt.chunk_name(entry.key), entry, start)
                except SnapshotRejected:
                    self._housekeeper.forget_chunks([entry])
                    raise

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
        """Evict least recently used snapshots until the disk budget holds; never text.

        Without ``keep`` (a full pass, as ``kvchat cache gc`` runs it) damaged rows are
        dropped first (:meth:`drop_damaged`); they are not in the returned list.
        """
        if keep is None:
            self.drop_damaged()
        return self._housekeeper.enforce_budget(self.budget_bytes, keep)

    def drop_damaged(self) -> dict[str, str]:
        """Remove every snapshot row that can never be loaded; returns {session id: why}.

        Damaged columns, a path that is not the session's own file name, a damaged layout,
        chunk keys that do not derive from the row's tokens (another session's, or an older
        key scheme's), chunk rows that are not ours. No file is read; only files whose names
        kvchat derives from keys are removed. Each session's next restore says why.
        """
        return self._housekeeper.drop_damaged()

    def over_budget_note(self) -> str | None:
        """A line for ``kvchat cache`` when the snapshots on disk exceed the disk budget (in
        particular when one session's snapshot alone is larger than it), else None."""
        return self._housekeeper.over_budget_note(self.budget_bytes)

    def disk_stats(self) -> dict[str, object]:
        """Figures ``kvchat cache`` can add to its disk line: ``over_budget`` (a note or None),
        ``damaged`` (rows that can never be loaded; ``cache gc`` removes them) and
        ``disabled`` (why snapshots are off, or None)."""
        damaged = 0
        for row in self.store.snapshots():
            if self._housekeeper.row_problem(row) is not None:
                damaged += 1
        return {
            "over_budget": self.over_budget_note(),
            "damaged": damaged,
            "disabled": self.disabled,
        }

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
