"""Parse, split and reassemble llama.cpp's seq-state bytes by token (cell) ranges.

The layout (llama.cpp's ``llama_kv_cache::state_write``, see DESIGN.md) carries no
version, so the parser verifies itself: every size must add up to the last byte, the
layer count must match the model, and every layer's row size must match the model's
KV width. Anything else → :class:`LayoutError`, and the caller keeps whole blobs.

Per stream the bytes are: cell metadata (pos, seq ids) for every cell; then per layer
the K rows of every cell; then V, either per layer as rows (``v_trans = 0``, flash
attention on) or transposed: per layer, per V dimension, one element of every cell.
A token range [a, b) therefore owns one contiguous run in the metadata, one per layer
in K, and one per layer (rows) or per layer × dimension (transposed) in V.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class LayoutError(ValueError):
    """The bytes are not the seq-state layout this module knows."""


@dataclass
class LayerData:
    type: int
    row_size: int  # bytes per cell (K, or V rows); for transposed V: el_size
    offset: int  # where this layer's data starts in the blob
    n_dims: int = 0  # transposed V only: n_embd_v_gqa


@dataclass
class StateLayout:
    """Where every piece of one single-stream seq state lives."""

    n_cells: int
    meta_offset: int
    meta_size: int  # bytes of cell metadata (all cells)
    cell_meta_size: int  # bytes per cell (uniform: one seq id per cell)
    v_trans: int
    n_layer: int
    magic: int = 0  # llama.cpp's leading u64, kept verbatim
    k_layers: list[LayerData] = field(default_factory=list)
    v_layers: list[LayerData] = field(default_factory=list)
    total: int = 0

    def describe(self) -> dict[str, Any]:
        """The per-model constants, recorded with a chunk chain and checked on restore."""
        return {
            "magic": self.magic,
            "cell_meta_size": self.cell_meta_size,
            "v_trans": self.v_trans,
            "n_layer": self.n_layer,
            "k": [[layer.type, layer.row_size] for layer in self.k_layers],
            "v": [[layer.type, layer.row_size, layer.n_dims] for layer in self.v_layers],
        }

    def per_cell_bytes(self) -> int:
        k = sum(layer.row_size for layer in self.k_layers)
        if self.v_trans:
            v = sum(layer.row_size * layer.n_dims for layer in self.v_layers)
        else:
            v = sum(layer.row_size for layer in self.v_layers)
        return self.cell_meta_size + k + v


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise LayoutError("state ends inside a header field")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def skip(self, n: int) -> int:
        start = self.pos
        if n < 0 or self.pos + n > len(self.data):
            raise LayoutError("state ends inside a data block")
        self.pos += n
        return start


def parse(data: memoryview | bytes, n_layer: int, k_width: int, v_width: int) -> StateLayout:
    """Parse a single-stream, single-sequence seq state; ``*_width`` = n_embd_{k,v}_gqa."""
    r = _Reader(memoryview(data).cast("B"))
    (magic,) = r.take("<Q")
    (n_stream,) = r.take("<I")
    if n_stream != 1:
        raise LayoutError(f"{n_stream} KV streams (only 1 is supported)")
    (n_cells,) = r.take("<I")
    meta_offset = r.pos
    expected_pos = 0
    for _ in range(n_cells):
        pos, n_seq = r.take("<iI")
        if n_seq != 1:
            raise LayoutError(f"a cell belongs to {n_seq} sequences")
        r.take("<i")
        if pos != expected_pos:
            raise LayoutError("cell positions are not 0, 1, 2, …")
        expected_pos += 1
    meta_size = r.pos - meta_offset
    v_trans, layers = r.take("<II")
    if layers != n_layer:
        raise LayoutError(f"state has {layers} layers, the model {n_layer}")
    layout = StateLayout(n_cells, meta_offset, meta_size, 12, v_trans, layers, magic=magic)
    for _ in range(layers):
        k_type, row_size = r.take("<iQ")
        _check_row(k_type, row_size, k_width, "K")
        layout.k_layers.append(LayerData(k_type, row_size, r.skip(row_size * n_cells)))
    for _ in range(layers):
        if not v_trans:
            v_type, row_size = r.take("<iQ")
            _check_row(v_type, row_size, v_width, "V")
            layout.v_layers.append(LayerData(v_type, row_size, r.skip(row_size * n_cells)))
        else:
            v_type, el_size, n_dims = r.take("<iII")
            if n_dims != v_width or el_size not in (2, 4):
                raise LayoutError(f"transposed V of {n_dims} × {el_size} B, model width {v_width}")
            layout.v_layers.append(
                LayerData(v_type, el_size, r.skip(el_size * n_dims * n_cells), n_dims)
            )
    if r.pos != len(r.data):
        raise LayoutError(f"{len(r.data) - r.pos} unexplained bytes after the last layer")
    layout.total = r.pos
    return layout


# u64 magic, u32 n_stream, u32 cell_count: what precedes the cell metadata.
_PREAMBLE = 16

# Bytes per block and elements per block of the KV types kvchat uses (ggml type ids).
_TYPE_SIZES = {1: (2, 1), 0: (4, 1), 8: (34, 32), 2: (18, 32)}  # f16, f32, q8_0, q4_0


def _check_row(type_id: int, row_size: int, width: int, what: str) -> None:
    if type_id not in _TYPE_SIZES:
        raise LayoutError(f"{what} of unknown ggml type {type_id}")
    block_bytes, block_elems = _TYPE_SIZES[type_id]
    if width % block_elems or row_size != width // block_elems * block_bytes:
        raise LayoutError(f"{what} row of {row_size} B does not match width {width}")


def chunk_size(layout: StateLayout, n_cells: int) -> int:
    return 8 + n_cells * layout.per_cell_bytes()


def extract(data: np.ndarray, layout: StateLayout, start: int, end: int) -> np.ndarray:
    """The bytes of cells [start, end): metadata, then K per layer, then V per layer."""
    n = end - start
    parts: list[np.ndarray] = [
        np.frombuffer(struct.pack("<II", start, n), dtype=np.uint8),
        data[
            layout.meta_offset + start * layout.cell_meta_size : layout.meta_offset
            + end * layout.cell_meta_size
        ],
    ]
    for layer in layout.k_layers:
        parts.append(
            data[layer.offset + start * layer.row_size : layer.offset + end * layer.row_size]
        )
    for layer in layout.v_layers:
        if layout.v_trans:
            block = data[
                layer.offset : layer.offset + layer.row_size * layer.n_dims * layout.n_cells
            ]
            grid = block.reshape(layer.n_dims, layout.n_cells * layer.row_size)
            parts.append(grid[:, start * layer.row_size : end * layer.row_size].reshape(-1))
        else:
            parts.append(
                data[layer.offset + start * layer.row_size : layer.offset + end * layer.row_size]
            )
    return np.concatenate(parts)


def _count(value: object, what: str, limit: int = 1 << 32) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise LayoutError(f"layout field {what} is not a count: {value!r}")
    return value


def check_desc(layout_desc: object) -> None:
    """Raise :class:`LayoutError` unless ``layout_desc`` is what :meth:`StateLayout.describe`
    writes: counts where counts belong, a known type for every layer, one K and one V
    entry per layer. A layout read back from the database is checked before it is used."""
    if not isinstance(layout_desc, dict):
        raise LayoutError("layout is not a JSON object")
    for name in ("magic", "cell_meta_size", "v_trans", "n_layer", "k", "v"):
        if name not in layout_desc:
            raise LayoutError(f"layout has no {name!r}")
    _count(layout_desc["magic"], "magic", 1 << 64)
    _count(layout_desc["cell_meta_size"], "cell_meta_size")
    n_layer = _count(layout_desc["n_layer"], "n_layer")
    if _count(layout_desc["v_trans"], "v_trans") > 1:
        raise LayoutError(f"layout field v_trans is {layout_desc['v_trans']!r}")
    for name, width in (("k", 2), ("v", 3)):
        layers = layout_desc[name]
        if not isinstance(layers, list) or len(layers) != n_layer:
            raise LayoutError(f"layout {name!r} does not list {n_layer} layers")
        for layer in layers:
            if not isinstance(layer, list) or len(layer) != width:
                raise LayoutError(f"layout {name!r} has a malformed layer: {layer!r}")
            kind = layer[0]
            if isinstance(kind, bool) or not isinstance(kind, int) or kind not in _TYPE_SIZES:
                raise LayoutError(f"layout {name!r} has a layer of unknown type {layer[0]!r}")
            for value in layer[1:]:
                _count(value, f"{name} row size")


def layout_for(layout_desc: dict[str, Any], n_cells: int) -> StateLayout:
    """The layout of a whole state of ``n_cells`` cells with these per-model constants.

    Raises :class:`LayoutError` for a description :func:`check_desc` refuses.
    """
    check_desc(layout_desc)
    _count(n_cells, "n_cells")
    layout = StateLayout(
        n_cells=n_cells,
        meta_offset=_PREAMBLE,
        meta_size=n_cells * layout_desc["cell_meta_size"],
        cell_meta_size=layout_desc["cell_meta_size"],
        v_trans=layout_desc["v_trans"],
        n_layer=layout_desc["n_layer"],
        magic=layout_desc["magic"],
    )
    offset = _PREAMBLE + layout.meta_size + 8
    for type_id, row_size in layout_desc["k"]:
        offset += 12
        layout.k_layers.append(LayerData(type_id, row_size, offset))
        offset += row_size * n_cells
    for type_id, row_size, n_dims in layout_desc["v"]:
        offset += 12
        layout.v_layers.append(LayerData(type_id, row_size, offset, n_dims))
        offset += row_size * (n_dims if layout.v_trans else 1) * n_cells
    layout.total = offset
    return layout


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
        layout = self.layout
        struct.pack_into("<QII", out, 0, layout.magic, 1, n_cells)
        struct.pack_into("<II", out, _PREAMBLE + layout.meta_size, layout.v_trans, layout.n_layer)
        for layer in layout.k_layers:
            struct.pack_into("<iQ", out, layer.offset - 12, layer.type, layer.row_size)
        for layer in layout.v_layers:
            if layout.v_trans:
                struct.pack_into(
                    "<iII", out, layer.offset - 12, layer.type, layer.row_size, layer.n_dims
                )
            else:
                struct.pack_into("<iQ", out, layer.offset - 12, layer.type, layer.row_size)

    def place(self, chunk: np.ndarray, expected_start: int) -> int:
        """Copy one chunk's cells (those below ``n_cells``) into place; returns how many.

        Chunks cover disjoint cells, so several may be placed at once from threads.
        """
        layout, out = self.layout, self.out
        start, n = struct.unpack_from("<II", chunk, 0)
        if start != expected_start or len(chunk) != 8 + n * self._per_cell:
            raise LayoutError("chunks do not tile the token range")
        cut = max(0, min(n, self.n_cells - start))
        end = start + cut
        meta_size = layout.cell_meta_size
        pos = 8
        dst = _PREAMBLE + start * meta_size
        out[dst : dst + cut * meta_size] = chunk[pos : pos + cut * meta_size]
        pos += n * meta_size
        for layer in layout.k_layers:
            size = layer.row_size
            out[layer.offset + start * size : layer.offset + end * size] = chunk[
                pos : pos + cut * size
            ]
            pos += n * size
        for layer in layout.v_layers:
            size = layer.row_size
            if layout.v_trans:
                grid = out[
                    layer.offset : layer.offset + size * layer.n_dims * self.n_cells
                ].reshape(layer.n_dims, self.n_cells * size)
                src = chunk[pos : pos + n * size * layer.n_dims].reshape(layer.n_dims, n * size)
                grid[:, start * size : end * size] = src[:, : cut * size]
                pos += n * size * layer.n_dims
            else:
                out[layer.offset + start * size : layer.offset + end * size] = chunk[
                    pos : pos + cut * size
                ]
                pos += n * size
        return cut

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
