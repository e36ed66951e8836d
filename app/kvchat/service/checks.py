"""What the service checks: room on the disk, an engine handed to it, two paths to one file."""

from __future__ import annotations

import errno
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvchat.engine import Engine
from kvchat.errors import KvchatError
from kvchat.store import Store

# disk_full is the store's (it names SQLite's "disk I/O error" on a full disk as such).
from kvchat.store.connection import disk_full as disk_full
from kvchat.store.store import DamagedDatabase, StoreFull


def open_store(database: Path) -> Store:
    """The store at ``database``, or one clear line for why it cannot open (a full disk
    named as such: SQLite reports a disk with no room for its shared-memory file as an I/O
    error)."""
    try:
        return Store(database)
    except OSError as exc:
        raise KvchatError(os_error_line("cannot open the database", exc)) from None
    except (StoreFull, DamagedDatabase):
        raise
    except KvchatError as exc:
        if disk_full(database.parent):
            raise StoreFull(f"the disk is full: cannot open the database ({exc})") from None
        raise


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


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (the paths compared when either cannot resolve)."""
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b


def os_error_line(what: str, exc: OSError) -> str:
    """One line for an OSError, naming a full disk as such."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full: {what} ({exc.strerror})"
    return f"{what}: {exc.strerror or exc}"
