"""Advisory file locks: one opener migrates a database at a time, one turn per session.

``flock`` locks belong to an open file and vanish when the process dies (a ``kill -9``
leaves nothing to clean up). The lock files are created by kvchat (0600) inside its data
directory, with names derived from session ids that kvchat generated, never from text.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.paths import ensure_private_dir

_SESSION_ID = re.compile(r"[0-9a-f]{1,64}")


class SessionBusy(KvchatError):
    """Another process holds the session's turn lock."""


def _open_lock_file(path: Path) -> int:
    return os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created 0600 if missing), waiting for it."""
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    """What the holder wrote into the lock file: ``pid command``."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 200).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "another process"


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
        fd = _open_lock_file(self.path(session_id))
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise SessionBusy(
                            f"session {session_id} is busy: {_holder(fd)} is running a turn "
                            "on it; try again when it has finished"
                        ) from None
                    time.sleep(0.05)
            try:  # who holds it, for the busy message; a full disk may refuse: the lock holds
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"process {os.getpid()}".encode(), 0)
            except OSError:
                pass
            yield
        finally:
            os.close(fd)

    def remove(self, session_id: str) -> None:
        """Forget a deleted session's lock file (only a file kvchat named)."""
        try:
            self.path(session_id).unlink(missing_ok=True)
        except (OSError, KvchatError):
            pass
