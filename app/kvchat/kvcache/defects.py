"""Defects planted on purpose, for tests alone: they show that the tests comparing a
restored context with a full prefill catch a wrong KV (issue 28, item 9). Never set in use.

``KVCHAT_PLANT_DEFECT`` names one defect; unset (the default) none is planted, and a value
that names no defect raises, so a typo never passes for a clean run. Each is consulted at
its sites by a one-line ``if planted(...)``:

* ``shifted-cell``: a chain's first chunk is restored with its first cell's K rows (every
  layer) swapped with the next cell's (cold/chunk_reader.py, both readers).
* ``dropped-chunk``: the last chunk of a restore is left out (its cells' positions are
  placed, their K and V are zeros) while the restore reports every token (cold/loader.py,
  both paths).
* ``stale-ram``: the warm tier keeps a session's older state: a spill of a session it
  already holds keeps the state from before the session's last turn (warm.py).
* ``window-piece``: a sliding-window restore's last window piece takes its cells' K and V
  from one position before its own (cold/checkpoints.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from kvchat.kvcache.state.layout import StateLayout

ENV = "KVCHAT_PLANT_DEFECT"
DEFECTS = frozenset({"shifted-cell", "dropped-chunk", "stale-ram", "window-piece"})


def planted(name: str) -> bool:
    """Whether the test-only defect ``name`` is planted in this process (see the module)."""
    if name not in DEFECTS:
        raise ValueError(f"no planted defect is named {name!r}")
    value = os.environ.get(ENV, "")
    if value and value not in DEFECTS:
        raise ValueError(f"{ENV}={value!r} names no planted defect ({', '.join(sorted(DEFECTS))})")
    return value == name


def swap_k_rows(buf: np.ndarray, layout: StateLayout, cell: int) -> None:
    """``shifted-cell``: swap the K rows of ``cell`` and ``cell + 1`` in every layer."""
    for layer in layout.k_layers:
        size = layer.row_size
        if size and cell + 1 < layout.n_cells:
            rows = buf[layer.offset : layer.offset + layout.n_cells * size].reshape(-1, size)
            rows[[cell, cell + 1]] = rows[[cell + 1, cell]]


def zero_payload(targets: list[memoryview]) -> None:
    """``dropped-chunk`` (a piece of its own cells): zero every K and V range in
    ``targets`` (a piece's ranges after its cell metadata)."""
    for target in targets:
        np.frombuffer(target, dtype=np.uint8)[:] = 0


def zero_cells(buf: np.ndarray, layout: StateLayout, first: int, count: int) -> None:
    """``dropped-chunk`` (a whole state): zero the K and V of cells [first, first + count)."""
    _move_cells(buf, layout, lambda cells: cells[first : first + count].fill(0))


def shift_cells(buf: np.ndarray, layout: StateLayout, first: int) -> None:
    """``window-piece``: cells from ``first`` on (at least 1) take the K and V of the cell
    before them."""
    start = max(1, first)

    def shift(cells: np.ndarray) -> None:
        cells[start:] = cells[start - 1 : -1].copy()

    _move_cells(buf, layout, shift)


def _move_cells(buf: np.ndarray, layout: StateLayout, change: Callable[[np.ndarray], None]) -> None:
    """Apply ``change`` to each layer's K and V as an array with one row per cell."""
    n = layout.n_cells
    for layer in [*layout.k_layers, *(() if layout.v_trans else layout.v_layers)]:
        if layer.row_size:
            size = layer.row_size
            change(buf[layer.offset : layer.offset + n * size].reshape(n, size))
    if layout.v_trans:
        for layer in layout.v_layers:
            size, dims = layer.row_size, layer.n_dims
            if size and dims:
                grid = buf[layer.offset : layer.offset + size * dims * n].reshape(dims, n, size)
                change(grid.transpose(1, 0, 2))
