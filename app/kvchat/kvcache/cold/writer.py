"""Writing snapshots: a state whole (a blob) or as chunks of a chain (each written once, by
key), with a sliding-window model's window pieces. Files first, then the index rows. See
:mod:`kvchat.kvcache.cold.snapshot_store`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from kvchat.engine import SeqStateEngine, common_prefix
from kvchat.kvcache.cold import chains as chunking
from kvchat.kvcache.cold import checkpoints as windows
from kvchat.kvcache.cold import files as kvfiles
from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.housekeeper import chunk_row_problem
from kvchat.kvcache.fingerprint import Fingerprint
from kvchat.kvcache.rejected import SnapshotsUnavailable
from kvchat.kvcache.results import SaveResult
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.store import ChunkRow, SnapshotRow, Store


class SnapshotWriter:
    """Writes one state as a blob in ``directory`` or as chunks in ``chunk_dir``."""

    def __init__(self, directory: Path, chunk_dir: Path, store: Store, chunk_tokens: int) -> None:
        self.directory = directory
        self.chunk_dir = chunk_dir
        self.store = store
        self.chunk_tokens = chunk_tokens

    def save_blob(
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

    def save_chunks(
        self,
        session_id: str,
        tokens: list[int],
        state: memoryview,
        layout: kvlayout.StateLayout,
        fingerprint: Fingerprint,
        engine: SeqStateEngine | None = None,
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
        engine: SeqStateEngine,
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
            parsed = kvlayout.parse_section(end_section.data, spec, n, header=False)
            sections.append((n, end_section, parsed))
        except kvlayout.LayoutError:
            pass
        for position, partial in pending:
            if position > n:
                continue
            try:
                ordered = kvlayout.in_position_order(partial, spec, partial=True)
                body = np.frombuffer(ordered, dtype=np.uint8)[8:]
                parsed = kvlayout.parse_section(body.data, spec, position, header=False)
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
        shared = common_prefix(row.token_ids, tokens)
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
