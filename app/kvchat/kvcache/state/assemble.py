"""Reassembling a whole seq state from chunks (the mapped path; see
:mod:`kvchat.kvcache.cold.chunk_reader` for the direct one) and from window pieces."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from kvchat.kvcache.state.layout import PREAMBLE, LayoutError, StateLayout, layout_for


def write_headers(out: np.ndarray, layout: StateLayout) -> None:
    """Write every header of a whole state of ``layout`` into ``out`` (the cells' bytes
    go between them)."""
    struct.pack_into("<QII", out.data, 0, layout.magic, 1, layout.n_cells)
    struct.pack_into("<II", out.data, PREAMBLE + layout.meta_size, layout.v_trans, layout.n_layer)
    for layer in layout.k_layers:
        struct.pack_into("<iQ", out.data, layer.offset - 12, layer.type, layer.row_size)
    for layer in layout.v_layers:
        if layout.v_trans:
            struct.pack_into(
                "<iII", out.data, layer.offset - 12, layer.type, layer.row_size, layer.n_dims
            )
        else:
            struct.pack_into("<iQ", out.data, layer.offset - 12, layer.type, layer.row_size)


class Assembler:
    """Writes a whole seq state of ``n_cells`` cells into ``out``, one chunk at a time.

    Chunks tile [0, ≥ n_cells); the last one used may be cut short. Placing a chunk
    right after checking it reads it while it is still in cache.
    """

    def __init__(self, out: np.ndarray, layout_desc: dict[str, Any], n_cells: int) -> None:
        self.layout = layout_for(layout_desc, n_cells)
        if len(out) < self.layout.total:
            raise LayoutError("output buffer too small")
        self.out = out
        self.n_cells = n_cells
        self._per_cell = self.layout.per_cell_bytes()
        write_headers(out, self.layout)

    def place(self, chunk: np.ndarray, expected_start: int) -> int:
        """Copy one chunk's cells (those below ``n_cells``) into place; returns how many.

        Chunks cover disjoint cells, so several may be placed at once from threads.
        """
        start, n = (int(v) for v in struct.unpack_from("<II", chunk.data, 0))
        if start != expected_start or len(chunk) != 8 + n * self._per_cell:
            raise LayoutError("chunks do not tile the token range")
        cut = max(0, min(n, self.n_cells - start))
        if cut:
            self.place_cells(chunk, 0, cut, start)
        return cut

    def place_cells(self, chunk: np.ndarray, first: int, count: int, at: int) -> None:
        """Copy cells [first, first + count) of ``chunk`` (whatever start its header names)
        to cells [at, at + count) of the output."""
        layout, out = self.layout, self.out
        (n,) = struct.unpack_from("<I", chunk.data, 4)
        if len(chunk) != 8 + n * self._per_cell:
            raise LayoutError("a chunk's size does not match its cell count")
        if first < 0 or count < 0 or first + count > n or at < 0 or at + count > self.n_cells:
            raise LayoutError("cells out of range")
        meta_size = layout.cell_meta_size
        pos = 8
        dst = PREAMBLE + at * meta_size
        out[dst : dst + count * meta_size] = chunk[
            pos + first * meta_size : pos + (first + count) * meta_size
        ]
        pos += n * meta_size
        for layer in layout.k_layers:
            size = layer.row_size
            out[layer.offset + at * size : layer.offset + (at + count) * size] = chunk[
                pos + first * size : pos + (first + count) * size
            ]
            pos += n * size
        for layer in layout.v_layers:
            size = layer.row_size
            if layout.v_trans:
                grid = out[
                    layer.offset : layer.offset + size * layer.n_dims * self.n_cells
                ].reshape(layer.n_dims, self.n_cells * size)
                src = chunk[pos : pos + n * size * layer.n_dims].reshape(layer.n_dims, n * size)
                grid[:, at * size : (at + count) * size] = src[
                    :, first * size : (first + count) * size
                ]
                pos += n * size * layer.n_dims
            else:
                out[layer.offset + at * size : layer.offset + (at + count) * size] = chunk[
                    pos + first * size : pos + (first + count) * size
                ]
                pos += n * size

    def finish(self, placed: int) -> int:
        """The state's size; raises LayoutError unless ``placed`` cells cover every cell."""
        if placed != self.n_cells:
            raise LayoutError(f"chunks cover {placed} of {self.n_cells} tokens")
        return self.layout.total


def assemble_into(
    out: np.ndarray, layout_desc: dict[str, Any], chunks: list[np.ndarray], n_cells: int
) -> int:
    """Write the seq state of the first ``n_cells`` cells of ``chunks`` into ``out``."""
    assembler = Assembler(out, layout_desc, n_cells)
    placed = 0
    for chunk in chunks:
        if placed >= n_cells:
            break
        placed += assembler.place(chunk, placed)
    return assembler.finish(placed)
