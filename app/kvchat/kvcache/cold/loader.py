"""Loading snapshots into the engine: a blob (mapped, verified, loaded) or a chain of chunks.

Chunks go one at a time into the engine when it can append a state piece by piece (the
KV in host memory): each is read, verified and copied into the KV cache while it is still
in the CPU's cache. Otherwise (a GPU, a sliding-window model's window section appended)
each is read straight into one whole state buffer, verified as it arrives, on two
threads, and the whole state is loaded. Both by :mod:`kvchat.kvcache.cold.chunk_reader`. A bad
chunk is forgotten, so the next save writes it again. See
:mod:`kvchat.kvcache.cold.snapshot_store`."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from kvchat.engine import SeqStateEngine
from kvchat.kvcache import defects
from kvchat.kvcache.cold import chains as chunking
from kvchat.kvcache.cold import checkpoints as windows
from kvchat.kvcache.cold import files as kvfiles
from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.chunk_reader import ChunkReader, PieceReader
from kvchat.kvcache.cold.housekeeper import Housekeeper, chunk_row_problem
from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.store import ChunkRow, SnapshotRow, Store


class SnapshotLoader:
    """Loads a snapshot row's data into an engine, or raises :class:`SnapshotRejected`."""

    def __init__(
        self, chunk_dir: Path, store: Store, housekeeper: Housekeeper, workers: ThreadPoolExecutor
    ) -> None:
        self.chunk_dir = chunk_dir
        self.store = store
        self._housekeeper = housekeeper
        self._workers = workers
        self._pieces: PieceReader | None = None

    def load(
        self,
        row: SnapshotRow,
        engine: SeqStateEngine,
        keep: int,
        window: windows.WindowPoint | None,
    ) -> None:
        if row.format == "chunks":
            self._load_chunks(row, engine, keep, window)
        else:
            self._load_blob(row, engine)

    def _load_blob(self, row: SnapshotRow, engine: SeqStateEngine) -> None:
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
        self,
        row: SnapshotRow,
        engine: SeqStateEngine,
        keep: int,
        window: windows.WindowPoint | None,
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
        if window is None and engine.capabilities.appends_state:
            self._append_chunks(row, engine, keep, needed)
            return
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
        engine: SeqStateEngine,
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
            reader = ChunkReader(view, assembler.layout)
            with _ChunkSet() as chunks:

                def verify_and_place(entry: ChunkRow, start: int) -> int:
                    path = self.chunk_dir / fmt.chunk_name(entry.key)
                    placed = reader.read(path, entry, start)
                    if placed is not None:
                        return placed
                    # Not a chunk the direct reader takes (cut short, or not as its row
                    # says): mapped, checked field by field, copied into place.
                    data = chunks.open(path, entry, start)
                    try:
                        return assembler.place(data, start)
                    except (ValueError, TypeError, IndexError, struct.error) as exc:
                        raise kvlayout.LayoutError(str(exc)) from None

                # Two workers: reads, checksums and numpy's copies release the GIL.
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
            if defects.planted("dropped-chunk"):  # test-only: see defects.py
                defects.zero_cells(view, assembler.layout, needed[-1][1], keep - needed[-1][1])
            size = assembler.finish(placed) + extra
        except kvlayout.LayoutError as exc:
            raise SnapshotRejected(f"snapshot chunks do not fit together: {exc}") from None
        finally:
            del view
        if not engine.state_set(out, size, row.token_ids[:keep]):
            raise SnapshotRejected("llama.cpp rejected the reassembled snapshot state")

    def _append_chunks(
        self,
        row: SnapshotRow,
        engine: SeqStateEngine,
        keep: int,
        needed: list[tuple[ChunkRow, int]],
    ) -> None:
        """Load the chain one chunk at a time, each read, verified and handed to llama.cpp
        while it is still in the CPU's cache (see :class:`PieceReader`). Nothing unverified
        reaches llama.cpp; a bad chunk leaves the context empty."""
        assert row.layout is not None
        reader = self._pieces
        if reader is None or reader.layout_desc != row.layout:
            reader = self._pieces = PieceReader(row.layout)
        loaded = False
        engine.clear()
        try:
            with _ChunkSet() as chunks:
                for entry, start in needed:
                    path = self.chunk_dir / fmt.chunk_name(entry.key)
                    try:
                        piece = reader.read(path, entry, start)
                        if piece is None:  # mapped, checked field by field, copied
                            data = chunks.open(path, entry, start)
                            piece = reader.piece(entry.n_tokens)
                            piece.fill(data)
                    except SnapshotRejected:
                        self._housekeeper.forget_chunks([entry])
                        raise
                    if defects.planted("dropped-chunk") and start == needed[-1][1]:  # test-only
                        defects.zero_payload(piece.targets[1:])
                    if not engine.state_append(reader.pointer, piece.size, keep):
                        raise SnapshotRejected("llama.cpp rejected a snapshot chunk")
            if not engine.state_adopt(row.token_ids[:keep]):
                raise SnapshotRejected("the snapshot's chunks do not hold its tokens' positions")
            loaded = True
        except kvlayout.LayoutError as exc:
            raise SnapshotRejected(f"snapshot chunks do not fit together: {exc}") from None
        finally:
            if not loaded:
                engine.clear()

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
