"""Reading a chain's chunk files straight into the engine's state buffer.

A chunk file holds its cells' bytes in the order of the state's layout: the cell
metadata, then each layer's K rows, then each layer's V (rows, or with flash attention off
the transposed form: per V dimension, one element of every cell). Each of those runs lands
in one contiguous range of the whole state, so ``preadv`` reads the file straight into
its places in the state buffer (no mapping, no copy in Python), :data:`BATCH_BYTES` at a
time; transposed V, whose dimensions are spread over the state, is read into a small
per-thread scratch buffer and placed by numpy. The chunk's checksum is taken over each
batch right after it arrives, while it is still in the core's cache, in the file's order,
so it is the checksum the file was written with. Bytes land before they are verified,
but the buffer reaches llama.cpp only when every chunk checked out.

Anything unexpected (a file whose size or header is not what its index row gives, a chunk
the restore cuts short) is left to the mapped reader (:func:`kvchat.kvcache.format.read_chunk`
and :class:`kvchat.kvcache.layout.Assembler`), which says precisely what is wrong.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import numpy as np
import xxhash

from kvchat.kvcache import files as kvfiles
from kvchat.kvcache import format as fmt
from kvchat.kvcache.errors import SnapshotRejected
from kvchat.kvcache.state_layout import PREAMBLE, LayoutError, StateLayout
from kvchat.store import ChunkRow

_scratch = threading.local()
# Bytes read per preadv before they are hashed: well within a core's L2 cache, so the hash
# reads them from cache, not from memory.
BATCH_BYTES = 512 << 10


def _scratch_bytes(size: int) -> np.ndarray:
    """This thread's scratch buffer, at least ``size`` bytes (kept between restores)."""
    buf: np.ndarray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < size:
        buf = np.empty(size, dtype=np.uint8)
        _scratch.buf = buf
    return buf[:size]


def _batches(targets: list[memoryview]) -> list[list[memoryview]]:
    """``targets`` in order, cut into runs of at most :data:`BATCH_BYTES` (a longer target
    is cut into pieces)."""
    batches: list[list[memoryview]] = []
    batch: list[memoryview] = []
    size = 0
    for target in targets:
        for at in range(0, len(target), BATCH_BYTES):
            piece = target[at : at + BATCH_BYTES]
            if batch and size + len(piece) > BATCH_BYTES:
                batches.append(batch)
                batch, size = [], 0
            batch.append(piece)
            size += len(piece)
    if batch:
        batches.append(batch)
    return batches


class ChunkReader:
    """Places whole chunks of a chain into ``out``, the state of ``layout`` (its ``n_cells``
    cells); safe to call from several threads at once for different chunks."""

    def __init__(self, out: np.ndarray, layout: StateLayout) -> None:
        if len(out) < layout.total:
            raise LayoutError("output buffer too small")
        self.out = out
        self.layout = layout
        self._view = memoryview(out)
        self._per_cell = layout.per_cell_bytes()
        # Bytes of transposed V per cell (read through the scratch buffer).
        self._scattered = (
            sum(v.row_size * v.n_dims for v in layout.v_layers) if layout.v_trans else 0
        )

    def read(self, path: Path, entry: ChunkRow, start: int) -> int | None:
        """Read, verify and place the chunk ``entry`` (at cell ``start``); the cells placed,
        or None when this reader does not take it (see the module's docstring).

        Raises :class:`SnapshotRejected` for a missing or foreign file or a checksum
        mismatch, :class:`LayoutError` when its cells are not the ones the chain needs.
        """
        n = entry.n_tokens
        if start + n > self.layout.n_cells or entry.n_bytes != 8 + n * self._per_cell:
            return None
        head = fmt.chunk_preamble(entry)
        found = bytearray(len(head))
        cells = bytearray(8)
        fd, size = kvfiles.open_regular(path, f"chunk {path.name}")
        try:
            if size != len(head) + entry.n_bytes:
                return None
            at = kvfiles.read_into(fd, [memoryview(found), memoryview(cells)])
            if at != len(head) + 8 or found != head:
                return None
            digest = xxhash.xxh3_128(cells)
            scratch = _scratch_bytes(n * self._scattered)
            for batch in _batches(self._targets(start, n, scratch)):
                want = sum(len(b) for b in batch)
                if kvfiles.read_into(fd, batch, at) != want:
                    return None  # the file shrank under us: the mapped reader says how
                at += want
                # Checked while it is still in the cache it was just read into.
                for piece in batch:
                    digest.update(piece)
        finally:
            os.close(fd)
        if digest.hexdigest() != entry.checksum:
            raise SnapshotRejected(f"snapshot chunk checksum mismatch: {path.name} is corrupt")
        if struct.unpack("<II", cells) != (start, n):
            raise LayoutError("chunks do not tile the token range")
        if self._scattered:
            self._scatter(scratch, start, n)
        return n

    def _targets(self, start: int, n: int, scratch: np.ndarray) -> list[memoryview]:
        """Where the chunk's bytes go, in the file's order: ranges of the state buffer, and
        of ``scratch`` for transposed V."""
        layout, view = self.layout, self._view
        at = PREAMBLE + start * layout.cell_meta_size
        targets = [view[at : at + n * layout.cell_meta_size]]
        rows = layout.k_layers if layout.v_trans else [*layout.k_layers, *layout.v_layers]
        for layer in rows:
            if layer.row_size:
                at = layer.offset + start * layer.row_size
                targets.append(view[at : at + n * layer.row_size])
        if layout.v_trans:
            targets.append(memoryview(scratch))
        return targets

    def _scatter(self, scratch: np.ndarray, start: int, n: int) -> None:
        """Place transposed V from ``scratch``: per layer, per dimension, ``n`` elements."""
        layout, out = self.layout, self.out
        pos = 0
        for layer in layout.v_layers:
            size, dims = layer.row_size, layer.n_dims
            width = n * size * dims
            if not width:
                continue
            grid = out[layer.offset : layer.offset + size * dims * layout.n_cells]
            grid = grid.reshape(dims, layout.n_cells * size)
            grid[:, start * size : (start + n) * size] = scratch[pos : pos + width].reshape(
                dims, n * size
            )
            pos += width
