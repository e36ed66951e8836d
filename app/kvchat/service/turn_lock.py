"""Holding a session's turn lock as a turn does: waiting a little for a turn running in
another process, then a clear error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvchat.errors import KvchatError
from kvchat.service.checks import os_error_line
from kvchat.store.locks import SessionLocks

# How long a turn waits for another process's turn on the same session before giving up.
LOCK_WAIT_S = 3.0


@contextmanager
def turn_lock(locks: SessionLocks, session_id: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the session's turn lock (see :class:`kvchat.store.locks.SessionLocks`): another
    process's turn on it raises ``SessionBusy`` after ``wait_s``; a lock file that cannot be
    made raises a KvchatError that names a full disk as such."""
    try:
        held = locks.hold(session_id, wait_s)
        held.__enter__()
    except OSError as exc:
        raise KvchatError(os_error_line(f"cannot lock session {session_id}", exc)) from None
    try:
        yield
    finally:
        held.__exit__(None, None, None)
