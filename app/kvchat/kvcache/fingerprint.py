"""What a snapshot's KV bytes depend on, checked before llama.cpp ever sees them.

llama.cpp verifies only byte layout when loading state, so bytes from another model
with the same shape would load and silently produce garbage. Everything that changes
the meaning of those bytes is in the fingerprint.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import llama_cpp
import xxhash

# Bytes hashed from each end of the model file: the GGUF header and metadata live at
# the start, so any metadata edit changes the identity; hashing all of a multi-GB file
# on every start would cost seconds.
IDENTITY_SPAN = 4 << 20
# What an origin looks like: ``bundle:`` and 32 hex digits of the file's sha256.
ORIGIN = re.compile(r"bundle:[0-9a-f]{32}")


def model_identity(path: Path) -> str:
    """A fast identity of a model file: its size plus xxh3-128 of its first and last 4 MiB."""
    size = path.stat().st_size
    h = xxhash.xxh3_128()
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as fh:
        h.update(fh.read(IDENTITY_SPAN))
        if size > IDENTITY_SPAN:
            fh.seek(max(IDENTITY_SPAN, size - IDENTITY_SPAN))
            h.update(fh.read(IDENTITY_SPAN))
    return h.hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """Identity of the model and context settings that produced some KV bytes."""

    model_id: str
    model_file: str
    llama_cpp_version: str
    type_k: str
    type_v: str
    flash_attn: bool
    rope_freq_base: float
    rope_freq_scale: float
    n_swa: int
    n_layer: int
    # Where the KV came from when it was not computed here: ``bundle:<sha256 prefix>`` for
    # a bundle's KV and whatever a context restored from it went on to compute. Part of
    # every chunk key (see chunking), so KV from a file forms its own trust domain: never
    # a donor for, nor shared with, KV computed here. None: computed here.
    origin: str | None = None

    @classmethod
    def current(cls, model_path: Path, layout: dict[str, Any]) -> Fingerprint:
        return cls(
            model_id=model_identity(model_path),
            model_file=os.path.basename(model_path),
            llama_cpp_version=llama_cpp.__version__,
            type_k=layout["type_k"],
            type_v=layout["type_v"],
            flash_attn=bool(layout["flash_attn"]),
            rope_freq_base=float(layout["rope_freq_base"]),
            rope_freq_scale=float(layout["rope_freq_scale"]),
            n_swa=int(layout["n_swa"]),
            n_layer=int(layout["n_layer"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """The stored form; ``origin`` only when there is one (local keys stay as they were)."""
        out = asdict(self)
        if out["origin"] is None:
            del out["origin"]
        return out

    def with_origin(self, origin: str | None) -> Fingerprint:
        """This fingerprint for KV of ``origin`` (None: computed here)."""
        return self if origin == self.origin else replace(self, origin=origin)

    def mismatch(self, saved: dict[str, Any]) -> str | None:
        """Why KV saved under ``saved`` cannot be loaded here, or None when it can."""
        damage = fingerprint_problem(saved)
        if damage is not None:
            return f"the snapshot's fingerprint is damaged ({damage})"
        return self._mismatch(saved)

    def _mismatch(self, saved: dict[str, Any]) -> str | None:
        if saved.get("model_id") != self.model_id:
            return (
                f"snapshot was made with a different model file "
                f"({saved.get('model_file')}, id {str(saved.get('model_id'))[:12]}; "
                f"now {self.model_file}, id {self.model_id[:12]})"
            )
        if saved.get("llama_cpp_version") != self.llama_cpp_version:
            return (
                f"snapshot was made with llama-cpp-python {saved.get('llama_cpp_version')}, "
                f"this is {self.llama_cpp_version}"
            )
        if (saved.get("type_k"), saved.get("type_v")) != (self.type_k, self.type_v):
            return (
                f"snapshot KV type is type_k={saved.get('type_k')} type_v={saved.get('type_v')}, "
                f"the context uses type_k={self.type_k} type_v={self.type_v}"
            )
        if bool(saved.get("flash_attn")) != self.flash_attn:
            return (
                f"snapshot was made with flash attention {'on' if saved.get('flash_attn') else 'off'}, "
                f"now it is {'on' if self.flash_attn else 'off'}"
            )
        for key in ("rope_freq_base", "rope_freq_scale"):
            if float(saved.get(key, -1)) != getattr(self, key):
                return f"snapshot RoPE setting {key}={saved.get(key)} differs from {getattr(self, key)}"
        if int(saved.get("n_swa", -1)) != self.n_swa:
            return f"snapshot sliding-window size {saved.get('n_swa')} differs from {self.n_swa}"
        if int(saved.get("n_layer", -1)) != self.n_layer:
            return f"snapshot has {saved.get('n_layer')} layers, the model has {self.n_layer}"
        return None


# What each field of a saved fingerprint must be (JSON gives ints for whole floats).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model_id": (str,),
    "model_file": (str,),
    "llama_cpp_version": (str,),
    "type_k": (str,),
    "type_v": (str,),
    "flash_attn": (bool,),
    "rope_freq_base": (int, float),
    "rope_freq_scale": (int, float),
    "n_swa": (int,),
    "n_layer": (int,),
}


def fingerprint_problem(saved: object) -> str | None:
    """Why a fingerprint read back from the database is not one kvchat wrote, or None."""
    if not isinstance(saved, dict):
        return "not a JSON object"
    for name, kinds in _FIELD_TYPES.items():
        value = saved.get(name)
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            return f"field {name} is {value!r}"
    origin = saved.get("origin")
    if origin is not None and (not isinstance(origin, str) or not ORIGIN.fullmatch(origin)):
        return f"field origin is {str(origin)[:40]!r}"
    return None


def origin_of(saved: dict[str, Any]) -> str | None:
    """The origin a stored fingerprint names (None: KV computed here)."""
    origin = saved.get("origin")
    return origin if isinstance(origin, str) else None
