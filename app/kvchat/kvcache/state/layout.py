"""What a llama.cpp seq state looks like: its layout (:class:`StateLayout`, where every
piece of one section lives), and the per-model constants recorded with a chunk chain (the
*description*: :meth:`StateLayout.describe`, checked by :func:`check_desc` when read back,
turned into a whole state's layout by :func:`layout_for`). See :mod:`kvchat.kvcache.state.ranges`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvchat.engine.api import KvSpec

# u64 magic, u32 n_stream, u32 cell_count: what precedes the cell metadata.
PREAMBLE = 16

# Bytes per block and elements per block of the KV cache types llama.cpp can use (ggml
# type ids): f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, bf16.
TYPE_SIZES = {
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
    # Cells listed out of position order (a ring's state): the order that sorts them, as
    # parsed by in_position_order; None when they are in order.
    order: Any = None

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
            if isinstance(kind, bool) or not isinstance(kind, int) or kind not in TYPE_SIZES:
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
    block_bytes, block_elems = TYPE_SIZES[type_id]
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
        meta_offset=PREAMBLE,
        meta_size=n_cells * layout_desc["cell_meta_size"],
        cell_meta_size=layout_desc["cell_meta_size"],
        v_trans=layout_desc["v_trans"],
        n_layer=layout_desc["n_layer"],
        magic=layout_desc["magic"],
    )
    offset = PREAMBLE + layout.meta_size + 8
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
