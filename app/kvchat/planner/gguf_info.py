"""What the planner needs to know about a model, read without loading it.

Two sources give the same :class:`ModelInfo`:

- a GGUF file, read with ``gguf.GGUFReader`` (metadata and tensor table only, memory-mapped;
  no weights are touched): architecture, layer count, heads, KV heads (a number or a
  per-layer array), head dims, sliding-window layers, trained context, and the exact bytes
  of every tensor, grouped by where llama.cpp puts them;
- an entry of ``models/catalog.toml``, for a model that is not on disk yet. Its figures come
  from the model's public ``config.json``; tensor bytes are then estimated from the file size
  (see :func:`info_from_catalog`).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from kvchat.errors import KvchatError
from kvchat.planner.catalog import (
    REQUIRED_CATALOG_KEYS,
    CatalogEntry,
    default_catalog_path,
    find_entry,
    info_from_catalog,
    load_catalog,
    with_catalog_marks,
)
from kvchat.planner.gguf_header import GGUFHeader, GGUFHeaderError, Skipped, read_header
from kvchat.planner.model_info import ModelInfo, recurrent_elements, swa_pattern

# What a model's GGUF may declare and still be read (beyond these: one line, not a model).
MAX_LAYERS = 4096
MAX_HEADS = 1 << 16
MAX_WIDTH = 1 << 22  # embedding, feed-forward and head sizes
MAX_CONTEXT = 1 << 30

# Architectures whose sliding-window layout llama.cpp hard-codes when the GGUF carries no
# ``{arch}.attention.sliding_window_pattern``: period n means that in every group of n
# layers the first n-1 use the sliding window and the last one attends to everything
# (llama.cpp's ``llama_hparams::set_swa_pattern``). Other architectures get SWA only from an
# explicit pattern key: llama.cpp ignores ``sliding_window`` for them (Mistral v0.1, Qwen2
# and Phi-3 configs carry one that llama.cpp does not apply).
SWA_PERIOD_BY_ARCH: dict[str, int] = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2}
# llama.cpp's default window for Gemma 2 when the key is absent.
DEFAULT_SWA_BY_ARCH: dict[str, int] = {"gemma2": 4096}


# Also the catalog's names and ModelInfo, which importers read from here.
__all__ = [
    "REQUIRED_CATALOG_KEYS",
    "CatalogEntry",
    "ModelInfo",
    "default_catalog_path",
    "find_entry",
    "has_chat_template",
    "info_from_catalog",
    "load_catalog",
    "read_gguf",
    "swa_pattern",
    "with_catalog_marks",
]

# --------------------------------------------------------------------------- GGUF files


def _field(header: GGUFHeader, key: str) -> Any:
    """The value of GGUF key ``key`` (scalar, string or list), or None when absent."""
    return header.get(key)


def _int(value: Any, key: str, low: int = 0, high: int = 1 << 24) -> int:
    """``value`` as a whole number in [low, high]; anything else is one line."""
    if type(value) is float and math.isfinite(value) and value.is_integer():
        value = int(value)
    if type(value) is not int or not low <= value <= high:
        shown = value if not isinstance(value, str) else value[:40]
        raise KvchatError(f"GGUF key {key} is {shown!r}, not a whole number in [{low}, {high}]")
    return value


def _per_layer(value: Any, n_layer: int, key: str) -> tuple[int, ...]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise KvchatError(f"GGUF key {key} has {len(value)} entries for {n_layer} layers")
        return tuple(_int(v, key, 0, MAX_HEADS) for v in value)
    return (_int(value, key, 0, MAX_HEADS),) * n_layer


_BLOCK = re.compile(r"^blk\.(\d+)\.")


# read_gguf's last readings, by (path, size, mtime, name): the planner, the engine's KV spec
# and the engine probe each read the same file at start-up (~30-50 ms a reading).
_READINGS: dict[tuple[str, int, int, str | None], ModelInfo] = {}
_KEEP_READINGS = 8


def read_gguf(path: str | os.PathLike[str], name: str | None = None) -> ModelInfo:
    """Read a GGUF file's metadata and tensor table (no weights are loaded); a file read
    before and unchanged since (same size and modification time) is not read again."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        stat = None
    if stat is None or not path.is_file():
        raise KvchatError(f"model file not found: {path}")
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, name)
    if key not in _READINGS:
        if len(_READINGS) >= _KEEP_READINGS:
            _READINGS.pop(next(iter(_READINGS)))
        _READINGS[key] = _read_gguf(path, name)
    return _READINGS[key]


def _read_gguf(path: Path, name: str | None) -> ModelInfo:
    try:
        header = read_header(path)
    except GGUFHeaderError as exc:
        raise KvchatError(f"not a readable GGUF file: {path} ({exc})") from None

    arch = _field(header, "general.architecture")
    if not isinstance(arch, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", arch):
        raise KvchatError(f"{path} has no general.architecture: not a model GGUF")

    def key(suffix: str) -> Any:
        return _field(header, f"{arch}.{suffix}")

    def opt(suffix: str, default: int, high: int = MAX_WIDTH) -> int:
        """``{arch}.suffix`` as a whole number; absent or 0: ``default``."""
        value = key(suffix)
        return default if value is None else (_int(value, f"{arch}.{suffix}", 0, high) or default)

    try:
        return _model_info(path, name, header, arch, key, opt)
    except KvchatError as exc:
        raise KvchatError(f"{path}: {exc}") from None


def _model_info(
    path: Path, name: str | None, header: GGUFHeader, arch: str, key: Any, opt: Any
) -> ModelInfo:
    n_layer = key("block_count")
    if n_layer is None:
        raise KvchatError(f"{arch}.block_count is missing")
    n_layer = _int(n_layer, f"{arch}.block_count", 1, MAX_LAYERS)
    n_embd = opt("embedding_length", 0)
    head_raw = key("attention.head_count")
    if head_raw is None:
        raise KvchatError(f"{arch}.attention.head_count is missing")
    n_head = _per_layer(head_raw, n_layer, f"{arch}.attention.head_count")
    kv_raw = key("attention.head_count_kv")
    n_head_kv = _per_layer(
        kv_raw if kv_raw is not None else head_raw, n_layer, f"{arch}.attention.head_count_kv"
    )

    head_max = max(n_head) if n_head else 0
    default_dim = n_embd // head_max if head_max else 0
    head_dim_k = opt("attention.key_length", default_dim)
    head_dim_v = opt("attention.value_length", default_dim)
    head_dim_k_swa = opt("attention.key_length_swa", head_dim_k)
    head_dim_v_swa = opt("attention.value_length_swa", head_dim_v)

    # Layers past n_layer - shared_kv_layers reuse earlier layers' KV (Gemma 3n style).
    shared = opt("attention.shared_kv_layers", 0, n_layer)
    if shared:
        n_head_kv = tuple(kv if il < n_layer - shared else 0 for il, kv in enumerate(n_head_kv))

    notes: list[str] = []
    window = opt("attention.sliding_window", DEFAULT_SWA_BY_ARCH.get(arch, 0), MAX_CONTEXT)
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        swa = tuple(
            v if type(v) is bool else bool(_int(v, "sliding_window_pattern", 0, 1)) for v in pattern
        )
        if len(swa) != n_layer:
            raise KvchatError(f"sliding_window_pattern has {len(swa)} entries for {n_layer} layers")
    elif pattern is not None and window:
        swa = swa_pattern(n_layer, _int(pattern, "sliding_window_pattern", 0, n_layer))
    elif arch in SWA_PERIOD_BY_ARCH and window:
        swa = swa_pattern(n_layer, SWA_PERIOD_BY_ARCH[arch])
    else:
        if window:
            notes.append(
                f"{arch}.attention.sliding_window = {window} is not applied by "
                "llama.cpp for this architecture: every layer keeps the full context"
            )
        swa = (False,) * n_layer
        window = 0
    if not any(swa):
        window = 0

    layer_bytes = [0] * n_layer
    weight_types: set[str] = set()
    input_bytes = output_bytes = 0
    has_output = False
    embd_bytes = 0
    for tensor in header.tensors:
        size = tensor.n_bytes
        match = _BLOCK.match(tensor.name)
        if match and int(match.group(1)) < n_layer:
            layer_bytes[int(match.group(1))] += size
            if len(tensor.shape) >= 2:
                weight_types.add(tensor.type_name)
        elif tensor.name.startswith("output"):
            output_bytes += size
            has_output = has_output or tensor.name == "output.weight"
        else:
            input_bytes += size
            if tensor.name == "token_embd.weight":
                embd_bytes = size
    weight_bytes = sum(layer_bytes) + input_bytes + output_bytes
    if not has_output:
        # llama.cpp loads token_embd a second time as the output matrix, on the output
        # layer's device (the GPU at full offload).
        output_bytes += embd_bytes

    recurrent, elements = _recurrent(arch, key, opt, n_layer, n_embd, n_head_kv)
    if arch in _RECURRENT_BETWEEN_ATTENTION:
        # Their GGUFs give every layer KV heads; only the attention layers keep a cache.
        n_head_kv = tuple(0 if rec else kv for kv, rec in zip(n_head_kv, recurrent))

    n_vocab = key("vocab_size")
    if n_vocab is None:
        n_vocab = header.count("tokenizer.ggml.tokens") or 0
    n_vocab = _int(n_vocab, f"{arch}.vocab_size", 0, 1 << 26)
    file_type = _field(header, "general.file_type")
    quant = _FILE_TYPES.get(file_type) if type(file_type) is int else None
    label = name or _field(header, "general.name")
    label = label if isinstance(label, str) and label else path.stem
    return ModelInfo(
        name=str(label),
        architecture=arch,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        head_dim_k_swa=head_dim_k_swa,
        head_dim_v_swa=head_dim_v_swa,
        n_embd=n_embd,
        n_ff=_first_int(key("feed_forward_length"), 4 * n_embd, f"{arch}.feed_forward_length"),
        n_vocab=n_vocab,
        context_length=opt("context_length", 0, MAX_CONTEXT),
        sliding_window=window,
        swa_layers=swa,
        weight_bytes=weight_bytes,
        layer_bytes=tuple(layer_bytes),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        tied_embeddings=not has_output,
        source="gguf",
        path=str(path),
        quantization=quant,
        notes=tuple(notes),
        weight_types=tuple(sorted(weight_types)),
        has_chat_template=_has_template(header),
        shared_kv_layers=shared,
        recurrent_layers=recurrent,
        recurrent_elements=elements,
    )


# Architectures whose every layer is recurrent, and hybrids whose recurrent layers are
# those without attention heads (llama.cpp: the GGUF's head_count_kv is 0 there).
_ALL_RECURRENT = {"mamba", "mamba2", "falcon-h1"}
_RECURRENT_WHERE_NO_KV = {"lfm2", "jamba", "granitehybrid", "nemotron_h"}
# Gated DeltaNet hybrids: attention on every full_attention_interval-th layer (default 4).
_RECURRENT_BETWEEN_ATTENTION = {"qwen35", "qwen35moe", "qwen3next"}


def _recurrent(
    arch: str, key: Any, opt: Any, n_layer: int, n_embd: int, n_head_kv: tuple[int, ...]
) -> tuple[tuple[bool, ...], int]:
    """(per layer: recurrent?, f32 state elements per recurrent layer), as llama.cpp's
    ``llama_hparams::n_embd_r`` + ``n_embd_s`` count them (Mamba 1/2 and short
    convolutions; ((), 0) for an architecture not known to be recurrent here)."""
    if arch in _ALL_RECURRENT:
        layers = (True,) * n_layer
    elif arch in _RECURRENT_WHERE_NO_KV:
        layers = tuple(kv == 0 for kv in n_head_kv)
        ff = key("feed_forward_length")
        if arch == "nemotron_h" and isinstance(ff, list):  # MLP-only layers: no state
            layers = tuple(
                rec and not _int(f, "feed_forward_length", 0, MAX_WIDTH)
                for rec, f in zip(layers, ff)
            )
    elif arch in _RECURRENT_BETWEEN_ATTENTION:
        interval = opt("full_attention_interval", 4, MAX_LAYERS)
        layers = tuple((il + 1) % interval != 0 for il in range(n_layer))
    else:
        return (), 0
    return layers, recurrent_elements(
        n_embd,
        conv_l_cache=opt("shortconv.l_cache", 0),
        d_conv=opt("ssm.conv_kernel", 0),
        d_inner=opt("ssm.inner_size", 0),
        d_state=opt("ssm.state_size", 0),
        n_group=opt("ssm.group_count", 0),
    )


def has_chat_template(path: str | os.PathLike[str]) -> bool:
    """Whether a GGUF file carries ``tokenizer.chat_template`` (False when unreadable)."""
    try:
        return _has_template(read_header(path))
    except GGUFHeaderError:
        return False


def _has_template(header: GGUFHeader) -> bool:
    template = _field(header, "tokenizer.chat_template")
    return isinstance(template, Skipped) or (isinstance(template, str) and bool(template))


def _first_int(value: Any, default: int, key: str) -> int:
    if isinstance(value, list):
        return max(_int(v, key, 0, MAX_WIDTH) for v in value) if value else default
    return _int(value, key, 0, MAX_WIDTH) if value else default


# general.file_type (llama_ftype) → quantization name, for display only.
_FILE_TYPES: dict[Any, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    30: "IQ4_XS",
    32: "BF16",
}
