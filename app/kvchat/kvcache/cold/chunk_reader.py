"""Reading a chain's chunk files straight into llama.cpp's seq-state layout.

A chunk file holds its cells' bytes in the order of the state's layout: the cell
metadata, then each layer's K rows, then each layer's V (rows, or with flash attention off
the transposed form: per V dimension, one element of every cell). So a chunk is a whole
state of its own cells, less the headers, and ``preadv`` reads the file straight into
place (no mapping, no copy in Python), :data:`BATCH_BYTES` at a time. The chunk's checksum
is taken over each batch right after it arrives, while it is still in the core's cache, in
the file's order, so it is the checksum the file was written with.

Two readers:

* :class:`PieceReader` (an engine that appends a state piece by piece: the KV in host
  memory) reads each chunk into a small state of its own cells, which llama.cpp copies
  into the KV cache right after it checks out, while it is still in the CPU's cache: no
  pass of the whole state through memory besides llama.cpp's own copy.
* :class:`ChunkReader` places every chunk in one whole state's buffer (the GPU path, and a
  sliding-window state whose window section follows); transposed V, whose dimensions are
  spread over the state, is read into a small per-thread scratch buffer and placed by
  numpy. Bytes land before they are verified, but the buffer reaches llama.cpp only when
  every chunk checked out.

Anything unexpected (a file whose size or header is not what its index row gives, a chunk
the restore cuts short) is left to the mapped reader (:func:`kvchat.kvcache.cold.formats.read_chunk`
and :class:`kvchat.kvcache.state.ranges.Assembler`), which says precisely what is wrong.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvchat.kvcache import defects
from kvchat.kvcache.cold import files as kvfiles
from kvchat.kvcache.cold import formats as fmt
from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.kvcache.state.assemble import write_headers
from kvchat.kvcache.state.layout import PREAMBLE, LayoutError, StateLayout, layout_for
from kvchat.store import ChunkRow

_scratch = threading.local()
# Bytes read per preadv before they are hashed: well within a core's L2 cache, so the hash
# reads them from cache, not from memory.
BATCH_BYTES = 512 << 10
# Chunk sizes whose pieces a PieceReader keeps (a chain's are mostly one size).
MAX_PIECE_SIZES = 8


def _scratch_bytes(size: int) -> np.ndarray:
    """This thread's scratch buffer, at least ``size`` bytes (kept between restores)."""
    buf: np.ndarray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < size:
        buf = np.empty(size, dtype=np.uint8)
        _scratch.buf = buf
    return buf[:size]


Batch = tuple[list[memoryview], int]


def _batches(targets: list[memoryview]) -> list[Batch]:
    """``targets`` in order, cut into runs of at most :data:`BATCH_BYTES` (a longer target
    is cut into pieces), each with its size."""
    batches: list[Batch] = []
    batch: list[memoryview] = []
    size = 0
    for target in targets:
        for at in range(0, len(target), BATCH_BYTES):
            piece = target[at : at + BATCH_BYTES]
            if batch and size + len(piece) > BATCH_BYTES:
                batches.append((batch, size))
                batch, size = [], 0
            batch.append(piece)
            size += len(piece)
    if batch:
        batches.append((batch, size))
    return batches


def read_verified(path: Path, entry: ChunkRow, start: int, batches: list[Batch]) -> bool:
    """Read the chunk file of ``entry`` (cells from ``start``) into the ranges ``batches``
    cut (see :func:`_batches`) in the file's order, hashing each batch as it arrives; False
    when the file is not what its row says (left to the mapped reader, which says how).

    Raises :class:`SnapshotRejected` for a missing or foreign file or a checksum mismatch,
    :class:`LayoutError` when its cells are not the ones the chain needs.
    """
    head = fmt.chunk_preamble(entry)
    found = bytearray(len(head))
    cells = bytearray(8)
    fd, size = kvfiles.open_regular(path, f"chunk {path.name}")
    try:
        if size != len(head) + entry.n_bytes:
            return False
        at = kvfiles.read_into(fd, [memoryview(found), memoryview(cells)])
        if at != len(head) + 8 or found != head:
            return False
        digest = xxhash.xxh3_128(cells)
        for batch, want in batches:
            if kvfiles.read_into(fd, batch, at) != want:
                return False  # the file shrank under us: the mapped reader says how
            at += want
            # Checked while it is still in the cache it was just read into.
            for piece in batch:
                digest.update(piece)
    finally:
        os.close(fd)
    if digest.hexdigest() != entry.checksum:
        raise SnapshotRejected(f"snapshot chunk checksum mismatch: {path.name} is corrupt")
    if struct.unpack("<II", cells) != (start, entry.n_tokens):
        raise LayoutError("chunks do not tile the token range")
    return True


class ChunkReader:
    """Places whole chunks of a chain into ``out``, the state of ``layout`` (its ``n_cells``
    cells); safe to call from several threads at once for different chunks."""

    def __init__(self, out: np.ndarray, layout: StateLayout) -> None:
        if len(out) < layout.total:
            raise LayoutError("output buffer too small")
        self.out = out
        self.layout = layout
        self._view = out.data
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
        scratch = _scratch_bytes(n * self._scattered)
        if not read_verified(path, entry, start, _batches(self._targets(start, n, scratch))):
            return None
        if defects.planted("shifted-cell") and start == 0:  # test-only: see defects.py
            defects.swap_k_rows(self.out, self.layout, 0)
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
            targets.append(scratch.data)
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


class Piece:
    """A whole seq state of ``layout``'s cells at the start of ``data``: its headers, and
    where a chunk file's runs land (``batches``)."""

    def __init__(self, layout: StateLayout, data: np.ndarray) -> None:
        self.layout = layout
        self.size = layout.total
        n, view = layout.n_cells, data.data
        targets = [view[PREAMBLE : PREAMBLE + layout.meta_size]]
        for layer in layout.k_layers:
            targets.append(view[layer.offset : layer.offset + n * layer.row_size])
        for layer in layout.v_layers:
            width = layer.row_size * (layer.n_dims if layout.v_trans else 1) * n
            targets.append(view[layer.offset : layer.offset + width])
        self.targets = targets
        self.batches = _batches(targets)
        self.payload = sum(len(target) for target in targets)

    def fill(self, chunk: np.ndarray) -> None:
        """Copy a verified chunk (its 8-byte cell header, then its runs) into place."""
        if len(chunk) != 8 + self.payload:
            raise LayoutError("a chunk's size does not match its cell count")
        at = 8
        for target in self.targets:
            np.frombuffer(target, dtype=np.uint8)[:] = chunk[at : at + len(target)]
            at += len(target)


class PieceReader:
    """Reads a chain one chunk at a time into a small whole seq state of the chunk's cells,
    for an engine that loads a state piece by piece (``state_append``): the chunk stays in
    the CPU's cache from the read through the checksum to llama.cpp copying it into the
    KV cache, instead of passing through a whole state's buffer in memory.

    One buffer serves every chunk size in turn, and is kept for the next restore (a fresh
    one page-faults on every first touch); so is what each size's piece looks like.
    """

    def __init__(self, layout_desc: dict[str, Any]) -> None:
        self.layout_desc = layout_desc
        self._buffer = np.empty(0, dtype=np.uint8)
        self._pieces: dict[int, Piece] = {}
        self._headers_for = -1  # the size whose headers the buffer holds

    def piece(self, n_cells: int) -> Piece:
        """The piece for a chunk of ``n_cells`` cells, its headers written."""
        piece = self._pieces.get(n_cells)
        if piece is None:
            layout = layout_for(self.layout_desc, n_cells)
            if layout.total > len(self._buffer):
                self._buffer = np.empty(layout.total, dtype=np.uint8)
                self._pieces.clear()
            if len(self._pieces) >= MAX_PIECE_SIZES:
                self._pieces.clear()
            piece = self._pieces[n_cells] = Piece(layout, self._buffer)
            self._headers_for = -1
        if self._headers_for != n_cells:
            write_headers(self._buffer, piece.layout)
            self._headers_for = n_cells
        return piece

    @property
    def pointer(self) -> Any:
        """The buffer, as llama.cpp takes it (valid until the next :meth:`piece`)."""
        return ctypes.cast(self._buffer.ctypes.data, ctypes.POINTER(ctypes.c_uint8))

    def read(self, path: Path, entry: ChunkRow, start: int) -> Piece | None:
        """The chunk ``entry`` (at cell ``start``) read and verified into its piece, or None
        when the file is not what its row says (see :class:`ChunkReader`); raises as
        :func:`read_verified` does."""
        piece = self.piece(entry.n_tokens)
        if entry.n_bytes != 8 + piece.payload:
            return None
        if not read_verified(path, entry, start, piece.batches):
            return None
        if defects.planted("shifted-cell") and start == 0:  # test-only: see defects.py
            defects.swap_k_rows(self._buffer, piece.layout, 0)
        return piece
