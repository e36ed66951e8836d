"""The exceptions of the snapshot code: a snapshot that can't be trusted, and a snapshot
directory kvchat refuses to write to."""

from __future__ import annotations


class SnapshotRejected(Exception):
    """A snapshot (or one of its files) failed a check; ``reason`` is shown to the user.

    Raised where the problem is found; :meth:`SnapshotStore.restore` catches it and
    falls back to a full prefill, reporting the reason.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SnapshotsUnavailable(OSError):
    """Snapshots cannot be written here (the directory is a symlink, not a directory, or a
    name would not be one kvchat derives from a key). An :class:`OSError`, so a failed save
    is reported like any other I/O failure: the turn goes on without a snapshot."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason
