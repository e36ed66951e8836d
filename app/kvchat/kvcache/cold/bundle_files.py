"""A session's cold snapshot carried out of and into the disk tier, for portable bundles.

Out: the session's own snapshot files, each verified (chain keys re-derived, checksums)
before its bytes are handed over. In: chunks (or a whole blob) read from elsewhere, checked
against the tokens and the layout they claim, then written exactly as a save writes them:
the data re-checksummed under a header this machine's fingerprint keys, atomically, at a
name derived from the key (or the new session id), and indexed only after the rename. A
chunk already on disk under the same key is shared, never rewritten. Nothing here takes a
file name from its input.

Raises :class:`SnapshotRejected` with the reason when the KV can't be trusted, and OSError
(:class:`SnapshotsUnavailable` included) when it can't be written; either way nothing is
left behind: files written before the failure are removed unless another snapshot indexed
them meanwhile.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvchat.engine import SeqStateEngine
from kvchat.kvcache.cold import chains as chunking
from kvchat.kvcache.cold import files as kvfiles
from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.cold.housekeeper import chunk_row_problem
from kvchat.kvcache.cold.snapshot_store import SnapshotStore
from kvchat.kvcache.fingerprint import Fingerprint, fingerprint_problem
from kvchat.kvcache.rejected import SnapshotRejected, SnapshotsUnavailable
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.kvcache.state.recompute import MAX_CHECK_TOKENS, FirstChunkCheck, check_first_cells
from kvchat.store import ChunkRow, SnapshotRow


@dataclass(frozen=True)
class SnapshotFile:
    """One verified file of a snapshot: the cells [start, start + n_tokens) it holds."""

    start: int
    n_tokens: int
    data: memoryview  # the whole file (header included); valid only until the next one


def own_snapshot(snapshots: SnapshotStore, session_id: str) -> SnapshotRow:
    """The session's own snapshot row, if it is one kvchat can load; else SnapshotRejected."""
    row = snapshots.store.get_snapshot(session_id)
    if row is None:
        raise SnapshotRejected("the session has no saved KV")
    if row.damage:
        raise SnapshotRejected(f"the session's snapshot row is damaged ({row.damage})")
    problem = fingerprint_problem(row.fingerprint)
    if problem is not None:
        raise SnapshotRejected(f"the session's snapshot fingerprint is damaged ({problem})")
    if row.format == "chunks":
        if row.layout is None or row.checksum != fmt.chain_checksum(row.chunk_keys):
            raise SnapshotRejected("the session's chunk list does not match its index row")
        try:
            kvlayout.check_desc(row.layout)
        except kvlayout.LayoutError as exc:
            raise SnapshotRejected(f"the session's snapshot layout is damaged: {exc}") from None
        if "swa" in row.layout:
            # Its window checkpoints are not carried by bundles (yet): text only.
            raise SnapshotRejected(
                "a sliding-window model's KV (chunks and window checkpoints) is not put in "
                "bundles yet"
            )
    return row


@contextmanager
def _mapped_view(path: Path, label: str) -> Iterator[tuple[mmap.mmap, memoryview]]:
    mapped = kvfiles.map_file(path, label)
    try:
        with memoryview(mapped) as view:
            yield mapped, view
    finally:
        mapped.close()


def snapshot_files(snapshots: SnapshotStore, row: SnapshotRow) -> Iterator[SnapshotFile]:
    """Each file of ``row`` in token order, verified against the index before it is yielded.

    Raises :class:`SnapshotRejected` at the first file that fails (missing, a symlink,
    truncated, corrupt, not this row's).
    """
    if row.format == "chunks":
        index = snapshots.store.get_chunks(row.chunk_keys)
        for entry, start in chunking.verify_chain(row, index, row.n_tokens):
            path = snapshots.chunk_dir / fmt.chunk_name(entry.key)
            with _mapped_view(path, f"chunk {path.name}") as (mapped, view):
                checked = fmt.read_chunk(mapped, entry, start, path.name)
                del checked  # a view into the mapping: released before it is unmapped
                yield SnapshotFile(start, entry.n_tokens, view)
        return
    if not fmt.is_blob_name(row.session_id, row.path):
        raise SnapshotRejected(f"the snapshot row names a file that is not its own ({row.path!r})")
    path = snapshots.directory / row.path
    with _mapped_view(path, path.name) as (mapped, view):
        checked = fmt.read_blob(mapped, row, path.name)
        del checked
        yield SnapshotFile(0, row.n_tokens, view)


@dataclass(frozen=True)
class IncomingChunk:
    """A chunk file read from a bundle: where it claims to sit, and its bytes on demand.

    ``read`` returns the member's bytes after checking them against the bundle's own hash
    (raising :class:`SnapshotRejected` when they don't match).
    """

    start: int
    n_tokens: int
    read: Callable[[], bytes]


def _tiles(chunks: Sequence[IncomingChunk], n_tokens: int) -> list[int]:
    """The chunk ends, checked to tile [0, n_tokens) in order."""
    ends: list[int] = []
    covered = 0
    for chunk in chunks:
        if chunk.start != covered or chunk.n_tokens <= 0:
            raise SnapshotRejected(
                f"the KV chunks do not tile the tokens (one starts at {chunk.start}, "
                f"expected {covered})"
            )
        covered += chunk.n_tokens
        ends.append(covered)
    if covered != n_tokens or not ends:
        raise SnapshotRejected(f"the KV chunks cover {covered} of {n_tokens} tokens")
    return ends


def _chunk_data(raw: bytes, chunk: IncomingChunk, per_cell: int, label: str) -> np.ndarray:
    """The chunk's data (after its header), checked: header, size, checksum, cell range."""
    if len(raw) < 12:
        raise SnapshotRejected(f"{label} is not a kvchat chunk file (too short)")
    header, data_at = fmt.read_header(raw, fmt.CHUNK_MAGIC, label)
    n_bytes = header.get("n_bytes")
    expected = 8 + chunk.n_tokens * per_cell
    if (
        header.get("start") != chunk.start
        or header.get("n_tokens") != chunk.n_tokens
        or n_bytes != expected
        or len(raw) != data_at + expected
    ):
        raise SnapshotRejected(f"{label} does not hold the cells the bundle says it holds")
    data = np.frombuffer(raw, dtype=np.uint8, count=expected, offset=data_at)
    if fmt.checksum(data) != header.get("checksum"):
        raise SnapshotRejected(f"{label} fails its checksum: the KV is corrupt")
    if struct.unpack_from("<II", data.data, 0) != (chunk.start, chunk.n_tokens):
        raise SnapshotRejected(f"{label} holds other cells than its header says")
    return data


def _check_layout(
    data: np.ndarray, layout_desc: dict[str, Any], n_tokens: int, shape: tuple[int, int, int]
) -> None:
    """The layout is this model's: the first chunk, assembled as a state, parses as one."""
    try:
        size = kvlayout.layout_for(layout_desc, n_tokens).total
        state = np.zeros(size, dtype=np.uint8)
        assembler = kvlayout.Assembler(state, layout_desc, n_tokens)
        assembler.finish(assembler.place(data, 0))
        parsed = kvlayout.parse(state.data, *shape)
    except kvlayout.LayoutError as exc:
        raise SnapshotRejected(f"the KV does not fit this model's layout ({exc})") from None
    if parsed.describe() != layout_desc or parsed.n_cells != n_tokens:
        raise SnapshotRejected("the KV layout is not this model's")


def _over_budget(snapshots: SnapshotStore, n_bytes: int) -> None:
    budget = snapshots.budget_bytes
    if budget is not None and n_bytes > budget:
        raise SnapshotRejected(
            f"the KV ({n_bytes:,} bytes) is larger than the disk cache budget ({budget:,} bytes)"
        )


def _usable(snapshots: SnapshotStore, session_id: str) -> None:
    if snapshots.disabled is not None:
        raise SnapshotRejected(f"snapshots are disabled: {snapshots.disabled}")
    if not fmt.valid_session_id(session_id):
        raise SnapshotsUnavailable(f"not a session id kvchat makes: {session_id!r}")


def install_chunks(
    snapshots: SnapshotStore,
    session_id: str,
    fingerprint: Fingerprint,
    shape: tuple[int, int, int] | None,
    tokens: list[int],
    layout_desc: dict[str, Any],
    chunks: Sequence[IncomingChunk],
    engine: SeqStateEngine | None = None,
) -> tuple[SnapshotRow, FirstChunkCheck | None]:
    """Write ``chunks`` as ``session_id``'s snapshot of ``tokens``; returns its index row
    and what recomputing the first chunk showed.

    Keys derive from ``tokens`` and ``fingerprint``: this machine's (the caller has checked
    that the bundle's matches it) with the bundle's origin, so the chunks stay apart from
    KV computed here. ``shape`` is the model's (layers, K width, V width), against which
    the layout is checked before anything is written. With ``engine``, the first chunk
    (its first :data:`MAX_CHECK_TOKENS` cells) is recomputed on it and compared
    (:func:`check_first_cells`; the context is left empty).
    """
    _usable(snapshots, session_id)
    if shape is None:
        raise SnapshotRejected("this model's KV layout cannot be checked, so chunks can't be")
    ends = _tiles(chunks, len(tokens))
    try:
        layout = kvlayout.layout_for(layout_desc, len(tokens))
    except kvlayout.LayoutError as exc:
        raise SnapshotRejected(f"the KV layout is damaged: {exc}") from None
    per_cell = layout.per_cell_bytes()
    _over_budget(snapshots, sum(8 + c.n_tokens * per_cell for c in chunks))
    keys = chunking.chain_keys(fingerprint.to_dict(), tokens, ends)
    known = snapshots.store.get_chunks(keys)
    written: list[tuple[str, Path]] = []
    new_rows: list[ChunkRow] = []
    check: FirstChunkCheck | None = None
    try:
        for number, (chunk, key) in enumerate(zip(chunks, keys)):
            label = f"KV chunk {number + 1}"
            data = _chunk_data(chunk.read(), chunk, per_cell, label)
            if number == 0:
                _check_layout(data, layout_desc, chunk.n_tokens, shape)
                if engine is not None:
                    check = _recompute(engine, shape, tokens, data, layout_desc, chunk.n_tokens)
            name = fmt.chunk_name(key)
            path = snapshots.chunk_dir / name
            existing = known.get(key)
            if (
                existing is not None
                and chunk_row_problem(existing) is None
                and (existing.start, existing.n_tokens) == (chunk.start, chunk.n_tokens)
                and kvfiles.regular_file(path) is not None
            ):
                continue  # the same cells of the same tokens are already here: shared
            problem = kvfiles.prepare_dir(path.parent)
            if problem is None and os.path.lexists(path) and kvfiles.regular_file(path) is None:
                problem = f"{path} is in the way (not a file kvchat wrote)"
            if problem is not None:
                raise SnapshotsUnavailable(f"cannot write snapshot chunks: {problem}")
            end = chunk.start + chunk.n_tokens
            parts, digest = fmt.chunk_parts(key, chunk.start, end, data)
            kvfiles.write_atomically(path, parts)
            written.append((key, path))
            new_rows.append(ChunkRow(key, name, chunk.start, chunk.n_tokens, len(data), digest))
        row = SnapshotRow(
            session_id=session_id,
            path="",
            n_tokens=len(tokens),
            token_ids=list(tokens),
            fingerprint=fingerprint.to_dict(),
            n_bytes=layout.total,
            checksum=fmt.chain_checksum(keys),
            format="chunks",
            chunk_keys=keys,
            layout=layout_desc,
        )
        snapshots.store.put_snapshot(row, new_rows)
    except BaseException:
        _remove_unindexed(snapshots, written)
        raise
    snapshots.enforce_budget(keep=session_id)
    return row, check


def _recompute(
    engine: SeqStateEngine,
    shape: tuple[int, int, int],
    tokens: list[int],
    data: np.ndarray,
    layout_desc: dict[str, Any],
    n_cells: int,
) -> FirstChunkCheck:
    """Recompute the first cells of imported KV (``data``: cells [0, n_cells) in chunk form)
    and compare; raises SnapshotRejected when they are not their tokens' KV."""
    n = min(n_cells, MAX_CHECK_TOKENS)
    if n < n_cells:
        layout = kvlayout.layout_for(layout_desc, n_cells)
        data = kvlayout.extract(_chunk_state(data, layout_desc, n_cells), layout, 0, n)
    return check_first_cells(engine, shape, tokens, data, n)


def _chunk_state(data: np.ndarray, layout_desc: dict[str, Any], n_cells: int) -> np.ndarray:
    """A chunk of cells [0, n_cells) assembled as a whole state (to cut a prefix from it)."""
    state = np.zeros(kvlayout.layout_for(layout_desc, n_cells).total, dtype=np.uint8)
    assembler = kvlayout.Assembler(state, layout_desc, n_cells)
    assembler.finish(assembler.place(data, 0))
    return state


def _remove_unindexed(snapshots: SnapshotStore, written: list[tuple[str, Path]]) -> None:
    """Remove chunk files this install wrote that no row indexes (a failed install)."""
    try:
        indexed = snapshots.store.get_chunks([key for key, _ in written])
    except Exception:
        return  # the orphan sweep removes them later
    for key, path in written:
        if key not in indexed:
            kvfiles.remove_file(path)


def install_blob(
    snapshots: SnapshotStore,
    session_id: str,
    fingerprint: Fingerprint,
    tokens: list[int],
    read: Callable[[], bytes],
    engine: SeqStateEngine | None = None,
    shape: tuple[int, int, int] | None = None,
) -> tuple[SnapshotRow, FirstChunkCheck | None]:
    """Write a whole-state blob file as ``session_id``'s snapshot of ``tokens``; with
    ``engine`` and ``shape``, its first cells are recomputed and compared first."""
    _usable(snapshots, session_id)
    raw = read()
    label = "the KV state"
    if len(raw) < 12:
        raise SnapshotRejected(f"{label} is not a kvchat snapshot file (too short)")
    header, tokens_at = fmt.read_header(raw, fmt.MAGIC, label)
    n_bytes = header.get("n_bytes")
    state_at = tokens_at + 4 * len(tokens)
    if (
        isinstance(n_bytes, bool)
        or not isinstance(n_bytes, int)
        or header.get("n_tokens") != len(tokens)
        or len(raw) != state_at + n_bytes
    ):
        raise SnapshotRejected(f"{label} does not match the bundle's tokens and sizes")
    ids = fmt.token_bytes(tokens)
    if raw[tokens_at:state_at] != ids:
        raise SnapshotRejected(f"{label} holds other token ids than the bundle says")
    state = np.frombuffer(raw, dtype=np.uint8, count=n_bytes, offset=state_at)
    if fmt.checksum(ids, state) != header.get("checksum"):
        raise SnapshotRejected(f"{label} fails its checksum: the KV is corrupt")
    _over_budget(snapshots, n_bytes)
    check: FirstChunkCheck | None = None
    if engine is not None and shape is not None:
        check = _blob_check(engine, shape, tokens, state)
    parts, digest = fmt.blob_parts(session_id, fingerprint.to_dict(), tokens, state.data)
    name = fmt.blob_name(session_id)
    path = snapshots.directory / name
    kvfiles.write_atomically(path, parts)
    row = SnapshotRow(
        session_id=session_id,
        path=name,
        n_tokens=len(tokens),
        token_ids=list(tokens),
        fingerprint=fingerprint.to_dict(),
        n_bytes=n_bytes,
        checksum=digest,
    )
    try:
        snapshots.store.put_snapshot(row)
    except BaseException:
        kvfiles.remove_file(path)
        raise
    snapshots.enforce_budget(keep=session_id)
    return row, check


def _blob_check(
    engine: SeqStateEngine, shape: tuple[int, int, int], tokens: list[int], state: np.ndarray
) -> FirstChunkCheck | None:
    """Recompute a whole state's first cells and compare (None: a state kvchat cannot cut,
    so there is nothing to compare cell by cell)."""
    try:
        parsed = kvlayout.parse(state.data, *shape)
    except kvlayout.LayoutError:
        return None
    if parsed.n_cells != len(tokens):
        raise SnapshotRejected("the KV state holds another number of cells than its tokens")
    n = min(len(tokens), MAX_CHECK_TOKENS)
    return check_first_cells(engine, shape, tokens, kvlayout.extract(state, parsed, 0, n), n)
