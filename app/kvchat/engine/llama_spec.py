"""What a model's KV cache holds per layer, read from its GGUF metadata (the same reading as
the memory planner's), for the seq-state parser that cuts states into chunks; or why its
state cannot be cut. Also whether its weights are repacked (batch alignment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import llama_cpp

from kvchat.engine.api import KvSpec
from kvchat.errors import KvchatError

# Weight types llama.cpp's CPU backend repacks (ggml-cpu/repack.cpp). Their matrix products
# take a batch's rows four at a time and the remaining ones singly, with other rounding:
# a token's KV then depends on where in its batch it falls. Batches that start on
# multiples of four make every token but a batch's tail land where a full prefill puts it.
REPACKED_TYPES = frozenset(
    {"Q1_0", "Q2_K", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "MXFP4"}
)
REPACK_ROWS = 4


class SpecReading(NamedTuple):
    """The spec (or None), why there is none (or None), and the batch alignment."""

    spec: KvSpec | None
    problem: str | None
    batch_align: int


def uniform_shape(metadata: dict[str, str], n_layer: int) -> tuple[int, int, int] | None:
    """(layers, K width, V width) per token and layer, or None when layers differ."""
    arch = metadata.get("general.architecture", "")

    def number(key: str) -> int | None:
        value = metadata.get(f"{arch}.{key}")
        try:
            return int(value) if value is not None else None
        except ValueError:  # an array (per-layer values): not a uniform shape
            return None

    n_head = number("attention.head_count")
    n_head_kv = number("attention.head_count_kv") or n_head
    n_embd = number("embedding_length")
    if not (n_head and n_head_kv and n_embd):
        return None
    k_dim = number("attention.key_length") or n_embd // n_head
    v_dim = number("attention.value_length") or n_embd // n_head
    return n_layer, n_head_kv * k_dim, n_head_kv * v_dim


def read_spec(model_path: Path, metadata: dict[str, str], model: Any) -> SpecReading:
    """The per-layer KV spec of the loaded ``model`` (a llama.cpp model pointer)."""
    if llama_cpp.llama_model_is_recurrent(model):
        return SpecReading(None, "a recurrent model keeps a fixed-size state, not per-token KV", 1)
    if llama_cpp.llama_model_is_hybrid(model):
        why = (
            "a hybrid model (attention and recurrent layers) keeps a recurrent state "
            "besides its per-token KV"
        )
        return SpecReading(None, why, 1)
    from kvchat.planner.gguf_info import read_gguf

    try:
        info = read_gguf(model_path)
    except KvchatError as exc:
        return SpecReading(None, f"its GGUF metadata could not be read ({exc})", 1)
    align = REPACK_ROWS if REPACKED_TYPES.intersection(info.weight_types) else 1
    k_widths: list[int] = []
    v_widths: list[int] = []
    swa: list[bool] = []
    shared = int(metadata.get(f"{info.architecture}.attention.shared_kv_layers", 0) or 0)
    for il in range(info.n_layer):
        if il >= info.n_layer - shared:
            continue  # the layer reuses another layer's cache (Gemma 3n style)
        kv_heads = info.n_head_kv[il]  # 0: the layer keeps zero-width rows (DeciLM)
        d_k, d_v = info.head_dims(il)
        k_widths.append(kv_heads * d_k)
        v_widths.append(kv_heads * d_v)
        swa.append(info.swa_layers[il])
    n_swa = int(llama_cpp.llama_model_n_swa(model)) if any(swa) else 0
    if any(swa) and n_swa != info.sliding_window:
        why = f"llama.cpp's sliding window ({n_swa}) is not the GGUF's ({info.sliding_window})"
        return SpecReading(None, why, align)
    return SpecReading(KvSpec(tuple(k_widths), tuple(v_widths), tuple(swa), n_swa), None, align)
