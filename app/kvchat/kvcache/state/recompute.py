"""Checking KV that came from elsewhere by computing part of it again here.

A bundle's hashes show that its KV arrived as its maker wrote it, not that its maker
wrote the KV of its own tokens: a forger can put another conversation's KV under them and
recompute the hashes. The first chunk of an imported chain is therefore recomputed (a
short prefill of its tokens on this model) and compared with the bundle's, cell by cell,
layer by layer. KV computed for the same tokens by the same model, llama.cpp version and
KV types differs only by rounding (batch sizes change the order of sums); KV of other
tokens differs entirely. What this does not prove: that the cells after the first chunk
are what their tokens give (a forger who keeps the first chunk genuine passes), which is
why imported KV stays in its own trust domain (see ``Fingerprint.origin``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from kvchat.engine import SeqStateEngine
from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.kvcache.state import ranges as kvlayout

# A cell whose K or V (any layer) differs from the recomputed one by more than this
# relative error (L2 norm of the difference over the norm of the recomputed row) is not
# the KV of its token. Rounding between batch sizes stays far below it (see the README).
MAX_CELL_ERROR = 0.05
# At most this many tokens are recomputed (the first chunk, or a blob's first tokens).
MAX_CHECK_TOKENS = 256


@dataclass(frozen=True)
class FirstChunkCheck:
    """What recomputing the first cells of imported KV showed."""

    tokens: int  # cells compared
    ms: float  # the prefill and the comparison
    worst: float  # the largest relative error of a cell (0: identical)
    note: str | None = None  # why some of it could not be compared (a KV type not decoded)


def _as_float(raw: np.ndarray, type_id: int, n_rows: int) -> np.ndarray | None:
    """``raw`` (``n_rows`` rows of one KV type) as float32 rows, or None for a type not
    decoded here. A NaN or an infinity stays one (an f16 NaN, a block scale that is one):
    the comparison refuses any (see :func:`compare_cells`)."""
    with np.errstate(all="ignore"):  # inf * 0 in a damaged block: NaN, refused below
        if type_id == 0:
            values = raw.view(np.float32)
        elif type_id == 1:
            values = raw.view(np.float16).astype(np.float32)
        elif type_id == 30:
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif type_id == 8 and raw.size % 34 == 0:  # q8_0: f16 scale, 32 int8
            blocks = raw.reshape(-1, 34)
            scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            quants = blocks[:, 2:].view(np.int8).astype(np.float32)
            values = (quants * scale).reshape(-1)
        elif type_id == 2 and raw.size % 18 == 0:  # q4_0: f16 scale, 32 nibbles - 8
            blocks = raw.reshape(-1, 18)
            scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            packed = blocks[:, 2:]
            quants = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
            values = ((quants - 8) * scale).reshape(-1)
        else:
            return None
    return values.reshape(n_rows, -1)


def _cell_errors(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Per row: |theirs - ours| / |ours| (L2), rows of zeros counted as exact; a row
    holding a NaN or an infinity on either side counts as entirely different (inf)."""
    with np.errstate(all="ignore"):
        diff = np.linalg.norm(theirs - ours, axis=1)
        scale = np.linalg.norm(ours, axis=1)
        errors = np.where(
            scale > 0, diff / np.maximum(scale, 1e-30), np.where(diff > 0, np.inf, 0.0)
        )
    finite = np.isfinite(ours).all(axis=1) & np.isfinite(theirs).all(axis=1)
    return np.where(finite & np.isfinite(errors), errors, np.inf)


def _worse(worst: float, error: float) -> float:
    """The larger of two errors, where a NaN counts as the largest of all (``max(0.0,
    nan)`` is 0.0: a NaN would have passed the check)."""
    return error if not error <= worst else worst


def compare_cells(
    ours: np.ndarray, theirs: np.ndarray, layout: kvlayout.StateLayout, n: int
) -> tuple[float, str | None]:
    """The largest per-cell relative error between two extracted chunks of ``n`` cells
    (:func:`kvlayout.extract`'s form: header, cell metadata, K per layer, V per layer)."""
    if ours.shape != theirs.shape:
        return float("inf"), None
    at = 8 + n * layout.cell_meta_size
    if not np.array_equal(ours[:at], theirs[:at]):
        return float("inf"), None  # other positions or sequences than these tokens'
    worst = 0.0
    skipped: set[int] = set()
    sections: list[tuple[kvlayout.LayerData, int, bool]] = [
        (layer, n * layer.row_size, False) for layer in layout.k_layers
    ]
    for layer in layout.v_layers:
        size = layer.row_size * layer.n_dims * n if layout.v_trans else n * layer.row_size
        sections.append((layer, size, bool(layout.v_trans)))
    for layer, size, transposed in sections:
        a, b = ours[at : at + size], theirs[at : at + size]
        at += size
        rows = layer.n_dims if transposed else n
        a_rows, b_rows = _as_float(a, layer.type, rows), _as_float(b, layer.type, rows)
        if a_rows is None or b_rows is None:
            skipped.add(layer.type)
            if not np.array_equal(a, b):
                worst = _worse(worst, float(np.mean(a != b)))
            continue
        if transposed:  # one row per V dimension: a cell is a column
            a_rows, b_rows = a_rows.T, b_rows.T
        errors = _cell_errors(a_rows, b_rows)
        if errors.size:
            worst = _worse(worst, float(errors.max()))
    note = (
        f"KV type {', '.join(map(str, sorted(skipped)))} compared byte by byte" if skipped else None
    )
    return (worst if math.isfinite(worst) else float("inf")), note


def check_first_cells(
    engine: SeqStateEngine,
    shape: tuple[int, int, int],
    tokens: list[int],
    theirs: np.ndarray,
    n: int,
) -> FirstChunkCheck:
    """Prefill ``tokens[:n]`` on an empty context and compare its KV with ``theirs`` (the
    imported cells [0, n) in extract form). Leaves the context empty. Raises
    :class:`SnapshotRejected` when the imported cells are not the KV of their tokens."""
    started = time.perf_counter()
    engine.clear()
    try:
        try:
            engine.prefill(tokens[:n])
            state = engine.state_get()
            parsed = kvlayout.parse(state, *shape)
            ours = kvlayout.extract(np.frombuffer(state, dtype=np.uint8), parsed, 0, n)
        except kvlayout.LayoutError as exc:
            raise SnapshotRejected(f"the recomputed KV cannot be compared ({exc})") from None
        except Exception as exc:  # llama.cpp refuses token ids this model doesn't have
            raise SnapshotRejected(
                f"the KV's tokens cannot be read by this model ({str(exc)[:120]})"
            ) from None
        worst, note = compare_cells(ours, theirs, parsed, n)
    finally:
        engine.clear()
    ms = (time.perf_counter() - started) * 1000
    if not worst <= MAX_CELL_ERROR:
        shown = "entirely" if not math.isfinite(worst) else f"by {worst:.0%}"
        raise SnapshotRejected(
            f"the KV is not what its own tokens give: its first {n} cells differ {shown} "
            f"from the same tokens computed here ({ms:.0f} ms to check)"
        )
    return FirstChunkCheck(n, ms, worst, note)
