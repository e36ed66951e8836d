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

import os
import re
import sys
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
from kvchat.planner.model_info import ModelInfo, recurrent_elements, swa_pattern

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


# String arrays longer than this (the tokenizer's vocabulary and merges) are skipped, not
# decoded: materialising them costs seconds and the planner needs only their length.
_SKIP_STRING_ARRAYS = 1024


def _metadata_reader(path: Path) -> Any:
    """A ``gguf.GGUFReader`` that reads numeric arrays as one view and skips long string arrays.

    The stock reader builds a numpy view per array element: ~4 s for the bundled model's
    49k-token vocabulary. Skipped arrays keep their element count in ``parts[1]``.
    """
    import gguf
    import numpy as np

    string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY

    class MetadataReader(gguf.GGUFReader):  # type: ignore[misc]
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if gguf.GGUFValueType(raw_type) != array:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs = orig_offs + 12
            itype = gguf.GGUFValueType(int(raw_itype[0]))
            count = int(alen[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, count)
                offs += int(values.nbytes)
                return offs - orig_offs, [raw_itype, alen, values], [2], [array, itype]
            if itype == string and count > _SKIP_STRING_ARRAYS:
                buf = self.data.data
                swapped = {"little": "big", "big": "little"}[sys.byteorder]
                order = swapped if self.byte_order == "S" else sys.byteorder
                for _ in range(count):
                    offs += 8 + int.from_bytes(buf[offs : offs + 8], order)
                return offs - orig_offs, [raw_itype, alen], [], [array, string]
            return super()._get_field_parts(orig_offs, raw_type)

    return MetadataReader(str(path), "r")


def _field(reader: Any, key: str) -> Any:
    """The value of GGUF key ``key`` (scalar, string or list), or None when absent."""
    import gguf

    fld = reader.fields.get(key)
    if fld is None or not fld.types:
        return None
    main = fld.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        if fld.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(fld.parts[i]).decode("utf-8", errors="replace") for i in fld.data]
        return [v for i in fld.data for v in fld.parts[i].tolist()]
    if main == gguf.GGUFValueType.STRING:
        return bytes(fld.parts[fld.data[0]]).decode("utf-8", errors="replace")
    return fld.parts[fld.data[0]].tolist()[0]


def _per_layer(value: Any, n_layer: int, key: str) -> tuple[int, ...]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise KvchatError(f"GGUF key {key} has {len(value)} entries for {n_layer} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * n_layer


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
        reader = _metadata_reader(path)
    except Exception as exc:  # the gguf package raises ValueError/struct errors on junk
        raise KvchatError(f"not a readable GGUF file: {path} ({exc})") from exc

    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise KvchatError(f"{path} has no general.architecture: not a model GGUF")

    def key(suffix: str) -> Any:
        return _field(reader, f"{arch}.{suffix}")

    n_layer = key("block_count")
    if n_layer is None:
        raise KvchatError(f"{path}: {arch}.block_count is missing")
    n_layer = int(n_layer)
    n_embd = int(key("embedding_length") or 0)
    head_raw = key("attention.head_count")
    if head_raw is None:
        raise KvchatError(f"{path}: {arch}.attention.head_count is missing")
    n_head = _per_layer(head_raw, n_layer, f"{arch}.attention.head_count")
    kv_raw = key("attention.head_count_kv")
    n_head_kv = _per_layer(
        kv_raw if kv_raw is not None else head_raw, n_layer, f"{arch}.attention.head_count_kv"
    )

    head_max = max(n_head) if n_head else 0
    default_dim = n_embd // head_max if head_max else 0
    head_dim_k = int(key("attention.key_length") or default_dim)
    head_dim_v = int(key("attention.value_length") or default_dim)
    head_dim_k_swa = int(key("attention.key_length_swa") or head_dim_k)
    head_dim_v_swa = int(key("attention.value_length_swa") or head_dim_v)

    # Layers past n_layer - shared_kv_layers reuse earlier layers' KV (Gemma 3n style).
    shared = int(key("attention.shared_kv_layers") or 0)
    if shared:
        n_head_kv = tuple(kv if il < n_layer - shared else 0 for il, kv in enumerate(n_head_kv))

    notes: list[str] = []
    window = int(key("attention.sliding_window") or DEFAULT_SWA_BY_ARCH.get(arch, 0))
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        swa = tuple(bool(v) for v in pattern)
        if len(swa) != n_layer:
            raise KvchatError(
                f"{path}: sliding_window_pattern has {len(swa)} entries for {n_layer} layers"
            )
    elif pattern is not None and window:
        swa = swa_pattern(n_layer, int(pattern))
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
    for tensor in reader.tensors:
        size = int(tensor.n_bytes)
        match = _BLOCK.match(tensor.name)
        if match and int(match.group(1)) < n_layer:
            layer_bytes[int(match.group(1))] += size
            if len(tensor.shape) >= 2:
                weight_types.add(tensor.tensor_type.name)
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

    recurrent, elements = _recurrent(arch, key, n_layer, n_embd, n_head_kv)
    if arch in _RECURRENT_BETWEEN_ATTENTION:
        # Their GGUFs give every layer KV heads; only the attention layers keep a cache.
        n_head_kv = tuple(0 if rec else kv for kv, rec in zip(n_head_kv, recurrent))

    n_vocab = key("vocab_size")
    if n_vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        n_vocab = int(tokens.parts[1][0]) if tokens is not None else 0
    quant = _FILE_TYPES.get(_field(reader, "general.file_type"))
    label = name or _field(reader, "general.name") or path.stem
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
        n_ff=_first_int(key("feed_forward_length"), 4 * n_embd),
        n_vocab=int(n_vocab),
        context_length=int(key("context_length") or 0),
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
        has_chat_template=bool(_field(reader, "tokenizer.chat_template")),
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
    arch: str, key: Any, n_layer: int, n_embd: int, n_head_kv: tuple[int, ...]
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
            layers = tuple(rec and not int(f) for rec, f in zip(layers, ff))
    elif arch in _RECURRENT_BETWEEN_ATTENTION:
        interval = int(key("full_attention_interval") or 4)
        layers = tuple((il + 1) % interval != 0 for il in range(n_layer))
    else:
        return (), 0
    return layers, recurrent_elements(
        n_embd,
        conv_l_cache=int(key("shortconv.l_cache") or 0),
        d_conv=int(key("ssm.conv_kernel") or 0),
        d_inner=int(key("ssm.inner_size") or 0),
        d_state=int(key("ssm.state_size") or 0),
        n_group=int(key("ssm.group_count") or 0),
    )


def has_chat_template(path: str | os.PathLike[str]) -> bool:
    """Whether a GGUF file carries ``tokenizer.chat_template`` (False when unreadable)."""
    try:
        return bool(_field(_metadata_reader(Path(path)), "tokenizer.chat_template"))
    except Exception:  # the gguf package raises ValueError/struct errors on junk
        return False


def _first_int(value: Any, default: int) -> int:
    if isinstance(value, list):
        return int(max(value)) if value else default
    return int(value) if value else default


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
