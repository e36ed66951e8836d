"""Advisory file locks: one opener migrates a database at a time, one turn per session.

The locks (``kvchat.system``'s: ``flock`` on POSIX, ``filelock`` elsewhere) vanish when the
process dies (a ``kill -9`` leaves nothing to clean up). The lock files are created by kvchat (0600) inside its data
directory, with names derived from session ids that kvchat generated, never from text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.paths import ensure_private_dir
from kvchat.system import LockBusy, current

_SESSION_ID = re.compile(r"[0-9a-f]{1,64}")


class SessionBusy(KvchatError):
    """Another process holds the session's turn lock."""


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created 0600 if missing), waiting for it."""
    with current().hold_lock(path, wait_s=None):
        yield


class SessionLocks:
    """Per-session turn locks under ``<data dir>/locks``; a turn holds its session's lock."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, session_id: str) -> Path:
        if not _SESSION_ID.fullmatch(session_id):
            raise KvchatError(f"not a session id: {session_id!r}")
        return self.directory / f"{session_id}.lock"

    @contextmanager
    def hold(self, session_id: str, wait_s: float = 3.0) -> Iterator[None]:
        """Hold the session's lock for a turn; wait up to ``wait_s``, then say who has it."""
        ensure_private_dir(self.directory)
        with ExitStack() as stack:
            try:
                lock = stack.enter_context(current().hold_lock(self.path(session_id), wait_s))
            except LockBusy as busy:
                raise SessionBusy(
                    f"session {session_id} is busy: {busy.holder or 'another process'} is "
                    "running a turn on it; try again when it has finished"
                ) from None
            lock.note(f"process {os.getpid()}")  # who holds it, for the busy message
            yield

    def remove(self, session_id: str) -> None:
        """Forget a deleted session's lock file (only a file kvchat named)."""
        try:
            current().remove_lock(self.path(session_id))
        except KvchatError:
            pass
