"""Bytes: what a token costs in the KV cache per cache type, what a snapshot (llama.cpp's seq
state) grows by, the attention kind in words, and sizes read from and written as text."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.planner.model_info import ModelInfo

KiB, MiB, GiB = 1024, 1024**2, 1024**3

# ggml type → (elements per block, bytes per block)
KV_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
}
CLI_KV_TYPES = ("f16", "q8_0", "q4_0")


def row_bytes(n_elems: int, kv_type: str) -> int:
    """Bytes of one cache row of ``n_elems`` elements stored as ``kv_type``."""
    try:
        block, size = KV_TYPES[kv_type]
    except KeyError:
        raise KvchatError(
            f"unknown KV cache type {kv_type!r}: use one of {', '.join(CLI_KV_TYPES)}"
        ) from None
    if n_elems % block:
        raise KvchatError(
            f"a {kv_type} KV cache needs rows that are a multiple of {block} "
            f"elements; this model's rows have {n_elems}"
        )
    return n_elems // block * size


@dataclass(frozen=True)
class KvPerToken:
    """KV-cache bytes each token costs, split by layer kind."""

    full: int  # all full-attention layers together
    swa: int  # all sliding-window layers together
    per_layer: tuple[int, ...]

    @property
    def total(self) -> int:
        """Per token when every layer holds the token (swa_full, or n_ctx ≤ window)."""
        return self.full + self.swa


# Bytes of llama.cpp's per-cell metadata in a seq state (pos, n_seq_id, one seq id).
CELL_META_BYTES = 12


def state_bytes_per_token(info: ModelInfo, kv: KvPerToken) -> int:
    """How much llama.cpp's seq state (a kvchat snapshot) grows per token: every layer's
    KV rows plus the cell metadata, except that sliding-window layers keep only their
    window's cells, so past the window only the full-attention layers grow."""
    meta = cell_meta_bytes(info)
    if not kv.total:
        return 0  # no layer keeps per-token KV (Mamba): a fixed recurrent state only
    if info.sliding_window and kv.swa:
        return kv.full + meta
    return kv.total + meta


# Architectures whose cells carry M-RoPE's extra positions: 24 bytes of metadata per cell
# (measured on qwen35), not 12.
MROPE_ARCHS = frozenset({"qwen35", "qwen35moe"})


def cell_meta_bytes(info: ModelInfo) -> int:
    """Bytes of metadata per cell in llama.cpp's seq state for this model."""
    return 2 * CELL_META_BYTES if info.architecture in MROPE_ARCHS else CELL_META_BYTES


def state_window_bytes(info: ModelInfo, kv: KvPerToken) -> int:
    """The fixed part of a sliding-window model's seq state once the window is full: its
    sliding-window layers' cells (plus their metadata) for ``window`` positions. 0 without
    sliding-window layers."""
    if not (info.sliding_window and kv.swa):
        return 0
    return info.sliding_window * (kv.swa + CELL_META_BYTES)


def attention_of(path: str | Path) -> str:
    """:func:`attention_summary` of a GGUF file, or "attention unknown" when unreadable."""
    from kvchat.planner.gguf_info import read_gguf

    try:
        return attention_summary(read_gguf(path))
    except KvchatError:
        return "attention unknown"


def attention_summary(info: ModelInfo) -> str:
    """The attention kind in words, e.g. "GQA 9/3" or "MQA 4/1, sliding window 512 on 15
    of 18 layers"."""
    pairs = [(h, kv) for h, kv in zip(info.n_head, info.n_head_kv) if kv]
    heads = "/".join(sorted({f"{h}/{kv}" for h, kv in pairs})) if pairs else "no KV"
    text = f"{info.attention_kind} {heads}"
    n_swa = sum(1 for il in range(info.n_layer) if info.swa_layers[il] and info.n_head_kv[il])
    if info.sliding_window and n_swa:
        with_kv = sum(1 for kv in info.n_head_kv if kv)
        text += f", sliding window {info.sliding_window:,} on {n_swa} of {with_kv} layers"
    return text


def kv_bytes_per_token(
    info: ModelInfo, type_k: str = "f16", type_v: str | None = None
) -> KvPerToken:
    """Per-token KV bytes: Σ layers row(n_kv·d_k, type_k) + row(n_kv·d_v, type_v)."""
    type_v = type_v or type_k
    full = swa = 0
    per_layer = []
    for il in range(info.n_layer):
        kv_heads = info.n_head_kv[il]
        d_k, d_v = info.head_dims(il)
        size = (
            row_bytes(kv_heads * d_k, type_k) + row_bytes(kv_heads * d_v, type_v) if kv_heads else 0
        )
        per_layer.append(size)
        if info.swa_layers[il]:
            swa += size
        else:
            full += size
    return KvPerToken(full=full, swa=swa, per_layer=tuple(per_layer))


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": GiB,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mib": MiB,
    "mb": 10**6,
    "g": GiB,
    "gib": GiB,
    "gb": 10**9,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """``"6GiB"``, ``"6G"`` and a bare ``"6"`` are 6·2³⁰ bytes; ``"6GB"`` is 6·10⁹."""
    match = _SIZE.match(text)
    unit = (match.group(2) or "").lower() if match else None
    if not match or unit not in _UNITS:
        raise KvchatError(f"not a size: {text!r} (try 6GiB, 5.5GiB, 8000MiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
