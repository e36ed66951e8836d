"""Window checkpoints: what lets a sliding-window model branch at any message.

llama.cpp's seq state of a model with sliding-window layers (Gemma 2/3) holds every cell
of its full-attention layers but only the last ``n_swa`` cells of its sliding-window
layers. The full-attention part is chunked like any model's
(:mod:`kvchat.kvcache.chunking`); the window part can only resume where it was taken.
So the window's cells are saved as a **checkpoint** at the positions where conversations
branch: where a regenerate of the last prompt starts, and where the next turn starts (both
taken by the engine while it decodes, see ``LlamaEngine.take_checkpoints``), plus the end
of the saved state. A checkpoint is at most ``n_swa`` cells (bounded by the window).

A checkpoint is stored like a chunk: a ``KVCCHNK1`` file named from its key, a row in
``kv_chunks`` (start = first cell, n_tokens = cells), its key derived from the fingerprint
and the token ids before its position (:func:`chunking.checkpoint_key`), so sessions that
share a prefix share their checkpoints, and a snapshot row lists its own as
``[[position, key], …]``. Restoring at position Q joins the chunks cut to Q and the
checkpoint at Q into one state. Where no checkpoint lets the next token see its whole
window, the restore is refused with the reason, never placed short.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvchat.engine import Engine
from kvchat.kvcache import layout as kvlayout
from kvchat.kvcache.chunking import checkpoint_key
from kvchat.kvcache.errors import SnapshotRejected
from kvchat.kvcache.format import valid_key
from kvchat.store import SnapshotRow

# Window checkpoints a snapshot keeps (the newest positions); each is at most n_swa cells.
MAX_CHECKPOINTS = 24


@dataclass(frozen=True)
class WindowPoint:
    """Where a sliding-window snapshot can be restored: ``tokens`` cells of the chain,
    with the window from the checkpoint ``key`` at ``position`` (``position`` ≥
    ``tokens``: a checkpoint holding every cell from 0 serves any earlier cut)."""

    tokens: int
    position: int
    key: str


def reuse_point(engine: Engine, held: Sequence[int], prompt: Sequence[int]) -> int:
    """Where the engine's prefill starts decoding ``prompt`` over ``held``."""
    method = getattr(engine, "reuse_point", None)
    if method is not None:
        return int(method(held, prompt))
    shared = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        shared += 1
    return max(0, min(shared, len(prompt) - 2))


def deepest_start(held: Sequence[int], prompt: Sequence[int]) -> int:
    """The furthest a prefill can start into ``held`` for ``prompt`` at all (the common
    prefix, less the two tokens it always decodes), alignment aside."""
    shared = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        shared += 1
    return max(0, min(shared, len(prompt) - 2))


def restore_floor(engine: Engine, n_tokens: int) -> int:
    """The lowest cut of a context restored with ``n_tokens`` tokens (0: any)."""
    method = getattr(engine, "restore_floor", None)
    return int(method(n_tokens)) if method is not None else 0


def continuation(tokens: Sequence[int]) -> list[int]:
    """A stand-in prompt that continues ``tokens`` (two ids no vocabulary has)."""
    return [*tokens, -1, -1]


def choose(
    row: SnapshotRow, keep: int, prompt: Sequence[int] | None, engine: Engine
) -> WindowPoint:
    """The best place to restore ``row`` (a sliding-window chain) for ``prompt``, at most
    ``keep`` tokens in. Raises :class:`SnapshotRejected` saying why none will do."""
    n_swa = window_size(row)
    target = list(prompt) if prompt is not None else continuation(row.token_ids[:keep])
    best: WindowPoint | None = None
    for position, key in row.checkpoints:
        if not (0 < position <= min(keep, row.n_tokens)) or not valid_key(key):
            continue
        held = row.token_ids[:position]
        if reuse_point(engine, held, target) >= restore_floor(engine, position):
            point = WindowPoint(position, position, key)
        elif position <= n_swa:
            # Every cell from 0 is in this checkpoint: cut it where the prompt parts.
            shared = reuse_point(engine, held, target)
            point = WindowPoint(shared, position, key)
        else:
            continue
        if point.tokens > 0 and (best is None or point.tokens > best.tokens):
            best = point
    if best is None:
        wanted = reuse_point(engine, row.token_ids[:keep], target)
        saved = sorted(position for position, _ in row.checkpoints)
        where = ", ".join(f"{p:,}" for p in saved[-4:]) if saved else "none"
        raise SnapshotRejected(
            f"sliding-window model: no window checkpoint lets the KV be cut back to token "
            f"{wanted:,} (checkpoints at {where}); the window would lack cells the next "
            "token attends to"
        )
    return best


def window_size(row: SnapshotRow) -> int:
    swa = (row.layout or {}).get("swa")
    return int(swa.get("n_swa", 0)) if isinstance(swa, dict) else 0


def check_keys(row: SnapshotRow) -> None:
    """Every listed checkpoint's key must derive from the row's tokens and fingerprint."""
    for position, key in row.checkpoints:
        if position > row.n_tokens or key != checkpoint_key(
            row.fingerprint, row.token_ids, position
        ):
            raise SnapshotRejected("the snapshot's window checkpoint keys do not match its tokens")


def verify_section(
    data: np.ndarray, layout_desc: dict[str, Any], position: int
) -> kvlayout.StateLayout:
    """Parse a stored checkpoint (a window section ending at ``position``) against the
    row's layout: every size must add up and match the recorded sliding-window part."""
    spec = kvlayout.swa_spec(layout_desc)
    if spec is None:
        raise SnapshotRejected("the snapshot's layout has no sliding-window part")
    try:
        section = kvlayout.parse_section(memoryview(data), spec, position, header=False)
    except kvlayout.LayoutError as exc:
        raise SnapshotRejected(f"a window checkpoint does not fit its snapshot: {exc}") from None
    recorded = {k: v for k, v in layout_desc["swa"].items() if k != "n_swa"}
    described = section.describe()
    del described["magic"]
    if described != recorded:
        raise SnapshotRejected("a window checkpoint's layout differs from its snapshot's")
    return section


def cut_section(data: np.ndarray, section: kvlayout.StateLayout, n_cells: int) -> np.ndarray:
    """The section holding only the first ``n_cells`` cells of ``section`` (whose cells
    start at position 0): the window of an earlier cut, before the window filled."""
    if n_cells == section.n_cells:
        return data
    if section.first_pos != 0 or not 0 < n_cells < section.n_cells:
        raise SnapshotRejected("a window checkpoint cannot be cut there")
    # The section is a one-stream state without the leading u64: reuse the chunk helpers.
    shifted = kvlayout.StateLayout(
        n_cells=section.n_cells,
        meta_offset=section.meta_offset,
        meta_size=section.meta_size,
        cell_meta_size=section.cell_meta_size,
        v_trans=section.v_trans,
        n_layer=section.n_layer,
        k_layers=section.k_layers,
        v_layers=section.v_layers,
    )
    cells = kvlayout.extract(data, shifted, 0, n_cells)
    desc = shifted.describe()
    out = np.zeros(kvlayout.layout_for(desc, n_cells).total, dtype=np.uint8)
    assembler = kvlayout.Assembler(out, desc, n_cells)
    assembler.finish(assembler.place(cells, 0))
    return out[8:]  # without the u64 a whole state starts with
