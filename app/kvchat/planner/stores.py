"""GGUF models already on this machine, in the stores other apps keep (read only).

People who run Ollama, LM Studio, Jan or GPT4All, or who downloaded GGUFs with
``huggingface-hub`` or llama.cpp, have gigabytes of models on disk. kvchat lists them where
they are and loads them from there: nothing is copied, moved or written in those folders.

| store | where (the variable that moves it) | named |
| --- | --- | --- |
| Ollama | ``~/.ollama/models`` (``OLLAMA_MODELS``): manifests name blobs | ``ollama:NAME:TAG`` |
| LM Studio | ``~/.lmstudio/models``, ``~/.cache/lm-studio/models`` | ``lmstudio:PUBLISHER/REPO/FILE`` |
| Hugging Face cache | ``~/.cache/huggingface/hub`` (``HF_HUB_CACHE``, ``HF_HOME``) | ``hf:ORG/REPO/FILE`` |
| llama.cpp cache | ``~/.cache/llama.cpp`` (``LLAMA_CACHE``) | ``llama.cpp:FILE`` |
| GPT4All | ``~/.local/share/nomic.ai/GPT4All`` | ``gpt4all:FILE`` |
| Jan | ``~/jan/models``, ``~/.local/share/Jan/data`` | ``jan:PATH`` |
| your folders | the ``model_dirs`` setting | ``folder:PATH`` |

A split GGUF (``…-00001-of-00003.gguf``) is one model, named by its first part (llama.cpp
loads the rest from beside it). What cannot be used — a blob a manifest names that is not
there, a file that is not GGUF yet (a download under way), a missing part, a folder that
cannot be read — is listed with the reason instead. So is what kvchat will not read: a
link that leads outside the store, a FIFO or device, an oversized or too deeply nested
manifest (:mod:`kvchat.planner.store_files` reads every store file, bounded); one such entry
costs its own line, never the listing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from kvchat.planner.store_files import (
    MAX_JSON_BYTES,
    StoreFileError,
    inside,
    load_json,
    read_head,
    regular_size,
)

GGUF_MAGIC = b"GGUF"
# Store name prefixes of model names: "ollama:qwen3:8b".
PREFIXES = ("ollama", "lmstudio", "hf", "llama.cpp", "gpt4all", "jan", "folder")
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# Folders deeper than this below a store's root are not searched (a store is a few levels).
MAX_DEPTH = 6
# Manifests and other small JSON files larger than this are not read.
MAX_MANIFEST_BYTES = MAX_JSON_BYTES
# Entries (files and folders) looked at below one store's root; past it, one line says so.
MAX_ENTRIES = 50_000
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class LocalModel:
    """A model found in another app's store: where it is, or why it cannot be used."""

    name: str  # what --model takes: "ollama:qwen3:8b"
    store: str  # "Ollama", "LM Studio", ...
    path: Path | None  # the GGUF (a split model's first part); None: not usable
    size_bytes: int = 0
    problem: str | None = None

    @property
    def usable(self) -> bool:
        return self.path is not None and self.problem is None


def store_roots(extra: Sequence[str] = ()) -> list[tuple[str, str, Path]]:
    """(store, name prefix, folder) for every store kvchat looks in, present or not."""
    home = Path.home()
    hf_home = Path(os.environ.get("HF_HOME") or home / ".cache" / "huggingface")
    roots = [
        ("Ollama", "ollama", Path(os.environ.get("OLLAMA_MODELS") or home / ".ollama" / "models")),
        ("LM Studio", "lmstudio", home / ".lmstudio" / "models"),
        ("LM Studio", "lmstudio", home / ".cache" / "lm-studio" / "models"),
        ("Hugging Face cache", "hf", Path(os.environ.get("HF_HUB_CACHE") or hf_home / "hub")),
        (
            "llama.cpp cache",
            "llama.cpp",
            Path(os.environ.get("LLAMA_CACHE") or home / ".cache" / "llama.cpp"),
        ),
        ("GPT4All", "gpt4all", home / ".local" / "share" / "nomic.ai" / "GPT4All"),
        ("Jan", "jan", home / "jan" / "models"),
        ("Jan", "jan", home / ".local" / "share" / "Jan" / "data"),
    ]
    roots += [("your folder", "folder", Path(folder).expanduser()) for folder in extra]
    return roots


def discover(extra: Sequence[str] = ()) -> list[LocalModel]:
    """Every model in the stores on this machine (and the ``extra`` folders), by name."""
    found: dict[str, LocalModel] = {}
    for store, prefix, root in store_roots(extra):
        if not root.is_dir():
            continue
        try:
            models = list(_ollama(root) if prefix == "ollama" else _files(store, prefix, root))
        except OSError as exc:
            models = [LocalModel(f"{prefix}:{root}", store, None, problem=_why(root, exc))]
        except StoreFileError as exc:
            models = [LocalModel(f"{prefix}:{root}", store, None, problem=str(exc))]
        for model in models:
            found.setdefault(model.name, model)
    return sorted(found.values(), key=lambda m: m.name)


def find_local(name: str, extra: Sequence[str] = ()) -> LocalModel | None:
    """The model ``name`` ("ollama:qwen3:8b", "hf:org/repo/file.gguf") names, or None when
    ``name`` is no store name; a store name that matches nothing is None too."""
    prefix = name.split(":", 1)[0]
    if prefix not in PREFIXES or ":" not in name:
        return None
    wanted = name if prefix != "ollama" or name.count(":") > 1 else f"{name}:latest"
    return next((m for m in discover(extra) if m.name == wanted), None)


def is_store_name(name: str) -> bool:
    return ":" in name and name.split(":", 1)[0] in PREFIXES


# --- Ollama -----------------------------------------------------------------------------------


def _ollama(root: Path) -> Iterator[LocalModel]:
    """Ollama keeps manifests (``manifests/HOST/NAMESPACE/NAME/TAG``, JSON) that name the
    model's blob by digest (``blobs/sha256-…``)."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for manifest in _walk(manifests, depth=4, base=root):
        if isinstance(manifest, LocalModel):  # a folder not searched, and why
            yield LocalModel(manifest.name, "Ollama", None, problem=manifest.problem)
            continue
        parts = manifest.relative_to(manifests).parts
        if len(parts) != 4:
            continue
        host, namespace, model, tag = parts
        if host == "registry.ollama.ai" and namespace == "library":
            name = f"ollama:{model}:{tag}"
        elif host == "registry.ollama.ai":
            name = f"ollama:{namespace}/{model}:{tag}"
        else:
            name = f"ollama:{host}/{namespace}/{model}:{tag}"
        yield _ollama_model(root, name, manifest)


def _ollama_model(root: Path, name: str, manifest: Path) -> LocalModel:
    try:
        parsed = load_json(manifest, root, MAX_MANIFEST_BYTES)
    except StoreFileError as exc:
        return LocalModel(name, "Ollama", None, problem=f"its manifest names no model layer: {exc}")
    layers = parsed.get("layers") if isinstance(parsed, dict) else None
    digest = next(
        (
            layer.get("digest")
            for layer in (layers if isinstance(layers, list) else [])
            if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER
        ),
        None,
    )
    if digest is None:
        return LocalModel(name, "Ollama", None, problem="its manifest names no model layer")
    if not isinstance(digest, str) or not re.fullmatch(r"sha256[:-][0-9a-f]{64}", digest):
        return LocalModel(
            name, "Ollama", None, problem=f"its manifest's digest is not one: {str(digest)[:80]!r}"
        )
    blob = root / "blobs" / digest.replace(":", "-")
    return _checked(name, "Ollama", blob, root)


# --- folders of GGUF files ----------------------------------------------------------------------


def _files(store: str, prefix: str, root: Path) -> Iterator[LocalModel]:
    """Every ``.gguf`` below ``root`` (split models once, by their first part)."""
    for path in _walk(root, depth=MAX_DEPTH, base=root, prefix=prefix):
        if isinstance(path, LocalModel):  # a folder not searched, and why
            yield LocalModel(path.name, store, None, problem=path.problem)
            continue
        if path.suffix.lower() != ".gguf":
            continue
        split = _SPLIT.match(path.name)
        if split and int(split["part"]) != 1:
            continue  # found through its first part
        yield _checked(_name(prefix, root, path), store, path, root)


def _name(prefix: str, root: Path, path: Path) -> str:
    relative = path.relative_to(root)
    if prefix == "hf":  # models--ORG--REPO/snapshots/REVISION/FILE
        parts = relative.parts
        if len(parts) >= 4 and parts[0].startswith("models--") and parts[1] == "snapshots":
            repo = parts[0][len("models--") :].replace("--", "/")
            return f"hf:{repo}/{'/'.join(parts[3:])}"
    if prefix in ("llama.cpp", "gpt4all") and len(relative.parts) == 1:
        return f"{prefix}:{path.name}"
    if prefix == "folder":
        return f"folder:{path}"
    return f"{prefix}:{relative.as_posix()}"


def _checked(name: str, store: str, path: Path, root: Path) -> LocalModel:
    """``path`` as a model, or why it is not one (yet): it must be a regular file inside the
    store's ``root`` once links are resolved, and start as a GGUF does."""
    try:
        size = regular_size(path, root)
        magic = read_head(path, root, 4)
    except StoreFileError as exc:
        return LocalModel(name, store, None, problem=str(exc))
    if magic != GGUF_MAGIC:
        return LocalModel(name, store, None, size, "not a GGUF file (a download under way?)")
    split = _SPLIT.match(path.name)
    if split:
        count = int(split["count"])
        if count > 999:
            return LocalModel(name, store, None, size, f"a split into {count} parts is not one")
        for part in range(2, count + 1):
            sibling = path.with_name(f"{split['stem']}-{part:05d}-of-{count:05d}.gguf")
            try:
                size += regular_size(sibling, root)
            except StoreFileError as exc:
                return LocalModel(
                    name, store, None, size, f"part {part} of {count} is missing ({exc})"
                )
    return LocalModel(name, store, path, size)


def _walk(
    root: Path, depth: int, base: Path, prefix: str = "ollama"
) -> Iterator[Path | LocalModel]:
    """What is below ``root`` but folders (files, links, FIFOs: the caller checks each), at
    most ``depth`` folders down, in name order. Folder links are followed only inside the
    store's ``base``, each folder once; a folder not searched is a :class:`LocalModel`
    saying why."""
    stack: list[tuple[Path, int]] = [(root, 0)]
    seen: set[tuple[int, int]] = set()
    looked = 0
    while stack:
        folder, level = stack.pop()
        try:
            st = folder.stat()
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(folder) as listing:
                names = [e.name for e in islice(listing, MAX_ENTRIES - looked + 1)]
        except OSError:
            if folder == root:
                raise
            continue
        looked += len(names)
        if looked > MAX_ENTRIES:
            yield LocalModel(
                f"{prefix}:{root}",
                "",
                None,
                problem=f"more than {MAX_ENTRIES} entries: the rest of {root} was not searched",
            )
            return
        for entry in (folder / n for n in sorted(names, reverse=True)):
            try:
                if not entry.is_dir():
                    yield entry
                elif level < depth:
                    if entry.is_symlink():
                        inside(entry, base)
                    stack.append((entry, level + 1))
            except StoreFileError as exc:
                relative = entry.relative_to(base).as_posix()
                yield LocalModel(f"{prefix}:{relative}", "", None, problem=f"folder {exc}")
            except OSError:
                continue


def _why(path: Path, exc: OSError) -> str:
    return f"cannot read {path}: {exc.strerror or exc}"


__all__ = ["LocalModel", "discover", "find_local", "is_store_name", "store_roots"]
