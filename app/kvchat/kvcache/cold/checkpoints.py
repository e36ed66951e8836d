"""Window checkpoints: what lets a sliding-window model branch where conversations branch.

llama.cpp's seq state of a model with sliding-window layers (Gemma 2/3) holds every cell
of its full-attention layers but only the last ``n_swa`` cells of its sliding-window
layers. The full-attention part is chunked like any model's
(:mod:`kvchat.kvcache.cold.chains`); the window part can only resume where it was taken.
So the engine takes the window's cells (llama.cpp's partial state) where branches start:
where a regenerate of the last prompt starts and where the next turn starts (see
``LlamaEngine.take_checkpoints``); the end of the saved state is one more. Each such
checkpoint is at most ``n_swa`` cells, bounded by the window.

A checkpoint is stored as **pieces**: the cells of positions [start, end) on a grid of
:data:`PIECE_TOKENS`, each a ``KVCCHNK1`` file and a ``kv_chunks`` row named from its key
(:func:`chunking.window_key`: the fingerprint, the token ids before ``end``, ``start``).
Consecutive checkpoints overlap by most of a window, and so do the sessions that share a
prefix: a piece is written once, and a turn writes only the cells that are new. A snapshot
row lists its pieces as ``[[start, end, key], …]``.

A state can be restored at position Q when its pieces hold every cell the window keeps
there (positions [Q - n_swa, Q), or [0, Q) before the window fills): the chunks cut to Q
and those cells joined into one state. Where no Q near the branch point has them, the
restore is refused with the reason: a window is never placed short of cells the next
token attends to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvchat.engine import SeqStateEngine
from kvchat.kvcache import defects
from kvchat.kvcache.cold.chains import window_key
from kvchat.kvcache.cold.formats import valid_key
from kvchat.kvcache.rejected import SnapshotRejected
from kvchat.kvcache.state import ranges as kvlayout
from kvchat.store import SnapshotRow

# The grid window pieces are cut on: shared between checkpoints and sessions.
PIECE_TOKENS = 64


@dataclass(frozen=True)
class Piece:
    """Window cells of positions [start, end), stored under ``key``."""

    start: int
    end: int
    key: str

    def to_json(self) -> list[Any]:
        return [self.start, self.end, self.key]


@dataclass(frozen=True)
class WindowPoint:
    """Where a sliding-window snapshot is restored: ``tokens`` cells of the chain, with
    the window cells [first, tokens) taken from ``pieces`` (in position order)."""

    tokens: int
    first: int
    pieces: list[Piece] = field(default_factory=list)


def deepest_start(held: Sequence[int], prompt: Sequence[int]) -> int:
    """The furthest a prefill can start into ``held`` for ``prompt`` at all (the common
    prefix, less the two tokens it always decodes), alignment aside."""
    shared = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        shared += 1
    return max(0, min(shared, len(prompt) - 2))


def continuation(tokens: Sequence[int]) -> list[int]:
    """A stand-in prompt that continues ``tokens`` (two ids no vocabulary has)."""
    return [*tokens, -1, -1]


def window_size(row: SnapshotRow) -> int:
    swa = (row.layout or {}).get("swa")
    return int(swa.get("n_swa", 0)) if isinstance(swa, dict) else 0


def window_first(position: int, n_swa: int) -> int:
    """The first position whose window cells a state ending at ``position`` keeps."""
    return max(0, position - n_swa)


def pieces_of(row: SnapshotRow) -> list[Piece]:
    return [Piece(int(s), int(e), str(k)) for s, e, k in row.checkpoints]


def grid(first: int, end: int) -> list[tuple[int, int]]:
    """The pieces [start, end) of positions [first, end) on the :data:`PIECE_TOKENS` grid."""
    cuts = list(range((first // PIECE_TOKENS + 1) * PIECE_TOKENS, end, PIECE_TOKENS))
    bounds = [first, *cuts, end]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]


def cover(pieces: Sequence[Piece], first: int, end: int) -> list[Piece] | None:
    """Pieces that together hold every position of [first, end), in order; None if they
    can't. Prefers the piece reaching furthest at each step."""
    chosen: list[Piece] = []
    at = first
    while at < end:
        best: Piece | None = None
        for piece in pieces:
            if piece.start <= at < piece.end and (best is None or piece.end > best.end):
                best = piece
        if best is None:
            return None
        chosen.append(best)
        at = best.end
    return chosen


def choose(
    row: SnapshotRow, keep: int, prompt: Sequence[int] | None, engine: SeqStateEngine
) -> WindowPoint:
    """The furthest position, at most ``keep`` tokens into ``row`` (a sliding-window
    chain), where it can be restored for ``prompt`` exactly: the window's cells there are
    in the row's pieces, and the prefill will start at or after the window's floor.
    Raises :class:`SnapshotRejected` saying why none will do."""
    n_swa = window_size(row)
    target = list(prompt) if prompt is not None else continuation(row.token_ids[:keep])
    pieces = [p for p in pieces_of(row) if valid_key(p.key) and p.end <= row.n_tokens]
    shared = deepest_start(row.token_ids[:keep], target)
    align = max(1, engine.batch_align)

    def start_at(q: int) -> int:
        """The engine's reuse point over the first q tokens (see ``reuse_point``)."""
        deepest = min(q, shared)
        return deepest - deepest % align

    limit = start_at(keep)
    ends = sorted({p.end for p in pieces} | {limit}, reverse=True)
    candidates: list[int] = []
    for end in ends:
        if end > limit:
            continue
        candidates.append(end)
        # An end off the prefill's alignment, and the alignment just below it.
        candidates += [q for q in range(end - 1, max(0, end - 8), -1)]
    for q in sorted({q for q in candidates if q > 0}, reverse=True):
        if start_at(q) < engine.restore_floor(q):
            continue
        first = window_first(q, n_swa)
        chosen = cover(pieces, first, q)
        if chosen is not None:
            return WindowPoint(q, first, chosen)
    saved = sorted({p.end for p in pieces})
    where = ", ".join(f"{p:,}" for p in saved[-4:]) if saved else "none"
    raise SnapshotRejected(
        f"sliding-window model: no window checkpoint lets the KV be cut back to token "
        f"{limit:,} (checkpoints end at {where}); the window would lack cells the next "
        "token attends to"
    )


def check_keys(row: SnapshotRow) -> None:
    """Every listed piece's key must derive from the row's tokens and fingerprint."""
    for piece in pieces_of(row):
        if piece.end > row.n_tokens or piece.key != window_key(
            row.fingerprint, row.token_ids, piece.start, piece.end
        ):
            raise SnapshotRejected("the snapshot's window checkpoint keys do not match its tokens")


def section_desc(layout_desc: dict[str, Any]) -> dict[str, Any]:
    """The sliding-window part of a (checked) description, as a one-section description
    :func:`kvlayout.layout_for` and :class:`kvlayout.Assembler` take."""
    swa = {k: v for k, v in layout_desc["swa"].items() if k != "n_swa"}
    return {"magic": 0, **swa}


def assemble_window(
    pieces: Sequence[tuple[Piece, np.ndarray]],
    layout_desc: dict[str, Any],
    first: int,
    end: int,
) -> np.ndarray:
    """The window section (no leading u64) holding positions [first, end), from verified
    piece chunks; checked cell by cell against the row's layout."""
    desc = section_desc(layout_desc)
    n_cells = end - first
    try:
        out = np.zeros(kvlayout.layout_for(desc, n_cells).total, dtype=np.uint8)
        assembler = kvlayout.Assembler(out, desc, n_cells)
        for piece, data in pieces:
            lo, hi = max(piece.start, first), min(piece.end, end)
            if lo < hi:
                assembler.place_cells(data, lo - piece.start, hi - lo, lo - first)
        if defects.planted("window-piece") and pieces:  # test-only: see defects.py
            defects.shift_cells(out, assembler.layout, max(pieces[-1][0].start, first) - first)
        section = out[8:]
        spec = kvlayout.swa_spec(layout_desc)
        assert spec is not None
        parsed = kvlayout.parse_section(section.data, spec, end, header=False)
    except (kvlayout.LayoutError, ValueError, IndexError) as exc:
        raise SnapshotRejected(f"the window checkpoint does not fit its snapshot: {exc}") from None
    described = parsed.describe()
    del described["magic"]
    if described != {k: v for k, v in desc.items() if k != "magic"}:
        raise SnapshotRejected("a window checkpoint's layout differs from its snapshot's")
    return section
