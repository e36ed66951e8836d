"""What the service checks before it starts: room on the disk, an engine handed to it."""

from __future__ import annotations

import errno
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvchat.engine import Engine

# Free space below which a disk counts as full (SQLite needs a few pages to open a file).
FULL_BELOW_BYTES = 64 * 1024


def check_engine_config(engine: Engine, wanted: Any, explicit: set[str]) -> None:
    """An engine handed to the service must be on the same model file and have every
    context setting these settings set (flags, environment, config file, arguments).

    What the settings leave to the planner is the engine's: a plan made now could differ
    from the one the engine was opened with (on a GPU, the engine itself uses the memory
    the planner measures).
    """
    have = engine.config
    differ = [
        f"{f.name}={getattr(have, f.name)!r} (wanted {getattr(wanted, f.name)!r})"
        for f in fields(wanted)
        if (f.name == "model_path" or f.name in explicit)
        and getattr(have, f.name) != getattr(wanted, f.name)
    ]
    if differ:
        raise ValueError(f"the engine given to ChatService has other settings: {', '.join(differ)}")


def disk_full(directory: Path) -> bool:
    """Whether the filesystem holding ``directory`` (or its nearest parent) has no room."""
    for place in (directory, *directory.parents):
        try:
            stat = os.statvfs(place)
        except OSError:
            continue
        return stat.f_bavail * stat.f_frsize < FULL_BELOW_BYTES
    return False


def os_error_line(what: str, exc: OSError) -> str:
    """One line for an OSError, naming a full disk as such."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full: {what} ({exc.strerror})"
    return f"{what}: {exc.strerror or exc}"
