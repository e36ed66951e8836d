"""Parsing llama.cpp's seq-state bytes (verifying every size adds up) and cutting a token
range out of them. See :mod:`kvchat.kvcache.state.ranges`."""

from __future__ import annotations

import struct

import numpy as np

from kvchat.engine.api import KvSpec
from kvchat.kvcache.state.layout import TYPE_SIZES, LayerData, LayoutError, StateLayout


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


def parse(
    data: memoryview | bytes,
    n_layer: int | None = None,
    k_width: int | None = None,
    v_width: int | None = None,
    *,
    spec: KvSpec | None = None,
) -> StateLayout:
    """Parse a single-stream, single-sequence seq state; raise :class:`LayoutError` unless
    every byte is accounted for.

    Either ``spec`` (what the model keeps, per layer) or a uniform shape ``n_layer`` ×
    ``k_width`` / ``v_width`` (n_embd_{k,v}_gqa). An interleaved spec expects the base
    section then the sliding-window one, whose cells must be the last ``min(n, n_swa)``
    positions of the base's ``n``.
    """
    if spec is None:
        if n_layer is None or k_width is None or v_width is None:
            raise TypeError("parse needs a spec or n_layer, k_width and v_width")
        spec = KvSpec.uniform(n_layer, k_width, v_width)
    view = memoryview(data).cast("B")
    r = _Reader(view)
    (magic,) = r.take("<Q")
    base = _section(r, *spec.part(False), first_pos=0)
    base.magic = magic
    if spec.interleaved:
        window = min(base.n_cells, spec.n_swa)
        swa = _section(r, *spec.part(True), first_pos=base.n_cells - window)
        if swa.n_cells != window:
            raise LayoutError(
                f"the sliding-window part holds {swa.n_cells} cells, the window {window}"
            )
        base.swa = swa
        base.n_swa = spec.n_swa
    if r.pos != len(r.data):
        raise LayoutError(f"{len(r.data) - r.pos} unexplained bytes after the last layer")
    base.total = r.pos
    return base


def parse_section(
    data: memoryview | bytes, spec: KvSpec, end_pos: int, *, header: bool = True
) -> StateLayout:
    """Parse a sliding-window section alone (a window checkpoint: llama.cpp's state with
    ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``, whose leading u64 ``header`` is skipped) that
    must hold the last ``min(end_pos, n_swa)`` positions before ``end_pos``."""
    view = memoryview(data).cast("B")
    r = _Reader(view)
    if header:
        r.take("<Q")
    window = min(end_pos, spec.n_swa)
    section = _section(r, *spec.part(True), first_pos=end_pos - window)
    if section.n_cells != window:
        raise LayoutError(f"the window checkpoint holds {section.n_cells} cells, not {window}")
    if r.pos != len(r.data):
        raise LayoutError(f"{len(r.data) - r.pos} unexplained bytes after the window")
    section.total = r.pos
    return section


def in_position_order(
    data: memoryview | bytes, spec: KvSpec, *, partial: bool = False
) -> memoryview:
    """``data`` (a seq state, or with ``partial`` a window checkpoint: llama.cpp's partial
    state) with the sliding-window section's cells in position order.

    Without swa_full, llama.cpp's sliding-window cache is a ring: once it has wrapped, its
    state lists the window's cells in ring order (e.g. positions 366…376, then 345…365).
    The cells are the same; kvchat cuts and stores them by position, so they are put in
    order (a copy; the bytes themselves when they already are). Raises
    :class:`LayoutError` when the bytes are not such a state."""
    view = memoryview(data).cast("B")
    if not spec.interleaved:
        return view
    r = _Reader(view)
    r.take("<Q")
    if not partial:
        _section(r, *spec.part(False), first_pos=0)
    section = _section(r, *spec.part(True), first_pos=None)
    if r.pos != len(view):
        raise LayoutError(f"{len(view) - r.pos} unexplained bytes after the window")
    order = section.order
    if order is None:
        return view
    src = np.frombuffer(view, dtype=np.uint8)
    out = src.copy()
    n = section.n_cells

    def permute(offset: int, size: int) -> None:
        block = src[offset : offset + n * size].reshape(n, size)
        out[offset : offset + n * size] = block[order].reshape(-1)

    permute(section.meta_offset, section.cell_meta_size)
    for layer in section.k_layers:
        permute(layer.offset, layer.row_size)
    for layer in section.v_layers:
        if section.v_trans:
            size = layer.row_size * layer.n_dims * n
            grid = src[layer.offset : layer.offset + size].reshape(layer.n_dims, n, layer.row_size)
            out[layer.offset : layer.offset + size] = grid[:, order, :].reshape(-1)
        else:
            permute(layer.offset, layer.row_size)
    return out.data.cast("B")


def _section(
    r: _Reader, k_widths: list[int], v_widths: list[int], *, first_pos: int | None
) -> StateLayout:
    """One cache's part: tried with 12-byte cell metadata, then with the 24-byte form; and
    with a V entry for every layer, then (a model whose zero-width layers keep no V tensor)
    without the zero-width ones. Only a reading where every size adds up is taken.
    ``first_pos`` None: the cells may come in any order of one run of positions (a ring,
    see :func:`in_position_order`)."""
    start = r.pos
    errors: list[str] = []
    tries = [(False, False), (True, False)]
    if 0 in v_widths:
        tries += [(False, True), (True, True)]
    for ext, no_empty_v in tries:
        r.pos = start
        try:
            return _read_section(r, k_widths, v_widths, first_pos, ext, no_empty_v)
        except LayoutError as exc:
            errors.append(str(exc))
    r.pos = start
    raise LayoutError(errors[0])


def _read_section(
    r: _Reader,
    k_widths: list[int],
    v_widths: list[int],
    first_pos: int | None,
    ext: bool,
    no_empty_v: bool = False,
) -> StateLayout:
    offset = r.pos
    (n_stream,) = r.take("<I")
    if n_stream != 1:
        raise LayoutError(f"{n_stream} KV streams (only 1 is supported)")
    (n_cells,) = r.take("<I")
    if n_cells == 0:
        raise LayoutError("the state holds no cells")
    meta_offset = r.pos
    cell_meta_size = 24 if ext else 12
    expected_pos = first_pos
    positions: list[int] = []
    for _ in range(n_cells):
        pos, n_seq = r.take("<iI")
        if n_seq != 1:
            raise LayoutError(f"a cell belongs to {n_seq} sequences")
        r.skip(cell_meta_size - 8)
        if expected_pos is None:
            positions.append(pos)
            continue
        if pos != expected_pos:
            raise LayoutError(f"cell positions are not {first_pos}, {(first_pos or 0) + 1}, …")
        expected_pos += 1
    order: np.ndarray | None = None
    if first_pos is None:
        first_pos = min(positions)
        if sorted(positions) != list(range(first_pos, first_pos + n_cells)):
            raise LayoutError("the cells' positions are not one run")
        if positions != sorted(positions):
            order = np.argsort(np.asarray(positions), kind="stable")
    meta_size = r.pos - meta_offset
    v_trans, layers = r.take("<II")
    if layers != len(k_widths):
        raise LayoutError(f"state has {layers} layers, the model {len(k_widths)}")
    layout = StateLayout(
        n_cells, meta_offset, meta_size, cell_meta_size, v_trans, layers, offset=offset
    )
    layout.first_pos = first_pos
    layout.order = order
    for width in k_widths:
        k_type, row_size = r.take("<iQ")
        _check_row(k_type, row_size, width, "K")
        layout.k_layers.append(LayerData(k_type, row_size, r.skip(row_size * n_cells)))
    for width in v_widths:
        if not width and no_empty_v:
            continue  # llama.cpp writes nothing for a layer without a V tensor
        if not v_trans:
            v_type, row_size = r.take("<iQ")
            _check_row(v_type, row_size, width, "V")
            layout.v_layers.append(LayerData(v_type, row_size, r.skip(row_size * n_cells)))
        else:
            v_type, el_size, n_dims = r.take("<iII")
            sizes = TYPE_SIZES.get(v_type)
            if n_dims != width or sizes is None or sizes[1] != 1 or el_size != sizes[0]:
                raise LayoutError(f"transposed V of {n_dims} × {el_size} B, model width {width}")
            layout.v_layers.append(
                LayerData(v_type, el_size, r.skip(el_size * n_dims * n_cells), n_dims)
            )
    layout.total = r.pos
    return layout


def _check_row(type_id: int, row_size: int, width: int, what: str) -> None:
    if type_id not in TYPE_SIZES:
        raise LayoutError(f"{what} of unknown ggml type {type_id}")
    block_bytes, block_elems = TYPE_SIZES[type_id]
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
