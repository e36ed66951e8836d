"""Models by the names the user found them under.

A model in another app's store is named by its store name everywhere (``ollama:gemma3:270m``,
never the blob's ``sha256-…`` file name); any other file by its name without ``.gguf``.
Where a model is named, a store name is accepted with its prefix or, when only one store
holds a model of that name, without it (``gemma3:270m``, ``tiny`` for ``ollama:tiny:latest``);
a name that matches nothing gets the nearest known name suggested.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.planner.stores import LocalModel, discover, store_roots

# Store names found for model files (resolved path → name): a store walk is done once per
# file, not at every turn.
_KNOWN: dict[str, str | None] = {}


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path


def store_name_for(path: Path, model_dirs: Sequence[str] = ()) -> str | None:
    """The store name of ``path`` when it is a model in another app's store (None: it is
    not in one). The user's own ``model_dirs`` folders are not stores: their files keep
    their file names."""
    real = _resolved(path)
    key = str(real)
    if key in _KNOWN:
        return _KNOWN[key]
    roots = [_resolved(root) for _, prefix, root in store_roots() if prefix != "folder"]
    name: str | None = None
    if any(real.is_relative_to(root) for root in roots):
        name = next(
            (
                m.name
                for m in discover(model_dirs)
                if m.path is not None and not m.name.startswith("folder:")
                if _resolved(m.path) == real
            ),
            None,
        )
    _KNOWN[key] = name
    return name


def model_name(path: Path, model_dirs: Sequence[str] = ()) -> str:
    """How the model file ``path`` is named to the user: its store name, else its file name
    without ``.gguf``."""
    return store_name_for(path, model_dirs) or path.stem


def bare_store_model(spec: str, model_dirs: Sequence[str] = ()) -> LocalModel | None:
    """The store model ``spec`` names without its store prefix ("gemma3:270m" for
    "ollama:gemma3:270m", "tiny" for "ollama:tiny:latest"); None when no store holds one. Two
    stores holding one of that name is a KvchatError naming both."""
    wanted = spec.strip()
    if not wanted:
        return None
    found = [m for m in discover(model_dirs) if not m.name.startswith("folder:")]
    matches = [m for m in found if _bare(m.name) in (wanted, f"{wanted}:latest")]
    if len(matches) > 1:
        names = ", ".join(m.name for m in matches)
        raise KvchatError(f"{spec!r} names more than one model here: {names}; give one of them")
    return matches[0] if matches else None


def _bare(name: str) -> str:
    return name.split(":", 1)[1] if ":" in name else name


def nearest(spec: str, names: Iterable[str]) -> str | None:
    """The known name closest to ``spec`` (None when none is close): compared with and
    without the store prefix, ignoring case."""
    by_key: dict[str, str] = {}
    for name in names:
        by_key.setdefault(name.lower(), name)
        by_key.setdefault(_bare(name).lower(), name)
        if name.endswith(":latest"):
            by_key.setdefault(_bare(name)[: -len(":latest")].lower(), name)
    close = difflib.get_close_matches(spec.strip().lower(), list(by_key), n=1, cutoff=0.6)
    return by_key[close[0]] if close else None


def suggestion(spec: str, names: Iterable[str]) -> str:
    """ "; did you mean 'NAME'?" for the nearest known name, else ""."""
    near = nearest(spec, names)
    return f"; did you mean {near!r}?" if near is not None and near != spec else ""


def store_names(model_dirs: Sequence[str] = ()) -> list[str]:
    """The names of the usable models in other apps' stores (for suggestions)."""
    return [m.name for m in discover(model_dirs) if m.usable and not m.name.startswith("folder:")]


__all__ = [
    "bare_store_model",
    "model_name",
    "nearest",
    "store_name_for",
    "store_names",
    "suggestion",
]
