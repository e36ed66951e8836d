"""The catalog of recommended models (``models/catalog.toml``, installed inside the package),
and a :class:`ModelInfo` estimated from an entry for a model not on disk yet."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from kvchat.errors import KvchatError
from kvchat.planner.model_info import ModelInfo, recurrent_elements, swa_pattern

# Bits per weight of the token-embedding / output matrices in common llama.cpp quantizations,
# used only to estimate where a catalog model's bytes sit (llama.cpp quantizes an untied
# token_embd with the file's base type and the output matrix, or a tied token_embd, as Q6_K).
_EMBD_BITS = {
    "Q4_0": 4.5,
    "Q4_1": 5.0,
    "Q4_K_S": 4.5,
    "Q4_K_M": 4.5,
    "Q5_K_S": 5.5,
    "Q5_K_M": 5.5,
    "Q6_K": 6.5625,
    "Q8_0": 8.5,
    "F16": 16.0,
    "BF16": 16.0,
}
_OUTPUT_BITS_DEFAULT = 6.5625


REQUIRED_CATALOG_KEYS = (
    "name",
    "title",
    "file",
    "quantization",
    "size_bytes",
    "architecture",
    "layers",
    "heads",
    "kv_heads",
    "head_dim",
    "embedding_length",
    "feed_forward_length",
    "vocab_size",
    "tied_embeddings",
    "context_length",
    "attention",
    "license",
    "source_model",
)


# The kinds of layer a hybrid's non-attention layers are (``recurrent``), and the catalog
# keys each needs for its state's size.
RECURRENT_KINDS: dict[str, tuple[str, ...]] = {
    "mamba2": ("ssm_conv_kernel", "ssm_inner_size", "ssm_state_size", "ssm_group_count"),
    "gated-deltanet": ("ssm_conv_kernel", "ssm_inner_size", "ssm_state_size", "ssm_group_count"),
    "shortconv": ("conv_l_cache",),
}
# Chat-template keywords that turn a thinking model's reasoning off (kvchat.service's
# ThinkingSwitch knows the same ones).
THINKING_SWITCHES = ("enable_thinking", "reasoning_effort")


@dataclass(frozen=True)
class CatalogEntry:
    """One recommended model (a row of ``models/catalog.toml``)."""

    name: str
    title: str
    file: str
    quantization: str
    size_bytes: int
    architecture: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    embedding_length: int
    feed_forward_length: int
    vocab_size: int
    tied_embeddings: bool
    context_length: int
    attention: str
    license: str
    source_model: str
    hf_repo: str | None = None
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    bundled: bool = False
    notes: str = ""
    # A built-in chat template (kvchat.planner.templates) for a GGUF that carries none.
    chat_template: str = ""
    # A thinking model writes its reasoning before the answer; thinking_switch is the
    # chat-template keyword that turns it off ("": it always thinks).
    thinking: bool = False
    thinking_switch: str = ""
    # A hybrid: the indices of the layers with attention (the others are ``recurrent``
    # layers of that kind, each with a fixed-size state), and that state's figures.
    attention_layers: tuple[int, ...] = field(default=())
    recurrent: str = ""
    ssm_conv_kernel: int = 0
    ssm_inner_size: int = 0
    ssm_state_size: int = 0
    ssm_group_count: int = 0
    conv_l_cache: int = 0

    @property
    def hybrid(self) -> bool:
        return bool(self.attention_layers)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["attention_layers"] = list(self.attention_layers)
        return data


def default_catalog_path() -> Path:
    """``KVCHAT_CATALOG``, else the catalog installed with kvchat (``kvchat.models``)."""
    env = os.environ.get("KVCHAT_CATALOG")
    if env:
        return Path(env).expanduser()
    return Path(str(resources.files("kvchat.models").joinpath("catalog.toml")))


def load_catalog(path: str | os.PathLike[str] | None = None) -> list[CatalogEntry]:
    """Parse and check the catalog; a missing or unreadable file is an error naming its path."""
    path = Path(path) if path is not None else default_catalog_path()
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise KvchatError(f"model catalog {path} is missing") from exc
    except OSError as exc:
        raise KvchatError(f"model catalog {path} cannot be read: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise KvchatError(f"model catalog {path} is not valid TOML: {exc}") from exc
    entries: list[CatalogEntry] = []
    known = set(CatalogEntry.__dataclass_fields__)
    for i, row in enumerate(data.get("model", [])):
        missing = [k for k in REQUIRED_CATALOG_KEYS if k not in row]
        if missing:
            raise KvchatError(f"{path}: model #{i + 1} lacks {', '.join(missing)}")
        unknown = set(row) - known
        if unknown:
            raise KvchatError(
                f"{path}: model {row['name']!r} has unknown keys {', '.join(sorted(unknown))}"
            )
        if "attention_layers" in row:
            row = {**row, "attention_layers": tuple(row["attention_layers"])}
        entry = CatalogEntry(**row)
        problem = _entry_problem(entry)
        if problem:
            raise KvchatError(f"{path}: model {entry.name!r} {problem}")
        entries.append(entry)
    names = [e.name for e in entries]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise KvchatError(f"{path}: duplicate model names {', '.join(sorted(dupes))}")
    return entries


def _entry_problem(entry: CatalogEntry) -> str | None:
    """Why the entry's thinking or hybrid keys do not hold together, or None."""
    if entry.thinking_switch and not entry.thinking:
        return "has a thinking_switch but is not a thinking model (thinking = true)"
    if entry.thinking_switch and entry.thinking_switch not in THINKING_SWITCHES:
        return f"has an unknown thinking_switch {entry.thinking_switch!r}"
    if not entry.attention_layers:
        return "names a recurrent kind without attention_layers" if entry.recurrent else None
    layers = entry.attention_layers
    if list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < entry.layers:
        return f"has attention_layers that are not distinct, ascending indices below {entry.layers}"
    needed = RECURRENT_KINDS.get(entry.recurrent)
    if needed is None:
        return f"is a hybrid whose recurrent kind is not one of {', '.join(RECURRENT_KINDS)}"
    missing = [key for key in needed if not getattr(entry, key)]
    if missing:
        return f"is a {entry.recurrent} hybrid without {', '.join(missing)}"
    return None


def find_entry(name: str, catalog: Sequence[CatalogEntry]) -> CatalogEntry | None:
    """The entry called ``name`` (case-insensitive), or whose GGUF file is ``name``."""
    wanted = name.strip().lower()
    for entry in catalog:
        if wanted in (entry.name.lower(), entry.file.lower()):
            return entry
    return None


def info_from_catalog(entry: CatalogEntry) -> ModelInfo:
    """A :class:`ModelInfo` from the catalog's figures alone (no file needed).

    Tensor bytes are estimated: the token embedding is vocab × n_embd at the quantization's
    base bits (Q6_K when tied), the output matrix vocab × n_embd at Q6_K (a copy of the
    embedding when tied), and the rest of ``size_bytes`` is split evenly over the layers.
    """
    n = entry.layers
    if entry.sliding_window and entry.sliding_window_pattern:
        swa = swa_pattern(n, entry.sliding_window_pattern)
    else:
        swa = (False,) * n
    embd_elems = entry.vocab_size * entry.embedding_length
    quant = entry.quantization.upper()
    if entry.tied_embeddings:
        input_bytes = int(embd_elems * _OUTPUT_BITS_DEFAULT / 8)
        output_bytes = input_bytes  # the duplicated output copy
        body = entry.size_bytes - input_bytes
    else:
        input_bytes = int(embd_elems * _EMBD_BITS.get(quant, 4.5) / 8)
        output_bits = 8.5 if quant == "Q8_0" else _OUTPUT_BITS_DEFAULT
        output_bytes = int(embd_elems * output_bits / 8)
        body = entry.size_bytes - input_bytes - output_bytes
    per_layer = max(body, 0) // n
    if entry.hybrid:
        attends = set(entry.attention_layers)
        n_head_kv = tuple(entry.kv_heads if il in attends else 0 for il in range(n))
        recurrent = tuple(il not in attends for il in range(n))
        elements = recurrent_elements(
            entry.embedding_length,
            conv_l_cache=entry.conv_l_cache,
            d_conv=entry.ssm_conv_kernel,
            d_inner=entry.ssm_inner_size,
            d_state=entry.ssm_state_size,
            n_group=entry.ssm_group_count,
        )
    else:
        n_head_kv, recurrent, elements = (entry.kv_heads,) * n, (), 0
    return ModelInfo(
        name=entry.name,
        architecture=entry.architecture,
        n_layer=n,
        n_head=(entry.heads,) * n,
        n_head_kv=n_head_kv,
        head_dim_k=entry.head_dim,
        head_dim_v=entry.head_dim,
        head_dim_k_swa=entry.head_dim,
        head_dim_v_swa=entry.head_dim,
        n_embd=entry.embedding_length,
        n_ff=entry.feed_forward_length,
        n_vocab=entry.vocab_size,
        context_length=entry.context_length,
        sliding_window=entry.sliding_window if any(swa) else 0,
        swa_layers=swa,
        weight_bytes=entry.size_bytes,
        layer_bytes=(per_layer,) * n,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        tied_embeddings=entry.tied_embeddings,
        source="catalog",
        path=None,
        quantization=entry.quantization,
        notes=("weights per layer estimated from the catalog's file size",),
        recurrent_layers=recurrent,
        recurrent_elements=elements,
        thinking=entry.thinking,
        thinking_switch=entry.thinking_switch,
    )


def with_catalog_marks(info: ModelInfo, entry: CatalogEntry | None) -> ModelInfo:
    """``info`` (read from the entry's GGUF file) with what only the catalog knows: whether
    the model thinks, and its switch."""
    if entry is None:
        return info
    return replace(info, thinking=entry.thinking, thinking_switch=entry.thinking_switch)
