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

A model with sliding-window layers (Gemma 2/3: llama.cpp's interleaved cache,
``llama_kv_cache_iswa``) writes two such sections after the leading u64: the **base**
part (its full-attention layers, every cell) and then the **SWA** part (its sliding-window
layers, only the cells the window still sees: the last ``n_swa`` positions). The base part
is chunked like a unified cache; the SWA part is kept whole per position (a window
checkpoint, :func:`parse_section`) and appended when a state is reassembled.

What the parser checks against comes from the model (:class:`KvSpec`): which layers keep a
cache, each layer's K and V width (they may differ per layer), and which layers slide. A
cell's metadata is 12 bytes (pos, n_seq_id = 1, seq id), or 24 when llama.cpp stores the
cell's extra fields (M-RoPE positions, per-layer-embedding token ids): both are tried, and
only a reading where every size adds up exactly is accepted.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvchat.engine.base import KvSpec

__all__ = ["KvSpec", "LayoutError", "StateLayout", "parse", "parse_section"]


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
    # Where this section starts (its u32 n_stream) and the position of its first cell.
    offset: int = 8
    first_pos: int = 0
    # The sliding-window section that follows the base one (interleaved caches), or None.
    swa: StateLayout | None = None
    n_swa: int = 0

    def describe(self) -> dict[str, Any]:
        """The per-model constants, recorded with a chunk chain and checked on restore."""
        desc = {
            "magic": self.magic,
            "cell_meta_size": self.cell_meta_size,
            "v_trans": self.v_trans,
            "n_layer": self.n_layer,
            "k": [[layer.type, layer.row_size] for layer in self.k_layers],
            "v": [[layer.type, layer.row_size, layer.n_dims] for layer in self.v_layers],
        }
        if self.swa is not None:
            swa = self.swa.describe()
            del swa["magic"]
            swa["n_swa"] = self.n_swa
            desc["swa"] = swa
        return desc

    @property
    def end(self) -> int:
        """Where the base section ends (the SWA section, if any, starts here)."""
        return self.swa.offset if self.swa is not None else self.total

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


def _section(
    r: _Reader, k_widths: list[int], v_widths: list[int], *, first_pos: int
) -> StateLayout:
    """One cache's part: tried with 12-byte cell metadata, then with the 24-byte form; and
    with a V entry for every layer, then (a model whose zero-width layers keep no V tensor)
    without the zero-width ones. Only a reading where every size adds up is taken."""
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
    first_pos: int,
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
    for _ in range(n_cells):
        pos, n_seq = r.take("<iI")
        if n_seq != 1:
            raise LayoutError(f"a cell belongs to {n_seq} sequences")
        r.skip(cell_meta_size - 8)
        if pos != expected_pos:
            raise LayoutError(f"cell positions are not {first_pos}, {first_pos + 1}, …")
        expected_pos += 1
    meta_size = r.pos - meta_offset
    v_trans, layers = r.take("<II")
    if layers != len(k_widths):
        raise LayoutError(f"state has {layers} layers, the model {len(k_widths)}")
    layout = StateLayout(
        n_cells, meta_offset, meta_size, cell_meta_size, v_trans, layers, offset=offset
    )
    layout.first_pos = first_pos
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
            sizes = _TYPE_SIZES.get(v_type)
            if n_dims != width or sizes is None or sizes[1] != 1 or el_size != sizes[0]:
                raise LayoutError(f"transposed V of {n_dims} × {el_size} B, model width {width}")
            layout.v_layers.append(
                LayerData(v_type, el_size, r.skip(el_size * n_dims * n_cells), n_dims)
            )
    layout.total = r.pos
    return layout


# u64 magic, u32 n_stream, u32 cell_count: what precedes the cell metadata.
_PREAMBLE = 16

# Bytes per block and elements per block of the KV cache types llama.cpp can use (ggml
# type ids): f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, bf16.
_TYPE_SIZES = {
    0: (4, 1),
    1: (2, 1),
    2: (18, 32),
    3: (20, 32),
    6: (22, 32),
    7: (24, 32),
    8: (34, 32),
    20: (18, 32),
    30: (2, 1),
}


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
    writes: counts where counts belong, a known type for every layer, one K entry per
    layer and at most one V entry per layer (a layer without V has none), and for an
    interleaved cache a ``swa`` part of the same form with its window ``n_swa``. A layout
    read back from the database is checked before it is used."""
    if not isinstance(layout_desc, dict):
        raise LayoutError("layout is not a JSON object")
    if "magic" not in layout_desc:
        raise LayoutError("layout has no 'magic'")
    _count(layout_desc["magic"], "magic", 1 << 64)
    _check_part(layout_desc, "layout")
    if "swa" in layout_desc:
        swa = layout_desc["swa"]
        if not isinstance(swa, dict):
            raise LayoutError("layout 'swa' is not a JSON object")
        _check_part(swa, "layout 'swa'")
        if _count(swa.get("n_swa"), "n_swa") == 0:
            raise LayoutError("layout 'swa' has no window")


def _check_part(desc: dict[str, Any], what: str) -> None:
    for name in ("cell_meta_size", "v_trans", "n_layer", "k", "v"):
        if name not in desc:
            raise LayoutError(f"{what} has no {name!r}")
    if desc["cell_meta_size"] not in (12, 24) or isinstance(desc["cell_meta_size"], bool):
        raise LayoutError(f"{what} field cell_meta_size is {desc['cell_meta_size']!r}")
    n_layer = _count(desc["n_layer"], "n_layer")
    if _count(desc["v_trans"], "v_trans") > 1:
        raise LayoutError(f"{what} field v_trans is {desc['v_trans']!r}")
    for name, width in (("k", 2), ("v", 3)):
        layers = desc[name]
        if not isinstance(layers, list) or not (
            len(layers) == n_layer or (name == "v" and len(layers) < n_layer)
        ):
            raise LayoutError(f"{what} {name!r} does not list {n_layer} layers")
        for layer in layers:
            if not isinstance(layer, list) or len(layer) != width:
                raise LayoutError(f"{what} {name!r} has a malformed layer: {layer!r}")
            kind = layer[0]
            if isinstance(kind, bool) or not isinstance(kind, int) or kind not in _TYPE_SIZES:
                raise LayoutError(f"{what} {name!r} has a layer of unknown type {layer[0]!r}")
            for value in layer[1:]:
                _count(value, f"{name} row size")


def base_desc(layout_desc: dict[str, Any]) -> dict[str, Any]:
    """The description without its sliding-window part (what the chunks hold)."""
    return {key: value for key, value in layout_desc.items() if key != "swa"}


def swa_spec(layout_desc: dict[str, Any]) -> KvSpec | None:
    """The sliding-window part of a (checked) description as a spec for
    :func:`parse_section`, with the widths its rows give; None without one."""
    swa = layout_desc.get("swa")
    if not isinstance(swa, dict):
        return None
    k_widths = [_width(t, size) for t, size in swa["k"]]
    v_widths = [n_dims if swa["v_trans"] else _width(t, size) for t, size, n_dims in swa["v"]]
    v_widths += [0] * (len(k_widths) - len(v_widths))
    n = len(k_widths)
    return KvSpec(tuple(k_widths), tuple(v_widths), (True,) * n, swa["n_swa"])


def _width(type_id: int, row_size: int) -> int:
    block_bytes, block_elems = _TYPE_SIZES[type_id]
    return row_size // block_bytes * block_elems


def layout_for(layout_desc: dict[str, Any], n_cells: int) -> StateLayout:
    """The layout of a whole state of ``n_cells`` cells with these per-model constants
    (for an interleaved cache: its base section; the sliding-window section follows at
    ``total``).

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

    def place_cells(self, chunk: np.ndarray, first: int, count: int, at: int) -> None:
        """Copy cells [first, first + count) of ``chunk`` (whatever start its header names)
        to cells [at, at + count) of the output."""
        layout, out = self.layout, self.out
        (n,) = struct.unpack_from("<I", chunk, 4)
        if len(chunk) != 8 + n * self._per_cell:
            raise LayoutError("a chunk's size does not match its cell count")
        if first < 0 or count < 0 or first + count > n or at < 0 or at + count > self.n_cells:
            raise LayoutError("cells out of range")
        meta_size = layout.cell_meta_size
        pos = 8
        dst = _PREAMBLE + at * meta_size
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
